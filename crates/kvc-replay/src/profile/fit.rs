//! The arithmetic of `kvc-replay profile`: straight lines fitted by least squares and their
//! residuals, the work of each point, the decode step read off streamed tokens, the transfer
//! read off D's first token, and the profile's factors from the fitted lines. Pure: no I/O.
//!
//! Work is counted with the profile's own formulas ([`prefill_flops`], [`decode_bytes`],
//! [`Profile::kv_bytes_per_token`]), so the fitted factors mean in the simulator exactly what
//! they meant in the fit.

use super::ProfileError;
use kvc_engine_sim::model::Profile;
use serde::Serialize;

/// A straight line `t = intercept + slope × x` fitted by least squares on the relative
/// errors, with the standard errors of its coefficients (from the residuals' variance).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Line {
    /// Where the line meets `x = 0`.
    pub intercept: f64,
    /// Its slope.
    pub slope: f64,
    /// Standard error of the intercept (0 when it was fixed at 0).
    pub intercept_se: f64,
    /// Standard error of the slope.
    pub slope_se: f64,
    /// The intercept was fixed at 0 (a free fit put it below 0).
    pub through_origin: bool,
}

impl Line {
    /// The line's value at `x`.
    pub fn at(&self, x: f64) -> f64 {
        self.intercept + self.slope * x
    }
}

/// Fewest points a sweep's fit accepts.
pub const MIN_POINTS: usize = 3;

/// Each point's weight: `1 / t²`, so that the fit minimises the squared *relative* errors
/// (as the residuals are reported and judged). Unweighted, the largest points set the line
/// and the short ones, a coding agent's usual turn (a few hundred new tokens), came out up
/// to 40% off on a CPU engine.
fn weight(t: f64) -> f64 {
    1.0 / (t * t)
}

/// Least squares over `(x, t)` points, on the relative errors (each point weighted by
/// `1 / t²`); `None` with fewer than [`MIN_POINTS`] points or fewer than two distinct `x`.
pub fn least_squares(points: &[(f64, f64)]) -> Option<Line> {
    let n = points.len();
    if n < MIN_POINTS {
        return None;
    }
    let w: Vec<f64> = points.iter().map(|p| weight(p.1)).collect();
    let sw: f64 = w.iter().sum();
    let mx = points.iter().zip(&w).map(|(p, w)| w * p.0).sum::<f64>() / sw;
    let mt = points.iter().zip(&w).map(|(p, w)| w * p.1).sum::<f64>() / sw;
    let sxx: f64 = points
        .iter()
        .zip(&w)
        .map(|(p, w)| w * (p.0 - mx).powi(2))
        .sum();
    let sxt: f64 = points
        .iter()
        .zip(&w)
        .map(|(p, w)| w * (p.0 - mx) * (p.1 - mt))
        .sum();
    if !(sxx > 0.0 && sxx.is_finite()) {
        return None;
    }
    let slope = sxt / sxx;
    let intercept = mt - slope * mx;
    let ssr: f64 = points
        .iter()
        .zip(&w)
        .map(|(p, w)| w * (p.1 - intercept - slope * p.0).powi(2))
        .sum();
    // The relative errors' variance: each point's own variance is that times t².
    let var = ssr / (n as f64 - 2.0);
    Some(Line {
        intercept,
        slope,
        intercept_se: (var * (1.0 / sw + mx * mx / sxx)).sqrt(),
        slope_se: (var / sxx).sqrt(),
        through_origin: false,
    })
}

/// Least squares of `t = slope × x` (the intercept fixed at 0), on the relative errors.
pub fn least_squares_through_origin(points: &[(f64, f64)]) -> Option<Line> {
    let n = points.len();
    let sxx: f64 = points.iter().map(|p| weight(p.1) * p.0 * p.0).sum();
    if n < 2 || !(sxx > 0.0 && sxx.is_finite()) {
        return None;
    }
    let slope = points.iter().map(|p| weight(p.1) * p.0 * p.1).sum::<f64>() / sxx;
    let ssr: f64 = points
        .iter()
        .map(|p| weight(p.1) * (p.1 - slope * p.0).powi(2))
        .sum();
    Some(Line {
        intercept: 0.0,
        slope,
        intercept_se: 0.0,
        slope_se: (ssr / (n as f64 - 1.0) / sxx).sqrt(),
        through_origin: true,
    })
}

