//! Router metrics: lock-free counters, a decision-latency histogram, and the Prometheus text
//! exposition (format 0.0.4) served on `/metrics`.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `kvc_router_decisions_total` | counter | `mode`, `reason` (`none` when direct or first turn) |
//! | `kvc_router_route_errors_total` | counter | `code` (gRPC code name, e.g. `invalid_argument`) |
//! | `kvc_router_decision_latency_seconds` | histogram | — |
//! | `kvc_router_decision_latency_quantile_seconds` | gauge | `quantile` (0.5, 0.99, 0.999) |
//! | `kvc_router_probes_total` | counter | `result` (`admit`, `reject`, `stale`, `contended`, `state`) |
//! | `kvc_router_probe_reroutes_total` | counter | — |
//! | `kvc_router_commit_evicts_total` | counter | `result` (`admitted`, `rejected`, `busy`, `error`) |
//! | `kvc_router_outcomes_total` | counter | `outcome` |
//! | `kvc_router_sessions_tracked` | gauge | — |
//! | `kvc_router_sessions_forgotten_total` | counter | `cause` (`expired`, `evicted`) |
//! | `kvc_router_pending_decisions` | gauge | — |
//! | `kvc_router_pending_dropped_total` | counter | — |
//! | `kvc_router_worker_capacity_tokens` | gauge | `worker`, `name`, `role` |
//! | `kvc_router_worker_used_tokens` | gauge | `worker`, `name`, `role` |
//! | `kvc_router_worker_used_fraction` | gauge | `worker`, `name`, `role` |
//! | `kvc_router_worker_queue_depth` | gauge | `worker`, `name`, `role` |
//! | `kvc_router_worker_in_flight` | gauge | `worker`, `name`, `role` |
//! | `kvc_router_worker_state_age_seconds` | gauge | `worker`, `name`, `role` (staleness) |
//! | `kvc_router_worker_health` | gauge | `worker`, `name`, `role`, `health` (1 for the current health) |
//! | `kvc_router_http_breaker_state` | gauge | `worker`, `state` (`closed`, `open`, `half-open`; 1 for the current state of each worker the HTTP front forwarded to or checked) |
//! | `kvc_router_http_breaker_transitions_total` | counter | `to` (the state entered) |
//! | `kvc_router_http_retries_total` | counter | — (requests forwarded again after a failure before any byte reached the client) |
//! | `kvc_router_http_health_checks_total` | counter | `result` (`ok`, `failed`) |
//! | `kvc_router_http_admission_rejects_total` | counter | — (answers `503` + `x-kvc-admission: rejected` from a decode worker) |
//! | `kvc_router_http_inferred_sessions_total` | counter | `result` (`continued`: a request without a session key continued a known session; `new`: it started an inferred session) |

pub use kvc_core::{CommitKind, ProbeKind};

use kvc_core::{BreakerState, ExecutionMode, FallThroughReason, Forgotten, Health, Outcome};
use kvc_core::{StableName, WorkerId, WorkerRole, WorkerState};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histogram buckets, in seconds (`+Inf` is implicit).
pub const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

const MODES: usize = 5;
const REASONS: usize = 1 + FallThroughReason::ALL.len(); // "none", then each reason
const OUTCOMES: usize = 6;

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

/// One worker as the metrics report it.
#[derive(Debug, Clone)]
pub struct WorkerSample {
    /// The worker.
    pub id: WorkerId,
    /// Its display name.
    pub name: String,
    /// Its role.
    pub role: WorkerRole,
    /// Its last known state (health included).
    pub state: WorkerState,
}

/// Gauges read at scrape time.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    /// Every worker.
    pub workers: Vec<WorkerSample>,
    /// Sessions in the session table.
    pub sessions_tracked: usize,
    /// Decisions awaiting an outcome report.
    pub pending_decisions: usize,
}

