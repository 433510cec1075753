//! Deciding a route: validating the request, the policy call, the snapshot probe of a planned
//! direct-to-D with its re-route through P, and the bounded table of decisions awaiting their
//! outcome.

use super::fleet::LiveStates;
use super::{
    Core, EXPIRE_PER_DECISION, Pending, RouterDecision, RouterService, feedback::probe_entry,
};
use crate::error::RequestError;
use crate::workers::WorkerEntry;
use kvc_core::{ExecutionMode, Outcome, SessionId, WorkerId};
use kvc_policy::{Decision, Observation, PolicyConfig, Residency, RouteRequest, RouterState};
use std::sync::atomic::Ordering;
use std::time::Instant;

impl RouterService {
    fn validate_route(&self, req: &RouteRequest<'_>) -> Result<(), RequestError> {
        if req.input_length == 0 {
            return Err(RequestError::InvalidArgument(
                "input_length must be positive".into(),
            ));
        }
        let max_input = self.config.limits.max_input_tokens;
        if req.input_length > max_input {
            return Err(RequestError::InvalidArgument(format!(
                "input_length {} exceeds limits.max-input-tokens ({max_input})",
                req.input_length
            )));
        }
        match (req.session, req.turn) {
            (None, Some(_)) => {
                return Err(RequestError::InvalidArgument(
                    "turn_id given without session_id".into(),
                ));
            }
            (_, Some(t)) if t.0 == 0 => {
                return Err(RequestError::InvalidArgument(
                    "turn_id counts from 1".into(),
                ));
            }
            _ => {}
        }
        if let Some(w) = req.rejected_by
            && self.entry(w.0).is_none()
        {
            return Err(RequestError::InvalidArgument(format!(
                "rejected_by names unknown worker {}",
                w.0
            )));
        }
        let block = self.config.policy.block_size();
        let max_blocks = block.blocks_for(req.input_length);
        if req.hash_ids.len() as u64 > max_blocks {
            return Err(RequestError::InvalidArgument(format!(
                "{} hash_ids for an input of {} tokens: at most {max_blocks} blocks of {} tokens",
                req.hash_ids.len(),
                req.input_length,
                block.tokens()
            )));
        }
        if req.hash_ids.is_empty() && req.input_length > u64::from(block.tokens()) {
            return Err(RequestError::InvalidArgument(format!(
                "no hash_ids for an input of {} tokens (more than one block of {}); send one id per block",
                req.input_length,
                block.tokens()
            )));
        }
        Ok(())
    }

    /// Decides where a request goes.
    ///
    /// Validates it (`INVALID_ARGUMENT` for a malformed request), asks the policy, and when the
    /// policy plans `direct-to-d` probes that decode worker's snapshot for the decision's
    /// footprint: if it cannot admit, the reject is observed and the request re-routed through
    /// a prefill worker. The decision is applied to the router state and remembered under its
    /// decision id until [`RouterService::report_outcome`].
    ///
    /// A caller whose own admission on D refused the previous direct-to-D decision asks again
    /// with `rejected_by` set; the policy counts that reject and answers with a P→D path.
    pub fn route(&self, req: &RouteRequest<'_>) -> Result<RouterDecision, RequestError> {
        self.route_excluding(req, &[])
    }

    /// [`RouterService::route`] with the workers in `exclude` treated as down for this one
    /// decision (a request re-routed after those workers failed it). `UNAVAILABLE` when no
    /// other worker can take it.
    pub fn route_excluding(
        &self,
        req: &RouteRequest<'_>,
        exclude: &[WorkerId],
    ) -> Result<RouterDecision, RequestError> {
        self.route_prompt(req, exclude, None)
    }

    /// [`RouterService::route_excluding`] for a request whose prompt tokens the caller has
    /// (the HTTP front): the engine events' eviction check then also asks how much of this
    /// prompt the worker holds, whoever stored it, beside how many blocks the events credit
    /// to the session (a block every session shares is credited to the last one to store or
    /// reuse it).
    pub fn route_prompt(
        &self,
        req: &RouteRequest<'_>,
        exclude: &[WorkerId],
        prompt: Option<&[u32]>,
    ) -> Result<RouterDecision, RequestError> {
        let started = Instant::now();
        let result = self.route_inner(req, exclude, prompt);
        match &result {
            Ok(d) => {
                self.metrics.record_decision(d.mode, d.fall_through_reason);
                self.metrics.record_latency(started.elapsed());
            }
            Err(e) => self.metrics.record_route_error(e.code()),
        }
        result
    }

