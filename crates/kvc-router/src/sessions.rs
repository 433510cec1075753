//! The bounded session table: which sessions the router remembers and when each was last seen.
//!
//! The router calls [`SessionTable::touch`] for every request of a session and
//! [`SessionTable::expire`] regularly; both hand back the sessions to forget (idle longer than
//! the TTL, or least recently seen beyond the bound), which the router then drops from its
//! [`kvc_policy::RouterState`] with `forget_session`.

pub use kvc_core::Forgotten;
use kvc_core::SessionId;
use std::collections::{BTreeSet, HashMap};

/// Sessions with their last-seen time, bounded by a TTL and a maximum count.
///
/// ```
/// use kvc_core::SessionId;
/// use kvc_router::sessions::{Forgotten, SessionTable};
///
/// let mut table = SessionTable::new(2, 1_000);
/// let mut gone = Vec::new();
/// table.touch(SessionId(1), 0, &mut gone);
/// table.touch(SessionId(2), 10, &mut gone);
/// table.touch(SessionId(3), 20, &mut gone);
/// assert_eq!(gone, [(SessionId(1), Forgotten::Evicted)]);
/// gone.clear();
/// table.expire(1_015, &mut gone);
/// assert_eq!(gone, [(SessionId(2), Forgotten::Expired)]);
/// assert_eq!(table.len(), 1);
/// ```
#[derive(Debug, Clone)]
pub struct SessionTable {
    max_sessions: usize,
    ttl_ms: u64,
    last_seen: HashMap<SessionId, u64>,
    by_age: BTreeSet<(u64, SessionId)>,
}

impl SessionTable {
    /// An empty table holding at most `max_sessions` (at least 1), each for `ttl_ms` after it
    /// was last seen.
    pub fn new(max_sessions: usize, ttl_ms: u64) -> Self {
        SessionTable {
            max_sessions: max_sessions.max(1),
            ttl_ms,
            // Twice the bound: a full table whose entries keep being replaced then rehashes in
            // place instead of growing once more (`RouterState::reserve_sessions` says why).
            last_seen: HashMap::with_capacity(kvc_policy::reserved(max_sessions.max(1))),
            by_age: BTreeSet::new(),
        }
    }

    /// Records that `session` was seen at `now_ms`; pushes onto `forgotten` the sessions that
    /// leave the table to keep it within its bound (never `session` itself).
    pub fn touch(
        &mut self,
        session: SessionId,
        now_ms: u64,
        forgotten: &mut Vec<(SessionId, Forgotten)>,
    ) {
        if let Some(old) = self.last_seen.insert(session, now_ms) {
            self.by_age.remove(&(old, session));
        }
        self.by_age.insert((now_ms, session));
        while self.last_seen.len() > self.max_sessions {
            let Some(&(seen, oldest)) = self.by_age.iter().find(|(_, s)| *s != session) else {
                break;
            };
            self.by_age.remove(&(seen, oldest));
            self.last_seen.remove(&oldest);
            forgotten.push((oldest, Forgotten::Evicted));
        }
    }

    /// Removes `session` (the client ended it); whether the table held it.
    pub fn remove(&mut self, session: SessionId) -> bool {
        match self.last_seen.remove(&session) {
            Some(seen) => {
                self.by_age.remove(&(seen, session));
                true
            }
            None => false,
        }
    }

    /// Removes the sessions not seen for more than the TTL at `now_ms`, pushing them onto
    /// `forgotten`.
    pub fn expire(&mut self, now_ms: u64, forgotten: &mut Vec<(SessionId, Forgotten)>) {
        while self.expire_some(now_ms, usize::MAX, forgotten) {}
    }

    /// Removes at most `limit` of the sessions not seen for more than the TTL at `now_ms`,
    /// oldest first, pushing them onto `forgotten`; `true` when more remain to expire. The
    /// router expires a few on every decision and the rest in chunks from its background tick,
    /// so a million sessions going idle together never stall one decision.
    pub fn expire_some(
        &mut self,
        now_ms: u64,
        limit: usize,
        forgotten: &mut Vec<(SessionId, Forgotten)>,
    ) -> bool {
        for _ in 0..limit {
            match self.by_age.first() {
                Some(&(seen, session)) if now_ms.saturating_sub(seen) > self.ttl_ms => {
                    self.by_age.pop_first();
                    self.last_seen.remove(&session);
                    forgotten.push((session, Forgotten::Expired));
                }
                _ => return false,
            }
        }
        self.by_age
            .first()
            .is_some_and(|&(seen, _)| now_ms.saturating_sub(seen) > self.ttl_ms)
    }

