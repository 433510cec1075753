//! # kvc-replay — traces, simulation and replay
//!
//! Placeholder for the replay crate; see ARCHITECTURE.md.
#![forbid(unsafe_code)]
