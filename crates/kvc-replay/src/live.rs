//! Live replay: the simulated cluster on a real clock, behind a real `kvc-router`.
//!
//! The workers are the simulator's engine model paced to wall time (`speedup` times faster than
//! the trace's own time scale). Every worker publishes its state into a shared-memory snapshot
//! (`kvc-admission`'s layout) after each step and at least every 100 ms, so the router's probes
//! read live state. Each turn asks the router (`kvc.v1.Router/Route`) where to go, runs there,
//! and reports back (`ReportOutcome`); a direct-to-D turn that the worker refuses is asked again
//! with `rejected_by`. Records and summary have the same shape as `sim`'s.
//!
//! The router learns evictions from the snapshots (a session missing from D's resident table
//! is not resident), as it would from a real engine. It is a separate process: a running one
//! at an address, or the `kvc-router` binary started here ([`router`]); this crate speaks to
//! it only through `kvc-proto`.

pub mod engine_signals;
pub mod kv_events;
pub mod router;

use crate::sim::engine::{Engine, Micros};
use crate::sim::{Decider, Hooks, Routed, SimConfig, SimError, SimOutput, run, worker_roles};
use crate::trace::Trace;
use kvc_admission::{
    Clock, CommitReceiver, CommitReply, ResidentEntry, ResidentState, SnapshotData, SnapshotReader,
    SnapshotWriter, SystemClock, commit_queue,
};
use kvc_core::{ExecutionMode, FallThroughReason, StateSource, WorkerId};
use kvc_policy::{ClusterView, Observation, RouteRequest};
use kvc_proto::convert::ProtoEnum;
use kvc_proto::pb;
use kvc_proto::pb::router_client::RouterClient;
use kvc_proto::worker::{LocalWorker, serve_worker_until};
use router::{ConfiguredWorker, RouterConfigFile, RouterProcess, find_router_binary};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// Which router the live replay talks to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouterTarget {
    /// A running router at this URI (`http://127.0.0.1:50051`), configured with the snapshot
    /// files of [`snapshot_path`].
    Address(String),
    /// The `kvc-router` binary started as a child process on a loopback port, with the run's
    /// policy: `router_bin`, else the binary beside this executable, else the one on `PATH`
    /// ([`router::find_router_binary`]).
    Spawn {
        /// The binary to run, when not found by itself.
        router_bin: Option<PathBuf>,
    },
}

/// Settings of a live replay besides the [`SimConfig`].
#[derive(Debug, Clone)]
pub struct LiveOptions {
    /// Wall time runs this many times faster than (scaled) trace time.
    pub speedup: f64,
    /// The router.
    pub router: RouterTarget,
    /// Directory of the workers' snapshot files (`w<id>.snap`).
    pub snapshot_dir: PathBuf,
    /// Resident-session slots in each snapshot.
    pub table_slots: usize,
    /// How long to wait for the router to answer before giving up.
    pub connect_timeout: Duration,
    /// Serve each worker's `kvc.v1.Worker` service on `127.0.0.1:<base + id>` (a spawned
    /// router always gets worker services, on free ports).
    pub worker_base_port: Option<u16>,
    /// Where the router reads the workers' state: [`StateSource::Snapshot`] (their snapshot
    /// files) or [`StateSource::Events`] (each worker also serves vLLM-named `/metrics`, see
    /// [`engine_signals`], and the router is configured with those instead of snapshots).
    pub router_state: StateSource,
    /// With [`StateSource::Events`]: serve worker `i`'s `/metrics` on `127.0.0.1:<base + i>`
    /// (free ports when `None`; then only a spawned router knows them).
    pub engine_base_port: Option<u16>,
}

impl LiveOptions {
    /// Checks the settings a live replay cannot run with: a positive, finite speedup, at
    /// least one snapshot slot, and a router state source of `snapshot` or `events`.
    pub fn validate(&self) -> Result<(), LiveError> {
        check_pacing(self.speedup, self.table_slots)?;
        check_router_state(self.router_state)
    }
}

