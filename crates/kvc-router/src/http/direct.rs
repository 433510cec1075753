//! Direct-to-D: the decode worker's body carries the session's continuation parameters, so
//! that its engine appends the turn to the session it holds.

use super::request::Api;
use serde_json::{Map, Value, json};

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
