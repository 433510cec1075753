//! A block prefix cache with LRU eviction and pinning, as kept by prefill and colocated
//! workers.
//!
//! Blocks are chained ids, so a cache hit is a leading run of blocks. Blocks that running
//! requests use are pinned and never evicted; unpinned blocks leave in least-recently-used order,
//! deepest block first among blocks used at the same time (leaves before their prefixes).

use kvc_core::BlockHash;
use std::collections::{BTreeSet, HashMap};

#[derive(Debug, Clone, Copy)]
struct Meta {
    last_use: u64,
    depth: u32,
    pins: u32,
}

/// A prefix cache of whole blocks.
#[derive(Debug, Default)]
pub(crate) struct PrefixCache {
    blocks: HashMap<BlockHash, Meta>,
    /// Unpinned blocks by (last use, reversed depth, id): the first entry leaves first.
    lru: BTreeSet<(u64, u32, BlockHash)>,
    pinned: usize,
}

impl PrefixCache {
    /// Cached blocks, pinned or not.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Unpinned (evictable) blocks.
    pub(crate) fn evictable(&self) -> usize {
        self.blocks.len() - self.pinned
    }

    /// Leading blocks of `hashes` present in the cache.
    pub(crate) fn match_len(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    fn lru_key(h: BlockHash, m: &Meta) -> (u64, u32, BlockHash) {
        (m.last_use, u32::MAX - m.depth, h)
    }

    /// Pins the leading `n` blocks of `hashes`, inserting missing ones, and marks them used at
    /// `now`. Returns how many blocks were newly inserted.
    pub(crate) fn pin(&mut self, hashes: &[BlockHash], now: u64) -> usize {
        let mut inserted = 0;
        for (depth, h) in hashes.iter().enumerate() {
            match self.blocks.get_mut(h) {
                Some(m) => {
                    if m.pins == 0 {
                        self.lru.remove(&Self::lru_key(*h, m));
                        self.pinned += 1;
                    }
                    m.pins += 1;
                    m.last_use = now;
                }
                None => {
                    self.blocks.insert(
                        *h,
                        Meta {
                            last_use: now,
                            depth: depth as u32,
                            pins: 1,
                        },
                    );
                    self.pinned += 1;
                    inserted += 1;
                }
            }
        }
        inserted
    }

    /// Releases one pin of each block of `hashes` (as pinned by [`PrefixCache::pin`]).
    pub(crate) fn unpin(&mut self, hashes: &[BlockHash], now: u64) {
        for h in hashes {
            if let Some(m) = self.blocks.get_mut(h) {
                debug_assert!(m.pins > 0, "unpin of an unpinned block");
                m.pins = m.pins.saturating_sub(1);
                m.last_use = now;
                if m.pins == 0 {
                    self.pinned -= 1;
                    self.lru.insert(Self::lru_key(*h, m));
                }
            }
        }
    }

    /// Evicts up to `n` unpinned blocks; returns how many left.
    pub(crate) fn evict(&mut self, n: usize) -> usize {
        let mut done = 0;
        while done < n {
            let Some(key) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&key.2);
            done += 1;
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(ids: &[u64]) -> Vec<BlockHash> {
        ids.iter().copied().map(BlockHash).collect()
    }

    #[test]
    fn pinned_blocks_survive_eviction_and_lru_order_holds() {
        let mut c = PrefixCache::default();
        assert_eq!(c.pin(&h(&[1, 2, 3]), 10), 3);
        assert_eq!(c.pin(&h(&[1, 2, 4]), 20), 1);
        assert_eq!(c.len(), 4);
        assert_eq!(c.evictable(), 0);
        assert_eq!(c.evict(10), 0, "everything is pinned");
        c.unpin(&h(&[1, 2, 3]), 30);
        // 1 and 2 are still pinned by the second request; 3 is free.
        assert_eq!(c.evictable(), 1);
        c.unpin(&h(&[1, 2, 4]), 40);
        assert_eq!(c.evictable(), 4);
        assert_eq!(c.match_len(&h(&[1, 2, 3, 9])), 3);
        // Oldest first (3 at t=30), then deepest first among t=40: 4, 2, 1.
        assert_eq!(c.evict(1), 1);
        assert_eq!(c.match_len(&h(&[1, 2, 3])), 2);
        assert_eq!(c.evict(1), 1);
        assert_eq!(c.match_len(&h(&[1, 2, 4])), 2);
        assert_eq!(c.evict(5), 2);
        assert_eq!(c.len(), 0);
    }
}
