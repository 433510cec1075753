//! Paths and fall-through reasons per policy: seeds, direct-to-D limits, rejects, migrations and residency.

mod common;

use common::*;
use kvc_core::{
    ExecutionMode, FallThroughReason, Health, Outcome, RequestId, SessionId, TurnId, WorkerId,
    WorkerRole,
};
use kvc_policy::{Observation, PolicyError, Residency, RouteRequest, WorkerView};

const ALL: [&str; 5] = ["round-robin", "cache-aware", "kv-aware-v0", "kvc-v2", "kvc"];

fn sid(s: u64) -> SessionId {
    SessionId(s)
}

#[test]
fn colocated_topology_is_colocated_for_every_policy() {
    let ws = dp(3);
    for name in ALL {
        let mut r = Router::named(name, &ws);
        for turn in 1..=4 {
            let b = ctx_blocks(7, 0, 4 + turn as usize);
            let d = r.serve(&ws, Some((7, turn)), &b);
            assert_eq!(d.mode, ExecutionMode::Colocated, "{name} turn {turn}");
            assert_eq!((d.prefill, d.reason), (None, None), "{name}");
            assert!(d.scores.iter().all(|s| s.role == WorkerRole::Colocated));
            assert_eq!(d.change.decode_role, WorkerRole::Colocated);
        }
        let d = r.serve(&ws, None, &ctx_blocks(8, 0, 1));
        assert_eq!(d.mode, ExecutionMode::Colocated, "{name} one-off");
    }
    // Sessionful policies keep a colocated session where its prefix is.
    for name in ["kv-aware-v0", "kvc-v2"] {
        let mut r = Router::named(name, &ws);
        let first = r.serve(&ws, Some((7, 1)), &ctx_blocks(7, 0, 10)).decode;
        let second = r.serve(&ws, Some((7, 2)), &ctx_blocks(7, 0, 12));
        assert_eq!(second.decode, first, "{name}");
        assert_eq!(second.cached_tokens, 14 * BS, "{name}");
        assert_eq!(
            second.need_tokens,
            if name == "kvc-v2" {
                2 * BS + 10
            } else {
                16 * BS + 10
            }
        );
    }
}

#[test]
fn kvc_keeps_a_resident_colocated_session_on_its_worker_until_that_worker_is_over_the_cap() {
    for name in ["kvc", "kvc-v2"] {
        let mut ws = dp(2);
        let mut r = Router::named(name, &ws);
        let home = r.serve(&ws, Some((7, 1)), &ctx_blocks(7, 0, 10)).decode;
        let other = WorkerId(1 - home.0);
        // Another session active on the home worker, requests queued there, the other idle:
        // a score-only choice would move session 7 and prefill its 14 blocks again.
        r.serve(&ws, Some((8, 1)), &ctx_blocks(8, 0, 2));
        set_load(&mut ws, home.0, 3, 2);
        let d = r.serve(&ws, Some((7, 2)), &ctx_blocks(7, 0, 12));
        assert_eq!(d.mode, ExecutionMode::Colocated, "{name}");
        assert_eq!(d.decode, home, "{name}: stays where its context is");
        assert_eq!(d.cached_tokens, 14 * BS, "{name}");
        // Over the hard cap while the other worker is not: it moves.
        set_used(&mut ws, home.0, 95_000);
        let d = r.serve(&ws, Some((7, 3)), &ctx_blocks(7, 0, 14));
        assert_eq!(
            d.decode, other,
            "{name}: moved off a worker over the hard cap"
        );
        // Both over the cap: nowhere better, it stays on its (new) worker.
        set_used(&mut ws, other.0, 95_000);
        let d = r.serve(&ws, Some((7, 4)), &ctx_blocks(7, 0, 15));
        assert_eq!(d.decode, other, "{name}");
    }
}

#[test]
fn first_turns_and_one_offs_are_seeded_through_p() {
    let ws = pd(1, 2);
    let b = ctx_blocks(1, 0, 3);
    for name in ALL {
        let mut r = Router::named(name, &ws);
        let one_off = RouteRequest::new(RequestId(1), 7 * BS, 5, &b);
        let d = r.decide(&ws, &one_off).unwrap();
        assert_eq!(
            (d.mode, d.reason, d.prefill),
            (ExecutionMode::Turn1Seed, None, Some(WorkerId(0))),
            "{name}"
        );
        assert_eq!(d.need_tokens, 7 * BS + 5);
        // A session without turn numbers: first time seen is a first turn, then later turns.
        let mut no_turn = one_off;
        no_turn.session = Some(sid(1));
        let d = r.decide(&ws, &no_turn).unwrap();
        assert_eq!(d.mode, ExecutionMode::Turn1Seed, "{name}");
        r.state.apply(&d.change);
        let d = r.decide(&ws, &no_turn).unwrap();
        assert_ne!(d.mode, ExecutionMode::Turn1Seed, "{name}");
    }
}

