//! `kvc-replay sim`: simulate one cluster and policy on a trace.

use super::{TraceArgs, report_skipped};
use anyhow::{Context, Result, bail};
use kvc_core::{BlockSize, Topology};
use kvc_policy::PolicyConfig;
use kvc_replay::output::{self, ProgressMode};
use kvc_replay::sim::config::Drain;
use kvc_replay::sim::metrics::Summary;
use kvc_replay::sim::{EvictionMode, Profile, SimConfig, SimError};
use kvc_replay::trace::{ReadAhead, SourceError, TraceStream};
use std::path::PathBuf;
use std::time::Instant;

/// Options of `kvc-replay sim`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = SIM_AFTER_HELP)]
pub(crate) struct Args {
    /// Trace file (JSONL, Mooncake fields plus optional session_id and turn_id).
    #[arg(long)]
    pub(crate) trace: PathBuf,
    #[command(flatten)]
    pub(crate) trace_opts: TraceArgs,
    #[command(flatten)]
    pub(crate) run: RunArgs,
    /// Directory for metrics.jsonl, summary.json and occupancy.csv (created if missing).
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// No progress bar.
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Also print a progress line (requests simulated, share of the trace read, rate) every
    /// 5 s on stderr, terminal or not; without it a bar shows on a terminal only.
    #[arg(long, conflicts_with = "quiet")]
    pub(crate) progress: bool,
    /// Load the whole trace before simulating instead of reading it as the run goes (what a
    /// trace that cannot be streamed gets anyway); the outputs are the same.
    #[arg(long)]
    pub(crate) in_memory: bool,
    /// Drain a worker during the run, WORKER@SECONDS (repeatable): from SECONDS of the run's
    /// clock (after --time-scale) no turn is placed on WORKER (a name as the summary gives
    /// it: d0, x1, dp2, …), which finishes its work and keeps the KV it holds; summary.json's
    /// `drains` says what became of the sessions it held.
    #[arg(long = "drain", value_name = "WORKER@SECONDS")]
    pub(crate) drains: Vec<String>,
}

const SIM_AFTER_HELP: &str = "\
Memory: the trace is read as the run goes and records are written as requests complete, so
the run holds the requests in flight (and those that finished ahead of an earlier one), a few
bytes per request for the summary's percentiles, a few per session and the policy's session
table (which no TTL trims in a simulated run), not the trace. A trace
that cannot be read in order (not sorted by timestamp, requests with and without session_id
mixed, or a session's turns out of order) is loaded whole instead, with a note on stderr; the
outputs are the same either way.

Outputs (in --out):
  metrics.jsonl   one JSON object per trace request, in trace order: index, session, turn,
                  scheduled_s, dispatch_s, first_token_s, done_s, ttft_s, latency_s, wait_s,
                  mode, reason, prefill, decode, input_tokens, cached_tokens, uncached_tokens,
                  output_tokens, outcome, and retractions when a decode worker retracted the
                  request for want of KV room. A request that failed in the engine
                  (kv-transfer-timeout, decode-oom) also has failure{stage, worker, waited_s,
                  need_tokens, free_tokens, evictable_tokens, queue_depth}: what it waited for
                  (decode-room, prefill-room, prefill, transfer, failed-pair, retracted,
                  retraction-limit, host-pool-full), on which worker, for how long, and that
                  worker's pool and queue when it failed. Times are seconds from the start of
                  the replay; TTFT and latency count from when the turn was ready.
  summary.json    requests, outcomes{name: count}, mechanism_errors, ttft_s / latency_s / wait_s
                  {mean, p50, p90, p99} over ok requests, direct_to_d_rate,
                  prompt_tokens{computed, cached} (summed over routed requests: what the
                  fleet prefilled, recomputed context included, and what it reused),
                  modes{mode: {requests, share, ttft_p50_s, latency_p50_s}}, reasons{reason: count},
                  workers{name: {requests}}, worker_spread, sessions{count, d_changes_mean,
                  d_changes_max, direct_rate_0_20, direct_rate_80_100}, config{…}, sim_span_s,
                  sim_wall_s.
                  With --drain, drains[{worker, at_s, sessions, resident_tokens, returned,
                  returned_tokens, next_turn_modes, next_turn_tokens{computed, cached},
                  next_turn_ttft_mean_s}]: the sessions the worker held when drained, those
                  that came back, and the mode, prompt tokens and TTFT of each one's first
                  turn after the drain.
  occupancy.csv   time_s and the used fraction of every worker's KV pool, every 10 s.
  committed.csv   the same for the committed fraction: what eviction cannot reclaim (running
                  requests; on decode workers, sessions that are not idle).

Policy knobs: --knob KEY=VALUE sets a field of the policy's configuration (repeatable); the
keys are those `kvc-replay policies` prints for the policy. Example:
  kvc-replay sim --trace t.jsonl --topology 1p3d --policy kvc --knob hard-cap=0.9 --out run/";

/// Cluster, policy and replay settings shared by `sim` and `live`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RunArgs {
    /// Cluster shape: NpMd (prefill + decode workers, e.g. 1p3d), NpMd-hybrid (the same, with
    /// prefill workers that may also host sessions, e.g. 2p6d-hybrid), Ndp (colocated, e.g.
    /// 4dp) or Nx (all-capable: every worker prefills for others, decodes and serves turns
    /// alone, e.g. 4x); at most 4,096 workers in all (the routing policies' limit).
    #[arg(long, default_value = "1p3d")]
    pub(crate) topology: Topology,
    /// Whether the engines serve turns alone (local prefill), on or off, as vLLM instances of
    /// any role do: on declares it for every decode worker and for the prefill workers of
    /// -hybrid shapes; off models stock SGLang decode servers, which cannot. Only `kvc` plans
    /// such turns; other policies behave the same either way.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = on_off, action = clap::ArgAction::Set)]
    pub(crate) local_prefill: bool,
    /// Whether the trace's explicit session ends (`final`) are honoured, on or off: on, the
    /// router forgets an ended session once its last request is answered and its decode
    /// worker releases the session's KV; off, ended sessions stay until evicted or expired.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = on_off, action = clap::ArgAction::Set)]
    pub(crate) session_ends: bool,
    /// Routing policy (see `kvc-replay policies`).
    #[arg(long, default_value = "kvc")]
    pub(crate) policy: String,
    /// Prefill selection on P/D clusters: round-robin, d-health-aware or prefix-aware (default:
    /// the policy's).
    #[arg(long)]
    pub(crate) prefill_policy: Option<String>,
    /// Set a policy knob, KEY=VALUE (repeatable; VALUE is parsed as JSON, else as a string).
    #[arg(long = "knob", value_name = "KEY=VALUE")]
    pub(crate) knobs: Vec<String>,
    /// Divide trace time by this (10 = ten times faster than recorded).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) time_scale: f64,
    /// Most requests in flight at once.
    #[arg(long, default_value_t = 32)]
    pub(crate) concurrency: usize,
    /// Engine profile (TOML); default: the embedded Qwen3-30B-A3B on H100 profile.
    #[arg(long)]
    pub(crate) profile: Option<PathBuf>,
    /// Seed of the engine's iteration-time jitter.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Honour the recommended pause that routing decisions carry: on or off.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub(crate) backpressure: String,
    /// Decode-side eviction: idle-lru (idle sessions only) or tiered (idle, cold, then hot).
    #[arg(long, default_value = "idle-lru", value_parser = ["idle-lru", "tiered"])]
    pub(crate) eviction: String,
}

