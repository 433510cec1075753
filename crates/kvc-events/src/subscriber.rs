//! The subscriber: one tokio task per worker that keeps the worker's part of the index in step
//! with its engine's event stream.
//!
//! A ZeroMQ SUB socket connects to the worker's `kv-events` endpoint with the configured topic
//! and reads `[topic, seq, payload]` messages ([`crate::frames`]). On a connection made with
//! nothing applied yet (the router just started, or the index was reset) and a replay
//! endpoint, the subscriber first asks for every buffered message from 0, so a router started
//! after the engine served traffic knows what it holds before the engine publishes again
//! ([`WorkerStats`]' `synced` says when that catch-up has ended). Each message goes through
//! the worker's [`SeqTracker`]: the next one is decoded and applied to the shared index; a gap
//! (or a first message above 0) sends `["", start_seq]` on a DEALER to the `kv-events-replay`
//! endpoint (connected for that replay only, closed when it ends) and applies the replies up
//! to the end marker while live messages are held; a lost history (no replay endpoint, a
//! replay that starts too late, fails or times out, a publisher restart) resets the worker's
//! index first. So does a lost connection: the engine may have restarted, and its first
//! messages may be gone before the subscriber is back, so the index is dropped and, on the
//! next connection, rebuilt by replay from 0.
//!
//! Per worker, between replays: this task, the SUB socket's own reconnect task and one
//! descriptor (`benches/fanin.rs` measures about 12 KB of resident memory per subscriber at
//! 4,096 engines). The index is write-locked once per message, for its events only.
//!
//! Nothing stops the task but its [`CancellationToken`]: an unreachable endpoint or a dropped
//! connection is retried with bounded exponential backoff; malformed frames, undecodable
//! payloads and unknown blocks are counted in [`WorkerStats`] and logged (one warning per
//! kind per second, the rest at debug level).

use crate::decode::decode_batch;
use crate::event::Event;
use crate::frames::{split_live, split_reply};
use crate::index::{ApplyOutcome, KvIndex, WorkerSpec};
use crate::seq::{LiveAction, ReplayAction, SeqTracker};
use crate::stats::WorkerStats;
use bytes::Bytes;
use kvc_core::WorkerId;
use parking_lot::RwLock;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

/// The index every subscriber writes and the router reads.
pub type SharedIndex = Arc<RwLock<KvIndex>>;

/// Where and how one worker's events are read (one data-parallel rank's stream).
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// The worker the events describe.
    pub worker: WorkerId,
    /// The engine's data-parallel rank that publishes this stream (0 without data
    /// parallelism): its blocks are indexed under that rank ([`KvIndex::apply_rank`]). A
    /// batch that names another rank (`data_parallel_rank`) is still indexed under this one,
    /// and counted (`other_rank`): the stream's endpoint says which rank's cache it is.
    pub rank: u32,
    /// Its engine's block size and pool size (the worker is added to the index with it if
    /// absent).
    pub spec: WorkerSpec,
    /// The engine's PUB endpoint, `tcp://HOST:PORT`.
    pub endpoint: String,
    /// The engine's replay ROUTER endpoint, if it has one.
    pub replay_endpoint: Option<String>,
    /// The topic to subscribe to (`""`: every message); a non-empty topic must match exactly.
    pub topic: String,
    /// Longest wait for one connection (SUB or replay DEALER).
    pub connect_timeout: Duration,
    /// Longest wait for a whole replay, request to end marker.
    pub replay_timeout: Duration,
    /// First wait before reconnecting; doubles after each failure up to `backoff_max`.
    pub backoff_min: Duration,
    /// Longest wait before reconnecting.
    pub backoff_max: Duration,
    /// Live messages held while a replay runs; more are dropped (and show up as a gap).
    pub max_held: usize,
}

impl SubscriberConfig {
    /// Defaults: no replay endpoint, empty topic, 2 s connect timeout, 5 s replay timeout,
    /// backoff from 100 ms to 5 s, 100,000 held messages.
    pub fn new(worker: WorkerId, spec: WorkerSpec, endpoint: impl Into<String>) -> Self {
        SubscriberConfig {
            worker,
            rank: 0,
            spec,
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            connect_timeout: Duration::from_secs(2),
            replay_timeout: Duration::from_secs(5),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            max_held: 100_000,
        }
    }
}

