//! The subscriber against the Rust publisher over loopback: gaps replayed, gaps older than the
//! replay buffer, a subscriber started mid-run, a restarted publisher (also one back and
//! quiet before the subscriber reconnects), malformed input and an unreachable endpoint. Every
//! wait is bounded; nothing asserts on time.

mod common;

use bytes::Bytes;
use common::{
    W, assert_same_index, engine_batches, publish_until_in_sync, reference, spec, wait_until,
};
use kvc_events::{
    KvIndex, Publisher, PublisherConfig, SharedIndex, Subscriber, SubscriberConfig,
    spawn_subscriber,
};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const TOPIC: &str = "kv@pod-3@model";

async fn publisher(buffer_steps: usize, cancel: &CancellationToken) -> Publisher {
    let mut cfg = PublisherConfig::new("tcp://127.0.0.1:0");
    cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    cfg.topic = TOPIC.into();
    cfg.buffer_steps = buffer_steps;
    Publisher::bind(cfg, cancel.clone()).await.unwrap()
}

fn subscribe(p: &Publisher, cancel: &CancellationToken) -> (SharedIndex, Subscriber) {
    let index: SharedIndex = Arc::new(parking_lot::RwLock::new(KvIndex::new()));
    let mut cfg = SubscriberConfig::new(W, spec(), p.endpoint());
    cfg.replay_endpoint = p.replay_endpoint().map(str::to_string);
    cfg.topic = TOPIC.into();
    cfg.backoff_min = Duration::from_millis(20);
    cfg.backoff_max = Duration::from_millis(200);
    let sub = spawn_subscriber(cfg, index.clone(), cancel.clone());
    (index, sub)
}