/// How far a fit's times are from the measured ones: the relative error of the fitted time,
/// `(fitted − measured) / measured`, over the points used.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Residuals {
    /// Points the fit used.
    pub points: usize,
    /// Root mean square of the relative errors.
    pub rms_rel: f64,
    /// Largest relative error, in magnitude.
    pub max_rel: f64,
}

/// The relative error of `fitted` against `measured`.
pub fn relative(fitted: f64, measured: f64) -> f64 {
    (fitted - measured) / measured
}

/// A sweep's line and how well it fits.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepFit {
    /// The line through the points.
    pub line: Line,
    /// Its residuals.
    pub residuals: Residuals,
    /// What the fit had to do that the user should know.
    pub warnings: Vec<String>,
}

/// Fits `t = intercept + slope × x` to one sweep's points (`x` the work, `t` seconds). The
/// slope must be positive (time grows with work); a negative intercept is clamped to 0 and the
/// slope fitted again through the origin, with a warning.
pub fn fit_sweep(sweep: &'static str, points: &[(f64, f64)]) -> Result<SweepFit, ProfileError> {
    let usable: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, t)| x.is_finite() && t.is_finite() && *t > 0.0)
        .collect();
    let distinct = {
        let mut xs: Vec<f64> = usable.iter().map(|p| p.0).collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        xs.len()
    };
    let too_few = ProfileError::TooFewPoints {
        sweep,
        usable: usable.len(),
        needed: MIN_POINTS,
    };
    if distinct < 2 {
        return Err(too_few);
    }
    let mut line = least_squares(&usable).ok_or(too_few)?;
    let mut warnings = Vec::new();
    if usable.len() < points.len() {
        warnings.push(format!(
            "{sweep}: {} of {} points left out of the fit (no positive time: the corrections \
             took more than was measured)",
            points.len() - usable.len(),
            points.len()
        ));
    }
    if line.slope.is_nan() || line.slope <= 0.0 {
        return Err(ProfileError::Unfittable {
            sweep,
            message: format!(
                "the measured time does not grow with the work (slope {:.3e} s per unit); the \
                 sizes may be too small to see past the noise: raise --max-context",
                line.slope
            ),
        });
    }
    if line.intercept < 0.0 {
        warnings.push(format!(
            "{sweep}: the fitted fixed cost was {:.2} ms, below 0: clamped to 0 and the slope \
             fitted again through the origin",
            line.intercept * 1e3
        ));
        line = least_squares_through_origin(&usable).ok_or(ProfileError::TooFewPoints {
            sweep,
            usable: usable.len(),
            needed: MIN_POINTS,
        })?;
    }
    let rel: Vec<f64> = usable
        .iter()
        .map(|&(x, t)| relative(line.at(x), t))
        .collect();
    let residuals = Residuals {
        points: usable.len(),
        rms_rel: (rel.iter().map(|r| r * r).sum::<f64>() / rel.len() as f64).sqrt(),
        max_rel: rel.iter().fold(0.0_f64, |m, r| m.max(r.abs())),
    };
    Ok(SweepFit {
        line,
        residuals,
        warnings,
    })
}

/// The facts of `facts` with the fitted factors at 1 and the fixed costs at 0, and peak and
/// bandwidth at 1: its prefill seconds are FLOPs, its decode seconds bytes.
fn unit_profile(facts: &Profile) -> Profile {
    let mut p = facts.clone();
    p.hardware.peak_flops = 1.0;
    p.hardware.hbm_bytes_per_s = 1.0;
    p.fit.prefill_efficiency = 1.0;
    p.fit.prefill_overhead_ms = 0.0;
    p.fit.decode_efficiency = 1.0;
    p.fit.decode_overhead_ms = 0.0;
    p
}

/// FLOPs of prefilling `new` tokens after `cached` ones, by the profile's formula.
pub fn prefill_flops(facts: &Profile, new: u64, cached: u64) -> f64 {
    unit_profile(facts).prefill_seconds([(new, cached)])
}

/// Bytes one decode step of `batch` streams holding `context` tokens in all reads, by the
/// profile's formula.
pub fn decode_bytes(facts: &Profile, batch: usize, context: u64) -> f64 {
    unit_profile(facts).decode_step_seconds(batch, context)
}

