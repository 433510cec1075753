//! The HTTP front's settings, and how they are read from the `[http]` table of the
//! configuration.

use super::breaker::BreakerOptions;
use super::error::FrontError;
use super::tokens::Tokenizer;
use crate::config::HttpConfig;
use crate::worker_http::PoolOptions;
use std::time::Duration;

/// Settings of the HTTP front.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpOptions {
    /// Header carrying the session key to the workers. Default `x-session-id`.
    pub session_header: String,
    /// Headers the client's session key is read from, in order, lowercase
    /// (`http.session-headers`; default [`crate::HttpConfig::DEFAULT_SESSION_HEADERS`]).
    pub session_headers: Vec<String>,
    /// Headers naming an agent within the client's session, lowercase
    /// (`http.session-agent-headers`; default [`crate::HttpConfig::DEFAULT_AGENT_HEADERS`]).
    pub agent_headers: Vec<String>,
    /// Headers naming a subagent's parent session by its key, lowercase
    /// (`http.session-parent-headers`; default [`crate::HttpConfig::DEFAULT_PARENT_HEADERS`]).
    pub parent_headers: Vec<String>,
    /// Headers naming a subagent's parent agent within its session, lowercase
    /// (`http.session-parent-agent-headers`; default
    /// [`crate::HttpConfig::DEFAULT_PARENT_AGENT_HEADERS`]).
    pub parent_agent_headers: Vec<String>,
    /// Deadline of each worker call (connect, send, whole answer). Default 300 s.
    pub request_timeout: Duration,
    /// The pool of connections to the workers.
    pub pool: PoolOptions,
    /// The model name `/v1/models` lists when no worker is reached over HTTP (else it lists
    /// what the workers' own `/v1/models` says). Default `default`.
    pub model: String,
    /// Largest request body accepted, in bytes; larger ones get 413 with a JSON error.
    /// Default 16 MiB.
    pub max_body_bytes: usize,
    /// How many times a request that failed before any byte reached the client is routed
    /// and forwarded again (see the module docs). Default 2.
    pub max_retries: u32,
    /// Wait before the first retry; it doubles for each further one, and each wait is
    /// shortened by a random jitter of up to a half. Default 25 ms.
    pub retry_backoff: Duration,
    /// The per-worker circuit breakers.
    pub breaker: BreakerOptions,
    /// How often every worker's `GET /health` is checked; `None` checks nothing. Default 5 s.
    pub health_check_interval: Option<Duration>,
    /// Deadline of one health check. Default 1 s.
    pub health_check_timeout: Duration,
    /// How text prompts become token ids. Default: the whitespace fallback.
    pub tokenizer: Tokenizer,
    /// Session inference: the fewest full blocks a prompt without a session key needs to be
    /// placed in a session by its prefix (see the module docs); 0 turns inference off.
    /// Default 1.
    pub infer_min_blocks: u32,
    /// Longest session id accepted (header or `session_params.id`), in bytes; a longer one
    /// gets 400. Default 256.
    pub max_session_id_bytes: usize,
    /// A request body must be complete within this time of the request's head; otherwise
    /// 408 and the connection is closed. Default 30 s.
    pub body_read_timeout: Duration,
    /// Turns one worker prefills itself at a time, before their first token; the others wait
    /// in the front, the fewest tokens to prefill first (`http.prefills-per-worker`; the
    /// prefill gate, `gate.rs`). 0 (the default): no limit.
    pub prefills_per_worker: usize,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            session_header: "x-session-id".to_owned(),
            session_headers: lowercase(&crate::HttpConfig::DEFAULT_SESSION_HEADERS),
            agent_headers: lowercase(&crate::HttpConfig::DEFAULT_AGENT_HEADERS),
            parent_headers: lowercase(&crate::HttpConfig::DEFAULT_PARENT_HEADERS),
            parent_agent_headers: lowercase(&crate::HttpConfig::DEFAULT_PARENT_AGENT_HEADERS),
            request_timeout: Duration::from_secs(300),
            pool: PoolOptions::default(),
            model: "default".to_owned(),
            max_body_bytes: 16 << 20,
            max_retries: 2,
            retry_backoff: Duration::from_millis(25),
            breaker: BreakerOptions::default(),
            health_check_interval: Some(Duration::from_secs(5)),
            health_check_timeout: Duration::from_secs(1),
            tokenizer: Tokenizer::fallback(),
            infer_min_blocks: 1,
            max_session_id_bytes: 256,
            body_read_timeout: Duration::from_secs(30),
            prefills_per_worker: 0,
        }
    }
}

