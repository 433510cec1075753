//! `kvc-replay live`: replay a trace through a real `kvc-router` in front of simulated workers
//! on a real clock.

use super::TraceArgs;
use super::sim::RunArgs;
use anyhow::{Result, bail};
use kvc_engine_sim::publish::engine_signals::EngineEndpoints;
use kvc_replay::http::{HttpLiveOptions, HttpRouter, WorkerOptions, live_http};
use kvc_replay::live::{LiveOptions, RouterTarget, live, router_config};
use kvc_replay::output::{summary_table, write_run};
use std::path::PathBuf;
use std::time::Duration;

/// Options of `kvc-replay live`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["router", "spawn_router", "write_router_config", "http_router"])))]
pub(crate) struct Args {
    /// Trace file (JSONL).
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) trace_opts: TraceArgs,
    #[command(flatten)]
    pub(crate) run: RunArgs,
    /// Wall time runs this many times faster than the (time-scaled) trace.
    #[arg(long, default_value_t = 10.0)]
    pub(crate) speedup: f64,
    /// URI of a running kvc-router (e.g. http://127.0.0.1:50051) configured with this run's
    /// snapshot files (see --write-router-config).
    #[arg(long, value_name = "URI")]
    pub(crate) router: Option<String>,
    /// Start the kvc-router binary as a child process (loopback, the run's --policy); it is
    /// killed when the replay ends.
    #[arg(long)]
    pub(crate) spawn_router: bool,
    /// With --spawn-router: the kvc-router binary to run (default: the one beside kvc-replay,
    /// else the first on PATH).
    #[arg(long, value_name = "PATH", requires = "spawn_router")]
    pub(crate) router_bin: Option<PathBuf>,
    /// Drive the router over HTTP: the simulated workers speak SGLang's HTTP API (P/D
    /// bootstrap handshake included; or vLLM's with --engine vllm) and each request is a
    /// /generate (or /v1/completions) call whose prompt text repeats where the trace's blocks
    /// repeat. With --spawn-router, the kvc-router binary is started with its HTTP front.
    #[arg(long)]
    pub(crate) http: bool,
    /// Drive the HTTP router at URL (e.g. http://127.0.0.1:8000; implies --http). Start it
    /// once --ready-file appears; the replay waits --connect-timeout-s for its GET /health.
    #[arg(long, value_name = "URL")]
    pub(crate) http_router: Option<String>,
    /// HTTP mode: serve worker i's HTTP API on 127.0.0.1:PORT+i (default: free ports).
    #[arg(long, value_name = "PORT")]
    pub(crate) http_base_port: Option<u16>,
    /// HTTP mode: serve prefill worker i's bootstrap server on 127.0.0.1:PORT+i (default:
    /// free ports).
    #[arg(long, value_name = "PORT")]
    pub(crate) bootstrap_base_port: Option<u16>,
    /// HTTP mode: once the workers serve, write their addresses, roles and bootstrap ports
    /// here (JSON; with --router-state events also their /metrics URLs and KV-event
    /// endpoints).
    #[arg(long, value_name = "FILE")]
    pub(crate) ready_file: Option<PathBuf>,
    /// HTTP mode: once the workers serve, write a kvc-router config for them here (TOML;
    /// HTTP front on 127.0.0.1:8000, gRPC on 127.0.0.1:50051, metrics on 127.0.0.1:9464).
    #[arg(long, value_name = "FILE")]
    pub(crate) http_router_config: Option<PathBuf>,
    /// HTTP mode: the HTTP API the simulated workers speak. `sglang`: SGLang's /generate with
    /// the P/D bootstrap handshake (each request a /generate call). `vllm`: vLLM's OpenAI
    /// routes with NixlConnector P/D (a prefill worker answers `kv_transfer_params` that a
    /// decode worker pulls the KV by; a plain request to any worker is served in full with its
    /// prefix cache; answers report `usage.prompt_tokens_details.cached_tokens`), each request
    /// a /v1/completions call, and the router config written sets `engine = "vllm"` on every
    /// worker.
    #[arg(long, default_value = "sglang", value_parser = ["sglang", "vllm"])]
    pub(crate) engine: String,
    /// HTTP mode with --engine vllm: each decode worker runs a decode-side P/D sidecar
    /// (llm-d's convention, for an endpoint picker behind Envoy): a request whose
    /// `x-prefiller-host-port: ip:port` header names a prefill worker is prefilled there
    /// first and then decoded with the pulled KV; without the header the decode worker serves
    /// the request alone.
    #[arg(long)]
    pub(crate) pd_sidecar: bool,
    /// HTTP mode: header carrying each request's session key.
    #[arg(long, default_value = "x-session-id")]
    pub(crate) session_header: String,
    /// HTTP mode: send no session header (the router must infer sessions).
    #[arg(long)]
    pub(crate) no_session_header: bool,
    /// HTTP mode: ask for whole answers instead of streams.
    #[arg(long)]
    pub(crate) no_stream: bool,
    /// HTTP mode: most wall seconds one request may take.
    #[arg(long, default_value_t = 600.0)]
    pub(crate) request_timeout_s: f64,
    /// HTTP mode: the router's name in the summary (default: the policy when spawned,
    /// `external` otherwise).
    #[arg(long)]
    pub(crate) router_label: Option<String>,
    /// Write the kvc-router config (TOML) matching this run's workers and snapshot files to
    /// FILE and exit; start the router with it, then run `live --router`.
    #[arg(long, value_name = "FILE")]
    pub(crate) write_router_config: Option<PathBuf>,
    /// gRPC address written into --write-router-config.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub(crate) router_listen: std::net::SocketAddr,
    /// Metrics address written into --write-router-config.
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub(crate) router_metrics_listen: std::net::SocketAddr,
    /// Directory of the workers' snapshot files (w<id>.snap); default /dev/shm/kvc-live (or the
    /// temp directory where /dev/shm does not exist).
    #[arg(long)]
    pub(crate) snapshot_dir: Option<PathBuf>,
    /// Serve each worker's kvc.v1.Worker service (State, CommitEvict) on 127.0.0.1:PORT+id
    /// (also written into --write-router-config). With --spawn-router, worker services are
    /// always served, on free ports.
    #[arg(long, value_name = "PORT")]
    pub(crate) worker_base_port: Option<u16>,
    /// Resident-session slots in each snapshot.
    #[arg(long, default_value_t = 512)]
    pub(crate) table_slots: usize,
    /// Where the router reads the workers' state: `snapshot` (their shared-memory snapshot
    /// files) or `events` (each worker shows its state as a stock vLLM engine does: Prometheus
    /// `/metrics` with vLLM's names and KV-cache events over ZeroMQ, and the router is
    /// configured with those and no snapshot; with --write-router-config only the /metrics
    /// endpoints can be written, the event sockets taking free ports at run time).
    #[arg(long, default_value = "snapshot", value_parser = ["snapshot", "events"])]
    pub(crate) router_state: String,
    /// With `--router-state events`: serve worker i's engine `/metrics` on 127.0.0.1:PORT+i
    /// (free ports otherwise, which only a router spawned here learns).
    #[arg(long, value_name = "PORT")]
    pub(crate) engine_base_port: Option<u16>,
    /// Seconds to wait for the router to answer before giving up.
    #[arg(long, default_value_t = 20.0)]
    pub(crate) connect_timeout_s: f64,
    /// Directory for metrics.jsonl, summary.json and occupancy.csv.
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// No progress output.
    #[arg(long, short)]
    pub(crate) quiet: bool,
}

