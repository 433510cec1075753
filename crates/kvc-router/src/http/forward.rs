//! Carrying out one decision: the request to the prefill and decode workers, the answer back
//! (whole, or relayed as it arrives), the outcome report and the circuit breakers' feedback.

use super::client::{
    ForwardError, WorkerResponse, post_json_with_headers, post_streaming_with_headers,
};
use super::request::Api;
use super::{App, HttpWorker, error_response, forward_error_response, report};
use crate::RouterDecision;
use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvc_core::{ExecutionMode, Outcome, WorkerId};
use serde_json::{Map, Value, json};
use std::sync::Arc;
use tokio::task::JoinHandle;

/// One client request, as every attempt forwards it.
pub(super) struct Forward {
    pub(super) api: Api,
    pub(super) request_id: u64,
    pub(super) input_length: u64,
    /// The session key, sent to every worker in the session header.
    pub(super) session_key: Option<Arc<str>>,
}

/// What one forwarding attempt came to. Whatever it is, its decision has been (or, for a
/// relayed stream, will be) reported.
pub(super) enum Attempt {
    /// The client's answer.
    Done(Response),
    /// Failed before any byte reached the client, in a way worth trying elsewhere (connection
    /// refused or broken, timeout before an answer, 502-504, or a prefill worker that failed
    /// before the decode worker answered): `response` is the failure as the client would get
    /// it, `failed` the workers to avoid.
    Retry {
        response: Response,
        failed: Vec<WorkerId>,
    },
    /// The decode worker's admission refused the request (`503` with
    /// `x-kvc-admission: rejected`), reported `rejected`; `response` is its answer.
    Rejected {
        response: Response,
        decode: WorkerId,
        /// Whether the refused decision was direct-to-D.
        direct: bool,
    },
}

/// Extra request headers, owned (they go into spawned tasks).
type Headers = Vec<(String, String)>;

fn header_refs(h: &Headers) -> Vec<(&str, &str)> {
    h.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect()
}

impl Forward {
    /// The session header for the workers (none without a session).
    fn headers(&self, app: &App) -> Headers {
        self.session_key
            .iter()
            .map(|k| (app.options.session_header.clone(), k.to_string()))
            .collect()
    }
}

/// The body a decode worker gets for a direct-to-D turn: SGLang's `/generate` carries the
/// session's continuation parameters, `session_params.id` = the session key, unless the client
/// sent `session_params` itself.
pub(super) fn direct_body(api: Api, body: &mut Map<String, Value>, session_key: Option<&str>) {
    let Some(key) = session_key else { return };
    if api == Api::Generate && body.get("session_params").is_none_or(Value::is_null) {
        body.insert("session_params".into(), json!({ "id": key }));
    }
}

/// Whether a worker's answer (or its absence) counts against its circuit breaker: no answer,
/// or a 5xx status.
pub(super) fn breaker_failure<T>(r: &Result<T, ForwardError>, status: impl Fn(&T) -> u16) -> bool {
    match r {
        Ok(w) => status(w) >= 500,
        Err(_) => true,
    }
}

/// Whether a worker's failure may be retried on another worker: no answer (connection
/// refused or broken, timeout), or 502, 503 or 504.
fn retryable<T>(r: &Result<T, ForwardError>, status: impl Fn(&T) -> u16) -> bool {
    match r {
        Ok(w) => (502..=504).contains(&status(w)),
        Err(ForwardError::Io(_) | ForwardError::Timeout(_)) => true,
        Err(_) => false,
    }
}

fn is_success(r: &Result<WorkerResponse, ForwardError>) -> bool {
    matches!(r, Ok(w) if (200..300).contains(&w.status))
}

/// Tokens generated, as the worker's answer reports them (SGLang `meta_info` or OpenAI
/// `usage`).
fn completion_tokens(body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v.pointer("/meta_info/completion_tokens")
        .or_else(|| v.pointer("/usage/completion_tokens"))
        .and_then(Value::as_u64)
}

