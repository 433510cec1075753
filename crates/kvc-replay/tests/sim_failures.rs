//! The failures the reference study found in its baseline (idle-only eviction, round-robin P),
//! reproduced by the simulator's engine, and their absence where the study saw none
//! (docs/calibration.md, "Failure paths"). Generated SWE traces, seeds 7 and 11, concurrency 32.

mod common;

use common::{run_with, swe_trace};
use kvc_core::Outcome;
use kvc_policy::PolicyConfig;
use kvc_replay::sim::{EvictionMode, SimOutput};
use std::collections::BTreeMap;

/// Mechanism errors per decode worker.
fn failures_by_worker(out: &SimOutput) -> BTreeMap<String, usize> {
    let mut by = BTreeMap::new();
    for r in out
        .records
        .iter()
        .filter(|r| r.outcome.is_mechanism_error())
    {
        *by.entry(r.decode.clone().unwrap_or_default()).or_default() += 1;
    }
    by
}

/// Whether worker `name`'s committed fraction reached `at_least` in a sample taken within the
/// transfer timeout (plus one sampling period) before `t`.
fn committed_before(out: &SimOutput, name: &str, t: f64, at_least: f64) -> bool {
    let k = out.worker_names.iter().position(|n| n == name).unwrap();
    out.committed
        .iter()
        .filter(|(s, _)| *s <= t && *s >= t - 42.0)
        .any(|(_, f)| f[k] >= at_least)
}

/// One of kvc's three fixes for the baseline's failures.
#[derive(Clone, Copy)]
enum Fix {
    Eviction,
    Backpressure,
    PrefillChoice,
}

/// `kvc` with all three fixes (tiered eviction, the backpressure hint, d-health-aware P
/// choice) at `time_scale`, but for `off`, switched back to the baseline's.
fn deployed_kvc(c: &mut kvc_replay::sim::SimConfig, time_scale: f64, off: Option<Fix>) {
    c.time_scale = time_scale;
    c.eviction = EvictionMode::Tiered;
    if let PolicyConfig::Kvc(k) = &mut c.policy {
        k.backpressure = kvc_policy::BackpressureConfig::ENABLED;
        k.prefill = kvc_policy::PrefillPolicy::DHealthAware;
        match off {
            Some(Fix::Eviction) => c.eviction = EvictionMode::IdleLru,
            Some(Fix::Backpressure) => k.backpressure = kvc_policy::BackpressureConfig::DISABLED,
            Some(Fix::PrefillChoice) => k.prefill = kvc_policy::PrefillPolicy::RoundRobin,
            None => {}
        }
    }
}

fn check_seed(seed: u64) {
    let trace = swe_trace(seed, 52);
    let ts10 = |c: &mut kvc_replay::sim::SimConfig| c.time_scale = 10.0;

    // 2p6d + kv-aware-v0 at time-scale 10: transfers time out on the decode workers whose
    // pools sit full of sessions with requests in flight (about 1% of requests; decode OOM
    // does not appear there, docs/calibration.md says why).
    let v0 = run_with(&trace, "2p6d", "kv-aware-v0", ts10);
    let o = &v0.summary.outcomes;
    let timeouts = o["kv-transfer-timeout"];
    assert!(timeouts >= 30, "seed {seed}: {timeouts} transfer timeouts");
    assert_eq!(
        v0.summary.mechanism_errors,
        timeouts + o["decode-oom"],
        "seed {seed}: only the memory failure paths fail requests"
    );
    let by = failures_by_worker(&v0);
    // Concentrated: one decode worker takes at least 40% of them (an even spread over six
    // would give each 17%), and at least 80% strike a pool that was ≥ 80% committed (sessions
    // running or with a request in flight) in the timeout before.
    let worst = by.values().copied().max().unwrap_or(0);
    assert!(
        worst * 10 >= v0.summary.mechanism_errors * 4,
        "seed {seed}: failures not concentrated: {by:?}"
    );
    let near_full = v0
        .records
        .iter()
        .filter(|r| r.outcome.is_mechanism_error())
        .filter(|r| committed_before(&v0, r.decode.as_deref().unwrap(), r.done_s, 0.8))
        .count();
    assert!(
        near_full * 10 >= v0.summary.mechanism_errors * 8,
        "seed {seed}: only {near_full} failures on a pool ≥ 80% committed"
    );

    // Where the study saw no such failure, none.
    let dp = run_with(&trace, "8dp", "cache-aware", ts10);
    assert_eq!(dp.summary.mechanism_errors, 0, "seed {seed}: 8dp");
    let kvc = run_with(&trace, "2p6d", "kvc", ts10);
    assert_eq!(kvc.summary.mechanism_errors, 0, "seed {seed}: 2p6d kvc");
    let deployed = run_with(&trace, "2p6d", "kvc", |c| deployed_kvc(c, 10.0, None));
    assert_eq!(
        deployed.summary.mechanism_errors, 0,
        "seed {seed}: 2p6d kvc with tiered eviction and backpressure"
    );
    // The ablation (docs/calibration.md): at this load kvc's placement keeps the decode pools
    // healthy by itself, so each of its three fixes switched off alone still fails nothing.
    for (fix, off) in [
        ("tiered eviction", Fix::Eviction),
        ("backpressure", Fix::Backpressure),
        ("d-health-aware P", Fix::PrefillChoice),
    ] {
        let run = run_with(&trace, "2p6d", "kvc", |c| deployed_kvc(c, 10.0, Some(off)));
        assert_eq!(
            run.summary.mechanism_errors, 0,
            "seed {seed}: 2p6d kvc without {fix}"
        );
    }
    // Under overload (1p3d at time-scale 10) kvc fails too, and backpressure is the fix whose
    // removal brings failures back on both seeds.
    let all = run_with(&trace, "1p3d", "kvc", |c| deployed_kvc(c, 10.0, None));
    let no_pause = run_with(&trace, "1p3d", "kvc", |c| {
        deployed_kvc(c, 10.0, Some(Fix::Backpressure))
    });
    assert!(
        no_pause.summary.mechanism_errors > all.summary.mechanism_errors,
        "seed {seed}: 1p3d kvc without backpressure: {} vs {}",
        no_pause.summary.mechanism_errors,
        all.summary.mechanism_errors
    );

    let v0_ts1 = run_with(&trace, "1p3d", "kv-aware-v0", |_| {});
    assert_eq!(
        v0_ts1.summary.mechanism_errors, 0,
        "seed {seed}: the baseline at time-scale 1"
    );
    assert!(
        v0_ts1
            .records
            .iter()
            .all(|r| r.retractions == 0 && r.outcome != Outcome::DecodeOom)
    );
}

#[test]
fn the_baseline_fails_under_pressure_seed_7() {
    check_seed(7);
}

#[test]
fn the_baseline_fails_under_pressure_seed_11() {
    check_seed(11);
}
