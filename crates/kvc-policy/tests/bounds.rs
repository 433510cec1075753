//! The router state stays within its bounds however many sessions and fresh blocks it sees.

mod common;

use common::*;
use kvc_core::{BlockHash, Outcome, RequestId, SessionId, TurnId, WorkerId};
use kvc_policy::{
    ClusterView, Observation, PolicyConfig, RouteRequest, RouterState, StateBounds, route,
};

/// 200,000 sessions × 3 turns of `kvc` decisions with fresh blocks on 2 prefill and 8 decode
/// workers; one request in seven never completes. Every table stays within its bound.
#[test]
fn entry_counts_stay_within_bounds() {
    const SESSIONS: u64 = 200_000;
    const TURNS: u32 = 3;
    let ws = pd(2, 8);
    let config = PolicyConfig::from_name("kvc").unwrap();
    let bounds = StateBounds {
        max_pending: 10_000,
        ..StateBounds::default()
    };
    let mut state = RouterState::with_bounds(&config, &ws, bounds);
    // Pools of 100,000 tokens: 196 blocks of 512, four pools' worth per view.
    let per_view = 4 * 196;
    assert_eq!(state.worker_block_bound(WorkerId(3)), per_view);
    let (mut request, mut block, mut now) = (0u64, 100u64, 0u64);
    let mut blocks = Vec::new();
    for turn in 1..=TURNS {
        for s in 1..=SESSIONS {
            request += 1;
            now += 1;
            blocks.clear();
            blocks.extend(SYSTEM.map(BlockHash));
            blocks.extend((block..block + 6).map(BlockHash));
            block += 6;
            let input = blocks.len() as u64 * BS;
            let req = RouteRequest::new(RequestId(request), input, 10, &blocks)
                .in_session(SessionId(s), TurnId(turn));
            let d = route(&config, &state, &ClusterView::new(now, &ws), &req).unwrap();
            state.apply(&d.change);
            if request % 7 != 0 {
                state.observe(&Observation::Completed {
                    request_id: req.request_id,
                    session: Some(SessionId(s)),
                    worker: d.decode,
                    outcome: Outcome::Ok,
                    resident_tokens: input,
                    direct: d.is_direct(),
                });
            }
        }
    }
    assert_eq!(state.session_count() as u64, SESSIONS);
    assert!(
        state
            .sessions()
            .all(|(_, r)| r.blocks.len() == 10 && r.reject_counts().count() == 0)
    );
    let mut held = 0;
    for w in 0..10 {
        let id = WorkerId(w);
        assert!(state.seen_blocks(id) <= per_view as usize, "worker {w}");
        assert!(state.live_blocks(id) <= per_view as usize, "worker {w}");
        held += state.seen_blocks(id) + state.live_blocks(id);
    }
    // Every prefill worker saw far more blocks than it keeps; a decode worker keeps no
    // grow-only view under `kvc` (the policy reads none of it).
    assert_eq!(state.seen_blocks(WorkerId(0)), per_view as usize);
    assert_eq!(state.seen_blocks(WorkerId(5)), 0);
    assert_eq!(state.live_blocks(WorkerId(5)), per_view as usize);
    assert!(state.dropped_blocks() > 1_000_000);
    assert!(state.known_blocks() <= held);
    // The bound counts each decision as it is applied: the completed one applied last took the
    // place of an abandoned one, so 9,999 abandoned decisions remain.
    assert_eq!(state.pending_count(), 9_999);
    assert_eq!(state.dropped_pending(), request / 7 - 9_999);
    // In-flight counts follow the pending decisions, released ones included.
    let in_flight: u64 = (2..10)
        .map(|w| u64::from(state.in_flight(WorkerId(w))))
        .sum();
    assert_eq!(in_flight, 9_999);
}

/// A session keeps at most `max-session-blocks` leading blocks of its last request; a turn that
/// extends the whole request still reuses all of it, a turn that diverges past the kept blocks
/// is credited with the kept ones only.
#[test]
fn session_block_lists_are_capped() {
    let ws = pd(1, 2);
    let config = PolicyConfig::from_name("kvc").unwrap();
    let bounds = StateBounds {
        max_session_blocks: 8,
        ..StateBounds::default()
    };
    let mut r = Router {
        state: RouterState::with_bounds(&config, &ws, bounds),
        config,
        next_request: 1,
    };
    let t1 = ctx_blocks(7, 0, 36);
    let first = r.serve(&ws, Some((7, 1)), &t1);
    let s = r.state.session(SessionId(7)).unwrap();
    assert_eq!((s.blocks.len(), s.block_count()), (8, 40));
    assert_eq!(s.blocks[..], t1[..8]);
    assert_eq!(r.state.dropped_session_blocks(), 32);
    assert_eq!(r.state.live_blocks(first.decode), 8);

    // Extends all 40 blocks by 2: direct-to-D with all 40 reused.
    let t2 = ctx_blocks(7, 0, 38);
    let req = r.request(7, 2, &t2);
    let d = r.decide(&ws, &req).unwrap();
    assert!(d.is_direct(), "{d:?}");
    assert_eq!(d.decode, first.decode);
    assert_eq!(d.cached_tokens, 40 * BS);

    // Shares 30 blocks and diverges: only the 8 kept blocks count, 34 blocks are new, more
    // than the 16-block direct limit.
    let mut t3 = t1[..30].to_vec();
    t3.extend((0..12).map(|k| BlockHash(99_000_000 + k)));
    let req = r.request(7, 2, &t3);
    let d = r.decide(&ws, &req).unwrap();
    assert!(!d.is_direct(), "{d:?}");
    assert_eq!(d.reason, Some(kvc_core::FallThroughReason::RealLargeAppend));

    // The lists and counts follow the latest request; a short one is kept whole.
    r.serve(&ws, Some((7, 2)), &t2);
    assert_eq!(r.state.dropped_session_blocks(), 32 + 34);
    let short = ctx_blocks(8, 0, 2);
    r.serve(&ws, Some((8, 1)), &short);
    let s = r.state.session(SessionId(8)).unwrap();
    assert_eq!((s.blocks.len(), s.block_count()), (6, 6));
    assert_eq!(s.shared_prefix(&ctx_blocks(8, 0, 3)), 6);
    assert_eq!(r.state.dropped_session_blocks(), 32 + 34);
}