/// A worker's whole answer, passed through to the client.
fn worker_answer(w: WorkerResponse) -> Response {
    let status = StatusCode::from_u16(w.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = w
        .content_type
        .and_then(|c| HeaderValue::from_str(&c).ok())
        .unwrap_or(HeaderValue::from_static("application/json"));
    (status, [(header::CONTENT_TYPE, content_type)], w.body).into_response()
}

/// A worker's answer, or its absence, as the client gets it.
fn answer_or_error(who: &str, r: Result<WorkerResponse, ForwardError>) -> Response {
    match r {
        Ok(w) => worker_answer(w),
        Err(e) => forward_error_response(who, &e),
    }
}

/// The 502 for a worker without an HTTP address.
fn no_address(id: u32) -> Response {
    error_response(
        StatusCode::BAD_GATEWAY,
        "worker_error",
        &format!("worker {id} has no HTTP address"),
    )
}

/// The request to the prefill worker of a P→D path, running on its own task (it feeds P's
/// breaker itself, so it may outlive the client's answer).
struct Prefill {
    id: WorkerId,
    task: JoinHandle<Result<WorkerResponse, ForwardError>>,
    /// P's answer once it is known to be a success.
    done: Option<Result<WorkerResponse, ForwardError>>,
}

impl Prefill {
    fn start(
        app: &Arc<App>,
        id: WorkerId,
        p: HttpWorker,
        path: &'static str,
        payload: Arc<[u8]>,
        headers: Headers,
    ) -> Prefill {
        let timeout = app.options.request_timeout;
        app.breakers
            .on_dispatch(&app.service, id, app.service.now_ms());
        let app = Arc::clone(app);
        let task = tokio::spawn(async move {
            let r = post_json_with_headers(&p.url, path, &header_refs(&headers), &payload, timeout)
                .await;
            app.feed_breaker(id, breaker_failure(&r, |w| w.status));
            if !is_success(&r) {
                let detail = match &r {
                    Ok(w) => format!("status {}", w.status),
                    Err(e) => e.to_string(),
                };
                tracing::warn!(worker = id.0, %detail, "prefill worker failed");
            }
            r
        });
        Prefill {
            id,
            task,
            done: None,
        }
    }

    /// Runs `d` (the decode worker's side) to its end, unless P fails first: then `d` is
    /// dropped (closing its connection: D would only wait for KV that never comes) and P's
    /// failure is the error. When both are ready, D's answer wins.
    async fn race<T>(
        &mut self,
        d: impl Future<Output = T>,
    ) -> Result<T, Result<WorkerResponse, ForwardError>> {
        tokio::pin!(d);
        loop {
            if self.done.is_some() {
                return Ok(d.await);
            }
            tokio::select! {
                biased;
                out = &mut d => return Ok(out),
                joined = &mut self.task => {
                    let r = joined.unwrap_or_else(|e| {
                        Err(ForwardError::Io(std::io::Error::other(e.to_string())))
                    });
                    if is_success(&r) {
                        self.done = Some(r);
                    } else {
                        return Err(r);
                    }
                }
            }
        }
    }

    /// Whether P has already failed (its task ended without success).
    async fn failed(&mut self) -> bool {
        if self.done.is_none() && self.task.is_finished() {
            let r = (&mut self.task)
                .await
                .unwrap_or_else(|e| Err(ForwardError::Io(std::io::Error::other(e.to_string()))));
            let failed = !is_success(&r);
            self.done = Some(r);
            return failed;
        }
        self.done.as_ref().is_some_and(|r| !is_success(r))
    }

    /// Stops P's request if it is still running: D will take no KV from it. Its breaker is
    /// not fed (the failure was not P's).
    fn abandon(self, app: &App) {
        if self.done.is_none() && !self.task.is_finished() {
            self.task.abort();
            app.breakers.on_abandoned(&app.service, self.id);
        }
    }
}

/// The start of an attempt: D's endpoint, the payload for both workers and P's request
/// (P→D), or the attempt's end when a worker has no address.
enum Start {
    Ready(HttpWorker, Arc<[u8]>, Option<Prefill>),
    Failed(Attempt),
}

/// What every attempt shares: the decision, the workers and the request.
struct Leg<'a> {
    app: &'a Arc<App>,
    fwd: &'a Forward,
    decision: &'a RouterDecision,
    d_id: WorkerId,
}

