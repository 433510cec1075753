//! The router configuration: TOML (kebab-case keys), validated before use.

use crate::error::ConfigError;
use kvc_core::{WorkerId, WorkerRole};
use kvc_policy::{MAX_WORKERS, PolicyConfig};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashSet};
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
#[serde(try_from = "RawRouterConfig", into = "RawRouterConfig")]
pub struct RouterConfig {
    /// gRPC listen address (port 0 picks a free port). Default `127.0.0.1:50051`.
    pub listen: SocketAddr,
    /// Prometheus `/metrics` listen address; `None` serves no metrics. Default `127.0.0.1:9464`.
    pub metrics_listen: Option<SocketAddr>,
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
    /// HTTP data-plane listen address (see [`crate::http`]); `None` (the default) serves no
    /// HTTP front. Port 0 picks a free port.
    pub http_listen: Option<SocketAddr>,
    /// Resilience of the HTTP data plane (the `[http]` table): timeouts, retries, circuit
    /// breakers, health checks.
    pub http: HttpConfig,
    /// The workers.
    pub workers: Vec<WorkerConfig>,
    /// Each worker's HTTP endpoint for the data plane, by worker id. In TOML these are the
    /// `http-url` and `bootstrap-port` keys of the worker's `[[workers]]` entry; a worker
    /// without `http-url` gets no forwarded requests.
    pub worker_http: BTreeMap<u32, WorkerHttpConfig>,
    /// Decode workers whose engine cannot append-prefill (no decode-side prefill of a turn's
    /// new tokens), by worker id: the `append-prefill = false` key of their `[[workers]]`
    /// entry (default `true`). No decision sends them a direct-to-D turn: later turns of a
    /// session resident there go P→D with the fall-through reason `direct-unsupported`.
    pub no_append_prefill: BTreeSet<u32>,
}

/// A worker's HTTP endpoint (the `http-url` and `bootstrap-port` keys of `[[workers]]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerHttpConfig {
    /// Base URL of its SGLang-style HTTP server, `http://host:port[/prefix]`.
    pub url: String,
    /// The disaggregation bootstrap port of a prefill worker (default
    /// [`crate::http::DEFAULT_BOOTSTRAP_PORT`]); ignored for other roles.
    pub bootstrap_port: Option<u16>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            metrics_listen: Some(SocketAddr::from(([127, 0, 0, 1], 9464))),
            policy: PolicyConfig::default(),
            sessions: SessionLimits::default(),
            stale_after_ms: kvc_admission::DEFAULT_STALE_AFTER_MS,
            refresh_interval_ms: 10,
            poll_interval_ms: 200,
            rpc_timeout_ms: 500,
            max_message_bytes: 1 << 20,
            max_pending_decisions: 100_000,
            shutdown_grace_ms: 5_000,
            http_listen: None,
            http: HttpConfig::default(),
            workers: Vec::new(),
            worker_http: BTreeMap::new(),
            no_append_prefill: BTreeSet::new(),
        }
    }
}

/// The TOML shape of [`RouterConfig`]: the same keys, with each worker's HTTP endpoint inline
/// in its `[[workers]]` entry.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
struct RawRouterConfig {
    listen: SocketAddr,
    metrics_listen: Option<SocketAddr>,
    http_listen: Option<SocketAddr>,
    policy: PolicyConfig,
    sessions: SessionLimits,
    stale_after_ms: u64,
    refresh_interval_ms: u64,
    poll_interval_ms: u64,
    rpc_timeout_ms: u64,
    max_message_bytes: usize,
    max_pending_decisions: usize,
    shutdown_grace_ms: u64,
    http: HttpConfig,
    workers: Vec<RawWorkerConfig>,
}

