//! The routing service itself, independent of any transport: the worker views, the policy
//! state behind one lock, and the bounded session and pending tables. It takes and returns
//! `kvc-core`/`kvc-policy`/`kvc-admission` types; each front (gRPC, HTTP) converts at its own
//! edge. Deciding a route is in `service/route.rs` (validation, the policy call, the
//! probe-and-re-route path); what comes back after a decision in `service/feedback.rs`
//! (outcomes, `CommitEvict`, probes).

mod changes;
pub use changes::{FleetChange, Reload, Removed};
mod discover;
mod feedback;
mod fleet;
mod route;

use crate::config::RouterConfig;
use crate::error::{ConfigError, RequestError};
use crate::metrics::{BlockSizes, Gauges, Metrics, ProbeKind, WorkerSample};
use crate::sessions::{Forgotten, SessionTable};
use crate::workers::WorkerEntry;
use kvc_admission::{CommitSender, ProbeAnswer, SystemClock};
use kvc_core::{
    ExecutionMode, FallThroughReason, Outcome, RequestId, SessionId, StateSource, WorkerId,
    WorkerRole, WorkerState,
};
use kvc_policy::{MAX_WORKERS, RouterState, WorkerView};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A clock shared by the router and its background tasks (snapshot writers must stamp their
/// publishes with the same clock).
pub use kvc_proto::worker::SharedClock;

#[derive(Debug, Clone, Copy)]
struct Pending {
    request_id: RequestId,
    session: Option<SessionId>,
    decode: WorkerId,
    direct: bool,
    /// The session ends once this decision's outcome is in ([`RouterService::end_session_after`]).
    ends_session: bool,
}

struct Core {
    state: RouterState,
    sessions: SessionTable,
    pending: HashMap<u64, Pending>,
    /// Decision ids in creation order (may hold ids already reported; compacted when long).
    pending_order: VecDeque<u64>,
    forgotten: Vec<(SessionId, Forgotten)>,
    fleet: fleet::FleetCache,
    /// The worker whose KV-cache events showed a session's blocks when a decision last
    /// looked: blocks missing from that worker's events later are an eviction the events saw
    /// happen, whatever the events' lag ([`crate::config::EngineSignalsConfig::events_lag_ms`]).
    events_showed: HashMap<SessionId, WorkerId>,
    /// Decisions of a session on a worker still waiting for their outcome: while one is, its
    /// KV may still be on its way to that worker (a P→D seed is computed and shipped before
    /// the engine stores and reports it), so the worker's events cannot show it gone.
    /// Keyed by session and worker, the count of such decisions.
    in_flight: HashMap<(SessionId, WorkerId), u32>,
}

impl Core {
    /// Records a decision of `session` on `worker` as waiting for its outcome.
    fn flight_started(&mut self, session: Option<SessionId>, worker: WorkerId) {
        if let Some(s) = session {
            *self.in_flight.entry((s, worker)).or_insert(0) += 1;
        }
    }

    /// The outcome of a decision of `session` on `worker` is in (or will never be).
    fn flight_ended(&mut self, session: Option<SessionId>, worker: WorkerId) {
        let Some(s) = session else { return };
        if let std::collections::hash_map::Entry::Occupied(mut e) =
            self.in_flight.entry((s, worker))
        {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }
}

/// What a probe of a worker said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeOutcome {
    /// How the probe was answered (snapshot result, or the polled state).
    pub kind: ProbeKind,
    /// The answer: no room (`can_admit` false, zeros) when the snapshot is stale or contended
    /// (its age `u64::MAX` when it cannot be read at all).
    pub reply: ProbeAnswer,
}

/// A routing decision as the router hands it out: the policy's choice, the id that names it in
/// [`RouterService::report_outcome`], and whether a snapshot probe re-routed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterDecision {
    /// Names this decision when its outcome is reported.
    pub decision_id: u64,
    /// The planned path.
    pub mode: ExecutionMode,
    /// The prefill worker, on every path through one.
    pub prefill_worker: Option<WorkerId>,
    /// The decode worker, or the colocated worker in a colocated cluster.
    pub decode_worker: WorkerId,
    /// Why a later turn is not direct-to-D: set for `fallback` and `reseed`.
    pub fall_through_reason: Option<FallThroughReason>,
    /// Tokens reused, as the router believes (see [`kvc_policy::Decision::cached_tokens`]).
    pub cached_tokens: u64,
    /// Backpressure hint from the chosen worker's queue and use.
    pub recommended_pause_ms: u32,
    /// Footprint estimate on the decode worker, in tokens.
    pub need_tokens: u64,
    /// The decode worker the policy first planned direct-to-D on, when its snapshot probe could
    /// not admit the request and the request was re-routed.
    pub probe_rejected_by: Option<WorkerId>,
    /// The chosen decode worker's `overlap` score component (blocks of the request the policy
    /// counts on it holding), for the policies that score one (`kv-aware-v0`, `kvc-v2`).
    pub decode_overlap: Option<u64>,
    /// The policy's estimate of the request's prefill on the worker that prefills it, in
    /// microseconds; 0 when the policy makes none.
    pub predicted_prefill_us: u64,
}

