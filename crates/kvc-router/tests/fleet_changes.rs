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
    assert_eq!(
        report.applied,
        [
            "worker 2 (`d2`) removed (0 resident session(s) move at their next turn, 0 \
             request(s) in flight run on)",
            "worker 1 (`d1`) drained",
            "worker 3 (`d3`) added",
        ]
    );
    assert_eq!(
        report.needs_restart,
        [
            "worker 0 (`p0`): capacity-tokens, http-url changed: needs a restart, or removing \
             the worker and adding it back",
            "settings other than the workers changed: they need a restart",
        ]
    );
    let listed: Vec<u32> = service.list_workers().iter().map(|w| w.id.0).collect();
    assert_eq!(listed, [0, 1, 3]);
    assert_eq!(service.set_drained(kvc_core::WorkerId(2), true), None);
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

async fn remove(c: &mut Cluster, worker: u32) -> Result<pb::RemoveWorkerReply, tonic::Status> {
    c.client
        .remove_worker(authed(pb::RemoveWorkerRequest { worker }))
        .await
        .map(tonic::Response::into_inner)
}

async fn add(c: &mut Cluster, worker_toml: &str) -> Result<u32, tonic::Status> {
    c.client
        .add_worker(authed(pb::AddWorkerRequest {
            worker_toml: worker_toml.to_owned(),
        }))
        .await
        .map(|r| r.into_inner().worker)
}

async fn listed_ids(c: &mut Cluster) -> Vec<u32> {
    c.client
        .list_workers(authed(pb::ListWorkersRequest {}))
        .await
        .unwrap()
        .into_inner()
        .workers
        .iter()
        .map(|w| w.id)
        .collect()
}

#[tokio::test]
async fn a_worker_removed_and_one_added_by_the_control_plane() {
    let (mut c, _dir) = with_token().await;
    // Session 7 resident on its decode worker; session 8's first turn in flight there too.
    let t1 = route(&mut c, route_req(1, Some(7), Some(1), 1_300, &[11, 12, 13])).await;
    let home = t1.decode_worker;
    let other = if home == 1 { 2 } else { 1 };
    served(&mut c, &t1, 1, 1_340).await;
    let mut in_flight = None;
    for s in 0..8u64 {
        let d = route(
            &mut c,
            route_req(20 + s, Some(300 + s), Some(1), 900, &[900 + s]),
        )
        .await;
        if d.decode_worker == home {
            in_flight = Some((d, 20 + s));
            break;
        }
        served(&mut c, &d, 20 + s, 940).await;
    }
    let (pending, pending_id) = in_flight.expect("a new session on the session's worker");

    let r = remove(&mut c, home).await.unwrap();
    // Session 7, and the session whose first turn is in flight there.
    assert_eq!((r.resident_sessions, r.in_flight), (2, 1));
    assert_eq!(listed_ids(&mut c).await, [0, other]);
    // The request in flight on it ends as usual, once, and leaves nothing counted there.
    served(&mut c, &pending, pending_id, 940).await;
    let view = c
        .service()
        .session_view(kvc_core::SessionId(pending_id + 280))
        .unwrap();
    assert_eq!(view.decode, Some(kvc_core::WorkerId(home)));
    assert_ne!(view.residency, kvc_policy::Residency::Resident);
    assert_eq!(view.held_blocks, 0);
    let again = c
        .client
        .report_outcome(authed(pb::OutcomeReport {
            decision_id: pending.decision_id,
            request_id: pending_id,
            outcome: Outcome::Ok.to_proto(),
            resident_tokens: 940,
        }))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::NotFound);
    // Session 7's next turn is re-seeded on the other decode worker.
    let t2 = route(
        &mut c,
        route_req(2, Some(7), Some(2), 1_900, &[11, 12, 14, 15]),
    )
    .await;
    assert_eq!(t2.decode_worker, other, "{t2:?}");
    assert_ne!(t2.mode(), ExecutionMode::DirectToD);
    served(&mut c, &t2, 2, 1_940).await;

    // Not twice; never the last decode worker.
    assert_eq!(
        remove(&mut c, home).await.unwrap_err().code(),
        Code::NotFound
    );
    let e = remove(&mut c, other).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(
        e.message().contains("add its replacement first"),
        "{}",
        e.message()
    );

    // A new decode worker, from its [[workers]] entry; its snapshot published.
    let snap = c.dir.0.join("w3.snap");
    let mut writer =
        kvc_admission::SnapshotWriter::create(&snap, kvc_core::WorkerId(3), common::CAPACITY, 64)
            .unwrap();
    let mut data = writer.empty_data();
    data.free_tokens = common::CAPACITY;
    data.publish_ms = c.now();
    writer.publish(&data).unwrap();
    let entry = format!(
        "id = 3\nname = \"d3\"\nrole = \"decode\"\ncapacity-tokens = {}\nsnapshot = {:?}\n",
        common::CAPACITY,
        snap.display().to_string()
    );
    assert_eq!(add(&mut c, &entry).await.unwrap(), 3);
    assert_eq!(listed_ids(&mut c).await, [0, other, 3]);
    assert_eq!(
        add(&mut c, &entry).await.unwrap_err().code(),
        Code::FailedPrecondition,
        "the same id twice"
    );
    let bad = add(&mut c, "id = 4\nrole = \"decoder\"\n")
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("decoder"), "{}", bad.message());
    let e = c
        .client
        .add_worker(pb::AddWorkerRequest {
            worker_toml: entry.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);

    // With the other decode worker drained, new sessions go to the added one.
    assert!(!drain(&mut c, other, true).await.unwrap());
    for s in 0..4u64 {
        let d = route(
            &mut c,
            route_req(40 + s, Some(500 + s), Some(1), 900, &[1_500 + s]),
        )
        .await;
        assert_eq!(d.decode_worker, 3, "{d:?}");
        served(&mut c, &d, 40 + s, 940).await;
    }
    let _keep = writer;
}

#[tokio::test]
async fn a_drained_worker_is_not_routed_on_stale_state() {
    let (mut c, _dir) = with_token().await;
    assert!(!drain(&mut c, 2, true).await.unwrap(), "not drained before");
    // Every worker's state grows stale, but P's: the decision is made on the stale decode
    // workers' last state, and never on the drained one.
    c.clock.advance(common::STALE_MS + 1);
    c.heartbeat(&[0]);
    c.wait_health(&[1], kvc_core::Health::Stale).await;
    for i in 0..6u64 {
        let d = route(
            &mut c,
            route_req(10 + i, Some(10 + i), Some(1), 600, &[i, 50 + i]),
        )
        .await;
        assert_eq!(d.decode_worker, 1, "decision {i}");
    }
    assert_eq!(c.service().metrics().stale_routed(), 6);
}
