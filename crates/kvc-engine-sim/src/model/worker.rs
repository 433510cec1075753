//! What the model keeps per worker and per job in flight: residents, stages, iterations.

use super::cache::PrefixCache;
use super::types::{Job, Micros};
use kvc_core::{HashIds, SessionId, WorkerId};
use std::collections::{BTreeMap, VecDeque};

#[derive(Debug, Clone)]
pub(super) struct ResidentEntry {
    pub(super) tokens: u64,
    pub(super) hashes: HashIds,
    pub(super) last_access: Micros,
    /// A job of the session holds this KV on the worker (transfer, prefill or decode).
    pub(super) running: bool,
    /// A request of the session is in flight elsewhere (on P, in the transfer queue):
    /// `pin_in_flight` keeps the KV out of idle-only eviction meanwhile.
    pub(super) pending: bool,
    /// Room preallocated for a transfer that has not arrived yet (the request is queued or
    /// prefilling on P, or on the wire): no eviction tier can take it back.
    pub(super) prealloc: bool,
}

impl ResidentEntry {
    /// `tokens` of a session (block ids `hashes`) that a job of it holds from `now` on.
    pub(super) fn running(tokens: u64, hashes: HashIds, now: Micros) -> Self {
        ResidentEntry {
            tokens,
            hashes,
            last_access: now,
            running: true,
            pending: false,
            prealloc: false,
        }
    }

    /// Evictable by idle-only eviction.
    pub(super) fn idle(&self) -> bool {
        !self.running && !self.pending
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// Waiting for pool room on its prefill or colocated worker.
    WaitingPool,
    /// In a prefill queue.
    Prefill,
    /// Prefilled on P, waiting for room on D.
    WaitingD,
    /// KV on its way to D.
    Transfer,
    /// Decoding.
    Decode,
    /// Retracted from a decode worker for want of room: waits there to recompute its context.
    Retracted,
    /// A turn its worker serves alone, waiting in that worker's queue for room (behind the
    /// transfers and turns that came first).
    WaitingLocal,
}

#[derive(Debug, Clone)]
pub(super) struct Active {
    pub(super) job: Job,
    /// Prefill worker (P→D path) or the worker that prefills (D for direct, DP).
    pub(super) prefill_on: WorkerId,
    pub(super) decode_on: WorkerId,
    pub(super) stage: Stage,
    pub(super) remaining: u64,
    pub(super) done_ctx: u64,
    pub(super) generated: u64,
    /// Blocks pinned on the prefill/colocated worker's cache.
    pub(super) pinned: usize,
    /// Extra (non-block) tokens reserved on the prefill/colocated worker.
    pub(super) extra: u64,
    pub(super) cached: u64,
    /// When waiting for room on D (transfer or retracted) fails.
    pub(super) deadline: Micros,
    /// When the KV transfer in progress ends.
    pub(super) transfer_end: Micros,
    /// Times retracted.
    pub(super) retractions: u32,
    /// Bumped by every retraction, so the work of an iteration that started before it is
    /// not applied after it.
    pub(super) epoch: u32,
    /// Tokens of its KV a decode-only worker copied to its host pool when it retracted the
    /// job; loaded back, not recomputed, when the job is readmitted.
    pub(super) backup: u64,
}

impl Active {
    /// A job at `stage`, prefilling on `prefill_on` and decoding on `decode_on`, with nothing
    /// done, reserved or pending yet.
    pub(super) fn new(job: Job, prefill_on: WorkerId, decode_on: WorkerId, stage: Stage) -> Self {
        Active {
            job,
            prefill_on,
            decode_on,
            stage,
            remaining: 0,
            done_ctx: 0,
            generated: 0,
            pinned: 0,
            extra: 0,
            cached: 0,
            deadline: 0,
            transfer_end: 0,
            retractions: 0,
            epoch: 0,
            backup: 0,
        }
    }
}

/// What one running iteration of a worker carries.
#[derive(Debug, Default)]
pub(super) struct Iteration {
    /// Prefill chunks: (job, tokens, job epoch).
    pub(super) prefill: Vec<(usize, u64, u32)>,
    /// Jobs that get one decode step: (job, job epoch).
    pub(super) decode: Vec<(usize, u32)>,
}

#[derive(Debug)]
pub(super) struct Worker {
    /// Sessions stay resident here between turns (a decode worker, or a worker that serves
    /// turns alone); its pool holds them beside the prefix cache of the prefills it runs for
    /// other workers.
    pub(super) hosts: bool,
    pub(super) capacity: u64,
    pub(super) cache: PrefixCache,
    pub(super) cache_extra: u64,
    pub(super) residents: BTreeMap<SessionId, ResidentEntry>,
    pub(super) resident_tokens: u64,
    pub(super) idle_tokens: u64,
    pub(super) prefill_q: VecDeque<usize>,
    pub(super) waiting: VecDeque<usize>,
    pub(super) running: Vec<usize>,
    pub(super) iteration: Option<Iteration>,
    /// Set while an iteration's results are applied: no new iteration starts before that ends.
    pub(super) settling: bool,
    pub(super) link_free: Micros,
    /// Share of the decode reserve counted for each request already active here when another
    /// is admitted (SGLang's `new_token_ratio`): decays per decode step, reset by a retraction.
    pub(super) token_ratio: f64,
    /// The worker can prefill (for others, or a turn alone), so it recomputes a retracted
    /// request's context; a decode-only worker backs the KV up to its host pool instead.
    pub(super) recomputes: bool,
    /// Tokens of retracted requests' KV held in the host pool of a decode-only worker.
    pub(super) host_backup: u64,
}

impl Worker {
    /// Whether running job `a` (of a session resident here, if it is) has room for the token
    /// its next decode step writes without growing its session: no resident entry, the token
    /// already allocated, or the session already at its full size.
    pub(super) fn has_room_for_step(&self, a: &Active) -> bool {
        let full = (a.job.input + a.job.output).min(self.capacity);
        self.residents
            .get(&a.job.session)
            .is_none_or(|r| Self::step_fits(a, r.tokens, full))
    }

    /// Whether job `a`'s next token fits the `allowed` tokens its session holds, given the
    /// `full` size the session may grow to.
    pub(super) fn step_fits(a: &Active, allowed: u64, full: u64) -> bool {
        a.job.input + a.generated < allowed || allowed >= full
    }
}
