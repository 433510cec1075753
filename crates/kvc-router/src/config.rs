//! The router configuration's schema: TOML (kebab-case keys) read straight into these types,
//! with their defaults; each type's `validate()` is in `config/validate.rs`.

use crate::error::ConfigError;
use kvc_core::{Capabilities, EngineKind, WorkerId, WorkerRole};
use kvc_policy::PolicyConfig;
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

#[cfg(feature = "schema")]
pub mod reference;
mod validate;

#[cfg(test)]
mod tests;

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
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct RouterConfig {
    /// gRPC listen address (port 0 picks a free port). Default `127.0.0.1:50051`.
    pub listen: SocketAddr,
    /// Prometheus `/metrics` listen address (`kvc-router --no-metrics` serves none). Default
    /// `127.0.0.1:9464`.
    pub metrics_listen: Option<SocketAddr>,
    /// HTTP data-plane listen address (the HTTP front, specified in `kvc_router::http`);
    /// absent (the default), no HTTP front is served. Port 0 picks a free port.
    pub http_listen: Option<SocketAddr>,
    /// Endpoint-picker listen address: Envoy's ext_proc gRPC service and its health services
    /// (specified in `kvc_router::epp`); absent (the default), no picker is served. Port 0
    /// picks a free port.
    #[cfg_attr(feature = "schema", schemars(example = &"127.0.0.1:9002"))]
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
    /// OpenTelemetry traces (the `[tracing]` table): absent (the default), the router makes
    /// no spans and exports nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracing: Option<TracingConfig>,
    /// A ZeroMQ SUB socket the router binds for engines that *connect* their KV-event
    /// publisher to it (`tcp://*:PORT`, `tcp://0.0.0.0:PORT` or `tcp://HOST:PORT`; llm-d's
    /// "central" mode): vLLM connects for an endpoint `tcp://ROUTER:PORT` in its
    /// `--kv-events-config`. Each message's topic names its worker: a worker's own
    /// `kv-events-topic`, else `kv@NAME@MODEL` with the worker's `name`; a topic naming no
    /// listening worker is counted and logged once, never indexed. Engines with several
    /// data-parallel ranks connect rank `r` to `PORT + r`: the router binds as many ports as
    /// the most `kv-events-ranks` of a listening worker. A listening worker is one with
    /// `engine` and no `kv-events` (its own SUB socket is for engines that bind); one that
    /// discovers its source listens when its engine says it connects out. Absent (the
    /// default): every engine binds, and the router connects to each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = &"tcp://*:5557"))]
    pub kv_events_listen: Option<String>,
    /// A Kubernetes InferencePool whose pods join the fleet as workers (the
    /// `[inference-pool]` table, read by [`crate::pool`]); absent (the default), the workers
    /// are the `[[workers]]` entries only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<InferencePoolConfig>,
    /// The workers (`[[workers]]`).
    pub workers: Vec<WorkerConfig>,
}

/// The `[inference-pool]` table: the Gateway API Inference Extension's InferencePool whose
/// ready pods are the router's workers, read from the Kubernetes API every `poll-ms` (the
/// pool's `spec.selector` and target port, then the pods it selects). A ready pod joins as an
/// `engine = "vllm"` worker named by the pod, with `http-url` `http://POD_IP:PORT`, and is
/// discovered like any such worker (events, block size, pool size); a pod that is not ready
/// or is terminating is drained; a pod gone (or given another IP) is removed. Its role is its
/// `role-label` (llm-d's `llm-d.ai/role`: `prefill`, `decode`, `both` or `colocated`), else
/// `default-role`. The `[[workers]]` entries of the file may run beside the pool's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct InferencePoolConfig {
    /// The InferencePool's name. Required.
    #[cfg_attr(feature = "schema", schemars(example = &"vllm-pd"))]
    pub name: String,
    /// Its namespace. Default: the router pod's own (its service account's `namespace`
    /// file).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = &"llm"))]
    pub namespace: Option<String>,
    /// The Kubernetes API, `https://host:port` or `http://host:port` (e.g. a `kubectl
    /// proxy` beside the router). Default: `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`,
    /// as in every pod.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = &"https://10.96.0.1:443"))]
    pub api_url: Option<String>,
    /// The bearer token sent to the API, re-read at every poll (tokens are rotated).
    /// Default: the service account's token file; none is sent when that file is absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "schema",
        schemars(example = &"/var/run/secrets/kubernetes.io/serviceaccount/token")
    )]
    pub token_file: Option<PathBuf>,
    /// The certificate authority (PEM) the API's certificate is checked against, for an
    /// `https` API. Default: the service account's `ca.crt`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "schema",
        schemars(example = &"/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
    )]
    pub ca_file: Option<PathBuf>,
    /// The InferencePool's API group and version: `inference.networking.k8s.io/v1` (the
    /// default) or the older `inference.networking.x-k8s.io/v1alpha2`.
    pub api_version: String,
    /// How often the pool and its pods are read. Default 2,000 ms.
    pub poll_ms: u64,
    /// Deadline of one call to the API. Default 5,000 ms.
    pub timeout_ms: u64,
    /// The pod label that gives a pod's role. Default `llm-d.ai/role`.
    pub role_label: String,
    /// The role of a pod without that label. Default `colocated`.
    pub default_role: WorkerRole,
    /// The lowest worker id a pod is given: each new pod takes the lowest id from here up
    /// that no worker holds (keep the `[[workers]]` ids below it). Default 1,024.
    pub first_id: u32,
}

