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
//! **Tokens and block hashes.** From `input_ids` (or a token-id `prompt`) with
//! [`block_hashes`] over the policy's block size. Text goes through the [`Tokenizer`] of
//! [`HttpOptions::tokenizer`] first: a Hugging Face `tokenizer.json` (`http.tokenizer` in the
//! configuration, `--tokenizer` on the command line; loaded at startup, a bad file stops the
//! start with an error naming it), else [`fallback_tokens`] (one token per whitespace-separated
//! word). A chat request's text is its messages through the simple template of [`chat_prompt`]
//! (used for hashing only; the worker gets the messages and applies its own template), then
//! the same tokenizer. The input length is the number of tokens.
//!
//! **Session and turn.** The session key is the `x-session-id` header (name configurable in
//! [`HttpOptions::session_header`]) or, for `/generate`, `session_params.id`; it maps to a
//! session id with [`kvc_core::SessionId::from_key`]. The turn is a per-session counter kept
//! here (bounded by the router's `sessions.ttl-ms` and `sessions.max`).
//!
//! **Session inference.** A request with neither is placed by its prefix. The front remembers,
//! for each session it knows (keyed or inferred; same bounds), the chained block hash at the
//! last *full* block of the session's latest prompt. A request whose block hashes hold one of
//! those hashes at the same position extends that prompt, so it continues that session: the
//! deepest such match wins, ties go to the most recently seen session. The match must be at
//! least [`HttpOptions::infer_min_blocks`] blocks deep (`http.infer-min-blocks`, default 4), so
//! that a shared system prompt alone never glues two conversations together. A request with no
//! such match but at least that many full blocks starts a new inferred session, keyed
//! `kvc-inferred-<16 hex digits>` (a per-process keyed hash of its first block hashes and its
//! request id), which later requests can continue; a shorter one is routed without a session.
//! `infer-min-blocks = 0` turns inference off. Counted in
//! `kvc_router_http_inferred_sessions_total{result="continued"|"new"}`.
//!
//! **Forwarding.** For a decision through a prefill worker (`turn1-seed`, `fallback`,
//! `reseed`) the same JSON body, with `bootstrap_host` (P's host), `bootstrap_port` (P's
//! bootstrap port) and a random `bootstrap_room` injected, goes to P and D concurrently; D's
//! answer is returned. `direct-to-d` sends the body to D alone with the session's continuation
//! parameters: for `/generate` without `session_params`, `session_params: {"id": <session
//! key>}` is added (a client's own `session_params` are kept as sent). `colocated` sends the
//! body to the worker. With a session, every worker request (P and D, every path, every API)
//! carries the session header (the configured name) with the session key. Each worker call has
//! the deadline [`HttpOptions::request_timeout`].
//!
//! The outcome is `ok` when D answered 2xx in full (the resident tokens are the input plus the
//! answer's `meta_info.completion_tokens` or `usage.completion_tokens`), else `worker-failed`.
//! A prefill worker's fate does not change that once D has answered: if P fails while (or
//! after) D answers, D's answer goes to the client and P's failure counts against P's circuit
//! breaker. If P fails *before* D has answered anything, D is not waited for (it would only
//! wait for KV that never comes): D's request is dropped (not counted against D), the decision
//! reported `worker-failed`, and the request is retried without P when P's failure is
//! retryable (see *Retries*); otherwise P's answer goes to the client. A worker that answered
//! non-2xx has its status and body passed through; one that did not answer gives 502 (504 on
//! a timeout). Responses carry `x-kvc-mode`, `x-kvc-decode-worker`, on a P→D path
//! `x-kvc-prefill-worker`, for a fall-through `x-kvc-reason` (e.g. `session-cap-rejected`),
//! and with a session `x-kvc-session` (the key, inferred ones included).
//!
//! **Admission refusals by D (the contract for engines with decode-side admission).** A
//! decode worker that cannot take a request — no room for a direct-to-D turn, or the session
//! is not resident — answers **`503` with the header `x-kvc-admission: rejected`** (and a JSON
//! error body). This is not a worker failure: it counts as a success for D's circuit breaker
//! and does not exclude D. For a direct-to-D decision, the decision is reported `rejected`
//! (the policy's view of what D holds is left as it was), and the request is routed again with
//! `rejected_by = D`, exactly as a gRPC caller would: the policy answers with a P→D path
//! (`fallback` with `session-cap-rejected`, or `reseed` with `migrated` after repeated
//! refusals), which is forwarded. This re-route happens at most once per request and is not a
//! retry. A refusal on a P→D path (or a second refusal) is reported `rejected` and tried on
//! another decode worker like a retryable failure, if a retry is left; otherwise the client
//! gets D's 503. Counted in `kvc_router_http_admission_rejects_total`. A decode worker whose
//! engine cannot append-prefill at all is declared with `append-prefill = false` in its
//! `[[workers]]` entry instead: it never gets a direct-to-D turn (later turns go P→D, reason
//! `direct-unsupported`).
//!
//! **Streaming.** With `"stream": true` the body is forwarded the same way, but D's answer is
//! relayed to the client as it arrives (chunked, with D's `Content-Type`, normally
//! `text/event-stream`), never buffered whole; P's answer is read and dropped. The client's
//! answer starts with D's first piece of body: until then the request can still be retried
//! (or re-routed after a refusal). The deadline [`HttpOptions::request_timeout`] bounds the wait
//! for D's response head, for its first piece and for each further one. If D's connection
//! breaks, its body is malformed or it goes silent past the deadline mid-stream, the client's
//! stream ends with one SSE error event,
//! `data: {"error": {"message": "...", "type": "worker_error", "code": 502}}`, and the
//! request is reported `worker-failed`. The outcome is reported when the stream has ended:
//! `ok` (resident tokens: the input plus the last `completion_tokens` seen in a `data:` event)
//! when D's stream completed with a 2xx status, else `worker-failed` (also when the client
//! went away first: nothing is claimed resident). A D that cannot be reached gets the same
//! JSON 502/504 as without streaming.
//!
//! **Resilience.** Options in [`HttpOptions`] (the `[http]` table of the configuration,
//! [`crate::HttpConfig`]):
//!
//! - *Retries.* A request that failed before any byte reached the client — its decode worker
//!   refused the connection, broke it, gave no answer (streaming: no head, or no first piece)
//!   within the deadline, or answered 502, 503 or 504; or its prefill worker failed that way
//!   before D answered — is reported `worker-failed`, then routed again with
//!   [`RouterService::route_excluding`] (the workers that failed it count as down for that
//!   decision) and forwarded again, at most [`HttpOptions::max_retries`] times, after a
//!   jittered backoff ([`HttpOptions::retry_backoff`], doubling). A prefill worker that had
//!   already failed alongside a failed D is excluded too. When no other worker can take it,
//!   or the retries are spent, the client gets the last failure. Nothing is retried once a
//!   stream has started.
//! - *Circuit breakers.* Per worker, [`BreakerOptions::failure_threshold`] consecutive
//!   failures (connect error, timeout, 5xx other than an admission refusal, a stream broken
//!   off, a failed health check) open it: the worker is taken out of rotation with
//!   [`RouterService::set_http_down`], so no policy picks it, for a cool-down that doubles with
//!   each re-opening up to [`BreakerOptions::max_cooldown`] (with jitter). Then it is
//!   half-open: back in rotation for one trial request (out again while the trial runs); the
//!   trial's success closes the breaker, its failure (or no result within
//!   [`HttpOptions::request_timeout`]) opens it again; a trial dropped for the other worker's
//!   failure leaves it half-open for a new trial. Any successful request closes it.
//! - *Health checks.* Every [`HttpOptions::health_check_interval`], each worker's `GET
//!   /health` is checked within [`HttpOptions::health_check_timeout`]: no answer or a 5xx
//!   counts against its breaker; any other answer closes a half-open breaker. The checks run
//!   on the Tokio runtime the app is built in (none outside a runtime) and stop when the app
//!   is dropped.
//!
//! Metrics: `kvc_router_http_breaker_state`, `kvc_router_http_breaker_transitions_total`,
//! `kvc_router_http_retries_total`, `kvc_router_http_health_checks_total`,
//! `kvc_router_http_admission_rejects_total`, `kvc_router_http_inferred_sessions_total` (see
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
mod forward;
mod infer;
mod request;
mod tokens;