/// How the request of a decision ended, for [`RouterService::report_outcome`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecisionOutcome {
    /// The decision ([`RouterDecision::decision_id`]).
    pub decision_id: u64,
    /// The request it was for (checked against the decision's).
    pub request_id: RequestId,
    /// How it ended.
    pub outcome: Outcome,
    /// Tokens of the session now resident on the decode worker (0 if none).
    pub resident_tokens: u64,
}

/// One worker as [`RouterService::list_workers`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedWorker {
    /// Its id.
    pub id: WorkerId,
    /// Its display name (`name` in the configuration, else one from its role and id).
    pub name: String,
    /// Its role.
    pub role: WorkerRole,
    /// Its last known state; the health says whether it is in rotation.
    pub state: WorkerState,
    /// Where that state comes from.
    pub source: StateSource,
    /// The counters of its KV-event streams over every data-parallel rank (indexed blocks
    /// summed, the highest last sequence number, gaps …; see
    /// [`kvc_events::StatsSnapshot::merged`]), once they run.
    pub events: Option<kvc_events::StatsSnapshot>,
    /// Each data-parallel rank's stream, lowest rank first (one for an engine without data
    /// parallelism), once they run.
    pub event_ranks: Vec<RankEvents>,
    /// Where its engine's KV-cache events are read (`tcp://…` or `ipc://…`: rank 0's; the
    /// router's `kv-events-listen` for an engine that connects to it), once known.
    pub kv_events: Option<String>,
    /// Where that came from: `config`, `engine` (`GET /kv_event_sources`), `listen` (the
    /// engine connects to the router's `kv-events-listen` socket), or empty.
    pub kv_events_from: &'static str,
    /// What reading the engine found an operator should know: the last attempt's problem, and
    /// the last answer's warnings (no events, no replay, …).
    pub warnings: Vec<String>,
    /// Drained by the operator: out of rotation, its running requests left to finish.
    pub drained: bool,
}

/// One data-parallel rank's KV-event stream of a worker, as [`ListedWorker`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEvents {
    /// The rank.
    pub rank: u32,
    /// The PUB endpoint read (`None`: the rank connects to the router's `kv-events-listen`).
    pub endpoint: Option<String>,
    /// Its stream's counters (its own sequence numbers, blocks indexed under the rank).
    pub stats: kvc_events::StatsSnapshot,
}

/// One session as [`RouterService::session_view`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionView {
    /// The decode (or colocated) worker it was last routed to.
    pub decode: Option<WorkerId>,
    /// Whether its KV is believed to be there.
    pub residency: kvc_policy::Residency,
    /// Its tokens resident there, as the last completion reported them.
    pub resident_tokens: u64,
    /// Blocks of its last request.
    pub blocks: usize,
    /// Of those, the leading ones the router's live view places on `decode`.
    pub held_blocks: usize,
    /// How many times it moved to another worker.
    pub moves: u32,
}

/// The router: worker views, the policy, its [`RouterState`], the session table and metrics.
///
/// Thread-safe; share it in an [`Arc`]. Decisions are serialised by one lock around the policy
/// state (the policy call and the snapshot probe are both short and never block).
pub struct RouterService {
    config: RouterConfig,
    clock: SharedClock,
    /// The fleet now: replaced whole when a worker is added or removed
    /// ([`RouterService::add_worker`], [`RouterService::remove_worker`]), so a reader holds
    /// one consistent table for as long as it needs.
    workers: RwLock<Arc<Workers>>,
    /// Serialises the fleet's changes (each one reads the table, then replaces it).
    changing: Mutex<()>,
    /// Told of every worker added or removed (the HTTP front's endpoints, the background
    /// tasks of a worker).
    fleet_watchers: RwLock<Vec<changes::FleetWatcher>>,
    core: Mutex<Core>,
    local_commit: RwLock<HashMap<WorkerId, CommitSender>>,
    next_decision: AtomicU64,
    metrics: Metrics,
    /// The client engine `/metrics` scrapes go through (its own connection pool).
    scrape_client: crate::worker_http::WorkerClient,
    /// What the engines' KV-cache events say each worker holds (written by the subscribers).
    kv_index: kvc_events::SharedIndex,
    /// When the service was made, on its clock (the KV-event catch-up window starts here).
    started_ms: u64,
    /// Changes of any worker's health ([`fleet::FleetCache`]).
    health_epoch: Arc<AtomicU64>,
    /// The `kv-events-listen` socket engines connect to, once bound
    /// ([`RouterService::bind_event_listener`]).
    kv_listener: std::sync::OnceLock<kvc_events::Listener>,
    /// The workers the inference pool's pods joined as ([`crate::pool`]): theirs to add and
    /// remove, left alone by a re-read of the file.
    pool_owned: RwLock<std::collections::HashSet<u32>>,
    /// What the inference pool's reader last found ([`crate::pool`]), once it has read.
    pool_stats: Mutex<Option<crate::metrics::PoolStats>>,
}

