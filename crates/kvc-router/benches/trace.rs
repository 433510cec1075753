//! The decision's cost with tracing off, on and not sampled, and on and sampled: a request
//! span opened from the client's headers (a `traceparent` with the sampled flag clear, or
//! set), the router's decision (`RouterService::route`, the same call the fronts make,
//! snapshot probe included) recorded on it, its outcome reported and recorded, the span
//! ended — what the HTTP front does around a decision, without the sockets.
//!
//! ```text
//! CARGO_TARGET_DIR=/work/tgt-router cargo bench -p kvc-router --bench trace -- \
//!     --warm-up-time 0.5 --measurement-time 2
//! ```
//!
//! Bench ids: `decision_trace/off`, `decision_trace/on_unsampled`, `decision_trace/on_sampled`
//! (one decision each, on one router: the three see the same state). After them it times
//! 100 blocks of 1,000 decisions of each traced mode, each block beside one with tracing off,
//! and writes to `KVC_BENCH_OUT` the median blocks in ns per decision and their ratios to
//! `off` (the
//! unsampled one must stay within 1.1× of it: tracing that samples nothing costs nothing
//! that matters). Sampled spans go to an exporter that drops them, so what is timed is the
//! router's side: ids, attributes, the hand-off to the batch processor.
//!
//! `KVC_BENCH_SMOKE=1` (`common::smoke`) shrinks the timed blocks to 3 of 50 decisions per
//! mode.
#![forbid(unsafe_code)]
#![allow(missing_docs)]

#[allow(dead_code)]
mod common;

use axum::http::{HeaderMap, HeaderValue};
use criterion::Criterion;
use kvc_core::{BlockHash, Outcome, RequestId, SessionId, TurnId};
use kvc_policy::RouteRequest;
use kvc_router::telemetry::{HeaderExtractor, Telemetry};
use kvc_router::{DecisionOutcome, RouterService, TracingConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use std::time::Instant;

const SESSIONS: u64 = 4_096;
/// Decisions of each timed block.
const CALLS: u64 = 1_000;
/// Timed blocks of each mode.
const BLOCKS: usize = 100;

/// The run's sizes: the full run's, or the smoke run's.
#[derive(Clone, Copy)]
struct Sizes {
    /// Decisions of each timed block.
    calls: u64,
    /// Timed blocks of each mode.
    blocks: usize,
}

fn sizes() -> Sizes {
    common::size(
        Sizes {
            calls: CALLS,
            blocks: BLOCKS,
        },
        Sizes {
            calls: 50,
            blocks: 3,
        },
    )
}

/// An exporter that drops every batch.
#[derive(Debug)]
struct Discard;

impl SpanExporter for Discard {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        drop(batch);
        Ok(())
    }
}

/// How a decision is traced.
#[derive(Clone, Copy)]
enum Mode {
    Off,
    Unsampled,
    Sampled,
}

/// One router service, decided on in every mode in turn (the same state for all three).
struct Fixture {
    service: RouterService,
    off: Telemetry,
    on: Telemetry,
    /// The client's headers: its `traceparent` with the sampled flag clear, and set.
    unsampled: HeaderMap,
    sampled: HeaderMap,
    next: u64,
    sizes: Sizes,
    _writers: Vec<kvc_admission::SnapshotWriter>,
}

/// A client's headers with a `traceparent` whose flags are `flags`.
fn client_headers(flags: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        "traceparent",
        HeaderValue::from_str(&format!(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}"
        ))
        .unwrap(),
    );
    headers.insert("x-session-id", HeaderValue::from_static("bench"));
    headers
}

impl Fixture {
    /// A router over one prefill and two decode workers, with tracing off and tracing on
    /// (every sampled span handed to [`Discard`]).
    fn new(sizes: Sizes) -> Fixture {
        let (cfg, writers, _) = common::one_p_two_d("trace-bench");
        let tracing = TracingConfig {
            otlp_endpoint: "http://127.0.0.1:4317".to_owned(),
            ..TracingConfig::default()
        };
        let on = Telemetry::with_exporter(Discard, &tracing, &cfg);
        let service = RouterService::new(cfg).expect("a valid configuration");
        service.refresh_workers();
        Fixture {
            service,
            off: Telemetry::off(),
            on,
            unsampled: client_headers("00"),
            sampled: client_headers("01"),
            next: 0,
            sizes,
            _writers: writers,
        }
    }

