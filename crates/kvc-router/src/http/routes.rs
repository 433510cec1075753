//! The axum routes of the front and their handlers: the POST APIs (body read within its
//! deadline, or refused as a JSON error in the API's shape), Anthropic's token count, readiness (`GET /health`, `GET /readyz`), liveness
//! (`GET /livez`), `GET /v1/models`, and JSON answers for unknown paths and methods.

use super::app::App;
use super::request::Api;
use super::responses::{
    answer_or_error, body_error_response, error_response, in_anthropic_shape, json_response,
    no_address,
};
use super::retry::serve_request;
use crate::worker_http::Call;
use axum::Router;
use axum::body::Bytes;
use axum::extract::Path;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::Response;
use axum::routing::{MethodRouter, get, post};
use kvc_core::{WorkerId, WorkerRole};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// The paths answered on a connection past the connection limit (see `listener`): what
/// health checkers and orchestrators call.
pub(super) const PROBE_PATHS: [&str; 3] = ["/health", "/livez", "/readyz"];

/// The front's routes over `app`.
pub(super) fn router(app: Arc<App>) -> Router {
    let body_limit = DefaultBodyLimit::max(app.options.max_body_bytes);
    Router::new()
        .route("/generate", post_endpoint(Api::Generate))
        .route("/v1/completions", post_endpoint(Api::Completions))
        .route("/v1/chat/completions", post_endpoint(Api::ChatCompletions))
        .route("/v1/messages", post_endpoint(Api::Messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/responses", post_endpoint(Api::Responses))
        .route("/v1/sessions/{key}", get(show_session).delete(end_session))
        .route("/health", get(readiness))
        .route("/readyz", get(readiness))
        .route("/livez", get(liveness))
        .route("/v1/models", get(models))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(body_limit)
        .with_state(app)
}

/// The axum handler of the POST endpoint for `api`: the body read within
/// [`super::HttpOptions::body_read_timeout`] (or refused by axum, e.g. too large), served as
/// `api`; the front's own errors in the API's shape.
fn post_endpoint(api: Api) -> MethodRouter<Arc<App>> {
    post(
        move |State(app): State<Arc<App>>, request: Request| async move {
            let headers = request.headers().clone();
            let response = match read_body(&app, request).await {
                Ok(body) => serve_request(&app, api, &headers, body).await,
                Err(response) => response,
            };
            if api.anthropic_errors() {
                in_anthropic_shape(response)
            } else {
                response
            }
        },
    )
}

/// A request's body, read within [`super::HttpOptions::body_read_timeout`]; else the error
/// to answer (axum's refusal, e.g. too large, or the 408).
async fn read_body(app: &Arc<App>, request: Request) -> Result<Bytes, Response> {
    let deadline = app.options.body_read_timeout;
    match tokio::time::timeout(deadline, Bytes::from_request(request, app)).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(e)) => Err(body_error_response(&e)),
        Err(_) => Err(body_timeout(deadline)),
    }
}

/// `POST /v1/messages/count_tokens` (Anthropic): nothing to route (no generation, no KV), so
/// the body goes as it is to one routable vLLM worker, taken in turn, and its answer back;
/// the front's own errors in Anthropic's shape.
async fn count_tokens(State(app): State<Arc<App>>, request: Request) -> Response {
    let response = match read_body(&app, request).await {
        Ok(body) => forward_count_tokens(&app, body).await,
        Err(response) => response,
    };
    in_anthropic_shape(response)
}

async fn forward_count_tokens(app: &Arc<App>, body: Bytes) -> Response {
    if !app.workers.all_vllm() {
        return not_vllm(Api::Messages);
    }
    let views = app.service.worker_views();
    let routable: Vec<WorkerId> = views
        .iter()
        .filter(|v| v.is_routable() && app.workers.get(v.id).is_some())
        .map(|v| v.id)
        .collect();
    if routable.is_empty() {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "no routable worker to count the tokens",
        );
    }
    let id = routable[app.next_request_id() as usize % routable.len()];
    let Some(endpoint) = app.endpoint(id) else {
        return no_address(id);
    };
    let answer = app
        .client
        .post_whole(Call {
            base: endpoint.url,
            path: "/v1/messages/count_tokens",
            headers: &[],
            body,
            timeout: app.options.request_timeout,
        })
        .await;
    answer_or_error(&format!("worker {}", id.0), answer)
}

