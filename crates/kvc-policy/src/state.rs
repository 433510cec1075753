//! What the router remembers between decisions.

use crate::config::PolicyConfig;
use crate::decision::StateChange;
use crate::index::{BlockIndex, BlockView, Map, WorkerSet};
use crate::view::{MAX_WORKERS, WorkerView};
use kvc_core::{BlockHash, Outcome, RequestId, SessionId, WorkerId, WorkerRole};
use serde::{Deserialize, Serialize};

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
    /// Block ids of the session's last request: what `current_d` holds when resident.
    pub blocks: Vec<BlockHash>,
    /// Caller time of the last decision applied for the session.
    pub last_routed_ms: u64,
    rejects: Vec<(WorkerId, u32)>,
    /// A reject already counted by an observation and not yet consumed by a re-route.
    observed_reject: Option<WorkerId>,
    /// The worker whose live block view holds `blocks` on behalf of this session.
    live_on: Option<WorkerId>,
}

impl SessionRoute {
    fn new() -> Self {
        SessionRoute {
            current_d: None,
            residency: Residency::NotResident,
            d_changes: 0,
            resident_tokens: 0,
            blocks: Vec::new(),
            last_routed_ms: 0,
            rejects: Vec::new(),
            observed_reject: None,
            live_on: None,
        }
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

    fn set_rejects(&mut self, worker: WorkerId, n: u32) {
        match self.rejects.iter_mut().find(|(w, _)| *w == worker) {
            Some(entry) => entry.1 = n,
            None => self.rejects.push((worker, n)),
        }
        self.rejects.sort_unstable_by_key(|(w, _)| *w);
    }
}

/// Feedback from the data plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "event")]
pub enum Observation {
    /// The request finished (any outcome) on its D / colocated worker; the worker now holds
    /// `resident_tokens` of the session (0 if none) — hash_ids are the request's blocks.
    Completed {
        /// The request.
        request_id: RequestId,
        /// Its session.
        session: Option<SessionId>,
        /// The D (or colocated worker) that served it.
        worker: WorkerId,
        /// How it ended.
        outcome: Outcome,
        /// Tokens of the session the worker keeps resident.
        resident_tokens: u64,
        /// Whether it went direct-to-D.
        direct: bool,
    },
    /// D refused a direct-to-D admission for the session.
    AdmissionRejected {
        /// The session.
        session: SessionId,
        /// The D that refused.
        worker: WorkerId,
    },
    /// D evicted the session's KV.
    Evicted {
        /// The session.
        session: SessionId,
        /// The D that evicted it.
        worker: WorkerId,
    },
}

#[derive(Debug, Clone, Copy, Default)]
struct WorkerCounters {
    in_flight: u32,
    assignments: u64,
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    decode: WorkerId,
    prefill: Option<WorkerId>,
}

/// Everything the router remembers between decisions: per-session routing state (current D,
/// reject counts per D, number of D changes, last known resident tokens), the per-worker block
/// view (what the router believes is cached/resident where), round-robin cursors, per-worker
/// assignment and in-flight counters.
///
/// The state is the same for every policy (each policy reads the parts it needs), so a router
/// may switch policy without rebuilding it. It changes only through [`RouterState::apply`],
/// [`RouterState::observe`] and [`RouterState::forget_session`]; [`crate::route`] only reads it.
#[derive(Debug, Clone)]
pub struct RouterState {
    policy: &'static str,
    sessions: Map<SessionId, SessionRoute>,
    index: BlockIndex,
    counters: Vec<WorkerCounters>,
    pending: Map<RequestId, Pending>,
    pairs: Map<(WorkerId, WorkerId), u32>,
    /// Last chosen worker per role (prefill, decode, colocated).
    cursors: [Option<WorkerId>; 3],
    /// Decode workers that take no direct-to-D turn (no decode-side append-prefill).
    no_direct: WorkerSet,
}

fn role_index(role: WorkerRole) -> usize {
    match role {
        WorkerRole::Prefill => 0,
        WorkerRole::Decode => 1,
        WorkerRole::Colocated => 2,
    }
}

impl RouterState {
    /// An empty state for a router running `config` over `workers` (used to size the per-worker
    /// counters; workers that appear later are added on first use).
    pub fn new(config: &PolicyConfig, workers: &[WorkerView]) -> Self {
        let slots = workers
            .iter()
            .map(|w| w.id.0 as usize + 1)
            .max()
            .unwrap_or(0)
            .min(MAX_WORKERS);
        RouterState {
            policy: config.name(),
            sessions: Map::default(),
            index: BlockIndex::default(),
            counters: vec![WorkerCounters::default(); slots],
            pending: Map::default(),
            pairs: Map::default(),
            cursors: [None; 3],
            no_direct: WorkerSet::EMPTY,
        }
    }

