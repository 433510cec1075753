//! `kvc-router`: an OpenAI-compatible HTTP front (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/responses`, `/v1/messages`) that routes each request of an agent session across
//! prefill/decode (or colocated) vLLM and SGLang workers, keeping a session's KV cache on a
//! decode worker; also a gRPC routing API (`kvc.v1.Router`), Prometheus `/metrics` and
//! Envoy's endpoint picker (ext_proc).
//!
//! Started in one line, `kvc-router --prefill URL --decode URL` (or `--worker URL` for
//! colocated engines, each repeatable) serves the HTTP front on `--host`:`--port`
//! (127.0.0.1:30000) with each engine's pool, block size, KV-event source and model read
//! from the engine itself (`kvc_router::flag_workers`).
//! With `--config FILE` (a TOML configuration, see `crates/kvc-router/examples/router.toml`)
//! the file's workers come first and the command line's are added after them; the other
//! flags override the file's keys. It serves until SIGTERM or SIGINT, then stops gracefully.
//! SIGHUP, or a change of the file's contents (checked every `--config-poll-ms`), re-reads the
//! file: what a running router can take (workers added and removed, each worker's `drained`)
//! is applied, the rest is logged as needing a restart, and a file that does not load changes
//! nothing. Once its listeners are bound it prints one line on stdout:
//! `kvc-router grpc=<addr> metrics=<addr|none> http=<addr|none> epp=<addr|none>`.
//!
//! `kvc-router check` (with the same flags) loads the configuration, asks each worker's engine
//! what it is (`kvc_router::check`), prints it with every problem and its fix, and exits 0
//! when all is well, 1 when a problem was found, 2 when the configuration does not load.
//!
//! Logs go to stderr, coloured only on a terminal; `--log-format json` writes one JSON object
//! per line (time, level, target, fields) for a log collector.
#![forbid(unsafe_code)]

use anyhow::Context as _;
use clap::Parser;
use kvc_core::EngineKind;
use kvc_policy::PolicyConfig;
use kvc_router::RouterConfig;
use kvc_router::flag_workers::FlagWorkers;
use std::io::{IsTerminal as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

/// The HTTP front's port when workers are given on the command line (the peers' default).
const DEFAULT_PORT: u16 = 30000;

/// kvc-router: an OpenAI-compatible HTTP front (chat/completions, completions, responses,
/// messages) that routes each request of an agent session across prefill/decode or colocated
/// vLLM and SGLang workers, sending a session's later turns straight to the decode worker that
/// still holds its KV cache. Also a gRPC routing API (kvc.v1.Router), Prometheus /metrics and
/// Envoy's endpoint picker.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvc-router",
    version,
    long_about = None,
    args_conflicts_with_subcommands = true,
    after_help = EXAMPLES
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

const EXAMPLES: &str = "\
Examples:
  kvc-router --prefill http://10.0.0.1:8000 --decode http://10.0.0.2:8000
      vLLM P/D engines behind the HTTP front on 127.0.0.1:30000; pool, block size, KV events
      and model read from each engine
  kvc-router --worker http://10.0.0.1:8000 --worker http://10.0.0.2:8000 --host 0.0.0.0
  kvc-router check --prefill http://10.0.0.1:8000 --decode http://10.0.0.2:8000
      what each engine says of itself, and every problem with its fix; exit 0, 1 or 2
  kvc-router --config router.toml";

#[derive(Debug, Clone, clap::Subcommand)]
enum Command {
    /// Check the configuration and every worker's engine, print what each says of itself and
    /// every problem with its fix, and exit: 0 all good, 1 a problem, 2 no configuration.
    ///
    /// The configuration is loaded as the router loads it (the file, then the flags); each
    /// engine is asked, within --timeout-ms per call, for its model (/v1/models), KV pool,
    /// block size and prefix caching (/metrics), KV-event source and replay (configured, or
    /// /kv_event_sources), whether its answers count cached prompt tokens (one request of one
    /// token) and its P/D role (/server_info, where it says it).
    Check(CheckArgs),
}

#[derive(Debug, Clone, clap::Args)]
struct CheckArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Deadline of each call to an engine, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Check")]
    timeout_ms: u64,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines, coloured on a terminal only.
    Text,
    /// One JSON object per line: timestamp, level, target, fields.
    Json,
}

