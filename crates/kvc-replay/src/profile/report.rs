//! What a profile run reports: each sweep's points with their fitted times, the engine's facts,
//! the profile built from the fits, and the TOML it is written as, opened by a comment of what
//! was measured and the residuals. Pure: no I/O.

use super::ProfileError;
use super::fit::{
    Factor, Line, PrefillFit, PrefillLine, Residuals, SweepFit, fit_prefill, fit_sweep,
    intake_line, median, relative, residuals,
};
use kvc_engine_sim::model::Profile;
use serde::Serialize;
use serde_json::Value;

/// One measured point of a sweep, with its fitted time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// What was sent (sizes, batch).
    pub inputs: Value,
    /// The work: FLOPs (prefill: linear and attention together), bytes read per step
    /// (decode), KV bytes shipped (transfer).
    pub x: f64,
    /// Prefill: the attention FLOPs among `x` (the rest is linear).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention_flops: Option<f64>,
    /// Each measurement, seconds.
    pub measured_s: Vec<f64>,
    /// Their median: what was fitted.
    pub median_s: f64,
    /// The fitted time (prefill: of the prefill fit, attention apart when it was fitted so).
    pub fitted_s: f64,
    /// `(fitted − median) / median` (intake: over the median time of the chat request, as
    /// the difference fitted may be near 0).
    pub residual: f64,
    /// What else was seen (cached tokens reported, the decode method, P's round trip, …).
    pub seen: Value,
}

/// One sweep's fit: the model, the factors, the residuals and every point.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepReport {
    /// `prefill`, `decode` or `transfer`.
    pub sweep: String,
    /// The model fitted.
    pub model: String,
    /// The factors it gave.
    pub factors: Vec<Factor>,
    /// The line in seconds and its units of work (prefill: the line of the total FLOPs, one
    /// efficiency for all; the times come from `prefill_line`).
    pub line: Line,
    /// Prefill: the fit the times come from, `t = intercept + linear_slope × linear FLOPs +
    /// attention_slope × attention FLOPs` (attention at the linear rate unless
    /// `separate_attention`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_line: Option<PrefillLine>,
    /// How well it fits.
    pub residuals: Residuals,
    /// Prefill with attention fitted apart: the residuals one efficiency for all prefill FLOPs
    /// (`line`) leaves on the same points.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub one_efficiency_residuals: Option<Residuals>,
    /// Every point.
    pub points: Vec<Point>,
}

/// A sweep's points, measured: inputs, work, each measurement and what else was seen.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    /// What was sent.
    pub inputs: Value,
    /// The work.
    pub x: f64,
    /// Prefill: the attention FLOPs among `x`.
    pub attention: Option<f64>,
    /// Each measurement, seconds.
    pub seconds: Vec<f64>,
    /// What else was seen.
    pub seen: Value,
}

/// Adds a sweep measured again to its first measurements: each point's times join those of
/// the point with the same inputs; a point only the second pass measured is added.
pub fn merge_points(points: &mut Vec<Measured>, again: Vec<Measured>) {
    for p in again {
        match points.iter_mut().find(|q| q.inputs == p.inputs) {
            Some(q) => q.seconds.extend(p.seconds),
            None => points.push(p),
        }
    }
}

/// The median of each point's measurements fitted by [`fit_sweep`], and its report without
/// factors (the caller adds them).
pub fn fit_points(
    sweep: &'static str,
    model: &str,
    points: &[Measured],
) -> Result<(SweepFit, SweepReport), ProfileError> {
    let xy: Vec<(f64, f64)> = points.iter().map(|p| (p.x, median(&p.seconds))).collect();
    let fit = fit_sweep(sweep, &xy)?;
    let report = SweepReport {
        sweep: sweep.into(),
        model: model.into(),
        factors: Vec::new(),
        line: fit.line,
        prefill_line: None,
        residuals: fit.residuals,
        one_efficiency_residuals: None,
        points: report_points(points, |p| fit.line.at(p.x)),
    };
    Ok((fit, report))
}

/// The model of the intake sweep.
pub const INTAKE_MODEL: &str = "t = intake + intake_per_token x prompt tokens (t: a cached \
     chat request's time less the prefill fit's time for its part not found cached)";

