//! `kvc-replay drive`, the replay driver for real engines, run here against standalone
//! simulated vLLM workers (`kvc-replay workers`) behind the `kvc-router` binary, each a
//! separate process on loopback: every request answered, prompt text in a tokenizer's
//! one-token words counted by the workers exactly as the trace counts it, the router's modes
//! and the cached tokens the answers report in the records; the same trace straight to one
//! worker, recorded as colocated; clear errors for a tokenizer without enough one-token
//! words and for an address where nothing answers.
#![forbid(unsafe_code)]

mod common;

use common::{Guard, bin_dir, free_port, http_get, read_json, wait_for_ready_file};
use serde_json::{Value, json};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A word-level tokenizer.json of `words` (one token each) and `[UNK]`.
fn word_tokenizer(path: &Path, words: &[&str]) {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), json!(0));
    for (i, w) in words.iter().enumerate() {
        vocab.insert((*w).into(), json!(i + 1));
    }
    let t = json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}});
    std::fs::write(path, t.to_string()).unwrap();
}

/// Three sessions of three turns, blocks of 16 tokens: a shared first block, each turn
/// appending a block to its session's last prompt.
fn trace(path: &Path) {
    let mut lines = String::new();
    for s in 0..3u64 {
        let mut ids = vec![0u64];
        for t in 1..=3u64 {
            ids.push(100 * (s + 1) + t);
            let input = 16 * ids.len() as u64 - 5;
            lines.push_str(
                &json!({"timestamp": s * 100 + t * 300, "session_id": s, "turn_id": t,
                    "input_length": input, "output_length": 4, "hash_ids": ids})
                .to_string(),
            );
            lines.push('\n');
        }
    }
    std::fs::write(path, lines).unwrap();
}

fn drive(bins: &Path, url: &str, dir: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(bins.join("kvc-replay"))
        .args([
            "drive",
            "--url",
            url,
            "--model",
            "sim",
            "--block-size",
            "16",
        ])
        .arg("--trace")
        .arg(dir.join("trace.jsonl"))
        .args(["--connect-timeout-s", "2", "--quiet"])
        .args(extra)
        .output()
        .unwrap()
}

fn records(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_trace_is_driven_through_the_router_and_straight_to_a_worker() {
    let bins = bin_dir();
    let dir = std::env::temp_dir().join(format!("kvc-drive-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    trace(&dir.join("trace.jsonl"));
    // Forty words of lowercase letters: wa .. wz, then waa ..
    let words: Vec<String> = (0..40u8)
        .map(|i| {
            format!(
                "w{}{}",
                char::from(b'a' + i % 26),
                "a".repeat(usize::from(i / 26))
            )
        })
        .collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let tokenizer = dir.join("tokenizer.json");
    word_tokenizer(&tokenizer, &words);

    let http = format!("127.0.0.1:{}", free_port());
    let (config, ready) = (dir.join("router.toml"), dir.join("ready.json"));
    let mut workers = Guard(
        Command::new(bins.join("kvc-replay"))
            .args(["workers", "--topology", "1p1d", "--speedup", "20"])
            .args(["--local-prefill", "off", "--model", "sim"])
            .args(["--duration-s", "300", "--router-http-listen", &http])
            .args(["--router-listen", "127.0.0.1:0"])
            .args(["--router-metrics-listen", "127.0.0.1:0"])
            .arg("--snapshot-dir")
            .arg(dir.join("snap"))
            .arg("--ready-file")
            .arg(&ready)
            .arg("--write-router-config")
            .arg(&config)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for_ready_file(&mut workers.0, &ready);
    let ready_json: Value =
        serde_json::from_str(&std::fs::read_to_string(&ready).unwrap()).unwrap();
    let decode_url = ready_json["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["role"] == "decode")
        .and_then(|w| w["url"].as_str())
        .unwrap()
        .to_owned();
    let _router = Guard(
        Command::new(bins.join("kvc-router"))
            .arg("--config")
            .arg(&config)
            .args(["--log", "warn"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(TcpStream::connect(&http).is_ok() && http_get(&http, "/health").contains(" 200 ")) {
        assert!(Instant::now() < deadline, "the router never became ready");
        std::thread::sleep(Duration::from_millis(200));
    }

    // Through the router, prompts in the tokenizer's words.
    let out = dir.join("kvc");
    let url = format!("http://{http}");
    let o = drive(
        &bins,
        &url,
        &dir,
        &[
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--time-scale",
            "4",
            "--label",
            "kvc",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report = read_json(&out, "drive.json");
    assert_eq!(report["requests"], 9, "{report}");
    assert_eq!(report["answered"], 9, "{report}");
    assert_eq!(report["errors"], json!({}), "{report}");
    // The workers count one token per word: every prompt as long as the trace says.
    assert_eq!(report["token_count_mismatches"], 0, "{report}");
    assert_eq!(
        report["reported_prompt_tokens"],
        report["trace_prompt_tokens"]
    );
    let recs = records(&out);
    assert_eq!(recs.len(), 9);
    for r in &recs {
        assert_eq!(r["outcome"], "ok", "{r}");
        assert!(r["ttft_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["latency_s"].as_f64().unwrap() >= r["ttft_s"].as_f64().unwrap());
        let turn = r["turn"].as_u64().unwrap();
        if turn == 1 {
            assert_eq!(r["mode"], "turn1-seed", "{r}");
        } else {
            // A later turn goes straight to D, which holds the earlier turn's full blocks
            // (turn t - 1 had t - 1 full blocks of 16 and a partial one).
            assert_eq!(r["mode"], "direct-to-d", "{r}");
            assert!(
                r["cached_tokens"].as_u64().unwrap() >= 16 * (turn - 1),
                "{r}"
            );
            assert_eq!(r["decode"], "1", "{r}");
        }
    }
    let summary = read_json(&out, "summary.json");
    assert_eq!(summary["requests"], 9);
    assert_eq!(summary["mechanism_errors"], 0);
    let direct = summary["direct_to_d_rate"].as_f64().unwrap();
    assert!((direct - 6.0 / 9.0).abs() < 1e-6, "{direct}");

    // Straight to the decode worker, no session header: every request colocated.
    let out = dir.join("alone");
    let o = drive(
        &bins,
        &decode_url,
        &dir,
        &[
            "--unlabelled-mode",
            "colocated",
            "--no-session-header",
            "--time-scale",
            "4",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let recs = records(&out);
    assert_eq!(recs.len(), 9);
    assert!(
        recs.iter()
            .all(|r| r["mode"] == "colocated" && r["outcome"] == "ok")
    );
    // Made-up words without a tokenizer: still answered, each word one token to the worker.
    assert_eq!(read_json(&out, "drive.json")["answered"], 9);

    // A tokenizer of too few one-token words: refused before anything is sent.
    let small = dir.join("small.json");
    word_tokenizer(&small, &words[..5]);
    let o = drive(
        &bins,
        &url,
        &dir,
        &[
            "--tokenizer",
            small.to_str().unwrap(),
            "--out",
            dir.join("x").to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("small.json") && err.contains("only 5 words"),
        "{err}"
    );

    // Nothing listening: a clear error once the connect timeout passes.
    let closed = format!("http://127.0.0.1:{}", free_port());
    let o = drive(
        &bins,
        &closed,
        &dir,
        &["--out", dir.join("y").to_str().unwrap()],
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("/health did not answer 2xx within 2 s"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
