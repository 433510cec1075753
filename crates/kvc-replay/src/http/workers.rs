//! Simulated workers that speak SGLang's HTTP API, on a real clock.
//!
//! One engine model (the simulator's [`Engine`]) runs on its own thread, paced to wall time
//! (`speedup` times faster). Each worker serves, on its own loopback port:
//!
//! | Route | |
//! |---|---|
//! | `POST /generate` | SGLang body: `text`, `sampling_params.max_new_tokens`, `stream`, and on the P→D path `bootstrap_host`, `bootstrap_port`, `bootstrap_room` |
//! | `GET /health`, `/health_generate` | 200 |
//! | `GET /server_info`, `/get_server_info` | role (`disaggregation_mode`), pool size |
//! | `GET /model_info`, `/get_model_info`, `/v1/models` | the model name |
//! | `POST /flush_cache` | 200 |
//!
//! **Paths.** A prefill worker needs `bootstrap_room`. A decode worker given a bootstrap room
//! is the D half of a P→D request: it asks the prefill worker's bootstrap server
//! (`GET http://<bootstrap_host>:<bootstrap_port>/bootstrap/route?room=<room>`, served by each
//! prefill worker on its own port) which worker it is, then the two halves meet by room in the
//! engine: P prefills, the KV moves to D, D decodes. Halves that do not meet within
//! [`PAIR_TIMEOUT_WALL`] fail with 504. A decode worker given no room runs a direct-to-D
//! turn: its admission needs the session resident and room for the append; otherwise it
//! answers 503 with `x-kvc-admission: rejected` (the contract of `kvc-router`'s HTTP front).
//! A colocated worker prefills and decodes alone.
//!
//! **Answers.** Non-streaming: SGLang's JSON (`text`, `meta_info` with `prompt_tokens`,
//! `completion_tokens`, `cached_tokens`, `finish_reason`). Streaming (`"stream": true`):
//! `data: {...}` events, one at the first token and one at the end, then `data: [DONE]`. The
//! prefill half answers once its KV reached D. An input over the model's limit gets 400 with
//! `{"error": {"message": "...longer than the model's context length...", "type":
//! "input_too_long"}}`.
//!
//! **Which request is it?** The engine model needs the trace's block ids and session; the
//! worker finds the trace request by its prompt text ([`super::prompt_key`]) among those the
//! driver registered as in flight. A prompt no one registered gets 400.

use super::prompt::prompt_key;
use crate::live::{LiveError, Publisher};
use crate::sim::SimConfig;
use crate::sim::engine::{DirectAdmission, Engine, EngineOptions, Event, Job, Micros, Wake};
use crate::trace::Trace;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvc_core::{Outcome, WorkerId, WorkerRole};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

/// How long (wall time) one half of a P→D request waits for the other.
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
}

/// How a request was carried out, as the workers saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedPath {
    /// Prefill on `prefill`, KV to `decode`.
    PrefillDecode {
        /// Prefill worker.
        prefill: WorkerId,
        /// Decode worker.
        decode: WorkerId,
    },
    /// Direct-to-D on the decode worker.
    Direct(WorkerId),
    /// Colocated worker.
    Colocated(WorkerId),
}

/// What the workers saw of one trace request (its last attempt).
#[derive(Debug, Clone, Default)]
pub struct Served {
    /// First arrival of the request at any worker.
    pub arrived: Option<Instant>,
    /// The path of the attempt that was carried out.
    pub path: Option<ServedPath>,
    /// Prompt tokens served from a cache.
    pub cached: u64,
    /// When the first token's event was handed to the HTTP server.
    pub first_sent: Option<Instant>,
    /// When the last event (or the whole answer) was handed to the HTTP server.
    pub done_sent: Option<Instant>,
    /// A failure the engine reported (transfer timeout).
    pub failure: Option<Outcome>,
    /// Direct-to-D attempts the decode worker's admission refused.
    pub admission_rejects: u32,
    /// Times a decode or colocated worker got this request (once per attempt).
    pub attempts: u32,
}

/// State shared by the worker servers, the engine thread and the driver.
pub(crate) struct Shared {
    pub(crate) trace: Arc<Trace>,
    roles: Vec<WorkerRole>,
    names: Vec<String>,
    /// Prompt key -> trace indices in flight with that prompt.
    registry: Mutex<HashMap<u64, Vec<usize>>>,
    served: Mutex<Vec<Served>>,
    commands: Mutex<mpsc::Sender<Command>>,
    max_input: u64,
    pool_tokens: u64,
    model: String,
    clock: Pacer,
}

