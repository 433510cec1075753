//! Traces: loading, writing, session inference, the SWE-agent generator and statistics
//! (coding-agent structure in [`agents`]).
//!
//! A trace file is JSON Lines in the Mooncake shape plus optional session and turn ids
//! ([`TraceRecord`]):
//!
//! ```json
//! {"timestamp": 0, "session_id": 3, "turn_id": 1, "input_length": 1200, "output_length": 40, "hash_ids": [0, 1, 2]}
//! ```
//!
//! - `timestamp`: arrival in milliseconds (a fractional value is rounded down);
//! - `input_length` (≥ 1) and `output_length`: tokens;
//! - `hash_ids`: chained block ids, exactly `ceil(input_length / block_size)` of them;
//! - `session_id` (a number, or a string mapped by [`SessionId::from_key`]) and `turn_id`
//!   (from 1): optional;
//! - `parent_session_id` (a session id, as `session_id`): optional, on every request of a child
//!   (subagent) session, naming the session that spawned it; it needs the record's own
//!   `session_id` and must differ from it;
//! - `final` (`true` or `false`, default `false`): optional, set on the last request of a
//!   session the client ended explicitly.
//!
//! Blank lines are skipped, unknown fields are ignored, a malformed line is a [`TraceError`]
//! naming the file, the line and the field (or, with [`LoadOptions::skip_invalid`], is skipped
//! and counted in the [`LoadReport`]).
//!
//! # Sessions and order
//!
//! Requests are sorted by timestamp (stable: ties keep file order) and numbered by
//! [`TraceRequest::index`]. Session assignment:
//! - a record with `session_id` keeps it; its turn is `turn_id`, or its 1-based position
//!   among its session's requests when absent;
//! - without session ids and without [`LoadOptions::infer_sessions`], each request is its
//!   own session (turn 1), whose id is its 0-based line index;
//! - with [`LoadOptions::infer_sessions`], follow-ups are found from the block ids (B
//!   continues A when B holds the last full block A introduced and B is longer) and the
//!   inferred sessions get ids `0, 1, …` in order of their first request.
//!
//! In a file mixing both kinds, requests without a session id get ids numbered after the
//! largest explicit one.
//!
//! # Example
//!
//! ```
//! use kvc_replay::trace::{self, LoadOptions};
//!
//! let text = "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 7, \"hash_ids\": [1, 2]}\n\
//!             \n\
//!             {\"timestamp\": 9, \"input_length\": 1100, \"output_length\": 3, \"hash_ids\": [1, 3, 4]}\n";
//! let opts = LoadOptions { infer_sessions: true, ..LoadOptions::default() };
//! let (trace, report) = trace::parse(text.as_bytes(), "example.jsonl", &opts).unwrap();
//! assert_eq!((report.lines, report.records, report.skipped), (3, 2, 0));
//! assert_eq!(trace.requests.len(), 2);
//! assert_eq!(trace.sessions(), 1); // the second request continues the first
//! assert_eq!(trace.requests[1].turn.0, 2);
//!
//! let bad = "{\"timestamp\": 5, \"input_length\": -1, \"output_length\": 7, \"hash_ids\": []}\n";
//! let err = trace::parse(bad.as_bytes(), "bad.jsonl", &opts).unwrap_err();
//! assert_eq!(err.to_string(), "bad.jsonl:1: field `input_length`: expected a non-negative integer, got the number -1");
//! ```

pub mod agents;
mod error;
pub mod generate;
mod hash_ids;
pub mod prefetch;
mod record;
mod sessions;
pub mod stats;
pub mod stream;

pub use error::TraceError;
pub use kvc_core::HashIds;
pub use kvc_core::{BlockHash, BlockSize, SessionId, TraceRecord, TurnId};
pub use prefetch::ReadAhead;
pub use stream::{Arrival, RequestSource, SourceError, TraceArrivals, TraceStream};

/// Alias of [`generate`] under the name `gen`, which is a reserved word since Rust 2024 and
/// must be written `r#gen`:
///
/// ```
/// use kvc_replay::trace::r#gen::{swe, SweConfig};
/// assert_eq!(swe(&SweConfig { sessions: 1, ..SweConfig::default() }).len(), 86);
/// ```
pub use self::generate as r#gen;

