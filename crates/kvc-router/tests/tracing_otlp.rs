//! OpenTelemetry traces end to end: a router whose configuration has a `[tracing]` table
//! exports, over OTLP/gRPC to an in-process collector on loopback, one span per request (the
//! child of the client's `traceparent`, with the decision's attributes) and one per worker
//! call (children of the request's), and each worker gets its call span's context as its
//! `traceparent`. Sampling follows the client's flag; without the table nothing is traced and
//! the client's context reaches the workers as it came.

mod common;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use common::front::{self, Front, Recording, answer_body, ids, json_response, worker_routes};
use kvc_router::http::HttpOptions;
use kvc_router::{RouterConfig, TracingConfig};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use parking_lot::Mutex;
use serde_json::json;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The client's trace context (sampled) and its parent span id.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

// ---- The collector ----------------------------------------------------------------------

/// Every span exported to the collector, with its resource's `service.name`.
#[derive(Default)]
struct Collected {
    spans: Mutex<Vec<(String, Span)>>,
    exports: std::sync::atomic::AtomicUsize,
}

struct Sink(Arc<Collected>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0
            .exports
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut spans = self.0.spans.lock();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| text(&r.attributes, "service.name"))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push((service.clone(), span));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// An OTLP/gRPC collector on a loopback port: its address and what it received.
async fn collector() -> (SocketAddr, Arc<Collected>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let collected = Arc::new(Collected::default());
    let sink = Sink(collected.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(sink))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    (addr, collected)
}

impl Collected {
    /// Waits (at most 20 s) until the spans of trace `trace` (hex) satisfy `done`; they.
    async fn wait_for(&self, trace: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let spans = self.trace(trace);
            if done(&spans) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "trace {trace} never complete: {spans:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The spans received of trace `trace` (hex).
    fn trace(&self, trace: &str) -> Vec<Span> {
        self.spans
            .lock()
            .iter()
            .filter(|(_, s)| hex(&s.trace_id) == trace)
            .map(|(_, s)| s.clone())
            .collect()
    }

    fn service_names(&self) -> Vec<String> {
        self.spans.lock().iter().map(|(n, _)| n.clone()).collect()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a AnyValue> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn text(attributes: &[KeyValue], key: &str) -> Option<String> {
    match attribute(attributes, key)? {
        AnyValue::StringValue(s) => Some(s.clone()),
        other => panic!("{key} is not a string: {other:?}"),
    }
}

fn int(attributes: &[KeyValue], key: &str) -> Option<i64> {
    match attribute(attributes, key)? {
        AnyValue::IntValue(i) => Some(*i),
        other => panic!("{key} is not an integer: {other:?}"),
    }
}

fn named<'a>(spans: &'a [Span], name: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.name == name).collect()
}

// ---- The workers ------------------------------------------------------------------------

/// A worker that answers every request at once and records its path and headers.
struct HeaderMock {
    name: String,
    received: Mutex<Vec<(String, HashMap<String, String>)>>,
}

impl Recording for HeaderMock {
    type Request = (String, HashMap<String, String>);

