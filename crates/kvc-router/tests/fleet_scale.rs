//! A fleet at the policies' worker limit: 4,096 workers (one prefill, 4,095 decode, each
//! publishing a snapshot) route over gRPC and through the HTTP front, and one worker more is
//! refused at start with the limit named.

mod common;

use common::front::{Front, options};
use common::sglang_mock::{generate_body, spawn_mock};
use common::{CAPACITY, route_req};
use kvc_core::{ExecutionMode, WorkerRole};
use kvc_policy::MAX_WORKERS;
use kvc_proto::convert::ProtoEnum;
use kvc_router::{RouterConfig, RouterService, WorkerConfig};
use std::time::Duration;

/// The only decode worker with room: the highest id the policies hold.
const ROOMY: u32 = MAX_WORKERS as u32 - 1;

/// Workers `0..n` of the base configuration's kind: P0, then decode workers `d<id>`, each
/// publishing a snapshot in `dir`.
fn fleet(cfg: &mut RouterConfig, n: u32) {
    let dir = cfg.workers[0]
        .snapshot
        .clone()
        .unwrap()
        .parent()
        .unwrap()
        .to_owned();
    cfg.workers = (0..n)
        .map(|i| {
            let role = if i == 0 {
                WorkerRole::Prefill
            } else {
                WorkerRole::Decode
            };
            WorkerConfig {
                name: Some(format!("{}{i}", &role.to_string()[..1])),
                snapshot: Some(dir.join(format!("w{i}.snap"))),
                ..WorkerConfig::new(i, role, CAPACITY)
            }
        })
        .collect();
    // 4,096 snapshots are read every 50 ms rather than every 5.
    cfg.refresh_interval_ms = 50;
    cfg.poll_interval_ms = 200;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_4096_workers_routes_over_grpc_and_http() {
    // One mock HTTP server stands behind every worker: which worker was chosen is read from
    // the front's headers.
    let (mock, mock_addr) = spawn_mock("any").await;
    let mut s = Front::start(
        |cfg| fleet(cfg, MAX_WORKERS as u32),
        async |_| (mock.clone(), mock_addr),
        |id, _| (id == 0).then_some(9_098),
        |_| {},
        // Only guards against a hang.
        options(Duration::from_secs(30)),
    )
    .await;
    assert_eq!(s.cluster.service().worker_views().len(), MAX_WORKERS);
    // Every decode worker but the last is nearly full, once the router has read it so.
    for id in 1..ROOMY {
        s.cluster.publish(id, CAPACITY - 1_000, 1_000);
    }
    let service = s.cluster.service().clone();
    common::wait_until("every full worker's snapshot read", || {
        service
            .worker_views()
            .iter()
            .filter(|v| (1..ROOMY).contains(&v.id.0))
            .all(|v| v.state.used_tokens == CAPACITY - 1_000)
    })
    .await;

    // gRPC: a first turn seeds on the roomy worker, its second goes there directly.
    let d1 = s
        .cluster
        .client
        .route(route_req(1, Some(7), Some(1), 1_300, &[11, 12, 13]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        ExecutionMode::from_proto(d1.mode).unwrap(),
        ExecutionMode::Turn1Seed
    );
    assert_eq!((d1.prefill_worker, d1.decode_worker), (Some(0), ROOMY));
    s.cluster.report_ok(d1.decision_id, 1, 1_340).await;
    let d2 = s
        .cluster
        .client
        .route(route_req(2, Some(7), Some(2), 1_900, &[11, 12, 14, 15]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        ExecutionMode::from_proto(d2.mode).unwrap(),
        ExecutionMode::DirectToD
    );
    assert_eq!((d2.prefill_worker, d2.decode_worker), (None, ROOMY));
    assert_eq!(d2.cached_tokens, 1_024);
    s.cluster.report_ok(d2.decision_id, 2, 1_940).await;

    // HTTP: the same for a session of the front, forwarded and answered.
    let session = [("x-session-id", "agent-4096")];
    let r = s
        .send("/generate", &session, &generate_body(0..1_300))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    assert_eq!(r.headers["x-kvc-decode-worker"], ROOMY.to_string());
    let r = s
        .send("/generate", &session, &generate_body(0..1_900))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "direct-to-d");
    assert_eq!(r.headers["x-kvc-decode-worker"], ROOMY.to_string());
    s.settle().await;
    let m = s.cluster.service().metrics();
    println!(
        "4,096 workers: decision p50 {:?}, p99 {:?}",
        m.decision_latency(0.5),
        m.decision_latency(0.99)
    );
    // P0 once, the roomy decode worker twice, all through the one mock. P's request of the
    // first turn runs beside D's, so the client's answer can come before P's request reaches
    // the mock (on a loaded machine it did): wait for it, then count exactly.
    common::wait_until("P's request and D's two at the mock", || {
        mock.received.lock().len() >= 3
    })
    .await;
    assert_eq!(mock.received.lock().len(), 3);
    assert_eq!(
        s.outcomes("ok"),
        4.0,
        "two over gRPC, two through the front"
    );
}

#[test]
fn one_worker_past_the_limit_is_refused_with_the_limit_named() {
    let dir = common::TempDir::new("fleet");
    let mut cfg = common::base_config(&dir);
    fleet(&mut cfg, MAX_WORKERS as u32 + 1);
    let Err(err) = RouterService::new(cfg) else {
        panic!("a 4,097-worker fleet is refused");
    };
    assert!(
        err.to_string()
            .contains("worker id 4096 out of range (ids must be below 4096)"),
        "{err}"
    );
}
