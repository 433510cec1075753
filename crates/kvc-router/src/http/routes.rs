//! The axum routes of the front and their handlers: the three POST APIs (body read, or refused
//! as a JSON error), `GET /health` and `GET /v1/models`.

use super::app::App;
use super::request::Api;
use super::responses::{body_error_response, error_response, json_response};
use super::retry::serve_request;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{MethodRouter, get, post};
use serde_json::json;
use std::sync::Arc;

/// The front's routes over `app`.
pub(super) fn router(app: Arc<App>) -> Router {
    let body_limit = DefaultBodyLimit::max(app.options.max_body_bytes);
    Router::new()
        .route("/generate", post_endpoint(Api::Generate))
        .route("/v1/completions", post_endpoint(Api::Completions))
        .route("/v1/chat/completions", post_endpoint(Api::ChatCompletions))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .layer(body_limit)
        .with_state(app)
}

/// The axum handler of the POST endpoint for `api`: the body read (or refused by axum),
/// served as `api`.
fn post_endpoint(api: Api) -> MethodRouter<Arc<App>> {
    post(
        move |State(app): State<Arc<App>>,
              headers: HeaderMap,
              body: Result<Bytes, BytesRejection>| async move {
            match body {
                Ok(body) => serve_request(&app, api, &headers, &body).await,
                Err(e) => body_error_response(&e),
            }
        },
    )
}

/// 200 while at least one worker is routable, else 503.
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

/// The configured model name, in OpenAI's list shape.
async fn models(State(app): State<Arc<App>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{ "id": app.options.model, "object": "model", "owned_by": "kvc" }],
        }),
    )
}
