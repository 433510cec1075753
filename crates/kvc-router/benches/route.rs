//! `Route` over loopback gRPC at 32 concurrent requests versus a no-op RPC (`Ping`) on the same
//! server stack, and the router's own decision latency.
//!
//! ```text
//! CARGO_TARGET_DIR=/work/tgt-router cargo bench -p kvc-router --bench route -- \
//!     --warm-up-time 0.5 --measurement-time 2
//! ```
//!
//! Bench ids: `router/route_rps`, `router/noop_rps` (throughput in requests per second, 4,096
//! sessions, the default policy `kvc`). After them it prints the Route/Ping throughput ratio
//! (medians of five alternating fixed runs of each) and the decision latency quantiles recorded by the router's
//! histogram; then Route's throughput on two more routers, one tracking 1,000 sessions and one
//! 100,000 (every session routed once before the timed runs), in five alternating fixed runs
//! each, and the ratio of their medians: a decision must not cost more with more sessions.
//!
//! `KVC_BENCH_SMOKE=1` (`common::smoke`) shrinks the fixed runs to 320 calls and one of each,
//! the two routers to 100 and 1,000 sessions, and the pending-decision bound to 100 (so the
//! smoke run still overflows it, as the full run overflows its 10,000).
#![forbid(unsafe_code)]
#![allow(missing_docs)]

mod common;

use criterion::{Criterion, Throughput};
use kvc_proto::pb;
use kvc_proto::pb::router_client::RouterClient;
use kvc_router::RunningRouter;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

const STREAMS: u64 = 32;
const SESSIONS: u64 = 4_096;
/// Calls of each fixed run.
const CALLS: u64 = 20_000;
/// Fixed runs of each kind whose median is kept.
const RUNS: usize = 5;
/// The sessions of the two routers [`sessions_scaling`] compares, and their names.
const SCALING: [(u64, &str); 2] = [(1_000, "1,000"), (100_000, "100,000")];

/// Calls of each fixed run (fewer in the smoke run).
fn calls() -> u64 {
    common::size(CALLS, 320)
}

/// Fixed runs of each kind (one in the smoke run).
fn runs() -> usize {
    common::size(RUNS, 1)
}

struct Fixture {
    sessions: u64,
    rt: tokio::runtime::Runtime,
    router: RunningRouter,
    client: RouterClient<Channel>,
    next: Arc<AtomicU64>,
    _dir: std::path::PathBuf,
    _writers: Vec<kvc_admission::SnapshotWriter>,
}

impl Fixture {
    /// A router over one prefill and two decode workers whose Route calls cycle over
    /// `sessions` sessions.
    fn new(sessions: u64) -> Fixture {
        let rt = common::runtime();
        let (mut cfg, writers, dir) = common::one_p_two_d("router-bench");
        cfg.max_pending_decisions = common::size(cfg.max_pending_decisions, 100);
        let (router, client) = rt.block_on(async {
            let router = kvc_router::serve(cfg, std::future::pending())
                .await
                .unwrap();
            let client = RouterClient::connect(format!("http://{}", router.grpc_addr()))
                .await
                .unwrap();
            (router, client)
        });
        Fixture {
            sessions,
            rt,
            router,
            client,
            next: Arc::new(AtomicU64::new(0)),
            _dir: dir,
            _writers: writers,
        }
    }

