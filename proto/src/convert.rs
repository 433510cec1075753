//! Conversions between the `kvc.v1` protobuf forms and the `kvc-core`, `kvc-policy` and
//! `kvc-admission` types they carry: the enums one to one by stable name ([`ProtoEnum`]), and
//! the messages whose fields are those types.

use crate::pb;
use kvc_admission::{CommitReply, CommitRequest, ProbeAnswer};
use kvc_core::{
    BlockHash, ExecutionMode, FallThroughReason, Health, Outcome, RequestId, SessionId, StableName,
    TurnId, WorkerId, WorkerRole,
};
use kvc_policy::RouteRequest;

/// A wire value that does not name a variant (unknown number, or `..._UNSPECIFIED`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} value {value} on the wire")]
pub struct InvalidEnum {
    /// What was being decoded.
    pub kind: &'static str,
    /// The raw value.
    pub value: i32,
}

/// A `kvc-core` enum with a `kvc.v1` protobuf counterpart.
pub trait ProtoEnum: StableName {
    /// The proto value (an `i32`, as prost stores enums in messages).
    fn to_proto(self) -> i32;
    /// The variant for a proto value; `..._UNSPECIFIED` and unknown values are errors.
    fn from_proto(value: i32) -> Result<Self, InvalidEnum>;
}

macro_rules! proto_enum {
    ($core:ident, $pb:ident { $( $v:ident ),+ $(,)? }) => {
        impl ProtoEnum for $core {
            fn to_proto(self) -> i32 {
                match self { $( $core::$v => pb::$pb::$v as i32, )+ }
            }
            fn from_proto(value: i32) -> Result<Self, InvalidEnum> {
                match pb::$pb::try_from(value) {
                    $( Ok(pb::$pb::$v) => Ok($core::$v), )+
                    _ => Err(InvalidEnum { kind: <$core as StableName>::KIND, value }),
                }
            }
        }
    };
}

proto_enum!(
    WorkerRole,
    WorkerRole {
        Prefill,
        Decode,
        Colocated
    }
);
proto_enum!(
    Health,
    Health {
        Healthy,
        Stale,
        Down,
        Draining
    }
);
proto_enum!(
    ExecutionMode,
    ExecutionMode {
        Turn1Seed,
        DirectToD,
        Fallback,
        Reseed,
        Colocated,
        LocalPrefill,
        MigrateKv
    }
);
proto_enum!(
    FallThroughReason,
    FallThroughReason {
        SessionNotResident,
        RealLargeAppend,
        SessionEvicted,
        SessionCapRejected,
        DecodeUnhealthy,
        Migrated,
        DirectUnsupported,
        Compacted,
    }
);
proto_enum!(
    Outcome,
    Outcome {
        Ok,
        InputTooLong,
        KvTransferTimeout,
        DecodeOom,
        Rejected,
        WorkerFailed,
        DirectCacheMiss,
        InvalidRequest,
    }
);

impl From<kvc_core::WorkerState> for pb::WorkerState {
    fn from(s: kvc_core::WorkerState) -> Self {
        pb::WorkerState {
            capacity_tokens: s.capacity_tokens,
            used_tokens: s.used_tokens,
            evictable_tokens: s.evictable_tokens,
            queue_depth: s.queue_depth,
            in_flight: s.in_flight,
            resident_sessions: s.resident_sessions,
            health: s.health.to_proto(),
            state_age_ms: s.state_age_ms,
        }
    }
}

impl TryFrom<pb::WorkerState> for kvc_core::WorkerState {
    type Error = InvalidEnum;
    fn try_from(s: pb::WorkerState) -> Result<Self, Self::Error> {
        Ok(kvc_core::WorkerState {
            capacity_tokens: s.capacity_tokens,
            used_tokens: s.used_tokens,
            evictable_tokens: s.evictable_tokens,
            queue_depth: s.queue_depth,
            in_flight: s.in_flight,
            resident_sessions: s.resident_sessions,
            health: Health::from_proto(s.health)?,
            state_age_ms: s.state_age_ms,
        })
    }
}

impl From<&RouteRequest<'_>> for pb::RouteRequest {
    fn from(r: &RouteRequest<'_>) -> Self {
        pb::RouteRequest {
            request_id: r.request_id.0,
            session_id: r.session.map(|s| s.0),
            turn_id: r.turn.map(|t| t.0),
            input_length: r.input_length,
            output_hint: r.output_hint,
            hash_ids: r.hash_ids.iter().map(|h| h.0).collect(),
            rejected_by: r.rejected_by.map(|w| w.0),
            parent_session_id: r.parent.map(|s| s.0),
        }
    }
}

