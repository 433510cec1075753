//! Loom model of the snapshot seqlock: one writer, two readers. No reader may ever accept a
//! torn snapshot.
//!
//! The models run the crate's own code: `seqlock::SeqlockWords` (the `begin_write` /
//! `end_write` / `read_consistent` functions the snapshot is built on, over three words), and
//! the snapshot writer, `read` and `probe` over an in-memory `MemSnapshot`. Every relaxed load
//! may return any store not ordered before it, so the state space doubles with each word a
//! reader loads: the two-reader models use the protocol over three words and probes (five
//! words); the full read with a table slot (thirteen words) races one reader. A control model
//! checks that loom does catch a reader that skips the second sequence check.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test --release -p kvc-admission --test loom`
//! (`LOOM_MAX_PREEMPTIONS` overrides the preemption bound of 2).
#![cfg(loom)]

use kvc_admission::seqlock::{SeqlockError, SeqlockWords};
use kvc_admission::{
    MemSnapshot, ProbeResult, ReadError, ResidentEntry, ResidentState, SnapshotData,
    SnapshotReader, SnapshotWriter,
};
use kvc_core::{SessionId, WorkerId};
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::thread;
use std::sync::Arc;

const CAPACITY: u64 = 1_000;

/// Publish number `k`: every word is a function of `k`, so mixing two publishes is visible.
fn version(writer: &SnapshotWriter, k: u64, with_resident: bool) -> SnapshotData {
    let mut d = writer.empty_data();
    d.used_tokens = 100 * k;
    d.free_tokens = CAPACITY - 100 * k;
    d.evictable_tokens = 10 * k;
    d.queue_depth = k as u32;
    d.in_flight = 2 * k as u32;
    d.publish_ms = 1_000 + k;
    if with_resident {
        d.residents.push(ResidentEntry {
            session: SessionId(7),
            tokens: 3 * k,
            last_access_ms: 500 + k,
            state: if k.is_multiple_of(2) {
                ResidentState::Idle
            } else {
                ResidentState::Running
            },
        });
    }
    d
}

/// Which publish a consistent read came from; panics on a torn one.
fn check_read(d: &SnapshotData, with_resident: bool) -> u64 {
    let k = d.used_tokens / 100;
    assert!(k == 1 || k == 2, "unexpected publish {k}: {d:?}");
    assert_eq!(d.free_tokens, CAPACITY - 100 * k, "torn: {d:?}");
    assert_eq!(d.evictable_tokens, 10 * k, "torn: {d:?}");
    assert_eq!(u64::from(d.queue_depth), k, "torn: {d:?}");
    assert_eq!(u64::from(d.in_flight), 2 * k, "torn: {d:?}");
    assert_eq!(d.publish_ms, 1_000 + k, "torn: {d:?}");
    if with_resident {
        assert_eq!(d.residents.len(), 1, "torn: {d:?}");
        let e = d.residents[0];
        assert_eq!(e.session, SessionId(7));
        assert_eq!(e.tokens, 3 * k, "torn: {d:?}");
        assert_eq!(e.last_access_ms, 500 + k, "torn: {d:?}");
        let state = if k == 2 {
            ResidentState::Idle
        } else {
            ResidentState::Running
        };
        assert_eq!(e.state, state, "torn: {d:?}");
    } else {
        assert!(d.residents.is_empty());
    }
    k
}

fn builder() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(2);
    }
    b
}

/// Publishes 1 (before the readers start) and 2 (racing them), with `slots` table slots;
/// runs `readers` on the snapshot.
fn race_snapshot(slots: usize, readers: Vec<Box<dyn FnOnce(SnapshotReader) + Send>>) {
    let mem = Arc::new(MemSnapshot::new(WorkerId(1), CAPACITY, slots).unwrap());
    let mut writer = SnapshotWriter::in_memory(Arc::clone(&mem));
    let with_resident = slots > 0;
    writer.publish(&version(&writer, 1, with_resident)).unwrap();
    let v2 = version(&writer, 2, with_resident);
    let handles: Vec<_> = readers
        .into_iter()
        .map(|run| {
            let reader = SnapshotReader::in_memory(Arc::clone(&mem)).with_max_attempts(1);
            thread::spawn(move || run(reader))
        })
        .collect();
    writer.publish(&v2).unwrap();
    for h in handles {
        h.join().unwrap();
    }
}

fn full_read(with_resident: bool) -> Box<dyn FnOnce(SnapshotReader) + Send> {
    Box::new(move |reader: SnapshotReader| match reader.read() {
        Ok(d) => {
            check_read(&d, with_resident);
        }
        Err(ReadError::Contended) => {}
        Err(e) => panic!("reader saw {e}"),
    })
}

