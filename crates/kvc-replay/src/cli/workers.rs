//! `kvc-replay workers`: standalone simulated vLLM workers for any client.

use super::sim::RunArgs;
use anyhow::{Result, bail};
use kvc_core::{BlockSize, EngineKind, StateSource};
use kvc_replay::http::{
    RouterConfigTarget, ServeOptions, StandaloneOptions, WorkerOptions, serve_workers,
};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Options of `kvc-replay workers`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = WORKERS_AFTER_HELP)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) run: RunArgs,
    /// The HTTP API the workers speak (vLLM's OpenAI API with NixlConnector P/D).
    #[arg(long, default_value = "vllm", value_parser = ["vllm"])]
    pub(crate) engine: String,
    /// Serve worker i on 127.0.0.1:PORT+i (default: free ports).
    #[arg(long, value_name = "PORT")]
    pub(crate) base_port: Option<u16>,
    /// Wall time runs this many times faster than the engine model's time (1 = the modelled
    /// GPU's own speed).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) speedup: f64,
    /// Tokens per block of the workers' prefix caches; the router configuration written
    /// counts the same (the policy's `block-size` knob).
    #[arg(long, value_name = "TOKENS", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) block_size: u32,
    /// The request header naming a session (kvc-router sets it on every worker request of a
    /// session); a request without it is a session of its own.
    #[arg(long, default_value = "x-session-id")]
    pub(crate) session_header: String,
    /// Also show the workers as stock vLLM engines do: each serves vLLM-named Prometheus
    /// /metrics (on 127.0.0.1:--engine-base-port+i, or free ports) and publishes its KV-cache
    /// events over ZeroMQ; the router configuration written then reads those instead of
    /// snapshot files.
    #[arg(long)]
    pub(crate) kv_events: bool,
    /// With --kv-events: serve worker i's /metrics on 127.0.0.1:PORT+i.
    #[arg(long, value_name = "PORT", requires = "kv_events")]
    pub(crate) engine_base_port: Option<u16>,
    /// Model name the workers report (default: the engine profile's name).
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Directory of the workers' snapshot files (w<id>.snap), read by a router configured
    /// with them; default /dev/shm/kvc-workers (or the temp directory).
    #[arg(long)]
    pub(crate) snapshot_dir: Option<PathBuf>,
    /// Resident-session slots in each snapshot.
    #[arg(long, default_value_t = 512)]
    pub(crate) table_slots: usize,
    /// Once the workers serve, write their names, roles and URLs here (JSON).
    #[arg(long, value_name = "FILE")]
    pub(crate) ready_file: Option<PathBuf>,
    /// Once the workers serve, write a kvc-router configuration for them here (TOML), with
    /// the run's --policy and the addresses below.
    #[arg(long, value_name = "FILE")]
    pub(crate) write_router_config: Option<PathBuf>,
    /// The router's HTTP front, written into --write-router-config.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub(crate) router_http_listen: SocketAddr,
    /// The router's gRPC listener, written into --write-router-config.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub(crate) router_listen: SocketAddr,
    /// The router's /metrics listener, written into --write-router-config.
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub(crate) router_metrics_listen: SocketAddr,
    /// Stop after this many wall seconds (default: run until Ctrl-C or SIGTERM).
    #[arg(long, value_name = "SECONDS")]
    pub(crate) duration_s: Option<f64>,
}

const WORKERS_AFTER_HELP: &str = "\
Simulated vLLM workers (the simulator's engine model on a real clock) that serve ANY prompt
from any client, GPU-free: try kvc-router (or another router) with your own client.

