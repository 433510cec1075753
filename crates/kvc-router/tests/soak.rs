//! Soak: 1,000,000 `Route` decisions over 200,000 sessions whose every turn brings fresh block
//! ids (a third of them never reported), at the default limits (100,000 sessions, 100,000 pending decisions, the block view
//! bounded by the workers' pools). The calls go to the in-process `RouterService` (the gRPC
//! front adds per-call buffers that are freed with each call, not state): the router's
//! resident memory stays under 512 MiB and does not grow over the second half of the run.
//!
//! Alone in its test binary, so the resident set it reads (`/proc/self/statm`) is the
//! router's and this loop's only.
#![forbid(unsafe_code)]

mod common;

use common::{CAPACITY, START_MS, TempDir};
use kvc_admission::{ManualClock, SnapshotWriter};
use kvc_core::{BlockHash, Outcome, RequestId, SessionId, TurnId, WorkerId, WorkerRole};
use kvc_policy::RouteRequest;
use kvc_router::{DecisionOutcome, RouterConfig, RouterService, WorkerConfig};
use std::sync::Arc;

const CALLS: u64 = 1_000_000;
const SESSIONS: u64 = 200_000;
/// Sessions open at the same time, each batch taking its turns in rounds (a session's turns
/// are close together).
const BATCH: u64 = 1_000;
/// The first half of the sessions take 2 turns each, so the session table (100,000) is full
/// after the first 200,000 calls; the second half take 8 turns each, each new session
/// replacing the least recently seen one. Every session ends with the same context size
/// (`CONTEXT_BLOCKS`), so what the second half of the run adds to the tables, it frees.
const FIRST_TURNS: u64 = 2;
const LATER_TURNS: u64 = 8;
/// Blocks of a session's last turn; each turn brings `CONTEXT_BLOCKS / turns` new ones.
const CONTEXT_BLOCKS: u64 = 32;

/// Session, turn and the session's number of turns, of call `r`.
fn schedule(r: u64) -> (u64, u64, u64) {
    let first = SESSIONS / 2 * FIRST_TURNS;
    let (base, turns, r) = if r < first {
        (0, FIRST_TURNS, r)
    } else {
        (SESSIONS / 2, LATER_TURNS, r - first)
    };
    let (batch, within) = (r / (BATCH * turns), r % (BATCH * turns));
    (
        base + batch * BATCH + within % BATCH,
        within / BATCH + 1,
        turns,
    )
}

/// Resident memory samples over the run.
const SAMPLES: u64 = 100;
/// The documented bound (docs/production.md, "Memory bounds").
const RSS_BOUND_MIB: f64 = 512.0;

/// Resident set of this process in MiB, from `/proc/self/statm` (pages of 4 KiB).
fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("resident pages in statm");
    pages * 4096.0 / (1024.0 * 1024.0)
}

#[test]
fn a_million_decisions_over_fresh_blocks_stay_within_the_memory_bound() {
    if !std::path::Path::new("/proc/self/statm").exists() {
        eprintln!("soak: no /proc/self/statm on this system; skipped");
        return;
    }
    let dir = TempDir::new("soak");
    let clock = Arc::new(ManualClock::new(START_MS));
    let mut cfg = RouterConfig {
        metrics_listen: None,
        // The clock only moves when the loop moves it.
        stale_after_ms: 3_600_000,
        ..RouterConfig::default()
    };
    let roles = [
        WorkerRole::Prefill,
        WorkerRole::Prefill,
        WorkerRole::Decode,
        WorkerRole::Decode,
        WorkerRole::Decode,
        WorkerRole::Decode,
    ];
    let mut writers = Vec::new();
    for (i, role) in roles.into_iter().enumerate() {
        let path = dir.0.join(format!("w{i}.snap"));
        let mut w = SnapshotWriter::create(&path, WorkerId(i as u32), CAPACITY, 64).unwrap();
        let mut data = w.empty_data();
        data.free_tokens = CAPACITY;
        data.publish_ms = START_MS;
        w.publish(&data).unwrap();
        writers.push(w);
        cfg.workers.push(WorkerConfig {
            snapshot: Some(path),
            ..WorkerConfig::new(i as u32, role, CAPACITY)
        });
    }
    let svc = RouterService::with_clock(cfg, clock.clone()).unwrap();
    svc.refresh_workers();

    let mut samples = Vec::new();
    let mut blocks: Vec<BlockHash> = Vec::new();
    let mut directs = 0u64;
    for r in 0..CALLS {
        let (session, turn, turns) = schedule(r);
        // The session's context: every turn so far, each with blocks never seen before.
        blocks.clear();
        blocks.extend(
            (0..turn * CONTEXT_BLOCKS / turns).map(|k| BlockHash((session << 24) | (k << 4) | 1)),
        );
        let input = blocks.len() as u64 * 512;
        let req = RouteRequest::new(RequestId(r), input, 50, &blocks)
            .in_session(SessionId(session), TurnId(turn as u32));
        let d = svc.route(&req).unwrap();
        directs += u64::from(d.mode == kvc_core::ExecutionMode::DirectToD);
        // One request in three never reports (the pending table reaches its bound, 100,000,
        // within the first third of the run); the others keep their input resident.
        if r % 3 != 0 {
            svc.report_outcome(&DecisionOutcome {
                decision_id: d.decision_id,
                request_id: RequestId(r),
                outcome: Outcome::Ok,
                resident_tokens: input,
            })
            .unwrap();
        }
        if r % 1_000 == 999 {
            clock.advance(1);
        }
        if (r + 1) % (CALLS / SAMPLES) == 0 {
            samples.push(rss_mib());
        }
    }
    drop(writers);

    let quarter = samples.len() / 4;
    let max = |s: &[f64]| s.iter().copied().fold(0.0, f64::max);
    let second = max(&samples[quarter..2 * quarter]);
    let last = max(&samples[3 * quarter..]);
    let peak = max(&samples);
    eprintln!(
        "soak: {CALLS} decisions, {directs} direct-to-D; RSS MiB: first sample {:.1}, max of 2nd quarter {second:.1}, max of last quarter {last:.1}, peak {peak:.1}",
        samples[0]
    );
    assert_eq!(svc.session_count(), 100_000, "the session table is full");
    assert!(svc.pending_decisions() <= 100_000);
    assert!(
        directs > CALLS / 2 + CALLS / 10,
        "later turns go direct-to-D: {directs}"
    );
    assert_eq!(
        schedule(CALLS - 1),
        (SESSIONS - 1, LATER_TURNS, LATER_TURNS)
    );
    assert!(
        peak <= RSS_BOUND_MIB,
        "peak RSS {peak:.1} MiB over {RSS_BOUND_MIB} MiB"
    );
    assert!(
        last <= second * 1.1,
        "RSS grew over the second half: {second:.1} MiB -> {last:.1} MiB ({samples:?})"
    );
}
