//! The entry point, and what every policy shares: the decision context and the decision builder.

use crate::backpressure::{BackpressureConfig, recommended_pause_ms};
use crate::config::PolicyConfig;
use crate::decision::{Decision, ScoreEntry, StateChange};
use crate::error::PolicyError;
use crate::fallthrough::{TurnClass, classify_with, is_first_turn};
use crate::fleet::{Fleet, WorkerStates};
use crate::footprint::footprint_tokens;
use crate::index::{BlockView, Depths};
use crate::state::{RouterState, SessionRoute};
use crate::view::{ClusterView, RouteRequest};
use crate::worker_set::WorkerSet;
use crate::{cache_aware, kv_aware_v0, kvc, kvc_v2, round_robin};
use kvc_core::{BlockSize, ExecutionMode, FallThroughReason, WorkerId, WorkerRole, WorkerState};

/// Decides where `req` goes.
///
/// Pure: reads `state` and `cluster`, writes nothing; the same inputs give the same
/// decision (the order of `cluster.workers` does not matter). To carry the decision out, pass
/// `decision.change` to [`RouterState::apply`].
///
/// The topology comes from the roles in `cluster`: all colocated gives mode `colocated` and no
/// prefill worker; otherwise P/D, where each policy chooses between `direct-to-d` and a P→D path
/// (`turn1-seed`, `fallback` with a reason, `reseed`), and `kvc` also between those and a turn
/// served alone (`local-prefill`) by a worker declared able to ([`kvc_core::Capabilities`]).
/// Unhealthy workers and workers without the capability a path needs are never chosen: P→D
/// goes from a `prefill` worker to another, `decode`, worker; sessions live on workers that
/// host them.
///
/// Errors: an invalid `config` ([`PolicyError::InvalidConfig`]); a view that is not a topology
/// ([`PolicyError::WrongTopology`], [`PolicyError::WorkerIdOutOfRange`],
/// [`PolicyError::DuplicateWorker`]); no healthy worker of a role the path needs
/// ([`PolicyError::NoHealthyWorker`]).
pub fn route(
    config: &PolicyConfig,
    state: &RouterState,
    cluster: &ClusterView<'_>,
    req: &RouteRequest<'_>,
) -> Result<Decision, PolicyError> {
    config.validate()?;
    let fleet = Fleet::new(cluster.workers)?;
    route_in(config, state, &fleet, &fleet, cluster.now_ms, req)
}

/// [`route`] on a prepared [`Fleet`], reading the published state of only the workers the
/// decision weighs from `states` (the fleet itself, or the caller's live source): a decision
/// costs what its candidates cost, not what the fleet is. `now_ms` is the caller's clock.
///
/// The same decision as [`route`] on a cluster view of the fleet's workers with the states
/// `states` gives and the health the fleet holds. Errors: as [`route`] (the fleet's topology
/// was checked when it was made).
pub fn route_in(
    config: &PolicyConfig,
    state: &RouterState,
    fleet: &Fleet,
    states: &dyn WorkerStates,
    now_ms: u64,
    req: &RouteRequest<'_>,
) -> Result<Decision, PolicyError> {
    config.validate()?;
    let ctx = Ctx::new(state, fleet, states, now_ms, req);
    match config {
        PolicyConfig::RoundRobin(c) => round_robin::route(c, &ctx),
        PolicyConfig::CacheAware(c) => cache_aware::route(c, &ctx),
        PolicyConfig::KvAwareV0(c) => kv_aware_v0::route(c, &ctx),
        PolicyConfig::KvcV2(c) => kvc_v2::route(c, &ctx),
        PolicyConfig::Kvc(c) => kvc::route(c, &ctx),
    }
}