impl Default for RawRouterConfig {
    fn default() -> Self {
        RouterConfig::default().into()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct RawWorkerConfig {
    id: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    role: WorkerRole,
    capacity_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    snapshot: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    address: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    http_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bootstrap_port: Option<u16>,
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    append_prefill: bool,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

impl TryFrom<RawRouterConfig> for RouterConfig {
    type Error = String;

    fn try_from(raw: RawRouterConfig) -> Result<Self, String> {
        let mut worker_http = BTreeMap::new();
        let mut no_append_prefill = BTreeSet::new();
        let mut workers = Vec::with_capacity(raw.workers.len());
        for w in raw.workers {
            if !w.append_prefill {
                no_append_prefill.insert(w.id);
            }
            match (w.http_url, w.bootstrap_port) {
                (Some(url), bootstrap_port) => {
                    worker_http.insert(
                        w.id,
                        WorkerHttpConfig {
                            url,
                            bootstrap_port,
                        },
                    );
                }
                (None, Some(_)) => {
                    return Err(format!(
                        "worker {}: `bootstrap-port` needs `http-url`",
                        w.id
                    ));
                }
                (None, None) => {}
            }
            workers.push(WorkerConfig {
                id: w.id,
                name: w.name,
                role: w.role,
                capacity_tokens: w.capacity_tokens,
                snapshot: w.snapshot,
                address: w.address,
            });
        }
        Ok(RouterConfig {
            listen: raw.listen,
            metrics_listen: raw.metrics_listen,
            policy: raw.policy,
            sessions: raw.sessions,
            stale_after_ms: raw.stale_after_ms,
            refresh_interval_ms: raw.refresh_interval_ms,
            poll_interval_ms: raw.poll_interval_ms,
            rpc_timeout_ms: raw.rpc_timeout_ms,
            max_message_bytes: raw.max_message_bytes,
            max_pending_decisions: raw.max_pending_decisions,
            shutdown_grace_ms: raw.shutdown_grace_ms,
            http_listen: raw.http_listen,
            http: raw.http,
            workers,
            worker_http,
            no_append_prefill,
        })
    }
}

impl From<RouterConfig> for RawRouterConfig {
    fn from(cfg: RouterConfig) -> Self {
        let mut http = cfg.worker_http;
        RawRouterConfig {
            listen: cfg.listen,
            metrics_listen: cfg.metrics_listen,
            http_listen: cfg.http_listen,
            policy: cfg.policy,
            sessions: cfg.sessions,
            stale_after_ms: cfg.stale_after_ms,
            refresh_interval_ms: cfg.refresh_interval_ms,
            poll_interval_ms: cfg.poll_interval_ms,
            rpc_timeout_ms: cfg.rpc_timeout_ms,
            max_message_bytes: cfg.max_message_bytes,
            max_pending_decisions: cfg.max_pending_decisions,
            shutdown_grace_ms: cfg.shutdown_grace_ms,
            http: cfg.http,
            workers: cfg
                .workers
                .into_iter()
                .map(|w| {
                    let h = http.remove(&w.id);
                    RawWorkerConfig {
                        id: w.id,
                        name: w.name,
                        role: w.role,
                        capacity_tokens: w.capacity_tokens,
                        snapshot: w.snapshot,
                        address: w.address,
                        bootstrap_port: h.as_ref().and_then(|h| h.bootstrap_port),
                        http_url: h.map(|h| h.url),
                        append_prefill: !cfg.no_append_prefill.contains(&w.id),
                    }
                })
                .collect(),
        }
    }
}

/// Resilience of the HTTP data plane: the `[http]` table (see [`crate::http`] for what each
/// knob does).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct HttpConfig {
    /// Deadline of each call to a worker (a streamed answer: its head, then each wait for
    /// more). Default 300,000 ms.
    pub request_timeout_ms: u64,
    /// Times a request that failed before any byte reached the client is routed and
    /// forwarded again. Default 2.
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
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            request_timeout_ms: 300_000,
            max_retries: 2,
            retry_backoff_ms: 25,
            breaker_failures: 3,
            breaker_cooldown_ms: 1_000,
            breaker_max_cooldown_ms: 30_000,
            health_check_interval_ms: 5_000,
            health_check_timeout_ms: 1_000,
            tokenizer: None,
            infer_min_blocks: 4,
        }
    }
}

impl HttpConfig {
    /// Largest `max-retries` accepted.
    pub const MAX_RETRIES: u32 = 10;

