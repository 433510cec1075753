//! The router's block view: which worker it believes holds which block.
//!
//! One entry per distinct block hash, each with two worker bitsets:
//! - `seen`: every worker a request carrying this block was sent to. Apart from the bound below
//!   it only grows (the reference baseline's view, and the approximate prefix-cache view of
//!   prefill and colocated workers);
//! - `live`: workers on which a session whose blocks include this block is believed resident
//!   right now. It is reference counted per worker, so it forgets a session's blocks when the
//!   session leaves the worker, is evicted or is forgotten.
//!
//! Each worker holds at most a bound of blocks in each view (see
//! [`crate::StateBounds::blocks_per_worker`]); past it, its least recently used block in that
//! view leaves (a live block with all its references). A request's blocks are used deepest
//! first, so a prefix always outlives its extensions and a worker's blocks stay prefix-closed
//! the way the depth search below assumes. An entry is freed when no worker holds it in either
//! view, so the index holds at most `2 × Σ bound` (block, worker) memberships and as many
//! distinct blocks.
//!
//! Recency is kept per worker and view in a queue of member ids, least recently used first: a
//! use appends the member (its earlier entry becomes stale), the bound takes members off the
//! front skipping stale entries, and a queue is compacted before it holds more than twice its
//! members (plus a small slack), so it costs at most 8 bytes per membership (counted when its
//! worker held the most), plus the slack.
//!
//! Because block ids are chained, a worker that holds block `k` holds blocks `0..k` as well, so
//! the number of leading blocks each candidate holds is found by a binary search on the prefix
//! depth, done for all candidates at once: candidates that answer alike at the same probe stay
//! in one group, so a decision costs a few lookups per distinct depth rather than one per block.

use crate::view::MAX_WORKERS;
use crate::worker_set::WorkerSet;
use kvc_core::BlockHash;
use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Holders past which a block's holder list becomes a bitset.
const LIST_MAX: usize = 8;

/// The workers holding one block in one view. Most blocks are held by one worker or a few (a
/// session's blocks, on its worker): sorted ids, up to four inline. A block many workers hold
/// (a shared system prompt) switches to a bitset, so intersecting it with a decision's
/// candidates costs a few words, not a search per candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Holders {
    /// At most [`LIST_MAX`] ids, sorted.
    List(SmallVec<[u16; 4]>),
    /// Any number.
    Bits(Box<WorkerSet>),
}

impl Default for Holders {
    fn default() -> Self {
        Holders::List(SmallVec::new())
    }
}

impl Holders {
    fn insert(&mut self, slot: usize) {
        match self {
            Holders::List(ids) => {
                let id = slot as u16;
                if let Err(at) = ids.binary_search(&id) {
                    if ids.len() < LIST_MAX {
                        ids.insert(at, id);
                    } else {
                        let mut bits = WorkerSet::EMPTY;
                        for &h in ids.iter() {
                            bits.insert(usize::from(h));
                        }
                        bits.insert(slot);
                        *self = Holders::Bits(Box::new(bits));
                    }
                }
            }
            Holders::Bits(bits) => bits.insert(slot),
        }
    }

    fn remove(&mut self, slot: usize) {
        match self {
            Holders::List(ids) => {
                if let Ok(at) = ids.binary_search(&(slot as u16)) {
                    ids.remove(at);
                }
            }
            Holders::Bits(bits) => bits.remove(slot),
        }
    }

    pub(crate) fn contains(&self, slot: usize) -> bool {
        match self {
            Holders::List(ids) => u16::try_from(slot).is_ok_and(|s| ids.binary_search(&s).is_ok()),
            Holders::Bits(bits) => bits.contains(slot),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Holders::List(ids) => ids.is_empty(),
            Holders::Bits(bits) => bits.is_empty(),
        }
    }

    /// The members of `set` that hold the block: a test per listed holder, or a word-wise
    /// intersection.
    fn and(&self, set: &WorkerSet) -> WorkerSet {
        match self {
            Holders::List(ids) => {
                let mut out = WorkerSet::EMPTY;
                for &slot in ids {
                    if set.contains(usize::from(slot)) {
                        out.insert(usize::from(slot));
                    }
                }
                out
            }
            Holders::Bits(bits) => bits.and(set),
        }
    }
}

