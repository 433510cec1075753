//! The HTTP client to the workers: hyper-util's pooled client (HTTP/1.1 keep-alive, idle
//! connections reused until the idle timeout, a connect timeout, `TCP_NODELAY`), with the
//! front's deadlines, its size limit and its reading of admission refusals. A call whose
//! connection closes before the answer's first byte goes once more on a new connection.

use crate::config::WorkerUrl;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::time::Duration;

/// Largest whole answer accepted from a worker, in bytes.
pub const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// The response header with which a decode worker says its admission refused a request: a
/// `503` with `x-kvc-admission: rejected`.
pub const ADMISSION_HEADER: &str = "x-kvc-admission";

/// Why a call to a worker got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// No connection could be opened (refused, unreachable, connect timeout).
    #[error("cannot connect: {0}")]
    Unreachable(String),
    /// The connection broke, or closed before the answer was complete.
    #[error("connection broken: {0}")]
    Broken(String),
    /// No answer (or, streaming, no next piece) within the deadline.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The answer is not valid HTTP, or is larger than [`MAX_RESPONSE_BYTES`].
    #[error("bad response: {0}")]
    BadResponse(String),
}

impl ForwardError {
    /// Whether another worker may do better: no connection, a broken one, or no answer in
    /// time (a malformed answer is the worker's bug, not a passing failure).
    pub(crate) fn is_transient(&self) -> bool {
        !matches!(self, ForwardError::BadResponse(_))
    }

    fn from_client(e: &hyper_util::client::legacy::Error) -> ForwardError {
        if e.is_connect() {
            return ForwardError::Unreachable(source_text(e));
        }
        match std::error::Error::source(e).and_then(|s| s.downcast_ref::<hyper::Error>()) {
            Some(h) => Self::from_hyper(h),
            None => ForwardError::Broken(source_text(e)),
        }
    }

    fn from_hyper(e: &hyper::Error) -> ForwardError {
        if e.is_parse() || e.is_parse_status() || e.is_parse_too_large() {
            ForwardError::BadResponse(source_text(e))
        } else {
            ForwardError::Broken(source_text(e))
        }
    }
}

/// `e` and its sources, `: `-separated.
fn source_text(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        text.push_str(": ");
        text.push_str(&s.to_string());
        next = s.source();
    }
    text
}

/// Whether `status` and an [`ADMISSION_HEADER`] value say "refused by admission".
fn admission_reject(status: u16, headers: &HeaderMap) -> bool {
    status == 503
        && headers
            .get(ADMISSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("rejected"))
}

/// A worker's whole answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkerAnswer {
    /// HTTP status code.
    pub(crate) status: u16,
    /// The `Content-Type` header, if any.
    pub(crate) content_type: Option<HeaderValue>,
    /// Whether it is an admission refusal (`503` with `x-kvc-admission: rejected`): the
    /// worker's admission refused the request (no room, or the session is not resident
    /// there), which is not a worker failure.
    pub(crate) admission_rejected: bool,
    /// The body (de-chunked).
    pub(crate) body: Bytes,
}

/// A worker's answer whose body is read as it arrives ([`WorkerStream::next_piece`]).
#[derive(Debug)]
pub(crate) struct WorkerStream {
    /// HTTP status code.
    pub(crate) status: u16,
    /// The `Content-Type` header, if any.
    pub(crate) content_type: Option<HeaderValue>,
    /// Whether it is an admission refusal (see [`WorkerAnswer::admission_rejected`]).
    pub(crate) admission_rejected: bool,
    body: Incoming,
}

impl WorkerStream {
    /// The next piece of the (de-chunked) body as the worker sent it, `None` once the body is
    /// complete. A connection that breaks or ends before the body is complete is an error.
    /// No deadline: wrap each call in one.
    pub(crate) async fn next_piece(&mut self) -> Result<Option<Bytes>, ForwardError> {
        loop {
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(ForwardError::from_hyper(&e)),
                // Trailers (and empty data frames) carry nothing to relay.
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => return Ok(Some(data)),
                    _ => continue,
                },
            }
        }
    }

    /// The rest of the body, whole: at most [`MAX_RESPONSE_BYTES`], each wait for more
    /// bounded by `timeout`.
    pub(crate) async fn read_rest(self, timeout: Duration) -> Result<WorkerAnswer, ForwardError> {
        self.read_body(Some(timeout)).await
    }

    /// The rest of the body, whole: at most [`MAX_RESPONSE_BYTES`], each wait for more
    /// bounded by `piece_timeout` when there is one.
    async fn read_body(
        mut self,
        piece_timeout: Option<Duration>,
    ) -> Result<WorkerAnswer, ForwardError> {
        let mut body = Vec::new();
        loop {
            let piece = match piece_timeout {
                Some(timeout) => within(timeout, self.next_piece()).await?,
                None => self.next_piece().await?,
            };
            let Some(piece) = piece else { break };
            body.extend_from_slice(&piece);
            if body.len() > MAX_RESPONSE_BYTES {
                return Err(too_large());
            }
        }
        Ok(WorkerAnswer {
            status: self.status,
            content_type: self.content_type,
            admission_rejected: self.admission_rejected,
            body: body.into(),
        })
    }
}