impl Leg<'_> {
    fn report(&self, outcome: Outcome, resident_tokens: u64) {
        report(
            self.app,
            self.decision.decision_id,
            self.fwd.request_id,
            outcome,
            resident_tokens,
        );
    }

    fn retry(&self, response: Response, failed: Vec<WorkerId>) -> Attempt {
        self.report(Outcome::WorkerFailed, 0);
        Attempt::Retry { response, failed }
    }

    /// P failed before D answered anything: D's request is dropped (not D's failure), the
    /// decision reported `worker-failed`, and the request tried again without P when P's
    /// failure is worth it; otherwise P's answer goes to the client.
    fn prefill_failed_first(
        &self,
        p_id: WorkerId,
        pr: Result<WorkerResponse, ForwardError>,
    ) -> Attempt {
        self.app.breakers.on_abandoned(&self.app.service, self.d_id);
        tracing::info!(
            request = self.fwd.request_id,
            prefill = p_id.0,
            "prefill worker failed before the decode worker answered"
        );
        if retryable(&pr, |w| w.status) {
            return self.retry(answer_or_error("prefill worker", pr), vec![p_id]);
        }
        self.report(Outcome::WorkerFailed, 0);
        Attempt::Done(answer_or_error("prefill worker", pr))
    }

    /// D's admission refused the request: not a failure of D (its breaker hears a success),
    /// P's request (if any) is stopped, and the decision is reported `rejected`.
    fn refused(&self, w: WorkerResponse, prefill: Option<Prefill>) -> Attempt {
        self.app.feed_breaker(self.d_id, false);
        if let Some(p) = prefill {
            p.abandon(self.app);
        }
        tracing::info!(
            request = self.fwd.request_id,
            decode = self.d_id.0,
            "decode worker's admission refused the request"
        );
        self.report(Outcome::Rejected, 0);
        Attempt::Rejected {
            response: worker_answer(w),
            decode: self.d_id,
            direct: self.decision.mode == ExecutionMode::DirectToD,
        }
    }

    /// The payload for both workers and P's request, started (P→D), or why not.
    fn start(&self, mut body: Map<String, Value>, headers: &Headers) -> Start {
        let app = self.app;
        let Some(d) = app.endpoint(self.d_id.0) else {
            return Start::Failed(self.retry(no_address(self.d_id.0), vec![self.d_id]));
        };
        let Some(WorkerId(p_id)) = self.decision.prefill_worker else {
            let payload: Arc<[u8]> = Value::Object(body).to_string().into_bytes().into();
            return Start::Ready(d, payload, None);
        };
        let Some(p) = app.endpoint(p_id) else {
            return Start::Failed(self.retry(no_address(p_id), vec![WorkerId(p_id)]));
        };
        app.add_bootstrap(&mut body, &p);
        let payload: Arc<[u8]> = Value::Object(body).to_string().into_bytes().into();
        let prefill = Prefill::start(
            app,
            WorkerId(p_id),
            p,
            self.fwd.api.path(),
            Arc::clone(&payload),
            headers.clone(),
        );
        Start::Ready(d, payload, Some(prefill))
    }
}

/// Sends the request where `decision` says and waits for D's whole answer; reports the outcome
/// and feeds the workers' breakers.
///
/// On a P→D path P's request runs alongside: if P fails before D has answered, D's request is
/// dropped and P's failure decides ([`Attempt::Retry`] without P when worth it). Once D has
/// answered, its answer goes to the client whatever P's fate (P's failure still counts against
/// P's breaker): the outcome is `ok` when D answered 2xx in full.
pub(super) async fn forward_whole(
    app: &Arc<App>,
    fwd: &Forward,
    body: Map<String, Value>,
    decision: &RouterDecision,
) -> Attempt {
    let leg = Leg {
        app,
        fwd,
        decision,
        d_id: decision.decode_worker,
    };
    let timeout = app.options.request_timeout;
    let headers = fwd.headers(app);
    let (d, payload, mut prefill) = match leg.start(body, &headers) {
        Start::Ready(d, payload, prefill) => (d, payload, prefill),
        Start::Failed(attempt) => return attempt,
    };
    app.breakers
        .on_dispatch(&app.service, leg.d_id, app.service.now_ms());
    let refs = header_refs(&headers);
    let d_call = post_json_with_headers(&d.url, fwd.api.path(), &refs, &payload, timeout);
    let dr = match &mut prefill {
        None => d_call.await,
        Some(p) => match p.race(d_call).await {
            Ok(dr) => dr,
            Err(pr) => return leg.prefill_failed_first(p.id, pr),
        },
    };
    let dr = match dr {
        Ok(w) if w.is_admission_reject() => return leg.refused(w, prefill),
        other => other,
    };
    app.feed_breaker(leg.d_id, breaker_failure(&dr, |w| w.status));
    if retryable(&dr, |w| w.status) {
        let mut failed = vec![leg.d_id];
        if let Some(mut p) = prefill {
            if p.failed().await {
                failed.push(p.id);
            }
            p.abandon(app);
        }
        return leg.retry(answer_or_error("decode worker", dr), failed);
    }
    let (outcome, resident) = match &dr {
        Ok(w) if (200..300).contains(&w.status) => (
            Outcome::Ok,
            fwd.input_length + completion_tokens(&w.body).unwrap_or(0),
        ),
        _ => {
            // D's answer is final and not a success: P has nobody to hand its KV to.
            if let Some(p) = prefill.take() {
                p.abandon(app);
            }
            (Outcome::WorkerFailed, 0)
        }
    };
    leg.report(outcome, resident);
    Attempt::Done(answer_or_error("decode worker", dr))
}

