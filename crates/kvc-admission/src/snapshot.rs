//! The snapshot a worker publishes: its data, the seqlock protocol, and the writer and reader
//! handles (over a shared-memory file or an in-memory [`MemSnapshot`]).

use crate::backpressure::recommended_pause_ms;
use crate::clock::Clock;
use crate::error::AdmissionError;
use crate::layout::{
    self, Counters, Header, LAYOUT_VERSION, MAGIC, MAX_SLOTS, Region, STATE_IDLE, STATE_RUNNING,
    Slot, checksum_step,
};
use crate::planner::{Resident, ResidentState};
use crate::seqlock::{SeqRead, begin_write, end_write, read_consistent};
use crate::sync::{Ordering, fence};
use kvc_core::{Health, SessionId, WorkerId, WorkerState};
#[cfg(not(loom))]
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;

/// Default staleness limit of a reader: a snapshot whose last publish is older than this is
/// reported as stale.
pub const DEFAULT_STALE_AFTER_MS: u64 = 1_000;

/// Default number of attempts of one read or probe before it reports contention.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 64;

/// One resident session as published in the snapshot table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ResidentEntry {
    /// The session.
    pub session: SessionId,
    /// Tokens of KV it holds.
    pub tokens: u64,
    /// Last access, writer clock in milliseconds.
    pub last_access_ms: u64,
    /// Idle or running.
    pub state: ResidentState,
}

impl From<ResidentEntry> for Resident {
    fn from(e: ResidentEntry) -> Self {
        Resident {
            session: e.session,
            tokens: e.tokens,
            state: e.state,
            last_access_ms: e.last_access_ms,
            predicted_next_use_ms: None,
        }
    }
}

/// The contents of one snapshot: what a worker publishes and what a reader gets back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotData {
    /// The publishing worker (fixed at creation).
    pub worker_id: WorkerId,
    /// Size of its KV pool in tokens (fixed at creation).
    pub capacity_tokens: u64,
    /// Tokens occupied.
    pub used_tokens: u64,
    /// Tokens free.
    pub free_tokens: u64,
    /// Of the used tokens, those that evicting idle sessions would free.
    pub evictable_tokens: u64,
    /// Requests or transfers waiting for the worker.
    pub queue_depth: u32,
    /// Requests running on the worker.
    pub in_flight: u32,
    /// Writer clock at publish, in milliseconds (the heartbeat).
    pub publish_ms: u64,
    /// Resident sessions (any order when publishing; sorted by session id when read back).
    pub residents: Vec<ResidentEntry>,
}

impl SnapshotData {
    /// An empty snapshot of a worker: nothing used, nothing free, no residents.
    pub fn empty(worker_id: WorkerId, capacity_tokens: u64) -> Self {
        SnapshotData {
            worker_id,
            capacity_tokens,
            used_tokens: 0,
            free_tokens: 0,
            evictable_tokens: 0,
            queue_depth: 0,
            in_flight: 0,
            publish_ms: 0,
            residents: Vec::new(),
        }
    }

    /// The worker state a router works with, aged at `now_ms` (same clock as the writer's).
    pub fn worker_state(&self, now_ms: u64, health: Health) -> WorkerState {
        WorkerState {
            capacity_tokens: self.capacity_tokens,
            used_tokens: self.used_tokens,
            evictable_tokens: self.evictable_tokens,
            queue_depth: self.queue_depth,
            in_flight: self.in_flight,
            resident_sessions: u32::try_from(self.residents.len()).unwrap_or(u32::MAX),
            health,
            state_age_ms: now_ms.saturating_sub(self.publish_ms),
        }
    }

    /// The resident sessions as eviction-planner input (no predicted next use).
    pub fn residents_for_planning(&self) -> Vec<Resident> {
        self.residents.iter().copied().map(Resident::from).collect()
    }
}

/// Why [`SnapshotReader::read`] returned no snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// The writer was publishing during every attempt.
    #[error("the snapshot was being published during every read attempt")]
    Contended,
    /// Nothing was published yet.
    #[error("nothing has been published yet")]
    NotPublished,
    /// A consistent read whose checksum does not match: the writer does not follow the layout.
    #[error("snapshot checksum mismatch: computed {computed:#018x}, stored {stored:#018x}")]
    Checksum {
        /// Checksum of the words read.
        computed: u64,
        /// Checksum word read.
        stored: u64,
    },
}

/// The answer to "is there room on this worker for `need_tokens` more?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeAnswer {
    /// `need_tokens <= available_tokens`.
    pub can_admit: bool,
    /// Free plus evictable tokens, at most the capacity.
    pub available_tokens: u64,
    /// Evictable tokens, not counting the requesting session's own tokens when it is resident
    /// and idle (it is never evicted to make room for itself).
    pub evictable_tokens: u64,
    /// The worker's queue depth.
    pub queue_depth: u32,
    /// Age of the snapshot: the reader's `now_ms` minus the writer's `publish_ms` (0 if the
    /// writer's clock is ahead).
    pub snapshot_age_ms: u64,
    /// [`recommended_pause_ms`] of the queue depth and used fraction.
    pub recommended_pause_ms: u32,
    /// Tokens the requesting session holds on the worker, if it is resident.
    pub session_resident_tokens: Option<u64>,
}

