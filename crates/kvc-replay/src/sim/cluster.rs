//! The workers of a topology: their roles, capabilities, names and the empty view a router
//! starts from.

use super::SimConfig;
use kvc_core::{Capabilities, WorkerId, WorkerRole, WorkerState};
pub use kvc_engine_sim::cluster::{layout_names, worker_names, worker_roles};
use kvc_policy::WorkerView;

/// Roles and declared capabilities of the workers a run simulates, in worker-id order: the
/// topology's layout, with local prefill where the configuration's engines serve turns alone
/// ([`SimConfig::local_prefill`]).
pub fn worker_layout(cfg: &SimConfig) -> Vec<(WorkerRole, Capabilities)> {
    cfg.topology.layout(cfg.local_prefill)
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
