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

/// Prompt tokens of the routed requests: what their prefills computed and what they found
/// cached. `computed` is what a policy makes the fleet prefill, recomputed context included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokens {
    /// Prompt tokens prefilled (each request's `uncached_tokens`), summed.
    pub computed: u64,
    /// Prompt tokens found cached (each request's `cached_tokens`), summed.
    pub cached: u64,
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

/// A worker drained during a run, and the sessions it held then.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DrainSummary {
    /// The drained worker.
    pub worker: String,
    /// When, in seconds of the run's clock.
    pub at_s: f64,
    /// Sessions it held when drained.
    pub sessions: usize,
    /// Their resident tokens then, summed.
    pub resident_tokens: u64,
    /// Of those sessions, the ones with a turn dispatched after the drain.
    pub returned: usize,
    /// Their resident tokens at the drain, summed: the context a move recomputes unless it
    /// takes the KV along.
    pub returned_tokens: u64,
    /// The execution mode of each returning session's first turn after the drain (`none`
    /// for a turn that was not routed), counted.
    pub next_turn_modes: BTreeMap<String, usize>,
    /// Prompt tokens those first turns computed and found cached, summed.
    pub next_turn_tokens: PromptTokens,
    /// Those first turns' mean TTFT, s (latency for one that failed).
    pub next_turn_ttft_mean_s: f64,
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
    /// `false` when the run ignored the trace's explicit session ends (`SimConfig::session_ends`);
    /// absent when it honoured them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_ends: Option<bool>,
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
    /// Prompt tokens of the routed requests, computed and cached (absent from summaries
    /// written before it was counted: zeros).
    #[serde(default)]
    pub prompt_tokens: PromptTokens,
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
    /// The workers drained during the run and what became of the sessions they held (absent
    /// when none was).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drains: Vec<DrainSummary>,
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
        // A session's figures follow its turns in turn order (ties in record order); the
        // other figures do not depend on the order records are added in.
        let mut by_session: BTreeMap<SessionId, Vec<&RequestRecord>> = BTreeMap::new();
        for r in records {
            by_session.entry(r.session).or_default().push(r);
        }
        let mut builder = SummaryBuilder::new(decode_workers);
        for turns in by_session.values_mut() {
            turns.sort_by_key(|r| r.turn);
            for r in turns.iter() {
                builder.add(r);
            }
        }
        builder.finish(config, sim_wall_s)
    }
}

/// The summary built as records come, holding a few bytes per request (the served requests'
/// TTFT, latency and wait, exactly, for the percentiles) and a few per session: what a run
/// that streams its records keeps instead of the records. Records must come in turn order
/// within each session (the replay writes them in trace order, where that holds); it gives
/// the same summary as [`Summary::build`] over the same records.
#[derive(Debug, Clone)]
pub struct SummaryBuilder {
    requests: usize,
    outcomes: BTreeMap<String, usize>,
    reasons: BTreeMap<String, usize>,
    workers: BTreeMap<String, WorkerSummary>,
    /// Worker name → index into `worker_names` (for the per-session tally).
    worker_index: BTreeMap<String, u32>,
    mechanism_errors: usize,
    routed: usize,
    prompt_tokens: PromptTokens,
    /// Requests per execution mode (routed ones).
    mode_requests: BTreeMap<ExecutionMode, usize>,
    /// Per served request, in the order added: its mode (`NO_MODE` if none), TTFT, latency
    /// and wait.
    served_mode: Vec<u8>,
    ttft: Column,
    latency: Column,
    wait: Column,
    span_start: f64,
    span_end: f64,
    sessions: std::collections::HashMap<SessionId, SessionTally>,
}

/// `served_mode` of a served request that took no path.
const NO_MODE: u8 = u8::MAX;

/// What a session's summary needs of the turns added so far.
#[derive(Debug, Clone, Copy)]
struct SessionTally {
    /// Decode worker of its last routed turn (`u32::MAX`: none yet).
    last_decode: u32,
    changes: u32,
    /// Turns after the first, and how many of them went direct-to-D.
    later: u32,
    direct: u32,
}