/// The outcome of a probe. Only `Ready` carries room; `Contended` and `Stale` never do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeResult {
    /// A consistent, fresh snapshot was read.
    Ready(ProbeAnswer),
    /// The writer was publishing during every attempt; try again (or treat as no room).
    Contended,
    /// The last publish is older than the staleness limit: the writer is gone or stuck.
    /// `age_ms` is `u64::MAX` when nothing was ever published.
    Stale {
        /// Age of the last publish.
        age_ms: u64,
    },
}

impl ProbeResult {
    /// The answer, if the snapshot was consistent and fresh.
    pub fn answer(&self) -> Option<&ProbeAnswer> {
        match self {
            ProbeResult::Ready(a) => Some(a),
            ProbeResult::Contended | ProbeResult::Stale { .. } => None,
        }
    }

    /// Whether the request can be admitted (false unless `Ready` says so).
    pub fn can_admit(&self) -> bool {
        self.answer().is_some_and(|a| a.can_admit)
    }
}

/// A snapshot in ordinary memory, with the same layout and protocol as the shared-memory file.
///
/// Used to model-check the protocol with loom, and by in-process writers and readers (tests,
/// simulations). Share it with [`Arc`] between one [`SnapshotWriter::in_memory`] and any number
/// of [`SnapshotReader::in_memory`].
pub struct MemSnapshot {
    header: Header,
    counters: Counters,
    slots: Box<[Slot]>,
}

impl MemSnapshot {
    /// A snapshot of `worker_id` with a pool of `capacity_tokens` and a table of `max_sessions`
    /// slots; nothing published yet.
    pub fn new(
        worker_id: WorkerId,
        capacity_tokens: u64,
        max_sessions: usize,
    ) -> Result<Self, AdmissionError> {
        check_table_size(max_sessions)?;
        let mem = MemSnapshot {
            header: Header::default(),
            counters: Counters::default(),
            slots: (0..max_sessions).map(|_| Slot::default()).collect(),
        };
        init_header(mem.region(), worker_id, capacity_tokens, max_sessions);
        Ok(mem)
    }

    fn region(&self) -> Region<'_> {
        Region {
            header: &self.header,
            counters: &self.counters,
            slots: &self.slots,
        }
    }

    /// The fixed header fields, as [`MemSnapshot::new`] wrote them.
    fn header_info(&self) -> HeaderInfo {
        let h = &self.header;
        HeaderInfo {
            worker_id: WorkerId(u32::try_from(h.worker_id.load(Ordering::Relaxed)).unwrap_or(0)),
            capacity_tokens: h.capacity_tokens.load(Ordering::Relaxed),
            max_sessions: self.slots.len(),
        }
    }
}

/// The accessors of the fixed header fields a writer and a reader both keep (as `info`).
macro_rules! header_accessors {
    () => {
        /// The worker id in the header.
        pub fn worker_id(&self) -> WorkerId {
            self.info.worker_id
        }

        /// The pool capacity in the header.
        pub fn capacity_tokens(&self) -> u64 {
            self.info.capacity_tokens
        }

        /// Slots of the resident table.
        pub fn max_sessions(&self) -> usize {
            self.info.max_sessions
        }
    };
}

impl std::fmt::Debug for MemSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemSnapshot")
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

pub(crate) fn check_table_size(max_sessions: usize) -> Result<(), AdmissionError> {
    if max_sessions > MAX_SLOTS {
        return Err(AdmissionError::TableTooLarge {
            requested: max_sessions,
            max: MAX_SLOTS,
        });
    }
    Ok(())
}

/// Writes the fixed header words of a fresh (all-zero) snapshot.
pub(crate) fn init_header(
    region: Region<'_>,
    worker_id: WorkerId,
    capacity_tokens: u64,
    max_sessions: usize,
) {
    let h = region.header;
    h.layout_version.store(LAYOUT_VERSION, Ordering::Relaxed);
    h.worker_id.store(u64::from(worker_id.0), Ordering::Relaxed);
    h.capacity_tokens.store(capacity_tokens, Ordering::Relaxed);
    h.max_sessions.store(max_sessions as u64, Ordering::Relaxed);
    h.file_bytes
        .store(layout::file_bytes(max_sessions) as u64, Ordering::Relaxed);
    h.seq.store(0, Ordering::Relaxed);
    h.publish_ms.store(0, Ordering::Relaxed);
    h.magic.store(MAGIC, Ordering::Release);
}

/// The fixed header fields, validated.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeaderInfo {
    pub(crate) worker_id: WorkerId,
    pub(crate) capacity_tokens: u64,
    pub(crate) max_sessions: usize,
}

