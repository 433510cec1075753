//! The sweeps of `kvc-replay profile` carried out against live engines, in order (prefill,
//! decode, transfer: each later one uses the earlier fits), one progress line per measurement,
//! and the profile and its report written.

use super::engine::{Completion, Engines, ServedModel};
use super::fit::{
    self, Factor, StepEstimate, StreamTimes, decode_bytes, prefill_flops, prefill_flops_split,
};
use super::plan::{Limits, Plan, Prompts, TRANSFER_OUTPUT};
use super::report::{self, EngineFacts, FitReport, Measured, ProfileRun, SweepReport};
use super::{ProfileError, ProfileOptions};
use crate::live::LiveError;
use kvc_core::openai::{VllmApi, nixl_prefill_body};
use kvc_engine_sim::model::Profile;
use serde_json::{Map, Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// Token ids per planned word of an intake prompt written by `/detokenize` (three-letter
/// words come to about that many tokens each on a byte-level BPE).
const INTAKE_TOKENS_PER_WORD: u64 = 3;

/// Tokens of each stream skipped, once every stream decodes, before its gaps count.
const SKIP_TOKENS: usize = 2;

/// Measures the engines of `opts` and fits a profile to what they did. `progress` gets one
/// line per measurement (what was sent, the time measured) and a few about the engine.
pub fn profile_engine(
    opts: &ProfileOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<ProfileRun, ProfileError> {
    validate(opts)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ProfileError::Invalid(format!("cannot start the async runtime: {e}")))?;
    rt.block_on(Run::new(opts, progress).go())
}

/// The file name of a profile's report: `h100.toml` → `h100.fit.json`, beside it.
pub fn fit_json_path(out: &Path) -> PathBuf {
    let stem = out
        .file_stem()
        .map_or_else(|| "profile".into(), |s| s.to_string_lossy().into_owned());
    out.with_file_name(format!("{stem}.fit.json"))
}

/// Writes `run`'s profile to `out` (TOML, opened by the comment of what was measured and the
/// residuals) and its report beside it ([`fit_json_path`]); the profile written is read back
/// with [`Profile::load`]. Returns the report's path.
pub fn write_profile(run: &ProfileRun, out: &Path) -> Result<PathBuf, ProfileError> {
    let json_path = fit_json_path(out);
    let name = json_path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let write = |path: &Path, text: &str| {
        std::fs::write(path, text).map_err(|e| ProfileError::Write {
            path: path.display().to_string(),
            message: e.to_string(),
        })
    };
    write(out, &report::profile_toml(run, &name)?)?;
    let mut report =
        serde_json::to_string_pretty(&run.report).map_err(|e| ProfileError::Write {
            path: json_path.display().to_string(),
            message: e.to_string(),
        })?;
    report.push('\n');
    write(&json_path, &report)?;
    let back = Profile::load(out).map_err(|e| ProfileError::Write {
        path: out.display().to_string(),
        message: format!("the profile written does not load: {e}"),
    })?;
    if back != run.profile {
        return Err(ProfileError::Write {
            path: out.display().to_string(),
            message: "the profile written reads back different".into(),
        });
    }
    Ok(json_path)
}

fn validate(opts: &ProfileOptions) -> Result<(), ProfileError> {
    let mut urls = vec![("--url", &opts.url)];
    if let Some(p) = &opts.pair {
        urls.push(("--prefill-url", &p.prefill));
        urls.push(("--decode-url", &p.decode));
    }
    if let Some(m) = &opts.metrics_url {
        urls.push(("--metrics-url", m));
    }
    for (flag, url) in urls {
        if !url.starts_with("http://") {
            return Err(ProfileError::Invalid(format!(
                "{flag} must be an http:// URL (got {url:?})"
            )));
        }
    }
    for (flag, v) in [
        ("--peak-flops", opts.peak_flops),
        ("--mem-bandwidth", opts.mem_bandwidth),
    ] {
        if let Some(v) = v
            && !(v.is_finite() && v > 0.0)
        {
            return Err(ProfileError::Invalid(format!(
                "{flag} must be a positive number (got {v})"
            )));
        }
    }
    if opts.repeats == 0 {
        return Err(ProfileError::Invalid("--repeats must be at least 1".into()));
    }
    if opts.chunk_tokens == Some(0) {
        return Err(ProfileError::Invalid(
            "--chunk-tokens must be at least 1".into(),
        ));
    }
    Ok(())
}

/// A base URL without its trailing slashes.
fn base(url: &str) -> String {
    url.trim_end_matches('/').to_owned()
}

/// A profile name from a model name: letters, digits, `-`, `_` and `.` kept, the rest `-`.
fn default_name(model: &str) -> String {
    let s: String = model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .collect();
    format!("{}-profiled", s.trim_matches('-'))
}

/// A `/v1/completions` body: a token-id prompt, greedy, exactly `max_tokens` generated.
fn body_map(model: &str, tokens: &[u32], max_tokens: u64, stream: bool) -> Map<String, Value> {
    let mut b = Map::new();
    b.insert("model".into(), json!(model));
    b.insert("prompt".into(), json!(tokens));
    b.insert("max_tokens".into(), json!(max_tokens));
    b.insert("temperature".into(), json!(0.0));
    b.insert("ignore_eos".into(), json!(true));
    b.insert("stream".into(), json!(stream));
    if stream {
        b.insert("stream_options".into(), json!({ "include_usage": true }));
    }
    b
}

/// [`body_map`] as a value.
fn body(model: &str, tokens: &[u32], max_tokens: u64, stream: bool) -> Value {
    Value::Object(body_map(model, tokens, max_tokens, stream))
}

fn ms(s: f64) -> String {
    format!("{:.2} ms", s * 1e3)
}

/// One run's state.
struct Run<'a> {
    opts: &'a ProfileOptions,
    progress: &'a mut dyn FnMut(&str),
    engines: Engines,
    url: String,
    /// The engine's Prometheus metrics (`--metrics-url`, or `URL/metrics`).
    metrics_url: String,
    prompts: Prompts,
    /// The next prompt's number.
    next_prompt: u64,
    requests: usize,
    warnings: Vec<String>,
}