/// `GET /v1/sessions/{key}`: what the router holds of session `key` — the decode worker it
/// was last routed to (`decode_worker`, its id and name), whether its KV is believed there
/// (`residency`: `resident`, `not-resident` or `evicted`), its tokens resident there as last
/// reported (`resident_tokens`), the blocks of its last request (`blocks`) and how many of
/// them the router's live view places on that worker (`held_blocks`), and how often it moved
/// (`moves`). 404 for a session the router does not hold; 400 for a key over
/// `http.max-session-id-bytes`.
async fn show_session(State(app): State<Arc<App>>, Path(key): Path<String>) -> Response {
    if let Err(m) = super::trust::check_session_id(&key, app.options.max_session_id_bytes) {
        return error_response(StatusCode::BAD_REQUEST, "invalid_request_error", &m);
    }
    let Some(v) = app
        .service
        .session_view(kvc_core::SessionId::from_key(&key))
    else {
        return error_response(
            StatusCode::NOT_FOUND,
            "not_found",
            &format!("no session {key:?}: never seen, ended, or expired"),
        );
    };
    let name = v.decode.and_then(|d| {
        app.service
            .config()
            .workers
            .iter()
            .find(|w| w.id == d.0)
            .map(|w| w.display_name())
    });
    json_response(
        StatusCode::OK,
        &json!({
            "session": key,
            "decode_worker": v.decode.map(|d| d.0),
            "decode_worker_name": name,
            "residency": v.residency,
            "resident_tokens": v.resident_tokens,
            "blocks": v.blocks,
            "held_blocks": v.held_blocks,
            "moves": v.moves,
        }),
    )
}

/// `DELETE /v1/sessions/{key}`: the client ends session `key` (its session header's value,
/// or an inferred session's `x-kvc-session`). The front and the router forget it at once, so
/// what the router counted resident for it is free for the next session placed on its decode
/// worker (a vLLM engine needs nothing more: the blocks stay in its prefix cache, unreferenced
/// and first to go). 200 `{"session", "ended": true}`; 404 for a session the router does not
/// know (never seen, already ended, or expired); 400 for a key over
/// `http.max-session-id-bytes`.
async fn end_session(State(app): State<Arc<App>>, Path(key): Path<String>) -> Response {
    if let Err(m) = super::trust::check_session_id(&key, app.options.max_session_id_bytes) {
        return error_response(StatusCode::BAD_REQUEST, "invalid_request_error", &m);
    }
    let session = kvc_core::SessionId::from_key(&key);
    let front = app.sessions.end(session);
    let router = app.service.end_session(session);
    if front || router {
        json_response(StatusCode::OK, &json!({ "session": key, "ended": true }))
    } else {
        error_response(
            StatusCode::NOT_FOUND,
            "not_found",
            &format!("no session {key:?}: never seen, already ended, or expired"),
        )
    }
}

/// 400 for an API only vLLM workers serve here, on a cluster with other workers.
pub(super) fn not_vllm(api: Api) -> Response {
    error_response(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        &format!(
            "{} is served through vLLM workers only (engine = \"vllm\" on every [[workers]] \
             entry): this cluster has workers of another engine",
            api.path()
        ),
    )
}

