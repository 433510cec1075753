//! Simulated workers that speak SGLang's HTTP API — or, with [`WorkerOptions::engine`] `vllm`,
//! vLLM's with NixlConnector P/D (module `vllm`: `POST /v1/completions`,
//! `/v1/chat/completions`, Anthropic's `/v1/messages` and `/v1/messages/count_tokens`, OpenAI's
//! `/v1/responses` instead of `/generate`, no bootstrap servers) — on a real clock.
//!
//! One engine model (the simulator's [`crate::model::Engine`]) runs on its own thread, paced to wall time
//! (`speedup` times faster). Each worker serves, on its own loopback port:
//!
//! | Route | |
//! |---|---|
//! | `POST /generate` | SGLang body: `text`, `sampling_params.max_new_tokens`, `stream`, and on the P→D path `bootstrap_host`, `bootstrap_port`, `bootstrap_room` |
//! | `GET /health`, `/health_generate` | 200 |
//! | `GET /server_info`, `/get_server_info` | role (`disaggregation_mode`), pool size |
//! | `GET /model_info`, `/get_model_info`, `/v1/models` | the model name |
//! | `GET /metrics`, `/kv_event_sources` (vLLM dialect) | its state under vLLM's metric names, and its KV-event publisher (module `vllm_info`) |
//! | `POST /flush_cache` | 200 |
//!
//! **Paths.** A prefill worker needs `bootstrap_room`. A decode worker given a bootstrap room
//! is the decode leg of a P→D request: it asks the prefill worker's bootstrap server
//! (`GET http://<bootstrap_host>:<bootstrap_port>/bootstrap/route?room=<room>`, served by each
//! prefill worker on its own port) which worker it is, then the two legs meet by room in the
//! engine: P prefills, the KV moves to D, D decodes. Legs that do not meet within
//! [`PAIR_TIMEOUT_WALL`] fail with 504. A decode worker given no room runs a direct-to-D
//! turn: its admission needs the session resident and room for the append; otherwise it
//! answers 503 with `x-kvc-admission: rejected` (the contract of `kvc-router`'s HTTP front).
//! A colocated worker prefills and decodes alone.
//!
//! **Answers.** Non-streaming: SGLang's JSON (`text`, `meta_info` with `prompt_tokens`,
//! `completion_tokens`, `cached_tokens`, `finish_reason`). Streaming (`"stream": true`):
//! `data: {...}` events, one at the first token and one at the end, then `data: [DONE]`. The
//! prefill leg answers once its KV reached D. An input over the model's limit gets 400 with
//! `{"error": {"message": "...longer than the model's context length...", "type":
//! "input_too_long"}}`.
//!
//! **Which request is it?** The engine model needs each request's block ids and session: the
//! driver hands the workers a [`Script`] of the requests it will send (`kvc-replay`'s HTTP
//! replay: the trace's), and a worker finds a request by its prompt text
//! ([`crate::prompt::prompt_key`]) among those the driver marked in flight
//! ([`SharedState::register`]). A prompt no one registered gets 400. Standalone workers
//! (module `standalone`) have no script: they tokenize whatever prompt comes.
//!
//! | module | job |
//! |---|---|
//! | this one | the servers' lifecycle: start, addresses, shutdown ([`HttpWorkers`]) |
//! | `state` | what servers, engine thread and driver share: prompts in flight, what was served, engine time |
//! | `script` | the requests a driver announces, by index |
//! | `engine_thread` | the engine paced to wall time, starting requests and reporting their progress |
//! | `rooms` | the two legs of a P→D request meeting by bootstrap room |
//! | `bootstrap` | each prefill worker's bootstrap server, and the client decode workers ask it with |
//! | `sglang` | the SGLang routes, informational answers, `/generate` body and answer shapes |
//! | `generate` | `POST /generate` |
//! | `stream` | streamed answers as SSE events |
//! | `vllm` | the vLLM dialect: OpenAI, Messages and Responses bodies and answers, P's holds pulled by D |
//! | `vllm_info` | what a vLLM worker says of itself on its HTTP port: `/metrics`, `/kv_event_sources` |
//! | `agent` | the Messages and Responses answers, stream events and errors, in vLLM's shapes |
//! | `pd_shim` | the decode side's P/D sidecar behind an endpoint picker (llm-d's `x-prefiller-host-port`) |
//! | `standalone` | workers without a trace ([`HttpWorkers::start_standalone`], `kvc-replay workers`): any prompt, tokenized with the router's rules, sessions named by the session header |

