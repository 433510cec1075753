//! The SGLang HTTP API of a simulated worker: its routes, the informational answers, the
//! `/generate` body it reads and the shapes of its answers.

use super::bootstrap::BootstrapClient;
use super::generate::generate;
use super::state::SharedState;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvc_core::{WorkerId, WorkerRole};
use serde_json::{Value, json};
use std::sync::Arc;

/// One worker's server: who it is and what it reaches.
pub(super) struct WorkerContext {
    pub(super) id: WorkerId,
    pub(super) role: WorkerRole,
    pub(super) name: String,
    pub(super) shared: Arc<SharedState>,
    /// Asks prefill workers' bootstrap servers (decode workers only use it).
    pub(super) client: BootstrapClient,
    /// Its own HTTP address (a vLLM prefill worker names it in `remote_host`/`remote_port`).
    pub(super) addr: std::net::SocketAddr,
    /// Fault injection for tests (vLLM dialect).
    pub(super) faults: super::Faults,
    /// The decode side's P/D sidecar, when the workers run behind an endpoint picker.
    pub(super) pd_shim: Option<Arc<super::pd_shim::PdShim>>,
    /// Every worker's state as last published (its `/metrics`, vLLM dialect).
    pub(super) board: crate::publish::StateBoard,
    /// Where its KV-cache events are published, when they are (its `/kv_event_sources`).
    pub(super) events: Option<crate::publish::engine_signals::EngineEndpoints>,
}

/// The routes of one worker: SGLang's `/generate`, or (`vllm`) vLLM's OpenAI routes.
pub(super) fn worker_app(ctx: Arc<WorkerContext>, vllm: bool) -> Router {
    let api = if vllm {
        super::vllm::routes().merge(super::vllm_info::routes())
    } else {
        Router::new().route("/generate", post(generate))
    };
    api.route("/health", get(|| async { "ok" }))
        .route("/health_generate", get(|| async { "ok" }))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/v1/models", get(models))
        .route("/flush_cache", post(|| async { "ok" }))
        // The body is read before the 404, so a pooled client's connection stays usable (an
        // unread body closes it, and the client's next request on it fails).
        .fallback(|_body: axum::body::Bytes| async {
            error_response(StatusCode::NOT_FOUND, "not_found", "no such route")
        })
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
        .with_state(ctx)
}

/// A JSON answer.
pub(super) fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// One piece of a streamed answer: an event, or the stream's failure.
pub(super) type Chunk = Result<axum::body::Bytes, std::io::Error>;

/// A `200` Server-Sent Events answer relaying `events` as they come.
pub(super) fn event_stream(events: tokio::sync::mpsc::UnboundedReceiver<Chunk>) -> Response {
    let body =
        axum::body::Body::from_stream(tokio_stream::wrappers::UnboundedReceiverStream::new(events));
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/event-stream")],
        body,
    )
        .into_response()
}

/// A `503`: the engine has stopped.
pub(super) fn shutting_down() -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        "the worker is shutting down",
    )
}

/// A `400` for a request the worker cannot take.
pub(super) fn invalid(message: &str) -> Response {
    error_response(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// An error answer before it is written in the shape of the API a request came through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Refusal {
    pub(super) status: StatusCode,
    /// The OpenAI `error.type`.
    pub(super) kind: &'static str,
    pub(super) message: String,
}

impl Refusal {
    /// A `400` for a request the worker cannot take.
    pub(super) fn invalid(message: impl Into<String>) -> Self {
        Refusal {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
        }
    }

    /// A `400` for an input over the model's limit.
    pub(super) fn too_long(input: u64, max_input: u64) -> Self {
        Refusal {
            status: StatusCode::BAD_REQUEST,
            kind: "input_too_long",
            message: format!(
                "The input ({input} tokens) is longer than the model's context length \
                 ({max_input} tokens)."
            ),
        }
    }

    /// The answer in the OpenAI shape SGLang uses ([`error_response`]).
    pub(super) fn into_response(self) -> Response {
        error_response(self.status, self.kind, &self.message)
    }
}

/// The trace request in flight whose prompt is `text`, its first arrival (`arrived`: when the
/// worker held its whole body) recorded (`attempt`:
/// the worker serves or decodes it, so the attempt counts); else why not: `400` for a prompt
/// this replay has not in flight, or one longer than the model's input limit.
pub(super) fn find_prompt(
    ctx: &WorkerContext,
    text: &str,
    attempt: bool,
    arrived: std::time::Instant,
) -> Result<usize, Refusal> {
    let shared = &ctx.shared;
    let Some(index) = shared.find(crate::prompt::prompt_key(text)) else {
        return Err(Refusal::invalid(format!(
            "{}: unknown prompt (not one this replay has in flight)",
            ctx.name
        )));
    };
    shared.with_served(index, |s| {
        s.arrived = Some(s.arrived.map_or(arrived, |a| a.min(arrived)));
        if attempt {
            s.attempts += 1;
        }
    });
    let r = &shared.script.requests[index];
    if r.input_length > shared.max_input {
        return Err(Refusal::too_long(r.input_length, shared.max_input));
    }
    Ok(index)
}

/// An error in the OpenAI shape SGLang uses: `{"error": {"message", "type", "code"}}`.
pub(super) fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    json_response(
        status,
        &json!({ "error": { "message": message, "type": kind, "code": status.as_u16() } }),
    )
}

