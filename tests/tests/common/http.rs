//! A plain blocking HTTP/1.1 client for the cross-process tests: one connection per call,
//! the whole answer read and parsed by the router tests' own `Answer`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

#[path = "../../../crates/kvc-router/tests/common/answer.rs"]
mod answer;

pub use answer::{Answer, request_head};

/// POSTs `body` to `http://addr{path}` with `headers`; one connection per call.
pub fn post(addr: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    post_within(addr, path, headers, body, Duration::from_secs(60))
}

/// [`post`] with a read deadline of `timeout`.
pub fn post_within(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    timeout: Duration,
) -> Answer {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(timeout)).unwrap();
    let head = request_head("POST", path, addr, headers, Some(body.len()));
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    Answer::parse(&raw)
}
