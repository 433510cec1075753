//! The simulated workers' KV-cache events, as a stock vLLM engine publishes them.
//!
//! The engine model keeps, per worker, the sessions resident there with their token count and
//! the trace block ids of what they hold. `EventSource` turns each worker's residents into
//! vLLM's view of its prefix cache — full blocks of [`ENGINE_BLOCK_TOKENS`] tokens, chained —
//! and emits the difference since the last call as `BlockStored` / `BlockRemoved` events:
//!
//! - **Tokens.** A trace block id stands for `block` tokens of content; token `j` of trace
//!   block `h` is a deterministic function of `(h, j)`, so two sessions that share trace
//!   blocks share tokens (and engine blocks). Tokens past the prompt's blocks (the answer a
//!   session keeps) depend on the session and the position.
//! - **Blocks.** Only full engine blocks are cached (as in vLLM); a block's engine hash chains
//!   its parent's hash with its content.
//! - **Sharing.** A block held by several sessions on a worker is stored once and removed when
//!   the last of them lets it go (a reference count per worker); `BlockStored` names the
//!   session that stored it (`session_id` = [`session_label`]).
//!
//! Deterministic: the same engine states give the same events (sessions are visited in id
//! order, no hashing with random state).

use super::engine_signals::ENGINE_BLOCK_TOKENS;
use crate::model::Engine;
use crate::publish::SessionLabels;
use kvc_core::HashIds;
use kvc_core::{SessionId, WorkerId};
use kvc_events::{BlockRemoved, BlockStored, EngineHash, Event, EventBatch, Medium};
use std::collections::{BTreeMap, HashMap};

/// The `session_id` a simulated engine writes for `session`: the key the replay clients name
/// the session by (`s<id>`), which a router maps with [`SessionId::from_key`].
pub fn session_label(session: SessionId) -> String {
    format!("s{}", session.0)
}

/// What one session holds on a worker, as engine blocks.
#[derive(Debug, Default)]
struct Held {
    /// What the blocks were computed from: (tokens, trace block count, last trace block).
    source: (u64, usize, u64),
    /// Engine hashes of its full blocks, in order.
    blocks: Vec<u64>,
}

/// One worker's cache as last published.
#[derive(Debug, Default)]
struct WorkerCache {
    sessions: BTreeMap<SessionId, Held>,
    /// Sessions holding each block.
    refs: HashMap<u64, u32>,
}

/// Emits every worker's KV-cache events from the engine's resident sessions.
#[derive(Debug)]
pub(crate) struct EventSource {
    /// Tokens per trace block.
    trace_block: u64,
    workers: Vec<WorkerCache>,
    /// Standalone workers: the keys clients named sessions by (else [`session_label`]).
    labels: Option<SessionLabels>,
}

impl EventSource {
    /// A source for `workers` workers of a trace with `trace_block` tokens per block.
    pub(crate) fn new(workers: usize, trace_block: u64) -> Self {
        EventSource {
            trace_block: trace_block.max(1),
            workers: (0..workers).map(|_| WorkerCache::default()).collect(),
            labels: None,
        }
    }

    /// Names sessions by the keys in `labels` where they have one.
    pub(crate) fn label_sessions(&mut self, labels: SessionLabels) {
        self.labels = Some(labels);
    }

    /// The events of every worker since the last call (by worker id; a worker with nothing
    /// new has an empty list), at wall time `ts` (seconds since the epoch).
    pub(crate) fn diff(&mut self, engine: &Engine, ts: f64) -> Vec<EventBatch> {
        let trace_block = self.trace_block;
        let labels = self.labels.as_ref();
        self.workers
            .iter_mut()
            .enumerate()
            .map(|(i, cache)| {
                let residents = engine.resident_blocks(WorkerId(i as u32));
                EventBatch {
                    ts,
                    events: cache.diff(&residents, trace_block, labels),
                    dp_rank: None,
                }
            })
            .collect()
    }
}