#[derive(Debug, Clone, clap::Args)]
struct RunArgs {
    /// A prefill worker's HTTP URL (`http://host:port`), repeatable: its engine (--engine) is
    /// asked for the rest.
    #[arg(long, value_name = "URL", value_parser = worker_url, help_heading = "Workers")]
    prefill: Vec<String>,

    /// A decode worker's HTTP URL, repeatable.
    #[arg(long, value_name = "URL", value_parser = worker_url, help_heading = "Workers")]
    decode: Vec<String>,

    /// A colocated worker's HTTP URL (it prefills and decodes), repeatable.
    #[arg(long, value_name = "URL", value_parser = worker_url, help_heading = "Workers")]
    worker: Vec<String>,

    /// The engine behind --prefill, --decode and --worker URLs: vllm or sglang [default:
    /// vllm].
    #[arg(long, value_name = "ENGINE", help_heading = "Workers")]
    engine: Option<EngineKind>,

    /// The KV pool of each --prefill, --decode and --worker engine, in tokens (default: read
    /// from vLLM's /metrics; required for SGLang).
    #[arg(long, value_name = "TOKENS", value_parser = clap::value_parser!(u64).range(1..), help_heading = "Workers")]
    capacity_tokens: Option<u64>,

    /// The HTTP front's address [default: 127.0.0.1, or the file's http-listen host].
    #[arg(
        long,
        value_name = "ADDR",
        conflicts_with = "http_listen",
        help_heading = "HTTP front"
    )]
    host: Option<IpAddr>,

    /// The HTTP front's port; 0 picks a free one [default: 30000, or the file's http-listen
    /// port]. Workers given on the command line turn the front on.
    #[arg(
        long,
        value_name = "PORT",
        conflicts_with = "http_listen",
        help_heading = "HTTP front"
    )]
    port: Option<u16>,

    /// HTTP front listen address (overrides `http-listen`; port 0 picks a free port).
    /// Workers get requests at their `http-url`.
    #[arg(long, value_name = "ADDR", help_heading = "HTTP front")]
    http_listen: Option<SocketAddr>,

    /// Hugging Face `tokenizer.json` for text prompts of the HTTP front (overrides
    /// `http.tokenizer`; without either, text is split on whitespace).
    #[arg(long, value_name = "FILE", help_heading = "HTTP front")]
    tokenizer: Option<PathBuf>,

    /// TOML configuration file (listen addresses, workers, policy and knobs, session limits,
    /// state and request limits, bearer tokens and TLS per listener). Without it, the
    /// defaults are used: no workers but the command line's, 127.0.0.1:50051 and
    /// 127.0.0.1:9464.
    #[arg(long, short = 'c', value_name = "FILE", help_heading = "Configuration")]
    config: Option<PathBuf>,

    /// Routing policy by name, with its default knobs (overrides the `[policy]` table):
    /// round-robin, cache-aware, kv-aware-v0, kvc-v2 or kvc.
    #[arg(long, value_name = "NAME", help_heading = "Configuration")]
    policy: Option<String>,

    /// gRPC listen address (overrides `listen`; port 0 picks a free port).
    #[arg(
        long,
        value_name = "ADDR",
        help_heading = "gRPC, metrics, endpoint picker"
    )]
    listen: Option<SocketAddr>,

    /// Prometheus /metrics listen address (overrides `metrics-listen`; port 0 picks a free port).
    #[arg(
        long,
        value_name = "ADDR",
        conflicts_with = "no_metrics",
        help_heading = "gRPC, metrics, endpoint picker"
    )]
    metrics_listen: Option<SocketAddr>,

    /// Serve no /metrics endpoint.
    #[arg(long, help_heading = "gRPC, metrics, endpoint picker")]
    no_metrics: bool,

    /// Endpoint-picker listen address (overrides `epp-listen`; port 0 picks a free port):
    /// Envoy's ext_proc gRPC service with the health services `liveness` and `readiness`.
    #[arg(
        long,
        value_name = "ADDR",
        help_heading = "gRPC, metrics, endpoint picker"
    )]
    epp_listen: Option<SocketAddr>,

    /// Forget a session after this many milliseconds without a request (overrides
    /// `sessions.ttl-ms`).
    #[arg(long, value_name = "MS", help_heading = "Configuration")]
    session_ttl_ms: Option<u64>,

    /// Most sessions tracked; the least recently seen is forgotten beyond it (overrides
    /// `sessions.max`).
    #[arg(long, value_name = "N", help_heading = "Configuration")]
    max_sessions: Option<usize>,

    /// A worker whose state is older than this is out of rotation (overrides `stale-after-ms`).
    #[arg(long, value_name = "MS", help_heading = "Configuration")]
    stale_after_ms: Option<u64>,

    /// How often the configuration file is checked for a change, in milliseconds (a changed
    /// file is re-read as on SIGHUP: workers added and removed, each worker's `drained`
    /// applied, the rest reported as needing a restart); 0 checks only on SIGHUP.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 2000,
        help_heading = "Configuration"
    )]
    config_poll_ms: u64,

    /// Log filter in `tracing` env-filter syntax (default: `RUST_LOG`, else `info`).
    #[arg(long, value_name = "FILTER", help_heading = "Logs")]
    log: Option<String>,

    /// Log lines as text (coloured only when stderr is a terminal) or as JSON, one object per
    /// line with timestamp, level, target and fields.
    #[arg(long, value_name = "FORMAT", value_enum, default_value_t = LogFormat::Text, help_heading = "Logs")]
    log_format: LogFormat,
}

