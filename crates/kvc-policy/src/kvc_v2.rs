//! `kvc-v2`: the reference study's fix: capacity-aware choice of D, a hard cap, a capped overlap,
//! migration after repeated admission rejects (counter reset by every successful direct-to-D
//! turn), a larger direct-to-D limit, and an incremental footprint.
//!
//! # Score of a candidate D (or colocated worker), highest wins
//!
//! ```text
//! total = overlap_weight  × min(overlap, overlap_cap_blocks) / overlap_cap_blocks
//!       + sticky_weight   × [D is the session's current D]
//!       − capacity_weight × committed_fraction(D)
//!       − load_weight     × (in_flight(D) + queue_depth(D))
//! ```
//!
//! `overlap` is the number of leading request blocks the router believes resident on D now (the
//! live view: it forgets a session's blocks when the session leaves D or D evicts it);
//! `in_flight` is the larger of the published and the router's own count;
//! `committed_fraction` is the share of D's pool that eviction cannot reclaim
//! (`(used − evictable) / capacity`: idle resident sessions do not count). A D whose committed
//! fraction is above `hard_cap` is not eligible while some candidate is at or below it. Ties go
//! to the lower `in_flight + queue_depth`, then fewer assignments, then the lower id.
//!
//! # Paths (P/D)
//!
//! - first turn: P→D `turn1-seed` to the best D.
//! - a session resident on a healthy D whose append is within `direct_limit_tokens`:
//!   `direct-to-d` there, unless that D is above the hard cap while another healthy D is at or
//!   below it: then the session migrates (`reseed`, reason `migrated`) to the best other D.
//! - a reject re-routed (`rejected_by = D`): the session's reject count on D, this one included,
//!   reaching `migrate_after_rejects` migrates the session to the best other D (`reseed`,
//!   `migrated`; the count on D is reset: D is released) if there is one it may use. Otherwise
//!   `fallback` with `session-cap-rejected`, staying on its D.
//! - other fall-throughs (`direct-unsupported` among them: a D declared without append-prefill
//!   with [`crate::RouterState::set_direct_append`]): P→D `fallback` with the classified
//!   reason. A session resident on a
//!   healthy D stays there (strict stickiness) unless that D is over the hard cap while another D
//!   is not, in which case the move is reported as `reseed` / `migrated`. A session that is not
//!   resident goes to the best D by score (the sticky term still favours its last D).
//!
//! The reject counter of a session on a D is reset by every successful direct-to-D completion on
//! that D ([`crate::RouterState::observe`]), so a session migrates only after N rejects with no
//! success in between, which avoids the thrashing of a permanent counter.
//!
//! Colocated topologies: every decision is `colocated`. A session resident on a healthy worker
//! stays there (strict stickiness, as a direct-to-D turn does) unless that worker is over the
//! hard cap while another is at or below it; every other turn goes to the best worker by the
//! same score, less (with `kvc`'s local prefill on) `ttft-weight ×` the seconds of prefill
//! queued on the worker and the turn's own, at the worker's measured pace
//! ([`crate::RouterState::prefill_pace`]).
//!
//! Score components: `overlap` (blocks), `overlap_term`, `sticky_term`, `capacity_term`,
//! `load_term`, `committed_fraction`; `total` is the sum of the four terms.

use crate::backpressure::BackpressureConfig;
use crate::config::{check, check_backpressure};
use crate::decision::{Decision, ScoreEntry};
use crate::error::PolicyError;
use crate::fallthrough::TurnClass;
use crate::index::BlockView;
use crate::local::LocalPrefillConfig;
use crate::prefill;
use crate::route::{Ctx, Knobs, Plan};
use crate::state::{Residency, SessionRoute};
use crate::worker_set::WorkerSet;
use kvc_core::{BlockSize, ExecutionMode, FallThroughReason, PrefillPolicy, WorkerId, WorkerRole};
use serde::{Deserialize, Serialize};
use std::cmp::{Ordering, Reverse};

