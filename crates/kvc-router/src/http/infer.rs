//! The HTTP front's session book: each session's key and turn counter, and the prefix anchors
//! with which a request that names no session continues a known one.
//!
//! A session's *anchor* is the chained block hash at the last full block of its latest prompt
//! (with that block's position), and its *tail* the hash and length of the tokens after that
//! block (the partial last block). Because block hashes are chained, a request whose hash at
//! the same position is equal extends that prompt up to its last full block; when its next
//! tokens also hash to the tail, it extends the whole prompt, whatever the block alignment: it
//! is the session's next turn. The deepest such match wins (ties: the most recently seen
//! session). Matching the whole prompt, not its last full block, is what keeps a shared system
//! prompt from gluing two conversations together: two first prompts that differ only in a
//! short user message share every full block when the system prompt is long. A prompt needs
//! `min_blocks` full blocks to be placed at all (1 by default; 0 turns inference off), so a
//! short first request still anchors the session its next request continues.

use crate::SessionLimits;
use kvc_core::SessionId;
use kvc_core::text::chain_hash;
use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::sync::Arc;

/// How a request without a session key was placed in a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Inferred {
    /// It continues a known session.
    Continued,
    /// It starts a new inferred session (which later requests can continue).
    New,
    /// Its session key was new, yet its prompt extends the prompt of a session another key
    /// used for one turn only: the client changes its id on every request, and the request
    /// continues that session instead.
    Rotated,
}

/// The session a request belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub(crate) session: SessionId,
    /// Its key: the client's, or the generated key of an inferred session.
    pub(crate) key: Arc<str>,
    /// Its turn, from 1.
    pub(crate) turn: u32,
    /// `None` when the client named the session.
    pub(crate) inferred: Option<Inferred>,
    /// For the first turn of a session the client named, a live session of another key whose
    /// latest prompt this one goes on past (a subagent started from its parent's context):
    /// its inferred parent.
    pub(crate) forked_from: Option<SessionId>,
}

/// What a request brings to [`SessionBook::resolve`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Prompt<'a> {
    /// The session key the client gave (header or `session_params.id`), if any.
    pub(crate) key: Option<&'a str>,
    /// The prompt's chained block hashes (the last block may be partial).
    pub(crate) hashes: &'a [u64],
    /// How many of them are full blocks.
    pub(crate) full_blocks: usize,
    /// The tokens the hashes cover, and the block size in tokens; `None` where they are not
    /// known (a session anchored so matches at its last full block).
    pub(crate) tokens: Option<(&'a [u32], usize)>,
}

impl Prompt<'_> {
    /// The tail of a prompt anchored at its last full block: the hash ([`chain_hash`] after
    /// that block) and length of the tokens after it.
    fn tail(&self) -> Option<(u64, u32)> {
        let (tokens, block) = self.tokens?;
        let start = self.full_blocks.checked_mul(block)?;
        let rest = tokens.get(start..)?;
        let prev = self.hashes.get(self.full_blocks.checked_sub(1)?)?;
        Some((chain_hash(*prev, rest), rest.len() as u32))
    }

    /// Whether the tokens after full block `i` begin with a tail of `len` tokens hashing to
    /// `hash` (unknown tokens: no).
    fn goes_on_with(&self, i: usize, (hash, len): (u64, u32)) -> bool {
        let Some((tokens, block)) = self.tokens else {
            return false;
        };
        let start = (i + 1) * block;
        tokens
            .get(start..start + len as usize)
            .is_some_and(|rest| chain_hash(self.hashes[i], rest) == hash)
    }
}

#[derive(Debug, Clone)]
struct Entry {
    turn: u32,
    last_ms: u64,
    key: Arc<str>,
    /// The client named the session (a key it sent), not the prefix.
    keyed: bool,
    /// Its later turns came with new keys ([`Inferred::Rotated`]).
    rotating: bool,
    /// (hash, position) of the last full block of the session's latest prompt.
    anchor: Option<(u64, u32)>,
    /// (hash, length) of that prompt's tokens after its anchor; `None` where they were not
    /// known.
    tail: Option<(u64, u32)>,
}

