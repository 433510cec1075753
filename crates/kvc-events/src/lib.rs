//! # kvc-events — what a stock engine's KV cache holds
//!
//! Stock vLLM and SGLang publish every block they cache and evict as msgpack batches over
//! ZeroMQ. This crate turns those streams into a bounded per-worker block index the router
//! can ask "how many leading blocks of this request does each worker hold?" in one pass.
//!
//! Modules, one job each:
//! - [`decode`]: a payload → [`EventBatch`], in every shape vLLM and SGLang send (batch as
//!   array or map; events as tagged maps or positional arrays; hashes as u64, i64 or bytes);
//!   typed errors, never a panic.
//! - [`encode`]: [`EventBatch`] → vLLM 0.33's map shape (for simulated workers and tests).
//! - [`chain`]: kvc's own block key, a chained xxh3-64 of each block's tokens (the rule is in
//!   that module's doc), the same for every engine and for requests.
//! - [`index`]: [`KvIndex`], blocks per worker keyed by that key (engine hashes kept only to
//!   resolve parents and removals), overlap across all workers in one walk, per-session
//!   residency, a per-worker bound with oldest-first dropping, stated memory per block.
//! - [`seq`]: [`SeqTracker`], what to do with each sequence number (apply, ignore, replay,
//!   reset).
//! - [`frames`]: the ZeroMQ framing of live messages, replay requests and replies.
//! - [`subscriber`]: one tokio task per worker and data-parallel rank (a SUB socket, and a
//!   replay DEALER while a replay runs) writing the shared index; counters in [`WorkerStats`].
//! - [`listener`]: one SUB socket (per rank) that *binds*, for engines that connect their
//!   PUB to the router; each message's topic names its worker, each worker's rank then read
//!   by the same stream logic as a subscriber's.
//! - [`publisher`]: PUB + replay ROUTER with a ring buffer, as an engine publishes.
//!
//! ## Use
//!
//! The router keeps one [`SharedIndex`], starts one subscriber per worker that has a
//! `kv-events` endpoint, reads [`WorkerStats::snapshot`] for `ListWorkers` and `/metrics`, and
//! asks the index for overlaps when routing:
//!
//! ```no_run
//! use kvc_core::{BlockSize, SessionId, WorkerId};
//! use kvc_events::{KvIndex, SharedIndex, SubscriberConfig, WorkerSpec, chain_keys, spawn_subscriber};
//! use std::sync::Arc;
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn example() {
//! let index: SharedIndex = Arc::new(parking_lot::RwLock::new(KvIndex::new()));
//! let cancel = CancellationToken::new();
//! let spec = WorkerSpec { block_size: BlockSize::new(16).unwrap(), capacity_blocks: 40_000 };
//! let mut cfg = SubscriberConfig::new(WorkerId(1), spec, "tcp://10.0.0.5:5557");
//! cfg.replay_endpoint = Some("tcp://10.0.0.5:5558".into());
//! cfg.topic = "kv@pod-1@llama".into();
//! let sub = spawn_subscriber(cfg, index.clone(), cancel.clone());
//!
//! // Routing: the request's tokens, chained in the workers' block size.
//! let tokens: Vec<u32> = vec![1; 4096];
//! let keys = chain_keys(&tokens, 16);
//! let per_worker: Vec<(WorkerId, usize)> = index.read().overlap(&keys);
//! let resident = index.read().session_residency(SessionId::from_key("session-42"));
//! let stats = sub.stats.snapshot(); // indexed_blocks, last_seq, gaps, resets, …
//! # let _ = (per_worker, resident, stats);
//! cancel.cancel();
//! # }
//! ```
//!
//! The index is plain data ([`KvIndex`]); the subscriber only locks it to apply a batch, so a
//! router that prefers another feeding path can call [`KvIndex::apply`] itself.
#![forbid(unsafe_code)]

pub mod chain;
pub mod decode;
pub mod encode;
pub mod event;
pub mod frames;
pub mod index;
pub mod listener;
pub mod publisher;
pub mod seq;
pub mod stats;
pub mod subscriber;

pub use chain::{BlockKey, KeyHasher, chain_keys};
pub use decode::{DecodeError, FieldError, decode_batch};
pub use encode::encode_batch;
pub use event::{BlockRemoved, BlockStored, EngineHash, Event, EventBatch, Medium};
pub use index::{ApplyOutcome, IndexError, KvIndex, WorkerOverlap, WorkerSpec};
pub use listener::{ListenError, Listener, ListenerConfig, ListenerStats, topic_worker};
pub use publisher::{PublishError, Publisher, PublisherConfig};
pub use seq::{LiveAction, ReplayAction, SeqTracker};
pub use stats::{StatsSnapshot, WorkerStats};
pub use subscriber::{SharedIndex, Subscriber, SubscriberConfig, spawn_subscriber};
