//! KV-cache event sources read from a vLLM engine (`GET /kv_event_sources`), for a worker
//! configured with `engine = "vllm"` and `http-url` but no `kv-events`.
//!
//! vLLM (0.32 and later) answers with each data-parallel rank's publisher configuration, keyed
//! by rank: `{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
//! "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv@pod@model", …}}`, and `{}`
//! from an engine started without `--kv-events-config`. The engine binds a wildcard or `ipc://`
//! endpoint (its address for subscribers is then the worker's host) and *connects* to a
//! `tcp://HOST:PORT` one, which a router that connects to engines cannot use.
//!
//! [`parse_event_sources`] is pure: it turns the answer into the source to subscribe to and
//! what an operator should hear about it. Each worker's progress (attempts, backoff, the last
//! problem, logged when it changes, and what was found) is its `DiscoveryState`.

use crate::workers::KvEventsSource;
use serde_json::Value;
use std::time::Duration;

/// What a `/kv_event_sources` answer says about subscribing to the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Discovered {
    /// The stream to subscribe to (the lowest data-parallel rank's), if there is a usable one.
    pub(crate) source: Option<KvEventsSource>,
    /// What the operator should know (no events, no replay, other ranks not indexed, …),
    /// each naming the fix.
    pub(crate) warnings: Vec<String>,
}

/// Why an answer could not be read as vLLM's `/kv_event_sources`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DiscoveryError {
    /// The answer is not the JSON object vLLM sends.
    #[error("GET /kv_event_sources answered {0}")]
    Garbage(String),
}

/// Reads a `/kv_event_sources` body; `host` is the worker's HTTP host, which replaces a
/// wildcard bind host.
pub(crate) fn parse_event_sources(body: &[u8], host: &str) -> Result<Discovered, DiscoveryError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| DiscoveryError::Garbage(format!("something that is not JSON ({e})")))?;
    let Value::Object(ranks) = value else {
        return Err(DiscoveryError::Garbage(format!(
            "JSON that is not an object keyed by data-parallel rank: {}",
            short(&value)
        )));
    };
    let mut by_rank = Vec::with_capacity(ranks.len());
    for (rank, cfg) in &ranks {
        let Ok(n) = rank.parse::<u32>() else {
            return Err(DiscoveryError::Garbage(format!(
                "a key `{rank}` that is not a data-parallel rank"
            )));
        };
        if !cfg.is_object() {
            return Err(DiscoveryError::Garbage(format!(
                "rank {n}'s entry that is not an object: {}",
                short(cfg)
            )));
        }
        by_rank.push((n, cfg));
    }
    by_rank.sort_by_key(|(n, _)| *n);
    let mut warnings = Vec::new();
    let Some(&(rank, cfg)) = by_rank.first() else {
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
    };
    if by_rank.len() > 1 {
        let others: Vec<String> = by_rank[1..].iter().map(|(n, _)| n.to_string()).collect();
        warnings.push(format!(
            "the engine runs {} data-parallel ranks; only rank {rank}'s events are indexed \
             (ranks {} are not: configure one worker per rank with its own kv-events)",
            by_rank.len(),
            others.join(", ")
        ));
    }
    let enabled = cfg["enable_kv_cache_events"].as_bool().unwrap_or(false);
    let publisher = cfg["publisher"].as_str().unwrap_or("");
    if !enabled || publisher != "zmq" {
        warnings.push(format!(
            "rank {rank}'s events are off (enable_kv_cache_events {enabled}, publisher \
             `{publisher}`): set \"enable_kv_cache_events\":true and \"publisher\":\"zmq\" \
             in --kv-events-config"
        ));
        return Ok(Discovered {
            source: None,
            warnings,
        });
    }
    let Some(endpoint) = cfg["endpoint"].as_str() else {
        return Err(DiscoveryError::Garbage(format!(
            "rank {rank} without an `endpoint` string"
        )));
    };
    let endpoint = match subscribable(endpoint, host) {
        Ok(e) => e,
        Err(why) => {
            warnings.push(format!("rank {rank}'s event endpoint `{endpoint}` {why}"));
            return Ok(Discovered {
                source: None,
                warnings,
            });
        }
    };
    let replay = match cfg["replay_endpoint"].as_str() {
        None => {
            warnings.push(format!(
                "rank {rank} has no replay endpoint: every missed event resets the worker's \
                 index; add \"replay_endpoint\":\"tcp://*:5558\" to --kv-events-config"
            ));
            None
        }
        Some(r) => match replay_address(r, host) {
            Some(r) => Some(r),
            None => {
                warnings.push(format!(
                    "rank {rank}'s replay endpoint `{r}` is not tcp://host:port or ipc://path; \
                     missed events reset the worker's index"
                ));
                None
            }
        },
    };
    Ok(Discovered {
        source: Some(KvEventsSource {
            endpoint,
            replay,
            topic: cfg["topic"].as_str().unwrap_or("").to_owned(),
            block_size: None,
        }),
        warnings,
    })
}

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