/// 408 for a body that did not arrive in time; the connection is closed after it.
fn body_timeout(deadline: Duration) -> Response {
    let mut r = error_response(
        StatusCode::REQUEST_TIMEOUT,
        "timeout",
        &format!(
            "the request body did not arrive within {} ms (http.body-read-timeout-ms)",
            deadline.as_millis()
        ),
    );
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// The front's readiness: routable workers per role and, when a new request cannot be
/// routed, why.
pub(crate) struct Readiness {
    prefill: usize,
    decode: usize,
    colocated: usize,
    healthy: usize,
    workers: usize,
    /// Why a new request cannot be routed; `None` when it can.
    pub(crate) missing: Option<String>,
}

/// Readiness of `app`: a colocated cluster needs one routable colocated worker; a
/// prefill/decode cluster one routable prefill and one routable decode worker (a first turn
/// goes through P). A worker is routable when its state is fresh and healthy, its circuit
/// breaker is not open, and it has an HTTP address. Within its first seconds a router also
/// waits for every worker's KV-cache events to catch up by replay
/// ([`crate::RouterService::events_catching_up`]).
pub(crate) fn readiness_of(app: &App) -> Readiness {
    let views = app.service.worker_views();
    let routable = |role: WorkerRole| {
        views
            .iter()
            .filter(|v| v.role == role && v.is_routable() && app.workers.get(v.id).is_some())
            .count()
    };
    let total = |role: WorkerRole| views.iter().filter(|v| v.role == role).count();
    let (p, d, c) = (
        routable(WorkerRole::Prefill),
        routable(WorkerRole::Decode),
        routable(WorkerRole::Colocated),
    );
    let missing = if p + d + c == 0 {
        Some("no routable worker".to_owned())
    } else if total(WorkerRole::Colocated) > 0 {
        (c == 0).then(|| "no routable colocated worker".to_owned())
    } else if p == 0 {
        Some(format!(
            "no routable prefill worker (0 of {}): a first turn cannot be routed",
            total(WorkerRole::Prefill)
        ))
    } else if d == 0 {
        Some(format!(
            "no routable decode worker (0 of {})",
            total(WorkerRole::Decode)
        ))
    } else {
        app.service.events_catching_up()
    };
    Readiness {
        prefill: p,
        decode: d,
        colocated: c,
        healthy: views.iter().filter(|v| v.is_routable()).count(),
        workers: views.len(),
        missing,
    }
}

/// Readiness: 200 while a new request can be routed, else 503 saying why (see
/// [`readiness_of`]).
async fn readiness(State(app): State<Arc<App>>) -> Response {
    let r = readiness_of(&app);
    let routable = json!({ "prefill": r.prefill, "decode": r.decode, "colocated": r.colocated });
    match r.missing {
        None => json_response(
            StatusCode::OK,
            &json!({ "status": "ok", "healthy_workers": r.healthy, "workers": r.workers,
                     "routable": routable }),
        ),
        Some(message) => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({
                "error": { "message": message, "type": "unavailable", "code": 503 },
                "status": "unavailable", "healthy_workers": r.healthy, "workers": r.workers,
                "routable": routable,
            }),
        ),
    }
}

/// Liveness: 200 whenever the process answers at all (whatever the workers' state).
async fn liveness() -> Response {
    json_response(StatusCode::OK, &json!({ "status": "ok" }))
}

/// The models the workers serve: the first of them (workers whose breaker is closed first,
/// at most [`MODELS_ASKED`]) to answer its own `GET /v1/models` with OpenAI's list has its
/// entries relayed, so a client learns the name to send. With no worker reached over HTTP,
/// the configured name ([`super::HttpOptions::model`]); 503 naming each worker's problem when
/// none of those asked answered.
async fn models(State(app): State<Arc<App>>) -> Response {
    let list = |data: serde_json::Value| {
        json_response(StatusCode::OK, &json!({ "object": "list", "data": data }))
    };
    let mut workers: Vec<_> = app.workers.iter().collect();
    workers.sort_by_key(|(id, _)| app.breakers.state(*id) != kvc_core::BreakerState::Closed);
    if workers.is_empty() {
        // Nothing to ask (workers reached over gRPC only): the configured name.
        return list(json!([{ "id": app.options.model, "object": "model", "owned_by": "kvc" }]));
    }
    let timeout = app.options.health_check_timeout;
    let mut problems = Vec::new();
    for (id, w) in workers.into_iter().take(MODELS_ASKED) {
        let problem = match app.client.get(&w.url, "/v1/models", timeout).await {
            Ok(a) if a.status == 200 => match model_entries(&a.body) {
                // The engine's own entries (with what it adds, such as `max_model_len`).
                Some(data) => return list(serde_json::Value::Array(data)),
                None => "not an OpenAI model list".to_owned(),
            },
            Ok(a) => format!("HTTP {}", a.status),
            Err(e) => e.to_string(),
        };
        problems.push(format!("worker {}: {problem}", id.0));
    }
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        &format!(
            "no worker answered GET /v1/models ({})",
            problems.join("; ")
        ),
    )
}

/// The `data` entries of an OpenAI model list, when every one has a string `id` and there is
/// at least one.
fn model_entries(body: &[u8]) -> Option<Vec<serde_json::Value>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let data = v.get_mut("data")?.as_array_mut().map(std::mem::take)?;
    (!data.is_empty() && data.iter().all(|m| m["id"].is_string())).then_some(data)
}

/// How many workers `GET /v1/models` asks, in turn, before it gives up.
const MODELS_ASKED: usize = 3;

/// 404 for a path the front does not serve.
async fn not_found(uri: Uri) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        "not_found",
        &format!("no route for {}", uri.path()),
    )
}

/// 405 for a method a served path does not take (in Anthropic's shape on the Messages paths).
async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let r = error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        &format!("{method} is not allowed on {}", uri.path()),
    );
    if uri.path().starts_with(Api::Messages.path()) {
        in_anthropic_shape(r)
    } else {
        r
    }
}
