//! Traces read as a replay goes: requests one at a time, in trace order, with the session
//! links the replay needs ([`Arrival`]), from a file ([`TraceStream`]) or from a trace in
//! memory ([`TraceArrivals`]), behind one interface ([`RequestSource`]).
//!
//! A file is streamed when it needs no look at later lines to be numbered as [`load`] numbers
//! it: timestamps never decrease, every request carries a session id or none does, and each
//! session's turns come in increasing turn order. Its requests, sessions and turns are then
//! exactly those [`load`] gives. A line that breaks one of these rules ends the stream with
//! [`SourceError::NeedsWholeTrace`], naming the line, so the caller can load the whole file
//! instead (which sorts, numbers and reports duplicates as it always has). A malformed line is
//! the same [`TraceError`] as [`load`] reports (or, with [`LoadOptions::skip_invalid`], is
//! skipped and counted in [`TraceStream::report`]).
//!
//! What a stream keeps: one line, and per session its last turn (none for a trace without
//! session ids read without inference); with [`LoadOptions::infer_sessions`], every block id
//! seen, as [`load`] does.
//!
//! [`load`]: super::load

use super::record::{self, LineRecord};
use super::sessions::SessionInference;
use super::{LoadOptions, LoadReport, Trace, TraceError, TraceRequest};
use kvc_core::{BlockHash, BlockSize, HashIds, SessionId, TurnId};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// One request as a streamed replay reads it: the request and its place in its session.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// The request (`request.index` counts from 0 in trace order).
    pub request: TraceRequest,
    /// Trace index of the turn this one follows (`None` for a session's first turn).
    pub after: Option<usize>,
    /// Whether a later turn of its session may follow it (`false` only when none can).
    pub may_continue: bool,
}

/// Why a source could not give its next request.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// A read error or a malformed line, as loading reports it.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The file cannot be read line by line in trace order (it is not sorted by time, mixes
    /// requests with and without session ids, or has a session's turns out of order): load it
    /// whole instead.
    #[error("{file}:{line}: {why}")]
    NeedsWholeTrace {
        /// The file.
        file: String,
        /// 1-based line number of the line at fault.
        line: usize,
        /// What is wrong with it.
        why: String,
    },
}

/// Requests in trace order, for a replay that reads them as it goes.
pub trait RequestSource {
    /// Tokens per block of the requests' `hash_ids`.
    fn block_size(&self) -> BlockSize;
    /// The next request in trace order, `None` after the last.
    fn next_arrival(&mut self) -> Result<Option<Arrival>, SourceError>;
    /// Share of the source read so far (0 to 1), when it is known.
    fn fraction_read(&self) -> Option<f64>;
}

/// The requests of a trace in memory, as a [`RequestSource`].
#[derive(Debug)]
pub struct TraceArrivals<'a> {
    trace: &'a Trace,
    next: usize,
    /// Per request: the turn it follows, and whether a turn follows it.
    links: Vec<(Option<usize>, bool)>,
}

impl<'a> TraceArrivals<'a> {
    /// The requests of `trace`, each linked to its session's turn before it (sessions' turns
    /// in turn order, ties in trace order).
    pub fn new(trace: &'a Trace) -> Self {
        let mut links = vec![(None, false); trace.len()];
        let mut by_session: HashMap<SessionId, Vec<usize>> = HashMap::new();
        for r in trace.iter() {
            by_session.entry(r.session).or_default().push(r.index);
        }
        for idxs in by_session.values_mut() {
            idxs.sort_by_key(|&i| (trace.requests[i].turn, i));
            for w in idxs.windows(2) {
                links[w[1]].0 = Some(w[0]);
                links[w[0]].1 = true;
            }
        }
        TraceArrivals {
            trace,
            next: 0,
            links,
        }
    }

    /// Whether every session's turns come in trace order (then a summary built as records
    /// come in trace order sees each session's turns in turn order).
    pub fn turns_in_trace_order(&self) -> bool {
        self.links
            .iter()
            .enumerate()
            .all(|(i, (after, _))| after.is_none_or(|a| a < i))
    }
}

impl RequestSource for TraceArrivals<'_> {
    fn block_size(&self) -> BlockSize {
        self.trace.block_size()
    }

    fn next_arrival(&mut self) -> Result<Option<Arrival>, SourceError> {
        let Some(r) = self.trace.requests.get(self.next) else {
            return Ok(None);
        };
        let (after, may_continue) = self.links[self.next];
        self.next += 1;
        Ok(Some(Arrival {
            request: r.clone(),
            after,
            may_continue,
        }))
    }

    fn fraction_read(&self) -> Option<f64> {
        Some(self.next as f64 / self.trace.len().max(1) as f64)
    }
}

/// Where a session's last turn read stands.
#[derive(Debug, Clone, Copy)]
struct SessionCursor {
    index: usize,
    turn: TurnId,
    /// Requests of the session so far.
    count: u32,
}

/// A trace file read line by line (see the module docs).
pub struct TraceStream<R> {
    reader: R,
    name: String,
    opts: LoadOptions,
    report: LoadReport,
    buf: Vec<u8>,
    ids: Vec<BlockHash>,
    /// Timestamp and line of the last request read.
    last: Option<(u64, usize)>,
    /// Whether the requests carry session ids (known from the first one).
    explicit: Option<bool>,
    cursors: HashMap<SessionId, SessionCursor>,
    inference: Option<SessionInference>,
    next_index: usize,
    bytes_read: u64,
    total_bytes: Option<u64>,
}

impl<R> std::fmt::Debug for TraceStream<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceStream")
            .field("name", &self.name)
            .field("requests", &self.next_index)
            .finish_non_exhaustive()
    }
}

