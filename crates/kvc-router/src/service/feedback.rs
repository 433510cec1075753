//! What comes back after a decision: the request's outcome, `CommitEvict` through a worker's
//! commit queue (its evictions observed), and probes of a worker's room.

use super::{DecisionOutcome, ProbeOutcome, RouterService};
use crate::error::RequestError;
use crate::metrics::{CommitKind, ProbeKind};
use crate::workers::WorkerEntry;
use kvc_admission::{
    CommitError, CommitReply, CommitRequest, CommitSender, ProbeAnswer, ProbeResult,
};
use kvc_core::{Outcome, SessionId, StateSource, WorkerId};
use kvc_policy::Observation;
use std::time::Duration;

impl RouterService {
    /// Feeds a request's outcome back: the decode worker's residency for the session, the
    /// in-flight count, and (for a successful direct-to-D turn) the session's reject counter.
    ///
    /// A direct-to-D decision reported `rejected` (its decode worker's admission refused the
    /// turn) only releases the request: the worker served nothing, so what the router believes
    /// resident there is left as it was (the caller then routes again with `rejected_by`).
    /// `NOT_FOUND` for a decision already reported or dropped; `INVALID_ARGUMENT` when the
    /// request id is not the decision's, or when `resident_tokens` exceeds the decode worker's
    /// `capacity-tokens` (the decision then stays pending). A decision on a worker removed
    /// from the fleet since is taken with no resident tokens: the router counts on nothing
    /// there.
    pub fn report_outcome(&self, report: &DecisionOutcome) -> Result<(), RequestError> {
        let outcome = report.outcome;
        let now = self.now_ms();
        let mut core = self.core.lock();
        let core = &mut *core;
        let Some(p) = core.pending.get(&report.decision_id).copied() else {
            return Err(RequestError::NotFound(format!(
                "unknown decision {} (already reported, or dropped)",
                report.decision_id
            )));
        };
        if p.request_id != report.request_id {
            return Err(RequestError::InvalidArgument(format!(
                "decision {} was for request {}, not {}",
                report.decision_id, p.request_id.0, report.request_id.0
            )));
        }
        let entry = self.entry(p.decode.0);
        // A worker that left the fleet since holds nothing the router counts on.
        let resident_tokens = if entry.is_some() {
            report.resident_tokens
        } else {
            0
        };
        let capacity = entry.as_ref().map_or(0, |e| e.pool_tokens());
        if resident_tokens > capacity {
            return Err(RequestError::InvalidArgument(format!(
                "resident_tokens {} exceeds the capacity of worker {} ({capacity} tokens)",
                report.resident_tokens, p.decode.0
            )));
        }
        core.pending.remove(&report.decision_id);
        core.flight_ended(p.session, p.decode);
        if let Some(e) = entry {
            e.note_released(resident_tokens);
        }
        let refused = p.direct && outcome == Outcome::Rejected;
        core.state.observe(&Observation::Completed {
            request_id: p.request_id,
            session: if refused { None } else { p.session },
            worker: p.decode,
            outcome,
            resident_tokens,
            direct: p.direct,
        });
        if let Some(s) = p.session
            && p.ends_session
        {
            // The client's last turn: its residency is released now that it is known.
            Self::end_in(core, s);
            self.metrics.record_session_ended();
        } else if let Some(s) = p.session
            && core.sessions.last_seen(s).is_some()
        {
            core.sessions.touch(s, now, &mut core.forgotten);
            self.forget(core);
        }
        self.metrics.record_outcome(outcome);
        Ok(())
    }

    /// The first token of decision `decision_id`'s answer came now: its prefill leaves its
    /// worker's backlog, and the time since the decision is a sample of that worker's pace
    /// ([`kvc_policy::RouterState::prefill_pace`]). Only for a turn its worker prefilled
    /// itself: a P→D turn's first token comes after its KV transfer, and its prefill stays in
    /// P's backlog until it completes. Nothing for a decision already reported.
    pub fn report_first_token(&self, decision_id: u64) {
        let now = self.now_ms();
        let mut core = self.core.lock();
        let Some(p) = core.pending.get(&decision_id).copied() else {
            return;
        };
        core.state.observe(&Observation::PrefillDone {
            request_id: p.request_id,
            at_ms: Some(now),
        });
    }

