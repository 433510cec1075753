//! Request and answer bodies as vLLM's API server reads and writes them, shared by the router
//! (which builds and reads them) and the simulated workers (which read and build them): a chat
//! message's text, the APIs a request can go through ([`VllmApi`]), the prefill worker's body
//! for NixlConnector P/D in each, and the generated and cached token counts of an answer in
//! each API's shape.

use serde_json::{Map, Value, json};

/// The text of a chat message's `content` (`index`: the message's position, for the error):
/// a string, `null` (empty), or an array of part objects whose `text` parts are concatenated
/// (other parts, e.g. images, add no text).
///
/// ```
/// use serde_json::json;
/// use kvc_core::openai::message_text;
///
/// let parts = json!([{"type": "text", "text": "a "}, {"type": "image_url"}, {"type": "text", "text": "b"}]);
/// assert_eq!(message_text(Some(&parts), 0).unwrap(), "a b");
/// assert_eq!(message_text(None, 0).unwrap(), "");
/// assert!(message_text(Some(&json!(7)), 3).unwrap_err().contains("messages[3]"));
/// ```
pub fn message_text(content: Option<&Value>, index: usize) -> Result<String, String> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                let Value::Object(part) = part else {
                    return Err(format!("`messages[{index}].content` parts must be objects"));
                };
                if part.get("type").and_then(Value::as_str) == Some("text") {
                    match part.get("text") {
                        Some(Value::String(t)) => text.push_str(t),
                        _ => {
                            return Err(format!(
                                "`messages[{index}].content`: a text part needs a string `text`"
                            ));
                        }
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(format!(
            "`messages[{index}].content` must be a string, an array of parts or null"
        )),
    }
}

/// The APIs of vLLM's OpenAI-compatible server that a request can be sent through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmApi {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/messages` (Anthropic).
    Messages,
    /// `POST /v1/responses` (OpenAI Responses).
    Responses,
}

impl VllmApi {
    /// The field a request's output limit is in.
    pub fn output_limit_field(self) -> &'static str {
        match self {
            VllmApi::Completions | VllmApi::ChatCompletions | VllmApi::Messages => "max_tokens",
            VllmApi::Responses => "max_output_tokens",
        }
    }
}

/// The body for the prefill worker of a NixlConnector P→D request through `api`: the
/// client's body with `kv_transfer_params` asking for a remote decode (`do_remote_decode:
/// true`, the `remote_*` fields null), `stream: false` and an output limit of one token (the
/// API's own field: `max_tokens`, or `max_output_tokens` for Responses; also
/// `max_completion_tokens` when a chat client set it), without `stream_options` and
/// `min_tokens`. A Responses prefill is not stored (`store: false`): nobody reads it.
pub fn nixl_prefill_body(body: &Map<String, Value>, api: VllmApi) -> Map<String, Value> {
    let mut p = body.clone();
    p.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    p.insert("stream".into(), Value::Bool(false));
    p.insert(api.output_limit_field().into(), Value::from(1));
    if p.contains_key("max_completion_tokens") {
        p.insert("max_completion_tokens".into(), Value::from(1));
    }
    if api == VllmApi::Responses {
        p.insert("store".into(), Value::Bool(false));
    }
    p.remove("stream_options");
    p.remove("min_tokens");
    p
}

/// Tokens generated, as an answer (or a stream event) of any of these APIs reports them:
/// OpenAI `usage.completion_tokens`, Messages and Responses `usage.output_tokens` (a
/// Responses stream's `response.completed` event: `response.usage.output_tokens`), SGLang
/// `meta_info.completion_tokens`.
pub fn completion_tokens_of(v: &Value) -> Option<u64> {
    [
        "/meta_info/completion_tokens",
        "/usage/completion_tokens",
        "/usage/output_tokens",
        "/response/usage/output_tokens",
    ]
    .iter()
    .find_map(|p| v.pointer(p))
    .and_then(Value::as_u64)
}

