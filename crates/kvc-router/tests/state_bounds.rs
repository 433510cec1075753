//! The router gives its policy state the configured bounds: each worker's block bound from its
//! `capacity-tokens`, `limits.max-session-blocks`, and `max-pending-decisions`; what the bounds
//! remove is counted on `/metrics`.
#![forbid(unsafe_code)]

mod common;

use common::{CAPACITY, Cluster, route_req, value};
use kvc_core::WorkerId;

#[tokio::test]
async fn the_policy_state_is_bounded_as_configured() {
    let mut c = Cluster::start(|cfg| {
        cfg.limits.pool_multiple = 1;
        cfg.limits.max_session_blocks = 4;
        cfg.max_pending_decisions = 50;
        cfg.max_message_bytes = 1 << 20;
        // Worker 2's pool is a tenth of the others'.
        cfg.workers[2].capacity_tokens = CAPACITY / 10;
    })
    .await;
    let svc = std::sync::Arc::clone(c.service());
    // 92,000 tokens in blocks of 512, rounded up: 180; 9,200 tokens: 18.
    assert_eq!(svc.worker_block_bound(WorkerId(0)), 180);
    assert_eq!(svc.worker_block_bound(WorkerId(1)), 180);
    assert_eq!(svc.worker_block_bound(WorkerId(2)), 18);

    // 300 first turns of 10 fresh blocks each (no outcome reported).
    for r in 0..300u64 {
        let ids: Vec<u64> = (0..10).map(|k| 1 + r * 10 + k).collect();
        c.client
            .route(route_req(r, Some(r), Some(1), 10 * 512, &ids))
            .await
            .unwrap();
    }
    assert_eq!(svc.pending_decisions(), 50);
    let m = c.metrics().await;
    // Each request's blocks past the first 4 were not kept in its session.
    assert_eq!(
        value(&m, "kvc_router_session_blocks_dropped_total", &[]),
        300.0 * 6.0
    );
    // 3,000 distinct blocks were sent to P and to the decode workers; the block view keeps at
    // most each worker's bound per view.
    let known = value(&m, "kvc_router_policy_blocks", &[]);
    assert!(known <= 2.0 * (180.0 + 180.0 + 18.0), "{known}");
    assert!(known >= 180.0, "{known}");
    assert!(value(&m, "kvc_router_policy_blocks_dropped_total", &[]) >= 3_000.0 - 180.0);
    assert_eq!(value(&m, "kvc_router_pending_dropped_total", &[]), 250.0);
}

#[test]
fn limits_are_configuration_keys() {
    let cfg = kvc_router::RouterConfig::from_toml_str(
        "[limits]\nblocks-per-worker = 64\npool-multiple = 2\nmax-session-blocks = 32\nmax-input-tokens = 1000000\n",
    )
    .unwrap();
    assert_eq!(cfg.limits.blocks_per_worker, Some(64));
    assert_eq!(cfg.limits.max_input_tokens, 1_000_000);
    let bounds = cfg.limits.state_bounds(cfg.max_pending_decisions);
    assert_eq!(
        (
            bounds.blocks_per_worker,
            bounds.pool_multiple,
            bounds.max_session_blocks,
            bounds.max_pending
        ),
        (Some(64), 2, 32, 100_000)
    );
    for key in [
        "blocks-per-worker",
        "pool-multiple",
        "max-session-blocks",
        "max-input-tokens",
    ] {
        let err = kvc_router::RouterConfig::from_toml_str(&format!("[limits]\n{key} = 0\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("limits.{key} must be positive")),
            "{err}"
        );
    }
    let text = toml::to_string(&cfg).unwrap();
    assert_eq!(kvc_router::RouterConfig::from_toml_str(&text).unwrap(), cfg);
}