/// Configuration of `kvc-v2`.
///
/// | field | default |
/// |---|---|
/// | `direct-limit-tokens` | 8,192 |
/// | `hard-cap` | 0.85 (used fraction) |
/// | `migrate-after-rejects` | 3 |
/// | `overlap-cap-blocks` | 16 |
/// | `overlap-weight` | 1.0 |
/// | `sticky-weight` | 2.0 |
/// | `capacity-weight` | 2.0 |
/// | `load-weight` | 0.05 |
/// | `incremental-footprint` | `true` |
/// | `prefill` | `d-health-aware` |
/// | `backpressure` | disabled (the study's v2 had none; see [`BackpressureConfig`]) |
/// | `block-size` | 512 |
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct KvcV2Config {
    /// Largest uncached append (tokens) that may go direct-to-D.
    pub direct_limit_tokens: u64,
    /// Used fraction above which a D is skipped while another is at or below it.
    pub hard_cap: f64,
    /// Rejects of a session on a D (with no successful direct-to-D turn there in between) that
    /// trigger migration. At least 1.
    pub migrate_after_rejects: u32,
    /// Overlap (blocks) beyond which more overlap adds nothing. At least 1.
    pub overlap_cap_blocks: u32,
    /// Weight of the capped overlap.
    pub overlap_weight: f64,
    /// Bonus of the session's current D.
    pub sticky_weight: f64,
    /// Penalty per unit of used fraction.
    pub capacity_weight: f64,
    /// Penalty per request in flight or queued.
    pub load_weight: f64,
    /// Use `max(0, input − cached) + output` for later turns.
    pub incremental_footprint: bool,
    /// How P is chosen.
    pub prefill: PrefillPolicy,
    /// Backpressure hint parameters.
    pub backpressure: BackpressureConfig,
    /// Tokens per block of `hash_ids`.
    pub block_size: BlockSize,
}

impl Default for KvcV2Config {
    fn default() -> Self {
        KvcV2Config {
            direct_limit_tokens: 8_192,
            hard_cap: 0.85,
            migrate_after_rejects: 3,
            overlap_cap_blocks: 16,
            overlap_weight: 1.0,
            sticky_weight: 2.0,
            capacity_weight: 2.0,
            load_weight: 0.05,
            incremental_footprint: true,
            prefill: PrefillPolicy::DHealthAware,
            backpressure: BackpressureConfig::DISABLED,
            block_size: BlockSize::default(),
        }
    }
}

impl KvcV2Config {
    /// Checks the values are in range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        const NAME: &str = "kvc-v2";
        check(
            self.hard_cap.is_finite() && self.hard_cap > 0.0 && self.hard_cap <= 1.0,
            NAME,
            "hard-cap must be within (0, 1]",
        )?;
        check(
            self.migrate_after_rejects >= 1,
            NAME,
            "migrate-after-rejects must be at least 1",
        )?;
        check(
            self.overlap_cap_blocks >= 1,
            NAME,
            "overlap-cap-blocks must be at least 1",
        )?;
        check(
            [
                self.overlap_weight,
                self.sticky_weight,
                self.capacity_weight,
                self.load_weight,
            ]
            .iter()
            .all(|w| w.is_finite() && *w >= 0.0),
            NAME,
            "weights must be finite and >= 0",
        )?;
        check_backpressure(&self.backpressure, NAME)
    }
}

/// Ranking of an eligible D: score, then lower load, fewer assignments, lower id.
type RankKey = (f64, Reverse<u64>, Reverse<u64>, Reverse<WorkerId>);

/// Placement terms that `kvc` adds to the v2 score (see [`crate::KvcConfig`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placement {
    /// Penalty per session active on D (routed within `active_window_ms`, still resident).
    pub(crate) active_weight: f64,
    /// How recent a session's last turn must be for it to count as active.
    pub(crate) active_window_ms: u64,
    /// Who prefills a turn that is not direct (`crate::local`).
    pub(crate) local: LocalPrefillConfig,
    /// A subagent's first turn goes direct-to-D on its parent's D where it may.
    pub(crate) subagents: bool,
    /// Compacted turns fall through as `compacted` and are placed afresh.
    pub(crate) compaction: bool,
    /// A session that moves to another D takes its KV along where the worker holding it can
    /// send it (`migrate-kv`, [`V2::kv_sender`]).
    pub(crate) migrate_kv: bool,
}

/// How a non-direct turn reaches its host.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Via {
    /// The host serves it alone.
    Local,
    /// A prefill worker (holding this many tokens of the prompt) ships the KV to the host.
    Prefill(WorkerId, u64),
}

/// The cheapest path to one host.
#[derive(Debug, Clone, Copy)]
struct Path {
    via: Via,
    /// Expected cost in seconds (`crate::local`).
    cost_s: f64,
    /// Expected prefill seconds on the worker that prefills.
    prefill_s: f64,
    /// Tokens of the prompt the host holds (local) — what the decision reports as cached.
    host_cached: u64,
    /// Of those, the session's own KV there (what a local turn need not allocate again).
    own: u64,
}

