//! The decoded shape of a KV-cache event batch, common to every wire shape the decoder
//! accepts (see [`crate::decode`]).

use xxhash_rust::xxh3::xxh3_64;

/// An engine's name for one block, normalised to 64 bits.
///
/// Engines send a block hash as an unsigned integer, a signed integer or raw bytes:
/// - an unsigned integer is kept as is;
/// - a signed integer keeps its two's-complement bit pattern (`-1` and `u64::MAX` are the
///   same hash);
/// - bytes become their xxh3-64 digest ([`EngineHash::from_bytes`]), whatever their length.
///
/// The index uses an engine hash only to find the block a later event names (a parent or a
/// removal), never to compare blocks across workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EngineHash(pub u64);

impl EngineHash {
    /// The hash of a block an engine names by raw bytes: xxh3-64 of the bytes (seed 0).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        EngineHash(xxh3_64(bytes))
    }

    /// The hash of a block an engine names by a signed integer (bit pattern kept).
    pub fn from_i64(v: i64) -> Self {
        EngineHash(v as u64)
    }
}

/// Where a stored or removed block lives. Only [`Medium::Gpu`] blocks (or events without a
/// medium) are resident in the worker's GPU pool; the index ignores the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Medium {
    /// `"GPU"` (any letter case).
    Gpu,
    /// `"CPU"` (any letter case): an offloaded copy.
    Cpu,
    /// Any other tier, kept verbatim (a disk or remote store, say).
    Other(String),
}

impl Medium {
    /// The medium an engine names by `name`.
    pub fn parse(name: &str) -> Self {
        if name.eq_ignore_ascii_case("gpu") {
            Medium::Gpu
        } else if name.eq_ignore_ascii_case("cpu") {
            Medium::Cpu
        } else {
            Medium::Other(name.to_string())
        }
    }

    /// The wire name (`"GPU"`, `"CPU"` or the name as received).
    pub fn as_str(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Other(s) => s,
        }
    }
}

/// Whether a block with this medium (or none) sits in the GPU pool the router routes on.
pub fn resident_on_gpu(medium: Option<&Medium>) -> bool {
    matches!(medium, None | Some(Medium::Gpu))
}

/// Blocks an engine has just cached: consecutive full blocks, each chained to the one before,
/// the first to `parent` (`None`: the first block of a sequence).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// One hash per block, in sequence order.
    pub block_hashes: Vec<EngineHash>,
    /// The block just before the first one, if any.
    pub parent: Option<EngineHash>,
    /// The tokens of exactly these blocks, in order (`block_hashes.len() * block_size` of
    /// them in a well-formed event; the index checks).
    pub token_ids: Vec<u32>,
    /// Tokens per block as the engine counts them.
    pub block_size: u32,
    /// vLLM's deprecated LoRA id; `None` for the base model.
    pub lora_id: Option<i64>,
    /// Where the blocks live; `None` when the engine does not say (GPU).
    pub medium: Option<Medium>,
    /// The LoRA adapter the blocks were computed with; `None` for the base model.
    pub lora_name: Option<String>,
    /// The request context that stored the blocks (vLLM 0.33's `session_id`).
    pub session_id: Option<String>,
}

/// Blocks an engine has evicted from `medium`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// The evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Where they were evicted from; `None` when the engine does not say (GPU).
    pub medium: Option<Medium>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// `BlockStored`.
    Stored(BlockStored),
    /// `BlockRemoved`.
    Removed(BlockRemoved),
    /// `AllBlocksCleared`: the engine dropped its whole prefix cache.
    AllCleared,
}

/// One published message: the events of one engine step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventBatch {
    /// The engine's wall-clock time of the batch, seconds since the epoch.
    pub ts: f64,
    /// The events, in the order the engine emitted them.
    pub events: Vec<Event>,
    /// The data-parallel (or attention-DP) rank that emitted the batch, when sent.
    pub dp_rank: Option<i64>,
}
