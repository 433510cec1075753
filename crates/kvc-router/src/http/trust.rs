//! What the front does not take from a client: the fields only the router may set, and session
//! ids longer than the configured limit.

use serde_json::{Map, Value};

/// Body fields only the router sets: SGLang's P→D pairing (`bootstrap_host`,
/// `bootstrap_port`, `bootstrap_room`, `bootstrap_pair_key`, `disagg_prefill_dp_rank`) and
/// vLLM's `kv_transfer_params`.
/// A client's values could point a decode worker at any host (a request forgery path), so
/// they are removed from every request before it is routed; the router adds its own on a P→D
/// path.
pub(super) const ROUTER_ONLY_FIELDS: [&str; 6] = [
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "disagg_prefill_dp_rank",
    "kv_transfer_params",
];

/// Removes [`ROUTER_ONLY_FIELDS`] from a client's body; returns how many there were.
pub(super) fn strip_router_fields(body: &mut Map<String, Value>) -> usize {
    ROUTER_ONLY_FIELDS
        .iter()
        .filter(|f| body.remove(**f).is_some())
        .count()
}

/// `Ok` when the session id `key` is at most `limit` bytes; else the message of the 400
/// answer (naming the limit and its key, never the id).
pub(super) fn check_session_id(key: &str, limit: usize) -> Result<(), String> {
    if key.len() <= limit {
        return Ok(());
    }
    Err(format!(
        "the session id is {} bytes; at most {limit} bytes are accepted \
         (http.max-session-id-bytes)",
        key.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn router_only_fields_are_removed_and_nothing_else() {
        let mut body = json!({"text": "a", "bootstrap_host": "h", "bootstrap_port": 1,
            "bootstrap_room": 2, "bootstrap_pair_key": "k", "disagg_prefill_dp_rank": 0,
            "kv_transfer_params": {},
            "session_params": {"id": "s"}})
        .as_object()
        .unwrap()
        .clone();
        assert_eq!(strip_router_fields(&mut body), 6);
        assert_eq!(
            Value::Object(body.clone()),
            json!({"text": "a", "session_params": {"id": "s"}})
        );
        assert_eq!(strip_router_fields(&mut body), 0);
    }

    #[test]
    fn session_ids_are_bounded() {
        assert_eq!(check_session_id(&"é".repeat(128), 256), Ok(()));
        let err = check_session_id(&"x".repeat(300), 256).unwrap_err();
        assert!(
            err.contains("300 bytes") && err.contains("at most 256 bytes"),
            "{err}"
        );
        assert!(err.contains("http.max-session-id-bytes"), "{err}");
        assert!(!err.contains("xxx"), "the id is not echoed: {err}");
    }
}
