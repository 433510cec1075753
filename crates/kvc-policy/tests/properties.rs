//! Property tests: random clusters and random request/feedback histories.

mod common;

use common::*;
use kvc_core::{
    BlockHash, ExecutionMode, FallThroughReason, Health, Outcome, RequestId, SessionId, TurnId,
    WorkerId, WorkerRole,
};
use kvc_policy::{
    ClusterView, Decision, Fleet, KvcV2Config, Observation, PolicyConfig, PolicyError,
    RouteRequest, RouterState, WorkerView, route, route_in,
};
use proptest::prelude::*;
use std::collections::BTreeMap;

const ALL: [&str; 5] = ["round-robin", "cache-aware", "kv-aware-v0", "kvc-v2", "kvc"];

#[derive(Debug, Clone)]
struct WorkerSpec {
    used_pct: u64,
    in_flight: u32,
    queue: u32,
    health: Health,
}

fn worker_spec() -> impl Strategy<Value = WorkerSpec> {
    (
        0u64..=100,
        0u32..20,
        0u32..10,
        prop_oneof![6 => Just(Health::Healthy), 1 => Just(Health::Stale), 1 => Just(Health::Down)],
    )
        .prop_map(|(used_pct, in_flight, queue, health)| WorkerSpec {
            used_pct,
            in_flight,
            queue,
            health,
        })
}

#[derive(Debug, Clone)]
enum Op {
    /// The next turn of a session: `extra` new blocks; `elide` rewrites its history.
    Turn {
        session: u64,
        extra: usize,
        elide: bool,
    },
    /// The next turn of a session, whose direct-to-D attempt (if any) is refused.
    RejectedTurn {
        session: u64,
        extra: usize,
        observe: bool,
    },
    Evict {
        session: u64,
    },
    /// Changes a worker's published state.
    Churn {
        worker: usize,
        spec: WorkerSpec,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..5, 0usize..24, prop::bool::weighted(0.1))
            .prop_map(|(session, extra, elide)| Op::Turn { session, extra, elide }),
        2 => (0u64..5, 0usize..6, any::<bool>())
            .prop_map(|(session, extra, observe)| Op::RejectedTurn { session, extra, observe }),
        1 => (0u64..5).prop_map(|session| Op::Evict { session }),
        1 => (0usize..8, worker_spec()).prop_map(|(worker, spec)| Op::Churn { worker, spec }),
    ]
}

fn build(colocated: bool, p: usize, specs: &[WorkerSpec]) -> Vec<WorkerView> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let role = if colocated {
                WorkerRole::Colocated
            } else if i < p {
                WorkerRole::Prefill
            } else {
                WorkerRole::Decode
            };
            let mut w = worker(i as u32, role);
            w.state.used_tokens = CAP * s.used_pct / 100;
            w.state.in_flight = s.in_flight;
            w.state.queue_depth = s.queue;
            w.state.health = s.health;
            w
        })
        .collect()
}

/// Per-session history of the driver: turn number, history generation and context length.
#[derive(Default, Clone, Copy)]
struct Session {
    turn: u32,
    generation: u64,
    len: usize,
}

