//! The router configuration: TOML (kebab-case keys) read straight into these types, then
//! checked by one `validate()` per type.

use crate::error::ConfigError;
use kvc_core::{Capabilities, EngineKind, WorkerId, WorkerRole};
use kvc_policy::{MAX_WORKERS, PolicyConfig};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Everything the router needs to run. Keys are kebab-case; absent keys take the documented
/// defaults; unknown keys are errors.
///
/// ```
/// use kvc_router::RouterConfig;
///
/// let cfg = RouterConfig::from_toml_str(r#"
///     listen = "127.0.0.1:0"
///     [policy]
///     policy = "kvc-v2"
///     hard-cap = 0.9
///     [[workers]]
///     id = 0
///     role = "prefill"
///     capacity-tokens = 92000
///     address = "http://127.0.0.1:50061"
///     [[workers]]
///     id = 1
///     role = "decode"
///     capacity-tokens = 92000
///     snapshot = "/dev/shm/kvc-w1.snap"
/// "#)?;
/// assert_eq!(cfg.policy.name(), "kvc-v2");
/// assert_eq!(cfg.workers.len(), 2);
/// assert_eq!(cfg.sessions.max_sessions, 100_000);
/// # Ok::<(), kvc_router::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct RouterConfig {
    /// gRPC listen address (port 0 picks a free port). Default `127.0.0.1:50051`.
    pub listen: SocketAddr,
    /// Prometheus `/metrics` listen address; `None` serves no metrics. Default `127.0.0.1:9464`.
    pub metrics_listen: Option<SocketAddr>,
    /// HTTP data-plane listen address (the HTTP front, specified in `kvc_router::http`);
    /// `None` (the default) serves no HTTP front. Port 0 picks a free port.
    pub http_listen: Option<SocketAddr>,
    /// Endpoint-picker listen address: Envoy's ext_proc gRPC service and its health services
    /// (specified in `kvc_router::epp`); `None` (the default) serves no picker. Port 0 picks a
    /// free port.
    pub epp_listen: Option<SocketAddr>,
    /// The routing policy and its knobs (a table tagged by `policy`, see
    /// [`kvc_policy::PolicyConfig`]). Default `kvc` with its defaults.
    pub policy: PolicyConfig,
    /// Bounds of the session table.
    pub sessions: SessionLimits,
    /// A worker whose state is older than this is `stale` (out of rotation). Default 1,000 ms.
    pub stale_after_ms: u64,
    /// How often snapshot-backed worker views are re-read. Default 10 ms.
    pub refresh_interval_ms: u64,
    /// How often service-only workers are asked for their state. Default 200 ms.
    pub poll_interval_ms: u64,
    /// Deadline of each call to a worker service (connect, `State`, `CommitEvict`). Default
    /// 500 ms.
    pub rpc_timeout_ms: u64,
    /// Largest request message accepted, in bytes (encoded); larger ones are
    /// `INVALID_ARGUMENT`. Default 1 MiB.
    pub max_message_bytes: usize,
    /// Decisions awaiting `ReportOutcome` remembered at most; the oldest are dropped beyond it.
    /// Default 100,000.
    pub max_pending_decisions: usize,
    /// On shutdown, how long open connections may finish before they are closed. Default
    /// 5,000 ms.
    pub shutdown_grace_ms: u64,
    /// The HTTP data plane's settings (the `[http]` table): timeouts, connection pool,
    /// retries, circuit breakers, health checks, tokenizer, session inference.
    pub http: HttpConfig,
    /// How stock engines' own signals are read (the `[engine-signals]` table): `/metrics`
    /// scrape interval, deadline and staleness.
    pub engine_signals: EngineSignalsConfig,
    /// Bounds of the routing state and of a request's size (the `[limits]` table).
    pub limits: Limits,
    /// Bearer tokens of the listeners (the `[auth.http]` and `[auth.grpc]` tables).
    pub auth: crate::auth::AuthConfig,
    /// TLS of the listeners (the `[tls.http]` and `[tls.grpc]` tables).
    pub tls: crate::tls::TlsConfig,
    /// The workers (`[[workers]]`).
    pub workers: Vec<WorkerConfig>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            metrics_listen: Some(SocketAddr::from(([127, 0, 0, 1], 9464))),
            http_listen: None,
            epp_listen: None,
            policy: PolicyConfig::default(),
            sessions: SessionLimits::default(),
            stale_after_ms: kvc_admission::DEFAULT_STALE_AFTER_MS,
            refresh_interval_ms: 10,
            poll_interval_ms: 200,
            rpc_timeout_ms: 500,
            max_message_bytes: 1 << 20,
            max_pending_decisions: 100_000,
            shutdown_grace_ms: 5_000,
            http: HttpConfig::default(),
            engine_signals: EngineSignalsConfig::default(),
            limits: Limits::default(),
            auth: crate::auth::AuthConfig::default(),
            tls: crate::tls::TlsConfig::default(),
            workers: Vec::new(),
        }
    }
}

/// One setting per listener, a table with an `http` sub-table (the HTTP front) and a `grpc`
/// one (the gRPC control API), each optional: `[auth]` and `[tls]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct PerListener<T> {
    /// The HTTP front's (`[<table>.http]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http: Option<T>,
    /// The gRPC listener's (`[<table>.grpc]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc: Option<T>,
}

impl<T> Default for PerListener<T> {
    fn default() -> Self {
        PerListener {
            http: None,
            grpc: None,
        }
    }
}

/// Fails with "`name` must be positive" for the first zero value of `values`.
fn all_positive<'a>(values: impl IntoIterator<Item = (&'a str, u64)>) -> Result<(), ConfigError> {
    match values.into_iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => Err(ConfigError::Invalid(format!("{name} must be positive"))),
        None => Ok(()),
    }
}

/// How the router reads stock engines' own signals: the `[engine-signals]` table. Applies to
/// workers with `metrics-url` (state source `events`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct EngineSignalsConfig {
    /// How often each engine's `/metrics` is scraped. Default 100 ms.
    pub scrape_interval_ms: u64,
    /// Deadline of one scrape. Default 500 ms.
    pub scrape_timeout_ms: u64,
    /// An engine whose last good scrape is older than this is `stale` (out of rotation).
    /// Default 2,000 ms.
    pub stale_after_ms: u64,
}

impl Default for EngineSignalsConfig {
    fn default() -> Self {
        EngineSignalsConfig {
            scrape_interval_ms: 100,
            scrape_timeout_ms: 500,
            stale_after_ms: 2_000,
        }
    }
}

impl EngineSignalsConfig {
    /// Checks the `[engine-signals]` table: every interval and deadline positive.
    pub fn validate(&self) -> Result<(), ConfigError> {
        all_positive([
            ("engine-signals.scrape-interval-ms", self.scrape_interval_ms),
            ("engine-signals.scrape-timeout-ms", self.scrape_timeout_ms),
            ("engine-signals.stale-after-ms", self.stale_after_ms),
        ])
    }
}