    /// These settings as [`crate::http::HttpOptions`] (the other options at their defaults),
    /// with the tokenizer file loaded: [`ConfigError::Tokenizer`] when it cannot be used.
    pub fn options(&self) -> Result<crate::http::HttpOptions, ConfigError> {
        use std::time::Duration;
        let tokenizer = match &self.tokenizer {
            Some(path) => crate::http::Tokenizer::from_file(path)?,
            None => crate::http::Tokenizer::fallback(),
        };
        Ok(crate::http::HttpOptions {
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            max_retries: self.max_retries,
            retry_backoff: Duration::from_millis(self.retry_backoff_ms),
            breaker: crate::http::BreakerOptions {
                failure_threshold: self.breaker_failures,
                cooldown: Duration::from_millis(self.breaker_cooldown_ms),
                max_cooldown: Duration::from_millis(self.breaker_max_cooldown_ms),
            },
            health_check_interval: (self.health_check_interval_ms > 0)
                .then(|| Duration::from_millis(self.health_check_interval_ms)),
            health_check_timeout: Duration::from_millis(self.health_check_timeout_ms),
            tokenizer,
            infer_min_blocks: self.infer_min_blocks,
            ..crate::http::HttpOptions::default()
        })
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("http.request-timeout-ms", self.request_timeout_ms),
            ("http.health-check-timeout-ms", self.health_check_timeout_ms),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(ConfigError::Invalid(format!("{name} must be positive")));
            }
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

/// One worker of the cluster. At least one of `snapshot` and `address` is required.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct WorkerConfig {
    /// Dense id, unique across roles, below [`kvc_policy::MAX_WORKERS`].
    pub id: u32,
    /// Display name (default `w<id>`).
    #[serde(default)]
    pub name: Option<String>,
    /// `prefill`, `decode` or `colocated`.
    pub role: WorkerRole,
    /// Size of its KV pool in tokens (must match the snapshot header when there is one).
    pub capacity_tokens: u64,
    /// Its shared-memory snapshot file: state and probes are read from it, with no RPC.
    #[serde(default)]
    pub snapshot: Option<PathBuf>,
    /// Its `kvc.v1.Worker` service (`http://host:port`): `CommitEvict` goes there, and its
    /// state is polled with `State` when it has no snapshot.
    #[serde(default)]
    pub address: Option<String>,
}

impl WorkerConfig {
    /// The worker id.
    pub fn worker_id(&self) -> WorkerId {
        WorkerId(self.id)
    }

