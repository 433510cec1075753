//! The HTTP front's session continuation, engines without decode-side append-prefill, admission
//! refusals by D, session inference, tokenizer files, and prefill failures, end to end against
//! in-process mock workers (snapshot workers on a manual clock give the router its state).

mod common;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use common::TempDir;
use common::front::{
    self, Recording, answer_body, error_response, ids, json_response, sse_response, worker_routes,
};
use kvc_core::{WorkerId, WorkerRole};
use kvc_router::http::{BreakerState, HttpOptions, Tokenizer};
use kvc_router::{RouterConfig, WorkerConfig};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// What a mock worker does with a request.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Act {
    /// Answers at once (JSON, or SSE events when `stream` is set).
    Answer,
    /// Answers 500 after this many milliseconds.
    FailAfter(u64),
    /// Answers 500 once the test releases it (`Mock::release`).
    FailWhenReleased,
    /// Answers this status at once, with a JSON error.
    Status(u16),
    /// Every request gets `503` with `x-kvc-admission: rejected`.
    RejectAll,
    /// A request without bootstrap fields (a direct-to-D turn) gets `503` with
    /// `x-kvc-admission: rejected`; others are answered.
    RejectDirect,
    /// A request whose `bootstrap_port` is this one waits for KV that never comes (no answer;
    /// streamed: a head, then nothing); others are answered.
    HangWith(u16),
}

/// One request a mock worker received: its path, its `x-session-id` and `x-conversation`
/// headers, its body.
type Received = (String, HashMap<String, String>, Value);

struct Mock {
    name: String,
    act: Mutex<Act>,
    received: Mutex<Vec<Received>>,
    /// What `Act::FailWhenReleased` waits for (a permit, so it may come first).
    release: tokio::sync::Notify,
}

impl Recording for Mock {
    type Request = Received;

    fn requests(&self) -> &Mutex<Vec<Received>> {
        &self.received
    }
}

fn sse(name: &str) -> Vec<String> {
    let mut events: Vec<String> = (0..3u64)
        .map(|i| {
            let v = json!({"text": format!("{name} tok{i}"), "meta_info": {"completion_tokens": i + 1}});
            format!("data: {v}\n\n")
        })
        .collect();
    events.push("data: [DONE]\n\n".to_owned());
    events
}

fn answer(m: &Mock, path: &str, stream: bool) -> Response {
    if stream {
        return sse_response(sse(&m.name).concat());
    }
    json_response(StatusCode::OK, &answer_body(&m.name, path, 8))
}

/// A decode worker's admission refusal.
fn refusal() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [
            ("content-type", "application/json"),
            ("x-kvc-admission", "rejected"),
        ],
        json!({"error": {"message": "no room for the session", "type": "admission"}}).to_string(),
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
    let kept = ["x-session-id", "x-conversation"]
        .iter()
        .filter_map(|h| {
            headers
                .get(*h)
                .map(|v| (h.to_string(), v.to_str().unwrap().to_owned()))
        })
        .collect();
    m.received
        .lock()
        .push((uri.path().to_owned(), kept, value.clone()));
    let act = *m.act.lock();
    match act {
        Act::Answer => answer(&m, uri.path(), stream),
        Act::FailAfter(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{} failed", m.name),
            )
        }
        Act::FailWhenReleased => {
            m.release.notified().await;
            error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{} failed", m.name),
            )
        }
        Act::Status(status) => error_response(
            StatusCode::from_u16(status).unwrap(),
            format!("{} says {status}", m.name),
        ),
        Act::RejectAll => refusal(),
        Act::RejectDirect if value.get("bootstrap_room").is_none() => refusal(),
        Act::HangWith(port) if value["bootstrap_port"] == port => {
            if stream {
                let forever = futures_pending_stream();
                return (
                    StatusCode::OK,
                    [("content-type", "text/event-stream")],
                    axum::body::Body::from_stream(forever),
                )
                    .into_response();
            }
            std::future::pending::<()>().await;
            unreachable!()
        }
        Act::RejectDirect | Act::HangWith(_) => answer(&m, uri.path(), stream),
    }
}

