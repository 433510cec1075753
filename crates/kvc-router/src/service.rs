//! The routing service itself, independent of the transport: validation, the policy call, the
//! probe-and-re-route path, outcome feedback, and the bounded session and pending tables.

use crate::config::RouterConfig;
use crate::convert::ProtoEnum;
use crate::error::{ConfigError, RequestError};
use crate::metrics::{CommitKind, Gauges, Metrics, ProbeKind, WorkerSample};
use crate::pb;
use crate::sessions::{Forgotten, SessionTable};
use crate::workers::{StateSource, WorkerEntry};
use kvc_admission::{Clock, CommitError, CommitRequest, CommitSender, ProbeResult, SystemClock};
use kvc_core::{BlockHash, Outcome, RequestId, SessionId, TurnId, WorkerId};
use kvc_policy::{
    ClusterView, Decision, MAX_WORKERS, Observation, RouteRequest, RouterState, WorkerView,
};
use parking_lot::{Mutex, RwLock};
use prost::Message as _;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A clock shared by the router and its background tasks.
pub type SharedClock = Arc<dyn Clock + Send + Sync>;

#[derive(Debug, Clone, Copy)]
struct Pending {
    request_id: RequestId,
    session: Option<SessionId>,
    decode: WorkerId,
    direct: bool,
}

struct Core {
    state: RouterState,
    sessions: SessionTable,
    pending: HashMap<u64, Pending>,
    /// Decision ids in creation order (may hold ids already reported; compacted when long).
    pending_order: VecDeque<u64>,
    forgotten: Vec<(SessionId, Forgotten)>,
}

/// What a probe of a worker said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeOutcome {
    /// How the probe was answered (snapshot result, or the polled state).
    pub kind: ProbeKind,
    /// The answer as sent on the wire.
    pub reply: pb::ProbeReply,
}

/// The router: worker views, the policy, its [`RouterState`], the session table and metrics.
///
/// Thread-safe; share it in an [`Arc`]. Decisions are serialised by one lock around the policy
/// state (the policy call and the snapshot probe are both short and never block).
pub struct RouterService {
    config: RouterConfig,
    clock: SharedClock,
    workers: Vec<WorkerEntry>,
    slots: Vec<Option<usize>>,
    core: Mutex<Core>,
    local_commit: RwLock<HashMap<WorkerId, CommitSender>>,
    next_decision: AtomicU64,
    metrics: Metrics,
}

