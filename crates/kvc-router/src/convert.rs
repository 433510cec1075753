//! Conversions between `kvc-core` types and their `kvc.v1` protobuf forms.

use crate::pb;
use kvc_core::{ExecutionMode, FallThroughReason, Health, Outcome, StableName, WorkerRole};

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
        Down
    }
);
proto_enum!(
    ExecutionMode,
    ExecutionMode {
        Turn1Seed,
        DirectToD,
        Fallback,
        Reseed,
        Colocated
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