pub use breaker::{BreakerOptions, BreakerState};
pub use client::{
    ADMISSION_HEADER, BaseUrl, ForwardError, MAX_RESPONSE_BYTES, WorkerResponse, WorkerStream,
    parse_response, post_json, post_json_with_headers, post_streaming, post_streaming_with_headers,
};
pub use request::{
    DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_TOKENS, chat_prompt,
};
pub use tokens::{Tokenizer, TokenizerError, block_hashes, fallback_tokens};

use crate::{DecisionOutcome, RequestError, RouterDecision, RouterService};
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use breaker::Breakers;
use forward::{Attempt, Forward, breaker_failure, direct_body, forward_stream, forward_whole};
use infer::{Inferred, SessionBook};
use kvc_core::{BlockHash, ExecutionMode, Outcome, RequestId, StableName, TurnId, WorkerId};
use kvc_policy::RouteRequest;
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

/// The response header naming the session a request was routed in (the client's key, or the
/// key of an inferred session).
pub const SESSION_RESPONSE_HEADER: &str = "x-kvc-session";

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
    /// Header carrying the session key (read from the client, sent to the workers). Default
    /// `x-session-id`.
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
    /// How text prompts become token ids. Default: the whitespace fallback.
    pub tokenizer: Tokenizer,
    /// Session inference: how many leading full blocks a request without a session key must
    /// share with a known session's latest prompt to continue it (see the module docs); 0
    /// turns inference off. Default 4.
    pub infer_min_blocks: u32,
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
            tokenizer: Tokenizer::fallback(),
            infer_min_blocks: 4,
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
    let app = Arc::new(App::new(service, workers, options));
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