impl WorkerCache {
    fn diff(
        &mut self,
        residents: &[(SessionId, u64, HashIds)],
        trace_block: u64,
        labels: Option<&SessionLabels>,
    ) -> Vec<Event> {
        let mut events = Vec::new();
        let mut removed = Vec::new();
        // Sessions gone from the worker.
        let gone: Vec<SessionId> = self
            .sessions
            .keys()
            .filter(|s| residents.binary_search_by_key(*s, |r| r.0).is_err())
            .copied()
            .collect();
        for s in gone {
            if let Some(held) = self.sessions.remove(&s) {
                self.release(&held.blocks, &mut removed);
            }
        }
        for (session, tokens, hashes) in residents {
            let ids = hashes.as_slice();
            let source = (*tokens, ids.len(), ids.last().map_or(0, |h| h.0));
            let old = self.sessions.remove(session).unwrap_or_default();
            if old.source == source && !old.blocks.is_empty() {
                self.sessions.insert(*session, old);
                continue;
            }
            // The same prompt blocks (a session decoding): its blocks so far stand, only the
            // ones its new tokens fill are computed.
            let keep = if (old.source.1, old.source.2) == (source.1, source.2) {
                old.blocks.len()
            } else {
                0
            };
            let (blocks, tokens_of) =
                engine_blocks(*session, *tokens, ids, trace_block, &old.blocks[..keep]);
            let common = old
                .blocks
                .iter()
                .zip(&blocks)
                .take_while(|(a, b)| a == b)
                .count();
            self.release(&old.blocks[common..], &mut removed);
            // Blocks new to the worker, in runs of consecutive positions.
            let mut run: Option<BlockStored> = None;
            let mut parent = common.checked_sub(1).map(|k| blocks[k]);
            for (pos, &h) in blocks.iter().enumerate().skip(common) {
                let count = self.refs.entry(h).or_insert(0);
                *count += 1;
                if *count == 1 {
                    let r = run.get_or_insert_with(|| BlockStored {
                        parent: parent.map(EngineHash),
                        block_size: ENGINE_BLOCK_TOKENS as u32,
                        medium: Some(Medium::Gpu),
                        session_id: Some(
                            labels
                                .and_then(|l| l.get(*session))
                                .unwrap_or_else(|| session_label(*session)),
                        ),
                        ..BlockStored::default()
                    });
                    r.block_hashes.push(EngineHash(h));
                    r.token_ids.extend(tokens_of(pos));
                } else if let Some(r) = run.take() {
                    events.push(Event::Stored(r));
                }
                parent = Some(h);
            }
            if let Some(r) = run {
                events.push(Event::Stored(r));
            }
            self.sessions.insert(*session, Held { source, blocks });
        }
        if !removed.is_empty() {
            // Removals first: a block freed and stored again in one step ends stored.
            events.insert(
                0,
                Event::Removed(BlockRemoved {
                    block_hashes: removed.into_iter().map(EngineHash).collect(),
                    medium: Some(Medium::Gpu),
                }),
            );
        }
        events
    }

    /// Drops one reference to each of `blocks`; the ones no session holds any more go to
    /// `removed`.
    fn release(&mut self, blocks: &[u64], removed: &mut Vec<u64>) {
        for h in blocks {
            if let Some(count) = self.refs.get_mut(h) {
                *count -= 1;
                if *count == 0 {
                    self.refs.remove(h);
                    removed.push(*h);
                }
            }
        }
    }
}

/// The engine blocks of a session holding `tokens` tokens whose prompt had trace blocks `ids`:
/// their chained hashes (the first ones are `known`, computed before from the same content),
/// and a function giving block `k`'s tokens.
fn engine_blocks<'a>(
    session: SessionId,
    tokens: u64,
    ids: &'a [kvc_core::BlockHash],
    trace_block: u64,
    known: &[u64],
) -> (Vec<u64>, impl Fn(usize) -> Vec<u32> + 'a) {
    let token_at = move |p: u64| -> u32 {
        let idx = (p / trace_block) as usize;
        let seed = match ids.get(idx) {
            Some(h) => mix(h.0, p % trace_block),
            // Past the prompt's blocks: the session's own answer.
            None => mix(session.0 ^ 0x5bd1_e995_0000_0000, p),
        };
        (seed % 151_000) as u32
    };
    let n = (tokens / ENGINE_BLOCK_TOKENS) as usize;
    let mut blocks = Vec::with_capacity(n);
    let known = &known[..known.len().min(n)];
    blocks.extend_from_slice(known);
    let mut parent = known.last().copied().unwrap_or(0);
    for k in known.len()..n {
        let start = k as u64 * ENGINE_BLOCK_TOKENS;
        let mut h = mix(parent, 0x9e37_79b9_7f4a_7c15);
        for p in start..start + ENGINE_BLOCK_TOKENS {
            h = mix(h, u64::from(token_at(p)));
        }
        blocks.push(h);
        parent = h;
    }
    let tokens_of = move |k: usize| {
        let start = k as u64 * ENGINE_BLOCK_TOKENS;
        (start..start + ENGINE_BLOCK_TOKENS).map(token_at).collect()
    };
    (blocks, tokens_of)
}

