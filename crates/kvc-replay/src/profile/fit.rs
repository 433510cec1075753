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
pub fn residuals(rel: impl Iterator<Item = f64>) -> Residuals {
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
    /// token while every stream was decoding, over the steps between, summed over the
    /// streams. Not the gaps one by one: a real vLLM's chunks reach the client in bursts
    /// (several in one read, the gaps between them near 0; on a loaded machine a stream's
    /// whole answer at once), so only the window's ends are used, and of those only chunks
    /// that end a burst (the next one more than [`BURST_GAP`] later): the others arrive late
    /// by the steps that followed them.
    PerToken,
    /// Fewer chunks than tokens (an engine that streams several tokens a chunk, like the
    /// simulated workers' first token then the rest): the mean gap of the stream whose first
    /// token came last, from its first chunk to its last.
    Span,
    /// The engine's own timing of its steps ([`engine_decode_step`]): what its finished
    /// requests spent from first token to last, over the steps in that time. Used wherever
    /// the engine reports it (vLLM); the streams' reading is kept beside it.
    Engine,
}

/// An engine's running totals of its decoding (vLLM's `/metrics`): the seconds its finished
/// requests spent from their first token to their last (`vllm:request_decode_time_seconds`'s
/// sum, taken at the engine, whatever the client's reading of the stream), how many requests
/// finished (its count), and the tokens generated (`vllm:generation_tokens_total`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DecodeCounters {
    /// Seconds from first to last token, summed over finished requests.
    pub decode_seconds: f64,
    /// Requests finished.
    pub finished: f64,
    /// Tokens generated.
    pub generated: f64,
}

