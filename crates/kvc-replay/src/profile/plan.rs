//! The sweep plan of `kvc-replay profile`: which requests measure what, sized from the engine's
//! limits, and the token-id prompts they carry, each never seen before. Pure: no I/O.
//!
//! Every size is a whole number of the engine's KV blocks, so a prefix sent alone is cached in
//! full and a prompt's new tokens start a block of their own.
//!
//! | sweep | points |
//! |---|---|
//! | prefill | new tokens `n` halving from `min(chunk, cap)` (at most [`PREFILL_SIZES`] sizes), nothing cached; then for a cached prefix of a quarter and of half the cap, the smallest, the middle and the largest `n` that fit |
//! | decode | batches [`DECODE_BATCHES`], each stream of context `L` = half the cap (less the generated tokens, and so that 8 streams fit in half the pool) and a quarter of that |
//! | transfer | [`TRANSFER_SIZES`] prompt lengths halving from the cap, less the generated tokens |
//! | intake | chat prompts of a sixteenth, an eighth and a quarter of the cap in words (a word is a token or more) |

use super::ProfileError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Token ids of the prompts are drawn from `MIN_TOKEN_ID..MAX_TOKEN_ID`: clear of the low ids
/// tokenizers keep for special tokens, and inside a 4,096-token vocabulary.
pub const MIN_TOKEN_ID: u32 = 100;
/// See [`MIN_TOKEN_ID`].
pub const MAX_TOKEN_ID: u32 = 4000;

/// Batch sizes of the decode sweep.
pub const DECODE_BATCHES: [usize; 4] = [1, 2, 4, 8];

/// Most sizes of new tokens without a cached prefix in the prefill sweep.
pub const PREFILL_SIZES: usize = 6;

/// Prompt lengths of the transfer sweep.
pub const TRANSFER_SIZES: usize = 5;

/// Fewest words of an intake prompt.
pub const MIN_INTAKE_WORDS: u64 = 16;

/// Tokens the decode engine generates in the transfer sweep (the first one is timed).
pub const TRANSFER_OUTPUT: u64 = 2;

/// The smallest context cap a plan is made for, in tokens.
pub const MIN_CONTEXT: u64 = 256;

/// What bounds the sweeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The engine's chunked-prefill budget: a prefill point's new tokens stay within it.
    pub chunk_tokens: u64,
    /// The longest context any request has (input and output).
    pub context_cap: u64,
    /// The engine's KV pool, in tokens.
    pub pool_tokens: u64,
    /// The engine's KV block size, in tokens.
    pub block_size: u64,
    /// Tokens each decode stream generates.
    pub decode_tokens: u64,
    /// Measurements of each point.
    pub repeats: usize,
    /// Whether a prefill/decode pair is measured.
    pub transfer: bool,
}

/// One prefill point: `new` tokens prefilled after `cached` ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillPoint {
    /// Tokens to prefill.
    pub new: u64,
    /// Tokens of the prefix sent first, to be found cached.
    pub cached: u64,
}

/// One decode point: `batch` concurrent streams of `context` prompt tokens each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePoint {
    /// Streams at once.
    pub batch: usize,
    /// Prompt tokens of each stream.
    pub context: u64,
}

/// The sweeps to run.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The prefill points, in order.
    pub prefill: Vec<PrefillPoint>,
    /// The decode points, in order.
    pub decode: Vec<DecodePoint>,
    /// The prompt lengths of the transfer sweep (empty without a pair).
    pub transfer: Vec<u64>,
    /// The words of each intake sweep's chat prompt.
    pub intake: Vec<u64>,
    /// Measurements of each point.
    pub repeats: usize,
    /// Tokens each decode stream generates.
    pub decode_tokens: u64,
}

/// `x` rounded down to a whole number of `block` tokens.
fn blocks(x: u64, block: u64) -> u64 {
    x / block * block
}