/// Validates a header read from a file of `len` bytes. Only relaxed loads (the mapping may be
/// read-only), then an acquire fence.
#[cfg(not(loom))]
pub(crate) fn validate_header(
    h: &Header,
    len: u64,
    path: &Path,
) -> Result<HeaderInfo, AdmissionError> {
    let magic = h.magic.load(Ordering::Relaxed);
    fence(Ordering::Acquire);
    if magic != MAGIC {
        return Err(AdmissionError::BadMagic {
            path: path.to_owned(),
            found: magic,
        });
    }
    let version = h.layout_version.load(Ordering::Relaxed);
    if version != LAYOUT_VERSION {
        return Err(AdmissionError::UnsupportedVersion {
            path: path.to_owned(),
            found: version,
            supported: LAYOUT_VERSION,
        });
    }
    let slots = h.max_sessions.load(Ordering::Relaxed);
    let max_sessions = usize::try_from(slots)
        .ok()
        .filter(|&s| s <= MAX_SLOTS)
        .ok_or_else(|| AdmissionError::InvalidHeader {
            path: path.to_owned(),
            reason: format!("table of {slots} slots (at most {MAX_SLOTS})"),
        })?;
    let expected = layout::file_bytes(max_sessions) as u64;
    let declared = h.file_bytes.load(Ordering::Relaxed);
    if declared != expected {
        return Err(AdmissionError::InvalidHeader {
            path: path.to_owned(),
            reason: format!(
                "size word says {declared} bytes, a table of {max_sessions} slots needs {expected}"
            ),
        });
    }
    if len < expected {
        return Err(AdmissionError::Truncated {
            path: path.to_owned(),
            len,
            expected,
        });
    }
    let worker = h.worker_id.load(Ordering::Relaxed);
    let worker_id =
        u32::try_from(worker)
            .map(WorkerId)
            .map_err(|_| AdmissionError::InvalidHeader {
                path: path.to_owned(),
                reason: format!("worker id {worker} does not fit 32 bits"),
            })?;
    Ok(HeaderInfo {
        worker_id,
        capacity_tokens: h.capacity_tokens.load(Ordering::Relaxed),
        max_sessions,
    })
}

/// Where the words live.
enum Backing {
    #[cfg(not(loom))]
    File(crate::shm::ShmMap),
    Memory(Arc<MemSnapshot>),
}

impl Backing {
    #[inline]
    fn region(&self) -> Region<'_> {
        match self {
            #[cfg(not(loom))]
            Backing::File(map) => map.region(),
            Backing::Memory(mem) => mem.region(),
        }
    }
}

/// The scalar part of a publish.
#[derive(Debug, Clone, Copy, Default)]
struct Scalars {
    publish_ms: u64,
    used_tokens: u64,
    free_tokens: u64,
    evictable_tokens: u64,
    queue_depth: u64,
    in_flight: u64,
}

/// The single writer of a snapshot (the worker's scheduler). Publishing never waits for readers.
pub struct SnapshotWriter {
    backing: Backing,
    path: Option<PathBuf>,
    info: HeaderInfo,
    /// Last sequence number stored (even).
    seq: u64,
    /// Slots filled by the last publish.
    filled: usize,
    /// Last published scalars and residents (sorted), for heartbeats.
    scalars: Scalars,
    residents: Vec<ResidentEntry>,
    /// Sorting buffer of the next publish.
    scratch: Vec<ResidentEntry>,
}