impl Shared {
    /// Marks trace request `index` (prompt `key`) as in flight.
    pub(crate) fn register(&self, key: u64, index: usize) {
        self.registry.lock().entry(key).or_default().push(index);
    }

    /// The request is over.
    pub(crate) fn unregister(&self, key: u64, index: usize) {
        let mut reg = self.registry.lock();
        if let Some(v) = reg.get_mut(&key) {
            v.retain(|i| *i != index);
            if v.is_empty() {
                reg.remove(&key);
            }
        }
    }

    fn find(&self, key: u64) -> Option<usize> {
        self.registry
            .lock()
            .get(&key)
            .and_then(|v| v.iter().min().copied())
    }

    fn with_served(&self, index: usize, f: impl FnOnce(&mut Served)) {
        if let Some(s) = self.served.lock().get_mut(index) {
            f(s);
        }
    }

    /// What the workers saw of every request, by trace index.
    pub(crate) fn served(&self) -> Vec<Served> {
        self.served.lock().clone()
    }

    pub(crate) fn names(&self) -> &[String] {
        &self.names
    }

    fn send(&self, c: Command) -> bool {
        self.commands.lock().send(c).is_ok()
    }
}

/// Engine time from wall time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pacer {
    pub(crate) start: Instant,
    pub(crate) speedup: f64,
}

impl Pacer {
    pub(crate) fn engine_now(&self) -> Micros {
        (self.start.elapsed().as_secs_f64() * 1e6 * self.speedup) as Micros
    }

    pub(crate) fn engine_at(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.start).as_secs_f64() * self.speedup
    }

    fn wall_of(&self, t: Micros) -> Instant {
        self.start + Duration::from_secs_f64(t as f64 / 1e6 / self.speedup)
    }
}

/// What a worker asks the engine to start.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Colocated(WorkerId),
    Direct(WorkerId),
    PrefillHalf {
        room: u64,
        prefill: WorkerId,
    },
    DecodeHalf {
        room: u64,
        decode: WorkerId,
        prefill: WorkerId,
    },
}

/// Progress of one started request, sent to the HTTP handler.
#[derive(Debug, Clone)]
enum Progress {
    /// The engine took it (the first message of every start that is not refused).
    Accepted,
    /// Direct-to-D refused by admission.
    Rejected(String),
    /// The first token (for a prefill half: its KV reached D).
    FirstToken,
    /// Finished.
    Done { cached: u64 },
    /// Failed (status, outcome, message).
    Failed(StatusCode, String),
}

enum Command {
    Start {
        index: usize,
        job: Job,
        kind: Kind,
        reply: UnboundedSender<Progress>,
    },
    Stop,
}

/// One started engine job: who hears about it.
struct Running {
    index: usize,
    decode: UnboundedSender<Progress>,
    prefill: Option<UnboundedSender<Progress>>,
    path: ServedPath,
}

/// The half of a P→D request waiting for the other.
struct Half {
    index: usize,
    kind: Kind,
    reply: UnboundedSender<Progress>,
    deadline: Micros,
}

/// The engine thread's state.
struct EngineLoop {
    engine: Engine,
    roles: Vec<WorkerRole>,
    shared: Arc<Shared>,
    wakes: BinaryHeap<Reverse<(Micros, u64, Wake)>>,
    seq: u64,
    /// Engine job id -> its listeners.
    running: HashMap<usize, Running>,
    next_job: usize,
    halves: HashMap<u64, Half>,
    deadlines: BTreeSet<(Micros, u64)>,
    publisher: Publisher,
    start_wall_ms: u64,
    speedup: f64,
    last: Micros,
    pair_timeout: Micros,
}

