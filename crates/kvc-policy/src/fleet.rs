//! The workers a router knows, prepared once for many decisions.
//!
//! [`crate::route`] takes a [`ClusterView`] and works out, for every decision, what the fleet
//! is (its topology, which workers are healthy in each role, where each id sits): a pass over
//! every worker. A [`Fleet`] keeps that between decisions — workers by id, the topology, the
//! healthy sets — and is changed in place when a worker's health changes
//! ([`Fleet::set_health`]), so [`crate::route_in`] costs what the workers it weighs cost, not
//! what the fleet is: a direct turn that stays on its worker reads that one worker's state.
//! The published states (pool, load) are asked of a [`WorkerStates`] source only for those
//! workers; a [`Fleet`] is one itself, with the states it was given.

use crate::error::PolicyError;
use crate::view::{MAX_WORKERS, WorkerView};
use crate::worker_set::WorkerSet;
use kvc_core::{Health, Topology, WorkerId, WorkerRole, WorkerState};

/// Where a decision reads the published state (pool, load) of a worker it weighs. Health is
/// the [`Fleet`]'s, not this source's: which workers may be chosen is decided there.
pub trait WorkerStates {
    /// The published state of `id`, a worker of the fleet the decision is made on.
    fn state(&self, id: WorkerId) -> WorkerState;
}

/// The workers a router knows, by id, with what every decision needs of the whole fleet
/// prepared: the topology (from roles and capabilities, which do not change) and the healthy
/// workers of each kind (kept as health changes).
#[derive(Debug, Clone)]
pub struct Fleet {
    /// By id, up to the largest id.
    views: Vec<Option<WorkerView>>,
    len: usize,
    topology: Topology,
    colocated: bool,
    /// Healthy workers that decode transferred KV (or healthy colocated workers).
    healthy_d: WorkerSet,
    /// Healthy workers that prefill for others.
    healthy_p: WorkerSet,
    /// Healthy workers of a P/D fleet that serve turns alone.
    healthy_local: WorkerSet,
    /// Workers of a P/D fleet that send their sessions' KV and are healthy or draining: those
    /// that may send a session they hold to another worker with its KV.
    kv_senders: WorkerSet,
}

impl Fleet {
    /// The fleet of `workers` (any order, ids unique and below [`MAX_WORKERS`]).
    ///
    /// Errors: as [`crate::ClusterView::topology`].
    pub fn new(workers: &[WorkerView]) -> Result<Fleet, PolicyError> {
        let topology = topology_of(workers)?;
        let width = workers
            .iter()
            .map(|w| w.id.0 as usize + 1)
            .max()
            .unwrap_or(0);
        let mut fleet = Fleet {
            views: vec![None; width],
            len: workers.len(),
            topology,
            colocated: matches!(topology, Topology::Colocated { .. }),
            healthy_d: WorkerSet::EMPTY,
            healthy_p: WorkerSet::EMPTY,
            healthy_local: WorkerSet::EMPTY,
            kv_senders: WorkerSet::EMPTY,
        };
        for w in workers {
            fleet.views[w.id.0 as usize] = Some(*w);
            fleet.file(w);
        }
        Ok(fleet)
    }

    /// Puts `w` in the healthy sets its capabilities and health say (none if it is not
    /// routable); takes it out of the others.
    fn file(&mut self, w: &WorkerView) {
        let slot = w.id.0 as usize;
        let routable = w.is_routable();
        let colocated = self.colocated;
        for (set, member) in [
            (&mut self.healthy_d, colocated || w.caps.decode),
            (&mut self.healthy_p, !colocated && w.caps.prefill),
            (&mut self.healthy_local, !colocated && w.caps.local),
        ] {
            if routable && member {
                set.insert(slot);
            } else {
                set.remove(slot);
            }
        }
        if !colocated && w.caps.send_kv && w.state.health.can_send_kv() {
            self.kv_senders.insert(slot);
        } else {
            self.kv_senders.remove(slot);
        }
    }

    /// The worker with this id, if it is in the fleet.
    pub fn worker(&self, id: WorkerId) -> Option<&WorkerView> {
        self.views.get(id.0 as usize).and_then(Option::as_ref)
    }

    /// Every worker, by id.
    pub fn workers(&self) -> impl Iterator<Item = &WorkerView> + '_ {
        self.views.iter().flatten()
    }

    /// How many workers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the fleet has no worker (never: [`Fleet::new`] refuses an empty one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The topology (see [`crate::ClusterView::topology`]).
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// Sets a worker's health, which decides whether decisions may choose it. Returns whether
    /// the worker is in the fleet (nothing changes otherwise).
    pub fn set_health(&mut self, id: WorkerId, health: Health) -> bool {
        let Some(Some(w)) = self.views.get_mut(id.0 as usize) else {
            return false;
        };
        if w.state.health != health {
            w.state.health = health;
            let w = *w;
            self.file(&w);
        }
        true
    }

    /// Sets a worker's published state, its health included (see [`Fleet::set_health`]).
    /// Returns whether the worker is in the fleet.
    pub fn set_state(&mut self, id: WorkerId, state: WorkerState) -> bool {
        if !self.set_health(id, state.health) {
            return false;
        }
        if let Some(Some(w)) = self.views.get_mut(id.0 as usize) {
            w.state = state;
        }
        true
    }

    /// One past the largest id.
    pub(crate) fn width(&self) -> usize {
        self.views.len()
    }

    pub(crate) fn is_colocated(&self) -> bool {
        self.colocated
    }

    pub(crate) fn healthy_d(&self) -> &WorkerSet {
        &self.healthy_d
    }

    pub(crate) fn healthy_p(&self) -> &WorkerSet {
        &self.healthy_p
    }

    pub(crate) fn healthy_local(&self) -> &WorkerSet {
        &self.healthy_local
    }

    pub(crate) fn kv_senders(&self) -> &WorkerSet {
        &self.kv_senders
    }
}

