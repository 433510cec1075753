//! Backpressure hint: how long the client should pause before its next request.

use kvc_core::WorkerState;
use serde::{Deserialize, Serialize};

/// The backpressure hint: the pause a client is advised to take before its request to a busy
/// worker ([`recommended_pause_ms`]). `max-pause-ms = 0` disables the hint.
///
/// | field | default (enabled) | meaning |
/// |---|---:|---|
/// | `queue-free` | 4 | queued requests that cost nothing |
/// | `used-free` | 0.80 | used fraction that costs nothing |
/// | `ms-per-queued` | 25 | pause per queued request beyond `queue-free` |
/// | `ms-at-full` | 500 | pause when the pool is 100% used (linear from `used-free`) |
/// | `kv-wait-free-ms` | 8,000 | how long the oldest P→D request into the worker may wait for its KV at no cost; each ms beyond adds one ms of pause (0 turns this term off) |
/// | `max-pause-ms` | 2,000 | upper bound; 0 disables |
///
/// The KV-wait term sees what precedes a transfer timeout: a decode worker whose prealloc
/// queue does not move (its pool pinned by requests in flight, a large transfer at the head
/// of its in-order queue, a retracted request holding admissions back) or whose P is held up
/// sending to it shows neither a long queue nor a full pool, but its oldest P→D request
/// stops getting its first token. 8 s is a quarter of the reference deployment's 32 s
/// transfer timeout and above the first-token time of nearly every P→D request where no
/// transfer fails (`docs/kvc-policy.md`, "Backpressure").
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct BackpressureConfig {
    /// Queue depth below or at which the queue adds no pause.
    pub queue_free: u32,
    /// Used fraction below or at which use adds no pause.
    pub used_free: f64,
    /// Milliseconds per queued request beyond `queue-free`.
    pub ms_per_queued: u32,
    /// Milliseconds at a full pool.
    pub ms_at_full: u32,
    /// Wait (ms) of the worker's oldest P→D request for its KV below or at which the wait
    /// adds no pause; 0 turns the term off.
    pub kv_wait_free_ms: u64,
    /// Cap on the pause; 0 turns the hint off.
    pub max_pause_ms: u32,
}

impl BackpressureConfig {
    /// The hint turned off (always 0).
    pub const DISABLED: BackpressureConfig = BackpressureConfig {
        queue_free: 4,
        used_free: 0.80,
        ms_per_queued: 25,
        ms_at_full: 500,
        kv_wait_free_ms: 8_000,
        max_pause_ms: 0,
    };

    /// The documented defaults, enabled.
    pub const ENABLED: BackpressureConfig = BackpressureConfig {
        max_pause_ms: 2_000,
        ..BackpressureConfig::DISABLED
    };

    /// Whether the hint is on.
    pub fn is_enabled(&self) -> bool {
        self.max_pause_ms > 0
    }
}

impl Default for BackpressureConfig {
    fn default() -> Self {
        BackpressureConfig::ENABLED
    }
}

