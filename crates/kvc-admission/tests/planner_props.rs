//! Properties of the tiered eviction planner.

use kvc_admission::{
    EvictionConfig, EvictionPlan, Resident, ResidentState, Tier, VictimOrder, hard_cap_tokens,
    plan_eviction,
};
use kvc_core::SessionId;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone)]
struct Case {
    residents: Vec<Resident>,
    need: u64,
    free: u64,
    capacity: u64,
    requester: Option<SessionId>,
    now: u64,
    cfg: EvictionConfig,
}

fn resident() -> impl Strategy<Value = (u64, bool, u64, Option<u64>)> {
    (
        0u64..5_000,
        any::<bool>(),
        0u64..100_000,
        proptest::option::of(0u64..200_000),
    )
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::collection::vec(resident(), 0..24),
        0u64..60_000,
        0u64..20_000,
        0u64..30_000,
        any::<Option<prop::sample::Index>>(),
        (
            0u64..100_000,
            0.0f64..=1.0,
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            // 0 (off) a quarter of the time, else within the residents' idle times.
            prop_oneof![Just(0u64), 1u64..100_000, 1u64..100_000, 1u64..100_000],
        ),
    )
        .prop_map(
            |(
                rs,
                need,
                free,
                other_used,
                req,
                (cold_after, cap, predicted, cold, hot, abandoned),
            )| {
                let residents: Vec<Resident> = rs
                    .into_iter()
                    .enumerate()
                    .map(|(i, (tokens, running, last, predicted))| Resident {
                        // Ids out of order with respect to the vector.
                        session: SessionId((i as u64 * 7_919) % 1_000),
                        tokens,
                        state: if running {
                            ResidentState::Running
                        } else {
                            ResidentState::Idle
                        },
                        last_access_ms: last,
                        predicted_next_use_ms: predicted,
                    })
                    .collect();
                let requester = req.and_then(|ix| {
                    (!residents.is_empty()).then(|| residents[ix.index(residents.len())].session)
                });
                let resident_tokens: u64 = residents.iter().map(|r| r.tokens).sum();
                Case {
                    capacity: resident_tokens + free + other_used,
                    residents,
                    need,
                    free,
                    requester,
                    now: 100_000,
                    cfg: EvictionConfig {
                        cold_after_ms: cold_after,
                        hard_cap_fraction: cap,
                        order: if predicted {
                            VictimOrder::PredictedNextUse
                        } else {
                            VictimOrder::Lru
                        },
                        allow_cold: cold,
                        allow_hot: hot,
                        abandoned_after_ms: abandoned,
                    },
                }
            },
        )
}

fn plan(c: &Case) -> EvictionPlan {
    plan_eviction(
        &c.residents,
        c.need,
        c.free,
        c.capacity,
        c.requester,
        c.now,
        &c.cfg,
    )
}

fn is_cold(c: &Case, r: &Resident) -> bool {
    r.state == ResidentState::Running && c.now - r.last_access_ms >= c.cfg.cold_after_ms
}

