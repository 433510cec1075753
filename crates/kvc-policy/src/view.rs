//! What a policy reads: the cluster view and the request.

use crate::error::PolicyError;
use kvc_core::{
    BlockHash, Capabilities, RequestId, SessionId, Topology, TurnId, WorkerId, WorkerRole,
    WorkerState,
};
use serde::{Deserialize, Serialize};

/// Most workers a router may know: every [`WorkerId`] must be below this value (ids are dense
/// indices, unique across roles).
pub const MAX_WORKERS: usize = 4_096;

/// One worker as the router sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct WorkerView {
    /// The worker.
    pub id: WorkerId,
    /// What it does.
    pub role: WorkerRole,
    /// Its KV pool, load and health.
    pub state: WorkerState,
    /// What its engine can do ([`WorkerView::new`]: what its role does by default, see
    /// [`Capabilities::of_role`]). Policies plan a path through a worker only if it can take
    /// it: P→D from a `prefill` worker to a `decode` one, a turn served alone (`local-prefill`,
    /// and only by `kvc`) on a `local` one; sessions are placed on workers that host them.
    pub caps: Capabilities,
}

impl WorkerView {
    /// A worker view with the capabilities of its role ([`Capabilities::of_role`]): a
    /// decode worker is not assumed to serve turns alone.
    pub fn new(id: WorkerId, role: WorkerRole, state: WorkerState) -> Self {
        WorkerView {
            id,
            role,
            state,
            caps: Capabilities::of_role(role),
        }
    }

    /// The same worker with the capabilities its engine declares.
    pub fn with_caps(self, caps: Capabilities) -> Self {
        WorkerView { caps, ..self }
    }

    /// Whether a policy may send work to it (healthy).
    pub fn is_routable(&self) -> bool {
        self.state.health.is_routable()
    }
}

/// The cluster at decision time. `now_ms` is the caller's clock (policies read no clock).
#[derive(Debug, Clone, Copy)]
pub struct ClusterView<'a> {
    /// Current time in milliseconds, on whatever clock the caller uses (virtual in the
    /// simulator). Recorded in the router state as a session's last routing time.
    pub now_ms: u64,
    /// Every worker the router knows, in any order (ids unique).
    pub workers: &'a [WorkerView],
}

impl<'a> ClusterView<'a> {
    /// A cluster view.
    pub fn new(now_ms: u64, workers: &'a [WorkerView]) -> Self {
        ClusterView { now_ms, workers }
    }

    /// The worker with this id, if present.
    pub fn worker(&self, id: WorkerId) -> Option<&'a WorkerView> {
        self.workers.iter().find(|w| w.id == id)
    }

    /// The topology the roles and capabilities describe: all `colocated` is a colocated
    /// cluster; otherwise prefill and decode workers: all-capable ([`Topology::AllCapable`])
    /// when every worker can prefill for the others and decode transferred KV, hybrid
    /// when a prefill-role worker may host sessions (serve turns alone), disaggregated
    /// otherwise. Counts include unhealthy workers.
    ///
    /// Errors: [`PolicyError::WrongTopology`] for an empty view, a mix of colocated and
    /// prefill/decode workers, or a P/D view without a worker that prefills for others or
    /// without one that decodes transferred KV;
    /// [`PolicyError::WorkerIdOutOfRange`] and [`PolicyError::DuplicateWorker`] for bad ids.
    pub fn topology(&self) -> Result<Topology, PolicyError> {
        crate::fleet::topology_of(self.workers)
    }
}

/// One request to route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteRequest<'a> {
    /// The request.
    pub request_id: RequestId,
    /// The session; `None` for a one-off request (always routed like a first turn).
    pub session: Option<SessionId>,
    /// The turn within the session (from 1). `None` with a session: a first turn if the router
    /// has no record of the session, a later turn otherwise.
    pub turn: Option<TurnId>,
    /// Prompt length in tokens.
    pub input_length: u64,
    /// Expected generated tokens (the trace's output length, or the request's max tokens).
    pub output_hint: u64,
    /// Chained block ids of the prompt.
    pub hash_ids: &'a [BlockHash],
    /// Set when re-routing after the D chosen for direct-to-D refused admission for this request;
    /// the policy must then return a P→D path (mode fallback or reseed, reason
    /// session-cap-rejected, or migrated if this reject triggered migration).
    pub rejected_by: Option<WorkerId>,
    /// The session that spawned this one (a subagent's parent), as the client named it or the
    /// router inferred it. `kvc` may place the first turn where the parent's KV is, as a
    /// direct-to-D append of what the parent's D does not hold ([`crate::KvcConfig`],
    /// `subagent-placement`).
    pub parent: Option<SessionId>,
}

impl<'a> RouteRequest<'a> {
    /// A one-off request (no session).
    pub fn new(
        request_id: RequestId,
        input_length: u64,
        output_hint: u64,
        hash_ids: &'a [BlockHash],
    ) -> Self {
        RouteRequest {
            request_id,
            session: None,
            turn: None,
            input_length,
            output_hint,
            hash_ids,
            rejected_by: None,
            parent: None,
        }
    }

    /// The same request as turn `turn` of `session`.
    pub fn in_session(self, session: SessionId, turn: TurnId) -> Self {
        RouteRequest {
            session: Some(session),
            turn: Some(turn),
            ..self
        }
    }

    /// The same request, from a session spawned by `parent` (see [`RouteRequest::parent`]).
    pub fn with_parent(self, parent: SessionId) -> Self {
        RouteRequest {
            parent: Some(parent),
            ..self
        }
    }

    /// The same request, re-routed after `worker` refused its direct-to-D admission.
    pub fn rejected_by(self, worker: WorkerId) -> Self {
        RouteRequest {
            rejected_by: Some(worker),
            ..self
        }
    }
}
