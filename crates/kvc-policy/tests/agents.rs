//! What coding agents do to sessions: subagents spawned by a live session, and compactions
//! (the agent rewrites its history, so the next prompt no longer extends the last one).

mod common;

use common::*;
use kvc_core::{BlockHash, ExecutionMode, FallThroughReason, SessionId, TurnId, WorkerId};
use kvc_policy::{KvcConfig, PolicyConfig, Residency, RouteRequest, is_compaction};

fn kvc_with(f: impl FnOnce(&mut KvcConfig)) -> PolicyConfig {
    let mut c = KvcConfig::default();
    f(&mut c);
    PolicyConfig::Kvc(c)
}

/// A parent session (1) served two turns; its D.
fn parent_on_its_d(r: &mut Router, ws: &[kvc_policy::WorkerView]) -> WorkerId {
    let d = r.serve(ws, Some((1, 1)), &ctx_blocks(1, 0, 10)).decode;
    let second = r.serve(ws, Some((1, 2)), &ctx_blocks(1, 0, 12));
    assert_eq!((second.mode, second.decode), (ExecutionMode::DirectToD, d));
    d
}

#[test]
fn a_subagents_first_turn_is_an_append_on_its_parents_d() {
    let ws = pd_local(1, 3);
    let mut r = Router::new(PolicyConfig::default(), &ws);
    let parent_d = parent_on_its_d(&mut r, &ws);
    // The child shares the system prompt (4 blocks) with its parent, then 3 blocks of its own.
    let child = ctx_blocks(2, 0, 3);
    let req = r.request(2, 1, &child).with_parent(SessionId(1));
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(
        (d.mode, d.decode, d.prefill, d.reason),
        (ExecutionMode::DirectToD, parent_d, None, None)
    );
    assert_eq!(
        d.cached_tokens,
        4 * BS,
        "the parent's system prompt on its D"
    );
    assert_eq!(d.need_tokens, 3 * BS + 10, "room for what D does not hold");
    r.state.apply(&d.change);
    let s = r.state.session(SessionId(2)).unwrap();
    assert_eq!(
        (s.current_d, s.residency),
        (Some(parent_d), Residency::Resident)
    );
    // Its next turn is direct-to-D there too.
    let next = ctx_blocks(2, 0, 5);
    let req = r.request(2, 2, &next);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!((d.mode, d.decode), (ExecutionMode::DirectToD, parent_d));

    // Without a parent, the same prompt is a first turn as any other.
    let req = r.request(3, 1, &child);
    let d = r.decide(&ws, &req).unwrap();
    assert_ne!(d.mode, ExecutionMode::DirectToD);
    // A D that keeps to its role (decodes transferred KV, never serves a whole turn alone)
    // appends the child as it appends its parent's turns: a vLLM decode engine does.
    let decode_only = pd(1, 3);
    let mut r = Router::new(PolicyConfig::default(), &decode_only);
    let parent_d = parent_on_its_d(&mut r, &decode_only);
    let req = r.request(2, 1, &child).with_parent(SessionId(1));
    let d = r.decide(&decode_only, &req).unwrap();
    assert_eq!(
        (d.mode, d.decode, d.prefill, d.cached_tokens),
        (ExecutionMode::DirectToD, parent_d, None, 4 * BS)
    );
    // Nor on a D declared without direct appends (a stock SGLang decode server).
    let mut r = Router::new(PolicyConfig::default(), &decode_only);
    let parent_d = parent_on_its_d(&mut r, &decode_only);
    r.state.set_direct_append(parent_d, false);
    let req = r.request(2, 1, &child).with_parent(SessionId(1));
    let d = r.decide(&decode_only, &req).unwrap();
    assert_eq!(
        (d.mode, d.prefill),
        (ExecutionMode::Turn1Seed, Some(WorkerId(0)))
    );
}

