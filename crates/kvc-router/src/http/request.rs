//! Parsing of the client request bodies the HTTP front accepts.

use kvc_core::agent_apis::{messages_chat, responses_chat};
use kvc_core::openai::{VllmApi, message_text};
use serde_json::{Map, Value};

pub use kvc_core::text::{
    DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_TOKENS, chat_prompt,
};

fn chat_messages(body: &Map<String, Value>) -> Result<Vec<(String, String)>, String> {
    let Some(messages) = body.get("messages") else {
        return Err("missing `messages`".to_owned());
    };
    let Value::Array(messages) = messages else {
        return Err("`messages` must be an array".to_owned());
    };
    if messages.is_empty() {
        return Err("`messages` is empty".to_owned());
    }
    let mut pairs = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(format!("`messages[{i}]` must be an object"));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) if !r.is_empty() => r.clone(),
            _ => return Err(format!("`messages[{i}].role` must be a non-empty string")),
        };
        pairs.push((role, message_text(m.get("content"), i)?));
    }
    Ok(pairs)
}

/// The prompt of a request: token ids, text to tokenize, or a chat's messages (role, text),
/// tokenized message by message ([`kvc_core::text::chat_tokens`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Prompt {
    Tokens(Vec<u32>),
    Text(String),
    Chat(Vec<(String, String)>),
}

/// A parsed client request: the JSON object to forward, and what routing needs from it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ClientRequest {
    pub(crate) body: Map<String, Value>,
    pub(crate) prompt: Prompt,
    pub(crate) output_hint: u64,
    /// A session key the body carries, as text, and the field it came from
    /// ([`SESSION_PARAMS_SOURCE`] or [`PROMPT_CACHE_KEY_SOURCE`]).
    pub(crate) session_key: Option<(String, &'static str)>,
    /// `stream: true`: the answer is relayed as it arrives.
    pub(crate) stream: bool,
}

/// SGLang's `session_params.id` (`/generate`), as a session key's source.
pub(crate) const SESSION_PARAMS_SOURCE: &str = "session_params";

/// OpenAI's `prompt_cache_key` (Chat Completions, Completions, Responses; Codex CLI sets it to
/// its conversation id), as a session key's source.
pub(crate) const PROMPT_CACHE_KEY_SOURCE: &str = "prompt_cache_key";

/// Anthropic's `metadata.user_id` (Messages), as a session key's source: Claude Code writes
/// there a JSON object whose `session_id` is the run's session (2.1: `{"device_id",
/// "account_uuid", "session_id"}`; earlier versions `user_<…>_session_<id>`). Any other user
/// id names a user, not a conversation, and is not taken.
pub(crate) const METADATA_USER_ID_SOURCE: &str = "metadata.user_id";

/// Every body field a session key can come from, as counted in
/// `kvc_router_http_session_keys_total`.
pub(crate) const BODY_SESSION_SOURCES: [&str; 3] = [
    SESSION_PARAMS_SOURCE,
    PROMPT_CACHE_KEY_SOURCE,
    METADATA_USER_ID_SOURCE,
];

/// The session a Messages request's `metadata.user_id` names, if it names one (see
/// [`METADATA_USER_ID_SOURCE`]).
fn metadata_session(body: &Map<String, Value>) -> Option<(String, &'static str)> {
    let user_id = body.get("metadata")?.get("user_id")?.as_str()?;
    let session = match serde_json::from_str::<Value>(user_id) {
        Ok(Value::Object(o)) => o.get("session_id")?.as_str()?.to_owned(),
        _ => user_id.rsplit_once("_session_")?.1.to_owned(),
    };
    (!session.is_empty()).then_some((session, METADATA_USER_ID_SOURCE))
}

/// `prompt_cache_key`, when the body has a non-empty one.
fn prompt_cache_key(body: &Map<String, Value>) -> Result<Option<(String, &'static str)>, String> {
    match body.get(PROMPT_CACHE_KEY_SOURCE) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some((s.clone(), PROMPT_CACHE_KEY_SOURCE))),
        Some(_) => Err("`prompt_cache_key` must be a non-empty string".to_owned()),
    }
}

/// Which API a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// SGLang `POST /generate`.
    Generate,
    /// OpenAI `POST /v1/completions`.
    Completions,
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions,
    /// Anthropic `POST /v1/messages` (Claude Code's API; vLLM workers only).
    Messages,
    /// OpenAI `POST /v1/responses` (Codex CLI's API; vLLM workers only).
    Responses,
}

