//! # kvc-policy — routing policies as pure functions
//!
//! Given a view of the cluster, what the router remembers, and one request, a policy decides
//! which decode worker (or colocated worker) serves the request, whether it goes
//! **direct-to-D** (the session's KV is resident on D, which append-prefills the new tokens)
//! or takes a **P→D** path (and through which prefill worker), and why. It also estimates the
//! request's footprint on D and recommends a client pause under pressure.
//!
//! Everything is a pure function of explicit inputs: no I/O, no clock (time is an input), no
//! async, no globals; ties are broken deterministically, and the order of the workers in the
//! view does not matter. The crate depends only on `kvc-core`, `serde` and `thiserror`, so a
//! router written elsewhere can depend on it cheaply.
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
//! decisions it applied and [`Observation::PrefillDone`]. Other policies only plan P→D (from a
//! prefill-capable worker to another, decode-capable one) and direct-to-D.
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
//! Prefill selection ([`PrefillPolicy`], named in `kvc-core`): `round-robin` or
//! `d-health-aware`. Shared helpers:
//! [`footprint_tokens`], [`classify_turn`], [`recommended_pause_ms`].
//!
//! ## A foreign router calling it
//!
//! ```
//! use kvc_core::{
//!     BlockHash, ExecutionMode, Outcome, RequestId, SessionId, TurnId, WorkerId, WorkerRole,
//!     WorkerState,
//! };
//! use kvc_policy::{route, ClusterView, Observation, PolicyConfig, RouteRequest, RouterState, WorkerView};
//!
//! // One prefill and two decode workers, as published by the workers.
//! let workers = [
//!     WorkerView::new(WorkerId(0), WorkerRole::Prefill, WorkerState::empty(92_000)),
//!     WorkerView::new(WorkerId(1), WorkerRole::Decode, WorkerState::empty(92_000)),
//!     WorkerView::new(WorkerId(2), WorkerRole::Decode, WorkerState::empty(92_000)),
//! ];
//! let config = PolicyConfig::from_name("kvc-v2")?;
//! let mut state = RouterState::new(&config, &workers);
//! let session = SessionId::from_key("agent-7");
//!
//! // Turn 1: 3 blocks (1,300 tokens) — seeded through P.
//! let turn1: Vec<BlockHash> = [11, 12, 13].map(BlockHash).to_vec();
//! let req = RouteRequest::new(RequestId(1), 1_300, 40, &turn1).in_session(session, TurnId(1));
//! let d = route(&config, &state, &ClusterView::new(0, &workers), &req)?;
//! assert_eq!(d.mode, ExecutionMode::Turn1Seed);
//! assert_eq!(d.prefill, Some(WorkerId(0)));
//! state.apply(&d.change);
//! state.observe(&Observation::Completed {
//!     request_id: RequestId(1), session: Some(session), worker: d.decode,
//!     outcome: Outcome::Ok, resident_tokens: 1_340, direct: false,
//! });
//!
//! // Turn 2 extends the context: its first two full blocks are resident on D, so it goes
//! // direct-to-D and D needs room only for what it adds to the session's 1,340 resident
//! // tokens (the recomputed tail replaces the session's own KV there) plus the output.
//! let turn2: Vec<BlockHash> = [11, 12, 14, 15].map(BlockHash).to_vec();
//! let req = RouteRequest::new(RequestId(2), 1_900, 40, &turn2).in_session(session, TurnId(2));
//! let d2 = route(&config, &state, &ClusterView::new(2_500, &workers), &req)?;
//! assert_eq!(d2.mode, ExecutionMode::DirectToD);
//! assert_eq!(d2.decode, d.decode);
//! assert_eq!(d2.prefill, None);
//! assert_eq!(d2.cached_tokens, 1_024);
//! assert_eq!(d2.need_tokens, 1_900 - 1_340 + 40);
//! state.apply(&d2.change);
//! # Ok::<(), kvc_policy::PolicyError>(())
//! ```
#![forbid(unsafe_code)]

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
