//! vLLM's OpenAI API with NixlConnector P/D semantics, for simulated workers run with
//! `--engine vllm`: `POST /v1/completions` and `POST /v1/chat/completions`.
//!
//! - A prefill worker given `kv_transfer_params.do_remote_decode: true` holds the request for
//!   a decode worker ([`PAIR_TIMEOUT_WALL`]) and answers at once with the parameters a decode
//!   worker pulls it by (`remote_engine_id` = its name, `remote_request_id`, `remote_block_ids`,
//!   `remote_host`, `remote_port`, `tp_size`, `do_remote_prefill: true`). The engine model has
//!   one P→D job (prefill on P, transfer, decode on D), so P's prefill is timed when D pulls:
//!   the pair costs what SGLang's concurrent legs cost.
//! - A decode worker given `kv_transfer_params.do_remote_prefill: true` pulls the held request
//!   from the prefill worker its `remote_engine_id` names (a P→D job); an unknown or expired
//!   `remote_request_id` is a 400 `kv_transfer_error`.
//! - A plain request (no `kv_transfer_params`) is served in full with the worker's prefix
//!   cache: on a decode worker a direct-to-D append when the session is resident there and
//!   has room, else a prefill of the whole prompt on that worker; on a prefill or colocated
//!   worker colocated-style.
//!
//! Answers carry `usage` (`prompt_tokens`, `completion_tokens`, `total_tokens`,
//! `prompt_tokens_details.cached_tokens`); streams send one chunk at the first token, one at
//! the end, the usage chunk (`choices: []`) when `stream_options.include_usage` is on, then
//! `data: [DONE]`. When replaying a trace, the prompt is `prompt` (a string), or for chat the
//! messages' contents joined by newlines; it is found among the driver's requests in flight as
//! for `/generate`. Standalone workers (`kvc-replay workers`) serve any prompt instead (a
//! string or token-id `prompt`, or chat `messages` whose contents are strings, `null` or text
//! parts): see `standalone`; a malformed body or an empty prompt gets 400.

use super::PAIR_TIMEOUT_WALL;
use super::engine_thread::{Progress, RequestPart};
use super::sglang::{
    Chunk, WorkerContext, error_response, event_stream, find_prompt, invalid, json_response,
    optional_u64, output_text, shutting_down, stream_flag,
};
use super::standalone::PromptIn;
use super::state::NO_TRACE_INDEX;
use crate::model::Job;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use kvc_core::{WorkerId, WorkerRole, sse};
use serde_json::{Map, Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// Which OpenAI API a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpenAi {
    Completions,
    Chat,
}

/// The parts of an OpenAI body the simulated worker uses.
#[derive(Debug)]
struct OpenAiBody {
    /// The prompt as a replay finds it among its requests: `prompt`, or the chat messages'
    /// contents joined by newlines (empty for a token-id prompt).
    text: String,
    /// The prompt as standalone workers tokenize it.
    prompt: PromptIn,
    max_tokens: Option<u64>,
    stream: bool,
    include_usage: bool,
    transfer: Option<Map<String, Value>>,
}