impl EngineLoop {
    fn run(mut self, commands: mpsc::Receiver<Command>) -> Result<(), LiveError> {
        let clock = self.shared.clock;
        let mut last_publish = Instant::now();
        loop {
            self.advance(clock.engine_now());
            if last_publish.elapsed() >= Duration::from_millis(5) {
                self.publish()?;
                last_publish = Instant::now();
            }
            let next = self
                .wakes
                .peek()
                .map(|Reverse((t, _, _))| *t)
                .into_iter()
                .chain(self.deadlines.first().map(|(t, _)| *t))
                .min();
            let wait = match next {
                Some(t) => clock
                    .wall_of(t)
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(20)),
                None => Duration::from_millis(20),
            };
            match commands.recv_timeout(wait) {
                Ok(Command::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Ok(Command::Start {
                    index,
                    job,
                    kind,
                    reply,
                }) => {
                    let now = clock.engine_now();
                    self.advance(now);
                    self.start(index, job, kind, reply);
                    self.drain();
                    // Publish at once: the router's next decision should see this request.
                    self.publish()?;
                    last_publish = Instant::now();
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
        Ok(())
    }

    /// Handles every wake and expired half due by `now`.
    fn advance(&mut self, now: Micros) {
        let now = now.max(self.last);
        while let Some(Reverse((t, _, key))) = self.wakes.peek().copied() {
            if t > now {
                break;
            }
            self.wakes.pop();
            let t = t.max(self.last);
            self.last = t;
            self.engine.wake(key, t);
            self.drain();
        }
        while let Some((t, room)) = self.deadlines.first().copied() {
            if t > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(h) = self.halves.remove(&room) {
                let _ = h.reply.send(Progress::Failed(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("bootstrap room {room}: the other half of the request never came"),
                ));
            }
        }
        self.last = now;
    }

    fn publish(&mut self) -> Result<(), LiveError> {
        self.publisher
            .publish(&self.engine, self.start_wall_ms, self.speedup)
    }

    fn start(&mut self, index: usize, mut job: Job, kind: Kind, reply: UnboundedSender<Progress>) {
        let now = self.last;
        let id = self.next_job;
        self.next_job += 1;
        job.id = id;
        match kind {
            Kind::Colocated(w) => {
                self.engine.start_colocated(job, w, now);
                let _ = reply.send(Progress::Accepted);
                self.running.insert(
                    id,
                    Running {
                        index,
                        decode: reply,
                        prefill: None,
                        path: ServedPath::Colocated(w),
                    },
                );
            }
            Kind::Direct(d) => {
                let resident = self.engine.resident_tokens(d, job.session).unwrap_or(0);
                let need = (job.input + job.output).saturating_sub(resident);
                match self.engine.try_direct(job, d, need, now) {
                    DirectAdmission::Admitted { .. } => {
                        let _ = reply.send(Progress::Accepted);
                        self.running.insert(
                            id,
                            Running {
                                index,
                                decode: reply,
                                prefill: None,
                                path: ServedPath::Direct(d),
                            },
                        );
                    }
                    DirectAdmission::NotResident => {
                        let _ = reply.send(Progress::Rejected(
                            "the session is not resident on this decode worker".into(),
                        ));
                    }
                    DirectAdmission::Rejected => {
                        let _ = reply.send(Progress::Rejected(
                            "no room for the session's append on this decode worker".into(),
                        ));
                    }
                }
            }
            Kind::PrefillHalf { room, .. } | Kind::DecodeHalf { room, .. } => {
                let is_prefill = matches!(kind, Kind::PrefillHalf { .. });
                let Some(other) = self.halves.remove(&room) else {
                    let deadline = now + self.pair_timeout;
                    self.deadlines.insert((deadline, room));
                    self.halves.insert(
                        room,
                        Half {
                            index,
                            kind,
                            reply,
                            deadline,
                        },
                    );
                    return;
                };
                self.deadlines.remove(&(other.deadline, room));
                let fail =
                    |a: &UnboundedSender<Progress>, b: &UnboundedSender<Progress>, m: String| {
                        for r in [a, b] {
                            let _ = r.send(Progress::Failed(StatusCode::BAD_REQUEST, m.clone()));
                        }
                    };
                let (p_half, d_half) = if is_prefill {
                    ((kind, &reply), (other.kind, &other.reply))
                } else {
                    ((other.kind, &other.reply), (kind, &reply))
                };
                let (
                    Kind::PrefillHalf { prefill, .. },
                    Kind::DecodeHalf {
                        decode,
                        prefill: resolved,
                        ..
                    },
                ) = (p_half.0, d_half.0)
                else {
                    fail(
                        &reply,
                        &other.reply,
                        format!("bootstrap room {room} was given to two workers of one role"),
                    );
                    return;
                };
                if other.index != index {
                    fail(
                        &reply,
                        &other.reply,
                        format!("bootstrap room {room} joins two different prompts"),
                    );
                    return;
                }
                if resolved != prefill {
                    fail(
                        &reply,
                        &other.reply,
                        format!(
                            "bootstrap room {room}: the decode worker was pointed at worker {} \
                             but the prefill half is on worker {}",
                            resolved.0, prefill.0
                        ),
                    );
                    return;
                }
                // The session moves to `decode`: its KV elsewhere is released (as in `sim`).
                for (w, role) in self.roles.iter().enumerate() {
                    let w = WorkerId(w as u32);
                    if *role == WorkerRole::Decode && w != decode {
                        self.engine.release_session(w, job.session, now);
                    }
                }
                self.engine.start_p_to_d(job, prefill, decode, now);
                let _ = p_half.1.send(Progress::Accepted);
                let _ = d_half.1.send(Progress::Accepted);
                self.running.insert(
                    id,
                    Running {
                        index,
                        decode: d_half.1.clone(),
                        prefill: Some(p_half.1.clone()),
                        path: ServedPath::PrefillDecode { prefill, decode },
                    },
                );
            }
        }
    }

    fn drain(&mut self) {
        for (t, w) in self.engine.take_wakes() {
            self.seq += 1;
            self.wakes.push(Reverse((t, self.seq, w)));
        }
        for ev in self.engine.take_events() {
            match ev {
                Event::FirstToken { id, .. } => {
                    if let Some(r) = self.running.get_mut(&id) {
                        let _ = r.decode.send(Progress::FirstToken);
                        if let Some(p) = r.prefill.take() {
                            let _ = p.send(Progress::FirstToken);
                        }
                    }
                }
                Event::Done { id, cached, .. } => {
                    if let Some(r) = self.running.remove(&id) {
                        self.shared.with_served(r.index, |s| {
                            s.path = Some(r.path);
                            s.cached = cached;
                        });
                        let _ = r.decode.send(Progress::Done { cached });
                    }
                }
                Event::TransferTimedOut { id, .. } => {
                    if let Some(r) = self.running.remove(&id) {
                        self.shared.with_served(r.index, |s| {
                            s.path = Some(r.path);
                            s.failure = Some(Outcome::KvTransferTimeout);
                        });
                        let failed = Progress::Failed(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "the KV transfer to the decode worker timed out".into(),
                        );
                        for tx in std::iter::once(&r.decode).chain(r.prefill.as_ref()) {
                            let _ = tx.send(failed.clone());
                        }
                    }
                }
                Event::Evicted { .. } => {}
            }
        }
    }
}

/// The running simulated workers.
pub struct HttpWorkers {
    pub(crate) shared: Arc<Shared>,
    addrs: Vec<SocketAddr>,
    bootstrap_ports: Vec<Option<u16>>,
    engine: Option<std::thread::JoinHandle<Result<(), LiveError>>>,
    stop: tokio_util_stop::Stop,
}

mod tokio_util_stop {
    /// Stops the servers when dropped or told to.
    #[derive(Debug)]
    pub(crate) struct Stop(pub(crate) Option<tokio::sync::watch::Sender<bool>>);

    impl Stop {
        pub(crate) fn stop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(true);
            }
        }
    }

    impl Drop for Stop {
        fn drop(&mut self) {
            self.stop();
        }
    }
}

impl HttpWorkers {
    /// Starts the engine thread and every worker's HTTP server (and each prefill worker's
    /// bootstrap server) on `runtime`. The trace is what the driver will send: workers find
    /// requests in it.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        trace: Arc<Trace>,
        cfg: &SimConfig,
        opts: &WorkerOptions,
    ) -> Result<Self, LiveError> {
        if !(opts.speedup.is_finite() && opts.speedup > 0.0) {
            return Err(LiveError::Invalid(format!(
                "speedup must be a positive number (got {})",
                opts.speedup
            )));
        }
        let roles = crate::sim::worker_roles(cfg.topology);
        let names = crate::sim::worker_names(&roles);
        let publisher = Publisher::create(cfg, &opts.snapshot_dir, opts.table_slots)?;
        let engine = Engine::new(
            cfg.profile.clone(),
            EngineOptions {
                eviction: cfg.eviction.into(),
                block_size: trace.block_size(),
            },
            &roles,
            cfg.seed,
            cfg.jitter,
        );
        let (tx, rx) = mpsc::channel();
        let clock = Pacer {
            start: Instant::now(),
            speedup: opts.speedup,
        };
        let shared = Arc::new(Shared {
            served: Mutex::new(vec![Served::default(); trace.len()]),
            trace,
            roles: roles.clone(),
            names: names.clone(),
            registry: Mutex::new(HashMap::new()),
            commands: Mutex::new(tx),
            max_input: cfg.profile.model.max_input_tokens,
            pool_tokens: cfg.profile.hardware.kv_pool_tokens,
            model: opts.model.clone(),
            clock,
        });
        let mut lp = EngineLoop {
            engine,
            roles: roles.clone(),
            shared: shared.clone(),
            wakes: BinaryHeap::new(),
            seq: 0,
            running: HashMap::new(),
            next_job: 0,
            halves: HashMap::new(),
            deadlines: BTreeSet::new(),
            publisher,
            start_wall_ms: kvc_admission::Clock::now_ms(&kvc_admission::SystemClock),
            speedup: opts.speedup,
            last: 0,
            pair_timeout: (PAIR_TIMEOUT_WALL.as_secs_f64() * 1e6 * opts.speedup) as Micros,
        };
        // Fresh snapshots before anyone reads them.
        lp.publish()?;
        let engine = std::thread::Builder::new()
            .name("kvc-sim-engine".into())
            .spawn(move || lp.run(rx))
            .map_err(|e| LiveError::Invalid(format!("cannot start the engine thread: {e}")))?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let client = bootstrap_client();
        let mut addrs = Vec::new();
        let mut bootstrap_ports = Vec::new();
        for (i, role) in roles.iter().enumerate() {
            let id = WorkerId(i as u32);
            let bootstrap = if *role == WorkerRole::Prefill {
                let port = opts
                    .bootstrap_base_port
                    .map_or(0, |b| b.saturating_add(i as u16));
                let app = Router::new()
                    .route("/bootstrap/route", get(bootstrap_route))
                    .route("/health", get(|| async { "ok" }))
                    .with_state(Arc::new(BootstrapCtx {
                        id,
                        name: names[i].clone(),
                    }));
                let addr = bind_and_serve(runtime, port, app, stop_rx.clone())?;
                Some(addr.port())
            } else {
                None
            };
            let ctx = Arc::new(WorkerCtx {
                id,
                role: *role,
                name: names[i].clone(),
                shared: shared.clone(),
                client: client.clone(),
            });
            let app = worker_app(ctx);
            let port = opts
                .http_base_port
                .map_or(0, |b| b.saturating_add(i as u16));
            addrs.push(bind_and_serve(runtime, port, app, stop_rx.clone())?);
            bootstrap_ports.push(bootstrap);
        }
        Ok(HttpWorkers {
            shared,
            addrs,
            bootstrap_ports,
            engine: Some(engine),
            stop: tokio_util_stop::Stop(Some(stop_tx)),
        })
    }