/// When one stream's token-carrying chunks arrived, and how many tokens it generated in all.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamTimes {
    /// Arrival of each chunk that carried a choice, seconds from a common origin, in order.
    pub chunks: Vec<f64>,
    /// Tokens generated (the answer's `usage.completion_tokens`).
    pub tokens: u64,
}

/// How a decode step was read off the streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StepMethod {
    /// One chunk per token (vLLM's streaming): each stream's time from its first to its last
    /// token while every stream was decoding, over the tokens between, summed over the
    /// streams. Not the gaps one by one: a real vLLM's chunks reach the client in bursts
    /// (several in one read, the gaps between them near 0), so only the window's ends are
    /// trusted.
    PerToken,
    /// Fewer chunks than tokens (an engine that streams several tokens a chunk, like the
    /// simulated workers' first token then the rest): the mean gap of the stream whose first
    /// token came last, from its first chunk to its last.
    Span,
}

/// One decode step's time as the streams show it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepEstimate {
    /// Seconds of one step.
    pub seconds: f64,
    /// Gaps (per token) or tokens (span) it was read from.
    pub samples: usize,
    /// How it was read.
    pub method: StepMethod,
}

/// The time of one decode step while every stream of `streams` decodes, skipping the first
/// `skip` tokens of each stream inside that window; `None` when the streams show too little.
///
/// The window runs from the last stream's first token to the first stream's last: before it
/// some streams are still prefilling (their prefill may share or delay the steps), after it
/// the batch is smaller.
pub fn decode_step(streams: &[StreamTimes], skip: usize) -> Option<StepEstimate> {
    if streams.is_empty() || streams.iter().any(|s| s.chunks.is_empty() || s.tokens < 2) {
        return None;
    }
    let per_token = streams.iter().all(|s| s.chunks.len() as u64 == s.tokens);
    if per_token {
        let start = streams.iter().map(|s| s.chunks[0]).fold(f64::MIN, f64::max);
        let end = streams
            .iter()
            .map(|s| *s.chunks.last().unwrap_or(&f64::MAX))
            .fold(f64::MAX, f64::min);
        let (mut span, mut gaps) = (0.0, 0usize);
        for s in streams {
            let inside: Vec<f64> = s
                .chunks
                .iter()
                .copied()
                .filter(|t| *t >= start && *t <= end)
                .skip(skip)
                .collect();
            if let (Some(first), Some(last)) = (inside.first(), inside.last()) {
                span += last - first;
                gaps += inside.len() - 1;
            }
        }
        if gaps < MIN_POINTS || span <= 0.0 {
            return None;
        }
        return Some(StepEstimate {
            seconds: span / gaps as f64,
            samples: gaps,
            method: StepMethod::PerToken,
        });
    }
    let last_start = streams
        .iter()
        .max_by(|a, b| a.chunks[0].total_cmp(&b.chunks[0]))?;
    let span = last_start.chunks.last()? - last_start.chunks[0];
    let steps = last_start.tokens - 1;
    (span > 0.0).then(|| StepEstimate {
        seconds: span / steps as f64,
        samples: steps as usize,
        method: StepMethod::Span,
    })
}

/// The KV transfer's seconds in a P→D call: D's time to its first token, less the decode
/// step D runs once the KV has arrived, less the prefill P had still to do when it answered
/// (`p_prefill − p_round_trip`, when positive: an engine that answers P's call before it
/// prefills, as the simulated workers do, prefills while D waits).
pub fn transfer_seconds(
    d_first_token: f64,
    decode_step: f64,
    p_prefill: f64,
    p_round_trip: f64,
) -> f64 {
    d_first_token - decode_step - (p_prefill - p_round_trip).max(0.0)
}

/// The median of `v` (`NaN` for none).
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let mid = s.len() / 2;
    if s.len() % 2 == 1 {
        s[mid]
    } else {
        (s[mid - 1] + s[mid]) / 2.0
    }
}

/// One fitted factor and its standard error.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Factor {
    /// The profile key (`fit.prefill_efficiency`).
    pub key: String,
    /// The fitted value, as written into the profile.
    pub value: f64,
    /// Its standard error (one sigma), from the fit's residuals.
    pub stderr: f64,
}

