//! The session table is bounded: by count (least recently seen first) and by TTL.
#![forbid(unsafe_code)]

mod common;

use common::{Cluster, route_req, value};
use kvc_core::{Health, SessionId};

#[tokio::test]
async fn session_table_never_exceeds_its_bound() {
    const N: usize = 4;
    const K: u64 = 5;
    let mut c = Cluster::start(|cfg| cfg.sessions.max_sessions = N).await;
    for s in 0..(N as u64 + K) {
        c.client
            .route(route_req(s, Some(1_000 + s), Some(1), 600, &[s, s + 1]))
            .await
            .unwrap();
        assert!(c.service().session_count() <= N);
        assert!(c.service().policy_session_count() <= N);
    }
    assert_eq!(c.service().session_count(), N);
    for s in 0..K {
        assert!(
            !c.service().knows_session(SessionId(1_000 + s)),
            "session {s} was evicted"
        );
    }
    for s in K..(N as u64 + K) {
        assert!(c.service().knows_session(SessionId(1_000 + s)));
    }
    let m = c.metrics().await;
    assert_eq!(value(&m, "kvc_router_sessions_tracked", &[]), N as f64);
    assert_eq!(
        value(
            &m,
            "kvc_router_sessions_forgotten_total",
            &[("cause", "evicted")]
        ),
        K as f64
    );
}

#[tokio::test]
async fn idle_sessions_expire_after_the_ttl() {
    let mut c = Cluster::start(|cfg| {
        cfg.sessions.ttl_ms = 5_000;
        cfg.stale_after_ms = 60_000;
    })
    .await;
    c.client
        .route(route_req(1, Some(1), Some(1), 600, &[1, 2]))
        .await
        .unwrap();
    c.clock.advance(3_000);
    c.client
        .route(route_req(2, Some(2), Some(1), 600, &[3, 4]))
        .await
        .unwrap();
    c.clock.advance(2_500);
    // Session 1 idle 5,500 ms > TTL; session 2 idle 2,500 ms.
    c.heartbeat(&[0, 1, 2]);
    c.wait_health(&[0, 1, 2], Health::Healthy).await;
    c.service().expire_sessions();
    assert!(!c.service().knows_session(SessionId(1)));
    assert!(c.service().knows_session(SessionId(2)));
    assert_eq!(c.service().session_count(), 1);
    // A later turn of the forgotten session is routed like a new session.
    c.client
        .route(route_req(3, Some(1), Some(2), 900, &[1, 2]))
        .await
        .unwrap();
    assert!(c.service().knows_session(SessionId(1)));
    let m = c.metrics().await;
    assert_eq!(
        value(
            &m,
            "kvc_router_sessions_forgotten_total",
            &[("cause", "expired")]
        ),
        1.0
    );
}

#[tokio::test]
async fn pending_decisions_are_bounded() {
    let mut c = Cluster::start(|cfg| cfg.max_pending_decisions = 3).await;
    let mut ids = Vec::new();
    for r in 0..5u64 {
        let d = c
            .client
            .route(route_req(r, None, None, 300, &[r]))
            .await
            .unwrap()
            .into_inner();
        ids.push(d.decision_id);
    }
    assert_eq!(c.service().pending_decisions(), 3);
    let e = c
        .client
        .report_outcome(kvc_proto::pb::OutcomeReport {
            decision_id: ids[0],
            request_id: 0,
            outcome: 1,
            resident_tokens: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    let m = c.metrics().await;
    assert_eq!(value(&m, "kvc_router_pending_dropped_total", &[]), 2.0);
}
