//! Markdown reports with SVG plots: TTFT and latency CDFs per run, decode-pool occupancy over
//! time (used and committed), execution-mode shares, and failures per worker and over time.

use crate::output::{compare_table, read_committed, read_occupancy, read_records, read_summary};
use crate::sim::metrics::RequestRecord;
use anyhow::{Context, Result};
use kvc_core::stats::percentile;
use kvc_core::{Outcome, StableName};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Points, x ascending.
    pub points: Vec<(f64, f64)>,
}

/// The x axis of a chart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum XAxis {
    /// Linear from 0 to the maximum.
    Linear(f64),
    /// Logarithmic (base 10) between two positive bounds.
    Log(f64, f64),
}

/// An SVG line chart with axes, ticks and a legend.
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    x_axis: XAxis,
    y_max: f64,
) -> String {
    let (w, h) = (720.0, 420.0);
    let (left, right, top, bottom) = (70.0, 200.0, 40.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let y_max = if y_max > 0.0 { y_max } else { 1.0 };
    let (lo, hi, log) = match x_axis {
        XAxis::Linear(m) => (0.0, if m > 0.0 { m } else { 1.0 }, false),
        XAxis::Log(a, b) => {
            let a = if a > 0.0 { a } else { 1e-3 };
            (a.log10(), b.max(a * 10.0).log10(), true)
        }
    };
    let sx = |x: f64| {
        let v = if log { x.max(1e-12).log10() } else { x };
        left + ((v - lo) / (hi - lo)).clamp(0.0, 1.0) * pw
    };
    let sy = |y: f64| top + ph - (y / y_max).clamp(0.0, 1.0) * ph;
    let mut s = svg_open(w, h, left + pw / 2.0, title);
    let x_ticks: Vec<f64> = if log {
        (lo.floor() as i32..=hi.ceil() as i32)
            .map(|e| 10f64.powi(e))
            .filter(|x| x.log10() >= lo - 1e-9 && x.log10() <= hi + 1e-9)
            .collect()
    } else {
        (0..=5).map(|i| hi * f64::from(i) / 5.0).collect()
    };
    for fx in x_ticks {
        let _ = writeln!(
            s,
            r##"<line x1="{x}" y1="{top}" x2="{x}" y2="{b}" stroke="#ddd"/><text x="{x}" y="{ty}" text-anchor="middle">{}</text>"##,
            tick(fx),
            x = sx(fx),
            b = top + ph,
            ty = top + ph + 16.0
        );
    }
    for i in 0..=5 {
        let fy = y_max * f64::from(i) / 5.0;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{y}" x2="{r}" y2="{y}" stroke="#ddd"/><text x="{tx}" y="{ty}" text-anchor="end">{}</text>"##,
            tick(fy),
            y = sy(fy),
            r = left + pw,
            tx = left - 6.0,
            ty = sy(fy) + 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        left + pw / 2.0,
        h - 12.0,
        esc(x_label)
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{}" text-anchor="middle" transform="rotate(-90 18 {})">{}</text>"#,
        top + ph / 2.0,
        top + ph / 2.0,
        esc(y_label)
    );
    for (i, se) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut d = String::new();
        for (j, (x, y)) in se.points.iter().enumerate() {
            let _ = write!(
                d,
                "{}{:.1},{:.1} ",
                if j == 0 { "M" } else { "L" },
                sx(*x),
                sy(*y)
            );
        }
        let _ = writeln!(
            s,
            r#"<path d="{}" fill="none" stroke="{color}" stroke-width="1.6"/>"#,
            d.trim_end()
        );
        let ly = top + 14.0 + i as f64 * 18.0;
        let lx = left + pw + 12.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            lx + 18.0,
            lx + 24.0,
            ly + 4.0,
            esc(&se.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// A horizontal stacked bar per run: the share of each execution mode.
pub fn share_chart(title: &str, runs: &[(String, Vec<(String, f64)>)]) -> String {
    let w = 720.0;
    let bar_h = 26.0;
    let top = 40.0;
    let left = 190.0;
    let pw = 480.0;
    let mut modes: Vec<String> = runs
        .iter()
        .flat_map(|(_, m)| m.iter().map(|(k, _)| k.clone()))
        .collect();
    modes.sort();
    modes.dedup();
    let h = top + runs.len() as f64 * (bar_h + 10.0) + 30.0 + 18.0 * modes.len().div_ceil(3) as f64;
    let mut s = svg_open(w, h, w / 2.0, title);
    for (i, (name, shares)) in runs.iter().enumerate() {
        let y = top + i as f64 * (bar_h + 10.0);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            left - 8.0,
            y + bar_h / 2.0 + 4.0,
            esc(name)
        );
        let mut x = left;
        for (mode, share) in shares {
            let k = modes.iter().position(|m| m == mode).unwrap_or(0);
            let bw = share * pw;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{y}" width="{bw:.1}" height="{bar_h}" fill="{}"><title>{}: {:.1}%</title></rect>"#,
                COLORS[k % COLORS.len()],
                esc(mode),
                share * 100.0
            );
            x += bw;
        }
    }
    let ly = top + runs.len() as f64 * (bar_h + 10.0) + 14.0;
    for (k, mode) in modes.iter().enumerate() {
        let lx = left + (k % 3) as f64 * 160.0;
        let y = ly + (k / 3) as f64 * 18.0;
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            y - 10.0,
            COLORS[k % COLORS.len()],
            lx + 16.0,
            y,
            esc(mode)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else if v >= 0.01 {
        format!("{v:.2}")
    } else {
        format!("{v:.0e}")
    }
}

/// The start of every plot: the SVG element `w`×`h`, a white page, and `title` centred on `title_x`.
fn svg_open(w: f64, h: f64, title_x: f64, title: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{title_x}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        esc(title)
    );
    s
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The power of ten at or below `x` (0.001 for non-positive or tiny values).
fn decade_below(x: f64) -> f64 {
    if x.is_finite() && x > 1e-3 {
        10f64.powi(x.log10().floor() as i32)
    } else {
        1e-3
    }
}

/// Empirical CDF points of `values` (at most ~200 points).
pub fn cdf(mut values: Vec<f64>) -> Vec<(f64, f64)> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return vec![];
    }
    let step = (n / 200).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (values[i], (i + 1) as f64 / n as f64))
        .collect();
    pts.push((values[n - 1], 1.0));
    pts
}

