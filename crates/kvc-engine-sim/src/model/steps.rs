//! Time passing: iterations started and ended, first tokens, transfers done or timed out,
//! jobs finished.

use super::engine::Engine;
use super::types::{Event, Micros, Wake, micros};
use super::worker::{Iteration, Stage};
use kvc_core::{FailureStage, WorkerId};

impl Engine {
    /// Starts an iteration on `w` if it is idle and has work.
    pub(super) fn start_iteration_if_idle(&mut self, w: WorkerId, now: Micros) {
        let wk = &self.workers[w.0 as usize];
        if wk.iteration.is_some() || wk.settling {
            return;
        }
        let mut budget = self.profile.fit.chunk_tokens;
        // The lists of the last iteration that ended, emptied, keep their room.
        let mut pieces = std::mem::take(&mut self.spare.prefill);
        let mut decode = std::mem::take(&mut self.spare.decode);
        let mut prefill_cost = 0.0;
        if !wk.prefill_q.is_empty() {
            let mut cost_pieces = Vec::new();
            for &id in &wk.prefill_q {
                if budget == 0 {
                    break;
                }
                let a = &self.jobs[&id];
                let take = a.remaining.min(budget);
                budget -= take;
                pieces.push((id, take, a.epoch));
                cost_pieces.push((take, a.done_ctx));
            }
            if !pieces.is_empty() {
                prefill_cost = self.profile.prefill_seconds(cost_pieces);
            }
        }
        // Without mixed batches (SGLang's default), a waiting prefill runs alone and the decode
        // batch resumes after it; with them, one iteration carries both.
        // The decode batch and its context, one job lookup each.
        let mut ctx = 0u64;
        if pieces.is_empty() || self.profile.fit.mixed_batches {
            decode.extend(wk.running.iter().map(|id| {
                let a = &self.jobs[id];
                ctx += a.job.input + a.generated;
                (*id, a.epoch)
            }));
        }
        if pieces.is_empty() && decode.is_empty() {
            self.spare = Iteration {
                prefill: pieces,
                decode,
            };
            return;
        }
        let mut secs = 0.0;
        if !pieces.is_empty() {
            secs += prefill_cost;
        }
        if !decode.is_empty() {
            secs += self.profile.decode_step_seconds(decode.len(), ctx);
        }
        let end = now + self.jittered(secs).max(1);
        self.workers[w.0 as usize].iteration = Some(Iteration {
            prefill: pieces,
            decode,
        });
        self.wakes.push((end, Wake::IterationEnd(w)));
    }

    /// Handles a wake-up the driver scheduled.
    pub fn wake(&mut self, wake: Wake, now: Micros) {
        match wake {
            Wake::IterationEnd(w) => self.end_iteration(w, now),
            Wake::TransferDone(id) => self.transfer_done(id, now),
            Wake::TransferTimeout(id) => self.transfer_timeout(id, now),
        }
    }

    pub(super) fn end_iteration(&mut self, w: WorkerId, now: Micros) {
        let Some(Iteration {
            prefill: mut pieces,
            mut decode,
        }) = self.workers[w.0 as usize].iteration.take()
        else {
            return;
        };
        let hosts = self.workers[w.0 as usize].hosts;
        self.workers[w.0 as usize].settling = true;
        if hosts && !decode.is_empty() {
            // One decode step: the ratio decays toward its floor.
            let p = &self.profile.fit.pressure;
            let step = (p.init_new_token_ratio - p.min_new_token_ratio)
                / f64::from(p.new_token_ratio_decay_steps);
            let wk = &mut self.workers[w.0 as usize];
            wk.token_ratio = (wk.token_ratio - step).max(p.min_new_token_ratio);
        }
        for (id, take, epoch) in pieces.drain(..) {
            // A job retracted (or failed) since the iteration started lost this work.
            let Some(a) = self.jobs.get_mut(&id).filter(|a| a.epoch == epoch) else {
                continue;
            };
            a.remaining -= take;
            a.done_ctx += take;
            if a.remaining == 0 {
                // Prefilled here for another worker: the KV ships.
                let ships = a.decode_on != w;
                self.workers[w.0 as usize].prefill_q.retain(|x| *x != id);
                if ships {
                    self.start_transfer(id, now);
                } else if self.jobs[&id].generated > 0 {
                    // A retracted job recomputed its context: decoding resumes.
                    self.jobs.get_mut(&id).expect("job").stage = Stage::Decode;
                    self.workers[w.0 as usize].running.push(id);
                } else {
                    self.first_token(id, w, now);
                }
            }
        }
        for (id, epoch) in decode.drain(..) {
            let Some(a) = self
                .jobs
                .get_mut(&id)
                .filter(|a| a.epoch == epoch && a.stage == Stage::Decode)
            else {
                continue;
            };
            // The room this step writes is usually there already ([`Engine::grow`]'s first
            // test); only a job short of it takes the way through `grow`.
            let a = if hosts && !self.workers[w.0 as usize].has_room_for_step(a) {
                if !self.grow(w, id, now) {
                    continue;
                }
                self.jobs.get_mut(&id).expect("job")
            } else {
                a
            };
            a.generated += 1;
            if a.generated >= a.job.output {
                self.finish(id, now);
            }
        }
        self.workers[w.0 as usize].settling = false;
        self.spare = Iteration {
            prefill: pieces,
            decode,
        };
        self.start_iteration_if_idle(w, now);
    }