fn default_snapshot_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm.join("kvc-live")
    } else {
        std::env::temp_dir().join("kvc-live")
    }
}

/// Runs `kvc-replay live`.
pub(crate) fn run(args: Args) -> Result<()> {
    let cfg = args.run.config()?;
    if matches!(
        cfg.topology,
        kvc_core::Topology::Hybrid { .. } | kvc_core::Topology::AllCapable { .. }
    ) {
        bail!(
            "live replays run NpMd and Ndp shapes: the router's configuration does not declare \
             worker capabilities, so {} has no live form (simulate it with `kvc-replay sim`)",
            cfg.topology
        );
    }
    let snapshot_dir = args
        .snapshot_dir
        .clone()
        .unwrap_or_else(default_snapshot_dir);
    if let Some(file) = &args.write_router_config {
        let n = kvc_replay::sim::worker_roles(cfg.topology).len();
        let worker_addrs: Vec<std::net::SocketAddr> = args
            .worker_base_port
            .map(|b| {
                (0..n)
                    .map(|i| {
                        std::net::SocketAddr::from(([127, 0, 0, 1], b.saturating_add(i as u16)))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut rc = router_config(
            &cfg,
            &snapshot_dir,
            args.router_listen,
            Some(args.router_metrics_listen),
            &worker_addrs,
        );
        if args.router_state == "events" {
            let Some(base) = args.engine_base_port else {
                bail!("--router-state events with --write-router-config needs --engine-base-port");
            };
            // The engines' event sockets take free ports at run time: a config written ahead
            // names their /metrics only.
            let engines: Vec<EngineEndpoints> = (0..n)
                .map(|i| EngineEndpoints {
                    metrics_url: format!(
                        "http://127.0.0.1:{}/metrics",
                        base.saturating_add(i as u16)
                    ),
                    kv_events: String::new(),
                    kv_events_replay: String::new(),
                    kv_events_topic: String::new(),
                })
                .collect();
            rc = rc.with_engine_signals(&engines);
        }
        std::fs::write(file, rc.to_toml()?)?;
        eprintln!("wrote {}", file.display());
        return Ok(());
    }
    let (Some(trace_path), Some(out)) = (&args.trace, &args.out) else {
        bail!("--trace and --out are required to replay");
    };
    if !(args.connect_timeout_s.is_finite() && args.connect_timeout_s >= 0.0) {
        bail!("--connect-timeout-s must be a number of seconds ≥ 0");
    }
    let trace = args.trace_opts.load(trace_path, args.quiet)?;
    let cfg = args.run.config_for(&trace)?;
    if args.http || args.http_router.is_some() {
        return run_http(&args, &trace, &cfg, snapshot_dir, out);
    }
    let opts = LiveOptions {
        speedup: args.speedup,
        router: match &args.router {
            Some(uri) => RouterTarget::Address(uri.clone()),
            None => RouterTarget::Spawn {
                router_bin: args.router_bin.clone(),
            },
        },
        snapshot_dir,
        table_slots: args.table_slots,
        connect_timeout: Duration::from_secs_f64(args.connect_timeout_s),
        worker_base_port: args.worker_base_port,
        router_state: args.router_state.parse()?,
        engine_base_port: args.engine_base_port,
    };
    let quiet = args.quiet;
    let mut last = 0;
    let mut progress = |done: usize, total: usize| {
        if !quiet && done >= last + total.max(10) / 10 {
            last = done;
            eprintln!("kvc-replay live: {done}/{total} requests");
        }
    };
    let output = live(&trace, &cfg, &opts, &mut progress)?;
    write_run(&output, out)?;
    print!(
        "{}",
        summary_table(&[(format!("live {}", super::sim::label(&cfg)), &output.summary)])
    );
    eprintln!("wrote {}", out.display());
    Ok(())
}

fn seconds(name: &str, v: f64) -> Result<Duration> {
    if !(v.is_finite() && v >= 0.0) {
        bail!("{name} must be a number of seconds ≥ 0 (got {v})");
    }
    Ok(Duration::from_secs_f64(v))
}

/// `live --http` / `live --http-router URL`.
fn run_http(
    args: &Args,
    trace: &kvc_replay::trace::Trace,
    cfg: &kvc_replay::sim::SimConfig,
    snapshot_dir: PathBuf,
    out: &std::path::Path,
) -> Result<()> {
    let opts = HttpLiveOptions {
        router: match &args.http_router {
            Some(url) => HttpRouter::Url(url.clone()),
            None if args.spawn_router => HttpRouter::Spawn {
                router_bin: args.router_bin.clone(),
            },
            None => bail!("--http needs --spawn-router or --http-router URL"),
        },
        label: args.router_label.clone(),
        workers: WorkerOptions {
            speedup: args.speedup,
            http_base_port: args.http_base_port,
            bootstrap_base_port: args.bootstrap_base_port,
            snapshot_dir,
            table_slots: args.table_slots,
            model: cfg.profile.name.clone(),
            router_state: args.router_state.parse()?,
            engine_base_port: args.engine_base_port,
            engine: args.engine.parse()?,
            faults: Default::default(),
            pd_shim: args.pd_sidecar,
        },
        session_header: (!args.no_session_header).then(|| args.session_header.clone()),
        stream: !args.no_stream,
        connect_timeout: seconds("--connect-timeout-s", args.connect_timeout_s)?,
        request_timeout: seconds("--request-timeout-s", args.request_timeout_s)?,
        ready_file: args.ready_file.clone(),
        router_config_file: args.http_router_config.clone(),
    };
    let quiet = args.quiet;
    let mut last = 0;
    let mut progress = |done: usize, total: usize| {
        if !quiet && done >= last + total.max(10) / 10 {
            last = done;
            eprintln!("kvc-replay live: {done}/{total} requests");
        }
    };
    let output = live_http(trace, cfg, &opts, &mut progress)?;
    write_run(&output.run, out)?;
    let path = out.join("http.json");
    let mut text = serde_json::to_string_pretty(&output.report)?;
    text.push('\n');
    std::fs::write(&path, text)?;
    let mut csv = String::from("index,to_worker_ms,from_worker_ms\n");
    for a in &output.report.added_by_request {
        csv.push_str(&format!(
            "{},{:.3},{:.3}\n",
            a.index, a.to_worker_ms, a.from_worker_ms
        ));
    }
    std::fs::write(out.join("router_added.csv"), csv)?;
    print!(
        "{}",
        summary_table(&[(
            format!("http {} {}", output.report.router, cfg.topology),
            &output.run.summary
        )])
    );
    let a = &output.report.router_added;
    println!(
        "router added latency (wall ms, {} streamed requests): mean {:.3} p50 {:.3} p90 {:.3} p99 {:.3} max {:.3}",
        a.requests, a.mean_ms, a.p50_ms, a.p90_ms, a.p99_ms, a.max_ms
    );
    for e in &output.report.first_errors {
        eprintln!("  {e}");
    }
    eprintln!("wrote {}", out.display());
    Ok(())
}
