//! OpenTelemetry traces of the router: off unless the configuration has a `[tracing]` table
//! ([`crate::config::TracingConfig`]), and then one span per routed request and one per call
//! to a worker, the sampled ones exported over OTLP/gRPC.
//!
//! - **Request span** (`kvc.request` for the HTTP front, kind server; `kvc.v1.Router/Route`
//!   for gRPC `Route`): the child of the client's W3C `traceparent` when it sent a valid one
//!   with the sampled flag set, else the root of a new trace, made for `sample-ratio` of the
//!   requests without a valid `traceparent`. A request whose client's trace is not sampled,
//!   or outside the ratio, gets no span at all (parent-based sampling, decided before any
//!   span is made) and its workers get the client's trace context as it came. When it ends (the client's answer is complete, a stream
//!   included) it carries `url.path`, the session (`kvc.session.key`, `kvc.session.id`,
//!   `kvc.turn`), the last decision (`kvc.decision.id`, `kvc.mode`, `kvc.reason`,
//!   `kvc.decode_worker`, `kvc.prefill_worker`: worker names; `kvc.cached_tokens`,
//!   `kvc.need_tokens`, `kvc.overlap_blocks` when the policy scored the chosen decode
//!   worker's overlap, `kvc.predicted_prefill_us`, `kvc.probe_rejected_by`), how many
//!   decisions the request took (`kvc.attempts`), the reported `kvc.outcome` and
//!   `http.response.status_code` (gRPC: `rpc.grpc.status_code`); a failure sets the span's
//!   status to error.
//! - **Worker-call span** (`kvc.worker_call`, kind client, a child of the request span): one
//!   per request sent to a worker — P's and D's of a P→D path, the one worker's otherwise —
//!   with `url.path`, `kvc.worker` (its name), `kvc.worker.id`, `kvc.leg` (`prefill` or
//!   `decode`), `kvc.attempt` (from 1: which decision it carries out),
//!   `http.response.status_code`, and `error.type` when the call failed (`unreachable`,
//!   `broken`, `timeout`, `bad-response`, `status` for a 5xx answer, `stream-broken` for a
//!   streamed answer that broke after its head, `abandoned` for a call the router dropped).
//!   The worker gets this span's context as its `traceparent` (the client's `tracestate`
//!   kept), so an engine that traces nests its spans under the router's.
//!
//! With tracing off nothing here runs beyond a `None` check, and for a request not sampled
//! beyond a read of its `traceparent`: no span, no id, no attribute formatted; the client's
//! `traceparent` goes to the workers unchanged
//! (`crate::http`'s forwarding). `cargo xtask bench` measures the decision path with
//! tracing off, on and not sampled, and on and sampled (`router.decision.trace_*`).

use crate::RouterDecision;
use crate::config::{RouterConfig, TracingConfig};
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use kvc_core::{ExecutionMode, FallThroughReason, Outcome, SessionId, StableName, WorkerId};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue, StringValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, SpanExporter,
};
use parking_lot::Mutex;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// The W3C trace-context headers.
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

pub use crate::error::TelemetryError;

/// The router's tracing: off ([`Telemetry::off`], the default), or a tracer whose finished
/// spans go to an exporter. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct Telemetry {
    inner: Option<Arc<Tracing>>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("on", &self.is_on())
            .finish()
    }
}

struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    /// Which of the traces the router starts are sampled ([`TracingConfig::sample_ratio`]).
    roots: RootSampler,
    /// Each configured worker's display name.
    names: HashMap<WorkerId, StringValue>,
}

impl Telemetry {
    /// No tracing: every span is [`RequestSpan::none`].
    pub fn off() -> Telemetry {
        Telemetry { inner: None }
    }

    /// The tracing `config` asks for: off without a `[tracing]` table, else OTLP/gRPC
    /// export to its `otlp-endpoint`. Must be called within a Tokio runtime (the exporter's
    /// connection runs on it); nothing is sent until the first sampled span ends, and an
    /// unreachable collector is logged by the exporter, never fatal.
    pub fn from_config(config: &RouterConfig) -> Result<Telemetry, TelemetryError> {
        let Some(t) = &config.tracing else {
            return Ok(Telemetry::off());
        };
        use opentelemetry_otlp::WithExportConfig as _;
        let endpoint = t.otlp_endpoint.trim().to_owned();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .with_timeout(Duration::from_millis(t.export_timeout_ms))
            .build()
            .map_err(|e| TelemetryError {
                endpoint,
                message: e.to_string(),
            })?;
        Ok(Telemetry::with_exporter(exporter, t, config))
    }

