//! A circuit breaker per worker: consecutive forwarding failures open it for a cool-down
//! (during which the worker is out of rotation), then one trial request decides.

use crate::RouterService;
use dashmap::DashMap;
use kvc_core::WorkerId;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use kvc_core::BreakerState;

/// Settings of the circuit breakers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerOptions {
    /// Consecutive failures (connect error, timeout, 5xx, broken stream, failed health check)
    /// that open a worker's breaker; 0 disables the breakers. Default 3.
    pub failure_threshold: u32,
    /// Cool-down of the first opening; it doubles with every re-opening from half-open, up to
    /// `max_cooldown`, and each is shortened by a random jitter of up to a quarter. Default
    /// 1 s.
    pub cooldown: Duration,
    /// Longest cool-down. Default 30 s.
    pub max_cooldown: Duration,
}

impl Default for BreakerOptions {
    fn default() -> Self {
        BreakerOptions {
            failure_threshold: 3,
            cooldown: Duration::from_secs(1),
            max_cooldown: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Breaker {
    state: BreakerState,
    failures: u32,
    /// Openings since the breaker was last closed (the cool-down doubles with each).
    trips: u32,
    /// End of the cool-down (router clock, ms) while open.
    until_ms: u64,
    /// Half-open: the trial request has been sent.
    trial_sent: bool,
    /// When the trial was sent (router clock, ms).
    trial_ms: u64,
    /// When a request to the worker last succeeded (router clock, ms; 0: never).
    last_success_ms: u64,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: BreakerState::Closed,
            failures: 0,
            trips: 0,
            until_ms: 0,
            trial_sent: false,
            trial_ms: 0,
            last_success_ms: 0,
        }
    }
}

/// Every worker's breaker. Time is the router's clock; state changes are applied to the
/// router (out of rotation while open or while a half-open trial runs) and its metrics.
pub(crate) struct Breakers {
    options: BreakerOptions,
    /// A trial without a result after this long failed (its request was abandoned).
    trial_timeout_ms: u64,
    /// Each worker's breaker, locked per worker (every forwarded call touches its workers'
    /// entries; calls to different workers do not wait for each other).
    table: DashMap<WorkerId, Breaker>,
    random: std::collections::hash_map::RandomState,
    counter: AtomicU64,
}

impl Breakers {
    /// Breakers whose half-open trial fails when it has no result after `trial_timeout`.
    pub(crate) fn new(options: BreakerOptions, trial_timeout: Duration) -> Self {
        Breakers {
            options,
            trial_timeout_ms: trial_timeout.as_millis() as u64,
            table: DashMap::new(),
            random: std::collections::hash_map::RandomState::new(),
            counter: AtomicU64::new(0),
        }
    }