/// Everything a policy reads for one decision, with per-decision lookups prepared.
pub(crate) struct Ctx<'a> {
    pub(crate) state: &'a RouterState,
    pub(crate) req: &'a RouteRequest<'a>,
    now_ms: u64,
    fleet: &'a Fleet,
    states: &'a dyn WorkerStates,
    /// All colocated workers.
    pub(crate) colocated: bool,
    /// Healthy workers that decode transferred KV (or healthy colocated workers): the targets
    /// of P→D paths.
    pub(crate) healthy_d: &'a WorkerSet,
    /// Healthy workers that prefill for others.
    pub(crate) healthy_p: &'a WorkerSet,
    /// Healthy workers of a P/D cluster that serve turns alone and take direct turns.
    pub(crate) healthy_local: WorkerSet,
    /// Workers that send their sessions' KV, healthy or draining: they may send a session
    /// they hold to another worker with its KV (`migrate-kv`).
    pub(crate) kv_senders: &'a WorkerSet,
}

impl<'a> Ctx<'a> {
    fn new(
        state: &'a RouterState,
        fleet: &'a Fleet,
        states: &'a dyn WorkerStates,
        now_ms: u64,
        req: &'a RouteRequest<'a>,
    ) -> Self {
        Ctx {
            state,
            req,
            now_ms,
            fleet,
            states,
            colocated: fleet.is_colocated(),
            healthy_d: fleet.healthy_d(),
            healthy_p: fleet.healthy_p(),
            healthy_local: fleet.healthy_local().and_not(state.no_direct()),
            kv_senders: fleet.kv_senders(),
        }
    }

    /// Healthy workers that host sessions: those that decode transferred KV and those that
    /// serve turns alone.
    pub(crate) fn hosts(&self) -> WorkerSet {
        self.healthy_d.or(&self.healthy_local)
    }

    /// The role of the worker that decodes: `decode`, or `colocated`.
    pub(crate) fn d_role(&self) -> WorkerRole {
        if self.colocated {
            WorkerRole::Colocated
        } else {
            WorkerRole::Decode
        }
    }

    /// Fails when no decode (or colocated) worker is healthy.
    pub(crate) fn require_d(&self) -> Result<(), PolicyError> {
        if self.healthy_d.is_empty() {
            Err(PolicyError::NoHealthyWorker {
                role: self.d_role(),
            })
        } else {
            Ok(())
        }
    }

    /// The published state of a worker present in the view.
    pub(crate) fn worker_state(&self, id: WorkerId) -> WorkerState {
        debug_assert!(
            self.fleet.worker(id).is_some(),
            "worker {id:?} not in the fleet"
        );
        self.states.state(id)
    }

    /// In-flight requests on a worker: the larger of the published count and the router's own
    /// count of requests it dispatched there that have not completed.
    pub(crate) fn load(&self, id: WorkerId) -> u32 {
        self.worker_state(id)
            .in_flight
            .max(self.state.in_flight(id))
    }

    /// The request's session state, if any.
    /// The caller's clock at this decision.
    pub(crate) fn now_ms(&self) -> u64 {
        self.now_ms
    }

