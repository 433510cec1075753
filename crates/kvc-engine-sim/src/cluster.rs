//! The simulated workers of one cluster: their layout, names, and the engine model they run.

use crate::model::{Engine, EngineOptions, Profile};
use kvc_core::{BlockSize, Capabilities, EvictionMode, Topology, WorkerRole};

/// What a cluster of simulated workers is: the one description the simulator, the live
/// replay and the HTTP workers build their engine model from.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Cluster shape.
    pub topology: Topology,
    /// Whether the engines serve turns alone (local prefill): decode workers, and the prefill
    /// workers of `NpMd-hybrid` shapes, then declare it ([`Topology::layout`]).
    pub local_prefill: bool,
    /// Engine profile (every worker's hardware and the timing physics).
    pub profile: Profile,
    /// Decode-side eviction.
    pub eviction: EvictionMode,
    /// Seed of the iteration-time jitter.
    pub seed: u64,
    /// Relative jitter of iteration times (deterministic from `seed`).
    pub jitter: f64,
    /// Tokens per block id of the requests the workers serve (the prefix caches count them).
    pub block_size: BlockSize,
}

impl ClusterSpec {
    /// Roles and declared capabilities of the workers, in worker-id order.
    pub fn layout(&self) -> Vec<(WorkerRole, Capabilities)> {
        self.topology.layout(self.local_prefill)
    }

    /// Roles of the workers, in worker-id order (prefill first).
    pub fn roles(&self) -> Vec<WorkerRole> {
        worker_roles(self.topology)
    }

    /// How many workers the cluster has.
    pub fn workers(&self) -> usize {
        self.roles().len()
    }

    /// The engine model of the cluster, every worker empty.
    pub fn engine(&self) -> Engine {
        Engine::with_layout(
            self.profile.clone(),
            EngineOptions {
                eviction: self.eviction.into(),
                block_size: self.block_size,
            },
            &self.layout(),
            self.seed,
            self.jitter,
        )
    }
}

/// Roles of the workers of a topology, in worker-id order (prefill first).
pub fn worker_roles(t: Topology) -> Vec<WorkerRole> {
    t.layout(false).into_iter().map(|(role, _)| role).collect()
}

/// Names of workers: `p0, p1, …, d0, d1, …` or `dp0, dp1, …`.
pub fn worker_names(roles: &[WorkerRole]) -> Vec<String> {
    let layout: Vec<(WorkerRole, Capabilities)> = roles
        .iter()
        .map(|r| (*r, Capabilities::of_role(*r)))
        .collect();
    layout_names(&layout)
}

/// Names of workers by role and capabilities: `p0, …` (prefill), `d0, …` (decode), `dp0, …`
/// (colocated), `x0, …` (decode workers that also prefill for others: all-capable).
pub fn layout_names(layout: &[(WorkerRole, Capabilities)]) -> Vec<String> {
    let (mut p, mut d, mut c, mut x) = (0, 0, 0, 0);
    let next = |n: &mut usize, prefix: &str| {
        *n += 1;
        format!("{prefix}{}", *n - 1)
    };
    layout
        .iter()
        .map(|(r, caps)| match r {
            WorkerRole::Prefill => next(&mut p, "p"),
            WorkerRole::Decode if caps.prefill => next(&mut x, "x"),
            WorkerRole::Decode => next(&mut d, "d"),
            WorkerRole::Colocated => next(&mut c, "dp"),
        })
        .collect()
}
