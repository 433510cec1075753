//! vLLM's OpenAI API with NixlConnector P/D semantics, for simulated workers run with
//! `--engine vllm`: `POST /v1/completions` and `POST /v1/chat/completions`, and the coding
//! agents' APIs as vLLM serves them: `POST /v1/messages` (Anthropic Messages),
//! `POST /v1/messages/count_tokens` and `POST /v1/responses` (OpenAI Responses).
//!
//! - A prefill worker given `kv_transfer_params.do_remote_decode: true` holds the request for
//!   a decode worker ([`PAIR_TIMEOUT_WALL`]) and answers at once with the parameters a decode
//!   worker pulls it by (`remote_engine_id` = its name, `remote_request_id`, `remote_block_ids`,
//!   `remote_host`, `remote_port`, `tp_size`, `do_remote_prefill: true`), in the answer's
//!   top-level `kv_transfer_params` (in every API). The engine model has one P→D job (prefill
//!   on P, transfer, decode on D), so P's prefill is timed when D pulls: the pair costs what
//!   SGLang's concurrent legs cost.
//! - A decode worker given `kv_transfer_params.do_remote_prefill: true` pulls the held request
//!   from the prefill worker its `remote_engine_id` names (a P→D job); an unknown or expired
//!   `remote_request_id` is a 400 `kv_transfer_error`.
//! - A plain request (no `kv_transfer_params`) is served in full with the worker's prefix
//!   cache: on a decode worker a direct-to-D append when the session is resident there and
//!   has room, else a prefill of the whole prompt on that worker; on a prefill or colocated
//!   worker colocated-style.
//!
//! **Prompts.** Completions take `prompt`; chat `messages`; Messages and Responses requests
//! are read as chat messages by [`kvc_core::agent_apis`] (`messages_chat`: `system`, then each
//! message, tool results as `tool` messages; `responses_chat`: `instructions`, then `input`'s
//! items; a request naming `previous_response_id` is refused with 400). When replaying a trace,
//! the prompt is `prompt` (a string), or for the other APIs the messages' texts joined by
//! newlines; it is found among the driver's requests in flight as for `/generate`. Standalone
//! workers (`kvc-replay workers`) serve any prompt instead (a string or token-id `prompt`, or
//! chat messages): see `standalone`; a malformed body or an empty prompt gets 400.
//!
//! **Output limits.** `max_tokens` (completions), `max_completion_tokens` or `max_tokens`
//! (chat), `max_tokens` (Messages, required: 400 without it), `max_output_tokens`
//! (Responses); every answer generates exactly that many tokens (`tok tok …`).
//!
//! **Answers.**
//! - Completions and chat: `usage` (`prompt_tokens`, `completion_tokens`, `total_tokens`,
//!   `prompt_tokens_details.cached_tokens`); streams send one chunk at the first token, one at
//!   the end, the usage chunk (`choices: []`) when `stream_options.include_usage` is on, then
//!   `data: [DONE]`. Errors: `{"error": {"message", "type", "code"}}`.
//! - Messages: `{"id": "msg_…", "type": "message", "role": "assistant", "content": [{"type":
//!   "text", "text"}], "model", "stop_reason": "max_tokens", "usage": {"input_tokens",
//!   "output_tokens", "cache_read_input_tokens"}}`, plus `kv_transfer_params` on a prefill
//!   worker's answer (vLLM leaves out null fields); `input_tokens` are the prompt tokens not
//!   read from the cache. Streams (`event:` lines): `message_start` (usage: the whole prompt as
//!   `input_tokens`, no cache details yet, as vLLM's first chunk), `content_block_start`,
//!   `content_block_delta` (`text_delta`) at the first token and at the end,
//!   `content_block_stop`, `message_delta` (`delta.stop_reason`, the final `usage`),
//!   `message_stop`. Errors: `{"type": "error", "error": {"type", "message"}}` (`type` by
//!   status: `invalid_request_error`, `overloaded_error`, `api_error`, …), mid-stream as an
//!   `error` event. `count_tokens` answers `{"input_tokens", "context_management":
//!   {"original_input_tokens"}}`: the prompt's tokens as the worker tokenizes them (the
//!   `input` of the job it would run, generation prompt included), no job run.
//! - Responses: `{"id": "resp_…", "object": "response", "created_at", "status", "model",
//!   "output": [{"type": "message", "id": "msg_…", "role": "assistant", "status":
//!   "completed", "content": [{"type": "output_text", "text", "annotations": []}]}], "usage":
//!   {"input_tokens", "input_tokens_details": {"cached_tokens"}, "output_tokens",
//!   "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens"}, "kv_transfer_params"}`
//!   and the request's echoed fields; `input_tokens` is the whole prompt. As every answer
//!   stops at its output limit, `status` is `incomplete` with `incomplete_details.reason:
//!   max_output_tokens` (vLLM's for a `length` finish). Streams (`event:` lines, each event
//!   with its `sequence_number`): `response.created`, `response.in_progress`,
//!   `response.output_item.added`, `response.content_part.added`,
//!   `response.output_text.delta` at the first token and at the end,
//!   `response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
//!   `response.completed` (its `response` carries the usage). Errors in OpenAI's shape,
//!   mid-stream an `error` event (`{"type": "error", "code", "message"}`).