impl SummaryBuilder {
    /// A builder for a run on `decode_workers` (listed so idle ones show up with zero
    /// requests).
    pub fn new(decode_workers: &[String]) -> SummaryBuilder {
        let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
        for o in Outcome::ALL {
            outcomes.insert(o.as_str().to_owned(), 0);
        }
        SummaryBuilder {
            requests: 0,
            outcomes,
            reasons: BTreeMap::new(),
            workers: decode_workers
                .iter()
                .map(|w| (w.clone(), WorkerSummary { requests: 0 }))
                .collect(),
            worker_index: BTreeMap::new(),
            mechanism_errors: 0,
            routed: 0,
            prompt_tokens: PromptTokens::default(),
            mode_requests: BTreeMap::new(),
            served_mode: Vec::new(),
            ttft: Column::default(),
            latency: Column::default(),
            wait: Column::default(),
            span_start: f64::INFINITY,
            span_end: 0.0,
            sessions: std::collections::HashMap::new(),
        }
    }

    /// Counts one record.
    pub fn add(&mut self, r: &RequestRecord) {
        self.requests += 1;
        *self
            .outcomes
            .entry(r.outcome.as_str().to_owned())
            .or_default() += 1;
        if r.outcome.is_mechanism_error() {
            self.mechanism_errors += 1;
        }
        self.span_start = self.span_start.min(r.scheduled_s);
        self.span_end = self.span_end.max(r.done_s);
        if let Some(reason) = r.reason {
            *self.reasons.entry(reason.as_str().to_owned()).or_default() += 1;
        }
        let mut decode_index = None;
        if let Some(d) = &r.decode {
            match self.workers.get_mut(d) {
                Some(w) => w.requests += 1,
                None => {
                    self.workers
                        .insert(d.clone(), WorkerSummary { requests: 1 });
                }
            }
            let next = self.worker_index.len() as u32;
            decode_index = Some(match self.worker_index.get(d) {
                Some(&k) => k,
                None => {
                    self.worker_index.insert(d.clone(), next);
                    next
                }
            });
        }
        if let Some(mode) = r.mode {
            self.routed += 1;
            self.prompt_tokens.computed += r.uncached_tokens;
            self.prompt_tokens.cached += r.cached_tokens;
            *self.mode_requests.entry(mode).or_default() += 1;
        }
        if r.outcome.is_served() {
            let mode = r.mode.map_or(NO_MODE, mode_code);
            self.served_mode.push(mode);
            self.ttft.push(r.ttft_s.unwrap_or(r.latency_s));
            self.latency.push(r.latency_s);
            self.wait.push(r.wait_s);
        }
        let direct = r.mode == Some(ExecutionMode::DirectToD);
        match self.sessions.get_mut(&r.session) {
            None => {
                self.sessions.insert(
                    r.session,
                    SessionTally {
                        last_decode: decode_index.unwrap_or(u32::MAX),
                        changes: 0,
                        later: 0,
                        direct: 0,
                    },
                );
            }
            Some(t) => {
                if let Some(d) = decode_index {
                    if t.last_decode != u32::MAX && t.last_decode != d {
                        t.changes += 1;
                    }
                    t.last_decode = d;
                }
                t.later += 1;
                t.direct += u32::from(direct);
            }
        }
    }

    /// The summary of the records added.
    pub fn finish(self, config: RunConfig, sim_wall_s: f64) -> Summary {
        let routed = self.routed;
        let share = |n: usize| {
            if routed == 0 {
                0.0
            } else {
                round6(n as f64 / routed as f64)
            }
        };
        let modes: BTreeMap<String, ModeSummary> = self
            .mode_requests
            .iter()
            .map(|(&mode, &n)| {
                let code = mode_code(mode);
                let pick = |c: &Column| c.select(&self.served_mode, code);
                (
                    mode.as_str().to_owned(),
                    ModeSummary {
                        requests: n,
                        share: share(n),
                        ttft_p50_s: pick(&self.ttft).dist().p50,
                        latency_p50_s: pick(&self.latency).dist().p50,
                    },
                )
            })
            .collect();
        let direct_to_d_rate = modes
            .get(ExecutionMode::DirectToD.as_str())
            .map_or(0.0, |m| m.share);
        let counts: Vec<usize> = self.workers.values().map(|w| w.requests).collect();
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
        let count = self.sessions.len();
        let (mut changes_sum, mut changes_max, mut low, mut high) = (0usize, 0usize, 0, 0);
        for t in self.sessions.values() {
            changes_sum += t.changes as usize;
            changes_max = changes_max.max(t.changes as usize);
            if t.later > 0 {
                let rate = f64::from(t.direct) / f64::from(t.later);
                if rate <= 0.2 {
                    low += 1;
                }
                if rate >= 0.8 {
                    high += 1;
                }
            }
        }
        let sessions = SessionSummary {
            count,
            d_changes_mean: if count == 0 {
                0.0
            } else {
                round6(changes_sum as f64 / count as f64)
            },
            d_changes_max: changes_max,
            direct_rate_0_20: low,
            direct_rate_80_100: high,
        };
        Summary {
            requests: self.requests,
            outcomes: self.outcomes,
            mechanism_errors: self.mechanism_errors,
            ttft_s: self.ttft.dist(),
            latency_s: self.latency.dist(),
            wait_s: self.wait.dist(),
            direct_to_d_rate,
            prompt_tokens: self.prompt_tokens,
            modes,
            reasons: self.reasons,
            workers: self.workers,
            worker_spread,
            sessions,
            drains: Vec::new(),
            config,
            sim_span_s: if self.requests == 0 {
                0.0
            } else {
                round6(self.span_end - self.span_start)
            },
            sim_wall_s,
        }
    }
}

