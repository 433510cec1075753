//! How the simulated workers show their state to a router: each worker's shared-memory
//! snapshot file (`kvc-admission`'s layout), and, as stock vLLM engines do, `/metrics` and
//! KV-cache events ([`engine_signals`], [`kv_events`]).
//!
//! | module | job |
//! |---|---|
//! | this one | [`Publisher`]: every worker's state into its snapshot and its engine signals, at each publish |
//! | [`engine_signals`] | vLLM-named `/metrics` per worker, and the event publishers' sockets |
//! | [`kv_events`] | the workers' residents as vLLM's `BlockStored` / `BlockRemoved` events |
//! | [`labels`] | the session keys events name sessions by (standalone workers) |

pub mod engine_signals;
pub mod kv_events;
pub mod labels;

pub use labels::SessionLabels;

use crate::model::{Engine, Micros};
use crate::{ClusterSpec, WorkerError};
use kvc_admission::{
    Clock, ResidentEntry, ResidentState, SnapshotData, SnapshotWriter, SystemClock,
};
use kvc_core::{StateSource, WorkerId, WorkerState};
use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The snapshot file of worker `id` in `dir`.
pub fn snapshot_path(dir: &Path, id: WorkerId) -> PathBuf {
    dir.join(format!("w{}.snap", id.0))
}

/// Publishes every worker's state: into its snapshot file, and/or as its engine signals.
pub struct Publisher {
    writers: Vec<SnapshotWriter>,
    data: SnapshotData,
    /// Every worker's state at the last publish (by worker id), what its `/metrics` shows.
    board: StateBoard,
    /// The workers' engine signals, updated at every publish when served.
    signals: Option<engine_signals::EngineSignals>,
}

/// Every worker's state at the last publish, by worker id: what a worker's `/metrics`
/// renders (on its own port with [`Publisher::serve_engine_signals`], and on a vLLM worker's
/// HTTP port).
pub type StateBoard = Arc<Mutex<Vec<WorkerState>>>;

impl Publisher {
    /// Creates one snapshot file per worker of `cluster` in `dir`, with `table_slots` resident
    /// slots each.
    pub fn create(
        cluster: &ClusterSpec,
        dir: &Path,
        table_slots: usize,
    ) -> Result<Self, WorkerError> {
        let mut p = Self::without_snapshots(cluster);
        std::fs::create_dir_all(dir).map_err(|e| WorkerError::Snapshot {
            path: dir.display().to_string(),
            message: e.to_string(),
        })?;
        let capacity = cluster.profile.hardware.kv_pool_tokens;
        let mut writers = Vec::new();
        for i in 0..cluster.workers() {
            let id = WorkerId(i as u32);
            let path = snapshot_path(dir, id);
            let w = SnapshotWriter::create(&path, id, capacity, table_slots).map_err(|e| {
                WorkerError::Snapshot {
                    path: path.display().to_string(),
                    message: e.to_string(),
                }
            })?;
            writers.push(w);
        }
        p.writers = writers;
        Ok(p)
    }

    /// The publisher for a router reading `state`: snapshot files in `dir`, or, for engine
    /// signals, none (`dir` is still created: it holds a spawned router's configuration).
    pub fn for_router_state(
        cluster: &ClusterSpec,
        state: StateSource,
        dir: &Path,
        table_slots: usize,
    ) -> Result<Self, WorkerError> {
        if state != StateSource::Events {
            return Self::create(cluster, dir, table_slots);
        }
        std::fs::create_dir_all(dir).map_err(|e| WorkerError::Snapshot {
            path: dir.display().to_string(),
            message: e.to_string(),
        })?;
        Ok(Self::without_snapshots(cluster))
    }

    /// A publisher that writes no snapshot file (the workers' state goes out only as engine
    /// signals, once served).
    pub fn without_snapshots(cluster: &ClusterSpec) -> Self {
        let capacity = cluster.profile.hardware.kv_pool_tokens;
        Publisher {
            data: SnapshotData::empty(WorkerId(0), capacity),
            writers: Vec::new(),
            board: Arc::new(Mutex::new(vec![
                WorkerState::empty(capacity);
                cluster.workers()
            ])),
            signals: None,
        }
    }

    /// Also serves every worker's engine signals on `rt` until `stop`: vLLM-named `/metrics`
    /// (worker `i` on `127.0.0.1:<base + i>`, free ports when `None`) and KV-cache events;
    /// `trace_block` is the trace's tokens per block. Returns where a router finds them.
    pub fn serve_engine_signals(
        &mut self,
        rt: &tokio::runtime::Handle,
        base: Option<u16>,
        model: &str,
        trace_block: u64,
        stop: &CancellationToken,
    ) -> Result<Vec<engine_signals::EngineEndpoints>, WorkerError> {
        let signals = engine_signals::EngineSignals::serve(
            rt,
            Arc::clone(&self.board),
            base,
            model,
            trace_block,
            stop,
        )?;
        let endpoints = signals.endpoints();
        self.signals = Some(signals);
        Ok(endpoints)
    }

    /// Every worker's state as last published.
    pub fn board(&self) -> StateBoard {
        Arc::clone(&self.board)
    }

    /// Names sessions in the engine events (when served) by the keys in `labels`.
    pub fn label_sessions(&mut self, labels: SessionLabels) {
        if let Some(signals) = &mut self.signals {
            signals.label_sessions(labels);
        }
    }

    /// Publishes the engine's state of every worker, stamped with the wall clock.
    /// Engine time `t` (simulated µs since the start) is wall time `start_ms + t / speedup`.
    pub fn publish(
        &mut self,
        engine: &Engine,
        start_ms: u64,
        speedup: f64,
    ) -> Result<(), WorkerError> {
        let now = SystemClock.now_ms();
        let to_wall = |t: Micros| start_ms + (t as f64 / 1e3 / speedup) as u64;
        for (i, w) in self.writers.iter_mut().enumerate() {
            let id = WorkerId(i as u32);
            let s = engine.state(id);
            let d = &mut self.data;
            d.worker_id = id;
            d.capacity_tokens = s.capacity_tokens;
            d.used_tokens = s.used_tokens.min(s.capacity_tokens);
            d.free_tokens = s.free_tokens();
            d.evictable_tokens = s.evictable_tokens.min(d.used_tokens);
            d.queue_depth = s.queue_depth;
            d.in_flight = s.in_flight;
            d.publish_ms = now;
            d.residents.clear();
            let slots = w.max_sessions();
            d.residents
                .extend(engine.residents(id).into_iter().take(slots).map(
                    |(session, tokens, last, running)| ResidentEntry {
                        session,
                        tokens,
                        last_access_ms: to_wall(last).min(now),
                        state: if running {
                            ResidentState::Running
                        } else {
                            ResidentState::Idle
                        },
                    },
                ));
            w.publish(d).map_err(|e| WorkerError::Snapshot {
                path: format!("worker {i}"),
                message: e.to_string(),
            })?;
        }
        {
            let mut board = self.board.lock();
            for (i, s) in board.iter_mut().enumerate() {
                *s = engine.state(WorkerId(i as u32));
            }
        }
        if let Some(signals) = &mut self.signals {
            signals.update(engine, now as f64 / 1e3);
        }
        Ok(())
    }
}
