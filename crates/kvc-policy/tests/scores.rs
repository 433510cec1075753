//! Table-driven checks of each policy's scores against hand-computed values.

mod common;

use common::*;
use kvc_core::{
    BlockHash, ExecutionMode, FallThroughReason, Health, RequestId, SessionId, TurnId, WorkerId,
    WorkerRole,
};
use kvc_policy::{
    ClusterView, Decision, KvcV2Config, Observation, PolicyConfig, PrefillPolicy, RouteRequest,
    StateChange, route,
};

/// Checks the entry of `worker` in `role`: `(component, value)` pairs, total and eligibility.
fn check(
    d: &Decision,
    worker: u32,
    role: WorkerRole,
    comps: &[(&str, f64)],
    total: f64,
    eligible: bool,
) {
    let e = d
        .score(WorkerId(worker), role)
        .unwrap_or_else(|| panic!("no score for w{worker} ({role}): {:?}", d.scores));
    for (name, want) in comps {
        let got = e
            .component(name)
            .unwrap_or_else(|| panic!("w{worker}: no component {name}"));
        assert!(
            approx(got, *want),
            "w{worker} {name}: got {got}, want {want}"
        );
    }
    assert!(
        approx(e.total, total),
        "w{worker} total: got {}, want {total}",
        e.total
    );
    assert_eq!(e.eligible, eligible, "w{worker} eligibility");
}

#[test]
fn kvc_v2_scores_capacity_overlap_load_and_cap() {
    let mut ws = pd(1, 3);
    let mut r = Router::named("kvc-v2", &ws);
    // Empty cluster: every D scores 0; the tie goes to the lowest id.
    let a = ctx_blocks(100, 0, 20);
    let d = r.serve(&ws, Some((100, 1)), &a);
    assert_eq!((d.mode, d.decode), (ExecutionMode::Turn1Seed, WorkerId(1)));

    set_used(&mut ws, 1, 50_000);
    set_used(&mut ws, 2, 20_000);
    set_load(&mut ws, 2, 2, 2);
    set_used(&mut ws, 3, 90_000);
    let b = ctx_blocks(200, 0, 10);
    let req = r.request(200, 1, &b);
    let d = r.decide(&ws, &req).unwrap();
    // d1: 1.0 × 4/16 − 2 × 0.5 = −0.75; d2: −2 × 0.2 − 0.05 × 4 = −0.6; d3 over the cap.
    let dr = WorkerRole::Decode;
    check(
        &d,
        1,
        dr,
        &[
            ("overlap", 4.0),
            ("overlap_term", 0.25),
            ("sticky_term", 0.0),
            ("capacity_term", -1.0),
            ("load_term", 0.0),
            ("committed_fraction", 0.5),
        ],
        -0.75,
        true,
    );
    check(
        &d,
        2,
        dr,
        &[
            ("overlap", 0.0),
            ("overlap_term", 0.0),
            ("capacity_term", -0.4),
            ("load_term", -0.2),
        ],
        -0.6,
        true,
    );
    check(
        &d,
        3,
        dr,
        &[("capacity_term", -1.8), ("committed_fraction", 0.9)],
        -1.8,
        false,
    );
    assert_eq!(
        (d.mode, d.decode, d.prefill),
        (ExecutionMode::Turn1Seed, WorkerId(2), Some(WorkerId(0)))
    );
    assert_eq!(d.reason, None);
    // The prefill worker saw session 100's blocks: the shared system prompt is reused there.
    assert_eq!(d.cached_tokens, 4 * BS);
    assert_eq!(d.need_tokens, 14 * BS + 10);

    // Session 100 evicted from d1: it goes back P→D; the sticky term keeps it on d1, whose live
    // overlap is gone: 0 + 2 − 1.0 = 1.0.
    r.state.observe(&Observation::Evicted {
        session: SessionId(100),
        worker: WorkerId(1),
    });
    let a2 = ctx_blocks(100, 0, 22);
    let req = r.request(100, 2, &a2);
    let d = r.decide(&ws, &req).unwrap();
    check(
        &d,
        1,
        dr,
        &[
            ("overlap", 0.0),
            ("sticky_term", 2.0),
            ("capacity_term", -1.0),
        ],
        1.0,
        true,
    );
    check(&d, 2, dr, &[("sticky_term", 0.0)], -0.6, true);
    assert_eq!(
        (d.mode, d.reason, d.decode),
        (
            ExecutionMode::Fallback,
            Some(FallThroughReason::SessionEvicted),
            WorkerId(1)
        )
    );
    // The P's prefix cache (grow-only) still holds the 24 blocks of turn 1.
    assert_eq!(d.cached_tokens, 24 * BS);
}

