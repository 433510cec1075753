//! What a simulated vLLM worker says of itself on its own HTTP port, as a stock vLLM server
//! does, so that a router given nothing but the worker's URL reads the rest from it:
//!
//! | Route | |
//! |---|---|
//! | `GET /metrics` | the worker's state under vLLM's names ([`render_vllm`]): load, pool use, `vllm:cache_config_info` (block size, pool in blocks, prefix caching on) |
//! | `GET /kv_event_sources` | vLLM 0.32's answer keyed by data-parallel rank: the worker's event publisher as the engine binds it (`tcp://*:PORT`, with its replay socket and topic); `{}` when it publishes no events (workers started without engine signals), as a vLLM started without `--kv-events-config` answers |

use super::sglang::{WorkerContext, json_response};
use crate::publish::engine_signals::render_vllm;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

/// The routes of this module, for a vLLM worker's server.
pub(super) fn routes() -> axum::Router<Arc<WorkerContext>> {
    axum::Router::new()
        .route("/metrics", axum::routing::get(metrics))
        .route("/kv_event_sources", axum::routing::get(event_sources))
}

async fn metrics(State(ctx): State<Arc<WorkerContext>>) -> Response {
    let state = ctx.board.lock().get(ctx.id.0 as usize).copied();
    match state {
        Some(s) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            render_vllm(&s, &ctx.shared.model),
        )
            .into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn event_sources(State(ctx): State<Arc<WorkerContext>>) -> Response {
    json_response(StatusCode::OK, &sources_answer(ctx.events.as_ref()))
}

/// The `/kv_event_sources` answer for a worker publishing at `events` (none: `{}`).
fn sources_answer(events: Option<&crate::publish::engine_signals::EngineEndpoints>) -> Value {
    let Some(e) = events else {
        return json!({});
    };
    // The engine binds every interface; a subscriber replaces `*` with the worker's host.
    let bound = |endpoint: &str| match endpoint.rsplit_once(':') {
        Some((_, port)) => Value::String(format!("tcp://*:{port}")),
        None => Value::Null,
    };
    let replay = if e.kv_events_replay.is_empty() {
        Value::Null
    } else {
        bound(&e.kv_events_replay)
    };
    json!({ "0": {
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": bound(&e.kv_events),
        "replay_endpoint": replay,
        "topic": e.kv_events_topic,
    }})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::engine_signals::EngineEndpoints;

    #[test]
    fn the_publisher_is_answered_as_vllm_binds_it_and_none_as_an_empty_object() {
        let e = EngineEndpoints {
            metrics_url: "http://127.0.0.1:9/metrics".into(),
            kv_events: "tcp://127.0.0.1:41001".into(),
            kv_events_replay: "tcp://127.0.0.1:41002".into(),
            kv_events_topic: "kv@w1@kvc-sim".into(),
        };
        let v = sources_answer(Some(&e));
        assert_eq!(v["0"]["endpoint"], "tcp://*:41001");
        assert_eq!(v["0"]["replay_endpoint"], "tcp://*:41002");
        assert_eq!(v["0"]["topic"], "kv@w1@kvc-sim");
        assert_eq!(v["0"]["publisher"], "zmq");
        assert_eq!(sources_answer(None), json!({}));
    }
}