impl<'a> Run<'a> {
    fn new(opts: &'a ProfileOptions, progress: &'a mut dyn FnMut(&str)) -> Self {
        Run {
            opts,
            progress,
            engines: Engines::new(opts.request_timeout),
            url: base(&opts.url),
            metrics_url: opts
                .metrics_url
                .clone()
                .unwrap_or_else(|| format!("{}/metrics", base(&opts.url))),
            prompts: Prompts::new(opts.seed),
            next_prompt: 0,
            requests: 0,
            warnings: Vec::new(),
        }
    }

    fn say(&mut self, line: &str) {
        (self.progress)(line);
    }

    fn warn(&mut self, w: String) {
        self.say(&format!("warning: {w}"));
        self.warnings.push(w);
    }

    /// A never-seen prompt of `len` tokens.
    fn prompt(&mut self, len: u64) -> Vec<u32> {
        let n = self.next_prompt;
        self.next_prompt += 1;
        self.prompts.tokens(n, len)
    }

    async fn call(
        &mut self,
        url: &str,
        body: &Value,
        request_id: Option<&str>,
    ) -> Result<Completion, ProfileError> {
        self.call_at(url, "/v1/completions", body, request_id).await
    }

    /// A counted call at `path` of the engine's API.
    async fn call_at(
        &mut self,
        url: &str,
        path: &str,
        body: &Value,
        request_id: Option<&str>,
    ) -> Result<Completion, ProfileError> {
        self.requests += 1;
        self.engines.complete_at(url, path, body, request_id).await
    }

