//! End-to-end routing over loopback gRPC: a router with one prefill and two decode workers
//! publishing snapshots into temp files, on a manual clock.
#![forbid(unsafe_code)]

mod common;

use common::{Cluster, route_req, value};
use kvc_core::{ExecutionMode, FallThroughReason, Health, Outcome, WorkerRole};
use kvc_proto::convert::ProtoEnum;
use kvc_proto::pb;

fn mode(d: &pb::RouteDecision) -> ExecutionMode {
    ExecutionMode::from_proto(d.mode).unwrap()
}

/// Turn 1 of session 7 (1,300 tokens, 3 blocks), reported back as resident.
async fn seed_session(c: &mut Cluster) -> pb::RouteDecision {
    let d1 = c
        .client
        .route(route_req(1, Some(7), Some(1), 1_300, &[11, 12, 13]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mode(&d1), ExecutionMode::Turn1Seed);
    assert_eq!(d1.prefill_worker, Some(0));
    assert!([1, 2].contains(&d1.decode_worker));
    assert_eq!(d1.fall_through_reason, None);
    assert_eq!(d1.probe_rejected_by, None);
    c.client
        .report_outcome(pb::OutcomeReport {
            decision_id: d1.decision_id,
            request_id: 1,
            outcome: Outcome::Ok.to_proto(),
            resident_tokens: 1_340,
        })
        .await
        .unwrap();
    d1
}

#[tokio::test]
async fn session_turns_seed_then_go_direct_to_d() {
    let mut c = Cluster::start(|_| {}).await;
    let d1 = seed_session(&mut c).await;

    let d2 = c
        .client
        .route(route_req(2, Some(7), Some(2), 1_900, &[11, 12, 14, 15]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mode(&d2), ExecutionMode::DirectToD);
    assert_eq!(d2.decode_worker, d1.decode_worker);
    assert_eq!(d2.prefill_worker, None);
    assert_eq!(d2.cached_tokens, 1_024);
    // The append extends the session in place: what it needs beyond the 1,340 tokens the
    // session holds there (its KV past the reused blocks is replaced), plus the output.
    assert_eq!(d2.need_tokens, 1_900 - 1_340 + 40);
    assert_eq!(d2.probe_rejected_by, None);
    assert!(d2.decision_id > d1.decision_id);

    let m = c.metrics().await;
    assert_eq!(
        value(&m, "kvc_router_probes_total", &[("result", "admit")]),
        1.0
    );
    assert_eq!(
        value(&m, "kvc_router_probes_total", &[("result", "reject")]),
        0.0
    );
    assert_eq!(
        value(
            &m,
            "kvc_router_decisions_total",
            &[("mode", "turn1-seed"), ("reason", "none")]
        ),
        1.0
    );
    assert_eq!(
        value(
            &m,
            "kvc_router_decisions_total",
            &[("mode", "direct-to-d"), ("reason", "none")]
        ),
        1.0
    );
    assert_eq!(
        value(&m, "kvc_router_outcomes_total", &[("outcome", "ok")]),
        1.0
    );
    assert_eq!(value(&m, "kvc_router_sessions_tracked", &[]), 1.0);
    assert_eq!(value(&m, "kvc_router_pending_decisions", &[]), 1.0);
    assert_eq!(
        value(&m, "kvc_router_decision_latency_seconds_count", &[]),
        2.0
    );
    // A decision id is reported once.
    let again = c
        .client
        .report_outcome(pb::OutcomeReport {
            decision_id: d1.decision_id,
            request_id: 1,
            outcome: Outcome::Ok.to_proto(),
            resident_tokens: 1,
        })
        .await
        .unwrap_err();
    assert_eq!(again.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn probe_reject_reroutes_through_prefill() {
    let mut c = Cluster::start(|_| {}).await;
    let d1 = seed_session(&mut c).await;
    let d = d1.decode_worker;
    // D's pool is lightly used but has only 100 tokens of room: the policy still plans
    // direct-to-D (capacity term fine), the snapshot probe cannot admit ~916 tokens.
    c.publish(d, 10_000, 100);

    let d2 = c
        .client
        .route(route_req(2, Some(7), Some(2), 1_900, &[11, 12, 14, 15]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d2.probe_rejected_by, Some(d));
    assert_eq!(mode(&d2), ExecutionMode::Fallback);
    assert_eq!(
        d2.fall_through_reason,
        Some(FallThroughReason::SessionCapRejected.to_proto())
    );
    assert_eq!(d2.prefill_worker, Some(0));
    assert_eq!(
        d2.decode_worker, d,
        "one reject does not migrate the session"
    );

    // The probe RPC gives the same answer.
    let p = c
        .client
        .probe(pb::ProbeRequest {
            worker: d,
            need_tokens: 916,
            session_id: Some(7),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!p.can_admit);
    assert_eq!(p.available_tokens, 100);

    let m = c.metrics().await;
    assert_eq!(
        value(&m, "kvc_router_probes_total", &[("result", "reject")]),
        2.0
    );
    assert_eq!(value(&m, "kvc_router_probe_reroutes_total", &[]), 1.0);
    assert_eq!(
        value(
            &m,
            "kvc_router_decisions_total",
            &[("mode", "fallback"), ("reason", "session-cap-rejected")]
        ),
        1.0
    );
    let state = c.service().worker_views();
    assert_eq!(
        state.iter().find(|v| v.id.0 == d).unwrap().state.health,
        Health::Healthy
    );
}

#[tokio::test]
async fn list_workers_and_metrics_describe_every_worker() {
    let mut c = Cluster::start(|_| {}).await;
    c.publish(2, 46_000, 46_000);
    // Wait until the refresher has read the new publish.
    for _ in 0..200 {
        if c.service().worker_views()[2].state.used_tokens == 46_000 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let list = c
        .client
        .list_workers(pb::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<u32> = list.workers.iter().map(|w| w.id).collect();
    assert_eq!(ids, [0, 1, 2]);
    let roles: Vec<WorkerRole> = list
        .workers
        .iter()
        .map(|w| WorkerRole::from_proto(w.role).unwrap())
        .collect();
    assert_eq!(
        roles,
        [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Decode]
    );
    for w in &list.workers {
        let s = w.state.unwrap();
        assert_eq!(s.capacity_tokens, common::CAPACITY);
        assert_eq!(Health::from_proto(s.health).unwrap(), Health::Healthy);
        assert_eq!(w.source, "snapshot");
        assert_eq!(s.state_age_ms, 0);
    }
    assert_eq!(list.workers[0].name, "p0");
    assert_eq!(list.workers[2].state.unwrap().used_tokens, 46_000);

    let (head, _) = common::http_get(c.router.metrics_addr().unwrap(), "/metrics").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4")
    );
    let m = c.metrics().await;
    for id in ["0", "1", "2"] {
        let role = if id == "0" { "prefill" } else { "decode" };
        let name = if id == "0" {
            "p0".to_owned()
        } else {
            format!("d{id}")
        };
        let labels = [("worker", id), ("name", name.as_str()), ("role", role)];
        assert_eq!(
            value(&m, "kvc_router_worker_capacity_tokens", &labels),
            92_000.0
        );
        assert_eq!(
            value(&m, "kvc_router_worker_state_age_seconds", &labels),
            0.0
        );
        let mut with_health = labels.to_vec();
        with_health.push(("health", "healthy"));
        assert_eq!(value(&m, "kvc_router_worker_health", &with_health), 1.0);
    }
    assert_eq!(
        value(
            &m,
            "kvc_router_worker_used_fraction",
            &[("worker", "2"), ("name", "d2"), ("role", "decode")]
        ),
        0.5
    );
    let buckets: Vec<f64> = m
        .iter()
        .filter(|s| s.name == "kvc_router_decision_latency_seconds_bucket")
        .map(|s| s.value)
        .collect();
    assert_eq!(
        buckets.len(),
        kvc_router::metrics::LATENCY_BUCKETS_SECONDS.len() + 1
    );
}

#[tokio::test]
async fn stale_worker_leaves_rotation_and_returns() {
    let mut c = Cluster::start(|_| {}).await;
    // Worker 2 stops heartbeating; the others keep publishing.
    c.clock.advance(common::STALE_MS + 1);
    c.heartbeat(&[0, 1]);
    // Judged at use: stale at once, before any refresh.
    let list = c
        .client
        .list_workers(pb::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        Health::from_proto(list.workers[2].state.unwrap().health).unwrap(),
        Health::Stale
    );
    c.wait_health(&[0, 1], Health::Healthy).await;
    for i in 0..12u64 {
        let d = c
            .client
            .route(route_req(100 + i, Some(100 + i), Some(1), 600, &[i, i + 1]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(d.decode_worker, 1, "no decision names the stale worker");
        assert_ne!(d.prefill_worker, Some(2));
    }
    let m = c.metrics().await;
    assert_eq!(
        value(
            &m,
            "kvc_router_worker_health",
            &[
                ("worker", "2"),
                ("name", "d2"),
                ("role", "decode"),
                ("health", "stale")
            ]
        ),
        1.0
    );

    // It publishes again: back in rotation, and (having had no assignments) chosen again.
    c.heartbeat(&[2]);
    c.wait_health(&[2], Health::Healthy).await;
    let mut chosen = false;
    for i in 0..12u64 {
        let d = c
            .client
            .route(route_req(
                200 + i,
                Some(200 + i),
                Some(1),
                600,
                &[50 + i, 60 + i],
            ))
            .await
            .unwrap()
            .into_inner();
        chosen |= d.decode_worker == 2;
    }
    assert!(chosen, "the recovered worker is routed to again");
}

/// Every decode worker's state grown stale (its publisher late, not its engine gone): the
/// decision is made on the state last known rather than refused, and counted; a worker that
/// publishes again is routed as before. (A worker that is down is never routed: see the
/// HTTP front's tests of killed workers.)
#[tokio::test]
async fn no_fresh_decode_worker_routes_on_the_stale_state() {
    let mut c = Cluster::start(|_| {}).await;
    c.clock.advance(common::STALE_MS + 1);
    c.heartbeat(&[0]);
    c.wait_health(&[1, 2], Health::Stale).await;
    let d = c
        .client
        .route(route_req(1, Some(1), Some(1), 600, &[1, 2]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mode(&d), ExecutionMode::Turn1Seed);
    assert_eq!(d.prefill_worker, Some(0));
    assert!([1, 2].contains(&d.decode_worker), "{d:?}");
    let m = c.metrics().await;
    assert_eq!(value(&m, "kvc_router_stale_routed_total", &[]), 1.0);
    assert_eq!(
        value(
            &m,
            "kvc_router_route_errors_total",
            &[("code", "unavailable")]
        ),
        0.0
    );
    // Fresh again: routed without the fallback.
    c.heartbeat(&[0, 1, 2]);
    c.wait_health(&[1, 2], Health::Healthy).await;
    c.client
        .route(route_req(2, Some(2), Some(1), 600, &[3, 4]))
        .await
        .unwrap();
    let m = c.metrics().await;
    assert_eq!(value(&m, "kvc_router_stale_routed_total", &[]), 1.0);
}

#[tokio::test]
async fn caller_reported_reject_gets_a_prefill_path() {
    let mut c = Cluster::start(|_| {}).await;
    let d1 = seed_session(&mut c).await;
    let mut req = route_req(2, Some(7), Some(2), 1_900, &[11, 12, 14, 15]);
    req.rejected_by = Some(d1.decode_worker);
    let d2 = c.client.route(req).await.unwrap().into_inner();
    assert_eq!(mode(&d2), ExecutionMode::Fallback);
    assert_eq!(
        d2.fall_through_reason,
        Some(FallThroughReason::SessionCapRejected.to_proto())
    );
    assert_eq!(d2.prefill_worker, Some(0));
    assert_eq!(d2.probe_rejected_by, None, "no probe on a P->D path");
    let m = c.metrics().await;
    assert_eq!(
        value(&m, "kvc_router_probes_total", &[("result", "admit")]),
        0.0
    );
    assert_eq!(
        value(&m, "kvc_router_probes_total", &[("result", "reject")]),
        0.0
    );

    let mut bad = route_req(3, Some(7), Some(3), 1_900, &[11, 12, 14, 15]);
    bad.rejected_by = Some(77);
    let e = c.client.route(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("unknown worker 77"), "{}", e.message());
}

#[tokio::test]
async fn a_refused_direct_turn_reported_rejected_leaves_the_session_resident() {
    let mut c = Cluster::start(|_| {}).await;
    let d1 = seed_session(&mut c).await;
    let turn2 = route_req(2, Some(7), Some(2), 1_900, &[11, 12, 14, 15]);
    let d2 = c.client.route(turn2.clone()).await.unwrap().into_inner();
    assert_eq!(mode(&d2), ExecutionMode::DirectToD);
    // D's admission refused it: reported `rejected`, then routed again with `rejected_by`.
    c.client
        .report_outcome(pb::OutcomeReport {
            decision_id: d2.decision_id,
            request_id: 2,
            outcome: Outcome::Rejected.to_proto(),
            resident_tokens: 0,
        })
        .await
        .unwrap();
    assert_eq!(c.service().pending_decisions(), 0);
    // The refusal changed nothing on D: the session is still resident there, and the same
    // turn asked again (no `rejected_by`) still plans direct-to-D.
    let retry = c.client.route(turn2.clone()).await.unwrap().into_inner();
    assert_eq!(mode(&retry), ExecutionMode::DirectToD);
    assert_eq!(retry.decode_worker, d1.decode_worker);
    c.client
        .report_outcome(pb::OutcomeReport {
            decision_id: retry.decision_id,
            request_id: 2,
            outcome: Outcome::Rejected.to_proto(),
            resident_tokens: 0,
        })
        .await
        .unwrap();
    let again = pb::RouteRequest {
        rejected_by: Some(d1.decode_worker),
        ..turn2.clone()
    };
    let d3 = c.client.route(again).await.unwrap().into_inner();
    assert_eq!(mode(&d3), ExecutionMode::Fallback);
    assert_eq!(
        d3.fall_through_reason,
        Some(FallThroughReason::SessionCapRejected.to_proto())
    );
    // The session was still resident on its D, which keeps it (strict stickiness).
    assert_eq!(d3.decode_worker, d1.decode_worker);
    // A P→D decision reported `rejected` placed nothing: the session is not resident.
    c.client
        .report_outcome(pb::OutcomeReport {
            decision_id: d3.decision_id,
            request_id: 2,
            outcome: Outcome::Rejected.to_proto(),
            resident_tokens: 0,
        })
        .await
        .unwrap();
    let d4 = c
        .client
        .route(route_req(3, Some(7), Some(3), 2_500, &[11, 12, 14, 15, 16]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        d4.fall_through_reason,
        Some(FallThroughReason::SessionNotResident.to_proto())
    );
    assert_eq!(c.service().pending_decisions(), 1);
}

#[tokio::test]
async fn a_decode_worker_without_append_prefill_is_never_direct_over_grpc() {
    let mut c = Cluster::start(|cfg| {
        for w in &mut cfg.workers[1..=2] {
            w.append_prefill = Some(false);
        }
    })
    .await;
    let d1 = seed_session(&mut c).await;
    let d2 = c
        .client
        .route(route_req(2, Some(7), Some(2), 1_900, &[11, 12, 14, 15]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mode(&d2), ExecutionMode::Fallback);
    assert_eq!(
        d2.fall_through_reason,
        Some(FallThroughReason::DirectUnsupported.to_proto())
    );
    assert_eq!(d2.decode_worker, d1.decode_worker);
    assert_eq!(d2.prefill_worker, Some(0));
    // No probe: no direct-to-D decision was ever planned.
    let m = c.metrics().await;
    assert_eq!(
        value(&m, "kvc_router_probes_total", &[("result", "admit")]),
        0.0
    );
}

/// The first turns of sessions 1..=`n` (2,000 tokens each, outcomes never reported, so P's
/// queue of prefills grows), by mode.
async fn first_turn_modes(c: &mut Cluster, n: u64) -> Vec<ExecutionMode> {
    let mut modes = Vec::new();
    for s in 1..=n {
        let d = c
            .client
            .route(route_req(
                s,
                Some(500 + s),
                Some(1),
                2_000,
                &[s * 10, s * 10 + 1, s * 10 + 2],
            ))
            .await
            .unwrap()
            .into_inner();
        modes.push(mode(&d));
    }
    modes
}

#[tokio::test]
async fn workers_without_an_engine_never_get_a_local_turn() {
    // Snapshot-fed workers declaring no engine route as they always did: through P, however
    // much prefill work is queued there.
    let mut c = Cluster::start(|_| {}).await;
    let modes = first_turn_modes(&mut c, 24).await;
    assert!(
        modes.iter().all(|m| *m == ExecutionMode::Turn1Seed),
        "{modes:?}"
    );
    let m = c.metrics().await;
    assert_eq!(
        value(
            &m,
            "kvc_router_decisions_total",
            &[("mode", "local-prefill"), ("reason", "none")]
        ),
        0.0
    );
    // The same cluster with its decode workers declared able to serve alone: `kvc` keeps
    // turns local there.
    let mut c = Cluster::start(|cfg| {
        for w in cfg
            .workers
            .iter_mut()
            .filter(|w| w.role == WorkerRole::Decode)
        {
            w.serve_alone = Some(true);
        }
    })
    .await;
    let modes = first_turn_modes(&mut c, 24).await;
    assert!(modes.contains(&ExecutionMode::LocalPrefill), "{modes:?}");
}

#[tokio::test]
async fn decisions_keep_the_fleet_health_until_it_changes() {
    let mut c = Cluster::start(|_| {}).await;
    c.wait_health(&[0, 1, 2], Health::Healthy).await;
    let svc = c.service().clone();
    let route = |i: u64| route_req(500 + i, Some(500 + i), Some(1), 600, &[i, i + 1]);
    let first = c.client.route(route(0)).await.unwrap().into_inner();
    assert_eq!(mode(&first), ExecutionMode::Turn1Seed);
    let after_first = svc.fleet_health_passes();
    assert!(after_first >= 1);
    // Snapshots refreshed (every 5 ms) without a change of health: no pass over the fleet.
    for i in 1..=10 {
        c.client.route(route(i)).await.unwrap();
    }
    assert_eq!(svc.fleet_health_passes(), after_first);

    // The circuit breaker takes worker 1 out: the next decision works the health out again
    // and no decision names it.
    assert!(svc.set_http_down(kvc_core::WorkerId(1), true));
    for i in 11..=20 {
        let d = c.client.route(route(i)).await.unwrap().into_inner();
        assert_eq!(
            d.decode_worker, 2,
            "decision {i} named the worker taken out"
        );
    }
    assert_eq!(svc.fleet_health_passes(), after_first + 1);
    assert!(svc.set_http_down(kvc_core::WorkerId(1), false));

    // Worker 2's state grows stale with time alone (no write): judged at the first decision
    // past its deadline.
    c.clock.advance(common::STALE_MS + 1);
    c.heartbeat(&[0, 1]);
    c.wait_health(&[0, 1], Health::Healthy).await;
    for i in 21..=30 {
        let d = c.client.route(route(i)).await.unwrap().into_inner();
        assert_eq!(d.decode_worker, 1, "decision {i} named the stale worker");
    }
}
