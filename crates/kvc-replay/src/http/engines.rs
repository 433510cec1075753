//! A trace replayed against real engines: every request an OpenAI `/v1/completions` call (or
//! SGLang's `/generate`) to one URL — a router in front of engines, or an engine itself — paced
//! as [`super::live_http`] paces it, and timed at the client.
//!
//! Nothing here sees inside the engines, so a record holds what the answer says: its status,
//! TTFT and latency at the client, the prompt and cached token counts of its `usage`, and,
//! from `kvc-router`, the `x-kvc-mode`, `x-kvc-reason`, `x-kvc-prefill-worker` and
//! `x-kvc-decode-worker` headers. A router that names no mode is recorded with the mode the
//! caller states for it ([`UnlabelledMode`]).
//!
//! Prompt text: with a tokenizer ([`one_token_words`]), each position of a block is one of
//! the tokenizer's one-token words, so a prompt is as many tokens as the trace says and two
//! prompts share as many leading tokens as they share leading positions; without one, the
//! made-up words of [`super::prompt_text`] (several tokens each under a real tokenizer).

use super::driver::{self, ClientSide, DriveOptions};
use super::wait_healthy;
use crate::live::LiveError;
use crate::sim::SimOutput;
use crate::sim::metrics::{RequestRecord, RunConfig, Summary};
use crate::trace::Trace;
use kvc_core::{EngineKind, ExecutionMode, Outcome};
use kvc_engine_sim::prompt::PromptWords;
use serde::Serialize;
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The mode recorded for an answer whose router names none (`x-kvc-mode` absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnlabelledMode {
    /// Every request goes through a prefill and a decode engine: a session's first turn is
    /// `turn1-seed`, a later one `fallback`.
    PrefillDecode,
    /// Every request is served by one engine alone.
    Colocated,
    /// Not known: such requests count as not routed.
    Unknown,
}

/// How to drive the engines.
#[derive(Debug, Clone)]
pub struct EngineDriveOptions {
    /// The URL requests go to (`http://127.0.0.1:18080`).
    pub url: String,
    /// The name of the run in its summary.
    pub label: String,
    /// The model named in each request.
    pub model: String,
    /// Header carrying each request's session key (`s<session id>`); `None` sends none.
    pub session_header: Option<String>,
    /// Ask for streamed answers (TTFT is measured only on streams).
    pub stream: bool,
    /// Most wall time one request may take.
    pub request_timeout: Duration,
    /// Most wall time to wait for `GET /health` to answer 2xx before the first request.
    pub connect_timeout: Duration,
    /// Trace time is divided by this.
    pub time_scale: f64,
    /// Most requests in flight.
    pub concurrency: usize,
    /// The API: OpenAI's `/v1/completions` (`Vllm`) or SGLang's `/generate`.
    pub engine: EngineKind,
    /// One-token words of the engine's tokenizer, or `None` for made-up words.
    pub words: Option<Arc<PromptWords>>,
    /// The mode of an answer without `x-kvc-mode`.
    pub unlabelled: UnlabelledMode,
}

/// What the answers said beyond the records.
#[derive(Debug, Clone, Serialize)]
pub struct EngineDriveReport {
    /// The run's name.
    pub label: String,
    /// Where requests went.
    pub url: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests answered in full.
    pub answered: usize,
    /// Prompt tokens of the answered requests, as the trace counts them.
    pub trace_prompt_tokens: u64,
    /// Prompt tokens of the answered requests, as their answers count them (those that say).
    pub reported_prompt_tokens: u64,
    /// Cached prompt tokens the answers report.
    pub reported_cached_tokens: u64,
    /// `reported_cached_tokens / reported_prompt_tokens`.
    pub reported_cached_share: f64,
    /// Answered requests whose answer gave no prompt token count.
    pub without_usage: usize,
    /// Answered requests whose reported prompt tokens differ from the trace's input length
    /// by more than 2 (special tokens): the prompt text does not tokenize as planned.
    pub token_count_mismatches: usize,
    /// Failed requests, per kind (`status 503`, `timeout`, `transport`, `stream`, ...).
    pub errors: std::collections::BTreeMap<String, usize>,
    /// The first errors, with their request index.
    pub first_errors: Vec<String>,
}

/// The result of a drive: records and summary in `sim`'s shape (times in wall seconds from
/// the first request), and the report.
#[derive(Debug, Clone)]
pub struct EngineDriveOutput {
    /// Records and summary.
    pub run: SimOutput,
    /// What the answers said.
    pub report: EngineDriveReport,
}

/// The one-token words of the Hugging Face `tokenizer.json` at `path`: each a run of 1 to 16
/// ASCII lowercase letters that, after a space, the tokenizer encodes as exactly one token
/// (a byte-level BPE's `Ġword`, a word-level vocabulary's `word`). Fails when the file is not
/// a tokenizer, or holds fewer than [`PromptWords::MIN_WORDS`] such words.
pub fn one_token_words(path: &Path) -> Result<PromptWords, LiveError> {
    let fail = |m: String| LiveError::Invalid(format!("tokenizer {}: {m}", path.display()));
    let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| fail(e.to_string()))?;
    let mut words = BTreeSet::new();
    for (_, id) in tokenizer.get_vocab(false) {
        let Ok(text) = tokenizer.decode(&[id], false) else {
            continue;
        };
        let word = text.trim_start_matches(' ');
        if word.is_empty() || word.len() > 16 || !word.bytes().all(|b| b.is_ascii_lowercase()) {
            continue;
        }
        let Ok(encoded) = tokenizer.encode_fast(format!(" {word}").as_str(), false) else {
            continue;
        };
        if encoded.get_ids() == [id] {
            words.insert(word.to_owned());
        }
    }
    let found = words.len();
    PromptWords::new(words.into_iter().collect()).ok_or_else(|| {
        fail(format!(
            "only {found} words of lowercase letters are one token after a space; at least {} are needed",
            PromptWords::MIN_WORDS
        ))
    })
}

