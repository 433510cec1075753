//! Admission of jobs: the P→D path, reseeds, direct-to-D and local turns, the queues that
//! wait for room, and transfers into decode workers.

use super::engine::Engine;
use super::types::{DirectAdmission, Job, LocalAdmission, Micros, Wake, micros};
use super::worker::{Active, ResidentEntry, Stage};
use kvc_core::{FailureStage, SessionId, WorkerId};

impl Engine {
    /// Starts a job on the P→D path: prefill on `p`, transfer to `d`.
    pub fn start_p_to_d(&mut self, job: Job, p: WorkerId, d: WorkerId, now: Micros) {
        let id = job.id;
        let a = Active::new(job, p, d, Stage::WaitingPool);
        let session = a.job.session;
        self.jobs.insert(id, a);
        if p == d {
            self.workers[p.0 as usize].waiting.push_back(id);
            self.retry_waiting(p, now);
            return;
        }
        // The decode worker learns of the request when it is sent (SGLang sends it to P and D
        // at once): from then on the session has a request in flight. D preallocates room for
        // the whole context before P computes anything; the request waits in D's queue for
        // that room, and fails past the transfer timeout.
        self.pin_pending(d, session);
        let deadline = now + micros(self.profile.fit.transfer_timeout_s);
        let a = self.jobs.get_mut(&id).expect("job");
        a.stage = Stage::WaitingD;
        a.deadline = deadline;
        self.workers[d.0 as usize].waiting.push_back(id);
        self.wakes.push((deadline, Wake::TransferTimeout(id)));
        self.retry_waiting(d, now);
    }

    /// Starts a job on the P→D path that seeds (or re-seeds) its session on `d`: the
    /// session's resident KV on every other decode worker is released first, so the session
    /// lives on one decode worker only. Every P→D start goes through here, in the simulator
    /// and behind the HTTP workers alike.
    pub fn reseed(&mut self, job: Job, p: WorkerId, d: WorkerId, now: Micros) {
        for w in 0..self.workers.len() {
            let w = WorkerId(w as u32);
            if w != d && self.workers[w.0 as usize].hosts {
                self.release_session(w, job.session, now);
            }
        }
        self.start_p_to_d(job, p, d, now);
    }

    /// Starts a job on the P→D path that moves its session from `from` to `d` with its KV
    /// (`migrate-kv`): the session's KV stays on `from`, held (not evictable) while the job
    /// waits, as vLLM's sender prefills at once and holds the KV for the pull; when `from`
    /// prefills the job the KV becomes prefix cache there, as a stock engine keeps a finished
    /// request's blocks ([`Engine::admit_prefill`]), so `from` computes only what it does not
    /// hold and ships the whole KV to `d`. The session's KV on every other worker is
    /// released, as for a reseed.
    pub fn migrate(&mut self, job: Job, from: WorkerId, d: WorkerId, now: Micros) {
        for w in 0..self.workers.len() {
            let w = WorkerId(w as u32);
            if w != d && w != from && self.workers[w.0 as usize].hosts {
                self.release_session(w, job.session, now);
            }
        }
        let wk = &mut self.workers[from.0 as usize];
        if let Some(r) = wk.residents.get_mut(&job.session)
            && r.idle()
        {
            r.pending = true;
            wk.idle_tokens -= r.tokens;
        }
        self.start_p_to_d(job, from, d, now);
    }