    async fn go(mut self) -> Result<ProfileRun, ProfileError> {
        let opts = self.opts;
        let started = SystemTime::now();
        let t0 = Instant::now();
        let mut urls = vec![self.url.clone()];
        if let Some(p) = &opts.pair {
            urls.extend([base(&p.prefill), base(&p.decode)]);
        }
        for u in &urls {
            crate::http::wait_healthy(u, opts.connect_timeout)
                .await
                .map_err(|e| {
                    ProfileError::NotReady(match e {
                        LiveError::Router(m) => m,
                        other => other.to_string(),
                    })
                })?;
        }
        let models = self.engines.models(&self.url).await?;
        let served = self.served_model(&models);
        let metrics_url = self.metrics_url.clone();
        let cache = self.engines.cache_config(&metrics_url).await?;
        let engine = EngineFacts {
            model: served.id.clone(),
            max_model_len: served.max_model_len,
            block_size: cache.block_size,
            num_gpu_blocks: cache.num_gpu_blocks,
            pool_tokens: cache.block_size * cache.num_gpu_blocks,
        };
        let mut facts = opts.facts.clone();
        if let Some(f) = opts.peak_flops {
            facts.hardware.peak_flops = f;
        }
        if let Some(b) = opts.mem_bandwidth {
            facts.hardware.hbm_bytes_per_s = b;
        }
        let chunk = opts.chunk_tokens.unwrap_or(facts.fit.chunk_tokens);
        let cap = opts
            .max_context
            .min(engine.max_model_len.unwrap_or(u64::MAX))
            .min(engine.pool_tokens);
        let plan = Plan::new(&Limits {
            chunk_tokens: chunk,
            context_cap: cap,
            pool_tokens: engine.pool_tokens,
            block_size: engine.block_size,
            decode_tokens: opts.decode_tokens,
            repeats: opts.repeats,
            transfer: opts.pair.is_some(),
        })?;
        let rtt = self.engines.health_rtt_ms(&self.url).await?;
        self.say(&format!(
            "profiling {} at {}: KV blocks of {} tokens, pool {} tokens, contexts up to {cap}, \
             chunked-prefill budget {chunk}; {} requests planned; GET /health round trip {rtt:.2} ms",
            engine.model,
            self.url,
            engine.block_size,
            engine.pool_tokens,
            plan.requests()
        ));
        let prefill = self.prefill_sweep(&plan, &facts, &engine).await?;
        let (prefill_fit, mut prefill_report) = report::fit_prefill_points(&prefill)?;
        let prefill_factors = fit::prefill_factors(&prefill_fit.line, facts.hardware.peak_flops)?;
        prefill_report.factors = prefill_factors.clone();
        self.say(&summary(&prefill_report));
        const DECODE_MODEL: &str =
            "t = decode_overhead + bytes(batch, context) / (decode_efficiency x hbm_bytes_per_s)";
        let mut decode = self.decode_sweep(&plan, &facts, &engine.model).await?;
        let (decode_fit, mut decode_report) =
            match report::fit_points("decode", DECODE_MODEL, &decode) {
                // A busy host's step times can hide the growth with the work: the sweep is
                // measured once more (as many repeats again) and fitted on every measurement.
                Err(ProfileError::Unfittable { message, .. }) => {
                    self.warn(format!(
                        "decode: {message}; the sweep measured again, {} more repeat(s) a point",
                        plan.repeats
                    ));
                    let again = self.decode_sweep(&plan, &facts, &engine.model).await?;
                    report::merge_points(&mut decode, again);
                    report::fit_points("decode", DECODE_MODEL, &decode)?
                }
                other => other?,
            };
        let decode_factors = fit::decode_factors(&decode_fit.line, facts.hardware.hbm_bytes_per_s)?;
        decode_report.factors = decode_factors.to_vec();
        self.say(&summary(&decode_report));
        let mut factors: Vec<Factor> = prefill_factors.into_iter().chain(decode_factors).collect();
        let mut fit_warnings: Vec<String> = prefill_fit
            .warnings
            .into_iter()
            .chain(decode_fit.warnings)
            .collect();
        let transfer_report = match &opts.pair {
            Some(pair) => {
                let points = self
                    .transfer_sweep(
                        &plan,
                        &facts,
                        &engine,
                        (&base(&pair.prefill), &base(&pair.decode)),
                        (&prefill_fit.line, &decode_fit.line),
                    )
                    .await?;
                let (transfer_fit, mut report) = report::fit_points(
                    "transfer",
                    "t = transfer_setup + tokens x kv_bytes_per_token / transfer_bytes_per_s \
                     (t: D's first token less one decode step and P's unfinished prefill)",
                    &points,
                )?;
                let f = fit::transfer_factors(&transfer_fit.line);
                report.factors = f.to_vec();
                factors.extend(f);
                fit_warnings.extend(transfer_fit.warnings);
                self.say(&summary(&report));
                Some(report)
            }
            None => {
                self.say(
                    "transfer not measured (no --prefill-url/--decode-url): \
                     fit.transfer_bytes_per_s and fit.transfer_setup_ms kept from the facts",
                );
                None
            }
        };
        let intake_report = match self
            .intake_sweep(&plan, &facts, &engine, &prefill_fit.line)
            .await?
        {
            Some(points) => match report::fit_intake_points(&points) {
                Ok((line, warnings, mut report)) => {
                    let f = fit::intake_factors(&line);
                    report.factors = f.to_vec();
                    factors.extend(f);
                    fit_warnings.extend(warnings);
                    self.say(&summary(&report));
                    Some(report)
                }
                // Points skipped (chats the engine refused): the intake is the one sweep
                // the profile can do without, as when the engine serves no chat.
                Err(e @ ProfileError::TooFewPoints { .. }) => {
                    self.warn(format!(
                        "intake not fitted ({e}); fit.intake_ms and fit.intake_ms_per_1k_tokens \
                         kept from the facts"
                    ));
                    None
                }
                Err(e) => return Err(e),
            },
            None => None,
        };
        for w in fit_warnings {
            self.warn(w);
        }
        let name = opts
            .name
            .clone()
            .unwrap_or_else(|| default_name(&engine.model));
        let mut warnings = std::mem::take(&mut self.warnings);
        let profile =
            report::build_profile(&facts, &name, &engine, chunk, &factors, &mut warnings)?;
        let secs = started
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_secs();
        let report = FitReport {
            measured_at: report::rfc3339(secs),
            url: self.url.clone(),
            prefill_url: opts.pair.as_ref().map(|p| base(&p.prefill)),
            decode_url: opts.pair.as_ref().map(|p| base(&p.decode)),
            facts: opts.facts_origin.clone(),
            engine,
            context_cap: cap,
            chunk_tokens: chunk,
            repeats: opts.repeats,
            seed: opts.seed,
            requests: self.requests,
            wall_s: t0.elapsed().as_secs_f64(),
            client_rtt_ms: rtt,
            prefill: prefill_report,
            decode: decode_report,
            transfer: transfer_report,
            intake: intake_report,
            warnings,
        };
        Ok(ProfileRun { profile, report })
    }

