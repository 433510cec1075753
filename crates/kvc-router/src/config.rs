//! The router configuration: TOML (kebab-case keys), validated before use.

use crate::error::ConfigError;
use kvc_core::{WorkerId, WorkerRole};
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
    /// The workers.
    pub workers: Vec<WorkerConfig>,
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
            workers: Vec::new(),
        }
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
        Ok(())
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
