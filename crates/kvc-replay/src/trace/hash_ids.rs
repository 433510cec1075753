//! The loader's per-session block-id stores: one shared store per session, each turn a window
//! ([`kvc_core::HashIds`]) over it.

use kvc_core::BlockHash;
use std::sync::Arc;

/// Builds the per-session stores: lists are appended in turn order, and a list that starts
/// with the whole previous list (or is a prefix of it) reuses its ids.
#[derive(Default)]
pub(crate) struct SessionStore {
    ids: Vec<BlockHash>,
    /// `(start, len)` of the last list added.
    last: Option<(usize, usize)>,
}

impl SessionStore {
    /// Adds a list; returns its `(start, len)` in the store.
    pub(crate) fn push(&mut self, list: &[BlockHash]) -> (usize, usize) {
        if let Some((start, len)) = self.last {
            let prev = &self.ids[start..start + len];
            if list.len() <= len && prev[..list.len()] == *list {
                return (start, list.len());
            }
            if start + len == self.ids.len() && list.len() > len && list[..len] == *prev {
                self.ids.extend_from_slice(&list[len..]);
                self.last = Some((start, list.len()));
                return (start, list.len());
            }
        }
        let start = self.ids.len();
        self.ids.extend_from_slice(list);
        self.last = Some((start, list.len()));
        (start, list.len())
    }

    /// Ids held so far.
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// Freezes the store.
    pub(crate) fn finish(self) -> Arc<[BlockHash]> {
        Arc::from(self.ids)
    }
}
