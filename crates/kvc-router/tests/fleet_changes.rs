//! A fleet that changes while the router runs: a worker drained by the control plane
//! (`DrainWorker`, behind the gRPC listener's token) or by a re-read configuration takes no new
//! work, its session moves at its next turn, and it comes back; what a re-read cannot apply is
//! named, worker by worker.

mod common;

use common::{Cluster, TempDir, route_req};
use kvc_core::Outcome;
use kvc_proto::convert::ProtoEnum;
use kvc_proto::pb;
use kvc_proto::pb::ExecutionMode;
use kvc_router::auth::TokenSource;
use tonic::Code;

const TOKEN: &str = "drain-token-5c1e";

fn authed<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    r
}

async fn with_token() -> (Cluster, TempDir) {
    let dir = TempDir::new("drain-token");
    let path = dir.0.join("grpc.token");
    std::fs::write(&path, format!("{TOKEN}\n")).unwrap();
    let c = Cluster::start(|cfg| cfg.auth.grpc = Some(TokenSource::file(path))).await;
    (c, dir)
}

async fn route(c: &mut Cluster, req: pb::RouteRequest) -> pb::RouteDecision {
    c.client.route(authed(req)).await.unwrap().into_inner()
}

async fn served(c: &mut Cluster, d: &pb::RouteDecision, request_id: u64, resident: u64) {
    c.client
        .report_outcome(authed(pb::OutcomeReport {
            decision_id: d.decision_id,
            request_id,
            outcome: Outcome::Ok.to_proto(),
            resident_tokens: resident,
        }))
        .await
        .unwrap();
}

async fn drain(c: &mut Cluster, worker: u32, drain: bool) -> Result<bool, tonic::Status> {
    c.client
        .drain_worker(authed(pb::DrainWorkerRequest { worker, drain }))
        .await
        .map(|r| r.into_inner().was_drained)
}

/// `DrainWorker` of worker 1 without a bearer token: its error.
async fn drain_without_token(c: &mut Cluster) -> tonic::Status {
    c.client
        .drain_worker(pb::DrainWorkerRequest {
            worker: 1,
            drain: true,
        })
        .await
        .unwrap_err()
}

#[tokio::test]
async fn a_drained_decode_worker_takes_no_new_work_and_its_session_moves_at_the_next_turn() {
    let (mut c, _dir) = with_token().await;
    let t1 = route(&mut c, route_req(1, Some(7), Some(1), 1_300, &[11, 12, 13])).await;
    assert_eq!(t1.mode(), ExecutionMode::Turn1Seed);
    let home = t1.decode_worker;
    let other = if home == 1 { 2 } else { 1 };
    served(&mut c, &t1, 1, 1_340).await;
    let t2 = route(
        &mut c,
        route_req(2, Some(7), Some(2), 1_900, &[11, 12, 14, 15]),
    )
    .await;
    assert_eq!(
        (t2.mode(), t2.decode_worker),
        (ExecutionMode::DirectToD, home)
    );
    served(&mut c, &t2, 2, 1_940).await;

    assert!(!drain(&mut c, home, true).await.unwrap());
    assert!(drain(&mut c, home, true).await.unwrap(), "already drained");
    let listed = c
        .client
        .list_workers(authed(pb::ListWorkersRequest {}))
        .await
        .unwrap()
        .into_inner()
        .workers;
    let w = listed.iter().find(|w| w.id == home).unwrap();
    assert!(w.drained);
    assert!(listed.iter().filter(|w| w.id != home).all(|w| !w.drained));

    // The session's next turn moves to the other decode worker, through P; a new session
    // never lands on the drained one.
    let t3 = route(
        &mut c,
        route_req(3, Some(7), Some(3), 2_100, &[11, 12, 14, 15, 16]),
    )
    .await;
    assert_eq!(t3.decode_worker, other, "{t3:?}");
    assert_ne!(t3.mode(), ExecutionMode::DirectToD);
    served(&mut c, &t3, 3, 2_140).await;
    for s in 0..6u64 {
        let d = route(
            &mut c,
            route_req(10 + s, Some(100 + s), Some(1), 900, &[500 + s, 600 + s]),
        )
        .await;
        assert_eq!(
            d.decode_worker,
            other,
            "session {} placed on the drained worker",
            100 + s
        );
    }
    let m = c.metrics().await;
    assert_eq!(
        common::value(
            &m,
            "kvc_router_worker_drained",
            &[
                ("worker", &home.to_string()),
                ("name", &format!("d{home}")),
                ("role", "decode")
            ]
        ),
        1.0
    );

    // Back in rotation: new sessions may land there again.
    assert!(drain(&mut c, home, false).await.unwrap());
    let mut placed_home = false;
    for s in 0..8u64 {
        let d = route(
            &mut c,
            route_req(30 + s, Some(200 + s), Some(1), 900, &[700 + s, 800 + s]),
        )
        .await;
        placed_home |= d.decode_worker == home;
    }
    assert!(placed_home, "no new session on the worker back in rotation");
    assert!(!c.service().is_drained(kvc_core::WorkerId(home)));

    // An unknown worker, and the call without the token.
    assert_eq!(
        drain(&mut c, 9, true).await.unwrap_err().code(),
        Code::NotFound
    );
    let e = drain_without_token(&mut c).await;
    assert_eq!(e.code(), Code::Unauthenticated);
}

#[tokio::test]
async fn drain_worker_is_refused_on_a_listener_without_a_token() {
    let mut c = Cluster::start(|_| {}).await;
    let e = drain_without_token(&mut c).await;
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(e.message().contains("[auth.grpc]"), "{}", e.message());
    assert!(!c.service().is_drained(kvc_core::WorkerId(1)));
}

#[tokio::test]
async fn a_reread_configuration_drains_and_names_what_needs_a_restart() {
    let c = Cluster::start(|_| {}).await;
    let service = c.service();
    let mut next = service.config().clone();
    next.workers[1].drained = true;
    next.workers[0].capacity_tokens += 1;
    next.workers[0].http_url = Some("http://127.0.0.1:9".into());
    let mut added = next.workers[2].clone();
    added.id = 3;
    added.name = Some("d3".into());
    next.workers.remove(2);
    next.workers.push(added);
    next.sessions.ttl_ms += 1;
    let report = service.reload(&next);
    assert_eq!(report.applied, ["worker 1 (`d1`) drained"]);
    assert_eq!(
        report.needs_restart,
        [
            "worker 0 (`p0`): capacity-tokens, http-url changed: needs a restart",
            "worker 3 (`d3`) added: adding a worker needs a restart",
            "worker 2 (`d2`) removed: removing a worker needs a restart (set drained = true \
             meanwhile)",
            "settings other than the workers changed: they need a restart",
        ]
    );
    assert!(service.is_drained(kvc_core::WorkerId(1)));
    // The same file again changes nothing; undraining is applied.
    assert!(service.reload(&next).applied.is_empty());
    next.workers[1].drained = false;
    assert_eq!(
        service.reload(&next).applied,
        ["worker 1 (`d1`) back in rotation"]
    );
    assert!(!service.is_drained(kvc_core::WorkerId(1)));
}
