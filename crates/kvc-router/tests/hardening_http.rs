//! The HTTP front against hostile or unlucky input: fields only the router may set never reach
//! a worker from the client, session ids are bounded, a silent decode worker is blamed for its
//! own silence, health says what routing can do, and every error the front answers is JSON.
//! In-process mock workers record everything they receive.

mod common;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use common::front::{
    self, Recording, answer_body, error_response, ids, json_response, sse_response, worker_routes,
};
use kvc_core::{Health, WorkerId, WorkerRole};
use kvc_policy::PolicyConfig;
use kvc_router::RouterConfig;
use kvc_router::http::{BreakerState, HttpOptions};
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
/// a prefill mock waits for its room to appear here, or in `abandoned`.
#[derive(Default)]
struct Handshakes {
    rooms: Mutex<HashSet<u64>>,
    /// Rooms whose decode leg reached a decode worker that never answers: no handshake
    /// will come.
    abandoned: Mutex<HashSet<u64>>,
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
/// engine whose bootstrap room expired: long enough never to fire on a loaded machine (a
/// partner known never to come is answered 504 at once).
const PARTNER_TIMEOUT: Duration = Duration::from_secs(20);

impl Recording for Mock {
    type Request = Received;

    fn requests(&self) -> &Mutex<Vec<Received>> {
        &self.received
    }
}

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
        return sse_response(events);
    }
    json_response(StatusCode::OK, &answer_body(&m.name, path, 8))
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
        // A prefill worker hands its KV over once the decode leg of its room shows up; its
        // room expires when that leg went to a decode worker that never answers.
        if let Some(room) = room {
            let met = tokio::time::timeout(PARTNER_TIMEOUT, async {
                loop {
                    let changed = m.handshakes.changed.notified();
                    if m.handshakes.rooms.lock().contains(&room) {
                        return true;
                    }
                    if m.handshakes.abandoned.lock().contains(&room) {
                        return false;
                    }
                    changed.await;
                }
            })
            .await;
            if !matches!(met, Ok(true)) {
                return error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("bootstrap room {room}: the decode leg never came"),
                );
            }
        }
        return answer(&m, uri.path(), stream);
    }
    if m.handshakes.hang_next.swap(false, Ordering::SeqCst) {
        if let Some(room) = room {
            m.handshakes.abandoned.lock().insert(room);
            m.handshakes.changed.notify_waiters();
        }
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
    let addr = front::serve(worker_routes(handler).with_state(mock.clone())).await;
    (mock, addr)
}

type Front = front::Front<Mock>;

const BOOTSTRAP_PORT: u16 = 9_100;

/// A router over the cluster `edit` makes of the default P0, D1, D2 (snapshot workers), each
/// worker with a mock HTTP server (prefill mocks wait for their decode partner), and its HTTP
/// front with `options`.
async fn start(
    edit: impl FnOnce(&mut RouterConfig),
    options: impl FnOnce(&mut HttpOptions),
) -> Front {
    let handshakes = Arc::new(Handshakes::default());
    // Only guards against a hang: longer than a prefill mock's wait for its partner.
    let mut o = front::options(Duration::from_secs(30));
    options(&mut o);
    let port = |_, role| (role == WorkerRole::Prefill).then_some(BOOTSTRAP_PORT);
    let spawn = async |name: &str| spawn_mock(name, &handshakes).await;
    Front::start(edit, spawn, port, |_| {}, o).await
}

impl Front {
    fn all_received(&self) -> Vec<(u32, Received)> {
        let mut ids: Vec<u32> = self.mocks.keys().copied().collect();
        ids.sort_unstable();
        ids.into_iter()
            .flat_map(|id| self.received(id).into_iter().map(move |r| (id, r)))
            .collect()
    }
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
    let f = start(|_| {}, |_| {}).await;
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
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
        f.settle().await;
        let extended = forge(json!({"input_ids": ids(1_000..2_900), "stream": stream,
                                    "sampling_params": {"max_new_tokens": 8}}));
        let r = f.post("/generate", &headers, &extended).await;
        assert_eq!(r.status, 200, "{}", r.body);
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
            assert_eq!(r.status, 200, "{}", r.body);
            f.settle().await;
        }
        let r = f
            .post(
                "/v1/completions",
                &headers2,
                &forge(json!({"prompt": "x", "stream": stream})),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
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
        assert_eq!(r.status, 200, "{}", r.body);
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
    let f = start(
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
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-kvc-mode"), "colocated");
        let r = f
            .post(
                "/v1/chat/completions",
                &FORGED_HEADERS,
                &forge(json!({"messages": [{"role": "user", "content": "hi"}], "stream": stream})),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    f.settle().await;
    assert_nothing_forged(&f, "colocated cluster");
}

#[tokio::test]
async fn over_long_session_ids_are_refused_and_never_kept() {
    let f = start(|_| {}, |_| {}).await;
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
        assert_eq!(r.status, 400, "{}", r.body);
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("256 bytes"), "{message}");
        assert!(message.contains("max-session-id-bytes"), "{message}");
        assert!(!r.body.contains(&long), "the id is not echoed");
        assert!(!r.headers.contains_key("x-kvc-session"));
    }
    assert!(f.all_received().is_empty(), "nothing was forwarded");
    assert_eq!(f.cluster.service().session_count(), 0, "nothing was stored");
    // At the limit it is a session like any other.
    let exact = "s".repeat(256);
    let r = f
        .post("/generate", &[("x-session-id", exact.as_str())], &body)
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-session"), exact);
}

