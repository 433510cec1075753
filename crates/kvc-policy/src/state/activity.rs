//! The count of `kvc`'s active sessions per worker, kept up to date decision by decision, and
//! the state's answer to how many sessions are active where.

use super::{RouterState, SessionRoute};
use kvc_core::{SessionId, WorkerId};
use std::collections::BTreeMap;

/// Sessions that may count as active for `kvc`'s placement term, maintained incrementally:
/// every session resident on its D and routed at or after `floor` has one count under the key
/// (time of its last routing, D). A session counts as active at time `now` when routed at or
/// after `now − window_ms`. `watermark` is the latest applied decision's `now − window_ms`, and
/// `per_worker` counts the entries at or after it; a decision adds or subtracts only the
/// entries between its own `now − window_ms` and the watermark, that is the sessions routed in
/// the interval between its time and the latest applied decision's. Entries are kept one window
/// below the watermark (`floor`), so decisions dated up to one window before the latest
/// applied one (requests racing for the router's lock) are answered the same way.
#[derive(Debug, Clone)]
pub(super) struct Activity {
    window_ms: u64,
    watermark: u64,
    floor: u64,
    entries: BTreeMap<(u64, u32), u32>,
    per_worker: Vec<u32>,
}

impl Activity {
    pub(super) fn new(window_ms: u64) -> Self {
        Activity {
            window_ms,
            watermark: 0,
            floor: 0,
            entries: BTreeMap::new(),
            per_worker: Vec::new(),
        }
    }

    pub(super) fn add(&mut self, key: Option<(u64, WorkerId)>) {
        let Some((t, d)) = key else { return };
        if t < self.floor {
            return;
        }
        *self.entries.entry((t, d.0)).or_insert(0) += 1;
        if t >= self.watermark {
            let slot = d.0 as usize;
            if self.per_worker.len() <= slot {
                self.per_worker.resize(slot + 1, 0);
            }
            self.per_worker[slot] += 1;
        }
    }

    pub(super) fn remove(&mut self, key: Option<(u64, WorkerId)>) {
        let Some((t, d)) = key else { return };
        if t < self.floor {
            return;
        }
        if let Some(n) = self.entries.get_mut(&(t, d.0)) {
            *n -= 1;
            if *n == 0 {
                self.entries.remove(&(t, d.0));
            }
            if t >= self.watermark {
                self.per_worker[d.0 as usize] -= 1;
            }
        }
    }

    pub(super) fn update(
        &mut self,
        before: Option<(u64, WorkerId)>,
        after: Option<(u64, WorkerId)>,
    ) {
        if before != after {
            self.remove(before);
            self.add(after);
        }
    }

    /// Moves the watermark to `now_ms − window_ms` if that is later (and the floor one window
    /// below it), dropping the entries under the floor.
    pub(super) fn advance(&mut self, now_ms: u64) {
        let mark = now_ms.saturating_sub(self.window_ms);
        if mark <= self.watermark {
            return;
        }
        for (&(_, slot), &n) in self.entries.range((self.watermark, 0)..(mark, 0)) {
            self.per_worker[slot as usize] -= n;
        }
        self.watermark = mark;
        self.floor = mark.saturating_sub(self.window_ms);
        while let Some(entry) = self.entries.first_entry()
            && entry.key().0 < self.floor
        {
            entry.remove();
        }
    }
}

impl RouterState {
    /// For every worker, the sessions other than `exclude` resident on it and routed at or
    /// after `now_ms − window_ms` (`kvc`'s active sessions), written to `out` (indexed by
    /// worker id). Reads the incremental aggregate when it answers for `window_ms` and
    /// `now_ms` is at most one window before the latest applied decision, else scans every
    /// session: the same counts either way.
    pub(crate) fn active_sessions(
        &self,
        now_ms: u64,
        window_ms: u64,
        exclude: Option<SessionId>,
        out: &mut [u32],
    ) {
        let from = now_ms.saturating_sub(window_ms);
        let a = &self.activity;
        if window_ms != a.window_ms || from < a.floor {
            self.scan_active(from, exclude, out);
            return;
        }
        let n = a.per_worker.len().min(out.len());
        out[..n].copy_from_slice(&a.per_worker[..n]);
        if from >= a.watermark {
            // Sessions routed in [watermark, from) went quiet since the latest applied decision.
            for (&(_, slot), &n) in a.entries.range((a.watermark, 0)..(from, 0)) {
                if let Some(x) = out.get_mut(slot as usize) {
                    *x -= n;
                }
            }
        } else {
            // A decision dated before the latest applied one: sessions routed in
            // [from, watermark) are still active for it.
            for (&(_, slot), &n) in a.entries.range((from, 0)..(a.watermark, 0)) {
                if let Some(x) = out.get_mut(slot as usize) {
                    *x += n;
                }
            }
        }
        if let Some((t, d)) = exclude
            .and_then(|s| self.sessions.get(&s))
            .and_then(SessionRoute::activity_key)
            && t >= from
            && let Some(x) = out.get_mut(d.0 as usize)
        {
            *x -= 1;
        }
    }

    /// [`RouterState::active_sessions`] from scratch, over every session.
    pub(crate) fn scan_active(&self, from: u64, exclude: Option<SessionId>, out: &mut [u32]) {
        for (id, r) in &self.sessions {
            if Some(*id) != exclude
                && let Some((t, d)) = r.activity_key()
                && t >= from
                && let Some(x) = out.get_mut(d.0 as usize)
            {
                *x += 1;
            }
        }
    }
}
