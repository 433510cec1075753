//! HTTP replay: a trace sent through any HTTP router to simulated workers that speak SGLang's
//! HTTP API (or vLLM's, with [`WorkerOptions::engine`] `vllm`: each request is then a
//! `/v1/completions` call, see [`kvc_engine_sim::http`]).
//!
//! [`HttpWorkers`] are the simulator's engine model on a real clock, each worker an HTTP server
//! on loopback (see [`kvc_engine_sim::http`] for the API and the P/D bootstrap handshake). The driver sends
//! each trace request as an SGLang `/generate` call to the router, with a prompt whose words
//! repeat exactly where the trace's blocks repeat ([`prompt_text`]), so a text-prefix router
//! sees the trace's real prefix structure. Records and summary have `sim`'s shape; times are in
//! engine time (wall time × speedup).
//!
//! The router is either the `kvc-router` binary started as a child process with its HTTP front
//! ([`HttpRouter::Spawn`]) or any router at a URL ([`HttpRouter::Url`]), started once the
//! workers are up (the replay writes a ready file with the workers' addresses, and the
//! `kvc-router` configuration for them, then waits for the router's `GET /health`).
//!
//! **Router added latency.** Per request, the time from the client sending it to the first
//! worker holding its whole body (before the worker parses it: the worker's own work is not
//! the router's), plus the time from the decode worker handing over its last event to
//! the client receiving the end of the answer: what the router (and the hops through it) add,
//! in wall milliseconds. It is measured for streamed requests that completed.

pub mod driver;
pub mod engines;
mod serve;

pub use driver::DriveOptions;
pub use kvc_engine_sim::http::{
    Faults, HttpWorkers, PAIR_TIMEOUT_WALL, Script, ScriptedRequest, Served, ServedPath,
    StandaloneOptions, WorkerOptions,
};
pub use kvc_engine_sim::prompt::{prompt_key, prompt_text};
pub use serve::{RouterConfigTarget, ServeOptions, serve_workers, worker_lines};

use crate::live::router::{RouterConfigFile, RouterProcess, find_router_binary};
use crate::live::{LiveError, router_config};
use crate::sim::cluster::decode_worker_names;
use crate::sim::metrics::{RequestRecord, Summary};
use crate::sim::{SimConfig, SimOutput, run_config};
use crate::trace::Trace;
use driver::ClientSide;
use kvc_core::stats::{P50, P90, P99, percentile};
use kvc_core::{EngineKind, ExecutionMode, FallThroughReason, Outcome, StableName};
use serde::Serialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Which HTTP router the replay drives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HttpRouter {
    /// A router at this base URL (`http://127.0.0.1:8000`), started by someone else once the
    /// ready file is written.
    Url(String),
    /// The `kvc-router` binary with its HTTP front, started as a child process with the run's
    /// policy (`router_bin`, else the binary beside this executable, else the one on `PATH`).
    Spawn {
        /// The binary to run, when not found by itself.
        router_bin: Option<PathBuf>,
    },
}

/// Settings of an HTTP replay besides the [`SimConfig`].
#[derive(Debug, Clone)]
pub struct HttpLiveOptions {
    /// The router.
    pub router: HttpRouter,
    /// Name of the router in the summary's `config.policy` (default: the run's policy for a
    /// spawned router, `external` otherwise).
    pub label: Option<String>,
    /// The simulated workers.
    pub workers: WorkerOptions,
    /// Header carrying the session key; `None` sends no session.
    pub session_header: Option<String>,
    /// Ask for streamed answers.
    pub stream: bool,
    /// How long to wait for the router's `/health` to answer 2xx.
    pub connect_timeout: Duration,
    /// Most wall time one request may take.
    pub request_timeout: Duration,
    /// Written (JSON) once the workers serve: their addresses, roles and bootstrap ports.
    pub ready_file: Option<PathBuf>,
    /// Written (TOML) once the workers serve: a `kvc-router` configuration for them.
    pub router_config_file: Option<PathBuf>,
}

/// Added latency of the router, wall milliseconds; percentiles are nearest-rank
/// ([`kvc_core::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AddedLatency {
    /// Requests measured.
    pub requests: usize,
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

