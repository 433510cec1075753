//! A fleet that changes under a live replay: `kvc-replay live --http-router` (simulated
//! workers and the client) in front of the `kvc-router` binary, whose configuration file is
//! edited while the sessions run — a decode worker added, another drained, then removed. The
//! router re-reads the file by itself (`--config-poll-ms`). Every request of the trace is
//! recorded once and served, and the router's view follows each edit.
#![forbid(unsafe_code)]

mod common;

use common::{
    Guard, bin_dir, free_port, gen_trace, http_get, read_json, start_http_live, wait_within,
};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The `[[workers]]` tables of a router configuration, and what comes before them.
fn split_workers(toml: &str) -> (String, Vec<String>) {
    let mut parts = toml.split("[[workers]]");
    let head = parts.next().unwrap().to_owned();
    (head, parts.map(|w| format!("[[workers]]{w}")).collect())
}

/// Writes `text` to `path` in one step (a reader never sees half a file).
fn write_whole(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The sum of the values of a metric's lines in a `/metrics` answer.
fn total(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}

/// Whether `/metrics` lists worker `id` (its drained gauge), and the gauge's value.
fn drained_gauge(metrics: &str, id: u32) -> Option<f64> {
    let tag = format!("worker=\"{id}\"");
    metrics
        .lines()
        .find(|l| l.starts_with("kvc_router_worker_drained{") && l.contains(&tag))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
}

/// Polls `/metrics` until `ready` holds of it, within 60 s.
fn wait_metrics(addr: &str, what: &str, ready: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    // The router binds its listeners shortly after it starts.
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "the router's /metrics never answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    loop {
        let m = http_get(addr, "/metrics");
        if ready(&m) {
            return m;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_worker_added_drained_and_removed_under_a_live_replay_loses_no_request() {
    let bins = bin_dir();
    let dir = std::env::temp_dir().join(format!("kvc-fleet-live-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let replay = bins.join("kvc-replay");
    let trace = gen_trace(&replay, &dir, 3, 8);
    let requests = std::fs::read_to_string(&trace).unwrap().lines().count();
    let http = format!("127.0.0.1:{}", free_port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let (written, config, out) = (
        dir.join("written.toml"),
        dir.join("router.toml"),
        dir.join("run"),
    );
    let mut live = start_http_live(
        &replay,
        &dir,
        &trace,
        ("1p3d", "16"),
        &format!("http://{http}"),
        &written,
    );
    // The router starts with p0, d0 and d1; d2 (id 3) is added while the replay runs.
    let (head, workers) = split_workers(&std::fs::read_to_string(&written).unwrap());
    assert_eq!(workers.len(), 4);
    assert!(workers[3].contains("id = 3"), "{}", workers[3]);
    write_whole(&config, &format!("{head}{}", workers[..3].concat()));
    let log = std::fs::File::create(dir.join("router.log")).unwrap();
    let router = Guard(
        Command::new(bins.join("kvc-router"))
            .arg("--config")
            .arg(&config)
            .args(["--http-listen", &http, "--listen", "127.0.0.1:0"])
            .args(["--metrics-listen", &metrics, "--log", "info"])
            .args(["--config-poll-ms", "100"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let decided = |m: &str| total(m, "kvc_router_decisions_total{");
    // The replay runs on its own clock; each step below waits for a count of decisions the
    // router reaches whatever the pace of either. d2 joins as soon as the fleet without it
    // has routed: the trace's first session runs alone for a while (22 turns, 73 s of trace
    // time, 4.6 s at 16x), and the seven sessions after it start with d2 in the fleet.
    let m = wait_metrics(&metrics, "the first decision", |m| decided(m) >= 1.0);
    assert_eq!(drained_gauge(&m, 3), None, "d2 is not in the fleet yet");

    // Added: the file lists d2 again.
    write_whole(&config, &format!("{head}{}", workers.concat()));
    let at_add = decided(&wait_metrics(&metrics, "d2 to join", |m| {
        drained_gauge(m, 3) == Some(0.0)
    }));
    // A sixth of the trace more than `from`, or all of it: the router decides every request
    // at least once, so the count is reached before the replay ends.
    let after_a_sixth = |from: f64| (from + (requests / 6) as f64).min(requests as f64);
    let at_drain = decided(&wait_metrics(
        &metrics,
        "decisions with d2 in the fleet",
        |m| decided(m) >= after_a_sixth(at_add),
    ));
    // Drained: d0 (id 1) takes no new work.
    let drained_d0 = workers[1].replace("role = \"decode\"", "role = \"decode\"\ndrained = true");
    write_whole(
        &config,
        &format!(
            "{head}{}{drained_d0}{}{}",
            workers[0], workers[2], workers[3]
        ),
    );
    wait_metrics(&metrics, "d0 to be drained", |m| {
        drained_gauge(m, 1) == Some(1.0) && decided(m) >= after_a_sixth(at_drain)
    });
    // Removed: d0 leaves the file.
    write_whole(
        &config,
        &format!("{head}{}{}{}", workers[0], workers[2], workers[3]),
    );
    wait_metrics(&metrics, "d0 to leave", |m| drained_gauge(m, 1).is_none());

    let status = wait_within(&mut live, Duration::from_secs(300), "the live replay");
    assert!(status.success(), "the live replay failed");
    let log = std::fs::read_to_string(dir.join("router.log")).unwrap();
    for line in [
        "worker 3 (`d2`) added",
        "worker 1 (`d0`) drained",
        "worker 1 (`d0`) removed",
    ] {
        assert!(
            log.contains(line),
            "no `{line}` in the router's log:\n{log}"
        );
    }

    // Every request of the trace recorded once, and served.
    let summary = read_json(&out, "summary.json");
    assert_eq!(summary["requests"].as_u64(), Some(requests as u64));
    assert_eq!(summary["outcomes"]["ok"].as_u64(), Some(requests as u64));
    assert_eq!(summary["mechanism_errors"].as_u64(), Some(0));
    let indices: BTreeSet<u64> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["index"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(indices.len(), requests, "a request recorded twice");
    let records: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), requests);
    let turns: BTreeSet<(u64, u64)> = records
        .iter()
        .map(|r| (r["session"].as_u64().unwrap(), r["turn"].as_u64().unwrap()))
        .collect();
    assert_eq!(turns.len(), requests, "a turn recorded twice");
    let sessions: BTreeSet<u64> = turns.iter().map(|t| t.0).collect();
    assert_eq!(sessions.len(), 8);
    // The added worker decoded turns; the removed one none after it left.
    let decoded_on = |name: &str| {
        records
            .iter()
            .filter(|r| r["decode"].as_str() == Some(name))
            .count()
    };
    let by_worker: std::collections::BTreeMap<&str, usize> =
        ["d0", "d1", "d2"].map(|d| (d, decoded_on(d))).into();
    assert!(
        decoded_on("d2") > 0,
        "the added worker served nothing (it joined after {at_add} decisions of {requests} \
         requests; decoded {by_worker:?})"
    );
    let text = http_get(&metrics, "/metrics");
    assert_eq!(drained_gauge(&text, 1), None);
    assert_eq!(drained_gauge(&text, 3), Some(0.0));
    drop(router);
    let _ = std::fs::remove_dir_all(&dir);
}
