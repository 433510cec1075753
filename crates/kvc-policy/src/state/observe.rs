//! Feedback from the data plane (`Observation`) and how the state takes it in.

use super::{Residency, RouterState, SessionRoute};
use crate::view::MAX_WORKERS;
use kvc_core::{BlockHash, Outcome, RequestId, SessionId, WorkerId};
use serde::{Deserialize, Serialize};

/// Feedback from the data plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "event")]
pub enum Observation {
    /// The request finished (any outcome) on its D / colocated worker; the worker now holds
    /// `resident_tokens` of the session (0 if none) — hash_ids are the request's blocks.
    Completed {
        /// The request.
        request_id: RequestId,
        /// Its session.
        session: Option<SessionId>,
        /// The D (or colocated worker) that served it.
        worker: WorkerId,
        /// How it ended.
        outcome: Outcome,
        /// Tokens of the session the worker keeps resident.
        resident_tokens: u64,
        /// Whether it went direct-to-D.
        direct: bool,
    },
    /// D refused a direct-to-D admission for the session.
    AdmissionRejected {
        /// The session.
        session: SessionId,
        /// The D that refused.
        worker: WorkerId,
    },
    /// The request's prefill is over: its first token is out. Its prefill estimate
    /// ([`crate::StateChange::prefill_us`]) stops counting in its worker's backlog (without
    /// this, it counts until the request completes).
    PrefillDone {
        /// The request.
        request_id: RequestId,
        /// When its first token came, on the clock of the decisions' `now_ms`: with it, the
        /// time since the decision is a sample of its worker's pace
        /// ([`RouterState::prefill_pace`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at_ms: Option<u64>,
    },
    /// D evicted the session's KV.
    Evicted {
        /// The session.
        session: SessionId,
        /// The D that evicted it.
        worker: WorkerId,
    },
    /// The engines' own reports (KV-cache events) show `worker` holding a session this state
    /// has no placement for: another router (a replica behind the same load balancer) placed
    /// it there. `blocks` are the leading blocks of the session's current request that
    /// `worker` holds.
    Adopted {
        /// The session.
        session: SessionId,
        /// The worker holding it.
        worker: WorkerId,
        /// The leading blocks it holds.
        blocks: Vec<BlockHash>,
        /// Tokens of the session it holds.
        resident_tokens: u64,
    },
}

