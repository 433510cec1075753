//! Serving the front on a TCP listener with bounded connections and deadlines: hyper's
//! HTTP/1.1 connection with its own head-size limit, a deadline on each request's head and on
//! the idle wait between requests, a connection limit with an overflow that still answers the
//! health probes, and JSON bodies on the answers hyper writes by itself (a malformed or
//! oversized head).

use super::responses::error_response;
use super::routes::PROBE_PATHS;
use crate::config::HttpConfig;
use axum::body::Bytes;
use axum::http::{Method, StatusCode};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

/// How the front's listener treats client connections (the `[http]` table's listener keys;
/// the body's own limit and deadline are [`super::HttpOptions`]'s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerOptions {
    /// A request's head must be complete within this time of its first byte; otherwise the
    /// connection is closed. Default 10 s.
    pub header_read_timeout: Duration,
    /// A connection with no request in progress (new, or kept alive after an answer) is
    /// closed when no byte of a new request arrives within this time. Default 60 s.
    pub idle_timeout: Duration,
    /// Largest request head (request line and headers) in bytes: a larger one gets 431 (JSON)
    /// and the connection is closed. Default 64 KiB.
    pub max_header_bytes: usize,
    /// Connections served at once. Default 1,024.
    pub max_connections: usize,
    /// Connections past `max_connections` that are answered once — the health probes
    /// ([`PROBE_PATHS`]) served, anything else 503 — then closed. Past both, a new connection
    /// is closed at once. Default 32.
    pub overflow_connections: usize,
}

impl Default for ListenerOptions {
    fn default() -> Self {
        ListenerOptions::from_config(&HttpConfig::default())
    }
}

impl ListenerOptions {
    /// The listener keys of the `[http]` table.
    pub fn from_config(config: &HttpConfig) -> Self {
        ListenerOptions {
            header_read_timeout: Duration::from_millis(config.header_read_timeout_ms),
            idle_timeout: Duration::from_millis(config.idle_timeout_ms),
            max_header_bytes: config.max_header_bytes,
            max_connections: config.max_connections,
            overflow_connections: config.overflow_connections,
        }
    }
}

/// Serves `app` (the front, [`super::http_app_with`]) on `listener` — over TLS after a
/// handshake within [`crate::tls::HANDSHAKE_TIMEOUT`] when `tls` is given — until `stop` is
/// cancelled, then stops accepting, asks every connection to finish its request in progress
/// and returns when they have all closed (dropping the returned future closes them at once).
///
/// Each accepted connection takes one of `max_connections` places and is served as long as
/// its client keeps it busy (HTTP/1.1 keep-alive, `TCP_NODELAY`). When none is free, it takes
/// one of the `overflow_connections` places: its one request is answered — the health probes
/// as usual, anything else `503` with a JSON error naming the limit — and it is closed. When
/// both are full, it is closed at once. Accept errors (e.g. no file descriptor left) pause
/// accepting for 100 ms; nothing stops the listener but `stop`.
pub async fn serve_front(
    listener: TcpListener,
    app: axum::Router,
    options: ListenerOptions,
    tls: Option<tokio_rustls::TlsAcceptor>,
    stop: CancellationToken,
) {
    let served = Arc::new(Semaphore::new(options.max_connections));
    let overflow = Arc::new(Semaphore::new(options.overflow_connections));
    let mut connections = tokio::task::JoinSet::new();
    let mut crowded = Crowding::default();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) if is_per_connection(&e) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "http front: cannot accept a connection; pausing 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (permit, lane) = if let Ok(p) = Arc::clone(&served).try_acquire_owned() {
            (p, Lane::Served)
        } else if let Ok(p) = Arc::clone(&overflow).try_acquire_owned() {
            crowded.note(&options, false);
            (p, Lane::Overflow)
        } else {
            crowded.note(&options, true);
            drop(tcp);
            continue;
        };
        let (app, stop, tls) = (app.clone(), stop.clone(), tls.clone());
        connections.spawn(async move {
            match tls {
                None => serve_connection(tcp, app, options, lane, stop).await,
                // The handshake runs in the connection's own task, bounded in time, so a
                // stalled client holds up no one; it holds its place meanwhile.
                Some(acceptor) => {
                    match tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
                        .await
                    {
                        Ok(Ok(tls)) => serve_connection(tls, app, options, lane, stop).await,
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "http front: TLS handshake failed")
                        }
                        Err(_) => tracing::debug!("http front: TLS handshake timed out"),
                    }
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// Accept errors that concern one connection only (it went away before it was accepted).
fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
    )
}

