//! Errors of snapshot creation, opening and publishing.

use kvc_core::SessionId;
use std::path::PathBuf;

/// Why a snapshot could not be created, opened or published.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// A file operation failed.
    #[error("snapshot file {path}: {source}")]
    Io {
        /// The snapshot file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file is shorter than its header says (or than a header).
    #[error("snapshot file {path}: truncated: {len} bytes, expected at least {expected}")]
    Truncated {
        /// The snapshot file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
        /// The length required.
        expected: u64,
    },
    /// Word 0 is not [`MAGIC`](crate::layout::MAGIC): not a kvc snapshot, or written on a
    /// machine of the other byte order.
    #[error("snapshot file {path}: bad magic {found:#018x}{}", if *found == crate::layout::MAGIC.swap_bytes() { " (written with the other byte order)" } else { "" })]
    BadMagic {
        /// The snapshot file.
        path: PathBuf,
        /// The word found.
        found: u64,
    },
    /// Word 1 is not the [`LAYOUT_VERSION`](crate::layout::LAYOUT_VERSION) this crate reads.
    #[error("snapshot file {path}: layout version {found}, this reader supports {supported}")]
    UnsupportedVersion {
        /// The snapshot file.
        path: PathBuf,
        /// The version found.
        found: u64,
        /// The version supported.
        supported: u64,
    },
    /// The header is inconsistent (table size out of range, size word wrong).
    #[error("snapshot file {path}: invalid header: {reason}")]
    InvalidHeader {
        /// The snapshot file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The mapping is not 8-byte aligned (cannot happen with page-aligned `mmap`).
    #[error("snapshot file {path}: mapping is not 8-byte aligned")]
    Misaligned {
        /// The snapshot file.
        path: PathBuf,
    },
    /// A table larger than [`MAX_SLOTS`](crate::layout::MAX_SLOTS) was asked for.
    #[error("table of {requested} slots requested, at most {max} allowed")]
    TableTooLarge {
        /// Slots requested.
        requested: usize,
        /// The limit.
        max: usize,
    },
    /// More resident sessions than the table has slots.
    #[error("{count} resident sessions do not fit a table of {max} slots")]
    TooManyResidents {
        /// Resident sessions given.
        count: usize,
        /// Table slots.
        max: usize,
    },
    /// The same session twice in the resident list.
    #[error("session {session} is listed twice among the residents")]
    DuplicateResident {
        /// The session.
        session: SessionId,
    },
    /// Published data disagrees with the snapshot's fixed header.
    #[error("published {field} is {found}, the snapshot header says {expected}")]
    HeaderMismatch {
        /// `"worker_id"` or `"capacity_tokens"`.
        field: &'static str,
        /// The header's value.
        expected: u64,
        /// The published value.
        found: u64,
    },
}