fn probe(session: Option<SessionId>) -> Box<dyn FnOnce(SnapshotReader) + Send> {
    Box::new(
        move |reader: SnapshotReader| match reader.probe(0, session, 1_002) {
            ProbeResult::Ready(a) => {
                let k = u64::from(a.queue_depth);
                assert!(k == 1 || k == 2, "unexpected {a:?}");
                // Session 7 is idle in publish 2: its tokens leave the evictable room.
                let own_idle = if session.is_some() && k == 2 {
                    3 * k
                } else {
                    0
                };
                assert_eq!(a.evictable_tokens, 10 * k - own_idle, "torn: {a:?}");
                assert_eq!(
                    a.available_tokens,
                    CAPACITY - 100 * k + 10 * k - own_idle,
                    "torn: {a:?}"
                );
                assert_eq!(a.snapshot_age_ms, 1_002 - (1_000 + k), "torn: {a:?}");
                let resident = session.map(|_| 3 * k);
                assert_eq!(a.session_resident_tokens, resident, "torn: {a:?}");
            }
            ProbeResult::Contended => {}
            ProbeResult::Stale { age_ms } => panic!("stale ({age_ms} ms)"),
        },
    )
}

/// The snapshot writer against two probing readers.
#[test]
fn snapshot_probes_never_torn() {
    builder().check(|| race_snapshot(0, vec![probe(None), probe(None)]));
}

/// The snapshot writer with a resident table against a full read.
#[test]
fn snapshot_table_read_never_torn() {
    builder().check(|| race_snapshot(1, vec![full_read(true)]));
}

/// The snapshot writer with a resident table against a probe looking the session up.
#[test]
fn snapshot_session_probe_never_torn() {
    builder().check(|| race_snapshot(1, vec![probe(Some(SessionId(7)))]));
}

/// A reader starting before the first publish sees nothing or the whole first publish.
#[test]
fn first_publish_is_all_or_nothing() {
    builder().check(|| {
        let mem = Arc::new(MemSnapshot::new(WorkerId(1), CAPACITY, 0).unwrap());
        let mut writer = SnapshotWriter::in_memory(Arc::clone(&mem));
        let v1 = version(&writer, 1, false);
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let reader = SnapshotReader::in_memory(Arc::clone(&mem)).with_max_attempts(1);
                thread::spawn(move || match reader.read() {
                    Ok(d) => assert_eq!(check_read(&d, false), 1),
                    Err(ReadError::NotPublished | ReadError::Contended) => {}
                    Err(e) => panic!("reader saw {e}"),
                })
            })
            .collect();
        writer.publish(&v1).unwrap();
        for r in readers {
            r.join().unwrap();
        }
    });
}

/// Publish `k` of the word-level model.
fn words_of(k: u64) -> [u64; 3] {
    [k, 10 * k + 1, 100 * k + 2]
}

/// The protocol over three words: two publishes racing two readers.
#[test]
fn seqlock_words_never_torn() {
    builder().check(|| {
        let words = Arc::new(SeqlockWords::new(3));
        words.publish(&words_of(1));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let words = Arc::clone(&words);
                thread::spawn(move || {
                    let mut out = [0; 3];
                    match words.read(&mut out, 2) {
                        Ok(seq) => {
                            let k = out[0];
                            assert_eq!(out, words_of(k), "torn read at seq {seq}");
                            assert_eq!(seq, 2 * k, "words of publish {k} at seq {seq}");
                        }
                        Err(SeqlockError::Contended) => {}
                        Err(SeqlockError::NotPublished) => panic!("published before spawn"),
                    }
                })
            })
            .collect();
        words.publish(&words_of(2));
        for r in readers {
            r.join().unwrap();
        }
    });
}

/// Control: a reader that accepts its copy without reloading the sequence does read torn
/// words, and loom finds it. (So the models above are able to fail.)
#[test]
fn loom_catches_a_reader_without_the_second_check() {
    let found = std::panic::catch_unwind(|| {
        builder().check(|| {
            let seq = Arc::new(AtomicU64::new(2));
            let a = Arc::new(AtomicU64::new(1));
            let b = Arc::new(AtomicU64::new(1));
            let reader = {
                let (seq, a, b) = (Arc::clone(&seq), Arc::clone(&a), Arc::clone(&b));
                thread::spawn(move || {
                    let s = seq.load(Ordering::Acquire);
                    if s % 2 == 0 {
                        let (x, y) = (a.load(Ordering::Relaxed), b.load(Ordering::Relaxed));
                        assert_eq!(x, y, "torn");
                    }
                })
            };
            seq.store(3, Ordering::Relaxed);
            loom::sync::atomic::fence(Ordering::Release);
            a.store(2, Ordering::Relaxed);
            b.store(2, Ordering::Relaxed);
            seq.store(4, Ordering::Release);
            reader.join().unwrap();
        });
    });
    let payload = found.expect_err("loom should have found the torn read");
    let message = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or_default();
    assert!(message.contains("torn"), "unexpected failure: {message}");
}
