//! One session's routing state: where it was last sent, whether its KV is believed there, its
//! rejects and the leading blocks of its last request.

use kvc_core::{BlockHash, WorkerId};
use serde::{Deserialize, Serialize};

#[cfg(doc)]
use crate::{Observation, StateBounds};

/// Whether the router believes a session's KV is on its current D.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Residency {
    /// Not resident: never placed, or its last request left nothing behind (a completion with
    /// no resident tokens, e.g. a failed transfer).
    NotResident,
    /// Resident on the current D (placed by a decision, confirmed by completions).
    Resident,
    /// The current D reported evicting it.
    Evicted,
}

/// The routing state of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRoute {
    /// The D (or colocated worker) the session was last routed to.
    pub current_d: Option<WorkerId>,
    /// Whether its KV is believed to be there.
    pub residency: Residency,
    /// How many times the session moved to a different D.
    pub d_changes: u32,
    /// Tokens of the session resident on `current_d`, as last reported by a completion.
    pub resident_tokens: u64,
    /// Leading block ids of the session's last request (at most
    /// [`StateBounds::max_session_blocks`] of them): what `current_d` holds when resident.
    pub blocks: Vec<BlockHash>,
    /// Blocks of the session's last request, `blocks` and those past the cap together.
    pub(super) block_count: usize,
    /// The last block id of the session's last request, kept when the cap cut it off.
    pub(super) last_block: Option<BlockHash>,
    /// Caller time of the last decision applied for the session.
    pub last_routed_ms: u64,
    pub(super) rejects: Vec<(WorkerId, u32)>,
    /// A reject already counted by an observation and not yet consumed by a re-route.
    pub(super) observed_reject: Option<WorkerId>,
    /// The worker whose live block view holds `blocks` on behalf of this session.
    pub(super) live_on: Option<WorkerId>,
}

impl SessionRoute {
    pub(super) fn new() -> Self {
        SessionRoute {
            current_d: None,
            residency: Residency::NotResident,
            d_changes: 0,
            resident_tokens: 0,
            blocks: Vec::new(),
            block_count: 0,
            last_block: None,
            last_routed_ms: 0,
            rejects: Vec::new(),
            observed_reject: None,
            live_on: None,
        }
    }

    /// Blocks of the session's last request, including any past
    /// [`StateBounds::max_session_blocks`] that [`SessionRoute::blocks`] does not keep.
    pub fn block_count(&self) -> usize {
        self.block_count
    }

    /// Leading blocks of `request` the session's last request shares with it. Exact when the
    /// last request's list was kept whole, or when `request` extends all of it (block ids are
    /// chained: sharing the last block means sharing every block before it); otherwise at most
    /// the kept blocks.
    pub fn shared_prefix(&self, request: &[BlockHash]) -> usize {
        let n = self.block_count;
        if n > self.blocks.len() && request.len() >= n && Some(request[n - 1]) == self.last_block {
            return n;
        }
        kvc_core::prefix::shared_prefix_blocks(&self.blocks, request)
    }

    /// Admission rejects of the session on `worker` since the counter was last reset (by a
    /// successful direct-to-D turn there, or by a migration away from it).
    pub fn rejects_on(&self, worker: WorkerId) -> u32 {
        self.rejects
            .iter()
            .find(|(w, _)| *w == worker)
            .map_or(0, |(_, n)| *n)
    }

    /// Reject counters that are not zero, by worker id.
    pub fn reject_counts(&self) -> impl Iterator<Item = (WorkerId, u32)> + '_ {
        self.rejects.iter().copied().filter(|(_, n)| *n > 0)
    }

    /// The reject count on `worker` once the reject that `rejected_by` reports is counted: an
    /// [`Observation::AdmissionRejected`] for it may already have counted it.
    pub(crate) fn rejects_after(&self, worker: WorkerId) -> u32 {
        let n = self.rejects_on(worker);
        if self.observed_reject == Some(worker) {
            n
        } else {
            n.saturating_add(1)
        }
    }

    /// Where and since when the session counts as possibly active: resident on its D, keyed by
    /// the time of its last routing.
    pub(super) fn activity_key(&self) -> Option<(u64, WorkerId)> {
        match (self.residency, self.current_d) {
            (Residency::Resident, Some(d)) => Some((self.last_routed_ms, d)),
            _ => None,
        }
    }

    pub(super) fn set_rejects(&mut self, worker: WorkerId, n: u32) {
        match self.rejects.iter_mut().find(|(w, _)| *w == worker) {
            Some(entry) => entry.1 = n,
            None => self.rejects.push((worker, n)),
        }
        self.rejects.sort_unstable_by_key(|(w, _)| *w);
    }
}
