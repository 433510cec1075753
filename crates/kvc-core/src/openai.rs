//! OpenAI-style request bodies as vLLM's API server reads them, shared by the router (which
//! builds them) and the simulated workers (which read and build them): a chat message's text,
//! and the prefill worker's body for NixlConnector P/D.

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

/// The body for the prefill worker of a NixlConnector P→D request: the client's body with
/// `kv_transfer_params` asking for a remote decode (`do_remote_decode: true`, the `remote_*`
/// fields null), `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1` when the
/// client set it), no `stream_options` and no `min_tokens`.
pub fn nixl_prefill_body(body: &Map<String, Value>) -> Map<String, Value> {
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
    p.insert("max_tokens".into(), Value::from(1));
    if p.contains_key("max_completion_tokens") {
        p.insert("max_completion_tokens".into(), Value::from(1));
    }
    p.remove("stream_options");
    p.remove("min_tokens");
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_body_asks_for_a_remote_decode_of_one_token() {
        let client = json!({"model": "m", "prompt": "a b", "stream": true,
            "max_tokens": 64, "min_tokens": 3, "stream_options": {"include_usage": true},
            "temperature": 0.0});
        let p = nixl_prefill_body(client.as_object().unwrap());
        assert_eq!(
            Value::Object(p),
            json!({"model": "m", "prompt": "a b", "stream": false, "max_tokens": 1,
                "temperature": 0.0, "kv_transfer_params": {"do_remote_decode": true,
                "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null}})
        );
        let chat = json!({"messages": [], "max_completion_tokens": 9});
        let p = nixl_prefill_body(chat.as_object().unwrap());
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
}