impl HttpOptions {
    /// The `[http]` table's settings (the others at their defaults), with the tokenizer file
    /// loaded: [`FrontError::Tokenizer`] when it cannot be used.
    pub fn from_config(config: &HttpConfig) -> Result<Self, FrontError> {
        let ms = Duration::from_millis;
        let tokenizer = match &config.tokenizer {
            Some(path) => Tokenizer::from_file(path)?,
            None => Tokenizer::fallback(),
        };
        Ok(HttpOptions {
            request_timeout: ms(config.request_timeout_ms),
            pool: PoolOptions {
                connect_timeout: ms(config.connect_timeout_ms),
                idle_timeout: ms(config.pool_idle_timeout_ms),
                max_idle_per_worker: config.pool_max_idle_per_worker,
            },
            max_retries: config.max_retries,
            retry_backoff: ms(config.retry_backoff_ms),
            breaker: BreakerOptions {
                failure_threshold: config.breaker_failures,
                cooldown: ms(config.breaker_cooldown_ms),
                max_cooldown: ms(config.breaker_max_cooldown_ms),
            },
            health_check_interval: (config.health_check_interval_ms > 0)
                .then(|| ms(config.health_check_interval_ms)),
            health_check_timeout: ms(config.health_check_timeout_ms),
            tokenizer,
            infer_min_blocks: config.infer_min_blocks,
            max_session_id_bytes: config.max_session_id_bytes,
            session_headers: lowercase(&config.session_headers),
            agent_headers: lowercase(&config.session_agent_headers),
            parent_headers: lowercase(&config.session_parent_headers),
            parent_agent_headers: lowercase(&config.session_parent_agent_headers),
            max_body_bytes: config.max_body_bytes,
            body_read_timeout: ms(config.body_read_timeout_ms),
            prefills_per_worker: config.prefills_per_worker,
            ..HttpOptions::default()
        })
    }
}

fn lowercase<S: AsRef<str>>(names: &[S]) -> Vec<String> {
    names
        .iter()
        .map(|n| n.as_ref().to_ascii_lowercase())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_http_table_becomes_the_options() {
        let config = HttpConfig {
            max_retries: 1,
            breaker_failures: 0,
            health_check_interval_ms: 0,
            request_timeout_ms: 700,
            connect_timeout_ms: 30,
            pool_idle_timeout_ms: 40,
            pool_max_idle_per_worker: 0,
            prefills_per_worker: 2,
            ..HttpConfig::default()
        };
        let o = HttpOptions::from_config(&config).unwrap();
        assert_eq!(o.max_retries, 1);
        assert_eq!(o.prefills_per_worker, 2);
        assert_eq!(o.breaker.failure_threshold, 0);
        assert_eq!(o.health_check_interval, None);
        assert_eq!(o.request_timeout, Duration::from_millis(700));
        assert_eq!(
            o.pool,
            PoolOptions {
                connect_timeout: Duration::from_millis(30),
                idle_timeout: Duration::from_millis(40),
                max_idle_per_worker: 0,
            }
        );
        assert_eq!(o.session_header, "x-session-id");
        // The defaults of both agree.
        assert_eq!(
            HttpOptions::from_config(&HttpConfig::default()).unwrap(),
            HttpOptions::default()
        );
    }

    #[test]
    fn a_missing_tokenizer_file_is_an_error_naming_it() {
        let config = HttpConfig {
            tokenizer: Some(Path::new("/nowhere/tokenizer.json").to_owned()),
            ..HttpConfig::default()
        };
        let err = HttpOptions::from_config(&config).unwrap_err();
        assert!(matches!(err, FrontError::Tokenizer(_)), "{err}");
        assert!(err.to_string().contains("/nowhere/tokenizer.json"), "{err}");
    }
}
