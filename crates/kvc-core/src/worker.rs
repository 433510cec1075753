//! The state of a worker as a router sees it.

use crate::names::Health;
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
