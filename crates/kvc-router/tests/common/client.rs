//! A client of the HTTP front for the tests: one POST over a fresh hyper connection, its
//! answer whole or piece by piece as the front sends it; or one request over a plain
//! connection, read to its end.

use super::EXCHANGE;
use super::answer::{Answer, request_head};
use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use std::collections::HashMap;
use std::net::SocketAddr;

/// An answer whose body is read as it arrives.
pub struct Streamed {
    pub status: u16,
    /// Header names in lower case.
    pub headers: HashMap<String, String>,
    body: Incoming,
}

impl Streamed {
    /// The next piece of the body, `None` at its end; panics when the front's stream is
    /// malformed or stalls for [`EXCHANGE`].
    pub async fn next_piece(&mut self) -> Option<Vec<u8>> {
        loop {
            let frame = tokio::time::timeout(EXCHANGE, self.body.frame())
                .await
                .expect("the stream stalled")?
                .expect("the front's stream is well formed");
            if let Ok(data) = frame.into_data()
                && !data.is_empty()
            {
                return Some(data.to_vec());
            }
        }
    }

    /// The rest of the body, as text.
    pub async fn read_all(&mut self) -> String {
        let mut all = Vec::new();
        while let Some(p) = self.next_piece().await {
            all.extend_from_slice(&p);
        }
        String::from_utf8(all).unwrap()
    }
}

/// `POST`s `body` (JSON) to `addr` + `path` with `headers` and returns once the answer's head
/// has arrived (within [`EXCHANGE`]).
pub async fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> Streamed {
    let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build_http();
    let mut req = hyper::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
    let response = tokio::time::timeout(EXCHANGE, client.request(req))
        .await
        .expect("the front answered in time")
        .expect("the front answers");
    let (head, body) = response.into_parts();
    Streamed {
        status: head.status.as_u16(),
        headers: head
            .headers
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap().to_owned()))
            .collect(),
        body,
    }
}

/// `POST`s and reads the whole answer (within [`EXCHANGE`]).
pub async fn exchange(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut s = post(addr, path, headers, body).await;
    let text = tokio::time::timeout(EXCHANGE, s.read_all())
        .await
        .expect("the front's answer ended in time");
    Answer {
        status: s.status,
        headers: s.headers,
        body: text,
    }
}

/// One bounded HTTP/1.1 exchange over a plain connection: `method path` with `headers`, and
/// `body` (JSON) when there is one. The front may answer (413) and close before reading a body
/// over its limit: a failed write or a reset after the answer is not an error here.
pub async fn raw_exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Answer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = request_head(method, path, "test", headers, body.map(str::len));
        s.write_all(head.as_bytes()).await.unwrap();
        if let Some(body) = body {
            let _ = s.write_all(body.as_bytes()).await;
        }
        let mut buf = Vec::new();
        if let Err(e) = s.read_to_end(&mut buf).await {
            assert!(!buf.is_empty(), "no answer: {e}");
        }
        buf
    };
    let raw = tokio::time::timeout(EXCHANGE, fut)
        .await
        .expect("the front answered in time");
    Answer::parse(&String::from_utf8(raw).unwrap())
}

/// An answer whose body must be JSON, parsed.
pub struct JsonAnswer {
    pub status: u16,
    /// Header names in lower case.
    pub headers: HashMap<String, String>,
    pub body: serde_json::Value,
}

impl From<Answer> for JsonAnswer {
    fn from(a: Answer) -> JsonAnswer {
        let body = serde_json::from_str(&a.body)
            .unwrap_or_else(|e| panic!("non-JSON body {:?}: {e}", a.body));
        JsonAnswer {
            status: a.status,
            headers: a.headers,
            body,
        }
    }
}
