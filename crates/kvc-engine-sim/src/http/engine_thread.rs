//! The engine thread: runs the simulator's [`Engine`] paced to wall time, starts the requests
//! the worker servers hand it, publishes the workers' snapshots and tells each request's
//! handlers how it progresses.

use super::rooms::{BootstrapRooms, Meeting, WaitingLeg};
use super::state::{ServedPath, SharedState};
use crate::WorkerError;
use crate::model::{DirectAdmission, Engine, Event, Job, Micros, Wake};
use crate::publish::Publisher;
use axum::http::StatusCode;
use kvc_core::{Outcome, SessionId, WorkerId};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;

/// The longest the thread sleeps: how late it notices a shutdown, at worst.
const IDLE_WAIT: Duration = Duration::from_millis(20);

/// Snapshots are published at least this often.
const PUBLISH_EVERY: Duration = Duration::from_millis(5);

/// The part of a request a worker asks the engine to carry out.
#[derive(Debug, Clone, Copy)]
pub(super) enum RequestPart {
    /// The whole request on a colocated worker.
    Colocated(WorkerId),
    /// A direct-to-D turn on a decode worker (subject to its admission).
    Direct(WorkerId),
    /// The prefill leg of a P→D request, waiting in `room` for its decode leg.
    PrefillLeg {
        /// The bootstrap room both legs name.
        room: u64,
        /// This prefill worker.
        prefill: WorkerId,
    },
    /// vLLM dialect: a decode worker pulled the request prefill worker `prefill` held (one
    /// P→D job: prefill on P, transfer, decode on D).
    Pulled {
        /// The prefill worker that held it.
        prefill: WorkerId,
        /// This decode worker.
        decode: WorkerId,
    },
    /// vLLM dialect: a plain request to a decode worker, served with its prefix cache — a
    /// direct-to-D append when the session is resident and there is room, else in full.
    Plain {
        /// This decode worker.
        decode: WorkerId,
        /// Fault injection: the worker drops the session's KV first (an eviction the router
        /// has not heard of).
        evict_first: bool,
    },
    /// The decode leg of a P→D request, waiting in `room` for its prefill leg.
    DecodeLeg {
        /// The bootstrap room both legs name.
        room: u64,
        /// This decode worker.
        decode: WorkerId,
        /// The prefill worker the bootstrap server named.
        prefill: WorkerId,
    },
}

/// Progress of one started request, sent to the HTTP handler.
#[derive(Debug, Clone)]
pub(super) enum Progress {
    /// The engine took it (the first message of every start that is not refused).
    Accepted,
    /// Direct-to-D refused by admission (why).
    Rejected(String),
    /// The first token (for a prefill leg: its KV reached D).
    FirstToken,
    /// Finished, `cached` prompt tokens served from a cache.
    Done {
        /// Prompt tokens served from a cache.
        cached: u64,
    },
    /// Failed: the HTTP status to answer and why.
    Failed(StatusCode, String),
}

/// A worker's request to start its part of trace request `index`.
pub(super) struct StartRequest {
    pub(super) index: usize,
    pub(super) job: Job,
    pub(super) part: RequestPart,
    /// Where the request's progress goes.
    pub(super) reply: UnboundedSender<Progress>,
}

/// One started engine job: who hears about it.
struct RunningJob {
    index: usize,
    /// Its engine session.
    session: SessionId,
    /// The decode (or colocated, or direct) worker's handler.
    decode: UnboundedSender<Progress>,
    /// The prefill worker's handler, until it heard of the first token.
    prefill: Option<UnboundedSender<Progress>>,
    path: ServedPath,
}

/// The engine thread's state.
pub(super) struct EngineThread {
    engine: Engine,
    shared: Arc<SharedState>,
    wakes: BinaryHeap<Reverse<(Micros, u64, Wake)>>,
    seq: u64,
    /// Engine job id -> its listeners.
    running: HashMap<usize, RunningJob>,
    /// Jobs running per session.
    busy: HashMap<SessionId, u32>,
    next_job: usize,
    rooms: BootstrapRooms,
    publisher: Publisher,
    start_wall_ms: u64,
    speedup: f64,
    last: Micros,
    pair_timeout: Micros,
}

