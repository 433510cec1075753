//! The HTTP front's calls into the routing service: ask for a decision, report its outcome.
//! Decisions come back as `kvc-core` values; this is the only file of the front that sees
//! the service's request and decision types.

use crate::telemetry::RequestSpan;
use crate::{DecisionOutcome, RequestError, RouterService};
use kvc_core::{
    BlockHash, ExecutionMode, FallThroughReason, Outcome, RequestId, SessionId, TurnId, WorkerId,
};
use kvc_policy::RouteRequest;

/// What the front asks the routing service for one client request (the same for every
/// attempt, but for `rejected_by`).
#[derive(Debug, Clone)]
pub(crate) struct RouteQuery {
    request_id: RequestId,
    session: Option<(SessionId, TurnId)>,
    input_length: u64,
    output_hint: u64,
    hash_ids: Vec<BlockHash>,
    rejected_by: Option<WorkerId>,
    /// The session that spawned this one, when the client named it or the front inferred it.
    parent: Option<SessionId>,
    /// The prompt's tokens, for the engines' events to say how much of it a worker holds.
    prompt: Vec<u32>,
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
            request_id: RequestId(request_id),
            session: session.map(|(s, t)| (s, TurnId(t))),
            input_length,
            output_hint,
            hash_ids: hash_ids.into_iter().map(BlockHash).collect(),
            rejected_by: None,
            parent: None,
            prompt: Vec::new(),
        }
    }

    /// The prompt's tokens (the whole prompt, generation prompt included).
    pub(super) fn with_prompt(self, prompt: Vec<u32>) -> Self {
        RouteQuery { prompt, ..self }
    }

    /// Names the session that spawned this query's session (a subagent's parent).
    pub(super) fn set_parent(&mut self, parent: Option<SessionId>) {
        self.parent = parent;
    }

    /// Marks the next decision as the answer to `worker`'s admission refusal (`None`: a plain
    /// route).
    pub(super) fn set_rejected_by(&mut self, worker: Option<WorkerId>) {
        self.rejected_by = worker;
    }

    /// The session and turn of the query, when it has a session.
    pub(super) fn session(&self) -> Option<(SessionId, u32)> {
        self.session.map(|(s, t)| (s, t.0))
    }

    /// The policy's view of this query.
    fn request(&self) -> RouteRequest<'_> {
        RouteRequest {
            request_id: self.request_id,
            session: self.session.map(|(s, _)| s),
            turn: self.session.map(|(_, t)| t),
            input_length: self.input_length,
            output_hint: self.output_hint,
            hash_ids: &self.hash_ids,
            rejected_by: self.rejected_by,
            parent: self.parent,
        }
    }
}

/// Where one attempt of a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Decision {
    /// Names the decision in its outcome report.
    pub(crate) id: u64,
    /// The path: through a prefill worker, direct-to-D, or colocated.
    pub(crate) mode: ExecutionMode,
    /// The prefill worker of a P→D path.
    pub(crate) prefill: Option<WorkerId>,
    /// The decode worker (the colocated worker in a colocated cluster).
    pub(crate) decode: WorkerId,
    /// Why a later turn did not go direct-to-D.
    pub(crate) reason: Option<FallThroughReason>,
    /// Prompt tokens the decision counts on D (or P) already holding.
    pub(crate) cached_tokens: u64,
}

/// The routing service's decision for `query`, the workers in `excluded` counted as down.
pub(crate) fn route(
    service: &RouterService,
    query: &RouteQuery,
    excluded: &[WorkerId],
) -> Result<Decision, RequestError> {
    route_traced(service, query, excluded, &RequestSpan::none())
}

/// [`route`], the decision (or the refusal) recorded on the request's span.
pub(crate) fn route_traced(
    service: &RouterService,
    query: &RouteQuery,
    excluded: &[WorkerId],
    span: &RequestSpan,
) -> Result<Decision, RequestError> {
    let prompt = (!query.prompt.is_empty()).then_some(&query.prompt[..]);
    let d = match service.route_prompt(&query.request(), excluded, prompt) {
        Ok(d) => d,
        Err(e) => {
            if span.is_recording() {
                span.record_error(&e.to_string());
            }
            return Err(e);
        }
    };
    span.record_decision(&d);
    Ok(Decision {
        id: d.decision_id,
        mode: d.mode,
        prefill: d.prefill_worker,
        decode: d.decode_worker,
        reason: d.fall_through_reason,
        cached_tokens: d.cached_tokens,
    })
}

/// Reports the first token of `decision`'s answer, for a turn its worker prefilled itself
/// (not a P→D one: see [`RouterService::report_first_token`]).
pub(crate) fn report_first_token(service: &RouterService, decision: &Decision) {
    if decision.prefill.is_none() {
        service.report_first_token(decision.id);
    }
}

/// Reports the outcome of `decision` (logged, never fatal).
pub(crate) fn report(
    service: &RouterService,
    decision: u64,
    request_id: u64,
    outcome: Outcome,
    resident_tokens: u64,
) {
    if let Err(e) = service.report_outcome(&DecisionOutcome {
        decision_id: decision,
        request_id: RequestId(request_id),
        outcome,
        resident_tokens,
    }) {
        tracing::warn!(decision, error = %e, "outcome not recorded");
    }
}
