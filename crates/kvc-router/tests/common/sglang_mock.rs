//! A mock SGLang/OpenAI worker whose behaviour a test sets (answer, stream, fail, stall, break
//! off mid-stream; its health up or down) and that records what it receives, behind the HTTP
//! front of one prefill and two decode workers: the fixtures of the forwarding tests.

use super::client::{self, JsonAnswer};
use super::front::{
    self, Front, Recording, answer_body, error_response, ids, json_response, worker_routes,
};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use kvc_core::WorkerId;
use kvc_router::http::{HttpOptions, WorkerEndpoints};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// What a mock worker does with a request.
#[derive(Clone, Copy, PartialEq)]
pub enum Behaviour {
    Answer,
    /// Like `Answer`, but a streamed answer is not held back after its first event.
    Flow,
    Fail,
    /// Never answers (a decode worker waiting for KV that does not come).
    Stall,
    /// A streamed answer that breaks off after two events.
    DieMidStream,
}

pub struct Mock {
    pub name: String,
    pub received: Mutex<Vec<(String, Value)>>,
    pub behaviour: Mutex<Behaviour>,
    /// What its `GET /health` answers: 200 while up, else 503.
    pub up: std::sync::atomic::AtomicBool,
    /// A streamed answer waits here after its first event.
    pub gate: tokio::sync::Notify,
}

impl Recording for Mock {
    type Request = (String, Value);

    fn requests(&self) -> &Mutex<Vec<(String, Value)>> {
        &self.received
    }
}

/// The SSE events a mock worker streams for `path`, then `data: [DONE]`.
pub fn stream_events(name: &str, path: &str) -> Vec<String> {
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
    let value: Value = serde_json::from_slice(&body).expect("router forwarded invalid JSON");
    let stream = value["stream"] == true;
    m.received.lock().push((uri.path().to_owned(), value));
    let behaviour = *m.behaviour.lock();
    match behaviour {
        Behaviour::Fail => {
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{} failed", m.name),
            );
        }
        Behaviour::Stall => std::future::pending::<()>().await,
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
    let tokens = if uri.path() == "/generate" { 40 } else { 12 };
    json_response(StatusCode::OK, &answer_body(&m.name, uri.path(), tokens))
}

