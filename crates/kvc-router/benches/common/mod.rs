//! What the router benchmarks share: the workers' snapshot files.

use kvc_core::WorkerId;
use std::path::{Path, PathBuf};

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
