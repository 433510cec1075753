//! # kvc-admission — probe, commit_evict and eviction planning for decode workers
//!
//! Placeholder for the admission crate; see ARCHITECTURE.md.
#![deny(unsafe_code)]
