//! Property test of the HTTP front's request handling: arbitrary methods, paths, headers and
//! bodies (raw bytes, arbitrary JSON over the fields the front reads, and near-valid requests)
//! sent over loopback to a front served by `serve_front` with mock workers. The front never
//! drops a request unanswered (a panic would), answers with a status in 200..600, and every
//! error answer (4xx/5xx) carries a JSON `{"error": {"message": ...}}` body.

mod common;

use axum::routing::post;
use common::Cluster;
use kvc_core::{Health, WorkerId};
use kvc_router::http::{HttpOptions, ListenerOptions, WorkerEndpoints, http_app_with, serve_front};
use proptest::prelude::*;
use serde_json::{Map, Value, json};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// One front for every case: its runtime, its address.
struct Harness {
    runtime: tokio::runtime::Runtime,
    addr: SocketAddr,
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let addr = runtime.block_on(start_front());
        Harness { runtime, addr }
    })
}

async fn spawn_worker() -> SocketAddr {
    let answer = |body: axum::body::Bytes| async move {
        let stream = serde_json::from_slice::<Value>(&body).is_ok_and(|v| v["stream"] == true);
        if stream {
            (
                [("content-type", "text/event-stream")],
                "data: {\"text\": \"a\", \"meta_info\": {\"completion_tokens\": 1}}\n\ndata: [DONE]\n\n"
                    .to_owned(),
            )
        } else {
            (
                [("content-type", "application/json")],
                json!({"text": "ok", "meta_info": {"completion_tokens": 1},
                       "usage": {"completion_tokens": 1}})
                .to_string(),
            )
        }
    };
    let app = axum::Router::new()
        .route("/generate", post(answer))
        .route("/v1/completions", post(answer))
        .route("/v1/chat/completions", post(answer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn start_front() -> SocketAddr {
    // The cluster's clock never moves: its snapshot workers stay healthy for every case.
    let cluster = Box::leak(Box::new(Cluster::start(|_| {}).await));
    cluster.wait_health(&[0, 1, 2], Health::Healthy).await;
    let mut workers = WorkerEndpoints::new();
    for id in 0..3 {
        let addr = spawn_worker().await;
        workers
            .insert(WorkerId(id), &format!("http://{addr}"), None)
            .unwrap();
    }
    let options = HttpOptions {
        request_timeout: Duration::from_secs(5),
        health_check_interval: None,
        max_body_bytes: 4_096,
        max_session_id_bytes: 64,
        body_read_timeout: Duration::from_secs(2),
        ..HttpOptions::default()
    };
    let app = http_app_with(cluster.service().clone(), workers, options);
    let listener = ListenerOptions {
        header_read_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(2),
        max_header_bytes: 2_048,
        ..ListenerOptions::default()
    };
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    tokio::spawn(serve_front(
        tcp,
        app,
        listener,
        None,
        CancellationToken::new(),
    ));
    addr
}

/// Everything the front sent for `request` on a fresh connection, until it closed.
async fn exchange(addr: SocketAddr, request: Vec<u8>) -> Vec<u8> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        // The front may answer and close before reading everything.
        let _ = s.write_all(&request).await;
        let mut got = Vec::new();
        let mut buf = [0u8; 8_192];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return got,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .expect("the front answered and closed within 10 s")
}

/// A chunked body, de-chunked (enough for the front's answers).
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = body.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&body[..line_end]).unwrap();
        let size = usize::from_str_radix(size.split(';').next().unwrap().trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        let start = line_end + 2;
        out.extend_from_slice(&body[start..start + size]);
        body = &body[start + size + 2..];
    }
    out
}

/// Checks one answer: a status line, a status in 200..600, and on an error a JSON error body
/// (but for `HEAD`, which has no body).
fn check_answer(method: &str, raw: &[u8]) -> Result<(), TestCaseError> {
    let text = String::from_utf8_lossy(raw);
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Err(TestCaseError::fail(format!("no answer: {text:?}")));
    };
    let head = String::from_utf8_lossy(&raw[..end]).to_lowercase();
    let status: u16 = head
        .strip_prefix("http/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| TestCaseError::fail(format!("no status line: {head:?}")))?;
    prop_assert!((200..600).contains(&status), "{head}");
    if status < 400 || method == "HEAD" {
        return Ok(());
    }
    let body = &raw[end + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_vec()
    };
    let v: Value = serde_json::from_slice(&body).map_err(|e| {
        TestCaseError::fail(format!(
            "{status} body is not JSON ({e}): {:?}",
            String::from_utf8_lossy(&body)
        ))
    })?;
    prop_assert!(v["error"]["message"].is_string(), "{status}: {v}");
    Ok(())
}

