//! The gRPC control API refuses what it cannot use with `INVALID_ARGUMENT`: bytes that are not a
//! message of the method's type, an `input_length` over `limits.max-input-tokens`, a
//! `ReportOutcome` claiming more resident tokens than the decode worker has. Arbitrary bytes and
//! arbitrary field values always get a gRPC status (never `INTERNAL` or `UNKNOWN`, which a
//! panicking handler would produce), and the router keeps serving.
#![forbid(unsafe_code)]

mod common;

use common::{CAPACITY, Cluster, route_req};
use kvc_core::Outcome;
use kvc_proto::convert::ProtoEnum;
use kvc_proto::pb;
use proptest::prelude::*;
use prost::Message as _;
use prost::bytes::Buf as _;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::{Code, Status};

/// A codec that sends and receives bytes as they are, to put any bytes on the wire.
#[derive(Debug, Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        prost::bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

/// The `kvc.v1.Router` methods taking a request message.
const METHODS: [&str; 6] = [
    "/kvc.v1.Router/Route",
    "/kvc.v1.Router/ReportOutcome",
    "/kvc.v1.Router/Probe",
    "/kvc.v1.Router/CommitEvict",
    "/kvc.v1.Router/ListWorkers",
    "/kvc.v1.Router/Ping",
];

/// Sends `bytes` as the request message of `method`; the answer's bytes or its status.
async fn call_raw(
    channel: &Channel,
    method: &'static str,
    bytes: Vec<u8>,
) -> Result<Vec<u8>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    grpc.unary(
        tonic::Request::new(bytes),
        PathAndQuery::from_static(method),
        Raw,
    )
    .await
    .map(tonic::Response::into_inner)
}

