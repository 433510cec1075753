//! The shapes of the coding agents' APIs as vLLM serves them (`vllm/entrypoints/anthropic`,
//! `vllm/entrypoints/openai/responses`): Anthropic Messages answers, stream events and errors,
//! OpenAI Responses objects and stream events. The requests' prompts are
//! [`kvc_core::agent_apis`]'; the flow (holds, pulls, the engine) is `vllm`'s.

use super::sglang::json_response;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use kvc_core::sse;
use serde_json::{Map, Value, json};

/// An SSE event with its `event:` line, as vLLM writes those of both APIs.
pub(super) fn named_event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\n{}", sse::event(&data.to_string())))
}

/// Anthropic's `error.type` for an answer of `status`.
pub(super) fn anthropic_error_type(status: StatusCode) -> &'static str {
    kvc_core::agent_apis::anthropic_error_type(status.as_u16())
}

/// `{"type": "error", "error": {"type", "message"}}`: an Anthropic error body.
pub(super) fn anthropic_error_body(status: StatusCode, message: &str) -> Value {
    json!({ "type": "error",
            "error": { "type": anthropic_error_type(status), "message": message } })
}

/// An Anthropic error answer.
pub(super) fn anthropic_error(status: StatusCode, message: &str) -> Response {
    json_response(status, &anthropic_error_body(status, message))
}

/// Messages `usage` (vLLM's `_build_anthropic_usage`): `input_tokens` are the prompt tokens
/// not read from a cache, `cache_read_input_tokens` those that were.
pub(super) fn messages_usage(prompt: u64, output: u64, cached: u64) -> Value {
    json!({
        "input_tokens": prompt.saturating_sub(cached),
        "output_tokens": output,
        "cache_read_input_tokens": cached,
    })
}

/// A whole Messages answer (vLLM drops its null fields: `stop_sequence`, and
/// `kv_transfer_params` but on a prefill worker's answer).
pub(super) fn messages_whole(
    id: &str,
    model: &str,
    text: &str,
    usage: Value,
    transfer: Value,
) -> Value {
    let mut v = json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "content": [{ "type": "text", "text": text }],
        "model": model,
        "stop_reason": "max_tokens",
        "usage": usage,
    });
    if !transfer.is_null() {
        v["kv_transfer_params"] = transfer;
    }
    v
}

/// The events of a Messages stream at its first token: `message_start` (its usage the
/// prompt's tokens, none generated yet, as vLLM's first chunk has no cache details),
/// `content_block_start` of the text block, and the first `text_delta`.
pub(super) fn messages_first(id: &str, model: &str, prompt: u64, first: &str) -> Vec<Bytes> {
    let start = json!({
        "type": "message_start",
        "message": {
            "id": id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": model,
            "stop_reason": null,
            "stop_sequence": null,
            "usage": { "input_tokens": prompt, "output_tokens": 0 },
        },
    });
    vec![
        named_event("message_start", &start),
        named_event(
            "content_block_start",
            &json!({ "type": "content_block_start", "index": 0,
                     "content_block": { "type": "text", "text": "" } }),
        ),
        messages_text_delta(first),
    ]
}

fn messages_text_delta(text: &str) -> Bytes {
    named_event(
        "content_block_delta",
        &json!({ "type": "content_block_delta", "index": 0,
                 "delta": { "type": "text_delta", "text": text } }),
    )
}

/// The events that end a Messages stream: the rest of the text (when there is any),
/// `content_block_stop`, `message_delta` with the stop reason and the final usage,
/// `message_stop`.
pub(super) fn messages_last(rest: &str, usage: Value) -> Vec<Bytes> {
    let mut v = Vec::with_capacity(4);
    if !rest.is_empty() {
        v.push(messages_text_delta(rest));
    }
    v.push(named_event(
        "content_block_stop",
        &json!({ "type": "content_block_stop", "index": 0 }),
    ));
    v.push(named_event(
        "message_delta",
        &json!({ "type": "message_delta",
                 "delta": { "stop_reason": "max_tokens", "stop_sequence": null },
                 "usage": usage }),
    ));
    v.push(named_event(
        "message_stop",
        &json!({ "type": "message_stop" }),
    ));
    v
}

/// The `error` event that ends a Messages stream the engine failed.
pub(super) fn messages_error_event(status: StatusCode, message: &str) -> Bytes {
    named_event("error", &anthropic_error_body(status, message))
}

