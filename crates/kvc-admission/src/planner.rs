//! Tiered eviction planning: a pure function from resident sessions and a need to an ordered
//! list of victims.
//!
//! Tiers, in order:
//! 1. **idle** — sessions with no request running, least recently used first (or, with
//!    [`VictimOrder::PredictedNextUse`], the one whose next use is predicted furthest away first;
//!    a session idle for [`EvictionConfig::abandoned_after_ms`] goes before every predicted
//!    one whatever its prediction: its client has paused past what a turn's tool call takes);
//! 2. **cold** — sessions with a request running but no access for
//!    [`EvictionConfig::cold_after_ms`]; their in-flight work is retracted; least recently used
//!    first;
//! 3. **hot** — every other running session, least recently used first, and only when the pool
//!    would otherwise stay above [`EvictionConfig::hard_cap_fraction`] of its capacity.
//!
//! The requesting session is never a victim, and neither is a session holding no tokens.

use kvc_core::{EvictionMode, SessionId};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;

/// Whether a resident session has a request running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ResidentState {
    /// No request running: the session waits for its next turn (evictable at no cost).
    Idle,
    /// A request of the session is running (evicting it retracts that work).
    Running,
}

kvc_core::impl_stable_name!(ResidentState, "resident state" { Idle => "idle", Running => "running" });

/// A session whose KV is resident on a worker, as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Resident {
    /// The session.
    pub session: SessionId,
    /// Tokens of KV it holds.
    pub tokens: u64,
    /// Idle or running.
    pub state: ResidentState,
    /// Last access (turn start or end), in milliseconds.
    pub last_access_ms: u64,
    /// When its next turn is expected, in milliseconds, if a predictor says so.
    #[serde(default)]
    pub predicted_next_use_ms: Option<u64>,
}

/// How idle victims are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VictimOrder {
    /// Least recently used first.
    Lru,
    /// Furthest predicted next use first; sessions without a prediction come before every
    /// predicted one (nothing says they will be back), least recently used first among them.
    PredictedNextUse,
}

kvc_core::impl_stable_name!(VictimOrder, "victim order" { Lru => "lru", PredictedNextUse => "predicted-next-use" });

/// Eviction settings.
///
/// Defaults: `cold_after_ms` 30 000 (ten times the median gap between turns of the reference
/// trace), `hard_cap_fraction` 0.95, `order` [`VictimOrder::Lru`], `allow_cold` and `allow_hot`
/// true, `abandoned_after_ms` 300 000 (a hundred times that median gap).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", default, deny_unknown_fields)]
pub struct EvictionConfig {
    /// A running session not accessed for this long is cold.
    pub cold_after_ms: u64,
    /// Hot sessions are evicted only while the pool would otherwise stay above this fraction of
    /// its capacity (clamped to `[0, 1]`).
    pub hard_cap_fraction: f64,
    /// Order of idle victims.
    pub order: VictimOrder,
    /// Whether cold sessions may be evicted.
    pub allow_cold: bool,
    /// Whether hot sessions may be evicted (above the hard cap).
    pub allow_hot: bool,
    /// An idle session not accessed for this long is abandoned: with
    /// [`VictimOrder::PredictedNextUse`] it is taken before every other idle session,
    /// least recently used first, whatever its predicted next use (with
    /// [`VictimOrder::Lru`] the least recently used already go first). 0 turns it off.
    pub abandoned_after_ms: u64,
}

impl Default for EvictionConfig {
    fn default() -> Self {
        EvictionConfig {
            cold_after_ms: 30_000,
            hard_cap_fraction: 0.95,
            order: VictimOrder::Lru,
            allow_cold: true,
            allow_hot: true,
            abandoned_after_ms: 300_000,
        }
    }
}

impl From<EvictionMode> for EvictionConfig {
    /// The planner settings of a decode worker's eviction mode: `idle-lru` takes idle sessions
    /// only, `tiered` takes idle, then cold, then hot ones; the other settings keep their
    /// defaults.
    fn from(mode: EvictionMode) -> Self {
        let tiered = match mode {
            EvictionMode::IdleLru => false,
            EvictionMode::Tiered => true,
        };
        EvictionConfig {
            allow_cold: tiered,
            allow_hot: tiered,
            ..EvictionConfig::default()
        }
    }
}