/// `fit.prefill_efficiency` and `fit.prefill_overhead_ms` from a fit of seconds against
/// FLOPs; an efficiency above 1 is an error naming `--peak-flops`.
pub fn prefill_factors(line: &Line, peak_flops: f64) -> Result<[Factor; 2], ProfileError> {
    let eff = efficiency(
        line,
        peak_flops,
        "fit.prefill_efficiency",
        "hardware.peak_flops",
        "--peak-flops",
    )?;
    Ok([eff, overhead(line, "fit.prefill_overhead_ms")])
}

/// `fit.decode_efficiency` and `fit.decode_overhead_ms` from a fit of seconds against bytes
/// read per step; an efficiency above 1 is an error naming `--mem-bandwidth`.
pub fn decode_factors(line: &Line, bandwidth: f64) -> Result<[Factor; 2], ProfileError> {
    let eff = efficiency(
        line,
        bandwidth,
        "fit.decode_efficiency",
        "hardware.hbm_bytes_per_s",
        "--mem-bandwidth",
    )?;
    Ok([eff, overhead(line, "fit.decode_overhead_ms")])
}

/// `fit.transfer_bytes_per_s` and `fit.transfer_setup_ms` from a fit of seconds against KV
/// bytes shipped.
pub fn transfer_factors(line: &Line) -> [Factor; 2] {
    let bw = 1.0 / line.slope;
    [
        Factor {
            key: "fit.transfer_bytes_per_s".into(),
            value: bw,
            stderr: bw * line.slope_se / line.slope,
        },
        overhead(line, "fit.transfer_setup_ms"),
    ]
}

fn efficiency(
    line: &Line,
    capacity: f64,
    factor: &'static str,
    fact: &'static str,
    flag: &'static str,
) -> Result<Factor, ProfileError> {
    let value = 1.0 / (line.slope * capacity);
    if value > 1.0 {
        return Err(ProfileError::EfficiencyAboveOne {
            factor,
            value,
            fact,
            fact_value: capacity,
            flag,
        });
    }
    Ok(Factor {
        key: factor.into(),
        value,
        stderr: value * line.slope_se / line.slope,
    })
}

