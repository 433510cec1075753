//! `kvc`'s `migrate-with-kv`: a session that moves to another decode worker takes its KV along
//! when the worker holding it can send it (capability `send-kv`, healthy or draining).

mod common;

use common::*;
use kvc_core::{Capabilities, ExecutionMode, FallThroughReason, Health, WorkerId, WorkerRole};
use kvc_policy::{Decision, KvcConfig, Observation, PolicyConfig, WorkerView};

/// One prefill worker (0) and two decode workers (1, 2) whose engines send their sessions' KV
/// (vLLM with NixlConnector), or not.
fn fleet(senders: bool) -> Vec<WorkerView> {
    pd(1, 2)
        .into_iter()
        .map(|w| match w.role {
            WorkerRole::Decode if senders => {
                w.with_caps(Capabilities::of_role(WorkerRole::Decode).with_send_kv())
            }
            _ => w,
        })
        .collect()
}

fn kvc(migrate_with_kv: bool) -> PolicyConfig {
    PolicyConfig::Kvc(KvcConfig {
        migrate_with_kv,
        ..KvcConfig::default()
    })
}

/// Session 7 seeded (20 blocks) and served on its decode worker; returns the router and it.
fn seeded(ws: &[WorkerView], migrate_with_kv: bool) -> (Router, WorkerId) {
    let mut r = Router::new(kvc(migrate_with_kv), ws);
    let d = r.serve(ws, Some((7, 1)), &ctx_blocks(7, 0, 20));
    assert_eq!(
        (d.mode, d.prefill),
        (ExecutionMode::Turn1Seed, Some(WorkerId(0)))
    );
    (r, d.decode)
}

/// Session 7's second turn (22 blocks past the system prompt), decided and not applied.
fn second_turn(r: &mut Router, ws: &[WorkerView]) -> Decision {
    let blocks = ctx_blocks(7, 0, 22);
    let req = r.request(7, 2, &blocks);
    r.decide(ws, &req).unwrap()
}

#[test]
fn a_session_leaving_a_draining_worker_takes_its_kv_along() {
    let mut ws = fleet(true);
    let (mut r, home) = seeded(&ws, true);
    let other = WorkerId(3 - home.0);
    set_health(&mut ws, home.0, Health::Draining);
    let blocks = ctx_blocks(7, 0, 22);
    let req = r.request(7, 2, &blocks);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!(d.mode, ExecutionMode::MigrateKv);
    assert_eq!(d.reason, Some(FallThroughReason::DecodeUnhealthy));
    assert_eq!((d.prefill, d.decode), (Some(home), other));
    // The sender holds the whole previous prompt: system prompt and 20 blocks.
    assert_eq!(d.cached_tokens, 24 * BS);
    let sender = d
        .score(home, WorkerRole::Prefill)
        .expect("the sender's entry");
    assert_eq!(sender.component("kv_sender"), Some(1.0));
    // Carried out, the session lives on the other worker: its next turn goes direct there.
    r.state.apply(&d.change);
    r.state.observe(&Observation::Completed {
        request_id: req.request_id,
        session: req.session,
        worker: other,
        outcome: kvc_core::Outcome::Ok,
        resident_tokens: blocks.len() as u64 * BS,
        direct: false,
    });
    let next = ctx_blocks(7, 0, 23);
    let req = r.request(7, 3, &next);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!((d.mode, d.decode), (ExecutionMode::DirectToD, other));
}

