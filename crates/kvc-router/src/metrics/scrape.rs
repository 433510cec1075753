//! Gauges read at scrape time: the workers' last known states, the session and pending tables,
//! the decision-latency quantiles and the circuit breakers. Each scrape registers them afresh
//! in a registry of their own from the values of that moment, so a scrape never shows a value
//! left over from an earlier one.

use super::Metrics;
use kvc_core::{BreakerState, Health, StableName, WorkerId, WorkerRole, WorkerState};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// One worker as the metrics report it.
#[derive(Debug, Clone)]
pub struct WorkerSample {
    /// The worker (its `worker` label).
    pub id: WorkerId,
    /// Its display name from the configuration (its `name` label).
    pub name: String,
    /// Its role (its `role` label).
    pub role: WorkerRole,
    /// Its last known state (health included), as the router judges it at scrape time.
    pub state: WorkerState,
    /// Its KV-event streams' counters over every data-parallel rank, when they run.
    pub events: Option<kvc_events::StatsSnapshot>,
    /// Each rank's stream counters, lowest rank first (empty before they run).
    pub ranks: Vec<(u32, kvc_events::StatsSnapshot)>,
    /// Whether its engine's answers report the prompt tokens served from its cache
    /// (`None` until an answer has said either way).
    pub cache_accounting: Option<bool>,
    /// Where its engine's KV-cache events are read, once known, and where that came from
    /// (`config` or `engine`).
    pub kv_events: Option<(String, &'static str)>,
    /// How many things reading its engine found wrong (problems and warnings; see
    /// `ListWorkers` for the text).
    pub discovery_warnings: usize,
    /// Drained by the operator.
    pub drained: bool,
    /// How much longer its first tokens take than the policy's estimates give
    /// (`kvc_policy::RouterState::prefill_pace`; 1 until measured).
    pub prefill_pace: f64,
}

/// The live state a scrape reports, read by the service just before rendering.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    /// Every configured worker, in id order.
    pub workers: Vec<WorkerSample>,
    /// Sessions in the session table.
    pub sessions_tracked: usize,
    /// Decisions awaiting an outcome report.
    pub pending_decisions: usize,
    /// The policy state's block view and what its bounds removed so far.
    pub blocks: BlockSizes,
    /// What the `kv-events-listen` socket could not hand to a worker, when it is bound.
    pub listener: Option<kvc_events::ListenerStats>,
    /// The inference pool's reader, when an `[inference-pool]` table is configured.
    pub pool: Option<PoolStats>,
}

/// What the inference pool's reader found at its last read, and its reads since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pods the pool selects, at the last read that answered.
    pub pods: usize,
    /// Of those, the ready ones.
    pub ready: usize,
    /// Of those, the ones whose role label names no role (left out).
    pub unknown_role: usize,
    /// Workers the pool's pods are now.
    pub workers: usize,
    /// Reads of the pool and its pods since start.
    pub reads: u64,
    /// Of those, the ones that failed (the fleet left as it was).
    pub read_failures: u64,
    /// Whether the last read failed.
    pub failing: bool,
}

/// The policy state's block view and its drop counters, for the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockSizes {
    /// Distinct blocks in the block view.
    pub known: usize,
    /// (worker, block) memberships removed by the per-worker block bound.
    pub dropped: u64,
    /// Blocks of requests past `limits.max-session-blocks`, not kept in their session.
    pub session_dropped: u64,
}

/// The quantiles of `kvc_router_decision_latency_quantile_seconds`, with their label values.
const QUANTILES: [(f64, &str); 3] = [(0.5, "0.5"), (0.99, "0.99"), (0.999, "0.999")];