/// The HTTP data plane's settings: the `[http]` table (the HTTP front's module doc,
/// `kvc_router::http`, says what each one does).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct HttpConfig {
    /// Deadline of each call to a worker (a streamed answer: its head, then each wait for
    /// more). Default 300,000 ms.
    pub request_timeout_ms: u64,
    /// Deadline of opening a connection to a worker (within the request's own deadline).
    /// Default 5,000 ms.
    pub connect_timeout_ms: u64,
    /// An idle pooled connection to a worker is closed after this long. Keep it below the
    /// workers' own keep-alive timeout (uvicorn's default is 5 s), so that the router does not
    /// reuse a connection the worker is closing. Default 4,000 ms.
    pub pool_idle_timeout_ms: u64,
    /// Idle connections kept open per worker for reuse; 0 opens a connection per call.
    /// Default 64.
    pub pool_max_idle_per_worker: usize,
    /// Times a request that failed before any byte reached the client is routed and
    /// forwarded again. Default 2, at most [`HttpConfig::MAX_RETRIES`].
    pub max_retries: u32,
    /// Wait before the first retry, doubled for each further one, with jitter. Default 25 ms.
    pub retry_backoff_ms: u64,
    /// Consecutive failures that open a worker's circuit breaker; 0 disables the breakers.
    /// Default 3.
    pub breaker_failures: u32,
    /// First cool-down of an open breaker, doubled on each re-opening. Default 1,000 ms.
    pub breaker_cooldown_ms: u64,
    /// Longest cool-down. Default 30,000 ms.
    pub breaker_max_cooldown_ms: u64,
    /// How often each worker's `GET /health` is checked; 0 disables the checks. Default
    /// 5,000 ms.
    pub health_check_interval_ms: u64,
    /// Deadline of one health check. Default 1,000 ms.
    pub health_check_timeout_ms: u64,
    /// A Hugging Face `tokenizer.json` for text prompts (block hashes and input lengths then
    /// match the engine's tokens); `None` (the default) uses the whitespace fallback. Loaded at
    /// startup (a relative path from the working directory): a file that cannot be read or
    /// used is a startup error naming it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// How many leading full blocks a request without a session key must share with a known
    /// session's latest prompt (ending exactly at that prompt's last full block) to continue
    /// it; 0 turns session inference off. Default 4.
    pub infer_min_blocks: u32,
    /// Longest session id the front accepts (the `x-session-id` header or
    /// `session_params.id`), in bytes; a longer one gets 400. Default 256.
    pub max_session_id_bytes: usize,
    /// Largest request body accepted, in bytes; a larger one gets 413. Default 16 MiB.
    pub max_body_bytes: usize,
    /// Largest request head (request line and headers), in bytes; a larger one gets 431 and
    /// the connection is closed. Default 64 KiB.
    pub max_header_bytes: usize,
    /// A request's head must be complete within this time of its first byte. Default
    /// 10,000 ms.
    pub header_read_timeout_ms: u64,
    /// A request's body must be complete within this time of its head; otherwise 408 and the
    /// connection is closed. Default 30,000 ms.
    pub body_read_timeout_ms: u64,
    /// A client connection with no request in progress (new, or kept alive after an answer)
    /// is closed when no byte of a new request arrives within this time. Default 60,000 ms.
    pub idle_timeout_ms: u64,
    /// Client connections served at once; further ones go to the overflow. Default 1,024.
    pub max_connections: usize,
    /// Connections past `max-connections` answered once each — `/health`, `/livez` and
    /// `/readyz` served, anything else 503 — then closed; past these too, a connection is
    /// closed without an answer. Default 32.
    pub overflow_connections: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            request_timeout_ms: 300_000,
            connect_timeout_ms: 5_000,
            pool_idle_timeout_ms: 4_000,
            pool_max_idle_per_worker: 64,
            max_retries: 2,
            retry_backoff_ms: 25,
            breaker_failures: 3,
            breaker_cooldown_ms: 1_000,
            breaker_max_cooldown_ms: 30_000,
            health_check_interval_ms: 5_000,
            health_check_timeout_ms: 1_000,
            tokenizer: None,
            infer_min_blocks: 4,
            max_session_id_bytes: 256,
            max_body_bytes: 16 << 20,
            max_header_bytes: 64 << 10,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            idle_timeout_ms: 60_000,
            max_connections: 1_024,
            overflow_connections: 32,
        }
    }
}

impl HttpConfig {
    /// Largest `max-retries` accepted.
    pub const MAX_RETRIES: u32 = 10;

    /// Smallest `max-header-bytes` accepted.
    pub const MIN_HEADER_BYTES: usize = 1_024;

    /// Checks the `[http]` table: positive deadlines and limits, `max-retries` in range, the
    /// breaker's longest cool-down at least its first, `max-header-bytes` at least
    /// [`HttpConfig::MIN_HEADER_BYTES`]. (The tokenizer file is loaded, and checked, when the
    /// HTTP front starts.)
    pub fn validate(&self) -> Result<(), ConfigError> {
        all_positive([
            ("http.request-timeout-ms", self.request_timeout_ms),
            ("http.connect-timeout-ms", self.connect_timeout_ms),
            ("http.pool-idle-timeout-ms", self.pool_idle_timeout_ms),
            ("http.health-check-timeout-ms", self.health_check_timeout_ms),
            ("http.header-read-timeout-ms", self.header_read_timeout_ms),
            ("http.body-read-timeout-ms", self.body_read_timeout_ms),
            ("http.idle-timeout-ms", self.idle_timeout_ms),
            (
                "http.max-session-id-bytes",
                self.max_session_id_bytes as u64,
            ),
            ("http.max-body-bytes", self.max_body_bytes as u64),
            ("http.max-connections", self.max_connections as u64),
        ])?;
        if self.max_header_bytes < Self::MIN_HEADER_BYTES {
            return Err(ConfigError::Invalid(format!(
                "http.max-header-bytes must be at least {}",
                Self::MIN_HEADER_BYTES
            )));
        }
        if self.max_retries > Self::MAX_RETRIES {
            return Err(ConfigError::Invalid(format!(
                "http.max-retries must be at most {}",
                Self::MAX_RETRIES
            )));
        }
        if self.breaker_max_cooldown_ms < self.breaker_cooldown_ms {
            return Err(ConfigError::Invalid(
                "http.breaker-max-cooldown-ms must be at least http.breaker-cooldown-ms".into(),
            ));
        }
        Ok(())
    }
}

/// Bounds of the router's session table: memory cannot grow without limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct SessionLimits {
    /// A session not seen for this long is forgotten. Default 600,000 ms (10 minutes).
    pub ttl_ms: u64,
    /// Most sessions tracked; beyond it the least recently seen is forgotten. Default 100,000.
    #[serde(rename = "max")]
    pub max_sessions: usize,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            ttl_ms: 600_000,
            max_sessions: 100_000,
        }
    }
}

