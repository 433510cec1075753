//! `round-robin`: each role's healthy workers in turn.
//!
//! The next worker is the first healthy one whose id follows the last worker chosen in that role
//! (wrapping to the lowest id), so workers joining, leaving or turning unhealthy never make it
//! skip or repeat more than needed. No session notion: in a P/D topology every turn is P→D
//! (`turn1-seed` for a first turn, else `fallback` with reason `session-not-resident`); in a
//! colocated topology every decision is `colocated`.
//!
//! Score components: `rr_order` (0 for the worker picked, 1 for the one after it, …);
//! `total = −rr_order`.

use crate::backpressure::BackpressureConfig;
use crate::config::check_backpressure;
use crate::decision::{Decision, ScoreEntry};
use crate::error::PolicyError;
use crate::index::BlockView;
use crate::prefill;
use crate::route::{Ctx, Knobs, Plan};
use crate::worker_set::WorkerSet;
use kvc_core::{BlockSize, PrefillPolicy, WorkerId, WorkerRole};
use serde::{Deserialize, Serialize};

/// Configuration of `round-robin`.
///
/// | field | default |
/// |---|---|
/// | `prefill` | `round-robin` |
/// | `incremental-footprint` | `true` |
/// | `backpressure` | disabled (`max-pause-ms = 0`) |
/// | `block-size` | 512 |
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct RoundRobinConfig {
    /// How P is chosen.
    pub prefill: PrefillPolicy,
    /// Count a later colocated turn's footprint net of the worker's prefix cache
    /// (`max(0, input − cached) + output`, [`crate::footprint_tokens`]) instead of
    /// `input + output`.
    pub incremental_footprint: bool,
    /// Backpressure hint parameters.
    pub backpressure: BackpressureConfig,
    /// Tokens per block of `hash_ids`.
    pub block_size: BlockSize,
}

impl Default for RoundRobinConfig {
    fn default() -> Self {
        RoundRobinConfig {
            prefill: PrefillPolicy::RoundRobin,
            incremental_footprint: true,
            backpressure: BackpressureConfig::DISABLED,
            block_size: BlockSize::default(),
        }
    }
}

impl RoundRobinConfig {
    /// Checks the values are in range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        check_backpressure(&self.backpressure, "round-robin")
    }
}

/// Members of `set` in round-robin order: those after `last` by id, then the rest.
pub(crate) fn order(set: &WorkerSet, last: Option<WorkerId>) -> impl Iterator<Item = usize> + '_ {
    let start = last.map_or(0, |w| w.0 as usize + 1);
    set.iter()
        .filter(move |s| *s >= start)
        .chain(set.iter().filter(move |s| *s < start))
}

/// Picks the next worker of `set` (not empty) for `role`; appends its score entries.
pub(crate) fn pick(
    ctx: &Ctx<'_>,
    set: &WorkerSet,
    role: WorkerRole,
    scores: &mut Vec<ScoreEntry>,
) -> WorkerId {
    let first = scores.len();
    let mut chosen = None;
    for (k, slot) in order(set, ctx.state.cursor(role)).enumerate() {
        let id = WorkerId(slot as u32);
        chosen.get_or_insert(id);
        let mut e = ScoreEntry::new(id, role).with("rr_order", k as f64);
        e.total = 0.0 - k as f64;
        scores.push(e);
    }
    scores[first..].sort_unstable_by_key(|e| e.worker);
    chosen.unwrap_or(WorkerId(0))
}

pub(crate) fn route(cfg: &RoundRobinConfig, ctx: &Ctx<'_>) -> Result<Decision, PolicyError> {
    ctx.require_d()?;
    let knobs = Knobs::new(cfg.incremental_footprint, cfg.backpressure);
    let mut scores = ctx.score_list();
    let d = pick(ctx, ctx.healthy_d, ctx.d_role(), &mut scores);
    if ctx.colocated {
        let cached = ctx.cached_on(d, BlockView::Seen, cfg.block_size);
        return Ok(ctx.finish(Plan::colocated(d, cached, scores), knobs));
    }
    let chosen_p = prefill::choose(ctx, cfg.prefill, d, cfg.block_size, &mut scores)?;
    let path = ctx.sessionless_path();
    let plan = Plan::p_to_d(path, d, chosen_p, scores, None);
    Ok(ctx.finish(plan, knobs))
}
