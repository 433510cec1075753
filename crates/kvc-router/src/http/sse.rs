//! Reading a relayed answer stream: the generated-token count its events report, and the SSE
//! error event that ends a client's stream when the worker failed mid-stream.

use super::attempt::completion_tokens;
use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::json;

/// Finds the generated-token count in a streamed answer: the last `data:` line (SSE) or line
/// of JSON that carries `meta_info.completion_tokens` or `usage.completion_tokens`.
#[derive(Debug, Default)]
pub(super) struct CompletionScan {
    line: Vec<u8>,
    overflow: bool,
    tokens: Option<u64>,
}

impl CompletionScan {
    /// Longest line examined; longer ones are skipped.
    pub(super) const MAX_LINE: usize = 1 << 20;

    /// Scans the next piece of the stream (lines may be split across pieces).
    pub(super) fn feed(&mut self, bytes: &[u8]) {
        for part in bytes.split_inclusive(|b| *b == b'\n') {
            if self.line.len() + part.len() > Self::MAX_LINE {
                self.overflow = true;
                self.line.clear();
            } else {
                self.line.extend_from_slice(part);
            }
            if part.ends_with(b"\n") {
                self.end_line();
            }
        }
    }

    fn end_line(&mut self) {
        if !self.overflow {
            let line = self.line.trim_ascii();
            let json = line.strip_prefix(b"data:").unwrap_or(line).trim_ascii();
            if let Some(n) = completion_tokens(json) {
                self.tokens = Some(n);
            }
        }
        self.line.clear();
        self.overflow = false;
    }

    /// The last count seen, the final line (without its line end) included.
    pub(super) fn finish(mut self) -> Option<u64> {
        self.end_line();
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
    Bytes::from(format!("{lead}data: {event}\n\n"))
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
        scan.feed(b"{\"usage\": {\"completion_tokens\": 7}}");
        assert_eq!(scan.finish(), Some(7), "a final line without its line end");
        let mut scan = CompletionScan::default();
        scan.feed(&vec![b'x'; CompletionScan::MAX_LINE + 1]);
        scan.feed(b"{\"usage\": {\"completion_tokens\": 9}}\n");
        assert_eq!(scan.finish(), None, "an over-long line is skipped whole");
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
