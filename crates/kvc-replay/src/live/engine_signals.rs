//! The simulated workers as a stock vLLM engine shows itself to a router: each worker serves
//! Prometheus `/metrics` with vLLM's metric names on its own loopback port, so a router can
//! run with its state read from the engines (`engine = "vllm"`, `metrics-url`) and no
//! snapshot.
//!
//! | series | value |
//! |---|---|
//! | `vllm:num_requests_running` | requests prefilling or decoding on the worker |
//! | `vllm:num_requests_waiting` | requests queued |
//! | `vllm:kv_cache_usage_perc` | pool share held by requests (used − evictable; a session's idle KV is free room to vLLM's prefix cache) |
//! | `vllm:cache_config_info` | labels `block_size` ([`ENGINE_BLOCK_TOKENS`]) and `num_gpu_blocks` (the pool in such blocks) |

use crate::live::LiveError;
use crate::sim::engine::Engine;
use axum::routing::get;
use kvc_core::{WorkerId, WorkerState};
use parking_lot::Mutex;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The block (page) size the simulated engines report, in tokens (vLLM's default).
pub const ENGINE_BLOCK_TOKENS: u64 = 16;

/// The `model_name` label of the simulated engines.
pub const MODEL_NAME: &str = "kvc-sim";

/// The `/metrics` servers of every worker and the states they report.
#[derive(Debug)]
pub(crate) struct EngineSignals {
    board: Arc<Mutex<Vec<WorkerState>>>,
    addrs: Vec<SocketAddr>,
}

impl EngineSignals {
    /// Serves `/metrics` for `states.len()` workers (worker `i` on `127.0.0.1:<base + i>`, or a
    /// free port when `base` is `None`) on `rt` until `stop` is cancelled; `model` is the
    /// `model_name` label.
    pub(crate) fn serve(
        rt: &tokio::runtime::Handle,
        states: Vec<WorkerState>,
        base: Option<u16>,
        model: &str,
        stop: &CancellationToken,
    ) -> Result<Self, LiveError> {
        let board = Arc::new(Mutex::new(states));
        let n = board.lock().len();
        let mut addrs = Vec::with_capacity(n);
        for i in 0..n {
            let port = base.map_or(0, |b| b.saturating_add(i as u16));
            let listener = rt
                .block_on(tokio::net::TcpListener::bind(("127.0.0.1", port)))
                .map_err(|e| {
                    LiveError::Router(format!("cannot serve worker {i}'s /metrics: {e}"))
                })?;
            addrs.push(
                listener
                    .local_addr()
                    .map_err(|e| LiveError::Router(e.to_string()))?,
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
        Ok(EngineSignals { board, addrs })
    }

    /// Takes every worker's state from `engine`.
    pub(crate) fn update(&self, engine: &Engine) {
        let mut board = self.board.lock();
        for (i, s) in board.iter_mut().enumerate() {
            *s = engine.state(WorkerId(i as u32));
        }
    }

    /// `http://127.0.0.1:<port>/metrics` of every worker, by id.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.addrs
            .iter()
            .map(|a| format!("http://{a}/metrics"))
            .collect()
    }
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
         vllm:cache_config_info{{block_size=\"{ENGINE_BLOCK_TOKENS}\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0\n",
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
