//! KV-cache event sources read from a vLLM engine (`GET /kv_event_sources`), for a worker
//! configured with `engine = "vllm"` and `http-url` but no `kv-events`.
//!
//! vLLM answers with each data-parallel rank's publisher, in one of the shapes its versions
//! use (all are read): vLLM 0.32's object keyed by rank, each entry the rank's publisher
//! configuration (`{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
//! "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv@pod@model", …}}`, `{}`
//! without `--kv-events-config`); later versions' list of the enabled publishers, bare or
//! under `"sources"`, each with its `data_parallel_rank` (`[{"data_parallel_rank": 0,
//! "endpoint": …, "replay_endpoint": …, "topic": …}]`). vLLM offsets a rank's ports by the
//! rank (`5557 + r`); the answer gives each rank's own. The engine binds a wildcard (`*`,
//! `::`) or `ipc://` endpoint (its address for subscribers is then the worker's host) and
//! *connects* to a `tcp://HOST:PORT` one: such a rank is read through the router's
//! `kv-events-listen` socket when it has one, and is refused (with the fix) otherwise.
//!
//! [`parse_event_sources`] is pure: it turns the answer into the sources to subscribe to,
//! one per rank, and what an operator should hear about it. Each worker's progress
//! (attempts, backoff, the last problem, logged when it changes, and what was found) is its
//! `DiscoveryState`. The other things an engine says that an operator must hear about (a
//! model other than the fleet's, prefix caching off, answers without cached-token counts)
//! are worded here too, once, for the router's log and for `kvc-router check`.

use crate::workers::{KvEventsSource, RankSource};
use serde_json::{Map, Value};
use std::time::Duration;

/// What a `/kv_event_sources` answer says about subscribing to the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Discovered {
    /// The streams to read, one per usable data-parallel rank, if there is any.
    pub(crate) source: Option<KvEventsSource>,
    /// What the operator should know (no events, no replay, a rank that cannot be read, …),
    /// each naming the fix.
    pub(crate) warnings: Vec<String>,
}

/// Why an answer could not be read as vLLM's `/kv_event_sources`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DiscoveryError {
    /// The answer is not the JSON vLLM sends.
    #[error("GET /kv_event_sources answered {0}")]
    Garbage(String),
}

/// Each rank of an answer with its entry.
type Ranks<'a> = Vec<(u32, &'a Map<String, Value>)>;

/// The sources of a list answer, each with its rank (absent: 0).
fn listed(items: &[Value]) -> Result<Ranks<'_>, DiscoveryError> {
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let Some(cfg) = item.as_object() else {
            return Err(DiscoveryError::Garbage(format!(
                "source {i} that is not an object: {}",
                short(item)
            )));
        };
        let rank = match cfg.get("data_parallel_rank") {
            None | Some(Value::Null) => 0,
            Some(r) => r
                .as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or_else(|| {
                    DiscoveryError::Garbage(format!(
                        "source {i} whose data_parallel_rank is not a rank: {}",
                        short(r)
                    ))
                })?,
        };
        out.push((rank, cfg));
    }
    Ok(out)
}

/// The ranks of an answer, in any of its shapes, sorted by rank.
fn ranks_of(value: &Value) -> Result<Ranks<'_>, DiscoveryError> {
    let entry = |rank: u32, cfg: &'_ Value| -> Result<(), DiscoveryError> {
        if cfg.is_object() {
            Ok(())
        } else {
            Err(DiscoveryError::Garbage(format!(
                "rank {rank}'s entry that is not an object: {}",
                short(cfg)
            )))
        }
    };
    let mut by_rank = match value {
        Value::Array(items) => listed(items)?,
        Value::Object(o) if o.len() == 1 && o.get("sources").is_some_and(Value::is_array) => {
            listed(o["sources"].as_array().map_or(&[][..], Vec::as_slice))?
        }
        Value::Object(ranks) => {
            let mut out = Vec::with_capacity(ranks.len());
            for (rank, cfg) in ranks {
                let Ok(n) = rank.parse::<u32>() else {
                    return Err(DiscoveryError::Garbage(format!(
                        "a key `{rank}` that is not a data-parallel rank"
                    )));
                };
                entry(n, cfg)?;
                out.push((n, cfg.as_object().expect("checked")));
            }
            out
        }
        other => {
            return Err(DiscoveryError::Garbage(format!(
                "JSON that is neither an object keyed by data-parallel rank nor a list of \
                 sources: {}",
                short(other)
            )));
        }
    };
    by_rank.sort_by_key(|(n, _)| *n);
    if let Some(w) = by_rank.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(DiscoveryError::Garbage(format!(
            "data-parallel rank {} twice",
            w[0].0
        )));
    }
    Ok(by_rank)
}

