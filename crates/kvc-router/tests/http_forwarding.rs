//! The HTTP front end to end: a router over one prefill and two decode snapshot workers (manual
//! clock), with in-process mock HTTP workers that record what they receive.

mod common;
mod http_client;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use common::Cluster;
use kvc_core::{Health, WorkerId};
use kvc_router::http::{HttpOptions, WorkerEndpoints, http_app_with};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A loopback address nobody listens on (connections are refused).
fn dead_addr() -> SocketAddr {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    addr
}

/// No retries, no circuit breakers, no health checks: every failure reaches the client.
fn without_resilience(o: &mut HttpOptions) {
    o.max_retries = 0;
    o.breaker.failure_threshold = 0;
    o.health_check_interval = None;
}

/// What a mock worker does with a request.
#[derive(Clone, Copy, PartialEq)]
enum Behaviour {
    Answer,
    /// Like `Answer`, but a streamed answer is not held back after its first event.
    Flow,
    Fail,
    Stall,
    /// A streamed answer that breaks off after two events.
    DieMidStream,
}

struct Mock {
    name: String,
    received: Mutex<Vec<(String, Value)>>,
    behaviour: Mutex<Behaviour>,
    /// What its `GET /health` answers: 200 while up, else 503.
    up: std::sync::atomic::AtomicBool,
    /// A streamed answer waits here after its first event.
    gate: tokio::sync::Notify,
}

/// The SSE events a mock worker streams for `path`, then `data: [DONE]`.
fn stream_events(name: &str, path: &str) -> Vec<String> {
    let mut events: Vec<String> = (0..3u64)
        .map(|i| {
            let v = if path == "/generate" {
                json!({"text": format!("{name} tok{i}"), "meta_info": {"completion_tokens": i + 1}})
            } else {
                json!({"choices": [{"text": format!("{name} tok{i}")}],
                       "usage": {"completion_tokens": i + 1}})
            };
            format!("data: {v}\n\n")
        })
        .collect();
    events.push("data: [DONE]\n\n".to_owned());
    events
}

async fn mock_handler(
    State(m): State<Arc<Mock>>,
    uri: axum::http::Uri,
    body: Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let value: Value = serde_json::from_slice(&body).expect("router forwarded invalid JSON");
    let stream = value["stream"] == true;
    m.received.lock().push((uri.path().to_owned(), value));
    let behaviour = *m.behaviour.lock();
    match behaviour {
        Behaviour::Fail => {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                [("content-type", "application/json")],
                json!({"error": {"message": format!("{} failed", m.name)}}).to_string(),
            )
                .into_response();
        }
        Behaviour::Stall => tokio::time::sleep(Duration::from_secs(3)).await,
        Behaviour::Answer | Behaviour::Flow | Behaviour::DieMidStream => {}
    }
    if stream {
        let events = stream_events(&m.name, uri.path());
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(8);
        let mock = m.clone();
        tokio::spawn(async move {
            for (i, e) in events.into_iter().enumerate() {
                if i == 2 && behaviour == Behaviour::DieMidStream {
                    // Half an event, then the connection breaks.
                    let _ = tx.send(Ok("data: {\"text\": \"cut".to_owned())).await;
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let _ = tx.send(Err(std::io::Error::other("worker died"))).await;
                    return;
                }
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
                if i == 0 && behaviour == Behaviour::Answer {
                    mock.gate.notified().await;
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        });
        let body = axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        return (
            StatusCode::OK,
            [("content-type", "text/event-stream")],
            body,
        )
            .into_response();
    }
    let answer = if uri.path() == "/generate" {
        json!({"text": format!("answer from {}", m.name), "meta_info": {"completion_tokens": 40}})
    } else if uri.path() == "/v1/chat/completions" {
        json!({"object": "chat.completion",
               "choices": [{"message": {"role": "assistant", "content": format!("answer from {}", m.name)}}],
               "usage": {"completion_tokens": 12}})
    } else {
        json!({"choices": [{"text": format!("answer from {}", m.name)}],
               "usage": {"completion_tokens": 12}})
    };
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        answer.to_string(),
    )
        .into_response()
}

