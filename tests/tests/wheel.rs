//! The kvc-router wheel (`scripts/wheel/build.sh`) installed as a user installs it: pip puts
//! it into a fresh venv, `kvc-router` and `kvc-replay` answer `--version` from the venv's
//! `bin/` found on PATH, and the installed router serves a chat to the installed simulated
//! workers: the first turn through the prefill worker, the later ones direct to the decode
//! worker with what the earlier turns left there reported cached.
//!
//! The wheel is built from the debug build (`build.sh --debug`: the binaries `cargo test`
//! has made, packaged as they are), or taken from `KVC_WHEEL` (a wheel built before, e.g. the
//! release one). Skipped with a notice only where python3 is absent (`build.sh` exits 3).
#![forbid(unsafe_code)]

mod common;

use common::http::{Answer, post};
use common::{Guard, free_port, http_get, wait_for_ready_file};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace root")
        .to_path_buf()
}

/// Runs `cmd`, panicking with its output unless it succeeds.
fn run_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The wheel to install: `KVC_WHEEL`, else one built from the debug build into `dir`; `None`
/// where python3 is absent.
fn wheel(dir: &Path) -> Option<PathBuf> {
    if let Some(w) = std::env::var_os("KVC_WHEEL") {
        return Some(w.into());
    }
    let out = Command::new("bash")
        .arg(root().join("scripts/wheel/build.sh"))
        .args(["--debug", "--out"])
        .arg(dir)
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/wheel/build.sh");
    if out.status.code() == Some(3) {
        return None;
    }
    assert!(out.status.success(), "building the wheel failed");
    let stdout = String::from_utf8(out.stdout).unwrap();
    Some(stdout.lines().last().expect("the wheel's path").into())
}

/// One chat turn of `session` through the router at `http`: the answer.
fn turn(http: &str, session: &str, messages: &[Value], stream: bool) -> Answer {
    let mut body = json!({"model": "sim", "messages": messages, "max_tokens": 8,
        "stream": stream});
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    let a = post(
        http,
        "/v1/chat/completions",
        &[("x-session-id", session)],
        &body.to_string(),
    );
    assert_eq!(a.status, 200, "{}", a.body);
    a
}

/// The answer's text and its usage (a whole answer, or a stream's chunks and usage chunk).
fn text_and_usage(a: &Answer, stream: bool) -> (String, Value) {
    if !stream {
        let v = a.json();
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        return (text.to_owned(), v["usage"].clone());
    }
    let events = a.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        a.body
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let usage = chunks
        .iter()
        .find(|c| c["choices"].as_array().is_some_and(Vec::is_empty))
        .map(|c| c["usage"].clone())
        .expect("a usage chunk");
    (text, usage)
}