    pub(crate) fn session(&self) -> Option<&'a SessionRoute> {
        self.req.session.and_then(|s| self.state.session(s))
    }

    /// Whether the request is routed as a first turn.
    pub(crate) fn first_turn(&self) -> bool {
        is_first_turn(self.req, self.session())
    }

    /// Leading request blocks each worker of `set` holds in `view`.
    pub(crate) fn depths(&self, set: &WorkerSet, view: BlockView) -> Depths {
        self.state
            .index()
            .depths(self.req.hash_ids, set.clone(), view)
    }

    /// One past the largest worker id in the view: the length of per-worker scratch tables.
    pub(crate) fn width(&self) -> usize {
        self.fleet.width()
    }

    /// Tokens of the request covered by `depth` leading blocks.
    pub(crate) fn reusable(&self, depth: u32, block_size: BlockSize) -> u64 {
        kvc_core::prefix::reusable_tokens(depth as usize, self.req.input_length, block_size)
    }

    /// Tokens of the request `worker` holds in `view`: its leading blocks, as tokens.
    pub(crate) fn cached_on(
        &self,
        worker: WorkerId,
        view: BlockView,
        block_size: BlockSize,
    ) -> u64 {
        let depth = self
            .state
            .index()
            .depth(self.req.hash_ids, worker.0 as usize, view);
        self.reusable(depth, block_size)
    }

    /// An empty score list (each policy reserves room for the candidates it scores: a direct
    /// turn scores one worker, not the fleet).
    pub(crate) fn score_list(&self) -> Vec<ScoreEntry> {
        Vec::new()
    }

    /// Classifies a later turn in a P/D topology (see [`crate::classify_turn`]); with
    /// `compaction`, a compacted turn over the direct limit falls through as `compacted`.
    pub(crate) fn classify(
        &self,
        direct_limit_tokens: u64,
        block_size: BlockSize,
        compaction: bool,
    ) -> TurnClass {
        classify_with(
            self.req,
            self.session(),
            direct_limit_tokens,
            block_size,
            |d| self.healthy_d.contains(d.0 as usize) || self.healthy_local.contains(d.0 as usize),
            |d| self.state.accepts_direct(d),
            compaction,
        )
    }

    /// Mode and reason of a P→D path for a policy with no session notion.
    pub(crate) fn sessionless_path(&self) -> (ExecutionMode, Option<FallThroughReason>) {
        if self.first_turn() {
            (ExecutionMode::Turn1Seed, None)
        } else if self.req.rejected_by.is_some() {
            (
                ExecutionMode::Fallback,
                Some(FallThroughReason::SessionCapRejected),
            )
        } else {
            (
                ExecutionMode::Fallback,
                Some(FallThroughReason::SessionNotResident),
            )
        }
    }

    /// Tokens of the input a plan's worker needs no new room for: what it holds of the
    /// input, and, for a turn that extends the session's own resident KV in place (direct-to-D,
    /// or a local turn on the session's D), all of that KV as last reported. The part past the
    /// reused prefix is the session's own and the append replaces it (the engine frees those
    /// blocks as it writes the new ones), so it is room for the append, not a cost beside it.
    /// Without this, a session near the pool's size whose D holds nothing else was refused an
    /// append that fits, and its only path left, P→D, needed the whole context on both
    /// workers and timed out (`docs/kvc-policy.md`, "Footprint").
    fn held_for(&self, plan: &Plan) -> u64 {
        if plan.cached_on_d == 0 {
            return 0;
        }
        let own = self
            .session()
            .filter(|s| {
                s.current_d == Some(plan.decode) && s.residency == crate::state::Residency::Resident
            })
            .map_or(0, |s| s.resident_tokens);
        plan.cached_on_d.max(own)
    }

    /// Builds the decision and its state change from a plan.
    pub(crate) fn finish(&self, plan: Plan, knobs: Knobs) -> Decision {
        let req = self.req;
        let held = self.held_for(&plan);
        // A first turn placed direct-to-D (a subagent on its parent's D) needs room for
        // what that D does not hold only, as a later turn does.
        let need_tokens = footprint_tokens(
            req.input_length,
            req.output_hint,
            held,
            self.first_turn() && plan.mode != ExecutionMode::DirectToD,
            knobs.incremental_footprint,
        );
        // Output past the pool is never allocated (the engine cuts generation at its context
        // limit), so no request needs more than the pool beside what it already holds there.
        let capacity = self.worker_state(plan.decode).capacity_tokens;
        let need_tokens = if capacity > 0 && knobs.incremental_footprint {
            need_tokens.min(
                capacity
                    .saturating_sub(held)
                    .max(req.input_length.saturating_sub(held)),
            )
        } else {
            need_tokens
        };
        let recommended_pause_ms = recommended_pause_ms(
            &self.worker_state(plan.decode),
            self.state.oldest_kv_wait_ms(plan.decode, self.now_ms),
            &knobs.backpressure,
        );
        Decision {
            mode: plan.mode,
            decode: plan.decode,
            prefill: plan.prefill,
            reason: plan.reason,
            cached_tokens: plan.cached_tokens,
            need_tokens,
            recommended_pause_ms,
            scores: plan.scores,
            change: StateChange {
                request_id: req.request_id,
                session: req.session,
                now_ms: self.now_ms,
                decode: plan.decode,
                decode_role: self.d_role(),
                prefill: plan.prefill,
                direct: plan.mode == ExecutionMode::DirectToD,
                blocks: req.hash_ids.to_vec(),
                reject_count: plan.reject_count,
                prefill_us: plan.prefill_us,
            },
        }
    }
}

