//! The `kvc-router` binary: `--help`, and a start/stop cycle with a temp config on port 0.
#![forbid(unsafe_code)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kvc-router");

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
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the binary prints its addresses");
    let grpc = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("grpc="))
        .unwrap_or_else(|| panic!("no grpc= in {line:?}"))
        .to_owned();
    let metrics: std::net::SocketAddr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("metrics="))
        .unwrap()
        .parse()
        .unwrap();
    let http: std::net::SocketAddr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("http="))
        .unwrap_or_else(|| panic!("no http= in {line:?}"))
        .parse()
        .unwrap();
    // The existing fields keep their order: grpc first, then metrics, then http.
    assert!(line.starts_with("kvc-router grpc="), "{line:?}");
    assert!(
        line.find(" metrics=").unwrap() < line.find(" http=").unwrap(),
        "{line:?}"
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
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
        // error; /v1/models lists the model.
        let (head, body) = common::http_get(http, "/health").await;
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["message"], "no routable worker");
        let (head, body) = common::http_get(http, "/v1/models").await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["object"], "list");
    });

    // The runtime (and its idle client connection) stays alive: the grace period bounds the
    // shutdown anyway.
    let status = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the binary did not stop within 10 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "clean exit after SIGTERM: {exit:?}");
    drop(rt);
}