/// Checks every invariant a decision must satisfy; returns a description of the first breach.
fn check_decision(
    name: &str,
    cfg: &PolicyConfig,
    state: &RouterState,
    now_ms: u64,
    ws: &[WorkerView],
    req: &RouteRequest<'_>,
    d: &Decision,
) -> Result<(), TestCaseError> {
    let colocated = ws.iter().all(|w| w.role == WorkerRole::Colocated);
    let dw = ws
        .iter()
        .find(|w| w.id == d.decode)
        .expect("decode worker in view");
    prop_assert!(dw.is_routable(), "{name}: unhealthy decode {:?}", dw);
    let d_role = if colocated {
        WorkerRole::Colocated
    } else {
        WorkerRole::Decode
    };
    prop_assert_eq!(dw.role, d_role, "{}: decode role", name);
    let p_path = matches!(
        d.mode,
        ExecutionMode::Turn1Seed | ExecutionMode::Fallback | ExecutionMode::Reseed
    );
    prop_assert_eq!(
        d.prefill.is_some(),
        p_path,
        "{}: prefill iff P→D ({:?})",
        name,
        d.mode
    );
    if let Some(p) = d.prefill {
        let pw = ws
            .iter()
            .find(|w| w.id == p)
            .expect("prefill worker in view");
        prop_assert!(pw.is_routable(), "{name}: unhealthy prefill");
        prop_assert_eq!(pw.role, WorkerRole::Prefill);
    }
    prop_assert_eq!(
        colocated,
        d.mode == ExecutionMode::Colocated,
        "{}: colocated mode",
        name
    );
    prop_assert_eq!(
        d.reason.is_some(),
        matches!(d.mode, ExecutionMode::Fallback | ExecutionMode::Reseed),
        "{}: reason iff fallback/reseed",
        name
    );
    if d.mode == ExecutionMode::Reseed {
        prop_assert_eq!(d.reason, Some(FallThroughReason::Migrated));
    }
    if req.rejected_by.is_some() && !colocated {
        prop_assert!(p_path, "{name}: a rejected request must take a P→D path");
    }
    prop_assert!(d.cached_tokens <= req.input_length);
    prop_assert!(
        d.scores.iter().all(|s| {
            ws.iter()
                .any(|w| w.id == s.worker && w.role == s.role && w.is_routable())
        }),
        "{name}: scores only for healthy candidates"
    );
    // Same inputs, same decision; the order of the view does not matter.
    let again = route(cfg, state, &ClusterView::new(now_ms, ws), req).unwrap();
    prop_assert_eq!(&again, d, "{}: not deterministic", name);
    let mut rev = ws.to_vec();
    rev.reverse();
    let rev_d = route(cfg, state, &ClusterView::new(now_ms, &rev), req).unwrap();
    prop_assert_eq!(&rev_d, d, "{}: depends on view order", name);
    // On a prepared fleet: the same decision, whether the fleet was made with these healths
    // or made all healthy and then told them, and whichever source gives the states.
    let fleet = Fleet::new(ws).unwrap();
    let prepared = route_in(cfg, state, &fleet, &fleet, now_ms, req).unwrap();
    prop_assert_eq!(&prepared, d, "{}: differs on a prepared fleet", name);
    let healthy: Vec<WorkerView> = ws
        .iter()
        .map(|w| {
            let mut h = *w;
            h.state.health = Health::Healthy;
            h
        })
        .collect();
    let mut told = Fleet::new(&healthy).unwrap();
    for w in ws {
        told.set_health(w.id, w.state.health);
    }
    let updated = route_in(cfg, state, &told, &fleet, now_ms, req).unwrap();
    prop_assert_eq!(&updated, d, "{}: differs after health changes", name);
    if let PolicyConfig::KvcV2(v2) = cfg {
        let over = |w: &WorkerView| w.state.committed_fraction() > v2.hard_cap;
        if over(dw) {
            prop_assert!(
                !ws.iter()
                    .any(|w| w.role == d_role && w.is_routable() && !over(w)),
                "kvc-v2 picked {} over the cap while another healthy D is under it",
                d.decode
            );
        }
    }
    if let (PolicyConfig::KvAwareV0(_), Some(s)) = (cfg, req.session)
        && let Some(cur) = state.session(s).and_then(|r| r.current_d)
        && ws
            .iter()
            .any(|w| w.id == cur && w.is_routable() && w.role == d_role)
    {
        prop_assert_eq!(d.decode, cur, "kv-aware-v0 left the pinned D");
    }
    Ok(())
}

/// An error is acceptable only when a role the path needs has no healthy worker.
fn check_error(ws: &[WorkerView], e: &PolicyError) -> Result<(), TestCaseError> {
    match e {
        PolicyError::NoHealthyWorker { role } => {
            prop_assert!(
                !ws.iter().any(|w| w.role == *role && w.is_routable()),
                "spurious {e}"
            );
            Ok(())
        }
        other => Err(TestCaseError::fail(format!("unexpected error {other}"))),
    }
}

