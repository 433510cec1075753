//! Why the HTTP front cannot be built from a configuration.

use super::tokens::TokenizerError;
use crate::ServeError;

/// A configuration the HTTP front cannot start with.
#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    /// The tokenizer file (`http.tokenizer`) cannot be read or used.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A worker's `http-url` is not `http://host:port[/prefix]`.
    #[error("worker {worker} http-url `{url}` is not http://host:port[/prefix]")]
    WorkerUrl {
        /// The worker's id.
        worker: u32,
        /// The URL as configured.
        url: String,
    },
}

impl From<FrontError> for ServeError {
    fn from(e: FrontError) -> Self {
        ServeError::HttpFront(Box::new(e))
    }
}
