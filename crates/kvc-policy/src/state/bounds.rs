//! How much the routing state may hold: `StateBounds` and the reservation rule of its tables.

use kvc_core::BlockSize;
use serde::{Deserialize, Serialize};

#[cfg(doc)]
use crate::{RouterState, SessionRoute};

/// How much a [`RouterState`] may hold besides its sessions (which the caller bounds, with
/// [`RouterState::forget_session`]). `docs/kvc-policy.md` ("Memory and cost") gives the cost of
/// each entry.
///
/// Serialized in kebab-case; absent fields take the defaults below.
///
/// | field | default |
/// |---|---|
/// | `blocks-per-worker` | none: derived from each worker's pool |
/// | `pool-multiple` | 4 |
/// | `fallback-blocks-per-worker` | 4,096 |
/// | `max-pending` | 65,536 |
/// | `max-session-blocks` | 256 |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct StateBounds {
    /// Blocks the block view keeps per worker, in each of its two views (grow-only and live);
    /// past it the worker's least recently used blocks leave. `None`: `pool-multiple` times the
    /// worker's pool in blocks (its published `capacity_tokens` over the policy's block size,
    /// rounded up) for workers whose capacity is known when the state is created, otherwise
    /// `fallback-blocks-per-worker`.
    pub blocks_per_worker: Option<u32>,
    /// How many pools' worth of blocks a worker keeps when the bound is derived (at least 1).
    pub pool_multiple: u32,
    /// Blocks per worker and view when the bound is derived but the pool is unknown (capacity
    /// 0, or a worker absent when the state was created).
    pub fallback_blocks_per_worker: u32,
    /// Decisions applied and not yet completed that the state tracks; past it the oldest is
    /// released as if it had completed (its in-flight counts drop, its session is untouched).
    pub max_pending: u32,
    /// Leading blocks of a session's last request the state keeps (in [`SessionRoute::blocks`]
    /// and in the live block view); the rest are counted
    /// ([`RouterState::dropped_session_blocks`]) and not kept. A turn that extends the whole
    /// last request is still recognised as such (its reuse is exact); a turn that diverges
    /// past the kept blocks is credited with the kept blocks only.
    pub max_session_blocks: u32,
}

impl Default for StateBounds {
    fn default() -> Self {
        StateBounds {
            blocks_per_worker: None,
            pool_multiple: 4,
            fallback_blocks_per_worker: 4_096,
            max_pending: 65_536,
            max_session_blocks: 256,
        }
    }
}

impl StateBounds {
    /// The per-view block bound of a worker with a pool of `capacity_tokens` (0: unknown).
    pub fn blocks_for(&self, capacity_tokens: u64, block_size: BlockSize) -> u32 {
        if let Some(n) = self.blocks_per_worker {
            return n;
        }
        if capacity_tokens == 0 {
            return self.fallback_blocks_per_worker;
        }
        let pool = block_size.blocks_for(capacity_tokens);
        u32::try_from(pool.saturating_mul(u64::from(self.pool_multiple.max(1)))).unwrap_or(u32::MAX)
    }
}

/// The most entries [`RouterState::reserve_sessions`] (and the pending table, for
/// [`StateBounds::max_pending`]) reserves up front.
pub const MAX_RESERVED: usize = 1 << 22;

/// Entries reserved for a table kept at `bound`: twice the bound, at most [`MAX_RESERVED`].
pub fn reserved(bound: usize) -> usize {
    bound.saturating_mul(2).min(MAX_RESERVED)
}
