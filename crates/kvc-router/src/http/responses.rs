//! What the front answers the client besides a worker's own answer: JSON errors (for a bad
//! request, a routing failure, a worker that did not answer) and the decision headers.

use super::decision::Decision;
use crate::RequestError;
use crate::worker_http::{ForwardError, WorkerAnswer};
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvc_core::agent_apis::anthropic_error_type;
use kvc_core::{StableName, WorkerId};
use serde_json::{Value, json};

/// The response header naming the session a request was routed in (the client's key, or the
/// key of an inferred session).
pub const SESSION_RESPONSE_HEADER: &str = "x-kvc-session";

/// `body` as a JSON response with `status`.
pub(super) fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// An error the front answered itself, kept with its response so that an API with errors of
/// another shape can write it anew ([`in_anthropic_shape`]).
#[derive(Debug, Clone)]
pub(super) struct OwnError {
    message: String,
}

/// `{"error": {"message", "type", "code"}}` with `status`.
pub(super) fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    let mut r = json_response(
        status,
        &json!({ "error": { "message": message, "type": kind, "code": status.as_u16() } }),
    );
    r.extensions_mut().insert(OwnError {
        message: message.to_owned(),
    });
    r
}

/// `{"type": "error", "error": {"type", "message"}}`: an Anthropic client's error body.
pub(super) fn anthropic_error_body(status: StatusCode, message: &str) -> serde_json::Value {
    json!({ "type": "error",
            "error": { "type": anthropic_error_type(status.as_u16()), "message": message } })
}

/// An answer to a Messages API client: an error the front answered itself written anew in
/// Anthropic's shape, with its status and headers; anything else (a worker's own answer,
/// already in that shape from vLLM's Messages endpoint) as it is.
pub(crate) fn in_anthropic_shape(response: Response) -> Response {
    let Some(e) = response.extensions().get::<OwnError>().cloned() else {
        return response;
    };
    let (mut parts, _) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    let body = anthropic_error_body(parts.status, &e.message).to_string();
    Response::from_parts(parts, axum::body::Body::from(body))
}

/// A body that could not be read (too large, cut short) as a JSON error.
pub(super) fn body_error_response(e: &BytesRejection) -> Response {
    error_response(e.status(), "invalid_request_error", &e.body_text())
}

/// A routing failure as the client gets it: 400 for a bad request, 503 when no worker can
/// take it, 504 for a deadline, else 500.
pub(crate) fn route_error_response(e: &RequestError) -> Response {
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

/// A worker (`who`) that gave no answer: 504 after a timeout, else 502.
pub(super) fn forward_error_response(who: &str, e: &ForwardError) -> Response {
    let status = match e {
        ForwardError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::BAD_GATEWAY,
    };
    error_response(status, "worker_error", &format!("{who}: {e}"))
}

/// A worker's whole answer, passed through to the client.
pub(super) fn worker_answer(a: WorkerAnswer) -> Response {
    let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = a
        .content_type
        .unwrap_or(HeaderValue::from_static("application/json"));
    (status, [(header::CONTENT_TYPE, content_type)], a.body).into_response()
}

/// A worker's answer, or its absence, as the client gets it.
pub(super) fn answer_or_error(who: &str, r: Result<WorkerAnswer, ForwardError>) -> Response {
    match r {
        Ok(a) => worker_answer(a),
        Err(e) => forward_error_response(who, &e),
    }
}

/// The 502 for a worker without an HTTP address.
pub(super) fn no_address(id: WorkerId) -> Response {
    error_response(
        StatusCode::BAD_GATEWAY,
        "worker_error",
        &format!("worker {} has no HTTP address", id.0),
    )
}

/// Adds `x-kvc-mode`, `x-kvc-decode-worker`, (P→D) `x-kvc-prefill-worker`, (fall-through)
/// `x-kvc-reason` and (with a session) `x-kvc-session`.
pub(super) fn with_decision_headers(
    mut response: Response,
    decision: &Decision,
    session_key: Option<&str>,
) -> Response {
    let h = response.headers_mut();
    h.insert(
        "x-kvc-mode",
        HeaderValue::from_static(decision.mode.as_str()),
    );
    h.insert("x-kvc-decode-worker", HeaderValue::from(decision.decode.0));
    if let Some(p) = decision.prefill {
        h.insert("x-kvc-prefill-worker", HeaderValue::from(p.0));
    }
    if let Some(reason) = decision.reason {
        h.insert("x-kvc-reason", HeaderValue::from_static(reason.as_str()));
    }
    if let Some(v) = session_key.and_then(|k| HeaderValue::from_str(k).ok()) {
        h.insert(SESSION_RESPONSE_HEADER, v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvc_core::{ExecutionMode, FallThroughReason};

    #[test]
    fn decision_headers_name_the_mode_workers_and_session() {
        let decision = Decision {
            id: 1,
            mode: ExecutionMode::Fallback,
            reason: Some(FallThroughReason::DirectUnsupported),
            prefill: Some(WorkerId(0)),
            decode: WorkerId(2),
            cached_tokens: 0,
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

    #[tokio::test]
    async fn front_errors_are_rewritten_for_anthropic_clients_and_worker_answers_are_not() {
        let r = in_anthropic_shape(error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "missing `max_tokens`",
        ));
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let body = body_json(r).await;
        assert_eq!(
            body,
            json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": "missing `max_tokens`"}})
        );
        for (status, kind) in [
            (StatusCode::NOT_FOUND, "not_found_error"),
            (StatusCode::PAYLOAD_TOO_LARGE, "request_too_large"),
            (StatusCode::SERVICE_UNAVAILABLE, "overloaded_error"),
            (StatusCode::GATEWAY_TIMEOUT, "timeout_error"),
            (StatusCode::BAD_GATEWAY, "api_error"),
            (StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error"),
        ] {
            let body = body_json(in_anthropic_shape(error_response(status, "x", "m"))).await;
            assert_eq!(body["error"]["type"], kind, "{status}");
        }
        let worker = worker_answer(WorkerAnswer {
            status: 400,
            content_type: None,
            admission_rejected: false,
            body: axum::body::Bytes::from_static(b"{\"type\":\"error\"}"),
        });
        assert_eq!(
            body_json(in_anthropic_shape(worker)).await,
            json!({"type": "error"})
        );
    }

    async fn body_json(r: Response) -> Value {
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[test]
    fn missing_answers_are_502_or_504() {
        let r = forward_error_response("decode worker", &ForwardError::Broken("reset".into()));
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        let r = forward_error_response(
            "decode worker",
            &ForwardError::Timeout(std::time::Duration::from_secs(1)),
        );
        assert_eq!(r.status(), StatusCode::GATEWAY_TIMEOUT);
        let r = route_error_response(&RequestError::Unavailable("none".into()));
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
}
