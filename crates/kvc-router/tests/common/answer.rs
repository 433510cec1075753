//! An HTTP/1.1 answer read off the wire, shared by the router's HTTP tests and the
//! cross-process tests (`tests/tests/common/http.rs` includes this file): the request head
//! both send, and the answer's status, headers and body (chunked encoding removed).

use serde_json::Value;
use std::collections::HashMap;

/// An HTTP answer: status, headers (lower-case names), body (chunked encoding removed).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: String,
}

impl Answer {
    /// Parses a whole answer as read from the connection; a chunked body is de-chunked.
    pub fn parse(raw: &str) -> Answer {
        let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok())
            .expect("a status line");
        let headers: HashMap<String, String> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let chunked = headers
            .get("transfer-encoding")
            .is_some_and(|v| v.contains("chunked"));
        let body = if chunked {
            dechunk(body)
        } else {
            body.to_owned()
        };
        Answer {
            status,
            headers,
            body,
        }
    }

    /// The header `name` (lower case); panics when the answer has none.
    pub fn header(&self, name: &str) -> &str {
        self.find_header(name)
            .unwrap_or_else(|| panic!("no {name} in {:?}", self.headers))
    }

    /// The header `name` (lower case), if the answer has it.
    pub fn find_header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The body as JSON; panics (showing the status and body) when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("{} is not JSON ({e}): {:?}", self.status, self.body))
    }

    /// The `data:` events of a Server-Sent Events body, `[DONE]` last.
    pub fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }
}

/// The head of a request that closes its connection after the answer: `method path`, `host`,
/// and, with a body (`body_len` bytes), a JSON content type and its length; then `headers`.
pub fn request_head(
    method: &str,
    path: &str,
    host: &str,
    headers: &[(&str, &str)],
    body_len: Option<usize>,
) -> String {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    if let Some(n) = body_len {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {n}\r\n"
        ));
    }
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head
}

/// A chunked body's content.
fn dechunk(mut raw: &str) -> String {
    let mut out = String::new();
    loop {
        let Some((size, rest)) = raw.split_once("\r\n") else {
            return out;
        };
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        raw = &rest[n + 2..];
    }
}
