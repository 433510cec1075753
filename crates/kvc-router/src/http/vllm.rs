//! The vLLM dialect (NixlConnector P/D): a P→D request is two plain HTTP calls — P prefills
//! with `kv_transfer_params` asking for a remote decode and answers the parameters D needs to
//! pull the KV; D gets the client's body with those parameters copied verbatim. A direct-to-D
//! turn is the client's body to D alone (vLLM's prefix cache reuses the session's blocks), and
//! D's reported cached tokens say whether the session was in fact still there.

use super::app::App;
use super::attempt::{
    AttemptResult, DecodeLeg, ForwardedRequest, counts_against_breaker, refusal_outcome,
};
use super::decision::{self, Decision};
use super::request::Api;
use super::responses::worker_answer;
use super::stream::forward_stream;
use super::whole::forward_whole;
use crate::telemetry::Leg;
use crate::worker_http::{Call, WorkerAnswer};
use axum::http::{HeaderName, HeaderValue};
use kvc_core::{ExecutionMode, Outcome, WorkerId};
use serde_json::{Map, Value};
use std::sync::Arc;

/// The response header naming the prefill worker that failed a P→D request the decode worker
/// then served alone.
pub const PREFILL_FAILED_HEADER: &str = "x-kvc-prefill-failed";

/// The header vLLM takes its request id from; P and D get the same.
const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

pub(super) use kvc_core::openai::nixl_prefill_body as prefill_body;

