//! Helpers of the cross-process tests (included with `mod common;`).
#![allow(dead_code, unreachable_pub)]

pub mod http;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The directory of the workspace's binaries (`target/<profile>`), built if missing.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf();
    if !dir.join("kvc-router").exists() || !dir.join("kvc-replay").exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "-p", "kvc-router", "-p", "kvc-replay"])
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .status()
            .expect("run cargo build");
        assert!(status.success(), "building the binaries failed");
    }
    dir
}

/// A loopback port free now, for a server started next.
pub fn free_port() -> u16 {
    // Below the kernel's ephemeral range: a port picked from it and released may be taken
    // again, before the server binds it, by any process's outgoing connection or bind(0).
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768)
        .clamp(12_000, 65_535);
    let span = low - 10_000;
    let start = std::process::id().wrapping_mul(7_919);
    for _ in 0..span {
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 10_000 + start.wrapping_add(k.wrapping_mul(104_729)) % span;
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port as u16)) {
            drop(l);
            return port as u16;
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A GET of `path` on `addr`: the whole answer as text, head and body.
pub fn http_get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to /metrics");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(http::request_head("GET", path, addr, &[], None).as_bytes())
        .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    // A chunked body is de-chunked: a chunk boundary may fall anywhere in a line.
    let answer = http::Answer::parse(&raw);
    format!("HTTP/1.1 {} \r\n\r\n{}", answer.status, answer.body)
}

/// Kills the child on drop (a failing test must not leave a router running).
pub struct Guard(pub Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn mode_shares(summary: &serde_json::Value) -> Vec<(String, f64)> {
    summary["modes"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v["share"].as_f64().unwrap()))
        .collect()
}

/// Waits (30 s at most) for `child`, still running, to write the file at `ready`.
pub fn wait_for_ready_file(child: &mut Child, ready: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "the workers never came up");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the workers stopped early"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for `child` to exit within `limit`; kills it and panics past the deadline.
pub fn wait_within(child: &mut Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Generates the SWE-agent trace of `sessions` sessions (seed `seed`) into `dir/trace.jsonl`.
pub fn gen_trace(replay: &Path, dir: &Path, seed: u64, sessions: usize) -> PathBuf {
    let trace = dir.join("trace.jsonl");
    let ok = Command::new(replay)
        .args(["gen", "swe", "--quiet", "--seed", &seed.to_string()])
        .args(["--sessions", &sessions.to_string(), "--out"])
        .arg(&trace)
        .status()
        .unwrap();
    assert!(ok.success(), "generating the trace failed");
    trace
}

/// Reads `dir/<file>` as JSON.
pub fn read_json(dir: &Path, file: &str) -> serde_json::Value {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// Runs `kvc-replay sim` of `trace` on `topology` with `policy` into `dir/sim`; returns that
/// directory.
pub fn run_sim(replay: &Path, dir: &Path, trace: &Path, topology: &str, policy: &str) -> PathBuf {
    let out = dir.join("sim");
    let ok = Command::new(replay)
        .args([
            "sim",
            "--quiet",
            "--topology",
            topology,
            "--policy",
            policy,
            "--trace",
        ])
        .arg(trace)
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(ok.success(), "kvc-replay sim failed");
    out
}

/// A generated SWE-agent trace (`seed`, `sessions` sessions, `requests` turns in all) plus one
/// single-turn session whose input (93,000 tokens) is over the model's limit.
pub fn swe_with_one_too_long(
    seed: u64,
    sessions: usize,
    requests: usize,
) -> kvc_replay::trace::Trace {
    use kvc_core::{BlockHash, SessionId, TurnId};
    use kvc_replay::trace::{self, generate::SweConfig};
    let mut records = trace::generate::swe(&SweConfig {
        seed,
        sessions,
        requests: Some(requests),
        ..SweConfig::default()
    });
    let too_long = 93_000u64;
    records.push(kvc_core::TraceRecord {
        timestamp: 5_000,
        session_id: Some(SessionId(999_999)),
        parent_session_id: None,
        turn_id: Some(TurnId(1)),
        session_final: false,
        input_length: too_long,
        output_length: 10,
        hash_ids: (0..too_long.div_ceil(512))
            .map(|i| BlockHash(7_000_000 + i))
            .collect(),
    });
    kvc_replay::trace::Trace::from_records(&records, &trace::LoadOptions::default())
        .unwrap()
        .0
}

/// A `kvc-replay live --http-router` run: simulated HTTP workers for `topology`, replaying
/// `trace` at `speedup` against the router at `router` (`http://…`), its output in `dir/run`.
/// Returns once the workers are up and the router configuration for them is written to
/// `config` (the replay then waits for the router).
pub fn start_http_live(
    replay: &Path,
    dir: &Path,
    trace: &Path,
    (topology, speedup): (&str, &str),
    router: &str,
    config: &Path,
) -> Child {
    let ready = dir.join("ready.json");
    let mut live = Command::new(replay)
        .args(["live", "--quiet", "--topology", topology, "--policy", "kvc"])
        .args(["--speedup", speedup, "--connect-timeout-s", "30"])
        .arg("--http-router")
        .arg(router)
        .arg("--snapshot-dir")
        .arg(dir.join("snap"))
        .arg("--http-router-config")
        .arg(config)
        .arg("--ready-file")
        .arg(&ready)
        .arg("--trace")
        .arg(trace)
        .arg("--out")
        .arg(dir.join("run"))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "the workers never came up");
        assert!(
            live.try_wait().unwrap().is_none(),
            "the replay stopped early"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    live
}

/// The version of the kvc-router crate, as its Cargo.toml states it (it names the wheel and
/// the image).
pub fn kvc_router_version() -> String {
    let manifest = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/kvc-router/Cargo.toml"
    ))
    .unwrap();
    manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("a version line")
        .to_owned()
}

/// The URL of the first worker of `role` in the ready file `kvc-replay workers` writes.
pub fn ready_worker_url(ready: &serde_json::Value, role: &str) -> String {
    ready["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["role"] == role)
        .and_then(|w| w["url"].as_str())
        .unwrap()
        .to_owned()
}
