//! The seqlock protocol, on its own.
//!
//! The snapshot writer and reader are built from three crate-internal functions,
//! `begin_write`, `end_write` and `read_consistent`; [`SeqlockWords`] runs the same three over
//! a small in-memory word buffer, which is what the loom model checks (loom cannot model
//! `mmap`, and a model of a few words stays small enough to explore exhaustively).

use crate::sync::{AtomicU64, Ordering, fence, spin_loop};

/// Starts a publish: stores `last_even + 1` (odd) and issues a release fence, so no word stored
/// afterwards can be seen by a reader whose second sequence load still returns `last_even`.
/// Returns the even number to end the publish with.
#[inline]
pub(crate) fn begin_write(seq: &AtomicU64, last_even: u64) -> u64 {
    seq.store(last_even + 1, Ordering::Relaxed);
    fence(Ordering::Release);
    last_even + 2
}

/// Ends a publish: stores the even number with release ordering, publishing every word stored
/// since [`begin_write`].
#[inline]
pub(crate) fn end_write(seq: &AtomicU64, even: u64) {
    seq.store(even, Ordering::Release);
}

/// Result of a bounded seqlock read.
pub(crate) enum SeqRead<T> {
    /// A consistent read.
    Consistent(T),
    /// The sequence number was 0: nothing published.
    NotPublished,
    /// Every attempt overlapped a publish. `stuck`: the sequence stayed at one odd value
    /// throughout (a writer stopped in the middle of a publish, or a slow one).
    Contended { stuck: bool },
}

/// The reader side: load the sequence (relaxed load then acquire fence — an acquire load that
/// is also allowed on read-only mappings); if odd, retry; run `body(seq)` (relaxed loads only);
/// acquire fence; reload the sequence; accept if unchanged. At most `max_attempts` attempts
/// (at least one).
#[inline]
pub(crate) fn read_consistent<T>(
    seq: &AtomicU64,
    max_attempts: u32,
    mut body: impl FnMut(u64) -> T,
) -> SeqRead<T> {
    let mut first = None;
    let mut last = 0;
    for _ in 0..max_attempts.max(1) {
        let s1 = seq.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        first.get_or_insert(s1);
        last = s1;
        if s1 & 1 == 0 {
            if s1 == 0 {
                return SeqRead::NotPublished;
            }
            let value = body(s1);
            fence(Ordering::Acquire);
            let s2 = seq.load(Ordering::Relaxed);
            if s2 == s1 {
                return SeqRead::Consistent(value);
            }
            last = s2;
        }
        spin_loop();
    }
    SeqRead::Contended {
        stuck: first == Some(last) && last & 1 == 1,
    }
}

/// Why a [`SeqlockWords::read`] returned nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SeqlockError {
    /// Every attempt overlapped a publish.
    #[error("every read attempt overlapped a publish")]
    Contended,
    /// Nothing was published yet.
    #[error("nothing has been published yet")]
    NotPublished,
}

/// A sequence number and a few words under the seqlock protocol, in ordinary memory.
///
/// One thread publishes ([`publish`](Self::publish) must never run concurrently with itself);
/// any number read.
///
/// ```
/// use kvc_admission::seqlock::{SeqlockError, SeqlockWords};
///
/// let words = SeqlockWords::new(3);
/// let mut out = [0; 3];
/// assert_eq!(words.read(&mut out, 8), Err(SeqlockError::NotPublished));
/// assert_eq!(words.publish(&[1, 2, 3]), 2);
/// assert_eq!(words.read(&mut out, 8), Ok(2));
/// assert_eq!(out, [1, 2, 3]);
/// ```
#[derive(Debug)]
pub struct SeqlockWords {
    seq: AtomicU64,
    words: Box<[AtomicU64]>,
}

impl SeqlockWords {
    /// `len` zero words, nothing published.
    pub fn new(len: usize) -> Self {
        SeqlockWords {
            seq: AtomicU64::new(0),
            words: (0..len).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Number of words.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Whether there are no words.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Publishes `values` (at most [`len`](Self::len) of them; the rest keep their value) and
    /// returns the new sequence number. Single writer only.
    pub fn publish(&self, values: &[u64]) -> u64 {
        // The single writer reads back its own last store.
        let last = self.seq.load(Ordering::Relaxed);
        let even = begin_write(&self.seq, last);
        for (w, v) in self.words.iter().zip(values) {
            w.store(*v, Ordering::Relaxed);
        }
        end_write(&self.seq, even);
        even
    }

    /// Reads a consistent copy of the words into `out` (at most [`len`](Self::len) of them) and
    /// returns its sequence number. On error `out` holds unspecified values.
    pub fn read(&self, out: &mut [u64], max_attempts: u32) -> Result<u64, SeqlockError> {
        match read_consistent(&self.seq, max_attempts, |seq| {
            for (o, w) in out.iter_mut().zip(self.words.iter()) {
                *o = w.load(Ordering::Relaxed);
            }
            seq
        }) {
            SeqRead::Consistent(seq) => Ok(seq),
            SeqRead::NotPublished => Err(SeqlockError::NotPublished),
            SeqRead::Contended { .. } => Err(SeqlockError::Contended),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn publish_read_round_trip() {
        let w = SeqlockWords::new(2);
        assert_eq!(w.len(), 2);
        assert!(!w.is_empty());
        let mut out = [9; 2];
        assert_eq!(w.publish(&[4, 5]), 2);
        assert_eq!(w.publish(&[6]), 4);
        assert_eq!(w.read(&mut out, 1), Ok(4));
        assert_eq!(out, [6, 5]);
    }

    #[test]
    fn odd_sequence_is_contended_and_stuck() {
        let w = SeqlockWords::new(1);
        w.publish(&[1]);
        w.seq.store(3, Ordering::Relaxed);
        let mut out = [0];
        assert_eq!(w.read(&mut out, 5), Err(SeqlockError::Contended));
        assert!(matches!(
            read_consistent(&w.seq, 5, |_| ()),
            SeqRead::Contended { stuck: true }
        ));
    }

    #[test]
    fn threads_never_see_mixed_words() {
        let w = Arc::new(SeqlockWords::new(4));
        w.publish(&[1, 2, 3, 4]);
        let writer = {
            let w = Arc::clone(&w);
            std::thread::spawn(move || {
                for k in 1..20_000u64 {
                    w.publish(&[k, 2 * k, 3 * k, 4 * k]);
                }
            })
        };
        let mut out = [0; 4];
        let mut accepted = 0;
        while !writer.is_finished() || accepted == 0 {
            if w.read(&mut out, 16).is_ok() {
                let k = out[0];
                assert_eq!(out, [k, 2 * k, 3 * k, 4 * k]);
                accepted += 1;
            }
        }
        writer.join().unwrap();
    }
}