    /// Starts a job that decode worker `d` serves alone and in full (a stock vLLM decode
    /// instance given a plain request whose session it does not hold, or has no room to
    /// extend): the session's KV on every decode worker is released first, then the job
    /// waits in `d`'s queue for room for its context exactly as a retracted job does,
    /// prefills the whole context on `d` and decodes there; past the transfer timeout
    /// without room it fails with `decode-oom`.
    pub fn start_full_on_decode(&mut self, job: Job, d: WorkerId, now: Micros) {
        for w in 0..self.workers.len() {
            let w = WorkerId(w as u32);
            if self.workers[w.0 as usize].hosts {
                self.release_session(w, job.session, now);
            }
        }
        let id = job.id;
        let deadline = now + micros(self.profile.fit.transfer_timeout_s);
        self.jobs.insert(
            id,
            Active {
                deadline,
                ..Active::new(job, d, d, Stage::Retracted)
            },
        );
        self.workers[d.0 as usize].waiting.push_back(id);
        self.wakes.push((deadline, Wake::TransferTimeout(id)));
        self.retry_waiting(d, now);
    }

    /// Starts a job on a colocated worker.
    pub fn start_colocated(&mut self, job: Job, w: WorkerId, now: Micros) {
        self.start_p_to_d(job, w, w, now);
    }

    /// Tries to admit a direct-to-D job on `d` whose router-side need estimate is
    /// `need_estimate` tokens. On success the job is queued for append-prefill.
    pub fn try_direct(
        &mut self,
        job: Job,
        d: WorkerId,
        need_estimate: u64,
        now: Micros,
    ) -> DirectAdmission {
        let block_size = self.opts.block_size;
        let wk = &self.workers[d.0 as usize];
        let Some(res) = wk.residents.get(&job.session) else {
            return DirectAdmission::NotResident;
        };
        debug_assert!(!res.running, "a session's turns run one at a time");
        let free = self.pool_free(d);
        let evictable_others = wk.idle_tokens.saturating_sub(res.tokens)
            + wk.cache.evictable() as u64 * self.block_tokens();
        if need_estimate > free + evictable_others {
            return DirectAdmission::Rejected;
        }
        let cached =
            kvc_core::prefix::reusable_from(&res.hashes, &job.hashes, job.input, block_size);
        let old = res.tokens;
        let new_size = job.input.max(old);
        if !self.make_room_admit(d, new_size - old, (job.session, false), now, true) {
            return DirectAdmission::Rejected;
        }
        let wk = &mut self.workers[d.0 as usize];
        let res = wk.residents.get_mut(&job.session).expect("still resident");
        if res.idle() {
            wk.idle_tokens -= res.tokens;
        }
        wk.resident_tokens = wk.resident_tokens - res.tokens + new_size;
        res.tokens = new_size;
        res.running = true;
        res.last_access = now;
        res.hashes = job.hashes.clone();
        let id = job.id;
        let remaining = job.input - cached;
        self.jobs.insert(
            id,
            Active {
                remaining,
                done_ctx: cached,
                cached,
                ..Active::new(job, d, d, Stage::Prefill)
            },
        );
        wk.prefill_q.push_back(id);
        self.start_iteration_if_idle(d, now);
        DirectAdmission::Admitted { cached }
    }

