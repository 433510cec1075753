//! Wire decode: one msgpack payload → [`EventBatch`].
//!
//! Accepted shapes (any mix of them):
//! - the batch as an array `[ts, events]` or `[ts, events, dp_rank]` (vLLM, SGLang) or as a
//!   map with keys `ts`, `events`, `data_parallel_rank` (vLLM 0.33); unknown map keys and extra
//!   array elements are ignored;
//! - each event as a map tagged by `"type"` (`BlockStored`, `BlockRemoved`,
//!   `AllBlocksCleared`; fields may be omitted when they hold their default, unknown keys are
//!   ignored) or as a positional array starting with the tag:
//!   `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id?, medium?,
//!   lora_name?, …]`, `["BlockRemoved", block_hashes, medium?, …]`, `["AllBlocksCleared"]`
//!   (vLLM before map events, and SGLang);
//! - a hash as an unsigned or signed integer or as bytes ([`EngineHash`] says how each is
//!   normalised); `ts` as a float or an integer; token ids as integers in `0..=u32::MAX`.
//!
//! Any input gives `Ok` or a [`DecodeError`] naming the event index and field at fault; the
//! decoder never panics, nests at most [`MAX_DEPTH`] levels and never allocates more than the
//! input's size warrants.

use crate::event::{BlockRemoved, BlockStored, EngineHash, Event, EventBatch, Medium};
use rmpv::ValueRef;
use thiserror::Error;

/// Deepest msgpack nesting the decoder reads (the batch shape needs 4; `extra_keys` a few more).
pub const MAX_DEPTH: usize = 32;

/// Why a payload is not an event batch.
#[derive(Debug, Error)]
pub enum DecodeError {
    /// The bytes are not one complete msgpack value.
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    /// A msgpack value is followed by more bytes.
    #[error("{0} trailing bytes after the batch")]
    TrailingBytes(usize),
    /// The outer value is not a batch.
    #[error("batch: {0}")]
    Batch(FieldError),
    /// One event is malformed.
    #[error("event {index}: {error}")]
    Event {
        /// Position of the event in the batch, from 0.
        index: usize,
        /// What is wrong with it.
        error: FieldError,
    },
}

/// What is wrong with one value of a batch or event.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FieldError {
    /// A required field is absent.
    #[error("missing field `{0}`")]
    Missing(&'static str),
    /// A field holds a value of the wrong kind.
    #[error("field `{field}`: expected {expected}, found {found}")]
    WrongType {
        /// The field.
        field: &'static str,
        /// What was expected.
        expected: &'static str,
        /// The msgpack kind found.
        found: &'static str,
    },
    /// One element of a list field holds a value of the wrong kind or range.
    #[error("field `{field}`[{position}]: expected {expected}, found {found}")]
    WrongElement {
        /// The list field.
        field: &'static str,
        /// Position in the list, from 0.
        position: usize,
        /// What was expected.
        expected: &'static str,
        /// What was found.
        found: String,
    },
    /// The event tag names no known event.
    #[error("unknown event type {0:?}")]
    UnknownType(String),
}

/// Decodes one payload (the third frame of a published message).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rd = payload;
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::TrailingBytes(rd.len()));
    }
    decode_batch_value(&value)
}

/// Decodes an already parsed msgpack value as a batch.
pub fn decode_batch_value(value: &ValueRef<'_>) -> Result<EventBatch, DecodeError> {
    let (ts, events, rank) = match value {
        ValueRef::Array(items) => (items.first(), items.get(1), items.get(2)),
        ValueRef::Map(pairs) => (
            field(pairs, "ts"),
            field(pairs, "events"),
            field(pairs, "data_parallel_rank"),
        ),
        other => {
            return Err(DecodeError::Batch(FieldError::WrongType {
                field: "batch",
                expected: "an array or a map",
                found: kind(other),
            }));
        }
    };
    let ts = number(
        ts.ok_or(FieldError::Missing("ts"))
            .map_err(DecodeError::Batch)?,
        "ts",
    )
    .map_err(DecodeError::Batch)?;
    let events = match events {
        None => return Err(DecodeError::Batch(FieldError::Missing("events"))),
        Some(ValueRef::Array(events)) => events,
        Some(other) => {
            return Err(DecodeError::Batch(FieldError::WrongType {
                field: "events",
                expected: "an array",
                found: kind(other),
            }));
        }
    };
    let dp_rank = opt(rank)
        .map(|v| int(v, "data_parallel_rank"))
        .transpose()
        .map_err(DecodeError::Batch)?;
    let events = events
        .iter()
        .enumerate()
        .map(|(index, e)| decode_event(e).map_err(|error| DecodeError::Event { index, error }))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
    })
}