fn parse(api: OpenAi, bytes: &[u8]) -> Result<OpenAiBody, String> {
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| format!("the body is not JSON: {e}"))?;
    let obj = v.as_object().ok_or("the body must be a JSON object")?;
    let (text, prompt) = match api {
        OpenAi::Completions => match obj.get("prompt") {
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
        OpenAi::Chat => {
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
            let parts: Vec<&str> = pairs.iter().map(|(_, c)| c.as_str()).collect();
            (parts.join("\n"), PromptIn::Chat(pairs))
        }
    };
    let max_tokens = match api {
        OpenAi::Chat => obj
            .get("max_completion_tokens")
            .or_else(|| obj.get("max_tokens")),
        OpenAi::Completions => obj.get("max_tokens"),
    };
    let max_tokens = optional_u64(max_tokens, "max_tokens")?;
    let stream = stream_flag(obj)?;
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if obj.get("stream_options").is_some_and(|o| !o.is_null()) && !stream {
        return Err("Stream options can only be defined when `stream=True`.".into());
    }
    let transfer = match obj.get("kv_transfer_params") {
        None | Some(Value::Null) => None,
        Some(Value::Object(p)) => Some(p.clone()),
        Some(_) => return Err("`kv_transfer_params` must be an object".into()),
    };
    Ok(OpenAiBody {
        text,
        prompt,
        max_tokens,
        stream,
        include_usage,
        transfer,
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
/// own prompt); else the worker's answer (400).
fn resolve(
    ctx: &WorkerContext,
    req: &OpenAiBody,
    headers: &HeaderMap,
    attempt: bool,
    arrived: std::time::Instant,
) -> Result<Resolved, Box<Response>> {
    let shared = &ctx.shared;
    let Some(standalone) = &shared.standalone else {
        if matches!(req.prompt, PromptIn::Tokens(_)) {
            return Err(Box::new(invalid("this worker takes a string `prompt`")));
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
        return Err(Box::new(invalid("the prompt is empty (no token)")));
    }
    if job.input > shared.max_input {
        return Err(Box::new(error_response(
            StatusCode::BAD_REQUEST,
            "input_too_long",
            &format!(
                "The input ({} tokens) is longer than the model's context length ({} tokens).",
                job.input, shared.max_input
            ),
        )));
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

/// vLLM's OpenAI routes, `/v1/completions` and `/v1/chat/completions`.
pub(super) fn routes() -> axum::Router<Arc<WorkerContext>> {
    let handler = |api: OpenAi| {
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
            let path = match api {
                OpenAi::Completions => "/v1/completions",
                OpenAi::Chat => "/v1/chat/completions",
            };
            match shim.before_serve(&ctx, path, &mut headers, body).await {
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
    axum::Router::new()
        .route(
            "/v1/completions",
            axum::routing::post(handler(OpenAi::Completions)),
        )
        .route(
            "/v1/chat/completions",
            axum::routing::post(handler(OpenAi::Chat)),
        )
}

/// Serves one OpenAI request whose body the worker held whole at `arrived`.
async fn serve(
    ctx: Arc<WorkerContext>,
    api: OpenAi,
    headers: &HeaderMap,
    body: &[u8],
    arrived: std::time::Instant,
) -> Response {
    let req = match parse(api, body) {
        Ok(r) => r,
        Err(m) => return invalid(&m),
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
        Err(answer) => return *answer,
    };
    let prompt_tokens = job.input;
    if remote_decode {
        return hold_for_decode(&ctx, api, headers, index, key, &job);
    }
    let part = if remote_prefill {
        let Some(p) = req.transfer.as_ref().and_then(|t| pull(&ctx, t)) else {
            return error_response(
                StatusCode::BAD_REQUEST,
                "kv_transfer_error",
                &format!(
                    "{}: no prefilled request to pull (unknown or expired `remote_request_id`)",
                    ctx.name
                ),
            );
        };
        if (p.1, p.2) != (index, key) {
            return error_response(
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
        return shutting_down();
    };
    let answer = Answer {
        api,
        model: shared.model.clone(),
        id: answer_id(index),
        prompt_tokens,
        output,
    };
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
                return error_response(status, "worker_error", &m);
            }
            Some(Progress::Rejected(m)) => {
                return error_response(StatusCode::SERVICE_UNAVAILABLE, "worker_error", &m);
            }
            None => {
                return error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "worker_error",
                    "the engine stopped",
                );
            }
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
    api: OpenAi,
    headers: &HeaderMap,
    index: usize,
    key: u64,
    job: &Job,
) -> Response {
    if ctx.role != WorkerRole::Prefill {
        return invalid(&format!(
            "{} is not a prefill worker (kv_role kv_consumer): it cannot produce KV for a \
             remote decode",
            ctx.name
        ));
    }
    if ctx.faults.fail_prefill {
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "worker_error",
            &format!("{}: prefill failed (injected fault)", ctx.name),
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
    let answer = Answer {
        api,
        model: ctx.shared.model.clone(),
        id: answer_id(index),
        prompt_tokens: job.input,
        output: 1,
    };
    json_response(StatusCode::OK, &answer.whole(0, params))
}

/// The `id` of an answer: the trace index's, or for a standalone worker's request a fresh one.
fn answer_id(index: usize) -> String {
    if index == NO_TRACE_INDEX {
        format!("cmpl-{}", NEXT_HOLD.fetch_add(1, Ordering::Relaxed))
    } else {
        format!("cmpl-r{index}")
    }
}

/// The shapes of one request's answer.
struct Answer {
    api: OpenAi,
    model: String,
    id: String,
    prompt_tokens: u64,
    output: u64,
}

impl Answer {
    fn usage(&self, completion: u64, cached: u64) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": { "cached_tokens": cached },
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (OpenAi::Completions, _) => "text_completion",
            (OpenAi::Chat, false) => "chat.completion",
            (OpenAi::Chat, true) => "chat.completion.chunk",
        }
    }

    fn whole(&self, cached: u64, transfer: Value) -> Value {
        let text = output_text(self.output);
        let choice = match self.api {
            OpenAi::Completions => {
                json!({ "index": 0, "text": text, "finish_reason": "length" })
            }
            OpenAi::Chat => json!({ "index": 0, "finish_reason": "length",
                "message": { "role": "assistant", "content": text } }),
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(self.output, cached),
            "kv_transfer_params": transfer,
        })
    }

    fn chunk(&self, text: &str, finish: Option<&str>) -> Bytes {
        let choice = match self.api {
            OpenAi::Completions => json!({ "index": 0, "text": text, "finish_reason": finish }),
            OpenAi::Chat => json!({ "index": 0, "finish_reason": finish,
                "delta": { "role": "assistant", "content": text } }),
        };
        let v = json!({ "id": self.id, "object": self.object(true), "model": self.model,
            "choices": [choice] });
        Bytes::from(sse::event(&v.to_string()))
    }

    fn usage_chunk(&self, cached: u64) -> Bytes {
        let v = json!({ "id": self.id, "object": self.object(true), "model": self.model,
            "choices": [], "usage": self.usage(self.output, cached) });
        Bytes::from(sse::event(&v.to_string()))
    }
}

/// A streamed answer: one chunk at the first token, one at the end, the usage chunk when
/// asked for, then `[DONE]`; an engine failure ends the stream with an error event.
fn relay(
    mut progress: UnboundedReceiver<Progress>,
    ctx: Arc<WorkerContext>,
    index: usize,
    answer: Answer,
    include_usage: bool,
) -> UnboundedReceiver<Chunk> {
    let (tx, out) = unbounded_channel();
    tokio::spawn(async move {
        loop {
            let chunks: Vec<Bytes> = match progress.recv().await {
                Some(Progress::Accepted) => continue,
                Some(Progress::FirstToken) => {
                    let now = Instant::now();
                    ctx.shared.with_served(index, |s| s.first_sent = Some(now));
                    vec![answer.chunk("tok", None)]
                }
                Some(Progress::Done { cached }) => {
                    let now = Instant::now();
                    ctx.shared.with_served(index, |s| s.done_sent = Some(now));
                    // Deltas concatenate to the whole answer: the rest follows the first
                    // token after a space.
                    let rest = match answer.output.saturating_sub(1) {
                        0 => String::new(),
                        n => format!(" {}", output_text(n)),
                    };
                    let mut v = vec![answer.chunk(&rest, Some("length"))];
                    if include_usage {
                        v.push(answer.usage_chunk(cached));
                    }
                    v.push(Bytes::from_static(sse::DONE_EVENT.as_bytes()));
                    for c in v {
                        let _ = tx.send(Ok(c));
                    }
                    return;
                }
                Some(Progress::Failed(_, m) | Progress::Rejected(m)) => {
                    let e = json!({ "error": { "message": m, "type": "worker_error",
                        "code": 500 } });
                    let _ = tx.send(Ok(Bytes::from(sse::event(&e.to_string()))));
                    return;
                }
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
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_bodies_are_read() {
        let b = parse(
            OpenAi::Completions,
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
            OpenAi::Chat,
            br#"{"messages": [{"role": "user", "content": "x y"}], "max_completion_tokens": 2,
                "max_tokens": 9}"#,
        )
        .unwrap();
        assert_eq!(
            (c.text.as_str(), c.max_tokens, c.stream),
            ("x y", Some(2), false)
        );
        assert_eq!(
            parse(OpenAi::Completions, br#"{"prompt": [1, 2]}"#)
                .unwrap()
                .prompt,
            PromptIn::Tokens(vec![1, 2])
        );
        let chat = parse(
            OpenAi::Chat,
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
                OpenAi::Completions,
                &br#"{"max_tokens": 3}"#[..],
                "missing `prompt`",
            ),
            (OpenAi::Completions, br#"{"prompt": [1, -2]}"#, "token ids"),
            (
                OpenAi::Completions,
                br#"{"prompt": {}}"#,
                "`prompt` must be",
            ),
            (
                OpenAi::Completions,
                br#"{"prompt": "a", "stream": "yes"}"#,
                "`stream`",
            ),
            (OpenAi::Chat, br#"{"messages": []}"#, "is empty"),
            (OpenAi::Chat, br#"{"messages": [{"content": "a"}]}"#, "role"),
            (
                OpenAi::Chat,
                br#"{"messages": [{"role": "user", "content": 5}]}"#,
                "content",
            ),
            (
                OpenAi::Chat,
                br#"{"messages": [{"role": "user", "content": "a"}],
                "max_tokens": -1}"#,
                "max_tokens",
            ),
            (OpenAi::Chat, b"not json", "not JSON"),
        ] {
            let err = parse(api, body).unwrap_err();
            assert!(err.contains(want), "{want}: {err}");
        }
        assert!(
            parse(
                OpenAi::Completions,
                br#"{"prompt": "a", "stream_options": {}}"#
            )
            .unwrap_err()
            .contains("stream=True")
        );
    }

    #[test]
    fn answers_carry_usage_with_cached_tokens() {
        let a = Answer {
            api: OpenAi::Chat,
            model: "m".into(),
            id: "cmpl-r0".into(),
            prompt_tokens: 10,
            output: 3,
        };
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
}
