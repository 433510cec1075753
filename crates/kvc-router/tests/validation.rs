//! Malformed requests get `INVALID_ARGUMENT` (or `NOT_FOUND` for an unknown decision), with a
//! message; nothing is counted as a decision and the router keeps serving.
#![forbid(unsafe_code)]

mod common;

use common::{Cluster, route_req, value};
use kvc_core::Outcome;
use kvc_proto::convert::ProtoEnum;
use kvc_proto::pb;

fn assert_invalid(r: Result<impl std::fmt::Debug, tonic::Status>, needle: &str) {
    let e = r.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains(needle),
        "`{}` lacks `{needle}`",
        e.message()
    );
}

#[tokio::test]
async fn malformed_requests_are_invalid_argument() {
    let mut c = Cluster::start(|_| {}).await;
    let cl = &mut c.client;

    // No hash ids for an input longer than one block.
    assert_invalid(
        cl.route(route_req(1, Some(1), Some(1), 5_000, &[])).await,
        "no hash_ids",
    );
    // More hash ids than ceil(1000 / 512) = 2.
    assert_invalid(
        cl.route(route_req(2, Some(1), Some(1), 1_000, &[1, 2, 3]))
            .await,
        "at most 2 blocks",
    );
    // Zero input, a turn without a session, turn 0.
    assert_invalid(
        cl.route(route_req(3, Some(1), Some(1), 0, &[])).await,
        "input_length",
    );
    assert_invalid(
        cl.route(route_req(4, None, Some(2), 100, &[1])).await,
        "without session_id",
    );
    assert_invalid(
        cl.route(route_req(5, Some(1), Some(0), 100, &[1])).await,
        "from 1",
    );
    // Oversized: 1,000 ids (about 9 KB) over the 4,096-byte limit; the length allows them.
    let ids: Vec<u64> = (0..1_000).map(|i| u64::MAX - i).collect();
    assert_invalid(
        cl.route(route_req(6, Some(1), Some(1), 512_000, &ids))
            .await,
        "exceeds the limit",
    );
    // Unknown workers.
    assert_invalid(
        cl.probe(pb::ProbeRequest {
            worker: 99,
            need_tokens: 1,
            session_id: None,
        })
        .await,
        "unknown worker 99",
    );
    assert_invalid(
        cl.commit_evict(pb::CommitEvictRequest {
            worker: 42,
            need_tokens: 1,
            session_id: None,
        })
        .await,
        "unknown worker 42",
    );
    // A bad outcome value, and a request id that does not match the decision.
    let d = cl
        .route(route_req(7, Some(1), Some(1), 600, &[1, 2]))
        .await
        .unwrap()
        .into_inner();
    assert_invalid(
        cl.report_outcome(pb::OutcomeReport {
            decision_id: d.decision_id,
            request_id: 7,
            outcome: 0,
            resident_tokens: 0,
        })
        .await,
        "outcome",
    );
    assert_invalid(
        cl.report_outcome(pb::OutcomeReport {
            decision_id: d.decision_id,
            request_id: 8,
            outcome: Outcome::Ok.to_proto(),
            resident_tokens: 0,
        })
        .await,
        "not 8",
    );
    let nf = cl
        .report_outcome(pb::OutcomeReport {
            decision_id: 123_456,
            request_id: 7,
            outcome: Outcome::Ok.to_proto(),
            resident_tokens: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(nf.code(), tonic::Code::NotFound);
    // CommitEvict to a worker with neither an address nor a queue.
    let fp = cl
        .commit_evict(pb::CommitEvictRequest {
            worker: 1,
            need_tokens: 1,
            session_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(fp.code(), tonic::Code::FailedPrecondition);

    // A short request without hash ids is fine; the router still serves.
    let ok = cl
        .route(route_req(9, None, None, 300, &[]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.prefill_worker, Some(0));

    let m = c.metrics().await;
    assert_eq!(
        value(
            &m,
            "kvc_router_route_errors_total",
            &[("code", "invalid_argument")]
        ),
        6.0
    );
    assert_eq!(
        value(&m, "kvc_router_decision_latency_seconds_count", &[]),
        2.0
    );
}

#[tokio::test]
async fn messages_over_the_transport_limit_are_refused_without_harm() {
    let mut c = Cluster::start(|_| {}).await;
    // 4 × 4,096 bytes is the transport limit: far above it the transport refuses the message.
    let ids: Vec<u64> = (0..20_000).map(|i| u64::MAX - i).collect();
    let e = c
        .client
        .route(route_req(1, Some(1), Some(1), 20_000 * 512, &ids))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted | tonic::Code::InvalidArgument
        ),
        "{e:?}"
    );
    let ok = c.client.ping(pb::PingRequest {}).await;
    assert!(ok.is_ok());
}
