//! `kvc-router`'s HTTP front (the binary, started by the replay as a child process) in front of
//! simulated P/D workers that speak SGLang's HTTP API: every request completes, with `sim`'s
//! execution-mode accounting, streaming and not.
#![forbid(unsafe_code)]

mod common;

use kvc_core::{ExecutionMode, Outcome, StableName, Topology};
use kvc_policy::PolicyConfig;
use kvc_replay::http::{HttpLiveOptions, HttpOutput, HttpRouter, WorkerOptions, live_http};
use kvc_replay::sim::{SimConfig, SimOutput, simulate};
use kvc_replay::trace::Trace;
use std::collections::BTreeMap;
use std::time::Duration;

/// Three SWE-agent sessions (45 turns) plus one single-turn session over the input limit.
fn trace() -> Trace {
    common::swe_with_one_too_long(11, 3, 45)
}

fn config() -> SimConfig {
    let mut cfg = SimConfig::new(
        "1p3d".parse::<Topology>().unwrap(),
        PolicyConfig::from_name("kvc").unwrap(),
    );
    // The router declares no worker capabilities: its decode workers serve no turn alone.
    cfg.local_prefill = false;
    cfg
}

fn http_run(trace: &Trace, stream: bool, name: &str) -> HttpOutput {
    let dir = std::env::temp_dir().join(format!("kvc-http-replay-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = HttpLiveOptions {
        router: HttpRouter::Spawn {
            router_bin: Some(common::bin_dir().join("kvc-router")),
        },
        label: None,
        workers: WorkerOptions {
            speedup: 20.0,
            http_base_port: None,
            bootstrap_base_port: None,
            snapshot_dir: dir.join("snap"),
            table_slots: 64,
            model: "sim".into(),
            router_state: kvc_core::StateSource::Snapshot,
            engine_base_port: None,
            engine: kvc_core::EngineKind::Sglang,
            faults: Default::default(),
            pd_shim: false,
        },
        session_header: Some("x-session-id".into()),
        stream,
        connect_timeout: Duration::from_secs(20),
        request_timeout: Duration::from_secs(120),
        ready_file: Some(dir.join("ready.json")),
        router_config_file: Some(dir.join("router.toml")),
    };
    let out = live_http(trace, &config(), &opts, &mut |_, _| {}).unwrap();
    // The ready file lists every worker with its URL; prefill workers have a bootstrap port.
    let ready: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("ready.json")).unwrap()).unwrap();
    let workers = ready["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 4);
    assert_eq!(workers[0]["role"], "prefill");
    assert!(workers[0]["bootstrap_port"].as_u64().is_some());
    assert!(workers[1]["bootstrap_port"].is_null());
    assert!(
        workers
            .iter()
            .all(|w| w["url"].as_str().unwrap().starts_with("http://127.0.0.1:"))
    );
    // The written kvc-router config loads and names every worker's HTTP address.
    let rc = kvc_router::config::RouterConfig::from_file(&dir.join("router.toml")).unwrap();
    assert_eq!(
        rc.workers.iter().filter(|w| w.http_url.is_some()).count(),
        4
    );
    assert!(rc.http_listen.is_some());
    out
}

fn mode_counts(run: &SimOutput) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for r in &run.records {
        let key = r.mode.map_or("none", ExecutionMode::as_str).to_owned();
        *m.entry(key).or_insert(0) += 1;
    }
    m
}

fn check(trace: &Trace, sim: &SimOutput, http: &HttpOutput, stream: bool) {
    let run = &http.run;
    // Every request is recorded once, in trace order.
    assert_eq!(run.records.len(), trace.len());
    assert!(run.records.iter().enumerate().all(|(i, r)| r.index == i));
    // The over-limit request is `input-too-long` in both, every other one completed.
    for (h, s) in run.records.iter().zip(&sim.records) {
        assert_eq!(
            h.outcome, s.outcome,
            "request {}: {:?}",
            h.index, http.report
        );
    }
    assert_eq!(run.summary.outcomes["input-too-long"], 1);
    assert_eq!(run.summary.outcomes["ok"], trace.len() - 1);
    assert_eq!(run.summary.mechanism_errors, 0);
    // Execution-mode accounting: first turns seed through P in both, and the direct-to-D share
    // of later turns is within 10 points of sim's.
    let (hm, sm) = (mode_counts(run), mode_counts(sim));
    assert_eq!(
        hm.get("turn1-seed"),
        sm.get("turn1-seed"),
        "{hm:?} vs {sm:?}"
    );
    assert_eq!(hm.get("turn1-seed"), Some(&3));
    assert_eq!(hm.get("none"), Some(&1));
    let share = |m: &BTreeMap<String, usize>| {
        m.get("direct-to-d").copied().unwrap_or(0) as f64 / (trace.len() - 4) as f64
    };
    assert!(
        (share(&hm) - share(&sm)).abs() <= 0.10,
        "direct-to-D share {:.3} over HTTP vs {:.3} in sim ({hm:?} vs {sm:?})",
        share(&hm),
        share(&sm)
    );
    assert!(share(&hm) > 0.8, "{hm:?}");
    // Where each request ran is what the workers saw: P→D paths name both workers, direct
    // turns only D.
    for r in &run.records {
        match r.mode {
            Some(ExecutionMode::DirectToD) => {
                assert!(r.prefill.is_none() && r.decode.as_deref().unwrap().starts_with('d'));
            }
            Some(ExecutionMode::Turn1Seed | ExecutionMode::Fallback | ExecutionMode::Reseed) => {
                assert_eq!(r.prefill.as_deref(), Some("p0"));
                assert!(r.decode.as_deref().unwrap().starts_with('d'));
            }
            other => assert!(r.outcome == Outcome::InputTooLong, "{other:?}"),
        }
        if r.outcome == Outcome::Ok {
            let ttft = r.ttft_s.unwrap();
            assert!(ttft > 0.0 && ttft <= r.latency_s, "{r:?}");
        }
    }
    // Direct turns reuse the session's KV: most of their prompt is cached.
    let direct: Vec<_> = run
        .records
        .iter()
        .filter(|r| r.mode == Some(ExecutionMode::DirectToD))
        .collect();
    let cached: u64 = direct.iter().map(|r| r.cached_tokens).sum();
    let input: u64 = direct.iter().map(|r| r.input_tokens).sum();
    assert!(cached * 2 > input, "cached {cached} of {input}");
    // The router's added latency is measured on streamed requests only.
    if stream {
        assert_eq!(http.report.router_added.requests, trace.len() - 1);
        let a = &http.report.router_added;
        assert!(a.p50_ms > 0.0 && a.p50_ms <= a.p99_ms && a.p99_ms <= a.max_ms);
    } else {
        assert_eq!(http.report.router_added.requests, 0);
    }
    assert_eq!(http.report.retried, 0, "{:?}", http.report);
    assert!(http.report.first_errors.is_empty(), "{:?}", http.report);
}

#[test]
fn kvc_router_over_http_matches_sim_accounting_streaming_and_not() {
    let trace = trace();
    let sim = simulate(&trace, &config(), &mut |_, _| {}).unwrap();
    assert_eq!(sim.summary.outcomes["input-too-long"], 1);
    let streamed = http_run(&trace, true, "stream");
    check(&trace, &sim, &streamed, true);
    let whole = http_run(&trace, false, "whole");
    check(&trace, &sim, &whole, false);
}