#[test]
fn kvc_v2_moves_a_resident_session_off_a_d_over_the_cap() {
    let mut ws = pd(1, 3);
    let mut r = Router::named("kvc-v2", &ws);
    let a = ctx_blocks(100, 0, 20);
    assert_eq!(r.serve(&ws, Some((100, 1)), &a).decode, WorkerId(1));
    set_used(&mut ws, 1, 90_000);
    set_used(&mut ws, 2, 20_000);
    set_load(&mut ws, 2, 2, 2);
    set_used(&mut ws, 3, 90_000);
    // A small append would go direct, but d1 is over the cap and d2 is under it.
    let a2 = ctx_blocks(100, 0, 21);
    let req = r.request(100, 2, &a2);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(
        (d.mode, d.reason, d.decode),
        (
            ExecutionMode::Reseed,
            Some(FallThroughReason::Migrated),
            WorkerId(2)
        )
    );
    let dr = WorkerRole::Decode;
    // d1 is excluded (the session leaves it); d3 is over the cap.
    check(
        &d,
        1,
        dr,
        &[
            ("overlap", 24.0),
            ("overlap_term", 1.0),
            ("capacity_term", -1.8),
        ],
        1.0 - 1.8,
        false,
    );
    check(&d, 2, dr, &[], -0.6, true);
    check(&d, 3, dr, &[], -1.8, false);
    assert_eq!(
        d.need_tokens,
        25 * BS + 10,
        "a reseed ships the whole context"
    );

    // Every D over the cap: no migration, the session goes direct.
    set_used(&mut ws, 2, 95_000);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!((d.mode, d.decode), (ExecutionMode::DirectToD, WorkerId(1)));
    assert_eq!(d.cached_tokens, 24 * BS);
    assert_eq!(d.need_tokens, BS + 10);
}

#[test]
fn kv_aware_v0_tuple() {
    let mut ws = pd(1, 3);
    let mut r = Router::named("kv-aware-v0", &ws);
    // First turns ignore the shared-prompt overlap: placement by in-flight, then assignments.
    for (s, want) in [(100, 1), (200, 2), (300, 3), (400, 1)] {
        let b = ctx_blocks(s, 0, 20);
        let d = r.serve(&ws, Some((s, 1)), &b);
        assert_eq!(
            (d.mode, d.decode),
            (ExecutionMode::Turn1Seed, WorkerId(want)),
            "session {s}"
        );
        assert_eq!(
            d.score(WorkerId(want), WorkerRole::Decode)
                .unwrap()
                .component("overlap"),
            Some(0.0)
        );
    }
    set_load(&mut ws, 2, 3, 0);
    // Session 100's append of 5 blocks (2,560 tokens) is over the 2,048 limit.
    let a2 = ctx_blocks(100, 0, 25);
    let req = r.request(100, 2, &a2);
    let d = r.decide(&ws, &req).unwrap();
    let dr = WorkerRole::Decode;
    check(
        &d,
        1,
        dr,
        &[
            ("overlap", 24.0),
            ("sticky_bonus", 1e6),
            ("sticky", 1.0),
            ("in_flight", 0.0),
            ("assignments", 2.0),
        ],
        1_000_024.0,
        true,
    );
    check(
        &d,
        2,
        dr,
        &[
            ("overlap", 4.0),
            ("sticky_bonus", 0.0),
            ("sticky", 0.0),
            ("in_flight", 3.0),
            ("assignments", 1.0),
        ],
        4.0,
        true,
    );
    check(
        &d,
        3,
        dr,
        &[("overlap", 4.0), ("in_flight", 0.0), ("assignments", 1.0)],
        4.0,
        true,
    );
    assert_eq!(
        (d.mode, d.reason, d.decode, d.prefill),
        (
            ExecutionMode::Fallback,
            Some(FallThroughReason::RealLargeAppend),
            WorkerId(1),
            Some(WorkerId(0))
        )
    );
    assert_eq!(
        d.cached_tokens,
        24 * BS,
        "P0 prefilled session 100's turn 1"
    );
    assert_eq!(d.need_tokens, 29 * BS + 10, "naive footprint");

    // An unknown session on a later turn counts overlap: 4 everywhere; d2 has 3 in flight, d1
    // two assignments, d3 one: d3 wins.
    let c = ctx_blocks(500, 0, 3);
    let req = r.request(500, 5, &c);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(
        (d.mode, d.reason, d.decode),
        (
            ExecutionMode::Fallback,
            Some(FallThroughReason::SessionNotResident),
            WorkerId(3)
        )
    );
    check(
        &d,
        1,
        dr,
        &[("overlap", 4.0), ("assignments", 2.0)],
        4.0,
        true,
    );
}

