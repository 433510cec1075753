//! The client side of an HTTP replay: sends each trace request to an HTTP router as an SGLang
//! `/generate` call (or, for vLLM workers, a `/v1/completions` call), paced like `sim` (a session's turns in order, turn k+1 ready at the later
//! of its scaled timestamp and turn k's end, at most `concurrency` in flight, first come first
//! served), and times the answer.

use crate::trace::Trace;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvc_core::EngineKind;
use kvc_core::sse::{SseEvent, SseScanner};
use kvc_engine_sim::http::{SharedState, connector};
use kvc_engine_sim::prompt::{PromptWords, prompt_key, prompt_text};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How the driver talks to the router.
#[derive(Debug, Clone)]
pub struct DriveOptions {
    /// Base URL of the router (`http://127.0.0.1:8000`).
    pub router_url: String,
    /// Header carrying the session key (`s<session id>`); `None` sends no session, leaving the
    /// router to infer it.
    pub session_header: Option<String>,
    /// Ask for streamed answers (TTFT is then measured at the client).
    pub stream: bool,
    /// Most time one request may take, wall clock.
    pub request_timeout: Duration,
    /// Trace time is divided by this.
    pub time_scale: f64,
    /// Most requests in flight.
    pub concurrency: usize,
    /// The workers' API: SGLang's `/generate`, or (`vllm`) OpenAI's `/v1/completions` with
    /// `stream_options.include_usage` on streams.
    pub engine: EngineKind,
    /// The model named in each request.
    pub model: String,
    /// The words prompts are written in: made-up words ([`prompt_text`]), or a real
    /// tokenizer's one-token words ([`PromptWords`]).
    pub words: Option<Arc<PromptWords>>,
}

impl DriveOptions {
    /// The prompt text of trace request `r`.
    pub(crate) fn prompt(&self, trace: &Trace, r: &crate::trace::TraceRequest) -> String {
        match &self.words {
            Some(w) => w.text(&r.hash_ids, r.input_length, trace.block_size()),
            None => prompt_text(&r.hash_ids, r.input_length, trace.block_size()),
        }
    }
}

/// What the client saw of one request.
#[derive(Debug, Clone)]
pub(crate) struct ClientSide {
    pub(crate) ready: Instant,
    pub(crate) dispatch: Instant,
    pub(crate) sent: Instant,
    pub(crate) first: Option<Instant>,
    pub(crate) done: Instant,
    pub(crate) status: u16,
    /// The router's `x-kvc-mode` header, when it sends one.
    pub(crate) mode: Option<String>,
    /// The router's `x-kvc-reason` header (why a later turn was not direct), when it sends one.
    pub(crate) reason: Option<String>,
    /// The router's `x-kvc-prefill-failed` header was there: the decode worker served a P→D
    /// request alone after its prefill worker failed.
    pub(crate) prefill_failed: bool,
    /// The router's `x-kvc-prefill-worker` and `x-kvc-decode-worker` headers, when it sends them.
    pub(crate) prefill_worker: Option<String>,
    pub(crate) decode_worker: Option<String>,
    /// The answer completed (2xx, and a stream that ended with `[DONE]` and no error event).
    pub(crate) complete: bool,
    /// The answer says the input is over the model's limit.
    pub(crate) input_too_long: bool,
    /// Why the request failed, when it did.
    pub(crate) error: Option<String>,
    /// The prompt tokens the answer's usage counted, when it says.
    pub(crate) prompt_tokens: Option<u64>,
    /// The prompt tokens the answer's usage says the engine found cached
    /// (`usage.prompt_tokens_details.cached_tokens`, or SGLang's `meta_info.cached_tokens`).
    pub(crate) cached_tokens: Option<u64>,
}

type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

/// Sends every request of the trace; returns what the client saw, by trace index. `shared`:
/// the simulated workers the requests go to (each prompt is registered there, for the worker
/// to find its trace request by), or `None` for real engines.
pub(crate) async fn drive(
    trace: Arc<Trace>,
    shared: Option<Arc<SharedState>>,
    opts: DriveOptions,
    start: Instant,
    speedup: f64,
    completed: Arc<AtomicUsize>,
) -> Vec<Option<ClientSide>> {
    let client: Client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector());
    let slots = Arc::new(tokio::sync::Semaphore::new(opts.concurrency.max(1)));
    let opts = Arc::new(opts);
    let mut tasks = tokio::task::JoinSet::new();
    for session in trace.session_list() {
        let turns = session.requests.clone();
        let (trace, shared, client, slots, opts, completed) = (
            trace.clone(),
            shared.clone(),
            client.clone(),
            slots.clone(),
            opts.clone(),
            completed.clone(),
        );
        tasks.spawn(async move {
            let mut out = Vec::with_capacity(turns.len());
            let mut previous_done = start;
            for i in turns {
                let r = &trace.requests[i];
                let at = start
                    + Duration::from_secs_f64(
                        r.timestamp_ms as f64 / 1e3 / opts.time_scale / speedup,
                    );
                let ready = at.max(previous_done);
                tokio::time::sleep_until(ready.into()).await;
                let permit = slots.clone().acquire_owned().await;
                let dispatch = Instant::now();
                let side = send(&trace, &shared, &client, &opts, i, ready, dispatch).await;
                drop(permit);
                previous_done = side.done;
                completed.fetch_add(1, Ordering::Relaxed);
                out.push((i, side));
            }
            out
        });
    }
    let mut all = vec![None; trace.len()];
    while let Some(done) = tasks.join_next().await {
        if let Ok(sides) = done {
            for (i, side) in sides {
                all[i] = Some(side);
            }
        }
    }
    all
}

