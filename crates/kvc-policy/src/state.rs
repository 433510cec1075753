//! What the router remembers between decisions.

use crate::config::PolicyConfig;
use crate::decision::StateChange;
use crate::index::{BlockIndex, BlockView, Map, WorkerSet};
use crate::view::{MAX_WORKERS, WorkerView};
use kvc_core::{BlockHash, BlockSize, Outcome, RequestId, SessionId, WorkerId, WorkerRole};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

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
    block_count: usize,
    /// The last block id of the session's last request, kept when the cap cut it off.
    last_block: Option<BlockHash>,
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
    fn activity_key(&self) -> Option<(u64, WorkerId)> {
        match (self.residency, self.current_d) {
            (Residency::Resident, Some(d)) => Some((self.last_routed_ms, d)),
            _ => None,
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
    /// The request's prefill is over: its first token is out. Its prefill estimate
    /// ([`crate::StateChange::prefill_us`]) stops counting in its worker's backlog (without
    /// this, it counts until the request completes).
    PrefillDone {
        /// The request.
        request_id: RequestId,
    },
    /// D evicted the session's KV.
    Evicted {
        /// The session.
        session: SessionId,
        /// The D that evicted it.
        worker: WorkerId,
    },
    /// The engines' own reports (KV-cache events) show `worker` holding a session this state
    /// has no placement for: another router (a replica behind the same load balancer) placed
    /// it there. `blocks` are the leading blocks of the session's current request that
    /// `worker` holds.
    Adopted {
        /// The session.
        session: SessionId,
        /// The worker holding it.
        worker: WorkerId,
        /// The leading blocks it holds.
        blocks: Vec<BlockHash>,
        /// Tokens of the session it holds.
        resident_tokens: u64,
    },
}

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
    /// When it was applied (the decision's `now_ms`).
    sent_ms: u64,
    /// A P→D decision whose KV has not reached its D yet (no first token reported).
    awaiting_kv: bool,
}

/// How much a [`RouterState`] may hold besides its sessions (which the caller bounds, with
/// [`RouterState::forget_session`]). `docs/kvc-policy.md` ("Memory and cost") gives the cost of
/// each entry.
///
/// Serialized in kebab-case; absent fields take the defaults below.
///
/// | field | default |
/// |---|---|
/// | `blocks-per-worker` | none: derived from each worker's pool |
/// | `pool-multiple` | 4 |
/// | `fallback-blocks-per-worker` | 4,096 |
/// | `max-pending` | 65,536 |
/// | `max-session-blocks` | 256 |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct StateBounds {
    /// Blocks the block view keeps per worker, in each of its two views (grow-only and live);
    /// past it the worker's least recently used blocks leave. `None`: `pool-multiple` times the
    /// worker's pool in blocks (its published `capacity_tokens` over the policy's block size,
    /// rounded up) for workers whose capacity is known when the state is created, otherwise
    /// `fallback-blocks-per-worker`.
    pub blocks_per_worker: Option<u32>,
    /// How many pools' worth of blocks a worker keeps when the bound is derived (at least 1).
    pub pool_multiple: u32,
    /// Blocks per worker and view when the bound is derived but the pool is unknown (capacity
    /// 0, or a worker absent when the state was created).
    pub fallback_blocks_per_worker: u32,
    /// Decisions applied and not yet completed that the state tracks; past it the oldest is
    /// released as if it had completed (its in-flight counts drop, its session is untouched).
    pub max_pending: u32,
    /// Leading blocks of a session's last request the state keeps (in [`SessionRoute::blocks`]
    /// and in the live block view); the rest are counted
    /// ([`RouterState::dropped_session_blocks`]) and not kept. A turn that extends the whole
    /// last request is still recognised as such (its reuse is exact); a turn that diverges
    /// past the kept blocks is credited with the kept blocks only.
    pub max_session_blocks: u32,
}

impl Default for StateBounds {
    fn default() -> Self {
        StateBounds {
            blocks_per_worker: None,
            pool_multiple: 4,
            fallback_blocks_per_worker: 4_096,
            max_pending: 65_536,
            max_session_blocks: 256,
        }
    }
}

