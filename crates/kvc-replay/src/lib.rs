//! # kvc-replay — traces, simulation and replay
//!
//! The replay side of kvc: trace tools now, and (in further modules) a deterministic
//! simulator of P/D and colocated clusters and live replay against the router.
//!
//! [`trace`] reads and writes JSONL traces in the Mooncake shape (plus optional session and
//! turn ids), rebuilds sessions of traces that have none, generates SWE-agent-like traces from a
//! seed, and summarizes a trace. The `kvc-replay` binary exposes it as `kvc-replay gen swe` and
//! `kvc-replay stats`.
//!
//! ```
//! use kvc_replay::trace::{self, generate, stats, LoadOptions};
//!
//! // Generate a small trace, write it as JSONL, load it back and summarize it.
//! let records = generate::swe(&generate::SweConfig { seed: 1, sessions: 2, ..Default::default() });
//! let mut file = Vec::new();
//! trace::write_jsonl(&mut file, &records).unwrap();
//! let (trace, report) = trace::parse(&file[..], "gen.jsonl", &LoadOptions::default()).unwrap();
//! assert_eq!(report.records, records.len());
//! assert_eq!(trace.sessions(), 2);
//! let s = stats::compute(&trace, kvc_core::DEFAULT_MAX_INPUT_TOKENS);
//! assert_eq!(s.requests, records.len());
//! ```
#![forbid(unsafe_code)]

pub mod live;
pub mod output;
pub mod report;
pub mod sim;
pub mod trace;
