//! Shared by the loopback tests: an engine-like stream of batches, the index a lossless run
//! builds from it, and bounded waits on a subscriber's counters.
#![allow(dead_code)]

use kvc_core::{BlockSize, SessionId, WorkerId};
use kvc_events::{
    BlockRemoved, BlockStored, EngineHash, Event, EventBatch, KvIndex, Publisher, StatsSnapshot,
    WorkerSpec, WorkerStats,
};
use std::time::{Duration, Instant};

pub(crate) const W: WorkerId = WorkerId(3);
pub(crate) const BS: u32 = 4;

pub(crate) fn spec() -> WorkerSpec {
    WorkerSpec {
        block_size: BlockSize::new(BS).unwrap(),
        capacity_blocks: 10_000,
    }
}

/// `n` batches as an engine with four concurrent sessions would publish them: each batch
/// extends one session by two chained blocks (a session starts a new chain every few
/// batches), every fifth batch also evicts the two oldest blocks of a session.
pub(crate) fn engine_batches(n: usize) -> Vec<EventBatch> {
    let mut chains: Vec<Vec<u64>> = vec![Vec::new(); 4];
    let mut generation = [0u32; 4];
    let mut next_hash = 1000u64;
    (0..n)
        .map(|i| {
            let s = i % 4;
            if i % 7 == s {
                chains[s].clear();
                generation[s] += 1;
            }
            let parent = chains[s].last().copied().map(EngineHash);
            let hashes = [next_hash, next_hash + 1];
            next_hash += 2;
            let token_ids: Vec<u32> = hashes
                .iter()
                .flat_map(|h| (0..BS).map(move |t| (*h as u32) * 31 + t))
                .collect();
            let mut events = vec![Event::Stored(BlockStored {
                block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
                parent,
                token_ids,
                block_size: BS,
                medium: Some(kvc_events::Medium::Gpu),
                session_id: Some(session_key(s, generation[s])),
                ..BlockStored::default()
            })];
            chains[s].extend(hashes);
            if i % 5 == 4 {
                let victim = &mut chains[(i / 5) % 4];
                if victim.len() > 2 {
                    let gone: Vec<u64> = victim.drain(..2).collect();
                    events.push(Event::Removed(BlockRemoved {
                        block_hashes: gone.into_iter().map(EngineHash).collect(),
                        medium: Some(kvc_events::Medium::Gpu),
                    }));
                }
            }
            EventBatch {
                ts: i as f64,
                events,
                dp_rank: Some(0),
            }
        })
        .collect()
}

pub(crate) fn session_key(s: usize, generation: u32) -> String {
    format!("session-{s}-{generation}")
}

/// The index a lossless subscriber builds from `batches`.
pub(crate) fn reference(batches: &[EventBatch]) -> KvIndex {
    let mut idx = KvIndex::new();
    idx.add_worker(W, spec()).unwrap();
    for b in batches {
        for e in &b.events {
            idx.apply(W, e).unwrap();
        }
    }
    idx
}

/// Asserts two indexes hold exactly the same blocks and session residency for `W`.
pub(crate) fn assert_same_index(got: &KvIndex, want: &KvIndex) {
    assert_eq!(got.worker_blocks(W), want.worker_blocks(W), "blocks differ");
    for s in 0..4 {
        for generation in 0..64 {
            let id = SessionId::from_key(&session_key(s, generation));
            assert_eq!(
                got.session_residency(id),
                want.session_residency(id),
                "residency of {}",
                session_key(s, generation)
            );
        }
    }
    assert_eq!(got.sessions(), want.sessions());
}

/// Waits (at most 20 s, polling) until `pred` holds for the counters; panics otherwise.
pub(crate) async fn wait_until(
    what: &str,
    stats: &WorkerStats,
    pred: impl Fn(&StatsSnapshot) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = stats.snapshot();
        if pred(&s) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: gave up waiting; stats {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Publishes `batches[*cursor..]` one at a time until the subscriber has applied the last
/// one published (its subscription is then live: PUB drops messages for subscriptions it
/// has not seen yet). Bounded by the batches available and 200 ms per batch.
pub(crate) async fn publish_until_in_sync(
    publisher: &Publisher,
    stats: &WorkerStats,
    batches: &[EventBatch],
    cursor: &mut usize,
) {
    loop {
        assert!(
            *cursor < batches.len(),
            "the subscriber never caught up: {:?}",
            stats.snapshot()
        );
        let seq = publisher.publish(&batches[*cursor]).await.unwrap();
        *cursor += 1;
        for _ in 0..20 {
            if stats.snapshot().last_seq == Some(seq) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