impl Api {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Api::Generate => "/generate",
            Api::Completions => "/v1/completions",
            Api::ChatCompletions => "/v1/chat/completions",
            Api::Messages => "/v1/messages",
            Api::Responses => "/v1/responses",
        }
    }

    /// The API as a vLLM server's (SGLang's `/generate` has no vLLM counterpart: a cluster
    /// with vLLM workers refuses it before anything is forwarded).
    pub(crate) fn vllm(self) -> VllmApi {
        match self {
            Api::Generate | Api::Completions => VllmApi::Completions,
            Api::ChatCompletions => VllmApi::ChatCompletions,
            Api::Messages => VllmApi::Messages,
            Api::Responses => VllmApi::Responses,
        }
    }

    /// Whether the API is one only vLLM workers serve here (the coding agents' APIs).
    pub(crate) fn vllm_only(self) -> bool {
        matches!(self, Api::Messages | Api::Responses)
    }

    /// Whether the client's errors are in Anthropic's shape
    /// (`{"type": "error", "error": {"type", "message"}}`) rather than OpenAI's.
    pub(crate) fn anthropic_errors(self) -> bool {
        self == Api::Messages
    }
}

fn token_ids(value: &Value, field: &str) -> Result<Vec<u32>, String> {
    let Value::Array(items) = value else {
        return Err(format!(
            "`{field}` must be a string or an array of token ids"
        ));
    };
    items
        .iter()
        .map(|v| match v {
            Value::Array(_) | Value::String(_) => Err(format!(
                "`{field}`: batched requests are not supported; send one prompt per request"
            )),
            _ => v
                .as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| format!("`{field}`: token ids are integers in 0..2^32")),
        })
        .collect()
}

fn prompt_from(value: &Value, field: &str) -> Result<Prompt, String> {
    match value {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        other => token_ids(other, field).map(Prompt::Tokens),
    }
}

fn optional_u64(obj: &Map<String, Value>, field: &str, what: &str) -> Result<Option<u64>, String> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("`{what}` must be a non-negative integer")),
    }
}

fn stream_flag(obj: &Map<String, Value>) -> Result<bool, String> {
    match obj.get("stream") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err("`stream` must be a boolean".to_owned()),
    }
}

