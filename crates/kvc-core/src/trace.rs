//! The trace record.

use crate::ids::{BlockHash, BlockSize, SessionId, TurnId};
use serde::{Deserialize, Serialize};

/// One request of a trace, in the Mooncake JSONL shape plus optional `session_id`,
/// `parent_session_id`, `turn_id` and `final`:
///
/// ```json
/// {"timestamp": 0, "session_id": 3, "turn_id": 1, "input_length": 1200, "output_length": 40, "hash_ids": [0, 1, 2]}
/// {"timestamp": 900, "session_id": 7, "parent_session_id": 3, "turn_id": 1, "final": true, "input_length": 700, "output_length": 9, "hash_ids": [0, 5]}
/// ```
///
/// The optional fields are written only when set (`final` only when `true`), so a trace
/// without them reads and writes back unchanged.
///
/// `hash_ids` holds one id per block of the input (the last block may be partial), so
/// `hash_ids.len() == ceil(input_length / block_size)` in a well-formed trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp: u64,
    /// The session this request belongs to, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<SessionId>,
    /// On every request of a child (subagent) session: the session that spawned it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<SessionId>,
    /// The turn within the session (from 1), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<TurnId>,
    /// Set on the last request of a session the client ended explicitly (a session-final
    /// signal: no turn of this session follows it).
    #[serde(rename = "final", default, skip_serializing_if = "std::ops::Not::not")]
    pub session_final: bool,
    /// Prompt length in tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Chained block ids of the prompt.
    pub hash_ids: Vec<BlockHash>,
}

impl TraceRecord {
    /// Whether the hash list has the length the input needs under `block_size`.
    pub fn hash_len_matches(&self, block_size: BlockSize) -> bool {
        self.hash_ids.len() as u64 == block_size.blocks_for(self.input_length)
    }
}
