//! The block index: which worker holds which block, keyed by kvc's own chained hash.
//!
//! Per worker, a flat map *engine hash → entry* (`own key`, a store stamp, a session handle):
//! the engine's hash is kept only to resolve the parent of a later `BlockStored` and the blocks
//! a `BlockRemoved` names. Across workers, one flat map per group of 64 workers
//! *own key → bitset of the workers holding it*, so a request's overlap with every worker is one
//! walk down its chain of keys ([`KvIndex::overlap`]).
//!
//! Rules:
//! - A `BlockStored` is indexed only if its medium is GPU (or absent), it names no LoRA adapter,
//!   its block size is the worker's and it carries exactly `blocks × block_size` tokens;
//!   otherwise its blocks are counted as `skipped` (other medium or adapter) or `invalid`.
//!   Its keys chain from the own key of its parent; a parent the worker does not hold makes
//!   the whole event `unknown_parent` (a chain cannot be rebuilt without its start).
//! - A `BlockRemoved` from a medium other than GPU changes nothing (`skipped`); a removed hash
//!   the worker does not hold counts as `unknown_removal`.
//! - `AllBlocksCleared` empties the worker ([`KvIndex::clear`]).
//! - Bound: a worker never holds more than its pool's block count ([`WorkerSpec`]). A store
//!   into a full worker first drops its oldest entries — the `⌈capacity / 32⌉` least recently
//!   stored — counted as `dropped`. (A full index means removals were missed: the engine itself
//!   never holds more than its pool.)
//! - Sessions: a block stored with a `session_id` counts toward that session's residency on
//!   the worker ([`KvIndex::session_residency`]) until it is removed, dropped or cleared.
//!   Session strings map to [`SessionId`] by [`SessionId::from_key`], the router's own rule.
//! - Data-parallel ranks: an engine running several data-parallel ranks has one publisher
//!   (and one prefix cache) per rank, so the index keeps each rank of a worker apart, with
//!   its own pool bound ([`KvIndex::add_rank`], [`KvIndex::apply_rank`]). A method that
//!   takes only a [`WorkerId`] to change or read one worker's blocks addresses its rank 0
//!   (an engine without data parallelism). The answers a policy reads per worker —
//!   [`KvIndex::overlap`], [`KvIndex::overlap_tokens`], [`KvIndex::session_residency`] —
//!   give each worker its best rank's count (a request served by one rank reuses that
//!   rank's cache only); [`KvIndex::overlap_ranks`] and [`KvIndex::session_residency_ranks`]
//!   answer per rank, so a session's residency names the rank that holds it.
//!
//! Memory: a worker's map costs `(8 + 16) × 5/4 = 30` bytes per entry when full and the
//! group map `(8 + 8) × 5/4 = 20` bytes per distinct key (both tables are capped at the slots
//! their bound needs), so an index whose workers are full costs at most 50 bytes per indexed
//! block, less where workers share blocks ([`KvIndex::memory_bytes`] measures it; while the
//! tables are still growing a block may cost up to twice as much).

mod table;

use crate::chain::{BlockKey, KeyHasher};
use crate::event::{BlockRemoved, BlockStored, EngineHash, Event, resident_on_gpu};
use kvc_core::{BlockSize, SessionId, WorkerId};
use std::collections::HashMap;
use table::FlatMap;
use thiserror::Error;

/// Workers per group map (one bit each in a `u64`).
const GROUP: usize = 64;

/// What the index must know about a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerSpec {
    /// The engine's block (page) size: events and requests are chained in it.
    pub block_size: BlockSize,
    /// The engine's pool size in blocks: the most blocks the index holds for the worker.
    pub capacity_blocks: u32,
}

/// A call the index refuses.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IndexError {
    /// The worker was never added.
    #[error("worker {0} is not in the index")]
    UnknownWorker(WorkerId),
    /// The worker was added before.
    #[error("worker {0} is already in the index")]
    DuplicateWorker(WorkerId),
    /// That data-parallel rank (above 0) of the worker was never added.
    #[error("worker {0} rank {1} is not in the index")]
    UnknownRank(WorkerId, u32),
    /// That data-parallel rank (above 0) of the worker was added before.
    #[error("worker {0} rank {1} is already in the index")]
    DuplicateRank(WorkerId, u32),
    /// A pool of zero blocks.
    #[error("worker {0}: capacity must be at least one block")]
    ZeroCapacity(WorkerId),
}

