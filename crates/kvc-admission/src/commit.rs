//! The commit_evict queue: a bounded channel of commands to the single writer, each with a reply.
//!
//! Callers [`submit`](CommitSender::submit) a [`CommitRequest`] and
//! [`wait`](PendingReply::wait) for the [`CommitReply`] with a timeout. The owner (the worker's
//! scheduler) drains the queue at its step boundary without blocking
//! ([`drain`](CommitReceiver::drain) or [`try_recv`](CommitReceiver::try_recv) and
//! [`CommitJob::answer`] after its step). A full queue answers at once with
//! [`CommitError::Busy`] and a pause hint; a dropped owner gives [`CommitError::OwnerGone`].
//! Plain `std` (a `sync_channel` and a `Mutex` + `Condvar` reply slot): no async runtime needed;
//! an async caller waits in a blocking task.

use crate::backpressure::recommended_pause_ms;
use crate::planner::EvictionPlan;
use kvc_core::SessionId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Make room for `need_tokens` (evicting if needed) for `session`'s next turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitRequest {
    /// Tokens that must be free for the request.
    pub need_tokens: u64,
    /// The requesting session (never evicted for its own request).
    pub session: Option<SessionId>,
}

/// The owner's answer to a [`CommitRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitReply {
    /// Whether the room was made (and reserved) for the request.
    pub admitted: bool,
    /// Tokens freed by evictions.
    pub freed_tokens: u64,
    /// Sessions evicted, in order.
    pub evicted: Vec<SessionId>,
    /// How long the caller should hold back before its next request to this worker.
    pub recommended_pause_ms: u32,
}

impl CommitReply {
    /// A refusal that evicted nothing.
    pub fn rejected(recommended_pause_ms: u32) -> Self {
        CommitReply {
            admitted: false,
            freed_tokens: 0,
            evicted: Vec::new(),
            recommended_pause_ms,
        }
    }

    /// The reply for an eviction plan the owner applied when it was satisfied (and discarded
    /// otherwise): admitted with the plan's victims, or rejected with no eviction.
    pub fn from_plan(plan: &EvictionPlan, recommended_pause_ms: u32) -> Self {
        if plan.satisfied {
            CommitReply {
                admitted: true,
                freed_tokens: plan.freed_tokens,
                evicted: plan.sessions(),
                recommended_pause_ms,
            }
        } else {
            CommitReply::rejected(recommended_pause_ms)
        }
    }
}

/// Why a commit got no reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CommitError {
    /// The queue is full; try again after the pause.
    #[error("commit queue full; retry in {recommended_pause_ms} ms")]
    Busy {
        /// [`recommended_pause_ms`] of the queue capacity and the owner's last used fraction.
        recommended_pause_ms: u32,
    },
    /// The owner dropped the queue (or the request) without answering.
    #[error("the queue owner is gone")]
    OwnerGone,
    /// No reply within the timeout.
    #[error("no reply within the timeout")]
    Timeout,
}

/// The reply slot shared by a caller and the owner.
#[derive(Debug)]
struct ReplySlot {
    state: Mutex<ReplyState>,
    ready: Condvar,
}

#[derive(Debug)]
enum ReplyState {
    Waiting,
    Ready(CommitReply),
    Abandoned,
}

impl ReplySlot {
    fn lock(&self) -> MutexGuard<'_, ReplyState> {
        // The critical sections cannot panic half-way; a poisoned lock still holds a valid state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn settle(&self, state: ReplyState) {
        let mut guard = self.lock();
        if matches!(*guard, ReplyState::Waiting) {
            *guard = state;
        }
        drop(guard);
        self.ready.notify_all();
    }
}

/// State shared by all senders and the receiver.
#[derive(Debug)]
struct Shared {
    capacity: usize,
    used_fraction_bits: AtomicU64,
}

