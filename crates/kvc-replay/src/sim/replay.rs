//! The replay loop: a trace's requests, paced by the run's clock, routed by a [`Decider`] and
//! carried out by the engine, one record per request.
//!
//! A session's turns run in order; turn k+1 is ready at `max(timestamp / time_scale,
//! completion of turn k)`; at most `concurrency` requests are in flight and the rest wait in
//! ready order. TTFT and latency are measured from the ready time. Events are ordered by
//! (time in µs, sequence number).

use super::cluster::{host_names, initial_views, layout_names, worker_layout};
use super::decider::{Decider, Hooks, LocalPolicy, Routed, Virtual};
use super::metrics::{FailureRecord, RequestRecord, Summary};
use super::{Occupancy, SimConfig, SimError, SimOutput, run_config};
use crate::trace::{Trace, TraceRequest};
use kvc_core::{Capabilities, ExecutionMode, Outcome, RequestId, SessionId, WorkerId, WorkerRole};
use kvc_engine_sim::model::{
    DirectAdmission, Engine, Event, Failure, Job, LocalAdmission, Micros, Wake, micros,
};
use kvc_policy::{ClusterView, Observation, RouteRequest, WorkerView};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

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
}

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

/// Occupancy is sampled this often (simulated µs).
const SAMPLE_EVERY: Micros = 10_000_000;