#[test]
fn a_subagent_is_seeded_where_its_parents_d_cannot_take_it() {
    let ws = pd_local(1, 2);
    let child = ctx_blocks(2, 0, 3);
    type Tweak = fn(&mut Vec<kvc_policy::WorkerView>, WorkerId);
    let seeded = |config: PolicyConfig, tweak: Tweak, refused: bool| {
        let mut ws = ws.clone();
        let mut r = Router::new(config, &ws);
        let parent_d = parent_on_its_d(&mut r, &ws);
        tweak(&mut ws, parent_d);
        let mut req = r.request(2, 1, &child).with_parent(SessionId(1));
        if refused {
            req = req.rejected_by(parent_d);
        }
        r.decide(&ws, &req).unwrap().mode
    };
    let keep: Tweak = |_, _| {};
    // Switched off.
    let off = kvc_with(|c| c.subagent_placement = false);
    assert_ne!(
        seeded(off, keep, false),
        ExecutionMode::DirectToD,
        "subagent-placement off"
    );
    // Policies without subagent placement.
    let v2 = PolicyConfig::from_name("kvc-v2").unwrap();
    assert_eq!(seeded(v2, keep, false), ExecutionMode::Turn1Seed, "kvc-v2");
    // The parent's D over the hard cap.
    let full: Tweak = |ws, d| set_used(ws, d.0, CAP * 9 / 10);
    assert_ne!(
        seeded(PolicyConfig::default(), full, false),
        ExecutionMode::DirectToD,
        "over the cap"
    );
    // A re-route after the parent's D refused it goes through P.
    assert_eq!(
        seeded(PolicyConfig::default(), keep, true),
        ExecutionMode::Turn1Seed
    );
    // What D does not hold is over the direct limit (17 blocks of its own: 8,704 tokens).
    let big = ctx_blocks(2, 0, 17);
    let mut r = Router::new(PolicyConfig::default(), &ws);
    parent_on_its_d(&mut r, &ws);
    let req = r.request(2, 1, &big).with_parent(SessionId(1));
    let d = r.decide(&ws, &req).unwrap();
    assert_ne!(d.mode, ExecutionMode::DirectToD, "over the direct limit");
    // A parent the router does not know.
    let req = r.request(3, 1, &child).with_parent(SessionId(99));
    assert_ne!(r.decide(&ws, &req).unwrap().mode, ExecutionMode::DirectToD);
}

#[test]
fn compactions_are_told_apart_from_appends() {
    let mut r = Router::new(PolicyConfig::default(), &pd(1, 1));
    let ws = pd(1, 1);
    r.serve(&ws, Some((1, 1)), &ctx_blocks(1, 0, 20));
    let s = r.state.session(SessionId(1)).unwrap().clone();
    let check = |blocks: &[BlockHash]| is_compaction(&s, s.shared_prefix(blocks));
    assert!(!check(&ctx_blocks(1, 0, 26)), "an append");
    // The last two blocks rewritten (a partial block, a generation prompt): not a compaction.
    let mut tail = ctx_blocks(1, 0, 22);
    tail[23] = BlockHash(7);
    assert!(!check(&tail[..23]), "the tail rewritten");
    assert!(
        check(&ctx_blocks(1, 1, 6)),
        "history summarised: the system prompt kept"
    );
    // Old tool output elided: it leaves the last prompt early but keeps more than a quarter.
    let mut elided = ctx_blocks(1, 0, 20);
    elided.truncate(10);
    elided.extend((0..12).map(|k| BlockHash(9_000 + k)));
    assert!(!check(&elided), "an elision");
    let mut cut = ctx_blocks(1, 0, 20);
    cut.truncate(6);
    cut.extend((0..12).map(|k| BlockHash(9_000 + k)));
    assert!(check(&cut), "a quarter kept");
}

