//! Forwarding a request whose answer goes to the client whole: D's answer read in full, P's
//! request beside it on a P→D path, the outcome reported and the breakers fed.

use super::app::App;
use super::attempt::{
    Attempt, AttemptResult, DecodeLeg, ForwardedRequest, cached_tokens, completion_tokens,
    counts_against_breaker, failure_outcome, judge_cache, worth_retrying,
};
use super::decision::Decision;
use super::responses::answer_or_error;
use serde_json::{Map, Value};
use std::sync::Arc;

/// Sends the request where `decision` says and waits for D's whole answer; reports the outcome
/// and feeds the workers' breakers.
///
/// On a P→D path P's request runs alongside: if P fails before D has answered, D's request is
/// dropped and P's failure decides ([`AttemptResult::RetryElsewhere`] without P when worth
/// it). Once D has answered, its answer goes to the client whatever P's fate (P's failure
/// still counts against P's breaker): the outcome is `ok` when D answered 2xx in full (or
/// `direct-cache-miss`, see [`judge_cache`], when `leg` expects cached tokens), the
/// engine's refusal of the request itself when it answered 4xx ([`failure_outcome`]), else
/// `worker-failed`.
pub(super) async fn forward_whole(
    app: &Arc<App>,
    request: &ForwardedRequest,
    body: Map<String, Value>,
    decision: &Decision,
    leg: &DecodeLeg,
) -> AttemptResult {
    let mut attempt = Attempt::new(app, request, decision);
    attempt.headers.extend(leg.headers.iter().cloned());
    // A place in its worker's prefill gate, given back with the whole answer (its first
    // token is not seen apart).
    let place = app
        .gate
        .enter_for(decision, request.input_length, app.options.request_timeout)
        .await;
    let sent = attempt.send(body, |call| app.client.post_whole(call));
    let (answer, mut prefill) = match sent.await {
        Ok(sent) => sent,
        Err(end) => return end,
    };
    drop(place);
    let answer = match answer {
        Ok(a) if a.admission_rejected => {
            attempt.decode_call.record_answer(Ok(a.status));
            return attempt.refused(a, prefill);
        }
        other => other,
    };
    let status = answer.as_ref().map(|a| a.status);
    attempt.decode_call.record_answer(status);
    app.feed_breaker(attempt.decode(), counts_against_breaker(status));
    if worth_retrying(status) {
        let failed = attempt.decode_failed(prefill).await;
        return attempt.retry(answer_or_error("decode worker", answer), failed);
    }
    let (outcome, resident) = match &answer {
        Ok(a) if (200..300).contains(&a.status) => {
            let cached = cached_tokens(&a.body);
            let completion = completion_tokens(&a.body);
            if completion.is_some() && app.workers.is_vllm(attempt.decode()) {
                app.service
                    .note_cache_accounting(attempt.decode(), cached.is_some());
            }
            judge_cache(
                leg.expected_cached,
                cached,
                request.input_length + completion.unwrap_or(0),
            )
        }
        _ => {
            // D's answer is final and not a success: P has nobody to hand its KV to.
            if let Some(p) = prefill.take() {
                p.abandon(app);
            }
            (failure_outcome(&answer), 0)
        }
    };
    attempt.report(outcome, resident);
    AttemptResult::Answered(answer_or_error("decode worker", answer))
}