use hash_ids::SessionStore;
use record::LineRecord;
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::path::Path;
use std::sync::Arc;

/// At most this many skipped-line errors are kept in [`LoadReport::first_errors`].
pub const MAX_REPORTED_ERRORS: usize = 10;

/// One request of a loaded trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRequest {
    /// Position in the loaded trace (requests are sorted by timestamp).
    pub index: usize,
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp_ms: u64,
    /// The session.
    pub session: SessionId,
    /// The turn within the session, from 1.
    pub turn: TurnId,
    /// The session that spawned this one, when the record names it (`parent_session_id`).
    pub parent_session: Option<SessionId>,
    /// Whether the client ended the session with this request (`final`).
    pub session_final: bool,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Chained block ids of the prompt (shared with the session's other turns where possible).
    pub hash_ids: HashIds,
}

impl TraceRequest {
    /// The request as a file record (with its session and turn).
    pub fn to_record(&self) -> TraceRecord {
        TraceRecord {
            timestamp: self.timestamp_ms,
            session_id: Some(self.session),
            parent_session_id: self.parent_session,
            turn_id: Some(self.turn),
            session_final: self.session_final,
            input_length: self.input_length,
            output_length: self.output_length,
            hash_ids: self.hash_ids.to_vec(),
        }
    }
}

/// The requests of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The session id.
    pub id: SessionId,
    /// Indices into [`Trace::requests`], in turn order.
    pub requests: Vec<usize>,
}

/// A loaded trace: requests sorted by timestamp, grouped into sessions.
#[derive(Debug, Clone)]
pub struct Trace {
    /// The requests, sorted by timestamp (`requests[i].index == i`).
    pub requests: Vec<TraceRequest>,
    sessions: Vec<Session>,
    block_size: BlockSize,
}

impl Trace {
    /// Number of sessions.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// The sessions, in order of their first request.
    pub fn session_list(&self) -> &[Session] {
        &self.sessions
    }

    /// The requests in timestamp order.
    pub fn iter(&self) -> std::slice::Iter<'_, TraceRequest> {
        self.requests.iter()
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether there is no request (never true for a trace built by [`load`] or [`parse`]).
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// A trace without requests, of `block_size` tokens per block: what standalone simulated
    /// workers start from, knowing no request in advance.
    pub fn empty(block_size: BlockSize) -> Trace {
        Trace {
            requests: Vec::new(),
            sessions: Vec::new(),
            block_size,
        }
    }

    /// Tokens per block of the `hash_ids`.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// Builds a trace from records in memory (e.g. from [`generate::swe`]), with the same
    /// validation, ordering and session rules as [`parse`]; errors name the source
    /// `<records>` and the 1-based position of the record.
    pub fn from_records<'a>(
        records: impl IntoIterator<Item = &'a TraceRecord>,
        opts: &LoadOptions,
    ) -> Result<(Trace, LoadReport), TraceError> {
        const SOURCE: &str = "<records>";
        let mut report = LoadReport::default();
        let mut ids = Vec::new();
        let mut lines = Vec::new();
        for (i, r) in records.into_iter().enumerate() {
            report.lines += 1;
            match record::check_record(r, SOURCE, i + 1, opts.block_size, &mut ids) {
                Ok(l) => lines.push(l),
                Err(e) => report.skip_or_fail(e, opts)?,
            }
        }
        let trace = build(lines, ids, SOURCE, opts, &mut report)?;
        Ok((trace, report))
    }

    /// The trace as records (sorted, with session and turn ids), e.g. to write it back.
    pub fn to_records(&self) -> Vec<TraceRecord> {
        self.requests.iter().map(TraceRequest::to_record).collect()
    }
}

impl<'a> IntoIterator for &'a Trace {
    type Item = &'a TraceRequest;
    type IntoIter = std::slice::Iter<'a, TraceRequest>;

    fn into_iter(self) -> Self::IntoIter {
        self.requests.iter()
    }
}

/// How to load a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadOptions {
    /// Rebuild sessions of requests that carry no `session_id` from their block ids.
    pub infer_sessions: bool,
    /// Skip malformed lines (counted in [`LoadReport::skipped`]) instead of failing.
    pub skip_invalid: bool,
    /// Tokens per `hash_ids` entry (512 by default).
    pub block_size: BlockSize,
}

