//! What the router remembers between decisions: the state's tables, how it is made, and what
//! it answers. Its sessions (`state/session.rs`), bounds (`state/bounds.rs`), decisions carried
//! out (`state/pending.rs`), feedback taken in (`state/observe.rs`) and active-session counts
//! (`state/activity.rs`) each have a module of their own.

use crate::config::PolicyConfig;
use crate::index::{BlockIndex, BlockView, Map};
use crate::view::{MAX_WORKERS, WorkerView};
use crate::worker_set::WorkerSet;
use kvc_core::{BlockHash, BlockSize, RequestId, SessionId, WorkerId, WorkerRole};
use std::collections::VecDeque;

mod activity;
mod bounds;
mod observe;
mod pending;
mod session;

#[cfg(test)]
mod tests;

use activity::Activity;
pub use bounds::{MAX_RESERVED, StateBounds, reserved};
pub use observe::Observation;
pub use session::{Residency, SessionRoute};

#[derive(Debug, Clone, Copy, Default)]
struct WorkerCounters {
    in_flight: u32,
    assignments: u64,
    /// Estimated prefill microseconds of the pending decisions that prefill on the worker and
    /// have not reported their first token.
    prefill_us: u64,
    /// P→D decisions into the worker (as D) whose KV has not arrived: no first token
    /// reported, not completed.
    awaiting_kv: u32,
    /// The prompt blocks of those decisions: KV on its way to the worker, which its pool must
    /// find room for when it lands.
    awaiting_kv_blocks: u64,
    /// How the worker's first tokens came against the estimates ([`RouterState::prefill_pace`]).
    pace: Pace,
}

/// Decayed sums of a worker's measured times to first token and of what the router's
/// estimates gave for them (the backlog ahead of each request and its own prefill).
#[derive(Debug, Clone, Copy, Default)]
struct Pace {
    measured_us: f64,
    estimated_us: f64,
    samples: u32,
}

impl Pace {
    /// Each sample's weight falls by this much per later sample (about the last 20 count).
    const DECAY: f64 = 0.95;
    /// Samples before the pace is used.
    const MIN_SAMPLES: u32 = 3;
    /// The range the pace is kept in.
    const RANGE: (f64, f64) = (1.0 / 64.0, 4096.0);

    fn add(&mut self, measured_us: f64, estimated_us: f64) {
        self.measured_us = self.measured_us * Self::DECAY + measured_us;
        self.estimated_us = self.estimated_us * Self::DECAY + estimated_us;
        self.samples = self.samples.saturating_add(1);
    }

    fn value(&self) -> f64 {
        if self.samples < Self::MIN_SAMPLES || self.estimated_us <= 0.0 {
            return 1.0;
        }
        (self.measured_us / self.estimated_us).clamp(Self::RANGE.0, Self::RANGE.1)
    }
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    decode: WorkerId,
    prefill: Option<WorkerId>,
    /// Order of application, to find the oldest pending decision.
    seq: u64,
    /// Its prefill estimate still counted on the worker that prefills it (`prefill`, else
    /// `decode`); 0 once its first token is reported.
    prefill_us: u64,
    /// The estimates of the decisions ahead of it on that worker when it was applied (its
    /// backlog then).
    ahead_us: u64,
    /// When it was applied (the decision's `now_ms`).
    sent_ms: u64,
    /// A P→D decision whose KV has not reached its D yet (no first token reported).
    awaiting_kv: bool,
    /// The request's prompt blocks (what its D holds once the KV lands).
    kv_blocks: u32,
}