/// The intake sweep's points (`x` prompt tokens, `seconds` each repetition's chat time less
/// the prefill fit's time for its uncached part, `seen.text_s` the chat times), fitted by
/// [`intake_line`]: the line,
/// its warnings and the report without factors (the caller adds them). Residuals are over
/// the chat request's median time.
pub fn fit_intake_points(
    points: &[Measured],
) -> Result<(Line, Vec<String>, SweepReport), ProfileError> {
    let xy: Vec<(f64, f64)> = points.iter().map(|p| (p.x, median(&p.seconds))).collect();
    let (line, warnings) = intake_line(&xy)?;
    let text_median = |p: &Measured| {
        let text: Vec<f64> = p.seen["text_s"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default();
        median(&text)
    };
    let report_points: Vec<Point> = points
        .iter()
        .map(|p| {
            let m = median(&p.seconds);
            let f = line.at(p.x);
            Point {
                inputs: p.inputs.clone(),
                x: p.x,
                attention_flops: None,
                measured_s: p.seconds.clone(),
                median_s: m,
                fitted_s: f,
                residual: (f - m) / text_median(p),
                seen: p.seen.clone(),
            }
        })
        .collect();
    let report = SweepReport {
        sweep: "intake".into(),
        model: INTAKE_MODEL.into(),
        factors: Vec::new(),
        line,
        prefill_line: None,
        residuals: residuals(
            report_points
                .iter()
                .map(|p| p.residual)
                .filter(|r| r.is_finite()),
        ),
        one_efficiency_residuals: None,
        points: report_points,
    };
    Ok((line, warnings, report))
}

/// The model of the prefill sweep with attention fitted apart.
pub const PREFILL_MODEL_SPLIT: &str = "t = prefill_overhead + linear_FLOPs(new) / \
     (prefill_efficiency x peak_flops) + attention_FLOPs(new, cached) / (attention_efficiency x \
     peak_flops)";

/// The model of the prefill sweep with one efficiency for all FLOPs.
pub const PREFILL_MODEL_ONE: &str =
    "t = prefill_overhead + FLOPs(new, cached) / (prefill_efficiency x peak_flops)";

/// The prefill sweep's points (each with its attention FLOPs; the rest of `x` is linear),
/// their medians fitted by [`fit_prefill`], and its report without factors (the caller adds
/// them): the model fitted, the fit's times and residuals, and the one-efficiency line beside
/// them.
pub fn fit_prefill_points(points: &[Measured]) -> Result<(PrefillFit, SweepReport), ProfileError> {
    let split = |p: &Measured| {
        let attention = p.attention.unwrap_or(0.0);
        (p.x - attention, attention)
    };
    let xy: Vec<(f64, f64, f64)> = points
        .iter()
        .map(|p| {
            let (linear, attention) = split(p);
            (linear, attention, median(&p.seconds))
        })
        .collect();
    let fit = fit_prefill(&xy)?;
    let separate = fit.line.separate_attention;
    let report = SweepReport {
        sweep: "prefill".into(),
        model: if separate {
            PREFILL_MODEL_SPLIT
        } else {
            PREFILL_MODEL_ONE
        }
        .into(),
        factors: Vec::new(),
        line: fit.one_rate.line,
        prefill_line: Some(fit.line),
        residuals: fit.residuals,
        one_efficiency_residuals: separate.then_some(fit.one_rate.residuals),
        points: report_points(points, |p| {
            let (linear, attention) = split(p);
            fit.line.at(linear, attention)
        }),
    };
    Ok((fit, report))
}

/// Each point with its median and its `fitted` time.
fn report_points(points: &[Measured], fitted: impl Fn(&Measured) -> f64) -> Vec<Point> {
    points
        .iter()
        .map(|p| {
            let m = median(&p.seconds);
            let f = fitted(p);
            Point {
                inputs: p.inputs.clone(),
                x: p.x,
                attention_flops: p.attention,
                measured_s: p.seconds.clone(),
                median_s: m,
                fitted_s: f,
                residual: relative(f, m),
                seen: p.seen.clone(),
            }
        })
        .collect()
}

/// What the engine said about itself.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineFacts {
    /// The model requests named.
    pub model: String,
    /// `max_model_len` of its `/v1/models` entry, when given.
    pub max_model_len: Option<u64>,
    /// `block_size` of `vllm:cache_config_info`.
    pub block_size: u64,
    /// `num_gpu_blocks` of `vllm:cache_config_info`.
    pub num_gpu_blocks: u64,
    /// The KV pool: blocks × block size.
    pub pool_tokens: u64,
}