/// A gauge holding a float (seconds, fractions).
type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct QuantileLabel {
    quantile: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BreakerLabels {
    worker: u32,
    state: &'static str,
}

/// The labels of every per-worker gauge.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WorkerLabels {
    worker: u32,
    name: String,
    role: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WorkerHealthLabels {
    worker: u32,
    name: String,
    role: &'static str,
    health: &'static str,
}

fn count(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// A registry holding the scrape-time gauges of `metrics` and `gauges` as they are now.
pub(super) fn registry(metrics: &Metrics, gauges: &Gauges) -> Registry {
    let mut r = Registry::default();

    let quantiles = Family::<QuantileLabel, FloatGauge>::default();
    for (q, label) in QUANTILES {
        quantiles
            .get_or_create(&QuantileLabel { quantile: label })
            .set(metrics.decision_latency(q).as_secs_f64());
    }
    r.register(
        "kvc_router_decision_latency_quantile_seconds",
        "Decision latency quantiles since start, from the router's HDR histogram",
        quantiles,
    );

    let sizes = [
        (
            "kvc_router_sessions_tracked",
            "Sessions in the router's session table",
            gauges.sessions_tracked,
        ),
        (
            "kvc_router_pending_decisions",
            "Decisions awaiting an outcome report",
            gauges.pending_decisions,
        ),
        (
            "kvc_router_policy_blocks",
            "Distinct blocks in the policy's block view",
            gauges.blocks.known,
        ),
    ];
    for (name, help, n) in sizes {
        let gauge = Gauge::<i64>::default();
        gauge.set(count(n));
        r.register(name, help, gauge);
    }
    let drops = [
        (
            "kvc_router_policy_blocks_dropped",
            "Worker-block memberships the per-worker block bound removed from the policy's block view",
            gauges.blocks.dropped,
        ),
        (
            "kvc_router_session_blocks_dropped",
            "Blocks of requests past limits.max-session-blocks, not kept in their session's list",
            gauges.blocks.session_dropped,
        ),
    ];
    for (name, help, n) in drops {
        let counter = prometheus_client::metrics::counter::Counter::<u64>::default();
        counter.inc_by(n);
        r.register(name, help, counter);
    }

    let breakers = Family::<BreakerLabels, Gauge>::default();
    for (worker, current) in metrics.breaker_states() {
        for state in BreakerState::ALL {
            breakers
                .get_or_create(&BreakerLabels {
                    worker,
                    state: state.as_str(),
                })
                .set(i64::from(*state == current));
        }
    }
    r.register(
        "kvc_router_http_breaker_state",
        "Circuit-breaker state of each worker the HTTP front has used (1 for the current state)",
        breakers,
    );

    worker_gauges(&mut r, &gauges.workers);
    event_gauges(&mut r, &gauges.workers);
    rank_gauges(&mut r, &gauges.workers);
    if let Some(l) = &gauges.listener {
        listener_gauges(&mut r, l);
    }
    if let Some(p) = &gauges.pool {
        pool_gauges(&mut r, p);
    }
    let accounting = Family::<WorkerLabels, Gauge>::default();
    for w in &gauges.workers {
        if let Some(reported) = w.cache_accounting {
            accounting
                .get_or_create(&labels(w))
                .set(i64::from(reported));
        }
    }
    r.register(
        "kvc_router_worker_cache_accounting",
        "Whether each engine's answers report their cached prompt tokens (1), or not (0: vLLM \
         started without --enable-prompt-tokens-details; no direct-cache-miss judgement there)",
        accounting,
    );
    r
}

/// The labels of a worker's KV-event counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    worker: u32,
    name: String,
    kind: &'static str,
}

/// The labels of one data-parallel rank's KV-event counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RankLabels {
    worker: u32,
    name: String,
    rank: u32,
    kind: &'static str,
}