impl std::fmt::Debug for SnapshotWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotWriter")
            .field("path", &self.path)
            .field("worker_id", &self.info.worker_id)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl SnapshotWriter {
    /// Creates the snapshot file at `path` (e.g. under `/dev/shm`) and maps it.
    ///
    /// The file is fully initialised under a temporary name in the same directory and then
    /// renamed over `path`, so a reader never sees a half-written header; a reader still
    /// mapping an older file at that path sees it go stale and should reopen.
    #[cfg(not(loom))]
    pub fn create(
        path: impl AsRef<Path>,
        worker_id: WorkerId,
        capacity_tokens: u64,
        max_sessions: usize,
    ) -> Result<Self, AdmissionError> {
        let path = path.as_ref();
        check_table_size(max_sessions)?;
        let map = crate::shm::ShmMap::create(path, max_sessions, |region| {
            init_header(region, worker_id, capacity_tokens, max_sessions);
        })?;
        Ok(SnapshotWriter {
            backing: Backing::File(map),
            path: Some(path.to_owned()),
            info: HeaderInfo {
                worker_id,
                capacity_tokens,
                max_sessions,
            },
            seq: 0,
            filled: 0,
            scalars: Scalars::default(),
            residents: Vec::with_capacity(max_sessions),
            scratch: Vec::with_capacity(max_sessions),
        })
    }

    /// The writer of an in-memory snapshot. There must be only one writer per snapshot.
    pub fn in_memory(mem: Arc<MemSnapshot>) -> Self {
        let info = mem.header_info();
        let seq = mem.header.seq.load(Ordering::Relaxed);
        let filled = usize::try_from(mem.counters.resident_count.load(Ordering::Relaxed))
            .unwrap_or(usize::MAX)
            .min(info.max_sessions);
        SnapshotWriter {
            backing: Backing::Memory(mem),
            path: None,
            info,
            seq: seq + (seq & 1),
            filled,
            scalars: Scalars::default(),
            residents: Vec::with_capacity(info.max_sessions),
            scratch: Vec::with_capacity(info.max_sessions),
        }
    }

    /// The snapshot file, if file-backed.
    pub fn path(&self) -> Option<&std::path::Path> {
        self.path.as_deref()
    }

    header_accessors!();

    /// The last sequence number published (0 before the first publish).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// An empty [`SnapshotData`] with this snapshot's worker id and capacity, to fill in.
    pub fn empty_data(&self) -> SnapshotData {
        SnapshotData::empty(self.info.worker_id, self.info.capacity_tokens)
    }

    /// Publishes `data`: one seqlock write of every field and of the resident table (sorted by
    /// session id). Never waits for readers.
    ///
    /// Fails, publishing nothing, when `data` names another worker or capacity than the header,
    /// has more residents than the table has slots, or lists a session twice.
    pub fn publish(&mut self, data: &SnapshotData) -> Result<(), AdmissionError> {
        if data.worker_id != self.info.worker_id {
            return Err(AdmissionError::HeaderMismatch {
                field: "worker_id",
                expected: u64::from(self.info.worker_id.0),
                found: u64::from(data.worker_id.0),
            });
        }
        if data.capacity_tokens != self.info.capacity_tokens {
            return Err(AdmissionError::HeaderMismatch {
                field: "capacity_tokens",
                expected: self.info.capacity_tokens,
                found: data.capacity_tokens,
            });
        }
        if data.residents.len() > self.info.max_sessions {
            return Err(AdmissionError::TooManyResidents {
                count: data.residents.len(),
                max: self.info.max_sessions,
            });
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(&data.residents);
        self.scratch.sort_unstable_by_key(|e| e.session);
        if let Some(w) = self
            .scratch
            .windows(2)
            .find(|w| w[0].session == w[1].session)
        {
            return Err(AdmissionError::DuplicateResident {
                session: w[0].session,
            });
        }
        std::mem::swap(&mut self.residents, &mut self.scratch);
        self.scalars = Scalars {
            publish_ms: data.publish_ms,
            used_tokens: data.used_tokens,
            free_tokens: data.free_tokens,
            evictable_tokens: data.evictable_tokens,
            queue_depth: u64::from(data.queue_depth),
            in_flight: u64::from(data.in_flight),
        };
        self.write();
        Ok(())
    }

    /// Republishes the last published data with a new `publish_ms` (a worker with nothing new
    /// to say still proves it is alive). Before any publish it publishes an empty snapshot.
    pub fn heartbeat(&mut self, now_ms: u64) {
        self.scalars.publish_ms = now_ms;
        self.write();
    }

    /// The seqlock write: sequence odd, release fence, relaxed stores of every protected word,
    /// sequence even with release.
    fn write(&mut self) {
        let s = self.scalars;
        let count = self.residents.len();

        let mut sum = layout::CHECKSUM_SEED;
        for w in [
            self.seq + 2,
            s.publish_ms,
            s.used_tokens,
            s.free_tokens,
            s.evictable_tokens,
            s.queue_depth,
            s.in_flight,
            count as u64,
        ] {
            sum = checksum_step(sum, w);
        }
        for e in &self.residents {
            for w in slot_words(e) {
                sum = checksum_step(sum, w);
            }
        }

        let region = self.backing.region();
        let (h, c) = (region.header, region.counters);
        let even = begin_write(&h.seq, self.seq);
        h.publish_ms.store(s.publish_ms, Ordering::Relaxed);
        c.used_tokens.store(s.used_tokens, Ordering::Relaxed);
        c.free_tokens.store(s.free_tokens, Ordering::Relaxed);
        c.evictable_tokens
            .store(s.evictable_tokens, Ordering::Relaxed);
        c.queue_depth.store(s.queue_depth, Ordering::Relaxed);
        c.in_flight.store(s.in_flight, Ordering::Relaxed);
        c.resident_count.store(count as u64, Ordering::Relaxed);
        for (slot, e) in region.slots.iter().zip(&self.residents) {
            let [session, tokens, last, state] = slot_words(e);
            slot.session.store(session, Ordering::Relaxed);
            slot.tokens.store(tokens, Ordering::Relaxed);
            slot.last_access_ms.store(last, Ordering::Relaxed);
            slot.state.store(state, Ordering::Relaxed);
        }
        // Clear the slots the previous publish filled and this one does not.
        if self.filled > count {
            for slot in &region.slots[count..self.filled] {
                slot.session.store(0, Ordering::Relaxed);
                slot.tokens.store(0, Ordering::Relaxed);
                slot.last_access_ms.store(0, Ordering::Relaxed);
                slot.state.store(0, Ordering::Relaxed);
            }
        }
        c.checksum.store(sum, Ordering::Relaxed);
        end_write(&h.seq, even);

        self.seq = even;
        self.filled = count;
    }
}

#[inline]
fn slot_words(e: &ResidentEntry) -> [u64; 4] {
    let state = match e.state {
        ResidentState::Idle => STATE_IDLE,
        ResidentState::Running => STATE_RUNNING,
    };
    [e.session.0, e.tokens, e.last_access_ms, state]
}

#[inline]
fn state_of(word: u64) -> ResidentState {
    if word == STATE_IDLE {
        ResidentState::Idle
    } else {
        ResidentState::Running
    }
}

/// Binary search of the first `count` slots (sorted by session) for `session`: its tokens and
/// state word. Bounded even on a torn table.
#[inline]
fn find_slot(slots: &[Slot], count: u64, session: u64) -> Option<(u64, u64)> {
    let n = usize::try_from(count)
        .unwrap_or(usize::MAX)
        .min(slots.len());
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let s = slots[mid].session.load(Ordering::Relaxed);
        if s == session {
            let slot = &slots[mid];
            return Some((
                slot.tokens.load(Ordering::Relaxed),
                slot.state.load(Ordering::Relaxed),
            ));
        }
        if s < session {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    None
}

/// The raw words a probe needs.
#[derive(Clone, Copy)]
struct ProbeWords {
    publish_ms: u64,
    used: u64,
    free: u64,
    evictable: u64,
    queue_depth: u64,
    own: Option<(u64, u64)>,
}

/// A reader of a snapshot: lock-free, no syscall, never blocks the writer.
///
/// `Send + Sync`: one reader can be shared by many threads.
pub struct SnapshotReader {
    backing: Backing,
    info: HeaderInfo,
    stale_after_ms: u64,
    max_attempts: u32,
}

impl std::fmt::Debug for SnapshotReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotReader")
            .field("worker_id", &self.info.worker_id)
            .field("stale_after_ms", &self.stale_after_ms)
            .field("max_attempts", &self.max_attempts)
            .finish_non_exhaustive()
    }
}