struct App {
    service: Arc<RouterService>,
    workers: HttpWorkers,
    breakers: Breakers,
    options: HttpOptions,
    sessions: Mutex<SessionBook>,
    next_request: AtomicU64,
    rooms: std::collections::hash_map::RandomState,
    room_counter: AtomicU64,
}

impl App {
    fn new(service: Arc<RouterService>, workers: HttpWorkers, options: HttpOptions) -> App {
        let sessions = SessionBook::new(service.config().sessions, options.infer_min_blocks);
        App {
            breakers: Breakers::new(options.breaker, options.request_timeout),
            sessions: Mutex::new(sessions),
            service,
            workers,
            options,
            next_request: AtomicU64::new(1),
            rooms: std::collections::hash_map::RandomState::new(),
            room_counter: AtomicU64::new(0),
        }
    }

    /// A random bootstrap room in `0..2^63`.
    fn room(&self) -> u64 {
        let mut h = self.rooms.build_hasher();
        h.write_u64(self.room_counter.fetch_add(1, Ordering::Relaxed));
        h.finish() >> 1
    }

    /// The key of a new inferred session: a hash (keyed per process) of the request's first
    /// block hashes and its id.
    fn inferred_key(&self, hash_ids: &[u64], request_id: u64) -> String {
        let mut h = self.rooms.build_hasher();
        let take = (self.options.infer_min_blocks as usize).max(1);
        for id in hash_ids.iter().take(take) {
            h.write_u64(*id);
        }
        h.write_u64(request_id);
        format!("kvc-inferred-{:016x}", h.finish())
    }

    /// The session of a request and its turn (see [`SessionBook::resolve`]), counted in the
    /// metrics when inferred.
    fn resolve_session(
        &self,
        key: Option<&str>,
        hash_ids: &[u64],
        full_blocks: usize,
        request_id: u64,
    ) -> Option<infer::Resolved> {
        let prompt = infer::Prompt {
            key,
            hashes: hash_ids,
            full_blocks,
        };
        let now = self.service.now_ms();
        let resolved = self
            .sessions
            .lock()
            .resolve(prompt, now, || self.inferred_key(hash_ids, request_id));
        if let Some(inferred) = resolved.as_ref().and_then(|r| r.inferred) {
            self.service
                .metrics()
                .record_inferred_session(inferred == Inferred::Continued);
        }
        resolved
    }

