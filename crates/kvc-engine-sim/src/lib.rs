//! # kvc-engine-sim — simulated inference engines
//!
//! Engines to route to without a GPU. The worker model the simulator runs ([`model`]) and,
//! over it, workers that serve on a real clock over SGLang's and vLLM's HTTP APIs
//! ([`http`]) and show their state as a stock engine does ([`publish`]): tests, the
//! side-by-side runs, load generators and users without GPUs point a router at them.
//!
//! | module | job |
//! |---|---|
//! | [`model`] | the clock-agnostic worker model: pools, prefix caches, resident sessions, batching, transfers; engine profiles |
//! | [`cluster`] | [`ClusterSpec`]: a cluster's layout, profile and seed, and the engine model built from it; worker roles and names |
//! | [`http`] | the workers on a real clock: SGLang's and vLLM's routes, P/D pairing, the decode-side sidecar, standalone workers |
//! | [`publish`] | snapshots, vLLM-named `/metrics` and KV-cache events from the model's state |
//! | [`prompt`] | prompt text whose words repeat where block ids repeat, and the key a worker finds a request by |
//!
//! The crate depends on the vocabulary (`kvc-core`), the snapshot layout (`kvc-admission`)
//! and the event wire (`kvc-events`), never on a replay driver: `kvc-replay` drives it.
//!
//! A P→D turn through the model, on a virtual clock:
//!
//! ```
//! use kvc_core::{BlockHash, BlockSize, EvictionMode, SessionId, Topology, WorkerId};
//! use kvc_engine_sim::ClusterSpec;
//! use kvc_engine_sim::model::{Event, Job, Profile};
//!
//! let spec = ClusterSpec {
//!     topology: "1p1d".parse::<Topology>().unwrap(),
//!     local_prefill: true,
//!     profile: Profile::default(),
//!     eviction: EvictionMode::IdleLru,
//!     seed: 0,
//!     jitter: 0.0,
//!     block_size: BlockSize::new(512).unwrap(),
//! };
//! let mut engine = spec.engine();
//! let hashes = (0..4).map(BlockHash).collect();
//! let job = Job { id: 7, session: SessionId(1), input: 2000, output: 4, hashes };
//! engine.reseed(job, WorkerId(0), WorkerId(1), 0);
//! // The driver's loop: wake the engine at the earliest time it asked for, collect events.
//! let (mut now, mut events, mut wakes) = (0, Vec::new(), engine.take_wakes());
//! while !wakes.is_empty() {
//!     wakes.sort();
//!     let (t, wake) = wakes.remove(0);
//!     now = now.max(t);
//!     engine.wake(wake, now);
//!     events.extend(engine.take_events());
//!     wakes.extend(engine.take_wakes());
//! }
//! let done = events.iter().find_map(|e| match e {
//!     Event::Done { id, resident_tokens, .. } => Some((*id, *resident_tokens)),
//!     _ => None,
//! });
//! let (id, resident) = done.expect("the turn finishes");
//! assert_eq!(id, 7);
//! assert!(resident >= 2000, "the session stays resident on D");
//! assert_eq!(engine.resident_tokens(WorkerId(1), SessionId(1)), Some(resident));
//! ```
#![forbid(unsafe_code)]

pub mod cluster;
mod error;
pub mod http;
pub mod model;
pub mod prompt;
pub mod publish;

pub use cluster::ClusterSpec;
pub use error::{WorkerError, check_pacing, check_router_state};
