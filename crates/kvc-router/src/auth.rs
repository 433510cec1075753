//! Bearer-token authentication of the listeners: one token for the HTTP front (`[auth.http]`)
//! and another for the gRPC control API (`[auth.grpc]`), each read at startup from a file
//! (`token-file`) or an environment variable (`token-env`), never from the command line.
//!
//! - A request presents `authorization: Bearer <token>`; the token is compared in constant time
//!   (the time depends on the lengths only). Missing or wrong: HTTP `401` with a JSON error
//!   body and `www-authenticate: Bearer`, gRPC `UNAUTHENTICATED`. The answer does not say which.
//! - HTTP: every path needs the token except `GET /livez` (liveness says nothing about
//!   routing and must answer an orchestrator without credentials).
//! - gRPC: every method of every service on the listener needs it (`kvc.v1.Router`: `Route`,
//!   `ReportOutcome`, `Probe`, `CommitEvict`, `ListWorkers`, `Ping`; reflection) except the
//!   standard health service `grpc.health.v1.Health`. One token per listener: `Route` and
//!   `ListWorkers` change or reveal as much as the feedback calls (sessions, pending
//!   decisions, the cluster's layout), so they are not left open.
//! - A listener without a token serves everyone. At startup the router warns for each
//!   listener bound to a non-loopback address without authentication (the metrics listener
//!   has none: bind it to loopback or a private network).
//!
//! The token is never logged: [`Token`]'s `Debug` prints its length only, and the
//! configuration holds the file path or the variable name, not the secret.

use crate::config::PerListener;
use crate::config::RouterConfig;
use crate::error::ConfigError;
use axum::http::{HeaderMap, HeaderValue, Request, Response, header};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use subtle::ConstantTimeEq as _;

/// The HTTP path that answers without a token.
pub const OPEN_HTTP_PATH: &str = "/livez";

/// The gRPC service whose methods answer without a token.
pub const OPEN_GRPC_SERVICE: &str = "grpc.health.v1.Health";

/// The listeners' tokens: the `[auth]` table (`[auth.http]`, `[auth.grpc]`). A listener
/// without one serves everyone.
pub type AuthConfig = PerListener<TokenSource>;

impl AuthConfig {
    /// Checks each table: exactly one of `token-file` and `token-env`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, source) in [("auth.http", &self.http), ("auth.grpc", &self.grpc)] {
            if let Some(s) = source {
                s.validate(name)?;
            }
        }
        Ok(())
    }
}

/// Where a token is read from: exactly one of the two keys.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct TokenSource {
    /// A file holding the token (surrounding whitespace, such as a final newline, is ignored;
    /// a relative path is from the working directory). Keep it readable by the router only.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = &"/etc/kvc/http.token"))]
    pub token_file: Option<PathBuf>,
    /// The name of an environment variable holding the token.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = &"KVC_GRPC_TOKEN"))]
    pub token_env: Option<String>,
}

impl TokenSource {
    /// A token read from `path`.
    pub fn file(path: impl Into<PathBuf>) -> Self {
        TokenSource {
            token_file: Some(path.into()),
            token_env: None,
        }
    }

    /// A token read from the environment variable `name`.
    pub fn env(name: impl Into<String>) -> Self {
        TokenSource {
            token_file: None,
            token_env: Some(name.into()),
        }
    }

    fn validate(&self, table: &str) -> Result<(), ConfigError> {
        match (&self.token_file, &self.token_env) {
            (Some(_), None) => Ok(()),
            (None, Some(name)) if !name.is_empty() => Ok(()),
            (None, Some(_)) => Err(ConfigError::Invalid(format!(
                "{table}.token-env must name a variable"
            ))),
            _ => Err(ConfigError::Invalid(format!(
                "{table} needs exactly one of token-file and token-env"
            ))),
        }
    }

    /// Reads the token: the file's content or the variable's value, trimmed. A file that
    /// cannot be read, an unset variable, an empty token or one that cannot travel in an
    /// `authorization` header (anything but visible ASCII) is an error naming the file or
    /// variable (never the value).
    pub fn load(&self, table: &str) -> Result<Token, ConfigError> {
        let (raw, from) = match (&self.token_file, &self.token_env) {
            (Some(path), None) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                (text, format!("{table}.token-file {}", path.display()))
            }
            (None, Some(name)) => {
                let value = std::env::var(name).map_err(|_| {
                    ConfigError::Invalid(format!(
                        "{table}.token-env: environment variable {name} is not set (or not UTF-8)"
                    ))
                })?;
                (value, format!("{table}.token-env {name}"))
            }
            _ => {
                return Err(ConfigError::Invalid(format!(
                    "{table} needs exactly one of token-file and token-env"
                )));
            }
        };
        Token::new(raw.trim()).ok_or_else(|| {
            ConfigError::Invalid(format!(
                "{from}: the token must be non-empty visible ASCII without spaces"
            ))
        })
    }
}

