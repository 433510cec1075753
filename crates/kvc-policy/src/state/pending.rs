//! Carrying out a decision: its pending entry, the per-worker in-flight, backlog and
//! awaiting-KV counts it adds, the session's new placement, and the release of each.

use super::{Pending, Residency, RouterState, SessionRoute, WorkerCounters, role_index};
use crate::decision::StateChange;
use crate::view::MAX_WORKERS;
use kvc_core::{RequestId, WorkerId, WorkerRole};
use std::collections::VecDeque;

impl RouterState {
    fn counters_mut(&mut self, id: WorkerId) -> Option<&mut WorkerCounters> {
        let slot = id.0 as usize;
        if slot >= MAX_WORKERS {
            return None;
        }
        if slot >= self.counters.len() {
            self.counters.resize(slot + 1, WorkerCounters::default());
        }
        Some(&mut self.counters[slot])
    }

    /// Carries out a decision (see [`StateChange`] for what changes).
    pub fn apply(&mut self, change: &StateChange) {
        if (change.decode.0 as usize) >= MAX_WORKERS
            || change.prefill.is_some_and(|p| p.0 as usize >= MAX_WORKERS)
        {
            return;
        }
        if let Some(old) = self.pending.remove(&change.request_id) {
            self.release(old);
        }
        self.activity.advance(change.now_ms);
        let awaiting_kv = change.prefill.is_some_and(|p| p != change.decode);
        let ahead_us = self
            .counters
            .get(change.prefill.unwrap_or(change.decode).0 as usize)
            .map_or(0, |c| c.prefill_us);
        let pending = Pending {
            decode: change.decode,
            prefill: change.prefill,
            seq: self.next_seq,
            prefill_us: change.prefill_us,
            ahead_us,
            sent_ms: change.now_ms,
            awaiting_kv,
            kv_blocks: u32::try_from(change.blocks.len()).unwrap_or(u32::MAX),
        };
        self.pending_order
            .push_back((self.next_seq, change.request_id));
        if awaiting_kv {
            let d = change.decode.0 as usize;
            if d >= self.awaiting_kv.len() {
                self.awaiting_kv.resize_with(d + 1, VecDeque::new);
            }
            self.awaiting_kv[d].push_back((self.next_seq, change.request_id));
            if let Some(c) = self.counters_mut(change.decode) {
                c.awaiting_kv = c.awaiting_kv.saturating_add(1);
                c.awaiting_kv_blocks = c
                    .awaiting_kv_blocks
                    .saturating_add(u64::from(pending.kv_blocks));
            }
        }
        self.next_seq += 1;
        for id in std::iter::once(change.decode).chain(change.prefill) {
            if let Some(c) = self.counters_mut(id) {
                c.in_flight = c.in_flight.saturating_add(1);
                c.assignments = c.assignments.saturating_add(1);
            }
        }
        self.add_backlog(&pending, true);
        if let Some(p) = change.prefill {
            *self.pairs.entry((p, change.decode)).or_insert(0) += 1;
            self.index.record_seen(p.0 as usize, &change.blocks);
            self.cursors[role_index(WorkerRole::Prefill)] = Some(p);
        }
        self.pending.insert(change.request_id, pending);
        self.bound_pending();
        if !self.seen_unread.contains(change.decode.0 as usize) {
            self.index
                .record_seen(change.decode.0 as usize, &change.blocks);
        }
        self.cursors[role_index(change.decode_role)] = Some(change.decode);

        let Some(sid) = change.session else {
            return;
        };
        let route = self.sessions.entry(sid).or_insert_with(SessionRoute::new);
        let before = route.activity_key();
        if route.current_d != Some(change.decode) {
            if route.current_d.is_some() {
                route.d_changes = route.d_changes.saturating_add(1);
            }
            route.current_d = Some(change.decode);
            route.resident_tokens = 0;
        }
        route.residency = Residency::Resident;
        route.last_routed_ms = change.now_ms;
        if let Some((worker, n)) = change.reject_count {
            route.set_rejects(worker, n);
        }
        // A new attempt starts: an observed reject not re-routed stays counted, but a later
        // `rejected_by` refers to a new reject.
        route.observed_reject = None;
        // The leading blocks the session keeps.
        let cap = (self.bounds.max_session_blocks as usize).min(change.blocks.len());
        let kept = &change.blocks[..cap];
        self.dropped_session_blocks += (change.blocks.len() - cap) as u64;
        // Move the session's live blocks to the new list on the chosen worker.
        let d = change.decode.0 as usize;
        match route.live_on {
            Some(w) if w == change.decode => {
                let k = kvc_core::prefix::shared_prefix_blocks(&route.blocks, kept);
                self.index.remove_live(d, &route.blocks[k..]);
                self.index.add_live(d, &kept[k..]);
            }
            other => {
                if let Some(w) = other {
                    self.index.remove_live(w.0 as usize, &route.blocks);
                }
                self.index.add_live(d, kept);
            }
        }
        route.live_on = Some(change.decode);
        route.blocks.clear();
        route.blocks.extend_from_slice(kept);
        route.block_count = change.blocks.len();
        route.last_block = (cap < change.blocks.len())
            .then(|| change.blocks.last().copied())
            .flatten();
        // A session's list holds its last request only: give back what a longer one left.
        if route.blocks.capacity() > 2 * route.blocks.len() + 16 {
            route.blocks.shrink_to_fit();
        }
        self.activity.update(before, route.activity_key());
    }

