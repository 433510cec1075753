//! Summary statistics of a trace (`kvc-replay stats`).
//!
//! Percentiles are nearest-rank ([`kvc_core::stats`]): `pXX` is the smallest value with at
//! least XX% of the values at or below it. The JSON form ([`TraceStats`] serialized) has stable keys:
//!
//! | key | meaning |
//! |---|---|
//! | `requests` | requests in the trace |
//! | `sessions` | sessions |
//! | `sessions_multi_turn` | sessions of two or more requests |
//! | `turns_per_session` | `mean`, `p50`, `min`, `max` requests per session |
//! | `input_tokens` | `mean`, `p50`, `p90`, `p99`, `max` of `input_length` |
//! | `output_tokens` | `mean`, `p50`, `p90`, `p99`, `max` of `output_length` |
//! | `session_peak_input` | `mean`, `p50`, `max` over sessions of their largest input |
//! | `append` | shares of turns 2+ whose uncached append is `up_to_2048`, `2049_to_8192`, `over_8192` tokens; `turns` counted, `p50`/`p90` of the append |
//! | `gap_s` | `p10`, `p50`, `p90`, `p99`, `max`, `mean` of the gap in seconds between consecutive turns of a session; `count` of gaps |
//! | `span_s` | seconds from the first to the last timestamp |
//! | `limit` | the input limit used (tokens) |
//! | `over_limit` | requests whose input exceeds `limit` |
//! | `over_limit_sessions` | ids of the sessions holding those requests, ascending |
//! | `subagents` | subagent sessions: `explicit` (with `parent_session_id`) and `explicit_parents`; `inferred` (without it, found by the rule in [`super::agents`]) and `inferred_parents`; `common_blocks`, the block ids in the first prompts of more than half of the sessions; `share` of sessions that are subagents |
//! | `compactions` | later turns whose prompt was rewritten: `count` (diverging turns keeping at most a quarter of the previous prompt's full blocks) and its `share` of later turns; `diverging` (turns whose `hash_ids` differ from the previous turn's before its last full block) and `diverging_share`; `turns` counted |
//! | `ends` | sessions whose last request carries `final: true`: `count`, `share` of sessions; `final_not_last`, requests with `final` that are not their session's last |
//! | `block_size` | tokens per block id |
//!
//! The *uncached append* of a turn is the part of its input past the leading full blocks it
//! shares with the previous turn of its session (`kvc_core::prefix::reusable_from`).

use super::Trace;
use super::agents::{self, CompactionStats, EndStats, SubagentStats};
use kvc_core::SessionId;
use kvc_core::prefix::reusable_from;
use kvc_core::stats::{P50, P90, P99, percentile};
use serde::Serialize;
use std::fmt;

/// Statistics of a trace; serializes with the stable keys listed in the module docs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceStats {
    /// Requests.
    pub requests: usize,
    /// Sessions.
    pub sessions: usize,
    /// Sessions of two or more requests.
    pub sessions_multi_turn: usize,
    /// Requests per session.
    pub turns_per_session: TurnStats,
    /// Input lengths (tokens).
    pub input_tokens: TokenStats,
    /// Output lengths (tokens).
    pub output_tokens: TokenStats,
    /// Per-session largest input (tokens).
    pub session_peak_input: PeakStats,
    /// Uncached appends of turns 2+.
    pub append: AppendStats,
    /// Gaps between consecutive turns of a session (seconds).
    pub gap_s: GapStats,
    /// Seconds from the first to the last timestamp.
    pub span_s: f64,
    /// Input limit (tokens) used for `over_limit`.
    pub limit: u64,
    /// Requests with an input above `limit`.
    pub over_limit: usize,
    /// Sessions holding an over-limit request, ascending.
    pub over_limit_sessions: Vec<SessionId>,
    /// Subagent sessions, explicit and inferred.
    pub subagents: SubagentStats,
    /// Later turns that rewrite the prompt.
    pub compactions: CompactionStats,
    /// Sessions ended explicitly (`final`).
    pub ends: EndStats,
    /// Tokens per block id.
    pub block_size: u32,
}

/// Requests per session.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TurnStats {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: u64,
    /// Fewest.
    pub min: u64,
    /// Most.
    pub max: u64,
}

/// A token-count distribution.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TokenStats {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: u64,
    /// 90th percentile.
    pub p90: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Largest.
    pub max: u64,
}

