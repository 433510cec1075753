//! One forwarding attempt of a decision: what it shares with the request's other attempts,
//! how it starts (the payload, P's request on a P→D path), what it can come to, and how a
//! worker's answer is judged for the breakers and for retries.

use super::app::App;
use super::decision::{self, Decision};
use super::endpoints::HttpWorker;
use super::pairing::{PrefillLeg, PrefillResult, partner_timed_out};
use super::request::Api;
use super::responses::{answer_or_error, error_response, no_address, worker_answer};
use crate::telemetry::{Leg, RequestSpan, WorkerCall};
use crate::worker_http::{Call, ForwardError, WorkerAnswer};
use axum::body::Bytes;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use kvc_core::{ExecutionMode, Outcome, WorkerId};
use serde_json::{Map, Value};
use std::sync::Arc;

/// One client request, as every attempt forwards it.
pub(crate) struct ForwardedRequest {
    pub(crate) api: Api,
    pub(crate) request_id: u64,
    pub(crate) input_length: u64,
    /// The session key, sent to every worker in the session header.
    pub(crate) session_key: Option<Arc<str>>,
    /// The body every attempt starts from (the client's, router-only fields removed).
    pub(crate) body: Map<String, Value>,
    /// The client's bytes, when `body` is exactly what they parse to: an attempt that adds
    /// nothing to the body forwards them as they came (a long prompt is not written again).
    pub(crate) client_bytes: Option<Bytes>,
    /// The client's W3C trace context (`traceparent`, and `tracestate` with it), passed on
    /// to every worker call so an engine that traces (vLLM's `--otlp-traces-endpoint`) joins
    /// the client's trace.
    pub(crate) trace_context: Vec<(HeaderName, HeaderValue)>,
    /// The request's span (none when tracing is off or for the endpoint picker): each worker
    /// call is its child, and the worker gets the call's own trace context in place of the
    /// client's.
    pub(crate) trace: RequestSpan,
}

/// The client's `traceparent` when it is a valid W3C trace context (version 00:
/// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, ids not all zero; a later version
/// with at least those fields), with its `tracestate` (at most 512 bytes); nothing otherwise.
pub(crate) fn trace_context(headers: &axum::http::HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    const PARENT: HeaderName = HeaderName::from_static("traceparent");
    const STATE: HeaderName = HeaderName::from_static("tracestate");
    let Some(parent) = headers.get(&PARENT) else {
        return Vec::new();
    };
    let Ok(text) = parent.to_str() else {
        return Vec::new();
    };
    let parts: Vec<&str> = text.trim().split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    };
    let valid = parts.len() >= 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && (parts[0] != "00" || parts.len() == 4)
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2);
    if !valid {
        return Vec::new();
    }
    let mut out = vec![(PARENT, parent.clone())];
    if let Some(state) = headers.get(&STATE).filter(|s| s.len() <= 512) {
        out.push((STATE, state.clone()));
    }
    out
}

impl ForwardedRequest {
    /// The bytes to send for `body`: the client's own when `body` is still the client's
    /// ([`ForwardedRequest::client_bytes`]); the client's own with the new top-level fields
    /// appended when `body` only adds fields the client did not send; else `body` written out
    /// ([`payload`]).
    pub(crate) fn payload(&self, body: &Map<String, Value>) -> Bytes {
        let Some(bytes) = &self.client_bytes else {
            return payload(body);
        };
        // Every field of the client's body is still there, unchanged.
        if self.body.iter().any(|(k, v)| body.get(k) != Some(v)) {
            return payload(body);
        }
        let added: Vec<(&String, &Value)> = body
            .iter()
            .filter(|(k, _)| !self.body.contains_key(*k))
            .collect();
        append_fields(bytes, &added).unwrap_or_else(|| payload(body))
    }

    /// The headers every worker request carries: the session header with the session key
    /// (none without a session, or when the key or the header name cannot be sent).
    pub(super) fn worker_headers(&self, app: &App) -> Vec<(HeaderName, HeaderValue)> {
        let mut headers = self.trace_context.clone();
        if let (Some(name), Some(key)) = (&app.session_header, &self.session_key)
            && let Ok(value) = HeaderValue::from_str(key)
        {
            headers.push((name.clone(), value));
        }
        headers
    }
}