    /// The model to name: `--model` (its `max_model_len` when the engine lists it), else the
    /// engine's first.
    fn served_model(&mut self, models: &[ServedModel]) -> ServedModel {
        match &self.opts.model {
            None => models[0].clone(),
            Some(m) => match models.iter().find(|s| &s.id == m) {
                Some(s) => s.clone(),
                None => {
                    let listed: Vec<&str> = models.iter().map(|s| s.id.as_str()).collect();
                    self.warn(format!(
                        "{}/v1/models does not list --model {m} (it lists {listed:?}): its \
                         max_model_len is not known",
                        self.url
                    ));
                    ServedModel {
                        id: m.clone(),
                        max_model_len: None,
                    }
                }
            },
        }
    }

    /// Per intake point: a chat prompt of its words and a token-id prompt of as many tokens as
    /// the chat's answer counted, each sent once to be cached, then each timed once a
    /// repetition (whole answers of one token; the chat first). The intake is the chat's time
    /// less what the prefill fit gives for its part not found cached: what a request costs
    /// before its prefill that grows with the whole prompt (the chat template, tokenizing the
    /// text, finding the prompt's blocks in the prefix cache), and the token-id prompt's time
    /// is kept beside it (the text's part is the difference of the two). `None` (with a
    /// warning) when the engine answers the first chat with an error status: it serves no
    /// chat (no template).
    async fn intake_sweep(
        &mut self,
        plan: &Plan,
        facts: &Profile,
        engine: &EngineFacts,
        prefill: &fit::PrefillLine,
    ) -> Result<Option<Vec<Measured>>, ProfileError> {
        const CHAT: &str = "/v1/chat/completions";
        let url = self.url.clone();
        let model = engine.model.clone();
        let mut points = Vec::new();
        for (i, &words) in plan.intake.iter().enumerate() {
            let n = self.next_prompt;
            self.next_prompt += 1;
            // The chat's text: token ids the engine turns back into text (vLLM's
            // `/detokenize`), so that it tokenizes as text of the engine's own tokens does;
            // where the engine serves no `/detokenize`, three-letter words.
            let ids = self.prompt(INTAKE_TOKENS_PER_WORD * words);
            let detokenize = json!({ "model": model, "tokens": ids });
            let detokenized = match self.call_at(&url, "/detokenize", &detokenize, None).await {
                Ok(c) => c
                    .body
                    .get("prompt")
                    .and_then(Value::as_str)
                    .filter(|t| !t.trim().is_empty())
                    .map(str::to_owned),
                Err(ProfileError::Status { .. } | ProfileError::Unexpected { .. }) => None,
                Err(e) => return Err(e),
            };
            let (content, text_kind) = match detokenized {
                Some(t) => (t, "detokenized token ids"),
                None => (self.prompts.words(n, words), "three-letter words"),
            };
            let chat = json!({
                "model": model,
                "messages": [{ "role": "user", "content": content }],
                "max_tokens": 1,
                "temperature": 0.0,
                "stream": false,
            });
            let first = match self.call_at(&url, CHAT, &chat, None).await {
                Ok(c) => c,
                Err(ProfileError::Status { status, body, .. }) if i == 0 => {
                    self.warn(format!(
                        "intake not measured: {url}{CHAT} answered {status} ({body}); \
                         fit.intake_ms and fit.intake_ms_per_1k_tokens kept from the facts"
                    ));
                    return Ok(None);
                }
                // A later, longer chat the engine refuses (its text tokenizes to more tokens
                // than the ids it came from, past the model's length): the point is left out
                // and the intake fitted on the points measured.
                Err(ProfileError::Status { status, body, .. }) if (400..500).contains(&status) => {
                    self.warn(format!(
                        "intake {}/{}: a chat of {words} words answered {status} ({body}); \
                         point skipped",
                        i + 1,
                        plan.intake.len()
                    ));
                    continue;
                }
                Err(e) => return Err(e),
            };
            let tokens = first
                .body
                .pointer("/usage/prompt_tokens")
                .and_then(Value::as_u64)
                .filter(|&t| t > 0)
                .ok_or_else(|| ProfileError::Unexpected {
                    url: format!("{url}{CHAT}"),
                    message: "a chat answer without usage.prompt_tokens".into(),
                })?;
            let ids = self.prompt(tokens);
            let ids_body = body(&model, &ids, 1, false);
            self.call(&url, &ids_body, None).await?;
            let mut point = Measured {
                inputs: json!({ "words": words, "text": text_kind }),
                x: tokens as f64,
                attention: None,
                seconds: Vec::new(),
                seen: json!({
                    "prompt_tokens": tokens, "text_s": [], "prefill_fit_s": [], "ids_s": [],
                    "reported_cached_tokens": [],
                }),
            };
            for rep in 0..plan.repeats {
                let text = self.call_at(&url, CHAT, &chat, None).await?;
                let id = self.call(&url, &ids_body, None).await?;
                let (tt, ti) = (
                    text.first_token_s().unwrap_or(f64::NAN),
                    id.first_token_s().unwrap_or(f64::NAN),
                );
                for (c, what) in [(&text, "chat"), (&id, "token-id")] {
                    if let Some(r) = c.cached_tokens
                        && r + engine.block_size < tokens
                    {
                        self.warn(format!(
                            "intake: {r} of the {what} prompt's {tokens} tokens reported cached \
                             on its second sending (expected at least {}): the difference holds \
                             prefill work",
                            tokens - engine.block_size
                        ));
                    }
                }
                // The prefill fit's time for what the chat's answer found not cached.
                let cached = text.cached_tokens.unwrap_or(0).min(tokens);
                let predicted =
                    prefill.at_flops(prefill_flops_split(facts, (tokens - cached).max(1), cached));
                point.seconds.push(tt - predicted);
                for (key, v) in [
                    ("text_s", json!(tt)),
                    ("prefill_fit_s", json!(predicted)),
                    ("ids_s", json!(ti)),
                    (
                        "reported_cached_tokens",
                        json!([text.cached_tokens, id.cached_tokens]),
                    ),
                ] {
                    if let Some(list) = point.seen[key].as_array_mut() {
                        list.push(v);
                    }
                }
                self.say(&format!(
                    "intake {}/{} (repeat {}/{}): a chat of {text_kind} ({tokens} tokens, \
                     {cached} cached) in {}, the prefill fit's time {}, its tokens as ids in {} \
                     -> intake {}",
                    i + 1,
                    plan.intake.len(),
                    rep + 1,
                    plan.repeats,
                    ms(tt),
                    ms(predicted),
                    ms(ti),
                    ms(tt - predicted)
                ));
            }
            points.push(point);
        }
        Ok(Some(points))
    }

