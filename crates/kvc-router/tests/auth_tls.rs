//! Bearer tokens and TLS on the router's listeners: without the token (or with a wrong one) the
//! HTTP front answers 401 with a JSON body and the gRPC API `UNAUTHENTICATED`; with it, the
//! call is served. TLS listeners serve TLS clients (with a client certificate when the gRPC
//! listener asks for one) and refuse plain ones. Certificates are made here with rcgen.
#![forbid(unsafe_code)]

mod common;

use common::{Cluster, TempDir, base_config, route_req};
use kvc_proto::pb;
use kvc_proto::pb::router_client::RouterClient;
use kvc_router::auth::{AuthConfig, TokenSource};
use kvc_router::tls::{ListenerTls, TlsConfig};
use kvc_router::{RouterConfig, RunningRouter};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::rustls;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const HTTP_TOKEN: &str = "http-token-7f3a9c";
const GRPC_TOKEN: &str = "grpc-token-41be02";

/// An HTTP/1.1 request over `stream` (closed after the answer): status, head, body.
async fn http_request<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<(u16, String, String)> {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head.push_str(body);
    stream.write_all(head.as_bytes()).await?;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(common::EXCHANGE, stream.read_to_end(&mut buf)).await;
    match read {
        Ok(Ok(_)) => {}
        // A TLS peer may end without close_notify once the answer is complete.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof && !buf.is_empty() => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => return Err(std::io::Error::other("no answer in time")),
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {text:?}")))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status in {head:?}")))?;
    Ok((status, head.to_owned(), body.to_owned()))
}

async fn plain_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> std::io::Result<(u16, String, String)> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    http_request(tcp, method, path, headers, "").await
}