/// A bearer token. Its `Debug` shows its length, never its value.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Box<[u8]>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token(<{} bytes>)", self.0.len())
    }
}

impl Token {
    /// `secret` as a token; `None` when it is empty or holds anything but visible ASCII.
    pub fn new(secret: &str) -> Option<Token> {
        let ok = !secret.is_empty() && secret.bytes().all(|b| b.is_ascii_graphic());
        ok.then(|| Token(secret.as_bytes().into()))
    }

    /// Whether `presented` is this token, compared in constant time for a given length.
    pub fn matches(&self, presented: &[u8]) -> bool {
        bool::from(self.0.as_ref().ct_eq(presented))
    }

    /// Whether `headers` carry `authorization: Bearer <this token>` (the scheme in any case).
    pub fn admits(&self, headers: &HeaderMap) -> bool {
        headers
            .get(header::AUTHORIZATION)
            .and_then(bearer)
            .is_some_and(|t| self.matches(t))
    }
}

/// The credentials of an `authorization: Bearer <credentials>` value.
fn bearer(value: &HeaderValue) -> Option<&[u8]> {
    let v = value.as_bytes();
    let scheme = v.get(..7)?;
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then(|| v[7..].trim_ascii())
}

/// The tokens the listeners check, read once at startup.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    /// The HTTP front's.
    pub http: Option<Arc<Token>>,
    /// The gRPC listener's.
    pub grpc: Option<Arc<Token>>,
}

impl Tokens {
    /// Reads the tokens `config` names ([`TokenSource::load`]).
    pub fn load(config: &AuthConfig) -> Result<Tokens, ConfigError> {
        let load = |source: &Option<TokenSource>, table| {
            source
                .as_ref()
                .map(|s| s.load(table).map(Arc::new))
                .transpose()
        };
        Ok(Tokens {
            http: load(&config.http, "auth.http")?,
            grpc: load(&config.grpc, "auth.grpc")?,
        })
    }
}

/// `app` with every path but [`OPEN_HTTP_PATH`] behind `token` (`app` unchanged without one).
pub fn require_http(app: axum::Router, token: Option<Arc<Token>>) -> axum::Router {
    match token {
        Some(token) => app.layer(axum::middleware::from_fn(
            move |req: Request<axum::body::Body>, next: axum::middleware::Next| {
                let token = Arc::clone(&token);
                async move {
                    if req.uri().path() == OPEN_HTTP_PATH || token.admits(req.headers()) {
                        next.run(req).await
                    } else {
                        unauthorized_http()
                    }
                }
            },
        )),
        None => app,
    }
}

/// `401` with the HTTP front's JSON error shape.
fn unauthorized_http() -> Response<axum::body::Body> {
    let body = serde_json::json!({
        "error": {
            "message": "missing or invalid bearer token",
            "type": "unauthorized",
            "code": 401,
        }
    });
    let mut response = Response::new(axum::body::Body::from(body.to_string()));
    *response.status_mut() = axum::http::StatusCode::UNAUTHORIZED;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// The tower layer of the gRPC listener: every call but those to [`OPEN_GRPC_SERVICE`]
/// needs the token; without one the layer lets everything through.
#[derive(Debug, Clone, Default)]
pub struct GrpcAuthLayer {
    token: Option<Arc<Token>>,
}

impl GrpcAuthLayer {
    /// Calls checked against `token` (none: not checked).
    pub fn new(token: Option<Arc<Token>>) -> Self {
        GrpcAuthLayer { token }
    }
}

impl<S> tower::Layer<S> for GrpcAuthLayer {
    type Service = GrpcAuth<S>;

    fn layer(&self, inner: S) -> GrpcAuth<S> {
        GrpcAuth {
            inner,
            token: self.token.clone(),
        }
    }
}

/// The service [`GrpcAuthLayer`] wraps around the gRPC routes.
#[derive(Debug, Clone)]
pub struct GrpcAuth<S> {
    inner: S,
    token: Option<Arc<Token>>,
}

/// Whether a gRPC request path (`/package.Service/Method`) belongs to [`OPEN_GRPC_SERVICE`].
fn open_grpc_path(path: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|p| p.strip_prefix(OPEN_GRPC_SERVICE))
        .is_some_and(|rest| rest.starts_with('/'))
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<Request<B>> for GrpcAuth<S>
where
    S: tower::Service<Request<B>, Response = Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let allowed = match &self.token {
            None => true,
            Some(t) => open_grpc_path(req.uri().path()) || t.admits(req.headers()),
        };
        if allowed {
            Box::pin(self.inner.call(req))
        } else {
            let status = tonic::Status::unauthenticated("missing or invalid bearer token");
            Box::pin(std::future::ready(Ok(status.into_http())))
        }
    }
}

