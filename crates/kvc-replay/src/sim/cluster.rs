//! The workers of a topology: their roles, capabilities, names and the empty view a router
//! starts from.

use super::SimConfig;
use kvc_core::{Capabilities, Topology, WorkerId, WorkerRole, WorkerState};
use kvc_policy::WorkerView;

/// Roles of the workers of a topology, in worker-id order (prefill first).
pub fn worker_roles(t: Topology) -> Vec<WorkerRole> {
    t.layout(false).into_iter().map(|(role, _)| role).collect()
}

/// Roles and declared capabilities of the workers a run simulates, in worker-id order: the
/// topology's layout, with local prefill where the configuration's engines serve turns alone
/// ([`SimConfig::local_prefill`]).
pub fn worker_layout(cfg: &SimConfig) -> Vec<(WorkerRole, Capabilities)> {
    cfg.topology.layout(cfg.local_prefill)
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

/// Names of the workers that decode (decode and colocated ones), in worker-id order: the
/// workers a summary reports on.
pub(crate) fn decode_worker_names(roles: &[WorkerRole], names: &[String]) -> Vec<String> {
    roles
        .iter()
        .zip(names)
        .filter(|(r, _)| **r != WorkerRole::Prefill)
        .map(|(_, n)| n.clone())
        .collect()
}

/// Names of the workers a summary reports on: those that host sessions (decode workers,
/// prefill workers that serve turns alone) or serve colocated, in worker-id order.
pub(crate) fn host_names(layout: &[(WorkerRole, Capabilities)], names: &[String]) -> Vec<String> {
    layout
        .iter()
        .zip(names)
        .filter(|((r, caps), _)| *r != WorkerRole::Prefill || caps.hosts_sessions())
        .map(|(_, n)| n.clone())
        .collect()
}

/// The initial view of a cluster: every worker empty and healthy, with its capabilities.
pub fn initial_views(cfg: &SimConfig) -> Vec<WorkerView> {
    worker_layout(cfg)
        .iter()
        .enumerate()
        .map(|(i, (role, caps))| {
            WorkerView::new(
                WorkerId(i as u32),
                *role,
                WorkerState::empty(cfg.profile.hardware.kv_pool_tokens),
            )
            .with_caps(*caps)
        })
        .collect()
}