/// The pause a client should take before its request, from the chosen worker's state and
/// `kv_wait_ms`, how long the oldest P→D request the router sent that worker has been waiting
/// for its KV to arrive there ([`crate::RouterState::oldest_kv_wait_ms`]):
///
/// ```text
/// queue_excess = max(0, queue_depth − queue_free)
/// use_excess   = clamp((committed_fraction − used_free) / (1 − used_free), 0, 1)
/// wait_excess  = max(0, kv_wait_ms − kv_wait_free_ms)      (0 when kv_wait_free_ms = 0)
/// pause        = min(max_pause_ms, ms_per_queued × queue_excess + ms_at_full × use_excess
///                                  + wait_excess)
/// ```
///
/// 0 for a light worker; grows with queueing, with use above `used_free` and with a KV
/// wait past `kv_wait_free_ms`.
///
/// ```
/// use kvc_core::WorkerState;
/// use kvc_policy::{recommended_pause_ms, BackpressureConfig};
/// let cfg = BackpressureConfig::ENABLED;
/// let mut s = WorkerState::empty(100_000);
/// assert_eq!(recommended_pause_ms(&s, 0, &cfg), 0);
/// s.queue_depth = 10;          // 6 over the free 4: 150 ms
/// s.used_tokens = 90_000;      // halfway from 80% to 100%: 250 ms
/// assert_eq!(recommended_pause_ms(&s, 0, &cfg), 400);
/// // Its oldest P→D request has waited 8.3 s for its KV, 300 ms past the free 8 s.
/// assert_eq!(recommended_pause_ms(&s, 8_300, &cfg), 700);
/// ```
pub fn recommended_pause_ms(state: &WorkerState, kv_wait_ms: u64, cfg: &BackpressureConfig) -> u32 {
    if !cfg.is_enabled() {
        return 0;
    }
    let queue_excess = state.queue_depth.saturating_sub(cfg.queue_free);
    let queue_ms = u64::from(cfg.ms_per_queued) * u64::from(queue_excess);
    let use_excess = if cfg.used_free >= 1.0 {
        0.0
    } else {
        ((state.committed_fraction() - cfg.used_free) / (1.0 - cfg.used_free)).clamp(0.0, 1.0)
    };
    // Rounded to the nearest millisecond, so exact fractions give exact figures.
    let use_ms = (f64::from(cfg.ms_at_full) * use_excess).round() as u64;
    let wait_ms = if cfg.kv_wait_free_ms == 0 {
        0
    } else {
        kv_wait_ms.saturating_sub(cfg.kv_wait_free_ms)
    };
    queue_ms
        .saturating_add(use_ms)
        .saturating_add(wait_ms)
        .min(u64::from(cfg.max_pause_ms)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(queue: u32, used: u64) -> WorkerState {
        let mut s = WorkerState::empty(1_000);
        s.queue_depth = queue;
        s.used_tokens = used;
        s
    }

    #[test]
    fn pause_table() {
        let on = BackpressureConfig::ENABLED;
        // (queue, used of 1,000) -> ms
        for ((q, u), want) in [
            ((0, 0), 0),
            ((4, 800), 0),
            ((5, 800), 25),
            ((4, 900), 250),
            ((4, 1_000), 500),
            ((4, 5_000), 500),
            ((12, 950), 200 + 375),
            ((200, 1_000), 2_000),
        ] {
            assert_eq!(
                recommended_pause_ms(&state(q, u), 0, &on),
                want,
                "q={q} u={u}"
            );
        }
        assert_eq!(
            recommended_pause_ms(&state(200, 1_000), 60_000, &BackpressureConfig::DISABLED),
            0
        );
        let flat = BackpressureConfig {
            used_free: 1.0,
            ..on
        };
        assert_eq!(recommended_pause_ms(&state(0, 1_000), 0, &flat), 0);
    }

    #[test]
    fn pause_grows_with_pressure() {
        let on = BackpressureConfig::ENABLED;
        let mut last = 0;
        for step in 0..=20u32 {
            let p = recommended_pause_ms(
                &state(step, u64::from(step) * 50),
                u64::from(step) * 500,
                &on,
            );
            assert!(p >= last, "pause fell at step {step}: {p} < {last}");
            last = p;
        }
        assert!(last > 0);
    }

    #[test]
    fn a_long_kv_wait_asks_for_a_pause() {
        let on = BackpressureConfig::ENABLED;
        // A quiet worker (short queue, pool far from full) whose oldest P→D request waits.
        for (wait, want) in [
            (0, 0),
            (8_000, 0),
            (8_001, 1),
            (9_250, 1_250),
            (31_000, 2_000),
        ] {
            assert_eq!(
                recommended_pause_ms(&state(1, 300), wait, &on),
                want,
                "wait {wait}"
            );
        }
        // The wait adds to the queue and use terms, under the same cap.
        assert_eq!(
            recommended_pause_ms(&state(6, 900), 8_500, &on),
            50 + 250 + 500
        );
        let off = BackpressureConfig {
            kv_wait_free_ms: 0,
            ..on
        };
        assert_eq!(recommended_pause_ms(&state(1, 300), 31_000, &off), 0);
    }
}