/// Connections past the limit, logged at most every 10 s.
#[derive(Default)]
struct Crowding {
    overflowed: u64,
    closed: u64,
    logged: Option<Instant>,
}

impl Crowding {
    fn note(&mut self, options: &ListenerOptions, closed: bool) {
        if closed {
            self.closed += 1;
        } else {
            self.overflowed += 1;
        }
        let now = Instant::now();
        if self
            .logged
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10))
        {
            tracing::warn!(
                max_connections = options.max_connections,
                overflow_connections = options.overflow_connections,
                answered_once = self.overflowed,
                closed_unanswered = self.closed,
                "http front: connection limit reached"
            );
            self.logged = Some(now);
            (self.overflowed, self.closed) = (0, 0);
        }
    }
}

/// Which place a connection holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    /// One of `max_connections`: served normally.
    Served,
    /// One of `overflow_connections`: one request answered, then closed.
    Overflow,
}

/// Serves one connection until it closes (or, once `stop` is cancelled, until its request in
/// progress is answered).
async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    tcp: S,
    app: axum::Router,
    options: ListenerOptions,
    lane: Lane,
    stop: CancellationToken,
) {
    let requests = Shared::default();
    let io = TokioIo::new(Watched::new(tcp, Arc::clone(&requests), &options));
    let service = FrontService {
        inner: TowerToHyperService::new(app),
        requests,
        probes_only: lane == Lane::Overflow,
        max_connections: options.max_connections,
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .keep_alive(lane == Lane::Served)
        // The head's deadlines are `Watched`'s (hyper's own would count the idle wait
        // between requests into the head's).
        .header_read_timeout(None)
        .max_header_size(options.max_header_bytes)
        .max_buf_size((options.max_header_bytes + 8_192).max(8_192));
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    let result = tokio::select! {
        r = connection.as_mut() => r,
        () = stop.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "http front: connection ended with an error");
    }
}

/// What a connection's service tells its [`Watched`] socket: requests begun, and those still
/// in progress (head read, answer's body not yet all handed to hyper).
#[derive(Default)]
struct Requests {
    begun: AtomicU64,
    in_flight: AtomicUsize,
    /// The connection's reader, waiting while a request was in progress: woken when the last
    /// one ends, so that the idle deadline starts.
    reader: parking_lot::Mutex<Option<std::task::Waker>>,
}

type Shared = Arc<Requests>;

/// Counts one request in progress until dropped.
struct InFlightGuard(Shared);

impl InFlightGuard {
    fn new(requests: &Shared) -> Self {
        requests.begun.fetch_add(1, Ordering::SeqCst);
        requests.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlightGuard(Arc::clone(requests))
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1
            && let Some(reader) = self.0.reader.lock().take()
        {
            reader.wake();
        }
    }
}

/// An answer's body that keeps its request counted in progress until it has been sent (or
/// dropped).
struct Guarded {
    body: axum::body::Body,
    _guard: InFlightGuard,
}

impl hyper::body::Body for Guarded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The front as one connection's hyper service: every request counted in progress while it
/// lasts; on an overflow connection only the health probes reach the front.
struct FrontService {
    inner: TowerToHyperService<axum::Router>,
    requests: Shared,
    probes_only: bool,
    max_connections: usize,
}