#[test]
fn a_worker_over_the_hard_cap_sends_a_session_it_sheds_only_when_it_is_draining() {
    // Over the hard cap and routable, the worker the session leaves is under memory pressure:
    // prefilling the turn there and holding the KV until the pull would add to it (in the
    // simulator such moves prefilled up to 11% more in all), so the move recomputes on P.
    let mut ws = fleet(true);
    let (mut r, home) = seeded(&ws, true);
    set_used(&mut ws, home.0, 95_000);
    let d = second_turn(&mut r, &ws);
    assert_eq!(
        (d.mode, d.reason, d.prefill),
        (
            ExecutionMode::Reseed,
            Some(FallThroughReason::Migrated),
            Some(WorkerId(0))
        )
    );
    assert_ne!(d.decode, home);
    // Drained as well, it takes no new work: it sends the session's KV.
    set_health(&mut ws, home.0, Health::Draining);
    let d = second_turn(&mut r, &ws);
    assert_eq!(
        (d.mode, d.reason, d.prefill),
        (
            ExecutionMode::MigrateKv,
            Some(FallThroughReason::DecodeUnhealthy),
            Some(home)
        )
    );
    assert_ne!(d.decode, home);
}

#[test]
fn without_a_sender_or_with_the_knob_off_a_move_recomputes_on_a_prefill_worker() {
    // (decode workers send KV, migrate-with-kv, health of the session's worker) -> the path.
    let cases = [
        (true, false, Health::Draining, ExecutionMode::Fallback),
        (false, true, Health::Draining, ExecutionMode::Fallback),
        // A worker that is down sends nothing.
        (true, true, Health::Down, ExecutionMode::Fallback),
        (true, true, Health::Stale, ExecutionMode::Fallback),
    ];
    for (senders, knob, health, mode) in cases {
        let mut ws = fleet(senders);
        let (mut r, home) = seeded(&ws, knob);
        set_health(&mut ws, home.0, health);
        let d = second_turn(&mut r, &ws);
        let case = format!("senders {senders}, migrate-with-kv {knob}, {health:?}");
        assert_eq!(d.mode, mode, "{case}");
        assert_eq!(d.reason, Some(FallThroughReason::DecodeUnhealthy), "{case}");
        assert_ne!(d.decode, home, "{case}");
        assert_ne!(d.prefill, Some(home), "{case}: never the worker it left");
    }
}

#[test]
fn a_session_takes_its_kv_along_only_to_a_worker_with_room_for_it_now() {
    let mut ws = fleet(true);
    let (mut r, home) = seeded(&ws, true);
    let other = WorkerId(3 - home.0);
    set_health(&mut ws, home.0, Health::Draining);
    let blocks = ctx_blocks(7, 0, 22);
    // The new worker lacks room for the 26 blocks: the KV would wait there, held on both.
    set_used(&mut ws, other.0, CAP - 26 * BS);
    let req = r.request(7, 2, &blocks);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!((d.mode, d.decode), (ExecutionMode::Fallback, other));
    assert_eq!(d.prefill, Some(WorkerId(0)));
    // With room for the prompt and its output hint, it moves with its KV.
    set_used(&mut ws, other.0, CAP - 26 * BS - 10);
    let d = r.decide(&ws, &req).unwrap();
    assert_eq!((d.mode, d.prefill), (ExecutionMode::MigrateKv, Some(home)));
}

#[test]
fn a_session_evicted_from_its_worker_has_no_kv_to_take_along() {
    let mut ws = fleet(true);
    let (mut r, home) = seeded(&ws, true);
    r.state.observe(&Observation::Evicted {
        session: kvc_core::SessionId(7),
        worker: home,
    });
    set_health(&mut ws, home.0, Health::Draining);
    let d = second_turn(&mut r, &ws);
    assert_ne!(d.mode, ExecutionMode::MigrateKv);
    assert_ne!(d.prefill, Some(home));
}

#[test]
fn a_draining_worker_gets_no_new_work_of_its_own() {
    let mut ws = fleet(true);
    let (mut r, home) = seeded(&ws, true);
    set_health(&mut ws, home.0, Health::Draining);
    for s in 20..30 {
        let d = r.serve(&ws, Some((s, 1)), &ctx_blocks(s, 0, 4));
        assert_ne!(d.decode, home, "session {s}");
        assert_ne!(
            d.prefill,
            Some(home),
            "session {s}: not a prefill worker either"
        );
    }
}