    fn route_inner(
        &self,
        req: &RouteRequest<'_>,
        exclude: &[WorkerId],
        prompt: Option<&[u32]>,
    ) -> Result<RouterDecision, RequestError> {
        self.validate_route(req)?;
        let session = req.session;
        let now = self.now_ms();
        let policy = &self.config.policy;

        let mut core = self.core.lock();
        let core = &mut *core;
        // When the session last had a request or an answer, before this request.
        let last_seen = session.and_then(|s| core.sessions.last_seen(s));
        // A few of the expired sessions per decision, the rest from the background tick.
        core.sessions
            .expire_some(now, EXPIRE_PER_DECISION, &mut core.forgotten);
        if let Some(s) = session {
            core.sessions.expire_if_stale(s, now, &mut core.forgotten);
            core.sessions.touch(s, now, &mut core.forgotten);
        }
        self.forget(core);

        let fleet = core
            .fleet
            .at(&self.workers().list, &self.health_epoch, now)?;
        // Workers excluded for this one decision: a copy of the fleet with them down.
        let excluded;
        let fleet = if exclude.is_empty() {
            fleet
        } else {
            let mut f = fleet.clone();
            for &w in exclude {
                f.set_health(w, kvc_core::Health::Down);
            }
            excluded = f;
            &excluded
        };
        let states = LiveStates {
            service: self,
            now_ms: now,
        };
        let decide = |state: &RouterState, req: &RouteRequest<'_>| {
            kvc_policy::route_in(policy, state, fleet, &states, now, req)
        };

