//! Forwarding a streamed request: nothing reaches the client before D's first piece of body
//! (until then the request can go elsewhere); from it on, D's answer is relayed to the client
//! as it arrives, and the outcome is reported when the stream has ended.

use super::app::App;
use super::attempt::{
    Attempt, AttemptResult, DecodeLeg, ForwardedRequest, counts_against_breaker, judge_cache,
    refusal_outcome, worth_retrying,
};
use super::decision::{self, Decision};
use super::pairing::PrefillLeg;
use super::request::Api;
use super::responses::{error_response, forward_error_response};
use super::sse::{CompletionScan, ScanEnd, UsageFilter, sse_error_event};
use crate::telemetry::{RequestSpan, WorkerCall};
use crate::worker_http::{ForwardError, WorkerAnswer, WorkerStream};
use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use kvc_core::{Outcome, WorkerId};
use serde_json::{Map, Value};
use std::sync::Arc;
use std::time::Duration;

/// The streaming counterpart of [`super::whole::forward_whole`]: D's answer is relayed to the
/// client as it arrives, from its first piece on, and the outcome is reported when it has
/// ended (`ok` when D's stream completed with a 2xx status).
///
/// Nothing reaches the client before D's first piece of body: until then a failure of D (no
/// head, a 502-504 head when `may_retry`, a body broken or silent before its first piece) or
/// of P (on a P→D path) is an [`AttemptResult::RetryElsewhere`], as for a whole answer.
pub(super) async fn forward_stream(
    app: &Arc<App>,
    request: &ForwardedRequest,
    body: Map<String, Value>,
    decision: &Decision,
    may_retry: bool,
    leg: &DecodeLeg,
) -> AttemptResult {
    let mut attempt = Attempt::new(app, request, decision);
    attempt.headers.extend(leg.headers.iter().cloned());
    let d_id = attempt.decode();
    let timeout = app.options.request_timeout;
    // A place in its worker's prefill gate, given back at the first piece of the answer.
    let mut place = app
        .gate
        .enter_for(decision, request.input_length, timeout)
        .await;
    let sent = attempt.send(body, |call| app.client.post_streaming(call));
    let (opened, mut prefill) = match sent.await {
        Ok(sent) => sent,
        Err(end) => return end,
    };
    let opened = match opened {
        Ok(stream) if stream.admission_rejected => {
            // The refusal stands even if its body is lost on the way.
            let lost_body = WorkerAnswer {
                status: stream.status,
                content_type: stream.content_type.clone(),
                admission_rejected: true,
                body: Bytes::new(),
            };
            attempt.decode_call.record_answer(Ok(stream.status));
            let answer = stream.read_rest(timeout).await.unwrap_or(lost_body);
            return attempt.refused(answer, prefill);
        }
        other => other,
    };
    let status = opened.as_ref().map(|s| s.status);
    attempt.decode_call.record_answer(status);
    let head_failed = counts_against_breaker(status);
    let head_retryable = worth_retrying(status);
    // A 502-504 head with no retry left is relayed like any other answer.
    let mut stream = match opened {
        Ok(s) if !(may_retry && head_retryable) => s,
        other => {
            app.feed_breaker(d_id, true);
            let failed = attempt.decode_failed(prefill).await;
            let response = match &other {
                Ok(s) => error_response(
                    StatusCode::from_u16(s.status).unwrap_or(StatusCode::BAD_GATEWAY),
                    "worker_error",
                    &format!("decode worker answered {}", s.status),
                ),
                Err(e) => forward_error_response("decode worker", e),
            };
            if head_retryable {
                return attempt.retry(response, failed);
            }
            attempt.report(Outcome::WorkerFailed, 0);
            return AttemptResult::Answered(response);
        }
    };
    // Wait for the first piece of D's body before answering the client: until then the
    // request can still go elsewhere.
    let next = tokio::time::timeout(timeout, stream.next_piece());
    let first = match attempt.await_decode(&mut prefill, next).await {
        Ok(r) => r,
        Err(end) => return end,
    };
    let first = match first {
        Ok(Ok(piece)) => piece,
        failure => {
            attempt
                .decode_call
                .record_failure("stream-broken", "no first piece of the answer");
            app.feed_breaker(d_id, true);
            if let Some(p) = prefill {
                p.abandon(app);
            }
            let response = match failure {
                Ok(Err(e)) => forward_error_response("decode worker", &e),
                _ => forward_error_response("decode worker", &ForwardError::Timeout(timeout)),
            };
            if may_retry {
                return attempt.retry(response, vec![d_id]);
            }
            attempt.report(Outcome::WorkerFailed, 0);
            return AttemptResult::Answered(response);
        }
    };
    let status = StatusCode::from_u16(stream.status).unwrap_or(StatusCode::BAD_GATEWAY);
    place.release();
    if status.is_success() {
        decision::report_first_token(&app.service, decision);
    }
    let content_type = stream
        .content_type
        .take()
        .unwrap_or(HeaderValue::from_static("text/event-stream"));
    // Only an event stream is filtered: an error answer's JSON body is relayed as it is.
    let events = content_type
        .to_str()
        .is_ok_and(|t| t.starts_with("text/event-stream"));
    let strip_usage = leg.strip_usage && status.is_success() && events;
    // An engine's refusal of the request is judged from its status and first piece (its
    // whole error body, as a rule).
    let refusal = refusal_outcome(status.as_u16(), first.as_deref().unwrap_or_default());
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    let relay = Relay {
        app: Arc::clone(app),
        decision: decision.id,
        request_id: request.request_id,
        api: request.api,
        input_length: request.input_length,
        decode: d_id,
        head_failed,
        status,
        refusal,
        timeout,
        expected_cached: leg.expected_cached,
        filter: strip_usage.then(UsageFilter::default),
        call: std::mem::take(&mut attempt.decode_call),
        trace: request.trace.clone(),
    };
    tokio::spawn(relay.run(stream, first, prefill, tx));
    let body = axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    AttemptResult::Answered((status, [(header::CONTENT_TYPE, content_type)], body).into_response())
}