/// How many tokens `text` is under the tokenizer at `path` (no special tokens added).
pub fn count_tokens(path: &Path, text: &str) -> Result<usize, LiveError> {
    let fail = |m: String| LiveError::Invalid(format!("tokenizer {}: {m}", path.display()));
    let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| fail(e.to_string()))?;
    let encoded = tokenizer
        .encode_fast(text, false)
        .map_err(|e| fail(e.to_string()))?;
    Ok(encoded.len())
}

/// Replays `trace` against `opts.url`. `progress` gets (completed, total) about twice a second.
pub fn drive_engines(
    trace: &Trace,
    opts: &EngineDriveOptions,
    config: RunConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<EngineDriveOutput, LiveError> {
    if !(opts.time_scale.is_finite() && opts.time_scale > 0.0) {
        return Err(LiveError::Invalid(format!(
            "time scale must be a positive number, got {}",
            opts.time_scale
        )));
    }
    if opts.concurrency == 0 {
        return Err(LiveError::Invalid("concurrency must be at least 1".into()));
    }
    let rt = crate::live::runtime()?;
    rt.block_on(wait_healthy(&opts.url, opts.connect_timeout))?;
    let drive_opts = DriveOptions {
        router_url: opts.url.clone(),
        session_header: opts.session_header.clone(),
        stream: opts.stream,
        request_timeout: opts.request_timeout,
        time_scale: opts.time_scale,
        concurrency: opts.concurrency,
        engine: opts.engine,
        model: opts.model.clone(),
        words: opts.words.clone(),
    };
    let trace = Arc::new(trace.clone());
    let completed = Arc::new(AtomicUsize::new(0));
    let total = trace.len();
    let start = Instant::now();
    let sides = rt.block_on(async {
        let mut task = tokio::spawn(driver::drive(
            trace.clone(),
            None,
            drive_opts,
            start,
            1.0,
            completed.clone(),
        ));
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                r = &mut task => break r,
                _ = tick.tick() => progress(completed.load(Ordering::Relaxed), total),
            }
        }
    });
    let sides = sides.map_err(|e| LiveError::Invalid(format!("the driver failed: {e}")))?;
    progress(completed.load(Ordering::Relaxed), total);
    let wall = start.elapsed().as_secs_f64();
    let (records, report) = records_of(&trace, &sides, start, opts);
    let mut decode: BTreeSet<String> = BTreeSet::new();
    decode.extend(records.iter().filter_map(|r| r.decode.clone()));
    let decode: Vec<String> = decode.into_iter().collect();
    let summary = Summary::build(&records, &decode, config, wall);
    Ok(EngineDriveOutput {
        run: SimOutput {
            records,
            summary,
            worker_names: decode,
            occupancy: Vec::new(),
            committed: Vec::new(),
        },
        report,
    })
}

