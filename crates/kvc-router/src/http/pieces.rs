//! Tokenizing a text piece by piece, with a bounded cache of the pieces' tokens: a prompt that
//! repeats an earlier prompt's text (the next turn of a conversation, a system prompt shared by
//! many sessions) costs only its new part, where a whole encoding costs its full length on every
//! turn (~3.5 ms for a 3,000-token prompt with a byte-level BPE, on the request path).
//!
//! A text is cut at *cut points* chosen from the text alone: after at least [`PIECE_BYTES`]
//! bytes since the previous cut, the first space whose previous byte is an ASCII letter or digit
//! and whose next byte is an ASCII letter. A word-splitting pre-tokenizer (the byte-level
//! regexes of GPT-2, Llama 3 and Qwen; `Whitespace`) always starts a pre-token there, and
//! tokens never cross a pre-token, so the tokens of the whole text are the tokens of its
//! pieces in order, between the special tokens the tokenizer adds around a text. Cut points
//! depend only on the bytes before them, so two prompts sharing a prefix share every piece that
//! ends inside it. [`Piecewise::for_tokenizer`] checks the equality on a probe text that mixes
//! words, code, numbers, punctuation, runs of spaces, new lines and non-ASCII letters; a
//! tokenizer where it fails is used whole.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The shortest piece (bytes), except the last of a text.
pub(crate) const PIECE_BYTES: usize = 1024;

/// Token ids kept in the cache at most (4 bytes each): 16 Mi ids, 64 MiB.
pub(crate) const CACHE_TOKENS: usize = 16 << 20;

/// The byte ranges of `text`'s pieces, in order, covering it; each but the last at least `min`
/// bytes long (`min` ≥ 1). An empty text is one empty piece.
pub(crate) fn piece_ranges(text: &str, min: usize) -> Vec<std::ops::Range<usize>> {
    let b = text.as_bytes();
    let min = min.max(1);
    let mut ranges = Vec::with_capacity(b.len() / min + 1);
    let mut start = 0;
    let mut i = min;
    while i + 1 < b.len() {
        if b[i] == b' ' && b[i - 1].is_ascii_alphanumeric() && b[i + 1].is_ascii_alphabetic() {
            ranges.push(start..i);
            start = i;
            i += min;
        } else {
            i += 1;
        }
    }
    ranges.push(start..b.len());
    ranges
}

/// Pieces' tokens by the 128-bit hash of their bytes, in two generations: a lookup that finds
/// a piece in the older one moves it to the newer; when the newer holds half the budget, it
/// becomes the older and the older is dropped. So at most `budget` ids (plus one piece) are
/// held, and a piece used within the last half-budget of insertions is kept.
#[derive(Debug)]
struct PieceCache {
    newer: HashMap<u128, Arc<[u32]>>,
    older: HashMap<u128, Arc<[u32]>>,
    newer_tokens: usize,
    budget: usize,
}

impl PieceCache {
    fn new(budget: usize) -> Self {
        PieceCache {
            newer: HashMap::new(),
            older: HashMap::new(),
            newer_tokens: 0,
            budget,
        }
    }

    fn get(&mut self, key: u128) -> Option<Arc<[u32]>> {
        if let Some(ids) = self.newer.get(&key) {
            return Some(ids.clone());
        }
        let ids = self.older.remove(&key)?;
        self.insert(key, ids.clone());
        Some(ids)
    }

    fn insert(&mut self, key: u128, ids: Arc<[u32]>) {
        self.newer_tokens += ids.len().max(1);
        self.newer.insert(key, ids);
        if self.newer_tokens > self.budget / 2 {
            self.older = std::mem::take(&mut self.newer);
            self.newer_tokens = 0;
        }
    }

    #[cfg(test)]
    fn tokens(&self) -> usize {
        self.newer
            .values()
            .chain(self.older.values())
            .map(|v| v.len())
            .sum()
    }
}

