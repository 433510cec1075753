//! The `kvc-router` binary as operators run it, each process on loopback beside simulated vLLM
//! workers (`kvc-replay workers`, which answer `/metrics`, `/kv_event_sources`, `/v1/models`
//! and `/server_info` on their own HTTP port as vLLM does): started in one line from the
//! workers' URLs alone, a chat's later turns go direct to the decode worker; `kvc-router
//! check` prints what each engine says and exits 0 on a good setup, 1 on a worker without KV
//! events or out of reach, 2 on a configuration that does not load; logs written to a pipe carry
//! no colour codes and, as JSON, parse line by line; bad flag values are named.
#![forbid(unsafe_code)]

mod common;

use common::http::post;
use common::{Guard, bin_dir, free_port, http_get, wait_for_ready_file};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A scratch directory of this test process, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvc-router-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Simulated vLLM workers of a 1P1D cluster (publishing KV events with `kv_events`): the
/// process, and the prefill and decode workers' URLs.
fn start_workers(dir: &Path, kv_events: bool) -> (Guard, String, String) {
    let ready = dir.join("ready.json");
    let mut cmd = Command::new(bin_dir().join("kvc-replay"));
    cmd.args(["workers", "--topology", "1p1d", "--speedup", "20"])
        .args(["--duration-s", "300"])
        .arg("--snapshot-dir")
        .arg(dir.join("snap"))
        .arg("--ready-file")
        .arg(&ready)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if kv_events {
        cmd.arg("--kv-events");
    }
    let mut workers = Guard(cmd.spawn().unwrap());
    wait_for_ready_file(&mut workers.0, &ready);
    let ready: Value = serde_json::from_str(&std::fs::read_to_string(&ready).unwrap()).unwrap();
    let url = |role: &str| common::ready_worker_url(&ready, role);
    let (p, d) = (url("prefill"), url("decode"));
    (workers, p, d)
}

