//! The `kvc-replay` binary: `gen swe` and `stats`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvc-replay"))
}

fn tmp(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("trace_cli");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn gen_swe(seed: u64, path: &Path) -> Vec<u8> {
    run(bin()
        .args([
            "gen",
            "swe",
            "--quiet",
            "--seed",
            &seed.to_string(),
            "--out",
        ])
        .arg(path));
    std::fs::read(path).unwrap()
}

#[test]
fn gen_is_byte_identical_for_a_seed_and_differs_across_seeds() {
    let a = gen_swe(7, &tmp("a.jsonl"));
    let b = gen_swe(7, &tmp("b.jsonl"));
    let c = gen_swe(8, &tmp("c.jsonl"));
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(a.iter().filter(|&&x| x == b'\n').count(), 4_449);
    // `--out -` writes the same bytes to stdout.
    let out = run(bin().args(["gen", "swe", "--seed", "7", "--out", "-", "-q"]));
    assert_eq!(out.stdout, a);
    assert!(out.stderr.is_empty());
}

#[test]
fn stats_json_has_the_documented_keys() {
    let path = tmp("stats.jsonl");
    gen_swe(7, &path);
    let out = run(bin().arg("stats").arg(&path).args(["--json", "--quiet"]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    let mut expected = vec![
        "requests",
        "sessions",
        "sessions_multi_turn",
        "turns_per_session",
        "input_tokens",
        "output_tokens",
        "session_peak_input",
        "append",
        "gap_s",
        "span_s",
        "limit",
        "over_limit",
        "over_limit_sessions",
        "subagents",
        "compactions",
        "ends",
        "block_size",
    ];
    let mut got = keys.clone();
    got.sort_unstable();
    expected.sort_unstable();
    assert_eq!(got, expected);
    let nested = [
        ("turns_per_session", &["mean", "min", "max"][..]),
        ("input_tokens", &["p50", "p90", "max"]),
        ("output_tokens", &["p50", "p90", "p99"]),
        ("session_peak_input", &["mean", "max"]),
        ("append", &["up_to_2048", "2049_to_8192", "over_8192"]),
        ("gap_s", &["p10", "p50", "p90", "max"]),
        (
            "subagents",
            &[
                "explicit",
                "explicit_parents",
                "inferred",
                "inferred_parents",
                "common_blocks",
                "share",
            ],
        ),
        (
            "compactions",
            &["count", "share", "diverging", "diverging_share", "turns"],
        ),
        ("ends", &["count", "share", "final_not_last"]),
    ];
    for (key, subkeys) in nested {
        for sub in subkeys {
            assert!(v[key][sub].is_number(), "{key}.{sub} missing in {v}");
        }
    }
    assert_eq!(v["requests"], 4_449);
    assert_eq!(v["limit"], 92_098);
    // --limit changes the count.
    let out = run(bin()
        .arg("stats")
        .arg(&path)
        .args(["--json", "-q", "--limit", "1000000"]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["over_limit"], 0);
    // Every key is documented in --help.
    let help = run(bin().args(["stats", "--help"]));
    let help = String::from_utf8(help.stdout).unwrap();
    for key in keys {
        assert!(help.contains(key), "--help does not document {key}");
    }
    for (key, subkeys) in nested {
        for sub in subkeys {
            assert!(help.contains(sub), "--help does not document {key}.{sub}");
        }
    }
    assert!(help.contains("Inferred subagents:"), "{help}");
    for option in [
        "--infer-sessions",
        "--skip-invalid",
        "--limit",
        "--json",
        "--quiet",
    ] {
        assert!(help.contains(option), "--help lacks {option}");
    }
}

#[test]
fn stats_table_is_readable() {
    let path = tmp("table.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}\n",
    )
    .unwrap();
    let out = run(bin().arg("stats").arg(&path));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("requests               1\n"), "{text}");
    assert!(
        text.contains("over 92098 tokens      0 (sessions: none)"),
        "{text}"
    );
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("loaded 1 requests in 1 sessions"), "{err}");
}

#[test]
fn malformed_file_fails_naming_file_and_line() {
    let path = tmp("bad.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\
         \n\
         {\"timestamp\": 1, \"input_length\": \"many\", \"output_length\": 5, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let out = bin().arg("stats").arg(&path).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    let want = format!("{}:3: field `input_length`", path.display());
    assert!(err.contains(&want), "{err}");
    assert!(out.stdout.is_empty());

    // --skip-invalid goes on and says how many lines it skipped.
    let out = run(bin()
        .arg("stats")
        .arg(&path)
        .args(["--skip-invalid", "--json", "-q"]));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("skipped 1 invalid line(s)"), "{err}");
    assert!(err.contains(&want), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 1);
}

#[test]
fn missing_file_fails_naming_it() {
    let out = bin()
        .args(["stats", "/nonexistent/trace.jsonl"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("/nonexistent/trace.jsonl"), "{err}");
}

#[test]
fn stats_infers_sessions_on_request() {
    let path = tmp("infer.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [1, 2, 3]}\n\
         {\"timestamp\": 9, \"input_length\": 1600, \"output_length\": 5, \"hash_ids\": [1, 2, 4, 5]}\n",
    )
    .unwrap();
    let sessions = |extra: &[&str]| {
        let out = run(bin()
            .arg("stats")
            .arg(&path)
            .args(["--json", "-q"])
            .args(extra));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["sessions"].as_u64().unwrap()
    };
    assert_eq!(sessions(&[]), 2);
    assert_eq!(sessions(&["--infer-sessions"]), 1);
}

#[test]
fn gen_agentic_adds_children_compactions_and_ends_and_stats_reports_them() {
    let path = tmp("agentic.jsonl");
    let gen_agentic = |extra: &[&str]| {
        run(bin()
            .args(["gen", "swe", "--seed", "1", "--agentic", "--out", "-", "-q"])
            .args(extra))
        .stdout
    };
    let a = gen_agentic(&[]);
    assert_eq!(gen_agentic(&[]), a);
    std::fs::write(&path, &a).unwrap();
    // The preset is the three options.
    let explicit = run(bin().args([
        "gen",
        "swe",
        "--seed",
        "1",
        "--subagents",
        "0.3",
        "--compactions",
        "0.5",
        "--ends",
        "0.8",
        "--out",
        "-",
        "-q",
    ]));
    assert_eq!(explicit.stdout, a);
    // An explicit option overrides the preset: no subagents, the rest as before.
    let no_children = gen_agentic(&["--subagents", "0"]);
    let text = String::from_utf8(no_children).unwrap();
    assert!(!text.contains("parent_session_id"));
    assert!(text.contains("\"final\":true"));

    let out = run(bin().arg("stats").arg(&path).args(["--json", "-q"]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let children = v["subagents"]["explicit"].as_u64().unwrap();
    assert!((16..=48).contains(&children), "{children}");
    assert_eq!(v["subagents"]["explicit_parents"], 16);
    assert_eq!(v["sessions"], 52 + children);
    assert!(v["compactions"]["count"].as_u64().unwrap() >= 8, "{v}");
    assert!(v["ends"]["count"].as_u64().unwrap() >= 42, "{v}");
    let table = run(bin().arg("stats").arg(&path).arg("-q"));
    let table = String::from_utf8(table.stdout).unwrap();
    for line in ["subagent sessions ", "compactions ", "explicit ends "] {
        assert!(table.contains(line), "{table}");
    }

    // A share outside 0–1 is refused, naming the option.
    let bad = bin()
        .args(["gen", "swe", "--seed", "1", "--ends", "1.5", "--out", "-"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8(bad.stderr).unwrap();
    assert!(
        err.contains("--ends") && err.contains("expected a fraction from 0 to 1"),
        "{err}"
    );
}
