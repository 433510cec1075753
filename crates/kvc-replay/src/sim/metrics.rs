//! Per-request records (`metrics.jsonl`) and the run summary (`summary.json`).

use kvc_core::stats::{P50, P90, P99, percentile};
use kvc_core::{
    ExecutionMode, FailureStage, FallThroughReason, Outcome, SessionId, StableName, TurnId,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One line of `metrics.jsonl`: what happened to one trace request. Times are seconds from the
/// start of the replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Position of the request in the loaded trace.
    pub index: usize,
    /// Session.
    pub session: SessionId,
    /// Turn within the session (from 1).
    pub turn: TurnId,
    /// When the turn was ready: its scaled timestamp or the previous turn's completion,
    /// whichever is later.
    pub scheduled_s: f64,
    /// When the client sent it (after any wait for a concurrency slot).
    pub dispatch_s: f64,
    /// When the first output token reached the client (`None` if it never did).
    pub first_token_s: Option<f64>,
    /// When the request finished (or failed).
    pub done_s: f64,
    /// `first_token_s − scheduled_s`.
    pub ttft_s: Option<f64>,
    /// `done_s − scheduled_s`.
    pub latency_s: f64,
    /// `dispatch_s − scheduled_s` plus any backpressure pause before the request started.
    pub wait_s: f64,
    /// Path taken (`None` when the request never reached a worker, e.g. `input-too-long`).
    pub mode: Option<ExecutionMode>,
    /// Why a later turn did not go direct-to-D.
    pub reason: Option<FallThroughReason>,
    /// Prefill worker, on P→D paths.
    pub prefill: Option<String>,
    /// Decode (or colocated) worker.
    pub decode: Option<String>,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Prompt tokens served from a cache (D's resident KV, P's or the colocated worker's prefix cache).
    pub cached_tokens: u64,
    /// Prompt tokens computed.
    pub uncached_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// Times its decode worker retracted it for want of KV room (absent when 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub retractions: u32,
    /// Why a request that failed in the engine failed (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureRecord>,
}

/// Why one request failed: what it was waiting for when its time ran out, on which worker,
/// and that worker's pool and queue at that moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureRecord {
    /// What it was waiting for (`decode-room`, `prefill-room`, `prefill`, `transfer`,
    /// `failed-pair`, `retracted`, `retraction-limit`, `host-pool-full`).
    pub stage: FailureStage,
    /// The worker it was waiting on.
    pub worker: String,
    /// How long that wait lasted (the transfer timeout for a wait that ran out).
    pub waited_s: f64,
    /// Tokens of room it needed there (with the decode reserve; 0 when not waiting for room).
    pub need_tokens: u64,
    /// Tokens of that worker's pool nothing occupied.
    pub free_tokens: u64,
    /// Tokens that idle sessions and unpinned prefix-cache blocks held there.
    pub evictable_tokens: u64,
    /// Requests waiting in that worker's queue for room, this one included.
    pub queue_depth: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Mean and percentiles of a sample.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Dist {
    /// Mean (0 for an empty sample).
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Dist {
    /// Mean and nearest-rank percentiles of `values` (sorted here).
    pub fn of(mut values: Vec<f64>) -> Dist {
        if values.is_empty() {
            return Dist::default();
        }
        values.sort_by(f64::total_cmp);
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        Dist {
            mean: round6(mean),
            p50: round6(percentile(&values, P50).unwrap_or(0.0)),
            p90: round6(percentile(&values, P90).unwrap_or(0.0)),
            p99: round6(percentile(&values, P99).unwrap_or(0.0)),
        }
    }
}

fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// Figures of one execution mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModeSummary {
    /// Requests that took this path.
    pub requests: usize,
    /// Share of routed requests.
    pub share: f64,
    /// Median TTFT over its served requests (`ok` and `direct-cache-miss`).
    pub ttft_p50_s: f64,
    /// Median latency over its served requests.
    pub latency_p50_s: f64,
}

/// Figures of one decode (or colocated) worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerSummary {
    /// Requests it decoded.
    pub requests: usize,
}