    /// Asks `worker` to make room (evicting if needed) through its commit queue: an attached
    /// in-process queue, else its worker service. Sessions it evicts are observed as evicted.
    /// `INVALID_ARGUMENT` for an unknown worker, `FAILED_PRECONDITION` for one with neither.
    pub async fn commit_evict(
        &self,
        worker: WorkerId,
        req: CommitRequest,
    ) -> Result<CommitReply, RequestError> {
        let entry = self.entry_or_invalid(worker.0)?;
        let local = self.local_commit.read().get(&worker).cloned();
        let result = if let Some(sender) = local {
            let timeout = Duration::from_millis(self.config.rpc_timeout_ms);
            commit_local(sender, req, timeout).await
        } else {
            match entry.commit_evict(req).await {
                Some(Ok(reply)) => Ok(reply),
                Some(Err(status)) => Err(match status.code() {
                    tonic::Code::ResourceExhausted => {
                        RequestError::ResourceExhausted(status.message().to_owned())
                    }
                    tonic::Code::DeadlineExceeded => {
                        RequestError::DeadlineExceeded(status.message().to_owned())
                    }
                    _ => RequestError::Unavailable(format!(
                        "worker {}: {}",
                        worker.0,
                        status.message()
                    )),
                }),
                None => Err(RequestError::FailedPrecondition(format!(
                    "worker {} has no service address or commit queue",
                    worker.0
                ))),
            }
        };
        match &result {
            Ok(reply) => {
                self.metrics.record_commit(if reply.admitted {
                    CommitKind::Admitted
                } else {
                    CommitKind::Rejected
                });
                if !reply.evicted.is_empty() {
                    let mut core = self.core.lock();
                    for s in &reply.evicted {
                        core.state.observe(&Observation::Evicted {
                            session: *s,
                            worker,
                        });
                    }
                }
            }
            Err(RequestError::ResourceExhausted(_)) => self.metrics.record_commit(CommitKind::Busy),
            Err(_) => self.metrics.record_commit(CommitKind::Error),
        }
        result
    }

    /// Probes `worker` for `need_tokens` (for `session`): its snapshot when it has one (no
    /// RPC), else its last polled state. `INVALID_ARGUMENT` for an unknown worker.
    pub fn probe_worker(
        &self,
        worker: WorkerId,
        need_tokens: u64,
        session: Option<SessionId>,
    ) -> Result<ProbeOutcome, RequestError> {
        let entry = self.entry_or_invalid(worker.0)?;
        let now = self.now_ms();
        let outcome = probe_entry(&entry, need_tokens, session, now);
        self.metrics.record_probe(outcome.kind);
        Ok(outcome)
    }
}

/// No room, and why not: `snapshot_age_ms` of what was read (`u64::MAX` when nothing was).
fn no_room(snapshot_age_ms: u64) -> ProbeAnswer {
    ProbeAnswer {
        can_admit: false,
        available_tokens: 0,
        evictable_tokens: 0,
        queue_depth: 0,
        snapshot_age_ms,
        recommended_pause_ms: 0,
        session_resident_tokens: None,
    }
}

pub(super) fn probe_entry(
    entry: &WorkerEntry,
    need_tokens: u64,
    session: Option<SessionId>,
    now: u64,
) -> ProbeOutcome {
    if entry.source == StateSource::Snapshot {
        let Some(reader) = entry.reader() else {
            return ProbeOutcome {
                kind: ProbeKind::Stale,
                reply: no_room(u64::MAX),
            };
        };
        return match reader.probe(need_tokens, session, now) {
            ProbeResult::Ready(a) => ProbeOutcome {
                kind: if a.can_admit {
                    ProbeKind::Admit
                } else {
                    ProbeKind::Reject
                },
                reply: a,
            },
            ProbeResult::Stale { age_ms } => ProbeOutcome {
                kind: ProbeKind::Stale,
                reply: no_room(age_ms),
            },
            ProbeResult::Contended => ProbeOutcome {
                kind: ProbeKind::Contended,
                reply: no_room(0),
            },
        };
    }
    let s = entry.state_at(now);
    let available = s.available_tokens();
    let can_admit = s.health.is_routable() && need_tokens <= available;
    ProbeOutcome {
        kind: ProbeKind::State,
        reply: ProbeAnswer {
            can_admit,
            available_tokens: available,
            evictable_tokens: s.evictable_tokens,
            queue_depth: s.queue_depth,
            snapshot_age_ms: s.state_age_ms,
            recommended_pause_ms: kvc_admission::recommended_pause_ms(
                u64::from(s.queue_depth),
                s.used_fraction(),
            ),
            session_resident_tokens: None,
        },
    }
}

async fn commit_local(
    sender: CommitSender,
    req: CommitRequest,
    timeout: Duration,
) -> Result<CommitReply, RequestError> {
    let pending = sender.submit(req).map_err(commit_error)?;
    tokio::task::spawn_blocking(move || pending.wait(timeout))
        .await
        .map_err(|e| RequestError::Internal(format!("commit wait task: {e}")))?
        .map_err(commit_error)
}

fn commit_error(e: CommitError) -> RequestError {
    match e {
        CommitError::Busy { .. } => RequestError::ResourceExhausted(e.to_string()),
        CommitError::OwnerGone => RequestError::Unavailable(e.to_string()),
        CommitError::Timeout => RequestError::DeadlineExceeded(e.to_string()),
    }
}
