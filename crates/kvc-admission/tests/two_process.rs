//! A real second process reads the snapshot while this one publishes as fast as it can.
//!
//! `child_process_never_accepts_a_torn_snapshot` re-executes this test binary with
//! `KVC_ADMISSION_CHILD_SNAPSHOT` set and a filter naming `reader_side`; that test then opens
//! the file and reads up to 1,000,000 snapshots (fewer when the time limit comes first: a
//! loaded machine reads slower, and the property checked is that no snapshot read is torn,
//! not a speed; at least `MIN_ACCEPTED` must be read). Run on its own (no variable), `reader_side` checks
//! the same properties against a writer thread of its own process.

use kvc_admission::{
    ReadError, ResidentEntry, ResidentState, SnapshotData, SnapshotReader, SnapshotWriter,
};
use kvc_core::{SessionId, WorkerId};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "KVC_ADMISSION_CHILD_SNAPSHOT";
const CHILD_READS: u64 = 1_000_000;
const IN_PROCESS_READS: u64 = 100_000;
/// The reader stops here even short of its count.
const READ_TIME_LIMIT: Duration = Duration::from_secs(40);
/// Snapshots a reader must accept, whatever the time limit cut short.
const MIN_ACCEPTED: u64 = 10_000;
const RESIDENTS: u64 = 4;
/// Different snapshots a reader must see before it stops.
const MIN_DISTINCT: u64 = 1_000;
const CAPACITY: u64 = 1 << 40;

