//! The router's block view: which worker it believes holds which block.
//!
//! One entry per distinct block hash, each with two worker bitsets:
//! - `seen`: every worker a request carrying this block was sent to. It only grows (the
//!   reference baseline's view, and the approximate prefix-cache view of prefill and colocated
//!   workers);
//! - `live`: workers on which a session whose blocks include this block is believed resident
//!   right now. It is reference counted per worker, so it forgets a session's blocks when the
//!   session leaves the worker, is evicted or is forgotten.
//!
//! Because block ids are chained, a worker that holds block `k` holds blocks `0..k` as well, so
//! the number of leading blocks each candidate holds is found by a binary search on the prefix
//! depth, done for all candidates at once: candidates that answer alike at the same probe stay
//! in one group, so a decision costs a few lookups per distinct depth rather than one per block.

use crate::view::MAX_WORKERS;
use kvc_core::BlockHash;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const WORDS: usize = MAX_WORKERS / 64;

/// A set of worker ids (each below [`MAX_WORKERS`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct WorkerSet([u64; WORDS]);

impl WorkerSet {
    pub(crate) const EMPTY: WorkerSet = WorkerSet([0; WORDS]);

    pub(crate) fn insert(&mut self, slot: usize) {
        self.0[slot / 64] |= 1 << (slot % 64);
    }

    pub(crate) fn remove(&mut self, slot: usize) {
        self.0[slot / 64] &= !(1 << (slot % 64));
    }

    pub(crate) fn contains(&self, slot: usize) -> bool {
        slot < MAX_WORKERS && self.0[slot / 64] & (1 << (slot % 64)) != 0
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub(crate) fn and(self, other: WorkerSet) -> WorkerSet {
        let mut out = self;
        for (a, b) in out.0.iter_mut().zip(other.0) {
            *a &= b;
        }
        out
    }

    pub(crate) fn and_not(self, other: WorkerSet) -> WorkerSet {
        let mut out = self;
        for (a, b) in out.0.iter_mut().zip(other.0) {
            *a &= !b;
        }
        out
    }

    /// The smallest member `>= from`, if any.
    pub(crate) fn first_at_or_after(&self, from: usize) -> Option<usize> {
        let mut word = from / 64;
        if word >= WORDS {
            return None;
        }
        let mut bits = self.0[word] & (u64::MAX << (from % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            if word == WORDS {
                return None;
            }
            bits = self.0[word];
        }
    }

    /// Members in increasing order.
    pub(crate) fn iter(self) -> impl Iterator<Item = usize> {
        let mut next = 0usize;
        std::iter::from_fn(move || {
            let found = self.first_at_or_after(next)?;
            next = found + 1;
            Some(found)
        })
    }
}

/// A hasher for keys that are already well-spread or small integers: each written word goes
/// through the splitmix64 finalizer. Deterministic (no per-process random keys) and fast.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MixHasher(u64);

fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.write_u64(u64::from(i));
    }

    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }

    fn write_u64(&mut self, i: u64) {
        self.0 = mix64(self.0 ^ i);
    }

    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
}

/// Hash map with the deterministic [`MixHasher`].
pub(crate) type Map<K, V> = HashMap<K, V, BuildHasherDefault<MixHasher>>;

/// Which of the two block views to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockView {
    /// Grow-only: every worker a block was ever sent to.
    Seen,
    /// Reference-counted: workers where a session holding the block is believed resident.
    Live,
}

/// The block index (see the module docs).
#[derive(Debug, Clone, Default)]
pub(crate) struct BlockIndex {
    entries: Map<BlockHash, u32>,
    seen: Vec<WorkerSet>,
    live: Vec<WorkerSet>,
    /// Live reference counts keyed by `entry << 8 | worker`.
    live_refs: Map<u64, u32>,
}

fn live_key(entry: u32, slot: usize) -> u64 {
    (u64::from(entry) << 8) | slot as u64
}