/// The streaming variant of [`forward_whole`]: D's answer is relayed to the client as it
/// arrives, from its first piece on, and the outcome is reported when it has ended (`ok` when
/// D's stream completed with a 2xx status).
///
/// Nothing reaches the client before D's first piece of body: until then a failure of D
/// (no head, a 502-504 head when `may_retry`, a body broken or silent before its first piece)
/// or of P (on a P→D path) is an [`Attempt::Retry`] like in [`forward_whole`].
pub(super) async fn forward_stream(
    app: &Arc<App>,
    fwd: &Forward,
    body: Map<String, Value>,
    decision: &RouterDecision,
    may_retry: bool,
) -> Attempt {
    let leg = Leg {
        app,
        fwd,
        decision,
        d_id: decision.decode_worker,
    };
    let d_id = leg.d_id;
    let timeout = app.options.request_timeout;
    let headers = fwd.headers(app);
    let (d, payload, mut prefill) = match leg.start(body, &headers) {
        Start::Ready(d, payload, prefill) => (d, payload, prefill),
        Start::Failed(attempt) => return attempt,
    };
    app.breakers
        .on_dispatch(&app.service, d_id, app.service.now_ms());
    let refs = header_refs(&headers);
    let open = post_streaming_with_headers(&d.url, fwd.api.path(), &refs, &payload, timeout);
    let mut opened = match &mut prefill {
        None => open.await,
        Some(p) => match p.race(open).await {
            Ok(o) => o,
            Err(pr) => return leg.prefill_failed_first(p.id, pr),
        },
    };
    if let Ok(ws) = &mut opened
        && ws.is_admission_reject()
    {
        let body = ws.read_rest(timeout).await.unwrap_or_default();
        let w = WorkerResponse {
            status: ws.status,
            content_type: ws.content_type.take(),
            admission: ws.admission.take(),
            body,
        };
        return leg.refused(w, prefill);
    }
    let head_failed = breaker_failure(&opened, |w| w.status);
    let head_retryable = retryable(&opened, |w| w.status);
    // A 502-504 head with no retry left is relayed like any other answer.
    let mut ws = match opened {
        Ok(ws) if !(may_retry && head_retryable) => ws,
        other => {
            app.feed_breaker(d_id, true);
            let mut failed = vec![d_id];
            if let Some(mut p) = prefill {
                if p.failed().await {
                    failed.push(p.id);
                }
                p.abandon(app);
            }
            let response = match &other {
                Ok(ws) => error_response(
                    StatusCode::from_u16(ws.status).unwrap_or(StatusCode::BAD_GATEWAY),
                    "worker_error",
                    &format!("decode worker answered {}", ws.status),
                ),
                Err(e) => forward_error_response("decode worker", e),
            };
            if head_retryable {
                return leg.retry(response, failed);
            }
            leg.report(Outcome::WorkerFailed, 0);
            return Attempt::Done(response);
        }
    };
    // Wait for the first piece of D's body before answering the client: until then the
    // request can still go elsewhere.
    let first = {
        let next = tokio::time::timeout(timeout, ws.next_chunk());
        match &mut prefill {
            None => next.await,
            Some(p) => match p.race(next).await {
                Ok(r) => r,
                Err(pr) => return leg.prefill_failed_first(p.id, pr),
            },
        }
    };
    let first = match first {
        Ok(Ok(piece)) => piece,
        failure => {
            app.feed_breaker(d_id, true);
            if let Some(p) = prefill {
                p.abandon(app);
            }
            let response = match failure {
                Ok(Err(e)) => forward_error_response("decode worker", &e),
                _ => forward_error_response("decode worker", &ForwardError::Timeout(timeout)),
            };
            if may_retry {
                return leg.retry(response, vec![d_id]);
            }
            leg.report(Outcome::WorkerFailed, 0);
            return Attempt::Done(response);
        }
    };
    let status = StatusCode::from_u16(ws.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = ws
        .content_type
        .as_deref()
        .and_then(|c| HeaderValue::from_str(c).ok())
        .unwrap_or(HeaderValue::from_static("text/event-stream"));
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    let relay_app = Arc::clone(app);
    let (request_id, decision_id, input_length) =
        (fwd.request_id, decision.decision_id, fwd.input_length);
    tokio::spawn(async move {
        let app = relay_app;
        let mut scan = CompletionScan::default();
        let mut ends_event = true;
        let mut worker_broke = false;
        let mut pending = first;
        let relayed = loop {
            let next = match pending.take() {
                Some(piece) => Ok(Some(piece)),
                None => match tokio::time::timeout(timeout, ws.next_chunk()).await {
                    Ok(Ok(piece)) => Ok(piece),
                    Ok(Err(e)) => Err(format!("decode worker: {e}")),
                    Err(_) => Err(format!("decode worker: nothing within {timeout:?}")),
                },
            };
            match next {
                Ok(Some(piece)) => {
                    scan.feed(&piece);
                    ends_event = piece.ends_with(b"\n\n");
                    if tx.send(Ok(Bytes::from(piece))).await.is_err() {
                        tracing::debug!(request = request_id, "client went away mid-stream");
                        break false;
                    }
                }
                Ok(None) => break true,
                Err(message) => {
                    worker_broke = true;
                    tracing::warn!(request = request_id, error = %message, "stream ended early");
                    let _ = tx.send(Ok(sse_error_event(&message, !ends_event))).await;
                    break false;
                }
            }
        };
        // The client's stream ends here.
        drop(tx);
        app.feed_breaker(d_id, head_failed || worker_broke);
        if !relayed && let Some(p) = prefill {
            p.abandon(&app);
        }
        let ok = relayed && status.is_success();
        let (outcome, resident) = if ok {
            (Outcome::Ok, input_length + scan.finish().unwrap_or(0))
        } else {
            (Outcome::WorkerFailed, 0)
        };
        report(&app, decision_id, request_id, outcome, resident);
    });
    let body = axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Attempt::Done((status, [(header::CONTENT_TYPE, content_type)], body).into_response())
}

/// Finds the generated-token count in a streamed answer: the last `data:` line (SSE) or line
/// of JSON that carries `meta_info.completion_tokens` or `usage.completion_tokens`.
#[derive(Debug, Default)]
pub(super) struct CompletionScan {
    line: Vec<u8>,
    overflow: bool,
    tokens: Option<u64>,
}

impl CompletionScan {
    /// Longest line examined; longer ones are skipped.
    pub(super) const MAX_LINE: usize = 1 << 20;

    pub(super) fn feed(&mut self, bytes: &[u8]) {
        for part in bytes.split_inclusive(|b| *b == b'\n') {
            if self.line.len() + part.len() > Self::MAX_LINE {
                self.overflow = true;
                self.line.clear();
            } else {
                self.line.extend_from_slice(part);
            }
            if part.ends_with(b"\n") {
                self.end_line();
            }
        }
    }

    fn end_line(&mut self) {
        if !self.overflow {
            let line = self.line.trim_ascii();
            let json = line.strip_prefix(b"data:").unwrap_or(line).trim_ascii();
            if let Some(n) = completion_tokens(json) {
                self.tokens = Some(n);
            }
        }
        self.line.clear();
        self.overflow = false;
    }

    pub(super) fn finish(mut self) -> Option<u64> {
        self.end_line();
        self.tokens
    }
}

/// The SSE event that ends a client's stream when the worker failed mid-stream.
pub(super) fn sse_error_event(message: &str, after_partial_event: bool) -> Bytes {
    let event = json!({ "error": {
        "message": message,
        "type": "worker_error",
        "code": StatusCode::BAD_GATEWAY.as_u16(),
    } });
    let lead = if after_partial_event { "\n\n" } else { "" };
    Bytes::from(format!("{lead}data: {event}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_tokens_are_found_in_split_sse_events() {
        let mut scan = CompletionScan::default();
        scan.feed(b"data: {\"meta_info\": {\"completion_");
        scan.feed(b"tokens\": 3}}\n\ndata: {\"usage\": {\"completion_tokens\": 5}}\n");
        scan.feed(b"\ndata: {\"text\": \"no count\"}\n\ndata: [DONE]\n\n");
        assert_eq!(scan.finish(), Some(5), "the last count seen");
        let mut scan = CompletionScan::default();
        scan.feed(b"{\"usage\": {\"completion_tokens\": 7}}");
        assert_eq!(scan.finish(), Some(7), "a final line without its line end");
        let mut scan = CompletionScan::default();
        scan.feed(&vec![b'x'; CompletionScan::MAX_LINE + 1]);
        scan.feed(b"{\"usage\": {\"completion_tokens\": 9}}\n");
        assert_eq!(scan.finish(), None, "an over-long line is skipped whole");
        assert_eq!(CompletionScan::default().finish(), None);
    }

    #[test]
    fn sse_error_events_are_well_formed() {
        let e = sse_error_event("decode worker: gone", false);
        let text = std::str::from_utf8(&e).unwrap();
        let json = text
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        let v: Value = serde_json::from_str(json).unwrap();
        assert_eq!(v["error"]["message"], "decode worker: gone");
        assert_eq!(v["error"]["type"], "worker_error");
        assert_eq!(v["error"]["code"], 502);
        let after = sse_error_event("x", true);
        assert!(
            after.starts_with(b"\n\ndata: "),
            "a cut event is closed first"
        );
    }

    #[test]
    fn direct_turns_of_generate_carry_the_session_params() {
        let mut body = Map::new();
        direct_body(Api::Generate, &mut body, Some("agent-1"));
        assert_eq!(
            Value::Object(body),
            json!({"session_params": {"id": "agent-1"}})
        );
        let mut body = json!({"session_params": null}).as_object().unwrap().clone();
        direct_body(Api::Generate, &mut body, Some("agent-1"));
        assert_eq!(body["session_params"], json!({"id": "agent-1"}));
        // What the client sent is kept.
        let sent = json!({"session_params": {"id": "mine", "offset": 3}});
        let mut body = sent.as_object().unwrap().clone();
        direct_body(Api::Generate, &mut body, Some("agent-1"));
        assert_eq!(Value::Object(body), sent);
        // Other APIs, or no session: unchanged.
        for (api, key) in [
            (Api::Completions, Some("agent-1")),
            (Api::ChatCompletions, Some("agent-1")),
            (Api::Generate, None),
        ] {
            let mut body = Map::new();
            direct_body(api, &mut body, key);
            assert!(body.is_empty(), "{api:?}");
        }
    }

    #[test]
    fn failures_are_classified_for_breakers_and_retries() {
        let answer = |status| -> Result<WorkerResponse, ForwardError> {
            Ok(WorkerResponse {
                status,
                content_type: None,
                admission: None,
                body: Vec::new(),
            })
        };
        let refused: Result<WorkerResponse, ForwardError> =
            Err(ForwardError::Io(std::io::Error::other("refused")));
        let status = |w: &WorkerResponse| w.status;
        assert!(breaker_failure(&refused, status) && retryable(&refused, status));
        assert!(retryable(
            &Err::<WorkerResponse, _>(ForwardError::Timeout(std::time::Duration::from_secs(1))),
            status
        ));
        assert!(!retryable(
            &Err::<WorkerResponse, _>(ForwardError::BadResponse("x".into())),
            status
        ));
        for s in [502, 503, 504] {
            assert!(
                breaker_failure(&answer(s), status) && retryable(&answer(s), status),
                "{s}"
            );
        }
        assert!(breaker_failure(&answer(500), status) && !retryable(&answer(500), status));
        for s in [200, 400, 404] {
            assert!(
                !breaker_failure(&answer(s), status) && !retryable(&answer(s), status),
                "{s}"
            );
        }
        assert!(is_success(&answer(204)) && !is_success(&answer(300)));
        assert_eq!(
            completion_tokens(br#"{"meta_info":{"completion_tokens":4}}"#),
            Some(4)
        );
        assert_eq!(
            completion_tokens(br#"{"usage":{"completion_tokens":6}}"#),
            Some(6)
        );
        assert_eq!(completion_tokens(b"not json"), None);
    }
}