/// The fields of a Responses request its answer repeats (vLLM's
/// `ResponsesResponse.from_request`), with vLLM's defaults.
pub(super) fn responses_echo(obj: &Map<String, Value>) -> Map<String, Value> {
    let get = |key: &str, default: Value| match obj.get(key) {
        None | Some(Value::Null) => default,
        Some(v) => v.clone(),
    };
    let mut m = Map::new();
    m.insert("instructions".into(), get("instructions", Value::Null));
    m.insert("metadata".into(), get("metadata", Value::Null));
    m.insert(
        "parallel_tool_calls".into(),
        get("parallel_tool_calls", Value::Bool(true)),
    );
    m.insert("temperature".into(), get("temperature", json!(1.0)));
    m.insert("tool_choice".into(), get("tool_choice", json!("auto")));
    m.insert("tools".into(), get("tools", json!([])));
    m.insert("top_p".into(), get("top_p", json!(1.0)));
    m.insert("background".into(), get("background", Value::Bool(false)));
    m.insert("max_tool_calls".into(), get("max_tool_calls", Value::Null));
    m.insert("previous_response_id".into(), Value::Null);
    m.insert("prompt".into(), get("prompt", Value::Null));
    m.insert("reasoning".into(), get("reasoning", Value::Null));
    m.insert("service_tier".into(), get("service_tier", json!("auto")));
    m.insert("text".into(), get("text", Value::Null));
    m.insert("truncation".into(), get("truncation", json!("disabled")));
    m.insert("user".into(), get("user", Value::Null));
    m
}

/// Responses `usage`: `input_tokens` is the whole prompt, `input_tokens_details.cached_tokens`
/// the part read from a cache (cache writes are not modelled: `cache_write_tokens` 0).
pub(super) fn responses_usage(prompt: u64, output: u64, cached: u64) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    })
}

/// One Responses answer's identity and request echo.
#[derive(Debug, Clone)]
pub(super) struct ResponseIds {
    /// The response's `id` (`resp_…`).
    pub(super) id: String,
    /// Its output message's `id` (`msg_…`).
    pub(super) item_id: String,
    pub(super) model: String,
    /// The request's fields the response repeats ([`responses_echo`]).
    pub(super) echo: Map<String, Value>,
    /// When the response was created (Unix seconds).
    pub(super) created_at: u64,
}

/// The output message of a Responses answer holding `text`.
fn output_message(item_id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [{ "type": "output_text", "text": text, "annotations": [],
                      "logprobs": null }],
    })
}

impl ResponseIds {
    /// The response object: `done` with `text` generated up to `output` tokens (the limit,
    /// so vLLM's `status` is `incomplete` with `incomplete_details.reason:
    /// max_output_tokens`), or in progress (no output, no usage).
    pub(super) fn response(
        &self,
        done: Option<(&str, Value)>,
        max_output_tokens: u64,
        transfer: Value,
    ) -> Value {
        let mut v = Map::new();
        v.insert("id".into(), json!(self.id));
        v.insert("object".into(), json!("response"));
        v.insert("created_at".into(), json!(self.created_at));
        v.insert("model".into(), json!(self.model));
        v.extend(self.echo.clone());
        v.insert("max_output_tokens".into(), json!(max_output_tokens));
        match done {
            Some((text, usage)) => {
                v.insert("status".into(), json!("incomplete"));
                v.insert(
                    "incomplete_details".into(),
                    json!({ "reason": "max_output_tokens" }),
                );
                v.insert(
                    "output".into(),
                    json!([output_message(&self.item_id, text, "completed")]),
                );
                v.insert("usage".into(), usage);
            }
            None => {
                v.insert("status".into(), json!("in_progress"));
                v.insert("incomplete_details".into(), Value::Null);
                v.insert("output".into(), json!([]));
                v.insert("usage".into(), Value::Null);
            }
        }
        v.insert("kv_transfer_params".into(), transfer);
        Value::Object(v)
    }
}

/// A Responses stream's events, numbered in order (`sequence_number`).
#[derive(Debug)]
pub(super) struct ResponsesStream {
    pub(super) ids: ResponseIds,
    pub(super) max_output_tokens: u64,
    next: u64,
}

impl ResponsesStream {
    pub(super) fn new(ids: ResponseIds, max_output_tokens: u64) -> Self {
        ResponsesStream {
            ids,
            max_output_tokens,
            next: 0,
        }
    }

    fn event(&mut self, name: &str, mut data: Value) -> Bytes {
        data["type"] = json!(name);
        data["sequence_number"] = json!(self.next);
        self.next += 1;
        named_event(name, &data)
    }

    /// `response.created` and `response.in_progress`, sent as the stream opens.
    pub(super) fn opening(&mut self) -> Vec<Bytes> {
        let r = self.ids.response(None, self.max_output_tokens, Value::Null);
        vec![
            self.event("response.created", json!({ "response": r.clone() })),
            self.event("response.in_progress", json!({ "response": r })),
        ]
    }

    fn text_delta(&mut self, delta: &str) -> Bytes {
        let item_id = self.ids.item_id.clone();
        self.event(
            "response.output_text.delta",
            json!({ "output_index": 0, "content_index": 0, "item_id": item_id,
                    "delta": delta, "logprobs": [] }),
        )
    }