#[test]
fn direct_limit_and_footprint_per_policy() {
    let ws = pd(1, 2);
    // Turn 1: 10 blocks. Turn 2 adds an append of `extra` blocks.
    // (policy, extra blocks) -> direct?
    for (name, extra, direct) in [
        ("kv-aware-v0", 4, true),  // 2,048 tokens: at the limit
        ("kv-aware-v0", 5, false), // 2,560 tokens
        ("kvc-v2", 5, true),
        ("kvc-v2", 16, true), // 8,192 tokens
        ("kvc-v2", 17, false),
        ("round-robin", 1, false),
        ("cache-aware", 1, false),
    ] {
        let mut r = Router::named(name, &ws);
        let t1 = ctx_blocks(3, 0, 6);
        let first = r.serve(&ws, Some((3, 1)), &t1);
        let t2 = ctx_blocks(3, 0, 6 + extra);
        let req = r.request(3, 2, &t2);
        let d = r.decide(&ws, &req).unwrap();
        let input = t2.len() as u64 * BS;
        if direct {
            assert_eq!(
                (d.mode, d.decode, d.prefill, d.reason),
                (ExecutionMode::DirectToD, first.decode, None, None),
                "{name} +{extra}"
            );
            assert_eq!(d.cached_tokens, 10 * BS);
            let need = if name == "kvc-v2" {
                extra as u64 * BS + 10
            } else {
                input + 10
            };
            assert_eq!(d.need_tokens, need, "{name}");
        } else {
            let reason = if name.starts_with("kv") {
                FallThroughReason::RealLargeAppend
            } else {
                FallThroughReason::SessionNotResident
            };
            assert_eq!(
                (d.mode, d.reason),
                (ExecutionMode::Fallback, Some(reason)),
                "{name} +{extra}"
            );
            assert!(d.prefill.is_some());
            assert_eq!(d.need_tokens, input + 10, "P→D ships the whole context");
        }
    }
}

#[test]
fn cached_tokens_count_only_full_blocks_of_the_input() {
    let ws = pd(1, 1);
    let mut r = Router::named("kvc-v2", &ws);
    let t1 = ctx_blocks(3, 0, 6);
    r.serve(&ws, Some((3, 1)), &t1);
    // Same 10 blocks plus a partial one: 10 full blocks reused; an input ending inside block 9
    // reuses only 9. The room it needs is what the input adds to the session's own KV on D
    // (10 blocks, as the completion reported): the recomputed tail of block 9 replaces KV the
    // session already holds there.
    let t2 = ctx_blocks(3, 0, 7);
    for (input, cached, need) in [(10 * BS + 100, 10 * BS, 100), (9 * BS + 300, 9 * BS, 0)] {
        let req = RouteRequest::new(RequestId(50), input, 0, &t2).in_session(sid(3), TurnId(2));
        let d = r.decide(&ws, &req).unwrap();
        assert_eq!(
            (d.mode, d.cached_tokens),
            (ExecutionMode::DirectToD, cached)
        );
        assert_eq!(d.need_tokens, need);
    }
}

#[test]
fn an_append_never_needs_more_than_the_pool_beside_its_own_kv() {
    // A session of 190 blocks (97,280 tokens) resident on a 100,000-token D: its next turn,
    // 300 tokens longer with 5,000 tokens of output, needs the 300 tokens and what the pool
    // has left for output, never the 5,000 (output past the pool is never allocated).
    let ws = pd(1, 1);
    for name in ["kvc", "kvc-v2"] {
        let mut r = Router::named(name, &ws);
        let t1 = ctx_blocks(5, 0, 186);
        r.serve(&ws, Some((5, 1)), &t1);
        let resident = t1.len() as u64 * BS;
        let t2 = ctx_blocks(5, 0, 187);
        let input = resident + 300;
        let req = RouteRequest::new(RequestId(60), input, 5_000, &t2).in_session(sid(5), TurnId(2));
        let d = r.decide(&ws, &req).unwrap();
        assert_eq!(d.mode, ExecutionMode::DirectToD, "{name}");
        assert_eq!(d.need_tokens, CAP - resident, "{name}");
    }
}

