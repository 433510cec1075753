//! The router's metrics: counters and the decision-latency histogram, kept in a
//! `prometheus-client` [`Registry`] and recorded lock-free, plus the Prometheus text exposition
//! (format 0.0.4, [`CONTENT_TYPE`]) served on `/metrics`. The gauges read from live state at
//! scrape time ([`Gauges`]) are registered afresh for each scrape (`metrics/scrape.rs`).
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `kvc_router_decisions_total` | counter | `mode`, `reason` (`none` when direct or first turn) |
//! | `kvc_router_route_errors_total` | counter | `code` (gRPC code name, e.g. `invalid_argument`) |
//! | `kvc_router_decision_latency_seconds` | histogram | — |
//! | `kvc_router_decision_latency_quantile_seconds` | gauge | `quantile` (0.5, 0.99, 0.999) |
//! | `kvc_router_probes_total` | counter | `result` (`admit`, `reject`, `stale`, `contended`, `state`) |
//! | `kvc_router_probe_reroutes_total` | counter | — |
//! | `kvc_router_event_evictions_total` | counter | — (plans that counted on a session's KV on its worker — direct-to-D, or a turn served alone there, local or colocated — dropped because the worker's KV-cache events showed none of the session's blocks: blocks they had shown and then removed, or none at all once the events have caught up with the session's last request or answer, or `engine-signals.events-lag-ms` after it) |
//! | `kvc_router_event_adoptions_total` | counter | — (sessions this router had no placement for, adopted where the engines' KV-cache events show them: another replica placed them) |
//! | `kvc_router_stale_routed_total` | counter | — (decisions made on workers whose state had grown stale, because no worker of a needed role had a fresh one) |
//! | `kvc_router_commit_evicts_total` | counter | `result` (`admitted`, `rejected`, `busy`, `error`) |
//! | `kvc_router_outcomes_total` | counter | `outcome` |
//! | `kvc_router_sessions_tracked` | gauge | — |
//! | `kvc_router_sessions_forgotten_total` | counter | `cause` (`expired`, `evicted`, `ended`: the client ended it) |
//! | `kvc_router_pending_decisions` | gauge | — |
//! | `kvc_router_pending_dropped_total` | counter | — |
//! | `kvc_router_policy_blocks` | gauge | — (distinct blocks in the policy's block view) |
//! | `kvc_router_policy_blocks_dropped_total` | counter | — (worker-block memberships the per-worker block bound removed) |
//! | `kvc_router_session_blocks_dropped_total` | counter | — (blocks past `limits.max-session-blocks`, not kept) |
//! | `kvc_router_worker_capacity_tokens` | gauge | `worker`, `name`, `role` |
//! | `kvc_router_worker_used_tokens` | gauge | `worker`, `name`, `role` |
//! | `kvc_router_worker_used_fraction` | gauge | `worker`, `name`, `role` |
//! | `kvc_router_worker_queue_depth` | gauge | `worker`, `name`, `role` |
//! | `kvc_router_worker_in_flight` | gauge | `worker`, `name`, `role` |
//! | `kvc_router_worker_state_age_seconds` | gauge | `worker`, `name`, `role` (staleness) |
//! | `kvc_router_worker_prefill_pace` | gauge | `worker`, `name`, `role` (measured time to first token over the policy's estimate) |
//! | `kvc_router_worker_health` | gauge | `worker`, `name`, `role`, `health` (1 for the current health) |
//! | `kvc_router_worker_kv_events` | gauge | `worker`, `name`, `kind` (`indexed-blocks`, `last-seq`, and since start `batches`, `gaps`, `replays`, `replay-failures`, `resets`, `malformed`, `unknown-blocks`, `dropped-blocks`, `connect-failures`; `synced` 1 once the first replay after start has ended), for workers with `kv-events` |
//! | `kvc_router_worker_kv_events_rank` | gauge | `worker`, `name`, `rank`, `kind` (`indexed-blocks`, `last-seq`, `synced`, and since start `gaps`, `resets`, `other-rank`): each data-parallel rank's own stream |
//! | `kvc_router_kv_events_listen` | gauge | `kind` (`received`, `unknown-topic`, `not-started`, `overflow`, `malformed`): the `kv-events-listen` socket, when configured |
//! | `kvc_router_inference_pool` | gauge | `kind` (`pods`, `ready`, `unknown-role` at the last read that answered; `workers` the pods are now; since start `reads`, `read-failures`; `failing` 1 while the last read failed), with an `[inference-pool]` table |
//! | `kvc_router_worker_drained` | gauge | `worker`, `name`, `role`: 1 while the operator has the worker drained (`DrainWorker`, or `drained` in its entry re-read on SIGHUP) |
//! | `kvc_router_worker_kv_events_source` | gauge | `worker`, `name`, `endpoint`, `from` (`config`, or `engine`: read from vLLM's `GET /kv_event_sources`); 1 per worker whose event source is known |
//! | `kvc_router_worker_discovery_warnings` | gauge | `worker`, `name`: what reading the engine found wrong (discovery's last problem and warnings, prefix caching off; the text in `ListWorkers`), for workers with any, or whose event source was read from the engine |
//! | `kvc_router_worker_cache_accounting` | gauge | `worker`, `name`, `role` (1: the engine's answers report their cached prompt tokens; 0: they do not, e.g. vLLM without `--enable-prompt-tokens-details`; absent until a vLLM worker's answer said) |
//! | `kvc_router_http_breaker_state` | gauge | `worker`, `state` (`closed`, `open`, `half-open`; 1 for the current state of each worker the HTTP front forwarded to or checked) |
//! | `kvc_router_http_breaker_transitions_total` | counter | `to` (the state entered) |
//! | `kvc_router_http_retries_total` | counter | — (requests forwarded again after a failure before any byte reached the client) |
//! | `kvc_router_http_health_checks_total` | counter | `result` (`ok`, `failed`) |
//! | `kvc_router_http_admission_rejects_total` | counter | — (answers `503` + `x-kvc-admission: rejected` from a decode worker) |
//! | `kvc_router_http_sessions_started_total` | counter | — (requests that started a session: a key the front had no record of, or a new inferred session) |
//! | `kvc_router_http_rotated_session_ids_total` | counter | — (requests whose session key was new, yet whose prompt extends a session another key had used for one turn only: an id the client changes every request, not trusted; the request continues that session) |
//! | `kvc_router_http_subagent_sessions_total` | counter | `parent` (`header`: a parent-session or parent-agent header named it, or an agent header within a client session; `inferred`: a new key whose prompt goes on past a live session's latest) — first turns of sessions with a known parent |
//! | `kvc_router_http_inferred_sessions_total` | counter | `result` (`continued`: a request without a session key continued a known session; `new`: it started an inferred session) |
//! | `kvc_router_http_session_keys_total` | counter | `source` (the header the client's session key came from — each of `http.session-headers` — or `session_params`, the body's) |
//!
//! Every label value of a counter exists from the start (at zero). Counters are registered
//! without their `_total` suffix, which the encoder appends; help texts without their final
//! full stop, which the registry appends.

