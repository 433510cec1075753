//! Trace generators. [`swe`] builds a trace with the statistics of SWE-agent sessions.
//!
//! # The SWE-agent model
//!
//! A session is an agent solving one task. Its prompt is a list of segments:
//! the system prompt (shared by every session), the task statement, then for every turn the
//! model's previous output and the tool's observation. Turn `t + 1`'s prompt is turn `t`'s
//! plus `output_t` and `observation_t`, so the context grows turn by turn.
//!
//! Observations are *short* (kept verbatim; a session-wide growth factor scales them, and early
//! exploration turns produce larger ones) or *long* (file views, test logs). A long observation
//! stays verbatim while it is among the last `W` tokens of the prompt (`W` drawn per session,
//! 1,600–7,000 tokens) and is then collapsed to a one-line placeholder. Collapsing changes the
//! prompt at the observation's position, so the first block that differs from the previous
//! turn moves back and the uncached append of that turn is a few thousand tokens: large
//! appends come from elision, not from huge observations. A session whose prompt would pass
//! the compaction threshold (`max_input_tokens − 4,096`) collapses its oldest segments.
//!
//! The longest sessions (`round(2 · sessions / 52)` of them, two for 52 sessions) run until
//! their prompt exceeds `max_input_tokens`; the harness then retries the same prompt once or
//! twice and the session ends, so each has 2–3 requests over the limit. Their growth factor is
//! found by bisection so that this happens on their planned last turns.
//!
//! Turns per session come from stratified draws (so 52 sessions have a mean close to the
//! target), then are adjusted by ±1 to reach the requested total. Sessions start staggered
//! (stratified) over `start_span_s`; gaps between turns and output lengths are drawn from
//! quantile tables.
//!
//! # Coding-agent traffic (optional, off by default)
//!
//! - **Subagents** ([`SweConfig::subagents`]): `round(share × sessions)` parents. After one of
//!   its turns such a parent starts 1–3 child sessions, 0.3–2.5 s apart from the turn, and
//!   its next turn comes 0.5–3 s after the last child request (or after its own gap, if
//!   later). A child's prompt opens with the shared system prompt (so its first blocks are its
//!   parent's), then a task of its own (1,200–4,500 tokens). It runs 2–6 turns that grow as a
//!   session's do, with short pauses, and its records carry `parent_session_id`. Children are
//!   numbered from `sessions` upward, by parent and then by start.
//! - **Compactions** ([`SweConfig::compactions`]): `round(share × long)` of the long sessions
//!   (prompt past [`COMPACTION_THRESHOLD`] tokens; never one that must pass the input limit).
//!   Whenever such a session's next prompt would pass the threshold, it is rewritten: the
//!   system prompt, a new summary (2,000–8,000 tokens), then the newest output and
//!   observation.
//! - **Explicit ends** ([`SweConfig::ends`]): the last request of `round(share × sessions)`
//!   sessions (and of each child with probability `share`) carries `final`.
//!
//! Each feature draws from a ChaCha stream of its own (near `u64::MAX`, apart from the plan's
//! and the sessions'). With all three at 0 no draw is made, and the trace is exactly the one
//! without them. One feature never changes another's choices: `ends` alone changes only the
//! `final` flags, and `compactions` alone changes only the compacting sessions. Children's
//! records come in timestamp order with everyone else's: a child is generated with its
//! parent, before the parent's first record is given.
//!
//! Block ids are *chained*: a block's id is interned from the id of the block before it and
//! the exact segment pieces it covers, so identical prefixes share ids and the first differing
//! block and everything after it get fresh ids. Ids are finally renumbered `0, 1, …` in order of
//! first appearance in the output.
//!
//! # Determinism
//!
//! Randomness comes from `ChaCha8Rng` (the plan from stream 0 of `seed`, session `s` from stream
//! `s + 1`), turned into numbers with integer operations and IEEE-exact float arithmetic only
//! (`+ − × ÷`; no `exp`, `ln` or other platform-dependent functions), and every distribution is
//! a piecewise-linear quantile table. No hash-map iteration reaches the output. The same config
//! gives byte-identical output on every platform.
//!
//! ```
//! use kvc_replay::trace::generate::{swe, SweConfig};
//!
//! let cfg = SweConfig { seed: 7, sessions: 3, ..SweConfig::default() };
//! let records = swe(&cfg);
//! assert_eq!(records, swe(&cfg));
//! assert_eq!(records.len(), 257); // round(4,449 · 3 / 52)
//! assert!(records.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
//! assert!(records.iter().all(|r| r.hash_len_matches(cfg.block_size)));
//! ```

