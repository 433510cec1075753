//! The `kvc-router` binary: `--help`, a start/stop cycle with a temp config on port 0, and
//! SIGHUP re-reading the file.
#![forbid(unsafe_code)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_kvc-router");

/// Sends `sig` (`-TERM`, `-HUP`) to `child`.
fn send_signal(child: &std::process::Child, sig: &str) {
    let status = Command::new("kill")
        .arg(sig)
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig}");
}

/// `child`'s exit status, once it has exited (at most [`common::WAIT`]).
fn wait_exit(child: &mut std::process::Child) -> std::process::ExitStatus {
    let mut exit = None;
    common::wait_until_blocking("the binary stopping after SIGTERM", || {
        exit = child.try_wait().unwrap();
        exit.is_some()
    });
    exit.unwrap()
}

/// A runtime for the async clients of a test that drives the binary.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The value of `key=` in the router's address line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// The line a started router prints on stdout (its addresses), within 30 s.
fn address_line(child: &mut std::process::Child) -> String {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("the binary prints its addresses")
}

#[test]
fn help_explains_every_option() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for opt in [
        "--config",
        "--listen",
        "--metrics-listen",
        "--no-metrics",
        "--http-listen",
        "--tokenizer",
        "--policy",
        "--session-ttl-ms",
        "--max-sessions",
        "--stale-after-ms",
        "--log",
        "--help",
        "--version",
    ] {
        assert!(text.contains(opt), "--help lacks {opt}:\n{text}");
    }
    assert!(text.contains("kvc-v2"), "policy names are listed");
}

#[test]
fn bad_config_fails_with_a_message() {
    let dir = common::TempDir::new("badcfg");
    let path = dir.0.join("router.toml");
    std::fs::write(&path, "listen = 5\n").unwrap();
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("invalid config"), "{err}");
}

#[test]
fn a_bad_tokenizer_file_stops_the_start_naming_it() {
    let dir = common::TempDir::new("badtok");
    let tokenizer = dir.0.join("broken-tokenizer.json");
    std::fs::write(&tokenizer, "{\"model\": 1}").unwrap();
    let path = dir.0.join("router.toml");
    std::fs::write(
        &path,
        "listen = \"127.0.0.1:0\"\nmetrics-listen = \"127.0.0.1:0\"\nhttp-listen = \"127.0.0.1:0\"\n",
    )
    .unwrap();
    for (args, file) in [
        (
            vec!["--tokenizer", tokenizer.to_str().unwrap()],
            "broken-tokenizer.json",
        ),
        (
            vec!["--tokenizer", "/nonexistent/tok.json"],
            "/nonexistent/tok.json",
        ),
    ] {
        let out = Command::new(BIN)
            .arg("--config")
            .arg(&path)
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(out.stdout.is_empty(), "nothing was served");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains("tokenizer") && err.contains(file), "{err}");
    }
}

