//! The `kvc.v1` proto enums and the `kvc-core` stable names describe the same things.
#![forbid(unsafe_code)]

use kvc_core::{
    ExecutionMode, FallThroughReason, Health, Outcome, StableName, StateSource, WorkerRole,
};
use kvc_proto::convert::ProtoEnum;
use kvc_proto::pb;

/// The proto value name (`EXECUTION_MODE_DIRECT_TO_D`) minus its prefix, lower-cased, with `_`
/// read as `-`, is the kvc-core stable name.
fn check<T: ProtoEnum + std::fmt::Debug + PartialEq>(prefix: &str, proto_name: fn(i32) -> String) {
    for v in T::ALL {
        let wire = v.to_proto();
        assert_ne!(wire, 0, "{v:?} must not map to UNSPECIFIED");
        assert_eq!(T::from_proto(wire).unwrap(), *v);
        let name = proto_name(wire);
        let stem = name
            .strip_prefix(prefix)
            .unwrap_or_else(|| panic!("{name} lacks prefix {prefix}"));
        assert_eq!(stem.to_ascii_lowercase().replace('_', "-"), v.as_str());
    }
    let err = T::from_proto(0).unwrap_err();
    assert_eq!(err.kind, T::KIND);
    assert!(T::from_proto(9999).is_err());
}

#[test]
fn proto_enums_match_stable_names() {
    check::<WorkerRole>("WORKER_ROLE_", |v| {
        pb::WorkerRole::try_from(v)
            .unwrap()
            .as_str_name()
            .to_owned()
    });
    check::<Health>("HEALTH_", |v| {
        pb::Health::try_from(v).unwrap().as_str_name().to_owned()
    });
    check::<ExecutionMode>("EXECUTION_MODE_", |v| {
        pb::ExecutionMode::try_from(v)
            .unwrap()
            .as_str_name()
            .to_owned()
    });
    check::<FallThroughReason>("FALL_THROUGH_REASON_", |v| {
        pb::FallThroughReason::try_from(v)
            .unwrap()
            .as_str_name()
            .to_owned()
    });
    check::<Outcome>("OUTCOME_", |v| {
        pb::Outcome::try_from(v).unwrap().as_str_name().to_owned()
    });
}

#[test]
fn worker_state_round_trips_through_proto() {
    let mut s = kvc_core::WorkerState::empty(92_000);
    s.used_tokens = 50_000;
    s.evictable_tokens = 10_000;
    s.queue_depth = 3;
    s.in_flight = 7;
    s.resident_sessions = 12;
    s.health = Health::Stale;
    s.state_age_ms = 250;
    let wire = pb::WorkerState::from(s);
    assert_eq!(wire.health, pb::Health::Stale as i32);
    assert_eq!(kvc_core::WorkerState::try_from(wire).unwrap(), s);
    let bad = pb::WorkerState {
        health: 0,
        ..pb::WorkerState::default()
    };
    assert!(kvc_core::WorkerState::try_from(bad).is_err());
}

/// `WorkerInfo.source` is a string, not a proto enum: the proto names exactly the stable names
/// of [`StateSource`] for it.
#[test]
fn worker_info_source_names_the_state_sources() {
    let proto = include_str!("../../proto/kvc/v1/router.proto");
    let field = proto.find("string source = ").expect("WorkerInfo.source");
    let comment = proto[..field]
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with("//"))
        .expect("a comment on WorkerInfo.source");
    let quoted: Vec<&str> = comment.split('"').skip(1).step_by(2).collect();
    let names: Vec<&str> = StateSource::ALL.iter().map(|s| s.as_str()).collect();
    assert_eq!(quoted, names, "{comment}");
}