    /// One traced decision, as the HTTP front makes it.
    fn decide(&mut self, mode: Mode) {
        let r = self.next;
        self.next += 1;
        let session = r % SESSIONS;
        let turn = (r / SESSIONS) as u32 + 1;
        let base = session * 64;
        let hashes = [
            BlockHash(base + 1),
            BlockHash(base + 2),
            BlockHash(base + 3),
        ];
        let (telemetry, headers) = match mode {
            Mode::Off => (&self.off, &self.sampled),
            Mode::Unsampled => (&self.on, &self.unsampled),
            Mode::Sampled => (&self.on, &self.sampled),
        };
        let span =
            telemetry.request_span("kvc.request", "/v1/completions", &HeaderExtractor(headers));
        let req = RouteRequest::new(RequestId(r), 1_300, 40, &hashes)
            .in_session(SessionId(session), TurnId(turn));
        span.record_session(None, Some((SessionId(session), turn)));
        let d = self.service.route(&req).expect("a decision");
        span.record_decision(&d);
        self.service
            .report_outcome(&DecisionOutcome {
                decision_id: d.decision_id,
                request_id: RequestId(r),
                outcome: Outcome::Ok,
                resident_tokens: 1_340,
            })
            .expect("the outcome recorded");
        span.record_outcome(Outcome::Ok);
        span.record_status(200);
        drop(span);
    }

    /// ns per decision over a block of [`CALLS`] (fewer in the smoke run) in `mode`.
    fn run(&mut self, mode: Mode) -> f64 {
        let calls = self.sizes.calls;
        let started = Instant::now();
        for _ in 0..calls {
            self.decide(mode);
        }
        started.elapsed().as_nanos() as f64 / calls as f64
    }
}

/// The median of `runs`.
fn median(mut runs: Vec<f64>) -> f64 {
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

fn main() {
    let sizes = sizes();
    let mut f = Fixture::new(sizes);
    // Every session seen once before anything is timed.
    for _ in 0..SESSIONS {
        f.decide(Mode::Off);
    }
    let mut c = common::criterion_settings(Criterion::default()).configure_from_args();
    {
        let mut g = c.benchmark_group("decision_trace");
        g.bench_function("off", |b| b.iter(|| f.decide(Mode::Off)));
        g.bench_function("on_unsampled", |b| b.iter(|| f.decide(Mode::Unsampled)));
        g.bench_function("on_sampled", |b| b.iter(|| f.decide(Mode::Sampled)));
        g.finish();
    }
    c.final_summary();

    // Blocks of each mode interleaved, and the median block: another process's burst of work
    // lands on both modes of a pair alike. Sampled blocks are paired with off blocks of their
    // own, so their exports (on the batch processor's thread) do not weigh on the unsampled.
    let pairs = |f: &mut Fixture, on: Mode| {
        let (mut off, mut traced) = (Vec::new(), Vec::new());
        for _ in 0..sizes.blocks {
            off.push(f.run(Mode::Off));
            traced.push(f.run(on));
        }
        (median(off), median(traced))
    };
    let (o, u) = pairs(&mut f, Mode::Unsampled);
    let (o2, s) = pairs(&mut f, Mode::Sampled);
    println!(
        "decision: tracing off {o:.0} ns, on and not sampled {u:.0} ns ({:.3}x); off {o2:.0} ns, on and sampled {s:.0} ns ({:.3}x)",
        u / o,
        s / o2
    );
    f.on.shutdown();
    // `cargo xtask bench` reads these figures from the file named by KVC_BENCH_OUT.
    if let Some(path) = std::env::var_os("KVC_BENCH_OUT") {
        let json = format!(
            "{{\"trace_off_ns\": {o:.1}, \"trace_on_unsampled_ns\": {u:.1}, \"trace_on_sampled_ns\": {s:.1}, \"trace_on_unsampled_vs_off\": {:.4}, \"trace_on_sampled_vs_off\": {:.4}}}\n",
            u / o,
            s / o2
        );
        std::fs::write(&path, json).expect("write KVC_BENCH_OUT");
    }
}