    /// Tracing as `tracing` says (sampling, service name, batching), its finished spans
    /// handed to `exporter`; worker names from `config`. [`Telemetry::from_config`] gives it
    /// the OTLP exporter; benchmarks and tests may give it another.
    pub fn with_exporter<E: SpanExporter + 'static>(
        exporter: E,
        tracing: &TracingConfig,
        config: &RouterConfig,
    ) -> Telemetry {
        let queue = tracing.max_queued_spans.max(1);
        let batch = BatchConfigBuilder::default()
            .with_scheduled_delay(Duration::from_millis(tracing.export_interval_ms))
            .with_max_queue_size(queue)
            .with_max_export_batch_size(queue.min(512))
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build();
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(tracing.service_name.clone())
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            // Only sampled requests reach the SDK (see `Telemetry::request_span`): a sampled
            // client's trace, or a root the router chose to sample.
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("kvc-router");
        let names = config
            .workers
            .iter()
            .map(|w| (WorkerId(w.id), StringValue::from(w.display_name())))
            .collect();
        Telemetry {
            inner: Some(Arc::new(Tracing {
                provider,
                tracer,
                roots: RootSampler::new(tracing.sample_ratio),
                names,
            })),
        }
    }

    /// Whether tracing is on.
    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// The span of one client request, named `name`, for `path`, the child of the trace
    /// context in `parent` (its `traceparent`, and `tracestate`) when there is a valid one.
    ///
    /// [`RequestSpan::none`] when tracing is off, and when the request is not sampled: a
    /// client's `traceparent` with the sampled flag clear (parent-based sampling), or, without
    /// a valid one, a request outside `sample-ratio`. Such a request costs a header read and
    /// no more, and its workers get the client's trace context as it came, as with tracing
    /// off.
    pub fn request_span(
        &self,
        name: &'static str,
        path: &'static str,
        parent: &dyn Extractor,
    ) -> RequestSpan {
        let Some(t) = &self.inner else {
            return RequestSpan::none();
        };
        let parent = match parent.get(TRACEPARENT.as_str()).and_then(client_sampled) {
            Some(true) => TraceContextPropagator::new().extract(parent),
            Some(false) => return RequestSpan::none(),
            None if t.roots.sample() => Context::new(),
            None => return RequestSpan::none(),
        };
        let span = t
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .start_with_context(&t.tracer, &parent);
        let recording = span.is_recording();
        RequestSpan {
            inner: Some(Arc::new(RequestInner {
                cx: parent.with_span(span),
                tracing: Arc::clone(t),
                path,
                attempts: AtomicU32::new(0),
                record: recording.then(|| Mutex::new(Record::default())),
            })),
        }
    }

    /// Exports what is left and stops the exporter (blocks until it has; call it off the
    /// async workers, e.g. in `spawn_blocking`). Spans ended afterwards are dropped.
    pub fn shutdown(&self) {
        if let Some(t) = &self.inner
            && let Err(e) = t.provider.shutdown()
        {
            tracing::warn!(error = %e, "tracing: the span exporter did not shut down cleanly");
        }
    }

    /// Exports every finished span now (blocks until done).
    pub fn flush(&self) {
        if let Some(t) = &self.inner
            && let Err(e) = t.provider.force_flush()
        {
            tracing::warn!(error = %e, "tracing: spans not flushed");
        }
    }
}

/// Whether a client's `traceparent` asks for its trace to be sampled; `None` when it is not a
/// valid W3C trace context (version 00: `00-<32 hex>-<16 hex>-<2 hex>`, lower-case, ids not
/// all zero; a later version with at least those fields), which the router ignores.
fn client_sampled(traceparent: &str) -> Option<bool> {
    let mut parts = traceparent.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let valid = hex(version, 2)
        && version != "ff"
        && (version != "00" || parts.next().is_none())
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(span, 16)
        && span.bytes().any(|b| b != b'0')
        && hex(flags, 2);
    if !valid {
        return None;
    }
    let flags = u8::from_str_radix(flags, 16).ok()?;
    Some(flags & 1 == 1)
}

/// The choice of which traces the router starts are sampled: each with probability `ratio`.
struct RootSampler {
    /// `ratio` of `u64::MAX`.
    threshold: u64,
    all: bool,
    random: std::collections::hash_map::RandomState,
    counter: AtomicU64,
}

impl RootSampler {
    fn new(ratio: f64) -> RootSampler {
        RootSampler {
            threshold: (ratio.clamp(0.0, 1.0) * u64::MAX as f64) as u64,
            all: ratio >= 1.0,
            random: std::collections::hash_map::RandomState::new(),
            counter: AtomicU64::new(0),
        }
    }