    /// Each worker's HTTP address, by worker id.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Each worker's bootstrap port (prefill workers only), by worker id.
    pub fn bootstrap_ports(&self) -> &[Option<u16>] {
        &self.bootstrap_ports
    }

    /// Worker roles, by worker id.
    pub fn roles(&self) -> &[WorkerRole] {
        &self.shared.roles
    }

    /// Stops the servers and the engine thread.
    pub fn stop(mut self) -> Result<(), LiveError> {
        self.stop.stop();
        self.shared.send(Command::Stop);
        match self.engine.take().map(std::thread::JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(LiveError::Invalid("the engine thread panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for HttpWorkers {
    fn drop(&mut self) {
        self.stop.stop();
        self.shared.send(Command::Stop);
    }
}

type BootstrapClient =
    hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, Body0>;
type Body0 = http_body_util::Empty<Bytes>;

fn bootstrap_client() -> BootstrapClient {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(super::driver::connector())
}

fn bind_and_serve(
    runtime: &tokio::runtime::Handle,
    port: u16,
    app: Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<SocketAddr, LiveError> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(addr))
        .map_err(|e| LiveError::Router(format!("cannot listen on {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| LiveError::Router(format!("cannot listen on {addr}: {e}")))?;
    runtime.spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        // Small SSE events go out at once (no Nagle delay behind a delayed ACK).
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await;
    });
    Ok(bound)
}

struct BootstrapCtx {
    id: WorkerId,
    name: String,
}

async fn bootstrap_route(State(ctx): State<Arc<BootstrapCtx>>, uri: axum::http::Uri) -> Response {
    let room = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix("room="))
        .and_then(|r| r.parse::<u64>().ok());
    match room {
        Some(room) => json_response(
            StatusCode::OK,
            &json!({ "worker": ctx.id.0, "name": ctx.name, "room": room }),
        ),
        None => error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "query parameter `room` must be an unsigned integer",
        ),
    }
}

struct WorkerCtx {
    id: WorkerId,
    role: WorkerRole,
    name: String,
    shared: Arc<Shared>,
    client: BootstrapClient,
}

fn worker_app(ctx: Arc<WorkerCtx>) -> Router {
    Router::new()
        .route("/generate", post(generate))
        .route("/health", get(|| async { "ok" }))
        .route("/health_generate", get(|| async { "ok" }))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/v1/models", get(models))
        .route("/flush_cache", post(|| async { "ok" }))
        .fallback(|| async { error_response(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
        .with_state(ctx)
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    json_response(
        status,
        &json!({ "error": { "message": message, "type": kind, "code": status.as_u16() } }),
    )
}

async fn server_info(State(ctx): State<Arc<WorkerCtx>>) -> Response {
    let mode = match ctx.role {
        WorkerRole::Prefill => "prefill",
        WorkerRole::Decode => "decode",
        WorkerRole::Colocated => "null",
    };
    json_response(
        StatusCode::OK,
        &json!({
            "model_path": ctx.shared.model,
            "served_model_name": ctx.shared.model,
            "disaggregation_mode": mode,
            "max_total_num_tokens": ctx.shared.pool_tokens,
            "context_length": ctx.shared.max_input,
            "worker": ctx.name,
        }),
    )
}

async fn model_info(State(ctx): State<Arc<WorkerCtx>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({ "model_path": ctx.shared.model, "is_generation": true }),
    )
}

async fn models(State(ctx): State<Arc<WorkerCtx>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({ "object": "list", "data": [{ "id": ctx.shared.model, "object": "model" }] }),
    )
}

/// The parts of a `/generate` body the simulated worker uses.
#[derive(Debug)]
struct GenerateBody {
    text: String,
    max_new_tokens: Option<u64>,
    stream: bool,
    room: Option<u64>,
    bootstrap: Option<(String, u16)>,
}

fn parse_body(bytes: &[u8]) -> Result<GenerateBody, String> {
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| format!("the body is not JSON: {e}"))?;
    let obj = v.as_object().ok_or("the body must be a JSON object")?;
    let text = match obj.get("text") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err("`text` must be a string".into()),
        None => return Err("this worker takes `text` prompts (no `text` field)".into()),
    };
    let max_new_tokens = match obj.get("sampling_params").map(|s| s.get("max_new_tokens")) {
        None | Some(None) | Some(Some(Value::Null)) => None,
        Some(Some(n)) => Some(
            n.as_u64()
                .ok_or("`sampling_params.max_new_tokens` must be an unsigned integer")?,
        ),
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("`stream` must be a boolean".into()),
    };
    let room = match obj.get("bootstrap_room") {
        None | Some(Value::Null) => None,
        Some(n) => Some(
            n.as_u64()
                .ok_or("`bootstrap_room` must be an unsigned integer")?,
        ),
    };
    let bootstrap = match (obj.get("bootstrap_host"), obj.get("bootstrap_port")) {
        (Some(Value::String(h)), Some(p)) => {
            let port = p
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .ok_or("`bootstrap_port` must be a port number")?;
            Some((h.clone(), port))
        }
        _ => None,
    };
    Ok(GenerateBody {
        text,
        max_new_tokens,
        stream,
        room,
        bootstrap,
    })
}

/// Asks the prefill worker's bootstrap server which worker holds `room`.
async fn resolve_prefill(
    client: &BootstrapClient,
    host: &str,
    port: u16,
    room: u64,
) -> Result<WorkerId, String> {
    use http_body_util::BodyExt;
    let uri: hyper::Uri = format!("http://{host}:{port}/bootstrap/route?room={room}")
        .parse()
        .map_err(|e| format!("bad bootstrap address {host}:{port}: {e}"))?;
    let call = async {
        let resp = client
            .get(uri)
            .await
            .map_err(|e| format!("bootstrap server {host}:{port} unreachable: {e}"))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("bootstrap server {host}:{port}: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("bootstrap server {host}:{port} answered {status}"));
        }
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| format!("bootstrap server {host}:{port}: bad answer: {e}"))?;
        v.get("worker")
            .and_then(Value::as_u64)
            .map(|w| WorkerId(w as u32))
            .ok_or_else(|| format!("bootstrap server {host}:{port}: no worker in its answer"))
    };
    tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .map_err(|_| format!("bootstrap server {host}:{port} did not answer within 5 s"))?
}