#[test]
fn the_installed_wheel_routes_a_chat_direct_to_d_after_its_first_turn() {
    let dir = std::env::temp_dir().join(format!("kvc-wheel-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let Some(wheel) = wheel(&dir) else {
        eprintln!("python3 not found: the wheel test is skipped");
        return;
    };
    let version = common::kvc_router_version();
    let name = wheel.file_name().unwrap().to_str().unwrap().to_owned();
    assert!(
        name.starts_with(&format!("kvc_router-{version}-py3-none-")) && name.ends_with(".whl"),
        "{name}"
    );

    // A fresh venv, the wheel installed by pip from the file alone (it depends on nothing).
    let venv = dir.join("venv");
    run_ok(
        Command::new("python3").args(["-m", "venv"]).arg(&venv),
        "python3 -m venv",
    );
    run_ok(
        Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .args(["--no-index", "--no-deps"])
            .arg(&wheel),
        "pip install",
    );
    let show = run_ok(
        Command::new(venv.join("bin/pip")).args(["show", "kvc-router"]),
        "pip show",
    );
    let show = String::from_utf8(show.stdout).unwrap();
    assert!(show.contains(&format!("Version: {version}\n")), "{show}");

    // Both binaries on PATH from the venv's bin/, as an activated venv has them.
    let bin = venv.join("bin");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for binary in ["kvc-router", "kvc-replay"] {
        let found = run_ok(
            Command::new("sh")
                .args(["-c", &format!("command -v {binary}")])
                .env("PATH", &path),
            "command -v",
        );
        assert_eq!(
            String::from_utf8(found.stdout).unwrap().trim(),
            bin.join(binary).to_str().unwrap()
        );
        let out = run_ok(
            Command::new(binary).arg("--version").env("PATH", &path),
            binary,
        );
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            format!("{binary} {version}\n")
        );
    }

    // The installed kvc-replay's simulated workers (one prefill, one decode, each held to its
    // role, each able to serve a turn alone and publishing KV-cache events, as vLLM
    // instances do).
    let ready = dir.join("ready.json");
    let mut workers = Guard(
        Command::new("kvc-replay")
            .env("PATH", &path)
            .args(["workers", "--topology", "1p1d"])
            .args(["--speedup", "20", "--duration-s", "300", "--kv-events"])
            .arg("--snapshot-dir")
            .arg(dir.join("snap"))
            .arg("--ready-file")
            .arg(&ready)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for_ready_file(&mut workers.0, &ready);
    let ready: Value = serde_json::from_str(&std::fs::read_to_string(&ready).unwrap()).unwrap();
    let url = |role: &str| common::ready_worker_url(&ready, role);

    // The installed router, started in one line from the workers' URLs (the rest read from
    // the engines).
    let port = free_port();
    let http = format!("127.0.0.1:{port}");
    let mut router = Guard(
        Command::new("kvc-router")
            .env("PATH", &path)
            .args(["--prefill", &url("prefill"), "--decode", &url("decode")])
            .args(["--port", &port.to_string()])
            .args(["--listen", "127.0.0.1:0", "--no-metrics", "--log", "warn"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    // Ready once its workers are in rotation (their pools read from the engines).
    while !(std::net::TcpStream::connect(&http).is_ok()
        && http_get(&http, "/readyz").starts_with("HTTP/1.1 200"))
    {
        assert!(router.0.try_wait().unwrap().is_none(), "the router stopped");
        assert!(Instant::now() < deadline, "the router never became ready");
        std::thread::sleep(Duration::from_millis(100));
    }

    // Three turns of one conversation, the last one streamed.
    let mut messages = vec![json!({"role": "system", "content":
        "You are a careful assistant who answers questions about software engineering, \
         explains each step of the reasoning and keeps every answer short enough to read \
         in one minute."})];
    let mut seen = Vec::new();
    for (t, stream) in [(1, false), (2, false), (3, true)] {
        messages.push(json!({"role": "user", "content":
            format!("Question {t}: which module parses the configuration file, and what \
                     happens when a key is missing or has the wrong type there?")}));
        let a = turn(&http, "wheel-chat", &messages, stream);
        let (text, usage) = text_and_usage(&a, stream);
        assert_eq!(text.split_whitespace().count(), 8, "turn {t}: {text:?}");
        assert_eq!(usage["completion_tokens"], 8, "turn {t}: {usage}");
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        seen.push((
            a.header("x-kvc-mode").to_owned(),
            a.header("x-kvc-decode-worker").to_owned(),
            cached,
        ));
        messages.push(json!({"role": "assistant", "content": text}));
    }
    // A vLLM instance serves a turn alone: the short first turn is prefilled on the decode
    // worker itself, which then holds the session for the later turns.
    let modes: Vec<&str> = seen.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(
        modes,
        ["local-prefill", "direct-to-d", "direct-to-d"],
        "{seen:?}"
    );
    assert!(seen.iter().all(|s| s.1 == seen[0].1), "{seen:?}");
    // Turn 1's prompt was new; each later turn finds the earlier turns' tokens on D.
    assert_eq!(seen[0].2, 0, "{seen:?}");
    assert!(
        seen[1].2 >= 32 && seen[2].2 > seen[1].2,
        "cached tokens by turn: {seen:?}"
    );

    drop(router);
    drop(workers);
    let _ = std::fs::remove_dir_all(&dir);
}
