//! Standalone simulated workers (`kvc-replay workers`): no trace behind them, so a request is
//! whatever a client sends. Its prompt is tokenized with the router's rules
//! ([`kvc_core::text`]: a chat request's messages through [`chat_tokens`], text through
//! [`fallback_tokens`], token-id prompts as given) and cut into chained block ids
//! ([`block_hashes`]) of [`StandaloneOptions::block_size`] tokens, which the engine model's
//! prefix caches match; the output length is the request's `max_completion_tokens` or
//! `max_tokens`, else the router's defaults ([`DEFAULT_CHAT_MAX_TOKENS`],
//! [`DEFAULT_MAX_TOKENS`]).
//!
//! **Sessions.** The engine keeps a session's KV resident on the worker that served it. A
//! request's session is named by the session header ([`StandaloneOptions::session_header`],
//! which `kvc-router` sets on every worker request of a session, keyed or inferred): the
//! engine session is [`SessionId::from_key`] of its value, as the router's is, and the
//! workers' KV events name it by that value. A request without the header is a session of its
//! own (served with the worker's prefix cache only). Two requests of one session in flight at
//! once cannot share its KV: the later one runs as a session of its own (see
//! `engine_thread`).

use crate::model::Job;
use crate::publish::SessionLabels;
use axum::http::HeaderMap;
use kvc_core::HashIds;
use kvc_core::text::{
    DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_TOKENS, block_hashes, chat_tokens, fallback_tokens,
};
use kvc_core::{BlockHash, BlockSize, SessionId};
use std::sync::atomic::{AtomicU64, Ordering};

/// Settings of standalone workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StandaloneOptions {
    /// Tokens per block of the prefix caches (and of the router's policy, in the configuration
    /// written for it).
    pub block_size: BlockSize,
    /// The header naming a request's session (`kvc-router` sends `x-session-id`).
    pub session_header: String,
}

impl Default for StandaloneOptions {
    fn default() -> Self {
        StandaloneOptions {
            block_size: BlockSize::new(16).unwrap_or_default(),
            session_header: "x-session-id".into(),
        }
    }
}

/// What standalone workers share: the options, the session labels, fresh session ids.
#[derive(Debug)]
pub(crate) struct Standalone {
    pub(crate) opts: StandaloneOptions,
    pub(crate) labels: SessionLabels,
    next_session: AtomicU64,
}

/// A request's prompt as the worker received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PromptIn {
    /// Text (`/v1/completions`' `prompt`).
    Text(String),
    /// Token ids (`/v1/completions`' `prompt` as an array).
    Tokens(Vec<u32>),
    /// Chat messages, (role, content text): `/v1/chat/completions`' `messages`, or those
    /// of a Messages or Responses request ([`kvc_core::agent_apis`]).
    Chat(Vec<(String, String)>),
}

impl Standalone {
    pub(crate) fn new(opts: StandaloneOptions, labels: SessionLabels) -> Self {
        Standalone {
            opts,
            labels,
            next_session: AtomicU64::new(0),
        }
    }

    /// A session no client names.
    pub(crate) fn fresh_session(&self) -> SessionId {
        let n = self.next_session.fetch_add(1, Ordering::Relaxed);
        SessionId::from_key(&format!("kvc-sim-anonymous-{n}"))
    }

    /// A prompt's tokens, how many of them its block hashes cover (a chat's cover its
    /// messages, not the closing generation prompt, as the router's do), and the output
    /// length of its API when the request names none.
    fn tokens(prompt: &PromptIn) -> (Vec<u32>, usize, u64) {
        match prompt {
            PromptIn::Text(t) => {
                let t = fallback_tokens(t);
                let n = t.len();
                (t, n, DEFAULT_MAX_TOKENS)
            }
            PromptIn::Tokens(t) => (t.clone(), t.len(), DEFAULT_MAX_TOKENS),
            PromptIn::Chat(m) => {
                let c = chat_tokens(
                    m.iter().map(|(r, c)| (r.as_str(), c.as_str())),
                    fallback_tokens,
                );
                (c.tokens, c.messages, DEFAULT_CHAT_MAX_TOKENS)
            }
        }
    }

    /// How many tokens `prompt` is (a job's input), without a job.
    pub(super) fn input_tokens(prompt: &PromptIn) -> u64 {
        Self::tokens(prompt).0.len() as u64
    }

    /// The engine job of a request: `prompt` tokenized, `max_tokens` (else the API's default)
    /// to generate, the session of `headers`.
    pub(super) fn job(
        &self,
        prompt: &PromptIn,
        max_tokens: Option<u64>,
        headers: &HeaderMap,
    ) -> Job {
        let (tokens, hashed, default_output) = Self::tokens(prompt);
        let key = headers
            .get(self.opts.session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .filter(|k| !k.is_empty());
        let session = match key {
            Some(k) => {
                let s = SessionId::from_key(k);
                self.labels.insert(s, k);
                s
            }
            None => self.fresh_session(),
        };
        let hashes: HashIds = block_hashes(&tokens[..hashed], self.opts.block_size)
            .into_iter()
            .map(BlockHash)
            .collect();
        Job {
            id: 0,
            session,
            input: tokens.len() as u64,
            output: max_tokens.unwrap_or(default_output).max(1),
            hashes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(session: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(s) = session {
            h.insert("x-session-id", s.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_chat_is_tokenized_and_named_as_the_router_does() {
        let labels = SessionLabels::default();
        let s = Standalone::new(StandaloneOptions::default(), labels.clone());
        let chat = |n: usize| {
            let mut m = vec![(
                "user".to_owned(),
                "a b c d e f g h i j k l m n o p q".to_owned(),
            )];
            for i in 0..n {
                m.push(("assistant".into(), format!("answer {i} with some words")));
                m.push(("user".into(), format!("question {i} again")));
            }
            PromptIn::Chat(m)
        };
        let one = s.job(&chat(0), None, &headers(Some("conv-1")));
        let two = s.job(&chat(3), Some(7), &headers(Some("conv-1")));
        assert_eq!(one.session, SessionId::from_key("conv-1"));
        assert_eq!(two.session, one.session);
        assert_eq!(labels.get(one.session).as_deref(), Some("conv-1"));
        // `<|user|>`, 17 words, `<|assistant|>`.
        assert_eq!(one.input, 19);
        assert_eq!(one.output, DEFAULT_CHAT_MAX_TOKENS);
        assert_eq!(two.output, 7);
        // The first full block repeats; the partial one does not count.
        assert_eq!(one.hashes.len(), 2);
        assert_eq!(one.hashes[0], two.hashes[0]);
        let text = s.job(&PromptIn::Text("x y".into()), Some(0), &headers(None));
        assert_eq!((text.input, text.output), (2, 1));
        let other = s.job(&PromptIn::Text("x y".into()), None, &headers(None));
        assert_ne!(text.session, other.session);
        assert_eq!(other.output, DEFAULT_MAX_TOKENS);
        assert_eq!(labels.get(text.session), None);
        let ids = s.job(&PromptIn::Tokens(vec![5; 40]), None, &headers(Some("t")));
        assert_eq!((ids.input, ids.hashes.len()), (40, 3));
    }
}
