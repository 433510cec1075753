//! The fleet changed by its operator while the router runs: a worker drained or put back
//! ([`RouterService::set_drained`]), and a re-read configuration applied as far as a running
//! router can ([`RouterService::reload`]).

use super::RouterService;
use crate::config::{RouterConfig, WorkerConfig};
use kvc_core::WorkerId;
use std::sync::atomic::Ordering;

/// What [`RouterService::reload`] did with a re-read configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reload {
    /// The changes applied (a worker drained or back in rotation).
    pub applied: Vec<String>,
    /// The changes left for a restart, each naming the worker and the keys.
    pub needs_restart: Vec<String>,
}

/// The keys of a worker entry that differ between `a` and `b`, `drained` aside.
fn changed_keys(a: &WorkerConfig, b: &WorkerConfig) -> Vec<String> {
    let as_map = |w: &WorkerConfig| {
        let mut w = w.clone();
        w.drained = false;
        match serde_json::to_value(&w) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        }
    };
    let (a, b) = (as_map(a), as_map(b));
    let mut keys: Vec<String> = a
        .keys()
        .chain(b.keys())
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

impl RouterService {
    /// Drains `worker` (`true`) or puts it back in rotation (`false`): a drained worker gets no
    /// new session and no turn (its sessions move at their next turn, as off a down worker),
    /// and the requests it runs finish. Returns whether it was drained before; `None` for an
    /// unknown worker.
    pub fn set_drained(&self, worker: WorkerId, drained: bool) -> Option<bool> {
        let entry = self.entry(worker.0)?;
        let before = entry.set_drained(drained);
        if before != drained {
            tracing::info!(
                worker = worker.0,
                name = %entry.name,
                "{}",
                if drained { "worker drained: no new work" } else { "worker back in rotation" }
            );
        }
        Some(before)
    }

    /// Whether `worker` is drained ([`RouterService::set_drained`]).
    pub fn is_drained(&self, worker: WorkerId) -> bool {
        self.entry(worker.0)
            .is_some_and(|e| e.drained.load(Ordering::Relaxed))
    }

    /// Applies what a re-read configuration changes that a running router can take: each
    /// worker's `drained`. Everything else that differs from the configuration the router
    /// started with (a worker added or removed, another key of a worker, any other setting)
    /// is reported, not applied: it needs a restart.
    pub fn reload(&self, new: &RouterConfig) -> Reload {
        let mut report = Reload::default();
        for w in &new.workers {
            let Some(old) = self.config.worker(WorkerId(w.id)) else {
                report.needs_restart.push(format!(
                    "worker {} (`{}`) added: adding a worker needs a restart",
                    w.id,
                    w.display_name()
                ));
                continue;
            };
            let changed = changed_keys(old, w);
            if !changed.is_empty() {
                report.needs_restart.push(format!(
                    "worker {} (`{}`): {} changed: needs a restart",
                    w.id,
                    w.display_name(),
                    changed.join(", ")
                ));
            }
            if self.set_drained(WorkerId(w.id), w.drained) != Some(w.drained) {
                report.applied.push(format!(
                    "worker {} (`{}`) {}",
                    w.id,
                    w.display_name(),
                    if w.drained {
                        "drained"
                    } else {
                        "back in rotation"
                    }
                ));
            }
        }
        for old in &self.config.workers {
            if new.worker(WorkerId(old.id)).is_none() {
                report.needs_restart.push(format!(
                    "worker {} (`{}`) removed: removing a worker needs a restart (set drained = \
                     true meanwhile)",
                    old.id,
                    old.display_name()
                ));
            }
        }
        let (mut a, mut b) = (self.config.clone(), new.clone());
        a.workers.clear();
        b.workers.clear();
        if a != b {
            report
                .needs_restart
                .push("settings other than the workers changed: they need a restart".to_owned());
        }
        report
    }
}