/// The fields of one event, wherever they came from (map keys or array positions).
#[derive(Default)]
struct Fields<'v, 'a> {
    block_hashes: Option<&'v ValueRef<'a>>,
    parent: Option<&'v ValueRef<'a>>,
    token_ids: Option<&'v ValueRef<'a>>,
    block_size: Option<&'v ValueRef<'a>>,
    lora_id: Option<&'v ValueRef<'a>>,
    medium: Option<&'v ValueRef<'a>>,
    lora_name: Option<&'v ValueRef<'a>>,
    session_id: Option<&'v ValueRef<'a>>,
}

fn decode_event(value: &ValueRef<'_>) -> Result<Event, FieldError> {
    let (tag, f) = match value {
        ValueRef::Map(pairs) => {
            let tag = field(pairs, "type").ok_or(FieldError::Missing("type"))?;
            let f = Fields {
                block_hashes: field(pairs, "block_hashes"),
                parent: field(pairs, "parent_block_hash"),
                token_ids: field(pairs, "token_ids"),
                block_size: field(pairs, "block_size"),
                lora_id: field(pairs, "lora_id"),
                medium: field(pairs, "medium"),
                lora_name: field(pairs, "lora_name"),
                session_id: field(pairs, "session_id"),
            };
            (tag, f)
        }
        ValueRef::Array(items) => {
            let tag = items.first().ok_or(FieldError::Missing("type"))?;
            let f = match text(tag, "type")? {
                "BlockStored" => Fields {
                    block_hashes: items.get(1),
                    parent: items.get(2),
                    token_ids: items.get(3),
                    block_size: items.get(4),
                    lora_id: items.get(5),
                    medium: items.get(6),
                    lora_name: items.get(7),
                    session_id: None,
                },
                "BlockRemoved" => Fields {
                    block_hashes: items.get(1),
                    medium: items.get(2),
                    ..Fields::default()
                },
                _ => Fields::default(),
            };
            (tag, f)
        }
        other => {
            return Err(FieldError::WrongType {
                field: "event",
                expected: "a map or an array",
                found: kind(other),
            });
        }
    };
    match text(tag, "type")? {
        "BlockStored" => {
            let block_size = int(
                f.block_size.ok_or(FieldError::Missing("block_size"))?,
                "block_size",
            )?;
            let block_size = u32::try_from(block_size).map_err(|_| FieldError::WrongType {
                field: "block_size",
                expected: "an integer in 0..=4294967295",
                found: "an integer out of range",
            })?;
            Ok(Event::Stored(BlockStored {
                block_hashes: hashes(
                    f.block_hashes.ok_or(FieldError::Missing("block_hashes"))?,
                    "block_hashes",
                )?,
                parent: opt(f.parent)
                    .map(|v| {
                        hash(v).map_err(|found| {
                            wrong("parent_block_hash", "an integer or bytes", found)
                        })
                    })
                    .transpose()?,
                token_ids: tokens(f.token_ids.ok_or(FieldError::Missing("token_ids"))?)?,
                block_size,
                lora_id: opt(f.lora_id).map(|v| int(v, "lora_id")).transpose()?,
                medium: medium(f.medium)?,
                lora_name: opt(f.lora_name)
                    .map(|v| text(v, "lora_name").map(str::to_string))
                    .transpose()?,
                session_id: opt(f.session_id)
                    .map(|v| text(v, "session_id").map(str::to_string))
                    .transpose()?,
            }))
        }
        "BlockRemoved" => Ok(Event::Removed(BlockRemoved {
            block_hashes: hashes(
                f.block_hashes.ok_or(FieldError::Missing("block_hashes"))?,
                "block_hashes",
            )?,
            medium: medium(f.medium)?,
        })),
        "AllBlocksCleared" => Ok(Event::AllCleared),
        other => Err(FieldError::UnknownType(other.chars().take(64).collect())),
    }
}

