//! Nearest-rank percentiles: the one rank rule behind every percentile kvc reports.
//!
//! `pXX` of `n` sorted values is the value at 1-based rank `⌈XX·n/100⌉` (at least 1): the
//! smallest value with at least XX% of the values at or below it. It is always one of the
//! values (never an interpolation), so a p99 of latencies is a latency some request had.
//!
//! Quantiles are given in **permille** (per thousand, `0..=1000`; [`P50`] is 500) so the rank
//! is exact integer arithmetic: no float rounding decides which value is reported, whatever
//! the number of values.
//!
//! ```
//! use kvc_core::stats::{P50, P90, P99, percentile};
//!
//! let sorted: Vec<u64> = (1..=10).collect();
//! assert_eq!(percentile(&sorted, P50), Some(5));
//! assert_eq!(percentile(&sorted, P90), Some(9));
//! assert_eq!(percentile(&sorted, P99), Some(10));
//! assert_eq!(percentile::<u64>(&[], P50), None);
//! ```

/// The median, in permille.
pub const P50: u32 = 500;
/// The 90th percentile, in permille.
pub const P90: u32 = 900;
/// The 99th percentile, in permille.
pub const P99: u32 = 990;

/// The 1-based nearest rank of the `permille`‰ quantile among `len` sorted values:
/// `⌈permille·len/1000⌉`, at least 1 (`permille` above 1000 counts as 1000). `None` when there
/// are no values.
pub fn nearest_rank(len: usize, permille: u32) -> Option<usize> {
    if len == 0 {
        return None;
    }
    let rank = (u128::from(permille.min(1000)) * len as u128).div_ceil(1000);
    // rank ≤ len, which fits a usize.
    Some((rank as usize).max(1))
}

/// The `permille`‰ nearest-rank percentile of `sorted` (ascending; see [`nearest_rank`]).
/// `None` when `sorted` is empty.
pub fn percentile<T: Copy>(sorted: &[T], permille: u32) -> Option<T> {
    nearest_rank(sorted.len(), permille).map(|rank| sorted[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ranks_of_ten_values() {
        let v: Vec<u64> = (1..=10).collect();
        assert_eq!(percentile(&v, P50), Some(5));
        assert_eq!(percentile(&v, P90), Some(9));
        assert_eq!(percentile(&v, P99), Some(10));
        assert_eq!(percentile(&v, 100), Some(1));
        assert_eq!(percentile(&v, 0), Some(1), "p0 is the smallest value");
        assert_eq!(percentile(&v, 1000), Some(10));
        assert_eq!(
            percentile(&v, 5000),
            Some(10),
            "above 1000 is the largest value"
        );
        assert_eq!(percentile(&[7u64], P99), Some(7));
        assert_eq!(percentile::<u64>(&[], P50), None);
    }

    #[test]
    fn floats_and_a_hundred_values() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, P50), Some(50.0));
        assert_eq!(percentile(&v, P90), Some(90.0));
        assert_eq!(percentile(&v, P99), Some(99.0));
        assert_eq!(percentile(&v, 999), Some(100.0));
        assert_eq!(percentile(&v, 10), Some(1.0));
    }

    #[test]
    fn even_counts_take_the_lower_median() {
        assert_eq!(percentile(&[1, 2, 3, 4], P50), Some(2));
        assert_eq!(percentile(&[1, 2, 3], P50), Some(2));
        assert_eq!(percentile(&[1, 2], P50), Some(1));
    }

    #[test]
    fn ranks_are_exact_for_huge_counts() {
        // permille × len overflows 64 bits here; the rank is still exact.
        assert_eq!(nearest_rank(usize::MAX, 1000), Some(usize::MAX));
        assert_eq!(nearest_rank(1_000_000_000, P90), Some(900_000_000));
        assert_eq!(nearest_rank(1_000_000_001, P90), Some(900_000_001));
        assert_eq!(nearest_rank(0, P50), None);
    }

    proptest! {
        #[test]
        fn the_rank_is_the_smallest_covering_at_least_the_share(
            len in 1usize..5000,
            permille in 0u32..=1000,
        ) {
            let rank = nearest_rank(len, permille).unwrap();
            prop_assert!((1..=len).contains(&rank));
            // At least permille‰ of the values are at or below the rank …
            prop_assert!(rank as u64 * 1000 >= u64::from(permille) * len as u64);
            // … and one rank less would not be enough (unless the rank is already the first).
            prop_assert!(rank == 1 || (rank as u64 - 1) * 1000 < u64::from(permille) * len as u64);
        }

        #[test]
        fn a_higher_quantile_never_gives_a_smaller_value(
            mut v in proptest::collection::vec(0u64..1000, 1..200),
            a in 0u32..=1000,
            b in 0u32..=1000,
        ) {
            v.sort_unstable();
            let (lo, hi) = (a.min(b), a.max(b));
            prop_assert!(percentile(&v, lo) <= percentile(&v, hi));
        }
    }
}
