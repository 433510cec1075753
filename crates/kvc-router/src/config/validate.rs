//! The router configuration's checks: one `validate()` per table and worker entry, and the
//! whole configuration's (unique ids and addresses, roles that can route).

use super::{
    DEFAULT_BOOTSTRAP_PORT, EngineSignalsConfig, HttpConfig, InferencePoolConfig, Limits,
    RouterConfig, SessionLimits, TracingConfig, WorkerConfig, WorkerUrl,
};
use crate::error::ConfigError;
use kvc_core::{EngineKind, WorkerRole};
use kvc_policy::MAX_WORKERS;
use std::collections::HashSet;
use std::path::PathBuf;

/// Fails with "`name` must be positive" for the first zero value of `values`.
fn all_positive<'a>(values: impl IntoIterator<Item = (&'a str, u64)>) -> Result<(), ConfigError> {
    match values.into_iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => Err(ConfigError::Invalid(format!("{name} must be positive"))),
        None => Ok(()),
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

impl HttpConfig {
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
        let mut seen = std::collections::BTreeSet::new();
        for (key, names) in [
            ("http.session-headers", &self.session_headers),
            ("http.session-agent-headers", &self.session_agent_headers),
            ("http.session-parent-headers", &self.session_parent_headers),
            (
                "http.session-parent-agent-headers",
                &self.session_parent_agent_headers,
            ),
        ] {
            if names.len() > Self::MAX_SESSION_HEADERS {
                return Err(ConfigError::Invalid(format!(
                    "{key} lists {} headers, at most {} are read",
                    names.len(),
                    Self::MAX_SESSION_HEADERS
                )));
            }
            for name in names {
                if axum::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                    return Err(ConfigError::Invalid(format!(
                        "{key}: `{name}` is not an HTTP header name"
                    )));
                }
                if !seen.insert(name.to_ascii_lowercase()) {
                    return Err(ConfigError::Invalid(format!(
                        "{key}: `{name}` is listed twice (header names are case-insensitive; \
                         a header is a session header or an agent header, not both)"
                    )));
                }
            }
        }
        Ok(())
    }
}

impl InferencePoolConfig {
    /// The API versions of the InferencePool that are read.
    pub const API_VERSIONS: [&'static str; 2] = [
        "inference.networking.k8s.io/v1",
        "inference.networking.x-k8s.io/v1alpha2",
    ];

    /// Checks the `[inference-pool]` table: a name, a known API version, an `http(s)://host:port`
    /// API when given, positive intervals, a role label, and room for pods above `first-id`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.name.is_empty() {
            return Err(ConfigError::Invalid(
                "inference-pool.name is required (the InferencePool whose pods are the workers)"
                    .into(),
            ));
        }
        if self.namespace.as_deref() == Some("") {
            return Err(ConfigError::Invalid(
                "inference-pool.namespace must not be empty (leave it out for the router pod's own)"
                    .into(),
            ));
        }
        if !Self::API_VERSIONS.contains(&self.api_version.as_str()) {
            return Err(ConfigError::Invalid(format!(
                "inference-pool.api-version `{}`: expected one of {}",
                self.api_version,
                Self::API_VERSIONS.join(", ")
            )));
        }
        if let Some(url) = &self.api_url {
            super::ApiUrl::parse(url).map_err(|e| {
                ConfigError::Invalid(format!("inference-pool.api-url `{url}`: {e}"))
            })?;
        }
        all_positive([
            ("inference-pool.poll-ms", self.poll_ms),
            ("inference-pool.timeout-ms", self.timeout_ms),
        ])?;
        if self.role_label.is_empty() {
            return Err(ConfigError::Invalid(
                "inference-pool.role-label must not be empty".into(),
            ));
        }
        if self.first_id as usize >= MAX_WORKERS {
            return Err(ConfigError::Invalid(format!(
                "inference-pool.first-id {} leaves no id for a pod: worker ids are below {MAX_WORKERS}",
                self.first_id
            )));
        }
        Ok(())
    }
}