impl SnapshotReader {
    /// Opens and maps (read-only) the snapshot file at `path`, validating its header.
    ///
    /// Errors: [`AdmissionError::Io`], [`AdmissionError::Truncated`] (shorter than the fixed
    /// part or than its table), [`AdmissionError::BadMagic`],
    /// [`AdmissionError::UnsupportedVersion`], [`AdmissionError::InvalidHeader`].
    #[cfg(not(loom))]
    pub fn open(path: impl AsRef<Path>) -> Result<Self, AdmissionError> {
        let (map, info) = crate::shm::ShmMap::open(path.as_ref())?;
        Ok(SnapshotReader {
            backing: Backing::File(map),
            info,
            stale_after_ms: DEFAULT_STALE_AFTER_MS,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
        })
    }

    /// A reader of an in-memory snapshot.
    pub fn in_memory(mem: Arc<MemSnapshot>) -> Self {
        SnapshotReader {
            info: mem.header_info(),
            backing: Backing::Memory(mem),
            stale_after_ms: DEFAULT_STALE_AFTER_MS,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
        }
    }

    /// Sets the staleness limit (default [`DEFAULT_STALE_AFTER_MS`]).
    pub fn with_stale_after_ms(mut self, stale_after_ms: u64) -> Self {
        self.stale_after_ms = stale_after_ms;
        self
    }

    /// Sets the attempts per read or probe (default [`DEFAULT_MAX_ATTEMPTS`], at least 1).
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    header_accessors!();

    /// The staleness limit in milliseconds.
    pub fn stale_after_ms(&self) -> u64 {
        self.stale_after_ms
    }

    /// Reads a consistent copy of the whole snapshot and verifies its checksum.
    pub fn read(&self) -> Result<SnapshotData, ReadError> {
        let mut out = SnapshotData::empty(self.info.worker_id, self.info.capacity_tokens);
        out.residents.reserve(self.info.max_sessions);
        self.read_into(&mut out)?;
        Ok(out)
    }

    /// [`read`](Self::read) into an existing [`SnapshotData`], reusing its allocation. On error
    /// `out` holds unspecified (possibly torn) values.
    pub fn read_into(&self, out: &mut SnapshotData) -> Result<(), ReadError> {
        out.worker_id = self.info.worker_id;
        out.capacity_tokens = self.info.capacity_tokens;
        let region = self.backing.region();
        let (h, c) = (region.header, region.counters);
        let result = read_consistent(&h.seq, self.max_attempts, |seq| {
            let publish_ms = h.publish_ms.load(Ordering::Relaxed);
            let used = c.used_tokens.load(Ordering::Relaxed);
            let free = c.free_tokens.load(Ordering::Relaxed);
            let evictable = c.evictable_tokens.load(Ordering::Relaxed);
            let queue_depth = c.queue_depth.load(Ordering::Relaxed);
            let in_flight = c.in_flight.load(Ordering::Relaxed);
            let count = c.resident_count.load(Ordering::Relaxed);
            let stored = c.checksum.load(Ordering::Relaxed);
            let mut sum = layout::CHECKSUM_SEED;
            for w in [
                seq,
                publish_ms,
                used,
                free,
                evictable,
                queue_depth,
                in_flight,
                count,
            ] {
                sum = checksum_step(sum, w);
            }
            out.publish_ms = publish_ms;
            out.used_tokens = used;
            out.free_tokens = free;
            out.evictable_tokens = evictable;
            out.queue_depth = saturate_u32(queue_depth);
            out.in_flight = saturate_u32(in_flight);
            out.residents.clear();
            let n = usize::try_from(count)
                .unwrap_or(usize::MAX)
                .min(region.slots.len());
            for slot in &region.slots[..n] {
                let session = slot.session.load(Ordering::Relaxed);
                let tokens = slot.tokens.load(Ordering::Relaxed);
                let last = slot.last_access_ms.load(Ordering::Relaxed);
                let state = slot.state.load(Ordering::Relaxed);
                for w in [session, tokens, last, state] {
                    sum = checksum_step(sum, w);
                }
                out.residents.push(ResidentEntry {
                    session: SessionId(session),
                    tokens,
                    last_access_ms: last,
                    state: state_of(state),
                });
            }
            // A count beyond the table cannot match the writer's checksum.
            (sum, stored, n as u64 == count)
        });
        match result {
            SeqRead::Consistent((computed, stored, in_table)) => {
                if computed == stored && in_table {
                    Ok(())
                } else {
                    Err(ReadError::Checksum { computed, stored })
                }
            }
            SeqRead::NotPublished => Err(ReadError::NotPublished),
            SeqRead::Contended { .. } => Err(ReadError::Contended),
        }
    }

