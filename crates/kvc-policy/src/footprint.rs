//! Footprint estimate: the KV room a request needs on its decode (or colocated) worker.

/// Tokens a request needs on D.
///
/// - a first turn, or `incremental == false` (the reference baseline's naive estimate):
///   `input + output`;
/// - otherwise `max(0, input − cached_on_d) + output`, where `cached_on_d` is what the worker
///   already holds of this input (the session's KV for direct-to-D, the prefix cache when
///   colocated; 0 on a P→D path, where the whole context is shipped).
///
/// ```
/// use kvc_policy::footprint_tokens;
/// assert_eq!(footprint_tokens(60_000, 200, 0, true, true), 60_200);
/// assert_eq!(footprint_tokens(60_000, 200, 58_880, false, true), 1_320);
/// assert_eq!(footprint_tokens(60_000, 200, 58_880, false, false), 60_200);
/// ```
pub fn footprint_tokens(
    input_length: u64,
    output_hint: u64,
    cached_on_d: u64,
    first_turn: bool,
    incremental: bool,
) -> u64 {
    if first_turn || !incremental {
        input_length.saturating_add(output_hint)
    } else {
        kvc_core::prefix::uncached_tokens(input_length, cached_on_d).saturating_add(output_hint)
    }
}

#[cfg(test)]
mod tests {
    use super::footprint_tokens;

    #[test]
    fn footprint_table() {
        // (input, output, cached, first, incremental) -> need
        let cases = [
            ((1_000, 50, 0, true, true), 1_050),
            ((1_000, 50, 512, true, true), 1_050),
            ((1_000, 50, 512, false, true), 538),
            ((1_000, 50, 512, false, false), 1_050),
            ((1_000, 50, 4_096, false, true), 50),
            ((0, 0, 0, false, true), 0),
            ((u64::MAX, 5, 0, true, true), u64::MAX),
        ];
        for ((i, o, c, f, inc), want) in cases {
            assert_eq!(
                footprint_tokens(i, o, c, f, inc),
                want,
                "{i} {o} {c} {f} {inc}"
            );
        }
    }
}