impl TracingConfig {
    /// Checks the `[tracing]` table: `otlp-endpoint` an `http://host:port` URL, a service
    /// name, `sample-ratio` within 0 to 1, positive intervals and queue.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let endpoint = self.otlp_endpoint.trim();
        if endpoint.is_empty() {
            return Err(ConfigError::Invalid(
                "tracing.otlp-endpoint is required (the OTLP/gRPC collector, \
                 `http://host:port`); leave the [tracing] table out for no traces"
                    .into(),
            ));
        }
        let uri: axum::http::Uri = endpoint.parse().map_err(|e| {
            ConfigError::Invalid(format!(
                "tracing.otlp-endpoint `{endpoint}` is not a URL ({e}): expected `http://host:port`"
            ))
        })?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err(ConfigError::Invalid(format!(
                "tracing.otlp-endpoint `{endpoint}`: expected `http://host:port` (OTLP over \
                 plaintext gRPC; `https` is not supported)"
            )));
        }
        if self.service_name.trim().is_empty() {
            return Err(ConfigError::Invalid(
                "tracing.service-name must not be empty".into(),
            ));
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(ConfigError::Invalid(format!(
                "tracing.sample-ratio must be within 0 and 1, not {}",
                self.sample_ratio
            )));
        }
        all_positive([
            ("tracing.export-interval-ms", self.export_interval_ms),
            ("tracing.export-timeout-ms", self.export_timeout_ms),
            ("tracing.max-queued-spans", self.max_queued_spans as u64),
        ])
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

impl Limits {
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
}

