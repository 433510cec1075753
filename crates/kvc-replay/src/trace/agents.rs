//! What coding-agent traffic adds to a trace: subagent sessions, compactions and explicit
//! session ends, found on any trace (with or without session ids).
//!
//! - **Subagent sessions.** *Explicit*: sessions whose requests carry `parent_session_id`.
//!   *Inferred*: sessions without one whose first request is turn 1 and whose first prompt
//!   shares leading blocks with the latest prompt of a *live* session — one with a request
//!   before it and one after it in trace order — beyond the *common blocks* (the block ids in
//!   the first prompts of more than half of the sessions: the system prompt every session
//!   shares). A child whose prompt shares only the common blocks with its parent cannot be
//!   told from any other new session, and is not inferred.
//! - **Compactions.** A later turn *diverges* when its `hash_ids` do not extend the previous
//!   turn's: they differ before the previous prompt's last full block. Agents that elide old
//!   tool output diverge at almost every other turn while keeping most of the prompt; a
//!   *compaction* is a diverging turn that keeps at most a quarter of the previous prompt's
//!   full blocks (the prompt was rewritten from near its start).
//! - **Explicit ends.** Sessions whose last request carries `final: true`.

use super::Trace;
use kvc_core::BlockHash;
use kvc_core::prefix::shared_prefix_blocks;
use serde::Serialize;
use std::collections::{BTreeSet, HashMap, HashSet};

/// Subagent sessions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SubagentStats {
    /// Sessions whose requests carry `parent_session_id`.
    pub explicit: usize,
    /// Distinct sessions those name as their parent.
    pub explicit_parents: usize,
    /// Sessions without `parent_session_id` that the inference rule finds (module docs).
    pub inferred: usize,
    /// Distinct sessions found as their parents.
    pub inferred_parents: usize,
    /// Block ids in the first prompts of more than half of the sessions.
    pub common_blocks: usize,
    /// Share of sessions that are subagents (explicit or inferred).
    pub share: f64,
}

/// Compactions: later turns that rewrite the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CompactionStats {
    /// Diverging turns that keep at most a quarter of the previous prompt's full blocks.
    pub count: usize,
    /// `count` over `turns`.
    pub share: f64,
    /// Later turns whose `hash_ids` differ from the previous turn's before its last full
    /// block (compactions and elisions of old context alike).
    pub diverging: usize,
    /// `diverging` over `turns`.
    pub diverging_share: f64,
    /// Later turns (turns 2+ of every session).
    pub turns: usize,
}

/// Sessions the client ended explicitly.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EndStats {
    /// Sessions whose last request carries `final: true`.
    pub count: usize,
    /// `count` over sessions.
    pub share: f64,
    /// Requests with `final: true` that are not their session's last.
    pub final_not_last: usize,
}

fn share(count: usize, total: usize) -> f64 {
    if total == 0 {
        0.0
    } else {
        count as f64 / total as f64
    }
}

/// Block ids in the first prompts of more than half of the sessions.
fn common_blocks(trace: &Trace) -> HashSet<BlockHash> {
    let sessions = trace.session_list();
    let mut seen: HashMap<BlockHash, usize> = HashMap::new();
    for s in sessions {
        let Some(&first) = s.requests.first() else {
            continue;
        };
        let ids: HashSet<BlockHash> = trace.requests[first].hash_ids.iter().copied().collect();
        for id in ids {
            *seen.entry(id).or_default() += 1;
        }
    }
    seen.into_iter()
        .filter(|&(_, n)| 2 * n > sessions.len())
        .map(|(id, _)| id)
        .collect()
}

/// Subagent sessions, explicit and inferred (see the module docs).
pub fn subagents(trace: &Trace) -> SubagentStats {
    let reqs = &trace.requests;
    let sessions = trace.session_list();
    let common = common_blocks(trace);

    let mut explicit = 0;
    let mut explicit_parents = BTreeSet::new();
    // Per session slot: first and last request in trace order, and whether it names a parent.
    let mut first_at = vec![usize::MAX; sessions.len()];
    let mut last_at = vec![0; sessions.len()];
    let mut slot_of = vec![0; reqs.len()];
    for (slot, s) in sessions.iter().enumerate() {
        if let Some(p) = s.requests.iter().find_map(|&i| reqs[i].parent_session) {
            explicit += 1;
            explicit_parents.insert(p);
        }
        for &i in &s.requests {
            slot_of[i] = slot;
            first_at[slot] = first_at[slot].min(i);
            last_at[slot] = last_at[slot].max(i);
        }
    }
    let has_parent: Vec<bool> = sessions
        .iter()
        .map(|s| s.requests.iter().any(|&i| reqs[i].parent_session.is_some()))
        .collect();

    // Sweep in trace order: `live` holds the sessions with a request before and after the
    // current one, `latest` the latest request of every session so far.
    let mut live: BTreeSet<usize> = BTreeSet::new();
    let mut latest = vec![usize::MAX; sessions.len()];
    let mut inferred = 0;
    let mut inferred_parents = BTreeSet::new();
    for (i, r) in reqs.iter().enumerate() {
        let slot = slot_of[i];
        if i == first_at[slot] && r.turn.is_first() && !has_parent[slot] {
            let mut best: Option<(usize, usize)> = None;
            for &p in &live {
                let prompt = &reqs[latest[p]].hash_ids;
                let shared = shared_prefix_blocks(prompt, &r.hash_ids);
                let beyond_common = r.hash_ids[..shared].iter().any(|id| !common.contains(id));
                if beyond_common && best.is_none_or(|(_, n)| shared > n) {
                    best = Some((p, shared));
                }
            }
            if let Some((p, _)) = best {
                inferred += 1;
                inferred_parents.insert(p);
            }
        }
        latest[slot] = i;
        if i == first_at[slot] {
            live.insert(slot);
        }
        if i == last_at[slot] {
            live.remove(&slot);
        }
    }

    SubagentStats {
        explicit,
        explicit_parents: explicit_parents.len(),
        inferred,
        inferred_parents: inferred_parents.len(),
        common_blocks: common.len(),
        share: share(explicit + inferred, sessions.len()),
    }
}