/// The Kubernetes API's address: `http(s)://host[:port]` (no path).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiUrl {
    /// `https` (checked against the CA) or plain `http`.
    pub https: bool,
    /// The host, without brackets for an IPv6 address.
    pub host: String,
    /// The port (default 443 for `https`, 80 for `http`).
    pub port: u16,
}

impl ApiUrl {
    /// Reads `http(s)://host[:port]`, with an optional trailing `/`.
    pub fn parse(url: &str) -> Result<ApiUrl, String> {
        let (https, rest) = if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else {
            return Err("expected `https://host:port` or `http://host:port`".into());
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains('/') {
            return Err("expected no path after the host and port".into());
        }
        let default_port = if https { 443 } else { 80 };
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (host, after) = v6
                .split_once(']')
                .ok_or("an IPv6 host without its closing `]`")?;
            match after.strip_prefix(':') {
                Some(p) => (host, Some(p)),
                None if after.is_empty() => (host, None),
                None => return Err(format!("`{after}` after the IPv6 host")),
            }
        } else {
            match rest.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (rest, None),
            }
        };
        if host.is_empty() {
            return Err("no host".into());
        }
        let port = match port {
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| format!("port `{p}` is not a port"))?,
            None => default_port,
        };
        Ok(ApiUrl {
            https,
            host: host.to_owned(),
            port,
        })
    }

    /// `host:port` as a `Host` header and a socket address say it.
    pub(crate) fn authority(&self) -> String {
        match self.host.parse::<IpAddr>() {
            Ok(IpAddr::V6(_)) => format!("[{}]:{}", self.host, self.port),
            _ => format!("{}:{}", self.host, self.port),
        }
    }
}

impl std::fmt::Display for ApiUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.https { "https" } else { "http" };
        write!(f, "{scheme}://{}", self.authority())
    }
}

impl Default for InferencePoolConfig {
    fn default() -> Self {
        InferencePoolConfig {
            name: String::new(),
            namespace: None,
            api_url: None,
            token_file: None,
            ca_file: None,
            api_version: "inference.networking.k8s.io/v1".to_owned(),
            poll_ms: 2_000,
            timeout_ms: 5_000,
            role_label: "llm-d.ai/role".to_owned(),
            default_role: WorkerRole::Colocated,
            first_id: 1_024,
        }
    }
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
            tracing: None,
            kv_events_listen: None,
            inference_pool: None,
            workers: Vec::new(),
        }
    }
}

/// One setting per listener: a table with an `http` sub-table (the HTTP front) and a `grpc`
/// one (the gRPC listener: the control API and the endpoint picker's health), each optional;
/// `[auth]` and `[tls]` are such tables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct PerListener<T> {
    /// The HTTP front's setting (`[auth.http]`, `[tls.http]`); absent, none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http: Option<T>,
    /// The gRPC listener's setting (`[auth.grpc]`, `[tls.grpc]`); absent, none.
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

