//! # kvc-policy — routing policies as pure functions
//!
//! Placeholder for the policy crate; see ARCHITECTURE.md.
#![forbid(unsafe_code)]