    /// The display name.
    pub fn display_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| format!("w{}", self.id))
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

    /// Checks every value: policy knobs in range, worker ids unique and in range, each worker
    /// with a snapshot or an address, positive limits and intervals.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.policy
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let positive = [
            ("stale-after-ms", self.stale_after_ms),
            ("refresh-interval-ms", self.refresh_interval_ms),
            ("poll-interval-ms", self.poll_interval_ms),
            ("rpc-timeout-ms", self.rpc_timeout_ms),
            ("sessions.ttl-ms", self.sessions.ttl_ms),
            ("sessions.max", self.sessions.max_sessions as u64),
            ("max-message-bytes", self.max_message_bytes as u64),
            ("max-pending-decisions", self.max_pending_decisions as u64),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(ConfigError::Invalid(format!("{name} must be positive")));
            }
        }
        self.http.validate()?;
        let mut seen = HashSet::new();
        for w in &self.workers {
            if w.id as usize >= MAX_WORKERS {
                return Err(ConfigError::Invalid(format!(
                    "worker id {} out of range (ids must be below {MAX_WORKERS})",
                    w.id
                )));
            }
            if !seen.insert(w.id) {
                return Err(ConfigError::Invalid(format!(
                    "worker id {} appears twice",
                    w.id
                )));
            }
            if w.snapshot.is_none() && w.address.is_none() {
                return Err(ConfigError::Invalid(format!(
                    "worker {} needs a snapshot path or a service address",
                    w.id
                )));
            }
            if w.capacity_tokens == 0 {
                return Err(ConfigError::Invalid(format!(
                    "worker {} capacity-tokens must be positive",
                    w.id
                )));
            }
            if let Some(addr) = &w.address
                && addr.parse::<tonic::transport::Uri>().is_err()
            {
                return Err(ConfigError::Invalid(format!(
                    "worker {} address `{addr}` is not a URI",
                    w.id
                )));
            }
        }
        for id in &self.no_append_prefill {
            match self.workers.iter().find(|w| w.id == *id) {
                None => {
                    return Err(ConfigError::Invalid(format!(
                        "append-prefill set for worker {id}, which is not configured"
                    )));
                }
                Some(w) if w.role != WorkerRole::Decode => {
                    return Err(ConfigError::Invalid(format!(
                        "worker {id}: append-prefill applies to decode workers only (it is {})",
                        w.role
                    )));
                }
                Some(_) => {}
            }
        }
        for (id, h) in &self.worker_http {
            if !seen.contains(id) {
                return Err(ConfigError::Invalid(format!(
                    "HTTP endpoint for worker {id}, which is not configured"
                )));
            }
            if crate::http::BaseUrl::parse(&h.url).is_err() {
                return Err(ConfigError::Invalid(format!(
                    "worker {id} http-url `{}` is not http://host:port[/prefix]",
                    h.url
                )));
            }
        }
        Ok(())
    }

    /// The HTTP endpoints of the workers that have one, for [`crate::http::http_app`].
    pub fn http_workers(&self) -> Result<crate::http::HttpWorkers, ConfigError> {
        let mut workers = crate::http::HttpWorkers::new();
        for (id, h) in &self.worker_http {
            workers
                .insert(WorkerId(*id), &h.url, h.bootstrap_port)
                .map_err(|e| ConfigError::Invalid(format!("worker {id}: {e}")))?;
        }
        Ok(workers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_file_parses() {
        let text = include_str!("../examples/router.toml");
        let cfg = RouterConfig::from_toml_str(text).unwrap();
        assert_eq!(cfg.workers.len(), 3);
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
        assert_eq!(cfg.http.options().unwrap().max_retries, 2);
        assert!(cfg.no_append_prefill.is_empty());
        assert_eq!(cfg.worker_http.len(), 3);
        assert_eq!(cfg.worker_http[&0].bootstrap_port, Some(8998));
        assert_eq!(cfg.worker_http[&1].url, "http://127.0.0.1:30001");
        assert_eq!(cfg.worker_http[&2].bootstrap_port, None);
        let workers = cfg.http_workers().unwrap();
        assert_eq!(workers.len(), 3);
        assert_eq!(workers.get(WorkerId(0)).unwrap().url.port, 30000);
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
        let worker =
            "[[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/x\"\n";
        let cfg = RouterConfig::from_toml_str(worker).unwrap();
        assert_eq!(cfg.http_listen, None);
        assert!(cfg.worker_http.is_empty());
        let bad_url = format!("{worker}http-url = \"https://h:1\"\n");
        let err = RouterConfig::from_toml_str(&bad_url).unwrap_err();
        assert!(
            matches!(err, ConfigError::Invalid(ref m) if m.contains("http-url")),
            "{err}"
        );
        let orphan_port = format!("{worker}bootstrap-port = 9000\n");
        let err = RouterConfig::from_toml_str(&orphan_port).unwrap_err();
        assert!(
            matches!(err, ConfigError::Parse(ref m) if m.contains("needs `http-url`")),
            "{err}"
        );
        let bad_listen = format!("http-listen = \"nowhere\"\n{worker}");
        assert!(matches!(
            RouterConfig::from_toml_str(&bad_listen),
            Err(ConfigError::Parse(_))
        ));
        let mut cfg = RouterConfig::from_toml_str(worker).unwrap();
        cfg.worker_http.insert(
            7,
            WorkerHttpConfig {
                url: "http://h:1".into(),
                bootstrap_port: None,
            },
        );
        assert!(cfg.validate().unwrap_err().to_string().contains("worker 7"));
    }

    #[test]
    fn the_http_table_is_parsed_and_validated() {
        let cfg = RouterConfig::from_toml_str(
            "[http]\nmax-retries = 1\nbreaker-failures = 0\nhealth-check-interval-ms = 0\n\
             request-timeout-ms = 700\n",
        )
        .unwrap();
        assert_eq!(cfg.http.max_retries, 1);
        assert_eq!(
            cfg.http.retry_backoff_ms, 25,
            "absent keys take their defaults"
        );
        let o = cfg.http.options().unwrap();
        assert_eq!(o.max_retries, 1);
        assert_eq!(o.breaker.failure_threshold, 0);
        assert_eq!(o.health_check_interval, None);
        assert_eq!(o.request_timeout, std::time::Duration::from_millis(700));
        assert_eq!(o.session_header, "x-session-id");
        let defaults = HttpConfig::default().options().unwrap();
        assert_eq!(defaults.infer_min_blocks, 4);
        assert_eq!(defaults.tokenizer, crate::http::Tokenizer::fallback());
        assert_eq!(
            defaults.health_check_interval,
            Some(std::time::Duration::from_secs(5))
        );
        assert_eq!(defaults.breaker, crate::http::BreakerOptions::default());
        for (text, key) in [
            ("[http]\nrequest-timeout-ms = 0\n", "request-timeout-ms"),
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
    fn append_prefill_is_a_decode_worker_key() {
        let text = "[[workers]]\nid = 0\nrole = \"prefill\"\ncapacity-tokens = 10\nsnapshot = \"/p\"\n\
                    [[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/d1\"\n\
                    append-prefill = false\n\
                    [[workers]]\nid = 2\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/d2\"\n\
                    append-prefill = true\n";
        let cfg = RouterConfig::from_toml_str(text).unwrap();
        assert_eq!(cfg.no_append_prefill, BTreeSet::from([1]));
        // It survives a round trip; the default (`true`) is not written out.
        let out = toml::to_string(&cfg).unwrap();
        assert_eq!(out.matches("append-prefill = false").count(), 1, "{out}");
        assert!(!out.contains("append-prefill = true"), "{out}");
        assert_eq!(RouterConfig::from_toml_str(&out).unwrap(), cfg);
        // The policy state learns it: no direct-to-D turn for worker 1.
        let svc = crate::RouterService::new(cfg).unwrap();
        assert_eq!(svc.config().no_append_prefill.len(), 1);
        let bad = text.replace(
            "snapshot = \"/p\"\n",
            "snapshot = \"/p\"\nappend-prefill = false\n",
        );
        let err = RouterConfig::from_toml_str(&bad).unwrap_err();
        assert!(
            matches!(err, ConfigError::Invalid(ref m) if m.contains("decode workers only")),
            "{err}"
        );
        let mut cfg = RouterConfig::from_toml_str(text).unwrap();
        cfg.no_append_prefill.insert(9);
        assert!(cfg.validate().unwrap_err().to_string().contains("worker 9"));
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
        // The file is loaded with the options: a missing one is an error naming it.
        let err = cfg.http.options().unwrap_err();
        assert!(matches!(err, ConfigError::Tokenizer(_)), "{err}");
        assert!(err.to_string().contains("/nowhere/tokenizer.json"), "{err}");
        assert!(
            !toml::to_string(&RouterConfig::default())
                .unwrap()
                .contains("tokenizer")
        );
    }

    #[test]
    fn rejects_bad_configs() {
        let base = "[[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\n";
        let err = RouterConfig::from_toml_str(base).unwrap_err();
        assert!(
            err.to_string()
                .contains("snapshot path or a service address")
        );
        let dup = format!("{base}snapshot = \"/x\"\n{base}snapshot = \"/y\"\n");
        assert!(
            RouterConfig::from_toml_str(&dup)
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
        let unknown = "bogus = 1\n";
        assert!(matches!(
            RouterConfig::from_toml_str(unknown),
            Err(ConfigError::Parse(_))
        ));
        let zero = "stale-after-ms = 0\n";
        assert!(
            RouterConfig::from_toml_str(zero)
                .unwrap_err()
                .to_string()
                .contains("stale-after-ms")
        );
        let policy = "[policy]\npolicy = \"kvc-v2\"\nhard-cap = 3.0\n";
        assert!(matches!(
            RouterConfig::from_toml_str(policy),
            Err(ConfigError::Invalid(_))
        ));
        let range =
            "[[workers]]\nid = 999\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/x\"\n";
        assert!(
            RouterConfig::from_toml_str(range)
                .unwrap_err()
                .to_string()
                .contains("out of range")
        );
    }

    #[test]
    fn defaults_round_trip_through_toml() {
        let cfg = RouterConfig::default();
        let text = toml::to_string(&cfg).unwrap();
        assert_eq!(RouterConfig::from_toml_str(&text).unwrap(), cfg);
    }
}
