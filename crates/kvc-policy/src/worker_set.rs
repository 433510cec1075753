//! Sets of worker ids: the bitsets a decision builds.

use smallvec::SmallVec;

/// A set of worker ids (each below [`MAX_WORKERS`](crate::view::MAX_WORKERS)): a bitset as long as its largest member
/// needs (inline up to 256 workers), for the sets a decision builds (healthy workers of a role,
/// candidates), so a small fleet pays for four words and not for the limit's sixty-four. The
/// index stores its holders in the compact [`Holders`](crate::index::Holders) instead.
#[derive(Debug, Clone, Default)]
pub(crate) struct WorkerSet(SmallVec<[u64; 4]>);

impl PartialEq for WorkerSet {
    fn eq(&self, other: &Self) -> bool {
        let n = self.0.len().max(other.0.len());
        (0..n).all(|i| self.word(i) == other.word(i))
    }
}

impl Eq for WorkerSet {}

impl WorkerSet {
    pub(crate) const EMPTY: WorkerSet = WorkerSet(SmallVec::new_const());

    fn word(&self, i: usize) -> u64 {
        self.0.get(i).copied().unwrap_or(0)
    }

    pub(crate) fn insert(&mut self, slot: usize) {
        let w = slot / 64;
        if self.0.len() <= w {
            self.0.resize(w + 1, 0);
        }
        self.0[w] |= 1 << (slot % 64);
    }

    pub(crate) fn remove(&mut self, slot: usize) {
        if let Some(w) = self.0.get_mut(slot / 64) {
            *w &= !(1 << (slot % 64));
        }
    }

    pub(crate) fn contains(&self, slot: usize) -> bool {
        self.word(slot / 64) & (1 << (slot % 64)) != 0
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub(crate) fn and(&self, other: &WorkerSet) -> WorkerSet {
        let n = self.0.len().min(other.0.len());
        WorkerSet(
            self.0[..n]
                .iter()
                .zip(&other.0[..n])
                .map(|(a, b)| a & b)
                .collect(),
        )
    }

    /// The workers in either set.
    pub(crate) fn or(&self, other: &WorkerSet) -> WorkerSet {
        let (long, short) = if self.0.len() >= other.0.len() {
            (self, other)
        } else {
            (other, self)
        };
        let mut out = long.clone();
        for (w, s) in out.0.iter_mut().zip(short.0.iter()) {
            *w |= s;
        }
        out
    }

    pub(crate) fn and_not(&self, other: &WorkerSet) -> WorkerSet {
        let mut out = self.clone();
        for (i, a) in out.0.iter_mut().enumerate() {
            *a &= !other.word(i);
        }
        out
    }

    /// The largest member, if any.
    pub(crate) fn last(&self) -> Option<usize> {
        self.0
            .iter()
            .enumerate()
            .rev()
            .find(|(_, w)| **w != 0)
            .map(|(i, w)| i * 64 + 63 - w.leading_zeros() as usize)
    }

    /// The smallest member `>= from`, if any.
    pub(crate) fn first_at_or_after(&self, from: usize) -> Option<usize> {
        let mut word = from / 64;
        let mut bits = self.word(word) & (u64::MAX << (from % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            if word >= self.0.len() {
                return None;
            }
            bits = self.0[word];
        }
    }

    /// Members in increasing order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        let mut next = 0usize;
        std::iter::from_fn(move || {
            let found = self.first_at_or_after(next)?;
            next = found + 1;
            Some(found)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(slots: &[usize]) -> WorkerSet {
        let mut s = WorkerSet::EMPTY;
        for &x in slots {
            s.insert(x);
        }
        s
    }

    #[test]
    fn worker_set_operations() {
        let s = set(&[0, 3, 64, 200, 255, 4_095]);
        assert_eq!(
            s.iter().collect::<Vec<_>>(),
            vec![0, 3, 64, 200, 255, 4_095]
        );
        assert_eq!(s.len(), 6);
        assert_eq!(s.last(), Some(4_095));
        assert_eq!(set(&[3, 70]).last(), Some(70));
        assert_eq!(WorkerSet::EMPTY.last(), None);
        assert_eq!(s.first_at_or_after(4), Some(64));
        assert_eq!(s.first_at_or_after(201), Some(255));
        assert_eq!(s.first_at_or_after(256), Some(4_095));
        assert_eq!(s.first_at_or_after(4_096), None);
        assert!(s.contains(200) && !s.contains(199) && !s.contains(300) && !s.contains(4_096));
        let t = set(&[3, 200, 7]);
        assert_eq!(
            s.and_not(&t).iter().collect::<Vec<_>>(),
            vec![0, 64, 255, 4_095]
        );
        assert_eq!(t.and_not(&s).iter().collect::<Vec<_>>(), vec![7]);
        // Equality ignores trailing empty words.
        let mut grown = set(&[3, 4_000]);
        grown.remove(4_000);
        assert_eq!(grown, set(&[3]));
        assert_ne!(grown, set(&[4]));
        assert!(WorkerSet::EMPTY.is_empty());
        let mut u = s;
        u.remove(0);
        assert_eq!(u.first_at_or_after(0), Some(3));
    }
}
