//! Errors of trace loading.

use std::io;
use std::path::PathBuf;

/// An error while reading or validating a trace.
///
/// Every variant about one record names the file, the 1-based line and, where one is at
/// fault, the field; [`Display`](std::fmt::Display) renders them as `file:line: …`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file (or the source name given to [`parse`](super::parse)).
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A line is not a JSON object (syntax error, invalid UTF-8, duplicate key, …).
    #[error("{file}:{line}: invalid JSON: {msg}")]
    Json {
        /// The file.
        file: String,
        /// 1-based line number.
        line: usize,
        /// What the JSON parser reported.
        msg: String,
    },
    /// A required field is absent (or `null`).
    #[error("{file}:{line}: missing field `{field}`")]
    MissingField {
        /// The file.
        file: String,
        /// 1-based line number.
        line: usize,
        /// The field.
        field: &'static str,
    },
    /// A field has the wrong type or an out-of-range value.
    #[error("{file}:{line}: field `{field}`: {msg}")]
    InvalidField {
        /// The file.
        file: String,
        /// 1-based line number.
        line: usize,
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        msg: String,
    },
    /// `hash_ids` does not have `ceil(input_length / block_size)` entries.
    #[error(
        "{file}:{line}: field `hash_ids`: {got} block ids, but input_length {input_length} \
         needs {expected} blocks of {block_size} tokens"
    )]
    HashLength {
        /// The file.
        file: String,
        /// 1-based line number.
        line: usize,
        /// Blocks the input needs.
        expected: u64,
        /// Ids the record has.
        got: u64,
        /// The record's `input_length`.
        input_length: u64,
        /// Tokens per block used for the check.
        block_size: u32,
    },
    /// Two records claim the same turn of the same session.
    #[error(
        "{file}:{line}: field `turn_id`: turn {turn} of session {session} already appears at line {first_line}"
    )]
    DuplicateTurn {
        /// The file.
        file: String,
        /// 1-based line number of the later record.
        line: usize,
        /// 1-based line number of the first record with that turn.
        first_line: usize,
        /// The session (its numeric id).
        session: u64,
        /// The turn.
        turn: u32,
    },
    /// The input holds no valid record (empty, only blank lines, or every line skipped).
    #[error("{file}: no valid trace records")]
    Empty {
        /// The file.
        file: String,
    },
}

impl TraceError {
    /// The 1-based line the error is about, if it is about one record.
    pub fn line(&self) -> Option<usize> {
        match self {
            TraceError::Json { line, .. }
            | TraceError::MissingField { line, .. }
            | TraceError::InvalidField { line, .. }
            | TraceError::HashLength { line, .. }
            | TraceError::DuplicateTurn { line, .. } => Some(*line),
            TraceError::Io { .. } | TraceError::Empty { .. } => None,
        }
    }

    /// The field at fault, if one is.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            TraceError::MissingField { field, .. } | TraceError::InvalidField { field, .. } => {
                Some(field)
            }
            TraceError::HashLength { .. } => Some("hash_ids"),
            TraceError::DuplicateTurn { .. } => Some("turn_id"),
            TraceError::Io { .. } | TraceError::Json { .. } | TraceError::Empty { .. } => None,
        }
    }

    /// Whether `--skip-invalid` may skip the record this error is about (every per-record
    /// error; not I/O errors nor an empty trace).
    pub fn is_record_error(&self) -> bool {
        self.line().is_some()
    }
}
