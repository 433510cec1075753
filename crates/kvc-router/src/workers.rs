//! The router's view of each worker: where its state comes from (a shared-memory snapshot, a
//! polled `kvc.v1.Worker` service, or a stock engine's own `/metrics`), its last known state,
//! and its health.
//!
//! Health is judged at the time of use from the age of the last good state:
//! - never seen, snapshot unreadable, or the last poll or scrape failed: `down`;
//! - last good state older than `stale-after-ms`: `stale`;
//! - otherwise `healthy` (or the health a polled worker reports about itself).
//!
//! So a worker leaves rotation as soon as its state is too old, without waiting for a refresh,
//! and comes back at the first refresh that sees it publish (or answer) again.

use crate::config::{RouterConfig, WorkerConfig, WorkerUrl};
use crate::engine_load::{EngineLoad, parse_engine_load};
use crate::worker_http::WorkerClient as HttpClient;
use kvc_admission::{CommitReply, CommitRequest, ReadError, SnapshotReader};
use kvc_core::{Capabilities, EngineKind, Health, StateSource, WorkerId, WorkerRole, WorkerState};
use kvc_policy::WorkerView;
use kvc_proto::worker::WorkerClient;
use parking_lot::{Mutex, RwLock};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

#[derive(Debug, Clone, Copy)]
struct Live {
    /// Last good state (its health and age are recomputed at use).
    state: WorkerState,
    /// Time of the last good state on the router clock (publish time for a snapshot).
    last_ok_ms: Option<u64>,
    /// The snapshot cannot be read, or the last poll failed.
    failing: bool,
    /// Health a polled worker reports about itself.
    reported: Health,
    /// [`WorkerEntry::released`] when the scrape whose load is in `state` was sent.
    released_at_scrape: u64,
}

/// A write of a worker's last state ([`WorkerEntry::live_write`]).
struct LiveWrite<'a> {
    entry: &'a WorkerEntry,
    guard: parking_lot::RwLockWriteGuard<'a, Live>,
    before: Health,
    now_ms: u64,
}

impl std::ops::Deref for LiveWrite<'_> {
    type Target = Live;

    fn deref(&self) -> &Live {
        &self.guard
    }
}

impl std::ops::DerefMut for LiveWrite<'_> {
    fn deref_mut(&mut self) -> &mut Live {
        &mut self.guard
    }
}

impl Drop for LiveWrite<'_> {
    fn drop(&mut self) {
        if self.entry.health_of(&self.guard, self.now_ms).0 != self.before {
            self.entry
                .health_epoch
                .fetch_add(1, std::sync::atomic::Ordering::Release);
        }
    }
}

/// One worker.
#[derive(Debug)]
pub(crate) struct WorkerEntry {
    pub(crate) id: WorkerId,
    pub(crate) name: String,
    pub(crate) role: WorkerRole,
    /// What its engine can do ([`WorkerConfig::capabilities`]), given to the policy.
    pub(crate) caps: Capabilities,
    /// The configured pool; 0 when it is read from the engine ([`WorkerEntry::pool_tokens`]).
    pub(crate) capacity_tokens: u64,
    /// The engine reported the pool of a worker configured without one, and the policy's
    /// block bound was set from it.
    pub(crate) pool_bound_set: std::sync::atomic::AtomicBool,
    pub(crate) source: StateSource,
    snapshot_path: Option<PathBuf>,
    reader: RwLock<Option<Arc<SnapshotReader>>>,
    last_open_attempt_ms: Mutex<Option<u64>>,
    /// Why the snapshot file could not be used at the last attempt (logged when it changes).
    open_failure: Mutex<Option<String>>,
    address: Option<String>,
    client: OnceLock<WorkerClient>,
    live: RwLock<Live>,
    /// Counts changes of any worker's health (shared by the router's workers): a write of a
    /// worker's state that changes its health, judged when written, adds one, so the router
    /// knows when the healthy sets it keeps must be worked out again.
    health_epoch: Arc<std::sync::atomic::AtomicU64>,
    /// Out of rotation by the HTTP front's circuit breaker (overrides any other health).
    pub(crate) http_down: std::sync::atomic::AtomicBool,
    /// Drained by the operator (`drained` in its entry, or `DrainWorker`): out of rotation
    /// (`Health::Draining` while it answers), the requests it runs left to finish.
    pub(crate) drained: std::sync::atomic::AtomicBool,
    /// Stops the worker's own background tasks (discovery, scrapes, event streams) when it
    /// leaves the fleet: each task's token, cancelled by [`WorkerEntry::stop_tasks`].
    tasks: Mutex<Vec<tokio_util::sync::CancellationToken>>,
    /// Set once it left the fleet.
    removed: std::sync::atomic::AtomicBool,
    /// The engine's `/metrics`, when the state comes from it.
    scraped: Option<Scraped>,
    /// The engine's KV-cache events, when the router indexes them: configured, or set once
    /// read from the engine ([`WorkerEntry::discover`]).
    kv_events: OnceLock<KvEventsSource>,
    /// A vLLM engine's HTTP server, asked for its event sources (`GET /kv_event_sources`)
    /// when `kv-events` is not configured.
    pub(crate) discover: Option<WorkerUrl>,
    /// How that discovery goes.
    pub(crate) discovery: Mutex<DiscoveryState>,
    /// What the engine's `/metrics` says is wrong with it for the router (prefix caching
    /// off), logged when it first appears.
    pub(crate) engine_warning: Mutex<Option<String>>,
    /// The counters of the running event streams, one per data-parallel rank (set once they
    /// start).
    pub(crate) event_stats: OnceLock<Vec<(u32, Arc<kvc_events::WorkerStats>)>>,
    /// Whether the engine's answers report cached prompt tokens: 0 not known yet, 1 they do,
    /// 2 they do not ([`crate::RouterService::note_cache_accounting`]).
    pub(crate) cache_accounting: std::sync::atomic::AtomicU8,
    /// The engine's block size as its `/metrics` last reported it (0: not reported).
    engine_block_size: std::sync::atomic::AtomicU32,
    /// Tokens of KV that requests the router saw end on this worker held (a running total).
    /// A scraped pool use still counts the requests that ended after the scrape was sent;
    /// [`WorkerEntry::state_at`] takes them off until the next scrape.
    released: std::sync::atomic::AtomicU64,
    stale_after_ms: u64,
    rpc_timeout: Duration,
}