fn meta(index: usize, prompt: u64, completion: u64, cached: u64, done: bool) -> Value {
    let finish = if done {
        json!({ "type": "length", "length": completion })
    } else {
        Value::Null
    };
    json!({
        "id": format!("r{index}"),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "finish_reason": finish,
    })
}

fn output_text(n: u64) -> String {
    let mut s = String::with_capacity(n as usize * 4);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str("tok");
    }
    s
}

async fn generate(State(ctx): State<Arc<WorkerCtx>>, body: Bytes) -> Response {
    let req = match parse_body(&body) {
        Ok(r) => r,
        Err(m) => return error_response(StatusCode::BAD_REQUEST, "invalid_request_error", &m),
    };
    let shared = &ctx.shared;
    let Some(index) = shared.find(prompt_key(&req.text)) else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &format!(
                "{}: unknown prompt (not one this replay has in flight)",
                ctx.name
            ),
        );
    };
    let arrived = Instant::now();
    shared.with_served(index, |s| {
        s.arrived = Some(s.arrived.map_or(arrived, |a| a.min(arrived)));
        if ctx.role != WorkerRole::Prefill {
            s.attempts += 1;
        }
    });
    let r = &shared.trace.requests[index];
    if r.input_length > shared.max_input {
        return error_response(
            StatusCode::BAD_REQUEST,
            "input_too_long",
            &format!(
                "The input ({} tokens) is longer than the model's context length ({} tokens).",
                r.input_length, shared.max_input
            ),
        );
    }
    let job = Job {
        id: 0,
        session: r.session,
        input: r.input_length,
        output: req.max_new_tokens.unwrap_or(r.output_length).max(1),
        hashes: r.hash_ids.clone(),
    };
    let output = job.output;
    let prompt_tokens = job.input;
    let kind = match (ctx.role, req.room) {
        (WorkerRole::Colocated, _) => Kind::Colocated(ctx.id),
        (WorkerRole::Prefill, Some(room)) => Kind::PrefillHalf {
            room,
            prefill: ctx.id,
        },
        (WorkerRole::Prefill, None) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                &format!(
                    "{} is a prefill worker: `bootstrap_room` is required",
                    ctx.name
                ),
            );
        }
        (WorkerRole::Decode, None) => Kind::Direct(ctx.id),
        (WorkerRole::Decode, Some(room)) => {
            let Some((host, port)) = &req.bootstrap else {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "`bootstrap_room` needs `bootstrap_host` and `bootstrap_port`",
                );
            };
            match resolve_prefill(&ctx.client, host, *port, room).await {
                Ok(prefill) => Kind::DecodeHalf {
                    room,
                    decode: ctx.id,
                    prefill,
                },
                Err(m) => return error_response(StatusCode::BAD_GATEWAY, "bootstrap_error", &m),
            }
        }
    };
    let (tx, mut rx) = unbounded_channel();
    if !shared.send(Command::Start {
        index,
        job,
        kind,
        reply: tx,
    }) {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the worker is shutting down",
        );
    }
    match rx.recv().await {
        Some(Progress::Accepted) => {}
        Some(Progress::Rejected(m)) => {
            shared.with_served(index, |s| s.admission_rejects += 1);
            let mut resp =
                error_response(StatusCode::SERVICE_UNAVAILABLE, "admission_rejected", &m);
            resp.headers_mut().insert(
                "x-kvc-admission",
                axum::http::HeaderValue::from_static("rejected"),
            );
            return resp;
        }
        Some(Progress::Failed(status, m)) => {
            return error_response(status, "worker_error", &m);
        }
        Some(_) | None => {
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "worker_error",
                "the engine stopped",
            );
        }
    }
    let is_prefill_half = matches!(kind, Kind::PrefillHalf { .. });
    if req.stream {
        let stream = ProgressStream {
            rx,
            shared: shared.clone(),
            index,
            prompt_tokens,
            output,
            prefill_half: is_prefill_half,
            finished: false,
        };
        let body = Body::from_stream(tokio_stream::wrappers::UnboundedReceiverStream::new(
            stream.spawn(),
        ));
        return (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/event-stream")],
            body,
        )
            .into_response();
    }
    // Whole answer: at the first token for a prefill half, at the end otherwise.
    loop {
        match rx.recv().await {
            Some(Progress::FirstToken) if is_prefill_half => {
                return json_response(
                    StatusCode::OK,
                    &json!({ "text": "", "meta_info": meta(index, prompt_tokens, 0, 0, false) }),
                );
            }
            Some(Progress::FirstToken | Progress::Accepted) => {
                let now = Instant::now();
                shared.with_served(index, |s| s.first_sent = Some(now));
            }
            Some(Progress::Done { cached }) => {
                let now = Instant::now();
                shared.with_served(index, |s| s.done_sent = Some(now));
                return json_response(
                    StatusCode::OK,
                    &json!({
                        "text": output_text(output),
                        "meta_info": meta(index, prompt_tokens, output, cached, true),
                    }),
                );
            }
            Some(Progress::Failed(status, m)) => {
                return error_response(status, "worker_error", &m);
            }
            Some(Progress::Rejected(m)) => {
                return error_response(StatusCode::SERVICE_UNAVAILABLE, "worker_error", &m);
            }
            None => {
                return error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "worker_error",
                    "the engine stopped",
                );
            }
        }
    }
}

