//! The `sim`, `compare`, `report`, `demo` and `policies` subcommands, run as a user would.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvc-replay"))
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvc-sim-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn gen_trace(dir: &Path) -> PathBuf {
    let t = dir.join("t.jsonl");
    ok(bin()
        .args([
            "gen",
            "swe",
            "--seed",
            "2",
            "--sessions",
            "5",
            "--quiet",
            "--out",
        ])
        .arg(&t)
        .output()
        .unwrap());
    t
}

#[test]
fn sim_writes_run_directory_and_compare_and_report_read_it() {
    let dir = tmp("run");
    let trace = gen_trace(&dir);
    let mut runs = Vec::new();
    for (topology, policy) in [("2dp", "cache-aware"), ("1p2d", "kvc-v2")] {
        let out = dir.join(format!("{topology}-{policy}"));
        let stdout = ok(bin()
            .args([
                "sim",
                "--quiet",
                "--topology",
                topology,
                "--policy",
                policy,
                "--trace",
            ])
            .arg(&trace)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap());
        assert!(stdout.contains("TTFT p50 (s)"), "{stdout}");
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap())
                .unwrap();
        for key in [
            "requests",
            "outcomes",
            "mechanism_errors",
            "ttft_s",
            "latency_s",
            "wait_s",
            "direct_to_d_rate",
            "modes",
            "workers",
            "worker_spread",
            "sessions",
            "config",
            "sim_wall_s",
        ] {
            assert!(summary.get(key).is_some(), "summary.json lacks {key}");
        }
        assert_eq!(summary["config"]["topology"], topology);
        assert_eq!(summary["config"]["policy"], policy);
        let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        assert_eq!(
            lines.lines().count() as u64,
            summary["requests"].as_u64().unwrap()
        );
        assert!(
            std::fs::read_to_string(out.join("occupancy.csv"))
                .unwrap()
                .starts_with("time_s,")
        );
        runs.push(out);
    }
    let table = ok(bin().arg("compare").args(&runs).output().unwrap());
    assert!(table.contains("| TTFT p99 (s) |"), "{table}");
    assert!(table.contains('%'), "deltas against the first run: {table}");
    assert!(
        table.contains("| 1p2d+kvc-v2 ts1 | direct-to-d |"),
        "{table}"
    );
    let report_dir = dir.join("report");
    ok(bin()
        .arg("report")
        .args(&runs)
        .arg("--out")
        .arg(&report_dir)
        .output()
        .unwrap());
    let md = std::fs::read_to_string(report_dir.join("report.md")).unwrap();
    for svg in [
        "ttft_cdf.svg",
        "latency_cdf.svg",
        "modes.svg",
        "occupancy_0.svg",
        "occupancy_1.svg",
    ] {
        assert!(md.contains(svg), "report.md does not show {svg}");
        let text = std::fs::read_to_string(report_dir.join(svg)).unwrap();
        assert!(
            text.starts_with("<svg") && text.trim_end().ends_with("</svg>"),
            "{svg}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_options_fail_with_a_clear_message() {
    let dir = tmp("bad");
    let trace = gen_trace(&dir);
    let run = |args: &[&str]| {
        let out = bin()
            .arg("sim")
            .arg("--trace")
            .arg(&trace)
            .args(args)
            .arg("--out")
            .arg(dir.join("x"))
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(run(&["--policy", "no-such"]).contains("no-such"));
    assert!(run(&["--topology", "1x"]).contains("invalid topology"));
    assert!(
        run(&["--policy", "kvc-v2", "--knob", "no_such_knob=1"]).contains("no knob `no_such_knob`")
    );
    assert!(run(&["--knob", "oops"]).contains("KEY=VALUE"));
    assert!(run(&["--time-scale", "0"]).contains("time-scale"));
    assert!(run(&["--local-prefill", "maybe"]).contains("expected on or off"));
    let too_many = run(&["--topology", "1024p3073d-hybrid"]);
    assert!(
        too_many.contains("4097 workers") && too_many.contains("at most 4096"),
        "{too_many}"
    );
    let no_worker = run(&["--drain", "d7@10"]);
    assert!(
        no_worker.contains("no worker `d7`") && no_worker.contains("p0, d0, d1, d2"),
        "{no_worker}"
    );
    assert!(run(&["--drain", "d0"]).contains("WORKER@SECONDS"));
    assert!(run(&["--drain", "d0@soon"]).contains("`soon` is not a number of seconds"));
    assert!(run(&["--drain", "p0@10"]).contains("p0 is a prefill worker"));
    assert!(
        !dir.join("x").join("metrics.jsonl").exists(),
        "nothing is written for a run refused at start"
    );
    let missing = bin()
        .args(["compare", "/nonexistent-run-dir"])
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("summary.json"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn knobs_reach_the_policy() {
    let dir = tmp("knob");
    let trace = gen_trace(&dir);
    let out = dir.join("r");
    ok(bin()
        .args([
            "sim",
            "--quiet",
            "--topology",
            "1p2d",
            "--policy",
            "kvc-v2",
            "--knob",
            "direct-limit-tokens=1024",
            "--trace",
        ])
        .arg(&trace)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap());
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["config"]["policy_config"]["direct-limit-tokens"], 1024);
    assert_eq!(s["config"]["local_prefill"], true);
    assert!(s.get("drains").is_none(), "no drain, no drains block");
    // A drain: its block says what became of the sessions the worker held.
    let drained = dir.join("drained");
    ok(bin()
        .args(["sim", "--quiet", "--topology", "1p2d", "--drain", "d1@30"])
        .arg("--trace")
        .arg(&trace)
        .arg("--out")
        .arg(&drained)
        .output()
        .unwrap());
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(drained.join("summary.json")).unwrap())
            .unwrap();
    let d = &s["drains"][0];
    assert_eq!(
        (d["worker"].as_str(), d["at_s"].as_f64()),
        (Some("d1"), Some(30.0))
    );
    let returned = d["returned"].as_u64().unwrap();
    let modes: u64 = d["next_turn_modes"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(modes, returned, "{d}");
    assert!(returned <= d["sessions"].as_u64().unwrap(), "{d}");
    // Engines that cannot serve turns alone, on an all-capable shape: kvc plans no local turn.
    let off = dir.join("off");
    ok(bin()
        .args([
            "sim",
            "--quiet",
            "--topology",
            "4x",
            "--local-prefill",
            "off",
        ])
        .arg("--trace")
        .arg(&trace)
        .arg("--out")
        .arg(&off)
        .output()
        .unwrap());
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(off.join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["config"]["local_prefill"], false);
    assert_eq!(s["config"]["topology"], "4x");
    assert!(s["modes"].get("local-prefill").is_none(), "{}", s["modes"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn demo_runs_the_reference_configurations_and_kvc() {
    let dir = tmp("demo");
    let stdout = ok(bin()
        .args(["demo", "--quiet", "--sessions", "4", "--out"])
        .arg(&dir)
        .output()
        .unwrap());
    // The table's header names the runs in order: `| metric | 4dp+cache-aware ts1 | … |`.
    let header = stdout.lines().next().unwrap_or_default();
    let runs: Vec<&str> = header
        .split('|')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .skip(1)
        .collect();
    assert_eq!(
        runs,
        [
            "4dp+cache-aware ts1",
            "1p3d+kv-aware-v0 ts1",
            "1p3d+kvc-v2 ts1",
            "1p3d+kvc ts1",
            "1p3d-hybrid+kvc ts1"
        ],
        "{stdout}"
    );
    assert!(dir.join("report/report.md").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn policies_lists_every_policy_with_knobs() {
    let out = ok(bin().arg("policies").output().unwrap());
    for name in ["round-robin", "cache-aware", "kv-aware-v0", "kvc-v2", "kvc"] {
        assert!(out.lines().any(|l| l == name), "{out}");
    }
    assert!(out.contains("direct-limit-tokens = 8192"), "{out}");
}
