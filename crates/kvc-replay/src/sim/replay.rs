//! The replay loop: a trace's requests, read as the run goes and paced by the run's clock,
//! routed by a [`Decider`] and carried out by the engine, one record per request.
//!
//! A session's turns run in order; turn k+1 is ready at `max(timestamp / time_scale,
//! completion of turn k)`; at most `concurrency` requests are in flight and the rest wait in
//! ready order. TTFT and latency are measured from the ready time. Events are ordered by
//! (time in µs, sequence number), a session's first turn before any other event of its
//! microsecond (first turns among themselves by session id).
//!
//! Requests come from a [`RequestSource`] in trace order; the loop reads one ahead of the
//! clock, so it holds the requests that have arrived and not finished, never the trace. A
//! finished turn whose session's next turn is not read yet keeps the sequence number that
//! turn's readiness would have had, so the order of events is the one a loop that knew the
//! whole trace would follow. Records go to a [`RunSink`] in trace order as they complete
//! (those that complete early wait for the ones before them), and the summary is built as
//! they go ([`SummaryBuilder`]).

use super::cluster::{host_names, initial_views, layout_names, worker_layout};
use super::decider::{Decider, Hooks, LocalPolicy, Routed, Virtual};
use super::metrics::{DrainSummary, FailureRecord, RequestRecord, Summary, SummaryBuilder};
use super::{Occupancy, SimConfig, SimError, SimOutput, run_config};
use crate::trace::{Arrival, RequestSource, Trace, TraceArrivals, TraceRequest};
use kvc_core::{
    ExecutionMode, Health, Outcome, RequestId, SessionId, StableName, WorkerId, WorkerState,
};
use kvc_engine_sim::model::{
    DirectAdmission, Engine, Event, Failure, Job, LocalAdmission, Micros, Wake, micros,
};
use kvc_policy::{Fleet, Observation, RouteRequest, WorkerStates};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

/// A table keyed by trace index, with a fixed (unseeded) hash: looked up for every event of a
/// request, never iterated (so its order cannot reach an output).
type ByIndex<V> = HashMap<usize, V, foldhash::fast::FixedState>;

/// Something the loop does at a point of simulated time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Scheduled {
    /// A session's turn becomes ready (trace index).
    Ready(usize),
    /// A request paused by backpressure starts (trace index).
    Start(usize),
    /// The engine asked to be woken.
    Engine(Wake),
    /// Sample pool occupancy.
    Sample,
    /// Periodic hook tick.
    Tick,
    /// The operator drains a worker (index into the configuration's drains).
    Drain(usize),
}

/// Order of events within one microsecond: a session's first turn (by session id) before
/// every other event (by sequence number).
const FIRST_TURN: u8 = 0;
const SEQUENCED: u8 = 1;

/// What the loop knows of one trace request while it runs.
#[derive(Debug, Clone, Default)]
struct RequestProgress {
    ready: Micros,
    dispatch: Micros,
    started: Micros,
    first: Option<Micros>,
    decision: Option<Routed>,
    cached: u64,
    retractions: u32,
    failure: Option<Failure>,
}

/// A request read from the source and not finished yet.
#[derive(Debug)]
struct Live {
    request: TraceRequest,
    may_continue: bool,
    progress: RequestProgress,
}

/// Occupancy is sampled this often (simulated µs).
const SAMPLE_EVERY: Micros = 10_000_000;

/// Where a run's results go as it runs: the records in trace order, the pool samples in time
/// order.
pub trait RunSink {
    /// Called once, before anything else, with the names of the workers (by worker index)
    /// whose pools are sampled.
    fn start(&mut self, worker_names: &[String]) -> Result<(), SimError>;
    /// The next record in trace order.
    fn record(&mut self, record: &RequestRecord) -> Result<(), SimError>;
    /// One sample (time in s) of every pool's used and committed fractions, by worker index.
    fn sample(&mut self, time_s: f64, used: &[f64], committed: &[f64]) -> Result<(), SimError>;
}

/// Where a streamed run stands, for a progress display.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Requests finished.
    pub completed: usize,
    /// Requests read from the source.
    pub read: usize,
    /// Requests in the trace, when the source knows.
    pub total: Option<usize>,
    /// Share of the source read, when the source knows.
    pub fraction_read: Option<f64>,
}

/// What a streamed run returns besides what its sink received.
#[derive(Debug, Clone)]
pub struct StreamOutput {
    /// The summary.
    pub summary: Summary,
    /// Worker names, by worker index.
    pub worker_names: Vec<String>,
}