fn too_large() -> ForwardError {
    ForwardError::BadResponse(format!("larger than {MAX_RESPONSE_BYTES} bytes"))
}

/// How the pool treats connections to the workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolOptions {
    /// Deadline of opening a connection. Default 5 s.
    pub connect_timeout: Duration,
    /// An idle connection is closed after this long. Default 4 s (below uvicorn's 5 s
    /// keep-alive, so that the router does not reuse a connection the worker is closing).
    pub idle_timeout: Duration,
    /// Idle connections kept per worker; 0 opens a connection per call. Default 64.
    pub max_idle_per_worker: usize,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(4),
            max_idle_per_worker: 64,
        }
    }
}

/// One call to a worker: `body` (JSON; empty for a `GET`) to `base` + `path`, with extra
/// `headers`, answered within `timeout`.
#[derive(Debug)]
pub(crate) struct Call<'a> {
    pub(crate) base: WorkerUrl,
    pub(crate) path: &'a str,
    pub(crate) headers: &'a [(HeaderName, HeaderValue)],
    pub(crate) body: Bytes,
    pub(crate) timeout: Duration,
}

/// The pooled client every call to a worker goes through (cheap to clone: the pool is
/// shared).
#[derive(Debug, Clone)]
pub(crate) struct WorkerClient {
    client: Client<HttpConnector, Full<Bytes>>,
    /// Without a pool: the one retry of a call whose connection closed before any answer
    /// (`WorkerClient::send`) goes out on a connection of its own.
    fresh: Client<HttpConnector, Full<Bytes>>,
}

impl WorkerClient {
    /// A client with its own pool of connections.
    pub(crate) fn new(pool: PoolOptions) -> Self {
        let mut connector = HttpConnector::new();
        // Streamed requests and small JSON bodies go out at once, not behind a delayed ACK.
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(pool.connect_timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(pool.idle_timeout)
            .pool_max_idle_per_host(pool.max_idle_per_worker)
            .build(connector.clone());
        let fresh = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector);
        WorkerClient { client, fresh }
    }

    /// Sends `method` to `base` + `path` and returns once the response head has arrived.
    async fn send(&self, method: Method, call: Call<'_>) -> Result<WorkerStream, ForwardError> {
        let Call {
            base,
            path,
            headers,
            body,
            ..
        } = call;
        let post = method == Method::POST;
        let build = || {
            let mut request = Request::builder()
                .method(method.clone())
                .uri(base.uri(path))
                .body(Full::new(body.clone()))
                .map_err(|e| ForwardError::Unreachable(format!("bad request URI: {e}")))?;
            let h = request.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            for (name, value) in headers {
                h.insert(name.clone(), value.clone());
            }
            Ok::<_, ForwardError>(request)
        };
        let request = build()?;
        // A worker call's timeline at debug level (`--log-level debug`): when the router sent
        // it and when the worker's head came, by the request id both legs of a P→D carry.
        let traced = (post && tracing::enabled!(tracing::Level::DEBUG))
            .then(|| (std::time::Instant::now(), request_id_of(request.headers())));
        if let Some((_, id)) = &traced {
            tracing::debug!(worker = %base.authority(), path, request_id = %id, "worker call sent");
        }
        let failed = |e: &hyper_util::client::legacy::Error| {
            if let Some((at, id)) = &traced {
                tracing::debug!(worker = %base.authority(), path, request_id = %id, error = %e,
                    elapsed_ms = at.elapsed().as_millis() as u64, "worker call failed");
            }
            ForwardError::from_client(e)
        };
        let response = match self.client.request(request).await {
            Ok(response) => response,
            // A pooled connection the worker closed as the call went out (its keep-alive
            // timer and ours race; on a loaded machine the margin goes): the worker read
            // nothing, or closed without a byte of answer. Once more, on a connection of its
            // own; a worker that closes that one too has failed the call.
            Err(e) if closed_before_answer(&e) => {
                tracing::info!(worker = %base.authority(), path, error = %e,
                    "worker closed the connection before any answer; sending the call once more on a new connection");
                self.fresh.request(build()?).await.map_err(|e| failed(&e))?
            }
            Err(e) => return Err(failed(&e)),
        };
        let (head, body) = response.into_parts();
        let status = head.status.as_u16();
        if let Some((at, id)) = &traced {
            tracing::debug!(worker = %base.authority(), path, request_id = %id, status,
                elapsed_ms = at.elapsed().as_millis() as u64, "worker call answered");
        }
        Ok(WorkerStream {
            status,
            content_type: head.headers.get(header::CONTENT_TYPE).cloned(),
            admission_rejected: admission_reject(status, &head.headers),
            body,
        })
    }

