//! Capabilities and `kvc`'s local prefill: which workers may prefill a turn, how the cost
//! picks between local prefill and P→D, and the router's prefill backlog.

mod common;

use common::*;
use kvc_core::{
    Capabilities, ExecutionMode, FallThroughReason, Outcome, RequestId, SessionId, Topology,
    WorkerId, WorkerRole,
};
use kvc_policy::{
    ClusterView, LocalPrefillConfig, Observation, PolicyConfig, PolicyError, RouteRequest,
    WorkerView,
};

/// `n` all-capable workers.
fn all_capable(n: u32) -> Vec<WorkerView> {
    (0..n)
        .map(|i| worker(i, WorkerRole::Decode).with_caps(Capabilities::ALL))
        .collect()
}

fn kvc() -> PolicyConfig {
    PolicyConfig::from_name("kvc").unwrap()
}

/// Makes P0's prefill backlog at least `seconds` long: pending turns through it, each with a
/// one-second prefill estimate (applied, not completed), as a router that sent them would hold.
fn load_backlog(r: &mut Router, ws: &[WorkerView], seconds: f64) {
    for _ in 0..100 {
        if r.state.prefill_backlog_s(WorkerId(0)) >= seconds {
            return;
        }
        let session = 900 + r.next_request;
        let blocks = ctx_blocks(session, 0, 80);
        let req = r.request(session, 1, &blocks);
        let mut d = r.decide(ws, &req).unwrap();
        d.change.prefill = Some(WorkerId(0));
        d.change.prefill_us = 1_000_000;
        r.state.apply(&d.change);
    }
    panic!("the backlog does not grow");
}

#[test]
fn views_name_the_topology_their_capabilities_make() {
    let view = |ws: &[WorkerView]| ClusterView::new(0, ws).topology();
    assert_eq!(
        view(&pd_local(1, 3)).unwrap(),
        Topology::Disaggregated {
            prefill: 1,
            decode: 3
        }
    );
    let mut hybrid = pd_local(2, 6);
    for w in hybrid.iter_mut().take(2) {
        *w = w.with_caps(Capabilities::of_role(WorkerRole::Prefill).with_local());
    }
    assert_eq!(
        view(&hybrid).unwrap(),
        Topology::Hybrid {
            prefill: 2,
            decode: 6
        }
    );
    assert_eq!(
        view(&all_capable(4)).unwrap(),
        Topology::AllCapable { workers: 4 }
    );
    // Decode workers that cannot prefill for others still need a prefill worker.
    let only_d: Vec<WorkerView> = (0..3)
        .map(|i| worker(i, WorkerRole::Decode).with_caps(Capabilities::ALL.with_local()))
        .map(|w| {
            w.with_caps(Capabilities {
                prefill: false,
                ..w.caps
            })
        })
        .collect();
    assert!(matches!(
        view(&only_d),
        Err(PolicyError::WrongTopology { .. })
    ));
    // The role's capabilities are the default: no local prefill unless declared.
    assert!(!worker(1, WorkerRole::Decode).caps.local);
}

#[test]
fn first_turn_goes_through_an_idle_prefill_worker_and_local_when_p_is_backed_up() {
    let ws = pd_local(1, 3);
    let mut r = Router::new(kvc(), &ws);
    // Every D has requests decoding: a prefill there holds them up, P is idle.
    let mut busy = ws.clone();
    for id in 1..4 {
        set_load(&mut busy, id, 8, 0);
    }
    let blocks = ctx_blocks(1, 0, 20);
    let d = r.decide(&busy, &r_req(1, &blocks)).unwrap();
    assert_eq!(d.mode, ExecutionMode::Turn1Seed);
    assert_eq!(d.prefill, Some(WorkerId(0)));
    assert!(d.change.prefill_us > 0);
    // P has seconds of prefill queued: the turn is served alone on a D.
    load_backlog(&mut r, &ws, 3.0);
    let d = r.decide(&busy, &r_req(2, &blocks)).unwrap();
    assert_eq!(d.mode, ExecutionMode::LocalPrefill);
    assert_eq!(d.prefill, None);
    assert_eq!(d.reason, None, "a first turn has no fall-through reason");
    assert_ne!(d.decode, WorkerId(0));
    // The whole prompt is allocated for the session on that D.
    assert_eq!(d.need_tokens, blocks.len() as u64 * BS + 10);
    // Off, kvc sends it through P whatever P's backlog.
    let mut off = kvc();
    if let PolicyConfig::Kvc(c) = &mut off {
        c.local_prefill = LocalPrefillConfig::OFF;
    }
    let d = kvc_policy::route(
        &off,
        &r.state,
        &ClusterView::new(0, &busy),
        &r_req(3, &blocks),
    )
    .unwrap();
    assert_eq!(d.mode, ExecutionMode::Turn1Seed);
}

