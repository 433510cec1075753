//! The decode side's P/D sidecar, for simulated vLLM decode workers run behind an endpoint
//! picker that follows llm-d's convention (`WorkerOptions::pd_shim`): the picker names the
//! decode worker as the request's destination and, for a P→D request, the prefill worker in
//! the request header `x-prefiller-host-port: ip:port`.
//!
//! - No header: the decode worker serves the request itself (a direct-to-D turn, or a turn
//!   it prefills alone), exactly as a plain request.
//! - A header naming a known prefill worker: the header is removed, the prefill worker gets
//!   the client's body on the same route (completions, chat, Messages or Responses) with
//!   `kv_transfer_params.do_remote_decode: true`, `stream: false`, an output limit of one
//!   token in the API's own field (`max_tokens`, and `max_completion_tokens: 1` when set;
//!   Responses `max_output_tokens: 1` and `store: false`), without `stream_options` and
//!   `min_tokens` ([`kvc_core::openai::nixl_prefill_body`]), under the same `X-Request-Id`
//!   (the client's, else a fresh one); then the decode worker serves the client's body with
//!   the top-level `kv_transfer_params` of P's answer (it pulls the KV). A 4xx answer of P other than 408 and 429 (e.g. a prompt over the model's
//!   limit) goes to the client as it is. When P fails otherwise (no answer within
//!   [`PREFILL_TIMEOUT`], a 5xx, 408 or 429, an answer without parameters), the decode worker
//!   serves the request alone and its answer carries `x-kvc-prefill-failed: <ip:port>`.
//! - A header naming anything but a known prefill worker (the allow-list guards against a
//!   request forged to make the decode worker call an arbitrary host): 400 (in the API's
//!   error shape), nothing called.

use super::sglang::WorkerContext;
use super::vllm::Api;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Map, Value};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The request header naming a P→D request's prefill worker.
pub(super) const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The response header naming the prefill worker that failed a P→D request the decode worker
/// then served alone (the name `kvc-router`'s HTTP front gives the same fact).
pub(super) const PREFILL_FAILED_HEADER: &str = "x-kvc-prefill-failed";
/// Most time the prefill worker's answer may take.
pub(super) const PREFILL_TIMEOUT: Duration = Duration::from_secs(30);

/// Every request id the sidecar makes up is distinct.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// The sidecar of the decode workers: the prefill workers it may call, and its client.
pub(crate) struct PdShim {
    prefill: OnceLock<HashSet<SocketAddr>>,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// What the sidecar made of a request before the decode worker serves it.
pub(super) enum Step {
    /// Serve this body (the client's, or with P's `kv_transfer_params`); `prefill_failed`
    /// names the prefill worker that failed.
    Serve {
        body: Bytes,
        prefill_failed: Option<SocketAddr>,
    },
    /// Answer this, serve nothing.
    Answer(Response),
}

impl PdShim {
    /// A sidecar that knows no prefill worker yet ([`PdShim::allow`]).
    pub(crate) fn new() -> Self {
        PdShim {
            prefill: OnceLock::new(),
            client: Client::builder(hyper_util::rt::TokioExecutor::new()).build(super::connector()),
        }
    }

    /// Sets the prefill workers the sidecar may call (once; later calls change nothing).
    pub(crate) fn allow(&self, prefill: impl IntoIterator<Item = SocketAddr>) {
        let _ = self.prefill.set(prefill.into_iter().collect());
    }

    /// The prefill worker a header value names, when it is one the sidecar may call.
    fn allowed(&self, value: &str) -> Option<SocketAddr> {
        let addr: SocketAddr = value.trim().parse().ok()?;
        self.prefill.get()?.contains(&addr).then_some(addr)
    }

