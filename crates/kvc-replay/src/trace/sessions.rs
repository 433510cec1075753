//! Session inference for traces without session ids.
//!
//! Rule (see the trace provenance notes): request B continues request A when B contains the
//! last *full* block that first appeared in A, and B's input is longer than A's. A strict
//! "A's list is a prefix of B's" rule would miss most follow-ups, because A's partial last
//! block gets a new id once the context grows. When several earlier requests qualify, B
//! continues the one whose block sits deepest in B (the most recent context). Follow-ups
//! form a tree; every request of one tree is one session.

use kvc_core::{BlockHash, BlockSize};
use std::collections::{HashMap, HashSet};

/// Session inference over requests given in arrival order, one at a time: what it keeps is
/// every block id seen and, per block id, the request whose last newly introduced full block
/// it is (that request's input and session), never the requests themselves.
#[derive(Debug)]
pub(crate) struct SessionInference {
    block_size: BlockSize,
    /// Every block id seen so far.
    seen: HashSet<BlockHash>,
    /// Block id -> (input, session) of the request whose last newly introduced full block it is.
    key_of: HashMap<BlockHash, (u64, u64)>,
    /// Sessions found so far (numbered `0, 1, …` in order of their first request).
    sessions: u64,
}

impl SessionInference {
    pub(crate) fn new(block_size: BlockSize) -> Self {
        SessionInference {
            block_size,
            seen: HashSet::new(),
            key_of: HashMap::new(),
            sessions: 0,
        }
    }

    /// Sessions found so far.
    pub(crate) fn sessions(&self) -> u64 {
        self.sessions
    }

    /// The session of the next request: the number of the session it continues, or a new one.
    pub(crate) fn push(&mut self, list: &[BlockHash], input: u64) -> u64 {
        let mut parent = None;
        for id in list {
            if let Some(&(a_input, a_session)) = self.key_of.get(id)
                && a_input < input
            {
                parent = Some(a_session);
            }
        }
        let session = parent.unwrap_or_else(|| {
            self.sessions += 1;
            self.sessions - 1
        });
        let full = usize::try_from(self.block_size.full_blocks(input))
            .unwrap_or(usize::MAX)
            .min(list.len());
        let mut last_new = None;
        for (k, id) in list.iter().enumerate() {
            if self.seen.insert(*id) && k < full {
                last_new = Some(*id);
            }
        }
        if let Some(id) = last_new {
            self.key_of.insert(id, (input, session));
        }
        session
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sessions(lists: &[(&[BlockHash], u64)], bs: BlockSize) -> Vec<u64> {
        let mut inference = SessionInference::new(bs);
        lists.iter().map(|(l, n)| inference.push(l, *n)).collect()
    }

    fn ids(v: &[u64]) -> Vec<BlockHash> {
        v.iter().copied().map(BlockHash).collect()
    }

    #[test]
    fn follow_up_found_despite_renamed_partial_block() {
        let bs = BlockSize::new(4).unwrap();
        // A: 3 full blocks + a partial one (id 4). B grows A: block 4 renamed to 5.
        let a = ids(&[1, 2, 3, 4]);
        let b = ids(&[1, 2, 3, 5, 6]);
        // C: unrelated. D: shares only the first block of A, not its last new full block.
        let c = ids(&[7, 8]);
        let d = ids(&[1, 9, 10, 11, 12]);
        let lists = [(&a[..], 14), (&b[..], 18), (&c[..], 8), (&d[..], 20)];
        assert_eq!(sessions(&lists, bs), vec![0, 0, 1, 2]);
    }

    #[test]
    fn a_shorter_request_does_not_continue() {
        let bs = BlockSize::new(4).unwrap();
        let a = ids(&[1, 2, 3]);
        let b = ids(&[1, 2, 3]);
        assert_eq!(sessions(&[(&a[..], 12), (&b[..], 12)], bs), vec![0, 1]);
    }
}
