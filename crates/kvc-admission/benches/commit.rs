//! commit_evict round trip: submit, the owner thread drains (planning an eviction over 32
//! resident sessions), the caller waits for the reply.
//!
//! `KVC_BENCH_SMOKE=1` (a check that the bench runs, not a measurement) shrinks only
//! criterion's bootstrap, to 2,000 resamples: the fixture is already small.

mod bench_smoke;

use bench_smoke::config;
use criterion::{Criterion, criterion_group, criterion_main};
use kvc_admission::{
    CommitReply, CommitRequest, EvictionConfig, Resident, ResidentState, commit_queue,
    plan_eviction, recommended_pause_ms,
};
use kvc_core::SessionId;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

fn bench_commit(c: &mut Criterion) {
    let (tx, mut rx) = commit_queue(64);
    let stop = Arc::new(AtomicBool::new(false));
    let owner = {
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let residents: Vec<Resident> = (0..32u64)
                .map(|i| Resident {
                    session: SessionId(i),
                    tokens: 2_000 + i * 10,
                    state: if i % 2 == 0 {
                        ResidentState::Idle
                    } else {
                        ResidentState::Running
                    },
                    last_access_ms: 1_000 + i * 37 % 500,
                    predicted_next_use_ms: None,
                })
                .collect();
            let cfg = EvictionConfig::default();
            while !stop.load(Ordering::Relaxed) {
                rx.drain_wait(Duration::from_millis(50), |req| {
                    let plan = plan_eviction(
                        &residents,
                        req.need_tokens,
                        4_000,
                        90_000,
                        req.session,
                        10_000,
                        &cfg,
                    );
                    CommitReply::from_plan(&plan, recommended_pause_ms(0, 0.9))
                });
            }
        })
    };

    let mut group = c.benchmark_group("commit_evict");
    group.bench_function("round_trip", |b| {
        b.iter(|| {
            let pending = tx
                .submit(CommitRequest {
                    need_tokens: black_box(9_000),
                    session: Some(SessionId(3)),
                })
                .expect("queue has room");
            let reply = pending.wait(Duration::from_secs(5)).expect("reply");
            assert!(reply.admitted);
            reply
        })
    });
    group.finish();

    stop.store(true, Ordering::Relaxed);
    owner.join().expect("owner");
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_commit
}
criterion_main!(benches);