Each worker serves on 127.0.0.1:
  POST /v1/completions       `prompt` (text or token ids), `max_tokens`, `stream`,
                             `stream_options.include_usage`
  POST /v1/chat/completions  `messages`, `max_completion_tokens` or `max_tokens`, `stream`
  POST /v1/messages          Anthropic Messages: `system`, `messages`, `max_tokens` (required),
                             `stream`; POST /v1/messages/count_tokens
  POST /v1/responses         OpenAI Responses: `instructions`, `input`, `max_output_tokens`,
                             `stream` (no `previous_response_id`)
  GET  /v1/models, /health, /server_info
  GET  /metrics              vLLM's names: load, pool, vllm:cache_config_info
  GET  /kv_event_sources     with --kv-events its KV-event publisher, else {} (none)
and, from a router, NixlConnector P/D: a prefill worker given
`kv_transfer_params.do_remote_decode` holds the prefilled request and answers the parameters a
decode worker given them (`do_remote_prefill`) pulls it by. A plain request to any worker is
served in full with its prefix cache: the blocks its session left there are reused. Answers
carry `usage.prompt_tokens_details.cached_tokens` (Messages: `usage.cache_read_input_tokens`;
Responses: `usage.input_tokens_details.cached_tokens`).

Prompts are tokenized with kvc-router's default rules (one token per whitespace-separated
word; a chat request's messages through its `<|role|>` template); the output length is
`max_completion_tokens`/`max_tokens`, else 128 (chat) or 16 (completions) tokens of `tok`.
Timing is the engine profile's (--profile), paced --speedup times faster than real time.
A session is named by --session-header; a second request of a session still in flight runs
as a session of its own. Options of replays (--time-scale, --concurrency, --backpressure)
have no effect here.

Example (the router in a second shell):
  kvc-replay workers --topology 1p3d --write-router-config kvc-router.toml
  kvc-router --config kvc-router.toml
  curl -s 127.0.0.1:8000/v1/chat/completions -H 'x-session-id: c1' \\
       -d '{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"hello\"}]}'";

fn default_snapshot_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm.join("kvc-workers")
    } else {
        std::env::temp_dir().join("kvc-workers")
    }
}

/// Runs `kvc-replay workers`.
pub(crate) fn run(args: Args) -> Result<()> {
    let Some(block_size) = BlockSize::new(args.block_size) else {
        bail!("--block-size must be at least 1");
    };
    let mut run = args.run.clone();
    if !run.knobs.iter().any(|k| k.starts_with("block-size=")) {
        run.knobs.push(format!("block-size={}", args.block_size));
    }
    let cfg = run.config()?;
    if matches!(
        cfg.topology,
        kvc_core::Topology::Hybrid { .. } | kvc_core::Topology::AllCapable { .. }
    ) {
        bail!(
            "simulated HTTP workers run NpMd and Ndp shapes, not {}",
            cfg.topology
        );
    }
    let duration = match args.duration_s {
        Some(s) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s)),
        Some(s) => bail!("--duration-s must be a positive number of seconds (got {s})"),
        None => None,
    };
    let snapshot_dir = args
        .snapshot_dir
        .clone()
        .unwrap_or_else(default_snapshot_dir);
    let opts = WorkerOptions {
        speedup: args.speedup,
        http_base_port: args.base_port,
        bootstrap_base_port: None,
        snapshot_dir,
        table_slots: args.table_slots,
        model: args
            .model
            .clone()
            .unwrap_or_else(|| cfg.profile.name.clone()),
        router_state: if args.kv_events {
            StateSource::Events
        } else {
            StateSource::Snapshot
        },
        engine_base_port: args.engine_base_port,
        engine: args.engine.parse::<EngineKind>()?,
        faults: Default::default(),
        pd_shim: false,
    };
    let standalone = StandaloneOptions {
        block_size,
        session_header: args.session_header.clone(),
    };
    let serve = ServeOptions {
        ready_file: args.ready_file.clone(),
        router_config: args
            .write_router_config
            .clone()
            .map(|path| RouterConfigTarget {
                path,
                http_listen: args.router_http_listen,
                listen: args.router_listen,
                metrics_listen: args.router_metrics_listen,
            }),
        duration,
    };
    serve_workers(&cfg, &opts, standalone, &serve)?;
    Ok(())
}
