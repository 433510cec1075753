//! How a text prompt becomes token ids and chained block ids, the rules every kvc component
//! shares: the router's HTTP front hashes client prompts with them, and the standalone
//! simulated workers tokenize the prompts they serve with them, so both see the same blocks.
//!
//! - [`chat_prompt`]: the text of a chat request (a simple template over role and content);
//! - [`fallback_tokens`]: one token per whitespace-separated word (the router's default
//!   tokenizer when no `tokenizer.json` is configured);
//! - [`block_hashes`]: chained 64-bit ids per block of token ids ([`chain_hash`]: one of them);
//! - the output lengths assumed when a request does not say.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Output length assumed when SGLang's `/generate` gives no `sampling_params.max_new_tokens`
/// (SGLang's default).
pub const DEFAULT_MAX_NEW_TOKENS: u64 = 128;

/// Output length assumed when `/v1/completions` gives no `max_tokens` (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: u64 = 16;

/// Output length assumed when `/v1/chat/completions` gives neither `max_completion_tokens` nor
/// `max_tokens`.
pub const DEFAULT_CHAT_MAX_TOKENS: u64 = 128;

/// The prompt text of a chat request, for hashing and session inference (an engine applies
/// its own chat template to the messages): each message as `<|role|>\ncontent\n`, in order,
/// then `<|assistant|>\n`. A conversation that grows turn by turn (previous messages, the
/// assistant's reply, a new user message) therefore extends the previous turn's text, and its
/// blocks repeat.
///
/// ```
/// use kvc_core::text::chat_prompt;
///
/// let turn1 = chat_prompt([("system", "Be brief."), ("user", "Hi")]);
/// assert_eq!(turn1, "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n");
/// let turn2 = chat_prompt([
///     ("system", "Be brief."),
///     ("user", "Hi"),
///     ("assistant", "Hello."),
///     ("user", "Bye"),
/// ]);
/// assert!(turn2.starts_with(&turn1));
/// ```
pub fn chat_prompt<'a>(messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut text = String::new();
    for (role, content) in messages {
        text.push_str("<|");
        text.push_str(role);
        text.push_str("|>\n");
        text.push_str(content);
        text.push('\n');
    }
    text.push_str(GENERATION_PROMPT);
    text
}

/// The generation prompt that ends a chat request's text ([`chat_prompt`]).
pub const GENERATION_PROMPT: &str = "<|assistant|>\n";

/// A chat request's tokens, as block hashes and session inference need them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTokens {
    /// Every token: each message's, then the generation prompt's (the input length).
    pub tokens: Vec<u32>,
    /// How many leading tokens are the messages' (what block hashes cover).
    pub messages: usize,
    /// Where each message's tokens start, in order (session inference finds a conversation's
    /// newest user message and its last message by them).
    pub starts: Vec<usize>,
}

impl ChatTokens {
    /// The tokens block hashes cover: the messages', not the generation prompt's.
    pub fn hashed(&self) -> &[u32] {
        &self.tokens[..self.messages]
    }
}

/// The tokens of a chat request: each message of [`chat_prompt`]'s template
/// (`<|role|>\ncontent\n`) tokenized on its own by `tokenize`, in order, then the
/// [`GENERATION_PROMPT`]. A request that extends a conversation by appending messages — a
/// user message after a user message, an assistant reply and a user message, a tool result —
/// then has the earlier request's message tokens as its prefix, whatever the tokenizer would
/// merge across a message boundary; the generation prompt, which the next request replaces
/// with a message, is left out of what block hashes cover ([`ChatTokens::hashed`]) and
/// counted in the input length.
///
/// ```
/// use kvc_core::text::{chat_tokens, fallback_tokens};
///
/// let one = chat_tokens([("system", "Be brief."), ("user", "Hi")], fallback_tokens);
/// let two = chat_tokens(
///     [("system", "Be brief."), ("user", "Hi"), ("user", "Still there?")],
///     fallback_tokens,
/// );
/// assert_eq!(one.tokens.len(), 6); // <|system|> Be brief. <|user|> Hi <|assistant|>
/// assert_eq!(one.messages, 5);
/// assert_eq!(one.starts, [0, 3]);
/// assert!(two.hashed().starts_with(one.hashed()));
/// ```
pub fn chat_tokens<'a>(
    messages: impl IntoIterator<Item = (&'a str, &'a str)>,
    mut tokenize: impl FnMut(&str) -> Vec<u32>,
) -> ChatTokens {
    let mut tokens = Vec::new();
    let mut starts = Vec::new();
    let mut text = String::new();
    for (role, content) in messages {
        starts.push(tokens.len());
        text.clear();
        text.push_str("<|");
        text.push_str(role);
        text.push_str("|>\n");
        text.push_str(content);
        text.push('\n');
        tokens.extend(tokenize(&text));
    }
    let messages = tokens.len();
    tokens.extend(tokenize(GENERATION_PROMPT));
    ChatTokens {
        tokens,
        messages,
        starts,
    }
}

