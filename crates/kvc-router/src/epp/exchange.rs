//! One ext_proc stream: one client request through Envoy, from its headers to the end of its
//! answer. Each message Envoy sends is answered here; the decision is made once the body is
//! whole, and its outcome reported once the answer has ended (or the stream broke).

use super::wire::{
    self, DESTINATION_HEADER, DROPPED_REASON_HEADER, LB_NAMESPACE, PREFILLER_HEADER, SERVED_KEY,
    SUBSET_KEY, SUBSET_NAMESPACE,
};
use crate::RequestError;
use crate::http::{
    Api, App, CompletionScan, Decision, Prepared, UsageFilter, add_continuation_params,
    ask_for_usage, cached_tokens, client_wants_usage, completion_tokens, in_anthropic_shape,
    judge_cache, prepare_request, readiness_of, refusal_outcome, report_outcome,
    route_error_response, route_query,
};
use crate::worker_http::{ADMISSION_HEADER, MAX_RESPONSE_BYTES};
use axum::http::HeaderMap;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_request,
};
use kvc_core::{ExecutionMode, Outcome, StableName, WorkerId, WorkerRole};
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Where one request is in its exchange.
enum Phase {
    /// Nothing seen yet.
    Start,
    /// The request headers came; the body is being buffered.
    Buffering {
        headers: HeaderMap,
        path: String,
        body: Vec<u8>,
        subset: Vec<String>,
    },
    /// The request went on (or was answered): only its answer is left.
    Sent,
}

/// A decision whose answer is awaited: what its outcome is judged by.
struct Pending {
    decision: Decision,
    request_id: u64,
    input_length: u64,
    /// The endpoint picked, `ip:port`.
    picked: String,
    /// The prompt tokens a vLLM direct-to-D decision counted on D holding.
    expected_cached: Option<u64>,
    /// The router asked for the usage chunk the client did not: it is removed.
    filter: Option<UsageFilter>,
    session_key: Option<Arc<str>>,
    status: Option<u16>,
    admission_refused: bool,
    scan: CompletionScan,
    /// A whole (non-event-stream) answer, up to [`MAX_RESPONSE_BYTES`].
    whole: Vec<u8>,
    event_stream: bool,
    served_elsewhere: bool,
}

/// The state of one ext_proc stream.
pub(crate) struct Exchange {
    app: Arc<App>,
    next_any: Arc<AtomicUsize>,
    phase: Phase,
    pending: Option<Pending>,
}

impl Exchange {
    /// A new exchange over the front's shared state; `next_any` turns the endpoint of
    /// requests routed without a decision (no body, or a path the router does not route).
    pub(crate) fn new(app: Arc<App>, next_any: Arc<AtomicUsize>) -> Self {
        Exchange {
            app,
            next_any,
            phase: Phase::Start,
            pending: None,
        }
    }

    /// The answers to one message of Envoy's.
    pub(crate) async fn on_message(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        let meta = msg.metadata_context.as_ref();
        match msg.request {
            Some(processing_request::Request::RequestHeaders(h)) => self.request_headers(h, meta),
            Some(processing_request::Request::RequestBody(b)) => self.request_body(b).await,
            Some(processing_request::Request::RequestTrailers(_)) => {
                vec![wire::trailers_response(true)]
            }
            Some(processing_request::Request::ResponseHeaders(h)) => {
                self.response_headers(&h, meta)
            }
            Some(processing_request::Request::ResponseBody(b)) => self.response_body(b),
            Some(processing_request::Request::ResponseTrailers(_)) => {
                self.finish();
                vec![wire::trailers_response(false)]
            }
            None => Vec::new(),
        }
    }

    fn request_headers(
        &mut self,
        h: HttpHeaders,
        meta: Option<&Metadata>,
    ) -> Vec<ProcessingResponse> {
        let (headers, path, _method, _) = wire::read_headers(h.headers.as_ref());
        let subset = wire::metadata_strings(meta, SUBSET_NAMESPACE, SUBSET_KEY);
        if h.end_of_stream {
            // No body: nothing to decide on; any ready endpoint serves it.
            self.phase = Phase::Sent;
            return vec![self.pick_any(&subset)];
        }
        self.phase = Phase::Buffering {
            headers,
            path,
            body: Vec::new(),
            subset,
        };
        Vec::new()
    }