use super::PAIR_TIMEOUT_WALL;
use super::agent::{self, ResponseIds, ResponsesStream};
use super::engine_thread::{Progress, RequestPart};
use super::sglang::{
    Chunk, Refusal, WorkerContext, event_stream, find_prompt, json_response, optional_u64,
    output_text, stream_flag,
};
use super::standalone::{PromptIn, Standalone};
use super::state::NO_TRACE_INDEX;
use crate::model::Job;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use kvc_core::openai::VllmApi;
use kvc_core::{WorkerId, WorkerRole, sse};
use serde_json::{Map, Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// Which API a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/messages` (Anthropic).
    Messages,
    /// `POST /v1/responses` (OpenAI Responses).
    Responses,
}

impl Api {
    /// Every API served, each on its own route.
    const SERVED: [Api; 4] = [Api::Completions, Api::Chat, Api::Messages, Api::Responses];

    /// The route.
    pub(super) fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
            Api::Messages => "/v1/messages",
            Api::Responses => "/v1/responses",
        }
    }

    /// The API as `kvc_core::openai` names it (its prefill body limits the output in the
    /// API's own field).
    pub(super) fn vllm(self) -> VllmApi {
        match self {
            Api::Completions => VllmApi::Completions,
            Api::Chat => VllmApi::ChatCompletions,
            Api::Messages => VllmApi::Messages,
            Api::Responses => VllmApi::Responses,
        }
    }

    /// `refusal` as this API answers errors: Anthropic's shape for Messages, else OpenAI's.
    pub(super) fn error(self, refusal: Refusal) -> Response {
        match self {
            Api::Messages => agent::anthropic_error(refusal.status, &refusal.message),
            _ => refusal.into_response(),
        }
    }

    /// A `400` in this API's shape.
    pub(super) fn invalid(self, message: impl Into<String>) -> Response {
        self.error(Refusal::invalid(message))
    }

    fn fail(self, status: StatusCode, kind: &'static str, message: impl Into<String>) -> Response {
        self.error(Refusal {
            status,
            kind,
            message: message.into(),
        })
    }
}

/// The parts of a request body the simulated worker uses.
#[derive(Debug)]
struct RequestBody {
    /// The prompt as a replay finds it among its requests: `prompt`, or the messages' texts
    /// joined by newlines (empty for a token-id prompt).
    text: String,
    /// The prompt as standalone workers tokenize it.
    prompt: PromptIn,
    max_tokens: Option<u64>,
    stream: bool,
    include_usage: bool,
    transfer: Option<Map<String, Value>>,
    /// Responses: the request's fields the response repeats.
    echo: Map<String, Value>,
}

/// Chat messages as a prompt: the replay's text (the texts joined by newlines) and the
/// standalone workers' messages.
fn chat_prompt(pairs: Vec<(String, String)>) -> (String, PromptIn) {
    let parts: Vec<&str> = pairs.iter().map(|(_, c)| c.as_str()).collect();
    (parts.join("\n"), PromptIn::Chat(pairs))
}

