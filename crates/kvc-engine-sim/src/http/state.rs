//! What the worker servers, the engine thread and the driver share: the script, the prompts in
//! flight, what the workers served of each request, and engine time read off the wall clock.

use super::engine_thread::{Progress, RequestPart, StartRequest};
use super::script::Script;
use crate::model::{Job, Micros};
use kvc_core::{Outcome, WorkerId, WorkerRole};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// How a request was carried out, as the workers saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedPath {
    /// Prefill on `prefill`, KV to `decode`.
    PrefillDecode {
        /// Prefill worker.
        prefill: WorkerId,
        /// Decode worker.
        decode: WorkerId,
    },
    /// Direct-to-D on the decode worker.
    Direct(WorkerId),
    /// Colocated worker.
    Colocated(WorkerId),
    /// A decode worker served a plain request in full (vLLM dialect): the session was not
    /// resident there, or had no room to grow, so the worker prefilled the whole prompt.
    DecodeInFull(WorkerId),
}

/// A prefill worker's answer to a vLLM `do_remote_decode` request, held until a decode
/// worker pulls it or it expires.
#[derive(Debug, Clone, Copy)]
pub(super) struct Hold {
    /// Trace index of the request (standalone workers: [`NO_TRACE_INDEX`]).
    pub(super) index: usize,
    /// Its prompt's key ([`crate::prompt::prompt_key`]): D must pull the prompt P prefilled.
    pub(super) key: u64,
    /// When it expires.
    pub(super) expires: Instant,
}

/// What the workers saw of one trace request (its last attempt).
#[derive(Debug, Clone, Default)]
pub struct Served {
    /// First arrival of the request at any worker.
    pub arrived: Option<Instant>,
    /// The path of the attempt that was carried out.
    pub path: Option<ServedPath>,
    /// Prompt tokens served from a cache.
    pub cached: u64,
    /// When the first token's event was handed to the HTTP server.
    pub first_sent: Option<Instant>,
    /// When the last event (or the whole answer) was handed to the HTTP server.
    pub done_sent: Option<Instant>,
    /// A failure the engine reported (transfer timeout).
    pub failure: Option<Outcome>,
    /// Direct-to-D attempts the decode worker's admission refused.
    pub admission_rejects: u32,
    /// Times a decode or colocated worker got this request (once per attempt).
    pub attempts: u32,
}

/// State shared by the worker servers, the engine thread and the driver.
pub struct SharedState {
    pub(super) script: Arc<Script>,
    pub(super) roles: Vec<WorkerRole>,
    pub(super) names: Vec<String>,
    /// Prompt key -> trace indices in flight with that prompt.
    pub(super) in_flight: Mutex<HashMap<u64, Vec<usize>>>,
    /// By trace index.
    pub(super) served: Mutex<Vec<Served>>,
    /// Requests to the engine thread.
    pub(super) engine: Mutex<mpsc::Sender<StartRequest>>,
    /// The model's input limit (tokens).
    pub(super) max_input: u64,
    /// KV pool of each worker (tokens).
    pub(super) pool_tokens: u64,
    /// The profile, for the front end's intake of a text prompt
    /// ([`crate::model::Profile::intake_seconds`]).
    pub(super) profile: crate::model::Profile,
    /// The model name the workers report.
    pub(super) model: String,
    pub(super) clock: Pacer,
    /// vLLM dialect: (prefill worker, remote request id) -> the request it holds for a
    /// decode worker.
    pub(super) holds: Mutex<HashMap<(WorkerId, String), Hold>>,
    /// Standalone workers (any prompt, no trace): how prompts become engine jobs; `None` when
    /// replaying a trace.
    pub(super) standalone: Option<super::standalone::Standalone>,
}

/// The trace index standalone workers give every request (no trace record is kept:
/// [`SharedState::with_served`] ignores it).
pub(super) const NO_TRACE_INDEX: usize = usize::MAX;

