//! Shared block-id lists.

use crate::BlockHash;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// The chained block ids of one request: a window into a reference-counted store.
///
/// Cloning is cheap (one reference-count increment). The loader puts all lists of one session
/// into one store; a turn whose list extends (or repeats) the previous turn's whole list is a
/// window over the same ids instead of a copy. Dereferences to `[BlockHash]`; compares by
/// content.
///
/// ```
/// use kvc_core::BlockHash;
/// use kvc_core::HashIds;
///
/// let ids = HashIds::from(vec![BlockHash(1), BlockHash(2)]);
/// let copy = ids.clone();
/// assert_eq!(&copy[..], &[BlockHash(1), BlockHash(2)]);
/// assert!(copy.shares_storage_with(&ids));
/// ```
#[derive(Clone)]
pub struct HashIds {
    store: Arc<[BlockHash]>,
    start: u32,
    len: u32,
}

impl HashIds {
    /// A window `start..start + len` into `store`; `None` if it does not fit (or does not fit
    /// in 32-bit offsets).
    pub fn window(store: Arc<[BlockHash]>, start: usize, len: usize) -> Option<Self> {
        let end = start.checked_add(len)?;
        if end > store.len() {
            return None;
        }
        Some(HashIds {
            store,
            start: u32::try_from(start).ok()?,
            len: u32::try_from(len).ok()?,
        })
    }

    /// The ids as a slice.
    pub fn as_slice(&self) -> &[BlockHash] {
        let start = self.start as usize;
        &self.store[start..start + self.len as usize]
    }

    /// Whether both lists are windows into the same store (so their common ids are held once).
    pub fn shares_storage_with(&self, other: &HashIds) -> bool {
        Arc::ptr_eq(&self.store, &other.store)
    }

    /// Ids held by the underlying store (shared by every window into it).
    pub fn store_len(&self) -> usize {
        self.store.len()
    }
}

impl Default for HashIds {
    fn default() -> Self {
        HashIds {
            store: Arc::from(Vec::new()),
            start: 0,
            len: 0,
        }
    }
}

impl Deref for HashIds {
    type Target = [BlockHash];

    fn deref(&self) -> &[BlockHash] {
        self.as_slice()
    }
}

impl AsRef<[BlockHash]> for HashIds {
    fn as_ref(&self) -> &[BlockHash] {
        self.as_slice()
    }
}

impl From<Vec<BlockHash>> for HashIds {
    fn from(ids: Vec<BlockHash>) -> Self {
        let store: Arc<[BlockHash]> = Arc::from(ids);
        let len = store.len();
        // A single list longer than u32::MAX ids (2^32 blocks of tokens) cannot occur in a
        // trace that fits in memory; clamp rather than panic.
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        HashIds {
            store,
            start: 0,
            len,
        }
    }
}

impl FromIterator<BlockHash> for HashIds {
    fn from_iter<I: IntoIterator<Item = BlockHash>>(iter: I) -> Self {
        HashIds::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl PartialEq for HashIds {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for HashIds {}

impl fmt::Debug for HashIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}
