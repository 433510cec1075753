//! `kvc`: the default policy. It keeps `kvc-v2`'s decision procedure (strict stickiness of
//! resident sessions, the hard cap, migration after repeated rejects with the counter reset by
//! every successful direct-to-D turn, the 8,192-token direct limit, the incremental footprint)
//! and changes where a session is *placed* — on its first turn, after an eviction, and when it
//! migrates:
//!
//! - **active-session term**: each session active on a D (resident there and routed within
//!   `active-window-ms`) costs `active-weight`. Those sessions decode alongside the new one and
//!   will grow into the same pool; co-locating active sessions is what later forces D to evict
//!   one of them (a `session-evicted` fall-through through P) and slows every decode step.
//!   Where the hosts' KV pools differ, a session active on a host costs `active-weight` times
//!   the largest host pool over that host's pool (`pool_scale`): a pool a tenth the size fills
//!   with a tenth of the sessions. Placed by the count alone, a decode engine cut to a couple of
//!   sessions beside a prefill engine with room for all of them (the prefill engine serving
//!   turns alone too) took as many new sessions as the large pool and evicted them from each
//!   other.
//! - **weak stickiness for non-resident sessions**: a session that lost its KV does not get a
//!   large bonus to return to the D that evicted it (`sticky-weight` 0.5 instead of 2.0); the
//!   old D is usually still the fullest.
//! - **stronger capacity and load terms** (`capacity-weight` 5, `load-weight` 0.5): place by
//!   committed memory and queue rather than by overlap.
//!
//! - **who prefills** (`local-prefill`, [`LocalPrefillConfig`]): where workers can serve a
//!   turn alone ([`kvc_core::Capabilities::local`]), a turn that is not direct-to-D is either
//!   prefilled by its host itself (`local-prefill`) or goes P→D, whichever has the lower
//!   expected cost (queue ahead, prefill work, transfer, the stall of the prefilling worker's
//!   decode batch); a session being placed also pays `ttft-weight` per second of its host's
//!   cheapest path, and the active-session weight is `local-prefill.active-weight` then.
//!   Without such workers (a router's default views) nothing of this applies.
//!
//! - **subagents** (`subagent-placement`): the first turn of a session spawned by another
//!   ([`crate::RouteRequest::parent`]) goes direct-to-D on the parent's D when the parent is
//!   resident there, that D is healthy, takes direct turns and is at or below the hard cap,
//!   holds some of the prompt (the shared system prompt, the parent's context), and what it
//!   does not hold is within the direct limit and fits its room: an append, not a seed.
//! - **compaction** (`compaction`): a later turn whose prompt is a compaction of the
//!   session's last one ([`crate::is_compaction`]) and whose uncached part is over the direct
//!   limit falls through as `compacted` and is placed as a fresh seed (by score, the weak
//!   sticky term only), not held to its D; the session's stale blocks leave the live view.
//!   Within the limit it stays direct-to-D, the cheapest path.
//!
//! - **migration with KV** (`migrate-with-kv`, off by default): a session that moves to
//!   another D (migrated, over the hard cap, its D unhealthy or draining) is prefilled by the
//!   worker that holds it, when that worker sends KV ([`kvc_core::Capabilities::send_kv`]) and
//!   is draining, or healthy and not over the hard cap, and the new D has room for it now
//!   (`migrate-kv`): only the new tokens are computed, and the new D pulls the whole KV.
//!
//! `docs/kvc-policy.md` has the measurements behind each part (ablations on the generated SWE
//! traces and the public Mooncake trace).
//!
//! Score of a candidate D, highest wins:
//!
//! ```text
//! total = overlap_weight  × min(overlap, overlap_cap_blocks) / overlap_cap_blocks
//!       + sticky_weight   × [D is the session's current D]
//!       − capacity_weight × committed_fraction(D)
//!       − load_weight     × (in_flight(D) + queue_depth(D))
//!       − active_weight   × active_sessions(D) × largest host pool / pool(D)
//!       − ttft_weight     × cost of D's cheapest path      (local prefill; placement only)
//! ```

use crate::backpressure::BackpressureConfig;
use crate::decision::Decision;
use crate::error::PolicyError;
use crate::kvc_v2::{KvcV2Config, Placement, route_with};
use crate::local::LocalPrefillConfig;
use crate::route::Ctx;
use kvc_core::{BlockSize, PrefillPolicy};
use serde::{Deserialize, Serialize};

