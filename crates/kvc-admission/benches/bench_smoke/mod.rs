//! The smoke switch this crate's benches share: `KVC_BENCH_SMOKE=1` (`cargo xtask bench
//! --smoke`) asks for each bench at its smallest, a check that it runs, not a measurement.

use criterion::Criterion;

/// Whether `KVC_BENCH_SMOKE=1` asks for the smoke run.
pub(crate) fn smoke() -> bool {
    std::env::var("KVC_BENCH_SMOKE").is_ok_and(|v| v == "1")
}

/// Criterion's settings: its defaults, or fewer bootstrap resamples in the smoke run (their
/// analysis dominates an unoptimised build's run, and the medians read do not depend on
/// them).
pub(crate) fn config() -> Criterion {
    if smoke() {
        Criterion::default().nresamples(2_000)
    } else {
        Criterion::default()
    }
}
