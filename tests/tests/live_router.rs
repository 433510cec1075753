//! End to end: `kvc-router` and `kvc-replay live` as separate processes on loopback.
//!
//! The live replay runs the simulated workers on a real clock, publishing their snapshots; the
//! router reads them, probes before direct-to-D, and routes every turn of a small generated
//! trace. Every request must have a record, decisions must have used the probe path, and the
//! execution-mode shares must agree with the simulator's within 10 percentage points.
#![forbid(unsafe_code)]

mod common;

use common::{Guard, bin_dir, free_port, http_get, mode_shares, run_sim};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn router_and_live_replay_in_separate_processes() {
    let bins = bin_dir();
    let dir = std::env::temp_dir().join(format!("kvc-live-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let replay = bins.join("kvc-replay");
    let trace = dir.join("trace.jsonl");
    let ok = Command::new(&replay)
        .args([
            "gen",
            "swe",
            "--seed",
            "2",
            "--sessions",
            "4",
            "--quiet",
            "--out",
        ])
        .arg(&trace)
        .status()
        .unwrap();
    assert!(ok.success());
    let grpc = format!("127.0.0.1:{}", free_port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let snapshots = dir.join("snap");
    let config = dir.join("router.toml");
    let ok = Command::new(&replay)
        .args([
            "live",
            "--topology",
            "1p2d",
            "--policy",
            "kvc-v2",
            "--router-listen",
            &grpc,
        ])
        .args(["--router-metrics-listen", &metrics, "--snapshot-dir"])
        .arg(&snapshots)
        .arg("--write-router-config")
        .arg(&config)
        .status()
        .unwrap();
    assert!(ok.success(), "writing the router config failed");

    // The replay starts first: it creates and publishes the snapshots, then waits for the router.
    let out = dir.join("live");
    let mut live = Command::new(&replay)
        .args([
            "live",
            "--quiet",
            "--topology",
            "1p2d",
            "--policy",
            "kvc-v2",
        ])
        .args(["--speedup", "100", "--connect-timeout-s", "30", "--router"])
        .arg(format!("http://{grpc}"))
        .arg("--snapshot-dir")
        .arg(&snapshots)
        .arg("--trace")
        .arg(&trace)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Give the replay a moment to create the snapshot files the router opens.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !snapshots.join("w2.snap").exists() {
        assert!(Instant::now() < deadline, "snapshots never appeared");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut router = Guard(
        Command::new(bins.join("kvc-router"))
            .arg("--config")
            .arg(&config)
            .args(["--log", "warn"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(router.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains(&grpc), "router announced {line:?}");

    // Bounded wait for the replay (the 4-session trace spans a few hundred seconds at 100x).
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = live.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = live.kill();
            panic!("the live replay did not finish in time");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "the live replay failed");

    let requests = std::fs::read_to_string(&trace).unwrap().lines().count();
    let records = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let mut seen = vec![false; requests];
    for l in records.lines() {
        let r: serde_json::Value = serde_json::from_str(l).unwrap();
        let i = r["index"].as_u64().unwrap() as usize;
        assert!(!seen[i], "request {i} recorded twice");
        seen[i] = true;
        assert!(
            r["mode"].is_string() || r["outcome"] == "input-too-long",
            "{l}"
        );
    }
    assert!(seen.iter().all(|s| *s), "every request has a record");

    let text = http_get(&metrics, "/metrics");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let admitted: f64 = text
        .lines()
        .find(|l| l.starts_with("kvc_router_probes_total{result=\"admit\"}"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .expect("probe counter in /metrics");
    assert!(admitted > 0.0, "decisions used the probe path");

    // Live and simulated runs of the same trace agree on the execution-mode shares.
    let sim = run_sim(&replay, &dir, &trace, "1p2d", "kvc-v2");
    let read = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("summary.json")).unwrap()).unwrap()
    };
    let (l, s) = (read(&out), read(&sim));
    let live_shares = mode_shares(&l);
    let sim_shares = mode_shares(&s);
    for (mode, share) in live_shares.iter().chain(sim_shares.iter()) {
        let other = |v: &[(String, f64)]| v.iter().find(|(m, _)| m == mode).map_or(0.0, |x| x.1);
        let (a, b) = (other(&live_shares), other(&sim_shares));
        assert!(
            (a - b).abs() <= 0.10,
            "{mode}: live {a:.3} vs sim {b:.3} (share {share})"
        );
    }
    drop(router);
    let _ = std::fs::remove_dir_all(&dir);
}
