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
    // Every decode worker saw far more blocks than it keeps.
    assert_eq!(state.seen_blocks(WorkerId(5)), per_view as usize);
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