    pub(super) fn first_token(&mut self, id: usize, decode_on: WorkerId, now: Micros) {
        self.events.push(Event::FirstToken { id, at: now });
        let a = self.jobs.get_mut(&id).expect("job");
        a.generated = 1;
        a.stage = Stage::Decode;
        if a.job.output <= 1 {
            self.finish(id, now);
        } else {
            self.workers[decode_on.0 as usize].running.push(id);
            self.start_iteration_if_idle(decode_on, now);
        }
    }

    pub(super) fn transfer_done(&mut self, id: usize, now: Micros) {
        let Some(a) = self.jobs.get(&id) else { return };
        // A transfer retracted and restarted since this wake-up was asked for ends later.
        if a.stage != Stage::Transfer || now < a.transfer_end {
            return;
        }
        let (p, d, session) = (a.prefill_on, a.decode_on, a.job.session);
        if let Some(r) = self.workers[d.0 as usize].residents.get_mut(&session) {
            r.prealloc = false;
        }
        self.release_prefill(id, now);
        self.first_token(id, d, now);
        self.retry_waiting(p, now);
    }

    /// Fails P→D job `id` on its way to D (queued or prefilling on P, or on P's sender):
    /// D's preallocated room and P's blocks are released. With `sending` (P had started on
    /// the job: its send goes to a room D has given up) P marks the pair dead
    /// ([`PressureFacts::failed_pair_recovery_s`]).
    ///
    /// [`PressureFacts::failed_pair_recovery_s`]: super::profile::PressureFacts
    pub(super) fn abort_p_to_d(
        &mut self,
        id: usize,
        sending: bool,
        stage: FailureStage,
        now: Micros,
    ) {
        let a = &self.jobs[&id];
        let (p, d, session) = (a.prefill_on, a.decode_on, a.job.session);
        let failure = match stage {
            FailureStage::PrefillRoom => {
                let need = self.prefill_need(id, p);
                self.failure(id, stage, p, need, now)
            }
            FailureStage::Prefill => self.failure(id, stage, p, 0, now),
            _ => self.failure(id, stage, d, 0, now),
        };
        let wp = &mut self.workers[p.0 as usize];
        wp.waiting.retain(|x| *x != id);
        wp.prefill_q.retain(|x| *x != id);
        if self.workers[d.0 as usize]
            .residents
            .get(&session)
            .is_some_and(|r| r.prealloc)
        {
            self.drop_resident(d, session);
        }
        self.release_prefill(id, now);
        self.jobs.remove(&id);
        let recovery = self.profile.fit.pressure.failed_pair_recovery_s;
        if sending && recovery > 0.0 {
            self.failed_pairs.insert((p, d), now + micros(recovery));
        }
        self.events.push(Event::TransferTimedOut {
            id,
            at: now,
            failure,
        });
        self.retry_waiting(p, now);
        self.retry_waiting(d, now);
    }

    /// Tokens of room job `id` waits for on prefill worker `p`: its blocks not in `p`'s
    /// prefix cache.
    fn prefill_need(&self, id: usize, p: WorkerId) -> u64 {
        let hashes = &self.jobs[&id].job.hashes;
        let matched = self.workers[p.0 as usize].cache.match_len(hashes);
        (hashes.len() - matched) as u64 * self.block_tokens()
    }

