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
//!
//! Some agents (Qwen Code, Aider) add a reminder to the newest user message of each request —
//! the current date before it, the edit format's rules after it — and send the history without
//! it: the next prompt leaves the previous one inside that message, so it extends no whole
//! prompt. For a session without a client key, the book also keeps where the newest user
//! message of its latest prompt starts (anchored as above, or at the start of the prompt) and
//! the tokens from there on ([`MOVED_MAX_TOKENS`] at most, [`MOVED_BUDGET_TOKENS`] for all
//! sessions). A request that holds that message with one span of at least [`MOVED_MIN_TOKENS`]
//! left out (its role and some of its text kept), then the messages that followed it
//! unchanged, and the span again in its own last message (the reminder moved to the new newest
//! message), continues that session. A second conversation with the same system prompt and
//! reminder is not taken for it: what it would leave out of the session's message includes
//! that session's own words, which its last message does not hold.

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
    /// For a chat: where its newest user message and its last message start in `tokens`.
    pub(crate) turns: Option<Turns<'a>>,
}

/// A chat's messages, as session inference needs them: where each starts in its tokens, and
/// which is its newest of role `user`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Turns<'a> {
    /// Each message's first token, in order (at least one message).
    pub(crate) starts: &'a [usize],
    /// The index of the newest message of role `user` (`None`: the chat has none).
    pub(crate) newest_user: Option<usize>,
}

/// The most tokens kept of a keyless session's prompt from its newest user message on; a
/// longer rest is not kept (the session's next request must then extend the whole prompt).
pub(crate) const MOVED_MAX_TOKENS: usize = 16_384;

/// The most tokens kept for all sessions' [`Moved`] records together (4 bytes each: 64 MiB);
/// past it, the records of the least recently seen sessions are dropped until a quarter of it
/// is free.
pub(crate) const MOVED_BUDGET_TOKENS: usize = 16 << 20;

/// The fewest tokens a reminder that moved to the newest message must have.
pub(crate) const MOVED_MIN_TOKENS: usize = 3;

/// The anchor of a [`Moved`] record whose newest user message starts within the prompt's
/// first block (its tail is then everything before that message).
const MOVED_ROOT: u64 = 0x6b76_635f_6d6f_7665;

/// The most sessions anchored at one place that a request is checked against for a moved
/// reminder (the most recently anchored first): many keyless sessions of one agent share the
/// place right after its system prompt while they are at their first turn.
const MOVED_CANDIDATES: usize = 64;

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
    /// A keyless session's latest prompt from its newest user message on.
    moved: Option<Moved>,
}

/// A keyless session's latest prompt from its newest user message on, and where that
/// message starts: anchored (hash and position of the last full block before it, or
/// [`MOVED_ROOT`] where it starts within the first block) with the tail up to it.
#[derive(Debug, Clone)]
struct Moved {
    anchor: (u64, u32),
    tail: (u64, u32),
    /// The tokens from the newest user message on.
    rest: Box<[u32]>,
    /// How many of them are that message's.
    first: usize,
}

impl Moved {
    /// The record of `prompt` (a chat with a newest user message, not its first message, and
    /// from there on at most [`MOVED_MAX_TOKENS`]).
    fn of(prompt: &Prompt<'_>) -> Option<Moved> {
        let (tokens, block) = prompt.tokens?;
        let turns = prompt.turns?;
        let i = turns.newest_user?;
        let start = *turns.starts.get(i)?;
        let end = turns.starts.get(i + 1).copied().unwrap_or(tokens.len());
        let blocks = start / block;
        let rest = tokens.get(start..)?;
        if start == 0 || blocks > prompt.full_blocks || rest.len() > MOVED_MAX_TOKENS {
            return None;
        }
        // Anchored at the last full block before the message, or (none) at the start.
        let (prev, at) = match blocks.checked_sub(1) {
            Some(b) => (prompt.hashes[b], b as u32),
            None => (MOVED_ROOT, u32::MAX),
        };
        let before = &tokens[blocks * block..start];
        Some(Moved {
            anchor: (prev, at),
            tail: (chain_hash(prev, before), before.len() as u32),
            rest: rest.into(),
            first: end.checked_sub(start)?,
        })
    }

    /// Whether the chat `tokens` (its messages `starts`) holds this record's rest from `start`
    /// — a message there that is the newest user message with one span of at least
    /// [`MOVED_MIN_TOKENS`] left out (its role and some of its text kept), then the messages
    /// that followed it, unchanged — and the span is found again in its last message, which
    /// comes after them.
    fn moved_into(&self, tokens: &[u32], start: usize, starts: &[usize]) -> bool {
        let Some(j) = starts.iter().position(|&s| s == start) else {
            return false;
        };
        let (Some(&end), Some(&last)) = (starts.get(j + 1), starts.last()) else {
            return false;
        };
        let (was, later) = self.rest.split_at(self.first);
        let now = &tokens[start..end];
        if now.len() < 2 || now.len() + MOVED_MIN_TOKENS > was.len() {
            return false;
        }
        // What is kept: a prefix and a suffix of the message as it was.
        let prefix = was.iter().zip(now).take_while(|(a, b)| a == b).count();
        let suffix = now.len() - prefix.min(now.len());
        if !was.ends_with(&now[now.len() - suffix..]) {
            return false;
        }
        let span = &was[prefix.min(now.len())..was.len() - suffix];
        let after = end + later.len();
        if after > last || tokens[end..after] != *later {
            return false;
        }
        // The span's first and last tokens may have merged with what bordered them.
        let core = if span.len() > 4 {
            &span[1..span.len() - 1]
        } else {
            span
        };
        tokens[last..].windows(core.len()).any(|w| w == core)
    }
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
    /// Hash of the last full block before a keyless session's newest user message → the
    /// sessions whose [`Moved`] record is anchored there.
    moved_index: HashMap<u64, Vec<SessionId>>,
    /// Tokens held by the [`Moved`] records.
    moved_tokens: usize,
    /// [`MOVED_BUDGET_TOKENS`] (smaller in tests).
    moved_budget: usize,
}

