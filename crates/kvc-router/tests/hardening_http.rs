//! The HTTP front against hostile or unlucky input: fields only the router may set never reach
//! a worker from the client, session ids are bounded, a silent decode worker is blamed for its
//! own silence, health says what routing can do, and every error the front answers is JSON.
//! In-process mock workers record everything they receive.

mod common;
mod http_client;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::Cluster;
use kvc_core::{Health, WorkerId, WorkerRole};
use kvc_policy::PolicyConfig;
use kvc_router::RouterConfig;
use kvc_router::http::{BreakerState, HttpOptions, WorkerEndpoints, http_app_with};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// One request a mock worker received: path, every header (lower-case names), body.
type Received = (String, HashMap<String, String>, Value);

/// Rooms whose decode leg reached a decode worker that answers (the KV handshake is done):
/// a prefill mock waits for its room to appear here.
#[derive(Default)]
struct Handshakes {
    rooms: Mutex<HashSet<u64>>,
    changed: tokio::sync::Notify,
    /// The next request any decode mock receives (only that one) is never answered.
    hang_next: AtomicBool,
}

struct Mock {
    name: String,
    received: Mutex<Vec<Received>>,
    handshakes: Arc<Handshakes>,
}

/// How long a prefill mock waits for its decode partner before answering 504, like an
/// engine whose bootstrap room expired.
const PARTNER_TIMEOUT: Duration = Duration::from_millis(1_500);

fn answer(m: &Mock, path: &str, stream: bool) -> Response {
    if stream {
        let events: String = (1..=2u64)
            .map(|i| {
                let v = json!({"text": format!("{} tok{i}", m.name), "meta_info": {"completion_tokens": i},
                               "usage": {"completion_tokens": i}});
                format!("data: {v}\n\n")
            })
            .chain(["data: [DONE]\n\n".to_owned()])
            .collect();
        return (
            StatusCode::OK,
            [("content-type", "text/event-stream")],
            events,
        )
            .into_response();
    }
    let v = if path == "/generate" {
        json!({"text": format!("answer from {}", m.name), "meta_info": {"completion_tokens": 8}})
    } else {
        json!({"choices": [{"text": format!("answer from {}", m.name)}], "usage": {"completion_tokens": 8}})
    };
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        v.to_string(),
    )
        .into_response()
}

async fn handler(
    State(m): State<Arc<Mock>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let value: Value = serde_json::from_slice(&body).expect("forwarded JSON");
    let stream = value["stream"] == true;
    let all = headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    m.received
        .lock()
        .push((uri.path().to_owned(), all, value.clone()));
    let room = value["bootstrap_room"].as_u64();
    if m.name.starts_with('p') {
        // A prefill worker hands its KV over once the decode leg of its room shows up.
        if let Some(room) = room {
            let met = tokio::time::timeout(PARTNER_TIMEOUT, async {
                loop {
                    let changed = m.handshakes.changed.notified();
                    if m.handshakes.rooms.lock().contains(&room) {
                        return;
                    }
                    changed.await;
                }
            })
            .await;
            if met.is_err() {
                return (
                    StatusCode::GATEWAY_TIMEOUT,
                    [("content-type", "application/json")],
                    json!({"error": {"message": format!("bootstrap room {room}: the decode leg never came")}})
                        .to_string(),
                )
                    .into_response();
            }
        }
        return answer(&m, uri.path(), stream);
    }
    if m.handshakes.hang_next.swap(false, Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
    if let Some(room) = room {
        m.handshakes.rooms.lock().insert(room);
        m.handshakes.changed.notify_waiters();
    }
    answer(&m, uri.path(), stream)
}

async fn spawn_mock(name: &str, handshakes: &Arc<Handshakes>) -> (Arc<Mock>, SocketAddr) {
    let mock = Arc::new(Mock {
        name: name.to_owned(),
        received: Mutex::new(Vec::new()),
        handshakes: Arc::clone(handshakes),
    });
    let app = axum::Router::new()
        .route("/generate", post(handler))
        .route("/v1/completions", post(handler))
        .route("/v1/chat/completions", post(handler))
        .with_state(mock.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (mock, addr)
}

struct Front {
    cluster: Cluster,
    mocks: HashMap<u32, Arc<Mock>>,
    addrs: HashMap<u32, SocketAddr>,
    addr: SocketAddr,
}

const BOOTSTRAP_PORT: u16 = 9_100;

impl Front {
    async fn start(
        edit: impl FnOnce(&mut RouterConfig),
        options: impl FnOnce(&mut HttpOptions),
    ) -> Front {
        let cluster = Cluster::start(edit).await;
        let workers: Vec<(u32, WorkerRole)> = cluster
            .service()
            .config()
            .workers
            .iter()
            .map(|w| (w.id, w.role))
            .collect();
        let ids: Vec<u32> = workers.iter().map(|w| w.0).collect();
        cluster.wait_health(&ids, Health::Healthy).await;
        let handshakes = Arc::new(Handshakes::default());
        let (mut mocks, mut addrs) = (HashMap::new(), HashMap::new());
        let mut http = WorkerEndpoints::new();
        for (id, role) in workers {
            let name = format!("{}{id}", &role.to_string()[..1]);
            let (mock, addr) = spawn_mock(&name, &handshakes).await;
            let port = (role == WorkerRole::Prefill).then_some(BOOTSTRAP_PORT);
            http.insert(WorkerId(id), &format!("http://{addr}"), port)
                .unwrap();
            mocks.insert(id, mock);
            addrs.insert(id, addr);
        }
        let mut o = HttpOptions {
            request_timeout: Duration::from_secs(10),
            retry_backoff: Duration::from_millis(1),
            health_check_interval: None,
            ..HttpOptions::default()
        };
        options(&mut o);
        let app = http_app_with(cluster.service().clone(), http, o);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Front {
            cluster,
            mocks,
            addrs,
            addr,
        }
    }

    fn received(&self, id: u32) -> Vec<Received> {
        self.mocks[&id].received.lock().clone()
    }

    fn all_received(&self) -> Vec<(u32, Received)> {
        let mut ids: Vec<u32> = self.mocks.keys().copied().collect();
        ids.sort_unstable();
        ids.into_iter()
            .flat_map(|id| self.received(id).into_iter().map(move |r| (id, r)))
            .collect()
    }

    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> Reply {
        let (status, headers, text) =
            http_client::exchange(self.addr, path, headers, &body.to_string()).await;
        Reply {
            status,
            headers,
            text,
        }
    }

    async fn get(&self, method: &str, path: &str) -> Reply {
        raw_exchange(self.addr, method, path).await
    }

    /// Waits (bounded) until no decision awaits its outcome.
    async fn settle(&self) {
        for _ in 0..500 {
            if self.cluster.service().pending_decisions() == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("an outcome was never reported");
    }
}

struct Reply {
    status: u16,
    headers: HashMap<String, String>,
    text: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("{} is not JSON ({e}): {:?}", self.status, self.text))
    }

    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .unwrap_or_else(|| panic!("no {name} in {:?}", self.headers))
    }
}

