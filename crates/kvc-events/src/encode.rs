//! Wire encode: [`EventBatch`] → msgpack in vLLM 0.33's map shape.
//!
//! The batch is a map `{ts, events, data_parallel_rank}` (the rank omitted when `None`); each
//! event is a map tagged by `"type"`. `BlockStored` always carries `block_hashes`,
//! `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium` and `lora_name` (nil
//! when unset, as vLLM writes fields without a default) and `session_id` only when set (vLLM
//! omits defaults). Hashes are written as unsigned integers. [`crate::decode::decode_batch`]
//! reads the result back unchanged.

use crate::event::{BlockRemoved, BlockStored, EngineHash, Event, EventBatch, Medium};
use rmp::encode::{
    ValueWriteError, write_array_len, write_f64, write_map_len, write_nil, write_sint, write_str,
    write_u64,
};

/// Encodes a batch (see the module doc for the shape).
pub fn encode_batch(batch: &EventBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 16 * batch.events.len());
    // Writes into a Vec cannot fail.
    let _ = write_batch(&mut out, batch);
    out
}

type W = Vec<u8>;
type R = Result<(), ValueWriteError<std::io::Error>>;

fn nil(out: &mut W) -> R {
    write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)
}

fn write_batch(out: &mut W, batch: &EventBatch) -> R {
    write_map_len(out, if batch.dp_rank.is_some() { 3 } else { 2 })?;
    write_str(out, "ts")?;
    write_f64(out, batch.ts)?;
    write_str(out, "events")?;
    write_array_len(out, len32(batch.events.len()))?;
    for e in &batch.events {
        match e {
            Event::Stored(s) => write_stored(out, s)?,
            Event::Removed(r) => write_removed(out, r)?,
            Event::AllCleared => {
                write_map_len(out, 1)?;
                write_str(out, "type")?;
                write_str(out, "AllBlocksCleared")?;
            }
        }
    }
    if let Some(rank) = batch.dp_rank {
        write_str(out, "data_parallel_rank")?;
        write_sint(out, rank)?;
    }
    Ok(())
}

fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn write_hashes(out: &mut W, hashes: &[EngineHash]) -> R {
    write_array_len(out, len32(hashes.len()))?;
    for h in hashes {
        write_u64(out, h.0)?;
    }
    Ok(())
}

fn write_opt_str(out: &mut W, s: Option<&str>) -> R {
    match s {
        Some(s) => write_str(out, s)?,
        None => nil(out)?,
    }
    Ok(())
}

fn write_medium(out: &mut W, m: Option<&Medium>) -> R {
    write_opt_str(out, m.map(Medium::as_str))
}

fn write_stored(out: &mut W, s: &BlockStored) -> R {
    write_map_len(out, if s.session_id.is_some() { 9 } else { 8 })?;
    write_str(out, "type")?;
    write_str(out, "BlockStored")?;
    write_str(out, "block_hashes")?;
    write_hashes(out, &s.block_hashes)?;
    write_str(out, "parent_block_hash")?;
    match s.parent {
        Some(p) => write_u64(out, p.0)?,
        None => nil(out)?,
    }
    write_str(out, "token_ids")?;
    write_array_len(out, len32(s.token_ids.len()))?;
    for t in &s.token_ids {
        write_u64(out, u64::from(*t))?;
    }
    write_str(out, "block_size")?;
    write_u64(out, u64::from(s.block_size))?;
    write_str(out, "lora_id")?;
    match s.lora_id {
        Some(id) => {
            write_sint(out, id)?;
        }
        None => nil(out)?,
    }
    write_str(out, "medium")?;
    write_medium(out, s.medium.as_ref())?;
    write_str(out, "lora_name")?;
    write_opt_str(out, s.lora_name.as_deref())?;
    if let Some(session) = &s.session_id {
        write_str(out, "session_id")?;
        write_str(out, session)?;
    }
    Ok(())
}

fn write_removed(out: &mut W, r: &BlockRemoved) -> R {
    write_map_len(out, 3)?;
    write_str(out, "type")?;
    write_str(out, "BlockRemoved")?;
    write_str(out, "block_hashes")?;
    write_hashes(out, &r.block_hashes)?;
    write_str(out, "medium")?;
    write_medium(out, r.medium.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::decode_batch;

    #[test]
    fn encode_then_decode_is_identity() {
        let batch = EventBatch {
            ts: 12.25,
            events: vec![
                Event::Stored(BlockStored {
                    block_hashes: vec![EngineHash(1), EngineHash(u64::MAX)],
                    parent: Some(EngineHash(9)),
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    lora_id: Some(-3),
                    medium: Some(Medium::Gpu),
                    lora_name: Some("a".into()),
                    session_id: Some("sess-1".into()),
                }),
                Event::Removed(BlockRemoved {
                    block_hashes: vec![EngineHash(1)],
                    medium: Some(Medium::Other("disk".into())),
                }),
                Event::AllCleared,
            ],
            dp_rank: Some(2),
        };
        assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
        let bare = EventBatch::default();
        assert_eq!(decode_batch(&encode_batch(&bare)).unwrap(), bare);
    }
}
