//! Fall-through classification: can a later turn go direct-to-D, and if not, why.

use crate::state::{Residency, RouterState, SessionRoute};
use crate::view::{ClusterView, RouteRequest};
use kvc_core::{BlockSize, FallThroughReason, WorkerId, WorkerRole};

/// Where a request stands before a policy picks workers (P/D topologies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnClass {
    /// A first turn or a one-off request: seeded through P→D.
    FirstTurn,
    /// The session is resident on a healthy D and its uncached append is within the limit.
    Direct {
        /// The session's D.
        decode: WorkerId,
        /// Tokens of the request the session's KV on D covers.
        cached_tokens: u64,
    },
    /// A later turn that cannot go direct-to-D.
    FallThrough {
        /// Why.
        reason: FallThroughReason,
        /// The session's D, if the router knows one.
        current_d: Option<WorkerId>,
    },
}

/// Whether a later turn's prompt (sharing `shared` leading blocks with the session's last
/// prompt) is a compaction of that prompt: it leaves the last prompt before its last two
/// blocks (the last one may be partial, and a chat template's generation prompt may reach
/// back into the one before) and keeps at most a quarter of it. The agent summarised its
/// history; what the session's D holds past the shared blocks is stale. (Eliding old tool
/// output also leaves the last prompt early, but keeps most of it: on the generated SWE
/// traces at least 42%, where a compaction keeps the system prompt alone, about 4%.)
///
/// A session whose list was cut by [`crate::StateBounds::max_session_blocks`] is judged by its
/// kept blocks: a prompt that shares all of them may share more, and is not taken for one.
pub fn is_compaction(session: &SessionRoute, shared: usize) -> bool {
    let last = session.block_count();
    let known = shared < session.blocks.len() || session.blocks.len() == last;
    known && shared + 2 < last && shared * 4 <= last
}

/// Whether the request is routed as a first turn: a one-off request, turn 1, or a session
/// without a turn number that the router has no record of.
pub fn is_first_turn(req: &RouteRequest<'_>, session: Option<&SessionRoute>) -> bool {
    match (req.session, req.turn) {
        (None, _) => true,
        (Some(_), Some(turn)) => turn.is_first(),
        (Some(_), None) => session.is_none(),
    }
}

/// Classifies a request against the session's routing state, in this order:
///
/// 1. first turn (see [`is_first_turn`]) → [`TurnClass::FirstTurn`];
/// 2. `rejected_by` set → `session-cap-rejected`;
/// 3. no record of the session or no D for it → `session-not-resident`;
/// 4. its D missing from the view, not a worker that hosts sessions, or not healthy →
///    `decode-unhealthy`;
/// 5. its D takes no direct-to-D turn ([`RouterState::set_direct_append`]) →
///    `direct-unsupported`;
/// 6. an eviction reported → `session-evicted`; not resident otherwise → `session-not-resident`;
/// 7. uncached append `input − cached` over `direct_limit_tokens` → `real-large-append`;
/// 8. otherwise [`TurnClass::Direct`], with `cached` = the request's tokens covered by the
///    session's blocks on D ([`kvc_core::prefix::reusable_from`]).
///
/// Policies may still refuse a direct path (kvc-v2 migrates a session off a D over its hard cap).
pub fn classify_turn(
    req: &RouteRequest<'_>,
    state: &RouterState,
    cluster: &ClusterView<'_>,
    direct_limit_tokens: u64,
    block_size: BlockSize,
) -> TurnClass {
    let session = req.session.and_then(|s| state.session(s));
    classify_with(
        req,
        session,
        direct_limit_tokens,
        block_size,
        |d| {
            cluster.worker(d).is_some_and(|w| {
                w.role != WorkerRole::Colocated && w.caps.hosts_sessions() && w.is_routable()
            })
        },
        |d| state.accepts_direct(d),
        false,
    )
}

/// [`classify_turn`] with the health and direct-append tests given as functions (the router's
/// fast lookups). With `compaction`, a turn over the direct limit whose prompt is a
/// compaction of the session's last one ([`is_compaction`]) falls through as `compacted`
/// instead of `real-large-append`.
pub(crate) fn classify_with(
    req: &RouteRequest<'_>,
    session: Option<&SessionRoute>,
    direct_limit_tokens: u64,
    block_size: BlockSize,
    healthy_decode: impl Fn(WorkerId) -> bool,
    accepts_direct: impl Fn(WorkerId) -> bool,
    compaction: bool,
) -> TurnClass {
    if is_first_turn(req, session) {
        return TurnClass::FirstTurn;
    }
    let current_d = session.and_then(|s| s.current_d);
    let fall = |reason| TurnClass::FallThrough { reason, current_d };
    if req.rejected_by.is_some() {
        return fall(FallThroughReason::SessionCapRejected);
    }
    let (Some(s), Some(d)) = (session, current_d) else {
        return fall(FallThroughReason::SessionNotResident);
    };
    if !healthy_decode(d) {
        return fall(FallThroughReason::DecodeUnhealthy);
    }
    if !accepts_direct(d) {
        return fall(FallThroughReason::DirectUnsupported);
    }
    match s.residency {
        Residency::Evicted => return fall(FallThroughReason::SessionEvicted),
        Residency::NotResident => return fall(FallThroughReason::SessionNotResident),
        Residency::Resident => {}
    }
    let shared = s.shared_prefix(req.hash_ids);
    let cached = kvc_core::prefix::reusable_tokens(shared, req.input_length, block_size);
    if kvc_core::prefix::uncached_tokens(req.input_length, cached) > direct_limit_tokens {
        return fall(if compaction && is_compaction(s, shared) {
            FallThroughReason::Compacted
        } else {
            FallThroughReason::RealLargeAppend
        });
    }
    TurnClass::Direct {
        decode: d,
        cached_tokens: cached,
    }
}
