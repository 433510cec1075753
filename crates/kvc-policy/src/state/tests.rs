//! Property tests of the routing state's incremental counts against recounts, and its sizes.

use super::*;
use crate::decision::StateChange;
use kvc_core::Outcome;
use proptest::prelude::*;

const WINDOW: u64 = 1_000;

#[derive(Debug, Clone)]
enum Op {
    Apply {
        session: Option<u64>,
        decode: u32,
        /// Time step; negative steps model decisions applied out of order.
        step: i64,
        blocks: Vec<u64>,
    },
    Complete {
        back: usize,
        resident: bool,
        direct: bool,
    },
    Reject {
        session: u64,
        worker: u32,
    },
    Evict {
        session: u64,
        worker: u32,
    },
    Forget {
        session: u64,
    },
    ForgetWorker {
        worker: u32,
    },
    FirstToken {
        back: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (
            prop::option::weighted(0.9, 0u64..12),
            1u32..5,
            -300i64..700,
            prop::collection::vec(0u64..30, 0..6),
        )
            .prop_map(|(session, decode, step, blocks)| Op::Apply {
                session,
                decode,
                step,
                blocks,
            }),
        3 => (0usize..8, any::<bool>(), any::<bool>())
            .prop_map(|(back, resident, direct)| Op::Complete { back, resident, direct }),
        1 => (0u64..12, 1u32..5).prop_map(|(session, worker)| Op::Reject { session, worker }),
        1 => (0u64..12, 1u32..5).prop_map(|(session, worker)| Op::Evict { session, worker }),
        1 => (0u64..12).prop_map(|session| Op::Forget { session }),
        1 => (1u32..5).prop_map(|worker| Op::ForgetWorker { worker }),
        2 => (0usize..8).prop_map(|back| Op::FirstToken { back }),
    ]
}

fn workers() -> Vec<WorkerView> {
    (0..5)
        .map(|i| {
            let role = if i == 0 {
                WorkerRole::Prefill
            } else {
                WorkerRole::Decode
            };
            WorkerView::new(WorkerId(i), role, kvc_core::WorkerState::empty(4 * 512))
        })
        .collect()
}

fn kvc_config() -> PolicyConfig {
    PolicyConfig::Kvc(crate::KvcConfig {
        active_window_ms: WINDOW,
        ..crate::KvcConfig::default()
    })
}