fn write(dir: &TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.0.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Token files in `dir` for both listeners (the environment-variable source is exercised
/// through the binary, whose environment a test can set).
fn token_config(dir: &TempDir) -> AuthConfig {
    AuthConfig {
        http: Some(TokenSource::file(write(
            dir,
            "http.token",
            &format!("{HTTP_TOKEN}\n"),
        ))),
        grpc: Some(TokenSource::file(write(dir, "grpc.token", GRPC_TOKEN))),
    }
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

async fn start(cfg: RouterConfig) -> RunningRouter {
    kvc_router::serve(cfg, std::future::pending())
        .await
        .unwrap()
}

fn authed<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut()
        .insert("authorization", bearer(token).parse().unwrap());
    r
}

#[tokio::test]
async fn grpc_calls_need_the_token_and_health_does_not() {
    let token_file = TempDir::new("grpc-token");
    let path = write(&token_file, "grpc.token", &format!("  {GRPC_TOKEN}\n"));
    let mut c = Cluster::start(|cfg| {
        cfg.auth.grpc = Some(TokenSource::file(path));
    })
    .await;
    let cl = &mut c.client;
    // No token, a wrong one, a wrong scheme: UNAUTHENTICATED for every method.
    let e = cl.ping(pb::PingRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    for wrong in ["grpc-token-41be0", "grpc-token-41be022", "x"] {
        let e = cl
            .route(authed(route_req(1, Some(1), Some(1), 600, &[1, 2]), wrong))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    }
    let mut basic = tonic::Request::new(pb::ListWorkersRequest {});
    basic.metadata_mut().insert(
        "authorization",
        format!("Basic {GRPC_TOKEN}").parse().unwrap(),
    );
    assert_eq!(
        cl.list_workers(basic).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    for e in [
        cl.report_outcome(pb::OutcomeReport::default())
            .await
            .unwrap_err(),
        cl.probe(pb::ProbeRequest::default()).await.unwrap_err(),
        cl.commit_evict(pb::CommitEvictRequest::default())
            .await
            .unwrap_err(),
    ] {
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    }
    // A malformed body without the token is refused for the token, not for the body.
    assert_eq!(c.service().metrics().decision_count(), 0);
    assert_eq!(c.service().session_count(), 0);

    // With the token: served.
    let cl = &mut c.client;
    cl.ping(authed(pb::PingRequest {}, GRPC_TOKEN))
        .await
        .unwrap();
    let d = cl
        .route(authed(
            route_req(1, Some(1), Some(1), 600, &[1, 2]),
            GRPC_TOKEN,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.prefill_worker, Some(0));
    let workers = cl
        .list_workers(authed(pb::ListWorkersRequest {}, GRPC_TOKEN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(workers.workers.len(), 3);

    // Health answers without a token.
    let ch = Channel::from_shared(format!("http://{}", c.router.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch);
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "kvc.v1.Router".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        status.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

#[tokio::test]
async fn http_requests_need_the_token_and_livez_does_not() {
    let dir = TempDir::new("http-token");
    let auth = token_config(&dir);
    let c = Cluster::start(|cfg| {
        cfg.http_listen = Some("127.0.0.1:0".parse().unwrap());
        cfg.auth.http = auth.http.clone();
    })
    .await;
    let addr = c.router.http_addr().unwrap();
    for headers in [
        vec![],
        vec![("authorization", "Bearer http-token-7f3a9")],
        vec![("authorization", "Bearer grpc-token-41be02")],
        vec![("authorization", HTTP_TOKEN)],
    ] {
        for (method, path) in [
            ("GET", "/health"),
            ("GET", "/v1/models"),
            ("POST", "/generate"),
        ] {
            let (status, head, body) = plain_request(addr, method, path, &headers).await.unwrap();
            assert_eq!(status, 401, "{method} {path} {headers:?}");
            assert!(
                head.to_ascii_lowercase()
                    .contains("www-authenticate: bearer"),
                "{head}"
            );
            let json: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(json["error"]["code"], 401, "{body}");
            assert_eq!(json["error"]["type"], "unauthorized", "{body}");
        }
    }
    let right = bearer(HTTP_TOKEN);
    // With the token, `/health` is the readiness probe: these workers have no `http-url`, so
    // nothing can be routed over HTTP and it says so.
    let (status, _, body) = plain_request(addr, "GET", "/health", &[("authorization", &right)])
        .await
        .unwrap();
    assert_eq!(status, 503, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["status"], "unavailable", "{body}");
    let (status, _, body) = plain_request(addr, "GET", "/v1/models", &[("authorization", &right)])
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    // Liveness is open (whether or not the front serves it, it is never 401).
    let (status, _, _) = plain_request(addr, "GET", "/livez", &[]).await.unwrap();
    assert_ne!(status, 401);
}

/// A `MakeWriter` collecting every log line in memory.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

/// Every log line of a router refusing and serving calls, at the most verbose level of the
/// router's own modules, holds neither the configured tokens nor the wrong ones presented.
#[tokio::test(flavor = "current_thread")]
async fn tokens_are_never_logged() {
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("kvc_router=trace,info"))
        .with_writer(logs.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let dir = TempDir::new("token-logs");
    let grpc_file = write(&dir, "grpc.token", GRPC_TOKEN);
    let http_file = write(&dir, "http.token", HTTP_TOKEN);
    let mut c = Cluster::start(|cfg| {
        // Non-loopback listeners would be warned about; these are loopback with tokens.
        cfg.http_listen = Some("127.0.0.1:0".parse().unwrap());
        cfg.auth.grpc = Some(TokenSource::file(&grpc_file));
        cfg.auth.http = Some(TokenSource::file(&http_file));
    })
    .await;
    let wrong = "wrong-token-d00d";
    let _ = c.client.ping(authed(pb::PingRequest {}, wrong)).await;
    c.client
        .ping(authed(pb::PingRequest {}, GRPC_TOKEN))
        .await
        .unwrap();
    let _ = c
        .client
        .route(authed(route_req(1, Some(1), Some(1), 0, &[]), GRPC_TOKEN))
        .await;
    let addr = c.router.http_addr().unwrap();
    let w = bearer(wrong);
    let r = bearer(HTTP_TOKEN);
    plain_request(addr, "GET", "/health", &[("authorization", &w)])
        .await
        .unwrap();
    plain_request(addr, "GET", "/health", &[("authorization", &r)])
        .await
        .unwrap();
    c.router.shutdown();
    let Cluster { router, .. } = c;
    router.wait().await.unwrap();
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("kvc-router serving"),
        "nothing captured:\n{text}"
    );
    for secret in [GRPC_TOKEN, HTTP_TOKEN, wrong] {
        assert!(!text.contains(secret), "{secret} logged:\n{text}");
    }
    // Nor does the configuration's debug form (it names the files, not their content).
    let cfg = RouterConfig {
        auth: AuthConfig {
            http: Some(TokenSource::file(&http_file)),
            grpc: Some(TokenSource::env("KVC_TEST_UNUSED")),
        },
        ..RouterConfig::default()
    };
    let shown = format!("{cfg:?}");
    assert!(
        !shown.contains(HTTP_TOKEN) && shown.contains("http.token"),
        "{shown}"
    );
}

/// A CA, a server certificate for `localhost` and 127.0.0.1 signed by it, and a client
/// certificate signed by it, as PEM files in `dir`.
struct Pki {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: String,
    client_key: String,
    ca_pem: String,
}

impl Pki {
    fn new(dir: &TempDir) -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf = |names: Vec<String>| {
            let key = KeyPair::generate().unwrap();
            let cert = CertificateParams::new(names)
                .unwrap()
                .signed_by(&key, &issuer)
                .unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(vec!["localhost".into(), "127.0.0.1".into()]);
        let (client_cert, client_key) = leaf(vec!["client.kvc.test".into()]);
        Pki {
            ca: write(dir, "ca.pem", &ca.pem()),
            server_cert: write(dir, "server.pem", &server_cert),
            server_key: write(dir, "server.key", &server_key),
            client_cert,
            client_key,
            ca_pem: ca.pem(),
        }
    }

    fn listener(&self, client_ca: bool) -> ListenerTls {
        ListenerTls {
            cert: self.server_cert.clone(),
            key: self.server_key.clone(),
            client_ca: client_ca.then(|| self.ca.clone()),
        }
    }

    fn client_tls(&self, with_identity: bool) -> ClientTlsConfig {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .domain_name("localhost");
        if with_identity {
            tls.identity(Identity::from_pem(&self.client_cert, &self.client_key))
        } else {
            tls
        }
    }

    /// A rustls client trusting only this CA.
    fn connector(&self) -> tokio_rustls::TlsConnector {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject as _;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }
}

/// `Ping` over a channel to `addr` with `tls` (none: plain), or why it failed.
async fn ping(addr: SocketAddr, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Channel::from_shared(format!("{scheme}://{addr}"))
        .unwrap()
        .connect_timeout(common::EXCHANGE)
        .timeout(common::EXCHANGE);
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    RouterClient::new(channel)
        .ping(pb::PingRequest {})
        .await
        .map(|_| ())
        .map_err(|e| format!("ping: {e:?}"))
}

fn tls_config(dir: &TempDir, tls: TlsConfig) -> RouterConfig {
    RouterConfig {
        metrics_listen: None,
        http_listen: Some("127.0.0.1:0".parse().unwrap()),
        tls,
        ..base_config(dir)
    }
}

#[tokio::test]
async fn tls_listeners_serve_tls_clients_and_refuse_plain_ones() {
    let dir = TempDir::new("tls");
    let pki = Pki::new(&dir);
    let router = start(tls_config(
        &dir,
        TlsConfig {
            http: Some(pki.listener(false)),
            grpc: Some(pki.listener(false)),
        },
    ))
    .await;
    // gRPC: a TLS client trusting the CA is served; a plain one is not.
    ping(router.grpc_addr(), Some(pki.client_tls(false)))
        .await
        .unwrap();
    let plain = ping(router.grpc_addr(), None).await;
    assert!(plain.is_err(), "a plain client was served");

    // HTTP: the same over TLS with ALPN http/1.1; plain HTTP gets no HTTP answer.
    let addr = router.http_addr().unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = pki.connector().connect(name, tcp).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), None);
    let (status, _, body) = http_request(tls, "GET", "/v1/models", &[], "")
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"object\":\"list\""), "{body}");
    let plain = plain_request(addr, "GET", "/v1/models", &[]).await;
    assert!(plain.is_err(), "a plain HTTP client was served: {plain:?}");
    // A client that never finishes its handshake holds up no one.
    let _stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = pki.connector().connect(name, tcp).await.unwrap();
    let (status, _, _) = http_request(tls, "GET", "/v1/models", &[], "")
        .await
        .unwrap();
    assert_eq!(status, 200);
    router.shutdown();
    router.wait().await.unwrap();
}

#[tokio::test]
async fn mutual_tls_refuses_clients_without_a_certificate() {
    let dir = TempDir::new("mtls");
    let pki = Pki::new(&dir);
    let router = start(RouterConfig {
        http_listen: None,
        ..tls_config(
            &dir,
            TlsConfig {
                http: None,
                grpc: Some(pki.listener(true)),
            },
        )
    })
    .await;
    let without = ping(router.grpc_addr(), Some(pki.client_tls(false))).await;
    assert!(without.is_err(), "served without a client certificate");
    // A certificate from another CA is refused as well.
    let other = Pki::new(&TempDir::new("mtls-other"));
    let foreign = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost")
        .identity(Identity::from_pem(&other.client_cert, &other.client_key));
    assert!(ping(router.grpc_addr(), Some(foreign)).await.is_err());
    ping(router.grpc_addr(), Some(pki.client_tls(true)))
        .await
        .unwrap();
    router.shutdown();
    router.wait().await.unwrap();
}

#[tokio::test]
async fn tokens_and_tls_together() {
    let dir = TempDir::new("tls-token");
    let pki = Pki::new(&dir);
    let router = start(RouterConfig {
        auth: token_config(&dir),
        ..tls_config(
            &dir,
            TlsConfig {
                http: Some(pki.listener(false)),
                grpc: Some(pki.listener(true)),
            },
        )
    })
    .await;
    let channel = Channel::from_shared(format!("https://{}", router.grpc_addr()))
        .unwrap()
        .tls_config(pki.client_tls(true))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = RouterClient::new(channel);
    let e = client.ping(pb::PingRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    client
        .ping(authed(pb::PingRequest {}, GRPC_TOKEN))
        .await
        .unwrap();

    let addr = router.http_addr().unwrap();
    let connect = || async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        pki.connector().connect(name, tcp).await.unwrap()
    };
    let (status, _, _) = http_request(connect().await, "GET", "/v1/models", &[], "")
        .await
        .unwrap();
    assert_eq!(status, 401);
    let right = bearer(HTTP_TOKEN);
    let (status, _, _) = http_request(
        connect().await,
        "GET",
        "/v1/models",
        &[("authorization", &right)],
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    router.shutdown();
    router.wait().await.unwrap();
}

/// The binary reads the gRPC token from the environment variable `token-env` names, and
/// refuses to start, naming the variable, when it is not set.
#[test]
fn the_binary_reads_a_token_from_the_environment() {
    use std::io::{BufRead as _, BufReader};
    use std::process::{Command, Stdio};
    const BIN: &str = env!("CARGO_BIN_EXE_kvc-router");
    let dir = TempDir::new("token-env");
    let cfg = write(
        &dir,
        "router.toml",
        "listen = \"127.0.0.1:0\"\nmetrics-listen = \"127.0.0.1:0\"\n\
         [auth.grpc]\ntoken-env = \"KVC_TEST_ROUTER_TOKEN\"\n",
    );
    let unset = Command::new(BIN)
        .arg("--config")
        .arg(&cfg)
        .env_remove("KVC_TEST_ROUTER_TOKEN")
        .output()
        .unwrap();
    assert!(!unset.status.success());
    let err = String::from_utf8_lossy(&unset.stderr);
    assert!(err.contains("KVC_TEST_ROUTER_TOKEN"), "{err}");

    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(&cfg)
        .env("KVC_TEST_ROUTER_TOKEN", GRPC_TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let grpc = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("grpc="))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = RouterClient::connect(format!("http://{grpc}"))
            .await
            .unwrap();
        let e = client.ping(pb::PingRequest {}).await.unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated);
        client
            .ping(authed(pb::PingRequest {}, GRPC_TOKEN))
            .await
            .unwrap();
    });
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains(GRPC_TOKEN), "token logged: {err}");
}
