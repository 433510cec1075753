//! Data-parallel ranks and engines that connect to the router, over loopback: two ranks of
//! one worker each indexed under its own rank; engines that connect their PUB socket to a
//! listener bound by the subscriber side, each indexed under the worker its topic names,
//! each with its own sequence numbers and replay; unknown topics counted and never indexed.
//! Every wait is bounded; nothing asserts on time.

mod common;

use common::{BS, engine_batches, spec, wait_until};
use kvc_core::{SessionId, WorkerId};
use kvc_events::{
    BlockStored, EngineHash, Event, EventBatch, KvIndex, Listener, ListenerConfig, Publisher,
    PublisherConfig, SharedIndex, SubscriberConfig, spawn_subscriber,
};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn index() -> SharedIndex {
    Arc::new(parking_lot::RwLock::new(KvIndex::new()))
}

/// One batch storing `blocks` chained blocks of `session` from hash `first` on.
fn session_batch(first: u64, blocks: u64, session: &str, rank: Option<i64>) -> EventBatch {
    let hashes: Vec<u64> = (first..first + blocks).collect();
    EventBatch {
        ts: 0.0,
        events: vec![Event::Stored(BlockStored {
            block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
            parent: None,
            token_ids: hashes
                .iter()
                .flat_map(|h| (0..BS).map(move |t| (*h as u32) * 7 + t))
                .collect(),
            block_size: BS,
            session_id: Some(session.into()),
            ..BlockStored::default()
        })],
        dp_rank: rank,
    }
}

async fn publisher(cfg: PublisherConfig, cancel: &CancellationToken) -> Publisher {
    Publisher::bind(cfg, cancel.clone()).await.unwrap()
}

/// Publishes `batch` again and again (a PUB socket drops what it sends before it has seen
/// the subscription) until `done`; at most 200 times, 50 ms apart.
async fn publish_until(p: &Publisher, batch: &EventBatch, what: &str, done: impl Fn() -> bool) {
    for _ in 0..200 {
        p.publish(batch).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        if done() {
            return;
        }
    }
    panic!("{what}: gave up publishing");
}