mod scrape;

pub use kvc_core::{CommitKind, ProbeKind};
pub use scrape::{BlockSizes, Gauges, PoolStats, WorkerSample};

use kvc_core::{
    BreakerState, ExecutionMode, FallThroughReason, Forgotten, Outcome, StableName, WorkerId,
};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::time::Duration;

/// The `Content-Type` of the exposition [`Metrics::render`] writes (Prometheus text format
/// 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Upper bounds of the latency histogram buckets, in seconds (`+Inf` is implicit).
pub const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

const MODES: usize = ExecutionMode::ALL.len();
const REASONS: usize = 1 + FallThroughReason::ALL.len(); // "none", then each reason
/// The label of a decision without a fall-through reason (direct, or a session's first turn).
const NO_REASON: &str = "none";

/// The gRPC codes `Route` fails with, in label order; any other code counts as `internal`.
const ERROR_CODES: [tonic::Code; 7] = [
    tonic::Code::InvalidArgument,
    tonic::Code::NotFound,
    tonic::Code::FailedPrecondition,
    tonic::Code::Unavailable,
    tonic::Code::DeadlineExceeded,
    tonic::Code::ResourceExhausted,
    tonic::Code::Internal,
];

fn code_label(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::InvalidArgument => "invalid_argument",
        tonic::Code::NotFound => "not_found",
        tonic::Code::FailedPrecondition => "failed_precondition",
        tonic::Code::Unavailable => "unavailable",
        tonic::Code::DeadlineExceeded => "deadline_exceeded",
        tonic::Code::ResourceExhausted => "resource_exhausted",
        _ => "internal",
    }
}