/// A 64-bit mix of two words (splitmix64 finalizer over their combination).
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvc_core::BlockHash;

    const TRACE_BLOCK: u64 = 64;

    fn ids(v: &[u64]) -> HashIds {
        HashIds::from(v.iter().map(|h| BlockHash(*h)).collect::<Vec<_>>())
    }

    fn stored(events: &[Event]) -> Vec<&BlockStored> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Stored(s) => Some(s),
                _ => None,
            })
            .collect()
    }

    fn removed(events: &[Event]) -> usize {
        events
            .iter()
            .map(|e| match e {
                Event::Removed(r) => r.block_hashes.len(),
                _ => 0,
            })
            .sum()
    }

    #[test]
    fn a_new_session_stores_its_full_blocks_with_their_tokens() {
        let mut cache = WorkerCache::default();
        // 100 tokens: six full 16-token blocks, the rest not cached.
        let ev = cache.diff(&[(SessionId(7), 100, ids(&[1, 2]))], TRACE_BLOCK, None);
        let s = stored(&ev);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].block_hashes.len(), 6);
        assert_eq!(s[0].token_ids.len(), 96);
        assert_eq!(s[0].parent, None);
        assert_eq!(s[0].session_id.as_deref(), Some("s7"));
        assert_eq!(s[0].block_size, 16);
        // Nothing changed: nothing to say.
        assert!(
            cache
                .diff(&[(SessionId(7), 100, ids(&[1, 2]))], TRACE_BLOCK, None)
                .is_empty()
        );
    }

    #[test]
    fn growth_stores_only_the_new_blocks_chained_to_the_last() {
        let mut cache = WorkerCache::default();
        let first = cache.diff(&[(SessionId(1), 64, ids(&[5]))], TRACE_BLOCK, None);
        let last = *stored(&first)[0].block_hashes.last().unwrap();
        let ev = cache.diff(&[(SessionId(1), 100, ids(&[5]))], TRACE_BLOCK, None);
        let s = stored(&ev);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].block_hashes.len(), 2);
        assert_eq!(s[0].parent, Some(last));
        assert_eq!(removed(&ev), 0);
        // The same content computed at once gives the same blocks.
        let mut fresh = WorkerCache::default();
        let all = fresh.diff(&[(SessionId(1), 100, ids(&[5]))], TRACE_BLOCK, None);
        let mut grown = stored(&first)[0].block_hashes.clone();
        grown.extend(&s[0].block_hashes);
        assert_eq!(stored(&all)[0].block_hashes, grown);
    }

    #[test]
    fn shared_prefixes_are_stored_once_and_removed_with_their_last_holder() {
        let mut cache = WorkerCache::default();
        let a = (SessionId(1), 128, ids(&[9, 10]));
        let b = (SessionId(2), 128, ids(&[9, 11]));
        let ev = cache.diff(&[a, b.clone()], TRACE_BLOCK, None);
        let s = stored(&ev);
        // Session 1 stores 8 blocks; session 2 shares the first trace block (4 blocks) and
        // stores its other 4, chained to the shared ones.
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].block_hashes.len(), 8);
        assert_eq!(s[1].block_hashes.len(), 4);
        assert_eq!(s[1].parent, Some(s[0].block_hashes[3]));
        assert_eq!(s[1].session_id.as_deref(), Some("s2"));
        // Session 1 leaves: only its own blocks go; the shared ones stay for session 2.
        let ev = cache.diff(std::slice::from_ref(&b), TRACE_BLOCK, None);
        assert_eq!(removed(&ev), 4);
        assert!(stored(&ev).is_empty());
        // Session 2 leaves too: the rest goes.
        assert_eq!(removed(&cache.diff(&[], TRACE_BLOCK, None)), 8);
        assert!(cache.refs.is_empty());
    }

    #[test]
    fn a_new_turn_replaces_the_answer_blocks_after_the_common_prefix() {
        let mut cache = WorkerCache::default();
        // Turn 1: prompt of one trace block, then 64 tokens of answer.
        cache.diff(&[(SessionId(3), 128, ids(&[20]))], TRACE_BLOCK, None);
        // Turn 2's prompt covers the answer with a new trace block.
        let ev = cache.diff(&[(SessionId(3), 128, ids(&[20, 21]))], TRACE_BLOCK, None);
        assert_eq!(removed(&ev), 4);
        let s = stored(&ev);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].block_hashes.len(), 4);
        // Removals come first, so a block freed and stored again in one step ends stored.
        assert!(matches!(ev[0], Event::Removed(_)));
    }

    #[test]
    fn events_encode_and_decode_as_vllm_sends_them() {
        let mut cache = WorkerCache::default();
        let events = cache.diff(&[(SessionId(4), 40, ids(&[1]))], TRACE_BLOCK, None);
        let batch = EventBatch {
            ts: 1.5,
            events,
            dp_rank: None,
        };
        let back = kvc_events::decode_batch(&kvc_events::encode_batch(&batch)).unwrap();
        assert_eq!(back, batch);
    }
}