async fn mock_health(State(m): State<Arc<Mock>>) -> StatusCode {
    if m.up.load(std::sync::atomic::Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn spawn_mock(name: &str) -> (Arc<Mock>, SocketAddr) {
    let mock = Arc::new(Mock {
        name: name.to_owned(),
        received: Mutex::new(Vec::new()),
        behaviour: Mutex::new(Behaviour::Answer),
        up: std::sync::atomic::AtomicBool::new(true),
        gate: tokio::sync::Notify::new(),
    });
    let app = axum::Router::new()
        .route("/generate", post(mock_handler))
        .route("/v1/completions", post(mock_handler))
        .route("/v1/chat/completions", post(mock_handler))
        .route("/health", axum::routing::get(mock_health))
        .with_state(mock.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (mock, addr)
}

struct Setup {
    cluster: Cluster,
    /// Mock workers by id: 0 = P, 1 and 2 = D.
    mocks: Vec<Arc<Mock>>,
    prefill_addr: SocketAddr,
    front: SocketAddr,
}

impl Setup {
    async fn start() -> Setup {
        Setup::start_with(|_| {}).await
    }

    async fn start_with(edit: impl FnOnce(&mut WorkerEndpoints)) -> Setup {
        Setup::start_full(edit, |_| {}).await
    }

    async fn start_full(
        edit: impl FnOnce(&mut WorkerEndpoints),
        edit_options: impl FnOnce(&mut HttpOptions),
    ) -> Setup {
        let cluster = Cluster::start(|_| {}).await;
        cluster.wait_health(&[0, 1, 2], Health::Healthy).await;
        let mut mocks = Vec::new();
        let mut workers = WorkerEndpoints::new();
        let mut prefill_addr = None;
        for (id, name) in ["p0", "d1", "d2"].iter().enumerate() {
            let (mock, addr) = spawn_mock(name).await;
            let bootstrap = (id == 0).then_some(8_998 + 100);
            workers
                .insert(WorkerId(id as u32), &format!("http://{addr}"), bootstrap)
                .unwrap();
            if id == 0 {
                prefill_addr = Some(addr);
            }
            mocks.push(mock);
        }
        edit(&mut workers);
        let mut options = HttpOptions {
            request_timeout: Duration::from_millis(500),
            model: "test-model".to_owned(),
            max_body_bytes: 64 * 1024,
            ..HttpOptions::default()
        };
        edit_options(&mut options);
        let app = http_app_with(cluster.service().clone(), workers, options);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Setup {
            cluster,
            mocks,
            prefill_addr: prefill_addr.unwrap(),
            front,
        }
    }

    fn received(&self, id: usize) -> Vec<(String, Value)> {
        self.mocks[id].received.lock().clone()
    }

    fn counts(&self) -> [usize; 3] {
        [0, 1, 2].map(|i| self.mocks[i].received.lock().len())
    }

    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        request(self.front, "POST", path, headers, body).await
    }
}

struct Reply {
    status: u16,
    headers: HashMap<String, String>,
    body: Value,
}

/// One bounded HTTP/1.1 exchange with the front; the body must be JSON.
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).await.unwrap();
        // The front may answer (413) and close before reading a body over its limit: a
        // failed write or a reset after the answer is not an error here.
        let _ = s.write_all(body.as_bytes()).await;
        let mut buf = Vec::new();
        if let Err(e) = s.read_to_end(&mut buf).await {
            assert!(!buf.is_empty(), "no answer: {e}");
        }
        buf
    };
    let raw = tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .expect("request to the HTTP front timed out");
    let text = String::from_utf8(raw).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let body = serde_json::from_str(body).unwrap_or_else(|e| panic!("non-JSON body {body:?}: {e}"));
    Reply {
        status,
        headers,
        body,
    }
}

/// `kvc_router_outcomes_total{outcome}` as the service renders it.
fn outcomes(s: &Setup, outcome: &str) -> f64 {
    let samples = common::parse_prometheus(&s.cluster.service().render_metrics());
    common::value(
        &samples,
        "kvc_router_outcomes_total",
        &[("outcome", outcome)],
    )
}

fn ids(range: std::ops::Range<u32>) -> Value {
    Value::from(range.collect::<Vec<u32>>())
}

fn generate_body(tokens: std::ops::Range<u32>) -> String {
    json!({"input_ids": ids(tokens), "sampling_params": {"max_new_tokens": 40}, "stream": false})
        .to_string()
}

