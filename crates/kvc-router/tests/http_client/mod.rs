//! A client of the HTTP front for the tests: one POST over a fresh hyper connection, its
//! answer whole or piece by piece as the front sends it.

#![allow(dead_code, unreachable_pub)]

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

/// An answer whose body is read as it arrives.
pub struct Streamed {
    pub status: u16,
    /// Header names in lower case.
    pub headers: HashMap<String, String>,
    body: Incoming,
}

impl Streamed {
    /// The next piece of the body, `None` at its end; panics when the front's stream is
    /// malformed or stalls for 5 s.
    pub async fn next_piece(&mut self) -> Option<Vec<u8>> {
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(5), self.body.frame())
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
/// has arrived (within 10 s).
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
    let response = tokio::time::timeout(Duration::from_secs(10), client.request(req))
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

/// `POST`s and reads the whole answer (within 10 s): status, headers, body text.
pub async fn exchange(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, HashMap<String, String>, String) {
    let mut s = post(addr, path, headers, body).await;
    let text = tokio::time::timeout(Duration::from_secs(10), s.read_all())
        .await
        .expect("the front's answer ended in time");
    (s.status, s.headers, text)
}