/// Whether the client asked for the usage chunk of its stream.
pub(crate) fn client_wants_usage(body: &Map<String, Value>) -> bool {
    body.get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// Turns `stream_options.include_usage` on in D's body (the final chunk then reports the
/// cached prompt tokens); other stream options are kept.
pub(crate) fn ask_for_usage(body: &mut Map<String, Value>) {
    let options = body
        .entry("stream_options")
        .or_insert_with(|| Value::Object(Map::new()));
    if !options.is_object() {
        *options = Value::Object(Map::new());
    }
    if let Value::Object(o) = options {
        o.insert("include_usage".into(), Value::Bool(true));
    }
}

/// P's `kv_transfer_params`, from its whole answer (2xx JSON carrying an object).
fn transfer_params(body: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v.get("kv_transfer_params")
        .filter(|p| p.is_object())
        .cloned()
}

/// What became of P's call when it gave no parameters.
enum PrefillFailure {
    /// P failed (no answer, a 5xx, no parameters in a 2xx): D serves the request alone.
    Failed(String),
    /// P refused the request itself (a 4xx, e.g. a prompt over the model's limit): the
    /// client gets P's answer.
    Refused(WorkerAnswer),
}

/// Sends P its request and returns the `kv_transfer_params` of its answer, or why there are
/// none. Feeds P's breaker.
async fn prefill(
    app: &Arc<App>,
    request: &ForwardedRequest,
    body: &Map<String, Value>,
    p: WorkerId,
    headers: &[(HeaderName, HeaderValue)],
) -> Result<Value, PrefillFailure> {
    let Some(endpoint) = app.endpoint(p) else {
        return Err(PrefillFailure::Failed(format!(
            "worker {} has no HTTP address",
            p.0
        )));
    };
    app.breakers
        .on_dispatch(&app.service, p, app.service.now_ms());
    let payload = super::attempt::payload(&prefill_body(body, request.api.vllm()));
    let mut call = request
        .trace
        .worker_call(p, Leg::Prefill, request.api.path());
    let headers = call.headers(headers);
    let answer = app
        .client
        .post_whole(Call {
            base: endpoint.url.clone(),
            path: request.api.path(),
            headers: &headers,
            body: payload,
            timeout: app.options.request_timeout,
        })
        .await;
    call.record_answer(answer.as_ref().map(|a| a.status));
    app.feed_breaker(p, counts_against_breaker(answer.as_ref().map(|a| a.status)));
    match answer {
        Ok(a) if (200..300).contains(&a.status) => transfer_params(&a.body).ok_or_else(|| {
            PrefillFailure::Failed("its answer has no `kv_transfer_params` object".to_owned())
        }),
        Ok(a) if refusal_outcome(a.status, &a.body).is_some() => Err(PrefillFailure::Refused(a)),
        Ok(a) => Err(PrefillFailure::Failed(format!("status {}", a.status))),
        Err(e) => Err(PrefillFailure::Failed(e.to_string())),
    }
}

/// One attempt of `decision` in the vLLM dialect.
///
/// On a P→D path P is called first ([`prefill_body`]); D then gets the client's body with
/// P's `kv_transfer_params` verbatim. When P fails (no answer, a 5xx or 408/429 status, or
/// no parameters in its answer) D gets the client's body alone and prefills itself: the
/// answer carries [`PREFILL_FAILED_HEADER`] naming P, and P's breaker hears of the failure.
/// P's other 4xx answers (the request's own fault, e.g. a prompt over the model's limit) go
/// to the client, reported as the refusal they are (`input-too-long` or `invalid-request`,
/// [`refusal_outcome`]), and D is not called. Both calls carry the same
/// `X-Request-Id`. A direct-to-D turn sends the client's body to D as it is, judged by D's
/// reported cached tokens. A streamed D request gets `stream_options.include_usage` (the
/// cached tokens are in the final usage chunk), and that chunk is removed from the client's
/// stream unless the client asked for it.
pub(super) async fn forward_vllm(
    app: &Arc<App>,
    request: &ForwardedRequest,
    body: Map<String, Value>,
    decision: &Decision,
    stream: bool,
    may_retry: bool,
) -> AttemptResult {
    let id = format!("kvc-{}-{}", request.request_id, decision.id);
    let mut headers = request.worker_headers(app);
    if let Ok(v) = HeaderValue::from_str(&id) {
        headers.push((REQUEST_ID_HEADER, v));
    }
    let mut d_body = body;
    let mut prefill_failed = None;
    if let Some(p) = decision.prefill {
        let sent = match prefill(app, request, &d_body, p, &headers).await {
            // The worker a session leaves refused to send it (no KV connector there, whatever
            // the configuration says): the request is not at fault, D prefills it.
            Err(PrefillFailure::Refused(answer))
                if decision.mode == ExecutionMode::MigrateKv
                    && refusal_outcome(answer.status, &answer.body)
                        == Some(Outcome::InvalidRequest) =>
            {
                Err(PrefillFailure::Failed(format!(
                    "the worker the session leaves refused to send its KV (status {}); does it \
                     run a KV connector?",
                    answer.status
                )))
            }
            other => other,
        };
        match sent {
            Ok(params) => {
                d_body.insert("kv_transfer_params".into(), params);
            }
            Err(PrefillFailure::Refused(answer)) => {
                // The request itself is at fault: D would refuse it too.
                let outcome =
                    refusal_outcome(answer.status, &answer.body).unwrap_or(Outcome::WorkerFailed);
                request.trace.record_outcome(outcome);
                decision::report(&app.service, decision.id, request.request_id, outcome, 0);
                return AttemptResult::Answered(worker_answer(answer));
            }
            Err(PrefillFailure::Failed(detail)) => {
                tracing::warn!(
                    request = request.request_id,
                    prefill = p.0,
                    %detail,
                    "prefill worker failed; the decode worker prefills the request itself"
                );
                prefill_failed = Some(p);
            }
        }
    }
    // The OpenAI APIs report usage in a stream only when asked; vLLM's Messages stream always
    // carries it (its `message_delta`), a Responses stream in its `response.completed`.
    let usage_option = matches!(request.api, Api::Completions | Api::ChatCompletions);
    let strip_usage = stream && usage_option && !client_wants_usage(&d_body);
    if stream && usage_option {
        ask_for_usage(&mut d_body);
    }
    let leg = DecodeLeg {
        headers: headers
            .into_iter()
            .filter(|(name, _)| *name == REQUEST_ID_HEADER)
            .collect(),
        expected_cached: (decision.mode == ExecutionMode::DirectToD)
            .then_some(decision.cached_tokens),
        strip_usage,
    };
    // P's part is done: D's call is forwarded like a decode worker's alone.
    let d_only = Decision {
        prefill: None,
        ..*decision
    };
    let result = if stream {
        forward_stream(app, request, d_body, &d_only, may_retry, &leg).await
    } else {
        forward_whole(app, request, d_body, &d_only, &leg).await
    };
    match (prefill_failed, result) {
        (Some(p), AttemptResult::Answered(mut response)) => {
            response
                .headers_mut()
                .insert(PREFILL_FAILED_HEADER, HeaderValue::from(p.0));
            AttemptResult::Answered(response)
        }
        (_, result) => result,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn usage_is_asked_for_and_what_the_client_asked_is_known() {
        let mut body = obj(json!({"stream": true}));
        assert!(!client_wants_usage(&body));
        ask_for_usage(&mut body);
        assert_eq!(body["stream_options"], json!({"include_usage": true}));
        let mut body = obj(json!({"stream_options": {"continuous_usage_stats": false}}));
        ask_for_usage(&mut body);
        assert_eq!(
            body["stream_options"],
            json!({"continuous_usage_stats": false, "include_usage": true})
        );
        let mut body = obj(json!({"stream_options": null}));
        ask_for_usage(&mut body);
        assert_eq!(body["stream_options"], json!({"include_usage": true}));
        assert!(client_wants_usage(&obj(
            json!({"stream_options": {"include_usage": true}})
        )));
    }

    #[test]
    fn transfer_params_are_taken_verbatim_from_p_s_answer() {
        let answer = br#"{"choices": [], "kv_transfer_params": {"do_remote_prefill": true,
            "remote_block_ids": [1, 2], "remote_request_id": "x", "tp_size": 1}}"#;
        assert_eq!(
            transfer_params(answer),
            Some(
                json!({"do_remote_prefill": true, "remote_block_ids": [1, 2],
                "remote_request_id": "x", "tp_size": 1})
            )
        );
        assert_eq!(transfer_params(br#"{"kv_transfer_params": null}"#), None);
        assert_eq!(transfer_params(b"oops"), None);
    }
}