/// Where a worker's KV-cache event source comes from, and what reading it from the engine
/// found so far.
#[derive(Debug, Default)]
pub(crate) struct DiscoveryState {
    /// Requests made to the engine.
    pub(crate) attempts: u64,
    /// The engine answered `/kv_event_sources` (usable or not): no longer waited for.
    pub(crate) answered: bool,
    /// Why the last attempt failed (logged when it changes); `None` after a good answer.
    pub(crate) problem: Option<String>,
    /// What the last good answer said an operator should know.
    pub(crate) warnings: Vec<String>,
    /// The wait after the last failed attempt.
    pub(crate) wait: std::time::Duration,
    /// The models the engine serves (`GET /v1/models`), once it has said.
    pub(crate) models: Vec<String>,
}

/// Where a stock engine publishes its KV-cache events: one stream per data-parallel rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KvEventsSource {
    /// Every rank read, lowest first (at least one).
    pub(crate) ranks: Vec<RankSource>,
    pub(crate) topic: String,
    /// Configured block size (else the one `/metrics` reports).
    pub(crate) block_size: Option<u32>,
}

/// One data-parallel rank's event stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RankSource {
    pub(crate) rank: u32,
    /// The PUB endpoint to connect to; `None`: the rank connects to the router's
    /// `kv-events-listen` socket.
    pub(crate) endpoint: Option<String>,
    pub(crate) replay: Option<String>,
}

impl KvEventsSource {
    /// The source `cfg` configures: `kv-events` (every rank at its port offset), or for a
    /// worker that listens (`listening`: the router binds `kv-events-listen`) its ranks read
    /// there; `None` otherwise.
    pub(crate) fn configured(cfg: &WorkerConfig, listening: bool) -> Option<Self> {
        if cfg.kv_events.is_none() && !cfg.listens_for_events(listening) {
            return None;
        }
        let at = |ep: &Option<String>, rank: u32| {
            ep.as_deref()
                .and_then(|e| WorkerConfig::rank_endpoint(e, rank))
        };
        Some(KvEventsSource {
            ranks: (0..cfg.kv_events_ranks.unwrap_or(1).max(1))
                .map(|rank| RankSource {
                    rank,
                    endpoint: at(&cfg.kv_events, rank),
                    replay: at(&cfg.kv_events_replay, rank),
                })
                .collect(),
            topic: cfg.kv_events_topic.clone().unwrap_or_default(),
            block_size: cfg.block_size,
        })
    }

    /// Where rank 0's events are read: its endpoint, or `listen` for the router's socket.
    pub(crate) fn shown(&self, listen: Option<&str>) -> String {
        match self.ranks.first().and_then(|r| r.endpoint.as_deref()) {
            Some(e) => e.to_owned(),
            None => listen.unwrap_or("").to_owned(),
        }
    }

    /// Whether rank 0 is read through the router's listen socket.
    pub(crate) fn listens(&self) -> bool {
        self.ranks.first().is_some_and(|r| r.endpoint.is_none())
    }
}

/// A stock engine's Prometheus endpoint.
#[derive(Debug)]
struct Scraped {
    kind: EngineKind,
    url: WorkerUrl,
    /// The engine's pool differs from `capacity-tokens` (said once).
    capacity_warned: std::sync::atomic::AtomicBool,
    /// The endpoint does not serve [`VLLM_LOAD_QUERY`]: it is read whole (said once).
    whole: std::sync::atomic::AtomicBool,
}

/// What a vLLM engine's `/metrics` is asked for: only the families its load is read from
/// (`prometheus_client`'s `name[]` filter, served under `/metrics/`). The whole answer is
/// some 50 KB of histograms that the engine's API server renders on its event loop, in the
/// way of the streams it serves (about 12 ms on a CPU machine, against 3 ms for these).
/// An endpoint that refuses it (a 4xx) or leaves out a family the load needs is read whole
/// from then on.
const VLLM_LOAD_QUERY: &str = "/?name%5B%5D=vllm%3Anum_requests_running\
     &name%5B%5D=vllm%3Anum_requests_waiting&name%5B%5D=vllm%3Akv_cache_usage_perc\
     &name%5B%5D=vllm%3Agpu_cache_usage_perc&name%5B%5D=vllm%3Acache_config_info";

