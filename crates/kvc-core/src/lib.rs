//! # kvc-core — the shared vocabulary of kvc
//!
//! Every kvc crate, every output file (`metrics.jsonl`, `summary.json`), every metrics label
//! and every CLI flag speaks the types defined here. The crate has no runtime: no I/O, no async,
//! no clock, and it depends on neither tokio nor tonic, so a router written elsewhere can depend
//! on it cheaply.
//!
//! ## In a router written elsewhere
//!
//! A router that asks `kvc-policy` for its decisions meets this crate at its edges: the ids
//! and block ids of an incoming request, the state its workers publish, and the names of what
//! happened, for its logs and metrics (`kvc-policy`'s crate docs show the whole loop):
//!
//! ```
//! use kvc_core::text::{block_hashes, fallback_tokens};
//! use kvc_core::{BlockHash, BlockSize, ExecutionMode, Health, Outcome, SessionId, StableName};
//! use kvc_core::{WorkerRole, WorkerState};
//!
//! // A request in: its session from the client's key, its prompt as chained block ids.
//! let session = SessionId::from_key("agent-7");
//! assert_eq!(session, SessionId::from_key("agent-7")); // the same id on every router
//! let turn1 = fallback_tokens("fix the failing test in parser.rs");
//! let turn2 = fallback_tokens("fix the failing test in parser.rs then run the suite");
//! let block = BlockSize::new(4).expect("a positive size");
//! let ids = |t: &[u32]| -> Vec<BlockHash> {
//!     block_hashes(t, block).into_iter().map(BlockHash).collect()
//! };
//! let (a, b) = (ids(&turn1), ids(&turn2));
//! assert_eq!((a.len(), b.len()), (2, 3)); // 7 and 11 words: the last block partial
//! assert_eq!(kvc_core::prefix::shared_prefix_blocks(&a, &b), 1); // one full block shared
//!
//! // A worker's published load, as the policy reads it.
//! let d = WorkerState { used_tokens: 60_000, evictable_tokens: 20_000, in_flight: 3,
//!                       ..WorkerState::empty(92_160) };
//! assert_eq!(d.available_tokens(), 52_160);
//! assert_eq!(d.committed_tokens(), 40_000);
//! assert!(d.health.is_routable() && !Health::Stale.is_routable());
//!
//! // What happened, named for logs and metric labels, and the one accounting rule.
//! assert_eq!("decode".parse::<WorkerRole>(), Ok(WorkerRole::Decode));
//! assert_eq!(ExecutionMode::DirectToD.as_str(), "direct-to-d");
//! assert_eq!("direct-to-d".parse::<ExecutionMode>(), Ok(ExecutionMode::DirectToD));
//! assert!(!Outcome::InputTooLong.is_mechanism_error());
//! assert!(Outcome::KvTransferTimeout.is_mechanism_error());
//! ```
//!
//! Depend on it with `kvc-core = "0.1"`; it is published on its own, as `kvc-policy` is.
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
#![forbid(unsafe_code)]

// The README's example runs as a doctest too, so the published page stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;

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