/// A running subscriber: its counters and its task.
#[derive(Debug)]
pub struct Subscriber {
    /// The worker's counters (shared with the task).
    pub stats: Arc<WorkerStats>,
    /// The task; it ends when the cancellation token fires.
    pub task: JoinHandle<()>,
}

/// Starts the subscriber task of one worker's rank (adds the rank to `index` if absent).
/// Must be called inside a tokio runtime.
pub fn spawn_subscriber(
    cfg: SubscriberConfig,
    index: SharedIndex,
    cancel: CancellationToken,
) -> Subscriber {
    let (run, stats) = Run::new(cfg, index);
    let task = tokio::spawn(run.run(cancel));
    Subscriber { stats, task }
}

/// Starts the task of one worker's rank fed by `queue` instead of a socket of its own: the
/// messages a router-bound SUB socket received with the worker's topic
/// ([`crate::listener`]). The same sequence tracking, replay and counters as
/// [`spawn_subscriber`]; `cfg.endpoint` and `cfg.topic` are not used. With no socket of its
/// own there is no disconnection to see: a restarted engine shows by its sequence numbers
/// starting again. Ends when cancelled or when the queue's sender is dropped.
pub(crate) fn spawn_fed(
    cfg: SubscriberConfig,
    index: SharedIndex,
    queue: mpsc::Receiver<ZmqMessage>,
    cancel: CancellationToken,
) -> Subscriber {
    let (run, stats) = Run::new(cfg, index);
    let task = tokio::spawn(run.run_fed(queue, cancel));
    Subscriber { stats, task }
}

/// Where a stream's live messages come from: its own SUB socket, or the queue a listener
/// fills.
enum Feed<'a> {
    Sub(&'a mut SubSocket),
    Queue(&'a mut mpsc::Receiver<ZmqMessage>),
}

impl Feed<'_> {
    async fn recv(&mut self) -> Result<ZmqMessage, String> {
        match self {
            Feed::Sub(s) => s.recv().await.map_err(|e| e.to_string()),
            Feed::Queue(q) => q
                .recv()
                .await
                .ok_or_else(|| "the listener stopped".to_owned()),
        }
    }
}

/// A SUB socket's peer events (a disconnected engine shows there).
type PeerEvents = Pin<Box<dyn Stream<Item = SocketEvent> + Send>>;

/// One warning per kind per second; the rest at debug level.
#[derive(Debug, Default)]
struct Limits {
    connect: Option<Instant>,
    malformed: Option<Instant>,
    undecodable: Option<Instant>,
    unknown: Option<Instant>,
    replay: Option<Instant>,
    other_rank: Option<Instant>,
}

fn allow(last: &mut Option<Instant>) -> bool {
    let now = Instant::now();
    if last.is_some_and(|t| now.duration_since(t) < Duration::from_secs(1)) {
        return false;
    }
    *last = Some(now);
    true
}

macro_rules! limited {
    ($slot:expr, $($arg:tt)+) => {
        if allow(&mut $slot) {
            tracing::warn!($($arg)+);
        } else {
            tracing::debug!($($arg)+);
        }
    };
}

/// How a replay ended.
enum ReplayEnd {
    /// The end marker arrived.
    Done,
    /// Cancelled.
    Stopped,
}

struct Run {
    cfg: SubscriberConfig,
    index: SharedIndex,
    stats: Arc<WorkerStats>,
    tracker: SeqTracker,
    limits: Limits,
}

impl Run {
    fn new(cfg: SubscriberConfig, index: SharedIndex) -> (Self, Arc<WorkerStats>) {
        {
            let mut idx = index.write();
            if !idx.has_rank(cfg.worker, cfg.rank) {
                // The rank is absent, so `add_rank`'s only other failure is a zero
                // capacity, which is logged.
                if let Err(e) = idx.add_rank(cfg.worker, cfg.rank, cfg.spec) {
                    tracing::error!(worker = %cfg.worker, rank = cfg.rank, "kv-events: {e}");
                }
            }
        }
        let stats = Arc::new(WorkerStats::new());
        let run = Run {
            cfg,
            index,
            stats: stats.clone(),
            tracker: SeqTracker::new(),
            limits: Limits::default(),
        };
        (run, stats)
    }