/// The tier a victim was taken from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tier {
    /// An idle session.
    Idle,
    /// A running session not accessed for `cold_after_ms`; its in-flight work is retracted.
    Cold,
    /// Any other running session, evicted above the hard cap; its in-flight work is retracted.
    Hot,
}

kvc_core::impl_stable_name!(Tier, "eviction tier" { Idle => "idle", Cold => "cold", Hot => "hot" });

/// One session to evict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Victim {
    /// The session.
    pub session: SessionId,
    /// Tokens its eviction frees.
    pub tokens: u64,
    /// Its tier.
    pub tier: Tier,
}

/// The outcome of [`plan_eviction`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct EvictionPlan {
    /// Sessions to evict, in order.
    pub victims: Vec<Victim>,
    /// Sum of the victims' tokens.
    pub freed_tokens: u64,
    /// Whether free tokens plus `freed_tokens` cover the need. When false, `victims` lists every
    /// session the rules allowed and they are not enough: a caller normally rejects the request
    /// and evicts nothing.
    pub satisfied: bool,
}

impl EvictionPlan {
    /// The victims' sessions, in order.
    pub fn sessions(&self) -> Vec<SessionId> {
        self.victims.iter().map(|v| v.session).collect()
    }
}

/// Plans which sessions to evict so that `need_tokens` are free.
///
/// `need_tokens` is what must be free in total; with `free_tokens` already free the plan frees
/// `need_tokens.saturating_sub(free_tokens)` (nothing, and `satisfied`, when that is zero). The
/// pool's used tokens are `capacity_tokens - free_tokens`.
///
/// Victims are taken tier by tier, and the plan stops as soon as the need is covered (so only
/// its last victim can free more than what was still missing):
/// 1. [`Tier::Idle`]: idle sessions, least recently used first, or with
///    [`VictimOrder::PredictedNextUse`] those idle for `abandoned_after_ms` first (least
///    recently used first), then the furthest predicted next use first;
/// 2. [`Tier::Cold`] (if `allow_cold`): running sessions not accessed for `cold_after_ms`,
///    least recently used first; their in-flight work is retracted;
/// 3. [`Tier::Hot`] (if `allow_hot`): the other running sessions, least recently used first,
///    only when after every idle and cold victim the used tokens would still exceed
///    [`hard_cap_tokens`] (`hard_cap_fraction × capacity_tokens`); their work is retracted.
///
/// The requester and sessions holding no tokens are never victims. Ties are broken by session
/// id, so the plan does not depend on the order of `residents`.
///
/// ```
/// use kvc_admission::{plan_eviction, EvictionConfig, Resident, ResidentState, Tier};
/// use kvc_core::SessionId;
///
/// let r = |id, tokens, state, last| Resident {
///     session: SessionId(id), tokens, state, last_access_ms: last, predicted_next_use_ms: None,
/// };
/// let residents = [
///     r(1, 4_000, ResidentState::Idle, 900),
///     r(2, 3_000, ResidentState::Idle, 100),
///     r(3, 8_000, ResidentState::Running, 50),
/// ];
/// let cfg = EvictionConfig { cold_after_ms: 500, ..EvictionConfig::default() };
/// // 10 000 tokens needed, 1 000 free: 9 000 to free.
/// let plan = plan_eviction(&residents, 10_000, 1_000, 20_000, Some(SessionId(9)), 1_000, &cfg);
/// assert_eq!(plan.sessions(), [SessionId(2), SessionId(1), SessionId(3)]);
/// assert_eq!(plan.victims[2].tier, Tier::Cold);
/// assert_eq!(plan.freed_tokens, 15_000);
/// assert!(plan.satisfied);
/// ```
pub fn plan_eviction(
    residents: &[Resident],
    need_tokens: u64,
    free_tokens: u64,
    capacity_tokens: u64,
    requester: Option<SessionId>,
    now_ms: u64,
    cfg: &EvictionConfig,
) -> EvictionPlan {
    let to_free = need_tokens.saturating_sub(free_tokens);
    if to_free == 0 {
        return EvictionPlan {
            victims: Vec::new(),
            freed_tokens: 0,
            satisfied: true,
        };
    }

    let mut idle = Vec::new();
    let mut cold = Vec::new();
    let mut hot = Vec::new();
    for r in residents {
        if Some(r.session) == requester || r.tokens == 0 {
            continue;
        }
        match r.state {
            ResidentState::Idle => idle.push(r),
            ResidentState::Running => {
                let idle_for = now_ms.saturating_sub(r.last_access_ms);
                if cfg.allow_cold && idle_for >= cfg.cold_after_ms {
                    cold.push(r);
                } else {
                    hot.push(r);
                }
            }
        }
    }

    match cfg.order {
        VictimOrder::Lru => idle.sort_by_key(|r| (r.last_access_ms, r.session)),
        VictimOrder::PredictedNextUse => idle.sort_by_key(|r| {
            let abandoned = cfg.abandoned_after_ms > 0
                && now_ms.saturating_sub(r.last_access_ms) >= cfg.abandoned_after_ms;
            (
                !abandoned,
                // Among the abandoned, least recently used first.
                if abandoned { r.last_access_ms } else { 0 },
                r.predicted_next_use_ms.is_some(),
                Reverse(r.predicted_next_use_ms),
                r.last_access_ms,
                r.session,
            )
        }),
    }
    cold.sort_by_key(|r| (r.last_access_ms, r.session));
    hot.sort_by_key(|r| (r.last_access_ms, r.session));

    let mut plan = EvictionPlan::default();
    take(&mut plan, Tier::Idle, &idle, to_free);
    take(&mut plan, Tier::Cold, &cold, to_free);
    if cfg.allow_hot && plan.freed_tokens < to_free {
        let used = capacity_tokens.saturating_sub(free_tokens);
        if used.saturating_sub(plan.freed_tokens) > hard_cap_tokens(capacity_tokens, cfg) {
            take(&mut plan, Tier::Hot, &hot, to_free);
        }
    }
    plan.satisfied = plan.freed_tokens >= to_free;
    plan
}