#[test]
fn cache_aware_rules() {
    let mut r = Router::named("cache-aware", &dp(3));
    let a = ctx_blocks(1, 0, 16);
    let d = r.serve(&dp(3), Some((1, 1)), &a);
    assert_eq!(
        (d.mode, d.decode, d.prefill),
        (ExecutionMode::Colocated, WorkerId(0), None)
    );
    let long = ctx_blocks(1, 0, 18); // 22 blocks, 20 known on w0: rate 20/22
    let short = ctx_blocks(2, 0, 6); // 10 blocks, 4 known on w0: rate 0.4
    let longer = ctx_blocks(2, 0, 16); // 20 blocks, 4 known on w0: rate 0.2
    let cr = WorkerRole::Colocated;
    // (blocks, loads of w0..w2) -> (chosen, imbalanced, by prefix)
    type Case<'a> = (&'a [BlockHash], [u32; 3], u32, bool, bool);
    let cases: [Case<'_>; 7] = [
        (&long, [0, 0, 0], 0, false, true),
        (&long, [100, 10, 30], 1, true, false),
        (&long, [100, 40, 50], 0, false, true), // gap 60 <= 64
        (&long, [200, 135, 150], 0, false, true), // gap 65 but 200 <= 1.5 x 135
        (&short, [1, 0, 0], 0, false, true),
        (&longer, [1, 0, 0], 1, false, false),
        // Equal loads: the fewest assignments wins (w0 already served the set-up requests).
        (&longer, [0, 0, 0], 1, false, false),
    ];
    for (i, (blocks, loads, want, imbalanced, by_prefix)) in cases.into_iter().enumerate() {
        let mut ws = dp(3);
        for (w, l) in loads.iter().enumerate() {
            set_load(&mut ws, w as u32, *l, 0);
        }
        let req = RouteRequest::new(RequestId(99), blocks.len() as u64 * BS, 10, blocks);
        let d = r.decide(&ws, &req).unwrap();
        assert_eq!(d.decode, WorkerId(want), "case {i}");
        assert_eq!(d.mode, ExecutionMode::Colocated);
        let known = if blocks.as_ptr() == long.as_ptr() {
            20.0
        } else {
            4.0
        };
        let rate0 = known / blocks.len() as f64;
        let total0 = if by_prefix {
            rate0
        } else {
            -f64::from(loads[0])
        };
        check(
            &d,
            0,
            cr,
            &[
                ("load", f64::from(loads[0])),
                ("match_blocks", known),
                ("match_rate", rate0),
                ("imbalanced", f64::from(u8::from(imbalanced))),
            ],
            total0,
            true,
        );
        let total1 = if by_prefix { 0.0 } else { -f64::from(loads[1]) };
        check(
            &d,
            1,
            cr,
            &[("match_blocks", 0.0), ("match_rate", 0.0)],
            total1,
            true,
        );
        assert_eq!(
            d.cached_tokens,
            if want == 0 { known as u64 * BS } else { 0 },
            "case {i}"
        );
    }
    // In P/D, P and D are picked independently and every turn goes P→D.
    let ws = pd(2, 2);
    let mut r = Router::named("cache-aware", &ws);
    let d1 = r.serve(&ws, Some((1, 1)), &a);
    assert_eq!(
        (d1.mode, d1.prefill, d1.decode),
        (ExecutionMode::Turn1Seed, Some(WorkerId(0)), WorkerId(2))
    );
    let req = r.request(1, 2, &long);
    let d2 = r.decide(&ws, &req).unwrap();
    assert_eq!(
        (d2.mode, d2.reason),
        (
            ExecutionMode::Fallback,
            Some(FallThroughReason::SessionNotResident)
        )
    );
    assert_eq!((d2.prefill, d2.decode), (Some(WorkerId(0)), WorkerId(2)));
    assert_eq!(d2.cached_tokens, 20 * BS);
    check(
        &d2,
        0,
        WorkerRole::Prefill,
        &[("match_blocks", 20.0)],
        20.0 / 22.0,
        true,
    );
}