impl AddedLatency {
    fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return AddedLatency::default();
        }
        v.sort_by(f64::total_cmp);
        let q = |permille| percentile(&v, permille).unwrap_or(0.0);
        AddedLatency {
            requests: v.len(),
            mean_ms: v.iter().sum::<f64>() / v.len() as f64,
            p50_ms: q(P50),
            p90_ms: q(P90),
            p99_ms: q(P99),
            max_ms: v[v.len() - 1],
        }
    }
}

/// The router's added latency of one request, wall milliseconds, in its two halves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AddedSample {
    /// The request's index in the trace (its record's `index`).
    pub index: usize,
    /// From the client sending it to its first arrival at a worker.
    pub to_worker_ms: f64,
    /// From the worker handing over its last event to the client holding the whole answer.
    pub from_worker_ms: f64,
}

/// What an HTTP replay measured besides `sim`'s outputs (`http.json`).
#[derive(Debug, Clone, Serialize)]
pub struct HttpReport {
    /// The router driven.
    pub router: String,
    /// The router's added latency.
    pub router_added: AddedLatency,
    /// The router's added latency of each request it is measured for, in its two halves
    /// (`router_added.csv`, not in `http.json`).
    #[serde(skip)]
    pub added_by_request: Vec<AddedSample>,
    /// Direct-to-D turns the decode workers' admission refused (the router then re-routed).
    pub admission_rejects: u64,
    /// Requests a decode worker got more than once, besides re-routes after an admission
    /// refusal (the router retried them).
    pub retried: usize,
    /// vLLM dialect: P→D requests whose prefill worker failed, served by the decode worker
    /// alone (the router's `x-kvc-prefill-failed` header); their records have no prefill
    /// worker and their decode worker's full prefill.
    pub prefill_failed: usize,
    /// vLLM dialect: direct-to-D turns the decode worker served in full because the session
    /// was no longer resident there (outcome `direct-cache-miss`).
    pub direct_cache_misses: usize,
    /// Each failed request's error, first 20.
    pub first_errors: Vec<String>,
}

/// Records, summary and the HTTP report of one replay.
#[derive(Debug, Clone)]
pub struct HttpOutput {
    /// Same shape as `sim`'s.
    pub run: SimOutput,
    /// What only an HTTP replay measures.
    pub report: HttpReport,
}

/// The `kvc-router` configuration for the simulated workers `workers` of `cfg` (snapshots in
/// `dir`), with its HTTP front on `http_listen`.
pub fn http_router_config(
    cfg: &SimConfig,
    dir: &Path,
    listen: SocketAddr,
    http_listen: SocketAddr,
    metrics_listen: Option<SocketAddr>,
    workers: &HttpWorkers,
) -> RouterConfigFile {
    let urls: Vec<(String, Option<u16>)> = workers
        .addrs()
        .iter()
        .zip(workers.bootstrap_ports())
        .map(|(addr, port)| (format!("http://{addr}"), *port))
        .collect();
    let mut rc = router_config(cfg, dir, listen, metrics_listen, &[]).with_http(http_listen, &urls);
    if workers.engine() == EngineKind::Vllm {
        rc = rc.with_engine(EngineKind::Vllm);
    }
    if workers.engine_urls().is_empty() {
        rc
    } else {
        rc.with_engine_signals(workers.engine_urls())
    }
}

fn ready_json(workers: &HttpWorkers) -> serde_json::Value {
    let list: Vec<serde_json::Value> = workers
        .addrs()
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let mut w = serde_json::json!({
                "id": i,
                "name": workers.shared().names()[i],
                "role": workers.roles()[i].to_string(),
                "url": format!("http://{a}"),
                "bootstrap_port": workers.bootstrap_ports()[i],
            });
            // With engine signals: where another router finds them (e.g. KV events for
            // vllm-router's kv_aware policy).
            if let Some(e) = workers.engine_urls().get(i) {
                w["metrics_url"] = e.metrics_url.clone().into();
                w["kv_events"] = e.kv_events.clone().into();
                w["kv_events_replay"] = e.kv_events_replay.clone().into();
                w["kv_events_topic"] = e.kv_events_topic.clone().into();
            }
            w
        })
        .collect();
    serde_json::json!({ "workers": list })
}