/// What one forwarding attempt came to. Whatever it is, its decision has been (or, for a
/// relayed stream, will be) reported.
pub(super) enum AttemptResult {
    /// The client's answer.
    Answered(Response),
    /// Failed before any byte reached the client, in a way worth trying elsewhere (connection
    /// refused or broken, timeout before an answer, 502-504, or a prefill worker that failed
    /// before the decode worker answered): `response` is the failure as the client would get
    /// it, `failed` the workers to avoid.
    RetryElsewhere {
        response: Response,
        failed: Vec<WorkerId>,
    },
    /// The decode worker's admission refused the request (`503` with
    /// `x-kvc-admission: rejected`), reported `rejected`; `response` is its answer.
    RefusedByAdmission {
        response: Response,
        decode: WorkerId,
        /// Whether the refused decision was direct-to-D.
        direct: bool,
    },
}

/// Whether a worker's answer (its status, or why there is none) counts against its circuit
/// breaker: no answer, or a 5xx status.
pub(super) fn counts_against_breaker(status: Result<u16, &ForwardError>) -> bool {
    match status {
        Ok(s) => s >= 500,
        Err(_) => true,
    }
}

/// Whether a worker's failure may be retried on another worker: no answer (connection
/// refused or broken, timeout), or 502, 503 or 504.
pub(super) fn worth_retrying(status: Result<u16, &ForwardError>) -> bool {
    match status {
        Ok(s) => (502..=504).contains(&s),
        Err(e) => e.is_transient(),
    }
}

/// What a worker's final answer that is not a success comes to when the engine refused the
/// request itself — a 4xx status other than 408 (timeout) and 429 (overload): `input-too-long`
/// when its message says the prompt is over the model's context (vLLM: "maximum context
/// length", "longer than the maximum model length"), else `invalid-request` (e.g. vLLM's 400
/// for `tool_choice: "auto"` on an engine started without tool calling). Neither is a
/// mechanism error or the worker's fault. `None` for any other status: the worker failed.
pub(crate) fn refusal_outcome(status: u16, body: &[u8]) -> Option<Outcome> {
    if !(400..500).contains(&status) || status == 408 || status == 429 {
        return None;
    }
    let text = String::from_utf8_lossy(&body[..body.len().min(4096)]).to_ascii_lowercase();
    let too_long = [
        "maximum context length",
        "longer than the maximum model length",
    ]
    .iter()
    .any(|m| text.contains(m));
    Some(if too_long {
        Outcome::InputTooLong
    } else {
        Outcome::InvalidRequest
    })
}

/// The outcome of a final answer that is not a success: [`refusal_outcome`], else
/// `worker-failed`.
pub(crate) fn failure_outcome(answer: &Result<WorkerAnswer, ForwardError>) -> Outcome {
    match answer {
        Ok(a) => refusal_outcome(a.status, &a.body).unwrap_or(Outcome::WorkerFailed),
        Err(_) => Outcome::WorkerFailed,
    }
}

/// Whether a worker answered 2xx.
pub(super) fn is_success(r: &Result<WorkerAnswer, ForwardError>) -> bool {
    matches!(r, Ok(a) if (200..300).contains(&a.status))
}

/// Tokens generated, as the worker's answer reports them (SGLang `meta_info`, OpenAI
/// `usage`, or the agents' APIs' `usage.output_tokens`: [`kvc_core::openai::completion_tokens_of`]).
pub(crate) fn completion_tokens(body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    kvc_core::openai::completion_tokens_of(&v)
}

/// Prompt tokens the worker's answer says it served from its prefix cache, in any API's
/// shape ([`kvc_core::openai::cached_tokens_of`]: vLLM's (OpenAI's)
/// `usage.prompt_tokens_details.cached_tokens`, Messages' `usage.cache_read_input_tokens`,
/// Responses' `usage.input_tokens_details.cached_tokens`, SGLang's `meta_info.cached_tokens`).
pub(crate) fn cached_tokens(body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    cached_tokens_of(&v)
}

