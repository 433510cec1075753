//! The HTTP data plane: a front for SGLang-style prefill/decode workers.
//!
//! [`http_app`] builds an `axum` router that takes the client's request, asks the
//! [`RouterService`] where it goes (the same decision path as the gRPC `Route`, without gRPC),
//! forwards it the way SGLang's disaggregation expects, returns the decode worker's answer and
//! feeds the outcome back (`ReportOutcome`).
//!
//! | Route | Body |
//! |---|---|
//! | `POST /generate` | SGLang: `text` or `input_ids`, `sampling_params.max_new_tokens`, optional `session_params.id`, optional `stream` |
//! | `POST /v1/completions` | OpenAI: `prompt` (text or token ids), `max_tokens`, optional `stream` |
//! | `POST /v1/chat/completions` | OpenAI: `messages` (`[{role, content}]`), `max_completion_tokens` or `max_tokens`, optional `stream` |
//! | `GET /health` | 200 while at least one worker is routable, else 503 |
//! | `GET /v1/models` | the configured model name, OpenAI list shape |
//!
//! A malformed body gets 400 with `{"error": {"message": "...", "type": "invalid_request_error"}}`;
//! one over [`HttpOptions::max_body_bytes`] gets 413 with the same shape.
//!
//! **Session and turn.** The session key is the `x-session-id` header (name configurable in
//! [`HttpOptions`]) or, for `/generate`, `session_params.id`; it maps to a session id with
//! [`kvc_core::SessionId::from_key`]. The turn is a per-session counter kept here (bounded by
//! the router's `sessions.ttl-ms` and `sessions.max`). A request without a key is routed
//! without a session.
//!
//! **Block hashes.** From `input_ids` (or a token-id `prompt`) with [`block_hashes`] over the
//! policy's block size; text goes through [`fallback_tokens`] (one token per word) first. A
//! chat request's text is its messages through the simple template of [`chat_prompt`] (used
//! for hashing only; the worker gets the messages and applies its own template). The input
//! length is the number of tokens.
//!
//! **Forwarding.** For a decision through a prefill worker (`turn1-seed`, `fallback`,
//! `reseed`) the same JSON body, with `bootstrap_host` (P's host), `bootstrap_port` (P's
//! bootstrap port) and a random `bootstrap_room` injected, goes to P and D concurrently; D's
//! answer is returned. `direct-to-d` sends the body unchanged to D alone, `colocated` to the
//! worker. Each worker call has the deadline [`HttpOptions::request_timeout`]. The outcome is
//! `ok` when every worker answered 2xx (the resident tokens are the input plus the answer's
//! `meta_info.completion_tokens` or `usage.completion_tokens`), else `worker-failed`. A worker
//! that answered non-2xx has its status and body passed through; one that did not answer
//! gives 502 (504 on a timeout). Responses carry `x-kvc-mode`, `x-kvc-decode-worker` and, on
//! the P→D path, `x-kvc-prefill-worker`.
//!
//! **Streaming.** With `"stream": true` the body is forwarded the same way, but D's answer is
//! relayed to the client as it arrives (chunked, with D's `Content-Type`, normally
//! `text/event-stream`), never buffered whole; P's answer is read and dropped. The deadline
//! [`HttpOptions::request_timeout`] then bounds the wait for D's response head and each wait
//! for more of its body. If D's connection breaks, its body is malformed or it goes silent
//! past the deadline mid-stream, the client's stream ends with one SSE error event,
//! `data: {"error": {"message": "...", "type": "worker_error", "code": 502}}`, and the
//! request is reported `worker-failed`. The outcome is reported when the stream has ended:
//! `ok` (resident tokens: the input plus the last `completion_tokens` seen in a `data:` event)
//! when D's stream completed with a 2xx status and P answered 2xx, else `worker-failed` (also
//! when the client went away first: nothing is claimed resident). A D that cannot be reached
//! gets the same JSON 502/504 as without streaming.
//!
//! **Resilience.** Options in [`HttpOptions`] (the `[http]` table of the configuration,
//! [`crate::HttpConfig`]):
//!
//! - *Retries.* A request whose decode worker failed before any byte reached the client —
//!   connection refused or broken, no answer (or, streaming, no response head) within the
//!   deadline, or a 502, 503 or 504 — is reported `worker-failed`, then routed again with
//!   [`RouterService::route_excluding`] (the workers that failed it count as down for that
//!   decision) and forwarded again, at most [`HttpOptions::max_retries`] times, after a
//!   jittered backoff ([`HttpOptions::retry_backoff`], doubling). A failing prefill worker
//!   alongside is excluded too. When no other worker can take it, or the retries are spent,
//!   the client gets the last failure. Nothing is retried once a stream has started.
//! - *Circuit breakers.* Per worker, [`BreakerOptions::failure_threshold`] consecutive
//!   failures (connect error, timeout, 5xx, a stream broken off, a failed health check) open
//!   it: the worker is taken out of rotation with [`RouterService::set_http_down`], so no
//!   policy picks it, for a cool-down that doubles with each re-opening up to
//!   [`BreakerOptions::max_cooldown`] (with jitter). Then it is half-open: back in rotation
//!   for one trial request (out again while the trial runs); the trial's success closes the
//!   breaker, its failure (or no result within [`HttpOptions::request_timeout`]) opens it
//!   again. Any successful request closes it.
//! - *Health checks.* Every [`HttpOptions::health_check_interval`], each worker's `GET
//!   /health` is checked within [`HttpOptions::health_check_timeout`]: no answer or a 5xx
//!   counts against its breaker; any other answer closes a half-open breaker. The checks run
//!   on the Tokio runtime the app is built in (none outside a runtime) and stop when the app
//!   is dropped.
//!
//! Metrics: `kvc_router_http_breaker_state`, `kvc_router_http_breaker_transitions_total`,
//! `kvc_router_http_retries_total`, `kvc_router_http_health_checks_total` (see
//! [`crate::metrics`]).
//!
//! ```
//! use kvc_core::WorkerId;
//! use kvc_router::http::{HttpWorkers, http_app};
//! use kvc_router::{RouterConfig, RouterService};
//! use std::sync::Arc;
//!
//! let service = Arc::new(RouterService::new(RouterConfig::default())?);
//! let mut workers = HttpWorkers::new();
//! workers.insert(WorkerId(0), "http://10.0.0.1:30000", Some(8998))?;
//! workers.insert(WorkerId(1), "http://10.0.0.2:30000", None)?;
//! assert_eq!(workers.len(), 2);
//! let app: axum::Router = http_app(service, workers);
//! // axum::serve(tokio::net::TcpListener::bind("0.0.0.0:8000").await?, app).await?;
//! # drop(app);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod breaker;
mod client;
mod request;
mod tokens;