/// Everything the router remembers between decisions: per-session routing state (current D,
/// reject counts per D, number of D changes, last known resident tokens), the per-worker block
/// view (what the router believes is cached/resident where), round-robin cursors, per-worker
/// assignment and in-flight counters.
///
/// The state is the same for every policy (each policy reads the parts it needs), so a router
/// may switch policy without rebuilding it. It changes only through [`RouterState::apply`],
/// [`RouterState::observe`] and [`RouterState::forget_session`]; [`crate::route`] only reads it.
///
/// # Memory and cost
///
/// Every table is bounded (`docs/kvc-policy.md`, "Memory and cost", has the derivation):
///
/// | table | bound | bytes per entry (about, 64-bit) |
/// |---|---|---|
/// | sessions | the caller's, through [`RouterState::forget_session`] (the router's session table) | 150–260, plus 8 per kept block of its last request (at most [`StateBounds::max_session_blocks`], default 256), plus 8 per D with a reject count |
/// | active-session aggregate | one entry per session resident on its D and routed within two `active-window-ms` of the latest decision | 30 |
/// | block view: distinct blocks | at most the memberships below | 90–110, more for a block held by over four workers |
/// | block view: (block, worker, view) memberships | [`StateBounds::blocks_per_worker`] per worker and view (default 4 × the worker's pool in blocks) | 40–60 |
/// | pending decisions | [`StateBounds::max_pending`] (default 65,536) | 90, with its P/D pair count |
/// | per-worker counters, round-robin cursors | [`MAX_WORKERS`] | 16 |
///
/// A decision costs the same whatever the number of sessions: it reads its own session, the
/// block view (a few lookups per distinct depth among the candidates), per-worker counters and,
/// for `kvc`, the active-session aggregate, which adjusts its per-D totals only by the sessions
/// whose window ends between its own time and the latest applied decision's. (A `kvc` configuration whose
/// `active-window-ms` differs from the one the state was created with, or a decision dated more
/// than one window before the latest applied one, counts active sessions by a scan of every
/// session instead.)
#[derive(Debug, Clone)]
pub struct RouterState {
    policy: &'static str,
    bounds: StateBounds,
    block_size: BlockSize,
    sessions: Map<SessionId, SessionRoute>,
    index: BlockIndex,
    activity: Activity,
    counters: Vec<WorkerCounters>,
    pending: Map<RequestId, Pending>,
    /// Pending decisions in order of application, with stale ids (completed or re-applied)
    /// skipped when met.
    pending_order: VecDeque<(u64, RequestId)>,
    /// Per decode worker (by index), its P→D decisions in order of application, with the
    /// same stale-id rule as `pending_order`; the front is always one still awaiting its KV
    /// (or the queue is empty), so the oldest such wait is read in constant time.
    awaiting_kv: Vec<VecDeque<(u64, RequestId)>>,
    next_seq: u64,
    dropped_pending: u64,
    dropped_session_blocks: u64,
    pairs: Map<(WorkerId, WorkerId), u32>,
    /// Transfer failures in a row per (P, D) pair: a P→D request through the pair that ended
    /// in `kv-transfer-timeout` adds one, one served through it clears the entry. At most one
    /// entry per pair of workers.
    pair_failures: Map<(WorkerId, WorkerId), u32>,
    /// Last chosen worker per role (prefill, decode, colocated).
    cursors: [Option<WorkerId>; 3],
    /// Decode workers that take no direct-to-D turn (no decode-side append-prefill).
    no_direct: WorkerSet,
    /// Workers whose grow-only view the policy never reads, so none is kept: under `kvc` and
    /// `kvc-v2`, the workers that prefill for no other (that view is read only of the
    /// workers a P→D prefill can run on).
    seen_unread: WorkerSet,
}

fn role_index(role: WorkerRole) -> usize {
    match role {
        WorkerRole::Prefill => 0,
        WorkerRole::Decode => 1,
        WorkerRole::Colocated => 2,
    }
}

impl RouterState {
    /// An empty state for a router running `config` over `workers`, with the default
    /// [`StateBounds`] (see [`RouterState::with_bounds`]).
    pub fn new(config: &PolicyConfig, workers: &[WorkerView]) -> Self {
        Self::with_bounds(config, workers, StateBounds::default())
    }

    /// An empty state for a router running `config` over `workers`, holding at most what
    /// `bounds` allows. `workers` size the per-worker counters (workers that appear later are
    /// added on first use) and give each worker its block bound from its published capacity
    /// ([`StateBounds::blocks_for`], with the block size of `config`); a router that learns a
    /// pool later sets it with [`RouterState::set_worker_blocks`].
    pub fn with_bounds(config: &PolicyConfig, workers: &[WorkerView], bounds: StateBounds) -> Self {
        let slots = workers
            .iter()
            .map(|w| w.id.0 as usize + 1)
            .max()
            .unwrap_or(0)
            .min(MAX_WORKERS);
        let block_size = config.block_size();
        let window_ms = match config {
            PolicyConfig::Kvc(c) => c.active_window_ms,
            _ => crate::KvcConfig::default().active_window_ms,
        };
        let mut index = BlockIndex::new(bounds.blocks_for(0, block_size));
        let mut seen_unread = WorkerSet::EMPTY;
        let reads_seen_of_every_worker =
            !matches!(config, PolicyConfig::Kvc(_) | PolicyConfig::KvcV2(_));
        for w in workers {
            if !reads_seen_of_every_worker
                && (w.id.0 as usize) < MAX_WORKERS
                && w.role != WorkerRole::Colocated
                && !w.caps.prefill
            {
                seen_unread.insert(w.id.0 as usize);
            }
            if (w.id.0 as usize) < MAX_WORKERS {
                index.set_bound(
                    w.id.0 as usize,
                    bounds.blocks_for(w.state.capacity_tokens, block_size),
                );
            }
        }
        RouterState {
            policy: config.name(),
            bounds,
            block_size,
            sessions: Map::default(),
            index,
            activity: Activity::new(window_ms),
            counters: vec![WorkerCounters::default(); slots],
            // Room for twice the bound: a table kept full by its bound then rehashes in place
            // as entries come and go, instead of growing once more (see `reserve_sessions`).
            pending: Map::with_capacity_and_hasher(
                reserved(bounds.max_pending as usize),
                Default::default(),
            ),
            pending_order: VecDeque::new(),
            awaiting_kv: Vec::new(),
            next_seq: 0,
            dropped_pending: 0,
            dropped_session_blocks: 0,
            pairs: Map::default(),
            pair_failures: Map::default(),
            cursors: [None; 3],
            no_direct: WorkerSet::EMPTY,
            seen_unread,
        }
    }