    /// Tries to admit a turn that worker `w` serves alone (`local-prefill`) with a
    /// router-side need estimate of `need_estimate` tokens: `w` prefills whatever of the
    /// prompt it does not hold, decodes, and keeps the session resident, as a vLLM instance
    /// serves a plain request. If the session is resident on `w`, this is an append of any
    /// size ([`Engine::try_direct`]). Otherwise the turn takes its place in `w`'s queue,
    /// behind the transfers and turns already waiting there for room (vLLM's scheduler is
    /// first come, first served), and is admitted when `w` has room for its prompt as an
    /// append has (the decode reserve for itself only): it reuses the longest prefix `w`
    /// holds — of another resident session's KV or of its prefix cache (vLLM's prefix caching
    /// shares blocks across requests; the model counts a shared block once per session
    /// holding it). Sent, it releases the session on every other worker that hosts it (as
    /// [`Engine::reseed`] does). Admitted,
    /// it prefills on `w` beside `w`'s own appends and the prefills `w` runs for others.
    pub fn try_local(
        &mut self,
        job: Job,
        w: WorkerId,
        need_estimate: u64,
        now: Micros,
    ) -> LocalAdmission {
        let wk = &self.workers[w.0 as usize];
        debug_assert!(wk.hosts, "a local turn on a worker that hosts no sessions");
        if wk.residents.contains_key(&job.session) {
            return match self.try_direct(job, w, need_estimate, now) {
                DirectAdmission::Admitted { cached } => LocalAdmission::Started { cached },
                DirectAdmission::NotResident | DirectAdmission::Rejected => {
                    LocalAdmission::Rejected
                }
            };
        }
        // The prompt must fit the pool at all (the model's input limit sees to it); room that
        // is not there now is waited for, in order.
        if job.input + self.profile.fit.pressure.decode_reserve_tokens > wk.capacity {
            return LocalAdmission::Rejected;
        }
        // The session lives on one worker: as a reseed does, the turn releases it on every
        // other worker that hosts it when it is sent.
        for o in 0..self.workers.len() {
            let o = WorkerId(o as u32);
            if o != w && self.workers[o.0 as usize].hosts {
                self.release_session(o, job.session, now);
            }
        }
        let id = job.id;
        self.jobs
            .insert(id, Active::new(job, w, w, Stage::WaitingLocal));
        if self.workers[w.0 as usize].waiting.is_empty() && self.admit_local(id, w, now) {
            return LocalAdmission::Started {
                cached: self.jobs[&id].cached,
            };
        }
        self.workers[w.0 as usize].waiting.push_back(id);
        LocalAdmission::Queued
    }

    /// Admits local turn `id` on `w` if `w` has room for its prompt (see
    /// [`Engine::try_local`]).
    pub(super) fn admit_local(&mut self, id: usize, w: WorkerId, now: Micros) -> bool {
        let (session, input) = (self.jobs[&id].job.session, self.jobs[&id].job.input);
        if !self.make_room_admit(w, input, (session, false), now, true) {
            return false;
        }
        let hashes = self.jobs[&id].job.hashes.clone();
        let wk = &mut self.workers[w.0 as usize];
        let held = wk
            .residents
            .values()
            .map(|r| kvc_core::prefix::shared_prefix_blocks(&r.hashes, &hashes))
            .chain(std::iter::once(wk.cache.match_len(&hashes)))
            .max()
            .unwrap_or(0);
        let cached = kvc_core::prefix::reusable_tokens(held, input, self.opts.block_size);
        wk.resident_tokens += input;
        wk.residents
            .insert(session, ResidentEntry::running(input, hashes, now));
        wk.prefill_q.push_back(id);
        let a = self.jobs.get_mut(&id).expect("job");
        a.stage = Stage::Prefill;
        a.remaining = input - cached;
        a.done_ctx = cached;
        a.cached = cached;
        self.start_iteration_if_idle(w, now);
        true
    }