/// Reads a `/kv_event_sources` body; `host` is the worker's HTTP host, which replaces a
/// wildcard bind host; `listening`: the router binds a `kv-events-listen` socket, so a rank
/// that connects out is read there.
pub(crate) fn parse_event_sources(
    body: &[u8],
    host: &str,
    listening: bool,
) -> Result<Discovered, DiscoveryError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| DiscoveryError::Garbage(format!("something that is not JSON ({e})")))?;
    let by_rank = ranks_of(&value)?;
    let mut warnings = Vec::new();
    if by_rank.is_empty() {
        warnings.push(
            "the engine publishes no KV-cache events (started without --kv-events-config): \
             the router cannot see which sessions it holds; start vLLM with \
             --kv-events-config '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\
             \"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}'"
                .to_owned(),
        );
        return Ok(Discovered {
            source: None,
            warnings,
        });
    }
    let mut ranks = Vec::with_capacity(by_rank.len());
    let mut topic = None;
    for (rank, cfg) in by_rank {
        // The list shapes name only enabled ZeroMQ publishers; vLLM 0.32's says it.
        let enabled = cfg
            .get("enable_kv_cache_events")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let publisher = cfg
            .get("publisher")
            .and_then(Value::as_str)
            .unwrap_or("zmq");
        if !enabled || publisher != "zmq" {
            warnings.push(format!(
                "rank {rank}'s events are off (enable_kv_cache_events {enabled}, publisher \
                 `{publisher}`): set \"enable_kv_cache_events\":true and \"publisher\":\"zmq\" \
                 in --kv-events-config"
            ));
            continue;
        }
        let Some(endpoint) = cfg.get("endpoint").and_then(Value::as_str) else {
            return Err(DiscoveryError::Garbage(format!(
                "rank {rank} without an `endpoint` string"
            )));
        };
        let endpoint = match subscribable(endpoint, host) {
            Ok(e) => Some(e),
            Err(Unusable::ConnectsOut) if listening => None,
            Err(why) => {
                warnings.push(format!(
                    "rank {rank}'s event endpoint `{endpoint}` {}",
                    why.explain(endpoint)
                ));
                continue;
            }
        };
        let replay = match cfg.get("replay_endpoint").and_then(Value::as_str) {
            None => {
                warnings.push(format!(
                    "rank {rank} has no replay endpoint: every missed event resets its \
                     index; add \"replay_endpoint\":\"tcp://*:5558\" to --kv-events-config"
                ));
                None
            }
            Some(r) => match replay_address(r, host) {
                Some(r) => Some(r),
                None => {
                    warnings.push(format!(
                        "rank {rank}'s replay endpoint `{r}` is not tcp://host:port or \
                         ipc://path; missed events reset its index"
                    ));
                    None
                }
            },
        };
        topic.get_or_insert_with(|| {
            cfg.get("topic")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        });
        ranks.push(RankSource {
            rank,
            endpoint,
            replay,
        });
    }
    Ok(Discovered {
        source: (!ranks.is_empty()).then(|| KvEventsSource {
            ranks,
            topic: topic.unwrap_or_default(),
            block_size: None,
        }),
        warnings,
    })
}

/// What an engine that does not answer `GET /kv_event_sources` (404) is told.
pub(crate) const NO_EVENT_SOURCES_ROUTE: &str = "GET /kv_event_sources answered 404: the \
     engine is not vLLM 0.32 or later; set kv-events (and kv-events-replay, kv-events-topic) \
     in its [[workers]] entry";

/// What a vLLM engine running without prefix caching is warned with.
pub(crate) const PREFIX_CACHING_OFF: &str = "the engine runs with prefix caching off \
     (cache_config_info enable_prefix_caching=\"False\"): it reuses no session's KV, so \
     every turn it serves is computed in full; start vLLM without --no-enable-prefix-caching";

/// What an engine whose answers carry no cached-token count is warned with.
pub(crate) const NO_CACHED_TOKENS: &str = "the engine's answers carry no \
     usage.prompt_tokens_details.cached_tokens: start vLLM with \
     --enable-prompt-tokens-details, or the router cannot tell a direct-to-D turn that missed \
     the worker's cache (direct-cache-miss)";