impl WorkerStates for Fleet {
    /// The state the fleet was last given for `id` (an empty pool, down, for an id not in it).
    fn state(&self, id: WorkerId) -> WorkerState {
        self.worker(id).map_or(
            WorkerState {
                health: Health::Down,
                ..WorkerState::empty(0)
            },
            |w| w.state,
        )
    }
}

/// The topology of `workers` (see [`crate::ClusterView::topology`]).
pub(crate) fn topology_of(workers: &[WorkerView]) -> Result<Topology, PolicyError> {
    let (mut p, mut d, mut c) = (0u32, 0u32, 0u32);
    let (mut can_p, mut can_d, mut all, mut hosting_p) = (false, false, true, false);
    let mut ids = WorkerSet::EMPTY;
    for w in workers {
        let slot = w.id.0 as usize;
        if slot >= MAX_WORKERS {
            return Err(PolicyError::WorkerIdOutOfRange(w.id));
        }
        if ids.contains(slot) {
            return Err(PolicyError::DuplicateWorker(w.id));
        }
        ids.insert(slot);
        can_p |= w.caps.prefill;
        can_d |= w.caps.decode;
        all &= w.caps.prefill && w.caps.decode;
        hosting_p |= w.role == WorkerRole::Prefill && w.caps.hosts_sessions();
        match w.role {
            WorkerRole::Prefill => p += 1,
            WorkerRole::Decode => d += 1,
            WorkerRole::Colocated => c += 1,
        }
    }
    match (p, d, c) {
        (0, 0, 0) => Err(PolicyError::WrongTopology {
            detail: "the cluster view has no workers",
        }),
        (0, 0, workers) => Ok(Topology::Colocated { workers }),
        (_, _, 1..) => Err(PolicyError::WrongTopology {
            detail: "colocated workers mixed with prefill/decode workers",
        }),
        _ if !can_p => Err(PolicyError::WrongTopology {
            detail: "decode workers but no prefill worker",
        }),
        _ if !can_d => Err(PolicyError::WrongTopology {
            detail: "prefill workers but no decode worker",
        }),
        (0, workers, 0) if all && workers >= 2 => Ok(Topology::AllCapable { workers }),
        (prefill, decode, 0) if hosting_p => Ok(Topology::Hybrid { prefill, decode }),
        (prefill, decode, 0) => Ok(Topology::Disaggregated { prefill, decode }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvc_core::Capabilities;

    fn worker(id: u32, role: WorkerRole) -> WorkerView {
        WorkerView::new(WorkerId(id), role, WorkerState::empty(1_000))
    }

    #[test]
    fn health_changes_move_a_worker_in_and_out_of_its_sets() {
        let local = Capabilities::of_role(WorkerRole::Decode).with_local();
        let mut fleet = Fleet::new(&[
            worker(0, WorkerRole::Prefill),
            worker(5, WorkerRole::Decode).with_caps(local),
            worker(2, WorkerRole::Decode),
        ])
        .unwrap();
        assert_eq!(fleet.width(), 6);
        assert_eq!(fleet.len(), 3);
        assert_eq!(
            fleet.topology(),
            Topology::Disaggregated {
                prefill: 1,
                decode: 2
            }
        );
        assert_eq!(fleet.healthy_d().iter().collect::<Vec<_>>(), vec![2, 5]);
        assert_eq!(fleet.healthy_p().iter().collect::<Vec<_>>(), vec![0]);
        assert_eq!(fleet.healthy_local().iter().collect::<Vec<_>>(), vec![5]);

        assert!(fleet.set_health(WorkerId(5), Health::Down));
        assert_eq!(fleet.healthy_d().iter().collect::<Vec<_>>(), vec![2]);
        assert!(fleet.healthy_local().is_empty());
        assert_eq!(
            fleet.worker(WorkerId(5)).unwrap().state.health,
            Health::Down
        );

        let back = WorkerState {
            used_tokens: 7,
            ..WorkerState::empty(1_000)
        };
        assert!(fleet.set_state(WorkerId(5), back));
        assert_eq!(fleet.healthy_d().iter().collect::<Vec<_>>(), vec![2, 5]);
        assert_eq!(fleet.healthy_local().iter().collect::<Vec<_>>(), vec![5]);
        assert_eq!(fleet.state(WorkerId(5)).used_tokens, 7);

        assert!(!fleet.set_health(WorkerId(3), Health::Down));
        assert!(!fleet.set_health(WorkerId(4_000), Health::Down));
        assert_eq!(
            fleet.workers().map(|w| w.id.0).collect::<Vec<_>>(),
            vec![0, 2, 5]
        );
    }

    #[test]
    fn the_fleet_refuses_what_a_cluster_view_refuses() {
        assert!(matches!(
            Fleet::new(&[]),
            Err(PolicyError::WrongTopology { .. })
        ));
        assert_eq!(
            Fleet::new(&[
                worker(1, WorkerRole::Prefill),
                worker(1, WorkerRole::Decode)
            ])
            .unwrap_err(),
            PolicyError::DuplicateWorker(WorkerId(1))
        );
        assert_eq!(
            Fleet::new(&[
                worker(0, WorkerRole::Prefill),
                worker(MAX_WORKERS as u32, WorkerRole::Decode)
            ])
            .unwrap_err(),
            PolicyError::WorkerIdOutOfRange(WorkerId(MAX_WORKERS as u32))
        );
    }
}