fn temp_snapshot(name: &str) -> PathBuf {
    let base = Path::new("/dev/shm");
    let base = if base.is_dir() {
        base.to_owned()
    } else {
        std::env::temp_dir()
    };
    base.join(format!(
        "kvc-admission-{name}-{}-{}.snap",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ))
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Publish number `k`: every word is derived from `k`.
fn fill(d: &mut SnapshotData, k: u64) {
    d.used_tokens = k;
    d.free_tokens = CAPACITY - k;
    d.evictable_tokens = k.wrapping_mul(7) % CAPACITY;
    d.queue_depth = (k % 1_000) as u32;
    d.in_flight = (k % 997) as u32;
    d.publish_ms = k;
    d.residents.clear();
    for i in 0..RESIDENTS {
        d.residents.push(ResidentEntry {
            session: SessionId(i * 10 + 1),
            tokens: k + i,
            last_access_ms: k.wrapping_mul(2) + i,
            state: if (k + i).is_multiple_of(2) {
                ResidentState::Idle
            } else {
                ResidentState::Running
            },
        });
    }
}

/// Checks that `d` is exactly publish `d.used_tokens`; returns a description of the first
/// mismatch.
fn torn(d: &SnapshotData) -> Option<String> {
    let k = d.used_tokens;
    let mut want = d.clone();
    fill(&mut want, k);
    (want != *d).then(|| format!("read {d:?}, publish {k} was {want:?}"))
}

#[derive(Debug, Default)]
struct Stats {
    accepted: u64,
    contended: u64,
    not_published: u64,
    checksum_failures: u64,
    torn: u64,
    distinct: u64,
    went_back: u64,
}

fn read_loop(reader: &SnapshotReader, target: u64) -> Stats {
    let mut stats = Stats::default();
    let mut d = SnapshotData::empty(reader.worker_id(), reader.capacity_tokens());
    let mut last_k = 0;
    let start = Instant::now();
    // Until `target` snapshots are accepted and the writer was seen publishing
    // (`MIN_DISTINCT` different snapshots), or the time limit.
    let mut attempts = 0u64;
    while stats.accepted < target || stats.distinct < MIN_DISTINCT {
        attempts += 1;
        if attempts.is_multiple_of(4_096) && start.elapsed() > READ_TIME_LIMIT {
            break;
        }
        match reader.read_into(&mut d) {
            Ok(()) => {
                stats.accepted += 1;
                if let Some(why) = torn(&d) {
                    if stats.torn == 0 {
                        eprintln!("torn snapshot: {why}");
                    }
                    stats.torn += 1;
                }
                let k = d.used_tokens;
                if k < last_k {
                    stats.went_back += 1;
                }
                if k != last_k {
                    stats.distinct += 1;
                }
                last_k = k;
            }
            Err(ReadError::Contended) => stats.contended += 1,
            Err(ReadError::NotPublished) => {
                stats.not_published += 1;
                std::thread::yield_now();
            }
            Err(ReadError::Checksum { .. }) => stats.checksum_failures += 1,
        }
    }
    stats
}

fn assert_clean(stats: &Stats) {
    assert_eq!(stats.torn, 0, "{stats:?}");
    assert_eq!(stats.checksum_failures, 0, "{stats:?}");
    assert_eq!(stats.went_back, 0, "{stats:?}");
    assert!(stats.accepted >= MIN_ACCEPTED, "{stats:?}");
    // The writer really was publishing while we read.
    assert!(stats.distinct >= MIN_DISTINCT, "{stats:?}");
}

/// Publishes `fill(k)` for k = 1, 2, … until `stop` says so; returns the number of publishes.
fn publish_until(writer: &mut SnapshotWriter, mut stop: impl FnMut(u64) -> bool) -> u64 {
    let mut d = writer.empty_data();
    let mut k = 0;
    loop {
        k += 1;
        fill(&mut d, k);
        writer.publish(&d).unwrap();
        if k % 256 == 0 && stop(k) {
            return k;
        }
    }
}

#[test]
fn child_process_never_accepts_a_torn_snapshot() {
    let path = temp_snapshot("two-process");
    let _cleanup = RemoveOnDrop(path.clone());
    let mut writer =
        SnapshotWriter::create(&path, WorkerId(5), CAPACITY, RESIDENTS as usize).unwrap();
    let mut first = writer.empty_data();
    fill(&mut first, 0);
    writer.publish(&first).unwrap();

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["reader_side", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();

    let deadline = Instant::now() + READ_TIME_LIMIT + Duration::from_secs(15);
    let mut status = None;
    let publishes = publish_until(&mut writer, |_| {
        status = child.try_wait().unwrap();
        status.is_some() || Instant::now() > deadline
    });
    let status = match status {
        Some(s) => s,
        None => {
            let _ = child.kill();
            panic!("child did not finish in time");
        }
    };
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let line = stdout
        .lines()
        .map(|l| l.unwrap())
        // libtest may print "test reader_side ... " on the same line first.
        .find_map(|l| l.find("child-stats ").map(|at| l[at..].to_owned()))
        .unwrap_or_else(|| panic!("no stats from the child (exit {status})"));
    assert!(status.success(), "child failed ({status}): {line}");
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name} in {line}"))
            .parse()
            .unwrap()
    };
    assert!(field("accepted") >= MIN_ACCEPTED, "{line}");
    assert_eq!(field("torn"), 0, "{line}");
    assert_eq!(field("checksum_failures"), 0, "{line}");
    assert!(publishes > 1_000, "only {publishes} publishes");
    eprintln!("parent published {publishes} snapshots; {line}");
}

/// The reader role (child of the test above), or on its own an in-process writer/reader race.
#[test]
fn reader_side() {
    if let Some(path) = std::env::var_os(CHILD_ENV) {
        let reader = SnapshotReader::open(&path).unwrap();
        assert_eq!(reader.worker_id(), WorkerId(5));
        let stats = read_loop(&reader, CHILD_READS);
        println!(
            "child-stats accepted={} torn={} checksum_failures={} contended={} distinct={} went_back={} not_published={}",
            stats.accepted,
            stats.torn,
            stats.checksum_failures,
            stats.contended,
            stats.distinct,
            stats.went_back,
            stats.not_published
        );
        assert_clean(&stats);
        return;
    }

    let path = temp_snapshot("in-process");
    let _cleanup = RemoveOnDrop(path.clone());
    let mut writer =
        SnapshotWriter::create(&path, WorkerId(5), CAPACITY, RESIDENTS as usize).unwrap();
    let reader = SnapshotReader::open(&path).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let writer_thread = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || publish_until(&mut writer, |_| done.load(Ordering::Relaxed)))
    };
    let stats = read_loop(&reader, IN_PROCESS_READS);
    done.store(true, Ordering::Relaxed);
    let publishes = writer_thread.join().unwrap();
    assert!(publishes > 1_000, "only {publishes} publishes");
    assert_clean(&stats);
}
