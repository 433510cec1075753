//! Stable names, the accounting rule, topologies and prefix helpers.

use kvc_core::prefix::{reusable_from, reusable_tokens, shared_prefix_blocks, uncached_tokens};
use kvc_core::*;

fn check_names<T>(expected: &[&str])
where
    T: StableName + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug + PartialEq,
    T: std::str::FromStr<Err = UnknownName> + std::fmt::Display,
{
    let names: Vec<&str> = T::ALL.iter().map(|v| v.as_str()).collect();
    assert_eq!(names, expected, "{}: stable names changed", T::KIND);
    let unique: std::collections::BTreeSet<&str> = names.iter().copied().collect();
    assert_eq!(unique.len(), names.len(), "{}: a name twice", T::KIND);
    for name in &names {
        assert!(
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
            "{}: `{name}` is not kebab-case",
            T::KIND
        );
    }
    for v in T::ALL {
        let json = serde_json::to_string(v).unwrap();
        assert_eq!(json, format!("\"{}\"", v.as_str()));
        let back: T = serde_json::from_str(&json).unwrap();
        assert_eq!(&back, v);
        assert_eq!(v.to_string(), v.as_str());
        assert_eq!(&v.as_str().parse::<T>().unwrap(), v);
    }
    let err = "no-such-name".parse::<T>().unwrap_err();
    assert_eq!(err.kind, T::KIND);
    assert!(err.to_string().contains(expected[0]), "{err}");
    assert!(serde_json::from_str::<T>("\"no-such-name\"").is_err());
}

#[test]
fn worker_roles_have_stable_names() {
    check_names::<WorkerRole>(&["prefill", "decode", "colocated"]);
}

#[test]
fn health_has_stable_names() {
    check_names::<Health>(&["healthy", "stale", "down", "draining"]);
    assert!(Health::Healthy.is_routable());
    assert!(!Health::Stale.is_routable());
    assert!(!Health::Down.is_routable());
    assert!(!Health::Draining.is_routable());
    // A draining worker still sends its sessions' KV; a stale or down one does not.
    let senders: Vec<Health> = Health::ALL
        .iter()
        .copied()
        .filter(|h| h.can_send_kv())
        .collect();
    assert_eq!(senders, [Health::Healthy, Health::Draining]);
}

#[test]
fn execution_modes_have_stable_names() {
    check_names::<ExecutionMode>(&[
        "turn1-seed",
        "direct-to-d",
        "fallback",
        "reseed",
        "colocated",
        "local-prefill",
        "migrate-kv",
    ]);
}

#[test]
fn fall_through_reasons_have_stable_names() {
    check_names::<FallThroughReason>(&[
        "session-not-resident",
        "real-large-append",
        "session-evicted",
        "session-cap-rejected",
        "decode-unhealthy",
        "migrated",
        "direct-unsupported",
        "compacted",
    ]);
}

#[test]
fn outcomes_have_stable_names() {
    check_names::<Outcome>(&[
        "ok",
        "input-too-long",
        "kv-transfer-timeout",
        "decode-oom",
        "rejected",
        "worker-failed",
        "direct-cache-miss",
        "invalid-request",
    ]);
}

#[test]
fn prefill_policies_have_stable_names() {
    check_names::<PrefillPolicy>(&["round-robin", "d-health-aware", "prefix-aware"]);
}

#[test]
fn eviction_modes_have_stable_names() {
    check_names::<EvictionMode>(&["idle-lru", "tiered"]);
}

#[test]
fn breaker_states_have_stable_names() {
    check_names::<BreakerState>(&["closed", "open", "half-open"]);
}

#[test]
fn probe_results_have_stable_names() {
    check_names::<ProbeKind>(&["admit", "reject", "stale", "contended", "state"]);
}

#[test]
fn commit_results_have_stable_names() {
    check_names::<CommitKind>(&["admitted", "rejected", "busy", "error"]);
}

#[test]
fn forget_causes_have_stable_names() {
    check_names::<Forgotten>(&["expired", "evicted", "ended"]);
}

/// The kinds name different things: no two enums share a `KIND`, which is what error messages
/// and parse failures tell apart.
#[test]
fn stable_name_kinds_are_unique() {
    let kinds = [
        WorkerRole::KIND,
        Health::KIND,
        ExecutionMode::KIND,
        FallThroughReason::KIND,
        Outcome::KIND,
        PrefillPolicy::KIND,
        EvictionMode::KIND,
        BreakerState::KIND,
        ProbeKind::KIND,
        CommitKind::KIND,
        Forgotten::KIND,
    ];
    let unique: std::collections::BTreeSet<&str> = kinds.iter().copied().collect();
    assert_eq!(unique.len(), kinds.len(), "{kinds:?}");
}