/// What one event did to the index, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks stored (new, or stored again and so refreshed).
    pub stored: u64,
    /// Blocks removed.
    pub removed: u64,
    /// Blocks of stores whose parent the worker does not hold (not indexed).
    pub unknown_parent: u64,
    /// Removed hashes the worker does not hold.
    pub unknown_removal: u64,
    /// Blocks not in the GPU pool or computed with a LoRA adapter (not indexed).
    pub skipped: u64,
    /// Blocks of malformed stores: wrong block size or token count (not indexed).
    pub invalid: u64,
    /// Entries dropped to keep the worker within its capacity.
    pub dropped: u64,
    /// Whether the event cleared the worker.
    pub cleared: bool,
}

impl ApplyOutcome {
    /// Unknown parents plus unknown removals: blocks an event named that the index never saw.
    pub fn unknown(&self) -> u64 {
        self.unknown_parent + self.unknown_removal
    }
}

impl std::ops::AddAssign for ApplyOutcome {
    fn add_assign(&mut self, o: Self) {
        self.stored += o.stored;
        self.removed += o.removed;
        self.unknown_parent += o.unknown_parent;
        self.unknown_removal += o.unknown_removal;
        self.skipped += o.skipped;
        self.invalid += o.invalid;
        self.dropped += o.dropped;
        self.cleared |= o.cleared;
    }
}

/// How many leading blocks of a request one worker holds (its best data-parallel rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerOverlap {
    /// The worker.
    pub worker: WorkerId,
    /// The data-parallel rank holding them (the lowest on a tie; 0 for an engine without
    /// data parallelism, or when no rank holds any).
    pub rank: u32,
    /// Leading blocks of the request the worker holds.
    pub blocks: usize,
    /// The tokens those blocks cover (`blocks × the worker's block size`).
    pub tokens: u64,
}

/// One indexed block of one worker (engine hash → own key).
#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    key: u64,
    stamp: u32,
    /// 0: no session; else a handle into [`Sessions`] (index + 1).
    session: u32,
}

#[derive(Debug)]
struct WorkerIndex {
    id: WorkerId,
    rank: u32,
    spec: WorkerSpec,
    entries: FlatMap<Entry>,
    /// Own keys held by more than one entry of this worker, with the extra count.
    dups: HashMap<u64, u32>,
    next_stamp: u32,
}

#[derive(Debug, Default)]
struct SessionSlot {
    id: Option<SessionId>,
    /// (worker-rank slot, blocks), only non-zero counts.
    per_worker: Vec<(u32, u32)>,
}

#[derive(Debug, Default)]
struct Sessions {
    handles: HashMap<SessionId, u32>,
    slots: Vec<SessionSlot>,
    free: Vec<u32>,
    /// A handle a store is using: kept even while it counts no block.
    pinned: u32,
}

impl Sessions {
    fn handle(&mut self, id: SessionId) -> u32 {
        if let Some(h) = self.handles.get(&id) {
            return *h;
        }
        let h = match self.free.pop() {
            Some(h) => h,
            None => {
                self.slots.push(SessionSlot::default());
                self.slots.len() as u32
            }
        };
        self.slots[(h - 1) as usize].id = Some(id);
        self.handles.insert(id, h);
        h
    }

    fn add(&mut self, h: u32, worker: u32) {
        let slot = &mut self.slots[(h - 1) as usize];
        match slot.per_worker.iter_mut().find(|(w, _)| *w == worker) {
            Some((_, n)) => *n += 1,
            None => slot.per_worker.push((worker, 1)),
        }
    }

    fn sub(&mut self, h: u32, worker: u32) {
        let Some(slot) = self.slots.get_mut((h - 1) as usize) else {
            return;
        };
        if let Some(pos) = slot.per_worker.iter().position(|(w, _)| *w == worker) {
            slot.per_worker[pos].1 -= 1;
            if slot.per_worker[pos].1 == 0 {
                slot.per_worker.swap_remove(pos);
            }
        }
        if h != self.pinned {
            self.release_if_empty(h);
        }
    }

