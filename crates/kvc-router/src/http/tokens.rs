//! Block hashes of a prompt: chained ids per block of token ids, and the tokenizers of text
//! prompts (a Hugging Face `tokenizer.json`, or the whitespace fallback). The pure rules
//! (`block_hashes`, `fallback_tokens`) live in [`kvc_core::text`], shared with the simulated
//! workers.

use super::pieces::{CACHE_TOKENS, Piecewise};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use kvc_core::text::{block_hashes, fallback_tokens};

/// A tokenizer file that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tokenizer {}: {message}", .path.display())]
pub struct TokenizerError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub message: String,
}

/// How the HTTP front turns a text prompt into token ids for its block hashes: a Hugging Face
/// `tokenizer.json` ([`Tokenizer::from_file`]), or the whitespace fallback
/// ([`fallback_tokens`], the default).
///
/// With the model's own tokenizer the block hashes line up with the engine's KV blocks, and
/// the input length the policy sees is the engine's. Truncation and padding configured in the
/// file are turned off (a prompt is hashed whole); special tokens are added as the engine adds
/// them to a text prompt.
///
/// ```
/// use kvc_router::http::Tokenizer;
///
/// let words = Tokenizer::fallback();
/// assert_eq!(words.path(), None);
/// assert_eq!(words.encode("the cat sat").len(), 3);
/// ```
#[derive(Clone, Default)]
pub struct Tokenizer {
    loaded: Option<Arc<Loaded>>,
}

struct Loaded {
    path: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    /// Piece-by-piece encoding with a cache ([`super::pieces`]), where it gives the whole
    /// encoding's ids.
    piecewise: Option<Piecewise>,
}

impl Tokenizer {
    /// The whitespace fallback ([`fallback_tokens`]).
    pub fn fallback() -> Self {
        Tokenizer::default()
    }

    /// Loads a Hugging Face `tokenizer.json`. The file must parse, and encode a short probe
    /// text; the error names the file and what is wrong.
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let fail = |message: String| TokenizerError {
            path: path.to_owned(),
            message,
        };
        let bytes = std::fs::read(path).map_err(|e| fail(format!("cannot read it: {e}")))?;
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| fail(format!("not a tokenizer.json: {e}")))?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| fail(format!("cannot turn truncation off: {e}")))?;
        tokenizer.with_padding(None);
        tokenizer
            .encode_fast("kvc tokenizer check", true)
            .map_err(|e| fail(format!("cannot encode text: {e}")))?;
        let piecewise = Piecewise::for_tokenizer(&tokenizer, CACHE_TOKENS);
        if piecewise.is_none() {
            tracing::info!(
                tokenizer = %path.display(),
                "this tokenizer does not split text where the router cuts it into pieces: \
                 every prompt is tokenized whole"
            );
        }
        Ok(Tokenizer {
            loaded: Some(Arc::new(Loaded {
                path: path.to_owned(),
                tokenizer,
                piecewise,
            })),
        })
    }

    /// Whether text is tokenized piece by piece with a cache ([`super::pieces`]): a tokenizer
    /// file whose tokens never cross the router's cut points. `false` for the fallback.
    pub fn piecewise(&self) -> bool {
        self.loaded
            .as_deref()
            .is_some_and(|l| l.piecewise.is_some())
    }

    /// Pieces of text found in the cache and pieces tokenized, since the start (zeros when
    /// not [`Tokenizer::piecewise`]).
    pub fn piece_counts(&self) -> (u64, u64) {
        self.loaded
            .as_deref()
            .and_then(|l| l.piecewise.as_ref())
            .map_or((0, 0), Piecewise::counts)
    }

    /// The file it was loaded from; `None` for the fallback.
    pub fn path(&self) -> Option<&Path> {
        self.loaded.as_deref().map(|l| l.path.as_path())
    }

    /// The token ids of `text`. Should the file's tokenizer fail on some text (e.g. a word-level
    /// vocabulary without an unknown token), that text falls back to [`fallback_tokens`] (logged).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let Some(loaded) = &self.loaded else {
            return fallback_tokens(text);
        };
        let ids = match &loaded.piecewise {
            Some(p) => p.encode(&loaded.tokenizer, text),
            None => loaded
                .tokenizer
                .encode_fast(text, true)
                .map(|e| e.get_ids().to_vec()),
        };
        match ids {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(
                    tokenizer = %loaded.path.display(),
                    error = %e,
                    "text not tokenized; using the whitespace fallback"
                );
                fallback_tokens(text)
            }
        }
    }
}