struct V2<'c, 'a> {
    cfg: &'c KvcV2Config,
    ctx: &'c Ctx<'a>,
    placement: Option<Placement>,
    /// The workers sessions may be placed on: decode workers, plus the workers that serve
    /// turns alone when `kvc` plans local prefill.
    hosts: WorkerSet,
    /// `kvc`'s local prefill, when it is on and some healthy worker can serve alone.
    local: Option<LocalPrefillConfig>,
}

impl V2<'_, '_> {
    fn over_cap(&self, d: WorkerId) -> bool {
        self.ctx.worker_state(d).committed_fraction() > self.cfg.hard_cap
    }

    fn any_under(&self, set: &WorkerSet) -> bool {
        set.iter().any(|s| !self.over_cap(WorkerId(s as u32)))
    }

    fn without(set: &WorkerSet, d: WorkerId) -> WorkerSet {
        let mut s = set.clone();
        s.remove(d.0 as usize);
        s
    }

    /// Scores every host (entries for all of them), picks the best eligible one outside
    /// `exclude`. `paths`, when given, adds `−ttft_weight × cost` of each host's cheapest
    /// path, and a host without a path is not eligible. `None` if no host is eligible.
    fn pick(
        &self,
        sticky_to: Option<WorkerId>,
        exclude: Option<WorkerId>,
        paths: Option<&[Option<Path>]>,
        scores: &mut Vec<ScoreEntry>,
    ) -> Option<WorkerId> {
        let (ctx, cfg) = (self.ctx, self.cfg);
        let mut candidates = match exclude {
            Some(x) => Self::without(&self.hosts, x),
            None => self.hosts.clone(),
        };
        if let Some(paths) = paths {
            for slot in self.hosts.iter() {
                if paths[slot].is_none() {
                    candidates.remove(slot);
                }
            }
        }
        let any_under = self.any_under(&candidates);
        let depths = ctx.depths(&self.hosts, BlockView::Live);
        // Sessions active on each D: the decode batch a new session would join.
        let mut active = vec![0u32; ctx.width()];
        if let Some(p) = self.placement {
            ctx.state.active_sessions(
                ctx.now_ms(),
                p.active_window_ms,
                ctx.req.session,
                &mut active,
            );
        }
        // Paths are worked out only where local prefill is on (`local`, or on a colocated
        // cluster the placement's own configuration).
        let ttft_weight = self
            .local
            .or(self.placement.map(|p| p.local))
            .map_or(0.0, |l| l.ttft_weight);
        let active_weight = match (self.placement, self.local) {
            (Some(_), Some(l)) => l.active_weight,
            (Some(p), None) => p.active_weight,
            (None, _) => 0.0,
        };
        // The largest pool among the hosts: an active session on a host with a smaller pool
        // costs more in proportion (`pool_scale`).
        let largest_pool = self
            .hosts
            .iter()
            .map(|slot| ctx.worker_state(WorkerId(slot as u32)).capacity_tokens)
            .max()
            .unwrap_or(0);
        let cap = f64::from(cfg.overlap_cap_blocks);
        scores.reserve(self.hosts.len());
        let mut best: Option<RankKey> = None;
        for slot in self.hosts.iter() {
            let id = WorkerId(slot as u32);
            let state = ctx.worker_state(id);
            let used = state.committed_fraction();
            let load = u64::from(ctx.load(id)) + u64::from(state.queue_depth);
            let overlap = depths[slot];
            let overlap_term =
                cfg.overlap_weight * f64::from(overlap.min(cfg.overlap_cap_blocks)) / cap;
            let sticky_term = if sticky_to == Some(id) {
                cfg.sticky_weight
            } else {
                0.0
            };
            let capacity_term = 0.0 - cfg.capacity_weight * used;
            let load_term = 0.0 - cfg.load_weight * load as f64;
            let pool_scale = pool_scale(largest_pool, state.capacity_tokens);
            let active_term = 0.0 - active_weight * f64::from(active[slot]) * pool_scale;
            let path_term = paths
                .and_then(|p| p[slot])
                .map_or(0.0, |p| 0.0 - ttft_weight * p.cost_s);
            let total =
                overlap_term + sticky_term + capacity_term + load_term + active_term + path_term;
            let eligible = candidates.contains(slot) && (!any_under || used <= cfg.hard_cap);
            if eligible {
                let key = (
                    total,
                    Reverse(load),
                    Reverse(ctx.state.assignments(id)),
                    Reverse(id),
                );
                let better = best.as_ref().is_none_or(|b| {
                    key.0
                        .total_cmp(&b.0)
                        .then_with(|| (key.1, key.2, key.3).cmp(&(b.1, b.2, b.3)))
                        == Ordering::Greater
                });
                if better {
                    best = Some(key);
                }
            }
            let mut e = ScoreEntry::new(id, ctx.d_role())
                .with("overlap", f64::from(overlap))
                .with("overlap_term", overlap_term)
                .with("sticky_term", sticky_term)
                .with("capacity_term", capacity_term)
                .with("load_term", load_term)
                .with("active_term", active_term)
                .with("pool_scale", pool_scale)
                .with("committed_fraction", used);
            if paths.is_some() {
                e = e.with("path_term", path_term);
            }
            e.total = total;
            e.eligible = eligible;
            scores.push(e);
        }
        best.map(|k| k.3.0)
    }