impl SessionLimits {
    /// Checks the `[sessions]` table: both bounds positive.
    pub fn validate(&self) -> Result<(), ConfigError> {
        all_positive([
            ("sessions.ttl-ms", self.ttl_ms),
            ("sessions.max", self.max_sessions as u64),
        ])
    }
}

/// Bounds of the routing state and of a request (the `[limits]` table). The policy state's
/// tables and their cost per entry are in `docs/kvc-policy.md` ("Memory and cost"); the
/// decisions awaiting an outcome are bounded by `max-pending-decisions`, the sessions by
/// `[sessions]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct Limits {
    /// Blocks the policy's block view keeps per worker and view (40–60 bytes each); absent
    /// (the default): `pool-multiple` times the worker's `capacity-tokens` in blocks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocks_per_worker: Option<u32>,
    /// How many pools' worth of blocks the block view keeps per worker. Default 4.
    pub pool_multiple: u32,
    /// Leading blocks of a session's last request the router keeps (8 bytes each, per
    /// session); the rest are counted in `kvc_router_session_blocks_dropped_total`. Default
    /// 256 (131,072 tokens at the default 512-token block).
    pub max_session_blocks: u32,
    /// Largest `input_length` of a request, in tokens; larger ones are `INVALID_ARGUMENT`.
    /// Default 16,777,216.
    pub max_input_tokens: u64,
}

impl Default for Limits {
    fn default() -> Self {
        let policy = kvc_policy::StateBounds::default();
        Limits {
            blocks_per_worker: None,
            pool_multiple: policy.pool_multiple,
            max_session_blocks: policy.max_session_blocks,
            max_input_tokens: Limits::DEFAULT_MAX_INPUT_TOKENS,
        }
    }
}

impl Limits {
    /// The default `max-input-tokens`: 16 Mi tokens.
    pub const DEFAULT_MAX_INPUT_TOKENS: u64 = 1 << 24;

    /// Checks the `[limits]` table: every bound positive.
    pub fn validate(&self) -> Result<(), ConfigError> {
        all_positive([
            (
                "limits.blocks-per-worker",
                self.blocks_per_worker.map_or(1, u64::from),
            ),
            ("limits.pool-multiple", u64::from(self.pool_multiple)),
            (
                "limits.max-session-blocks",
                u64::from(self.max_session_blocks),
            ),
            ("limits.max-input-tokens", self.max_input_tokens),
        ])
    }

    /// The policy state's bounds: these, with `max_pending` decisions awaiting an outcome.
    pub fn state_bounds(&self, max_pending: usize) -> kvc_policy::StateBounds {
        kvc_policy::StateBounds {
            blocks_per_worker: self.blocks_per_worker,
            pool_multiple: self.pool_multiple,
            max_pending: u32::try_from(max_pending).unwrap_or(u32::MAX),
            max_session_blocks: self.max_session_blocks,
            ..kvc_policy::StateBounds::default()
        }
    }
}

/// One worker of the cluster (a `[[workers]]` entry). At least one of `snapshot`, `address`
/// and `metrics-url` is required; the state comes from the first of them present.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct WorkerConfig {
    /// Dense id, unique across roles, below [`kvc_policy::MAX_WORKERS`].
    pub id: u32,
    /// Display name (default `w<id>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `prefill`, `decode` or `colocated`.
    pub role: WorkerRole,
    /// Size of its KV pool in tokens (must match the snapshot header when there is one). May
    /// be left out (0) for an `engine = "vllm"` worker with `metrics-url`: its pool is then
    /// what the engine's `/metrics` reports (`vllm:cache_config_info`: `num_gpu_blocks` ×
    /// `block_size`), and the worker is out of rotation until a scrape has reported it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub capacity_tokens: u64,
    /// Its shared-memory snapshot file: state and probes are read from it, with no RPC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<PathBuf>,
    /// Its `kvc.v1.Worker` service (`http://host:port`): `CommitEvict` goes there, and its
    /// state is polled with `State` when it has no snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Base URL of its SGLang-style HTTP server for the HTTP data plane,
    /// `http://host:port[/prefix]` (see [`WorkerUrl`]); a worker without one gets no
    /// forwarded requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_url: Option<String>,
    /// The disaggregation bootstrap port of a prefill worker (the HTTP front's default is
    /// SGLang's, 8998); needs `http-url`; ignored for other roles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// Whether a decode worker's engine can append-prefill (decode-side prefill of a turn's
    /// new tokens): `None` when the key is absent, then [`WorkerConfig::can_append_prefill`]
    /// decides by `engine` (`false` for a stock SGLang decode server, which cannot serve a
    /// request without a bootstrap room; `true` otherwise). With `false` no decision sends it
    /// a direct-to-D turn: later turns of a session resident there go P→D with the
    /// fall-through reason `direct-unsupported`. Only decode workers may set `false`;
    /// `append-prefill = true` with `engine = "sglang"` declares a patched engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub append_prefill: Option<bool>,
    /// Whether the worker may serve a turn alone (`local-prefill`: it prefills what it does
    /// not hold of the prompt, decodes, and keeps the session): `None` when the key is
    /// absent, then [`WorkerConfig::capabilities`] decides by `engine` (`true` for a vLLM
    /// instance of either role, which serves a plain request in full; `false` otherwise).
    /// `true` is refused with `engine = "sglang"` (a stock SGLang prefill or decode server
    /// cannot serve a request without its partner) and on a colocated worker (which always
    /// serves alone). A prefill worker that serves alone also hosts sessions (`NpMd-hybrid`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serve_alone: Option<bool>,
    /// The stock engine serving this worker, `vllm` or `sglang`: which metric names its
    /// `/metrics` uses. Required with `metrics-url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineKind>,
    /// The engine's Prometheus endpoint, `http://host:port/metrics`: without a snapshot, the
    /// worker's load and pool use are scraped from it (state source `events`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_url: Option<String>,
    /// The engine's KV-cache event publisher (ZeroMQ PUB), `tcp://host:port` (or `ipc://path`
    /// for an engine on the same machine): the router indexes the blocks the engine stores and
    /// removes (which sessions are resident where). The engine must *bind* it: vLLM binds only
    /// a wildcard or ipc endpoint (`"endpoint": "tcp://*:5557"` in its `--kv-events-config`)
    /// and connects for `tcp://HOST:PORT`; the wildcard form is refused here (it is not an
    /// address to connect to). Needs `engine`, and `metrics-url` when there is no snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// The engine's event replay socket (ZeroMQ ROUTER), `tcp://host:port`: missed events are
    /// asked for again there; without it a gap resets the worker's index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// The topic the engine publishes its events under (default: every topic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_topic: Option<String>,
    /// The engine's KV block (page) size in tokens, for its events. Default: what its
    /// `/metrics` reports (vLLM's `cache_config_info`); required for SGLang.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
}

