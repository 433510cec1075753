//! Which session a client request belongs to: the key from the session header or the body's
//! `session_params.id`, else a session inferred from the prompt's prefix (see [`super::infer`]);
//! and its turn. Inferred sessions are counted in the metrics.

use super::infer::{self, Inferred, Resolved, SessionBook};
use crate::{RouterService, SessionLimits};
use axum::http::HeaderMap;
use kvc_core::SessionId;
use parking_lot::Mutex;
use std::hash::{BuildHasher, Hasher};

/// The session key a client sent in header `name`: `Ok(None)` without the header, an error
/// message when it is not non-empty text.
pub(super) fn header_key(headers: &HeaderMap, name: &str) -> Result<Option<String>, String> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => match v.to_str() {
            Ok(s) if !s.trim().is_empty() => Ok(Some(s.trim().to_owned())),
            _ => Err(format!("header `{name}` must be non-empty text")),
        },
    }
}

/// A session key from the client's headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ClientKey<'n> {
    /// The key: the session header's value, with `/agent/<agent>` for a subagent.
    pub(super) key: String,
    /// The header it came from.
    pub(super) source: &'n str,
    /// The session header's value alone, when an agent header made the key a subagent's.
    pub(super) agent_of: Option<String>,
}

/// The session key a client's headers give, and the header it came from: the first of
/// `names` present, followed by `/agent/<agent>` when one of `agents` is present too (a
/// subagent sharing its parent's session id has a conversation of its own). Each part is at
/// most `limit` bytes. `Ok(None)` without any of `names`; an error message for a present
/// header that is empty or not text, or too long.
pub(super) fn client_key<'n>(
    headers: &HeaderMap,
    names: &'n [String],
    agents: &[String],
    limit: usize,
) -> Result<Option<ClientKey<'n>>, String> {
    let mut found = None;
    for name in names {
        if let Some(key) = header_key(headers, name)? {
            found = Some((key, name.as_str()));
            break;
        }
    }
    let Some((mut key, source)) = found else {
        return Ok(None);
    };
    super::trust::check_session_id(&key, limit).map_err(|m| format!("header `{source}`: {m}"))?;
    let mut agent_of = None;
    for name in agents {
        if let Some(agent) = checked(headers, name, limit)? {
            agent_of = Some(key.clone());
            key.push_str("/agent/");
            key.push_str(&agent);
            break;
        }
    }
    Ok(Some(ClientKey {
        key,
        source,
        agent_of,
    }))
}

/// Header `name`'s value as a session id of at most `limit` bytes.
fn checked(headers: &HeaderMap, name: &str, limit: usize) -> Result<Option<String>, String> {
    let Some(v) = header_key(headers, name)? else {
        return Ok(None);
    };
    super::trust::check_session_id(&v, limit).map_err(|m| format!("header `{name}`: {m}"))?;
    Ok(Some(v))
}

/// The key of the session that spawned the request's (a subagent's parent), from its
/// headers: the first of `parents` present (the parent's own key); else, for a subagent
/// within a client session (`client.agent_of`), that session's agent named by the first of
/// `parent_agents` present, or the session's main conversation without one. Errors as
/// [`client_key`]'s.
pub(super) fn parent_key(
    headers: &HeaderMap,
    client: Option<&ClientKey<'_>>,
    parents: &[String],
    parent_agents: &[String],
    limit: usize,
) -> Result<Option<String>, String> {
    for name in parents {
        if let Some(parent) = checked(headers, name, limit)? {
            return Ok(Some(parent));
        }
    }
    let Some(session) = client.and_then(|c| c.agent_of.as_ref()) else {
        return Ok(None);
    };
    for name in parent_agents {
        if let Some(agent) = checked(headers, name, limit)? {
            return Ok(Some(format!("{session}/agent/{agent}")));
        }
    }
    Ok(Some(session.clone()))
}

/// The front's sessions: the book of keys, turns and prefix anchors, and the per-process key
/// of the hash that names new inferred sessions.
pub(super) struct Sessions {
    book: Mutex<SessionBook>,
    min_blocks: u32,
    key_hasher: std::collections::hash_map::RandomState,
}

impl Sessions {
    /// Sessions bounded by the router's `limits`; inference needs `min_blocks` shared full
    /// blocks (0: none).
    pub(super) fn new(limits: SessionLimits, min_blocks: u32) -> Self {
        Sessions {
            book: Mutex::new(SessionBook::new(limits, min_blocks)),
            min_blocks,
            key_hasher: std::collections::hash_map::RandomState::new(),
        }
    }

    /// The key of a new inferred session: a hash (keyed per process) of the request's first
    /// block hashes and its id.
    fn inferred_key(&self, hash_ids: &[u64], request_id: u64) -> String {
        let mut h = self.key_hasher.build_hasher();
        for id in hash_ids.iter().take((self.min_blocks as usize).max(1)) {
            h.write_u64(*id);
        }
        h.write_u64(request_id);
        format!("kvc-inferred-{:016x}", h.finish())
    }

