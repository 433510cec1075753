//! The engine model: prefill, decode and colocated workers with KV pools, prefix caches,
//! resident sessions, continuous batching, append-prefill and KV transfers.
//!
//! The model is clock-agnostic: it is driven by calls that carry the current time in
//! microseconds and returns the next time it wants to be woken (iteration ends, transfer
//! completions, timeouts) as [`Wake`] values, so the same code runs under the simulator's
//! virtual clock and under a real clock.

use super::cache::PrefixCache;
use super::profile::Profile;
use kvc_admission::{EvictionConfig, Resident, ResidentState, plan_eviction};
use kvc_core::HashIds;
use kvc_core::{BlockSize, Capabilities, Health, SessionId, WorkerId, WorkerRole, WorkerState};
use std::cmp::Reverse;
use std::collections::{BTreeMap, VecDeque};

/// Microseconds of simulated (or real) time.
pub type Micros = u64;

/// Converts seconds to whole microseconds.
pub fn micros(seconds: f64) -> Micros {
    if seconds <= 0.0 {
        0
    } else {
        (seconds * 1e6).round() as Micros
    }
}

/// A request as the engine sees it.
#[derive(Debug, Clone)]
pub struct Job {
    /// Caller's handle (the trace index).
    pub id: usize,
    /// Session.
    pub session: SessionId,
    /// Prompt tokens.
    pub input: u64,
    /// Tokens to generate (at least 1 is produced).
    pub output: u64,
    /// Block ids of the prompt.
    pub hashes: HashIds,
}

/// Something the engine asks its driver to do at a time. Ordered (variant, then worker or job)
/// so drivers can keep wake-ups in a deterministic queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Wake {
    /// The iteration running on a worker ends.
    IterationEnd(WorkerId),
    /// The transfer of a job's KV into its decode worker finishes.
    TransferDone(usize),
    /// A job waiting for room on a decode worker gives up.
    TransferTimeout(usize),
}

/// What happened to a job, reported to the driver.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The first output token of a job reached the client.
    FirstToken {
        /// Job.
        id: usize,
        /// When.
        at: Micros,
    },
    /// A job finished.
    Done {
        /// Job.
        id: usize,
        /// When.
        at: Micros,
        /// Resident tokens of its session left on its decode worker (0 if none).
        resident_tokens: u64,
        /// Prompt tokens served from a cache.
        cached: u64,
    },
    /// A job's KV transfer timed out waiting for room on D.
    TransferTimedOut {
        /// Job.
        id: usize,
        /// When.
        at: Micros,
    },
    /// A request failed for want of KV room on its decode worker: retracted more often than
    /// the profile allows, retracted on a decode-only worker whose host pool had no room for
    /// its KV, or left waiting past the transfer timeout after a retraction.
    DecodeOom {
        /// Job.
        id: usize,
        /// When.
        at: Micros,
    },
    /// A running request's KV was freed for want of room; it waits on its decode worker and
    /// recomputes its context when room returns.
    Retracted {
        /// Job.
        id: usize,
        /// The decode worker.
        worker: WorkerId,
    },
    /// A decode worker evicted a session's KV.
    Evicted {
        /// Session.
        session: SessionId,
        /// Worker.
        worker: WorkerId,
    },
}

#[derive(Debug, Clone)]
struct ResidentEntry {
    tokens: u64,
    hashes: HashIds,
    last_access: Micros,
    /// A job of the session holds this KV on the worker (transfer, prefill or decode).
    running: bool,
    /// A request of the session is in flight elsewhere (on P, in the transfer queue):
    /// `pin_in_flight` keeps the KV out of idle-only eviction meanwhile.
    pending: bool,
    /// Room preallocated for a transfer that has not arrived yet (the request is queued or
    /// prefilling on P, or on the wire): no eviction tier can take it back.
    prealloc: bool,
}

impl ResidentEntry {
    /// `tokens` of a session (block ids `hashes`) that a job of it holds from `now` on.
    fn running(tokens: u64, hashes: HashIds, now: Micros) -> Self {
        ResidentEntry {
            tokens,
            hashes,
            last_access: now,
            running: true,
            pending: false,
            prealloc: false,
        }
    }

    /// Evictable by idle-only eviction.
    fn idle(&self) -> bool {
        !self.running && !self.pending
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Waiting for pool room on its prefill or colocated worker.
    WaitingPool,
    /// In a prefill queue.
    Prefill,
    /// Prefilled on P, waiting for room on D.
    WaitingD,
    /// KV on its way to D.
    Transfer,
    /// Decoding.
    Decode,
    /// Retracted from a decode worker for want of room: waits there to recompute its context.
    Retracted,
    /// A turn its worker serves alone, waiting in that worker's queue for room (behind the
    /// transfers and turns that came first).
    WaitingLocal,
}

#[derive(Debug, Clone)]
struct Active {
    job: Job,
    /// Prefill worker (P→D path) or the worker that prefills (D for direct, DP).
    prefill_on: WorkerId,
    decode_on: WorkerId,
    stage: Stage,
    remaining: u64,
    done_ctx: u64,
    generated: u64,
    /// Blocks pinned on the prefill/colocated worker's cache.
    pinned: usize,
    /// Extra (non-block) tokens reserved on the prefill/colocated worker.
    extra: u64,
    cached: u64,
    /// When waiting for room on D (transfer or retracted) fails.
    deadline: Micros,
    /// When the KV transfer in progress ends.
    transfer_end: Micros,
    /// Times retracted.
    retractions: u32,
    /// Bumped by every retraction, so the work of an iteration that started before it is
    /// not applied after it.
    epoch: u32,
    /// Tokens of its KV a decode-only worker copied to its host pool when it retracted the
    /// job; loaded back, not recomputed, when the job is readmitted.
    backup: u64,
}

impl Active {
    /// A job at `stage`, prefilling on `prefill_on` and decoding on `decode_on`, with nothing
    /// done, reserved or pending yet.
    fn new(job: Job, prefill_on: WorkerId, decode_on: WorkerId, stage: Stage) -> Self {
        Active {
            job,
            prefill_on,
            decode_on,
            stage,
            remaining: 0,
            done_ctx: 0,
            generated: 0,
            pinned: 0,
            extra: 0,
            cached: 0,
            deadline: 0,
            transfer_end: 0,
            retractions: 0,
            epoch: 0,
            backup: 0,
        }
    }
}

/// What one running iteration of a worker carries.
#[derive(Debug)]
struct Iteration {
    /// Prefill chunks: (job, tokens, job epoch).
    prefill: Vec<(usize, u64, u32)>,
    /// Jobs that get one decode step: (job, job epoch).
    decode: Vec<(usize, u32)>,
}

#[derive(Debug)]
struct Worker {
    /// Sessions stay resident here between turns (a decode worker, or a worker that serves
    /// turns alone); its pool holds them beside the prefix cache of the prefills it runs for
    /// other workers.
    hosts: bool,
    capacity: u64,
    cache: PrefixCache,
    cache_extra: u64,
    residents: BTreeMap<SessionId, ResidentEntry>,
    resident_tokens: u64,
    idle_tokens: u64,
    prefill_q: VecDeque<usize>,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    iteration: Option<Iteration>,
    /// Set while an iteration's results are applied: no new iteration starts before that ends.
    settling: bool,
    link_free: Micros,
    /// Share of the decode reserve counted for each request already active here when another
    /// is admitted (SGLang's `new_token_ratio`): decays per decode step, reset by a retraction.
    token_ratio: f64,
    /// The worker can prefill (for others, or a turn alone), so it recomputes a retracted
    /// request's context; a decode-only worker backs the KV up to its host pool instead.
    recomputes: bool,
    /// Tokens of retracted requests' KV held in the host pool of a decode-only worker.
    host_backup: u64,
}

/// Engine-side eviction behaviour of decode workers.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOptions {
    /// Eviction planner settings (tiers allowed, victim order).
    pub eviction: EvictionConfig,
    /// Tokens per block.
    pub block_size: BlockSize,
}

