//! The P/D bootstrap handshake: each prefill worker's bootstrap server answers which worker
//! holds a room (`GET /bootstrap/route?room=<room>`), and the client a decode worker asks it
//! with.

use super::sglang::{error_response, json_response};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::Response;
use axum::routing::get;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use kvc_core::WorkerId;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// Most time a decode worker waits for a bootstrap server's answer.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(5);

/// The client decode workers ask bootstrap servers with (bodiless `GET`s).
pub(super) type BootstrapClient = Client<HttpConnector, http_body_util::Empty<Bytes>>;

/// A pooled client with `TCP_NODELAY`, like the driver's.
pub(super) fn bootstrap_client() -> BootstrapClient {
    Client::builder(hyper_util::rt::TokioExecutor::new()).build(super::connector())
}

/// The prefill worker a bootstrap server answers for.
struct BootstrapServer {
    id: WorkerId,
    name: String,
}

/// The bootstrap server of prefill worker `id` (named `name`).
pub(super) fn bootstrap_app(id: WorkerId, name: String) -> Router {
    Router::new()
        .route("/bootstrap/route", get(bootstrap_route))
        .route("/health", get(|| async { "ok" }))
        .with_state(Arc::new(BootstrapServer { id, name }))
}

async fn bootstrap_route(State(server): State<Arc<BootstrapServer>>, uri: Uri) -> Response {
    let room = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix("room="))
        .and_then(|r| r.parse::<u64>().ok());
    match room {
        Some(room) => json_response(
            StatusCode::OK,
            &json!({ "worker": server.id.0, "name": server.name, "room": room }),
        ),
        None => error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "query parameter `room` must be an unsigned integer",
        ),
    }
}

/// Asks the prefill worker's bootstrap server at `host:port` which worker holds `room`.
pub(super) async fn resolve_prefill(
    client: &BootstrapClient,
    host: &str,
    port: u16,
    room: u64,
) -> Result<WorkerId, String> {
    use http_body_util::BodyExt;
    let uri: hyper::Uri = format!("http://{host}:{port}/bootstrap/route?room={room}")
        .parse()
        .map_err(|e| format!("bad bootstrap address {host}:{port}: {e}"))?;
    let call = async {
        let resp = client
            .get(uri)
            .await
            .map_err(|e| format!("bootstrap server {host}:{port} unreachable: {e}"))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("bootstrap server {host}:{port}: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("bootstrap server {host}:{port} answered {status}"));
        }
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| format!("bootstrap server {host}:{port}: bad answer: {e}"))?;
        v.get("worker")
            .and_then(Value::as_u64)
            .map(|w| WorkerId(w as u32))
            .ok_or_else(|| format!("bootstrap server {host}:{port}: no worker in its answer"))
    };
    tokio::time::timeout(BOOTSTRAP_TIMEOUT, call)
        .await
        .map_err(|_| format!("bootstrap server {host}:{port} did not answer within 5 s"))?
}