/// Runs `ops`, calling `check` after each with the state and the latest decision time.
fn run(
    state: &mut RouterState,
    ops: &[Op],
    mut check: impl FnMut(&RouterState, u64) -> Result<(), TestCaseError>,
) -> Result<(), TestCaseError> {
    let mut now = 5_000u64;
    let mut applied: Vec<(RequestId, Option<SessionId>, WorkerId)> = Vec::new();
    for (k, op) in ops.iter().enumerate() {
        match op {
            Op::Apply {
                session,
                decode,
                step,
                blocks,
            } => {
                now = now.saturating_add_signed(*step);
                let id = RequestId(k as u64);
                let session = session.map(SessionId);
                state.apply(&StateChange {
                    request_id: id,
                    session,
                    now_ms: now,
                    decode: WorkerId(*decode),
                    decode_role: WorkerRole::Decode,
                    prefill: Some(WorkerId(0)),
                    direct: false,
                    blocks: blocks.iter().map(|b| BlockHash(*b)).collect(),
                    reject_count: None,
                    prefill_us: 0,
                });
                applied.push((id, session, WorkerId(*decode)));
            }
            Op::Complete {
                back,
                resident,
                direct,
            } => {
                if let Some(&(request_id, session, worker)) =
                    applied.iter().rev().nth(*back % applied.len().max(1))
                {
                    state.observe(&Observation::Completed {
                        request_id,
                        session,
                        worker,
                        outcome: Outcome::Ok,
                        resident_tokens: if *resident { 700 } else { 0 },
                        direct: *direct,
                    });
                }
            }
            Op::Reject { session, worker } => {
                state.observe(&Observation::AdmissionRejected {
                    session: SessionId(*session),
                    worker: WorkerId(*worker),
                });
            }
            Op::Evict { session, worker } => {
                state.observe(&Observation::Evicted {
                    session: SessionId(*session),
                    worker: WorkerId(*worker),
                });
            }
            Op::Forget { session } => state.forget_session(SessionId(*session)),
            Op::ForgetWorker { worker } => {
                state.forget_worker(WorkerId(*worker));
            }
            Op::FirstToken { back } => {
                if let Some(&(request_id, _, _)) =
                    applied.iter().rev().nth(*back % applied.len().max(1))
                {
                    state.observe(&Observation::PrefillDone {
                        request_id,
                        at_ms: None,
                    });
                }
            }
        }
        check(state, now)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// The incremental active-session counts equal a count from scratch over every session,
    /// for decision times before, at and after the latest applied one, with and without an
    /// excluded session, and for another window (answered by the scan).
    #[test]
    fn active_sessions_match_a_recount(ops in prop::collection::vec(op(), 1..80)) {
        let mut state = RouterState::new(&kvc_config(), &workers());
        run(&mut state, &ops, |state, now| {
            for dt in [-2_500i64, -2_001, -2_000, -1_500, -1_000, -200, -1, 0, 1, 250, 999, 1_000, 1_001, 4_000] {
                let at = now.saturating_add_signed(dt);
                for window in [WINDOW, 300] {
                    for exclude in [None, Some(SessionId(3)), Some(SessionId(40))] {
                        let mut fast = [0u32; 8];
                        state.active_sessions(at, window, exclude, &mut fast);
                        let mut slow = [0u32; 8];
                        for (id, r) in state.sessions() {
                            if Some(id) != exclude
                                && r.residency == Residency::Resident
                                && at.saturating_sub(r.last_routed_ms) <= window
                                && let Some(d) = r.current_d
                            {
                                slow[d.0 as usize] += 1;
                            }
                        }
                        prop_assert_eq!(&fast, &slow, "at {} window {}", at, window);
                    }
                }
            }
            Ok(())
        })?;
    }

    /// Pending decisions never exceed their bound, and in-flight counts equal the
    /// decisions still pending on each worker.
    #[test]
    fn pending_decisions_stay_bounded(ops in prop::collection::vec(op(), 1..80), max in 0u32..6) {
        let bounds = StateBounds { max_pending: max, ..StateBounds::default() };
        let mut state = RouterState::with_bounds(&kvc_config(), &workers(), bounds);
        run(&mut state, &ops, |state, _| {
            prop_assert!(state.pending_count() <= max as usize);
            prop_assert!(state.pending_order.len() <= 2 * state.pending.len() + 65);
            for w in 0..5u32 {
                let n = state
                    .pending
                    .values()
                    .filter(|p| p.decode == WorkerId(w) || p.prefill == Some(WorkerId(w)))
                    .count();
                prop_assert_eq!(state.in_flight(WorkerId(w)) as usize, n);
            }
            Ok(())
        })?;
    }

    /// Each decode worker's count of P→D requests awaiting their KV, and the wait of the
    /// earliest applied of them, equal a recount over the pending decisions; the queues
    /// behind them stay bounded.
    #[test]
    fn kv_waits_match_a_recount(ops in prop::collection::vec(op(), 1..80), max in 0u32..12) {
        let bounds = StateBounds { max_pending: max, ..StateBounds::default() };
        let mut state = RouterState::with_bounds(&kvc_config(), &workers(), bounds);
        run(&mut state, &ops, |state, now| {
            for w in 0..5u32 {
                let waiting: Vec<&Pending> = state
                    .pending
                    .values()
                    .filter(|p| p.decode == WorkerId(w) && p.awaiting_kv)
                    .collect();
                prop_assert_eq!(state.awaiting_kv(WorkerId(w)) as usize, waiting.len());
                prop_assert_eq!(
                    state.awaiting_kv_blocks(WorkerId(w)),
                    waiting.iter().map(|p| u64::from(p.kv_blocks)).sum::<u64>()
                );
                let first = waiting.iter().min_by_key(|p| p.seq);
                let at = now + 1_000;
                prop_assert_eq!(
                    state.oldest_kv_wait_ms(WorkerId(w), at),
                    first.map_or(0, |p| at.saturating_sub(p.sent_ms))
                );
                let q = state.awaiting_kv.get(w as usize).map_or(0, VecDeque::len);
                prop_assert!(q <= 2 * waiting.len() + 65, "queue {} for {}", q, waiting.len());
            }
            Ok(())
        })?;
    }
}

#[test]
fn pending_and_worker_entries_are_the_documented_size() {
    // The figures of `docs/kvc-policy.md` ("Memory and cost"): a pending decision's value,
    // an awaiting-KV queue entry, and a worker's counters plus its queue's header.
    assert_eq!(std::mem::size_of::<Pending>(), 56);
    assert_eq!(std::mem::size_of::<(u64, RequestId)>(), 16);
    assert_eq!(
        std::mem::size_of::<WorkerCounters>() + std::mem::size_of::<VecDeque<(u64, RequestId)>>(),
        88
    );
}

#[test]
fn a_session_route_is_120_bytes() {
    // The figure `docs/kvc-policy.md` uses for the session table's cost per entry.
    assert_eq!(std::mem::size_of::<SessionRoute>(), 120);
}

#[test]
fn block_bounds_derive_from_the_pool() {
    let b = StateBounds::default();
    let bs = BlockSize::default();
    assert_eq!(b.blocks_for(92_160, bs), 4 * 180);
    assert_eq!(b.blocks_for(92_161, bs), 4 * 181);
    assert_eq!(b.blocks_for(0, bs), 4_096);
    let fixed = StateBounds {
        blocks_per_worker: Some(10),
        ..b
    };
    assert_eq!(fixed.blocks_for(92_160, bs), 10);
    let ws = workers();
    let mut state = RouterState::new(&kvc_config(), &ws);
    assert_eq!(state.worker_block_bound(WorkerId(1)), 16);
    assert_eq!(state.worker_block_bound(WorkerId(9)), 4_096);
    state.set_worker_blocks(WorkerId(9), 1_024);
    assert_eq!(state.worker_block_bound(WorkerId(9)), 8);
}

/// A worker taken out of the fleet: its resident sessions count as evicted from it, its
/// blocks leave both views, its bound stays, and the other workers keep theirs.
#[test]
fn a_forgotten_worker_holds_nothing_and_its_sessions_are_evicted() {
    // (kv-aware-v0 keeps every worker's grow-only view.)
    let v0 = PolicyConfig::from_name("kv-aware-v0").unwrap();
    let mut state = RouterState::new(&v0, &workers());
    let blocks: Vec<BlockHash> = (0..6).map(BlockHash).collect();
    for (k, (session, decode)) in [(1u64, 1u32), (2, 1), (3, 2)].into_iter().enumerate() {
        let request_id = RequestId(k as u64);
        let change = StateChange {
            request_id,
            session: Some(SessionId(session)),
            now_ms: 1_000,
            decode: WorkerId(decode),
            decode_role: WorkerRole::Decode,
            prefill: Some(WorkerId(0)),
            direct: false,
            blocks: blocks
                .iter()
                .map(|b| BlockHash(b.0 + 100 * session))
                .collect(),
            reject_count: None,
            prefill_us: 0,
        };
        state.apply(&change);
        state.observe(&Observation::Completed {
            request_id,
            session: Some(SessionId(session)),
            worker: WorkerId(decode),
            outcome: Outcome::Ok,
            resident_tokens: 700,
            direct: false,
        });
    }
    let bound = state.worker_block_bound(WorkerId(1));
    assert_eq!(state.live_blocks(WorkerId(1)), 12);
    assert_eq!(state.seen_blocks(WorkerId(1)), 12);
    assert_eq!(state.live_blocks(WorkerId(2)), 6);

    assert_eq!(state.forget_worker(WorkerId(1)), 2);
    assert_eq!(state.live_blocks(WorkerId(1)), 0);
    assert_eq!(state.seen_blocks(WorkerId(1)), 0);
    assert_eq!(state.worker_block_bound(WorkerId(1)), bound);
    for s in [1, 2] {
        let route = state.session(SessionId(s)).unwrap();
        assert_eq!(route.residency, Residency::Evicted);
        assert_eq!(route.resident_tokens, 0);
    }
    assert_eq!(
        state.session(SessionId(3)).unwrap().residency,
        Residency::Resident
    );
    assert_eq!(state.live_blocks(WorkerId(2)), 6);
    assert_eq!(state.seen_blocks(WorkerId(2)), 6);
    // Nothing left to forget the second time.
    assert_eq!(state.forget_worker(WorkerId(1)), 0);
}

/// Under `kvc` (and `kvc-v2`) the grow-only view of a worker that prefills for no other is
/// never read, so none is kept; under the baselines, and for a prefill worker, it is.
#[test]
fn the_grow_only_view_is_kept_only_where_the_policy_reads_it() {
    let blocks: Vec<BlockHash> = (0..6).map(BlockHash).collect();
    let seen_after_one_turn = |config: &PolicyConfig| {
        let mut state = RouterState::new(config, &workers());
        state.apply(&StateChange {
            request_id: RequestId(1),
            session: Some(SessionId(1)),
            now_ms: 1_000,
            decode: WorkerId(1),
            decode_role: WorkerRole::Decode,
            prefill: Some(WorkerId(0)),
            direct: false,
            blocks: blocks.clone(),
            reject_count: None,
            prefill_us: 0,
        });
        let kept: Vec<bool> = (0..3).map(|w| state.keeps_seen(WorkerId(w))).collect();
        let seen = (
            state.seen_blocks(WorkerId(0)),
            state.seen_blocks(WorkerId(1)),
        );
        (kept, seen, state)
    };
    for name in ["kvc", "kvc-v2"] {
        let (kept, seen, mut state) = seen_after_one_turn(&PolicyConfig::from_name(name).unwrap());
        assert_eq!(kept, vec![true, false, false], "{name}");
        assert_eq!(seen, (6, 0), "{name}");
        // The id given to another worker later keeps its view.
        state.forget_worker(WorkerId(1));
        assert!(state.keeps_seen(WorkerId(1)), "{name}");
    }
    for name in ["kv-aware-v0", "cache-aware", "round-robin"] {
        let (kept, seen, _) = seen_after_one_turn(&PolicyConfig::from_name(name).unwrap());
        assert_eq!(kept, vec![true, true, true], "{name}");
        assert_eq!(seen, (6, 6), "{name}");
    }
}