impl pb::RouteRequest {
    /// The request's block ids as `kvc-core` hashes (the storage [`Self::to_core`] borrows).
    pub fn block_hashes(&self) -> Vec<BlockHash> {
        self.hash_ids.iter().copied().map(BlockHash).collect()
    }

    /// The request as a policy reads it, over `hash_ids` (from [`Self::block_hashes`]). Every
    /// field carries over as it is; checking it is the receiver's job.
    pub fn to_core<'a>(&self, hash_ids: &'a [BlockHash]) -> RouteRequest<'a> {
        RouteRequest {
            request_id: RequestId(self.request_id),
            session: self.session_id.map(SessionId),
            turn: self.turn_id.map(TurnId),
            input_length: self.input_length,
            output_hint: self.output_hint,
            hash_ids,
            rejected_by: self.rejected_by.map(WorkerId),
            parent: self.parent_session_id.map(SessionId),
        }
    }
}

impl From<ProbeAnswer> for pb::ProbeReply {
    /// Drops `session_resident_tokens`, which the wire form does not carry.
    fn from(a: ProbeAnswer) -> Self {
        pb::ProbeReply {
            can_admit: a.can_admit,
            available_tokens: a.available_tokens,
            evictable_tokens: a.evictable_tokens,
            queue_depth: a.queue_depth,
            snapshot_age_ms: a.snapshot_age_ms,
            recommended_pause_ms: a.recommended_pause_ms,
        }
    }
}

impl pb::CommitEvictRequest {
    /// `CommitEvict` of `req` on `worker`.
    pub fn for_worker(worker: WorkerId, req: CommitRequest) -> Self {
        pb::CommitEvictRequest {
            worker: worker.0,
            need_tokens: req.need_tokens,
            session_id: req.session.map(|s| s.0),
        }
    }

    /// The worker it names and what it asks of that worker's commit queue.
    pub fn to_core(&self) -> (WorkerId, CommitRequest) {
        (
            WorkerId(self.worker),
            CommitRequest {
                need_tokens: self.need_tokens,
                session: self.session_id.map(SessionId),
            },
        )
    }
}

impl From<CommitReply> for pb::CommitEvictReply {
    fn from(r: CommitReply) -> Self {
        pb::CommitEvictReply {
            admitted: r.admitted,
            freed_tokens: r.freed_tokens,
            evicted_sessions: r.evicted.iter().map(|s| s.0).collect(),
            recommended_pause_ms: r.recommended_pause_ms,
        }
    }
}

impl From<pb::CommitEvictReply> for CommitReply {
    fn from(r: pb::CommitEvictReply) -> Self {
        CommitReply {
            admitted: r.admitted,
            freed_tokens: r.freed_tokens,
            evicted: r.evicted_sessions.into_iter().map(SessionId).collect(),
            recommended_pause_ms: r.recommended_pause_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_request_round_trips() {
        let hashes = [BlockHash(7), BlockHash(9)];
        let mut req =
            RouteRequest::new(RequestId(4), 1_000, 40, &hashes).in_session(SessionId(3), TurnId(2));
        req.rejected_by = Some(WorkerId(1));
        let wire = pb::RouteRequest::from(&req);
        assert_eq!(wire.hash_ids, [7, 9]);
        assert_eq!(wire.rejected_by, Some(1));
        let back_hashes = wire.block_hashes();
        let back = wire.to_core(&back_hashes);
        assert_eq!(back.request_id, RequestId(4));
        assert_eq!(back.session, Some(SessionId(3)));
        assert_eq!(back.turn, Some(TurnId(2)));
        assert_eq!((back.input_length, back.output_hint), (1_000, 40));
        assert_eq!(back.hash_ids, &hashes);
        assert_eq!(back.rejected_by, Some(WorkerId(1)));
    }

    #[test]
    fn commit_evict_round_trips() {
        let req = CommitRequest {
            need_tokens: 5_000,
            session: Some(SessionId(9)),
        };
        let wire = pb::CommitEvictRequest::for_worker(WorkerId(2), req);
        assert_eq!(wire.to_core(), (WorkerId(2), req));
        let reply = CommitReply {
            admitted: true,
            freed_tokens: 1_340,
            evicted: vec![SessionId(7), SessionId(8)],
            recommended_pause_ms: 25,
        };
        let wire = pb::CommitEvictReply::from(reply.clone());
        assert_eq!(wire.evicted_sessions, [7, 8]);
        assert_eq!(CommitReply::from(wire), reply);
    }
}
