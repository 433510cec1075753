//! What the router benchmarks share: the workers' snapshot files, a 1P2D fleet of them, and
//! the smoke switch.
//!
//! `KVC_BENCH_SMOKE=1` asks every router bench for its smoke run: the whole pipeline at its
//! smallest sizes (each bench's docs say which shrink), every `KVC_BENCH_OUT` key still
//! written, to check that the bench runs — its figures measure nothing.

use kvc_core::WorkerId;
use std::path::{Path, PathBuf};

/// Whether `KVC_BENCH_SMOKE=1` asks for the smoke run (see the module's docs).
pub(crate) fn smoke() -> bool {
    std::env::var("KVC_BENCH_SMOKE").is_ok_and(|v| v == "1")
}

/// `full` in the full run, `small` in the smoke run.
pub(crate) fn size<T>(full: T, small: T) -> T {
    if smoke() { small } else { full }
}

/// `c`, with fewer bootstrap resamples (2,000) in the smoke run: their analysis dominates an
/// unoptimised build's run, and the point estimates do not depend on them.
pub(crate) fn criterion_settings(c: criterion::Criterion) -> criterion::Criterion {
    if smoke() { c.nresamples(2_000) } else { c }
}

/// Pool of every benchmarked worker, tokens.
pub(crate) const POOL_TOKENS: u64 = 92_000;

/// Creates worker `i`'s snapshot file in `dir` and publishes it empty (the whole pool free)
/// at `now_ms`; returns its path and the writer, which must live as long as the router reads it.
pub(crate) fn fresh_snapshot(
    dir: &Path,
    i: usize,
    now_ms: u64,
) -> (PathBuf, kvc_admission::SnapshotWriter) {
    let path = dir.join(format!("w{i}.snap"));
    let mut w = kvc_admission::SnapshotWriter::create(&path, WorkerId(i as u32), POOL_TOKENS, 64)
        .expect("create a snapshot file");
    let mut d = w.empty_data();
    d.free_tokens = POOL_TOKENS;
    d.publish_ms = now_ms;
    w.publish(&d).expect("publish a snapshot");
    (path, w)
}

/// The benchmarks' runtime: two worker threads, timers and I/O.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("start a runtime")
}

/// A fresh scratch folder `kvc-<name>-<pid>` under the temp directory.
pub(crate) fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvc-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the scratch folder");
    dir
}

/// The wall clock the snapshots are stamped with, ms.
pub(crate) fn now_ms() -> u64 {
    use kvc_admission::Clock;
    kvc_admission::SystemClock.now_ms()
}

/// A router configuration over one prefill and two decode workers, each with a fresh snapshot
/// file in a scratch folder named `name` (kept fresh for an hour: they are published once),
/// the writers, which must live as long as the router reads them, and the folder.
#[allow(
    dead_code,
    reason = "the endpoint-picker bench builds a fleet of its own"
)]
pub(crate) fn one_p_two_d(
    name: &str,
) -> (
    kvc_router::RouterConfig,
    Vec<kvc_admission::SnapshotWriter>,
    PathBuf,
) {
    use kvc_core::WorkerRole;
    let dir = scratch_dir(name);
    let now = now_ms();
    let mut cfg = kvc_router::RouterConfig {
        listen: "127.0.0.1:0".parse().expect("an address"),
        metrics_listen: None,
        stale_after_ms: 3_600_000,
        max_pending_decisions: 10_000,
        ..kvc_router::RouterConfig::default()
    };
    let mut writers = Vec::new();
    for (i, role) in [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Decode]
        .into_iter()
        .enumerate()
    {
        let (path, w) = fresh_snapshot(&dir, i, now);
        writers.push(w);
        cfg.workers.push(kvc_router::WorkerConfig {
            snapshot: Some(path),
            ..kvc_router::WorkerConfig::new(i as u32, role, POOL_TOKENS)
        });
    }
    (cfg, writers, dir)
}
