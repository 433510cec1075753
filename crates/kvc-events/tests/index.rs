//! The block index: chaining, parents, removals, unknown blocks, the bound and its
//! oldest-first drop, session residency, clearing, overlap across workers, memory per block.

use kvc_core::{BlockSize, SessionId, WorkerId};
use kvc_events::{
    ApplyOutcome, BlockKey, BlockRemoved, BlockStored, EngineHash, Event, IndexError, KvIndex,
    Medium, WorkerOverlap, WorkerSpec, chain_keys,
};

fn spec(bs: u32, cap: u32) -> WorkerSpec {
    WorkerSpec {
        block_size: BlockSize::new(bs).unwrap(),
        capacity_blocks: cap,
    }
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> Event {
    Event::Stored(BlockStored {
        block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
        parent: parent.map(EngineHash),
        token_ids: tokens.to_vec(),
        block_size: bs,
        ..BlockStored::default()
    })
}

fn with_session(e: Event, session: &str) -> Event {
    match e {
        Event::Stored(mut s) => {
            s.session_id = Some(session.into());
            Event::Stored(s)
        }
        other => other,
    }
}

fn removed(hashes: &[u64]) -> Event {
    Event::Removed(BlockRemoved {
        block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
        medium: None,
    })
}

const W1: WorkerId = WorkerId(1);
const W2: WorkerId = WorkerId(2);
const W3: WorkerId = WorkerId(3);

fn index(workers: &[WorkerId], bs: u32, cap: u32) -> KvIndex {
    let mut idx = KvIndex::new();
    for w in workers {
        idx.add_worker(*w, spec(bs, cap)).unwrap();
    }
    idx
}

#[test]
fn stores_chain_from_their_parent_to_the_request_keys() {
    let mut idx = index(&[W1], 2, 100);
    let tokens: Vec<u32> = (10..18).collect();
    let a = idx
        .apply(W1, &stored(&[101, 102], None, &tokens[..4], 2))
        .unwrap();
    assert_eq!(a.stored, 2);
    let b = idx
        .apply(W1, &stored(&[103, 104], Some(102), &tokens[4..], 2))
        .unwrap();
    assert_eq!(
        b,
        ApplyOutcome {
            stored: 2,
            ..ApplyOutcome::default()
        }
    );
    let keys = chain_keys(&tokens, 2);
    let mut want: Vec<(EngineHash, BlockKey)> = [101, 102, 103, 104]
        .iter()
        .map(|h| EngineHash(*h))
        .zip(keys.iter().copied())
        .collect();
    want.sort();
    assert_eq!(idx.worker_blocks(W1), want);
    assert_eq!(idx.overlap(&keys), vec![(W1, 4)]);
    // A request diverging in its third block matches two.
    let mut other = tokens.clone();
    other[5] = 999;
    assert_eq!(idx.overlap(&chain_keys(&other, 2)), vec![(W1, 2)]);
    assert_eq!(idx.indexed_blocks(W1), 4);
}

#[test]
fn unknown_parents_and_removals_are_counted_and_change_nothing() {
    let mut idx = index(&[W1], 2, 100);
    let o = idx
        .apply(W1, &stored(&[5, 6], Some(77), &[1, 2, 3, 4], 2))
        .unwrap();
    assert_eq!(
        o,
        ApplyOutcome {
            unknown_parent: 2,
            ..ApplyOutcome::default()
        }
    );
    assert_eq!(o.unknown(), 2);
    assert_eq!(idx.indexed_blocks(W1), 0);
    idx.apply(W1, &stored(&[1], None, &[1, 2], 2)).unwrap();
    let o = idx.apply(W1, &removed(&[1, 9, 10])).unwrap();
    assert_eq!(
        o,
        ApplyOutcome {
            removed: 1,
            unknown_removal: 2,
            ..ApplyOutcome::default()
        }
    );
    assert_eq!(idx.indexed_blocks(W1), 0);
    assert_eq!(idx.overlap(&chain_keys(&[1, 2], 2)), vec![(W1, 0)]);
}

#[test]
fn removal_of_a_middle_block_cuts_the_prefix_there() {
    let mut idx = index(&[W1], 1, 100);
    idx.apply(W1, &stored(&[1, 2, 3], None, &[7, 8, 9], 1))
        .unwrap();
    idx.apply(W1, &removed(&[2])).unwrap();
    assert_eq!(idx.overlap(&chain_keys(&[7, 8, 9], 1)), vec![(W1, 1)]);
    // A child of a removed block cannot be chained any more.
    let o = idx.apply(W1, &stored(&[4], Some(2), &[5], 1)).unwrap();
    assert_eq!(o.unknown_parent, 1);
}

#[test]
fn other_media_adapters_and_malformed_stores_are_not_indexed() {
    let mut idx = index(&[W1], 2, 100);
    let mut cpu = stored(&[1], None, &[1, 2], 2);
    if let Event::Stored(s) = &mut cpu {
        s.medium = Some(Medium::Cpu);
    }
    assert_eq!(idx.apply(W1, &cpu).unwrap().skipped, 1);
    let mut lora = stored(&[1], None, &[1, 2], 2);
    if let Event::Stored(s) = &mut lora {
        s.lora_name = Some("adapter".into());
    }
    assert_eq!(idx.apply(W1, &lora).unwrap().skipped, 1);
    assert_eq!(
        idx.apply(W1, &stored(&[1], None, &[1, 2, 3], 2))
            .unwrap()
            .invalid,
        1
    );
    assert_eq!(
        idx.apply(W1, &stored(&[1], None, &[1, 2, 3, 4], 4))
            .unwrap()
            .invalid,
        1
    );
    assert_eq!(idx.indexed_blocks(W1), 0);
    // A GPU block survives a removal from the CPU tier.
    let mut gpu = stored(&[1], None, &[1, 2], 2);
    if let Event::Stored(s) = &mut gpu {
        s.medium = Some(Medium::Gpu);
    }
    idx.apply(W1, &gpu).unwrap();
    let cpu_removal = Event::Removed(BlockRemoved {
        block_hashes: vec![EngineHash(1)],
        medium: Some(Medium::Cpu),
    });
    assert_eq!(idx.apply(W1, &cpu_removal).unwrap().skipped, 1);
    assert_eq!(idx.indexed_blocks(W1), 1);
}

#[test]
fn a_full_worker_drops_its_least_recently_stored_blocks() {
    let mut idx = index(&[W1], 1, 64);
    for h in 0..64u64 {
        idx.apply(W1, &stored(&[h], None, &[h as u32], 1)).unwrap();
    }
    // Storing block 0 again makes it the most recent.
    idx.apply(W1, &stored(&[0], None, &[0], 1)).unwrap();
    assert_eq!(idx.indexed_blocks(W1), 64);
    let o = idx.apply(W1, &stored(&[100], None, &[100], 1)).unwrap();
    assert_eq!(o.dropped, 2, "⌈64 / 32⌉ oldest entries go");
    assert_eq!(o.stored, 1);
    let held: Vec<u64> = idx.worker_blocks(W1).iter().map(|(h, _)| h.0).collect();
    assert_eq!(held.len(), 63);
    assert!(held.contains(&0) && held.contains(&100));
    assert!(
        !held.contains(&1) && !held.contains(&2),
        "blocks 1 and 2 were the oldest"
    );
    assert!(held.contains(&3));
    // Shrinking the pool drops down to it, oldest first.
    assert_eq!(idx.set_capacity(W1, 10).unwrap(), 53);
    let held: Vec<u64> = idx.worker_blocks(W1).iter().map(|(h, _)| h.0).collect();
    assert_eq!(held, vec![0, 56, 57, 58, 59, 60, 61, 62, 63, 100]);
}

#[test]
fn session_residency_follows_stores_removals_and_clears() {
    let mut idx = index(&[W1, W2], 1, 100);
    idx.apply(
        W1,
        &with_session(stored(&[1, 2, 3], None, &[1, 2, 3], 1), "sess-a"),
    )
    .unwrap();
    idx.apply(W2, &with_session(stored(&[1], None, &[1], 1), "sess-a"))
        .unwrap();
    idx.apply(W2, &with_session(stored(&[9], None, &[9], 1), "sess-b"))
        .unwrap();
    idx.apply(W2, &stored(&[10], None, &[10], 1)).unwrap();
    let a = SessionId::from_key("sess-a");
    let b = SessionId::from_key("sess-b");
    assert_eq!(idx.session_residency(a), vec![(W1, 3), (W2, 1)]);
    assert_eq!(idx.session_residency(b), vec![(W2, 1)]);
    assert_eq!(idx.sessions(), 2);
    idx.apply(W1, &removed(&[2])).unwrap();
    assert_eq!(idx.session_residency(a), vec![(W1, 2), (W2, 1)]);
    idx.apply(W1, &Event::AllCleared).unwrap();
    assert_eq!(idx.session_residency(a), vec![(W2, 1)]);
    idx.apply(W2, &removed(&[9])).unwrap();
    assert_eq!(idx.session_residency(b), vec![]);
    assert_eq!(
        idx.sessions(),
        1,
        "a session with no block left is forgotten"
    );
    // Storing a block again under another session moves it.
    idx.apply(W2, &with_session(stored(&[1], None, &[1], 1), "sess-b"))
        .unwrap();
    assert_eq!(idx.session_residency(a), vec![]);
    assert_eq!(idx.session_residency(b), vec![(W2, 1)]);
}

#[test]
fn clear_empties_one_worker_only() {
    let mut idx = index(&[W1, W2], 2, 100);
    let tokens = [1, 2, 3, 4];
    idx.apply(W1, &stored(&[1, 2], None, &tokens, 2)).unwrap();
    idx.apply(W2, &stored(&[1, 2], None, &tokens, 2)).unwrap();
    let o = idx.apply(W1, &Event::AllCleared).unwrap();
    assert!(o.cleared);
    assert_eq!(idx.indexed_blocks(W1), 0);
    assert_eq!(idx.overlap(&chain_keys(&tokens, 2)), vec![(W1, 0), (W2, 2)]);
    assert_eq!(idx.clear(W2), Ok(2));
    assert_eq!(idx.total_blocks(), 0);
}

#[test]
fn two_engine_hashes_for_the_same_tokens_keep_the_block_until_both_go() {
    let mut idx = index(&[W1], 2, 100);
    idx.apply(W1, &stored(&[1], None, &[5, 6], 2)).unwrap();
    idx.apply(W1, &stored(&[2], None, &[5, 6], 2)).unwrap();
    let keys = chain_keys(&[5, 6], 2);
    idx.apply(W1, &removed(&[1])).unwrap();
    assert_eq!(idx.overlap(&keys), vec![(W1, 1)]);
    idx.apply(W1, &removed(&[2])).unwrap();
    assert_eq!(idx.overlap(&keys), vec![(W1, 0)]);
}

#[test]
fn overlap_answers_every_worker_in_one_walk() {
    let mut idx = index(&[W1, W2, W3], 2, 100);
    let tokens: Vec<u32> = (0..12).collect();
    let hashes: Vec<u64> = (1..=6).collect();
    idx.apply(W1, &stored(&hashes, None, &tokens, 2)).unwrap();
    idx.apply(W2, &stored(&hashes[..2], None, &tokens[..4], 2))
        .unwrap();
    let keys = chain_keys(&tokens, 2);
    assert_eq!(idx.overlap(&keys), vec![(W1, 6), (W2, 2), (W3, 0)]);
    assert_eq!(idx.overlap(&keys[..1]), vec![(W1, 1), (W2, 1), (W3, 0)]);
    assert_eq!(idx.overlap(&[]), vec![(W1, 0), (W2, 0), (W3, 0)]);
}

#[test]
fn more_than_64_workers_are_answered_too() {
    let workers: Vec<WorkerId> = (0..70).map(WorkerId).collect();
    let mut idx = index(&workers, 1, 10);
    let tokens = [4u32, 5, 6];
    for (i, w) in workers.iter().enumerate() {
        let n = i % 4;
        if n > 0 {
            idx.apply(*w, &stored(&[1, 2, 3][..n], None, &tokens[..n], 1))
                .unwrap();
        }
    }
    let got = idx.overlap(&chain_keys(&tokens, 1));
    let want: Vec<(WorkerId, usize)> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| (*w, i % 4))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn overlap_in_tokens_chains_each_block_size() {
    let mut idx = KvIndex::new();
    idx.add_worker(W1, spec(2, 100)).unwrap();
    idx.add_worker(W2, spec(4, 100)).unwrap();
    let tokens: Vec<u32> = (0..9).collect();
    idx.apply(W1, &stored(&[1, 2, 3], None, &tokens[..6], 2))
        .unwrap();
    idx.apply(W2, &stored(&[1], None, &tokens[..4], 4)).unwrap();
    assert_eq!(
        idx.overlap_tokens(&tokens),
        vec![
            WorkerOverlap {
                worker: W1,
                rank: 0,
                blocks: 3,
                tokens: 6
            },
            WorkerOverlap {
                worker: W2,
                rank: 0,
                blocks: 1,
                tokens: 4
            },
        ]
    );
}

#[test]
fn calls_on_unknown_workers_and_bad_specs_are_refused() {
    let mut idx = index(&[W1], 2, 10);
    assert_eq!(
        idx.add_worker(W1, spec(2, 10)),
        Err(IndexError::DuplicateWorker(W1))
    );
    assert_eq!(
        idx.add_worker(W2, spec(2, 0)),
        Err(IndexError::ZeroCapacity(W2))
    );
    assert_eq!(
        idx.apply(W3, &Event::AllCleared),
        Err(IndexError::UnknownWorker(W3))
    );
    assert_eq!(idx.clear(W3), Err(IndexError::UnknownWorker(W3)));
    assert_eq!(idx.indexed_blocks(W3), 0);
}

/// Fills `workers` workers to their capacity with distinct chained blocks; returns the
/// index's bytes per indexed block.
fn bytes_per_block(workers: u32, capacity: u32, shared: bool) -> f64 {
    let mut idx = KvIndex::new();
    for w in 0..workers {
        idx.add_worker(WorkerId(w), spec(16, capacity)).unwrap();
    }
    for w in 0..workers {
        let mut parent = None;
        for b in 0..capacity {
            let seed = if shared { b } else { w * capacity + b };
            let tokens: Vec<u32> = (0..16).map(|t| seed * 16 + t).collect();
            let h = u64::from(seed) + 1;
            let e = stored(&[h], parent, &tokens, 16);
            let o = idx.apply(WorkerId(w), &e).unwrap();
            assert_eq!(o.stored, 1);
            parent = Some(h);
        }
    }
    assert_eq!(idx.total_blocks(), (workers * capacity) as usize);
    idx.memory_bytes() as f64 / idx.total_blocks() as f64
}

#[test]
fn a_full_index_costs_at_most_64_bytes_per_block() {
    // Worker maps: (8 + 16) bytes × 5/4 slots per block; group map: (8 + 8) × 5/4 per key.
    let unshared = bytes_per_block(8, 10_000, false);
    assert!(unshared <= 50.5, "{unshared} bytes per block");
    assert!(unshared >= 49.0, "{unshared} bytes per block");
    // Shared: 30 bytes per worker entry plus one group slot of 16 bytes per key (16,384 slots
    // for 10,000 keys) spread over 8 workers.
    let shared = bytes_per_block(8, 10_000, true);
    assert!(
        shared <= 34.0,
        "{shared} bytes per block when every worker holds the same blocks"
    );
}

#[test]
fn data_parallel_ranks_are_kept_apart_and_answer_with_the_best_rank() {
    let mut idx = KvIndex::new();
    idx.add_rank(W1, 1, spec(1, 100)).unwrap();
    idx.add_worker(W1, spec(1, 100)).unwrap();
    idx.add_worker(W2, spec(1, 100)).unwrap();
    assert_eq!(
        idx.add_rank(W1, 1, spec(1, 100)),
        Err(IndexError::DuplicateRank(W1, 1))
    );
    assert_eq!(
        idx.apply_rank(W2, 3, &Event::AllCleared),
        Err(IndexError::UnknownRank(W2, 3))
    );
    // The same engine hashes on two ranks are two caches: rank 1 holds three blocks of the
    // session, rank 0 one; W2 one.
    idx.apply_rank(
        W1,
        1,
        &with_session(stored(&[1, 2, 3], None, &[1, 2, 3], 1), "sess-a"),
    )
    .unwrap();
    idx.apply(W1, &with_session(stored(&[1], None, &[1], 1), "sess-a"))
        .unwrap();
    idx.apply(W2, &with_session(stored(&[7], None, &[1], 1), "sess-a"))
        .unwrap();
    let a = SessionId::from_key("sess-a");
    assert_eq!(
        idx.session_residency_ranks(a),
        vec![(W1, 1, 3), (W1, 0, 1), (W2, 0, 1)]
    );
    // Per worker: its best rank's count; W1's place is where its first rank was added.
    assert_eq!(idx.session_residency(a), vec![(W1, 3), (W2, 1)]);
    let keys = chain_keys(&[1, 2, 3, 4], 1);
    assert_eq!(idx.overlap(&keys), vec![(W1, 3), (W2, 1)]);
    assert_eq!(
        idx.overlap_ranks(&keys),
        vec![(W1, 1, 3), (W1, 0, 1), (W2, 0, 1)]
    );
    let best = idx.overlap_tokens(&[1, 2, 3, 4]);
    assert_eq!(
        (best[0].worker, best[0].rank, best[0].blocks, best[0].tokens),
        (W1, 1, 3, 3)
    );
    assert_eq!((best[1].worker, best[1].rank, best[1].blocks), (W2, 0, 1));
    assert_eq!(
        (
            idx.rank_blocks(W1, 1),
            idx.indexed_blocks(W1),
            idx.total_blocks()
        ),
        (3, 1, 5)
    );
    assert_eq!(idx.workers().map(|(w, _)| w).collect::<Vec<_>>(), [W1, W2]);
    // Clearing one rank leaves the other; a tie goes to the lowest rank.
    assert_eq!(idx.clear_rank(W1, 1), Ok(3));
    assert_eq!(idx.session_residency_ranks(a), vec![(W1, 0, 1), (W2, 0, 1)]);
    assert_eq!(idx.overlap(&keys), vec![(W1, 1), (W2, 1)]);
    // Rank 1 was added first, yet rank 0 answers when neither holds any.
    let none = idx.overlap_tokens(&[9])[0];
    assert_eq!((none.rank, none.blocks), (0, 0));
    assert_eq!(idx.indexed_blocks(W1), 1);
}
