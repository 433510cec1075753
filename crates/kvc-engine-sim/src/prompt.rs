//! Prompt text for a trace request: words that repeat exactly where the trace's blocks repeat.
//!
//! A trace carries block ids, not text. To drive a router that only sees text (a text-prefix
//! router, or `kvc-router` with its one-token-per-word fallback), each token position of a
//! block becomes one word determined by the block id and the position within the block, so two
//! prompts share a text prefix exactly as far as they share leading block ids (a partial last
//! block shares the prefix of its words). Words are six lowercase letters or digits, separated
//! by single spaces.

use kvc_core::{BlockHash, BlockSize};

const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

/// SplitMix64's finaliser: a well-mixed 64-bit function of `x`.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Appends the word at `position` of block `block` to `out`.
fn push_word(out: &mut String, block: u64, position: u64) {
    let mut v = mix(block ^ mix(position));
    for _ in 0..6 {
        out.push(char::from(ALPHABET[(v & 31) as usize]));
        v >>= 5;
    }
}

/// The prompt of a request of `input_length` tokens with block ids `hashes` (blocks of
/// `block` tokens): `input_length` words. Positions past the listed blocks (a record with too
/// few ids) take words of a block derived from the last listed id and the block's index.
///
/// ```
/// use kvc_core::{BlockHash, BlockSize};
/// use kvc_engine_sim::prompt::prompt_text;
///
/// let block = BlockSize::new(4).unwrap();
/// let turn1 = prompt_text(&[BlockHash(7), BlockHash(8)], 6, block);
/// let turn2 = prompt_text(&[BlockHash(7), BlockHash(9), BlockHash(3)], 10, block);
/// assert_eq!(turn1.split(' ').count(), 6);
/// // The first block's four words are shared; the second block differs.
/// let words = |s: &str| s.split(' ').map(str::to_owned).collect::<Vec<_>>();
/// assert_eq!(words(&turn1)[..4], words(&turn2)[..4]);
/// assert_ne!(words(&turn1)[4], words(&turn2)[4]);
/// ```
pub fn prompt_text(hashes: &[BlockHash], input_length: u64, block: BlockSize) -> String {
    let bs = u64::from(block.tokens());
    let mut out = String::with_capacity(input_length as usize * 7);
    for p in 0..input_length {
        let id = block_id_at(hashes, p, bs);
        if p > 0 {
            out.push(' ');
        }
        push_word(&mut out, id, p % bs);
    }
    out
}

/// The block id of position `p` (blocks of `bs` tokens): the listed id, or one derived from
/// the last listed id and the block's index past the list.
fn block_id_at(hashes: &[BlockHash], p: u64, bs: u64) -> u64 {
    let b = p / bs;
    match hashes.get(b as usize) {
        Some(h) => h.0,
        None => mix(hashes.last().map_or(0, |h| h.0) ^ b.rotate_left(32)),
    }
}

/// Prompt text for a real engine's tokenizer: a list of words each of which, written after a
/// space, is one token of the engine's vocabulary, so that a prompt of `n` positions is `n`
/// tokens and two prompts share exactly as many leading tokens as they share leading
/// positions (where [`prompt_text`]'s made-up words split into several tokens each, a
/// different number per word). Every position is written as a space and its word.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptWords {
    words: Vec<String>,
}

impl PromptWords {
    /// The fewest words a list may hold: with fewer, blocks would share too many words by
    /// chance.
    pub const MIN_WORDS: usize = 16;

    /// A word list; `None` if it holds fewer than [`Self::MIN_WORDS`] words, or a word that is
    /// empty or holds whitespace.
    pub fn new(mut words: Vec<String>) -> Option<PromptWords> {
        words.sort();
        words.dedup();
        let ok = words.len() >= Self::MIN_WORDS
            && words
                .iter()
                .all(|w| !w.is_empty() && !w.chars().any(char::is_whitespace));
        ok.then_some(PromptWords { words })
    }

    /// The words, sorted.
    pub fn words(&self) -> &[String] {
        &self.words
    }

    /// The prompt of a request of `input_length` positions with block ids `hashes` (blocks of
    /// `block` tokens): ` word` per position, the word chosen by the block id and the position
    /// within the block (as [`prompt_text`] does).
    ///
    /// ```
    /// use kvc_core::{BlockHash, BlockSize};
    /// use kvc_engine_sim::prompt::PromptWords;
    ///
    /// let words = PromptWords::new((0..20).map(|i| format!("w{i}")).collect()).unwrap();
    /// let block = BlockSize::new(4).unwrap();
    /// let a = words.text(&[BlockHash(7), BlockHash(8)], 6, block);
    /// let b = words.text(&[BlockHash(7), BlockHash(9)], 8, block);
    /// assert_eq!(a.split(' ').count(), 7); // a leading space, then six words
    /// let w = |s: &str| s.split(' ').skip(1).map(str::to_owned).collect::<Vec<_>>();
    /// assert_eq!(w(&a)[..4], w(&b)[..4]);
    /// ```
    pub fn text(&self, hashes: &[BlockHash], input_length: u64, block: BlockSize) -> String {
        let bs = u64::from(block.tokens());
        let n = self.words.len() as u64;
        let mut out = String::with_capacity(input_length as usize * 8);
        for p in 0..input_length {
            let id = block_id_at(hashes, p, bs);
            let v = mix(id ^ mix(p % bs));
            out.push(' ');
            out.push_str(&self.words[(v % n) as usize]);
        }
        out
    }
}