impl BlockIndex {
    /// Distinct blocks known.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    fn entry(&mut self, h: BlockHash) -> u32 {
        let next = self.seen.len() as u32;
        let e = *self.entries.entry(h).or_insert(next);
        if e == next {
            self.seen.push(WorkerSet::EMPTY);
            self.live.push(WorkerSet::EMPTY);
        }
        e
    }

    /// Records that `blocks` were sent to worker `slot` (grow-only view).
    pub(crate) fn record_seen(&mut self, slot: usize, blocks: &[BlockHash]) {
        for &h in blocks {
            let e = self.entry(h) as usize;
            self.seen[e].insert(slot);
        }
    }

    /// Adds one live reference of worker `slot` to each of `blocks`.
    pub(crate) fn add_live(&mut self, slot: usize, blocks: &[BlockHash]) {
        for &h in blocks {
            let e = self.entry(h);
            let count = self.live_refs.entry(live_key(e, slot)).or_insert(0);
            *count += 1;
            if *count == 1 {
                self.live[e as usize].insert(slot);
            }
        }
    }

    /// Drops one live reference of worker `slot` from each of `blocks` (the inverse of
    /// [`BlockIndex::add_live`] for the same list).
    pub(crate) fn remove_live(&mut self, slot: usize, blocks: &[BlockHash]) {
        for h in blocks {
            let Some(&e) = self.entries.get(h) else {
                continue;
            };
            let key = live_key(e, slot);
            if let Some(count) = self.live_refs.get_mut(&key) {
                *count -= 1;
                if *count == 0 {
                    self.live_refs.remove(&key);
                    self.live[e as usize].remove(slot);
                }
            }
        }
    }

    /// Workers holding `h` in `view`.
    pub(crate) fn holders(&self, h: BlockHash, view: BlockView) -> WorkerSet {
        match self.entries.get(&h) {
            None => WorkerSet::EMPTY,
            Some(&e) => match view {
                BlockView::Seen => self.seen[e as usize],
                BlockView::Live => self.live[e as usize],
            },
        }
    }

    /// For every worker of `set`, the number of leading `blocks` it holds in `view`, written to
    /// `out[worker]` (entries of workers outside `set` are left untouched).
    pub(crate) fn depths(
        &self,
        blocks: &[BlockHash],
        set: WorkerSet,
        view: BlockView,
        out: &mut [u32; MAX_WORKERS],
    ) {
        self.split(blocks, 0, blocks.len(), set, view, out);
    }

    /// Every worker of `set` holds between `lo` and `hi` leading blocks.
    fn split(
        &self,
        blocks: &[BlockHash],
        lo: usize,
        hi: usize,
        set: WorkerSet,
        view: BlockView,
        out: &mut [u32; MAX_WORKERS],
    ) {
        if set.is_empty() {
            return;
        }
        if lo == hi {
            for slot in set.iter() {
                out[slot] = lo as u32;
            }
            return;
        }
        // lo < mid <= hi: does the worker hold block `mid - 1` (so at least `mid` blocks)?
        let mid = lo + (hi - lo).div_ceil(2);
        let have = self.holders(blocks[mid - 1], view).and(set);
        self.split(blocks, lo, mid - 1, set.and_not(have), view, out);
        self.split(blocks, mid, hi, have, view, out);
    }

    /// The number of leading `blocks` worker `slot` holds in `view`.
    pub(crate) fn depth(&self, blocks: &[BlockHash], slot: usize, view: BlockView) -> u32 {
        let mut set = WorkerSet::EMPTY;
        set.insert(slot);
        let mut out = [0u32; MAX_WORKERS];
        self.depths(blocks, set, view, &mut out);
        out[slot]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(ids: &[u64]) -> Vec<BlockHash> {
        ids.iter().copied().map(BlockHash).collect()
    }

    fn set(slots: &[usize]) -> WorkerSet {
        let mut s = WorkerSet::EMPTY;
        for &x in slots {
            s.insert(x);
        }
        s
    }

    #[test]
    fn worker_set_operations() {
        let s = set(&[0, 3, 64, 200, 255]);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 3, 64, 200, 255]);
        assert_eq!(s.len(), 5);
        assert_eq!(s.first_at_or_after(4), Some(64));
        assert_eq!(s.first_at_or_after(201), Some(255));
        assert_eq!(s.first_at_or_after(256), None);
        assert!(s.contains(200) && !s.contains(199) && !s.contains(300));
        let t = set(&[3, 200, 7]);
        assert_eq!(s.and(t).iter().collect::<Vec<_>>(), vec![3, 200]);
        assert_eq!(s.and_not(t).iter().collect::<Vec<_>>(), vec![0, 64, 255]);
        assert!(WorkerSet::EMPTY.is_empty());
        let mut u = s;
        u.remove(0);
        assert_eq!(u.first_at_or_after(0), Some(3));
    }

    #[test]
    fn depths_follow_chained_prefixes() {
        let mut idx = BlockIndex::default();
        idx.record_seen(1, &hs(&[10, 11, 12, 13, 14]));
        idx.record_seen(2, &hs(&[10, 11]));
        idx.record_seen(3, &hs(&[10, 11, 12, 20]));
        let req = hs(&[10, 11, 12, 13, 15, 16]);
        let mut out = [u32::MAX; MAX_WORKERS];
        idx.depths(&req, set(&[1, 2, 3, 4]), BlockView::Seen, &mut out);
        assert_eq!(&out[1..5], &[4, 2, 3, 0]);
        assert_eq!(out[0], u32::MAX, "workers outside the set are untouched");
        assert_eq!(idx.depth(&req, 1, BlockView::Seen), 4);
        assert_eq!(idx.depth(&[], 1, BlockView::Seen), 0);
        assert_eq!(idx.depth(&req, 1, BlockView::Live), 0);
        assert_eq!(idx.len(), 6);
    }

    #[test]
    fn live_view_is_reference_counted() {
        let mut idx = BlockIndex::default();
        let a = hs(&[1, 2, 3]);
        let b = hs(&[1, 2, 4]);
        idx.add_live(5, &a);
        idx.add_live(5, &b);
        assert_eq!(idx.depth(&a, 5, BlockView::Live), 3);
        idx.remove_live(5, &a);
        // Blocks 1 and 2 are still held through `b`; block 3 is gone.
        assert_eq!(idx.depth(&a, 5, BlockView::Live), 2);
        assert_eq!(idx.depth(&b, 5, BlockView::Live), 3);
        idx.remove_live(5, &b);
        assert_eq!(idx.depth(&b, 5, BlockView::Live), 0);
        // The grow-only view never saw them; removing unknown blocks is harmless.
        assert_eq!(idx.depth(&b, 5, BlockView::Seen), 0);
        idx.remove_live(5, &hs(&[99]));
    }
}
