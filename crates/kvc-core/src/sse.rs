//! Server-Sent Events: an incremental scanner that turns a byte stream into events' `data`,
//! and the framing of the events a server writes.
//!
//! The scanner follows the SSE wire format (`text/event-stream`): lines end with `\n`, `\r\n`
//! or `\r`; a blank line ends an event; an event's `data` is its `data:` lines (one leading
//! space dropped) joined by `\n`; comment lines (`:`…) and other fields (`event:`, `id:`,
//! `retry:`) are skipped. It holds no more than the unfinished event, so chunks may split an
//! event, a line or a `\r\n` anywhere: the events are the same however the stream is cut.
//!
//! Two departures, both for streams of LLM servers:
//! - the `data: [DONE]` sentinel that ends OpenAI-style and SGLang streams is its own event,
//!   [`SseEvent::Done`];
//! - [`SseScanner::finish`] (end of stream) yields an event the server did not end with its
//!   blank line, where the standard drops it: a final `[DONE]` or error is still seen.
//!
//! An event over the scanner's size limit is skipped whole and counted, never cut.
//!
//! ```
//! use kvc_core::sse::{SseEvent, SseScanner};
//!
//! let mut scan = SseScanner::new();
//! let mut events = scan.feed(b"data: {\"text\": \"a\"}\n\nda");
//! events.extend(scan.feed(b"ta: [DONE]\r\n\r\n"));
//! assert_eq!(
//!     events,
//!     vec![SseEvent::Data(b"{\"text\": \"a\"}".to_vec()), SseEvent::Done]
//! );
//! assert_eq!(scan.finish(), None);
//! ```

use std::fmt::Write as _;

/// Largest event [`SseScanner::new`] assembles, in bytes (its lines as received).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 8 << 20;

/// The `data` of the sentinel event that ends an OpenAI-style or SGLang stream.
pub const DONE_DATA: &str = "[DONE]";

/// The sentinel event, framed: what a server writes last.
pub const DONE_EVENT: &str = "data: [DONE]\n\n";

/// One event of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseEvent {
    /// An event's data: its `data:` lines joined by `\n`, bytes as received.
    Data(Vec<u8>),
    /// The `[DONE]` sentinel (its data, spaces around it ignored).
    Done,
}

impl SseEvent {
    fn of(data: Vec<u8>) -> SseEvent {
        if data.trim_ascii() == DONE_DATA.as_bytes() {
            SseEvent::Done
        } else {
            SseEvent::Data(data)
        }
    }
}

/// Scans a byte stream, fed in chunks as they arrive, into [`SseEvent`]s.
#[derive(Debug, Clone)]
pub struct SseScanner {
    /// The current line, without its line end (empty while the event is oversized).
    line: Vec<u8>,
    /// Bytes of the current line received so far, kept or not: 0 means a blank line.
    line_bytes: usize,
    /// The current event's data so far.
    data: Vec<u8>,
    /// The current event has a `data:` line (an event of one empty `data:` line is an event).
    has_data: bool,
    /// The last chunk ended with `\r`: a `\n` starting the next one ends no second line.
    after_cr: bool,
    /// The current event went over the limit: its bytes are dropped up to its blank line.
    oversized: bool,
    /// Bytes of the current event received so far (its lines, without line ends).
    event_bytes: usize,
    max_event_bytes: usize,
    skipped: u64,
}

impl Default for SseScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl SseScanner {
    /// A scanner of events up to [`DEFAULT_MAX_EVENT_BYTES`].
    pub fn new() -> Self {
        Self::with_max_event_bytes(DEFAULT_MAX_EVENT_BYTES)
    }

    /// A scanner that skips events of more than `max_event_bytes` (counted as their lines
    /// arrive, line ends excluded).
    pub fn with_max_event_bytes(max_event_bytes: usize) -> Self {
        SseScanner {
            line: Vec::new(),
            line_bytes: 0,
            data: Vec::new(),
            has_data: false,
            after_cr: false,
            oversized: false,
            event_bytes: 0,
            max_event_bytes,
            skipped: 0,
        }
    }

    /// Events skipped whole because they were over the size limit.
    pub fn oversized_events(&self) -> u64 {
        self.skipped
    }

    /// The stream so far ends inside an event: a line, or lines not yet ended by their blank
    /// line. A writer cutting the stream short closes the event first (`\n\n`) so what it
    /// appends is an event of its own.
    pub fn in_event(&self) -> bool {
        self.event_bytes > 0
    }

