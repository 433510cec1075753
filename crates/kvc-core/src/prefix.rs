//! Block-prefix helpers.
//!
//! Block ids are chained, so reuse is always a *leading* run of blocks. Only full blocks are
//! reusable: a partial last block gets a new id once the context grows.

use crate::ids::{BlockHash, BlockSize};

/// Number of leading blocks two hash lists share.
///
/// ```
/// use kvc_core::{BlockHash, prefix::shared_prefix_blocks};
/// let a = [1, 2, 3, 4].map(BlockHash);
/// let b = [1, 2, 9].map(BlockHash);
/// assert_eq!(shared_prefix_blocks(&a, &b), 2);
/// ```
pub fn shared_prefix_blocks(a: &[BlockHash], b: &[BlockHash]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Tokens of a request of `input_length` tokens that `matched_blocks` leading cached blocks
/// cover: only full blocks of this input count, so the result never exceeds the input.
pub fn reusable_tokens(matched_blocks: usize, input_length: u64, block_size: BlockSize) -> u64 {
    let full = block_size.full_blocks(input_length);
    (matched_blocks as u64).min(full) * u64::from(block_size.tokens())
}

/// Tokens of `input_length` that are not covered by `cached_tokens`.
pub fn uncached_tokens(input_length: u64, cached_tokens: u64) -> u64 {
    input_length.saturating_sub(cached_tokens)
}

/// Reusable tokens of `request` given the blocks of an earlier request held in a cache.
pub fn reusable_from(
    cached: &[BlockHash],
    request: &[BlockHash],
    input_length: u64,
    block_size: BlockSize,
) -> u64 {
    reusable_tokens(
        shared_prefix_blocks(cached, request),
        input_length,
        block_size,
    )
}