/// The prompt of a request through `api`, or what is wrong with the body.
fn parse_prompt(api: Api, obj: &Map<String, Value>) -> Result<(String, PromptIn), String> {
    Ok(match api {
        Api::Completions => match obj.get("prompt") {
            Some(Value::String(s)) => (s.clone(), PromptIn::Text(s.clone())),
            Some(Value::Array(ids)) => {
                let tokens = ids
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or("`prompt` must be a string or one array of token ids (0..2^32)")?;
                (String::new(), PromptIn::Tokens(tokens))
            }
            Some(_) => return Err("`prompt` must be a string or an array of token ids".into()),
            None => return Err("missing `prompt`".into()),
        },
        Api::Chat => {
            let messages = obj
                .get("messages")
                .and_then(Value::as_array)
                .ok_or("`messages` must be an array")?;
            if messages.is_empty() {
                return Err("`messages` is empty".into());
            }
            let mut pairs = Vec::with_capacity(messages.len());
            for (i, m) in messages.iter().enumerate() {
                let role = m
                    .get("role")
                    .and_then(Value::as_str)
                    .filter(|r| !r.is_empty())
                    .ok_or_else(|| format!("`messages[{i}].role` must be a non-empty string"))?;
                pairs.push((
                    role.to_owned(),
                    kvc_core::openai::message_text(m.get("content"), i)?,
                ));
            }
            chat_prompt(pairs)
        }
        Api::Messages => chat_prompt(kvc_core::agent_apis::messages_chat(obj)?),
        Api::Responses => chat_prompt(kvc_core::agent_apis::responses_chat(obj)?),
    })
}

/// A JSON object body, or what is wrong with it.
fn json_object(bytes: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice(bytes).map_err(|e| format!("the body is not JSON: {e}"))? {
        Value::Object(o) => Ok(o),
        _ => Err("the body must be a JSON object".into()),
    }
}

fn parse(api: Api, bytes: &[u8]) -> Result<RequestBody, String> {
    let obj = json_object(bytes)?;
    let (text, prompt) = parse_prompt(api, &obj)?;
    let max_tokens = match api {
        Api::Completions => optional_u64(obj.get("max_tokens"), "max_tokens")?,
        Api::Chat => optional_u64(
            obj.get("max_completion_tokens")
                .or_else(|| obj.get("max_tokens")),
            "max_tokens",
        )?,
        Api::Messages => match obj.get("max_tokens") {
            None | Some(Value::Null) => return Err("missing `max_tokens`".into()),
            v => optional_u64(v, "max_tokens")?,
        },
        Api::Responses => optional_u64(obj.get("max_output_tokens"), "max_output_tokens")?,
    };
    let stream = stream_flag(&obj)?;
    let mut include_usage = false;
    if matches!(api, Api::Completions | Api::Chat) {
        include_usage = obj
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if obj.get("stream_options").is_some_and(|o| !o.is_null()) && !stream {
            return Err("Stream options can only be defined when `stream=True`.".into());
        }
    }
    let transfer = match obj.get("kv_transfer_params") {
        None | Some(Value::Null) => None,
        Some(Value::Object(p)) => Some(p.clone()),
        Some(_) => return Err("`kv_transfer_params` must be an object".into()),
    };
    let echo = if api == Api::Responses {
        agent::responses_echo(&obj)
    } else {
        Map::new()
    };
    Ok(RequestBody {
        text,
        prompt,
        max_tokens,
        stream,
        include_usage,
        transfer,
        echo,
    })
}

/// The request a worker serves: a trace request of the replay, or (standalone workers) the
/// client's own prompt.
struct Resolved {
    /// Trace index ([`NO_TRACE_INDEX`] for standalone workers).
    index: usize,
    /// The prompt's key: P's hold and D's pull name the same prompt.
    key: u64,
    /// The engine job.
    job: Job,
}

/// Finds the request of `req` (a replay's trace request in flight, or a standalone worker's
/// own prompt); else why not (400).
fn resolve(
    ctx: &WorkerContext,
    req: &RequestBody,
    headers: &HeaderMap,
    attempt: bool,
    arrived: std::time::Instant,
) -> Result<Resolved, Refusal> {
    let shared = &ctx.shared;
    let Some(standalone) = &shared.standalone else {
        if matches!(req.prompt, PromptIn::Tokens(_)) {
            return Err(Refusal::invalid("this worker takes a string `prompt`"));
        }
        let index = find_prompt(ctx, &req.text, attempt, arrived)?;
        return Ok(Resolved {
            index,
            key: crate::prompt::prompt_key(&req.text),
            job: shared.job(index, req.max_tokens),
        });
    };
    let job = standalone.job(&req.prompt, req.max_tokens, headers);
    if job.input == 0 {
        return Err(Refusal::invalid("the prompt is empty (no token)"));
    }
    if job.input > shared.max_input {
        return Err(Refusal::too_long(job.input, shared.max_input));
    }
    let key = match &req.prompt {
        PromptIn::Tokens(t) => {
            let text: Vec<String> = t.iter().map(u32::to_string).collect();
            crate::prompt::prompt_key(&text.join(","))
        }
        _ => crate::prompt::prompt_key(&req.text),
    };
    Ok(Resolved {
        index: NO_TRACE_INDEX,
        key,
        job,
    })
}

