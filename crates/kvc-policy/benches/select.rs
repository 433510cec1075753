//! Time per routing decision that scores every decode worker.
//!
//! Cluster: 2 prefill workers and 8 (`d8`), 64 (`d64`) or 4,094 (`d4094`: 4,096 workers, the
//! policies' limit) decode workers; each D holds 8
//! resident sessions of 150 blocks (1,172 distinct known blocks per D, shared system prompt
//! included). The request has 180 blocks: a fork of a session resident on one D (its 150 blocks
//! plus 30 new ones) under a session id the router does not know, so the policy scores every D
//! (overlap 150 on one D, 4 on the others) and then picks P.
//!
//! - `select/d8`, `select/d64`, `select/d4094`: `kvc-v2` (the headline figures);
//! - `select/dN/<policy>`: the other policies on the same request;
//! - `select/dN/kvc-v2-direct`, `select/dN/kvc-direct`: `kvc-v2` and `kvc` on a later turn of a
//!   resident session (the direct-to-D path, the common case: one candidate, whatever the
//!   fleet).
//!
//! Decisions are made as the router and the simulator make them: on a prepared [`Fleet`]
//! (`route_in`), so what is measured is the decision, not a pass over the fleet's views.
//!
//! `KVC_BENCH_SMOKE=1` (a check that the bench runs, not a measurement) keeps every bench id
//! but builds `d64` with 16 decode workers and `d4094` with 256 (258 workers, still past the
//! 256 a worker set holds inline), and bootstraps criterion's estimates from 2,000 resamples.
#![forbid(unsafe_code)]

mod bench_smoke;

use bench_smoke::{config, smoke};
use criterion::{Criterion, criterion_group, criterion_main};
use kvc_core::{
    BlockHash, Outcome, RequestId, SessionId, TurnId, WorkerId, WorkerRole, WorkerState,
};
use kvc_policy::{
    Fleet, Observation, PolicyConfig, RouteRequest, RouterState, StateBounds, StateChange,
    WorkerView, route_in,
};
use std::hint::black_box;

const PREFILL: u32 = 2;
const SESSIONS_PER_D: u64 = 8;
const SESSION_BLOCKS: u64 = 150;
const BLOCK: u64 = 512;

/// The decode workers the fleet named `d{d}` has: `d`, or fewer in the smoke run.
fn fleet_size(d: u32) -> u32 {
    match d {
        64 if smoke() => 16,
        4_094 if smoke() => 256,
        d => d,
    }
}

fn session_blocks(session: u64, n: u64) -> Vec<BlockHash> {
    (1..=4)
        .chain((0..n - 4).map(|k| session * 1_000_000 + k))
        .map(BlockHash)
        .collect()
}

fn cluster(d: u32) -> Vec<WorkerView> {
    (0..PREFILL + d)
        .map(|i| {
            let role = if i < PREFILL {
                WorkerRole::Prefill
            } else {
                WorkerRole::Decode
            };
            let mut s = WorkerState::empty(92_000);
            s.used_tokens = 30_000 + u64::from(i % 5) * 9_000;
            s.in_flight = i % 4;
            s.queue_depth = i % 3;
            WorkerView::new(WorkerId(i), role, s)
        })
        .collect()
}

/// A state where every D holds `SESSIONS_PER_D` resident sessions (with a block bound that
/// keeps them all: 1,172 blocks per D are more than the default bound of four 180-block pools).
fn populated(config: &PolicyConfig, workers: &[WorkerView], d: u32) -> RouterState {
    let bounds = StateBounds {
        blocks_per_worker: Some(4_096),
        ..StateBounds::default()
    };
    let mut state = RouterState::with_bounds(config, workers, bounds);
    let mut request = 0;
    for k in 0..u64::from(d) * SESSIONS_PER_D {
        let decode = WorkerId(PREFILL + (k % u64::from(d)) as u32);
        let blocks = session_blocks(k + 1, SESSION_BLOCKS);
        request += 1;
        state.apply(&StateChange {
            request_id: RequestId(request),
            session: Some(SessionId(k + 1)),
            now_ms: 0,
            decode,
            decode_role: WorkerRole::Decode,
            prefill: Some(WorkerId((k % u64::from(PREFILL)) as u32)),
            direct: false,
            blocks,
            reject_count: None,
            prefill_us: 0,
        });
        state.observe(&Observation::Completed {
            request_id: RequestId(request),
            session: Some(SessionId(k + 1)),
            worker: decode,
            outcome: Outcome::Ok,
            resident_tokens: SESSION_BLOCKS * BLOCK,
            direct: false,
        });
    }
    state
}

fn bench_select(c: &mut Criterion) {
    let mut group = c.benchmark_group("select");
    for name_d in [8u32, 64, 4_094] {
        let d = fleet_size(name_d);
        let workers = cluster(d);
        // Session 3 is resident on one D: fork it (new session id) and extend by 30 blocks.
        let mut fork = session_blocks(3, SESSION_BLOCKS);
        fork.extend((0..30).map(|k| BlockHash(9_000_000_000 + k)));
        let fork_req = RouteRequest::new(RequestId(1_000_000), 180 * BLOCK - 100, 50, &fork)
            .in_session(SessionId(777_777), TurnId(2));
        // A later turn of session 3 itself: direct-to-D.
        let mut next = session_blocks(3, SESSION_BLOCKS);
        next.extend((0..4).map(|k| BlockHash(8_000_000_000 + k)));
        let direct_req = RouteRequest::new(RequestId(1_000_001), 154 * BLOCK - 100, 50, &next)
            .in_session(SessionId(3), TurnId(2));
        let fleet = Fleet::new(&workers).unwrap();

        for name in ["kvc-v2", "kvc", "kv-aware-v0", "cache-aware", "round-robin"] {
            let config = PolicyConfig::from_name(name).unwrap();
            let state = populated(&config, &workers, d);
            assert!(state.known_blocks() as u64 >= u64::from(d) * 1_000);
            let id = if name == "kvc-v2" {
                format!("d{name_d}")
            } else {
                format!("d{name_d}/{name}")
            };
            // As the router decides: on the prepared fleet, which also gives the states.
            let decide = |req: &RouteRequest<'_>| {
                route_in(&config, &state, black_box(&fleet), &fleet, 0, req).unwrap()
            };
            group.bench_function(id, |b| b.iter(|| decide(black_box(&fork_req))));
            if name == "kvc-v2" || name == "kvc" {
                let decision = decide(&direct_req);
                assert!(decision.is_direct());
                group.bench_function(format!("d{name_d}/{name}-direct"), |b| {
                    b.iter(|| decide(black_box(&direct_req)))
                });
            }
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_select
}
criterion_main!(benches);