    fn sample(&self) -> bool {
        use std::hash::{BuildHasher as _, Hasher as _};
        if self.all {
            return true;
        }
        if self.threshold == 0 {
            return false;
        }
        let mut h = self.random.build_hasher();
        h.write_u64(self.counter.fetch_add(1, Ordering::Relaxed));
        h.finish() < self.threshold
    }
}

/// The trace context of a request's headers, for [`Telemetry::request_span`].
pub struct HeaderExtractor<'a>(pub &'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// What a request span reports when it ends (only a sampled span keeps one).
#[derive(Default)]
struct Record {
    session_key: Option<Arc<str>>,
    session: Option<(SessionId, u32)>,
    decision: Option<DecisionRecord>,
    outcome: Option<Outcome>,
    status: Option<u16>,
    grpc_code: Option<i64>,
    error: Option<String>,
}

#[derive(Clone, Copy)]
struct DecisionRecord {
    id: u64,
    mode: ExecutionMode,
    reason: Option<FallThroughReason>,
    prefill: Option<WorkerId>,
    decode: WorkerId,
    cached_tokens: u64,
    need_tokens: u64,
    overlap: Option<u64>,
    predicted_prefill_us: u64,
    probe_rejected_by: Option<WorkerId>,
}

struct RequestInner {
    /// The client's context with the request span in it.
    cx: Context,
    tracing: Arc<Tracing>,
    path: &'static str,
    /// Decisions made for the request so far.
    attempts: AtomicU32,
    /// `None` for a span that is not sampled: nothing is kept or written.
    record: Option<Mutex<Record>>,
}

/// One request's span (or none): cheap to clone; the span ends, its attributes written,
/// when the last clone is dropped (for a relayed stream, when the stream has ended).
#[derive(Clone, Default)]
pub struct RequestSpan {
    inner: Option<Arc<RequestInner>>,
}

impl RequestSpan {
    /// No span (tracing off).
    pub fn none() -> RequestSpan {
        RequestSpan { inner: None }
    }

    /// Whether the span is sampled (its attributes will be exported).
    pub fn is_recording(&self) -> bool {
        self.inner.as_ref().is_some_and(|i| i.record.is_some())
    }

    fn with_record(&self, f: impl FnOnce(&mut Record)) {
        if let Some(record) = self.inner.as_ref().and_then(|i| i.record.as_ref()) {
            f(&mut record.lock());
        }
    }

    /// The request's session: the client's key (when it has one) and the session and turn
    /// it resolved to.
    pub fn record_session(&self, key: Option<&Arc<str>>, session: Option<(SessionId, u32)>) {
        self.with_record(|r| {
            r.session_key = key.cloned();
            r.session = session;
        });
    }

    /// A decision made for the request (a retry's replaces the previous one's; each counts
    /// as an attempt).
    pub fn record_decision(&self, d: &RouterDecision) {
        let Some(inner) = &self.inner else {
            return;
        };
        inner.attempts.fetch_add(1, Ordering::Relaxed);
        self.with_record(|r| {
            r.decision = Some(DecisionRecord {
                id: d.decision_id,
                mode: d.mode,
                reason: d.fall_through_reason,
                prefill: d.prefill_worker,
                decode: d.decode_worker,
                cached_tokens: d.cached_tokens,
                need_tokens: d.need_tokens,
                overlap: d.decode_overlap,
                predicted_prefill_us: d.predicted_prefill_us,
                probe_rejected_by: d.probe_rejected_by,
            });
        });
    }

    /// The outcome reported for the request's decision.
    pub fn record_outcome(&self, outcome: Outcome) {
        self.with_record(|r| r.outcome = Some(outcome));
    }

    /// The HTTP status the client was answered with.
    pub fn record_status(&self, status: u16) {
        self.with_record(|r| r.status = Some(status));
    }

    /// The gRPC status code the caller was answered with (0: OK).
    pub fn record_grpc_code(&self, code: i32) {
        self.with_record(|r| r.grpc_code = Some(i64::from(code)));
    }

    /// Why the request failed (sets the span's status to error).
    pub fn record_error(&self, message: &str) {
        self.with_record(|r| r.error = Some(message.to_owned()));
    }

