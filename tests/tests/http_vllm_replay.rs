//! `kvc-router`'s HTTP front (the binary, started by the replay) in front of simulated workers
//! that speak vLLM's OpenAI API with NixlConnector P/D (`live --http --engine vllm`): every
//! request recorded once, the execution modes within 10 points of `sim`'s, streaming and
//! not, and a failing prefill worker leaving every P→D request to its decode worker alone.
#![forbid(unsafe_code)]

mod common;

use kvc_core::{EngineKind, ExecutionMode, Outcome, StableName};
use kvc_policy::PolicyConfig;
use kvc_replay::http::{Faults, HttpLiveOptions, HttpOutput, HttpRouter, WorkerOptions, live_http};
use kvc_replay::sim::{SimConfig, SimOutput, simulate};
use kvc_replay::trace::Trace;
use std::collections::BTreeMap;
use std::time::Duration;

/// Three SWE-agent sessions (45 turns) plus one single-turn session over the input limit.
fn trace() -> Trace {
    common::swe_with_one_too_long(11, 3, 45)
}

fn config() -> SimConfig {
    SimConfig::new(
        "1p3d".parse().unwrap(),
        PolicyConfig::from_name("kvc").unwrap(),
    )
}

/// [`config`] with workers held to their roles (`--local-prefill off`): every turn that is
/// not direct goes through P, whose failures these runs inject.
fn fixed_roles() -> SimConfig {
    SimConfig {
        local_prefill: false,
        ..config()
    }
}

fn http_run(
    trace: &Trace,
    cfg: &SimConfig,
    stream: bool,
    faults: Faults,
    name: &str,
) -> HttpOutput {
    let dir = std::env::temp_dir().join(format!("kvc-http-vllm-{}-{name}", std::process::id()));
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
            engine: EngineKind::Vllm,
            faults,
            pd_shim: false,
        },
        session_header: Some("x-session-id".into()),
        stream,
        connect_timeout: Duration::from_secs(20),
        request_timeout: Duration::from_secs(120),
        ready_file: Some(dir.join("ready.json")),
        router_config_file: Some(dir.join("router.toml")),
    };
    let out = live_http(trace, cfg, &opts, &mut |_, _| {}).unwrap();
    // The written router config declares every worker a vLLM engine; no bootstrap ports.
    let rc = kvc_router::config::RouterConfig::from_file(&dir.join("router.toml")).unwrap();
    assert_eq!(rc.workers.len(), 4);
    assert!(
        rc.workers
            .iter()
            .all(|w| w.engine == Some(EngineKind::Vllm))
    );
    assert!(rc.workers.iter().all(|w| w.bootstrap_port.is_none()));
    let _ = std::fs::remove_dir_all(&dir);
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

fn check(trace: &Trace, sim: &SimOutput, http: &HttpOutput) {
    let run = &http.run;
    assert_eq!(run.records.len(), trace.len());
    assert!(run.records.iter().enumerate().all(|(i, r)| r.index == i));
    let served = run.summary.outcomes["ok"] + run.summary.outcomes["direct-cache-miss"];
    assert_eq!(served, trace.len() - 1, "{:?}", http.report);
    assert_eq!(run.summary.outcomes["input-too-long"], 1);
    assert_eq!(run.summary.mechanism_errors, 0);
    assert_eq!(
        run.summary.outcomes["direct-cache-miss"],
        http.report.direct_cache_misses
    );
    let (hm, sm) = (mode_counts(run), mode_counts(sim));
    // The three sessions' first turns: through P with workers held to their roles, served
    // alone by an idle decode worker where vLLM's workers may (as in sim).
    let first = match sim.summary.config.local_prefill {
        true => "local-prefill",
        false => "turn1-seed",
    };
    assert_eq!(hm.get(first), Some(&3), "{hm:?}");
    for mode in ["turn1-seed", "local-prefill"] {
        assert_eq!(hm.get(mode), sm.get(mode), "{mode}: {hm:?} vs {sm:?}");
    }
    let share = |m: &BTreeMap<String, usize>| {
        m.get("direct-to-d").copied().unwrap_or(0) as f64 / (trace.len() - 4) as f64
    };
    assert!(
        (share(&hm) - share(&sm)).abs() <= 0.10,
        "direct-to-D share {:.3} over HTTP vs {:.3} in sim ({hm:?} vs {sm:?})",
        share(&hm),
        share(&sm)
    );
    for r in &run.records {
        match r.mode {
            Some(ExecutionMode::DirectToD | ExecutionMode::LocalPrefill) => {
                assert!(r.prefill.is_none() && r.decode.as_deref().unwrap().starts_with('d'));
            }
            Some(ExecutionMode::Turn1Seed | ExecutionMode::Fallback | ExecutionMode::Reseed) => {
                assert!(r.decode.as_deref().unwrap().starts_with('d'), "{r:?}");
            }
            other => assert!(r.outcome == Outcome::InputTooLong, "{other:?}"),
        }
        if r.outcome == Outcome::Ok {
            let ttft = r.ttft_s.unwrap();
            assert!(ttft > 0.0 && ttft <= r.latency_s, "{r:?}");
        }
    }
    assert!(http.report.first_errors.is_empty(), "{:?}", http.report);
}