/// One bounded request without a body over a fresh connection (`Connection: close`).
async fn raw_exchange(addr: SocketAddr, method: &str, path: &str) -> Reply {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.unwrap();
        buf
    };
    let raw = tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .expect("the front answered in time");
    let text = String::from_utf8(raw).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines.next().unwrap().split(' ').nth(1).unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Reply {
        status: status.parse().unwrap(),
        headers,
        text: body.to_owned(),
    }
}

fn ids(r: std::ops::Range<u32>) -> Value {
    Value::from(r.collect::<Vec<u32>>())
}

/// What a hostile client adds to every request: the fields that pair P with D, vLLM's KV
/// transfer parameters, and the router's own headers.
const FORGED_HEADERS: [(&str, &str); 4] = [
    ("x-kvc-mode", "direct-to-d"),
    ("x-kvc-session", "forged"),
    ("x-kvc-admission", "rejected"),
    ("x-kvc-decode-worker", "1"),
];

fn forge(mut body: Value) -> Value {
    let o = body.as_object_mut().unwrap();
    o.insert("bootstrap_host".into(), json!("169.254.169.254"));
    o.insert("bootstrap_port".into(), json!(80));
    o.insert("bootstrap_room".into(), json!(7));
    o.insert(
        "kv_transfer_params".into(),
        json!({"remote_host": "169.254.169.254", "remote_port": 80, "do_remote_prefill": true}),
    );
    body
}

/// Every request a worker received carries nothing of the client's forgeries: no
/// `kv_transfer_params`, no `x-kvc-*` header, and bootstrap fields only as the router set them
/// (P's host and bootstrap port, a room of its own, the same on P and D) on a P→D path.
fn assert_nothing_forged(f: &Front, what: &str) {
    let all = f.all_received();
    assert!(!all.is_empty(), "{what}: nothing was forwarded");
    for (id, (path, headers, body)) in &all {
        let o = body.as_object().unwrap();
        assert!(
            !o.contains_key("kv_transfer_params"),
            "{what}: worker {id} got kv_transfer_params on {path}: {body}"
        );
        for name in headers.keys() {
            assert!(
                !name.starts_with("x-kvc-"),
                "{what}: worker {id} got header {name}"
            );
        }
        match o.get("bootstrap_room") {
            None => {
                assert!(
                    !o.contains_key("bootstrap_host") && !o.contains_key("bootstrap_port"),
                    "{what}: worker {id} got client bootstrap fields: {body}"
                );
            }
            Some(room) => {
                assert_ne!(room, &json!(7), "{what}: worker {id} got the client's room");
                assert_eq!(o["bootstrap_host"], json!("127.0.0.1"), "{what}: {body}");
                assert_eq!(o["bootstrap_port"], json!(BOOTSTRAP_PORT), "{what}: {body}");
                // The same room went to the prefill worker.
                let p_rooms: Vec<Value> = f
                    .received(0)
                    .iter()
                    .map(|r| r.2["bootstrap_room"].clone())
                    .collect();
                assert!(p_rooms.contains(room), "{what}: room {room} unknown to P");
            }
        }
    }
}

