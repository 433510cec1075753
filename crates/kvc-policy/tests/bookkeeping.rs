//! Router-state bookkeeping, turn classification, backpressure hints, errors and the
//! decision's serialized shape.

mod common;

use common::*;
use kvc_core::{
    BlockHash, ExecutionMode, FallThroughReason, Health, Outcome, RequestId, SessionId, WorkerId,
    WorkerRole,
};
use kvc_policy::{
    BackpressureConfig, ClusterView, KvcV2Config, Observation, PolicyConfig, PolicyError,
    Residency, RouteRequest, RouterState, TurnClass, WorkerView, classify_turn,
    recommended_pause_ms, route,
};

const ALL: [&str; 5] = ["round-robin", "cache-aware", "kv-aware-v0", "kvc-v2", "kvc"];

fn sid(s: u64) -> SessionId {
    SessionId(s)
}

#[test]
fn classify_turn_precedence() {
    let mut ws = pd(1, 2);
    let mut r = Router::named("kvc-v2", &ws);
    let t1 = ctx_blocks(5, 0, 8);
    let d0 = r.serve(&ws, Some((5, 1)), &t1).decode;
    let t2 = ctx_blocks(5, 0, 9);
    let bs = kvc_core::BlockSize::default();
    let class = |r: &Router, ws: &[WorkerView], req: &RouteRequest<'_>, limit| {
        classify_turn(req, &r.state, &ClusterView::new(0, ws), limit, bs)
    };
    let req = r.request(5, 2, &t2);
    assert_eq!(
        class(&r, &ws, &req, 8_192),
        TurnClass::Direct {
            decode: d0,
            cached_tokens: 12 * BS
        }
    );
    let large = |reason| TurnClass::FallThrough {
        reason,
        current_d: Some(d0),
    };
    assert_eq!(
        class(&r, &ws, &req, BS - 1),
        large(FallThroughReason::RealLargeAppend)
    );
    assert_eq!(
        class(&r, &ws, &req.rejected_by(d0), 8_192),
        large(FallThroughReason::SessionCapRejected)
    );
    // A D that takes no direct turn: after a reject, before residency and the append limit.
    r.state.set_direct_append(d0, false);
    assert!(!r.state.accepts_direct(d0));
    assert_eq!(
        class(&r, &ws, &req, BS - 1),
        large(FallThroughReason::DirectUnsupported)
    );
    assert_eq!(
        class(&r, &ws, &req.rejected_by(d0), 8_192),
        large(FallThroughReason::SessionCapRejected)
    );
    r.state.set_direct_append(d0, true);
    assert!(r.state.accepts_direct(d0));
    r.state.observe(&Observation::Evicted {
        session: sid(5),
        worker: d0,
    });
    assert_eq!(
        class(&r, &ws, &req, 8_192),
        large(FallThroughReason::SessionEvicted)
    );
    set_health(&mut ws, d0.0, Health::Down);
    assert_eq!(
        class(&r, &ws, &req, 8_192),
        large(FallThroughReason::DecodeUnhealthy)
    );
    let other = r.request(77, 4, &t2);
    assert_eq!(
        class(&r, &ws, &other, 8_192),
        TurnClass::FallThrough {
            reason: FallThroughReason::SessionNotResident,
            current_d: None
        }
    );
    let first = r.request(77, 1, &t2);
    assert_eq!(class(&r, &ws, &first, 8_192), TurnClass::FirstTurn);
}