/// The records and samples of a run, kept in memory.
#[derive(Debug, Default)]
struct Collect {
    records: Vec<RequestRecord>,
    occupancy: Occupancy,
    committed: Occupancy,
}

impl RunSink for Collect {
    fn start(&mut self, _worker_names: &[String]) -> Result<(), SimError> {
        Ok(())
    }

    fn record(&mut self, record: &RequestRecord) -> Result<(), SimError> {
        self.records.push(record.clone());
        Ok(())
    }

    fn sample(&mut self, time_s: f64, used: &[f64], committed: &[f64]) -> Result<(), SimError> {
        self.occupancy.push((time_s, used.to_vec()));
        self.committed.push((time_s, committed.to_vec()));
        Ok(())
    }
}

/// The engine's worker states, as the policy reads them.
struct EngineStates<'e>(&'e Engine);

impl WorkerStates for EngineStates<'_> {
    fn state(&self, id: WorkerId) -> WorkerState {
        self.0.state(id)
    }
}

struct Replay<'a> {
    cfg: &'a SimConfig,
    engine: Engine,
    /// The workers as the policy sees them (roles, capabilities, health: all healthy); their
    /// published states are read from `engine` for the workers a decision weighs.
    fleet: Fleet,
    names: Vec<String>,
    decider: &'a mut dyn Decider,
    source: &'a mut dyn RequestSource,
    /// The next request of the source, read ahead; `None` once the source is exhausted.
    peeked: Option<Arrival>,
    queue: BinaryHeap<Reverse<(Micros, u8, u64, Scheduled)>>,
    seq: u64,
    now: Micros,
    /// Ready requests waiting for a slot, by (ready time, index).
    waiting: BTreeSet<(Micros, usize)>,
    in_flight: usize,
    /// Requests read and not finished, by trace index.
    live: ByIndex<Live>,
    /// A turn read before the turn it follows finished: that turn's index → its index.
    awaiting: ByIndex<usize>,
    /// A finished turn whose session's next turn is not read yet: its index → (finish time,
    /// the sequence number the next turn's readiness takes).
    finished: ByIndex<(Micros, u64)>,
    /// Records finished ahead of an earlier one, by trace index.
    early: BTreeMap<usize, RequestRecord>,
    /// Trace index of the next record to hand to the sink.
    next_record: usize,
    sink: &'a mut dyn RunSink,
    summary: SummaryBuilder,
    read: usize,
    completed: usize,
    /// A sink error met where the loop cannot return it; returned after the event.
    failed: Option<SimError>,
    /// What became of the sessions each drained worker held, by drain.
    drains: Vec<DrainSummary>,
    /// The TTFT (latency when none) of the drains' returning sessions' first turns, summed,
    /// by drain: their means when the run ends.
    drain_ttft_s: Vec<f64>,
    /// Sessions a drained worker held whose next turn has not come yet: the drain (index)
    /// and the tokens the session held there.
    drained: HashMap<SessionId, (usize, u64), foldhash::fast::FixedState>,
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

