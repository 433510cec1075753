//! Asking one worker's engine what `kvc-router check` reports, each call within the check's
//! deadline: its models (`GET /v1/models`, which also tells whether it is up), its load
//! source (`/metrics` read by [`crate::engine_load`]: pool, block size, prefix caching), its
//! KV-event source (configured, or `GET /kv_event_sources` read by [`crate::discovery`], and
//! whether the sockets accept a connection), whether its answers count cached prompt tokens
//! (one request of one token) and the P/D role it says it has (`GET /server_info`).

use super::WorkerCheck;
use crate::config::{RouterConfig, WorkerConfig, WorkerUrl};
use crate::worker_http::{Call, WorkerClient};
use kvc_core::{EngineKind, WorkerRole};
use serde_json::Value;
use std::time::Duration;

/// What the probes of one worker share.
pub(super) struct Probe<'a> {
    pub(super) client: &'a WorkerClient,
    pub(super) router: &'a RouterConfig,
    pub(super) timeout: Duration,
}

impl Probe<'_> {
    /// Everything the check says of worker `w`; `out` holds its facts and findings.
    pub(super) async fn worker(&self, w: &WorkerConfig, out: &mut WorkerCheck) {
        let http = w.http_url.as_deref().and_then(|u| WorkerUrl::parse(u).ok());
        match &http {
            Some(url) => {
                if !self.models(url, out).await {
                    return;
                }
            }
            None => out.fact("http-url", "none: the HTTP front forwards nothing to it"),
        }
        self.state(w, out).await;
        self.events(w, http.as_ref(), out).await;
        if let Some(url) = &http {
            if w.engine == Some(EngineKind::Vllm) {
                self.cached_tokens(url, out).await;
            }
            self.role(w, url, out).await;
        }
    }

    /// `GET /v1/models`: the served models. `false` when the engine cannot be reached (the
    /// rest is not asked).
    async fn models(&self, url: &WorkerUrl, out: &mut WorkerCheck) -> bool {
        match self.client.get(url, "/v1/models", self.timeout).await {
            Ok(a) if a.status == 200 => match crate::discovery::parse_models(&a.body) {
                Some(ids) => {
                    out.fact("model", ids.join(", "));
                    out.models = ids;
                }
                None => out.warning(format!(
                    "GET {} answered something that is not OpenAI's model list: {}",
                    url.uri("/v1/models"),
                    excerpt(&a.body)
                )),
            },
            Ok(a) => out.warning(format!(
                "GET {} answered HTTP {}: is this an OpenAI-compatible server?",
                url.uri("/v1/models"),
                a.status
            )),
            Err(e) => {
                out.fact("engine", "unreachable");
                out.problem(format!(
                    "unreachable: GET {}: {e}: start the engine, or give its address",
                    url.uri("/v1/models")
                ));
                return false;
            }
        }
        true
    }

    /// Where the worker's load comes from, and for an engine's `/metrics` what it reports.
    async fn state(&self, w: &WorkerConfig, out: &mut WorkerCheck) {
        if let Some(path) = &w.snapshot {
            match std::fs::metadata(path) {
                Ok(_) => out.fact("state", format!("snapshot {}", path.display())),
                Err(e) => out.problem(format!(
                    "snapshot {}: {e}: the worker is out of rotation until its writer creates \
                     the file",
                    path.display()
                )),
            }
            return;
        }
        if let Some(addr) = &w.address {
            out.fact("state", format!("kvc.v1.Worker service at {addr}"));
            return;
        }
        let (Some(metrics), Some(kind)) = (&w.metrics_url, w.engine) else {
            return;
        };
        let Ok(url) = WorkerUrl::parse(metrics) else {
            return;
        };
        let load = match self.client.get(&url, "", self.timeout).await {
            Ok(a) if a.status == 200 => std::str::from_utf8(&a.body)
                .map_err(|e| format!("not UTF-8 text: {e}"))
                .and_then(|t| {
                    crate::engine_load::parse_engine_load(kind, t).map_err(|e| e.to_string())
                }),
            Ok(a) => Err(format!("HTTP {}", a.status)),
            Err(e) => Err(e.to_string()),
        };
        let load = match load {
            Ok(l) => l,
            Err(e) => {
                let fix = match kind {
                    EngineKind::Vllm => "is this vLLM's /metrics (metrics-url)?",
                    EngineKind::Sglang => "start SGLang with --enable-metrics",
                };
                out.problem(format!(
                    "GET {metrics}: {e}: the worker is out of rotation without its load; {fix}"
                ));
                return;
            }
        };
        match (load.pool_tokens, load.block_size) {
            (Some(tokens), Some(bs)) if bs > 0 => out.fact(
                "KV pool",
                format!(
                    "{} blocks of {bs} tokens ({tokens} tokens)",
                    tokens / u64::from(bs)
                ),
            ),
            (Some(tokens), _) => out.fact("KV pool", format!("{tokens} tokens")),
            (None, _) if w.pool_from_engine() => out.problem(format!(
                "{metrics} reports no pool size (vllm:cache_config_info): set capacity-tokens"
            )),
            (None, _) => out.fact(
                "KV pool",
                format!("{} tokens (configured)", w.capacity_tokens),
            ),
        }
        if let Some(pool) = load.pool_tokens
            && w.capacity_tokens > 0
            && pool != w.capacity_tokens
        {
            out.warning(format!(
                "the engine's KV pool is {pool} tokens, capacity-tokens says {}: the router \
                 uses the engine's; leave capacity-tokens out",
                w.capacity_tokens
            ));
        }
        if let (Some(set), Some(engine)) = (w.block_size, load.block_size)
            && set != engine
        {
            out.problem(format!(
                "block-size is {set} but the engine's blocks are {engine} tokens: its events \
                 would be read wrong; leave block-size out"
            ));
        }
        match load.prefix_caching {
            Some(true) => out.fact("prefix caching", "on"),
            Some(false) => {
                out.fact("prefix caching", "off");
                out.problem(crate::discovery::PREFIX_CACHING_OFF);
            }
            None => {}
        }
    }

    /// The KV-event source: configured, read from the engine, or none (a problem for an
    /// engine whose state is read from its `/metrics`: the router cannot see which sessions
    /// it holds; a worker with a snapshot or a `kvc.v1.Worker` service reports them itself).
    async fn events(&self, w: &WorkerConfig, http: Option<&WorkerUrl>, out: &mut WorkerCheck) {
        if w.engine.is_none() {
            return;
        }
        let listening = self.router.kv_events_listen.is_some();
        if let Some(endpoint) = &w.kv_events {
            out.fact("KV events", format!("{endpoint} (configured)"));
            self.reachable("KV events", endpoint, out).await;
            match &w.kv_events_replay {
                Some(replay) => {
                    out.fact("event replay", replay.clone());
                    self.reachable("event replay", replay, out).await;
                }
                None => no_replay(out),
            }
            return;
        }
        if w.listens_for_events(listening) {
            out.fact(
                "KV events",
                format!(
                    "the engine connects to the router's kv-events-listen {}",
                    self.router.kv_events_listen.as_deref().unwrap_or_default()
                ),
            );
            match &w.kv_events_replay {
                Some(replay) => out.fact("event replay", replay.clone()),
                None => no_replay(out),
            }
            return;
        }
        let Some(url) = http.filter(|_| w.discovers_events()) else {
            if w.snapshot.is_some() || w.address.is_some() {
                // Its residency comes with its state, from kvc's own publisher.
                out.fact("KV events", "none (residency read with its state)");
                return;
            }
            out.fact("KV events", "none");
            out.problem(
                "no KV events: the router cannot see which sessions the engine holds; set \
                 kv-events (and kv-events-replay) in its [[workers]] entry, or give it engine = \
                 \"vllm\" and its http-url alone so that the engine says where they are",
            );
            return;
        };
        let answer = self
            .client
            .get(url, "/kv_event_sources", self.timeout)
            .await;
        let found = match answer {
            Ok(a) if a.status == 200 => {
                crate::discovery::parse_event_sources(&a.body, &url.host, listening)
                    .map_err(|e| e.to_string())
            }
            Ok(a) if a.status == 404 => Err(crate::discovery::NO_EVENT_SOURCES_ROUTE.to_owned()),
            Ok(a) => Err(format!("GET /kv_event_sources answered HTTP {}", a.status)),
            Err(e) => Err(format!("GET /kv_event_sources: {e}")),
        };
        let found = match found {
            Ok(d) => d,
            Err(e) => {
                out.fact("KV events", "unknown");
                out.problem(e);
                return;
            }
        };
        let Some(source) = found.source else {
            out.fact("KV events", "none (GET /kv_event_sources)");
            for w in found.warnings {
                out.problem(format!("no KV events: {w}"));
            }
            return;
        };
        let topic = match source.topic.as_str() {
            "" => String::new(),
            t => format!(", topic {t}"),
        };
        let endpoints: Vec<String> = source
            .ranks
            .iter()
            .map(|r| {
                let at = r
                    .endpoint
                    .as_deref()
                    .unwrap_or("the router's kv-events-listen");
                match source.ranks.len() {
                    1 => at.to_owned(),
                    _ => format!("rank {} {at}", r.rank),
                }
            })
            .collect();
        out.fact(
            "KV events",
            format!(
                "{} (from GET /kv_event_sources{topic})",
                endpoints.join(", ")
            ),
        );
        let replays: Vec<&str> = source
            .ranks
            .iter()
            .filter_map(|r| r.replay.as_deref())
            .collect();
        out.fact(
            "event replay",
            match replays.is_empty() {
                true => "not offered".to_owned(),
                false => replays.join(", "),
            },
        );
        for r in &source.ranks {
            if let Some(e) = &r.endpoint {
                self.reachable("KV events", e, out).await;
            }
            if let Some(e) = &r.replay {
                self.reachable("event replay", e, out).await;
            }
        }
        for w in found.warnings {
            out.warning(w);
        }
    }

    /// Whether a ZeroMQ endpoint the engine binds takes a connection (a tcp one within the
    /// deadline; an ipc one: its file exists).
    async fn reachable(&self, what: &str, endpoint: &str, out: &mut WorkerCheck) {
        let failed = if let Some(path) = endpoint.strip_prefix("ipc://") {
            std::fs::metadata(path).err().map(|e| e.to_string())
        } else if let Some(addr) = endpoint.strip_prefix("tcp://") {
            let addr = addr.trim_start_matches('[').replace("]:", ":");
            let connect = match addr.rsplit_once(':') {
                Some((h, p)) => match p.parse::<u16>() {
                    Ok(port) => Some(tokio::net::TcpStream::connect((h.to_owned(), port))),
                    Err(_) => None,
                },
                None => None,
            };
            match connect {
                None => Some("not host:port".to_owned()),
                Some(c) => match tokio::time::timeout(self.timeout, c).await {
                    Ok(Ok(_)) => None,
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some(format!("no connection within {:?}", self.timeout)),
                },
            }
        } else {
            None
        };
        if let Some(e) = failed {
            out.problem(format!(
                "{what} at {endpoint}: {e}: the engine does not publish there (its \
                 --kv-events-config endpoint and replay_endpoint)"
            ));
        }
    }

    /// One request of one token: whether the answer counts its cached prompt tokens.
    async fn cached_tokens(&self, url: &WorkerUrl, out: &mut WorkerCheck) {
        let mut body = serde_json::json!({"prompt": "kvc-router check", "max_tokens": 1});
        if let Some(model) = out.models.first() {
            body["model"] = Value::String(model.clone());
        }
        let call = Call {
            base: url.clone(),
            path: "/v1/completions",
            headers: &[],
            body: body.to_string().into(),
            timeout: self.timeout,
        };
        let what = format!("a one-token POST {}", url.uri("/v1/completions"));
        match self.client.post_whole(call).await {
            Ok(a) if a.status == 200 => {
                let v: Value = serde_json::from_slice(&a.body).unwrap_or(Value::Null);
                match kvc_core::openai::cached_tokens_of(&v) {
                    Some(n) => out.fact(
                        "cached tokens",
                        format!("reported (usage.prompt_tokens_details.cached_tokens = {n})"),
                    ),
                    None => {
                        out.fact("cached tokens", "not reported");
                        out.warning(crate::discovery::NO_CACHED_TOKENS);
                    }
                }
            }
            Ok(a) => out.warning(format!(
                "{what} answered HTTP {}: {}",
                a.status,
                excerpt(&a.body)
            )),
            Err(e) => out.warning(format!("{what}: {e}")),
        }
    }

    /// The P/D role the engine says it has (`GET /server_info`), against the configured one.
    async fn role(&self, w: &WorkerConfig, url: &WorkerUrl, out: &mut WorkerCheck) {
        let answer = self
            .client
            .get(url, "/server_info?config_format=json", self.timeout)
            .await;
        let said = match &answer {
            Ok(a) if a.status == 200 => serde_json::from_slice::<Value>(&a.body)
                .ok()
                .as_ref()
                .and_then(said_role),
            _ => None,
        };
        let Some(said) = said else {
            if w.engine == Some(EngineKind::Vllm) {
                let why = match &answer {
                    Ok(a) if a.status == 404 => "not said by the engine (vLLM says it at \
                         /server_info only with VLLM_SERVER_DEV_MODE=1)"
                        .to_owned(),
                    Ok(a) if a.status == 200 => {
                        "not said by the engine (its /server_info names no configuration)"
                            .to_owned()
                    }
                    Ok(a) => format!("not said: GET /server_info answered {}", a.status),
                    // A CPU engine builds its first /server_info answer slowly (seconds).
                    Err(e) => format!(
                        "not said: GET /server_info: {e} (an engine's first answer there can \
                         take seconds: run check again, or raise --timeout-ms)"
                    ),
                };
                out.fact("P/D role", why);
            }
            return;
        };
        out.fact("P/D role", said.said.clone());
        if !said.roles.contains(&w.role) {
            out.problem(format!(
                "configured as a {} worker but the engine says {}: give it with its role \
                 (--prefill, --decode or --worker; `role` in a file), or restart the engine \
                 with the role it should have (vLLM: --kv-transfer-config kv_role; SGLang: \
                 --disaggregation-mode)",
                w.role, said.said
            ));
        }
    }
}