mod agent;
mod bootstrap;
mod engine_thread;
mod generate;
mod pd_shim;
mod rooms;
mod script;
mod sglang;
mod standalone;
mod state;
mod stream;
mod vllm;
mod vllm_info;

pub use script::{Script, ScriptedRequest};
pub use standalone::StandaloneOptions;
pub use state::{Pacer, Served, ServedPath, SharedState};

use crate::model::Micros;
use crate::publish::Publisher;
use crate::{ClusterSpec, WorkerError, check_pacing, check_router_state};
use axum::Router;
use bootstrap::{bootstrap_app, bootstrap_client};
use engine_thread::EngineThread;
use kvc_core::{EngineKind, StateSource, WorkerId, WorkerRole};
use parking_lot::Mutex;
use sglang::{WorkerContext, worker_app};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long (wall time) one leg of a P→D request waits for the other.
pub const PAIR_TIMEOUT_WALL: Duration = Duration::from_secs(10);

/// Settings of the simulated HTTP workers.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Wall time runs this many times faster than engine time.
    pub speedup: f64,
    /// Serve worker `i` on `127.0.0.1:<base + i>` (free ports when `None`).
    pub http_base_port: Option<u16>,
    /// Serve prefill worker `i`'s bootstrap server on `127.0.0.1:<base + i>` (free ports when
    /// `None`).
    pub bootstrap_base_port: Option<u16>,
    /// Directory of the snapshot files the workers publish (`w<id>.snap`).
    pub snapshot_dir: PathBuf,
    /// Resident-session slots in each snapshot.
    pub table_slots: usize,
    /// Model name the workers report.
    pub model: String,
    /// Where the router reads the workers' state: `snapshot`, or `events` (each worker also
    /// serves vLLM-named `/metrics`, see [`crate::publish::engine_signals`]).
    pub router_state: StateSource,
    /// With `events`: worker `i`'s `/metrics` on `127.0.0.1:<base + i>` (free ports when
    /// `None`).
    pub engine_base_port: Option<u16>,
    /// The HTTP API the workers speak: SGLang's (`/generate`, bootstrap rooms) or vLLM's
    /// (OpenAI routes with NixlConnector `kv_transfer_params`, see `vllm`).
    pub engine: EngineKind,
    /// Fault injection for tests (vLLM dialect only); none by default.
    pub faults: Faults,
    /// vLLM dialect: each decode worker runs llm-d's decode-side P/D sidecar (see
    /// `pd_shim`): a request naming a prefill worker in `x-prefiller-host-port` is prefilled
    /// there first; for a router that follows that convention (kvc-router's endpoint picker
    /// behind Envoy).
    pub pd_shim: bool,
}

/// Faults the simulated vLLM workers can be told to show (for tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Every prefill worker answers 500 to a `do_remote_decode` request (the router then
    /// sends the request to its decode worker alone).
    pub fail_prefill: bool,
    /// Every decode worker drops the session's KV just before serving a plain request (an
    /// eviction the router has not heard of: a direct-to-D turn becomes a full prefill).
    pub evict_before_plain: bool,
}