/// Every remote request id a prefill worker hands out is distinct.
static NEXT_HOLD: AtomicU64 = AtomicU64::new(0);

/// vLLM's routes: the OpenAI APIs, Messages (with `count_tokens`) and Responses.
pub(super) fn routes() -> axum::Router<Arc<WorkerContext>> {
    let handler = |api: Api| {
        move |State(ctx): State<Arc<WorkerContext>>, mut headers: HeaderMap, body: Bytes| async move {
            let arrived = std::time::Instant::now();
            // Behind an endpoint picker, a decode worker's sidecar runs the prefill step first.
            let Some(shim) = ctx
                .pd_shim
                .clone()
                .filter(|_| ctx.role == WorkerRole::Decode)
            else {
                return serve(ctx, api, &headers, &body, arrived).await;
            };
            match shim.before_serve(&ctx, api, &mut headers, body).await {
                super::pd_shim::Step::Serve {
                    body,
                    prefill_failed,
                } => super::pd_shim::mark(
                    serve(ctx, api, &headers, &body, arrived).await,
                    prefill_failed,
                ),
                super::pd_shim::Step::Answer(response) => response,
            }
        }
    };
    let mut router = axum::Router::new().route(
        "/v1/messages/count_tokens",
        axum::routing::post(count_tokens),
    );
    for api in Api::SERVED {
        router = router.route(api.path(), axum::routing::post(handler(api)));
    }
    router
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the worker would run them (a
/// standalone worker's tokenization; a replay's trace request length), no engine job.
async fn count_tokens(State(ctx): State<Arc<WorkerContext>>, body: Bytes) -> Response {
    let api = Api::Messages;
    let (text, prompt) = match json_object(&body).and_then(|o| parse_prompt(api, &o)) {
        Ok(p) => p,
        Err(m) => return api.invalid(m),
    };
    let tokens = if ctx.shared.standalone.is_some() {
        Standalone::input_tokens(&prompt)
    } else {
        match ctx.shared.find(crate::prompt::prompt_key(&text)) {
            Some(index) => ctx.shared.script.requests[index].input_length,
            None => {
                return api.invalid(format!(
                    "{}: unknown prompt (not one this replay has in flight)",
                    ctx.name
                ));
            }
        }
    };
    json_response(
        StatusCode::OK,
        &json!({ "input_tokens": tokens,
                 "context_management": { "original_input_tokens": tokens } }),
    )
}

/// The worker's answer when the engine has stopped, in `api`'s shape.
fn engine_stopped(api: Api) -> Response {
    api.fail(
        StatusCode::INTERNAL_SERVER_ERROR,
        "worker_error",
        "the engine stopped",
    )
}

/// Serves one request through `api` whose body the worker held whole at `arrived`.
async fn serve(
    ctx: Arc<WorkerContext>,
    api: Api,
    headers: &HeaderMap,
    body: &[u8],
    arrived: std::time::Instant,
) -> Response {
    let req = match parse(api, body) {
        Ok(r) => r,
        Err(m) => return api.invalid(m),
    };
    let shared = &ctx.shared;
    let flag = |name: &str| {
        req.transfer
            .as_ref()
            .and_then(|p| p.get(name))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    let (remote_decode, remote_prefill) = (flag("do_remote_decode"), flag("do_remote_prefill"));
    let Resolved { index, key, job } = match resolve(&ctx, &req, headers, !remote_decode, arrived) {
        Ok(r) => r,
        Err(refusal) => return api.error(refusal),
    };
    let prompt_tokens = job.input;
    // The front end's intake: a text prompt is turned into tokens (chat template, tokenizer)
    // before the scheduler sees it; token ids go straight in.
    if !matches!(req.prompt, PromptIn::Tokens(_)) {
        let intake = shared.profile.intake_seconds(prompt_tokens) / shared.clock.speedup;
        if intake > 0.0 {
            tokio::time::sleep(std::time::Duration::from_secs_f64(intake)).await;
        }
    }
    if remote_decode {
        return hold_for_decode(&ctx, api, &req, headers, index, key, &job);
    }
    let part = if remote_prefill {
        let Some(p) = req.transfer.as_ref().and_then(|t| pull(&ctx, t)) else {
            return api.fail(
                StatusCode::BAD_REQUEST,
                "kv_transfer_error",
                format!(
                    "{}: no prefilled request to pull (unknown or expired `remote_request_id`)",
                    ctx.name
                ),
            );
        };
        if (p.1, p.2) != (index, key) {
            return api.fail(
                StatusCode::BAD_REQUEST,
                "kv_transfer_error",
                "the pulled request is another prompt",
            );
        }
        RequestPart::Pulled {
            prefill: p.0,
            decode: ctx.id,
        }
    } else {
        match ctx.role {
            WorkerRole::Decode => RequestPart::Plain {
                decode: ctx.id,
                evict_first: ctx.faults.evict_before_plain,
            },
            WorkerRole::Prefill | WorkerRole::Colocated => RequestPart::Colocated(ctx.id),
        }
    };
    let output = job.output;
    let Some(mut progress) = shared.start_on_engine(index, job, part) else {
        return api.fail(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the worker is shutting down",
        );
    };
    let answer = Answer::new(api, &shared.model, index, prompt_tokens, output, req.echo);
    if req.stream {
        return event_stream(relay(
            progress,
            ctx.clone(),
            index,
            answer,
            req.include_usage,
        ));
    }
    loop {
        match progress.recv().await {
            Some(Progress::Accepted) => {}
            Some(Progress::FirstToken) => {
                let now = Instant::now();
                shared.with_served(index, |s| s.first_sent = Some(now));
            }
            Some(Progress::Done { cached }) => {
                let now = Instant::now();
                shared.with_served(index, |s| s.done_sent = Some(now));
                return json_response(StatusCode::OK, &answer.whole(cached, Value::Null));
            }
            Some(Progress::Failed(status, m)) => {
                return api.fail(status, "worker_error", m);
            }
            Some(Progress::Rejected(m)) => {
                return api.fail(StatusCode::SERVICE_UNAVAILABLE, "worker_error", m);
            }
            None => return engine_stopped(api),
        }
    }
}

/// The held request `transfer` names: (prefill worker, trace index, prompt key), when it is
/// there.
fn pull(ctx: &WorkerContext, transfer: &Map<String, Value>) -> Option<(WorkerId, usize, u64)> {
    let engine = transfer.get("remote_engine_id")?.as_str()?;
    let id = transfer.get("remote_request_id")?.as_str()?;
    let p = ctx.shared.worker_named(engine)?;
    let hold = ctx.shared.pull(p, id)?;
    Some((p, hold.index, hold.key))
}

/// A prefill worker's answer to `do_remote_decode`: the request is held for a decode
/// worker's pull, and the parameters to pull it by are returned.
fn hold_for_decode(
    ctx: &WorkerContext,
    api: Api,
    req: &RequestBody,
    headers: &HeaderMap,
    index: usize,
    key: u64,
    job: &Job,
) -> Response {
    if ctx.role != WorkerRole::Prefill {
        return api.invalid(format!(
            "{} is not a prefill worker (kv_role kv_consumer): it cannot produce KV for a \
             remote decode",
            ctx.name
        ));
    }
    if ctx.faults.fail_prefill {
        return api.fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            "worker_error",
            format!("{}: prefill failed (injected fault)", ctx.name),
        );
    }
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| format!("p{}", NEXT_HOLD.fetch_add(1, Ordering::Relaxed)));
    let remote_id = format!("{request_id}-{}", NEXT_HOLD.fetch_add(1, Ordering::Relaxed));
    let expires = Instant::now() + PAIR_TIMEOUT_WALL;
    ctx.shared
        .hold(ctx.id, remote_id.clone(), index, key, expires);
    let blocks: Vec<u64> = (0..job.hashes.len() as u64).collect();
    let params = json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": ctx.name,
        "remote_block_ids": blocks,
        "remote_request_id": remote_id,
        "remote_host": ctx.addr.ip().to_string(),
        "remote_port": ctx.addr.port(),
        "tp_size": 1,
    });
    let answer = Answer::new(
        api,
        &ctx.shared.model,
        index,
        job.input,
        1,
        req.echo.clone(),
    );
    json_response(StatusCode::OK, &answer.whole(0, params))
}