/// A bounded commit queue of `capacity` commands (at least 1).
///
/// ```
/// use kvc_admission::{commit_queue, CommitReply, CommitRequest, CommitError};
/// use std::time::Duration;
///
/// let (tx, mut owner) = commit_queue(1);
/// let pending = tx.submit(CommitRequest { need_tokens: 100, session: None }).unwrap();
/// // The queue is full now: backpressure, not growth.
/// assert!(matches!(tx.submit(CommitRequest { need_tokens: 1, session: None }),
///                  Err(CommitError::Busy { .. })));
/// // The owner drains at its step boundary.
/// assert_eq!(owner.drain(|req| CommitReply {
///     admitted: req.need_tokens <= 500, freed_tokens: 0, evicted: vec![], recommended_pause_ms: 0,
/// }), 1);
/// assert!(pending.wait(Duration::from_secs(1)).unwrap().admitted);
/// ```
pub fn commit_queue(capacity: usize) -> (CommitSender, CommitReceiver) {
    let capacity = capacity.max(1);
    let (tx, rx) = std::sync::mpsc::sync_channel(capacity);
    let shared = Arc::new(Shared {
        capacity,
        used_fraction_bits: AtomicU64::new(0f64.to_bits()),
    });
    (
        CommitSender {
            tx,
            shared: Arc::clone(&shared),
        },
        CommitReceiver { rx, shared },
    )
}

/// One queued command: the request and where its answer goes.
struct Envelope {
    request: CommitRequest,
    reply: ReplyTo,
}

/// The owner's side of a reply slot; dropping it unanswered wakes the caller with
/// [`CommitError::OwnerGone`].
#[derive(Debug)]
struct ReplyTo(Arc<ReplySlot>);

impl Drop for ReplyTo {
    fn drop(&mut self) {
        self.0.settle(ReplyState::Abandoned);
    }
}

/// The submitting side of a commit queue. Cheap to clone; `Send + Sync`.
#[derive(Debug, Clone)]
pub struct CommitSender {
    tx: SyncSender<Envelope>,
    shared: Arc<Shared>,
}

impl CommitSender {
    /// Queues `request` without blocking. A full queue gives [`CommitError::Busy`] at once; a
    /// dropped owner gives [`CommitError::OwnerGone`].
    pub fn submit(&self, request: CommitRequest) -> Result<PendingReply, CommitError> {
        let slot = Arc::new(ReplySlot {
            state: Mutex::new(ReplyState::Waiting),
            ready: Condvar::new(),
        });
        let envelope = Envelope {
            request,
            reply: ReplyTo(Arc::clone(&slot)),
        };
        match self.tx.try_send(envelope) {
            Ok(()) => Ok(PendingReply { slot }),
            Err(TrySendError::Full(_)) => Err(CommitError::Busy {
                recommended_pause_ms: self.busy_pause_ms(),
            }),
            Err(TrySendError::Disconnected(_)) => Err(CommitError::OwnerGone),
        }
    }

    /// The pause a busy reply carries: [`recommended_pause_ms`] of the queue capacity (a full
    /// queue) and the used fraction the owner last reported.
    pub fn busy_pause_ms(&self) -> u32 {
        let used = f64::from_bits(self.shared.used_fraction_bits.load(Ordering::Relaxed));
        recommended_pause_ms(self.shared.capacity as u64, used)
    }

    /// The queue capacity.
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }
}

/// A reply to come.
#[derive(Debug)]
pub struct PendingReply {
    slot: Arc<ReplySlot>,
}

impl PendingReply {
    /// Waits at most `timeout` for the reply. [`CommitError::OwnerGone`] as soon as the owner
    /// drops the request unanswered; [`CommitError::Timeout`] when time runs out (the request
    /// may still be executed later).
    pub fn wait(self, timeout: Duration) -> Result<CommitReply, CommitError> {
        let guard = self.slot.lock();
        let (mut guard, _) = self
            .slot
            .ready
            .wait_timeout_while(guard, timeout, |s| matches!(s, ReplyState::Waiting))
            .unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(&mut *guard, ReplyState::Abandoned) {
            ReplyState::Ready(reply) => Ok(reply),
            ReplyState::Abandoned => Err(CommitError::OwnerGone),
            ReplyState::Waiting => {
                *guard = ReplyState::Waiting;
                Err(CommitError::Timeout)
            }
        }
    }

    /// Whether the reply (or the owner's departure) has arrived, so [`wait`](Self::wait)
    /// would return at once.
    pub fn is_ready(&self) -> bool {
        !matches!(*self.slot.lock(), ReplyState::Waiting)
    }
}

/// A command taken from the queue, to answer after the owner's step.
#[derive(Debug)]
pub struct CommitJob {
    request: CommitRequest,
    reply: ReplyTo,
}

impl CommitJob {
    /// The request.
    pub fn request(&self) -> &CommitRequest {
        &self.request
    }

    /// Sends the reply and wakes the caller. Dropping the job unanswered gives the caller
    /// [`CommitError::OwnerGone`].
    pub fn answer(self, reply: CommitReply) {
        self.reply.0.settle(ReplyState::Ready(reply));
    }
}