pub(super) use kvc_core::openai::cached_tokens_of;

/// What a decode worker's call adds to the common forwarding (the vLLM dialect); the default
/// adds nothing.
#[derive(Debug, Clone, Default)]
pub(super) struct DecodeLeg {
    /// Headers for D besides the session header (vLLM: `X-Request-Id`, the same as P's).
    pub(super) headers: Vec<(HeaderName, HeaderValue)>,
    /// A direct-to-D turn on an engine without an admission contract: the prompt tokens the
    /// decision counted on D holding, judged against D's reported cached tokens
    /// ([`judge_cache`]).
    pub(super) expected_cached: Option<u64>,
    /// The router asked D for the usage chunk the client did not ask for: usage-only chunks
    /// are removed from the client's stream.
    pub(super) strip_usage: bool,
}

/// The outcome and resident tokens of a request D answered 2xx in full: `ok` with
/// `resident`, unless D reported its cached prompt tokens (`cached`) and they are less than
/// half of what the direct-to-D decision counted on (`expected`): then the session had been
/// evicted from D and D recomputed it, `direct-cache-miss` with 0 resident tokens (the
/// policy stops counting the session resident there; its next turn goes through P).
pub(crate) fn judge_cache(
    expected: Option<u64>,
    cached: Option<u64>,
    resident: u64,
) -> (Outcome, u64) {
    match (expected, cached) {
        (Some(e), Some(c)) if e > 0 && c.saturating_mul(2) < e => (Outcome::DirectCacheMiss, 0),
        _ => (Outcome::Ok, resident),
    }
}

/// The bytes of a worker request's JSON `body`, written into a buffer sized for it up front (a
/// long prompt is most of the body; growing the buffer as it is written copies it over and
/// over).
pub(super) fn payload(body: &Map<String, Value>) -> Bytes {
    let size: usize = body
        .iter()
        .map(|(k, v)| k.len() + 4 + approximate_len(v))
        .sum();
    let mut out = Vec::with_capacity(size + 2);
    serde_json::to_writer(&mut out, body)
        .expect("a map of JSON values with string keys always serializes into memory");
    Bytes::from(out)
}

/// The JSON object `object` (a client's body, known to parse as an object) with `fields`
/// appended as members, its own bytes kept as they came; `None` if it does not end in `}`.
/// `fields` must not be members of `object` already (a duplicate key would be read
/// differently by different parsers).
fn append_fields(object: &Bytes, fields: &[(&String, &Value)]) -> Option<Bytes> {
    if fields.is_empty() {
        return Some(object.clone());
    }
    let close = object.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if object[close] != b'}' {
        return None;
    }
    let head = &object[..close];
    let empty = head
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .is_some_and(|i| head[i] == b'{');
    let extra: usize = fields
        .iter()
        .map(|(k, v)| k.len() + 4 + approximate_len(v))
        .sum();
    let mut out = Vec::with_capacity(head.len() + extra + 2);
    out.extend_from_slice(head);
    for (i, (k, v)) in fields.iter().enumerate() {
        if i > 0 || !empty {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, k).ok()?;
        out.push(b':');
        serde_json::to_writer(&mut out, v).ok()?;
    }
    out.push(b'}');
    Some(Bytes::from(out))
}

/// About how many bytes `v` takes as JSON (its strings' lengths plus a little per value).
fn approximate_len(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len() + 2,
        Value::Array(a) => 2 + a.iter().map(|x| approximate_len(x) + 1).sum::<usize>(),
        Value::Object(o) => {
            2 + o
                .iter()
                .map(|(k, x)| k.len() + 4 + approximate_len(x))
                .sum::<usize>()
        }
        _ => 8,
    }
}

/// An attempt that has its workers: D's endpoint, the payload for both workers and, on a P→D
/// path, P's request already running.
struct Dispatched {
    decode: HttpWorker,
    payload: Bytes,
    prefill: Option<PrefillLeg>,
}