#[test]
fn kv_aware_v0_stays_pinned_through_evictions_and_rejects() {
    let mut ws = pd(1, 3);
    let mut r = Router::named("kv-aware-v0", &ws);
    let t1 = ctx_blocks(5, 0, 8);
    let d0 = r.serve(&ws, Some((5, 1)), &t1).decode;
    set_used(&mut ws, d0.0, CAP); // full
    let t2 = ctx_blocks(5, 0, 9);
    // Eviction: P→D again, to the same D.
    r.state.observe(&Observation::Evicted {
        session: sid(5),
        worker: d0,
    });
    assert_eq!(
        r.state.session(sid(5)).unwrap().residency,
        Residency::Evicted
    );
    let req = r.request(5, 2, &t2);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(
        (d.mode, d.reason, d.decode),
        (
            ExecutionMode::Fallback,
            Some(FallThroughReason::SessionEvicted),
            d0
        )
    );
    r.state.apply(&d.change);
    // Rejects: counted, never acted on.
    for n in 1..=10 {
        let req = r.request(5, 2 + n, &t2).rejected_by(d0);
        let d = r.decide(&ws, &req).unwrap();
        assert_eq!(
            (d.mode, d.reason, d.decode),
            (
                ExecutionMode::Fallback,
                Some(FallThroughReason::SessionCapRejected),
                d0
            )
        );
        assert_eq!(d.change.reject_count, Some((d0, n)));
        r.state.apply(&d.change);
        assert_eq!(r.state.session(sid(5)).unwrap().rejects_on(d0), n);
    }
    assert_eq!(r.state.session(sid(5)).unwrap().d_changes, 0);
}

#[test]
fn decode_unhealthy_moves_the_session() {
    for name in ["kv-aware-v0", "kvc-v2"] {
        let mut ws = pd(1, 2);
        let mut r = Router::named(name, &ws);
        let t1 = ctx_blocks(5, 0, 8);
        let d0 = r.serve(&ws, Some((5, 1)), &t1).decode;
        set_health(&mut ws, d0.0, Health::Stale);
        let t2 = ctx_blocks(5, 0, 9);
        let d = r.serve(&ws, Some((5, 2)), &t2);
        assert_eq!(
            (d.mode, d.reason),
            (
                ExecutionMode::Fallback,
                Some(FallThroughReason::DecodeUnhealthy)
            ),
            "{name}"
        );
        assert_ne!(d.decode, d0);
        let s = r.state.session(sid(5)).unwrap();
        assert_eq!((s.current_d, s.d_changes), (Some(d.decode), 1), "{name}");
        // Back to direct on the new D.
        let d = r.serve(&ws, Some((5, 3)), &ctx_blocks(5, 0, 10));
        assert_eq!(d.mode, ExecutionMode::DirectToD, "{name}");
    }
}

/// Sends turn after turn of one session while D rejects every direct-to-D attempt; returns the
/// mode of each re-routed decision.
fn reject_loop(
    r: &mut Router,
    ws: &[WorkerView],
    session: u64,
    d0: WorkerId,
    turns: u32,
    observe_first: bool,
) -> Vec<ExecutionMode> {
    let mut modes = Vec::new();
    for t in 0..turns {
        let blocks = ctx_blocks(session, 0, 9 + t as usize);
        let req = r.request(session, 2 + t, &blocks);
        let d = r.decide(ws, &req).unwrap();
        assert_eq!((d.mode, d.decode), (ExecutionMode::DirectToD, d0));
        r.state.apply(&d.change);
        if observe_first {
            r.state.observe(&Observation::AdmissionRejected {
                session: sid(session),
                worker: d0,
            });
        }
        let again = r.decide(ws, &req.rejected_by(d0)).unwrap();
        assert!(again.prefill.is_some(), "a re-route takes a P→D path");
        modes.push(again.mode);
        r.state.apply(&again.change);
        if again.mode == ExecutionMode::Reseed {
            break;
        }
        // The P→D turn completes on d0, resident again.
        r.state.observe(&Observation::Completed {
            request_id: req.request_id,
            session: Some(sid(session)),
            worker: d0,
            outcome: Outcome::Ok,
            resident_tokens: blocks.len() as u64 * BS,
            direct: false,
        });
    }
    modes
}

