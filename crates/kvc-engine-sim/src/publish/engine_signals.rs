//! The simulated workers as a stock vLLM engine shows itself to a router: each worker serves
//! Prometheus `/metrics` with vLLM's metric names on its own loopback port and publishes its
//! KV-cache events over ZeroMQ (PUB plus a replay ROUTER, vLLM's framing and map-shaped
//! events with `session_id`, from [`super::kv_events`]), so a router can run with its state
//! read from the engines (`engine = "vllm"`, `metrics-url`, `kv-events`) and no snapshot.
//!
//! | series | value |
//! |---|---|
//! | `vllm:num_requests_running` | requests prefilling or decoding on the worker |
//! | `vllm:num_requests_waiting` | requests queued |
//! | `vllm:kv_cache_usage_perc` | pool share held by requests (used − evictable; a session's idle KV is free room to vLLM's prefix cache) |
//! | `vllm:cache_config_info` | labels `block_size` ([`ENGINE_BLOCK_TOKENS`]), `enable_prefix_caching` (`True`) and `num_gpu_blocks` (the pool in such blocks) |

use super::kv_events::EventSource;
use crate::WorkerError;
use crate::model::Engine;
use axum::routing::get;
use kvc_core::WorkerState;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The block (page) size the simulated engines report, in tokens (vLLM's default).
pub const ENGINE_BLOCK_TOKENS: u64 = 16;

/// The `model_name` label of the simulated engines.
pub const MODEL_NAME: &str = "kvc-sim";

/// Where a router finds one simulated engine's signals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineEndpoints {
    /// Its `/metrics` URL.
    pub metrics_url: String,
    /// Its event PUB endpoint, `tcp://127.0.0.1:PORT`.
    pub kv_events: String,
    /// Its event replay ROUTER endpoint.
    pub kv_events_replay: String,
    /// The topic of its events.
    pub kv_events_topic: String,
}

/// The `/metrics` servers and event publishers of every worker.
#[derive(Debug)]
pub(crate) struct EngineSignals {
    addrs: Vec<SocketAddr>,
    events: EventSource,
    publishers: Vec<kvc_events::Publisher>,
    rt: tokio::runtime::Handle,
    /// Publishing failed once (said once; the replay goes on without events).
    publish_failed: bool,
}

impl EngineSignals {
    /// Serves `/metrics` for the workers of `board` (worker `i` on `127.0.0.1:<base + i>`, or
    /// a free port when `base` is `None`) and binds each worker's event publisher (free ports),
    /// on `rt` until `stop` is cancelled; `model` is the `model_name` label, `trace_block` the
    /// trace's tokens per block.
    pub(crate) fn serve(
        rt: &tokio::runtime::Handle,
        board: super::StateBoard,
        base: Option<u16>,
        model: &str,
        trace_block: u64,
        stop: &CancellationToken,
    ) -> Result<Self, WorkerError> {
        let n = board.lock().len();
        let mut addrs = Vec::with_capacity(n);
        for i in 0..n {
            let port = base.map_or(0, |b| b.saturating_add(i as u16));
            let listener = rt
                .block_on(tokio::net::TcpListener::bind(("127.0.0.1", port)))
                .map_err(|e| {
                    WorkerError::Serve(format!("cannot serve worker {i}'s /metrics: {e}"))
                })?;
            addrs.push(
                listener
                    .local_addr()
                    .map_err(|e| WorkerError::Serve(e.to_string()))?,
            );
            let board = Arc::clone(&board);
            let model = model.to_owned();
            let app = axum::Router::new().route(
                "/metrics",
                get(move || {
                    let state = board.lock().get(i).copied();
                    let model = model.clone();
                    async move { state.map(|s| render_vllm(&s, &model)).unwrap_or_default() }
                }),
            );
            let stop = stop.child_token();
            rt.spawn(async move {
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(stop.cancelled_owned())
                    .await;
            });
        }
        let mut publishers = Vec::with_capacity(n);
        for i in 0..n {
            let cfg = kvc_events::PublisherConfig {
                replay_endpoint: Some("tcp://127.0.0.1:0".into()),
                topic: topic(i),
                ..kvc_events::PublisherConfig::new("tcp://127.0.0.1:0")
            };
            let publisher = rt
                .block_on(kvc_events::Publisher::bind(cfg, stop.child_token()))
                .map_err(|e| WorkerError::Serve(format!("worker {i}'s KV events: {e}")))?;
            publishers.push(publisher);
        }
        Ok(EngineSignals {
            addrs,
            events: EventSource::new(n, trace_block),
            publishers,
            rt: rt.clone(),
            publish_failed: false,
        })
    }

