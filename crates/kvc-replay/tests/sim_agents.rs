//! Coding agents in the simulator: a subagent's first turn on its parent's decode worker, and
//! explicit session ends.

mod common;

use common::run_with;
use kvc_core::{ExecutionMode, SessionId, TurnId};
use kvc_replay::sim::SimOutput;
use kvc_replay::trace::{self, Trace};

/// A parent (session 1, two turns, the second `final` when `parent_ends`), its subagent
/// (session 2, sharing the parent's first three blocks) and, after the parent's end, another
/// child of it (session 3).
fn trace(parent_ends: bool) -> Trace {
    let line = |t: u64, s: u64, turn: u32, blocks: &[u64], extra: &str| {
        let ids: Vec<String> = blocks.iter().map(u64::to_string).collect();
        format!(
            "{{\"timestamp\": {t}, \"session_id\": {s}, \"turn_id\": {turn}, \"input_length\": {}, \
             \"output_length\": 20, \"hash_ids\": [{}]{extra}}}\n",
            blocks.len() * 512,
            ids.join(", ")
        )
    };
    let child = ", \"parent_session_id\": 1";
    let end = if parent_ends { ", \"final\": true" } else { "" };
    let text = [
        line(0, 1, 1, &[1, 2, 3, 4, 5, 6], ""),
        line(4_000, 2, 1, &[1, 2, 3, 101, 102], child),
        line(6_000, 2, 2, &[1, 2, 3, 101, 102, 103], child),
        line(8_000, 1, 2, &[1, 2, 3, 4, 5, 6, 7], end),
        line(20_000, 3, 1, &[1, 2, 3, 4, 5, 6, 7, 301], child),
    ]
    .concat();
    trace::parse(text.as_bytes(), "agents", &trace::LoadOptions::default())
        .unwrap()
        .0
}

fn record(out: &SimOutput, session: u64, turn: u32) -> &kvc_replay::sim::metrics::RequestRecord {
    out.records
        .iter()
        .find(|r| r.session == SessionId(session) && r.turn == TurnId(turn))
        .unwrap()
}

#[test]
fn a_subagents_first_turn_is_an_append_on_its_parents_decode_worker() {
    let t = trace(false);
    let out = run_with(&t, "1p3d", "kvc", |_| {});
    let parent = record(&out, 1, 1);
    let child = record(&out, 2, 1);
    assert_eq!(child.mode, Some(ExecutionMode::DirectToD));
    assert_eq!(child.decode, parent.decode, "on the parent's D");
    assert_eq!(
        child.cached_tokens,
        3 * 512,
        "the parent's first three blocks"
    );
    assert_eq!(child.prefill, None);
    assert_eq!(record(&out, 2, 2).mode, Some(ExecutionMode::DirectToD));
    // Switched off, the same turn is a seed.
    let off = run_with(&t, "1p3d", "kvc", |c| {
        if let kvc_policy::PolicyConfig::Kvc(k) = &mut c.policy {
            k.subagent_placement = false;
        }
    });
    assert_ne!(record(&off, 2, 1).mode, Some(ExecutionMode::DirectToD));
}

#[test]
fn an_ended_session_is_forgotten_by_the_router_and_released_by_its_worker() {
    // The parent still live: its later child goes direct to its D, which holds all but one
    // block of the child's prompt.
    let kept = run_with(&trace(false), "1p3d", "kvc", |_| {});
    let child = record(&kept, 3, 1);
    assert_eq!(child.mode, Some(ExecutionMode::DirectToD));
    assert_eq!(child.cached_tokens, 7 * 512);
    // Ended: the router has no parent to place it by, and the worker let the KV go.
    let ended = run_with(&trace(true), "1p3d", "kvc", |_| {});
    let child = record(&ended, 3, 1);
    assert_ne!(child.mode, Some(ExecutionMode::DirectToD));
    // The end ignored (`--session-ends off`): as if the client had never said.
    let ignored = run_with(&trace(true), "1p3d", "kvc", |c| c.session_ends = false);
    assert_eq!(record(&ignored, 3, 1).mode, Some(ExecutionMode::DirectToD));
}