/// The address to connect a SUB socket to for an engine's `endpoint`, or why there is none.
fn subscribable(endpoint: &str, host: &str) -> Result<String, String> {
    if endpoint.starts_with("ipc://") {
        return Ok(endpoint.to_owned());
    }
    let Some((bind_host, port)) = tcp_parts(endpoint) else {
        return Err("is not tcp://host:port or ipc://path".to_owned());
    };
    if is_wildcard(bind_host) {
        Ok(format!("tcp://{}:{port}", bracketed(host)))
    } else {
        Err(format!(
            "makes the engine connect to a subscriber that binds there (vLLM binds only a \
             wildcard or ipc endpoint); the router connects to engines: start vLLM with \
             \"endpoint\":\"tcp://*:{port}\""
        ))
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

    #[test]
    fn a_wildcard_bind_becomes_the_workers_host() {
        let d = parse_event_sources(
            vllm("tcp://*:5557", Some("tcp://*:5558")).as_bytes(),
            "10.0.0.7",
        )
        .unwrap();
        let s = d.source.unwrap();
        assert_eq!(s.endpoint, "tcp://10.0.0.7:5557");
        assert_eq!(s.replay.as_deref(), Some("tcp://10.0.0.7:5558"));
        assert_eq!(s.topic, "kv@d0@m");
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        let v6 = parse_event_sources(vllm("tcp://0.0.0.0:1", None).as_bytes(), "::1").unwrap();
        assert_eq!(v6.source.unwrap().endpoint, "tcp://[::1]:1");
        assert_eq!(v6.warnings.len(), 1);
        assert!(
            v6.warnings[0].contains("no replay endpoint"),
            "{:?}",
            v6.warnings
        );
    }

    #[test]
    fn ipc_endpoints_are_kept_and_a_connect_endpoint_is_refused_with_the_fix() {
        let d = parse_event_sources(
            vllm("ipc:///tmp/e.sock", Some("ipc:///tmp/r.sock")).as_bytes(),
            "127.0.0.1",
        )
        .unwrap();
        let s = d.source.unwrap();
        assert_eq!(
            (s.endpoint.as_str(), s.replay.as_deref()),
            ("ipc:///tmp/e.sock", Some("ipc:///tmp/r.sock"))
        );
        let c = parse_event_sources(
            vllm("tcp://router:5557", Some("tcp://*:5558")).as_bytes(),
            "h",
        )
        .unwrap();
        assert_eq!(c.source, None);
        assert!(c.warnings[0].contains("tcp://*:5557"), "{:?}", c.warnings);
    }

    #[test]
    fn no_events_events_off_and_several_ranks_are_said() {
        let none = parse_event_sources(b"{}", "h").unwrap();
        assert_eq!(none.source, None);
        assert!(none.warnings[0].contains("--kv-events-config"));
        let off = parse_event_sources(
            br#"{"0": {"enable_kv_cache_events": false, "publisher": "null", "endpoint": "tcp://*:1"}}"#,
            "h",
        )
        .unwrap();
        assert_eq!(off.source, None);
        assert!(
            off.warnings[0].contains("events are off"),
            "{:?}",
            off.warnings
        );
        let two = br#"{"1": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5560", "topic": ""},
                       "0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5559", "topic": ""}}"#;
        let d = parse_event_sources(two, "h").unwrap();
        assert_eq!(d.source.unwrap().endpoint, "tcp://h:5557");
        assert_eq!(d.warnings.len(), 1);
        assert!(
            d.warnings[0].contains("2 data-parallel ranks"),
            "{:?}",
            d.warnings
        );
    }

    #[test]
    fn answers_that_are_not_vllms_are_errors_naming_what_came() {
        for (body, says) in [
            (&b"<html>404</html>"[..], "not JSON"),
            (b"[1, 2]", "not an object"),
            (b"{\"zero\": {}}", "`zero`"),
            (b"{\"0\": 5}", "rank 0's entry"),
            (
                br#"{"0": {"enable_kv_cache_events": true, "publisher": "zmq"}}"#,
                "without an `endpoint`",
            ),
        ] {
            let e = parse_event_sources(body, "h").unwrap_err();
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
