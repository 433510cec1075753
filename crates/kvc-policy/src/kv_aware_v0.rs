//! `kv-aware-v0`: the reference study's baseline, kept faithful as the control, defects included.
//!
//! Each healthy decode (or colocated) worker gets the tuple
//!
//! ```text
//! (overlap + sticky_bonus × sticky, sticky, −in_flight, −assignments)
//! ```
//!
//! compared lexicographically, highest wins, final tie to the lower id. `overlap` is the number
//! of leading request blocks the router has ever sent to the worker (a grow-only view: it never
//! forgets on eviction — the study's defect, kept; only the state's per-worker block bound,
//! 4 pools' worth of blocks by default, drops the least recently sent blocks, which the
//! default simulator runs never notice); `sticky` is 1 for the session's current D; `sticky_bonus` is large, so a
//! session stays on its first D however full that D is (the pinning defect); `in_flight` is the
//! larger of the published and the router's own count; `assignments` counts requests the router
//! sent to the worker. There is no capacity term.
//!
//! First turns are placed with `overlap` taken as 0 unless `first-turn-overlap` is set: every
//! session shares the system prompt, so counting it would send every new session to the first D
//! that ever held one, whereas the reference baseline spread its requests evenly over the decode
//! workers (±3.8%); its defect is the pinning of later turns.
//!
//! In a P/D topology a later turn goes direct-to-D when [`crate::classify_turn`] allows it with
//! the small 2,048-token limit; otherwise P→D to the tuple's winner, which is the pinned D again
//! whenever it is healthy: after an eviction (`session-evicted`), a large append or a reject
//! (`session-cap-rejected`). It never migrates (`reseed` never happens); a session changes D only
//! when its D is unhealthy (`decode-unhealthy`). Rejects are counted in the router state but
//! never acted on. The footprint is the naive `input + output` unless `incremental-footprint`
//! is set.
//!
//! Score components: `overlap` (as counted in the key), `sticky_bonus` (the bonus added), `sticky`, `in_flight`,
//! `assignments`; `total` = the first key, `overlap + sticky_bonus × sticky`.

use crate::backpressure::BackpressureConfig;
use crate::config::check_backpressure;
use crate::decision::{Decision, ScoreEntry};
use crate::error::PolicyError;
use crate::fallthrough::TurnClass;
use crate::index::BlockView;
use crate::prefill;
use crate::route::{Ctx, Knobs, Plan};
use kvc_core::{BlockSize, ExecutionMode, PrefillPolicy, WorkerId};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;

/// Configuration of `kv-aware-v0` (defaults reproduce the reference baseline).
///
/// | field | default |
/// |---|---|
/// | `direct-limit-tokens` | 2,048 |
/// | `sticky-bonus` | 1,000,000 (blocks) |
/// | `first-turn-overlap` | `false` |
/// | `incremental-footprint` | `false` (defect 7: naive `input + output`) |
/// | `prefill` | `round-robin` (defect 6) |
/// | `backpressure` | disabled (defect 4) |
/// | `block-size` | 512 |
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct KvAwareV0Config {
    /// Largest uncached append (tokens) that may go direct-to-D.
    pub direct_limit_tokens: u64,
    /// Added to the overlap of the session's current D.
    pub sticky_bonus: u64,
    /// Count overlap when placing a first turn. Off, a first turn's overlap is taken as 0: every
    /// session shares the system prompt, and counting it would send every new session to the
    /// same D.
    pub first_turn_overlap: bool,
    /// Use `max(0, input − cached) + output` for later turns instead of `input + output`.
    pub incremental_footprint: bool,
    /// How P is chosen.
    pub prefill: PrefillPolicy,
    /// Backpressure hint parameters.
    pub backpressure: BackpressureConfig,
    /// Tokens per block of `hash_ids`.
    pub block_size: BlockSize,
}

impl Default for KvAwareV0Config {
    fn default() -> Self {
        KvAwareV0Config {
            direct_limit_tokens: 2_048,
            sticky_bonus: 1_000_000,
            first_turn_overlap: false,
            incremental_footprint: false,
            prefill: PrefillPolicy::RoundRobin,
            backpressure: BackpressureConfig::DISABLED,
            block_size: BlockSize::default(),
        }
    }
}

impl KvAwareV0Config {
    /// Checks the values are in range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        check_backpressure(&self.backpressure, "kv-aware-v0")
    }
}

/// Scores every healthy D (or colocated worker); returns the winner and its overlap.
fn pick(
    ctx: &Ctx<'_>,
    cfg: &KvAwareV0Config,
    sticky_to: Option<WorkerId>,
    scores: &mut Vec<ScoreEntry>,
) -> (WorkerId, u32) {
    let depths = ctx.depths(ctx.healthy_d, BlockView::Seen);
    let use_overlap = cfg.first_turn_overlap || !ctx.first_turn();
    let mut best = None;
    for slot in ctx.healthy_d.iter() {
        let id = WorkerId(slot as u32);
        let overlap = if use_overlap {
            u64::from(depths[slot])
        } else {
            0
        };
        let sticky = u64::from(sticky_to == Some(id));
        let in_flight = ctx.load(id);
        let assignments = ctx.state.assignments(id);
        let primary = overlap.saturating_add(cfg.sticky_bonus.saturating_mul(sticky));
        let key = (
            primary,
            sticky,
            Reverse(in_flight),
            Reverse(assignments),
            Reverse(id),
        );
        if best.as_ref().is_none_or(|b| key > *b) {
            best = Some(key);
        }
        let mut e = ScoreEntry::new(id, ctx.d_role())
            .with("overlap", overlap as f64)
            .with("sticky_bonus", (cfg.sticky_bonus * sticky) as f64)
            .with("sticky", sticky as f64)
            .with("in_flight", f64::from(in_flight))
            .with("assignments", assignments as f64);
        e.total = primary as f64;
        scores.push(e);
    }
    let d = best.map_or(WorkerId(0), |k| k.4.0);
    (d, depths[d.0 as usize])
}

pub(crate) fn route(cfg: &KvAwareV0Config, ctx: &Ctx<'_>) -> Result<Decision, PolicyError> {
    ctx.require_d()?;
    let knobs = Knobs::new(cfg.incremental_footprint, cfg.backpressure);
    let session = ctx.session();
    let pinned = session.and_then(|s| s.current_d);
    let mut scores = ctx.score_list();
    let (best, best_depth) = pick(ctx, cfg, pinned, &mut scores);
    if ctx.colocated {
        let cached = ctx.reusable(best_depth, cfg.block_size);
        return Ok(ctx.finish(Plan::colocated(best, cached, scores), knobs));
    }
    let reject_count = match (ctx.req.rejected_by, ctx.req.session) {
        (Some(r), Some(_)) => Some((r, session.map_or(1, |s| s.rejects_after(r)))),
        _ => None,
    };
    let (mode, reason) = match ctx.classify(cfg.direct_limit_tokens, cfg.block_size, false) {
        TurnClass::Direct {
            decode,
            cached_tokens,
        } => {
            let plan = Plan::direct(decode, cached_tokens, scores, reject_count);
            return Ok(ctx.finish(plan, knobs));
        }
        TurnClass::FirstTurn => (ExecutionMode::Turn1Seed, None),
        TurnClass::FallThrough { reason, .. } => (ExecutionMode::Fallback, Some(reason)),
    };
    let chosen_p = prefill::choose(ctx, cfg.prefill, best, cfg.block_size, &mut scores)?;
    let plan = Plan::p_to_d((mode, reason), best, chosen_p, scores, reject_count);
    Ok(ctx.finish(plan, knobs))
}
