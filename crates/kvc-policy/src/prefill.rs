//! Choosing the prefill worker of a P→D path by the configured [`PrefillPolicy`] (its stable
//! names are defined in `kvc-core`).
//!
//! - `round-robin`: the next healthy prefill worker after the last one chosen (by id, wrapping).
//! - `d-health-aware`: the lowest joint cost given the target D (chosen first):
//!
//!   ```text
//!   cost(P | D) = (in_flight(P) + queue_depth(P)) + pair_in_flight(P, D) × (1 + queue_depth(D))
//!                 + 8 × pair_failures(P, D)
//!   ```
//!
//!   where `in_flight(P)` is the larger of the published in-flight count and the router's own
//!   count of P→D requests it sent through P (each one ends in a KV transfer), and
//!   `pair_in_flight(P, D)` counts those bound for this D: transfers to a D with a queue are
//!   slow, so a P already feeding that D is charged per transfer and per queued request on D.
//!   `pair_failures(P, D)` counts the P→D requests through the pair that ended in
//!   `kv-transfer-timeout` since the last one it served: a P whose transfers keep failing to
//!   this D (its transfer session to D is broken) is charged as if it had eight more requests
//!   in flight per failure, so traffic to D moves to another P until that one is as bad.
//!   D's health gates it before P is chosen (an unhealthy D is never a target). Ties go to
//!   round-robin order, so on an idle cluster it spreads like `round-robin`.
//! - `prefix-aware`: `d-health-aware`'s cost plus the share of the prompt the P would compute:
//!
//!   ```text
//!   cost(P | D) = cost_d_health_aware(P | D) + (input − cached(P)) / input
//!   ```
//!
//!   where `cached(P)` is the request's prefix P's cache holds as the router believes (the
//!   grow-only view). The share is at most 1: a P holding the whole prompt is worth one request
//!   in flight less than a P holding none of it (one request in flight costs about one prompt's
//!   compute), so a re-seed or a fallback goes to the P that holds the session's prefix unless
//!   it is busier by a whole request. With no cache anywhere every share is 1 and the choice is
//!   `d-health-aware`'s, ties in round-robin order.

use crate::decision::ScoreEntry;
use crate::error::PolicyError;
use crate::index::BlockView;
use crate::round_robin;
use crate::route::Ctx;
use crate::worker_set::WorkerSet;
use kvc_core::{BlockSize, PrefillPolicy, WorkerId, WorkerRole};

/// Chooses the prefill worker for a P→D path to `decode` among the healthy workers that
/// prefill for others, `decode` itself excepted; appends the prefill score entries.
/// Returns the worker and the tokens of the request its prefix cache holds, as the router
/// believes (grow-only view).
pub(crate) fn choose(
    ctx: &Ctx<'_>,
    policy: PrefillPolicy,
    decode: WorkerId,
    block_size: BlockSize,
    scores: &mut Vec<ScoreEntry>,
) -> Result<(WorkerId, u64), PolicyError> {
    // A worker never ships KV to itself (an all-capable worker is a candidate on both sides).
    let mut candidates = ctx.healthy_p.clone();
    candidates.remove(decode.0 as usize);
    if candidates.is_empty() {
        return Err(PolicyError::NoHealthyWorker {
            role: WorkerRole::Prefill,
        });
    }
    let p = match policy {
        PrefillPolicy::RoundRobin => {
            round_robin::pick(ctx, &candidates, WorkerRole::Prefill, scores)
        }
        PrefillPolicy::DHealthAware => d_health_aware(ctx, &candidates, decode, None, scores),
        PrefillPolicy::PrefixAware => {
            d_health_aware(ctx, &candidates, decode, Some(block_size), scores)
        }
    };
    Ok((p, ctx.cached_on(p, BlockView::Seen, block_size)))
}

/// What one transfer failure in a row through a (P, D) pair adds to P's cost for D, in
/// requests in flight.
const PAIR_FAILURE_COST: u64 = 8;

/// `d-health-aware`, and with `cache` (the block size) `prefix-aware`: the share of the prompt
/// each P would compute is added to its cost.
fn d_health_aware(
    ctx: &Ctx<'_>,
    candidates: &WorkerSet,
    decode: WorkerId,
    cache: Option<BlockSize>,
    scores: &mut Vec<ScoreEntry>,
) -> WorkerId {
    let d_queue = u64::from(ctx.worker_state(decode).queue_depth);
    let input = ctx.req.input_length;
    let first = scores.len();
    let mut best: Option<(f64, WorkerId)> = None;
    for (order, slot) in
        round_robin::order(candidates, ctx.state.cursor(WorkerRole::Prefill)).enumerate()
    {
        let id = WorkerId(slot as u32);
        let p_load = u64::from(ctx.load(id)) + u64::from(ctx.worker_state(id).queue_depth);
        let pair = u64::from(ctx.state.pair_in_flight(id, decode));
        let failures = u64::from(ctx.state.pair_failures(id, decode));
        let requests = p_load + pair * (1 + d_queue) + PAIR_FAILURE_COST * failures;
        // The share of the prompt this P would compute (prefix-aware only; 0 for an empty prompt).
        let compute = cache.map(|block_size| {
            let cached = ctx.cached_on(id, BlockView::Seen, block_size).min(input);
            if input == 0 {
                0.0
            } else {
                (input - cached) as f64 / input as f64
            }
        });
        let cost = requests as f64 + compute.unwrap_or(0.0);
        // Strictly lower cost wins; equal cost keeps the earlier one in round-robin order.
        if best.is_none_or(|(c, _)| cost < c) {
            best = Some((cost, id));
        }
        let mut e = ScoreEntry::new(id, WorkerRole::Prefill)
            .with("p_load", p_load as f64)
            .with("pair_in_flight", pair as f64)
            .with("pair_failures", failures as f64)
            .with("d_queue_depth", d_queue as f64)
            .with("rr_order", order as f64);
        if let Some(share) = compute {
            e = e.with("compute_share", share);
        }
        e.total = 0.0 - cost;
        scores.push(e);
    }
    scores[first..].sort_unstable_by_key(|e| e.worker);
    // `healthy_p` is not empty (checked by the caller).
    best.map_or(decode, |(_, id)| id)
}
