//! # kvc-router — the kvc routing service
//!
//! A gRPC service (`kvc.v1.Router`, defined in `proto/kvc/v1/router.proto`) that decides, for
//! each request of an agent session, which decode worker serves it and whether it goes
//! **direct-to-D** (the session's KV is resident there) or through a prefill worker. Decisions
//! come from a `kvc-policy` policy over live worker state; the router owns the policy's
//! [`kvc_policy::RouterState`].
//!
//! - **Worker state** comes from each worker's shared-memory snapshot (`kvc-admission`, read
//!   without RPC every `refresh-interval-ms`) or, for workers known only by address, from
//!   polling `kvc.v1.Worker/State`. A worker whose state is older than `stale-after-ms` is
//!   `stale`, one that cannot be read or does not answer is `down`; either is out of rotation
//!   until it publishes (answers) again.
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
//!   `max-pending-decisions`.
//! - **Validation**: malformed requests (no `hash_ids` for an input longer than one block, more
//!   `hash_ids` than `ceil(input_length / block)`, zero input, a turn without a session, an
//!   unknown worker, including in `rejected_by`, a message over `max-message-bytes`) get
//!   `INVALID_ARGUMENT`.
//! - **HTTP data plane**: with `http-listen` set, an SGLang/OpenAI-compatible HTTP front
//!   forwards each request to the workers; [`http`] is its specification.
//! - **Engines without decode-side append-prefill**: a decode worker with
//!   `append-prefill = false` never gets a direct-to-D decision (reason `direct-unsupported`).
//! - **Operations**: standard gRPC health and reflection, Prometheus text on `/metrics` (see
//!   [`metrics`] for the series), `tracing` logs, graceful shutdown.
//!
//! ## Running it
//!
//! ```text
//! kvc-router --config crates/kvc-router/examples/router.toml
//! kvc-router --config router.toml --listen 0.0.0.0:50051 --policy kv-aware-v0 --max-sessions 50000
//! RUST_LOG=kvc_router=debug kvc-router --config router.toml
//! ```
//!
//! It prints `kvc-router grpc=<addr> metrics=<addr|none> http=<addr|none>` on stdout once
//! bound and stops cleanly on SIGTERM or SIGINT. `kvc-router --help` lists every option.
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
//! directly, without any transport.
//!
//! ```
//! use kvc_router::{pb, serve, RouterConfig};
//!
//! # tokio::runtime::Runtime::new()?.block_on(async {
//! let config = RouterConfig {
//!     listen: "127.0.0.1:0".parse()?,
//!     metrics_listen: None,
//!     ..RouterConfig::default()
//! };
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let router = serve(config, async { let _ = stopped.await; }).await?;
//!
//! let mut client =
//!     pb::router_client::RouterClient::connect(format!("http://{}", router.grpc_addr())).await?;
//! let workers = client.list_workers(pb::ListWorkersRequest {}).await?.into_inner();
//! assert!(workers.workers.is_empty());
//!
//! let _ = stop.send(());
//! router.wait().await?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`pb`] holds the generated messages, clients and servers; [`convert`] maps the proto enums to
//! and from the stable vocabulary of `kvc-core`, so a proto value and a kvc-core name always
//! mean the same thing.
//!
//! ```
//! use kvc_core::ExecutionMode;
//! use kvc_router::{convert::ProtoEnum, pb};
//!
//! let wire = ExecutionMode::DirectToD.to_proto();
//! assert_eq!(wire, pb::ExecutionMode::DirectToD as i32);
//! assert_eq!(ExecutionMode::from_proto(wire).unwrap(), ExecutionMode::DirectToD);
//! ```
#![forbid(unsafe_code)]

pub mod config;
pub mod convert;
mod error;
mod grpc;
pub mod http;
pub mod metrics;
mod server;
mod service;
pub mod sessions;
mod workers;

pub use config::{HttpConfig, RouterConfig, SessionLimits, WorkerConfig};
pub use error::{ConfigError, RequestError, ServeError};
pub use grpc::{LocalWorker, RouterGrpc};
pub use server::{
    RunningRouter, RunningWorker, serve, serve_service, serve_worker, spawn_background,
};
pub use service::{ProbeOutcome, RouterService, SharedClock};
pub use workers::StateSource;

/// Generated code for the `kvc.v1` protobuf package.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("kvc.v1");

    /// The encoded file descriptor set of `kvc.v1`, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("kvc_v1_descriptor");
}
