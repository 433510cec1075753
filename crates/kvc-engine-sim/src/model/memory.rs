//! Memory: making room on a worker (eviction tiers, retraction, growth), the router's
//! commit-evict, and the prefix-cache reservations of prefills.

use super::engine::Engine;
use super::types::{Event, Failure, Micros, Wake, micros};
use super::worker::{Stage, Worker};
use kvc_admission::{Resident, ResidentState, plan_eviction};
use kvc_core::{FailureStage, SessionId, WorkerId};
use std::cmp::Reverse;

impl Engine {
    /// Frees room on decode worker `w` for `need` tokens by evicting sessions other than
    /// `requester`, with the configured planner. Returns whether `need` tokens are now free.
    pub(super) fn make_room_d(
        &mut self,
        w: WorkerId,
        need: u64,
        requester: Option<SessionId>,
        now: Micros,
    ) -> bool {
        self.make_room_tiers(w, need, requester, now, true)
    }

    /// [`Self::make_room_d`], with the hot tier of the eviction mode left out unless `hot`.
    pub(super) fn make_room_tiers(
        &mut self,
        w: WorkerId,
        need: u64,
        requester: Option<SessionId>,
        now: Micros,
        hot: bool,
    ) -> bool {
        let mut eviction = self.opts.eviction;
        eviction.allow_hot &= hot;
        let mut free = self.pool_free(w);
        if free >= need {
            return true;
        }
        // On a worker that also prefills for others, the prefix cache of that work goes
        // first: it is only a cache (pinned blocks, in use, stay).
        let block = self.block_tokens();
        let cache = &mut self.workers[w.0 as usize].cache;
        if cache.evictable() > 0 {
            cache.evict((need - free).div_ceil(block) as usize);
            free = self.pool_free(w);
            if free >= need {
                return true;
            }
        }
        let wk = &self.workers[w.0 as usize];
        // Evicting a running session retracts its request. A decode-only worker cannot
        // recompute it, so tiered eviction takes only the running sessions whose KV its host
        // pool has room to back up; the others' requests would be aborted.
        let host_free = self
            .profile
            .fit
            .pressure
            .retraction_host_pool_tokens
            .saturating_sub(wk.host_backup);
        let residents: Vec<Resident> = wk
            .residents
            .iter()
            .filter(|(_, r)| !r.prealloc)
            .filter(|(_, r)| wk.recomputes || !r.running || r.tokens <= host_free)
            .map(|(s, r)| Resident {
                session: *s,
                tokens: r.tokens,
                state: if r.idle() {
                    ResidentState::Idle
                } else {
                    ResidentState::Running
                },
                last_access_ms: r.last_access / 1000,
                predicted_next_use_ms: None,
            })
            .collect();
        let plan = plan_eviction(
            &residents,
            need,
            free,
            wk.capacity,
            requester,
            now / 1000,
            &eviction,
        );
        if !plan.satisfied {
            return false;
        }
        for v in plan.victims {
            self.evict(w, v.session, now);
        }
        self.pool_free(w) >= need
    }

    /// Tokens of worker `w`'s pool that nothing occupies: not its resident sessions, not its
    /// prefix cache, not the extra room its prefills reserved.
    pub(super) fn pool_free(&self, w: WorkerId) -> u64 {
        let wk = &self.workers[w.0 as usize];
        let cache = wk.cache.len() as u64 * self.block_tokens() + wk.cache_extra;
        wk.capacity.saturating_sub(wk.resident_tokens + cache)
    }

    /// Evicts `session`'s KV from decode worker `w`; a job holding it there is retracted.
    pub(super) fn evict(&mut self, w: WorkerId, session: SessionId, now: Micros) {
        let running = self.workers[w.0 as usize]
            .residents
            .get(&session)
            .is_some_and(|r| r.running);
        match self.job_holding(w, session).filter(|_| running) {
            Some(id) => self.retract(id, now),
            None => self.drop_resident(w, session),
        }
        self.events.push(Event::Evicted { session, worker: w });
    }

    /// The job whose KV `session` holds on decode worker `w` (transferring, append- or
    /// re-prefilling there, or decoding).
    pub(super) fn job_holding(&self, w: WorkerId, session: SessionId) -> Option<usize> {
        self.jobs
            .iter()
            .find(|(_, a)| {
                a.decode_on == w
                    && a.job.session == session
                    && match a.stage {
                        Stage::Transfer | Stage::Decode => true,
                        Stage::Prefill => a.prefill_on == w,
                        _ => false,
                    }
            })
            .map(|(id, _)| *id)
    }

