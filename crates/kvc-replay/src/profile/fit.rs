//! The arithmetic of `kvc-replay profile`: straight lines fitted by least squares and their
//! residuals, the prefill sweep's fit with attention at a rate of its own, the work of each
//! point, the decode step read off streamed tokens, the transfer read off D's first token, and
//! the profile's factors from the fits. Pure: no I/O.
//!
//! Work is counted with the profile's own formulas ([`prefill_flops`], [`prefill_flops_split`],
//! [`decode_bytes`], [`Profile::kv_bytes_per_token`]), so the fitted factors mean in the
//! simulator exactly what they meant in the fit.

use super::ProfileError;
use kvc_engine_sim::model::{PrefillFlops, Profile};
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
    let mut warnings: Vec<String> = left_out(sweep, usable.len(), points.len())
        .into_iter()
        .collect();
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
    let residuals = residuals(usable.iter().map(|&(x, t)| relative(line.at(x), t)));
    Ok(SweepFit {
        line,
        residuals,
        warnings,
    })
}

/// The warning for points a sweep's fit left out (no positive time), if any were.
fn left_out(sweep: &str, usable: usize, all: usize) -> Option<String> {
    (usable < all).then(|| {
        format!(
            "{sweep}: {} of {all} points left out of the fit (no positive time: the corrections \
             took more than was measured)",
            all - usable
        )
    })
}

/// RMS and largest magnitude of relative errors.
fn residuals(rel: impl Iterator<Item = f64>) -> Residuals {
    let rel: Vec<f64> = rel.collect();
    Residuals {
        points: rel.len(),
        rms_rel: (rel.iter().map(|r| r * r).sum::<f64>() / rel.len() as f64).sqrt(),
        max_rel: rel.iter().fold(0.0_f64, |m, r| m.max(r.abs())),
    }
}

/// The prefill sweep's fitted time against its two kinds of work, `t = intercept +
/// linear_slope × linear FLOPs + attention_slope × attention FLOPs`, fitted on the relative
/// errors, with the standard errors of its coefficients.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PrefillLine {
    /// The fixed cost, seconds.
    pub intercept: f64,
    /// Seconds per linear FLOP (the matmuls over the parameters).
    pub linear_slope: f64,
    /// Seconds per attention FLOP; equal to `linear_slope` when attention was not fitted apart.
    pub attention_slope: f64,
    /// Standard error of the intercept (0 when it was fixed at 0).
    pub intercept_se: f64,
    /// Standard error of `linear_slope`.
    pub linear_slope_se: f64,
    /// Standard error of `attention_slope`.
    pub attention_slope_se: f64,
    /// Covariance of the two slopes' estimates (with one slope for both: its variance).
    pub slopes_cov: f64,
    /// The intercept was fixed at 0 (a free fit put it below 0).
    pub through_origin: bool,
    /// Attention was fitted a slope of its own; if not, this is the line of the total FLOPs
    /// (one efficiency for all prefill FLOPs).
    pub separate_attention: bool,
}

impl PrefillLine {
    /// The fitted time of `linear` and `attention` FLOPs.
    pub fn at(&self, linear: f64, attention: f64) -> f64 {
        self.intercept + self.linear_slope * linear + self.attention_slope * attention
    }

    /// The fitted time of a prefill's FLOPs.
    pub fn at_flops(&self, flops: PrefillFlops) -> f64 {
        self.at(flops.linear, flops.attention)
    }

    /// One line of the total FLOPs: attention at the linear work's rate.
    pub fn one_rate(line: &Line) -> Self {
        PrefillLine {
            intercept: line.intercept,
            linear_slope: line.slope,
            attention_slope: line.slope,
            intercept_se: line.intercept_se,
            linear_slope_se: line.slope_se,
            attention_slope_se: line.slope_se,
            slopes_cov: line.slope_se * line.slope_se,
            through_origin: line.through_origin,
            separate_attention: false,
        }
    }

