//! The modelled cluster: its construction, and what it tells of each worker's state.

use super::cache::PrefixCache;
use super::profile::Profile;
use super::types::{EngineOptions, Event, Micros, Wake, micros};
use super::worker::{Active, Iteration, Worker};
use kvc_core::HashIds;
use kvc_core::{Capabilities, Health, SessionId, WorkerId, WorkerRole, WorkerState};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// Jobs by id, with a fixed (unseeded) hash.
pub(super) type JobMap = HashMap<usize, Active, foldhash::fast::FixedState>;

/// The modelled cluster.
#[derive(Debug)]
pub struct Engine {
    pub(super) profile: Profile,
    pub(super) opts: EngineOptions,
    pub(super) workers: Vec<Worker>,
    /// Jobs by id; looked up for every job of every iteration, never iterated (so their
    /// order cannot reach an output).
    pub(super) jobs: JobMap,
    /// (P, D) pairs whose transfer session P holds for dead, until when.
    pub(super) failed_pairs: BTreeMap<(WorkerId, WorkerId), Micros>,
    pub(super) events: Vec<Event>,
    pub(super) wakes: Vec<(Micros, Wake)>,
    pub(super) jitter_state: u64,
    pub(super) jitter: f64,
    /// Emptied lists of an ended iteration, reused by the next one that starts.
    pub(super) spare: Iteration,
}

impl Engine {
    /// A cluster of `roles.len()` workers (ids are indices), each with the profile's KV pool
    /// and the capabilities of its role ([`Capabilities::of_role`]).
    /// `jitter` (fraction, e.g. 0.03) perturbs iteration times deterministically from `seed`.
    pub fn new(
        profile: Profile,
        opts: EngineOptions,
        roles: &[WorkerRole],
        seed: u64,
        jitter: f64,
    ) -> Self {
        let layout: Vec<(WorkerRole, Capabilities)> = roles
            .iter()
            .map(|r| (*r, Capabilities::of_role(*r)))
            .collect();
        Self::with_layout(profile, opts, &layout, seed, jitter)
    }

    /// A cluster of workers with declared capabilities (ids are indices; see
    /// [`kvc_core::Topology::layout`]). A worker that hosts sessions
    /// ([`Capabilities::hosts_sessions`], colocated workers aside) keeps them resident as a
    /// decode worker does; one that also prefills for others keeps the prefix cache of that
    /// work in the same pool.
    pub fn with_layout(
        profile: Profile,
        opts: EngineOptions,
        layout: &[(WorkerRole, Capabilities)],
        seed: u64,
        jitter: f64,
    ) -> Self {
        let capacity = profile.hardware.kv_pool_tokens;
        let workers = layout
            .iter()
            .map(|(role, caps)| Worker {
                hosts: *role != WorkerRole::Colocated && caps.hosts_sessions(),
                capacity,
                cache: PrefixCache::default(),
                cache_extra: 0,
                residents: BTreeMap::new(),
                resident_tokens: 0,
                idle_tokens: 0,
                prefill_q: VecDeque::new(),
                waiting: VecDeque::new(),
                running: Vec::new(),
                iteration: None,
                settling: false,
                link_free: 0,
                token_ratio: profile.fit.pressure.init_new_token_ratio,
                recomputes: caps.prefill || caps.local,
                host_backup: 0,
            })
            .collect();
        Engine {
            profile,
            opts,
            workers,
            jobs: JobMap::default(),
            failed_pairs: BTreeMap::new(),
            events: Vec::new(),
            wakes: Vec::new(),
            jitter_state: seed ^ 0x9e37_79b9_7f4a_7c15,
            jitter,
            spare: Iteration::default(),
        }
    }

    /// The profile in use.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Takes the events produced since the last call.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// Takes the wake-ups requested since the last call.
    pub fn take_wakes(&mut self) -> Vec<(Micros, Wake)> {
        std::mem::take(&mut self.wakes)
    }

    /// Tokens in one block.
    pub(super) fn block_tokens(&self) -> u64 {
        u64::from(self.opts.block_size.tokens())
    }

    /// The state a router sees of worker `w`.
    pub fn state(&self, w: WorkerId) -> WorkerState {
        let wk = &self.workers[w.0 as usize];
        let block = self.block_tokens();
        // One pool: resident sessions (workers that host them) and the prefix cache of the
        // prefills a worker runs (for others, or for itself when colocated).
        let used = wk.resident_tokens + wk.cache.len() as u64 * block + wk.cache_extra;
        let evictable = wk.idle_tokens + wk.cache.evictable() as u64 * block;
        WorkerState {
            capacity_tokens: wk.capacity,
            used_tokens: used,
            evictable_tokens: evictable,
            queue_depth: (wk.prefill_q.len() + wk.waiting.len()) as u32,
            in_flight: (wk.running.len() + wk.prefill_q.len()) as u32,
            resident_sessions: wk.residents.len() as u32,
            health: Health::Healthy,
            state_age_ms: 0,
        }
    }

    /// Tokens of `session` resident on decode worker `w`.
    pub fn resident_tokens(&self, w: WorkerId, session: SessionId) -> Option<u64> {
        self.workers[w.0 as usize]
            .residents
            .get(&session)
            .map(|r| r.tokens)
    }

    /// Sessions resident on worker `w`: (session, tokens, last access, busy), by session id;
    /// busy sessions (a job running there, or with `pin_in_flight` a request in flight) are
    /// not idle.
    pub fn residents(&self, w: WorkerId) -> Vec<(SessionId, u64, Micros, bool)> {
        self.workers[w.0 as usize]
            .residents
            .iter()
            .map(|(s, r)| (*s, r.tokens, r.last_access, !r.idle()))
            .collect()
    }

    /// Sessions resident on worker `w` with their tokens and the block ids of the prompt whose
    /// KV they hold, by session id.
    pub fn resident_blocks(&self, w: WorkerId) -> Vec<(SessionId, u64, HashIds)> {
        self.workers[w.0 as usize]
            .residents
            .iter()
            .map(|(s, r)| (*s, r.tokens, r.hashes.clone()))
            .collect()
    }

    /// Number of workers.
    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// Used fraction of every worker's pool, by worker index.
    pub fn occupancy(&self) -> Vec<f64> {
        (0..self.workers.len())
            .map(|i| self.state(WorkerId(i as u32)).used_fraction())
            .collect()
    }

    /// Committed fraction of every worker's pool (what eviction cannot reclaim), by index.
    pub fn committed(&self) -> Vec<f64> {
        (0..self.workers.len())
            .map(|i| self.state(WorkerId(i as u32)).committed_fraction())
            .collect()
    }

    pub(super) fn jittered(&mut self, seconds: f64) -> Micros {
        if self.jitter <= 0.0 {
            return micros(seconds);
        }
        // splitmix64 step → uniform in [-1, 1).
        self.jitter_state = self.jitter_state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.jitter_state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let u = (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
        micros(seconds * (1.0 + self.jitter * u))
    }
}