/// Everything a run measured and fitted: what `OUT.fit.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitReport {
    /// When the run started (UTC, RFC 3339).
    pub measured_at: String,
    /// The colocated engine.
    pub url: String,
    /// The prefill engine of the pair, when measured.
    pub prefill_url: Option<String>,
    /// The decode engine of the pair, when measured.
    pub decode_url: Option<String>,
    /// Where the model and hardware facts came from.
    pub facts: String,
    /// What the engine said about itself.
    pub engine: EngineFacts,
    /// The longest context a sweep sent.
    pub context_cap: u64,
    /// The chunked-prefill budget the prefill sweep stayed within.
    pub chunk_tokens: u64,
    /// Measurements of each point (their median is fitted).
    pub repeats: usize,
    /// The prompts' seed.
    pub seed: u64,
    /// Requests sent.
    pub requests: usize,
    /// Wall seconds the sweeps took.
    pub wall_s: f64,
    /// Median round trip of `GET /health` at the client, ms: part of every fitted fixed cost.
    pub client_rtt_ms: f64,
    /// The prefill sweep.
    pub prefill: SweepReport,
    /// The decode sweep.
    pub decode: SweepReport,
    /// The transfer sweep (`None`: no pair; the facts' transfer factors were kept).
    pub transfer: Option<SweepReport>,
    /// The intake sweep (`None`: the engine serves no chat; the facts' intake was kept).
    pub intake: Option<SweepReport>,
    /// What the user should know.
    pub warnings: Vec<String>,
}

/// A measured profile and its report.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileRun {
    /// The profile (valid: [`Profile::parse`] accepts its TOML).
    pub profile: Profile,
    /// What was measured and how well it fits.
    pub report: FitReport,
}

/// The profile of a run: the facts profile's `[model]` facts (with `max_input_tokens` from
/// the engine's `max_model_len` when it gave one), its `[hardware]` with the pool measured,
/// the fitted factors, and every other `[fit]` factor kept but `fit.attention_efficiency`,
/// which is set only when among the fitted factors (without it, the prefill fit gave all
/// prefill FLOPs one efficiency). A `max_input_tokens` the measured
/// pool cannot hold in 512-token blocks is lowered to what it can, with a warning.
pub fn build_profile(
    facts: &Profile,
    name: &str,
    engine: &EngineFacts,
    chunk_tokens: u64,
    factors: &[Factor],
    warnings: &mut Vec<String>,
) -> Result<Profile, ProfileError> {
    let mut p = facts.clone();
    p.name = name.to_owned();
    p.hardware.kv_pool_tokens = engine.pool_tokens;
    if let Some(len) = engine.max_model_len {
        p.model.max_input_tokens = len;
    }
    let room = engine.pool_tokens / 512 * 512;
    if p.model.max_input_tokens.div_ceil(512) * 512 > engine.pool_tokens {
        warnings.push(format!(
            "model.max_input_tokens lowered from {} to {room}: the simulator needs the longest \
             input to fit the KV pool ({} tokens) in 512-token blocks",
            p.model.max_input_tokens, engine.pool_tokens
        ));
        p.model.max_input_tokens = room;
    }
    p.fit.chunk_tokens = chunk_tokens;
    // Attention runs at its own efficiency only when the fit says so.
    p.fit.attention_efficiency = None;
    for f in factors {
        let slot = match f.key.as_str() {
            "fit.attention_efficiency" => {
                p.fit.attention_efficiency = Some(f.value);
                continue;
            }
            "fit.prefill_efficiency" => &mut p.fit.prefill_efficiency,
            "fit.prefill_overhead_ms" => &mut p.fit.prefill_overhead_ms,
            "fit.decode_efficiency" => &mut p.fit.decode_efficiency,
            "fit.decode_overhead_ms" => &mut p.fit.decode_overhead_ms,
            "fit.transfer_bytes_per_s" => &mut p.fit.transfer_bytes_per_s,
            "fit.transfer_setup_ms" => &mut p.fit.transfer_setup_ms,
            "fit.intake_ms" => &mut p.fit.intake_ms,
            "fit.intake_ms_per_1k_tokens" => &mut p.fit.intake_ms_per_1k_tokens,
            other => {
                return Err(ProfileError::Invalid(format!("no profile key {other}")));
            }
        };
        *slot = f.value;
    }
    let text = toml::to_string(&p).map_err(|e| ProfileError::Invalid(e.to_string()))?;
    Profile::parse(&text, "the measured profile").map_err(|e| ProfileError::Invalid(e.to_string()))
}

