//! The `kvc-router` a replay drives, without linking it: the TOML configuration that matches a
//! replay's workers ([`RouterConfigFile`], the router's own schema for the keys a replay knows;
//! every other key takes the router's default), and the router binary run as a child process
//! ([`RouterProcess`]).

use super::LiveError;
use kvc_core::{EngineKind, WorkerRole};
use kvc_engine_sim::publish::engine_signals::{ENGINE_BLOCK_TOKENS, EngineEndpoints};
use kvc_policy::PolicyConfig;
use serde::Serialize;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The binary's file name on this platform.
const ROUTER_BIN: &str = if cfg!(windows) {
    "kvc-router.exe"
} else {
    "kvc-router"
};

/// A `kvc-router` configuration file (TOML, kebab-case keys) for a replay's workers.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct RouterConfigFile {
    /// gRPC listen address.
    pub listen: SocketAddr,
    /// Prometheus `/metrics` listen address; absent takes the router's default (a router
    /// started with `--no-metrics` serves none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
    /// The HTTP front's listen address; absent serves none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_listen: Option<SocketAddr>,
    /// The replay's policy and knobs (the `[policy]` table).
    pub policy: PolicyConfig,
    /// One `[[workers]]` entry per simulated worker.
    pub workers: Vec<ConfiguredWorker>,
}

/// One `[[workers]]` entry of a [`RouterConfigFile`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ConfiguredWorker {
    /// Worker id (its index in the replay).
    pub id: u32,
    /// Display name (`p0`, `d1` …, the replay's names).
    pub name: String,
    /// Role.
    pub role: WorkerRole,
    /// KV pool, tokens.
    pub capacity_tokens: u64,
    /// Its shared-memory snapshot file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<PathBuf>,
    /// Its `kvc.v1.Worker` service URI, when it serves one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Its SGLang-style HTTP server, when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_url: Option<String>,
    /// Its disaggregation bootstrap port (prefill workers of an HTTP replay).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// The stock engine it stands for (`vllm`), when declared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineKind>,
    /// Whether the router may plan turns it serves alone (`serve-alone`): written on prefill
    /// and decode workers declared a stock engine, from [`ConfiguredWorker::serves_alone`],
    /// so that the router sees the capabilities the simulator gives the same worker (a vLLM
    /// engine's default would let every worker serve alone).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serve_alone: Option<bool>,
    /// Whether the replay's worker serves turns alone (the simulator's layout of the
    /// topology with `--local-prefill`); not a router key.
    #[serde(skip)]
    pub serves_alone: bool,
    /// Where the router reads its engine's signals instead of a snapshot, when it does.
    #[serde(flatten)]
    pub signals: Option<ConfiguredSignals>,
}

/// A worker's engine signals in a [`ConfiguredWorker`]: its `metrics-url` and, when it
/// publishes them, its KV-cache events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ConfiguredSignals {
    /// Its engine `/metrics` URL.
    pub metrics_url: String,
    /// Its engine's KV-cache events.
    #[serde(flatten)]
    pub events: Option<ConfiguredEvents>,
}

/// A worker's KV-cache event sockets in a [`ConfiguredSignals`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ConfiguredEvents {
    /// The PUB endpoint.
    pub kv_events: String,
    /// The replay ROUTER endpoint.
    pub kv_events_replay: String,
    /// The topic of its events.
    pub kv_events_topic: String,
    /// Its engine's block size (the events' blocks).
    pub block_size: u32,
}

/// `serve-alone` for a prefill or decode worker, as the simulator lays it out; nothing for
/// a colocated one, which always serves alone.
fn declared_serve_alone(w: &ConfiguredWorker) -> Option<bool> {
    (w.role != WorkerRole::Colocated).then_some(w.serves_alone)
}

impl RouterConfigFile {
    /// The TOML text.
    pub fn to_toml(&self) -> Result<String, LiveError> {
        toml::to_string_pretty(self)
            .map_err(|e| LiveError::Invalid(format!("cannot write the router config: {e}")))
    }

    /// The same configuration with the HTTP front on `http_listen` and worker `i` at `urls[i]`
    /// (its HTTP URL and bootstrap port).
    pub fn with_http(mut self, http_listen: SocketAddr, urls: &[(String, Option<u16>)]) -> Self {
        self.http_listen = Some(http_listen);
        for (w, (url, bootstrap_port)) in self.workers.iter_mut().zip(urls) {
            w.http_url = Some(url.clone());
            w.bootstrap_port = *bootstrap_port;
        }
        self
    }