async fn stop(cancel: CancellationToken, sub: Subscriber, p: Publisher) {
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(10), sub.task)
        .await
        .expect("the subscriber stops when cancelled")
        .expect("the subscriber task does not panic");
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_messages_are_replayed_and_the_index_matches_a_lossless_run() {
    let cancel = CancellationToken::new();
    let p = publisher(10_000, &cancel).await;
    let (index, sub) = subscribe(&p, &cancel);
    let batches = engine_batches(80);
    let mut cursor = 0;
    publish_until_in_sync(&p, &sub.stats, &batches, &mut cursor).await;
    let before = sub.stats.snapshot();
    // Two gaps, each repaired before the next: three messages, then one.
    let mut last = 0;
    for (i, b) in batches.iter().enumerate().skip(cursor) {
        let unsent = (cursor + 5..cursor + 8).contains(&i) || i == cursor + 20;
        last = if unsent {
            p.publish_unsent(b).await.unwrap()
        } else {
            p.publish(b).await.unwrap()
        };
        if i == cursor + 19 {
            wait_until("the first gap repaired", &sub.stats, |s| {
                s.last_seq == Some(last)
            })
            .await;
        }
    }
    assert_eq!(last, batches.len() as u64 - 1);
    wait_until("all applied", &sub.stats, |s| s.last_seq == Some(last)).await;
    let s = sub.stats.snapshot();
    assert_eq!(s.gaps - before.gaps, 2, "{before:?} {s:?}");
    assert_eq!(s.replays - before.replays, 2, "{before:?} {s:?}");
    assert_eq!((s.resets, s.restarts), (0, 0));
    assert_eq!(s.replay_failures, 0);
    assert_eq!((s.malformed, s.undecodable, s.unknown), (0, 0, 0));
    let want = reference(&batches);
    assert!(want.indexed_blocks(W) > 0);
    assert_same_index(&index.read(), &want);
    assert_eq!(s.indexed_blocks, want.indexed_blocks(W) as u64);
    stop(cancel, sub, p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_older_than_the_replay_buffer_resets_and_rebuilds_from_what_follows() {
    let cancel = CancellationToken::new();
    let p = publisher(4, &cancel).await;
    let (index, sub) = subscribe(&p, &cancel);
    let batches = engine_batches(60);
    let mut cursor = 0;
    publish_until_in_sync(&p, &sub.stats, &batches, &mut cursor).await;
    let before = sub.stats.snapshot();
    // Eight batches never sent live, then one sent: the buffer keeps only the last four.
    for b in &batches[cursor..cursor + 8] {
        p.publish_unsent(b).await.unwrap();
    }
    let seen = p.publish(&batches[cursor + 8]).await.unwrap();
    wait_until("the gap handled", &sub.stats, |s| s.last_seq == Some(seen)).await;
    let s = sub.stats.snapshot();
    assert_eq!(s.gaps - before.gaps, 1);
    assert_eq!(s.resets - before.resets, 1);
    // What survives is what the four buffered batches and everything after them build.
    let first_kept = cursor + 5;
    let mut last = seen;
    for b in &batches[cursor + 9..] {
        last = p.publish(b).await.unwrap();
    }
    wait_until("all applied", &sub.stats, |s| s.last_seq == Some(last)).await;
    let want = reference(&batches[first_kept..]);
    assert!(want.indexed_blocks(W) > 0);
    assert_same_index(&index.read(), &want);
    let s = sub.stats.snapshot();
    assert_eq!(s.resets - before.resets, 1);
    assert!(
        s.unknown > 0,
        "stores chained to forgotten blocks are counted"
    );
    stop(cancel, sub, p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_started_mid_run_rebuilds_from_replay() {
    let cancel = CancellationToken::new();
    let p = publisher(10_000, &cancel).await;
    let batches = engine_batches(90);
    for b in &batches[..50] {
        p.publish(b).await.unwrap();
    }
    // The router starts now: its first live message is 50 or later.
    let (index, sub) = subscribe(&p, &cancel);
    let mut cursor = 50;
    publish_until_in_sync(&p, &sub.stats, &batches, &mut cursor).await;
    let mut last = cursor as u64 - 1;
    for b in &batches[cursor..] {
        last = p.publish(b).await.unwrap();
    }
    wait_until("all applied", &sub.stats, |s| s.last_seq == Some(last)).await;
    let s = sub.stats.snapshot();
    assert_eq!(s.replays, 1, "one replay from 0");
    assert_eq!(s.gaps, 0, "a late start is not a gap");
    assert_eq!(s.resets, 0);
    assert_same_index(&index.read(), &reference(&batches));
    stop(cancel, sub, p).await;
}

/// Batches an engine's first run publishes at least, before it is restarted.
const FIRST_RUN: usize = 20;

/// Publishes an engine's first run on `p` until `sub` applied all of it: batches until the
/// subscription is live (bounded by [`publish_until_in_sync`]: 200 ms a batch, here 200
/// batches), then on to [`FIRST_RUN`] if the subscription took fewer. Returns how many
/// batches the run published (numbered from 0).
async fn first_run(p: &Publisher, sub: &Subscriber) -> usize {
    let batches = engine_batches(FIRST_RUN + 200);
    let mut cursor = 0;
    publish_until_in_sync(p, &sub.stats, &batches, &mut cursor).await;
    let n = cursor.max(FIRST_RUN);
    for b in &batches[cursor..n] {
        p.publish(b).await.unwrap();
    }
    wait_until("first run applied", &sub.stats, |s| {
        s.last_seq == Some(n as u64 - 1)
    })
    .await;
    n
}

/// Stops the engine `first` and starts it again on the same ports, numbering from 0 again.
async fn restart(first: Publisher, cancel: &CancellationToken) -> Publisher {
    let mut cfg = PublisherConfig::new(first.endpoint());
    cfg.replay_endpoint = first.replay_endpoint().map(str::to_string);
    cfg.topic = TOPIC.into();
    first.shutdown().await;
    Publisher::bind(cfg, cancel.clone()).await.unwrap()
}

/// A TCP forwarder in front of a publisher's live endpoint, with a gate. Open, it joins each
/// connection to the publisher; shut, it accepts a connection and holds it, forwarding
/// nothing, so a subscriber's handshake cannot finish and it never counts as connected (its
/// attempt times out and is retried) until the gate opens, when every held connection is
/// joined. A connection the publisher closes is closed on the subscriber's side too, as a
/// direct one would be.
struct Gate {
    addr: std::net::SocketAddr,
    state: Arc<(std::sync::Mutex<GateState>, std::sync::Condvar)>,
}

struct GateState {
    open: bool,
    stopped: bool,
}

impl Gate {
    /// An open gate in front of `upstream` (`tcp://host:port`).
    fn start(upstream: &str) -> Gate {
        let upstream: std::net::SocketAddr = upstream
            .strip_prefix("tcp://")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("not a tcp:// endpoint: {upstream}"));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new((
            std::sync::Mutex::new(GateState {
                open: true,
                stopped: false,
            }),
            std::sync::Condvar::new(),
        ));
        let shared = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if shared.0.lock().unwrap().stopped {
                    break;
                }
                if let Ok(down) = conn {
                    let shared = shared.clone();
                    std::thread::spawn(move || Gate::forward(down, upstream, &shared));
                }
            }
        });
        Gate { addr, state }
    }

    /// The endpoint subscribers connect to.
    fn endpoint(&self) -> String {
        format!("tcp://{}", self.addr)
    }

    fn set(&self, open: bool) {
        self.state.0.lock().unwrap().open = open;
        self.state.1.notify_all();
    }

    /// Holds `down` while the gate is shut, then joins it to `upstream` until either side
    /// closes (then both are closed). Nothing listening upstream: `down` is closed.
    fn forward(
        down: std::net::TcpStream,
        upstream: std::net::SocketAddr,
        state: &(std::sync::Mutex<GateState>, std::sync::Condvar),
    ) {
        {
            let mut s = state.0.lock().unwrap();
            while !s.open && !s.stopped {
                s = state.1.wait(s).unwrap();
            }
            if s.stopped {
                return;
            }
        }
        let Ok(up) = std::net::TcpStream::connect(upstream) else {
            return;
        };
        let _ = (down.set_nodelay(true), up.set_nodelay(true));
        let pipe = |mut from: std::net::TcpStream, mut to: std::net::TcpStream| {
            let _ = std::io::copy(&mut from, &mut to);
            let _ = from.shutdown(std::net::Shutdown::Both);
            let _ = to.shutdown(std::net::Shutdown::Both);
        };
        let (Ok(down2), Ok(up2)) = (down.try_clone(), up.try_clone()) else {
            return;
        };
        let there = std::thread::spawn(move || pipe(down2, up2));
        pipe(up, down);
        let _ = there.join();
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.state.0.lock().unwrap().stopped = true;
        self.state.1.notify_all();
        // Wakes the accepting thread, which then sees `stopped`.
        let _ = std::net::TcpStream::connect(self.addr);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_publisher_resets_the_worker() {
    let cancel = CancellationToken::new();
    let first = publisher(10_000, &cancel).await;
    let (index, sub) = subscribe(&first, &cancel);
    first_run(&first, &sub).await;
    let second = restart(first, &cancel).await;
    let restarted = engine_batches(30);
    let mut cursor = 0;
    publish_until_in_sync(&second, &sub.stats, &restarted, &mut cursor).await;
    let mut last = cursor as u64 - 1;
    for b in &restarted[cursor..] {
        last = second.publish(b).await.unwrap();
    }
    wait_until("second run applied", &sub.stats, |s| {
        s.last_seq == Some(last)
    })
    .await;
    let s = sub.stats.snapshot();
    // The old index went when the connection dropped; the new run was read from 0 (by
    // replay), so no number ever went back.
    assert_eq!((s.restarts, s.resets), (0, 1));
    assert_same_index(&index.read(), &reference(&restarted));
    stop(cancel, sub, second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_back_before_the_subscriber_is_read_from_its_replay_not_the_old_index() {
    let cancel = CancellationToken::new();
    let first = publisher(10_000, &cancel).await;
    // The subscriber reaches the live stream through a gate, shut while the engine restarts
    // and publishes: it cannot be back before the new engine has published, whatever the
    // timing.
    let gate = Gate::start(first.endpoint());
    let index: SharedIndex = Arc::new(parking_lot::RwLock::new(KvIndex::new()));
    let mut cfg = SubscriberConfig::new(W, spec(), gate.endpoint());
    cfg.replay_endpoint = first.replay_endpoint().map(str::to_string);
    cfg.topic = TOPIC.into();
    cfg.backoff_min = Duration::from_millis(20);
    cfg.backoff_max = Duration::from_millis(200);
    let sub = spawn_subscriber(cfg, index.clone(), cancel.clone());
    let first_len = first_run(&first, &sub).await;
    let before = sub.stats.snapshot();
    assert!(
        before.replays >= 1,
        "the first connection replays: {before:?}"
    );
    gate.set(false);
    let second = restart(first, &cancel).await;
    wait_until("the drop seen", &sub.stats, |s| {
        !s.connected && s.resets > before.resets
    })
    .await;
    // Three messages, numbered 0..=2, then silence: no live message ever shows the restart
    // (no subscriber is connected to hear them).
    let restarted = engine_batches(3);
    for b in &restarted {
        second.publish(b).await.unwrap();
    }
    gate.set(true);
    wait_until("the new run read by replay", &sub.stats, |s| {
        s.connected && s.last_seq == Some(2)
    })
    .await;
    let s = sub.stats.snapshot();
    assert_eq!(s.resets - before.resets, 1, "one reset, at the drop: {s:?}");
    assert_eq!(
        s.replays - before.replays,
        1,
        "one replay, at the second connection: {s:?}"
    );
    assert_eq!(s.restarts, 0, "no live number went back: {s:?}");
    assert!(s.indexed_blocks < reference(&engine_batches(first_len)).worker_blocks(W).len() as u64);
    assert_same_index(&index.read(), &reference(&restarted));
    stop(cancel, sub, second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_undecodable_payloads_and_unknown_blocks_are_counted() {
    let cancel = CancellationToken::new();
    let mut raw = PubSocket::new();
    let endpoint = raw.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let index: SharedIndex = Arc::new(parking_lot::RwLock::new(KvIndex::new()));
    let cfg = SubscriberConfig::new(W, spec(), endpoint);
    let sub = spawn_subscriber(cfg, index.clone(), cancel.clone());
    let batches = engine_batches(200);
    let frames = |seq: u64, payload: Vec<u8>| {
        ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ])
        .unwrap()
    };
    // Valid messages until the subscription is live.
    let mut seq = 0u64;
    let mut in_sync = false;
    for b in &batches {
        raw.send(frames(seq, kvc_events::encode_batch(b)))
            .await
            .unwrap();
        for _ in 0..20 {
            if sub.stats.snapshot().last_seq == Some(seq) {
                in_sync = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        seq += 1;
        if in_sync {
            break;
        }
    }
    assert!(in_sync, "{:?}", sub.stats.snapshot());
    let before = sub.stats.snapshot();
    // Two frames; a 3-byte sequence frame; bytes that are not msgpack; a removal of a block
    // never stored.
    raw.send(ZmqMessage::try_from(vec![Bytes::new(), Bytes::from_static(b"x")]).unwrap())
        .await
        .unwrap();
    raw.send(
        ZmqMessage::try_from(vec![Bytes::new(), Bytes::from_static(b"abc"), Bytes::new()]).unwrap(),
    )
    .await
    .unwrap();
    raw.send(frames(seq, vec![0xc1, 0xff])).await.unwrap();
    let unknown = kvc_events::EventBatch {
        ts: 0.0,
        events: vec![kvc_events::Event::Removed(kvc_events::BlockRemoved {
            block_hashes: vec![kvc_events::EngineHash(424_242)],
            medium: None,
        })],
        dp_rank: None,
    };
    raw.send(frames(seq + 1, kvc_events::encode_batch(&unknown)))
        .await
        .unwrap();
    wait_until("the bad input handled", &sub.stats, |s| {
        s.last_seq == Some(seq + 1)
    })
    .await;
    let s = sub.stats.snapshot();
    assert_eq!(s.malformed - before.malformed, 2);
    assert_eq!(s.undecodable - before.undecodable, 1);
    assert_eq!(s.unknown - before.unknown, 1);
    assert_eq!(
        s.resets, 0,
        "without a replay endpoint nothing was lost here"
    );
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(10), sub.task)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_is_retried_counted_and_stopped_by_cancel() {
    let cancel = CancellationToken::new();
    // A port nothing listens on: bind one, note it, close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let index: SharedIndex = Arc::new(parking_lot::RwLock::new(KvIndex::new()));
    let mut cfg = SubscriberConfig::new(W, spec(), format!("tcp://127.0.0.1:{port}"));
    cfg.connect_timeout = Duration::from_millis(100);
    cfg.backoff_min = Duration::from_millis(10);
    cfg.backoff_max = Duration::from_millis(40);
    let sub = spawn_subscriber(cfg, index.clone(), cancel.clone());
    wait_until("retried", &sub.stats, |s| s.connect_failures >= 3).await;
    let s = sub.stats.snapshot();
    assert!(!s.connected);
    assert_eq!(s.last_seq, None);
    // The index answers meanwhile: the worker is there, holding nothing.
    assert_eq!(index.read().indexed_blocks(W), 0);
    assert_eq!(index.read().workers().count(), 1);
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(10), sub.task)
        .await
        .expect("cancel stops a subscriber that never connected")
        .unwrap();
}