    /// A span for one call to `worker` on `path` as the `leg` of the current attempt, the
    /// child of this request's span. [`WorkerCall::none`] when tracing is off.
    pub(crate) fn worker_call(&self, worker: WorkerId, leg: Leg, path: &'static str) -> WorkerCall {
        let Some(inner) = &self.inner else {
            return WorkerCall::none();
        };
        let t = &inner.tracing;
        let mut span = t
            .tracer
            .span_builder("kvc.worker_call")
            .with_kind(SpanKind::Client)
            .start_with_context(&t.tracer, &inner.cx);
        if span.is_recording() {
            let mut attributes = vec![
                KeyValue::new("url.path", path),
                KeyValue::new("kvc.worker.id", i64::from(worker.0)),
                KeyValue::new("kvc.leg", leg.as_str()),
                KeyValue::new(
                    "kvc.attempt",
                    i64::from(inner.attempts.load(Ordering::Relaxed).max(1)),
                ),
            ];
            if let Some(name) = t.names.get(&worker) {
                attributes.push(KeyValue::new("kvc.worker", name.clone()));
            }
            span.set_attributes(attributes);
        }
        let mut traceparent = Vec::with_capacity(2);
        let cx = Context::new().with_remote_span_context(span.span_context().clone());
        TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(&mut traceparent));
        WorkerCall {
            inner: Some(CallInner {
                span,
                traceparent,
                answered: false,
            }),
        }
    }
}

impl Drop for RequestInner {
    fn drop(&mut self) {
        let span = self.cx.span();
        if let Some(record) = self.record.take() {
            let r = record.into_inner();
            let mut a = Vec::with_capacity(20);
            a.push(KeyValue::new("url.path", self.path));
            a.push(KeyValue::new(
                "kvc.attempts",
                i64::from(self.attempts.load(Ordering::Relaxed)),
            ));
            if let Some(key) = r.session_key {
                a.push(KeyValue::new("kvc.session.key", StringValue::from(key)));
            }
            if let Some((s, turn)) = r.session {
                // The router's 64-bit id of the session, in decimal (past an `i64`).
                a.push(KeyValue::new("kvc.session.id", s.0.to_string()));
                a.push(KeyValue::new("kvc.turn", i64::from(turn)));
            }
            if let Some(d) = r.decision {
                let name = |w: WorkerId| {
                    self.tracing
                        .names
                        .get(&w)
                        .cloned()
                        .unwrap_or_else(|| StringValue::from(format!("w{}", w.0)))
                };
                a.push(KeyValue::new("kvc.decision.id", d.id as i64));
                a.push(KeyValue::new("kvc.mode", d.mode.as_str()));
                if let Some(reason) = d.reason {
                    a.push(KeyValue::new("kvc.reason", reason.as_str()));
                }
                a.push(KeyValue::new("kvc.decode_worker", name(d.decode)));
                if let Some(p) = d.prefill {
                    a.push(KeyValue::new("kvc.prefill_worker", name(p)));
                }
                a.push(KeyValue::new("kvc.cached_tokens", d.cached_tokens as i64));
                a.push(KeyValue::new("kvc.need_tokens", d.need_tokens as i64));
                if let Some(o) = d.overlap {
                    a.push(KeyValue::new("kvc.overlap_blocks", o as i64));
                }
                a.push(KeyValue::new(
                    "kvc.predicted_prefill_us",
                    d.predicted_prefill_us as i64,
                ));
                if let Some(w) = d.probe_rejected_by {
                    a.push(KeyValue::new("kvc.probe_rejected_by", name(w)));
                }
            }
            let mut failed = r.error.clone();
            if let Some(o) = r.outcome {
                a.push(KeyValue::new("kvc.outcome", o.as_str()));
                if o.is_mechanism_error() && failed.is_none() {
                    failed = Some(format!("outcome {}", o.as_str()));
                }
            }
            if let Some(s) = r.status {
                a.push(KeyValue::new("http.response.status_code", i64::from(s)));
                if s >= 500 && failed.is_none() {
                    failed = Some(format!("status {s}"));
                }
            }
            if let Some(c) = r.grpc_code {
                a.push(KeyValue::new("rpc.grpc.status_code", c));
            }
            span.set_attributes(a);
            if let Some(message) = failed {
                span.set_status(Status::error(message));
            }
        }
        span.end();
    }
}

/// Which part of a decision a worker call carries out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leg {
    /// P's call on a P→D path.
    Prefill,
    /// D's call (or the one worker's).
    Decode,
}

impl Leg {
    fn as_str(self) -> &'static str {
        match self {
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
        }
    }
}

struct CallInner {
    span: opentelemetry_sdk::trace::Span,
    /// This span's `traceparent` (and `tracestate`), for the worker.
    traceparent: Vec<(HeaderName, HeaderValue)>,
    answered: bool,
}