/// The router's counters and histograms. Recording is lock-free except for the quantile
/// histogram (one short uncontended-in-practice lock per decision).
#[derive(Debug)]
pub struct Metrics {
    decisions: [[AtomicU64; REASONS]; MODES],
    route_errors: [AtomicU64; ERROR_CODES.len()],
    latency_buckets: [AtomicU64; LATENCY_BUCKETS_SECONDS.len() + 1],
    latency_sum_ns: AtomicU64,
    latency_count: AtomicU64,
    latency_hist: Mutex<hdrhistogram::Histogram<u64>>,
    probes: [AtomicU64; 5],
    reroutes: AtomicU64,
    commits: [AtomicU64; 4],
    outcomes: [AtomicU64; OUTCOMES],
    forgotten_expired: AtomicU64,
    forgotten_evicted: AtomicU64,
    pending_dropped: AtomicU64,
    breaker_states: Mutex<BTreeMap<u32, BreakerState>>,
    breaker_transitions: [AtomicU64; 3],
    http_retries: AtomicU64,
    health_checks: [AtomicU64; 2],
    http_admission_rejects: AtomicU64,
    inferred_sessions: [AtomicU64; 2],
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn mode_index(m: ExecutionMode) -> usize {
    ExecutionMode::ALL.iter().position(|x| *x == m).unwrap_or(0)
}

fn breaker_index(s: BreakerState) -> usize {
    BreakerState::ALL.iter().position(|x| *x == s).unwrap_or(0)
}

fn reason_index(r: Option<FallThroughReason>) -> usize {
    r.map_or(0, |r| {
        1 + FallThroughReason::ALL
            .iter()
            .position(|x| *x == r)
            .unwrap_or(0)
    })
}

impl Metrics {
    /// All counters at zero.
    pub fn new() -> Self {
        // 1 ns to 60 s at 3 significant figures.
        let hist = hdrhistogram::Histogram::new_with_bounds(1, 60_000_000_000, 3)
            .expect("constant histogram bounds are valid");
        Metrics {
            decisions: Default::default(),
            route_errors: Default::default(),
            latency_buckets: Default::default(),
            latency_sum_ns: AtomicU64::new(0),
            latency_count: AtomicU64::new(0),
            latency_hist: Mutex::new(hist),
            probes: Default::default(),
            reroutes: AtomicU64::new(0),
            commits: Default::default(),
            outcomes: Default::default(),
            forgotten_expired: AtomicU64::new(0),
            forgotten_evicted: AtomicU64::new(0),
            pending_dropped: AtomicU64::new(0),
            breaker_states: Mutex::new(BTreeMap::new()),
            breaker_transitions: Default::default(),
            http_retries: AtomicU64::new(0),
            health_checks: Default::default(),
            http_admission_rejects: AtomicU64::new(0),
            inferred_sessions: Default::default(),
        }
    }

    /// Counts a decision.
    pub fn record_decision(&self, mode: ExecutionMode, reason: Option<FallThroughReason>) {
        self.decisions[mode_index(mode)][reason_index(reason)].fetch_add(1, Ordering::Relaxed);
    }

    /// Decisions counted with this mode and reason.
    pub fn decisions(&self, mode: ExecutionMode, reason: Option<FallThroughReason>) -> u64 {
        self.decisions[mode_index(mode)][reason_index(reason)].load(Ordering::Relaxed)
    }

