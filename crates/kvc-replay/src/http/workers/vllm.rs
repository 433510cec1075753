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
//! `data: [DONE]`. The prompt is `prompt` (a string), or for chat the messages' contents
//! joined by newlines; it is found among the driver's requests in flight as for `/generate`.

use super::PAIR_TIMEOUT_WALL;
use super::engine_thread::{Progress, RequestPart};
use super::sglang::{
    Chunk, WorkerContext, error_response, event_stream, find_prompt, invalid, json_response,
    output_text, shutting_down,
};
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
    text: String,
    max_tokens: Option<u64>,
    stream: bool,
    include_usage: bool,
    transfer: Option<Map<String, Value>>,
}

fn parse(api: OpenAi, bytes: &[u8]) -> Result<OpenAiBody, String> {
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| format!("the body is not JSON: {e}"))?;
    let obj = v.as_object().ok_or("the body must be a JSON object")?;
    let text = match api {
        OpenAi::Completions => match obj.get("prompt") {
            Some(Value::String(s)) => s.clone(),
            _ => return Err("this worker takes a string `prompt`".into()),
        },
        OpenAi::Chat => {
            let messages = obj
                .get("messages")
                .and_then(Value::as_array)
                .ok_or("`messages` must be an array")?;
            let parts: Vec<&str> = messages
                .iter()
                .map(|m| m.get("content").and_then(Value::as_str).unwrap_or(""))
                .collect();
            parts.join("\n")
        }
    };
    let max_tokens = match api {
        OpenAi::Chat => obj
            .get("max_completion_tokens")
            .or_else(|| obj.get("max_tokens")),
        OpenAi::Completions => obj.get("max_tokens"),
    };
    let max_tokens = match max_tokens {
        None | Some(Value::Null) => None,
        Some(n) => Some(
            n.as_u64()
                .ok_or("`max_tokens` must be an unsigned integer")?,
        ),
    };
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
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
        max_tokens,
        stream,
        include_usage,
        transfer,
    })
}

/// Every remote request id a prefill worker hands out is distinct.
static NEXT_HOLD: AtomicU64 = AtomicU64::new(0);

/// vLLM's OpenAI routes, `/v1/completions` and `/v1/chat/completions`.
pub(super) fn routes() -> axum::Router<Arc<WorkerContext>> {
    let handler = |api: OpenAi| {
        move |State(ctx): State<Arc<WorkerContext>>, mut headers: HeaderMap, body: Bytes| async move {
            // Behind an endpoint picker, a decode worker's sidecar runs the prefill step first.
            let Some(shim) = ctx
                .pd_shim
                .clone()
                .filter(|_| ctx.role == WorkerRole::Decode)
            else {
                return serve(ctx, api, &headers, &body).await;
            };
            let path = match api {
                OpenAi::Completions => "/v1/completions",
                OpenAi::Chat => "/v1/chat/completions",
            };
            match shim.before_serve(&ctx, path, &mut headers, body).await {
                super::pd_shim::Step::Serve {
                    body,
                    prefill_failed,
                } => super::pd_shim::mark(serve(ctx, api, &headers, &body).await, prefill_failed),
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

async fn serve(ctx: Arc<WorkerContext>, api: OpenAi, headers: &HeaderMap, body: &[u8]) -> Response {
    let req = match parse(api, body) {
        Ok(r) => r,
        Err(m) => return invalid(&m),
    };
    let shared = &ctx.shared;
    let remote_decode = req
        .transfer
        .as_ref()
        .and_then(|p| p.get("do_remote_decode"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let remote_prefill = req
        .transfer
        .as_ref()
        .and_then(|p| p.get("do_remote_prefill"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let index = match find_prompt(&ctx, &req.text, !remote_decode) {
        Ok(i) => i,
        Err(answer) => return *answer,
    };
    let prompt_tokens = shared.trace.requests[index].input_length;
    if remote_decode {
        return hold_for_decode(&ctx, api, headers, index, prompt_tokens);
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
        if p.1 != index {
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
    let job = shared.job(index, req.max_tokens);
    let output = job.output;
    let Some(mut progress) = shared.start_on_engine(index, job, part) else {
        return shutting_down();
    };
    let answer = Answer {
        api,
        model: shared.model.clone(),
        id: format!("cmpl-r{index}"),
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

/// The held request `transfer` names: (prefill worker, trace index), when it is there.
fn pull(ctx: &WorkerContext, transfer: &Map<String, Value>) -> Option<(WorkerId, usize)> {
    let engine = transfer.get("remote_engine_id")?.as_str()?;
    let id = transfer.get("remote_request_id")?.as_str()?;
    let p = ctx.shared.worker_named(engine)?;
    let hold = ctx.shared.pull(p, id)?;
    Some((p, hold.index))
}

/// A prefill worker's answer to `do_remote_decode`: the request is held for a decode
/// worker's pull, and the parameters to pull it by are returned.
fn hold_for_decode(
    ctx: &WorkerContext,
    api: OpenAi,
    headers: &HeaderMap,
    index: usize,
    prompt_tokens: u64,
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
    ctx.shared.hold(ctx.id, remote_id.clone(), index, expires);
    let r = &ctx.shared.trace.requests[index];
    let blocks: Vec<u64> = (0..r.hash_ids.len() as u64).collect();
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
        id: format!("cmpl-r{index}"),
        prompt_tokens,
        output: 1,
    };
    json_response(StatusCode::OK, &answer.whole(0, params))
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
                    let rest = output_text(answer.output.saturating_sub(1));
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
        assert!(parse(OpenAi::Completions, br#"{"prompt": [1, 2]}"#).is_err());
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
