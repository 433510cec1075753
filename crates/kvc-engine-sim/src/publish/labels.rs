//! The session keys standalone workers' KV events name sessions by.

use kvc_core::SessionId;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// The session keys the workers' KV events name sessions by, by engine session: the
/// `session_id` of a `BlockStored` is the key the router was given, so it maps the events'
/// sessions to its own with [`SessionId::from_key`]. Bounded ([`SessionLabels::MAX`]): past
/// the bound the oldest labels are dropped (their sessions' events then carry the
/// replay's `s<id>` label, which no router session matches: a missed direct-to-D at worst).
#[derive(Debug, Clone, Default)]
pub struct SessionLabels {
    inner: Arc<Mutex<Labels>>,
}

#[derive(Debug, Default)]
struct Labels {
    by_session: HashMap<SessionId, (u64, String)>,
    next: u64,
}

impl SessionLabels {
    /// Most labels kept.
    pub const MAX: usize = 65_536;

    /// Names engine session `session` by `key`.
    pub(crate) fn insert(&self, session: SessionId, key: &str) {
        let mut l = self.inner.lock();
        let stamp = l.next;
        l.next += 1;
        l.by_session.insert(session, (stamp, key.to_owned()));
        if l.by_session.len() > Self::MAX {
            // Drop the oldest half (one sort per MAX / 2 inserts).
            let mut stamps: Vec<u64> = l.by_session.values().map(|(s, _)| *s).collect();
            stamps.sort_unstable();
            let cut = stamps[stamps.len() / 2];
            l.by_session.retain(|_, (s, _)| *s >= cut);
        }
    }

    /// The key of `session`, when it has one.
    pub(crate) fn get(&self, session: SessionId) -> Option<String> {
        self.inner
            .lock()
            .by_session
            .get(&session)
            .map(|(_, k)| k.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_bounded_and_keep_the_newest() {
        let labels = SessionLabels::default();
        for i in 0..SessionLabels::MAX as u64 + 1 {
            labels.insert(SessionId(i), &format!("k{i}"));
        }
        assert!(labels.inner.lock().by_session.len() <= SessionLabels::MAX / 2 + 1);
        let last = SessionLabels::MAX as u64;
        assert_eq!(
            labels.get(SessionId(last)).as_deref(),
            Some(format!("k{last}").as_str())
        );
        assert_eq!(labels.get(SessionId(0)), None);
    }
}
