//! The block index's speed and size.
//!
//! - `events_apply/store_remove_4096`: one worker (block size 16, pool 100,000 blocks, 20,000
//!   blocks already held) applies 256 `BlockStored` events of 16 chained blocks (4,096 blocks,
//!   tokens hashed into own keys, every event with a `session_id`) then 256 `BlockRemoved`
//!   events naming the same blocks: 8,192 blocks applied per iteration.
//! - `events_overlap/4096_tokens_8_workers`: a 4,096-token request (256 blocks of 16) against
//!   8 workers, each holding 20,000 other blocks and worker `i` the first `32 × (i + 1)` blocks
//!   of the request, so the walk runs the whole chain: keys given, one lookup per block.
//! - `events_overlap/4096_tokens_8_workers_hashed`: the same, hashing the request's tokens
//!   into keys first (what a router does per request).
//!
//! The index's bytes per block (capacity of its tables over blocks held, 8 workers filled to
//! a 10,000-block pool with distinct blocks) is printed and, with the figures `cargo xtask
//! bench` needs, written as JSON to the file named by `KVC_BENCH_OUT`.
//!
//! `KVC_BENCH_SMOKE=1` (a check that the bench runs, not a measurement) shrinks only
//! criterion's bootstrap, to 2,000 resamples: the fixtures take under a second to build even
//! unoptimised, and the ids name their sizes.

use criterion::{Criterion, Throughput};
use kvc_core::{BlockSize, WorkerId};
use kvc_events::{
    BlockKey, BlockRemoved, BlockStored, EngineHash, Event, KeyHasher, KvIndex, WorkerSpec,
    chain_keys,
};
use std::hint::black_box;

const BS: u32 = 16;

/// Whether `KVC_BENCH_SMOKE=1` asks for the smoke run (see the module's docs).
fn smoke() -> bool {
    std::env::var("KVC_BENCH_SMOKE").is_ok_and(|v| v == "1")
}

fn spec(capacity: u32) -> WorkerSpec {
    WorkerSpec {
        block_size: BlockSize::new(BS).unwrap(),
        capacity_blocks: capacity,
    }
}

/// `events` stores of `blocks` chained blocks each, hashes from `first_hash`, tokens from
/// `seed`; the first event has no parent.
fn store_events(first_hash: u64, seed: u32, events: u32, blocks: u32) -> Vec<Event> {
    let mut out = Vec::new();
    let mut parent = None;
    let mut h = first_hash;
    for e in 0..events {
        let hashes: Vec<EngineHash> = (0..blocks).map(|i| EngineHash(h + u64::from(i))).collect();
        let start = seed.wrapping_add(e * blocks * BS);
        let tokens: Vec<u32> = (0..blocks * BS).map(|t| start.wrapping_add(t)).collect();
        out.push(Event::Stored(BlockStored {
            block_hashes: hashes.clone(),
            parent,
            token_ids: tokens,
            block_size: BS,
            session_id: Some(format!("session-{}", e % 8)),
            ..BlockStored::default()
        }));
        parent = hashes.last().copied();
        h += u64::from(blocks);
    }
    out
}

fn fill(idx: &mut KvIndex, w: WorkerId, first_hash: u64, seed: u32, blocks: u32) {
    for e in store_events(first_hash, seed, blocks / 16, 16) {
        idx.apply(w, &e).unwrap();
    }
}

fn apply(c: &mut Criterion) {
    let mut idx = KvIndex::new();
    let w = WorkerId(0);
    idx.add_worker(w, spec(100_000)).unwrap();
    fill(&mut idx, w, 1 << 40, 7_000_000, 20_000);
    let stores = store_events(1, 1_000, 256, 16);
    let removes: Vec<Event> = stores
        .iter()
        .map(|e| match e {
            Event::Stored(s) => Event::Removed(BlockRemoved {
                block_hashes: s.block_hashes.clone(),
                medium: None,
            }),
            other => other.clone(),
        })
        .collect();
    let mut g = c.benchmark_group("events_apply");
    g.throughput(Throughput::Elements(8_192));
    g.bench_function("store_remove_4096", |b| {
        b.iter(|| {
            for e in stores.iter().chain(&removes) {
                black_box(idx.apply(w, e).unwrap());
            }
        })
    });
    g.finish();
}

fn overlap_fixture() -> (KvIndex, Vec<u32>) {
    let mut idx = KvIndex::new();
    let tokens: Vec<u32> = (0..4096).map(|t| t * 7 + 3).collect();
    for i in 0..8u32 {
        let w = WorkerId(i);
        idx.add_worker(w, spec(40_000)).unwrap();
        fill(
            &mut idx,
            w,
            (u64::from(i) + 1) << 40,
            50_000_000 * (i + 1),
            20_000,
        );
        let n = 32 * (i + 1) as usize;
        let hashes: Vec<EngineHash> = (0..n as u64).map(|h| EngineHash(h + 1)).collect();
        let e = Event::Stored(BlockStored {
            block_hashes: hashes,
            parent: None,
            token_ids: tokens[..n * BS as usize].to_vec(),
            block_size: BS,
            ..BlockStored::default()
        });
        assert_eq!(idx.apply(w, &e).unwrap().stored, n as u64);
    }
    (idx, tokens)
}

fn overlap(c: &mut Criterion) {
    let (idx, tokens) = overlap_fixture();
    let keys = chain_keys(&tokens, BS as usize);
    let want: Vec<usize> = (1..=8).map(|i| 32 * i).collect();
    let got: Vec<usize> = idx.overlap(&keys).iter().map(|(_, n)| *n).collect();
    assert_eq!(got, want);
    let mut g = c.benchmark_group("events_overlap");
    g.bench_function("4096_tokens_8_workers", |b| {
        b.iter(|| black_box(idx.overlap(black_box(&keys))))
    });
    let mut hasher = KeyHasher::new();
    let mut scratch: Vec<BlockKey> = Vec::with_capacity(256);
    g.bench_function("4096_tokens_8_workers_hashed", |b| {
        b.iter(|| {
            scratch.clear();
            hasher.chain_into(None, black_box(&tokens), BS as usize, &mut scratch);
            black_box(idx.overlap(&scratch))
        })
    });
    g.finish();
}

/// Bytes per indexed block of 8 workers filled to a 10,000-block pool with distinct blocks.
fn bytes_per_block() -> f64 {
    let mut idx = KvIndex::new();
    for i in 0..8u32 {
        idx.add_worker(WorkerId(i), spec(10_000)).unwrap();
        fill(
            &mut idx,
            WorkerId(i),
            (u64::from(i) + 1) << 40,
            20_000 * i,
            10_000,
        );
    }
    assert_eq!(idx.total_blocks(), 80_000);
    idx.memory_bytes() as f64 / idx.total_blocks() as f64
}

fn main() {
    let bytes = bytes_per_block();
    println!("events_bytes_per_block: {bytes:.2}");
    let c = Criterion::default();
    // Fewer bootstrap resamples in the smoke run: their analysis dominates an unoptimised
    // build's run.
    let c = if smoke() { c.nresamples(2_000) } else { c };
    let mut c = c.configure_from_args();
    apply(&mut c);
    overlap(&mut c);
    c.final_summary();
    // `cargo xtask bench` reads the size from the file named by KVC_BENCH_OUT (the speeds
    // from criterion's own estimates).
    if let Some(path) = std::env::var_os("KVC_BENCH_OUT") {
        std::fs::write(&path, format!("{{\"bytes_per_block\": {bytes:.3}}}\n"))
            .expect("write KVC_BENCH_OUT");
    }
}