fn no_replay(out: &mut WorkerCheck) {
    out.fact("event replay", "not offered");
    out.warning(
        "no event replay: every missed event resets the worker's index; set kv-events-replay \
         (vLLM: \"replay_endpoint\":\"tcp://*:5558\" in --kv-events-config)",
    );
}

/// The P/D role an engine states of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SaidRole {
    /// The worker roles that fit it.
    pub(super) roles: Vec<WorkerRole>,
    /// What it said, as an operator reads it.
    pub(super) said: String,
}

/// The role in a `/server_info` answer: vLLM's (`vllm_config.kv_transfer_config`: `kv_role`
/// and `kv_connector`; none: no P/D) or SGLang's (`disaggregation_mode`, with
/// `disaggregation_transfer_backend`); `None` when it says neither.
pub(super) fn said_role(v: &Value) -> Option<SaidRole> {
    use WorkerRole::{Colocated, Decode, Prefill};
    if let Some(cfg) = v.get("vllm_config").filter(|c| c.is_object()) {
        let kv = cfg.get("kv_transfer_config").filter(|k| k.is_object());
        let Some(kv) = kv else {
            return Some(SaidRole {
                roles: vec![Colocated],
                said: "no kv_transfer_config (no P/D connector)".into(),
            });
        };
        let role = kv.get("kv_role").and_then(Value::as_str).unwrap_or("");
        let connector = kv
            .get("kv_connector")
            .and_then(Value::as_str)
            .unwrap_or("?");
        let roles = match role {
            "kv_producer" => vec![Prefill, Colocated],
            "kv_consumer" => vec![Decode, Colocated],
            _ => vec![Prefill, Decode, Colocated],
        };
        return Some(SaidRole {
            roles,
            said: format!("kv_role {role}, kv_connector {connector}"),
        });
    }
    let mode = v.get("disaggregation_mode")?.as_str()?;
    let roles = match mode {
        "prefill" => vec![Prefill],
        "decode" => vec![Decode],
        "null" | "" => vec![Colocated],
        _ => return None,
    };
    let backend = v
        .get("disaggregation_transfer_backend")
        .and_then(Value::as_str)
        .map_or(String::new(), |b| format!(", transfer backend {b}"));
    Some(SaidRole {
        roles,
        said: format!("disaggregation_mode {mode}{backend}"),
    })
}

