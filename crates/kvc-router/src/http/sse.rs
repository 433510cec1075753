//! Reading a relayed answer stream: the generated-token and cached-token counts its events
//! report, the removal of usage-only chunks the client did not ask for, and the SSE error
//! event that ends a client's stream when the worker failed mid-stream.

use super::attempt::{cached_tokens_of, completion_tokens};
use super::request::Api;
use super::responses::anthropic_error_body;
use axum::body::Bytes;
use axum::http::StatusCode;
use kvc_core::sse::{self, SseEvent, SseScanner};
use serde_json::{Value, json};

/// Finds the generated-token count in a streamed answer: the last SSE event whose data
/// carries `meta_info.completion_tokens` or `usage.completion_tokens`. The events are read by
/// the workspace's one SSE scanner ([`kvc_core::sse`]).
#[derive(Debug)]
pub(crate) struct CompletionScan {
    events: SseScanner,
    tokens: Option<u64>,
    cached: Option<u64>,
    /// The stream's closing event was seen ([`CompletionScan::ended`]).
    ended: bool,
}

/// What a finished [`CompletionScan`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScanEnd {
    /// The last generated-token count seen.
    pub(crate) completion: Option<u64>,
    /// The last cached-prompt-token count seen (vLLM's final usage chunk).
    pub(crate) cached: Option<u64>,
}

impl Default for CompletionScan {
    fn default() -> Self {
        CompletionScan {
            events: SseScanner::with_max_event_bytes(Self::MAX_EVENT),
            tokens: None,
            cached: None,
            ended: false,
        }
    }
}

impl CompletionScan {
    /// Largest event examined; longer ones are skipped whole.
    pub(super) const MAX_EVENT: usize = 1 << 20;

    /// Scans the next piece of the stream (events may be split across pieces).
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        for event in self.events.feed(bytes) {
            self.read(event);
        }
    }

    /// Whether the stream so far stops inside an event (an error event must close it first).
    pub(super) fn in_event(&self) -> bool {
        self.events.in_event()
    }

    /// Whether the stream's closing event has been fed: OpenAI's and SGLang's `[DONE]`, a
    /// Messages stream's `message_stop`, a Responses stream's `response.completed`. A client
    /// may send its next request as soon as it reads it, before the stream itself ends.
    pub(super) fn ended(&self) -> bool {
        self.ended
    }

    /// The counts seen so far.
    pub(super) fn so_far(&self) -> ScanEnd {
        ScanEnd {
            completion: self.tokens,
            cached: self.cached,
        }
    }

    fn read(&mut self, event: SseEvent) {
        let data = match event {
            SseEvent::Done => {
                self.ended = true;
                return;
            }
            SseEvent::Data(data) => data,
        };
        if closing_event(data.trim_ascii()) {
            self.ended = true;
        }
        if let Some(n) = completion_tokens(data.trim_ascii()) {
            self.tokens = Some(n);
            if let Ok(v) = serde_json::from_slice::<Value>(data.trim_ascii())
                && let Some(c) = cached_tokens_of(&v)
            {
                self.cached = Some(c);
            }
        }
    }

    /// The last counts seen, an event the stream did not close included.
    pub(crate) fn finish(mut self) -> ScanEnd {
        if let Some(event) = self.events.finish() {
            self.read(event);
        }
        ScanEnd {
            completion: self.tokens,
            cached: self.cached,
        }
    }
}

/// Whether an event's data is the last event of a Messages (`message_stop`) or Responses
/// (`response.completed`) stream: its `type`, parsed only from events that name one of them.
fn closing_event(data: &[u8]) -> bool {
    const TYPES: [&str; 2] = ["message_stop", "response.completed"];
    let names = |t: &str| data.windows(t.len()).any(|w| w == t.as_bytes());
    if !TYPES.iter().any(|t| names(t)) {
        return false;
    }
    serde_json::from_slice::<Value>(data)
        .ok()
        .and_then(|v| v.get("type").and_then(Value::as_str).map(str::to_owned))
        .is_some_and(|t| TYPES.contains(&t.as_str()))
}

/// Removes usage-only chunks (`"choices": []` with a `usage`, what vLLM sends last when
/// `stream_options.include_usage` is on) from a relayed stream, re-framing every other event
/// as `data: ...` (vLLM writes no other SSE field). Used when the router asked for the usage
/// and the client did not.
#[derive(Debug)]
pub(crate) struct UsageFilter {
    events: SseScanner,
}

impl Default for UsageFilter {
    fn default() -> Self {
        UsageFilter {
            events: SseScanner::with_max_event_bytes(CompletionScan::MAX_EVENT),
        }
    }
}

/// Whether an event's data is a usage-only chunk.
fn usage_only(data: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(data.trim_ascii()) else {
        return false;
    };
    v.get("usage").is_some_and(|u| !u.is_null())
        && v.get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty)
}

impl UsageFilter {
    fn frame(out: &mut Vec<u8>, event: SseEvent) {
        match event {
            SseEvent::Done => out.extend_from_slice(sse::DONE_EVENT.as_bytes()),
            SseEvent::Data(data) if !usage_only(&data) => {
                out.extend_from_slice(sse::event(&String::from_utf8_lossy(&data)).as_bytes());
            }
            SseEvent::Data(_) => {}
        }
    }

