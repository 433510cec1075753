//! The coding agents' own APIs as vLLM's API server reads them: Anthropic's Messages API
//! (`POST /v1/messages`, what Claude Code speaks) and OpenAI's Responses API
//! (`POST /v1/responses`, what Codex CLI speaks), shared by the router (which hashes their
//! prompts) and the simulated workers (which serve them).
//!
//! vLLM serves both by turning the request into chat messages and applying the model's chat
//! template (`vllm/entrypoints/anthropic/serving.py`, `vllm/entrypoints/openai/responses`).
//! The functions here turn a request into the same sequence of messages, `(role, text)` in
//! order, closely enough for what a router needs of it: a request that extends another's
//! conversation (the previous request's messages, then the reply, a tool result, the next user
//! message) has the previous request's messages as its first messages, each rendered the same.
//! Tool calls and tool results are text of their own (the call's name and arguments, the
//! result's content), so two turns that differ only in a tool's output differ from there on.
//!
//! - Messages: `system` (a string, or text blocks joined) is the first message; Claude Code's
//!   attribution block (`x-anthropic-billing-header…`, a hash that changes with every request)
//!   is left out, as vLLM leaves it out. Each message's `tool_result` blocks become `tool`
//!   messages of their own, before the rest of that message (vLLM's order); `text`,
//!   `thinking` and `tool_use` blocks are the message's text; images and documents add none.
//! - Responses: `instructions` is the first message (`system`); `input` is a string (one user
//!   message) or items: messages (`input_text` / `output_text` parts), `function_call`
//!   (assistant), `function_call_output` (`tool`), `reasoning` (its summary, assistant), and
//!   any other item as its type and its JSON.

use serde_json::{Map, Value};

/// The prefix of the system block Claude Code adds to every request (a per-request hash, so
/// no two requests would share their first block); vLLM drops it before the chat template.
pub const CLAUDE_BILLING_BLOCK_PREFIX: &str = "x-anthropic-billing-header";

/// Anthropic's `error.type` for an error answered with HTTP `status` (the types of
/// Anthropic's API reference), for errors written in the Messages API's shape.
pub fn anthropic_error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Chat messages, `(role, text)` in order.
pub type ChatMessages = Vec<(String, String)>;

fn field_str<'a>(obj: &'a Map<String, Value>, key: &str, what: &str) -> Result<&'a str, String> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s),
        _ => Err(format!("`{what}` must be a string")),
    }
}

/// The text of Anthropic content: a string, or blocks whose `text` parts are joined (`what`
/// names the field in errors). Tool results nest content of this shape.
fn anthropic_text(content: &Value, what: &str) -> Result<String, String> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (i, b) in blocks.iter().enumerate() {
                let Value::Object(b) = b else {
                    return Err(format!("`{what}[{i}]` must be an object"));
                };
                if b.get("type").and_then(Value::as_str) == Some("text") {
                    text.push_str(field_str(b, "text", &format!("{what}[{i}].text"))?);
                }
            }
            Ok(text)
        }
        _ => Err(format!("`{what}` must be a string or an array of blocks")),
    }
}

/// The messages of an Anthropic Messages request (see the module docs), or what is wrong
/// with it.
///
/// ```
/// use kvc_core::agent_apis::messages_chat;
/// use serde_json::json;
///
/// let body = json!({"model": "m", "max_tokens": 8,
///     "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
///                {"type": "text", "text": "You code."}],
///     "messages": [{"role": "user", "content": "fix it"},
///         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
///             "name": "Read", "input": {"path": "a.rs"}}]},
///         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
///             "content": "fn main() {}"}, {"type": "text", "text": "go on"}]}]});
/// let m = messages_chat(body.as_object().unwrap()).unwrap();
/// let roles: Vec<&str> = m.iter().map(|(r, _)| r.as_str()).collect();
/// assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
/// assert_eq!(m[0].1, "You code.");
/// assert_eq!(m[3].1, "fn main() {}");
/// ```
pub fn messages_chat(body: &Map<String, Value>) -> Result<ChatMessages, String> {
    let mut out = ChatMessages::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            if !s.is_empty() && !s.starts_with(CLAUDE_BILLING_BLOCK_PREFIX) {
                out.push(("system".to_owned(), s.clone()));
            }
        }
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (i, b) in blocks.iter().enumerate() {
                let Value::Object(b) = b else {
                    return Err(format!("`system[{i}]` must be an object"));
                };
                if b.get("type").and_then(Value::as_str) == Some("text") {
                    let t = field_str(b, "text", &format!("system[{i}].text"))?;
                    if !t.starts_with(CLAUDE_BILLING_BLOCK_PREFIX) {
                        text.push_str(t);
                    }
                }
            }
            if !text.is_empty() {
                out.push(("system".to_owned(), text));
            }
        }
        Some(_) => return Err("`system` must be a string or an array of blocks".to_owned()),
    }
    let messages = match body.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err("`messages` is empty".to_owned()),
        Some(_) => return Err("`messages` must be an array".to_owned()),
        None => return Err("missing `messages`".to_owned()),
    };
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(format!("`messages[{i}]` must be an object"));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) if !r.is_empty() => r.clone(),
            _ => return Err(format!("`messages[{i}].role` must be a non-empty string")),
        };
        let blocks = match m.get("content") {
            Some(Value::String(s)) => {
                out.push((role, s.clone()));
                continue;
            }
            Some(Value::Array(b)) => b,
            _ => {
                return Err(format!(
                    "`messages[{i}].content` must be a string or an array of blocks"
                ));
            }
        };
        let mut text = String::new();
        for (j, b) in blocks.iter().enumerate() {
            let what = format!("messages[{i}].content[{j}]");
            let Value::Object(b) = b else {
                return Err(format!("`{what}` must be an object"));
            };
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.push_str(field_str(b, "text", &format!("{what}.text"))?),
                Some("thinking") => {
                    if let Some(Value::String(t)) = b.get("thinking") {
                        text.push_str(t);
                    }
                }
                Some("tool_use") => {
                    let name = b.get("name").and_then(Value::as_str).unwrap_or("");
                    let input = b.get("input").cloned().unwrap_or(Value::Null);
                    text.push_str(&format!("<tool_use {name}>{input}</tool_use>"));
                }
                Some("tool_result") => {
                    let content = b.get("content").unwrap_or(&Value::Null);
                    let result = anthropic_text(content, &format!("{what}.content"))?;
                    out.push(("tool".to_owned(), result));
                }
                Some(_) => {}
                None => return Err(format!("`{what}.type` must be a string")),
            }
        }
        // A user message of tool results alone adds no user message (as in vLLM).
        if !(role == "user" && text.is_empty() && blocks.iter().any(is_tool_result)) {
            out.push((role, text));
        }
    }
    Ok(out)
}