    /// Frees a handle that counts no block.
    fn release_if_empty(&mut self, h: u32) {
        let Some(slot) = self.slots.get_mut((h - 1) as usize) else {
            return;
        };
        if slot.per_worker.is_empty()
            && let Some(id) = slot.id.take()
        {
            self.handles.remove(&id);
            slot.per_worker = Vec::new();
            self.free.push(h);
        }
    }

    fn bytes(&self) -> usize {
        self.handles.capacity() * 16
            + self.slots.capacity() * std::mem::size_of::<SessionSlot>()
            + self
                .slots
                .iter()
                .map(|s| s.per_worker.capacity() * 8)
                .sum::<usize>()
            + self.free.capacity() * 4
    }
}

/// Blocks held per worker (and data-parallel rank), keyed by kvc's chained hash (see the
/// module doc).
#[derive(Debug, Default)]
pub struct KvIndex {
    /// One per (worker, rank), in the order added.
    workers: Vec<WorkerIndex>,
    by_id: HashMap<(WorkerId, u32), usize>,
    groups: Vec<FlatMap<u64>>,
    sessions: Sessions,
    hasher: KeyHasher,
}

impl KvIndex {
    /// An index with no workers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a worker (its rank 0). Workers keep the order they were added in every answer.
    pub fn add_worker(&mut self, id: WorkerId, spec: WorkerSpec) -> Result<(), IndexError> {
        self.add_rank(id, 0, spec)
    }

    /// Adds data-parallel rank `rank` of worker `id`, with that rank's pool. A worker's ranks
    /// may be added in any order; the worker keeps the place its first rank was added at.
    pub fn add_rank(
        &mut self,
        id: WorkerId,
        rank: u32,
        spec: WorkerSpec,
    ) -> Result<(), IndexError> {
        if self.by_id.contains_key(&(id, rank)) {
            return Err(if rank == 0 {
                IndexError::DuplicateWorker(id)
            } else {
                IndexError::DuplicateRank(id, rank)
            });
        }
        if spec.capacity_blocks == 0 {
            return Err(IndexError::ZeroCapacity(id));
        }
        let slot = self.workers.len();
        self.workers.push(WorkerIndex {
            id,
            rank,
            spec,
            entries: FlatMap::new(spec.capacity_blocks as usize),
            dups: HashMap::new(),
            next_stamp: 0,
        });
        self.by_id.insert((id, rank), slot);
        if slot / GROUP >= self.groups.len() {
            self.groups.push(FlatMap::new(0));
        }
        self.update_group_limit(slot / GROUP);
        Ok(())
    }