    /// `total` calls spread over 32 concurrent tasks; returns the wall time.
    fn run(&self, total: u64, route: bool) -> Duration {
        self.rt.block_on(async {
            let started = Instant::now();
            let mut tasks = Vec::with_capacity(STREAMS as usize);
            for s in 0..STREAMS {
                let n = total / STREAMS + u64::from(s < total % STREAMS);
                let mut client = self.client.clone();
                let next = Arc::clone(&self.next);
                let sessions = self.sessions;
                tasks.push(tokio::spawn(async move {
                    for _ in 0..n {
                        if route {
                            let r = next.fetch_add(1, Ordering::Relaxed);
                            let session = r % sessions;
                            let base = session * 64;
                            let req = pb::RouteRequest {
                                request_id: r,
                                session_id: Some(session),
                                turn_id: None,
                                input_length: 1_300,
                                output_hint: 40,
                                hash_ids: vec![base + 1, base + 2, base + 3],
                                rejected_by: None,
                                parent_session_id: None,
                            };
                            client.route(req).await.unwrap();
                        } else {
                            client.ping(pb::PingRequest {}).await.unwrap();
                        }
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            started.elapsed()
        })
    }
}

/// The median of `runs`.
fn median(mut runs: Vec<f64>) -> f64 {
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

/// Route's throughput with 1,000 and with 100,000 tracked sessions: the median of five
/// alternating fixed runs on each, after every session was routed once (alternating and the
/// median keep a busy machine's swings out of the ratio).
fn sessions_scaling() -> (f64, f64) {
    let [(small_n, small_name), (large_n, large_name)] =
        common::size(SCALING, [(100, "100"), (1_000, "1,000")]);
    let small = Fixture::new(small_n);
    let large = Fixture::new(large_n);
    for f in [&small, &large] {
        f.run(f.sessions, true);
        assert_eq!(f.router.service().session_count() as u64, f.sessions);
    }
    let calls = calls();
    let rps = |f: &Fixture| calls as f64 / f.run(calls, true).as_secs_f64();
    let (mut s, mut l) = (Vec::new(), Vec::new());
    for _ in 0..runs() {
        s.push(rps(&small));
        l.push(rps(&large));
    }
    let (s, l) = (median(s), median(l));
    for (f, n) in [(&small, small_name), (&large, large_name)] {
        let m = f.router.service().metrics();
        println!(
            "router: {n} sessions: decision p50 {:?}, p99 {:?}",
            m.decision_latency(0.5),
            m.decision_latency(0.99)
        );
    }
    println!(
        "router: Route with {small_name} sessions {s:.0} req/s, with {large_name} sessions {l:.0} req/s, ratio {:.3}",
        l / s
    );
    for f in [small, large] {
        f.stop();
    }
    (s, l)
}

impl Fixture {
    /// Stops the router and removes its snapshot files.
    fn stop(self) {
        self.router.shutdown();
        let Fixture {
            rt, router, _dir, ..
        } = self;
        rt.block_on(async {
            let _ = tokio::time::timeout(Duration::from_secs(10), router.wait()).await;
        });
        let _ = std::fs::remove_dir_all(&_dir);
    }
}

fn main() {
    let mut c =
        common::criterion_settings(Criterion::default().sample_size(10)).configure_from_args();
    let f = Fixture::new(SESSIONS);
    {
        let mut g = c.benchmark_group("router");
        g.throughput(Throughput::Elements(1));
        g.bench_function("route_rps", |b| b.iter_custom(|iters| f.run(iters, true)));
        g.bench_function("noop_rps", |b| b.iter_custom(|iters| f.run(iters, false)));
        g.finish();
    }

    // Five alternating fixed, bounded runs of each; the ratio of the medians.
    let (calls, runs) = (calls(), runs());
    let rps = |d: Duration| calls as f64 / d.as_secs_f64();
    let (mut pings, mut routes) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        pings.push(rps(f.run(calls, false)));
        routes.push(rps(f.run(calls, true)));
    }
    let (ping, route) = (median(pings), median(routes));
    let m = f.router.service().metrics();
    println!(
        "router: {calls} calls x {STREAMS} streams, median of {runs}: route {route:.0} req/s, ping {ping:.0} req/s, route/ping throughput ratio {:.3}",
        route / ping
    );
    println!(
        "router: decision latency over {} decisions: p50 {:?}, p99 {:?}, p99.9 {:?}",
        m.decision_count(),
        m.decision_latency(0.5),
        m.decision_latency(0.99),
        m.decision_latency(0.999)
    );
    let p99_us = m.decision_latency(0.99).as_secs_f64() * 1e6;
    f.stop();
    let (small, large) = sessions_scaling();
    // `cargo xtask bench` reads these figures from the file named by KVC_BENCH_OUT.
    if let Some(path) = std::env::var_os("KVC_BENCH_OUT") {
        let json = format!(
            "{{\"route_rps\": {route:.1}, \"noop_rps\": {ping:.1}, \"route_vs_noop\": {:.4}, \"decision_p99_us\": {p99_us:.3}, \"route_rps_1k_sessions\": {small:.1}, \"route_rps_100k_sessions\": {large:.1}, \"route_100k_vs_1k_sessions\": {:.4}}}\n",
            route / ping,
            large / small,
        );
        std::fs::write(&path, json).expect("write KVC_BENCH_OUT");
    }
    c.final_summary();
}
