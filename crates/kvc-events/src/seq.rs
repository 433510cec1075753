//! Sequence tracking: what to do with each message given the last one applied.
//!
//! Publishers number messages from 0, one by one. ZeroMQ PUB/SUB never delivers a message
//! twice, so on the live stream:
//! - the next number is applied;
//! - the same number again is ignored (a duplicate);
//! - a higher number means a gap: with a replay endpoint, ask for the missing range; without,
//!   the history is lost — reset the worker's index and start over from this message;
//! - a lower number can only come from a new publisher (the engine restarted): reset, then
//!   treat the message as the first one;
//! - a first message above 0 means the subscriber started late (or the router restarted):
//!   ask for replay from 0 so the index is rebuilt from what the publisher still buffers.
//!
//! Replayed messages (sent by the publisher's replay socket in order, from the first number
//! asked for) are applied when they are the next number, skipped when already applied, and
//! when the first replayed number is above the next one needed, the publisher no longer has
//! the missing history: reset the worker's index, then apply.

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

/// Per worker: the last sequence number applied.
#[derive(Debug, Clone, Default)]
pub struct SeqTracker {
    last: Option<u64>,
}

impl SeqTracker {
    /// A tracker that has applied nothing.
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

    /// Classifies a live message. `can_replay`: a replay endpoint is configured and a replay
    /// may be asked for now (not right after one, so a replay that could not close a gap
    /// leads to a reset, never to a loop).
    pub fn on_live(&self, seq: u64, can_replay: bool) -> LiveAction {
        match self.last {
            None if seq == 0 || !can_replay => LiveAction::Apply,
            None => LiveAction::Replay {
                from: 0,
                reset: false,
            },
            Some(last) if seq == last => LiveAction::Ignore,
            Some(last) if seq == last.saturating_add(1) => LiveAction::Apply,
            Some(last) if seq > last => {
                if can_replay {
                    LiveAction::Replay {
                        from: last + 1,
                        reset: false,
                    }
                } else {
                    LiveAction::ResetThenApply { restart: false }
                }
            }
            // A lower number: a new publisher.
            Some(_) if seq == 0 || !can_replay => LiveAction::ResetThenApply { restart: true },
            Some(_) => LiveAction::Replay {
                from: 0,
                reset: true,
            },
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

    /// Forgets the history (the worker's index was reset).
    pub fn reset(&mut self) {
        self.last = None;
    }
}