        // A session this router has no placement for, which the engines' events show
        // resident on a worker: another replica placed it. Adopt that placement, and route the
        // request as a later turn (this router's turn count started at its own first sight).
        let adopted;
        let req = match session {
            Some(s) if core.state.session(s).is_none_or(|r| r.current_d.is_none()) => {
                match self.events_placement(s) {
                    Some((worker, blocks)) => {
                        let n = (blocks as usize).min(req.hash_ids.len());
                        core.state.observe(&Observation::Adopted {
                            session: s,
                            worker,
                            blocks: req.hash_ids[..n].to_vec(),
                            resident_tokens: u64::from(blocks)
                                * u64::from(policy.block_size().tokens()),
                        });
                        self.metrics.record_event_adoption();
                        adopted = RouteRequest {
                            turn: req.turn.filter(|t| !t.is_first()),
                            ..*req
                        };
                        &adopted
                    }
                    None => req,
                }
            }
            _ => req,
        };
        let mut decision = match decide(&core.state, req) {
            // No worker of a needed role has fresh state: route on the stale ones rather
            // than refuse (a starved publisher or a late scrape is not a dead worker; one
            // that is gone fails the request, and its breaker takes it out).
            Err(e @ kvc_policy::PolicyError::NoHealthyWorker { .. }) => {
                let drained: Vec<WorkerId> = self
                    .workers()
                    .list
                    .iter()
                    .filter(|w| w.drained.load(Ordering::Relaxed))
                    .map(|w| w.id)
                    .collect();
                let Some(revived) = stale_as_healthy(fleet, &drained) else {
                    return Err(e.into());
                };
                let decision =
                    kvc_policy::route_in(policy, &core.state, &revived, &states, now, req)?;
                self.metrics.record_stale_routed();
                decision
            }
            other => other?,
        };
        // The engine's own events say the session's KV is gone from the worker it would go
        // to: the policy learns the eviction and decides again (reseed or fallback; a local
        // turn planned on the session's host, which counted on that KV, is costed again; a
        // colocated session is placed again by score).
        // Not while the events of the session's last turn may still be on their way: a turn
        // sent as soon as the last one was answered would otherwise find nothing stored yet.
        // The events decide once they had shown the blocks there (then they saw them go),
        // once they have caught up with the session's last request or answer (a batch the
        // engine published since is applied), or `events-lag-ms` after it. Holding "some"
        // blocks is not enough: the blocks of a system prompt every session shares stay on a
        // busy worker, so the events must show at least half of what the plan counts on the
        // worker holding. What they show held is the more of: the blocks the events credit
        // to the session, and, when the caller gave the prompt's tokens (the HTTP front), the
        // prompt's leading blocks on the worker, whoever stored them. vLLM reports a
        // prefix-cache hit as a store under the hitting request's session, so a block many
        // sessions share is credited to the last of them: a subagent's first turn on its
        // parent's worker takes the credit of the parent's whole prefix. The credit alone
        // still decides where the front's tokens are not the engine's (another template, an
        // engine whose events carry other tokens).
        // Nor while an earlier request of the session on that worker waits for its outcome:
        // its KV may still be on its way there (a seed computed on P and shipped, which the
        // engine stores and reports only when it lands), however long that takes, and an
        // agent sends requests of one session side by side (a title beside the turn, tool
        // calls answered in parallel).
        let evicted = session.is_some_and(|s| {
            counts_on_residency(&decision, &core.state, s)
                && !core.in_flight.contains_key(&(s, decision.decode))
                && self.events_show_eviction(
                    &mut core.events_showed,
                    &decision,
                    (s, prompt),
                    last_seen,
                    now,
                )
        });
        if let Some(s) = session
            && evicted
        {
            core.events_showed.remove(&s);
            core.state.observe(&Observation::Evicted {
                session: s,
                worker: decision.decode,
            });
            self.metrics.record_event_eviction();
            decision = decide(&core.state, req)?;
        }
        let mut probe_rejected_by = None;
        if decision.is_direct() {
            let d = decision.decode;
            let admitted = match self.entry(d.0) {
                Some(entry) => {
                    let need = self.direct_need_tokens(&entry, &decision, &core.state, policy);
                    let p = probe_entry(&entry, need, session, now);
                    self.metrics.record_probe(p.kind);
                    p.reply.can_admit
                }
                None => false,
            };
            if !admitted {
                if let Some(s) = session {
                    core.state.observe(&Observation::AdmissionRejected {
                        session: s,
                        worker: d,
                    });
                }
                self.metrics.record_reroute();
                decision = decide(&core.state, &req.rejected_by(d))?;
                probe_rejected_by = Some(d);
            }
        }
        core.state.apply(&decision.change);
        let id = self.next_decision.fetch_add(1, Ordering::Relaxed);
        core.pending.insert(
            id,
            Pending {
                request_id: req.request_id,
                session,
                decode: decision.decode,
                direct: decision.is_direct(),
                ends_session: false,
            },
        );
        core.flight_started(session, decision.decode);
        core.pending_order.push_back(id);
        self.bound_pending(core);
        Ok(handed_out(id, &decision, probe_rejected_by))
    }

    fn bound_pending(&self, core: &mut Core) {
        let max = self.config.max_pending_decisions;
        let mut dropped = 0u64;
        while core.pending.len() > max {
            let Some(oldest) = core.pending_order.pop_front() else {
                break;
            };
            if let Some(p) = core.pending.remove(&oldest) {
                core.flight_ended(p.session, p.decode);
                // Release its in-flight count without touching the session's residency: the
                // outcome is unknown.
                core.state.observe(&Observation::Completed {
                    request_id: p.request_id,
                    session: None,
                    worker: p.decode,
                    outcome: Outcome::WorkerFailed,
                    resident_tokens: 0,
                    direct: p.direct,
                });
                dropped += 1;
            }
        }
        if core.pending_order.len() > 2 * max.max(16) {
            let pending = &core.pending;
            core.pending_order.retain(|id| pending.contains_key(id));
        }
        if dropped > 0 {
            self.metrics.record_pending_dropped(dropped);
        }
    }
}

