//! kvc's own block key: a chained hash of a block's tokens.
//!
//! The rule, the same for every engine:
//!
//! ```text
//! key(block 0) = xxh3_64( 0u64 as 8 little-endian bytes ‖ tokens of block 0 as u32 little-endian )
//! key(block i) = xxh3_64( key(block i-1) as 8 little-endian bytes ‖ tokens of block i as u32 little-endian )
//! ```
//!
//! xxh3-64 with seed 0 (`xxhash_rust::xxh3::xxh3_64`), blocks of the engine's block size, only
//! full blocks. A key therefore names a block *and* everything before it: two sequences share
//! key `i` only if they share their first `(i + 1) × block_size` tokens (up to 64-bit
//! collisions). A request is chained the same way ([`chain_keys`]) to look it up.
//!
//! Cost: one xxh3 call per block, each waiting for the key before it, so hashing a request is
//! bound by latency, not bandwidth — several times the cost of the index lookup for small
//! blocks (`cargo xtask bench` reports both: `events.overlap_4096_tokens_8_workers_ns` with
//! the keys given, `events.overlap_hashed_4096_tokens_8_workers_ns` hashing first). A router
//! computes a request's keys once and reuses them for every worker of that block size.

use xxhash_rust::xxh3::xxh3_64;

/// kvc's key for one block (see the module doc for the rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockKey(pub u64);

/// Hashes blocks one after another, reusing one buffer.
#[derive(Debug, Default)]
pub struct KeyHasher {
    buf: Vec<u8>,
}

impl KeyHasher {
    /// A hasher with an empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// The key of the block holding `tokens`, chained to `parent` (`None` for a first block).
    pub fn key(&mut self, parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
        let len = 8 + 4 * tokens.len();
        if self.buf.len() != len {
            self.buf.resize(len, 0);
        }
        hash_into(&mut self.buf, parent, tokens)
    }

    /// Appends the keys of the full blocks of `tokens` (chained from `parent`) to `out`.
    pub fn chain_into(
        &mut self,
        parent: Option<BlockKey>,
        tokens: &[u32],
        block_size: usize,
        out: &mut Vec<BlockKey>,
    ) {
        if block_size == 0 {
            return;
        }
        let len = 8 + 4 * block_size;
        if self.buf.len() != len {
            self.buf.resize(len, 0);
        }
        let mut parent = parent;
        out.reserve(tokens.len() / block_size);
        for block in tokens.chunks_exact(block_size) {
            let k = hash_into(&mut self.buf, parent, block);
            out.push(k);
            parent = Some(k);
        }
    }
}

/// The key of one block, `buf` being exactly `8 + 4 × tokens.len()` bytes of scratch.
#[inline]
fn hash_into(buf: &mut [u8], parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
    let (head, body) = buf.split_at_mut(8);
    head.copy_from_slice(&parent.map_or(0, |p| p.0).to_le_bytes());
    for (dst, t) in body.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    BlockKey(xxh3_64(buf))
}

/// The keys of the full blocks of a request's `tokens` in blocks of `block_size` tokens (a
/// partial last block has no key; a zero block size gives none).
pub fn chain_keys(tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
    let mut out = Vec::new();
    KeyHasher::new().chain_into(None, tokens, block_size, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_is_xxh3_over_parent_then_tokens() {
        let tokens = [1u32, 2, 3, 4, 5];
        let keys = chain_keys(&tokens, 2);
        assert_eq!(keys.len(), 2, "the partial last block has no key");
        let mut first = 0u64.to_le_bytes().to_vec();
        first.extend([1, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(keys[0], BlockKey(xxh3_64(&first)));
        let mut second = keys[0].0.to_le_bytes().to_vec();
        second.extend([3, 0, 0, 0, 4, 0, 0, 0]);
        assert_eq!(keys[1], BlockKey(xxh3_64(&second)));
        assert_eq!(chain_keys(&tokens, 0), vec![]);
    }

    #[test]
    fn keys_depend_on_every_earlier_token() {
        let a = chain_keys(&[1, 2, 3, 4], 2);
        let b = chain_keys(&[9, 2, 3, 4], 2);
        assert_ne!(a[1], b[1]);
        let c = chain_keys(&[1, 2, 3, 4, 7, 7], 2);
        assert_eq!(a[..], c[..2]);
    }
}
