//! The discrete-event simulator: replays a trace through a modelled P/D or colocated cluster
//! with a routing policy from `kvc-policy`, on a virtual clock.
//!
//! Replay semantics (docs in `simulator.md`): a session's turns run in order; turn k+1 is ready
//! at `max(timestamp / time_scale, completion of turn k)`; at most `concurrency` requests are in
//! flight and the rest wait in ready order. TTFT and latency are measured from the ready time.
//!
//! Determinism: events are ordered by (time in µs, sequence number); no wall clock and no
//! unordered iteration feed the logic, so the same trace, config and seed give byte-identical
//! records.

mod cache;
pub mod engine;
pub mod metrics;
pub mod profile;

use crate::trace::{Trace, TraceRequest};
use engine::{DirectAdmission, Engine, EngineOptions, Event, Job, Micros, Wake, micros};
use kvc_core::{ExecutionMode, Outcome, StableName, Topology, WorkerId, WorkerRole};
use kvc_policy::{
    ClusterView, Decision, Observation, PolicyConfig, RouteRequest, RouterState, WorkerView,
};
use metrics::{RequestRecord, RunConfig, Summary};
pub use profile::Profile;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

pub use kvc_core::EvictionMode;

/// Everything a run depends on besides the trace.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Cluster shape.
    pub topology: Topology,
    /// Routing policy (with its prefill selection).
    pub policy: PolicyConfig,
    /// Trace time is divided by this (10 replays ten times faster).
    pub time_scale: f64,
    /// Most requests in flight.
    pub concurrency: usize,
    /// Seed of the iteration-time jitter.
    pub seed: u64,
    /// Honour the recommended pause of routing decisions before starting a request.
    pub backpressure: bool,
    /// Decode-side eviction.
    pub eviction: EvictionMode,
    /// Engine profile.
    pub profile: Profile,
    /// Relative jitter of iteration times (deterministic from `seed`).
    pub jitter: f64,
}

impl SimConfig {
    /// The reference setup: `1p3d`, time-scale 1, concurrency 32, seed 0, the default profile.
    pub fn new(topology: Topology, policy: PolicyConfig) -> Self {
        SimConfig {
            topology,
            policy,
            time_scale: 1.0,
            concurrency: 32,
            seed: 0,
            backpressure: true,
            eviction: EvictionMode::IdleLru,
            profile: Profile::default(),
            jitter: 0.02,
        }
    }
}

/// A configuration the simulator cannot run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A bad setting.
    #[error("invalid simulation setting: {0}")]
    Invalid(String),
    /// The modelled cluster stopped making progress with requests unfinished (a request that
    /// can never fit, for instance). This is a simulator bug or an impossible profile.
    #[error(
        "simulation stalled with {unfinished} request(s) unfinished (first: trace index {first})"
    )]
    Stalled {
        /// Requests that never finished.
        unfinished: usize,
        /// Trace index of the first of them.
        first: usize,
    },
}

/// Pool occupancy samples: (time in s, used fraction of every worker's pool by worker index).
pub type Occupancy = Vec<(f64, Vec<f64>)>;

/// Records and summary of one run.
#[derive(Debug, Clone)]
pub struct SimOutput {
    /// One record per trace request, in trace order.
    pub records: Vec<RequestRecord>,
    /// The summary.
    pub summary: Summary,
    /// Decode (or colocated) worker names, by worker index (`None` for prefill workers).
    pub worker_names: Vec<String>,
    /// Pool occupancy samples, every 10 s of simulated time.
    pub occupancy: Occupancy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A session's turn becomes ready (trace index).
    Ready(usize),
    /// A paused request starts.
    Start(usize),
    /// The engine asked to be woken.
    Engine(Wake),
    /// Sample pool occupancy.
    Sample,
    /// Periodic hook tick.
    Tick,
}

#[derive(Debug, Clone, Default)]
struct ReqState {
    ready: Micros,
    dispatch: Micros,
    started: Micros,
    first: Option<Micros>,
    decision: Option<Routed>,
    cached: u64,
}

const SAMPLE_EVERY: Micros = 10_000_000;