/// The body of trace request `i`: SGLang's `/generate`, or vLLM's `/v1/completions`.
fn body_of(
    trace: &Trace,
    model: &str,
    i: usize,
    text: &str,
    stream: bool,
    engine: EngineKind,
) -> Vec<u8> {
    let r = &trace.requests[i];
    if engine == EngineKind::Vllm {
        let mut body = json!({
            "model": model,
            "prompt": text,
            "max_tokens": r.output_length.max(1),
            "ignore_eos": true,
            "temperature": 0.0,
            "stream": stream,
        });
        if stream {
            body["stream_options"] = json!({ "include_usage": true });
        }
        return body.to_string().into_bytes();
    }
    json!({
        "text": text,
        "sampling_params": {
            "max_new_tokens": r.output_length.max(1),
            "ignore_eos": true,
            "temperature": 0.0,
        },
        "stream": stream,
    })
    .to_string()
    .into_bytes()
}

async fn send(
    trace: &Trace,
    shared: &Option<Arc<SharedState>>,
    client: &Client,
    opts: &DriveOptions,
    i: usize,
    ready: Instant,
    dispatch: Instant,
) -> ClientSide {
    let r = &trace.requests[i];
    let text = opts.prompt(trace, r);
    let key = prompt_key(&text);
    let body = body_of(trace, &opts.model, i, &text, opts.stream, opts.engine);
    drop(text);
    if let Some(shared) = shared {
        shared.register(key, i);
    }
    let sent = Instant::now();
    let mut side = ClientSide {
        ready,
        dispatch,
        sent,
        first: None,
        done: sent,
        status: 0,
        mode: None,
        reason: None,
        prefill_failed: false,
        prefill_worker: None,
        decode_worker: None,
        complete: false,
        input_too_long: false,
        error: None,
        prompt_tokens: None,
        cached_tokens: None,
    };
    let session_key = format!("s{}", r.session.0);
    let result = tokio::time::timeout(
        opts.request_timeout,
        exchange(client, opts, &session_key, body, &mut side),
    )
    .await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => side.error = Some(e),
        Err(_) => {
            side.error = Some(format!(
                "no complete answer within {:.0} s",
                opts.request_timeout.as_secs_f64()
            ));
        }
    }
    side.done = Instant::now();
    if let Some(shared) = shared {
        shared.unregister(key, i);
    }
    side
}

/// One request and its answer.
async fn exchange(
    client: &Client,
    opts: &DriveOptions,
    session_key: &str,
    body: Vec<u8>,
    side: &mut ClientSide,
) -> Result<(), String> {
    let path = match opts.engine {
        EngineKind::Vllm => "/v1/completions",
        EngineKind::Sglang => "/generate",
    };
    let url = format!("{}{path}", opts.router_url.trim_end_matches('/'));
    let mut req = hyper::Request::post(url.as_str()).header("content-type", "application/json");
    if let Some(h) = &opts.session_header {
        req = req.header(h.as_str(), session_key);
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("bad request to {url}: {e}"))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    side.status = resp.status().as_u16();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    side.mode = header("x-kvc-mode");
    side.reason = header("x-kvc-reason");
    side.prefill_failed = header("x-kvc-prefill-failed").is_some();
    side.prefill_worker = header("x-kvc-prefill-worker");
    side.decode_worker = header("x-kvc-decode-worker");
    let ok = resp.status().is_success();
    let mut body = resp.into_body();
    let mut events = StreamedAnswer::default();
    let mut whole = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("{url}: the answer broke off: {e}"))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        if ok && opts.stream {
            events.feed(data);
            if side.first.is_none() && events.first_token {
                side.first = Some(Instant::now());
            }
        } else {
            whole.extend_from_slice(data);
        }
    }
    if !ok {
        let text = String::from_utf8_lossy(&whole);
        side.input_too_long = text.contains("longer than the model's context length");
        return Err(format!("{url} answered {}: {}", side.status, text.trim()));
    }
    if opts.stream {
        events.finish();
        if let Some(e) = events.error {
            return Err(format!("error event: {e}"));
        }
        side.complete = events.done && events.completion.is_some();
        side.prompt_tokens = events.usage.prompt;
        side.cached_tokens = events.usage.cached;
        if !side.complete {
            return Err("the stream ended without its last event".into());
        }
    } else {
        let v: Value =
            serde_json::from_slice(&whole).map_err(|e| format!("the answer is not JSON: {e}"))?;
        side.complete = v
            .pointer("/meta_info/completion_tokens")
            .or_else(|| v.pointer("/usage/completion_tokens"))
            .is_some();
        let usage = Usage::of(&v);
        side.prompt_tokens = usage.prompt;
        side.cached_tokens = usage.cached;
        if !side.complete {
            return Err(format!("the answer has no meta_info or usage: {v}"));
        }
    }
    Ok(())
}