impl TraceStream<BufReader<File>> {
    /// Opens a trace file for streaming.
    pub fn open(path: &Path, opts: &LoadOptions) -> Result<Self, TraceError> {
        let io = |source| TraceError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let total = file.metadata().map_err(io)?.len();
        let mut s = TraceStream::new(
            BufReader::with_capacity(1 << 20, file),
            &path.display().to_string(),
            opts,
        );
        s.total_bytes = Some(total);
        Ok(s)
    }
}

impl<R: BufRead> TraceStream<R> {
    /// Streams a trace from a reader; `source_name` names it in errors.
    pub fn new(reader: R, source_name: &str, opts: &LoadOptions) -> Self {
        TraceStream {
            reader,
            name: source_name.to_owned(),
            opts: *opts,
            report: LoadReport::default(),
            buf: Vec::with_capacity(64 * 1024),
            ids: Vec::new(),
            last: None,
            explicit: None,
            cursors: HashMap::new(),
            inference: opts
                .infer_sessions
                .then(|| SessionInference::new(opts.block_size)),
            next_index: 0,
            bytes_read: 0,
            total_bytes: None,
        }
    }

    /// What was read so far (lines, requests, skipped lines and their first errors).
    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// Sessions seen so far.
    pub fn sessions(&self) -> usize {
        match (&self.inference, self.explicit) {
            (_, Some(true)) => self.cursors.len(),
            (Some(inf), _) => inf.sessions() as usize,
            _ => self.next_index,
        }
    }

    fn whole(&self, line: usize, why: String) -> SourceError {
        SourceError::NeedsWholeTrace {
            file: self.name.clone(),
            line,
            why,
        }
    }

    /// The next valid line, `None` at the end of the file.
    fn next_line(&mut self) -> Result<Option<LineRecord>, TraceError> {
        loop {
            self.buf.clear();
            let n = self
                .reader
                .read_until(b'\n', &mut self.buf)
                .map_err(|source| TraceError::Io {
                    path: self.name.clone().into(),
                    source,
                })?;
            if n == 0 {
                return Ok(None);
            }
            self.bytes_read += n as u64;
            self.report.lines += 1;
            let mut text = self.buf.trim_ascii();
            if self.report.lines == 1 {
                text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
            }
            if text.is_empty() {
                self.report.blank += 1;
                continue;
            }
            self.ids.clear();
            match record::parse_line(
                text,
                &self.name,
                self.report.lines,
                self.opts.block_size,
                &mut self.ids,
            ) {
                Ok(l) => return Ok(Some(l)),
                Err(e) => self.report.skip_or_fail(e, &self.opts)?,
            }
        }
    }
}

impl<R: BufRead> RequestSource for TraceStream<R> {
    fn block_size(&self) -> BlockSize {
        self.opts.block_size
    }

    fn next_arrival(&mut self) -> Result<Option<Arrival>, SourceError> {
        let Some(l) = self.next_line()? else {
            if self.next_index == 0 {
                return Err(TraceError::Empty {
                    file: self.name.clone(),
                }
                .into());
            }
            return Ok(None);
        };
        if let Some((t, line)) = self.last
            && l.timestamp_ms < t
        {
            return Err(self.whole(
                l.line,
                format!(
                    "timestamp {} ms is earlier than line {line}'s {t} ms (the trace is not \
                     sorted by time)",
                    l.timestamp_ms
                ),
            ));
        }
        let explicit = l.session_id.is_some();
        if self.explicit.is_some_and(|e| e != explicit) {
            return Err(self.whole(
                l.line,
                "the trace mixes requests with and without session_id".to_owned(),
            ));
        }
        self.explicit = Some(explicit);
        let list = &self.ids[l.ids_start..l.ids_start + l.ids_len];
        let index = self.next_index;
        let (session, cursor) = match (l.session_id, &mut self.inference) {
            (Some(s), _) => (s, self.cursors.get(&s).copied()),
            (None, Some(inf)) => {
                let s = SessionId(inf.push(list, l.input_length));
                (s, self.cursors.get(&s).copied())
            }
            // Each request its own session, numbered by its line.
            (None, None) => (SessionId(l.line as u64 - 1), None),
        };
        let count = cursor.map_or(1, |c| c.count.saturating_add(1));
        let turn = l.turn_id.unwrap_or(TurnId(count));
        if let Some(c) = cursor
            && turn <= c.turn
        {
            return Err(self.whole(
                l.line,
                format!(
                    "turn {} of session {} comes after its turn {} (a session's turns must \
                     come in increasing order)",
                    turn.0, session.0, c.turn.0
                ),
            ));
        }
        let may_continue = l.session_id.is_some() || self.inference.is_some();
        if may_continue {
            self.cursors
                .insert(session, SessionCursor { index, turn, count });
        }
        self.last = Some((l.timestamp_ms, l.line));
        self.next_index += 1;
        self.report.records += 1;
        Ok(Some(Arrival {
            request: TraceRequest {
                index,
                timestamp_ms: l.timestamp_ms,
                session,
                turn,
                parent_session: l.parent_session_id,
                session_final: l.session_final,
                input_length: l.input_length,
                output_length: l.output_length,
                hash_ids: HashIds::from(list.to_vec()),
            },
            after: cursor.map(|c| c.index),
            may_continue,
        }))
    }

    fn fraction_read(&self) -> Option<f64> {
        self.total_bytes
            .map(|t| (self.bytes_read as f64 / t.max(1) as f64).min(1.0))
    }
}

/// Reads a whole source into requests (for tests and tools that want a stream's view).
pub fn collect(source: &mut dyn RequestSource) -> Result<Vec<Arrival>, SourceError> {
    let mut out = Vec::new();
    while let Some(a) = source.next_arrival()? {
        out.push(a);
    }
    Ok(out)
}