/// Leading request blocks per worker, indexed by worker id, for the workers of the set they
/// were asked for (0 for the others); as long as the largest id asked for, not the fleet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Depths(Vec<u32>);

impl Depths {
    /// Room for every worker of `set`.
    pub(crate) fn for_set(set: &WorkerSet) -> Self {
        Depths(vec![0; set.last().map_or(0, |l| l + 1)])
    }
}

impl std::ops::Index<usize> for Depths {
    type Output = u32;

    fn index(&self, slot: usize) -> &u32 {
        self.0.get(slot).unwrap_or(&0)
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
    /// Grow-only: every worker a block was sent to (within the per-worker bound).
    Seen,
    /// Reference-counted: workers where a session holding the block is believed resident.
    Live,
}

impl BlockView {
    fn index(self) -> usize {
        match self {
            BlockView::Seen => 0,
            BlockView::Live => 1,
        }
    }
}

/// The position of a freed member.
const NIL: u32 = u32::MAX;

/// One distinct block and the workers holding it in each view.
#[derive(Debug, Clone)]
struct Entry {
    hash: BlockHash,
    seen: Holders,
    live: Holders,
}

/// One block held by one worker in one view.
#[derive(Debug, Clone, Copy)]
struct Member {
    entry: u32,
    /// Live references (1 for the seen view).
    refs: u32,
    /// Where its current entry is in its worker's [`Queue`] for the view ([`NIL`] once freed).
    pos: u32,
    slot: u16,
    view: u8,
}

/// One worker's recency queue in one view: member ids from `head` on, least recently used
/// first. Using a member appends it; its entry at [`Member::pos`] is its current one, and the
/// others (earlier uses, freed members) are stale and skipped. A queue is compacted to its
/// current entries before it would hold more than `2 × len + QUEUE_SLACK`, and a full queue
/// grows to just that, so it costs at most two ids (8 bytes) per member it held at its largest,
/// plus the slack.
#[derive(Debug, Clone, Default)]
struct Queue {
    ids: Vec<u32>,
    /// Entries before it were taken off the front.
    head: usize,
    /// Members held.
    len: u32,
}

/// Entries a queue holds past twice its members before it is compacted.
const QUEUE_SLACK: usize = 32;

/// Bits of a worker id in a member key.
const SLOT_BITS: u32 = MAX_WORKERS.trailing_zeros();
const _: () = assert!(MAX_WORKERS.is_power_of_two() && MAX_WORKERS <= 1 << 16);

/// A member's key: its block's hash, its worker and its view, so that finding a worker's
/// member for a block is one lookup. The hash is kept as two halves, so the key takes 12 bytes
/// and a table slot (key and member id) 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MemberKey {
    hash: [u32; 2],
    /// `view << SLOT_BITS | slot`.
    at: u32,
}

impl MemberKey {
    fn new(h: BlockHash, slot: usize, view: BlockView) -> Self {
        MemberKey {
            hash: [h.0 as u32, (h.0 >> 32) as u32],
            at: ((view.index() as u32) << SLOT_BITS) | slot as u32,
        }
    }
}

impl std::hash::Hash for MemberKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // One word: block hashes are well spread already, and the worker and view spread
        // over the high bits.
        let h = u64::from(self.hash[0]) | (u64::from(self.hash[1]) << 32);
        state.write_u64(h ^ u64::from(self.at).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    }
}

/// The block index (see the module docs), bounded per worker and view: each worker holds at
/// most `bound(worker)` blocks in each view; past it, its least recently used block in that
/// view leaves (a request's blocks are used deepest first, so a prefix outlives its
/// extensions).
#[derive(Debug, Clone)]
pub(crate) struct BlockIndex {
    entries: Map<BlockHash, u32>,
    slab: Vec<Entry>,
    free_entries: Vec<u32>,
    members: Map<MemberKey, u32>,
    links: Vec<Member>,
    free_links: Vec<u32>,
    /// Per worker slot, one recency queue per view.
    queues: Vec<[Queue; 2]>,
    /// Per worker slot; slots past the end use `default_bound`.
    bounds: Vec<u32>,
    default_bound: u32,
    /// Memberships removed because a worker was over its bound.
    dropped: u64,
}