/// The owner's side of a commit queue (the single writer).
#[derive(Debug)]
pub struct CommitReceiver {
    rx: Receiver<Envelope>,
    shared: Arc<Shared>,
}

impl CommitReceiver {
    /// Takes the next queued command, if any, without blocking.
    pub fn try_recv(&mut self) -> Option<CommitJob> {
        match self.rx.try_recv() {
            Ok(e) => Some(CommitJob {
                request: e.request,
                reply: e.reply,
            }),
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => None,
        }
    }

    /// Answers queued commands with `f`, without blocking: at most the queue capacity per call
    /// (so a stream of new commands cannot hold the owner). Returns how many were answered.
    pub fn drain(&mut self, f: impl FnMut(&CommitRequest) -> CommitReply) -> usize {
        self.drain_at_most(self.shared.capacity, f)
    }

    /// Like [`drain`](Self::drain), but first waits up to `timeout` for a command when the
    /// queue is empty (for an owner with nothing else to do).
    pub fn drain_wait(
        &mut self,
        timeout: Duration,
        mut f: impl FnMut(&CommitRequest) -> CommitReply,
    ) -> usize {
        match self.rx.recv_timeout(timeout) {
            Ok(e) => {
                let reply = f(&e.request);
                CommitJob {
                    request: e.request,
                    reply: e.reply,
                }
                .answer(reply);
                1 + self.drain_at_most(self.shared.capacity - 1, f)
            }
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => 0,
        }
    }

    fn drain_at_most(
        &mut self,
        max: usize,
        mut f: impl FnMut(&CommitRequest) -> CommitReply,
    ) -> usize {
        let mut answered = 0;
        while answered < max {
            let Some(job) = self.try_recv() else { break };
            let reply = f(job.request());
            job.answer(reply);
            answered += 1;
        }
        answered
    }

    /// Reports the pool's used fraction, which busy replies use for their pause hint.
    pub fn set_used_fraction(&self, used_fraction: f64) {
        self.shared
            .used_fraction_bits
            .store(used_fraction.to_bits(), Ordering::Relaxed);
    }

    /// The queue capacity.
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;
    use std::time::Instant;

    fn req(need: u64) -> CommitRequest {
        CommitRequest {
            need_tokens: need,
            session: Some(SessionId(need)),
        }
    }

    fn ok(req: &CommitRequest) -> CommitReply {
        CommitReply {
            admitted: true,
            freed_tokens: req.need_tokens,
            evicted: vec![SessionId(7)],
            recommended_pause_ms: 0,
        }
    }

    #[test]
    fn round_trip_in_order() {
        let (tx, mut rx) = commit_queue(4);
        let p1 = tx.submit(req(1)).unwrap();
        let p2 = tx.submit(req(2)).unwrap();
        assert!(!p1.is_ready());
        let mut seen = Vec::new();
        assert_eq!(
            rx.drain(|r| {
                seen.push(r.need_tokens);
                ok(r)
            }),
            2
        );
        assert_eq!(seen, [1, 2]);
        assert!(p2.is_ready());
        assert_eq!(p2.wait(Duration::ZERO).unwrap().freed_tokens, 2);
        assert_eq!(p1.wait(Duration::ZERO).unwrap().evicted, [SessionId(7)]);
        assert_eq!(rx.drain(ok), 0);
    }

    #[test]
    fn full_queue_is_busy_with_pause_hint() {
        let (tx, rx) = commit_queue(2);
        let _a = tx.submit(req(1)).unwrap();
        let _b = tx.submit(req(2)).unwrap();
        // 2 queued × 5 ms, no pressure reported.
        assert_eq!(
            tx.submit(req(3)).unwrap_err(),
            CommitError::Busy {
                recommended_pause_ms: 10
            }
        );
        rx.set_used_fraction(1.0);
        assert_eq!(
            tx.clone().submit(req(3)).unwrap_err(),
            CommitError::Busy {
                recommended_pause_ms: recommended_pause_ms(2, 1.0)
            }
        );
        assert_eq!(tx.busy_pause_ms(), 260);
    }

    #[test]
    fn capacity_zero_means_one() {
        let (tx, rx) = commit_queue(0);
        assert_eq!(tx.capacity(), 1);
        assert_eq!(rx.capacity(), 1);
        let _a = tx.submit(req(1)).unwrap();
        assert!(matches!(tx.submit(req(2)), Err(CommitError::Busy { .. })));
    }