/// A compact code of an execution mode (its position in [`ExecutionMode::ALL`]).
fn mode_code(mode: ExecutionMode) -> u8 {
    ExecutionMode::ALL
        .iter()
        .position(|&m| m == mode)
        .map_or(NO_MODE, |p| p as u8)
}

/// Seconds kept exactly in little room: whole microseconds as `u32` while every value is
/// one (as the simulator's are), every value as `f64` once one is not.
#[derive(Debug, Clone)]
enum Column {
    Micros(Vec<u32>),
    Seconds(Vec<f64>),
}

impl Default for Column {
    fn default() -> Self {
        Column::Micros(Vec::new())
    }
}

/// `x` as whole microseconds, if that is exactly what it is.
fn exact_micros(x: f64) -> Option<u32> {
    let m = (x * 1e6).round();
    if !(0.0..=f64::from(u32::MAX)).contains(&m) {
        return None;
    }
    let m = m as u32;
    (micros_to_seconds(m).to_bits() == x.to_bits()).then_some(m)
}

fn micros_to_seconds(m: u32) -> f64 {
    f64::from(m) / 1e6
}

impl Column {
    fn push(&mut self, x: f64) {
        match self {
            Column::Micros(v) => match exact_micros(x) {
                Some(m) => v.push(m),
                None => {
                    let mut wide: Vec<f64> = v.iter().map(|&m| micros_to_seconds(m)).collect();
                    wide.push(x);
                    *self = Column::Seconds(wide);
                }
            },
            Column::Seconds(v) => v.push(x),
        }
    }

    /// The values whose `codes` entry is `code`.
    fn select(&self, codes: &[u8], code: u8) -> Column {
        let keep = |k: usize| codes[k] == code;
        match self {
            Column::Micros(v) => Column::Micros(
                v.iter()
                    .enumerate()
                    .filter(|&(k, _)| keep(k))
                    .map(|(_, &m)| m)
                    .collect(),
            ),
            Column::Seconds(v) => Column::Seconds(
                v.iter()
                    .enumerate()
                    .filter(|&(k, _)| keep(k))
                    .map(|(_, &x)| x)
                    .collect(),
            ),
        }
    }

    /// Mean and nearest-rank percentiles, as [`Dist::of`] gives them over the same seconds.
    fn dist(&self) -> Dist {
        match self {
            Column::Seconds(v) => Dist::of(v.clone()),
            Column::Micros(v) => {
                if v.is_empty() {
                    return Dist::default();
                }
                // Whole microseconds sort as their seconds do, and the mean sums the seconds
                // in the same (sorted) order as `Dist::of`.
                let mut sorted = v.clone();
                sorted.sort_unstable();
                let mean =
                    sorted.iter().map(|&m| micros_to_seconds(m)).sum::<f64>() / sorted.len() as f64;
                let at = |p| micros_to_seconds(percentile(&sorted, p).unwrap_or(0));
                Dist {
                    mean: round6(mean),
                    p50: round6(at(P50)),
                    p90: round6(at(P90)),
                    p99: round6(at(P99)),
                }
            }
        }
    }
}