/// Runs the replay of a trace in memory with decisions from `decider` and the clock hooks
/// `hooks`, keeping every record.
pub fn run(
    trace: &Trace,
    cfg: &SimConfig,
    decider: &mut dyn Decider,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SimOutput, SimError> {
    let wall = std::time::Instant::now();
    let n = trace.len();
    let mut source = TraceArrivals::new(trace);
    let mut sink = Collect::default();
    let out = run_stream(&mut source, cfg, decider, hooks, &mut sink, &mut |p| {
        progress(p.completed, n)
    })?;
    // Built from the records themselves: exact whatever the order of a session's turns.
    let mut summary = Summary::build(
        &sink.records,
        &host_names(&worker_layout(cfg), &out.worker_names),
        run_config(cfg),
        wall.elapsed().as_secs_f64(),
    );
    summary.drains = out.summary.drains;
    Ok(SimOutput {
        records: sink.records,
        summary,
        worker_names: out.worker_names,
        occupancy: sink.occupancy,
        committed: sink.committed,
    })
}

/// Runs the simulation of the requests of `source` with the config's policy in process, on
/// the virtual clock, handing records and samples to `sink` as they come.
pub fn simulate_stream(
    source: &mut dyn RequestSource,
    cfg: &SimConfig,
    sink: &mut dyn RunSink,
    progress: &mut dyn FnMut(&Progress),
) -> Result<StreamOutput, SimError> {
    let mut policy = LocalPolicy::new(cfg.policy.clone(), &initial_views(cfg));
    run_stream(source, cfg, &mut policy, &mut Virtual, sink, progress)
}

/// Runs the replay of the requests of `source` with decisions from `decider` and the clock
/// hooks `hooks`, handing records (in trace order) and samples to `sink` as they come. The
/// summary assumes each session's turns come in trace order (a file stream checks it; see
/// [`TraceArrivals::turns_in_trace_order`] for a trace in memory).
pub fn run_stream(
    source: &mut dyn RequestSource,
    cfg: &SimConfig,
    decider: &mut dyn Decider,
    hooks: &mut dyn Hooks,
    sink: &mut dyn RunSink,
    progress: &mut dyn FnMut(&Progress),
) -> Result<StreamOutput, SimError> {
    cfg.validate()?;
    cfg.check_block_size_of(source.block_size())?;
    let wall = std::time::Instant::now();
    let layout = worker_layout(cfg);
    let names = layout_names(&layout);
    let engine = cfg.cluster(source.block_size()).engine();
    let fleet = Fleet::new(&initial_views(cfg))
        .map_err(|e| SimError::Invalid(format!("topology {}: {e}", cfg.topology)))?;
    let summary = SummaryBuilder::new(&host_names(&layout, &names));
    sink.start(&names)?;
    let drains = cfg
        .drains
        .iter()
        .map(|d| DrainSummary {
            worker: names[d.worker.0 as usize].clone(),
            at_s: d.at_s,
            ..DrainSummary::default()
        })
        .collect();
    let mut sim = Replay {
        cfg,
        engine,
        decider,
        fleet,
        names,
        source,
        peeked: None,
        queue: BinaryHeap::new(),
        seq: 0,
        now: 0,
        waiting: BTreeSet::new(),
        in_flight: 0,
        live: ByIndex::default(),
        awaiting: ByIndex::default(),
        finished: ByIndex::default(),
        early: BTreeMap::new(),
        next_record: 0,
        sink,
        summary,
        read: 0,
        completed: 0,
        failed: None,
        drain_ttft_s: vec![0.0; cfg.drains.len()],
        drains,
        drained: HashMap::default(),
    };
    sim.peeked = sim.source.next_arrival()?;
    if sim.peeked.is_some() {
        sim.push(0, Scheduled::Sample);
        if hooks.tick_every().is_some() {
            sim.push(0, Scheduled::Tick);
        }
        for (k, d) in cfg.drains.iter().enumerate() {
            sim.push(micros(d.at_s), Scheduled::Drain(k));
        }
    }
    let mut reported = 0;
    loop {
        sim.read_arrived()?;
        let Some(Reverse((t, _, _, next))) = sim.queue.pop() else {
            break;
        };
        hooks.before(t);
        sim.now = t;
        match next {
            Scheduled::Ready(i) => {
                sim.live_mut(i).progress.ready = t;
                sim.waiting.insert((t, i));
                sim.dispatch_waiting();
            }
            Scheduled::Start(i) => sim.start(i),
            Scheduled::Engine(k) => {
                sim.engine.wake(k, t);
                sim.drain_engine();
            }
            Scheduled::Sample => {
                // Sample while anything else is pending; an empty queue means the run is over.
                if sim.unfinished() && (!sim.queue.is_empty() || sim.peeked.is_some()) {
                    let (used, committed) = (sim.engine.occupancy(), sim.engine.committed());
                    sim.sink.sample(t as f64 / 1e6, &used, &committed)?;
                    sim.push(t + SAMPLE_EVERY, Scheduled::Sample);
                }
            }
            Scheduled::Tick => {
                if let Some(every) = hooks.tick_every()
                    && sim.unfinished()
                {
                    sim.push(t + every.max(1), Scheduled::Tick);
                }
            }
            Scheduled::Drain(k) => sim.drain(k),
        }
        hooks.after(t, &mut sim.engine);
        sim.drain_engine();
        if let Some(e) = sim.failed.take() {
            return Err(e);
        }
        if sim.completed >= reported + 64 {
            reported = sim.completed;
            progress(&sim.progress());
        }
    }
    progress(&sim.progress());
    if !sim.live.is_empty() {
        return Err(SimError::Stalled {
            unfinished: sim.live.len(),
            first: sim.next_record,
        });
    }
    let drains = sim.drain_summaries();
    let mut summary = sim
        .summary
        .finish(run_config(cfg), wall.elapsed().as_secs_f64());
    summary.drains = drains;
    Ok(StreamOutput {
        summary,
        worker_names: sim.names,
    })
}

impl Replay<'_> {
    fn scaled(&self, r: &TraceRequest) -> Micros {
        micros(r.timestamp_ms as f64 / 1e3 / self.cfg.time_scale)
    }

    fn push(&mut self, t: Micros, next: Scheduled) {
        self.seq += 1;
        self.queue.push(Reverse((t, SEQUENCED, self.seq, next)));
    }

    fn live_mut(&mut self, i: usize) -> &mut Live {
        self.live.get_mut(&i).expect("a live request")
    }

    fn request(&self, i: usize) -> &TraceRequest {
        &self.live[&i].request
    }

    /// Whether a request is read and not finished, or not read yet.
    fn unfinished(&self) -> bool {
        !self.live.is_empty() || self.peeked.is_some()
    }

    fn progress(&self) -> Progress {
        Progress {
            completed: self.completed,
            read: self.read,
            total: self.peeked.is_none().then_some(self.read),
            fraction_read: self.source.fraction_read(),
        }
    }

    /// Reads every request whose scaled timestamp is not after the next event (all of them
    /// when no event is pending), so that event is the earliest there is.
    fn read_arrived(&mut self) -> Result<(), SimError> {
        while let Some(a) = &self.peeked {
            let t = self.scaled(&a.request);
            if let Some(Reverse((head, ..))) = self.queue.peek()
                && *head < t
            {
                break;
            }
            let next = self.source.next_arrival()?;
            let a = std::mem::replace(&mut self.peeked, next).expect("peeked");
            self.arrive(a, t);
        }
        Ok(())
    }

    /// Takes in a request read from the source, ready at `t` unless it follows a turn.
    fn arrive(&mut self, a: Arrival, t: Micros) {
        let i = a.request.index;
        let session = a.request.session;
        self.read += 1;
        self.live.insert(
            i,
            Live {
                request: a.request,
                may_continue: a.may_continue,
                progress: RequestProgress::default(),
            },
        );
        match a.after {
            None => self
                .queue
                .push(Reverse((t, FIRST_TURN, session.0, Scheduled::Ready(i)))),
            Some(prev) => match self.finished.remove(&prev) {
                Some((done, seq)) => {
                    self.queue
                        .push(Reverse((t.max(done), SEQUENCED, seq, Scheduled::Ready(i))))
                }
                None => {
                    self.awaiting.insert(prev, i);
                }
            },
        }
    }

    /// The operator drains worker `cfg.drains[k]`: no decision places a turn on it from now
    /// on (it is `draining`: it finishes its work and keeps its KV), and the sessions it
    /// holds are noted, to count what their next turns compute.
    fn drain(&mut self, k: usize) {
        let w = self.cfg.drains[k].worker;
        for (session, tokens, ..) in self.engine.residents(w) {
            self.drains[k].sessions += 1;
            self.drains[k].resident_tokens += tokens;
            self.drained.insert(session, (k, tokens));
        }
        self.fleet.set_health(w, Health::Draining);
    }

    /// Counts a finished request against the drain that moved its session, if it is the
    /// session's first turn dispatched (at `dispatch`) after that drain.
    fn note_drained(&mut self, dispatch: Micros, record: &RequestRecord) {
        let Some(&(k, tokens)) = self.drained.get(&record.session) else {
            return;
        };
        if dispatch < micros(self.cfg.drains[k].at_s) {
            return;
        }
        self.drained.remove(&record.session);
        let report = &mut self.drains[k];
        report.returned += 1;
        report.returned_tokens += tokens;
        let mode = record.mode.map_or("none", |m| m.as_str());
        *report.next_turn_modes.entry(mode.to_owned()).or_default() += 1;
        report.next_turn_tokens.computed += record.uncached_tokens;
        report.next_turn_tokens.cached += record.cached_tokens;
        self.drain_ttft_s[k] += record.ttft_s.unwrap_or(record.latency_s);
    }

    /// The drains' summaries, with their means.
    fn drain_summaries(&mut self) -> Vec<DrainSummary> {
        let mut drains = std::mem::take(&mut self.drains);
        for (d, sum) in drains.iter_mut().zip(&self.drain_ttft_s) {
            if d.returned > 0 {
                d.next_turn_ttft_mean_s = (sum / d.returned as f64 * 1e6).round() / 1e6;
            }
        }
        drains
    }

    fn dispatch_waiting(&mut self) {
        while self.in_flight < self.cfg.concurrency {
            let Some((_, i)) = self.waiting.pop_first() else {
                break;
            };
            self.in_flight += 1;
            let now = self.now;
            self.live_mut(i).progress.dispatch = now;
            self.route_and_start(i);
        }
    }

    fn route(&mut self, i: usize, rejected_by: Option<WorkerId>) -> Option<Routed> {
        let r = &self.live[&i].request;
        let req = RouteRequest {
            request_id: RequestId(i as u64),
            session: Some(r.session),
            turn: Some(r.turn),
            input_length: r.input_length,
            output_hint: r.output_length,
            hash_ids: &r.hash_ids,
            rejected_by,
            parent: r.parent_session,
        };
        let states = EngineStates(&self.engine);
        self.decider
            .route(&self.fleet, &states, self.now / 1000, &req)
    }

    fn route_and_start(&mut self, i: usize) {
        let r = self.request(i);
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
        self.live_mut(i).progress.decision = Some(decision);
        // The engine's front end takes the request in (chat template, tokenizer) before its
        // scheduler sees it: the request starts that much later.
        let delay = pause + self.intake(i);
        if delay > 0 {
            self.push(self.now + delay, Scheduled::Start(i));
        } else {
            self.start(i);
        }
    }

    /// The profile's intake time of request `i` (0 for a profile without one).
    fn intake(&self, i: usize) -> Micros {
        micros(
            self.cfg
                .profile
                .intake_seconds(self.request(i).input_length),
        )
    }

    fn job(&self, i: usize) -> Job {
        let r = self.request(i);
        Job {
            id: i,
            session: r.session,
            input: r.input_length,
            output: r.output_length.max(1),
            hashes: r.hash_ids.clone(),
        }
    }

    fn start(&mut self, i: usize) {
        let now = self.now;
        // Started (for `wait_s`) when the client's wait ended; the intake is the engine's.
        let started = now.saturating_sub(self.intake(i));
        let st = &mut self.live_mut(i).progress;
        st.started = started;
        let mut decision = st.decision.take().expect("decision");
        // A worker serves the turn alone (direct-to-D, local prefill) if it admits it; if it
        // does not, the policy routes again with `rejected_by` and gives a P→D path.
        if matches!(
            decision.mode,
            ExecutionMode::DirectToD | ExecutionMode::LocalPrefill
        ) {
            let job = self.job(i);
            let session = job.session;
            let (d, need) = (decision.decode, decision.need_tokens);
            let admission = if decision.mode == ExecutionMode::DirectToD {
                match self.engine.try_direct(job.clone(), d, need, self.now) {
                    // A first turn placed where another session's KV is (a subagent on its
                    // parent's D): D serves it as a plain request, prefilling what it does
                    // not hold, as a vLLM instance does.
                    DirectAdmission::NotResident if self.live[&i].request.turn.is_first() => {
                        match self.engine.try_local(job, d, need, self.now) {
                            LocalAdmission::Started { cached } => {
                                DirectAdmission::Admitted { cached }
                            }
                            LocalAdmission::Queued => DirectAdmission::Admitted { cached: 0 },
                            LocalAdmission::Rejected => DirectAdmission::Rejected,
                        }
                    }
                    other => other,
                }
            } else {
                match self.engine.try_local(job, d, need, self.now) {
                    LocalAdmission::Started { cached } => DirectAdmission::Admitted { cached },
                    // Counted when it is admitted.
                    LocalAdmission::Queued => DirectAdmission::Admitted { cached: 0 },
                    LocalAdmission::Rejected => DirectAdmission::Rejected,
                }
            };
            match admission {
                DirectAdmission::Admitted { cached } => {
                    self.decider.carried_out(&decision);
                    let st = &mut self.live_mut(i).progress;
                    st.cached = cached;
                    st.decision = Some(decision);
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
        match (decision.mode, decision.prefill) {
            (ExecutionMode::Colocated, _) => {
                self.engine.start_colocated(job, decision.decode, self.now);
            }
            (ExecutionMode::MigrateKv, Some(p)) => {
                self.engine.migrate(job, p, decision.decode, self.now);
            }
            (_, Some(p)) => self.engine.reseed(job, p, decision.decode, self.now),
            (mode, None) => {
                debug_assert!(false, "mode {mode} without a prefill worker");
                self.finish(i, Outcome::Rejected);
                return;
            }
        }
        self.live_mut(i).progress.decision = Some(decision);
        self.drain_engine();
    }

    fn drain_engine(&mut self) {
        for (t, w) in self.engine.take_wakes() {
            self.push(t, Scheduled::Engine(w));
        }
        for event in self.engine.take_events() {
            match event {
                Event::FirstToken { id, at } => {
                    if let Some(l) = self.live.get_mut(&id) {
                        l.progress.first = Some(at);
                    }
                    let done = Observation::PrefillDone {
                        request_id: RequestId(id as u64),
                        at_ms: Some(at / 1000),
                    };
                    self.decider.observe(&done, None);
                }
                Event::Done {
                    id,
                    at,
                    resident_tokens,
                    cached,
                } => {
                    debug_assert_eq!(at, self.now);
                    if let Some(l) = self.live.get_mut(&id) {
                        l.progress.cached = cached;
                    }
                    self.observe_done(id, Outcome::Ok, resident_tokens);
                    self.finish(id, Outcome::Ok);
                }
                Event::TransferTimedOut { id, failure, .. } => {
                    if let Some(l) = self.live.get_mut(&id) {
                        l.progress.failure = Some(failure);
                    }
                    self.observe_done(id, Outcome::KvTransferTimeout, 0);
                    self.finish(id, Outcome::KvTransferTimeout);
                }
                Event::DecodeOom { id, failure, .. } => {
                    if let Some(l) = self.live.get_mut(&id) {
                        l.progress.failure = Some(failure);
                    }
                    self.observe_done(id, Outcome::DecodeOom, 0);
                    self.finish(id, Outcome::DecodeOom);
                }
                Event::Retracted { id, .. } => {
                    if let Some(l) = self.live.get_mut(&id) {
                        l.progress.retractions += 1;
                    }
                }
                Event::Evicted { session, worker } => {
                    self.decider
                        .observe(&Observation::Evicted { session, worker }, None);
                }
            }
        }
    }

    fn observe_done(&mut self, i: usize, outcome: Outcome, resident_tokens: u64) {
        let Some(l) = self.live.get(&i) else {
            return;
        };
        let Some(d) = &l.progress.decision else {
            return;
        };
        let completed = Observation::Completed {
            request_id: RequestId(i as u64),
            session: Some(l.request.session),
            worker: d.decode,
            outcome,
            resident_tokens,
            direct: d.mode == ExecutionMode::DirectToD,
        };
        let d = d.clone();
        self.decider.observe(&completed, Some(&d));
    }

    fn finish(&mut self, i: usize, outcome: Outcome) {
        let Some(live) = self.live.remove(&i) else {
            debug_assert!(false, "request {i} finished twice");
            return;
        };
        let (r, st) = (&live.request, &live.progress);
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
        let record = RequestRecord {
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
            retractions: st.retractions,
            failure: st.failure.map(|f| FailureRecord {
                stage: f.stage,
                worker: self.names[f.worker.0 as usize].clone(),
                waited_s: secs(self.now.saturating_sub(f.since)),
                need_tokens: f.need_tokens,
                free_tokens: f.free_tokens,
                evictable_tokens: f.evictable_tokens,
                queue_depth: f.queue_depth,
            }),
        };
        self.note_drained(st.dispatch, &record);
        self.emit(record);
        if self.cfg.session_ends && live.request.session_final {
            // The client ended the session: the router forgets it and its D lets its KV go.
            let session = live.request.session;
            self.decider.end_session(session);
            if let Some(d) = &live.progress.decision {
                self.engine.release_session(d.decode, session, self.now);
                // Work waiting there for room may start now.
                self.drain_engine();
            }
        }
        self.in_flight -= 1;
        self.completed += 1;
        if let Some(next) = self.awaiting.remove(&i) {
            let t = self.scaled(self.request(next)).max(self.now);
            self.push(t, Scheduled::Ready(next));
        } else if live.may_continue {
            // The next turn, when it is read, is ready at this sequence number.
            self.seq += 1;
            self.finished.insert(i, (self.now, self.seq));
        }
        self.dispatch_waiting();
    }

    /// Hands records to the sink in trace order.
    fn emit(&mut self, record: RequestRecord) {
        if record.index != self.next_record {
            self.early.insert(record.index, record);
            return;
        }
        self.write(&record);
        while let Some(r) = self.early.remove(&self.next_record) {
            self.write(&r);
        }
    }

    fn write(&mut self, record: &RequestRecord) {
        self.next_record += 1;
        self.summary.add(record);
        if let Err(e) = self.sink.record(record)
            && self.failed.is_none()
        {
            self.failed = Some(e);
        }
    }
}
