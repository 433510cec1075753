//! # kvc-core — the shared vocabulary of kvc
//!
//! Every kvc crate, every output file (`metrics.jsonl`, `summary.json`), every metrics label
//! and every CLI flag speaks the types defined here. The crate has no runtime: no I/O, no async,
//! no clock, and it depends on neither tokio nor tonic, so a router written elsewhere can depend
//! on it cheaply.
//!
//! What is here:
//! - ids: [`SessionId`], [`TurnId`], [`RequestId`], [`WorkerId`], [`BlockHash`] and the block
//!   size ([`BlockSize`], 512 tokens by default);
//! - the trace record ([`TraceRecord`]) in the Mooncake JSONL shape plus optional session and turn;
//! - worker roles ([`WorkerRole`]), health ([`Health`]) and the state a router sees
//!   ([`WorkerState`]); cluster shapes ([`Topology`], e.g. `1p3d`, `4dp`);
//! - execution modes ([`ExecutionMode`]), fall-through reasons ([`FallThroughReason`]) and
//!   request outcomes ([`Outcome`]) with the one rule for what counts as a mechanism error
//!   ([`Outcome::is_mechanism_error`]);
//! - the names of settings and states other crates expose in files, labels and flags: prefill
//!   selection ([`PrefillPolicy`]), decode-side eviction ([`EvictionMode`]), the HTTP front's
//!   circuit breaker ([`BreakerState`]), and the router's probe, commit and session-table
//!   results ([`ProbeKind`], [`CommitKind`], [`Forgotten`]);
//! - block-prefix helpers ([`prefix`]);
//! - the nearest-rank percentile every kvc summary reports ([`stats`]) and the scanner and
//!   framing of Server-Sent Events streams ([`sse`]);
//! - how a text or chat prompt becomes token ids and chained block ids ([`text`]);
//! - OpenAI-style bodies as vLLM reads them: a chat message's text, NixlConnector's prefill
//!   body and an answer's token counts in each API ([`openai`]); the coding agents' APIs
//!   (Anthropic Messages, OpenAI Responses) as chat messages ([`agent_apis`]).
//!
//! Every enum serializes to a **stable kebab-case name** ([`StableName`]); the same string is
//! used in JSON, in metrics labels and on the command line.
//!
//! ```
//! use kvc_core::{ExecutionMode, Outcome, StableName};
//!
//! assert_eq!(ExecutionMode::DirectToD.as_str(), "direct-to-d");
//! assert_eq!("direct-to-d".parse::<ExecutionMode>().unwrap(), ExecutionMode::DirectToD);
//! assert!(!Outcome::InputTooLong.is_mechanism_error());
//! assert!(Outcome::KvTransferTimeout.is_mechanism_error());
//! ```
#![forbid(unsafe_code)]

pub mod agent_apis;
mod hash_ids;
mod ids;
mod names;
pub mod openai;
pub mod prefix;
pub mod sse;
pub mod stats;
pub mod text;
mod topology;
mod trace;
mod worker;

pub use hash_ids::HashIds;
pub use ids::{BlockHash, BlockSize, RequestId, SessionId, TurnId, WorkerId};
pub use names::{
    BreakerState, CommitKind, EngineKind, EvictionMode, ExecutionMode, FailureStage,
    FallThroughReason, Forgotten, Health, Outcome, PrefillPolicy, ProbeKind, StableName,
    StateSource, UnknownName, WorkerRole,
};
pub use topology::{Topology, TopologyError};
pub use trace::TraceRecord;
pub use worker::{Capabilities, WorkerState};

/// Default block size in tokens: one `hash_ids` entry covers this many tokens.
pub const DEFAULT_BLOCK_SIZE: u32 = 512;

/// Default model input limit in tokens (the reference deployment rejected inputs above it).
pub const DEFAULT_MAX_INPUT_TOKENS: u64 = 92_098;

/// KV bytes per token of the reference model (Qwen3-30B-A3B, bf16): 2 × 48 × 4 × 128 × 2.
pub const REFERENCE_KV_BYTES_PER_TOKEN: u64 = 98_304;