impl WorkerConfig {
    /// Checks this entry on its own: id in range, a snapshot or an address, a positive
    /// capacity, a service address that is a URI, an `http-url` of the form
    /// `http://host:port[/prefix]`, `bootstrap-port` only with `http-url`, `append-prefill =
    /// false` only on a decode worker.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_in(false)
    }

    /// [`WorkerConfig::validate`] in a router that binds `kv-events-listen` (`listening`).
    pub(crate) fn validate_in(&self, listening: bool) -> Result<(), ConfigError> {
        let id = self.id;
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if id as usize >= MAX_WORKERS {
            return invalid(format!(
                "worker id {id} out of range (ids must be below {MAX_WORKERS})"
            ));
        }
        if self.discover == Some(true)
            && (self.engine != Some(EngineKind::Vllm) || self.http_url.is_none())
        {
            return invalid(format!(
                "worker {id}: discover = true needs engine = \"vllm\" and an http-url (only \
                 vLLM's HTTP server says where its events are)"
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
        self.validate_kv_events(listening)?;
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
        if self.send_kv && self.role != WorkerRole::Decode {
            return invalid(format!(
                "worker {id}: send-kv applies to decode workers only (it is {}): a session \
                 leaves a decode worker with its KV",
                self.role
            ));
        }
        if self.send_kv && self.engine == Some(EngineKind::Sglang) {
            return invalid(format!(
                "worker {id}: send-kv = true needs a decode engine that can also send KV \
                 (vLLM with NixlConnector); a stock SGLang decode server cannot \
                 (engine = \"sglang\")"
            ));
        }
        Ok(())
    }

    /// The `kv-events*` and `block-size` keys: endpoints `tcp://host:port`, the replay
    /// endpoint, topic and ranks only with `kv-events` or on a worker that listens
    /// (`listening`: the router binds `kv-events-listen`), which needs `engine`, a source of
    /// load (`metrics-url` or a snapshot) and a block size (set, or read from vLLM's
    /// `/metrics`); several ranks only over tcp, their ports within 65535.
    fn validate_kv_events(&self, listening: bool) -> Result<(), ConfigError> {
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
        let ranks = self.kv_events_ranks.unwrap_or(1);
        if ranks == 0 {
            return invalid(format!(
                "worker {id} kv-events-ranks must be positive (the engine's data-parallel ranks)"
            ));
        }
        let listens = self.listens_for_events(listening);
        let what = if self.kv_events.is_some() {
            "`kv-events`"
        } else if listens {
            "a worker that listens (the router's kv-events-listen, no kv-events)"
        } else {
            if self.kv_events_replay.is_some()
                || self.kv_events_topic.is_some()
                || self.kv_events_ranks.is_some()
            {
                let why = if self.discovers_events() {
                    " (this worker reads its event sources, every rank's, from the engine)"
                } else if listening {
                    " (a worker listens only with `engine`)"
                } else {
                    ""
                };
                return invalid(format!(
                    "worker {id}: `kv-events-replay`, `kv-events-topic` and `kv-events-ranks` \
                     need `kv-events`, or the router's `kv-events-listen`{why}"
                ));
            }
            return Ok(());
        };
        for (key, value) in [
            ("kv-events", &self.kv_events),
            ("kv-events-replay", &self.kv_events_replay),
        ] {
            if let Some(v) = value
                && ranks > 1
                && WorkerConfig::rank_endpoint(v, ranks - 1).is_none()
            {
                return invalid(format!(
                    "worker {id} {key} `{v}` with kv-events-ranks = {ranks}: each rank's port is \
                     the endpoint's plus its rank, so it must be tcp://host:port with a port \
                     below {}",
                    65_536 - ranks
                ));
            }
        }
        let Some(engine) = self.engine else {
            return invalid(format!(
                "worker {id}: {what} needs `engine` (`vllm` or `sglang`)"
            ));
        };
        if self.metrics_url.is_none() && self.snapshot.is_none() {
            return invalid(format!(
                "worker {id}: {what} needs `metrics-url` (or a snapshot) for the worker's load"
            ));
        }
        if self.block_size.is_none() && (engine == EngineKind::Sglang || self.metrics_url.is_none())
        {
            return invalid(format!(
                "worker {id}: {what} needs `block-size` (only vLLM's /metrics reports it)"
            ));
        }
        Ok(())
    }
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

/// One kind of address of a worker, normalised (`None`: the worker has none).
type WorkerKey = fn(&WorkerConfig) -> Option<String>;

/// A worker as error messages name it: its id and display name.
fn worker_label(w: &WorkerConfig) -> String {
    format!("{} (`{}`)", w.id, w.display_name())
}

impl RouterConfig {
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
        if let Some(t) = &self.tracing {
            t.validate()?;
        }
        if let Some(pool) = &self.inference_pool {
            pool.validate()?;
        }
        let mut seen = HashSet::new();
        for w in &self.workers {
            if !seen.insert(w.id) {
                return Err(ConfigError::Invalid(format!(
                    "worker id {} appears twice",
                    w.id
                )));
            }
            w.validate_in(self.kv_events_listen.is_some())?;
        }
        self.validate_kv_events_listen()?;
        self.validate_unique_addresses()?;
        self.validate_topology()
    }

    /// `kv-events-listen`: `tcp://host:port` (host `*` for every interface); port 0 only when
    /// no listening worker has several ranks (theirs follow the first port).
    fn validate_kv_events_listen(&self) -> Result<(), ConfigError> {
        let Some(ep) = &self.kv_events_listen else {
            return Ok(());
        };
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        let Some(port) = ep
            .strip_prefix("tcp://")
            .and_then(|r| r.rsplit_once(':'))
            .filter(|(h, _)| !h.is_empty())
            .and_then(|(_, p)| p.parse::<u16>().ok())
        else {
            return invalid(format!(
                "kv-events-listen `{ep}` is not tcp://host:port (tcp://*:5557 binds every \
                 interface)"
            ));
        };
        let ranks = self.event_listen_ranks();
        if ranks > 1 && (port == 0 || u32::from(port) + ranks - 1 > u32::from(u16::MAX)) {
            return invalid(format!(
                "kv-events-listen `{ep}`: a listening worker has kv-events-ranks = {ranks}, so \
                 the router binds the port and the {} after it: give a fixed port below {}",
                ranks - 1,
                65_536 - ranks
            ));
        }
        Ok(())
    }

    /// The ports `kv-events-listen` binds: the most `kv-events-ranks` of a listening worker
    /// (at least 1).
    pub fn event_listen_ranks(&self) -> u32 {
        let listening = self.kv_events_listen.is_some();
        self.workers
            .iter()
            .filter(|w| w.listens_for_events(listening))
            .map(|w| w.kv_events_ranks.unwrap_or(1))
            .max()
            .unwrap_or(1)
            .max(1)
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
}