use kvc_core::{BlockHash, BlockSize, DEFAULT_MAX_INPUT_TOKENS, SessionId, TraceRecord, TurnId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// Requests of the reference trace (52 sessions).
pub const REFERENCE_REQUESTS: usize = 4_449;
/// Sessions of the reference trace.
pub const REFERENCE_SESSIONS: usize = 52;

/// Configuration of [`swe`].
#[derive(Debug, Clone, PartialEq)]
pub struct SweConfig {
    /// Seed: the same config gives the same trace.
    pub seed: u64,
    /// Sessions (52 in the reference trace).
    pub sessions: usize,
    /// Total requests; `None` for `round(4,449 · sessions / 52)`.
    pub requests: Option<usize>,
    /// Tokens per block id.
    pub block_size: BlockSize,
    /// Model input limit; the longest sessions end just past it.
    pub max_input_tokens: u64,
    /// Tokens of the system prompt shared by every session.
    pub system_prompt_tokens: u64,
    /// Seconds over which session starts are spread; `None` for `5,600 · sessions / 52`
    /// (the reference rate of new sessions).
    pub start_span_s: Option<f64>,
    /// Share (0–1) of sessions that spawn subagent sessions (see the module docs); 0 for none.
    pub subagents: f64,
    /// Share (0–1) of the long sessions (those whose prompt passes 40,000 tokens, other than
    /// the ones ending past the input limit) that compact their prompt; 0 for none.
    pub compactions: f64,
    /// Share (0–1) of sessions whose last request carries `final: true`; 0 for none.
    pub ends: f64,
}

impl SweConfig {
    /// The `--agentic` preset: subagents 0.3, compactions 0.5, ends 0.8.
    pub const AGENTIC: (f64, f64, f64) = (0.3, 0.5, 0.8);
}

impl Default for SweConfig {
    fn default() -> Self {
        SweConfig {
            seed: 0,
            sessions: REFERENCE_SESSIONS,
            requests: None,
            block_size: BlockSize::default(),
            max_input_tokens: DEFAULT_MAX_INPUT_TOKENS,
            system_prompt_tokens: 1_800,
            start_span_s: None,
            subagents: 0.0,
            compactions: 0.0,
            ends: 0.0,
        }
    }
}

/// A piecewise-linear quantile table: `(cumulative probability, value)`, both ascending,
/// from probability 0 to 1.
type Quantiles = &'static [(f64, f64)];

/// Turns per session.
const TURNS: Quantiles = &[
    (0.0, 20.0),
    (0.1, 38.0),
    (0.5, 88.0),
    (0.9, 126.0),
    (1.0, 140.0),
];
/// Fewest turns of a session.
const MIN_TURNS: usize = 20;
/// Output tokens per request.
const OUTPUT: Quantiles = &[
    (0.0, 2.0),
    (0.5, 50.0),
    (0.75, 120.0),
    (0.9, 300.0),
    (0.99, 700.0),
    (0.995, 850.0),
    (0.999, 1_150.0),
    (1.0, 1_600.0),
];
/// Seconds between consecutive turns of a session.
const GAP_S: Quantiles = &[
    (0.0, 0.9),
    (0.1, 1.6),
    (0.5, 2.5),
    (0.75, 4.0),
    (0.9, 7.8),
    (0.95, 12.0),
    (0.98, 20.0),
    (0.99, 30.0),
    (0.998, 90.0),
    (1.0, 265.0),
];
/// Tokens of a short observation before the growth factors.
const SHORT_OBS: Quantiles = &[
    (0.0, 20.0),
    (0.25, 120.0),
    (0.5, 260.0),
    (0.75, 520.0),
    (0.9, 900.0),
    (0.98, 1_500.0),
    (1.0, 2_600.0),
];
/// Tokens of a long (later collapsed) observation.
const LONG_OBS: Quantiles = &[
    (0.0, 400.0),
    (0.25, 800.0),
    (0.5, 1_150.0),
    (0.75, 1_600.0),
    (0.9, 2_300.0),
    (0.99, 4_200.0),
    (1.0, 9_000.0),
];
/// Per-session growth factor of short observations.
const GROWTH: Quantiles = &[(0.0, 0.6), (0.5, 1.0), (1.0, 1.6)];
/// Scale of short observations.
const SHORT_SCALE: f64 = 0.72;
/// Share of observations that are long.
const LONG_SHARE: f64 = 0.54;
/// Range of the per-session verbatim window (tokens).
const WINDOW: (u64, u64) = (1_600, 6_500);
/// Range of a collapsed observation's placeholder (tokens).
const PLACEHOLDER: (u64, u64) = (20, 60);
/// Range of the margin by which an over-limit session's prompt is fitted to pass the limit.
const OVER_MARGIN: (u64, u64) = (100, 600);
/// Range of the task statement (tokens).
const TASK: (u64, u64) = (4_500, 7_500);
/// Compaction starts this many tokens below the input limit…
const COMPACT_MARGIN: u64 = 4_096;
/// …and collapses segments until the prompt is this much below the threshold.
const COMPACT_DROP: u64 = 8_000;
/// A session that compacts does so whenever its prompt passes this many tokens.
pub const COMPACTION_THRESHOLD: u64 = 40_000;
/// Range of a compaction's summary (tokens).
const SUMMARY: (u64, u64) = (2_000, 8_000);
/// Range of a subagent's task statement (tokens).
const CHILD_TASK: (u64, u64) = (1_200, 4_500);
/// Range of the turns of a subagent session.
const CHILD_TURNS: (u64, u64) = (2, 6);
/// Range of the subagents one parent spawns.
const CHILD_COUNT: (u64, u64) = (1, 3);
/// Range of the delay from the parent's spawning turn to a subagent's first request (ms).
const CHILD_DELAY_MS: (u64, u64) = (300, 2_500);
/// Range of the delay from a parent's last subagent request to the parent's next turn (ms).
const RESUME_MS: (u64, u64) = (500, 3_000);
/// Seconds between consecutive turns of a subagent session: short pauses.
const CHILD_GAP_S: Quantiles = &[(0.0, 0.6), (0.1, 1.0), (0.5, 1.8), (0.9, 3.5), (1.0, 8.0)];
/// ChaCha streams of the optional features, apart from the plan's (0) and the sessions'
/// (`s + 1`), so each feature leaves the draws of the others, and the default trace, alone.
const SUBAGENT_STREAM: u64 = u64::MAX;
const COMPACTION_STREAM: u64 = u64::MAX - 1;
const ENDS_STREAM: u64 = u64::MAX - 2;
/// Seconds of session starts per session (5,600 s for 52 sessions).
const START_SPAN_PER_SESSION_S: f64 = 5_600.0 / 52.0;

/// Early turns observe more: short observations are scaled by `0.5 + 2 · 25 / (25 + t)`.
fn early_factor(turn: usize) -> f64 {
    0.5 + 2.0 * 25.0 / (25.0 + turn as f64)
}

/// Draws from a ChaCha8 stream.
struct Draw(ChaCha8Rng);

impl Draw {
    fn stream(seed: u64, stream: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        Draw(rng)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    fn unit(&mut self) -> f64 {
        (self.0.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// Uniform integer in `lo..=hi` (multiply-shift; the bias is below 2⁻⁴⁰ for our ranges).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        let n = u128::from(hi - lo) + 1;
        lo + ((u128::from(self.0.next_u64()) * n) >> 64) as u64
    }

    fn quantile(&mut self, table: Quantiles) -> f64 {
        let u = self.unit();
        quantile(table, u)
    }
}

/// Value of a quantile table at cumulative probability `u`.
fn quantile(table: Quantiles, u: f64) -> f64 {
    for pair in table.windows(2) {
        let ((u0, v0), (u1, v1)) = (pair[0], pair[1]);
        if u <= u1 {
            return v0 + (v1 - v0) * (u - u0) / (u1 - u0);
        }
    }
    table.last().map_or(0.0, |&(_, v)| v)
}

/// Rounds a non-negative draw to whole tokens (at least `min`).
fn whole(x: f64, min: u64) -> u64 {
    ((x + 0.5) as u64).max(min)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    System,
    Task,
    Output,
    Short,
    Long,
    /// A compaction's summary of the session so far.
    Summary,
}

#[derive(Clone, Copy)]
struct Segment {
    uid: u64,
    len: u64,
    kind: Kind,
    collapsed: bool,
}

/// One generated turn of a session.
struct Turn {
    input: u64,
    output: u64,
    /// Milliseconds since the previous turn (0 for the first).
    gap_ms: u64,
    /// Interned block ids (empty when not hashing).
    ids: Vec<u64>,
}

/// How a session ends.
#[derive(Clone, Copy)]
enum Ending {
    /// After `turns` turns; the prompt is compacted below the limit.
    Turns(usize),
    /// When the prompt first exceeds the limit, followed by `retries` identical requests;
    /// at most `turns` turns.
    OverLimit { turns: usize, retries: usize },
}

/// A piece of a block: `(segment uid, start, end)` offsets within the segment.
type Piece = (u64, u64, u64);

/// Interns blocks: a block's id is determined by its predecessor and the pieces it covers.
///
/// Only blocks made of the shared system prompt alone (segment uid 0; their predecessors are
/// such blocks too) can be equal across sessions, since every other segment's uid is its
/// session's own: those get ids from one table shared by all sessions (marked with
/// [`Interner::SHARED`]), the others from a table of their session, dropped when it ends. Two
/// blocks get the same id exactly when one table for all would give them the same id, and
/// ids are renumbered by first appearance in the output, so the output does not depend on
/// which table numbered a block.
#[derive(Default)]
struct Interner {
    shared: HashMap<(u64, Vec<Piece>), u64>,
    session: HashMap<(u64, Vec<Piece>), u64>,
}

impl Interner {
    const ROOT: u64 = u64::MAX;
    /// Marks the ids of shared blocks.
    const SHARED: u64 = 1 << 62;

    fn id(&mut self, parent: u64, pieces: Vec<Piece>) -> u64 {
        if pieces.iter().all(|p| p.0 == 0) {
            let next = Self::SHARED | self.shared.len() as u64;
            *self.shared.entry((parent, pieces)).or_insert(next)
        } else {
            let next = self.session.len() as u64;
            *self.session.entry((parent, pieces)).or_insert(next)
        }
    }

    /// Starts a session: its own blocks are numbered afresh.
    fn new_session(&mut self) {
        self.session.clear();
    }
}

struct SessionSim<'a> {
    cfg: &'a SweConfig,
    session: usize,
    growth: f64,
    /// Collapse old segments when the prompt nears the limit (for sessions that must stay
    /// under it; never when ending over the limit).
    compact: bool,
    /// Rewrite the prompt (system prompt, summary, newest message) whenever it passes this
    /// many tokens.
    compact_over: Option<u64>,
    /// A subagent session: a shorter task statement and short pauses between turns.
    child: bool,
}

impl SessionSim<'_> {
    fn limit_threshold(&self) -> u64 {
        self.cfg.max_input_tokens.saturating_sub(COMPACT_MARGIN)
    }

    /// Runs the session; hashes blocks when `interner` is given.
    fn run(&self, ending: Ending, mut interner: Option<&mut Interner>) -> Vec<Turn> {
        let cfg = self.cfg;
        let bs = u64::from(cfg.block_size.tokens());
        let mut draw = Draw::stream(cfg.seed, self.session as u64 + 1);
        let mut next_uid = (self.session as u64 + 1) << 32;
        let mut uid = || {
            next_uid += 1;
            next_uid
        };

        let (task_range, gaps) = if self.child {
            (CHILD_TASK, CHILD_GAP_S)
        } else {
            (TASK, GAP_S)
        };
        let task = draw.range(task_range.0, task_range.1);
        let window = draw.range(WINDOW.0, WINDOW.1);
        let mut segs = vec![
            Segment {
                uid: 0,
                len: cfg.system_prompt_tokens,
                kind: Kind::System,
                collapsed: false,
            },
            Segment {
                uid: uid(),
                len: task,
                kind: Kind::Task,
                collapsed: false,
            },
        ];
        let (max_turns, retries) = match ending {
            Ending::Turns(t) => (t, None),
            Ending::OverLimit { turns, retries } => (turns, Some(retries)),
        };

        let mut out: Vec<Turn> = Vec::with_capacity(max_turns);
        let mut len: u64 = segs.iter().map(|s| s.len).sum();
        // First token position where this turn's prompt differs from the previous one.
        let mut diff: u64 = 0;
        let mut crossed_at: Option<usize> = None;
        let mut prev_ids: Vec<u64> = Vec::new();
        loop {
            let turn = out.len() + 1;
            let output = whole(draw.quantile(OUTPUT), 1);
            let gap_ms = whole(draw.quantile(gaps) * 1000.0, 1);
            let ids = match interner.as_deref_mut() {
                Some(int) => {
                    let ids = block_ids(&segs, len, diff, &prev_ids, bs, int);
                    prev_ids.clone_from(&ids);
                    ids
                }
                None => Vec::new(),
            };
            out.push(Turn {
                input: len,
                output,
                gap_ms: if turn == 1 { 0 } else { gap_ms },
                ids,
            });
            if retries.is_some() && crossed_at.is_none() && len > cfg.max_input_tokens {
                crossed_at = Some(turn);
            }
            if out.len() >= max_turns {
                break;
            }
            if let (Some(c), Some(r)) = (crossed_at, retries) {
                if turn >= c + r {
                    break;
                }
                // The harness retries the same prompt.
                diff = len;
                continue;
            }

            // Next prompt: this turn's output, then the tool's observation.
            diff = len;
            segs.push(Segment {
                uid: uid(),
                len: output,
                kind: Kind::Output,
                collapsed: false,
            });
            let (kind, size) = if draw.unit() < LONG_SHARE {
                (Kind::Long, whole(draw.quantile(LONG_OBS), 1))
            } else {
                let base = draw.quantile(SHORT_OBS);
                (
                    Kind::Short,
                    whole(base * SHORT_SCALE * self.growth * early_factor(turn), 1),
                )
            };
            segs.push(Segment {
                uid: uid(),
                len: size,
                kind,
                collapsed: false,
            });
            len += output + size;

            // Collapse long observations that left the verbatim window.
            let mut start = 0;
            for seg in &mut segs {
                let end = start + seg.len;
                if seg.kind == Kind::Long && !seg.collapsed && len - end > window {
                    diff = diff.min(start);
                    seg.len = draw.range(PLACEHOLDER.0, PLACEHOLDER.1);
                    seg.uid = uid();
                    seg.collapsed = true;
                }
                start = end;
            }
            len = segs.iter().map(|s| s.len).sum();

            // Compaction near the limit (sessions that must stay under it).
            if self.compact && retries.is_none() && len > self.limit_threshold() {
                let target = self.limit_threshold().saturating_sub(COMPACT_DROP);
                let mut start = 0;
                for seg in &mut segs {
                    let collapsible = matches!(seg.kind, Kind::Output | Kind::Short | Kind::Long)
                        && !seg.collapsed
                        && seg.len > PLACEHOLDER.1;
                    if collapsible && len > target {
                        diff = diff.min(start);
                        let placeholder = draw.range(PLACEHOLDER.0, PLACEHOLDER.1);
                        len = len - seg.len + placeholder;
                        seg.len = placeholder;
                        seg.uid = uid();
                        seg.collapsed = true;
                    }
                    start += seg.len;
                }
            }

            // The agent compacts its context: the system prompt, a summary of the session so
            // far, then the newest message (this turn's output and observation).
            if let Some(over) = self.compact_over
                && retries.is_none()
                && len > over
            {
                let newest = segs.split_off(segs.len() - 2);
                segs.truncate(1);
                segs.push(Segment {
                    uid: uid(),
                    len: draw.range(SUMMARY.0, SUMMARY.1),
                    kind: Kind::Summary,
                    collapsed: false,
                });
                segs.extend(newest);
                diff = diff.min(cfg.system_prompt_tokens);
                len = segs.iter().map(|s| s.len).sum();
            }
        }
        out
    }
}

/// Block ids of a prompt: the leading blocks before `diff` are the previous turn's; the rest
/// are interned from their pieces, each chained on the block before it.
fn block_ids(
    segs: &[Segment],
    len: u64,
    diff: u64,
    prev: &[u64],
    bs: u64,
    interner: &mut Interner,
) -> Vec<u64> {
    let blocks = len.div_ceil(bs) as usize;
    let keep = ((diff / bs) as usize).min(prev.len()).min(blocks);
    let mut ids = Vec::with_capacity(blocks);
    ids.extend_from_slice(&prev[..keep]);
    let mut starts = Vec::with_capacity(segs.len());
    let mut pos = 0;
    for s in segs {
        starts.push(pos);
        pos += s.len;
    }
    for k in keep..blocks {
        let (lo, hi) = (k as u64 * bs, ((k as u64 + 1) * bs).min(len));
        let mut pieces = Vec::with_capacity(2);
        let mut i = starts.partition_point(|&s| s <= lo).saturating_sub(1);
        let mut at = lo;
        while at < hi && i < segs.len() {
            let seg_end = starts[i] + segs[i].len;
            let take_end = seg_end.min(hi);
            if take_end > at {
                pieces.push((segs[i].uid, at - starts[i], take_end - starts[i]));
                at = take_end;
            }
            i += 1;
        }
        let parent = ids.last().copied().unwrap_or(Interner::ROOT);
        ids.push(interner.id(parent, pieces));
    }
    ids
}

/// Generates a SWE-agent-like trace (see the module docs); records are sorted by timestamp,
/// ties broken by session and turn, and carry `session_id` (0-based, in order of session
/// start; subagent sessions from `sessions` upward) and `turn_id` (from 1). [`swe_stream`]
/// gives the same records one at a time.
pub fn swe(cfg: &SweConfig) -> Vec<TraceRecord> {
    swe_stream(cfg).collect()
}

/// Turns, growth factor, ending and start of every session.
fn plan(cfg: &SweConfig) -> SwePlan {
    let n = cfg.sessions;
    if n == 0 {
        return SwePlan {
            growth: Vec::new(),
            ending: Vec::new(),
            starts_ms: Vec::new(),
            planned: 0,
            turn_cap: 0,
            agentic: Agentic::default(),
        };
    }
    let mut plan = Draw::stream(cfg.seed, 0);

    // Turns per session: stratified draws, shuffled over sessions.
    let mut turns: Vec<usize> = (0..n)
        .map(|i| {
            let u = (i as f64 + plan.unit()) / n as f64;
            (quantile(TURNS, u) + 0.5) as usize
        })
        .collect();
    for i in (1..n).rev() {
        let j = plan.range(0, i as u64) as usize;
        turns.swap(i, j);
    }
    let growth: Vec<f64> = (0..n).map(|_| plan.quantile(GROWTH)).collect();

    // Session starts: stratified over the span, the first at 0.
    let span = cfg
        .start_span_s
        .unwrap_or(START_SPAN_PER_SESSION_S * n as f64)
        .max(0.0);
    let raw_starts: Vec<f64> = (0..n)
        .map(|i| span * (i as f64 + plan.unit()) / n as f64)
        .collect();
    let starts_ms: Vec<u64> = raw_starts
        .iter()
        .map(|&s| whole((s - raw_starts[0]) * 1000.0, 0))
        .collect();

    // The longest sessions run past the limit.
    let over_limit_sessions = (2 * n + REFERENCE_SESSIONS / 2) / REFERENCE_SESSIONS;
    let mut by_length: Vec<usize> = (0..n).collect();
    by_length.sort_by_key(|&s| (std::cmp::Reverse(turns[s]), s));
    let mut ending: Vec<Ending> = turns.iter().map(|&t| Ending::Turns(t)).collect();
    let mut growth = growth;
    let mut final_turns: Vec<Option<usize>> = vec![None; n];
    for &s in &by_length[..over_limit_sessions] {
        let retries = plan.range(1, 2) as usize;
        let margin = plan.range(OVER_MARGIN.0, OVER_MARGIN.1);
        let target = turns[s].saturating_sub(retries).max(1);
        growth[s] = fit_over_limit(cfg, s, target, margin);
        let e = Ending::OverLimit {
            turns: target + retries,
            retries,
        };
        ending[s] = e;
        // The run ends `retries` turns after the limit is passed, possibly before `target`.
        let sim = SessionSim {
            cfg,
            session: s,
            growth: growth[s],
            compact: false,
            compact_over: None,
            child: false,
        };
        final_turns[s] = Some(sim.run(e, None).len());
    }

    // Other sessions: shorter than every over-limit one, adjusted to the requested total.
    let cap = final_turns
        .iter()
        .flatten()
        .min()
        .map_or(quantile(TURNS, 1.0) as usize, |&m| m.saturating_sub(1))
        .max(MIN_TURNS);
    let target_total = cfg
        .requests
        .unwrap_or((REFERENCE_REQUESTS * n + REFERENCE_SESSIONS / 2) / REFERENCE_SESSIONS);
    let others: Vec<usize> = (0..n).filter(|&s| final_turns[s].is_none()).collect();
    for &s in &others {
        final_turns[s] = Some(turns[s].clamp(MIN_TURNS, cap));
    }
    let mut total: usize = final_turns.iter().flatten().sum();
    while total != target_total && !others.is_empty() {
        let mut changed = false;
        for &s in &others {
            let t = final_turns[s].get_or_insert(MIN_TURNS);
            if total < target_total && *t < cap {
                *t += 1;
                total += 1;
                changed = true;
            } else if total > target_total && *t > MIN_TURNS {
                *t -= 1;
                total -= 1;
                changed = true;
            }
            if total == target_total {
                break;
            }
        }
        if !changed {
            break;
        }
    }
    for &s in &others {
        ending[s] = Ending::Turns(final_turns[s].unwrap_or(MIN_TURNS));
    }

    let lengths: Vec<usize> = final_turns.iter().map(|t| t.unwrap_or(MIN_TURNS)).collect();
    let agentic = plan_agentic(cfg, &growth, &ending, &lengths);
    SwePlan {
        growth,
        ending,
        starts_ms,
        planned: total,
        turn_cap: cap,
        agentic,
    }
}

/// Rounds `fraction` (clamped to 0–1) of `n` to a whole count.
fn share_of(fraction: f64, n: usize) -> usize {
    let f = if fraction.is_nan() {
        0.0
    } else {
        fraction.clamp(0.0, 1.0)
    };
    ((f * n as f64 + 0.5) as usize).min(n)
}

/// `k` of `items`, chosen by a partial Fisher–Yates shuffle, in ascending order.
fn choose(draw: &mut Draw, mut items: Vec<usize>, k: usize) -> Vec<usize> {
    let n = items.len();
    for i in 0..k.min(n) {
        let j = draw.range(i as u64, n as u64 - 1) as usize;
        items.swap(i, j);
    }
    items.truncate(k);
    items.sort_unstable();
    items
}

/// Subagents, compactions and explicit ends of every session, each drawn from its own stream;
/// `lengths` holds the requests of every session.
fn plan_agentic(cfg: &SweConfig, growth: &[f64], ending: &[Ending], lengths: &[usize]) -> Agentic {
    let n = ending.len();
    let mut a = Agentic {
        spawns: vec![None; n],
        children: Vec::new(),
        compacts: vec![false; n],
        ends: vec![false; n],
    };

    let parents = share_of(cfg.subagents, n);
    if parents > 0 {
        let mut draw = Draw::stream(cfg.seed, SUBAGENT_STREAM);
        for s in choose(&mut draw, (0..n).collect(), parents) {
            // The spawning turn has a next turn (other than a retry of an over-limit prompt).
            let retries = match ending[s] {
                Ending::Turns(_) => 0,
                Ending::OverLimit { retries, .. } => retries,
            };
            let last_spawn = lengths[s].saturating_sub(retries + 1);
            if last_spawn == 0 {
                continue;
            }
            let after_turn = draw.range(1, last_spawn as u64) as usize;
            let count = draw.range(CHILD_COUNT.0, CHILD_COUNT.1) as usize;
            let mut delays: Vec<u64> = (0..count)
                .map(|_| draw.range(CHILD_DELAY_MS.0, CHILD_DELAY_MS.1))
                .collect();
            // Children are numbered in the order they start.
            delays.sort_unstable();
            let first = a.children.len();
            for delay_ms in delays {
                a.children.push(ChildPlan {
                    turns: draw.range(CHILD_TURNS.0, CHILD_TURNS.1) as usize,
                    growth: draw.quantile(GROWTH),
                    delay_ms,
                    final_end: false,
                });
            }
            a.spawns[s] = Some(Spawn {
                after_turn,
                children: first..a.children.len(),
                resume_ms: draw.range(RESUME_MS.0, RESUME_MS.1),
            });
        }
    }

    if cfg.compactions > 0.0 {
        // Long sessions: those whose prompt passes the threshold (never the ones that must
        // pass the input limit).
        let long: Vec<usize> = (0..n)
            .filter(|&s| {
                matches!(ending[s], Ending::Turns(_))
                    && SessionSim {
                        cfg,
                        session: s,
                        growth: growth[s],
                        compact: true,
                        compact_over: None,
                        child: false,
                    }
                    .run(ending[s], None)
                    .iter()
                    .any(|t| t.input > COMPACTION_THRESHOLD)
            })
            .collect();
        let k = share_of(cfg.compactions, long.len());
        let mut draw = Draw::stream(cfg.seed, COMPACTION_STREAM);
        for s in choose(&mut draw, long, k) {
            a.compacts[s] = true;
        }
    }

    if cfg.ends > 0.0 {
        let mut draw = Draw::stream(cfg.seed, ENDS_STREAM);
        for s in choose(&mut draw, (0..n).collect(), share_of(cfg.ends, n)) {
            a.ends[s] = true;
        }
        // Subagents end explicitly with the same probability.
        for c in &mut a.children {
            c.final_end = draw.unit() < cfg.ends;
        }
    }
    a
}

/// What the generator decides for every session before generating any turn.
struct SwePlan {
    growth: Vec<f64>,
    ending: Vec<Ending>,
    starts_ms: Vec<u64>,
    /// Requests planned in all.
    planned: usize,
    /// Most turns of a session that does not pass the input limit.
    turn_cap: usize,
    agentic: Agentic,
}

/// The optional agentic features of a plan (all empty by default).
#[derive(Default)]
struct Agentic {
    /// Per session: the subagents it spawns, if any.
    spawns: Vec<Option<Spawn>>,
    /// Subagent sessions; child `j` has session id `sessions + j`.
    children: Vec<ChildPlan>,
    /// Per session: whether it compacts past [`COMPACTION_THRESHOLD`].
    compacts: Vec<bool>,
    /// Per session: whether its last request carries `final`.
    ends: Vec<bool>,
}

/// Subagents a parent spawns after one of its turns.
#[derive(Clone)]
struct Spawn {
    /// The parent's turn (1-based) after which the subagents start.
    after_turn: usize,
    /// Their indices in [`Agentic::children`].
    children: std::ops::Range<usize>,
    /// Delay from the last subagent request to the parent's next turn (ms).
    resume_ms: u64,
}

/// One subagent session.
struct ChildPlan {
    turns: usize,
    growth: f64,
    /// Delay from the parent's spawning turn to the subagent's first request (ms).
    delay_ms: u64,
    final_end: bool,
}

/// The records of [`swe`], generated as they are taken: sessions are generated when the
/// output reaches their start and dropped once their last turn is out, so memory grows with
/// the sessions that overlap in time, not with the trace.
pub struct SweStream<'a> {
    cfg: &'a SweConfig,
    plan: SwePlan,
    interner: Interner,
    /// The next session to generate.
    next_session: usize,
    /// Generated sessions with turns left: their turns, the next one's position, its
    /// timestamp, and the output ids of the session's own blocks.
    open: HashMap<usize, OpenSession>,
    /// (timestamp, session) of the next turn of every open session.
    heads: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize)>>,
    /// Output id of every shared block, by its index (`u64::MAX`: not out yet).
    shared_ids: Vec<u64>,
    next_id: u64,
}