    /// The workers (their rank 0), in the order they were added.
    pub fn workers(&self) -> impl Iterator<Item = (WorkerId, WorkerSpec)> + '_ {
        self.workers
            .iter()
            .filter(|w| w.rank == 0)
            .map(|w| (w.id, w.spec))
    }

    /// Every (worker, data-parallel rank) with its spec, in the order added.
    pub fn ranks(&self) -> impl Iterator<Item = (WorkerId, u32, WorkerSpec)> + '_ {
        self.workers.iter().map(|w| (w.id, w.rank, w.spec))
    }

    /// Whether rank `rank` of worker `id` is in the index.
    pub fn has_rank(&self, id: WorkerId, rank: u32) -> bool {
        self.by_id.contains_key(&(id, rank))
    }

    /// Changes a worker's pool size (its engine reported a new one); drops the oldest
    /// entries if it now holds more. Returns the entries dropped.
    pub fn set_capacity(&mut self, id: WorkerId, capacity_blocks: u32) -> Result<u64, IndexError> {
        self.set_rank_capacity(id, 0, capacity_blocks)
    }

    /// [`KvIndex::set_capacity`] for one data-parallel rank.
    pub fn set_rank_capacity(
        &mut self,
        id: WorkerId,
        rank: u32,
        capacity_blocks: u32,
    ) -> Result<u64, IndexError> {
        if capacity_blocks == 0 {
            return Err(IndexError::ZeroCapacity(id));
        }
        let w = self.slot_of(id, rank)?;
        self.workers[w].spec.capacity_blocks = capacity_blocks;
        self.workers[w].entries.set_limit(capacity_blocks as usize);
        self.update_group_limit(w / GROUP);
        let excess = self.workers[w]
            .entries
            .len()
            .saturating_sub(capacity_blocks as usize);
        Ok(if excess > 0 {
            self.drop_oldest(w, excess)
        } else {
            0
        })
    }

    fn update_group_limit(&mut self, g: usize) {
        let limit: usize = self.workers[g * GROUP..((g + 1) * GROUP).min(self.workers.len())]
            .iter()
            .map(|w| w.spec.capacity_blocks as usize)
            .sum();
        self.groups[g].set_limit(limit);
    }

    fn slot_of(&self, id: WorkerId, rank: u32) -> Result<usize, IndexError> {
        self.by_id.get(&(id, rank)).copied().ok_or(if rank == 0 {
            IndexError::UnknownWorker(id)
        } else {
            IndexError::UnknownRank(id, rank)
        })
    }

    /// Applies one event of `worker` (its rank 0; see the module doc for the rules).
    pub fn apply(&mut self, worker: WorkerId, event: &Event) -> Result<ApplyOutcome, IndexError> {
        self.apply_rank(worker, 0, event)
    }

    /// Applies one event published by data-parallel rank `rank` of `worker`.
    pub fn apply_rank(
        &mut self,
        worker: WorkerId,
        rank: u32,
        event: &Event,
    ) -> Result<ApplyOutcome, IndexError> {
        let w = self.slot_of(worker, rank)?;
        Ok(match event {
            Event::Stored(s) => self.store(w, s),
            Event::Removed(r) => self.remove_blocks(w, r),
            Event::AllCleared => {
                self.clear_slot(w);
                ApplyOutcome {
                    cleared: true,
                    ..ApplyOutcome::default()
                }
            }
        })
    }

    fn store(&mut self, w: usize, s: &BlockStored) -> ApplyOutcome {
        let n = s.block_hashes.len() as u64;
        let mut out = ApplyOutcome::default();
        if !resident_on_gpu(s.medium.as_ref()) || s.lora_id.is_some() || s.lora_name.is_some() {
            out.skipped = n;
            return out;
        }
        let bs = self.workers[w].spec.block_size.tokens();
        if s.block_size != bs || s.token_ids.len() as u64 != n * u64::from(bs) {
            out.invalid = n;
            return out;
        }
        let mut parent = match s.parent {
            None => None,
            Some(p) => match self.workers[w].entries.get(p.0) {
                Some(e) => Some(BlockKey(e.key)),
                None => {
                    out.unknown_parent = n;
                    return out;
                }
            },
        };
        let session = s
            .session_id
            .as_deref()
            .map(|k| self.sessions.handle(SessionId::from_key(k)));
        self.sessions.pinned = session.unwrap_or(0);
        for (hash, tokens) in s
            .block_hashes
            .iter()
            .zip(s.token_ids.chunks_exact(bs as usize))
        {
            let key = self.hasher.key(parent, tokens);
            out.dropped += self.insert(w, *hash, key, session.unwrap_or(0));
            out.stored += 1;
            parent = Some(key);
        }
        self.sessions.pinned = 0;
        if let Some(h) = session {
            self.sessions.release_if_empty(h);
        }
        out
    }

    /// Inserts one block; returns the entries dropped to make room.
    fn insert(&mut self, w: usize, hash: EngineHash, key: BlockKey, session: u32) -> u64 {
        let stamp = self.stamp(w);
        if let Some(e) = self.workers[w].entries.get_mut(hash.0) {
            if e.key == key.0 {
                e.stamp = stamp;
                let old = std::mem::replace(&mut e.session, session);
                if old != session {
                    if old != 0 {
                        self.sessions.sub(old, w as u32);
                    }
                    if session != 0 {
                        self.sessions.add(session, w as u32);
                    }
                }
                return 0;
            }
            // The engine reuses a hash for other tokens: forget the old block first.
            self.remove_entry(w, hash.0);
        }
        let mut dropped = 0;
        let cap = self.workers[w].spec.capacity_blocks as usize;
        if self.workers[w].entries.len() >= cap {
            dropped = self.drop_oldest(w, cap.div_ceil(32));
        }
        self.workers[w].entries.insert(
            hash.0,
            Entry {
                key: key.0,
                stamp,
                session,
            },
        );
        if session != 0 {
            self.sessions.add(session, w as u32);
        }
        let bit = 1u64 << (w % GROUP);
        let group = &mut self.groups[w / GROUP];
        match group.get_mut(key.0) {
            Some(mask) if *mask & bit != 0 => {
                *self.workers[w].dups.entry(key.0).or_insert(0) += 1;
            }
            Some(mask) => *mask |= bit,
            None => {
                group.insert(key.0, bit);
            }
        }
        dropped
    }

    fn stamp(&mut self, w: usize) -> u32 {
        if self.workers[w].next_stamp == u32::MAX {
            self.renumber_stamps(w);
        }
        let wi = &mut self.workers[w];
        let s = wi.next_stamp;
        wi.next_stamp += 1;
        s
    }

    /// Renumbers a worker's stamps `0..len` in the same order (once every 2^32 stores).
    fn renumber_stamps(&mut self, w: usize) {
        let wi = &mut self.workers[w];
        let mut order: Vec<(u32, u64)> = wi.entries.iter().map(|(h, e)| (e.stamp, h)).collect();
        order.sort_unstable();
        for (i, (_, h)) in order.iter().enumerate() {
            if let Some(e) = wi.entries.get_mut(*h) {
                e.stamp = i as u32;
            }
        }
        wi.next_stamp = order.len() as u32;
    }

    /// Drops the `n` least recently stored entries of worker slot `w`.
    fn drop_oldest(&mut self, w: usize, n: usize) -> u64 {
        let mut order: Vec<(u32, u64)> = self.workers[w]
            .entries
            .iter()
            .map(|(h, e)| (e.stamp, h))
            .collect();
        let n = n.min(order.len());
        if n == 0 {
            return 0;
        }
        if n < order.len() {
            order.select_nth_unstable(n - 1);
        }
        for (_, h) in &order[..n] {
            self.remove_entry(w, *h);
        }
        n as u64
    }

    /// Removes one entry of worker slot `w` by engine hash; whether it was there.
    fn remove_entry(&mut self, w: usize, hash: u64) -> bool {
        let Some(e) = self.workers[w].entries.remove(hash) else {
            return false;
        };
        if e.session != 0 {
            self.sessions.sub(e.session, w as u32);
        }
        let wi = &mut self.workers[w];
        if let Some(extra) = wi.dups.get_mut(&e.key) {
            *extra -= 1;
            if *extra == 0 {
                wi.dups.remove(&e.key);
            }
            return true;
        }
        let group = &mut self.groups[w / GROUP];
        if let Some(mask) = group.get_mut(e.key) {
            *mask &= !(1u64 << (w % GROUP));
            if *mask == 0 {
                group.remove(e.key);
            }
        }
        true
    }

    fn remove_blocks(&mut self, w: usize, r: &BlockRemoved) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        if !resident_on_gpu(r.medium.as_ref()) {
            out.skipped = r.block_hashes.len() as u64;
            return out;
        }
        for h in &r.block_hashes {
            if self.remove_entry(w, h.0) {
                out.removed += 1;
            } else {
                out.unknown_removal += 1;
            }
        }
        out
    }

    /// Forgets everything a worker (its rank 0) holds (its engine cleared its cache,
    /// restarted, or its event history was lost).
    pub fn clear(&mut self, worker: WorkerId) -> Result<u64, IndexError> {
        self.clear_rank(worker, 0)
    }

    /// [`KvIndex::clear`] for one data-parallel rank.
    pub fn clear_rank(&mut self, worker: WorkerId, rank: u32) -> Result<u64, IndexError> {
        let w = self.slot_of(worker, rank)?;
        Ok(self.clear_slot(w))
    }

    fn clear_slot(&mut self, w: usize) -> u64 {
        let hashes: Vec<u64> = self.workers[w].entries.iter().map(|(h, _)| h).collect();
        for h in &hashes {
            self.remove_entry(w, *h);
        }
        let wi = &mut self.workers[w];
        wi.entries.clear();
        wi.dups = HashMap::new();
        wi.next_stamp = 0;
        hashes.len() as u64
    }

    /// Blocks a worker (its rank 0) holds (0 for a worker not in the index).
    pub fn indexed_blocks(&self, worker: WorkerId) -> usize {
        self.rank_blocks(worker, 0)
    }

    /// Blocks one data-parallel rank of a worker holds (0 for one not in the index).
    pub fn rank_blocks(&self, worker: WorkerId, rank: u32) -> usize {
        self.slot_of(worker, rank)
            .map_or(0, |w| self.workers[w].entries.len())
    }

    /// Blocks held over all workers (a block two workers hold counts twice).
    pub fn total_blocks(&self) -> usize {
        self.workers.iter().map(|w| w.entries.len()).sum()
    }

    /// A worker's (rank 0's) blocks as (engine hash, own key), sorted: the index's exact
    /// content for it.
    pub fn worker_blocks(&self, worker: WorkerId) -> Vec<(EngineHash, BlockKey)> {
        self.rank_entries(worker, 0)
    }

    /// [`KvIndex::worker_blocks`] for one data-parallel rank.
    pub fn rank_entries(&self, worker: WorkerId, rank: u32) -> Vec<(EngineHash, BlockKey)> {
        let Ok(w) = self.slot_of(worker, rank) else {
            return Vec::new();
        };
        let mut v: Vec<_> = self.workers[w]
            .entries
            .iter()
            .map(|(h, e)| (EngineHash(h), BlockKey(e.key)))
            .collect();
        v.sort_unstable();
        v
    }

    /// For each worker (in the order added), how many leading keys of `keys` its best
    /// data-parallel rank holds.
    ///
    /// `keys` come from [`crate::chain_keys`] in one block size; workers of another block
    /// size hold none of them. One pass down the chain for every group of 64 worker ranks.
    pub fn overlap(&self, keys: &[BlockKey]) -> Vec<(WorkerId, usize)> {
        let per_rank = self.slot_overlap(keys);
        self.best_per_worker(|slot| per_rank[slot])
            .into_iter()
            .map(|(w, _, n)| (w, n))
            .collect()
    }

    /// For each (worker, data-parallel rank), in the order added, how many leading keys of
    /// `keys` it holds.
    pub fn overlap_ranks(&self, keys: &[BlockKey]) -> Vec<(WorkerId, u32, usize)> {
        self.slot_overlap(keys)
            .into_iter()
            .zip(&self.workers)
            .map(|(n, w)| (w.id, w.rank, n))
            .collect()
    }

    /// Per worker (in the order its first rank was added): the rank with the highest
    /// `count(slot)` (the lowest rank on a tie) and that count.
    fn best_per_worker<T: Ord + Copy>(
        &self,
        count: impl Fn(usize) -> T,
    ) -> Vec<(WorkerId, u32, T)> {
        let mut out: Vec<(WorkerId, u32, T)> = Vec::new();
        let mut at: HashMap<WorkerId, usize> = HashMap::new();
        for (slot, w) in self.workers.iter().enumerate() {
            let n = count(slot);
            match at.get(&w.id) {
                Some(&i) => {
                    let (_, rank, best) = &mut out[i];
                    if n > *best || (n == *best && w.rank < *rank) {
                        (*rank, *best) = (w.rank, n);
                    }
                }
                None => {
                    at.insert(w.id, out.len());
                    out.push((w.id, w.rank, n));
                }
            }
        }
        out
    }

    fn slot_overlap(&self, keys: &[BlockKey]) -> Vec<usize> {
        let mut counts = vec![keys.len(); self.workers.len()];
        for (g, table) in self.groups.iter().enumerate() {
            let first = g * GROUP;
            let n = (self.workers.len() - first).min(GROUP);
            let mut running = if n == GROUP {
                u64::MAX
            } else {
                (1u64 << n) - 1
            };
            for (i, k) in keys.iter().enumerate() {
                let held = table.get(k.0).copied().unwrap_or(0);
                let mut lost = running & !held;
                while lost != 0 {
                    let bit = lost.trailing_zeros() as usize;
                    counts[first + bit] = i;
                    lost &= lost - 1;
                }
                running &= held;
                if running == 0 {
                    break;
                }
            }
        }
        counts
    }

    /// For each worker (in the order added), the leading blocks of a request's `tokens` its
    /// best data-parallel rank holds, chained in the worker's own block size (one chain per
    /// distinct block size).
    pub fn overlap_tokens(&mut self, tokens: &[u32]) -> Vec<WorkerOverlap> {
        let mut sizes: Vec<u32> = self
            .workers
            .iter()
            .map(|w| w.spec.block_size.tokens())
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut out: Vec<WorkerOverlap> = self
            .workers
            .iter()
            .map(|w| WorkerOverlap {
                worker: w.id,
                rank: w.rank,
                blocks: 0,
                tokens: 0,
            })
            .collect();
        let mut keys = Vec::new();
        for bs in sizes {
            keys.clear();
            self.hasher.chain_into(None, tokens, bs as usize, &mut keys);
            for (slot, blocks) in self.slot_overlap(&keys).into_iter().enumerate() {
                if self.workers[slot].spec.block_size.tokens() == bs {
                    out[slot].blocks = blocks;
                    out[slot].tokens = blocks as u64 * u64::from(bs);
                }
            }
        }
        self.best_per_worker(|slot| out[slot].blocks)
            .into_iter()
            .map(|(worker, rank, blocks)| {
                let slot = self.by_id[&(worker, rank)];
                WorkerOverlap {
                    worker,
                    rank,
                    blocks,
                    tokens: out[slot].tokens,
                }
            })
            .collect()
    }

    /// Blocks of `session` each worker holds on its best data-parallel rank (workers
    /// holding none are left out), in the order the workers were added.
    pub fn session_residency(&self, session: SessionId) -> Vec<(WorkerId, u32)> {
        let per_rank = self.session_slots(session);
        if per_rank.is_empty() {
            return Vec::new();
        }
        let count = |slot: usize| {
            per_rank
                .iter()
                .find(|(s, _)| *s as usize == slot)
                .map_or(0, |(_, n)| *n)
        };
        self.best_per_worker(count)
            .into_iter()
            .filter(|(_, _, n)| *n > 0)
            .map(|(w, _, n)| (w, n))
            .collect()
    }

    /// Blocks of `session` each (worker, data-parallel rank) holds, as (worker, rank,
    /// blocks), ranks holding none left out, in the order the ranks were added: which rank
    /// of a data-parallel engine holds the session.
    pub fn session_residency_ranks(&self, session: SessionId) -> Vec<(WorkerId, u32, u32)> {
        self.session_slots(session)
            .into_iter()
            .map(|(slot, n)| {
                let w = &self.workers[slot as usize];
                (w.id, w.rank, n)
            })
            .collect()
    }

    /// (slot, blocks) of a session, sorted by slot.
    fn session_slots(&self, session: SessionId) -> Vec<(u32, u32)> {
        let Some(h) = self.sessions.handles.get(&session) else {
            return Vec::new();
        };
        let mut v: Vec<(u32, u32)> = self.sessions.slots[(*h - 1) as usize].per_worker.clone();
        v.sort_unstable();
        v
    }

    /// Sessions with at least one indexed block.
    pub fn sessions(&self) -> usize {
        self.sessions.handles.len()
    }

    /// Bytes the index has allocated for its tables (capacity, not length): the per-worker
    /// maps, the group maps, the duplicate-key counts and the session table.
    pub fn memory_bytes(&self) -> usize {
        let workers: usize = self
            .workers
            .iter()
            .map(|w| w.entries.bytes() + w.dups.capacity() * 16)
            .sum();
        let groups: usize = self.groups.iter().map(FlatMap::bytes).sum();
        workers + groups + self.sessions.bytes()
    }
}