impl BlockIndex {
    /// An empty index whose workers hold at most `default_bound` blocks per view unless
    /// [`BlockIndex::set_bound`] says otherwise.
    pub(crate) fn new(default_bound: u32) -> Self {
        BlockIndex {
            entries: Map::default(),
            slab: Vec::new(),
            free_entries: Vec::new(),
            members: Map::default(),
            links: Vec::new(),
            free_links: Vec::new(),
            queues: Vec::new(),
            bounds: Vec::new(),
            default_bound,
            dropped: 0,
        }
    }

    /// Distinct blocks known (held by some worker in some view).
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Blocks worker `slot` holds in `view`.
    pub(crate) fn held(&self, slot: usize, view: BlockView) -> usize {
        self.queues
            .get(slot)
            .map_or(0, |q| q[view.index()].len as usize)
    }

    /// Memberships removed so far because a worker was over its bound.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The most blocks worker `slot` holds per view.
    pub(crate) fn bound(&self, slot: usize) -> u32 {
        self.bounds.get(slot).copied().unwrap_or(self.default_bound)
    }

    /// Sets the most blocks worker `slot` holds per view, dropping its least recently used
    /// blocks at once if it holds more.
    pub(crate) fn set_bound(&mut self, slot: usize, bound: u32) {
        if self.bounds.len() <= slot {
            self.bounds.resize(slot + 1, self.default_bound);
        }
        self.bounds[slot] = bound;
        self.trim(slot, BlockView::Seen);
        self.trim(slot, BlockView::Live);
    }

    /// Whether `m` is the current entry at `at` of the queue of `slot` in `view`.
    fn is_current(&self, m: u32, at: usize, slot: usize, view: usize) -> bool {
        let link = &self.links[m as usize];
        link.pos as usize == at && usize::from(link.slot) == slot && usize::from(link.view) == view
    }

    /// Appends member `m` to the queue of `slot` in `view` as its most recently used.
    fn push_tail(&mut self, m: u32, slot: usize, view: usize) {
        let q = &self.queues[slot][view];
        if q.ids.len() >= 2 * q.len as usize + QUEUE_SLACK {
            self.compact(slot, view);
        }
        let q = &mut self.queues[slot][view];
        if q.ids.len() == q.ids.capacity() {
            // (Below `2 × len + QUEUE_SLACK` entries, as just checked.)
            q.ids
                .reserve_exact(2 * q.len as usize + QUEUE_SLACK + 1 - q.ids.len());
        }
        self.links[m as usize].pos = q.ids.len() as u32;
        q.ids.push(m);
    }

    /// Keeps only the current entries of the queue of `slot` in `view`, in their order.
    fn compact(&mut self, slot: usize, view: usize) {
        let q = &mut self.queues[slot][view];
        let mut ids = std::mem::take(&mut q.ids);
        let head = std::mem::take(&mut q.head);
        let mut kept = 0;
        for at in head..ids.len() {
            let m = ids[at];
            if self.is_current(m, at, slot, view) {
                self.links[m as usize].pos = kept as u32;
                ids[kept] = m;
                kept += 1;
            }
        }
        ids.truncate(kept);
        self.queues[slot][view].ids = ids;
    }

    /// Marks member `m` as the most recently used of its queue.
    fn touch(&mut self, m: u32) {
        let Member {
            slot, view, pos, ..
        } = self.links[m as usize];
        let (slot, view) = (usize::from(slot), usize::from(view));
        if pos as usize + 1 != self.queues[slot][view].ids.len() {
            self.push_tail(m, slot, view);
        }
    }