    /// At the first token: the output message and its text part added, the first delta.
    pub(super) fn first(&mut self, first: &str) -> Vec<Bytes> {
        let item_id = self.ids.item_id.clone();
        vec![
            self.event(
                "response.output_item.added",
                json!({ "output_index": 0, "item": { "type": "message", "id": item_id,
                        "role": "assistant", "status": "in_progress", "content": [] } }),
            ),
            self.event(
                "response.content_part.added",
                json!({ "output_index": 0, "content_index": 0, "item_id": item_id,
                        "part": { "type": "output_text", "text": "", "annotations": [],
                                  "logprobs": [] } }),
            ),
            self.text_delta(first),
        ]
    }

    /// At the end: the rest of the text (when there is any), the text, part and item done,
    /// then `response.completed` carrying the response with its usage.
    pub(super) fn last(&mut self, rest: &str, text: &str, usage: Value) -> Vec<Bytes> {
        let item_id = self.ids.item_id.clone();
        let mut v = Vec::with_capacity(5);
        if !rest.is_empty() {
            v.push(self.text_delta(rest));
        }
        let part = json!({ "type": "output_text", "text": text, "annotations": [],
                           "logprobs": null });
        v.push(self.event(
            "response.output_text.done",
            json!({ "output_index": 0, "content_index": 0, "item_id": item_id,
                    "text": text, "logprobs": [] }),
        ));
        v.push(self.event(
            "response.content_part.done",
            json!({ "output_index": 0, "content_index": 0, "item_id": item_id,
                    "part": part }),
        ));
        v.push(self.event(
            "response.output_item.done",
            json!({ "output_index": 0,
                    "item": output_message(&item_id, text, "completed") }),
        ));
        let response = self
            .ids
            .response(Some((text, usage)), self.max_output_tokens, Value::Null);
        v.push(self.event("response.completed", json!({ "response": response })));
        v
    }

    /// The `error` event that ends a stream the engine failed.
    pub(super) fn error(&mut self, message: &str) -> Bytes {
        self.event(
            "error",
            json!({ "code": "worker_error", "message": message, "param": null }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(b: &Bytes) -> (String, Value) {
        let s = std::str::from_utf8(b).unwrap();
        let (event, rest) = s.split_once('\n').unwrap();
        let data = rest.strip_prefix("data: ").unwrap().trim_end();
        (
            event.strip_prefix("event: ").unwrap().to_owned(),
            serde_json::from_str(data).unwrap(),
        )
    }

    #[test]
    fn messages_usage_counts_the_cached_tokens_apart() {
        assert_eq!(
            messages_usage(65, 3, 48),
            json!({"input_tokens": 17, "output_tokens": 3, "cache_read_input_tokens": 48})
        );
        let w = messages_whole("msg_1", "m", "tok", messages_usage(5, 1, 0), Value::Null);
        assert!(w.get("kv_transfer_params").is_none() && w.get("stop_sequence").is_none());
        let e = anthropic_error_body(StatusCode::BAD_REQUEST, "no");
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(
            anthropic_error_type(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error"
        );
        assert_eq!(
            anthropic_error_type(StatusCode::INTERNAL_SERVER_ERROR),
            "api_error"
        );
    }

    #[test]
    fn responses_streams_number_their_events() {
        let ids = ResponseIds {
            id: "resp_1".into(),
            item_id: "msg_1".into(),
            model: "m".into(),
            echo: responses_echo(&Map::new()),
            created_at: 7,
        };
        let mut s = ResponsesStream::new(ids, 2);
        let mut events = s.opening();
        events.extend(s.first("tok"));
        events.extend(s.last(" tok", "tok tok", responses_usage(9, 2, 0)));
        let got: Vec<(String, u64)> = events
            .iter()
            .map(|b| {
                let (e, d) = data(b);
                assert_eq!(d["type"], e.as_str());
                (e, d["sequence_number"].as_u64().unwrap())
            })
            .collect();
        let names: Vec<&str> = got.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        assert!(got.iter().enumerate().all(|(i, (_, n))| *n == i as u64));
        let (_, done) = data(events.last().unwrap());
        assert_eq!(done["response"]["usage"]["total_tokens"], 11);
        assert_eq!(
            done["response"]["output"][0]["content"][0]["text"],
            "tok tok"
        );
        assert_eq!(done["response"]["tools"], json!([]));
    }

    #[test]
    fn a_failed_stream_ends_with_an_error_event_in_its_api_s_shape() {
        let (name, e) = data(&messages_error_event(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy",
        ));
        assert_eq!(name, "error");
        assert_eq!(
            e,
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
        );
        let ids = ResponseIds {
            id: "resp_1".into(),
            item_id: "msg_1".into(),
            model: "m".into(),
            echo: Map::new(),
            created_at: 0,
        };
        let mut s = ResponsesStream::new(ids, 2);
        let opened = s.opening().len() as u64;
        let (name, e) = data(&s.error("gone"));
        assert_eq!(name, "error");
        assert_eq!(
            e,
            json!({"type": "error", "code": "worker_error", "message": "gone", "param": null,
                   "sequence_number": opened})
        );
    }
}