    /// A stream fed by a listener's queue: one pump until cancelled or the queue closes.
    async fn run_fed(mut self, mut queue: mpsc::Receiver<ZmqMessage>, cancel: CancellationToken) {
        self.stats.connected.store(true, Relaxed);
        let _ = self.pump(&mut Feed::Queue(&mut queue), None, &cancel).await;
        self.stats.connected.store(false, Relaxed);
    }

    async fn run(mut self, cancel: CancellationToken) {
        let mut backoff = self.cfg.backoff_min;
        loop {
            let connected = tokio::select! {
                _ = cancel.cancelled() => break,
                r = self.connect() => r,
            };
            match connected {
                Ok((mut sub, peer_events)) => {
                    backoff = self.cfg.backoff_min;
                    self.stats.connected.store(true, Relaxed);
                    tracing::debug!(worker = %self.cfg.worker, rank = self.cfg.rank, endpoint = %self.cfg.endpoint, "kv-events: connected");
                    let stopped = self
                        .pump(&mut Feed::Sub(&mut sub), Some(peer_events), &cancel)
                        .await;
                    self.stats.connected.store(false, Relaxed);
                    if stopped {
                        break;
                    }
                    // The engine may come back as a new process, numbering from 0 with an
                    // empty cache, and may publish its first messages before this task
                    // reconnects (a SUB socket misses them): nothing would then show the old
                    // index is stale. Drop it now; the reconnection rebuilds it from the
                    // replay buffer (or the live stream, without one).
                    if self.tracker.last().is_some() {
                        self.reset("the engine disconnected");
                    }
                    self.tracker.forget();
                }
                Err(e) => {
                    WorkerStats::add(&self.stats.connect_failures, 1);
                    limited!(self.limits.connect, worker = %self.cfg.worker, endpoint = %self.cfg.endpoint, "kv-events: cannot connect: {e}");
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(self.cfg.backoff_max);
        }
    }

    /// A SUB socket connected to the endpoint, and its peer events (a disconnected engine
    /// shows there: the socket itself goes on waiting, and over `ipc://` never reconnects).
    async fn connect(&self) -> Result<(SubSocket, PeerEvents), zeromq::ZmqError> {
        let mut opts = SocketOptions::default();
        opts.connect_timeout(self.cfg.connect_timeout);
        let mut sub = SubSocket::with_options(opts);
        let peer_events: PeerEvents = Box::pin(sub.monitor());
        sub.subscribe(&self.cfg.topic).await?;
        sub.connect(&self.cfg.endpoint).await?;
        Ok((sub, peer_events))
    }

    /// Reads the live stream until it fails or the engine disconnects (false: reconnect) or
    /// the task is cancelled (true). With nothing applied yet and a replay endpoint, first
    /// catches up by replay from 0.
    async fn pump(
        &mut self,
        sub: &mut Feed<'_>,
        mut peer_events: Option<PeerEvents>,
        cancel: &CancellationToken,
    ) -> bool {
        if self.tracker.last().is_none() && self.cfg.replay_endpoint.is_some() {
            let mut held = VecDeque::new();
            let stopped = self.replay(0, sub, &mut held, cancel).await;
            self.stats.synced.store(true, Relaxed);
            if stopped {
                return true;
            }
            self.apply_held(held);
        }
        self.stats.synced.store(true, Relaxed);
        let mut watching = peer_events.is_some();
        loop {
            let msg = tokio::select! {
                _ = cancel.cancelled() => return true,
                m = sub.recv() => m,
                event = next_event(&mut peer_events), if watching => match event {
                    Some(SocketEvent::Disconnected(_)) => {
                        limited!(self.limits.connect, worker = %self.cfg.worker, endpoint = %self.cfg.endpoint, "kv-events: the engine disconnected; reconnecting");
                        return false;
                    }
                    Some(_) => continue,
                    None => {
                        watching = false;
                        continue;
                    }
                },
            };
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    limited!(self.limits.connect, worker = %self.cfg.worker, "kv-events: connection lost: {e}");
                    return false;
                }
            };
            let Some((seq, payload)) = self.live_frames(msg) else {
                continue;
            };
            let can_replay = self.cfg.replay_endpoint.is_some();
            match self.tracker.on_live(seq, can_replay) {
                LiveAction::Apply => self.apply(seq, &payload),
                LiveAction::Ignore => WorkerStats::add(&self.stats.duplicates, 1),
                LiveAction::ResetThenApply { restart } => {
                    let counter = if restart {
                        &self.stats.restarts
                    } else {
                        &self.stats.gaps
                    };
                    WorkerStats::add(counter, 1);
                    self.reset(if restart {
                        "publisher restarted"
                    } else {
                        "gap and no replay endpoint"
                    });
                    self.apply(seq, &payload);
                }
                LiveAction::Replay { from, reset } => {
                    if reset {
                        WorkerStats::add(&self.stats.restarts, 1);
                        self.reset("publisher restarted");
                    } else if from > 0 {
                        WorkerStats::add(&self.stats.gaps, 1);
                    }
                    let mut held = VecDeque::from([(seq, payload)]);
                    if self.replay(from, sub, &mut held, cancel).await {
                        return true;
                    }
                    self.apply_held(held);
                }
            }
        }
    }