fn run_history(
    name: &str,
    colocated: bool,
    p: usize,
    specs: &[WorkerSpec],
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let cfg = PolicyConfig::from_name(name).unwrap();
    let mut ws = build(colocated, p, specs);
    let mut state = RouterState::new(&cfg, &ws);
    let mut sessions: BTreeMap<u64, Session> = BTreeMap::new();
    let mut next_id = 1u64;
    for op in ops {
        match op {
            Op::Churn { worker: i, spec } => {
                let n = ws.len();
                let w = &mut ws[*i % n];
                w.state.used_tokens = CAP * spec.used_pct / 100;
                w.state.in_flight = spec.in_flight;
                w.state.queue_depth = spec.queue;
                w.state.health = spec.health;
            }
            Op::Evict { session } => {
                if let Some(d) = state.session(SessionId(*session)).and_then(|s| s.current_d) {
                    state.observe(&Observation::Evicted {
                        session: SessionId(*session),
                        worker: d,
                    });
                }
            }
            Op::Turn {
                session,
                extra,
                elide,
            }
            | Op::RejectedTurn {
                session,
                extra,
                observe: elide,
            } => {
                let rejected = matches!(op, Op::RejectedTurn { .. });
                let s = sessions.entry(*session).or_default();
                s.turn += 1;
                s.len += extra;
                if *elide && !rejected {
                    s.generation += 1;
                }
                let blocks: Vec<BlockHash> = ctx_blocks(*session, s.generation, s.len);
                let input = blocks.len() as u64 * BS - 100;
                let id = RequestId(next_id);
                next_id += 1;
                let req = RouteRequest::new(id, input, 20, &blocks)
                    .in_session(SessionId(*session), TurnId(s.turn));
                let view = ClusterView::new(u64::from(s.turn) * 1_000, &ws);
                let mut d = match route(&cfg, &state, &view, &req) {
                    Ok(d) => d,
                    Err(e) => {
                        check_error(&ws, &e)?;
                        continue;
                    }
                };
                check_decision(name, &cfg, &state, view.now_ms, &ws, &req, &d)?;
                state.apply(&d.change);
                if rejected && d.is_direct() {
                    if *elide {
                        state.observe(&Observation::AdmissionRejected {
                            session: SessionId(*session),
                            worker: d.decode,
                        });
                    }
                    let re = req.rejected_by(d.decode);
                    match route(&cfg, &state, &view, &re) {
                        Ok(d2) => {
                            check_decision(name, &cfg, &state, view.now_ms, &ws, &re, &d2)?;
                            state.apply(&d2.change);
                            d = d2;
                        }
                        Err(e) => {
                            check_error(&ws, &e)?;
                            continue;
                        }
                    }
                }
                state.observe(&Observation::Completed {
                    request_id: id,
                    session: Some(SessionId(*session)),
                    worker: d.decode,
                    outcome: Outcome::Ok,
                    resident_tokens: input,
                    direct: d.is_direct(),
                });
                if d.is_direct() {
                    let r = state.session(SessionId(*session)).unwrap();
                    prop_assert_eq!(
                        r.rejects_on(d.decode),
                        0,
                        "counter not reset by a direct success"
                    );
                }
            }
        }
    }
    Ok(())
}

