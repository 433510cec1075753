//! Sequence tracking: what to do with each message given the last one applied.
//!
//! Publishers number messages from 0, one by one, and ZeroMQ PUB/SUB delivers them in order
//! and never twice, so the live stream's numbers only go down when a new publisher (a
//! restarted engine) took over. On the live stream:
//! - the next number is applied;
//! - a number already applied is ignored — a repeat, or one a replay already delivered
//!   (live messages queued while a replay ran);
//! - a higher number means a gap: with a replay endpoint, ask for the missing range; without,
//!   the history is lost — reset the worker's index and start over from this message;
//! - a number below the previous *live* one is a restarted publisher: reset, then treat the
//!   message as the first one;
//! - a first message above 0 means the subscriber started late (or the router restarted):
//!   ask for replay from 0 so the index is rebuilt from what the publisher still buffers.
//!
//! Replayed messages (sent by the publisher's replay socket in order, from the first number
//! asked for) are applied when they are the next number, skipped when already applied, and
//! when the first replayed number is above the next one needed, the publisher no longer has
//! the missing history: reset the worker's index, then apply. Live messages held during a
//! replay are then applied in order ([`SeqTracker::on_held`]).

/// What to do with a message from the live stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiveAction {
    /// Apply it.
    Apply,
    /// Ignore it: already applied.
    Ignore,
    /// Hold it, ask the replay endpoint for every message from `from` on, apply the replies
    /// ([`SeqTracker::on_replayed`]), then the held messages.
    Replay {
        /// The first number to ask for.
        from: u64,
        /// Whether the worker's index must be reset first (a restarted publisher).
        reset: bool,
    },
    /// The history before this message is lost: reset the worker's index, then apply it.
    ResetThenApply {
        /// Whether the loss is a publisher restart (a lower number) rather than a gap.
        restart: bool,
    },
}

/// What to do with a message from a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayAction {
    /// Apply it.
    Apply,
    /// Skip it: already applied.
    Skip,
    /// The replay starts after the next number needed: reset the worker's index, then apply.
    ResetThenApply,
}

/// Per worker: the last sequence number applied and the last one seen live.
#[derive(Debug, Clone, Default)]
pub struct SeqTracker {
    last: Option<u64>,
    live: Option<u64>,
}

impl SeqTracker {
    /// A tracker that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// The last number applied, if any.
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// The number that continues the history.
    fn next(&self) -> u64 {
        self.last.map_or(0, |l| l.saturating_add(1))
    }

    /// Classifies a live message and records it as seen. `can_replay`: a replay endpoint is
    /// configured.
    pub fn on_live(&mut self, seq: u64, can_replay: bool) -> LiveAction {
        let backwards = self.live.is_some_and(|l| seq < l);
        self.live = Some(seq);
        match self.last {
            None if seq == 0 || !can_replay => LiveAction::Apply,
            None => LiveAction::Replay {
                from: 0,
                reset: false,
            },
            Some(_) if backwards && (seq == 0 || !can_replay) => {
                LiveAction::ResetThenApply { restart: true }
            }
            Some(_) if backwards => LiveAction::Replay {
                from: 0,
                reset: true,
            },
            Some(last) if seq <= last => LiveAction::Ignore,
            Some(last) if seq == last + 1 => LiveAction::Apply,
            Some(last) if can_replay => LiveAction::Replay {
                from: last + 1,
                reset: false,
            },
            Some(_) => LiveAction::ResetThenApply { restart: false },
        }
    }

    /// Records a live message held while a replay runs (classified later by
    /// [`SeqTracker::on_held`]).
    pub fn hold(&mut self, seq: u64) {
        self.live = Some(seq);
    }

    /// Classifies a live message held during a replay, once the replay ended: applied when
    /// next, ignored when the replay delivered it, and a gap the replay did not close (no
    /// second replay, so a stubborn gap cannot loop) resets the worker.
    pub fn on_held(&self, seq: u64) -> LiveAction {
        match self.last {
            Some(last) if seq <= last => LiveAction::Ignore,
            _ if seq == self.next() || self.last.is_none() => LiveAction::Apply,
            _ => LiveAction::ResetThenApply { restart: false },
        }
    }

    /// Classifies a replayed message.
    pub fn on_replayed(&self, seq: u64) -> ReplayAction {
        let next = self.next();
        if self.last.is_some_and(|l| seq <= l) {
            ReplayAction::Skip
        } else if seq == next {
            ReplayAction::Apply
        } else {
            ReplayAction::ResetThenApply
        }
    }

    /// Records that message `seq` was applied.
    pub fn applied(&mut self, seq: u64) {
        self.last = Some(seq);
    }

    /// Forgets the applied history (the worker's index was reset); the live stream's
    /// position is kept.
    pub fn reset(&mut self) {
        self.last = None;
    }

    /// Forgets everything, the live position too: the connection the numbers came over is
    /// gone, and whoever publishes on the next one (the same engine or a restarted one)
    /// numbers its own way.
    pub fn forget(&mut self) {
        *self = Self::default();
    }
}