/// The profile as TOML, opened by a comment saying what was measured, when, against which
/// engine and model, and each sweep's residuals; `points_file` names the report with every
/// point.
pub fn profile_toml(run: &ProfileRun, points_file: &str) -> Result<String, ProfileError> {
    let r = &run.report;
    let body = toml::to_string(&run.profile).map_err(|e| ProfileError::Invalid(e.to_string()))?;
    let mut h = String::new();
    let mut line = |s: &str| {
        h.push_str(if s.is_empty() { "#" } else { "# " });
        h.push_str(s);
        h.push('\n');
    };
    line(&format!(
        "Engine profile measured by `kvc-replay profile` on {} against {} (model {}).",
        r.measured_at, r.url, r.engine.model
    ));
    if let (Some(p), Some(d)) = (&r.prefill_url, &r.decode_url) {
        line(&format!("Transfer measured on the P/D pair {p} -> {d}."));
    }
    line(&format!(
        "[model] and [hardware] facts from {}; hardware.kv_pool_tokens = {} blocks x {} tokens \
         (vllm:cache_config_info){}.",
        r.facts,
        r.engine.num_gpu_blocks,
        r.engine.block_size,
        match r.engine.max_model_len {
            Some(l) => format!("; model.max_input_tokens from max_model_len {l}"),
            None => String::new(),
        }
    ));
    line(&format!(
        "{} requests in {:.1} s, contexts up to {} tokens, chunked-prefill budget {}, each point \
         the median of {} (seed {}).",
        r.requests, r.wall_s, r.context_cap, r.chunk_tokens, r.repeats, r.seed
    ));
    line(&format!(
        "Fixed costs include the client's round trip (GET /health: {:.2} ms).",
        r.client_rtt_ms
    ));
    line("");
    line("Fit residuals (relative error of the fitted time; factors with one standard error):");
    let sweeps = [
        Some(&r.prefill),
        Some(&r.decode),
        r.transfer.as_ref(),
        r.intake.as_ref(),
    ];
    for s in sweeps.into_iter().flatten() {
        line(&format!(
            "  {:<8} {:>3} points, RMS {:.2} %, max {:.2} %; {}",
            s.sweep,
            s.residuals.points,
            s.residuals.rms_rel * 100.0,
            s.residuals.max_rel * 100.0,
            s.factors
                .iter()
                .map(|f| format!("{} = {} ± {}", f.key, sig(f.value), sig(f.stderr)))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        if let Some(one) = &s.one_efficiency_residuals {
            line(&format!(
                "           (one efficiency for all {} FLOPs would leave RMS {:.2} %, max {:.2} %)",
                s.sweep,
                one.rms_rel * 100.0,
                one.max_rel * 100.0
            ));
        }
    }
    if r.transfer.is_none() {
        line(
            "  transfer not measured (no --prefill-url/--decode-url): transfer factors kept from the facts.",
        );
    }
    if r.intake.is_none() {
        line(
            "  intake not measured (the engine served no chat request): intake kept from the facts.",
        );
    }
    for w in &r.warnings {
        line(&format!("warning: {w}"));
    }
    line(&format!(
        "Every point, measured and fitted: {points_file} beside this file."
    ));
    h.push('\n');
    h.push_str(&body);
    Ok(h)
}

/// `v` with four significant digits.
fn sig(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = 3 - v.abs().log10().floor() as i32;
    if (0..=6).contains(&digits) {
        format!("{v:.prec$}", prec = digits as usize)
    } else {
        format!("{v:.3e}")
    }
}

/// `secs` since the Unix epoch as RFC 3339 UTC (`2026-12-01T09:30:00Z`).
pub fn rfc3339(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Days since 1970-01-01 to a civil date (proleptic Gregorian), era by era of 400 years.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine of 2,048 blocks of 32 tokens with a 4,096-token context, serving `model`.
    fn engine_facts(model: &str) -> EngineFacts {
        EngineFacts {
            model: model.into(),
            max_model_len: Some(4096),
            block_size: 32,
            num_gpu_blocks: 2048,
            pool_tokens: 65_536,
        }
    }

    #[test]
    fn the_profile_keeps_the_facts_and_takes_the_fits() {
        let facts = Profile::default();
        let engine = engine_facts("m");
        let factors = [
            Factor {
                key: "fit.prefill_efficiency".into(),
                value: 0.3,
                stderr: 0.01,
            },
            Factor {
                key: "fit.decode_overhead_ms".into(),
                value: 7.5,
                stderr: 0.1,
            },
        ];
        let mut warnings = Vec::new();
        let p = build_profile(&facts, "mine", &engine, 2048, &factors, &mut warnings).unwrap();
        assert_eq!(p.name, "mine");
        assert_eq!(p.model.max_input_tokens, 4096);
        assert_eq!(p.hardware.kv_pool_tokens, 65_536);
        assert_eq!(p.fit.chunk_tokens, 2048);
        assert_eq!(
            (p.fit.prefill_efficiency, p.fit.decode_overhead_ms),
            (0.3, 7.5)
        );
        assert_eq!(p.fit.decode_efficiency, facts.fit.decode_efficiency);
        assert_eq!(p.fit.pressure, facts.fit.pressure);
        assert_eq!(p.model.layers, facts.model.layers);
        assert!(warnings.is_empty());
        // No max_model_len and a small pool: the facts' limit is lowered to fit it.
        let small = EngineFacts {
            max_model_len: None,
            pool_tokens: 20_000,
            ..engine
        };
        let p = build_profile(&facts, "mine", &small, 2048, &[], &mut warnings).unwrap();
        assert_eq!(p.model.max_input_tokens, 19_968);
        assert!(warnings[0].contains("lowered"), "{warnings:?}");
    }

    #[test]
    fn the_attention_efficiency_is_written_only_when_fitted() {
        let engine = engine_facts("m");
        let attention = Factor {
            key: "fit.attention_efficiency".into(),
            value: 0.05,
            stderr: 0.002,
        };
        let mut warnings = Vec::new();
        let p = build_profile(
            &Profile::default(),
            "mine",
            &engine,
            2048,
            &[attention],
            &mut warnings,
        )
        .unwrap();
        assert_eq!(p.fit.attention_efficiency, Some(0.05));
        // Facts that carry one from an earlier run: not kept when this fit gave none.
        let p = build_profile(&p, "again", &engine, 2048, &[], &mut warnings).unwrap();
        assert_eq!(p.fit.attention_efficiency, None);
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[test]
    fn prefill_points_are_fitted_with_attention_apart_and_reported_so() {
        // t = 10 ms + linear / 4e10 + attention / 5e9, the attention FLOPs a share of x.
        let measured: Vec<Measured> = [
            (2e9, 1e8),
            (4e9, 4e8),
            (8e9, 1.6e9),
            (16e9, 6.4e9),
            (2e9, 2e9),
            (8e9, 8e9),
        ]
        .iter()
        .map(|&(linear, attention)| Measured {
            inputs: serde_json::json!({ "linear": linear }),
            x: linear + attention,
            attention: Some(attention),
            seconds: vec![0.010 + linear / 4e10 + attention / 5e9],
            seen: Value::Null,
        })
        .collect();
        let (fit, mut prefill) = fit_prefill_points(&measured).unwrap();
        assert!(fit.line.separate_attention, "{:?}", fit.warnings);
        assert_eq!(prefill.model, PREFILL_MODEL_SPLIT);
        assert_eq!(prefill.prefill_line, Some(fit.line));
        assert_eq!(prefill.line, fit.one_rate.line);
        assert!(prefill.residuals.max_rel < 1e-9, "{:?}", prefill.residuals);
        let one = prefill.one_efficiency_residuals.unwrap();
        assert!(one.max_rel > 0.1, "{one:?}");
        for (p, m) in prefill.points.iter().zip(&measured) {
            assert_eq!(p.attention_flops, m.attention);
            assert_eq!(p.x, m.x);
            assert!((p.fitted_s - m.seconds[0]).abs() < 1e-12, "{p:?}");
            assert!(p.residual.abs() < 1e-9);
        }
        let json = serde_json::to_value(&prefill).unwrap();
        assert!(json["points"][0]["attention_flops"].as_f64().unwrap() == 1e8);
        assert_eq!(json["prefill_line"]["separate_attention"], true);
        prefill.factors = super::super::fit::prefill_factors(&fit.line, 1e11).unwrap();
        let head = header(prefill);
        let row = head
            .iter()
            .position(|l| l.starts_with("#   prefill "))
            .unwrap();
        assert!(
            head[row].contains("fit.prefill_efficiency = 0.4000 ± ")
                && head[row].contains("fit.attention_efficiency = 0.05000 ± "),
            "{}",
            head[row]
        );
        assert!(
            head[row + 1].contains("(one efficiency for all prefill FLOPs would leave RMS"),
            "{head:#?}"
        );

        // One efficiency for all FLOPs: the line of x, and no attention factor.
        let flat: Vec<Measured> = measured
            .iter()
            .map(|m| Measured {
                seconds: vec![0.010 + m.x / 4e10],
                ..m.clone()
            })
            .collect();
        let (fit, prefill) = fit_prefill_points(&flat).unwrap();
        assert!(!fit.line.separate_attention);
        assert_eq!(fit.warnings.len(), 1, "{:?}", fit.warnings);
        assert_eq!(prefill.model, PREFILL_MODEL_ONE);
        assert_eq!(prefill.one_efficiency_residuals, None);
        for p in &prefill.points {
            assert!((p.fitted_s - fit.one_rate.line.at(p.x)).abs() < 1e-15);
        }
    }

    /// The comment lines opening the TOML of a run whose prefill sweep is `prefill`.
    fn header(prefill: SweepReport) -> Vec<String> {
        let engine = engine_facts("kvc-tiny");
        let mut warnings = Vec::new();
        let profile = build_profile(
            &Profile::default(),
            "tiny",
            &engine,
            512,
            &prefill.factors,
            &mut warnings,
        )
        .unwrap();
        let run = ProfileRun {
            profile,
            report: FitReport {
                measured_at: rfc3339(0),
                url: "http://127.0.0.1:18080".into(),
                prefill_url: None,
                decode_url: None,
                facts: "the embedded default profile".into(),
                engine,
                context_cap: 4096,
                chunk_tokens: 512,
                repeats: 1,
                seed: 7,
                requests: 6,
                wall_s: 1.0,
                client_rtt_ms: 0.2,
                decode: SweepReport {
                    sweep: "decode".into(),
                    factors: Vec::new(),
                    ..prefill.clone()
                },
                prefill,
                transfer: None,
                intake: None,
                warnings,
            },
        };
        let text = profile_toml(&run, "tiny.fit.json").unwrap();
        let written = Profile::parse(&text, "written").unwrap();
        assert!((written.fit.attention_efficiency.unwrap() - 0.05).abs() < 1e-12);
        text.lines()
            .take_while(|l| l.starts_with('#'))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn dates_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_798_761_599), "2026-12-31T23:59:59Z");
    }

    #[test]
    fn significant_digits() {
        assert_eq!(sig(0.41234), "0.4123");
        assert_eq!(sig(30.91), "30.91");
        assert_eq!(sig(5.0e9), "5.000e9");
        assert_eq!(sig(0.0), "0");
    }

    #[test]
    fn the_toml_opens_with_what_was_measured_and_the_residuals_and_loads() {
        // t = 2 ms + x / 1e12 over three exact points.
        let measured: Vec<Measured> = [1e9, 2e9, 4e9]
            .iter()
            .map(|&x| Measured {
                inputs: serde_json::json!({ "x": x }),
                x,
                attention: None,
                seconds: vec![0.002 + x / 1e12, 0.002 + x / 1e12 + 1e-6],
                seen: Value::Null,
            })
            .collect();
        let (fit, mut prefill) = fit_points("prefill", "t = a + b x", &measured).unwrap();
        assert!(
            (fit.line.intercept - 0.0020005).abs() < 1e-9,
            "{:?}",
            fit.line
        );
        assert_eq!(prefill.points.len(), 3);
        assert_eq!(prefill.points[0].measured_s.len(), 2);
        assert!(prefill.points.iter().all(|p| p.residual.abs() < 1e-9));
        prefill.factors = vec![Factor {
            key: "fit.prefill_efficiency".into(),
            value: 0.25,
            stderr: 0.001,
        }];
        let mut decode = prefill.clone();
        decode.sweep = "decode".into();
        let engine = engine_facts("kvc-tiny");
        let mut warnings = vec!["decode: something to know".to_owned()];
        let profile = build_profile(
            &Profile::default(),
            "tiny",
            &engine,
            512,
            &[],
            &mut warnings,
        )
        .unwrap();
        let run = ProfileRun {
            profile,
            report: FitReport {
                measured_at: rfc3339(1_798_761_599),
                url: "http://127.0.0.1:18080".into(),
                prefill_url: None,
                decode_url: None,
                facts: "the embedded default profile".into(),
                engine,
                context_cap: 4096,
                chunk_tokens: 512,
                repeats: 2,
                seed: 7,
                requests: 96,
                wall_s: 12.5,
                client_rtt_ms: 0.2,
                prefill,
                decode,
                transfer: None,
                intake: None,
                warnings,
            },
        };
        let text = profile_toml(&run, "tiny.fit.json").unwrap();
        let head: Vec<&str> = text.lines().take_while(|l| l.starts_with('#')).collect();
        assert!(
            head[0]
                .contains("2026-12-31T23:59:59Z against http://127.0.0.1:18080 (model kvc-tiny)")
        );
        let row = head.iter().find(|l| l.starts_with("#   prefill ")).unwrap();
        assert!(
            row.contains("3 points, RMS 0.00 %") && row.contains("fit.prefill_efficiency = 0.2500"),
            "{row}"
        );
        assert!(head.iter().any(|l| l.contains("transfer not measured")));
        assert!(head.iter().any(|l| l.contains("intake not measured")));
        assert!(
            head.iter()
                .any(|l| l.contains("warning: decode: something to know"))
        );
        assert!(head.iter().any(|l| l.contains("tiny.fit.json")));
        assert_eq!(Profile::parse(&text, "written").unwrap(), run.profile);
    }

    /// A point measured in both passes keeps every time, in order; a point only the second
    /// pass measured is added; the fit then takes each point's median over both passes.
    #[test]
    fn a_sweep_measured_again_joins_the_first_pass_point_by_point() {
        use serde_json::json;
        let point = |batch: u32, x: f64, seconds: &[f64]| Measured {
            inputs: json!({ "batch": batch }),
            x,
            attention: None,
            seconds: seconds.to_vec(),
            seen: json!({}),
        };
        // The first pass: a slope lost in the noise (the larger points came out faster).
        let mut points = vec![
            point(1, 1.0, &[0.30, 0.10, 0.31]),
            point(4, 4.0, &[0.29]),
            point(8, 8.0, &[0.28]),
        ];
        assert!(matches!(
            fit_points("decode", "t", &points),
            Err(ProfileError::Unfittable { .. })
        ));
        let again = vec![
            point(4, 4.0, &[0.40, 0.41]),
            point(8, 8.0, &[0.50, 0.52]),
            point(16, 16.0, &[0.70]),
        ];
        merge_points(&mut points, again);
        assert_eq!(points.len(), 4);
        assert_eq!(points[0].seconds, [0.30, 0.10, 0.31]);
        assert_eq!(points[1].seconds, [0.29, 0.40, 0.41]);
        assert_eq!(points[2].seconds, [0.28, 0.50, 0.52]);
        assert_eq!(points[3].inputs, json!({ "batch": 16 }));
        let (fit, _) = fit_points("decode", "t", &points).unwrap();
        assert!(fit.line.slope > 0.0, "{:?}", fit.line);
    }
}