    /// A uniform random number in `[0, 1)`.
    pub(crate) fn unit(&self) -> f64 {
        let mut h = self.random.build_hasher();
        h.write_u64(self.counter.fetch_add(1, Ordering::Relaxed));
        (h.finish() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn enabled(&self) -> bool {
        self.options.failure_threshold > 0
    }

    /// The jittered cool-down of the `trips`-th opening.
    fn cooldown_ms(&self, trips: u32) -> u64 {
        let base = self.options.cooldown.as_millis() as u64;
        let cap = (self.options.max_cooldown.as_millis() as u64).max(base);
        let doubled = base
            .saturating_mul(1u64 << trips.saturating_sub(1).min(32))
            .min(cap);
        doubled - (doubled as f64 * 0.25 * self.unit()) as u64
    }

    fn apply(service: &RouterService, worker: WorkerId, b: &Breaker) {
        let down = match b.state {
            BreakerState::Closed => false,
            BreakerState::Open => true,
            BreakerState::HalfOpen => b.trial_sent,
        };
        service.set_http_down(worker, down);
        service.metrics().record_breaker_state(worker, b.state);
    }

    fn open(&self, b: &mut Breaker, now_ms: u64) {
        b.trips = b.trips.saturating_add(1);
        b.state = BreakerState::Open;
        b.failures = 0;
        b.trial_sent = false;
        b.until_ms = now_ms.saturating_add(self.cooldown_ms(b.trips));
    }

    /// A request to `worker` succeeded: the breaker closes.
    pub(crate) fn on_success(&self, service: &RouterService, worker: WorkerId) {
        if !self.enabled() {
            return;
        }
        let mut b = self.table.entry(worker).or_default();
        *b = Breaker {
            last_success_ms: service.now_ms(),
            ..Breaker::default()
        };
        Self::apply(service, worker, &b);
    }

    /// A health check of `worker` sent at `sent_ms` failed at `now_ms`: a failure
    /// ([`Breakers::on_failure`]) unless a request to the worker succeeded since the check was
    /// sent — a worker answering requests is up, however late its `/health` (a CPU engine's
    /// API server answers it late while a long prefill or a KV transfer holds it). Returns
    /// whether it counted.
    pub(crate) fn on_check_failed(
        &self,
        service: &RouterService,
        worker: WorkerId,
        sent_ms: u64,
        now_ms: u64,
    ) -> bool {
        if self
            .table
            .get(&worker)
            .is_some_and(|b| b.last_success_ms >= sent_ms && b.last_success_ms > 0)
        {
            return false;
        }
        self.on_failure(service, worker, now_ms);
        true
    }

    /// A health check found `worker` up: a half-open breaker (cool-down over) closes; an open
    /// one waits for its cool-down; a closed one keeps its failure count (requests may fail
    /// while `/health` answers).
    pub(crate) fn on_recovered(&self, service: &RouterService, worker: WorkerId) {
        if !self.enabled() {
            return;
        }
        let mut b = self.table.entry(worker).or_default();
        if b.state == BreakerState::HalfOpen {
            *b = Breaker::default();
            tracing::info!(worker = worker.0, "circuit closed by a health check");
        }
        Self::apply(service, worker, &b);
    }

    /// A request or health check of `worker` failed at `now_ms`.
    pub(crate) fn on_failure(&self, service: &RouterService, worker: WorkerId, now_ms: u64) {
        if !self.enabled() {
            return;
        }
        let mut entry = self.table.entry(worker).or_default();
        let b = entry.value_mut();
        match b.state {
            BreakerState::Closed => {
                b.failures = b.failures.saturating_add(1);
                if b.failures >= self.options.failure_threshold {
                    self.open(b, now_ms);
                    tracing::warn!(worker = worker.0, until_ms = b.until_ms, "circuit opened");
                }
            }
            BreakerState::HalfOpen => {
                self.open(b, now_ms);
                tracing::warn!(
                    worker = worker.0,
                    until_ms = b.until_ms,
                    "circuit re-opened"
                );
            }
            // A request sent before the breaker opened: the cool-down stands.
            BreakerState::Open => {}
        }
        Self::apply(service, worker, b);
    }

    /// A request is being sent to `worker`: a half-open worker's first one is its trial, and
    /// the worker leaves rotation until the trial's result is known.
    pub(crate) fn on_dispatch(&self, service: &RouterService, worker: WorkerId, now_ms: u64) {
        if !self.enabled() {
            return;
        }
        if let Some(mut b) = self.table.get_mut(&worker)
            && b.state == BreakerState::HalfOpen
            && !b.trial_sent
        {
            b.trial_sent = true;
            b.trial_ms = now_ms;
            Self::apply(service, worker, &b);
        }
    }

    /// A request sent to `worker` was dropped before its answer, for another worker's failure:
    /// nothing is learnt about `worker`, so a half-open breaker whose trial it was gets a new
    /// trial (back in rotation) instead of waiting for the trial timeout.
    pub(crate) fn on_abandoned(&self, service: &RouterService, worker: WorkerId) {
        if !self.enabled() {
            return;
        }
        if let Some(mut b) = self.table.get_mut(&worker)
            && b.state == BreakerState::HalfOpen
            && b.trial_sent
        {
            b.trial_sent = false;
            Self::apply(service, worker, &b);
        }
    }

    /// Moves every open breaker whose cool-down has ended at `now_ms` to half-open, and
    /// re-opens every half-open one whose trial has had no result within the trial timeout.
    pub(crate) fn tick(&self, service: &RouterService, now_ms: u64) {
        if !self.enabled() {
            return;
        }
        for mut entry in self.table.iter_mut() {
            let (worker, b) = entry.pair_mut();
            if b.state == BreakerState::Open && now_ms >= b.until_ms {
                b.state = BreakerState::HalfOpen;
                b.trial_sent = false;
                Self::apply(service, *worker, b);
            } else if b.state == BreakerState::HalfOpen
                && b.trial_sent
                && now_ms >= b.trial_ms.saturating_add(self.trial_timeout_ms)
            {
                self.open(b, now_ms);
                Self::apply(service, *worker, b);
            }
        }
    }

    /// `worker`'s state (closed when never used).
    pub(crate) fn state(&self, worker: WorkerId) -> BreakerState {
        self.table
            .get(&worker)
            .map_or(BreakerState::Closed, |b| b.state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RouterConfig, WorkerConfig};
    use kvc_admission::ManualClock;
    use kvc_core::WorkerRole;
    use std::sync::Arc;

    fn service() -> RouterService {
        service_at(Arc::new(ManualClock::new(0)))
    }

    /// A prefill and a decode worker (ids 0, 1) on `clock`.
    fn service_at(clock: Arc<ManualClock>) -> RouterService {
        let mut config = RouterConfig::default();
        for (id, role) in [(0, WorkerRole::Prefill), (1, WorkerRole::Decode)] {
            let mut w = WorkerConfig::new(id, role, 100);
            w.address = Some(format!("http://127.0.0.1:{}", id + 1));
            config.workers.push(w);
        }
        RouterService::with_clock(config, clock).unwrap()
    }

    /// Breakers opening after `threshold` failures, cooling down from `cooldown_ms` up to
    /// `max_cooldown_ms`, with half a second for a trial.
    fn breakers(threshold: u32, cooldown_ms: u64, max_cooldown_ms: u64) -> Breakers {
        Breakers::new(
            BreakerOptions {
                failure_threshold: threshold,
                cooldown: Duration::from_millis(cooldown_ms),
                max_cooldown: Duration::from_millis(max_cooldown_ms),
            },
            Duration::from_millis(500),
        )
    }

    /// The breaker transitions counted into open, half-open and closed.
    fn transitions(svc: &RouterService) -> [u64; 3] {
        let m = svc.metrics();
        [
            BreakerState::Open,
            BreakerState::HalfOpen,
            BreakerState::Closed,
        ]
        .map(|s| m.breaker_transitions(s))
    }

    #[test]
    fn a_health_check_that_failed_while_requests_succeeded_does_not_count() {
        let clock = Arc::new(ManualClock::new(1_000));
        let svc = service_at(clock.clone());
        let (w, b) = (WorkerId(1), breakers(3, 1_000, 4_000));
        // Three checks sent at 1 s, 11 s and 21 s each time out 10 s later; a request the
        // worker was serving all along is answered at 30.5 s, before the third check fails.
        clock.set(11_000);
        assert!(b.on_check_failed(&svc, w, 1_000, 11_000));
        clock.set(21_000);
        assert!(b.on_check_failed(&svc, w, 11_000, 21_000));
        clock.set(30_500);
        b.on_success(&svc, w);
        clock.set(31_000);
        assert!(
            !b.on_check_failed(&svc, w, 21_000, 31_000),
            "the worker answered since"
        );
        assert_eq!(b.state(w), BreakerState::Closed);
        assert!(!svc.is_http_down(w));
        // Checks sent after that success count again: three in a row open the breaker.
        for sent in [31_000, 41_000, 51_000] {
            clock.set(sent + 10_000);
            assert!(b.on_check_failed(&svc, w, sent, sent + 10_000));
        }
        assert_eq!(b.state(w), BreakerState::Open);
        assert!(svc.is_http_down(w));
    }

    #[test]
    fn opens_after_the_threshold_then_half_opens_and_closes_on_success() {
        let svc = service();
        let w = WorkerId(1);
        let b = breakers(3, 1_000, 4_000);
        b.on_failure(&svc, w, 0);
        b.on_failure(&svc, w, 0);
        b.on_success(&svc, w);
        b.on_failure(&svc, w, 0);
        b.on_failure(&svc, w, 0);
        assert_eq!(
            b.state(w),
            BreakerState::Closed,
            "a success resets the count"
        );
        assert!(!svc.is_http_down(w));
        b.on_failure(&svc, w, 100);
        assert_eq!(b.state(w), BreakerState::Open);
        assert!(svc.is_http_down(w));
        assert!(!svc.is_http_down(WorkerId(0)));
        let until = b.table.get(&w).unwrap().until_ms;
        assert!((100 + 750..=100 + 1_000).contains(&until), "{until}");
        b.tick(&svc, until - 1);
        assert_eq!(b.state(w), BreakerState::Open);
        b.tick(&svc, until);
        assert_eq!(b.state(w), BreakerState::HalfOpen);
        assert!(!svc.is_http_down(w), "back in rotation for the trial");
        b.on_dispatch(&svc, w, until);
        assert!(svc.is_http_down(w), "one trial at a time");
        b.on_success(&svc, w);
        assert_eq!(b.state(w), BreakerState::Closed);
        assert!(!svc.is_http_down(w));
        assert_eq!(transitions(&svc), [1, 1, 1]);
        assert_eq!(svc.metrics().breaker_state(w), Some(BreakerState::Closed));
    }

    #[test]
    fn an_abandoned_trial_reopens_the_breaker() {
        let svc = service();
        let w = WorkerId(0);
        let b = breakers(1, 100, 100);
        b.on_failure(&svc, w, 0);
        b.tick(&svc, 100);
        assert_eq!(b.state(w), BreakerState::HalfOpen);
        b.on_dispatch(&svc, w, 100);
        b.tick(&svc, 599);
        assert_eq!(b.state(w), BreakerState::HalfOpen);
        assert!(svc.is_http_down(w));
        b.tick(&svc, 600);
        assert_eq!(b.state(w), BreakerState::Open);
        assert!(svc.is_http_down(w));
        assert_eq!(transitions(&svc), [2, 1, 0]);
        assert_eq!(svc.metrics().breaker_state(w), Some(BreakerState::Open));
    }

    #[test]
    fn a_trial_dropped_for_another_worker_waits_for_a_new_trial() {
        let svc = service();
        let w = WorkerId(0);
        let b = breakers(1, 100, 100);
        // Closed or open breakers are not affected.
        b.on_abandoned(&svc, w);
        assert_eq!(b.state(w), BreakerState::Closed);
        b.on_failure(&svc, w, 0);
        b.on_abandoned(&svc, w);
        assert_eq!(b.state(w), BreakerState::Open);
        assert!(svc.is_http_down(w));
        b.tick(&svc, 100);
        b.on_dispatch(&svc, w, 100);
        assert!(svc.is_http_down(w), "the trial runs");
        b.on_abandoned(&svc, w);
        assert_eq!(b.state(w), BreakerState::HalfOpen);
        assert!(!svc.is_http_down(w), "back in rotation for another trial");
        // No trial timeout runs for the dropped one.
        b.tick(&svc, 10_000);
        assert_eq!(b.state(w), BreakerState::HalfOpen);
        b.on_dispatch(&svc, w, 10_000);
        assert!(svc.is_http_down(w));
        b.on_success(&svc, w);
        assert_eq!(b.state(w), BreakerState::Closed);
    }

    #[test]
    fn a_failed_trial_reopens_with_a_doubled_capped_cooldown() {
        let svc = service();
        let w = WorkerId(0);
        let b = breakers(1, 1_000, 3_000);
        let mut now = 0;
        let mut cooldowns = Vec::new();
        for _ in 0..4 {
            b.on_failure(&svc, w, now);
            assert_eq!(b.state(w), BreakerState::Open);
            let until = b.table.get(&w).unwrap().until_ms;
            cooldowns.push(until - now);
            now = until;
            b.tick(&svc, now);
            assert_eq!(b.state(w), BreakerState::HalfOpen);
        }
        let bounds = [(750, 1_000), (1_500, 2_000), (2_250, 3_000), (2_250, 3_000)];
        for (c, (lo, hi)) in cooldowns.iter().zip(bounds) {
            assert!((lo..=hi).contains(c), "{cooldowns:?}");
        }
        // Failures while open do not extend the cool-down.
        b.on_failure(&svc, w, now);
        let until = b.table.get(&w).unwrap().until_ms;
        b.on_failure(&svc, w, now + 10);
        assert_eq!(b.table.get(&w).unwrap().until_ms, until);
    }

    #[test]
    fn a_zero_threshold_disables_the_breaker() {
        let svc = service();
        let b = Breakers::new(
            BreakerOptions {
                failure_threshold: 0,
                ..BreakerOptions::default()
            },
            Duration::from_millis(500),
        );
        for _ in 0..10 {
            b.on_failure(&svc, WorkerId(0), 0);
        }
        assert_eq!(b.state(WorkerId(0)), BreakerState::Closed);
        assert!(!svc.is_http_down(WorkerId(0)));
        assert_eq!(svc.metrics().breaker_state(WorkerId(0)), None);
    }

    #[test]
    fn jitter_is_uniform_enough() {
        let b = Breakers::new(BreakerOptions::default(), Duration::from_secs(1));
        let xs: Vec<f64> = (0..1_000).map(|_| b.unit()).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((0.4..0.6).contains(&mean), "{mean}");
    }
}