/// A fresh number for an answer's ids.
fn fresh_id() -> u64 {
    NEXT_HOLD.fetch_add(1, Ordering::Relaxed)
}

/// The `id` of an answer (`cmpl-`, Messages `msg_`, Responses `resp_`): the trace index's, or
/// for a standalone worker's request a fresh one.
fn answer_id(api: Api, index: usize) -> String {
    let prefix = match api {
        Api::Completions | Api::Chat => "cmpl-",
        Api::Messages => "msg_",
        Api::Responses => "resp_",
    };
    if index == NO_TRACE_INDEX {
        format!("{prefix}{}", fresh_id())
    } else {
        format!("{prefix}r{index}")
    }
}

/// The shapes of one request's answer.
struct Answer {
    api: Api,
    model: String,
    id: String,
    prompt_tokens: u64,
    output: u64,
    /// Responses: the response's ids and the request's echoed fields.
    response: Option<ResponseIds>,
}

impl Answer {
    fn new(
        api: Api,
        model: &str,
        index: usize,
        prompt_tokens: u64,
        output: u64,
        echo: Map<String, Value>,
    ) -> Self {
        let id = answer_id(api, index);
        let response = (api == Api::Responses).then(|| ResponseIds {
            id: id.clone(),
            item_id: format!("msg_{}", fresh_id()),
            model: model.to_owned(),
            echo,
            created_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        });
        Answer {
            api,
            model: model.to_owned(),
            id,
            prompt_tokens,
            output,
            response,
        }
    }