/// The labels of the listen socket's counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// Each data-parallel rank's stream: blocks indexed under it, its own last sequence number,
/// whether it caught up, its gaps and resets.
fn rank_gauges(r: &mut Registry, workers: &[WorkerSample]) {
    let family = Family::<RankLabels, Gauge>::default();
    for w in workers {
        for (rank, e) in &w.ranks {
            for (kind, v) in [
                ("indexed-blocks", e.indexed_blocks),
                ("last-seq", e.last_seq.unwrap_or(0)),
                ("synced", u64::from(e.synced)),
                ("gaps", e.gaps),
                ("resets", e.resets),
                ("other-rank", e.other_rank),
            ] {
                family
                    .get_or_create(&RankLabels {
                        worker: w.id.0,
                        name: w.name.clone(),
                        rank: *rank,
                        kind,
                    })
                    .set(count(v));
            }
        }
    }
    r.register(
        "kvc_router_worker_kv_events_rank",
        "KV-cache event stream of each data-parallel rank of each engine-backed worker (one rank for an engine without data parallelism): blocks indexed under the rank, its last sequence number applied, whether it caught up, and since start its gaps, index resets and batches naming another rank, by kind",
        family,
    );
}

/// The `kv-events-listen` socket: messages received, and those not handed to a worker, by
/// why.
fn listener_gauges(r: &mut Registry, l: &kvc_events::ListenerStats) {
    let family = Family::<KindLabel, Gauge>::default();
    for (kind, v) in [
        ("received", l.received),
        ("unknown-topic", l.unknown_topic),
        ("not-started", l.not_started),
        ("overflow", l.overflow),
        ("malformed", l.malformed),
    ] {
        family.get_or_create(&KindLabel { kind }).set(count(v));
    }
    r.register(
        "kvc_router_kv_events_listen",
        "Messages the kv-events-listen socket received from engines that connect to the router, and those it could not hand to a worker: a topic naming no listening worker (never indexed), a worker whose stream had not started, a full stream queue, malformed frames; by kind",
        family,
    );
}

/// The inference pool's reader: its pods at the last read, and its reads since start.
fn pool_gauges(r: &mut Registry, p: &PoolStats) {
    let family = Family::<KindLabel, Gauge>::default();
    for (kind, v) in [
        ("pods", p.pods as u64),
        ("ready", p.ready as u64),
        ("unknown-role", p.unknown_role as u64),
        ("workers", p.workers as u64),
        ("reads", p.reads),
        ("read-failures", p.read_failures),
        ("failing", u64::from(p.failing)),
    ] {
        family.get_or_create(&KindLabel { kind }).set(count(v));
    }
    r.register(
        "kvc_router_inference_pool",
        "The inference pool's pods at the last read that answered (selected, ready, left out for their role label) and the workers they are, and its reads of the Kubernetes API since start (failed ones, and whether the last one failed), by kind",
        family,
    );
}

/// The labels of a worker's event source.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    worker: u32,
    name: String,
    endpoint: String,
    from: &'static str,
}