struct Replay<'a> {
    cfg: &'a SimConfig,
    trace: &'a Trace,
    engine: Engine,
    layout: Vec<(WorkerRole, Capabilities)>,
    names: Vec<String>,
    decider: &'a mut dyn Decider,
    queue: BinaryHeap<Reverse<(Micros, u64, Scheduled)>>,
    seq: u64,
    now: Micros,
    /// Ready requests waiting for a slot, by (ready time, index).
    waiting: BTreeSet<(Micros, usize)>,
    in_flight: usize,
    /// Per trace index: index of the session's next turn.
    next_turn: Vec<Option<usize>>,
    requests: Vec<RequestProgress>,
    records: Vec<Option<RequestRecord>>,
    occupancy: Occupancy,
    committed: Occupancy,
    completed: usize,
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
    cfg.validate()?;
    cfg.check_block_size(trace)?;
    let wall = std::time::Instant::now();
    let layout = worker_layout(cfg);
    let names = layout_names(&layout);
    let engine = cfg.engine(trace);
    let n = trace.requests.len();
    // Link each request to its session's next turn (trace order is timestamp order; turns of
    // a session are sorted by turn number).
    let mut next_turn = vec![None; n];
    let mut by_session: BTreeMap<SessionId, Vec<usize>> = BTreeMap::new();
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
    let mut sim = Replay {
        cfg,
        trace,
        engine,
        decider,
        layout,
        names,
        queue: BinaryHeap::new(),
        seq: 0,
        now: 0,
        waiting: BTreeSet::new(),
        in_flight: 0,
        next_turn,
        requests: vec![RequestProgress::default(); n],
        records: vec![None; n],
        occupancy: Vec::new(),
        committed: Vec::new(),
        completed: 0,
    };
    for i in firsts {
        let t = sim.scaled(&trace.requests[i]);
        sim.push(t, Scheduled::Ready(i));
    }
    if n > 0 {
        sim.push(0, Scheduled::Sample);
        if hooks.tick_every().is_some() {
            sim.push(0, Scheduled::Tick);
        }
    }
    let mut reported = 0;
    while let Some(Reverse((t, _, next))) = sim.queue.pop() {
        hooks.before(t);
        sim.now = t;
        match next {
            Scheduled::Ready(i) => {
                sim.requests[i].ready = t;
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
                if sim.completed < n && !sim.queue.is_empty() {
                    sim.occupancy.push((t as f64 / 1e6, sim.engine.occupancy()));
                    sim.committed.push((t as f64 / 1e6, sim.engine.committed()));
                    sim.push(t + SAMPLE_EVERY, Scheduled::Sample);
                }
            }
            Scheduled::Tick => {
                if let Some(every) = hooks.tick_every()
                    && sim.completed < n
                {
                    sim.push(t + every.max(1), Scheduled::Tick);
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
    let summary = Summary::build(
        &records,
        &host_names(&sim.layout, &sim.names),
        run_config(cfg),
        wall.elapsed().as_secs_f64(),
    );
    Ok(SimOutput {
        records,
        summary,
        worker_names: sim.names,
        occupancy: sim.occupancy,
        committed: sim.committed,
    })
}

impl Replay<'_> {
    fn scaled(&self, r: &TraceRequest) -> Micros {
        micros(r.timestamp_ms as f64 / 1e3 / self.cfg.time_scale)
    }

    fn push(&mut self, t: Micros, next: Scheduled) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, next)));
    }

    fn dispatch_waiting(&mut self) {
        while self.in_flight < self.cfg.concurrency {
            let Some((_, i)) = self.waiting.pop_first() else {
                break;
            };
            self.in_flight += 1;
            self.requests[i].dispatch = self.now;
            self.route_and_start(i);
        }
    }

    fn cluster_views(&self) -> Vec<WorkerView> {
        self.layout
            .iter()
            .enumerate()
            .map(|(i, (role, caps))| {
                let id = WorkerId(i as u32);
                WorkerView::new(id, *role, self.engine.state(id)).with_caps(*caps)
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
            request_id: RequestId(i as u64),
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
        self.requests[i].decision = Some(decision);
        if pause > 0 {
            self.push(self.now + pause, Scheduled::Start(i));
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
        self.requests[i].started = self.now;
        let mut decision = self.requests[i].decision.take().expect("decision");
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
                self.engine.try_direct(job, d, need, self.now)
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
                    self.requests[i].cached = cached;
                    self.requests[i].decision = Some(decision);
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
            (_, Some(p)) => self.engine.reseed(job, p, decision.decode, self.now),
            (mode, None) => {
                debug_assert!(false, "mode {mode} without a prefill worker");
                self.finish(i, Outcome::Rejected);
                return;
            }
        }
        self.requests[i].decision = Some(decision);
        self.drain_engine();
    }

    fn drain_engine(&mut self) {
        for (t, w) in self.engine.take_wakes() {
            self.push(t, Scheduled::Engine(w));
        }
        for event in self.engine.take_events() {
            match event {
                Event::FirstToken { id, at } => {
                    self.requests[id].first = Some(at);
                    let done = Observation::PrefillDone {
                        request_id: RequestId(id as u64),
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
                    self.requests[id].cached = cached;
                    self.observe_done(id, Outcome::Ok, resident_tokens);
                    self.finish(id, Outcome::Ok);
                }
                Event::TransferTimedOut { id, failure, .. } => {
                    self.requests[id].failure = Some(failure);
                    self.observe_done(id, Outcome::KvTransferTimeout, 0);
                    self.finish(id, Outcome::KvTransferTimeout);
                }
                Event::DecodeOom { id, failure, .. } => {
                    self.requests[id].failure = Some(failure);
                    self.observe_done(id, Outcome::DecodeOom, 0);
                    self.finish(id, Outcome::DecodeOom);
                }
                Event::Retracted { id, .. } => self.requests[id].retractions += 1,
                Event::Evicted { session, worker } => {
                    self.decider
                        .observe(&Observation::Evicted { session, worker }, None);
                }
            }
        }
    }

    fn observe_done(&mut self, i: usize, outcome: Outcome, resident_tokens: u64) {
        let Some(d) = &self.requests[i].decision else {
            return;
        };
        let completed = Observation::Completed {
            request_id: RequestId(i as u64),
            session: Some(self.trace.requests[i].session),
            worker: d.decode,
            outcome,
            resident_tokens,
            direct: d.mode == ExecutionMode::DirectToD,
        };
        let d = d.clone();
        self.decider.observe(&completed, Some(&d));
    }

    fn finish(&mut self, i: usize, outcome: Outcome) {
        let r = &self.trace.requests[i];
        let st = &self.requests[i];
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
        });
        self.in_flight -= 1;
        self.completed += 1;
        if let Some(next) = self.next_turn[i] {
            let t = self.scaled(&self.trace.requests[next]).max(self.now);
            self.push(t, Scheduled::Ready(next));
        }
        self.dispatch_waiting();
    }
}
