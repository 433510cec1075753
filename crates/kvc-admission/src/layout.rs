//! The binary layout of a snapshot, version [`LAYOUT_VERSION`].
//!
//! The crate documentation has the full specification (offsets, word meanings, protocol).
//! Everything is a native-endian `u64` word at an 8-byte-aligned offset; there is no
//! implicit padding anywhere (each `#[repr(C)]` struct below is nothing but `AtomicU64` fields,
//! and the sizes are checked at compile time).

use crate::sync::AtomicU64;

/// The magic number in word 0: the ASCII bytes `KVCSNAP1` read as a little-endian `u64`.
///
/// The word is stored in native byte order, so on a little-endian machine the file starts with
/// the bytes `KVCSNAP1`.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KVCSNAP1");

/// The layout version in word 1. A reader rejects any other value.
pub const LAYOUT_VERSION: u64 = 1;

/// Size of one word in bytes.
pub const WORD_BYTES: usize = 8;

/// Size of the header (words 0–7) in bytes.
pub const HEADER_BYTES: usize = 64;

/// Size of the counters block (words 8–15) in bytes.
pub const COUNTERS_BYTES: usize = 64;

/// Byte offset of the resident-session table (header plus counters).
pub const TABLE_OFFSET: usize = HEADER_BYTES + COUNTERS_BYTES;

/// Size of one resident-session slot in bytes (4 words).
pub const SLOT_BYTES: usize = 32;

/// The largest table a snapshot may have (slots).
pub const MAX_SLOTS: usize = 1 << 20;

/// Word offsets of every field (multiply by [`WORD_BYTES`] for the byte offset).
pub mod word {
    /// [`MAGIC`](super::MAGIC).
    pub const MAGIC: usize = 0;
    /// [`LAYOUT_VERSION`](super::LAYOUT_VERSION).
    pub const LAYOUT_VERSION: usize = 1;
    /// The worker id (a `u32` widened to `u64`).
    pub const WORKER_ID: usize = 2;
    /// Size of the worker's KV pool in tokens.
    pub const CAPACITY_TOKENS: usize = 3;
    /// Number of slots in the resident-session table.
    pub const MAX_SESSIONS: usize = 4;
    /// Total size of the snapshot in bytes, `file_bytes(max_sessions)`.
    pub const FILE_BYTES: usize = 5;
    /// The seqlock sequence number: odd while a publish is in progress, even otherwise;
    /// 0 means nothing was published yet.
    pub const SEQ: usize = 6;
    /// Writer clock at the last publish, in milliseconds (the heartbeat).
    pub const PUBLISH_MS: usize = 7;
    /// Tokens occupied in the pool.
    pub const USED_TOKENS: usize = 8;
    /// Tokens free in the pool.
    pub const FREE_TOKENS: usize = 9;
    /// Of the used tokens, those that evicting idle sessions would free.
    pub const EVICTABLE_TOKENS: usize = 10;
    /// Requests or transfers waiting for the worker.
    pub const QUEUE_DEPTH: usize = 11;
    /// Requests running on the worker.
    pub const IN_FLIGHT: usize = 12;
    /// Number of valid table slots (the first `resident_count` ones).
    pub const RESIDENT_COUNT: usize = 13;
    /// [`checksum`](super::checksum) of the published words.
    pub const CHECKSUM: usize = 14;
    /// Reserved, zero.
    pub const RESERVED: usize = 15;
    /// First word of slot 0 of the table.
    pub const TABLE: usize = 16;
    /// Slot word 0: the session id.
    pub const SLOT_SESSION: usize = 0;
    /// Slot word 1: the session's resident tokens.
    pub const SLOT_TOKENS: usize = 1;
    /// Slot word 2: the session's last access, writer clock in milliseconds.
    pub const SLOT_LAST_ACCESS_MS: usize = 2;
    /// Slot word 3: [`STATE_IDLE`](super::STATE_IDLE) or
    /// [`STATE_RUNNING`](super::STATE_RUNNING).
    pub const SLOT_STATE: usize = 3;
}

/// Slot state word of an idle session (no request running).
pub const STATE_IDLE: u64 = 0;
/// Slot state word of a session with a request running. Readers treat every non-zero value
/// as running.
pub const STATE_RUNNING: u64 = 1;

/// Total size in bytes of a snapshot whose table has `max_sessions` slots.
pub const fn file_bytes(max_sessions: usize) -> usize {
    TABLE_OFFSET + max_sessions * SLOT_BYTES
}

/// Seed of [`checksum`].
pub const CHECKSUM_SEED: u64 = 0x6b76_635f_7365_716c;
/// Multiplier of [`checksum`] (odd, so each step is a bijection).
pub const CHECKSUM_MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;
/// Rotation of [`checksum`].
pub const CHECKSUM_ROTATION: u32 = 27;

/// The checksum of a sequence of words:
/// `h = CHECKSUM_SEED; for w in words { h = ((h ^ w) * CHECKSUM_MULTIPLIER).rotate_left(27) }`
/// (wrapping multiplication).
///
/// The words covered, in order: the final (even) sequence number, `publish_ms`, the six counters
/// `used_tokens`, `free_tokens`, `evictable_tokens`, `queue_depth`, `in_flight`,
/// `resident_count`, then the four words of each of the first `resident_count` slots.
/// Every step is a bijection of `h`, so a change in any single word always changes the result.
///
/// ```
/// use kvc_admission::layout::{checksum, CHECKSUM_SEED};
///
/// assert_eq!(checksum([]), CHECKSUM_SEED);
/// assert_ne!(checksum([1, 2]), checksum([2, 1]));
/// ```
pub fn checksum(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = CHECKSUM_SEED;
    for w in words {
        h = checksum_step(h, w);
    }
    h
}