/// The labels of `kvc_router_decisions_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DecisionLabels {
    mode: &'static str,
    reason: &'static str,
}

// The families with one label: `code`, `result`, `outcome`, `cause` or `to`.

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CodeLabel {
    code: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CauseLabel {
    cause: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ParentLabel {
    parent: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ToLabel {
    to: &'static str,
}

/// Registers a counter family whose label sets are all known up front, creates every series
/// (so each is exposed at zero before its first count) and returns their handles in the
/// order of `labels`: counting through a handle takes no lock.
fn counter_family<S, const N: usize>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    labels: [S; N],
) -> [Counter; N]
where
    S: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::<S, Counter>::default();
    let handles = labels.map(|l| family.get_or_create_owned(&l));
    registry.register(name, help, family);
    handles
}

/// Registers a counter without labels and returns its handle.
fn counter(registry: &mut Registry, name: &str, help: &str) -> Counter {
    let c = Counter::default();
    registry.register(name, help, c.clone());
    c
}

/// Where a value sits in a stable-name enum's `ALL` (the index of its counter handle).
fn position<T: StableName + PartialEq>(value: T) -> usize {
    T::ALL.iter().position(|v| *v == value).unwrap_or(0)
}

fn reason_index(r: Option<FallThroughReason>) -> usize {
    r.map_or(0, |r| 1 + position(r))
}

/// The router's counters and histograms. Recording is lock-free (each counter is an atomic
/// shared with the registry) except for the latency histograms and the breaker table (one
/// short, uncontended-in-practice lock each).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    decisions: [[Counter; REASONS]; MODES],
    route_errors: [Counter; ERROR_CODES.len()],
    latency: Histogram,
    /// The same latencies at 3 significant figures, for the quantile gauges and
    /// [`Metrics::decision_latency`].
    latency_hist: Mutex<hdrhistogram::Histogram<u64>>,
    probes: [Counter; ProbeKind::ALL.len()],
    reroutes: Counter,
    event_evictions: Counter,
    event_adoptions: Counter,
    stale_routed: Counter,
    commits: [Counter; CommitKind::ALL.len()],
    outcomes: [Counter; Outcome::ALL.len()],
    forgotten: [Counter; Forgotten::ALL.len()],
    pending_dropped: Counter,
    /// Each worker's breaker state as last recorded, by worker id (exposed at scrape time).
    breaker_states: Mutex<BTreeMap<u32, BreakerState>>,
    breaker_transitions: [Counter; BreakerState::ALL.len()],
    http_retries: Counter,
    /// `ok`, then `failed`.
    health_checks: [Counter; 2],
    http_admission_rejects: Counter,
    /// `continued`, then `new`.
    inferred_sessions: [Counter; 2],
    rotated_session_ids: Counter,
    sessions_started: Counter,
    /// `header`, then `inferred`.
    subagent_sessions: [Counter; 2],
    /// Requests with a client session key, by where it came from.
    session_keys: Family<SourceLabel, Counter>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SourceLabel {
    source: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// All counters at zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let r = &mut registry;
        let decision_labels: [[DecisionLabels; REASONS]; MODES] = std::array::from_fn(|mi| {
            std::array::from_fn(|ri| DecisionLabels {
                mode: ExecutionMode::ALL[mi].as_str(),
                reason: if ri == 0 {
                    NO_REASON
                } else {
                    FallThroughReason::ALL[ri - 1].as_str()
                },
            })
        });
        let family = Family::<DecisionLabels, Counter>::default();
        let decisions = decision_labels.map(|row| row.map(|l| family.get_or_create_owned(&l)));
        r.register(
            "kvc_router_decisions",
            "Routing decisions by execution mode and fall-through reason",
            family,
        );
        let route_errors = counter_family(
            r,
            "kvc_router_route_errors",
            "Route calls that failed, by gRPC status code",
            ERROR_CODES.map(|c| CodeLabel {
                code: code_label(c),
            }),
        );
        let latency = Histogram::new(LATENCY_BUCKETS_SECONDS.iter().copied());
        r.register(
            "kvc_router_decision_latency_seconds",
            "Time to decide one Route call inside the router (validation, policy, probe, re-route)",
            latency.clone(),
        );
        let probes = counter_family(
            r,
            "kvc_router_probes",
            "Admission probes of decode-worker snapshots, by result",
            std::array::from_fn(|i| ResultLabel {
                result: ProbeKind::ALL[i].as_str(),
            }),
        );
        let reroutes = counter(
            r,
            "kvc_router_probe_reroutes",
            "Requests re-routed through a prefill worker after a probe could not admit them",
        );
        let event_evictions = counter(
            r,
            "kvc_router_event_evictions",
            "Plans that counted on a session's KV on its worker (direct-to-D, or served alone there) dropped because the worker's KV-cache events showed none of the session's blocks",
        );
        let event_adoptions = counter(
            r,
            "kvc_router_event_adoptions",
            "Sessions this router had no placement for, adopted where the engines' KV-cache events show them (placed by another replica)",
        );
        let stale_routed = counter(
            r,
            "kvc_router_stale_routed",
            "Decisions made on workers whose state had grown stale, because no worker of a needed role had a fresh one",
        );
        let commits = counter_family(
            r,
            "kvc_router_commit_evicts",
            "CommitEvict calls forwarded to workers, by result",
            std::array::from_fn(|i| ResultLabel {
                result: CommitKind::ALL[i].as_str(),
            }),
        );
        let outcomes = counter_family(
            r,
            "kvc_router_outcomes",
            "Outcomes reported for routed requests",
            std::array::from_fn(|i| OutcomeLabel {
                outcome: Outcome::ALL[i].as_str(),
            }),
        );
        let forgotten = counter_family(
            r,
            "kvc_router_sessions_forgotten",
            "Sessions dropped from the table, by cause",
            std::array::from_fn(|i| CauseLabel {
                cause: Forgotten::ALL[i].as_str(),
            }),
        );
        let pending_dropped = counter(
            r,
            "kvc_router_pending_dropped",
            "Decisions dropped unreported (pending table full)",
        );
        let breaker_transitions = counter_family(
            r,
            "kvc_router_http_breaker_transitions",
            "Circuit-breaker transitions, by the state entered",
            std::array::from_fn(|i| ToLabel {
                to: BreakerState::ALL[i].as_str(),
            }),
        );
        let http_retries = counter(
            r,
            "kvc_router_http_retries",
            "HTTP requests forwarded again after a failure before any byte reached the client",
        );
        let health_checks = counter_family(
            r,
            "kvc_router_http_health_checks",
            "Active health checks of the workers' /health, by result",
            [
                ResultLabel { result: "ok" },
                ResultLabel { result: "failed" },
            ],
        );
        let http_admission_rejects = counter(
            r,
            "kvc_router_http_admission_rejects",
            "Requests a decode worker's admission refused over HTTP (503 with x-kvc-admission: rejected)",
        );
        let inferred_sessions = counter_family(
            r,
            "kvc_router_http_inferred_sessions",
            "Requests without a session key placed in an inferred session, by result",
            [
                ResultLabel {
                    result: "continued",
                },
                ResultLabel { result: "new" },
            ],
        );
        let sessions_started = counter(
            r,
            "kvc_router_http_sessions_started",
            "Requests that started a session (a key the front had no record of, or a new inferred session)",
        );
        let rotated_session_ids = counter(
            r,
            "kvc_router_http_rotated_session_ids",
            "Requests whose new session key continued the prompt of a one-turn session under another key (an id changed every request: not trusted)",
        );
        let subagent_sessions = counter_family(
            r,
            "kvc_router_http_subagent_sessions",
            "First turns of sessions spawned by another (subagents), by how the parent was known",
            [
                ParentLabel { parent: "header" },
                ParentLabel { parent: "inferred" },
            ],
        );
        let session_keys = Family::<SourceLabel, Counter>::default();
        r.register(
            "kvc_router_http_session_keys",
            "Requests whose session key the client gave, by the header (or body field) it came from",
            session_keys.clone(),
        );
        // 1 ns to 60 s at 3 significant figures.
        let hist = hdrhistogram::Histogram::new_with_bounds(1, 60_000_000_000, 3)
            .expect("constant histogram bounds are valid");
        Metrics {
            registry,
            decisions,
            route_errors,
            latency,
            latency_hist: Mutex::new(hist),
            probes,
            reroutes,
            event_evictions,
            event_adoptions,
            stale_routed,
            commits,
            outcomes,
            forgotten,
            pending_dropped,
            breaker_states: Mutex::new(BTreeMap::new()),
            breaker_transitions,
            http_retries,
            health_checks,
            http_admission_rejects,
            inferred_sessions,
            rotated_session_ids,
            sessions_started,
            subagent_sessions,
            session_keys,
        }
    }

    /// Counts a decision.
    pub fn record_decision(&self, mode: ExecutionMode, reason: Option<FallThroughReason>) {
        self.decisions[position(mode)][reason_index(reason)].inc();
    }

    /// Decisions counted with this mode and reason.
    pub fn decisions(&self, mode: ExecutionMode, reason: Option<FallThroughReason>) -> u64 {
        self.decisions[position(mode)][reason_index(reason)].get()
    }

    /// Counts a failed `Route`.
    pub fn record_route_error(&self, code: tonic::Code) {
        let label = code_label(code);
        if let Some(i) = ERROR_CODES.iter().position(|c| code_label(*c) == label) {
            self.route_errors[i].inc();
        }
    }

    /// Records the latency of one decision.
    pub fn record_latency(&self, elapsed: Duration) {
        self.latency.observe(elapsed.as_secs_f64());
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.latency_hist.lock().saturating_record(ns.max(1));
    }

    /// The decision latency at quantile `q` in `[0, 1]` (zero before any decision).
    pub fn decision_latency(&self, q: f64) -> Duration {
        let h = self.latency_hist.lock();
        if h.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_nanos(h.value_at_quantile(q.clamp(0.0, 1.0)))
    }

    /// Decisions whose latency was recorded.
    pub fn decision_count(&self) -> u64 {
        self.latency_hist.lock().len()
    }

    /// Counts a probe.
    pub fn record_probe(&self, kind: ProbeKind) {
        self.probes[position(kind)].inc();
    }

    /// Probes counted with this result.
    pub fn probes(&self, kind: ProbeKind) -> u64 {
        self.probes[position(kind)].get()
    }

    /// Counts a re-route after a probe reject.
    pub fn record_reroute(&self) {
        self.reroutes.inc();
    }

    /// Counts a direct-to-D plan dropped because the engine's events showed the session gone.
    pub fn record_event_eviction(&self) {
        self.event_evictions.inc();
    }

    /// Counts a session adopted from the engines' events (placed by another replica).
    pub fn record_event_adoption(&self) {
        self.event_adoptions.inc();
    }

    /// Counts a decision made on stale workers (none of a needed role was fresh).
    pub fn record_stale_routed(&self) {
        self.stale_routed.inc();
    }

    /// Decisions made on stale workers so far.
    pub fn stale_routed(&self) -> u64 {
        self.stale_routed.get()
    }

    /// Counts a `CommitEvict`.
    pub fn record_commit(&self, kind: CommitKind) {
        self.commits[position(kind)].inc();
    }

    /// Counts an outcome report.
    pub fn record_outcome(&self, outcome: Outcome) {
        self.outcomes[position(outcome)].inc();
    }

    /// Counts sessions leaving the table (`expired` by TTL or `evicted` by the bound).
    pub fn record_forgotten(&self, expired: u64, evicted: u64) {
        self.forgotten[position(Forgotten::Expired)].inc_by(expired);
        self.forgotten[position(Forgotten::Evicted)].inc_by(evicted);
    }

    /// Counts a session its client ended.
    pub fn record_session_ended(&self) {
        self.forgotten[position(Forgotten::Ended)].inc();
    }

    /// Counts pending decisions dropped unreported.
    pub fn record_pending_dropped(&self, n: u64) {
        self.pending_dropped.inc_by(n);
    }

    /// Sets `worker`'s circuit-breaker state; a change of state is counted as a transition (so
    /// is a first state other than `closed`).
    pub fn record_breaker_state(&self, worker: WorkerId, state: BreakerState) {
        let previous = self.breaker_states.lock().insert(worker.0, state);
        if previous.is_some_and(|p| p != state)
            || (previous.is_none() && state != BreakerState::Closed)
        {
            self.breaker_transitions[position(state)].inc();
        }
    }

    /// `worker`'s circuit-breaker state as last recorded (`None` before the HTTP front
    /// forwarded to or checked it).
    pub fn breaker_state(&self, worker: WorkerId) -> Option<BreakerState> {
        self.breaker_states.lock().get(&worker.0).copied()
    }

    /// Circuit-breaker transitions into `state` so far.
    pub fn breaker_transitions(&self, state: BreakerState) -> u64 {
        self.breaker_transitions[position(state)].get()
    }

    /// Counts one HTTP request forwarded again after a failure.
    pub fn record_http_retry(&self) {
        self.http_retries.inc();
    }

    /// HTTP requests forwarded again after a failure so far.
    pub fn http_retries(&self) -> u64 {
        self.http_retries.get()
    }

    /// Counts one active health check of a worker's `/health`.
    pub fn record_health_check(&self, ok: bool) {
        self.health_checks[usize::from(!ok)].inc();
    }

    /// Active health checks so far that succeeded (`ok`) or failed.
    pub fn health_checks(&self, ok: bool) -> u64 {
        self.health_checks[usize::from(!ok)].get()
    }

    /// Counts one refusal by a decode worker's admission over HTTP (`503` with
    /// `x-kvc-admission: rejected`).
    pub fn record_http_admission_reject(&self) {
        self.http_admission_rejects.inc();
    }

    /// Refusals by decode workers' admission over HTTP so far.
    pub fn http_admission_rejects(&self) -> u64 {
        self.http_admission_rejects.get()
    }

    /// Counts one request without a session key placed in an inferred session: `continued` a
    /// known session, or started a new one.
    pub fn record_inferred_session(&self, continued: bool) {
        self.inferred_sessions[usize::from(!continued)].inc();
    }

    /// Counts a request whose new session key continued a one-turn session of another key.
    pub fn record_rotated_session_id(&self) {
        self.rotated_session_ids.inc();
    }

    /// Counts the first turn of a subagent's session, its parent named by a header or
    /// inferred from the prompt.
    pub fn record_subagent_session(&self, inferred: bool) {
        self.subagent_sessions[usize::from(inferred)].inc();
    }

    /// First turns of subagent sessions so far, their parent named by a header (`false`) or
    /// inferred.
    pub fn subagent_sessions(&self, inferred: bool) -> u64 {
        self.subagent_sessions[usize::from(inferred)].get()
    }

    /// Counts a request that started a session at the HTTP front.
    pub fn record_session_started(&self) {
        self.sessions_started.inc();
    }

    /// Requests whose session key was found to rotate, so far.
    pub fn rotated_session_ids(&self) -> u64 {
        self.rotated_session_ids.get()
    }

    /// Requests without a session key that continued a known session (`continued`) or started
    /// an inferred one, so far.
    pub fn inferred_sessions(&self, continued: bool) -> u64 {
        self.inferred_sessions[usize::from(!continued)].get()
    }

    /// The counter of requests whose session key came from `source` (a header name, or
    /// `session_params`), exported (at zero) from this call on; a caller counting often keeps
    /// the handle.
    pub fn session_key_counter(&self, source: &str) -> Counter {
        self.session_keys
            .get_or_create(&SourceLabel {
                source: source.to_owned(),
            })
            .clone()
    }

    /// Requests whose session key came from `source`, so far.
    pub fn session_keys(&self, source: &str) -> u64 {
        self.session_keys
            .get_or_create(&SourceLabel {
                source: source.to_owned(),
            })
            .get()
    }

    /// Every circuit breaker's state as last recorded, by worker id.
    pub(crate) fn breaker_states(&self) -> BTreeMap<u32, BreakerState> {
        self.breaker_states.lock().clone()
    }

    /// The Prometheus text exposition (format 0.0.4, [`CONTENT_TYPE`]) of every metric: the
    /// counters and the histogram, then the gauges read from `gauges` and from the latency and
    /// breaker tables now.
    pub fn render(&self, gauges: &Gauges) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let scraped = scrape::registry(self, gauges);
        for registry in [&self.registry, &scraped] {
            prometheus_client::encoding::prometheus_text::encode(&mut out, registry)
                .expect("encoding into a String does not fail");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_are_cumulative_and_quantiles_ordered() {
        let m = Metrics::new();
        for us in [3u64, 7, 20, 40, 2_000_000] {
            m.record_latency(Duration::from_micros(us));
        }
        let text = m.render(&Gauges::default());
        // Bounds below 1e-4 are written as Go's `strconv.FormatFloat` does (`5e-06`).
        assert!(text.contains("kvc_router_decision_latency_seconds_bucket{le=\"5e-06\"} 1\n"));
        assert!(text.contains("kvc_router_decision_latency_seconds_bucket{le=\"5e-05\"} 4\n"));
        assert!(text.contains("kvc_router_decision_latency_seconds_bucket{le=\"0.001\"} 4\n"));
        assert!(text.contains("kvc_router_decision_latency_seconds_bucket{le=\"1\"} 4\n"));
        assert!(text.contains("kvc_router_decision_latency_seconds_bucket{le=\"+Inf\"} 5\n"));
        assert!(text.contains("kvc_router_decision_latency_seconds_count 5\n"));
        assert!(m.decision_latency(0.5) <= m.decision_latency(0.99));
        assert!(m.decision_latency(0.99) >= Duration::from_secs(1));
        assert_eq!(m.decision_count(), 5);
    }

    #[test]
    fn decisions_count_by_mode_and_reason() {
        let m = Metrics::new();
        m.record_decision(
            ExecutionMode::Fallback,
            Some(FallThroughReason::SessionCapRejected),
        );
        m.record_decision(ExecutionMode::DirectToD, None);
        m.record_decision(ExecutionMode::DirectToD, None);
        assert_eq!(m.decisions(ExecutionMode::DirectToD, None), 2);
        let text = m.render(&Gauges::default());
        assert!(text.contains(
            "kvc_router_decisions_total{mode=\"fallback\",reason=\"session-cap-rejected\"} 1\n"
        ));
        assert!(
            text.contains("kvc_router_decisions_total{mode=\"direct-to-d\",reason=\"none\"} 2\n")
        );
        // Every combination is exposed from the start.
        let series = text
            .lines()
            .filter(|l| l.starts_with("kvc_router_decisions_total{"))
            .count();
        assert_eq!(series, MODES * REASONS);
    }

    #[test]
    fn counters_keep_their_names_help_and_type() {
        let m = Metrics::new();
        m.record_reroute();
        m.record_forgotten(2, 1);
        let text = m.render(&Gauges::default());
        assert!(text.contains(
            "# HELP kvc_router_probe_reroutes_total Requests re-routed through a prefill worker \
             after a probe could not admit them.\n\
             # TYPE kvc_router_probe_reroutes_total counter\n\
             kvc_router_probe_reroutes_total 1\n"
        ));
        assert!(text.contains("kvc_router_sessions_forgotten_total{cause=\"expired\"} 2\n"));
        assert!(text.contains("kvc_router_sessions_forgotten_total{cause=\"evicted\"} 1\n"));
        assert!(!text.contains("_total_total"));
        assert!(!text.contains(".."), "help texts end with one full stop");
        assert!(!text.contains("# EOF"));
    }

    #[test]
    fn breaker_transitions_count_changes_only() {
        let m = Metrics::new();
        m.record_breaker_state(WorkerId(0), BreakerState::Closed);
        m.record_breaker_state(WorkerId(1), BreakerState::Open);
        m.record_breaker_state(WorkerId(1), BreakerState::Open);
        m.record_breaker_state(WorkerId(1), BreakerState::HalfOpen);
        assert_eq!(m.breaker_transitions(BreakerState::Closed), 0);
        assert_eq!(m.breaker_transitions(BreakerState::Open), 1);
        assert_eq!(m.breaker_transitions(BreakerState::HalfOpen), 1);
        let text = m.render(&Gauges::default());
        assert!(text.contains("kvc_router_http_breaker_transitions_total{to=\"half-open\"} 1\n"));
        assert!(
            text.contains("kvc_router_http_breaker_state{worker=\"1\",state=\"half-open\"} 1\n")
        );
        assert!(text.contains("kvc_router_http_breaker_state{worker=\"1\",state=\"open\"} 0\n"));
        assert!(text.contains("kvc_router_http_breaker_state{worker=\"0\",state=\"closed\"} 1\n"));
    }
}