/// How the router reads stock engines' own signals: the `[engine-signals]` table. Applies to
/// workers with `metrics-url` (state source `events`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct EngineSignalsConfig {
    /// How often each engine's `/metrics` is scraped. Default 100 ms.
    pub scrape_interval_ms: u64,
    /// Deadline of one scrape. Default 500 ms.
    pub scrape_timeout_ms: u64,
    /// An engine whose last good scrape is older than this is `stale` (out of rotation).
    /// Default 2,000 ms.
    pub stale_after_ms: u64,
    /// How long an engine's KV-cache events may take to reach the router: until the events
    /// have caught up with a session's last request or answer (a batch the engine published
    /// since, by its `ts` on the engine's clock, is applied), and for at most this long after
    /// it, the session's blocks missing from its worker's events are not taken for an
    /// eviction (the engine may have stored them and not yet published, or the router not yet
    /// read, the events). A busy engine publishes every step, so its events catch up within
    /// milliseconds; this bound is for an idle one. 0: always trust the events. While a
    /// request of the session on that worker is unanswered (its KV may still be computed on P
    /// and shipped), the events never count as an eviction, whatever this bound.
    /// Default 2,000 ms.
    pub events_lag_ms: u64,
}

impl Default for EngineSignalsConfig {
    fn default() -> Self {
        EngineSignalsConfig {
            scrape_interval_ms: 100,
            scrape_timeout_ms: 500,
            stale_after_ms: 2_000,
            events_lag_ms: 2_000,
        }
    }
}

/// The HTTP data plane's settings: the `[http]` table (the HTTP front's module doc,
/// `kvc_router::http`, says what each one does).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
    /// match the engine's tokens); absent (the default), one token per whitespace-separated
    /// word. Loaded at startup (a relative path from the working directory): a file that
    /// cannot be read or used is a startup error naming it. `kvc-router --tokenizer`
    /// overrides it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = &"/models/my-model/tokenizer.json"))]
    pub tokenizer: Option<PathBuf>,
    /// Session inference: a request without a session key continues the known session whose
    /// whole latest prompt its own begins with (every token, whatever the block alignment:
    /// a shared system prompt alone never glues two conversations), and otherwise starts an
    /// inferred session; prompts of fewer full blocks than this are routed without a
    /// session. 0 turns session inference off. Default 1.
    pub infer_min_blocks: u32,
    /// Longest session id the front accepts (a session header, an agent header, or
    /// `session_params.id`), in bytes; a longer one gets 400. Default 256.
    pub max_session_id_bytes: usize,
    /// Headers a client's session key is read from, in order: the first one present names
    /// the session (before `session_params.id` in the body). Default
    /// [`HttpConfig::DEFAULT_SESSION_HEADERS`], the ones common coding agents and benchmark
    /// clients send; empty: sessions come only from the body or from inference.
    pub session_headers: Vec<String>,
    /// Headers naming an agent within a client's session (a subagent, whose conversation is
    /// its own): when one is present beside a session header, the session is that agent's,
    /// keyed `<session>/agent/<agent>`. Default [`HttpConfig::DEFAULT_AGENT_HEADERS`].
    pub session_agent_headers: Vec<String>,
    /// Headers naming the session that spawned the request's session (a subagent's parent),
    /// by the parent's own session key, read in order. A subagent's first turn may then go
    /// direct-to-D where its parent's KV is (the `kvc` policy's `subagent-placement`).
    /// Default [`HttpConfig::DEFAULT_PARENT_HEADERS`].
    pub session_parent_headers: Vec<String>,
    /// Headers naming the parent agent of a subagent within the same client session (keyed
    /// `<session>/agent/<parent>`); a request of an agent without one was spawned by the
    /// session's main conversation. Default [`HttpConfig::DEFAULT_PARENT_AGENT_HEADERS`].
    pub session_parent_agent_headers: Vec<String>,
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
    /// Turns a worker prefills itself (colocated, local prefill, direct-to-D) that the front
    /// sends it at a time before their first token; further ones wait in the front, and the
    /// one with the fewest tokens to prefill goes next (a turn's tokens count half as much for
    /// every 2 s it has waited). A stock engine matches a prompt against its cache only when
    /// it schedules it, first come first served: on a busy engine with a small KV pool a turn
    /// whose prefix was cached when it arrived loses it to the prefills queued ahead of it.
    /// 0 (the default): no limit, every turn goes to its worker at once.
    pub prefills_per_worker: usize,
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
            infer_min_blocks: 1,
            max_session_id_bytes: 256,
            session_headers: HttpConfig::DEFAULT_SESSION_HEADERS
                .iter()
                .map(|h| (*h).to_owned())
                .collect(),
            session_agent_headers: HttpConfig::DEFAULT_AGENT_HEADERS
                .iter()
                .map(|h| (*h).to_owned())
                .collect(),
            session_parent_headers: HttpConfig::DEFAULT_PARENT_HEADERS
                .iter()
                .map(|h| (*h).to_owned())
                .collect(),
            session_parent_agent_headers: HttpConfig::DEFAULT_PARENT_AGENT_HEADERS
                .iter()
                .map(|h| (*h).to_owned())
                .collect(),
            max_body_bytes: 16 << 20,
            max_header_bytes: 64 << 10,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            idle_timeout_ms: 60_000,
            max_connections: 1_024,
            overflow_connections: 32,
            prefills_per_worker: 0,
        }
    }
}