/// The start of an answer's body, on one line.
fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match line.char_indices().nth(160) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn vllm_and_sglang_roles_are_read_and_silence_is_none() {
        let producer = json!({"vllm_config": {"kv_transfer_config":
            {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}}});
        let r = said_role(&producer).unwrap();
        assert_eq!(r.said, "kv_role kv_producer, kv_connector NixlConnector");
        assert!(r.roles.contains(&WorkerRole::Prefill) && !r.roles.contains(&WorkerRole::Decode));
        let both = json!({"vllm_config": {"kv_transfer_config":
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"}}});
        assert_eq!(said_role(&both).unwrap().roles.len(), 3);
        let plain = json!({"vllm_config": {"kv_transfer_config": null}});
        assert_eq!(said_role(&plain).unwrap().roles, [WorkerRole::Colocated]);
        let sglang = json!({"disaggregation_mode": "decode",
                            "disaggregation_transfer_backend": "mooncake"});
        let r = said_role(&sglang).unwrap();
        assert_eq!(r.roles, [WorkerRole::Decode]);
        assert_eq!(
            r.said,
            "disaggregation_mode decode, transfer backend mooncake"
        );
        // vLLM's text form and servers that say nothing of a role.
        assert_eq!(said_role(&json!({"vllm_config": "model='m' ..."})), None);
        assert_eq!(said_role(&json!({"version": "0.11"})), None);
    }

    #[test]
    fn excerpts_are_one_short_line() {
        assert_eq!(excerpt(b"a\n  b\tc"), "a b c");
        let long = "x ".repeat(200);
        assert_eq!(excerpt(long.as_bytes()).chars().count(), 161);
    }
}
