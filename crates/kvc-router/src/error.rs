//! Errors of the router: configuration, startup, and per-request failures.

use std::path::PathBuf;

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Not valid TOML, or keys of the wrong type or unknown.
    #[error("invalid config: {0}")]
    Parse(String),
    /// A value out of range or inconsistent.
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Why the router could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A listener could not be bound.
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        /// `"grpc"`, `"metrics"`, `"http"` or `"epp"`.
        what: &'static str,
        /// The address.
        addr: std::net::SocketAddr,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC reflection service could not be built from the descriptor set.
    #[error("reflection service: {0}")]
    Reflection(String),
    /// The gRPC server failed.
    #[error("grpc server: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The metrics server failed.
    #[error("metrics server: {0}")]
    Metrics(std::io::Error),
    /// The HTTP front could not be built from the configuration (e.g. its tokenizer file
    /// cannot be used); the message says what and names the file.
    #[error("http front: {0}")]
    HttpFront(Box<dyn std::error::Error + Send + Sync>),
    /// The HTTP data-plane server failed.
    #[error("http server: {0}")]
    Http(std::io::Error),
    /// Tracing could not be started (the `[tracing]` table).
    #[error(transparent)]
    Tracing(#[from] TelemetryError),
    /// The `kv-events-listen` socket could not be bound.
    #[error("kv-events-listen: {0}")]
    EventListener(String),
    /// A server task panicked or was cancelled.
    #[error("server task: {0}")]
    Join(String),
}

/// Why tracing could not be started (`crate::telemetry`).
#[derive(Debug, thiserror::Error)]
#[error("tracing: cannot build the OTLP exporter for {endpoint}: {message}")]
pub struct TelemetryError {
    pub(crate) endpoint: String,
    pub(crate) message: String,
}

/// Why one request failed; each kind maps to one gRPC status code ([`RequestError::code`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The request is malformed (`INVALID_ARGUMENT`).
    #[error("{0}")]
    InvalidArgument(String),
    /// A decision id the router does not remember (`NOT_FOUND`).
    #[error("{0}")]
    NotFound(String),
    /// The request cannot be served in the current configuration (`FAILED_PRECONDITION`).
    #[error("{0}")]
    FailedPrecondition(String),
    /// No worker can take the request now, or a worker did not answer (`UNAVAILABLE`).
    #[error("{0}")]
    Unavailable(String),
    /// A worker did not answer in time (`DEADLINE_EXCEEDED`).
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A worker is overloaded; retry after the pause (`RESOURCE_EXHAUSTED`).
    #[error("{0}")]
    ResourceExhausted(String),
    /// A bug or an unexpected failure (`INTERNAL`).
    #[error("{0}")]
    Internal(String),
}

impl RequestError {
    /// The gRPC status code of this error.
    pub fn code(&self) -> tonic::Code {
        match self {
            RequestError::InvalidArgument(_) => tonic::Code::InvalidArgument,
            RequestError::NotFound(_) => tonic::Code::NotFound,
            RequestError::FailedPrecondition(_) => tonic::Code::FailedPrecondition,
            RequestError::Unavailable(_) => tonic::Code::Unavailable,
            RequestError::DeadlineExceeded(_) => tonic::Code::DeadlineExceeded,
            RequestError::ResourceExhausted(_) => tonic::Code::ResourceExhausted,
            RequestError::Internal(_) => tonic::Code::Internal,
        }
    }
}

impl From<RequestError> for tonic::Status {
    fn from(e: RequestError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

impl From<kvc_policy::PolicyError> for RequestError {
    fn from(e: kvc_policy::PolicyError) -> Self {
        use kvc_policy::PolicyError as P;
        match e {
            P::NoHealthyWorker { .. } => RequestError::Unavailable(e.to_string()),
            P::WrongTopology { .. } => RequestError::FailedPrecondition(e.to_string()),
            other => RequestError::Internal(other.to_string()),
        }
    }
}
