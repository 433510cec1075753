//! The Kubernetes API as the inference pool's reader calls it: one HTTP/1.1 `GET` per call,
//! over TLS checked against the cluster's CA (or plain HTTP to a `kubectl proxy`), with the
//! service account's bearer token read afresh for each call, bounded in time and in size.

use crate::config::ApiUrl;
use http_body_util::BodyExt as _;
use hyper::body::Bytes;
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// The largest answer read from the API (a pod list of thousands of pods fits).
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// The Kubernetes API as the pool's reader calls it.
pub(super) struct Api {
    pub(super) url: ApiUrl,
    pub(super) tls: Option<tokio_rustls::TlsConnector>,
    pub(super) token_file: Option<PathBuf>,
    pub(super) timeout: Duration,
}

impl Api {
    /// `GET path`: the status and the body, or why there is none.
    pub(super) async fn get(&self, path: &str) -> Result<(u16, Bytes), String> {
        let token = match &self.token_file {
            Some(f) => match std::fs::read_to_string(f) {
                Ok(t) => Some(t.trim().to_owned()),
                Err(e) => return Err(format!("cannot read the token file {}: {e}", f.display())),
            },
            None => None,
        };
        let call = async {
            let tcp = tokio::net::TcpStream::connect((self.url.host.as_str(), self.url.port))
                .await
                .map_err(|e| format!("cannot connect to {}: {e}", self.url))?;
            let _ = tcp.set_nodelay(true);
            match &self.tls {
                None => get_over(tcp, &self.url, path, token.as_deref()).await,
                Some(connector) => {
                    let name = tokio_rustls::rustls::pki_types::ServerName::try_from(
                        self.url.host.clone(),
                    )
                    .map_err(|e| format!("`{}` is not a TLS server name: {e}", self.url.host))?;
                    let tls = connector
                        .connect(name, tcp)
                        .await
                        .map_err(|e| format!("TLS with {}: {e}", self.url))?;
                    get_over(tls, &self.url, path, token.as_deref()).await
                }
            }
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "{} did not answer GET {path} within {} ms",
                self.url,
                self.timeout.as_millis()
            )),
        }
    }
}

/// One HTTP/1.1 `GET path` over `io`.
async fn get_over<S>(
    io: S,
    url: &ApiUrl,
    path: &str,
    token: Option<&str>,
) -> Result<(u16, Bytes), String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(|e| format!("HTTP with {url}: {e}"))?;
    let conn = tokio::spawn(conn);
    let mut req = hyper::Request::get(path)
        .header(hyper::header::HOST, url.authority())
        .header(hyper::header::ACCEPT, "application/json");
    if let Some(t) = token {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let req = req
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|e| format!("GET {path}: {e}"))?;
    let answer = async {
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("GET {url}{path}: {e}"))?;
        let status = resp.status().as_u16();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| format!("GET {url}{path}: the answer: {e}"))?
            .to_bytes();
        Ok((status, body))
    }
    .await;
    conn.abort();
    answer
}
