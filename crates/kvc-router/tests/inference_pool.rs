//! A Kubernetes InferencePool's pods as the fleet: a router with an `[inference-pool]` table
//! and no `[[workers]]` reads the pool and its pods from a Kubernetes API (here a mock one,
//! over TLS checked against its CA, with the service account's bearer token), adds each
//! ready pod as a vLLM worker known by its pod IP, drains a pod that is not ready, removes
//! one that is gone, and leaves the fleet as it is while the API fails. The pods' engines
//! are mock vLLMs on loopback addresses of their own (127.0.0.2, .3, …), on the one port the
//! pool names.

mod common;

use axum::routing::get;
use common::{Cluster, TempDir, route_req};
use http_body_util::Full;
use hyper::body::Bytes;
use kvc_core::{Health, WorkerRole};
use kvc_router::InferencePoolConfig;
use kvc_router::tls::ListenerTls;
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const TOKEN: &str = "sa-token-5d1e";
const POOL_PATH: &str =
    "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/vllm-pd";
const PODS_PATH: &str = "/api/v1/namespaces/llm/pods?labelSelector=app%3Dvllm";

/// What the mock API answers, and what it was asked.
#[derive(Default)]
struct ApiState {
    pods: Vec<Value>,
    /// Answer every call with this status instead.
    fail: Option<u16>,
    /// Calls answered 200.
    served: u64,
    /// Calls answered with `fail`.
    failed: u64,
    /// Calls refused for their token.
    refused: u64,
}

type Api = Arc<Mutex<ApiState>>;

fn pod(name: &str, ip: &str, ready: bool, role: &str) -> Value {
    json!({
        "metadata": {"name": name, "labels": {"app": "vllm", "llm-d.ai/role": role}},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        },
    })
}

fn answer(api: &Api, req: &hyper::Request<hyper::body::Incoming>, port: u16) -> (u16, String) {
    let mut st = api.lock();
    let auth = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if auth != Some(&format!("Bearer {TOKEN}")) {
        st.refused += 1;
        return (401, r#"{"kind":"Status","reason":"Unauthorized"}"#.into());
    }
    if let Some(status) = st.fail {
        st.failed += 1;
        return (
            status,
            r#"{"kind":"Status","message":"etcd is down"}"#.into(),
        );
    }
    let path = req.uri().path_and_query().map_or("", |p| p.as_str());
    let body = match path {
        POOL_PATH => json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "vllm-pd", "namespace": "llm"},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm"}},
                "targetPorts": [{"number": port}],
                "endpointPickerRef": {"name": "kvc-router-epp", "port": {"number": 9002}},
            },
        }),
        PODS_PATH => json!({"kind": "PodList", "items": st.pods.clone()}),
        _ => return (404, format!("no {path}")),
    };
    st.served += 1;
    (200, body.to_string())
}

/// The mock Kubernetes API over TLS (its certificate signed by the CA written to `ca.pem`),
/// the token written to `token`.
async fn mock_api(dir: &TempDir, engine_port: u16) -> (SocketAddr, Api) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    write("ca.pem", &ca.pem());
    write("token", &format!("{TOKEN}\n"));
    let tls = kvc_router::tls::http_server_config(&ListenerTls {
        cert: write("api.pem", &cert.pem()),
        key: write("api.key", &key.serialize_pem()),
        client_ca: None,
    })
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let api: Api = Arc::default();
    let shared = Arc::clone(&api);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, api) = (acceptor.clone(), Arc::clone(&shared));
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |req| {
                    let (status, body) = answer(&api, &req, engine_port);
                    async move {
                        hyper::Response::builder()
                            .status(status)
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from(body)))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    (addr, api)
}

const METRICS: &str = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n\
     vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0\n\
     vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0\n\
     vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"5750\"} 1.0\n";