    /// Declares whether decode worker `worker` takes direct-to-D turns (every worker does
    /// unless told otherwise). A worker whose engine cannot append-prefill (no decode-side
    /// prefill of the new tokens) must be declared `false`: every policy then routes a later
    /// turn of a session resident there through a prefill worker, with the fall-through reason
    /// `direct-unsupported`, so the state never records a direct turn it could not serve.
    /// Ids at or above [`MAX_WORKERS`] are ignored.
    pub fn set_direct_append(&mut self, worker: WorkerId, accepts: bool) {
        let slot = worker.0 as usize;
        if slot >= MAX_WORKERS {
            return;
        }
        if accepts {
            self.no_direct.remove(slot);
        } else {
            self.no_direct.insert(slot);
        }
    }

    /// Whether `worker` takes direct-to-D turns (see [`RouterState::set_direct_append`]).
    pub fn accepts_direct(&self, worker: WorkerId) -> bool {
        !self.no_direct.contains(worker.0 as usize)
    }

    /// The stable name of the policy the state was created for (informational: the state
    /// itself is policy-independent).
    pub fn policy_name(&self) -> &'static str {
        self.policy
    }

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
        let pending = Pending {
            decode: change.decode,
            prefill: change.prefill,
        };
        for id in std::iter::once(change.decode).chain(change.prefill) {
            if let Some(c) = self.counters_mut(id) {
                c.in_flight = c.in_flight.saturating_add(1);
                c.assignments = c.assignments.saturating_add(1);
            }
        }
        if let Some(p) = change.prefill {
            *self.pairs.entry((p, change.decode)).or_insert(0) += 1;
            self.index.record_seen(p.0 as usize, &change.blocks);
            self.cursors[role_index(WorkerRole::Prefill)] = Some(p);
        }
        self.pending.insert(change.request_id, pending);
        self.index
            .record_seen(change.decode.0 as usize, &change.blocks);
        self.cursors[role_index(change.decode_role)] = Some(change.decode);