/// One decision being carried out: what every step of the attempt needs.
pub(super) struct Attempt<'a> {
    pub(super) app: &'a Arc<App>,
    pub(super) request: &'a ForwardedRequest,
    pub(super) decision: &'a Decision,
    /// The headers for D: the session header, the trace context (D's call span's when
    /// tracing is on).
    pub(super) headers: Vec<(HeaderName, HeaderValue)>,
    /// D's call span (none when tracing is off): the caller records D's answer on it.
    pub(super) decode_call: WorkerCall,
}

impl<'a> Attempt<'a> {
    pub(super) fn new(
        app: &'a Arc<App>,
        request: &'a ForwardedRequest,
        decision: &'a Decision,
    ) -> Self {
        let decode_call =
            request
                .trace
                .worker_call(decision.decode, Leg::Decode, request.api.path());
        let mut headers = request.worker_headers(app);
        decode_call.apply(&mut headers);
        // A direct-to-D turn on a data-parallel engine goes to the rank holding the session.
        if decision.mode == ExecutionMode::DirectToD
            && let Some(h) = super::direct::rank_header(
                &app.service,
                decision.decode,
                request.session_key.as_deref(),
            )
        {
            headers.push(h);
        }
        Attempt {
            app,
            request,
            decision,
            headers,
            decode_call,
        }
    }

    /// The decode worker.
    pub(super) fn decode(&self) -> WorkerId {
        self.decision.decode
    }

    /// Reports the decision's outcome.
    pub(super) fn report(&self, outcome: Outcome, resident_tokens: u64) {
        self.request.trace.record_outcome(outcome);
        decision::report(
            &self.app.service,
            self.decision.id,
            self.request.request_id,
            outcome,
            resident_tokens,
        );
    }

    /// Reports `worker-failed` and asks for the request to be tried without `failed`.
    pub(super) fn retry(&self, response: Response, failed: Vec<WorkerId>) -> AttemptResult {
        self.report(Outcome::WorkerFailed, 0);
        AttemptResult::RetryElsewhere { response, failed }
    }

    /// P failed before D answered anything. When P says its decode partner never came
    /// (`504`, [`partner_timed_out`]), the failure is D's: D's breaker hears it and the
    /// request is tried again without D (through the same P if it is chosen again).
    /// Otherwise D's request is dropped (not D's failure), the decision reported
    /// `worker-failed`, and the request tried again without P when P's failure is worth it;
    /// otherwise P's answer goes to the client.
    pub(super) fn prefill_failed_first(
        &self,
        prefill: WorkerId,
        answer: PrefillResult,
    ) -> AttemptResult {
        if partner_timed_out(&answer) {
            let decode = self.decode();
            self.app.feed_breaker(decode, true);
            tracing::warn!(
                request = self.request.request_id,
                prefill = prefill.0,
                decode = decode.0,
                "the decode worker never joined the prefill worker's KV transfer"
            );
            let response = error_response(
                StatusCode::GATEWAY_TIMEOUT,
                "worker_error",
                &format!(
                    "decode worker {} never joined the KV transfer of prefill worker {} \
                     (the prefill worker timed out waiting for it)",
                    decode.0, prefill.0
                ),
            );
            return self.retry(response, vec![decode]);
        }
        self.app
            .breakers
            .on_abandoned(&self.app.service, self.decode());
        tracing::info!(
            request = self.request.request_id,
            prefill = prefill.0,
            "prefill worker failed before the decode worker answered"
        );
        if worth_retrying(answer.as_ref().map(|a| a.status)) {
            return self.retry(answer_or_error("prefill worker", answer), vec![prefill]);
        }
        self.report(Outcome::WorkerFailed, 0);
        AttemptResult::Answered(answer_or_error("prefill worker", answer))
    }