/// Prompt tokens an answer (or a stream event) says the engine served from its prefix cache:
/// OpenAI `usage.prompt_tokens_details.cached_tokens`, Messages
/// `usage.cache_read_input_tokens` (a stream's `message_delta`), Responses
/// `usage.input_tokens_details.cached_tokens` (a stream's `response.completed`:
/// under `response`), SGLang `meta_info.cached_tokens`.
pub fn cached_tokens_of(v: &Value) -> Option<u64> {
    [
        "/usage/prompt_tokens_details/cached_tokens",
        "/meta_info/cached_tokens",
        "/usage/cache_read_input_tokens",
        "/usage/input_tokens_details/cached_tokens",
        "/response/usage/input_tokens_details/cached_tokens",
    ]
    .iter()
    .find_map(|p| v.pointer(p))
    .and_then(Value::as_u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn the_prefill_body_asks_for_a_remote_decode_of_one_token() {
        let client = json!({"model": "m", "prompt": "a b", "stream": true,
            "max_tokens": 64, "min_tokens": 3, "stream_options": {"include_usage": true},
            "temperature": 0.0});
        let p = nixl_prefill_body(client.as_object().unwrap(), VllmApi::Completions);
        assert_eq!(
            Value::Object(p),
            json!({"model": "m", "prompt": "a b", "stream": false, "max_tokens": 1,
                "temperature": 0.0, "kv_transfer_params": {"do_remote_decode": true,
                "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null}})
        );
        let chat = json!({"messages": [], "max_completion_tokens": 9});
        let p = nixl_prefill_body(chat.as_object().unwrap(), VllmApi::ChatCompletions);
        assert_eq!(p["max_completion_tokens"], 1);
        assert_eq!(p["max_tokens"], 1);
    }

    #[test]
    fn message_parts_must_be_objects_and_text_parts_need_text() {
        let e = message_text(Some(&json!(["x"])), 2).unwrap_err();
        assert_eq!(e, "`messages[2].content` parts must be objects");
        let e = message_text(Some(&json!([{"type": "text"}])), 1).unwrap_err();
        assert_eq!(
            e,
            "`messages[1].content`: a text part needs a string `text`"
        );
        assert_eq!(message_text(Some(&json!("hi")), 0).unwrap(), "hi");
    }

    #[test]
    fn prefill_bodies_limit_the_output_in_each_api_s_own_field() {
        let r = nixl_prefill_body(
            &obj(json!({"input": "x", "max_output_tokens": 50, "stream": true, "store": true})),
            VllmApi::Responses,
        );
        assert_eq!(r["max_output_tokens"], 1);
        assert_eq!(r["store"], false);
        assert_eq!(r["stream"], false);
        assert!(!r.contains_key("max_tokens"));
        assert_eq!(r["kv_transfer_params"]["do_remote_decode"], true);
        let m = nixl_prefill_body(
            &obj(json!({"messages": [], "max_tokens": 50, "stream": true})),
            VllmApi::Messages,
        );
        assert_eq!(m["max_tokens"], 1);
        assert!(!m.contains_key("store"));
    }

    #[test]
    fn usage_counts_are_read_in_every_api_s_shape() {
        let chat = json!({"usage": {"completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 32}}});
        let messages = json!({"type": "message_delta",
            "usage": {"input_tokens": 5, "output_tokens": 4, "cache_read_input_tokens": 48}});
        let responses = json!({"type": "response.completed", "response": {"usage": {
            "input_tokens": 60, "output_tokens": 6,
            "input_tokens_details": {"cached_tokens": 56, "cache_write_tokens": 0}}}});
        let sglang = json!({"meta_info": {"completion_tokens": 2, "cached_tokens": 1}});
        let got: Vec<_> = [&chat, &messages, &responses, &sglang]
            .iter()
            .map(|v| (completion_tokens_of(v), cached_tokens_of(v)))
            .collect();
        assert_eq!(
            got,
            [
                (Some(3), Some(32)),
                (Some(4), Some(48)),
                (Some(6), Some(56)),
                (Some(2), Some(1))
            ]
        );
        assert_eq!(
            cached_tokens_of(&json!({"usage": {"prompt_tokens": 3}})),
            None
        );
    }
}
