//! Identifier newtypes.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Declares a numeric id: serialized as the plain number, displayed as `$prefix` then the
/// number.
macro_rules! numeric_id {
    ($(#[$doc:meta])* $name:ident($int:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub $int);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

numeric_id!(
    /// A session (one agent conversation). Serialized as a plain number.
    ///
    /// Sessions named by strings (an `x-session-id` header, say) map to a stable id through
    /// [`SessionId::from_key`].
    SessionId(u64),
    "s"
);

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

numeric_id!(
    /// A turn within a session, counted from 1.
    TurnId(u32),
    ""
);

impl TurnId {
    /// Whether this is the session's first turn.
    pub fn is_first(self) -> bool {
        self.0 <= 1
    }
}

numeric_id!(
    /// One request (one turn sent to the cluster).
    RequestId(u64),
    "r"
);

numeric_id!(
    /// A worker of the cluster: a dense index, unique across roles.
    WorkerId(u32),
    "w"
);

/// The id of one block of tokens. Ids are chained: a block's id depends on every token before
/// it, so two requests sharing block `k` share blocks `0..=k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// Tokens per block. Defaults to [`crate::DEFAULT_BLOCK_SIZE`] (512).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
