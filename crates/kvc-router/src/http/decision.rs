//! The HTTP front's calls into the routing service: ask for a decision, report its outcome.
//! Decisions come back as `kvc-core` values; this is the only file of the front that sees
//! the service's request and decision types.

use crate::convert::ProtoEnum;
use crate::{RequestError, RouterService, pb};
use kvc_core::{ExecutionMode, FallThroughReason, Outcome, SessionId, WorkerId};

/// What the front asks the routing service for one client request (the same for every
/// attempt, but for `rejected_by`).
#[derive(Debug, Clone)]
pub(super) struct RouteQuery {
    request: pb::RouteRequest,
}

impl RouteQuery {
    /// A request of `input_length` tokens with `hash_ids`, in `session` at `turn` when it has
    /// one.
    pub(super) fn new(
        request_id: u64,
        session: Option<(SessionId, u32)>,
        input_length: u64,
        output_hint: u64,
        hash_ids: Vec<u64>,
    ) -> Self {
        RouteQuery {
            request: pb::RouteRequest {
                request_id,
                session_id: session.map(|(s, _)| s.0),
                turn_id: session.map(|(_, t)| t),
                input_length,
                output_hint,
                hash_ids,
                rejected_by: None,
            },
        }
    }

    /// Marks the next decision as the answer to `worker`'s admission refusal (`None`: a plain
    /// route).
    pub(super) fn set_rejected_by(&mut self, worker: Option<WorkerId>) {
        self.request.rejected_by = worker.map(|w| w.0);
    }
}

/// Where one attempt of a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Decision {
    /// Names the decision in its outcome report.
    pub(super) id: u64,
    /// The path: through a prefill worker, direct-to-D, or colocated.
    pub(super) mode: ExecutionMode,
    /// The prefill worker of a P→D path.
    pub(super) prefill: Option<WorkerId>,
    /// The decode worker (the colocated worker in a colocated cluster).
    pub(super) decode: WorkerId,
    /// Why a later turn did not go direct-to-D.
    pub(super) reason: Option<FallThroughReason>,
}

/// The routing service's decision for `query`, the workers in `excluded` counted as down.
pub(super) fn route(
    service: &RouterService,
    query: &RouteQuery,
    excluded: &[WorkerId],
) -> Result<Decision, RequestError> {
    let d = service.route_excluding(&query.request, excluded)?;
    let mode = ExecutionMode::from_proto(d.mode)
        .map_err(|e| RequestError::Internal(format!("decision {}: {e}", d.decision_id)))?;
    Ok(Decision {
        id: d.decision_id,
        mode,
        prefill: d.prefill_worker.map(WorkerId),
        decode: WorkerId(d.decode_worker),
        reason: d
            .fall_through_reason
            .and_then(|r| FallThroughReason::from_proto(r).ok()),
    })
}

/// Reports the outcome of `decision` (logged, never fatal).
pub(super) fn report(
    service: &RouterService,
    decision: u64,
    request_id: u64,
    outcome: Outcome,
    resident_tokens: u64,
) {
    if let Err(e) = service.report_outcome(&pb::OutcomeReport {
        decision_id: decision,
        request_id,
        outcome: outcome.to_proto(),
        resident_tokens,
    }) {
        tracing::warn!(decision, error = %e, "outcome not recorded");
    }
}
