//! Where the HTTP front reaches each worker: its base URL and, for a prefill worker, its
//! disaggregation bootstrap port.

use super::error::FrontError;
use crate::config::{RouterConfig, WorkerUrl};
use kvc_core::{EngineKind, WorkerId};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::Arc;

pub use crate::config::DEFAULT_BOOTSTRAP_PORT;

/// Every worker the HTTP front forwards to, by id.
#[derive(Debug, Clone, Default)]
pub struct WorkerEndpoints {
    workers: HashMap<WorkerId, HttpWorker>,
}

/// One worker's HTTP endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpWorker {
    /// Its base URL, parsed.
    pub url: WorkerUrl,
    /// The bootstrap port of a prefill worker (ignored for others).
    pub bootstrap_port: u16,
    /// The engine it runs (its `engine` key): `vllm` is forwarded in vLLM's NixlConnector
    /// dialect, anything else in SGLang's bootstrap dialect.
    pub engine: Option<EngineKind>,
}

impl WorkerEndpoints {
    /// No workers.
    pub fn new() -> Self {
        WorkerEndpoints::default()
    }

    /// The endpoints of the configured workers that have an `http-url`.
    pub fn from_config(config: &RouterConfig) -> Result<Self, FrontError> {
        let mut workers = WorkerEndpoints::new();
        for w in &config.workers {
            if let Some(url) = &w.http_url {
                workers.insert(w.worker_id(), url, w.bootstrap_port)?;
                workers.set_engine(w.worker_id(), w.engine);
            }
        }
        Ok(workers)
    }

    /// Registers worker `id` at `url` (`http://host:port[/prefix]`); `bootstrap_port` is the
    /// disaggregation bootstrap port of a prefill worker ([`DEFAULT_BOOTSTRAP_PORT`] when
    /// `None`). Replaces an earlier entry for `id`.
    pub fn insert(
        &mut self,
        id: WorkerId,
        url: &str,
        bootstrap_port: Option<u16>,
    ) -> Result<(), FrontError> {
        let url =
            WorkerUrl::parse(url).map_err(|url| FrontError::WorkerUrl { worker: id.0, url })?;
        self.workers.insert(
            id,
            HttpWorker {
                url,
                bootstrap_port: bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT),
                engine: None,
            },
        );
        Ok(())
    }

    /// Declares the engine worker `id` runs (no effect for an unregistered worker).
    pub fn set_engine(&mut self, id: WorkerId, engine: Option<EngineKind>) {
        if let Some(w) = self.workers.get_mut(&id) {
            w.engine = engine;
        }
    }

    /// Whether worker `id` is a vLLM engine (forwarded in the NixlConnector dialect).
    pub fn is_vllm(&self, id: WorkerId) -> bool {
        self.workers
            .get(&id)
            .is_some_and(|w| w.engine == Some(EngineKind::Vllm))
    }

    /// Whether any worker is a vLLM engine (then SGLang's `/generate` is not served).
    pub fn any_vllm(&self) -> bool {
        self.workers
            .values()
            .any(|w| w.engine == Some(EngineKind::Vllm))
    }

    /// Whether every worker is a vLLM engine (then the coding agents' APIs are served).
    pub fn all_vllm(&self) -> bool {
        !self.workers.is_empty()
            && self
                .workers
                .values()
                .all(|w| w.engine == Some(EngineKind::Vllm))
    }

    /// Worker `id`'s endpoint.
    pub fn get(&self, id: WorkerId) -> Option<&HttpWorker> {
        self.workers.get(&id)
    }

    /// Every worker and its endpoint, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerId, &HttpWorker)> {
        self.workers.iter().map(|(id, w)| (*id, w))
    }

    /// Forgets worker `id`'s endpoint (it left the fleet).
    pub fn remove(&mut self, id: WorkerId) {
        self.workers.remove(&id);
    }

    /// Number of workers registered.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether no worker is registered.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

/// The endpoints as the running front reads them: those it started with, and those of the
/// workers added since ([`LiveEndpoints::apply`]), without those removed.
#[derive(Debug, Clone, Default)]
pub(crate) struct LiveEndpoints(Arc<RwLock<WorkerEndpoints>>);