/// Per-session peak input.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PeakStats {
    /// Mean over sessions.
    pub mean: f64,
    /// Median over sessions.
    pub p50: u64,
    /// Largest.
    pub max: u64,
}

/// Uncached-append distribution over turns 2+ of every session.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AppendStats {
    /// Share of appends ≤ 2,048 tokens.
    pub up_to_2048: f64,
    /// Share of appends of 2,049–8,192 tokens.
    #[serde(rename = "2049_to_8192")]
    pub from_2049_to_8192: f64,
    /// Share of appends above 8,192 tokens.
    pub over_8192: f64,
    /// Turns counted (turns 2+).
    pub turns: usize,
    /// Median append (tokens).
    pub p50: u64,
    /// 90th-percentile append (tokens).
    pub p90: u64,
}

/// Gaps between consecutive turns of a session, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GapStats {
    /// 10th percentile.
    pub p10: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
    /// Mean.
    pub mean: f64,
    /// Gaps counted.
    pub count: usize,
}

fn mean(values: &[u64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64
}

fn tokens(mut values: Vec<u64>) -> TokenStats {
    values.sort_unstable();
    TokenStats {
        mean: mean(&values),
        p50: percentile(&values, P50).unwrap_or(0),
        p90: percentile(&values, P90).unwrap_or(0),
        p99: percentile(&values, P99).unwrap_or(0),
        max: values.last().copied().unwrap_or(0),
    }
}

fn share(count: usize, total: usize) -> f64 {
    if total == 0 {
        0.0
    } else {
        count as f64 / total as f64
    }
}

fn secs(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

/// Computes the statistics; `limit` is the input limit for `over_limit` (the reference
/// deployment's is [`kvc_core::DEFAULT_MAX_INPUT_TOKENS`]).
pub fn compute(trace: &Trace, limit: u64) -> TraceStats {
    let reqs = &trace.requests;
    let bs = trace.block_size();
    let sessions = trace.session_list();

    let mut turn_counts: Vec<u64> = sessions.iter().map(|s| s.requests.len() as u64).collect();
    turn_counts.sort_unstable();
    let mut peaks: Vec<u64> = sessions
        .iter()
        .map(|s| {
            s.requests
                .iter()
                .map(|&i| reqs[i].input_length)
                .max()
                .unwrap_or(0)
        })
        .collect();
    peaks.sort_unstable();

    let mut appends: Vec<u64> = Vec::new();
    let mut gaps_ms: Vec<u64> = Vec::new();
    for s in sessions {
        for pair in s.requests.windows(2) {
            let (prev, cur) = (&reqs[pair[0]], &reqs[pair[1]]);
            let reused = reusable_from(&prev.hash_ids, &cur.hash_ids, cur.input_length, bs);
            appends.push(cur.input_length - reused.min(cur.input_length));
            gaps_ms.push(cur.timestamp_ms.abs_diff(prev.timestamp_ms));
        }
    }
    let small = appends.iter().filter(|&&a| a <= 2048).count();
    let large = appends.iter().filter(|&&a| a > 8192).count();
    appends.sort_unstable();
    gaps_ms.sort_unstable();

    let mut over_limit_sessions: Vec<SessionId> = reqs
        .iter()
        .filter(|r| r.input_length > limit)
        .map(|r| r.session)
        .collect();
    let over_limit = over_limit_sessions.len();
    over_limit_sessions.sort_unstable();
    over_limit_sessions.dedup();

    let span_ms = match (reqs.first(), reqs.last()) {
        (Some(a), Some(b)) => b.timestamp_ms.saturating_sub(a.timestamp_ms),
        _ => 0,
    };

    TraceStats {
        requests: reqs.len(),
        sessions: sessions.len(),
        sessions_multi_turn: sessions.iter().filter(|s| s.requests.len() >= 2).count(),
        turns_per_session: TurnStats {
            mean: mean(&turn_counts),
            p50: percentile(&turn_counts, P50).unwrap_or(0),
            min: turn_counts.first().copied().unwrap_or(0),
            max: turn_counts.last().copied().unwrap_or(0),
        },
        input_tokens: tokens(reqs.iter().map(|r| r.input_length).collect()),
        output_tokens: tokens(reqs.iter().map(|r| r.output_length).collect()),
        session_peak_input: PeakStats {
            mean: mean(&peaks),
            p50: percentile(&peaks, P50).unwrap_or(0),
            max: peaks.last().copied().unwrap_or(0),
        },
        append: AppendStats {
            up_to_2048: share(small, appends.len()),
            from_2049_to_8192: share(appends.len() - small - large, appends.len()),
            over_8192: share(large, appends.len()),
            turns: appends.len(),
            p50: percentile(&appends, P50).unwrap_or(0),
            p90: percentile(&appends, P90).unwrap_or(0),
        },
        gap_s: GapStats {
            p10: secs(percentile(&gaps_ms, 100).unwrap_or(0)),
            p50: secs(percentile(&gaps_ms, P50).unwrap_or(0)),
            p90: secs(percentile(&gaps_ms, P90).unwrap_or(0)),
            p99: secs(percentile(&gaps_ms, P99).unwrap_or(0)),
            max: secs(gaps_ms.last().copied().unwrap_or(0)),
            mean: mean(&gaps_ms) / 1000.0,
            count: gaps_ms.len(),
        },
        span_s: secs(span_ms),
        limit,
        over_limit,
        over_limit_sessions,
        subagents: agents::subagents(trace),
        compactions: agents::compactions(trace),
        ends: agents::ends(trace),
        block_size: bs.tokens(),
    }
}

/// A readable table.
impl fmt::Display for TraceStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        let t = &self.turns_per_session;
        let i = &self.input_tokens;
        let o = &self.output_tokens;
        let p = &self.session_peak_input;
        let a = &self.append;
        let g = &self.gap_s;
        writeln!(f, "{:<22} {}", "requests", self.requests)?;
        writeln!(
            f,
            "{:<22} {} ({} with 2+ requests)",
            "sessions", self.sessions, self.sessions_multi_turn
        )?;
        writeln!(
            f,
            "{:<22} mean {:.1}  p50 {}  min {}  max {}",
            "turns per session", t.mean, t.p50, t.min, t.max
        )?;
        writeln!(
            f,
            "{:<22} mean {:.0}  p50 {}  p90 {}  p99 {}  max {}",
            "input tokens", i.mean, i.p50, i.p90, i.p99, i.max
        )?;
        writeln!(
            f,
            "{:<22} mean {:.0}  p50 {}  p90 {}  p99 {}  max {}",
            "output tokens", o.mean, o.p50, o.p90, o.p99, o.max
        )?;
        writeln!(
            f,
            "{:<22} mean {:.0}  p50 {}  max {}",
            "session peak input", p.mean, p.p50, p.max
        )?;
        writeln!(
            f,
            "{:<22} <=2048 {}  2049-8192 {}  >8192 {}  (p50 {}, p90 {}, {} turns)",
            "uncached append",
            pct(a.up_to_2048),
            pct(a.from_2049_to_8192),
            pct(a.over_8192),
            a.p50,
            a.p90,
            a.turns
        )?;
        writeln!(
            f,
            "{:<22} p10 {:.2}  p50 {:.2}  p90 {:.2}  p99 {:.2}  max {:.1}  mean {:.2}",
            "gap between turns (s)", g.p10, g.p50, g.p90, g.p99, g.max, g.mean
        )?;
        writeln!(f, "{:<22} {:.1}", "span (s)", self.span_s)?;
        let sessions: Vec<String> = self
            .over_limit_sessions
            .iter()
            .map(|s| s.0.to_string())
            .collect();
        writeln!(
            f,
            "{:<22} {} (sessions: {})",
            format!("over {} tokens", self.limit),
            self.over_limit,
            if sessions.is_empty() {
                "none".to_owned()
            } else {
                sessions.join(", ")
            }
        )?;
        let sa = &self.subagents;
        writeln!(
            f,
            "{:<22} {} explicit ({} parents)  {} inferred ({} parents)  {} of sessions  ({} common blocks)",
            "subagent sessions",
            sa.explicit,
            sa.explicit_parents,
            sa.inferred,
            sa.inferred_parents,
            pct(sa.share),
            sa.common_blocks
        )?;
        let c = &self.compactions;
        writeln!(
            f,
            "{:<22} {} ({} of {} later turns; {} diverge, {})",
            "compactions",
            c.count,
            pct(c.share),
            c.turns,
            c.diverging,
            pct(c.diverging_share)
        )?;
        let e = &self.ends;
        writeln!(
            f,
            "{:<22} {} sessions ({}; {} final requests not last)",
            "explicit ends",
            e.count,
            pct(e.share),
            e.final_not_last
        )
    }
}
