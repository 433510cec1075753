//! End to end without snapshots: the simulated workers show their state as stock vLLM engines
//! do (Prometheus `/metrics` with vLLM's names, KV-cache events over ZeroMQ), and a spawned
//! `kvc-router` reads only those (`--router-state events`). Every request must be recorded
//! with no mechanism error, the router must have indexed the decode workers' blocks, and the
//! execution-mode shares must agree with the snapshot-fed run of the same trace within five
//! points.
#![forbid(unsafe_code)]

mod common;

use common::{bin_dir, gen_trace, mode_shares, read_json, wait_within};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Replays `trace` live on `1p3d` with `kvc` and a spawned router reading `state`; returns
/// the output directory and the replay's standard error.
fn live(replay: &Path, dir: &Path, trace: &Path, state: &str) -> (PathBuf, String) {
    let out = dir.join(format!("live-{state}"));
    let mut child = Command::new(replay)
        .args(["live", "--quiet", "--topology", "1p3d", "--policy", "kvc"])
        // Workers held to their roles in both runs, so that only the state source differs (a
        // router reading engine signals learns the workers' engine, which could let them
        // serve turns alone).
        .args(["--local-prefill", "off"])
        .args([
            "--speedup",
            "100",
            "--connect-timeout-s",
            "30",
            "--spawn-router",
        ])
        .arg("--router-bin")
        .arg(bin_dir().join("kvc-router"))
        .args(["--router-state", state, "--snapshot-dir"])
        .arg(dir.join(format!("snap-{state}")))
        .arg("--trace")
        .arg(trace)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut s).unwrap();
        s
    });
    let status = wait_within(&mut child, Duration::from_secs(240), "the live replay");
    let stderr = reader.join().unwrap();
    assert!(
        status.success(),
        "live --router-state {state} failed: {stderr}"
    );
    (out, stderr)
}

#[test]
fn a_router_fed_only_by_engine_signals_routes_like_one_fed_by_snapshots() {
    let replay = bin_dir().join("kvc-replay");
    let dir = std::env::temp_dir().join(format!("kvc-live-events-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let trace = gen_trace(&replay, &dir, 7, 4);
    let requests = std::fs::read_to_string(&trace).unwrap().lines().count();

    let (events_out, stderr) = live(&replay, &dir, &trace, "events");
    let (snap_out, _) = live(&replay, &dir, &trace, "snapshot");

    // The router was configured with engine endpoints only, and indexed the decode workers'
    // blocks from their events.
    let config = std::fs::read_to_string(dir.join("snap-events/kvc-router.toml")).unwrap();
    assert!(!config.contains("snapshot ="), "{config}");
    // No snapshot file was written at all.
    let files: Vec<String> = std::fs::read_dir(dir.join("snap-events"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files, ["kvc-router.toml"]);
    assert!(config.contains("metrics-url") && config.contains("kv-events-replay"));
    for d in ["d0", "d1", "d2"] {
        let line = stderr
            .lines()
            .find(|l| l.contains(&format!("router view of {d} from engine events")))
            .unwrap_or_else(|| panic!("no router view of {d}: {stderr}"));
        let blocks: u64 = line
            .split(": ")
            .nth(2)
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        assert!(blocks > 0, "{line}");
    }

    let (e, s) = (
        read_json(&events_out, "summary.json"),
        read_json(&snap_out, "summary.json"),
    );
    for summary in [&e, &s] {
        assert_eq!(summary["requests"].as_u64(), Some(requests as u64));
        assert_eq!(summary["mechanism_errors"].as_u64(), Some(0), "{summary}");
    }
    let records = std::fs::read_to_string(events_out.join("metrics.jsonl")).unwrap();
    assert_eq!(records.lines().count(), requests);
    let (es, ss) = (mode_shares(&e), mode_shares(&s));
    for (mode, _) in es.iter().chain(ss.iter()) {
        let of = |v: &[(String, f64)]| v.iter().find(|(m, _)| m == mode).map_or(0.0, |x| x.1);
        let (a, b) = (of(&es), of(&ss));
        assert!(
            (a - b).abs() <= 0.05,
            "{mode}: events {a:.3} vs snapshot {b:.3}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
