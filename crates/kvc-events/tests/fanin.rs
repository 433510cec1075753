//! Many subscribers on one shared index over loopback: 200 engines each indexed under its own
//! worker, and healthy engines indexed while others are stalled, killed, silent (a TCP
//! listener that never speaks) or refusing. Every wait is bounded; nothing asserts on time.
//! (About 1,000 descriptors at the peak: the engines' listeners and connections live in this
//! process too.)

mod common;

use common::{BS, spec};
use kvc_core::WorkerId;
use kvc_events::{
    BlockStored, EngineHash, Event, EventBatch, KvIndex, Publisher, PublisherConfig, SharedIndex,
    StatsSnapshot, Subscriber, SubscriberConfig, spawn_subscriber,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "kv@fleet";
/// Batches each healthy engine publishes.
const BATCHES: u64 = 3;

async fn engine(cancel: &CancellationToken) -> Publisher {
    let mut cfg = PublisherConfig::new("tcp://127.0.0.1:0");
    cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    cfg.topic = TOPIC.into();
    Publisher::bind(cfg, cancel.clone()).await.unwrap()
}

/// Engine `e`'s batch `b`: one chain of two blocks, hashes and tokens its own.
fn batch(e: u32, b: u64) -> EventBatch {
    let first = u64::from(e) * 1_000 + b * 2;
    let hashes = vec![EngineHash(first), EngineHash(first + 1)];
    let token_ids = (0..2 * BS)
        .map(|t| e * 10_000 + b as u32 * 100 + t)
        .collect();
    EventBatch {
        ts: b as f64,
        events: vec![Event::Stored(BlockStored {
            block_hashes: hashes,
            parent: None,
            token_ids,
            block_size: BS,
            ..BlockStored::default()
        })],
        dp_rank: None,
    }
}

fn subscriber_cfg(worker: WorkerId, endpoint: &str, replay: Option<&str>) -> SubscriberConfig {
    let mut cfg = SubscriberConfig::new(worker, spec(), endpoint);
    cfg.replay_endpoint = replay.map(str::to_string);
    cfg.topic = TOPIC.into();
    cfg.backoff_min = Duration::from_millis(20);
    cfg.backoff_max = Duration::from_millis(200);
    cfg
}

fn subscribe(
    p: &Publisher,
    worker: WorkerId,
    index: &SharedIndex,
    cancel: &CancellationToken,
) -> Subscriber {
    let cfg = subscriber_cfg(worker, p.endpoint(), p.replay_endpoint());
    spawn_subscriber(cfg, index.clone(), cancel.clone())
}

/// Waits (at most 60 s, polling) until `pred` holds for every subscriber.
async fn wait_all(what: &str, subs: &[&Subscriber], pred: impl Fn(&StatsSnapshot) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let behind = subs.iter().filter(|s| !pred(&s.stats.snapshot())).count();
        if behind == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {behind} subscribers never got there"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Publishes engine `e`'s batches, then an empty batch every 100 ms until its subscriber has
/// applied the last one published (PUB may drop the first messages of a subscription it has
/// not seen yet; a later one then shows the gap, which the replay closes). A subscriber slowed
/// by a busy machine gets the 100 ms to catch up, rather than chasing a new batch every poll.
/// Bounded: 10 s.
async fn publish_all(p: &Publisher, e: u32, sub: &Subscriber) {
    let mut last = 0;
    for b in 0..BATCHES {
        last = p.publish(&batch(e, b)).await.unwrap();
    }
    for i in 1..=1_000 {
        if sub.stats.snapshot().last_seq.is_some_and(|s| s >= last) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        if i % 10 == 0 {
            last = p.publish(&EventBatch::default()).await.unwrap();
        }
    }
    panic!("engine {e}: never applied: {:?}", sub.stats.snapshot());
}

/// The index a lossless run of `engines` builds.
fn reference(engines: &[u32]) -> KvIndex {
    let mut idx = KvIndex::new();
    for &e in engines {
        idx.add_worker(WorkerId(e), spec()).unwrap();
        for b in 0..BATCHES {
            for ev in &batch(e, b).events {
                idx.apply(WorkerId(e), ev).unwrap();
            }
        }
    }
    idx
}

fn assert_indexed(index: &SharedIndex, engines: &[u32]) {
    let want = reference(engines);
    let got = index.read();
    for &e in engines {
        let w = WorkerId(e);
        assert_eq!(got.worker_blocks(w), want.worker_blocks(w), "worker {e}");
        assert_eq!(got.indexed_blocks(w), 2 * BATCHES as usize, "worker {e}");
    }
}

async fn stop(cancel: CancellationToken, subs: Vec<Subscriber>) {
    cancel.cancel();
    for s in subs {
        tokio::time::timeout(Duration::from_secs(10), s.task)
            .await
            .expect("a subscriber stops when cancelled")
            .expect("a subscriber task does not panic");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_engines_are_each_indexed_under_their_own_worker() {
    let cancel = CancellationToken::new();
    let index: SharedIndex = Arc::new(parking_lot::RwLock::new(KvIndex::new()));
    let ids: Vec<u32> = (0..200).collect();
    let mut engines = Vec::new();
    for _ in &ids {
        engines.push(engine(&cancel).await);
    }
    let subs: Vec<Subscriber> = engines
        .iter()
        .zip(&ids)
        .map(|(p, &e)| subscribe(p, WorkerId(e), &index, &cancel))
        .collect();
    wait_all("connected", &subs.iter().collect::<Vec<_>>(), |s| {
        s.connected && s.synced
    })
    .await;
    for ((p, &e), s) in engines.iter().zip(&ids).zip(&subs) {
        publish_all(p, e, s).await;
    }
    assert_indexed(&index, &ids);
    assert_eq!(index.read().total_blocks(), 200 * 2 * BATCHES as usize);
    for s in &subs {
        let snap = s.stats.snapshot();
        assert_eq!((snap.resets, snap.malformed, snap.undecodable), (0, 0, 0));
    }
    stop(cancel.clone(), subs).await;
    for p in engines {
        p.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_killed_silent_and_refusing_engines_do_not_stop_the_others() {
    let cancel = CancellationToken::new();
    let index: SharedIndex = Arc::new(parking_lot::RwLock::new(KvIndex::new()));
    let healthy_ids: Vec<u32> = (0..16).collect();
    let mut healthy = Vec::new();
    for _ in &healthy_ids {
        healthy.push(engine(&cancel).await);
    }
    let stalled = engine(&cancel).await;
    let killed = engine(&cancel).await;
    // Accepts connections and never speaks: the handshake times out, again and again.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_ep = format!("tcp://{}", silent.local_addr().unwrap());
    let hold = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = silent.accept().await {
            conns.push(c);
        }
    });
    let refused_ep = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("tcp://{}", l.local_addr().unwrap())
    };

    let mut subs: Vec<Subscriber> = healthy
        .iter()
        .zip(&healthy_ids)
        .map(|(p, &e)| subscribe(p, WorkerId(e), &index, &cancel))
        .collect();
    let stalled_sub = subscribe(&stalled, WorkerId(100), &index, &cancel);
    let killed_sub = subscribe(&killed, WorkerId(101), &index, &cancel);
    let mut silent_cfg = subscriber_cfg(WorkerId(102), &silent_ep, None);
    silent_cfg.connect_timeout = Duration::from_millis(300);
    let silent_sub = spawn_subscriber(silent_cfg, index.clone(), cancel.clone());
    let refused_sub = spawn_subscriber(
        subscriber_cfg(WorkerId(103), &refused_ep, Some(&refused_ep)),
        index.clone(),
        cancel.clone(),
    );
    let mut reachable: Vec<&Subscriber> = subs.iter().collect();
    reachable.extend([&stalled_sub, &killed_sub]);
    wait_all("connected", &reachable, |s| s.connected && s.synced).await;
    killed.shutdown().await;
    wait_all("killed engine noticed", &[&killed_sub], |s| !s.connected).await;
    wait_all("retried", &[&silent_sub, &refused_sub, &killed_sub], |s| {
        s.connect_failures >= 2
    })
    .await;

    for ((p, &e), s) in healthy.iter().zip(&healthy_ids).zip(&subs) {
        publish_all(p, e, s).await;
    }
    assert_indexed(&index, &healthy_ids);
    let st = stalled_sub.stats.snapshot();
    assert!(st.connected);
    assert_eq!((st.last_seq, st.indexed_blocks), (None, 0));
    for s in [&silent_sub, &refused_sub, &killed_sub] {
        let snap = s.stats.snapshot();
        assert!(!snap.connected);
        assert_eq!(snap.indexed_blocks, 0);
    }
    for w in 100..104 {
        assert_eq!(index.read().indexed_blocks(WorkerId(w)), 0);
    }

    subs.extend([stalled_sub, killed_sub, silent_sub, refused_sub]);
    stop(cancel.clone(), subs).await;
    hold.abort();
    for p in healthy {
        p.shutdown().await;
    }
    stalled.shutdown().await;
}