    /// Removes `session`'s KV from decode worker `w`.
    pub(super) fn drop_resident(&mut self, w: WorkerId, session: SessionId) {
        let wk = &mut self.workers[w.0 as usize];
        if let Some(r) = wk.residents.remove(&session) {
            wk.resident_tokens -= r.tokens;
            if r.idle() {
                wk.idle_tokens -= r.tokens;
            }
        }
    }

    /// Frees room on decode worker `w` to admit a request that allocates `alloc` more tokens
    /// now (its context, or what its context adds to the session's KV there), the way SGLang's
    /// decode worker admits a transfer: only the context is allocated, and the pool must keep
    /// the profile's decode reserve free for this request and the worker's share (its token
    /// ratio) of it for every other request running there (a budget, not an allocation:
    /// output is allocated token by token as decoding goes on).
    /// An append (direct-to-D) is a prefill of D's own scheduler, which keeps the reserve
    /// for the request itself only (`others` false). Hot sessions are evicted only if `hot`.
    /// Returns whether the room is there.
    pub(super) fn make_room_admit(
        &mut self,
        w: WorkerId,
        alloc: u64,
        (requester, others): (SessionId, bool),
        now: Micros,
        hot: bool,
    ) -> bool {
        let need = self.admit_need(w, alloc, (requester, others));
        self.make_room_tiers(w, need, Some(requester), now, hot)
    }

    /// The free room [`Self::make_room_admit`] asks of worker `w` for a request that
    /// allocates `alloc` tokens now: `alloc` plus the decode reserve.
    pub(super) fn admit_need(
        &self,
        w: WorkerId,
        alloc: u64,
        (requester, others): (SessionId, bool),
    ) -> u64 {
        let wk = &self.workers[w.0 as usize];
        let running = if others {
            wk.residents
                .iter()
                .filter(|(s, r)| r.running && **s != requester)
                .count() as u64
        } else {
            0
        };
        // The request admitted keeps its whole reserve; the ones already active count for the
        // worker's current share of theirs (all of it with a ratio of 1).
        let reserve = self.profile.fit.pressure.decode_reserve_tokens;
        let share = (reserve as f64 * wk.token_ratio).ceil() as u64;
        let headroom = reserve + share.min(reserve) * running;
        // The request never needs room past the pool beside the KV it already holds there:
        // its output stops at the context limit, so its reserve is cut to what the pool has
        // left (a session whose context nearly fills the pool is admitted alone on it).
        let own = wk.residents.get(&requester).map_or(0, |r| r.tokens);
        (alloc + headroom).min(wk.capacity.saturating_sub(own).max(alloc))
    }

    /// Why job `id` fails now at `stage`, waiting on `worker` for `need` tokens of room:
    /// that worker's pool and queue as they are (call it before the job leaves them).
    pub(super) fn failure(
        &self,
        id: usize,
        stage: FailureStage,
        worker: WorkerId,
        need: u64,
        now: Micros,
    ) -> Failure {
        let wk = &self.workers[worker.0 as usize];
        let timeout = micros(self.profile.fit.transfer_timeout_s);
        let since = match stage {
            FailureStage::RetractionLimit | FailureStage::HostPoolFull => now,
            _ => self.jobs[&id].deadline.saturating_sub(timeout).min(now),
        };
        let queued = wk.waiting.len() + usize::from(!wk.waiting.contains(&id));
        Failure {
            stage,
            worker,
            need_tokens: need,
            free_tokens: self.pool_free(worker),
            evictable_tokens: wk.idle_tokens + wk.cache.evictable() as u64 * self.block_tokens(),
            queue_depth: u32::try_from(queued).unwrap_or(u32::MAX),
            since,
        }
    }