    /// Dispatches the attempt and sends D its request (`send`, given the call: D's URL, the
    /// request's path, the attempt's headers, the payload and the request timeout) while P's
    /// request runs on a P→D path: D's answer (see [`Attempt::await_decode`]) with P's leg, or
    /// the attempt's end.
    pub(super) async fn send<'s, T, F>(
        &'s self,
        body: Map<String, Value>,
        send: impl FnOnce(Call<'s>) -> F,
    ) -> Result<(T, Option<PrefillLeg>), AttemptResult>
    where
        F: Future<Output = T>,
    {
        let Dispatched {
            decode,
            payload,
            mut prefill,
        } = self.dispatch(body).map_err(|end| *end)?;
        let call = Call {
            base: decode.url,
            path: self.request.api.path(),
            headers: &self.headers,
            body: payload,
            timeout: self.app.options.request_timeout,
        };
        let answer = self.await_decode(&mut prefill, send(call)).await?;
        Ok((answer, prefill))
    }

    /// Waits for `decode` (D's side of the attempt), racing P's request on a P→D path: P
    /// failing first ends the attempt (see [`Attempt::prefill_failed_first`]).
    pub(super) async fn await_decode<T>(
        &self,
        prefill: &mut Option<PrefillLeg>,
        decode: impl Future<Output = T>,
    ) -> Result<T, AttemptResult> {
        match prefill {
            None => Ok(decode.await),
            Some(p) => p
                .race(decode)
                .await
                .map_err(|p_answer| self.prefill_failed_first(p.id, p_answer)),
        }
    }

    /// D's admission refused the request: not a failure of D (its breaker hears a success),
    /// P's request (if any) is stopped, and the decision is reported `rejected`.
    pub(super) fn refused(
        &self,
        answer: WorkerAnswer,
        prefill: Option<PrefillLeg>,
    ) -> AttemptResult {
        self.app.feed_breaker(self.decode(), false);
        if let Some(p) = prefill {
            p.abandon(self.app);
        }
        tracing::info!(
            request = self.request.request_id,
            decode = self.decode().0,
            "decode worker's admission refused the request"
        );
        self.report(Outcome::Rejected, 0);
        AttemptResult::RefusedByAdmission {
            response: worker_answer(answer),
            decode: self.decode(),
            direct: self.decision.mode == ExecutionMode::DirectToD,
        }
    }

    /// D's failure before any byte reached the client: `failed` D (and P, if it has failed
    /// too) are avoided by a retry; P's request is stopped.
    pub(super) async fn decode_failed(&self, prefill: Option<PrefillLeg>) -> Vec<WorkerId> {
        let mut failed = vec![self.decode()];
        if let Some(mut p) = prefill {
            if p.failed().await {
                failed.push(p.id);
            }
            p.abandon(self.app);
        }
        failed
    }