#[test]
fn a_decode_worker_without_append_prefill_never_gets_a_direct_turn() {
    for name in ["kv-aware-v0", "kvc-v2", "kvc"] {
        let ws = pd(1, 2);
        let mut r = Router::named(name, &ws);
        let first = r.serve(&ws, Some((5, 1)), &ctx_blocks(5, 0, 8));
        let d0 = first.decode;
        r.state.set_direct_append(d0, false);
        // Later turns stay on the session's D, through P, and the state never records a direct
        // turn there.
        for turn in 2..=3u32 {
            let d = r.serve(&ws, Some((5, turn)), &ctx_blocks(5, 0, 8 + turn as usize));
            assert_eq!(
                (d.mode, d.reason, d.decode, d.prefill),
                (
                    ExecutionMode::Fallback,
                    Some(FallThroughReason::DirectUnsupported),
                    d0,
                    Some(WorkerId(0))
                ),
                "{name} turn {turn}"
            );
            assert!(!d.change.direct, "{name}");
            assert_eq!(
                r.state.session(sid(5)).unwrap().residency,
                Residency::Resident
            );
        }
        // Another session on the other D still goes direct.
        let other = if d0 == WorkerId(1) { 2 } else { 1 };
        r.state.set_direct_append(d0, true);
        let d = r.serve(&ws, Some((5, 4)), &ctx_blocks(5, 0, 12));
        assert_eq!(d.mode, ExecutionMode::DirectToD, "{name}: allowed again");
        r.state.set_direct_append(WorkerId(other), false);
        let d = r.serve(&ws, Some((5, 5)), &ctx_blocks(5, 0, 13));
        assert_eq!(
            d.mode,
            ExecutionMode::DirectToD,
            "{name}: only its own D counts"
        );
    }
    // Ids out of range are ignored.
    let ws = pd(1, 1);
    let mut state = RouterState::new(&PolicyConfig::default(), &ws);
    state.set_direct_append(WorkerId(100_000), false);
    assert!(state.accepts_direct(WorkerId(100_000)));
}

#[test]
fn router_state_bookkeeping() {
    let ws = pd(1, 2);
    let mut r = Router::named("kvc-v2", &ws);
    let t1 = ctx_blocks(5, 0, 8);
    let req = r.request(5, 1, &t1);
    let d = r.decide(&ws, &req).unwrap();
    r.state.apply(&d.change);
    let (p, dd) = (d.prefill.unwrap(), d.decode);
    assert_eq!(
        (
            r.state.in_flight(p),
            r.state.in_flight(dd),
            r.state.pair_in_flight(p, dd)
        ),
        (1, 1, 1)
    );
    // Re-applying a change for the same request replaces it.
    r.state.apply(&d.change);
    assert_eq!((r.state.in_flight(dd), r.state.assignments(dd)), (1, 2));
    assert_eq!(r.state.cursor(WorkerRole::Decode), Some(dd));
    assert_eq!(r.state.cursor(WorkerRole::Prefill), Some(p));
    r.state.observe(&Observation::Completed {
        request_id: req.request_id,
        session: Some(sid(5)),
        worker: dd,
        outcome: Outcome::Ok,
        resident_tokens: 6_000,
        direct: false,
    });
    assert_eq!(
        (
            r.state.in_flight(p),
            r.state.in_flight(dd),
            r.state.pair_in_flight(p, dd)
        ),
        (0, 0, 0)
    );
    let s = r.state.session(sid(5)).unwrap();
    assert_eq!(
        (s.current_d, s.residency, s.resident_tokens, s.blocks.len()),
        (Some(dd), Residency::Resident, 6_000, 12)
    );
    assert_eq!(r.state.known_blocks(), 12);
    assert_eq!(r.state.session_count(), 1);
    assert_eq!(r.state.policy_name(), "kvc-v2");
    r.state.forget_session(sid(5));
    assert!(r.state.session(sid(5)).is_none());
    assert_eq!(r.state.resident_depth(dd, &t1), 0);
    // The grow-only view stays on P; the policy reads none of a D that prefills for no
    // other, so none is kept there.
    assert_eq!(r.state.seen_depth(p, &t1), 12);
    assert!(!r.state.keeps_seen(dd) && r.state.keeps_seen(p));
    assert_eq!(r.state.seen_depth(dd, &t1), 0);
    // Unknown ids are harmless.
    r.state.observe(&Observation::Evicted {
        session: sid(404),
        worker: dd,
    });
    assert_eq!(r.state.in_flight(WorkerId(200)), 0);
}

