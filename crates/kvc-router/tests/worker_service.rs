//! Workers reached through `kvc.v1.Worker`: a prefill worker known only by address (its state
//! polled with `State`) and a decode worker whose `CommitEvict` goes to its commit queue.
#![forbid(unsafe_code)]

mod common;

use common::{Cluster, route_req, value};
use kvc_admission::{CommitReply, SnapshotReader, commit_queue};
use kvc_core::{ExecutionMode, FallThroughReason, Health, Outcome, SessionId};
use kvc_proto::convert::ProtoEnum;
use kvc_proto::pb;
use kvc_proto::worker::{LocalWorker, SharedClock, serve_worker};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polled_worker_and_commit_evict_forwarding() {
    let dir = common::TempDir::new("svc");
    let clock = Arc::new(kvc_admission::ManualClock::new(common::START_MS));
    let shared: SharedClock = clock.clone();

    // Snapshots for all three; the prefill worker's is read only by its own service.
    let paths: Vec<_> = (0..3).map(|i| dir.0.join(format!("w{i}.snap"))).collect();
    let mut writers: Vec<_> = (0..3u32)
        .map(|i| {
            let mut w = kvc_admission::SnapshotWriter::create(
                &paths[i as usize],
                kvc_core::WorkerId(i),
                common::CAPACITY,
                64,
            )
            .unwrap();
            let mut d = w.empty_data();
            d.free_tokens = common::CAPACITY;
            // Worker 1 is busier, so new sessions go to worker 2.
            if i == 1 {
                d.used_tokens = 40_000;
                d.free_tokens = 52_000;
            }
            d.publish_ms = common::START_MS;
            w.publish(&d).unwrap();
            w
        })
        .collect();

    // Worker 2's commit queue owner: admits and evicts session 7.
    let (tx2, mut rx2) = commit_queue(8);
    let stop = Arc::new(AtomicBool::new(false));
    let owner = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                rx2.drain_wait(Duration::from_millis(5), |req| CommitReply {
                    admitted: req.need_tokens <= 10_000,
                    freed_tokens: 1_340,
                    evicted: vec![SessionId(7)],
                    recommended_pause_ms: 0,
                });
            }
        })
    };
    let (tx0, _rx0) = commit_queue(1);
    let local = |i: usize, tx| {
        LocalWorker::new(
            SnapshotReader::open(&paths[i]).unwrap(),
            tx,
            Arc::clone(&shared),
            // Only guards against an owner that never answers.
            Duration::from_secs(30),
        )
    };
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let p_service = serve_worker(any, local(0, tx0.clone())).await.unwrap();
    let p_addr = p_service.addr();
    let d2_service = serve_worker(any, local(2, tx2)).await.unwrap();

    let mut cfg = common::base_config(&dir);
    cfg.workers[0].snapshot = None;
    cfg.workers[0].address = Some(p_service.uri());
    cfg.workers[2].address = Some(d2_service.uri());
    // State polls and the CommitEvict round trip never time out on a loaded machine; a
    // stopped service still fails at once (its connection is refused).
    cfg.rpc_timeout_ms = 30_000;
    let service =
        Arc::new(kvc_router::RouterService::with_clock(cfg, Arc::clone(&shared)).unwrap());
    let router = kvc_router::serve_service(Arc::clone(&service), std::future::pending())
        .await
        .unwrap();
    let mut client =
        pb::router_client::RouterClient::connect(format!("http://{}", router.grpc_addr()))
            .await
            .unwrap();

    let wait = |ids: Vec<u32>, health: Health| {
        let service = Arc::clone(&service);
        async move { common::wait_health(&service, &ids, health).await }
    };
    wait(vec![0, 1, 2], Health::Healthy).await;
    let list = client
        .list_workers(pb::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.workers[0].source, "service");
    assert_eq!(list.workers[2].source, "snapshot");

    // Session 7 seeds on worker 2 and is reported resident.
    let d1 = client
        .route(route_req(1, Some(7), Some(1), 1_300, &[11, 12, 13]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d1.decode_worker, 2);
    client
        .report_outcome(pb::OutcomeReport {
            decision_id: d1.decision_id,
            request_id: 1,
            outcome: Outcome::Ok.to_proto(),
            resident_tokens: 1_340,
        })
        .await
        .unwrap();

    // CommitEvict for another session evicts session 7 on worker 2.
    let reply = client
        .commit_evict(pb::CommitEvictRequest {
            worker: 2,
            need_tokens: 5_000,
            session_id: Some(9),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(reply.admitted);
    assert_eq!(reply.evicted_sessions, [7]);
    // The router observed the eviction: the next turn cannot go direct.
    let d2 = client
        .route(route_req(2, Some(7), Some(2), 1_900, &[11, 12, 14, 15]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        ExecutionMode::from_proto(d2.mode).unwrap(),
        ExecutionMode::Fallback
    );
    assert_eq!(
        d2.fall_through_reason,
        Some(FallThroughReason::SessionEvicted.to_proto())
    );
    assert_eq!(d2.prefill_worker, Some(0));

    // The prefill worker stops answering: out of rotation, so no P→D path exists.
    p_service.stop().await.unwrap();
    wait(vec![0], Health::Down).await;
    let e = client
        .route(route_req(3, Some(8), Some(1), 600, &[1, 2]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);

    // It comes back on the same address: back in rotation.
    let p_again = serve_worker(p_addr, local(0, tx0)).await.unwrap();
    for w in &mut writers {
        w.heartbeat(common::START_MS);
    }
    wait(vec![0], Health::Healthy).await;
    let d3 = client
        .route(route_req(4, Some(8), Some(1), 600, &[1, 2]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d3.prefill_worker, Some(0));

    let text = common::http_get(router.metrics_addr().unwrap(), "/metrics")
        .await
        .1;
    let m = common::parse_prometheus(&text);
    assert_eq!(
        value(
            &m,
            "kvc_router_commit_evicts_total",
            &[("result", "admitted")]
        ),
        1.0
    );

    stop.store(true, Ordering::Relaxed);
    owner.join().unwrap();
    p_again.stop().await.unwrap();
    d2_service.stop().await.unwrap();
    router.shutdown();
    router.wait().await.unwrap();
}

#[tokio::test]
async fn shutdown_stops_the_router_cleanly() {
    let c = Cluster::start(|_| {}).await;
    let addr = c.router.grpc_addr();
    c.router.shutdown();
    tokio::time::timeout(common::WAIT, c.router.wait())
        .await
        .expect("the router stops")
        .unwrap();
    let again = tokio::net::TcpStream::connect(addr).await;
    assert!(again.is_err(), "the listener is closed after shutdown");
}
