//! `kvc-replay profile`: measure a live engine with a bounded sweep and write an engine profile
//! (`profiles/*.toml` format) fitted to it, with the fit's residuals.

use anyhow::{Result, bail};
use kvc_engine_sim::model::Profile;
use kvc_replay::profile::{PdUrls, ProfileOptions, profile_engine, write_profile};
use std::path::PathBuf;

const PROFILE_AFTER_HELP: &str = "\
What is measured (every time at the client, every prompt but the intake's chats a list of
token ids drawn from ids 100..4000 that no earlier request sent, so nothing is found cached
by accident):

  prefill   single requests, one at a time: N new tokens (halving from the chunk budget, at
            most 6 sizes) after C cached tokens (0, and a quarter and half of the context
            cap: the prefix is sent alone first, and the answer's cached_tokens must show
            it, else a warning). The time to the first token is fitted as
              overhead + linear_FLOPs(N) / (prefill_efficiency x peak_flops)
                       + attention_FLOPs(N, C) / (attention_efficiency x peak_flops)
            with the profile's FLOP counts -> fit.prefill_efficiency,
            fit.attention_efficiency, fit.prefill_overhead_ms. When attention cannot be
            told apart (the two efficiencies within one standard error of each other, or the
            points unable to separate them), one efficiency is fitted to all FLOPs and
            fit.attention_efficiency is not written, with a warning.
  decode    B = 1, 2, 4, 8 concurrent streams, each of L prompt tokens (two sizes) and
            --decode-tokens generated, each prompt sent alone first (one token) to be
            cached. One decode step is the engine's own decode seconds over its steps,
            from vLLM's counters read before and after the point
            (vllm:request_decode_time_seconds, vllm:generation_tokens_total): a busy
            client or API server delivers tokens in bursts. An engine without them: each
            stream's time from its first to its last token while all B streams decode,
            over the steps between, only chunks that end a burst taken as ends (an engine
            that streams several tokens a chunk: the mean gap of the stream that started
            last). Fitted as
              overhead + bytes(B, context at mid-stream) / (decode_efficiency x bandwidth)
            -> fit.decode_efficiency, fit.decode_overhead_ms.
  transfer  with --prefill-url and --decode-url (a NixlConnector pair), five prompt
            lengths: the prompt sent to P alone first (P's prefix cache warmed), then vLLM's
            two P/D calls (P: kv_transfer_params do_remote_decode, max_tokens 1, not
            streamed; D: the request with P's kv_transfer_params; the same X-Request-Id).
            D's time to the first token, less one decode step (the decode fit) and the
            prefill P had not finished when it answered, is fitted as
              setup + tokens x kv_bytes_per_token / transfer_bytes_per_s
            -> fit.transfer_bytes_per_s, fit.transfer_setup_ms. Without the pair, the facts
            profile's transfer factors are kept.
  intake    three chats (/v1/chat/completions), their text the engine's /detokenize of
            3/16, 3/8 and 3/4 of the context cap in token ids (three-letter words where
            the engine serves no /detokenize), each sent once to be cached and then timed
            (whole answers of one token), with a token-id prompt of its length beside it.
            The chat's time less the prefill fit's time for its uncached tail is fitted by
            ordinary least squares as
              intake + intake_per_token x prompt tokens
            -> fit.intake_ms, fit.intake_ms_per_1k_tokens (a slope below 0: the mean; an
            intercept below 0: through the origin; nothing above 0: 0; each with a
            warning). An engine that serves no chat keeps the facts' intake.

From the engine itself: the model (GET /v1/models, the first entry, unless --model), its
max_model_len (model.max_input_tokens) and the KV pool (vllm:cache_config_info's
num_gpu_blocks x block_size, from /metrics: hardware.kv_pool_tokens). Every sweep's context
is capped at the smallest of --max-context, max_model_len and the pool. The other [model]
and [hardware] facts come from --facts (peak FLOP/s and bandwidth from --peak-flops and
--mem-bandwidth when given); every other [fit] factor (pressure, timeouts, mixed_batches) is
copied from it.

Every fixed cost fitted includes what a request costs the client whatever its size (the HTTP
round trip, parsing, streaming); the GET /health round trip is reported beside it. A fitted
efficiency above 1 is an error (the hardware facts are too low: raise --peak-flops or
--mem-bandwidth); a fixed cost fitted below 0 is set to 0, the slope fitted again, and a
warning recorded. A decode sweep whose step times do not grow with the work (a busy host's
noise can hide the growth) is measured once more, --repeats more times a point, and fitted on
every measurement, with a warning; if the growth is still hidden the profile fails.

About 180 requests with the defaults, 210 with a pair (each point measured --repeats times, the median
fitted): on an H100 well under a minute; on a CPU-only vLLM build, lower --max-context.

Output: --out, the profile (loads with `kvc-replay sim --profile`), opened by a comment with
what was measured, when, against which URL and model, and each sweep's residuals (points,
RMS and largest relative error) and factors with their standard errors; and beside it
OUT-stem.fit.json with every point: inputs, each measured time, the median, the fitted time
and the relative residual.

Example, a vLLM engine and a NixlConnector pair on one H100 each:
  kvc-replay profile --url http://gpu-a:8000 \\
    --prefill-url http://gpu-b:8000 --decode-url http://gpu-c:8000 \\
    --facts profiles/qwen3-30b-a3b-h100.toml --out my-h100.toml";

/// Options of `kvc-replay profile`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = PROFILE_AFTER_HELP)]
pub(crate) struct Args {
    /// A colocated engine (serves whole requests: prefill and decode): the prefill and decode
    /// sweeps run against it.
    #[arg(long, value_name = "URL")]
    pub(crate) url: String,
    /// The prefill engine of a NixlConnector P/D pair (kv_role kv_producer), for the transfer
    /// sweep; needs --decode-url.
    #[arg(long, value_name = "URL", requires = "decode_url")]
    pub(crate) prefill_url: Option<String>,
    /// The decode engine of the pair (kv_role kv_consumer); needs --prefill-url.
    #[arg(long, value_name = "URL", requires = "prefill_url")]
    pub(crate) decode_url: Option<String>,
    /// Where the engine's Prometheus metrics are (vllm:cache_config_info), when not at
    /// URL/metrics as vLLM serves them.
    #[arg(long, value_name = "URL")]
    pub(crate) metrics_url: Option<String>,
    /// The model named in requests (default: the first entry of the engine's /v1/models).
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// A profile whose [model] and [hardware] facts the fits use and whose other [fit]
    /// factors are kept (default: the embedded Qwen3-30B-A3B on H100 profile).
    #[arg(long, value_name = "PROFILE.toml")]
    pub(crate) facts: Option<PathBuf>,
    /// The hardware's dense peak FLOP/s at the model's precision (overrides
    /// hardware.peak_flops of the facts).
    #[arg(long, value_name = "FLOPS")]
    pub(crate) peak_flops: Option<f64>,
    /// The hardware's memory bandwidth in bytes/s (overrides hardware.hbm_bytes_per_s).
    #[arg(long, value_name = "BYTES_PER_S")]
    pub(crate) mem_bandwidth: Option<f64>,
    /// The engine's chunked-prefill budget in tokens (vLLM's max_num_batched_tokens); prefill
    /// points keep their new tokens within it (default: the facts' fit.chunk_tokens).
    #[arg(long, value_name = "N")]
    pub(crate) chunk_tokens: Option<u64>,
    /// The longest context any request has, in tokens (also capped by max_model_len and the
    /// KV pool).
    #[arg(long, value_name = "N", default_value_t = kvc_replay::profile::DEFAULT_MAX_CONTEXT)]
    pub(crate) max_context: u64,
    /// Each point is measured this many times; the median is fitted.
    #[arg(long, value_name = "N", default_value_t = kvc_replay::profile::DEFAULT_REPEATS)]
    pub(crate) repeats: usize,
    /// Tokens each decode stream generates.
    #[arg(long, value_name = "N", default_value_t = kvc_replay::profile::DEFAULT_DECODE_TOKENS)]
    pub(crate) decode_tokens: u64,
    /// The profile's name (default: the model's, with -profiled).
    #[arg(long)]
    pub(crate) name: Option<String>,
    /// Seeds the prompts' token ids (default: from the clock, so that a second run against the
    /// same engine finds nothing of the first cached); written into the report.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Most wall seconds one request may take.
    #[arg(long, default_value_t = 120.0)]
    pub(crate) request_timeout_s: f64,
    /// Seconds to wait for each engine's GET /health to answer 2xx.
    #[arg(long, default_value_t = 30.0)]
    pub(crate) connect_timeout_s: f64,
    /// Where to write the profile (TOML); its points go beside it, as OUT-stem.fit.json.
    #[arg(long, value_name = "PROFILE.toml")]
    pub(crate) out: PathBuf,
    /// No progress lines (warnings still are).
    #[arg(long, short)]
    pub(crate) quiet: bool,
}

/// Runs `kvc-replay profile`.
pub(crate) fn run(args: Args) -> Result<()> {
    let mut opts = ProfileOptions::new(args.url.clone());
    if let Some(path) = &args.facts {
        opts.facts = Profile::load(path)?;
        opts.facts_origin = path.display().to_string();
    }
    opts.pair = match (&args.prefill_url, &args.decode_url) {
        (Some(p), Some(d)) => Some(PdUrls {
            prefill: p.clone(),
            decode: d.clone(),
        }),
        (None, None) => None,
        _ => bail!("--prefill-url and --decode-url go together"),
    };
    opts.metrics_url = args.metrics_url.clone();
    opts.model = args.model.clone();
    opts.peak_flops = args.peak_flops;
    opts.mem_bandwidth = args.mem_bandwidth;
    opts.chunk_tokens = args.chunk_tokens;
    opts.max_context = args.max_context;
    opts.repeats = args.repeats;
    opts.decode_tokens = args.decode_tokens;
    opts.name = args.name.clone();
    opts.seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    opts.request_timeout = super::positive_seconds("--request-timeout-s", args.request_timeout_s)?;
    opts.connect_timeout = super::positive_seconds("--connect-timeout-s", args.connect_timeout_s)?;
    let quiet = args.quiet;
    let mut progress = |line: &str| {
        if !quiet || line.starts_with("warning") {
            eprintln!("kvc-replay profile: {line}");
        }
    };
    let run = profile_engine(&opts, &mut progress)?;
    let report = write_profile(&run, &args.out)?;
    let p = &run.profile.fit;
    println!(
        "prefill_efficiency {:.4}, {}prefill_overhead_ms {:.2}, decode_efficiency {:.4}, \
         decode_overhead_ms {:.2}, transfer_bytes_per_s {:.4e}, transfer_setup_ms {:.2}{}",
        p.prefill_efficiency,
        p.attention_efficiency
            .map_or_else(String::new, |a| format!("attention_efficiency {a:.4}, ")),
        p.prefill_overhead_ms,
        p.decode_efficiency,
        p.decode_overhead_ms,
        p.transfer_bytes_per_s,
        p.transfer_setup_ms,
        if run.report.transfer.is_none() {
            " (transfer kept from the facts)"
        } else {
            ""
        }
    );
    eprintln!(
        "wrote {} and {} ({} requests in {:.1} s)",
        args.out.display(),
        report.display(),
        run.report.requests,
        run.report.wall_s
    );
    Ok(())
}