#[test]
fn starts_serves_and_stops_on_sigterm() {
    let dir = common::TempDir::new("bin");
    let snap = dir.0.join("w1.snap");
    let path = dir.0.join("router.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:0\"\nmetrics-listen = \"127.0.0.1:0\"\nshutdown-grace-ms = 300\n\
             http-listen = \"192.0.2.1:0\"\n\
             [[workers]]\nid = 0\nrole = \"prefill\"\ncapacity-tokens = 1000\naddress = \"http://127.0.0.1:1\"\n\
             http-url = \"http://127.0.0.1:1\"\nbootstrap-port = 2\n\
             [[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 1000\nsnapshot = \"{}\"\n",
            snap.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(&path)
        // Overrides the config's unbindable (TEST-NET) `http-listen`.
        .arg("--http-listen")
        .arg("127.0.0.1:0")
        .arg("--max-sessions")
        .arg("10")
        .arg("--log")
        .arg("warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let line = address_line(&mut child);
    let grpc = field(&line, "grpc").to_owned();
    let metrics: std::net::SocketAddr = field(&line, "metrics").parse().unwrap();
    let http: std::net::SocketAddr = field(&line, "http").parse().unwrap();
    // The existing fields keep their order: grpc first, then metrics, then http.
    assert!(line.starts_with("kvc-router grpc="), "{line:?}");
    assert!(
        line.find(" metrics=").unwrap() < line.find(" http=").unwrap(),
        "{line:?}"
    );

    let rt = runtime();
    rt.block_on(async {
        let mut client =
            kvc_proto::pb::router_client::RouterClient::connect(format!("http://{grpc}"))
                .await
                .unwrap();
        let list = client
            .list_workers(kvc_proto::pb::ListWorkersRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(list.workers.len(), 2);
        // Neither worker is reachable: both out of rotation.
        for w in &list.workers {
            assert_ne!(
                w.state.unwrap().health,
                kvc_proto::pb::Health::Healthy as i32
            );
        }
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "kvc.v1.Router".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            status.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
        let (_, body) = common::http_get(metrics, "/metrics").await;
        assert!(body.contains("kvc_router_sessions_tracked 0"));
        // The HTTP front answers: no worker is routable yet, so /health is 503 with a JSON
        // error; /v1/models asks the workers, and nothing listens at their address.
        let (head, body) = common::http_get(http, "/health").await;
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["message"], "no routable worker");
        let (head, body) = common::http_get(http, "/v1/models").await;
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with("no worker answered GET /v1/models (worker "),
            "{message}"
        );
    });

    // The runtime (and its idle client connection) stays alive: the grace period bounds the
    // shutdown anyway.
    send_signal(&child, "-TERM");
    let exit = wait_exit(&mut child);
    assert!(exit.success(), "clean exit after SIGTERM: {exit:?}");
    drop(rt);
}

#[test]
fn sighup_rereads_the_file_drains_a_worker_and_keeps_a_broken_file_out() {
    rereads_the_file(true);
}

#[test]
fn a_changed_file_is_reread_without_a_signal() {
    rereads_the_file(false);
}

/// Starts the binary, drains d1 by editing its file, breaks the file, undrains d1: told by
/// SIGHUP (`signal`, polling off) or noticed by polling the file every 100 ms.
fn rereads_the_file(signal: bool) {
    let dir = common::TempDir::new("bin-hup");
    let snap = dir.0.join("w1.snap");
    let path = dir.0.join("router.toml");
    let config = |drained: bool| {
        format!(
            "listen = \"127.0.0.1:0\"\nmetrics-listen = \"127.0.0.1:0\"\nshutdown-grace-ms = 300\n\
             [[workers]]\nid = 0\nname = \"p0\"\nrole = \"prefill\"\ncapacity-tokens = 1000\n\
             address = \"http://127.0.0.1:1\"\n\
             [[workers]]\nid = 1\nname = \"d1\"\nrole = \"decode\"\ncapacity-tokens = 1000\n\
             snapshot = \"{}\"\ndrained = {drained}\n",
            snap.display()
        )
    };
    // Written whole or not at all: a poll never reads a half-written file.
    let write_config = |text: &str| {
        let tmp = dir.0.join("router.toml.new");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    };
    write_config(&config(false));
    // The log goes to a file the test reads while the router runs.
    let log_path = dir.0.join("router.log");
    let log = || String::from_utf8_lossy(&std::fs::read(&log_path).unwrap()).into_owned();
    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(&path)
        .arg("--config-poll-ms")
        .arg(if signal { "0" } else { "100" })
        .arg("--log")
        .arg("info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let line = address_line(&mut child);
    let metrics: std::net::SocketAddr = field(&line, "metrics").parse().unwrap();
    let rt = runtime();
    let drained_gauge = || {
        let (_, body) = rt.block_on(common::http_get(metrics, "/metrics"));
        body.lines()
            .find(|l| l.starts_with("kvc_router_worker_drained{") && l.contains("name=\"d1\""))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let hup = |child: &std::process::Child| {
        if !signal {
            return;
        }
        send_signal(child, "-HUP");
    };
    let wait_gauge = |want: f64| {
        common::wait_until_blocking(format!("d1's drained gauge becoming {want}"), || {
            drained_gauge() == Some(want)
        });
    };
    const NOT_APPLIED: &str = "not applied (the running configuration stays)";
    assert_eq!(drained_gauge(), Some(0.0));
    write_config(&config(true));
    hup(&child);
    wait_gauge(1.0);
    // A file that does not load changes nothing (and the router keeps running): once the
    // router has said so, d1 is still drained.
    assert!(!log().contains(NOT_APPLIED), "{}", log());
    write_config("listen = [");
    hup(&child);
    common::wait_until_blocking("the broken file refused", || log().contains(NOT_APPLIED));
    assert_eq!(drained_gauge(), Some(1.0));
    assert!(
        child.try_wait().unwrap().is_none(),
        "a broken file stopped the router"
    );
    write_config(&config(false));
    hup(&child);
    wait_gauge(0.0);

    send_signal(&child, "-TERM");
    let status = wait_exit(&mut child);
    assert!(status.success(), "clean exit after SIGTERM: {status:?}");
    let log = log();
    let why = if signal { "SIGHUP" } else { "the file changed" };
    assert!(log.contains(&format!("{why}: ")), "{log}");
    assert!(log.contains("worker 1 (`d1`) drained"), "{log}");
    assert!(log.contains(NOT_APPLIED), "{log}");
    assert!(log.contains("worker 1 (`d1`) back in rotation"), "{log}");
}