fn overhead(line: &Line, key: &str) -> Factor {
    Factor {
        key: key.into(),
        value: line.intercept * 1e3,
        stderr: line.intercept_se * 1e3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-300)
    }

    #[test]
    fn exact_points_give_back_slope_and_intercept() {
        let pts: Vec<(f64, f64)> = [1e12, 3e12, 7e12, 2e13]
            .iter()
            .map(|&x| (x, 0.030 + x / (0.4 * 989e12)))
            .collect();
        let fit = fit_sweep("prefill", &pts).unwrap();
        assert!(close(fit.line.intercept, 0.030, 1e-9), "{:?}", fit.line);
        assert!(close(fit.line.slope, 1.0 / (0.4 * 989e12), 1e-9));
        assert!(fit.line.slope_se < 1e-12 * fit.line.slope);
        assert!(fit.residuals.rms_rel < 1e-12 && fit.residuals.max_rel < 1e-12);
        assert_eq!(fit.residuals.points, 4);
        assert!(fit.warnings.is_empty());
        let [eff, ovh] = prefill_factors(&fit.line, 989e12).unwrap();
        assert_eq!(eff.key, "fit.prefill_efficiency");
        assert!(close(eff.value, 0.4, 1e-9), "{eff:?}");
        assert!(close(ovh.value, 30.0, 1e-9), "{ovh:?}");
        let [bw, setup] = transfer_factors(&Line {
            intercept: 0.04,
            slope: 1.0 / 5e9,
            intercept_se: 0.001,
            slope_se: 1e-12,
            through_origin: false,
        });
        assert!(close(bw.value, 5e9, 1e-12) && close(bw.stderr, 5e9 * 5e-3, 1e-9));
        assert!(close(setup.value, 40.0, 1e-12) && close(setup.stderr, 1.0, 1e-12));
    }

    #[test]
    fn noisy_points_report_their_spread() {
        // t = 5 ms + x / 1e12, each point 2 % off, alternately up and down.
        let pts: Vec<(f64, f64)> = (1..=8)
            .map(|i| {
                let x = f64::from(i) * 5e9;
                let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
                (x, (0.005 + x / 1e12) * (1.0 + sign * 0.02))
            })
            .collect();
        let fit = fit_sweep("decode", &pts).unwrap();
        assert!(close(fit.line.slope, 1e-12, 0.05), "{:?}", fit.line);
        assert!(fit.residuals.rms_rel > 0.01 && fit.residuals.rms_rel < 0.03);
        assert!(fit.residuals.max_rel < 0.05);
        assert!(fit.line.slope_se > 0.0 && fit.line.intercept_se > 0.0);
        let [eff, _] = decode_factors(&fit.line, 3.35e12).unwrap();
        assert!(close(eff.value, 1e12 / 3.35e12, 0.05), "{eff:?}");
        assert!(eff.stderr > 0.0);
    }

    #[test]
    fn short_points_are_fitted_on_their_relative_error() {
        // t = 10 ms + x / 1e11, the longest point 36 % above the line (attention growing
        // faster than linear): an unweighted fit would put the fixed cost below 0 and the
        // shortest point 74 % off; on the relative errors the short points stay within 7 %.
        let mut pts: Vec<(f64, f64)> = [1e9, 2e9, 4e9, 8e9, 16e9, 32e9]
            .iter()
            .map(|&x| (x, 0.010 + x / 1e11))
            .collect();
        pts[5].1 = 0.45;
        let fit = fit_sweep("prefill", &pts).unwrap();
        assert!(!fit.line.through_origin && fit.warnings.is_empty());
        assert!(close(fit.line.intercept, 0.0084, 0.01), "{:?}", fit.line);
        for &(x, t) in &pts[..5] {
            let r = relative(fit.line.at(x), t);
            assert!(r.abs() < 0.08, "x {x:e}: {r}");
        }
        assert!(
            close(fit.residuals.max_rel, 0.206, 0.01),
            "{:?}",
            fit.residuals
        );
    }

    #[test]
    fn an_efficiency_above_one_names_the_option_to_raise() {
        let line = Line {
            intercept: 0.001,
            slope: 1.0 / 2e15,
            intercept_se: 0.0,
            slope_se: 0.0,
            through_origin: false,
        };
        let err = prefill_factors(&line, 989e12).unwrap_err();
        assert!(matches!(err, ProfileError::EfficiencyAboveOne { .. }));
        let text = err.to_string();
        assert!(
            text.contains("fit.prefill_efficiency") && text.contains("--peak-flops"),
            "{text}"
        );
        let text = decode_factors(&line, 1e15).unwrap_err().to_string();
        assert!(text.contains("--mem-bandwidth"), "{text}");
    }

    #[test]
    fn too_few_points_or_sizes_are_refused() {
        for pts in [
            vec![(1.0, 1.0), (2.0, 2.0)],
            vec![(1.0, 1.0), (1.0, 1.1), (1.0, 0.9)],
            vec![(1.0, 1.0), (2.0, f64::NAN), (3.0, -1.0), (4.0, 2.0)],
        ] {
            let err = fit_sweep("transfer", &pts).unwrap_err();
            assert!(
                matches!(
                    err,
                    ProfileError::TooFewPoints {
                        sweep: "transfer",
                        ..
                    }
                ),
                "{pts:?}: {err}"
            );
        }
        let one_out = [(1.0, 1.0), (2.0, 2.0), (3.0, -0.5), (4.0, 4.0)];
        let fit = fit_sweep("transfer", &one_out).unwrap();
        assert_eq!(fit.residuals.points, 3);
        assert!(
            fit.warnings[0].contains("1 of 4 points left out"),
            "{:?}",
            fit.warnings
        );
        let flat = [(1.0, 2.0), (2.0, 1.5), (3.0, 1.0)];
        let err = fit_sweep("prefill", &flat).unwrap_err().to_string();
        assert!(err.contains("does not grow"), "{err}");
    }

    #[test]
    fn a_negative_fixed_cost_is_clamped_with_a_warning() {
        let pts = [(1.0, 0.5), (2.0, 1.6), (3.0, 2.6), (4.0, 3.5)];
        let fit = fit_sweep("transfer", &pts).unwrap();
        assert!(fit.line.through_origin);
        assert_eq!(fit.line.intercept, 0.0);
        // On the relative errors: Σ(x/t) / Σ(x²/t²).
        let (sxt, sxx) = pts.iter().fold((0.0, 0.0), |(a, b), (x, t)| {
            (a + x / t, b + x * x / (t * t))
        });
        assert!(close(fit.line.slope, sxt / sxx, 1e-12), "{:?}", fit.line);
        assert_eq!(fit.warnings.len(), 1);
        assert!(
            fit.warnings[0].contains("clamped to 0"),
            "{:?}",
            fit.warnings
        );
    }

    #[test]
    fn per_token_streams_give_the_step_while_all_decode() {
        // Stream a starts at 0 and decodes alone (gap 5) until b's first token at 20; then
        // both decode with gap 8 until a ends.
        let a: Vec<f64> = (0..4)
            .map(|i| f64::from(i) * 5.0)
            .chain((1..=10).map(|i| 15.0 + 5.0 + f64::from(i) * 8.0))
            .collect();
        let b: Vec<f64> = (0..=12).map(|i| 20.0 + f64::from(i) * 8.0).collect();
        let streams = [
            StreamTimes {
                tokens: a.len() as u64,
                chunks: a,
            },
            StreamTimes {
                tokens: b.len() as u64,
                chunks: b,
            },
        ];
        let est = decode_step(&streams, 2).unwrap();
        assert_eq!(est.method, StepMethod::PerToken);
        assert!(close(est.seconds, 8.0, 1e-12), "{est:?}");
        assert!(est.samples >= 10);
    }

    #[test]
    fn per_token_streams_read_in_bursts_give_the_step() {
        // Steps of 4 ms, the client reading the chunks three at a time: two gaps of 0 and one
        // of 12 ms, whose median would say 0.
        let bursty = |start: f64| -> Vec<f64> {
            (0..30)
                .map(|i| start + f64::from(i / 3 * 3) * 0.004)
                .collect()
        };
        let streams = [0.0, 0.0].map(|start| StreamTimes {
            tokens: 30,
            chunks: bursty(start),
        });
        let est = decode_step(&streams, 0).unwrap();
        assert_eq!(est.method, StepMethod::PerToken);
        // 27 steps of 4 ms from the first chunk to the last, read over 29 gaps.
        assert!(close(est.seconds, 27.0 * 0.004 / 29.0, 1e-12), "{est:?}");
        assert_eq!(est.samples, 58);
        // A window with no time in it tells nothing.
        let flat = [StreamTimes {
            tokens: 10,
            chunks: vec![1.0; 10],
        }];
        assert!(decode_step(&flat, 0).is_none());
    }

    #[test]
    fn coarse_streams_give_the_mean_gap_of_the_last_started() {
        // The simulated workers: a chunk at the first token, one at the last. The first stream
        // waited through the second's prefill; the second decoded 31 steps of 10.
        let streams = [
            StreamTimes {
                chunks: vec![0.1, 0.66],
                tokens: 32,
            },
            StreamTimes {
                chunks: vec![0.35, 0.66],
                tokens: 32,
            },
        ];
        let est = decode_step(&streams, 3).unwrap();
        assert_eq!(est.method, StepMethod::Span);
        assert!(close(est.seconds, 0.01, 1e-9), "{est:?}");
        assert_eq!(est.samples, 31);
        assert!(
            decode_step(
                &[StreamTimes {
                    chunks: vec![],
                    tokens: 3
                }],
                0
            )
            .is_none()
        );
    }

    #[test]
    fn the_transfer_is_what_d_waited_less_its_step_and_p_s_unfinished_prefill() {
        // A P that prefilled before answering (its round trip longer than the prefill).
        assert!(close(
            transfer_seconds(0.100, 0.010, 0.030, 0.040),
            0.090,
            1e-12
        ));
        // A P that answered at once and prefilled while D waited.
        assert!(close(
            transfer_seconds(0.100, 0.010, 0.030, 0.001),
            0.061,
            1e-12
        ));
    }

    #[test]
    fn work_is_counted_with_the_profile_s_formulas() {
        let p = Profile::default();
        let active = p.active_params();
        let attn = 4.0 * 48.0 * 32.0 * 128.0;
        let f = prefill_flops(&p, 1000, 3000);
        assert!(close(
            f,
            2.0 * active * 1000.0 + attn * 1000.0 * 3500.0,
            1e-12
        ));
        // A step's time is its bytes over efficiency × bandwidth, plus the fixed cost.
        let b = decode_bytes(&p, 4, 10_000);
        let t = b / (p.fit.decode_efficiency * p.hardware.hbm_bytes_per_s)
            + p.fit.decode_overhead_ms / 1e3;
        assert!(close(t, p.decode_step_seconds(4, 10_000), 1e-12));
        assert!(b > 10_000.0 * p.kv_bytes_per_token());
    }
}
