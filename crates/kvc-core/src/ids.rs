//! Identifier newtypes.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A session (one agent conversation). Serialized as a plain number.
///
/// Sessions named by strings (an `x-session-id` header, say) map to a stable id through
/// [`SessionId::from_key`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionId(pub u64);

impl SessionId {
    /// Stable id for a textual session key (64-bit FNV-1a; identical on every platform and run).
    pub fn from_key(key: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in key.as_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        SessionId(h)
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}", self.0)
    }
}

/// A turn within a session, counted from 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TurnId(pub u32);

impl TurnId {
    /// Whether this is the session's first turn.
    pub fn is_first(self) -> bool {
        self.0 <= 1
    }
}

impl fmt::Display for TurnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One request (one turn sent to the cluster).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// A worker of the cluster: a dense index, unique across roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerId(pub u32);

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}", self.0)
    }
}

/// The id of one block of tokens. Ids are chained: a block's id depends on every token before
/// it, so two requests sharing block `k` share blocks `0..=k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// Tokens per block. Defaults to [`crate::DEFAULT_BLOCK_SIZE`] (512).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockSize(u32);

impl BlockSize {
    /// A block size; `None` for zero.
    pub fn new(tokens: u32) -> Option<Self> {
        (tokens > 0).then_some(BlockSize(tokens))
    }

    /// Tokens per block.
    pub fn tokens(self) -> u32 {
        self.0
    }

    /// Blocks needed to hold `tokens` tokens (the last one possibly partial).
    pub fn blocks_for(self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.0))
    }

    /// Full blocks inside `tokens` tokens (a partial last block is not counted).
    pub fn full_blocks(self, tokens: u64) -> u64 {
        tokens / u64::from(self.0)
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        BlockSize(crate::DEFAULT_BLOCK_SIZE)
    }
}