/// Whether `decision` counts on `session`'s KV being resident on its decode worker: a
/// direct-to-D turn, or a local turn on the worker the router believes holds the session.
impl RouterService {
    /// The room a direct-to-D `decision` needs on its worker, as the worker's probe judges
    /// it. A snapshot's probe counts the session's own KV and the reservations itself, so
    /// the decision's need goes as it is. A stock engine's figures count only its running
    /// requests: the session's cached blocks sit in what it reports free (the first to be
    /// taken when other work needs room), and the KV of the P→D requests on their way to it
    /// lands there before this turn runs. The turn is admitted only if that room holds all
    /// three; else it goes through P, which holds the session's prefix, instead of reaching
    /// a D that evicted it meanwhile and recomputes the whole prompt.
    fn direct_need_tokens(
        &self,
        entry: &WorkerEntry,
        decision: &Decision,
        state: &RouterState,
        policy: &PolicyConfig,
    ) -> u64 {
        if !entry.is_scraped() {
            return decision.need_tokens;
        }
        let inbound = state
            .awaiting_kv_blocks(decision.decode)
            .saturating_mul(u64::from(policy.block_size().tokens()));
        decision
            .need_tokens
            .saturating_add(decision.cached_tokens)
            .saturating_add(inbound)
    }

    /// Whether the events of `decision`'s worker say `session` is gone from it (the rule
    /// above); records the worker while they show the session there.
    fn events_show_eviction(
        &self,
        showed: &mut std::collections::HashMap<SessionId, WorkerId>,
        decision: &Decision,
        (session, prompt): (SessionId, Option<&[u32]>),
        last_seen: Option<u64>,
        now: u64,
    ) -> bool {
        let d = decision.decode;
        let enough = |held: u64| held.saturating_mul(2) >= decision.cached_tokens.max(1);
        // The prompt's overlap is worked out only where the credit alone falls short.
        let held = match self.events_residency(d, session) {
            Some(c) if enough(c) => Some(c),
            credited => match (credited, prompt.and_then(|t| self.events_prompt_held(d, t))) {
                (Some(c), Some(p)) => Some(c.max(p)),
                (c, p) => c.or(p),
            },
        };
        match held {
            Some(held) if !enough(held) => {
                showed.get(&session) == Some(&d)
                    || last_seen.is_none_or(|t| {
                        now.saturating_sub(t) >= self.config.engine_signals.events_lag_ms
                            || self.events_caught_up(d, t)
                    })
            }
            Some(_) => {
                showed.insert(session, d);
                false
            }
            None => false,
        }
    }
}

/// Whether `decision` counts on `session`'s KV being where the policy believes it: a direct
/// turn, or a turn served alone (local prefill, or a colocated worker's) on the worker the
/// session is resident on. A colocated session held to its worker after that worker evicted
/// it would never be placed again (strict stickiness), however full its worker.
fn counts_on_residency(decision: &Decision, state: &RouterState, session: SessionId) -> bool {
    match decision.mode {
        ExecutionMode::DirectToD => true,
        ExecutionMode::LocalPrefill | ExecutionMode::Colocated => {
            state.session(session).is_some_and(|r| {
                r.current_d == Some(decision.decode) && r.residency == Residency::Resident
            })
        }
        _ => false,
    }
}

/// The policy's `decision`, handed out under decision id `id`.
fn handed_out(id: u64, d: &Decision, probe_rejected_by: Option<WorkerId>) -> RouterDecision {
    RouterDecision {
        decision_id: id,
        mode: d.mode,
        prefill_worker: d.prefill,
        decode_worker: d.decode,
        fall_through_reason: d.reason,
        cached_tokens: d.cached_tokens,
        recommended_pause_ms: d.recommended_pause_ms,
        need_tokens: d.need_tokens,
        probe_rejected_by,
        // A count of blocks, scored as a float.
        decode_overlap: d
            .score(d.decode, d.change.decode_role)
            .and_then(|e| e.component("overlap"))
            .map(|o| o.max(0.0).round() as u64),
        predicted_prefill_us: d.change.prefill_us,
    }
}

/// A copy of `fleet` with its stale workers (but the `drained` ones) taken as healthy; `None`
/// when it has none.
fn stale_as_healthy(fleet: &kvc_policy::Fleet, drained: &[WorkerId]) -> Option<kvc_policy::Fleet> {
    let stale: Vec<WorkerId> = fleet
        .workers()
        .filter(|w| w.state.health == kvc_core::Health::Stale && !drained.contains(&w.id))
        .map(|w| w.id)
        .collect();
    if stale.is_empty() {
        return None;
    }
    let mut revived = fleet.clone();
    for w in stale {
        revived.set_health(w, kvc_core::Health::Healthy);
    }
    Some(revived)
}