fn r_req(session: u64, blocks: &[kvc_core::BlockHash]) -> RouteRequest<'_> {
    RouteRequest::new(
        RequestId(10_000 + session),
        blocks.len() as u64 * BS,
        10,
        blocks,
    )
    .in_session(SessionId(session), kvc_core::TurnId(1))
}

#[test]
fn engines_declared_unable_never_get_local_turns() {
    // Decode workers without the capability (stock SGLang), or declared without
    // append-prefill: every turn that is not direct goes through P, however long P's queue.
    for declare in [false, true] {
        let ws = if declare { pd_local(1, 2) } else { pd(1, 2) };
        let mut r = Router::new(kvc(), &ws);
        if declare {
            r.state.set_direct_append(WorkerId(1), false);
            r.state.set_direct_append(WorkerId(2), false);
        }
        load_backlog(&mut r, &ws, 5.0);
        let blocks = ctx_blocks(3, 0, 20);
        let d = r.decide(&ws, &r_req(3, &blocks)).unwrap();
        assert_eq!(d.mode, ExecutionMode::Turn1Seed, "declared {declare}");
    }
    // Other policies never plan local prefill.
    let ws = pd_local(1, 2);
    for name in ["round-robin", "cache-aware", "kv-aware-v0", "kvc-v2"] {
        let mut r = Router::named(name, &ws);
        load_backlog(&mut r, &ws, 5.0);
        let blocks = ctx_blocks(4, 0, 20);
        let d = r.decide(&ws, &r_req(4, &blocks)).unwrap();
        assert_ne!(d.mode, ExecutionMode::LocalPrefill, "{name}");
    }
}

#[test]
fn a_large_append_is_prefilled_on_the_sessions_own_worker_and_a_reject_goes_through_p() {
    let ws = pd_local(1, 2);
    let mut r = Router::new(kvc(), &ws);
    let t1 = ctx_blocks(5, 0, 10);
    let seed = r.serve(&ws, Some((5, 1)), &t1);
    let home = seed.decode;
    // 30 new blocks (15,360 tokens) is over the direct limit; P is backed up.
    load_backlog(&mut r, &ws, 3.0);
    let mut t2 = t1.clone();
    t2.extend(ctx_blocks(5, 0, 40).into_iter().skip(14));
    let req = r.request(5, 2, &t2);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(d.mode, ExecutionMode::LocalPrefill);
    assert_eq!(
        d.decode, home,
        "a resident session is prefilled where it lives"
    );
    assert_eq!(d.reason, Some(FallThroughReason::RealLargeAppend));
    assert_eq!(d.cached_tokens, 14 * BS);
    // Only what is not resident is allocated.
    assert_eq!(d.need_tokens, (t2.len() as u64 - 14) * BS + 10);
    // Refused there: the re-route is a P→D path, never local.
    let again = r.decide(&ws, &req.rejected_by(home)).unwrap();
    assert!(matches!(
        again.mode,
        ExecutionMode::Fallback | ExecutionMode::Reseed
    ));
    assert_eq!(again.prefill, Some(WorkerId(0)));
}

#[test]
fn all_capable_workers_serve_alone_and_never_ship_to_themselves() {
    let ws = all_capable(3);
    let mut r = Router::new(kvc(), &ws);
    for s in 0..6 {
        let blocks = ctx_blocks(20 + s, 0, 12);
        let d = r.serve(&ws, Some((20 + s, 1)), &blocks);
        assert_eq!(d.mode, ExecutionMode::LocalPrefill);
    }
    // Policies that only know P→D pick a P other than the D.
    for name in ["round-robin", "cache-aware", "kv-aware-v0", "kvc-v2"] {
        let mut r = Router::named(name, &ws);
        for s in 0..6 {
            let blocks = ctx_blocks(40 + s, 0, 12);
            let d = r.serve(&ws, Some((40 + s, 1)), &blocks);
            assert!(d.prefill.is_some() && d.prefill != Some(d.decode), "{name}");
        }
    }
    // One healthy worker: nothing to ship from, so a P→D-only policy has no P.
    let mut one = all_capable(2);
    set_health(&mut one, 1, kvc_core::Health::Down);
    let r = Router::named("kvc-v2", &one);
    let blocks = ctx_blocks(60, 0, 4);
    assert!(matches!(
        r.decide(&one, &r_req(60, &blocks)),
        Err(PolicyError::NoHealthyWorker {
            role: WorkerRole::Prefill
        })
    ));
}