    /// Takes job `id`'s KV off its decode worker for want of room. The job waits at the head
    /// of the worker's queue: a transfer for room again; a prefilled or decoding job, on a
    /// worker that can prefill, to recompute its context — or it fails with `decode-oom` past
    /// the profile's retraction limit; on a decode-only worker, which cannot recompute, with
    /// its KV backed up to the worker's host pool — or, when the pool has no room for it, it
    /// fails with `decode-oom` at once (SGLang aborts a request whose KV it cannot back up).
    pub(super) fn retract(&mut self, id: usize, now: Micros) {
        let timeout = micros(self.profile.fit.transfer_timeout_s);
        let pressure = &self.profile.fit.pressure;
        let (limit, host_pool) = (
            pressure.max_retractions,
            pressure.retraction_host_pool_tokens,
        );
        let a = self.jobs.get_mut(&id).expect("job");
        let (d, session, stage) = (a.decode_on, a.job.session, a.stage);
        a.epoch += 1;
        a.retractions += 1;
        let wk = &self.workers[d.0 as usize];
        let recompute = stage == Stage::Transfer || wk.recomputes;
        // The KV a decode-only worker holds for the job: its context, or the part of an append
        // computed so far.
        let backup = match stage {
            _ if recompute => 0,
            Stage::Decode => a.job.input + a.generated,
            _ => a.done_ctx,
        };
        let fail = if recompute {
            a.retractions > limit
        } else {
            wk.host_backup + backup > host_pool
        };
        a.stage = if stage == Stage::Transfer {
            Stage::WaitingD
        } else {
            Stage::Retracted
        };
        a.deadline = now + timeout;
        if !fail {
            a.backup = backup;
        }
        let failure = fail.then(|| {
            let stage = if recompute {
                FailureStage::RetractionLimit
            } else {
                FailureStage::HostPoolFull
            };
            self.failure(id, stage, d, backup, now)
        });
        let wk = &mut self.workers[d.0 as usize];
        wk.running.retain(|x| *x != id);
        wk.prefill_q.retain(|x| *x != id);
        // The bet on running requests' output was lost: admission is cautious again.
        wk.token_ratio = self.profile.fit.pressure.init_new_token_ratio;
        self.drop_resident(d, session);
        if let Some(failure) = failure {
            let p = self.jobs[&id].prefill_on;
            self.release_prefill(id, now);
            self.jobs.remove(&id);
            self.events.push(Event::DecodeOom {
                id,
                at: now,
                failure,
            });
            if p != d {
                self.retry_waiting(p, now);
            }
            return;
        }
        let wk = &mut self.workers[d.0 as usize];
        wk.host_backup += backup;
        wk.waiting.push_front(id);
        self.wakes.push((now + timeout, Wake::TransferTimeout(id)));
        self.events.push(Event::Retracted { id, worker: d });
    }

    /// Gives running job `id` on decode worker `w` room for its next token, evicting by the
    /// configured mode and else retracting running jobs the way SGLang does (fewest tokens
    /// generated first, then the longest input). Returns whether the job keeps running.
    pub(super) fn grow(&mut self, w: WorkerId, id: usize, now: Micros) -> bool {
        loop {
            let a = &self.jobs[&id];
            let session = a.job.session;
            let full = (a.job.input + a.job.output).min(self.workers[w.0 as usize].capacity);
            let Some(allowed) = self.workers[w.0 as usize]
                .residents
                .get(&session)
                .map(|r| r.tokens)
            else {
                return true;
            };
            if Worker::step_fits(a, allowed, full) {
                return true;
            }
            // Room for the token this step writes (SGLang allocates decode KV token by token).
            let step = (a.job.input + a.generated + 1).min(full) - allowed;
            if self.make_room_d(w, step, Some(session), now) {
                let wk = &mut self.workers[w.0 as usize];
                wk.resident_tokens += step;
                if let Some(r) = wk.residents.get_mut(&session) {
                    r.tokens += step;
                }
                return true;
            }
            let victim = self.workers[w.0 as usize]
                .running
                .iter()
                .map(|v| (*v, &self.jobs[v]))
                .filter(|(_, v)| v.stage == Stage::Decode)
                .min_by_key(|(v, j)| (j.generated, Reverse(j.job.input), *v))
                .map(|(v, _)| v)
                .unwrap_or(id);
            self.retract(victim, now);
            if victim == id {
                return false;
            }
        }
    }