/// Piecewise encoding for one tokenizer: the special tokens it adds before and after a text,
/// and the cache of pieces.
#[derive(Debug)]
pub(crate) struct Piecewise {
    before: Vec<u32>,
    after: Vec<u32>,
    cache: Mutex<PieceCache>,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// A probe text for [`Piecewise::for_tokenizer`]: prose, code, numbers, punctuation, runs of
/// spaces and new lines, non-ASCII letters, in a fixed order.
fn probe_text() -> String {
    let parts = [
        "The quick brown fox, said the agent, ran 12 tests in 3.5 s. ",
        "fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
        "def foo(a, b):\n\treturn a+b  # don't, it's   spaced\n\n",
        "Ünïcödé wörds und Straße; naïve café. 東京 and x_y_z == 42\r\n",
        "$ git diff --stat HEAD~1 | tail -n 3\n--- a/src/lib.rs\n+++ b/src/lib.rs\n",
        "{\"role\": \"tool\", \"content\": \"ok\"}   ...  !!  ??\n",
    ];
    let mut text = String::new();
    for round in 0..12 {
        for (i, p) in parts.iter().enumerate() {
            if (round + i) % 3 == 0 {
                text.push_str("word ");
            }
            text.push_str(p);
        }
    }
    text
}

impl Piecewise {
    /// Piecewise encoding for `tokenizer` with a cache of at most `budget` ids, or `None` when
    /// it would not give the whole encoding's ids (checked on a probe text cut every few
    /// bytes), or the special tokens around a text cannot be told apart.
    pub(crate) fn for_tokenizer(tokenizer: &tokenizers::Tokenizer, budget: usize) -> Option<Self> {
        let ids = |text: &str, special: bool| {
            tokenizer
                .encode_fast(text, special)
                .ok()
                .map(|e| e.get_ids().to_vec())
        };
        // The special tokens around a text: the one-word encoding with them, less it without.
        let with = ids("word", true)?;
        let bare = ids("word", false)?;
        let at = (0..=with.len().checked_sub(bare.len())?)
            .find(|&i| with[i..i + bare.len()] == bare[..])?;
        let piecewise = Piecewise {
            before: with[..at].to_vec(),
            after: with[at + bare.len()..].to_vec(),
            cache: Mutex::new(PieceCache::new(budget)),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        };
        let probe = probe_text();
        let whole = ids(&probe, true)?;
        for min in [1, 7, 64] {
            let mut parts = piecewise.before.clone();
            for r in piece_ranges(&probe, min) {
                parts.extend(ids(&probe[r], false)?);
            }
            parts.extend_from_slice(&piecewise.after);
            if parts != whole {
                return None;
            }
        }
        Some(piecewise)
    }

    /// The ids of `text` with the special tokens a text gets: every piece's from the cache, or
    /// encoded by `tokenizer` and cached.
    pub(crate) fn encode(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
    ) -> tokenizers::Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(self.before.len() + text.len() / 3);
        ids.extend_from_slice(&self.before);
        for range in piece_ranges(text, PIECE_BYTES) {
            let piece = &text[range];
            let key = xxhash_rust::xxh3::xxh3_128(piece.as_bytes());
            let cached = self.cache.lock().get(key);
            match cached {
                Some(piece_ids) => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    ids.extend_from_slice(&piece_ids);
                }
                None => {
                    self.misses.fetch_add(1, Ordering::Relaxed);
                    let encoding = tokenizer.encode_fast(piece, false)?;
                    let piece_ids: Arc<[u32]> = encoding.get_ids().into();
                    ids.extend_from_slice(&piece_ids);
                    self.cache.lock().insert(key, piece_ids);
                }
            }
        }
        ids.extend_from_slice(&self.after);
        Ok(ids)
    }

    /// Pieces found in the cache and pieces encoded, since the start.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_text_and_cut_only_before_a_space_between_words() {
        let text = "alpha beta  gamma 12 delta,epsilon zeta\neta theta iota";
        for min in [1, 3, 10, 100] {
            let ranges = piece_ranges(text, min);
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges.last().unwrap().end, text.len());
            for pair in ranges.windows(2) {
                assert_eq!(pair[0].end, pair[1].start, "min {min}");
                assert!(pair[0].len() >= min, "min {min}: {ranges:?}");
            }
            for r in &ranges[1..] {
                let b = text.as_bytes();
                assert_eq!(b[r.start], b' ');
                assert!(b[r.start - 1].is_ascii_alphanumeric());
                assert!(b[r.start + 1].is_ascii_alphabetic());
            }
        }
        // Every allowed cut with min 1: before " beta", " gamma" (its run of two spaces is
        // not), " delta" (after a digit), " zeta", " theta", " iota".
        let starts: Vec<_> = piece_ranges(text, 1)
            .iter()
            .map(|r| &text[r.start..])
            .map(|s| s.split_whitespace().next().unwrap().to_owned())
            .collect();
        assert_eq!(
            starts,
            ["alpha", "beta", "delta,epsilon", "zeta", "theta", "iota"]
        );
        assert_eq!(piece_ranges("", 8), vec![0..0]);
        assert_eq!(piece_ranges("one", 1), vec![0..3]);
        // A prefix's cut points are the longer text's, up to where the prefix ends.
        let long = format!("{text} kappa lambda mu nu xi omicron");
        let short = piece_ranges(text, 4);
        let longer = piece_ranges(&long, 4);
        assert_eq!(short[..short.len() - 1], longer[..short.len() - 1]);
    }

    #[test]
    fn the_cache_keeps_at_most_its_budget_and_what_was_used_last() {
        let mut c = PieceCache::new(10);
        let ids = |n: u32| -> Arc<[u32]> { (0..n).collect::<Vec<_>>().into() };
        c.insert(1, ids(3));
        c.insert(2, ids(3));
        assert_eq!(c.tokens(), 6);
        // Over half the budget: both move to the older generation.
        assert_eq!(c.get(1).unwrap().len(), 3); // 1 back in the newer
        c.insert(3, ids(4)); // newer 7 > 5: {1, 3} older, 2 dropped
        assert!(c.get(2).is_none());
        assert_eq!(c.get(3).unwrap().len(), 4);
        assert!(c.tokens() <= 10 + 4);
        for k in 10..100 {
            c.insert(k, ids(2));
            assert!(c.tokens() <= 10 + 2, "{}", c.tokens());
        }
        assert!(c.get(1).is_none());
        assert!(c.get(99).is_some());
    }
}
