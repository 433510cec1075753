//! The replay loop's two seams: where decisions come from ([`Decider`]; [`LocalPolicy`] runs
//! the policy in process) and which clock it runs on ([`Hooks`]; [`Virtual`] for `sim`).

use kvc_core::{ExecutionMode, FallThroughReason, WorkerId};
use kvc_engine_sim::model::{Engine, Micros};
use kvc_policy::{
    Decision, Fleet, Observation, PolicyConfig, RouteRequest, RouterState, StateChange,
    WorkerStates, WorkerView,
};

/// A routing decision as the replay carries it out.
#[derive(Debug, Clone)]
pub struct Routed {
    /// Path.
    pub mode: ExecutionMode,
    /// Decode (or colocated) worker.
    pub decode: WorkerId,
    /// Prefill worker on P→D paths.
    pub prefill: Option<WorkerId>,
    /// Why a later turn did not go direct.
    pub reason: Option<FallThroughReason>,
    /// The router's footprint estimate on D (what admission checks).
    pub need_tokens: u64,
    /// Pause the client should honour before starting.
    pub recommended_pause_ms: u32,
    /// The router's id of the decision (0 when the router has none).
    pub decision_id: u64,
    /// The state change to apply when carried out (local policies only).
    pub change: Option<StateChange>,
}

impl From<Decision> for Routed {
    fn from(d: Decision) -> Self {
        Routed {
            mode: d.mode,
            decode: d.decode,
            prefill: d.prefill,
            reason: d.reason,
            need_tokens: d.need_tokens,
            recommended_pause_ms: d.recommended_pause_ms,
            decision_id: 0,
            change: Some(d.change),
        }
    }
}

/// Where routing decisions come from: the policy in process ([`LocalPolicy`]) or a router
/// service (the live replay).
pub trait Decider {
    /// Routes one request at `now_ms` on `fleet`, whose workers' published states `states`
    /// gives; `None` when no worker can take it.
    fn route(
        &mut self,
        fleet: &Fleet,
        states: &dyn WorkerStates,
        now_ms: u64,
        req: &RouteRequest<'_>,
    ) -> Option<Routed>;
    /// The data plane carried `routed` out (admission passed, work started).
    fn carried_out(&mut self, routed: &Routed);
    /// Feedback from the data plane; `routed` is the decision it concerns, when there is one.
    fn observe(&mut self, event: &Observation, routed: Option<&Routed>);
    /// The client ended `session` (its last request is answered): its routing state goes.
    /// A decider without such a call leaves the session to its own expiry.
    fn end_session(&mut self, session: kvc_core::SessionId) {
        let _ = session;
    }
}

/// The policy of a [`super::SimConfig`], run in process with its own [`RouterState`].
#[derive(Debug)]
pub struct LocalPolicy {
    config: PolicyConfig,
    state: RouterState,
}

impl LocalPolicy {
    /// A fresh router state for `config` over `workers`.
    pub fn new(config: PolicyConfig, workers: &[WorkerView]) -> Self {
        let state = RouterState::new(&config, workers);
        LocalPolicy { config, state }
    }
}

impl Decider for LocalPolicy {
    fn route(
        &mut self,
        fleet: &Fleet,
        states: &dyn WorkerStates,
        now_ms: u64,
        req: &RouteRequest<'_>,
    ) -> Option<Routed> {
        kvc_policy::route_in(&self.config, &self.state, fleet, states, now_ms, req)
            .ok()
            .map(Routed::from)
    }

    fn carried_out(&mut self, routed: &Routed) {
        if let Some(change) = &routed.change {
            self.state.apply(change);
        }
    }

    fn observe(&mut self, event: &Observation, _routed: Option<&Routed>) {
        self.state.observe(event);
    }

    fn end_session(&mut self, session: kvc_core::SessionId) {
        self.state.forget_session(session);
    }
}

/// Hooks of a run on another clock (the live replay): pacing and publishing worker state.
pub trait Hooks {
    /// Called before an event at simulated time `t` is handled (a real-clock run sleeps here).
    fn before(&mut self, t: Micros);
    /// Called after events are handled at time `t`, with the engine (a live run publishes its
    /// state and answers queued worker commands here).
    fn after(&mut self, t: Micros, engine: &mut Engine);
    /// A period of simulated time at which [`Hooks::after`] should run even without events.
    fn tick_every(&self) -> Option<Micros>;
}

/// No hooks: the virtual clock of `simulate`.
#[derive(Debug, Default)]
pub struct Virtual;

impl Hooks for Virtual {
    fn before(&mut self, _t: Micros) {}
    fn after(&mut self, _t: Micros, _engine: &mut Engine) {}
    fn tick_every(&self) -> Option<Micros> {
        None
    }
}
