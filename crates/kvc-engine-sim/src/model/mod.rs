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
//! - **A worker's pool is never overcommitted.** Running requests, resident sessions, the
//!   prefix cache and room reserved for KV on its way in together fit `capacity`; room is
//!   made only by evicting what an eviction tier allows (idle sessions first, never a
//!   session a job holds or a transfer has been promised), by retracting a decoding request,
//!   or not at all (the job waits, or its transfer times out).
//! - **One home per session.** A session is resident on at most one worker once a turn has
//!   finished: a reseed, or a turn carried out elsewhere, releases it on every other worker.
//! - **Every job ends once.** Each job gets one `FirstToken` (unless it fails first) and one
//!   `Finished` or failure event, and its reservations are released on every path.

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
pub use profile::Profile;
pub use types::{DirectAdmission, EngineOptions, Event, Job, LocalAdmission, Micros, Wake, micros};
