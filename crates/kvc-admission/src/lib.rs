//! # kvc-admission — probe, commit_evict and eviction planning for decode workers
//!
//! Admission is the hot path of KV-centric routing: most calls only ask "is there room on this
//! decode worker for this session's next turn?". This crate splits admission in two:
//!
//! - a **probe** ([`SnapshotReader::probe`]) that reads a snapshot the worker's scheduler
//!   publishes into shared memory at each step ([`SnapshotWriter::publish`]). It takes no lock,
//!   makes no syscall, allocates nothing and never blocks the writer (a seqlock); a snapshot
//!   being rewritten during every attempt is reported as [`ProbeResult::Contended`], one whose
//!   writer stopped publishing as [`ProbeResult::Stale`] — never as free room;
//! - a **commit_evict** ([`commit_queue`]) queued to the single writer, which drains the queue
//!   at its step boundary and answers after its step; a full queue answers at once with
//!   [`CommitError::Busy`] and a pause hint.
//!
//! The owner decides what to evict with [`plan_eviction`], a pure tiered planner (idle sessions,
//! then cold ones, then hot ones above a hard cap; never the requester), which the simulator
//! uses directly. Every answer carries the same backpressure hint, [`recommended_pause_ms`].
//!
//! ```
//! use kvc_admission::{ProbeResult, ResidentEntry, ResidentState, SnapshotReader, SnapshotWriter};
//! use kvc_core::{SessionId, WorkerId};
//!
//! let path = std::env::temp_dir().join(format!("kvc-doc-{}.snap", std::process::id()));
//! // The worker's scheduler creates the file once and publishes at every step.
//! let mut writer = SnapshotWriter::create(&path, WorkerId(1), 90_000, 64)?;
//! let mut data = writer.empty_data();
//! data.used_tokens = 70_000;
//! data.free_tokens = 20_000;
//! data.evictable_tokens = 12_000;
//! data.publish_ms = 5_000;
//! data.residents.push(ResidentEntry {
//!     session: SessionId(42), tokens: 12_000, last_access_ms: 4_000, state: ResidentState::Idle,
//! });
//! writer.publish(&data)?;
//!
//! // A router process maps the same file and probes it.
//! let reader = SnapshotReader::open(&path)?;
//! let ProbeResult::Ready(answer) = reader.probe(25_000, Some(SessionId(42)), 5_010) else {
//!     panic!("fresh snapshot expected");
//! };
//! assert_eq!(answer.session_resident_tokens, Some(12_000));
//! // Session 42's own idle tokens do not count as evictable room for itself.
//! assert_eq!(answer.available_tokens, 20_000);
//! assert!(!answer.can_admit);
//! // Two seconds without a publish: stale, never room.
//! assert!(matches!(reader.probe(1, None, 7_010), ProbeResult::Stale { age_ms: 2_010 }));
//! # std::fs::remove_file(&path)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Snapshot layout, version 1
//!
//! A snapshot is a file (normally under `/dev/shm`) of `128 + 32 × max_sessions` bytes, mapped
//! shared by one writer and any number of readers. It is an array of **`u64` words in native
//! byte order** (writer and readers run on the same machine); every word sits at an offset that
//! is a multiple of 8 and the mapping is page-aligned, so every word is 8-byte aligned. The Rust
//! definitions are `#[repr(C)]` structs of `AtomicU64` fields only (no padding), with their
//! sizes and offsets checked at compile time; [`layout`] has the constants.
//!
//! | bytes | word | field | meaning |
//! |---|---|---|---|
//! | 0 | 0 | `magic` | [`layout::MAGIC`] = `0x3150414e5343564b` (the bytes `KVCSNAP1` on little-endian machines) |
//! | 8 | 1 | `layout_version` | [`layout::LAYOUT_VERSION`] = 1 |
//! | 16 | 2 | `worker_id` | the worker's [`WorkerId`](kvc_core::WorkerId) (`u32` widened) |
//! | 24 | 3 | `capacity_tokens` | KV pool size in tokens |
//! | 32 | 4 | `max_sessions` | slots in the resident table (at most [`layout::MAX_SLOTS`]) |
//! | 40 | 5 | `file_bytes` | `128 + 32 × max_sessions` |
//! | 48 | 6 | `seq` | seqlock sequence: 0 = never published, odd = publish in progress |
//! | 56 | 7 | `publish_ms` | writer clock at the last publish, ms (the heartbeat) |
//! | 64 | 8 | `used_tokens` | tokens occupied |
//! | 72 | 9 | `free_tokens` | tokens free |
//! | 80 | 10 | `evictable_tokens` | of the used tokens, those evicting idle sessions would free |
//! | 88 | 11 | `queue_depth` | requests or transfers waiting (readers saturate at `u32::MAX`) |
//! | 96 | 12 | `in_flight` | requests running (readers saturate at `u32::MAX`) |
//! | 104 | 13 | `resident_count` | valid table slots, `≤ max_sessions` |
//! | 112 | 14 | `checksum` | see below |
//! | 120 | 15 | reserved | 0 |
//! | 128 + 32 i | 16 + 4 i | `session` | slot i: session id |
//! | 136 + 32 i | 17 + 4 i | `tokens` | slot i: resident tokens |
//! | 144 + 32 i | 18 + 4 i | `last_access_ms` | slot i: last access, writer clock, ms |
//! | 152 + 32 i | 19 + 4 i | `state` | slot i: 0 = idle, 1 = running (readers take any non-zero as running) |
//!
//! Words 0–5 are written once, before the file appears under its name (the writer creates it
//! under a temporary name and renames it), and never change; a file is never resized in place
//! (a new writer creates a new file and renames it over the old name). Words 6–15 and the
//! table are written only by the single writer, only with 8-byte atomic stores. The first
//! `resident_count` slots hold the resident sessions **sorted by session id, without
//! duplicates** (readers binary-search them); the other slots are ignored (this writer zeroes
//! them).
//!
//! `checksum` is [`layout::checksum`] of, in order: the final even `seq`, `publish_ms`,
//! `used_tokens`, `free_tokens`, `evictable_tokens`, `queue_depth`, `in_flight`,
//! `resident_count`, then the four words of each of the first `resident_count` slots, where
//! `h = 0x6b76635f7365716c; for each word w: h = rotate_left((h ^ w) × 0x9e3779b97f4a7c15, 27)`
//! with wrapping multiplication. A full [`SnapshotReader::read`] verifies it; the probe does not
//! (it reads a few words only and relies on the sequence check).
//!
//! ### Protocol
//!
//! Writer (one per file), to publish:
//! 1. store `seq + 1` (odd) with relaxed ordering;
//! 2. release fence;
//! 3. store `publish_ms`, the counters, the slots and `checksum`, each with a relaxed 8-byte
//!    atomic store;
//! 4. store `seq + 2` (even) with release ordering.
//!
//! Reader, per attempt (at most [`DEFAULT_MAX_ATTEMPTS`] by default):
//! 1. load `seq` (relaxed), then an acquire fence — together an acquire load that is also valid
//!    on the read-only mapping readers use; if odd, spin and retry; if 0, nothing is published;
//! 2. load the words it needs with relaxed 8-byte atomic loads (indices bounded by the table
//!    size whatever `resident_count` says);
//! 3. acquire fence;
//! 4. load `seq` again; accept the copy if it equals the first load, else retry.
//!
//! A read that always overlaps a publish gives up ([`ReadError::Contended`],
//! [`ProbeResult::Contended`]). Age = reader's `now_ms` − `publish_ms` with a clock both sides
//! share ([`SystemClock`] across processes); older than the reader's limit (default
//! [`DEFAULT_STALE_AFTER_MS`]) is stale. The loom model in `tests/loom.rs` checks this exact
//! code (over a [`MemSnapshot`]) with one writer and two readers.
//!
//! ## Modules
//!
//! - [`layout`]: the constants of the layout and the checksum;
//! - [`seqlock`]: the protocol on its own (what the loom model checks);
//! - snapshot: [`SnapshotWriter`], [`SnapshotReader`], [`MemSnapshot`], [`SnapshotData`],
//!   [`ProbeResult`];
//! - commit queue: [`commit_queue`], [`CommitSender`], [`CommitReceiver`], [`PendingReply`];
//! - planner: [`plan_eviction`], [`EvictionConfig`], [`EvictionPlan`];
//! - [`recommended_pause_ms`] and the [`Clock`] trait.
//!
//! `unsafe` code lives only in the private shared-memory module (mapping the file and viewing it
//! as atomic words).
#![deny(unsafe_code)]

mod backpressure;
mod clock;
mod commit;
mod error;
pub mod layout;
mod planner;
pub mod seqlock;
#[cfg(not(loom))]
mod shm;
mod snapshot;
mod sync;

pub use backpressure::{
    MAX_PAUSE_MS, PAUSE_PER_QUEUED_MS, PRESSURE_PAUSE_MS, PRESSURE_START_FRACTION,
    recommended_pause_ms,
};
pub use clock::{Clock, ManualClock, SystemClock};
pub use commit::{
    CommitError, CommitJob, CommitReceiver, CommitReply, CommitRequest, CommitSender, PendingReply,
    commit_queue,
};
pub use error::AdmissionError;
pub use planner::{
    EvictionConfig, EvictionPlan, Resident, ResidentState, Tier, Victim, VictimOrder,
    hard_cap_tokens, plan_eviction,
};
pub use snapshot::{
    DEFAULT_MAX_ATTEMPTS, DEFAULT_STALE_AFTER_MS, MemSnapshot, ProbeAnswer, ProbeResult, ReadError,
    ResidentEntry, SnapshotData, SnapshotReader, SnapshotWriter,
};
