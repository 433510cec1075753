//! Policy names, serde configs, documented defaults and validation.

use kvc_core::{BlockSize, StableName};
use kvc_policy::{
    BackpressureConfig, CacheAwareConfig, KvAwareV0Config, KvcV2Config, PolicyConfig, PolicyError,
    PrefillPolicy, RoundRobinConfig,
};

#[test]
fn stable_names_round_trip() {
    assert_eq!(
        PolicyConfig::all_names(),
        &["round-robin", "cache-aware", "kv-aware-v0", "kvc-v2", "kvc"]
    );
    for name in PolicyConfig::all_names() {
        let cfg = PolicyConfig::from_name(name).unwrap();
        assert_eq!(cfg.name(), *name);
        cfg.validate().unwrap();
        let json = serde_json::to_value(&cfg).unwrap();
        assert_eq!(json["policy"], *name);
        let back: PolicyConfig = serde_json::from_value(json).unwrap();
        assert_eq!(back, cfg);
        // Only the tag: every other field takes its default.
        let bare: PolicyConfig =
            serde_json::from_str(&format!(r#"{{"policy": "{name}"}}"#)).unwrap();
        assert_eq!(bare, cfg);
    }
    let err = PolicyConfig::from_name("sticky").unwrap_err();
    assert_eq!(err, PolicyError::UnknownPolicy("sticky".into()));
    assert_eq!(
        err.to_string(),
        "unknown policy `sticky` (expected one of: round-robin, cache-aware, kv-aware-v0, kvc-v2, kvc)"
    );
    assert_eq!(PolicyConfig::default().name(), "kvc");
}

#[test]
fn prefill_policy_names() {
    assert_eq!(
        PrefillPolicy::ALL
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>(),
        vec!["round-robin", "d-health-aware", "prefix-aware"]
    );
    for p in PrefillPolicy::ALL {
        assert_eq!(p.as_str().parse::<PrefillPolicy>().unwrap(), *p);
        assert_eq!(p.to_string(), p.as_str());
        assert_eq!(
            serde_json::to_string(p).unwrap(),
            format!("\"{}\"", p.as_str())
        );
    }
    let err = "random".parse::<PrefillPolicy>().unwrap_err();
    assert_eq!(err.name, "random");
    assert_eq!(
        err.to_string(),
        "unknown prefill policy `random` (expected one of: round-robin, d-health-aware, prefix-aware)"
    );
}

#[test]
fn documented_defaults() {
    let v2 = KvcV2Config::default();
    assert_eq!(v2.direct_limit_tokens, 8_192);
    assert_eq!(v2.hard_cap, 0.85);
    assert_eq!(v2.migrate_after_rejects, 3);
    assert_eq!(v2.overlap_cap_blocks, 16);
    assert_eq!(
        (
            v2.overlap_weight,
            v2.sticky_weight,
            v2.capacity_weight,
            v2.load_weight
        ),
        (1.0, 2.0, 2.0, 0.05)
    );
    assert!(v2.incremental_footprint);
    assert_eq!(v2.prefill, PrefillPolicy::DHealthAware);
    assert_eq!(v2.backpressure, BackpressureConfig::DISABLED);
    assert_eq!(v2.block_size, BlockSize::default());

    let v0 = KvAwareV0Config::default();
    assert_eq!(v0.direct_limit_tokens, 2_048);
    assert_eq!(v0.sticky_bonus, 1_000_000);
    assert!(!v0.first_turn_overlap);
    assert!(!v0.incremental_footprint);
    assert_eq!(v0.prefill, PrefillPolicy::RoundRobin);
    assert!(!v0.backpressure.is_enabled());

    let ca = CacheAwareConfig::default();
    assert_eq!(
        (
            ca.cache_threshold,
            ca.balance_abs_threshold,
            ca.balance_rel_threshold
        ),
        (0.3, 64, 1.5)
    );
    assert!(!ca.backpressure.is_enabled());

    let rr = RoundRobinConfig::default();
    assert_eq!(rr.prefill, PrefillPolicy::RoundRobin);
    assert!(!rr.backpressure.is_enabled());

    let bp = BackpressureConfig::default();
    assert_eq!(
        (
            bp.queue_free,
            bp.used_free,
            bp.ms_per_queued,
            bp.ms_at_full,
            bp.max_pause_ms
        ),
        (4, 0.8, 25, 500, 2_000)
    );

    let cfg = PolicyConfig::from_name("kv-aware-v0").unwrap();
    assert_eq!(cfg.direct_limit_tokens(), Some(2_048));
    assert_eq!(cfg.prefill_policy(), Some(PrefillPolicy::RoundRobin));
    assert_eq!(
        PolicyConfig::from_name("cache-aware")
            .unwrap()
            .prefill_policy(),
        None
    );
    assert_eq!(
        PolicyConfig::from_name("round-robin")
            .unwrap()
            .direct_limit_tokens(),
        None
    );
    assert_eq!(cfg.block_size().tokens(), 512);
}

#[test]
fn kebab_case_fields_and_unknown_fields() {
    let cfg: PolicyConfig = serde_json::from_str(
        r#"{"policy": "kvc-v2", "direct-limit-tokens": 4096, "migrate-after-rejects": 5,
            "prefill": "round-robin", "block-size": 256,
            "backpressure": {"max-pause-ms": 0}}"#,
    )
    .unwrap();
    let PolicyConfig::KvcV2(v2) = cfg else {
        panic!("wrong variant")
    };
    assert_eq!(v2.direct_limit_tokens, 4_096);
    assert_eq!(v2.migrate_after_rejects, 5);
    assert_eq!(v2.prefill, PrefillPolicy::RoundRobin);
    assert_eq!(v2.block_size.tokens(), 256);
    assert!(!v2.backpressure.is_enabled());
    assert_eq!(v2.backpressure.ms_at_full, 500);
    assert_eq!(v2.hard_cap, 0.85);

    for bad in [
        r#"{"policy": "kvc-v2", "hard_cap": 0.9}"#,
        r#"{"policy": "kv-aware-v0", "no-such-field": 1}"#,
        r#"{"policy": "kvc-v3"}"#,
        r#"{"hard-cap": 0.9}"#,
        r#"{"policy": "kvc-v2", "prefill": "random"}"#,
    ] {
        assert!(
            serde_json::from_str::<PolicyConfig>(bad).is_err(),
            "{bad} should not parse"
        );
    }
    let text = serde_json::to_string(&PolicyConfig::from_name("cache-aware").unwrap()).unwrap();
    assert!(text.contains("\"cache-threshold\":0.3"), "{text}");
    assert!(text.contains("\"balance-abs-threshold\":64"), "{text}");
}

#[test]
fn validation_rejects_out_of_range_values() {
    let v2 = KvcV2Config::default();
    let bad_v2 = [
        (
            KvcV2Config {
                hard_cap: 1.5,
                ..v2
            },
            "hard-cap must be within (0, 1]",
        ),
        (
            KvcV2Config {
                hard_cap: f64::NAN,
                ..v2
            },
            "hard-cap must be within (0, 1]",
        ),
        (
            KvcV2Config {
                migrate_after_rejects: 0,
                ..v2
            },
            "migrate-after-rejects must be at least 1",
        ),
        (
            KvcV2Config {
                overlap_cap_blocks: 0,
                ..v2
            },
            "overlap-cap-blocks must be at least 1",
        ),
        (
            KvcV2Config {
                load_weight: -1.0,
                ..v2
            },
            "weights must be finite and >= 0",
        ),
        (
            KvcV2Config {
                backpressure: BackpressureConfig {
                    used_free: 2.0,
                    ..BackpressureConfig::ENABLED
                },
                ..v2
            },
            "backpressure used-free must be within [0, 1]",
        ),
    ];
    for (cfg, detail) in bad_v2 {
        assert_eq!(
            PolicyConfig::KvcV2(cfg).validate(),
            Err(PolicyError::InvalidConfig {
                policy: "kvc-v2",
                detail
            })
        );
    }
    let ca = CacheAwareConfig {
        cache_threshold: 1.1,
        ..CacheAwareConfig::default()
    };
    assert_eq!(
        ca.validate(),
        Err(PolicyError::InvalidConfig {
            policy: "cache-aware",
            detail: "cache-threshold must be within [0, 1]"
        })
    );
    let ca = CacheAwareConfig {
        balance_rel_threshold: f64::INFINITY,
        ..CacheAwareConfig::default()
    };
    assert!(ca.validate().is_err());
    let v0 = KvAwareV0Config {
        backpressure: BackpressureConfig {
            used_free: -0.1,
            ..BackpressureConfig::DISABLED
        },
        ..KvAwareV0Config::default()
    };
    assert!(v0.validate().is_err());
    let rr = RoundRobinConfig {
        backpressure: BackpressureConfig {
            used_free: f64::NAN,
            ..BackpressureConfig::DISABLED
        },
        ..RoundRobinConfig::default()
    };
    assert!(PolicyConfig::RoundRobin(rr).validate().is_err());
}
