//! The HTTP front over mock workers, for the router's HTTP tests: a `Cluster` of snapshot
//! workers gives the router its state, each configured worker gets a mock HTTP server, and the
//! front forwards to them; then what the tests ask of it (a POST, metrics and outcome counts,
//! waits for outcomes and breakers) and the pieces every mock answers with.

use super::Cluster;
use super::answer::Answer;
use super::client;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use kvc_core::{Health, WorkerId, WorkerRole};
use kvc_router::RouterConfig;
use kvc_router::http::{
    BreakerState, HttpOptions, WorkerEndpoints, http_app_traced, http_app_with,
};
use kvc_router::telemetry::Telemetry;
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A mock worker that records the requests it receives.
pub trait Recording {
    /// What it keeps of one request.
    type Request: Clone;

    /// The requests received so far, in order.
    fn requests(&self) -> &Mutex<Vec<Self::Request>>;
}

/// A router's HTTP front over one mock `M` per configured worker.
pub struct Front<M> {
    pub cluster: Cluster,
    /// Mock workers by worker id.
    pub mocks: HashMap<u32, Arc<M>>,
    /// The mock workers' addresses by worker id.
    pub addrs: HashMap<u32, SocketAddr>,
    /// The front's address.
    pub addr: SocketAddr,
}

/// The options the HTTP tests start from: no health checks, retries after 1 ms, and a
/// request deadline of `timeout`.
pub fn options(timeout: Duration) -> HttpOptions {
    HttpOptions {
        request_timeout: timeout,
        retry_backoff: Duration::from_millis(1),
        health_check_interval: None,
        ..HttpOptions::default()
    }
}

impl<M: Send + Sync + 'static> Front<M> {
    /// A router over the cluster `edit` makes of the default P0, D1, D2 (snapshot workers,
    /// healthy before it starts), each worker with a mock from `spawn` (given the worker's
    /// name: its role's initial and id, `p0`, `d1` …) registered with the bootstrap port
    /// `bootstrap` gives it, then the endpoints as `endpoints` changes them, and the front
    /// with `options`.
    pub async fn start(
        edit: impl FnOnce(&mut RouterConfig),
        spawn: impl AsyncFnMut(&str) -> (Arc<M>, SocketAddr),
        bootstrap: impl Fn(u32, WorkerRole) -> Option<u16>,
        endpoints: impl FnOnce(&mut WorkerEndpoints),
        options: HttpOptions,
    ) -> Front<M> {
        Self::start_traced(edit, spawn, bootstrap, endpoints, options, false).await
    }

    /// [`Front::start`], with `traced`: the front traced as the configuration's `[tracing]`
    /// table says (`Telemetry::from_config`; off without one).
    pub async fn start_traced(
        edit: impl FnOnce(&mut RouterConfig),
        mut spawn: impl AsyncFnMut(&str) -> (Arc<M>, SocketAddr),
        bootstrap: impl Fn(u32, WorkerRole) -> Option<u16>,
        endpoints: impl FnOnce(&mut WorkerEndpoints),
        options: HttpOptions,
        traced: bool,
    ) -> Front<M> {
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
        let (mut mocks, mut addrs) = (HashMap::new(), HashMap::new());
        let mut http = WorkerEndpoints::new();
        for (id, role) in workers {
            let name = format!("{}{id}", &role.to_string()[..1]);
            let (mock, addr) = spawn(&name).await;
            http.insert(WorkerId(id), &format!("http://{addr}"), bootstrap(id, role))
                .unwrap();
            mocks.insert(id, mock);
            addrs.insert(id, addr);
        }
        endpoints(&mut http);
        let app = if traced {
            let telemetry = Telemetry::from_config(cluster.service().config()).unwrap();
            http_app_traced(cluster.service().clone(), http, options, telemetry)
        } else {
            http_app_with(cluster.service().clone(), http, options)
        };
        let addr = serve(app).await;
        Front {
            cluster,
            mocks,
            addrs,
            addr,
        }
    }

    /// One bounded POST of `body` (JSON) to the front; the whole answer.
    pub async fn post(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> Answer {
        client::exchange(self.addr, path, headers, &body.to_string()).await
    }

    /// A bodyless `method path` request to the front, over a plain connection.
    pub async fn get(&self, method: &str, path: &str) -> Answer {
        client::raw_exchange(self.addr, method, path, &[], None).await
    }

    /// The sample `name` with exactly `labels` of the service's metrics.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let samples = super::parse_prometheus(&self.cluster.service().render_metrics());
        super::value(&samples, name, labels)
    }

    /// `kvc_router_outcomes_total{outcome}`.
    pub fn outcomes(&self, outcome: &str) -> f64 {
        self.metric("kvc_router_outcomes_total", &[("outcome", outcome)])
    }

    /// Waits (at most [`super::WAIT`]) until no decision awaits its outcome.
    pub async fn settle(&self) {
        super::wait_until("every outcome reported", || {
            self.cluster.service().pending_decisions() == 0
        })
        .await;
    }

    /// Waits (at most [`super::WAIT`]) until worker `id`'s breaker is in `state`.
    pub async fn wait_breaker(&self, id: u32, state: BreakerState) {
        super::wait_until(format!("worker {id}'s breaker becoming {state:?}"), || {
            self.cluster.service().metrics().breaker_state(WorkerId(id)) == Some(state)
        })
        .await;
    }
}