/// One call to a worker's span (or none): ends when dropped.
#[derive(Default)]
pub(crate) struct WorkerCall {
    inner: Option<CallInner>,
}

impl WorkerCall {
    /// No span (tracing off).
    pub(crate) fn none() -> WorkerCall {
        WorkerCall { inner: None }
    }

    /// The headers for the worker: `base` as it is when tracing is off; with this span's
    /// `traceparent` (and `tracestate`) in place of any in `base` when it is on.
    pub(crate) fn headers<'a>(
        &self,
        base: &'a [(HeaderName, HeaderValue)],
    ) -> Cow<'a, [(HeaderName, HeaderValue)]> {
        match &self.inner {
            None => Cow::Borrowed(base),
            Some(c) => {
                let mut out: Vec<(HeaderName, HeaderValue)> = base
                    .iter()
                    .filter(|(n, _)| *n != TRACEPARENT && *n != TRACESTATE)
                    .cloned()
                    .collect();
                out.extend(c.traceparent.iter().cloned());
                Cow::Owned(out)
            }
        }
    }

    /// `headers` with this span's `traceparent` (and `tracestate`) in place of any there;
    /// unchanged when tracing is off.
    pub(crate) fn apply(&self, headers: &mut Vec<(HeaderName, HeaderValue)>) {
        if let Some(c) = &self.inner {
            headers.retain(|(n, _)| *n != TRACEPARENT && *n != TRACESTATE);
            headers.extend(c.traceparent.iter().cloned());
        }
    }

    /// The worker's answer: its status, or why there is none.
    pub(crate) fn record_answer(&mut self, answer: Result<u16, &crate::worker_http::ForwardError>) {
        use crate::worker_http::ForwardError;
        let Some(c) = &mut self.inner else {
            return;
        };
        c.answered = true;
        if !c.span.is_recording() {
            return;
        }
        match answer {
            Ok(status) => {
                c.span.set_attribute(KeyValue::new(
                    "http.response.status_code",
                    i64::from(status),
                ));
                if status >= 500 {
                    c.span
                        .set_attribute(KeyValue::new("error.type", status.to_string()));
                    c.span.set_status(Status::error(format!("status {status}")));
                }
            }
            Err(e) => {
                let kind = match e {
                    ForwardError::Unreachable(_) => "unreachable",
                    ForwardError::Broken(_) => "broken",
                    ForwardError::Timeout(_) => "timeout",
                    ForwardError::BadResponse(_) => "bad-response",
                };
                c.span.set_attribute(KeyValue::new("error.type", kind));
                c.span.set_status(Status::error(e.to_string()));
            }
        }
    }

    /// A failure after the answer's head (`kind`: `stream-broken`), with its message.
    pub(crate) fn record_failure(&mut self, kind: &'static str, message: &str) {
        if let Some(c) = &mut self.inner
            && c.span.is_recording()
        {
            c.span.set_attribute(KeyValue::new("error.type", kind));
            c.span.set_status(Status::error(message.to_owned()));
        }
    }
}

impl Drop for WorkerCall {
    fn drop(&mut self) {
        if let Some(c) = &mut self.inner {
            if !c.answered && c.span.is_recording() {
                c.span
                    .set_attribute(KeyValue::new("error.type", "abandoned"));
            }
            c.span.end();
        }
    }
}

struct HeaderInjector<'a>(&'a mut Vec<(HeaderName, HeaderValue)>);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.push((name, value));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clients_sampled_flag_is_read_from_a_valid_traceparent_only() {
        let tp =
            |flags: &str| format!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}");
        assert_eq!(client_sampled(&tp("01")), Some(true));
        assert_eq!(client_sampled(&tp("03")), Some(true));
        assert_eq!(client_sampled(&tp("00")), Some(false));
        assert_eq!(client_sampled(&tp("02")), Some(false));
        // A later version may carry more fields.
        assert_eq!(
            client_sampled("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz"),
            Some(true)
        );
        for bad in [
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "",
        ] {
            assert_eq!(client_sampled(bad), None, "{bad}");
        }
    }

    #[test]
    fn roots_are_sampled_at_the_ratio() {
        assert!((0..1_000).all(|_| RootSampler::new(1.0).sample()));
        let none = RootSampler::new(0.0);
        assert!((0..1_000).all(|_| !none.sample()));
        let quarter = RootSampler::new(0.25);
        let n = (0..10_000).filter(|_| quarter.sample()).count();
        // 25% of 10,000 draws: a standard deviation of 43.
        assert!((2_000..3_000).contains(&n), "{n}");
    }
}