    /// The member for `h` on `slot` in `view`, and whether it is new: created (with no
    /// reference, not yet among the entry's holders, most recently used) if missing.
    fn member(&mut self, slot: usize, view: BlockView, h: BlockHash) -> (u32, bool) {
        let vacant = match self.members.entry(MemberKey::new(h, slot, view)) {
            std::collections::hash_map::Entry::Occupied(o) => return (*o.get(), false),
            std::collections::hash_map::Entry::Vacant(v) => v,
        };
        let next_entry = match self.free_entries.last() {
            Some(&e) => e,
            None => self.slab.len() as u32,
        };
        let entry = *self.entries.entry(h).or_insert(next_entry);
        if entry == next_entry {
            let fresh = Entry {
                hash: h,
                seen: Holders::default(),
                live: Holders::default(),
            };
            if self.free_entries.pop().is_some() {
                self.slab[entry as usize] = fresh;
            } else {
                self.slab.push(fresh);
            }
        }
        let link = Member {
            entry,
            refs: 0,
            pos: NIL,
            slot: slot as u16,
            view: view.index() as u8,
        };
        let m = match self.free_links.pop() {
            Some(m) => {
                self.links[m as usize] = link;
                m
            }
            None => {
                self.links.push(link);
                (self.links.len() - 1) as u32
            }
        };
        vacant.insert(m);
        if self.queues.len() <= slot {
            self.queues.resize_with(slot + 1, Default::default);
        }
        self.queues[slot][view.index()].len += 1;
        self.push_tail(m, slot, view.index());
        (m, true)
    }

    /// Removes member `m`: its worker no longer holds the block in that view.
    fn drop_member(&mut self, m: u32) {
        let link = &mut self.links[m as usize];
        link.pos = NIL;
        let Member {
            entry, slot, view, ..
        } = *link;
        let q = &mut self.queues[usize::from(slot)][usize::from(view)];
        q.len -= 1;
        if q.len == 0 {
            // Every entry left is stale.
            q.ids.clear();
            q.head = 0;
        }
        let view = if view == 0 {
            BlockView::Seen
        } else {
            BlockView::Live
        };
        let e = &mut self.slab[entry as usize];
        self.members
            .remove(&MemberKey::new(e.hash, usize::from(slot), view));
        self.free_links.push(m);
        match view {
            BlockView::Seen => e.seen.remove(slot as usize),
            BlockView::Live => e.live.remove(slot as usize),
        }
        if e.seen.is_empty() && e.live.is_empty() {
            self.entries.remove(&e.hash);
            self.free_entries.push(entry);
        }
    }

    /// Drops the least recently used blocks of `slot` in `view` past its bound.
    fn trim(&mut self, slot: usize, view: BlockView) {
        let bound = self.bound(slot);
        let view = view.index();
        while let Some(q) = self.queues.get_mut(slot).map(|q| &mut q[view])
            && q.len > bound
        {
            // (A queue holding members has their current entries from `head` on.)
            let at = q.head;
            let m = q.ids[at];
            q.head += 1;
            if self.is_current(m, at, slot, view) {
                self.drop_member(m);
                self.dropped += 1;
            }
        }
    }

    /// Records that `blocks` were sent to worker `slot` (grow-only view, within the bound).
    pub(crate) fn record_seen(&mut self, slot: usize, blocks: &[BlockHash]) {
        // The members already there, looked up first: the lookups do not depend on each
        // other, so their cache misses overlap, where a lookup between two queue moves waits
        // for its own.
        let found = self.find_members(slot, BlockView::Seen, blocks);
        // Deepest first, so the prefix is the most recently used.
        for (&h, known) in blocks.iter().zip(found).rev() {
            let (m, fresh) = match known {
                Some(m) => (m, false),
                None => self.member(slot, BlockView::Seen, h),
            };
            if fresh {
                // (A seen member is among its entry's holders from its creation on.)
                let link = &mut self.links[m as usize];
                link.refs = 1;
                let entry = link.entry as usize;
                self.slab[entry].seen.insert(slot);
            }
            self.touch(m);
        }
        self.trim(slot, BlockView::Seen);
    }

    /// The member of each of `blocks` on `slot` in `view`, where there is one.
    fn find_members(&self, slot: usize, view: BlockView, blocks: &[BlockHash]) -> Vec<Option<u32>> {
        blocks
            .iter()
            .map(|&h| self.members.get(&MemberKey::new(h, slot, view)).copied())
            .collect()
    }

