//! Generator seeds held out from the rest of the suite (which replays seeds 7, 11 and 13):
//! `kvc` at its defaults, at time-scale 10 on eight GPUs, fails no request through a
//! mechanism of its own. The seeds are those on which it once did (transfer timeouts of
//! sessions whose context nearly fills a pool: `docs/calibration.md`, "Held-out seeds");
//! `cargo xtask bench` sweeps seeds 0–29 (`sim.kvc_ts10_*_mechanism_errors_max`). A failed
//! request's record says why it failed (`failure`).

mod common;

use common::{run_with, swe_trace};
use kvc_core::Outcome;

fn no_mechanism_error(seed: u64, topology: &str) {
    let trace = swe_trace(seed, 52);
    let out = run_with(&trace, topology, "kvc", |c| c.time_scale = 10.0);
    let failed: Vec<_> = out
        .records
        .iter()
        .filter(|r| r.outcome.is_mechanism_error())
        .map(|r| (r.index, r.outcome, r.failure.clone()))
        .collect();
    assert_eq!(
        out.summary.mechanism_errors, 0,
        "seed {seed} {topology}: {failed:?}"
    );
}

#[test]
fn hybrid_seeds_that_failed_fail_nothing() {
    for seed in [2, 3, 15, 19, 23, 27] {
        no_mechanism_error(seed, "2p6d-hybrid");
    }
}

#[test]
fn plain_seeds_that_failed_fail_nothing() {
    for seed in [4, 20, 28] {
        no_mechanism_error(seed, "2p6d");
    }
}

/// Where requests do fail (four GPUs at ten times the trace's pace), every failed request's
/// record names what it waited for, on which worker, and for how long.
#[test]
fn every_failed_request_says_why() {
    let trace = swe_trace(2, 20);
    let out = run_with(&trace, "1p3d", "kvc", |c| c.time_scale = 10.0);
    let mut failed = 0;
    for r in &out.records {
        if matches!(r.outcome, Outcome::KvTransferTimeout | Outcome::DecodeOom) {
            failed += 1;
            let f = r.failure.as_ref().expect("a failed request says why");
            assert!(
                f.worker == r.decode.clone().unwrap() || Some(&f.worker) == r.prefill.as_ref(),
                "{r:?}"
            );
            assert!((0.0..=32.0 + 1e-9).contains(&f.waited_s), "{r:?}");
            assert!(f.queue_depth >= 1, "{r:?}");
        } else {
            assert!(r.failure.is_none(), "{r:?}");
        }
    }
    assert!(failed > 0, "the run is meant to fail some requests");
}