#[test]
fn round_robin_order_skips_unhealthy_workers() {
    let mut ws = pd(2, 3);
    let mut r = Router::named("round-robin", &ws);
    let b = ctx_blocks(1, 0, 2);
    let mut seen = Vec::new();
    for turn in 1..=4 {
        let d = r.serve(&ws, Some((1, turn)), &b);
        seen.push((d.prefill.unwrap().0, d.decode.0));
        if turn == 1 {
            check(&d, 2, WorkerRole::Decode, &[("rr_order", 0.0)], 0.0, true);
            check(&d, 4, WorkerRole::Decode, &[("rr_order", 2.0)], -2.0, true);
        }
        if turn == 2 {
            assert_eq!(d.reason, Some(FallThroughReason::SessionNotResident));
        }
    }
    assert_eq!(seen, vec![(0, 2), (1, 3), (0, 4), (1, 2)]);
    set_health(&mut ws, 3, Health::Down);
    set_health(&mut ws, 0, Health::Stale);
    let d = r.serve(&ws, Some((1, 5)), &b);
    assert_eq!((d.prefill, d.decode), (Some(WorkerId(1)), WorkerId(4)));
    assert!(
        d.score(WorkerId(3), WorkerRole::Decode).is_none(),
        "unhealthy workers are not candidates"
    );
    let d = r.serve(&ws, Some((1, 6)), &b);
    assert_eq!(d.decode, WorkerId(2));
    // Colocated: the same rotation.
    let mut r = Router::named("round-robin", &dp(3));
    let got: Vec<u32> = (0..4).map(|_| r.serve(&dp(3), None, &b).decode.0).collect();
    assert_eq!(got, vec![0, 1, 2, 0]);
}

fn change(request: u64, p: u32, d: u32) -> StateChange {
    StateChange {
        request_id: RequestId(request),
        session: None,
        now_ms: 0,
        decode: WorkerId(d),
        decode_role: WorkerRole::Decode,
        prefill: Some(WorkerId(p)),
        direct: false,
        blocks: vec![],
        reject_count: None,
        prefill_us: 0,
    }
}

#[test]
fn d_health_aware_prefill_cost() {
    let cfg = PolicyConfig::KvcV2(KvcV2Config {
        prefill: PrefillPolicy::DHealthAware,
        ..KvcV2Config::default()
    });
    let base = pd(2, 2);
    let mut r = Router::new(cfg, &base);
    r.state.apply(&change(1, 0, 2));
    r.state.apply(&change(2, 0, 2));
    r.state.apply(&change(3, 1, 3));
    assert_eq!(r.state.pair_in_flight(WorkerId(0), WorkerId(2)), 2);
    assert_eq!(r.state.in_flight(WorkerId(0)), 2);
    let b = ctx_blocks(9, 0, 2);
    let req = RouteRequest::new(RequestId(10), 6 * BS, 1, &b);
    let pr = WorkerRole::Prefill;

    // Target d2 (d3 down), d2 has 3 queued: P0 = 2 + 2 × (1 + 3) = 10; P1 = (1 + 1) + 0 = 2.
    let mut ws = base.clone();
    set_health(&mut ws, 3, Health::Down);
    set_load(&mut ws, 2, 0, 3);
    set_load(&mut ws, 1, 0, 1);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!((d.decode, d.prefill), (WorkerId(2), Some(WorkerId(1))));
    check(
        &d,
        0,
        pr,
        &[
            ("p_load", 2.0),
            ("pair_in_flight", 2.0),
            ("d_queue_depth", 3.0),
            ("rr_order", 0.0),
        ],
        -10.0,
        true,
    );
    check(
        &d,
        1,
        pr,
        &[("p_load", 2.0), ("pair_in_flight", 0.0), ("rr_order", 1.0)],
        -2.0,
        true,
    );

    // Target d3 (d2 down), no queue: P0 = 2; P1 = 2 + 1 × 1 = 3.
    let mut ws = base.clone();
    set_health(&mut ws, 2, Health::Down);
    set_load(&mut ws, 1, 0, 1);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!((d.decode, d.prefill), (WorkerId(3), Some(WorkerId(0))));
    check(&d, 1, pr, &[("pair_in_flight", 1.0)], -3.0, true);

    // Equal costs (P0 = 2 + 0; P1 = 1 + 1 × 1): round-robin order after the last P chosen
    // (P1), so P0.
    let mut ws = base.clone();
    set_health(&mut ws, 2, Health::Down);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(d.prefill, Some(WorkerId(0)));
    check(&d, 0, pr, &[("p_load", 2.0), ("rr_order", 0.0)], -2.0, true);
    check(&d, 1, pr, &[("p_load", 1.0), ("rr_order", 1.0)], -2.0, true);
    // Once P0 is the last one chosen, the same tie goes to P1.
    r.state.apply(&change(4, 0, 2));
    r.state.observe(&Observation::Completed {
        request_id: RequestId(4),
        session: None,
        worker: WorkerId(2),
        outcome: kvc_core::Outcome::Ok,
        resident_tokens: 0,
        direct: false,
    });
    assert_eq!(r.state.cursor(WorkerRole::Prefill), Some(WorkerId(0)));
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(d.prefill, Some(WorkerId(1)));
}

