//! The requests a driver may send the workers, by index: what the engine model needs of each
//! (the worker finds one by its prompt text among those the driver marked in flight).

use kvc_core::{HashIds, SessionId};

/// One request a driver may send: its session, its size and its prompt's chained block ids.
#[derive(Debug, Clone)]
pub struct ScriptedRequest {
    /// The session.
    pub session: SessionId,
    /// Prompt tokens.
    pub input_length: u64,
    /// Tokens to generate when the client sets no limit.
    pub output_length: u64,
    /// Chained block ids of the prompt.
    pub hash_ids: HashIds,
}

/// The requests a driver may send, by index (a trace's, in trace order); empty for
/// standalone workers, which take any prompt.
#[derive(Debug, Clone, Default)]
pub struct Script {
    /// The requests, by index.
    pub requests: Vec<ScriptedRequest>,
}

impl Script {
    /// How many requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
}