    #[test]
    fn dropped_owner_is_an_error_not_a_hang() {
        let (tx, rx) = commit_queue(2);
        let pending = tx.submit(req(1)).unwrap();
        drop(rx);
        let start = Instant::now();
        assert_eq!(
            pending.wait(Duration::from_secs(30)),
            Err(CommitError::OwnerGone)
        );
        assert!(start.elapsed() < Duration::from_secs(30));
        assert_eq!(tx.submit(req(2)).unwrap_err(), CommitError::OwnerGone);
    }

    #[test]
    fn owner_dropped_while_caller_waits() {
        let (tx, rx) = commit_queue(2);
        let pending = tx.submit(req(1)).unwrap();
        let waiter = thread::spawn(move || pending.wait(Duration::from_secs(30)));
        thread::sleep(Duration::from_millis(20));
        drop(rx);
        assert_eq!(waiter.join().unwrap(), Err(CommitError::OwnerGone));
    }

    #[test]
    fn unanswered_job_is_owner_gone() {
        let (tx, mut rx) = commit_queue(2);
        let pending = tx.submit(req(1)).unwrap();
        let job = rx.try_recv().unwrap();
        assert_eq!(job.request().need_tokens, 1);
        drop(job);
        assert_eq!(pending.wait(Duration::ZERO), Err(CommitError::OwnerGone));
    }

    #[test]
    fn timeout_when_owner_is_slow() {
        let (tx, mut rx) = commit_queue(2);
        let pending = tx.submit(req(1)).unwrap();
        assert_eq!(
            pending.wait(Duration::from_millis(10)),
            Err(CommitError::Timeout)
        );
        // The owner can still run it later; nobody is waiting any more.
        assert_eq!(rx.drain(ok), 1);
    }

    #[test]
    fn answer_after_step_from_another_thread() {
        let (tx, mut rx) = commit_queue(8);
        let owner = thread::spawn(move || {
            let mut answered = 0;
            while answered < 3 {
                // Collect, "run the step", then answer.
                let mut jobs = Vec::new();
                while let Some(j) = rx.try_recv() {
                    jobs.push(j);
                }
                for j in jobs {
                    let reply = ok(j.request());
                    j.answer(reply);
                    answered += 1;
                }
                thread::yield_now();
            }
        });
        let replies: Vec<_> = (1..=3)
            .map(|n| tx.submit(req(n)).unwrap())
            .map(|p| p.wait(Duration::from_secs(30)).unwrap().freed_tokens)
            .collect();
        assert_eq!(replies, [1, 2, 3]);
        owner.join().unwrap();
    }

    #[test]
    fn drain_wait_blocks_until_work_or_timeout() {
        let (tx, mut rx) = commit_queue(4);
        assert_eq!(rx.drain_wait(Duration::from_millis(5), ok), 0);
        let sender = thread::spawn(move || {
            let p = tx.submit(req(9)).unwrap();
            p.wait(Duration::from_secs(30)).unwrap()
        });
        let mut n = 0;
        while n == 0 {
            n = rx.drain_wait(Duration::from_secs(30), ok);
        }
        assert_eq!(n, 1);
        assert_eq!(sender.join().unwrap().freed_tokens, 9);
    }

    #[test]
    fn drain_is_bounded_by_capacity() {
        let (tx, mut rx) = commit_queue(2);
        let _a = tx.submit(req(1)).unwrap();
        let _b = tx.submit(req(2)).unwrap();
        let mut calls = 0;
        let n = rx.drain(|r| {
            calls += 1;
            // A new command arriving while draining waits for the next drain.
            let _ = tx.submit(req(r.need_tokens + 10));
            ok(r)
        });
        assert_eq!(n, 2);
        assert_eq!(calls, 2);
        assert_eq!(rx.drain(ok), 2);
    }

    #[test]
    fn reply_from_plan() {
        use crate::planner::{Tier, Victim};
        let plan = EvictionPlan {
            victims: vec![Victim {
                session: SessionId(4),
                tokens: 10,
                tier: Tier::Idle,
            }],
            freed_tokens: 10,
            satisfied: true,
        };
        let r = CommitReply::from_plan(&plan, 3);
        assert!(r.admitted);
        assert_eq!(r.evicted, [SessionId(4)]);
        assert_eq!(r.freed_tokens, 10);
        let unsatisfied = EvictionPlan {
            satisfied: false,
            ..plan
        };
        assert_eq!(
            CommitReply::from_plan(&unsatisfied, 3),
            CommitReply::rejected(3)
        );
    }
}
