//! Parsing and validating one JSONL line.
//!
//! The line is deserialized leniently (every field as a loose value, unknown fields ignored),
//! then each field is checked, so an error names the field rather than only a column.

use super::TraceError;
use kvc_core::{BlockHash, BlockSize, SessionId, TurnId};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use std::fmt;

/// One validated line; its block ids are appended to a shared buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LineRecord {
    pub(crate) line: usize,
    pub(crate) timestamp_ms: u64,
    pub(crate) session_id: Option<SessionId>,
    pub(crate) parent_session_id: Option<SessionId>,
    pub(crate) turn_id: Option<TurnId>,
    pub(crate) session_final: bool,
    pub(crate) input_length: u64,
    pub(crate) output_length: u64,
    /// `start..start + len` in the shared id buffer.
    pub(crate) ids_start: usize,
    pub(crate) ids_len: usize,
}

/// Fields of a line as found, before validation.
#[derive(Default)]
struct RawLine {
    timestamp: Option<Value>,
    input_length: Option<Value>,
    output_length: Option<Value>,
    session_id: Option<Value>,
    parent_session_id: Option<Value>,
    turn_id: Option<Value>,
    session_final: Option<Value>,
    hash_ids: Option<RawIds>,
}

/// `hash_ids` as found: the ids, or why they are not a list of ids.
enum RawIds {
    Null,
    Ids(Vec<BlockHash>),
    Invalid(String),
}

enum Key {
    Timestamp,
    InputLength,
    OutputLength,
    SessionId,
    ParentSessionId,
    TurnId,
    Final,
    HashIds,
    Other,
}

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "timestamp" => Key::Timestamp,
                    "input_length" => Key::InputLength,
                    "output_length" => Key::OutputLength,
                    "session_id" => Key::SessionId,
                    "parent_session_id" => Key::ParentSessionId,
                    "turn_id" => Key::TurnId,
                    "final" => Key::Final,
                    "hash_ids" => Key::HashIds,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