/// The KV-event subscribers' counters, one family with a `kind` label per counter.
fn event_gauges(r: &mut Registry, workers: &[WorkerSample]) {
    let family = Family::<EventLabels, Gauge>::default();
    for w in workers {
        let Some(e) = &w.events else {
            continue;
        };
        let kinds = [
            ("indexed-blocks", e.indexed_blocks),
            ("last-seq", e.last_seq.unwrap_or(0)),
            ("batches", e.batches),
            ("gaps", e.gaps),
            ("replays", e.replays),
            ("replay-failures", e.replay_failures),
            ("resets", e.resets),
            ("malformed", e.malformed + e.undecodable),
            ("unknown-blocks", e.unknown),
            ("dropped-blocks", e.dropped),
            ("connect-failures", e.connect_failures),
            ("synced", u64::from(e.synced)),
        ];
        for (kind, v) in kinds {
            family
                .get_or_create(&EventLabels {
                    worker: w.id.0,
                    name: w.name.clone(),
                    kind,
                })
                .set(count(v));
        }
    }
    let drained = Family::<WorkerLabels, Gauge>::default();
    for w in workers {
        drained.get_or_create(&labels(w)).set(i64::from(w.drained));
    }
    r.register(
        "kvc_router_worker_drained",
        "Whether each worker is drained by the operator (1: no new work; its running requests finish)",
        drained,
    );
    let sources = Family::<SourceLabels, Gauge>::default();
    let warnings = Family::<WorkerLabels, Gauge>::default();
    for w in workers {
        if let Some((endpoint, from)) = &w.kv_events {
            sources
                .get_or_create(&SourceLabels {
                    worker: w.id.0,
                    name: w.name.clone(),
                    endpoint: endpoint.clone(),
                    from,
                })
                .set(1);
        }
        if w.discovery_warnings > 0 || w.kv_events.as_ref().is_some_and(|(_, f)| *f == "engine") {
            warnings
                .get_or_create(&labels(w))
                .set(i64::try_from(w.discovery_warnings).unwrap_or(i64::MAX));
        }
    }
    r.register(
        "kvc_router_worker_kv_events_source",
        "Where each worker's KV-cache events are read (1 per worker, labelled with the endpoint and `from`: `config`, or `engine` for one read from vLLM's GET /kv_event_sources)",
        sources,
    );
    r.register(
        "kvc_router_worker_discovery_warnings",
        "What reading each engine's event sources found wrong (its last problem and warnings; ListWorkers has the text), for workers that read it",
        warnings,
    );
    r.register(
        "kvc_router_worker_kv_events",
        "KV-cache event subscriber of each engine-backed worker: blocks indexed, last sequence number applied, and counts since start (batches, gaps, replays, replay failures, index resets, malformed messages, events naming unknown blocks, blocks dropped to the pool bound, failed connections), by kind",
        family,
    );
}

/// A count read from a worker's published state.
type Count = fn(&WorkerState) -> i64;

/// The labels of `w`'s gauges.
fn labels(w: &WorkerSample) -> WorkerLabels {
    WorkerLabels {
        worker: w.id.0,
        name: w.name.clone(),
        role: w.role.as_str(),
    }
}

/// Registers a gauge family per `(name, help, count)`: one gauge per worker, its count.
fn count_families(r: &mut Registry, workers: &[WorkerSample], families: &[(&str, &str, Count)]) {
    for &(name, help, get) in families {
        let family = Family::<WorkerLabels, Gauge>::default();
        for w in workers {
            family.get_or_create(&labels(w)).set(get(&w.state));
        }
        r.register(name, help, family);
    }
}