/// Compactions (see the module docs).
pub fn compactions(trace: &Trace) -> CompactionStats {
    let reqs = &trace.requests;
    let bs = trace.block_size();
    let (mut count, mut diverging, mut turns) = (0, 0, 0);
    for s in trace.session_list() {
        for pair in s.requests.windows(2) {
            let (prev, cur) = (&reqs[pair[0]], &reqs[pair[1]]);
            turns += 1;
            let full = usize::try_from(bs.full_blocks(prev.input_length))
                .unwrap_or(usize::MAX)
                .min(prev.hash_ids.len());
            let kept = shared_prefix_blocks(&prev.hash_ids, &cur.hash_ids);
            if kept < full {
                diverging += 1;
                if 4 * kept <= full {
                    count += 1;
                }
            }
        }
    }
    CompactionStats {
        count,
        share: share(count, turns),
        diverging,
        diverging_share: share(diverging, turns),
        turns,
    }
}

/// Explicit session ends.
pub fn ends(trace: &Trace) -> EndStats {
    let reqs = &trace.requests;
    let sessions = trace.session_list();
    let mut count = 0;
    let mut final_not_last = 0;
    for s in sessions {
        if let Some((&last, rest)) = s.requests.split_last() {
            count += usize::from(reqs[last].session_final);
            final_not_last += rest.iter().filter(|&&i| reqs[i].session_final).count();
        }
    }
    EndStats {
        count,
        share: share(count, sessions.len()),
        final_not_last,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::LoadOptions;
    use kvc_core::{BlockSize, SessionId, TraceRecord, TurnId};

    /// Block size of the hand-made traces.
    const BS: u32 = 4;

    struct Rec {
        ts: u64,
        session: u64,
        turn: u32,
        parent: Option<u64>,
        last: bool,
        ids: &'static [u64],
        /// Tokens (default: every block full).
        input: Option<u64>,
    }

    fn rec(ts: u64, session: u64, turn: u32, ids: &'static [u64]) -> Rec {
        Rec {
            ts,
            session,
            turn,
            parent: None,
            last: false,
            ids,
            input: None,
        }
    }

    impl Rec {
        fn child_of(self, parent: u64) -> Rec {
            Rec {
                parent: Some(parent),
                ..self
            }
        }
        fn last(self) -> Rec {
            Rec { last: true, ..self }
        }
        fn input(self, tokens: u64) -> Rec {
            Rec {
                input: Some(tokens),
                ..self
            }
        }
    }

    fn trace(recs: Vec<Rec>) -> Trace {
        let records: Vec<TraceRecord> = recs
            .into_iter()
            .map(|r| TraceRecord {
                timestamp: r.ts,
                session_id: Some(SessionId(r.session)),
                parent_session_id: r.parent.map(SessionId),
                turn_id: Some(TurnId(r.turn)),
                session_final: r.last,
                input_length: r.input.unwrap_or(r.ids.len() as u64 * u64::from(BS)),
                output_length: 1,
                hash_ids: r.ids.iter().copied().map(BlockHash).collect(),
            })
            .collect();
        let opts = LoadOptions {
            block_size: BlockSize::new(BS).unwrap(),
            ..LoadOptions::default()
        };
        Trace::from_records(&records, &opts).unwrap().0
    }

    #[test]
    fn explicit_children_and_ends_are_counted() {
        let t = trace(vec![
            rec(0, 1, 1, &[1, 2]),
            rec(5, 2, 1, &[1, 3]).child_of(1),
            rec(6, 2, 2, &[1, 3, 4]).child_of(1).last(),
            rec(7, 3, 1, &[1, 5]).child_of(1),
            rec(8, 4, 1, &[9]).last(),
            rec(9, 4, 2, &[9, 10]),
            rec(10, 1, 2, &[1, 2, 6]),
            rec(20, 1, 3, &[1, 2, 6, 7]).last(),
        ]);
        let s = subagents(&t);
        assert_eq!((s.explicit, s.explicit_parents), (2, 1));
        assert_eq!((s.inferred, s.inferred_parents), (0, 0));
        assert_eq!(s.share, 0.5);
        let e = ends(&t);
        // Sessions 1 and 2 end explicitly; session 4's flag is on its first of two requests.
        assert_eq!((e.count, e.share, e.final_not_last), (2, 0.5, 1));
    }

    #[test]
    fn a_new_session_sharing_a_live_sessions_own_blocks_is_an_inferred_child() {
        // Blocks 100 and 101 (a system prompt) open the first prompt of 8 of 9 sessions.
        let t = trace(vec![
            rec(0, 1, 1, &[100, 101, 1, 2]),
            // Shares 100, 101 and 1 with session 1, which is live (turns at 0 and 100).
            rec(50, 2, 1, &[100, 101, 1, 9]),
            // Shares only the common blocks with session 1.
            rec(60, 3, 1, &[100, 101, 20, 21]),
            // A child named as such is explicit, not inferred.
            rec(70, 5, 1, &[100, 101, 1, 2, 3]).child_of(1),
            rec(80, 6, 1, &[200, 201]),
            rec(90, 7, 1, &[100, 101, 40]),
            rec(95, 8, 1, &[100, 101, 50]),
            rec(96, 9, 1, &[100, 101, 60]),
            rec(100, 1, 2, &[100, 101, 1, 2, 3, 4]),
            rec(200, 1, 3, &[100, 101, 1, 2, 3, 4, 5]),
            // Shares session 1's blocks, but session 1 has ended (no request after this one).
            rec(300, 4, 1, &[100, 101, 1, 2, 30]),
        ]);
        let s = subagents(&t);
        assert_eq!(s.common_blocks, 2);
        assert_eq!((s.explicit, s.explicit_parents), (1, 1));
        assert_eq!((s.inferred, s.inferred_parents), (1, 1));
        assert_eq!(s.share, 2.0 / 9.0);
    }

    #[test]
    fn without_a_common_prefix_any_shared_leading_block_counts() {
        // Block 1 opens the first prompts of half of the sessions, not more: it is not common.
        let t = trace(vec![
            rec(0, 1, 1, &[1, 2]),
            rec(5, 2, 1, &[1, 3]),
            rec(6, 3, 1, &[7]),
            rec(7, 4, 1, &[8]),
            rec(9, 1, 2, &[1, 2, 4]),
        ]);
        let s = subagents(&t);
        assert_eq!((s.common_blocks, s.inferred, s.inferred_parents), (0, 1, 1));
    }

    #[test]
    fn a_rewritten_prompt_is_a_compaction_an_elision_only_diverges() {
        let t = trace(vec![
            rec(0, 1, 1, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
            // Extends turn 1.
            rec(1, 1, 2, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]).input(46),
            // Extends turn 2: its partial last block (12) gets a new id as the context grows.
            rec(2, 1, 3, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14]).input(50),
            // Elision: diverges at block 8 of 12 full ones, keeps 8 (more than a quarter).
            rec(3, 1, 4, &[1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22]),
            // Compaction: keeps 2 of 11 full blocks.
            rec(4, 1, 5, &[1, 2, 30, 31]),
            // A retry repeats the prompt; then it grows again.
            rec(5, 1, 6, &[1, 2, 30, 31]),
            rec(6, 1, 7, &[1, 2, 30, 31, 32]),
            rec(7, 2, 1, &[1, 2, 40]),
        ]);
        let c = compactions(&t);
        assert_eq!((c.turns, c.diverging, c.count), (6, 2, 1));
        assert_eq!(c.share, 1.0 / 6.0);
        assert_eq!(c.diverging_share, 2.0 / 6.0);
        // A quarter exactly still counts: 1 of 4 full blocks kept.
        let t = trace(vec![rec(0, 1, 1, &[1, 2, 3, 4]), rec(1, 1, 2, &[1, 9, 10])]);
        assert_eq!(compactions(&t).count, 1);
        let t = trace(vec![rec(0, 1, 1, &[1, 2, 3]), rec(1, 1, 2, &[1, 9, 10])]);
        assert_eq!((compactions(&t).diverging, compactions(&t).count), (1, 0));
    }

    #[test]
    fn a_trace_without_sessions_has_none_of_these() {
        let records: Vec<TraceRecord> = (0..4u64)
            .map(|i| TraceRecord {
                timestamp: i,
                session_id: None,
                parent_session_id: None,
                turn_id: None,
                session_final: false,
                input_length: 8,
                output_length: 1,
                hash_ids: vec![BlockHash(1), BlockHash(10 + i)],
            })
            .collect();
        let opts = LoadOptions {
            block_size: BlockSize::new(BS).unwrap(),
            ..LoadOptions::default()
        };
        let t = Trace::from_records(&records, &opts).unwrap().0;
        // Block 1 is common; each request its own session, none live.
        let s = subagents(&t);
        assert_eq!((s.common_blocks, s.explicit, s.inferred), (1, 0, 0));
        let c = compactions(&t);
        assert_eq!((c.turns, c.diverging, c.count, c.share), (0, 0, 0, 0.0));
        assert_eq!((ends(&t).count, ends(&t).share), (0, 0.0));
    }
}