#[test]
fn prefix_aware_prefill_goes_where_the_prefix_is_unless_that_p_is_a_request_busier() {
    let config = |prefill| {
        PolicyConfig::KvcV2(KvcV2Config {
            prefill,
            ..KvcV2Config::default()
        })
    };
    let base = pd(2, 1);
    let mut r = Router::new(config(PrefillPolicy::PrefixAware), &base);
    // P1 prefilled session 9's first 8 context blocks (and the system prompt) for d2, answered.
    let seen = ctx_blocks(9, 0, 8);
    r.state.apply(&StateChange {
        blocks: seen.clone(),
        ..change(1, 1, 2)
    });
    r.state.observe(&Observation::Completed {
        request_id: RequestId(1),
        session: None,
        worker: WorkerId(2),
        outcome: kvc_core::Outcome::Ok,
        resident_tokens: 0,
        direct: false,
    });
    assert_eq!(r.state.cursor(WorkerRole::Prefill), Some(WorkerId(1)));
    // The next request extends that prompt by 8 blocks: P1 holds half of it (or more: the
    // shared system prompt), P0 nothing.
    let b = ctx_blocks(9, 0, 16);
    let req = RouteRequest::new(RequestId(10), b.len() as u64 * BS, 1, &b);
    let cached = seen.len() as f64;
    let share_p1 = (b.len() as f64 - cached) / b.len() as f64;
    let pr = WorkerRole::Prefill;

    // Idle P's: round-robin order would take P0 (after P1); the cache takes P1.
    let d = r.decide(&base, &req).unwrap();
    assert_eq!(d.prefill, Some(WorkerId(1)));
    check(
        &d,
        0,
        pr,
        &[("compute_share", 1.0), ("rr_order", 0.0)],
        -1.0,
        true,
    );
    check(
        &d,
        1,
        pr,
        &[("compute_share", share_p1), ("rr_order", 1.0)],
        -share_p1,
        true,
    );

    // P1 one request busier: 1 + share against P0's 0 + 1; P0 is cheaper.
    let mut ws = base.clone();
    set_load(&mut ws, 1, 0, 1);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(d.prefill, Some(WorkerId(0)));
    check(&d, 1, pr, &[("p_load", 1.0)], -(1.0 + share_p1), true);

    // d-health-aware on the same state is blind to the cache: round-robin order, P0.
    let blind = Router {
        config: config(PrefillPolicy::DHealthAware),
        ..r
    };
    let d = blind.decide(&base, &req).unwrap();
    assert_eq!(d.prefill, Some(WorkerId(0)));
    assert!(
        d.scores
            .iter()
            .all(|e| e.component("compute_share").is_none())
    );
}