/// What loading read.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// Lines read (blank ones included).
    pub lines: usize,
    /// Requests loaded.
    pub records: usize,
    /// Blank lines skipped.
    pub blank: usize,
    /// Malformed lines skipped (only with [`LoadOptions::skip_invalid`]).
    pub skipped: usize,
    /// The first [`MAX_REPORTED_ERRORS`] errors of skipped lines.
    pub first_errors: Vec<TraceError>,
}

impl LoadReport {
    fn skip_or_fail(&mut self, err: TraceError, opts: &LoadOptions) -> Result<(), TraceError> {
        if !opts.skip_invalid || !err.is_record_error() {
            return Err(err);
        }
        self.skipped += 1;
        if self.first_errors.len() < MAX_REPORTED_ERRORS {
            self.first_errors.push(err);
        }
        Ok(())
    }
}

/// Loads a JSONL trace file.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<(Trace, LoadReport), TraceError> {
    let file = File::open(path).map_err(|source| TraceError::Io {
        path: path.to_owned(),
        source,
    })?;
    let name = path.display().to_string();
    parse(BufReader::with_capacity(1 << 20, file), &name, opts)
}

/// Parses a JSONL trace from a reader; `source_name` names it in errors.
pub fn parse(
    mut reader: impl BufRead,
    source_name: &str,
    opts: &LoadOptions,
) -> Result<(Trace, LoadReport), TraceError> {
    let mut report = LoadReport::default();
    let mut ids: Vec<BlockHash> = Vec::new();
    let mut lines: Vec<LineRecord> = Vec::new();
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|source| TraceError::Io {
                path: source_name.into(),
                source,
            })?;
        if n == 0 {
            break;
        }
        report.lines += 1;
        let mut text = buf.trim_ascii();
        if report.lines == 1 {
            text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
        }
        if text.is_empty() {
            report.blank += 1;
            continue;
        }
        match record::parse_line(text, source_name, report.lines, opts.block_size, &mut ids) {
            Ok(l) => lines.push(l),
            Err(e) => report.skip_or_fail(e, opts)?,
        }
    }
    let trace = build(lines, ids, source_name, opts, &mut report)?;
    Ok((trace, report))
}