    /// Where a subagent's first turn goes direct-to-D, with the tokens that D holds of it: its
    /// parent's D, when the parent is resident on a healthy host that takes direct turns (it
    /// prefills the part of a prompt it does not hold, as for a later turn of its own sessions:
    /// a vLLM instance of any role does, a stock SGLang decode server does not and is declared
    /// so), is at or below the hard cap, and holds some of the prompt, the rest within the
    /// direct limit and within the room the host has. Never on a re-route after a refusal.
    fn parent_host(&self) -> Option<(WorkerId, u64)> {
        let ctx = self.ctx;
        let req = ctx.req;
        if !self.placement.is_some_and(|p| p.subagents) || req.rejected_by.is_some() {
            return None;
        }
        let parent = ctx.state.session(req.parent?)?;
        let d = self.resident_d(Some(parent))?;
        let takes_direct = (ctx.healthy_d.contains(d.0 as usize)
            || ctx.healthy_local.contains(d.0 as usize))
            && ctx.state.accepts_direct(d);
        if !takes_direct || self.over_cap(d) {
            return None;
        }
        let cached = ctx.cached_on(d, BlockView::Live, self.cfg.block_size);
        let uncached = kvc_core::prefix::uncached_tokens(req.input_length, cached);
        let need = uncached.saturating_add(req.output_hint);
        (cached > 0
            && uncached <= self.cfg.direct_limit_tokens
            && ctx.worker_state(d).available_tokens() >= need)
            .then_some((d, cached))
    }

    /// The session's D if it is resident there on a healthy host.
    fn resident_d(&self, session: Option<&SessionRoute>) -> Option<WorkerId> {
        let s = session?;
        let d = s.current_d?;
        (s.residency == Residency::Resident && self.hosts.contains(d.0 as usize)).then_some(d)
    }

    /// The worker that may send the session's KV to `d`, the D it moves to, and the tokens of
    /// the prompt it holds: the session's D, where the session is resident (not evicted), when
    /// it is not `d`, sends its sessions' KV and is draining, or healthy and not over the hard
    /// cap (a routable worker over it is short of memory: prefilling the turn and holding the
    /// KV until the pull would add to that, so its sessions move by recompute), `d` decodes transferred
    /// KV and has room now for the prompt and its output hint (a transfer that waits for room
    /// holds the session on both workers), the turn is not a compaction (its old KV is stale)
    /// and the sender holds some of the prompt.
    fn kv_sender(
        &self,
        session: Option<&SessionRoute>,
        d: WorkerId,
        reason: Option<FallThroughReason>,
    ) -> Option<(WorkerId, u64)> {
        let s = session?;
        let source = s.current_d?;
        let ctx = self.ctx;
        let req = ctx.req;
        let movable = source != d
            && s.residency == Residency::Resident
            && reason != Some(FallThroughReason::Compacted)
            && ctx.kv_senders.contains(source.0 as usize)
            && (!ctx.healthy_d.contains(source.0 as usize) || !self.over_cap(source))
            && ctx.healthy_d.contains(d.0 as usize)
            && ctx.worker_state(d).available_tokens()
                >= req.input_length.saturating_add(req.output_hint);
        if !movable {
            return None;
        }
        // What it holds now (the live view: a host's blocks, not a prefill worker's cache).
        let cached = ctx.cached_on(source, BlockView::Live, self.cfg.block_size);
        (cached > 0).then_some((source, cached))
    }