impl WorkerOptions {
    /// Checks the settings the workers cannot run with: a positive, finite speedup and at
    /// least one snapshot slot.
    pub fn validate(&self) -> Result<(), WorkerError> {
        check_pacing(self.speedup, self.table_slots)?;
        check_router_state(self.router_state)?;
        if self.router_state == StateSource::Events && self.engine != EngineKind::Vllm {
            return Err(WorkerError::Invalid(
                "the simulated workers show their state as vLLM engines do: reading it from \
                 their events (--router-state events) over HTTP needs --engine vllm"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// The running simulated workers.
pub struct HttpWorkers {
    shared: Arc<SharedState>,
    addrs: Vec<SocketAddr>,
    bootstrap_ports: Vec<Option<u16>>,
    engine: Option<std::thread::JoinHandle<Result<(), WorkerError>>>,
    dialect: EngineKind,
    /// Each worker's engine signals, when served.
    engine_urls: Vec<crate::publish::engine_signals::EngineEndpoints>,
    /// Stops the servers and the engine thread; cancelled on [`HttpWorkers::stop`] and on drop.
    shutdown: CancellationToken,
}

impl HttpWorkers {
    /// Starts the engine thread and every worker's HTTP server (and each prefill worker's
    /// bootstrap server) on `runtime`. The script is what the driver will send: workers find
    /// requests in it.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        script: Arc<Script>,
        cluster: &ClusterSpec,
        opts: &WorkerOptions,
    ) -> Result<Self, WorkerError> {
        Self::start_with(runtime, script, cluster, opts, None)
    }

    /// Starts standalone workers (`kvc-replay workers`): no trace, any prompt from any client
    /// (see `standalone`), in vLLM's dialect. The engine's prefix caches count blocks of
    /// `standalone.block_size` tokens (`cluster`'s block size is not used); a router
    /// configured for them should count the same.
    pub fn start_standalone(
        runtime: &tokio::runtime::Handle,
        cluster: &ClusterSpec,
        opts: &WorkerOptions,
        standalone: StandaloneOptions,
    ) -> Result<Self, WorkerError> {
        if opts.engine != EngineKind::Vllm {
            return Err(WorkerError::Invalid(
                "standalone workers speak vLLM's OpenAI API (--engine vllm)".into(),
            ));
        }
        let cluster = ClusterSpec {
            block_size: standalone.block_size,
            ..cluster.clone()
        };
        Self::start_with(runtime, Arc::default(), &cluster, opts, Some(standalone))
    }

    fn start_with(
        runtime: &tokio::runtime::Handle,
        script: Arc<Script>,
        cluster: &ClusterSpec,
        opts: &WorkerOptions,
        standalone: Option<StandaloneOptions>,
    ) -> Result<Self, WorkerError> {
        opts.validate()?;
        let roles = cluster.roles();
        let names = crate::cluster::worker_names(&roles);
        let shutdown = CancellationToken::new();
        let mut publisher = Publisher::for_router_state(
            cluster,
            opts.router_state,
            &opts.snapshot_dir,
            opts.table_slots,
        )?;
        let engine_urls = if opts.router_state == StateSource::Events {
            publisher.serve_engine_signals(
                runtime,
                opts.engine_base_port,
                &opts.model,
                u64::from(cluster.block_size.tokens()),
                &shutdown,
            )?
        } else {
            Vec::new()
        };
        let board = publisher.board();
        let labels = crate::publish::SessionLabels::default();
        if standalone.is_some() {
            publisher.label_sessions(labels.clone());
        }
        let engine = cluster.engine();
        let (to_engine, requests) = mpsc::channel();
        let shared = Arc::new(SharedState {
            served: Mutex::new(vec![Served::default(); script.len()]),
            script,
            roles: roles.clone(),
            names: names.clone(),
            in_flight: Mutex::new(HashMap::new()),
            engine: Mutex::new(to_engine),
            max_input: cluster.profile.model.max_input_tokens,
            pool_tokens: cluster.profile.hardware.kv_pool_tokens,
            profile: cluster.profile.clone(),
            model: opts.model.clone(),
            clock: Pacer {
                start: Instant::now(),
                speedup: opts.speedup,
            },
            holds: Mutex::new(HashMap::new()),
            standalone: standalone.map(|o| standalone::Standalone::new(o, labels.clone())),
        });
        let mut engine_thread = EngineThread::new(
            engine,
            shared.clone(),
            publisher,
            opts.speedup,
            (PAIR_TIMEOUT_WALL.as_secs_f64() * 1e6 * opts.speedup) as Micros,
        );
        // Fresh snapshots before anyone reads them.
        engine_thread.publish()?;
        let engine_shutdown = shutdown.clone();
        let engine = std::thread::Builder::new()
            .name("kvc-sim-engine".into())
            .spawn(move || engine_thread.run(requests, engine_shutdown))
            .map_err(|e| WorkerError::Invalid(format!("cannot start the engine thread: {e}")))?;
        let client = bootstrap_client();
        let shim = (opts.pd_shim && opts.engine == EngineKind::Vllm)
            .then(|| Arc::new(pd_shim::PdShim::new()));
        let mut addrs = Vec::new();
        let mut bootstrap_ports = Vec::new();
        for (i, role) in roles.iter().enumerate() {
            let id = WorkerId(i as u32);
            let bootstrap = if *role == WorkerRole::Prefill && opts.engine == EngineKind::Sglang {
                let port = opts
                    .bootstrap_base_port
                    .map_or(0, |b| b.saturating_add(i as u16));
                let app = bootstrap_app(id, names[i].clone());
                let addr = serve(runtime, port, app, shutdown.clone())?;
                Some(addr.port())
            } else {
                None
            };
            let port = opts
                .http_base_port
                .map_or(0, |b| b.saturating_add(i as u16));
            let (listener, addr) = bind(runtime, port)?;
            let ctx = Arc::new(WorkerContext {
                id,
                role: *role,
                name: names[i].clone(),
                shared: shared.clone(),
                client: client.clone(),
                addr,
                faults: opts.faults,
                pd_shim: shim.clone(),
                board: Arc::clone(&board),
                events: engine_urls.get(i).cloned(),
            });
            let vllm = opts.engine == EngineKind::Vllm;
            spawn_serve(runtime, listener, worker_app(ctx, vllm), shutdown.clone());
            addrs.push(addr);
            bootstrap_ports.push(bootstrap);
        }
        if let Some(shim) = &shim {
            shim.allow(
                roles
                    .iter()
                    .zip(&addrs)
                    .filter(|(r, _)| **r == WorkerRole::Prefill)
                    .map(|(_, a)| *a),
            );
        }
        Ok(HttpWorkers {
            shared,
            addrs,
            bootstrap_ports,
            engine: Some(engine),
            dialect: opts.engine,
            engine_urls,
            shutdown,
        })
    }

    /// What the worker servers, the engine thread and a driver share.
    pub fn shared(&self) -> &Arc<SharedState> {
        &self.shared
    }

    /// Each worker's engine signals, by worker id (empty unless the router reads them).
    pub fn engine_urls(&self) -> &[crate::publish::engine_signals::EngineEndpoints] {
        &self.engine_urls
    }

    /// Each worker's HTTP address, by worker id.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The HTTP API the workers speak.
    pub fn engine(&self) -> EngineKind {
        self.dialect
    }

    /// Each worker's bootstrap port (SGLang prefill workers only), by worker id.
    pub fn bootstrap_ports(&self) -> &[Option<u16>] {
        &self.bootstrap_ports
    }

    /// Worker roles, by worker id.
    pub fn roles(&self) -> &[WorkerRole] {
        &self.shared.roles
    }

    /// Stops the servers and the engine thread, and waits for the engine thread.
    pub fn stop(mut self) -> Result<(), WorkerError> {
        self.shutdown.cancel();
        match self.engine.take().map(std::thread::JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(WorkerError::Invalid("the engine thread panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for HttpWorkers {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// An HTTP connector with `TCP_NODELAY` (a request's last segment is not held back waiting
/// for the ACK of the previous one).
pub fn connector() -> hyper_util::client::legacy::connect::HttpConnector {
    let mut c = hyper_util::client::legacy::connect::HttpConnector::new();
    c.set_nodelay(true);
    c
}

/// Serves `app` on `127.0.0.1:<port>` (a free port for 0) until `shutdown` is cancelled;
/// returns the bound address.
fn serve(
    runtime: &tokio::runtime::Handle,
    port: u16,
    app: Router,
    shutdown: CancellationToken,
) -> Result<SocketAddr, WorkerError> {
    let (listener, bound) = bind(runtime, port)?;
    spawn_serve(runtime, listener, app, shutdown);
    Ok(bound)
}

/// A listener on `127.0.0.1:<port>` (a free port for 0) and its address.
fn bind(
    runtime: &tokio::runtime::Handle,
    port: u16,
) -> Result<(tokio::net::TcpListener, SocketAddr), WorkerError> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(addr))
        .map_err(|e| WorkerError::Serve(format!("cannot listen on {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| WorkerError::Serve(format!("cannot listen on {addr}: {e}")))?;
    Ok((listener, bound))
}

/// Serves `app` on `listener` until `shutdown` is cancelled.
fn spawn_serve(
    runtime: &tokio::runtime::Handle,
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: CancellationToken,
) {
    runtime.spawn(async move {
        // Small SSE events go out at once (no Nagle delay behind a delayed ACK).
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
    });
}
