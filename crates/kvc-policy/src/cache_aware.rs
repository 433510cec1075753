//! `cache-aware`: the prefix-cache routing baseline of the SGLang router.
//!
//! Over one set of workers (the colocated workers; or, in a P/D topology, the decode workers and,
//! independently, the prefill workers), with `load` = requests in flight on the worker (the
//! larger of the published count and the router's own count):
//!
//! 1. if `max_load − min_load > balance_abs_threshold` and
//!    `max_load > min_load × balance_rel_threshold`, the least-loaded worker;
//! 2. else, if the longest prefix match has a match rate above `cache_threshold`, that worker;
//! 3. else the least-loaded worker.
//!
//! The prefix match of a worker is the number of leading request blocks the router has sent it
//! (grow-only view, like the router's approximate radix tree, and like it bounded: the least
//! recently sent blocks leave past the state's per-worker block bound); the match rate is the tokens those
//! blocks cover (full blocks only) over the input length. Ties: the longest match prefers the
//! lower load, then the lower id; among the least loaded, the worker with the fewest requests
//! assigned so far wins, then the lower id (so an idle pool spreads new work evenly).
//!
//! It has no session notion and no joint P/D choice: in a P/D topology every turn is P→D
//! (`turn1-seed` for a first turn, else `fallback` with reason `session-not-resident`, or
//! `session-cap-rejected` if a caller re-routes a reject); colocated decisions are `colocated`.
//!
//! Score components: `load`, `match_blocks`, `match_rate`, `imbalanced` (1 if rule 1 fired);
//! `total` = `match_rate` when the prefix rule chose, otherwise `−load`.

use crate::backpressure::BackpressureConfig;
use crate::config::{check, check_backpressure};
use crate::decision::{Decision, ScoreEntry};
use crate::error::PolicyError;
use crate::index::BlockView;
use crate::route::{Ctx, Knobs, Plan};
use crate::worker_set::WorkerSet;
use kvc_core::{BlockSize, WorkerId, WorkerRole};
use serde::{Deserialize, Serialize};

/// Configuration of `cache-aware` (defaults are the SGLang router's CLI defaults).
///
/// | field | default |
/// |---|---|
/// | `cache-threshold` | 0.3 |
/// | `balance-abs-threshold` | 64 |
/// | `balance-rel-threshold` | 1.5 |
/// | `incremental-footprint` | `true` |
/// | `backpressure` | disabled (`max-pause-ms = 0`) |
/// | `block-size` | 512 |
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct CacheAwareConfig {
    /// Minimum match rate (exclusive) for the prefix rule.
    pub cache_threshold: f64,
    /// Absolute load gap above which the pool counts as imbalanced.
    pub balance_abs_threshold: u32,
    /// Relative load ratio above which the pool counts as imbalanced.
    pub balance_rel_threshold: f64,
    /// Count a later colocated turn's footprint net of the worker's prefix cache
    /// (`max(0, input − cached) + output`, [`crate::footprint_tokens`]) instead of
    /// `input + output`.
    pub incremental_footprint: bool,
    /// Backpressure hint parameters.
    pub backpressure: BackpressureConfig,
    /// Tokens per block of `hash_ids`.
    pub block_size: BlockSize,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            incremental_footprint: true,
            backpressure: BackpressureConfig::DISABLED,
            block_size: BlockSize::default(),
        }
    }
}

impl CacheAwareConfig {
    /// Checks the values are in range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        const NAME: &str = "cache-aware";
        check(
            self.cache_threshold.is_finite() && (0.0..=1.0).contains(&self.cache_threshold),
            NAME,
            "cache-threshold must be within [0, 1]",
        )?;
        check(
            self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 0.0,
            NAME,
            "balance-rel-threshold must be finite and >= 0",
        )?;
        check_backpressure(&self.backpressure, NAME)
    }
}

/// Picks among `set` (not empty) for `role`; appends score entries. Returns the worker and the
/// leading request blocks it holds.
fn pick(
    ctx: &Ctx<'_>,
    cfg: &CacheAwareConfig,
    set: &WorkerSet,
    role: WorkerRole,
    scores: &mut Vec<ScoreEntry>,
) -> (WorkerId, u32) {
    let depths = ctx.depths(set, BlockView::Seen);
    let (mut min_load, mut max_load) = (u32::MAX, 0u32);
    let mut least: Option<(u32, u64, WorkerId)> = None;
    let mut longest: Option<(u32, u32, WorkerId)> = None;
    for slot in set.iter() {
        let id = WorkerId(slot as u32);
        let load = ctx.load(id);
        min_load = min_load.min(load);
        max_load = max_load.max(load);
        // Ids increase, so strict comparisons keep the lower id on ties.
        let assigned = ctx.state.assignments(id);
        if least.is_none_or(|(l, a, _)| (load, assigned) < (l, a)) {
            least = Some((load, assigned, id));
        }
        let depth = depths[slot];
        if longest.is_none_or(|(d, l, _)| depth > d || (depth == d && load < l)) {
            longest = Some((depth, load, id));
        }
    }
    let imbalanced = max_load.saturating_sub(min_load) > cfg.balance_abs_threshold
        && f64::from(max_load) > f64::from(min_load) * cfg.balance_rel_threshold;
    let rate = |depth: u32| {
        if ctx.req.input_length == 0 {
            0.0
        } else {
            ctx.reusable(depth, cfg.block_size) as f64 / ctx.req.input_length as f64
        }
    };
    let (Some((_, _, least_id)), Some((best_depth, _, best_id))) = (least, longest) else {
        return (WorkerId(0), 0);
    };
    let by_prefix = !imbalanced && rate(best_depth) > cfg.cache_threshold;
    let chosen = if by_prefix { best_id } else { least_id };
    for slot in set.iter() {
        let id = WorkerId(slot as u32);
        let load = f64::from(ctx.load(id));
        let r = rate(depths[slot]);
        let mut e = ScoreEntry::new(id, role)
            .with("load", load)
            .with("match_blocks", f64::from(depths[slot]))
            .with("match_rate", r)
            .with("imbalanced", if imbalanced { 1.0 } else { 0.0 });
        e.total = if by_prefix { r } else { 0.0 - load };
        scores.push(e);
    }
    (chosen, depths[chosen.0 as usize])
}

pub(crate) fn route(cfg: &CacheAwareConfig, ctx: &Ctx<'_>) -> Result<Decision, PolicyError> {
    ctx.require_d()?;
    let knobs = Knobs::new(cfg.incremental_footprint, cfg.backpressure);
    let mut scores = ctx.score_list();
    let (d, d_depth) = pick(ctx, cfg, ctx.healthy_d, ctx.d_role(), &mut scores);
    if ctx.colocated {
        let cached = ctx.reusable(d_depth, cfg.block_size);
        return Ok(ctx.finish(Plan::colocated(d, cached, scores), knobs));
    }
    // A worker never ships KV to itself (an all-capable worker is a candidate on both sides).
    let mut prefill = ctx.healthy_p.clone();
    prefill.remove(d.0 as usize);
    if prefill.is_empty() {
        return Err(PolicyError::NoHealthyWorker {
            role: WorkerRole::Prefill,
        });
    }
    let (p, p_depth) = pick(ctx, cfg, &prefill, WorkerRole::Prefill, &mut scores);
    let (mode, reason) = ctx.sessionless_path();
    let cached = ctx.reusable(p_depth, cfg.block_size);
    let plan = Plan::p_to_d((mode, reason), d, (p, cached), scores, None);
    Ok(ctx.finish(plan, knobs))
}