    /// Whether a session resident on host `d` stays there: `d` is at or below the hard cap, or
    /// no host is (strict stickiness).
    fn may_stay(&self, d: WorkerId) -> bool {
        !self.over_cap(d) || !self.any_under(&self.hosts)
    }

    /// The D of a P→D path that is not a reject-driven migration: the resident D if it may be
    /// used (strict stickiness), otherwise the best by score.
    fn sticky_or_best(
        &self,
        session: Option<&SessionRoute>,
        paths: Option<&[Option<Path>]>,
        scores: &mut Vec<ScoreEntry>,
    ) -> WorkerId {
        let healthy_current = session
            .and_then(|s| s.current_d)
            .filter(|d| self.hosts.contains(d.0 as usize));
        let best = self.pick(healthy_current, None, paths, scores);
        if let Some(d) = self.resident_d(session)
            && self.may_stay(d)
        {
            return d;
        }
        // `hosts` is not empty (checked by the caller), so `pick` found a D.
        best.unwrap_or(WorkerId(0))
    }

    /// On a colocated cluster, every host's one path: it serves the turn alone, after the
    /// prefill already queued there, both at its measured pace
    /// ([`crate::RouterState::prefill_pace`]).
    fn colocated_paths(&self, l: &LocalPrefillConfig) -> Vec<Option<Path>> {
        let ctx = self.ctx;
        let mut out = vec![None; ctx.width()];
        for slot in self.hosts.iter() {
            let h = WorkerId(slot as u32);
            let host_cached = ctx.cached_on(h, BlockView::Live, self.cfg.block_size);
            let pf = l.prefill_s(
                ctx.req.input_length.saturating_sub(host_cached),
                host_cached,
            );
            out[slot] = Some(Path {
                via: Via::Local,
                cost_s: ctx.state.paced_backlog_s(h) + pf * ctx.state.prefill_pace(h),
                prefill_s: pf,
                host_cached,
                own: 0,
            });
        }
        out
    }