    /// The session of a request (`key` when the client named one) and its turn (see
    /// [`SessionBook::resolve`]), counted in `service`'s metrics when inferred: `hashed` is
    /// the tokens the block hashes `hash_ids` cover, and the block size; `turns`, for a chat,
    /// where its newest user message and its last message start.
    pub(super) fn resolve(
        &self,
        service: &RouterService,
        key: Option<&str>,
        hashed: (&[u32], kvc_core::BlockSize),
        turns: Option<infer::Turns<'_>>,
        hash_ids: &[u64],
        request_id: u64,
    ) -> Option<Resolved> {
        let (tokens, block) = hashed;
        let block = block.tokens() as usize;
        let prompt = infer::Prompt {
            key,
            hashes: hash_ids,
            full_blocks: tokens.len() / block,
            tokens: Some((tokens, block)),
            turns,
        };
        let resolved = self.book.lock().resolve(prompt, service.now_ms(), || {
            self.inferred_key(hash_ids, request_id)
        });
        match resolved.as_ref().and_then(|r| r.inferred) {
            Some(Inferred::Rotated) => service.metrics().record_rotated_session_id(),
            Some(inferred) => service
                .metrics()
                .record_inferred_session(inferred == Inferred::Continued),
            None => {}
        }
        resolved
    }

    /// Forgets `session` (its client ended it): a later request with its key starts at turn
    /// 1, and no request is inferred to continue it. Whether the front knew it.
    pub(super) fn end(&self, session: SessionId) -> bool {
        self.book.lock().remove(session)
    }
}

/// The request header that marks a request its session's last turn (`true` or `1`; `false`
/// or `0` say it is not): once the turn is answered, the session ends as with
/// `DELETE /v1/sessions/{key}`.
pub const SESSION_FINAL_HEADER: &str = "x-session-final";

/// Whether the request is marked its session's last turn ([`SESSION_FINAL_HEADER`]); else
/// the 400 message for a value that is neither.
pub(crate) fn session_final(headers: &HeaderMap) -> Result<bool, String> {
    let Some(v) = headers.get(SESSION_FINAL_HEADER) else {
        return Ok(false);
    };
    match v.to_str().map(str::trim) {
        Ok(t) if t.eq_ignore_ascii_case("true") || t == "1" => Ok(true),
        Ok(t) if t.eq_ignore_ascii_case("false") || t == "0" => Ok(false),
        _ => Err(format!(
            "header `{SESSION_FINAL_HEADER}` must be true, false, 1 or 0"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RouterConfig;
    use axum::http::HeaderValue;
    use kvc_admission::ManualClock;
    use std::sync::Arc;

    #[test]
    fn sessions_are_resolved_with_the_router_limits_and_counted() {
        let clock = Arc::new(ManualClock::new(1_000));
        let limits = SessionLimits {
            ttl_ms: 100,
            max_sessions: 10,
        };
        let config = RouterConfig {
            sessions: limits,
            ..RouterConfig::default()
        };
        let service = RouterService::with_clock(config, clock.clone()).unwrap();
        let sessions = Sessions::new(limits, 2);
        let block = kvc_core::BlockSize::new(2).unwrap();
        let resolve = |key, tokens: &[u32], id| {
            let h = kvc_core::text::block_hashes(tokens, block);
            sessions.resolve(&service, key, (tokens, block), None, &h, id)
        };
        let a = [1, 2, 3, 4, 5, 6, 7];
        let r = resolve(Some("a"), &a, 1).unwrap();
        assert_eq!((r.turn, r.inferred), (1, None));
        clock.advance(101);
        let r = resolve(Some("a"), &a, 2).unwrap();
        assert_eq!(r.turn, 1, "expired after the router's session TTL");
        // No key: it extends session `a`'s prompt, its partial last block included.
        let longer = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let r = resolve(None, &longer, 3).unwrap();
        assert_eq!(&*r.key, "a");
        assert_eq!((r.turn, r.inferred), (2, Some(Inferred::Continued)));
        let other = [1, 2, 3, 4, 5, 6, 8, 8];
        let r = resolve(None, &other, 4).unwrap();
        assert_eq!(r.inferred, Some(Inferred::New));
        assert!(r.key.starts_with("kvc-inferred-"), "{}", r.key);
        assert_eq!(r.key.len(), "kvc-inferred-".len() + 16);
        assert_ne!(
            sessions.inferred_key(&[21, 22], 4),
            sessions.inferred_key(&[21, 22], 5)
        );
        let m = service.metrics();
        assert_eq!(
            (m.inferred_sessions(true), m.inferred_sessions(false)),
            (1, 1)
        );
    }

    #[test]
    fn session_keys_come_from_non_empty_headers() {
        let mut headers = HeaderMap::new();
        assert_eq!(header_key(&headers, "x-session-id"), Ok(None));
        headers.insert("x-session-id", HeaderValue::from_static("  agent-1 "));
        assert_eq!(
            header_key(&headers, "x-session-id"),
            Ok(Some("agent-1".to_owned()))
        );
        headers.insert("x-session-id", HeaderValue::from_static(" "));
        let err = header_key(&headers, "x-session-id").unwrap_err();
        assert!(err.contains("`x-session-id`"), "{err}");
    }
}