async fn mock_health(State(m): State<Arc<Mock>>) -> StatusCode {
    if m.up.load(std::sync::atomic::Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// `GET /v1/models` as an engine answers it: model `engine-model` while up, 503 when down.
async fn mock_models(State(m): State<Arc<Mock>>) -> axum::response::Response {
    if m.up.load(std::sync::atomic::Ordering::SeqCst) {
        json_response(
            StatusCode::OK,
            &serde_json::json!({"object": "list",
                "data": [{"id": "engine-model", "object": "model", "owned_by": m.name}]}),
        )
    } else {
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{} is down", m.name),
        )
    }
}

/// A [`Mock`] named `name` (answering), serving on a fresh loopback port.
pub async fn spawn_mock(name: &str) -> (Arc<Mock>, SocketAddr) {
    let mock = Arc::new(Mock {
        name: name.to_owned(),
        received: Mutex::new(Vec::new()),
        behaviour: Mutex::new(Behaviour::Answer),
        up: std::sync::atomic::AtomicBool::new(true),
        gate: tokio::sync::Notify::new(),
    });
    let app = worker_routes(mock_handler)
        .route("/health", axum::routing::get(mock_health))
        .route("/v1/models", axum::routing::get(mock_models))
        .with_state(mock.clone());
    let addr = front::serve(app).await;
    (mock, addr)
}

/// The front over P0, D1 and D2, each with a [`Mock`].
pub type Setup = Front<Mock>;

/// A loopback address nobody listens on (connections are refused).
pub fn dead_addr() -> SocketAddr {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    addr
}

/// No retries, no circuit breakers, no health checks: every failure reaches the client.
pub fn without_resilience(o: &mut HttpOptions) {
    o.max_retries = 0;
    o.breaker.failure_threshold = 0;
    o.health_check_interval = None;
}

/// The front with its workers as they start.
pub async fn start() -> Setup {
    start_with(|_| {}).await
}

/// The front with the endpoints as `edit` changes them.
pub async fn start_with(edit: impl FnOnce(&mut WorkerEndpoints)) -> Setup {
    start_full(edit, |_| {}).await
}

/// The request deadline of [`start_full`]'s options: long enough never to fire on a loaded
/// machine (a test that needs a deadline to fire sets a short one).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The front with the endpoints as `edit` changes them and the options as `edit_options`
/// changes a [`REQUEST_TIMEOUT`] deadline, model `test-model` and a 64 KiB body limit.
pub async fn start_full(
    edit: impl FnOnce(&mut WorkerEndpoints),
    edit_options: impl FnOnce(&mut HttpOptions),
) -> Setup {
    let mut options = HttpOptions {
        request_timeout: REQUEST_TIMEOUT,
        model: "test-model".to_owned(),
        max_body_bytes: 64 * 1024,
        ..HttpOptions::default()
    };
    edit_options(&mut options);
    let bootstrap = |id, _| (id == 0).then_some(8_998 + 100);
    Front::start(|_| {}, spawn_mock, bootstrap, edit, options).await
}

/// The front with decode worker 2 at an address nothing listens on, retries on (two, 2 ms
/// apart), no health checks, and a breaker opening after `failure_threshold` failures (0: none).
pub async fn start_with_dead_d2(failure_threshold: u32) -> Setup {
    start_full(
        |w| {
            w.insert(WorkerId(2), &format!("http://{}", dead_addr()), None)
                .unwrap();
        },
        |o| {
            o.max_retries = 2;
            o.retry_backoff = Duration::from_millis(2);
            o.breaker.failure_threshold = failure_threshold;
            o.health_check_interval = None;
        },
    )
    .await
}

impl Front<Mock> {
    /// Request `i` of its own session `<prefix><i>`: a `/generate` of 600 tokens of its own.
    pub async fn send_session(&self, prefix: &str, i: u32) -> JsonAnswer {
        let key = format!("{prefix}{i}");
        self.send(
            "/generate",
            &[("x-session-id", key.as_str())],
            &generate_body(i * 1_000..i * 1_000 + 600),
        )
        .await
    }

    /// Requests received by P0, D1 and D2.
    pub fn counts(&self) -> [usize; 3] {
        [0, 1, 2].map(|i| self.count(i))
    }

    /// The decode workers' mocks.
    pub fn decode_mocks(&self) -> [&Arc<Mock>; 2] {
        [&self.mocks[&1], &self.mocks[&2]]
    }

    /// One POST over a plain connection; the answer's body must be JSON.
    pub async fn send(&self, path: &str, headers: &[(&str, &str)], body: &str) -> JsonAnswer {
        client::raw_exchange(self.addr, "POST", path, headers, Some(body))
            .await
            .into()
    }

    /// A bodyless `method path` request; the answer's body must be JSON.
    pub async fn request(&self, method: &str, path: &str) -> JsonAnswer {
        client::raw_exchange(self.addr, method, path, &[], Some(""))
            .await
            .into()
    }

    /// A streamed POST of `body`.
    pub async fn open_stream(&self, path: &str, body: &Value) -> client::Streamed {
        client::post(self.addr, path, &[], &body.to_string()).await
    }

    /// The decode worker called since the counts were `before`.
    pub fn chosen_decode(&self, before: [usize; 3]) -> u32 {
        let now = self.counts();
        match (now[1] > before[1], now[2] > before[2]) {
            (true, false) => 1,
            (false, true) => 2,
            other => panic!("exactly one decode worker should be called: {other:?}"),
        }
    }
}

/// A non-streamed `/generate` body of the token ids `tokens`.
pub fn generate_body(tokens: std::ops::Range<u32>) -> String {
    json!({"input_ids": ids(tokens), "sampling_params": {"max_new_tokens": 40}, "stream": false})
        .to_string()
}
