//! The backpressure hint shared by probe answers and busy commit replies.

/// Pause added per queued request or command, in milliseconds.
pub const PAUSE_PER_QUEUED_MS: u64 = 5;

/// Used fraction of the pool above which memory pressure adds to the pause.
pub const PRESSURE_START_FRACTION: f64 = 0.85;

/// Pause added by a completely full pool, in milliseconds (reached linearly from
/// [`PRESSURE_START_FRACTION`]).
pub const PRESSURE_PAUSE_MS: f64 = 250.0;

/// The largest pause ever recommended, in milliseconds.
pub const MAX_PAUSE_MS: u32 = 1_000;

/// How long a client should hold back its next request to a worker, in milliseconds.
///
/// ```text
/// pressure = clamp((used_fraction - PRESSURE_START_FRACTION) / (1 - PRESSURE_START_FRACTION), 0, 1)
/// pause    = min(MAX_PAUSE_MS, PAUSE_PER_QUEUED_MS * queue_depth + round(PRESSURE_PAUSE_MS * pressure))
///          = min(1000, 5 * queue_depth + round(250 * pressure))
/// ```
///
/// An empty queue on a pool at most 85% used gives 0. A used fraction that is not a number
/// counts as a full pool (fail closed). The same function answers a probe (with the worker's
/// queue depth and used fraction) and a busy commit queue (with the queue's capacity and the
/// used fraction its owner last reported).
///
/// ```
/// use kvc_admission::recommended_pause_ms;
///
/// assert_eq!(recommended_pause_ms(0, 0.5), 0);
/// assert_eq!(recommended_pause_ms(4, 0.5), 20);
/// assert_eq!(recommended_pause_ms(0, 1.0), 250);
/// assert_eq!(recommended_pause_ms(10_000, 0.0), 1_000);
/// ```
pub fn recommended_pause_ms(queue_depth: u64, used_fraction: f64) -> u32 {
    let used = if used_fraction.is_nan() {
        1.0
    } else {
        used_fraction
    };
    let pressure =
        ((used - PRESSURE_START_FRACTION) / (1.0 - PRESSURE_START_FRACTION)).clamp(0.0, 1.0);
    // Both terms are bounded before the sum: the queue term saturates, the pressure term
    // is at most PRESSURE_PAUSE_MS.
    let queue_ms = queue_depth.saturating_mul(PAUSE_PER_QUEUED_MS);
    let pressure_ms = (PRESSURE_PAUSE_MS * pressure).round() as u64;
    let total = queue_ms.saturating_add(pressure_ms);
    u32::try_from(total.min(u64::from(MAX_PAUSE_MS))).unwrap_or(MAX_PAUSE_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_without_queue_or_pressure() {
        assert_eq!(recommended_pause_ms(0, 0.0), 0);
        assert_eq!(recommended_pause_ms(0, PRESSURE_START_FRACTION), 0);
    }

    #[test]
    fn queue_term_is_linear_then_capped() {
        assert_eq!(recommended_pause_ms(1, 0.0), 5);
        assert_eq!(recommended_pause_ms(7, 0.0), 35);
        assert_eq!(recommended_pause_ms(200, 0.0), 1_000);
        assert_eq!(recommended_pause_ms(u64::MAX, 0.0), MAX_PAUSE_MS);
    }

    #[test]
    fn pressure_term_ramps_from_start_fraction() {
        // Halfway between 0.85 and 1.0.
        assert_eq!(recommended_pause_ms(0, 0.925), 125);
        assert_eq!(recommended_pause_ms(0, 1.0), 250);
        assert_eq!(recommended_pause_ms(0, 3.0), 250);
        assert_eq!(recommended_pause_ms(0, -1.0), 0);
        assert_eq!(recommended_pause_ms(2, 1.0), 260);
    }

    #[test]
    fn nan_fails_closed() {
        assert_eq!(recommended_pause_ms(0, f64::NAN), 250);
    }

    #[test]
    fn monotone_in_both_arguments() {
        let mut last = 0;
        for q in 0..300 {
            let p = recommended_pause_ms(q, 0.9);
            assert!(p >= last);
            last = p;
        }
        let mut last = 0;
        for i in 0..=100 {
            let p = recommended_pause_ms(3, f64::from(i) / 100.0);
            assert!(p >= last);
            last = p;
        }
    }
}