    /// Makes room for `sessions` sessions, the bound the caller keeps the session table at,
    /// with as much again to spare: a hash table full to its bound, whose entries keep being
    /// replaced, rehashes in place only while at most half full, and otherwise grows once
    /// more, late and at a time that depends on the churn. Reserving up front moves that
    /// growth to the start; the memory is touched as sessions arrive.
    /// (At most [`MAX_RESERVED`] entries are reserved; a larger table grows as it fills.)
    pub fn reserve_sessions(&mut self, sessions: usize) {
        let want = reserved(sessions);
        self.sessions
            .reserve(want.saturating_sub(self.sessions.len()));
    }

    /// The bounds the state was created with.
    pub fn bounds(&self) -> &StateBounds {
        &self.bounds
    }

    /// Sets the per-view block bound of `worker` from its pool of `capacity_tokens` (see
    /// [`StateBounds::blocks_for`]), e.g. once a worker that was unknown or unreachable when
    /// the state was created publishes its capacity; blocks past the new bound leave at once,
    /// least recently used first. Ids at or above [`MAX_WORKERS`] are ignored.
    pub fn set_worker_blocks(&mut self, worker: WorkerId, capacity_tokens: u64) {
        let slot = worker.0 as usize;
        if slot < MAX_WORKERS {
            let n = self.bounds.blocks_for(capacity_tokens, self.block_size);
            self.index.set_bound(slot, n);
        }
    }

    /// The most blocks the block view keeps for `worker` in each view.
    pub fn worker_block_bound(&self, worker: WorkerId) -> u32 {
        self.index.bound(worker.0 as usize)
    }

    /// Whether the grow-only view is kept for `worker`: not for a worker whose view the policy
    /// never reads (under `kvc` and `kvc-v2`, a worker of the initial fleet that prefills for
    /// no other); always for one that joined later.
    pub fn keeps_seen(&self, worker: WorkerId) -> bool {
        !self.seen_unread.contains(worker.0 as usize)
    }

    /// Blocks the grow-only view holds for `worker` (at most its bound).
    pub fn seen_blocks(&self, worker: WorkerId) -> usize {
        self.index.held(worker.0 as usize, BlockView::Seen)
    }

    /// Blocks the live view holds for `worker` (at most its bound).
    pub fn live_blocks(&self, worker: WorkerId) -> usize {
        self.index.held(worker.0 as usize, BlockView::Live)
    }

    /// (worker, block) memberships the block bound has removed so far.
    pub fn dropped_blocks(&self) -> u64 {
        self.index.dropped()
    }

    /// Decisions applied and not yet completed.
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Pending decisions released by [`StateBounds::max_pending`] so far.
    pub fn dropped_pending(&self) -> u64 {
        self.dropped_pending
    }