/// Configuration of `kvc`.
///
/// | field | default |
/// |---|---|
/// | `direct-limit-tokens` | 8,192 |
/// | `hard-cap` | 0.85 (committed fraction) |
/// | `migrate-after-rejects` | 3 |
/// | `overlap-cap-blocks` | 16 |
/// | `overlap-weight` | 1.0 |
/// | `sticky-weight` | 0.5 |
/// | `capacity-weight` | 5.0 |
/// | `load-weight` | 0.5 |
/// | `active-weight` | 0.5 |
/// | `active-window-ms` | 30,000 |
/// | `incremental-footprint` | `true` |
/// | `prefill` | `d-health-aware` |
/// | `backpressure` | disabled |
/// | `block-size` | 512 |
/// | `local-prefill` | on ([`LocalPrefillConfig`]) |
/// | `subagent-placement` | `true` |
/// | `compaction` | `true` |
/// | `migrate-with-kv` | `false` |
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct KvcConfig {
    /// Largest uncached append (tokens) that may go direct-to-D.
    pub direct_limit_tokens: u64,
    /// Committed fraction above which a D is skipped while another is at or below it.
    pub hard_cap: f64,
    /// Rejects of a session on a D (no successful direct-to-D turn in between) that trigger
    /// migration. At least 1.
    pub migrate_after_rejects: u32,
    /// Overlap (blocks) beyond which more overlap adds nothing. At least 1.
    pub overlap_cap_blocks: u32,
    /// Weight of the capped overlap.
    pub overlap_weight: f64,
    /// Bonus of the session's last D when it is not resident anywhere.
    pub sticky_weight: f64,
    /// Penalty per unit of committed fraction.
    pub capacity_weight: f64,
    /// Penalty per request in flight or queued.
    pub load_weight: f64,
    /// Penalty per session active on the D.
    pub active_weight: f64,
    /// A session routed within this many milliseconds (and still resident) is active.
    pub active_window_ms: u64,
    /// Use `max(0, input − cached) + output` for later turns.
    pub incremental_footprint: bool,
    /// How P is chosen.
    pub prefill: PrefillPolicy,
    /// Backpressure hint parameters.
    pub backpressure: BackpressureConfig,
    /// Tokens per block of `hash_ids`.
    pub block_size: BlockSize,
    /// Who prefills a turn that is not direct-to-D where workers can serve turns alone
    /// (`local-prefill` turns, P→D chosen by expected cost): the `local-prefill` table,
    /// [`crate::LocalPrefillConfig`].
    pub local_prefill: LocalPrefillConfig,
    /// Place a subagent's first turn direct-to-D on its parent's D when the parent is resident
    /// there, that D is healthy, takes direct turns, is at or below the hard cap and holds some
    /// of the prompt, and what it does not hold is within the direct limit and fits its room.
    pub subagent_placement: bool,
    /// Recognise compacted turns: reason `compacted`, placed as a fresh seed.
    pub compaction: bool,
    /// A session that moves to another decode worker (migration, its D over the hard cap,
    /// unhealthy or draining) takes its KV along where the worker holding it sends its
    /// sessions' KV (capability `send-kv`) and is draining, or healthy and not over the hard
    /// cap (one over it is short of memory): that worker is the turn's P, computing only the
    /// new tokens, and the new D pulls the KV (`migrate-kv`).
    pub migrate_with_kv: bool,
}

impl Default for KvcConfig {
    fn default() -> Self {
        KvcConfig {
            direct_limit_tokens: 8_192,
            hard_cap: 0.85,
            migrate_after_rejects: 3,
            overlap_cap_blocks: 16,
            overlap_weight: 1.0,
            sticky_weight: 0.5,
            capacity_weight: 5.0,
            load_weight: 0.5,
            active_weight: 0.5,
            active_window_ms: 30_000,
            incremental_footprint: true,
            prefill: PrefillPolicy::DHealthAware,
            backpressure: BackpressureConfig::DISABLED,
            block_size: BlockSize::default(),
            local_prefill: LocalPrefillConfig::default(),
            subagent_placement: true,
            compaction: true,
            migrate_with_kv: false,
        }
    }
}

impl KvcConfig {
    /// The v2 part of the configuration.
    fn v2(&self) -> KvcV2Config {
        KvcV2Config {
            direct_limit_tokens: self.direct_limit_tokens,
            hard_cap: self.hard_cap,
            migrate_after_rejects: self.migrate_after_rejects,
            overlap_cap_blocks: self.overlap_cap_blocks,
            overlap_weight: self.overlap_weight,
            sticky_weight: self.sticky_weight,
            capacity_weight: self.capacity_weight,
            load_weight: self.load_weight,
            incremental_footprint: self.incremental_footprint,
            prefill: self.prefill,
            backpressure: self.backpressure,
            block_size: self.block_size,
        }
    }

    /// Checks the values are in range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        self.v2().validate().map_err(|e| match e {
            PolicyError::InvalidConfig { detail, .. } => PolicyError::InvalidConfig {
                policy: "kvc",
                detail,
            },
            other => other,
        })?;
        if !(self.active_weight.is_finite() && self.active_weight >= 0.0) {
            return Err(PolicyError::InvalidConfig {
                policy: "kvc",
                detail: "active-weight must be a finite number ≥ 0",
            });
        }
        self.local_prefill.validate("kvc")
    }
}

pub(crate) fn route(cfg: &KvcConfig, ctx: &Ctx<'_>) -> Result<Decision, PolicyError> {
    let placement = Placement {
        active_weight: cfg.active_weight,
        active_window_ms: cfg.active_window_ms,
        local: cfg.local_prefill,
        subagents: cfg.subagent_placement,
        compaction: cfg.compaction,
        migrate_kv: cfg.migrate_with_kv,
    };
    route_with(&cfg.v2(), Some(placement), ctx)
}