/// A body stream that never yields.
fn futures_pending_stream() -> tokio_stream::wrappers::ReceiverStream<Result<Bytes, std::io::Error>>
{
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    // Kept open (never sends) until the connection is dropped.
    tokio::spawn(async move {
        tx.closed().await;
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

async fn spawn_mock(name: &str) -> (Arc<Mock>, SocketAddr) {
    let mock = Arc::new(Mock {
        name: name.to_owned(),
        act: Mutex::new(Act::Answer),
        received: Mutex::new(Vec::new()),
        release: tokio::sync::Notify::new(),
    });
    let addr = front::serve(worker_routes(handler).with_state(mock.clone())).await;
    (mock, addr)
}

/// A bootstrap port per prefill worker id.
fn bootstrap_port(id: u32) -> u16 {
    9_000 + id as u16
}

type Front = front::Front<Mock>;

/// A router over the cluster `edit` makes of the default P0, D1, D2 (snapshot workers), each
/// worker with a mock HTTP server, and its HTTP front with `options`.
async fn start(
    edit: impl FnOnce(&mut RouterConfig),
    options: impl FnOnce(&mut HttpOptions),
) -> Front {
    // Only guards against a hang: no test here waits for it.
    let mut o = front::options(Duration::from_secs(30));
    options(&mut o);
    let port = |id, role| (role == WorkerRole::Prefill).then(|| bootstrap_port(id));
    Front::start(edit, spawn_mock, port, |_| {}, o).await
}

impl Front {
    fn act(&self, id: u32, act: Act) {
        *self.mocks[&id].act.lock() = act;
    }
}

fn generate(tokens: std::ops::Range<u32>) -> Value {
    json!({"input_ids": ids(tokens), "sampling_params": {"max_new_tokens": 8}})
}

/// One prefill and one decode worker (P0, D1).
fn one_p_one_d(cfg: &mut RouterConfig) {
    cfg.workers.truncate(2);
}

#[tokio::test]
async fn direct_turns_carry_the_session_to_the_decode_worker() {
    let f = start(one_p_one_d, |_| {}).await;
    let session = [("x-session-id", "agent-1")];
    let r = f.post("/generate", &session, &generate(0..1_300)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    assert_eq!(r.header("x-kvc-session"), "agent-1");
    // Both halves of the P→D path get the session header; the body is the client's.
    for id in [0, 1] {
        let (_, headers, body) = &f.received(id)[0];
        assert_eq!(headers["x-session-id"], "agent-1", "worker {id}");
        assert!(body.get("session_params").is_none(), "worker {id}");
    }
    let r = f.post("/generate", &session, &generate(0..1_900)).await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    let (_, headers, body) = &f.received(1)[1];
    assert_eq!(headers["x-session-id"], "agent-1");
    assert_eq!(body["session_params"], json!({"id": "agent-1"}));
    assert_eq!(body["input_ids"], ids(0..1_900));
    assert!(body.get("bootstrap_room").is_none());

    // `session_params` sent by the client is kept as it is (and names the session).
    let mut own = generate(0..2_400);
    own["session_params"] = json!({"id": "agent-1", "rid": "r-7"});
    let r = f.post("/generate", &[], &own).await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    let (_, headers, body) = &f.received(1)[2];
    assert_eq!(
        body["session_params"],
        json!({"id": "agent-1", "rid": "r-7"})
    );
    assert_eq!(headers["x-session-id"], "agent-1");

    // OpenAI APIs: the header, no `session_params`.
    let chat = |n: u32| {
        let words: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
        json!({"messages": [{"role": "user", "content": words.join(" ")}], "max_tokens": 8})
    };
    let s2 = [("x-session-id", "chat-2")];
    f.post("/v1/chat/completions", &s2, &chat(1_300)).await;
    let r = f.post("/v1/chat/completions", &s2, &chat(1_900)).await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    let (path, headers, body) = f.received(1).pop().unwrap();
    assert_eq!(path, "/v1/chat/completions");
    assert_eq!(headers["x-session-id"], "chat-2");
    assert!(body.get("session_params").is_none());
    assert_eq!(
        f.received_at_least(0, 2).await.len(),
        2,
        "P saw the two first turns only"
    );
}

#[tokio::test]
async fn the_session_header_is_forwarded_under_its_configured_name() {
    let f = start(one_p_one_d, |o| {
        o.session_header = "x-conversation".to_owned();
        o.session_headers = vec!["x-conversation".to_owned()];
    })
    .await;
    let h = [("x-conversation", "c-9")];
    f.post("/v1/completions", &h, &json!({"prompt": "hello there"}))
        .await;
    for id in [0, 1] {
        let (_, headers, _) = &f.received(id)[0];
        assert_eq!(
            headers.get("x-conversation").map(String::as_str),
            Some("c-9")
        );
        assert!(!headers.contains_key("x-session-id"));
    }
    // Without a session, no header.
    f.post("/v1/completions", &[], &json!({"prompt": "one off"}))
        .await;
    assert!(f.received(1)[1].1.is_empty());
}

/// `n` distinct words, `<tag>0 <tag>1 …`.
fn words(tag: &str, n: u32) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A chat body whose one user message is `n` words.
fn chat_words(n: u32) -> Value {
    json!({"messages": [{"role": "user", "content": words("w", n)}], "max_tokens": 8})
}

#[tokio::test]
async fn the_coding_agents_session_headers_name_sessions() {
    let f = start(one_p_one_d, |_| {}).await;
    // Each agent's own header(s), as its client sends them: two turns of one session, the
    // second direct to D, and the key forwarded to the workers as `x-session-id`.
    let agents: [(&str, &[(&str, &str)]); 4] = [
        ("claude-code", &[("X-Claude-Code-Session-Id", "cc-1")]),
        (
            "codex",
            &[("session-id", "cx-1"), ("thread-id", "cx-thread-1")],
        ),
        ("codex-old", &[("session_id", "cx-old")]),
        (
            "opencode",
            &[("x-session-affinity", "ses_1"), ("X-Session-Id", "ses_1")],
        ),
    ];
    for (k, (agent, headers)) in agents.iter().enumerate() {
        let offset = 10_000 * (k as u32 + 1);
        let body = |n: u32| {
            let words: Vec<String> = (0..n).map(|i| format!("{agent}{}", offset + i)).collect();
            json!({"messages": [{"role": "user", "content": words.join(" ")}], "max_tokens": 8})
        };
        let r = f.post("/v1/chat/completions", headers, &body(1_300)).await;
        assert_eq!(r.status, 200, "{agent}: {}", r.body);
        assert_eq!(r.header("x-kvc-mode"), "turn1-seed", "{agent}");
        let r = f.post("/v1/chat/completions", headers, &body(1_900)).await;
        assert_eq!(r.header("x-kvc-mode"), "direct-to-d", "{agent}");
        let expected = match *agent {
            // The conversation thread, ahead of the session it belongs to.
            "codex" => "cx-thread-1",
            _ => headers[0].1,
        };
        assert_eq!(r.header("x-kvc-session"), expected, "{agent}");
        let (_, sent, _) = f.received(1).pop().unwrap();
        assert_eq!(sent["x-session-id"], expected, "{agent}");
    }
    let m = f.cluster.service().metrics();
    for (source, n) in [
        ("x-claude-code-session-id", 2),
        ("thread-id", 2),
        ("session_id", 2),
        ("x-session-id", 2),
        ("session-id", 0),
        ("x-session-affinity", 0),
    ] {
        assert_eq!(m.session_keys(source), n, "{source}");
    }
    // Every configured source is exported, from the start.
    let keys = |source| f.metric("kvc_router_http_session_keys_total", &[("source", source)]);
    assert_eq!(keys("session-id"), 0.0);
    assert_eq!(keys("x-claude-code-session-id"), 2.0);
}

#[tokio::test]
async fn a_claude_code_subagent_is_a_session_of_its_own() {
    let f = start(one_p_one_d, |_| {}).await;
    let parent = [("x-claude-code-session-id", "cc-9")];
    let child = [
        ("x-claude-code-session-id", "cc-9"),
        ("x-claude-code-agent-id", "explore-1"),
    ];
    let r = f
        .post("/v1/chat/completions", &parent, &chat_words(1_300))
        .await;
    assert_eq!(r.header("x-kvc-session"), "cc-9");
    // The subagent's conversation is not its parent's: a first turn of its own session.
    let other: Vec<String> = (0..1_300).map(|i| format!("sub{i}")).collect();
    let sub = |extra: u32| {
        let mut words = other.clone();
        words.extend((0..extra).map(|i| format!("more{i}")));
        json!({"messages": [{"role": "user", "content": words.join(" ")}], "max_tokens": 8})
    };
    let r = f.post("/v1/chat/completions", &child, &sub(0)).await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    assert_eq!(r.header("x-kvc-session"), "cc-9/agent/explore-1");
    let r = f.post("/v1/chat/completions", &child, &sub(600)).await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    // The parent's next turn is still its own session's later turn.
    let r = f
        .post("/v1/chat/completions", &parent, &chat_words(1_900))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    assert_eq!(r.header("x-kvc-session"), "cc-9");
}

#[tokio::test]
async fn session_headers_are_read_in_their_configured_order() {
    let f = start(one_p_one_d, |o| {
        o.session_headers = vec!["x-b".to_owned(), "x-a".to_owned()];
        o.agent_headers = Vec::new();
    })
    .await;
    let both = [("x-a", "from-a"), ("x-b", "from-b")];
    let r = f
        .post("/v1/chat/completions", &both, &chat_words(1_300))
        .await;
    assert_eq!(r.header("x-kvc-session"), "from-b");
    let r = f
        .post(
            "/v1/chat/completions",
            &[("x-a", "from-a")],
            &chat_words(1_300),
        )
        .await;
    assert_eq!(r.header("x-kvc-session"), "from-a");
    // A header the list does not name names nothing; the body's `session_params` comes after
    // every header.
    let r = f
        .post(
            "/v1/completions",
            &[("x-session-id", "ignored")],
            &json!({"prompt": "one off"}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.find_header("x-kvc-session"), None);
    let mut body = generate(0..1_300);
    body["session_params"] = json!({"id": "from-body"});
    let r = f.post("/generate", &[("x-a", "from-a")], &body).await;
    assert_eq!(r.header("x-kvc-session"), "from-a");
    let r = f.post("/generate", &[], &body).await;
    assert_eq!(r.header("x-kvc-session"), "from-body");
    assert_eq!(
        f.cluster.service().metrics().session_keys("session_params"),
        1
    );
    // An empty header is refused, naming it; so is an agent id past the limit.
    let r = f
        .post("/v1/completions", &[("x-b", " ")], &json!({"prompt": "hi"}))
        .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("`x-b`"), "{}", r.body);
}

#[tokio::test]
async fn an_agent_id_is_bounded_like_a_session_id() {
    let f = start(one_p_one_d, |o| o.max_session_id_bytes = 16).await;
    let long = "a".repeat(17);
    let h = [
        ("x-claude-code-session-id", "cc-1"),
        ("x-claude-code-agent-id", long.as_str()),
    ];
    let r = f
        .post("/v1/completions", &h, &json!({"prompt": "hi"}))
        .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("x-claude-code-agent-id"), "{}", r.body);
    assert!(r.body.contains("16 bytes"), "{}", r.body);
    assert_eq!(f.count(0) + f.count(1), 0, "nothing forwarded");
}

#[tokio::test]
async fn a_decode_worker_without_append_prefill_gets_every_turn_through_p() {
    let f = start(
        |cfg| {
            one_p_one_d(cfg);
            cfg.workers[1].append_prefill = Some(false);
        },
        |_| {},
    )
    .await;
    let session = [("x-session-id", "agent-2")];
    let r = f.post("/generate", &session, &generate(0..1_300)).await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    for (turn, n) in [(2, 1_900), (3, 2_500)] {
        let r = f.post("/generate", &session, &generate(0..n)).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-kvc-mode"), "fallback", "turn {turn}");
        assert_eq!(r.header("x-kvc-reason"), "direct-unsupported");
        assert_eq!(r.header("x-kvc-prefill-worker"), "0");
        assert_eq!(r.header("x-kvc-decode-worker"), "1");
        assert_eq!(
            (f.count(0), f.count(1)),
            (turn, turn),
            "P and D, never D alone"
        );
        // A P→D turn: bootstrap fields, no continuation parameters.
        let (_, _, body) = f.received(1).pop().unwrap();
        assert!(body["bootstrap_room"].is_u64());
        assert!(body.get("session_params").is_none());
    }
    assert_eq!(
        f.metric(
            "kvc_router_decisions_total",
            &[("mode", "fallback"), ("reason", "direct-unsupported")]
        ),
        2.0
    );
    assert_eq!(
        f.metric(
            "kvc_router_decisions_total",
            &[("mode", "direct-to-d"), ("reason", "none")]
        ),
        0.0
    );
    assert_eq!(f.outcomes("ok"), 3.0);
}

#[tokio::test]
async fn an_admission_refusal_by_d_is_routed_again_through_p() {
    let f = start(
        |_| {},
        |o| {
            // One failure would open a breaker: the refusals must not count.
            o.breaker.failure_threshold = 1;
            o.max_retries = 0;
        },
    )
    .await;
    let session = [("x-session-id", "agent-3")];
    let r = f.post("/generate", &session, &generate(0..1_300)).await;
    let d: u32 = r.header("x-kvc-decode-worker").parse().unwrap();
    f.act(d, Act::RejectDirect);
    let r = f.post("/generate", &session, &generate(0..1_900)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["text"], format!("answer from d{d}"));
    assert_eq!(r.header("x-kvc-mode"), "fallback");
    assert_eq!(r.header("x-kvc-reason"), "session-cap-rejected");
    assert_eq!(
        r.header("x-kvc-decode-worker"),
        d.to_string(),
        "D is not excluded"
    );
    assert_eq!(r.header("x-kvc-prefill-worker"), "0");
    // D saw the refused direct turn, then the P→D one.
    let got = f.received(d);
    assert_eq!(got.len(), 3);
    assert!(got[1].2.get("bootstrap_room").is_none());
    assert!(got[2].2["bootstrap_room"].is_u64());
    assert_eq!(f.received_at_least(0, 2).await.len(), 2);
    let service = f.cluster.service();
    assert!(!service.is_http_down(WorkerId(d)));
    assert_ne!(
        service.metrics().breaker_state(WorkerId(d)),
        Some(BreakerState::Open)
    );
    assert_eq!(service.metrics().http_retries(), 0, "not a retry");
    assert_eq!(
        f.metric("kvc_router_http_admission_rejects_total", &[]),
        1.0
    );
    assert_eq!(f.outcomes("rejected"), 1.0);
    assert_eq!(f.outcomes("ok"), 2.0);
    assert_eq!(service.pending_decisions(), 0);

    // Streamed, the same: the refusal comes before any byte reaches the client.
    let mut body = generate(0..2_500);
    body["stream"] = json!(true);
    let r = f.post("/generate", &session, &body).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvc-mode"), "fallback");
    assert_eq!(r.body, sse(&format!("d{d}")).concat());
    f.settle().await;
    assert_eq!(
        f.metric("kvc_router_http_admission_rejects_total", &[]),
        2.0
    );
    assert_eq!(f.outcomes("rejected"), 2.0);
    assert_eq!(f.outcomes("ok"), 3.0);

    // A D that refuses every request: after the one re-route, its refusal is the answer.
    f.act(d, Act::Answer);
    let r = f.post("/generate", &session, &generate(0..3_100)).await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d", "resident again");
    assert_eq!(f.cluster.service().pending_decisions(), 0);
}

#[tokio::test]
async fn a_refusal_on_every_path_is_answered_without_looping() {
    let f = start(one_p_one_d, |o| o.max_retries = 0).await;
    let session = [("x-session-id", "agent-4")];
    f.post("/generate", &session, &generate(0..1_300)).await;
    // D refuses everything now, P→D included.
    f.act(1, Act::RejectAll);
    let r = f.post("/generate", &session, &generate(0..1_900)).await;
    // The direct turn was refused, then the P→D re-route: the refusal is the answer.
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["message"], "no room for the session");
    assert_eq!(r.header("x-kvc-mode"), "fallback");
    assert_eq!((f.received_at_least(0, 2).await.len(), f.count(1)), (2, 3));
    assert_eq!(
        f.metric("kvc_router_http_admission_rejects_total", &[]),
        2.0
    );
    assert_eq!(f.outcomes("rejected"), 2.0);
    let service = f.cluster.service();
    assert_eq!(service.metrics().http_retries(), 0);
    assert!(!service.is_http_down(WorkerId(1)));
    assert_eq!(service.pending_decisions(), 0);
    // With a retry left, a refusal on the P→D path is tried on another D.
    let f = start(|_| {}, |o| o.max_retries = 1).await;
    let r = f.post("/generate", &session, &generate(0..1_300)).await;
    let d: u32 = r.header("x-kvc-decode-worker").parse().unwrap();
    f.act(d, Act::RejectAll);
    let r = f.post("/generate", &session, &generate(0..1_900)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-decode-worker"), (3 - d).to_string());
    assert_eq!(f.cluster.service().metrics().http_retries(), 1);
    assert_eq!(
        f.metric("kvc_router_http_admission_rejects_total", &[]),
        2.0
    );
}

/// Token ids of a conversation: `shared` tokens of a common system prompt, then tokens of
/// its own, `n` in all.
fn conversation(c: u32, shared: u32, n: u32) -> Value {
    let tokens: Vec<u32> = (0..n)
        .map(|i| if i < shared { i } else { c * 100_000 + i })
        .collect();
    json!({"input_ids": tokens, "sampling_params": {"max_new_tokens": 8}})
}

#[tokio::test]
async fn keyless_conversations_are_told_apart_by_their_prefix() {
    let f = start(|_| {}, |_| {}).await;
    // Two conversations share a 2-block system prompt; turn 1 has 5 full blocks (of 512).
    let a1 = f
        .post("/generate", &[], &conversation(1, 1_024, 2_600))
        .await;
    let b1 = f
        .post("/generate", &[], &conversation(2, 1_024, 2_600))
        .await;
    for r in [&a1, &b1] {
        assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
        assert!(r.header("x-kvc-session").starts_with("kvc-inferred-"));
    }
    assert_ne!(a1.header("x-kvc-session"), b1.header("x-kvc-session"));
    let (da, db) = (
        a1.header("x-kvc-decode-worker"),
        b1.header("x-kvc-decode-worker"),
    );
    assert_ne!(
        da, db,
        "two active sessions are spread over the decode workers"
    );
    // Each turn 2 extends its own turn 1: direct to its own D, in its own session.
    let b2 = f
        .post("/generate", &[], &conversation(2, 1_024, 3_300))
        .await;
    let a2 = f
        .post("/generate", &[], &conversation(1, 1_024, 3_100))
        .await;
    for (t1, t2) in [(&a1, &a2), (&b1, &b2)] {
        assert_eq!(t2.status, 200);
        assert_eq!(t2.header("x-kvc-mode"), "direct-to-d");
        assert_eq!(
            t2.header("x-kvc-decode-worker"),
            t1.header("x-kvc-decode-worker")
        );
        assert_eq!(t2.header("x-kvc-session"), t1.header("x-kvc-session"));
    }
    // The direct turn carries the inferred session to D.
    let d: u32 = da.parse().unwrap();
    let (_, headers, body) = f.received(d).pop().unwrap();
    assert_eq!(body["session_params"]["id"], a1.header("x-kvc-session"));
    assert_eq!(headers["x-session-id"], a1.header("x-kvc-session"));
    // A third conversation sharing only the system prompt starts a session of its own.
    let c1 = f
        .post("/generate", &[], &conversation(3, 1_024, 2_600))
        .await;
    assert_eq!(c1.header("x-kvc-mode"), "turn1-seed");
    let sessions = [&a1, &b1, &c1].map(|r| r.header("x-kvc-session").to_owned());
    assert!(sessions[2] != sessions[0] && sessions[2] != sessions[1]);
    // Under one full block: routed without a session.
    let short = f.post("/generate", &[], &conversation(4, 100, 400)).await;
    assert!(!short.headers.contains_key("x-kvc-session"));
    // A short first prompt (two full blocks, the second inside the system prompt) anchors its
    // session all the same: the next request, which extends it, continues it.
    let e1 = f
        .post("/generate", &[], &conversation(5, 1_024, 1_300))
        .await;
    let e2 = f
        .post("/generate", &[], &conversation(5, 1_024, 1_700))
        .await;
    assert_eq!(e2.header("x-kvc-session"), e1.header("x-kvc-session"));
    assert_eq!(e2.header("x-kvc-mode"), "direct-to-d");
    // A system prompt of five full blocks, then a short first message of each conversation's
    // own (inside the sixth block): their last full blocks are the same, their whole prompts
    // are not, so they are two sessions.
    let g1 = f
        .post("/generate", &[], &conversation(6, 2_560, 2_700))
        .await;
    let h1 = f
        .post("/generate", &[], &conversation(7, 2_560, 2_700))
        .await;
    assert_ne!(g1.header("x-kvc-session"), h1.header("x-kvc-session"));
    assert_eq!(h1.header("x-kvc-mode"), "turn1-seed");
    let inferred = |result| {
        f.metric(
            "kvc_router_http_inferred_sessions_total",
            &[("result", result)],
        )
    };
    assert_eq!((inferred("new"), inferred("continued")), (6.0, 3.0));
}

/// A word-level `tokenizer.json` over `w0..w{n}` with a whitespace pre-tokenizer (which
/// splits punctuation off words); `[UNK]` is id 0.
fn word_tokenizer(dir: &TempDir, n: u32) -> std::path::PathBuf {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    vocab.insert(",".into(), 1.into());
    for i in 0..n {
        vocab.insert(format!("w{i}"), (i + 2).into());
    }
    let json = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    });
    let path = dir.0.join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    path
}

/// `n` words joined by commas and no spaces: one token for the whitespace fallback, `2n - 1`
/// for the word-level tokenizer.
fn comma_text(n: u32) -> String {
    (0..n)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[tokio::test]
async fn text_and_chat_prompts_go_through_the_tokenizer_file() {
    let dir = TempDir::new("tok");
    let tokenizer = Tokenizer::from_file(&word_tokenizer(&dir, 2_000)).unwrap();
    let with = start(one_p_one_d, |o| o.tokenizer = tokenizer.clone()).await;
    let without = start(one_p_one_d, |_| {}).await;
    // 1,100 words: 2,199 tokens (4 full blocks) with the file, 1 with the fallback.
    let chat =
        |n: u32| json!({"messages": [{"role": "user", "content": comma_text(n)}], "max_tokens": 8});
    for (path, body1, body2) in [
        (
            "/v1/completions",
            json!({"prompt": comma_text(1_100)}),
            json!({"prompt": comma_text(1_500)}),
        ),
        ("/v1/chat/completions", chat(1_100), chat(1_500)),
    ] {
        let r1 = with.post(path, &[], &body1).await;
        assert_eq!(r1.header("x-kvc-mode"), "turn1-seed", "{path}");
        let session = r1.header("x-kvc-session").to_owned();
        let r2 = with.post(path, &[], &body2).await;
        assert_eq!(r2.header("x-kvc-mode"), "direct-to-d", "{path}");
        assert_eq!(r2.header("x-kvc-session"), session, "{path}");
        // The whitespace fallback sees one token: no session to infer, turn 2 goes through P.
        let r1 = without.post(path, &[], &body1).await;
        assert!(!r1.headers.contains_key("x-kvc-session"), "{path}");
        let r2 = without.post(path, &[], &body2).await;
        assert_eq!(r2.header("x-kvc-mode"), "turn1-seed", "{path}");
    }
}

#[tokio::test]
async fn a_prefill_failure_after_d_answered_does_not_fail_the_request() {
    let f = start(one_p_one_d, |o| o.breaker.failure_threshold = 1).await;
    let service = f.cluster.service().clone();
    // P fails only once the client has D's answer.
    f.act(0, Act::FailWhenReleased);
    let session = [("x-session-id", "agent-6")];
    let r = f.post("/generate", &session, &generate(0..1_300)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["text"], "answer from d1");
    // D's whole answer arrived: `ok`, and the session is resident on D.
    assert_eq!(f.outcomes("ok"), 1.0);
    f.mocks[&0].release.notify_one();
    // P's failure still counts against P.
    f.wait_breaker(0, BreakerState::Open).await;
    assert!(service.is_http_down(WorkerId(0)));
    assert_eq!(
        service.metrics().breaker_state(WorkerId(1)),
        Some(BreakerState::Closed)
    );
    let r = f.post("/generate", &session, &generate(0..1_900)).await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");

    // Streamed: D's stream completes while P fails.
    let f = start(one_p_one_d, |o| o.breaker.failure_threshold = 1).await;
    f.act(0, Act::FailWhenReleased);
    let mut body = generate(0..1_300);
    body["stream"] = json!(true);
    let r = f.post("/generate", &session, &body).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, sse("d1").concat());
    f.mocks[&0].release.notify_one();
    f.settle().await;
    assert_eq!(f.outcomes("ok"), 1.0);
    f.wait_breaker(0, BreakerState::Open).await;
}

/// Adds a second prefill worker, id 3.
fn two_prefill(cfg: &mut RouterConfig) {
    let dir = cfg.workers[0]
        .snapshot
        .as_ref()
        .unwrap()
        .parent()
        .unwrap()
        .to_owned();
    cfg.workers.push(WorkerConfig {
        name: Some("p3".into()),
        snapshot: Some(dir.join("w3.snap")),
        ..WorkerConfig::new(3, WorkerRole::Prefill, common::CAPACITY)
    });
}

#[tokio::test]
async fn a_prefill_failure_before_d_answered_is_tried_again_without_p() {
    for stream in [false, true] {
        let f = start(two_prefill, |o| {
            o.breaker.failure_threshold = 1;
            o.max_retries = 1;
        })
        .await;
        let service = f.cluster.service().clone();
        // P0 answers 503 at once; any D paired with P0 waits for KV that never comes.
        f.act(0, Act::Status(503));
        for d in [1, 2] {
            f.act(d, Act::HangWith(bootstrap_port(0)));
        }
        let mut served = 0;
        for i in 0..16u32 {
            let mut body = generate(i * 10_000..i * 10_000 + 600);
            body["stream"] = json!(stream);
            let key = format!("s{i}");
            let r = f.post("/generate", &[("x-session-id", &key)], &body).await;
            served += 1;
            if f.count(0) == 0 {
                assert_eq!(r.header("x-kvc-prefill-worker"), "3");
                continue;
            }
            // P0 failed first: D's request was dropped, not waited for, and the request went
            // through P3 without excluding D.
            assert_eq!(r.status, 200, "stream {stream}: {}", r.body);
            assert_eq!(r.header("x-kvc-prefill-worker"), "3");
            let d: u32 = r.header("x-kvc-decode-worker").parse().unwrap();
            assert_ne!(
                service.metrics().breaker_state(WorkerId(d)),
                Some(BreakerState::Open),
                "stream {stream}"
            );
            break;
        }
        assert_eq!(f.count(0), 1, "stream {stream}: P0 was tried once");
        f.wait_breaker(0, BreakerState::Open).await;
        assert_eq!(service.metrics().http_retries(), 1);
        f.settle().await;
        assert_eq!(f.outcomes("worker-failed"), 1.0);
        assert_eq!(f.outcomes("ok"), f64::from(served));
    }
}

#[tokio::test]
async fn a_prefill_failure_before_d_answered_is_answered_when_not_retryable() {
    let f = start(one_p_one_d, |o| o.max_retries = 0).await;
    f.act(0, Act::FailAfter(0));
    f.act(1, Act::HangWith(bootstrap_port(0)));
    let session = [("x-session-id", "agent-8")];
    let r = f.post("/generate", &session, &generate(0..1_300)).await;
    // P's own answer (a 500), not a timeout of D's.
    assert_eq!(r.status, 500, "{}", r.body);
    assert_eq!(r.json()["error"]["message"], "p0 failed");
    assert_eq!(f.outcomes("worker-failed"), 1.0);
    assert_eq!(f.cluster.service().pending_decisions(), 0);
    // Nothing became resident: the next turn goes through P again.
    f.act(0, Act::Answer);
    f.act(1, Act::Answer);
    let r = f.post("/generate", &session, &generate(0..1_900)).await;
    assert_eq!(r.status, 200);
    assert_ne!(r.header("x-kvc-mode"), "direct-to-d");
}

#[tokio::test]
async fn headerless_chat_conversations_are_one_inferred_session() {
    let f = start(one_p_one_d, |_| {}).await;
    let sys = json!({"role": "system", "content": words("sys", 1_000)});
    let u1 = json!({"role": "user", "content": words("first", 2_000)});
    let u2 = json!({"role": "user", "content": words("second", 500)});
    let a2 = json!({"role": "assistant", "content": words("reply", 200)});
    let t3 = json!({"role": "tool", "content": words("tool", 300)});
    let u3 = json!({"role": "user", "content": words("third", 400)});
    let chat = |messages: Vec<&Value>| json!({"messages": messages, "max_tokens": 8});
    let turns = [
        chat(vec![&sys, &u1]),
        // A user message appended, no reply between (an agent after a cut-off answer).
        chat(vec![&sys, &u1, &u2]),
        // The reply, then a user message.
        chat(vec![&sys, &u1, &u2, &a2, &u3]),
        // A tool result, then a user message.
        chat(vec![&sys, &u1, &u2, &a2, &u3, &t3, &u2]),
    ];
    let mut session = None;
    for (k, body) in turns.iter().enumerate() {
        let r = f.post("/v1/chat/completions", &[], body).await;
        assert_eq!(r.status, 200, "turn {}: {}", k + 1, r.body);
        let s = r.header("x-kvc-session").to_owned();
        assert!(s.starts_with("kvc-inferred-"), "turn {}: {s}", k + 1);
        let expected = if k == 0 { "turn1-seed" } else { "direct-to-d" };
        assert_eq!(
            r.header("x-kvc-mode"),
            expected,
            "turn {}: {:?}",
            k + 1,
            r.find_header("x-kvc-reason")
        );
        match &session {
            None => session = Some(s),
            Some(first) => assert_eq!(&s, first, "turn {}", k + 1),
        }
    }
}

#[tokio::test]
async fn a_turn_appended_after_a_prompt_ending_on_a_block_boundary_continues_its_session() {
    // The first prompt is exactly five blocks (512 tokens each) with the chat's generation
    // prompt, `<|assistant|>`, its last token; the next request appends a user message where
    // that generation prompt was. The session continues, and the turn goes direct to D.
    let f = start(one_p_one_d, |_| {}).await;
    // `<|system|>` + 1,000 words + `<|user|>` + 1,557 words + `<|assistant|>` = 2,560 tokens.
    let sys = json!({"role": "system", "content": words("sys", 1_000)});
    let u1 = json!({"role": "user", "content": words("first", 1_557)});
    let u2 = json!({"role": "user", "content": words("second", 500)});
    let r = f
        .post(
            "/v1/chat/completions",
            &[],
            &json!({"messages": [&sys, &u1], "max_tokens": 8}),
        )
        .await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    let first = r.header("x-kvc-session").to_owned();
    let r = f
        .post(
            "/v1/chat/completions",
            &[],
            &json!({"messages": [&sys, &u1, &u2], "max_tokens": 8}),
        )
        .await;
    assert_eq!(r.header("x-kvc-session"), first);
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
}

#[tokio::test]
async fn the_agents_apis_are_refused_on_a_cluster_of_sglang_workers() {
    // SGLang's servers have no Messages or Responses endpoint to forward to: the client is
    // told so in its API's shape, and no worker is called.
    let f = start(one_p_one_d, |_| {}).await;
    let messages = json!({"max_tokens": 4, "messages": [{"role": "user", "content": "q"}]});
    let r = f.post("/v1/messages", &[], &messages).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "error", "Anthropic's shape: {v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("/v1/messages") && message.contains("vllm"),
        "{v}"
    );
    let r = f.post("/v1/messages/count_tokens", &[], &messages).await;
    assert_eq!((r.status, r.json()["type"].as_str()), (400, Some("error")));
    let r = f
        .post(
            "/v1/responses",
            &[],
            &json!({"input": "q", "max_output_tokens": 4}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/responses"),
        "{}",
        r.body
    );
    assert_eq!(f.count(0) + f.count(1), 0);
}

#[tokio::test]
async fn a_session_id_the_client_changes_every_request_is_detected_and_not_trusted() {
    // Each request names a new id, yet extends the previous request's prompt: the ids are
    // counted as rotating and the requests continue the first id's session (direct to D).
    let f = start(one_p_one_d, |_| {}).await;
    let prompt = |n: u32| json!({"prompt": words("w", n), "max_tokens": 4});
    let rotated = |f: &Front| f.metric("kvc_router_http_rotated_session_ids_total", &[]);
    let r = f
        .post(
            "/v1/completions",
            &[("x-session-id", "rot-1")],
            &prompt(2_100),
        )
        .await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    for (id, n) in [("rot-2", 2_700), ("rot-3", 3_300)] {
        let r = f
            .post("/v1/completions", &[("x-session-id", id)], &prompt(n))
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-kvc-session"), "rot-1", "{id} continues rot-1");
        assert_eq!(r.header("x-kvc-mode"), "direct-to-d", "{id}");
    }
    assert_eq!(rotated(&f), 2.0);
    // (Prompts of at least `infer-min-blocks` = 4 full blocks of 512 tokens.)
    // A session that kept its id for two turns is not rotating: a new id extending its
    // prompt is a session of its own.
    let other = |n: u32| json!({"prompt": words("v", n), "max_tokens": 4});
    for n in [2_100, 2_700] {
        let r = f
            .post("/v1/completions", &[("x-session-id", "keep-1")], &other(n))
            .await;
        assert_eq!(r.header("x-kvc-session"), "keep-1");
    }
    let r = f
        .post(
            "/v1/completions",
            &[("x-session-id", "keep-2")],
            &other(3_300),
        )
        .await;
    assert_eq!(r.header("x-kvc-session"), "keep-2");
    // Its prompt goes on past keep-1's latest: a session started from keep-1's context (a
    // subagent), its parent inferred, its first turn an append on keep-1's decode worker.
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    assert_eq!(
        f.metric(
            "kvc_router_http_subagent_sessions_total",
            &[("parent", "inferred")]
        ),
        1.0
    );
    // Nor is a new id whose prompt merely shares a first block or two.
    let r = f
        .post(
            "/v1/completions",
            &[("x-session-id", "rot-x")],
            &json!({"prompt": format!("{} {}", words("w", 600), words("z", 2_000)), "max_tokens": 4}),
        )
        .await;
    assert_eq!(r.header("x-kvc-session"), "rot-x");
    assert_eq!(rotated(&f), 2.0);
}

/// A completion body: the shared system prompt (4 blocks of 512 words), then `n` words of
/// `tag`.
fn with_system(tag: &str, n: u32) -> Value {
    json!({"prompt": format!("{} {}", words("sys", 2_048), words(tag, n)), "max_tokens": 4})
}

#[tokio::test]
async fn a_subagents_first_turn_goes_direct_to_its_parents_decode_worker() {
    // Decode workers that may serve a turn alone (as vLLM instances do): a D can take a
    // session it has no KV of.
    let f = start(
        |cfg| {
            for w in &mut cfg.workers {
                w.serve_alone = Some(true);
            }
        },
        |_| {},
    )
    .await;
    let post = |headers: Vec<(&'static str, &'static str)>, body: Value| {
        let f = &f;
        async move { f.post("/v1/completions", &headers, &body).await }
    };
    // Parents: a Codex thread and a Claude Code session.
    let r = post(vec![("thread-id", "th-1")], with_system("p", 1_000)).await;
    assert_ne!(r.header("x-kvc-mode"), "direct-to-d");
    let codex_d = r.header("x-kvc-decode-worker").to_owned();
    let r = post(
        vec![("x-claude-code-session-id", "cc-1")],
        with_system("m", 1_000),
    )
    .await;
    assert_ne!(r.header("x-kvc-mode"), "direct-to-d");
    let claude_d = r.header("x-kvc-decode-worker").to_owned();
    // Children, each naming its parent as its client does: the first turn is an append on
    // the parent's D (which holds the system prompt), not a seed through P.
    type Headers = Vec<(&'static str, &'static str)>;
    let children: [(&str, Headers, &str, &str); 4] = [
        (
            "codex",
            vec![("thread-id", "th-2"), ("x-codex-parent-thread-id", "th-1")],
            "th-2",
            &codex_d,
        ),
        (
            "opencode",
            vec![("x-session-id", "ses_c"), ("x-parent-session-id", "th-1")],
            "ses_c",
            &codex_d,
        ),
        (
            "claude-code subagent",
            vec![
                ("x-claude-code-session-id", "cc-1"),
                ("x-claude-code-agent-id", "a1"),
            ],
            "cc-1/agent/a1",
            &claude_d,
        ),
        (
            "claude-code subagent of a subagent",
            vec![
                ("x-claude-code-session-id", "cc-1"),
                ("x-claude-code-agent-id", "a2"),
                ("x-claude-code-parent-agent-id", "a1"),
            ],
            "cc-1/agent/a2",
            &claude_d,
        ),
    ];
    for (i, (who, headers, key, parent_d)) in children.into_iter().enumerate() {
        let tag = format!("c{i}-");
        let body = with_system(&tag, 1_000);
        let r = f.post("/v1/completions", &headers, &body).await;
        assert_eq!(r.status, 200, "{who}: {}", r.body);
        assert_eq!(r.header("x-kvc-session"), key, "{who}");
        assert_eq!(r.header("x-kvc-mode"), "direct-to-d", "{who}");
        assert_eq!(r.header("x-kvc-decode-worker"), parent_d, "{who}");
        assert_eq!(r.find_header("x-kvc-prefill-worker"), None, "{who}");
    }
    assert_eq!(
        f.metric(
            "kvc_router_http_subagent_sessions_total",
            &[("parent", "header")]
        ),
        4.0
    );
    // The same kind of prompt from a session without a parent is not an append.
    let r = post(vec![("thread-id", "th-9")], with_system("z", 1_000)).await;
    assert_ne!(r.header("x-kvc-mode"), "direct-to-d");
    // A new key whose prompt goes on past a live session's latest (of a session past its
    // first turn, or it would be taken for an id the client rotates): its parent is inferred.
    let r = post(vec![("thread-id", "th-1")], with_system("p", 1_200)).await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    let fork = format!("{} {}", words("sys", 2_048), words("p", 1_200));
    let r = post(
        vec![("x-session-id", "fork-1")],
        json!({"prompt": format!("{fork} {}", words("f", 600)), "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    assert_eq!(r.header("x-kvc-decode-worker"), codex_d);
    assert_eq!(
        f.metric(
            "kvc_router_http_subagent_sessions_total",
            &[("parent", "inferred")]
        ),
        1.0
    );
    // A parent header is bounded like a session id.
    let long = "p".repeat(300);
    let r = f
        .post(
            "/v1/completions",
            &[("thread-id", "th-10"), ("x-parent-session-id", &long)],
            &with_system("y", 100),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("x-parent-session-id"), "{}", r.body);
}

#[tokio::test]
async fn a_compacted_turn_is_recognised_and_placed_as_a_fresh_seed() {
    let f = start(one_p_one_d, |_| {}).await;
    let key = [("x-session-id", "cmp-1")];
    let r = f
        .post("/v1/completions", &key, &with_system("h", 10_000))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    let r = f
        .post("/v1/completions", &key, &with_system("h", 10_400))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    // The agent summarised its history: the system prompt, then a summary of 8,600 tokens
    // (over the 8,192-token direct limit), shorter than the last prompt.
    let r = f
        .post("/v1/completions", &key, &with_system("s", 8_600))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (r.header("x-kvc-mode"), r.header("x-kvc-reason")),
        ("fallback", "compacted")
    );
    assert_eq!(r.header("x-kvc-session"), "cmp-1");
    assert_eq!(
        f.metric(
            "kvc_router_decisions_total",
            &[("mode", "fallback"), ("reason", "compacted")]
        ),
        1.0
    );
    // The compacted conversation goes on direct to D.
    let r = f
        .post("/v1/completions", &key, &with_system("s", 9_000))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    // A turn that grows by more than the limit without leaving its history is a large
    // append, not a compaction.
    let r = f
        .post("/v1/completions", &key, &with_system("s", 18_000))
        .await;
    assert_eq!(
        (r.header("x-kvc-mode"), r.header("x-kvc-reason")),
        ("fallback", "real-large-append")
    );
}

impl Front {
    /// Publishes decode worker `id` with `used` tokens of its pool in use and waits (at most
    /// [`common::WAIT`]) until the router has read it.
    async fn publish_used(&mut self, id: u32, used: u64) {
        self.cluster
            .publish(id, used, common::CAPACITY.saturating_sub(used));
        let service = self.cluster.service();
        common::wait_until(format!("worker {id}'s publish read"), || {
            service.worker_views()[id as usize].state.used_tokens == used
        })
        .await;
    }

    /// `GET /v1/sessions/{key}`, 200, as JSON.
    async fn session(&self, key: &str) -> Value {
        let r = self.get("GET", &format!("/v1/sessions/{key}")).await;
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    }
}

#[tokio::test]
async fn a_compacted_turn_moves_off_a_busy_decode_worker_and_leaves_it() {
    let mut f = start(|_| {}, |_| {}).await;
    let key = [("x-session-id", "cmp-2")];
    let r = f
        .post("/v1/completions", &key, &with_system("h", 10_000))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    let old_d: u32 = r.header("x-kvc-decode-worker").parse().unwrap();
    let r = f
        .post("/v1/completions", &key, &with_system("h", 10_400))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    f.settle().await;
    let before = f.session("cmp-2").await;
    assert_eq!(before["decode_worker"], old_d);
    assert_eq!(before["residency"], "resident");
    assert_eq!(before["moves"], 0);
    let old_blocks = before["blocks"].as_u64().unwrap();
    assert!(old_blocks >= 24, "{before}");
    assert_eq!(before["held_blocks"], before["blocks"], "{before}");
    // The session's D gets busy; then the agent summarises its history (8,600 new tokens,
    // over the direct limit): a fresh seed, placed on the other D.
    f.publish_used(old_d, common::CAPACITY * 6 / 10).await;
    let r = f
        .post("/v1/completions", &key, &with_system("s", 8_600))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (r.header("x-kvc-mode"), r.header("x-kvc-reason")),
        ("fallback", "compacted")
    );
    let new_d: u32 = r.header("x-kvc-decode-worker").parse().unwrap();
    assert_ne!(new_d, old_d, "placed afresh, off the busy D");
    f.settle().await;
    // Its residency is the summary's, on the new D; the old history is no longer counted.
    let after = f.session("cmp-2").await;
    assert_eq!(after["decode_worker"], new_d);
    assert_eq!(after["residency"], "resident");
    assert_eq!(after["moves"], 1);
    let new_blocks = after["blocks"].as_u64().unwrap();
    assert!(new_blocks < old_blocks, "{after}");
    assert_eq!(after["held_blocks"], after["blocks"], "{after}");
    // The old D, idle again, takes the next session: nothing of the compacted one is
    // counted active there.
    f.publish_used(old_d, 0).await;
    let r = f
        .post(
            "/v1/completions",
            &[("x-session-id", "next")],
            &json!({"prompt": words("n", 1_300), "max_tokens": 4}),
        )
        .await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    assert_eq!(r.header("x-kvc-decode-worker"), old_d.to_string());
    // The session view of an unknown key is a 404.
    let r = f.get("GET", "/v1/sessions/nobody").await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("nobody"), "{}", r.body);
}

#[tokio::test]
async fn a_session_its_client_ends_frees_its_decode_worker_for_the_next_one() {
    let f = start(|_| {}, |_| {}).await;
    let first = |key: &'static str| {
        let f = &f;
        async move {
            let r = f
                .post(
                    "/v1/completions",
                    &[("x-session-id", key)],
                    &json!({"prompt": words(key, 1_300), "max_tokens": 4}),
                )
                .await;
            assert_eq!(r.header("x-kvc-mode"), "turn1-seed", "{key}");
            r.header("x-kvc-decode-worker").to_owned()
        }
    };
    let placed: Vec<(&str, String)> = {
        let mut v = Vec::new();
        for key in ["a", "b", "c"] {
            v.push((key, first(key).await));
        }
        v
    };
    f.settle().await;
    assert_ne!(placed[0].1, placed[1].1, "two active sessions are spread");
    // The D holding two of the three, and the one holding the third.
    let busy = if placed[2].1 == placed[0].1 {
        placed[0].1.clone()
    } else {
        placed[1].1.clone()
    };
    let ending: Vec<&str> = placed
        .iter()
        .filter(|(_, d)| *d == busy)
        .map(|(k, _)| *k)
        .collect();
    assert_eq!(ending.len(), 2);
    // Both end: one by `DELETE`, the other by its last turn marked final.
    let r = f
        .get("DELETE", &format!("/v1/sessions/{}", ending[0]))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let last = format!("{} {}", words(ending[1], 1_300), words("x", 200));
    let r = f
        .post(
            "/v1/completions",
            &[("x-session-id", ending[1]), ("x-session-final", "true")],
            &json!({"prompt": last, "max_tokens": 4}),
        )
        .await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    assert_eq!(r.header("x-kvc-decode-worker"), busy);
    f.settle().await;
    for key in &ending {
        assert_eq!(
            f.get("GET", &format!("/v1/sessions/{key}")).await.status,
            404
        );
    }
    assert_eq!(
        f.metric("kvc_router_sessions_forgotten_total", &[("cause", "ended")]),
        2.0
    );
    // The next session goes where the ended ones were, not beside the live one.
    assert_eq!(first("e").await, busy);
}