/// The value of `key` in a msgpack map (the first one, if repeated).
fn field<'v, 'a>(pairs: &'v [(ValueRef<'a>, ValueRef<'a>)], key: &str) -> Option<&'v ValueRef<'a>> {
    pairs.iter().find_map(|(k, v)| match k {
        ValueRef::String(s) if s.as_str() == Some(key) => Some(v),
        _ => None,
    })
}

/// `None` for an absent or nil field.
fn opt<'v, 'a>(v: Option<&'v ValueRef<'a>>) -> Option<&'v ValueRef<'a>> {
    v.filter(|v| !matches!(v, ValueRef::Nil))
}

/// The msgpack kind of a value, for error messages.
fn kind(v: &ValueRef<'_>) -> &'static str {
    match v {
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "a boolean",
        ValueRef::Integer(_) => "an integer",
        ValueRef::F32(_) | ValueRef::F64(_) => "a float",
        ValueRef::String(_) => "a string",
        ValueRef::Binary(_) => "bytes",
        ValueRef::Array(_) => "an array",
        ValueRef::Map(_) => "a map",
        ValueRef::Ext(..) => "an extension value",
    }
}

/// A value of the wrong type for `field`.
fn wrong(field: &'static str, expected: &'static str, found: &'static str) -> FieldError {
    FieldError::WrongType {
        field,
        expected,
        found,
    }
}

fn text<'v>(v: &'v ValueRef<'_>, field: &'static str) -> Result<&'v str, FieldError> {
    match v {
        ValueRef::String(s) => s
            .as_str()
            .ok_or(wrong(field, "a UTF-8 string", "invalid UTF-8")),
        other => Err(wrong(field, "a string", kind(other))),
    }
}

fn int(v: &ValueRef<'_>, field: &'static str) -> Result<i64, FieldError> {
    match v {
        ValueRef::Integer(i) => i.as_i64().ok_or(wrong(
            field,
            "an integer in the i64 range",
            "an integer above i64::MAX",
        )),
        other => Err(wrong(field, "an integer", kind(other))),
    }
}

fn number(v: &ValueRef<'_>, field: &'static str) -> Result<f64, FieldError> {
    match v {
        ValueRef::F64(x) => Ok(*x),
        ValueRef::F32(x) => Ok(f64::from(*x)),
        ValueRef::Integer(i) => {
            i.as_f64()
                .ok_or(wrong(field, "a number", "an unrepresentable integer"))
        }
        other => Err(wrong(field, "a number", kind(other))),
    }
}

/// One hash, or the kind of what was found instead.
fn hash(v: &ValueRef<'_>) -> Result<EngineHash, &'static str> {
    match v {
        ValueRef::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(EngineHash(u)),
            (None, Some(s)) => Ok(EngineHash::from_i64(s)),
            (None, None) => Err("an unrepresentable integer"),
        },
        ValueRef::Binary(b) => Ok(EngineHash::from_bytes(b)),
        other => Err(kind(other)),
    }
}

fn hashes(v: &ValueRef<'_>, field: &'static str) -> Result<Vec<EngineHash>, FieldError> {
    let ValueRef::Array(items) = v else {
        return Err(wrong(field, "an array of hashes", kind(v)));
    };
    items
        .iter()
        .enumerate()
        .map(|(position, h)| {
            hash(h).map_err(|found| FieldError::WrongElement {
                field,
                position,
                expected: "an integer or bytes",
                found: found.to_string(),
            })
        })
        .collect()
}

fn tokens(v: &ValueRef<'_>) -> Result<Vec<u32>, FieldError> {
    let ValueRef::Array(items) = v else {
        return Err(FieldError::WrongType {
            field: "token_ids",
            expected: "an array of integers",
            found: kind(v),
        });
    };
    items
        .iter()
        .enumerate()
        .map(|(position, t)| {
            let bad = |found: String| FieldError::WrongElement {
                field: "token_ids",
                position,
                expected: "an integer in 0..=4294967295",
                found,
            };
            match t {
                ValueRef::Integer(i) => i
                    .as_u64()
                    .and_then(|u| u32::try_from(u).ok())
                    .ok_or_else(|| bad(i.to_string())),
                other => Err(bad(kind(other).to_string())),
            }
        })
        .collect()
}