/// Why a scrape gave no load.
enum ScrapeFailure {
    /// No answer in time: the last state ages.
    Timeout,
    /// The engine answered an error status.
    Status(u16),
    /// A 200 whose text is not the load (a family missing, a line malformed).
    NotLoad(String),
    /// No answer: no connection, a broken one.
    Unanswered(String),
}

impl WorkerEntry {
    /// The entry of `cfg` in a router configured by `router` (which sets its deadlines and
    /// how old a state may get).
    pub(crate) fn new(cfg: &WorkerConfig, router: &RouterConfig) -> Self {
        let scraped = match (&cfg.metrics_url, cfg.engine) {
            (Some(url), Some(kind)) => WorkerUrl::parse(url).ok().map(|url| Scraped {
                kind,
                url,
                capacity_warned: std::sync::atomic::AtomicBool::new(false),
                whole: std::sync::atomic::AtomicBool::new(false),
            }),
            _ => None,
        };
        let (source, stale_after_ms) = if cfg.snapshot.is_some() {
            (StateSource::Snapshot, router.stale_after_ms)
        } else if scraped.is_some() {
            (StateSource::Events, router.engine_signals.stale_after_ms)
        } else {
            (StateSource::Service, router.stale_after_ms)
        };
        let mut state = WorkerState::empty(cfg.capacity_tokens);
        state.health = Health::Down;
        WorkerEntry {
            id: cfg.worker_id(),
            name: cfg.display_name(),
            role: cfg.role,
            caps: cfg.capabilities(),
            capacity_tokens: cfg.capacity_tokens,
            pool_bound_set: std::sync::atomic::AtomicBool::new(false),
            source,
            snapshot_path: cfg.snapshot.clone(),
            reader: RwLock::new(None),
            last_open_attempt_ms: Mutex::new(None),
            open_failure: Mutex::new(None),
            address: cfg.address.clone(),
            client: OnceLock::new(),
            live: RwLock::new(Live {
                state,
                last_ok_ms: None,
                failing: false,
                reported: Health::Healthy,
                released_at_scrape: 0,
            }),
            health_epoch: Arc::default(),
            http_down: std::sync::atomic::AtomicBool::new(false),
            drained: std::sync::atomic::AtomicBool::new(cfg.drained),
            tasks: Mutex::new(Vec::new()),
            removed: std::sync::atomic::AtomicBool::new(false),
            scraped,
            kv_events: match KvEventsSource::configured(cfg, router.kv_events_listen.is_some()) {
                Some(source) => OnceLock::from(source),
                None => OnceLock::new(),
            },
            discover: cfg
                .discovers_events()
                .then(|| {
                    cfg.http_url
                        .as_deref()
                        .and_then(|u| WorkerUrl::parse(u).ok())
                })
                .flatten(),
            discovery: Mutex::new(DiscoveryState::default()),
            engine_warning: Mutex::new(None),
            event_stats: OnceLock::new(),
            cache_accounting: std::sync::atomic::AtomicU8::new(0),
            engine_block_size: std::sync::atomic::AtomicU32::new(0),
            released: std::sync::atomic::AtomicU64::new(0),
            stale_after_ms,
            rpc_timeout: Duration::from_millis(router.rpc_timeout_ms),
        }
    }

    /// Takes note of whether the engine reuses cached prefixes: off, no turn it serves reuses
    /// the session's KV (a direct-to-D turn is recomputed in full), which is warned about once
    /// and listed until the engine says it is on.
    fn note_prefix_caching(&self, on: Option<bool>) {
        let mut w = self.engine_warning.lock();
        match on {
            Some(false) if w.is_none() => {
                let text = crate::discovery::PREFIX_CACHING_OFF.to_owned();
                tracing::warn!(worker = self.id.0, name = %self.name, "{text}");
                *w = Some(text);
            }
            Some(true) => *w = None,
            _ => {}
        }
    }

    /// Where its engine's KV-cache events are read: configured, or discovered (`None` before
    /// that, or when there is no source).
    pub(crate) fn kv_events(&self) -> Option<&KvEventsSource> {
        self.kv_events.get()
    }

    /// Whether the router reads (or will, once discovered) this worker's KV-cache events.
    pub(crate) fn has_event_source(&self) -> bool {
        self.kv_events.get().is_some() || self.discover.is_some()
    }