#[tokio::test]
async fn router_only_fields_never_reach_a_worker_on_any_path() {
    let f = Front::start(|_| {}, |_| {}).await;
    let words: Vec<String> = (0..1_900).map(|i| format!("w{i}")).collect();
    for stream in [false, true] {
        let key = format!("forger-{stream}");
        let mut headers: Vec<(&str, &str)> = FORGED_HEADERS.to_vec();
        headers.push(("x-session-id", key.as_str()));
        // /generate: turn 1 goes P→D, turn 2 (the prompt extended) direct to D.
        let turn = |n: u32| {
            forge(
                json!({"input_ids": ids(n * 1_000..n * 1_000 + 1_300), "stream": stream,
                        "sampling_params": {"max_new_tokens": 8}}),
            )
        };
        let r = f.post("/generate", &headers, &turn(1)).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
        f.settle().await;
        let extended = forge(json!({"input_ids": ids(1_000..2_900), "stream": stream,
                                    "sampling_params": {"max_new_tokens": 8}}));
        let r = f.post("/generate", &headers, &extended).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.header("x-kvc-mode"), "direct-to-d", "stream {stream}");
        f.settle().await;
        // The OpenAI APIs, both paths.
        let key2 = format!("openai-{stream}");
        let mut headers2: Vec<(&str, &str)> = FORGED_HEADERS.to_vec();
        headers2.push(("x-session-id", key2.as_str()));
        for n in [1_300, 1_900] {
            let body =
                forge(json!({"prompt": words[..n].join(" "), "stream": stream, "max_tokens": 8}));
            let r = f.post("/v1/completions", &headers2, &body).await;
            assert_eq!(r.status, 200, "{}", r.text);
            f.settle().await;
        }
        let r = f
            .post(
                "/v1/completions",
                &headers2,
                &forge(json!({"prompt": "x", "stream": stream})),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        f.settle().await;
        let chat = forge(
            json!({"messages": [{"role": "user", "content": words[..1_300].join(" ")}],
                                "stream": stream}),
        );
        let r = f
            .post(
                "/v1/chat/completions",
                &[("x-kvc-session", "forged")],
                &chat,
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        f.settle().await;
    }
    assert_nothing_forged(&f, "P/D cluster");
    let d_direct = f
        .all_received()
        .iter()
        .filter(|(id, r)| *id != 0 && r.2.get("bootstrap_room").is_none())
        .count();
    assert!(d_direct >= 2, "direct-to-D turns were exercised");
}

#[tokio::test]
async fn router_only_fields_never_reach_a_colocated_worker() {
    let f = Front::start(
        |cfg| {
            for w in &mut cfg.workers {
                w.role = WorkerRole::Colocated;
            }
            cfg.policy = PolicyConfig::from_name("cache-aware").unwrap();
        },
        |_| {},
    )
    .await;
    for stream in [false, true] {
        let r = f
            .post(
                "/generate",
                &FORGED_HEADERS,
                &forge(json!({"input_ids": ids(0..300), "stream": stream})),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.header("x-kvc-mode"), "colocated");
        let r = f
            .post(
                "/v1/chat/completions",
                &FORGED_HEADERS,
                &forge(json!({"messages": [{"role": "user", "content": "hi"}], "stream": stream})),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    f.settle().await;
    assert_nothing_forged(&f, "colocated cluster");
}

#[tokio::test]
async fn over_long_session_ids_are_refused_and_never_kept() {
    let f = Front::start(|_| {}, |_| {}).await;
    let long = "s".repeat(257);
    let body = json!({"input_ids": ids(0..300)});
    let refusals = [
        f.post("/generate", &[("x-session-id", long.as_str())], &body)
            .await,
        f.post(
            "/generate",
            &[],
            &json!({"input_ids": ids(0..300), "session_params": {"id": long}}),
        )
        .await,
        f.post(
            "/v1/completions",
            &[("x-session-id", long.as_str())],
            &json!({"prompt": "a b c"}),
        )
        .await,
    ];
    for r in refusals {
        assert_eq!(r.status, 400, "{}", r.text);
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("256 bytes"), "{message}");
        assert!(message.contains("max-session-id-bytes"), "{message}");
        assert!(!r.text.contains(&long), "the id is not echoed");
        assert!(!r.headers.contains_key("x-kvc-session"));
    }
    assert!(f.all_received().is_empty(), "nothing was forwarded");
    assert_eq!(f.cluster.service().session_count(), 0, "nothing was stored");
    // At the limit it is a session like any other.
    let exact = "s".repeat(256);
    let r = f
        .post("/generate", &[("x-session-id", exact.as_str())], &body)
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.header("x-kvc-session"), exact);
}

/// One P (id 0) and two D; the first decode worker to get a request never answers it, and P
/// answers 504 when its partner never comes. The request ends on the other D, through the
/// same P; the silent D is blamed (its breaker opens at one failure), P is not.
async fn silent_decode_worker_is_blamed(stream: bool) {
    let f = Front::start(|_| {}, |o| o.breaker.failure_threshold = 1).await;
    f.mocks[&1]
        .handshakes
        .hang_next
        .store(true, Ordering::SeqCst);
    let body = json!({"input_ids": ids(0..1_300), "stream": stream});
    let r = f
        .post("/generate", &[("x-session-id", "agent-1")], &body)
        .await;
    assert_eq!(r.status, 200, "stream {stream}: {}", r.text);
    assert_eq!(r.header("x-kvc-prefill-worker"), "0");
    let answered: u32 = r.header("x-kvc-decode-worker").parse().unwrap();
    let silent = 3 - answered;
    assert_eq!(
        f.received(silent).len(),
        1,
        "the silent D got the first attempt"
    );
    assert_eq!(
        f.received(0).len(),
        2,
        "both attempts went through the one P"
    );
    f.settle().await;
    let m = f.cluster.service().metrics();
    assert_eq!(m.breaker_state(WorkerId(silent)), Some(BreakerState::Open));
    assert_ne!(m.breaker_state(WorkerId(0)), Some(BreakerState::Open));
    assert!(!f.cluster.service().is_http_down(WorkerId(0)));
    assert_eq!(
        f.received(silent)[0].2["bootstrap_port"],
        json!(BOOTSTRAP_PORT)
    );
    let _ = &f.addrs;
}

#[tokio::test]
async fn a_silent_decode_worker_is_blamed_not_its_prefill_worker() {
    silent_decode_worker_is_blamed(false).await;
}

#[tokio::test]
async fn a_silent_decode_worker_is_blamed_on_a_stream_too() {
    silent_decode_worker_is_blamed(true).await;
}

#[tokio::test]
async fn health_is_readiness_and_liveness_is_separate() {
    let f = Front::start(|_| {}, |_| {}).await;
    let r = f.get("GET", "/health").await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["status"], "ok");
    let r = f.get("GET", "/readyz").await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = f.get("GET", "/livez").await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["status"], "ok");

    // The prefill worker goes stale: the decode workers are healthy, but no new session
    // can be routed (a first turn needs P).
    let mut c = f.cluster;
    c.clock.advance(common::STALE_MS + 500);
    c.heartbeat(&[1, 2]);
    c.wait_health(&[0], Health::Stale).await;
    c.wait_health(&[1, 2], Health::Healthy).await;
    let f = Front { cluster: c, ..f };
    for path in ["/health", "/readyz"] {
        let r = f.get("GET", path).await;
        assert_eq!(r.status, 503, "{path}: {}", r.text);
        let v = r.json();
        assert_eq!(v["error"]["type"], "unavailable");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("prefill"), "{path}: {message}");
    }
    let r = f.get("GET", "/livez").await;
    assert_eq!(r.status, 200, "liveness does not depend on the workers");
    // And indeed nothing routes.
    let r = f
        .post(
            "/generate",
            &[("x-session-id", "s")],
            &json!({"input_ids": ids(0..300)}),
        )
        .await;
    assert_eq!(r.status, 503, "{}", r.text);
}

#[tokio::test]
async fn unknown_paths_and_methods_get_json_errors() {
    let f = Front::start(|_| {}, |_| {}).await;
    for (method, path, status) in [
        ("GET", "/nowhere", 404),
        ("POST", "/v2/generate", 404),
        ("GET", "/generate", 405),
        ("DELETE", "/v1/chat/completions", 405),
        ("POST", "/health", 405),
    ] {
        let r = f.get(method, path).await;
        assert_eq!(r.status, status, "{method} {path}: {}", r.text);
        let v = r.json();
        assert_eq!(v["error"]["code"], status, "{method} {path}");
        assert!(v["error"]["message"].is_string(), "{method} {path}");
    }
}