/// What a streamed answer said so far: its SSE events read as they arrive.
#[derive(Debug, Default)]
struct StreamedAnswer {
    events: SseScanner,
    /// An event counted at least one generated token.
    first_token: bool,
    /// The last token count an event carried.
    completion: Option<u64>,
    /// The `[DONE]` event came.
    done: bool,
    /// The last error event, as JSON text.
    error: Option<String>,
    /// The prompt counts the last event that carried them said.
    usage: Usage,
}

/// The prompt counts an answer reports.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Usage {
    prompt: Option<u64>,
    cached: Option<u64>,
}

impl Usage {
    /// Reads OpenAI's `usage` (`prompt_tokens`, `prompt_tokens_details.cached_tokens`) or
    /// SGLang's `meta_info` (`prompt_tokens`, `cached_tokens`).
    fn of(v: &Value) -> Usage {
        let at = |a: &str, b: &str| {
            v.pointer(a)
                .or_else(|| v.pointer(b))
                .and_then(Value::as_u64)
        };
        Usage {
            prompt: at("/usage/prompt_tokens", "/meta_info/prompt_tokens"),
            cached: at(
                "/usage/prompt_tokens_details/cached_tokens",
                "/meta_info/cached_tokens",
            ),
        }
    }
}

impl StreamedAnswer {
    fn feed(&mut self, bytes: &[u8]) {
        for event in self.events.feed(bytes) {
            self.take(event);
        }
    }

    fn take(&mut self, event: SseEvent) {
        let data = match event {
            SseEvent::Done => {
                self.done = true;
                return;
            }
            SseEvent::Data(data) => data,
        };
        let Ok(v) = serde_json::from_slice::<Value>(&data) else {
            return;
        };
        if let Some(e) = v.get("error") {
            self.error = Some(e.to_string());
            return;
        }
        // An OpenAI chunk with generated text (vLLM reports the count in its usage chunk).
        let text = v
            .pointer("/choices/0/text")
            .or_else(|| v.pointer("/choices/0/delta/content"))
            .and_then(Value::as_str);
        if text.is_some_and(|t| !t.is_empty()) {
            self.first_token = true;
        }
        let usage = Usage::of(&v);
        if usage.prompt.is_some() {
            self.usage = usage;
        }
        if let Some(n) = v
            .pointer("/meta_info/completion_tokens")
            .or_else(|| v.pointer("/usage/completion_tokens"))
            .and_then(Value::as_u64)
        {
            self.completion = Some(n);
            if n >= 1 {
                self.first_token = true;
            }
        }
    }

    /// The stream ended: an event it did not close still counts.
    fn finish(&mut self) {
        if let Some(event) = self.events.finish() {
            self.take(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{StreamedAnswer, Usage};

    #[test]
    fn events_split_across_chunks_are_read_whole() {
        let mut s = StreamedAnswer::default();
        s.feed(b"data: {\"text\": \"\", \"meta_info\": {\"completion_tokens\": 0}}\n\nda");
        assert!(!s.first_token);
        s.feed(b"ta: {\"meta_info\": {\"completion_tokens\": 1}}\n\n");
        assert!(s.first_token);
        s.feed(b"data: {\"meta_info\": {\"completion_tokens\": 9}}\n\ndata: [DONE]\n\n");
        s.finish();
        assert_eq!(s.completion, Some(9));
        assert!(s.done);
        assert_eq!(s.error, None);
    }

    #[test]
    fn the_usage_chunk_gives_the_prompt_and_cached_counts() {
        let mut s = StreamedAnswer::default();
        s.feed(b"data: {\"choices\": [{\"text\": \"x\"}], \"usage\": null}\n\n");
        assert_eq!(s.usage, Usage::default());
        s.feed(b"data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 900, \"completion_tokens\": 4, \"prompt_tokens_details\": {\"cached_tokens\": 864}}}\n\ndata: [DONE]\n\n");
        s.finish();
        assert_eq!(
            s.usage,
            Usage {
                prompt: Some(900),
                cached: Some(864)
            }
        );
        assert_eq!(s.completion, Some(4));
        // No details: the prompt count alone.
        let v: serde_json::Value =
            serde_json::from_str(r#"{"usage": {"prompt_tokens": 7}}"#).unwrap();
        assert_eq!(
            Usage::of(&v),
            Usage {
                prompt: Some(7),
                cached: None
            }
        );
    }

    #[test]
    fn an_error_event_is_kept() {
        let mut s = StreamedAnswer::default();
        s.feed(b"data: {\"error\": {\"message\": \"gone\"}}");
        s.finish();
        assert!(s.error.as_deref().is_some_and(|e| e.contains("gone")));
        assert!(!s.done);
    }
}