    /// The client's bytes for the next piece of D's stream (empty while an event is
    /// incomplete, or when it held only a usage chunk).
    pub(crate) fn feed(&mut self, piece: &[u8]) -> Bytes {
        let mut out = Vec::new();
        for event in self.events.feed(piece) {
            Self::frame(&mut out, event);
        }
        Bytes::from(out)
    }

    /// The client's bytes for an event D's stream ended inside of.
    pub(crate) fn finish(&mut self) -> Bytes {
        let mut out = Vec::new();
        if let Some(event) = self.events.finish() {
            Self::frame(&mut out, event);
        }
        Bytes::from(out)
    }
}

/// The SSE event that ends a client's stream of `api` when the worker failed mid-stream, in
/// that API's shape: OpenAI's `data: {"error": {...}}`; for Messages an `error` event
/// (`{"type": "error", "error": {"type": "api_error", ...}}`), for Responses an `error` event
/// (`{"type": "error", "code", "message"}`). After a cut event (`after_partial_event`) that
/// event is closed first.
pub(super) fn sse_error_event(api: Api, message: &str, after_partial_event: bool) -> Bytes {
    let lead = if after_partial_event { "\n\n" } else { "" };
    let event = match api {
        Api::Messages => format!(
            "event: error\n{}",
            sse::event(&anthropic_error_body(StatusCode::BAD_GATEWAY, message).to_string())
        ),
        Api::Responses => format!(
            "event: error\n{}",
            sse::event(
                &json!({ "type": "error", "code": "worker_error", "message": message,
                         "param": null })
                .to_string()
            )
        ),
        Api::Generate | Api::Completions | Api::ChatCompletions => sse::event(
            &json!({ "error": {
                "message": message,
                "type": "worker_error",
                "code": StatusCode::BAD_GATEWAY.as_u16(),
            } })
            .to_string(),
        ),
    };
    Bytes::from(format!("{lead}{event}"))
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
        assert_eq!(scan.finish().completion, Some(5), "the last count seen");
        let mut scan = CompletionScan::default();
        scan.feed(b"data: {\"usage\": {\"completion_tokens\": 7}}");
        assert!(scan.in_event(), "the stream stops inside an event");
        assert_eq!(
            scan.finish().completion,
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
            scan.finish().completion,
            Some(9),
            "an over-long event is skipped whole, the next read"
        );
        assert_eq!(CompletionScan::default().finish().completion, None);
        let mut scan = CompletionScan::default();
        scan.feed(b"data: {\"choices\": [], \"usage\": {\"completion_tokens\": 4, ");
        scan.feed(b"\"prompt_tokens_details\": {\"cached_tokens\": 48}}}\n\ndata: [DONE]\n\n");
        assert_eq!(
            scan.finish(),
            ScanEnd {
                completion: Some(4),
                cached: Some(48)
            }
        );
    }

    #[test]
    fn usage_only_chunks_are_removed_and_the_rest_kept() {
        let mut f = UsageFilter::default();
        let text = b"data: {\"choices\": [{\"text\": \"a\"}]}\n\ndata: {\"choices\": [], ";
        assert_eq!(
            &f.feed(text)[..],
            b"data: {\"choices\": [{\"text\": \"a\"}]}\n\n"
        );
        let rest = b"\"usage\": {\"completion_tokens\": 2}}\n\ndata: [DONE]\n\n";
        assert_eq!(&f.feed(rest)[..], b"data: [DONE]\n\n");
        // A usage that rides on a chunk with choices is kept (the client's own request).
        let mut f = UsageFilter::default();
        let both = b"data: {\"choices\": [{\"text\": \"b\"}], \"usage\": null}";
        assert!(f.feed(both).is_empty(), "the event is not closed yet");
        assert_eq!(
            &f.finish()[..],
            b"data: {\"choices\": [{\"text\": \"b\"}], \"usage\": null}\n\n"
        );
    }

    #[test]
    fn sse_error_events_are_well_formed() {
        let e = sse_error_event(Api::ChatCompletions, "decode worker: gone", false);
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
        let after = sse_error_event(Api::Completions, "x", true);
        assert!(
            after.starts_with(b"\n\ndata: "),
            "a cut event is closed first"
        );
        // The agents' APIs: an `error` event in each one's shape.
        let data_of = |b: Bytes| -> Value {
            let text = String::from_utf8(b.to_vec()).unwrap();
            let data = text
                .strip_prefix("event: error\ndata: ")
                .and_then(|t| t.strip_suffix("\n\n"))
                .unwrap_or_else(|| panic!("not an error event: {text:?}"))
                .to_owned();
            serde_json::from_str(&data).unwrap()
        };
        let m = data_of(sse_error_event(Api::Messages, "gone", false));
        assert_eq!(
            m,
            serde_json::json!({"type": "error", "error": {"type": "api_error", "message": "gone"}})
        );
        let r = data_of(sse_error_event(Api::Responses, "gone", false));
        assert_eq!(
            (r["type"].as_str(), r["message"].as_str()),
            (Some("error"), Some("gone"))
        );
        assert!(sse_error_event(Api::Messages, "x", true).starts_with(b"\n\nevent: error\n"));
    }
}
