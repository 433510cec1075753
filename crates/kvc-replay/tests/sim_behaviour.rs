//! Simulator behaviour: determinism, accounting, and faithfulness of the baseline policies.

mod common;

use common::{run, run_with, seed7, swe_trace};
use kvc_core::{ExecutionMode, Outcome};
use kvc_replay::output::write_run;
use std::collections::BTreeMap;

#[test]
fn same_run_twice_gives_byte_identical_metrics() {
    let trace = swe_trace(3, 8);
    let dir = std::env::temp_dir().join(format!("kvc-sim-det-{}", std::process::id()));
    let a = run(&trace, "1p3d", "kvc-v2");
    let b = run(&trace, "1p3d", "kvc-v2");
    write_run(&a, &dir.join("a")).unwrap();
    write_run(&b, &dir.join("b")).unwrap();
    let ma = std::fs::read(dir.join("a/metrics.jsonl")).unwrap();
    let mb = std::fs::read(dir.join("b/metrics.jsonl")).unwrap();
    assert!(!ma.is_empty());
    assert_eq!(ma, mb, "metrics.jsonl differs between identical runs");
    // A different jitter seed changes timings.
    let c = run_with(&trace, "1p3d", "kvc-v2", |c| c.seed = 99);
    write_run(&c, &dir.join("c")).unwrap();
    assert_ne!(ma, std::fs::read(dir.join("c/metrics.jsonl")).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_request_appears_once_and_over_limit_is_not_an_error() {
    let trace = seed7();
    for (topology, policy) in [
        ("1p3d", "kv-aware-v0"),
        ("1p3d", "kvc-v2"),
        ("4dp", "cache-aware"),
    ] {
        let out = run(trace, topology, policy);
        assert_eq!(out.records.len(), trace.requests.len());
        for (i, r) in out.records.iter().enumerate() {
            assert_eq!(
                r.index, i,
                "{topology}+{policy}: records are in trace order"
            );
        }
        let over: Vec<usize> = trace
            .requests
            .iter()
            .filter(|r| r.input_length > 92_098)
            .map(|r| r.index)
            .collect();
        assert!(
            !over.is_empty(),
            "the generated trace has over-limit requests"
        );
        for i in &over {
            assert_eq!(
                out.records[*i].outcome,
                Outcome::InputTooLong,
                "{topology}+{policy}"
            );
            assert_eq!(out.records[*i].mode, None);
        }
        let s = &out.summary;
        assert_eq!(s.requests, trace.requests.len());
        assert_eq!(
            s.outcomes["input-too-long"],
            over.len(),
            "{topology}+{policy}"
        );
        let errors: usize = s
            .outcomes
            .iter()
            .filter(|(k, _)| *k != "ok" && *k != "input-too-long")
            .map(|(_, v)| *v)
            .sum();
        assert_eq!(s.mechanism_errors, errors);
        assert_eq!(s.outcomes.values().sum::<usize>(), trace.requests.len());
        // Timing sanity on every ok record.
        for r in out.records.iter().filter(|r| r.outcome == Outcome::Ok) {
            let ttft = r.ttft_s.unwrap();
            assert!(ttft > 0.0 && ttft <= r.latency_s + 1e-9, "{r:?}");
            assert!(r.dispatch_s >= r.scheduled_s && r.done_s >= r.dispatch_s);
            assert_eq!(r.cached_tokens + r.uncached_tokens, r.input_tokens);
        }
        if topology == "4dp" {
            assert!(
                out.records
                    .iter()
                    .all(|r| r.mode.is_none() || r.mode == Some(ExecutionMode::Colocated))
            );
            assert!(out.records.iter().all(|r| r.prefill.is_none()));
        }
    }
}

#[test]
fn kv_aware_v0_never_moves_a_session_and_v2_rarely_does() {
    let trace = seed7();
    let v0 = run(trace, "1p3d", "kv-aware-v0");
    let mut first_d: BTreeMap<_, String> = BTreeMap::new();
    for r in &v0.records {
        if let Some(d) = &r.decode {
            let pinned = first_d.entry(r.session).or_insert_with(|| d.clone());
            assert_eq!(pinned, d, "kv-aware-v0 moved session {}", r.session);
        }
    }
    assert_eq!(v0.summary.sessions.d_changes_max, 0);
    let v2 = run(trace, "1p3d", "kvc-v2");
    assert!(
        v2.summary.sessions.d_changes_mean < 2.0,
        "kvc-v2 mean D changes {}",
        v2.summary.sessions.d_changes_mean
    );
}

#[test]
fn turns_of_a_session_run_in_order() {
    let trace = swe_trace(5, 6);
    let out = run(&trace, "1p3d", "kvc-v2");
    let mut last: BTreeMap<_, (u32, f64)> = BTreeMap::new();
    let mut recs: Vec<_> = out.records.iter().collect();
    recs.sort_by_key(|r| (r.session, r.turn));
    for r in recs {
        if let Some((turn, done)) = last.get(&r.session) {
            assert!(r.turn.0 > *turn);
            assert!(
                r.scheduled_s >= *done - 1e-9,
                "turn starts before the previous one ended"
            );
        }
        last.insert(r.session, (r.turn.0, r.done_s));
    }
}

#[test]
fn a_policy_counting_other_blocks_than_the_trace_is_refused() {
    use kvc_core::{BlockSize, Topology};
    use kvc_policy::PolicyConfig;
    use kvc_replay::sim::{SimConfig, SimError, simulate};
    use kvc_replay::trace::{LoadOptions, generate, parse, write_jsonl};
    let records = generate::swe(&generate::SweConfig {
        seed: 1,
        sessions: 1,
        ..Default::default()
    });
    let mut bytes = Vec::new();
    write_jsonl(&mut bytes, &records).unwrap();
    let trace = parse(&bytes[..], "t", &LoadOptions::default()).unwrap().0;
    let mut cfg = SimConfig::new(
        Topology::Disaggregated {
            prefill: 1,
            decode: 1,
        },
        PolicyConfig::from_name("kvc-v2").unwrap(),
    );
    if let PolicyConfig::KvcV2(c) = &mut cfg.policy {
        c.block_size = BlockSize::new(256).unwrap();
    }
    let err = simulate(&trace, &cfg, &mut |_, _| {}).unwrap_err();
    assert!(
        matches!(err, SimError::Invalid(ref m) if m.contains("512-token blocks")),
        "{err}"
    );
}

#[test]
fn the_engine_s_intake_delays_each_request_by_its_own_length() {
    let trace = swe_trace(3, 8);
    let plain = run(&trace, "2dp", "cache-aware");
    let (fixed_ms, per_1k_ms) = (6.0, 3.0);
    let taken = run_with(&trace, "2dp", "cache-aware", |c| {
        c.profile.fit.intake_ms = fixed_ms;
        c.profile.fit.intake_ms_per_1k_tokens = per_1k_ms;
    });
    assert_eq!(plain.records.len(), taken.records.len());
    let intake = |r: &kvc_replay::sim::metrics::RequestRecord| {
        (fixed_ms + per_1k_ms * r.input_tokens as f64 / 1e3) / 1e3
    };
    // The first request meets idle engines: its first token comes exactly the intake later.
    let (a, b) = (&plain.records[0], &taken.records[0]);
    let shift = b.ttft_s.unwrap() - a.ttft_s.unwrap();
    assert!((shift - intake(b)).abs() < 2e-6, "{shift} vs {}", intake(b));
    assert!((b.latency_s - a.latency_s - intake(b)).abs() < 2e-6);
    for (a, b) in plain.records.iter().zip(&taken.records) {
        // Nobody waits longer to be sent: the intake is the engine's, not the client's.
        assert!((a.wait_s - b.wait_s).abs() < 1e-9, "{a:?}\n{b:?}");
        assert_eq!(a.outcome, b.outcome);
        if let Some(t) = b.ttft_s {
            assert!(t >= intake(b) - 1e-6, "{b:?}");
        }
    }
    // The default profile has none.
    assert_eq!(kvc_replay::sim::Profile::default().fit.intake_ms, 0.0);
}