/// Turns a request's progress into SSE events.
struct ProgressStream {
    rx: UnboundedReceiver<Progress>,
    shared: Arc<Shared>,
    index: usize,
    prompt_tokens: u64,
    output: u64,
    prefill_half: bool,
    finished: bool,
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

impl ProgressStream {
    /// Relays the events on a task; the receiver yields body chunks.
    fn spawn(mut self) -> UnboundedReceiver<Result<Bytes, std::io::Error>> {
        let (tx, out) = unbounded_channel();
        tokio::spawn(async move {
            while !self.finished {
                let Some(p) = self.rx.recv().await else {
                    let _ = tx.send(Err(std::io::Error::other("the engine stopped")));
                    return;
                };
                let chunks = self.chunks(p);
                for c in chunks {
                    if tx.send(c).is_err() {
                        return;
                    }
                }
            }
        });
        out
    }

    fn chunks(&mut self, p: Progress) -> Vec<Result<Bytes, std::io::Error>> {
        let done = Bytes::from_static(b"data: [DONE]\n\n");
        match p {
            Progress::Accepted => Vec::new(),
            Progress::FirstToken if self.prefill_half => {
                self.finished = true;
                let m = meta(self.index, self.prompt_tokens, 0, 0, false);
                vec![Ok(sse(&json!({ "text": "", "meta_info": m }))), Ok(done)]
            }
            Progress::FirstToken => {
                let m = meta(self.index, self.prompt_tokens, 1, 0, false);
                let now = Instant::now();
                self.shared
                    .with_served(self.index, |s| s.first_sent = Some(now));
                vec![Ok(sse(&json!({ "text": "tok", "meta_info": m })))]
            }
            Progress::Done { cached } => {
                self.finished = true;
                let m = meta(self.index, self.prompt_tokens, self.output, cached, true);
                let now = Instant::now();
                self.shared
                    .with_served(self.index, |s| s.done_sent = Some(now));
                vec![
                    Ok(sse(
                        &json!({ "text": output_text(self.output), "meta_info": m }),
                    )),
                    Ok(done),
                ]
            }
            Progress::Failed(_, m) | Progress::Rejected(m) => {
                self.finished = true;
                vec![Ok(sse(
                    &json!({ "error": { "message": m, "type": "worker_error", "code": 500 } }),
                ))]
            }
        }
    }
}