    /// The attention efficiency as a multiple of the prefill efficiency (`linear_slope /
    /// attention_slope`), and its standard error (first order, from the slopes' variances and
    /// covariance).
    pub fn efficiency_ratio(&self) -> (f64, f64) {
        let (a, b) = (self.linear_slope, self.attention_slope);
        let ratio = a / b;
        let rel_var = (self.linear_slope_se / a).powi(2) + (self.attention_slope_se / b).powi(2)
            - 2.0 * self.slopes_cov / (a * b);
        (ratio, ratio.abs() * rel_var.max(0.0).sqrt())
    }
}

/// The normal equations of a design whose columns, scaled to unit diagonal, have a
/// determinant below this are taken as singular: one column is (nearly) a combination of the
/// others, and no fit can tell their coefficients apart.
const SINGULAR: f64 = 1e-10;

/// Weighted least squares of `t` on the columns of `rows` (each row one point's regressors),
/// each point weighted by `1 / t²`: the coefficients, the inverse of the weighted normal
/// equations `XᵀWX`, and the weighted sum of squared residuals. `None` when the normal
/// equations are singular (their determinant, scaled to unit diagonal, at most [`SINGULAR`]).
/// The equations are solved directly, by Gauss–Jordan elimination on the matrix scaled to unit
/// diagonal (so that FLOP counts of 1e12 beside an intercept of 1 lose nothing; symmetric and
/// positive definite, it needs no pivoting).
fn weighted_normal_equations<const K: usize>(
    rows: &[[f64; K]],
    t: &[f64],
) -> Option<([f64; K], [[f64; K]; K], f64)> {
    let mut m = [[0.0; K]; K];
    let mut v = [0.0; K];
    for (x, &t) in rows.iter().zip(t) {
        let w = weight(t);
        for j in 0..K {
            v[j] += w * x[j] * t;
            for k in 0..K {
                m[j][k] += w * x[j] * x[k];
            }
        }
    }
    let mut s = [0.0; K];
    for j in 0..K {
        s[j] = m[j][j].sqrt();
        if !(s[j] > 0.0 && s[j].is_finite()) {
            return None;
        }
    }
    // c = D⁻¹ M D⁻¹ (unit diagonal), inverted in place beside the identity.
    let mut c = [[0.0; K]; K];
    let mut inv = [[0.0; K]; K];
    for j in 0..K {
        for k in 0..K {
            c[j][k] = m[j][k] / (s[j] * s[k]);
        }
        inv[j][j] = 1.0;
    }
    // Each pivot is a diagonal entry of a Schur complement of `c`, in (0, 1] while `c` is
    // positive definite: the running product only falls, and ends at the determinant.
    let mut det = 1.0;
    for col in 0..K {
        let p = c[col][col];
        det *= p;
        if det.is_nan() || det <= SINGULAR {
            return None;
        }
        for k in 0..K {
            c[col][k] /= p;
            inv[col][k] /= p;
        }
        for r in 0..K {
            if r != col {
                let f = c[r][col];
                for k in 0..K {
                    c[r][k] -= f * c[col][k];
                    inv[r][k] -= f * inv[col][k];
                }
            }
        }
    }
    // M⁻¹ = D⁻¹ C⁻¹ D⁻¹; the coefficients M⁻¹ v.
    let mut m_inv = [[0.0; K]; K];
    let mut beta = [0.0; K];
    for j in 0..K {
        for k in 0..K {
            m_inv[j][k] = inv[j][k] / (s[j] * s[k]);
            beta[j] += m_inv[j][k] * v[k];
        }
    }
    let ssr = rows
        .iter()
        .zip(t)
        .map(|(x, &t)| {
            let fitted: f64 = x.iter().zip(&beta).map(|(x, b)| x * b).sum();
            weight(t) * (t - fitted).powi(2)
        })
        .sum();
    Some((beta, m_inv, ssr))
}

/// Fewest points the prefill fit with attention apart accepts (three coefficients and one
/// degree of freedom left for the standard errors).
pub const MIN_PREFILL_POINTS: usize = 4;