impl SharedState {
    /// Marks request `index` of the script (prompt `key`, [`crate::prompt::prompt_key`]) as in
    /// flight: a worker given that prompt serves that request.
    pub fn register(&self, key: u64, index: usize) {
        self.in_flight.lock().entry(key).or_default().push(index);
    }

    /// Request `index` (prompt `key`) is over.
    pub fn unregister(&self, key: u64, index: usize) {
        let mut in_flight = self.in_flight.lock();
        if let Some(v) = in_flight.get_mut(&key) {
            v.retain(|i| *i != index);
            if v.is_empty() {
                in_flight.remove(&key);
            }
        }
    }

    /// The trace request in flight with prompt `key` (the earliest, when several are).
    pub(super) fn find(&self, key: u64) -> Option<usize> {
        self.in_flight
            .lock()
            .get(&key)
            .and_then(|v| v.iter().min().copied())
    }

    /// Updates what the workers saw of trace request `index`.
    pub(super) fn with_served(&self, index: usize, f: impl FnOnce(&mut Served)) {
        if let Some(s) = self.served.lock().get_mut(index) {
            f(s);
        }
    }

    /// What the workers saw of every request, by script index.
    pub fn served(&self) -> Vec<Served> {
        self.served.lock().clone()
    }

    /// Worker names, by worker id.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The model name the workers report.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Prefill worker `p` holds trace request `index` (prompt `key`) for a decode worker's
    /// pull under `id` until `expires`; expired holds are dropped here.
    pub(super) fn hold(&self, p: WorkerId, id: String, index: usize, key: u64, expires: Instant) {
        let now = Instant::now();
        let mut holds = self.holds.lock();
        holds.retain(|_, h| h.expires > now);
        holds.insert(
            (p, id),
            Hold {
                index,
                key,
                expires,
            },
        );
    }

    /// Takes the hold `id` of prefill worker `p`: `None` when unknown or expired.
    pub(super) fn pull(&self, p: WorkerId, id: &str) -> Option<Hold> {
        let hold = self.holds.lock().remove(&(p, id.to_owned()))?;
        (hold.expires > Instant::now()).then_some(hold)
    }

    /// The worker named `name`.
    pub(super) fn worker_named(&self, name: &str) -> Option<WorkerId> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| WorkerId(i as u32))
    }

    /// The engine job of trace request `index`, generating `max_tokens` (the client's limit)
    /// or else the trace's output length, at least one token.
    pub(super) fn job(&self, index: usize, max_tokens: Option<u64>) -> Job {
        let r = &self.script.requests[index];
        Job {
            id: 0,
            session: r.session,
            input: r.input_length,
            output: max_tokens.unwrap_or(r.output_length).max(1),
            hashes: r.hash_ids.clone(),
        }
    }

    /// Hands trace request `index` (as `job`, for `part` of its path) to the engine thread
    /// and returns where its progress comes; `None` once the engine has stopped.
    pub(super) fn start_on_engine(
        &self,
        index: usize,
        job: Job,
        part: RequestPart,
    ) -> Option<UnboundedReceiver<Progress>> {
        let (reply, progress) = unbounded_channel();
        let request = StartRequest {
            index,
            job,
            part,
            reply,
        };
        self.engine.lock().send(request).ok().map(|()| progress)
    }
}

/// Engine time from wall time: the engine runs `speedup` times faster than the wall clock,
/// from `start`.
#[derive(Debug, Clone, Copy)]
pub struct Pacer {
    /// Engine time 0.
    pub start: Instant,
    /// How many times faster than the wall clock engine time runs.
    pub speedup: f64,
}

impl Pacer {
    /// Engine time now.
    pub fn engine_now(&self) -> Micros {
        (self.start.elapsed().as_secs_f64() * 1e6 * self.speedup) as Micros
    }

    /// Engine time of the wall instant `t`, in seconds.
    pub fn engine_at(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.start).as_secs_f64() * self.speedup
    }

    /// The wall instant of engine time `t`.
    pub(super) fn wall_of(&self, t: Micros) -> Instant {
        self.start + Duration::from_secs_f64(t as f64 / 1e6 / self.speedup)
    }
}
