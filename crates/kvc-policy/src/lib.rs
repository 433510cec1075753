//! # kvc-policy — routing policies as pure functions
//!
//! Given a view of the cluster, what the router remembers, and one request, a policy decides
//! which decode worker (or colocated worker) serves the request, whether it goes
//! **direct-to-D** (the session's KV is resident on D, which append-prefills the new tokens)
//! or takes a **P→D** path (and through which prefill worker), and why. It also estimates the
//! request's footprint on D and recommends a client pause under pressure.
//!
//! ## A router written elsewhere
//!
//! A router keeps its own table of workers. For each request it builds the policy's inputs
//! from that table, asks [`route`] for a decision, carries it out, applies the decision's
//! [`Decision::change`], and reports how the request ended with [`RouterState::observe`]:
//!
//! ```
//! use kvc_core::text::{block_hashes, fallback_tokens};
//! use kvc_core::{BlockHash, BlockSize, ExecutionMode, Outcome, RequestId, SessionId, TurnId};
//! use kvc_core::{WorkerId, WorkerRole, WorkerState};
//! use kvc_policy::{ClusterView, Observation, PolicyConfig, RouteRequest, RouterState, WorkerView};
//!
//! // The router's own record of a worker: its address, role and last published load.
//! struct Worker { url: &'static str, role: WorkerRole, pool: u64, used: u64 }
//! let mut table = [
//!     Worker { url: "http://10.0.0.1:8000", role: WorkerRole::Prefill, pool: 92_160, used: 0 },
//!     Worker { url: "http://10.0.0.2:8000", role: WorkerRole::Decode, pool: 92_160, used: 0 },
//!     Worker { url: "http://10.0.0.3:8000", role: WorkerRole::Decode, pool: 92_160, used: 0 },
//! ];
//! // The policy's view of the table: a worker's id is its index there.
//! let views = |table: &[Worker]| -> Vec<WorkerView> {
//!     let view = |(i, w): (usize, &Worker)| {
//!         let state = WorkerState { used_tokens: w.used, ..WorkerState::empty(w.pool) };
//!         WorkerView::new(WorkerId(i as u32), w.role, state)
//!     };
//!     table.iter().enumerate().map(view).collect()
//! };
//! let config = PolicyConfig::from_name("kvc")?;
//! let mut state = RouterState::new(&config, &views(&table));
//! let session = SessionId::from_key("agent-7"); // the client's session key
//!
//! // One request: route, dispatch, apply, and report the answer.
//! let mut serve = |id: u64, turn: u32, words: u64, now_ms: u64| {
//!     let prompt: String = (0..words).map(|i| format!("w{i} ")).collect();
//!     let tokens = fallback_tokens(&prompt); // one token per word
//!     let blocks: Vec<BlockHash> =
//!         block_hashes(&tokens, BlockSize::default()).into_iter().map(BlockHash).collect();
//!     let request = RouteRequest::new(RequestId(id), words, 40, &blocks)
//!         .in_session(session, TurnId(turn));
//!     let workers = views(&table);
//!     let d = kvc_policy::route(&config, &state, &ClusterView::new(now_ms, &workers), &request)?;
//!     // Send it to D's `url` (through the prefill worker first when `d.prefill` is Some).
//!     let _d_url = table[d.decode.0 as usize].url;
//!     state.apply(&d.change);
//!     // D answered 40 tokens and keeps the session's whole context (all it holds here).
//!     table[d.decode.0 as usize].used = words + 40;
//!     state.observe(&Observation::Completed {
//!         request_id: RequestId(id), session: Some(session), worker: d.decode,
//!         outcome: Outcome::Ok, resident_tokens: words + 40, direct: d.is_direct(),
//!     });
//!     Ok::<_, kvc_policy::PolicyError>(d)
//! };
//!
//! // First turn: 1,300 tokens, seeded through the prefill worker onto a D.
//! let first = serve(1, 1, 1_300, 0)?;
//! assert_eq!(first.mode, ExecutionMode::Turn1Seed);
//! assert_eq!(first.prefill, Some(WorkerId(0)));
//! // Later turn: the context grew to 1,900 tokens. Its first two 512-token blocks, whole in the
//! // first turn, are resident on that D, so it goes direct-to-D; D needs room only for what the
//! // turn adds to the session's 1,340 resident tokens, plus the output.
//! let later = serve(2, 2, 1_900, 2_500)?;
//! assert_eq!(later.mode, ExecutionMode::DirectToD);
//! assert_eq!((later.decode, later.prefill), (first.decode, None));
//! assert_eq!(later.cached_tokens, 1_024);
//! assert_eq!(later.need_tokens, 1_900 - 1_340 + 40);
//! # Ok::<(), kvc_policy::PolicyError>(())
//! ```
//!
//! Depend on it with `kvc-policy = "0.1"` (and `kvc-core = "0.1"` for the vocabulary): both
//! crates are publishable on their own (`docs/kvc-policy.md`, "Depending on it").
//!
//! Everything is a pure function of explicit inputs: no I/O, no clock (time is an input), no
//! async, no globals; ties are broken deterministically, and the order of the workers in the
//! view does not matter. The crate depends only on `kvc-core`, `serde`, `smallvec` and
//! `thiserror`, so a router written elsewhere can depend on it cheaply.
//!
//! ## The loop
//!
//! 1. Build a [`ClusterView`] (each worker's role and published [`kvc_core::WorkerState`]) and a
//!    [`RouteRequest`].
//! 2. Call [`route`] with a [`PolicyConfig`] and the [`RouterState`]; it returns a [`Decision`]
//!    (mode, workers, fall-through reason, cached and needed tokens, pause, score breakdown) and
//!    the state change as a value, [`Decision::change`].
//! 3. Dispatch, then [`RouterState::apply`] the change; feed completions, admission rejects and
//!    evictions back with [`RouterState::observe`]. If D refuses a direct-to-D admission, route
//!    again with [`RouteRequest::rejected_by`] set.
//!
//! A decode worker whose engine cannot append-prefill (no decode-side prefill of a turn's new
//! tokens) is declared once with [`RouterState::set_direct_append`]; no policy then plans a
//! direct-to-D turn there (those turns go P→D with the reason `direct-unsupported`).
//!
//! What a worker's engine can do is declared in its view ([`WorkerView::with_caps`],
//! [`kvc_core::Capabilities`]; [`WorkerView::new`] assumes only what its role does). Where
//! workers can serve a turn alone, `kvc` chooses per turn between direct-to-D, P→D and
//! `local-prefill` (the worker prefills the turn itself and keeps the session), by expected
//! cost ([`LocalPrefillConfig`]); the router's prefill backlog per worker comes from the
//! decisions it applied and [`Observation::PrefillDone`], whose time also measures each
//! worker's pace against the estimates ([`RouterState::prefill_pace`]; on colocated clusters,
//! `kvc` places sessions by the prefill waiting on each worker at that pace). Other policies
//! only plan P→D (from a prefill-capable worker to another, decode-capable one) and
//! direct-to-D.
//!
//! ## Policies (stable names)
//!
//! | name | what it does |
//! |---|---|
//! | `round-robin` | workers of each role in turn; no session notion |
//! | `cache-aware` | SGLang router's baseline: imbalance check, longest prefix match above a threshold, else least loaded; P and D chosen independently; every P/D turn goes P→D |
//! | `kv-aware-v0` | the reference study's baseline: `(overlap + sticky bonus, sticky, −in-flight, −assignments)`, grow-only block view, 2,048-token direct limit, no capacity term, no migration: sessions stay pinned to their first D |
//! | `kvc-v2` | the study's fix: capacity term and 85% hard cap, capped overlap, migration after 3 rejects (counter reset by each successful direct-to-D turn), 8,192-token direct limit, incremental footprint, D-health-aware choice of P, backpressure hint |
//! | `kvc` | the default ([`PolicyConfig::default`]): `kvc-v2`'s procedure with placement that charges each D for its active sessions, weak stickiness for sessions that lost their KV, stronger capacity and load terms, and, where workers can serve turns alone, local prefill chosen by expected cost (`docs/kvc-policy.md`) |
//!
//! [`PolicyConfig::all_names`] lists the same names in this order.
//!
//! Prefill selection ([`PrefillPolicy`], named in `kvc-core`): `round-robin`,
//! `d-health-aware` or `prefix-aware`. Shared helpers:
//! [`footprint_tokens`], [`classify_turn`], [`recommended_pause_ms`].
#![forbid(unsafe_code)]