/// The modelled cluster.
#[derive(Debug)]
pub struct Engine {
    profile: Profile,
    opts: EngineOptions,
    workers: Vec<Worker>,
    jobs: BTreeMap<usize, Active>,
    /// (P, D) pairs whose transfer session P holds for dead, until when.
    failed_pairs: BTreeMap<(WorkerId, WorkerId), Micros>,
    events: Vec<Event>,
    wakes: Vec<(Micros, Wake)>,
    jitter_state: u64,
    jitter: f64,
}

/// Admission answer for a direct-to-D request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectAdmission {
    /// Admitted; the job append-prefills `cached` tokens short of its input.
    Admitted {
        /// Tokens reused from the resident KV.
        cached: u64,
    },
    /// The session is not resident on that worker.
    NotResident,
    /// No room for the estimated need.
    Rejected,
}

/// Admission answer for a turn a worker serves alone ([`Engine::try_local`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalAdmission {
    /// Admitted: the job prefills the prompt but `cached` tokens.
    Started {
        /// Tokens reused from KV the worker holds.
        cached: u64,
    },
    /// Queued in the worker's queue, in order, until the worker has room for it.
    Queued,
    /// Refused: the session is resident there and its append is refused as a direct-to-D
    /// one is, or the prompt does not fit the pool at all.
    Rejected,
}

impl Engine {
    /// A cluster of `roles.len()` workers (ids are indices), each with the profile's KV pool
    /// and the capabilities of its role ([`Capabilities::of_role`]).
    /// `jitter` (fraction, e.g. 0.03) perturbs iteration times deterministically from `seed`.
    pub fn new(
        profile: Profile,
        opts: EngineOptions,
        roles: &[WorkerRole],
        seed: u64,
        jitter: f64,
    ) -> Self {
        let layout: Vec<(WorkerRole, Capabilities)> = roles
            .iter()
            .map(|r| (*r, Capabilities::of_role(*r)))
            .collect();
        Self::with_layout(profile, opts, &layout, seed, jitter)
    }

    /// A cluster of workers with declared capabilities (ids are indices; see
    /// [`kvc_core::Topology::layout`]). A worker that hosts sessions
    /// ([`Capabilities::hosts_sessions`], colocated workers aside) keeps them resident as a
    /// decode worker does; one that also prefills for others keeps the prefix cache of that
    /// work in the same pool.
    pub fn with_layout(
        profile: Profile,
        opts: EngineOptions,
        layout: &[(WorkerRole, Capabilities)],
        seed: u64,
        jitter: f64,
    ) -> Self {
        let capacity = profile.hardware.kv_pool_tokens;
        let workers = layout
            .iter()
            .map(|(role, caps)| Worker {
                hosts: *role != WorkerRole::Colocated && caps.hosts_sessions(),
                capacity,
                cache: PrefixCache::default(),
                cache_extra: 0,
                residents: BTreeMap::new(),
                resident_tokens: 0,
                idle_tokens: 0,
                prefill_q: VecDeque::new(),
                waiting: VecDeque::new(),
                running: Vec::new(),
                iteration: None,
                settling: false,
                link_free: 0,
                token_ratio: profile.fit.pressure.init_new_token_ratio,
                recomputes: caps.prefill || caps.local,
                host_backup: 0,
            })
            .collect();
        Engine {
            profile,
            opts,
            workers,
            jobs: BTreeMap::new(),
            failed_pairs: BTreeMap::new(),
            events: Vec::new(),
            wakes: Vec::new(),
            jitter_state: seed ^ 0x9e37_79b9_7f4a_7c15,
            jitter,
        }
    }

    /// The profile in use.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Takes the events produced since the last call.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// Takes the wake-ups requested since the last call.
    pub fn take_wakes(&mut self) -> Vec<(Micros, Wake)> {
        std::mem::take(&mut self.wakes)
    }

    /// Tokens in one block.
    fn block_tokens(&self) -> u64 {
        u64::from(self.opts.block_size.tokens())
    }

    /// The state a router sees of worker `w`.
    pub fn state(&self, w: WorkerId) -> WorkerState {
        let wk = &self.workers[w.0 as usize];
        let block = self.block_tokens();
        // One pool: resident sessions (workers that host them) and the prefix cache of the
        // prefills a worker runs (for others, or for itself when colocated).
        let used = wk.resident_tokens + wk.cache.len() as u64 * block + wk.cache_extra;
        let evictable = wk.idle_tokens + wk.cache.evictable() as u64 * block;
        WorkerState {
            capacity_tokens: wk.capacity,
            used_tokens: used,
            evictable_tokens: evictable,
            queue_depth: (wk.prefill_q.len() + wk.waiting.len()) as u32,
            in_flight: (wk.running.len() + wk.prefill_q.len()) as u32,
            resident_sessions: wk.residents.len() as u32,
            health: Health::Healthy,
            state_age_ms: 0,
        }
    }

    /// Tokens of `session` resident on decode worker `w`.
    pub fn resident_tokens(&self, w: WorkerId, session: SessionId) -> Option<u64> {
        self.workers[w.0 as usize]
            .residents
            .get(&session)
            .map(|r| r.tokens)
    }

    /// Sessions resident on worker `w`: (session, tokens, last access, busy), by session id;
    /// busy sessions (a job running there, or with `pin_in_flight` a request in flight) are
    /// not idle.
    pub fn residents(&self, w: WorkerId) -> Vec<(SessionId, u64, Micros, bool)> {
        self.workers[w.0 as usize]
            .residents
            .iter()
            .map(|(s, r)| (*s, r.tokens, r.last_access, !r.idle()))
            .collect()
    }