/// A policy's choice, before the shared parts of the decision are filled in.
pub(crate) struct Plan {
    pub(crate) mode: ExecutionMode,
    pub(crate) decode: WorkerId,
    pub(crate) prefill: Option<WorkerId>,
    pub(crate) reason: Option<FallThroughReason>,
    /// Reused tokens as reported in the decision.
    pub(crate) cached_tokens: u64,
    /// What the decode (or colocated) worker already holds of the input (0 on P→D paths).
    pub(crate) cached_on_d: u64,
    pub(crate) scores: Vec<ScoreEntry>,
    pub(crate) reject_count: Option<(WorkerId, u32)>,
    /// The policy's prefill estimate (µs) on the worker that prefills; 0 for none.
    pub(crate) prefill_us: u64,
}

impl Plan {
    /// A P→D plan: prefill on `prefill` (holding `cached` tokens of the input), decode on `decode`.
    pub(crate) fn p_to_d(
        (mode, reason): (ExecutionMode, Option<FallThroughReason>),
        decode: WorkerId,
        (prefill, cached): (WorkerId, u64),
        scores: Vec<ScoreEntry>,
        reject_count: Option<(WorkerId, u32)>,
    ) -> Plan {
        Plan {
            mode,
            decode,
            prefill: Some(prefill),
            reason,
            cached_tokens: cached,
            cached_on_d: 0,
            scores,
            reject_count,
            prefill_us: 0,
        }
    }

    /// A turn served alone by `host`, which holds `cached` tokens of the input, `own` of them
    /// the session's own KV (the rest, shared prefixes of other sessions, is computed once
    /// more in the footprint: the prompt is allocated for this session); `reason` is why a
    /// later turn is not direct (`None` for a first turn).
    pub(crate) fn local(
        host: WorkerId,
        reason: Option<FallThroughReason>,
        (cached, own): (u64, u64),
        scores: Vec<ScoreEntry>,
        reject_count: Option<(WorkerId, u32)>,
    ) -> Plan {
        Plan {
            mode: ExecutionMode::LocalPrefill,
            decode: host,
            prefill: None,
            reason,
            cached_tokens: cached,
            cached_on_d: own,
            scores,
            reject_count,
            prefill_us: 0,
        }
    }

    /// A direct-to-D plan on `decode`, which holds `cached` tokens of the input.
    pub(crate) fn direct(
        decode: WorkerId,
        cached: u64,
        scores: Vec<ScoreEntry>,
        reject_count: Option<(WorkerId, u32)>,
    ) -> Plan {
        Plan {
            mode: ExecutionMode::DirectToD,
            decode,
            prefill: None,
            reason: None,
            cached_tokens: cached,
            cached_on_d: cached,
            scores,
            reject_count,
            prefill_us: 0,
        }
    }

    /// The plan of a colocated cluster: worker `w`, which holds `cached` tokens of the input.
    pub(crate) fn colocated(w: WorkerId, cached: u64, scores: Vec<ScoreEntry>) -> Plan {
        Plan {
            mode: ExecutionMode::Colocated,
            decode: w,
            prefill: None,
            reason: None,
            cached_tokens: cached,
            cached_on_d: cached,
            scores,
            reject_count: None,
            prefill_us: 0,
        }
    }

    /// The same plan with a prefill estimate of `seconds` on the worker that prefills.
    pub(crate) fn with_prefill_s(self, seconds: f64) -> Plan {
        Plan {
            prefill_us: (seconds.max(0.0) * 1e6).round() as u64,
            ..self
        }
    }
}

/// Config values every policy has.
#[derive(Clone, Copy)]
pub(crate) struct Knobs {
    pub(crate) incremental_footprint: bool,
    pub(crate) backpressure: BackpressureConfig,
}

impl Knobs {
    pub(crate) fn new(incremental_footprint: bool, backpressure: BackpressureConfig) -> Self {
        Knobs {
            incremental_footprint,
            backpressure,
        }
    }
}