    async fn request_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        let Phase::Buffering { body, .. } = &mut self.phase else {
            return Vec::new();
        };
        if body.len() + b.body.len() > self.app.options.max_body_bytes {
            self.phase = Phase::Sent;
            return vec![immediate_error(
                413,
                "invalid_request_error",
                &format!(
                    "the request body is over {} bytes (http.max-body-bytes)",
                    self.app.options.max_body_bytes
                ),
            )];
        }
        body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            return Vec::new();
        }
        let Phase::Buffering {
            headers,
            path,
            body,
            subset,
        } = std::mem::replace(&mut self.phase, Phase::Sent)
        else {
            return Vec::new();
        };
        let body = axum::body::Bytes::from(body);
        let api = match path.split('?').next().unwrap_or_default() {
            "/v1/completions" => Api::Completions,
            "/v1/chat/completions" => Api::ChatCompletions,
            "/v1/messages" => Api::Messages,
            "/v1/responses" => Api::Responses,
            "/generate" => Api::Generate,
            // A path the router does not route (e.g. a cache flush): any ready endpoint.
            _ => {
                let mut out = vec![self.pick_any(&subset)];
                if matches!(out[0].response, Some(ref r) if !is_immediate(r)) {
                    out.extend(wire::body_chunks(true, &body));
                }
                return out;
            }
        };
        let prepared = match prepare_request(&self.app, api, &headers, body).await {
            Ok(p) => p,
            Err(response) if api.anthropic_errors() => {
                return vec![immediate_from(in_anthropic_shape(response)).await];
            }
            Err(response) => return vec![immediate_from(response).await],
        };
        match self.decide(prepared, &subset) {
            Ok(out) => out,
            Err(e) => vec![route_refusal(&e).await],
        }
    }

    /// The decision for a prepared request, within the subset hint when Envoy sent one:
    /// the headers answer and the body back, or an immediate answer.
    fn decide(
        &mut self,
        p: Prepared,
        subset: &[String],
    ) -> Result<Vec<ProcessingResponse>, RequestError> {
        let app = &self.app;
        let excluded = match self.outside_subset(subset) {
            Ok(e) => e,
            Err(why) => return Ok(vec![immediate_error(503, "unavailable", why)]),
        };
        app.breakers.tick(&app.service, app.service.now_ms());
        let decision = route_query(&app.service, &p.query, &excluded)?;
        if p.ends_session {
            // The session's last turn (`x-session-final`): it ends once its outcome is in.
            app.service.end_session_after(decision.id);
        }
        let (Some(decode), prefill) = (
            app.endpoint(decision.decode),
            decision.prefill.map(|w| app.endpoint(w)),
        ) else {
            report_outcome(
                &app.service,
                decision.id,
                p.request.request_id,
                Outcome::WorkerFailed,
                0,
            );
            return Ok(vec![immediate_error(
                503,
                "unavailable",
                &format!("worker {} has no HTTP address", decision.decode.0),
            )]);
        };
        let picked = format!("{}", Endpoint(&decode.url));
        let mut body = p.request.body.clone();
        if decision.mode == ExecutionMode::DirectToD {
            add_continuation_params(p.request.api, &mut body, p.request.session_key.as_deref());
        }
        let vllm = app.workers.is_vllm(decision.decode);
        let mut filter = None;
        // Only the OpenAI APIs need asking for a stream's usage (see `crate::http`'s vLLM
        // dialect).
        if vllm && p.stream && matches!(p.request.api, Api::Completions | Api::ChatCompletions) {
            if !client_wants_usage(&body) {
                filter = Some(UsageFilter::default());
            }
            ask_for_usage(&mut body);
        }
        let bytes = p.request.payload(&body);
        let mut set = vec![
            wire::set_header(DESTINATION_HEADER, &picked),
            wire::set_header("content-length", &bytes.len().to_string()),
        ];
        let mut remove = Vec::new();
        match prefill.flatten() {
            Some(p_endpoint) => set.push(wire::set_header(
                PREFILLER_HEADER,
                &format!("{}", Endpoint(&p_endpoint.url)),
            )),
            // A client's own header would send the decode side to a host of its choosing.
            None => remove.push(PREFILLER_HEADER.to_owned()),
        }
        if let (Some(key), Some(name)) = (&p.request.session_key, &app.session_header) {
            set.push(wire::set_header(name.as_str(), key));
        }
        app.breakers
            .on_dispatch(&app.service, decision.decode, app.service.now_ms());
        if let Some(w) = decision.prefill {
            app.breakers
                .on_dispatch(&app.service, w, app.service.now_ms());
        }
        let dynamic = wire::metadata(LB_NAMESPACE, DESTINATION_HEADER, &picked);
        let mut out = vec![wire::request_headers_response(set, remove, Some(dynamic))];
        out.extend(wire::body_chunks(true, &bytes));
        self.pending = Some(Pending {
            expected_cached: (vllm && decision.mode == ExecutionMode::DirectToD)
                .then_some(decision.cached_tokens),
            decision,
            request_id: p.request.request_id,
            input_length: p.request.input_length,
            picked,
            filter,
            session_key: p.request.session_key,
            status: None,
            admission_refused: false,
            scan: CompletionScan::default(),
            whole: Vec::new(),
            event_stream: false,
            served_elsewhere: false,
        });
        Ok(out)
    }

    /// The workers outside the subset hint (none without a hint); why none can be picked when
    /// no configured worker is in it.
    fn outside_subset(&self, subset: &[String]) -> Result<Vec<WorkerId>, &'static str> {
        if subset.is_empty() {
            return Ok(Vec::new());
        }
        let allowed: HashSet<&str> = subset.iter().map(String::as_str).collect();
        let (inside, outside): (Vec<_>, Vec<_>) = self
            .app
            .workers
            .iter()
            .map(|(id, w)| {
                (
                    id,
                    allowed.contains(format!("{}", Endpoint(&w.url)).as_str()),
                )
            })
            .partition(|(_, inside)| *inside);
        if inside.is_empty() {
            return Err("no configured worker is in the request's endpoint subset");
        }
        let mut outside: Vec<WorkerId> = outside.into_iter().map(|(id, _)| id).collect();
        // Workers without an HTTP address are not endpoints at all.
        for v in self.app.service.worker_views() {
            if self.app.workers.get(v.id).is_none() && !outside.contains(&v.id) {
                outside.push(v.id);
            }
        }
        Ok(outside)
    }

    /// A request routed without a decision goes to a routable worker in turn (a decode or
    /// colocated one when there is one), within the subset hint; 503 when none is.
    fn pick_any(&self, subset: &[String]) -> ProcessingResponse {
        let app = &self.app;
        let mut views = app.service.worker_views();
        views.sort_by_key(|v| v.id);
        let mut candidates: Vec<(WorkerRole, String)> = views
            .iter()
            .filter(|v| v.is_routable())
            .filter_map(|v| {
                app.endpoint(v.id)
                    .map(|w| (v.role, format!("{}", Endpoint(&w.url))))
            })
            .filter(|(_, e)| subset.is_empty() || subset.iter().any(|s| s == e))
            .collect();
        if candidates.iter().any(|(r, _)| *r != WorkerRole::Prefill) {
            candidates.retain(|(r, _)| *r != WorkerRole::Prefill);
        }
        if candidates.is_empty() {
            let why = readiness_of(app)
                .missing
                .unwrap_or_else(|| "no routable worker in the request's subset".to_owned());
            return immediate_error(503, "unavailable", &why);
        }
        let i = self.next_any.fetch_add(1, Ordering::Relaxed) % candidates.len();
        let picked = &candidates[i].1;
        let set = vec![wire::set_header(DESTINATION_HEADER, picked)];
        wire::request_headers_response(
            set,
            vec![PREFILLER_HEADER.to_owned()],
            Some(wire::metadata(LB_NAMESPACE, DESTINATION_HEADER, picked)),
        )
    }

    fn response_headers(
        &mut self,
        h: &HttpHeaders,
        meta: Option<&Metadata>,
    ) -> Vec<ProcessingResponse> {
        let (headers, _, _, status) = wire::read_headers(h.headers.as_ref());
        let Some(p) = self.pending.as_mut() else {
            return vec![wire::response_headers_response(Vec::new(), Vec::new())];
        };
        p.status = status;
        p.admission_refused = headers
            .get(ADMISSION_HEADER)
            .is_some_and(|v| v.as_bytes() == b"rejected");
        p.event_stream = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let served = wire::metadata_strings(meta, LB_NAMESPACE, SERVED_KEY);
        p.served_elsewhere = !served.is_empty() && !served.contains(&p.picked);
        let d = &p.decision;
        let mut set = vec![
            wire::set_header("x-kvc-mode", d.mode.as_str()),
            wire::set_header("x-kvc-decode-worker", &d.decode.0.to_string()),
        ];
        if let Some(w) = d.prefill {
            set.push(wire::set_header("x-kvc-prefill-worker", &w.0.to_string()));
        }
        if let Some(r) = d.reason {
            set.push(wire::set_header("x-kvc-reason", r.as_str()));
        }
        if let Some(k) = &p.session_key {
            set.push(wire::set_header(crate::http::SESSION_RESPONSE_HEADER, k));
        }
        // The body changes length once the usage chunk is removed.
        let remove = if p.filter.is_some() {
            vec!["content-length".to_owned()]
        } else {
            Vec::new()
        };
        let out = vec![wire::response_headers_response(set, remove)];
        if h.end_of_stream {
            self.finish();
        }
        out
    }

    fn response_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        let Some(p) = self.pending.as_mut() else {
            return vec![wire::body_chunk(false, b.body, b.end_of_stream)];
        };
        if p.event_stream {
            p.scan.feed(&b.body);
        } else if p.whole.len() + b.body.len() <= MAX_RESPONSE_BYTES {
            p.whole.extend_from_slice(&b.body);
        }
        let mut out = match (&mut p.filter, p.event_stream) {
            (Some(f), true) => f.feed(&b.body).to_vec(),
            _ => b.body,
        };
        if b.end_of_stream {
            if let (Some(f), true) = (&mut p.filter, p.event_stream) {
                out.extend_from_slice(&f.finish());
            }
            self.finish();
        }
        vec![wire::body_chunk(false, out, b.end_of_stream)]
    }

    /// Reports the pending decision's outcome from its answer.
    fn finish(&mut self) {
        let Some(p) = self.pending.take() else {
            return;
        };
        let app = &self.app;
        let decode = p.decision.decode;
        let status = p.status.unwrap_or(0);
        let (outcome, resident) = if p.served_elsewhere {
            (Outcome::WorkerFailed, 0)
        } else if (200..300).contains(&status) {
            let (completion, cached) = if p.event_stream {
                let end = p.scan.finish();
                (end.completion, end.cached)
            } else {
                (completion_tokens(&p.whole), cached_tokens(&p.whole))
            };
            if completion.is_some() && app.workers.is_vllm(decode) {
                app.service.note_cache_accounting(decode, cached.is_some());
            }
            let resident = p.input_length + completion.unwrap_or(0);
            judge_cache(p.expected_cached, cached, resident)
        } else if status == 503 && p.admission_refused {
            (Outcome::Rejected, 0)
        } else if let Some(refused) = refusal_outcome(status, &p.whole) {
            (refused, 0)
        } else {
            (Outcome::WorkerFailed, 0)
        };
        let failed = p.served_elsewhere || status >= 500 && !p.admission_refused || status == 0;
        app.feed_breaker(decode, failed);
        report_outcome(&app.service, p.decision.id, p.request_id, outcome, resident);
    }

    /// The stream ended: a decision still waiting for its answer is reported `worker-failed`
    /// (the request was cut off; nothing is claimed resident).
    pub(crate) fn abandon(&mut self) {
        if let Some(p) = self.pending.take() {
            report_outcome(
                &self.app.service,
                p.decision.id,
                p.request_id,
                Outcome::WorkerFailed,
                0,
            );
        }
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        self.abandon();
    }
}