#[test]
fn mechanism_error_rule() {
    let errors: Vec<Outcome> = Outcome::ALL
        .iter()
        .copied()
        .filter(|o| o.is_mechanism_error())
        .collect();
    assert_eq!(
        errors,
        vec![
            Outcome::KvTransferTimeout,
            Outcome::DecodeOom,
            Outcome::Rejected,
            Outcome::WorkerFailed
        ]
    );
    assert!(!Outcome::Ok.is_mechanism_error());
    assert!(!Outcome::InputTooLong.is_mechanism_error());
    assert!(!Outcome::DirectCacheMiss.is_mechanism_error());
    assert!(!Outcome::InvalidRequest.is_mechanism_error());
    assert!(!Outcome::InvalidRequest.is_served());
}

#[test]
fn worker_state_serializes_kebab_case_and_computes_room() {
    let mut s = WorkerState::empty(1000);
    s.used_tokens = 900;
    s.evictable_tokens = 300;
    assert_eq!(s.free_tokens(), 100);
    assert_eq!(s.available_tokens(), 400);
    assert!((s.used_fraction() - 0.9).abs() < 1e-12);
    assert_eq!(s.committed_tokens(), 600);
    assert!((s.committed_fraction() - 0.6).abs() < 1e-12);
    let json = serde_json::to_value(s).unwrap();
    assert_eq!(json["capacity-tokens"], 1000);
    assert_eq!(json["health"], "healthy");
    let back: WorkerState = serde_json::from_value(json).unwrap();
    assert_eq!(back, s);
    // Over-full and zero-capacity pools stay in range.
    s.used_tokens = 5000;
    assert_eq!(s.free_tokens(), 0);
    assert_eq!(s.available_tokens(), 300);
    assert_eq!(s.used_fraction(), 1.0);
    assert_eq!(WorkerState::empty(0).used_fraction(), 1.0);
    assert_eq!(WorkerState::empty(0).committed_fraction(), 1.0);
    // More evictable than used (inconsistent input) saturates at zero.
    s.evictable_tokens = 9000;
    assert_eq!(s.committed_tokens(), 0);
}

#[test]
fn trace_record_round_trips_mooncake_shape() {
    let line =
        r#"{"timestamp": 40, "input_length": 1025, "output_length": 3, "hash_ids": [7, 8, 9]}"#;
    let r: TraceRecord = serde_json::from_str(line).unwrap();
    assert_eq!(r.timestamp, 40);
    assert_eq!(r.session_id, None);
    assert_eq!(r.hash_ids, vec![BlockHash(7), BlockHash(8), BlockHash(9)]);
    assert!(r.hash_len_matches(BlockSize::default()));
    let out = serde_json::to_string(&r).unwrap();
    assert!(
        !out.contains("session_id"),
        "absent session must not be written: {out}"
    );
    let with = r#"{"timestamp":1,"session_id":4,"turn_id":2,"input_length":512,"output_length":1,"hash_ids":[1]}"#;
    let r: TraceRecord = serde_json::from_str(with).unwrap();
    assert_eq!(r.session_id, Some(SessionId(4)));
    assert_eq!(r.turn_id, Some(TurnId(2)));
    assert_eq!(serde_json::to_string(&r).unwrap(), with);
    let short = TraceRecord {
        hash_ids: vec![],
        ..r
    };
    assert!(!short.hash_len_matches(BlockSize::default()));
}

#[test]
fn trace_record_parent_and_final_are_written_only_when_set() {
    let child = r#"{"timestamp":9,"session_id":7,"parent_session_id":3,"turn_id":2,"final":true,"input_length":600,"output_length":5,"hash_ids":[1,2]}"#;
    let r: TraceRecord = serde_json::from_str(child).unwrap();
    assert_eq!(r.parent_session_id, Some(SessionId(3)));
    assert!(r.session_final);
    assert_eq!(serde_json::to_string(&r).unwrap(), child);
    // Unset, they are not written: a plain record reads and writes back unchanged.
    let plain = TraceRecord {
        parent_session_id: None,
        session_final: false,
        ..r
    };
    assert_eq!(
        serde_json::to_string(&plain).unwrap(),
        r#"{"timestamp":9,"session_id":7,"turn_id":2,"input_length":600,"output_length":5,"hash_ids":[1,2]}"#
    );
    let explicit_false: TraceRecord = serde_json::from_str(
        r#"{"timestamp":9,"final":false,"input_length":1,"output_length":1,"hash_ids":[1]}"#,
    )
    .unwrap();
    assert!(!explicit_false.session_final);
}

