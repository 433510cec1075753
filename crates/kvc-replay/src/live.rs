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

pub mod router;

pub use kvc_engine_sim::publish::snapshot_path;

use crate::sim::{Decider, Hooks, Routed, SimConfig, SimError, SimOutput, run, worker_roles};
use crate::trace::Trace;
use kvc_admission::{
    Clock, CommitReceiver, CommitReply, SnapshotReader, SystemClock, commit_queue,
};
use kvc_core::{ExecutionMode, FallThroughReason, StateSource, WorkerId};
use kvc_engine_sim::model::{Engine, Micros};
use kvc_engine_sim::publish::{Publisher, engine_signals, kv_events};
use kvc_engine_sim::{WorkerError, check_pacing, check_router_state};
use kvc_policy::{Fleet, Observation, RouteRequest, WorkerStates};
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
        Ok(check_router_state(self.router_state)?)
    }
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

impl From<WorkerError> for LiveError {
    fn from(e: WorkerError) -> Self {
        match e {
            WorkerError::Invalid(m) => LiveError::Invalid(m),
            WorkerError::Snapshot { path, message } => LiveError::Snapshot { path, message },
            WorkerError::Serve(m) => LiveError::Router(m),
        }
    }
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
            self.error = Some(e.into());
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
    fn route(
        &mut self,
        _fleet: &Fleet,
        _states: &dyn WorkerStates,
        _now_ms: u64,
        req: &RouteRequest<'_>,
    ) -> Option<Routed> {
        let mut msg = pb::RouteRequest::from(req);
        if self.keyed_sessions {
            msg.session_id = req
                .session
                .map(|s| kvc_core::SessionId::from_key(&kv_events::session_label(s)).0);
            msg.parent_session_id = req
                .parent
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
    let mut publisher = Publisher::for_router_state(
        &cfg.cluster(trace.block_size()),
        opts.router_state,
        &opts.snapshot_dir,
        opts.table_slots,
    )?;
    let rt = runtime()?;
    let start_wall_ms = SystemClock.now_ms();
    // Publish once so the router finds fresh snapshots from its first read.
    let engine_for_first = kvc_engine_sim::model::Engine::new(
        cfg.profile.clone(),
        kvc_engine_sim::model::EngineOptions {
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
