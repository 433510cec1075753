//! The fleet changed by its operator while the router runs: a worker added
//! ([`RouterService::add_worker`]), drained or put back ([`RouterService::set_drained`]) or
//! removed ([`RouterService::remove_worker`]), and a re-read configuration applied as far as a
//! running router can ([`RouterService::reload`]).

use super::{RouterService, Workers};
use crate::config::{RouterConfig, WorkerConfig};
use crate::error::RequestError;
use crate::workers::WorkerEntry;
use kvc_core::WorkerId;
use kvc_policy::{Fleet, WorkerView};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// What is told of each change of the fleet ([`RouterService::watch_fleet`]).
pub(super) type FleetWatcher = Box<dyn Fn(&FleetChange) + Send + Sync>;

/// A worker that joined or left the fleet, as the watchers registered with
/// [`RouterService::watch_fleet`] are told.
#[derive(Debug, Clone, PartialEq)]
pub enum FleetChange {
    /// A worker is about to join, with its configuration entry: told before any decision can
    /// choose it (so that, e.g., the HTTP front knows where to reach it first).
    Joining(Box<WorkerConfig>),
    /// The worker joined: it is in the fleet (its background tasks may start).
    Added(WorkerId),
    /// A worker left: told once no decision can choose it any more.
    Removed(WorkerId),
}

/// What [`RouterService::remove_worker`] left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Removed {
    /// Sessions that were resident on it, or placed there by a decision still in flight:
    /// each is re-seeded on another worker at its next turn.
    pub resident_sessions: usize,
    /// Decisions on it still awaiting their outcome: their requests run on, and their
    /// outcomes are taken as usual when they come.
    pub in_flight: usize,
}

/// What [`RouterService::reload`] did with a re-read configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reload {
    /// The changes applied (a worker added, removed, drained or back in rotation).
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

/// Why `list`'s workers cannot serve together (no decode worker left, colocated and P/D
/// workers mixed …), if they cannot.
fn fleet_problem(list: &[Arc<WorkerEntry>]) -> Option<String> {
    let views: Vec<WorkerView> = list.iter().map(|w| w.view_at(0)).collect();
    Fleet::new(&views).err().map(|e| e.to_string())
}

impl RouterService {
    /// Calls `watcher` for every worker added or removed from now on, on the thread that
    /// makes the change (see [`FleetChange`] for when each is told).
    pub fn watch_fleet(&self, watcher: impl Fn(&FleetChange) + Send + Sync + 'static) {
        self.fleet_watchers.write().push(Box::new(watcher));
    }

    fn tell_watchers(&self, change: &FleetChange) {
        for w in self.fleet_watchers.read().iter() {
            w(change);
        }
    }

    /// Adds a worker to the running fleet, configured by `cfg` as a `[[workers]]` entry: it
    /// is checked with the fleet as the configuration file's workers are (its id unused and
    /// below the limit, its keys valid, the fleet still one the policy can route), then
    /// takes new sessions as soon as its state says it is up; an engine it only names by
    /// `http-url` is discovered as at start. Errors: `FailedPrecondition` for an id in use or
    /// a fleet the policy cannot route, `InvalidArgument` for an entry that is not valid.
    pub fn add_worker(&self, cfg: WorkerConfig) -> Result<(), RequestError> {
        self.add_workers(vec![cfg])
    }

