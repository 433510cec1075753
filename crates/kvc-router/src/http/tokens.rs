//! Block hashes of a prompt: chained ids per block of token ids, and the fallback tokenizer
//! used for text when no tokenizer is configured.

use kvc_core::BlockSize;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// Chained block ids of `tokens`: one id per block of `block` tokens (the last, partial block
/// included), each the 64-bit FNV-1a hash of the previous block's id (0 for the first block)
/// followed by the block's token ids (little-endian `u32`s).
///
/// Two prompts share their leading ids exactly as far as they share whole leading blocks of
/// tokens, so the router sees the prompt's real prefix structure.
///
/// ```
/// use kvc_core::BlockSize;
/// use kvc_router::http::block_hashes;
///
/// let block = BlockSize::new(4).unwrap();
/// let a = block_hashes(&[1, 2, 3, 4, 5, 6], block);
/// let b = block_hashes(&[1, 2, 3, 4, 9], block);
/// assert_eq!(a.len(), 2);
/// assert_eq!(a[0], b[0]);
/// assert_ne!(a[1], b[1]);
/// ```
pub fn block_hashes(tokens: &[u32], block: BlockSize) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks(block.tokens() as usize)
        .map(|chunk| {
            let mut h = fnv(FNV_OFFSET, &prev.to_le_bytes());
            for t in chunk {
                h = fnv(h, &t.to_le_bytes());
            }
            prev = h;
            h
        })
        .collect()
}

/// The fallback tokenizer for text prompts: one token per whitespace-separated word, its id the
/// low 32 bits of the word's 64-bit FNV-1a hash.
///
/// It does not match any model's tokenizer (token counts differ from the engine's), but it is
/// deterministic and prefix-preserving: a prompt that extends another by whole words gets the
/// other's tokens as its prefix. It serves tests and clusters without a configured tokenizer.
///
/// ```
/// use kvc_router::http::fallback_tokens;
///
/// let a = fallback_tokens("the cat sat");
/// let b = fallback_tokens("the cat  sat on\nthe mat");
/// assert_eq!(a.len(), 3);
/// assert_eq!(b.len(), 6);
/// assert_eq!(a[..], b[..3]);
/// assert_eq!(b[0], b[4]);
/// ```
pub fn fallback_tokens(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| fnv(FNV_OFFSET, w.as_bytes()) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_ids_depend_on_every_earlier_block() {
        let block = BlockSize::new(2).unwrap();
        let a = block_hashes(&[1, 2, 3, 4, 5, 6], block);
        let b = block_hashes(&[9, 2, 3, 4, 5, 6], block);
        assert_eq!(a.len(), 3);
        // Same tokens in blocks 2 and 3, but a different first block: every id differs.
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        // A partial last block counts as a block.
        assert_eq!(block_hashes(&[1, 2, 3], block).len(), 2);
        assert_eq!(block_hashes(&[1, 2, 3], block)[0], a[0]);
        assert!(block_hashes(&[], block).is_empty());
    }

    #[test]
    fn default_block_of_512_tokens() {
        let block = BlockSize::new(kvc_core::DEFAULT_BLOCK_SIZE).unwrap();
        let tokens: Vec<u32> = (0..1_300).collect();
        let ids = block_hashes(&tokens, block);
        assert_eq!(ids.len(), 3);
        let longer: Vec<u32> = (0..1_900).collect();
        let ids2 = block_hashes(&longer, block);
        assert_eq!(ids2.len(), 4);
        assert_eq!(ids[..2], ids2[..2]);
        assert_ne!(ids[2], ids2[2]);
    }
}