    /// Single requests, one at a time: a prefix sent alone first where one is to be cached,
    /// then the prompt, its time to the first token measured.
    async fn prefill_sweep(
        &mut self,
        plan: &Plan,
        facts: &Profile,
        engine: &EngineFacts,
    ) -> Result<Vec<Measured>, ProfileError> {
        let url = self.url.clone();
        let model = engine.model.clone();
        let bs = engine.block_size;
        let mut points: Vec<Measured> = plan
            .prefill
            .iter()
            .map(|p| Measured {
                inputs: json!({ "new_tokens": p.new, "cached_tokens": p.cached }),
                x: prefill_flops(facts, p.new, p.cached),
                attention: Some(prefill_flops_split(facts, p.new, p.cached).attention),
                seconds: Vec::new(),
                seen: json!({ "reported_cached_tokens": [] }),
            })
            .collect();
        for rep in 0..plan.repeats {
            for (i, p) in plan.prefill.iter().enumerate() {
                let n = self.next_prompt;
                self.next_prompt += 1;
                if p.cached > 0 {
                    let prefix = self.prompts.tokens(n, p.cached);
                    self.call(&url, &body(&model, &prefix, 1, false), None)
                        .await?;
                }
                let tokens = self.prompts.tokens(n, p.cached + p.new);
                let c = self
                    .call(&url, &body(&model, &tokens, 1, true), None)
                    .await?;
                let t = c.first_token_s().unwrap_or(f64::NAN);
                let reported = c.cached_tokens;
                if let Some(r) = reported {
                    if p.cached > 0 && r + bs < p.cached {
                        self.warn(format!(
                            "prefill: {r} of a {}-token prefix reported cached (expected at least \
                             {}): the engine did not keep the prefix sent just before",
                            p.cached,
                            p.cached - bs
                        ));
                    } else if p.cached == 0 && r >= bs {
                        self.warn(format!(
                            "prefill: {r} tokens of a never-seen prompt reported cached"
                        ));
                    }
                }
                if let Some(list) = points[i].seen["reported_cached_tokens"].as_array_mut() {
                    list.push(json!(reported));
                }
                points[i].seconds.push(t);
                let shown = reported.map_or_else(|| "not reported".into(), |r| r.to_string());
                self.say(&format!(
                    "prefill {}/{} (repeat {}/{}): {} new tokens after {} cached -> first token \
                     in {} (cached reported: {shown})",
                    i + 1,
                    plan.prefill.len(),
                    rep + 1,
                    plan.repeats,
                    p.new,
                    p.cached,
                    ms(t)
                ));
            }
        }
        Ok(points)
    }

