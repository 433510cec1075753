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
//! - `sessions/1000`, `sessions/100000`, `sessions/1000000`: route + apply + completion;
//! - after the group, the ratio of the medians (from criterion's estimates) is printed:
//!   the acceptance figure is `1000 / 100000 ≥ 0.8`;
//! - then the tail: 200,000 decisions timed one by one on a state of 1,000 and on one of
//!   1,000,000 sessions, in alternating runs of 10,000 (so a busy machine's swings fall on
//!   both), their 99th percentiles and ratio (target `≤ 1.25`), and the memory the
//!   1,000,000-session state holds per session (resident set growth while it fills, over the
//!   sessions). With `KVC_BENCH_OUT` set, these figures are written there as JSON.
//!
//! `KVC_BENCH_SMOKE=1` (a check that the bench runs, not a measurement) keeps the bench ids and
//! the JSON keys but fills 100, 32,000 and 40,000 sessions (the window still holds every
//! session of the first and 30,000 of the others), times 2,000 decisions per state in runs of
//! 500, and bootstraps criterion's estimates from 2,000 resamples.

mod bench_smoke;

use bench_smoke::{config, smoke};
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

/// The sessions of each state, which name its bench (`sessions/<n>`).
const SIZES: [u64; 3] = [1_000, 100_000, 1_000_000];

/// Decisions timed one by one per state in [`tail`].
const TIMED: usize = 200_000;
/// Decisions of one run of [`tail`] before switching to the other state.
const RUN: usize = 10_000;

/// The sizes of one run: the full run's, or the smoke run's.
struct Sizes {
    /// Sessions of the states named by [`SIZES`].
    sessions: [u64; 3],
    /// Decisions timed one by one per state in [`tail`].
    timed: usize,
    /// Decisions of one run of [`tail`] before switching to the other state.
    run: usize,
}

fn sizes() -> Sizes {
    if smoke() {
        Sizes {
            sessions: [100, 32_000, 40_000],
            timed: 2_000,
            run: 500,
        }
    } else {
        Sizes {
            sessions: SIZES,
            timed: TIMED,
            run: RUN,
        }
    }
}

fn bench_sessions(c: &mut Criterion) {
    let sizes = sizes();
    let mut group = c.benchmark_group("sessions");
    for (id, n) in SIZES.into_iter().zip(sizes.sessions) {
        let mut driver = Driver::new(n);
        assert_eq!(driver.state.session_count() as u64, n);
        group.bench_function(id.to_string(), |b| b.iter(|| driver.step()));
        assert_eq!(driver.state.session_count() as u64, n);
        assert!(driver.state.pending_count() == 0);
    }
    group.finish();
    print_ratio(&sizes);
    tail(&sizes);
}

/// This process's resident set, in bytes (Linux; 0 elsewhere).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4_096)
}

/// The decision p99 at 1,000 and at 1,000,000 sessions, and bytes per session at 1,000,000
/// (at the smoke sizes in the smoke run).
fn tail(sizes: &Sizes) {
    let [small_n, _, large_n] = sizes.sessions;
    let small = Driver::new(small_n);
    let before = rss_bytes();
    let large = Driver::new(large_n);
    let per_session = rss_bytes().saturating_sub(before) as f64 / large_n as f64;
    let mut drivers = [small, large];
    let timed = sizes.timed;
    let mut times: [Vec<f64>; 2] = [Vec::with_capacity(timed), Vec::with_capacity(timed)];
    while times[0].len() < timed {
        for (d, t) in drivers.iter_mut().zip(times.iter_mut()) {
            for _ in 0..sizes.run {
                let started = std::time::Instant::now();
                d.step();
                t.push(started.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    for t in &mut times {
        t.sort_by(f64::total_cmp);
    }
    let p99 = |t: &[f64]| kvc_core::stats::percentile(t, kvc_core::stats::P99).unwrap_or(0.0);
    let (small_p99, large_p99) = (p99(&times[0]), p99(&times[1]));
    let ratio = large_p99 / small_p99;
    println!(
        "sessions: decision p99 {small_p99:.2} µs at {} sessions, {large_p99:.2} µs at {}: \
         ratio {ratio:.3} (target <= 1.25); {per_session:.0} bytes per session at {}",
        small_n, large_n, large_n
    );
    if let Some(out) = std::env::var_os("KVC_BENCH_OUT") {
        let json = format!(
            "{{\"decision_p99_us_1k\": {small_p99:.3}, \"decision_p99_us_1m\": {large_p99:.3}, \
             \"p99_1m_vs_1k\": {ratio:.4}, \"bytes_per_session_1m\": {per_session:.1}}}\n"
        );
        std::fs::write(&out, json).expect("KVC_BENCH_OUT is writable");
    }
}

/// Prints the ratio of the medians criterion just estimated, if it wrote them.
fn print_ratio(sizes: &Sizes) {
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
    let [small_n, large_n, _] = sizes.sessions;
    if let (Some(small), Some(large)) = (median(SIZES[0]), median(SIZES[1])) {
        println!(
            "sessions: median {:.2} µs at {} sessions, {:.2} µs at {}: ratio {:.3} (rate at {} / rate at {})",
            small / 1e3,
            small_n,
            large / 1e3,
            large_n,
            small / large,
            large_n,
            small_n,
        );
    }
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_sessions
}
criterion_main!(benches);