/// Appends victims from `candidates` (already ordered) until `to_free` tokens are freed.
fn take(plan: &mut EvictionPlan, tier: Tier, candidates: &[&Resident], to_free: u64) {
    for r in candidates {
        if plan.freed_tokens >= to_free {
            break;
        }
        plan.freed_tokens = plan.freed_tokens.saturating_add(r.tokens);
        plan.victims.push(Victim {
            session: r.session,
            tokens: r.tokens,
            tier,
        });
    }
}

/// `hard_cap_fraction × capacity_tokens`, rounded down, with the fraction clamped to `[0, 1]`
/// (a fraction that is not a number counts as 1: no hot eviction).
pub fn hard_cap_tokens(capacity_tokens: u64, cfg: &EvictionConfig) -> u64 {
    let fraction = if cfg.hard_cap_fraction.is_nan() {
        1.0
    } else {
        cfg.hard_cap_fraction.clamp(0.0, 1.0)
    };
    ((capacity_tokens as f64) * fraction).floor() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvc_core::StableName;

    fn r(id: u64, tokens: u64, state: ResidentState, last: u64) -> Resident {
        Resident {
            session: SessionId(id),
            tokens,
            state,
            last_access_ms: last,
            predicted_next_use_ms: None,
        }
    }

    use ResidentState::{Idle, Running};

    fn cfg() -> EvictionConfig {
        EvictionConfig {
            cold_after_ms: 1_000,
            ..EvictionConfig::default()
        }
    }

    #[test]
    fn nothing_to_free_gives_empty_satisfied_plan() {
        let rs = [r(1, 10, Idle, 0)];
        let plan = plan_eviction(&rs, 100, 100, 1_000, None, 0, &cfg());
        assert_eq!(
            plan,
            EvictionPlan {
                victims: vec![],
                freed_tokens: 0,
                satisfied: true
            }
        );
    }

    #[test]
    fn idle_lru_first_and_stops_when_covered() {
        let rs = [
            r(1, 100, Idle, 30),
            r(2, 100, Idle, 10),
            r(3, 100, Idle, 20),
            r(4, 100, Idle, 40),
        ];
        let plan = plan_eviction(&rs, 250, 50, 1_000, None, 50, &cfg());
        assert_eq!(plan.sessions(), [SessionId(2), SessionId(3)]);
        assert_eq!(plan.freed_tokens, 200);
        assert!(plan.satisfied);
        assert!(plan.victims.iter().all(|v| v.tier == Tier::Idle));
    }

    #[test]
    fn predicted_next_use_furthest_first_unpredicted_before() {
        let mut rs = [
            r(1, 100, Idle, 10),
            r(2, 100, Idle, 20),
            r(3, 100, Idle, 30),
            r(4, 100, Idle, 5),
        ];
        rs[0].predicted_next_use_ms = Some(5_000);
        rs[1].predicted_next_use_ms = Some(9_000);
        rs[2].predicted_next_use_ms = None;
        rs[3].predicted_next_use_ms = Some(1_000);
        let cfg = EvictionConfig {
            order: VictimOrder::PredictedNextUse,
            ..cfg()
        };
        let plan = plan_eviction(&rs, 400, 0, 1_000, None, 50, &cfg);
        assert_eq!(
            plan.sessions(),
            [SessionId(3), SessionId(2), SessionId(1), SessionId(4)]
        );
    }

    #[test]
    fn cold_after_idle_and_never_the_requester() {
        let rs = [
            r(1, 500, Running, 0),     // cold (idle for 5 000 ms)
            r(2, 100, Idle, 4_900),    // idle
            r(3, 700, Running, 4_500), // hot
            r(4, 300, Idle, 100),      // the requester
        ];
        let plan = plan_eviction(&rs, 600, 0, 10_000, Some(SessionId(4)), 5_000, &cfg());
        assert_eq!(plan.sessions(), [SessionId(2), SessionId(1)]);
        assert_eq!(plan.victims[0].tier, Tier::Idle);
        assert_eq!(plan.victims[1].tier, Tier::Cold);
        assert_eq!(plan.freed_tokens, 600);
        assert!(plan.satisfied);
    }

    #[test]
    fn hot_only_above_hard_cap() {
        let rs = [r(1, 400, Running, 900), r(2, 400, Running, 950)];
        // Pool of 1 000 with 200 free: 800 used, cap 950 → hot sessions are protected.
        let below = plan_eviction(&rs, 500, 200, 1_000, None, 1_000, &cfg());
        assert!(below.victims.is_empty());
        assert!(!below.satisfied);
        // Pool of 1 000 with 20 free: 980 used > 950 → hot eviction, LRU first.
        let above = plan_eviction(&rs, 500, 20, 1_000, None, 1_000, &cfg());
        assert_eq!(above.sessions(), [SessionId(1), SessionId(2)]);
        assert!(above.victims.iter().all(|v| v.tier == Tier::Hot));
        assert!(above.satisfied);
        // Disallowed hot eviction.
        let off = EvictionConfig {
            allow_hot: false,
            ..cfg()
        };
        assert!(
            plan_eviction(&rs, 500, 20, 1_000, None, 1_000, &off)
                .victims
                .is_empty()
        );
    }

    #[test]
    fn disallowed_cold_counts_as_hot() {
        let rs = [r(1, 400, Running, 0)];
        let cfg = EvictionConfig {
            allow_cold: false,
            ..cfg()
        };
        // 990 of 1 000 used: above the cap, so the (old) running session goes as hot.
        let plan = plan_eviction(&rs, 100, 10, 1_000, None, 10_000, &cfg);
        assert_eq!(
            plan.victims,
            [Victim {
                session: SessionId(1),
                tokens: 400,
                tier: Tier::Hot
            }]
        );
    }

    #[test]
    fn unsatisfiable_lists_everything_allowed() {
        let rs = [r(1, 100, Idle, 0), r(2, 0, Idle, 0), r(3, 50, Idle, 1)];
        let plan = plan_eviction(&rs, 1_000, 0, 10_000, None, 0, &cfg());
        assert_eq!(plan.sessions(), [SessionId(1), SessionId(3)]);
        assert_eq!(plan.freed_tokens, 150);
        assert!(!plan.satisfied);
    }

    #[test]
    fn hard_cap_tokens_clamps() {
        let mut c = cfg();
        c.hard_cap_fraction = 0.5;
        assert_eq!(hard_cap_tokens(1_001, &c), 500);
        c.hard_cap_fraction = 7.0;
        assert_eq!(hard_cap_tokens(1_000, &c), 1_000);
        c.hard_cap_fraction = f64::NAN;
        assert_eq!(hard_cap_tokens(1_000, &c), 1_000);
    }

    #[test]
    fn names_and_serde_agree() {
        for o in VictimOrder::ALL {
            let json = serde_json::to_string(o).unwrap();
            assert_eq!(json, format!("\"{}\"", o.as_str()));
            assert_eq!(o.as_str().parse::<VictimOrder>().unwrap(), *o);
        }
        assert_eq!(VictimOrder::PredictedNextUse.as_str(), "predicted-next-use");
        for t in Tier::ALL {
            assert_eq!(serde_json::to_string(t).unwrap(), format!("\"{t}\""));
        }
        for s in ResidentState::ALL {
            assert_eq!(serde_json::to_string(s).unwrap(), format!("\"{s}\""));
        }
        let err = "mru".parse::<VictimOrder>().unwrap_err();
        assert_eq!(err.expected, "lru, predicted-next-use");
    }

    #[test]
    fn an_abandoned_session_goes_before_any_prediction() {
        // At 400 000 ms: session 4 was last seen 350 s ago and session 1 310 s ago (both past
        // the 300 s pause); 2 and 3 are recent. 4's prediction says it is back soon.
        let mut rs = [
            r(1, 100, Idle, 90_000),
            r(2, 100, Idle, 390_000),
            r(3, 100, Idle, 395_000),
            r(4, 100, Idle, 50_000),
        ];
        rs[0].predicted_next_use_ms = Some(900_000);
        rs[1].predicted_next_use_ms = Some(2_000_000);
        rs[2].predicted_next_use_ms = None;
        rs[3].predicted_next_use_ms = Some(401_000);
        let cfg = EvictionConfig {
            order: VictimOrder::PredictedNextUse,
            ..cfg()
        };
        assert_eq!(cfg.abandoned_after_ms, 300_000);
        let plan = plan_eviction(&rs, 400, 0, 1_000, None, 400_000, &cfg);
        assert_eq!(
            plan.sessions(),
            [SessionId(4), SessionId(1), SessionId(3), SessionId(2)]
        );
        // Off: the predictions alone order them.
        let off = EvictionConfig {
            abandoned_after_ms: 0,
            ..cfg
        };
        let plan = plan_eviction(&rs, 400, 0, 1_000, None, 400_000, &off);
        assert_eq!(
            plan.sessions(),
            [SessionId(3), SessionId(2), SessionId(1), SessionId(4)]
        );
    }

    #[test]
    fn config_deserializes_with_defaults() {
        let c: EvictionConfig =
            serde_json::from_str(r#"{"order":"predicted-next-use","allow-hot":false}"#).unwrap();
        assert_eq!(c.order, VictimOrder::PredictedNextUse);
        assert!(!c.allow_hot);
        assert_eq!(c.cold_after_ms, 30_000);
        assert_eq!(c.abandoned_after_ms, 300_000);
        assert!(serde_json::from_str::<EvictionConfig>(r#"{"colder":1}"#).is_err());
    }

    #[test]
    fn eviction_modes_choose_the_tiers() {
        let idle = EvictionConfig::from(EvictionMode::IdleLru);
        assert!(!idle.allow_cold && !idle.allow_hot);
        let tiered = EvictionConfig::from(EvictionMode::Tiered);
        assert!(tiered.allow_cold && tiered.allow_hot);
        for c in [idle, tiered] {
            assert_eq!(c.cold_after_ms, EvictionConfig::default().cold_after_ms);
            assert_eq!(c.order, VictimOrder::Lru);
        }
    }
}