/// One P (id 0) and two D; the first decode worker to get a request never answers it, and P
/// answers 504 when its partner never comes (at once: the silent D's mock tells it so). The
/// request ends on the other D, through the same P; the silent D is blamed (its breaker opens
/// at one failure), P is not.
async fn silent_decode_worker_is_blamed(stream: bool) {
    let f = start(|_| {}, |o| o.breaker.failure_threshold = 1).await;
    f.mocks[&1]
        .handshakes
        .hang_next
        .store(true, Ordering::SeqCst);
    let body = json!({"input_ids": ids(0..1_300), "stream": stream});
    let r = f
        .post("/generate", &[("x-session-id", "agent-1")], &body)
        .await;
    assert_eq!(r.status, 200, "stream {stream}: {}", r.body);
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
    let f = start(|_| {}, |_| {}).await;
    let r = f.get("GET", "/health").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["status"], "ok");
    let r = f.get("GET", "/readyz").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = f.get("GET", "/livez").await;
    assert_eq!(r.status, 200, "{}", r.body);
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
        assert_eq!(r.status, 503, "{path}: {}", r.body);
        let v = r.json();
        assert_eq!(v["error"]["type"], "unavailable");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("prefill"), "{path}: {message}");
    }
    let r = f.get("GET", "/livez").await;
    assert_eq!(r.status, 200, "liveness does not depend on the workers");
    // A request that comes all the same is routed on P's last known state (a late publisher
    // is not a dead worker), and counted.
    let r = f
        .post(
            "/generate",
            &[("x-session-id", "s")],
            &json!({"input_ids": ids(0..300)}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-prefill-worker"), "0");
    assert_eq!(f.metric("kvc_router_stale_routed_total", &[]), 1.0);
}

#[tokio::test]
async fn unknown_paths_and_methods_get_json_errors() {
    let f = start(|_| {}, |_| {}).await;
    for (method, path, status) in [
        ("GET", "/nowhere", 404),
        ("POST", "/v2/generate", 404),
        ("GET", "/generate", 405),
        ("DELETE", "/v1/chat/completions", 405),
        ("POST", "/health", 405),
    ] {
        let r = f.get(method, path).await;
        assert_eq!(r.status, status, "{method} {path}: {}", r.body);
        let v = r.json();
        assert_eq!(v["error"]["code"], status, "{method} {path}");
        assert!(v["error"]["message"].is_string(), "{method} {path}");
    }
}

#[tokio::test]
async fn a_clients_trace_context_reaches_every_worker_and_a_bad_one_none() {
    let f = start(|_| {}, |_| {}).await;
    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let headers = [
        ("x-session-id", "traced"),
        ("traceparent", PARENT),
        ("tracestate", "vendor=abc"),
    ];
    let body = json!({"input_ids": ids(0..1_300), "sampling_params": {"max_new_tokens": 8}});
    let r = f.post("/generate", &headers, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    f.settle().await;
    // P and D both got the client's trace context, as it came.
    let all = f.all_received();
    assert_eq!(
        all.iter().map(|(id, _)| *id).filter(|id| *id == 0).count(),
        1
    );
    assert!(all.len() >= 2, "{all:?}");
    for (id, (_, h, _)) in &all {
        assert_eq!(
            h.get("traceparent").map(String::as_str),
            Some(PARENT),
            "worker {id}"
        );
        assert_eq!(h.get("tracestate").map(String::as_str), Some("vendor=abc"));
    }
    let seen = all.len();
    // Not W3C's form (uppercase hex, an all-zero trace id, too short, version ff): dropped,
    // the tracestate with it.
    for (i, bad) in [
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("untraced-{i}");
        let headers = [
            ("x-session-id", key.as_str()),
            ("traceparent", bad),
            ("tracestate", "vendor=abc"),
        ];
        let body = json!({"input_ids": ids(10_000 * (i as u32 + 1)..10_000 * (i as u32 + 1) + 1_300),
                          "sampling_params": {"max_new_tokens": 8}});
        let r = f.post("/generate", &headers, &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        f.settle().await;
    }
    let all = f.all_received();
    assert!(all.len() > seen);
    let untraced: Vec<_> = all
        .iter()
        .filter(|(_, (_, h, _))| {
            h.get("x-session-id")
                .is_some_and(|k| k.starts_with("untraced"))
        })
        .collect();
    assert!(untraced.len() >= 4, "{}", untraced.len());
    for (id, (_, h, _)) in untraced {
        assert!(
            !h.contains_key("traceparent") && !h.contains_key("tracestate"),
            "worker {id}: {h:?}"
        );
    }
}