struct OpenSession {
    turns: std::vec::IntoIter<Turn>,
    /// 1-based number of the next turn.
    turn: usize,
    ts: u64,
    ids: Vec<u64>,
    /// The session that spawned this one (subagents only).
    parent: Option<SessionId>,
    /// Whether the last request carries `final`.
    final_end: bool,
}

/// Generates a SWE-agent-like trace as a stream of records (see [`swe`]).
pub fn swe_stream(cfg: &SweConfig) -> SweStream<'_> {
    SweStream {
        cfg,
        plan: plan(cfg),
        interner: Interner::default(),
        next_session: 0,
        open: HashMap::new(),
        heads: std::collections::BinaryHeap::new(),
        shared_ids: Vec::new(),
        next_id: 0,
    }
}

impl SweStream<'_> {
    /// Requests the stream will give, and the most turns of a session that stays under the
    /// input limit: fewer requests than asked for when the sessions cannot hold them (every
    /// such session is kept shorter than the shortest one that passes the limit).
    ///
    /// Both count the top-level sessions only: subagent sessions (see [`SweConfig::subagents`])
    /// come on top, and [`planned_total`](Self::planned_total) counts them too.
    pub fn planned(&self) -> (usize, usize) {
        (self.plan.planned, self.plan.turn_cap)
    }

    /// Requests the stream will give, subagent sessions' included.
    pub fn planned_total(&self) -> usize {
        self.plan.planned
            + self
                .plan
                .agentic
                .children
                .iter()
                .map(|c| c.turns)
                .sum::<usize>()
    }

    /// Subagent sessions the stream will give.
    pub fn planned_subagents(&self) -> usize {
        self.plan.agentic.children.len()
    }

    /// Generates session `s` (and the subagents it spawns) with block hashing and queues its
    /// first turn.
    fn open_session(&mut self, s: usize) {
        let a = &self.plan.agentic;
        let sim = SessionSim {
            cfg: self.cfg,
            session: s,
            growth: self.plan.growth[s],
            compact: true,
            compact_over: a
                .compacts
                .get(s)
                .copied()
                .unwrap_or(false)
                .then_some(COMPACTION_THRESHOLD),
            child: false,
        };
        self.interner.new_session();
        let mut turns = sim.run(self.plan.ending[s], Some(&mut self.interner));
        let start = self.plan.starts_ms[s];
        if let Some(spawn) = a.spawns.get(s).cloned().flatten()
            && spawn.after_turn < turns.len()
        {
            // The spawning turn's timestamp; the subagents run in the pause after it, and the
            // parent's next turn waits for the last of them.
            let spawned_at = turns[..spawn.after_turn]
                .iter()
                .fold(start, |ts, t| ts.saturating_add(t.gap_ms));
            let mut last = spawned_at;
            for j in spawn.children {
                let c = &self.plan.agentic.children[j];
                let id = self.cfg.sessions + j;
                let child = SessionSim {
                    cfg: self.cfg,
                    session: id,
                    growth: c.growth,
                    compact: true,
                    compact_over: None,
                    child: true,
                };
                let (delay, final_end) = (c.delay_ms, c.final_end);
                self.interner.new_session();
                let child_turns = child.run(Ending::Turns(c.turns), Some(&mut self.interner));
                let first_ts = spawned_at.saturating_add(delay);
                let end = child_turns
                    .iter()
                    .fold(first_ts, |ts, t| ts.saturating_add(t.gap_ms));
                last = last.max(end);
                self.queue(
                    id,
                    child_turns,
                    first_ts,
                    Some(SessionId(s as u64)),
                    final_end,
                );
            }
            let next = &mut turns[spawn.after_turn];
            let needed = last.saturating_add(spawn.resume_ms) - spawned_at;
            next.gap_ms = next.gap_ms.max(needed);
        }
        let final_end = self.plan.agentic.ends.get(s).copied().unwrap_or(false);
        self.queue(s, turns, start, None, final_end);
    }

    /// Queues the first turn of session `s`, which starts at `start` (ms).
    fn queue(
        &mut self,
        s: usize,
        turns: Vec<Turn>,
        start: u64,
        parent: Option<SessionId>,
        final_end: bool,
    ) {
        let Some(first) = turns.first() else {
            return;
        };
        let ts = start.saturating_add(first.gap_ms);
        self.open.insert(
            s,
            OpenSession {
                turns: turns.into_iter(),
                turn: 1,
                ts,
                ids: Vec::new(),
                parent,
                final_end,
            },
        );
        self.heads.push(std::cmp::Reverse((ts, s)));
    }
}

