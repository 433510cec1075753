//! Per-worker counters of a subscriber, readable at any time without a lock (for the router's
//! `ListWorkers` and `/metrics`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// Counters of one worker's event stream. Every field only grows, except the gauges
/// `indexed_blocks`, `last_seq` and `connected` (`synced`, once set, stays set).
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub(crate) indexed_blocks: AtomicU64,
    /// `u64::MAX`: nothing applied yet.
    pub(crate) last_seq: AtomicU64,
    /// `u64::MAX`: no batch with a usable timestamp applied yet.
    pub(crate) last_batch_ms: AtomicU64,
    pub(crate) connected: AtomicBool,
    pub(crate) synced: AtomicBool,
    pub(crate) batches: AtomicU64,
    pub(crate) blocks_stored: AtomicU64,
    pub(crate) blocks_removed: AtomicU64,
    pub(crate) cleared: AtomicU64,
    pub(crate) gaps: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) replay_failures: AtomicU64,
    pub(crate) restarts: AtomicU64,
    pub(crate) resets: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) malformed: AtomicU64,
    pub(crate) undecodable: AtomicU64,
    pub(crate) unknown: AtomicU64,
    pub(crate) skipped: AtomicU64,
    pub(crate) invalid: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) connect_failures: AtomicU64,
    pub(crate) other_rank: AtomicU64,
}

/// A copy of [`WorkerStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Blocks the index holds for the worker.
    pub indexed_blocks: u64,
    /// Last sequence number applied; `None` before the first.
    pub last_seq: Option<u64>,
    /// When the engine published the last batch applied (its `ts`, Unix milliseconds on the
    /// engine's clock); `None` before the first. A batch is applied only after every batch
    /// published before it, so everything the engine published until then is in the index.
    pub last_batch_ms: Option<u64>,
    /// Whether the SUB socket is connected (for a stream fed by a router-bound listener,
    /// [`crate::listener`]: whether its task runs).
    pub connected: bool,
    /// Whether the index has caught up with the publisher once: the replay asked for on the
    /// first connection ended (or failed, the index then starting from the live stream), or,
    /// without a replay endpoint, the first connection was made.
    pub synced: bool,
    /// Batches applied.
    pub batches: u64,
    /// Blocks stored (indexed or refreshed).
    pub blocks_stored: u64,
    /// Blocks removed.
    pub blocks_removed: u64,
    /// `AllBlocksCleared` events applied.
    pub cleared: u64,
    /// Gaps seen on the live stream.
    pub gaps: u64,
    /// Replay requests sent.
    pub replays: u64,
    /// Replays that did not finish (unreachable, timed out, malformed replies).
    pub replay_failures: u64,
    /// Publisher restarts seen (the sequence number went back).
    pub restarts: u64,
    /// Times the worker's index was reset because its history was lost (a gap no replay
    /// closed, a publisher restart, the engine disconnected).
    pub resets: u64,
    /// Live messages received twice (ignored).
    pub duplicates: u64,
    /// Messages whose frames were not `[topic, 8-byte seq, payload]` (dropped).
    pub malformed: u64,
    /// Payloads that did not decode (dropped).
    pub undecodable: u64,
    /// Blocks events named that the worker was not known to hold (unknown parents and
    /// unknown removals).
    pub unknown: u64,
    /// Blocks not indexed: another medium than GPU, or a LoRA adapter.
    pub skipped: u64,
    /// Blocks of malformed stores (wrong block size or token count).
    pub invalid: u64,
    /// Entries dropped to keep the worker within its pool size.
    pub dropped: u64,
    /// Failed connection attempts to the event endpoint.
    pub connect_failures: u64,
    /// Batches whose `data_parallel_rank` was not the stream's rank (indexed under the
    /// stream's rank all the same).
    pub other_rank: u64,
}

