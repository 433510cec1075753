//! `kvc-replay sim` reading the trace as it goes: the same bytes as the run over the whole
//! trace, every request recorded once, and a trace it cannot stream loaded whole (or its
//! malformed line reported, with its line number).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvc-replay"))
}

fn ok(out: Output) -> Output {
    assert!(
        out.status.success(),
        "failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvc-sim-stream-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn gen_trace(dir: &Path, sessions: &str, seed: &str) -> PathBuf {
    let t = dir.join(format!("t-{sessions}-{seed}.jsonl"));
    ok(bin()
        .args([
            "gen",
            "swe",
            "--seed",
            seed,
            "--sessions",
            sessions,
            "--quiet",
        ])
        .arg("--out")
        .arg(&t)
        .output()
        .unwrap());
    t
}

/// Runs `sim` on `trace` with `extra` options into `out`; returns its stderr.
fn sim(trace: &Path, out: &Path, extra: &[&str]) -> String {
    let o = ok(bin()
        .args(["sim", "--quiet", "--trace"])
        .arg(trace)
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .unwrap());
    String::from_utf8(o.stderr).unwrap()
}

/// The files of a run directory, `summary.json` without its wall-time line.
fn run_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let bytes = std::fs::read(dir.join(&n)).unwrap();
            let bytes = if n == "summary.json" {
                String::from_utf8(bytes)
                    .unwrap()
                    .lines()
                    .filter(|l| !l.contains("\"sim_wall_s\""))
                    .collect::<Vec<_>>()
                    .join("\n")
                    .into_bytes()
            } else {
                bytes
            };
            (n, bytes)
        })
        .collect()
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).unwrap().lines().count()
}

#[test]
fn streamed_runs_write_the_bytes_of_whole_trace_runs() {
    let dir = tmp("same");
    let swe = gen_trace(&dir, "12", "4");
    let mooncake = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/traces/synthetic_trace.jsonl"
    ));
    let mut cases: Vec<(&Path, Vec<&str>)> = vec![
        (&swe, vec!["--topology", "1p3d"]),
        (
            &swe,
            vec!["--topology", "2p6d-hybrid", "--time-scale", "10"],
        ),
        (&swe, vec!["--topology", "4dp", "--policy", "cache-aware"]),
        (
            &swe,
            vec!["--topology", "3x", "--concurrency", "4", "--seed", "3"],
        ),
    ];
    if mooncake.exists() {
        cases.push((mooncake, vec!["--topology", "2p6d", "--infer-sessions"]));
        cases.push((
            mooncake,
            vec!["--topology", "1p3d", "--policy", "kv-aware-v0"],
        ));
    }
    for (k, (trace, opts)) in cases.iter().enumerate() {
        let streamed = dir.join(format!("stream-{k}"));
        let whole = dir.join(format!("whole-{k}"));
        sim(trace, &streamed, opts);
        let mut whole_opts = opts.clone();
        whole_opts.push("--in-memory");
        sim(trace, &whole, &whole_opts);
        let (a, b) = (run_files(&streamed), run_files(&whole));
        assert_eq!(
            a.iter().map(|f| &f.0).collect::<Vec<_>>(),
            [
                "committed.csv",
                "metrics.jsonl",
                "occupancy.csv",
                "summary.json"
            ],
            "{opts:?}"
        );
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            assert!(x == y, "{name} differs for {opts:?}");
        }
        // Every trace line has its record, in trace order.
        let records = std::fs::read_to_string(streamed.join("metrics.jsonl")).unwrap();
        assert_eq!(records.lines().count(), lines(trace), "{opts:?}");
        for (i, line) in records.lines().enumerate() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["index"].as_u64(), Some(i as u64));
        }
    }
}

#[test]
fn an_unsorted_trace_is_loaded_whole_with_the_same_outputs() {
    let dir = tmp("unsorted");
    let swe = gen_trace(&dir, "4", "6");
    // Two lines swapped: the trace is not in time order past line 40.
    let text = std::fs::read_to_string(&swe).unwrap();
    let mut rows: Vec<&str> = text.lines().collect();
    let at = rows
        .windows(2)
        .skip(39)
        .position(|w| {
            let ts = |l: &str| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["timestamp"]
                    .as_u64()
                    .unwrap()
            };
            ts(w[0]) < ts(w[1])
        })
        .unwrap()
        + 39;
    rows.swap(at, at + 1);
    let unsorted = dir.join("unsorted.jsonl");
    std::fs::write(&unsorted, rows.join("\n") + "\n").unwrap();
    let stderr = sim(&unsorted, &dir.join("a"), &["--topology", "1p3d"]);
    assert!(
        stderr.contains(&format!("unsorted.jsonl:{}: timestamp", at + 2))
            && stderr.contains("not sorted by time); loading the whole trace"),
        "{stderr}"
    );
    sim(
        &unsorted,
        &dir.join("b"),
        &["--topology", "1p3d", "--in-memory"],
    );
    assert!(run_files(&dir.join("a")) == run_files(&dir.join("b")));
    assert_eq!(lines(&dir.join("a/metrics.jsonl")), rows.len());
}

#[test]
fn a_malformed_line_is_reported_with_its_line_or_skipped() {
    let dir = tmp("malformed");
    let swe = gen_trace(&dir, "3", "8");
    let text = std::fs::read_to_string(&swe).unwrap();
    let mut rows: Vec<String> = text.lines().map(str::to_owned).collect();
    rows[99] = rows[99].replace("\"input_length\":", "\"input_length\":-");
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, rows.join("\n") + "\n").unwrap();
    for extra in [&[][..], &["--in-memory"][..]] {
        let out = bin()
            .args(["sim", "--quiet", "--topology", "1p3d", "--trace"])
            .arg(&bad)
            .arg("--out")
            .arg(dir.join("run"))
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("cannot load trace")
                && stderr.contains(
                    "bad.jsonl:100: field `input_length`: expected a non-negative integer"
                ),
            "{extra:?}: {stderr}"
        );
    }
    // Skipped, it is counted and every other line gets its record.
    let stderr = sim(
        &bad,
        &dir.join("skipped"),
        &["--topology", "1p3d", "--skip-invalid"],
    );
    assert!(
        stderr.contains("skipped 1 invalid line(s)") && stderr.contains("bad.jsonl:100:"),
        "{stderr}"
    );
    assert_eq!(lines(&dir.join("skipped/metrics.jsonl")), rows.len() - 1);
    sim(
        &bad,
        &dir.join("skipped-whole"),
        &["--topology", "1p3d", "--skip-invalid", "--in-memory"],
    );
    assert!(run_files(&dir.join("skipped")) == run_files(&dir.join("skipped-whole")));
}