    /// `batch` concurrent streams at a time; one decode step's time while all of them decode.
    async fn decode_sweep(
        &mut self,
        plan: &Plan,
        facts: &Profile,
        model: &str,
    ) -> Result<Vec<Measured>, ProfileError> {
        let url = self.url.clone();
        let k = plan.decode_tokens;
        let mut points: Vec<Measured> = plan
            .decode
            .iter()
            .map(|p| {
                let mid = p.batch as u64 * (p.context + k / 2);
                Measured {
                    inputs: json!({ "batch": p.batch, "context_tokens": p.context,
                                    "max_tokens": k, "context_mid_stream": mid }),
                    x: decode_bytes(facts, p.batch, mid),
                    attention: None,
                    seconds: Vec::new(),
                    seen: json!({ "estimates": [], "stream_estimates": [] }),
                }
            })
            .collect();
        for rep in 0..plan.repeats {
            for (i, p) in plan.decode.iter().enumerate() {
                // Each stream's prompt is sent alone first (one token) to be cached: the
                // streams then start within a step or two of each other, and the engine's
                // counters time steps that decode (not steps that also prefill another
                // stream's prompt).
                let prompts: Vec<Vec<u32>> = (0..p.batch).map(|_| self.prompt(p.context)).collect();
                let mut warm = tokio::task::JoinSet::new();
                for tokens in &prompts {
                    let b = body(model, tokens, 1, false);
                    let (engines, url) = (self.engines.clone(), url.clone());
                    warm.spawn(async move { engines.complete(&url, &b, None).await });
                }
                self.requests += p.batch;
                while let Some(joined) = warm.join_next().await {
                    joined.map_err(|e| {
                        ProfileError::Invalid(format!("a decode prompt's task failed: {e}"))
                    })??;
                }
                let metrics_url = self.metrics_url.clone();
                let before = self.engines.decode_counters(&metrics_url).await?;
                let mut tasks = tokio::task::JoinSet::new();
                for (s, tokens) in prompts.iter().enumerate() {
                    let b = body(model, tokens, k, true);
                    let (engines, url) = (self.engines.clone(), url.clone());
                    tasks.spawn(async move { (s, engines.complete(&url, &b, None).await) });
                }
                self.requests += p.batch;
                let mut answers: Vec<Option<Completion>> = vec![None; p.batch];
                while let Some(joined) = tasks.join_next().await {
                    let (s, answer) = joined.map_err(|e| {
                        ProfileError::Invalid(format!("a decode stream's task failed: {e}"))
                    })?;
                    answers[s] = Some(answer?);
                }
                let answers: Vec<Completion> = answers.into_iter().flatten().collect();
                let origin = answers
                    .iter()
                    .map(|a| a.sent)
                    .min()
                    .unwrap_or_else(Instant::now);
                let streams: Vec<StreamTimes> = answers
                    .iter()
                    .map(|a| StreamTimes {
                        chunks: a
                            .chunks
                            .iter()
                            .map(|t| t.saturating_duration_since(origin).as_secs_f64())
                            .collect(),
                        tokens: a.completion_tokens.unwrap_or(k),
                    })
                    .collect();
                let what = format!(
                    "decode {}/{} (repeat {}/{}): {} stream(s) of {} prompt tokens, {k} generated",
                    i + 1,
                    plan.decode.len(),
                    rep + 1,
                    plan.repeats,
                    p.batch,
                    p.context
                );
                let after = match before {
                    Some(_) => self.engines.decode_counters(&metrics_url).await?,
                    None => None,
                };
                let engine_step = before
                    .zip(after)
                    .and_then(|(b, a)| fit::engine_decode_step(&b, &a, p.batch));
                let stream_step = fit::decode_step(&streams, SKIP_TOKENS);
                if let Some(list) = points[i].seen["stream_estimates"].as_array_mut() {
                    list.push(json!(stream_step));
                }
                let streams_say = stream_step.map_or_else(
                    || "the streams showed no window where all decoded".to_owned(),
                    |s| format!("the streams say {}", describe(&s)),
                );
                if before.is_some() && engine_step.is_none() {
                    self.warn(format!(
                        "{what}: the engine's decode counters did not count {} finished                          request(s) between the two readings (another client?); the streams'                          reading is used",
                        p.batch
                    ));
                }
                match engine_step.or(stream_step) {
                    Some(est) => {
                        points[i].seconds.push(est.seconds);
                        if let Some(list) = points[i].seen["estimates"].as_array_mut() {
                            list.push(json!(est));
                        }
                        if est.method == fit::StepMethod::Engine {
                            self.say(&format!(
                                "{what} -> step {} ({streams_say})",
                                describe(&est)
                            ));
                        } else {
                            self.say(&format!("{what} -> step {}", describe(&est)));
                        }
                    }
                    None => self.warn(format!("{what}: {streams_say}; point skipped")),
                }
            }
        }
        points.retain(|p| !p.seconds.is_empty());
        Ok(points)
    }