/// Roles of the workers of a topology, in worker-id order (prefill first).
pub fn worker_roles(t: Topology) -> Vec<WorkerRole> {
    match t {
        Topology::Disaggregated { prefill, decode } => {
            let mut v = vec![WorkerRole::Prefill; prefill as usize];
            v.extend(std::iter::repeat_n(WorkerRole::Decode, decode as usize));
            v
        }
        Topology::Colocated { workers } => vec![WorkerRole::Colocated; workers as usize],
    }
}

/// Names of workers: `p0, p1, …, d0, d1, …` or `dp0, dp1, …`.
pub fn worker_names(roles: &[WorkerRole]) -> Vec<String> {
    let (mut p, mut d, mut c) = (0, 0, 0);
    roles
        .iter()
        .map(|r| match r {
            WorkerRole::Prefill => {
                p += 1;
                format!("p{}", p - 1)
            }
            WorkerRole::Decode => {
                d += 1;
                format!("d{}", d - 1)
            }
            WorkerRole::Colocated => {
                c += 1;
                format!("dp{}", c - 1)
            }
        })
        .collect()
}

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
    pub reason: Option<kvc_core::FallThroughReason>,
    /// The router's footprint estimate on D (what admission checks).
    pub need_tokens: u64,
    /// Pause the client should honour before starting.
    pub recommended_pause_ms: u32,
    /// The router's id of the decision (0 when the router has none).
    pub decision_id: u64,
    /// The state change to apply when carried out (local policies only).
    pub change: Option<kvc_policy::StateChange>,
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
    /// Routes one request; `None` when no worker can take it.
    fn route(&mut self, cluster: &ClusterView<'_>, req: &RouteRequest<'_>) -> Option<Routed>;
    /// The data plane carried `routed` out (admission passed, work started).
    fn carried_out(&mut self, routed: &Routed);
    /// Feedback from the data plane; `routed` is the decision it concerns, when there is one.
    fn observe(&mut self, event: &Observation, routed: Option<&Routed>);
}

/// The policy of a [`SimConfig`], run in process with its own [`RouterState`].
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
    fn route(&mut self, cluster: &ClusterView<'_>, req: &RouteRequest<'_>) -> Option<Routed> {
        kvc_policy::route(&self.config, &self.state, cluster, req)
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

struct Sim<'a> {
    cfg: &'a SimConfig,
    trace: &'a Trace,
    engine: Engine,
    roles: Vec<WorkerRole>,
    names: Vec<String>,
    decider: &'a mut dyn Decider,
    queue: BinaryHeap<Reverse<(Micros, u64, Ev)>>,
    seq: u64,
    now: Micros,
    /// Ready requests waiting for a slot, by (ready time, index).
    waiting: BTreeSet<(Micros, usize)>,
    in_flight: usize,
    /// Per trace index: index of the session's next turn.
    next_turn: Vec<Option<usize>>,
    reqs: Vec<ReqState>,
    records: Vec<Option<RequestRecord>>,
    occupancy: Occupancy,
    completed: usize,
}

/// The initial view of a cluster: every worker empty and healthy.
pub fn initial_views(cfg: &SimConfig) -> Vec<WorkerView> {
    worker_roles(cfg.topology)
        .iter()
        .enumerate()
        .map(|(i, r)| WorkerView {
            id: WorkerId(i as u32),
            role: *r,
            state: kvc_core::WorkerState::empty(cfg.profile.hardware.kv_pool_tokens),
        })
        .collect()
}

