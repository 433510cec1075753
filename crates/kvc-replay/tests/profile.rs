//! `kvc-replay profile` against simulated vLLM workers whose engine profile is known: a
//! colocated worker for the prefill and decode sweeps and a 1p1d NixlConnector pair for the
//! transfer, in process, on a real clock (speedup 1, no jitter). Each fitted factor must come
//! back within three of the standard errors the profiler reports (plus a stated timing
//! resolution) of what the workers can show: anywhere between the engine model's value and
//! the value with the workers' serving cost included, that cost measured in the same run just
//! before and just after the sweep. The profile written must load with `Profile::load` and
//! carry its residuals. The default profile runs attention at the prefill efficiency, so the
//! prefill fit either keeps one efficiency (with its warning) or gives attention an
//! efficiency of its own that the serving cost explains; a second engine runs attention at a
//! third of the prefill efficiency, and `fit.attention_efficiency` must come back. Also the
//! clear errors against a closed port and against servers that are not vLLM.
//!
//! **Why the verdict does not depend on how busy the machine is.** The profiler times real
//! requests on the wall clock; what it cannot tell from the engine's own work is what the
//! workers' serving costs on the moment's machine (a debug build's HTTP path, shared with
//! whatever else runs on the two cores). A bound fixed in advance (say "within 15 % of the
//! model") therefore judges the machine, not the profiler: on a loaded machine the serving
//! cost alone moved the attention efficiency 16 % off the model, and a fit that read it
//! exactly failed. So every bound here comes from the same run:
//! - the serving cost is measured twice, around the sweep, on workers of the same kind
//!   sharing the same machine, and a factor passes when it lies within the envelope of the
//!   model's value and both served values;
//! - widened by the profiler's own standard errors (three of them), by the noise the sweep's
//!   own repeats show ([`sweep_noise`]: a point's spread, as a share of a rate, or over the
//!   sizes' range for a growth per token) where that exceeds the timing resolution below,
//!   and by how far the two served values lie apart (the expected value's own noise);
//! - the attention test's claim that one efficiency cannot fit its points is an F test on
//!   the two fits' residuals, not a ratio of their worst points.
//!
//! A profiler that misreads a factor (a wrong unit, a sweep that mixes cached and fresh
//! tokens, a step read from the wrong stream) lands outside that envelope on any machine. The
//! real-clock tests hold [`REAL_CLOCK`], so that two of them never share the cores, and
//! nothing here bounds how long a sweep takes (that is a benchmark's figure). Measured: 20
//! runs in a row alone and 5 beside a release build passed; with three other CPU-bound jobs
//! beside it (a load of 6 to 8 on two cores) the points scatter by several percent and the
//! serving cost's growth per token can no longer be fitted: no timing test holds there.

//! What the profiler sees besides the engine model, and how the expected values allow for it:
//! - **Serving cost.** Every request also pays the workers' HTTP path: the round trip, the
//!   JSON of its token ids read and hashed into blocks, the engine thread's hand-offs. Here
//!   (a debug build, on an idle machine) that is about half a millisecond plus half a
//!   microsecond per prompt token. The profiler cannot tell it from the engine's work (to a
//!   user it is part of what a request costs): the fixed costs absorb its constant part and
//!   the prefill and transfer slopes its per-token part, by a few percent (the cached tokens'
//!   part, with attention fitted apart, the attention slope: by about 7 %, more on a loaded
//!   machine). The test measures it on workers whose engine has the same fixed costs at
//!   infinite speed ([`serving_cost`]), before and after the sweep; there too, what a chat
//!   costs beyond a token-id prompt of as many tokens and the configured intake (the text's
//!   path through the workers, which the intake sweep reads as intake).
//! - **Transfer semantics.** A simulated decode worker emits the first token the moment the
//!   KV has arrived, with none of the decode step vLLM runs then, and a simulated prefill
//!   worker whose prefix cache holds the whole prompt recomputes nothing where vLLM recomputes
//!   the last block; the simulated P also answers at once and prefills while D waits. The
//!   profiler, made for vLLM, takes off one decode step and one block's prefill: so on these
//!   workers it reads the true transfer less those, and the expected transfer line is worked
//!   out the same way from the true profile ([`transfer_model`]).
//! - **Timing resolution.** The workers, their engine thread and the profiler's client share
//!   two cores; what is left beyond the standard errors is allowed for explicitly
//!   ([`Check::allowance`]).
//! - **Streaming.** The simulated workers stream the first token, then the rest in one chunk:
//!   the decode step is read as the mean gap of the last stream to start (its first token
//!   comes once every stream has prefilled, and all of them then decode in step).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvc_core::openai::{VllmApi, nixl_prefill_body};
use kvc_core::{EngineKind, EvictionMode, StateSource, Topology};
use kvc_engine_sim::ClusterSpec;
use kvc_engine_sim::http::{HttpWorkers, StandaloneOptions, WorkerOptions};
use kvc_engine_sim::model::Profile;
use kvc_replay::profile::fit::{Line, PrefillLine, fit_sweep, least_squares_two};
use kvc_replay::profile::plan::{Limits, Plan, Prompts};
use kvc_replay::profile::{
    FitReport, PdUrls, ProfileError, ProfileOptions, fit_json_path, profile_engine, write_profile,
};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Block size of the simulated workers' prefix caches and of their `/metrics`.
const BLOCK: u64 = 16;

/// The sweep's limits: contexts up to 4,096 tokens, prefill chunks of 2,048.
const MAX_CONTEXT: u64 = 4096;
const CHUNK: u64 = 2048;

/// Measurements of each point: the median of three sets aside one delayed by the machine's
/// other work.
const REPEATS: usize = 3;

