//! The workers of a topology: their roles, names and the empty view a router starts from.

use super::SimConfig;
use kvc_core::{Topology, WorkerId, WorkerRole, WorkerState};
use kvc_policy::WorkerView;

/// Roles of the workers of a topology, in worker-id order (prefill first).
pub fn worker_roles(t: Topology) -> Vec<WorkerRole> {
    match t {
        Topology::Disaggregated { prefill, decode } => {
            let mut v = vec![WorkerRole::Prefill; prefill as usize];
            v.extend(std::iter::repeat_n(WorkerRole::Decode, decode as usize));
            v
        }
        Topology::Colocated { workers } => vec![WorkerRole::Colocated; workers as usize],
    }
}

/// Names of workers: `p0, p1, …, d0, d1, …` or `dp0, dp1, …`.
pub fn worker_names(roles: &[WorkerRole]) -> Vec<String> {
    let (mut p, mut d, mut c) = (0, 0, 0);
    roles
        .iter()
        .map(|r| match r {
            WorkerRole::Prefill => {
                p += 1;
                format!("p{}", p - 1)
            }
            WorkerRole::Decode => {
                d += 1;
                format!("d{}", d - 1)
            }
            WorkerRole::Colocated => {
                c += 1;
                format!("dp{}", c - 1)
            }
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

/// The initial view of a cluster: every worker empty and healthy.
pub fn initial_views(cfg: &SimConfig) -> Vec<WorkerView> {
    worker_roles(cfg.topology)
        .iter()
        .enumerate()
        .map(|(i, r)| WorkerView {
            id: WorkerId(i as u32),
            role: *r,
            state: WorkerState::empty(cfg.profile.hardware.kv_pool_tokens),
        })
        .collect()
}
