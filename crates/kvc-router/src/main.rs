//! `kvc-router`: the kvc routing service (gRPC `kvc.v1.Router`, Prometheus `/metrics`).
//!
//! Reads a TOML configuration (see `crates/kvc-router/examples/router.toml`), applies the
//! command-line overrides, serves until SIGTERM or SIGINT, then stops gracefully. SIGHUP, or
//! a change of the file's contents (checked every `--config-poll-ms`), re-reads the file: what
//! a running router can take (workers added and removed, each worker's `drained`) is applied,
//! the rest is logged as needing a restart, and a file that does not load changes nothing.
//! Once both
//! listeners are bound it prints one line on stdout:
//! `kvc-router grpc=<addr> metrics=<addr|none> http=<addr|none> epp=<addr|none>`.
#![forbid(unsafe_code)]

use anyhow::Context as _;
use clap::Parser;
use kvc_policy::PolicyConfig;
use kvc_router::RouterConfig;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;

/// The kvc routing service: routes agent-session requests across prefill/decode workers from
/// live worker state, with a snapshot probe before every direct-to-D decision.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvc-router", version, about, long_about = None)]
struct Cli {
    /// TOML configuration file (listen addresses, workers, policy and knobs, session limits,
    /// state and request limits, bearer tokens and TLS per listener).
    /// Without it, the defaults are used: no workers, 127.0.0.1:50051 and 127.0.0.1:9464.
    #[arg(long, short = 'c', value_name = "FILE")]
    config: Option<PathBuf>,

    /// gRPC listen address (overrides `listen`; port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,

    /// Prometheus /metrics listen address (overrides `metrics-listen`; port 0 picks a free port).
    #[arg(long, value_name = "ADDR", conflicts_with = "no_metrics")]
    metrics_listen: Option<SocketAddr>,

    /// HTTP data-plane listen address (overrides `http-listen`; port 0 picks a free port).
    /// Workers get requests at their `http-url`.
    #[arg(long, value_name = "ADDR")]
    http_listen: Option<SocketAddr>,

    /// Endpoint-picker listen address (overrides `epp-listen`; port 0 picks a free port):
    /// Envoy's ext_proc gRPC service with the health services `liveness` and `readiness`.
    #[arg(long, value_name = "ADDR")]
    epp_listen: Option<SocketAddr>,

    /// Hugging Face `tokenizer.json` for text prompts of the HTTP front (overrides
    /// `http.tokenizer`; without either, text is split on whitespace).
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,

    /// Serve no /metrics endpoint.
    #[arg(long)]
    no_metrics: bool,

    /// Routing policy by name, with its default knobs (overrides the `[policy]` table):
    /// round-robin, cache-aware, kv-aware-v0, kvc-v2 or kvc.
    #[arg(long, value_name = "NAME")]
    policy: Option<String>,

    /// Forget a session after this many milliseconds without a request (overrides
    /// `sessions.ttl-ms`).
    #[arg(long, value_name = "MS")]
    session_ttl_ms: Option<u64>,

    /// Most sessions tracked; the least recently seen is forgotten beyond it (overrides
    /// `sessions.max`).
    #[arg(long, value_name = "N")]
    max_sessions: Option<usize>,

    /// A worker whose state is older than this is out of rotation (overrides `stale-after-ms`).
    #[arg(long, value_name = "MS")]
    stale_after_ms: Option<u64>,

    /// How often the configuration file is checked for a change, in milliseconds (a changed
    /// file is re-read as on SIGHUP: workers added and removed, each worker's `drained`
    /// applied, the rest reported as needing a restart); 0 checks only on SIGHUP.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    config_poll_ms: u64,

    /// Log filter in `tracing` env-filter syntax (default: `RUST_LOG`, else `info`).
    #[arg(long, value_name = "FILTER")]
    log: Option<String>,
}