    /// Names sessions in the events by the keys in `labels` (standalone workers).
    pub(crate) fn label_sessions(&mut self, labels: crate::publish::SessionLabels) {
        self.events.label_sessions(labels);
    }

    /// Publishes what every worker's cache gained and lost since the last call (`now_s`: wall
    /// time, seconds since the epoch); the board is the publisher's, already updated.
    pub(crate) fn update(&mut self, engine: &Engine, now_s: f64) {
        let batches = self.events.diff(engine, now_s);
        for (publisher, batch) in self.publishers.iter().zip(batches) {
            if batch.events.is_empty() {
                continue;
            }
            if let Err(e) = self.rt.block_on(publisher.publish(&batch))
                && !self.publish_failed
            {
                self.publish_failed = true;
                eprintln!("kvc-replay live: KV events not published: {e}");
            }
        }
    }

    /// Every worker's endpoints, by id.
    pub(crate) fn endpoints(&self) -> Vec<EngineEndpoints> {
        self.addrs
            .iter()
            .zip(&self.publishers)
            .enumerate()
            .map(|(i, (a, p))| EngineEndpoints {
                metrics_url: format!("http://{a}/metrics"),
                kv_events: p.endpoint().to_owned(),
                kv_events_replay: p.replay_endpoint().unwrap_or_default().to_owned(),
                kv_events_topic: topic(i),
            })
            .collect()
    }
}

/// The event topic of worker `i` (vLLM's `kv@<pod>@<model>` convention).
fn topic(i: usize) -> String {
    format!("kv@w{i}@{MODEL_NAME}")
}

/// The vLLM-named exposition of one worker's state.
pub fn render_vllm(s: &WorkerState, model: &str) -> String {
    let labels = format!("engine=\"0\",model_name=\"{}\"", model.replace('"', "'"));
    let held = s
        .used_tokens
        .saturating_sub(s.evictable_tokens)
        .min(s.capacity_tokens);
    let usage = if s.capacity_tokens == 0 {
        0.0
    } else {
        held as f64 / s.capacity_tokens as f64
    };
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, value: f64| {
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {value:?}\n"
        );
    };
    gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        f64::from(s.in_flight),
    );
    gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        f64::from(s.queue_depth),
    );
    gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        usage,
    );
    let _ = write!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{ENGINE_BLOCK_TOKENS}\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0\n",
        s.capacity_tokens / ENGINE_BLOCK_TOKENS
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvc_core::Health;

    #[test]
    fn the_exposition_carries_vllm_names_and_the_held_share() {
        let s = WorkerState {
            capacity_tokens: 1_600,
            used_tokens: 1_000,
            evictable_tokens: 200,
            queue_depth: 3,
            in_flight: 2,
            resident_sessions: 4,
            health: Health::Healthy,
            state_age_ms: 0,
        };
        let text = render_vllm(&s, "qwen");
        assert!(text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"qwen\"} 2.0\n"));
        assert!(text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"qwen\"} 3.0\n"));
        assert!(text.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"qwen\"} 0.5\n"));
        assert!(text.contains("num_gpu_blocks=\"100\"} 1.0\n"));
        assert!(text.contains("block_size=\"16\""));
    }
}