    /// The same configuration with every worker declared a stock `engine` (for the vLLM
    /// dialect: the router forwards in NixlConnector's two calls).
    pub fn with_engine(mut self, engine: EngineKind) -> Self {
        for w in &mut self.workers {
            w.engine = Some(engine);
            w.serve_alone = declared_serve_alone(w);
        }
        self
    }

    /// The same configuration with worker `i`'s state read from its simulated vLLM engine's
    /// signals at `engines[i]` (`/metrics` and, when given, KV-cache events) instead of its
    /// snapshot.
    pub fn with_engine_signals(mut self, engines: &[EngineEndpoints]) -> Self {
        for (w, e) in self.workers.iter_mut().zip(engines) {
            w.snapshot = None;
            w.engine = Some(EngineKind::Vllm);
            w.serve_alone = declared_serve_alone(w);
            w.signals = Some(ConfiguredSignals {
                metrics_url: e.metrics_url.clone(),
                events: (!e.kv_events.is_empty()).then(|| ConfiguredEvents {
                    kv_events: e.kv_events.clone(),
                    kv_events_replay: e.kv_events_replay.clone(),
                    kv_events_topic: e.kv_events_topic.clone(),
                    block_size: ENGINE_BLOCK_TOKENS as u32,
                }),
            });
        }
        self
    }
}

/// The `kvc-router` binary to run: `explicit` when given (it must exist), else the one beside
/// the running executable, else the first on `PATH`. The error names every place it looked.
pub fn find_router_binary(explicit: Option<&Path>) -> Result<PathBuf, LiveError> {
    if let Some(path) = explicit {
        return if path.is_file() {
            Ok(path.to_path_buf())
        } else {
            Err(LiveError::Router(format!(
                "no kvc-router binary at {} (--router-bin)",
                path.display()
            )))
        };
    }
    let mut looked = Vec::new();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        let beside = dir.join(ROUTER_BIN);
        if beside.is_file() {
            return Ok(beside);
        }
        looked.push(beside.display().to_string());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join(ROUTER_BIN);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    looked.push(format!(
        "every directory of PATH ({})",
        path.to_string_lossy()
    ));
    Err(LiveError::Router(format!(
        "cannot find the {ROUTER_BIN} binary; looked at {}. Build it (`cargo build -p kvc-router`) \
         or name it with --router-bin PATH",
        looked.join(" and ")
    )))
}

/// A `kvc-router` running as a child process, killed when dropped (on every exit of the
/// replay, error or not).
#[derive(Debug)]
pub struct RouterProcess {
    child: Child,
    grpc: SocketAddr,
    http: Option<SocketAddr>,
}

impl RouterProcess {
    /// Writes `config` to `config_path`, starts `binary` with it (no metrics listener), and
    /// waits at most `timeout` for the line it prints once every listener is bound.
    pub fn start(
        binary: &Path,
        config: &RouterConfigFile,
        config_path: &Path,
        timeout: Duration,
    ) -> Result<Self, LiveError> {
        std::fs::write(config_path, config.to_toml()?).map_err(|e| LiveError::Snapshot {
            path: config_path.display().to_string(),
            message: format!("cannot write: {e}"),
        })?;
        let mut child = Command::new(binary)
            .arg("--config")
            .arg(config_path)
            .args(["--no-metrics", "--log", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| LiveError::Router(format!("cannot start {}: {e}", binary.display())))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads the announcement, then drains whatever else the router prints.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next());
            for _ in lines {}
        });
        let mut process = RouterProcess {
            child,
            grpc: SocketAddr::from(([127, 0, 0, 1], 0)),
            http: None,
        };
        let line = match rx.recv_timeout(timeout) {
            Ok(Some(Ok(line))) => line,
            Ok(_) => {
                let status = process
                    .child
                    .wait()
                    .map_or_else(|e| format!("cannot be waited for: {e}"), |s| s.to_string());
                return Err(LiveError::Router(format!(
                    "{} exited before it was ready ({status})",
                    binary.display()
                )));
            }
            Err(_) => {
                return Err(LiveError::Router(format!(
                    "{} did not announce its listeners within {:.0} s",
                    binary.display(),
                    timeout.as_secs_f64()
                )));
            }
        };
        let field = |key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .and_then(|a| a.parse::<SocketAddr>().ok())
        };
        process.grpc = field("grpc=").ok_or_else(|| {
            LiveError::Router(format!("unexpected announcement from the router: {line:?}"))
        })?;
        process.http = field("http=");
        Ok(process)
    }

    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc
    }

    /// The bound HTTP front address, if it serves one.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