fn is_tool_result(b: &Value) -> bool {
    b.get("type").and_then(Value::as_str) == Some("tool_result")
}

/// The text of a Responses message's `content`: a string, or parts whose `text` is joined
/// (`input_text`, `output_text`, `text`, `refusal`'s `refusal`); images and files add none.
fn response_content_text(content: &Value, what: &str) -> Result<String, String> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (i, p) in parts.iter().enumerate() {
                let Value::Object(p) = p else {
                    return Err(format!("`{what}[{i}]` must be an object"));
                };
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        text.push_str(field_str(p, "text", &format!("{what}[{i}].text"))?);
                    }
                    Some("refusal") => {
                        if let Some(Value::String(r)) = p.get("refusal") {
                            text.push_str(r);
                        }
                    }
                    _ => {}
                }
            }
            Ok(text)
        }
        _ => Err(format!("`{what}` must be a string or an array of parts")),
    }
}

/// The messages of an OpenAI Responses request (see the module docs), or what is wrong with
/// it. A request continuing a stored response (`previous_response_id`) is refused: its
/// conversation is held by the engine that stored it, not in the request.
///
/// ```
/// use kvc_core::agent_apis::responses_chat;
/// use serde_json::json;
///
/// let body = json!({"model": "m", "instructions": "You code.", "store": false,
///     "input": [{"type": "message", "role": "user",
///                "content": [{"type": "input_text", "text": "list files"}]},
///         {"type": "function_call", "name": "shell", "arguments": "{\"cmd\":\"ls\"}",
///          "call_id": "c1"},
///         {"type": "function_call_output", "call_id": "c1", "output": "a.rs"}]});
/// let m = responses_chat(body.as_object().unwrap()).unwrap();
/// let roles: Vec<&str> = m.iter().map(|(r, _)| r.as_str()).collect();
/// assert_eq!(roles, ["system", "user", "assistant", "tool"]);
/// assert_eq!(m[3].1, "a.rs");
/// ```
pub fn responses_chat(body: &Map<String, Value>) -> Result<ChatMessages, String> {
    if body
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(
            "`previous_response_id` is not supported through the router: the \
                    conversation would be held by the one engine that stored that response; \
                    send the whole conversation in `input` (with `store: false`)"
                .to_owned(),
        );
    }
    let mut out = ChatMessages::new();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            if !s.is_empty() {
                out.push(("system".to_owned(), s.clone()));
            }
        }
        Some(_) => return Err("`instructions` must be a string".to_owned()),
    }
    let items = match body.get("input") {
        Some(Value::String(s)) => {
            out.push(("user".to_owned(), s.clone()));
            return Ok(out);
        }
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) => return Err("`input` is empty".to_owned()),
        Some(_) => return Err("`input` must be a string or an array of items".to_owned()),
        None => return Err("missing `input`".to_owned()),
    };
    for (i, item) in items.iter().enumerate() {
        let what = format!("input[{i}]");
        let Value::Object(item) = item else {
            return Err(format!("`{what}` must be an object"));
        };
        let kind = match item.get("type") {
            Some(Value::String(t)) => t.as_str(),
            None if item.contains_key("role") => "message",
            _ => return Err(format!("`{what}.type` must be a string")),
        };
        match kind {
            "message" => {
                let role = match item.get("role") {
                    Some(Value::String(r)) if !r.is_empty() => r.clone(),
                    _ => return Err(format!("`{what}.role` must be a non-empty string")),
                };
                let content = item.get("content").unwrap_or(&Value::Null);
                out.push((
                    role,
                    response_content_text(content, &format!("{what}.content"))?,
                ));
            }
            "function_call" => {
                let name = item.get("name").and_then(Value::as_str).unwrap_or("");
                let arguments = item.get("arguments").and_then(Value::as_str).unwrap_or("");
                out.push((
                    "assistant".to_owned(),
                    format!("<tool_call {name}>{arguments}</tool_call>"),
                ));
            }
            "function_call_output" => {
                let output = item.get("output").unwrap_or(&Value::Null);
                let text = match output {
                    Value::String(s) => s.clone(),
                    other => response_content_text(other, &format!("{what}.output"))?,
                };
                out.push(("tool".to_owned(), text));
            }
            "reasoning" => {
                let mut text = String::new();
                for key in ["summary", "content"] {
                    if let Some(Value::Array(parts)) = item.get(key) {
                        for p in parts {
                            if let Some(t) = p.get("text").and_then(Value::as_str) {
                                text.push_str(t);
                            }
                        }
                    }
                }
                out.push(("assistant".to_owned(), text));
            }
            other => out.push((other.to_owned(), Value::Object(item.clone()).to_string())),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn pairs(m: &[(&str, &str)]) -> ChatMessages {
        m.iter()
            .map(|(r, t)| ((*r).to_owned(), (*t).to_owned()))
            .collect()
    }

    #[test]
    fn a_messages_conversation_that_grows_keeps_its_messages_as_its_prefix() {
        let turn1 = json!({"max_tokens": 4, "system": "S",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "q",
                "cache_control": {"type": "ephemeral"}}]}]});
        let turn2 = json!({"max_tokens": 4, "system": "S",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm",
                    "signature": "x"}, {"type": "text", "text": "a"},
                    {"type": "tool_use", "id": "t", "name": "Bash", "input": {"c": "ls"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                    "content": [{"type": "text", "text": "out"}]}]}]});
        let a = messages_chat(&obj(turn1)).unwrap();
        let b = messages_chat(&obj(turn2)).unwrap();
        assert_eq!(a, pairs(&[("system", "S"), ("user", "q")]));
        assert_eq!(&b[..2], &a[..]);
        assert_eq!(
            &b[2..],
            &pairs(&[
                ("assistant", "hma<tool_use Bash>{\"c\":\"ls\"}</tool_use>"),
                ("tool", "out")
            ])[..]
        );
    }

    #[test]
    fn the_billing_block_changes_nothing() {
        let with = |hash: &str| {
            messages_chat(&obj(json!({"system": [
                {"type": "text", "text": format!("{CLAUDE_BILLING_BLOCK_PREFIX}: cch={hash};")},
                {"type": "text", "text": "S"}],
                "messages": [{"role": "user", "content": "q"}]})))
            .unwrap()
        };
        assert_eq!(with("1"), with("2"));
        assert_eq!(with("1")[0], ("system".to_owned(), "S".to_owned()));
    }

    #[test]
    fn malformed_messages_requests_are_refused_with_a_reason() {
        let cases = [
            (json!({}), "missing `messages`"),
            (json!({"messages": []}), "empty"),
            (json!({"messages": [1]}), "`messages[0]` must be an object"),
            (
                json!({"messages": [{"content": "a"}]}),
                "`messages[0].role`",
            ),
            (
                json!({"messages": [{"role": "user", "content": 5}]}),
                "`messages[0].content`",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
                "`messages[0].content[0].text`",
            ),
            (
                json!({"system": 3, "messages": [{"role": "user", "content": "a"}]}),
                "`system`",
            ),
        ];
        for (body, want) in cases {
            let e = messages_chat(&obj(body.clone())).unwrap_err();
            assert!(e.contains(want), "{body}: {e}");
        }
    }

    #[test]
    fn responses_inputs_in_every_shape() {
        let m = responses_chat(&obj(json!({"input": "hi"}))).unwrap();
        assert_eq!(m, pairs(&[("user", "hi")]));
        let m = responses_chat(&obj(json!({"instructions": "S", "input": [
            {"role": "developer", "content": "D"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}],
             "encrypted_content": "zzz"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "a"}]},
            {"type": "local_shell_call", "call_id": "c", "action": {"command": ["ls"]}}]})))
        .unwrap();
        assert_eq!(
            &m[..4],
            &pairs(&[
                ("system", "S"),
                ("developer", "D"),
                ("assistant", "r"),
                ("assistant", "a")
            ])[..]
        );
        assert_eq!(m[4].0, "local_shell_call");
        assert!(m[4].1.contains("\"ls\""));
        for (body, want) in [
            (json!({}), "missing `input`"),
            (json!({"input": []}), "empty"),
            (json!({"input": 3}), "`input`"),
            (json!({"input": [{"content": "x"}]}), "`input[0].type`"),
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (json!({"input": "x", "instructions": 1}), "`instructions`"),
        ] {
            let e = responses_chat(&obj(body.clone())).unwrap_err();
            assert!(e.contains(want), "{body}: {e}");
        }
    }
}