#[test]
fn d_health_aware_prefill_avoids_a_pair_whose_transfers_keep_failing() {
    let cfg = PolicyConfig::KvcV2(KvcV2Config {
        prefill: PrefillPolicy::DHealthAware,
        ..KvcV2Config::default()
    });
    let base = pd(2, 2);
    let mut r = Router::new(cfg, &base);
    let completed = |id: u64, outcome| Observation::Completed {
        request_id: RequestId(id),
        session: None,
        worker: WorkerId(2),
        outcome,
        resident_tokens: 0,
        direct: false,
    };
    // Two transfers P0 → d2 time out; one P1 → d2 does too, then one through P1 is served.
    for (id, p) in [(1, 0), (2, 0), (3, 1), (4, 1)] {
        r.state.apply(&change(id, p, 2));
    }
    for id in 1..=3 {
        r.state
            .observe(&completed(id, kvc_core::Outcome::KvTransferTimeout));
    }
    r.state.observe(&completed(4, kvc_core::Outcome::Ok));
    assert_eq!(r.state.pair_failures(WorkerId(0), WorkerId(2)), 2);
    assert_eq!(r.state.pair_failures(WorkerId(1), WorkerId(2)), 0);
    assert_eq!(r.state.pair_failures(WorkerId(0), WorkerId(3)), 0);

    // Target d2 (d3 down): P0 = 0 + 8 × 2 = 16, P1 = 2 queued = 2.
    let mut ws = base.clone();
    set_health(&mut ws, 3, Health::Down);
    set_load(&mut ws, 1, 0, 2);
    let b = ctx_blocks(9, 0, 2);
    let req = RouteRequest::new(RequestId(10), 6 * BS, 1, &b);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!((d.decode, d.prefill), (WorkerId(2), Some(WorkerId(1))));
    check(
        &d,
        0,
        WorkerRole::Prefill,
        &[("pair_failures", 2.0)],
        -16.0,
        true,
    );
    // Round-robin does not look: it takes P0 after P1.
    let mut rr = Router::new(
        PolicyConfig::KvcV2(KvcV2Config {
            prefill: PrefillPolicy::RoundRobin,
            ..KvcV2Config::default()
        }),
        &base,
    );
    rr.state.apply(&change(1, 1, 2));
    let d = rr.decide(&ws, &req).unwrap();
    assert_eq!(d.prefill, Some(WorkerId(0)));
}

#[test]
fn kvc_places_a_new_session_away_from_active_sessions() {
    // 1 P + 2 D, identical state: the only difference is that d1 hosts an active session.
    let ws = pd(1, 2);
    let mut r = Router::named("kvc", &ws);
    let a = ctx_blocks(1, 0, 8);
    let first = r.serve(&ws, Some((1, 1)), &a);
    assert_eq!(first.mode, ExecutionMode::Turn1Seed);
    let busy = first.decode;
    let b = ctx_blocks(2, 0, 8);
    let req = RouteRequest::new(RequestId(50), 8 * BS, 10, &b).in_session(SessionId(2), TurnId(1));
    let d = r.decide(&ws, &req).unwrap();
    let other = if busy == WorkerId(1) {
        WorkerId(2)
    } else {
        WorkerId(1)
    };
    assert_eq!(
        d.decode, other,
        "the new session avoids the D with an active session"
    );
    let dr = WorkerRole::Decode;
    // Hand-computed: active_term = −0.5 × 1 on the busy D, 0 on the other; nothing else differs
    // (no load, no committed memory, no overlap beyond the shared system prompt on the busy D).
    let e_busy = d.score(busy, dr).unwrap();
    let e_other = d.score(other, dr).unwrap();
    assert!(approx(e_busy.component("active_term").unwrap(), -0.5));
    assert!(approx(e_other.component("active_term").unwrap(), 0.0));
    // kvc-v2 has no such term: it reports 0 everywhere.
    let v2 = Router::named("kvc-v2", &ws);
    let dv2 = v2.decide(&ws, &req).unwrap();
    assert!(approx(
        dv2.score(busy, dr)
            .unwrap()
            .component("active_term")
            .unwrap(),
        0.0
    ));
    // A session routed longer ago than the window no longer counts.
    let later = route(&r.config, &r.state, &ClusterView::new(31_000, &ws), &req).unwrap();
    assert!(approx(
        later
            .score(busy, dr)
            .unwrap()
            .component("active_term")
            .unwrap(),
        0.0
    ));
}