    /// Scans the next chunk of the stream; returns the events it completed, in order.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        let mut events = Vec::new();
        let mut rest = chunk;
        if rest.is_empty() {
            return events;
        }
        if std::mem::take(&mut self.after_cr) && rest[0] == b'\n' {
            rest = &rest[1..];
        }
        while let Some(end) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.take_line_bytes(&rest[..end]);
            let cr = rest[end] == b'\r';
            rest = &rest[end + 1..];
            if cr {
                match rest.first() {
                    Some(b'\n') => rest = &rest[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            if let Some(event) = self.end_line() {
                events.push(event);
            }
        }
        self.take_line_bytes(rest);
        events
    }

    /// The stream ended: the event it did not end with a blank line, if any. The scanner is
    /// then ready for a new stream.
    pub fn finish(&mut self) -> Option<SseEvent> {
        if self.line_bytes > 0 {
            // A last line without its line end; a non-blank line ends no event.
            let _ = self.end_line();
        }
        self.after_cr = false;
        self.end_event()
    }

    fn take_line_bytes(&mut self, bytes: &[u8]) {
        self.line_bytes += bytes.len();
        self.event_bytes = self.event_bytes.saturating_add(bytes.len());
        if self.oversized {
            return;
        }
        if self.event_bytes > self.max_event_bytes {
            self.oversized = true;
            self.line = Vec::new();
            self.data = Vec::new();
            return;
        }
        self.line.extend_from_slice(bytes);
    }

    /// A line ended: a blank line ends the event, a `data:` line adds to it.
    fn end_line(&mut self) -> Option<SseEvent> {
        let blank = self.line_bytes == 0;
        self.line_bytes = 0;
        if blank {
            return self.end_event();
        }
        let line = std::mem::take(&mut self.line);
        if self.oversized {
            return None;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => (&line[..colon], &line[colon + 1..]),
            None => (&line[..], &[][..]),
        };
        if field == b"data" {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        // Keep the buffer's room for the next line.
        self.line = line;
        self.line.clear();
        None
    }

    fn end_event(&mut self) -> Option<SseEvent> {
        let has_data = std::mem::take(&mut self.has_data);
        self.event_bytes = 0;
        if std::mem::take(&mut self.oversized) {
            self.skipped += 1;
            return None;
        }
        has_data.then(|| SseEvent::of(std::mem::take(&mut self.data)))
    }
}

/// The bytes of one event carrying `data`: one `data:` line per line of `data` (a `\r\n`,
/// `\n` or `\r` in it starts a new one), then the blank line. [`SseScanner`] reads back
/// `data` with its line ends as `\n`.
///
/// ```
/// assert_eq!(kvc_core::sse::event("{\"text\": \"a\"}"), "data: {\"text\": \"a\"}\n\n");
/// assert_eq!(kvc_core::sse::event("a\nb"), "data: a\ndata: b\n\n");
/// ```
pub fn event(data: &str) -> String {
    let mut out = String::with_capacity(data.len() + 8);
    let mut rest = data;
    loop {
        let end = rest.find(['\r', '\n']).unwrap_or(rest.len());
        let _ = writeln!(out, "data: {}", &rest[..end]);
        if end == rest.len() {
            break;
        }
        let skip = if rest[end..].starts_with("\r\n") {
            2
        } else {
            1
        };
        rest = &rest[end + skip..];
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(s: &str) -> SseEvent {
        SseEvent::Data(s.as_bytes().to_vec())
    }

    /// Every event a new scanner finds in `chunks`, the one left at the end included.
    fn scan_all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut scan = SseScanner::new();
        let mut events: Vec<SseEvent> = chunks.iter().flat_map(|c| scan.feed(c)).collect();
        events.extend(scan.finish());
        events
    }

    #[test]
    fn events_end_at_blank_lines_of_any_line_end() {
        assert_eq!(
            scan_all(&[b"data: a\n\ndata: b\r\n\r\ndata: c\r\rdata: [DONE]\n\n"]),
            vec![data("a"), data("b"), data("c"), SseEvent::Done]
        );
    }

    #[test]
    fn an_event_split_anywhere_is_read_whole() {
        let mut scan = SseScanner::new();
        assert_eq!(scan.feed(b"data: {\"n\""), vec![]);
        assert_eq!(scan.feed(b": 1}\r"), vec![]);
        assert_eq!(
            scan.feed(b"\n"),
            vec![],
            "the \\n of a split \\r\\n ends no line"
        );
        assert_eq!(
            scan.feed(b"\r"),
            vec![data("{\"n\": 1}")],
            "a lone \\r ends a line"
        );
        assert_eq!(scan.feed(b"\ndata: [DO"), vec![]);
        assert_eq!(scan.feed(b"NE]\n\n"), vec![SseEvent::Done]);
        assert_eq!(scan.finish(), None);
    }

    #[test]
    fn multi_line_data_comments_and_other_fields() {
        assert_eq!(
            scan_all(&[
                b": keep-alive\n\nevent: message\nid: 7\ndata: one\ndata:two\nretry: 5\n\n"
            ]),
            vec![data("one\ntwo")],
            "a comment alone is no event"
        );
        assert_eq!(scan_all(&[b"data\n\ndata:\n\n"]), vec![data(""), data("")]);
        assert_eq!(
            scan_all(&[b"data:  two spaces\n\n"]),
            vec![data(" two spaces")],
            "one leading space is dropped"
        );
    }

    #[test]
    fn the_end_of_stream_yields_an_unfinished_event() {
        let mut scan = SseScanner::new();
        assert_eq!(scan.feed(b"data: {\"error\": \"gone\"}"), vec![]);
        assert_eq!(scan.finish(), Some(data("{\"error\": \"gone\"}")));
        assert_eq!(scan.finish(), None, "the scanner starts afresh");
        assert_eq!(scan.feed(b"data: [DONE]\n"), vec![]);
        assert_eq!(scan.finish(), Some(SseEvent::Done));
        assert_eq!(scan.feed(b"data: x\n\n"), vec![data("x")]);
    }

    #[test]
    fn a_stream_ends_inside_an_event_until_its_blank_line() {
        let mut scan = SseScanner::new();
        assert!(!scan.in_event());
        scan.feed(b"data: {\"a\"");
        assert!(scan.in_event(), "inside a line");
        scan.feed(b": 1}\r\n");
        assert!(scan.in_event(), "a line without its blank line");
        scan.feed(b"\r\n");
        assert!(!scan.in_event());
        scan.feed(b": comment\n");
        assert!(scan.in_event(), "a comment not yet ended");
        scan.feed(b"\n");
        assert!(!scan.in_event());
    }

    #[test]
    fn oversized_events_are_skipped_whole() {
        let mut scan = SseScanner::with_max_event_bytes(16);
        let mut events = scan.feed(b"data: 0123456789");
        events.extend(scan.feed(b"abcdef\ndata: more\n\ndata: ok\n\n"));
        assert_eq!(events, vec![data("ok")]);
        assert_eq!(scan.oversized_events(), 1);
        // The limit counts the whole event, not one line.
        let mut scan = SseScanner::with_max_event_bytes(16);
        assert_eq!(scan.feed(b"data: 12345\ndata: 12345\n\n"), vec![]);
        assert_eq!(scan.feed(b"data: 12345\n\n"), vec![data("12345")]);
        assert_eq!(scan.oversized_events(), 1);
    }

    #[test]
    fn framing_round_trips() {
        assert_eq!(event("x"), "data: x\n\n");
        assert_eq!(event(""), "data: \n\n");
        assert_eq!(event("a\r\nb\rc"), "data: a\ndata: b\ndata: c\n\n");
        let mut scan = SseScanner::new();
        let mut stream = event("{\"a\": 1}\n{\"b\": 2}");
        stream.push_str(DONE_EVENT);
        assert_eq!(
            scan.feed(stream.as_bytes()),
            vec![data("{\"a\": 1}\n{\"b\": 2}"), SseEvent::Done]
        );
    }

    /// One event of a generated stream: its data lines, whether to put a comment first, and
    /// the line end it is written with.
    fn stream_of(events: &[(Vec<String>, bool, u8)]) -> (Vec<u8>, Vec<SseEvent>) {
        let mut bytes = Vec::new();
        let mut expected = Vec::new();
        for (lines, comment, end) in events {
            let end: &[u8] = match end % 3 {
                0 => b"\n",
                1 => b"\r\n",
                _ => b"\r",
            };
            if *comment {
                bytes.extend_from_slice(b": comment");
                bytes.extend_from_slice(end);
            }
            for l in lines {
                bytes.extend_from_slice(b"data: ");
                bytes.extend_from_slice(l.as_bytes());
                bytes.extend_from_slice(end);
            }
            bytes.extend_from_slice(end);
            if !lines.is_empty() {
                let joined = lines.join("\n");
                expected.push(if joined.trim() == DONE_DATA {
                    SseEvent::Done
                } else {
                    SseEvent::Data(joined.into_bytes())
                });
            }
        }
        (bytes, expected)
    }

    proptest! {
        #[test]
        fn chunking_never_changes_the_events(
            events in proptest::collection::vec(
                (
                    proptest::collection::vec(
                        prop_oneof![Just("[DONE]".to_owned()), "[ -~]{0,12}"],
                        0..3,
                    ),
                    any::<bool>(),
                    0u8..3,
                ),
                0..8,
            ),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..12),
        ) {
            let (bytes, expected) = stream_of(&events);
            let mut whole = SseScanner::new();
            let mut got_whole = whole.feed(&bytes);
            got_whole.extend(whole.finish());
            prop_assert_eq!(&got_whole, &expected);

            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
            at.push(0);
            at.push(bytes.len());
            at.sort_unstable();
            let mut split = SseScanner::new();
            let mut got_split = Vec::new();
            for w in at.windows(2) {
                got_split.extend(split.feed(&bytes[w[0]..w[1]]));
            }
            got_split.extend(split.finish());
            prop_assert_eq!(got_split, expected);
        }

        #[test]
        fn framed_data_is_read_back(text in "[ -~\n]{0,40}") {
            let mut scan = SseScanner::new();
            let events = scan.feed(event(&text).as_bytes());
            let expected = if text.trim() == DONE_DATA {
                SseEvent::Done
            } else {
                SseEvent::Data(text.clone().into_bytes())
            };
            prop_assert_eq!(events, vec![expected]);
        }
    }
}