fn method() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => Just("POST".to_owned()),
        2 => Just("GET".to_owned()),
        1 => prop::sample::select(vec!["PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]).prop_map(str::to_owned),
        1 => "[A-Z]{1,8}",
        1 => "[!-~]{1,6}",
    ]
}

fn path() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::sample::select(vec![
            "/generate", "/v1/completions", "/v1/chat/completions", "/health", "/readyz",
            "/livez", "/v1/models",
        ])
        .prop_map(str::to_owned),
        2 => "/[a-zA-Z0-9/_.%?=&-]{0,40}",
        1 => "[ -~]{0,30}",
    ]
}

fn header() -> impl Strategy<Value = (String, String)> {
    let name = prop_oneof![
        prop::sample::select(vec![
            "x-session-id",
            "content-type",
            "accept",
            "x-kvc-mode",
            "x-kvc-session",
            "user-agent",
            "authorization",
            "connection",
        ])
        .prop_map(str::to_owned),
        "[a-z][a-z0-9-]{0,12}".prop_filter("the request's own framing", |n| {
            !matches!(
                n.as_str(),
                "content-length" | "transfer-encoding" | "expect" | "host"
            )
        }),
    ];
    let value = prop_oneof![
        4 => "[ -~]{0,40}",
        1 => "[a-z]{60,80}",
        1 => "[ -~]{0,4}[\u{80}-\u{10ffff}]{1,4}",
    ];
    (name, value)
}

const KEYS: [&str; 16] = [
    "text",
    "input_ids",
    "prompt",
    "messages",
    "session_params",
    "stream",
    "sampling_params",
    "max_new_tokens",
    "max_tokens",
    "max_completion_tokens",
    "bootstrap_room",
    "bootstrap_host",
    "kv_transfer_params",
    "role",
    "content",
    "id",
];

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e12f64..1e12).prop_map(Value::from),
        "[ -~]{0,24}".prop_map(Value::from),
        prop::collection::vec(0u32..200_000, 0..48).prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(KEYS.to_vec()).prop_map(str::to_owned),
        1 => "[a-z_]{1,10}",
    ]
}

/// A request body the front can route, with random content.
fn near_valid() -> impl Strategy<Value = Value> {
    let words = "[a-z]{1,6}( [a-z]{1,6}){0,60}";
    prop_oneof![
        (
            prop::collection::vec(0u32..50_000, 1..300),
            any::<bool>(),
            prop::option::of("[ -~]{1,80}")
        )
            .prop_map(|(ids, stream, sid)| {
                let mut v = json!({"input_ids": ids, "stream": stream,
                                   "sampling_params": {"max_new_tokens": 4}});
                if let Some(id) = sid {
                    v["session_params"] = json!({"id": id});
                }
                v
            }),
        (words, any::<bool>()).prop_map(|(text, stream)| json!({"prompt": text, "stream": stream})),
        (words, words, any::<bool>()).prop_map(|(a, b, stream)| json!({
            "messages": [{"role": "system", "content": a}, {"role": "user", "content": b}],
            "stream": stream})),
    ]
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        2 => prop::collection::vec(any::<u8>(), 0..200),
        3 => prop::collection::btree_map(key(), json_value(), 0..8).prop_map(|m| {
            Value::Object(m.into_iter().collect::<Map<String, Value>>()).to_string().into_bytes()
        }),
        3 => near_valid().prop_map(|v| v.to_string().into_bytes()),
        1 => "[a-z]{5000,5200}".prop_map(|s| json!({"text": s}).to_string().into_bytes()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 384,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_request_gets_an_answer_and_every_error_is_json(
        method in method(),
        path in path(),
        headers in prop::collection::vec(header(), 0..6),
        body in body(),
    ) {
        let h = harness();
        let mut request = format!("{method} {path} HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n");
        if !body.is_empty() || method == "POST" {
            request.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        for (name, value) in &headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        let mut raw = request.into_bytes();
        raw.extend_from_slice(&body);
        let answer = h.runtime.block_on(exchange(h.addr, raw));
        check_answer(&method, &answer)?;
    }
}