#[test]
fn kvc_v2_migrates_after_exactly_n_rejects_counted_once() {
    for observe_first in [false, true] {
        let ws = pd(1, 3);
        let mut r = Router::named("kvc-v2", &ws);
        let d0 = r.serve(&ws, Some((5, 1)), &ctx_blocks(5, 0, 8)).decode;
        let modes = reject_loop(&mut r, &ws, 5, d0, 10, observe_first);
        assert_eq!(
            modes,
            vec![
                ExecutionMode::Fallback,
                ExecutionMode::Fallback,
                ExecutionMode::Reseed
            ],
            "observe_first={observe_first}"
        );
        let s = r.state.session(sid(5)).unwrap();
        assert_ne!(s.current_d, Some(d0));
        assert_eq!(s.d_changes, 1);
        assert_eq!(s.rejects_on(d0), 0, "migration releases the old D");
    }
}

#[test]
fn successful_direct_turn_resets_the_reject_counter() {
    let ws = pd(1, 3);
    let mut r = Router::named("kvc-v2", &ws);
    let d0 = r.serve(&ws, Some((5, 1)), &ctx_blocks(5, 0, 8)).decode;
    assert_eq!(
        reject_loop(&mut r, &ws, 5, d0, 2, true),
        vec![ExecutionMode::Fallback; 2]
    );
    assert_eq!(r.state.session(sid(5)).unwrap().rejects_on(d0), 2);
    // A direct turn that succeeds resets the counter ...
    let d = r.serve(&ws, Some((5, 10)), &ctx_blocks(5, 0, 20));
    assert_eq!((d.mode, d.decode), (ExecutionMode::DirectToD, d0));
    assert_eq!(r.state.session(sid(5)).unwrap().rejects_on(d0), 0);
    // ... so two more rejects do not migrate; the third does.
    let modes = reject_loop(&mut r, &ws, 5, d0, 3, false);
    assert_eq!(
        modes,
        vec![
            ExecutionMode::Fallback,
            ExecutionMode::Fallback,
            ExecutionMode::Reseed
        ]
    );
    // A failed direct turn does not reset it.
    let ws = pd(1, 2);
    let mut r = Router::named("kvc-v2", &ws);
    let d0 = r.serve(&ws, Some((6, 1)), &ctx_blocks(6, 0, 8)).decode;
    r.state.observe(&Observation::AdmissionRejected {
        session: sid(6),
        worker: d0,
    });
    r.state.observe(&Observation::Completed {
        request_id: RequestId(999),
        session: Some(sid(6)),
        worker: d0,
        outcome: Outcome::DecodeOom,
        resident_tokens: 8 * BS,
        direct: true,
    });
    assert_eq!(r.state.session(sid(6)).unwrap().rejects_on(d0), 1);
}

#[test]
fn an_observed_reject_without_reroute_does_not_absorb_the_next_one() {
    let ws = pd(1, 3);
    let mut r = Router::named("kvc-v2", &ws);
    let d0 = r.serve(&ws, Some((5, 1)), &ctx_blocks(5, 0, 8)).decode;
    // Reject observed; the caller gives up on that request (no re-route).
    let t2 = ctx_blocks(5, 0, 9);
    let req = r.request(5, 2, &t2);
    let d = r.decide(&ws, &req).unwrap();
    r.state.apply(&d.change);
    r.state.observe(&Observation::AdmissionRejected {
        session: sid(5),
        worker: d0,
    });
    // The next turn is rejected too and re-routed without an observation: it counts.
    let t3 = ctx_blocks(5, 0, 10);
    let req = r.request(5, 3, &t3);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(d.mode, ExecutionMode::DirectToD);
    r.state.apply(&d.change);
    let again = r.decide(&ws, &req.rejected_by(d0)).unwrap();
    assert_eq!(again.change.reject_count, Some((d0, 2)));
}