    /// Is there room for `need_tokens` more tokens, for `session` if given, at `now_ms` (same
    /// clock as the writer's `publish_ms`)?
    ///
    /// Reads only the sequence, `publish_ms`, four counters and (with a session) a binary search
    /// of the table: no allocation, no syscall, no lock. The answer is `Stale` when the last
    /// publish is older than the staleness limit (or nothing was published), `Contended` when
    /// every attempt overlapped a publish — except that a writer stuck in the middle of a publish
    /// for longer than the staleness limit (per its last `publish_ms` word) is `Stale`.
    #[inline]
    pub fn probe(&self, need_tokens: u64, session: Option<SessionId>, now_ms: u64) -> ProbeResult {
        let region = self.backing.region();
        let (h, c) = (region.header, region.counters);
        let result = read_consistent(&h.seq, self.max_attempts, |_| ProbeWords {
            publish_ms: h.publish_ms.load(Ordering::Relaxed),
            used: c.used_tokens.load(Ordering::Relaxed),
            free: c.free_tokens.load(Ordering::Relaxed),
            evictable: c.evictable_tokens.load(Ordering::Relaxed),
            queue_depth: c.queue_depth.load(Ordering::Relaxed),
            own: session.and_then(|s| {
                find_slot(region.slots, c.resident_count.load(Ordering::Relaxed), s.0)
            }),
        });
        let w = match result {
            SeqRead::Consistent(w) => w,
            SeqRead::NotPublished => return ProbeResult::Stale { age_ms: u64::MAX },
            SeqRead::Contended { stuck } => {
                if stuck {
                    let age_ms = now_ms.saturating_sub(h.publish_ms.load(Ordering::Relaxed));
                    if age_ms > self.stale_after_ms {
                        return ProbeResult::Stale { age_ms };
                    }
                }
                return ProbeResult::Contended;
            }
        };
        let age_ms = now_ms.saturating_sub(w.publish_ms);
        if age_ms > self.stale_after_ms {
            return ProbeResult::Stale { age_ms };
        }
        let capacity = self.info.capacity_tokens;
        let own_idle = match w.own {
            Some((tokens, state)) if state == STATE_IDLE => tokens,
            _ => 0,
        };
        let evictable_tokens = w.evictable.saturating_sub(own_idle);
        let available_tokens = w.free.saturating_add(evictable_tokens).min(capacity);
        let used_fraction = if capacity == 0 {
            1.0
        } else {
            (w.used as f64 / capacity as f64).min(1.0)
        };
        let queue_depth = saturate_u32(w.queue_depth);
        ProbeResult::Ready(ProbeAnswer {
            can_admit: need_tokens <= available_tokens,
            available_tokens,
            evictable_tokens,
            queue_depth,
            snapshot_age_ms: age_ms,
            recommended_pause_ms: recommended_pause_ms(u64::from(queue_depth), used_fraction),
            session_resident_tokens: w.own.map(|(tokens, _)| tokens),
        })
    }

    /// [`probe`](Self::probe) at the time `clock` reads.
    pub fn probe_with(
        &self,
        need_tokens: u64,
        session: Option<SessionId>,
        clock: &impl Clock,
    ) -> ProbeResult {
        self.probe(need_tokens, session, clock.now_ms())
    }

    /// The current sequence number (0: nothing published; odd: a publish is in progress).
    pub fn seq(&self) -> u64 {
        let s = self.backing.region().header.seq.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        s
    }
}