    /// `POST`s `call` and reads the whole answer, all within its timeout.
    pub(crate) async fn post_whole(&self, call: Call<'_>) -> Result<WorkerAnswer, ForwardError> {
        within(call.timeout, async {
            read_all(self.send(Method::POST, call).await?).await
        })
        .await
    }

    /// `POST`s `call` and returns once the response head has arrived, within its timeout; the
    /// body is then read with [`WorkerStream::next_piece`].
    pub(crate) async fn post_streaming(
        &self,
        call: Call<'_>,
    ) -> Result<WorkerStream, ForwardError> {
        within(call.timeout, self.send(Method::POST, call)).await
    }

    /// `GET`s `base` + `path` and reads the whole answer, all within `timeout`.
    pub(crate) async fn get(
        &self,
        base: &WorkerUrl,
        path: &str,
        timeout: Duration,
    ) -> Result<WorkerAnswer, ForwardError> {
        let call = Call {
            base: base.clone(),
            path,
            headers: &[],
            body: Bytes::new(),
            timeout,
        };
        within(timeout, async {
            read_all(self.send(Method::GET, call).await?).await
        })
        .await
    }
}

/// Whether a call failed because its connection closed before the answer's first byte (no
/// connect error, no malformed answer: hyper's "connection closed before message completed").
fn closed_before_answer(e: &hyper_util::client::legacy::Error) -> bool {
    !e.is_connect()
        && std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<hyper::Error>())
            .is_some_and(hyper::Error::is_incomplete_message)
}

/// The `X-Request-Id` a call carries (`-` without one), for the debug timeline.
fn request_id_of(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned()
}

/// `call`'s result, or [`ForwardError::Timeout`] when it takes longer than `timeout`.
async fn within<T>(
    timeout: Duration,
    call: impl Future<Output = Result<T, ForwardError>>,
) -> Result<T, ForwardError> {
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| ForwardError::Timeout(timeout))?
}