    /// Adds one live reference of worker `slot` to each of `blocks`.
    pub(crate) fn add_live(&mut self, slot: usize, blocks: &[BlockHash]) {
        for &h in blocks.iter().rev() {
            let (m, _) = self.member(slot, BlockView::Live, h);
            let link = &mut self.links[m as usize];
            link.refs += 1;
            let entry = link.entry as usize;
            if link.refs == 1 {
                self.slab[entry].live.insert(slot);
            }
            self.touch(m);
        }
        self.trim(slot, BlockView::Live);
    }

    /// Drops one live reference of worker `slot` from each of `blocks` (the inverse of
    /// [`BlockIndex::add_live`] for the same list; blocks the bound already removed are
    /// skipped).
    pub(crate) fn remove_live(&mut self, slot: usize, blocks: &[BlockHash]) {
        for h in blocks {
            let Some(&m) = self.members.get(&MemberKey::new(*h, slot, BlockView::Live)) else {
                continue;
            };
            let link = &mut self.links[m as usize];
            link.refs -= 1;
            if link.refs == 0 {
                self.drop_member(m);
            }
        }
    }

    /// Workers holding `h` in `view`.
    pub(crate) fn holders(&self, h: BlockHash, view: BlockView) -> Option<&Holders> {
        let &e = self.entries.get(&h)?;
        let entry = &self.slab[e as usize];
        Some(match view {
            BlockView::Seen => &entry.seen,
            BlockView::Live => &entry.live,
        })
    }

    /// For every worker of `set`, the number of leading `blocks` it holds in `view`
    /// (0 for workers outside `set`).
    pub(crate) fn depths(&self, blocks: &[BlockHash], set: WorkerSet, view: BlockView) -> Depths {
        let mut out = Depths::for_set(&set);
        let len = set.len();
        self.split(blocks, 0, blocks.len(), set, len, view, &mut out);
        out
    }

    /// Every worker of `set` (of `len` members) holds between `lo` and `hi` leading blocks.
    #[allow(clippy::too_many_arguments)]
    fn split(
        &self,
        blocks: &[BlockHash],
        lo: usize,
        hi: usize,
        set: WorkerSet,
        len: usize,
        view: BlockView,
        out: &mut Depths,
    ) {
        if len == 0 {
            return;
        }
        if lo == hi {
            for slot in set.iter() {
                out.0[slot] = lo as u32;
            }
            return;
        }
        // lo < mid <= hi: does the worker hold block `mid - 1` (so at least `mid` blocks)?
        let mid = lo + (hi - lo).div_ceil(2);
        let have = self
            .holders(blocks[mid - 1], view)
            .map_or(WorkerSet::EMPTY, |h| h.and(&set));
        let have_len = have.len();
        let rest = set.and_not(&have);
        self.split(blocks, lo, mid - 1, rest, len - have_len, view, out);
        self.split(blocks, mid, hi, have, have_len, view, out);
    }

