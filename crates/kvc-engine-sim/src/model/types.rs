//! The model's vocabulary: time, jobs, wake-ups, events, options and admission answers.

use kvc_admission::EvictionConfig;
use kvc_core::{BlockSize, FailureStage, HashIds, SessionId, WorkerId};

/// Microseconds of simulated (or real) time.
pub type Micros = u64;

/// Converts seconds to whole microseconds.
pub fn micros(seconds: f64) -> Micros {
    if seconds <= 0.0 {
        0
    } else {
        (seconds * 1e6).round() as Micros
    }
}

/// A request as the engine sees it.
#[derive(Debug, Clone)]
pub struct Job {
    /// Caller's handle (the trace index).
    pub id: usize,
    /// Session.
    pub session: SessionId,
    /// Prompt tokens.
    pub input: u64,
    /// Tokens to generate (at least 1 is produced).
    pub output: u64,
    /// Block ids of the prompt.
    pub hashes: HashIds,
}

/// Something the engine asks its driver to do at a time. Ordered (variant, then worker or job)
/// so drivers can keep wake-ups in a deterministic queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Wake {
    /// The iteration running on a worker ends.
    IterationEnd(WorkerId),
    /// The transfer of a job's KV into its decode worker finishes.
    TransferDone(usize),
    /// A job waiting for room on a decode worker gives up.
    TransferTimeout(usize),
}

/// What happened to a job, reported to the driver.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The first output token of a job reached the client.
    FirstToken {
        /// Job.
        id: usize,
        /// When.
        at: Micros,
    },
    /// A job finished.
    Done {
        /// Job.
        id: usize,
        /// When.
        at: Micros,
        /// Resident tokens of its session left on its decode worker (0 if none).
        resident_tokens: u64,
        /// Prompt tokens served from a cache.
        cached: u64,
    },
    /// A job's KV transfer timed out: waiting for room on D, for room or compute on P, or
    /// on the wire (`failure` says which).
    TransferTimedOut {
        /// Job.
        id: usize,
        /// When.
        at: Micros,
        /// Where it was waiting, and the state of that worker then.
        failure: Failure,
    },
    /// A request failed for want of KV room on its decode worker: retracted more often than
    /// the profile allows, retracted on a decode-only worker whose host pool had no room for
    /// its KV, or left waiting past the transfer timeout after a retraction.
    DecodeOom {
        /// Job.
        id: usize,
        /// When.
        at: Micros,
        /// Which of those, and the state of the decode worker then.
        failure: Failure,
    },
    /// A running request's KV was freed for want of room; it waits on its decode worker and
    /// recomputes its context when room returns.
    Retracted {
        /// Job.
        id: usize,
        /// The decode worker.
        worker: WorkerId,
    },
    /// A decode worker evicted a session's KV.
    Evicted {
        /// Session.
        session: SessionId,
        /// Worker.
        worker: WorkerId,
    },
}

/// Why a job failed: what it was waiting for, on which worker, and that worker's pool and
/// queue at the moment it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    /// What the job was waiting for.
    pub stage: FailureStage,
    /// The worker it was waiting on (D for room on D, a retraction or the wire; P for room
    /// or compute on P).
    pub worker: WorkerId,
    /// Tokens of room it needed on that worker (0 where it was not waiting for room).
    pub need_tokens: u64,
    /// Tokens of that worker's pool that nothing occupied.
    pub free_tokens: u64,
    /// Tokens of that worker's pool that idle sessions and unpinned prefix-cache blocks
    /// held (what eviction could have taken without retracting anyone).
    pub evictable_tokens: u64,
    /// Requests waiting in that worker's queue for room, this one included.
    pub queue_depth: u32,
    /// When the wait that ran out began (the decision, a retraction, or D's room granted).
    pub since: Micros,
}

/// Engine-side eviction behaviour of decode workers.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOptions {
    /// Eviction planner settings (tiers allowed, victim order).
    pub eviction: EvictionConfig,
    /// Tokens per block.
    pub block_size: BlockSize,
}

/// Admission answer for a direct-to-D request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectAdmission {
    /// Admitted; the job append-prefills `cached` tokens short of its input.
    Admitted {
        /// Tokens reused from the resident KV.
        cached: u64,
    },
    /// The session is not resident on that worker.
    NotResident,
    /// No room for the estimated need.
    Rejected,
}

/// Admission answer for a turn a worker serves alone ([`super::Engine::try_local`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalAdmission {
    /// Admitted: the job prefills the prompt but `cached` tokens.
    Started {
        /// Tokens reused from KV the worker holds.
        cached: u64,
    },
    /// Queued in the worker's queue, in order, until the worker has room for it.
    Queued,
    /// Refused: the session is resident there and its append is refused as a direct-to-D
    /// one is, or the prompt does not fit the pool at all.
    Rejected,
}