/// One step of [`checksum`].
#[inline]
pub(crate) fn checksum_step(h: u64, w: u64) -> u64 {
    (h ^ w)
        .wrapping_mul(CHECKSUM_MULTIPLIER)
        .rotate_left(CHECKSUM_ROTATION)
}

/// Words 0–7. Words 0–5 are written once, before the file becomes visible under its name.
#[derive(Default)]
#[repr(C)]
pub(crate) struct Header {
    pub(crate) magic: AtomicU64,
    pub(crate) layout_version: AtomicU64,
    pub(crate) worker_id: AtomicU64,
    pub(crate) capacity_tokens: AtomicU64,
    pub(crate) max_sessions: AtomicU64,
    pub(crate) file_bytes: AtomicU64,
    pub(crate) seq: AtomicU64,
    pub(crate) publish_ms: AtomicU64,
}

/// Words 8–15, protected by the seqlock.
#[derive(Default)]
#[repr(C)]
pub(crate) struct Counters {
    pub(crate) used_tokens: AtomicU64,
    pub(crate) free_tokens: AtomicU64,
    pub(crate) evictable_tokens: AtomicU64,
    pub(crate) queue_depth: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) resident_count: AtomicU64,
    pub(crate) checksum: AtomicU64,
    pub(crate) reserved: AtomicU64,
}

/// One table slot (4 words), protected by the seqlock.
#[derive(Default)]
#[repr(C)]
pub(crate) struct Slot {
    pub(crate) session: AtomicU64,
    pub(crate) tokens: AtomicU64,
    pub(crate) last_access_ms: AtomicU64,
    pub(crate) state: AtomicU64,
}

/// A view of one snapshot's memory: header, counters and table.
#[derive(Clone, Copy)]
pub(crate) struct Region<'a> {
    pub(crate) header: &'a Header,
    pub(crate) counters: &'a Counters,
    pub(crate) slots: &'a [Slot],
}

// The layout checks only hold for the real atomics (loom's carry model state).
#[cfg(not(loom))]
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<AtomicU64>() == WORD_BYTES && align_of::<AtomicU64>() == WORD_BYTES);
    assert!(size_of::<Header>() == HEADER_BYTES && align_of::<Header>() == WORD_BYTES);
    assert!(size_of::<Counters>() == COUNTERS_BYTES && align_of::<Counters>() == WORD_BYTES);
    assert!(size_of::<Slot>() == SLOT_BYTES && align_of::<Slot>() == WORD_BYTES);
    assert!(offset_of!(Header, magic) == word::MAGIC * WORD_BYTES);
    assert!(offset_of!(Header, layout_version) == word::LAYOUT_VERSION * WORD_BYTES);
    assert!(offset_of!(Header, worker_id) == word::WORKER_ID * WORD_BYTES);
    assert!(offset_of!(Header, capacity_tokens) == word::CAPACITY_TOKENS * WORD_BYTES);
    assert!(offset_of!(Header, max_sessions) == word::MAX_SESSIONS * WORD_BYTES);
    assert!(offset_of!(Header, file_bytes) == word::FILE_BYTES * WORD_BYTES);
    assert!(offset_of!(Header, seq) == word::SEQ * WORD_BYTES);
    assert!(offset_of!(Header, publish_ms) == word::PUBLISH_MS * WORD_BYTES);
    assert!(HEADER_BYTES + offset_of!(Counters, used_tokens) == word::USED_TOKENS * WORD_BYTES);
    assert!(HEADER_BYTES + offset_of!(Counters, free_tokens) == word::FREE_TOKENS * WORD_BYTES);
    assert!(
        HEADER_BYTES + offset_of!(Counters, evictable_tokens)
            == word::EVICTABLE_TOKENS * WORD_BYTES
    );
    assert!(HEADER_BYTES + offset_of!(Counters, queue_depth) == word::QUEUE_DEPTH * WORD_BYTES);
    assert!(HEADER_BYTES + offset_of!(Counters, in_flight) == word::IN_FLIGHT * WORD_BYTES);
    assert!(
        HEADER_BYTES + offset_of!(Counters, resident_count) == word::RESIDENT_COUNT * WORD_BYTES
    );
    assert!(HEADER_BYTES + offset_of!(Counters, checksum) == word::CHECKSUM * WORD_BYTES);
    assert!(HEADER_BYTES + offset_of!(Counters, reserved) == word::RESERVED * WORD_BYTES);
    assert!(TABLE_OFFSET == word::TABLE * WORD_BYTES);
    assert!(offset_of!(Slot, session) == word::SLOT_SESSION * WORD_BYTES);
    assert!(offset_of!(Slot, tokens) == word::SLOT_TOKENS * WORD_BYTES);
    assert!(offset_of!(Slot, last_access_ms) == word::SLOT_LAST_ACCESS_MS * WORD_BYTES);
    assert!(offset_of!(Slot, state) == word::SLOT_STATE * WORD_BYTES);
};