#[tokio::test]
async fn first_turn_goes_to_p_and_d_then_direct_to_d() {
    let s = Setup::start().await;
    let session = [("x-session-id", "agent-7")];

    let r = s
        .post("/generate", &session, &generate_body(0..1_300))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    let d: usize = r.headers["x-kvc-decode-worker"].parse().unwrap();
    assert!(d == 1 || d == 2);
    let other = 3 - d;
    assert_eq!(r.body["text"], format!("answer from d{d}"));

    let p_got = s.received(0);
    let d_got = s.received(d);
    assert_eq!(p_got.len(), 1);
    assert_eq!(d_got.len(), 1);
    assert!(s.received(other).is_empty());
    let (p_path, p_body) = &p_got[0];
    let (d_path, d_body) = &d_got[0];
    assert_eq!(p_path, "/generate");
    assert_eq!(d_path, "/generate");
    // The same body to both, with the bootstrap fields of P injected.
    assert_eq!(p_body, d_body);
    assert_eq!(p_body["bootstrap_host"], s.prefill_addr.ip().to_string());
    assert_eq!(p_body["bootstrap_port"], 9_098);
    let room = p_body["bootstrap_room"].as_u64().expect("room is a u64");
    assert!(room < 1 << 63);
    assert_eq!(p_body["input_ids"], ids(0..1_300));
    assert_eq!(p_body["sampling_params"]["max_new_tokens"], 40);
    assert_eq!(p_body["stream"], false);
    // The outcome was reported.
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(outcomes(&s, "ok"), 1.0);

    // Turn 2 extends the prompt: the session is resident on D, so D alone gets it, unchanged.
    let r = s
        .post("/generate", &session, &generate_body(0..1_900))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "direct-to-d");
    assert_eq!(r.headers["x-kvc-decode-worker"], d.to_string());
    assert!(!r.headers.contains_key("x-kvc-prefill-worker"));
    assert_eq!(r.body["text"], format!("answer from d{d}"));
    assert_eq!(s.received(0).len(), 1, "P must not see a direct-to-D turn");
    assert!(s.received(other).is_empty());
    let d_got = s.received(d);
    assert_eq!(d_got.len(), 2);
    let body = d_got[1].1.as_object().unwrap();
    assert!(!body.contains_key("bootstrap_room"));
    assert!(!body.contains_key("bootstrap_host"));
    assert_eq!(body["input_ids"], ids(0..1_900));
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(outcomes(&s, "ok"), 2.0);

    // Another session starts on the P path again, with a different room.
    let r = s
        .post(
            "/generate",
            &[("x-session-id", "agent-8")],
            &generate_body(5_000..5_600),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    let p_got = s.received(0);
    assert_eq!(p_got.len(), 2);
    assert_ne!(p_got[1].1["bootstrap_room"], room);
}