// The README's example runs as a doctest too, so the published page stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;

mod backpressure;
mod cache_aware;
mod config;
mod decision;
mod error;
mod fallthrough;
mod fleet;
mod footprint;
mod index;
mod kv_aware_v0;
mod kvc;
mod kvc_v2;
mod local;
mod prefill;
mod round_robin;
mod route;
mod state;
mod view;
mod worker_set;

pub use backpressure::{BackpressureConfig, recommended_pause_ms};
pub use cache_aware::CacheAwareConfig;
pub use config::PolicyConfig;
pub use decision::{Component, Decision, ScoreEntry, StateChange};
pub use error::PolicyError;
pub use fallthrough::{TurnClass, classify_turn, is_compaction, is_first_turn};
pub use fleet::{Fleet, WorkerStates};
pub use footprint::footprint_tokens;
pub use kv_aware_v0::KvAwareV0Config;
pub use kvc::KvcConfig;
pub use kvc_core::PrefillPolicy;
pub use kvc_v2::KvcV2Config;
pub use local::LocalPrefillConfig;
pub use round_robin::RoundRobinConfig;
pub use route::{route, route_in};
pub use state::{
    MAX_RESERVED, Observation, Residency, RouterState, SessionRoute, StateBounds, reserved,
};
pub use view::{ClusterView, MAX_WORKERS, RouteRequest, WorkerView};
