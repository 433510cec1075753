//! `kvc-replay drive`: replay a trace against real engines (or any router in front of them).

use super::TraceArgs;
use anyhow::{Result, bail};
use kvc_replay::http::engines::{
    EngineDriveOptions, UnlabelledMode, count_tokens, drive_engines, one_token_words,
};
use kvc_replay::output::{summary_table, write_run};
use kvc_replay::sim::metrics::RunConfig;
use std::path::PathBuf;
use std::sync::Arc;

const DRIVE_AFTER_HELP: &str = "\
Each trace request becomes one /v1/completions call (or /generate with --engine sglang) to
--url, with ignore_eos, temperature 0 and the trace's output length, paced as `sim` paces it: a
session's turns in order, turn k+1 ready at the later of its scaled timestamp and turn k's end,
at most --concurrency in flight.

The run directory gets what `sim` writes (metrics.jsonl, summary.json), so `compare` and
`report` read it, and drive.json: requests answered, errors per kind, the prompt and cached
tokens the answers' usage reports (usage.prompt_tokens_details.cached_tokens; vLLM reports it
with --enable-prompt-tokens-details) and how many answers counted a prompt other than the
trace says.

With --tokenizer (the engine's tokenizer.json), every token position of the trace is one of the
tokenizer's one-token words, so prompts are as long as the trace says and share exactly the
tokens the trace's blocks share; the first prompt is checked against the tokenizer before
anything is sent.

Example, against a kvc-router in front of real vLLM engines:
  kvc-replay drive --url http://127.0.0.1:18080 --model kvc-tiny \\
    --tokenizer model/tokenizer.json --trace trace.jsonl --out runs/kvc";

/// Options of `kvc-replay drive`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = DRIVE_AFTER_HELP)]
pub(crate) struct Args {
    /// Trace file (JSONL).
    #[arg(long)]
    pub(crate) trace: PathBuf,
    #[command(flatten)]
    pub(crate) trace_opts: TraceArgs,
    /// Where requests go: a router in front of the engines, or one engine.
    #[arg(long, value_name = "URL")]
    pub(crate) url: String,
    /// The model named in each request (the engines' served model name).
    #[arg(long)]
    pub(crate) model: String,
    /// The engine's tokenizer.json: prompts are written in its one-token words (without it,
    /// in made-up words that a real tokenizer splits into several tokens each).
    #[arg(long, value_name = "FILE")]
    pub(crate) tokenizer: Option<PathBuf>,
    /// The API: vLLM's OpenAI /v1/completions, or SGLang's /generate.
    #[arg(long, default_value = "vllm", value_parser = ["vllm", "sglang"])]
    pub(crate) engine: String,
    /// Directory for metrics.jsonl, summary.json and drive.json.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// The run's name in its summary.
    #[arg(long, default_value = "external")]
    pub(crate) label: String,
    /// The mode recorded for an answer without x-kvc-mode (routers other than kvc-router):
    /// `prefill-decode` (every request through a prefill and a decode engine), `colocated`
    /// (one engine serves it), or `unknown` (not counted as routed).
    #[arg(long, default_value = "unknown", value_parser = ["prefill-decode", "colocated", "unknown"])]
    pub(crate) unlabelled_mode: String,
    /// The topology named in the summary (what the engines are, e.g. 1p1d or 2x).
    #[arg(long, default_value = "external")]
    pub(crate) topology: String,
    /// Trace time is divided by this.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) time_scale: f64,
    /// Most requests in flight.
    #[arg(long, default_value_t = 32)]
    pub(crate) concurrency: usize,
    /// Header carrying each request's session key.
    #[arg(long, default_value = "x-session-id")]
    pub(crate) session_header: String,
    /// Send no session header.
    #[arg(long)]
    pub(crate) no_session_header: bool,
    /// Ask for whole answers instead of streams (no TTFT then).
    #[arg(long)]
    pub(crate) no_stream: bool,
    /// Most wall seconds one request may take.
    #[arg(long, default_value_t = 600.0)]
    pub(crate) request_timeout_s: f64,
    /// Seconds to wait for GET /health at --url to answer 2xx.
    #[arg(long, default_value_t = 30.0)]
    pub(crate) connect_timeout_s: f64,
    /// No progress output.
    #[arg(long, short)]
    pub(crate) quiet: bool,
}

/// Runs `kvc-replay drive`.
pub(crate) fn run(args: Args) -> Result<()> {
    let request_timeout = super::positive_seconds("--request-timeout-s", args.request_timeout_s)?;
    let connect_timeout = super::positive_seconds("--connect-timeout-s", args.connect_timeout_s)?;
    if !(args.time_scale.is_finite() && args.time_scale > 0.0) {
        bail!(
            "--time-scale must be a number > 0 (got {})",
            args.time_scale
        );
    }
    if args.concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    let trace = args.trace_opts.load(&args.trace, args.quiet)?;
    if trace.is_empty() {
        bail!("{} holds no requests", args.trace.display());
    }
    let words = match &args.tokenizer {
        Some(path) => {
            let words = one_token_words(path)?;
            // The plan checked on the first request: as many tokens as the trace says.
            let r = &trace.requests[0];
            let text = words.text(&r.hash_ids, r.input_length, trace.block_size());
            let n = count_tokens(path, &text)?;
            if n as u64 != r.input_length {
                bail!(
                    "tokenizer {}: the first prompt is {n} tokens, the trace says {}: this \
                     tokenizer merges across words, so prompts would not repeat where blocks do",
                    path.display(),
                    r.input_length
                );
            }
            if !args.quiet {
                eprintln!(
                    "kvc-replay drive: prompts in {} one-token words of {}",
                    words.words().len(),
                    path.display()
                );
            }
            Some(Arc::new(words))
        }
        None => None,
    };
    let opts = EngineDriveOptions {
        url: args.url.clone(),
        label: args.label.clone(),
        model: args.model.clone(),
        session_header: (!args.no_session_header).then(|| args.session_header.clone()),
        stream: !args.no_stream,
        request_timeout,
        connect_timeout,
        time_scale: args.time_scale,
        concurrency: args.concurrency,
        engine: args.engine.parse()?,
        words,
        unlabelled: match args.unlabelled_mode.as_str() {
            "prefill-decode" => UnlabelledMode::PrefillDecode,
            "colocated" => UnlabelledMode::Colocated,
            _ => UnlabelledMode::Unknown,
        },
    };
    let config = RunConfig {
        topology: args.topology.clone(),
        policy: args.label.clone(),
        prefill_policy: None,
        time_scale: args.time_scale,
        concurrency: args.concurrency,
        seed: 0,
        backpressure: false,
        eviction: "engine".into(),
        profile: format!("engines at {}", args.url),
        local_prefill: false,
        session_ends: None,
        policy_config: serde_json::Value::Null,
    };
    let quiet = args.quiet;
    let mut last = 0;
    let mut progress = |done: usize, total: usize| {
        if !quiet && done >= last + total.max(10) / 10 {
            last = done;
            eprintln!("kvc-replay drive: {done}/{total} requests");
        }
    };
    let output = drive_engines(&trace, &opts, config, &mut progress)?;
    write_run(&output.run, &args.out)?;
    let mut text = serde_json::to_string_pretty(&output.report)?;
    text.push('\n');
    std::fs::write(args.out.join("drive.json"), text)?;
    print!(
        "{}",
        summary_table(&[(
            format!("{} {}", args.label, args.topology),
            &output.run.summary
        )])
    );
    let r = &output.report;
    println!(
        "answered {}/{}; engines report {:.3} of {} prompt tokens cached; {} answers counted a \
         prompt other than the trace's; errors {:?}",
        r.answered,
        r.requests,
        r.reported_cached_share,
        r.reported_prompt_tokens,
        r.token_count_mismatches,
        r.errors
    );
    for e in &r.first_errors {
        eprintln!("  {e}");
    }
    eprintln!("wrote {}", args.out.display());
    Ok(())
}
