//! The HTTP front's listener against slow, idle, oversized and too many clients: deadlines on
//! a request's head, its body and the idle wait, a connection limit that keeps the health
//! probes answerable, and JSON on the answers hyper writes by itself. Raw loopback sockets;
//! every wait is bounded.

mod common;

use axum::routing::post;
use common::Cluster;
use kvc_core::{Health, WorkerId};
use kvc_router::http::{HttpOptions, ListenerOptions, WorkerEndpoints, http_app_with, serve_front};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Long enough never to fire during a test.
const LONG: Duration = Duration::from_secs(60);
/// Short enough to fire within a test.
const SHORT: Duration = Duration::from_millis(300);
/// An idle deadline that fires within a test, yet long enough for a kept-alive client on a
/// loaded machine to send its next request before it.
const IDLE: Duration = Duration::from_secs(3);
/// The most any test waits for the front to act.
const BOUND: Duration = Duration::from_secs(10);

async fn spawn_worker() -> SocketAddr {
    let answer = || async {
        (
            [("content-type", "application/json")],
            json!({"text": "ok", "meta_info": {"completion_tokens": 1}}).to_string(),
        )
    };
    let app = axum::Router::new()
        .route("/generate", post(answer))
        .route("/v1/completions", post(answer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

struct Front {
    _cluster: Cluster,
    addr: SocketAddr,
    stop: CancellationToken,
}

impl Drop for Front {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The front over P0, D1, D2 (each with a worker answering at once) served by `serve_front`
/// with `listener` options and `options` edited.
async fn start(listener: ListenerOptions, options: impl FnOnce(&mut HttpOptions)) -> Front {
    let cluster = Cluster::start(|_| {}).await;
    cluster.wait_health(&[0, 1, 2], Health::Healthy).await;
    let mut workers = WorkerEndpoints::new();
    for id in 0..3 {
        let addr = spawn_worker().await;
        workers
            .insert(WorkerId(id), &format!("http://{addr}"), None)
            .unwrap();
    }
    let mut o = HttpOptions {
        health_check_interval: None,
        ..HttpOptions::default()
    };
    options(&mut o);
    let app = http_app_with(cluster.service().clone(), workers, o);
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(serve_front(tcp, app, listener, None, stop.clone()));
    Front {
        _cluster: cluster,
        addr,
        stop,
    }
}

fn listener(edit: impl FnOnce(&mut ListenerOptions)) -> ListenerOptions {
    let mut o = ListenerOptions {
        header_read_timeout: LONG,
        idle_timeout: LONG,
        ..ListenerOptions::default()
    };
    edit(&mut o);
    o
}

/// Everything the front sends until it closes the connection (a reset counts as closed),
/// within [`BOUND`]; panics if the connection is still open then.
async fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(BOUND, read)
        .await
        .unwrap_or_else(|_| panic!("the connection is still open after {BOUND:?}"));
    got
}

/// One answer (status, lower-cased head, JSON body) read from `s`, the connection left open:
/// the head, then `content-length` bytes of body.
async fn read_answer(s: &mut TcpStream) -> (u16, String, Value) {
    let read = async {
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&raw[..end]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .expect("a content-length");
                if raw.len() >= end + 4 + length {
                    return (head, raw[end + 4..end + 4 + length].to_vec());
                }
            }
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the answer was complete: {raw:?}");
            raw.extend_from_slice(&buf[..n]);
        }
    };
    let (head, body) = tokio::time::timeout(BOUND, read).await.expect("an answer");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{head}: not JSON ({e}): {}", String::from_utf8_lossy(&body)));
    (status, head, body)
}

/// Parses a whole answer the front sent before closing.
fn parse_closed(raw: &[u8]) -> (u16, String, Value) {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer: {text:?}"));
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{head}: not JSON ({e}): {body:?}"));
    (status, head.to_lowercase(), body)
}

async fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr).await.unwrap()
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n")
}