    /// vLLM's two P/D calls per point, P's prefix cache warmed first; the transfer is D's time
    /// to its first token less one decode step and P's unfinished prefill (both as the
    /// prefill and decode fits predict them).
    async fn transfer_sweep(
        &mut self,
        plan: &Plan,
        facts: &Profile,
        engine: &EngineFacts,
        (p_url, d_url): (&str, &str),
        (prefill_line, decode_line): (&fit::PrefillLine, &fit::Line),
    ) -> Result<Vec<Measured>, ProfileError> {
        let model = engine.model.clone();
        let bs = engine.block_size;
        let kv = facts.kv_bytes_per_token();
        let mut points: Vec<Measured> = plan
            .transfer
            .iter()
            .map(|&n| Measured {
                inputs: json!({ "tokens": n }),
                x: n as f64 * kv,
                attention: None,
                seconds: Vec::new(),
                seen: json!({ "p_round_trip_s": [], "d_first_token_s": [] }),
            })
            .collect();
        for rep in 0..plan.repeats {
            for (i, &n) in plan.transfer.iter().enumerate() {
                let id = self.next_prompt;
                let tokens = self.prompt(n);
                self.call(p_url, &body(&model, &tokens, 1, false), None)
                    .await?;
                let original = body_map(&model, &tokens, TRANSFER_OUTPUT, true);
                let p_body = Value::Object(nixl_prefill_body(&original, VllmApi::Completions));
                let request_id = format!("kvc-profile-{:x}-{id}", self.opts.seed);
                let p = self.call(p_url, &p_body, Some(&request_id)).await?;
                let p_rt = p.first_token_s().unwrap_or(f64::NAN);
                let params = match p.body.get("kv_transfer_params") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    _ => {
                        return Err(ProfileError::Unexpected {
                            url: format!("{p_url}/v1/completions"),
                            message: "the answer to do_remote_decode has no kv_transfer_params \
                                      object: is this a NixlConnector prefill engine \
                                      (kv_role kv_producer)?"
                                .into(),
                        });
                    }
                };
                let mut d_body = original;
                d_body.insert("kv_transfer_params".into(), params);
                let d_body = Value::Object(d_body);
                let d = self.call(d_url, &d_body, Some(&request_id)).await?;
                let d_ttft = d.first_token_s().unwrap_or(f64::NAN);
                let step = decode_line.at(decode_bytes(facts, 1, n));
                // P's prefix cache holds the prompt's full blocks but the last (an engine
                // recomputes at least one token).
                let uncached = n - (n - 1) / bs * bs;
                let p_prefill =
                    prefill_line.at_flops(prefill_flops_split(facts, uncached, n - uncached));
                let t = fit::transfer_seconds(d_ttft, step, p_prefill, p_rt);
                points[i].seconds.push(t);
                for (key, v) in [("p_round_trip_s", p_rt), ("d_first_token_s", d_ttft)] {
                    if let Some(list) = points[i].seen[key].as_array_mut() {
                        list.push(json!(v));
                    }
                }
                self.say(&format!(
                    "transfer {}/{} (repeat {}/{}): {n} tokens -> P answered in {}, D's first \
                     token in {}, less a decode step of {} and P's unfinished prefill of {}: \
                     transfer {}",
                    i + 1,
                    plan.transfer.len(),
                    rep + 1,
                    plan.repeats,
                    ms(p_rt),
                    ms(d_ttft),
                    ms(step),
                    ms((p_prefill - p_rt).max(0.0)),
                    ms(t)
                ));
            }
        }
        Ok(points)
    }
}