async fn channel(c: &Cluster) -> Channel {
    Channel::from_shared(format!("http://{}", c.router.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

#[tokio::test]
async fn malformed_protobuf_is_invalid_argument() {
    let c = Cluster::start(|_| {}).await;
    let ch = channel(&c).await;
    // A length-delimited field running past the end; a field with the reserved wire type 7;
    // a varint that never ends; a group end without a start.
    let malformed: [&[u8]; 4] = [
        &[0x32, 0x10, 0x01],
        &[0x0f],
        &[
            0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        ],
        &[0x0c],
    ];
    for method in &METHODS[..4] {
        for bytes in malformed {
            let e = call_raw(&ch, method, bytes.to_vec()).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{method} {bytes:?}: {e:?}");
            assert!(!e.message().is_empty(), "{method}: no message");
        }
    }
    // Well-formed bytes still reach the handler (an empty Ping is a Ping).
    assert_eq!(
        call_raw(&ch, METHODS[5], Vec::new()).await.unwrap(),
        Vec::<u8>::new()
    );
    // Nothing was counted as a routing decision.
    assert_eq!(c.service().metrics().decision_count(), 0);
}

#[tokio::test]
async fn input_length_is_bounded() {
    let mut c = Cluster::start(|_| {}).await;
    let e = c
        .client
        .route(route_req(1, Some(1), Some(1), u64::MAX, &[1, 2, 3]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("max-input-tokens"), "{}", e.message());
    let just_over = kvc_router::config::Limits::DEFAULT_MAX_INPUT_TOKENS + 1;
    let e = c
        .client
        .route(route_req(2, Some(1), Some(1), just_over, &[1, 2, 3]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // At the limit it is a request like any other.
    let at = kvc_router::config::Limits::DEFAULT_MAX_INPUT_TOKENS;
    c.client
        .route(route_req(3, Some(1), Some(1), at, &[1, 2, 3]))
        .await
        .unwrap();
    assert_eq!(c.service().session_count(), 1);
}

#[tokio::test]
async fn resident_tokens_above_capacity_are_invalid_argument() {
    let mut c = Cluster::start(|_| {}).await;
    let d = c
        .client
        .route(route_req(1, Some(5), Some(1), 600, &[1, 2]))
        .await
        .unwrap()
        .into_inner();
    let report = |resident_tokens| pb::OutcomeReport {
        decision_id: d.decision_id,
        request_id: 1,
        outcome: Outcome::Ok.to_proto(),
        resident_tokens,
    };
    for too_many in [u64::MAX, CAPACITY + 1] {
        let e = c.client.report_outcome(report(too_many)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("capacity"), "{}", e.message());
    }
    // Refused reports leave the decision pending and the session's residency untouched.
    assert_eq!(c.service().pending_decisions(), 1);
    c.client.report_outcome(report(CAPACITY)).await.unwrap();
    assert_eq!(c.service().pending_decisions(), 0);
}

/// Codes an arbitrary request may get; anything else (`INTERNAL`, `UNKNOWN`, `CANCELLED`)
/// would mean the router failed, or a handler panicked.
const ACCEPTABLE: [Code; 7] = [
    Code::Ok,
    Code::InvalidArgument,
    Code::NotFound,
    Code::FailedPrecondition,
    Code::Unavailable,
    Code::OutOfRange,
    Code::DeadlineExceeded,
];

fn acceptable<T: std::fmt::Debug>(what: &str, r: &Result<T, Status>) -> Result<(), TestCaseError> {
    let code = r.as_ref().err().map_or(Code::Ok, Status::code);
    prop_assert!(ACCEPTABLE.contains(&code), "{what}: {r:?}");
    Ok(())
}

/// A message of `method`'s type with arbitrary field values, encoded.
fn typed_message() -> impl Strategy<Value = (usize, Vec<u8>)> {
    let worker = prop_oneof![0u32..4, any::<u32>()];
    let route = (
        any::<u64>(),
        proptest::option::of(0u64..8),
        proptest::option::of(any::<u32>()),
        prop_oneof![1u64..5_000, any::<u64>()],
        any::<u64>(),
        proptest::collection::vec(any::<u64>(), 0..12),
        proptest::option::of(worker.clone()),
    )
        .prop_map(
            |(
                request_id,
                session_id,
                turn_id,
                input_length,
                output_hint,
                hash_ids,
                rejected_by,
            )| {
                (
                    0,
                    pb::RouteRequest {
                        request_id,
                        session_id,
                        turn_id,
                        input_length,
                        output_hint,
                        hash_ids,
                        rejected_by,
                        parent_session_id: None,
                    }
                    .encode_to_vec(),
                )
            },
        );
    let outcome = (
        0u64..64,
        any::<u64>(),
        -2i32..9,
        prop_oneof![0u64..200_000, any::<u64>()],
    )
        .prop_map(|(decision_id, request_id, outcome, resident_tokens)| {
            (
                1,
                pb::OutcomeReport {
                    decision_id,
                    request_id,
                    outcome,
                    resident_tokens,
                }
                .encode_to_vec(),
            )
        });
    let probe = (
        worker.clone(),
        any::<u64>(),
        proptest::option::of(any::<u64>()),
    )
        .prop_map(|(worker, need_tokens, session_id)| {
            (
                2,
                pb::ProbeRequest {
                    worker,
                    need_tokens,
                    session_id,
                }
                .encode_to_vec(),
            )
        });
    let commit = (worker, any::<u64>(), proptest::option::of(any::<u64>())).prop_map(
        |(worker, need_tokens, session_id)| {
            (
                3,
                pb::CommitEvictRequest {
                    worker,
                    need_tokens,
                    session_id,
                }
                .encode_to_vec(),
            )
        },
    );
    prop_oneof![route, outcome, probe, commit]
}

/// Arbitrary bytes, or a typed message with one byte changed, for any method.
fn any_bytes() -> impl Strategy<Value = (usize, Vec<u8>)> {
    prop_oneof![
        (
            0..METHODS.len(),
            proptest::collection::vec(any::<u8>(), 0..48)
        ),
        (typed_message(), any::<prop::sample::Index>(), any::<u8>()).prop_map(
            |((method, mut bytes), at, value)| {
                if !bytes.is_empty() {
                    let i = at.index(bytes.len());
                    bytes[i] = value;
                }
                (method, bytes)
            }
        ),
    ]
}

#[test]
fn arbitrary_requests_always_get_a_status() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let c = rt.block_on(Cluster::start(|_| {}));
    let ch = rt.block_on(channel(&c));
    // A runner counts its cases across runs: one runner per strategy.
    let runner = || {
        proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 400,
            failure_persistence: None,
            ..ProptestConfig::default()
        })
    };
    runner()
        .run(&typed_message(), |(method, bytes)| {
            let r = rt.block_on(call_raw(&ch, METHODS[method], bytes));
            acceptable(METHODS[method], &r)
        })
        .unwrap();
    runner()
        .run(&any_bytes(), |(method, bytes)| {
            let r = rt.block_on(call_raw(&ch, METHODS[method], bytes.clone()));
            acceptable(&format!("{} {bytes:?}", METHODS[method]), &r)
        })
        .unwrap();
    // Still serving, with its tables within bounds.
    rt.block_on(call_raw(&ch, METHODS[5], Vec::new())).unwrap();
    assert!(c.service().session_count() <= 8);
}