fn load(cli: &Cli) -> anyhow::Result<RouterConfig> {
    let mut cfg = match &cli.config {
        Some(path) => RouterConfig::from_file(path)?,
        None => RouterConfig::default(),
    };
    if let Some(a) = cli.listen {
        cfg.listen = a;
    }
    if cli.no_metrics {
        cfg.metrics_listen = None;
    } else if let Some(a) = cli.metrics_listen {
        cfg.metrics_listen = Some(a);
    }
    if let Some(a) = cli.http_listen {
        cfg.http_listen = Some(a);
    }
    if let Some(a) = cli.epp_listen {
        cfg.epp_listen = Some(a);
    }
    if let Some(t) = &cli.tokenizer {
        cfg.http.tokenizer = Some(t.clone());
    }
    if let Some(p) = &cli.policy {
        cfg.policy = PolicyConfig::from_name(p)?;
    }
    if let Some(v) = cli.session_ttl_ms {
        cfg.sessions.ttl_ms = v;
    }
    if let Some(v) = cli.max_sessions {
        cfg.sessions.max_sessions = v;
    }
    if let Some(v) = cli.stale_after_ms {
        cfg.stale_after_ms = v;
    }
    cfg.validate()?;
    Ok(cfg)
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                    _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; SIGINT only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Re-reads the configuration on every SIGHUP, and when the file's contents change (checked
/// every `--config-poll-ms`; a Kubernetes ConfigMap mounted as a file changes this way), for
/// the router's lifetime.
fn reload_on_change(
    cli: &Cli,
    loaded: Option<Vec<u8>>,
    service: std::sync::Arc<kvc_router::RouterService>,
) {
    let Some(path) = cli.config.clone() else {
        return;
    };
    let cli = cli.clone();
    let mut seen = loaded;
    // Installed before the router says it is up: a SIGHUP from then on is a reload, never
    // the default action (ending the process).
    #[cfg(unix)]
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(|e| tracing::warn!(error = %e, "cannot listen for SIGHUP"))
        .ok();
    tokio::spawn(async move {
        let mut poll = (cli.config_poll_ms > 0).then(|| {
            let mut t = tokio::time::interval(std::time::Duration::from_millis(cli.config_poll_ms));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        loop {
            #[cfg(unix)]
            let hup_signal = async {
                match hup.as_mut() {
                    Some(h) => h.recv().await,
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let hup_signal = std::future::pending::<Option<()>>();
            let tick = async {
                match poll.as_mut() {
                    Some(t) => t.tick().await,
                    None => std::future::pending().await,
                }
            };
            let why = tokio::select! {
                s = hup_signal => match s {
                    Some(()) => "SIGHUP",
                    None => return,
                },
                _ = tick => {
                    let now = std::fs::read(&path).ok();
                    if now.is_none() || now == seen {
                        continue;
                    }
                    seen = now;
                    "the file changed"
                }
            };
            if why == "SIGHUP" {
                seen = std::fs::read(&path).ok();
            }
            match load(&cli) {
                Ok(cfg) => {
                    let report = service.reload(&cfg);
                    for line in &report.applied {
                        tracing::info!("{why}: {}: {line}", path.display());
                    }
                    for line in &report.needs_restart {
                        tracing::warn!("{why}: {}: {line}", path.display());
                    }
                    if report.applied.is_empty() && report.needs_restart.is_empty() {
                        tracing::info!("{why}: {}: nothing changed", path.display());
                    }
                }
                Err(e) => tracing::error!(
                    "{why}: {} not applied (the running configuration stays): {e:#}",
                    path.display()
                ),
            }
        }
    });
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = match &cli.log {
        Some(f) => tracing_subscriber::EnvFilter::try_new(f).context("invalid --log filter")?,
        None => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    // The file as it was when loaded: a change made while the router starts is seen as one.
    let loaded = cli.config.as_ref().and_then(|p| std::fs::read(p).ok());
    let config = load(&cli)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    runtime.block_on(async move {
        let router = kvc_router::serve(config, shutdown_signal()).await?;
        let metrics = router
            .metrics_addr()
            .map_or_else(|| "none".to_owned(), |a| a.to_string());
        let http = router
            .http_addr()
            .map_or_else(|| "none".to_owned(), |a| a.to_string());
        let epp = router
            .epp_addr()
            .map_or_else(|| "none".to_owned(), |a| a.to_string());
        reload_on_change(&cli, loaded, std::sync::Arc::clone(router.service()));
        let mut out = std::io::stdout().lock();
        writeln!(
            out,
            "kvc-router grpc={} metrics={metrics} http={http} epp={epp}",
            router.grpc_addr()
        )?;
        out.flush()?;
        drop(out);
        router.wait().await?;
        anyhow::Ok(())
    })
}