impl StatsSnapshot {
    /// One worker's counters over its data-parallel ranks' streams: counts and indexed
    /// blocks summed, `connected` and `synced` only when every stream is, `last_seq` the
    /// highest of those applied (each stream numbers its own; read a rank's own for its
    /// position). `None` for no stream.
    pub fn merged(ranks: impl IntoIterator<Item = StatsSnapshot>) -> Option<StatsSnapshot> {
        ranks.into_iter().reduce(|a, b| StatsSnapshot {
            indexed_blocks: a.indexed_blocks + b.indexed_blocks,
            last_seq: a.last_seq.max(b.last_seq),
            // The stream furthest behind: `None` (before Some) while one has applied nothing.
            last_batch_ms: a.last_batch_ms.min(b.last_batch_ms),
            connected: a.connected && b.connected,
            synced: a.synced && b.synced,
            batches: a.batches + b.batches,
            blocks_stored: a.blocks_stored + b.blocks_stored,
            blocks_removed: a.blocks_removed + b.blocks_removed,
            cleared: a.cleared + b.cleared,
            gaps: a.gaps + b.gaps,
            replays: a.replays + b.replays,
            replay_failures: a.replay_failures + b.replay_failures,
            restarts: a.restarts + b.restarts,
            resets: a.resets + b.resets,
            duplicates: a.duplicates + b.duplicates,
            malformed: a.malformed + b.malformed,
            undecodable: a.undecodable + b.undecodable,
            unknown: a.unknown + b.unknown,
            skipped: a.skipped + b.skipped,
            invalid: a.invalid + b.invalid,
            dropped: a.dropped + b.dropped,
            connect_failures: a.connect_failures + b.connect_failures,
            other_rank: a.other_rank + b.other_rank,
        })
    }
}

impl WorkerStats {
    /// Fresh counters (nothing applied yet).
    pub fn new() -> Self {
        WorkerStats {
            last_seq: AtomicU64::new(u64::MAX),
            last_batch_ms: AtomicU64::new(u64::MAX),
            ..Self::default()
        }
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let last = self.last_seq.load(Relaxed);
        let batch_ms = self.last_batch_ms.load(Relaxed);
        StatsSnapshot {
            indexed_blocks: self.indexed_blocks.load(Relaxed),
            last_seq: (last != u64::MAX).then_some(last),
            last_batch_ms: (batch_ms != u64::MAX).then_some(batch_ms),
            connected: self.connected.load(Relaxed),
            synced: self.synced.load(Relaxed),
            batches: self.batches.load(Relaxed),
            blocks_stored: self.blocks_stored.load(Relaxed),
            blocks_removed: self.blocks_removed.load(Relaxed),
            cleared: self.cleared.load(Relaxed),
            gaps: self.gaps.load(Relaxed),
            replays: self.replays.load(Relaxed),
            replay_failures: self.replay_failures.load(Relaxed),
            restarts: self.restarts.load(Relaxed),
            resets: self.resets.load(Relaxed),
            duplicates: self.duplicates.load(Relaxed),
            malformed: self.malformed.load(Relaxed),
            undecodable: self.undecodable.load(Relaxed),
            unknown: self.unknown.load(Relaxed),
            skipped: self.skipped.load(Relaxed),
            invalid: self.invalid.load(Relaxed),
            dropped: self.dropped.load(Relaxed),
            connect_failures: self.connect_failures.load(Relaxed),
            other_rank: self.other_rank.load(Relaxed),
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        if n > 0 {
            counter.fetch_add(n, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_merge_into_one_worker() {
        let a = StatsSnapshot {
            indexed_blocks: 3,
            last_seq: Some(9),
            connected: true,
            synced: true,
            gaps: 1,
            ..StatsSnapshot::default()
        };
        let b = StatsSnapshot {
            indexed_blocks: 4,
            last_seq: None,
            connected: true,
            synced: false,
            gaps: 2,
            other_rank: 1,
            ..StatsSnapshot::default()
        };
        let m = StatsSnapshot::merged([a, b]).unwrap();
        assert_eq!(
            (
                m.indexed_blocks,
                m.last_seq,
                m.connected,
                m.synced,
                m.gaps,
                m.other_rank
            ),
            (7, Some(9), true, false, 3, 1)
        );
        assert_eq!(StatsSnapshot::merged([a]), Some(a));
        assert_eq!(StatsSnapshot::merged([]), None);
        // A worker's events have caught up only as far as its slowest rank's.
        let at = |ms| StatsSnapshot {
            last_batch_ms: ms,
            ..StatsSnapshot::default()
        };
        let merged = |x, y| StatsSnapshot::merged([at(x), at(y)]).unwrap().last_batch_ms;
        assert_eq!(merged(Some(7), Some(5)), Some(5));
        assert_eq!(merged(Some(7), None), None);
    }
}