fn describe(est: &StepEstimate) -> String {
    match est.method {
        fit::StepMethod::PerToken => format!(
            "{} (over {} gaps between tokens)",
            ms(est.seconds),
            est.samples
        ),
        fit::StepMethod::Engine => format!(
            "{} (the engine's own timing of {} steps)",
            ms(est.seconds),
            est.samples
        ),
        fit::StepMethod::Span => format!(
            "{} (mean over {} tokens of the last stream to start: the engine streams several \
             tokens a chunk)",
            ms(est.seconds),
            est.samples
        ),
    }
}

/// One line of a sweep's fit: its factors and residuals.
fn summary(r: &SweepReport) -> String {
    let factors: Vec<String> = r
        .factors
        .iter()
        .map(|f| format!("{} = {:.4} ± {:.4}", f.key, f.value, f.stderr))
        .collect();
    let one = r.one_efficiency_residuals.map_or_else(String::new, |one| {
        format!(
            " (one efficiency for all FLOPs: RMS {:.2} %, max {:.2} %)",
            one.rms_rel * 100.0,
            one.max_rel * 100.0
        )
    });
    format!(
        "{} fit over {} points: {}; residuals RMS {:.2} %, max {:.2} %{one}",
        r.sweep,
        r.residuals.points,
        factors.join(", "),
        r.residuals.rms_rel * 100.0,
        r.residuals.max_rel * 100.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_bodies_and_report_paths() {
        assert_eq!(
            default_name("Qwen/Qwen3-30B-A3B"),
            "Qwen-Qwen3-30B-A3B-profiled"
        );
        let b = body("m", &[101, 102], 4, true);
        assert_eq!(b["prompt"], json!([101, 102]));
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(
            (b["ignore_eos"].clone(), b["temperature"].clone()),
            (json!(true), json!(0.0))
        );
        assert!(body("m", &[1], 1, false).get("stream_options").is_none());
        assert_eq!(
            fit_json_path(Path::new("out/h100.toml")),
            Path::new("out/h100.fit.json")
        );
        let mut o = ProfileOptions::new("https://x");
        assert!(validate(&o).unwrap_err().to_string().contains("http://"));
        o.url = "http://x".into();
        o.repeats = 0;
        assert!(validate(&o).unwrap_err().to_string().contains("--repeats"));
        o.repeats = 1;
        o.peak_flops = Some(-1.0);
        assert!(
            validate(&o)
                .unwrap_err()
                .to_string()
                .contains("--peak-flops")
        );
    }
}
