//! `kvc-replay live`: replay a trace through a real `kvc-router` in front of simulated workers
//! on a real clock.

use super::TraceArgs;
use super::sim::RunArgs;
use anyhow::{Result, bail};
use kvc_replay::live::{LiveOptions, RouterTarget, live, router_config};
use kvc_replay::output::{summary_table, write_run};
use std::path::PathBuf;
use std::time::Duration;

/// Options of `kvc-replay live`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["router", "spawn_router", "write_router_config"])))]
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
    /// Start a kvc-router inside this process (loopback, the run's --policy).
    #[arg(long)]
    pub(crate) spawn_router: bool,
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
        let rc = router_config(
            &cfg,
            &snapshot_dir,
            args.router_listen,
            Some(args.router_metrics_listen),
            &worker_addrs,
        );
        let text = toml::to_string_pretty(&rc)?;
        std::fs::write(file, text)?;
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
    let opts = LiveOptions {
        speedup: args.speedup,
        router: match &args.router {
            Some(uri) => RouterTarget::Address(uri.clone()),
            None => RouterTarget::Spawn,
        },
        snapshot_dir,
        table_slots: args.table_slots,
        connect_timeout: Duration::from_secs_f64(args.connect_timeout_s),
        worker_base_port: args.worker_base_port,
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