    /// Applies the live messages held while a replay ran, in order.
    fn apply_held(&mut self, held: VecDeque<(u64, Bytes)>) {
        for (seq, payload) in held {
            match self.tracker.on_held(seq) {
                LiveAction::Apply => self.apply(seq, &payload),
                LiveAction::ResetThenApply { .. } => {
                    WorkerStats::add(&self.stats.gaps, 1);
                    self.reset("gap the replay did not close");
                    self.apply(seq, &payload);
                }
                LiveAction::Ignore | LiveAction::Replay { .. } => {}
            }
        }
    }

    /// (seq, payload) of a live message with the configured topic; counts malformed ones.
    fn live_frames(&mut self, msg: ZmqMessage) -> Option<(u64, Bytes)> {
        let frames = msg.into_vec();
        match split_live(&frames) {
            Some((topic, seq, payload)) => {
                if !self.cfg.topic.is_empty() && topic.as_ref() != self.cfg.topic.as_bytes() {
                    tracing::debug!(worker = %self.cfg.worker, "kv-events: other topic ignored");
                    return None;
                }
                Some((seq, payload.clone()))
            }
            None => {
                WorkerStats::add(&self.stats.malformed, 1);
                limited!(self.limits.malformed, worker = %self.cfg.worker, frames = frames.len(), "kv-events: malformed message dropped (want [topic, 8-byte seq, payload])");
                None
            }
        }
    }

    /// Asks for every message from `from` on and applies the replies; live messages arriving
    /// meanwhile go to `held`. A failed replay resets the worker. True when cancelled.
    async fn replay(
        &mut self,
        from: u64,
        sub: &mut Feed<'_>,
        held: &mut VecDeque<(u64, Bytes)>,
        cancel: &CancellationToken,
    ) -> bool {
        WorkerStats::add(&self.stats.replays, 1);
        let timeout = self.cfg.replay_timeout;
        let outcome =
            tokio::time::timeout(timeout, self.replay_inner(from, sub, held, cancel)).await;
        let err = match outcome {
            Ok(Ok(ReplayEnd::Done)) => return false,
            Ok(Ok(ReplayEnd::Stopped)) => return true,
            Ok(Err(e)) => e,
            Err(_) => format!("no end marker within {timeout:?}"),
        };
        WorkerStats::add(&self.stats.replay_failures, 1);
        limited!(self.limits.replay, worker = %self.cfg.worker, from, "kv-events: replay failed: {err}");
        self.reset("replay failed");
        false
    }