    /// Runs the prefill step of a request through `api` with `headers` and `body`, when its
    /// headers name a prefill worker (the header is removed from `headers`); the sidecar's own
    /// errors are in `api`'s shape.
    pub(super) async fn before_serve(
        &self,
        ctx: &WorkerContext,
        api: Api,
        headers: &mut HeaderMap,
        body: Bytes,
    ) -> Step {
        let Some(value) = headers.remove(PREFILLER_HEADER) else {
            return Step::Serve {
                body,
                prefill_failed: None,
            };
        };
        let named = value.to_str().unwrap_or_default().to_owned();
        let Some(p) = self.allowed(&named) else {
            return Step::Answer(api.invalid(format!(
                "{}: `{PREFILLER_HEADER}: {named}` is not a known prefill worker",
                ctx.name
            )));
        };
        let Ok(Value::Object(client_body)) = serde_json::from_slice::<Value>(&body) else {
            return Step::Answer(api.invalid("the body must be a JSON object"));
        };
        let request_id = match headers.get("x-request-id").and_then(|v| v.to_str().ok()) {
            Some(id) => id.to_owned(),
            None => {
                let id = format!(
                    "pd-{}-{}",
                    ctx.id.0,
                    NEXT_ID.fetch_add(1, Ordering::Relaxed)
                );
                if let Ok(v) = HeaderValue::from_str(&id) {
                    headers.insert("x-request-id", v);
                }
                id
            }
        };
        match self.prefill_call(p, api, &request_id, &client_body).await {
            Ok(params) => {
                let mut d = client_body;
                d.insert("kv_transfer_params".into(), params);
                Step::Serve {
                    body: Bytes::from(Value::Object(d).to_string()),
                    prefill_failed: None,
                }
            }
            Err(PrefillError::Refused(status, answer)) => Step::Answer(
                (
                    status,
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    answer,
                )
                    .into_response(),
            ),
            // Named on the answer; the decode worker prefills the request itself.
            Err(PrefillError::Failed) => Step::Serve {
                body,
                prefill_failed: Some(p),
            },
        }
    }

    /// P's call (the same route, the API's prefill body): its top-level
    /// `kv_transfer_params`, or why there are none.
    async fn prefill_call(
        &self,
        p: SocketAddr,
        api: Api,
        request_id: &str,
        body: &Map<String, Value>,
    ) -> Result<Value, PrefillError> {
        let payload = Bytes::from(
            Value::Object(kvc_core::openai::nixl_prefill_body(body, api.vllm())).to_string(),
        );
        let request = hyper::Request::post(format!("http://{p}{}", api.path()))
            .header("content-type", "application/json")
            .header("x-request-id", request_id)
            .body(Full::new(payload))
            .map_err(|_| PrefillError::Failed)?;
        let call = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|_| PrefillError::Failed)?;
            let status = response.status();
            let answer = response
                .into_body()
                .collect()
                .await
                .map_err(|_| PrefillError::Failed)?
                .to_bytes();
            Ok::<_, PrefillError>((status, answer))
        };
        let (status, answer) = tokio::time::timeout(PREFILL_TIMEOUT, call)
            .await
            .map_err(|_| PrefillError::Failed)??;
        if status.is_client_error()
            && status != StatusCode::REQUEST_TIMEOUT
            && status != StatusCode::TOO_MANY_REQUESTS
        {
            return Err(PrefillError::Refused(status, answer));
        }
        if !status.is_success() {
            return Err(PrefillError::Failed);
        }
        serde_json::from_slice::<Value>(&answer)
            .ok()
            .and_then(|v| {
                v.get("kv_transfer_params")
                    .filter(|p| p.is_object())
                    .cloned()
            })
            .ok_or(PrefillError::Failed)
    }
}

/// Why P's call gave no parameters.
enum PrefillError {
    /// P refused the request itself: its answer goes to the client.
    Refused(StatusCode, Bytes),
    /// P failed (no answer in time, a 5xx, 408 or 429, no parameters): the decode worker
    /// serves the request alone.
    Failed,
}

/// `response` with [`PREFILL_FAILED_HEADER`] naming `p`, when P failed.
pub(super) fn mark(mut response: Response, prefill_failed: Option<SocketAddr>) -> Response {
    if let Some(v) = prefill_failed.and_then(|p| HeaderValue::from_str(&p.to_string()).ok()) {
        response.headers_mut().insert(PREFILL_FAILED_HEADER, v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_known_prefill_workers_are_allowed() {
        let shim = PdShim::new();
        assert_eq!(shim.allowed("127.0.0.1:9000"), None, "nothing known yet");
        let p: SocketAddr = "127.0.0.1:9000".parse().unwrap();
        shim.allow([p]);
        assert_eq!(shim.allowed(" 127.0.0.1:9000 "), Some(p));
        assert_eq!(shim.allowed("127.0.0.1:9001"), None);
        assert_eq!(shim.allowed("169.254.169.254:80"), None);
        assert_eq!(
            shim.allowed("localhost:9000"),
            None,
            "names are not resolved"
        );
        shim.allow(["127.0.0.1:9001".parse().unwrap()]);
        assert_eq!(shim.allowed("127.0.0.1:9001"), None, "set once");
    }

    #[test]
    fn a_failed_prefill_is_named_on_the_answer() {
        let p: SocketAddr = "127.0.0.1:9000".parse().unwrap();
        let r = mark(StatusCode::OK.into_response(), Some(p));
        assert_eq!(r.headers()[PREFILL_FAILED_HEADER], "127.0.0.1:9000");
        let r = mark(StatusCode::OK.into_response(), None);
        assert!(r.headers().get(PREFILL_FAILED_HEADER).is_none());
    }
}