    /// This API's `usage` of the whole answer.
    fn usage(&self, cached: u64) -> Value {
        let (prompt, output) = (self.prompt_tokens, self.output);
        match self.api {
            Api::Completions | Api::Chat => json!({
                "prompt_tokens": prompt,
                "completion_tokens": output,
                "total_tokens": prompt + output,
                "prompt_tokens_details": { "cached_tokens": cached },
            }),
            Api::Messages => agent::messages_usage(prompt, output, cached),
            Api::Responses => agent::responses_usage(prompt, output, cached),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Completions, _) => "text_completion",
            (Api::Chat, false) => "chat.completion",
            (_, true) => "chat.completion.chunk",
            (Api::Messages, false) => "message",
            (Api::Responses, false) => "response",
        }
    }

    fn whole(&self, cached: u64, transfer: Value) -> Value {
        let text = output_text(self.output);
        let choice = match self.api {
            Api::Completions => {
                json!({ "index": 0, "text": text, "finish_reason": "length" })
            }
            Api::Chat => json!({ "index": 0, "finish_reason": "length",
                "message": { "role": "assistant", "content": text } }),
            Api::Messages => {
                return agent::messages_whole(
                    &self.id,
                    &self.model,
                    &text,
                    self.usage(cached),
                    transfer,
                );
            }
            Api::Responses => {
                let ids = self
                    .response
                    .as_ref()
                    .expect("a Responses answer has its ids");
                return ids.response(Some((&text, self.usage(cached))), self.output, transfer);
            }
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(cached),
            "kv_transfer_params": transfer,
        })
    }

    fn chunk(&self, text: &str, finish: Option<&str>) -> Bytes {
        let choice = match self.api {
            Api::Completions => json!({ "index": 0, "text": text, "finish_reason": finish }),
            _ => json!({ "index": 0, "finish_reason": finish,
                "delta": { "role": "assistant", "content": text } }),
        };
        let v = json!({ "id": self.id, "object": self.object(true), "model": self.model,
            "choices": [choice] });
        Bytes::from(sse::event(&v.to_string()))
    }

    fn usage_chunk(&self, cached: u64) -> Bytes {
        let v = json!({ "id": self.id, "object": self.object(true), "model": self.model,
            "choices": [], "usage": self.usage(cached) });
        Bytes::from(sse::event(&v.to_string()))
    }
}

/// The first token of every streamed answer, and the rest after a space: the deltas
/// concatenate to the whole answer.
const FIRST: &str = "tok";

fn rest_of(output: u64) -> String {
    match output.saturating_sub(1) {
        0 => String::new(),
        n => format!(" {}", output_text(n)),
    }
}

