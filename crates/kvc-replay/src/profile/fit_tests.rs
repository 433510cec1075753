//! Tests of the profile fits.

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
    // Steps of 4 ms, the client reading the chunks three at a time: each chunk arrives with
    // the last of its three (two gaps of 0 and one of 12 ms, whose median would say 0).
    let bursty = |start: f64| -> Vec<f64> {
        (0..30)
            .map(|i| start + f64::from(i / 3 * 3 + 2) * 0.004 + 0.000_1)
            .collect()
    };
    let streams = [0.0, 0.0].map(|start| StreamTimes {
        tokens: 30,
        chunks: bursty(start),
    });
    let est = decode_step(&streams, 0).unwrap();
    assert_eq!(est.method, StepMethod::PerToken);
    // The bursts' last chunks, tokens 2 and 29 of each stream: 27 steps of 4 ms.
    assert!(close(est.seconds, 0.004, 1e-12), "{est:?}");
    assert_eq!(est.samples, 54);
    // A window with no time in it tells nothing.
    let flat = [StreamTimes {
        tokens: 10,
        chunks: vec![1.0; 10],
    }];
    assert!(decode_step(&flat, 0).is_none());
}

#[test]
fn a_stream_held_back_by_a_loaded_machine_does_not_shorten_the_step() {
    // Steps of 10 ms. Stream b's API server was not scheduled for its first 12 tokens and
    // sent them at once with the 12th; stream c came whole in one burst at its end.
    let steady: Vec<f64> = (0..40).map(|i| f64::from(i) * 0.010).collect();
    let held: Vec<f64> = (0..40)
        .map(|i| f64::from(i.max(11)) * 0.010 + 0.000_2)
        .collect();
    let whole = vec![0.390_3; 40];
    let stream = |chunks: &Vec<f64>| StreamTimes {
        tokens: 40,
        chunks: chunks.clone(),
    };
    let est = decode_step(&[stream(&steady), stream(&held)], 0).unwrap();
    // The window: from b's first chunk (110.2 ms) to a's last (390 ms). Trusted ends: a's
    // tokens 12 and 39, b's 11 (its burst's last) and 38.
    assert!(close(est.seconds, 0.010, 1e-9), "{est:?}");
    assert_eq!(est.samples, 27 + 27);
    // Every chunk of the window taken as it came would have said (0.27 + 0.27) / (27 + 38)
    // = 8.3 ms. A stream that came whole in one burst says nothing of a step.
    assert!(decode_step(&[stream(&whole)], 0).is_none());
}

#[test]
fn the_engine_s_counters_give_its_own_step() {
    let before = DecodeCounters {
        decode_seconds: 10.0,
        finished: 40.0,
        generated: 1_000.0,
    };
    // Four streams of 32 tokens: 4 × 31 steps in 2.48 s of decoding.
    let after = DecodeCounters {
        decode_seconds: 12.48,
        finished: 44.0,
        generated: 1_128.0,
    };
    let est = engine_decode_step(&before, &after, 4).unwrap();
    assert_eq!((est.method, est.samples), (StepMethod::Engine, 124));
    assert!(close(est.seconds, 0.020, 1e-12), "{est:?}");
    // A fifth request finished in between (another client's): not this point's alone.
    let mixed = DecodeCounters {
        finished: 45.0,
        generated: 1_129.0,
        ..after
    };
    assert!(engine_decode_step(&before, &mixed, 4).is_none());
    // One-token answers time no step.
    let one_token = DecodeCounters {
        decode_seconds: 10.0,
        finished: 44.0,
        generated: 1_004.0,
    };
    assert!(engine_decode_step(&before, &one_token, 4).is_none());
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
    let t =
        b / (p.fit.decode_efficiency * p.hardware.hbm_bytes_per_s) + p.fit.decode_overhead_ms / 1e3;
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

#[test]
fn the_intake_line_gives_back_its_fixed_cost_and_growth() {
    // 6 ms + 2 ms per 1,000 tokens.
    let pts: Vec<(f64, f64)> = [258.0, 514.0, 1026.0, 2050.0]
        .iter()
        .map(|&n| (n, 0.006 + 2e-6 * n))
        .collect();
    let (line, warnings) = intake_line(&pts).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert!(
        close(line.intercept, 0.006, 1e-9) && close(line.slope, 2e-6, 1e-9),
        "{line:?}"
    );
    let f = intake_factors(&line);
    assert_eq!(f[0].key, "fit.intake_ms");
    assert!(close(f[0].value, 6.0, 1e-9));
    assert_eq!(f[1].key, "fit.intake_ms_per_1k_tokens");
    assert!(close(f[1].value, 2.0, 1e-9));
    assert!(f[0].stderr < 1e-9 && f[1].stderr < 1e-9);
}

#[test]
fn an_intake_that_shrinks_with_the_prompt_is_taken_as_its_mean() {
    let pts = [(256.0, 0.0062), (512.0, 0.0060), (1024.0, 0.0055)];
    let (line, warnings) = intake_line(&pts).unwrap();
    assert_eq!(line.slope, 0.0);
    assert!(close(
        line.intercept,
        (0.0062 + 0.0060 + 0.0055) / 3.0,
        1e-12
    ));
    assert!(line.intercept_se > 0.0);
    assert_eq!(warnings.len(), 1);
    assert!(
        warnings[0].contains("below 0") && warnings[0].contains("mean"),
        "{warnings:?}"
    );
}

#[test]
fn an_intake_below_zero_at_no_tokens_goes_through_the_origin() {
    // Grows 4 ms per 1,000 tokens from -0.5 ms: the line through the origin instead.
    let pts = [(256.0, 0.000524), (512.0, 0.001548), (1024.0, 0.003596)];
    let (line, warnings) = intake_line(&pts).unwrap();
    assert!(line.through_origin && line.intercept == 0.0, "{line:?}");
    let want =
        pts.iter().map(|p| p.0 * p.1).sum::<f64>() / pts.iter().map(|p| p.0 * p.0).sum::<f64>();
    assert!(close(line.slope, want, 1e-12));
    assert_eq!(warnings.len(), 1);
    assert!(warnings[0].contains("clamped to 0"), "{warnings:?}");
}

#[test]
fn no_intake_at_all_is_zero_with_one_warning() {
    // A chat no slower than its token ids (workers without a front end), within the noise.
    let pts = [(258.0, -0.0002), (514.0, 0.0001), (1026.0, -0.0004)];
    let (line, warnings) = intake_line(&pts).unwrap();
    assert_eq!((line.intercept, line.slope), (0.0, 0.0));
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("no intake (0)"), "{warnings:?}");
    let err = intake_line(&[(258.0, 0.001), (258.0, 0.002), (258.0, 0.003)]).unwrap_err();
    assert!(
        matches!(
            err,
            ProfileError::TooFewPoints {
                sweep: "intake",
                ..
            }
        ),
        "{err}"
    );
}
