//! A minimal HTTP/1.1 client for forwarding: one `POST` per connection (`Connection: close`),
//! a `Content-Length` request body, a whole-request deadline. Responses may carry a
//! `Content-Length` body, a chunked body, or a body delimited by the connection's end.
//! [`post_streaming`] returns once the response head has arrived and yields the body piece by
//! piece ([`WorkerStream::next_chunk`]) as the worker sends it.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest response accepted from a worker, in bytes.
pub const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// The response header with which a decode worker says its admission refused a request: a
/// `503` with `x-kvc-admission: rejected` (see [`WorkerResponse::is_admission_reject`]).
pub const ADMISSION_HEADER: &str = "x-kvc-admission";

/// Whether `status` and an [`ADMISSION_HEADER`] value say "refused by admission".
fn admission_reject(status: u16, admission: Option<&str>) -> bool {
    status == 503 && admission.is_some_and(|v| v.trim().eq_ignore_ascii_case("rejected"))
}

/// Why a forwarded request got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// The worker's base URL is not `http://host:port[/prefix]`.
    #[error("bad worker url `{0}`")]
    BadUrl(String),
    /// The connection could not be opened, or broke.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// No complete answer within the deadline.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The answer is not valid HTTP/1.1 (or is larger than [`MAX_RESPONSE_BYTES`]).
    #[error("bad response: {0}")]
    BadResponse(String),
}

/// A worker's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerResponse {
    /// HTTP status code.
    pub status: u16,
    /// The `Content-Type` header, if any.
    pub content_type: Option<String>,
    /// The [`ADMISSION_HEADER`] header, if any.
    pub admission: Option<String>,
    /// The body (de-chunked).
    pub body: Vec<u8>,
}

impl WorkerResponse {
    /// A `503` with `x-kvc-admission: rejected`: the worker's admission refused the request
    /// (no room, or the session is not resident there), which is not a worker failure.
    pub fn is_admission_reject(&self) -> bool {
        admission_reject(self.status, self.admission.as_deref())
    }
}

/// A parsed `http://host:port[/prefix]` base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// Port (80 when absent).
    pub port: u16,
    /// Path prefix without a trailing `/` (often empty).
    pub prefix: String,
}