impl HttpConfig {
    /// Largest `max-retries` accepted.
    pub const MAX_RETRIES: u32 = 10;

    /// The session headers read by default, in order (each client's own code says which it
    /// sends; the HTTP front's module doc, `kvc_router::http`, names the versions read):
    /// - `x-session-id`: kvc's own, the benchmark clients', and OpenCode's (`X-Session-Id`
    ///   beside `x-session-affinity`, its session id, to providers other than its own);
    /// - `x-claude-code-session-id`: Claude Code (the session of the CLI run; its subagents
    ///   add `x-claude-code-agent-id`, see [`HttpConfig::DEFAULT_AGENT_HEADERS`]);
    /// - `thread-id`, `session-id`: Codex CLI (the conversation thread, and the session it
    ///   belongs to; a spawned subagent thread has its own thread id), `session_id` in
    ///   earlier versions;
    /// - `x-session-affinity`: OpenCode.
    pub const DEFAULT_SESSION_HEADERS: [&'static str; 6] = [
        "x-session-id",
        "x-claude-code-session-id",
        "thread-id",
        "session-id",
        "session_id",
        "x-session-affinity",
    ];

    /// The agent headers read by default: `x-claude-code-agent-id` (Claude Code's subagents
    /// share their parent's session id and name themselves with it).
    pub const DEFAULT_AGENT_HEADERS: [&'static str; 1] = ["x-claude-code-agent-id"];

    /// The parent-session headers read by default: `x-codex-parent-thread-id` (Codex CLI
    /// 0.171, on a spawned subagent thread's requests: the thread that spawned it, whose own
    /// requests carry it as `thread-id`) and `x-parent-session-id` (OpenCode, on a child
    /// session's requests: the parent's session id, its `x-session-id`).
    pub const DEFAULT_PARENT_HEADERS: [&'static str; 2] =
        ["x-codex-parent-thread-id", "x-parent-session-id"];

    /// The parent-agent headers read by default: `x-claude-code-parent-agent-id` (Claude Code
    /// 2.1, beside `x-claude-code-agent-id` on a subagent's requests when another subagent
    /// spawned it).
    pub const DEFAULT_PARENT_AGENT_HEADERS: [&'static str; 1] = ["x-claude-code-parent-agent-id"];

    /// Most names in `session-headers` or `session-agent-headers`.
    pub const MAX_SESSION_HEADERS: usize = 32;

    /// Smallest `max-header-bytes` accepted.
    pub const MIN_HEADER_BYTES: usize = 1_024;
}

/// OpenTelemetry traces: the `[tracing]` table. Present, the router makes one span per
/// routed request (the HTTP front's and gRPC `Route`'s) and one per call to a worker, and
/// exports the sampled ones over OTLP/gRPC to `otlp-endpoint` (`crate::telemetry` says what
/// each span carries).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct TracingConfig {
    /// The OTLP/gRPC collector, `http://host:port` (plaintext gRPC, e.g. an OpenTelemetry
    /// Collector's `4317`). Required.
    #[cfg_attr(feature = "schema", schemars(example = &"http://127.0.0.1:4317"))]
    pub otlp_endpoint: String,
    /// The traces' `service.name`. Default `kvc-router`.
    pub service_name: String,
    /// Fraction of the requests without a client trace context that start a trace of the
    /// router's, 0 to 1. A request whose client sent a valid `traceparent` follows the
    /// client's sampled flag instead (parent-based sampling). Default 1.
    pub sample_ratio: f64,
    /// Most time a finished span waits before it is exported (the batch's delay). Default
    /// 5,000 ms.
    pub export_interval_ms: u64,
    /// Deadline of one export to the collector. Default 10,000 ms.
    pub export_timeout_ms: u64,
    /// Finished spans held for export at most; beyond it new ones are dropped (and counted in
    /// the router's log when the processor shuts down). Default 2,048.
    pub max_queued_spans: usize,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: String::new(),
            service_name: "kvc-router".to_owned(),
            sample_ratio: 1.0,
            export_interval_ms: 5_000,
            export_timeout_ms: 10_000,
            max_queued_spans: 2_048,
        }
    }
}