impl WorkerConfig {
    /// A worker with only the required keys: no name, snapshot, address or HTTP endpoint,
    /// append-prefill on.
    pub fn new(id: u32, role: WorkerRole, capacity_tokens: u64) -> Self {
        WorkerConfig {
            id,
            name: None,
            role,
            capacity_tokens,
            snapshot: None,
            address: None,
            http_url: None,
            bootstrap_port: None,
            append_prefill: None,
            serve_alone: None,
            engine: None,
            metrics_url: None,
            kv_events: None,
            kv_events_replay: None,
            kv_events_topic: None,
            block_size: None,
        }
    }

    /// The worker id.
    pub fn worker_id(&self) -> WorkerId {
        WorkerId(self.id)
    }

    /// Whether this worker may be sent a direct-to-D turn: `append-prefill` when set, else
    /// `false` for `engine = "sglang"` (a stock SGLang decode server answers 400 to a request
    /// without a bootstrap room) and `true` for anything else (vLLM serves a plain request
    /// in full with its prefix cache; kvc's own workers append-prefill).
    pub fn can_append_prefill(&self) -> bool {
        self.append_prefill
            .unwrap_or(self.engine != Some(EngineKind::Sglang))
    }

    /// What the worker's engine can do, for the policy's view of it
    /// ([`kvc_policy::WorkerView::with_caps`]): its role's own work
    /// ([`Capabilities::of_role`]) plus serving turns alone where `serve-alone` says so, or,
    /// without the key, where the engine is vLLM (any role). A worker without `engine` or
    /// `serve-alone` routes as before capabilities existed.
    pub fn capabilities(&self) -> Capabilities {
        let caps = Capabilities::of_role(self.role);
        if self.role == WorkerRole::Colocated {
            return caps;
        }
        match self
            .serve_alone
            .unwrap_or(self.engine == Some(EngineKind::Vllm))
        {
            true => caps.with_local(),
            false => caps,
        }
    }

    /// Whether the worker's pool size is read from its engine (`capacity-tokens` left out):
    /// a vLLM engine scraped through `metrics-url`, with no snapshot (whose header carries a
    /// pool size of its own).
    pub fn pool_from_engine(&self) -> bool {
        self.capacity_tokens == 0
            && self.engine == Some(EngineKind::Vllm)
            && self.metrics_url.is_some()
            && self.snapshot.is_none()
    }

    /// The display name.
    pub fn display_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| format!("w{}", self.id))
    }

    /// Checks this entry on its own: id in range, a snapshot or an address, a positive
    /// capacity, a service address that is a URI, an `http-url` of the form
    /// `http://host:port[/prefix]`, `bootstrap-port` only with `http-url`, `append-prefill =
    /// false` only on a decode worker.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let id = self.id;
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if id as usize >= MAX_WORKERS {
            return invalid(format!(
                "worker id {id} out of range (ids must be below {MAX_WORKERS})"
            ));
        }
        if self.snapshot.is_none() && self.address.is_none() && self.metrics_url.is_none() {
            return invalid(format!(
                "worker {id} needs a snapshot path, a service address or a metrics-url"
            ));
        }
        if let Some(url) = &self.metrics_url {
            if WorkerUrl::parse(url).is_err() {
                return invalid(format!(
                    "worker {id} metrics-url `{url}` is not http://host:port/path"
                ));
            }
            if self.engine.is_none() {
                return invalid(format!(
                    "worker {id}: `metrics-url` needs `engine` (`vllm` or `sglang`) to read it"
                ));
            }
        }
        self.validate_kv_events()?;
        if self.capacity_tokens == 0 && !self.pool_from_engine() {
            return invalid(format!(
                "worker {id} capacity-tokens must be positive (it may be left out only for an \
                 engine = \"vllm\" worker with a metrics-url and no snapshot: vLLM's /metrics \
                 reports its pool)"
            ));
        }
        if let Some(addr) = &self.address
            && addr.parse::<tonic::transport::Uri>().is_err()
        {
            return invalid(format!("worker {id} address `{addr}` is not a URI"));
        }
        match (&self.http_url, self.bootstrap_port) {
            (Some(url), _) if WorkerUrl::parse(url).is_err() => {
                return invalid(format!(
                    "worker {id} http-url `{url}` is not http://host:port[/prefix]"
                ));
            }
            (None, Some(_)) => {
                return invalid(format!("worker {id}: `bootstrap-port` needs `http-url`"));
            }
            _ => {}
        }
        if self.append_prefill == Some(false) && self.role != WorkerRole::Decode {
            return invalid(format!(
                "worker {id}: append-prefill applies to decode workers only (it is {})",
                self.role
            ));
        }
        if self.serve_alone.is_some() && self.role == WorkerRole::Colocated {
            return invalid(format!(
                "worker {id}: serve-alone applies to prefill and decode workers only \
                 (a colocated worker always serves its requests alone)"
            ));
        }
        if self.serve_alone == Some(true) && self.engine == Some(EngineKind::Sglang) {
            return invalid(format!(
                "worker {id}: serve-alone = true needs an engine that serves a plain request \
                 in full; a stock SGLang {} server cannot (engine = \"sglang\")",
                self.role
            ));
        }
        Ok(())
    }

    /// The `kv-events*` and `block-size` keys: endpoints `tcp://host:port`, the replay
    /// endpoint and topic only with `kv-events`, which needs `engine`, a source of load
    /// (`metrics-url` or a snapshot) and a block size (set, or read from vLLM's `/metrics`).
    fn validate_kv_events(&self) -> Result<(), ConfigError> {
        let id = self.id;
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        for (key, value) in [
            ("kv-events", &self.kv_events),
            ("kv-events-replay", &self.kv_events_replay),
        ] {
            if let Some(v) = value
                && !is_event_endpoint(v)
            {
                return invalid(format!(
                    "worker {id} {key} `{v}` is not tcp://host:port or ipc://path"
                ));
            }
        }
        if self.block_size == Some(0) {
            return invalid(format!("worker {id} block-size must be positive"));
        }
        if self.kv_events.is_none() {
            if self.kv_events_replay.is_some() || self.kv_events_topic.is_some() {
                return invalid(format!(
                    "worker {id}: `kv-events-replay` and `kv-events-topic` need `kv-events`"
                ));
            }
            return Ok(());
        }
        let Some(engine) = self.engine else {
            return invalid(format!(
                "worker {id}: `kv-events` needs `engine` (`vllm` or `sglang`)"
            ));
        };
        if self.metrics_url.is_none() && self.snapshot.is_none() {
            return invalid(format!(
                "worker {id}: `kv-events` needs `metrics-url` (or a snapshot) for the worker's load"
            ));
        }
        if self.block_size.is_none() && (engine == EngineKind::Sglang || self.metrics_url.is_none())
        {
            return invalid(format!(
                "worker {id}: `kv-events` needs `block-size` (only vLLM's /metrics reports it)"
            ));
        }
        Ok(())
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Whether `s` is an endpoint the router can connect an event socket to: `tcp://host:port`
/// with a non-empty host (not a wildcard: that is the engine's bind form, `tcp://*:5557`)
/// and a port, or `ipc://path` with a non-empty path (an engine on the same machine).
fn is_event_endpoint(s: &str) -> bool {
    if let Some(path) = s.strip_prefix("ipc://") {
        return !path.is_empty();
    }
    s.strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .is_some_and(|(host, port)| !host.is_empty() && host != "*" && port.parse::<u16>().is_ok())
}

/// SGLang's default disaggregation bootstrap port: a prefill worker's when its
/// `bootstrap-port` is absent.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// One kind of address of a worker, normalised (`None`: the worker has none).
type WorkerKey = fn(&WorkerConfig) -> Option<String>;

/// A worker as error messages name it: its id and display name.
fn worker_label(w: &WorkerConfig) -> String {
    format!("{} (`{}`)", w.id, w.display_name())
}

/// A worker's parsed HTTP base URL, `http://host[:port][/prefix]` (`https` is not supported).
///
/// ```
/// use kvc_router::config::WorkerUrl;
///
/// let u = WorkerUrl::parse("http://[::1]:30000/sglang/")?;
/// assert_eq!((u.host.as_str(), u.port, u.prefix.as_str()), ("::1", 30000, "/sglang"));
/// assert_eq!(u.authority(), "[::1]:30000");
/// assert!(WorkerUrl::parse("https://h:1").is_err());
/// # Ok::<(), String>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerUrl {
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// Port (80 when absent).
    pub port: u16,
    /// Path prefix without a trailing `/` (often empty).
    pub prefix: String,
}

