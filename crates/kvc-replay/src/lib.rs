//! # kvc-replay — traces, simulation and replay
//!
//! The replay side of kvc: how anyone learns whether a routing policy is better, on a laptop,
//! deterministically.
//!
//! - [`trace`] reads and writes JSONL traces in the Mooncake shape (plus optional session and
//!   turn ids), rebuilds sessions of traces that have none, generates SWE-agent-like traces
//!   from a seed, and summarizes a trace (`kvc-replay gen swe`, `kvc-replay stats`).
//! - [`sim`] is the discrete-event simulator: the calibrated worker model of prefill, decode
//!   and colocated workers (`kvc_engine_sim::model`) driven on a virtual clock, with the
//!   decisions of a `kvc-policy` policy ([`sim::simulate`]; `kvc-replay sim`).
//! - [`live`] runs the same model on a real clock behind a real `kvc-router`, publishing the
//!   workers' shared-memory snapshots (`kvc-replay live`).
//! - [`http`] replays a trace through any HTTP router in front of the simulated engines of
//!   `kvc-engine-sim` (`kvc-replay live --http`), or serves those engines to any client
//!   (`kvc-replay workers`).
//! - [`profile`] measures a live engine with a bounded sweep and fits an engine profile to it
//!   (`kvc-replay profile`).
//! - [`output`] and [`report`] write and read run directories (`metrics.jsonl`,
//!   `summary.json`, `occupancy.csv`), compare runs and draw SVG plots (`kvc-replay compare`,
//!   `kvc-replay report`, `kvc-replay demo`).
//!
//! Simulating a generated trace with the default policy:
//!
//! ```
//! use kvc_core::Topology;
//! use kvc_policy::PolicyConfig;
//! use kvc_replay::sim::{SimConfig, simulate};
//! use kvc_replay::trace::{self, generate, LoadOptions};
//!
//! let records = generate::swe(&generate::SweConfig { seed: 3, sessions: 2, ..Default::default() });
//! let mut file = Vec::new();
//! trace::write_jsonl(&mut file, &records).unwrap();
//! let (trace, _) = trace::parse(&file[..], "gen.jsonl", &LoadOptions::default()).unwrap();
//! let cfg = SimConfig::new("1p2d".parse::<Topology>().unwrap(), PolicyConfig::default());
//! let out = simulate(&trace, &cfg, &mut |_, _| {}).unwrap();
//! assert_eq!(out.records.len(), trace.requests.len());
//! assert_eq!(out.summary.config.policy, "kvc");
//! ```
//!
//! Loading and summarizing a trace:
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

pub mod http;
pub mod live;
pub mod output;
pub mod profile;
pub mod report;
pub mod sim;
pub mod trace;