    /// The number of leading `blocks` worker `slot` holds in `view`: a binary search on the
    /// prefix depth, one lookup per probe.
    pub(crate) fn depth(&self, blocks: &[BlockHash], slot: usize, view: BlockView) -> u32 {
        let holds = |i: usize| {
            self.holders(blocks[i], view)
                .is_some_and(|h| h.contains(slot))
        };
        // Invariant: the worker holds blocks[..lo] and not blocks[hi] (if hi < len).
        let (mut lo, mut hi) = (0usize, blocks.len());
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if holds(mid - 1) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo as u32
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
    fn holders_against_a_set() {
        let s = set(&[0, 3, 64, 200, 255, 4_095]);
        let t = set(&[3, 200, 7]);
        // From either side.
        let mut h = Holders::default();
        for slot in [4_000, 3, 200, 9, 3] {
            h.insert(slot);
        }
        assert_eq!(h, Holders::List([3, 9, 200, 4_000].into_iter().collect()));
        assert!(h.contains(4_000) && !h.contains(4_001) && !h.contains(70_000));
        assert_eq!(h.and(&t).iter().collect::<Vec<_>>(), vec![3, 200]);
        assert_eq!(h.and(&s).iter().collect::<Vec<_>>(), vec![3, 200]);
        h.remove(9);
        h.remove(10);
        assert_eq!(h, Holders::List([3, 200, 4_000].into_iter().collect()));
        // Past eight holders the list becomes a bitset, with the same answers.
        for slot in [1, 2, 4, 5, 6] {
            h.insert(slot);
        }
        assert!(matches!(h, Holders::List(_)), "eight listed");
        h.insert(7);
        h.insert(64);
        assert!(matches!(h, Holders::Bits(_)));
        assert!(h.contains(64) && h.contains(4_000) && !h.contains(8));
        assert_eq!(h.and(&t).iter().collect::<Vec<_>>(), vec![3, 7, 200]);
        assert_eq!(h.and(&s).iter().collect::<Vec<_>>(), vec![3, 64, 200]);
        for slot in [1, 2, 3, 4, 5, 6, 7, 64, 200, 4_000] {
            h.remove(slot);
        }
        assert!(h.is_empty());
    }

    #[test]
    fn an_entry_is_small_whatever_the_fleet() {
        // Hash, and two holder lists of four ids inline (or a boxed bitset each): the size of
        // one distinct block in the docs' memory table, the same at 8 workers as at 4,096.
        assert_eq!(std::mem::size_of::<Entry>(), 72);
        assert_eq!(std::mem::size_of::<Member>(), 16);
        // A member table slot: key and member id.
        assert_eq!(std::mem::size_of::<(MemberKey, u32)>(), 16);
    }

    #[test]
    fn depths_follow_chained_prefixes() {
        let mut idx = BlockIndex::new(u32::MAX);
        idx.record_seen(1, &hs(&[10, 11, 12, 13, 14]));
        idx.record_seen(2, &hs(&[10, 11]));
        idx.record_seen(3, &hs(&[10, 11, 12, 20]));
        let req = hs(&[10, 11, 12, 13, 15, 16]);
        let out = idx.depths(&req, set(&[1, 2, 3, 4]), BlockView::Seen);
        assert_eq!((1..5).map(|s| out[s]).collect::<Vec<_>>(), vec![4, 2, 3, 0]);
        assert_eq!(out[0], 0, "workers outside the set read 0");
        assert_eq!(out[4_000], 0);
        assert_eq!(idx.depth(&req, 1, BlockView::Seen), 4);
        assert_eq!(idx.depth(&[], 1, BlockView::Seen), 0);
        assert_eq!(idx.depth(&req, 1, BlockView::Live), 0);
        assert_eq!(idx.len(), 6);
    }

    #[test]
    fn live_view_is_reference_counted() {
        let mut idx = BlockIndex::new(u32::MAX);
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

    /// A plain model of the bounded index: per (worker, view) a list of (block, references)
    /// from least to most recently used.
    #[derive(Default)]
    struct Model {
        lists: std::collections::HashMap<(usize, usize), Vec<(u64, u32)>>,
    }

    impl Model {
        fn add(&mut self, slot: usize, view: usize, blocks: &[u64], bound: usize, seen: bool) {
            let list = self.lists.entry((slot, view)).or_default();
            for &h in blocks.iter().rev() {
                let refs = match list.iter().position(|(b, _)| *b == h) {
                    Some(i) => list.remove(i).1,
                    None => 0,
                };
                list.push((h, if seen { 1 } else { refs + 1 }));
            }
            let over = list.len().saturating_sub(bound);
            list.drain(..over);
        }

        fn remove(&mut self, slot: usize, blocks: &[u64]) {
            let list = self.lists.entry((slot, 1)).or_default();
            for h in blocks {
                if let Some(i) = list.iter().position(|(b, _)| b == h) {
                    list[i].1 -= 1;
                    if list[i].1 == 0 {
                        list.remove(i);
                    }
                }
            }
        }

        fn holds(&self, slot: usize, view: usize, h: u64) -> bool {
            self.lists
                .get(&(slot, view))
                .is_some_and(|l| l.iter().any(|(b, _)| *b == h))
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, failure_persistence: None, ..Default::default() })]

        /// The index holds exactly what a least-recently-used model holds, per worker and
        /// view, reference counts included; with a bound never reached it is the unbounded
        /// index (grow-only view, reference-counted live view).
        #[test]
        fn bounded_index_matches_an_lru_model(
            bound in proptest::prop_oneof![1u32..8, proptest::strategy::Just(u32::MAX)],
            ops in proptest::collection::vec(
                (0u8..3, 0usize..3, proptest::collection::vec(0u64..20, 0..7)),
                1..150,
            ),
        ) {
            let mut idx = BlockIndex::new(bound);
            let mut model = Model::default();
            let mut added: Vec<(usize, Vec<u64>)> = Vec::new();
            for (kind, slot, blocks) in &ops {
                let hashes = hs(blocks);
                match kind {
                    0 => {
                        idx.record_seen(*slot, &hashes);
                        model.add(*slot, 0, blocks, bound as usize, true);
                    }
                    1 => {
                        idx.add_live(*slot, &hashes);
                        model.add(*slot, 1, blocks, bound as usize, false);
                        added.push((*slot, blocks.clone()));
                    }
                    _ => {
                        if let Some((s, b)) = added.pop() {
                            idx.remove_live(s, &hs(&b));
                            model.remove(s, &b);
                        }
                    }
                }
                let mut distinct = std::collections::BTreeSet::new();
                for slot in 0..3 {
                    for (v, view) in [BlockView::Seen, BlockView::Live].into_iter().enumerate() {
                        let n = model.lists.get(&(slot, v)).map_or(0, Vec::len);
                        proptest::prop_assert_eq!(idx.held(slot, view), n);
                        proptest::prop_assert!(n <= bound as usize);
                        for h in 0..20u64 {
                            let holds = model.holds(slot, v, h);
                            if holds {
                                distinct.insert(h);
                            }
                            proptest::prop_assert_eq!(
                                idx.holders(BlockHash(h), view).is_some_and(|x| x.contains(slot)),
                                holds,
                                "block {} slot {} view {:?}", h, slot, view
                            );
                        }
                    }
                }
                proptest::prop_assert_eq!(idx.len(), distinct.len());
            }
        }
    }