/// One decode step as the engine timed it, from its counters read `before` and `after` a
/// point's `streams` requests: the decode seconds they added over the steps they took (each
/// request's tokens after its first). `None` unless exactly `streams` requests finished in
/// between (another client's request would mix in) and at least [`MIN_POINTS`] steps were
/// timed.
pub fn engine_decode_step(
    before: &DecodeCounters,
    after: &DecodeCounters,
    streams: usize,
) -> Option<StepEstimate> {
    let finished = after.finished - before.finished;
    let steps = after.generated - before.generated - finished;
    let seconds = after.decode_seconds - before.decode_seconds;
    (finished == streams as f64 && steps >= MIN_POINTS as f64 && seconds > 0.0).then(|| {
        StepEstimate {
            seconds: seconds / steps,
            samples: steps as usize,
            method: StepMethod::Engine,
        }
    })
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

/// Chunks of one stream that arrive closer together than this came in one burst (one read of
/// the client's, or the API server flushing what queued while it was not scheduled): well
/// under any engine's decode step.
pub const BURST_GAP: f64 = 0.000_5;

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
            // The chunks inside the window, by index; of those, only the last of each burst
            // is trusted as an end: a burst's chunks were made a step apart and held back
            // until the last of them, so the earlier ones arrive late by whole steps.
            let trusted: Vec<(usize, f64)> = s
                .chunks
                .iter()
                .copied()
                .enumerate()
                .filter(|(_, t)| *t >= start && *t <= end)
                .skip(skip)
                .filter(|&(i, t)| s.chunks.get(i + 1).is_none_or(|next| next - t > BURST_GAP))
                .collect();
            if let (Some(first), Some(last)) = (trusted.first(), trusted.last()) {
                span += last.1 - first.1;
                gaps += last.0 - first.0;
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

/// Fits the intake, `t = intercept + slope × prompt tokens`, `t` a cached chat request's time
/// less the prefill fit's time for its uncached part: ordinary least squares, unweighted, as
/// `t` is a difference of two times and may be near 0 or below it. A slope below 0 (no
/// growth with the prompt that the noise does not hide) leaves the mean alone; an intercept
/// below 0 is fixed at 0 and the slope fitted through the origin; no intake above 0 at all
/// gives a line of 0. Each says so in a warning.
pub fn intake_line(points: &[(f64, f64)]) -> Result<(Line, Vec<String>), ProfileError> {
    let usable: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, t)| x.is_finite() && t.is_finite())
        .collect();
    let mut warnings: Vec<String> = Vec::new();
    if usable.len() < points.len() {
        warnings.push(format!(
            "intake sweep: {} of {} points left out of the fit (a request without a time)",
            points.len() - usable.len(),
            points.len()
        ));
    }
    let n = usable.len() as f64;
    let mut xs: Vec<f64> = usable.iter().map(|p| p.0).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    if usable.len() < MIN_POINTS || xs.len() < 2 {
        return Err(ProfileError::TooFewPoints {
            sweep: "intake",
            usable: usable.len(),
            needed: MIN_POINTS,
        });
    }
    let mx = usable.iter().map(|p| p.0).sum::<f64>() / n;
    let mt = usable.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = usable.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxt: f64 = usable.iter().map(|p| (p.0 - mx) * (p.1 - mt)).sum();
    let slope = sxt / sxx;
    let intercept = mt - slope * mx;
    let ssr: f64 = usable
        .iter()
        .map(|p| (p.1 - intercept - slope * p.0).powi(2))
        .sum();
    let var = ssr / (n - 2.0);
    let free = Line {
        intercept,
        slope,
        intercept_se: (var * (1.0 / n + mx * mx / sxx)).sqrt(),
        slope_se: (var / sxx).sqrt(),
        through_origin: false,
    };
    let zero = Line {
        intercept: 0.0,
        slope: 0.0,
        intercept_se: 0.0,
        slope_se: 0.0,
        through_origin: true,
    };
    let line = if slope < 0.0 {
        let sd = (usable.iter().map(|p| (p.1 - mt).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
        warnings.push(format!(
            "intake: the fitted growth with the prompt came out below 0 ({:.3} ms per 1,000 \
             tokens): the intake taken as the same for every prompt, their mean",
            slope * 1e6
        ));
        Line {
            intercept: mt,
            slope: 0.0,
            intercept_se: sd / n.sqrt(),
            slope_se: 0.0,
            through_origin: false,
        }
    } else if intercept < 0.0 {
        let sxx0: f64 = usable.iter().map(|p| p.0 * p.0).sum();
        let slope0 = usable.iter().map(|p| p.0 * p.1).sum::<f64>() / sxx0;
        let ssr0: f64 = usable.iter().map(|p| (p.1 - slope0 * p.0).powi(2)).sum();
        warnings.push(format!(
            "intake: the fitted fixed cost was {:.2} ms, below 0: clamped to 0 and the growth \
             fitted again through the origin",
            intercept * 1e3
        ));
        Line {
            intercept: 0.0,
            slope: slope0,
            intercept_se: 0.0,
            slope_se: (ssr0 / (n - 1.0) / sxx0).sqrt(),
            through_origin: true,
        }
    } else {
        free
    };
    // No intake above 0 at any size (or a part of the line below 0): none at all.
    if !(line.intercept >= 0.0 && line.slope >= 0.0 && line.intercept + line.slope > 0.0) {
        // Nothing of the refits above is kept: one word for it.
        warnings.retain(|w| !w.starts_with("intake:"));
        warnings.push(format!(
            "intake: a cached chat request took no longer than the prefill fit gives for it \
             (mean difference {:.2} ms): no intake (0)",
            mt * 1e3
        ));
        return Ok((zero, warnings));
    }
    Ok((line, warnings))
}

/// `fit.intake_ms` and `fit.intake_ms_per_1k_tokens` from [`intake_line`]'s line (seconds
/// against prompt tokens).
pub fn intake_factors(line: &Line) -> [Factor; 2] {
    [
        overhead(line, "fit.intake_ms"),
        Factor {
            key: "fit.intake_ms_per_1k_tokens".into(),
            value: line.slope * 1e6,
            stderr: line.slope_se * 1e6,
        },
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

// The tests sit beside this file (a folder `fit/` would be a folder of its own to the layering
// test, importing from this one).
#[cfg(test)]
#[path = "fit_tests.rs"]
mod tests;