impl SessionBook {
    pub(crate) fn new(limits: SessionLimits, min_blocks: u32) -> Self {
        SessionBook {
            limits,
            min_blocks,
            entries: HashMap::new(),
            anchors: HashMap::new(),
            moved_index: HashMap::new(),
            moved_tokens: 0,
            moved_budget: MOVED_BUDGET_TOKENS,
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The number of anchors indexed (for tests of the bound).
    #[cfg(test)]
    pub(crate) fn anchor_count(&self) -> usize {
        self.anchors.values().map(Vec::len).sum::<usize>()
            + self.moved_index.values().map(Vec::len).sum::<usize>()
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
                match self
                    .continued(prompt, now_ms)
                    .or_else(|| self.moved_from(prompt, now_ms))
                {
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
        let moved = (!keyed && self.min_blocks > 0)
            .then(|| Moved::of(&prompt))
            .flatten();
        self.set_moved(session, moved);
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

    /// The live keyless session whose latest prompt this one holds with a reminder moved
    /// from that prompt's newest user message to this one's last message ([`Moved`]),
    /// anchored deepest; ties to the most recently seen.
    fn moved_from(&self, prompt: Prompt<'_>, now_ms: u64) -> Option<(SessionId, Arc<str>)> {
        let (tokens, block) = prompt.tokens?;
        let starts = prompt.turns?.starts;
        // Each full block, deepest first, then the start of the prompt.
        let places = (0..prompt.full_blocks)
            .rev()
            .map(|i| (prompt.hashes[i], i as u32, (i + 1) * block))
            .chain(std::iter::once((MOVED_ROOT, u32::MAX, 0)));
        for (hash, at, from) in places {
            let Some(list) = self.moved_index.get(&hash) else {
                continue;
            };
            let best = list
                .iter()
                .rev()
                .take(MOVED_CANDIDATES)
                .filter_map(|s| self.entries.get(s).map(|e| (*s, e)))
                .filter(|(_, e)| {
                    self.live(e, now_ms)
                        && e.moved.as_ref().is_some_and(|m| {
                            let (tail, len) = (m.tail.0, m.tail.1 as usize);
                            m.anchor == (hash, at)
                                && tokens
                                    .get(from..from + len)
                                    .is_some_and(|t| chain_hash(hash, t) == tail)
                                && m.moved_into(tokens, from + len, starts)
                        })
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
                    moved: None,
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

    fn set_moved(&mut self, session: SessionId, moved: Option<Moved>) {
        let Some(e) = self.entries.get_mut(&session) else {
            return;
        };
        let new = moved.as_ref().map(|m| (m.anchor.0, m.rest.len()));
        let old = std::mem::replace(&mut e.moved, moved).map(|m| (m.anchor.0, m.rest.len()));
        self.moved_tokens = self.moved_tokens - old.map_or(0, |o| o.1) + new.map_or(0, |n| n.1);
        if old.map(|o| o.0) != new.map(|n| n.0) {
            if let Some((hash, _)) = old {
                Self::unindex(&mut self.moved_index, hash, session);
            }
            if let Some((hash, _)) = new {
                self.moved_index.entry(hash).or_default().push(session);
            }
        }
        if self.moved_tokens > self.moved_budget {
            self.shed_moved(session);
        }
    }

    /// Drops the [`Moved`] records of the least recently seen sessions (never `keep`'s) until
    /// a quarter of the budget is free.
    fn shed_moved(&mut self, keep: SessionId) {
        let mut held: Vec<(u64, SessionId)> = self
            .entries
            .iter()
            .filter(|(s, e)| **s != keep && e.moved.is_some())
            .map(|(s, e)| (e.last_ms, *s))
            .collect();
        held.sort_unstable();
        let target = self.moved_budget / 4 * 3;
        for (_, s) in held {
            if self.moved_tokens <= target {
                break;
            }
            if let Some(m) = self.entries.get_mut(&s).and_then(|e| e.moved.take()) {
                self.moved_tokens -= m.rest.len();
                Self::unindex(&mut self.moved_index, m.anchor.0, s);
            }
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
        if let Some(m) = e.moved {
            self.moved_tokens -= m.rest.len();
            Self::unindex(&mut self.moved_index, m.anchor.0, session);
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
mod tests;