    /// Admits waiting jobs of worker `w` while there is room: in order, without overtaking,
    /// on prefill and colocated workers; on a decode worker a transfer (or retracted job) that
    /// fits is not held behind one that does not, so a session whose own KV is pinned there
    /// can always take its turn.
    pub(super) fn retry_waiting(&mut self, w: WorkerId, now: Micros) {
        let decode = self.workers[w.0 as usize].hosts;
        let decode_only = decode && !self.workers[w.0 as usize].recomputes;
        let mut blocked = false;
        let mut i = 0;
        while let Some(&id) = self.workers[w.0 as usize].waiting.get(i) {
            let a = &self.jobs[&id];
            // A decode-only worker preallocates room for no new transfer while a request it
            // retracted waits to come back (SGLang's decode loop returns before its prealloc
            // queue while its retracted queue is not empty).
            if decode_only
                && a.stage == Stage::WaitingD
                && self.workers[w.0 as usize]
                    .waiting
                    .iter()
                    .any(|j| self.jobs[j].stage == Stage::Retracted && self.jobs[j].decode_on == w)
            {
                i += 1;
                continue;
            }
            // Behind a request that does not fit, only a session whose own KV is on this
            // worker may go ahead: its admission replaces that KV.
            if blocked
                && !self.workers[w.0 as usize]
                    .residents
                    .contains_key(&a.job.session)
            {
                i += 1;
                continue;
            }
            // A job another (nested) admission already moved on — to its prefill worker's
            // queue, say, while an outer loop over this queue still holds it — leaves.
            let ok = match a.stage {
                Stage::WaitingPool if a.prefill_on == w => self.admit_prefill(id, w, now),
                Stage::WaitingD if a.decode_on == w => self.admit_transfer(id, now),
                Stage::Retracted if a.decode_on == w => self.admit_retracted(id, now),
                Stage::WaitingLocal if a.decode_on == w => self.admit_local(id, w, now),
                _ => true,
            };
            if ok {
                // By id: an admission may have retracted a job to the head of the queue.
                let queue = &mut self.workers[w.0 as usize].waiting;
                if let Some(pos) = queue.iter().position(|x| *x == id) {
                    queue.remove(pos);
                }
                i = 0;
                blocked = false;
            } else if decode {
                blocked = true;
                i += 1;
            } else {
                break;
            }
        }
    }

    /// Reserves prefill room for a waiting job on its prefill/colocated worker.
    pub(super) fn admit_prefill(&mut self, id: usize, w: WorkerId, now: Micros) -> bool {
        let a = &self.jobs[&id];
        let colocated = a.prefill_on == a.decode_on;
        if !colocated {
            // A worker prefilling a session it holds for another (`migrate-kv`): the
            // session's KV is the prefix this prefill reuses, and leaves with it.
            let session = a.job.session;
            self.resident_to_cache(w, session, now);
        }
        let a = &self.jobs[&id];
        let extra = if colocated { a.job.output } else { 0 };
        let hashes = a.job.hashes.clone();
        let input = a.job.input;
        let Some((matched, extra)) = self.reserve_cache(w, &hashes, extra, now) else {
            return false;
        };
        let cached = kvc_core::prefix::reusable_tokens(matched, input, self.opts.block_size);
        let a = self.jobs.get_mut(&id).expect("job");
        a.pinned = hashes.len();
        a.extra = extra;
        a.cached = cached;
        a.remaining = input - cached;
        a.done_ctx = cached;
        a.stage = Stage::Prefill;
        self.workers[w.0 as usize].prefill_q.push_back(id);
        self.start_iteration_if_idle(w, now);
        true
    }

    /// Reserves room on D for a prefilled job and starts its transfer.
    pub(super) fn admit_transfer(&mut self, id: usize, now: Micros) -> bool {
        let a = &self.jobs[&id];
        let (d, p, session) = (a.decode_on, a.prefill_on, a.job.session);
        let need = a.job.input;
        // The session's previous KV on D is replaced by the incoming one. It is released at
        // the first try, room or not: SGLang locks the matched prefix for a preallocation
        // and unlocks it when the room is not there.
        if self.workers[d.0 as usize]
            .residents
            .get(&session)
            .is_some_and(|r| !r.running)
        {
            self.drop_resident(d, session);
        }
        if !self.make_room_admit(d, need, (session, true), now, true) {
            return false;
        }
        let a = self.jobs.get_mut(&id).expect("job");
        a.stage = Stage::WaitingPool;
        let hashes = a.job.hashes.clone();
        let wk = &mut self.workers[d.0 as usize];
        wk.resident_tokens += need;
        wk.residents.insert(
            session,
            ResidentEntry {
                tokens: need,
                hashes,
                last_access: now,
                running: true,
                pending: false,
                prealloc: true,
            },
        );
        // The room is D's; now P may prefill. A worker that also hosts sessions may have no
        // room for the prefill (its pool can hold rooms it preallocated for transfers from
        // the very workers waiting on it): the request gives up after the transfer timeout
        // there, as it would waiting for D.
        if self.workers[p.0 as usize].hosts {
            let deadline = now + micros(self.profile.fit.transfer_timeout_s);
            self.jobs.get_mut(&id).expect("job").deadline = deadline;
            self.wakes.push((deadline, Wake::TransferTimeout(id)));
        }
        self.workers[p.0 as usize].waiting.push_back(id);
        self.retry_waiting(p, now);
        true
    }

