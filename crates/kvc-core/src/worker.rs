//! The state of a worker as a router sees it.

use crate::names::{Health, WorkerRole};
use serde::{Deserialize, Serialize};

/// A worker's KV pool and load, as published by the worker (or modelled by the simulator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct WorkerState {
    /// Size of the KV pool, in tokens.
    pub capacity_tokens: u64,
    /// Tokens occupied (resident sessions, running requests, reservations, cached blocks).
    pub used_tokens: u64,
    /// Of the used tokens, how many could be freed by evicting idle entries.
    pub evictable_tokens: u64,
    /// Requests (or transfers) waiting for the worker.
    pub queue_depth: u32,
    /// Requests running on the worker.
    pub in_flight: u32,
    /// Sessions whose KV is resident on the worker.
    pub resident_sessions: u32,
    /// Health as last judged by the router.
    pub health: Health,
    /// Age of this state in milliseconds when it was read.
    pub state_age_ms: u64,
}

impl WorkerState {
    /// An idle, healthy, empty worker with `capacity_tokens` of KV.
    pub fn empty(capacity_tokens: u64) -> Self {
        WorkerState {
            capacity_tokens,
            used_tokens: 0,
            evictable_tokens: 0,
            queue_depth: 0,
            in_flight: 0,
            resident_sessions: 0,
            health: Health::Healthy,
            state_age_ms: 0,
        }
    }

    /// Tokens not used at all.
    pub fn free_tokens(&self) -> u64 {
        self.capacity_tokens.saturating_sub(self.used_tokens)
    }

    /// Tokens that could be had: free plus evictable.
    pub fn available_tokens(&self) -> u64 {
        self.free_tokens()
            .saturating_add(self.evictable_tokens)
            .min(self.capacity_tokens)
    }

    /// Used tokens that eviction cannot reclaim (`used − evictable`).
    pub fn committed_tokens(&self) -> u64 {
        self.used_tokens.saturating_sub(self.evictable_tokens)
    }

    /// Committed fraction of the pool in `[0, 1]` (1 for a zero-capacity pool): the share held
    /// by running work and reservations, not by idle entries that could be evicted.
    pub fn committed_fraction(&self) -> f64 {
        if self.capacity_tokens == 0 {
            1.0
        } else {
            (self.committed_tokens() as f64 / self.capacity_tokens as f64).min(1.0)
        }
    }

    /// Used fraction of the pool in `[0, 1]` (1 for a zero-capacity pool).
    pub fn used_fraction(&self) -> f64 {
        if self.capacity_tokens == 0 {
            1.0
        } else {
            (self.used_tokens as f64 / self.capacity_tokens as f64).min(1.0)
        }
    }
}

/// What a worker's engine can do, whatever its role. The role says what a worker is for in a
/// topology; the capabilities say which paths a policy may plan through it.
///
/// | worker | `prefill` | `decode` | `local` | `send-kv` |
/// |---|:-:|:-:|:-:|:-:|
/// | prefill worker | ✓ | | | |
/// | decode worker (stock SGLang, or any engine by default) | | ✓ | | |
/// | decode worker that serves plain requests (vLLM) | | ✓ | ✓ | |
/// | decode worker whose connector also sends (vLLM NixlConnector) | | ✓ | ✓ | ✓ |
/// | prefill worker that may host sessions (vLLM) | ✓ | | ✓ | |
/// | all-capable worker | ✓ | ✓ | ✓ | ✓ |
///
/// A worker *hosts sessions* (their KV stays resident between turns) when it can decode
/// transferred KV or serve turns alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct Capabilities {
    /// Prefills prompts for other workers and ships their KV (the prefill side of P→D).
    pub prefill: bool,
    /// Receives KV from a prefill worker and decodes it (the decode side of P→D).
    pub decode: bool,
    /// Serves a turn alone: prefills whatever of the prompt it does not hold, decodes, and
    /// keeps the session resident. A vLLM instance of any role does; a stock SGLang decode
    /// server does not (it answers 400 without a bootstrap room).
    pub local: bool,
    /// Sends a session it holds to another worker with its KV: prefills the session's next
    /// turn from its cache and ships the KV, as the prefill side of P→D for its own sessions
    /// only (a policy's `migrate-kv`; it is not a prefill worker for others' turns). A vLLM
    /// engine with NixlConnector does, whatever its `kv_role`.
    pub send_kv: bool,
}

impl Capabilities {
    /// What a worker of `role` does by default: a prefill worker prefills for others, a
    /// decode worker decodes transferred KV, a colocated worker serves its requests alone.
    /// Serving turns alone on a P/D worker is never assumed: it is declared.
    pub fn of_role(role: WorkerRole) -> Self {
        match role {
            WorkerRole::Prefill => Capabilities {
                prefill: true,
                ..Capabilities::default()
            },
            WorkerRole::Decode => Capabilities {
                decode: true,
                ..Capabilities::default()
            },
            WorkerRole::Colocated => Capabilities {
                local: true,
                ..Capabilities::default()
            },
        }
    }

    /// Every capability: prefills for others, decodes transferred KV, serves turns alone.
    pub const ALL: Capabilities = Capabilities {
        prefill: true,
        decode: true,
        local: true,
        send_kv: true,
    };

    /// The same capabilities plus serving turns alone.
    pub fn with_local(self) -> Self {
        Capabilities {
            local: true,
            ..self
        }
    }

    /// The same capabilities plus sending its sessions' KV.
    pub fn with_send_kv(self) -> Self {
        Capabilities {
            send_kv: true,
            ..self
        }
    }

    /// Whether sessions can stay resident on the worker between turns: it decodes
    /// transferred KV or serves turns alone.
    pub fn hosts_sessions(self) -> bool {
        self.decode || self.local
    }
}