fn medium(v: Option<&ValueRef<'_>>) -> Result<Option<Medium>, FieldError> {
    opt(v)
        .map(|v| text(v, "medium").map(Medium::parse))
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn encode(v: &Value) -> Vec<u8> {
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, v).unwrap();
        buf
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    #[test]
    fn a_positional_sglang_batch_decodes() {
        let event = Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(7u64)]),
            Value::Nil,
            Value::Array(vec![Value::from(1), Value::from(2)]),
            Value::from(2),
            Value::Nil,
            s("GPU"),
        ]);
        let batch = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![event]),
            Value::from(3),
        ]);
        let b = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.dp_rank, Some(3));
        assert_eq!(
            b.events,
            vec![Event::Stored(BlockStored {
                block_hashes: vec![EngineHash(7)],
                parent: None,
                token_ids: vec![1, 2],
                block_size: 2,
                lora_id: None,
                medium: Some(Medium::Gpu),
                lora_name: None,
                session_id: None,
            })]
        );
    }

    #[test]
    fn errors_name_the_event_and_field() {
        let bad = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (
                s("block_hashes"),
                Value::Array(vec![Value::from(1), s("x")]),
            ),
            (s("token_ids"), Value::Array(vec![])),
            (s("block_size"), Value::from(16)),
        ]);
        let ok = Value::Map(vec![(s("type"), s("AllBlocksCleared"))]);
        let batch = Value::Array(vec![Value::from(0), Value::Array(vec![ok, bad])]);
        match decode_batch(&encode(&batch)) {
            Err(DecodeError::Event { index: 1, error }) => assert_eq!(
                error,
                FieldError::WrongElement {
                    field: "block_hashes",
                    position: 1,
                    expected: "an integer or bytes",
                    found: "a string".into()
                }
            ),
            other => panic!("unexpected {other:?}"),
        }
        let unknown = Value::Array(vec![
            Value::from(0),
            Value::Array(vec![Value::Array(vec![s("BlockMoved")])]),
        ]);
        assert!(matches!(
            decode_batch(&encode(&unknown)),
            Err(DecodeError::Event { index: 0, error: FieldError::UnknownType(t) }) if t == "BlockMoved"
        ));
        let missing = Value::Map(vec![(s("ts"), Value::from(1))]);
        assert!(matches!(
            decode_batch(&encode(&missing)),
            Err(DecodeError::Batch(FieldError::Missing("events")))
        ));
        let mut trailing = encode(&Value::Array(vec![Value::from(0), Value::Array(vec![])]));
        trailing.push(0xc0);
        assert!(matches!(
            decode_batch(&trailing),
            Err(DecodeError::TrailingBytes(1))
        ));
        assert!(matches!(decode_batch(&[]), Err(DecodeError::Msgpack(_))));
        let negative_token = Value::Array(vec![
            Value::from(0),
            Value::Array(vec![Value::Map(vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), Value::Array(vec![Value::from(1)])),
                (s("token_ids"), Value::Array(vec![Value::from(-4)])),
                (s("block_size"), Value::from(1)),
            ])]),
        ]);
        match decode_batch(&encode(&negative_token)) {
            Err(DecodeError::Event {
                index: 0,
                error:
                    FieldError::WrongElement {
                        field,
                        position,
                        found,
                        ..
                    },
            }) => {
                assert_eq!((field, position, found.as_str()), ("token_ids", 0, "-4"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn hashes_normalise_to_64_bits() {
        assert_eq!(hash(&ValueRef::from(-1i64)), Ok(EngineHash(u64::MAX)));
        assert_eq!(hash(&ValueRef::from(u64::MAX)), Ok(EngineHash(u64::MAX)));
        let bytes = [1u8, 2, 3];
        assert_eq!(
            hash(&ValueRef::Binary(&bytes)),
            Ok(EngineHash(xxhash_rust::xxh3::xxh3_64(&bytes)))
        );
        assert_eq!(hash(&ValueRef::Nil), Err("nil"));
    }
}