    /// Releases the oldest pending decisions past [`StateBounds::max_pending`], and drops
    /// stale ids from the order once they outnumber the pending decisions.
    fn bound_pending(&mut self) {
        while self.pending.len() > self.bounds.max_pending as usize {
            let Some((seq, id)) = self.pending_order.pop_front() else {
                break;
            };
            if self.pending.get(&id).is_some_and(|p| p.seq == seq)
                && let Some(p) = self.pending.remove(&id)
            {
                self.release(p);
                self.dropped_pending += 1;
            }
        }
        while let Some(&(seq, id)) = self.pending_order.front()
            && self.pending.get(&id).is_none_or(|p| p.seq != seq)
        {
            self.pending_order.pop_front();
        }
        if self.pending_order.len() > 2 * self.pending.len() + 64 {
            let pending = &self.pending;
            self.pending_order
                .retain(|(seq, id)| pending.get(id).is_some_and(|p| p.seq == *seq));
        }
    }

    /// Adds (or takes back) a pending decision's prefill estimate on its prefilling worker.
    pub(super) fn add_backlog(&mut self, p: &Pending, add: bool) {
        if let Some(c) = self.counters_mut(p.prefill.unwrap_or(p.decode)) {
            c.prefill_us = if add {
                c.prefill_us.saturating_add(p.prefill_us)
            } else {
                c.prefill_us.saturating_sub(p.prefill_us)
            };
        }
    }

    /// Drops the stale ids at the front of decode worker `d`'s awaiting queue (decisions
    /// completed, re-applied or whose KV arrived), and every stale id once they outnumber the
    /// live ones, as `bound_pending` does for the pending order.
    fn trim_awaiting(&mut self, d: WorkerId) {
        let live = self.counters.get(d.0 as usize).map_or(0, |c| c.awaiting_kv) as usize;
        let Some(q) = self.awaiting_kv.get_mut(d.0 as usize) else {
            return;
        };
        let pending = &self.pending;
        let is_live = |(seq, id): &(u64, RequestId)| {
            pending
                .get(id)
                .is_some_and(|p| p.seq == *seq && p.awaiting_kv)
        };
        while q.front().is_some_and(|e| !is_live(e)) {
            q.pop_front();
        }
        if q.len() > 2 * live + 64 {
            q.retain(is_live);
        }
    }

    /// Takes a decision out of its decode worker's count of P→D requests awaiting their KV.
    pub(super) fn kv_arrived(&mut self, p: &Pending) {
        if p.awaiting_kv {
            if let Some(c) = self.counters_mut(p.decode) {
                c.awaiting_kv = c.awaiting_kv.saturating_sub(1);
                c.awaiting_kv_blocks = c.awaiting_kv_blocks.saturating_sub(u64::from(p.kv_blocks));
            }
            self.trim_awaiting(p.decode);
        }
    }

    pub(super) fn release(&mut self, p: Pending) {
        self.add_backlog(&p, false);
        self.kv_arrived(&p);
        for id in std::iter::once(p.decode).chain(p.prefill) {
            if let Some(c) = self.counters_mut(id) {
                c.in_flight = c.in_flight.saturating_sub(1);
            }
        }
        if let Some(pre) = p.prefill
            && let Some(n) = self.pairs.get_mut(&(pre, p.decode))
        {
            *n -= 1;
            if *n == 0 {
                self.pairs.remove(&(pre, p.decode));
            }
        }
    }
}