/// Least squares of `t = intercept + a × linear + b × attention` over `(linear, attention,
/// t)` points, on the relative errors (each point weighted by `1 / t²`, as [`least_squares`]),
/// the intercept fixed at 0 when `through_origin`; standard errors from the inverse of the
/// weighted normal equations times the relative errors' variance (the weighted sum of squared
/// residuals over the degrees of freedom).
///
/// Errors: [`ProfileError::TooFewPoints`] with fewer than [`MIN_PREFILL_POINTS`] points (one
/// fewer through the origin); [`ProfileError::Unfittable`] when the points cannot tell the
/// attention FLOPs from the linear ones: when, over the points, one of the intercept, the
/// linear and the attention FLOPs is (nearly) a combination of the others. That is so with
/// fewer than three distinct points, with every point of one size of new tokens (the linear
/// FLOPs constant, one with the intercept), or with every point at one `cached + new / 2`
/// (attention a fixed multiple of the linear FLOPs).
pub fn least_squares_two(
    points: &[(f64, f64, f64)],
    through_origin: bool,
) -> Result<PrefillLine, ProfileError> {
    let coefficients = if through_origin { 2 } else { 3 };
    let n = points.len();
    if n <= coefficients {
        return Err(ProfileError::TooFewPoints {
            sweep: "prefill",
            usable: n,
            needed: coefficients + 1,
        });
    }
    let t: Vec<f64> = points.iter().map(|p| p.2).collect();
    let singular = || ProfileError::Unfittable {
        sweep: "prefill",
        message: "the points cannot tell the attention FLOPs from the linear ones (over them, \
                  one of the fixed cost, the linear and the attention FLOPs is a combination of \
                  the others): the sweep needs at least three sizes of new tokens, or prefixes \
                  cached beside them"
            .into(),
    };
    let (intercept, a, b, var_c, var_a, var_b, cov_ab) = if through_origin {
        let rows: Vec<[f64; 2]> = points.iter().map(|p| [p.0, p.1]).collect();
        let (beta, inv, ssr) = weighted_normal_equations(&rows, &t).ok_or_else(singular)?;
        let var = ssr / (n - 2) as f64;
        (
            0.0,
            beta[0],
            beta[1],
            0.0,
            var * inv[0][0],
            var * inv[1][1],
            var * inv[0][1],
        )
    } else {
        let rows: Vec<[f64; 3]> = points.iter().map(|p| [1.0, p.0, p.1]).collect();
        let (beta, inv, ssr) = weighted_normal_equations(&rows, &t).ok_or_else(singular)?;
        let var = ssr / (n - 3) as f64;
        (
            beta[0],
            beta[1],
            beta[2],
            var * inv[0][0],
            var * inv[1][1],
            var * inv[2][2],
            var * inv[1][2],
        )
    };
    Ok(PrefillLine {
        intercept,
        linear_slope: a,
        attention_slope: b,
        intercept_se: var_c.max(0.0).sqrt(),
        linear_slope_se: var_a.max(0.0).sqrt(),
        attention_slope_se: var_b.max(0.0).sqrt(),
        slopes_cov: cov_ab,
        through_origin,
        separate_attention: true,
    })
}

/// The prefill sweep's fit.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillFit {
    /// The fit whose times are reported (attention apart, or one line of the total FLOPs).
    pub line: PrefillLine,
    /// Its residuals.
    pub residuals: Residuals,
    /// One efficiency for all prefill FLOPs on the same points: the line of the total FLOPs.
    pub one_rate: SweepFit,
    /// What the fit had to do that the user should know.
    pub warnings: Vec<String>,
}