/// The model ids of a `GET /v1/models` answer (OpenAI's list shape), `None` for anything else.
pub(crate) fn parse_models(body: &[u8]) -> Option<Vec<String>> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let ids: Vec<String> = v["data"]
        .as_array()?
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .collect();
    (!ids.is_empty()).then_some(ids)
}

/// For each worker's served models (empty: not known), the warning of one that serves none
/// of the fleet's model: the model most workers serve (ties: the one named first).
pub(crate) fn model_warnings(served: &[Vec<String>]) -> Vec<Option<String>> {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for ids in served {
        for id in ids {
            match counts.iter_mut().find(|(m, _)| m == id) {
                Some((_, n)) => *n += 1,
                None => counts.push((id, 1)),
            }
        }
    }
    let Some(&(fleet, _)) = counts.iter().rev().max_by_key(|(_, n)| *n) else {
        return vec![None; served.len()];
    };
    served
        .iter()
        .map(|ids| {
            (!ids.is_empty() && !ids.iter().any(|m| m == fleet)).then(|| {
                format!(
                    "the engine serves {} but the other workers serve `{fleet}`: a request \
                     for one model routed to it fails; give each model its own router",
                    ids.iter()
                        .map(|m| format!("`{m}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
        })
        .collect()
}

/// Why an engine's event endpoint cannot be subscribed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unusable {
    /// Not `tcp://host:port` or `ipc://path`.
    Form,
    /// `tcp://HOST:PORT`: the engine connects to a subscriber that binds there.
    ConnectsOut,
}

impl Unusable {
    fn explain(self, endpoint: &str) -> String {
        match self {
            Unusable::Form => "is not tcp://host:port or ipc://path".to_owned(),
            Unusable::ConnectsOut => {
                let port = tcp_parts(endpoint).map_or(5557, |(_, p)| p);
                format!(
                    "makes the engine connect to a subscriber that binds there (vLLM binds \
                     only a wildcard or ipc endpoint) and the router does not listen: start \
                     vLLM with \"endpoint\":\"tcp://*:{port}\", or give the router \
                     kv-events-listen = \"tcp://*:{port}\""
                )
            }
        }
    }
}

/// The address to connect a SUB socket to for an engine's `endpoint`, or why there is none.
fn subscribable(endpoint: &str, host: &str) -> Result<String, Unusable> {
    if endpoint.starts_with("ipc://") {
        return Ok(endpoint.to_owned());
    }
    let Some((bind_host, port)) = tcp_parts(endpoint) else {
        return Err(Unusable::Form);
    };
    if is_wildcard(bind_host) {
        Ok(format!("tcp://{}:{port}", bracketed(host)))
    } else {
        Err(Unusable::ConnectsOut)
    }
}

/// The address to ask for a replay at: a replay socket always binds, so a wildcard host is
/// the worker's and any other host is where it listens.
fn replay_address(endpoint: &str, host: &str) -> Option<String> {
    if endpoint.starts_with("ipc://") {
        return Some(endpoint.to_owned());
    }
    let (bind_host, port) = tcp_parts(endpoint)?;
    let host = if is_wildcard(bind_host) {
        bracketed(host)
    } else {
        bind_host.to_owned()
    };
    Some(format!("tcp://{host}:{port}"))
}

/// `tcp://HOST:PORT` split into the host (brackets kept) and a valid port.
fn tcp_parts(endpoint: &str) -> Option<(&str, u16)> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (h, p) = rest.rsplit_once(':')?;
    let port = p.parse::<u16>().ok().filter(|p| *p > 0)?;
    Some((h, port))
}

/// A bind host for every interface: vLLM binds an endpoint naming `*` or `::`; later
/// versions report a bound wildcard as `0.0.0.0`.
fn is_wildcard(host: &str) -> bool {
    matches!(host, "*" | "" | "0.0.0.0" | "[::]" | "::")
}

fn bracketed(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

fn short(v: &Value) -> String {
    let mut s = v.to_string();
    if s.len() > 120 {
        let cut = (0..=120)
            .rev()
            .find(|&i| s.is_char_boundary(i))
            .unwrap_or(0);
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// First wait after a failed attempt; doubled after each, up to [`RETRY_MAX`].
pub(crate) const RETRY_MIN: Duration = Duration::from_millis(500);
/// The longest wait between attempts, and the wait before asking again an engine that
/// answered it has no usable events (it may be restarted with them).
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(30);

/// How the next wait grows after a failed attempt.
pub(crate) fn next_wait(wait: Duration) -> Duration {
    (wait * 2).clamp(RETRY_MIN, RETRY_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm(endpoint: &str, replay: Option<&str>) -> String {
        let replay = replay.map_or("null".to_owned(), |r| format!("\"{r}\""));
        format!(
            "{{\"0\": {{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \
             \"endpoint\": \"{endpoint}\", \"replay_endpoint\": {replay}, \
             \"buffer_steps\": 10000, \"hwm\": 100000, \"max_queue_size\": 100000, \
             \"topic\": \"kv@d0@m\"}}}}"
        )
    }

    fn rank(d: &Discovered, i: usize) -> &RankSource {
        &d.source.as_ref().unwrap().ranks[i]
    }

    #[test]
    fn a_wildcard_bind_becomes_the_workers_host() {
        let d = parse_event_sources(
            vllm("tcp://*:5557", Some("tcp://*:5558")).as_bytes(),
            "10.0.0.7",
            false,
        )
        .unwrap();
        let s = d.source.as_ref().unwrap();
        assert_eq!(s.ranks.len(), 1);
        assert_eq!(rank(&d, 0).rank, 0);
        assert_eq!(rank(&d, 0).endpoint.as_deref(), Some("tcp://10.0.0.7:5557"));
        assert_eq!(rank(&d, 0).replay.as_deref(), Some("tcp://10.0.0.7:5558"));
        assert_eq!(s.topic, "kv@d0@m");
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        let v6 =
            parse_event_sources(vllm("tcp://0.0.0.0:1", None).as_bytes(), "::1", false).unwrap();
        assert_eq!(rank(&v6, 0).endpoint.as_deref(), Some("tcp://[::1]:1"));
        assert_eq!(v6.warnings.len(), 1);
        assert!(
            v6.warnings[0].contains("no replay endpoint"),
            "{:?}",
            v6.warnings
        );
    }

    #[test]
    fn ipc_endpoints_are_kept_and_a_connect_endpoint_is_refused_with_the_fix_unless_listening() {
        let d = parse_event_sources(
            vllm("ipc:///tmp/e.sock", Some("ipc:///tmp/r.sock")).as_bytes(),
            "127.0.0.1",
            false,
        )
        .unwrap();
        assert_eq!(
            (
                rank(&d, 0).endpoint.as_deref(),
                rank(&d, 0).replay.as_deref()
            ),
            (Some("ipc:///tmp/e.sock"), Some("ipc:///tmp/r.sock"))
        );
        let connect = vllm("tcp://router:5557", Some("tcp://*:5558"));
        let c = parse_event_sources(connect.as_bytes(), "h", false).unwrap();
        assert_eq!(c.source, None);
        assert!(c.warnings[0].contains("tcp://*:5557"), "{:?}", c.warnings);
        assert!(
            c.warnings[0].contains("kv-events-listen"),
            "{:?}",
            c.warnings
        );
        // A router that listens reads that rank on its own socket, replaying at the engine.
        let l = parse_event_sources(connect.as_bytes(), "h", true).unwrap();
        assert_eq!(rank(&l, 0).endpoint, None);
        assert_eq!(rank(&l, 0).replay.as_deref(), Some("tcp://h:5558"));
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
    }

    #[test]
    fn no_events_and_events_off_are_said() {
        let none = parse_event_sources(b"{}", "h", false).unwrap();
        assert_eq!(none.source, None);
        assert!(none.warnings[0].contains("--kv-events-config"));
        for empty in [&b"[]"[..], br#"{"sources": []}"#] {
            let d = parse_event_sources(empty, "h", false).unwrap();
            assert_eq!(d.source, None);
            assert!(d.warnings[0].contains("--kv-events-config"));
        }
        let off = parse_event_sources(
            br#"{"0": {"enable_kv_cache_events": false, "publisher": "null", "endpoint": "tcp://*:1"}}"#,
            "h",
            false,
        )
        .unwrap();
        assert_eq!(off.source, None);
        assert!(
            off.warnings[0].contains("events are off"),
            "{:?}",
            off.warnings
        );
    }

    #[test]
    fn every_data_parallel_rank_is_a_source_in_each_shape() {
        let keyed = br#"{"1": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5560", "topic": "kv@d@m"},
                         "0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5559", "topic": "kv@d@m"}}"#;
        let listed = br#"[{"data_parallel_rank": 1, "endpoint": "tcp://0.0.0.0:5558", "replay_endpoint": "tcp://0.0.0.0:5560", "topic": "kv@d@m"},
                         {"data_parallel_rank": 0, "endpoint": "tcp://0.0.0.0:5557", "replay_endpoint": "tcp://0.0.0.0:5559", "topic": "kv@d@m"}]"#;
        let wrapped = format!("{{\"sources\": {}}}", std::str::from_utf8(listed).unwrap());
        for body in [&keyed[..], listed, wrapped.as_bytes()] {
            let d = parse_event_sources(body, "h", false).unwrap();
            assert!(d.warnings.is_empty(), "{:?}", d.warnings);
            let got: Vec<(u32, Option<&str>, Option<&str>)> = d
                .source
                .as_ref()
                .unwrap()
                .ranks
                .iter()
                .map(|r| (r.rank, r.endpoint.as_deref(), r.replay.as_deref()))
                .collect();
            assert_eq!(
                got,
                [
                    (0, Some("tcp://h:5557"), Some("tcp://h:5559")),
                    (1, Some("tcp://h:5558"), Some("tcp://h:5560"))
                ]
            );
            assert_eq!(d.source.unwrap().topic, "kv@d@m");
        }
        // A rank that cannot be read is said and left out; the others are read.
        let mixed = br#"{"0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5559"},
                         "1": {"endpoint": "tcp://elsewhere:5558"}}"#;
        let d = parse_event_sources(mixed, "h", false).unwrap();
        assert_eq!(d.source.as_ref().unwrap().ranks.len(), 1);
        assert_eq!(rank(&d, 0).rank, 0);
        assert_eq!(d.warnings.len(), 1);
        assert!(
            d.warnings[0].starts_with("rank 1's event endpoint"),
            "{:?}",
            d.warnings
        );
    }

    #[test]
    fn answers_that_are_not_vllms_are_errors_naming_what_came() {
        for (body, says) in [
            (&b"<html>404</html>"[..], "not JSON"),
            (b"5", "neither an object"),
            (b"[1, 2]", "source 0 that is not an object"),
            (b"[{\"data_parallel_rank\": -1}]", "not a rank"),
            (b"{\"zero\": {}}", "`zero`"),
            (b"{\"0\": 5}", "rank 0's entry"),
            (
                br#"[{"data_parallel_rank": 0, "endpoint": "tcp://*:1"}, {"endpoint": "tcp://*:2"}]"#,
                "rank 0 twice",
            ),
            (
                br#"{"0": {"enable_kv_cache_events": true, "publisher": "zmq"}}"#,
                "without an `endpoint`",
            ),
        ] {
            let e = parse_event_sources(body, "h", false).unwrap_err();
            assert!(e.to_string().contains(says), "{e} lacks {says}");
        }
    }

    #[test]
    fn a_worker_serving_another_model_than_the_fleet_is_named() {
        assert_eq!(
            parse_models(br#"{"object":"list","data":[{"id":"kvc-tiny","object":"model"}]}"#),
            Some(vec!["kvc-tiny".to_owned()])
        );
        assert_eq!(parse_models(b"{}"), None);
        assert_eq!(parse_models(b"<html>"), None);
        let m = |ids: &[&str]| ids.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let w = model_warnings(&[m(&["a"]), m(&["a", "b"]), m(&["c"]), m(&[])]);
        assert_eq!(
            (w[0].is_some(), w[1].is_some(), w[3].is_some()),
            (false, false, false)
        );
        let third = w[2].as_deref().unwrap();
        assert!(
            third.contains("`c`") && third.contains("serve `a`"),
            "{third}"
        );
        // A tie goes to the model named first.
        let tie = model_warnings(&[m(&["x"]), m(&["y"])]);
        assert_eq!(tie[0], None);
        assert!(tie[1].as_deref().unwrap().contains("serve `x`"));
        assert_eq!(model_warnings(&[m(&[]), m(&[])]), [None, None]);
    }

    #[test]
    fn waits_double_within_bounds() {
        assert_eq!(next_wait(Duration::ZERO), RETRY_MIN);
        assert_eq!(next_wait(RETRY_MIN), RETRY_MIN * 2);
        assert_eq!(next_wait(RETRY_MAX), RETRY_MAX);
    }
}
