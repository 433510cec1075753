//! The worker model: prefill, decode and colocated workers with KV pools, prefix caches,
//! resident sessions, continuous batching, append-prefill and KV transfers.
//!
//! The model is clock-agnostic: it is driven by calls that carry the current time in
//! microseconds and returns the next time it wants to be woken (iteration ends, transfer
//! completions, timeouts) as [`Wake`] values, so the same code runs under the simulator's
//! virtual clock and under a real clock (the simulated workers' engine thread).
//!
//! | module | job |
//! |---|---|
//! | [`types`] | the vocabulary: [`Micros`], [`Job`], [`Wake`], [`Event`], [`EngineOptions`], admission answers |
//! | `worker` | what is kept per worker (pool, prefix cache, residents, queues, the running iteration) and per job in flight (its stage) |
//! | [`engine`] | [`Engine`]: construction from a layout, and each worker's state as a router would read it |
//! | `admission` | jobs starting: P→D, reseed, full prefill on D, colocated, direct-to-D, local turns; the queues waiting for room; transfers into D |
//! | `memory` | room on a worker: eviction tiers, retraction and host backup, decode growth, commit-evict, prefix-cache reservations |
//! | `steps` | time passing: iterations started and ended, first tokens, transfers done, aborted or timed out, jobs finished |
//! | `cache` | the prefix cache of one worker |
//! | [`profile`] | engine profiles and the timing physics (fitted in `docs/calibration.md`) |
//!
//! Invariants, held by every call:
//!
//! - **No clock, no randomness of its own.** Time comes in with each call; iteration times
//!   are jittered by a generator seeded from the configuration; maps are ordered (`BTreeMap`),
//!   so the same calls give the same events and wake-ups, byte for byte.
//! - **Room is made, never assumed.** A job starts on a worker only once its pool has room
//!   for it beside the running requests, the resident sessions, the prefix cache and the room
//!   promised to KV on its way in. Room comes from what an eviction tier allows (idle
//!   sessions first; never a session a job holds, nor room promised to a transfer), from
//!   retracting a decoding request, or not at all: the job waits, and a transfer waiting past
//!   its timeout fails.
//! - **One home per session.** A P→D seed, a full prefill on a decode worker and a turn a
//!   worker serves alone release the session on every other worker that hosts it; a
//!   direct-to-D turn stays where the session is.
//! - **Every job ends once.** A job gets at most one `FirstToken` and exactly one of `Done`,
//!   `TransferTimedOut` or `DecodeOom`, and what it reserved is released on each of those
//!   paths.

mod admission;
mod cache;
pub mod engine;
mod memory;
pub mod profile;
mod steps;
#[cfg(test)]
mod tests;
pub mod types;
mod worker;

pub use engine::Engine;
pub use profile::{PrefillFlops, Profile};
pub use types::{
    DirectAdmission, EngineOptions, Event, Failure, Job, LocalAdmission, Micros, Wake, micros,
};