impl EngineThread {
    /// The thread's state; `pair_timeout` is how long (engine time) one leg of a P→D request
    /// waits for the other.
    pub(super) fn new(
        engine: Engine,
        shared: Arc<SharedState>,
        publisher: Publisher,
        speedup: f64,
        pair_timeout: Micros,
    ) -> Self {
        EngineThread {
            engine,
            shared,
            wakes: BinaryHeap::new(),
            seq: 0,
            running: HashMap::new(),
            busy: HashMap::new(),
            next_job: 0,
            rooms: BootstrapRooms::default(),
            publisher,
            start_wall_ms: kvc_admission::Clock::now_ms(&kvc_admission::SystemClock),
            speedup,
            last: 0,
            pair_timeout,
        }
    }

    /// Runs until `shutdown` is cancelled or every sender of `requests` is gone.
    pub(super) fn run(
        mut self,
        requests: mpsc::Receiver<StartRequest>,
        shutdown: CancellationToken,
    ) -> Result<(), WorkerError> {
        let clock = self.shared.clock;
        let mut last_publish = Instant::now();
        while !shutdown.is_cancelled() {
            self.advance(clock.engine_now());
            if last_publish.elapsed() >= PUBLISH_EVERY {
                self.publish()?;
                last_publish = Instant::now();
            }
            let next = self
                .wakes
                .peek()
                .map(|Reverse((t, _, _))| *t)
                .into_iter()
                .chain(self.rooms.next_deadline())
                .min();
            let wait = match next {
                Some(t) => clock
                    .wall_of(t)
                    .saturating_duration_since(Instant::now())
                    .min(IDLE_WAIT),
                None => IDLE_WAIT,
            };
            match requests.recv_timeout(wait) {
                Ok(request) => {
                    self.advance(clock.engine_now());
                    self.start(request);
                    self.drain();
                    // Publish at once: the router's next decision should see this request.
                    self.publish()?;
                    last_publish = Instant::now();
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
        Ok(())
    }

    /// Publishes every worker's snapshot.
    pub(super) fn publish(&mut self) -> Result<(), WorkerError> {
        self.publisher
            .publish(&self.engine, self.start_wall_ms, self.speedup)
    }

    /// Handles every wake and every expired P→D leg due by `now`.
    fn advance(&mut self, now: Micros) {
        let now = now.max(self.last);
        while let Some(Reverse((t, _, key))) = self.wakes.peek().copied() {
            if t > now {
                break;
            }
            self.wakes.pop();
            let t = t.max(self.last);
            self.last = t;
            self.engine.wake(key, t);
            self.drain();
        }
        for (room, leg) in self.rooms.expire(now) {
            let _ = leg.reply.send(Progress::Failed(
                StatusCode::GATEWAY_TIMEOUT,
                format!("bootstrap room {room}: the other half of the request never came"),
            ));
        }
        self.last = now;
    }

    fn start(&mut self, request: StartRequest) {
        let StartRequest {
            index,
            mut job,
            part,
            reply,
        } = request;
        let now = self.last;
        let id = self.next_job;
        self.next_job += 1;
        job.id = id;
        // Standalone workers serve any client: a session's second request in flight cannot
        // share the KV the first one is still growing, so it runs as a session of its own.
        if let Some(standalone) = &self.shared.standalone
            && self.busy.contains_key(&job.session)
        {
            job.session = standalone.fresh_session();
        }
        let session = job.session;
        let (path, decode, prefill) = match part {
            RequestPart::Colocated(w) => {
                self.engine.start_colocated(job, w, now);
                (ServedPath::Colocated(w), reply, None)
            }
            RequestPart::Direct(d) => {
                let resident = self.engine.resident_tokens(d, job.session).unwrap_or(0);
                let need = (job.input + job.output).saturating_sub(resident);
                let refusal = match self.engine.try_direct(job, d, need, now) {
                    DirectAdmission::Admitted { .. } => None,
                    DirectAdmission::NotResident => {
                        Some("the session is not resident on this decode worker")
                    }
                    DirectAdmission::Rejected => {
                        Some("no room for the session's append on this decode worker")
                    }
                };
                if let Some(why) = refusal {
                    let _ = reply.send(Progress::Rejected(why.into()));
                    return;
                }
                (ServedPath::Direct(d), reply, None)
            }
            RequestPart::Plain {
                decode: d,
                evict_first,
            } => {
                if evict_first {
                    self.engine.release_session(d, job.session, now);
                }
                let resident = self.engine.resident_tokens(d, job.session);
                let need = (job.input + job.output).saturating_sub(resident.unwrap_or(0));
                let direct = match resident {
                    Some(_) => self.engine.try_direct(job.clone(), d, need, now),
                    None => DirectAdmission::NotResident,
                };
                match direct {
                    DirectAdmission::Admitted { .. } => (ServedPath::Direct(d), reply, None),
                    DirectAdmission::NotResident | DirectAdmission::Rejected => {
                        self.engine.start_full_on_decode(job, d, now);
                        (ServedPath::DecodeInFull(d), reply, None)
                    }
                }
            }
            RequestPart::Pulled { prefill, decode } => {
                self.engine.reseed(job, prefill, decode, now);
                (ServedPath::PrefillDecode { prefill, decode }, reply, None)
            }
            RequestPart::PrefillLeg { room, .. } | RequestPart::DecodeLeg { room, .. } => {
                let leg = WaitingLeg {
                    index,
                    part,
                    reply,
                    deadline: now + self.pair_timeout,
                };
                match self.rooms.meet(room, leg) {
                    Meeting::Waiting => return,
                    Meeting::Mismatch { message, replies } => {
                        for r in replies {
                            let _ =
                                r.send(Progress::Failed(StatusCode::BAD_REQUEST, message.clone()));
                        }
                        return;
                    }
                    Meeting::Paired(pair) => {
                        self.engine.reseed(job, pair.prefill, pair.decode, now);
                        let _ = pair.prefill_reply.send(Progress::Accepted);
                        (
                            ServedPath::PrefillDecode {
                                prefill: pair.prefill,
                                decode: pair.decode,
                            },
                            pair.decode_reply,
                            Some(pair.prefill_reply),
                        )
                    }
                }
            }
        };
        let _ = decode.send(Progress::Accepted);
        *self.busy.entry(session).or_default() += 1;
        self.running.insert(
            id,
            RunningJob {
                index,
                session,
                decode,
                prefill,
                path,
            },
        );
    }

    /// Records `outcome` for job `id` and fails its pending answers with `message`.
    fn fail(&mut self, id: usize, outcome: Outcome, message: &str) {
        if let Some(r) = self.finish(id) {
            self.shared.with_served(r.index, |s| {
                s.path = Some(r.path);
                s.failure = Some(outcome);
            });
            let failed = Progress::Failed(StatusCode::INTERNAL_SERVER_ERROR, message.into());
            for tx in std::iter::once(&r.decode).chain(r.prefill.as_ref()) {
                let _ = tx.send(failed.clone());
            }
        }
    }

    /// Job `id` is over: its listeners, its session no longer busy with it.
    fn finish(&mut self, id: usize) -> Option<RunningJob> {
        let r = self.running.remove(&id)?;
        if let Some(n) = self.busy.get_mut(&r.session) {
            *n -= 1;
            if *n == 0 {
                self.busy.remove(&r.session);
            }
        }
        Some(r)
    }

    /// Takes the engine's wake-ups and events, telling each request's handlers.
    fn drain(&mut self) {
        for (t, w) in self.engine.take_wakes() {
            self.seq += 1;
            self.wakes.push(Reverse((t, self.seq, w)));
        }
        for event in self.engine.take_events() {
            match event {
                Event::FirstToken { id, .. } => {
                    if let Some(r) = self.running.get_mut(&id) {
                        let _ = r.decode.send(Progress::FirstToken);
                        if let Some(p) = r.prefill.take() {
                            let _ = p.send(Progress::FirstToken);
                        }
                    }
                }
                Event::Done { id, cached, .. } => {
                    if let Some(r) = self.finish(id) {
                        self.shared.with_served(r.index, |s| {
                            s.path = Some(r.path);
                            s.cached = cached;
                        });
                        let _ = r.decode.send(Progress::Done { cached });
                    }
                }
                Event::TransferTimedOut { id, .. } => self.fail(
                    id,
                    Outcome::KvTransferTimeout,
                    "the KV transfer to the decode worker timed out",
                ),
                Event::DecodeOom { id, .. } => self.fail(
                    id,
                    Outcome::DecodeOom,
                    "the decode worker ran out of KV memory for this request",
                ),
                Event::Retracted { .. } | Event::Evicted { .. } => {}
            }
        }
    }
}