type Answer = hyper::Response<Guarded>;

impl hyper::service::Service<hyper::Request<Incoming>> for FrontService {
    type Response = Answer;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Answer, Infallible>> + Send>>;

    fn call(&self, request: hyper::Request<Incoming>) -> Self::Future {
        let guard = InFlightGuard::new(&self.requests);
        let probe = matches!(*request.method(), Method::GET | Method::HEAD)
            && PROBE_PATHS.contains(&request.uri().path());
        if self.probes_only && !probe {
            let body = error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                &format!(
                    "the router is serving its maximum of {} connections \
                     (http.max-connections); try again",
                    self.max_connections
                ),
            );
            return Box::pin(std::future::ready(Ok(body.map(|body| Guarded {
                body,
                _guard: guard,
            }))));
        }
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| Guarded {
                body,
                _guard: guard,
            }))
        })
    }
}

/// Where a connection is between requests (see [`Watched`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No request in progress and no byte of the next one since this time.
    Idle(Instant),
    /// The next request's head started arriving at this time.
    Head(Instant),
    /// A request is in progress (its body and answer have deadlines of their own).
    Busy,
}

/// A client connection as hyper reads and writes it, with two deadlines hyper does not keep
/// apart: the idle wait for a new request (`idle_timeout`, from the end of the previous
/// answer's last write, or from the accept) and the arrival of its head once it has started
/// (`header_read_timeout`). A read past either fails with `TimedOut`, which ends the
/// connection. It also gives hyper's own answers — written when a head could not be read,
/// before any request reached the front: malformed (400), too long (431), too long a URI
/// (414) — a JSON body.
struct Watched<S> {
    inner: S,
    requests: Shared,
    header_read_timeout: Duration,
    idle_timeout: Duration,
    max_header_bytes: usize,
    phase: Phase,
    /// [`Requests::begun`] when `phase` was last updated.
    begun_seen: u64,
    /// The last write that made progress.
    last_write: Instant,
    sleep: Pin<Box<Sleep>>,
    armed: Option<Instant>,
    /// Answer heads the front's service has written (one per request begun).
    heads_written: u64,
    /// The last head written was the service's and its body may still be being written.
    answering: bool,
    /// hyper's own answer, replaced: the bytes written in its place and how many have gone.
    replaced: Option<(Vec<u8>, usize)>,
}

impl<S> Watched<S> {
    fn new(inner: S, requests: Shared, options: &ListenerOptions) -> Self {
        let now = Instant::now();
        Watched {
            inner,
            requests,
            header_read_timeout: options.header_read_timeout,
            idle_timeout: options.idle_timeout,
            max_header_bytes: options.max_header_bytes,
            phase: Phase::Idle(now),
            begun_seen: 0,
            last_write: now,
            sleep: Box::pin(tokio::time::sleep_until(now)),
            armed: None,
            heads_written: 0,
            answering: false,
            replaced: None,
        }
    }