impl<M: Recording> Front<M> {
    /// What worker `id`'s mock received so far.
    pub fn received(&self, id: u32) -> Vec<M::Request> {
        self.mocks[&id].requests().lock().clone()
    }

    /// How many requests worker `id`'s mock received.
    pub fn count(&self, id: u32) -> usize {
        self.mocks[&id].requests().lock().len()
    }

    /// What worker `id`'s mock received, once it holds at least `n` requests (at most
    /// [`super::WAIT`]): on the SGLang dialect P's request runs beside D's, and the client's
    /// answer can come before P's request reaches its mock.
    pub async fn received_at_least(&self, id: u32, n: usize) -> Vec<M::Request> {
        super::wait_until(format!("{n} request(s) at worker {id}'s mock"), || {
            self.count(id) >= n
        })
        .await;
        self.received(id)
    }
}

/// Serves `app` on a fresh loopback port; its address.
pub async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A mock worker's routes: `handler` behind SGLang's `/generate` and OpenAI's completions
/// and chat completions.
pub fn worker_routes<H, T, S>(handler: H) -> axum::Router<S>
where
    H: axum::handler::Handler<T, S> + Clone,
    T: 'static,
    S: Clone + Send + Sync + 'static,
{
    axum::Router::new()
        .route("/generate", post(handler.clone()))
        .route("/v1/completions", post(handler.clone()))
        .route("/v1/chat/completions", post(handler.clone()))
        .route("/v1/messages", post(handler.clone()))
        .route("/v1/responses", post(handler))
}

/// A JSON answer with `status`.
pub fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [("content-type", "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// An error answer with `status` and the message `message`.
pub fn error_response(status: StatusCode, message: String) -> Response {
    json_response(status, &json!({"error": {"message": message}}))
}

/// A Server-Sent Events answer (200) of `events`.
pub fn sse_response(events: String) -> Response {
    (
        StatusCode::OK,
        [("content-type", "text/event-stream")],
        events,
    )
        .into_response()
}

/// The answer worker `name` gives on `path`: "answer from `name`" with `completion_tokens`
/// tokens, in SGLang's shape on `/generate`, OpenAI's chat or completion shape otherwise.
pub fn answer_body(name: &str, path: &str, completion_tokens: u64) -> Value {
    let text = format!("answer from {name}");
    if path == "/generate" {
        json!({"text": text, "meta_info": {"completion_tokens": completion_tokens}})
    } else if path == "/v1/chat/completions" {
        json!({"object": "chat.completion",
               "choices": [{"message": {"role": "assistant", "content": text}}],
               "usage": {"completion_tokens": completion_tokens}})
    } else {
        json!({"choices": [{"text": text}], "usage": {"completion_tokens": completion_tokens}})
    }
}

/// The token ids `range`, as JSON.
pub fn ids(range: std::ops::Range<u32>) -> Value {
    Value::from(range.collect::<Vec<u32>>())
}