    /// Where the event source came from: `config`, `engine` (discovered), `listen` (the
    /// engine connects to the router's `kv-events-listen` socket) or `` (none yet).
    pub(crate) fn kv_events_from(&self) -> &'static str {
        match (self.kv_events.get(), &self.discover) {
            (None, _) => "",
            (Some(s), _) if s.listens() => "listen",
            (Some(_), Some(_)) => "engine",
            (Some(_), None) => "config",
        }
    }

    /// Sets the source read from the engine (once; later calls change nothing).
    pub(crate) fn set_discovered(&self, source: KvEventsSource) -> bool {
        self.kv_events.set(source).is_ok()
    }

    /// The worker's KV pool in tokens: configured, else the last one its engine reported (0
    /// until then).
    pub(crate) fn pool_tokens(&self) -> u64 {
        match self.capacity_tokens {
            0 => self.live.read().state.capacity_tokens,
            n => n,
        }
    }

    /// A request that held `tokens` of KV on this worker has ended (its answer is complete): a
    /// scraped pool use taken before that no longer counts them.
    pub(crate) fn note_released(&self, tokens: u64) {
        self.released
            .fetch_add(tokens, std::sync::atomic::Ordering::Relaxed);
    }

    /// The last known state with health and age judged at `now_ms` (a scraped pool use without
    /// the requests seen ending since its scrape was sent).
    pub(crate) fn state_at(&self, now_ms: u64) -> WorkerState {
        let live = *self.live.read();
        let mut s = live.state;
        if self.scraped.is_some() {
            let since = self
                .released
                .load(std::sync::atomic::Ordering::Relaxed)
                .saturating_sub(live.released_at_scrape);
            s.used_tokens = s.used_tokens.saturating_sub(since);
        }
        s.state_age_ms = live
            .last_ok_ms
            .map_or(u64::MAX, |ok| now_ms.saturating_sub(ok));
        s.health = self.health_of(&live, now_ms).0;
        s
    }

    /// The health of `live` at `now_ms`, and the time from which it changes by itself (the
    /// state grows stale) if nothing is written: `None` when only a write can change it.
    fn health_of(&self, live: &Live, now_ms: u64) -> (Health, Option<u64>) {
        if self.http_down.load(std::sync::atomic::Ordering::Relaxed) {
            return (Health::Down, None);
        }
        let health = match live.last_ok_ms {
            None => (Health::Down, None),
            Some(_) if live.failing => (Health::Down, None),
            Some(ok) if now_ms.saturating_sub(ok) > self.stale_after_ms => (Health::Stale, None),
            Some(ok) => (
                live.reported,
                Some(ok.saturating_add(self.stale_after_ms).saturating_add(1)),
            ),
        };
        // Drained: no new work, but a healthy one still sends its sessions' KV as they leave.
        match health {
            (Health::Healthy, until) if self.drained.load(std::sync::atomic::Ordering::Relaxed) => {
                (Health::Draining, until)
            }
            other => other,
        }
    }

    /// The health at `now_ms` and when it changes by itself ([`WorkerEntry::health_of`]).
    pub(crate) fn health_until(&self, now_ms: u64) -> (Health, Option<u64>) {
        self.health_of(&self.live.read(), now_ms)
    }

    /// Shares the counter of health changes the router's workers add to.
    pub(crate) fn share_health_epoch(&mut self, epoch: &Arc<std::sync::atomic::AtomicU64>) {
        self.health_epoch = Arc::clone(epoch);
    }

    /// A token for one of the worker's background tasks: a child of `stop`, cancelled as well
    /// when the worker leaves the fleet ([`WorkerEntry::stop_tasks`]; at once if it already
    /// left).
    pub(crate) fn task_token(
        &self,
        stop: &tokio_util::sync::CancellationToken,
    ) -> tokio_util::sync::CancellationToken {
        let token = stop.child_token();
        let mut tasks = self.tasks.lock();
        if self.removed() {
            token.cancel();
        }
        tasks.retain(|t| !t.is_cancelled());
        tasks.push(token.clone());
        token
    }

    /// Stops the worker's background tasks for good: it left the fleet.
    pub(crate) fn stop_tasks(&self) {
        let mut tasks = self.tasks.lock();
        self.removed
            .store(true, std::sync::atomic::Ordering::Release);
        for t in tasks.drain(..) {
            t.cancel();
        }
    }

    /// Whether the worker left the fleet ([`WorkerEntry::stop_tasks`]).
    pub(crate) fn removed(&self) -> bool {
        self.removed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Drains the worker (or ends the drain); a change counts as a change of health. Returns
    /// whether it was drained before.
    pub(crate) fn set_drained(&self, drained: bool) -> bool {
        let before = self
            .drained
            .swap(drained, std::sync::atomic::Ordering::Relaxed);
        if before != drained {
            self.health_epoch
                .fetch_add(1, std::sync::atomic::Ordering::Release);
        }
        before
    }

    /// Takes the HTTP front's circuit breaker's word (see [`WorkerEntry::http_down`]); a change
    /// of it counts as a change of health.
    pub(crate) fn set_http_down(&self, down: bool) {
        if self
            .http_down
            .swap(down, std::sync::atomic::Ordering::Relaxed)
            != down
        {
            self.health_epoch
                .fetch_add(1, std::sync::atomic::Ordering::Release);
        }
    }

    /// The last state, for a write judged at `now_ms`: a write that changes the worker's
    /// health then counts in the router's health epoch.
    fn live_write(&self, now_ms: u64) -> LiveWrite<'_> {
        let guard = self.live.write();
        let before = self.health_of(&guard, now_ms).0;
        LiveWrite {
            entry: self,
            guard,
            before,
            now_ms,
        }
    }

    pub(crate) fn view_at(&self, now_ms: u64) -> WorkerView {
        WorkerView::new(self.id, self.role, self.state_at(now_ms)).with_caps(self.caps)
    }

    /// The snapshot reader, once the file could be opened.
    pub(crate) fn reader(&self) -> Option<Arc<SnapshotReader>> {
        self.reader.read().clone()
    }

    fn open_reader(&self, now_ms: u64) -> Option<Arc<SnapshotReader>> {
        let path = self.snapshot_path.as_ref()?;
        {
            let mut last = self.last_open_attempt_ms.lock();
            // Reopen at most twice per staleness period.
            if let Some(t) = *last
                && now_ms.saturating_sub(t) < (self.stale_after_ms / 2).max(1)
                && now_ms >= t
            {
                return None;
            }
            *last = Some(now_ms);
        }
        match SnapshotReader::open(path) {
            Ok(r) => {
                if r.worker_id() != self.id || r.capacity_tokens() != self.capacity_tokens {
                    self.open_failed(
                        path,
                        format!(
                            "its header says worker {} with {} tokens, the configuration \
                             worker {} with {} tokens",
                            r.worker_id().0,
                            r.capacity_tokens(),
                            self.id.0,
                            self.capacity_tokens
                        ),
                    );
                    self.live_write(now_ms).failing = true;
                    return None;
                }
                if self.open_failure.lock().take().is_some() {
                    tracing::info!(worker = self.id.0, path = %path.display(), "snapshot file opened");
                }
                let r = Arc::new(r.with_stale_after_ms(self.stale_after_ms));
                *self.reader.write() = Some(Arc::clone(&r));
                Some(r)
            }
            Err(e) => {
                self.open_failed(path, e.to_string());
                None
            }
        }
    }

    /// Logs why the snapshot file at `path` cannot be used: a warning with the path and the
    /// reason the first time and whenever the reason changes (from the first refresh, i.e. at
    /// startup), at debug level while it stays the same. The file is tried again at the next
    /// refresh (at most twice per `stale-after-ms`).
    fn open_failed(&self, path: &std::path::Path, reason: String) {
        let mut last = self.open_failure.lock();
        if last.as_deref() == Some(reason.as_str()) {
            tracing::debug!(worker = self.id.0, path = %path.display(), %reason, "snapshot file still unusable");
            return;
        }
        tracing::warn!(
            worker = self.id.0,
            path = %path.display(),
            %reason,
            "cannot use the snapshot file; the worker is out of rotation until it can (retrying)"
        );
        *last = Some(reason);
    }

    /// Re-reads the snapshot (opening or reopening the file when needed).
    pub(crate) fn refresh_snapshot(&self, now_ms: u64) {
        if self.source != StateSource::Snapshot {
            return;
        }
        let reader = match self.reader() {
            Some(r) => r,
            None => match self.open_reader(now_ms) {
                Some(r) => r,
                None => return,
            },
        };
        let fresh = self.apply_read(&reader, now_ms);
        if !fresh {
            // The writer may have replaced the file (a restarted worker renames a new one
            // over the path): try the file now under the name.
            if let Some(r) = self.open_reader(now_ms)
                && !Arc::ptr_eq(&r, &reader)
            {
                self.apply_read(&r, now_ms);
            }
        }
    }

    /// Applies one read of `reader`; returns whether the state is fresh.
    fn apply_read(&self, reader: &SnapshotReader, now_ms: u64) -> bool {
        match reader.read() {
            Ok(data) => {
                let mut live = self.live_write(now_ms);
                let newer = live.last_ok_ms.is_none_or(|t| data.publish_ms >= t);
                if newer {
                    live.state = data.worker_state(now_ms, Health::Healthy);
                    live.last_ok_ms = Some(data.publish_ms);
                    live.failing = false;
                    live.reported = Health::Healthy;
                }
                now_ms.saturating_sub(data.publish_ms) <= self.stale_after_ms
            }
            Err(ReadError::Contended) => true,
            Err(ReadError::NotPublished) => false,
            Err(e @ ReadError::Checksum { .. }) => {
                tracing::warn!(worker = self.id.0, error = %e, "snapshot read failed");
                self.live_write(now_ms).failing = true;
                false
            }
        }
    }

    fn client(&self) -> Option<WorkerClient> {
        let addr = self.address.as_ref()?;
        if let Some(c) = self.client.get() {
            return Some(c.clone());
        }
        let client = WorkerClient::connect_lazy(addr, self.rpc_timeout).ok()?;
        Some(self.client.get_or_init(|| client).clone())
    }

    /// Whether the worker has a service address.
    pub(crate) fn has_service(&self) -> bool {
        self.address.is_some()
    }

    /// Asks the worker service for its state and records the answer (or the failure).
    pub(crate) async fn poll(&self, now_ms: impl Fn() -> u64) {
        let Some(client) = self.client() else {
            return;
        };
        let answer = tokio::time::timeout(self.rpc_timeout, client.state()).await;
        let now = now_ms();
        let parsed = match answer {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err("timed out".to_owned()),
        };
        let mut live = self.live_write(now);
        match parsed {
            Ok(state) => {
                let was_down = live.failing || live.last_ok_ms.is_none();
                live.reported = state.health;
                live.state = state;
                live.last_ok_ms = Some(now.saturating_sub(state.state_age_ms));
                live.failing = false;
                if was_down {
                    tracing::info!(worker = self.id.0, "worker answers; in rotation");
                }
            }
            Err(e) => {
                if !live.failing {
                    tracing::warn!(worker = self.id.0, error = %e, "worker state poll failed; out of rotation");
                }
                live.failing = true;
            }
        }
    }

    /// Scrapes the engine's `/metrics` (within `timeout`) and records its load as the worker's
    /// state, or the failure (out of rotation until a scrape succeeds again).
    pub(crate) async fn scrape(
        &self,
        client: &HttpClient,
        timeout: Duration,
        now_ms: impl Fn() -> u64,
    ) {
        let Some(scraped) = &self.scraped else {
            return;
        };
        let released = self.released.load(std::sync::atomic::Ordering::Relaxed);
        let whole = &scraped.whole;
        let filtered =
            scraped.kind == EngineKind::Vllm && !whole.load(std::sync::atomic::Ordering::Relaxed);
        let mut load = self
            .read_load(
                client,
                scraped,
                if filtered { VLLM_LOAD_QUERY } else { "" },
                timeout,
            )
            .await;
        // A 4xx, or an answer without a family the load needs: the endpoint does not serve
        // the filter (another server in front, an older engine). Read whole from now on.
        if filtered
            && matches!(
                &load,
                Err(ScrapeFailure::Status(400..=499) | ScrapeFailure::NotLoad(_))
            )
        {
            whole.store(true, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(worker = self.id.0, url = %scraped.url.uri(""), "the engine's /metrics does not serve the load's families alone; reading it whole");
            load = self.read_load(client, scraped, "", timeout).await;
        }
        let now = now_ms();
        // A busy engine can be slow to answer /metrics (a CPU engine's API server waits out a
        // long prefill): a scrape that only ran out of time leaves the last good state to age
        // until `stale-after-ms`; an engine that refuses, breaks or garbles the answer is out
        // at once.
        let load = match load {
            Ok(load) => Ok(load),
            Err(ScrapeFailure::Timeout) => {
                tracing::debug!(worker = self.id.0, url = %scraped.url.uri(""), "engine metrics scrape timed out; the last state ages");
                return;
            }
            Err(ScrapeFailure::Status(status)) => Err(format!("HTTP status {status}")),
            Err(ScrapeFailure::NotLoad(e) | ScrapeFailure::Unanswered(e)) => Err(e),
        };
        let mut live = self.live_write(now);
        match load {
            Ok(load) => {
                if let Some(bs) = load.block_size {
                    self.engine_block_size
                        .store(bs, std::sync::atomic::Ordering::Relaxed);
                }
                self.note_prefix_caching(load.prefix_caching);
                let was_down = live.failing || live.last_ok_ms.is_none();
                live.state = self.engine_state(scraped, &load);
                live.released_at_scrape = released;
                live.reported = Health::Healthy;
                live.last_ok_ms = Some(now);
                live.failing = false;
                if was_down {
                    tracing::info!(worker = self.id.0, url = %scraped.url.uri(""), "engine metrics read; in rotation");
                }
            }
            Err(e) => {
                if !live.failing {
                    tracing::warn!(worker = self.id.0, url = %scraped.url.uri(""), error = %e, "engine metrics scrape failed; out of rotation");
                }
                live.failing = true;
            }
        }
    }

    /// One read of the engine's `/metrics` at `path` (below its URL) as its load. A
    /// kept-alive connection the engine's server closed just as the call went out (uvicorn
    /// closes idle ones after 5 s) says nothing of the engine: the client asks once more on
    /// a new connection (`worker_http`), where a live engine answers. A connection that
    /// breaks otherwise (mid-answer, or twice) is asked once more here: a busy engine's one
    /// broken scrape must not take it out of rotation.
    async fn read_load(
        &self,
        client: &HttpClient,
        scraped: &Scraped,
        path: &str,
        timeout: Duration,
    ) -> Result<EngineLoad, ScrapeFailure> {
        let mut answer = client.get(&scraped.url, path, timeout).await;
        if matches!(answer, Err(crate::worker_http::ForwardError::Broken(_))) {
            tracing::debug!(worker = self.id.0, url = %scraped.url.uri(path), "engine metrics scrape broke; asking again");
            answer = client.get(&scraped.url, path, timeout).await;
        }
        match answer {
            Ok(a) if a.status == 200 => std::str::from_utf8(&a.body)
                .map_err(|e| format!("not UTF-8 text: {e}"))
                .and_then(|text| parse_engine_load(scraped.kind, text).map_err(|e| e.to_string()))
                .map_err(ScrapeFailure::NotLoad),
            Ok(a) => Err(ScrapeFailure::Status(a.status)),
            Err(crate::worker_http::ForwardError::Timeout(_)) => Err(ScrapeFailure::Timeout),
            Err(e) => Err(ScrapeFailure::Unanswered(e.to_string())),
        }
    }

    /// The worker state an engine's load stands for: its pool (the engine's own size when it
    /// reports one) used by running requests, nothing evictable counted (a stock engine's
    /// cached blocks of finished requests are free room to it), waiting requests as the queue.
    fn engine_state(&self, scraped: &Scraped, load: &EngineLoad) -> WorkerState {
        let capacity = match load.pool_tokens {
            Some(pool) if pool > 0 => {
                if self.capacity_tokens == 0 {
                    if !scraped
                        .capacity_warned
                        .swap(true, std::sync::atomic::Ordering::Relaxed)
                    {
                        tracing::info!(
                            worker = self.id.0,
                            engine_pool_tokens = pool,
                            "KV pool read from the engine's /metrics (capacity-tokens not set)"
                        );
                    }
                } else if pool != self.capacity_tokens
                    && !scraped
                        .capacity_warned
                        .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(
                        worker = self.id.0,
                        engine_pool_tokens = pool,
                        config_capacity = self.capacity_tokens,
                        "the engine's KV pool differs from capacity-tokens; using the engine's"
                    );
                }
                pool
            }
            _ => self.capacity_tokens,
        };
        WorkerState {
            capacity_tokens: capacity,
            used_tokens: (load.kv_usage * capacity as f64).round() as u64,
            evictable_tokens: 0,
            queue_depth: load.waiting,
            in_flight: load.running,
            resident_sessions: 0,
            health: Health::Healthy,
            state_age_ms: 0,
        }
    }

    /// The block size the engine's events use: configured, else reported by its `/metrics`
    /// (`None` until a scrape has reported one).
    pub(crate) fn event_block_size(&self) -> Option<u32> {
        let source = self.kv_events()?;
        source.block_size.or_else(|| {
            match self
                .engine_block_size
                .load(std::sync::atomic::Ordering::Relaxed)
            {
                0 => None,
                bs => Some(bs),
            }
        })
    }

    /// Whether the engine's answers report cached prompt tokens (`None`: not known yet).
    pub(crate) fn cache_accounting(&self) -> Option<bool> {
        match self
            .cache_accounting
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            1 => Some(true),
            2 => Some(false),
            _ => None,
        }
    }

    /// The event streams' counters over every rank ([`kvc_events::StatsSnapshot::merged`]),
    /// once they run.
    pub(crate) fn event_stats(&self) -> Option<kvc_events::StatsSnapshot> {
        kvc_events::StatsSnapshot::merged(self.rank_stats().into_iter().map(|(_, s)| s))
    }

    /// Each rank's stream counters, lowest rank first (empty before they run).
    pub(crate) fn rank_stats(&self) -> Vec<(u32, kvc_events::StatsSnapshot)> {
        self.event_stats
            .get()
            .map(|v| v.iter().map(|(r, s)| (*r, s.snapshot())).collect())
            .unwrap_or_default()
    }

    /// Whether the state comes from the engine's `/metrics`.
    pub(crate) fn is_scraped(&self) -> bool {
        self.scraped.is_some()
    }

    /// Forwards a `CommitEvict` to the worker service (`None` when it has no address).
    pub(crate) async fn commit_evict(
        &self,
        req: CommitRequest,
    ) -> Option<Result<CommitReply, tonic::Status>> {
        let client = self.client()?;
        let answer =
            tokio::time::timeout(self.rpc_timeout, client.commit_evict(self.id, req)).await;
        Some(match answer {
            Ok(r) => r,
            Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                "worker {} did not answer CommitEvict within {} ms",
                self.id.0,
                self.rpc_timeout.as_millis()
            ))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// What a tracing subscriber writes, shared with the test.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The warnings logged while `f` runs.
    fn warnings(f: impl FnOnce()) -> Vec<String> {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(out.0.lock().clone()).unwrap();
        text.lines().map(str::to_owned).collect()
    }

    fn entry(path: &std::path::Path) -> WorkerEntry {
        let mut cfg = WorkerConfig::new(3, WorkerRole::Decode, 1_000);
        cfg.snapshot = Some(path.to_owned());
        let router = crate::RouterConfig {
            stale_after_ms: 1_000,
            rpc_timeout_ms: 100,
            ..crate::RouterConfig::default()
        };
        WorkerEntry::new(&cfg, &router)
    }

    #[test]
    fn unusable_snapshot_files_are_logged_with_path_and_reason_once_and_retried() {
        let dir = std::env::temp_dir().join(format!("kvc-workers-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.snap");
        let garbage = dir.join("garbage.snap");
        std::fs::write(&garbage, b"not a snapshot at all").unwrap();
        for path in [&missing, &garbage] {
            let w = entry(path);
            let logged = warnings(|| {
                // At startup, then at later refreshes (each a retry: 500 ms apart).
                for now in [0, 600, 1_200] {
                    w.refresh_snapshot(now);
                }
            });
            assert_eq!(
                logged.len(),
                1,
                "logged once while the reason stays: {logged:?}"
            );
            let line = &logged[0];
            assert!(line.contains(&path.display().to_string()), "{line}");
            assert!(line.contains("reason="), "{line}");
            assert!(line.contains("worker=3"), "{line}");
            assert_eq!(w.state_at(1_200).health, Health::Down);
            assert_eq!(*w.last_open_attempt_ms.lock(), Some(1_200), "retried");
        }
        let missing_reason = warnings(|| entry(&missing).refresh_snapshot(0)).concat();
        let garbage_reason = warnings(|| entry(&garbage).refresh_snapshot(0)).concat();
        assert_ne!(
            missing_reason.split("reason=").nth(1),
            garbage_reason.split("reason=").nth(1),
            "the reasons differ"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn requests_seen_ending_after_a_scrape_no_longer_count_in_its_pool_use() {
        let usage = Arc::new(Mutex::new(0.87));
        let shared = Arc::clone(&usage);
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let u = *shared.lock();
                async move {
                    format!(
                        "vllm:num_requests_running{{model_name=\"m\"}} 1\n\
                         vllm:num_requests_waiting{{model_name=\"m\"}} 0\n\
                         vllm:kv_cache_usage_perc{{model_name=\"m\"}} {u}\n"
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let mut cfg = WorkerConfig::new(1, WorkerRole::Decode, 100_000);
        cfg.engine = Some(EngineKind::Vllm);
        cfg.metrics_url = Some(format!("http://{addr}/metrics"));
        let w = WorkerEntry::new(&cfg, &crate::RouterConfig::default());
        let client = HttpClient::new(crate::worker_http::PoolOptions::default());
        let timeout = Duration::from_secs(5);
        w.scrape(&client, timeout, || 0).await;
        assert_eq!(w.state_at(0).used_tokens, 87_000);
        // The session's turn that held 60K tokens ends before the next scrape.
        w.note_released(60_000);
        assert_eq!(w.state_at(0).used_tokens, 27_000);
        w.note_released(40_000);
        assert_eq!(w.state_at(0).used_tokens, 0, "never below nothing");
        // The next scrape shows the engine's own figure, and only later ends count against it.
        *usage.lock() = 0.3;
        w.scrape(&client, timeout, || 10).await;
        assert_eq!(w.state_at(10).used_tokens, 30_000);
        w.note_released(5_000);
        assert_eq!(w.state_at(10).used_tokens, 25_000);
        // A worker whose state does not come from scrapes is left as it is.
        let mut cfg = WorkerConfig::new(2, WorkerRole::Decode, 100_000);
        cfg.snapshot = Some(std::path::PathBuf::from("/nonexistent/kvc.snap"));
        let snap = WorkerEntry::new(&cfg, &crate::RouterConfig::default());
        snap.live.write().state.used_tokens = 50_000;
        snap.note_released(20_000);
        assert_eq!(snap.state_at(0).used_tokens, 50_000);
    }

    #[tokio::test]
    async fn a_scrape_whose_connection_breaks_is_asked_once_more_before_the_worker_leaves() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A server that closes the first `breaks` connections after reading the request (as
        // an engine closing an idle kept-alive connection does), then answers.
        async fn serve(breaks: usize) -> std::net::SocketAddr {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(async move {
                let mut seen = 0;
                loop {
                    let (mut sock, _) = listener.accept().await.unwrap();
                    let mut buf = [0u8; 4096];
                    let _ = sock.read(&mut buf).await;
                    seen += 1;
                    if seen <= breaks {
                        drop(sock);
                        continue;
                    }
                    let body = "vllm:num_requests_running{model_name=\"m\"} 2\n\
                                vllm:num_requests_waiting{model_name=\"m\"} 0\n\
                                vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n";
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = sock.write_all(head.as_bytes()).await;
                    let _ = sock.write_all(body.as_bytes()).await;
                }
            });
            addr
        }
        let client = HttpClient::new(crate::worker_http::PoolOptions::default());
        let timeout = Duration::from_secs(5);
        // Each scrape is two calls of the client's (the second on a new connection when the
        // first closes unanswered), and a broken one is scraped once more: three broken
        // connections are survived, four are not.
        for (breaks, health, used) in [(3, Health::Healthy, 50_000), (4, Health::Down, 0)] {
            let addr = serve(breaks).await;
            let mut cfg = WorkerConfig::new(1, WorkerRole::Decode, 100_000);
            cfg.engine = Some(EngineKind::Vllm);
            cfg.metrics_url = Some(format!("http://{addr}/metrics"));
            let w = WorkerEntry::new(&cfg, &crate::RouterConfig::default());
            w.scrape(&client, timeout, || 0).await;
            let state = w.state_at(0);
            assert_eq!(state.health, health, "{breaks} broken connection(s)");
            assert_eq!(state.used_tokens, used, "{breaks} broken connection(s)");
            // Drained, a worker that answers is draining (it still sends its sessions' KV as
            // they leave); one that does not stays down; the breaker's verdict wins.
            w.set_drained(true);
            let drained = if health == Health::Healthy {
                Health::Draining
            } else {
                health
            };
            assert_eq!(
                w.state_at(0).health,
                drained,
                "{breaks} broken connection(s)"
            );
            w.http_down
                .store(true, std::sync::atomic::Ordering::Relaxed);
            assert_eq!(w.state_at(0).health, Health::Down);
            w.http_down
                .store(false, std::sync::atomic::Ordering::Relaxed);
            w.set_drained(false);
            assert_eq!(w.state_at(0).health, health, "back in rotation");
        }
    }
}
