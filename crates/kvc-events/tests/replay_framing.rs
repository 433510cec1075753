//! Replay replies in both shapes engines send — vLLM 0.32+'s `["", topic, seq, payload]`
//! (bytes captured from a real vLLM) and SGLang's / older vLLM's `["", seq, payload]` — and a
//! subscriber started after its engine published, which must catch up by replay before the
//! engine publishes again.

mod common;

use bytes::Bytes;
use common::{W, assert_same_index, engine_batches, reference, spec, wait_until};
use kvc_events::frames::split_reply;
use kvc_events::{
    Event, KvIndex, Publisher, PublisherConfig, SharedIndex, SubscriberConfig, decode_batch,
    spawn_subscriber,
};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The messages of `tests/fixtures/vllm032_replay_reply.frames`.
fn captured() -> Vec<Vec<Bytes>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/vllm032_replay_reply.frames");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let hex = |s: &str| -> Bytes {
        if s == "-" {
            return Bytes::new();
        }
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect::<Vec<u8>>()
            .into()
    };
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split(' ').map(hex).collect())
        .collect()
}

#[test]
fn a_real_vllm_replay_reply_and_its_end_marker_are_read() {
    let messages = captured();
    assert_eq!(messages.len(), 2);
    // vLLM 0.32: four frames, the topic before the sequence.
    assert_eq!(messages[0].len(), 4);
    assert_eq!(messages[0][1].as_ref(), b"kv@d0@kvc-tiny");
    let (seq, payload) = split_reply(&messages[0])
        .expect("a well-formed reply")
        .expect("a batch, not the end marker");
    assert_eq!(seq, 0);
    let batch = decode_batch(payload).expect("vLLM's payload decodes");
    let Event::Stored(stored) = &batch.events[0] else {
        panic!("a BlockStored event: {:?}", batch.events);
    };
    assert_eq!((stored.block_size, stored.token_ids.len()), (32, 32));
    assert_eq!(stored.parent, None);
    assert_eq!(batch.dp_rank, Some(0));
    // The end marker: ["", "", END_SEQ, ""].
    assert_eq!(messages[1].len(), 4);
    assert_eq!(split_reply(&messages[1]), Some(None));
    // The same reply without the topic frame (SGLang, older vLLM) reads the same.
    let old = [Bytes::new(), messages[0][2].clone(), messages[0][3].clone()];
    assert_eq!(
        split_reply(&old).flatten().map(|(s, p)| (s, p.len())),
        Some((0, payload.len()))
    );
    let old_end = [Bytes::new(), messages[1][2].clone(), Bytes::new()];
    assert_eq!(split_reply(&old_end), Some(None));
}

async fn late_subscriber_catches_up(topic_frame: bool) {
    let cancel = CancellationToken::new();
    let mut cfg = PublisherConfig::new("tcp://127.0.0.1:0");
    cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    cfg.topic = "kv@pod-3@model".into();
    cfg.replay_topic_frame = topic_frame;
    let p = Publisher::bind(cfg, cancel.clone()).await.unwrap();
    let batches = engine_batches(30);
    for b in &batches {
        p.publish(b).await.unwrap();
    }
    // The router starts now, and the engine publishes nothing more.
    let index: SharedIndex = Arc::new(parking_lot::RwLock::new(KvIndex::new()));
    let mut sub_cfg = SubscriberConfig::new(W, spec(), p.endpoint());
    sub_cfg.replay_endpoint = p.replay_endpoint().map(str::to_string);
    sub_cfg.topic = "kv@pod-3@model".into();
    sub_cfg.backoff_min = Duration::from_millis(20);
    let sub = spawn_subscriber(sub_cfg, index.clone(), cancel.clone());
    wait_until("caught up by replay", &sub.stats, |s| {
        s.synced && s.last_seq == Some(29)
    })
    .await;
    let s = sub.stats.snapshot();
    assert_eq!((s.replays, s.replay_failures, s.resets), (1, 0, 0), "{s:?}");
    assert_eq!(s.malformed, 0);
    let want = reference(&batches);
    assert!(want.indexed_blocks(W) > 0);
    assert_same_index(&index.read(), &want);
    // Live batches then continue the history.
    let next = engine_batches(31).pop().unwrap();
    let seq = p.publish(&next).await.unwrap();
    assert_eq!(seq, 30);
    wait_until("the next live batch", &sub.stats, |s| {
        s.last_seq == Some(30)
    })
    .await;
    assert_eq!(sub.stats.snapshot().resets, 0);
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(10), sub.task)
        .await
        .expect("the subscriber stops when cancelled")
        .expect("no panic");
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_subscriber_catches_up_from_a_vllm_0_32_replay_socket() {
    late_subscriber_catches_up(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_subscriber_catches_up_from_an_sglang_style_replay_socket() {
    late_subscriber_catches_up(false).await;
}