    /// Brings `phase` up to date with the service's requests at `now`.
    fn update_phase(&mut self, now: Instant) {
        let begun = self.requests.begun.load(Ordering::SeqCst);
        let busy = self.requests.in_flight.load(Ordering::SeqCst) > 0;
        if busy {
            self.phase = Phase::Busy;
        } else if begun != self.begun_seen || self.phase == Phase::Busy {
            // A request came and went since the last look.
            self.phase = Phase::Idle(now);
        }
        self.begun_seen = begun;
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let now = Instant::now();
        this.update_phase(now);
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && matches!(this.phase, Phase::Idle(_)) {
                    this.phase = Phase::Head(now);
                    this.answering = false;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                let (deadline, what) = match this.phase {
                    Phase::Idle(t) => (
                        t.max(this.last_write) + this.idle_timeout,
                        "idle connection",
                    ),
                    Phase::Head(t) => (t + this.header_read_timeout, "request head"),
                    Phase::Busy => {
                        *this.requests.reader.lock() = Some(cx.waker().clone());
                        // The request may have ended meanwhile.
                        if this.requests.in_flight.load(Ordering::SeqCst) == 0 {
                            cx.waker().wake_by_ref();
                        }
                        return Poll::Pending;
                    }
                };
                if this.armed != Some(deadline) {
                    this.sleep.as_mut().reset(deadline);
                    this.armed = Some(deadline);
                }
                match this.sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("{what}: deadline passed"),
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.replaced.is_none() && buf.starts_with(b"HTTP/1.1 ") {
            let begun = this.requests.begun.load(Ordering::SeqCst);
            if this.heads_written < begun {
                // The head of the service's answer to a request.
                this.heads_written += 1;
                this.answering = true;
            } else if !this.answering
                && let Some(status) = own_answer_status(buf)
            {
                this.replaced = Some((json_answer(status, this.max_header_bytes), 0));
            }
        }
        let Some((bytes, sent)) = &mut this.replaced else {
            let written = Pin::new(&mut this.inner).poll_write(cx, buf);
            if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
                this.last_write = Instant::now();
            }
            return written;
        };
        while *sent < bytes.len() {
            match Pin::new(&mut this.inner).poll_write(cx, &bytes[*sent..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *sent += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        // hyper's own bytes stand replaced.
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The status of an error answer hyper writes by itself (`HTTP/1.1 4xx ...`), if `buf`
/// starts one.
fn own_answer_status(buf: &[u8]) -> Option<u16> {
    let status = buf.strip_prefix(b"HTTP/1.1 ")?.get(..3)?;
    let status: u16 = std::str::from_utf8(status).ok()?.parse().ok()?;
    (400..600).contains(&status).then_some(status)
}

/// The whole answer written instead of hyper's bodiless one: the same status, a JSON error
/// body, and the connection closed.
fn json_answer(status: u16, max_header_bytes: usize) -> Vec<u8> {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
    let reason = code.canonical_reason().unwrap_or("Error");
    let message = match status {
        431 => format!(
            "the request head is larger than {max_header_bytes} bytes or has too many \
             headers (http.max-header-bytes)"
        ),
        414 => "the request URI is too long".to_owned(),
        400 => "the request head is not valid HTTP/1.1".to_owned(),
        _ => reason.to_owned(),
    };
    let body = serde_json::json!({
        "error": { "message": message, "type": "invalid_request_error", "code": status }
    })
    .to_string();
    format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_answers_are_recognised_and_replaced_with_json() {
        assert_eq!(
            own_answer_status(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            Some(431)
        );
        assert_eq!(
            own_answer_status(b"HTTP/1.1 400 Bad Request\r\n"),
            Some(400)
        );
        assert_eq!(own_answer_status(b"HTTP/1.1 200 OK\r\n"), None);
        assert_eq!(own_answer_status(b"HTTP/1.1 4"), None);
        assert_eq!(own_answer_status(b"data: x"), None);
        let answer = String::from_utf8(json_answer(431, 4096)).unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            "{head}"
        );
        assert!(head.contains(&format!("content-length: {}", body.len())));
        assert!(head.contains("connection: close"));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], 431);
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("4096 bytes")
        );
    }

    #[test]
    fn options_come_from_the_http_table() {
        let config = HttpConfig {
            header_read_timeout_ms: 1,
            idle_timeout_ms: 2,
            max_header_bytes: 3,
            max_connections: 4,
            overflow_connections: 5,
            ..HttpConfig::default()
        };
        let o = ListenerOptions::from_config(&config);
        assert_eq!(
            o,
            ListenerOptions {
                header_read_timeout: Duration::from_millis(1),
                idle_timeout: Duration::from_millis(2),
                max_header_bytes: 3,
                max_connections: 4,
                overflow_connections: 5,
            }
        );
        assert_eq!(ListenerOptions::default().max_connections, 1_024);
    }
}