/// `ip:port` of a worker URL (IPv6 in brackets), what Envoy's original-destination load
/// balancing and llm-d's headers carry.
pub(crate) struct Endpoint<'a>(pub(crate) &'a crate::config::WorkerUrl);

impl std::fmt::Display for Endpoint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.host.contains(':') {
            write!(f, "[{}]:{}", self.0.host, self.0.port)
        } else {
            write!(f, "{}:{}", self.0.host, self.0.port)
        }
    }
}

fn is_immediate(
    r: &envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response,
) -> bool {
    matches!(
        r,
        envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response::ImmediateResponse(_)
    )
}

/// `{"error": {...}}` as an immediate answer.
fn immediate_error(status: u16, kind: &str, message: &str) -> ProcessingResponse {
    let body = serde_json::json!({ "error": { "message": message, "type": kind, "code": status } });
    wire::immediate(status, body.to_string().into_bytes(), &[])
}

/// A routing refusal as an immediate answer: the HTTP front's status and body (400 for a bad
/// request, 503 when no worker can take it), except that a shed request (the service's
/// resources exhausted) is 429 with the reason in [`DROPPED_REASON_HEADER`].
async fn route_refusal(e: &RequestError) -> ProcessingResponse {
    if let RequestError::ResourceExhausted(m) = e {
        let body = serde_json::json!({ "error": { "message": m, "type": "overloaded",
            "code": 429 } });
        return wire::immediate(
            429,
            body.to_string().into_bytes(),
            &[(DROPPED_REASON_HEADER, "resource-exhausted")],
        );
    }
    immediate_from(route_error_response(e)).await
}

/// One of the front's own error answers (a 4xx for a request it cannot route) as an
/// immediate answer, its status and JSON body as they are.
async fn immediate_from(response: axum::response::Response) -> ProcessingResponse {
    let status = response.status().as_u16();
    let body = axum::body::to_bytes(response.into_body(), MAX_RESPONSE_BYTES)
        .await
        .map(|b| b.to_vec())
        .unwrap_or_default();
    wire::immediate(status, body, &[])
}