    /// The cheapest path to every host (`None` where there is none), `crate::local`'s rule.
    /// `allow_local` is false on a re-route after a refused admission (a P→D path then).
    fn paths(&self, l: &LocalPrefillConfig, allow_local: bool) -> Vec<Option<Path>> {
        let ctx = self.ctx;
        let req = ctx.req;
        let bs = self.cfg.block_size;
        let first = ctx.first_turn();
        let session = ctx.session();
        let decoding = |w: WorkerId| {
            if self.hosts.contains(w.0 as usize) {
                ctx.load(w)
            } else {
                0
            }
        };
        let need = |own: u64| {
            crate::footprint::footprint_tokens(req.input_length, req.output_hint, own, first, true)
        };
        // What each prefill worker would cost, whatever the host (the transfer aside).
        let transfer = l.transfer_s(req.input_length);
        let order = crate::round_robin::order(ctx.healthy_p, ctx.state.cursor(WorkerRole::Prefill));
        // What a worker holds of the prompt for a prefill it runs for another: a prefill
        // worker's prefix cache (the grow-only view, as `d-health-aware` reads it); a worker
        // that hosts sessions, what is resident there (its live view).
        let prefillers: Vec<(WorkerId, u64, f64, f64)> = order
            .map(|slot| {
                let p = WorkerId(slot as u32);
                let view = if self.hosts.contains(slot) {
                    BlockView::Live
                } else {
                    BlockView::Seen
                };
                let cached = ctx.cached_on(p, view, bs);
                let new = req.input_length - cached;
                let pf = l.prefill_s(new, cached);
                let backlog = ctx.state.prefill_backlog_s(p);
                let room = if ctx.worker_state(p).available_tokens() >= new {
                    0.0
                } else {
                    l.no_room_s
                };
                (
                    p,
                    cached,
                    pf,
                    l.run_cost(backlog, pf, decoding(p)) + transfer + room,
                )
            })
            .collect();
        // Cheapest first, round-robin order among equal costs: a host's best prefill worker
        // is the first it may use, found in a step or two instead of a pass over all of them
        // (the same choice as that pass: strictly cheaper wins, ties keep round-robin order).
        // (Sorted once per room term a host may add, so rounding ties break as that pass does.)
        let sorted = |extra: f64| {
            let mut k: Vec<usize> = (0..prefillers.len()).collect();
            k.sort_by(|&a, &b| {
                (prefillers[a].3 + extra)
                    .total_cmp(&(prefillers[b].3 + extra))
                    .then(a.cmp(&b))
            });
            k
        };
        let by_cost = [sorted(0.0), sorted(l.no_room_s)];
        // The prefill workers a host may use, in cost order, by what rules some out for it:
        // whether the host serves alone (a worker that hosts sessions is then not used) and
        // whether it has a local path (a prefill worker over its headroom is then not used).
        // Filtered once per kind of host, so each host's choice is a step or two, not a pass.
        let usable_orders: [[[std::cell::OnceCell<Vec<usize>>; 2]; 2]; 2] = Default::default();
        let usable_order = |room: usize, local_capable: bool, has_local: bool| {
            usable_orders[room][usize::from(local_capable)][usize::from(has_local)].get_or_init(
                || {
                    by_cost[room]
                        .iter()
                        .copied()
                        .filter(|&k| {
                            let p = prefillers[k].0;
                            let hosting = self.hosts.contains(p.0 as usize) && local_capable;
                            let busy = has_local && ctx.state.prefill_backlog_s(p) > l.p_headroom_s;
                            !hosting && !busy
                        })
                        .collect()
                },
            )
        };
        let mut out = vec![None; ctx.width()];
        for slot in self.hosts.iter() {
            let h = WorkerId(slot as u32);
            let host_cached = ctx.cached_on(h, BlockView::Live, bs);
            // The session's own KV on the host, which a local turn extends in place.
            let own = session
                .filter(|s| s.current_d == Some(h) && s.residency == Residency::Resident)
                .map_or(0, |s| {
                    kvc_core::prefix::reusable_from(&s.blocks, req.hash_ids, req.input_length, bs)
                });
            let available = ctx.worker_state(h).available_tokens();
            // A path onto a host without room for the turn waits there for it.
            let room = |n: u64| if available >= n { 0.0 } else { l.no_room_s };
            let backlog = ctx.state.prefill_backlog_s(h);
            let local = (allow_local && ctx.healthy_local.contains(slot)).then(|| {
                let pf = l.prefill_s(req.input_length - host_cached, host_cached);
                let path = Path {
                    via: Via::Local,
                    cost_s: l.run_cost(backlog, pf, decoding(h)) + room(need(own)),
                    prefill_s: pf,
                    host_cached,
                    own,
                };
                (path, backlog <= l.max_local_backlog_s)
            });
            // A local path the host can take now: under its backlog limit, with room.
            let has_local = local.is_some_and(|(_, ok)| ok) && available >= need(own);
            let mut best: Option<Path> = local.filter(|(_, ok)| *ok).map(|(p, _)| p);
            if ctx.healthy_d.contains(slot) {
                let room_pd = room(need(0));
                let local_capable = ctx.healthy_local.contains(slot);
                // A worker that hosts sessions prefills for a host that cannot serve alone
                // only: its queue and pool are its sessions' too, and the transfer needs room
                // on both sides. A prefill worker is used by a turn with a local path only
                // while it has headroom.
                let order = usable_order(usize::from(room_pd != 0.0), local_capable, has_local);
                let cheapest = order.iter().map(|&k| prefillers[k]).find(|&(p, ..)| p != h);
                if let Some((p, cached, pf, cost)) = cheapest {
                    let cost = cost + room_pd;
                    // Strictly cheaper wins: a tie keeps local.
                    if best.is_none_or(|b| cost < b.cost_s) {
                        best = Some(Path {
                            via: Via::Prefill(p, cached),
                            cost_s: cost,
                            prefill_s: pf,
                            host_cached,
                            own,
                        });
                    }
                }
            }
            // No other path: the host serves alone whatever its backlog says.
            out[slot] = best.or(local.map(|(p, _)| p));
        }
        out
    }
}

pub(crate) fn route(cfg: &KvcV2Config, ctx: &Ctx<'_>) -> Result<Decision, PolicyError> {
    route_with(cfg, None, ctx)
}

/// How much more an active session weighs on a host whose KV pool holds `pool` tokens than on
/// the hosts with the largest pool, `largest`: `largest / pool`, 1 where either is unknown (0).
/// A pool a tenth of the largest takes a tenth of the sessions before it evicts one of them.
fn pool_scale(largest: u64, pool: u64) -> f64 {
    if largest == 0 || pool == 0 {
        1.0
    } else {
        largest as f64 / pool as f64
    }
}