pub use breaker::{BreakerOptions, BreakerState};
pub use client::{
    BaseUrl, ForwardError, MAX_RESPONSE_BYTES, WorkerResponse, WorkerStream, parse_response,
    post_json, post_streaming,
};
pub use request::{
    DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_TOKENS, chat_prompt,
};
pub use tokens::{block_hashes, fallback_tokens};

use crate::convert::ProtoEnum;
use crate::{RequestError, RouterService, pb};
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use breaker::Breakers;
use kvc_core::{ExecutionMode, Outcome, SessionId, StableName, WorkerId};
use parking_lot::Mutex;
use request::{Api, Prompt};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// SGLang's default disaggregation bootstrap port, used for a prefill worker registered
/// without one.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Where the HTTP front reaches each worker.
#[derive(Debug, Clone, Default)]
pub struct HttpWorkers {
    workers: HashMap<WorkerId, HttpWorker>,
}

/// One worker's HTTP endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpWorker {
    /// Its base URL, parsed.
    pub url: BaseUrl,
    /// The bootstrap port of a prefill worker (ignored for others).
    pub bootstrap_port: u16,
}

impl HttpWorkers {
    /// No workers.
    pub fn new() -> Self {
        HttpWorkers::default()
    }

    /// Registers worker `id` at `url` (`http://host:port`); `bootstrap_port` is the
    /// disaggregation bootstrap port of a prefill worker ([`DEFAULT_BOOTSTRAP_PORT`] when
    /// `None`). Replaces an earlier entry for `id`.
    pub fn insert(
        &mut self,
        id: WorkerId,
        url: &str,
        bootstrap_port: Option<u16>,
    ) -> Result<(), ForwardError> {
        let url = BaseUrl::parse(url)?;
        self.workers.insert(
            id,
            HttpWorker {
                url,
                bootstrap_port: bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT),
            },
        );
        Ok(())
    }

    /// Worker `id`'s endpoint.
    pub fn get(&self, id: WorkerId) -> Option<&HttpWorker> {
        self.workers.get(&id)
    }

    /// Number of workers registered.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether no worker is registered.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

/// Settings of the HTTP front.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpOptions {
    /// Header carrying the session key. Default `x-session-id`.
    pub session_header: String,
    /// Deadline of each worker call (connect, send, whole answer). Default 300 s.
    pub request_timeout: Duration,
    /// The model name `/v1/models` lists. Default `default`.
    pub model: String,
    /// Largest request body accepted, in bytes; larger ones get 413 with a JSON error.
    /// Default 16 MiB.
    pub max_body_bytes: usize,
    /// How many times a request that failed before any byte reached the client is routed
    /// and forwarded again (see the module docs). Default 2.
    pub max_retries: u32,
    /// Wait before the first retry; it doubles for each further one, and each wait is
    /// shortened by a random jitter of up to a half. Default 25 ms.
    pub retry_backoff: Duration,
    /// The per-worker circuit breakers.
    pub breaker: BreakerOptions,
    /// How often every worker's `GET /health` is checked; `None` checks nothing. Default 5 s.
    pub health_check_interval: Option<Duration>,
    /// Deadline of one health check. Default 1 s.
    pub health_check_timeout: Duration,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            session_header: "x-session-id".to_owned(),
            request_timeout: Duration::from_secs(300),
            model: "default".to_owned(),
            max_body_bytes: 16 << 20,
            max_retries: 2,
            retry_backoff: Duration::from_millis(25),
            breaker: BreakerOptions::default(),
            health_check_interval: Some(Duration::from_secs(5)),
            health_check_timeout: Duration::from_secs(1),
        }
    }
}