/// A streamed answer in its API's events (see the module docs); an engine failure ends the
/// stream with an error event.
fn relay(
    mut progress: UnboundedReceiver<Progress>,
    ctx: Arc<WorkerContext>,
    index: usize,
    answer: Answer,
    include_usage: bool,
) -> UnboundedReceiver<Chunk> {
    let (tx, out) = unbounded_channel();
    let mut responses = answer
        .response
        .clone()
        .map(|ids| ResponsesStream::new(ids, answer.output));
    if let Some(r) = &mut responses {
        for c in r.opening() {
            let _ = tx.send(Ok(c));
        }
    }
    tokio::spawn(async move {
        loop {
            let (chunks, last): (Vec<Bytes>, bool) = match progress.recv().await {
                Some(Progress::Accepted) => continue,
                Some(Progress::FirstToken) => {
                    let now = Instant::now();
                    ctx.shared.with_served(index, |s| s.first_sent = Some(now));
                    let v = match (answer.api, &mut responses) {
                        (Api::Messages, _) => agent::messages_first(
                            &answer.id,
                            &answer.model,
                            answer.prompt_tokens,
                            FIRST,
                        ),
                        (_, Some(r)) => r.first(FIRST),
                        _ => vec![answer.chunk(FIRST, None)],
                    };
                    (v, false)
                }
                Some(Progress::Done { cached }) => {
                    let now = Instant::now();
                    ctx.shared.with_served(index, |s| s.done_sent = Some(now));
                    let rest = rest_of(answer.output);
                    let v = match (answer.api, &mut responses) {
                        (Api::Messages, _) => agent::messages_last(&rest, answer.usage(cached)),
                        (_, Some(r)) => {
                            r.last(&rest, &output_text(answer.output), answer.usage(cached))
                        }
                        _ => {
                            let mut v = vec![answer.chunk(&rest, Some("length"))];
                            if include_usage {
                                v.push(answer.usage_chunk(cached));
                            }
                            v.push(Bytes::from_static(sse::DONE_EVENT.as_bytes()));
                            v
                        }
                    };
                    (v, true)
                }
                Some(Progress::Failed(status, m)) => (
                    vec![failure_event(&answer, responses.as_mut(), status, &m)],
                    true,
                ),
                Some(Progress::Rejected(m)) => (
                    vec![failure_event(
                        &answer,
                        responses.as_mut(),
                        StatusCode::SERVICE_UNAVAILABLE,
                        &m,
                    )],
                    true,
                ),
                None => {
                    let _ = tx.send(Err(std::io::Error::other("the engine stopped")));
                    return;
                }
            };
            for c in chunks {
                if tx.send(Ok(c)).is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    out
}

/// The event that ends a stream the engine failed (`status`, `message`), in its API's shape.
fn failure_event(
    answer: &Answer,
    responses: Option<&mut ResponsesStream>,
    status: StatusCode,
    message: &str,
) -> Bytes {
    match (answer.api, responses) {
        (Api::Messages, _) => agent::messages_error_event(status, message),
        (_, Some(r)) => r.error(message),
        _ => {
            let e = json!({ "error": { "message": message, "type": "worker_error",
                "code": 500 } });
            Bytes::from(sse::event(&e.to_string()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_bodies_are_read() {
        let b = parse(
            Api::Completions,
            br#"{"prompt": "a b", "max_tokens": 5, "stream": true,
                "stream_options": {"include_usage": true},
                "kv_transfer_params": {"do_remote_decode": true}}"#,
        )
        .unwrap();
        assert_eq!(b.text, "a b");
        assert_eq!(b.max_tokens, Some(5));
        assert!(b.stream && b.include_usage);
        assert_eq!(b.transfer.unwrap()["do_remote_decode"], true);
        let c = parse(
            Api::Chat,
            br#"{"messages": [{"role": "user", "content": "x y"}], "max_completion_tokens": 2,
                "max_tokens": 9}"#,
        )
        .unwrap();
        assert_eq!(
            (c.text.as_str(), c.max_tokens, c.stream),
            ("x y", Some(2), false)
        );
        assert_eq!(
            parse(Api::Completions, br#"{"prompt": [1, 2]}"#)
                .unwrap()
                .prompt,
            PromptIn::Tokens(vec![1, 2])
        );
        let chat = parse(
            Api::Chat,
            br#"{"messages": [{"role": "system", "content": null},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                {"type": "image_url"}, {"type": "text", "text": " b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(chat.text, "\na b");
        assert_eq!(
            chat.prompt,
            PromptIn::Chat(vec![
                ("system".into(), String::new()),
                ("user".into(), "a b".into())
            ])
        );
        for (api, body, want) in [
            (
                Api::Completions,
                &br#"{"max_tokens": 3}"#[..],
                "missing `prompt`",
            ),
            (Api::Completions, br#"{"prompt": [1, -2]}"#, "token ids"),
            (Api::Completions, br#"{"prompt": {}}"#, "`prompt` must be"),
            (
                Api::Completions,
                br#"{"prompt": "a", "stream": "yes"}"#,
                "`stream`",
            ),
            (Api::Chat, br#"{"messages": []}"#, "is empty"),
            (Api::Chat, br#"{"messages": [{"content": "a"}]}"#, "role"),
            (
                Api::Chat,
                br#"{"messages": [{"role": "user", "content": 5}]}"#,
                "content",
            ),
            (
                Api::Chat,
                br#"{"messages": [{"role": "user", "content": "a"}],
                "max_tokens": -1}"#,
                "max_tokens",
            ),
            (Api::Chat, b"not json", "not JSON"),
        ] {
            let err = parse(api, body).unwrap_err();
            assert!(err.contains(want), "{want}: {err}");
        }
        assert!(
            parse(
                Api::Completions,
                br#"{"prompt": "a", "stream_options": {}}"#
            )
            .unwrap_err()
            .contains("stream=True")
        );
    }

    #[test]
    fn answers_carry_usage_with_cached_tokens() {
        let a = Answer::new(Api::Chat, "m", 0, 10, 3, Map::new());
        assert_eq!(a.id, "cmpl-r0");
        let w = a.whole(8, Value::Null);
        assert_eq!(w["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        assert_eq!(w["usage"]["total_tokens"], 13);
        assert_eq!(w["choices"][0]["message"]["content"], "tok tok tok");
        let u = a.usage_chunk(4);
        let text = std::str::from_utf8(&u).unwrap();
        assert!(
            text.starts_with("data: ") && text.contains("\"choices\":[]"),
            "{text}"
        );
    }

    #[test]
    fn agent_bodies_are_read_as_chat_messages() {
        let m = parse(
            Api::Messages,
            br#"{"model": "m", "max_tokens": 4, "stream": true, "system": "S",
                "messages": [{"role": "user", "content": "a b"}],
                "kv_transfer_params": {"do_remote_decode": true}}"#,
        )
        .unwrap();
        assert_eq!(
            (m.text.as_str(), m.max_tokens, m.stream),
            ("S\na b", Some(4), true)
        );
        assert_eq!(
            m.prompt,
            PromptIn::Chat(vec![
                ("system".into(), "S".into()),
                ("user".into(), "a b".into())
            ])
        );
        assert_eq!(m.transfer.unwrap()["do_remote_decode"], true);
        let r = parse(
            Api::Responses,
            br#"{"model": "m", "instructions": "S", "input": "q", "max_output_tokens": 9,
                "max_tokens": 2, "tools": [{"type": "function", "name": "f"}]}"#,
        )
        .unwrap();
        assert_eq!((r.text.as_str(), r.max_tokens), ("S\nq", Some(9)));
        assert_eq!(r.echo["instructions"], "S");
        assert_eq!(r.echo["tools"][0]["name"], "f");
        for (api, body, want) in [
            (
                Api::Messages,
                &br#"{"messages": [{"role": "user", "content": "a"}]}"#[..],
                "missing `max_tokens`",
            ),
            (
                Api::Messages,
                br#"{"max_tokens": -1, "messages": [{"role": "user", "content": "a"}]}"#,
                "`max_tokens` must be",
            ),
            (Api::Messages, br#"{"max_tokens": 1}"#, "missing `messages`"),
            (
                Api::Responses,
                br#"{"max_output_tokens": 1}"#,
                "missing `input`",
            ),
            (
                Api::Responses,
                br#"{"input": "a", "max_output_tokens": "x"}"#,
                "`max_output_tokens` must be",
            ),
            (
                Api::Responses,
                br#"{"input": "a", "previous_response_id": "resp_1"}"#,
                "previous_response_id",
            ),
            (Api::Responses, b"[]", "JSON object"),
        ] {
            let err = parse(api, body).unwrap_err();
            assert!(err.contains(want), "{want}: {err}");
        }
    }

    #[test]
    fn agent_answers_carry_usage_in_their_api_s_shape() {
        let m = Answer::new(Api::Messages, "m", 3, 10, 2, Map::new());
        let w = m.whole(8, Value::Null);
        assert_eq!(w["id"], "msg_r3");
        assert_eq!(
            w["usage"],
            json!({"input_tokens": 2, "output_tokens": 2, "cache_read_input_tokens": 8})
        );
        assert_eq!(w["content"], json!([{"type": "text", "text": "tok tok"}]));
        let held = m.whole(0, json!({"do_remote_prefill": true}));
        assert_eq!(held["kv_transfer_params"]["do_remote_prefill"], true);
        let r = Answer::new(Api::Responses, "m", 3, 10, 2, Map::new());
        let w = r.whole(8, Value::Null);
        assert_eq!(w["id"], "resp_r3");
        assert_eq!(w["usage"]["input_tokens"], 10);
        assert_eq!(w["usage"]["input_tokens_details"]["cached_tokens"], 8);
        assert_eq!(w["usage"]["total_tokens"], 12);
        assert_eq!(w["output"][0]["content"][0]["text"], "tok tok");
        assert_eq!(w["max_output_tokens"], 2);
        assert!(w["kv_transfer_params"].is_null());
    }
}