impl Plan {
    /// The plan for an engine with these limits.
    pub fn new(l: &Limits) -> Result<Plan, ProfileError> {
        if l.block_size == 0 || l.repeats == 0 || l.chunk_tokens == 0 {
            return Err(ProfileError::Invalid(
                "the block size, the chunk budget and the repeats must be at least 1".into(),
            ));
        }
        if l.decode_tokens < 8 {
            return Err(ProfileError::Invalid(format!(
                "decode streams need at least 8 tokens each to time their steps (got {})",
                l.decode_tokens
            )));
        }
        let bs = l.block_size;
        let cap = l.context_cap.min(l.pool_tokens);
        if cap < MIN_CONTEXT.max(4 * bs) || cap < 4 * l.decode_tokens {
            return Err(ProfileError::Invalid(format!(
                "the context cap ({cap} tokens: the smallest of --max-context, the model's \
                 max_model_len and the KV pool) is too small to profile: at least {} tokens",
                MIN_CONTEXT.max(4 * bs).max(4 * l.decode_tokens)
            )));
        }
        let n_max = blocks(l.chunk_tokens.min(cap), bs);
        if n_max < bs {
            return Err(ProfileError::Invalid(format!(
                "the chunked-prefill budget ({} tokens) is smaller than one KV block ({bs})",
                l.chunk_tokens
            )));
        }
        let mut new_sizes = Vec::new();
        let mut n = n_max;
        while new_sizes.len() < PREFILL_SIZES && n >= bs {
            let b = blocks(n, bs);
            if new_sizes.last() != Some(&b) {
                new_sizes.push(b);
            }
            n /= 2;
        }
        new_sizes.reverse();
        let mut prefill: Vec<PrefillPoint> = new_sizes
            .iter()
            .map(|&new| PrefillPoint { new, cached: 0 })
            .collect();
        let mut prefixes = vec![blocks(cap / 4, bs), blocks(cap / 2, bs)];
        prefixes.dedup();
        for cached in prefixes.into_iter().filter(|&c| c > 0) {
            let fitting: Vec<u64> = new_sizes
                .iter()
                .copied()
                .filter(|n| cached + n <= cap)
                .collect();
            let mut chosen = Vec::new();
            if let (Some(&first), Some(&last)) = (fitting.first(), fitting.last()) {
                chosen.extend([first, fitting[fitting.len() / 2], last]);
            }
            chosen.dedup();
            prefill.extend(chosen.into_iter().map(|new| PrefillPoint { new, cached }));
        }
        let k = l.decode_tokens;
        let long = blocks(
            (cap / 2)
                .min(cap.saturating_sub(k))
                .min((l.pool_tokens / 2 / 8).saturating_sub(k)),
            bs,
        );
        let short = blocks(long / 4, bs).max(bs);
        if long < 2 * bs {
            return Err(ProfileError::Invalid(format!(
                "the KV pool ({} tokens) cannot hold 8 decode streams of two blocks each",
                l.pool_tokens
            )));
        }
        let mut decode = Vec::new();
        for context in [short, long] {
            for batch in DECODE_BATCHES {
                decode.push(DecodePoint { batch, context });
            }
        }
        let mut transfer = Vec::new();
        if l.transfer {
            let top = blocks(cap - TRANSFER_OUTPUT, bs);
            for i in (0..TRANSFER_SIZES).rev() {
                let n = blocks(top >> i, bs);
                if n >= bs && transfer.last() != Some(&n) {
                    transfer.push(n);
                }
            }
        }
        let mut intake: Vec<u64> = [cap / 16, cap / 8, cap / 4]
            .into_iter()
            .map(|w| w.max(MIN_INTAKE_WORDS))
            .collect();
        intake.dedup();
        Ok(Plan {
            prefill,
            decode,
            transfer,
            intake,
            repeats: l.repeats,
            decode_tokens: k,
        })
    }

    /// Requests the plan sends: a cached prefill point's prefix and its prompt, one per decode
    /// stream, and three per transfer point (P warmed, P's call, D's call), each repeated; and
    /// per intake point a `/detokenize` call for its text, its chat and token-id prompts sent
    /// once to be cached, then each once a repetition.
    pub fn requests(&self) -> usize {
        let prefill: usize = self
            .prefill
            .iter()
            .map(|p| if p.cached > 0 { 2 } else { 1 })
            .sum();
        // Each decode stream's prompt is sent alone once first, to be cached.
        let decode: usize = self.decode.iter().map(|p| 2 * p.batch).sum();
        (prefill + decode + 3 * self.transfer.len()) * self.repeats
            + self.intake.len() * (3 + 2 * self.repeats)
    }
}

/// The token-id prompts of one run: each prompt its own ChaCha8 stream of the seed, so that
/// a prompt depends only on the seed and its number, and two prompts share no prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prompts {
    seed: u64,
}

impl Prompts {
    /// Prompts seeded with `seed` (a run with another seed shares no prefix with this one).
    pub fn new(seed: u64) -> Self {
        Prompts { seed }
    }