/// Runs `kvc-router` with `args` to its end (a check, or a start that fails).
fn router(args: &[&str]) -> Output {
    Command::new(bin_dir().join("kvc-router"))
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Starts `kvc-router` with `args`, its log written to `log`: the process and the
/// `http=` address it printed once bound.
fn serve(args: &[&str], log: &Path) -> (Guard, String) {
    let mut child = Command::new(bin_dir().join("kvc-router"))
        .args(args)
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let guard = Guard(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the router prints its addresses");
    let http = line
        .split_whitespace()
        .find_map(|f| f.strip_prefix("http="))
        .unwrap_or_else(|| panic!("no http= in {line:?}"))
        .to_owned();
    (guard, http)
}

/// Waits (at most 30 s) until the router at `http` answers its readiness probe with 200.
fn wait_ready(http: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http_get(http, "/readyz").starts_with("HTTP/1.1 200") {
        assert!(Instant::now() < deadline, "the router never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends SIGTERM to the router and waits (at most 10 s) for it to end.
fn stop(mut router: Guard) {
    let _ = Command::new("kill")
        .args(["-TERM", &router.0.id().to_string()])
        .status();
    let status = common::wait_within(&mut router.0, Duration::from_secs(10), "the router");
    assert!(status.success(), "{status:?}");
    // Ended and waited for: nothing left for the guard to stop.
    std::mem::forget(router);
}

#[test]
fn one_line_start_serves_a_chat_whose_later_turns_go_direct_to_d() {
    let dir = Scratch::new("start");
    let (_workers, p, d) = start_workers(&dir.0, true);
    let log = dir.0.join("router.log");
    let (router, http) = serve(&["--prefill", &p, "--decode", &d, "--port", "0"], &log);
    wait_ready(&http);
    let mut messages = vec![json!({"role": "system", "content":
        "You are a careful assistant who answers questions about software engineering, \
         explains each step of the reasoning and keeps every answer short."})];
    let mut turns = Vec::new();
    for t in 0..3 {
        messages.push(json!({"role": "user", "content":
            format!("Question {t}: which module parses the configuration file, and what \
                     happens when a key is missing there?")}));
        let body = json!({"model": "m", "messages": messages, "max_tokens": 8});
        let a = post(
            &http,
            "/v1/chat/completions",
            &[("x-session-id", "cli-chat")],
            &body.to_string(),
        );
        assert_eq!(a.status, 200, "turn {t}: {}", a.body);
        let v = a.json();
        messages.push(v["choices"][0]["message"].clone());
        turns.push((
            a.header("x-kvc-mode").to_owned(),
            a.header("x-kvc-decode-worker").to_owned(),
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        ));
    }
    // The later turns go straight to the worker that holds the session, which serves what
    // the earlier turns left there from its cache.
    for later in &turns[1..] {
        assert_eq!(later.0, "direct-to-d", "{turns:?}");
        assert_eq!(later.1, turns[0].1, "{turns:?}");
    }
    assert!(0 < turns[1].2 && turns[1].2 < turns[2].2, "{turns:?}");
    stop(router);
    let log = std::fs::read(&log).unwrap();
    let log = text(&log);
    assert!(
        log.contains("kv-events: source read from the engine"),
        "{log}"
    );
    assert!(
        !log.contains("\x1b["),
        "colour codes in a log that is a file:\n{log}"
    );
}

#[test]
fn check_prints_what_each_engine_says_and_exits_by_what_it_found() {
    let dir = Scratch::new("check");
    let (_with_events, p, d) = start_workers(&dir.0.join("events"), true);
    let (_without, _, d_silent) = start_workers(&dir.0.join("silent"), false);

    // A good setup: every fact, no problem, 0.
    let out = router(&["check", "--prefill", &p, "--decode", &d]);
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", text(&out.stderr));
    let metrics = http_get(d.trim_start_matches("http://"), "/metrics");
    let label = |name: &str| -> u64 {
        let at = metrics.find(&format!("{name}=\"")).expect(name) + name.len() + 2;
        metrics[at..].split('"').next().unwrap().parse().unwrap()
    };
    let (blocks, block_size) = (label("num_gpu_blocks"), label("block_size"));
    assert_eq!(block_size, 16);
    let lines: Vec<&str> = said.lines().collect();
    let fact = |worker: &str, what: &str| -> String {
        let start = lines.iter().position(|l| l.starts_with(worker)).unwrap();
        lines[start + 1..]
            .iter()
            .take_while(|l| l.starts_with("  "))
            .find_map(|l| l.trim().strip_prefix(what))
            .unwrap_or_else(|| panic!("{worker} has no {what}:\n{said}"))
            .trim()
            .to_owned()
    };
    assert!(
        lines[0].starts_with("kvc-router check: the configuration loads"),
        "{said}"
    );
    for worker in ["p0 (prefill, vllm)", "d0 (decode, vllm)"] {
        assert_eq!(
            fact(worker, "KV pool"),
            format!(
                "{blocks} blocks of {block_size} tokens ({} tokens)",
                blocks * block_size
            )
        );
        assert_eq!(fact(worker, "prefix caching"), "on");
        assert!(
            fact(worker, "KV events").contains("from GET /kv_event_sources"),
            "{said}"
        );
        assert!(
            fact(worker, "event replay").starts_with("tcp://127.0.0.1:"),
            "{said}"
        );
        assert!(
            fact(worker, "cached tokens").starts_with("reported"),
            "{said}"
        );
        assert!(!fact(worker, "model").is_empty());
    }
    assert_eq!(
        fact("d0 (decode, vllm)", "P/D role"),
        "disaggregation_mode decode"
    );
    assert!(
        said.ends_with("2 worker(s) checked: 0 problem(s), 0 warning(s)\n"),
        "{said}"
    );

    // A decode engine started without KV events: a problem naming the fix, 1.
    let out = router(&["check", "--prefill", &p, "--decode", &d_silent]);
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("problem: d0: no KV events: "), "{said}");
    assert!(said.contains("--kv-events-config"), "{said}");
    assert!(!said.contains("problem: p0"), "{said}");

    // An address where no engine answers: unreachable, 1.
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    let out = router(&["check", "--prefill", &p, "--decode", &nowhere]);
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains(&format!(
            "problem: d0: unreachable: GET {nowhere}/v1/models"
        )),
        "{said}"
    );

    // A configuration file that does not load: 2, naming the file and the key.
    let file = dir.0.join("broken-router.toml");
    std::fs::write(
        &file,
        "[[workers]]\nid = 0\nrole = \"decode\"\ncapcity-tokens = 5\n",
    )
    .unwrap();
    let out = router(&["check", "--config", file.to_str().unwrap()]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(out.stdout.is_empty());
    assert!(
        err.contains("broken-router.toml") && err.contains("capcity-tokens"),
        "{err}"
    );
    // A file whose worker a flag names again: 2, naming the URL.
    std::fs::write(
        &file,
        format!("[[workers]]\nid = 0\nrole = \"decode\"\nengine = \"vllm\"\nhttp-url = \"{d}\"\n"),
    )
    .unwrap();
    let out = router(&[
        "check",
        "--config",
        file.to_str().unwrap(),
        "--prefill",
        &p,
        "--decode",
        &d,
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("--decode `{d}`: this URL is already worker `w0`")),
        "{err}"
    );
    // The file's workers first, the flags' after them: a loading pair.
    let out = router(&["check", "--config", file.to_str().unwrap(), "--prefill", &p]);
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(
        said.contains("\nw0 (decode, vllm) ") && said.contains("\np0 (prefill, vllm) "),
        "{said}"
    );
}

#[test]
fn logs_carry_no_colour_codes_off_a_terminal_and_json_lines_parse() {
    let dir = Scratch::new("logs");
    for format in ["text", "json"] {
        let log = dir.0.join(format!("{format}.log"));
        let (router, _) = serve(
            &["--log-format", format, "--port", "0", "--log", "debug"],
            &log,
        );
        stop(router);
        let log = text(&std::fs::read(&log).unwrap());
        assert!(log.lines().count() >= 2, "{log}");
        assert!(
            !log.contains("\x1b["),
            "colour codes in a {format} log:\n{log}"
        );
        if format == "json" {
            for line in log.lines() {
                let v: Value =
                    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                assert!(v["level"].is_string() && v["target"].is_string(), "{line}");
                assert!(
                    v["timestamp"].is_string() && v["fields"].is_object(),
                    "{line}"
                );
            }
            assert!(log.contains("\"message\":\"kvc-router serving\""), "{log}");
        } else {
            assert!(
                log.contains(" INFO kvc_router::server: kvc-router serving"),
                "{log}"
            );
        }
    }
}

#[test]
fn bad_flag_values_are_named_with_their_flag() {
    for (args, code, says) in [
        (
            &["--prefill", "10.0.0.1:8000"][..],
            2,
            "'10.0.0.1:8000' for '--prefill <URL>': not a worker URL",
        ),
        (
            &["--worker", "http://h:1", "--port", "70000"],
            2,
            "'70000' for '--port <PORT>'",
        ),
        (
            &["--worker", "http://h:1", "--host", "example"],
            2,
            "'example' for '--host <ADDR>'",
        ),
        (
            &["--worker", "http://h:1", "--engine", "tgi"],
            2,
            "unknown engine `tgi`",
        ),
        (
            &["--port", "1", "--http-listen", "127.0.0.1:1"],
            2,
            "'--port <PORT>' cannot be used with '--http-listen <ADDR>'",
        ),
        (
            &["--prefill", "http://h:1", "--decode", "http://H:1/"],
            1,
            "--decode `http://H:1/`: this URL is already worker `p0`",
        ),
        (
            &["--engine", "vllm"],
            1,
            "--engine and --capacity-tokens apply to workers given with --prefill",
        ),
        (
            &["--worker", "http://h:1", "--policy", "fastest"],
            1,
            "--policy `fastest`: unknown policy",
        ),
        (&["--prefill", "http://h:1"], 1, "the workers cannot route"),
        (
            &["--worker", "http://h:1", "--engine", "sglang"],
            1,
            "--engine sglang needs --capacity-tokens",
        ),
        (
            &["check", "--decode", "nope"],
            2,
            "'nope' for '--decode <URL>'",
        ),
        (
            &["check", "--worker", "http://h:1", "--timeout-ms", "0"],
            2,
            "'0' for '--timeout-ms <MS>'",
        ),
    ] {
        let out = router(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?} served or checked");
    }
}