/// The task that relays D's stream to the client after its first piece, then reports the
/// outcome and feeds D's breaker.
struct Relay {
    app: Arc<App>,
    decision: u64,
    request_id: u64,
    /// The client's API (the shape of a mid-stream error event).
    api: Api,
    input_length: u64,
    decode: WorkerId,
    /// D's head was a failure status (relayed: no retry was left).
    head_failed: bool,
    status: StatusCode,
    /// D refused the request itself (a 4xx): the outcome whatever becomes of the relay.
    refusal: Option<Outcome>,
    /// Longest wait for each further piece.
    timeout: Duration,
    /// See [`DecodeLeg::expected_cached`].
    expected_cached: Option<u64>,
    /// Removes the usage chunk the client did not ask for ([`DecodeLeg::strip_usage`]).
    filter: Option<UsageFilter>,
    /// D's call span (declared before `trace`: it ends first, within the request's span).
    call: WorkerCall,
    /// The request's span: it ends once the stream has (this holds it until then).
    trace: RequestSpan,
}

impl Relay {
    async fn run(
        mut self,
        mut stream: WorkerStream,
        first: Option<Bytes>,
        prefill: Option<PrefillLeg>,
        tx: tokio::sync::mpsc::Sender<Result<Bytes, std::convert::Infallible>>,
    ) {
        let timeout = self.timeout;
        let mut scan = CompletionScan::default();
        let mut ends_event = true;
        let mut worker_broke = false;
        let mut pending = Some(first);
        // Set once the outcome is reported: at D's closing event, before the client reads it
        // (a client may send its next turn as soon as it has, and that turn must find this
        // one's outcome recorded), or at the end of the stream.
        let mut reported = false;
        let relayed = loop {
            let next = match pending.take() {
                Some(piece) => Ok(piece),
                None => match tokio::time::timeout(timeout, stream.next_piece()).await {
                    Ok(Ok(piece)) => Ok(piece),
                    Ok(Err(e)) => Err(format!("decode worker: {e}")),
                    Err(_) => Err(format!("decode worker: nothing within {timeout:?}")),
                },
            };
            let next = match (next, self.filter.as_mut()) {
                (Ok(Some(piece)), Some(f)) => {
                    // The filter hands the client whole events only.
                    scan.feed(&piece);
                    let out = f.feed(&piece);
                    if out.is_empty() {
                        continue;
                    }
                    Ok(Some(out))
                }
                (Ok(None), Some(f)) => {
                    let out = f.finish();
                    if !out.is_empty() && tx.send(Ok(out)).await.is_err() {
                        break false;
                    }
                    Ok(None)
                }
                (Ok(Some(piece)), None) => {
                    scan.feed(&piece);
                    ends_event = !scan.in_event();
                    Ok(Some(piece))
                }
                (other, _) => other,
            };
            if !reported && scan.ended() && self.status.is_success() {
                let (outcome, resident) = self.judge(scan.so_far());
                self.report(outcome, resident);
                reported = true;
            }
            match next {
                Ok(Some(piece)) => {
                    if tx.send(Ok(piece)).await.is_err() {
                        tracing::debug!(request = self.request_id, "client went away mid-stream");
                        break false;
                    }
                }
                Ok(None) => break true,
                Err(message) => {
                    worker_broke = true;
                    self.call.record_failure("stream-broken", &message);
                    tracing::warn!(request = self.request_id, error = %message, "stream ended early");
                    let _ = tx
                        .send(Ok(sse_error_event(self.api, &message, !ends_event)))
                        .await;
                    break false;
                }
            }
        };
        let app = &self.app;
        app.feed_breaker(self.decode, self.head_failed || worker_broke);
        if !relayed && let Some(p) = prefill {
            p.abandon(app);
        }
        if !reported {
            let (outcome, resident) = if relayed && self.status.is_success() {
                self.judge(scan.finish())
            } else {
                (self.refusal.unwrap_or(Outcome::WorkerFailed), 0)
            };
            self.report(outcome, resident);
        }
        // The client's stream ends here, after the outcome is recorded.
        drop(tx);
    }

    /// The outcome of a stream that completed, from the counts its events reported.
    fn judge(&self, end: ScanEnd) -> (Outcome, u64) {
        if end.completion.is_some() && self.app.workers.is_vllm(self.decode) {
            self.app
                .service
                .note_cache_accounting(self.decode, end.cached.is_some());
        }
        judge_cache(
            self.expected_cached,
            end.cached,
            self.input_length + end.completion.unwrap_or(0),
        )
    }

    fn report(&self, outcome: Outcome, resident: u64) {
        self.trace.record_outcome(outcome);
        decision::report(
            &self.app.service,
            self.decision,
            self.request_id,
            outcome,
            resident,
        );
    }
}