impl Iterator for SweStream<'_> {
    type Item = TraceRecord;

    fn next(&mut self) -> Option<TraceRecord> {
        // Records are in (timestamp, session, turn) order; sessions start in session order, so
        // a session is generated before the first record that would follow its first turn
        // (subagents, numbered after every top-level session, are generated with their parent,
        // before their first turn).
        while self.next_session < self.cfg.sessions
            && self.heads.peek().is_none_or(|&std::cmp::Reverse(head)| {
                (self.plan.starts_ms[self.next_session], self.next_session) < head
            })
        {
            self.open_session(self.next_session);
            self.next_session += 1;
        }
        let std::cmp::Reverse((ts, s)) = self.heads.pop()?;
        let open = self.open.get_mut(&s)?;
        let t = open.turns.next()?;
        let k = open.turn;
        let hash_ids = t
            .ids
            .iter()
            .map(|&id| {
                let slot = if id & Interner::SHARED != 0 {
                    let at = (id & !Interner::SHARED) as usize;
                    if self.shared_ids.len() <= at {
                        self.shared_ids.resize(at + 1, u64::MAX);
                    }
                    &mut self.shared_ids[at]
                } else {
                    let at = id as usize;
                    if open.ids.len() <= at {
                        open.ids.resize(at + 1, u64::MAX);
                    }
                    &mut open.ids[at]
                };
                if *slot == u64::MAX {
                    *slot = self.next_id;
                    self.next_id += 1;
                }
                BlockHash(*slot)
            })
            .collect();
        let last = open.turns.as_slice().is_empty();
        let record = TraceRecord {
            timestamp: ts,
            session_id: Some(SessionId(s as u64)),
            parent_session_id: open.parent,
            turn_id: Some(TurnId(u32::try_from(k).unwrap_or(u32::MAX))),
            session_final: last && open.final_end,
            input_length: t.input,
            output_length: t.output,
            hash_ids,
        };
        // The session's next turn, if any (its gap is known only once it is taken).
        match open.turns.as_slice().first() {
            Some(next) => {
                open.ts = ts.saturating_add(next.gap_ms);
                open.turn += 1;
                self.heads.push(std::cmp::Reverse((open.ts, s)));
            }
            None => {
                self.open.remove(&s);
            }
        }
        Some(record)
    }
}

/// Smallest growth factor (by bisection) with which session `s`, never compacted, has an
/// input above `max_input_tokens + margin` by turn `target` (the largest factor tried if none
/// does). The margin keeps the first over-limit input from sitting exactly on the limit.
fn fit_over_limit(cfg: &SweConfig, s: usize, target: usize, margin: u64) -> f64 {
    let crosses = |g: f64| {
        let sim = SessionSim {
            cfg,
            session: s,
            growth: g,
            compact: false,
            compact_over: None,
            child: false,
        };
        sim.run(Ending::Turns(target), None)
            .iter()
            .any(|t| t.input > cfg.max_input_tokens.saturating_add(margin))
    };
    let (mut lo, mut hi) = (0.25, 8.0);
    if !crosses(hi) {
        return hi;
    }
    for _ in 0..40 {
        let mid = (lo + hi) / 2.0;
        if crosses(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}