#[test]
fn a_prefill_worker_that_hosts_sessions_prefills_only_for_hosts_that_cannot() {
    // 1p2d-hybrid: P hosts sessions too. D1 serves alone, D2 cannot.
    let mut ws = pd_local(1, 2);
    ws[0] = ws[0].with_caps(Capabilities::of_role(WorkerRole::Prefill).with_local());
    ws[2] = ws[2].with_caps(Capabilities::of_role(WorkerRole::Decode));
    let r = Router::new(kvc(), &ws);
    let view = ClusterView::new(0, &ws);
    assert_eq!(
        view.topology().unwrap(),
        Topology::Hybrid {
            prefill: 1,
            decode: 2
        }
    );
    let blocks = ctx_blocks(70, 0, 16);
    let d = r.decide(&ws, &r_req(70, &blocks)).unwrap();
    match d.mode {
        ExecutionMode::LocalPrefill => assert!(d.decode == WorkerId(0) || d.decode == WorkerId(1)),
        _ => {
            assert_eq!(
                d.decode,
                WorkerId(2),
                "P→D only to the D that cannot serve alone"
            );
            assert_eq!(d.prefill, Some(WorkerId(0)));
        }
    }
}

#[test]
fn the_backlog_counts_prefills_until_their_first_token_or_completion() {
    let mut ws = pd_local(1, 2);
    let mut r = Router::new(kvc(), &ws);
    // Busy decode workers: an idle P prefills.
    set_load(&mut ws, 1, 8, 0);
    set_load(&mut ws, 2, 8, 0);
    let p = WorkerId(0);
    assert_eq!(r.state.prefill_backlog_s(p), 0.0);
    let blocks = ctx_blocks(80, 0, 20);
    let req = r_req(80, &blocks);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(d.prefill, Some(p));
    let us = d.change.prefill_us;
    assert!(us > 0);
    r.state.apply(&d.change);
    assert!(approx(r.state.prefill_backlog_s(p), us as f64 / 1e6));
    // Applying the same request again (a re-route) replaces it.
    r.state.apply(&d.change);
    assert!(approx(r.state.prefill_backlog_s(p), us as f64 / 1e6));
    r.state.observe(&Observation::PrefillDone {
        request_id: req.request_id,
        at_ms: None,
    });
    assert_eq!(r.state.prefill_backlog_s(p), 0.0);
    // Completion after the first token takes nothing more away; without one, it does.
    r.state.observe(&Observation::Completed {
        request_id: req.request_id,
        session: req.session,
        worker: d.decode,
        outcome: Outcome::Ok,
        resident_tokens: 100,
        direct: false,
    });
    assert_eq!(r.state.prefill_backlog_s(p), 0.0);
    let blocks2 = ctx_blocks(81, 0, 20);
    let req2 = r_req(81, &blocks2);
    let d2 = r.decide(&ws, &req2).unwrap();
    r.state.apply(&d2.change);
    assert!(
        r.state
            .prefill_backlog_s(d2.change.prefill.unwrap_or(d2.decode))
            > 0.0
    );
    r.state.observe(&Observation::Completed {
        request_id: req2.request_id,
        session: req2.session,
        worker: d2.decode,
        outcome: Outcome::KvTransferTimeout,
        resident_tokens: 0,
        direct: false,
    });
    for w in 0..3 {
        assert_eq!(r.state.prefill_backlog_s(WorkerId(w)), 0.0);
    }
}