    async fn replay_inner(
        &mut self,
        from: u64,
        sub: &mut Feed<'_>,
        held: &mut VecDeque<(u64, Bytes)>,
        cancel: &CancellationToken,
    ) -> Result<ReplayEnd, String> {
        let Some(endpoint) = self.cfg.replay_endpoint.clone() else {
            return Err("no replay endpoint".into());
        };
        let mut opts = SocketOptions::default();
        opts.connect_timeout(self.cfg.connect_timeout);
        let mut dealer = DealerSocket::with_options(opts);
        dealer
            .connect(&endpoint)
            .await
            .map_err(|e| format!("cannot connect to {endpoint}: {e}"))?;
        let request = ZmqMessage::try_from(vec![Bytes::new(), crate::frames::seq_frame(from)])
            .map_err(|e| e.to_string())?;
        dealer.send(request).await.map_err(|e| e.to_string())?;
        let mut sub_alive = true;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return Ok(ReplayEnd::Stopped),
                reply = dealer.recv() => {
                    let frames = reply.map_err(|e| e.to_string())?.into_vec();
                    match split_reply(&frames) {
                        None => {
                            WorkerStats::add(&self.stats.malformed, 1);
                            return Err(format!("malformed reply of {} frames", frames.len()));
                        }
                        Some(None) => return Ok(ReplayEnd::Done),
                        Some(Some((seq, payload))) => match self.tracker.on_replayed(seq) {
                            ReplayAction::Skip => {}
                            ReplayAction::Apply => self.apply(seq, payload),
                            ReplayAction::ResetThenApply => {
                                self.reset("history older than the replay buffer");
                                self.apply(seq, payload);
                            }
                        },
                    }
                }
                live = sub.recv(), if sub_alive => match live {
                    Ok(msg) => {
                        if let Some(m) = self.live_frames(msg)
                            && held.len() < self.cfg.max_held
                        {
                            self.tracker.hold(m.0);
                            held.push_back(m);
                        }
                    }
                    // The pump notices on its next read; finish the replay first.
                    Err(_) => sub_alive = false,
                },
            }
        }
    }

    /// Resets the worker's index and sequence history.
    fn reset(&mut self, why: &str) {
        WorkerStats::add(&self.stats.resets, 1);
        tracing::info!(worker = %self.cfg.worker, rank = self.cfg.rank, "kv-events: index reset: {why}");
        let mut idx = self.index.write();
        let _ = idx.clear_rank(self.cfg.worker, self.cfg.rank);
        self.stats.indexed_blocks.store(0, Relaxed);
        drop(idx);
        self.tracker.reset();
        self.stats.last_seq.store(u64::MAX, Relaxed);
    }

    /// Decodes and applies message `seq`; it counts as consumed even when undecodable.
    fn apply(&mut self, seq: u64, payload: &[u8]) {
        self.tracker.applied(seq);
        self.stats.last_seq.store(seq, Relaxed);
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                WorkerStats::add(&self.stats.undecodable, 1);
                limited!(self.limits.undecodable, worker = %self.cfg.worker, seq, "kv-events: undecodable payload dropped: {e}");
                return;
            }
        };
        if batch.ts.is_finite() && batch.ts >= 0.0 {
            // Saturating: a timestamp past u64::MAX ms reads as u64::MAX - 1.
            let ms = (batch.ts * 1_000.0).min((u64::MAX - 1) as f64) as u64;
            self.stats.last_batch_ms.store(ms, Relaxed);
        }
        if let Some(r) = batch.dp_rank
            && r != i64::from(self.cfg.rank)
        {
            WorkerStats::add(&self.stats.other_rank, 1);
            limited!(self.limits.other_rank, worker = %self.cfg.worker, rank = self.cfg.rank, batch_rank = r, seq, "kv-events: a batch of this rank's stream names another data-parallel rank; indexed under the stream's rank (check the endpoints' port offsets)");
        }
        let mut total = ApplyOutcome::default();
        let mut cleared = 0;
        let (worker, rank) = (self.cfg.worker, self.cfg.rank);
        let indexed = {
            let mut idx = self.index.write();
            for e in &batch.events {
                if let Ok(o) = idx.apply_rank(worker, rank, e) {
                    total += o;
                }
                cleared += u64::from(matches!(e, Event::AllCleared));
            }
            idx.rank_blocks(worker, rank)
        };
        let s = &self.stats;
        s.indexed_blocks.store(indexed as u64, Relaxed);
        WorkerStats::add(&s.batches, 1);
        WorkerStats::add(&s.blocks_stored, total.stored);
        WorkerStats::add(&s.blocks_removed, total.removed);
        WorkerStats::add(&s.cleared, cleared);
        WorkerStats::add(&s.unknown, total.unknown());
        WorkerStats::add(&s.skipped, total.skipped);
        WorkerStats::add(&s.invalid, total.invalid);
        WorkerStats::add(&s.dropped, total.dropped);
        if total.unknown() > 0 || total.invalid > 0 {
            limited!(self.limits.unknown, worker = %self.cfg.worker, seq, unknown_parent = total.unknown_parent, unknown_removal = total.unknown_removal, invalid = total.invalid, "kv-events: events name blocks the index does not hold");
        }
    }
}

/// The next peer event, or `None` for a stream without them.
async fn next_event(events: &mut Option<PeerEvents>) -> Option<SocketEvent> {
    match events {
        Some(e) => e.next().await,
        None => None,
    }
}
