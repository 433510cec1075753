//! Direct-to-D: the decode worker's body carries the session's continuation parameters, so
//! that its engine appends the turn to the session it holds.

use super::request::Api;
use axum::http::{HeaderName, HeaderValue};
use kvc_core::{SessionId, WorkerId};
use serde_json::{Map, Value, json};

/// The header vLLM's OpenAI server reads to serve a request on one data-parallel rank
/// (`X-data-parallel-rank`, an integer; the engine's own balancing picks a rank without it).
pub(crate) const DP_RANK: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// The rank header of a direct-to-D turn of `session_key` on `decode`: the rank whose
/// KV-cache events hold the session, when the worker's events come as several ranks and
/// one holds it; `None` otherwise (the engine then picks the rank).
pub(crate) fn rank_header(
    service: &crate::RouterService,
    decode: WorkerId,
    session_key: Option<&str>,
) -> Option<(HeaderName, HeaderValue)> {
    let rank = service.resident_rank(decode, SessionId::from_key(session_key?))?;
    Some((DP_RANK, HeaderValue::from(rank)))
}

/// Adds the session's continuation parameters to a direct-to-D body: SGLang's `/generate`
/// gets `session_params.id` = the session key, unless the client sent `session_params`
/// itself. Other APIs, or no session: unchanged.
pub(crate) fn add_continuation_params(
    api: Api,
    body: &mut Map<String, Value>,
    session_key: Option<&str>,
) {
    let Some(key) = session_key else { return };
    if api == Api::Generate && body.get("session_params").is_none_or(Value::is_null) {
        body.insert("session_params".into(), json!({ "id": key }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_turns_of_generate_carry_the_session_params() {
        let mut body = Map::new();
        add_continuation_params(Api::Generate, &mut body, Some("agent-1"));
        assert_eq!(
            Value::Object(body),
            json!({"session_params": {"id": "agent-1"}})
        );
        let mut body = json!({"session_params": null}).as_object().unwrap().clone();
        add_continuation_params(Api::Generate, &mut body, Some("agent-1"));
        assert_eq!(body["session_params"], json!({"id": "agent-1"}));
        // What the client sent is kept.
        let sent = json!({"session_params": {"id": "mine", "offset": 3}});
        let mut body = sent.as_object().unwrap().clone();
        add_continuation_params(Api::Generate, &mut body, Some("agent-1"));
        assert_eq!(Value::Object(body), sent);
        // Other APIs, or no session: unchanged.
        for (api, key) in [
            (Api::Completions, Some("agent-1")),
            (Api::ChatCompletions, Some("agent-1")),
            (Api::Generate, None),
        ] {
            let mut body = Map::new();
            add_continuation_params(api, &mut body, key);
            assert!(body.is_empty(), "{api:?}");
        }
    }
}