/// Distinct snapshot folders for the workers of one test process.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// Held by each test that profiles workers on the real clock: two at once would share the
/// machine's two cores, and each one's timing with it.
static REAL_CLOCK: Mutex<()> = Mutex::new(());

/// The prefill sweep's warning when it keeps one efficiency for all FLOPs.
const ONE_EFFICIENCY_KEPT: &str = "one efficiency kept for all prefill FLOPs";

/// The simulated engines' profile: the default model and hardware facts with factors chosen
/// so the whole sweep takes well under a minute: a prefill of 2,048 new tokens ~130 ms,
/// decode steps of 9–18 ms, a 4,080-token transfer ~240 ms.
fn true_profile() -> Profile {
    let mut p = Profile {
        name: "profiled-sim".into(),
        ..Profile::default()
    };
    p.fit.prefill_efficiency = 0.15;
    p.fit.prefill_overhead_ms = 30.0;
    p.fit.decode_efficiency = 0.7;
    p.fit.decode_overhead_ms = 6.0;
    p.fit.chunk_tokens = CHUNK;
    p.fit.transfer_bytes_per_s = 2e9;
    p.fit.transfer_setup_ms = 40.0;
    // A chat prompt waits 20 ms + 10 ms per 1,000 tokens before the scheduler sees it (the
    // workers sleep that long); token ids go straight in.
    p.fit.intake_ms = 20.0;
    p.fit.intake_ms_per_1k_tokens = 10.0;
    p
}

/// The true profile at infinite speed: a prefill iteration, a decode step and a transfer
/// cost their fixed costs alone. What a request takes beyond those on such workers is their
/// serving cost (including the engine thread's wake-up after sleeping through them).
fn fixed_cost_profile() -> Profile {
    let mut p = true_profile();
    p.hardware.peak_flops = 1e30;
    p.hardware.hbm_bytes_per_s = 1e30;
    p.fit.transfer_bytes_per_s = 1e30;
    p
}