    /// Prompt number `stream`: `len` token ids in `MIN_TOKEN_ID..MAX_TOKEN_ID`.
    pub fn tokens(&self, stream: u64, len: u64) -> Vec<u32> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(stream);
        let span = u64::from(MAX_TOKEN_ID - MIN_TOKEN_ID);
        (0..len)
            .map(|_| MIN_TOKEN_ID + ((u128::from(rng.next_u64()) * u128::from(span)) >> 64) as u32)
            .collect()
    }

    /// Prompt number `stream` as `count` words of three lowercase letters, separated by
    /// spaces: the text of a chat prompt no other prompt of the run starts with.
    pub fn words(&self, stream: u64, count: u64) -> String {
        let mut out = String::with_capacity(count as usize * 4);
        for (i, id) in self.tokens(stream, count).into_iter().enumerate() {
            if i > 0 {
                out.push(' ');
            }
            for k in 0..3 {
                out.push(char::from(b'a' + (id / 26u32.pow(k) % 26) as u8));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            chunk_tokens: 8192,
            context_cap: 8192,
            pool_tokens: 92_160,
            block_size: 16,
            decode_tokens: 32,
            repeats: 2,
            transfer: true,
        }
    }

    #[test]
    fn the_default_plan_stays_within_its_bounds() {
        let l = limits();
        let p = Plan::new(&l).unwrap();
        let fresh: Vec<u64> = p
            .prefill
            .iter()
            .filter(|x| x.cached == 0)
            .map(|x| x.new)
            .collect();
        assert_eq!(fresh, [256, 512, 1024, 2048, 4096, 8192]);
        let cached: Vec<(u64, u64)> = p
            .prefill
            .iter()
            .filter(|x| x.cached > 0)
            .map(|x| (x.cached, x.new))
            .collect();
        assert_eq!(
            cached,
            [
                (2048, 256),
                (2048, 1024),
                (2048, 4096),
                (4096, 256),
                (4096, 1024),
                (4096, 4096)
            ]
        );
        for x in &p.prefill {
            assert!(x.new <= l.chunk_tokens && x.new + x.cached <= l.context_cap);
            assert_eq!((x.new % 16, x.cached % 16), (0, 0));
        }
        assert_eq!(p.decode.len(), 8);
        assert_eq!(
            (p.decode[0].context, p.decode[7].context, p.decode[7].batch),
            (1024, 4096, 8)
        );
        assert_eq!(p.transfer, [496, 1008, 2032, 4080, 8176]);
        // 6 + 12 prefill, 2 × 15 decode streams each sent first to be cached, 5 × 3 transfer
        // calls; twice.
        assert_eq!(p.intake, [512, 1024, 2048]);
        assert_eq!(p.requests(), (18 + 2 * 30 + 15) * 2 + 3 * (3 + 2 * 2));
        assert!(p.requests() <= 210);
    }

    #[test]
    fn a_small_chunk_or_pool_shrinks_the_plan() {
        let l = Limits {
            chunk_tokens: 512,
            context_cap: 4096,
            pool_tokens: 16_384,
            block_size: 32,
            transfer: false,
            ..limits()
        };
        let p = Plan::new(&l).unwrap();
        assert!(p.prefill.iter().all(|x| x.new <= 512));
        assert_eq!(p.prefill[0].new, 32);
        // 8 streams of the long context fit in half the pool.
        let long = p.decode.iter().map(|d| d.context).max().unwrap();
        assert!(8 * (long + 32) <= 16_384 / 2, "{long}");
        assert!(p.transfer.is_empty());
        let tiny = Limits {
            context_cap: 100,
            ..l
        };
        let err = Plan::new(&tiny).unwrap_err().to_string();
        assert!(err.contains("too small to profile"), "{err}");
    }

    #[test]
    fn prompts_are_deterministic_distinct_and_in_range() {
        let p = Prompts::new(7);
        let a = p.tokens(1, 64);
        assert_eq!(a, Prompts::new(7).tokens(1, 64));
        assert_eq!(a.len(), 64);
        assert!(a.iter().all(|t| (MIN_TOKEN_ID..MAX_TOKEN_ID).contains(t)));
        // Another stream, or another seed, starts differently.
        assert_ne!(a[..4], p.tokens(2, 64)[..4]);
        assert_ne!(a[..4], Prompts::new(8).tokens(1, 64)[..4]);
        // A longer prompt of the same stream extends the shorter one.
        assert_eq!(p.tokens(1, 128)[..64], a[..]);
        let w = p.words(3, 5);
        assert_eq!(w, Prompts::new(7).words(3, 5));
        assert_eq!(w.len(), 5 * 4 - 1);
        assert!(
            w.split(' ')
                .all(|x| x.len() == 3 && x.bytes().all(|b| b.is_ascii_lowercase()))
        );
        assert_ne!(w, p.words(4, 5));
    }
}