    /// Starts the transfer of prefilled job `id` from P to D, into room D preallocated.
    /// One transfer at a time leaves a P and enters a D, in the order P finished them: a D
    /// with a queue of incoming transfers holds up the P that sends to it, and every transfer
    /// queued on that P behind it; P holds the job's KV until its transfer ends.
    /// A send over a (P, D) pair P holds for dead fails at once (`failed_pair_recovery_s`).
    pub(super) fn start_transfer(&mut self, id: usize, now: Micros) {
        let a = self.jobs.get_mut(&id).expect("job");
        a.stage = Stage::Transfer;
        let (p, d, input) = (a.prefill_on, a.decode_on, a.job.input);
        if self
            .failed_pairs
            .get(&(p, d))
            .is_some_and(|until| now < *until)
        {
            self.abort_p_to_d(id, false, FailureStage::FailedPair, now);
            return;
        }
        let secs = self.profile.transfer_seconds(input);
        let start = now
            .max(self.workers[p.0 as usize].link_free)
            .max(self.workers[d.0 as usize].link_free);
        let end = start + micros(secs);
        self.workers[p.0 as usize].link_free = end;
        self.workers[d.0 as usize].link_free = end;
        self.jobs.get_mut(&id).expect("job").transfer_end = end;
        self.wakes.push((end, Wake::TransferDone(id)));
    }

    /// With `pin_in_flight`, marks `session`'s idle KV on decode worker `d` busy: a request
    /// of the session is on its way to `d`, and its KV stays until the transfer replaces it.
    pub(super) fn pin_pending(&mut self, d: WorkerId, session: SessionId) {
        if !self.profile.fit.pressure.pin_in_flight {
            return;
        }
        let wk = &mut self.workers[d.0 as usize];
        if let Some(r) = wk.residents.get_mut(&session)
            && r.idle()
        {
            r.pending = true;
            wk.idle_tokens -= r.tokens;
        }
    }

    /// Re-admits a retracted job on its decode worker: room for its context and some output,
    /// then a prefill of the whole context (recompute), then decoding resumes. KV a
    /// decode-only worker backed up is loaded back from its host pool instead of recomputed
    /// (the copy's time is not modelled).
    pub(super) fn admit_retracted(&mut self, id: usize, now: Micros) -> bool {
        let a = &self.jobs[&id];
        let (d, session) = (a.decode_on, a.job.session);
        let context = a.job.input + a.generated;
        // A retracted job takes room back without retracting hot work in turn (which could
        // hand the same room back and forth).
        if !self.make_room_admit(d, context, (session, true), now, false) {
            return false;
        }
        let tokens = context;
        let a = self.jobs.get_mut(&id).expect("job");
        let backup = std::mem::take(&mut a.backup).min(context);
        a.stage = Stage::Prefill;
        a.prefill_on = d;
        a.remaining = context - backup;
        a.done_ctx = backup;
        let resume = a.remaining == 0 && a.generated > 0;
        if resume {
            a.stage = Stage::Decode;
        }
        let hashes = a.job.hashes.clone();
        let wk = &mut self.workers[d.0 as usize];
        wk.host_backup -= backup;
        wk.resident_tokens += tokens;
        wk.residents
            .insert(session, ResidentEntry::running(tokens, hashes, now));
        if resume {
            wk.running.push(id);
        } else {
            wk.prefill_q.push_back(id);
        }
        self.start_iteration_if_idle(d, now);
        true
    }
}