impl WorkerUrl {
    /// Parses `http://host[:port][/prefix]`; the error is the text that is not one.
    pub fn parse(url: &str) -> Result<WorkerUrl, String> {
        let bad = || url.to_owned();
        let rest = url.strip_prefix("http://").ok_or_else(bad)?;
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or_else(bad)?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| bad())?,
                None if after.is_empty() => 80,
                None => return Err(bad()),
            };
            (host, port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, p.parse().map_err(|_| bad())?),
                None => (authority, 80),
            }
        };
        if host.is_empty() {
            return Err(bad());
        }
        let parsed = WorkerUrl {
            host: host.to_owned(),
            port,
            prefix: prefix.to_owned(),
        };
        // Every request URI built from it must be valid (no spaces, no query in the prefix).
        match parsed.uri("/").parse::<axum::http::Uri>() {
            Ok(u) if u.query().is_none() => Ok(parsed),
            _ => Err(bad()),
        }
    }

    /// `host:port`, with an IPv6 host in brackets.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The absolute URI of `path` (which starts with `/`) on this worker.
    pub fn uri(&self, path: &str) -> String {
        format!("http://{}{}{path}", self.authority(), self.prefix)
    }
}

impl RouterConfig {
    /// Parses and validates a TOML document.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let cfg: RouterConfig =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads, parses and validates a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml_str(&text)
    }

    /// Checks every value: the policy's knobs, positive limits and intervals, the `[http]`
    /// and `[sessions]` tables, each worker entry, worker ids unique, no two workers with
    /// the same name, service address, snapshot file, `http-url` or bootstrap server, and
    /// roles that can route (all colocated, or prefill and decode workers).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.policy
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        all_positive([
            ("stale-after-ms", self.stale_after_ms),
            ("refresh-interval-ms", self.refresh_interval_ms),
            ("poll-interval-ms", self.poll_interval_ms),
            ("rpc-timeout-ms", self.rpc_timeout_ms),
        ])?;
        self.sessions.validate()?;
        all_positive([
            ("max-message-bytes", self.max_message_bytes as u64),
            ("max-pending-decisions", self.max_pending_decisions as u64),
        ])?;
        self.http.validate()?;
        self.engine_signals.validate()?;
        self.limits.validate()?;
        self.auth.validate()?;
        self.tls.validate()?;
        let mut seen = HashSet::new();
        for w in &self.workers {
            if !seen.insert(w.id) {
                return Err(ConfigError::Invalid(format!(
                    "worker id {} appears twice",
                    w.id
                )));
            }
            w.validate()?;
        }
        self.validate_unique_addresses()?;
        self.validate_topology()
    }

    /// No two workers share a name, a service `address`, a `snapshot` file, an `http-url`, a
    /// `metrics-url`, a `kv-events` or `kv-events-replay` endpoint, or (prefill workers) a
    /// bootstrap server (host and `bootstrap-port`): each would be one worker counted twice,
    /// or two workers fighting over one file or port.
    fn validate_unique_addresses(&self) -> Result<(), ConfigError> {
        let keys: [(&str, WorkerKey); 8] = [
            ("name", |w| Some(w.display_name())),
            ("address", |w| {
                w.address
                    .as_ref()
                    .map(|a| a.trim_end_matches('/').to_ascii_lowercase())
            }),
            ("snapshot", |w| {
                w.snapshot
                    .as_ref()
                    .map(|p| p.components().collect::<PathBuf>().display().to_string())
            }),
            ("http-url", |w| {
                let url = WorkerUrl::parse(w.http_url.as_deref()?).ok()?;
                Some(format!(
                    "http://{}{}",
                    url.authority().to_ascii_lowercase(),
                    url.prefix
                ))
            }),
            ("metrics-url", |w| {
                w.metrics_url
                    .as_ref()
                    .map(|a| a.trim_end_matches('/').to_ascii_lowercase())
            }),
            ("kv-events endpoint", |w| {
                w.kv_events.as_ref().map(|a| a.to_ascii_lowercase())
            }),
            ("kv-events-replay endpoint", |w| {
                w.kv_events_replay.as_ref().map(|a| a.to_ascii_lowercase())
            }),
            ("bootstrap server", |w| {
                if w.role != WorkerRole::Prefill {
                    return None;
                }
                let url = WorkerUrl::parse(w.http_url.as_deref()?).ok()?;
                let port = w.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
                Some(format!("{}:{port}", url.host.to_ascii_lowercase()))
            }),
        ];
        for (what, key) in keys {
            let mut seen: std::collections::HashMap<String, &WorkerConfig> =
                std::collections::HashMap::new();
            for w in &self.workers {
                let Some(k) = key(w) else { continue };
                if let Some(first) = seen.insert(k.clone(), w) {
                    return Err(ConfigError::Invalid(format!(
                        "workers {} and {} have the same {what} `{k}`",
                        worker_label(first),
                        worker_label(w)
                    )));
                }
            }
        }
        Ok(())
    }

    /// The workers' roles describe a cluster the policies can route on — the rule of
    /// [`kvc_policy::ClusterView::topology`]: all colocated, or at least one prefill and one
    /// decode worker and no colocated one. (No worker at all is accepted: such a router
    /// answers every request as unavailable, and its readiness probe says so.)
    fn validate_topology(&self) -> Result<(), ConfigError> {
        if self.workers.is_empty() {
            return Ok(());
        }
        let views: Vec<kvc_policy::WorkerView> = self
            .workers
            .iter()
            .map(|w| {
                kvc_policy::WorkerView::new(
                    w.worker_id(),
                    w.role,
                    kvc_core::WorkerState::empty(w.capacity_tokens),
                )
                .with_caps(w.capabilities())
            })
            .collect();
        kvc_policy::ClusterView::new(0, &views)
            .topology()
            .map(|_| ())
            .map_err(|e| {
                let by_role = |role: WorkerRole| {
                    let listed: Vec<String> = self
                        .workers
                        .iter()
                        .filter(|w| w.role == role)
                        .map(worker_label)
                        .collect();
                    match listed.is_empty() {
                        true => format!("{role}: none"),
                        false => format!("{role}: {}", listed.join(", ")),
                    }
                };
                ConfigError::Invalid(format!(
                    "the workers cannot route: {e} ({}; {}; {})",
                    by_role(WorkerRole::Prefill),
                    by_role(WorkerRole::Decode),
                    by_role(WorkerRole::Colocated)
                ))
            })
    }

    /// The configured worker `id`.
    pub fn worker(&self, id: WorkerId) -> Option<&WorkerConfig> {
        self.workers.iter().find(|w| w.id == id.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_file_parses() {
        let text = include_str!("../examples/router.toml");
        let cfg = RouterConfig::from_toml_str(text).unwrap();
        assert_eq!(cfg.workers.len(), 4);
        assert_eq!(cfg.workers[3].engine, Some(EngineKind::Vllm));
        assert_eq!(
            cfg.workers[3].metrics_url.as_deref(),
            Some("http://127.0.0.1:30003/metrics")
        );
        assert_eq!(cfg.engine_signals, EngineSignalsConfig::default());
        assert_eq!(
            cfg.workers[3].kv_events.as_deref(),
            Some("tcp://127.0.0.1:5557")
        );
        assert_eq!(cfg.workers[3].block_size, None);
        assert_eq!(cfg.workers[0].role, WorkerRole::Prefill);
        assert_eq!(cfg.sessions.ttl_ms, 600_000);
        assert_eq!(cfg.policy.name(), "kvc");
        assert_eq!(
            cfg.http_listen,
            Some(SocketAddr::from(([127, 0, 0, 1], 8000)))
        );
        assert_eq!(cfg.http, HttpConfig::default());
        assert_eq!(cfg.http.infer_min_blocks, 4);
        assert_eq!(cfg.http.tokenizer, None);
        assert_eq!(cfg.http.max_retries, 2);
        assert!(cfg.workers.iter().all(|w| w.can_append_prefill()));
        assert!(cfg.workers.iter().all(|w| w.http_url.is_some()));
        assert_eq!(cfg.workers[0].bootstrap_port, Some(8998));
        assert_eq!(
            cfg.workers[1].http_url.as_deref(),
            Some("http://127.0.0.1:30001")
        );
        assert_eq!(cfg.workers[2].bootstrap_port, None);
        let url = WorkerUrl::parse(cfg.workers[0].http_url.as_deref().unwrap()).unwrap();
        assert_eq!(url.port, 30000);
        // The HTTP keys survive a round trip inline in `[[workers]]`.
        let text = toml::to_string(&cfg).unwrap();
        assert!(
            text.contains("http-url = \"http://127.0.0.1:30002\""),
            "{text}"
        );
        assert_eq!(RouterConfig::from_toml_str(&text).unwrap(), cfg);
    }

    #[test]
    fn http_keys_are_validated() {
        let worker = "[[workers]]\nid = 0\nrole = \"prefill\"\ncapacity-tokens = 10\nsnapshot = \"/p\"\n\
                      [[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/x\"\n";
        let cfg = RouterConfig::from_toml_str(worker).unwrap();
        assert_eq!(cfg.http_listen, None);
        assert!(cfg.workers.iter().all(|w| w.http_url.is_none()));
        for url in [
            "https://h:1",
            "http://:1",
            "http://h:x",
            "http://h/a b",
            "http://h/?q=1",
        ] {
            let bad_url = format!("{worker}http-url = \"{url}\"\n");
            let err = RouterConfig::from_toml_str(&bad_url).unwrap_err();
            assert!(
                matches!(err, ConfigError::Invalid(ref m) if m.contains("http-url") && m.contains("worker 1")),
                "{url}: {err}"
            );
        }
        let orphan_port = format!("{worker}bootstrap-port = 9000\n");
        let err = RouterConfig::from_toml_str(&orphan_port).unwrap_err();
        assert!(
            matches!(err, ConfigError::Invalid(ref m) if m.contains("needs `http-url`")),
            "{err}"
        );
        let bad_listen = format!("http-listen = \"nowhere\"\n{worker}");
        assert!(matches!(
            RouterConfig::from_toml_str(&bad_listen),
            Err(ConfigError::Parse(_))
        ));
        let unknown = format!("{worker}http-port = 1\n");
        assert!(matches!(
            RouterConfig::from_toml_str(&unknown),
            Err(ConfigError::Parse(_))
        ));
    }

    #[test]
    fn worker_urls_parse() {
        let u = WorkerUrl::parse("http://10.0.0.1:30000").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.prefix.as_str()),
            ("10.0.0.1", 30000, "")
        );
        assert_eq!(u.uri("/generate"), "http://10.0.0.1:30000/generate");
        let u = WorkerUrl::parse("http://h/p/").unwrap();
        assert_eq!((u.port, u.prefix.as_str()), (80, "/p"));
        assert_eq!(u.uri("/health"), "http://h:80/p/health");
        let u = WorkerUrl::parse("http://[fe80::1]").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("fe80::1", 80));
        for bad in ["http://[::1", "http://[::1]x", "ftp://h", "http://h:70000"] {
            assert_eq!(WorkerUrl::parse(bad), Err(bad.to_owned()));
        }
    }

    #[test]
    fn the_http_table_is_parsed_and_validated() {
        let cfg = RouterConfig::from_toml_str(
            "[http]\nmax-retries = 1\nbreaker-failures = 0\nhealth-check-interval-ms = 0\n\
             request-timeout-ms = 700\npool-max-idle-per-worker = 0\n",
        )
        .unwrap();
        assert_eq!(cfg.http.max_retries, 1);
        assert_eq!(
            cfg.http.retry_backoff_ms, 25,
            "absent keys take their defaults"
        );
        assert_eq!(cfg.http.breaker_failures, 0);
        assert_eq!(cfg.http.health_check_interval_ms, 0);
        assert_eq!(cfg.http.request_timeout_ms, 700);
        assert_eq!(cfg.http.pool_max_idle_per_worker, 0);
        assert_eq!(cfg.http.connect_timeout_ms, 5_000);
        for (text, key) in [
            ("[http]\nrequest-timeout-ms = 0\n", "request-timeout-ms"),
            ("[http]\nconnect-timeout-ms = 0\n", "connect-timeout-ms"),
            ("[http]\npool-idle-timeout-ms = 0\n", "pool-idle-timeout-ms"),
            (
                "[http]\nhealth-check-timeout-ms = 0\n",
                "health-check-timeout-ms",
            ),
            ("[http]\nmax-retries = 11\n", "max-retries"),
            (
                "[http]\nbreaker-cooldown-ms = 10\nbreaker-max-cooldown-ms = 5\n",
                "breaker-max-cooldown-ms",
            ),
        ] {
            let err = RouterConfig::from_toml_str(text).unwrap_err();
            assert!(
                matches!(err, ConfigError::Invalid(ref m) if m.contains(key)),
                "{text}: {err}"
            );
        }
        assert!(matches!(
            RouterConfig::from_toml_str("[http]\nretries = 1\n"),
            Err(ConfigError::Parse(_))
        ));
    }

    #[test]
    fn a_stock_sglang_decode_worker_gets_no_direct_turn_unless_declared() {
        let mut w = WorkerConfig::new(1, WorkerRole::Decode, 10);
        assert!(w.can_append_prefill(), "kvc's own workers append-prefill");
        w.engine = Some(EngineKind::Vllm);
        assert!(
            w.can_append_prefill(),
            "vLLM serves a plain request in full"
        );
        w.engine = Some(EngineKind::Sglang);
        assert!(
            !w.can_append_prefill(),
            "stock SGLang cannot serve without a room"
        );
        w.append_prefill = Some(true);
        assert!(w.can_append_prefill(), "a patched engine, declared");
        w.engine = Some(EngineKind::Vllm);
        w.append_prefill = Some(false);
        assert!(!w.can_append_prefill());
        // An SGLang prefill worker's default `false` is not a misplaced key.
        let mut p = WorkerConfig::new(0, WorkerRole::Prefill, 10);
        p.snapshot = Some("/p".into());
        p.engine = Some(EngineKind::Sglang);
        assert!(p.validate().is_ok());
    }

    #[test]
    fn serving_alone_defaults_from_the_engine_and_can_be_declared() {
        let caps = |role, engine, serve_alone| {
            let mut w = WorkerConfig::new(0, role, 10);
            w.engine = engine;
            w.serve_alone = serve_alone;
            w.capabilities()
        };
        let (p, d, c) = (
            WorkerRole::Prefill,
            WorkerRole::Decode,
            WorkerRole::Colocated,
        );
        let vllm = Some(EngineKind::Vllm);
        let sglang = Some(EngineKind::Sglang);
        // No engine, or SGLang: the role's own work only, as before capabilities existed.
        for role in [p, d, c] {
            assert_eq!(caps(role, None, None), Capabilities::of_role(role));
            assert_eq!(caps(role, sglang, None), Capabilities::of_role(role));
        }
        // vLLM of either role serves a plain request in full.
        for role in [p, d] {
            assert_eq!(
                caps(role, vllm, None),
                Capabilities::of_role(role).with_local()
            );
            assert_eq!(caps(role, vllm, Some(false)), Capabilities::of_role(role));
            assert_eq!(
                caps(role, None, Some(true)),
                Capabilities::of_role(role).with_local(),
                "kvc's own engine, declared"
            );
        }
        assert_eq!(caps(c, vllm, None), Capabilities::of_role(c));
    }

    #[test]
    fn serve_alone_is_refused_where_the_engine_cannot() {
        let base = "[[workers]]\nid = 0\nrole = \"prefill\"\ncapacity-tokens = 10\nsnapshot = \"/p\"\n\
                    [[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/d\"\n";
        let with = |extra: &str| RouterConfig::from_toml_str(&format!("{base}{extra}"));
        let cfg = with("engine = \"vllm\"\nserve-alone = false\n").unwrap();
        assert_eq!(cfg.workers[1].serve_alone, Some(false));
        assert!(!cfg.workers[1].capabilities().local);
        // It survives a round trip; an absent key is not written out.
        let out = toml::to_string(&cfg).unwrap();
        assert_eq!(out.matches("serve-alone").count(), 1, "{out}");
        assert_eq!(RouterConfig::from_toml_str(&out).unwrap(), cfg);
        assert!(with("engine = \"sglang\"\nserve-alone = false\n").is_ok());
        let err = with("engine = \"sglang\"\nserve-alone = true\n").unwrap_err();
        assert!(
            matches!(err, ConfigError::Invalid(ref m)
                if m.contains("serve-alone = true") && m.contains("stock SGLang decode")),
            "{err}"
        );
        let colocated = "[[workers]]\nid = 0\nrole = \"colocated\"\ncapacity-tokens = 10\n\
                         snapshot = \"/c\"\nserve-alone = true\n";
        let err = RouterConfig::from_toml_str(colocated).unwrap_err();
        assert!(
            matches!(err, ConfigError::Invalid(ref m) if m.contains("prefill and decode workers only")),
            "{err}"
        );
        assert!(matches!(
            with("serve-alone = \"yes\"\n"),
            Err(ConfigError::Parse(_))
        ));
    }

    #[test]
    fn append_prefill_is_a_decode_worker_key() {
        let text = "[[workers]]\nid = 0\nrole = \"prefill\"\ncapacity-tokens = 10\nsnapshot = \"/p\"\n\
                    [[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/d1\"\n\
                    append-prefill = false\n\
                    [[workers]]\nid = 2\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/d2\"\n\
                    append-prefill = true\n";
        let cfg = RouterConfig::from_toml_str(text).unwrap();
        let off: Vec<u32> = cfg
            .workers
            .iter()
            .filter(|w| !w.can_append_prefill())
            .map(|w| w.id)
            .collect();
        assert_eq!(off, [1]);
        // It survives a round trip; an absent key is not written out.
        let out = toml::to_string(&cfg).unwrap();
        assert_eq!(out.matches("append-prefill = false").count(), 1, "{out}");
        assert_eq!(out.matches("append-prefill").count(), 2, "{out}");
        assert_eq!(RouterConfig::from_toml_str(&out).unwrap(), cfg);
        // The policy state learns it.
        let svc = crate::RouterService::new(cfg).unwrap();
        assert!(
            !svc.config()
                .worker(WorkerId(1))
                .unwrap()
                .can_append_prefill()
        );
        let bad = text.replace(
            "snapshot = \"/p\"\n",
            "snapshot = \"/p\"\nappend-prefill = false\n",
        );
        let err = RouterConfig::from_toml_str(&bad).unwrap_err();
        assert!(
            matches!(err, ConfigError::Invalid(ref m) if m.contains("decode workers only") && m.contains("worker 0")),
            "{err}"
        );
    }

    #[test]
    fn tokenizer_and_inference_keys() {
        let cfg = RouterConfig::from_toml_str(
            "[http]\ntokenizer = \"/nowhere/tokenizer.json\"\ninfer-min-blocks = 0\n",
        )
        .unwrap();
        assert_eq!(
            cfg.http.tokenizer.as_deref(),
            Some(Path::new("/nowhere/tokenizer.json"))
        );
        assert_eq!(cfg.http.infer_min_blocks, 0);
        let text = toml::to_string(&cfg).unwrap();
        assert_eq!(RouterConfig::from_toml_str(&text).unwrap(), cfg);
        assert!(
            !toml::to_string(&RouterConfig::default())
                .unwrap()
                .contains("tokenizer")
        );
    }

    /// The message of the error `toml` is rejected with.
    fn error_of(toml: &str) -> String {
        RouterConfig::from_toml_str(toml).unwrap_err().to_string()
    }

    #[test]
    fn rejects_bad_configs() {
        let base = "[[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\n";
        // The same worker alone in a cluster that can route.
        let colocated = |toml: &str| toml.replace("\"decode\"", "\"colocated\"");
        assert!(error_of(base).contains("a snapshot path, a service address or a metrics-url"));
        let dup = format!("{base}snapshot = \"/x\"\n{base}snapshot = \"/y\"\n");
        assert!(error_of(&dup).contains("twice"));
        let scraped = format!("{base}metrics-url = \"http://127.0.0.1:8001/metrics\"\n");
        assert!(error_of(&scraped).contains("`metrics-url` needs `engine`"));
        let garbled = format!("{base}engine = \"vllm\"\nmetrics-url = \"tcp://h:1\"\n");
        assert!(error_of(&garbled).contains("metrics-url `tcp://h:1` is not"));
        let unknown_engine = format!("{scraped}engine = \"trt\"\n");
        assert!(matches!(
            RouterConfig::from_toml_str(&unknown_engine),
            Err(ConfigError::Parse(_))
        ));
        let events = format!(
            "{base}address = \"http://h:2\"\nengine = \"sglang\"\nkv-events = \"tcp://h:5557\"\n"
        );
        assert!(error_of(&events).contains("needs `metrics-url`"));
        let events = format!("{events}metrics-url = \"http://h:1/metrics\"\n");
        assert!(error_of(&events).contains("needs `block-size`"));
        let ok_events = format!("{events}block-size = 32\nkv-events-replay = \"tcp://h:5558\"\n");
        assert_eq!(
            RouterConfig::from_toml_str(&colocated(&ok_events))
                .unwrap()
                .workers[0]
                .block_size,
            Some(32)
        );
        let topic = format!("{ok_events}kv-events-topic = \"kv@pod@m\"\n");
        assert_eq!(
            RouterConfig::from_toml_str(&colocated(&topic))
                .unwrap()
                .workers[0]
                .kv_events_topic
                .as_deref(),
            Some("kv@pod@m")
        );
        let bad_endpoint = ok_events.replace("tcp://h:5557", "udp://h:5557");
        assert!(
            error_of(&bad_endpoint).contains("kv-events `udp://h:5557` is not tcp://host:port")
        );
        // The engine's bind form is not an address to connect to; an ipc path is.
        let wildcard = ok_events.replace("tcp://h:5557", "tcp://*:5557");
        assert!(error_of(&wildcard).contains("kv-events `tcp://*:5557` is not tcp://host:port"));
        let ipc = ok_events.replace("tcp://h:5557", "ipc:///run/vllm/events.sock");
        assert_eq!(
            RouterConfig::from_toml_str(&colocated(&ipc))
                .unwrap()
                .workers[0]
                .kv_events
                .as_deref(),
            Some("ipc:///run/vllm/events.sock")
        );
        assert!(error_of(&ok_events.replace("tcp://h:5557", "ipc://")).contains("ipc://path"));
        let orphan = format!("{scraped}engine = \"vllm\"\nkv-events-replay = \"tcp://h:1\"\n");
        assert!(error_of(&orphan).contains("need `kv-events`"));
        let vllm = format!("{scraped}engine = \"vllm\"\nkv-events = \"tcp://h:1\"\n");
        assert!(RouterConfig::from_toml_str(&colocated(&vllm)).is_ok());
        let ok = format!("{scraped}engine = \"sglang\"\n");
        let cfg = RouterConfig::from_toml_str(&colocated(&ok)).unwrap();
        assert_eq!(cfg.workers[0].engine, Some(EngineKind::Sglang));
        assert_eq!(cfg.engine_signals, EngineSignalsConfig::default());
        assert!(
            error_of(&format!("[engine-signals]\nscrape-interval-ms = 0\n{ok}"))
                .contains("engine-signals.scrape-interval-ms must be positive")
        );
        let unknown = "bogus = 1\n";
        assert!(matches!(
            RouterConfig::from_toml_str(unknown),
            Err(ConfigError::Parse(_))
        ));
        for key in [
            "stale-after-ms",
            "refresh-interval-ms",
            "poll-interval-ms",
            "rpc-timeout-ms",
            "max-message-bytes",
            "max-pending-decisions",
        ] {
            let err = RouterConfig::from_toml_str(&format!("{key} = 0\n")).unwrap_err();
            assert!(
                matches!(err, ConfigError::Invalid(ref m) if m == &format!("{key} must be positive")),
                "{key}: {err}"
            );
        }
        for (key, name) in [("ttl-ms", "sessions.ttl-ms"), ("max", "sessions.max")] {
            let err = RouterConfig::from_toml_str(&format!("[sessions]\n{key} = 0\n")).unwrap_err();
            assert!(err.to_string().contains(name), "{err}");
        }
        let policy = "[policy]\npolicy = \"kvc-v2\"\nhard-cap = 3.0\n";
        assert!(matches!(
            RouterConfig::from_toml_str(policy),
            Err(ConfigError::Invalid(_))
        ));
        let range =
            "[[workers]]\nid = 999\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/x\"\n";
        assert!(error_of(range).contains("out of range"));
        let capacity = format!("{}snapshot = \"/x\"\n", base.replace("10", "0"));
        assert!(error_of(&capacity).contains("worker 1 capacity-tokens must be positive"));
        // Left out: only where vLLM's /metrics reports the pool.
        let no_capacity = base.replace("capacity-tokens = 10\n", "");
        let scraped = "metrics-url = \"http://h:1/metrics\"\n";
        let vllm = format!("{no_capacity}engine = \"vllm\"\n{scraped}");
        let cfg = RouterConfig::from_toml_str(&vllm.replace("\"decode\"", "\"colocated\""));
        let cfg = cfg.unwrap();
        assert_eq!(cfg.workers[0].capacity_tokens, 0);
        assert!(cfg.workers[0].pool_from_engine());
        assert!(!toml::to_string(&cfg).unwrap().contains("capacity-tokens"));
        let sglang = format!("{no_capacity}engine = \"sglang\"\n{scraped}");
        assert!(error_of(&sglang).contains("capacity-tokens must be positive"));
        let snapshot = format!("{vllm}snapshot = \"/x\"\n");
        assert!(error_of(&snapshot).contains("may be left out only for an engine = \"vllm\""));
        let address = format!("{base}address = \"not a uri\"\n");
        assert!(error_of(&address).contains("worker 1 address `not a uri` is not a URI"));
    }

    #[test]
    fn defaults_round_trip_through_toml() {
        let cfg = RouterConfig::default();
        let text = toml::to_string(&cfg).unwrap();
        assert_eq!(RouterConfig::from_toml_str(&text).unwrap(), cfg);
    }
}