#[test]
fn kvc_v2_does_not_migrate_without_a_usable_target() {
    // One D: rejects pile up, the session stays.
    let ws = pd(1, 1);
    let mut r = Router::named("kvc-v2", &ws);
    let d0 = r.serve(&ws, Some((5, 1)), &ctx_blocks(5, 0, 8)).decode;
    let modes = reject_loop(&mut r, &ws, 5, d0, 5, false);
    assert_eq!(modes, vec![ExecutionMode::Fallback; 5]);
    assert_eq!(r.state.session(sid(5)).unwrap().rejects_on(d0), 5);
    // Two Ds, the other over the cap while d0 is under it: no move to a D over the cap.
    let mut ws = pd(1, 2);
    let mut r = Router::named("kvc-v2", &ws);
    let d0 = r.serve(&ws, Some((5, 1)), &ctx_blocks(5, 0, 8)).decode;
    let other = if d0.0 == 1 { 2 } else { 1 };
    set_used(&mut ws, other, 90_000);
    let modes = reject_loop(&mut r, &ws, 5, d0, 4, false);
    assert_eq!(modes, vec![ExecutionMode::Fallback; 4]);
}

#[test]
fn direct_to_d_needs_no_prefill_worker() {
    let mut ws = pd(2, 2);
    let mut r = Router::named("kvc-v2", &ws);
    r.serve(&ws, Some((5, 1)), &ctx_blocks(5, 0, 8));
    set_health(&mut ws, 0, Health::Down);
    set_health(&mut ws, 1, Health::Down);
    let t2 = ctx_blocks(5, 0, 9);
    let req = r.request(5, 2, &t2);
    assert_eq!(r.decide(&ws, &req).unwrap().mode, ExecutionMode::DirectToD);
    let t1 = ctx_blocks(6, 0, 2);
    let req = r.request(6, 1, &t1);
    assert_eq!(
        r.decide(&ws, &req),
        Err(PolicyError::NoHealthyWorker {
            role: WorkerRole::Prefill
        })
    );
}

#[test]
fn completion_without_resident_tokens_ends_residency() {
    let ws = pd(1, 2);
    let mut r = Router::named("kvc-v2", &ws);
    let t1 = ctx_blocks(5, 0, 8);
    let req = r.request(5, 1, &t1);
    let d = r.decide(&ws, &req).unwrap();
    r.state.apply(&d.change);
    assert_eq!(r.state.resident_depth(d.decode, &t1), 12);
    r.state.observe(&Observation::Completed {
        request_id: req.request_id,
        session: Some(sid(5)),
        worker: d.decode,
        outcome: Outcome::KvTransferTimeout,
        resident_tokens: 0,
        direct: false,
    });
    let s = r.state.session(sid(5)).unwrap();
    assert_eq!(
        (s.residency, s.resident_tokens),
        (Residency::NotResident, 0)
    );
    assert_eq!(r.state.resident_depth(d.decode, &t1), 0);
    let p = d.prefill.expect("a first turn goes P→D");
    assert_eq!(
        r.state.seen_depth(p, &t1),
        12,
        "the grow-only view keeps them"
    );
    let t2 = ctx_blocks(5, 0, 9);
    let req = r.request(5, 2, &t2);
    let d2 = r.decide(&ws, &req).unwrap();
    assert_eq!(
        (d2.mode, d2.reason),
        (
            ExecutionMode::Fallback,
            Some(FallThroughReason::SessionNotResident)
        )
    );
}

#[test]
fn a_request_the_engine_refused_leaves_the_session_where_it_was() {
    let ws = pd(1, 2);
    for name in ["kvc-v2", "kvc"] {
        let mut r = Router::named(name, &ws);
        let t1 = ctx_blocks(6, 0, 8);
        let first = r.serve(&ws, Some((6, 1)), &t1);
        let t2 = ctx_blocks(6, 0, 9);
        let req = r.request(6, 2, &t2);
        let d = r.decide(&ws, &req).unwrap();
        assert_eq!(d.mode, ExecutionMode::DirectToD, "{name}");
        r.state.apply(&d.change);
        // The engine answered 4xx: it touched none of the session's KV.
        r.state.observe(&Observation::Completed {
            request_id: req.request_id,
            session: Some(sid(6)),
            worker: d.decode,
            outcome: Outcome::InvalidRequest,
            resident_tokens: 0,
            direct: true,
        });
        let s = r.state.session(sid(6)).unwrap();
        assert_eq!(s.residency, Residency::Resident, "{name}");
        assert_eq!(r.state.resident_depth(first.decode, &t1), 12, "{name}");
        assert_eq!(r.state.pending_count(), 0, "{name}: no longer in flight");
        let req = r.request(6, 3, &t2);
        let again = r.decide(&ws, &req).unwrap();
        assert_eq!(
            (again.mode, again.decode),
            (ExecutionMode::DirectToD, first.decode),
            "{name}"
        );
    }
}