fn topology() -> impl Strategy<Value = (bool, usize, Vec<WorkerSpec>)> {
    prop_oneof![
        (1usize..=3, 1usize..=5).prop_flat_map(|(p, d)| {
            prop::collection::vec(worker_spec(), p + d).prop_map(move |specs| (false, p, specs))
        }),
        prop::collection::vec(worker_spec(), 1..=5).prop_map(|specs| (true, 0, specs)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// Healthy workers of the right role only, P iff P→D, determinism, kvc-v2's hard cap,
    /// kv-aware-v0's pin, reject counters reset by direct successes: over random histories.
    #[test]
    fn decisions_respect_invariants(
        (colocated, p, specs) in topology(),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        for name in ALL {
            run_history(name, colocated, p, &specs, &ops)?;
        }
    }

    /// kv-aware-v0 keeps a session on its first D however full and loaded that D is, through
    /// evictions, large appends, history rewrites (which leave only the shared prompt as
    /// overlap, the same on every D) and rejects, as long as that D stays healthy.
    #[test]
    fn kv_aware_v0_never_leaves_the_first_d(
        d_count in 2usize..=5,
        churn in prop::collection::vec((0usize..5, 0u64..=100, 0u32..50), 0..30),
        events in prop::collection::vec(0u8..5, 1..30),
    ) {
        let mut ws = pd(1, d_count as u32);
        let mut r = Router::named("kv-aware-v0", &ws);
        // Other sessions first, so every D has seen the shared system prompt.
        for s in 0..d_count as u64 {
            r.serve(&ws, Some((10 + s, 1)), &ctx_blocks(10 + s, 0, 3));
        }
        let first = r.serve(&ws, Some((1, 1)), &ctx_blocks(1, 0, 10)).decode;
        let (mut len, mut generation) = (10, 0);
        for (k, ev) in events.iter().enumerate() {
            if let Some((w, used, load)) = churn.get(k) {
                let id = 1 + (*w % d_count) as u32;
                set_used(&mut ws, id, CAP * used / 100);
                set_load(&mut ws, id, *load, *load / 2);
            }
            // The first D is always full and the busiest.
            set_used(&mut ws, first.0, CAP);
            set_load(&mut ws, first.0, 60, 30);
            len += if *ev == 1 { 20 } else { 1 };
            if *ev == 4 {
                generation += 1;
            }
            let blocks = ctx_blocks(1, generation, len);
            let turn = 2 + k as u32;
            match ev {
                0 => { r.state.observe(&Observation::Evicted { session: SessionId(1), worker: first }); }
                2 => { r.state.observe(&Observation::AdmissionRejected { session: SessionId(1), worker: first }); }
                _ => {}
            }
            let mut req = r.request(1, turn, &blocks);
            if *ev == 3 { req = req.rejected_by(first); }
            let d = r.decide(&ws, &req).unwrap();
            prop_assert_eq!(d.decode, first);
            prop_assert_ne!(d.mode, ExecutionMode::Reseed);
            r.state.apply(&d.change);
        }
        prop_assert_eq!(r.state.session(SessionId(1)).unwrap().d_changes, 0);
    }

    /// kvc-v2 migrates exactly when the N-th reject since the last successful direct-to-D turn
    /// on the session's D arrives, and the counter is 0 after every direct success.
    #[test]
    fn kvc_v2_migrates_after_exactly_n_rejects(
        n in 1u32..=5,
        d_count in 2usize..=4,
        events in prop::collection::vec((any::<bool>(), any::<bool>()), 1..40),
    ) {
        let cfg = PolicyConfig::KvcV2(KvcV2Config { migrate_after_rejects: n, ..KvcV2Config::default() });
        let ws = pd(1, d_count as u32);
        let mut r = Router::new(cfg, &ws);
        let mut current = r.serve(&ws, Some((1, 1)), &ctx_blocks(1, 0, 4)).decode;
        let mut model: BTreeMap<WorkerId, u32> = BTreeMap::new();
        let mut len = 4;
        for (k, (reject, observe)) in events.iter().enumerate() {
            len += 1;
            let blocks = ctx_blocks(1, 0, len);
            let req = r.request(1, 2 + k as u32, &blocks);
            let d = r.decide(&ws, &req).unwrap();
            prop_assert_eq!((d.mode, d.decode), (ExecutionMode::DirectToD, current));
            r.state.apply(&d.change);
            if !reject {
                r.state.observe(&Observation::Completed {
                    request_id: req.request_id, session: Some(SessionId(1)), worker: current,
                    outcome: Outcome::Ok, resident_tokens: len as u64 * BS, direct: true,
                });
                model.insert(current, 0);
                prop_assert_eq!(r.state.session(SessionId(1)).unwrap().rejects_on(current), 0);
                continue;
            }
            if *observe {
                r.state.observe(&Observation::AdmissionRejected { session: SessionId(1), worker: current });
            }
            let count = model.entry(current).or_insert(0);
            *count += 1;
            let d2 = r.decide(&ws, &req.rejected_by(current)).unwrap();
            if *count == n {
                prop_assert_eq!((d2.mode, d2.reason), (ExecutionMode::Reseed, Some(FallThroughReason::Migrated)));
                prop_assert_ne!(d2.decode, current);
                *count = 0;
            } else {
                prop_assert_eq!((d2.mode, d2.reason, d2.decode), (ExecutionMode::Fallback, Some(FallThroughReason::SessionCapRejected), current));
            }
            r.state.apply(&d2.change);
            r.state.observe(&Observation::Completed {
                request_id: req.request_id, session: Some(SessionId(1)), worker: d2.decode,
                outcome: Outcome::Ok, resident_tokens: len as u64 * BS, direct: false,
            });
            prop_assert_eq!(r.state.session(SessionId(1)).unwrap().rejects_on(current), model[&current]);
            current = d2.decode;
        }
    }
}