/// The whole body of `stream`, at most [`MAX_RESPONSE_BYTES`] (no deadline of its own).
async fn read_all(stream: WorkerStream) -> Result<WorkerAnswer, ForwardError> {
    stream.read_body(None).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post<'a>(
        base: &WorkerUrl,
        path: &'a str,
        headers: &'a [(HeaderName, HeaderValue)],
        body: Bytes,
        timeout: Duration,
    ) -> Call<'a> {
        Call {
            base: base.clone(),
            path,
            headers,
            body,
            timeout,
        }
    }
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A raw HTTP/1.1 server: each connection answers its requests, in turn, with `answer`
    /// (split into parts written 30 ms apart) and records each request's text; counts the
    /// connections it accepted.
    struct RawServer {
        url: WorkerUrl,
        connections: Arc<AtomicUsize>,
        requests: Arc<parking_lot::Mutex<Vec<String>>>,
    }

    async fn raw_server(parts: Vec<&'static [u8]>) -> RawServer {
        serve_raw(parts, None).await
    }

    /// [`raw_server`]; with `close_after = Some(k)`, each connection answers its first `k`
    /// requests, then closes on reading the next without a byte of answer (as a worker whose
    /// keep-alive timer fired as the call went out).
    async fn serve_raw(parts: Vec<&'static [u8]>, close_after: Option<usize>) -> RawServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let (c, r) = (connections.clone(), requests.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
                let (parts, r) = (parts.clone(), r.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    for answered in 0.. {
                        let Some(text) = read_request(&mut s, &mut buf).await else {
                            return;
                        };
                        r.lock().push(text);
                        if close_after == Some(answered) {
                            return; // dropped: closed without an answer
                        }
                        for p in &parts {
                            if s.write_all(p).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(30)).await;
                        }
                    }
                });
            }
        });
        RawServer {
            url: WorkerUrl::parse(&format!("http://127.0.0.1:{port}/v")).unwrap(),
            connections,
            requests,
        }
    }

    /// One request's head and `Content-Length` body, as text; `None` at the connection's end.
    async fn read_request(s: &mut tokio::net::TcpStream, buf: &mut [u8]) -> Option<String> {
        let mut raw = Vec::new();
        loop {
            if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&raw[..end]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if raw.len() >= end + 4 + length {
                    return Some(String::from_utf8_lossy(&raw).into_owned());
                }
            }
            let n = s.read(buf).await.ok()?;
            if n == 0 {
                return None;
            }
            raw.extend_from_slice(&buf[..n]);
        }
    }

    fn client() -> WorkerClient {
        WorkerClient::new(PoolOptions::default())
    }

    const SECOND: Duration = Duration::from_secs(1);

    #[tokio::test]
    async fn connections_are_kept_alive_and_reused() {
        let server = raw_server(vec![
            b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 3\r\n\r\nyes",
        ])
        .await;
        let c = client();
        let header = (
            HeaderName::from_static("x-session-id"),
            HeaderValue::from_static("agent 7"),
        );
        for _ in 0..3 {
            let a = c
                .post_whole(post(
                    &server.url,
                    "/generate",
                    std::slice::from_ref(&header),
                    Bytes::from_static(b"{\"a\":1}"),
                    SECOND,
                ))
                .await
                .unwrap();
            assert_eq!((a.status, &a.body[..]), (201, &b"yes"[..]));
            assert_eq!(a.content_type.unwrap(), "application/json");
            assert!(!a.admission_rejected);
        }
        assert_eq!(
            server.connections.load(Ordering::SeqCst),
            1,
            "one pooled connection"
        );
        let requests = server.requests.lock().clone();
        assert_eq!(requests.len(), 3);
        let text = &requests[0];
        assert!(text.starts_with("POST /v/generate HTTP/1.1\r\n"), "{text}");
        assert!(text.contains("\r\nx-session-id: agent 7\r\n"), "{text}");
        assert!(text.contains("\r\ncontent-length: 7\r\n"), "{text}");
        assert!(text.ends_with("{\"a\":1}"), "{text}");
        assert!(!text.to_lowercase().contains("connection: close"), "{text}");
    }

    #[tokio::test]
    async fn no_pooling_opens_a_connection_per_call() {
        let server = raw_server(vec![b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]).await;
        let c = WorkerClient::new(PoolOptions {
            max_idle_per_worker: 0,
            ..PoolOptions::default()
        });
        for _ in 0..2 {
            let a = c.get(&server.url, "/health", SECOND).await.unwrap();
            assert_eq!(a.status, 200);
        }
        assert_eq!(server.connections.load(Ordering::SeqCst), 2);
        assert!(server.requests.lock()[0].starts_with("GET /v/health HTTP/1.1\r\n"));
    }

    #[tokio::test]
    async fn streamed_bodies_arrive_piece_by_piece() {
        let server = raw_server(vec![
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"3\r\nabc\r\n",
            b"2\r\nde\r\n",
            b"3\r\nfgh\r\n0\r\n\r\n",
        ])
        .await;
        let mut ws = client()
            .post_streaming(post(
                &server.url,
                "/generate",
                &[],
                Bytes::from_static(b"{}"),
                SECOND,
            ))
            .await
            .unwrap();
        assert_eq!(ws.status, 200);
        assert_eq!(ws.content_type.clone().unwrap(), "text/event-stream");
        let mut pieces = Vec::new();
        while let Some(p) = ws.next_piece().await.unwrap() {
            pieces.push(p);
        }
        assert_eq!(pieces.concat(), b"abcdefgh");
        assert!(pieces.len() >= 3, "not buffered: {pieces:?}");
    }

    /// A server that answers one request with `answer`, then closes the connection.
    async fn closing_server(answer: &'static [u8]) -> WorkerUrl {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = WorkerUrl::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            read_request(&mut s, &mut buf).await.unwrap();
            s.write_all(answer).await.unwrap();
            tokio::time::sleep(Duration::from_millis(30)).await;
        });
        url
    }

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";

    #[tokio::test]
    async fn a_call_whose_kept_alive_connection_closes_unanswered_goes_once_more_on_a_new_one() {
        let server = serve_raw(vec![OK], Some(1)).await;
        let c = client();
        let body = Bytes::from_static(b"{\"turn\":1}");
        let first = c
            .post_whole(post(&server.url, "/x", &[], body, SECOND))
            .await
            .unwrap();
        assert_eq!(&first.body[..], b"ok");
        // The kept-alive connection closes on the second call: it is sent again, on a new
        // connection, with the same body, and answered.
        let body = Bytes::from_static(b"{\"turn\":2}");
        let second = c
            .post_whole(post(&server.url, "/x", &[], body, SECOND))
            .await
            .unwrap();
        assert_eq!((second.status, &second.body[..]), (200, &b"ok"[..]));
        assert_eq!(server.connections.load(Ordering::SeqCst), 2);
        let requests = server.requests.lock().clone();
        assert_eq!(requests.len(), 3, "{requests:?}");
        assert!(requests[1].ends_with("{\"turn\":2}") && requests[2].ends_with("{\"turn\":2}"));
    }

    #[tokio::test]
    async fn a_worker_that_closes_every_connection_unanswered_fails_the_call_after_one_retry() {
        let server = serve_raw(vec![OK], Some(0)).await;
        for (call, streaming) in [(1, false), (2, true)] {
            let call_of = || post(&server.url, "/x", &[], Bytes::from_static(b"{}"), SECOND);
            let err = if streaming {
                client().post_streaming(call_of()).await.unwrap_err()
            } else {
                client().post_whole(call_of()).await.unwrap_err()
            };
            assert!(matches!(err, ForwardError::Broken(_)), "{err:?}");
            assert!(
                err.to_string().contains("closed before message completed"),
                "{err}"
            );
            // Each call: the first connection and exactly one more.
            assert_eq!(server.connections.load(Ordering::SeqCst), 2 * call);
            assert_eq!(server.requests.lock().len(), 2 * call);
        }
    }

    #[tokio::test]
    async fn a_stream_cut_short_is_an_error() {
        let url =
            closing_server(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
                .await;
        let mut ws = client()
            .post_streaming(post(&url, "/generate", &[], Bytes::new(), SECOND))
            .await
            .unwrap();
        assert_eq!(&ws.next_piece().await.unwrap().unwrap()[..], b"abc");
        let err = ws.next_piece().await.unwrap_err();
        assert!(matches!(err, ForwardError::Broken(_)), "{err:?}");
        // A whole answer cut short is an error too.
        let url = closing_server(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc").await;
        let err = client().get(&url, "/", SECOND).await.unwrap_err();
        assert!(err.is_transient(), "{err:?}");
    }

    #[tokio::test]
    async fn deadlines_and_refused_connections_are_errors() {
        let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = WorkerUrl::parse(&format!("http://{}", silent.local_addr().unwrap())).unwrap();
        let wait = Duration::from_millis(100);
        let err = client()
            .post_whole(post(&url, "/x", &[], Bytes::new(), wait))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ForwardError::Timeout(d) if d == wait),
            "{err:?}"
        );
        assert!(err.is_transient());
        drop(silent);
        let err = client().get(&url, "/x", SECOND).await.unwrap_err();
        assert!(matches!(err, ForwardError::Unreachable(_)), "{err:?}");
        assert!(err.is_transient());
    }

    #[tokio::test]
    async fn malformed_answers_are_bad_responses() {
        let server = raw_server(vec![b"HTTP/1.1 abc\r\n\r\n"]).await;
        let err = client().get(&server.url, "/", SECOND).await.unwrap_err();
        assert!(matches!(err, ForwardError::BadResponse(_)), "{err:?}");
        assert!(!err.is_transient());
    }

    #[tokio::test]
    async fn admission_refusals_are_recognised() {
        let server = raw_server(vec![
            b"HTTP/1.1 503 Service Unavailable\r\nx-kvc-admission: Rejected \r\nContent-Length: 4\r\n\r\nfull",
        ])
        .await;
        let ws = client()
            .post_streaming(post(&server.url, "/generate", &[], Bytes::new(), SECOND))
            .await
            .unwrap();
        assert!(ws.admission_rejected);
        let a = ws.read_rest(SECOND).await.unwrap();
        assert!(a.admission_rejected);
        assert_eq!(&a.body[..], b"full");
        let mut headers = HeaderMap::new();
        assert!(!admission_reject(503, &headers));
        headers.insert(ADMISSION_HEADER, HeaderValue::from_static("rejected"));
        assert!(admission_reject(503, &headers));
        assert!(!admission_reject(502, &headers));
        headers.insert(ADMISSION_HEADER, HeaderValue::from_static("maybe"));
        assert!(!admission_reject(503, &headers));
    }
}