#[test]
fn topologies_parse_and_print() {
    for (text, t) in [
        (
            "1p3d",
            Topology::Disaggregated {
                prefill: 1,
                decode: 3,
            },
        ),
        (
            "2p6d",
            Topology::Disaggregated {
                prefill: 2,
                decode: 6,
            },
        ),
        (
            "8p24d",
            Topology::Disaggregated {
                prefill: 8,
                decode: 24,
            },
        ),
        ("4dp", Topology::Colocated { workers: 4 }),
        ("8DP", Topology::Colocated { workers: 8 }),
    ] {
        assert_eq!(text.parse::<Topology>().unwrap(), t, "{text}");
        assert_eq!(t.to_string(), text.to_ascii_lowercase());
        assert_eq!(serde_json::to_string(&t).unwrap(), format!("\"{}\"", t));
    }
    assert_eq!("1p3d".parse::<Topology>().unwrap().worker_count(), 4);
    for bad in [
        "", "p3d", "1p", "0p3d", "1p0d", "0dp", "dp", "3d1p", "1p3dx", "-1p3d", "1x3d",
    ] {
        assert!(bad.parse::<Topology>().is_err(), "{bad} should be rejected");
    }
}

#[test]
fn session_key_hash_is_stable() {
    assert_eq!(SessionId::from_key(""), SessionId(0xcbf2_9ce4_8422_2325));
    assert_eq!(SessionId::from_key("a"), SessionId(0xaf63_dc4c_8601_ec8c));
    assert_ne!(
        SessionId::from_key("agent-1"),
        SessionId::from_key("agent-2")
    );
}

fn h(ids: &[u64]) -> Vec<BlockHash> {
    ids.iter().copied().map(BlockHash).collect()
}

#[test]
fn prefix_helpers_edge_cases() {
    let bs = BlockSize::default();
    // Empty lists.
    assert_eq!(shared_prefix_blocks(&[], &[]), 0);
    assert_eq!(shared_prefix_blocks(&h(&[1, 2]), &[]), 0);
    assert_eq!(reusable_from(&[], &h(&[1, 2]), 1024, bs), 0);
    // Full match.
    assert_eq!(shared_prefix_blocks(&h(&[1, 2, 3]), &h(&[1, 2, 3])), 3);
    assert_eq!(
        reusable_from(&h(&[1, 2, 3]), &h(&[1, 2, 3]), 1536, bs),
        1536
    );
    // Divergence at block 0.
    assert_eq!(shared_prefix_blocks(&h(&[9, 2, 3]), &h(&[1, 2, 3])), 0);
    // A later equal block after divergence does not count (ids are chained).
    assert_eq!(shared_prefix_blocks(&h(&[1, 5, 3]), &h(&[1, 2, 3])), 1);
    // One list a prefix of the other.
    assert_eq!(shared_prefix_blocks(&h(&[1, 2]), &h(&[1, 2, 3, 4])), 2);
    // Partial last block: 1,100 tokens = 2 full blocks + 76 tokens; a full hash match reuses
    // only the full blocks.
    assert_eq!(
        reusable_from(&h(&[1, 2, 3]), &h(&[1, 2, 3]), 1100, bs),
        1024
    );
    assert_eq!(reusable_tokens(3, 1100, bs), 1024);
    assert_eq!(reusable_tokens(1, 1100, bs), 512);
    assert_eq!(reusable_tokens(0, 1100, bs), 0);
    // An input under one block reuses nothing.
    assert_eq!(reusable_tokens(1, 300, bs), 0);
    assert_eq!(uncached_tokens(1100, 1024), 76);
    assert_eq!(uncached_tokens(100, 1024), 0);
    // Block arithmetic.
    assert_eq!(bs.blocks_for(0), 0);
    assert_eq!(bs.blocks_for(512), 1);
    assert_eq!(bs.blocks_for(513), 2);
    assert_eq!(bs.full_blocks(1023), 1);
    assert!(BlockSize::new(0).is_none());
    assert_eq!(BlockSize::new(16).unwrap().blocks_for(33), 3);
}

proptest::proptest! {
    #[test]
    fn reusable_never_exceeds_input(a in proptest::collection::vec(0u64..4, 0..20),
                                    b in proptest::collection::vec(0u64..4, 0..20),
                                    input in 0u64..20_000) {
        let (a, b) = (h(&a), h(&b));
        let n = shared_prefix_blocks(&a, &b);
        proptest::prop_assert!(n <= a.len().min(b.len()));
        proptest::prop_assert_eq!(&a[..n], &b[..n]);
        if n < a.len().min(b.len()) { proptest::prop_assert_ne!(a[n], b[n]); }
        let r = reusable_from(&a, &b, input, BlockSize::default());
        proptest::prop_assert!(r <= input);
        proptest::prop_assert_eq!(r % 512, 0);
    }
}

#[test]
fn state_sources_have_stable_names() {
    check_names::<StateSource>(&["snapshot", "service", "events"]);
}

#[test]
fn engine_kinds_have_stable_names() {
    check_names::<EngineKind>(&["vllm", "sglang"]);
}