#[inline]
fn saturate_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn entry(id: u64, tokens: u64, state: ResidentState) -> ResidentEntry {
        ResidentEntry {
            session: SessionId(id),
            tokens,
            last_access_ms: id * 10,
            state,
        }
    }

    fn pair(max_sessions: usize) -> (SnapshotWriter, SnapshotReader) {
        let mem = Arc::new(MemSnapshot::new(WorkerId(3), 10_000, max_sessions).unwrap());
        (
            SnapshotWriter::in_memory(Arc::clone(&mem)),
            SnapshotReader::in_memory(mem),
        )
    }

    /// A writer and a reader of a worker-0 snapshot of 100 tokens, with its memory (for
    /// tests that tamper with the words).
    fn exposed_pair(max_sessions: usize) -> (Arc<MemSnapshot>, SnapshotWriter, SnapshotReader) {
        let mem = Arc::new(MemSnapshot::new(WorkerId(0), 100, max_sessions).unwrap());
        let w = SnapshotWriter::in_memory(Arc::clone(&mem));
        let r = SnapshotReader::in_memory(Arc::clone(&mem));
        (mem, w, r)
    }

    /// A snapshot as [`exposed_pair`] makes it, with session 1 published idle on 5 tokens:
    /// its memory and a reader.
    fn one_idle_resident(max_sessions: usize) -> (Arc<MemSnapshot>, SnapshotReader) {
        let (mem, mut w, r) = exposed_pair(max_sessions);
        let mut d = w.empty_data();
        d.residents = vec![entry(1, 5, ResidentState::Idle)];
        w.publish(&d).unwrap();
        (mem, r)
    }

    fn data(w: &SnapshotWriter) -> SnapshotData {
        SnapshotData {
            used_tokens: 8_000,
            free_tokens: 2_000,
            evictable_tokens: 3_000,
            queue_depth: 2,
            in_flight: 5,
            publish_ms: 1_000,
            residents: vec![
                entry(30, 1_000, ResidentState::Idle),
                entry(10, 2_000, ResidentState::Running),
                entry(20, 500, ResidentState::Idle),
            ],
            ..w.empty_data()
        }
    }

    #[test]
    fn read_before_publish_is_not_published() {
        let (_w, r) = pair(4);
        assert_eq!(r.read(), Err(ReadError::NotPublished));
        assert_eq!(r.probe(1, None, 0), ProbeResult::Stale { age_ms: u64::MAX });
        assert_eq!(r.seq(), 0);
    }

    #[test]
    fn publish_then_read_round_trips_sorted() {
        let (mut w, r) = pair(4);
        let d = data(&w);
        w.publish(&d).unwrap();
        assert_eq!(w.seq(), 2);
        assert_eq!(r.seq(), 2);
        let got = r.read().unwrap();
        let mut want = d.clone();
        want.residents.sort_by_key(|e| e.session);
        assert_eq!(got, want);
    }

    #[test]
    fn shrinking_table_clears_old_slots() {
        let (mut w, r) = pair(4);
        let mut d = data(&w);
        w.publish(&d).unwrap();
        d.residents.truncate(1);
        w.publish(&d).unwrap();
        let got = r.read().unwrap();
        assert_eq!(got.residents, [entry(30, 1_000, ResidentState::Idle)]);
        assert_eq!(
            r.probe(0, Some(SessionId(10)), 1_000)
                .answer()
                .unwrap()
                .session_resident_tokens,
            None
        );
    }

    #[test]
    fn publish_rejects_bad_data() {
        let (mut w, r) = pair(2);
        let d = data(&w);
        assert!(matches!(
            w.publish(&d),
            Err(AdmissionError::TooManyResidents { count: 3, max: 2 })
        ));
        let mut dup = w.empty_data();
        dup.residents = vec![
            entry(1, 1, ResidentState::Idle),
            entry(1, 2, ResidentState::Idle),
        ];
        assert!(matches!(
            w.publish(&dup),
            Err(AdmissionError::DuplicateResident {
                session: SessionId(1)
            })
        ));
        let mut other = w.empty_data();
        other.worker_id = WorkerId(4);
        assert!(matches!(
            w.publish(&other),
            Err(AdmissionError::HeaderMismatch {
                field: "worker_id",
                expected: 3,
                found: 4
            })
        ));
        let mut cap = w.empty_data();
        cap.capacity_tokens = 1;
        assert!(matches!(
            w.publish(&cap),
            Err(AdmissionError::HeaderMismatch {
                field: "capacity_tokens",
                ..
            })
        ));
        // Nothing was published by the failed calls.
        assert_eq!(r.read(), Err(ReadError::NotPublished));
    }

    #[test]
    fn failed_publish_keeps_the_last_data_for_heartbeats() {
        let (mut w, r) = pair(4);
        let d = data(&w);
        w.publish(&d).unwrap();
        let mut dup = d.clone();
        dup.residents.push(entry(10, 1, ResidentState::Idle));
        assert!(w.publish(&dup).is_err());
        w.heartbeat(2_000);
        let got = r.read().unwrap();
        assert_eq!(got.publish_ms, 2_000);
        assert_eq!(got.used_tokens, d.used_tokens);
        assert_eq!(
            got.residents
                .iter()
                .map(|e| e.session.0)
                .collect::<Vec<_>>(),
            [10, 20, 30]
        );
    }

    #[test]
    fn probe_answers_room_and_excludes_own_idle_tokens() {
        let (mut w, r) = pair(4);
        w.publish(&data(&w)).unwrap();
        // Anonymous: free 2 000 + evictable 3 000.
        let a = *r.probe(5_000, None, 1_200).answer().unwrap();
        assert_eq!(
            a,
            ProbeAnswer {
                can_admit: true,
                available_tokens: 5_000,
                evictable_tokens: 3_000,
                queue_depth: 2,
                snapshot_age_ms: 200,
                recommended_pause_ms: 10,
                session_resident_tokens: None,
            }
        );
        assert!(!r.probe(5_001, None, 1_200).can_admit());
        // Session 30 is idle with 1 000 tokens: not evictable for its own request.
        let own = *r.probe(5_000, Some(SessionId(30)), 1_200).answer().unwrap();
        assert_eq!(own.evictable_tokens, 2_000);
        assert_eq!(own.available_tokens, 4_000);
        assert!(!own.can_admit);
        assert_eq!(own.session_resident_tokens, Some(1_000));
        // Session 10 is running: its tokens were never evictable.
        let running = *r.probe(5_000, Some(SessionId(10)), 1_200).answer().unwrap();
        assert_eq!(running.evictable_tokens, 3_000);
        assert_eq!(running.session_resident_tokens, Some(2_000));
        // Unknown session.
        let unknown = *r.probe(1, Some(SessionId(11)), 1_200).answer().unwrap();
        assert_eq!(unknown.session_resident_tokens, None);
    }

    #[test]
    fn stale_snapshot_is_never_room() {
        let (mut w, r) = pair(4);
        let r = r.with_stale_after_ms(500);
        w.publish(&data(&w)).unwrap();
        assert!(r.probe(1, None, 1_500).can_admit());
        assert_eq!(r.probe(1, None, 1_501), ProbeResult::Stale { age_ms: 501 });
        assert!(!r.probe(1, None, 1_501).can_admit());
        // A writer clock ahead of the reader's gives age 0.
        assert_eq!(r.probe(1, None, 10).answer().unwrap().snapshot_age_ms, 0);
        // A heartbeat refreshes it without changing the data.
        w.heartbeat(1_400);
        let a = *r.probe(1, None, 1_501).answer().unwrap();
        assert_eq!(a.snapshot_age_ms, 101);
        assert_eq!(r.read().unwrap().residents.len(), 3);
    }

    #[test]
    fn probe_with_clock() {
        let (mut w, r) = pair(1);
        let clock = crate::ManualClock::new(1_000);
        let mut d = w.empty_data();
        d.publish_ms = clock.now_ms();
        d.free_tokens = 10;
        w.publish(&d).unwrap();
        assert!(r.probe_with(10, None, &clock).can_admit());
        clock.advance(DEFAULT_STALE_AFTER_MS + 1);
        assert!(matches!(
            r.probe_with(10, None, &clock),
            ProbeResult::Stale { .. }
        ));
    }

    #[test]
    fn writer_stuck_mid_publish_is_contended_then_stale() {
        let (mem, mut w, r) = exposed_pair(0);
        let r = r.with_stale_after_ms(100).with_max_attempts(4);
        let mut d = w.empty_data();
        d.publish_ms = 1_000;
        d.free_tokens = 100;
        w.publish(&d).unwrap();
        // Simulate a writer that died after making the sequence odd.
        mem.header.seq.store(3, Ordering::Relaxed);
        assert_eq!(r.read(), Err(ReadError::Contended));
        assert_eq!(r.probe(1, None, 1_050), ProbeResult::Contended);
        assert_eq!(r.probe(1, None, 1_101), ProbeResult::Stale { age_ms: 101 });
    }

    #[test]
    fn corrupted_word_fails_the_checksum() {
        let (mem, r) = one_idle_resident(2);
        assert!(r.read().is_ok());
        mem.slots[0].tokens.store(6, Ordering::Relaxed);
        assert!(matches!(r.read(), Err(ReadError::Checksum { .. })));
        mem.slots[0].tokens.store(5, Ordering::Relaxed);
        mem.counters.resident_count.store(3, Ordering::Relaxed);
        assert!(matches!(r.read(), Err(ReadError::Checksum { .. })));
    }

    #[test]
    fn foreign_state_words_read_as_running_and_checksum_uses_raw_word() {
        let (mem, r) = one_idle_resident(1);
        // Rewrite the slot as a foreign writer would, with state word 7, and its checksum.
        let seq = mem.header.seq.load(Ordering::Relaxed);
        mem.slots[0].state.store(7, Ordering::Relaxed);
        let sum = layout::checksum([seq, 0, 0, 0, 0, 0, 0, 1, 1, 5, 10, 7]);
        mem.counters.checksum.store(sum, Ordering::Relaxed);
        let got = r.read().unwrap();
        assert_eq!(got.residents[0].state, ResidentState::Running);
    }

    #[test]
    fn second_writer_continues_the_sequence() {
        let mem = Arc::new(MemSnapshot::new(WorkerId(0), 100, 1).unwrap());
        let mut w = SnapshotWriter::in_memory(Arc::clone(&mem));
        w.heartbeat(5);
        w.heartbeat(6);
        drop(w);
        let mut w2 = SnapshotWriter::in_memory(Arc::clone(&mem));
        assert_eq!(w2.seq(), 4);
        w2.heartbeat(7);
        assert_eq!(SnapshotReader::in_memory(mem).read().unwrap().publish_ms, 7);
    }

    #[test]
    fn worker_state_conversion() {
        let (mut w, r) = pair(4);
        w.publish(&data(&w)).unwrap();
        let s = r.read().unwrap().worker_state(1_250, Health::Healthy);
        assert_eq!(s.capacity_tokens, 10_000);
        assert_eq!(s.used_tokens, 8_000);
        assert_eq!(s.evictable_tokens, 3_000);
        assert_eq!(s.queue_depth, 2);
        assert_eq!(s.in_flight, 5);
        assert_eq!(s.resident_sessions, 3);
        assert_eq!(s.state_age_ms, 250);
        let planning = r.read().unwrap().residents_for_planning();
        assert_eq!(planning[0].session, SessionId(10));
        assert_eq!(planning[0].predicted_next_use_ms, None);
    }

    #[test]
    fn table_size_is_limited() {
        assert!(matches!(
            MemSnapshot::new(WorkerId(0), 1, MAX_SLOTS + 1),
            Err(AdmissionError::TableTooLarge { .. })
        ));
    }
}
