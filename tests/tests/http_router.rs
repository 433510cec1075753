//! End to end over HTTP: `kvc-replay live --http-router` (simulated SGLang-style workers and
//! the client) and the `kvc-router` binary as separate processes on loopback, the router
//! started from the configuration the replay wrote once its workers were up — the same steps as
//! `scripts/side-by-side/run.sh`.
#![forbid(unsafe_code)]

mod common;

use common::{
    Guard, bin_dir, free_port, gen_trace, http_get, mode_shares, read_json, run_sim,
    start_http_live, wait_within,
};
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn kvc_router_binary_in_front_of_simulated_http_workers() {
    let bins = bin_dir();
    let dir = std::env::temp_dir().join(format!("kvc-http-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let replay = bins.join("kvc-replay");
    let trace = gen_trace(&replay, &dir, 3, 3);
    let http = format!("127.0.0.1:{}", free_port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let (config, out) = (dir.join("router.toml"), dir.join("run"));
    let mut live = start_http_live(
        &replay,
        &dir,
        &trace,
        ("1p2d", "40"),
        &format!("http://{http}"),
        &config,
    );
    let workers = read_json(&dir, "ready.json");
    assert_eq!(workers["workers"].as_array().unwrap().len(), 3);
    let router = Guard(
        Command::new(bins.join("kvc-router"))
            .arg("--config")
            .arg(&config)
            .args(["--http-listen", &http, "--listen", "127.0.0.1:0"])
            .args(["--metrics-listen", &metrics, "--log", "warn"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let status = wait_within(&mut live, Duration::from_secs(180), "the HTTP replay");
    assert!(status.success(), "the HTTP replay failed");

    // Every request completed over HTTP, and was streamed through the router.
    let summary = read_json(&out, "summary.json");
    let requests = std::fs::read_to_string(&trace).unwrap().lines().count();
    assert_eq!(summary["requests"].as_u64(), Some(requests as u64));
    assert_eq!(summary["outcomes"]["ok"].as_u64(), Some(requests as u64));
    assert_eq!(summary["mechanism_errors"].as_u64(), Some(0));
    let report = read_json(&out, "http.json");
    assert_eq!(report["router"], "external");
    assert_eq!(
        report["router_added"]["requests"].as_u64(),
        Some(requests as u64)
    );
    // Each request's two halves, one row per request measured, in trace order.
    let csv = std::fs::read_to_string(out.join("router_added.csv")).unwrap();
    let rows: Vec<Vec<f64>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(|v| v.parse().unwrap()).collect())
        .collect();
    assert_eq!(
        csv.lines().next(),
        Some("index,to_worker_ms,from_worker_ms")
    );
    assert_eq!(rows.len(), requests);
    assert!(rows.windows(2).all(|w| w[0][0] < w[1][0]));
    assert!(rows.iter().all(|r| r[1] > 0.0 && r[2] >= 0.0));
    // The router's own counters saw the HTTP requests and its probes admitted direct turns.
    let text = http_get(&metrics, "/metrics");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let admitted: f64 = text
        .lines()
        .find(|l| l.starts_with("kvc_router_probes_total{result=\"admit\"}"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .expect("probe counter in /metrics");
    assert!(admitted > 0.0, "direct turns were probed");

    // Same execution-mode accounting as the simulator, within 10 points per mode.
    let sim = run_sim(&replay, &dir, &trace, "1p2d", "kvc");
    let (h, s) = (
        mode_shares(&summary),
        mode_shares(&read_json(&sim, "summary.json")),
    );
    let share = |v: &[(String, f64)], m: &str| v.iter().find(|(k, _)| k == m).map_or(0.0, |x| x.1);
    for (mode, _) in h.iter().chain(s.iter()) {
        let (a, b) = (share(&h, mode), share(&s, mode));
        assert!((a - b).abs() <= 0.10, "{mode}: HTTP {a:.3} vs sim {b:.3}");
    }
    assert!(share(&h, "direct-to-d") > 0.8, "{h:?}");
    drop(router);
    let _ = std::fs::remove_dir_all(&dir);
}