/// Reads a worker URL flag: `http://host:port[/prefix]`.
fn worker_url(s: &str) -> Result<String, String> {
    kvc_router::config::WorkerUrl::parse(s)
        .map(|_| s.to_owned())
        .map_err(|_| "not a worker URL (expected http://host:port[/prefix])".to_owned())
}

/// The configuration the flags describe: the file (or the defaults), the command line's
/// workers after its own, then the overrides; validated.
fn load(args: &RunArgs) -> anyhow::Result<RouterConfig> {
    let flag_workers = FlagWorkers {
        prefill: args.prefill.clone(),
        decode: args.decode.clone(),
        colocated: args.worker.clone(),
        engine: args.engine,
        capacity_tokens: args.capacity_tokens,
    };
    let mut cfg = match &args.config {
        Some(path) => {
            // With workers on the command line, the file is validated with them (below).
            let read = match flag_workers.is_empty() {
                true => RouterConfig::from_file(path),
                false => kvc_router::flag_workers::read_unvalidated(path),
            };
            match read {
                Ok(cfg) => cfg,
                // A read error names the file already.
                Err(e @ kvc_router::ConfigError::Read { .. }) => return Err(e.into()),
                Err(e) => anyhow::bail!("{}: {e}", path.display()),
            }
        }
        None => RouterConfig::default(),
    };
    if flag_workers.is_empty() && (args.engine.is_some() || args.capacity_tokens.is_some()) {
        anyhow::bail!(
            "--engine and --capacity-tokens apply to workers given with --prefill, --decode or \
             --worker, and none is"
        );
    }
    let added = flag_workers.add_to(&mut cfg)?;
    if let Some(a) = args.listen {
        cfg.listen = a;
    }
    if args.no_metrics {
        cfg.metrics_listen = None;
    } else if let Some(a) = args.metrics_listen {
        cfg.metrics_listen = Some(a);
    }
    if let Some(a) = args.http_listen {
        cfg.http_listen = Some(a);
    } else if args.host.is_some() || args.port.is_some() || (added > 0 && cfg.http_listen.is_none())
    {
        let host = args
            .host
            .or(cfg.http_listen.map(|a| a.ip()))
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let port = args
            .port
            .or(cfg.http_listen.map(|a| a.port()))
            .unwrap_or(DEFAULT_PORT);
        cfg.http_listen = Some(SocketAddr::new(host, port));
    }
    if let Some(a) = args.epp_listen {
        cfg.epp_listen = Some(a);
    }
    if let Some(t) = &args.tokenizer {
        cfg.http.tokenizer = Some(t.clone());
    }
    if let Some(p) = &args.policy {
        cfg.policy = PolicyConfig::from_name(p).with_context(|| format!("--policy `{p}`"))?;
    }
    if let Some(v) = args.session_ttl_ms {
        cfg.sessions.ttl_ms = v;
    }
    if let Some(v) = args.max_sessions {
        cfg.sessions.max_sessions = v;
    }
    if let Some(v) = args.stale_after_ms {
        cfg.stale_after_ms = v;
    }
    match (&args.config, cfg.validate()) {
        (_, Ok(())) => Ok(cfg),
        (Some(path), Err(e)) => anyhow::bail!("{}: {e}", path.display()),
        (None, Err(e)) => Err(e.into()),
    }
}

