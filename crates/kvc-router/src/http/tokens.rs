//! Block hashes of a prompt: chained ids per block of token ids, and the tokenizers of text
//! prompts (a Hugging Face `tokenizer.json`, or the whitespace fallback). The pure rules
//! (`block_hashes`, `fallback_tokens`) live in [`kvc_core::text`], shared with the simulated
//! workers.

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
        Ok(Tokenizer {
            loaded: Some(Arc::new(Loaded {
                path: path.to_owned(),
                tokenizer,
            })),
        })
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
        match loaded.tokenizer.encode_fast(text, true) {
            Ok(encoding) => encoding.get_ids().to_vec(),
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