    #[test]
    fn compacted_queues_keep_the_use_order() {
        let mut idx = BlockIndex::new(u32::MAX);
        let blocks = hs(&(0..40).collect::<Vec<_>>());
        idx.record_seen(0, &blocks);
        // Uses of single blocks, oldest first: each appends a queue entry, many times over
        // the compaction threshold.
        for round in 0..20u64 {
            for b in (0..40u64).filter(|b| b % 4 == round % 4) {
                idx.record_seen(0, &hs(&[b]));
            }
        }
        assert!(idx.queues[0][0].ids.len() <= 2 * 40 + QUEUE_SLACK);
        // The last round used the blocks `b % 4 == 3`, the one before `b % 4 == 2`, and so on:
        // shrinking the bound drops the least recently used round first.
        idx.set_bound(0, 30);
        assert_eq!(idx.dropped(), 10);
        for b in 0..40u64 {
            let held = idx
                .holders(BlockHash(b), BlockView::Seen)
                .is_some_and(|h| h.contains(0));
            assert_eq!(held, b % 4 != 0, "block {b}");
        }
        idx.set_bound(0, 5);
        let kept: Vec<u64> = (0..40u64)
            .filter(|&b| {
                idx.holders(BlockHash(b), BlockView::Seen)
                    .is_some_and(|h| h.contains(0))
            })
            .collect();
        // Of the last round (3, 7, ..., 39, used in that order), the five most recent.
        assert_eq!(kept, vec![23, 27, 31, 35, 39]);
        assert_eq!(idx.held(0, BlockView::Seen), 5);
    }

    #[test]
    fn a_prefix_outlives_its_extensions() {
        let mut idx = BlockIndex::new(3);
        idx.record_seen(0, &hs(&[1, 2, 3, 4, 5]));
        assert_eq!(idx.depth(&hs(&[1, 2, 3, 4, 5]), 0, BlockView::Seen), 3);
        assert_eq!(idx.held(0, BlockView::Seen), 3);
        assert_eq!(idx.dropped(), 2);
        // Lowering a bound trims at once, deepest (least recently used) first.
        idx.set_bound(0, 1);
        assert_eq!(idx.depth(&hs(&[1, 2, 3]), 0, BlockView::Seen), 1);
        assert_eq!(idx.len(), 1);
    }
}