/// Standalone simulated vLLM workers of `topology` running `profile` on `rt`, with
/// vLLM-named `/metrics` when `metrics`.
fn start(
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    topology: &str,
    metrics: bool,
    profile: Profile,
) -> HttpWorkers {
    let standalone = StandaloneOptions::default();
    assert_eq!(u64::from(standalone.block_size.tokens()), BLOCK);
    let cluster = ClusterSpec {
        topology: topology.parse::<Topology>().unwrap(),
        local_prefill: true,
        profile,
        eviction: EvictionMode::IdleLru,
        seed: 0,
        jitter: 0.0,
        block_size: standalone.block_size,
    };
    let snapshots = dir.join(format!(
        "{topology}-{}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&snapshots).unwrap();
    let opts = WorkerOptions {
        speedup: 1.0,
        http_base_port: None,
        bootstrap_base_port: None,
        snapshot_dir: snapshots,
        table_slots: 64,
        model: "sim-model".into(),
        router_state: if metrics {
            StateSource::Events
        } else {
            StateSource::Snapshot
        },
        engine_base_port: None,
        engine: EngineKind::Vllm,
        faults: Default::default(),
        pd_shim: false,
    };
    HttpWorkers::start_standalone(rt.handle(), &cluster, &opts, standalone).expect("workers start")
}

/// A temporary folder, removed with the value.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kvc-profile-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

/// Posts `body` to `url`: seconds to the first streamed chunk that carries a choice (or to
/// the whole answer), and a whole answer's JSON.
async fn timed_post(client: &Client, url: &str, body: &Value, request_id: &str) -> (f64, Value) {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .header("x-request-id", request_id)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let sent = Instant::now();
    let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("an answer in time")
        .expect("an answer");
    assert!(resp.status().is_success(), "{url}: {}", resp.status());
    let mut answer = resp.into_body();
    let mut seen = Vec::new();
    let mut first = None;
    while let Some(frame) = answer.frame().await {
        if let Some(d) = frame.unwrap().data_ref() {
            seen.extend_from_slice(d);
            if first.is_none() && String::from_utf8_lossy(&seen).contains("\"choices\":[{") {
                first = Some(sent.elapsed().as_secs_f64());
            }
        }
    }
    if body["stream"] == true {
        (first.expect("a token chunk"), Value::Null)
    } else {
        (
            sent.elapsed().as_secs_f64(),
            serde_json::from_slice(&seen).unwrap(),
        )
    }
}

fn completion(tokens: &[u32], max_tokens: u64, stream: bool) -> Value {
    let mut b = json!({"model": "sim-model", "prompt": tokens, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": true, "stream": stream});
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What the simulated workers' serving adds to the engine model's time, measured on workers
/// running [`fixed_cost_profile`], less the fixed costs.
#[derive(Debug)]
struct ServingCost {
    /// A colocated worker's time to the first token for a prompt of `T` tokens, beyond its one
    /// prefill iteration: `a + b T`.
    colocated: Line,
    /// By prompt length: P's round trip, and D's time to the first token beyond P's one
    /// iteration and the transfer's setup, of the two P/D calls (P's cache warmed first).
    pair: Vec<(u64, f64, f64)>,
    /// What a chat costs the colocated worker beyond a token-id prompt of as many tokens
    /// and the intake it sleeps (the text's path: template, words, the timer's tick), as
    /// (ms, ms per 1,000 prompt tokens): the intake sweep reads it as intake.
    intake_excess: (f64, f64),
}

fn serving_cost(
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    transfer_sizes: &[u64],
    intake_words: &[u64],
) -> ServingCost {
    let truth = true_profile();
    let iteration = truth.fit.prefill_overhead_ms / 1e3;
    let setup = truth.fit.transfer_setup_ms / 1e3;
    let colocated = start(rt, dir, "1dp", false, fixed_cost_profile());
    let pair = start(rt, dir, "1p1d", false, fixed_cost_profile());
    let client: Client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(kvc_engine_sim::http::connector());
    let prompts = Prompts::new(99);
    let mut next = 0;
    let mut prompt = |len: u64| {
        next += 1;
        (next, prompts.tokens(next, len))
    };
    let url = format!("http://{}/v1/completions", colocated.addrs()[0]);
    let mut points = Vec::new();
    // As the prefill sweep sends them: new tokens within one chunk, after a cached prefix.
    for (new, cached) in [
        (64, 0),
        (512, 0),
        (1024, 0),
        (2048, 0),
        (1024, 2048),
        (2048, 2048),
    ] {
        let times: Vec<f64> = (0..5)
            .map(|i| {
                let (n, tokens) = prompt(new + cached);
                if cached > 0 {
                    let warm = completion(&prompts.tokens(n, cached), 1, false);
                    rt.block_on(timed_post(&client, &url, &warm, &format!("w{n}")));
                }
                let b = completion(&tokens, 1, true);
                rt.block_on(timed_post(&client, &url, &b, &format!("c{n}-{i}")))
                    .0
                    - iteration
            })
            .collect();
        points.push(((new + cached) as f64, median(times)));
    }
    // Under heavy contention the cost's growth with the prompt (half a microsecond a token)
    // can drown in the noise: then it is taken as the same for every prompt, the points'
    // median.
    // As the intake sweep sends them: a chat of three-letter words and a token-id prompt of
    // as many tokens, both cached, timed in turn.
    let mut excess = Vec::new();
    for &words in intake_words {
        let (n, _) = prompt(0);
        let chat = json!({
            "model": "sim-model",
            "messages": [{ "role": "user", "content": prompts.words(n, words) }],
            "max_tokens": 1,
            "temperature": 0.0,
            "stream": false,
        });
        let chat_url = format!("http://{}/v1/chat/completions", colocated.addrs()[0]);
        let (_, answer) = rt.block_on(timed_post(&client, &chat_url, &chat, &format!("t{n}")));
        let tokens = answer["usage"]["prompt_tokens"]
            .as_u64()
            .expect("prompt_tokens");
        let ids = completion(&prompts.tokens(n, tokens), 1, false);
        rt.block_on(timed_post(&client, &url, &ids, &format!("i{n}")));
        let intake =
            truth.fit.intake_ms / 1e3 + truth.fit.intake_ms_per_1k_tokens * tokens as f64 / 1e6;
        let diffs: Vec<f64> = (0..5)
            .map(|i| {
                let id = format!("x{n}-{i}");
                let text = rt.block_on(timed_post(&client, &chat_url, &chat, &id)).0;
                let as_ids = rt.block_on(timed_post(&client, &url, &ids, &id)).0;
                text - as_ids - intake
            })
            .collect();
        excess.push((tokens as f64, median(diffs)));
    }
    let intake_excess = match excess.len() {
        0 => (0.0, 0.0),
        _ => {
            let (a, b) = ordinary_least_squares(&excess);
            (a * 1e3, b * 1e6)
        }
    };
    let colocated_line = match fit_sweep("calibration", &points) {
        Ok(fit) => fit.line,
        Err(e) => {
            eprintln!("serving cost taken as a constant: {e}");
            Line {
                intercept: median(points.iter().map(|p| p.1).collect()),
                slope: 0.0,
                intercept_se: 0.0,
                slope_se: 0.0,
                through_origin: false,
            }
        }
    };
    let (p_url, d_url) = (
        format!("http://{}/v1/completions", pair.addrs()[0]),
        format!("http://{}/v1/completions", pair.addrs()[1]),
    );
    let mut pd = Vec::new();
    for &n in transfer_sizes {
        let (mut ps, mut ds) = (Vec::new(), Vec::new());
        for i in 0..5 {
            let (_, tokens) = prompt(n);
            let id = format!("cal-{n}-{i}");
            rt.block_on(timed_post(
                &client,
                &p_url,
                &completion(&tokens, 1, false),
                &id,
            ));
            let original = completion(&tokens, 2, true);
            let p_body = Value::Object(nixl_prefill_body(
                original.as_object().unwrap(),
                VllmApi::Completions,
            ));
            let (p_rt, p_answer) = rt.block_on(timed_post(&client, &p_url, &p_body, &id));
            let mut d_body = original;
            d_body["kv_transfer_params"] = p_answer["kv_transfer_params"].clone();
            let (d, _) = rt.block_on(timed_post(&client, &d_url, &d_body, &id));
            ps.push(p_rt);
            ds.push(d - iteration - setup);
        }
        pd.push((n, median(ps), median(ds)));
    }
    colocated.stop().unwrap();
    pair.stop().unwrap();
    ServingCost {
        colocated: colocated_line,
        pair: pd,
        intake_excess,
    }
}

/// The intercept and slope of the least-squares line through `points` (any signs).
fn ordinary_least_squares(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let (mx, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - slope * mx, slope)
}

/// What the profiler reads as the transfer of `n` tokens on the simulated pair, by the
/// engine model alone: D's first token comes after P's one iteration (the prompt cached) and
/// the transfer; the profiler takes off a decode step and one block's prefill.
fn transfer_model(truth: &Profile, n: u64) -> f64 {
    truth.prefill_seconds([(0, n)]) + truth.transfer_seconds(n)
        - truth.decode_step_seconds(1, n)
        - truth.prefill_seconds([(BLOCK, n - BLOCK)])
}

/// One factor's check: the fitted value, its reported standard error, the engine model's
/// value, and the values with the workers' serving cost included (one per measurement of
/// that cost in the run).
struct Check {
    key: &'static str,
    fitted: f64,
    stderr: f64,
    model: f64,
    served: Vec<f64>,
    /// The noise of the sweep's own measurements in the factor's unit ([`sweep_noise`]).
    noise: f64,
}

impl Check {
    /// The timing resolution allowed beyond the standard errors: the workers, their engine
    /// thread and the profiler's client share the machine's two cores, so a stream's chunks
    /// reach the client a fraction of a millisecond late when others end at the same moment
    /// (a decode batch finishing), and more so on a loaded machine — 2 ms on a fixed cost,
    /// 3 % on a rate (a run on a quiet machine stays within 0.75 ms and 1 %).
    ///
    /// On a busy machine the repeats of one point scatter by more than that: the allowance is
    /// then the noise the sweep's own repeats show ([`sweep_noise`]).
    fn allowance(&self) -> f64 {
        let base = if self.key.ends_with("_ms") {
            2.0
        } else {
            0.03 * self.model
        };
        base.max(self.noise)
    }

    /// The envelope the fitted value must lie in: the model's value and every served one,
    /// widened by three standard errors, the allowance and how far the served values of the
    /// two measurements of the serving cost lie apart (the expected value's own noise).
    fn envelope(&self) -> (f64, f64) {
        let (s_lo, s_hi) = self
            .served
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &s| (lo.min(s), hi.max(s)));
        let slack = 3.0 * self.stderr + self.allowance() + (s_hi - s_lo);
        let (lo, hi) = self
            .served
            .iter()
            .fold((self.model, self.model), |(lo, hi), &s| {
                (lo.min(s), hi.max(s))
            });
        (lo - slack, hi + slack)
    }

    /// The fitted value, if it lies outside [`Check::envelope`].
    fn problems(&self) -> Option<String> {
        let (lo, hi) = self.envelope();
        (!(lo..=hi).contains(&self.fitted)).then(|| {
            format!(
                "{}: fitted {} ± {}, outside [{lo}, {hi}] (model {}, with serving cost {:?}; \
                 {:.1} % off the model)",
                self.key,
                self.fitted,
                self.stderr,
                self.model,
                self.served,
                (self.fitted - self.model).abs() / self.model * 100.0
            )
        })
    }

    /// The same factor's check with the values served under another measurement of the
    /// serving cost added.
    fn and_served(mut self, other: Check) -> Check {
        assert_eq!(self.key, other.key);
        self.served.extend(other.served);
        self
    }
}

/// Each factor's check with the served values of both measurements of the serving cost.
fn merged(before: Vec<Check>, after: Vec<Check>) -> Vec<Check> {
    assert_eq!(before.len(), after.len());
    before
        .into_iter()
        .zip(after)
        .map(|(b, a)| b.and_served(a))
        .collect()
}

fn factor(report: &Value, sweep: &str, key: &str) -> (f64, f64) {
    let f = report[sweep]["factors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["key"] == key)
        .unwrap_or_else(|| panic!("{sweep} has {key}"));
    (f["value"].as_f64().unwrap(), f["stderr"].as_f64().unwrap())
}

/// The runtime each real-clock test runs its workers and the profiler on.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn the_profiler_recovers_the_simulated_engines_profile() {
    let _clock = REAL_CLOCK.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    let dir = TempDir::new("sim");
    let truth = true_profile();
    let plan = Plan::new(&Limits {
        chunk_tokens: CHUNK,
        context_cap: MAX_CONTEXT,
        pool_tokens: truth.hardware.kv_pool_tokens,
        block_size: BLOCK,
        decode_tokens: 32,
        repeats: REPEATS,
        transfer: true,
    })
    .unwrap();
    let started = Instant::now();
    let cost = serving_cost(&rt, &dir.0, &plan.transfer, &plan.intake);
    let colocated = start(&rt, &dir.0, "1dp", true, truth.clone());
    let pair = start(&rt, &dir.0, "1p1d", false, truth.clone());
    let mut opts = ProfileOptions::new(format!("http://{}/", colocated.addrs()[0]));
    opts.metrics_url = Some(colocated.engine_urls()[0].metrics_url.clone());
    opts.pair = Some(PdUrls {
        prefill: format!("http://{}", pair.addrs()[0]),
        decode: format!("http://{}", pair.addrs()[1]),
    });
    opts.chunk_tokens = Some(CHUNK);
    opts.max_context = MAX_CONTEXT;
    opts.repeats = REPEATS;
    opts.seed = 7;
    let mut lines = Vec::new();
    let run = profile_engine(&opts, &mut |l: &str| lines.push(l.to_owned()))
        .expect("the profile is measured");
    colocated.stop().unwrap();
    pair.stop().unwrap();
    let cost_after = serving_cost(&rt, &dir.0, &plan.transfer, &plan.intake);
    let wall = started.elapsed();

    // The engine's own facts, the plan's size and the progress lines.
    let r = &run.report;
    assert_eq!(r.engine.model, "sim-model");
    assert_eq!((r.engine.block_size, r.engine.pool_tokens), (BLOCK, 92_160));
    assert_eq!(r.context_cap, MAX_CONTEXT);
    assert_eq!(r.requests, plan.requests());
    let measured =
        (plan.prefill.len() + plan.decode.len() + plan.transfer.len() + plan.intake.len())
            * REPEATS;
    assert_eq!(
        lines.iter().filter(|l| l.contains("(repeat")).count(),
        measured,
        "one line per measurement: {lines:#?}"
    );
    // The engine runs attention at the prefill efficiency: at most the prefill fit's word
    // that it kept one efficiency for all FLOPs.
    assert!(
        r.warnings
            .iter()
            .all(|w| w.starts_with("prefill:") && w.contains(ONE_EFFICIENCY_KEPT)),
        "{:?}",
        r.warnings
    );
    // The cached prefixes were found cached, the fresh prompts were not.
    for p in r.prefill.points.iter() {
        let want = p.inputs["cached_tokens"].as_u64().unwrap();
        for got in p.seen["reported_cached_tokens"].as_array().unwrap() {
            assert_eq!(got.as_u64(), Some(want), "{p:?}");
        }
    }
    assert_eq!(
        r.transfer.as_ref().unwrap().points.len(),
        plan.transfer.len()
    );
    // The profile written, read back.
    let out = dir.0.join("sim.toml");
    let json_path = write_profile(&run, &out).expect("the profile is written");
    assert_eq!(json_path, dir.0.join("sim.fit.json"));
    assert_eq!(json_path, fit_json_path(&out));
    let loaded = Profile::load(&out).expect("the written profile loads");
    assert_eq!(loaded, run.profile);
    assert_eq!(loaded.model, truth.model);
    assert_eq!(loaded.fit.pressure, truth.fit.pressure);
    assert_eq!(loaded.fit.chunk_tokens, CHUNK);
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.starts_with("# Engine profile measured by `kvc-replay profile`"));
    assert!(text.contains("(model sim-model)"), "{text}");
    assert!(text.contains("# Fit residuals"), "{text}");
    for sweep in ["prefill", "decode", "transfer"] {
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("#   {sweep} ")))
            .unwrap_or_else(|| panic!("a residual row for {sweep}: {text}"));
        assert!(row.contains("RMS") && row.contains("max"), "{row}");
    }
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let points = report["prefill"]["points"].as_array().unwrap();
    assert_eq!(points.len(), plan.prefill.len());
    for p in points {
        assert_eq!(p["measured_s"].as_array().unwrap().len(), REPEATS);
        let (m, f) = (
            p["median_s"].as_f64().unwrap(),
            p["fitted_s"].as_f64().unwrap(),
        );
        assert!((p["residual"].as_f64().unwrap() - (f - m) / m).abs() < 1e-12);
    }
    let prefill_line = prefill_fit_reported(r, &report);
    // Attention fitted apart only when its efficiency differs from the prefill efficiency by
    // more than a standard error; then it is written, else not, and the warning says so.
    if prefill_line.separate_attention {
        let (value, _) = factor(&report, "prefill", "fit.attention_efficiency");
        // Through the profile's TOML the value may come back an ulp away.
        let written = loaded.fit.attention_efficiency.expect("written");
        assert!(
            (written - value).abs() <= 1e-12 * value,
            "{written} vs {value}"
        );
        assert!(text.contains("fit.attention_efficiency = "), "{text}");
    } else {
        assert_eq!(loaded.fit.attention_efficiency, None);
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    }

    // What the profiler should see, with the serving cost of either measurement.
    let fitted = &run.profile;
    let mut checks = merged(
        prefill_checks(r, &report, &truth, &cost.colocated),
        prefill_checks(r, &report, &truth, &cost_after.colocated),
    );
    checks.extend(decode_checks(&report, &truth));
    checks.extend(merged(
        transfer_checks(&report, &truth, fitted, &plan.transfer, &cost),
        transfer_checks(&report, &truth, fitted, &plan.transfer, &cost_after),
    ));
    // The intake: the workers' own sleep, plus what a chat's path costs them beyond a
    // token-id prompt's (its template and words, and the timer's tick: tokio's sleeps end on
    // a millisecond tick, up to 1 ms late), measured in the serving cost (`intake_excess`:
    // on a quiet machine about a millisecond, and nothing that grows with the prompt), plus
    // what the prefill fit, which the profiler takes off, leaves out of a prompt served from
    // cache: the workers read and hash every token of it (the serving cost's slope), while
    // the fit puts that cost of cached tokens into attention, which for the one uncached
    // block of an intake point is next to nothing. Left out, that read the fitted growth
    // as 10 % off on a quiet machine, every time.
    let intake = r.intake.as_ref().expect("the intake sweep");
    assert_eq!(intake.points.len(), plan.intake.len());
    for p in &intake.points {
        let words = p.inputs["words"].as_u64().unwrap();
        // The workers serve no `/detokenize`: the chat is words, and their chat template adds
        // the role's token to them.
        assert_eq!(p.inputs["text"], "three-letter words", "{p:?}");
        assert_eq!(p.seen["prompt_tokens"].as_u64(), Some(words + 2), "{p:?}");
        assert_eq!(p.measured_s.len(), REPEATS);
    }
    // The profile holds the fitted factors (through its TOML: to an ulp).
    for (written, key) in [
        (fitted.fit.intake_ms, "fit.intake_ms"),
        (
            fitted.fit.intake_ms_per_1k_tokens,
            "fit.intake_ms_per_1k_tokens",
        ),
    ] {
        let value = factor(&report, "intake", key).0;
        assert!(
            (written - value).abs() <= 1e-12 * value.abs(),
            "{key}: {written} vs {value}"
        );
    }
    checks.extend(
        [
            ("fit.intake_ms", truth.fit.intake_ms),
            (
                "fit.intake_ms_per_1k_tokens",
                truth.fit.intake_ms_per_1k_tokens,
            ),
        ]
        .map(|(key, model)| {
            let served = |c: &ServingCost| {
                if key == "fit.intake_ms" {
                    model + c.intake_excess.0
                } else {
                    model + c.intake_excess.1 + c.colocated.slope * 1e6
                }
            };
            check(&report, "intake", key, model, served(&cost)).and_served(check(
                &report,
                "intake",
                key,
                model,
                served(&cost_after),
            ))
        }),
    );
    let table = table(&checks);
    eprintln!(
        "serving cost measured and engines profiled in {:.1} s, the sweep {:.1} s (serving \
         cost {:.3} ms + {:.3} µs per prompt token before, {:.3} ms + {:.3} µs after; \
         a chat's excess {:.3} ms + {:.3} ms per 1K tokens before, {:.3} + {:.3} after; \
         configured transfer {} B/s, {} ms)\n{}",
        wall.as_secs_f64(),
        r.wall_s,
        cost.colocated.intercept * 1e3,
        cost.colocated.slope * 1e6,
        cost_after.colocated.intercept * 1e3,
        cost_after.colocated.slope * 1e6,
        cost.intake_excess.0,
        cost.intake_excess.1,
        cost_after.intake_excess.0,
        cost_after.intake_excess.1,
        truth.fit.transfer_bytes_per_s,
        truth.fit.transfer_setup_ms,
        table
    );
    let problems: Vec<String> = checks.iter().filter_map(Check::problems).collect();
    assert!(problems.is_empty(), "{problems:#?}\n{lines:#?}");
}

/// The prefill sweep's fit as reported, checked against its points: each point's fitted time
/// is the fit's at the point's linear and attention FLOPs, and the factors are the fit's.
fn prefill_fit_reported(r: &FitReport, report: &Value) -> PrefillLine {
    let line = r.prefill.prefill_line.expect("the prefill sweep's fit");
    for p in &r.prefill.points {
        let a = p
            .attention_flops
            .expect("a prefill point's attention FLOPs");
        let t = line.at(p.x - a, a);
        assert!((p.fitted_s - t).abs() <= 1e-12 * t, "{p:?}");
    }
    let keys: Vec<&str> = report["prefill"]["factors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["key"].as_str().unwrap())
        .collect();
    let mut want = vec!["fit.prefill_efficiency", "fit.prefill_overhead_ms"];
    if line.separate_attention {
        want.insert(1, "fit.attention_efficiency");
    }
    assert_eq!(keys, want);
    assert_eq!(
        r.prefill.one_efficiency_residuals.is_some(),
        line.separate_attention
    );
    line
}

/// The prefill factors' checks. What the profiler should see is the engine model's time plus
/// the serving cost (`cost`, by prompt tokens) at each point, fitted the way the profiler
/// fitted its points (attention apart or not). The serving cost grows with the cached tokens
/// too, which a fit with attention apart reads as slower attention (by about 7 % with
/// [`true_profile`]'s factors). With no attention efficiency of its own, the engine model
/// runs attention at the prefill efficiency.
fn prefill_checks(r: &FitReport, report: &Value, truth: &Profile, cost: &Line) -> Vec<Check> {
    let fitted = r.prefill.prefill_line.expect("the prefill sweep's fit");
    let points: Vec<(f64, f64, f64)> = r
        .prefill
        .points
        .iter()
        .map(|p| {
            let n = p.inputs["new_tokens"].as_u64().unwrap();
            let c = p.inputs["cached_tokens"].as_u64().unwrap();
            let a = p.attention_flops.unwrap();
            let t = truth.prefill_seconds([(n, c)]) + cost.at((n + c) as f64);
            (p.x - a, a, t)
        })
        .collect();
    let served = if fitted.separate_attention {
        least_squares_two(&points, false).expect("the served times' fit")
    } else {
        let total: Vec<(f64, f64)> = points.iter().map(|&(l, a, t)| (l + a, t)).collect();
        PrefillLine::one_rate(&fit_sweep("prefill", &total).unwrap().line)
    };
    let peak = truth.hardware.peak_flops;
    let mut checks = vec![
        check(
            report,
            "prefill",
            "fit.prefill_efficiency",
            truth.fit.prefill_efficiency,
            1.0 / (served.linear_slope * peak),
        ),
        check(
            report,
            "prefill",
            "fit.prefill_overhead_ms",
            truth.fit.prefill_overhead_ms,
            served.intercept * 1e3,
        ),
    ];
    if fitted.separate_attention {
        checks.push(check(
            report,
            "prefill",
            "fit.attention_efficiency",
            truth
                .fit
                .attention_efficiency
                .unwrap_or(truth.fit.prefill_efficiency),
            1.0 / (served.attention_slope * peak),
        ));
    }
    checks
}

/// The transfer factors' checks. The model's line is the true transfer less what the
/// profiler takes off for vLLM ([`transfer_model`]); the served line adds what the pair's
/// serving cost (`cost`) adds to D's first token, and takes off the decode step and P's
/// one-block prefill the profiler takes off with its own fitted profile (`fitted`), less what
/// P's round trip already covered.
fn transfer_checks(
    report: &Value,
    truth: &Profile,
    fitted: &Profile,
    sizes: &[u64],
    cost: &ServingCost,
) -> Vec<Check> {
    let kv = truth.kv_bytes_per_token();
    let model = fit_sweep(
        "transfer",
        &sizes
            .iter()
            .map(|&n| (n as f64 * kv, transfer_model(truth, n)))
            .collect::<Vec<_>>(),
    )
    .unwrap()
    .line;
    let served = fit_sweep(
        "transfer",
        &cost
            .pair
            .iter()
            .map(|&(n, p_rt, d_serving)| {
                let d = truth.prefill_seconds([(0, n)]) + truth.transfer_seconds(n) + d_serving;
                let step = fitted.decode_step_seconds(1, n);
                let p_prefill = fitted.prefill_seconds([(BLOCK, n - BLOCK)]);
                (n as f64 * kv, d - step - (p_prefill - p_rt).max(0.0))
            })
            .collect::<Vec<_>>(),
    )
    .unwrap()
    .line;
    // Bytes/s and setup ms of each transfer line.
    vec![
        check(
            report,
            "transfer",
            "fit.transfer_bytes_per_s",
            1.0 / model.slope,
            1.0 / served.slope,
        ),
        check(
            report,
            "transfer",
            "fit.transfer_setup_ms",
            model.intercept * 1e3,
            served.intercept * 1e3,
        ),
    ]
}

/// The decode factors' checks: nothing of the serving cost shows in a decode step.
fn decode_checks(report: &Value, truth: &Profile) -> [Check; 2] {
    [
        ("fit.decode_efficiency", truth.fit.decode_efficiency),
        ("fit.decode_overhead_ms", truth.fit.decode_overhead_ms),
    ]
    .map(|(key, model)| check(report, "decode", key, model, model))
}

/// The check of `sweep`'s factor `key` as reported.
fn check(report: &Value, sweep: &str, key: &'static str, model: f64, served: f64) -> Check {
    let (fitted, stderr) = factor(report, sweep, key);
    let noise = sweep_noise(report, sweep);
    Check {
        key,
        fitted,
        stderr,
        model,
        served: vec![served],
        noise: if key.ends_with("_ms") {
            noise.rel * noise.typical_s * 1e3
        } else if key.ends_with("_per_1k_tokens") {
            noise.abs_s * 1e3 / (noise.x_range / 1e3)
        } else {
            noise.rel * model
        },
    }
}

/// How much a sweep's measurements scatter in this run ([`sweep_noise`]).
struct SweepNoise {
    /// The median over its points of the spread of a point's repeats relative to their
    /// median (a quiet machine: about 1 %).
    rel: f64,
    /// The same spread in seconds.
    abs_s: f64,
    /// The median time of its points (s).
    typical_s: f64,
    /// How far its points' sizes (`x`) range.
    x_range: f64,
}

/// How much `sweep`'s measurements scatter in this run. A factor fitted from points that
/// scatter by a share `r` can be off by about `r` of a rate, or `r` of a typical point's time
/// on a fixed cost, and a growth per token by about a point's spread over the sizes' range,
/// beyond what its standard error (from the medians' residuals, of as few as three points)
/// says.
fn sweep_noise(report: &Value, sweep: &str) -> SweepNoise {
    let points = report[sweep]["points"]
        .as_array()
        .expect("the sweep's points");
    let mut spreads = Vec::new();
    let mut abs_spreads = Vec::new();
    let mut medians = Vec::new();
    let (mut x_lo, mut x_hi) = (f64::MAX, f64::MIN);
    for p in points {
        let x = p["x"].as_f64().expect("a point's size");
        (x_lo, x_hi) = (x_lo.min(x), x_hi.max(x));
        let times: Vec<f64> = p["measured_s"]
            .as_array()
            .expect("a point's measurements")
            .iter()
            .map(|t| t.as_f64().unwrap())
            .collect();
        let (lo, hi) = times
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &t| (lo.min(t), hi.max(t)));
        let m = median(times);
        medians.push(m);
        spreads.push((hi - lo) / m);
        abs_spreads.push(hi - lo);
    }
    SweepNoise {
        rel: median(spreads),
        abs_s: median(abs_spreads),
        typical_s: median(medians),
        x_range: x_hi - x_lo,
    }
}

/// One line per check.
fn table(checks: &[Check]) -> String {
    checks
        .iter()
        .map(|c| {
            format!(
                "{:<26} fitted {:>12.6} ± {:<10.4e} model {:>12.6}  with serving cost {}",
                c.key,
                c.fitted,
                c.stderr,
                c.model,
                c.served
                    .iter()
                    .map(|s| format!("{s:>12.6}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// An engine whose prefill attention runs at a third of the efficiency of its linear work:
/// the profiler fits attention apart, writes `fit.attention_efficiency`, and the factors come
/// back as in [`the_profiler_recovers_the_simulated_engines_profile`] (a colocated worker
/// alone: no transfer).
#[test]
fn the_profiler_recovers_an_attention_efficiency_of_its_own() {
    let _clock = REAL_CLOCK.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    let dir = TempDir::new("attention");
    let mut truth = true_profile();
    truth.fit.attention_efficiency = Some(0.05);
    let started = Instant::now();
    let cost = serving_cost(&rt, &dir.0, &[], &[]);
    let colocated = start(&rt, &dir.0, "1dp", true, truth.clone());
    let mut opts = ProfileOptions::new(format!("http://{}", colocated.addrs()[0]));
    opts.metrics_url = Some(colocated.engine_urls()[0].metrics_url.clone());
    opts.chunk_tokens = Some(CHUNK);
    opts.max_context = MAX_CONTEXT;
    opts.repeats = REPEATS;
    opts.seed = 11;
    let mut lines = Vec::new();
    let run = profile_engine(&opts, &mut |l: &str| lines.push(l.to_owned()))
        .expect("the profile is measured");
    colocated.stop().unwrap();
    let cost_after = serving_cost(&rt, &dir.0, &[], &[]);
    let wall = started.elapsed();

    let r = &run.report;
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert!(r.transfer.is_none());
    let report = serde_json::to_value(r).unwrap();
    let line = prefill_fit_reported(r, &report);
    assert!(line.separate_attention, "{lines:#?}");
    let (attention, _) = factor(&report, "prefill", "fit.attention_efficiency");
    assert_eq!(run.profile.fit.attention_efficiency, Some(attention));
    assert_eq!(
        r.prefill.model,
        kvc_replay::profile::report::PREFILL_MODEL_SPLIT
    );
    // One efficiency for all FLOPs would miss these points by far more: its misfit is the
    // model's, not noise. Judged the way a statistician weighs an extra parameter (an F test
    // on the residual sums of squares, one parameter more, at p < 0.01), so that the noise of
    // a loaded machine, which raises both fits' residuals, does not decide: over 20 runs on
    // a quiet machine F came out 297 to 1,151, over 5 beside a release build 88 to 493. Only
    // where the noise swamps the model's misfit (seen at a load of three to four times the
    // cores: F near 6) can the test no longer tell the two fits apart.
    let one = r.prefill.one_efficiency_residuals.unwrap();
    let apart = r.prefill.residuals;
    assert_eq!(one.points, apart.points);
    let (rss_one, rss_apart) = (
        one.rms_rel.powi(2) * one.points as f64,
        apart.rms_rel.powi(2) * apart.points as f64,
    );
    let freedom = apart.points as f64 - 3.0;
    let f = (rss_one - rss_apart) / (rss_apart / freedom);
    assert_eq!(apart.points, 12, "the F bound below is for 12 points");
    // The 0.99 quantile of F(1, 9).
    const F_1_9_P99: f64 = 10.56;
    assert!(
        f > F_1_9_P99 && one.max_rel > 0.05,
        "F = {f:.1}: attention apart {apart:?}, one efficiency {one:?}"
    );
    assert!(lines.iter().any(|l| l.starts_with("prefill fit over")
        && l.contains("fit.attention_efficiency = ")
        && l.contains("one efficiency for all FLOPs: RMS")));
    // Written and read back with it.
    let out = dir.0.join("attention.toml");
    write_profile(&run, &out).expect("the profile is written");
    let loaded = Profile::load(&out).expect("the written profile loads");
    assert_eq!(loaded.fit.attention_efficiency, Some(attention));
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("#   prefill ") && l.contains("fit.attention_efficiency = ")),
        "{text}"
    );
    assert!(
        text.contains("(one efficiency for all prefill FLOPs would leave RMS"),
        "{text}"
    );

    let mut checks = merged(
        prefill_checks(r, &report, &truth, &cost.colocated),
        prefill_checks(r, &report, &truth, &cost_after.colocated),
    );
    checks.extend(decode_checks(&report, &truth));
    eprintln!(
        "serving cost measured and engine profiled in {:.1} s, the sweep {:.1} s; prefill \
         residuals RMS {:.2} %, max {:.2} % (one efficiency for all: RMS {:.2} %, max {:.2} %; \
         F = {f:.1})\n{}",
        wall.as_secs_f64(),
        r.wall_s,
        r.prefill.residuals.rms_rel * 100.0,
        r.prefill.residuals.max_rel * 100.0,
        one.rms_rel * 100.0,
        one.max_rel * 100.0,
        table(&checks)
    );
    let problems: Vec<String> = checks.iter().filter_map(Check::problems).collect();
    assert!(problems.is_empty(), "{problems:#?}\n{lines:#?}");
}

/// A server on a free loopback port answering `app`, on `rt`.
fn serve(rt: &tokio::runtime::Runtime, app: axum::Router) -> String {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

fn quick(url: String) -> ProfileOptions {
    let mut o = ProfileOptions::new(url);
    o.connect_timeout = Duration::from_secs(1);
    o.request_timeout = Duration::from_secs(5);
    o
}

#[test]
fn a_closed_port_or_a_server_that_is_not_vllm_is_named_in_a_clear_error() {
    // A port that was free a moment ago: nothing answers there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let err = profile_engine(&quick(url.clone()), &mut |_| {}).unwrap_err();
    assert!(matches!(err, ProfileError::NotReady(_)), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("{url}/health did not answer 2xx within 1 s")),
        "{text}"
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    use axum::routing::get;
    // Healthy, but no OpenAI model list.
    let no_models = serve(
        &rt,
        axum::Router::new()
            .route("/health", get(|| async { "ok" }))
            .route(
                "/v1/models",
                get(|| async {
                    (
                        axum::http::StatusCode::NOT_FOUND,
                        "{\"detail\":\"Not Found\"}",
                    )
                }),
            ),
    );
    let text = profile_engine(&quick(no_models.clone()), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        text.contains(&format!("{no_models}/v1/models answered 404"))
            && text.contains("expected an OpenAI model list")
            && text.contains("Not Found"),
        "{text}"
    );
    // A model list, but no vLLM cache metrics.
    let not_vllm = serve(
        &rt,
        axum::Router::new()
            .route("/health", get(|| async { "ok" }))
            .route(
                "/v1/models",
                get(|| async { "{\"object\": \"list\", \"data\": [{\"id\": \"m\"}]}" }),
            )
            .route("/metrics", get(|| async { "sglang:token_usage 0.1\n" })),
    );
    let text = profile_engine(&quick(not_vllm.clone()), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        text.contains(&format!("{not_vllm}/metrics"))
            && text.contains("vllm:cache_config_info")
            && text.contains("not a vLLM engine?"),
        "{text}"
    );
    // An empty model list.
    let empty = serve(
        &rt,
        axum::Router::new()
            .route("/health", get(|| async { "ok" }))
            .route(
                "/v1/models",
                get(|| async { "{\"object\": \"list\", \"data\": []}" }),
            ),
    );
    let text = profile_engine(&quick(empty.clone()), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        text.contains(&format!("{empty}/v1/models")) && text.contains("serves no model"),
        "{text}"
    );
}
