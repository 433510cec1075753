//! Reading a relayed answer stream: the generated-token count its events report, and the SSE
//! error event that ends a client's stream when the worker failed mid-stream.

use super::attempt::completion_tokens;
use axum::body::Bytes;
use axum::http::StatusCode;
use kvc_core::sse::{self, SseEvent, SseScanner};
use serde_json::json;

/// Finds the generated-token count in a streamed answer: the last SSE event whose data
/// carries `meta_info.completion_tokens` or `usage.completion_tokens`. The events are read by
/// the workspace's one SSE scanner ([`kvc_core::sse`]).
#[derive(Debug)]
pub(super) struct CompletionScan {
    events: SseScanner,
    tokens: Option<u64>,
}

impl Default for CompletionScan {
    fn default() -> Self {
        CompletionScan {
            events: SseScanner::with_max_event_bytes(Self::MAX_EVENT),
            tokens: None,
        }
    }
}

impl CompletionScan {
    /// Largest event examined; longer ones are skipped whole.
    pub(super) const MAX_EVENT: usize = 1 << 20;

    /// Scans the next piece of the stream (events may be split across pieces).
    pub(super) fn feed(&mut self, bytes: &[u8]) {
        for event in self.events.feed(bytes) {
            self.read(event);
        }
    }

    /// Whether the stream so far stops inside an event (an error event must close it first).
    pub(super) fn in_event(&self) -> bool {
        self.events.in_event()
    }

    fn read(&mut self, event: SseEvent) {
        if let SseEvent::Data(data) = event
            && let Some(n) = completion_tokens(data.trim_ascii())
        {
            self.tokens = Some(n);
        }
    }

    /// The last count seen, an event the stream did not close included.
    pub(super) fn finish(mut self) -> Option<u64> {
        if let Some(event) = self.events.finish() {
            self.read(event);
        }
        self.tokens
    }
}

/// The SSE event that ends a client's stream when the worker failed mid-stream; after a cut
/// event (`after_partial_event`) that event is closed first.
pub(super) fn sse_error_event(message: &str, after_partial_event: bool) -> Bytes {
    let event = json!({ "error": {
        "message": message,
        "type": "worker_error",
        "code": StatusCode::BAD_GATEWAY.as_u16(),
    } });
    let lead = if after_partial_event { "\n\n" } else { "" };
    Bytes::from(format!("{lead}{}", sse::event(&event.to_string())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn completion_tokens_are_found_in_split_sse_events() {
        let mut scan = CompletionScan::default();
        scan.feed(b"data: {\"meta_info\": {\"completion_");
        scan.feed(b"tokens\": 3}}\n\ndata: {\"usage\": {\"completion_tokens\": 5}}\n");
        scan.feed(b"\ndata: {\"text\": \"no count\"}\n\ndata: [DONE]\n\n");
        assert_eq!(scan.finish(), Some(5), "the last count seen");
        let mut scan = CompletionScan::default();
        scan.feed(b"data: {\"usage\": {\"completion_tokens\": 7}}");
        assert!(scan.in_event(), "the stream stops inside an event");
        assert_eq!(
            scan.finish(),
            Some(7),
            "a final event without its blank line"
        );
        let mut scan = CompletionScan::default();
        let mut long = b"data: ".to_vec();
        long.extend(vec![b'x'; CompletionScan::MAX_EVENT + 1]);
        scan.feed(&long);
        scan.feed(b"\n\ndata: {\"usage\": {\"completion_tokens\": 9}}\r\n\r\n");
        assert!(!scan.in_event());
        assert_eq!(
            scan.finish(),
            Some(9),
            "an over-long event is skipped whole, the next read"
        );
        assert_eq!(CompletionScan::default().finish(), None);
    }

    #[test]
    fn sse_error_events_are_well_formed() {
        let e = sse_error_event("decode worker: gone", false);
        let text = std::str::from_utf8(&e).unwrap();
        let json = text
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        let v: Value = serde_json::from_str(json).unwrap();
        assert_eq!(v["error"]["message"], "decode worker: gone");
        assert_eq!(v["error"]["type"], "worker_error");
        assert_eq!(v["error"]["code"], 502);
        let after = sse_error_event("x", true);
        assert!(
            after.starts_with(b"\n\ndata: "),
            "a cut event is closed first"
        );
    }
}