/// The files the router reads when it starts, before it binds anything (tokens, TLS
/// certificates and keys, the tokenizer, the workers' URLs), read as it reads them.
fn read_startup_files(cfg: &RouterConfig) -> anyhow::Result<()> {
    kvc_router::auth::Tokens::load(&cfg.auth)?;
    if let Some(tls) = &cfg.tls.http {
        kvc_router::tls::http_server_config(tls)?;
    }
    if let Some(tls) = &cfg.tls.grpc {
        kvc_router::tls::grpc_server_config(tls)?;
    }
    if cfg.http_listen.is_some() || cfg.epp_listen.is_some() {
        kvc_router::http::HttpOptions::from_config(&cfg.http).context("http front")?;
        kvc_router::http::WorkerEndpoints::from_config(cfg).context("http front")?;
    }
    Ok(())
}

/// Completes at the first SIGTERM or SIGINT. The handlers are installed when this is called
/// (within the runtime), not when the future is first polled: a signal sent as soon as the
/// router has said it is up stops it gracefully, never by the default action.
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate())
            .map_err(|e| tracing::warn!(error = %e, "cannot listen for SIGTERM"))
            .ok();
        let int = signal(SignalKind::interrupt())
            .map_err(|e| tracing::warn!(error = %e, "cannot listen for SIGINT"))
            .ok();
        async move {
            let wait = |s: Option<tokio::signal::unix::Signal>| async move {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = wait(term) => tracing::info!("SIGTERM: shutting down"),
                () = wait(int) => tracing::info!("SIGINT: shutting down"),
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Re-reads the configuration on every SIGHUP, and when the file's contents change (checked
/// every `--config-poll-ms`; a Kubernetes ConfigMap mounted as a file changes this way), for
/// the router's lifetime.
fn reload_on_change(
    cli: &RunArgs,
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

/// Logs to stderr in `args`' format and filter: text coloured only on a terminal (a pipe or
/// a file gets no escape codes), or JSON lines.
fn init_logs(args: &RunArgs) -> anyhow::Result<()> {
    let filter = match &args.log {
        Some(f) => tracing_subscriber::EnvFilter::try_new(f).context("invalid --log filter")?,
        None => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.with_ansi(false).json().init(),
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let run = match &cli.command {
        Some(Command::Check(check)) => &check.run,
        None => &cli.run,
    };
    if let Err(e) = init_logs(run) {
        eprintln!("kvc-router: {e:#}");
        return ExitCode::from(2);
    }
    let served = match &cli.command {
        Some(Command::Check(check)) => return run_check(check),
        None => serve(&cli.run),
    };
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvc-router: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `kvc-router check`: the configuration loaded (2 when it does not), the workers' engines
/// asked, the report printed (1 when it holds a problem).
fn run_check(args: &CheckArgs) -> ExitCode {
    let loaded = load(&args.run).and_then(|cfg| read_startup_files(&cfg).map(|()| cfg));
    let config = match loaded {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("kvc-router check: the configuration does not load: {e:#}");
            return ExitCode::from(2);
        }
    };
    let flag_workers = args.run.prefill.len() + args.run.decode.len() + args.run.worker.len();
    let from = match &args.run.config {
        Some(path) if flag_workers > 0 => format!("{} and the command line", path.display()),
        Some(path) => path.display().to_string(),
        None => "the command line".to_owned(),
    };
    let addr = |a: Option<SocketAddr>| a.map_or_else(|| "none".to_owned(), |a| a.to_string());
    println!(
        "kvc-router check: the configuration loads ({from}): {} worker(s), policy {}, \
         http={} grpc={} metrics={} epp={}",
        config.workers.len(),
        config.policy.name(),
        addr(config.http_listen),
        config.listen,
        addr(config.metrics_listen),
        addr(config.epp_listen),
    );
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvc-router check: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let timeout = std::time::Duration::from_millis(args.timeout_ms);
    let report = runtime.block_on(kvc_router::check::check_workers(&config, timeout));
    print!("{}", report.render());
    let _ = std::io::stdout().flush();
    match report.problem_count() {
        0 => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

/// Serves until SIGTERM or SIGINT.
fn serve(args: &RunArgs) -> anyhow::Result<()> {
    // The file as it was when loaded: a change made while the router starts is seen as one.
    let loaded = args.config.as_ref().and_then(|p| std::fs::read(p).ok());
    let config = load(args)?;
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
        reload_on_change(args, loaded, std::sync::Arc::clone(router.service()));
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
