//! The HTTP front's shared state: the routing service, the worker endpoints and the pooled
//! client that reaches them, the circuit breakers, the session book and the settings.

use super::breaker::Breakers;
use super::endpoints::{HttpWorker, LiveEndpoints, WorkerEndpoints};
use super::options::HttpOptions;
use super::pairing::BootstrapRooms;
use super::session::Sessions;
use crate::RouterService;
use crate::telemetry::Telemetry;
use crate::worker_http::WorkerClient;
use axum::http::HeaderName;
use kvc_core::WorkerId;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Everything a request handler needs, shared by all of them.
pub(crate) struct App {
    pub(crate) service: Arc<RouterService>,
    /// Where each worker is reached: kept up to date as workers join and leave the fleet.
    pub(crate) workers: LiveEndpoints,
    pub(super) client: WorkerClient,
    pub(crate) breakers: Breakers,
    pub(super) sessions: Sessions,
    pub(super) rooms: BootstrapRooms,
    pub(crate) options: HttpOptions,
    /// The router's tracing (off unless configured): one span per request and per worker
    /// call.
    pub(crate) telemetry: Telemetry,
    /// [`HttpOptions::session_header`] as a header name; `None` when it is not one (then no
    /// worker request carries it).
    pub(crate) session_header: Option<HeaderName>,
    /// `kvc_router_http_session_keys_total` by source: every session header, and the body.
    session_keys: HashMap<String, prometheus_client::metrics::counter::Counter>,
    next_request: AtomicU64,
    /// The prefill gate ([`HttpOptions::prefills_per_worker`]).
    pub(super) gate: super::gate::PrefillGate,
}

impl App {
    pub(crate) fn new(
        service: Arc<RouterService>,
        workers: WorkerEndpoints,
        options: HttpOptions,
        telemetry: Telemetry,
    ) -> App {
        let sessions = Sessions::new(service.config().sessions, options.infer_min_blocks);
        let workers = LiveEndpoints::new(workers);
        {
            let workers = workers.clone();
            service.watch_fleet(move |change| workers.apply(change));
        }
        let session_keys = options
            .session_headers
            .iter()
            .map(String::as_str)
            .chain(super::request::BODY_SESSION_SOURCES)
            .map(|source| {
                let counter = service.metrics().session_key_counter(source);
                (source.to_owned(), counter)
            })
            .collect();
        App {
            client: WorkerClient::new(options.pool),
            breakers: Breakers::new(options.breaker, options.request_timeout),
            gate: super::gate::PrefillGate::new(options.prefills_per_worker),
            session_header: HeaderName::from_bytes(options.session_header.as_bytes()).ok(),
            sessions,
            rooms: BootstrapRooms::new(),
            service,
            workers,
            options,
            telemetry,
            session_keys,
            next_request: AtomicU64::new(1),
        }
    }

    /// Counts a request whose session key came from `source` (a session header, or the
    /// body's [`super::request::BODY_SESSION_SOURCES`]).
    pub(super) fn count_session_key(&self, source: &str) {
        if let Some(c) = self.session_keys.get(source) {
            c.inc();
        }
    }

    /// A fresh id for the next client request (from 1).
    pub(super) fn next_request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// Feeds one worker's result to its circuit breaker.
    pub(crate) fn feed_breaker(&self, worker: WorkerId, failed: bool) {
        if failed {
            self.breakers
                .on_failure(&self.service, worker, self.service.now_ms());
        } else {
            self.breakers.on_success(&self.service, worker);
        }
    }

    /// Worker `id`'s endpoint.
    pub(crate) fn endpoint(&self, id: WorkerId) -> Option<HttpWorker> {
        self.workers.get(id)
    }
}