fn worker_gauges(r: &mut Registry, workers: &[WorkerSample]) {
    let counts: [(&str, &str, Count); 2] = [
        (
            "kvc_router_worker_capacity_tokens",
            "KV pool size of each worker, in tokens",
            |s| count(s.capacity_tokens),
        ),
        (
            "kvc_router_worker_used_tokens",
            "KV tokens used on each worker, as last published",
            |s| count(s.used_tokens),
        ),
    ];
    count_families(r, workers, &counts);
    let used_fraction = Family::<WorkerLabels, FloatGauge>::default();
    for w in workers {
        used_fraction
            .get_or_create(&labels(w))
            .set(w.state.used_fraction());
    }
    r.register(
        "kvc_router_worker_used_fraction",
        "Used fraction of each worker's KV pool, as last published",
        used_fraction,
    );
    let loads: [(&str, &str, Count); 2] = [
        (
            "kvc_router_worker_queue_depth",
            "Queue depth of each worker, as last published",
            |s| i64::from(s.queue_depth),
        ),
        (
            "kvc_router_worker_in_flight",
            "Requests running on each worker, as last published",
            |s| i64::from(s.in_flight),
        ),
    ];
    count_families(r, workers, &loads);
    let age = Family::<WorkerLabels, FloatGauge>::default();
    for w in workers {
        let seconds = if w.state.state_age_ms == u64::MAX {
            f64::INFINITY
        } else {
            w.state.state_age_ms as f64 / 1e3
        };
        age.get_or_create(&labels(w)).set(seconds);
    }
    let pace = Family::<WorkerLabels, FloatGauge>::default();
    for w in workers {
        pace.get_or_create(&labels(w)).set(w.prefill_pace);
    }
    r.register(
        "kvc_router_worker_prefill_pace",
        "Each worker's measured time to first token over the policy's estimate for it (1 until three are measured)",
        pace,
    );
    r.register(
        "kvc_router_worker_state_age_seconds",
        "Age of each worker's last published state (staleness)",
        age,
    );
    let health = Family::<WorkerHealthLabels, Gauge>::default();
    for w in workers {
        for h in Health::ALL {
            health
                .get_or_create(&WorkerHealthLabels {
                    worker: w.id.0,
                    name: w.name.clone(),
                    role: w.role.as_str(),
                    health: h.as_str(),
                })
                .set(i64::from(w.state.health == *h));
        }
    }
    r.register(
        "kvc_router_worker_health",
        "1 for each worker's current health (healthy workers are in rotation), 0 otherwise",
        health,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(id: u32, name: &str, state: WorkerState) -> WorkerSample {
        WorkerSample {
            cache_accounting: None,
            kv_events: None,
            discovery_warnings: 0,
            drained: false,
            prefill_pace: 1.0 + f64::from(id),
            id: WorkerId(id),
            name: name.to_owned(),
            role: WorkerRole::Decode,
            state,
            events: None,
            ranks: Vec::new(),
        }
    }

    #[test]
    fn worker_gauges_keep_integers_and_report_unknown_age_as_infinite() {
        let mut fresh = WorkerState::empty(92_000);
        fresh.used_tokens = 46_000;
        fresh.state_age_ms = 250;
        let mut lost = WorkerState::empty(92_000);
        lost.state_age_ms = u64::MAX;
        lost.health = Health::Down;
        let gauges = Gauges {
            workers: vec![sample(1, "d1", fresh), sample(2, "d2", lost)],
            sessions_tracked: 3,
            pending_decisions: 0,
            blocks: BlockSizes {
                known: 12,
                dropped: 5,
                session_dropped: 7,
            },
            listener: None,
            pool: None,
        };
        let text = Metrics::new().render(&gauges);
        let d1 = "{worker=\"1\",name=\"d1\",role=\"decode\"}";
        let d2 = "{worker=\"2\",name=\"d2\",role=\"decode\"}";
        for line in [
            format!("kvc_router_worker_capacity_tokens{d1} 92000\n"),
            format!("kvc_router_worker_used_tokens{d1} 46000\n"),
            format!("kvc_router_worker_used_fraction{d1} 0.5\n"),
            format!("kvc_router_worker_state_age_seconds{d1} 0.25\n"),
            format!("kvc_router_worker_state_age_seconds{d2} +Inf\n"),
            format!("kvc_router_worker_prefill_pace{d2} 3.0\n"),
            "kvc_router_worker_health{worker=\"2\",name=\"d2\",role=\"decode\",health=\"down\"} 1\n"
                .to_owned(),
            "kvc_router_worker_health{worker=\"2\",name=\"d2\",role=\"decode\",health=\"healthy\"} 0\n"
                .to_owned(),
            "kvc_router_sessions_tracked 3\n".to_owned(),
            "kvc_router_pending_decisions 0\n".to_owned(),
            "kvc_router_policy_blocks 12\n".to_owned(),
            "kvc_router_policy_blocks_dropped_total 5\n".to_owned(),
            "kvc_router_session_blocks_dropped_total 7\n".to_owned(),
        ] {
            assert!(text.contains(&line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let gauges = Gauges {
            workers: vec![sample(0, "a\"b\\c\nd", WorkerState::empty(1))],
            ..Gauges::default()
        };
        let text = Metrics::new().render(&gauges);
        assert!(
            text.contains("name=\"a\\\"b\\\\c\\nd\""),
            "unescaped worker name in\n{text}"
        );
    }
}