/// Mock vLLM engines on 127.0.0.2, 127.0.0.3, … (`n` of them), all on one port as a pool's
/// pods are; returns the port.
async fn engines(n: u8) -> u16 {
    'again: for _ in 0..20 {
        let first = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
        let port = first.local_addr().unwrap().port();
        let mut listeners = vec![first];
        for i in 1..n {
            match tokio::net::TcpListener::bind((format!("127.0.0.{}", 2 + i), port)).await {
                Ok(l) => listeners.push(l),
                Err(_) => continue 'again,
            }
        }
        for l in listeners {
            let app = axum::Router::new()
                .route("/metrics", get(|| async { METRICS }))
                .route("/kv_event_sources", get(|| async { "{}" }))
                .route(
                    "/v1/models",
                    get(|| async { r#"{"object":"list","data":[{"id":"m","object":"model"}]}"# }),
                );
            tokio::spawn(async move { axum::serve(l, app).await });
        }
        return port;
    }
    panic!("no port free on 127.0.0.2 to 127.0.0.{}", 1 + n);
}

/// The fleet as (name, role, drained), sorted by name.
fn fleet(c: &Cluster) -> Vec<(String, WorkerRole, bool)> {
    let mut out: Vec<_> = c
        .service()
        .list_workers()
        .into_iter()
        .map(|w| (w.name, w.role, w.drained))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Waits (at most [`common::WAIT`]) until the fleet is `expected`.
async fn wait_fleet(c: &Cluster, expected: &[(&str, WorkerRole, bool)]) {
    let expected: Vec<(String, WorkerRole, bool)> = expected
        .iter()
        .map(|&(n, r, d)| (n.to_owned(), r, d))
        .collect();
    let deadline = std::time::Instant::now() + common::WAIT;
    loop {
        let now = fleet(c);
        if now == expected {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the fleet is not {expected:?} within {:?}: {now:?}",
            common::WAIT
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pools_ready_pods_are_the_fleet_as_they_come_and_go() {
    use WorkerRole::{Decode, Prefill};
    let dir = TempDir::new("pool");
    let port = engines(3).await;
    let (api_addr, api) = mock_api(&dir, port).await;
    api.lock().pods = vec![
        pod("vllm-p-0", "127.0.0.2", true, "prefill"),
        pod("vllm-d-0", "127.0.0.3", true, "decode"),
        // Still loading its model.
        pod("vllm-d-1", "127.0.0.4", false, "both"),
        // A pod whose label names no role the router knows.
        pod("vllm-x-0", "127.0.0.9", true, "sidecar"),
    ];
    let pool = InferencePoolConfig {
        name: "vllm-pd".into(),
        namespace: Some("llm".into()),
        api_url: Some(format!("https://{api_addr}")),
        token_file: Some(dir.0.join("token")),
        ca_file: Some(dir.0.join("ca.pem")),
        poll_ms: 50,
        // No call is cut off (and left to reach the API later): each is answered before
        // the next starts.
        timeout_ms: 30_000,
        ..InferencePoolConfig::default()
    };
    let mut c = Cluster::start(move |cfg| {
        cfg.engine_signals.scrape_interval_ms = 20;
        cfg.workers.clear();
        cfg.inference_pool = Some(pool);
    })
    .await;

    // The ready pods join, decode first (id 1024), each known by its pod IP and the pool's port.
    wait_fleet(
        &c,
        &[("vllm-d-0", Decode, false), ("vllm-p-0", Prefill, false)],
    )
    .await;
    let listed = c.service().list_workers();
    let id_of = |name: &str| listed.iter().find(|w| w.name == name).unwrap().id.0;
    assert_eq!((id_of("vllm-d-0"), id_of("vllm-p-0")), (1024, 1025));
    // Their engines are read as any vLLM worker's: the pool size from /metrics.
    c.wait_health(&[1024, 1025], Health::Healthy).await;
    let listed = c.service().list_workers();
    let d0 = listed.iter().find(|w| w.name == "vllm-d-0").unwrap();
    assert_eq!(d0.state.capacity_tokens, 5_750 * 16);
    // A new session goes to the one decode pod.
    let first = c
        .client
        .route(route_req(1, Some(70), Some(1), 1_200, &[1, 2, 3]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.decode_worker, 1024, "{first:?}");

    // /metrics says what the last read found: four pods, three ready, one left out for its
    // role label, two workers; no read failed.
    let pool_gauge = |m: &[common::Sample], kind: &str| {
        common::value(m, "kvc_router_inference_pool", &[("kind", kind)])
    };
    let m = c.metrics().await;
    for (kind, v) in [
        ("pods", 4.0),
        ("ready", 3.0),
        ("unknown-role", 1.0),
        ("workers", 2.0),
        ("read-failures", 0.0),
        ("failing", 0.0),
    ] {
        assert_eq!(pool_gauge(&m, kind), v, "{kind}");
    }
    assert!(pool_gauge(&m, "reads") >= 1.0);

    // A re-read of the file (no [[workers]]) leaves the pool's workers alone.
    let report = c.service().reload(&c.service().config().clone());
    assert_eq!(report, kvc_router::Reload::default());

    // d-1 becomes ready and joins (1026); d-0 stops being ready: drained, its session moves.
    {
        let mut st = api.lock();
        st.pods[2] = pod("vllm-d-1", "127.0.0.4", true, "both");
        st.pods[1] = pod("vllm-d-0", "127.0.0.3", false, "decode");
    }
    wait_fleet(
        &c,
        &[
            ("vllm-d-0", Decode, true),
            ("vllm-d-1", Decode, false),
            ("vllm-p-0", Prefill, false),
        ],
    )
    .await;
    c.wait_health(&[1026], Health::Healthy).await;
    let second = c
        .client
        .route(route_req(2, Some(70), Some(2), 1_600, &[1, 2, 3, 4]))
        .await
        .unwrap()
        .into_inner();
    // The session moves off the drained pod (to d-1, or served alone by p-0).
    assert!([1025, 1026].contains(&second.decode_worker), "{second:?}");

    // d-0's pod is deleted: its worker leaves, and its id is free for the next pod.
    api.lock().pods.remove(1);
    wait_fleet(
        &c,
        &[("vllm-d-1", Decode, false), ("vllm-p-0", Prefill, false)],
    )
    .await;

    // The API fails (500, then a token it refuses): the fleet stays as it is, and the pods
    // that change meanwhile are taken once it answers again (the token is re-read).
    api.lock().fail = Some(500);
    let served = api.lock().served;
    common::wait_until("a call answered 500", || api.lock().failed >= 1).await;
    api.lock()
        .pods
        .push(pod("vllm-d-2", "127.0.0.3", true, "decode"));
    std::fs::write(dir.0.join("token"), "expired").unwrap();
    // A call that read the old token before the write meets the failing API: it stays
    // failing until a call has carried the new token (the calls go one after another).
    common::wait_until("a call with the new token refused", || {
        api.lock().refused >= 1
    })
    .await;
    api.lock().fail = None;
    common::wait_until("the token re-read again", || api.lock().refused >= 2).await;
    // (Read failures counted, the last read failing, the workers unchanged.)
    let m = c.metrics().await;
    assert!(pool_gauge(&m, "read-failures") >= 2.0);
    assert_eq!(pool_gauge(&m, "failing"), 1.0);
    assert_eq!(pool_gauge(&m, "workers"), 2.0);
    assert_eq!(api.lock().served, served, "a failing API served a call");
    assert_eq!(
        fleet(&c),
        vec![
            ("vllm-d-1".to_owned(), Decode, false),
            ("vllm-p-0".to_owned(), Prefill, false)
        ]
    );
    std::fs::write(dir.0.join("token"), TOKEN).unwrap();
    wait_fleet(
        &c,
        &[
            ("vllm-d-1", Decode, false),
            ("vllm-d-2", Decode, false),
            ("vllm-p-0", Prefill, false),
        ],
    )
    .await;
    let listed = c.service().list_workers();
    let d2 = listed.iter().find(|w| w.name == "vllm-d-2").unwrap();
    assert_eq!(d2.id.0, 1024, "the lowest free id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_outside_a_pod_without_an_api_url_refuses_to_start() {
    let dir = TempDir::new("pool-no-api");
    let mut cfg = common::base_config(&dir);
    cfg.workers.clear();
    cfg.inference_pool = Some(InferencePoolConfig {
        name: "vllm-pd".into(),
        namespace: Some("llm".into()),
        ..InferencePoolConfig::default()
    });
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        return; // Inside a pod the default is the pod's API.
    }
    let Err(err) = kvc_router::serve(cfg, std::future::pending()).await else {
        panic!("a router without an API to read its pool started");
    };
    assert!(err.to_string().contains("set api-url"), "{err}");
}