    /// Blocks of applied requests that [`StateBounds::max_session_blocks`] kept out of their
    /// session's list (and of the live view) so far.
    pub fn dropped_session_blocks(&self) -> u64 {
        self.dropped_session_blocks
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

    /// Workers that take no direct-to-D turns.
    pub(crate) fn no_direct(&self) -> &WorkerSet {
        &self.no_direct
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

    fn drop_live(index: &mut BlockIndex, route: &mut SessionRoute) {
        if let Some(w) = route.live_on.take() {
            index.remove_live(w.0 as usize, &route.blocks);
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
            self.activity.remove(route.activity_key());
        }
    }

    /// Forgets what the state believes `worker` holds, for a worker taken out of the fleet:
    /// every session placed or resident there counts as evicted from it (its next turn is
    /// re-seeded elsewhere, as after an eviction), and its blocks leave both views of the
    /// block index. Its block bound is kept, so a worker added later under the same id starts
    /// empty with the same bound. Returns the sessions that were resident on it.
    pub fn forget_worker(&mut self, worker: WorkerId) -> usize {
        // An id given to another worker later keeps its grow-only view.
        self.seen_unread.remove(worker.0 as usize);
        let mut resident = 0;
        for route in self.sessions.values_mut() {
            let placed = route.current_d == Some(worker);
            if placed || route.live_on == Some(worker) {
                let before = route.activity_key();
                if placed && route.residency == Residency::Resident {
                    resident += 1;
                    route.residency = Residency::Evicted;
                    route.resident_tokens = 0;
                }
                if route.live_on == Some(worker) {
                    Self::drop_live(&mut self.index, route);
                }
                self.activity.update(before, route.activity_key());
            }
        }
        let slot = worker.0 as usize;
        if slot < MAX_WORKERS {
            let bound = self.index.bound(slot);
            self.index.set_bound(slot, 0);
            self.index.set_bound(slot, bound);
        }
        resident
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

    /// How long (ms, at `now_ms`) the oldest P→D request the router has sent to decode worker
    /// `worker` has been waiting for its KV to arrive there: applied, no first token reported
    /// ([`Observation::PrefillDone`]), not completed; 0 when none waits. Without first-token
    /// reports the wait counts until the request completes.
    pub fn oldest_kv_wait_ms(&self, worker: WorkerId, now_ms: u64) -> u64 {
        self.awaiting_kv
            .get(worker.0 as usize)
            .and_then(|q| q.front())
            .and_then(|(_, id)| self.pending.get(id))
            .map_or(0, |p| now_ms.saturating_sub(p.sent_ms))
    }

    /// P→D requests the router has sent to decode worker `worker` whose KV has not arrived
    /// (see [`RouterState::oldest_kv_wait_ms`]).
    pub fn awaiting_kv(&self, worker: WorkerId) -> u32 {
        self.counters
            .get(worker.0 as usize)
            .map_or(0, |c| c.awaiting_kv)
    }

    /// The prompt blocks of those requests ([`RouterState::awaiting_kv`]): KV on its way to
    /// `worker` that its pool must find room for, which the worker's own figures do not show
    /// until it lands.
    pub fn awaiting_kv_blocks(&self, worker: WorkerId) -> u64 {
        self.counters
            .get(worker.0 as usize)
            .map_or(0, |c| c.awaiting_kv_blocks)
    }

    /// Estimated seconds of prefill the router has sent `worker` that have not reported their
    /// first token ([`Observation::PrefillDone`]) or completed: the queue ahead of a new
    /// prefill there, as far as the router knows.
    pub fn prefill_backlog_s(&self, worker: WorkerId) -> f64 {
        self.counters
            .get(worker.0 as usize)
            .map_or(0.0, |c| c.prefill_us as f64 / 1e6)
    }

    /// How much longer `worker`'s first tokens take than the router's estimates give: the
    /// measured time from sending a request to its first token over the estimate of the
    /// backlog ahead of it and of its own prefill, as decayed sums over the requests reported
    /// with a time ([`Observation::PrefillDone`] `at_ms`), the latest weighing most. 1 until
    /// three have been (and for a worker with none). An engine on slower hardware, or
    /// serving a larger model, than the estimates' rates assume has a pace above 1.
    pub fn prefill_pace(&self, worker: WorkerId) -> f64 {
        self.counters
            .get(worker.0 as usize)
            .map_or(1.0, |c| c.pace.value())
    }

    /// [`RouterState::prefill_backlog_s`] at the worker's own pace
    /// ([`RouterState::prefill_pace`]): the seconds of prefill queued there as it measures.
    pub fn paced_backlog_s(&self, worker: WorkerId) -> f64 {
        self.prefill_backlog_s(worker) * self.prefill_pace(worker)
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

    /// P→D requests from `prefill` to `decode` that ended in `kv-transfer-timeout` since the
    /// last one served through that pair.
    pub fn pair_failures(&self, prefill: WorkerId, decode: WorkerId) -> u32 {
        self.pair_failures
            .get(&(prefill, decode))
            .copied()
            .unwrap_or(0)
    }

    /// The last worker chosen in `role` (the round-robin cursor).
    pub fn cursor(&self, role: WorkerRole) -> Option<WorkerId> {
        self.cursors[role_index(role)]
    }

    /// Leading blocks of `blocks` the router has sent to `worker` (grow-only view, within the
    /// worker's block bound).
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

    /// Distinct blocks in the block view (held by some worker in either view).
    pub fn known_blocks(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn index(&self) -> &BlockIndex {
        &self.index
    }
}