        let Some(sid) = change.session else {
            return;
        };
        let route = self.sessions.entry(sid).or_insert_with(SessionRoute::new);
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
        // Move the session's live blocks to the new list on the chosen worker.
        let d = change.decode.0 as usize;
        match route.live_on {
            Some(w) if w == change.decode => {
                let k = kvc_core::prefix::shared_prefix_blocks(&route.blocks, &change.blocks);
                self.index.remove_live(d, &route.blocks[k..]);
                self.index.add_live(d, &change.blocks[k..]);
            }
            other => {
                if let Some(w) = other {
                    self.index.remove_live(w.0 as usize, &route.blocks);
                }
                self.index.add_live(d, &change.blocks);
            }
        }
        route.live_on = Some(change.decode);
        route.blocks.clear();
        route.blocks.extend_from_slice(&change.blocks);
    }

    fn release(&mut self, p: Pending) {
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

    fn drop_live(index: &mut BlockIndex, route: &mut SessionRoute) {
        if let Some(w) = route.live_on.take() {
            index.remove_live(w.0 as usize, &route.blocks);
        }
    }

    /// Takes feedback from the data plane into account.
    ///
    /// - `Completed`: the request stops counting in flight; if `worker` is the session's current
    ///   D, a positive `resident_tokens` confirms residency and 0 ends it (an eviction already
    ///   reported stays `evicted`); a successful (`ok`) direct-to-D turn resets the session's
    ///   reject counter on `worker` to 0.
    /// - `AdmissionRejected`: the session's reject counter on `worker` grows by one (a re-route
    ///   of the same reject with [`crate::RouteRequest::rejected_by`] does not count it again).
    /// - `Evicted`: if `worker` is the session's current D, the session is `evicted` there and
    ///   leaves the live block view. The grow-only view keeps its blocks.
    pub fn observe(&mut self, event: &Observation) {
        match *event {
            Observation::Completed {
                request_id,
                session,
                worker,
                outcome,
                resident_tokens,
                direct,
            } => {
                if let Some(p) = self.pending.remove(&request_id) {
                    self.release(p);
                }
                let Some(route) = session.and_then(|s| self.sessions.get_mut(&s)) else {
                    return;
                };
                if direct && outcome == Outcome::Ok {
                    route.set_rejects(worker, 0);
                    if route.observed_reject == Some(worker) {
                        route.observed_reject = None;
                    }
                }
                if route.current_d != Some(worker) {
                    return;
                }
                if resident_tokens > 0 {
                    route.residency = Residency::Resident;
                    route.resident_tokens = resident_tokens;
                    if route.live_on.is_none() && (worker.0 as usize) < MAX_WORKERS {
                        self.index.add_live(worker.0 as usize, &route.blocks);
                        route.live_on = Some(worker);
                    }
                } else {
                    if route.residency != Residency::Evicted {
                        route.residency = Residency::NotResident;
                    }
                    route.resident_tokens = 0;
                    Self::drop_live(&mut self.index, route);
                }
            }
            Observation::AdmissionRejected { session, worker } => {
                let route = self
                    .sessions
                    .entry(session)
                    .or_insert_with(SessionRoute::new);
                let n = route.rejects_on(worker).saturating_add(1);
                route.set_rejects(worker, n);
                route.observed_reject = Some(worker);
            }
            Observation::Evicted { session, worker } => {
                let Some(route) = self.sessions.get_mut(&session) else {
                    return;
                };
                if route.current_d == Some(worker) {
                    route.residency = Residency::Evicted;
                    route.resident_tokens = 0;
                    Self::drop_live(&mut self.index, route);
                }
            }
        }
    }

    /// The routing state of a session.
    pub fn session(&self, id: SessionId) -> Option<&SessionRoute> {
        self.sessions.get(&id)
    }

    /// Drops a session's routing state (and its blocks from the live view); for routers that
    /// bound their tables or expire idle sessions.
    pub fn forget_session(&mut self, id: SessionId) {
        if let Some(mut route) = self.sessions.remove(&id) {
            Self::drop_live(&mut self.index, &mut route);
        }
    }

    /// Every session with routing state, in no particular order.
    pub fn sessions(&self) -> impl Iterator<Item = (SessionId, &SessionRoute)> + '_ {
        self.sessions.iter().map(|(id, r)| (*id, r))
    }

    /// Sessions with routing state.
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Requests this router dispatched to `worker` that have not completed.
    pub fn in_flight(&self, worker: WorkerId) -> u32 {
        self.counters
            .get(worker.0 as usize)
            .map_or(0, |c| c.in_flight)
    }

    /// Requests ever assigned to `worker`.
    pub fn assignments(&self, worker: WorkerId) -> u64 {
        self.counters
            .get(worker.0 as usize)
            .map_or(0, |c| c.assignments)
    }

    /// P→D requests in flight from `prefill` to `decode`.
    pub fn pair_in_flight(&self, prefill: WorkerId, decode: WorkerId) -> u32 {
        self.pairs.get(&(prefill, decode)).copied().unwrap_or(0)
    }

    /// The last worker chosen in `role` (the round-robin cursor).
    pub fn cursor(&self, role: WorkerRole) -> Option<WorkerId> {
        self.cursors[role_index(role)]
    }

    /// Leading blocks of `blocks` the router has ever sent to `worker` (grow-only view).
    pub fn seen_depth(&self, worker: WorkerId, blocks: &[BlockHash]) -> usize {
        self.depth(worker, blocks, BlockView::Seen)
    }

    /// Leading blocks of `blocks` the router believes resident on `worker` now (live view).
    pub fn resident_depth(&self, worker: WorkerId, blocks: &[BlockHash]) -> usize {
        self.depth(worker, blocks, BlockView::Live)
    }

    fn depth(&self, worker: WorkerId, blocks: &[BlockHash], view: BlockView) -> usize {
        if worker.0 as usize >= MAX_WORKERS {
            return 0;
        }
        self.index.depth(blocks, worker.0 as usize, view) as usize
    }

    /// Distinct blocks in the block view.
    pub fn known_blocks(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn index(&self) -> &BlockIndex {
        &self.index
    }
}