/// Per-session figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionSummary {
    /// Sessions in the run.
    pub count: usize,
    /// Mean number of times a session's decode worker changed.
    pub d_changes_mean: f64,
    /// Most changes of one session.
    pub d_changes_max: usize,
    /// Sessions whose direct-to-D rate over turns 2+ is at most 20%.
    pub direct_rate_0_20: usize,
    /// Sessions whose direct-to-D rate over turns 2+ is at least 80%.
    pub direct_rate_80_100: usize,
}

/// The run configuration, echoed in the summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// Cluster shape.
    pub topology: String,
    /// Routing policy name.
    pub policy: String,
    /// Prefill selection policy name (P/D only).
    pub prefill_policy: Option<String>,
    /// Trace time divided by this.
    pub time_scale: f64,
    /// Most requests in flight.
    pub concurrency: usize,
    /// Seed.
    pub seed: u64,
    /// Whether the client honoured recommended pauses.
    pub backpressure: bool,
    /// Engine eviction mode.
    pub eviction: String,
    /// Engine profile name.
    pub profile: String,
    /// Whether the engines serve turns alone (local prefill; see `SimConfig::local_prefill`);
    /// absent from summaries written before it existed, whose engines did not.
    #[serde(default)]
    pub local_prefill: bool,
    /// The policy's full configuration.
    pub policy_config: serde_json::Value,
}

/// `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests in the trace (each appears once in `metrics.jsonl`).
    pub requests: usize,
    /// Count per outcome (stable names).
    pub outcomes: BTreeMap<String, usize>,
    /// Requests whose outcome is a mechanism error (neither `ok`, `input-too-long` nor
    /// `direct-cache-miss`).
    pub mechanism_errors: usize,
    /// TTFT over served requests (`ok` and `direct-cache-miss`), s.
    pub ttft_s: Dist,
    /// Latency over served requests, s.
    pub latency_s: Dist,
    /// Wait before start (slot + pause) over served requests, s.
    pub wait_s: Dist,
    /// Share of routed requests that went direct-to-D.
    pub direct_to_d_rate: f64,
    /// Per execution mode.
    pub modes: BTreeMap<String, ModeSummary>,
    /// Count per fall-through reason.
    pub reasons: BTreeMap<String, usize>,
    /// Per decode (or colocated) worker.
    pub workers: BTreeMap<String, WorkerSummary>,
    /// (max − min) / mean of requests per decode (or colocated) worker, halved.
    pub worker_spread: f64,
    /// Per session.
    pub sessions: SessionSummary,
    /// Run configuration.
    pub config: RunConfig,
    /// Simulated time from the first ready turn to the last completion, s.
    pub sim_span_s: f64,
    /// Wall time of the simulation, s (the only field that varies between identical runs; it
    /// is not written to `metrics.jsonl`).
    pub sim_wall_s: f64,
}