fn write_file(path: &Path, text: &str) -> Result<(), LiveError> {
    std::fs::write(path, text).map_err(|e| LiveError::Snapshot {
        path: path.display().to_string(),
        message: format!("cannot write: {e}"),
    })
}

/// Waits until `GET <url>/health` answers 2xx.
pub(crate) async fn wait_healthy(url: &str, timeout: Duration) -> Result<(), LiveError> {
    let client: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let uri: hyper::Uri = format!("{}/health", url.trim_end_matches('/'))
        .parse()
        .map_err(|e| LiveError::Invalid(format!("bad router URL {url}: {e}")))?;
    let deadline = Instant::now() + timeout;
    loop {
        let attempt = tokio::time::timeout(Duration::from_secs(2), client.get(uri.clone())).await;
        let last = match attempt {
            Ok(Ok(r)) if r.status().is_success() => return Ok(()),
            Ok(Ok(r)) => format!("answered {}", r.status()),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer within 2 s".to_owned(),
        };
        if Instant::now() >= deadline {
            return Err(LiveError::Router(format!(
                "{url}/health did not answer 2xx within {:.0} s: {last}",
                timeout.as_secs_f64()
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the simulated workers need of the trace's requests (they find each by its prompt).
fn script_of(trace: &Trace) -> Script {
    Script {
        requests: trace
            .requests
            .iter()
            .map(|r| ScriptedRequest {
                session: r.session,
                input_length: r.input_length,
                output_length: r.output_length,
                hash_ids: r.hash_ids.clone(),
            })
            .collect(),
    }
}

/// Replays `trace` through the HTTP router of `opts` in front of simulated workers.
/// `progress` gets (completed, total) about twice a second.
pub fn live_http(
    trace: &Trace,
    cfg: &SimConfig,
    opts: &HttpLiveOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<HttpOutput, LiveError> {
    cfg.validate()?;
    cfg.check_block_size(trace)?;
    opts.workers.validate()?;
    let rt = crate::live::runtime()?;
    let trace = Arc::new(trace.clone());
    let workers = HttpWorkers::start(
        rt.handle(),
        Arc::new(script_of(&trace)),
        &cfg.cluster(trace.block_size()),
        &opts.workers,
    )?;
    if let Some(path) = &opts.router_config_file {
        let rc = http_router_config(
            cfg,
            &opts.workers.snapshot_dir,
            SocketAddr::from(([127, 0, 0, 1], 50051)),
            SocketAddr::from(([127, 0, 0, 1], 8000)),
            Some(SocketAddr::from(([127, 0, 0, 1], 9464))),
            &workers,
        );
        write_file(path, &rc.to_toml()?)?;
    }
    if let Some(path) = &opts.ready_file {
        write_file(path, &format!("{:#}\n", ready_json(&workers)))?;
    }
    let mut _spawned = None;
    let (url, label) = match &opts.router {
        HttpRouter::Url(u) => (
            u.clone(),
            opts.label.clone().unwrap_or_else(|| "external".into()),
        ),
        HttpRouter::Spawn { router_bin } => {
            let binary = find_router_binary(router_bin.as_deref())?;
            let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
            let rc = http_router_config(
                cfg,
                &opts.workers.snapshot_dir,
                loopback,
                loopback,
                None,
                &workers,
            );
            let config_path = opts.workers.snapshot_dir.join("kvc-router.toml");
            let running = RouterProcess::start(&binary, &rc, &config_path, opts.connect_timeout)?;
            let addr = running
                .http_addr()
                .ok_or_else(|| LiveError::Router("the router serves no HTTP front".into()))?;
            _spawned = Some(running);
            (
                format!("http://{addr}"),
                opts.label
                    .clone()
                    .unwrap_or_else(|| cfg.policy.name().to_owned()),
            )
        }
    };
    rt.block_on(wait_healthy(&url, opts.connect_timeout))?;
    let drive_opts = DriveOptions {
        router_url: url.clone(),
        session_header: opts.session_header.clone(),
        stream: opts.stream,
        request_timeout: opts.request_timeout,
        time_scale: cfg.time_scale,
        concurrency: cfg.concurrency,
        engine: opts.workers.engine,
        model: workers.shared().model().to_owned(),
        words: None,
    };
    let wall = Instant::now();
    // Trace time 0 is now: engine time keeps running from the workers' start.
    let start = Instant::now();
    let completed = Arc::new(AtomicUsize::new(0));
    let total = trace.len();
    let shared = workers.shared().clone();
    let speedup = opts.workers.speedup;
    let sides = rt.block_on(async {
        let mut task = tokio::spawn(driver::drive(
            trace.clone(),
            Some(shared.clone()),
            drive_opts,
            start,
            speedup,
            completed.clone(),
        ));
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                r = &mut task => break r,
                _ = tick.tick() => progress(completed.load(Ordering::Relaxed), total),
            }
        }
    });
    let sides = sides.map_err(|e| LiveError::Invalid(format!("the driver failed: {e}")))?;
    progress(completed.load(Ordering::Relaxed), total);
    // A spawned router is stopped here (and, were this never reached, when dropped).
    drop(_spawned.take());
    let served = shared.served();
    let names = shared.names().to_vec();
    let roles = workers.roles().to_vec();
    let pacer = kvc_engine_sim::http::Pacer { start, speedup };
    workers.stop()?;
    let mut config = run_config(cfg);
    config.policy = label.clone();
    let (records, report) = build_records(&trace, &sides, &served, &names, pacer, label);
    let summary = Summary::build(
        &records,
        &decode_worker_names(&roles, &names),
        config,
        wall.elapsed().as_secs_f64(),
    );
    Ok(HttpOutput {
        run: SimOutput {
            records,
            summary,
            worker_names: names,
            occupancy: Vec::new(),
            committed: Vec::new(),
        },
        report,
    })
}

/// One record per trace request from what the client and the workers saw.
fn build_records(
    trace: &Trace,
    sides: &[Option<ClientSide>],
    served: &[Served],
    names: &[String],
    pacer: kvc_engine_sim::http::Pacer,
    router: String,
) -> (Vec<RequestRecord>, HttpReport) {
    let secs = |t: Instant| pacer.engine_at(t);
    let mut first_of_session = vec![false; trace.len()];
    for s in trace.session_list() {
        if let Some(&i) = s.requests.first() {
            first_of_session[i] = true;
        }
    }
    let mut added = Vec::new();
    let mut samples = Vec::new();
    let mut first_errors = Vec::new();
    let mut retried = 0;
    let mut admission_rejects = 0u64;
    let mut prefill_failed = 0;
    let mut direct_cache_misses = 0;
    let mut records = Vec::with_capacity(trace.len());
    for (i, r) in trace.requests.iter().enumerate() {
        let s = &served[i];
        admission_rejects += u64::from(s.admission_rejects);
        if s.attempts > 1 + s.admission_rejects {
            retried += 1;
        }
        let Some(c) = &sides[i] else {
            // The driver lost the request (its task failed): count it, never drop it.
            if first_errors.len() < 20 {
                first_errors.push(format!("request {i}: the driver did not finish it"));
            }
            records.push(lost_record(i, r));
            continue;
        };
        let direct = c.mode.as_deref() == Some(ExecutionMode::DirectToD.as_str())
            || (c.mode.is_none() && matches!(s.path, Some(ServedPath::Direct(_))));
        let outcome = if c.complete {
            if direct && matches!(s.path, Some(ServedPath::DecodeInFull(_))) {
                direct_cache_misses += 1;
                Outcome::DirectCacheMiss
            } else {
                Outcome::Ok
            }
        } else if c.input_too_long {
            Outcome::InputTooLong
        } else if let Some(f) = s.failure {
            f
        } else if s.arrived.is_none() && (c.status == 503 || c.status == 429) {
            Outcome::Rejected
        } else {
            Outcome::WorkerFailed
        };
        if c.prefill_failed {
            prefill_failed += 1;
        }
        let served = matches!(outcome, Outcome::Ok | Outcome::DirectCacheMiss);
        if !served && outcome != Outcome::InputTooLong && first_errors.len() < 20 {
            first_errors.push(format!(
                "request {i}: {}",
                c.error.as_deref().unwrap_or("failed")
            ));
        }
        let mode = c
            .mode
            .as_deref()
            .and_then(|m| m.parse::<ExecutionMode>().ok())
            .or(match s.path {
                Some(ServedPath::Direct(_)) => Some(ExecutionMode::DirectToD),
                Some(ServedPath::DecodeInFull(_)) if first_of_session[i] => {
                    Some(ExecutionMode::Turn1Seed)
                }
                Some(ServedPath::DecodeInFull(_)) => Some(ExecutionMode::Fallback),
                Some(ServedPath::Colocated(_)) => Some(ExecutionMode::Colocated),
                Some(ServedPath::PrefillDecode { .. }) if first_of_session[i] => {
                    Some(ExecutionMode::Turn1Seed)
                }
                Some(ServedPath::PrefillDecode { .. }) => Some(ExecutionMode::Fallback),
                None => None,
            })
            .filter(|_| s.path.is_some() || outcome != Outcome::InputTooLong);
        let (prefill, decode) = match s.path {
            Some(ServedPath::PrefillDecode { prefill, decode }) => (
                Some(names[prefill.0 as usize].clone()),
                Some(names[decode.0 as usize].clone()),
            ),
            Some(
                ServedPath::Direct(w) | ServedPath::Colocated(w) | ServedPath::DecodeInFull(w),
            ) => (None, Some(names[w.0 as usize].clone())),
            None => (None, None),
        };
        let first = if served {
            c.first.or(s.first_sent)
        } else {
            None
        };
        if served
            && c.first.is_some()
            && let (Some(arrived), Some(done_sent)) = (s.arrived, s.done_sent)
        {
            let there = arrived.saturating_duration_since(c.sent);
            let back = c.done.saturating_duration_since(done_sent);
            added.push((there + back).as_secs_f64() * 1e3);
            samples.push(AddedSample {
                index: i,
                to_worker_ms: there.as_secs_f64() * 1e3,
                from_worker_ms: back.as_secs_f64() * 1e3,
            });
        }
        let (cached, uncached) = if s.path.is_some() {
            (s.cached, r.input_length.saturating_sub(s.cached))
        } else {
            (s.cached, 0)
        };
        let parts = RecordParts {
            mode,
            prefill,
            decode,
            first,
            cached,
            uncached,
            outcome,
        };
        records.push(client_record(i, r, c, secs, parts));
    }
    let report = HttpReport {
        router,
        router_added: AddedLatency::of(added),
        added_by_request: samples,
        admission_rejects,
        retried,
        prefill_failed,
        direct_cache_misses,
        first_errors,
    };
    (records, report)
}

/// Where a request the client saw through was served and how it ended, for its record.
struct RecordParts {
    mode: Option<ExecutionMode>,
    prefill: Option<String>,
    decode: Option<String>,
    /// When the first token reached the client (`None`: not served, or not streamed).
    first: Option<Instant>,
    cached: u64,
    uncached: u64,
    outcome: Outcome,
}

/// The record of request `i` from the client's timings (`secs`: an instant as the record's
/// seconds) and where and how it was served.
fn client_record(
    i: usize,
    r: &crate::trace::TraceRequest,
    c: &ClientSide,
    secs: impl Fn(Instant) -> f64,
    s: RecordParts,
) -> RequestRecord {
    let ready = secs(c.ready);
    RequestRecord {
        index: i,
        session: r.session,
        turn: r.turn,
        scheduled_s: ready,
        dispatch_s: secs(c.dispatch),
        first_token_s: s.first.map(&secs),
        done_s: secs(c.done),
        ttft_s: s.first.map(|f| secs(f) - ready),
        latency_s: secs(c.done) - ready,
        wait_s: secs(c.dispatch) - ready,
        mode: s.mode,
        reason: c
            .reason
            .as_deref()
            .and_then(|r| r.parse::<FallThroughReason>().ok())
            .filter(|_| s.mode != Some(ExecutionMode::DirectToD)),
        prefill: s.prefill,
        decode: s.decode,
        input_tokens: r.input_length,
        cached_tokens: s.cached,
        uncached_tokens: s.uncached,
        output_tokens: r.output_length,
        outcome: s.outcome,
        retractions: 0,
        failure: None,
    }
}

fn lost_record(i: usize, r: &crate::trace::TraceRequest) -> RequestRecord {
    RequestRecord {
        index: i,
        session: r.session,
        turn: r.turn,
        scheduled_s: 0.0,
        dispatch_s: 0.0,
        first_token_s: None,
        done_s: 0.0,
        ttft_s: None,
        latency_s: 0.0,
        wait_s: 0.0,
        mode: None,
        reason: None,
        prefill: None,
        decode: None,
        input_tokens: r.input_length,
        cached_tokens: 0,
        uncached_tokens: 0,
        output_tokens: r.output_length,
        outcome: Outcome::WorkerFailed,
        retractions: 0,
        failure: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvc_core::{BlockHash, SessionId, TraceRecord, TurnId, WorkerId};

    #[test]
    fn a_direct_turn_the_decode_worker_served_in_full_is_a_direct_cache_miss() {
        let records: Vec<TraceRecord> = (1..=3u32)
            .map(|t| TraceRecord {
                timestamp: u64::from(t) * 1_000,
                session_id: Some(SessionId(1)),
                parent_session_id: None,
                turn_id: Some(TurnId(t)),
                session_final: false,
                input_length: 1_024 * u64::from(t),
                output_length: 4,
                hash_ids: (0..2 * u64::from(t)).map(BlockHash).collect(),
            })
            .collect();
        let trace = Trace::from_records(&records, &crate::trace::LoadOptions::default())
            .unwrap()
            .0;
        let now = Instant::now();
        let side = |mode: &str, prefill_failed: bool| ClientSide {
            ready: now,
            dispatch: now,
            sent: now,
            first: Some(now),
            done: now,
            status: 200,
            mode: Some(mode.to_owned()),
            reason: None,
            prefill_failed,
            prefill_worker: None,
            decode_worker: None,
            complete: true,
            input_too_long: false,
            error: None,
            prompt_tokens: None,
            cached_tokens: None,
        };
        let d = WorkerId(1);
        let served = |path| Served {
            path: Some(path),
            ..Served::default()
        };
        let sides = vec![
            Some(side("turn1-seed", true)),
            Some(side("direct-to-d", false)),
            Some(side("direct-to-d", false)),
        ];
        let paths = vec![
            served(ServedPath::DecodeInFull(d)),
            served(ServedPath::DecodeInFull(d)),
            served(ServedPath::Direct(d)),
        ];
        let names = vec!["p0".to_owned(), "d1".to_owned()];
        let pacer = kvc_engine_sim::http::Pacer {
            start: now,
            speedup: 1.0,
        };
        let (records, report) = build_records(&trace, &sides, &paths, &names, pacer, "x".into());
        let outcomes: Vec<Outcome> = records.iter().map(|r| r.outcome).collect();
        assert_eq!(
            outcomes,
            [Outcome::Ok, Outcome::DirectCacheMiss, Outcome::Ok],
            "a P→D request D served alone is `ok`; a direct turn served in full is a miss"
        );
        assert_eq!((report.prefill_failed, report.direct_cache_misses), (1, 1));
        assert!(
            records
                .iter()
                .all(|r| r.prefill.is_none() && r.ttft_s.is_some())
        );
        assert!(report.first_errors.is_empty());
    }

    #[test]
    fn added_latency_percentiles() {
        let a = AddedLatency::of((1..=100).map(f64::from).collect());
        assert_eq!(a.requests, 100);
        assert!((a.mean_ms - 50.5).abs() < 1e-9);
        // Nearest rank of 100 values: p50 is the 50th, p90 the 90th, p99 the 99th.
        assert_eq!(a.p50_ms, 50.0);
        assert_eq!(a.p90_ms, 90.0);
        assert_eq!(a.p99_ms, 99.0);
        assert_eq!(a.max_ms, 100.0);
        assert_eq!(AddedLatency::of(Vec::new()), AddedLatency::default());
    }
}
