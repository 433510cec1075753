//! The fleet as decisions see it, kept between decisions: the policy's [`Fleet`] (roles,
//! capabilities, the healthy workers of each kind) with its health brought up to date only
//! when some worker's health changed (the workers' shared health epoch moved) or a state grew
//! old enough to be stale, and the workers' states read for just the workers a decision
//! weighs ([`LiveStates`]). So a decision costs what its candidates cost, not the fleet.

use super::RouterService;
use crate::workers::WorkerEntry;
use kvc_core::{Health, WorkerId, WorkerState};
use kvc_policy::{Fleet, PolicyError, WorkerStates};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The policy's fleet and when its health was last worked out.
#[derive(Debug)]
pub(super) struct FleetCache {
    /// The fleet, or why the workers are not one (a router configured without workers
    /// answers every decision with it).
    fleet: Result<Fleet, PolicyError>,
    /// The health epoch the fleet's health reflects (`None` before the first pass).
    epoch: Option<u64>,
    /// When the health was worked out, on the router clock.
    built_ms: u64,
    /// From when some worker's state is stale unless written again (`u64::MAX`: never).
    valid_until_ms: u64,
    /// Passes over every worker made so far (the `fleet_health_passes` figure).
    passes: u64,
}

impl FleetCache {
    /// The fleet of `workers`, its health to be worked out at the first decision.
    pub(super) fn new(workers: &[Arc<WorkerEntry>]) -> Self {
        let views: Vec<_> = workers.iter().map(|w| w.view_at(0)).collect();
        FleetCache {
            fleet: Fleet::new(&views),
            epoch: None,
            built_ms: 0,
            valid_until_ms: 0,
            passes: 0,
        }
    }

    /// The fleet with every worker's health as of `now_ms`: worked out again (a pass over the
    /// workers) only when the epoch moved since the last pass, a state may have grown stale
    /// since, or the clock went back.
    pub(super) fn at(
        &mut self,
        workers: &[Arc<WorkerEntry>],
        epoch: &AtomicU64,
        now_ms: u64,
    ) -> Result<&Fleet, PolicyError> {
        let fleet = self.fleet.as_mut().map_err(|e| e.clone())?;
        // Read before the pass: a change during it moves the epoch past this value.
        let e = epoch.load(Ordering::Acquire);
        let fresh =
            self.epoch == Some(e) && now_ms < self.valid_until_ms && now_ms >= self.built_ms;
        if !fresh {
            let mut until = u64::MAX;
            for w in workers {
                let (health, changes_at) = w.health_until(now_ms);
                fleet.set_health(w.id, health);
                if let Some(t) = changes_at {
                    until = until.min(t);
                }
            }
            self.epoch = Some(e);
            self.built_ms = now_ms;
            self.valid_until_ms = until;
            self.passes += 1;
        }
        Ok(fleet)
    }

    /// The fleet of `workers` after a worker joined or left: its health worked out again at
    /// the next decision; the pass count goes on.
    pub(super) fn rebuild(&mut self, workers: &[Arc<WorkerEntry>]) {
        let passes = self.passes;
        *self = FleetCache::new(workers);
        self.passes = passes;
    }

    /// Passes over every worker so far.
    pub(super) fn passes(&self) -> u64 {
        self.passes
    }
}

/// The workers' states at one time, read as a decision asks for them.
pub(super) struct LiveStates<'a> {
    pub(super) service: &'a RouterService,
    pub(super) now_ms: u64,
}

impl WorkerStates for LiveStates<'_> {
    fn state(&self, id: WorkerId) -> WorkerState {
        match self.service.entry(id.0) {
            Some(w) => w.state_at(self.now_ms),
            None => WorkerState {
                health: Health::Down,
                ..WorkerState::empty(0)
            },
        }
    }
}