/// Fits the prefill sweep's `(linear, attention, t)` points as `t = overhead + linear /
/// (prefill_efficiency × peak) + attention / (attention_efficiency × peak)`
/// ([`least_squares_two`]; a fixed cost below 0 is clamped to 0 and the slopes fitted again
/// through the origin, with a warning). One efficiency for all prefill FLOPs (the line of the
/// total FLOPs, [`fit_sweep`]) is kept instead, with a warning saying why, when the two
/// cannot be told apart: the fit is not possible, a slope comes out at 0 or below, or the
/// attention efficiency comes out within one standard error of the prefill efficiency.
/// Errors are those of the one-efficiency fit.
pub fn fit_prefill(points: &[(f64, f64, f64)]) -> Result<PrefillFit, ProfileError> {
    let one_rate = fit_sweep(
        "prefill",
        &points
            .iter()
            .map(|&(l, a, t)| (l + a, t))
            .collect::<Vec<_>>(),
    )?;
    let usable: Vec<(f64, f64, f64)> = points
        .iter()
        .copied()
        .filter(|(l, a, t)| l.is_finite() && a.is_finite() && t.is_finite() && *t > 0.0)
        .collect();
    let mut warnings: Vec<String> = left_out("prefill", usable.len(), points.len())
        .into_iter()
        .collect();
    let two = least_squares_two(&usable, false).and_then(|line| {
        if line.intercept >= 0.0 {
            return Ok(line);
        }
        let again = least_squares_two(&usable, true)?;
        warnings.push(format!(
            "prefill: the fitted fixed cost was {:.2} ms, below 0: clamped to 0 and the slopes \
             fitted again through the origin",
            line.intercept * 1e3
        ));
        Ok(again)
    });
    let kept = "one efficiency kept for all prefill FLOPs (fit.attention_efficiency not written)";
    let why = match two {
        Err(e) => format!("prefill: attention not fitted apart ({e}); {kept}"),
        Ok(line) if !(line.linear_slope > 0.0 && line.attention_slope > 0.0) => format!(
            "prefill: fitted apart, the linear and attention FLOPs took {:.3e} and {:.3e} s per \
             FLOP, not both above 0; {kept}",
            line.linear_slope, line.attention_slope
        ),
        Ok(line) => {
            let (ratio, se) = line.efficiency_ratio();
            if (ratio - 1.0).abs() > se {
                let residuals =
                    residuals(usable.iter().map(|&(l, a, t)| relative(line.at(l, a), t)));
                return Ok(PrefillFit {
                    line,
                    residuals,
                    one_rate,
                    warnings,
                });
            }
            format!(
                "prefill: the attention efficiency came out {ratio:.3} ± {se:.3} times the \
                 prefill efficiency, within one standard error of it; {kept}"
            )
        }
    };
    let mut warnings = one_rate.warnings.clone();
    warnings.push(why);
    Ok(PrefillFit {
        line: PrefillLine::one_rate(&one_rate.line),
        residuals: one_rate.residuals,
        one_rate,
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
    p.fit.attention_efficiency = None;
    p.fit.prefill_overhead_ms = 0.0;
    p.fit.decode_efficiency = 1.0;
    p.fit.decode_overhead_ms = 0.0;
    p
}

/// FLOPs of prefilling `new` tokens after `cached` ones, by the profile's formula: linear and
/// attention together.
pub fn prefill_flops(facts: &Profile, new: u64, cached: u64) -> f64 {
    unit_profile(facts).prefill_seconds([(new, cached)])
}

/// The FLOPs of [`prefill_flops`] apart: linear (the matmuls over the parameters) and
/// attention, by the profile's formulas; they add up to [`prefill_flops`].
pub fn prefill_flops_split(facts: &Profile, new: u64, cached: u64) -> PrefillFlops {
    facts.prefill_flops([(new, cached)])
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

/// `fit.prefill_efficiency`, `fit.attention_efficiency` (when the fit gave attention a rate
/// of its own) and `fit.prefill_overhead_ms` from the prefill fit; an efficiency above 1 is an
/// error naming `--peak-flops`.
pub fn prefill_factors(line: &PrefillLine, peak_flops: f64) -> Result<Vec<Factor>, ProfileError> {
    let eff = |key, slope, se| {
        efficiency(
            slope,
            se,
            peak_flops,
            key,
            "hardware.peak_flops",
            "--peak-flops",
        )
    };
    let mut factors = vec![eff(
        "fit.prefill_efficiency",
        line.linear_slope,
        line.linear_slope_se,
    )?];
    if line.separate_attention {
        factors.push(eff(
            "fit.attention_efficiency",
            line.attention_slope,
            line.attention_slope_se,
        )?);
    }
    factors.push(Factor {
        key: "fit.prefill_overhead_ms".into(),
        value: line.intercept * 1e3,
        stderr: line.intercept_se * 1e3,
    });
    Ok(factors)
}

/// `fit.decode_efficiency` and `fit.decode_overhead_ms` from a fit of seconds against bytes
/// read per step; an efficiency above 1 is an error naming `--mem-bandwidth`.
pub fn decode_factors(line: &Line, bandwidth: f64) -> Result<[Factor; 2], ProfileError> {
    let eff = efficiency(
        line.slope,
        line.slope_se,
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
    slope: f64,
    slope_se: f64,
    capacity: f64,
    factor: &'static str,
    fact: &'static str,
    flag: &'static str,
) -> Result<Factor, ProfileError> {
    let value = 1.0 / (slope * capacity);
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
        stderr: value * slope_se / slope,
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
        let factors = prefill_factors(&PrefillLine::one_rate(&fit.line), 989e12).unwrap();
        let [eff, ovh] = [&factors[0], &factors[1]];
        assert_eq!(factors.len(), 2);
        assert_eq!(eff.key, "fit.prefill_efficiency");
        assert_eq!(ovh.key, "fit.prefill_overhead_ms");
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
        let err = prefill_factors(&PrefillLine::one_rate(&line), 989e12).unwrap_err();
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

    /// The tiny model of a CPU engine: 2 layers, 4 query heads of 32, 1.344e6 parameters.
    fn tiny() -> Profile {
        let mut p = Profile::default();
        p.model.layers = 2;
        p.model.q_heads = 4;
        p.model.kv_heads = 2;
        p.model.head_dim = 32;
        p.model.dense_params = 1.344e6;
        p.model.expert_params = 0.0;
        p.model.experts = 1;
        p.model.active_experts = 1;
        p.model.bytes_per_param = 4;
        p.hardware.peak_flops = 1.6e11;
        p
    }

    /// The prefill sweep's `(new, cached)` points with contexts up to 8,192 tokens.
    const SWEEP: [(u64, u64); 12] = [
        (256, 0),
        (512, 0),
        (1024, 0),
        (2048, 0),
        (4096, 0),
        (8192, 0),
        (256, 2048),
        (1024, 2048),
        (4096, 2048),
        (256, 4096),
        (1024, 4096),
        (4096, 4096),
    ];

    /// `(linear, attention, t)` of each `(new, cached)` by the tiny model's FLOPs and `time`.
    fn points(sizes: &[(u64, u64)], time: impl Fn(PrefillFlops) -> f64) -> Vec<(f64, f64, f64)> {
        let p = tiny();
        sizes
            .iter()
            .map(|&(n, c)| {
                let f = prefill_flops_split(&p, n, c);
                (f.linear, f.attention, time(f))
            })
            .collect()
    }

    /// 12 ms, the linear FLOPs at 30 % of 1.6e11, attention at 5 %.
    fn two_rates(f: PrefillFlops) -> f64 {
        0.012 + f.linear / (0.3 * 1.6e11) + f.attention / (0.05 * 1.6e11)
    }

    #[test]
    fn prefill_flops_split_by_the_profile_s_formulas() {
        let mut p = tiny();
        let f = prefill_flops_split(&p, 1024, 2048);
        // 2 × 1.344e6 × 1,024 and 4 × 2 × 4 × 32 × 1,024 × (2,048 + 512).
        assert!(close(f.linear, 2.752_512e9, 1e-12), "{f:?}");
        assert!(close(f.attention, 2.684_354_56e9, 1e-12), "{f:?}");
        assert_eq!(f.linear + f.attention, prefill_flops(&p, 1024, 2048));
        // The work does not depend on the facts' own efficiencies.
        p.fit.attention_efficiency = Some(0.01);
        assert_eq!(f.linear + f.attention, prefill_flops(&p, 1024, 2048));
        assert_eq!(prefill_flops_split(&p, 1024, 2048), f);
    }

    #[test]
    fn exact_points_give_back_both_rates() {
        let pts = points(&SWEEP, two_rates);
        let line = least_squares_two(&pts, false).unwrap();
        assert!(line.separate_attention && !line.through_origin);
        assert!(close(line.intercept, 0.012, 1e-9), "{line:?}");
        assert!(close(line.linear_slope, 1.0 / 0.48e11, 1e-9), "{line:?}");
        assert!(close(line.attention_slope, 1.0 / 0.08e11, 1e-9), "{line:?}");
        assert!(line.linear_slope_se < 1e-9 * line.linear_slope);
        assert!(line.attention_slope_se < 1e-9 * line.attention_slope);
        let fit = fit_prefill(&pts).unwrap();
        assert!(fit.warnings.is_empty(), "{:?}", fit.warnings);
        assert_eq!(fit.line, line);
        assert!(fit.residuals.max_rel < 1e-12, "{:?}", fit.residuals);
        assert_eq!(fit.residuals.points, 12);
        // One efficiency for all FLOPs misses these points by far.
        assert!(fit.one_rate.residuals.max_rel > 0.2, "{:?}", fit.one_rate);
        let f = prefill_factors(&fit.line, 1.6e11).unwrap();
        let keys: Vec<&str> = f.iter().map(|f| f.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "fit.prefill_efficiency",
                "fit.attention_efficiency",
                "fit.prefill_overhead_ms"
            ]
        );
        assert!(close(f[0].value, 0.3, 1e-9), "{f:?}");
        assert!(close(f[1].value, 0.05, 1e-9), "{f:?}");
        assert!(close(f[2].value, 12.0, 1e-9), "{f:?}");
        // Through the origin, the two slopes alone.
        let pts = points(&SWEEP, |f| two_rates(f) - 0.012);
        let line = least_squares_two(&pts, true).unwrap();
        assert!(line.through_origin && line.intercept == 0.0 && line.intercept_se == 0.0);
        assert!(close(line.linear_slope, 1.0 / 0.48e11, 1e-9), "{line:?}");
        assert!(close(line.attention_slope, 1.0 / 0.08e11, 1e-9), "{line:?}");
    }

    #[test]
    fn designs_that_cannot_separate_attention_are_refused_and_fall_back() {
        let unfittable = |sizes: &[(u64, u64)]| {
            let pts = points(sizes, two_rates);
            let err = least_squares_two(&pts, false).unwrap_err();
            assert!(
                matches!(
                    err,
                    ProfileError::Unfittable {
                        sweep: "prefill",
                        ..
                    }
                ),
                "{sizes:?}: {err:?}"
            );
            assert!(
                err.to_string()
                    .contains("cannot tell the attention FLOPs from the linear ones"),
                "{err}"
            );
            pts
        };
        // Nothing cached and two sizes of new tokens: three coefficients, two distinct points.
        unfittable(&[(512, 0), (512, 0), (2048, 0), (2048, 0), (512, 0)]);
        // One size of new tokens: the linear FLOPs are constant, one with the fixed cost.
        unfittable(&[(1024, 0), (1024, 1024), (1024, 2048), (1024, 4096)]);
        // One `cached + new / 2`: attention a fixed multiple of the linear FLOPs.
        let pts = unfittable(&[
            (256, 1920),
            (512, 1792),
            (1024, 1536),
            (2048, 1024),
            (4096, 0),
        ]);
        // The sweep's fit then gives all FLOPs one efficiency, and says why.
        let fit = fit_prefill(&pts).unwrap();
        assert!(!fit.line.separate_attention);
        assert_eq!(fit.line, PrefillLine::one_rate(&fit.one_rate.line));
        assert_eq!(fit.residuals, fit.one_rate.residuals);
        assert_eq!(fit.warnings.len(), 1, "{:?}", fit.warnings);
        assert!(
            fit.warnings[0].contains("attention not fitted apart")
                && fit.warnings[0].contains("one efficiency kept for all prefill FLOPs"),
            "{:?}",
            fit.warnings
        );
        let f = prefill_factors(&fit.line, 1.6e11).unwrap();
        assert_eq!(f.len(), 2);
        assert!(f.iter().all(|f| f.key != "fit.attention_efficiency"));
        // Three points leave no degree of freedom for the standard errors.
        let err = least_squares_two(&points(&SWEEP[..3], two_rates), false).unwrap_err();
        assert!(
            matches!(
                err,
                ProfileError::TooFewPoints {
                    sweep: "prefill",
                    usable: 3,
                    needed: MIN_PREFILL_POINTS
                }
            ),
            "{err:?}"
        );
        let fit = fit_prefill(&points(&SWEEP[..3], two_rates)).unwrap();
        assert!(!fit.line.separate_attention);
        assert!(
            fit.warnings[0].contains("usable point(s)"),
            "{:?}",
            fit.warnings
        );
    }

    /// Each point 3 % off, up and down in turn.
    fn noisy(pts: Vec<(f64, f64, f64)>) -> Vec<(f64, f64, f64)> {
        pts.into_iter()
            .enumerate()
            .map(|(i, (l, a, t))| (l, a, t * if i % 2 == 0 { 1.03 } else { 0.97 }))
            .collect()
    }

    #[test]
    fn noisy_prefill_points_report_their_spread() {
        let fit = fit_prefill(&noisy(points(&SWEEP, two_rates))).unwrap();
        assert!(fit.line.separate_attention, "{:?}", fit.warnings);
        assert!(fit.warnings.is_empty(), "{:?}", fit.warnings);
        let l = fit.line;
        assert!(close(l.linear_slope, 1.0 / 0.48e11, 0.15), "{l:?}");
        assert!(close(l.attention_slope, 1.0 / 0.08e11, 0.05), "{l:?}");
        assert!(l.intercept_se > 0.0 && l.linear_slope_se > 0.0 && l.attention_slope_se > 0.0);
        // The truth within three standard errors.
        assert!(
            (l.linear_slope - 1.0 / 0.48e11).abs() < 3.0 * l.linear_slope_se,
            "{l:?}"
        );
        assert!((l.attention_slope - 1.0 / 0.08e11).abs() < 3.0 * l.attention_slope_se);
        assert!(fit.residuals.rms_rel > 0.01 && fit.residuals.rms_rel < 0.04);
        assert!(fit.residuals.max_rel < 0.06, "{:?}", fit.residuals);
        let (ratio, se) = l.efficiency_ratio();
        assert!(
            close(ratio, 1.0 / 6.0, 0.15) && se > 0.0 && se < 0.1,
            "{ratio} ± {se}"
        );
        let f = prefill_factors(&l, 1.6e11).unwrap();
        assert!(close(f[1].value, 0.05, 0.05) && f[1].stderr > 0.0, "{f:?}");
    }

    #[test]
    fn one_rate_for_all_flops_within_the_noise_falls_back() {
        // Attention at the linear rate, 25 % of peak, each point 3 % off.
        let one = |f: PrefillFlops| 0.012 + (f.linear + f.attention) / (0.25 * 1.6e11);
        let fit = fit_prefill(&noisy(points(&SWEEP, one))).unwrap();
        assert!(!fit.line.separate_attention);
        assert_eq!(fit.warnings.len(), 1, "{:?}", fit.warnings);
        assert!(
            fit.warnings[0].contains("within one standard error")
                && fit.warnings[0].contains("one efficiency kept"),
            "{:?}",
            fit.warnings
        );
        let two = least_squares_two(&noisy(points(&SWEEP, one)), false).unwrap();
        let (ratio, se) = two.efficiency_ratio();
        assert!((ratio - 1.0).abs() <= se, "{ratio} ± {se}");
        let f = prefill_factors(&fit.line, 1.6e11).unwrap();
        assert_eq!(f.len(), 2);
        assert!(close(f[0].value, 0.25, 0.05), "{f:?}");
    }

    #[test]
    fn an_attention_efficiency_above_one_names_the_option_to_raise() {
        // The linear FLOPs at 10 % of 1.6e11, attention at 60 %.
        let fast = |f: PrefillFlops| 0.012 + f.linear / 1.6e10 + f.attention / 0.96e11;
        let fit = fit_prefill(&points(&SWEEP, fast)).unwrap();
        assert!(fit.line.separate_attention, "{:?}", fit.warnings);
        // Peak set half the real one: attention at 120 % of it.
        let err = prefill_factors(&fit.line, 0.8e11).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                ProfileError::EfficiencyAboveOne {
                    factor: "fit.attention_efficiency",
                    ..
                }
            ) && text.contains("--peak-flops"),
            "{text}"
        );
    }

    #[test]
    fn a_negative_fixed_cost_is_clamped_and_both_slopes_fitted_again() {
        // 2 ms less than nothing at 0 FLOPs: the free fit's fixed cost is below 0.
        let pts = points(&SWEEP, |f| two_rates(f) - 0.014);
        let fit = fit_prefill(&pts).unwrap();
        assert!(fit.line.through_origin && fit.line.separate_attention);
        assert_eq!((fit.line.intercept, fit.line.intercept_se), (0.0, 0.0));
        assert_eq!(fit.line, least_squares_two(&pts, true).unwrap());
        assert_eq!(fit.warnings.len(), 1);
        assert!(
            fit.warnings[0].contains("clamped to 0"),
            "{:?}",
            fit.warnings
        );
    }

    #[test]
    fn a_cpu_engine_s_prefill_is_fitted_with_attention_apart() {
        // Medians measured on a CPU vLLM serving the tiny model (seconds to the first token),
        // in the order of SWEEP.
        let measured = [
            0.0136, 0.0158, 0.0262, 0.0545, 0.1588, 0.5104, 0.0198, 0.0507, 0.2526, 0.0287, 0.0740,
            0.3311,
        ];
        let p = tiny();
        let pts: Vec<(f64, f64, f64)> = SWEEP
            .iter()
            .zip(measured)
            .map(|(&(n, c), t)| {
                let f = prefill_flops_split(&p, n, c);
                (f.linear, f.attention, t)
            })
            .collect();
        let fit = fit_prefill(&pts).unwrap();
        assert!(fit.line.separate_attention && fit.warnings.is_empty());
        // Attention apart: within 9 % everywhere, where one efficiency for all FLOPs leaves
        // 27 % (the short prompts fitted too slow, the long ones too fast).
        assert!(
            close(fit.residuals.rms_rel, 0.0451, 0.01),
            "{:?}",
            fit.residuals
        );
        assert!(
            close(fit.residuals.max_rel, 0.0868, 0.01),
            "{:?}",
            fit.residuals
        );
        let one = fit.one_rate.residuals;
        assert!(
            close(one.rms_rel, 0.1572, 0.01) && close(one.max_rel, 0.2690, 0.01),
            "{one:?}"
        );
        let l = fit.line;
        assert!(close(l.intercept, 0.010_762, 1e-4) && close(l.intercept_se, 0.000_653, 1e-3));
        let (ratio, se) = l.efficiency_ratio();
        assert!(close(ratio, 0.2687, 1e-3) && se < 0.05, "{ratio} ± {se}");
        // With these facts the linear FLOPs ran at 1.95 ± 0.30 of the peak given (2 × all
        // parameters per token, embeddings included, overstates them): an error naming
        // --peak-flops; at twice the peak, attention at 26 % and the linear work at 97 %.
        let err = prefill_factors(&l, p.hardware.peak_flops).unwrap_err();
        assert!(
            matches!(err, ProfileError::EfficiencyAboveOne { factor: "fit.prefill_efficiency", value, .. } if close(value, 1.946, 1e-3)),
            "{err:?}"
        );
        let f = prefill_factors(&l, 2.0 * p.hardware.peak_flops).unwrap();
        assert!(
            close(f[0].value, 0.9731, 1e-3) && close(f[0].stderr, 0.1498, 1e-2),
            "{f:?}"
        );
        assert!(
            close(f[1].value, 0.2614, 1e-3) && close(f[1].stderr, 0.0099, 1e-2),
            "{f:?}"
        );
        assert!(close(f[2].value, 10.762, 1e-4), "{f:?}");
        let one = prefill_factors(&PrefillLine::one_rate(&fit.one_rate.line), 1.6e11).unwrap();
        assert!(
            close(one[0].value, 0.8003, 1e-3) && close(one[1].value, 6.958, 1e-3),
            "{one:?}"
        );
    }
}