/// Sessions by id, bounded by the router's session limits, with an index of their anchors.
#[derive(Debug)]
pub(crate) struct SessionBook {
    limits: SessionLimits,
    /// Shortest match (in blocks) that continues a session; 0: no inference.
    min_blocks: u32,
    entries: HashMap<SessionId, Entry>,
    /// Anchor hash → the sessions anchored there (usually one).
    anchors: HashMap<u64, Vec<SessionId>>,
}

impl SessionBook {
    pub(crate) fn new(limits: SessionLimits, min_blocks: u32) -> Self {
        SessionBook {
            limits,
            min_blocks,
            entries: HashMap::new(),
            anchors: HashMap::new(),
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The number of anchors indexed (for tests of the bound).
    #[cfg(test)]
    pub(crate) fn anchor_count(&self) -> usize {
        self.anchors.values().map(Vec::len).sum()
    }

    fn live(&self, e: &Entry, now_ms: u64) -> bool {
        now_ms.saturating_sub(e.last_ms) <= self.limits.ttl_ms
    }

    /// The session of a request at `now_ms`, and its turn: the client's key if it gave one;
    /// otherwise (inference on, and at least `min_blocks` full blocks) the session whose anchor
    /// it matches deepest, or a new inferred session keyed `new_key()`. `None`: routed without
    /// a session. The session's anchor moves to this prompt's last full block.
    pub(crate) fn resolve(
        &mut self,
        prompt: Prompt<'_>,
        now_ms: u64,
        new_key: impl FnOnce() -> String,
    ) -> Option<Resolved> {
        let mut forked_from = None;
        let (session, key, inferred) = match prompt.key {
            Some(k) => match self.rotated_from(k, prompt, now_ms) {
                Some((s, key)) => (s, key, Some(Inferred::Rotated)),
                None => {
                    forked_from = self.extended(k, prompt, now_ms).map(|(s, _)| s);
                    (SessionId::from_key(k), Arc::<str>::from(k), None)
                }
            },
            None => {
                if self.min_blocks == 0 || prompt.full_blocks < self.min_blocks as usize {
                    return None;
                }
                match self.continued(prompt, now_ms) {
                    Some((s, key)) => (s, key, Some(Inferred::Continued)),
                    None => {
                        let key = Arc::<str>::from(new_key());
                        (SessionId::from_key(&key), key, Some(Inferred::New))
                    }
                }
            }
        };
        let keyed = prompt.key.is_some();
        let turn = self.bump(session, &key, keyed, now_ms);
        if inferred == Some(Inferred::Rotated)
            && let Some(e) = self.entries.get_mut(&session)
        {
            e.rotating = true;
        }
        let anchor = (prompt.full_blocks >= (self.min_blocks.max(1) as usize)
            && self.min_blocks > 0)
            .then(|| {
                let i = prompt.full_blocks - 1;
                (prompt.hashes[i], i as u32)
            });
        self.set_anchor(session, anchor);
        if let Some(e) = self.entries.get_mut(&session) {
            e.tail = anchor.and_then(|_| prompt.tail());
        }
        self.bound(session, now_ms);
        Some(Resolved {
            session,
            key,
            turn,
            inferred,
            forked_from: forked_from.filter(|_| turn == 1),
        })
    }

    /// The live session whose latest prompt this one extends (through its last full block,
    /// and through its tail where that is known), anchored deepest (at least `min_blocks`
    /// deep); ties to the most recently seen.
    fn continued(&self, prompt: Prompt<'_>, now_ms: u64) -> Option<(SessionId, Arc<str>)> {
        let shallowest = self.min_blocks.max(1) as usize - 1;
        for i in (shallowest..prompt.full_blocks).rev() {
            let hash = prompt.hashes[i];
            let Some(list) = self.anchors.get(&hash) else {
                continue;
            };
            let best = list
                .iter()
                .filter_map(|s| self.entries.get(s).map(|e| (*s, e)))
                .filter(|(_, e)| {
                    e.anchor == Some((hash, i as u32))
                        && self.live(e, now_ms)
                        && e.tail.is_none_or(|tail| prompt.goes_on_with(i, tail))
                })
                .max_by_key(|(s, e)| (e.last_ms, s.0));
            if let Some((s, e)) = best {
                return Some((s, Arc::clone(&e.key)));
            }
        }
        None
    }

    /// For a request with client key `k` the front has not seen (alive): the live session
    /// its prompt extends (as [`SessionBook::continued`] finds it), when that session was
    /// named by another client key and had one turn only (or was found rotating before), and
    /// the prompt goes on past that session's latest — the pattern of a client that sends a
    /// new id with every request. Shorter prompts than `min_blocks`, or inference off: none.
    fn rotated_from(
        &self,
        k: &str,
        prompt: Prompt<'_>,
        now_ms: u64,
    ) -> Option<(SessionId, Arc<str>)> {
        if self.min_blocks == 0 || prompt.full_blocks < self.min_blocks as usize {
            return None;
        }
        let (s, key) = self.extended(k, prompt, now_ms)?;
        let e = self.entries.get(&s)?;
        (e.keyed && (e.turn == 1 || e.rotating)).then_some((s, key))
    }

    /// For a request with client key `k` the front has not seen (alive): the live session of
    /// another key whose latest prompt this one extends and goes on past (a second session
    /// that merely starts with the same first prompt is not taken). Shorter prompts than
    /// `min_blocks`, or inference off: none.
    fn extended(&self, k: &str, prompt: Prompt<'_>, now_ms: u64) -> Option<(SessionId, Arc<str>)> {
        if self.min_blocks == 0 || prompt.full_blocks < self.min_blocks as usize {
            return None;
        }
        let own = SessionId::from_key(k);
        if self.entries.get(&own).is_some_and(|e| self.live(e, now_ms)) {
            return None;
        }
        let (s, key) = self.continued(prompt, now_ms)?;
        let e = self.entries.get(&s)?;
        let longer = e
            .anchor
            .is_some_and(|(_, at)| (at as usize) + 1 < prompt.full_blocks);
        (s != own && longer).then_some((s, key))
    }

    /// Counts a turn of `session` (1 for a new or expired session).
    fn bump(&mut self, session: SessionId, key: &Arc<str>, keyed: bool, now_ms: u64) -> u32 {
        let ttl = self.limits.ttl_ms;
        match self.entries.entry(session) {
            MapEntry::Occupied(mut o) => {
                let e = o.get_mut();
                if now_ms.saturating_sub(e.last_ms) <= ttl {
                    e.turn = e.turn.saturating_add(1);
                } else {
                    e.turn = 1;
                }
                e.last_ms = now_ms;
                e.key = Arc::clone(key);
                e.keyed = keyed;
                e.turn
            }
            MapEntry::Vacant(v) => {
                v.insert(Entry {
                    turn: 1,
                    last_ms: now_ms,
                    key: Arc::clone(key),
                    keyed,
                    rotating: false,
                    anchor: None,
                    tail: None,
                });
                1
            }
        }
    }

    fn set_anchor(&mut self, session: SessionId, anchor: Option<(u64, u32)>) {
        let Some(e) = self.entries.get_mut(&session) else {
            return;
        };
        let old = std::mem::replace(&mut e.anchor, anchor);
        if old == anchor {
            return;
        }
        if let Some((hash, _)) = old {
            Self::unindex(&mut self.anchors, hash, session);
        }
        if let Some((hash, _)) = anchor {
            self.anchors.entry(hash).or_default().push(session);
        }
    }

    fn unindex(anchors: &mut HashMap<u64, Vec<SessionId>>, hash: u64, session: SessionId) {
        if let Some(list) = anchors.get_mut(&hash) {
            list.retain(|s| *s != session);
            if list.is_empty() {
                anchors.remove(&hash);
            }
        }
    }

    /// Forgets `session`; whether it was known.
    pub(crate) fn remove(&mut self, session: SessionId) -> bool {
        let Some(e) = self.entries.remove(&session) else {
            return false;
        };
        if let Some((hash, _)) = e.anchor {
            Self::unindex(&mut self.anchors, hash, session);
        }
        true
    }

    /// Keeps at most `sessions.max` sessions: the expired go first, then the least recently
    /// seen (never `keep`, the session just used).
    fn bound(&mut self, keep: SessionId, now_ms: u64) {
        let max = self.limits.max_sessions.max(1);
        if self.entries.len() <= max {
            return;
        }
        let expired: Vec<SessionId> = self
            .entries
            .iter()
            .filter(|(_, e)| !self.live(e, now_ms))
            .map(|(s, _)| *s)
            .collect();
        for s in expired {
            let _ = self.remove(s);
        }
        while self.entries.len() > max {
            let oldest = self
                .entries
                .iter()
                .filter(|(s, _)| **s != keep)
                .min_by_key(|(s, e)| (e.last_ms, s.0))
                .map(|(s, _)| *s);
            match oldest {
                Some(s) => {
                    let _ = self.remove(s);
                }
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book(ttl_ms: u64, max_sessions: usize, min_blocks: u32) -> SessionBook {
        SessionBook::new(
            SessionLimits {
                ttl_ms,
                max_sessions,
            },
            min_blocks,
        )
    }

    fn prompt<'a>(key: Option<&'a str>, hashes: &'a [u64], full_blocks: usize) -> Prompt<'a> {
        Prompt {
            key,
            hashes,
            full_blocks,
            tokens: None,
        }
    }

    /// Chained-looking hashes: a conversation `c`'s blocks after a shared system prefix of
    /// `shared` blocks.
    fn blocks(c: u64, shared: usize, n: usize) -> Vec<u64> {
        (0..n as u64)
            .map(|i| {
                if (i as usize) < shared {
                    1_000 + i
                } else {
                    c * 1_000_000 + i
                }
            })
            .collect()
    }

    #[test]
    fn a_new_key_extending_a_one_turn_keyed_session_is_a_rotated_id() {
        let mut b = book(1_000, 10, 4);
        let h = blocks(1, 0, 9);
        let r1 = b.resolve(prompt(Some("id-1"), &h[..5], 5), 0, || unreachable!());
        assert_eq!(r1.unwrap().inferred, None);
        let r2 = b
            .resolve(prompt(Some("id-2"), &h[..7], 7), 1, || unreachable!())
            .unwrap();
        assert_eq!(
            (&*r2.key, r2.turn, r2.inferred),
            ("id-1", 2, Some(Inferred::Rotated))
        );
        // Found rotating, the session stays so for its next new id.
        let r3 = b
            .resolve(prompt(Some("id-3"), &h[..9], 9), 2, || unreachable!())
            .unwrap();
        assert_eq!((&*r3.key, r3.turn), ("id-1", 3));
        // A key already seen is trusted as it is; an inferred session is never a rotation.
        let r = b
            .resolve(prompt(Some("id-1"), &h[..9], 9), 3, || unreachable!())
            .unwrap();
        assert_eq!((r.turn, r.inferred), (4, None));
        let other = blocks(2, 0, 6);
        let inferred = b
            .resolve(prompt(None, &other[..5], 5), 4, || {
                "kvc-inferred-x".to_owned()
            })
            .unwrap();
        assert_eq!(inferred.inferred, Some(Inferred::New));
        let r = b
            .resolve(prompt(Some("id-9"), &other, 6), 5, || unreachable!())
            .unwrap();
        assert_eq!((&*r.key, r.inferred), ("id-9", None));
        // A second session starting with the very same prompt is a session of its own.
        let same = blocks(3, 0, 5);
        b.resolve(prompt(Some("twin-1"), &same, 5), 6, || unreachable!());
        let r = b
            .resolve(prompt(Some("twin-2"), &same, 5), 7, || unreachable!())
            .unwrap();
        assert_eq!((&*r.key, r.turn, r.inferred), ("twin-2", 1, None));
    }

    #[test]
    fn keyed_turns_count_per_session_and_restart_after_the_ttl() {
        let mut b = book(100, 10, 4);
        let h = blocks(1, 0, 2);
        let turn = |b: &mut SessionBook, key, now| {
            b.resolve(prompt(Some(key), &h, 2), now, || unreachable!())
                .unwrap()
                .turn
        };
        assert_eq!(turn(&mut b, "a", 0), 1);
        assert_eq!(turn(&mut b, "a", 50), 2);
        assert_eq!(turn(&mut b, "b", 50), 1);
        assert_eq!(turn(&mut b, "a", 150), 3);
        assert_eq!(turn(&mut b, "a", 251), 1, "expired: a new session");
        let r = b
            .resolve(prompt(Some("a"), &h, 2), 252, String::new)
            .unwrap();
        assert_eq!(r.session, SessionId::from_key("a"));
        assert_eq!(&*r.key, "a");
        assert_eq!(r.inferred, None);
    }

    #[test]
    fn the_book_is_bounded_by_the_session_limit() {
        let mut b = book(1_000_000, 2, 1);
        let keys = ["k0", "k1", "k2"];
        for (i, k) in keys.iter().enumerate() {
            let h = blocks(i as u64 + 1, 0, 3);
            for t in 0..2 {
                b.resolve(prompt(Some(k), &h, 3), i as u64 * 10 + t, String::new);
            }
        }
        assert_eq!(b.len(), 2);
        assert_eq!(
            b.anchor_count(),
            2,
            "the forgotten session's anchor went too"
        );
        // The least recently seen session was forgotten; the others kept their count.
        let h = blocks(9, 0, 3);
        assert_eq!(
            b.resolve(prompt(Some("k0"), &h, 3), 100, String::new)
                .unwrap()
                .turn,
            1
        );
        assert_eq!(
            b.resolve(prompt(Some("k2"), &h, 3), 101, String::new)
                .unwrap()
                .turn,
            3
        );
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn a_keyless_request_continues_the_session_it_extends() {
        let mut b = book(1_000_000, 100, 4);
        // Too short to infer anything: no session.
        let short = blocks(1, 0, 3);
        assert_eq!(b.resolve(prompt(None, &short, 3), 0, || "x".into()), None);
        assert_eq!(b.len(), 0);

        let a1 = blocks(1, 2, 6);
        let r = b
            .resolve(prompt(None, &a1, 5), 1, || "inferred-a".into())
            .unwrap();
        assert_eq!((r.turn, r.inferred), (1, Some(Inferred::New)));
        assert_eq!(&*r.key, "inferred-a");
        let sa = r.session;
        // Another conversation sharing only the 2-block system prefix: a new session.
        let b1 = blocks(2, 2, 6);
        let r = b
            .resolve(prompt(None, &b1, 6), 2, || "inferred-b".into())
            .unwrap();
        assert_eq!(r.inferred, Some(Inferred::New));
        let sb = r.session;
        assert_ne!(sa, sb);
        // Turn 2 of each extends its own first prompt (through its last full block).
        let a2 = blocks(1, 2, 9);
        let r = b
            .resolve(prompt(None, &a2, 8), 3, || unreachable!())
            .unwrap();
        assert_eq!(
            (r.session, r.turn, r.inferred),
            (sa, 2, Some(Inferred::Continued))
        );
        assert_eq!(&*r.key, "inferred-a");
        let b2 = blocks(2, 2, 7);
        let r = b
            .resolve(prompt(None, &b2, 7), 4, || unreachable!())
            .unwrap();
        assert_eq!((r.session, r.turn), (sb, 2));
        // A's anchor moved to its turn-2 prompt: a request that only extends turn 1 (and not
        // turn 2) is a new session.
        let fork = blocks(1, 2, 5);
        let r = b
            .resolve(prompt(None, &fork, 5), 5, || "fork".into())
            .unwrap();
        assert_eq!(r.inferred, Some(Inferred::New));
        assert_eq!(b.anchor_count(), 3);
    }

    #[test]
    fn the_deepest_match_wins_then_the_most_recent() {
        let mut b = book(1_000_000, 100, 2);
        let shallow = blocks(1, 0, 3);
        let deep = blocks(1, 0, 5);
        // (Two turns under its key: a longer prompt under another key is no rotated id.)
        b.resolve(prompt(Some("shallow"), &shallow, 3), 9, String::new);
        let s_shallow = b
            .resolve(prompt(Some("shallow"), &shallow, 3), 10, String::new)
            .unwrap()
            .session;
        let s_deep = b
            .resolve(prompt(Some("deep"), &deep, 5), 5, String::new)
            .unwrap()
            .session;
        let longer = blocks(1, 0, 7);
        let r = b
            .resolve(prompt(None, &longer, 7), 20, String::new)
            .unwrap();
        assert_eq!(r.session, s_deep, "deepest, although less recent");
        assert_ne!(r.session, s_shallow);
        // Two sessions anchored at the same block: the most recent one.
        let mut b = book(1_000_000, 100, 2);
        let h = blocks(1, 0, 4);
        b.resolve(prompt(Some("old"), &h, 4), 1, String::new);
        b.resolve(prompt(Some("new"), &h, 4), 2, String::new);
        let r = b.resolve(prompt(None, &blocks(1, 0, 6), 6), 3, String::new);
        assert_eq!(r.unwrap().session, SessionId::from_key("new"));
        // An expired session is not continued.
        let mut b = book(10, 100, 2);
        b.resolve(prompt(Some("gone"), &h, 4), 0, String::new);
        let r = b
            .resolve(prompt(None, &blocks(1, 0, 6), 6), 11, || "fresh".into())
            .unwrap();
        assert_eq!(r.inferred, Some(Inferred::New));
        assert_eq!(&*r.key, "fresh");
    }

    #[test]
    fn inference_off_routes_keyless_requests_without_a_session() {
        let mut b = book(1_000_000, 100, 0);
        let h = blocks(1, 0, 8);
        b.resolve(prompt(Some("k"), &h, 8), 0, String::new);
        assert_eq!(b.anchor_count(), 0);
        assert_eq!(b.resolve(prompt(None, &h, 8), 1, || "x".into()), None);
    }

    /// Conversations as clients send them: their messages rendered by the router (a chat
    /// request, [`kvc_core::text::chat_tokens`]) or by a real model's chat template into a
    /// text prompt (ChatML as Qwen's, Llama 3's, the real-vLLM harness's), tokenized, in
    /// blocks of any size.
    mod properties {
        use super::*;
        use kvc_core::BlockSize;
        use kvc_core::text::{block_hashes, chat_tokens, fallback_tokens};
        use proptest::prelude::*;

        #[derive(Debug, Clone, Copy)]
        enum Render {
            /// A chat request: the router hashes its messages, not the generation prompt.
            Router,
            ChatMl,
            Llama3,
            Harness,
        }

        /// The tokens a request's block hashes cover.
        fn hashed(render: Render, messages: &[(String, String)]) -> Vec<u32> {
            let (open, close, generation): (fn(&str) -> String, &str, &str) = match render {
                Render::Router => {
                    let pairs = messages.iter().map(|(r, c)| (r.as_str(), c.as_str()));
                    return chat_tokens(pairs, fallback_tokens).hashed().to_vec();
                }
                Render::ChatMl => (
                    |r| format!("<|im_start|>{r}\n"),
                    "<|im_end|>\n",
                    "<|im_start|>assistant\n",
                ),
                Render::Llama3 => (
                    |r| format!("<|start_header_id|>{r}<|end_header_id|>\n\n"),
                    "<|eot_id|>",
                    "<|start_header_id|>assistant<|end_header_id|>\n\n",
                ),
                Render::Harness => (|r| format!("<|{r}|>\n"), "<|end|>\n", "<|assistant|>\n"),
            };
            let mut text = String::new();
            if matches!(render, Render::Llama3) {
                text.push_str("<|begin_of_text|>");
            }
            for (role, content) in messages {
                text.push_str(&open(role));
                text.push_str(content);
                text.push_str(close);
            }
            text.push_str(generation);
            fallback_tokens(&text)
        }

        fn words(tag: &str, n: usize) -> String {
            (0..n).map(|i| format!("{tag}{i} ")).collect::<String>()
        }

        /// What a turn appends: 0 a user message after a user message (a retry after a
        /// cut-off answer), 1 an answer and a user message, 2 an answer with a tool call and
        /// the tool's result, 3 two tool results.
        fn append(conv: &mut Vec<(String, String)>, render: Render, step: u8, n: usize, tag: &str) {
            let msg = |role: &str, t: &str| (role.to_owned(), words(&format!("{tag}{t}"), n));
            // A text prompt ends with the generation prompt: the next one extends it only
            // with the answer it asked for (a chat request's messages extend with anything).
            let step = match render {
                Render::Router => step % 4,
                _ => 1 + step % 2,
            };
            match step {
                0 => conv.push(msg("user", "again")),
                1 => conv.extend([msg("assistant", "answer"), msg("user", "next")]),
                2 => conv.extend([msg("assistant", "call"), msg("tool", "result")]),
                _ => conv.extend([msg("tool", "out"), msg("tool", "more")]),
            }
        }

        fn render_strategy() -> impl Strategy<Value = Render> {
            prop_oneof![
                Just(Render::Router),
                Just(Render::ChatMl),
                Just(Render::Llama3),
                Just(Render::Harness)
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// Every turn of a conversation that sends no session key continues its session,
            /// whatever the block size and the lengths (its first request too, unless it is
            /// shorter than one full block); another conversation with the same system prompt
            /// and a first message of its own, interleaved with it, is never glued to it.
            #[test]
            fn keyless_conversations_hold_and_stay_apart(
                render in render_strategy(),
                block in 1u32..64,
                system in 0usize..200,
                first in 1usize..40,
                steps in proptest::collection::vec((any::<u8>(), 1usize..60), 1..8),
            ) {
                let bs = BlockSize::new(block).unwrap();
                let mut book = book(1_000_000, 1_000, 1);
                let shared = words("system", system);
                let mut convs: Vec<Vec<(String, String)>> = ["a", "b"]
                    .iter()
                    .map(|tag| {
                        let mut c = Vec::new();
                        if system > 0 {
                            c.push(("system".to_owned(), shared.clone()));
                        }
                        c.push(("user".to_owned(), words(&format!("task-{tag}-"), first)));
                        c
                    })
                    .collect();
                let mut sessions: [Option<SessionId>; 2] = [None, None];
                let mut now = 0;
                for turn in 0..=steps.len() {
                    for (k, tag) in ["a", "b"].into_iter().enumerate() {
                        if turn > 0 {
                            let (step, n) = steps[turn - 1];
                            append(&mut convs[k], render, step, n, tag);
                        }
                        let tokens = hashed(render, &convs[k]);
                        let hashes = block_hashes(&tokens, bs);
                        let full_blocks = tokens.len() / block as usize;
                        now += 1;
                        let r = book.resolve(
                            Prompt {
                                key: None,
                                hashes: &hashes,
                                full_blocks,
                                tokens: Some((&tokens, block as usize)),
                            },
                            now,
                            || format!("inferred-{tag}-{turn}"),
                        );
                        let Some(r) = r else {
                            prop_assert_eq!(full_blocks, 0, "{:?} turn {} placed nowhere", render, turn);
                            continue;
                        };
                        match sessions[k] {
                            None => {
                                prop_assert_eq!(r.inferred, Some(Inferred::New));
                                sessions[k] = Some(r.session);
                            }
                            Some(s) => {
                                prop_assert_eq!(
                                    (r.session, r.inferred),
                                    (s, Some(Inferred::Continued)),
                                    "{:?} conversation {} turn {}", render, tag, turn
                                );
                            }
                        }
                    }
                    if let [Some(a), Some(b)] = sessions {
                        prop_assert_ne!(a, b, "{:?}: glued at turn {}", render, turn);
                    }
                }
            }
        }
    }
}