fn post_generate(body: &str) -> String {
    format!(
        "POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

const GENERATE: &str = r#"{"input_ids": [1, 2, 3]}"#;

#[tokio::test]
async fn a_partial_head_is_cut_off_at_the_header_deadline() {
    let f = start(listener(|o| o.header_read_timeout = SHORT), |_| {}).await;
    let mut s = connect(f.addr).await;
    s.write_all(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Le")
        .await
        .unwrap();
    let got = read_until_closed(&mut s).await;
    assert!(
        got.is_empty(),
        "no answer: {}",
        String::from_utf8_lossy(&got)
    );
    // A head trickling in, byte by byte, does not outlast the deadline either.
    let mut s = connect(f.addr).await;
    let trickle = async {
        for b in b"GET /health HTTP/1.1\r\nX-Slow: ".iter().cycle() {
            if s.write_all(&[*b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(BOUND, trickle)
        .await
        .expect("the trickling head was cut off");
}

#[tokio::test]
async fn a_half_sent_body_gets_408_and_the_connection_closes() {
    let f = start(listener(|_| {}), |o| o.body_read_timeout = SHORT).await;
    let mut s = connect(f.addr).await;
    s.write_all(
        b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
          Content-Length: 1000\r\n\r\n{\"input_ids\": [1,",
    )
    .await
    .unwrap();
    let got = read_until_closed(&mut s).await;
    let (status, head, body) = parse_closed(&got);
    assert_eq!(status, 408, "{head}");
    assert!(head.contains("connection: close"), "{head}");
    assert_eq!(body["error"]["code"], 408);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("http.body-read-timeout-ms"), "{message}");
}

#[tokio::test]
async fn idle_connections_are_closed_at_the_idle_deadline() {
    let f = start(listener(|o| o.idle_timeout = IDLE), |_| {}).await;
    // A connection that never sends anything.
    let mut s = connect(f.addr).await;
    assert!(read_until_closed(&mut s).await.is_empty());
    // A kept-alive connection after its answers.
    let mut s = connect(f.addr).await;
    for _ in 0..2 {
        s.write_all(get("/livez").as_bytes()).await.unwrap();
        let (status, head, _) = read_answer(&mut s).await;
        assert_eq!(status, 200, "{head}");
        assert!(!head.contains("connection: close"), "kept alive: {head}");
    }
    assert!(read_until_closed(&mut s).await.is_empty());
}

#[tokio::test]
async fn past_the_connection_limit_the_health_probes_still_answer() {
    let f = start(
        listener(|o| {
            o.max_connections = 3;
            o.overflow_connections = 2;
        }),
        |_| {},
    )
    .await;
    // Three clients hold every place (each served once, then kept alive).
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = connect(f.addr).await;
        s.write_all(get("/livez").as_bytes()).await.unwrap();
        assert_eq!(read_answer(&mut s).await.0, 200);
        held.push(s);
    }
    // The health probes are answered on an overflow place, then the connection is closed.
    for path in ["/health", "/readyz", "/livez"] {
        let mut s = connect(f.addr).await;
        s.write_all(get(path).as_bytes()).await.unwrap();
        let (status, head, body) = parse_closed(&read_until_closed(&mut s).await);
        assert_eq!(status, 200, "{path}: {head} {body}");
        assert!(head.contains("connection: close"), "{head}");
    }
    // Anything else gets 503 naming the limit.
    let mut s = connect(f.addr).await;
    s.write_all(post_generate(GENERATE).as_bytes())
        .await
        .unwrap();
    let (status, _, body) = parse_closed(&read_until_closed(&mut s).await);
    assert_eq!(status, 503);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("3 connections") && message.contains("http.max-connections"));
    // Two silent clients take the overflow places; the next connection is closed unanswered.
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(connect(f.addr).await);
    }
    let mut s = connect(f.addr).await;
    s.write_all(get("/health").as_bytes()).await.unwrap();
    assert!(read_until_closed(&mut s).await.is_empty());
    // The held clients leave: places free up and requests are served again.
    drop(held);
    let mut served = None;
    let deadline = std::time::Instant::now() + common::WAIT;
    while std::time::Instant::now() < deadline {
        let mut s = connect(f.addr).await;
        s.write_all(post_generate(GENERATE).as_bytes())
            .await
            .unwrap();
        let got = read_until_closed_or_answer(&mut s).await;
        if got.0 == 200 {
            served = Some(got);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _, body) = served.expect("served again once places were free");
    assert_eq!(status, 200);
    assert_eq!(body["text"], "ok");
    drop(silent);
}

/// An answer on a kept-alive connection, or the one a closing connection sent (status 0 when
/// it sent none).
async fn read_until_closed_or_answer(s: &mut TcpStream) -> (u16, String, Value) {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        loop {
            if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&raw[..end]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if raw.len() >= end + 4 + length {
                    return;
                }
            }
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(BOUND, read)
        .await
        .expect("an answer or a close");
    if raw.is_empty() {
        return (0, String::new(), Value::Null);
    }
    parse_closed(&raw)
}

#[tokio::test]
async fn oversized_and_malformed_heads_get_json_errors() {
    let f = start(listener(|o| o.max_header_bytes = 4_096), |_| {}).await;
    let pad = "a".repeat(8_000);
    let huge_session = "s".repeat(1 << 20);
    let cases = [
        (
            format!("GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: {pad}\r\n\r\n"),
            431,
        ),
        (
            format!(
                "POST /generate HTTP/1.1\r\nHost: t\r\nX-Session-Id: {huge_session}\r\n\
                 Content-Length: 2\r\n\r\n{{}}"
            ),
            431,
        ),
        (
            "GET /he\u{1}lth HTTP/1.1\r\nHost: t\r\n\r\n".to_owned(),
            400,
        ),
        ("GET /health HTTP/1.1\r\nBad Header\r\n\r\n".to_owned(), 400),
    ];
    for (request, want) in cases {
        let mut s = connect(f.addr).await;
        // The front may close before reading everything: a failed write is not an error.
        let _ = s.write_all(request.as_bytes()).await;
        let (status, head, body) = parse_closed(&read_until_closed(&mut s).await);
        assert_eq!(status, want, "{head}");
        assert_eq!(body["error"]["code"], want);
        assert!(body["error"]["message"].is_string());
        if want == 431 {
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.contains("4096 bytes"), "{message}");
        }
    }
    // The front still serves.
    let mut s = connect(f.addr).await;
    s.write_all(get("/livez").as_bytes()).await.unwrap();
    assert_eq!(read_answer(&mut s).await.0, 200);
}

#[tokio::test]
async fn the_http_table_configures_the_served_front() {
    let cluster = Cluster::start(|cfg| {
        cfg.http_listen = Some("127.0.0.1:0".parse().unwrap());
        cfg.http.idle_timeout_ms = IDLE.as_millis() as u64;
        cfg.http.max_body_bytes = 64;
        cfg.http.max_session_id_bytes = 4;
    })
    .await;
    let addr = cluster.router.http_addr().unwrap();
    let mut s = connect(addr).await;
    s.write_all(get("/livez").as_bytes()).await.unwrap();
    assert_eq!(read_answer(&mut s).await.0, 200);
    let body = format!(r#"{{"text": "{}"}}"#, "w ".repeat(100));
    s.write_all(post_generate(&body).as_bytes()).await.unwrap();
    let (status, _, body) = read_answer(&mut s).await;
    assert_eq!(status, 413, "{body}");
    let mut s = connect(addr).await;
    let request = format!(
        "POST /generate HTTP/1.1\r\nHost: t\r\nX-Session-Id: abcde\r\n\
         Content-Length: {}\r\n\r\n{GENERATE}",
        GENERATE.len()
    );
    s.write_all(request.as_bytes()).await.unwrap();
    let (status, _, body) = read_answer(&mut s).await;
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 4 bytes")
    );
    // Idle past `idle-timeout-ms`: closed.
    assert!(read_until_closed(&mut s).await.is_empty());
}