#[test]
fn kvc_router_drives_simulated_vllm_workers_like_sim_streaming_and_not() {
    let trace = trace();
    for (cfg, stream) in [(config(), true), (config(), false), (fixed_roles(), true)] {
        let sim = simulate(&trace, &cfg, &mut |_, _| {}).unwrap();
        let name = match (cfg.local_prefill, stream) {
            (true, true) => "stream",
            (true, false) => "whole",
            (false, _) => "fixed-roles",
        };
        let run = http_run(&trace, &cfg, stream, Faults::default(), name);
        check(&trace, &sim, &run);
        assert_eq!(run.report.prefill_failed, 0);
        // P→D requests ran through P, with the KV pulled by D.
        for r in &run.run.records {
            if matches!(r.mode, Some(ExecutionMode::Turn1Seed)) {
                assert_eq!(r.prefill.as_deref(), Some("p0"), "{r:?}");
            }
        }
        if stream {
            assert_eq!(run.report.router_added.requests, trace.len() - 1);
        }
    }
}

#[test]
fn a_failing_prefill_worker_leaves_p_to_d_requests_to_the_decode_worker() {
    let trace = trace();
    let faults = Faults {
        fail_prefill: true,
        ..Faults::default()
    };
    let run = http_run(&trace, &fixed_roles(), true, faults, "fail-p");
    let records = &run.run.records;
    assert_eq!(records.len(), trace.len());
    assert_eq!(run.run.summary.mechanism_errors, 0, "{:?}", run.report);
    let through_p = records
        .iter()
        .filter(|r| {
            matches!(
                r.mode,
                Some(ExecutionMode::Turn1Seed | ExecutionMode::Fallback | ExecutionMode::Reseed)
            )
        })
        .count();
    assert!(through_p >= 3);
    assert_eq!(run.report.prefill_failed, through_p, "{:?}", run.report);
    // Nothing ran through P: every request was served by a decode worker alone.
    assert!(records.iter().all(|r| r.prefill.is_none()));
    assert_eq!(
        run.run.summary.outcomes["ok"] + run.run.summary.outcomes["direct-cache-miss"],
        trace.len() - 1
    );
    assert!(run.report.first_errors.is_empty(), "{:?}", run.report);
}

#[test]
fn a_session_evicted_behind_the_router_s_back_is_a_direct_cache_miss() {
    let trace = trace();
    let faults = Faults {
        evict_before_plain: true,
        ..Faults::default()
    };
    for stream in [true, false] {
        let name = if stream {
            "evict-stream"
        } else {
            "evict-whole"
        };
        let run = http_run(&trace, &fixed_roles(), stream, faults, name);
        let records = &run.run.records;
        assert_eq!(records.len(), trace.len());
        assert_eq!(run.run.summary.mechanism_errors, 0, "{:?}", run.report);
        // Every direct-to-D turn found its session gone and was judged a miss; nothing else was.
        let direct = records
            .iter()
            .filter(|r| r.mode == Some(ExecutionMode::DirectToD))
            .count();
        let misses = run.run.summary.outcomes["direct-cache-miss"];
        assert!(misses > 0, "{:?}", run.report);
        assert_eq!(misses, direct);
        assert_eq!(run.report.direct_cache_misses, misses);
        assert!(
            records
                .iter()
                .all(|r| (r.outcome == Outcome::DirectCacheMiss)
                    == (r.mode == Some(ExecutionMode::DirectToD)))
        );
        // The router learned each miss: the turn after one goes through P again.
        for pair in records.windows(2) {
            if pair[0].outcome == Outcome::DirectCacheMiss && pair[1].session == pair[0].session {
                assert_ne!(pair[1].mode, Some(ExecutionMode::DirectToD), "{pair:?}");
            }
        }
        assert_eq!(run.run.summary.outcomes["ok"] + misses, trace.len() - 1);
    }
}