    /// Adds several workers at once, as [`RouterService::add_worker`] adds one: all or none,
    /// the fleet checked with all of them (so a prefill worker and a decode worker can join
    /// a fleet that neither could join alone).
    pub fn add_workers(&self, cfgs: Vec<WorkerConfig>) -> Result<(), RequestError> {
        let _changing = self.changing.lock();
        let now = self.workers();
        let names = || {
            cfgs.iter()
                .map(|c| format!("{} (`{}`)", c.id, c.display_name()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let label = |cfgs: &[WorkerConfig]| match cfgs {
            [one] => format!("worker {} (`{}`)", one.id, one.display_name()),
            _ => format!("workers {}", names()),
        };
        for cfg in &cfgs {
            if now.get(cfg.id).is_some() {
                return Err(RequestError::FailedPrecondition(format!(
                    "worker {} is already in the fleet (`{}`): remove it first, or use another id",
                    cfg.id,
                    now.config(cfg.id)
                        .map_or_else(String::new, WorkerConfig::display_name)
                )));
            }
        }
        let mut whole = self.config.clone();
        whole.workers = now.configs.clone();
        whole.workers.extend(cfgs.iter().cloned());
        whole.validate().map_err(|e| {
            RequestError::InvalidArgument(format!("{} not added: {e}", label(&cfgs)))
        })?;
        let mut list = now.list.clone();
        let mut entries = Vec::with_capacity(cfgs.len());
        for cfg in &cfgs {
            let mut entry = WorkerEntry::new(cfg, &self.config);
            entry.share_health_epoch(&self.health_epoch);
            let entry = Arc::new(entry);
            list.push(Arc::clone(&entry));
            entries.push(entry);
        }
        if let Some(problem) = fleet_problem(&list) {
            return Err(RequestError::FailedPrecondition(format!(
                "{} not added: {problem}",
                label(&cfgs)
            )));
        }
        let mut configs = now.configs.clone();
        configs.extend(cfgs.iter().cloned());
        let table = Arc::new(Workers::new(list, configs));
        for cfg in &cfgs {
            self.tell_watchers(&FleetChange::Joining(Box::new(cfg.clone())));
        }
        {
            let mut core = self.core.lock();
            for cfg in &cfgs {
                core.state
                    .set_worker_blocks(cfg.worker_id(), cfg.capacity_tokens);
                core.state
                    .set_direct_append(cfg.worker_id(), cfg.can_append_prefill());
            }
            core.fleet.rebuild(&table.list);
            *self.workers.write() = table;
        }
        for (cfg, entry) in cfgs.iter().zip(&entries) {
            entry.refresh_snapshot(self.now_ms());
            tracing::info!(worker = cfg.id, name = %entry.name, role = ?cfg.role, "worker added to the fleet");
        }
        self.health_epoch.fetch_add(1, Ordering::Release);
        for cfg in &cfgs {
            self.tell_watchers(&FleetChange::Added(cfg.worker_id()));
        }
        Ok(())
    }

    /// Removes `worker` from the running fleet: it takes no new request from now on, its
    /// background tasks stop, the router forgets what it believed the worker held (the
    /// sessions resident there are re-seeded elsewhere at their next turn), and what its
    /// engine's events said leaves the index. Requests already sent to it run on; their
    /// outcomes are taken as usual, once each. Errors: `NotFound` for a worker not in the
    /// fleet, `FailedPrecondition` when the workers left could not serve (the last decode
    /// worker, …).
    pub fn remove_worker(&self, worker: WorkerId) -> Result<Removed, RequestError> {
        let _changing = self.changing.lock();
        let now = self.workers();
        let Some(entry) = now.get(worker.0).cloned() else {
            return Err(RequestError::NotFound(format!(
                "worker {} is not in the fleet",
                worker.0
            )));
        };
        let keep: Vec<usize> = (0..now.list.len())
            .filter(|&i| now.list[i].id != worker)
            .collect();
        let list: Vec<Arc<WorkerEntry>> = keep.iter().map(|&i| Arc::clone(&now.list[i])).collect();
        if let Some(problem) = fleet_problem(&list) {
            return Err(RequestError::FailedPrecondition(format!(
                "worker {} (`{}`) not removed: without it, {problem}; add its replacement first \
                 (or drain it)",
                worker.0, entry.name
            )));
        }
        let configs = keep.iter().map(|&i| now.configs[i].clone()).collect();
        let table = Arc::new(Workers::new(list, configs));
        let removed = {
            let mut core = self.core.lock();
            *self.workers.write() = table;
            let core = &mut *core;
            core.fleet.rebuild(&self.workers().list);
            let resident_sessions = core.state.forget_worker(worker);
            let in_flight = core.pending.values().filter(|p| p.decode == worker).count();
            Removed {
                resident_sessions,
                in_flight,
            }
        };
        entry.stop_tasks();
        self.pool_owned.write().remove(&worker.0);
        self.local_commit.write().remove(&worker);
        let _ = self.kv_index.write().clear(worker);
        self.health_epoch.fetch_add(1, Ordering::Release);
        tracing::info!(
            worker = worker.0,
            name = %entry.name,
            resident_sessions = removed.resident_sessions,
            in_flight = removed.in_flight,
            "worker removed from the fleet: its sessions move at their next turn"
        );
        self.tell_watchers(&FleetChange::Removed(worker));
        Ok(removed)
    }

    /// Adds the workers of some of the inference pool's pods ([`crate::pool`]): as
    /// [`RouterService::add_workers`], and a re-read of the file leaves them alone.
    pub(crate) fn add_pool_workers(&self, cfgs: Vec<WorkerConfig>) -> Result<(), RequestError> {
        let ids: Vec<u32> = cfgs.iter().map(|c| c.id).collect();
        self.pool_owned.write().extend(ids.iter().copied());
        let added = self.add_workers(cfgs);
        if added.is_err() {
            let mut owned = self.pool_owned.write();
            for id in &ids {
                owned.remove(id);
            }
        }
        added
    }

    /// Records what the inference pool's reader found (shown on `/metrics`).
    pub(crate) fn set_pool_stats(&self, stats: crate::metrics::PoolStats) {
        *self.pool_stats.lock() = Some(stats);
    }

    /// Whether `worker` joined for one of the inference pool's pods.
    pub(crate) fn is_pool_worker(&self, worker: u32) -> bool {
        self.pool_owned.read().contains(&worker)
    }

    /// The lowest worker id from `from` up that no worker holds, if any is left.
    pub(crate) fn lowest_free_id(&self, from: u32) -> Option<u32> {
        let now = self.workers();
        (from..kvc_policy::MAX_WORKERS as u32).find(|&id| now.get(id).is_none())
    }

    /// The name worker `id` has in the fleet, if it is in it.
    pub(crate) fn worker_name(&self, id: u32) -> Option<String> {
        self.entry(id).map(|e| e.name.clone())
    }

    /// A token for a background task of `worker`: cancelled with `stop`, and when the worker
    /// leaves the fleet (already cancelled for a worker not in it).
    pub fn worker_task_token(
        &self,
        worker: WorkerId,
        stop: &tokio_util::sync::CancellationToken,
    ) -> tokio_util::sync::CancellationToken {
        match self.entry(worker.0) {
            Some(e) => e.task_token(stop),
            None => {
                let t = stop.child_token();
                t.cancel();
                t
            }
        }
    }

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

    /// Applies what a re-read configuration changes that a running router can take: workers
    /// added ([`RouterService::add_worker`]) and removed ([`RouterService::remove_worker`]),
    /// and each worker's `drained`. Everything else that differs from the running
    /// configuration (another key of a worker, any other setting) is reported, not applied:
    /// it needs a restart, or, for a worker, removing it and adding it back.
    pub fn reload(&self, new: &RouterConfig) -> Reload {
        let mut report = Reload::default();
        let now = self.workers();
        // Removed first: an id given to another engine is taken out, then added anew. The
        // inference pool's workers are the pool's, not the file's.
        for old in &now.configs {
            if self.is_pool_worker(old.id) {
                continue;
            }
            let replaced = new
                .worker(WorkerId(old.id))
                .is_some_and(|w| w.role != old.role);
            if new.worker(WorkerId(old.id)).is_some() && !replaced {
                continue;
            }
            match self.remove_worker(WorkerId(old.id)) {
                Ok(r) => report.applied.push(format!(
                    "worker {} (`{}`) removed ({} resident session(s) move at their next turn, \
                     {} request(s) in flight run on)",
                    old.id,
                    old.display_name(),
                    r.resident_sessions,
                    r.in_flight
                )),
                Err(e) => report.needs_restart.push(e.to_string()),
            }
        }
        let now = self.workers();
        for w in &new.workers {
            if self.is_pool_worker(w.id) {
                report.needs_restart.push(format!(
                    "worker {} (`{}`) not added: id {} is held by the inference pool's pod `{}`; \
                     give the file's workers ids below inference-pool.first-id",
                    w.id,
                    w.display_name(),
                    w.id,
                    self.worker_name(w.id).unwrap_or_default()
                ));
                continue;
            }
            let Some(old) = now.config(w.id) else {
                match self.add_worker(w.clone()) {
                    Ok(()) => report.applied.push(format!(
                        "worker {} (`{}`) added{}",
                        w.id,
                        w.display_name(),
                        if w.drained { ", drained" } else { "" }
                    )),
                    Err(e) => report.needs_restart.push(e.to_string()),
                }
                continue;
            };
            let changed = changed_keys(old, w);
            if !changed.is_empty() {
                report.needs_restart.push(format!(
                    "worker {} (`{}`): {} changed: needs a restart, or removing the worker and \
                     adding it back",
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