/// The HTTP front with the default [`HttpOptions`].
pub fn http_app(service: Arc<RouterService>, workers: HttpWorkers) -> Router {
    http_app_with(service, workers, HttpOptions::default())
}

/// The HTTP front with explicit options.
pub fn http_app_with(
    service: Arc<RouterService>,
    workers: HttpWorkers,
    options: HttpOptions,
) -> Router {
    let body_limit = DefaultBodyLimit::max(options.max_body_bytes);
    let health_checks = options
        .health_check_interval
        .filter(|i| !i.is_zero() && !workers.is_empty());
    let app = Arc::new(App {
        service,
        workers,
        breakers: Breakers::new(options.breaker, options.request_timeout),
        options,
        turns: Mutex::new(HashMap::new()),
        next_request: AtomicU64::new(1),
        rooms: std::collections::hash_map::RandomState::new(),
        room_counter: AtomicU64::new(0),
    });
    // The checks run while the app lives, on the runtime it is built in (none: no checks).
    if let (Some(interval), Ok(runtime)) = (health_checks, tokio::runtime::Handle::try_current()) {
        runtime.spawn(health_checks_task(Arc::downgrade(&app), interval));
    }
    Router::new()
        .route("/generate", post_endpoint(Api::Generate))
        .route("/v1/completions", post_endpoint(Api::Completions))
        .route("/v1/chat/completions", post_endpoint(Api::ChatCompletions))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .layer(body_limit)
        .with_state(app)
}

#[derive(Debug, Clone, Copy)]
struct TurnEntry {
    turn: u32,
    last_ms: u64,
}

struct App {
    service: Arc<RouterService>,
    workers: HttpWorkers,
    breakers: Breakers,
    options: HttpOptions,
    turns: Mutex<HashMap<SessionId, TurnEntry>>,
    next_request: AtomicU64,
    rooms: std::collections::hash_map::RandomState,
    room_counter: AtomicU64,
}

impl App {
    /// The next turn of `session` (1 for a new or expired session). The table is bounded by
    /// the router's session limits.
    fn next_turn(&self, session: SessionId) -> u32 {
        let limits = self.service.config().sessions;
        let now = self.service.now_ms();
        let mut turns = self.turns.lock();
        let turn = match turns.get_mut(&session) {
            Some(e) if now.saturating_sub(e.last_ms) <= limits.ttl_ms => {
                e.turn = e.turn.saturating_add(1);
                e.last_ms = now;
                e.turn
            }
            _ => {
                turns.insert(
                    session,
                    TurnEntry {
                        turn: 1,
                        last_ms: now,
                    },
                );
                1
            }
        };
        let max = limits.max_sessions.max(1);
        if turns.len() > max {
            turns.retain(|_, e| now.saturating_sub(e.last_ms) <= limits.ttl_ms);
            while turns.len() > max {
                let oldest = turns
                    .iter()
                    .filter(|(s, _)| **s != session)
                    .min_by_key(|(_, e)| e.last_ms)
                    .map(|(s, _)| *s);
                match oldest {
                    Some(s) => turns.remove(&s),
                    None => break,
                };
            }
        }
        turn
    }

    /// A random bootstrap room in `0..2^63`.
    fn room(&self) -> u64 {
        let mut h = self.rooms.build_hasher();
        h.write_u64(self.room_counter.fetch_add(1, Ordering::Relaxed));
        h.finish() >> 1
    }
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    json_response(
        status,
        &json!({ "error": { "message": message, "type": kind, "code": status.as_u16() } }),
    )
}

/// One POST endpoint: the body read (or refused) by axum, handled as `api`.
async fn endpoint(
    api: Api,
    app: Arc<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body {
        Ok(body) => handle(&app, api, &headers, &body).await,
        Err(e) => body_error_response(&e),
    }
}

/// The axum handler of the POST endpoint for `api`.
fn post_endpoint(api: Api) -> axum::routing::MethodRouter<Arc<App>> {
    post(
        move |State(app): State<Arc<App>>,
              headers: HeaderMap,
              body: Result<Bytes, BytesRejection>| endpoint(api, app, headers, body),
    )
}

/// A body that could not be read (too large, cut short) as a JSON error.
fn body_error_response(e: &BytesRejection) -> Response {
    error_response(e.status(), "invalid_request_error", &e.body_text())
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let views = app.service.worker_views();
    let healthy = views.iter().filter(|v| v.is_routable()).count();
    if healthy > 0 {
        json_response(
            StatusCode::OK,
            &json!({ "status": "ok", "healthy_workers": healthy, "workers": views.len() }),
        )
    } else {
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "no routable worker",
        )
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{ "id": app.options.model, "object": "model", "owned_by": "kvc" }],
        }),
    )
}