/// Parses a request body of `api`. The error is the message for a 400 answer.
pub(crate) fn parse(api: Api, bytes: &[u8]) -> Result<ClientRequest, String> {
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| format!("invalid JSON body: {e}"))?;
    let Value::Object(body) = value else {
        return Err("the body must be a JSON object".to_owned());
    };
    let stream = stream_flag(&body)?;
    let (prompt, output_hint, session_key) = match api {
        Api::Generate => {
            let prompt = match (body.get("input_ids"), body.get("text")) {
                (Some(ids), None) => Prompt::Tokens(token_ids(ids, "input_ids")?),
                (None, Some(Value::String(text))) => Prompt::Text(text.clone()),
                (None, Some(Value::Array(_))) => {
                    return Err(
                        "`text`: batched requests are not supported; send one prompt per request"
                            .to_owned(),
                    );
                }
                (None, Some(_)) => return Err("`text` must be a string".to_owned()),
                (Some(_), Some(_)) => {
                    return Err("give either `text` or `input_ids`, not both".to_owned());
                }
                (None, None) => return Err("missing `text` or `input_ids`".to_owned()),
            };
            let output_hint = match body.get("sampling_params") {
                None | Some(Value::Null) => None,
                Some(Value::Object(sp)) => {
                    optional_u64(sp, "max_new_tokens", "sampling_params.max_new_tokens")?
                }
                Some(_) => return Err("`sampling_params` must be an object".to_owned()),
            }
            .unwrap_or(DEFAULT_MAX_NEW_TOKENS);
            let session_key = match body.get("session_params") {
                None | Some(Value::Null) => None,
                Some(Value::Object(sp)) => match sp.get("id") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) if !s.is_empty() => {
                        Some((s.clone(), SESSION_PARAMS_SOURCE))
                    }
                    Some(Value::Number(n)) => Some((n.to_string(), SESSION_PARAMS_SOURCE)),
                    Some(_) => {
                        return Err(
                            "`session_params.id` must be a non-empty string or a number".to_owned()
                        );
                    }
                },
                Some(_) => return Err("`session_params` must be an object".to_owned()),
            };
            (prompt, output_hint, session_key)
        }
        Api::Completions => {
            let prompt = match body.get("prompt") {
                Some(p) => prompt_from(p, "prompt")?,
                None => return Err("missing `prompt`".to_owned()),
            };
            let output_hint =
                optional_u64(&body, "max_tokens", "max_tokens")?.unwrap_or(DEFAULT_MAX_TOKENS);
            (prompt, output_hint, prompt_cache_key(&body)?)
        }
        Api::ChatCompletions => {
            let prompt = Prompt::Chat(chat_messages(&body)?);
            let output_hint =
                match optional_u64(&body, "max_completion_tokens", "max_completion_tokens")? {
                    Some(n) => n,
                    None => optional_u64(&body, "max_tokens", "max_tokens")?
                        .unwrap_or(DEFAULT_CHAT_MAX_TOKENS),
                };
            (prompt, output_hint, prompt_cache_key(&body)?)
        }
        Api::Messages => {
            let prompt = Prompt::Chat(messages_chat(&body)?);
            // Required by the API (vLLM refuses a request without it).
            let output_hint =
                optional_u64(&body, "max_tokens", "max_tokens")?.ok_or("missing `max_tokens`")?;
            (prompt, output_hint, metadata_session(&body))
        }
        Api::Responses => {
            let prompt = Prompt::Chat(responses_chat(&body)?);
            let output_hint = optional_u64(&body, "max_output_tokens", "max_output_tokens")?
                .unwrap_or(DEFAULT_CHAT_MAX_TOKENS);
            (prompt, output_hint, prompt_cache_key(&body)?)
        }
    };
    Ok(ClientRequest {
        prompt,
        output_hint,
        session_key,
        stream,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_bodies() {
        let r = parse(
            Api::Generate,
            br#"{"text":"a b","sampling_params":{"max_new_tokens":7},"session_params":{"id":"s1"}}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Text("a b".into()));
        assert_eq!(r.output_hint, 7);
        assert_eq!(
            r.session_key,
            Some(("s1".to_owned(), SESSION_PARAMS_SOURCE))
        );

        let r = parse(
            Api::Generate,
            br#"{"input_ids":[1,2,3],"stream":false,"session_params":{"id":42}}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(r.output_hint, DEFAULT_MAX_NEW_TOKENS);
        assert_eq!(
            r.session_key,
            Some(("42".to_owned(), SESSION_PARAMS_SOURCE))
        );
        assert!(!r.stream);
        let r = parse(Api::Generate, br#"{"text":"a","stream":true}"#).unwrap();
        assert!(r.stream);
        let r = parse(
            Api::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"q"}],"stream":true}"#,
        )
        .unwrap();
        assert!(r.stream);
    }

    #[test]
    fn completions_bodies() {
        let r = parse(
            Api::Completions,
            br#"{"model":"m","prompt":"hi","max_tokens":3}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert_eq!(r.output_hint, 3);
        assert_eq!(r.session_key, None);
        let r = parse(Api::Completions, br#"{"prompt":[5,6]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![5, 6]));
        assert_eq!(r.output_hint, DEFAULT_MAX_TOKENS);
    }

    #[test]
    fn chat_bodies() {
        let r = parse(
            Api::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"system","content":"S"},
                {"role":"user","content":[{"type":"text","text":"a "},
                {"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]},
                {"role":"assistant","content":null}],"max_tokens":9}"#,
        )
        .unwrap();
        let pair = |r: &str, c: &str| (r.to_owned(), c.to_owned());
        assert_eq!(
            r.prompt,
            Prompt::Chat(vec![
                pair("system", "S"),
                pair("user", "a b"),
                pair("assistant", "")
            ])
        );
        assert_eq!(r.output_hint, 9);
        assert_eq!(r.session_key, None);
        let r = parse(
            Api::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"q"}],"max_tokens":9,"max_completion_tokens":4}"#,
        )
        .unwrap();
        assert_eq!(r.output_hint, 4, "max_completion_tokens wins");
        let r = parse(
            Api::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"q"}]}"#,
        )
        .unwrap();
        assert_eq!(r.output_hint, DEFAULT_CHAT_MAX_TOKENS);
    }

    #[test]
    fn agent_api_bodies_give_their_prompt_limit_and_session() {
        let r = parse(
            Api::Messages,
            br#"{"model":"m","max_tokens":64,"system":"S","stream":true,
                "metadata":{"user_id":"{\"device_id\":\"d\",\"account_uuid\":\"\",\"session_id\":\"c0ffee\"}"},
                "messages":[{"role":"user","content":[{"type":"text","text":"q"}]}]}"#,
        )
        .unwrap();
        let pair = |r: &str, c: &str| (r.to_owned(), c.to_owned());
        assert_eq!(
            r.prompt,
            Prompt::Chat(vec![pair("system", "S"), pair("user", "q")])
        );
        assert_eq!((r.output_hint, r.stream), (64, true));
        assert_eq!(
            r.session_key,
            Some(("c0ffee".to_owned(), METADATA_USER_ID_SOURCE))
        );
        let old_style = br#"{"max_tokens":1,"metadata":{"user_id":"user_ab_account__session_s-9"},
            "messages":[{"role":"user","content":"q"}]}"#;
        assert_eq!(
            parse(Api::Messages, old_style).unwrap().session_key,
            Some(("s-9".to_owned(), METADATA_USER_ID_SOURCE))
        );
        let a_user = br#"{"max_tokens":1,"metadata":{"user_id":"alice"},
            "messages":[{"role":"user","content":"q"}]}"#;
        assert_eq!(parse(Api::Messages, a_user).unwrap().session_key, None);
        let e = parse(
            Api::Messages,
            br#"{"messages":[{"role":"user","content":"q"}]}"#,
        )
        .unwrap_err();
        assert!(e.contains("max_tokens"), "{e}");

        let r = parse(
            Api::Responses,
            br#"{"model":"m","instructions":"S","input":"q","max_output_tokens":9,
                "prompt_cache_key":"thread-1","store":false}"#,
        )
        .unwrap();
        assert_eq!(
            r.prompt,
            Prompt::Chat(vec![pair("system", "S"), pair("user", "q")])
        );
        assert_eq!(r.output_hint, 9);
        assert_eq!(
            r.session_key,
            Some(("thread-1".to_owned(), PROMPT_CACHE_KEY_SOURCE))
        );
        let r = parse(Api::Responses, br#"{"input":"q"}"#).unwrap();
        assert_eq!(r.output_hint, DEFAULT_CHAT_MAX_TOKENS);
        let e = parse(Api::Responses, br#"{"input":"q","prompt_cache_key":7}"#).unwrap_err();
        assert!(e.contains("prompt_cache_key"), "{e}");
        let r = parse(
            Api::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"q"}],"prompt_cache_key":"c"}"#,
        )
        .unwrap();
        assert_eq!(
            r.session_key,
            Some(("c".to_owned(), PROMPT_CACHE_KEY_SOURCE))
        );
    }

    #[test]
    fn malformed_chat_bodies_are_rejected_with_a_reason() {
        let cases: [(&[u8], &str); 8] = [
            (br#"{"prompt":"a"}"#, "missing `messages`"),
            (br#"{"messages":"a"}"#, "must be an array"),
            (br#"{"messages":[]}"#, "empty"),
            (br#"{"messages":[1]}"#, "`messages[0]` must be an object"),
            (br#"{"messages":[{"content":"a"}]}"#, "`messages[0].role`"),
            (
                br#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":5}]}"#,
                "`messages[1].content`",
            ),
            (
                br#"{"messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
                "text part",
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"max_completion_tokens":-1}"#,
                "max_completion_tokens",
            ),
        ];
        for (body, want) in cases {
            let err = parse(Api::ChatCompletions, body).unwrap_err();
            assert!(
                err.contains(want),
                "{}: {err}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn malformed_bodies_are_rejected_with_a_reason() {
        let cases: [(Api, &[u8], &str); 12] = [
            (Api::Generate, b"{", "invalid JSON"),
            (Api::Generate, b"[1]", "JSON object"),
            (Api::Generate, br#"{}"#, "missing"),
            (
                Api::Generate,
                br#"{"text":"a","input_ids":[1]}"#,
                "not both",
            ),
            (Api::Generate, br#"{"text":["a","b"]}"#, "batched"),
            (Api::Generate, br#"{"input_ids":[[1],[2]]}"#, "batched"),
            (Api::Generate, br#"{"input_ids":[-1]}"#, "token ids"),
            (
                Api::Generate,
                br#"{"text":"a","stream":"yes"}"#,
                "must be a boolean",
            ),
            (
                Api::Generate,
                br#"{"text":"a","sampling_params":{"max_new_tokens":"x"}}"#,
                "max_new_tokens",
            ),
            (
                Api::Generate,
                br#"{"text":"a","session_params":{"id":true}}"#,
                "session_params.id",
            ),
            (Api::Completions, br#"{"max_tokens":3}"#, "missing `prompt`"),
            (
                Api::Completions,
                br#"{"prompt":"a","max_tokens":-3}"#,
                "max_tokens",
            ),
        ];
        for (api, body, want) in cases {
            let err = parse(api, body).unwrap_err();
            assert!(
                err.contains(want),
                "{}: {err}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