/// The fallback tokenizer for text prompts: one token per whitespace-separated word, its id the
/// low 32 bits of the word's 64-bit XXH3 hash.
///
/// It does not match any model's tokenizer (token counts differ from an engine's), but it is
/// deterministic and prefix-preserving: a prompt that extends another by whole words gets the
/// other's tokens as its prefix. It sits on the router's request path, so an ASCII prompt
/// (the common case) is split byte by byte; any other is split on Unicode whitespace, which
/// gives the same words for ASCII text.
///
/// ```
/// use kvc_core::text::fallback_tokens;
///
/// let a = fallback_tokens("the cat sat");
/// let b = fallback_tokens("the cat  sat on\nthe mat");
/// assert_eq!(a.len(), 3);
/// assert_eq!(b.len(), 6);
/// assert_eq!(a[..], b[..3]);
/// assert_eq!(b[0], b[4]);
/// ```
pub fn fallback_tokens(text: &str) -> Vec<u32> {
    let word = |w: &[u8]| xxh3_64(w) as u32;
    if !text.is_ascii() {
        return text
            .split_whitespace()
            .map(|w| word(w.as_bytes()))
            .collect();
    }
    let bytes = text.as_bytes();
    let mut tokens = Vec::with_capacity(bytes.len() / 4);
    let mut start = None;
    for (i, &b) in bytes.iter().enumerate() {
        let space = matches!(b, b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r');
        match (space, start) {
            (true, Some(s)) => {
                tokens.push(word(&bytes[s..i]));
                start = None;
            }
            (false, None) => start = Some(i),
            _ => {}
        }
    }
    if let Some(s) = start {
        tokens.push(word(&bytes[s..]));
    }
    tokens
}

/// Chained block ids of `tokens`: one id per block of `block` tokens (the last, partial block
/// included), each the 64-bit XXH3 hash, seeded with the previous block's id (0 for the first
/// block), of the block's token ids as little-endian `u32`s.
///
/// Two prompts share their leading ids exactly as far as they share whole leading blocks of
/// tokens, so a router sees the prompt's real prefix structure.
///
/// ```
/// use kvc_core::BlockSize;
/// use kvc_core::text::block_hashes;
///
/// let block = BlockSize::new(4).unwrap();
/// let a = block_hashes(&[1, 2, 3, 4, 5, 6], block);
/// let b = block_hashes(&[1, 2, 3, 4, 9], block);
/// assert_eq!(a.len(), 2);
/// assert_eq!(a[0], b[0]);
/// assert_ne!(a[1], b[1]);
/// ```
pub fn block_hashes(tokens: &[u32], block: crate::BlockSize) -> Vec<u64> {
    let size = block.tokens() as usize;
    let mut bytes = Vec::with_capacity(size * 4);
    let mut prev = 0u64;
    tokens
        .chunks(size)
        .map(|chunk| {
            prev = chain_into(&mut bytes, prev, chunk);
            prev
        })
        .collect()
}

/// The id [`block_hashes`] gives a block of `tokens` (any number of them: a partial block's
/// id too) after a block whose id is `prev` (0 for the first block).
///
/// ```
/// use kvc_core::BlockSize;
/// use kvc_core::text::{block_hashes, chain_hash};
///
/// let ids = block_hashes(&[1, 2, 3, 4, 5], BlockSize::new(4).unwrap());
/// assert_eq!(chain_hash(0, &[1, 2, 3, 4]), ids[0]);
/// assert_eq!(chain_hash(ids[0], &[5]), ids[1]);
/// ```
pub fn chain_hash(prev: u64, tokens: &[u32]) -> u64 {
    chain_into(&mut Vec::with_capacity(tokens.len() * 4), prev, tokens)
}

fn chain_into(bytes: &mut Vec<u8>, prev: u64, tokens: &[u32]) -> u64 {
    bytes.clear();
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    xxh3_64_with_seed(bytes, prev)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BlockSize;

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
    fn a_growing_chat_extends_its_tokens_and_blocks() {
        let block = BlockSize::new(4).unwrap();
        let one = fallback_tokens(&chat_prompt([
            ("system", "be brief and kind"),
            ("user", "hi"),
        ]));
        let two = fallback_tokens(&chat_prompt([
            ("system", "be brief and kind"),
            ("user", "hi"),
            ("assistant", "hello there"),
            ("user", "bye"),
        ]));
        assert_eq!(one[..], two[..one.len()]);
        let (a, b) = (block_hashes(&one, block), block_hashes(&two, block));
        let full = one.len() / 4;
        assert_eq!(a[..full], b[..full]);
        assert!(fallback_tokens(" \n\t").is_empty());
    }

    proptest::proptest! {
        /// The ASCII fast path splits exactly where Unicode whitespace does.
        #[test]
        fn ascii_prompts_split_as_unicode_whitespace_does(text in "[ -~\t\n\x0b\x0c\r\x1c-\x1f]{0,64}") {
            let words: Vec<u32> = text
                .split_whitespace()
                .map(|w| xxh3_64(w.as_bytes()) as u32)
                .collect();
            proptest::prop_assert_eq!(fallback_tokens(&text), words);
        }
    }

    #[test]
    fn non_ascii_prompts_split_on_unicode_whitespace() {
        // U+00A0 (no-break space) and U+3000 (ideographic space) separate words.
        let t = fallback_tokens("caf\u{e9}\u{a0}cr\u{e8}me\u{3000}br\u{fb}l\u{e9}e x");
        assert_eq!(t.len(), 4);
        assert_eq!(t[3], fallback_tokens("x")[0]);
        assert_eq!(t[0], fallback_tokens("caf\u{e9}")[0]);
    }
}