impl std::fmt::Debug for RouterService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterService")
            .field("policy", &self.config.policy.name())
            .field("workers", &self.workers)
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
        let timeout = Duration::from_millis(config.rpc_timeout_ms);
        let workers: Vec<WorkerEntry> = config
            .workers
            .iter()
            .map(|w| WorkerEntry::new(w, config.stale_after_ms, timeout))
            .collect();
        let mut slots = vec![None; MAX_WORKERS];
        for (i, w) in workers.iter().enumerate() {
            slots[w.id.0 as usize] = Some(i);
        }
        let views: Vec<WorkerView> = workers.iter().map(|w| w.view_at(0)).collect();
        let mut state = RouterState::new(&config.policy, &views);
        for w in config.workers.iter().filter(|w| !w.append_prefill) {
            state.set_direct_append(w.worker_id(), false);
        }
        let service = RouterService {
            core: Mutex::new(Core {
                state,
                sessions: SessionTable::new(config.sessions.max_sessions, config.sessions.ttl_ms),
                pending: HashMap::new(),
                pending_order: VecDeque::new(),
                forgotten: Vec::new(),
            }),
            config,
            clock,
            workers,
            slots,
            local_commit: RwLock::new(HashMap::new()),
            next_decision: AtomicU64::new(1),
            metrics: Metrics::new(),
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

    fn entry(&self, id: u32) -> Option<&WorkerEntry> {
        self.slots
            .get(id as usize)
            .copied()
            .flatten()
            .map(|i| &self.workers[i])
    }

    fn entry_or_invalid(&self, id: u32) -> Result<&WorkerEntry, RequestError> {
        self.entry(id)
            .ok_or_else(|| RequestError::InvalidArgument(format!("unknown worker {id}")))
    }

    /// Re-reads every snapshot-backed worker's state (the background refresher calls this every
    /// `refresh-interval-ms`).
    pub fn refresh_workers(&self) {
        let now = self.now_ms();
        for w in &self.workers {
            w.refresh_snapshot(now);
        }
    }

    /// Asks every worker known only by its service address for its state, one after another,
    /// each call bounded by `rpc-timeout-ms` (the background poller calls this every
    /// `poll-interval-ms`).
    pub async fn poll_workers(&self) {
        let clock = &self.clock;
        for w in &self.workers {
            if w.source == StateSource::Service && w.has_service() {
                w.poll(|| clock.now_ms()).await;
            }
        }
    }

    /// Whether any worker is polled through its service.
    pub fn has_polled_workers(&self) -> bool {
        self.workers
            .iter()
            .any(|w| w.source == StateSource::Service && w.has_service())
    }

    /// Every worker as a policy sees it now.
    pub fn worker_views(&self) -> Vec<WorkerView> {
        let now = self.now_ms();
        self.workers.iter().map(|w| w.view_at(now)).collect()
    }

    /// Takes `worker` out of rotation (`down`), or returns it to what its state says: while
    /// down its health is [`kvc_core::Health::Down`] in [`RouterService::worker_views`], the
    /// metrics and every routing decision, so no policy picks it. The HTTP front's circuit
    /// breaker sets this. Returns `false` for an unknown worker.
    pub fn set_http_down(&self, worker: WorkerId, down: bool) -> bool {
        match self.entry(worker.0) {
            Some(e) => {
                e.http_down.store(down, Ordering::Relaxed);
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

    /// Drops sessions idle longer than the TTL (also done on every `Route`).
    pub fn expire_sessions(&self) {
        let now = self.now_ms();
        let mut core = self.core.lock();
        let core = &mut *core;
        core.sessions.expire(now, &mut core.forgotten);
        self.forget(core);
    }

    fn forget(&self, core: &mut Core) {
        let (mut expired, mut evicted) = (0, 0);
        for (s, why) in core.forgotten.drain(..) {
            core.state.forget_session(s);
            match why {
                Forgotten::Expired => expired += 1,
                Forgotten::Evicted => evicted += 1,
            }
        }
        if expired + evicted > 0 {
            self.metrics.record_forgotten(expired, evicted);
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

    /// Whether the router remembers `session`.
    pub fn knows_session(&self, session: SessionId) -> bool {
        let core = self.core.lock();
        core.sessions.last_seen(session).is_some() || core.state.session(session).is_some()
    }

    /// Decisions awaiting `ReportOutcome`.
    pub fn pending_decisions(&self) -> usize {
        self.core.lock().pending.len()
    }

    /// Gauges for the metrics exposition.
    pub fn gauges(&self) -> Gauges {
        let now = self.now_ms();
        let (sessions_tracked, pending_decisions) = {
            let core = self.core.lock();
            (core.sessions.len(), core.pending.len())
        };
        Gauges {
            workers: self
                .workers
                .iter()
                .map(|w| WorkerSample {
                    id: w.id,
                    name: w.name.clone(),
                    role: w.role,
                    state: w.state_at(now),
                })
                .collect(),
            sessions_tracked,
            pending_decisions,
        }
    }

    /// The Prometheus text exposition of the router's metrics.
    pub fn render_metrics(&self) -> String {
        self.metrics.render(&self.gauges())
    }

    fn validate_route(&self, req: &pb::RouteRequest) -> Result<(), RequestError> {
        let size = req.encoded_len();
        if size > self.config.max_message_bytes {
            return Err(RequestError::InvalidArgument(format!(
                "request of {size} bytes exceeds the limit of {} bytes",
                self.config.max_message_bytes
            )));
        }
        if req.input_length == 0 {
            return Err(RequestError::InvalidArgument(
                "input_length must be positive".into(),
            ));
        }
        match (req.session_id, req.turn_id) {
            (None, Some(_)) => {
                return Err(RequestError::InvalidArgument(
                    "turn_id given without session_id".into(),
                ));
            }
            (_, Some(0)) => {
                return Err(RequestError::InvalidArgument(
                    "turn_id counts from 1".into(),
                ));
            }
            _ => {}
        }
        if let Some(w) = req.rejected_by
            && self.entry(w).is_none()
        {
            return Err(RequestError::InvalidArgument(format!(
                "rejected_by names unknown worker {w}"
            )));
        }
        let block = self.config.policy.block_size();
        let max_blocks = block.blocks_for(req.input_length);
        if req.hash_ids.len() as u64 > max_blocks {
            return Err(RequestError::InvalidArgument(format!(
                "{} hash_ids for an input of {} tokens: at most {max_blocks} blocks of {} tokens",
                req.hash_ids.len(),
                req.input_length,
                block.tokens()
            )));
        }
        if req.hash_ids.is_empty() && req.input_length > u64::from(block.tokens()) {
            return Err(RequestError::InvalidArgument(format!(
                "no hash_ids for an input of {} tokens (more than one block of {}); send one id per block",
                req.input_length,
                block.tokens()
            )));
        }
        Ok(())
    }

    /// Probes `worker` for `need_tokens` (for `session`): its snapshot when it has one (no
    /// RPC), else its last polled state.
    pub fn probe_worker(
        &self,
        worker: WorkerId,
        need_tokens: u64,
        session: Option<SessionId>,
    ) -> Result<ProbeOutcome, RequestError> {
        let entry = self.entry_or_invalid(worker.0)?;
        let now = self.now_ms();
        let outcome = probe_entry(entry, need_tokens, session, now);
        self.metrics.record_probe(outcome.kind);
        Ok(outcome)
    }

    /// Decides where a request goes.
    ///
    /// Validates it (`INVALID_ARGUMENT` for a malformed request), asks the policy, and when the
    /// policy plans `direct-to-d` probes that decode worker's snapshot for the decision's
    /// footprint: if it cannot admit, the reject is observed and the request re-routed through
    /// a prefill worker. The decision is applied to the router state and remembered under its
    /// decision id until [`RouterService::report_outcome`].
    pub fn route(&self, req: &pb::RouteRequest) -> Result<pb::RouteDecision, RequestError> {
        self.route_excluding(req, &[])
    }

    /// [`RouterService::route`] with the workers in `exclude` treated as down for this one
    /// decision (a request re-routed after those workers failed it). `UNAVAILABLE` when no
    /// other worker can take it.
    pub fn route_excluding(
        &self,
        req: &pb::RouteRequest,
        exclude: &[WorkerId],
    ) -> Result<pb::RouteDecision, RequestError> {
        let started = Instant::now();
        let result = self.route_inner(req, exclude);
        match &result {
            Ok(d) => {
                let mode = kvc_core::ExecutionMode::from_proto(d.mode).ok();
                let reason = d
                    .fall_through_reason
                    .and_then(|r| kvc_core::FallThroughReason::from_proto(r).ok());
                if let Some(mode) = mode {
                    self.metrics.record_decision(mode, reason);
                }
                self.metrics.record_latency(started.elapsed());
            }
            Err(e) => self.metrics.record_route_error(e.code()),
        }
        result
    }

    fn route_inner(
        &self,
        req: &pb::RouteRequest,
        exclude: &[WorkerId],
    ) -> Result<pb::RouteDecision, RequestError> {
        self.validate_route(req)?;
        let hash_ids: Vec<BlockHash> = req.hash_ids.iter().copied().map(BlockHash).collect();
        let session = req.session_id.map(SessionId);
        let mut rreq = RouteRequest::new(
            RequestId(req.request_id),
            req.input_length,
            req.output_hint,
            &hash_ids,
        );
        rreq.session = session;
        rreq.turn = req.turn_id.map(TurnId);
        // A caller whose own admission on D refused the previous direct-to-D decision asks
        // again; the policy counts that reject and answers with a P->D path.
        rreq.rejected_by = req.rejected_by.map(WorkerId);
        let now = self.now_ms();
        let mut views: Vec<WorkerView> = self.workers.iter().map(|w| w.view_at(now)).collect();
        for v in &mut views {
            if exclude.contains(&v.id) {
                v.state.health = kvc_core::Health::Down;
            }
        }
        let cluster = ClusterView::new(now, &views);
        let policy = &self.config.policy;

        let mut core = self.core.lock();
        let core = &mut *core;
        core.sessions.expire(now, &mut core.forgotten);
        if let Some(s) = session {
            core.sessions.touch(s, now, &mut core.forgotten);
        }
        self.forget(core);

        let mut decision = kvc_policy::route(policy, &core.state, &cluster, &rreq)?;
        let mut probe_rejected_by = None;
        if decision.is_direct() {
            let d = decision.decode;
            let admitted = match self.entry(d.0) {
                Some(entry) => {
                    let p = probe_entry(entry, decision.need_tokens, session, now);
                    self.metrics.record_probe(p.kind);
                    p.reply.can_admit
                }
                None => false,
            };
            if !admitted {
                if let Some(s) = session {
                    core.state.observe(&Observation::AdmissionRejected {
                        session: s,
                        worker: d,
                    });
                }
                self.metrics.record_reroute();
                decision = kvc_policy::route(policy, &core.state, &cluster, &rreq.rejected_by(d))?;
                probe_rejected_by = Some(d.0);
            }
        }
        core.state.apply(&decision.change);
        let id = self.next_decision.fetch_add(1, Ordering::Relaxed);
        core.pending.insert(
            id,
            Pending {
                request_id: rreq.request_id,
                session,
                decode: decision.decode,
                direct: decision.is_direct(),
            },
        );
        core.pending_order.push_back(id);
        self.bound_pending(core);
        Ok(to_pb(id, &decision, probe_rejected_by))
    }

    fn bound_pending(&self, core: &mut Core) {
        let max = self.config.max_pending_decisions;
        let mut dropped = 0u64;
        while core.pending.len() > max {
            let Some(oldest) = core.pending_order.pop_front() else {
                break;
            };
            if let Some(p) = core.pending.remove(&oldest) {
                // Release its in-flight count without touching the session's residency: the
                // outcome is unknown.
                core.state.observe(&Observation::Completed {
                    request_id: p.request_id,
                    session: None,
                    worker: p.decode,
                    outcome: Outcome::WorkerFailed,
                    resident_tokens: 0,
                    direct: p.direct,
                });
                dropped += 1;
            }
        }
        if core.pending_order.len() > 2 * max.max(16) {
            let pending = &core.pending;
            core.pending_order.retain(|id| pending.contains_key(id));
        }
        if dropped > 0 {
            self.metrics.record_pending_dropped(dropped);
        }
    }

    /// Feeds a request's outcome back: the decode worker's residency for the session, the
    /// in-flight count, and (for a successful direct-to-D turn) the session's reject counter.
    ///
    /// A direct-to-D decision reported `rejected` (its decode worker's admission refused the
    /// turn) only releases the request: the worker served nothing, so what the router believes
    /// resident there is left as it was (the caller then routes again with `rejected_by`).
    pub fn report_outcome(&self, report: &pb::OutcomeReport) -> Result<(), RequestError> {
        let outcome = Outcome::from_proto(report.outcome)
            .map_err(|e| RequestError::InvalidArgument(e.to_string()))?;
        let now = self.now_ms();
        let mut core = self.core.lock();
        let core = &mut *core;
        let Some(p) = core.pending.get(&report.decision_id).copied() else {
            return Err(RequestError::NotFound(format!(
                "unknown decision {} (already reported, or dropped)",
                report.decision_id
            )));
        };
        if p.request_id.0 != report.request_id {
            return Err(RequestError::InvalidArgument(format!(
                "decision {} was for request {}, not {}",
                report.decision_id, p.request_id.0, report.request_id
            )));
        }
        core.pending.remove(&report.decision_id);
        let refused = p.direct && outcome == Outcome::Rejected;
        core.state.observe(&Observation::Completed {
            request_id: p.request_id,
            session: if refused { None } else { p.session },
            worker: p.decode,
            outcome,
            resident_tokens: report.resident_tokens,
            direct: p.direct,
        });
        if let Some(s) = p.session
            && core.sessions.last_seen(s).is_some()
        {
            core.sessions.touch(s, now, &mut core.forgotten);
            self.forget(core);
        }
        self.metrics.record_outcome(outcome);
        Ok(())
    }

    /// Asks `worker` to make room (evicting if needed) through its commit queue: an attached
    /// in-process queue, else its worker service. Sessions it evicts are observed as evicted.
    pub async fn commit_evict(
        &self,
        req: pb::CommitEvictRequest,
    ) -> Result<pb::CommitEvictReply, RequestError> {
        let entry = self.entry_or_invalid(req.worker)?;
        let worker = entry.id;
        let local = self.local_commit.read().get(&worker).cloned();
        let result = if let Some(sender) = local {
            let timeout = Duration::from_millis(self.config.rpc_timeout_ms);
            commit_local(sender, &req, timeout).await
        } else {
            match entry.commit_evict(req).await {
                Some(Ok(reply)) => Ok(reply),
                Some(Err(status)) => Err(match status.code() {
                    tonic::Code::ResourceExhausted => {
                        RequestError::ResourceExhausted(status.message().to_owned())
                    }
                    tonic::Code::DeadlineExceeded => {
                        RequestError::DeadlineExceeded(status.message().to_owned())
                    }
                    _ => RequestError::Unavailable(format!(
                        "worker {}: {}",
                        worker.0,
                        status.message()
                    )),
                }),
                None => Err(RequestError::FailedPrecondition(format!(
                    "worker {} has no service address or commit queue",
                    worker.0
                ))),
            }
        };
        match &result {
            Ok(reply) => {
                self.metrics.record_commit(if reply.admitted {
                    CommitKind::Admitted
                } else {
                    CommitKind::Rejected
                });
                if !reply.evicted_sessions.is_empty() {
                    let mut core = self.core.lock();
                    for s in &reply.evicted_sessions {
                        core.state.observe(&Observation::Evicted {
                            session: SessionId(*s),
                            worker,
                        });
                    }
                }
            }
            Err(RequestError::ResourceExhausted(_)) => self.metrics.record_commit(CommitKind::Busy),
            Err(_) => self.metrics.record_commit(CommitKind::Error),
        }
        result
    }

    /// Every worker with its state and health now.
    pub fn list_workers(&self) -> pb::ListWorkersReply {
        let now = self.now_ms();
        pb::ListWorkersReply {
            workers: self.workers.iter().map(|w| w.info_at(now)).collect(),
        }
    }

    /// The probe RPC: validates the worker and probes it.
    pub fn probe(&self, req: &pb::ProbeRequest) -> Result<pb::ProbeReply, RequestError> {
        self.probe_worker(
            WorkerId(req.worker),
            req.need_tokens,
            req.session_id.map(SessionId),
        )
        .map(|o| o.reply)
    }
}

fn probe_entry(
    entry: &WorkerEntry,
    need_tokens: u64,
    session: Option<SessionId>,
    now: u64,
) -> ProbeOutcome {
    if entry.source == StateSource::Snapshot {
        let Some(reader) = entry.reader() else {
            return ProbeOutcome {
                kind: ProbeKind::Stale,
                reply: pb::ProbeReply {
                    snapshot_age_ms: u64::MAX,
                    ..Default::default()
                },
            };
        };
        return match reader.probe(need_tokens, session, now) {
            ProbeResult::Ready(a) => ProbeOutcome {
                kind: if a.can_admit {
                    ProbeKind::Admit
                } else {
                    ProbeKind::Reject
                },
                reply: pb::ProbeReply {
                    can_admit: a.can_admit,
                    available_tokens: a.available_tokens,
                    evictable_tokens: a.evictable_tokens,
                    queue_depth: a.queue_depth,
                    snapshot_age_ms: a.snapshot_age_ms,
                    recommended_pause_ms: a.recommended_pause_ms,
                },
            },
            ProbeResult::Stale { age_ms } => ProbeOutcome {
                kind: ProbeKind::Stale,
                reply: pb::ProbeReply {
                    snapshot_age_ms: age_ms,
                    ..Default::default()
                },
            },
            ProbeResult::Contended => ProbeOutcome {
                kind: ProbeKind::Contended,
                reply: pb::ProbeReply::default(),
            },
        };
    }
    let s = entry.state_at(now);
    let available = s.available_tokens();
    let can_admit = s.health.is_routable() && need_tokens <= available;
    ProbeOutcome {
        kind: ProbeKind::State,
        reply: pb::ProbeReply {
            can_admit,
            available_tokens: available,
            evictable_tokens: s.evictable_tokens,
            queue_depth: s.queue_depth,
            snapshot_age_ms: s.state_age_ms,
            recommended_pause_ms: kvc_admission::recommended_pause_ms(
                u64::from(s.queue_depth),
                s.used_fraction(),
            ),
        },
    }
}

async fn commit_local(
    sender: CommitSender,
    req: &pb::CommitEvictRequest,
    timeout: Duration,
) -> Result<pb::CommitEvictReply, RequestError> {
    let pending = sender
        .submit(CommitRequest {
            need_tokens: req.need_tokens,
            session: req.session_id.map(SessionId),
        })
        .map_err(commit_error)?;
    let reply = tokio::task::spawn_blocking(move || pending.wait(timeout))
        .await
        .map_err(|e| RequestError::Internal(format!("commit wait task: {e}")))?
        .map_err(commit_error)?;
    Ok(pb::CommitEvictReply {
        admitted: reply.admitted,
        freed_tokens: reply.freed_tokens,
        evicted_sessions: reply.evicted.iter().map(|s| s.0).collect(),
        recommended_pause_ms: reply.recommended_pause_ms,
    })
}

fn commit_error(e: CommitError) -> RequestError {
    match e {
        CommitError::Busy { .. } => RequestError::ResourceExhausted(e.to_string()),
        CommitError::OwnerGone => RequestError::Unavailable(e.to_string()),
        CommitError::Timeout => RequestError::DeadlineExceeded(e.to_string()),
    }
}

fn to_pb(id: u64, d: &Decision, probe_rejected_by: Option<u32>) -> pb::RouteDecision {
    pb::RouteDecision {
        decision_id: id,
        mode: d.mode.to_proto(),
        prefill_worker: d.prefill.map(|w| w.0),
        decode_worker: d.decode.0,
        fall_through_reason: d.reason.map(ProtoEnum::to_proto),
        cached_tokens: d.cached_tokens,
        recommended_pause_ms: d.recommended_pause_ms,
        need_tokens: d.need_tokens,
        probe_rejected_by,
    }
}