/// The kind of a failed request, for the report's count.
fn error_kind(c: &ClientSide) -> String {
    if c.status != 0 && !(200..300).contains(&c.status) {
        return format!("status {}", c.status);
    }
    match c.error.as_deref() {
        Some(e) if e.starts_with("no complete answer within") => "timeout".into(),
        Some(e) if e.contains("broke off") || e.contains("stream ended") => "stream".into(),
        Some(e) if e.starts_with("error event") => "error event".into(),
        Some(_) if c.status == 0 => "transport".into(),
        Some(_) => "answer".into(),
        None => "incomplete".into(),
    }
}

/// One record per trace request from what the client saw.
fn records_of(
    trace: &Trace,
    sides: &[Option<ClientSide>],
    start: Instant,
    opts: &EngineDriveOptions,
) -> (Vec<RequestRecord>, EngineDriveReport) {
    let secs = |t: Instant| t.saturating_duration_since(start).as_secs_f64();
    let mut first_of_session = vec![false; trace.len()];
    for s in trace.session_list() {
        if let Some(&i) = s.requests.first() {
            first_of_session[i] = true;
        }
    }
    let mut report = EngineDriveReport {
        label: opts.label.clone(),
        url: opts.url.clone(),
        requests: trace.len(),
        answered: 0,
        trace_prompt_tokens: 0,
        reported_prompt_tokens: 0,
        reported_cached_tokens: 0,
        reported_cached_share: 0.0,
        without_usage: 0,
        token_count_mismatches: 0,
        errors: Default::default(),
        first_errors: Vec::new(),
    };
    let mut records = Vec::with_capacity(trace.len());
    for (i, r) in trace.requests.iter().enumerate() {
        let Some(c) = &sides[i] else {
            *report.errors.entry("lost".into()).or_default() += 1;
            if report.first_errors.len() < 20 {
                report
                    .first_errors
                    .push(format!("request {i}: the driver did not finish it"));
            }
            records.push(super::lost_record(i, r));
            continue;
        };
        let outcome = if c.complete {
            Outcome::Ok
        } else if c.input_too_long {
            Outcome::InputTooLong
        } else if c.status == 503 || c.status == 429 {
            Outcome::Rejected
        } else {
            Outcome::WorkerFailed
        };
        let served = outcome == Outcome::Ok;
        if served {
            report.answered += 1;
            report.trace_prompt_tokens += r.input_length;
            match c.prompt_tokens {
                Some(p) => {
                    report.reported_prompt_tokens += p;
                    report.reported_cached_tokens += c.cached_tokens.unwrap_or(0);
                    if p.abs_diff(r.input_length) > 2 {
                        report.token_count_mismatches += 1;
                    }
                }
                None => report.without_usage += 1,
            }
        } else {
            *report.errors.entry(error_kind(c)).or_default() += 1;
            if report.first_errors.len() < 20 {
                report.first_errors.push(format!(
                    "request {i}: {}",
                    c.error.as_deref().unwrap_or("failed")
                ));
            }
        }
        let mode = c
            .mode
            .as_deref()
            .and_then(|m| m.parse::<ExecutionMode>().ok())
            .or(match opts.unlabelled {
                _ if c.status == 0 => None,
                UnlabelledMode::PrefillDecode if first_of_session[i] => {
                    Some(ExecutionMode::Turn1Seed)
                }
                UnlabelledMode::PrefillDecode => Some(ExecutionMode::Fallback),
                UnlabelledMode::Colocated => Some(ExecutionMode::Colocated),
                UnlabelledMode::Unknown => None,
            });
        let cached = if served {
            c.cached_tokens.unwrap_or(0)
        } else {
            0
        };
        let parts = super::RecordParts {
            mode,
            prefill: c.prefill_worker.clone(),
            decode: c.decode_worker.clone(),
            first: if served { c.first } else { None },
            cached,
            uncached: if served {
                r.input_length.saturating_sub(cached)
            } else {
                0
            },
            outcome,
        };
        records.push(super::client_record(i, r, c, secs, parts));
    }
    if report.reported_prompt_tokens > 0 {
        report.reported_cached_share =
            report.reported_cached_tokens as f64 / report.reported_prompt_tokens as f64;
    }
    (records, report)
}