    /// The token ids of a text prompt. A tokenizer file's encoding runs on the blocking pool
    /// (long prompts take a while); the fallback runs inline.
    async fn tokenize(&self, text: &str) -> Vec<u32> {
        let tokenizer = &self.options.tokenizer;
        if tokenizer.path().is_none() {
            return tokenizer.encode(text);
        }
        let (tokenizer, owned) = (tokenizer.clone(), text.to_owned());
        match tokio::task::spawn_blocking(move || tokenizer.encode(&owned)).await {
            Ok(tokens) => tokens,
            Err(e) => {
                tracing::warn!(error = %e, "tokenizer task failed; using the whitespace fallback");
                fallback_tokens(text)
            }
        }
    }

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
        Prompt::Text(text) => app.tokenize(text).await,
    };
    if tokens.is_empty() {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the prompt is empty",
        );
    }
    let block = app.service.config().policy.block_size();
    let hash_ids = block_hashes(&tokens, block);
    let full_blocks = tokens.len() / block.tokens() as usize;
    let request_id = app.next_request.fetch_add(1, Ordering::Relaxed);
    let client_key = header_key.or_else(|| req.session_key.clone());
    let resolved = app.resolve_session(client_key.as_deref(), &hash_ids, full_blocks, request_id);
    let input_length = tokens.len() as u64;
    let hash_ids: Vec<BlockHash> = hash_ids.into_iter().map(BlockHash).collect();
    let mut route_req = RouteRequest {
        request_id: RequestId(request_id),
        session: resolved.as_ref().map(|r| r.session),
        turn: resolved.as_ref().map(|r| TurnId(r.turn)),
        input_length,
        output_hint: req.output_hint,
        hash_ids: &hash_ids,
        rejected_by: None,
    };
    let fwd = Forward {
        api,
        request_id,
        input_length,
        session_key: resolved.map(|r| r.key),
    };
    let session_key = fwd.session_key.clone();
    let respond = |response: Response, decision: &RouterDecision| {
        with_decision_headers(response, decision, session_key.as_deref())
    };
    let mut excluded: Vec<WorkerId> = Vec::new();
    let mut attempt = 0u32;
    let mut retrying = false;
    let mut admission_rerouted = false;
    // The previous attempt's failure, answered when no other worker can take the request.
    let mut previous: Option<Response> = None;
    loop {
        app.breakers.tick(&app.service, app.service.now_ms());
        let decision = match app.service.route_excluding(&route_req, &excluded) {
            Ok(d) => d,
            Err(e) => return previous.unwrap_or_else(|| route_error_response(&e)),
        };
        // A `rejected_by` is answered by one decision; later retries are plain re-routes.
        route_req.rejected_by = None;
        if std::mem::take(&mut retrying) {
            app.service.metrics().record_http_retry();
        }
        let may_retry = attempt < app.options.max_retries;
        let mut body = req.body.clone();
        if decision.mode == ExecutionMode::DirectToD {
            direct_body(api, &mut body, fwd.session_key.as_deref());
        }
        let result = if req.stream {
            forward_stream(app, &fwd, body, &decision, may_retry).await
        } else {
            forward_whole(app, &fwd, body, &decision).await
        };
        let (response, failed) = match result {
            Attempt::Done(response) => return respond(response, &decision),
            Attempt::Retry { response, failed } => (respond(response, &decision), failed),
            Attempt::Rejected {
                response,
                decode,
                direct,
            } => {
                app.service.metrics().record_http_admission_reject();
                let response = respond(response, &decision);
                if direct && !admission_rerouted {
                    // Like a gRPC caller whose admission refused a direct-to-D decision: route
                    // again with `rejected_by`; the policy answers with a P→D path. Not a retry,
                    // and at most once per request.
                    admission_rerouted = true;
                    route_req.rejected_by = Some(decode);
                    previous = Some(response);
                    tracing::info!(
                        request = request_id,
                        decode = decode.0,
                        "direct-to-D turn refused by the decode worker; re-routing through P"
                    );
                    continue;
                }
                (response, vec![decode])
            }
        };
        if !may_retry {
            return response;
        }
        previous = Some(response);
        attempt += 1;
        retrying = true;
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

/// Adds `x-kvc-mode`, `x-kvc-decode-worker`, (P→D) `x-kvc-prefill-worker`, (fall-through)
/// `x-kvc-reason` and (with a session) `x-kvc-session`.
fn with_decision_headers(
    mut response: Response,
    decision: &RouterDecision,
    session_key: Option<&str>,
) -> Response {
    let h = response.headers_mut();
    h.insert(
        "x-kvc-mode",
        HeaderValue::from_static(decision.mode.as_str()),
    );
    h.insert(
        "x-kvc-decode-worker",
        HeaderValue::from(decision.decode_worker.0),
    );
    if let Some(p) = decision.prefill_worker {
        h.insert("x-kvc-prefill-worker", HeaderValue::from(p.0));
    }
    if let Some(reason) = decision.fall_through_reason {
        h.insert("x-kvc-reason", HeaderValue::from_static(reason.as_str()));
    }
    if let Some(v) = session_key.and_then(|k| HeaderValue::from_str(k).ok()) {
        h.insert(SESSION_RESPONSE_HEADER, v);
    }
    response
}

/// Reports the outcome of `decision` (logged, never fatal).
fn report(app: &App, decision_id: u64, request_id: u64, outcome: Outcome, resident_tokens: u64) {
    if let Err(e) = app.service.report_outcome(&DecisionOutcome {
        decision_id,
        request_id: RequestId(request_id),
        outcome,
        resident_tokens,
    }) {
        tracing::warn!(decision = decision_id, error = %e, "outcome not recorded");
    }
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
    use kvc_core::FallThroughReason;

    fn app(limits: SessionLimits, options: HttpOptions) -> (App, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000));
        let config = RouterConfig {
            sessions: limits,
            ..RouterConfig::default()
        };
        let service = Arc::new(RouterService::with_clock(config, clock.clone()).unwrap());
        (App::new(service, HttpWorkers::new(), options), clock)
    }

    #[test]
    fn rooms_are_below_2_pow_63_and_differ() {
        let (app, _) = app(SessionLimits::default(), HttpOptions::default());
        let rooms: std::collections::HashSet<u64> = (0..1_000).map(|_| app.room()).collect();
        assert_eq!(rooms.len(), 1_000);
        assert!(rooms.iter().all(|r| *r < 1 << 63));
    }

    #[test]
    fn sessions_are_resolved_with_the_router_limits_and_counted() {
        let (app, clock) = app(
            SessionLimits {
                ttl_ms: 100,
                max_sessions: 10,
            },
            HttpOptions {
                infer_min_blocks: 2,
                ..HttpOptions::default()
            },
        );
        let h = [11, 12, 13];
        let r = app.resolve_session(Some("a"), &h, 3, 1).unwrap();
        assert_eq!((r.turn, r.inferred), (1, None));
        clock.advance(101);
        let r = app.resolve_session(Some("a"), &h, 3, 2).unwrap();
        assert_eq!(r.turn, 1, "expired after the router's session TTL");
        // No key: it extends session `a`'s prompt.
        let longer = [11, 12, 13, 14];
        let r = app.resolve_session(None, &longer, 4, 3).unwrap();
        assert_eq!(&*r.key, "a");
        assert_eq!((r.turn, r.inferred), (2, Some(Inferred::Continued)));
        let other = [21, 22, 23];
        let r = app.resolve_session(None, &other, 3, 4).unwrap();
        assert_eq!(r.inferred, Some(Inferred::New));
        assert!(r.key.starts_with("kvc-inferred-"), "{}", r.key);
        assert_eq!(r.key.len(), "kvc-inferred-".len() + 16);
        assert_ne!(app.inferred_key(&other, 4), app.inferred_key(&other, 5));
        let m = app.service.metrics();
        assert_eq!(
            (m.inferred_sessions(true), m.inferred_sessions(false)),
            (1, 1)
        );
    }

    #[tokio::test]
    async fn text_goes_through_the_configured_tokenizer() {
        let (fallback, _) = app(SessionLimits::default(), HttpOptions::default());
        assert_eq!(fallback.tokenize("a b c").await, fallback_tokens("a b c"));
        let dir = std::env::temp_dir().join(format!("kvc-router-tok-app-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, tokens::tests::word_level_json(&["a", "b", "c"])).unwrap();
        let options = HttpOptions {
            tokenizer: Tokenizer::from_file(&path).unwrap(),
            ..HttpOptions::default()
        };
        let (app, _) = app(SessionLimits::default(), options);
        assert_eq!(app.tokenize("a b c zzz").await, vec![1, 2, 3, 0]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn decision_headers_name_the_mode_workers_and_session() {
        let decision = RouterDecision {
            decision_id: 1,
            mode: ExecutionMode::Fallback,
            fall_through_reason: Some(FallThroughReason::DirectUnsupported),
            prefill_worker: Some(WorkerId(0)),
            decode_worker: WorkerId(2),
            cached_tokens: 0,
            recommended_pause_ms: 0,
            need_tokens: 0,
            probe_rejected_by: None,
        };
        let r = with_decision_headers(StatusCode::OK.into_response(), &decision, Some("s-1"));
        let h = r.headers();
        assert_eq!(h["x-kvc-mode"], "fallback");
        assert_eq!(h["x-kvc-decode-worker"], "2");
        assert_eq!(h["x-kvc-prefill-worker"], "0");
        assert_eq!(h["x-kvc-reason"], "direct-unsupported");
        assert_eq!(h[SESSION_RESPONSE_HEADER], "s-1");
        let r = with_decision_headers(StatusCode::OK.into_response(), &decision, Some("bad\nkey"));
        assert!(!r.headers().contains_key(SESSION_RESPONSE_HEADER));
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