    /// Removes `session` if it was not seen for more than the TTL at `now_ms` (pushing it onto
    /// `forgotten`): a session whose turn arrives before its expiry was swept is still
    /// forgotten first, and routed as a new one.
    pub fn expire_if_stale(
        &mut self,
        session: SessionId,
        now_ms: u64,
        forgotten: &mut Vec<(SessionId, Forgotten)>,
    ) {
        if let Some(&seen) = self.last_seen.get(&session)
            && now_ms.saturating_sub(seen) > self.ttl_ms
        {
            self.by_age.remove(&(seen, session));
            self.last_seen.remove(&session);
            forgotten.push((session, Forgotten::Expired));
        }
    }

    /// When `session` was last seen, if it is in the table.
    pub fn last_seen(&self, session: SessionId) -> Option<u64> {
        self.last_seen.get(&session).copied()
    }

    /// Sessions in the table.
    pub fn len(&self) -> usize {
        self.last_seen.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.last_seen.is_empty()
    }

    /// The bound on the number of sessions.
    pub fn max_sessions(&self) -> usize {
        self.max_sessions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_evicts_least_recently_seen() {
        let mut t = SessionTable::new(3, 10_000);
        let mut gone = Vec::new();
        for i in 0..3 {
            t.touch(SessionId(i), i, &mut gone);
        }
        // Session 0 is seen again: session 1 is now the least recently seen.
        t.touch(SessionId(0), 5, &mut gone);
        t.touch(SessionId(9), 6, &mut gone);
        assert_eq!(gone, [(SessionId(1), Forgotten::Evicted)]);
        assert_eq!(t.len(), 3);
        assert_eq!(t.last_seen(SessionId(0)), Some(5));
        assert_eq!(t.last_seen(SessionId(1)), None);
        gone.clear();
        for i in 100..110 {
            t.touch(SessionId(i), 7, &mut gone);
            assert!(t.len() <= 3);
        }
        assert_eq!(gone.len(), 10);
        assert_eq!(t.len(), t.by_age.len());
    }

    #[test]
    fn ttl_expiry_is_strictly_after_the_ttl() {
        let mut t = SessionTable::new(10, 100);
        let mut gone = Vec::new();
        t.touch(SessionId(1), 0, &mut gone);
        t.touch(SessionId(2), 50, &mut gone);
        t.expire(100, &mut gone);
        assert!(gone.is_empty());
        t.expire(101, &mut gone);
        assert_eq!(gone, [(SessionId(1), Forgotten::Expired)]);
        t.expire(1_000, &mut gone);
        assert_eq!(gone.len(), 2);
        assert!(t.is_empty());
    }

    #[test]
    fn expiry_in_chunks_forgets_each_session_once_oldest_first() {
        let mut t = SessionTable::new(20_000, 100);
        let mut gone = Vec::new();
        for i in 0..10_000u64 {
            t.touch(SessionId(i), i / 10, &mut gone);
        }
        t.touch(SessionId(99_999), 2_000, &mut gone);
        assert!(gone.is_empty());
        // At 2,000 every session but the last is past the TTL.
        assert!(t.expire_some(2_000, 64, &mut gone));
        assert_eq!(gone.len(), 64);
        assert_eq!(gone[0], (SessionId(0), Forgotten::Expired));
        assert_eq!(t.len(), 10_001 - 64);
        let mut chunks = 1;
        while t.expire_some(2_000, 4_096, &mut gone) {
            chunks += 1;
        }
        assert_eq!(chunks, 3, "64, then 4,096, 4,096 and the last 1,744");
        let ids: Vec<u64> = gone.iter().map(|(s, _)| s.0).collect();
        assert_eq!(ids, (0..10_000).collect::<Vec<_>>());
        assert_eq!(t.len(), 1);
        assert!(!t.expire_some(2_000, 1, &mut gone));
        assert_eq!(t.last_seen(SessionId(99_999)), Some(2_000));
    }

    #[test]
    fn a_stale_session_is_expired_before_its_next_touch() {
        let mut t = SessionTable::new(10, 100);
        let mut gone = Vec::new();
        t.touch(SessionId(1), 0, &mut gone);
        t.touch(SessionId(2), 90, &mut gone);
        t.expire_if_stale(SessionId(1), 100, &mut gone);
        assert!(gone.is_empty(), "idle exactly the TTL is not stale");
        t.expire_if_stale(SessionId(1), 101, &mut gone);
        t.expire_if_stale(SessionId(2), 101, &mut gone);
        t.expire_if_stale(SessionId(3), 101, &mut gone);
        assert_eq!(gone, [(SessionId(1), Forgotten::Expired)]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.by_age.len(), 1);
    }
}
