//! The shared-memory file: creation, header validation, publishing across mappings.

use kvc_admission::layout::{self, LAYOUT_VERSION, MAGIC, TABLE_OFFSET, word};
use kvc_admission::{
    AdmissionError, ProbeResult, ReadError, ResidentEntry, ResidentState, SnapshotReader,
    SnapshotWriter,
};
use kvc_core::{SessionId, WorkerId};
use std::path::{Path, PathBuf};

/// A file path in a fresh directory, removed on drop.
struct TempPath {
    dir: PathBuf,
    path: PathBuf,
}

impl TempPath {
    fn new(name: &str) -> Self {
        let base = Path::new("/dev/shm");
        let base = if base.is_dir() {
            base.to_owned()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("kvc-admission-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("worker.snap");
        TempPath { dir, path }
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn set_word(path: &Path, index: usize, value: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[index * 8..index * 8 + 8].copy_from_slice(&value.to_ne_bytes());
    std::fs::write(path, bytes).unwrap();
}

fn word_of(bytes: &[u8], index: usize) -> u64 {
    u64::from_ne_bytes(bytes[index * 8..index * 8 + 8].try_into().unwrap())
}

#[test]
fn created_file_has_the_documented_header() {
    let t = TempPath::new("header");
    let w = SnapshotWriter::create(&t.path, WorkerId(9), 92_000, 16).unwrap();
    assert_eq!(w.path(), Some(t.path.as_path()));
    let bytes = std::fs::read(&t.path).unwrap();
    assert_eq!(bytes.len(), layout::file_bytes(16));
    assert_eq!(bytes.len(), 128 + 32 * 16);
    assert_eq!(word_of(&bytes, word::MAGIC), MAGIC);
    if cfg!(target_endian = "little") {
        assert_eq!(&bytes[..8], b"KVCSNAP1");
    }
    assert_eq!(word_of(&bytes, word::LAYOUT_VERSION), LAYOUT_VERSION);
    assert_eq!(word_of(&bytes, word::WORKER_ID), 9);
    assert_eq!(word_of(&bytes, word::CAPACITY_TOKENS), 92_000);
    assert_eq!(word_of(&bytes, word::MAX_SESSIONS), 16);
    assert_eq!(word_of(&bytes, word::FILE_BYTES), bytes.len() as u64);
    assert_eq!(word_of(&bytes, word::SEQ), 0);
    // No temporary file left behind.
    let names: Vec<_> = std::fs::read_dir(&t.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["worker.snap"]);
}

#[test]
fn published_words_sit_at_the_documented_offsets() {
    let t = TempPath::new("offsets");
    let mut w = SnapshotWriter::create(&t.path, WorkerId(1), 1_000, 4).unwrap();
    let mut d = w.empty_data();
    d.used_tokens = 600;
    d.free_tokens = 400;
    d.evictable_tokens = 150;
    d.queue_depth = 3;
    d.in_flight = 4;
    d.publish_ms = 77;
    d.residents = vec![
        ResidentEntry {
            session: SessionId(20),
            tokens: 100,
            last_access_ms: 70,
            state: ResidentState::Running,
        },
        ResidentEntry {
            session: SessionId(10),
            tokens: 50,
            last_access_ms: 60,
            state: ResidentState::Idle,
        },
    ];
    w.publish(&d).unwrap();
    let b = std::fs::read(&t.path).unwrap();
    let words: Vec<u64> = (0..b.len() / 8).map(|i| word_of(&b, i)).collect();
    assert_eq!(words[word::SEQ], 2);
    assert_eq!(words[word::PUBLISH_MS], 77);
    assert_eq!(
        words[word::USED_TOKENS..=word::RESIDENT_COUNT],
        [600, 400, 150, 3, 4, 2]
    );
    assert_eq!(words[word::RESERVED], 0);
    // Sorted by session id.
    assert_eq!(
        words[word::TABLE..word::TABLE + 8],
        [
            10,
            50,
            60,
            layout::STATE_IDLE,
            20,
            100,
            70,
            layout::STATE_RUNNING
        ]
    );
    assert_eq!(words[word::TABLE + 8..], [0; 8]);
    // The documented checksum.
    let mut covered = vec![2, 77, 600, 400, 150, 3, 4, 2];
    covered.extend_from_slice(&words[word::TABLE..word::TABLE + 8]);
    assert_eq!(words[word::CHECKSUM], layout::checksum(covered));
}

#[test]
fn reader_sees_each_publish_across_mappings() {
    let t = TempPath::new("publish");
    let mut w = SnapshotWriter::create(&t.path, WorkerId(2), 10_000, 8).unwrap();
    let r = SnapshotReader::open(&t.path).unwrap();
    assert_eq!(r.worker_id(), WorkerId(2));
    assert_eq!(r.capacity_tokens(), 10_000);
    assert_eq!(r.max_sessions(), 8);
    assert_eq!(r.read(), Err(ReadError::NotPublished));
    let mut d = w.empty_data();
    for k in 1..=5u64 {
        d.used_tokens = k * 1_000;
        d.free_tokens = 10_000 - k * 1_000;
        d.publish_ms = k;
        w.publish(&d).unwrap();
        let got = r.read().unwrap();
        assert_eq!(got, d);
        assert_eq!(r.seq(), 2 * k);
        let a = *r.probe(9_000 - k * 1_000, None, k).answer().unwrap();
        assert!(a.can_admit);
        assert_eq!(a.available_tokens, 10_000 - k * 1_000);
    }
}

#[test]
fn recreating_the_file_leaves_old_readers_stale() {
    let t = TempPath::new("recreate");
    let mut old = SnapshotWriter::create(&t.path, WorkerId(3), 100, 1).unwrap();
    let mut d = old.empty_data();
    d.free_tokens = 100;
    d.publish_ms = 1_000;
    old.publish(&d).unwrap();
    let reader = SnapshotReader::open(&t.path)
        .unwrap()
        .with_stale_after_ms(500);
    drop(old);
    // A restarted worker replaces the file; the old mapping stops moving.
    let mut new = SnapshotWriter::create(&t.path, WorkerId(3), 100, 1).unwrap();
    d.publish_ms = 2_000;
    new.publish(&d).unwrap();
    assert_eq!(
        reader.probe(1, None, 2_000),
        ProbeResult::Stale { age_ms: 1_000 }
    );
    let reopened = SnapshotReader::open(&t.path).unwrap();
    assert!(reopened.probe(1, None, 2_000).can_admit());
}

#[test]
fn missing_file_is_io_error() {
    let t = TempPath::new("missing");
    let err = SnapshotReader::open(t.dir.join("nope.snap")).unwrap_err();
    assert!(matches!(err, AdmissionError::Io { .. }), "{err}");
}

#[test]
fn wrong_magic_is_bad_magic() {
    let t = TempPath::new("magic");
    drop(SnapshotWriter::create(&t.path, WorkerId(0), 1, 2).unwrap());
    set_word(&t.path, word::MAGIC, 0x1234);
    let err = SnapshotReader::open(&t.path).unwrap_err();
    assert!(
        matches!(err, AdmissionError::BadMagic { found: 0x1234, .. }),
        "{err}"
    );
    // The other byte order is named in the message.
    set_word(&t.path, word::MAGIC, MAGIC.swap_bytes());
    let err = SnapshotReader::open(&t.path).unwrap_err();
    assert!(err.to_string().contains("other byte order"), "{err}");
}

#[test]
fn wrong_version_is_unsupported_version() {
    let t = TempPath::new("version");
    drop(SnapshotWriter::create(&t.path, WorkerId(0), 1, 2).unwrap());
    set_word(&t.path, word::LAYOUT_VERSION, 2);
    let err = SnapshotReader::open(&t.path).unwrap_err();
    assert!(
        matches!(
            err,
            AdmissionError::UnsupportedVersion {
                found: 2,
                supported: 1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn truncated_files_are_truncated() {
    let t = TempPath::new("truncated");
    // Shorter than header and counters.
    std::fs::write(&t.path, [0u8; 40]).unwrap();
    let err = SnapshotReader::open(&t.path).unwrap_err();
    assert!(
        matches!(
            err,
            AdmissionError::Truncated {
                len: 40,
                expected,
                ..
            } if expected == TABLE_OFFSET as u64
        ),
        "{err}"
    );
    // Empty.
    std::fs::write(&t.path, []).unwrap();
    assert!(matches!(
        SnapshotReader::open(&t.path).unwrap_err(),
        AdmissionError::Truncated { len: 0, .. }
    ));
    // A valid header whose table was cut off.
    drop(SnapshotWriter::create(&t.path, WorkerId(0), 1, 8).unwrap());
    let bytes = std::fs::read(&t.path).unwrap();
    std::fs::write(&t.path, &bytes[..bytes.len() - 8]).unwrap();
    let err = SnapshotReader::open(&t.path).unwrap_err();
    assert!(
        matches!(
            err,
            AdmissionError::Truncated { len, expected, .. }
                if len == layout::file_bytes(8) as u64 - 8 && expected == layout::file_bytes(8) as u64
        ),
        "{err}"
    );
}

#[test]
fn inconsistent_header_is_invalid_header() {
    let t = TempPath::new("invalid");
    drop(SnapshotWriter::create(&t.path, WorkerId(0), 1, 2).unwrap());
    set_word(&t.path, word::FILE_BYTES, 4_096);
    assert!(matches!(
        SnapshotReader::open(&t.path).unwrap_err(),
        AdmissionError::InvalidHeader { .. }
    ));
    drop(SnapshotWriter::create(&t.path, WorkerId(0), 1, 2).unwrap());
    set_word(&t.path, word::MAX_SESSIONS, u64::MAX);
    assert!(matches!(
        SnapshotReader::open(&t.path).unwrap_err(),
        AdmissionError::InvalidHeader { .. }
    ));
}

#[test]
fn creating_in_a_missing_directory_fails_cleanly() {
    let t = TempPath::new("nodir");
    let err = SnapshotWriter::create(t.dir.join("a/b/c.snap"), WorkerId(0), 1, 1).unwrap_err();
    assert!(matches!(err, AdmissionError::Io { .. }), "{err}");
    assert!(matches!(
        SnapshotWriter::create(&t.path, WorkerId(0), 1, layout::MAX_SLOTS + 1).unwrap_err(),
        AdmissionError::TableTooLarge { .. }
    ));
}