#[tokio::test]
async fn text_prompts_and_session_params_follow_the_session() {
    let s = Setup::start().await;
    let words: Vec<String> = (0..1_900).map(|i| format!("w{i}")).collect();
    let body = |n: usize| {
        json!({"text": words[..n].join(" "), "session_params": {"id": "chat-1"},
               "sampling_params": {"max_new_tokens": 40}})
        .to_string()
    };
    let r = s.post("/generate", &[], &body(1_300)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    let d = r.headers["x-kvc-decode-worker"].clone();
    assert_eq!(s.received(0)[0].1["text"], words[..1_300].join(" "));

    let r = s.post("/generate", &[], &body(1_900)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "direct-to-d");
    assert_eq!(r.headers["x-kvc-decode-worker"], d);
    assert_eq!(s.counts()[0], 1);
}

#[tokio::test]
async fn openai_completions_are_forwarded_on_the_same_path() {
    let s = Setup::start().await;
    let body =
        json!({"model": "test-model", "prompt": "say hello to the cluster", "max_tokens": 12})
            .to_string();
    let r = s.post("/v1/completions", &[], &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let d: usize = r.headers["x-kvc-decode-worker"].parse().unwrap();
    assert_eq!(r.body["choices"][0]["text"], format!("answer from d{d}"));
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    let (path, got) = &s.received(d)[0];
    assert_eq!(path, "/v1/completions");
    assert_eq!(got["prompt"], "say hello to the cluster");
    assert_eq!(got["max_tokens"], 12);
    assert_eq!(got["bootstrap_room"], s.received(0)[0].1["bootstrap_room"]);
    assert_eq!(s.cluster.service().pending_decisions(), 0);
}

#[tokio::test]
async fn chat_completions_are_forwarded_unchanged_and_follow_the_session() {
    let s = Setup::start().await;
    let words = |r: std::ops::Range<u32>| r.map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": words(0..1_300)}),
    ];
    let session = [("x-session-id", "chat-9")];
    let body = json!({"model": "test-model", "messages": messages, "max_tokens": 12}).to_string();
    let r = s.post("/v1/chat/completions", &session, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    let d: usize = r.headers["x-kvc-decode-worker"].parse().unwrap();
    assert_eq!(
        r.body["choices"][0]["message"]["content"],
        format!("answer from d{d}")
    );
    let (p_path, p_body) = &s.received(0)[0];
    let (d_path, d_body) = &s.received(d)[0];
    assert_eq!(p_path, "/v1/chat/completions");
    assert_eq!(d_path, "/v1/chat/completions");
    assert_eq!(p_body, d_body);
    // The messages go through as the client sent them (no template applied).
    assert_eq!(d_body["messages"], Value::from(messages.clone()));
    assert_eq!(d_body["max_tokens"], 12);
    assert_eq!(d_body["bootstrap_port"], 9_098);
    assert_eq!(outcomes(&s, "ok"), 1.0);

    // The next turn repeats the conversation and adds to it: direct to the same D, unchanged.
    messages.push(json!({"role": "assistant", "content": format!("answer from d{d}")}));
    messages.push(json!({"role": "user", "content": words(1_300..1_900)}));
    let body = json!({"model": "test-model", "messages": messages, "max_tokens": 12}).to_string();
    let r = s.post("/v1/chat/completions", &session, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "direct-to-d");
    assert_eq!(r.headers["x-kvc-decode-worker"], d.to_string());
    assert_eq!(s.counts()[0], 1, "P must not see a direct-to-D turn");
    let (_, d_body) = &s.received(d)[1];
    assert!(!d_body.as_object().unwrap().contains_key("bootstrap_room"));
    assert_eq!(d_body["messages"], Value::from(messages));
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(outcomes(&s, "ok"), 2.0);

    // Malformed chat bodies: 400 with the JSON error shape, nothing forwarded.
    for (bad, want) in [
        (r#"{"messages": []}"#, "empty"),
        (
            r#"{"messages": [{"role": "user", "content": 3}]}"#,
            "content",
        ),
        (r#"{"prompt": "a"}"#, "missing `messages`"),
    ] {
        let r = s.post("/v1/chat/completions", &[], bad).await;
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(r.body["error"]["type"], "invalid_request_error");
        let message = r.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(want), "{bad}: {message}");
    }
    assert_eq!(s.counts()[0], 1);
}

#[tokio::test]
async fn malformed_bodies_get_400_with_a_json_error() {
    let s = Setup::start().await;
    let cases: [(&str, &str, &str); 7] = [
        ("/generate", "{not json", "invalid JSON"),
        ("/generate", "[1, 2]", "JSON object"),
        ("/generate", r#"{"sampling_params": {}}"#, "missing"),
        ("/generate", r#"{"text": "a", "stream": 1}"#, "stream"),
        ("/generate", r#"{"text": "   "}"#, "empty"),
        ("/v1/completions", r#"{"prompt": ["a", "b"]}"#, "batched"),
        (
            "/v1/completions",
            r#"{"prompt": "a", "max_tokens": "many"}"#,
            "max_tokens",
        ),
    ];
    for (path, body, want) in cases {
        let r = s.post(path, &[], body).await;
        assert_eq!(r.status, 400, "{path} {body}");
        let message = r.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(want), "{body}: {message}");
        assert_eq!(r.body["error"]["type"], "invalid_request_error");
    }
    // An empty session header is malformed too.
    let r = s
        .post("/generate", &[("x-session-id", " ")], r#"{"text":"a"}"#)
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("x-session-id")
    );
    // A body over the limit: 413, same error shape.
    let big = generate_body(0..20_000);
    assert!(big.len() > 64 * 1024);
    let r = s.post("/generate", &[], &big).await;
    assert_eq!(r.status, 413);
    assert!(r.body["error"]["message"].is_string());
    assert_eq!(r.body["error"]["type"], "invalid_request_error");
    assert_eq!(s.counts(), [0, 0, 0], "nothing malformed reaches a worker");
    assert_eq!(s.cluster.service().pending_decisions(), 0);
}

#[tokio::test]
async fn health_and_models_answer() {
    let s = Setup::start().await;
    let r = request(s.front, "GET", "/health", &[], "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["status"], "ok");
    assert_eq!(r.body["healthy_workers"], 3);
    let r = request(s.front, "GET", "/v1/models", &[], "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["object"], "list");
    assert_eq!(r.body["data"][0]["id"], "test-model");
    assert_eq!(r.body["data"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn health_is_503_when_no_worker_is_routable() {
    let s = Setup::start().await;
    // Let every snapshot go stale.
    s.cluster.clock.advance(common::STALE_MS + 500);
    s.cluster.wait_health(&[0, 1, 2], Health::Stale).await;
    let r = request(s.front, "GET", "/health", &[], "").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.body["error"]["message"], "no routable worker");
    // Routing fails too: 503, nothing forwarded.
    let r = s.post("/generate", &[], &generate_body(0..100)).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body["error"]["message"].is_string());
    assert_eq!(s.counts(), [0, 0, 0]);
}

#[tokio::test]
async fn failed_prefill_is_reported_and_the_next_turn_is_not_direct() {
    let s = Setup::start().await;
    *s.mocks[0].behaviour.lock() = Behaviour::Fail;
    // The decode workers wait (for KV that does not come) longer than the deadline.
    for m in &s.mocks[1..] {
        *m.behaviour.lock() = Behaviour::Stall;
    }
    let session = [("x-session-id", "agent-9")];
    let r = s
        .post("/generate", &session, &generate_body(0..1_300))
        .await;
    // P failed first: its answer, not a timeout of D's, and counted as worker-failed, so
    // nothing is resident.
    assert_eq!(r.status, 500, "{}", r.body);
    assert_eq!(r.body["error"]["message"], "p0 failed");
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(outcomes(&s, "worker-failed"), 1.0);
    assert_eq!(outcomes(&s, "ok"), 0.0);
    *s.mocks[0].behaviour.lock() = Behaviour::Answer;
    for m in &s.mocks[1..] {
        *m.behaviour.lock() = Behaviour::Answer;
    }
    let r = s
        .post("/generate", &session, &generate_body(0..1_900))
        .await;
    assert_eq!(r.status, 200);
    assert_ne!(r.headers["x-kvc-mode"], "direct-to-d");
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    assert_eq!(s.counts()[0], 2);
}

#[tokio::test]
async fn failing_stalled_and_dead_decode_workers_give_json_errors() {
    let s = Setup::start_full(
        |w| {
            // Worker 2 points at a port nobody listens on.
            w.insert(WorkerId(2), &format!("http://{}", dead_addr()), None)
                .unwrap();
        },
        without_resilience,
    )
    .await;
    *s.mocks[1].behaviour.lock() = Behaviour::Fail;
    let mut seen: HashMap<&str, u32> = HashMap::new();
    let mut requests = 0.0;
    // Distinct sessions and prompts until both decode workers were chosen (bounded).
    for i in 0..32u32 {
        if seen.contains_key("failing") && seen.contains_key("dead") {
            break;
        }
        let key = format!("s{i}");
        let r = s
            .post(
                "/generate",
                &[("x-session-id", key.as_str())],
                &generate_body(i * 1_000..i * 1_000 + 600),
            )
            .await;
        requests += 1.0;
        match r.headers["x-kvc-decode-worker"].as_str() {
            "1" => {
                // The worker's own error is passed through.
                assert_eq!(r.status, 500);
                assert_eq!(r.body["error"]["message"], "d1 failed");
                *seen.entry("failing").or_default() += 1;
            }
            "2" => {
                assert_eq!(r.status, 502);
                assert_eq!(r.body["error"]["type"], "worker_error");
                *seen.entry("dead").or_default() += 1;
            }
            other => panic!("unexpected decode worker {other}"),
        }
    }
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(outcomes(&s, "worker-failed"), requests);

    *s.mocks[1].behaviour.lock() = Behaviour::Stall;
    for i in 0..32u32 {
        let key = format!("t{i}");
        let r = s
            .post(
                "/generate",
                &[("x-session-id", key.as_str())],
                &generate_body(50_000 + i * 1_000..50_000 + i * 1_000 + 600),
            )
            .await;
        if r.headers["x-kvc-decode-worker"] == "1" {
            assert_eq!(r.status, 504, "{}", r.body);
            let message = r.body["error"]["message"].as_str().unwrap();
            assert!(message.contains("no answer within"), "{message}");
            *seen.entry("stalled").or_default() += 1;
            break;
        }
    }
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(seen.len(), 3, "every failure kind exercised: {seen:?}");
}

#[tokio::test]
async fn the_session_header_name_is_configurable() {
    let s = Setup::start_full(|_| {}, |o| o.session_header = "x-conversation".to_owned()).await;
    let r = s
        .post(
            "/generate",
            &[("x-conversation", "c1")],
            &generate_body(0..1_300),
        )
        .await;
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    let r = s
        .post(
            "/generate",
            &[("x-conversation", "c1")],
            &generate_body(0..1_900),
        )
        .await;
    assert_eq!(r.headers["x-kvc-mode"], "direct-to-d");
    // The default header now names no session: a sessionless request takes the P path.
    let r = s
        .post(
            "/generate",
            &[("x-session-id", "c1")],
            &generate_body(0..2_000),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    assert_eq!(s.counts()[0], 2);
}

/// A streamed request to the front.
async fn open_stream(s: &Setup, path: &str, body: &Value) -> http_client::Streamed {
    http_client::post(s.front, path, &[], &body.to_string()).await
}

/// The next piece of a streamed answer, within a bound.
async fn next_piece(ws: &mut http_client::Streamed) -> Option<Vec<u8>> {
    ws.next_piece().await
}

async fn read_all(ws: &mut http_client::Streamed) -> String {
    ws.read_all().await
}

/// Outcomes are reported once a stream has ended: wait (bounded) until none is pending.
async fn settle(s: &Setup) {
    for _ in 0..500 {
        if s.cluster.service().pending_decisions() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("a streamed request's outcome was never reported");
}

fn chosen_decode(s: &Setup, before: [usize; 3]) -> usize {
    let now = s.counts();
    match (now[1] > before[1], now[2] > before[2]) {
        (true, false) => 1,
        (false, true) => 2,
        other => panic!("exactly one decode worker should be called: {other:?}"),
    }
}

#[tokio::test]
async fn streamed_answers_are_relayed_as_they_arrive() {
    let s = Setup::start().await;
    let body = |n: u32| {
        json!({"input_ids": ids(0..n), "sampling_params": {"max_new_tokens": 40},
               "session_params": {"id": "stream-1"}, "stream": true})
    };
    // P streams too (its answer is drained, not relayed): let it through at once.
    s.mocks[0].gate.notify_one();
    let mut ws = open_stream(&s, "/generate", &body(1_300)).await;
    assert_eq!(ws.status, 200);
    assert_eq!(ws.headers["content-type"], "text/event-stream");
    let d = chosen_decode(&s, [1, 0, 0]);
    // The first event reaches the client while the worker still holds the rest back: the
    // answer is not buffered.
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("tok0") {
        got.extend(next_piece(&mut ws).await.expect("the first event"));
    }
    assert!(!String::from_utf8_lossy(&got).contains("tok1"));
    s.mocks[d].gate.notify_one();
    let rest = read_all(&mut ws).await;
    let all = format!("{}{rest}", String::from_utf8(got).unwrap());
    assert_eq!(all, stream_events(&format!("d{d}"), "/generate").concat());
    // The outcome is reported once P has answered too.
    settle(&s).await;
    // P and D got the same body, with the bootstrap fields and `stream: true`.
    let (_, p_body) = &s.received(0)[0];
    let (_, d_body) = &s.received(d)[0];
    assert_eq!(p_body, d_body);
    assert_eq!(d_body["stream"], true);
    assert!(d_body["bootstrap_room"].is_u64());
    assert_eq!(outcomes(&s, "ok"), 1.0);

    // The outcome made the session resident on D: the next turn streams direct-to-D.
    let before = s.counts();
    let mut ws = open_stream(&s, "/generate", &body(1_900)).await;
    assert_eq!(chosen_decode(&s, before), d);
    s.mocks[d].gate.notify_one();
    let all = read_all(&mut ws).await;
    assert_eq!(all, stream_events(&format!("d{d}"), "/generate").concat());
    assert_eq!(s.counts()[0], 1, "P must not see a direct-to-D turn");
    settle(&s).await;
    assert_eq!(outcomes(&s, "ok"), 2.0);

    // OpenAI completions stream the same way, to the same path.
    s.mocks[0].gate.notify_one();
    let before = s.counts();
    let mut ws = open_stream(
        &s,
        "/v1/completions",
        &json!({"prompt": "stream this please", "max_tokens": 3, "stream": true}),
    )
    .await;
    let d = chosen_decode(&s, before);
    s.mocks[d].gate.notify_one();
    let all = read_all(&mut ws).await;
    assert_eq!(
        all,
        stream_events(&format!("d{d}"), "/v1/completions").concat()
    );
    assert_eq!(s.received(d).last().unwrap().0, "/v1/completions");
    settle(&s).await;
    assert_eq!(outcomes(&s, "ok"), 3.0);
    assert_eq!(outcomes(&s, "worker-failed"), 0.0);
}

#[tokio::test]
async fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let s = Setup::start().await;
    for m in &s.mocks[1..] {
        *m.behaviour.lock() = Behaviour::DieMidStream;
    }
    let chat = json!({"messages": [{"role": "user", "content": "tell me a long story"}],
                      "max_tokens": 50, "stream": true});
    let mut ws = open_stream(&s, "/v1/chat/completions", &chat).await;
    assert_eq!(ws.status, 200);
    let d = chosen_decode(&s, [1, 0, 0]);
    let all = read_all(&mut ws).await;
    let events = stream_events(&format!("d{d}"), "/v1/chat/completions");
    // What the worker sent before it died comes first, unchanged.
    assert!(all.starts_with(&events[..2].concat()), "{all}");
    // The stream ends with one well-formed SSE error event.
    assert!(all.ends_with("\n\n"), "{all:?}");
    let last = all
        .trim_end()
        .rsplit("\n\n")
        .next()
        .unwrap()
        .strip_prefix("data: ")
        .unwrap_or_else(|| panic!("no error event at the end: {all:?}"));
    let error: Value = serde_json::from_str(last).unwrap();
    assert_eq!(error["error"]["type"], "worker_error");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("decode worker")
    );
    assert!(!all.contains("[DONE]"));
    // Counted, as a worker failure.
    settle(&s).await;
    assert_eq!(outcomes(&s, "worker-failed"), 1.0);
    assert_eq!(outcomes(&s, "ok"), 0.0);
}

#[tokio::test]
async fn a_stream_to_a_dead_decode_worker_gets_a_json_error() {
    let s = Setup::start_full(
        |w| {
            for id in [1, 2] {
                w.insert(WorkerId(id), &format!("http://{}", dead_addr()), None)
                    .unwrap();
            }
        },
        without_resilience,
    )
    .await;
    let body = json!({"text": "a b c", "stream": true}).to_string();
    let r = s.post("/generate", &[], &body).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert_eq!(r.body["error"]["type"], "worker_error");
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(outcomes(&s, "worker-failed"), 1.0);
}

/// The front's metrics (the service's exposition) as samples.
fn metric(s: &Setup, name: &str, labels: &[(&str, &str)]) -> f64 {
    let samples = common::parse_prometheus(&s.cluster.service().render_metrics());
    common::value(&samples, name, labels)
}

#[tokio::test]
async fn a_refused_decode_worker_is_retried_on_the_other_and_its_breaker_opens() {
    let s = Setup::start_full(
        |w| {
            w.insert(WorkerId(2), &format!("http://{}", dead_addr()), None)
                .unwrap();
        },
        |o| {
            o.max_retries = 2;
            o.retry_backoff = Duration::from_millis(2);
            o.breaker.failure_threshold = 1;
            o.health_check_interval = None;
        },
    )
    .await;
    let service = s.cluster.service().clone();
    let mut requests = 0.0;
    // Distinct sessions until one was first routed to the dead worker (bounded).
    for i in 0..32u32 {
        let key = format!("r{i}");
        let r = s
            .post(
                "/generate",
                &[("x-session-id", key.as_str())],
                &generate_body(i * 1_000..i * 1_000 + 600),
            )
            .await;
        requests += 1.0;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.headers["x-kvc-decode-worker"], "1");
        assert_eq!(r.body["text"], "answer from d1");
        if service.metrics().http_retries() > 0 {
            break;
        }
    }
    assert_eq!(
        service.metrics().http_retries(),
        1,
        "the dead worker was tried once"
    );
    assert_eq!(metric(&s, "kvc_router_http_retries_total", &[]), 1.0);
    // One failure opened its breaker: out of rotation, nothing more is sent its way.
    assert!(service.is_http_down(WorkerId(2)));
    assert_eq!(
        service.metrics().breaker_state(WorkerId(2)),
        Some(kvc_router::http::BreakerState::Open)
    );
    assert_eq!(
        metric(
            &s,
            "kvc_router_http_breaker_state",
            &[("worker", "2"), ("state", "open")]
        ),
        1.0
    );
    assert_eq!(
        metric(
            &s,
            "kvc_router_http_breaker_transitions_total",
            &[("to", "open")]
        ),
        1.0
    );
    let views = service.worker_views();
    assert_eq!(views[2].state.health, Health::Down);
    assert_eq!(views[1].state.health, Health::Healthy);
    for i in 100..104u32 {
        let key = format!("r{i}");
        let r = s
            .post(
                "/generate",
                &[("x-session-id", key.as_str())],
                &generate_body(i * 1_000..i * 1_000 + 600),
            )
            .await;
        requests += 1.0;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.headers["x-kvc-decode-worker"], "1");
    }
    assert_eq!(service.metrics().http_retries(), 1);
    // The failed decision and every answered one are reported.
    assert_eq!(service.pending_decisions(), 0);
    assert_eq!(outcomes(&s, "worker-failed"), 1.0);
    assert_eq!(outcomes(&s, "ok"), requests);
}

#[tokio::test]
async fn retries_stop_at_the_limit_and_the_last_failure_is_answered() {
    let s = Setup::start_full(
        |w| {
            for id in [1, 2] {
                w.insert(WorkerId(id), &format!("http://{}", dead_addr()), None)
                    .unwrap();
            }
        },
        |o| {
            o.max_retries = 1;
            o.retry_backoff = Duration::from_millis(2);
            o.breaker.failure_threshold = 0;
            o.health_check_interval = None;
        },
    )
    .await;
    let r = s.post("/generate", &[], &generate_body(0..600)).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert_eq!(r.body["error"]["type"], "worker_error");
    // The first attempt and one retry, each reported.
    assert_eq!(s.cluster.service().metrics().http_retries(), 1);
    assert_eq!(outcomes(&s, "worker-failed"), 2.0);
    assert_eq!(s.cluster.service().pending_decisions(), 0);
}

#[tokio::test]
async fn a_stream_is_retried_on_another_decode_worker_before_any_byte() {
    let s = Setup::start_full(
        |w| {
            w.insert(WorkerId(2), &format!("http://{}", dead_addr()), None)
                .unwrap();
        },
        |o| {
            o.max_retries = 2;
            o.retry_backoff = Duration::from_millis(2);
            // No breaker: the dead worker stays in rotation, every pick of it is retried.
            o.breaker.failure_threshold = 0;
            o.health_check_interval = None;
        },
    )
    .await;
    for m in &s.mocks {
        *m.behaviour.lock() = Behaviour::Flow;
    }
    let metrics = || s.cluster.service().metrics().http_retries();
    let mut requests = 0.0;
    for i in 0..32u32 {
        let body = json!({"input_ids": ids(i * 1_000..i * 1_000 + 600),
                          "session_params": {"id": format!("st{i}")}, "stream": true});
        let mut ws = open_stream(&s, "/generate", &body).await;
        requests += 1.0;
        assert_eq!(ws.status, 200);
        let text = read_all(&mut ws).await;
        assert!(
            text.contains("d1 tok2") && text.ends_with("data: [DONE]\n\n"),
            "{text}"
        );
        settle(&s).await;
        if metrics() > 0 {
            break;
        }
    }
    let retries = metrics() as f64;
    assert!(retries >= 1.0, "the dead worker was never picked");
    assert_eq!(outcomes(&s, "worker-failed"), retries);
    assert_eq!(outcomes(&s, "ok"), requests);
}

#[tokio::test]
async fn health_checks_open_the_breaker_and_recovery_closes_it() {
    use kvc_router::http::BreakerState;
    let s = Setup::start_full(
        |_| {},
        |o| {
            o.max_retries = 0;
            o.breaker.failure_threshold = 2;
            o.breaker.cooldown = Duration::from_millis(10);
            o.health_check_interval = Some(Duration::from_millis(20));
            o.health_check_timeout = Duration::from_millis(300);
        },
    )
    .await;
    let service = s.cluster.service().clone();
    let w2 = WorkerId(2);
    s.mocks[2]
        .up
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let mut opened = false;
    for _ in 0..200 {
        if service.metrics().breaker_state(w2) == Some(BreakerState::Open) {
            opened = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(opened, "failing health checks never opened the breaker");
    assert!(service.is_http_down(w2));
    assert!(service.metrics().health_checks(false) >= 2);
    assert!(
        metric(
            &s,
            "kvc_router_http_health_checks_total",
            &[("result", "ok")]
        ) >= 2.0
    );
    // Out of rotation: requests go to the other decode worker.
    for i in 0..4u32 {
        let key = format!("h{i}");
        let r = s
            .post(
                "/generate",
                &[("x-session-id", key.as_str())],
                &generate_body(i * 1_000..i * 1_000 + 600),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.headers["x-kvc-decode-worker"], "1");
    }
    // The router's clock is manual: the cool-down ends when it is advanced.
    s.mocks[2]
        .up
        .store(true, std::sync::atomic::Ordering::SeqCst);
    s.cluster.clock.advance(20);
    let mut closed = false;
    for _ in 0..200 {
        if service.metrics().breaker_state(w2) == Some(BreakerState::Closed) {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(closed, "a healthy worker's breaker never closed");
    assert!(!service.is_http_down(w2));
    assert_eq!(service.worker_views()[2].state.health, Health::Healthy);
    let m = service.metrics();
    assert!(m.breaker_transitions(BreakerState::Open) >= 1);
    assert!(m.breaker_transitions(BreakerState::HalfOpen) >= 1);
    assert!(m.breaker_transitions(BreakerState::Closed) >= 1);
}