/// Writes `report.md` and its SVG plots into `out` for the run directories `runs`.
/// Returns the report's path.
pub fn write_report(runs: &[PathBuf], out: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut summaries = Vec::new();
    let mut ttft = Vec::new();
    let mut lat = Vec::new();
    let (mut ttft_max, mut lat_max) = (0.0f64, 0.0f64);
    let (mut ttft_min, mut lat_min) = (f64::INFINITY, f64::INFINITY);
    for dir in runs {
        let s = read_summary(dir)?;
        let name = run_name(dir, &s);
        let recs = read_records(dir)?;
        let ok = recs.iter().filter(|r| r.outcome.is_served());
        let t: Vec<f64> = ok.clone().filter_map(|r| r.ttft_s).collect();
        let l: Vec<f64> = ok.map(|r| r.latency_s).collect();
        let mut ts = t.clone();
        ts.sort_by(f64::total_cmp);
        let mut ls = l.clone();
        ls.sort_by(f64::total_cmp);
        ttft_max = ttft_max.max(ts.last().copied().unwrap_or(1.0));
        lat_max = lat_max.max(ls.last().copied().unwrap_or(1.0));
        // The axes start at the 1st percentile (10‰).
        ttft_min = ttft_min.min(percentile(&ts, 10).unwrap_or(0.0));
        lat_min = lat_min.min(percentile(&ls, 10).unwrap_or(0.0));
        ttft.push(Series {
            name: name.clone(),
            points: cdf(t),
        });
        lat.push(Series {
            name: name.clone(),
            points: cdf(l),
        });
        summaries.push((name, s));
    }
    let mut md = String::from("# kvc replay report\n\n");
    md.push_str(&compare_table(&summaries));
    md.push('\n');
    let write = |file: &str, svg: String| -> Result<()> {
        let p = out.join(file);
        std::fs::write(&p, svg).with_context(|| format!("cannot write {}", p.display()))
    };
    write(
        "ttft_cdf.svg",
        line_chart(
            "TTFT CDF (served requests)",
            "TTFT (s, log scale)",
            "fraction of requests",
            &ttft,
            XAxis::Log(decade_below(ttft_min), ttft_max),
            1.0,
        ),
    )?;
    write(
        "latency_cdf.svg",
        line_chart(
            "Latency CDF (served requests)",
            "latency (s, log scale)",
            "fraction of requests",
            &lat,
            XAxis::Log(decade_below(lat_min), lat_max),
            1.0,
        ),
    )?;
    md.push_str(
        "\n## Distributions\n\n![TTFT CDF](ttft_cdf.svg)\n\n![Latency CDF](latency_cdf.svg)\n",
    );
    let shares: Vec<(String, Vec<(String, f64)>)> = summaries
        .iter()
        .map(|(n, s)| {
            (
                n.clone(),
                s.modes.iter().map(|(m, v)| (m.clone(), v.share)).collect(),
            )
        })
        .collect();
    write("modes.svg", share_chart("Execution-mode shares", &shares))?;
    md.push_str(
        "\n## Execution modes\n\n![Execution-mode shares](modes.svg)\n\n## Pool occupancy\n\n",
    );
    // One chart of a per-decode-worker fraction over time.
    let pool_chart = |file: &str,
                      title: &str,
                      y: &str,
                      names: &[String],
                      rows: &[(f64, Vec<f64>)],
                      t_max: f64| {
        let series = decode_series(names, rows);
        write(
            file,
            line_chart(title, "time (s)", y, &series, XAxis::Linear(t_max), 1.0),
        )
    };
    for (i, dir) in runs.iter().enumerate() {
        let (names, rows) = read_occupancy(dir)?;
        let t_max = rows.last().map_or(1.0, |r| r.0);
        let file = format!("occupancy_{i}.svg");
        let title = format!("KV pool use over time: {}", summaries[i].0);
        pool_chart(&file, &title, "used fraction", &names, &rows, t_max)?;
        let _ = writeln!(md, "![{title}]({file})\n");
        if let Some((names, rows)) = read_committed(dir)? {
            let file = format!("committed_{i}.svg");
            let title = format!("KV pool committed (not evictable): {}", summaries[i].0);
            pool_chart(&file, &title, "committed fraction", &names, &rows, t_max)?;
            let _ = writeln!(md, "![{title}]({file})\n");
        }
    }
    md.push_str("\n## Failures\n\n");
    for (i, dir) in runs.iter().enumerate() {
        let name = &summaries[i].0;
        let recs = read_records(dir)?;
        let failed: Vec<&RequestRecord> = recs
            .iter()
            .filter(|r| r.outcome.is_mechanism_error())
            .collect();
        if failed.is_empty() {
            let _ = writeln!(md, "{name}: no mechanism errors.\n");
            continue;
        }
        md.push_str(&failure_table(name, &failed));
        let file = format!("failures_{i}.svg");
        let title = format!("Failures over time: {name}");
        let t_max = recs.iter().map(|r| r.done_s).fold(1.0, f64::max);
        write(
            &file,
            line_chart(
                &title,
                "time (s)",
                "failed requests (cumulative)",
                &failure_series(&failed),
                XAxis::Linear(t_max),
                failed.len() as f64,
            ),
        )?;
        let _ = writeln!(md, "![{title}]({file})\n");
    }
    md.push_str("\nOutcomes per run:\n\n| run | ");
    let outcome_names: Vec<&str> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
    md.push_str(&outcome_names.join(" | "));
    md.push_str(" |\n|---|");
    md.push_str(&"---:|".repeat(outcome_names.len()));
    md.push('\n');
    for (n, s) in &summaries {
        let _ = write!(md, "| {n} |");
        for o in &outcome_names {
            let _ = write!(md, " {} |", s.outcomes.get(*o).copied().unwrap_or(0));
        }
        md.push('\n');
    }
    let path = out.join("report.md");
    std::fs::write(&path, md).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// Occupancy series of the decode (and colocated) workers, prefill workers left out.
fn decode_series(names: &[String], rows: &[(f64, Vec<f64>)]) -> Vec<Series> {
    names
        .iter()
        .enumerate()
        .filter(|(_, n)| !n.starts_with('p'))
        .map(|(k, n)| Series {
            name: n.clone(),
            points: rows
                .iter()
                .map(|(t, f)| (*t, f.get(k).copied().unwrap_or(0.0)))
                .collect(),
        })
        .collect()
}

/// Markdown: failed requests of one run per decode worker, per prefill worker and per P–D
/// pair, by outcome.
fn failure_table(run: &str, failed: &[&RequestRecord]) -> String {
    let outcomes: Vec<Outcome> = Outcome::ALL
        .iter()
        .copied()
        .filter(|o| failed.iter().any(|r| r.outcome == *o))
        .collect();
    let mut rows: BTreeMap<(u8, String), BTreeMap<Outcome, usize>> = BTreeMap::new();
    for r in failed {
        let decode = r.decode.clone().unwrap_or_else(|| "–".into());
        let mut keys = vec![(0, decode.clone())];
        if let Some(p) = &r.prefill {
            keys.push((1, p.clone()));
            keys.push((2, format!("{p}→{decode}")));
        }
        for k in keys {
            *rows.entry(k).or_default().entry(r.outcome).or_default() += 1;
        }
    }
    let mut md = format!("{run}: {} failed requests.\n\n| worker |", failed.len());
    for o in &outcomes {
        let _ = write!(md, " {} |", o.as_str());
    }
    md.push_str(" retractions |\n|---|");
    md.push_str(&"---:|".repeat(outcomes.len() + 1));
    md.push('\n');
    for ((_, w), counts) in &rows {
        let _ = write!(md, "| {w} |");
        for o in &outcomes {
            let _ = write!(md, " {} |", counts.get(o).copied().unwrap_or(0));
        }
        let retracted: u32 = failed
            .iter()
            .filter(|r| {
                r.decode.as_deref() == Some(w)
                    || r.prefill.as_deref() == Some(w)
                    || r.prefill
                        .as_ref()
                        .zip(r.decode.as_ref())
                        .is_some_and(|(p, d)| format!("{p}→{d}") == *w)
            })
            .map(|r| r.retractions)
            .sum();
        let _ = writeln!(md, " {retracted} |");
    }
    md.push('\n');
    md
}

/// Cumulative failed requests over time, one series per decode worker and one per prefill
/// worker (`via p0`: the failed P→D requests it prefilled), so a P that takes most of the
/// failures shows beside the D they were bound for.
fn failure_series(failed: &[&RequestRecord]) -> Vec<Series> {
    let mut by_worker: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in failed {
        let w = r.decode.clone().unwrap_or_else(|| "–".into());
        by_worker.entry(w).or_default().push(r.done_s);
        if let Some(p) = &r.prefill {
            by_worker
                .entry(format!("via {p}"))
                .or_default()
                .push(r.done_s);
        }
    }
    by_worker
        .into_iter()
        .map(|(name, mut times)| {
            times.sort_by(f64::total_cmp);
            let mut points = vec![(0.0, 0.0)];
            for (k, t) in times.iter().enumerate() {
                points.push((*t, k as f64));
                points.push((*t, (k + 1) as f64));
            }
            Series { name, points }
        })
        .collect()
}

/// A run's display name: `topology+policy tsN`.
pub fn run_name(dir: &Path, s: &crate::sim::metrics::Summary) -> String {
    let _ = dir;
    format!(
        "{}+{} ts{}",
        s.config.topology, s.config.policy, s.config.time_scale
    )
}