    /// The payload for both workers, with P's request started on a P→D path (the decode
    /// worker's breaker hears of the dispatch too), or the attempt's end (boxed: it is the
    /// rare path) when a worker has no address.
    fn dispatch(&self, mut body: Map<String, Value>) -> Result<Dispatched, Box<AttemptResult>> {
        let app = self.app;
        let Some(decode) = app.endpoint(self.decode()) else {
            return Err(Box::new(
                self.retry(no_address(self.decode()), vec![self.decode()]),
            ));
        };
        let prefill = match self.decision.prefill {
            None => None,
            Some(p_id) => {
                let Some(p) = app.endpoint(p_id) else {
                    return Err(Box::new(self.retry(no_address(p_id), vec![p_id])));
                };
                app.rooms.add_to(&mut body, &p);
                Some((p_id, p))
            }
        };
        let payload = self.request.payload(&body);
        let prefill = prefill.map(|(p_id, p)| {
            let path = self.request.api.path();
            let call = self.request.trace.worker_call(p_id, Leg::Prefill, path);
            let mut headers = self.headers.clone();
            call.apply(&mut headers);
            PrefillLeg::start(app, p_id, p, path, payload.clone(), headers, call)
        });
        app.breakers
            .on_dispatch(&app.service, self.decode(), app.service.now_ms());
        Ok(Dispatched {
            decode,
            payload,
            prefill,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn failures_are_classified_for_breakers_and_retries() {
        let refused = ForwardError::Unreachable("refused".into());
        assert!(counts_against_breaker(Err(&refused)) && worth_retrying(Err(&refused)));
        let broken = ForwardError::Broken("reset".into());
        assert!(counts_against_breaker(Err(&broken)) && worth_retrying(Err(&broken)));
        let late = ForwardError::Timeout(Duration::from_secs(1));
        assert!(worth_retrying(Err(&late)));
        let bad = ForwardError::BadResponse("x".into());
        assert!(counts_against_breaker(Err(&bad)) && !worth_retrying(Err(&bad)));
        for s in [502, 503, 504] {
            assert!(
                counts_against_breaker(Ok(s)) && worth_retrying(Ok(s)),
                "{s}"
            );
        }
        assert!(counts_against_breaker(Ok(500)) && !worth_retrying(Ok(500)));
        for s in [200, 400, 404] {
            assert!(
                !counts_against_breaker(Ok(s)) && !worth_retrying(Ok(s)),
                "{s}"
            );
        }
        let answer = |status| -> Result<WorkerAnswer, ForwardError> {
            Ok(WorkerAnswer {
                status,
                content_type: None,
                admission_rejected: false,
                body: Bytes::new(),
            })
        };
        assert!(is_success(&answer(204)) && !is_success(&answer(300)));
        assert!(!is_success(&Err(bad)));
        assert_eq!(
            completion_tokens(br#"{"meta_info":{"completion_tokens":4}}"#),
            Some(4)
        );
        assert_eq!(
            completion_tokens(br#"{"usage":{"completion_tokens":6}}"#),
            Some(6)
        );
        assert_eq!(completion_tokens(b"not json"), None);
        assert_eq!(
            cached_tokens(br#"{"usage":{"prompt_tokens_details":{"cached_tokens":32}}}"#),
            Some(32)
        );
        assert_eq!(
            cached_tokens(br#"{"meta_info":{"cached_tokens":3}}"#),
            Some(3)
        );
        assert_eq!(cached_tokens(br#"{"usage":{"prompt_tokens":3}}"#), None);
    }

    #[test]
    fn fields_are_appended_to_the_client_s_own_bytes() {
        let key = "session_params".to_owned();
        let value = serde_json::json!({"id": "a\"b"});
        let fields = [(&key, &value)];
        let got = append_fields(&Bytes::from_static(b"{ \"text\" : \"x y\" }  \n"), &fields);
        assert_eq!(
            &got.unwrap()[..],
            br#"{ "text" : "x y" ,"session_params":{"id":"a\"b"}}"#
        );
        let got = append_fields(&Bytes::from_static(b" { \n } "), &fields).unwrap();
        assert_eq!(
            &got[..],
            br#" { 
 "session_params":{"id":"a\"b"}}"#
        );
        let got: Value = serde_json::from_slice(&got).unwrap();
        assert_eq!(got, serde_json::json!({"session_params": {"id": "a\"b"}}));
        assert_eq!(
            &append_fields(&Bytes::from_static(b"{\"a\":1}"), &[]).unwrap()[..],
            b"{\"a\":1}"
        );
        assert!(append_fields(&Bytes::from_static(b"[1]"), &fields).is_none());
    }

    #[test]
    fn a_direct_turn_served_from_far_less_cache_than_expected_is_a_miss() {
        // Less than half of what the decision counted on.
        assert_eq!(
            judge_cache(Some(100), Some(49), 300),
            (Outcome::DirectCacheMiss, 0)
        );
        assert_eq!(
            judge_cache(Some(100), Some(0), 300),
            (Outcome::DirectCacheMiss, 0)
        );
        assert_eq!(judge_cache(Some(100), Some(50), 300), (Outcome::Ok, 300));
        assert_eq!(judge_cache(Some(100), Some(160), 300), (Outcome::Ok, 300));
        // Nothing expected, nothing reported, or not a direct turn: no judgement.
        assert_eq!(judge_cache(Some(0), Some(0), 300), (Outcome::Ok, 300));
        assert_eq!(judge_cache(Some(100), None, 300), (Outcome::Ok, 300));
        assert_eq!(judge_cache(None, Some(0), 300), (Outcome::Ok, 300));
        assert!(!Outcome::DirectCacheMiss.is_mechanism_error());
    }
}