impl StateBounds {
    /// The per-view block bound of a worker with a pool of `capacity_tokens` (0: unknown).
    pub fn blocks_for(&self, capacity_tokens: u64, block_size: BlockSize) -> u32 {
        if let Some(n) = self.blocks_per_worker {
            return n;
        }
        if capacity_tokens == 0 {
            return self.fallback_blocks_per_worker;
        }
        let pool = block_size.blocks_for(capacity_tokens);
        u32::try_from(pool.saturating_mul(u64::from(self.pool_multiple.max(1)))).unwrap_or(u32::MAX)
    }
}

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
struct Activity {
    window_ms: u64,
    watermark: u64,
    floor: u64,
    entries: BTreeMap<(u64, u32), u32>,
    per_worker: Vec<u32>,
}

impl Activity {
    fn new(window_ms: u64) -> Self {
        Activity {
            window_ms,
            watermark: 0,
            floor: 0,
            entries: BTreeMap::new(),
            per_worker: Vec::new(),
        }
    }

    fn add(&mut self, key: Option<(u64, WorkerId)>) {
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

    fn remove(&mut self, key: Option<(u64, WorkerId)>) {
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

    fn update(&mut self, before: Option<(u64, WorkerId)>, after: Option<(u64, WorkerId)>) {
        if before != after {
            self.remove(before);
            self.add(after);
        }
    }

    /// Moves the watermark to `now_ms − window_ms` if that is later (and the floor one window
    /// below it), dropping the entries under the floor.
    fn advance(&mut self, now_ms: u64) {
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
/// | block view: distinct blocks | at most the memberships below | 95–115 |
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
}

/// The most entries [`RouterState::reserve_sessions`] (and the pending table, for
/// [`StateBounds::max_pending`]) reserves up front.
pub const MAX_RESERVED: usize = 1 << 22;

/// Entries reserved for a table kept at `bound`: twice the bound, at most [`MAX_RESERVED`].
pub fn reserved(bound: usize) -> usize {
    bound.saturating_mul(2).min(MAX_RESERVED)
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
        for w in workers {
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
        self.activity.advance(change.now_ms);
        let awaiting_kv = change.prefill.is_some_and(|p| p != change.decode);
        let pending = Pending {
            decode: change.decode,
            prefill: change.prefill,
            seq: self.next_seq,
            prefill_us: change.prefill_us,
            sent_ms: change.now_ms,
            awaiting_kv,
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
        self.index
            .record_seen(change.decode.0 as usize, &change.blocks);
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
    fn add_backlog(&mut self, p: &Pending, add: bool) {
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
    fn kv_arrived(&mut self, p: &Pending) {
        if p.awaiting_kv {
            if let Some(c) = self.counters_mut(p.decode) {
                c.awaiting_kv = c.awaiting_kv.saturating_sub(1);
            }
            self.trim_awaiting(p.decode);
        }
    }

    fn release(&mut self, p: Pending) {
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
    ///   reject counter on `worker` to 0. An `invalid-request` (the engine refused the request
    ///   itself) changes nothing but the in-flight count.
    /// - `AdmissionRejected`: the session's reject counter on `worker` grows by one (a re-route
    ///   of the same reject with [`crate::RouteRequest::rejected_by`] does not count it again).
    /// - `Evicted`: if `worker` is the session's current D, the session is `evicted` there and
    ///   leaves the live block view. The grow-only view keeps its blocks (until the worker's
    ///   block bound pushes them out, least recently used first).
    /// - `Adopted`: a session with no current D (unknown, or known only by its rejects) is
    ///   taken to be resident on `worker` with `blocks` (capped as a decision's are) in the live
    ///   block view; a session this state has placed keeps its placement, and no blocks change
    ///   nothing.
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
                    if let Some(pre) = p.prefill {
                        let pair = (pre, p.decode);
                        if outcome == Outcome::KvTransferTimeout {
                            let n = self.pair_failures.entry(pair).or_insert(0);
                            *n = n.saturating_add(1);
                        } else if outcome.is_served() {
                            self.pair_failures.remove(&pair);
                        }
                    }
                }
                // The engine refused the request before touching any KV: the session stays
                // where it was, as resident as it was.
                if outcome == Outcome::InvalidRequest {
                    return;
                }
                let Some(route) = session.and_then(|s| self.sessions.get_mut(&s)) else {
                    return;
                };
                let before = route.activity_key();
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
                self.activity.update(before, route.activity_key());
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
            Observation::PrefillDone { request_id } => {
                if let Some(mut p) = self.pending.get(&request_id).copied() {
                    self.add_backlog(&p, false);
                    p.prefill_us = 0;
                    let arrived = p;
                    p.awaiting_kv = false;
                    self.pending.insert(request_id, p);
                    self.kv_arrived(&arrived);
                }
            }
            Observation::Adopted {
                session,
                worker,
                ref blocks,
                resident_tokens,
            } => {
                if blocks.is_empty()
                    || self
                        .sessions
                        .get(&session)
                        .is_some_and(|r| r.current_d.is_some())
                {
                    return;
                }
                let route = self
                    .sessions
                    .entry(session)
                    .or_insert_with(SessionRoute::new);
                let before = route.activity_key();
                let cap = (self.bounds.max_session_blocks as usize).min(blocks.len());
                route.current_d = Some(worker);
                route.residency = Residency::Resident;
                route.resident_tokens = resident_tokens;
                route.blocks.clear();
                route.blocks.extend_from_slice(&blocks[..cap]);
                route.block_count = blocks.len();
                route.last_block = (cap < blocks.len())
                    .then(|| blocks.last().copied())
                    .flatten();
                if (worker.0 as usize) < MAX_WORKERS {
                    self.index.add_live(worker.0 as usize, &route.blocks);
                    route.live_on = Some(worker);
                }
                self.activity.update(before, route.activity_key());
            }
            Observation::Evicted { session, worker } => {
                let Some(route) = self.sessions.get_mut(&session) else {
                    return;
                };
                if route.current_d == Some(worker) {
                    let before = route.activity_key();
                    route.residency = Residency::Evicted;
                    route.resident_tokens = 0;
                    Self::drop_live(&mut self.index, route);
                    self.activity.update(before, route.activity_key());
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
            self.activity.remove(route.activity_key());
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

    /// Estimated seconds of prefill the router has sent `worker` that have not reported their
    /// first token ([`Observation::PrefillDone`]) or completed: the queue ahead of a new
    /// prefill there, as far as the router knows.
    pub fn prefill_backlog_s(&self, worker: WorkerId) -> f64 {
        self.counters
            .get(worker.0 as usize)
            .map_or(0.0, |c| c.prefill_us as f64 / 1e6)
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
        out: &mut [u32; MAX_WORKERS],
    ) {
        let from = now_ms.saturating_sub(window_ms);
        let a = &self.activity;
        if window_ms != a.window_ms || from < a.floor {
            self.scan_active(from, exclude, out);
            return;
        }
        out[..a.per_worker.len()].copy_from_slice(&a.per_worker);
        if from >= a.watermark {
            // Sessions routed in [watermark, from) went quiet since the latest applied decision.
            for (&(_, slot), &n) in a.entries.range((a.watermark, 0)..(from, 0)) {
                out[slot as usize] -= n;
            }
        } else {
            // A decision dated before the latest applied one: sessions routed in
            // [from, watermark) are still active for it.
            for (&(_, slot), &n) in a.entries.range((from, 0)..(a.watermark, 0)) {
                out[slot as usize] += n;
            }
        }
        if let Some((t, d)) = exclude
            .and_then(|s| self.sessions.get(&s))
            .and_then(SessionRoute::activity_key)
            && t >= from
        {
            out[d.0 as usize] -= 1;
        }
    }

    /// [`RouterState::active_sessions`] from scratch, over every session.
    pub(crate) fn scan_active(
        &self,
        from: u64,
        exclude: Option<SessionId>,
        out: &mut [u32; MAX_WORKERS],
    ) {
        for (id, r) in &self.sessions {
            if Some(*id) != exclude
                && let Some((t, d)) = r.activity_key()
                && t >= from
            {
                out[d.0 as usize] += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const WINDOW: u64 = 1_000;

    #[derive(Debug, Clone)]
    enum Op {
        Apply {
            session: Option<u64>,
            decode: u32,
            /// Time step; negative steps model decisions applied out of order.
            step: i64,
            blocks: Vec<u64>,
        },
        Complete {
            back: usize,
            resident: bool,
            direct: bool,
        },
        Reject {
            session: u64,
            worker: u32,
        },
        Evict {
            session: u64,
            worker: u32,
        },
        Forget {
            session: u64,
        },
        FirstToken {
            back: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (
                prop::option::weighted(0.9, 0u64..12),
                1u32..5,
                -300i64..700,
                prop::collection::vec(0u64..30, 0..6),
            )
                .prop_map(|(session, decode, step, blocks)| Op::Apply {
                    session,
                    decode,
                    step,
                    blocks,
                }),
            3 => (0usize..8, any::<bool>(), any::<bool>())
                .prop_map(|(back, resident, direct)| Op::Complete { back, resident, direct }),
            1 => (0u64..12, 1u32..5).prop_map(|(session, worker)| Op::Reject { session, worker }),
            1 => (0u64..12, 1u32..5).prop_map(|(session, worker)| Op::Evict { session, worker }),
            1 => (0u64..12).prop_map(|session| Op::Forget { session }),
            2 => (0usize..8).prop_map(|back| Op::FirstToken { back }),
        ]
    }

    fn workers() -> Vec<WorkerView> {
        (0..5)
            .map(|i| {
                let role = if i == 0 {
                    WorkerRole::Prefill
                } else {
                    WorkerRole::Decode
                };
                WorkerView::new(WorkerId(i), role, kvc_core::WorkerState::empty(4 * 512))
            })
            .collect()
    }

    fn kvc_config() -> PolicyConfig {
        PolicyConfig::Kvc(crate::KvcConfig {
            active_window_ms: WINDOW,
            ..crate::KvcConfig::default()
        })
    }

    /// Runs `ops`, calling `check` after each with the state and the latest decision time.
    fn run(
        state: &mut RouterState,
        ops: &[Op],
        mut check: impl FnMut(&RouterState, u64) -> Result<(), TestCaseError>,
    ) -> Result<(), TestCaseError> {
        let mut now = 5_000u64;
        let mut applied: Vec<(RequestId, Option<SessionId>, WorkerId)> = Vec::new();
        for (k, op) in ops.iter().enumerate() {
            match op {
                Op::Apply {
                    session,
                    decode,
                    step,
                    blocks,
                } => {
                    now = now.saturating_add_signed(*step);
                    let id = RequestId(k as u64);
                    let session = session.map(SessionId);
                    state.apply(&StateChange {
                        request_id: id,
                        session,
                        now_ms: now,
                        decode: WorkerId(*decode),
                        decode_role: WorkerRole::Decode,
                        prefill: Some(WorkerId(0)),
                        direct: false,
                        blocks: blocks.iter().map(|b| BlockHash(*b)).collect(),
                        reject_count: None,
                        prefill_us: 0,
                    });
                    applied.push((id, session, WorkerId(*decode)));
                }
                Op::Complete {
                    back,
                    resident,
                    direct,
                } => {
                    if let Some(&(request_id, session, worker)) =
                        applied.iter().rev().nth(*back % applied.len().max(1))
                    {
                        state.observe(&Observation::Completed {
                            request_id,
                            session,
                            worker,
                            outcome: Outcome::Ok,
                            resident_tokens: if *resident { 700 } else { 0 },
                            direct: *direct,
                        });
                    }
                }
                Op::Reject { session, worker } => {
                    state.observe(&Observation::AdmissionRejected {
                        session: SessionId(*session),
                        worker: WorkerId(*worker),
                    });
                }
                Op::Evict { session, worker } => {
                    state.observe(&Observation::Evicted {
                        session: SessionId(*session),
                        worker: WorkerId(*worker),
                    });
                }
                Op::Forget { session } => state.forget_session(SessionId(*session)),
                Op::FirstToken { back } => {
                    if let Some(&(request_id, _, _)) =
                        applied.iter().rev().nth(*back % applied.len().max(1))
                    {
                        state.observe(&Observation::PrefillDone { request_id });
                    }
                }
            }
            check(state, now)?;
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        /// The incremental active-session counts equal a count from scratch over every session,
        /// for decision times before, at and after the latest applied one, with and without an
        /// excluded session, and for another window (answered by the scan).
        #[test]
        fn active_sessions_match_a_recount(ops in prop::collection::vec(op(), 1..80)) {
            let mut state = RouterState::new(&kvc_config(), &workers());
            run(&mut state, &ops, |state, now| {
                for dt in [-2_500i64, -2_001, -2_000, -1_500, -1_000, -200, -1, 0, 1, 250, 999, 1_000, 1_001, 4_000] {
                    let at = now.saturating_add_signed(dt);
                    for window in [WINDOW, 300] {
                        for exclude in [None, Some(SessionId(3)), Some(SessionId(40))] {
                            let mut fast = [0u32; MAX_WORKERS];
                            state.active_sessions(at, window, exclude, &mut fast);
                            let mut slow = [0u32; MAX_WORKERS];
                            for (id, r) in state.sessions() {
                                if Some(id) != exclude
                                    && r.residency == Residency::Resident
                                    && at.saturating_sub(r.last_routed_ms) <= window
                                    && let Some(d) = r.current_d
                                {
                                    slow[d.0 as usize] += 1;
                                }
                            }
                            prop_assert_eq!(&fast[..8], &slow[..8], "at {} window {}", at, window);
                        }
                    }
                }
                Ok(())
            })?;
        }

        /// Pending decisions never exceed their bound, and in-flight counts equal the
        /// decisions still pending on each worker.
        #[test]
        fn pending_decisions_stay_bounded(ops in prop::collection::vec(op(), 1..80), max in 0u32..6) {
            let bounds = StateBounds { max_pending: max, ..StateBounds::default() };
            let mut state = RouterState::with_bounds(&kvc_config(), &workers(), bounds);
            run(&mut state, &ops, |state, _| {
                prop_assert!(state.pending_count() <= max as usize);
                prop_assert!(state.pending_order.len() <= 2 * state.pending.len() + 65);
                for w in 0..5u32 {
                    let n = state
                        .pending
                        .values()
                        .filter(|p| p.decode == WorkerId(w) || p.prefill == Some(WorkerId(w)))
                        .count();
                    prop_assert_eq!(state.in_flight(WorkerId(w)) as usize, n);
                }
                Ok(())
            })?;
        }

        /// Each decode worker's count of P→D requests awaiting their KV, and the wait of the
        /// earliest applied of them, equal a recount over the pending decisions; the queues
        /// behind them stay bounded.
        #[test]
        fn kv_waits_match_a_recount(ops in prop::collection::vec(op(), 1..80), max in 0u32..12) {
            let bounds = StateBounds { max_pending: max, ..StateBounds::default() };
            let mut state = RouterState::with_bounds(&kvc_config(), &workers(), bounds);
            run(&mut state, &ops, |state, now| {
                for w in 0..5u32 {
                    let waiting: Vec<&Pending> = state
                        .pending
                        .values()
                        .filter(|p| p.decode == WorkerId(w) && p.awaiting_kv)
                        .collect();
                    prop_assert_eq!(state.awaiting_kv(WorkerId(w)) as usize, waiting.len());
                    let first = waiting.iter().min_by_key(|p| p.seq);
                    let at = now + 1_000;
                    prop_assert_eq!(
                        state.oldest_kv_wait_ms(WorkerId(w), at),
                        first.map_or(0, |p| at.saturating_sub(p.sent_ms))
                    );
                    let q = state.awaiting_kv.get(w as usize).map_or(0, VecDeque::len);
                    prop_assert!(q <= 2 * waiting.len() + 65, "queue {} for {}", q, waiting.len());
                }
                Ok(())
            })?;
        }
    }

    #[test]
    fn pending_and_worker_entries_are_the_documented_size() {
        // The figures of `docs/kvc-policy.md` ("Memory and cost"): a pending decision's value,
        // an awaiting-KV queue entry, and a worker's counters plus its queue's header.
        assert_eq!(std::mem::size_of::<Pending>(), 40);
        assert_eq!(std::mem::size_of::<(u64, RequestId)>(), 16);
        assert_eq!(
            std::mem::size_of::<WorkerCounters>()
                + std::mem::size_of::<VecDeque<(u64, RequestId)>>(),
            56
        );
    }

    #[test]
    fn a_session_route_is_120_bytes() {
        // The figure `docs/kvc-policy.md` uses for the session table's cost per entry.
        assert_eq!(std::mem::size_of::<SessionRoute>(), 120);
    }

    #[test]
    fn block_bounds_derive_from_the_pool() {
        let b = StateBounds::default();
        let bs = BlockSize::default();
        assert_eq!(b.blocks_for(92_160, bs), 4 * 180);
        assert_eq!(b.blocks_for(92_161, bs), 4 * 181);
        assert_eq!(b.blocks_for(0, bs), 4_096);
        let fixed = StateBounds {
            blocks_per_worker: Some(10),
            ..b
        };
        assert_eq!(fixed.blocks_for(92_160, bs), 10);
        let ws = workers();
        let mut state = RouterState::new(&kvc_config(), &ws);
        assert_eq!(state.worker_block_bound(WorkerId(1)), 16);
        assert_eq!(state.worker_block_bound(WorkerId(9)), 4_096);
        state.set_worker_blocks(WorkerId(9), 1_024);
        assert_eq!(state.worker_block_bound(WorkerId(9)), 8);
    }
}