/// Tokens of the candidates (not the requester) in each tier, as the rules define them.
fn tier_totals(c: &Case) -> (u64, u64, u64) {
    let (mut idle, mut cold, mut hot) = (0, 0, 0);
    for r in c
        .residents
        .iter()
        .filter(|r| Some(r.session) != c.requester)
    {
        match r.state {
            ResidentState::Idle => idle += r.tokens,
            ResidentState::Running if c.cfg.allow_cold && is_cold(c, r) => cold += r.tokens,
            ResidentState::Running => hot += r.tokens,
        }
    }
    (idle, cold, hot)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn never_evicts_the_requester_nor_twice(c in case()) {
        let p = plan(&c);
        let mut seen = HashSet::new();
        for v in &p.victims {
            prop_assert!(Some(v.session) != c.requester);
            prop_assert!(seen.insert(v.session), "{} twice", v.session);
            prop_assert!(v.tokens > 0);
        }
        prop_assert_eq!(p.freed_tokens, p.victims.iter().map(|v| v.tokens).sum::<u64>());
    }

    #[test]
    fn frees_the_need_whenever_the_allowed_total_allows(c in case()) {
        let p = plan(&c);
        let to_free = c.need.saturating_sub(c.free);
        prop_assert_eq!(p.satisfied, p.freed_tokens >= to_free);
        let (idle, cold, hot) = tier_totals(&c);
        let used = c.capacity - c.free;
        let hot_allowed =
            c.cfg.allow_hot && used.saturating_sub(idle + cold) > hard_cap_tokens(c.capacity, &c.cfg);
        let allowed = idle + cold + if hot_allowed { hot } else { 0 };
        if allowed >= to_free {
            prop_assert!(p.satisfied, "allowed {} >= {} but {:?}", allowed, to_free, p);
        } else {
            prop_assert!(!p.satisfied);
            // An unsatisfiable plan lists everything the rules allow.
            prop_assert_eq!(p.freed_tokens, allowed);
        }
        if to_free == 0 {
            prop_assert!(p.victims.is_empty());
        }
    }

    #[test]
    fn evicts_no_more_than_needed(c in case()) {
        let p = plan(&c);
        let to_free = c.need.saturating_sub(c.free);
        if let Some(last) = p.victims.last() {
            // Without its last victim the plan would fall short.
            prop_assert!(p.freed_tokens - last.tokens < to_free);
        }
    }

    #[test]
    fn respects_tier_rules_and_order(c in case()) {
        let p = plan(&c);
        let by_id: HashMap<_, _> = c.residents.iter().map(|r| (r.session, r)).collect();
        let tiers: Vec<Tier> = p.victims.iter().map(|v| v.tier).collect();
        prop_assert!(tiers.windows(2).all(|w| w[0] <= w[1]), "tiers out of order: {:?}", tiers);
        let (idle, cold, _) = tier_totals(&c);
        let used = c.capacity - c.free;
        let mut freed_before = 0;
        for v in &p.victims {
            let r = by_id[&v.session];
            prop_assert_eq!(v.tokens, r.tokens);
            match v.tier {
                Tier::Idle => prop_assert_eq!(r.state, ResidentState::Idle),
                Tier::Cold => {
                    prop_assert!(c.cfg.allow_cold);
                    prop_assert!(is_cold(&c, r));
                }
                Tier::Hot => {
                    prop_assert!(c.cfg.allow_hot);
                    prop_assert_eq!(r.state, ResidentState::Running);
                    prop_assert!(!(c.cfg.allow_cold && is_cold(&c, r)));
                    // Hot victims only once every idle and cold session went and the pool is
                    // still above the hard cap.
                    prop_assert!(freed_before >= idle + cold);
                    prop_assert!(used - (idle + cold) > hard_cap_tokens(c.capacity, &c.cfg));
                }
            }
            freed_before += v.tokens;
        }
        // Within a tier: the configured order.
        for tier in [Tier::Idle, Tier::Cold, Tier::Hot] {
            let rs: Vec<&Resident> = p
                .victims
                .iter()
                .filter(|v| v.tier == tier)
                .map(|v| by_id[&v.session])
                .collect();
            for w in rs.windows(2) {
                if tier == Tier::Idle && c.cfg.order == VictimOrder::PredictedNextUse {
                    // Abandoned sessions first (least recently used first), then the
                    // unpredicted, then the furthest predicted.
                    let abandoned = |r: &Resident| {
                        c.cfg.abandoned_after_ms > 0
                            && c.now - r.last_access_ms >= c.cfg.abandoned_after_ms
                    };
                    let key = |r: &Resident| match (abandoned(r), r.predicted_next_use_ms) {
                        (true, _) => (0, 0, r.last_access_ms),
                        (false, None) => (1, 0, r.last_access_ms),
                        (false, Some(t)) => (2, u64::MAX - t, r.last_access_ms),
                    };
                    prop_assert!(key(w[0]) <= key(w[1]), "{:?} before {:?}", w[0], w[1]);
                } else {
                    prop_assert!(w[0].last_access_ms <= w[1].last_access_ms);
                }
            }
        }
        // No skipped candidate: every allowed session of an earlier tier than the last victim's
        // (or older in the same tier) was taken.
        if let Some(last) = p.victims.last() {
            let taken: HashSet<_> = p.victims.iter().map(|v| v.session).collect();
            for r in c.residents.iter().filter(|r| Some(r.session) != c.requester && r.tokens > 0) {
                let earlier_tier = match r.state {
                    ResidentState::Idle => Tier::Idle < last.tier,
                    ResidentState::Running if c.cfg.allow_cold && is_cold(&c, r) => {
                        Tier::Cold < last.tier
                    }
                    ResidentState::Running => false,
                };
                if earlier_tier {
                    prop_assert!(taken.contains(&r.session), "{} skipped", r.session);
                }
            }
        }
    }

    #[test]
    fn deterministic_whatever_the_input_order(c in case()) {
        let mut reversed = c.clone();
        reversed.residents.reverse();
        prop_assert_eq!(plan(&c), plan(&reversed));
    }
}