impl BaseUrl {
    /// Parses `http://host[:port][/prefix]`; `https` is not supported.
    pub fn parse(url: &str) -> Result<BaseUrl, ForwardError> {
        let bad = || ForwardError::BadUrl(url.to_owned());
        let rest = url.strip_prefix("http://").ok_or_else(bad)?;
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or_else(bad)?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| bad())?,
                None if after.is_empty() => 80,
                None => return Err(bad()),
            };
            (host, port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, p.parse().map_err(|_| bad())?),
                None => (authority, 80),
            }
        };
        if host.is_empty() {
            return Err(bad());
        }
        Ok(BaseUrl {
            host: host.to_owned(),
            port,
            prefix: prefix.to_owned(),
        })
    }

    fn host_header(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// `POST`s `body` (JSON) to `base` + `path` and reads the whole answer, all within `timeout`.
pub async fn post_json(
    base: &BaseUrl,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<WorkerResponse, ForwardError> {
    post_json_with_headers(base, path, &[], body, timeout).await
}

/// [`post_json`] with extra request headers (`name`, `value`); a header whose name is not an
/// HTTP token, or whose value is not visible ASCII (spaces and tabs allowed), is not sent.
pub async fn post_json_with_headers(
    base: &BaseUrl,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<WorkerResponse, ForwardError> {
    tokio::time::timeout(timeout, request_inner(base, "POST", path, headers, body))
        .await
        .map_err(|_| ForwardError::Timeout(timeout))?
}

/// `GET`s `base` + `path` and reads the whole answer, all within `timeout`.
pub(super) async fn get(
    base: &BaseUrl,
    path: &str,
    timeout: Duration,
) -> Result<WorkerResponse, ForwardError> {
    tokio::time::timeout(timeout, request_inner(base, "GET", path, &[], &[]))
        .await
        .map_err(|_| ForwardError::Timeout(timeout))?
}

/// Whether `name: value` may go on the wire as one header line (a token name; a value of
/// visible ASCII, spaces and tabs).
fn sendable_header(name: &str, value: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
        && value
            .bytes()
            .all(|b| b == b'\t' || b == b' ' || b.is_ascii_graphic())
}

/// Opens a connection to `base` and sends the request.
async fn send_request(
    base: &BaseUrl,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<TcpStream, ForwardError> {
    let mut stream = TcpStream::connect((base.host.as_str(), base.port)).await?;
    let _ = stream.set_nodelay(true);
    let mut head = format!(
        "{method} {}{path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n",
        base.prefix,
        base.host_header(),
        body.len()
    );
    for (name, value) in headers {
        if sendable_header(name, value) {
            head.push_str(name);
            head.push_str(": ");
            head.push_str(value);
            head.push_str("\r\n");
        }
    }
    head.push_str("\r\n");
    let mut request = head.into_bytes();
    request.extend_from_slice(body);
    stream.write_all(&request).await?;
    Ok(stream)
}

async fn request_inner(
    base: &BaseUrl,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<WorkerResponse, ForwardError> {
    let mut stream = send_request(base, method, path, headers, body).await?;
    // Read until the answer is complete (by its length or its last chunk) or the worker
    // closes the connection, whichever comes first.
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return parse_response(&raw);
        }
        raw.extend_from_slice(&buf[..n]);
        if raw.len() > MAX_RESPONSE_BYTES {
            return Err(ForwardError::BadResponse(format!(
                "larger than {MAX_RESPONSE_BYTES} bytes"
            )));
        }
        if let Some(response) = parse_partial(&raw, false)? {
            return Ok(response);
        }
    }
}

/// Parses a complete HTTP/1.1 response read until the connection closed.
pub fn parse_response(raw: &[u8]) -> Result<WorkerResponse, ForwardError> {
    parse_partial(raw, true)?
        .ok_or_else(|| ForwardError::BadResponse("incomplete response".to_owned()))
}

/// Parses the response read so far: `None` while it is incomplete and more may come
/// (`at_eof` false); an error when it is malformed, or incomplete at the end of the stream.
fn parse_partial(raw: &[u8], at_eof: bool) -> Result<Option<WorkerResponse>, ForwardError> {
    let bad = |m: &str| ForwardError::BadResponse(m.to_owned());
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if at_eof {
            Err(bad("no end of headers"))
        } else {
            Ok(None)
        };
    };
    let rest = &raw[end + 4..];
    let Head {
        status,
        content_type,
        admission,
        content_length,
        chunked,
    } = parse_head(&raw[..end])?;
    let body = if chunked {
        match dechunk(rest)? {
            Some(body) => body,
            None if at_eof => return Err(bad("truncated chunk")),
            None => return Ok(None),
        }
    } else if let Some(n) = content_length {
        if rest.len() < n {
            return if at_eof {
                Err(bad("body shorter than content-length"))
            } else {
                Ok(None)
            };
        }
        rest[..n].to_vec()
    } else if at_eof {
        rest.to_vec()
    } else {
        return Ok(None);
    };
    Ok(Some(WorkerResponse {
        status,
        content_type,
        admission,
        body,
    }))
}

/// A response's status line and the headers that matter here.
struct Head {
    status: u16,
    content_type: Option<String>,
    admission: Option<String>,
    content_length: Option<usize>,
    chunked: bool,
}

/// Parses the response head (without its final blank line).
fn parse_head(head: &[u8]) -> Result<Head, ForwardError> {
    let bad = |m: &str| ForwardError::BadResponse(m.to_owned());
    let head = std::str::from_utf8(head).map_err(|_| bad("headers are not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    if !parts.next().is_some_and(|v| v.starts_with("HTTP/1.")) {
        return Err(bad("not an HTTP/1.x status line"));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .filter(|s| (100..1000).contains(s))
        .ok_or_else(|| bad("bad status code"))?;
    let mut content_type = None;
    let mut admission = None;
    let mut content_length = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(bad("bad header line"));
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-type") {
            content_type = Some(value.to_owned());
        } else if name.eq_ignore_ascii_case(ADMISSION_HEADER) {
            admission = Some(value.to_owned());
        } else if name.eq_ignore_ascii_case("content-length") {
            content_length = Some(
                value
                    .parse::<usize>()
                    .map_err(|_| bad("bad content-length"))?,
            );
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        }
    }
    Ok(Head {
        status,
        content_type,
        admission,
        content_length,
        chunked,
    })
}

/// How the rest of a streamed body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// This many bytes remain.
    Length(usize),
    /// Chunked: waiting for a chunk-size line.
    ChunkSize,
    /// Chunked: this many bytes of the current chunk remain.
    ChunkData(usize),
    /// Chunked: the line end after a chunk's data.
    ChunkEnd,
    /// Until the worker closes the connection.
    UntilClose,
    /// The body is complete.
    Done,
}

/// A worker's answer whose body is read as it arrives (see [`post_streaming`]).
#[derive(Debug)]
pub struct WorkerStream {
    /// HTTP status code.
    pub status: u16,
    /// The `Content-Type` header, if any.
    pub content_type: Option<String>,
    /// The [`ADMISSION_HEADER`] header, if any.
    pub admission: Option<String>,
    conn: TcpStream,
    /// Bytes read but not yet decoded.
    buf: Vec<u8>,
    framing: Framing,
}

impl WorkerStream {
    /// A `503` with `x-kvc-admission: rejected` (see [`WorkerResponse::is_admission_reject`]).
    pub fn is_admission_reject(&self) -> bool {
        admission_reject(self.status, self.admission.as_deref())
    }

    /// The rest of the body, whole: at most [`MAX_RESPONSE_BYTES`], each wait for more
    /// bounded by `timeout`.
    pub async fn read_rest(&mut self, timeout: Duration) -> Result<Vec<u8>, ForwardError> {
        let mut body = Vec::new();
        loop {
            let piece = tokio::time::timeout(timeout, self.next_chunk())
                .await
                .map_err(|_| ForwardError::Timeout(timeout))??;
            let Some(piece) = piece else {
                return Ok(body);
            };
            body.extend_from_slice(&piece);
            if body.len() > MAX_RESPONSE_BYTES {
                return Err(ForwardError::BadResponse(format!(
                    "larger than {MAX_RESPONSE_BYTES} bytes"
                )));
            }
        }
    }

    /// The next piece of the (de-chunked) body as the worker sent it, `None` once the body is
    /// complete. A connection that breaks or ends before the body is complete is an error
    /// ([`ForwardError::Io`] or [`ForwardError::BadResponse`]). No deadline: wrap each call in
    /// one.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, ForwardError> {
        let bad = |m: &str| ForwardError::BadResponse(m.to_owned());
        loop {
            match self.framing {
                Framing::Done => return Ok(None),
                Framing::Length(0) => {
                    self.framing = Framing::Done;
                    return Ok(None);
                }
                Framing::Length(n) if !self.buf.is_empty() => {
                    let take = n.min(self.buf.len());
                    let out: Vec<u8> = self.buf.drain(..take).collect();
                    self.framing = Framing::Length(n - take);
                    return Ok(Some(out));
                }
                Framing::UntilClose if !self.buf.is_empty() => {
                    return Ok(Some(std::mem::take(&mut self.buf)));
                }
                Framing::ChunkSize => {
                    if let Some(eol) = self.buf.windows(2).position(|w| w == b"\r\n") {
                        let line = std::str::from_utf8(&self.buf[..eol])
                            .map_err(|_| bad("bad chunk size"))?;
                        let size_text = line.split(';').next().unwrap_or_default().trim();
                        let size = usize::from_str_radix(size_text, 16)
                            .map_err(|_| bad("bad chunk size"))?;
                        self.buf.drain(..eol + 2);
                        // After the last chunk only (rare) trailers remain: the body is done.
                        self.framing = if size == 0 {
                            Framing::Done
                        } else {
                            Framing::ChunkData(size)
                        };
                        continue;
                    }
                    if self.buf.len() > 1024 {
                        return Err(bad("chunk-size line too long"));
                    }
                }
                Framing::ChunkData(n) if !self.buf.is_empty() => {
                    let take = n.min(self.buf.len());
                    let out: Vec<u8> = self.buf.drain(..take).collect();
                    self.framing = if take == n {
                        Framing::ChunkEnd
                    } else {
                        Framing::ChunkData(n - take)
                    };
                    return Ok(Some(out));
                }
                Framing::ChunkEnd if self.buf.len() >= 2 => {
                    if &self.buf[..2] != b"\r\n" {
                        return Err(bad("chunk without its line end"));
                    }
                    self.buf.drain(..2);
                    self.framing = Framing::ChunkSize;
                    continue;
                }
                _ => {}
            }
            // More input is needed.
            let mut piece = vec![0u8; 16 * 1024];
            let n = self.conn.read(&mut piece).await?;
            if n == 0 {
                return match self.framing {
                    Framing::UntilClose => {
                        self.framing = Framing::Done;
                        Ok(None)
                    }
                    _ => Err(bad("connection closed before the end of the body")),
                };
            }
            self.buf.extend_from_slice(&piece[..n]);
        }
    }
}