impl LiveEndpoints {
    pub(crate) fn new(endpoints: WorkerEndpoints) -> Self {
        LiveEndpoints(Arc::new(RwLock::new(endpoints)))
    }

    /// Takes in a worker added (with an `http-url`) or removed.
    pub(crate) fn apply(&self, change: &crate::FleetChange) {
        match change {
            crate::FleetChange::Joining(cfg) => {
                let Some(url) = &cfg.http_url else { return };
                let mut w = self.0.write();
                match w.insert(cfg.worker_id(), url, cfg.bootstrap_port) {
                    Ok(()) => w.set_engine(cfg.worker_id(), cfg.engine),
                    Err(e) => tracing::error!(worker = cfg.id, "{e}"),
                }
            }
            crate::FleetChange::Removed(id) => self.0.write().remove(*id),
            crate::FleetChange::Added(_) => {}
        }
    }

    /// Worker `id`'s endpoint.
    pub(crate) fn get(&self, id: WorkerId) -> Option<HttpWorker> {
        self.0.read().get(id).cloned()
    }

    /// See [`WorkerEndpoints::is_vllm`].
    pub(crate) fn is_vllm(&self, id: WorkerId) -> bool {
        self.0.read().is_vllm(id)
    }

    /// See [`WorkerEndpoints::any_vllm`].
    pub(crate) fn any_vllm(&self) -> bool {
        self.0.read().any_vllm()
    }

    /// See [`WorkerEndpoints::all_vllm`].
    pub(crate) fn all_vllm(&self) -> bool {
        self.0.read().all_vllm()
    }

    /// Every worker and its endpoint now, in no particular order.
    pub(crate) fn iter(&self) -> std::vec::IntoIter<(WorkerId, HttpWorker)> {
        let now: Vec<_> = self
            .0
            .read()
            .iter()
            .map(|(id, w)| (id, w.clone()))
            .collect();
        now.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WorkerConfig;
    use kvc_core::WorkerRole;

    #[test]
    fn workers_need_http_urls() {
        let mut w = WorkerEndpoints::new();
        assert!(w.is_empty());
        w.insert(WorkerId(3), "http://h:1", None).unwrap();
        assert_eq!(
            w.get(WorkerId(3)).unwrap().bootstrap_port,
            DEFAULT_BOOTSTRAP_PORT
        );
        w.insert(WorkerId(3), "http://h:2", Some(7)).unwrap();
        assert_eq!(w.len(), 1);
        assert_eq!(w.get(WorkerId(3)).unwrap().url.port, 2);
        assert_eq!(w.get(WorkerId(3)).unwrap().bootstrap_port, 7);
        let err = w.insert(WorkerId(4), "https://h:1", None).unwrap_err();
        assert!(
            matches!(&err, FrontError::WorkerUrl { worker: 4, url } if url == "https://h:1"),
            "{err}"
        );
        assert_eq!(w.get(WorkerId(4)), None);
    }

    #[test]
    fn the_configured_http_urls_are_the_endpoints() {
        let mut config = RouterConfig::default();
        let mut p = WorkerConfig::new(0, WorkerRole::Prefill, 10);
        p.http_url = Some("http://10.0.0.1:30000".into());
        p.bootstrap_port = Some(9000);
        let mut d = WorkerConfig::new(1, WorkerRole::Decode, 10);
        d.http_url = Some("http://10.0.0.2:30000/v".into());
        d.engine = Some(EngineKind::Vllm);
        config.workers = vec![p, d, WorkerConfig::new(2, WorkerRole::Decode, 10)];
        let w = WorkerEndpoints::from_config(&config).unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!(w.get(WorkerId(0)).unwrap().bootstrap_port, 9000);
        assert_eq!(w.get(WorkerId(1)).unwrap().url.prefix, "/v");
        assert_eq!(
            w.get(WorkerId(1)).unwrap().bootstrap_port,
            DEFAULT_BOOTSTRAP_PORT
        );
        assert_eq!(w.get(WorkerId(2)), None);
        assert!(w.is_vllm(WorkerId(1)) && !w.is_vllm(WorkerId(0)) && !w.is_vllm(WorkerId(2)));
        assert!(w.any_vllm());
    }
}