/// Logs a warning for each listener `config` binds to a non-loopback address without
/// authentication (HTTP and gRPC without a token, and the metrics listener, which has none).
pub(crate) fn warn_open_listeners(config: &RouterConfig) {
    let listeners: [(&str, Option<SocketAddr>, bool, &str); 3] = [
        (
            "grpc",
            Some(config.listen),
            config.auth.grpc.is_some(),
            "set [auth.grpc] or bind to loopback",
        ),
        (
            "http",
            config.http_listen,
            config.auth.http.is_some(),
            "set [auth.http] or bind to loopback",
        ),
        (
            "metrics",
            config.metrics_listen,
            false,
            "it has no authentication: bind it to loopback or a private network",
        ),
    ];
    for (what, addr, authenticated, advice) in listeners {
        if let Some(addr) = addr
            && !addr.ip().is_loopback()
            && !authenticated
        {
            tracing::warn!(
                listener = %what,
                %addr,
                "listener bound to a non-loopback address without authentication: anyone who reaches it is served ({advice})"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn bearer_tokens_are_matched_exactly() {
        let t = Token::new("s3cret-token").unwrap();
        assert!(t.admits(&headers("Bearer s3cret-token")));
        assert!(t.admits(&headers("bearer s3cret-token")));
        assert!(t.admits(&headers("BEARER  s3cret-token ")));
        for wrong in [
            "Bearer s3cret-toke",
            "Bearer s3cret-token2",
            "Bearer ",
            "Basic s3cret-token",
            "s3cret-token",
            "Bearers3cret-token",
        ] {
            assert!(!t.admits(&headers(wrong)), "{wrong}");
        }
        assert!(!t.admits(&HeaderMap::new()));
        assert_eq!(format!("{t:?}"), "Token(<12 bytes>)");
        for bad in ["", "two words", "tab\there", "é"] {
            assert!(Token::new(bad).is_none(), "{bad:?}");
        }
    }

    /// Log lines written while `f` runs.
    fn logged(f: impl FnOnce()) -> String {
        use std::sync::Mutex;
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let sink = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let bytes = buf.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn open_listeners_off_loopback_are_warned_about() {
        let mut cfg = RouterConfig {
            listen: "0.0.0.0:50051".parse().unwrap(),
            metrics_listen: Some("127.0.0.1:9464".parse().unwrap()),
            http_listen: Some("[::]:8000".parse().unwrap()),
            ..RouterConfig::default()
        };
        let text = logged(|| warn_open_listeners(&cfg));
        assert_eq!(text.matches("without authentication").count(), 2, "{text}");
        assert!(
            text.contains("listener=grpc") && text.contains("listener=http"),
            "{text}"
        );
        cfg.auth.grpc = Some(TokenSource::env("T"));
        cfg.metrics_listen = Some("10.1.2.3:9464".parse().unwrap());
        let text = logged(|| warn_open_listeners(&cfg));
        assert!(!text.contains("listener=grpc"), "{text}");
        assert!(
            text.contains("listener=http") && text.contains("listener=metrics"),
            "{text}"
        );
        let quiet = RouterConfig::default();
        assert_eq!(logged(|| warn_open_listeners(&quiet)), "");
    }

    #[test]
    fn health_is_the_only_open_grpc_service() {
        assert!(open_grpc_path("/grpc.health.v1.Health/Check"));
        assert!(open_grpc_path("/grpc.health.v1.Health/Watch"));
        assert!(!open_grpc_path("/grpc.health.v1.HealthX/Check"));
        assert!(!open_grpc_path("/kvc.v1.Router/Route"));
        assert!(!open_grpc_path(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
        ));
        assert!(!open_grpc_path("grpc.health.v1.Health/Check"));
    }

    #[test]
    fn sources_need_exactly_one_key_and_name_what_failed() {
        let both = TokenSource {
            token_file: Some("/x".into()),
            token_env: Some("X".into()),
        };
        for bad in [TokenSource::default(), both, TokenSource::env("")] {
            assert!(
                matches!(bad.validate("auth.http"), Err(ConfigError::Invalid(ref m)) if m.starts_with("auth.http")),
                "{bad:?}"
            );
        }
        let missing = TokenSource::file("/nonexistent/kvc-token");
        assert!(matches!(
            missing.load("auth.grpc"),
            Err(ConfigError::Read { ref path, .. }) if path == std::path::Path::new("/nonexistent/kvc-token")
        ));
        let unset = TokenSource::env("KVC_TEST_TOKEN_NEVER_SET");
        let err = unset.load("auth.grpc").unwrap_err().to_string();
        assert!(err.contains("KVC_TEST_TOKEN_NEVER_SET"), "{err}");

        let dir = std::env::temp_dir().join(format!("kvc-auth-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "  abc.DEF-123\n").unwrap();
        let t = TokenSource::file(&file).load("auth.http").unwrap();
        assert!(t.matches(b"abc.DEF-123"));
        std::fs::write(&file, "two words\n").unwrap();
        let err = TokenSource::file(&file)
            .load("auth.http")
            .unwrap_err()
            .to_string();
        assert!(err.contains("auth.http.token-file"), "{err}");
        assert!(!err.contains("two words"), "the value leaked: {err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