impl Tokenizer {
    /// [`Tokenizer::encode`] for a request handler: a tokenizer file's encoding runs on the
    /// blocking pool (long prompts take a while); the fallback runs inline.
    pub(crate) async fn encode_off_thread(&self, text: &str) -> Vec<u32> {
        if self.loaded.is_none() {
            return fallback_tokens(text);
        }
        let (tokenizer, owned) = (self.clone(), text.to_owned());
        match tokio::task::spawn_blocking(move || tokenizer.encode(&owned)).await {
            Ok(tokens) => tokens,
            Err(e) => {
                tracing::warn!(error = %e, "tokenizer task failed; using the whitespace fallback");
                fallback_tokens(text)
            }
        }
    }
}

/// A chat's messages as (role, text) pairs of `&str`.
fn pairs(m: &[(String, String)]) -> impl Iterator<Item = (&str, &str)> {
    m.iter().map(|(r, c)| (r.as_str(), c.as_str()))
}

impl Tokenizer {
    /// A chat's tokens ([`kvc_core::text::chat_tokens`]: message by message, then the
    /// generation prompt), off the request thread as [`Tokenizer::encode_off_thread`].
    pub(crate) async fn encode_chat_off_thread(
        &self,
        messages: &[(String, String)],
    ) -> kvc_core::text::ChatTokens {
        if self.loaded.is_none() {
            return kvc_core::text::chat_tokens(pairs(messages), fallback_tokens);
        }
        let (tokenizer, owned) = (self.clone(), messages.to_vec());
        match tokio::task::spawn_blocking(move || {
            kvc_core::text::chat_tokens(pairs(&owned), |t| tokenizer.encode(t))
        })
        .await
        {
            Ok(tokens) => tokens,
            Err(e) => {
                tracing::warn!(error = %e, "tokenizer task failed; using the whitespace fallback");
                kvc_core::text::chat_tokens(pairs(messages), fallback_tokens)
            }
        }
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.path() {
            Some(p) => write!(f, "Tokenizer({})", p.display()),
            None => f.write_str("Tokenizer(whitespace fallback)"),
        }
    }
}

/// Two tokenizers are equal when both are the fallback or both were loaded from the same path.
impl PartialEq for Tokenizer {
    fn eq(&self, other: &Self) -> bool {
        self.path() == other.path()
    }
}

impl Eq for Tokenizer {}

#[cfg(test)]
mod tests {
    use super::super::pieces::{PIECE_BYTES, piece_ranges};
    use super::*;
    use kvc_core::BlockSize;