    pub(super) fn transfer_timeout(&mut self, id: usize, now: Micros) {
        let Some(a) = self.jobs.get(&id) else { return };
        if now < a.deadline {
            return;
        }
        let (p, d) = (a.prefill_on, a.decode_on);
        if self.profile.fit.pressure.timeout_until_arrival
            && p != d
            && !self.workers[p.0 as usize].hosts
            && matches!(
                a.stage,
                Stage::WaitingPool | Stage::Prefill | Stage::Transfer
            )
        {
            // Preallocated on D, but the KV has not arrived in time: D gives up on it. If P
            // had started on it, P's send goes to a room D no longer holds and fails.
            let sending = matches!(a.stage, Stage::Prefill | Stage::Transfer);
            let stage = match a.stage {
                Stage::WaitingPool => FailureStage::PrefillRoom,
                Stage::Prefill => FailureStage::Prefill,
                _ => FailureStage::Transfer,
            };
            self.abort_p_to_d(id, sending, stage, now);
            return;
        }
        if a.stage == Stage::Retracted {
            // Retracted and never given room back: out of memory as far as the client knows.
            let (d, backup, session) = (a.decode_on, a.backup, a.job.session);
            let need = self.admit_need(d, a.job.input + a.generated, (session, true));
            let failure = self.failure(id, FailureStage::Retracted, d, need, now);
            let wk = &mut self.workers[d.0 as usize];
            wk.waiting.retain(|x| *x != id);
            wk.host_backup -= backup;
            self.jobs.remove(&id);
            self.events.push(Event::DecodeOom {
                id,
                at: now,
                failure,
            });
            self.retry_waiting(d, now);
            return;
        }
        let (p, d, session) = (a.prefill_on, a.decode_on, a.job.session);
        if a.stage == Stage::WaitingPool && p != d && self.workers[p.0 as usize].hosts {
            // Waiting for prefill room on a worker that hosts sessions: D's room goes back.
            let need = self.prefill_need(id, p);
            let failure = self.failure(id, FailureStage::PrefillRoom, p, need, now);
            self.workers[p.0 as usize].waiting.retain(|x| *x != id);
            self.drop_resident(d, session);
            self.jobs.remove(&id);
            self.events.push(Event::TransferTimedOut {
                id,
                at: now,
                failure,
            });
            self.retry_waiting(p, now);
            self.retry_waiting(d, now);
            return;
        }
        if a.stage != Stage::WaitingD {
            return;
        }
        let need = self.admit_need(d, a.job.input, (session, true));
        let failure = self.failure(id, FailureStage::DecodeRoom, d, need, now);
        self.workers[d.0 as usize].waiting.retain(|x| *x != id);
        self.release_prefill(id, now);
        // The session's old KV on D (if any) is no longer trusted.
        self.release_session(d, session, now);
        self.jobs.remove(&id);
        self.events.push(Event::TransferTimedOut {
            id,
            at: now,
            failure,
        });
        self.retry_waiting(p, now);
        self.retry_waiting(d, now);
    }

    /// Unpins a job's blocks and extra tokens on its prefill/colocated worker.
    pub(super) fn release_prefill(&mut self, id: usize, now: Micros) {
        let a = self.jobs.get_mut(&id).expect("job");
        let (w, n, extra) = (a.prefill_on, a.pinned, a.extra);
        let hashes = a.job.hashes.clone();
        a.pinned = 0;
        a.extra = 0;
        let wk = &mut self.workers[w.0 as usize];
        wk.cache.unpin(&hashes[..n], now);
        wk.cache_extra -= extra;
    }

    pub(super) fn finish(&mut self, id: usize, now: Micros) {
        let a = self.jobs.remove(&id).expect("job");
        let w = a.decode_on;
        let cached = a.cached;
        self.workers[w.0 as usize].running.retain(|x| *x != id);
        let mut resident_tokens = 0;
        if self.workers[w.0 as usize].hosts {
            let wk = &mut self.workers[w.0 as usize];
            if let Some(r) = wk.residents.get_mut(&a.job.session) {
                r.running = false;
                r.last_access = now;
                wk.idle_tokens += r.tokens;
                resident_tokens = r.tokens;
            }
        } else {
            self.jobs.insert(id, a);
            self.release_prefill(id, now);
            self.jobs.remove(&id);
        }
        self.events.push(Event::Done {
            id,
            at: now,
            resident_tokens,
            cached,
        });
        self.retry_waiting(w, now);
    }
}