impl Summary {
    /// Builds the summary of a run from its records. `decode_workers` lists every decode (or
    /// colocated) worker so idle ones show up with zero requests.
    pub fn build(
        records: &[RequestRecord],
        decode_workers: &[String],
        config: RunConfig,
        sim_wall_s: f64,
    ) -> Summary {
        let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
        for o in Outcome::ALL {
            outcomes.insert(o.as_str().to_owned(), 0);
        }
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        let mut workers: BTreeMap<String, WorkerSummary> = decode_workers
            .iter()
            .map(|w| (w.clone(), WorkerSummary { requests: 0 }))
            .collect();
        let mut per_mode: BTreeMap<ExecutionMode, (usize, Vec<f64>, Vec<f64>)> = BTreeMap::new();
        let (mut ttft, mut lat, mut wait) = (vec![], vec![], vec![]);
        let mut routed = 0usize;
        let mut span_end: f64 = 0.0;
        let mut span_start = f64::INFINITY;
        for r in records {
            *outcomes.entry(r.outcome.as_str().to_owned()).or_default() += 1;
            span_start = span_start.min(r.scheduled_s);
            span_end = span_end.max(r.done_s);
            if let Some(reason) = r.reason {
                *reasons.entry(reason.as_str().to_owned()).or_default() += 1;
            }
            if let Some(d) = &r.decode {
                workers
                    .entry(d.clone())
                    .or_insert(WorkerSummary { requests: 0 })
                    .requests += 1;
            }
            if let Some(mode) = r.mode {
                routed += 1;
                let e = per_mode.entry(mode).or_default();
                e.0 += 1;
                if r.outcome.is_served() {
                    e.1.push(r.ttft_s.unwrap_or(r.latency_s));
                    e.2.push(r.latency_s);
                }
            }
            if r.outcome.is_served() {
                ttft.push(r.ttft_s.unwrap_or(r.latency_s));
                lat.push(r.latency_s);
                wait.push(r.wait_s);
            }
        }
        let mechanism_errors = records
            .iter()
            .filter(|r| r.outcome.is_mechanism_error())
            .count();
        let share = |n: usize| {
            if routed == 0 {
                0.0
            } else {
                round6(n as f64 / routed as f64)
            }
        };
        let modes: BTreeMap<String, ModeSummary> = per_mode
            .into_iter()
            .map(|(mode, (n, t, l))| {
                (
                    mode.as_str().to_owned(),
                    ModeSummary {
                        requests: n,
                        share: share(n),
                        ttft_p50_s: Dist::of(t).p50,
                        latency_p50_s: Dist::of(l).p50,
                    },
                )
            })
            .collect();
        let direct_to_d_rate = modes
            .get(ExecutionMode::DirectToD.as_str())
            .map_or(0.0, |m| m.share);
        let counts: Vec<usize> = workers.values().map(|w| w.requests).collect();
        let worker_spread = match (counts.iter().max(), counts.iter().min()) {
            (Some(&max), Some(&min)) if !counts.is_empty() => {
                let mean = counts.iter().sum::<usize>() as f64 / counts.len() as f64;
                if mean > 0.0 {
                    round6((max - min) as f64 / mean / 2.0)
                } else {
                    0.0
                }
            }
            _ => 0.0,
        };
        Summary {
            requests: records.len(),
            outcomes,
            mechanism_errors,
            ttft_s: Dist::of(ttft),
            latency_s: Dist::of(lat),
            wait_s: Dist::of(wait),
            direct_to_d_rate,
            modes,
            reasons,
            workers,
            worker_spread,
            sessions: session_summary(records),
            config,
            sim_span_s: if records.is_empty() {
                0.0
            } else {
                round6(span_end - span_start)
            },
            sim_wall_s,
        }
    }
}

fn session_summary(records: &[RequestRecord]) -> SessionSummary {
    // Records are in trace order; group by session keeping turn order.
    let mut by_session: BTreeMap<SessionId, Vec<&RequestRecord>> = BTreeMap::new();
    for r in records {
        by_session.entry(r.session).or_default().push(r);
    }
    let mut changes = Vec::with_capacity(by_session.len());
    let (mut low, mut high) = (0, 0);
    for turns in by_session.values_mut() {
        turns.sort_by_key(|r| r.turn);
        let mut last: Option<&str> = None;
        let mut n = 0usize;
        for r in turns.iter() {
            if let Some(d) = r.decode.as_deref() {
                if last.is_some_and(|l| l != d) {
                    n += 1;
                }
                last = Some(d);
            }
        }
        changes.push(n);
        let later: Vec<&&RequestRecord> = turns.iter().skip(1).collect();
        if !later.is_empty() {
            let direct = later
                .iter()
                .filter(|r| r.mode == Some(ExecutionMode::DirectToD))
                .count();
            let rate = direct as f64 / later.len() as f64;
            if rate <= 0.2 {
                low += 1;
            }
            if rate >= 0.8 {
                high += 1;
            }
        }
    }
    let count = changes.len();
    SessionSummary {
        count,
        d_changes_mean: if count == 0 {
            0.0
        } else {
            round6(changes.iter().sum::<usize>() as f64 / count as f64)
        },
        d_changes_max: changes.iter().copied().max().unwrap_or(0),
        direct_rate_0_20: low,
        direct_rate_80_100: high,
    }
}