/// The router may read the workers' state from their snapshots or their engine signals (a
/// live replay has no worker that only answers `State`).
pub(crate) fn check_router_state(source: StateSource) -> Result<(), LiveError> {
    match source {
        StateSource::Snapshot | StateSource::Events => Ok(()),
        StateSource::Service => Err(LiveError::Invalid(
            "the router state of a live replay is `snapshot` or `events`".to_owned(),
        )),
    }
}

/// The rule for the settings every real-clock replay shares (the live replay's and the HTTP
/// workers'): wall time runs `speedup` (positive, finite) times faster than engine time, and
/// snapshots hold at least one resident session (`table_slots`).
pub(crate) fn check_pacing(speedup: f64, table_slots: usize) -> Result<(), LiveError> {
    if !(speedup.is_finite() && speedup > 0.0) {
        return Err(LiveError::Invalid(format!(
            "speedup must be a positive number (got {speedup})"
        )));
    }
    if table_slots == 0 {
        return Err(LiveError::Invalid("table slots must be at least 1".into()));
    }
    Ok(())
}

/// Why a live replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    /// A bad setting.
    #[error("invalid live replay setting: {0}")]
    Invalid(String),
    /// The snapshot files could not be created or published.
    #[error("snapshot {path}: {message}")]
    Snapshot {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
    /// The router could not be started or reached.
    #[error("router: {0}")]
    Router(String),
    /// The replay itself failed.
    #[error(transparent)]
    Sim(#[from] SimError),
}

/// The snapshot file of worker `id` in `dir`.
pub fn snapshot_path(dir: &Path, id: WorkerId) -> PathBuf {
    dir.join(format!("w{}.snap", id.0))
}

/// The router configuration that matches a live replay of `cfg` publishing into `dir`, with
/// the workers' service addresses when they are served (`worker_addrs[id]`).
pub fn router_config(
    cfg: &SimConfig,
    dir: &Path,
    listen: SocketAddr,
    metrics_listen: Option<SocketAddr>,
    worker_addrs: &[SocketAddr],
) -> RouterConfigFile {
    let roles = worker_roles(cfg.topology);
    let names = crate::sim::worker_names(&roles);
    let layout = crate::sim::cluster::worker_layout(cfg);
    RouterConfigFile {
        listen,
        metrics_listen,
        http_listen: None,
        policy: cfg.policy.clone(),
        workers: roles
            .iter()
            .enumerate()
            .map(|(i, role)| ConfiguredWorker {
                id: i as u32,
                name: names[i].clone(),
                role: *role,
                capacity_tokens: cfg.profile.hardware.kv_pool_tokens,
                snapshot: Some(snapshot_path(dir, WorkerId(i as u32))),
                address: worker_addrs.get(i).map(|a| format!("http://{a}")),
                http_url: None,
                bootstrap_port: None,
                engine: None,
                serve_alone: None,
                serves_alone: layout.get(i).is_some_and(|(_, caps)| caps.local),
                signals: None,
            })
            .collect(),
    }
}

/// Publishes every worker's state: into its snapshot file, and/or as its engine signals.
pub(crate) struct Publisher {
    writers: Vec<SnapshotWriter>,
    /// Each worker's pool, tokens (by worker id).
    capacities: Vec<u64>,
    data: SnapshotData,
    /// The workers' engine signals, updated at every publish when served.
    signals: Option<engine_signals::EngineSignals>,
}

impl Publisher {
    /// Creates one snapshot file per worker of `cfg` in `dir`, with `table_slots` resident
    /// slots each.
    pub(crate) fn create(
        cfg: &SimConfig,
        dir: &Path,
        table_slots: usize,
    ) -> Result<Self, LiveError> {
        let mut p = Self::without_snapshots(cfg);
        std::fs::create_dir_all(dir).map_err(|e| LiveError::Snapshot {
            path: dir.display().to_string(),
            message: e.to_string(),
        })?;
        let capacity = cfg.profile.hardware.kv_pool_tokens;
        let mut writers = Vec::new();
        for i in 0..worker_roles(cfg.topology).len() {
            let id = WorkerId(i as u32);
            let path = snapshot_path(dir, id);
            let w = SnapshotWriter::create(&path, id, capacity, table_slots).map_err(|e| {
                LiveError::Snapshot {
                    path: path.display().to_string(),
                    message: e.to_string(),
                }
            })?;
            writers.push(w);
        }
        p.writers = writers;
        Ok(p)
    }

    /// The publisher for a router reading `state`: snapshot files in `dir`, or, for engine
    /// signals, none (`dir` is still created: it holds a spawned router's configuration).
    pub(crate) fn for_router_state(
        cfg: &SimConfig,
        state: StateSource,
        dir: &Path,
        table_slots: usize,
    ) -> Result<Self, LiveError> {
        if state != StateSource::Events {
            return Self::create(cfg, dir, table_slots);
        }
        std::fs::create_dir_all(dir).map_err(|e| LiveError::Snapshot {
            path: dir.display().to_string(),
            message: e.to_string(),
        })?;
        Ok(Self::without_snapshots(cfg))
    }

    /// A publisher that writes no snapshot file (the workers' state goes out only as engine
    /// signals, once served).
    pub(crate) fn without_snapshots(cfg: &SimConfig) -> Self {
        let capacity = cfg.profile.hardware.kv_pool_tokens;
        Publisher {
            data: SnapshotData::empty(WorkerId(0), capacity),
            writers: Vec::new(),
            capacities: vec![capacity; worker_roles(cfg.topology).len()],
            signals: None,
        }
    }

    /// Also serves every worker's engine signals on `rt` until `stop`: vLLM-named `/metrics`
    /// (worker `i` on `127.0.0.1:<base + i>`, free ports when `None`) and KV-cache events;
    /// `trace_block` is the trace's tokens per block. Returns where a router finds them.
    pub(crate) fn serve_engine_signals(
        &mut self,
        rt: &tokio::runtime::Handle,
        base: Option<u16>,
        model: &str,
        trace_block: u64,
        stop: &CancellationToken,
    ) -> Result<Vec<engine_signals::EngineEndpoints>, LiveError> {
        let states = self
            .capacities
            .iter()
            .map(|c| kvc_core::WorkerState::empty(*c))
            .collect();
        let signals =
            engine_signals::EngineSignals::serve(rt, states, base, model, trace_block, stop)?;
        let endpoints = signals.endpoints();
        self.signals = Some(signals);
        Ok(endpoints)
    }

    /// Names sessions in the engine events (when served) by the keys in `labels`.
    pub(crate) fn label_sessions(&mut self, labels: crate::http::workers::SessionLabels) {
        if let Some(signals) = &mut self.signals {
            signals.label_sessions(labels);
        }
    }

    /// Publishes the engine's state of every worker, stamped with the wall clock.
    /// Engine time `t` (simulated µs since the start) is wall time `start_ms + t / speedup`.
    pub(crate) fn publish(
        &mut self,
        engine: &Engine,
        start_ms: u64,
        speedup: f64,
    ) -> Result<(), LiveError> {
        let now = SystemClock.now_ms();
        let to_wall = |t: Micros| start_ms + (t as f64 / 1e3 / speedup) as u64;
        for (i, w) in self.writers.iter_mut().enumerate() {
            let id = WorkerId(i as u32);
            let s = engine.state(id);
            let d = &mut self.data;
            d.worker_id = id;
            d.capacity_tokens = s.capacity_tokens;
            d.used_tokens = s.used_tokens.min(s.capacity_tokens);
            d.free_tokens = s.free_tokens();
            d.evictable_tokens = s.evictable_tokens.min(d.used_tokens);
            d.queue_depth = s.queue_depth;
            d.in_flight = s.in_flight;
            d.publish_ms = now;
            d.residents.clear();
            let slots = w.max_sessions();
            d.residents
                .extend(engine.residents(id).into_iter().take(slots).map(
                    |(session, tokens, last, running)| ResidentEntry {
                        session,
                        tokens,
                        last_access_ms: to_wall(last).min(now),
                        state: if running {
                            ResidentState::Running
                        } else {
                            ResidentState::Idle
                        },
                    },
                ));
            w.publish(d).map_err(|e| LiveError::Snapshot {
                path: format!("worker {i}"),
                message: e.to_string(),
            })?;
        }
        if let Some(signals) = &mut self.signals {
            signals.update(engine, now as f64 / 1e3);
        }
        Ok(())
    }
}

/// Paces the replay to wall time, publishes snapshots and answers worker commands.
struct LiveHooks {
    /// Per worker: the commit_evict queue its worker service feeds.
    commits: Vec<CommitReceiver>,
    start: Instant,
    start_wall_ms: u64,
    speedup: f64,
    publisher: Publisher,
    error: Option<LiveError>,
    /// Largest lag behind wall time, µs of simulated time.
    max_lag: Micros,
}

impl LiveHooks {
    fn wall_of(&self, t: Micros) -> Duration {
        Duration::from_secs_f64(t as f64 / 1e6 / self.speedup)
    }
}

impl Hooks for LiveHooks {
    fn before(&mut self, t: Micros) {
        let target = self.start + self.wall_of(t);
        let now = Instant::now();
        if target > now {
            std::thread::sleep(target - now);
        } else {
            let lag = (now - target).as_secs_f64() * 1e6 * self.speedup;
            self.max_lag = self.max_lag.max(lag as Micros);
        }
    }

    fn after(&mut self, t: Micros, engine: &mut Engine) {
        if self.error.is_some() {
            return;
        }
        // The worker's step boundary: answer the commit_evicts queued by its service.
        for (i, rx) in self.commits.iter_mut().enumerate() {
            while let Some(job) = rx.try_recv() {
                let req = *job.request();
                let (admitted, freed, evicted) =
                    engine.commit_evict(WorkerId(i as u32), req.need_tokens, req.session, t);
                let mut reply = CommitReply::rejected(0);
                reply.admitted = admitted;
                reply.freed_tokens = freed;
                reply.evicted = evicted;
                job.answer(reply);
            }
        }
        if let Err(e) = self
            .publisher
            .publish(engine, self.start_wall_ms, self.speedup)
        {
            self.error = Some(e);
        }
    }

    fn tick_every(&self) -> Option<Micros> {
        // Every 100 ms of wall time.
        Some((100_000.0 * self.speedup) as Micros)
    }
}

/// Decisions from a `kvc-router` over gRPC.
struct RemoteDecider {
    rt: tokio::runtime::Runtime,
    client: RouterClient<Channel>,
    names: Vec<String>,
    failures: usize,
    last_error: Option<String>,
    /// Name sessions to the router by the key their engines label them with
    /// (`SessionId::from_key` of [`kv_events::session_label`]), as engine events name them;
    /// otherwise by the trace's session ids, as the snapshots do.
    keyed_sessions: bool,
}

impl RemoteDecider {
    fn call<T>(
        &mut self,
        f: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Option<T> {
        match self.rt.block_on(f) {
            Ok(r) => Some(r.into_inner()),
            Err(status) => {
                self.failures += 1;
                self.last_error = Some(status.to_string());
                None
            }
        }
    }
}

impl Decider for RemoteDecider {
    fn route(&mut self, _cluster: &ClusterView<'_>, req: &RouteRequest<'_>) -> Option<Routed> {
        let mut msg = pb::RouteRequest::from(req);
        if self.keyed_sessions {
            msg.session_id = req
                .session
                .map(|s| kvc_core::SessionId::from_key(&kv_events::session_label(s)).0);
        }
        let mut client = self.client.clone();
        let d = self.call(async move { client.route(msg).await })?;
        let mode = ExecutionMode::from_proto(d.mode).ok()?;
        let reason = d
            .fall_through_reason
            .and_then(|r| FallThroughReason::from_proto(r).ok());
        let decode = WorkerId(d.decode_worker);
        if decode.0 as usize >= self.names.len() {
            self.failures += 1;
            self.last_error = Some(format!("router named unknown worker {}", d.decode_worker));
            return None;
        }
        Some(Routed {
            mode,
            decode,
            prefill: d.prefill_worker.map(WorkerId),
            reason,
            need_tokens: d.need_tokens,
            recommended_pause_ms: d.recommended_pause_ms,
            decision_id: d.decision_id,
            change: None,
        })
    }

    fn carried_out(&mut self, _routed: &Routed) {}

    fn observe(&mut self, event: &Observation, routed: Option<&Routed>) {
        if let (
            Observation::Completed {
                request_id,
                outcome,
                resident_tokens,
                ..
            },
            Some(r),
        ) = (event, routed)
        {
            let msg = pb::OutcomeReport {
                decision_id: r.decision_id,
                request_id: request_id.0,
                outcome: outcome.to_proto(),
                resident_tokens: *resident_tokens,
            };
            let mut client = self.client.clone();
            let _ = self.call(async move { client.report_outcome(msg).await });
        }
    }
}

/// The async runtime a live replay runs on: two worker threads, timers and I/O.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, LiveError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| LiveError::Router(format!("cannot start the async runtime: {e}")))
}

/// Runs the live replay of `trace` under `cfg` (its policy is used when the router is spawned
/// here). `progress` gets (completed, total).
pub fn live(
    trace: &Trace,
    cfg: &SimConfig,
    opts: &LiveOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SimOutput, LiveError> {
    opts.validate()?;
    let roles = worker_roles(cfg.topology);
    // A router reading engine signals gets no snapshot file, and no worker service (which
    // answers from one).
    let events = opts.router_state == StateSource::Events;
    let mut publisher =
        Publisher::for_router_state(cfg, opts.router_state, &opts.snapshot_dir, opts.table_slots)?;
    let rt = runtime()?;
    let start_wall_ms = SystemClock.now_ms();
    // Publish once so the router finds fresh snapshots from its first read.
    let engine_for_first = crate::sim::engine::Engine::new(
        cfg.profile.clone(),
        crate::sim::engine::EngineOptions {
            eviction: kvc_admission::EvictionConfig::default(),
            block_size: kvc_core::BlockSize::default(),
        },
        &roles,
        0,
        0.0,
    );
    publisher.publish(&engine_for_first, start_wall_ms, opts.speedup)?;
    // Everything started here stops on this token: cancelled at the end, and on every early
    // return by the guard.
    let stop = CancellationToken::new();
    let _stop_on_exit = stop.clone().drop_guard();
    let engine_urls = match opts.router_state {
        StateSource::Events => publisher.serve_engine_signals(
            rt.handle(),
            opts.engine_base_port,
            engine_signals::MODEL_NAME,
            u64::from(cfg.policy.block_size().tokens()),
            &stop,
        )?,
        _ => Vec::new(),
    };
    // Worker services: State from the snapshot, CommitEvict through a queue the replay loop
    // answers at its step boundary.
    let mut commits = Vec::new();
    let mut worker_addrs = Vec::new();
    let mut workers = Vec::new();
    let spawn = matches!(opts.router, RouterTarget::Spawn { .. });
    let serve_workers = !events && (opts.worker_base_port.is_some() || spawn);
    if serve_workers {
        for i in 0..roles.len() {
            let id = WorkerId(i as u32);
            let port = opts
                .worker_base_port
                .map_or(0, |b| b.saturating_add(i as u16));
            let (tx, rx) = commit_queue(64);
            let path = snapshot_path(&opts.snapshot_dir, id);
            let reader = SnapshotReader::open(&path).map_err(|e| LiveError::Snapshot {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
            let worker = LocalWorker::new(
                reader,
                tx,
                std::sync::Arc::new(SystemClock),
                Duration::from_secs(2),
            );
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let running = rt
                .block_on(serve_worker_until(addr, worker, stop.child_token()))
                .map_err(|e| LiveError::Router(format!("cannot serve worker {i}: {e}")))?;
            worker_addrs.push(running.addr());
            workers.push(running);
            commits.push(rx);
        }
    }
    // A spawned router is killed when this is dropped, error or not.
    let mut _spawned = None;
    let uri = match &opts.router {
        RouterTarget::Address(a) => a.clone(),
        RouterTarget::Spawn { router_bin } => {
            let binary = find_router_binary(router_bin.as_deref())?;
            let mut rc = router_config(
                cfg,
                &opts.snapshot_dir,
                SocketAddr::from(([127, 0, 0, 1], 0)),
                None,
                &worker_addrs,
            );
            if opts.router_state == StateSource::Events {
                rc = rc.with_engine_signals(&engine_urls);
            }
            let config_path = opts.snapshot_dir.join("kvc-router.toml");
            let process = RouterProcess::start(&binary, &rc, &config_path, opts.connect_timeout)?;
            let addr = process.grpc_addr();
            _spawned = Some(process);
            format!("http://{addr}")
        }
    };
    // Connect, retrying until the router answers Ping (it may still be starting).
    let deadline = Instant::now() + opts.connect_timeout;
    let client = loop {
        let attempt = rt.block_on(async {
            let mut c = RouterClient::connect(uri.clone())
                .await
                .map_err(|e| e.to_string())?;
            c.ping(pb::PingRequest {})
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(c)
        });
        match attempt {
            Ok(c) => break c,
            Err(e) if Instant::now() >= deadline => {
                return Err(LiveError::Router(format!("no answer from {uri}: {e}")));
            }
            Err(_) => {
                publisher.publish(&engine_for_first, start_wall_ms, opts.speedup)?;
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    // A router reading engine signals learns each worker's state at its first scrape: wait
    // until it lists every worker healthy (bounded by the same deadline).
    if opts.router_state == StateSource::Events {
        loop {
            let mut c = client.clone();
            let listed = rt
                .block_on(async move { c.list_workers(pb::ListWorkersRequest {}).await })
                .map(|r| r.into_inner().workers);
            let ready = listed.as_ref().is_ok_and(|ws| {
                ws.len() == roles.len()
                    && ws.iter().all(|w| {
                        w.state
                            .as_ref()
                            .is_some_and(|s| s.health == pb::Health::Healthy as i32)
                    })
            });
            if ready {
                break;
            }
            if Instant::now() >= deadline {
                return Err(LiveError::Router(format!(
                    "the router at {uri} never listed every worker healthy: {:?}",
                    listed.map_err(|e| e.to_string())
                )));
            }
            publisher.publish(&engine_for_first, start_wall_ms, opts.speedup)?;
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let mut decider = RemoteDecider {
        rt,
        client,
        names: crate::sim::worker_names(&roles),
        failures: 0,
        last_error: None,
        keyed_sessions: opts.router_state == StateSource::Events,
    };
    let mut hooks = LiveHooks {
        commits,
        start: Instant::now(),
        start_wall_ms: SystemClock.now_ms(),
        speedup: opts.speedup,
        publisher,
        error: None,
        max_lag: 0,
    };
    let out = run(trace, cfg, &mut decider, &mut hooks, progress)?;
    if opts.router_state == StateSource::Events {
        // What the router made of the engines' events, for the operator.
        let mut c = decider.client.clone();
        if let Ok(r) = decider
            .rt
            .block_on(async move { c.list_workers(pb::ListWorkersRequest {}).await })
        {
            for w in r.into_inner().workers {
                eprintln!(
                    "kvc-replay live: router view of {} from engine events: {} blocks indexed, last event {}",
                    w.name,
                    w.indexed_blocks.map_or("none".into(), |b| b.to_string()),
                    w.last_event_seq.map_or("none".into(), |s| s.to_string()),
                );
            }
        }
    }
    stop.cancel();
    for w in workers {
        let _ = decider.rt.block_on(w.stop());
    }
    if let Some(e) = hooks.error {
        return Err(e);
    }
    if decider.failures > 0 {
        eprintln!(
            "kvc-replay live: {} router call(s) failed; last: {}",
            decider.failures,
            decider.last_error.unwrap_or_default()
        );
    }
    if hooks.max_lag > 0 {
        eprintln!(
            "kvc-replay live: fell behind the wall clock by up to {:.3} s of trace time",
            hooks.max_lag as f64 / 1e6
        );
    }
    Ok(out)
}