    /// A commit_evict asked of decode worker `w`: frees room for `need` tokens by evicting
    /// sessions other than `requester` (reported as [`Event::Evicted`]). Returns whether the
    /// room is there now, the tokens freed and the sessions evicted.
    pub fn commit_evict(
        &mut self,
        w: WorkerId,
        need: u64,
        requester: Option<SessionId>,
        now: Micros,
    ) -> (bool, u64, Vec<SessionId>) {
        if !self.workers[w.0 as usize].hosts {
            return (false, 0, Vec::new());
        }
        let before: Vec<SessionId> = self.workers[w.0 as usize]
            .residents
            .keys()
            .copied()
            .collect();
        let used_before = self.workers[w.0 as usize].resident_tokens;
        let ok = self.make_room_d(w, need, requester, now);
        let wk = &self.workers[w.0 as usize];
        let evicted: Vec<SessionId> = before
            .into_iter()
            .filter(|s| !wk.residents.contains_key(s))
            .collect();
        let freed = used_before - wk.resident_tokens;
        if freed > 0 {
            self.retry_waiting(w, now);
        }
        (ok, freed, evicted)
    }

    /// Drops `session`'s resident KV on `w` if any (the router moved it elsewhere).
    pub fn release_session(&mut self, w: WorkerId, session: SessionId, now: Micros) {
        let running = self.workers[w.0 as usize]
            .residents
            .get(&session)
            .is_some_and(|r| r.running);
        if !running {
            self.drop_resident(w, session);
            self.retry_waiting(w, now);
        }
    }

    /// Turns `session`'s idle KV on `w` into prefix cache of its blocks (none if the session
    /// is not resident there or a request of it runs there): the worker no longer hosts the
    /// session, and a prefill there reuses those blocks.
    pub(super) fn resident_to_cache(&mut self, w: WorkerId, session: SessionId, now: Micros) {
        let wk = &self.workers[w.0 as usize];
        let Some(hashes) = wk
            .residents
            .get(&session)
            .filter(|r| !r.running)
            .map(|r| r.hashes.clone())
        else {
            return;
        };
        self.drop_resident(w, session);
        // The same blocks, now as cache: no room freed for the waiting jobs (and none woken:
        // the caller is admitting one of them).
        let cache = &mut self.workers[w.0 as usize].cache;
        cache.pin(&hashes, now);
        cache.unpin(&hashes, now);
    }

    /// Reserves pool room on a prefill/colocated worker for a job's blocks (+ `extra` tokens,
    /// cut to what the pool can hold). Returns `Some((reused blocks, extra reserved))`: the
    /// leading blocks held in the prefix cache or, on a worker that hosts sessions, in a
    /// resident session's KV.
    pub(super) fn reserve_cache(
        &mut self,
        w: WorkerId,
        hashes: &[kvc_core::BlockHash],
        extra: u64,
        now: Micros,
    ) -> Option<(usize, u64)> {
        let block = self.block_tokens();
        let free = self.pool_free(w);
        let wk = &mut self.workers[w.0 as usize];
        let matched = wk.cache.match_len(hashes);
        let new_blocks = (hashes.len() - matched) as u64;
        // Output past the pool is cut (the context limit); blocks of an accepted input always fit.
        let extra = extra.min(wk.capacity.saturating_sub(hashes.len() as u64 * block));
        let need = new_blocks * block + extra;
        if free < need && wk.hosts {
            // A worker that hosts sessions prefills for another: its cache goes first, then
            // its sessions by the eviction mode (never hot ones: this work is not theirs).
            wk.cache.pin(&hashes[..matched], now);
            let room = self.make_room_tiers(w, need, None, now, false);
            self.workers[w.0 as usize]
                .cache
                .unpin(&hashes[..matched], now);
            if !room {
                return None;
            }
        } else if free < need {
            // Pin the matched prefix first so eviction cannot take it, then evict.
            let short = need - free;
            let evictable = wk.cache.evictable() as u64 * block;
            // The matched blocks are about to be pinned; they cannot count as evictable.
            let matched_unpinned = hashes[..matched].len() as u64 * block;
            if evictable.saturating_sub(matched_unpinned) < short {
                return None;
            }
            wk.cache.pin(&hashes[..matched], now);
            wk.cache.evict(short.div_ceil(block) as usize);
            wk.cache.unpin(&hashes[..matched], now);
        }
        let wk = &mut self.workers[w.0 as usize];
        wk.cache.pin(hashes, now);
        wk.cache_extra += extra;
        // A worker that hosts sessions also reuses their KV (one prefix cache in the engine);
        // the blocks it pins for this prefill are counted besides them.
        let reused = wk
            .residents
            .values()
            .map(|r| kvc_core::prefix::shared_prefix_blocks(&r.hashes, hashes))
            .fold(matched, usize::max);
        Some((reused, extra))
    }
}