impl RunArgs {
    /// The config for `trace`: the policy counts blocks of the trace's size unless a
    /// `block-size` knob says otherwise.
    pub(crate) fn config_for(&self, trace: &kvc_replay::trace::Trace) -> Result<SimConfig> {
        self.config_for_block_size(trace.block_size())
    }

    /// The config for a trace of `block_size`-token blocks (see [`RunArgs::config_for`]).
    pub(crate) fn config_for_block_size(&self, block_size: BlockSize) -> Result<SimConfig> {
        let mut args = self.clone();
        let bs = block_size.tokens();
        if bs != kvc_core::DEFAULT_BLOCK_SIZE
            && !args.knobs.iter().any(|k| k.starts_with("block-size="))
        {
            args.knobs.push(format!("block-size={bs}"));
        }
        args.config()
    }

    /// The simulation config these options describe.
    pub(crate) fn config(&self) -> Result<SimConfig> {
        let policy = policy_config(&self.policy, self.prefill_policy.as_deref(), &self.knobs)?;
        let mut cfg = SimConfig::new(self.topology, policy);
        cfg.time_scale = self.time_scale;
        cfg.concurrency = self.concurrency;
        cfg.seed = self.seed;
        cfg.backpressure = self.backpressure == "on";
        cfg.local_prefill = self.local_prefill;
        cfg.session_ends = self.session_ends;
        cfg.eviction = match self.eviction.as_str() {
            "tiered" => EvictionMode::Tiered,
            _ => EvictionMode::IdleLru,
        };
        if let Some(p) = &self.profile {
            cfg.profile = Profile::load(p)?;
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Builds a policy config from a name, an optional prefill policy and `KEY=VALUE` knobs.
pub(crate) fn policy_config(
    name: &str,
    prefill: Option<&str>,
    knobs: &[String],
) -> Result<PolicyConfig> {
    let base = PolicyConfig::from_name(name)?;
    if prefill.is_none() && knobs.is_empty() {
        return Ok(base);
    }
    let mut value = serde_json::to_value(&base)?;
    let obj = value
        .as_object_mut()
        .context("policy config is not an object")?;
    let mut sets: Vec<(String, serde_json::Value)> = Vec::new();
    if let Some(p) = prefill {
        sets.push(("prefill".into(), serde_json::Value::String(p.into())));
    }
    for k in knobs {
        let (key, raw) = k
            .split_once('=')
            .with_context(|| format!("--knob `{k}`: expected KEY=VALUE"))?;
        let v =
            serde_json::from_str(raw).unwrap_or_else(|_| serde_json::Value::String(raw.to_owned()));
        sets.push((key.trim().to_owned(), v));
    }
    for (key, v) in sets {
        if !obj.contains_key(&key) {
            let known: Vec<&str> = obj
                .keys()
                .map(String::as_str)
                .filter(|k| *k != "policy")
                .collect();
            bail!(
                "policy `{name}` has no knob `{key}` (knobs: {})",
                known.join(", ")
            );
        }
        obj.insert(key, v);
    }
    serde_json::from_value(value).with_context(|| format!("invalid knob value for `{name}`"))
}

/// Runs `kvc-replay sim`.
pub(crate) fn run(args: Args) -> Result<()> {
    let mode = if args.quiet {
        ProgressMode::Quiet
    } else if args.progress {
        ProgressMode::Lines
    } else {
        ProgressMode::Bar
    };
    let (cfg, summary) = if args.in_memory {
        run_whole(&args, mode)?
    } else {
        match run_streamed(&args, mode)? {
            Some(done) => done,
            None => run_whole(&args, mode)?,
        }
    };
    print!("{}", output::summary_table(&[(label(&cfg), &summary)]));
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

/// The run with the trace read as it goes; `None` if the trace must be loaded whole.
fn run_streamed(args: &Args, mode: ProgressMode) -> Result<Option<(SimConfig, Summary)>> {
    let started = Instant::now();
    let opts = args.trace_opts.options();
    let cannot = || format!("cannot load trace {}", args.trace.display());
    let stream = TraceStream::open(&args.trace, &opts).with_context(cannot)?;
    let cfg = with_drains(
        args.run.config_for_block_size(opts.block_size)?,
        &args.drains,
    )?;
    // Parsed on a thread of its own while the simulation runs.
    let mut ahead = ReadAhead::new(stream).context("cannot start the trace reader thread")?;
    let result = output::stream_and_write(&mut ahead, &cfg, &args.out, mode);
    let stream = ahead.into_inner();
    let summary = match result {
        Ok(summary) => summary,
        Err(SimError::Source(e @ SourceError::NeedsWholeTrace { .. })) => {
            eprintln!("kvc-replay: {e}; loading the whole trace");
            return Ok(None);
        }
        Err(SimError::Source(SourceError::Trace(e))) => {
            return Err(anyhow::Error::from(e).context(cannot()));
        }
        Err(e) => return Err(e.into()),
    };
    report_skipped(&args.trace, stream.report());
    if !args.quiet {
        eprintln!(
            "kvc-replay: read {} requests in {} sessions from {} as the run went ({:.2} s)",
            stream.report().records,
            stream.sessions(),
            args.trace.display(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(Some((cfg, summary)))
}

/// The run with the whole trace loaded first.
fn run_whole(args: &Args, mode: ProgressMode) -> Result<(SimConfig, Summary)> {
    let trace = args.trace_opts.load(&args.trace, args.quiet)?;
    let cfg = with_drains(args.run.config_for(&trace)?, &args.drains)?;
    let summary = output::run_and_write(&trace, &cfg, &args.out, mode == ProgressMode::Quiet)?;
    Ok((cfg, summary))
}

/// `cfg` with the drains of `--drain WORKER@SECONDS` options, checked.
pub(crate) fn with_drains(mut cfg: SimConfig, drains: &[String]) -> Result<SimConfig> {
    if drains.is_empty() {
        return Ok(cfg);
    }
    let names = kvc_engine_sim::cluster::layout_names(&cfg.topology.layout(cfg.local_prefill));
    for d in drains {
        let (name, at) = d
            .split_once('@')
            .with_context(|| format!("--drain `{d}`: expected WORKER@SECONDS, e.g. d0@600"))?;
        let Some(slot) = names.iter().position(|n| n == name.trim()) else {
            bail!(
                "--drain `{d}`: topology {} has no worker `{}` (its workers: {})",
                cfg.topology,
                name.trim(),
                names.join(", ")
            );
        };
        let at_s: f64 = at
            .trim()
            .parse()
            .with_context(|| format!("--drain `{d}`: `{at}` is not a number of seconds"))?;
        cfg.drains.push(Drain {
            worker: kvc_core::WorkerId(slot as u32),
            at_s,
        });
    }
    cfg.validate()?;
    Ok(cfg)
}

/// A short label for a run: `1p3d+kvc-v2 ts1`.
pub(crate) fn label(cfg: &SimConfig) -> String {
    format!(
        "{}+{} ts{}",
        cfg.topology,
        cfg.policy.name(),
        cfg.time_scale
    )
}

/// Parses `on` or `off`.
fn on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("expected on or off, not `{other}`")),
    }
}