/// The workers of the fleet, in the order they were configured or added, and where each id's
/// entry is.
#[derive(Debug, Default)]
pub(crate) struct Workers {
    pub(crate) list: Vec<Arc<WorkerEntry>>,
    /// Each worker's entry in the configuration, in the order of `list`.
    pub(crate) configs: Vec<crate::config::WorkerConfig>,
    /// Index into `list` by worker id (`MAX_WORKERS` long).
    slots: Vec<Option<u32>>,
}

impl Workers {
    fn new(list: Vec<Arc<WorkerEntry>>, configs: Vec<crate::config::WorkerConfig>) -> Self {
        let mut slots = vec![None; MAX_WORKERS];
        for (i, w) in list.iter().enumerate() {
            slots[w.id.0 as usize] = Some(i as u32);
        }
        Workers {
            list,
            configs,
            slots,
        }
    }

    /// Worker `id`'s entry in the configuration.
    pub(crate) fn config(&self, id: u32) -> Option<&crate::config::WorkerConfig> {
        let i = (*self.slots.get(id as usize)?)?;
        self.configs.get(i as usize)
    }

    fn get(&self, id: u32) -> Option<&Arc<WorkerEntry>> {
        let i = (*self.slots.get(id as usize)?)?;
        self.list.get(i as usize)
    }
}

/// How long after start readiness waits for each worker's KV-cache events to catch up (the
/// subscriber's connect timeout, 2 s, plus its replay timeout, 5 s, with room to spare): a
/// router started beside engines that already served traffic replays what they hold before
/// it answers ready, and an engine whose events cannot be reached does not hold readiness
/// back for longer.
pub const KV_EVENTS_CATCH_UP_MS: u64 = 10_000;

/// Expired sessions a decision forgets at most (the background tick forgets the rest).
pub(crate) const EXPIRE_PER_DECISION: usize = 64;

/// Expired sessions forgotten per hold of the state's lock by the background tick.
pub(crate) const EXPIRE_CHUNK: usize = 4_096;

impl std::fmt::Debug for RouterService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterService")
            .field("policy", &self.config.policy.name())
            .field("workers", &self.workers().list)
            .finish_non_exhaustive()
    }
}

impl RouterService {
    /// A router for `config` on the system clock (the clock snapshot writers stamp with).
    pub fn new(config: RouterConfig) -> Result<Self, ConfigError> {
        Self::with_clock(config, Arc::new(SystemClock))
    }