    /// Counts a failed `Route`.
    pub fn record_route_error(&self, code: tonic::Code) {
        let label = code_label(code);
        if let Some(i) = ERROR_CODES.iter().position(|c| code_label(*c) == label) {
            self.route_errors[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records the latency of one decision.
    pub fn record_latency(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        let bucket = LATENCY_BUCKETS_SECONDS
            .iter()
            .position(|le| secs <= *le)
            .unwrap_or(LATENCY_BUCKETS_SECONDS.len());
        self.latency_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.latency_sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.latency_count.fetch_add(1, Ordering::Relaxed);
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
        self.latency_count.load(Ordering::Relaxed)
    }

    /// Counts a probe.
    pub fn record_probe(&self, kind: ProbeKind) {
        let i = ProbeKind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
        self.probes[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Probes counted with this result.
    pub fn probes(&self, kind: ProbeKind) -> u64 {
        let i = ProbeKind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
        self.probes[i].load(Ordering::Relaxed)
    }

    /// Counts a re-route after a probe reject.
    pub fn record_reroute(&self) {
        self.reroutes.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a `CommitEvict`.
    pub fn record_commit(&self, kind: CommitKind) {
        let i = CommitKind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
        self.commits[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an outcome report.
    pub fn record_outcome(&self, outcome: Outcome) {
        let i = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.outcomes[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts sessions leaving the table (`expired` by TTL or `evicted` by the bound).
    pub fn record_forgotten(&self, expired: u64, evicted: u64) {
        self.forgotten_expired.fetch_add(expired, Ordering::Relaxed);
        self.forgotten_evicted.fetch_add(evicted, Ordering::Relaxed);
    }

    /// Counts pending decisions dropped unreported.
    pub fn record_pending_dropped(&self, n: u64) {
        self.pending_dropped.fetch_add(n, Ordering::Relaxed);
    }

    /// Sets `worker`'s circuit-breaker state; a change of state is counted as a transition.
    pub fn record_breaker_state(&self, worker: WorkerId, state: BreakerState) {
        let previous = self.breaker_states.lock().insert(worker.0, state);
        if previous.is_some_and(|p| p != state)
            || (previous.is_none() && state != BreakerState::Closed)
        {
            self.breaker_transitions[breaker_index(state)].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `worker`'s circuit-breaker state as last recorded (`None` before the HTTP front
    /// forwarded to or checked it).
    pub fn breaker_state(&self, worker: WorkerId) -> Option<BreakerState> {
        self.breaker_states.lock().get(&worker.0).copied()
    }

    /// Circuit-breaker transitions into `state` so far.
    pub fn breaker_transitions(&self, state: BreakerState) -> u64 {
        self.breaker_transitions[breaker_index(state)].load(Ordering::Relaxed)
    }

    /// Counts one HTTP request forwarded again after a failure.
    pub fn record_http_retry(&self) {
        self.http_retries.fetch_add(1, Ordering::Relaxed);
    }

    /// HTTP requests forwarded again after a failure so far.
    pub fn http_retries(&self) -> u64 {
        self.http_retries.load(Ordering::Relaxed)
    }

    /// Counts one active health check of a worker's `/health`.
    pub fn record_health_check(&self, ok: bool) {
        self.health_checks[usize::from(!ok)].fetch_add(1, Ordering::Relaxed);
    }

    /// Active health checks so far that succeeded (`ok`) or failed.
    pub fn health_checks(&self, ok: bool) -> u64 {
        self.health_checks[usize::from(!ok)].load(Ordering::Relaxed)
    }

    /// Counts one refusal by a decode worker's admission over HTTP (`503` with
    /// `x-kvc-admission: rejected`).
    pub fn record_http_admission_reject(&self) {
        self.http_admission_rejects.fetch_add(1, Ordering::Relaxed);
    }

    /// Refusals by decode workers' admission over HTTP so far.
    pub fn http_admission_rejects(&self) -> u64 {
        self.http_admission_rejects.load(Ordering::Relaxed)
    }

    /// Counts one request without a session key placed in an inferred session: `continued` a
    /// known session, or started a new one.
    pub fn record_inferred_session(&self, continued: bool) {
        self.inferred_sessions[usize::from(!continued)].fetch_add(1, Ordering::Relaxed);
    }

    /// Requests without a session key that continued a known session (`continued`) or started
    /// an inferred one, so far.
    pub fn inferred_sessions(&self, continued: bool) -> u64 {
        self.inferred_sessions[usize::from(!continued)].load(Ordering::Relaxed)
    }

    /// The Prometheus text exposition (format 0.0.4) of every metric.
    pub fn render(&self, gauges: &Gauges) -> String {
        let mut out = String::with_capacity(8 * 1024);
        let o = &mut out;

        header(
            o,
            "kvc_router_decisions_total",
            "counter",
            "Routing decisions by execution mode and fall-through reason.",
        );
        for (mi, mode) in ExecutionMode::ALL.iter().enumerate() {
            for ri in 0..REASONS {
                let reason = if ri == 0 {
                    "none"
                } else {
                    FallThroughReason::ALL[ri - 1].as_str()
                };
                let v = self.decisions[mi][ri].load(Ordering::Relaxed);
                let _ = writeln!(
                    o,
                    "kvc_router_decisions_total{{mode=\"{}\",reason=\"{reason}\"}} {v}",
                    mode.as_str()
                );
            }
        }

        counter_family(
            o,
            "kvc_router_route_errors_total",
            "Route calls that failed, by gRPC status code.",
            "code",
            ERROR_CODES.iter().map(|c| code_label(*c)),
            &self.route_errors,
        );

        header(
            o,
            "kvc_router_decision_latency_seconds",
            "histogram",
            "Time to decide one Route call inside the router (validation, policy, probe, re-route).",
        );
        let mut cumulative = 0u64;
        for (i, le) in LATENCY_BUCKETS_SECONDS.iter().enumerate() {
            cumulative += self.latency_buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(
                o,
                "kvc_router_decision_latency_seconds_bucket{{le=\"{le}\"}} {cumulative}"
            );
        }
        cumulative += self.latency_buckets[LATENCY_BUCKETS_SECONDS.len()].load(Ordering::Relaxed);
        let _ = writeln!(
            o,
            "kvc_router_decision_latency_seconds_bucket{{le=\"+Inf\"}} {cumulative}"
        );
        let sum = self.latency_sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(o, "kvc_router_decision_latency_seconds_sum {sum}");
        let _ = writeln!(o, "kvc_router_decision_latency_seconds_count {cumulative}");

        header(
            o,
            "kvc_router_decision_latency_quantile_seconds",
            "gauge",
            "Decision latency quantiles since start, from the router's HDR histogram.",
        );
        for q in [0.5, 0.99, 0.999] {
            let v = self.decision_latency(q).as_secs_f64();
            let _ = writeln!(
                o,
                "kvc_router_decision_latency_quantile_seconds{{quantile=\"{q}\"}} {v}"
            );
        }

        counter_family(
            o,
            "kvc_router_probes_total",
            "Admission probes of decode-worker snapshots, by result.",
            "result",
            ProbeKind::ALL.iter().map(|k| k.as_str()),
            &self.probes,
        );
        header(
            o,
            "kvc_router_probe_reroutes_total",
            "counter",
            "Requests re-routed through a prefill worker after a probe could not admit them.",
        );
        let _ = writeln!(
            o,
            "kvc_router_probe_reroutes_total {}",
            self.reroutes.load(Ordering::Relaxed)
        );

        counter_family(
            o,
            "kvc_router_commit_evicts_total",
            "CommitEvict calls forwarded to workers, by result.",
            "result",
            CommitKind::ALL.iter().map(|k| k.as_str()),
            &self.commits,
        );

        counter_family(
            o,
            "kvc_router_outcomes_total",
            "Outcomes reported for routed requests.",
            "outcome",
            Outcome::ALL.iter().map(|x| x.as_str()),
            &self.outcomes,
        );

        header(
            o,
            "kvc_router_sessions_tracked",
            "gauge",
            "Sessions in the router's session table.",
        );
        let _ = writeln!(o, "kvc_router_sessions_tracked {}", gauges.sessions_tracked);
        header(
            o,
            "kvc_router_sessions_forgotten_total",
            "counter",
            "Sessions dropped from the table, by cause.",
        );
        let _ = writeln!(
            o,
            "kvc_router_sessions_forgotten_total{{cause=\"{}\"}} {}",
            Forgotten::Expired.as_str(),
            self.forgotten_expired.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            o,
            "kvc_router_sessions_forgotten_total{{cause=\"{}\"}} {}",
            Forgotten::Evicted.as_str(),
            self.forgotten_evicted.load(Ordering::Relaxed)
        );
        header(
            o,
            "kvc_router_pending_decisions",
            "gauge",
            "Decisions awaiting an outcome report.",
        );
        let _ = writeln!(
            o,
            "kvc_router_pending_decisions {}",
            gauges.pending_decisions
        );
        header(
            o,
            "kvc_router_pending_dropped_total",
            "counter",
            "Decisions dropped unreported (pending table full).",
        );
        let _ = writeln!(
            o,
            "kvc_router_pending_dropped_total {}",
            self.pending_dropped.load(Ordering::Relaxed)
        );

        header(
            o,
            "kvc_router_http_breaker_state",
            "gauge",
            "Circuit-breaker state of each worker the HTTP front has used (1 for the current state).",
        );
        for (worker, current) in self.breaker_states.lock().iter() {
            for &state in BreakerState::ALL {
                let v = u8::from(state == *current);
                let _ = writeln!(
                    o,
                    "kvc_router_http_breaker_state{{worker=\"{worker}\",state=\"{}\"}} {v}",
                    state.as_str()
                );
            }
        }
        header(
            o,
            "kvc_router_http_breaker_transitions_total",
            "counter",
            "Circuit-breaker transitions, by the state entered.",
        );
        for &state in BreakerState::ALL {
            let v = self.breaker_transitions[breaker_index(state)].load(Ordering::Relaxed);
            let _ = writeln!(
                o,
                "kvc_router_http_breaker_transitions_total{{to=\"{}\"}} {v}",
                state.as_str()
            );
        }
        header(
            o,
            "kvc_router_http_retries_total",
            "counter",
            "HTTP requests forwarded again after a failure before any byte reached the client.",
        );
        let _ = writeln!(
            o,
            "kvc_router_http_retries_total {}",
            self.http_retries.load(Ordering::Relaxed)
        );
        counter_family(
            o,
            "kvc_router_http_health_checks_total",
            "Active health checks of the workers' /health, by result.",
            "result",
            ["ok", "failed"].into_iter(),
            &self.health_checks,
        );
        header(
            o,
            "kvc_router_http_admission_rejects_total",
            "counter",
            "Requests a decode worker's admission refused over HTTP (503 with x-kvc-admission: rejected).",
        );
        let _ = writeln!(
            o,
            "kvc_router_http_admission_rejects_total {}",
            self.http_admission_rejects.load(Ordering::Relaxed)
        );
        counter_family(
            o,
            "kvc_router_http_inferred_sessions_total",
            "Requests without a session key placed in an inferred session, by result.",
            "result",
            ["continued", "new"].into_iter(),
            &self.inferred_sessions,
        );

        worker_gauges(o, &gauges.workers);
        out
    }
}

/// A counter with one label: the HELP/TYPE header, then one sample per label value
/// (`values[i]` is the counter of the i-th label value).
fn counter_family<'a>(
    o: &mut String,
    name: &str,
    help: &str,
    label: &str,
    label_values: impl Iterator<Item = &'a str>,
    values: &[AtomicU64],
) {
    header(o, name, "counter", help);
    for (value, counter) in label_values.zip(values) {
        let v = counter.load(Ordering::Relaxed);
        let _ = writeln!(o, "{name}{{{label}=\"{value}\"}} {v}");
    }
}

fn header(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} {kind}");
}

/// Escapes a label value for the text format (`\`, `"` and newline).
fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn worker_gauges(o: &mut String, workers: &[WorkerSample]) {
    type Getter = fn(&WorkerState) -> f64;
    let series: [(&str, &str, Getter); 6] = [
        (
            "kvc_router_worker_capacity_tokens",
            "KV pool size of each worker, in tokens.",
            |s| s.capacity_tokens as f64,
        ),
        (
            "kvc_router_worker_used_tokens",
            "KV tokens used on each worker, as last published.",
            |s| s.used_tokens as f64,
        ),
        (
            "kvc_router_worker_used_fraction",
            "Used fraction of each worker's KV pool, as last published.",
            |s| s.used_fraction(),
        ),
        (
            "kvc_router_worker_queue_depth",
            "Queue depth of each worker, as last published.",
            |s| f64::from(s.queue_depth),
        ),
        (
            "kvc_router_worker_in_flight",
            "Requests running on each worker, as last published.",
            |s| f64::from(s.in_flight),
        ),
        (
            "kvc_router_worker_state_age_seconds",
            "Age of each worker's last published state (staleness).",
            |s| {
                if s.state_age_ms == u64::MAX {
                    f64::INFINITY
                } else {
                    s.state_age_ms as f64 / 1e3
                }
            },
        ),
    ];
    for (name, help, get) in series {
        header(o, name, "gauge", help);
        for w in workers {
            let v = get(&w.state);
            let v = if v.is_infinite() {
                "+Inf".to_owned()
            } else {
                v.to_string()
            };
            let _ = writeln!(
                o,
                "{name}{{worker=\"{}\",name=\"{}\",role=\"{}\"}} {v}",
                w.id.0,
                escape(&w.name),
                w.role.as_str()
            );
        }
    }
    header(
        o,
        "kvc_router_worker_health",
        "gauge",
        "1 for each worker's current health (healthy workers are in rotation), 0 otherwise.",
    );
    for w in workers {
        for h in Health::ALL {
            let v = u8::from(w.state.health == *h);
            let _ = writeln!(
                o,
                "kvc_router_worker_health{{worker=\"{}\",name=\"{}\",role=\"{}\",health=\"{}\"}} {v}",
                w.id.0,
                escape(&w.name),
                w.role.as_str(),
                h.as_str()
            );
        }
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
        assert!(text.contains("kvc_router_decision_latency_seconds_bucket{le=\"0.000005\"} 1\n"));
        assert!(text.contains("kvc_router_decision_latency_seconds_bucket{le=\"0.00005\"} 4\n"));
        assert!(text.contains("kvc_router_decision_latency_seconds_bucket{le=\"1\"} 4\n"));
        assert!(text.contains("kvc_router_decision_latency_seconds_bucket{le=\"+Inf\"} 5\n"));
        assert!(text.contains("kvc_router_decision_latency_seconds_count 5\n"));
        assert!(m.decision_latency(0.5) <= m.decision_latency(0.99));
        assert!(m.decision_latency(0.99) >= Duration::from_secs(1));
        assert_eq!(m.decision_count(), 5);
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
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
    }
}
