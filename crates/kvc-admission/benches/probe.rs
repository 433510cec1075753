//! Probe latency with a writer thread publishing continuously.
//!
//! `probe/readers1`: one reader thread probing. `probe/readers2`: two reader threads probing at
//! once (time per probe per thread, the slower thread). The writer republishes a 32-session
//! snapshot in a loop, yielding between publishes (`KVC_BENCH_WRITER_PAUSE_US` sets a sleep
//! between publishes instead).
//!
//! `KVC_BENCH_SMOKE=1` (a check that the bench runs, not a measurement) shrinks only
//! criterion's bootstrap, to 2,000 resamples: the fixture is already small.

mod bench_smoke;

use bench_smoke::config;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvc_admission::{
    Clock, ProbeResult, ResidentEntry, ResidentState, SnapshotData, SnapshotReader, SnapshotWriter,
    SystemClock,
};
use kvc_core::{SessionId, WorkerId};
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

const SESSIONS: u64 = 32;

fn snapshot_path() -> PathBuf {
    let dir = PathBuf::from("/dev/shm");
    let dir = if dir.is_dir() {
        dir
    } else {
        std::env::temp_dir()
    };
    dir.join(format!("kvc-bench-probe-{}.snap", std::process::id()))
}

fn data(writer: &SnapshotWriter, k: u64, now_ms: u64) -> SnapshotData {
    let mut d = writer.empty_data();
    d.used_tokens = 60_000 + k % 1_000;
    d.free_tokens = 30_000 - k % 1_000;
    d.evictable_tokens = 10_000;
    d.queue_depth = (k % 4) as u32;
    d.in_flight = 8;
    d.publish_ms = now_ms;
    d.residents = (0..SESSIONS)
        .map(|i| ResidentEntry {
            session: SessionId(i * 7),
            tokens: 1_000 + i,
            last_access_ms: now_ms,
            state: if i % 3 == 0 {
                ResidentState::Running
            } else {
                ResidentState::Idle
            },
        })
        .collect();
    d
}

struct Tally {
    ready: AtomicU64,
    other: AtomicU64,
}

impl Tally {
    fn count(&self, r: &ProbeResult) {
        match r {
            ProbeResult::Ready(_) => self.ready.fetch_add(1, Ordering::Relaxed),
            _ => self.other.fetch_add(1, Ordering::Relaxed),
        };
    }
}

fn probe_loop(reader: &SnapshotReader, iters: u64, now_ms: u64) -> (Duration, u64) {
    let mut ready = 0;
    let start = Instant::now();
    for i in 0..iters {
        let session = SessionId((i % SESSIONS) * 7);
        let r = reader.probe(black_box(2_000), Some(black_box(session)), now_ms);
        ready += u64::from(matches!(r, ProbeResult::Ready(_)));
        black_box(r);
    }
    (start.elapsed(), ready)
}

fn bench_probe(c: &mut Criterion) {
    let path = snapshot_path();
    let mut writer = SnapshotWriter::create(&path, WorkerId(0), 90_000, 64).expect("create");
    writer
        .publish(&data(&writer, 0, SystemClock.now_ms()))
        .expect("publish");
    let pause = std::env::var("KVC_BENCH_WRITER_PAUSE_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&us| us > 0)
        .map(Duration::from_micros);
    let stop = Arc::new(AtomicBool::new(false));
    let publishes = Arc::new(AtomicU64::new(0));
    let writer_thread = {
        let stop = Arc::clone(&stop);
        let publishes = Arc::clone(&publishes);
        thread::spawn(move || {
            let mut k = 0;
            let mut d = data(&writer, 0, SystemClock.now_ms());
            while !stop.load(Ordering::Relaxed) {
                k += 1;
                d.used_tokens = 60_000 + k % 1_000;
                d.free_tokens = 30_000 - k % 1_000;
                d.queue_depth = (k % 4) as u32;
                if k % 1_024 == 0 {
                    d.publish_ms = SystemClock.now_ms();
                }
                writer.publish(&d).expect("publish");
                match pause {
                    Some(p) => thread::sleep(p),
                    None => thread::yield_now(),
                }
            }
            publishes.store(k, Ordering::Relaxed);
        })
    };

    let reader = SnapshotReader::open(&path)
        .expect("open")
        .with_stale_after_ms(60_000);
    let tally = Tally {
        ready: AtomicU64::new(0),
        other: AtomicU64::new(0),
    };
    let mut group = c.benchmark_group("probe");
    group.throughput(Throughput::Elements(1));
    group.bench_function("readers1", |b| {
        let now_ms = SystemClock.now_ms();
        b.iter(|| {
            let r = reader.probe(black_box(2_000), Some(black_box(SessionId(70))), now_ms);
            tally.count(&r);
            r
        })
    });
    group.bench_function("readers2", |b| {
        b.iter_custom(|iters| {
            let now_ms = SystemClock.now_ms();
            let barrier = Barrier::new(2);
            let (d1, d2) = thread::scope(|s| {
                let run = || {
                    barrier.wait();
                    probe_loop(&reader, iters, now_ms)
                };
                let h1 = s.spawn(run);
                let h2 = s.spawn(run);
                (h1.join().expect("reader"), h2.join().expect("reader"))
            });
            tally.ready.fetch_add(d1.1 + d2.1, Ordering::Relaxed);
            tally
                .other
                .fetch_add(2 * iters - d1.1 - d2.1, Ordering::Relaxed);
            d1.0.max(d2.0)
        })
    });
    group.finish();

    stop.store(true, Ordering::Relaxed);
    writer_thread.join().expect("writer");
    let _ = std::fs::remove_file(&path);
    let ready = tally.ready.load(Ordering::Relaxed);
    let other = tally.other.load(Ordering::Relaxed);
    eprintln!(
        "probe: {} publishes; {ready} probes ready, {other} contended or stale ({:.3}%)",
        publishes.load(Ordering::Relaxed),
        100.0 * other as f64 / (ready + other).max(1) as f64
    );
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_probe
}
criterion_main!(benches);