    /// A Hugging Face `tokenizer.json`: a word-level model over `words` (ids from 1, `[UNK]` is
    /// 0) after a whitespace pre-tokenizer.
    fn word_level_json(words: &[&str]) -> String {
        let mut vocab = serde_json::Map::new();
        vocab.insert("[UNK]".into(), 0.into());
        for (i, w) in words.iter().enumerate() {
            vocab.insert((*w).into(), (i + 1).into());
        }
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        })
        .to_string()
    }

    /// A temporary directory, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str) -> Dir {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir()
                .join(format!("kvc-router-tok-{tag}-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Dir(dir)
        }

        fn file(&self, name: &str, text: &str) -> PathBuf {
            let path = self.0.join(name);
            std::fs::write(&path, text).unwrap();
            path
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_tokenizer_file_gives_its_ids_and_their_block_hashes() {
        let dir = Dir::new("ok");
        let path = dir.file(
            "tokenizer.json",
            &word_level_json(&["the", "cat", "sat", "on"]),
        );
        let t = Tokenizer::from_file(&path).unwrap();
        assert_eq!(t.path(), Some(path.as_path()));
        assert_eq!(t.encode("the cat sat"), vec![1, 2, 3]);
        // Punctuation splits off (whitespace pre-tokenizer); unknown words are `[UNK]`.
        assert_eq!(
            t.encode("the  cat, sat on the mat"),
            vec![1, 2, 0, 3, 4, 1, 0]
        );
        let block = BlockSize::new(2).unwrap();
        assert_eq!(
            block_hashes(&t.encode("the cat sat on"), block),
            block_hashes(&[1, 2, 3, 4], block)
        );
        assert_ne!(t.encode("the cat sat"), fallback_tokens("the cat sat"));
        assert_eq!(t, Tokenizer::from_file(&path).unwrap());
        assert_ne!(t, Tokenizer::fallback());
        assert!(format!("{t:?}").contains("tokenizer.json"));
        assert_eq!(
            format!("{:?}", Tokenizer::fallback()),
            "Tokenizer(whitespace fallback)"
        );
    }

    /// A byte-level BPE `tokenizer.json` (GPT-2's pre-tokenizer) with a few merges, that adds
    /// `<s>` before and `</s>` after every text.
    fn byte_level_json() -> String {
        let mut vocab = serde_json::Map::new();
        let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
            .into_iter()
            .collect();
        alphabet.sort_unstable();
        for c in alphabet {
            let id = vocab.len();
            vocab.insert(c.to_string(), id.into());
        }
        let merges = [
            ("Ġ", "t"),
            ("Ġt", "h"),
            ("Ġth", "e"),
            ("e", "r"),
            ("i", "n"),
            ("Ġ", "a"),
            ("o", "n"),
            ("Ġ", "c"),
            ("Ġc", "a"),
        ];
        for (a, b) in merges {
            let id = vocab.len();
            vocab.insert(format!("{a}{b}"), id.into());
        }
        let (bos, eos) = (vocab.len(), vocab.len() + 1);
        let special = |id: usize, content: &str| {
            serde_json::json!({"id": id, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        };
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [special(bos, "<s>"), special(eos, "</s>")],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                "trim_offsets": true, "use_regex": true},
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {
                    "<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]},
                    "</s>": {"id": "</s>", "ids": [eos], "tokens": ["</s>"]}}},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab,
                "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()},
        })
        .to_string()
    }

    /// A long agent-like prompt: `turns` turns of prose, code and tool output.
    fn conversation(turns: usize) -> String {
        let mut text = String::from("You are a coding agent. Use the tools.\n");
        for t in 0..turns {
            text.push_str(&format!(
                "<user> turn {t}: the cat ran the tests, then fix the error in src/lib.rs \
                 line {}.\n<tool> $ cargo test\n  running 12 tests ... ok  ({t}.5 s)\n\
                 fn main() {{ let x = vec![1, 2, {t}]; }}\nÜnïcödé café 東京\n\n",
                t * 7
            ));
        }
        text
    }

    #[test]
    fn a_byte_level_tokenizer_is_used_piece_by_piece_with_the_whole_texts_ids() {
        let dir = Dir::new("pieces");
        let path = dir.file("tokenizer.json", &byte_level_json());
        let t = Tokenizer::from_file(&path).unwrap();
        assert!(t.piecewise());
        let whole = tokenizers::Tokenizer::from_file(&path).unwrap();
        let ids = |text: &str| whole.encode_fast(text, true).unwrap().get_ids().to_vec();
        for text in [
            "",
            "the",
            "  the cat  ",
            &conversation(1),
            &conversation(60),
        ] {
            assert_eq!(t.encode(text), ids(text), "{text:?}");
        }
        let (bos, eos) = (265, 266);
        let first = t.encode(&conversation(60));
        assert_eq!((first[0], *first.last().unwrap()), (bos, eos));

        // The next turn repeats the earlier text: only its last pieces are tokenized again.
        let (hits0, misses0) = t.piece_counts();
        let pieces = piece_ranges(&conversation(61), PIECE_BYTES).len() as u64;
        assert!(pieces > 8, "{pieces}");
        assert_eq!(t.encode(&conversation(61)), ids(&conversation(61)));
        let (hits, misses) = t.piece_counts();
        assert!(
            misses - misses0 <= 2,
            "{} of {pieces} tokenized",
            misses - misses0
        );
        assert_eq!((hits - hits0) + (misses - misses0), pieces);
    }

    #[test]
    fn a_tokenizer_whose_tokens_cross_the_cut_points_is_used_whole() {
        // No pre-tokenizer: a word-level vocabulary sees the whole text as one word.
        let dir = Dir::new("whole");
        let mut v: serde_json::Value = serde_json::from_str(&word_level_json(&["a"])).unwrap();
        v["pre_tokenizer"] = serde_json::Value::Null;
        let path = dir.file("tokenizer.json", &v.to_string());
        let t = Tokenizer::from_file(&path).unwrap();
        assert!(!t.piecewise());
        let long = "alpha beta ".repeat(400);
        assert_eq!(t.encode(&long), vec![0]);
        assert_eq!(t.piece_counts(), (0, 0));
        assert!(!Tokenizer::fallback().piecewise());
    }

    #[test]
    fn truncation_and_padding_of_the_file_are_turned_off() {
        let dir = Dir::new("trunc");
        let mut v: serde_json::Value = serde_json::from_str(&word_level_json(&["a", "b"])).unwrap();
        v["truncation"] = serde_json::json!({"direction": "Right", "max_length": 2,
            "strategy": "LongestFirst", "stride": 0});
        v["padding"] = serde_json::json!({"strategy": {"Fixed": 8}, "direction": "Right",
            "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "[UNK]"});
        let path = dir.file("tokenizer.json", &v.to_string());
        let t = Tokenizer::from_file(&path).unwrap();
        assert_eq!(t.encode("a b a b a"), vec![1, 2, 1, 2, 1]);
    }

    #[test]
    fn bad_tokenizer_files_are_errors_naming_the_file() {
        let dir = Dir::new("bad");
        let missing = dir.0.join("missing.json");
        let err = Tokenizer::from_file(&missing).unwrap_err();
        assert_eq!(err.path, missing);
        assert!(err.message.contains("cannot read"), "{err}");
        assert!(err.to_string().contains("missing.json"), "{err}");

        let cases = [
            (
                "garbage.json",
                "{not json".to_owned(),
                "not a tokenizer.json",
            ),
            (
                "model.json",
                word_level_json(&["a"]).replace("WordLevel", "NoSuchModel"),
                "not a tokenizer.json",
            ),
            (
                "no-unk.json",
                word_level_json(&["a"])
                    .replace("\"unk_token\":\"[UNK]\"", "\"unk_token\":\"<missing>\""),
                "cannot encode",
            ),
        ];
        for (name, text, want) in cases {
            let path = dir.file(name, &text);
            let err = Tokenizer::from_file(&path).unwrap_err();
            assert_eq!(err.path, path);
            assert!(err.message.contains(want), "{name}: {err}");
            assert!(err.to_string().contains(name), "{err}");
        }
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

    #[tokio::test]
    async fn text_goes_through_the_tokenizer_off_the_request_thread() {
        let fallback = Tokenizer::fallback();
        assert_eq!(
            fallback.encode_off_thread("a b c").await,
            fallback_tokens("a b c")
        );
        let dir = Dir::new("off-thread");
        let path = dir.0.join("tokenizer.json");
        std::fs::write(&path, word_level_json(&["a", "b", "c"])).unwrap();
        let tokenizer = Tokenizer::from_file(&path).unwrap();
        assert_eq!(
            tokenizer.encode_off_thread("a b c zzz").await,
            vec![1, 2, 3, 0]
        );
    }
}