#[test]
fn local_prefill_knobs_are_checked() {
    for bad in [
        r#"{"policy":"kvc","local-prefill":{"prefill-tokens-per-s":0}}"#,
        r#"{"policy":"kvc","local-prefill":{"interference-weight":-1}}"#,
    ] {
        let cfg: PolicyConfig = serde_json::from_str(bad).unwrap();
        assert!(matches!(
            cfg.validate(),
            Err(PolicyError::InvalidConfig { policy: "kvc", .. })
        ));
    }
    assert!(
        serde_json::from_str::<PolicyConfig>(r#"{"policy":"kvc","local-prefill":{"nope":1}}"#)
            .is_err()
    );
    let ok: PolicyConfig =
        serde_json::from_str(r#"{"policy":"kvc","local-prefill":{"enabled":false}}"#).unwrap();
    assert!(ok.validate().is_ok());
}

/// 1P1D whose prefill worker also serves turns alone and has a pool a hundred times the decode
/// worker's (a decode engine cut to a session or two beside a prefill engine with room for all
/// of them). With pools of one size, new sessions split between the two by the count of active
/// sessions; with these pools an active session on the small one weighs a hundred times as
/// much, and the small pool takes one session at a time.
#[test]
fn an_active_session_weighs_by_the_pool_it_fills() {
    const SMALL: u64 = 20 * BS; // 10,240 tokens: one session of 12 blocks (6,144 tokens)
    let cluster = |small: u64| {
        vec![
            WorkerView::new(
                WorkerId(0),
                WorkerRole::Prefill,
                kvc_core::WorkerState::empty(100 * SMALL),
            )
            .with_caps(Capabilities::of_role(WorkerRole::Prefill).with_local()),
            WorkerView::new(
                WorkerId(1),
                WorkerRole::Decode,
                kvc_core::WorkerState::empty(small),
            )
            .with_caps(Capabilities::of_role(WorkerRole::Decode).with_local()),
        ]
    };
    // Sessions 1..=n placed in turn (the system prompt's 4 blocks and 8 of their own), each
    // one still active when the next is placed.
    let hosts = |r: &mut Router, ws: &[WorkerView], n: u64| -> Vec<u32> {
        (1..=n)
            .map(|s| r.serve(ws, Some((s, 1)), &ctx_blocks(s, 0, 8)).decode.0)
            .collect()
    };
    let on_small = |placed: &[u32]| placed.iter().filter(|&&h| h == 1).count();
    let even = cluster(100 * SMALL);
    let placed = hosts(&mut Router::named("kvc", &even), &even, 8);
    assert_eq!(on_small(&placed), 4, "pools of one size: {placed:?}");

    let ws = cluster(SMALL);
    let mut r = Router::named("kvc", &ws);
    let placed = hosts(&mut r, &ws, 16);
    assert_eq!(on_small(&placed), 1, "a small pool: {placed:?}");
    let blocks = ctx_blocks(17, 0, 8);
    let req = r.request(17, 1, &blocks);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(d.decode, WorkerId(0));
    let dr = WorkerRole::Decode;
    // The small pool's one active session: −0.25 × 1 × 100; the large pool's fifteen:
    // −0.25 × 15 × 1 (`local-prefill.active-weight`, where local prefill is planned).
    let small = d.score(WorkerId(1), dr).unwrap();
    assert!(approx(small.component("pool_scale").unwrap(), 100.0));
    assert!(approx(small.component("active_term").unwrap(), -25.0));
    let large = d.score(WorkerId(0), dr).unwrap();
    assert!(approx(large.component("pool_scale").unwrap(), 1.0));
    assert!(approx(
        large.component("active_term").unwrap(),
        -0.25 * 15.0
    ));
    // Once the small pool's session has been quiet for the active window, it takes the next.
    let quiet = RouteRequest::new(RequestId(900), 12 * BS, 10, &blocks)
        .in_session(SessionId(17), kvc_core::TurnId(1));
    let later =
        kvc_policy::route(&r.config, &r.state, &ClusterView::new(31_000, &ws), &quiet).unwrap();
    assert_eq!(later.decode, WorkerId(1));
}

/// Applies a first turn of `session` (`n` blocks past the system prompt) on `worker`, as a
/// router that sent it there holds it: in flight, its prefill estimate in the backlog.
fn send_to(
    r: &mut Router,
    ws: &[WorkerView],
    session: u64,
    n: usize,
    worker: u32,
) -> (RequestId, u64) {
    let blocks = ctx_blocks(session, 0, n);
    let req = r.request(session, 1, &blocks);
    let mut d = r.decide(ws, &req).unwrap();
    assert_eq!(d.mode, ExecutionMode::Colocated);
    d.change.decode = WorkerId(worker);
    r.state.apply(&d.change);
    (req.request_id, d.change.prefill_us)
}

#[test]
fn a_workers_pace_is_its_measured_first_tokens_over_the_estimates() {
    let ws = dp(2);
    let mut r = Router::new(kvc(), &ws);
    let w0 = WorkerId(0);
    // A colocated turn carries its prefill estimate, counted in its worker's backlog.
    let (id, us) = send_to(&mut r, &ws, 1, 20, 0);
    assert!(us > 1_000, "an estimate of {us} µs");
    assert!(approx(r.state.prefill_backlog_s(w0), us as f64 / 1e6));
    // First tokens ten times later than the estimates (decisions at 0 ms): the pace is 1
    // until three have come, then 10.
    let ten_times = |us: u64| Some((us * 10).div_ceil(1_000));
    r.state.observe(&Observation::PrefillDone {
        request_id: id,
        at_ms: ten_times(us),
    });
    assert_eq!(r.state.prefill_backlog_s(w0), 0.0);
    assert_eq!(r.state.prefill_pace(w0), 1.0);
    let (id, us) = send_to(&mut r, &ws, 2, 20, 0);
    r.state.observe(&Observation::PrefillDone {
        request_id: id,
        at_ms: ten_times(us),
    });
    assert_eq!(r.state.prefill_pace(w0), 1.0);
    let (id, us) = send_to(&mut r, &ws, 3, 20, 0);
    r.state.observe(&Observation::PrefillDone {
        request_id: id,
        at_ms: ten_times(us),
    });
    let pace = r.state.prefill_pace(w0);
    assert!((pace - 10.0).abs() < 0.1, "pace {pace}");
    // Reported again, or without a time, a first token adds no sample.
    r.state.observe(&Observation::PrefillDone {
        request_id: id,
        at_ms: Some(1_000_000),
    });
    assert_eq!(r.state.prefill_pace(w0), pace);
    // The backlog in the worker's own time.
    let (_, us) = send_to(&mut r, &ws, 4, 20, 0);
    assert!(approx(r.state.paced_backlog_s(w0), pace * us as f64 / 1e6));
    // The other worker's first tokens came without a time: its pace stays 1.
    for s in 5..9 {
        let (id, _) = send_to(&mut r, &ws, s, 20, 1);
        r.state.observe(&Observation::PrefillDone {
            request_id: id,
            at_ms: None,
        });
    }
    assert_eq!(r.state.prefill_pace(WorkerId(1)), 1.0);
}

#[test]
fn a_colocated_session_is_placed_where_less_prefill_waits_at_the_workers_pace() {
    let ws = dp(2);
    let disabled: PolicyConfig =
        serde_json::from_str(r#"{"policy":"kvc","local-prefill":{"enabled":false}}"#).unwrap();
    // (configuration, worker 0's first tokens measured, where the new session goes)
    for (config, measured, expected) in [
        (kvc(), true, 1),
        (kvc(), false, 0),
        (disabled.clone(), true, 0),
    ] {
        let enabled = config != disabled;
        let mut r = Router::new(config, &ws);
        // Worker 0 measured at 400 times the estimates (a CPU engine against rates for a GPU
        // one), or not measured at all (its first tokens came without a time).
        // Those sessions then end (nothing of them kept there).
        for s in 1..4 {
            let (id, us) = send_to(&mut r, &ws, s, 20, 0);
            let at_ms = measured.then(|| (us * 400).div_ceil(1_000));
            r.state.observe(&Observation::PrefillDone {
                request_id: id,
                at_ms,
            });
            r.state.observe(&Observation::Completed {
                request_id: id,
                session: Some(SessionId(s)),
                worker: WorkerId(0),
                outcome: Outcome::Ok,
                resident_tokens: 0,
                direct: false,
            });
        }
        // One prompt of 10 blocks waits on worker 0, two of one block on worker 1: by the
        // count of requests in flight worker 0 is the lighter; by the prefill waiting there at
        // its pace, the heavier by seconds.
        send_to(&mut r, &ws, 10, 10, 0);
        send_to(&mut r, &ws, 11, 1, 1);
        send_to(&mut r, &ws, 12, 1, 1);
        let blocks = ctx_blocks(20, 0, 20);
        let req = r.request(20, 1, &blocks);
        let d = r.decide(&ws, &req).unwrap();
        let term = |w: u32| {
            d.score(WorkerId(w), WorkerRole::Colocated)
                .and_then(|s| s.component("path_term"))
        };
        assert_eq!(
            d.decode,
            WorkerId(expected),
            "measured {measured}, enabled {enabled}"
        );
        if enabled {
            let (t0, t1) = (term(0).unwrap(), term(1).unwrap());
            assert!(t0 < t1, "path terms {t0} and {t1}");
            if measured {
                assert!(t0 < t1 - 10.0, "path terms {t0} and {t1}");
            }
            assert!(d.change.prefill_us > 0);
        } else {
            assert_eq!((term(0), term(1)), (None, None));
            assert_eq!(d.change.prefill_us, 0);
        }
    }
}