fn route_error_response(e: &RequestError) -> Response {
    let (status, kind) = match e {
        RequestError::InvalidArgument(_) => (StatusCode::BAD_REQUEST, "invalid_request_error"),
        RequestError::Unavailable(_) | RequestError::ResourceExhausted(_) => {
            (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
        }
        RequestError::DeadlineExceeded(_) => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
        RequestError::NotFound(_)
        | RequestError::FailedPrecondition(_)
        | RequestError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
    };
    error_response(status, kind, &e.to_string())
}

fn forward_error_response(who: &str, e: &ForwardError) -> Response {
    let status = match e {
        ForwardError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::BAD_GATEWAY,
    };
    error_response(status, "worker_error", &format!("{who}: {e}"))
}

/// Tokens generated, as the worker's answer reports them (SGLang `meta_info` or OpenAI
/// `usage`).
fn completion_tokens(body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v.pointer("/meta_info/completion_tokens")
        .or_else(|| v.pointer("/usage/completion_tokens"))
        .and_then(Value::as_u64)
}

fn is_success(r: &Result<WorkerResponse, ForwardError>) -> bool {
    matches!(r, Ok(w) if (200..300).contains(&w.status))
}

async fn handle(app: &Arc<App>, api: Api, headers: &HeaderMap, bytes: &[u8]) -> Response {
    let req = match request::parse(api, bytes) {
        Ok(r) => r,
        Err(m) => return error_response(StatusCode::BAD_REQUEST, "invalid_request_error", &m),
    };
    let header_key = match headers.get(app.options.session_header.as_str()) {
        None => None,
        Some(v) => match v.to_str() {
            Ok(s) if !s.trim().is_empty() => Some(s.trim().to_owned()),
            _ => {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    &format!(
                        "header `{}` must be non-empty text",
                        app.options.session_header
                    ),
                );
            }
        },
    };
    let tokens = match &req.prompt {
        Prompt::Tokens(t) => t.clone(),
        Prompt::Text(text) => fallback_tokens(text),
    };
    if tokens.is_empty() {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the prompt is empty",
        );
    }
    let session = header_key
        .or(req.session_key.clone())
        .map(|k| SessionId::from_key(&k));
    let turn = session.map(|s| app.next_turn(s));
    let block = app.service.config().policy.block_size();
    let request_id = app.next_request.fetch_add(1, Ordering::Relaxed);
    let input_length = tokens.len() as u64;
    let route_req = pb::RouteRequest {
        request_id,
        session_id: session.map(|s| s.0),
        turn_id: turn,
        input_length,
        output_hint: req.output_hint,
        hash_ids: block_hashes(&tokens, block),
        rejected_by: None,
    };
    let mut excluded: Vec<WorkerId> = Vec::new();
    let mut attempt = 0u32;
    // The previous attempt's failure, answered when no other worker can take the request.
    let mut previous: Option<Response> = None;
    loop {
        app.breakers.tick(&app.service, app.service.now_ms());
        let decision = match app.service.route_excluding(&route_req, &excluded) {
            Ok(d) => d,
            Err(e) => return previous.unwrap_or_else(|| route_error_response(&e)),
        };
        if attempt > 0 {
            app.service.metrics().record_http_retry();
        }
        let may_retry = attempt < app.options.max_retries;
        let body = req.body.clone();
        let result = if req.stream {
            forward_stream(
                app,
                api,
                body,
                &decision,
                request_id,
                input_length,
                may_retry,
            )
            .await
        } else {
            forward_whole(app, api, body, &decision, request_id, input_length).await
        };
        match result {
            Attempt::Done(response) => return with_decision_headers(response, &decision),
            Attempt::Retry { response, failed } => {
                let response = with_decision_headers(response, &decision);
                if !may_retry {
                    return response;
                }
                previous = Some(response);
                attempt += 1;
                for w in failed {
                    if !excluded.contains(&w) {
                        excluded.push(w);
                    }
                }
                let wait = app.backoff(attempt);
                tracing::info!(
                    request = request_id,
                    attempt,
                    excluded = ?excluded,
                    wait_ms = wait.as_millis() as u64,
                    "re-routing a failed request"
                );
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// Adds `x-kvc-mode`, `x-kvc-decode-worker` and (P→D) `x-kvc-prefill-worker`.
fn with_decision_headers(mut response: Response, decision: &pb::RouteDecision) -> Response {
    let mode = ExecutionMode::from_proto(decision.mode).ok();
    let h = response.headers_mut();
    if let Some(mode) = mode {
        h.insert("x-kvc-mode", HeaderValue::from_static(mode.as_str()));
    }
    h.insert(
        "x-kvc-decode-worker",
        HeaderValue::from(decision.decode_worker),
    );
    if let Some(p) = decision.prefill_worker {
        h.insert("x-kvc-prefill-worker", HeaderValue::from(p));
    }
    response
}

/// Reports the outcome of `decision` (logged, never fatal).
fn report(app: &App, decision_id: u64, request_id: u64, outcome: Outcome, resident_tokens: u64) {
    if let Err(e) = app.service.report_outcome(&pb::OutcomeReport {
        decision_id,
        request_id,
        outcome: outcome.to_proto(),
        resident_tokens,
    }) {
        tracing::warn!(decision = decision_id, error = %e, "outcome not recorded");
    }
}

/// Finds the generated-token count in a streamed answer: the last `data:` line (SSE) or line
/// of JSON that carries `meta_info.completion_tokens` or `usage.completion_tokens`.
#[derive(Debug, Default)]
struct CompletionScan {
    line: Vec<u8>,
    overflow: bool,
    tokens: Option<u64>,
}

impl CompletionScan {
    /// Longest line examined; longer ones are skipped.
    const MAX_LINE: usize = 1 << 20;

    fn feed(&mut self, bytes: &[u8]) {
        for part in bytes.split_inclusive(|b| *b == b'\n') {
            if self.line.len() + part.len() > Self::MAX_LINE {
                self.overflow = true;
                self.line.clear();
            } else {
                self.line.extend_from_slice(part);
            }
            if part.ends_with(b"\n") {
                self.end_line();
            }
        }
    }

    fn end_line(&mut self) {
        if !self.overflow {
            let line = self.line.trim_ascii();
            let json = line.strip_prefix(b"data:").unwrap_or(line).trim_ascii();
            if let Some(n) = completion_tokens(json) {
                self.tokens = Some(n);
            }
        }
        self.line.clear();
        self.overflow = false;
    }

    fn finish(mut self) -> Option<u64> {
        self.end_line();
        self.tokens
    }
}

/// The SSE event that ends a client's stream when the worker failed mid-stream.
fn sse_error_event(message: &str, after_partial_event: bool) -> Bytes {
    let event = json!({ "error": {
        "message": message,
        "type": "worker_error",
        "code": StatusCode::BAD_GATEWAY.as_u16(),
    } });
    let lead = if after_partial_event { "\n\n" } else { "" };
    Bytes::from(format!("{lead}data: {event}\n\n"))
}

/// What one forwarding attempt came to. Either way its decision has been (or, for a relayed
/// stream, will be) reported.
enum Attempt {
    /// The client's answer.
    Done(Response),
    /// Failed before any byte reached the client, in a way worth trying elsewhere (connection
    /// refused or broken, timeout before an answer, 502-504): `response` is the failure as
    /// the client would get it, `failed` the workers to avoid.
    Retry {
        response: Response,
        failed: Vec<WorkerId>,
    },
}

/// The 502 for a worker without an HTTP address.
fn no_address(id: u32) -> Response {
    error_response(
        StatusCode::BAD_GATEWAY,
        "worker_error",
        &format!("worker {id} has no HTTP address"),
    )
}

/// Whether a worker's answer (or its absence) counts against its circuit breaker: no answer,
/// or a 5xx status.
fn breaker_failure<T>(r: &Result<T, ForwardError>, status: impl Fn(&T) -> u16) -> bool {
    match r {
        Ok(w) => status(w) >= 500,
        Err(_) => true,
    }
}

/// Whether a worker's failure may be retried on another worker: no answer (connection
/// refused or broken, timeout), or 502, 503 or 504.
fn retryable<T>(r: &Result<T, ForwardError>, status: impl Fn(&T) -> u16) -> bool {
    match r {
        Ok(w) => (502..=504).contains(&status(w)),
        Err(ForwardError::Io(_) | ForwardError::Timeout(_)) => true,
        Err(_) => false,
    }
}

impl App {
    /// Feeds one worker's result to its circuit breaker.
    fn feed_breaker(&self, worker: WorkerId, failed: bool) {
        if failed {
            self.breakers
                .on_failure(&self.service, worker, self.service.now_ms());
        } else {
            self.breakers.on_success(&self.service, worker);
        }
    }

    /// The jittered wait before retry `attempt` (from 1).
    fn backoff(&self, attempt: u32) -> Duration {
        let base = self
            .options
            .retry_backoff
            .saturating_mul(1 << attempt.saturating_sub(1).min(16));
        base.mul_f64(1.0 - 0.5 * self.breakers.unit())
    }

    /// Worker `id`'s endpoint.
    fn endpoint(&self, id: u32) -> Option<HttpWorker> {
        self.workers.get(WorkerId(id)).cloned()
    }

    /// Injects P's bootstrap address and a fresh room into `body`.
    fn add_bootstrap(&self, body: &mut serde_json::Map<String, Value>, p: &HttpWorker) {
        body.insert("bootstrap_host".into(), Value::from(p.url.host.clone()));
        body.insert("bootstrap_port".into(), Value::from(p.bootstrap_port));
        body.insert("bootstrap_room".into(), Value::from(self.room()));
    }
}

/// The streaming variant of [`forward_whole`]: P (if any) gets the request as before; D's
/// answer is relayed to the client as it arrives, and the outcome is reported when it has
/// ended. A failure before D's answer began (and, when `may_retry`, a 502-504 head) is
/// reported at once and returned as [`Attempt::Retry`].
async fn forward_stream(
    app: &Arc<App>,
    api: Api,
    mut body: serde_json::Map<String, Value>,
    decision: &pb::RouteDecision,
    request_id: u64,
    input_length: u64,
    may_retry: bool,
) -> Attempt {
    let timeout = app.options.request_timeout;
    let path = api.path();
    let decision_id = decision.decision_id;
    let d_id = WorkerId(decision.decode_worker);
    let retry = |response: Response, failed: Vec<WorkerId>| {
        report(app, decision_id, request_id, Outcome::WorkerFailed, 0);
        Attempt::Retry { response, failed }
    };
    let Some(d) = app.endpoint(d_id.0) else {
        return retry(no_address(d_id.0), vec![d_id]);
    };
    let prefill = match decision.prefill_worker {
        None => None,
        Some(p_id) => {
            let Some(p) = app.endpoint(p_id) else {
                return retry(no_address(p_id), vec![WorkerId(p_id)]);
            };
            app.add_bootstrap(&mut body, &p);
            let payload = Value::Object(body.clone()).to_string();
            let p_app = Arc::clone(app);
            app.breakers
                .on_dispatch(&app.service, WorkerId(p_id), app.service.now_ms());
            Some(tokio::spawn(async move {
                let r = post_json(&p.url, path, payload.as_bytes(), timeout).await;
                p_app.feed_breaker(WorkerId(p_id), breaker_failure(&r, |w| w.status));
                let ok = is_success(&r);
                if !ok {
                    let detail = match &r {
                        Ok(w) => format!("status {}", w.status),
                        Err(e) => e.to_string(),
                    };
                    tracing::warn!(worker = p_id, %detail, "prefill worker failed");
                }
                ok
            }))
        }
    };
    let payload = Value::Object(body).to_string();
    app.breakers
        .on_dispatch(&app.service, d_id, app.service.now_ms());
    let opened = post_streaming(&d.url, path, payload.as_bytes(), timeout).await;
    let head_failed = breaker_failure(&opened, |w| w.status);
    let head_retryable = retryable(&opened, |w| w.status);
    let mut ws = match opened {
        Ok(ws) if !(may_retry && head_retryable) => ws,
        other => {
            app.feed_breaker(d_id, true);
            if let Some(p) = prefill {
                p.abort();
            }
            let response = match &other {
                Ok(ws) => error_response(
                    StatusCode::from_u16(ws.status).unwrap_or(StatusCode::BAD_GATEWAY),
                    "worker_error",
                    &format!("decode worker answered {}", ws.status),
                ),
                Err(e) => forward_error_response("decode worker", e),
            };
            if head_retryable {
                return retry(response, vec![d_id]);
            }
            report(app, decision_id, request_id, Outcome::WorkerFailed, 0);
            return Attempt::Done(response);
        }
    };
    let status = StatusCode::from_u16(ws.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = ws
        .content_type
        .as_deref()
        .and_then(|c| HeaderValue::from_str(c).ok())
        .unwrap_or(HeaderValue::from_static("text/event-stream"));
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    let relay_app = Arc::clone(app);
    tokio::spawn(async move {
        let app = relay_app;
        let mut scan = CompletionScan::default();
        let mut ends_event = true;
        let mut worker_broke = false;
        let relayed = loop {
            let failure = match tokio::time::timeout(timeout, ws.next_chunk()).await {
                Ok(Ok(Some(piece))) => {
                    scan.feed(&piece);
                    ends_event = piece.ends_with(b"\n\n");
                    if tx.send(Ok(Bytes::from(piece))).await.is_err() {
                        tracing::debug!(request = request_id, "client went away mid-stream");
                        break false;
                    }
                    continue;
                }
                Ok(Ok(None)) => break true,
                Ok(Err(e)) => format!("decode worker: {e}"),
                Err(_) => format!("decode worker: nothing within {timeout:?}"),
            };
            worker_broke = true;
            tracing::warn!(request = request_id, error = %failure, "stream ended early");
            let _ = tx.send(Ok(sse_error_event(&failure, !ends_event))).await;
            break false;
        };
        // The client's stream ends here, before P is waited for.
        drop(tx);
        app.feed_breaker(d_id, head_failed || worker_broke);
        let prefill_ok = match prefill {
            None => true,
            Some(p) if relayed => matches!(tokio::time::timeout(timeout, p).await, Ok(Ok(true))),
            Some(p) => {
                p.abort();
                false
            }
        };
        let ok = relayed && prefill_ok && status.is_success();
        let (outcome, resident) = if ok {
            (Outcome::Ok, input_length + scan.finish().unwrap_or(0))
        } else {
            (Outcome::WorkerFailed, 0)
        };
        report(&app, decision_id, request_id, outcome, resident);
    });
    let body = axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Attempt::Done((status, [(header::CONTENT_TYPE, content_type)], body).into_response())
}

/// Sends the request where `decision` says, waits for the whole answer, reports the outcome
/// and feeds the workers' breakers; a failure of D worth trying elsewhere is
/// [`Attempt::Retry`].
async fn forward_whole(
    app: &App,
    api: Api,
    mut body: serde_json::Map<String, Value>,
    decision: &pb::RouteDecision,
    request_id: u64,
    input_length: u64,
) -> Attempt {
    let timeout = app.options.request_timeout;
    let path = api.path();
    let decision_id = decision.decision_id;
    let d_id = WorkerId(decision.decode_worker);
    let retry = |response: Response, failed: Vec<WorkerId>| {
        report(app, decision_id, request_id, Outcome::WorkerFailed, 0);
        Attempt::Retry { response, failed }
    };
    let Some(d) = app.endpoint(d_id.0) else {
        return retry(no_address(d_id.0), vec![d_id]);
    };
    let (prefill, dr) = match decision.prefill_worker {
        None => {
            let payload = Value::Object(body).to_string();
            app.breakers
                .on_dispatch(&app.service, d_id, app.service.now_ms());
            let dr = post_json(&d.url, path, payload.as_bytes(), timeout).await;
            (None, dr)
        }
        Some(p_id) => {
            let Some(p) = app.endpoint(p_id) else {
                return retry(no_address(p_id), vec![WorkerId(p_id)]);
            };
            app.add_bootstrap(&mut body, &p);
            let payload = Value::Object(body).to_string();
            app.breakers
                .on_dispatch(&app.service, WorkerId(p_id), app.service.now_ms());
            app.breakers
                .on_dispatch(&app.service, d_id, app.service.now_ms());
            let (pr, dr) = tokio::join!(
                post_json(&p.url, path, payload.as_bytes(), timeout),
                post_json(&d.url, path, payload.as_bytes(), timeout),
            );
            let p_failed = breaker_failure(&pr, |w| w.status);
            app.feed_breaker(WorkerId(p_id), p_failed);
            if !is_success(&pr) {
                let detail = match &pr {
                    Ok(w) => format!("status {}", w.status),
                    Err(e) => e.to_string(),
                };
                tracing::warn!(worker = p_id, %detail, "prefill worker failed");
            }
            (Some((WorkerId(p_id), p_failed, is_success(&pr))), dr)
        }
    };
    app.feed_breaker(d_id, breaker_failure(&dr, |w| w.status));
    if retryable(&dr, |w| w.status) {
        let mut failed = vec![d_id];
        if let Some((p, true, _)) = prefill {
            failed.push(p);
        }
        let response = match dr {
            Ok(w) => worker_answer(w),
            Err(e) => forward_error_response("decode worker", &e),
        };
        return retry(response, failed);
    }
    let prefill_ok = prefill.is_none_or(|(_, _, ok)| ok);
    let (outcome, resident) = match &dr {
        Ok(w) if prefill_ok && (200..300).contains(&w.status) => (
            Outcome::Ok,
            input_length + completion_tokens(&w.body).unwrap_or(0),
        ),
        _ => (Outcome::WorkerFailed, 0),
    };
    report(app, decision_id, request_id, outcome, resident);
    Attempt::Done(match dr {
        Ok(w) => worker_answer(w),
        Err(e) => forward_error_response("decode worker", &e),
    })
}

/// A worker's whole answer, passed through to the client.
fn worker_answer(w: WorkerResponse) -> Response {
    let status = StatusCode::from_u16(w.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = w
        .content_type
        .and_then(|c| HeaderValue::from_str(&c).ok())
        .unwrap_or(HeaderValue::from_static("application/json"));
    (status, [(header::CONTENT_TYPE, content_type)], w.body).into_response()
}

/// Every worker's `GET /health`, every `interval`, while the app lives. A transport failure,
/// a timeout or a 5xx counts against the worker's breaker; any other answer means it is up,
/// and closes a breaker whose cool-down has ended.
async fn health_checks_task(app: std::sync::Weak<App>, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(app) = app.upgrade() else { return };
        app.breakers.tick(&app.service, app.service.now_ms());
        let timeout = app.options.health_check_timeout;
        let mut checks = tokio::task::JoinSet::new();
        for (id, w) in &app.workers.workers {
            let (id, url) = (*id, w.url.clone());
            checks.spawn(async move { (id, client::get(&url, "/health", timeout).await) });
        }
        while let Some(done) = checks.join_next().await {
            let Ok((id, r)) = done else { continue };
            let failed = breaker_failure(&r, |w| w.status);
            app.service.metrics().record_health_check(!failed);
            if failed {
                let detail = match &r {
                    Ok(w) => format!("status {}", w.status),
                    Err(e) => e.to_string(),
                };
                tracing::debug!(worker = id.0, %detail, "health check failed");
                app.breakers
                    .on_failure(&app.service, id, app.service.now_ms());
            } else {
                app.breakers.on_recovered(&app.service, id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RouterConfig, SessionLimits};
    use kvc_admission::ManualClock;

    fn app(limits: SessionLimits) -> (App, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000));
        let config = RouterConfig {
            sessions: limits,
            ..RouterConfig::default()
        };
        let service = Arc::new(RouterService::with_clock(config, clock.clone()).unwrap());
        let app = App {
            service,
            workers: HttpWorkers::new(),
            breakers: Breakers::new(BreakerOptions::default(), Duration::from_secs(300)),
            options: HttpOptions::default(),
            turns: Mutex::new(HashMap::new()),
            next_request: AtomicU64::new(1),
            rooms: std::collections::hash_map::RandomState::new(),
            room_counter: AtomicU64::new(0),
        };
        (app, clock)
    }

    #[test]
    fn turns_count_per_session_and_restart_after_the_ttl() {
        let (app, clock) = app(SessionLimits {
            ttl_ms: 100,
            max_sessions: 10,
        });
        let (a, b) = (SessionId::from_key("a"), SessionId::from_key("b"));
        assert_eq!(app.next_turn(a), 1);
        assert_eq!(app.next_turn(a), 2);
        assert_eq!(app.next_turn(b), 1);
        clock.advance(100);
        assert_eq!(app.next_turn(a), 3);
        clock.advance(101);
        assert_eq!(app.next_turn(a), 1, "expired: a new session");
        assert_eq!(app.next_turn(b), 1);
    }

    #[test]
    fn the_turn_table_is_bounded_by_the_session_limit() {
        let (app, clock) = app(SessionLimits {
            ttl_ms: 1_000_000,
            max_sessions: 2,
        });
        let ids: Vec<SessionId> = (0..3)
            .map(|i| SessionId::from_key(&i.to_string()))
            .collect();
        for id in &ids {
            app.next_turn(*id);
            app.next_turn(*id);
            clock.advance(1);
        }
        assert_eq!(app.turns.lock().len(), 2);
        // The least recently seen session was forgotten; the others kept their count.
        assert_eq!(app.next_turn(ids[0]), 1);
        assert_eq!(app.next_turn(ids[2]), 3);
        assert_eq!(app.turns.lock().len(), 2);
    }

    #[test]
    fn rooms_are_below_2_pow_63_and_differ() {
        let (app, _) = app(SessionLimits::default());
        let rooms: std::collections::HashSet<u64> = (0..1_000).map(|_| app.room()).collect();
        assert_eq!(rooms.len(), 1_000);
        assert!(rooms.iter().all(|r| *r < 1 << 63));
    }

    #[test]
    fn completion_tokens_are_found_in_split_sse_events() {
        let mut scan = CompletionScan::default();
        scan.feed(b"data: {\"meta_info\": {\"completion_");
        scan.feed(b"tokens\": 3}}\n\ndata: {\"usage\": {\"completion_tokens\": 5}}\n");
        scan.feed(b"\ndata: {\"text\": \"no count\"}\n\ndata: [DONE]\n\n");
        assert_eq!(scan.finish(), Some(5), "the last count seen");
        let mut scan = CompletionScan::default();
        scan.feed(b"{\"usage\": {\"completion_tokens\": 7}}");
        assert_eq!(scan.finish(), Some(7), "a final line without its line end");
        let mut scan = CompletionScan::default();
        scan.feed(&vec![b'x'; CompletionScan::MAX_LINE + 1]);
        scan.feed(b"{\"usage\": {\"completion_tokens\": 9}}\n");
        assert_eq!(scan.finish(), None, "an over-long line is skipped whole");
        assert_eq!(CompletionScan::default().finish(), None);
    }

    #[test]
    fn sse_error_events_are_well_formed() {
        let e = sse_error_event("decode worker: gone", false);
        let text = std::str::from_utf8(&e).unwrap();
        let json = text
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        let v: Value = serde_json::from_str(json).unwrap();
        assert_eq!(v["error"]["message"], "decode worker: gone");
        assert_eq!(v["error"]["type"], "worker_error");
        assert_eq!(v["error"]["code"], 502);
        let after = sse_error_event("x", true);
        assert!(
            after.starts_with(b"\n\ndata: "),
            "a cut event is closed first"
        );
    }

    #[test]
    fn workers_need_http_urls() {
        let mut w = HttpWorkers::new();
        assert!(w.is_empty());
        w.insert(WorkerId(3), "http://h:1", None).unwrap();
        assert_eq!(
            w.get(WorkerId(3)).unwrap().bootstrap_port,
            DEFAULT_BOOTSTRAP_PORT
        );
        w.insert(WorkerId(3), "http://h:2", Some(7)).unwrap();
        assert_eq!(w.len(), 1);
        assert_eq!(w.get(WorkerId(3)).unwrap().url.port, 2);
        assert_eq!(w.get(WorkerId(3)).unwrap().bootstrap_port, 7);
        assert!(matches!(
            w.insert(WorkerId(4), "https://h:1", None),
            Err(ForwardError::BadUrl(_))
        ));
        assert_eq!(w.get(WorkerId(4)), None);
    }
}