const W1: WorkerId = WorkerId(1);
const W2: WorkerId = WorkerId(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rank_of_a_worker_is_indexed_under_its_rank() {
    let cancel = CancellationToken::new();
    let idx = index();
    let mut subs = Vec::new();
    let mut pubs = Vec::new();
    for rank in 0..2u32 {
        let p = publisher(PublisherConfig::new("tcp://127.0.0.1:0"), &cancel).await;
        let mut cfg = SubscriberConfig::new(W1, spec(), p.endpoint());
        cfg.rank = rank;
        subs.push(spawn_subscriber(cfg, idx.clone(), cancel.clone()));
        pubs.push(p);
    }
    // Rank 1 holds three blocks of the session, rank 0 one of another; rank 1's batch says
    // it is rank 1, and rank 0's stream receives one batch that claims rank 5.
    publish_until(
        &pubs[1],
        &session_batch(10, 3, "s-1", Some(1)),
        "rank 1",
        || subs[1].stats.snapshot().indexed_blocks == 3,
    )
    .await;
    publish_until(
        &pubs[0],
        &session_batch(10, 1, "s-0", Some(5)),
        "rank 0",
        || subs[0].stats.snapshot().indexed_blocks == 1,
    )
    .await;
    let s1 = SessionId::from_key("s-1");
    let s0 = SessionId::from_key("s-0");
    {
        let i = idx.read();
        assert_eq!(i.session_residency_ranks(s1), vec![(W1, 1, 3)]);
        assert_eq!(i.session_residency_ranks(s0), vec![(W1, 0, 1)]);
        assert_eq!(i.session_residency(s1), vec![(W1, 3)]);
        assert_eq!((i.rank_blocks(W1, 0), i.rank_blocks(W1, 1)), (1, 3));
    }
    assert_eq!(subs[1].stats.snapshot().other_rank, 0);
    assert!(subs[0].stats.snapshot().other_rank >= 1);
    cancel.cancel();
    for s in subs {
        tokio::time::timeout(Duration::from_secs(10), s.task)
            .await
            .unwrap()
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_that_connect_are_indexed_under_the_worker_their_topic_names() {
    let cancel = CancellationToken::new();
    let idx = index();
    let listener = Listener::bind(ListenerConfig::new("tcp://127.0.0.1:0"), cancel.clone())
        .await
        .unwrap();
    let at = listener.endpoints()[0].clone();
    listener.expect(W1, "d0", None);
    listener.expect(W2, "d1", Some("custom-topic"));
    let mut streams = Vec::new();
    let mut engines = Vec::new();
    for (w, topic) in [(W1, "kv@d0@llama"), (W2, "custom-topic")] {
        let mut cfg = PublisherConfig::new(at.clone());
        cfg.connect = true;
        cfg.topic = topic.into();
        cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
        let p = publisher(cfg, &cancel).await;
        let mut scfg = SubscriberConfig::new(w, spec(), "unused");
        scfg.replay_endpoint = p.replay_endpoint().map(str::to_owned);
        streams.push(listener.start(scfg, idx.clone(), cancel.clone()).unwrap());
        engines.push(p);
    }
    // A second stream for a running rank is refused; so is a worker never declared.
    let again = SubscriberConfig::new(W1, spec(), "unused");
    assert!(listener.start(again, idx.clone(), cancel.clone()).is_none());
    let stranger = SubscriberConfig::new(WorkerId(9), spec(), "unused");
    assert!(
        listener
            .start(stranger, idx.clone(), cancel.clone())
            .is_none()
    );

    // d0's engine publishes 60 batches (one at a time until its stream has applied one:
    // what its PUB sent before it saw the subscription is replayed from its buffer); d1's
    // one batch of its own session. Each numbers from 0: neither's sequence disturbs the
    // other's.
    let batches = engine_batches(60);
    let mut cursor = 0;
    common::publish_until_in_sync(&engines[0], &streams[0].stats, &batches, &mut cursor).await;
    for b in &batches[cursor..] {
        engines[0].publish(b).await.unwrap();
    }
    publish_until(
        &engines[1],
        &session_batch(500, 2, "d1-s", None),
        "d1",
        || streams[1].stats.snapshot().indexed_blocks == 2,
    )
    .await;
    let last = batches.len() as u64 - 1;
    wait_until("d0 caught up", &streams[0].stats, |s| {
        s.last_seq == Some(last)
    })
    .await;
    let want = common::reference(&batches);
    {
        let i = idx.read();
        // The reference index is built for the common worker id.
        assert_eq!(i.worker_blocks(W1), want.worker_blocks(common::W));
        assert_eq!(
            i.session_residency(SessionId::from_key("d1-s")),
            vec![(W2, 2)]
        );
        assert_eq!(i.rank_blocks(W2, 0), 2);
    }
    let s0 = streams[0].stats.snapshot();
    assert!(s0.connected && s0.synced, "{s0:?}");
    assert!(streams[1].stats.snapshot().last_seq.is_some());

    // An engine whose topic names no listening worker: counted, listed once, never indexed.
    let mut cfg = PublisherConfig::new(at.clone());
    cfg.connect = true;
    cfg.topic = "kv@nobody@llama".into();
    let stranger = publisher(cfg, &cancel).await;
    let before = idx.read().total_blocks();
    publish_until(
        &stranger,
        &session_batch(900, 4, "stranger", None),
        "unknown topic",
        || listener.stats().unknown_topic >= 3,
    )
    .await;
    let st = listener.stats();
    assert_eq!(st.unknown_topics, vec!["kv@nobody@llama".to_owned()]);
    assert_eq!(idx.read().total_blocks(), before);
    assert!(
        idx.read()
            .session_residency(SessionId::from_key("stranger"))
            .is_empty()
    );
    assert_eq!(st.malformed, 0);
    // A listening worker whose stream has not started: its messages are counted apart,
    // and not indexed either.
    listener.expect(WorkerId(3), "d2", None);
    let mut cfg = PublisherConfig::new(at.clone());
    cfg.connect = true;
    cfg.topic = "kv@d2@llama".into();
    let early = publisher(cfg, &cancel).await;
    publish_until(
        &early,
        &session_batch(950, 1, "early", None),
        "not started",
        || listener.stats().not_started >= 1,
    )
    .await;
    assert_eq!(listener.stats().unknown_topics.len(), 1);
    assert_eq!(idx.read().total_blocks(), before);
    cancel.cancel();
    for s in streams {
        tokio::time::timeout(Duration::from_secs(10), s.task)
            .await
            .unwrap()
            .unwrap();
    }
    listener.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_for_two_ranks_binds_two_ports_and_each_is_its_rank() {
    let cancel = CancellationToken::new();
    // A free pair of ports: bind rank 0 on any port, then ask for that port and the next.
    let probe = Listener::bind(ListenerConfig::new("tcp://127.0.0.1:0"), cancel.clone())
        .await
        .unwrap();
    let port: u16 = probe.endpoints()[0]
        .rsplit_once(':')
        .unwrap()
        .1
        .parse()
        .unwrap();
    probe.shutdown().await;
    let mut lcfg = ListenerConfig::new(format!("tcp://127.0.0.1:{port}"));
    lcfg.ranks = 2;
    let Ok(listener) = Listener::bind(lcfg, cancel.clone()).await else {
        // Another process took one of the two ports in between: nothing to check here.
        eprintln!("ports {port} and {} not both free; skipped", port + 1);
        return;
    };
    assert_eq!(
        listener.endpoints(),
        [
            format!("tcp://127.0.0.1:{port}"),
            format!("tcp://127.0.0.1:{}", port + 1)
        ]
    );
    let idx = index();
    listener.expect(W1, "d0", None);
    let mut streams = Vec::new();
    for rank in 0..2 {
        let mut scfg = SubscriberConfig::new(W1, spec(), "unused");
        scfg.rank = rank;
        streams.push(listener.start(scfg, idx.clone(), cancel.clone()).unwrap());
    }
    // Rank 1 of the engine connects to port + 1, as vLLM offsets it.
    let mut cfg = PublisherConfig::new(format!("tcp://127.0.0.1:{}", port + 1));
    cfg.connect = true;
    cfg.topic = "kv@d0@m".into();
    let rank1 = publisher(cfg, &cancel).await;
    publish_until(
        &rank1,
        &session_batch(1, 2, "r1", Some(1)),
        "rank 1",
        || streams[1].stats.snapshot().indexed_blocks == 2,
    )
    .await;
    assert_eq!(
        idx.read()
            .session_residency_ranks(SessionId::from_key("r1")),
        vec![(W1, 1, 2)]
    );
    assert_eq!(streams[0].stats.snapshot().batches, 0);
    // Ports are fixed for several ranks.
    let mut zero = ListenerConfig::new("tcp://127.0.0.1:0");
    zero.ranks = 2;
    assert!(matches!(
        Listener::bind(zero, cancel.clone()).await,
        Err(kvc_events::ListenError::PortZero(_))
    ));
    cancel.cancel();
    listener.shutdown().await;
}