/// Writes records as JSON Lines (one object per line, fields in [`TraceRecord`] order).
pub fn write_jsonl<R: std::borrow::Borrow<TraceRecord>>(
    mut w: impl Write,
    records: impl IntoIterator<Item = R>,
) -> io::Result<()> {
    for r in records {
        serde_json::to_writer(&mut w, r.borrow()).map_err(io::Error::other)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

/// Largest store of one session (ids are addressed with 32-bit offsets).
const MAX_STORE: usize = u32::MAX as usize;

/// Sorts, assigns sessions and turns, and shares block ids per session.
fn build(
    mut lines: Vec<LineRecord>,
    ids: Vec<BlockHash>,
    file: &str,
    opts: &LoadOptions,
    report: &mut LoadReport,
) -> Result<Trace, TraceError> {
    lines.sort_by_key(|l| l.timestamp_ms);
    let (sessions, turns) = loop {
        let session_of = assign_sessions(&lines, &ids, opts);
        let (sessions, turns) = group(&lines, &session_of);
        let dups = duplicate_turns(&lines, &sessions, &turns, file);
        if dups.is_empty() {
            break (sessions, turns);
        }
        let mut drop_pos = vec![false; lines.len()];
        for (pos, err) in dups {
            report.skip_or_fail(err, opts)?;
            drop_pos[pos] = true;
        }
        let mut k = 0;
        lines.retain(|_| {
            k += 1;
            !drop_pos[k - 1]
        });
    };
    if lines.is_empty() {
        return Err(TraceError::Empty {
            file: file.to_owned(),
        });
    }

    // Per-session stores: each session's lists in turn order.
    let mut windows: Vec<(usize, usize, usize)> = vec![(0, 0, 0); lines.len()];
    let mut stores: Vec<Arc<[BlockHash]>> = Vec::new();
    for s in &sessions {
        let mut store = SessionStore::default();
        for &pos in &s.requests {
            let l = &lines[pos];
            let list = &ids[l.ids_start..l.ids_start + l.ids_len];
            if store.len() + list.len() > MAX_STORE {
                stores.push(std::mem::take(&mut store).finish());
            }
            let (start, len) = store.push(list);
            windows[pos] = (stores.len(), start, len);
        }
        stores.push(store.finish());
    }
    drop(ids);

    let requests = lines
        .iter()
        .enumerate()
        .map(|(index, l)| {
            let (store, start, len) = windows[index];
            TraceRequest {
                index,
                timestamp_ms: l.timestamp_ms,
                session: sessions[turns[index].0].id,
                turn: turns[index].1,
                parent_session: l.parent_session_id,
                session_final: l.session_final,
                input_length: l.input_length,
                output_length: l.output_length,
                hash_ids: HashIds::window(Arc::clone(&stores[store]), start, len)
                    .unwrap_or_default(),
            }
        })
        .collect();
    report.records = lines.len();
    Ok(Trace {
        requests,
        sessions,
        block_size: opts.block_size,
    })
}

/// The session of every line (lines sorted by timestamp).
fn assign_sessions(lines: &[LineRecord], ids: &[BlockHash], opts: &LoadOptions) -> Vec<SessionId> {
    let base = lines
        .iter()
        .filter_map(|l| l.session_id)
        .map(|s| s.0.wrapping_add(1))
        .max()
        .unwrap_or(0);
    let mut out: Vec<SessionId> = lines
        .iter()
        .map(|l| {
            l.session_id
                .unwrap_or(SessionId(base.wrapping_add(l.line as u64 - 1)))
        })
        .collect();
    if opts.infer_sessions {
        let mut inference = sessions::SessionInference::new(opts.block_size);
        for (l, slot) in lines.iter().zip(out.iter_mut()) {
            if l.session_id.is_none() {
                let list = &ids[l.ids_start..l.ids_start + l.ids_len];
                *slot = SessionId(base.wrapping_add(inference.push(list, l.input_length)));
            }
        }
    }
    out
}

/// Groups lines into sessions (in order of first request) and numbers turns; returns the
/// sessions (request positions in turn order) and, per line, `(session slot, turn)`.
fn group(lines: &[LineRecord], session_of: &[SessionId]) -> (Vec<Session>, Vec<(usize, TurnId)>) {
    let mut slot_of: HashMap<SessionId, usize> = HashMap::new();
    let mut sessions: Vec<Session> = Vec::new();
    let mut turns = Vec::with_capacity(lines.len());
    for (pos, (l, &sid)) in lines.iter().zip(session_of).enumerate() {
        let slot = *slot_of.entry(sid).or_insert_with(|| {
            sessions.push(Session {
                id: sid,
                requests: Vec::new(),
            });
            sessions.len() - 1
        });
        let reqs = &mut sessions[slot].requests;
        reqs.push(pos);
        let by_order = u32::try_from(reqs.len()).unwrap_or(u32::MAX);
        turns.push((slot, l.turn_id.unwrap_or(TurnId(by_order))));
    }
    for s in &mut sessions {
        // Stable: equal turns keep timestamp order.
        s.requests.sort_by_key(|&pos| turns[pos].1);
    }
    (sessions, turns)
}

/// Every line repeating an earlier line's `(session, turn)`, as `(position, error)` in file
/// order.
fn duplicate_turns(
    lines: &[LineRecord],
    sessions: &[Session],
    turns: &[(usize, TurnId)],
    file: &str,
) -> Vec<(usize, TraceError)> {
    let mut found = Vec::new();
    for s in sessions {
        let mut k = 0;
        while k < s.requests.len() {
            // A run of equal turns: the line that comes first in the file is kept.
            let mut end = k + 1;
            while end < s.requests.len() && turns[s.requests[end]].1 == turns[s.requests[k]].1 {
                end += 1;
            }
            let run = &s.requests[k..end];
            if let Some(&first) = run.iter().min_by_key(|&&p| lines[p].line) {
                for &pos in run.iter().filter(|&&p| p != first) {
                    found.push((
                        pos,
                        TraceError::DuplicateTurn {
                            file: file.to_owned(),
                            line: lines[pos].line,
                            first_line: lines[first].line,
                            session: s.id.0,
                            turn: turns[pos].1.0,
                        },
                    ));
                }
            }
            k = end;
        }
    }
    found.sort_by_key(|(pos, _)| lines[*pos].line);
    found
}