/// The v2 decision procedure, with `kvc`'s placement terms and local prefill when given.
pub(crate) fn route_with(
    cfg: &KvcV2Config,
    placement: Option<Placement>,
    ctx: &Ctx<'_>,
) -> Result<Decision, PolicyError> {
    ctx.require_d()?;
    let knobs = Knobs::new(cfg.incremental_footprint, cfg.backpressure);
    let local = placement
        .map(|p| p.local)
        .filter(|l| l.enabled && !ctx.colocated && !ctx.healthy_local.is_empty());
    let rejected = ctx.req.rejected_by.is_some();
    // After a refused admission the path is P→D, so only workers that decode transferred KV
    // may host it.
    let hosts = match local {
        Some(_) if !rejected => ctx.hosts(),
        _ => ctx.healthy_d.clone(),
    };
    let v2 = V2 {
        cfg,
        ctx,
        placement,
        hosts,
        local,
    };
    let session = ctx.session();
    let mut scores = ctx.score_list();

    if ctx.colocated {
        let current = session
            .and_then(|s| s.current_d)
            .filter(|d| ctx.healthy_d.contains(d.0 as usize));
        // With local prefill on, each worker's cost of the turn: the prefill queued there
        // and the turn's own, at the worker's measured pace.
        let colocated_local = placement.map(|p| p.local).filter(|l| l.enabled);
        let costs = colocated_local.map(|l| v2.colocated_paths(&l));
        let best = v2.pick(current, None, costs.as_deref(), &mut scores);
        // Strict stickiness, as for a direct-to-D turn: a session resident on a healthy
        // worker stays there (its next turn is an append to what that worker holds) unless
        // the worker is over the hard cap while another is not. Moving it for a lighter
        // queue would prefill its whole context again elsewhere.
        let w = match v2.resident_d(session) {
            Some(d) if v2.may_stay(d) => d,
            _ => best.unwrap_or(WorkerId(0)),
        };
        let cached = ctx.cached_on(w, BlockView::Live, cfg.block_size);
        let mut plan = Plan::colocated(w, cached, scores);
        if let Some(l) = colocated_local {
            // Counted in the worker's backlog until its first token.
            plan = plan
                .with_prefill_s(l.prefill_s(ctx.req.input_length.saturating_sub(cached), cached));
        }
        return Ok(ctx.finish(plan, knobs));
    }

    // Every host's cheapest path, worked out only for a decision that weighs them (not for a
    // direct turn that stays on its worker).
    let all_paths = std::cell::OnceCell::new();
    let paths = || {
        all_paths
            .get_or_init(|| local.map(|l| v2.paths(&l, !rejected)))
            .as_deref()
    };
    let migrated = (ExecutionMode::Reseed, Some(FallThroughReason::Migrated));
    let mut reject_count = None;
    let compaction = placement.is_some_and(|p| p.compaction);
    let (mode, reason, d) = match (
        ctx.classify(cfg.direct_limit_tokens, cfg.block_size, compaction),
        ctx.req.rejected_by,
    ) {
        (TurnClass::FirstTurn, _) if let Some((d, cached)) = v2.parent_host() => {
            // A subagent appended to what its parent's D holds.
            let mut only = WorkerSet::EMPTY;
            only.insert(d.0 as usize);
            V2 { hosts: only, ..v2 }.pick(None, None, None, &mut scores);
            let mut plan = Plan::direct(d, cached, scores, None);
            if let Some(l) = local {
                plan = plan.with_prefill_s(l.prefill_s(ctx.req.input_length - cached, cached));
            }
            return Ok(ctx.finish(plan, knobs));
        }
        (TurnClass::FirstTurn, _) => {
            let d = v2
                .pick(None, None, paths(), &mut scores)
                .unwrap_or(WorkerId(0));
            (ExecutionMode::Turn1Seed, None, d)
        }
        (
            TurnClass::Direct {
                decode,
                cached_tokens,
            },
            _,
        ) => {
            let others = V2::without(&v2.hosts, decode);
            if v2.over_cap(decode) && v2.any_under(&others) {
                let d = v2
                    .pick(None, Some(decode), paths(), &mut scores)
                    .unwrap_or(WorkerId(0));
                (migrated.0, migrated.1, d)
            } else {
                // The entry of the session's D, for debugging: the choice is made, and scoring
                // every other host would make a direct turn cost as much as the fleet is large.
                let mut only = WorkerSet::EMPTY;
                only.insert(decode.0 as usize);
                V2 { hosts: only, ..v2 }.pick(Some(decode), None, None, &mut scores);
                let mut plan = Plan::direct(decode, cached_tokens, scores, None);
                if let Some(l) = local {
                    let new = ctx.req.input_length - cached_tokens;
                    plan = plan.with_prefill_s(l.prefill_s(new, cached_tokens));
                }
                return Ok(ctx.finish(plan, knobs));
            }
        }
        (TurnClass::FallThrough { reason, .. }, Some(r)) if ctx.req.session.is_some() => {
            let n = session.map_or(1, |s| s.rejects_after(r));
            let others = V2::without(&v2.hosts, r);
            let r_unusable = !v2.hosts.contains(r.0 as usize) || v2.over_cap(r);
            let can_migrate = n >= cfg.migrate_after_rejects
                && !others.is_empty()
                && (v2.any_under(&others) || r_unusable);
            if can_migrate {
                reject_count = Some((r, 0));
                let d = v2
                    .pick(None, Some(r), paths(), &mut scores)
                    .unwrap_or(WorkerId(0));
                (migrated.0, migrated.1, d)
            } else {
                let d = v2.sticky_or_best(session, paths(), &mut scores);
                if v2.resident_d(session).is_some_and(|cur| cur != d) {
                    // Moved off a D over the hard cap: a migration, which releases `r`.
                    reject_count = Some((r, 0));
                    (migrated.0, migrated.1, d)
                } else {
                    reject_count = Some((r, n));
                    (ExecutionMode::Fallback, Some(reason), d)
                }
            }
        }
        (
            TurnClass::FallThrough {
                reason: FallThroughReason::Compacted,
                current_d,
            },
            _,
        ) => {
            // A fresh seed: placed by score, its old D favoured by the weak sticky term only.
            let current = current_d.filter(|d| v2.hosts.contains(d.0 as usize));
            let d = v2
                .pick(current, None, paths(), &mut scores)
                .unwrap_or(WorkerId(0));
            (
                ExecutionMode::Fallback,
                Some(FallThroughReason::Compacted),
                d,
            )
        }
        (TurnClass::FallThrough { reason, .. }, _) => {
            let d = v2.sticky_or_best(session, paths(), &mut scores);
            if v2.resident_d(session).is_some_and(|cur| cur != d) {
                (migrated.0, migrated.1, d)
            } else {
                (ExecutionMode::Fallback, Some(reason), d)
            }
        }
    };
    if placement.is_some_and(|p| p.migrate_kv)
        && mode != ExecutionMode::Turn1Seed
        && let Some((source, cached)) = v2.kv_sender(session, d, reason)
    {
        // The worker that holds the session prefills the turn from its cache and the new D
        // pulls the KV: nothing of the context is computed again.
        let mut e = ScoreEntry::new(source, WorkerRole::Prefill).with("kv_sender", 1.0);
        e.total = 0.0;
        scores.push(e);
        let plan = Plan::p_to_d(
            (ExecutionMode::MigrateKv, reason),
            d,
            (source, cached),
            scores,
            reject_count,
        );
        return Ok(ctx.finish(plan, knobs));
    }
    let Some(path) = paths().and_then(|p| p[d.0 as usize]) else {
        let chosen_p = prefill::choose(ctx, cfg.prefill, d, cfg.block_size, &mut scores)?;
        let plan = Plan::p_to_d((mode, reason), d, chosen_p, scores, reject_count);
        return Ok(ctx.finish(plan, knobs));
    };
    let plan = match path.via {
        Via::Local => Plan::local(
            d,
            reason,
            (path.host_cached, path.own),
            scores,
            reject_count,
        ),
        Via::Prefill(p, cached) => {
            prefill_entries(ctx, &mut scores);
            Plan::p_to_d((mode, reason), d, (p, cached), scores, reject_count)
        }
    };
    Ok(ctx.finish(plan.with_prefill_s(path.prefill_s), knobs))
}

/// Score entries of the prefill workers when `kvc`'s local prefill chose P by cost: their
/// backlog, for debugging (`total` is its negative).
fn prefill_entries(ctx: &Ctx<'_>, scores: &mut Vec<ScoreEntry>) {
    for slot in ctx.healthy_p.iter() {
        let id = WorkerId(slot as u32);
        let backlog = ctx.state.prefill_backlog_s(id);
        let mut e = ScoreEntry::new(id, WorkerRole::Prefill).with("backlog_s", backlog);
        e.total = 0.0 - backlog;
        scores.push(e);
    }
}
