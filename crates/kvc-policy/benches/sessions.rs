//! Cost of a `kvc` decision against the number of sessions the router tracks.
//!
//! Cluster: 2 prefill and 8 decode workers, each with a 92,160-token pool (180 blocks of 512
//! tokens). The state is first filled with 1,000 or 100,000 sessions, each placed by a `kvc`
//! decision 1 ms after the previous one and resident on its D, so the active-session window
//! (30 s) holds every session at 1,000 and 30,000 of them at 100,000. Each measured iteration is
//! one decision carried out: the next turn of the next session in turn (its shared 4-block
//! system prompt plus 8 fresh blocks, so the block view keeps taking new hashes and stays at its
//! bound), routed, applied and completed, 1 ms after the previous one.
//!
//! - `sessions/1000`, `sessions/100000`: route + apply + completion;
//! - after the group, the ratio of the two medians (from criterion's estimates) is printed:
//!   the acceptance figure is `1000 / 100000 ≥ 0.8`.

use criterion::{Criterion, criterion_group, criterion_main};
use kvc_core::{
    BlockHash, Outcome, RequestId, SessionId, TurnId, WorkerId, WorkerRole, WorkerState,
};
use kvc_policy::{
    ClusterView, Observation, PolicyConfig, RouteRequest, RouterState, WorkerView, route,
};
use std::hint::black_box;

const PREFILL: u32 = 2;
const DECODE: u32 = 8;
const POOL: u64 = 92_160;
const BLOCK: u64 = 512;
const FRESH: u64 = 8;

fn cluster() -> Vec<WorkerView> {
    (0..PREFILL + DECODE)
        .map(|i| {
            let role = if i < PREFILL {
                WorkerRole::Prefill
            } else {
                WorkerRole::Decode
            };
            let mut s = WorkerState::empty(POOL);
            s.used_tokens = 30_000 + u64::from(i % 5) * 9_000;
            s.in_flight = i % 4;
            s.queue_depth = i % 3;
            WorkerView::new(WorkerId(i), role, s)
        })
        .collect()
}

/// Drives one router: sessions `1..=sessions`, a fresh block id and request id per use.
struct Driver {
    config: PolicyConfig,
    workers: Vec<WorkerView>,
    state: RouterState,
    sessions: u64,
    turns: Vec<u32>,
    next_session: u64,
    next_block: u64,
    next_request: u64,
    now_ms: u64,
    blocks: Vec<BlockHash>,
}

impl Driver {
    fn new(sessions: u64) -> Self {
        let config = PolicyConfig::from_name("kvc").unwrap();
        let workers = cluster();
        let state = RouterState::new(&config, &workers);
        let mut d = Driver {
            config,
            workers,
            state,
            sessions,
            turns: vec![0; sessions as usize + 1],
            next_session: 0,
            next_block: 1_000,
            next_request: 0,
            now_ms: 0,
            blocks: Vec::new(),
        };
        for _ in 0..sessions {
            d.step();
        }
        d
    }

    /// One decision for the next session in turn: route, apply, complete.
    fn step(&mut self) {
        self.next_session = self.next_session % self.sessions + 1;
        let s = self.next_session;
        self.turns[s as usize] += 1;
        self.now_ms += 1;
        self.next_request += 1;
        self.blocks.clear();
        self.blocks.extend((1..=4).map(BlockHash));
        self.blocks
            .extend((self.next_block..self.next_block + FRESH).map(BlockHash));
        self.next_block += FRESH;
        let input = (4 + FRESH) * BLOCK - 100;
        let req = RouteRequest::new(RequestId(self.next_request), input, 50, &self.blocks)
            .in_session(SessionId(s), TurnId(self.turns[s as usize]));
        let view = ClusterView::new(self.now_ms, &self.workers);
        let d = route(&self.config, &self.state, black_box(&view), black_box(&req)).unwrap();
        self.state.apply(&d.change);
        self.state.observe(&Observation::Completed {
            request_id: req.request_id,
            session: Some(SessionId(s)),
            worker: d.decode,
            outcome: Outcome::Ok,
            resident_tokens: input + 50,
            direct: d.is_direct(),
        });
    }
}

const SIZES: [u64; 2] = [1_000, 100_000];

fn bench_sessions(c: &mut Criterion) {
    let mut group = c.benchmark_group("sessions");
    for n in SIZES {
        let mut driver = Driver::new(n);
        assert_eq!(driver.state.session_count() as u64, n);
        group.bench_function(n.to_string(), |b| b.iter(|| driver.step()));
        assert_eq!(driver.state.session_count() as u64, n);
        assert!(driver.state.pending_count() == 0);
    }
    group.finish();
    print_ratio();
}

/// Prints the ratio of the medians criterion just estimated, if it wrote them.
fn print_ratio() {
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"))
        .join("criterion/sessions");
    let median = |n: u64| -> Option<f64> {
        let text =
            std::fs::read_to_string(dir.join(n.to_string()).join("new/estimates.json")).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        v["median"]["point_estimate"].as_f64()
    };
    if let (Some(small), Some(large)) = (median(SIZES[0]), median(SIZES[1])) {
        println!(
            "sessions: median {:.2} µs at {} sessions, {:.2} µs at {}: ratio {:.3} (rate at {} / rate at {})",
            small / 1e3,
            SIZES[0],
            large / 1e3,
            SIZES[1],
            small / large,
            SIZES[1],
            SIZES[0],
        );
    }
}

criterion_group!(benches, bench_sessions);
criterion_main!(benches);
