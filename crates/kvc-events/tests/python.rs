//! A pyzmq PUB + replay ROUTER (`scripts/live_publisher.py`, msgspec payloads) feeding the
//! Rust subscriber over loopback, with two gaps only replay can close.
//!
//! Ignored by plain `cargo test`: `scripts/check.sh` installs msgspec and pyzmq into a venv
//! and runs it with `KVC_EVENTS_PYTHON` naming the venv's python.

mod common;

use common::{W, assert_same_index, engine_batches, reference, spec, wait_until};
use kvc_events::{KvIndex, SharedIndex, SubscriberConfig, decode_batch, spawn_subscriber};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const N: usize = 60;
const TOPIC: &str = "kv@py-worker@model";

/// The payloads the script wrote, in order.
fn payloads(path: &std::path::Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let mut out = Vec::new();
    let mut rest = bytes.as_slice();
    while rest.len() >= 4 {
        let n = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
        out.push(rest[4..4 + n].to_vec());
        rest = &rest[4 + n..];
    }
    assert!(rest.is_empty());
    out
}

#[test]
#[ignore = "needs msgspec and pyzmq: run by crates/kvc-events/scripts/check.sh"]
fn a_pyzmq_publisher_feeds_the_rust_subscriber() {
    let python = std::env::var("KVC_EVENTS_PYTHON")
        .expect("KVC_EVENTS_PYTHON names a python with msgspec and pyzmq");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::temp_dir().join(format!("kvc-events-py-{}.bin", std::process::id()));
    let mut child = Command::new(python)
        .arg(dir.join("scripts/live_publisher.py"))
        .arg(&out)
        .arg(N.to_string())
        .arg("12,13,14,40")
        .arg(TOPIC)
        .current_dir(dir.join("scripts"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the Python publisher");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let mut endpoints = line.split_whitespace().filter_map(|kv| kv.split_once('='));
    let pub_ep = endpoints.next().expect("pub=").1.to_string();
    let replay_ep = endpoints.next().expect("replay=").1.to_string();
    let mut stdin = child.stdin.take().unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cancel = CancellationToken::new();
    let index: SharedIndex = Arc::new(parking_lot::RwLock::new(KvIndex::new()));
    let result = rt.block_on(async {
        let mut cfg = SubscriberConfig::new(W, spec(), pub_ep);
        cfg.replay_endpoint = Some(replay_ep);
        cfg.topic = TOPIC.into();
        let sub = spawn_subscriber(cfg, index.clone(), cancel.clone());
        wait_until("connected", &sub.stats, |s| s.connected).await;
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
        wait_until("all applied", &sub.stats, |s| {
            s.last_seq == Some(N as u64 - 1)
        })
        .await;
        cancel.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), sub.task).await;
        sub.stats.snapshot()
    });
    drop(stdin);
    let _ = child.wait();

    // The payloads decode to exactly the batches the Rust mirror generates.
    let decoded: Vec<_> = payloads(&out)
        .iter()
        .map(|p| decode_batch(p).unwrap())
        .collect();
    let _ = std::fs::remove_file(&out);
    let batches = engine_batches(N);
    assert_eq!(decoded, batches);
    assert!(result.gaps >= 1, "{result:?}");
    assert!(result.replays >= 1, "{result:?}");
    assert_eq!(
        (result.resets, result.undecodable, result.malformed),
        (0, 0, 0)
    );
    assert_same_index(&index.read(), &reference(&batches));
}
