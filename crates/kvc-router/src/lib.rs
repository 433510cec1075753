//! # kvc-router — the kvc routing service
//!
//! A gRPC service (`kvc.v1.Router`, defined in `proto/kvc/v1/router.proto`) that decides, for
//! each request of an agent session, which decode worker serves it and whether it goes
//! **direct-to-D** (the session's KV is resident there) or through a prefill worker. Decisions
//! come from a `kvc-policy` policy over live worker state; the router owns the policy's
//! [`kvc_policy::RouterState`].
//!
//! - **Worker state** comes from each worker's shared-memory snapshot (`kvc-admission`, read
//!   without RPC every `refresh-interval-ms`), for a stock engine (`engine = "vllm" |
//!   "sglang"`, `metrics-url`) from scraping its Prometheus `/metrics` ([`engine_load`] reads
//!   both engines' names), or, for workers known only by address, from polling
//!   `kvc.v1.Worker/State`. A worker whose state is older than `stale-after-ms` (for an engine,
//!   `engine-signals.stale-after-ms`) is `stale`, one that cannot be read or does not answer
//!   is `down`; either is out of rotation until it publishes (answers) again.
//! - **Engine KV-cache events**: a worker with `kv-events` (and `engine`) has a ZeroMQ
//!   subscriber (`kvc-events`) that indexes the blocks its engine stores and removes, with the
//!   session that stored them (`session_id`, mapped with [`kvc_core::SessionId::from_key`]).
//!   A direct-to-D plan onto a worker whose events show none of the session's blocks is an
//!   eviction the policy learns before it decides again; a session the router has no
//!   placement for, which the events show on a worker, is adopted there (another replica
//!   placed it). `ListWorkers` and `/metrics` report
//!   each subscriber's indexed blocks, last sequence number, gaps, replays and resets.
//! - **Probe path**: when the policy plans `direct-to-d`, the router probes that decode worker's
//!   snapshot for the decision's footprint; if it cannot admit, the reject is fed back
//!   (`AdmissionRejected`) and the request re-routed through a prefill worker
//!   (`RouteDecision.probe_rejected_by` says so). A caller whose own admission refused a
//!   direct-to-D decision asks again with `RouteRequest.rejected_by` and gets a P→D path.
//! - **Feedback**: `ReportOutcome` (by decision id) tells the policy what is now resident (a
//!   direct-to-D decision reported `rejected`, refused by D's admission, leaves it as it was);
//!   `CommitEvict` is forwarded to the worker's commit queue and its evictions observed.
//! - **Bounded memory**: sessions expire after `sessions.ttl-ms` and the least recently seen
//!   are forgotten beyond `sessions.max`; decisions awaiting an outcome are bounded by
//!   `max-pending-decisions`; the policy state's block view and each session's block list by
//!   the `[limits]` table ([`config::Limits`]), each worker's block bound set from its
//!   `capacity-tokens`.
//! - **Validation**: malformed requests (bytes that are not a protobuf message of the method's
//!   type, no `hash_ids` for an input longer than one block, more `hash_ids` than
//!   `ceil(input_length / block)`, zero input or more than `limits.max-input-tokens`, a turn
//!   without a session, an unknown worker, including in `rejected_by`, a message over
//!   `max-message-bytes`, `resident_tokens` over the decode worker's capacity) get
//!   `INVALID_ARGUMENT`.
//! - **Security**: a bearer token per listener ([`auth`], from a file or an environment
//!   variable) and TLS with rustls on both listeners, mutual on gRPC as an option ([`tls`]).
//! - **HTTP data plane**: with `http-listen` set, an SGLang/OpenAI-compatible HTTP front
//!   forwards each request to the workers; [`http`] is its specification.
//! - **Endpoint picker**: with `epp-listen` set, Envoy's ext_proc service: Envoy forwards
//!   each request to the worker picked with the HTTP front's request reading and the same
//!   decisions; [`epp`] is its specification.
//! - **Engines without decode-side append-prefill**: a decode worker with
//!   `append-prefill = false` never gets a direct-to-D decision (reason `direct-unsupported`).
//! - **Workers that serve turns alone**: a worker's capabilities
//!   ([`WorkerConfig::capabilities`]) go into every view the policy sees; a prefill or
//!   decode worker that may serve a turn alone (`serve-alone`, by default every
//!   `engine = "vllm"` worker) can be given `local-prefill` decisions, which the HTTP front
//!   forwards as the client's own request to it. Without `engine` or `serve-alone`, none is.
//! - **Operations**: standard gRPC health and reflection, Prometheus text on `/metrics` (see
//!   [`metrics`] for the series), `tracing` logs, graceful shutdown; with a `[tracing]`
//!   table, OpenTelemetry spans per request and worker call over OTLP ([`telemetry`]).
//!
//! ## Running it
//!
//! ```text
//! kvc-router --prefill http://10.0.0.1:8000 --decode http://10.0.0.2:8000
//! kvc-router check --prefill http://10.0.0.1:8000 --decode http://10.0.0.2:8000
//! kvc-router --config crates/kvc-router/examples/router.toml
//! kvc-router --config router.toml --listen 0.0.0.0:50051 --policy kv-aware-v0 --max-sessions 50000
//! RUST_LOG=kvc_router=debug kvc-router --config router.toml
//! ```
//!
//! It prints `kvc-router grpc=<addr> metrics=<addr|none> http=<addr|none> epp=<addr|none>` on stdout once
//! bound and stops cleanly on SIGTERM or SIGINT. `kvc-router --help` lists every option.
//! Workers named by URL on the command line are made into configuration entries by
//! [`flag_workers`]; `kvc-router check` is [`check`].
//!
//! ## Configuration
//!
//! TOML, keys in kebab-case ([`RouterConfig`]); `crates/kvc-router/examples/router.toml` is a
//! complete example:
//!
//! ```toml
//! listen = "127.0.0.1:50051"
//! metrics-listen = "127.0.0.1:9464"
//! # Optional: the HTTP data plane (absent: none).
//! http-listen = "127.0.0.1:8000"
//! stale-after-ms = 1000
//!
//! [sessions]
//! ttl-ms = 600000
//! max = 100000
//!
//! [policy]
//! policy = "kvc-v2"
//! hard-cap = 0.85
//!
//! [[workers]]
//! id = 0
//! role = "prefill"
//! capacity-tokens = 92000
//! address = "http://127.0.0.1:50060"
//! # Its SGLang HTTP server and disaggregation bootstrap port (default 8998).
//! http-url = "http://127.0.0.1:30000"
//! bootstrap-port = 8998
//!
//! [[workers]]
//! id = 1
//! role = "decode"
//! capacity-tokens = 92000
//! snapshot = "/dev/shm/kvc-w1.snap"
//! http-url = "http://127.0.0.1:30001"
//! # Its engine append-prefills a direct-to-D turn's new tokens (the default).
//! append-prefill = true
//! ```
//!
//! ## In process
//!
//! [`serve`] binds both listeners, starts the background tasks and returns the bound addresses;
//! the servers stop when the shutdown future completes. [`RouterService`] can also be used
//! directly, without any transport: it takes and returns `kvc-core`/`kvc-policy` types
//! ([`RouterService::route`] a [`kvc_policy::RouteRequest`], answering a [`RouterDecision`]).
//! Protobuf types live in the `kvc-proto` crate and appear only in the gRPC front ([`grpc`],
//! with an example of a client calling a router served in process).
//!
//! ```
//! use kvc_core::{BlockHash, RequestId, SessionId, TurnId};
//! use kvc_policy::RouteRequest;
//! use kvc_router::{RequestError, RouterConfig, RouterService};
//!
//! let service = RouterService::new(RouterConfig::default())?;
//! let hashes = [BlockHash(11), BlockHash(12)];
//! let request = RouteRequest::new(RequestId(1), 1_000, 40, &hashes)
//!     .in_session(SessionId(7), TurnId(1));
//! // No worker is configured, so none can take it; nothing is left pending.
//! assert!(service.route(&request).is_err());
//! assert_eq!(service.pending_decisions(), 0);
//! // A malformed request is refused before any policy runs.
//! let empty = RouteRequest::new(RequestId(2), 0, 40, &[]);
//! assert!(matches!(service.route(&empty), Err(RequestError::InvalidArgument(_))));
//! # Ok::<(), kvc_router::ConfigError>(())
//! ```
#![forbid(unsafe_code)]

pub mod auth;
pub mod check;
pub mod config;
mod discovery;
pub mod engine_load;
pub mod epp;
mod error;
pub mod flag_workers;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod pool;
mod server;
mod service;
pub mod sessions;
pub mod telemetry;
pub mod tls;
mod worker_http;
mod workers;

pub use config::{
    EngineSignalsConfig, HttpConfig, InferencePoolConfig, RouterConfig, SessionLimits,
    TracingConfig, WorkerConfig,
};
pub use error::{ConfigError, RequestError, ServeError};
pub use grpc::RouterGrpc;
pub use server::{RunningRouter, serve, serve_service, spawn_background};
pub use service::{
    DecisionOutcome, FleetChange, KV_EVENTS_CATCH_UP_MS, ListedWorker, ProbeOutcome, RankEvents,
    Reload, Removed, RouterDecision, RouterService, SessionView, SharedClock,
};