async fn server_info(State(ctx): State<Arc<WorkerContext>>) -> Response {
    let mode = match ctx.role {
        WorkerRole::Prefill => "prefill",
        WorkerRole::Decode => "decode",
        WorkerRole::Colocated => "null",
    };
    json_response(
        StatusCode::OK,
        &json!({
            "model_path": ctx.shared.model,
            "served_model_name": ctx.shared.model,
            "disaggregation_mode": mode,
            "max_total_num_tokens": ctx.shared.pool_tokens,
            "context_length": ctx.shared.max_input,
            "worker": ctx.name,
        }),
    )
}

async fn model_info(State(ctx): State<Arc<WorkerContext>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({ "model_path": ctx.shared.model, "is_generation": true }),
    )
}

async fn models(State(ctx): State<Arc<WorkerContext>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({ "object": "list", "data": [{ "id": ctx.shared.model, "object": "model" }] }),
    )
}

/// The parts of a `/generate` body the simulated worker uses.
#[derive(Debug)]
pub(super) struct GenerateBody {
    /// The prompt.
    pub(super) text: String,
    pub(super) max_new_tokens: Option<u64>,
    pub(super) stream: bool,
    /// `bootstrap_room`: set on both legs of a P→D request.
    pub(super) room: Option<u64>,
    /// `bootstrap_host` and `bootstrap_port`: the prefill worker's bootstrap server.
    pub(super) bootstrap: Option<(String, u16)>,
}

/// An optional unsigned field of a body (absent or `null`: `None`); the error names `field`.
pub(super) fn optional_u64(value: Option<&Value>, field: &str) -> Result<Option<u64>, String> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(n) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("`{field}` must be an unsigned integer")),
    }
}

/// A body's `stream` flag (absent or `null`: not streamed).
pub(super) fn stream_flag(obj: &serde_json::Map<String, Value>) -> Result<bool, String> {
    match obj.get("stream") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err("`stream` must be a boolean".into()),
    }
}

impl GenerateBody {
    /// Reads a `/generate` body; the error says what is wrong with it.
    pub(super) fn parse(bytes: &[u8]) -> Result<GenerateBody, String> {
        let v: Value =
            serde_json::from_slice(bytes).map_err(|e| format!("the body is not JSON: {e}"))?;
        let obj = v.as_object().ok_or("the body must be a JSON object")?;
        let text = match obj.get("text") {
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err("`text` must be a string".into()),
            None => return Err("this worker takes `text` prompts (no `text` field)".into()),
        };
        let max_new_tokens = optional_u64(
            obj.get("sampling_params")
                .and_then(|s| s.get("max_new_tokens")),
            "sampling_params.max_new_tokens",
        )?;
        let stream = stream_flag(obj)?;
        let room = optional_u64(obj.get("bootstrap_room"), "bootstrap_room")?;
        let bootstrap = match (obj.get("bootstrap_host"), obj.get("bootstrap_port")) {
            (Some(Value::String(h)), Some(p)) => {
                let port = p
                    .as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .ok_or("`bootstrap_port` must be a port number")?;
                Some((h.clone(), port))
            }
            _ => None,
        };
        Ok(GenerateBody {
            text,
            max_new_tokens,
            stream,
            room,
            bootstrap,
        })
    }
}

/// SGLang's `meta_info` of trace request `index`: `completion` tokens so far, the finish
/// reason once `done`.
pub(super) fn meta_info(
    index: usize,
    prompt: u64,
    completion: u64,
    cached: u64,
    done: bool,
) -> Value {
    let finish = if done {
        json!({ "type": "length", "length": completion })
    } else {
        Value::Null
    };
    json!({
        "id": format!("r{index}"),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "finish_reason": finish,
    })
}

/// The generated text of `n` tokens: `tok tok …`.
pub(super) fn output_text(n: u64) -> String {
    let mut s = String::with_capacity(n as usize * 4);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str("tok");
    }
    s
}