#[test]
fn backpressure_hint_follows_the_chosen_d() {
    let mut ws = pd(1, 2);
    for id in [1, 2] {
        set_used(&mut ws, id, 95_000);
        set_load(&mut ws, id, 0, 12);
    }
    let b = ctx_blocks(1, 0, 2);
    let req = RouteRequest::new(RequestId(1), 6 * BS, 1, &b);
    let with_pause = PolicyConfig::KvcV2(KvcV2Config {
        backpressure: BackpressureConfig::ENABLED,
        ..KvcV2Config::default()
    });
    let v2 = Router::new(with_pause, &ws).decide(&ws, &req).unwrap();
    let want = recommended_pause_ms(&ws[1].state, 0, &BackpressureConfig::ENABLED);
    assert_eq!(want, 8 * 25 + 375);
    assert_eq!(v2.recommended_pause_ms, want);
    let v0 = Router::named("kv-aware-v0", &ws).decide(&ws, &req).unwrap();
    assert_eq!(v0.recommended_pause_ms, 0);
    // The default kvc-v2, like the study's, sends no pause.
    let plain = Router::named("kvc-v2", &ws).decide(&ws, &req).unwrap();
    assert_eq!(plain.recommended_pause_ms, 0);
}

#[test]
fn worker_order_in_the_view_does_not_matter() {
    let ws = pd(2, 4);
    for name in ALL {
        let mut r = Router::named(name, &ws);
        for s in 1..=6u64 {
            r.serve(&ws, Some((s, 1)), &ctx_blocks(s, 0, s as usize));
        }
        let mut rev = ws.clone();
        rev.reverse();
        rev.swap(1, 4);
        let b = ctx_blocks(3, 0, 5);
        let req = r.request(3, 2, &b);
        assert_eq!(
            r.decide(&ws, &req).unwrap(),
            r.decide(&rev, &req).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn errors() {
    let b: Vec<BlockHash> = vec![];
    let req = RouteRequest::new(RequestId(1), 10, 1, &b);
    let state = RouterState::new(&PolicyConfig::default(), &[]);
    let go =
        |ws: &[WorkerView], cfg: &PolicyConfig| route(cfg, &state, &ClusterView::new(0, ws), &req);
    let cfg = PolicyConfig::default();
    let wrong = |detail| Err(PolicyError::WrongTopology { detail });
    assert_eq!(go(&[], &cfg), wrong("the cluster view has no workers"));
    let mut mixed = pd(1, 1);
    mixed.push(worker(5, WorkerRole::Colocated));
    assert_eq!(
        go(&mixed, &cfg),
        wrong("colocated workers mixed with prefill/decode workers")
    );
    assert_eq!(
        go(&[worker(0, WorkerRole::Decode)], &cfg),
        wrong("decode workers but no prefill worker")
    );
    assert_eq!(
        go(&[worker(0, WorkerRole::Prefill)], &cfg),
        wrong("prefill workers but no decode worker")
    );
    assert_eq!(
        go(&[worker(4_096, WorkerRole::Colocated)], &cfg),
        Err(PolicyError::WorkerIdOutOfRange(WorkerId(4_096)))
    );
    // The largest id is in range.
    assert_eq!(
        go(&[worker(4_095, WorkerRole::Colocated)], &cfg)
            .unwrap()
            .decode,
        WorkerId(4_095)
    );
    assert_eq!(
        go(
            &[
                worker(3, WorkerRole::Colocated),
                worker(3, WorkerRole::Colocated)
            ],
            &cfg
        ),
        Err(PolicyError::DuplicateWorker(WorkerId(3)))
    );
    for name in ALL {
        let cfg = PolicyConfig::from_name(name).unwrap();
        let mut ws = pd(1, 2);
        set_health(&mut ws, 1, Health::Down);
        set_health(&mut ws, 2, Health::Stale);
        assert_eq!(
            go(&ws, &cfg),
            Err(PolicyError::NoHealthyWorker {
                role: WorkerRole::Decode
            }),
            "{name}"
        );
        let mut ws = dp(2);
        set_health(&mut ws, 0, Health::Down);
        set_health(&mut ws, 1, Health::Down);
        assert_eq!(
            go(&ws, &cfg),
            Err(PolicyError::NoHealthyWorker {
                role: WorkerRole::Colocated
            }),
            "{name}"
        );
        let mut ws = pd(1, 1);
        set_health(&mut ws, 0, Health::Down);
        assert_eq!(
            go(&ws, &cfg),
            Err(PolicyError::NoHealthyWorker {
                role: WorkerRole::Prefill
            }),
            "{name}"
        );
    }
    let bad = PolicyConfig::KvcV2(KvcV2Config {
        hard_cap: 0.0,
        ..KvcV2Config::default()
    });
    assert_eq!(
        go(&dp(1), &bad),
        Err(PolicyError::InvalidConfig {
            policy: "kvc-v2",
            detail: "hard-cap must be within (0, 1]"
        })
    );
    let msg = PolicyError::NoHealthyWorker {
        role: WorkerRole::Prefill,
    }
    .to_string();
    assert_eq!(msg, "no healthy prefill worker");
}

#[test]
fn decision_serializes_with_named_components() {
    let ws = pd(1, 2);
    let r = Router::named("kvc-v2", &ws);
    let b = ctx_blocks(1, 0, 2);
    let req = RouteRequest::new(RequestId(4), 6 * BS, 1, &b);
    let d = r.decide(&ws, &req).unwrap();
    let v = serde_json::to_value(&d).unwrap();
    assert_eq!(v["mode"], "turn1-seed");
    assert_eq!(v["decode"], 1);
    assert_eq!(v["prefill"], 0);
    assert!(v["reason"].is_null());
    assert_eq!(v["scores"][0]["role"], "decode");
    assert_eq!(v["scores"][0]["components"]["sticky_term"], 0.0);
    assert_eq!(v["scores"][2]["role"], "prefill");
    assert_eq!(v["change"]["request-id"], 4);
    let back: kvc_policy::StateChange = serde_json::from_value(v["change"].clone()).unwrap();
    assert_eq!(back, d.change);
}

#[test]
fn a_session_another_router_placed_is_adopted_and_goes_direct() {
    let ws = pd(1, 2);
    // Router `a` places the session and serves two turns; router `b` never saw it.
    let mut a = Router::named("kvc", &ws);
    let mut b = Router::named("kvc", &ws);
    let t1 = ctx_blocks(9, 0, 6);
    let d = a.serve(&ws, Some((9, 1)), &t1).decode;
    let t2 = ctx_blocks(9, 0, 8);
    // Without adoption `b` has no placement: not direct.
    let req = b.request(9, 2, &t2);
    let blind = b.decide(&ws, &req).unwrap();
    assert_ne!(blind.mode, ExecutionMode::DirectToD);
    // The engines show `d` holding the first six blocks: `b` adopts, and goes direct there.
    let adopted = Observation::Adopted {
        session: sid(9),
        worker: d,
        blocks: t2[..t1.len()].to_vec(),
        resident_tokens: t1.len() as u64 * BS,
    };
    b.state.observe(&adopted);
    let s = b.state.session(sid(9)).unwrap();
    assert_eq!((s.current_d, s.residency), (Some(d), Residency::Resident));
    let direct = b.decide(&ws, &req).unwrap();
    assert_eq!(
        (direct.mode, direct.decode, direct.cached_tokens),
        (ExecutionMode::DirectToD, d, t1.len() as u64 * BS)
    );
    // A router keeps its own placement: `a` placed the session on `d`, an adoption elsewhere
    // changes nothing; nor does one without blocks.
    let other = ws
        .iter()
        .map(|w| w.id)
        .find(|w| *w != d && w.0 != 0)
        .unwrap();
    for obs in [
        Observation::Adopted {
            session: sid(9),
            worker: other,
            blocks: t2.clone(),
            resident_tokens: 1,
        },
        Observation::Adopted {
            session: sid(10),
            worker: other,
            blocks: Vec::new(),
            resident_tokens: 1,
        },
    ] {
        a.state.observe(&obs);
    }
    assert_eq!(a.state.session(sid(9)).unwrap().current_d, Some(d));
    assert!(a.state.session(sid(10)).is_none());
}