#[test]
fn a_compacted_turn_is_placed_afresh_and_its_stale_blocks_leave() {
    let ws = pd(1, 2);
    let mut r = Router::new(PolicyConfig::default(), &ws);
    let old = ctx_blocks(1, 0, 40);
    let d = r.serve(&ws, Some((1, 1)), &ctx_blocks(1, 0, 30)).decode;
    assert_eq!(
        r.serve(&ws, Some((1, 2)), &old).mode,
        ExecutionMode::DirectToD
    );
    let other = if d == WorkerId(1) {
        WorkerId(2)
    } else {
        WorkerId(1)
    };
    // The session's D is busier; the summary (20 new blocks, 10,240 tokens) is over the
    // direct limit.
    let mut busy = ws.clone();
    set_used(&mut busy, d.0, CAP * 6 / 10);
    let summary = ctx_blocks(1, 1, 20);
    let req = r.request(1, 3, &summary);
    let compacted = r.decide(&busy, &req).unwrap();
    assert_eq!(
        (compacted.mode, compacted.reason, compacted.decode),
        (
            ExecutionMode::Fallback,
            Some(FallThroughReason::Compacted),
            other
        ),
        "a fresh seed, on the better D"
    );
    // Switched off: a large append, held to its D.
    let mut off = Router::new(kvc_with(|c| c.compaction = false), &ws);
    off.serve(&ws, Some((1, 1)), &ctx_blocks(1, 0, 30));
    off.serve(&ws, Some((1, 2)), &old);
    let req = off.request(1, 3, &summary);
    let d_off = off.decide(&busy, &req).unwrap();
    assert_eq!(
        (d_off.reason, d_off.decode),
        (Some(FallThroughReason::RealLargeAppend), d)
    );
    // Carried out, the old history leaves the live view of its D.
    assert_eq!(r.state.resident_depth(d, &old), 44);
    r.state.apply(&compacted.change);
    assert_eq!(r.state.resident_depth(d, &old), 0);
    assert_eq!(r.state.resident_depth(other, &summary), 24);
}

#[test]
fn a_small_compaction_stays_direct_and_keeps_only_the_shared_prefix() {
    let ws = pd(1, 1);
    let mut r = Router::new(PolicyConfig::default(), &ws);
    let old = ctx_blocks(1, 0, 40);
    r.serve(&ws, Some((1, 1)), &ctx_blocks(1, 0, 30));
    let d = r.serve(&ws, Some((1, 2)), &old).decode;
    let summary = ctx_blocks(1, 1, 6);
    let req = RouteRequest::new(kvc_core::RequestId(99), 10 * BS, 10, &summary)
        .in_session(SessionId(1), TurnId(3));
    let direct = r.decide(&ws, &req).unwrap();
    assert_eq!(
        (direct.mode, direct.decode, direct.cached_tokens),
        (ExecutionMode::DirectToD, d, 4 * BS)
    );
    r.state.apply(&direct.change);
    assert_eq!(r.state.resident_depth(d, &old), 4, "the system prompt only");
    assert_eq!(r.state.resident_depth(d, &summary), 10);
}

#[test]
fn a_session_its_client_ended_frees_its_decode_worker_for_the_next_one() {
    let mut ws = pd(1, 2);
    let mut r = Router::new(PolicyConfig::default(), &ws);
    // Three sessions placed on D1 while D2 is busy.
    set_load(&mut ws, 2, 10, 0);
    for s in 1..=3 {
        assert_eq!(
            r.serve(&ws, Some((s, 1)), &ctx_blocks(s, 0, 4)).decode,
            WorkerId(1)
        );
    }
    // D2 less busy now: a new session goes there rather than join D1's three active ones.
    set_load(&mut ws, 2, 2, 0);
    assert_eq!(
        r.serve(&ws, Some((4, 1)), &ctx_blocks(4, 0, 4)).decode,
        WorkerId(2)
    );
    // Two of D1's sessions end: the next session is placed on D1.
    r.state.forget_session(SessionId(1));
    r.state.forget_session(SessionId(2));
    assert!(r.state.session(SessionId(1)).is_none());
    assert_eq!(
        r.serve(&ws, Some((5, 1)), &ctx_blocks(5, 0, 4)).decode,
        WorkerId(1)
    );
}