/// Runs the simulation with the config's policy in process, on the virtual clock.
/// `progress` is called with (completed, total) as requests finish.
pub fn simulate(
    trace: &Trace,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SimOutput, SimError> {
    let mut policy = LocalPolicy::new(cfg.policy.clone(), &initial_views(cfg));
    run(trace, cfg, &mut policy, &mut Virtual, progress)
}

/// Runs the replay with decisions from `decider` and the clock hooks `hooks`.
pub fn run(
    trace: &Trace,
    cfg: &SimConfig,
    decider: &mut dyn Decider,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SimOutput, SimError> {
    if !(cfg.time_scale.is_finite() && cfg.time_scale > 0.0) {
        return Err(SimError::Invalid(format!(
            "time scale must be a positive number (got {})",
            cfg.time_scale
        )));
    }
    if cfg.concurrency == 0 {
        return Err(SimError::Invalid("concurrency must be at least 1".into()));
    }
    if cfg.policy.block_size() != trace.block_size() {
        return Err(SimError::Invalid(format!(
            "the trace has {}-token blocks but the policy counts {}-token blocks \
             (set the policy knob block-size)",
            trace.block_size().tokens(),
            cfg.policy.block_size().tokens()
        )));
    }
    let wall = std::time::Instant::now();
    let roles = worker_roles(cfg.topology);
    let names = worker_names(&roles);
    let engine = Engine::new(
        cfg.profile.clone(),
        EngineOptions {
            eviction: cfg.eviction.into(),
            block_size: trace.block_size(),
        },
        &roles,
        cfg.seed,
        cfg.jitter,
    );
    let n = trace.requests.len();
    // Link each request to its session's next turn (trace order is timestamp order; turns of
    // a session are sorted by turn number).
    let mut next_turn = vec![None; n];
    let mut by_session: std::collections::BTreeMap<kvc_core::SessionId, Vec<usize>> =
        std::collections::BTreeMap::new();
    for (i, r) in trace.requests.iter().enumerate() {
        by_session.entry(r.session).or_default().push(i);
    }
    let mut firsts = Vec::with_capacity(by_session.len());
    for idxs in by_session.values_mut() {
        idxs.sort_by_key(|&i| (trace.requests[i].turn, i));
        for w in idxs.windows(2) {
            next_turn[w[0]] = Some(w[1]);
        }
        firsts.push(idxs[0]);
    }
    let mut sim = Sim {
        cfg,
        trace,
        engine,
        decider,
        roles,
        names,
        queue: BinaryHeap::new(),
        seq: 0,
        now: 0,
        waiting: BTreeSet::new(),
        in_flight: 0,
        next_turn,
        reqs: vec![ReqState::default(); n],
        records: vec![None; n],
        occupancy: Vec::new(),
        completed: 0,
    };
    for i in firsts {
        let t = sim.scaled(&trace.requests[i]);
        sim.push(t, Ev::Ready(i));
    }
    if n > 0 {
        sim.push(0, Ev::Sample);
        if hooks.tick_every().is_some() {
            sim.push(0, Ev::Tick);
        }
    }
    let mut reported = 0;
    while let Some(Reverse((t, _, ev))) = sim.queue.pop() {
        hooks.before(t);
        sim.now = t;
        match ev {
            Ev::Ready(i) => {
                sim.reqs[i].ready = t;
                sim.waiting.insert((t, i));
                sim.dispatch_waiting();
            }
            Ev::Start(i) => sim.start(i),
            Ev::Engine(k) => {
                sim.engine.wake(k, t);
                sim.drain_engine();
            }
            Ev::Sample => {
                // Sample while anything else is pending; an empty queue means the run is over.
                if sim.completed < n && !sim.queue.is_empty() {
                    sim.occupancy.push((t as f64 / 1e6, sim.engine.occupancy()));
                    sim.push(t + SAMPLE_EVERY, Ev::Sample);
                }
            }
            Ev::Tick => {
                if let Some(every) = hooks.tick_every()
                    && sim.completed < n
                {
                    sim.push(t + every.max(1), Ev::Tick);
                }
            }
        }
        hooks.after(t, &mut sim.engine);
        sim.drain_engine();
        if sim.completed >= reported + 64 {
            reported = sim.completed;
            progress(sim.completed, n);
        }
    }
    progress(sim.completed, n);
    if let Some(stuck) = sim.records.iter().position(Option::is_none) {
        return Err(SimError::Stalled {
            unfinished: sim.records.iter().filter(|r| r.is_none()).count(),
            first: stuck,
        });
    }
    let records: Vec<RequestRecord> = sim.records.into_iter().flatten().collect();
    let decode_names: Vec<String> = sim
        .roles
        .iter()
        .zip(&sim.names)
        .filter(|(r, _)| **r != WorkerRole::Prefill)
        .map(|(_, n)| n.clone())
        .collect();
    let config = run_config(cfg);
    let summary = Summary::build(
        &records,
        &decode_names,
        config,
        wall.elapsed().as_secs_f64(),
    );
    Ok(SimOutput {
        records,
        summary,
        worker_names: sim.names,
        occupancy: sim.occupancy,
    })
}

/// The `config` block of a run's summary.
pub fn run_config(cfg: &SimConfig) -> RunConfig {
    RunConfig {
        topology: cfg.topology.to_string(),
        policy: cfg.policy.name().to_owned(),
        prefill_policy: cfg
            .policy
            .prefill_policy()
            .filter(|_| matches!(cfg.topology, Topology::Disaggregated { .. }))
            .map(|p| p.as_str().to_owned()),
        time_scale: cfg.time_scale,
        concurrency: cfg.concurrency,
        seed: cfg.seed,
        backpressure: cfg.backpressure,
        eviction: cfg.eviction.as_str().to_owned(),
        profile: cfg.profile.name.clone(),
        policy_config: serde_json::to_value(&cfg.policy).unwrap_or(serde_json::Value::Null),
    }
}

impl Sim<'_> {
    fn scaled(&self, r: &TraceRequest) -> Micros {
        micros(r.timestamp_ms as f64 / 1e3 / self.cfg.time_scale)
    }

    fn push(&mut self, t: Micros, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, ev)));
    }

    fn dispatch_waiting(&mut self) {
        while self.in_flight < self.cfg.concurrency {
            let Some((_, i)) = self.waiting.pop_first() else {
                break;
            };
            self.in_flight += 1;
            self.reqs[i].dispatch = self.now;
            self.route_and_start(i);
        }
    }

    fn cluster_views(&self) -> Vec<WorkerView> {
        self.roles
            .iter()
            .enumerate()
            .map(|(i, r)| WorkerView {
                id: WorkerId(i as u32),
                role: *r,
                state: self.engine.state(WorkerId(i as u32)),
            })
            .collect()
    }

    fn route(&mut self, i: usize, rejected_by: Option<WorkerId>) -> Option<Routed> {
        let r = &self.trace.requests[i];
        let views = self.cluster_views();
        let cluster = ClusterView {
            now_ms: self.now / 1000,
            workers: &views,
        };
        let req = RouteRequest {
            request_id: kvc_core::RequestId(i as u64),
            session: Some(r.session),
            turn: Some(r.turn),
            input_length: r.input_length,
            output_hint: r.output_length,
            hash_ids: &r.hash_ids,
            rejected_by,
        };
        self.decider.route(&cluster, &req)
    }

    fn route_and_start(&mut self, i: usize) {
        let r = &self.trace.requests[i];
        if r.input_length > self.cfg.profile.model.max_input_tokens {
            self.finish(i, Outcome::InputTooLong);
            return;
        }
        let Some(decision) = self.route(i, None) else {
            self.finish(i, Outcome::Rejected);
            return;
        };
        let pause = if self.cfg.backpressure {
            Micros::from(decision.recommended_pause_ms) * 1000
        } else {
            0
        };
        self.reqs[i].decision = Some(decision);
        if pause > 0 {
            self.push(self.now + pause, Ev::Start(i));
        } else {
            self.start(i);
        }
    }

    fn job(&self, i: usize) -> Job {
        let r = &self.trace.requests[i];
        Job {
            id: i,
            session: r.session,
            input: r.input_length,
            output: r.output_length.max(1),
            hashes: r.hash_ids.clone(),
        }
    }

    fn start(&mut self, i: usize) {
        self.reqs[i].started = self.now;
        let mut decision = self.reqs[i].decision.take().expect("decision");
        if decision.mode == ExecutionMode::DirectToD {
            let job = self.job(i);
            let session = job.session;
            match self
                .engine
                .try_direct(job, decision.decode, decision.need_tokens, self.now)
            {
                DirectAdmission::Admitted { cached } => {
                    self.decider.carried_out(&decision);
                    self.reqs[i].cached = cached;
                    self.reqs[i].decision = Some(decision);
                    self.drain_engine();
                    return;
                }
                DirectAdmission::NotResident | DirectAdmission::Rejected => {
                    self.decider.observe(
                        &Observation::AdmissionRejected {
                            session,
                            worker: decision.decode,
                        },
                        Some(&decision),
                    );
                    match self.route(i, Some(decision.decode)) {
                        Some(d) => decision = d,
                        None => {
                            self.finish(i, Outcome::Rejected);
                            return;
                        }
                    }
                }
            }
        }
        self.decider.carried_out(&decision);
        let job = self.job(i);
        let session = job.session;
        match (decision.mode, decision.prefill) {
            (ExecutionMode::Colocated, _) => {
                self.engine.start_colocated(job, decision.decode, self.now);
            }
            (_, Some(p)) => {
                // The session's KV elsewhere is released: it is being re-seeded on `decode`.
                for (w, role) in self.roles.iter().enumerate() {
                    let w = WorkerId(w as u32);
                    if *role == WorkerRole::Decode && w != decision.decode {
                        self.engine.release_session(w, session, self.now);
                    }
                }
                self.engine.start_p_to_d(job, p, decision.decode, self.now);
            }
            (mode, None) => {
                debug_assert!(false, "mode {mode} without a prefill worker");
                self.finish(i, Outcome::Rejected);
                return;
            }
        }
        self.reqs[i].decision = Some(decision);
        self.drain_engine();
    }

    fn drain_engine(&mut self) {
        for (t, w) in self.engine.take_wakes() {
            self.push(t, Ev::Engine(w));
        }
        for ev in self.engine.take_events() {
            match ev {
                Event::FirstToken { id, at } => self.reqs[id].first = Some(at),
                Event::Done {
                    id,
                    at,
                    resident_tokens,
                    cached,
                } => {
                    debug_assert_eq!(at, self.now);
                    self.reqs[id].cached = cached;
                    self.observe_done(id, Outcome::Ok, resident_tokens);
                    self.finish(id, Outcome::Ok);
                }
                Event::TransferTimedOut { id, .. } => {
                    self.observe_done(id, Outcome::KvTransferTimeout, 0);
                    self.finish(id, Outcome::KvTransferTimeout);
                }
                Event::Evicted { session, worker } => {
                    self.decider
                        .observe(&Observation::Evicted { session, worker }, None);
                }
            }
        }
    }

    fn observe_done(&mut self, i: usize, outcome: Outcome, resident_tokens: u64) {
        let Some(d) = &self.reqs[i].decision else {
            return;
        };
        let ev = Observation::Completed {
            request_id: kvc_core::RequestId(i as u64),
            session: Some(self.trace.requests[i].session),
            worker: d.decode,
            outcome,
            resident_tokens,
            direct: d.mode == ExecutionMode::DirectToD,
        };
        let d = d.clone();
        self.decider.observe(&ev, Some(&d));
    }

    fn finish(&mut self, i: usize, outcome: Outcome) {
        let r = &self.trace.requests[i];
        let st = &self.reqs[i];
        let secs = |t: Micros| t as f64 / 1e6;
        let (mode, reason, prefill, decode, cached) = match &st.decision {
            Some(d) => (
                Some(d.mode),
                d.reason,
                d.prefill.map(|p| self.names[p.0 as usize].clone()),
                Some(self.names[d.decode.0 as usize].clone()),
                st.cached,
            ),
            None => (None, None, None, None, 0),
        };
        let first = st.first.filter(|_| outcome == Outcome::Ok);
        let reason = reason.filter(|_| mode != Some(ExecutionMode::DirectToD));
        self.records[i] = Some(RequestRecord {
            index: i,
            session: r.session,
            turn: r.turn,
            scheduled_s: secs(st.ready),
            dispatch_s: secs(st.dispatch),
            first_token_s: first.map(secs),
            done_s: secs(self.now),
            ttft_s: first.map(|f| secs(f - st.ready)),
            latency_s: secs(self.now - st.ready),
            wait_s: secs(st.started.max(st.dispatch) - st.ready),
            mode,
            reason,
            prefill,
            decode,
            input_tokens: r.input_length,
            cached_tokens: cached,
            uncached_tokens: if mode.is_some() {
                r.input_length.saturating_sub(cached)
            } else {
                0
            },
            output_tokens: r.output_length,
            outcome,
        });
        self.in_flight -= 1;
        self.completed += 1;
        if let Some(next) = self.next_turn[i] {
            let t = self.scaled(&self.trace.requests[next]).max(self.now);
            self.push(t, Ev::Ready(next));
        }
        self.dispatch_waiting();
    }
}