/// A 64-bit key of a prompt's text (FNV-1a), used to find the trace request a worker was sent.
pub fn prompt_key(text: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<&str> {
        s.split(' ').collect()
    }

    #[test]
    fn word_count_is_the_input_length_and_words_are_six_characters() {
        let block = BlockSize::new(512).unwrap();
        let text = prompt_text(&[BlockHash(1), BlockHash(2), BlockHash(3)], 1100, block);
        let w = words(&text);
        assert_eq!(w.len(), 1100);
        assert!(w.iter().all(|w| w.len() == 6 && w.is_ascii()));
        assert_eq!(prompt_text(&[], 0, block), "");
    }

    #[test]
    fn shared_blocks_share_text_and_others_do_not() {
        let block = BlockSize::new(512).unwrap();
        let a = prompt_text(&[BlockHash(10), BlockHash(11), BlockHash(12)], 1536, block);
        let b = prompt_text(&[BlockHash(10), BlockHash(11), BlockHash(99)], 1536, block);
        let (wa, wb) = (words(&a), words(&b));
        assert_eq!(wa[..1024], wb[..1024]);
        let differing = wa[1024..]
            .iter()
            .zip(&wb[1024..])
            .filter(|(x, y)| x != y)
            .count();
        assert!(differing > 500, "only {differing} of 512 words differ");
        // A partial last block is the prefix of the full block with the same id.
        let partial = prompt_text(&[BlockHash(10), BlockHash(11), BlockHash(12)], 1100, block);
        assert!(a.starts_with(&partial));
        // Words within a block are not one repeated word.
        let distinct: std::collections::BTreeSet<&str> = wa[..512].iter().copied().collect();
        assert!(distinct.len() > 500);
    }

    #[test]
    fn prompt_keys_tell_prompts_apart() {
        let block = BlockSize::new(16).unwrap();
        let a = prompt_text(&[BlockHash(1)], 16, block);
        let b = prompt_text(&[BlockHash(1)], 15, block);
        assert_ne!(prompt_key(&a), prompt_key(&b));
        assert_eq!(prompt_key(&a), prompt_key(&a.clone()));
    }

    #[test]
    fn missing_ids_still_give_every_word() {
        let block = BlockSize::new(4).unwrap();
        let t = prompt_text(&[BlockHash(5)], 12, block);
        let w = words(&t);
        assert_eq!(w.len(), 12);
        assert_ne!(w[4..8], w[8..12]);
    }

    #[test]
    fn word_lists_give_one_word_per_position_shared_where_blocks_are() {
        let list = PromptWords::new((0..40).map(|i| format!("x{i}")).collect()).unwrap();
        let block = BlockSize::new(32).unwrap();
        let a = list.text(&[BlockHash(1), BlockHash(2), BlockHash(3)], 80, block);
        let b = list.text(&[BlockHash(1), BlockHash(2), BlockHash(4)], 96, block);
        assert!(a.starts_with(' ') && !a.contains("  "));
        let (wa, wb): (Vec<&str>, Vec<&str>) = (words(&a)[1..].to_vec(), words(&b)[1..].to_vec());
        assert_eq!(wa.len(), 80);
        assert_eq!(wb.len(), 96);
        assert_eq!(wa[..64], wb[..64]);
        let differing = wa[64..]
            .iter()
            .zip(&wb[64..])
            .filter(|(x, y)| x != y)
            .count();
        assert!(differing > 8, "only {differing} of 16 words differ");
        assert!(wa.iter().all(|w| list.words().iter().any(|l| l == w)));
        // The same inputs give the same text.
        assert_eq!(
            a,
            list.text(&[BlockHash(1), BlockHash(2), BlockHash(3)], 80, block)
        );
    }

    #[test]
    fn short_or_blank_word_lists_are_refused() {
        assert_eq!(
            PromptWords::new((0..15).map(|i| format!("x{i}")).collect()),
            None
        );
        let mut words: Vec<String> = (0..20).map(|i| format!("x{i}")).collect();
        // Duplicates do not count twice.
        assert_eq!(PromptWords::new(vec!["x".to_owned(); 20]), None);
        words.push("two words".into());
        assert_eq!(PromptWords::new(words.clone()), None);
        words.pop();
        words.push(String::new());
        assert_eq!(PromptWords::new(words), None);
    }
}