    fn requests(&self) -> &Mutex<Vec<Self::Request>> {
        &self.received
    }
}

async fn handler(
    State(m): State<Arc<HeaderMock>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    _body: Bytes,
) -> Response {
    let headers = headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    m.received.lock().push((uri.path().to_owned(), headers));
    json_response(StatusCode::OK, &answer_body(&m.name, uri.path(), 8))
}

async fn spawn_mock(name: &str) -> (Arc<HeaderMock>, SocketAddr) {
    let mock = Arc::new(HeaderMock {
        name: name.to_owned(),
        received: Mutex::new(Vec::new()),
    });
    let addr = front::serve(worker_routes(handler).with_state(mock.clone())).await;
    (mock, addr)
}

/// The front over P0, D1 and D2 (SGLang mocks recording headers), traced as `tracing` says
/// (`None`: no `[tracing]` table).
async fn start(tracing: Option<TracingConfig>) -> Front<HeaderMock> {
    let options = HttpOptions {
        request_timeout: Duration::from_secs(10),
        health_check_interval: None,
        ..HttpOptions::default()
    };
    Front::start_traced(
        |cfg: &mut RouterConfig| cfg.tracing = tracing,
        spawn_mock,
        |id, _| (id == 0).then_some(8_998),
        |_| {},
        options,
        true,
    )
    .await
}

fn tracing_to(collector: SocketAddr, sample_ratio: f64) -> TracingConfig {
    TracingConfig {
        otlp_endpoint: format!("http://{collector}"),
        service_name: "kvc-router-under-test".to_owned(),
        sample_ratio,
        export_interval_ms: 50,
        ..TracingConfig::default()
    }
}

/// The `traceparent` fields: (trace id, parent id, flags).
fn traceparent_of(headers: &HashMap<String, String>) -> (String, String, String) {
    let tp = headers.get("traceparent").expect("a traceparent");
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(parts[0], "00", "{tp}");
    (
        parts[1].to_owned(),
        parts[2].to_owned(),
        parts[3].to_owned(),
    )
}

fn generate_body(from: u32) -> serde_json::Value {
    json!({"input_ids": ids(from..from + 1_300), "sampling_params": {"max_new_tokens": 8}})
}

// ---- The tests --------------------------------------------------------------------------

#[tokio::test]
async fn a_request_span_joins_the_clients_trace_with_the_decision_and_its_worker_calls_nest() {
    let (addr, collected) = collector().await;
    // Ratio 0: only the client's sampled flag can make this trace sampled.
    let f = start(Some(tracing_to(addr, 0.0))).await;
    let parent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-01");
    let headers = [
        ("x-session-id", "traced"),
        ("traceparent", parent.as_str()),
        ("tracestate", "vendor=abc"),
    ];
    let r = f.post("/generate", &headers, &generate_body(0)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    let decode: u32 = r.header("x-kvc-decode-worker").parse().unwrap();
    assert_eq!(r.header("x-kvc-prefill-worker"), "0");

    let spans = collected
        .wait_for(TRACE_ID, |s| {
            named(s, "kvc.request").len() == 1 && named(s, "kvc.worker_call").len() == 2
        })
        .await;
    // The request span: the client's span's child, a server span, with the decision.
    let request = named(&spans, "kvc.request")[0];
    assert_eq!(hex(&request.parent_span_id), CLIENT_SPAN);
    assert_eq!(request.kind, SpanKind::Server as i32);
    let a = &request.attributes;
    assert_eq!(text(a, "url.path").as_deref(), Some("/generate"));
    assert_eq!(text(a, "kvc.session.key").as_deref(), Some("traced"));
    assert_eq!(int(a, "kvc.turn"), Some(1));
    assert!(text(a, "kvc.session.id").is_some());
    assert_eq!(text(a, "kvc.mode").as_deref(), Some("turn1-seed"));
    assert_eq!(text(a, "kvc.reason"), None);
    assert_eq!(text(a, "kvc.prefill_worker").as_deref(), Some("p0"));
    assert_eq!(
        text(a, "kvc.decode_worker"),
        Some(format!("d{decode}")),
        "the worker the answer names"
    );
    assert_eq!(int(a, "kvc.attempts"), Some(1));
    assert!(int(a, "kvc.decision.id").is_some());
    assert!(int(a, "kvc.need_tokens").is_some_and(|n| n >= 1_300));
    assert!(int(a, "kvc.cached_tokens").is_some());
    assert!(int(a, "kvc.predicted_prefill_us").is_some());
    assert_eq!(text(a, "kvc.outcome").as_deref(), Some("ok"));
    assert_eq!(int(a, "http.response.status_code"), Some(200));
    // The client's tracestate is the trace's.
    assert_eq!(request.trace_state, "vendor=abc");

    // One call span per worker, each the request span's child.
    let calls = named(&spans, "kvc.worker_call");
    let mut legs: Vec<(String, String)> = calls
        .iter()
        .map(|c| {
            assert_eq!(c.parent_span_id, request.span_id);
            assert_eq!(c.kind, SpanKind::Client as i32);
            assert_eq!(int(&c.attributes, "kvc.attempt"), Some(1));
            assert_eq!(int(&c.attributes, "http.response.status_code"), Some(200));
            assert_eq!(text(&c.attributes, "error.type"), None);
            assert_eq!(
                text(&c.attributes, "url.path").as_deref(),
                Some("/generate")
            );
            (
                text(&c.attributes, "kvc.leg").unwrap(),
                text(&c.attributes, "kvc.worker").unwrap(),
            )
        })
        .collect();
    legs.sort();
    assert_eq!(
        legs,
        [
            ("decode".to_owned(), format!("d{decode}")),
            ("prefill".to_owned(), "p0".to_owned())
        ]
    );
    assert!(
        collected
            .service_names()
            .iter()
            .all(|n| n == "kvc-router-under-test")
    );

    // Each worker got its own call span's context: the same trace, its call span as parent.
    for worker in [0, decode] {
        let received = f.received(worker);
        assert_eq!(received.len(), 1, "worker {worker}: {received:?}");
        let (trace, parent, flags) = traceparent_of(&received[0].1);
        assert_eq!(trace, TRACE_ID, "worker {worker}");
        assert_eq!(flags, "01", "worker {worker}");
        let leg = if worker == 0 { "prefill" } else { "decode" };
        let call = calls
            .iter()
            .find(|c| text(&c.attributes, "kvc.leg").as_deref() == Some(leg))
            .unwrap();
        assert_eq!(parent, hex(&call.span_id), "worker {worker}");
        assert_ne!(parent, CLIENT_SPAN);
        assert_eq!(
            received[0].1.get("tracestate").map(String::as_str),
            Some("vendor=abc")
        );
    }

    // At ratio 0 a request without a trace context starts none: no span, nothing to pass on.
    let r = f
        .post(
            "/generate",
            &[("x-session-id", "root")],
            &generate_body(50_000),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let decode: u32 = r.header("x-kvc-decode-worker").parse().unwrap();
    for worker in [0, decode] {
        let last = f.received(worker).last().unwrap().1.clone();
        assert!(
            !last.contains_key("traceparent"),
            "worker {worker}: {last:?}"
        );
    }
}

#[tokio::test]
async fn a_streamed_request_s_span_ends_with_its_stream() {
    let (addr, collected) = collector().await;
    let f = start(Some(tracing_to(addr, 1.0))).await;
    let parent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-01");
    let headers = [
        ("x-session-id", "streamed"),
        ("traceparent", parent.as_str()),
    ];
    let mut body = generate_body(0);
    body["stream"] = json!(true);
    let r = f.post("/generate", &headers, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let spans = collected
        .wait_for(TRACE_ID, |s| {
            named(s, "kvc.request").len() == 1 && named(s, "kvc.worker_call").len() == 2
        })
        .await;
    let request = named(&spans, "kvc.request")[0];
    // Reported once the stream had ended, and the span ended after that.
    assert_eq!(
        text(&request.attributes, "kvc.outcome").as_deref(),
        Some("ok")
    );
    let decode = named(&spans, "kvc.worker_call")
        .into_iter()
        .find(|c| text(&c.attributes, "kvc.leg").as_deref() == Some("decode"))
        .unwrap();
    assert_eq!(
        int(&decode.attributes, "http.response.status_code"),
        Some(200)
    );
    assert!(request.end_time_unix_nano >= decode.end_time_unix_nano);
    assert!(decode.start_time_unix_nano >= request.start_time_unix_nano);
}

#[tokio::test]
async fn an_unsampled_client_trace_gets_no_span_and_reaches_the_workers_unchanged() {
    let (addr, collected) = collector().await;
    // Ratio 1: every trace the router starts is sampled, but the client's flag decides its own.
    let f = start(Some(tracing_to(addr, 1.0))).await;
    const UNSAMPLED: &str = "0af7651916cd43dd8448eb211c80319c";
    let parent = format!("00-{UNSAMPLED}-b7ad6b7169203331-00");
    let headers = [
        ("x-session-id", "unsampled"),
        ("traceparent", parent.as_str()),
    ];
    let r = f.post("/generate", &headers, &generate_body(0)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let unsampled_calls: Vec<_> = f
        .received(0)
        .into_iter()
        .chain(f.received(1))
        .chain(f.received(2))
        .collect();
    assert_eq!(unsampled_calls.len(), 2, "{unsampled_calls:?}");
    // No span of the router's: the client's context goes on as it came.
    for (_, h) in &unsampled_calls {
        assert_eq!(h.get("traceparent"), Some(&parent));
    }

    // A request without a trace context starts a trace of the router's, sampled.
    let r = f
        .post(
            "/generate",
            &[("x-session-id", "rooted")],
            &generate_body(50_000),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let decode: u32 = r.header("x-kvc-decode-worker").parse().unwrap();
    let rooted = f.received(decode).last().unwrap().1.clone();
    let (trace, _, flags) = traceparent_of(&rooted);
    assert_eq!(flags, "01");
    let spans = collected
        .wait_for(&trace, |s| {
            named(s, "kvc.request").len() == 1 && named(s, "kvc.worker_call").len() == 2
        })
        .await;
    let request = named(&spans, "kvc.request")[0];
    assert!(request.parent_span_id.is_empty(), "a root span");
    assert_eq!(
        text(&request.attributes, "kvc.session.key").as_deref(),
        Some("rooted")
    );
    // The rooted trace was exported after the unsampled request ended: nothing of that one
    // was (spans leave in the order they end).
    assert!(collected.trace(UNSAMPLED).is_empty());
    assert_eq!(collected.spans.lock().len(), 3);
}

#[tokio::test]
async fn without_a_tracing_table_nothing_is_exported_and_the_clients_context_is_forwarded() {
    let (_addr, collected) = collector().await;
    let f = start(None).await;
    let parent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-01");
    let headers = [
        ("x-session-id", "untraced"),
        ("traceparent", parent.as_str()),
        ("tracestate", "vendor=abc"),
    ];
    let r = f.post("/generate", &headers, &generate_body(0)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let all: Vec<_> = f
        .received(0)
        .into_iter()
        .chain(f.received(1))
        .chain(f.received(2))
        .collect();
    assert_eq!(all.len(), 2);
    for (_, h) in &all {
        assert_eq!(h.get("traceparent"), Some(&parent));
        assert_eq!(h.get("tracestate").map(String::as_str), Some("vendor=abc"));
    }
    assert!(
        !kvc_router::telemetry::Telemetry::from_config(f.cluster.service().config())
            .unwrap()
            .is_on()
    );
    // Well past the export interval a traced router would use: still nothing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        collected.exports.load(std::sync::atomic::Ordering::SeqCst),
        0
    );
}

#[tokio::test]
async fn a_grpc_route_call_is_a_span_of_the_callers_trace_with_its_decision() {
    let (addr, collected) = collector().await;
    let mut c = common::Cluster::start(|cfg| cfg.tracing = Some(tracing_to(addr, 0.0))).await;
    c.wait_health(&[0, 1, 2], kvc_core::Health::Healthy).await;
    let mut request = tonic::Request::new(common::route_req(7, Some(42), Some(1), 1_300, &[1, 2]));
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-{CLIENT_SPAN}-01").parse().unwrap(),
    );
    let d = c.client.route(request).await.unwrap().into_inner();
    let spans = collected
        .wait_for(TRACE_ID, |s| named(s, "kvc.v1.Router/Route").len() == 1)
        .await;
    let span = named(&spans, "kvc.v1.Router/Route")[0];
    assert_eq!(hex(&span.parent_span_id), CLIENT_SPAN);
    let a = &span.attributes;
    assert_eq!(text(a, "kvc.mode").as_deref(), Some("turn1-seed"));
    assert_eq!(int(a, "kvc.decision.id"), Some(d.decision_id as i64));
    assert_eq!(
        text(a, "kvc.decode_worker"),
        Some(format!("d{}", d.decode_worker))
    );
    assert_eq!(text(a, "kvc.session.id").as_deref(), Some("42"));
    assert_eq!(int(a, "kvc.turn"), Some(1));
    assert_eq!(int(a, "rpc.grpc.status_code"), Some(0));

    // A refused call: its span says why, with the gRPC code.
    let mut bad = tonic::Request::new(common::route_req(8, None, Some(1), 1_300, &[1, 2]));
    bad.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-{CLIENT_SPAN}-01").parse().unwrap(),
    );
    let e = c.client.route(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let spans = collected
        .wait_for(TRACE_ID, |s| named(s, "kvc.v1.Router/Route").len() == 2)
        .await;
    let refused = named(&spans, "kvc.v1.Router/Route")
        .into_iter()
        .find(|s| int(&s.attributes, "rpc.grpc.status_code") != Some(0))
        .unwrap();
    assert_eq!(
        int(&refused.attributes, "rpc.grpc.status_code"),
        Some(tonic::Code::InvalidArgument as i64)
    );
    assert_eq!(text(&refused.attributes, "kvc.mode"), None);
    let status = refused.status.as_ref().unwrap();
    assert!(status.message.contains("turn_id"), "{status:?}");
}

#[test]
fn a_bad_tracing_table_is_refused_naming_the_key() {
    let parse = |table: &str| {
        RouterConfig::from_toml_str(&format!("[tracing]\n{table}"))
            .and_then(|c| c.validate().map(|()| c))
    };
    let ok = parse("otlp-endpoint = \"http://127.0.0.1:4317\"").unwrap();
    let t = ok.tracing.unwrap();
    assert_eq!(t.service_name, "kvc-router");
    assert_eq!(t.sample_ratio, 1.0);
    assert_eq!(RouterConfig::from_toml_str("").unwrap().tracing, None);
    for (table, key) in [
        ("sample-ratio = 0.5", "tracing.otlp-endpoint"),
        (
            "otlp-endpoint = \"127.0.0.1:4317\"",
            "tracing.otlp-endpoint",
        ),
        (
            "otlp-endpoint = \"https://collector:4317\"",
            "tracing.otlp-endpoint",
        ),
        (
            "otlp-endpoint = \"http://c:4317\"\nsample-ratio = 1.5",
            "tracing.sample-ratio",
        ),
        (
            "otlp-endpoint = \"http://c:4317\"\nsample-ratio = -0.1",
            "tracing.sample-ratio",
        ),
        (
            "otlp-endpoint = \"http://c:4317\"\nservice-name = \" \"",
            "tracing.service-name",
        ),
        (
            "otlp-endpoint = \"http://c:4317\"\nexport-interval-ms = 0",
            "tracing.export-interval-ms",
        ),
        (
            "otlp-endpoint = \"http://c:4317\"\nmax-queued-spans = 0",
            "tracing.max-queued-spans",
        ),
        ("otlp-endpoint = \"http://c:4317\"\nsample = 1", "sample"),
    ] {
        let e = parse(table).unwrap_err().to_string();
        assert!(e.contains(key), "{table:?}: {e}");
    }
}