/// Bounds of the router's session table: memory cannot grow without limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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

/// Bounds of the routing state and of a request (the `[limits]` table). The policy state's
/// tables and their cost per entry are in `docs/kvc-policy.md` ("Memory and cost"); the
/// decisions awaiting an outcome are bounded by `max-pending-decisions`, the sessions by
/// `[sessions]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct Limits {
    /// Blocks the policy's block view keeps per worker and view (40–60 bytes each); absent
    /// (the default): `pool-multiple` times the worker's `capacity-tokens` in blocks.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = 200_000))]
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
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct WorkerConfig {
    /// Dense id, unique across roles, below [`kvc_policy::MAX_WORKERS`].
    pub id: u32,
    /// Display name (default `w<id>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// What it does: `prefill`, `decode` or `colocated`.
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
    /// new tokens). Absent, `engine` decides ([`WorkerConfig::can_append_prefill`]: `false`
    /// for a stock SGLang decode server, which cannot serve a request without a bootstrap
    /// room; `true` otherwise). With `false` no decision sends it a direct-to-D turn: later
    /// turns of a session resident there go P→D with the fall-through reason
    /// `direct-unsupported`. Only decode workers may set `false`;
    /// `append-prefill = true` with `engine = "sglang"` declares a patched engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub append_prefill: Option<bool>,
    /// Whether the worker may serve a turn alone (`local-prefill`: it prefills what it does
    /// not hold of the prompt, decodes, and keeps the session). Absent, `engine` decides
    /// ([`WorkerConfig::capabilities`]: `true` for a vLLM instance of either role, which
    /// serves a plain request in full; `false` otherwise).
    /// `true` is refused with `engine = "sglang"` (a stock SGLang prefill or decode server
    /// cannot serve a request without its partner) and on a colocated worker (which always
    /// serves alone). A prefill worker that serves alone also hosts sessions (`NpMd-hybrid`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serve_alone: Option<bool>,
    /// Whether this decode worker's engine can also send KV: prefill a turn of a session it
    /// holds from its cache and ship the KV to another decode worker. A vLLM engine with
    /// NixlConnector can, whatever its `kv_role` (0.32's scheduler serves a request's
    /// `do_remote_decode` as it comes; a `kv_consumer` decode engine has been seen to). With the `kvc` policy's `migrate-with-kv`, a session that
    /// leaves it (drained, over the hard cap, migrated) takes its KV along instead of being
    /// prefilled again elsewhere. It never prefills other sessions' turns. Decode workers
    /// only; refused with `engine = "sglang"`. Default `false`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    #[cfg_attr(feature = "schema", schemars(example = true))]
    pub send_kv: bool,
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
    /// asked for again there; without it a gap resets the worker's index. With `kv-events`,
    /// or on a worker that listens (the router's `kv-events-listen`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// The topic the engine publishes its events under (default: every topic; on a worker
    /// that listens, `kv@<name>@…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_topic: Option<String>,
    /// How many data-parallel ranks the engine runs (default 1), each publishing its own
    /// stream as vLLM does: rank `r` on `kv-events` and `kv-events-replay` with the port
    /// plus `r` (tcp only), each indexed under its rank. With `kv-events`, or on a worker
    /// that listens (its ranks connect to the router's port plus `r`). A worker that reads
    /// its source from the engine is told every rank by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = 2))]
    pub kv_events_ranks: Option<u32>,
    /// The engine's KV block (page) size in tokens, for its events. Default: what its
    /// `/metrics` reports (vLLM's `cache_config_info`); required for SGLang.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = 16))]
    pub block_size: Option<u32>,
    /// Whether what is left out is read from the engine (`engine = "vllm"` with `http-url`
    /// only; default `true` there): `metrics-url` is `<http-url>/metrics` (when the worker has
    /// no snapshot or service address either), and without `kv-events` the event source
    /// (endpoint, replay endpoint, topic) is asked of the engine's `GET /kv_event_sources`,
    /// a wildcard bind host replaced by the `http-url`'s host, retried until it answers.
    /// `false` reads nothing but what is configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = false))]
    pub discover: Option<bool>,
    /// Out of rotation for new work: no decision places a new session or a turn on it (its
    /// sessions move at their next turn), while the requests it runs finish. Changed on a
    /// running router by re-reading the file (SIGHUP) or with the `DrainWorker` call.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drained: bool,
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
            send_kv: false,
            engine: None,
            metrics_url: None,
            kv_events: None,
            kv_events_replay: None,
            kv_events_topic: None,
            kv_events_ranks: None,
            discover: None,
            drained: false,
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
    /// without the key, where the engine is vLLM (any role), and sending its sessions' KV
    /// where `send-kv` says so. A worker without `engine` or
    /// `serve-alone` routes as before capabilities existed.
    pub fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::of_role(self.role);
        if self.role == WorkerRole::Colocated {
            return caps;
        }
        caps.send_kv = self.send_kv;
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

    /// Whether the engine is asked for what is left out (`discover`, by default on for a vLLM
    /// engine with an `http-url`).
    pub fn discovers(&self) -> bool {
        self.engine == Some(EngineKind::Vllm)
            && self.http_url.is_some()
            && self.discover.unwrap_or(true)
    }

    /// Whether the event source is read from the engine: it discovers, has no `kv-events`,
    /// and its load comes from the engine's `/metrics` (which also reports the block size).
    pub fn discovers_events(&self) -> bool {
        self.discovers() && self.kv_events.is_none() && self.metrics_url.is_some()
    }

    /// Whether its KV-cache events arrive at the router's `kv-events-listen` socket
    /// (`router_listens`): it has `engine`, no `kv-events`, and does not read its source from
    /// the engine (such a worker listens when its engine says it connects out).
    pub fn listens_for_events(&self, router_listens: bool) -> bool {
        router_listens
            && self.engine.is_some()
            && self.kv_events.is_none()
            && !self.discovers_events()
    }

    /// `endpoint` as data-parallel rank `rank` uses it: vLLM's port offset (`tcp://H:P` →
    /// `tcp://H:P+rank`); unchanged for rank 0, `None` for a non-tcp endpoint or a port past
    /// 65535 of a rank above 0.
    pub fn rank_endpoint(endpoint: &str, rank: u32) -> Option<String> {
        if rank == 0 {
            return Some(endpoint.to_owned());
        }
        let (base, port) = endpoint.strip_prefix("tcp://")?.rsplit_once(':')?;
        let port = u32::from(port.parse::<u16>().ok()?) + rank;
        (port <= u32::from(u16::MAX)).then(|| format!("tcp://{base}:{port}"))
    }

    /// Fills in what discovery derives from the configuration alone: `metrics-url` from
    /// `http-url` for a discovering worker with no other source of state.
    pub fn fill_from_engine_urls(&mut self) {
        if self.discovers()
            && self.metrics_url.is_none()
            && self.snapshot.is_none()
            && self.address.is_none()
            && let Some(url) = self
                .http_url
                .as_deref()
                .and_then(|u| WorkerUrl::parse(u).ok())
        {
            self.metrics_url = Some(url.uri("/metrics"));
        }
    }

    /// The display name.
    pub fn display_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| format!("w{}", self.id))
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// SGLang's default disaggregation bootstrap port: a prefill worker's when its
/// `bootstrap-port` is absent.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

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

impl WorkerConfig {
    /// Parses one `[[workers]]` entry written as TOML (its keys, without the table's
    /// header), with the keys read from its engine's URLs filled in as in a file; checked
    /// with the rest of the fleet when it is added ([`crate::RouterService::add_worker`]).
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let mut w: WorkerConfig =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        w.fill_from_engine_urls();
        Ok(w)
    }
}

impl RouterConfig {
    /// Parses and validates a TOML document.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let mut cfg: RouterConfig =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        for w in &mut cfg.workers {
            w.fill_from_engine_urls();
        }
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

    /// The configured worker `id`.
    pub fn worker(&self, id: WorkerId) -> Option<&WorkerConfig> {
        self.workers.iter().find(|w| w.id == id.0)
    }
}