impl RouterState {
    /// Takes feedback from the data plane into account.
    ///
    /// - `Completed`: the request stops counting in flight; if `worker` is the session's current
    ///   D, a positive `resident_tokens` confirms residency and 0 ends it (an eviction already
    ///   reported stays `evicted`); a successful (`ok`) direct-to-D turn resets the session's
    ///   reject counter on `worker` to 0. An `invalid-request` (the engine refused the request
    ///   itself) changes nothing but the in-flight count.
    /// - `AdmissionRejected`: the session's reject counter on `worker` grows by one (a re-route
    ///   of the same reject with [`crate::RouteRequest::rejected_by`] does not count it again).
    /// - `Evicted`: if `worker` is the session's current D, the session is `evicted` there and
    ///   leaves the live block view. The grow-only view keeps its blocks (until the worker's
    ///   block bound pushes them out, least recently used first).
    /// - `Adopted`: a session with no current D (unknown, or known only by its rejects) is
    ///   taken to be resident on `worker` with `blocks` (capped as a decision's are) in the live
    ///   block view; a session this state has placed keeps its placement, and no blocks change
    ///   nothing.
    pub fn observe(&mut self, event: &Observation) {
        match *event {
            Observation::Completed {
                request_id,
                session,
                worker,
                outcome,
                resident_tokens,
                direct,
            } => {
                if let Some(p) = self.pending.remove(&request_id) {
                    self.release(p);
                    if let Some(pre) = p.prefill {
                        let pair = (pre, p.decode);
                        if outcome == Outcome::KvTransferTimeout {
                            let n = self.pair_failures.entry(pair).or_insert(0);
                            *n = n.saturating_add(1);
                        } else if outcome.is_served() {
                            self.pair_failures.remove(&pair);
                        }
                    }
                }
                // The engine refused the request before touching any KV: the session stays
                // where it was, as resident as it was.
                if outcome == Outcome::InvalidRequest {
                    return;
                }
                let Some(route) = session.and_then(|s| self.sessions.get_mut(&s)) else {
                    return;
                };
                let before = route.activity_key();
                if direct && outcome == Outcome::Ok {
                    route.set_rejects(worker, 0);
                    if route.observed_reject == Some(worker) {
                        route.observed_reject = None;
                    }
                }
                if route.current_d != Some(worker) {
                    return;
                }
                if resident_tokens > 0 {
                    route.residency = Residency::Resident;
                    route.resident_tokens = resident_tokens;
                    if route.live_on.is_none() && (worker.0 as usize) < MAX_WORKERS {
                        self.index.add_live(worker.0 as usize, &route.blocks);
                        route.live_on = Some(worker);
                    }
                } else {
                    if route.residency != Residency::Evicted {
                        route.residency = Residency::NotResident;
                    }
                    route.resident_tokens = 0;
                    Self::drop_live(&mut self.index, route);
                }
                self.activity.update(before, route.activity_key());
            }
            Observation::AdmissionRejected { session, worker } => {
                let route = self
                    .sessions
                    .entry(session)
                    .or_insert_with(SessionRoute::new);
                let n = route.rejects_on(worker).saturating_add(1);
                route.set_rejects(worker, n);
                route.observed_reject = Some(worker);
            }
            Observation::PrefillDone { request_id, at_ms } => {
                if let Some(mut p) = self.pending.get(&request_id).copied() {
                    // A sample of the pace: only a decision with an estimate, reported once.
                    if let Some(at) = at_ms
                        && p.prefill_us > 0
                        && let Some(c) = self
                            .counters
                            .get_mut(p.prefill.unwrap_or(p.decode).0 as usize)
                    {
                        let measured = at.saturating_sub(p.sent_ms) as f64 * 1e3;
                        c.pace.add(measured, (p.ahead_us + p.prefill_us) as f64);
                    }
                    self.add_backlog(&p, false);
                    p.prefill_us = 0;
                    let arrived = p;
                    p.awaiting_kv = false;
                    self.pending.insert(request_id, p);
                    self.kv_arrived(&arrived);
                }
            }
            Observation::Adopted {
                session,
                worker,
                ref blocks,
                resident_tokens,
            } => {
                if blocks.is_empty()
                    || self
                        .sessions
                        .get(&session)
                        .is_some_and(|r| r.current_d.is_some())
                {
                    return;
                }
                let route = self
                    .sessions
                    .entry(session)
                    .or_insert_with(SessionRoute::new);
                let before = route.activity_key();
                let cap = (self.bounds.max_session_blocks as usize).min(blocks.len());
                route.current_d = Some(worker);
                route.residency = Residency::Resident;
                route.resident_tokens = resident_tokens;
                route.blocks.clear();
                route.blocks.extend_from_slice(&blocks[..cap]);
                route.block_count = blocks.len();
                route.last_block = (cap < blocks.len())
                    .then(|| blocks.last().copied())
                    .flatten();
                if (worker.0 as usize) < MAX_WORKERS {
                    self.index.add_live(worker.0 as usize, &route.blocks);
                    route.live_on = Some(worker);
                }
                self.activity.update(before, route.activity_key());
            }
            Observation::Evicted { session, worker } => {
                let Some(route) = self.sessions.get_mut(&session) else {
                    return;
                };
                if route.current_d == Some(worker) {
                    let before = route.activity_key();
                    route.residency = Residency::Evicted;
                    route.resident_tokens = 0;
                    Self::drop_live(&mut self.index, route);
                    self.activity.update(before, route.activity_key());
                }
            }
        }
    }
}