impl<'de> de::Deserialize<'de> for RawLine {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct LineVisitor;
        impl<'de> Visitor<'de> for LineVisitor {
            type Value = RawLine;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawLine, A::Error> {
                fn set<T, E: de::Error>(
                    slot: &mut Option<T>,
                    v: T,
                    name: &'static str,
                ) -> Result<(), E> {
                    if slot.is_some() {
                        return Err(E::duplicate_field(name));
                    }
                    *slot = Some(v);
                    Ok(())
                }
                let mut raw = RawLine::default();
                while let Some(key) = map.next_key::<Key>()? {
                    match key {
                        Key::Timestamp => set(&mut raw.timestamp, map.next_value()?, "timestamp")?,
                        Key::InputLength => {
                            set(&mut raw.input_length, map.next_value()?, "input_length")?
                        }
                        Key::OutputLength => {
                            set(&mut raw.output_length, map.next_value()?, "output_length")?
                        }
                        Key::SessionId => {
                            set(&mut raw.session_id, map.next_value()?, "session_id")?
                        }
                        Key::ParentSessionId => set(
                            &mut raw.parent_session_id,
                            map.next_value()?,
                            "parent_session_id",
                        )?,
                        Key::TurnId => set(&mut raw.turn_id, map.next_value()?, "turn_id")?,
                        Key::Final => set(&mut raw.session_final, map.next_value()?, "final")?,
                        Key::HashIds => set(&mut raw.hash_ids, map.next_value()?, "hash_ids")?,
                        Key::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(raw)
            }
        }
        d.deserialize_map(LineVisitor)
    }
}

impl<'de> de::Deserialize<'de> for RawIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct IdsVisitor;
        fn not_a_list<E>(what: &str) -> Result<RawIds, E> {
            Ok(RawIds::Invalid(format!(
                "expected a list of block ids, got {what}"
            )))
        }
        impl<'de> Visitor<'de> for IdsVisitor {
            type Value = RawIds;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of block ids")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawIds, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                let mut bad: Option<String> = None;
                let mut i = 0usize;
                while let Some(v) = seq.next_element::<IdEntry>()? {
                    match v {
                        IdEntry::Id(id) if bad.is_none() => ids.push(BlockHash(id)),
                        IdEntry::Id(_) => {}
                        IdEntry::Other(v) => {
                            if bad.is_none() {
                                bad = Some(format!(
                                    "entry {i} is {}, expected a non-negative integer",
                                    describe(&v)
                                ));
                            }
                        }
                    }
                    i += 1;
                }
                Ok(match bad {
                    Some(msg) => RawIds::Invalid(msg),
                    None => RawIds::Ids(ids),
                })
            }
            fn visit_unit<E: de::Error>(self) -> Result<RawIds, E> {
                Ok(RawIds::Null)
            }
            fn visit_none<E: de::Error>(self) -> Result<RawIds, E> {
                Ok(RawIds::Null)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<RawIds, E> {
                not_a_list("a boolean")
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<RawIds, E> {
                not_a_list("a number")
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<RawIds, E> {
                not_a_list("a number")
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<RawIds, E> {
                not_a_list("a number")
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<RawIds, E> {
                not_a_list("a string")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawIds, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                not_a_list("an object")
            }
        }
        d.deserialize_any(IdsVisitor)
    }
}

/// One entry of `hash_ids`: an id read straight from the number, or any other value kept (as
/// much of it as its description needs) for the error message.
enum IdEntry {
    Id(u64),
    Other(Value),
}

impl<'de> de::Deserialize<'de> for IdEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct EntryVisitor;
        impl<'de> Visitor<'de> for EntryVisitor {
            type Value = IdEntry;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block id")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<IdEntry, E> {
                Ok(IdEntry::Id(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<IdEntry, E> {
                Ok(match u64::try_from(v) {
                    Ok(id) => IdEntry::Id(id),
                    Err(_) => IdEntry::Other(Value::from(v)),
                })
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<IdEntry, E> {
                Ok(IdEntry::Other(Value::from(v)))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<IdEntry, E> {
                Ok(IdEntry::Other(Value::Bool(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<IdEntry, E> {
                Ok(IdEntry::Other(Value::String(v.to_owned())))
            }
            fn visit_unit<E: de::Error>(self) -> Result<IdEntry, E> {
                Ok(IdEntry::Other(Value::Null))
            }
            fn visit_none<E: de::Error>(self) -> Result<IdEntry, E> {
                Ok(IdEntry::Other(Value::Null))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<IdEntry, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(IdEntry::Other(Value::Array(Vec::new())))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<IdEntry, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(IdEntry::Other(Value::Object(serde_json::Map::new())))
            }
        }
        d.deserialize_any(EntryVisitor)
    }
}

/// A short description of a JSON value for error messages (long values are cut).
fn describe(v: &Value) -> String {
    let kind = match v {
        Value::Null => return "null".to_owned(),
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "the number",
        Value::String(_) => "the string",
        Value::Array(_) => return "a list".to_owned(),
        Value::Object(_) => return "an object".to_owned(),
    };
    let mut text = v.to_string();
    if text.len() > 40 {
        let mut cut = 37;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str("...");
    }
    format!("{kind} {text}")
}

/// Context for the checks of one line.
struct Ctx<'a> {
    file: &'a str,
    line: usize,
}

impl Ctx<'_> {
    fn missing(&self, field: &'static str) -> TraceError {
        TraceError::MissingField {
            file: self.file.to_owned(),
            line: self.line,
            field,
        }
    }

    fn invalid(&self, field: &'static str, msg: String) -> TraceError {
        TraceError::InvalidField {
            file: self.file.to_owned(),
            line: self.line,
            field,
            msg,
        }
    }

    /// An optional session id: a non-negative integer, or a string mapped by
    /// [`SessionId::from_key`].
    fn session(
        &self,
        v: Option<Value>,
        field: &'static str,
    ) -> Result<Option<SessionId>, TraceError> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(key)) => Ok(Some(SessionId::from_key(&key))),
            Some(v) => v.as_u64().map(|id| Some(SessionId(id))).ok_or_else(|| {
                self.invalid(
                    field,
                    format!(
                        "expected a non-negative integer or a string, got {}",
                        describe(&v)
                    ),
                )
            }),
        }
    }

    /// A parent session must come with the record's own session, and differ from it.
    fn check_parent(
        &self,
        session: Option<SessionId>,
        parent: Option<SessionId>,
    ) -> Result<(), TraceError> {
        match (session, parent) {
            (_, None) => Ok(()),
            (None, Some(p)) => Err(self.invalid(
                "parent_session_id",
                format!(
                    "parent session {} given on a record without `session_id` (a child session \
                     must be named to be linked to its parent)",
                    p.0
                ),
            )),
            (Some(s), Some(p)) if s == p => Err(self.invalid(
                "parent_session_id",
                format!(
                    "names the record's own session {} (a session cannot be its own parent)",
                    s.0
                ),
            )),
            _ => Ok(()),
        }
    }

    /// A required non-negative integer.
    fn count(&self, v: Option<Value>, field: &'static str) -> Result<u64, TraceError> {
        match v {
            None | Some(Value::Null) => Err(self.missing(field)),
            Some(v) => v.as_u64().ok_or_else(|| {
                self.invalid(
                    field,
                    format!("expected a non-negative integer, got {}", describe(&v)),
                )
            }),
        }
    }
}

/// Parses one non-blank line; appends its block ids to `ids` only when the line is valid.
pub(crate) fn parse_line(
    bytes: &[u8],
    file: &str,
    line: usize,
    block_size: BlockSize,
    ids: &mut Vec<BlockHash>,
) -> Result<LineRecord, TraceError> {
    let raw: RawLine = serde_json::from_slice(bytes).map_err(|e| TraceError::Json {
        file: file.to_owned(),
        line,
        msg: json_msg(&e),
    })?;
    let ctx = Ctx { file, line };

    let timestamp_ms = match raw.timestamp {
        None | Some(Value::Null) => return Err(ctx.missing("timestamp")),
        Some(v) => match v.as_u64() {
            Some(t) => t,
            // Fractional milliseconds are accepted and rounded down.
            None => match v.as_f64() {
                Some(f) if (0.0..18_446_744_073_709_551_616.0).contains(&f) => f as u64,
                _ => {
                    return Err(ctx.invalid(
                        "timestamp",
                        format!("expected non-negative milliseconds, got {}", describe(&v)),
                    ));
                }
            },
        },
    };
    let input_length = ctx.count(raw.input_length, "input_length")?;
    if input_length == 0 {
        return Err(ctx.invalid("input_length", "must be at least 1 token".to_owned()));
    }
    let output_length = ctx.count(raw.output_length, "output_length")?;

    let session_id = ctx.session(raw.session_id, "session_id")?;
    let parent_session_id = ctx.session(raw.parent_session_id, "parent_session_id")?;
    ctx.check_parent(session_id, parent_session_id)?;
    let session_final = match raw.session_final {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(v) => {
            return Err(ctx.invalid(
                "final",
                format!("expected true or false, got {}", describe(&v)),
            ));
        }
    };
    let turn_id = match raw.turn_id {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64().and_then(|t| u32::try_from(t).ok()) {
            Some(t) if t >= 1 => Some(TurnId(t)),
            _ => {
                return Err(ctx.invalid(
                    "turn_id",
                    format!(
                        "expected an integer from 1 to {}, got {}",
                        u32::MAX,
                        describe(&v)
                    ),
                ));
            }
        },
    };

    let list = match raw.hash_ids {
        None | Some(RawIds::Null) => return Err(ctx.missing("hash_ids")),
        Some(RawIds::Invalid(msg)) => return Err(ctx.invalid("hash_ids", msg)),
        Some(RawIds::Ids(list)) => list,
    };
    let expected = block_size.blocks_for(input_length);
    if list.len() as u64 != expected {
        return Err(TraceError::HashLength {
            file: file.to_owned(),
            line,
            expected,
            got: list.len() as u64,
            input_length,
            block_size: block_size.tokens(),
        });
    }
    let ids_start = ids.len();
    ids.extend_from_slice(&list);
    Ok(LineRecord {
        line,
        timestamp_ms,
        session_id,
        parent_session_id,
        turn_id,
        session_final,
        input_length,
        output_length,
        ids_start,
        ids_len: list.len(),
    })
}

/// The parser's message without its own "at line 1 column N" suffix (the line is ours).
fn json_msg(e: &serde_json::Error) -> String {
    let msg = e.to_string();
    match msg.rfind(" at line ") {
        Some(cut) => format!("{} (column {})", &msg[..cut], e.column()),
        None => msg,
    }
}

/// Validates a record built in memory (the same checks as for a line).
pub(crate) fn check_record(
    r: &kvc_core::TraceRecord,
    file: &str,
    line: usize,
    block_size: BlockSize,
    ids: &mut Vec<BlockHash>,
) -> Result<LineRecord, TraceError> {
    let ctx = Ctx { file, line };
    if r.input_length == 0 {
        return Err(ctx.invalid("input_length", "must be at least 1 token".to_owned()));
    }
    if r.turn_id.is_some_and(|t| t.0 == 0) {
        return Err(ctx.invalid("turn_id", "turns are counted from 1".to_owned()));
    }
    ctx.check_parent(r.session_id, r.parent_session_id)?;
    if !r.hash_len_matches(block_size) {
        return Err(TraceError::HashLength {
            file: file.to_owned(),
            line,
            expected: block_size.blocks_for(r.input_length),
            got: r.hash_ids.len() as u64,
            input_length: r.input_length,
            block_size: block_size.tokens(),
        });
    }
    let ids_start = ids.len();
    ids.extend_from_slice(&r.hash_ids);
    Ok(LineRecord {
        line,
        timestamp_ms: r.timestamp,
        session_id: r.session_id,
        parent_session_id: r.parent_session_id,
        turn_id: r.turn_id,
        session_final: r.session_final,
        input_length: r.input_length,
        output_length: r.output_length,
        ids_start,
        ids_len: r.hash_ids.len(),
    })
}
