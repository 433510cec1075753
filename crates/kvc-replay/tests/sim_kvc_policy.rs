//! The `kvc` policy against the baselines (issue targets), on two generator seeds, concurrency
//! 32, TTFT and latency from when each turn is ready.

mod common;

use common::{run_with, swe_trace};
use kvc_replay::sim::metrics::Summary;

fn headline(s: &Summary) -> [(&'static str, f64); 8] {
    [
        ("TTFT mean", s.ttft_s.mean),
        ("TTFT p50", s.ttft_s.p50),
        ("TTFT p90", s.ttft_s.p90),
        ("TTFT p99", s.ttft_s.p99),
        ("latency mean", s.latency_s.mean),
        ("latency p50", s.latency_s.p50),
        ("latency p90", s.latency_s.p90),
        ("latency p99", s.latency_s.p99),
    ]
}

fn check_seed(seed: u64) {
    let trace = swe_trace(seed, 52);
    let ts1 = |topology: &str, policy: &str| run_with(&trace, topology, policy, |_| {}).summary;
    let kvc = ts1("1p3d", "kvc");
    let dp = ts1("4dp", "cache-aware");
    let v2 = ts1("1p3d", "kvc-v2");
    // Time-scale 1: lower than the colocated baseline on all eight figures.
    for ((name, k), (_, b)) in headline(&kvc).into_iter().zip(headline(&dp)) {
        assert!(
            k < b,
            "seed {seed}: kvc {name} {k:.4} is not below 4dp+cache-aware's {b:.4}"
        );
    }
    // Time-scale 1: no headline figure worse than kvc-v2 by more than 2%, and a p99 better by 5%.
    for ((name, k), (_, b)) in headline(&kvc).into_iter().zip(headline(&v2)) {
        assert!(
            k <= b * 1.02,
            "seed {seed}: kvc {name} {k:.4} vs kvc-v2 {b:.4}"
        );
    }
    assert!(
        kvc.ttft_s.p99 <= v2.ttft_s.p99 * 0.95 || kvc.latency_s.p99 <= v2.latency_s.p99 * 0.95,
        "seed {seed}: neither p99 is 5% better than kvc-v2's"
    );
    assert_eq!(kvc.mechanism_errors, 0);
    // Time-scale 10 on 2p6d vs 8dp: no mechanism errors and a TTFT p90 no worse than the
    // colocated baseline's. (Latency p90 stays ~7-9% above 8dp: docs/kvc-policy.md.)
    let ts10 = |topology: &str, policy: &str| {
        run_with(&trace, topology, policy, |c| c.time_scale = 10.0).summary
    };
    let k10 = ts10("2p6d", "kvc");
    let d10 = ts10("8dp", "cache-aware");
    assert_eq!(k10.mechanism_errors, 0, "seed {seed}");
    assert!(
        k10.ttft_s.p90 <= d10.ttft_s.p90,
        "seed {seed}: TTFT p90 {} vs {}",
        k10.ttft_s.p90,
        d10.ttft_s.p90
    );
}

#[test]
fn kvc_beats_the_colocated_baseline_and_v2_seed_7() {
    check_seed(7);
}

#[test]
fn kvc_beats_the_colocated_baseline_and_v2_seed_11() {
    check_seed(11);
}