/// `POST`s `body` (JSON) to `base` + `path` and returns once the response head has arrived,
/// within `timeout`; the body is then read with [`WorkerStream::next_chunk`].
pub async fn post_streaming(
    base: &BaseUrl,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<WorkerStream, ForwardError> {
    post_streaming_with_headers(base, path, &[], body, timeout).await
}

/// [`post_streaming`] with extra request headers, as [`post_json_with_headers`] sends them.
pub async fn post_streaming_with_headers(
    base: &BaseUrl,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<WorkerStream, ForwardError> {
    let open = async {
        let mut conn = send_request(base, "POST", path, headers, body).await?;
        let mut raw = Vec::new();
        let mut piece = vec![0u8; 16 * 1024];
        let end = loop {
            if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                break end;
            }
            if raw.len() > 64 * 1024 {
                return Err(ForwardError::BadResponse(
                    "response head too long".to_owned(),
                ));
            }
            let n = conn.read(&mut piece).await?;
            if n == 0 {
                return Err(ForwardError::BadResponse("no end of headers".to_owned()));
            }
            raw.extend_from_slice(&piece[..n]);
        };
        let head = parse_head(&raw[..end])?;
        let framing = if head.chunked {
            Framing::ChunkSize
        } else if let Some(n) = head.content_length {
            Framing::Length(n)
        } else {
            Framing::UntilClose
        };
        Ok(WorkerStream {
            status: head.status,
            content_type: head.content_type,
            admission: head.admission,
            conn,
            buf: raw[end + 4..].to_vec(),
            framing,
        })
    };
    tokio::time::timeout(timeout, open)
        .await
        .map_err(|_| ForwardError::Timeout(timeout))?
}

/// The de-chunked body, `None` while the last chunk has not arrived.
fn dechunk(mut data: &[u8]) -> Result<Option<Vec<u8>>, ForwardError> {
    let bad = |m: &str| ForwardError::BadResponse(m.to_owned());
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let line = std::str::from_utf8(&data[..eol]).map_err(|_| bad("bad chunk size"))?;
        let size_text = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| bad("bad chunk size"))?;
        data = &data[eol + 2..];
        if size == 0 {
            // Trailers (rare) end with an empty line; wait for it.
            return Ok(data
                .windows(2)
                .position(|w| w == b"\r\n")
                .is_some()
                .then_some(out));
        }
        if data.len() < size + 2 {
            return Ok(None);
        }
        if &data[size..size + 2] != b"\r\n" {
            return Err(bad("chunk without its line end"));
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_base_urls() {
        let u = BaseUrl::parse("http://127.0.0.1:30000").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.prefix.as_str()),
            ("127.0.0.1", 30000, "")
        );
        let u = BaseUrl::parse("http://worker/api/").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.prefix.as_str()),
            ("worker", 80, "/api")
        );
        let u = BaseUrl::parse("http://[::1]:8000").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 8000));
        assert_eq!(u.host_header(), "[::1]:8000");
        for bad in [
            "https://a:1",
            "http://:1",
            "http://a:x",
            "a:1",
            "http://[::1",
        ] {
            assert!(
                matches!(BaseUrl::parse(bad), Err(ForwardError::BadUrl(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn parses_length_chunked_and_close_delimited_bodies() {
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}xx",
        )
        .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
        assert_eq!(r.body, b"{}");

        let r = parse_response(
            b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(r.status, 503);
        assert_eq!(r.body, b"abcde");

        let r = parse_response(b"HTTP/1.0 200 OK\r\n\r\nall of it").unwrap();
        assert_eq!(r.body, b"all of it");
    }

    #[test]
    fn incomplete_responses_wait_for_more() {
        let full = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nabcd";
        for cut in [10, full.len() - 4, full.len() - 1] {
            assert_eq!(parse_partial(&full[..cut], false).unwrap(), None, "{cut}");
        }
        assert_eq!(parse_partial(full, false).unwrap().unwrap().body, b"abcd");
        let chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n";
        for cut in [chunked.len() - 12, chunked.len() - 5, chunked.len() - 2] {
            assert_eq!(
                parse_partial(&chunked[..cut], false).unwrap(),
                None,
                "{cut}"
            );
        }
        assert_eq!(parse_partial(chunked, false).unwrap().unwrap().body, b"ab");
        // Without a length, only the end of the stream ends the body.
        assert_eq!(
            parse_partial(b"HTTP/1.1 200 OK\r\n\r\nxy", false).unwrap(),
            None
        );
    }

    /// A worker that answers with a length but keeps the connection open is not waited for.
    #[tokio::test]
    async fn a_complete_answer_does_not_wait_for_the_connection_to_close() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let mut got = Vec::new();
            while !got.ends_with(b"{\"a\":1}") {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "request cut short");
                got.extend_from_slice(&buf[..n]);
            }
            let text = String::from_utf8(got).unwrap();
            // Path prefix, Connection and Content-Length as documented; otherwise no answer.
            assert!(text.starts_with("POST /v/generate HTTP/1.1\r\n"), "{text}");
            assert!(text.contains("\r\nConnection: close\r\n"), "{text}");
            assert!(text.contains("\r\nContent-Length: 7\r\n"), "{text}");
            s.write_all(b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nyes")
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let base = BaseUrl::parse(&format!("http://{addr}/v")).unwrap();
        let r = post_json(&base, "/generate", br#"{"a":1}"#, Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(r.status, 201);
        assert_eq!(r.body, b"yes");
        server.abort();
    }

    #[tokio::test]
    async fn deadline_and_refused_connections_are_errors() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Accepts (through the backlog) but never answers.
        let base = BaseUrl::parse(&format!("http://{addr}")).unwrap();
        let err = post_json(&base, "/x", b"{}", Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(err, ForwardError::Timeout(d) if d == Duration::from_millis(100)));
        drop(listener);
        let err = post_json(&base, "/x", b"{}", Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(matches!(err, ForwardError::Io(_)), "{err:?}");
    }

    /// Serves `parts` on one connection, with a pause between them, then closes it.
    async fn serve_parts(parts: Vec<&'static [u8]>) -> BaseUrl {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf).await.unwrap();
            for p in parts {
                s.write_all(p).await.unwrap();
                s.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        BaseUrl::parse(&format!("http://{addr}")).unwrap()
    }

    async fn drain(ws: &mut WorkerStream) -> Result<Vec<Vec<u8>>, ForwardError> {
        let mut pieces = Vec::new();
        while let Some(p) = tokio::time::timeout(Duration::from_secs(5), ws.next_chunk())
            .await
            .expect("bounded")?
        {
            pieces.push(p);
        }
        Ok(pieces)
    }

    #[tokio::test]
    async fn streamed_bodies_arrive_piece_by_piece() {
        let base = serve_parts(vec![
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
            b"cde\r\n3;x\r\nfgh\r\n",
            b"0\r\n\r\n",
        ])
        .await;
        let mut ws = post_streaming(&base, "/g", b"{}", Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(ws.status, 200);
        assert_eq!(ws.content_type.as_deref(), Some("text/event-stream"));
        let pieces = drain(&mut ws).await.unwrap();
        assert_eq!(pieces.concat(), b"abcdefgh");
        assert!(pieces.len() >= 3, "not buffered: {pieces:?}");

        let base = serve_parts(vec![
            b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab",
            b"cdXX",
        ])
        .await;
        let mut ws = post_streaming(&base, "/g", b"{}", Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(drain(&mut ws).await.unwrap().concat(), b"abcd");

        let base = serve_parts(vec![b"HTTP/1.0 200 OK\r\n\r\nxy", b"z"]).await;
        let mut ws = post_streaming(&base, "/g", b"{}", Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(drain(&mut ws).await.unwrap().concat(), b"xyz");
    }

    #[tokio::test]
    async fn a_stream_cut_short_is_an_error() {
        for parts in [
            vec![&b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"[..]],
            vec![b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nab"],
            vec![b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY"],
        ] {
            let base = serve_parts(parts).await;
            let mut ws = post_streaming(&base, "/g", b"{}", Duration::from_secs(2))
                .await
                .unwrap();
            let err = drain(&mut ws).await.unwrap_err();
            assert!(matches!(err, ForwardError::BadResponse(_)), "{err:?}");
        }
        // No head at all within the deadline.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = BaseUrl::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        let err = post_streaming(&base, "/g", b"{}", Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(err, ForwardError::Timeout(_)), "{err:?}");
    }

    #[test]
    fn admission_refusals_are_recognised() {
        let r = parse_response(
            b"HTTP/1.1 503 Busy\r\nX-KVC-Admission: Rejected\r\ncontent-length: 2\r\n\r\n{}",
        )
        .unwrap();
        assert_eq!(r.admission.as_deref(), Some("Rejected"));
        assert!(r.is_admission_reject());
        for raw in [
            &b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n"[..],
            b"HTTP/1.1 500 Oops\r\nx-kvc-admission: rejected\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 503 Busy\r\nx-kvc-admission: admitted\r\ncontent-length: 0\r\n\r\n",
        ] {
            let r = parse_response(raw).unwrap();
            assert!(!r.is_admission_reject(), "{}", String::from_utf8_lossy(raw));
        }
    }

    #[tokio::test]
    async fn extra_headers_are_sent_and_unsafe_ones_dropped() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            let mut buf = vec![0u8; 4096];
            while !got.ends_with(b"{}") {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "request cut short");
                got.extend_from_slice(&buf[..n]);
            }
            s.write_all(
                b"HTTP/1.1 503 Busy\r\nx-kvc-admission: rejected\r\n\
                  Transfer-Encoding: chunked\r\n\r\n4\r\nfull\r\n0\r\n\r\n",
            )
            .await
            .unwrap();
            String::from_utf8(got).unwrap()
        });
        let base = BaseUrl::parse(&format!("http://{addr}")).unwrap();
        let headers = [
            ("x-session-id", "agent 7"),
            ("x-evil", "a\r\nInjected: 1"),
            ("bad name", "x"),
            ("x-empty", ""),
        ];
        let mut ws =
            post_streaming_with_headers(&base, "/g", &headers, b"{}", Duration::from_secs(2))
                .await
                .unwrap();
        assert!(ws.is_admission_reject());
        assert_eq!(ws.read_rest(Duration::from_secs(2)).await.unwrap(), b"full");
        let text = server.await.unwrap();
        assert!(text.contains("\r\nx-session-id: agent 7\r\n"), "{text}");
        assert!(text.contains("\r\nx-empty: \r\n"), "{text}");
        assert!(!text.contains("Injected"), "{text}");
        assert!(
            !text.contains("x-evil") && !text.contains("bad name"),
            "{text}"
        );
    }

    #[test]
    fn rejects_malformed_responses() {
        for raw in [
            &b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab"[..],
            b"HTTP/1.1 200 OK\r\n",
            b"SPDY 200 OK\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n",
            b"HTTP/1.1 200 OK\r\nno-colon\r\n\r\n",
        ] {
            assert!(
                matches!(parse_response(raw), Err(ForwardError::BadResponse(_))),
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
    }
}
