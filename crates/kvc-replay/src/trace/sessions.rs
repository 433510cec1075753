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

/// For requests given in arrival order (`lists[i]`, `inputs[i]`), the root request of each
/// one's session (a request with no predecessor is its own root).
pub(crate) fn infer_roots<'a>(
    requests: impl ExactSizeIterator<Item = (&'a [BlockHash], u64)>,
    block_size: BlockSize,
) -> Vec<usize> {
    let n = requests.len();
    let mut roots: Vec<usize> = Vec::with_capacity(n);
    let mut inputs: Vec<u64> = Vec::with_capacity(n);
    // Every block id seen so far.
    let mut seen: HashSet<BlockHash> = HashSet::new();
    // Block id -> the request whose last newly introduced full block it is.
    let mut key_of: HashMap<BlockHash, usize> = HashMap::new();
    for (i, (list, input)) in requests.enumerate() {
        let mut parent = None;
        for id in list {
            if let Some(&a) = key_of.get(id)
                && inputs[a] < input
            {
                parent = Some(a);
            }
        }
        roots.push(parent.map_or(i, |a| roots[a]));
        inputs.push(input);

        let full = usize::try_from(block_size.full_blocks(input))
            .unwrap_or(usize::MAX)
            .min(list.len());
        let mut last_new = None;
        for (k, id) in list.iter().enumerate() {
            if seen.insert(*id) && k < full {
                last_new = Some(*id);
            }
        }
        if let Some(id) = last_new {
            key_of.insert(id, i);
        }
    }
    roots
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let roots = infer_roots(lists.iter().map(|(l, n)| (*l, *n)), bs);
        assert_eq!(roots, vec![0, 0, 2, 3]);
    }

    #[test]
    fn a_shorter_request_does_not_continue() {
        let bs = BlockSize::new(4).unwrap();
        let a = ids(&[1, 2, 3]);
        let b = ids(&[1, 2, 3]);
        let roots = infer_roots([(&a[..], 12), (&b[..], 12)].into_iter(), bs);
        assert_eq!(roots, vec![0, 1]);
    }
}