    /// Sessions resident on worker `w` with their tokens and the block ids of the prompt whose
    /// KV they hold, by session id.
    pub fn resident_blocks(&self, w: WorkerId) -> Vec<(SessionId, u64, HashIds)> {
        self.workers[w.0 as usize]
            .residents
            .iter()
            .map(|(s, r)| (*s, r.tokens, r.hashes.clone()))
            .collect()
    }

    /// Number of workers.
    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// Used fraction of every worker's pool, by worker index.
    pub fn occupancy(&self) -> Vec<f64> {
        (0..self.workers.len())
            .map(|i| self.state(WorkerId(i as u32)).used_fraction())
            .collect()
    }

    /// Committed fraction of every worker's pool (what eviction cannot reclaim), by index.
    pub fn committed(&self) -> Vec<f64> {
        (0..self.workers.len())
            .map(|i| self.state(WorkerId(i as u32)).committed_fraction())
            .collect()
    }

    fn jittered(&mut self, seconds: f64) -> Micros {
        if self.jitter <= 0.0 {
            return micros(seconds);
        }
        // splitmix64 step → uniform in [-1, 1).
        self.jitter_state = self.jitter_state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.jitter_state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let u = (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
        micros(seconds * (1.0 + self.jitter * u))
    }

    // ----- memory -------------------------------------------------------------------------

    /// Frees room on decode worker `w` for `need` tokens by evicting sessions other than
    /// `requester`, with the configured planner. Returns whether `need` tokens are now free.
    fn make_room_d(
        &mut self,
        w: WorkerId,
        need: u64,
        requester: Option<SessionId>,
        now: Micros,
    ) -> bool {
        self.make_room_tiers(w, need, requester, now, true)
    }

    /// [`Self::make_room_d`], with the hot tier of the eviction mode left out unless `hot`.
    fn make_room_tiers(
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
    fn pool_free(&self, w: WorkerId) -> u64 {
        let wk = &self.workers[w.0 as usize];
        let cache = wk.cache.len() as u64 * self.block_tokens() + wk.cache_extra;
        wk.capacity.saturating_sub(wk.resident_tokens + cache)
    }

    /// Evicts `session`'s KV from decode worker `w`; a job holding it there is retracted.
    fn evict(&mut self, w: WorkerId, session: SessionId, now: Micros) {
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
    fn job_holding(&self, w: WorkerId, session: SessionId) -> Option<usize> {
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
    fn drop_resident(&mut self, w: WorkerId, session: SessionId) {
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
    fn make_room_admit(
        &mut self,
        w: WorkerId,
        alloc: u64,
        (requester, others): (SessionId, bool),
        now: Micros,
        hot: bool,
    ) -> bool {
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
        let need = (alloc + headroom).min(wk.capacity);
        self.make_room_tiers(w, need, Some(requester), now, hot)
    }

    /// Takes job `id`'s KV off its decode worker for want of room. The job waits at the head
    /// of the worker's queue: a transfer for room again; a prefilled or decoding job, on a
    /// worker that can prefill, to recompute its context — or it fails with `decode-oom` past
    /// the profile's retraction limit; on a decode-only worker, which cannot recompute, with
    /// its KV backed up to the worker's host pool — or, when the pool has no room for it, it
    /// fails with `decode-oom` at once (SGLang aborts a request whose KV it cannot back up).
    fn retract(&mut self, id: usize, now: Micros) {
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
        let wk = &mut self.workers[d.0 as usize];
        wk.running.retain(|x| *x != id);
        wk.prefill_q.retain(|x| *x != id);
        // The bet on running requests' output was lost: admission is cautious again.
        wk.token_ratio = self.profile.fit.pressure.init_new_token_ratio;
        self.drop_resident(d, session);
        if fail {
            let p = self.jobs[&id].prefill_on;
            self.release_prefill(id, now);
            self.jobs.remove(&id);
            self.events.push(Event::DecodeOom { id, at: now });
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
    fn grow(&mut self, w: WorkerId, id: usize, now: Micros) -> bool {
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
            if a.job.input + a.generated < allowed || allowed >= full {
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

    /// Reserves pool room on a prefill/colocated worker for a job's blocks (+ `extra` tokens,
    /// cut to what the pool can hold). Returns `Some((reused blocks, extra reserved))`: the
    /// leading blocks held in the prefix cache or, on a worker that hosts sessions, in a
    /// resident session's KV.
    fn reserve_cache(
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

    // ----- admission of jobs ---------------------------------------------------------------

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
    fn admit_local(&mut self, id: usize, w: WorkerId, now: Micros) -> bool {
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
    fn retry_waiting(&mut self, w: WorkerId, now: Micros) {
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
    fn admit_prefill(&mut self, id: usize, w: WorkerId, now: Micros) -> bool {
        let a = &self.jobs[&id];
        let colocated = a.prefill_on == a.decode_on;
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
    fn admit_transfer(&mut self, id: usize, now: Micros) -> bool {
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
    fn start_transfer(&mut self, id: usize, now: Micros) {
        let a = self.jobs.get_mut(&id).expect("job");
        a.stage = Stage::Transfer;
        let (p, d, input) = (a.prefill_on, a.decode_on, a.job.input);
        if self
            .failed_pairs
            .get(&(p, d))
            .is_some_and(|until| now < *until)
        {
            self.abort_p_to_d(id, false, now);
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
    fn pin_pending(&mut self, d: WorkerId, session: SessionId) {
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
    fn admit_retracted(&mut self, id: usize, now: Micros) -> bool {
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

    /// Starts an iteration on `w` if it is idle and has work.
    fn start_iteration_if_idle(&mut self, w: WorkerId, now: Micros) {
        let wk = &self.workers[w.0 as usize];
        if wk.iteration.is_some() || wk.settling {
            return;
        }
        let mut budget = self.profile.fit.chunk_tokens;
        let mut pieces: Vec<(usize, u64, u32)> = Vec::new();
        let mut cost_pieces: Vec<(u64, u64)> = Vec::new();
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
        // Without mixed batches (SGLang's default), a waiting prefill runs alone and the decode
        // batch resumes after it; with them, one iteration carries both.
        let decode: Vec<(usize, u32)> = if pieces.is_empty() || self.profile.fit.mixed_batches {
            wk.running
                .iter()
                .map(|id| (*id, self.jobs[id].epoch))
                .collect()
        } else {
            Vec::new()
        };
        if pieces.is_empty() && decode.is_empty() {
            return;
        }
        let mut secs = 0.0;
        if !pieces.is_empty() {
            secs += self.profile.prefill_seconds(cost_pieces);
        }
        if !decode.is_empty() {
            let ctx: u64 = decode
                .iter()
                .map(|(id, _)| {
                    let a = &self.jobs[id];
                    a.job.input + a.generated
                })
                .sum();
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

    fn end_iteration(&mut self, w: WorkerId, now: Micros) {
        let Some(Iteration {
            prefill: pieces,
            decode,
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
        for (id, take, epoch) in pieces {
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
        for (id, epoch) in decode {
            if !self
                .jobs
                .get(&id)
                .is_some_and(|a| a.epoch == epoch && a.stage == Stage::Decode)
            {
                continue;
            }
            if hosts && !self.grow(w, id, now) {
                continue;
            }
            let a = self.jobs.get_mut(&id).expect("job");
            a.generated += 1;
            if a.generated >= a.job.output {
                self.finish(id, now);
            }
        }
        self.workers[w.0 as usize].settling = false;
        self.start_iteration_if_idle(w, now);
    }

    fn first_token(&mut self, id: usize, decode_on: WorkerId, now: Micros) {
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

    fn transfer_done(&mut self, id: usize, now: Micros) {
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
    fn abort_p_to_d(&mut self, id: usize, sending: bool, now: Micros) {
        let a = &self.jobs[&id];
        let (p, d, session) = (a.prefill_on, a.decode_on, a.job.session);
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
        self.events.push(Event::TransferTimedOut { id, at: now });
        self.retry_waiting(p, now);
        self.retry_waiting(d, now);
    }

    fn transfer_timeout(&mut self, id: usize, now: Micros) {
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
            self.abort_p_to_d(id, sending, now);
            return;
        }
        if a.stage == Stage::Retracted {
            // Retracted and never given room back: out of memory as far as the client knows.
            let (d, backup) = (a.decode_on, a.backup);
            let wk = &mut self.workers[d.0 as usize];
            wk.waiting.retain(|x| *x != id);
            wk.host_backup -= backup;
            self.jobs.remove(&id);
            self.events.push(Event::DecodeOom { id, at: now });
            self.retry_waiting(d, now);
            return;
        }
        let (p, d, session) = (a.prefill_on, a.decode_on, a.job.session);
        if a.stage == Stage::WaitingPool && p != d && self.workers[p.0 as usize].hosts {
            // Waiting for prefill room on a worker that hosts sessions: D's room goes back.
            self.workers[p.0 as usize].waiting.retain(|x| *x != id);
            self.drop_resident(d, session);
            self.jobs.remove(&id);
            self.events.push(Event::TransferTimedOut { id, at: now });
            self.retry_waiting(p, now);
            self.retry_waiting(d, now);
            return;
        }
        if a.stage != Stage::WaitingD {
            return;
        }
        self.workers[d.0 as usize].waiting.retain(|x| *x != id);
        self.release_prefill(id, now);
        // The session's old KV on D (if any) is no longer trusted.
        self.release_session(d, session, now);
        self.jobs.remove(&id);
        self.events.push(Event::TransferTimedOut { id, at: now });
        self.retry_waiting(p, now);
        self.retry_waiting(d, now);
    }

    /// Unpins a job's blocks and extra tokens on its prefill/colocated worker.
    fn release_prefill(&mut self, id: usize, now: Micros) {
        let a = self.jobs.get_mut(&id).expect("job");
        let (w, n, extra) = (a.prefill_on, a.pinned, a.extra);
        let hashes = a.job.hashes.clone();
        a.pinned = 0;
        a.extra = 0;
        let wk = &mut self.workers[w.0 as usize];
        wk.cache.unpin(&hashes[..n], now);
        wk.cache_extra -= extra;
    }

    fn finish(&mut self, id: usize, now: Micros) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvc_admission::EvictionConfig;
    use kvc_core::BlockHash;

    /// Wakes `e` in time order until job `id` has its first token (the events before it are
    /// dropped); `now` ends at that wake-up.
    fn run_to_first_token(e: &mut Engine, id: usize, now: &mut Micros) {
        loop {
            let ev = e.take_events();
            if ev
                .iter()
                .any(|x| matches!(x, Event::FirstToken { id: i, .. } if *i == id))
            {
                return;
            }
            let mut wakes = e.take_wakes();
            wakes.sort_by_key(|(t, _)| *t);
            let (t, w) = wakes.remove(0);
            e.wakes.extend(wakes);
            *now = t;
            e.wake(w, *now);
        }
    }

    fn engine(roles: &[WorkerRole], pool: u64, timeout_s: f64) -> Engine {
        engine_with(roles, pool, |p| p.fit.transfer_timeout_s = timeout_s)
    }

    /// An idle-only-eviction engine with pool `pool` and the profile adjusted by `adjust`.
    fn engine_with(roles: &[WorkerRole], pool: u64, adjust: impl FnOnce(&mut Profile)) -> Engine {
        let mut profile = Profile::default();
        profile.hardware.kv_pool_tokens = pool;
        profile.model.max_input_tokens = pool / 2;
        adjust(&mut profile);
        let eviction = EvictionConfig {
            allow_cold: false,
            allow_hot: false,
            ..EvictionConfig::default()
        };
        Engine::new(
            profile,
            EngineOptions {
                eviction,
                block_size: BlockSize::default(),
            },
            roles,
            1,
            0.0,
        )
    }

    fn job(id: usize, session: u64, blocks: &[u64], input: u64, output: u64) -> Job {
        Job {
            id,
            session: SessionId(session),
            input,
            output,
            hashes: blocks
                .iter()
                .copied()
                .map(BlockHash)
                .collect::<Vec<_>>()
                .into(),
        }
    }

    /// Runs the engine until it has nothing scheduled; returns the events.
    fn settle(e: &mut Engine, now: &mut Micros) -> Vec<Event> {
        let mut events = e.take_events();
        let mut wakes = e.take_wakes();
        while !wakes.is_empty() {
            wakes.sort_by_key(|(t, _)| *t);
            let (t, w) = wakes.remove(0);
            *now = (*now).max(t);
            e.wake(w, *now);
            events.extend(e.take_events());
            wakes.extend(e.take_wakes());
        }
        events
    }

    const P: WorkerId = WorkerId(0);
    const D: WorkerId = WorkerId(1);

    #[test]
    fn p_to_d_turn_leaves_the_session_resident_and_direct_reuses_it() {
        let mut e = engine(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, 32.0);
        let mut now = 0;
        e.start_p_to_d(job(1, 7, &[1, 2, 3], 1500, 4), P, D, now);
        let ev = settle(&mut e, &mut now);
        let first = ev
            .iter()
            .position(|x| matches!(x, Event::FirstToken { id: 1, .. }))
            .expect("first token");
        let done = ev
            .iter()
            .position(|x| matches!(x, Event::Done { id: 1, .. }))
            .expect("done");
        assert!(first < done);
        assert!(matches!(
            ev[done],
            Event::Done {
                resident_tokens: 1504,
                cached: 0,
                ..
            }
        ));
        assert_eq!(e.resident_tokens(D, SessionId(7)), Some(1504));
        let s = e.state(D);
        assert_eq!(
            (s.used_tokens, s.evictable_tokens, s.resident_sessions),
            (1504, 1504, 1)
        );
        // The next turn extends the prompt: two full blocks are reused on D.
        let adm = e.try_direct(job(2, 7, &[1, 2, 4, 5], 1900, 3), D, 403, now);
        assert_eq!(adm, DirectAdmission::Admitted { cached: 1024 });
        assert_eq!(
            e.state(D).evictable_tokens,
            0,
            "a running session is not evictable"
        );
        let ev = settle(&mut e, &mut now);
        assert!(ev.iter().any(|x| matches!(
            x,
            Event::Done {
                id: 2,
                resident_tokens: 1903,
                cached: 1024,
                ..
            }
        )));
        // A session that is not on D cannot go direct.
        assert_eq!(
            e.try_direct(job(3, 8, &[9], 100, 1), D, 10, now),
            DirectAdmission::NotResident
        );
    }

    #[test]
    fn a_reseed_releases_the_session_on_the_other_decode_workers() {
        let d2 = WorkerId(2);
        let roles = [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Decode];
        let mut e = engine(&roles, 8192, 32.0);
        let mut now = 0;
        e.reseed(job(1, 7, &[1, 2, 3], 1500, 4), P, D, now);
        settle(&mut e, &mut now);
        e.reseed(job(2, 8, &[9], 100, 1), P, d2, now);
        settle(&mut e, &mut now);
        assert_eq!(e.resident_tokens(D, SessionId(7)), Some(1504));
        // A one-token answer writes no KV past its prompt.
        assert_eq!(e.resident_tokens(d2, SessionId(8)), Some(100));
        // Session 7 moves to d2: D holds it no more; session 8 stays where it is.
        e.reseed(job(3, 7, &[1, 2, 3, 4], 2000, 4), P, d2, now);
        assert_eq!(e.resident_tokens(D, SessionId(7)), None);
        assert_eq!(e.state(D).used_tokens, 0);
        settle(&mut e, &mut now);
        assert_eq!(e.resident_tokens(d2, SessionId(7)), Some(2004));
        assert_eq!(e.resident_tokens(d2, SessionId(8)), Some(100));
    }

    #[test]
    fn direct_admission_rejects_an_estimate_over_the_room() {
        let mut e = engine(&[WorkerRole::Prefill, WorkerRole::Decode], 4096, 32.0);
        let mut now = 0;
        e.start_p_to_d(job(1, 1, &[1, 2, 3, 4], 2000, 10), P, D, now);
        settle(&mut e, &mut now);
        // 2,010 used, 2,086 free; the session's own idle tokens do not count as room for it.
        // (The fourth block was partial; grown into a full block it has a new id.)
        assert_eq!(
            e.try_direct(job(2, 1, &[1, 2, 3, 6, 5], 2100, 10), D, 2_087, now),
            DirectAdmission::Rejected
        );
        assert_eq!(
            e.try_direct(job(2, 1, &[1, 2, 3, 6, 5], 2100, 10), D, 2_086, now),
            DirectAdmission::Admitted { cached: 1536 }
        );
    }

    #[test]
    fn idle_sessions_are_evicted_for_a_transfer_and_reported() {
        let mut e = engine(&[WorkerRole::Prefill, WorkerRole::Decode], 4096, 32.0);
        let mut now = 0;
        e.start_p_to_d(job(1, 1, &[1, 2, 3, 4], 2000, 10), P, D, now);
        settle(&mut e, &mut now);
        // 2,010 tokens resident, 2,086 free: a 2,510-token arrival needs the idle session gone.
        e.start_p_to_d(job(2, 2, &[11, 12, 13, 14, 15], 2500, 10), P, D, now);
        let ev = settle(&mut e, &mut now);
        assert!(ev.iter().any(|x| matches!(
            x,
            Event::Evicted {
                session: SessionId(1),
                worker: D
            }
        )));
        assert_eq!(e.resident_tokens(D, SessionId(1)), None);
        assert_eq!(e.resident_tokens(D, SessionId(2)), Some(2510));
    }

    #[test]
    fn a_transfer_without_room_times_out() {
        let mut e = engine(&[WorkerRole::Prefill, WorkerRole::Decode], 4096, 2.0);
        let mut now = 0;
        // A long-running request holds most of D while the second transfer waits.
        e.start_p_to_d(job(1, 1, &[1, 2, 3, 4], 2000, 1_000_000), P, D, now);
        let mut wakes = Vec::new();
        let mut events = Vec::new();
        // Run until the first request decodes, then start the second one.
        loop {
            events.extend(e.take_events());
            wakes.extend(e.take_wakes());
            if events
                .iter()
                .any(|x| matches!(x, Event::FirstToken { id: 1, .. }))
            {
                break;
            }
            wakes.sort_by_key(|(t, _)| *t);
            let (t, w) = wakes.remove(0);
            now = t;
            e.wake(w, now);
        }
        e.start_p_to_d(job(2, 2, &[11, 12, 13, 14], 2000, 10), P, D, now);
        let deadline = now + micros(2.0);
        let mut timed_out = None;
        for _ in 0..1_000_000 {
            events.extend(e.take_events());
            if let Some(Event::TransferTimedOut { id, at }) = events
                .iter()
                .find(|x| matches!(x, Event::TransferTimedOut { .. }))
            {
                timed_out = Some((*id, *at));
                break;
            }
            wakes.extend(e.take_wakes());
            wakes.sort_by_key(|(t, _)| *t);
            let (t, w) = wakes.remove(0);
            now = t;
            e.wake(w, now);
        }
        let (id, at) = timed_out.expect("the second transfer times out");
        assert_eq!(id, 2);
        assert!(
            at >= deadline && at < deadline + micros(1.0),
            "{at} vs {deadline}"
        );
        assert_eq!(e.resident_tokens(D, SessionId(2)), None);
    }

    #[test]
    fn a_session_with_a_request_in_flight_is_not_idle() {
        for pin in [true, false] {
            let mut e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
                p.fit.pressure.pin_in_flight = pin;
            });
            let mut now = 0;
            e.start_p_to_d(job(1, 1, &[1, 2, 3, 4], 2000, 10), P, D, now);
            settle(&mut e, &mut now);
            assert_eq!(e.state(D).evictable_tokens, 2010);
            // The next turn is sent: D preallocates its whole context at once (there is room),
            // replacing the session's old KV, and no eviction can take that room back while
            // the request is on P or on the wire, pinned or not.
            e.start_p_to_d(job(2, 1, &[1, 2, 3, 4, 5], 2500, 10), P, D, now);
            let (ok, freed, evicted) = e.commit_evict(D, 8192, None, now);
            assert_eq!(e.state(D).evictable_tokens, 0);
            let busy: Vec<_> = e.residents(D).iter().map(|r| (r.0, r.1, r.3)).collect();
            assert_eq!(busy, vec![(SessionId(1), 2500, true)]);
            assert_eq!((ok, freed, evicted), (false, 0, vec![]));
            // Either way the turn completes and leaves its new KV resident.
            let ev = settle(&mut e, &mut now);
            assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 2, .. })));
            assert_eq!(e.resident_tokens(D, SessionId(1)), Some(2510));
            assert_eq!(e.state(D).evictable_tokens, 2510);
        }
    }

    /// Two long decodes on a pool that holds only one of them whole: the second is admitted
    /// with the decode reserve, outgrows it, and is retracted (SGLang's choice: the fewest
    /// tokens generated). D can prefill (it serves turns alone), so it recomputes. Returns the
    /// events.
    fn outgrow(max_retractions: u32) -> Vec<Event> {
        let mut e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
            p.fit.pressure.decode_reserve_tokens = 256;
            p.fit.pressure.max_retractions = max_retractions;
        });
        e.workers[D.0 as usize].recomputes = true;
        outgrow_on(e)
    }

    /// The two decodes of [`outgrow`] on engine `e`.
    fn outgrow_on(mut e: Engine) -> Vec<Event> {
        let mut now = 0;
        e.start_p_to_d(job(1, 1, &[1, 2, 3, 4, 5, 6], 3000, 3000), P, D, now);
        e.start_p_to_d(job(2, 2, &[11, 12, 13], 1500, 3000), P, D, now);
        let ev = settle(&mut e, &mut now);
        // Nothing is left behind: both sessions idle or gone, the pool consistent.
        let s = e.state(D);
        assert_eq!(s.used_tokens, s.evictable_tokens);
        ev
    }

    #[test]
    fn decode_that_outgrows_the_pool_is_retracted_and_recomputed() {
        let ev = outgrow(3);
        let retracted = ev
            .iter()
            .filter(|x| matches!(x, Event::Retracted { id: 2, worker: D }))
            .count();
        assert!(retracted >= 1, "{ev:?}");
        assert!(
            !ev.iter()
                .any(|x| matches!(x, Event::Retracted { id: 1, .. }))
        );
        for id in [1, 2] {
            assert!(
                ev.iter()
                    .any(|x| matches!(x, Event::Done { id: i, .. } if *i == id))
            );
            let firsts = ev
                .iter()
                .filter(|x| matches!(x, Event::FirstToken { id: i, .. } if *i == id))
                .count();
            assert_eq!(firsts, 1, "job {id}: one first token, retracted or not");
        }
    }

    #[test]
    fn decode_retracted_past_the_limit_fails_with_decode_oom() {
        let ev = outgrow(0);
        assert!(
            ev.iter()
                .any(|x| matches!(x, Event::DecodeOom { id: 2, .. }))
        );
        assert!(!ev.iter().any(|x| matches!(x, Event::Done { id: 2, .. })));
        assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 1, .. })));
    }

    /// [`outgrow`] on a decode-only worker (stock SGLang: no prefill path) with a host pool
    /// of `host_pool` tokens for retracted requests' KV.
    fn outgrow_decode_only(host_pool: u64) -> (Vec<Event>, u32) {
        let e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
            p.fit.pressure.decode_reserve_tokens = 256;
            p.fit.pressure.retraction_host_pool_tokens = host_pool;
        });
        assert!(!e.workers[D.0 as usize].recomputes);
        let ev = outgrow_on(e);
        let recomputes = ev
            .iter()
            .filter(|x| matches!(x, Event::Retracted { id: 2, .. }))
            .count() as u32;
        (ev, recomputes)
    }

    #[test]
    fn a_decode_only_worker_without_host_room_fails_a_retracted_request_at_once() {
        let (ev, retracted) = outgrow_decode_only(0);
        assert_eq!(retracted, 0, "{ev:?}");
        assert!(
            ev.iter()
                .any(|x| matches!(x, Event::DecodeOom { id: 2, .. }))
        );
        assert!(!ev.iter().any(|x| matches!(x, Event::Done { id: 2, .. })));
        assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 1, .. })));
        // Too small a pool for the request's KV is no pool.
        let (ev, _) = outgrow_decode_only(1000);
        assert!(
            ev.iter()
                .any(|x| matches!(x, Event::DecodeOom { id: 2, .. }))
        );
    }

    #[test]
    fn a_decode_only_worker_backs_a_retracted_request_up_and_loads_it_back() {
        let (ev, retracted) = outgrow_decode_only(8192);
        assert!(retracted >= 1, "{ev:?}");
        assert!(!ev.iter().any(|x| matches!(x, Event::DecodeOom { .. })));
        for id in [1, 2] {
            assert!(
                ev.iter()
                    .any(|x| matches!(x, Event::Done { id: i, .. } if *i == id))
            );
        }
    }

    #[test]
    fn a_decode_only_worker_admits_no_transfer_while_a_retracted_request_waits() {
        let mut e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
            p.fit.pressure.decode_reserve_tokens = 256;
            p.fit.pressure.retraction_host_pool_tokens = 8192;
        });
        let mut now = 0;
        e.start_p_to_d(job(1, 1, &[1, 2, 3, 4, 5, 6], 3000, 400), P, D, now);
        run_to_first_token(&mut e, 1, &mut now);
        e.retract(1, now);
        assert_eq!(e.workers[D.0 as usize].host_backup, 3001);
        // Another session's request holds 6,000 tokens: the retracted request does not fit.
        let other = ResidentEntry::running(6000, job(9, 9, &[99], 6000, 1).hashes, now);
        e.workers[D.0 as usize]
            .residents
            .insert(SessionId(9), other);
        e.workers[D.0 as usize].resident_tokens += 6000;
        // A small transfer that fits the pool waits behind the retracted request...
        e.start_p_to_d(job(2, 2, &[11], 500, 2), P, D, now);
        assert_eq!(e.state(D).queue_depth, 2);
        assert_eq!(e.state(D).used_tokens, 6000);
        // ...and goes once the retracted request is back.
        e.drop_resident(D, SessionId(9));
        e.retry_waiting(D, now);
        assert_eq!(e.state(D).queue_depth, 0);
        assert_eq!(e.workers[D.0 as usize].host_backup, 0);
        let ev = settle(&mut e, &mut now);
        assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 1, .. })));
        assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 2, .. })));
        // Loaded back, not recomputed: no first token again.
        assert!(
            !ev.iter()
                .any(|x| matches!(x, Event::FirstToken { id: 1, .. }))
        );
    }

    #[test]
    fn tiered_eviction_on_a_decode_only_worker_takes_only_sessions_it_can_back_up() {
        for (host_pool, retracted) in [(0, false), (16_384, true)] {
            let mut profile = Profile::default();
            profile.hardware.kv_pool_tokens = 8192;
            profile.model.max_input_tokens = 8000;
            profile.fit.pressure.decode_reserve_tokens = 64;
            profile.fit.pressure.retraction_host_pool_tokens = host_pool;
            let opts = EngineOptions {
                eviction: EvictionConfig::default(),
                block_size: BlockSize::default(),
            };
            let mut e = Engine::new(
                profile,
                opts,
                &[WorkerRole::Prefill, WorkerRole::Decode],
                1,
                0.0,
            );
            let mut now = 0;
            // A running request holds 97% of D; a transfer needs room there.
            e.start_p_to_d(job(1, 1, &[1], 7900, 100), P, D, now);
            let mut ev = Vec::new();
            while !ev
                .iter()
                .any(|x| matches!(x, Event::FirstToken { id: 1, .. }))
            {
                let mut wakes = e.take_wakes();
                wakes.sort_by_key(|(t, _)| *t);
                let (t, w) = wakes.remove(0);
                e.wakes.extend(wakes);
                now = t;
                e.wake(w, now);
                ev.extend(e.take_events());
            }
            e.start_p_to_d(job(2, 2, &[2], 2000, 2), P, D, now);
            ev.extend(settle(&mut e, &mut now));
            assert_eq!(
                ev.iter()
                    .any(|x| matches!(x, Event::Retracted { id: 1, .. })),
                retracted,
                "host pool {host_pool}: {ev:?}"
            );
            assert!(!ev.iter().any(|x| matches!(x, Event::DecodeOom { .. })));
            for id in [1, 2] {
                assert!(
                    ev.iter()
                        .any(|x| matches!(x, Event::Done { id: i, .. } if *i == id))
                );
            }
        }
    }

    #[test]
    fn the_token_ratio_decays_per_decode_step_and_a_retraction_resets_it() {
        let mut e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
            p.fit.pressure.new_token_ratio_decay_steps = 10;
        });
        let mut now = 0;
        let ratio = |e: &Engine| e.workers[D.0 as usize].token_ratio;
        assert_eq!(ratio(&e), 0.7);
        // Four decode steps (the first token comes with the transfer): 0.7 − 4 × 0.0602.
        e.start_p_to_d(job(1, 1, &[1, 2], 1000, 5), P, D, now);
        settle(&mut e, &mut now);
        assert!((ratio(&e) - (0.7 - 4.0 * (0.7 - 0.098) / 10.0)).abs() < 1e-9);
        // Many more steps: it stays at the floor.
        e.start_p_to_d(job(2, 2, &[3, 4], 1000, 40), P, D, now);
        settle(&mut e, &mut now);
        assert_eq!(ratio(&e), 0.098);
        // A retraction sets it back: the worker admits cautiously again.
        let id = 3;
        e.start_p_to_d(job(id, 3, &[5, 6], 1000, 1_000), P, D, now);
        run_to_first_token(&mut e, 3, &mut now);
        e.retract(id, now);
        assert_eq!(ratio(&e), 0.7);
    }

    #[test]
    fn running_requests_count_for_the_ratio_of_their_reserve_at_admission() {
        // 8,192 tokens; a decoding request of 4,000 (context allocated so far) is active.
        for (ratio, admitted) in [(1.0, false), (0.1, true)] {
            let mut e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
                p.fit.pressure.decode_reserve_tokens = 512;
                p.fit.pressure.init_new_token_ratio = ratio;
                p.fit.pressure.min_new_token_ratio = ratio;
            });
            let mut now = 0;
            e.start_p_to_d(
                job(1, 1, &[1, 2, 3, 4, 5, 6, 7, 8], 4000, 1_000_000),
                P,
                D,
                now,
            );
            run_to_first_token(&mut e, 1, &mut now);
            // 3,400 more tokens: with the whole reserve of both (1,024) they do not fit the
            // 4,192 free; with its own and a tenth of the running one's (512 + 52) they do.
            e.start_p_to_d(job(2, 2, &[11, 12, 13, 14, 15, 16, 17], 3400, 4), P, D, now);
            assert_eq!(e.state(D).queue_depth == 0, admitted, "ratio {ratio}");
        }
    }

    #[test]
    fn kv_that_does_not_arrive_in_time_fails_and_breaks_the_pair_on_p() {
        let d2 = WorkerId(2);
        let roles = [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Decode];
        let mut e = engine_with(&roles, 65_536, |p| {
            p.fit.transfer_timeout_s = 0.001;
            p.fit.pressure.timeout_until_arrival = true;
            p.fit.pressure.failed_pair_recovery_s = 100.0;
        });
        let mut now = 0;
        // Room on D at once, but P's prefill takes longer than the timeout: D gives up, the
        // room is released, and P's send to it fails.
        e.start_p_to_d(job(1, 1, &[1, 2, 3, 4, 5, 6, 7, 8], 4000, 4), P, D, now);
        let ev = settle(&mut e, &mut now);
        assert!(
            ev.iter()
                .any(|x| matches!(x, Event::TransferTimedOut { id: 1, .. }))
        );
        assert!(
            !ev.iter()
                .any(|x| matches!(x, Event::FirstToken { id: 1, .. }))
        );
        assert_eq!(e.state(D).used_tokens, 0);
        // With time to spare, P's next transfer to that D fails as soon as its KV is ready;
        // its transfer to the other D goes through.
        e.profile.fit.transfer_timeout_s = 32.0;
        e.start_p_to_d(job(2, 2, &[11, 12], 1000, 4), P, D, now);
        e.start_p_to_d(job(3, 3, &[21, 22], 1000, 4), P, d2, now);
        let start = now;
        let ev = settle(&mut e, &mut now);
        let failed_at = ev
            .iter()
            .find_map(|x| match x {
                Event::TransferTimedOut { id: 2, at } => Some(*at),
                _ => None,
            })
            .expect("the transfer over the dead pair fails");
        assert!(failed_at < start + micros(1.0));
        assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 3, .. })));
        assert_eq!(e.resident_tokens(D, SessionId(2)), None);
        // Once the pair has recovered, transfers to that D go through again.
        now += micros(100.0);
        e.start_p_to_d(job(4, 2, &[11, 12], 1000, 4), P, D, now);
        let ev = settle(&mut e, &mut now);
        assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 4, .. })));
    }

    fn hosting_engine(caps: &[(WorkerRole, Capabilities)], pool: u64) -> Engine {
        let mut profile = Profile::default();
        profile.hardware.kv_pool_tokens = pool;
        profile.model.max_input_tokens = pool / 2;
        let eviction = EvictionConfig {
            allow_cold: false,
            allow_hot: false,
            ..EvictionConfig::default()
        };
        Engine::with_layout(
            profile,
            EngineOptions {
                eviction,
                block_size: BlockSize::default(),
            },
            caps,
            1,
            0.0,
        )
    }

    #[test]
    fn a_local_turn_reuses_what_its_worker_holds_and_keeps_the_session() {
        let d = Capabilities::of_role(WorkerRole::Decode).with_local();
        let mut e = hosting_engine(&[(WorkerRole::Decode, d), (WorkerRole::Decode, d)], 8192);
        let (w0, w1) = (WorkerId(0), WorkerId(1));
        let mut now = 0;
        // Session 1 is served alone on w0 from scratch.
        let adm = e.try_local(job(1, 1, &[1, 2, 3], 1500, 4), w0, 1504, now);
        assert_eq!(adm, LocalAdmission::Started { cached: 0 });
        settle(&mut e, &mut now);
        assert_eq!(e.resident_tokens(w0, SessionId(1)), Some(1504));
        // Session 2 shares two blocks with session 1's KV on w0: they are not computed again.
        let adm = e.try_local(job(2, 2, &[1, 2, 7, 8], 2000, 4), w0, 2004, now);
        assert_eq!(adm, LocalAdmission::Started { cached: 1024 });
        settle(&mut e, &mut now);
        // Session 1 moves to w1: its KV on w0 is released when the turn is sent.
        let adm = e.try_local(job(3, 1, &[1, 2, 3, 9], 1900, 4), w1, 1904, now);
        assert_eq!(adm, LocalAdmission::Started { cached: 0 });
        assert_eq!(e.resident_tokens(w0, SessionId(1)), None);
        let ev = settle(&mut e, &mut now);
        assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 3, .. })));
        assert_eq!(e.resident_tokens(w1, SessionId(1)), Some(1904));
        // A resident session's large append extends its KV in place.
        let adm = e.try_local(job(4, 1, &[1, 2, 3, 10, 11, 12], 3000, 4), w1, 1200, now);
        assert_eq!(adm, LocalAdmission::Started { cached: 1536 });
    }

    #[test]
    fn a_local_turn_waits_in_order_behind_a_transfer() {
        let d = Capabilities::of_role(WorkerRole::Decode).with_local();
        let p = Capabilities::of_role(WorkerRole::Prefill);
        let mut e = hosting_engine(&[(WorkerRole::Prefill, p), (WorkerRole::Decode, d)], 8192);
        let mut now = 0;
        // A long decode holds most of D.
        e.start_p_to_d(
            job(1, 1, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 5000, 400),
            P,
            D,
            now,
        );
        loop {
            let ev = e.take_events();
            if ev
                .iter()
                .any(|x| matches!(x, Event::FirstToken { id: 1, .. }))
            {
                break;
            }
            let mut wakes = e.take_wakes();
            wakes.sort_by_key(|(t, _)| *t);
            let (t, w) = wakes.remove(0);
            for (t2, w2) in wakes {
                e.wakes.push((t2, w2));
            }
            now = t;
            e.wake(w, now);
        }
        // A transfer that does not fit waits in D's queue; a local turn that would fit
        // queues behind it rather than overtaking.
        e.start_p_to_d(job(2, 2, &[21, 22, 23, 24, 25, 26], 3000, 10), P, D, now);
        assert_eq!(e.state(D).queue_depth, 1);
        // It would fit now, but it is not first in line.
        let adm = e.try_local(job(3, 3, &[31], 400, 4), D, 404, now);
        assert_eq!(adm, LocalAdmission::Queued);
        assert_eq!(e.state(D).queue_depth, 2);
        let ev = settle(&mut e, &mut now);
        let at = |id| {
            ev.iter()
                .find_map(|x| match x {
                    Event::FirstToken { id: i, at } if *i == id => Some(*at),
                    Event::Done { id: i, at, .. } if *i == id && id == 1 => Some(*at),
                    _ => None,
                })
                .expect("event")
        };
        // The transfer got its room when the long decode ended; the local turn after it.
        assert!(at(3) >= at(1), "the local turn overtook the transfer");
        assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 3, .. })));
        // A prompt over the pool is refused outright.
        assert_eq!(
            e.try_local(job(4, 4, &[41], 8000, 4), D, 8004, now),
            LocalAdmission::Rejected
        );
    }

    #[test]
    fn a_worker_that_hosts_sessions_prefills_for_another_in_one_pool() {
        let x = Capabilities::ALL;
        let mut e = hosting_engine(&[(WorkerRole::Decode, x), (WorkerRole::Decode, x)], 8192);
        let (x0, x1) = (WorkerId(0), WorkerId(1));
        let mut now = 0;
        // Session 1 lives on x0.
        e.try_local(job(1, 1, &[1, 2, 3], 1500, 2), x0, 1502, now);
        settle(&mut e, &mut now);
        // x0 prefills session 2 for x1; it reuses the blocks of session 1's KV.
        e.reseed(job(2, 2, &[1, 2, 5, 6], 2000, 3), x0, x1, now);
        let ev = settle(&mut e, &mut now);
        assert!(ev.iter().any(|x| matches!(
            x,
            Event::Done {
                id: 2,
                cached: 1024,
                ..
            }
        )));
        assert_eq!(e.resident_tokens(x1, SessionId(2)), Some(2003));
        // x0's pool holds session 1 and the prefix cache of the work it did for x1.
        let s = e.state(x0);
        assert_eq!(s.used_tokens, 1502 + 4 * 512);
        assert_eq!(s.evictable_tokens, s.used_tokens);
        assert_eq!(s.resident_sessions, 1);
    }

    #[test]
    fn colocated_worker_reuses_its_prefix_cache() {
        let mut e = engine(&[WorkerRole::Colocated], 8192, 32.0);
        let w = WorkerId(0);
        let mut now = 0;
        e.start_colocated(job(1, 1, &[1, 2, 3], 1400, 2), w, now);
        let ev = settle(&mut e, &mut now);
        assert!(ev.iter().any(|x| matches!(
            x,
            Event::Done {
                id: 1,
                cached: 0,
                resident_tokens: 0,
                ..
            }
        )));
        e.start_colocated(job(2, 1, &[1, 2, 4, 5], 2000, 2), w, now);
        let ev = settle(&mut e, &mut now);
        assert!(ev.iter().any(|x| matches!(
            x,
            Event::Done {
                id: 2,
                cached: 1024,
                ..
            }
        )));
        // Blocks stay cached and become evictable once nothing runs.
        let s = e.state(w);
        assert_eq!(s.used_tokens, 5 * 512);
        assert_eq!(s.evictable_tokens, 5 * 512);
    }
}