    /// A router for `config` reading time from `clock` (for tests and simulations; snapshot
    /// writers must stamp their publishes with the same clock).
    pub fn with_clock(config: RouterConfig, clock: SharedClock) -> Result<Self, ConfigError> {
        config.validate()?;
        let health_epoch = Arc::new(AtomicU64::new(0));
        let workers: Vec<Arc<WorkerEntry>> = config
            .workers
            .iter()
            .map(|w| {
                let mut entry = WorkerEntry::new(w, &config);
                entry.share_health_epoch(&health_epoch);
                Arc::new(entry)
            })
            .collect();
        let fleet = fleet::FleetCache::new(&workers);
        let views: Vec<WorkerView> = workers.iter().map(|w| w.view_at(0)).collect();
        let workers = Workers::new(workers, config.workers.clone());
        let bounds = config.limits.state_bounds(config.max_pending_decisions);
        let mut state = RouterState::with_bounds(&config.policy, &views, bounds);
        state.reserve_sessions(config.sessions.max_sessions);
        for w in &config.workers {
            // Each worker's block bound from its configured pool, whatever its state says now.
            state.set_worker_blocks(w.worker_id(), w.capacity_tokens);
            if !w.can_append_prefill() {
                state.set_direct_append(w.worker_id(), false);
            }
        }
        let started_ms = clock.now_ms();
        let service = RouterService {
            core: Mutex::new(Core {
                state,
                sessions: SessionTable::new(config.sessions.max_sessions, config.sessions.ttl_ms),
                // Twice the bound, as for the session tables (`RouterState::reserve_sessions`).
                pending: HashMap::with_capacity(kvc_policy::reserved(config.max_pending_decisions)),
                pending_order: VecDeque::new(),
                forgotten: Vec::new(),
                fleet,
                events_showed: HashMap::new(),
                in_flight: HashMap::new(),
            }),
            config,
            clock,
            workers: RwLock::new(Arc::new(workers)),
            changing: Mutex::new(()),
            fleet_watchers: RwLock::new(Vec::new()),
            local_commit: RwLock::new(HashMap::new()),
            next_decision: AtomicU64::new(1),
            metrics: Metrics::new(),
            scrape_client: crate::worker_http::WorkerClient::new(Default::default()),
            kv_index: Arc::new(RwLock::new(kvc_events::KvIndex::new())),
            started_ms,
            health_epoch,
            kv_listener: std::sync::OnceLock::new(),
            pool_owned: RwLock::new(std::collections::HashSet::new()),
            pool_stats: Mutex::new(None),
        };
        service.refresh_workers();
        Ok(service)
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The current time on the router's clock.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Sends `CommitEvict` for `worker` to an in-process commit queue instead of a worker
    /// service (e.g. a simulated worker in the same process).
    pub fn attach_commit_queue(&self, worker: WorkerId, sender: CommitSender) {
        self.local_commit.write().insert(worker, sender);
    }

    /// The fleet as it is now (a worker added or removed after this call is not in it).
    pub(crate) fn workers(&self) -> Arc<Workers> {
        Arc::clone(&self.workers.read())
    }

    fn entry(&self, id: u32) -> Option<Arc<WorkerEntry>> {
        self.workers.read().get(id).cloned()
    }

    fn entry_or_invalid(&self, id: u32) -> Result<Arc<WorkerEntry>, RequestError> {
        self.entry(id)
            .ok_or_else(|| RequestError::InvalidArgument(format!("unknown worker {id}")))
    }

    /// Re-reads every snapshot-backed worker's state (the background refresher calls this every
    /// `refresh-interval-ms`).
    pub fn refresh_workers(&self) {
        let now = self.now_ms();
        for w in self.workers().list.iter() {
            w.refresh_snapshot(now);
        }
    }

    /// Asks every worker known only by its service address for its state, one after another,
    /// each call bounded by `rpc-timeout-ms` (the background poller calls this every
    /// `poll-interval-ms`).
    pub async fn poll_workers(&self) {
        let clock = &self.clock;
        for w in self.workers().list.iter() {
            if w.source == StateSource::Service && w.has_service() {
                w.poll(|| clock.now_ms()).await;
            }
        }
    }

    /// Scrapes `worker`'s engine `/metrics` once, within `engine-signals.scrape-timeout-ms`
    /// (a background task per such worker calls this every
    /// `engine-signals.scrape-interval-ms`); nothing for a worker without `metrics-url`.
    pub async fn scrape_worker(&self, worker: WorkerId) {
        let Some(entry) = self.entry(worker.0) else {
            return;
        };
        let timeout = Duration::from_millis(self.config.engine_signals.scrape_timeout_ms);
        let clock = &self.clock;
        entry
            .scrape(&self.scrape_client, timeout, || clock.now_ms())
            .await;
        // A pool read from the engine bounds the policy's block view as a configured one does.
        if entry.capacity_tokens == 0 && !entry.pool_bound_set.load(Ordering::Relaxed) {
            let pool = entry.pool_tokens();
            if pool > 0 {
                self.core.lock().state.set_worker_blocks(worker, pool);
                entry.pool_bound_set.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Why the router should not answer ready yet because of KV-cache events: a worker with
    /// `kv-events` whose subscriber has not caught up with its engine (not started, or its
    /// first replay not ended), within [`KV_EVENTS_CATCH_UP_MS`] of start. `None` once every
    /// one has, or the window has passed.
    pub fn events_catching_up(&self) -> Option<String> {
        if self.now_ms().saturating_sub(self.started_ms) >= KV_EVENTS_CATCH_UP_MS {
            return None;
        }
        // A worker whose engine answered it has no usable events is not waited for.
        let workers = self.workers();
        let behind: Vec<&str> = workers
            .list
            .iter()
            .filter(|w| {
                w.kv_events().is_some() || (w.discover.is_some() && !w.discovery.lock().answered)
            })
            .filter(|w| !w.event_stats().is_some_and(|s| s.synced))
            .map(|w| w.name.as_str())
            .collect();
        (!behind.is_empty()).then(|| {
            format!(
                "KV-cache events of {} still catching up with the engine (replay)",
                behind.join(", ")
            )
        })
    }

    /// Takes note of whether a 2xx answer of `worker`'s engine (one that carried `usage`)
    /// reported its cached prompt tokens. The first answer without them is warned about, once
    /// per worker: a vLLM engine reports them only when started with
    /// `--enable-prompt-tokens-details`, and without them no direct-to-D turn on it can be
    /// judged a `direct-cache-miss`.
    pub(crate) fn note_cache_accounting(&self, worker: WorkerId, reported: bool) {
        let Some(entry) = self.entry(worker.0) else {
            return;
        };
        let value = if reported { 1 } else { 2 };
        let before = entry.cache_accounting.swap(value, Ordering::Relaxed);
        if !reported && before != 2 {
            tracing::warn!(
                worker = worker.0,
                name = %entry.name,
                "{}",
                crate::discovery::NO_CACHED_TOKENS
            );
        }
    }

    /// The workers with a `kv-events` endpoint, or one to read from the engine.
    pub fn event_workers(&self) -> Vec<WorkerId> {
        self.workers()
            .list
            .iter()
            .filter(|w| w.has_event_source())
            .map(|w| w.id)
            .collect()
    }

    /// Binds the `kv-events-listen` socket (one per data-parallel rank, rank `r` at the
    /// port plus `r`), until `stop`, and declares the workers that listen (a discovering
    /// worker is declared once its engine says it connects out). Nothing without the key.
    pub async fn bind_event_listener(
        &self,
        stop: &tokio_util::sync::CancellationToken,
    ) -> Result<(), crate::error::ServeError> {
        let Some(endpoint) = &self.config.kv_events_listen else {
            return Ok(());
        };
        if self.kv_listener.get().is_some() {
            return Ok(());
        }
        let mut cfg = kvc_events::ListenerConfig::new(endpoint.clone());
        cfg.ranks = self.config.event_listen_ranks();
        let listener = kvc_events::Listener::bind(cfg, stop.child_token())
            .await
            .map_err(|e| crate::error::ServeError::EventListener(e.to_string()))?;
        for w in self.workers().list.iter() {
            if let Some(source) = w.kv_events().filter(|s| s.listens()) {
                listener.expect(w.id, &w.name, Some(source.topic.as_str()));
            }
        }
        tracing::info!(endpoints = ?listener.endpoints(), "kv-events: listening for engines that connect");
        let _ = self.kv_listener.set(listener);
        Ok(())
    }

    /// The endpoints the `kv-events-listen` socket bound (ports resolved), rank 0's first;
    /// empty before it is bound or without the key.
    pub fn event_listen_endpoints(&self) -> Vec<String> {
        self.kv_listener
            .get()
            .map(|l| l.endpoints().to_vec())
            .unwrap_or_default()
    }

    /// What the `kv-events-listen` socket could not hand to a worker (unknown topics, …).
    pub fn event_listener_stats(&self) -> Option<kvc_events::ListenerStats> {
        self.kv_listener.get().map(kvc_events::Listener::stats)
    }

    /// Starts `worker`'s KV-event streams (until `stop`), one per data-parallel rank, once
    /// the engine's block size and pool are known (configured, or reported by its
    /// `/metrics`): a SUB socket connected to each rank's endpoint, or, for a rank that
    /// connects to the router, a stream fed by the `kv-events-listen` socket; the index
    /// keeps at most the worker's pool in blocks for each rank. Returns `false` while either
    /// is unknown (call again later), `true` once started or when there is nothing to start.
    pub fn start_event_subscriber(
        &self,
        worker: WorkerId,
        stop: &tokio_util::sync::CancellationToken,
    ) -> bool {
        let Some(entry) = self.entry(worker.0) else {
            return true;
        };
        let Some(source) = entry.kv_events() else {
            // A source still to be read from the engine: wait for it.
            return entry.discover.is_none();
        };
        if entry.event_stats.get().is_some() {
            return true;
        }
        let Some(block_size) = entry.event_block_size() else {
            return false;
        };
        let Some(block_size) = kvc_core::BlockSize::new(block_size) else {
            tracing::error!(
                worker = worker.0,
                block_size,
                "kv-events: unusable block size"
            );
            return true;
        };
        // A pool read from the engine is known after its first scrape.
        let capacity = entry.pool_tokens();
        if capacity == 0 {
            return false;
        }
        let capacity_blocks =
            (capacity / u64::from(block_size.tokens())).clamp(1, u64::from(u32::MAX));
        let spec = kvc_events::WorkerSpec {
            block_size,
            capacity_blocks: capacity_blocks as u32,
        };
        if source.ranks.iter().any(|r| r.endpoint.is_none()) && self.kv_listener.get().is_none() {
            // The listener is bound before the event tasks start; until then there is
            // nothing to read.
            return false;
        }
        let mut streams = Vec::with_capacity(source.ranks.len());
        for r in &source.ranks {
            let mut cfg = kvc_events::SubscriberConfig::new(
                worker,
                spec,
                r.endpoint.clone().unwrap_or_default(),
            );
            cfg.rank = r.rank;
            cfg.replay_endpoint = r.replay.clone();
            cfg.topic = source.topic.clone();
            let subscriber = match &r.endpoint {
                Some(endpoint) => {
                    tracing::info!(
                        worker = worker.0,
                        rank = r.rank,
                        endpoint = %endpoint,
                        block_size = block_size.tokens(),
                        capacity_blocks,
                        "kv-events: subscribed"
                    );
                    kvc_events::spawn_subscriber(
                        cfg,
                        Arc::clone(&self.kv_index),
                        stop.child_token(),
                    )
                }
                None => {
                    let Some(listener) = self.kv_listener.get() else {
                        continue;
                    };
                    listener.expect(worker, &entry.name, Some(source.topic.as_str()));
                    let Some(sub) =
                        listener.start(cfg, Arc::clone(&self.kv_index), stop.child_token())
                    else {
                        tracing::error!(
                            worker = worker.0,
                            rank = r.rank,
                            "kv-events: the rank's stream already runs"
                        );
                        continue;
                    };
                    tracing::info!(
                        worker = worker.0,
                        rank = r.rank,
                        replay = r.replay.as_deref().unwrap_or("none"),
                        block_size = block_size.tokens(),
                        capacity_blocks,
                        "kv-events: reading the engine's events on the listen socket"
                    );
                    sub
                }
            };
            streams.push((r.rank, subscriber.stats));
        }
        let _ = entry.event_stats.set(streams);
        true
    }

    /// Whether `worker`'s engine events have caught up with `since_ms` (Unix ms): a batch the
    /// engine published at or after it is applied, so is everything it published before.
    pub(crate) fn events_caught_up(&self, worker: WorkerId, since_ms: u64) -> bool {
        self.entry(worker.0)
            .and_then(|e| e.event_stats())
            .and_then(|s| s.last_batch_ms)
            .is_some_and(|t| t >= since_ms)
    }

    /// How many tokens of `session`'s blocks `worker`'s engine events say it holds (its best
    /// rank); `None` for a worker without events, or before a stream of it has applied any.
    pub(crate) fn events_residency(&self, worker: WorkerId, session: SessionId) -> Option<u64> {
        let entry = self.entry(worker.0)?;
        let stats = entry.event_stats()?;
        stats.last_seq?;
        let block = u64::from(entry.event_block_size()?);
        let blocks = self
            .kv_index
            .read()
            .session_residency(session)
            .iter()
            .find(|(w, _)| *w == worker)
            .map_or(0, |(_, n)| *n);
        Some(u64::from(blocks) * block)
    }

    /// How many leading tokens of `prompt` `worker`'s engine events say it holds (its best
    /// rank), whichever request stored them; `None` for a worker without events, or before a
    /// stream of it has applied any.
    pub(crate) fn events_prompt_held(&self, worker: WorkerId, prompt: &[u32]) -> Option<u64> {
        self.entry(worker.0)?.event_stats()?.last_seq?;
        let held = self
            .kv_index
            .write()
            .overlap_tokens(prompt)
            .into_iter()
            .filter(|o| o.worker == worker)
            .map(|o| o.tokens)
            .max()
            .unwrap_or(0);
        Some(held)
    }

    /// The data-parallel rank of `worker` whose events hold the most of `session`'s blocks
    /// (the lowest on a tie), for a worker read as several ranks; `None` for one rank, or
    /// when no rank holds any.
    pub fn resident_rank(&self, worker: WorkerId, session: SessionId) -> Option<u32> {
        let ranks = self.entry(worker.0)?.event_stats.get()?.len();
        if ranks < 2 {
            return None;
        }
        self.kv_index
            .read()
            .session_residency_ranks(session)
            .into_iter()
            .filter(|(w, _, n)| *w == worker && *n > 0)
            .max_by_key(|(_, rank, n)| (*n, std::cmp::Reverse(*rank)))
            .map(|(_, rank, _)| rank)
    }

    /// Where the engines' KV-cache events place `session`: the worker that hosts sessions
    /// holding the most of its blocks (a decode worker on a tie), and how many; `None` when
    /// no such worker holds any.
    pub(crate) fn events_placement(&self, session: SessionId) -> Option<(WorkerId, u32)> {
        let residency = self.kv_index.read().session_residency(session);
        residency
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .filter_map(|(w, n)| {
                let v = self.entry(w.0)?;
                v.caps
                    .hosts_sessions()
                    .then_some((n, v.role == kvc_core::WorkerRole::Decode, w))
            })
            .max_by_key(|(n, decode, w)| (*n, *decode, std::cmp::Reverse(w.0)))
            .map(|(n, _, w)| (w, n))
    }

    /// The workers whose state is scraped from their engine's `/metrics`.
    pub fn scraped_workers(&self) -> Vec<WorkerId> {
        self.workers()
            .list
            .iter()
            .filter(|w| w.is_scraped())
            .map(|w| w.id)
            .collect()
    }

    /// Whether any worker is polled through its service.
    pub fn has_polled_workers(&self) -> bool {
        self.workers()
            .list
            .iter()
            .any(|w| w.source == StateSource::Service && w.has_service())
    }

    /// How many decisions worked out every worker's health: the healthy workers of each kind
    /// are kept between decisions and worked out again only when some worker's health changed
    /// (a failed poll or scrape, an unreadable snapshot, a worker answering again, the HTTP
    /// front's circuit breaker) or a state may have grown stale since.
    pub fn fleet_health_passes(&self) -> u64 {
        self.core.lock().fleet.passes()
    }

    /// Every worker as a policy sees it now.
    pub fn worker_views(&self) -> Vec<WorkerView> {
        let now = self.now_ms();
        self.workers().list.iter().map(|w| w.view_at(now)).collect()
    }

    /// Takes `worker` out of rotation (`down`), or returns it to what its state says: while
    /// down its health is [`kvc_core::Health::Down`] in [`RouterService::worker_views`], the
    /// metrics and every routing decision, so no policy picks it. The HTTP front's circuit
    /// breaker sets this. Returns `false` for an unknown worker.
    pub fn set_http_down(&self, worker: WorkerId, down: bool) -> bool {
        match self.entry(worker.0) {
            Some(e) => {
                e.set_http_down(down);
                true
            }
            None => false,
        }
    }

    /// Whether `worker` was taken out of rotation with [`RouterService::set_http_down`].
    pub fn is_http_down(&self, worker: WorkerId) -> bool {
        self.entry(worker.0)
            .is_some_and(|e| e.http_down.load(Ordering::Relaxed))
    }

    /// Drops sessions idle longer than the TTL, 4,096 at a time with the lock
    /// released in between, so decisions go on while many expire (every `Route` also drops a
    /// few, and a session whose turn comes is checked itself).
    pub fn expire_sessions(&self) {
        let now = self.now_ms();
        loop {
            let mut core = self.core.lock();
            let core = &mut *core;
            let more = core
                .sessions
                .expire_some(now, EXPIRE_CHUNK, &mut core.forgotten);
            self.forget(core);
            if !more {
                return;
            }
        }
    }

    fn forget(&self, core: &mut Core) {
        let (mut expired, mut evicted) = (0, 0);
        for (s, why) in core.forgotten.drain(..) {
            core.state.forget_session(s);
            core.events_showed.remove(&s);
            match why {
                Forgotten::Expired => expired += 1,
                Forgotten::Evicted => evicted += 1,
                // Ended sessions are forgotten and counted where the client ends them.
                Forgotten::Ended => {}
            }
        }
        if expired + evicted > 0 {
            self.metrics.record_forgotten(expired, evicted);
        }
    }

    /// Ends `session` now (its client said so): the session table and the policy state
    /// forget it, so its residency is released at once — what the router counted resident
    /// for it on its decode worker is free for the next session placed there. A decision of
    /// the session still in flight is reported as usual and ends it again when it was marked
    /// with [`RouterService::end_session_after`]. Whether the router knew the session.
    pub fn end_session(&self, session: SessionId) -> bool {
        let mut core = self.core.lock();
        let known = Self::end_in(&mut core, session);
        if known {
            self.metrics.record_session_ended();
        }
        known
    }

    fn end_in(core: &mut Core, session: SessionId) -> bool {
        let known = core.sessions.remove(session) | core.state.session(session).is_some();
        core.state.forget_session(session);
        core.events_showed.remove(&session);
        known
    }

    /// Marks decision `decision_id` its session's last turn: once its outcome is reported,
    /// the session ends as with [`RouterService::end_session`]. Whether the decision is
    /// still pending (and has a session).
    pub fn end_session_after(&self, decision_id: u64) -> bool {
        let mut core = self.core.lock();
        match core.pending.get_mut(&decision_id) {
            Some(p) if p.session.is_some() => {
                p.ends_session = true;
                true
            }
            _ => false,
        }
    }

    /// Sessions in the session table (the policy state holds no more than these).
    pub fn session_count(&self) -> usize {
        self.core.lock().sessions.len()
    }

    /// Sessions the policy state holds routing state for.
    pub fn policy_session_count(&self) -> usize {
        self.core.lock().state.session_count()
    }

    /// What the policy state holds of `session`: where it was last routed, whether its KV is
    /// believed there, and what of it the router counts resident on that worker (its blocks
    /// the live view places there). `None` for a session the policy does not hold.
    pub fn session_view(&self, session: SessionId) -> Option<SessionView> {
        let core = self.core.lock();
        let route = core.state.session(session)?;
        let held_blocks = route
            .current_d
            .map_or(0, |d| core.state.resident_depth(d, &route.blocks));
        Some(SessionView {
            decode: route.current_d,
            residency: route.residency,
            resident_tokens: route.resident_tokens,
            blocks: route.block_count(),
            held_blocks,
            moves: route.d_changes,
        })
    }

    /// Whether the router remembers `session`.
    pub fn knows_session(&self, session: SessionId) -> bool {
        let core = self.core.lock();
        core.sessions.last_seen(session).is_some() || core.state.session(session).is_some()
    }

    /// The most blocks the policy's block view keeps for `worker` in each view.
    pub fn worker_block_bound(&self, worker: WorkerId) -> u32 {
        self.core.lock().state.worker_block_bound(worker)
    }

    /// Decisions awaiting `ReportOutcome`.
    pub fn pending_decisions(&self) -> usize {
        self.core.lock().pending.len()
    }

    /// Gauges for the metrics exposition.
    pub fn gauges(&self) -> Gauges {
        let now = self.now_ms();
        let fleet = self.workers();
        let (sessions_tracked, pending_decisions, blocks, paces) = {
            let core = self.core.lock();
            let paces: Vec<f64> = fleet
                .list
                .iter()
                .map(|w| core.state.prefill_pace(w.id))
                .collect();
            let blocks = BlockSizes {
                known: core.state.known_blocks(),
                dropped: core.state.dropped_blocks(),
                session_dropped: core.state.dropped_session_blocks(),
            };
            (core.sessions.len(), core.pending.len(), blocks, paces)
        };
        let models = self.model_warnings();
        Gauges {
            workers: fleet
                .list
                .iter()
                .zip(models)
                .zip(paces)
                .map(|((w, model), prefill_pace)| WorkerSample {
                    id: w.id,
                    name: w.name.clone(),
                    role: w.role,
                    state: w.state_at(now),
                    events: w.event_stats(),
                    ranks: w.rank_stats(),
                    cache_accounting: w.cache_accounting(),
                    kv_events: w.kv_events().map(|k| {
                        (
                            k.shown(self.config.kv_events_listen.as_deref()),
                            w.kv_events_from(),
                        )
                    }),
                    discovery_warnings: {
                        let d = w.discovery.lock();
                        d.warnings.len()
                            + usize::from(d.problem.is_some())
                            + usize::from(w.engine_warning.lock().is_some())
                            + usize::from(model.is_some())
                    },
                    drained: w.drained.load(Ordering::Relaxed),
                    prefill_pace,
                })
                .collect(),
            sessions_tracked,
            pending_decisions,
            blocks,
            listener: self.event_listener_stats(),
            pool: *self.pool_stats.lock(),
        }
    }

    /// The Prometheus text exposition of the router's metrics.
    pub fn render_metrics(&self) -> String {
        self.metrics.render(&self.gauges())
    }

    /// Every worker with its state and health now.
    pub fn list_workers(&self) -> Vec<ListedWorker> {
        let now = self.now_ms();
        let models = self.model_warnings();
        self.workers()
            .list
            .iter()
            .zip(models)
            .map(|(w, model)| ListedWorker {
                id: w.id,
                name: w.name.clone(),
                role: w.role,
                state: w.state_at(now),
                source: w.source,
                events: w.event_stats(),
                event_ranks: {
                    let endpoints = w.kv_events().map(|k| k.ranks.clone()).unwrap_or_default();
                    w.rank_stats()
                        .into_iter()
                        .map(|(rank, stats)| RankEvents {
                            rank,
                            endpoint: endpoints
                                .iter()
                                .find(|r| r.rank == rank)
                                .and_then(|r| r.endpoint.clone()),
                            stats,
                        })
                        .collect()
                },
                kv_events: w
                    .kv_events()
                    .map(|k| k.shown(self.config.kv_events_listen.as_deref())),
                kv_events_from: w.kv_events_from(),
                warnings: {
                    let d = w.discovery.lock();
                    let engine = w.engine_warning.lock();
                    d.problem
                        .iter()
                        .chain(&d.warnings)
                        .chain(engine.iter())
                        .cloned()
                        .chain(model)
                        .collect()
                },
                drained: w.drained.load(Ordering::Relaxed),
            })
            .collect()
    }
}
