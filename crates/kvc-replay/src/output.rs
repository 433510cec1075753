//! Writing and reading run directories, and the comparison tables.
//!
//! A run directory holds `metrics.jsonl` (one [`RequestRecord`] per line, in trace order),
//! `summary.json` ([`Summary`]) and `occupancy.csv` (time and pool use of every worker).

use crate::sim::metrics::{RequestRecord, Summary};
use crate::sim::{Occupancy, SimConfig, SimOutput, simulate};
use crate::trace::Trace;
use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;

/// Simulates `trace` under `cfg` (with a progress bar on stderr unless `quiet` or the run
/// takes under a second) and writes the run directory `out`.
pub fn run_and_write(trace: &Trace, cfg: &SimConfig, out: &Path, quiet: bool) -> Result<SimOutput> {
    let started = std::time::Instant::now();
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut progress = |done: usize, total: usize| {
        if quiet {
            return;
        }
        if bar.is_none() && started.elapsed().as_secs_f64() > 1.0 {
            let b = indicatif::ProgressBar::new(total as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:40}] {pos}/{len} requests ({eta} left)",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            b.set_message("simulating");
            bar = Some(b);
        }
        if let Some(b) = &bar {
            b.set_position(done as u64);
        }
    };
    let output = simulate(trace, cfg, &mut progress)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    write_run(&output, out)?;
    Ok(output)
}

/// Writes `metrics.jsonl`, `summary.json` and `occupancy.csv` into `dir`.
pub fn write_run(output: &SimOutput, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join("metrics.jsonl");
    let file =
        std::fs::File::create(&path).with_context(|| format!("cannot write {}", path.display()))?;
    let mut w = BufWriter::new(file);
    for r in &output.records {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n")?;
    }
    w.flush()?;
    let path = dir.join("summary.json");
    let mut text = serde_json::to_string_pretty(&output.summary)?;
    text.push('\n');
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    let csv = occupancy_csv(&output.worker_names, &output.occupancy);
    let path = dir.join("occupancy.csv");
    std::fs::write(&path, csv).with_context(|| format!("cannot write {}", path.display()))?;
    if !output.committed.is_empty() {
        let path = dir.join("committed.csv");
        std::fs::write(
            &path,
            occupancy_csv(&output.worker_names, &output.committed),
        )
        .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// `time_s` and one column per worker, four decimals, one row per sample.
fn occupancy_csv(names: &[String], rows: &Occupancy) -> String {
    let mut csv = String::from("time_s");
    for n in names {
        let _ = write!(csv, ",{n}");
    }
    csv.push('\n');
    for (t, fr) in rows {
        let _ = write!(csv, "{t}");
        for f in fr {
            let _ = write!(csv, ",{f:.4}");
        }
        csv.push('\n');
    }
    csv
}

/// Reads `DIR/summary.json`.
pub fn read_summary(dir: &Path) -> Result<Summary> {
    let path = dir.join("summary.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {} (is it a run directory?)", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("invalid {}", path.display()))
}

/// Reads `DIR/metrics.jsonl`.
pub fn read_records(dir: &Path) -> Result<Vec<RequestRecord>> {
    let path = dir.join("metrics.jsonl");
    let file =
        std::fs::File::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("cannot read {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line)
                .with_context(|| format!("{}:{}: invalid record", path.display(), i + 1))?,
        );
    }
    Ok(out)
}

/// Reads `DIR/occupancy.csv`: worker names and (time, fractions) rows.
pub fn read_occupancy(dir: &Path) -> Result<(Vec<String>, Occupancy)> {
    read_fractions(&dir.join("occupancy.csv"))
}

/// Reads `DIR/committed.csv` (the committed share of every pool) if the run wrote one.
pub fn read_committed(dir: &Path) -> Result<Option<(Vec<String>, Occupancy)>> {
    let path = dir.join("committed.csv");
    if path.exists() {
        read_fractions(&path).map(Some)
    } else {
        Ok(None)
    }
}

/// Reads a `time_s,worker…` CSV of fractions.
fn read_fractions(path: &Path) -> Result<(Vec<String>, Occupancy)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut lines = text.lines();
    let header = lines.next().unwrap_or("");
    let names: Vec<String> = header.split(',').skip(1).map(str::to_owned).collect();
    let mut rows = Vec::new();
    for (i, l) in lines.enumerate() {
        let nums: Result<Vec<f64>, _> = l.split(',').map(str::parse::<f64>).collect();
        let nums = nums.with_context(|| format!("{}:{}: not numbers", path.display(), i + 2))?;
        if let Some((t, rest)) = nums.split_first() {
            rows.push((*t, rest.to_vec()));
        }
    }
    Ok((names, rows))
}

/// A figure read off a summary.
type Metric = fn(&Summary) -> f64;

const HEADLINE: [(&str, Metric); 10] = [
    ("TTFT mean (s)", |s| s.ttft_s.mean),
    ("TTFT p50 (s)", |s| s.ttft_s.p50),
    ("TTFT p90 (s)", |s| s.ttft_s.p90),
    ("TTFT p99 (s)", |s| s.ttft_s.p99),
    ("latency mean (s)", |s| s.latency_s.mean),
    ("latency p50 (s)", |s| s.latency_s.p50),
    ("latency p90 (s)", |s| s.latency_s.p90),
    ("latency p99 (s)", |s| s.latency_s.p99),
    ("direct-to-D rate", |s| s.direct_to_d_rate),
    ("mechanism errors", |s| s.mechanism_errors as f64),
];

/// A short table of each run's headline figures.
pub fn summary_table(runs: &[(String, &Summary)]) -> String {
    let mut out = String::new();
    let _ = write!(out, "{:<18}", "metric");
    for (name, _) in runs {
        let _ = write!(out, " {name:>24}");
    }
    out.push('\n');
    for (label, f) in HEADLINE {
        let _ = write!(out, "{label:<18}");
        for (_, s) in runs {
            let _ = write!(out, " {:>24}", fmt_num(f(s)));
        }
        out.push('\n');
    }
    out
}

fn fmt_num(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e12 {
        format!("{x:.0}")
    } else {
        format!("{x:.3}")
    }
}

/// The reference study's kind of table: each headline metric per run with deltas against the
/// first, then a per-execution-mode table (share, latency p50, TTFT p50). Markdown.
pub fn compare_table(runs: &[(String, Summary)]) -> String {
    let mut out = String::new();
    let Some((_, base)) = runs.first() else {
        return out;
    };
    out.push_str("| metric |");
    for (name, _) in runs {
        let _ = write!(out, " {name} |");
    }
    out.push_str("\n|---|");
    for _ in runs {
        out.push_str("---:|");
    }
    out.push('\n');
    let mut rows: Vec<(&str, Metric)> = HEADLINE.to_vec();
    rows.push(("worker spread (±)", |s| s.worker_spread));
    rows.push(("D changes / session", |s| s.sessions.d_changes_mean));
    for (label, f) in &rows {
        let _ = write!(out, "| {label} |");
        let b = f(base);
        for (i, (_, s)) in runs.iter().enumerate() {
            let v = f(s);
            if i == 0 {
                let _ = write!(out, " {} |", fmt_num(v));
            } else {
                let _ = write!(out, " {} ({}) |", fmt_num(v), delta(b, v));
            }
        }
        out.push('\n');
    }
    out.push_str(
        "\n| run | mode | share | latency p50 (s) | TTFT p50 (s) |\n|---|---|---:|---:|---:|\n",
    );
    for (name, s) in runs {
        for (mode, m) in &s.modes {
            let _ = writeln!(
                out,
                "| {name} | {mode} | {:.1}% | {:.3} | {:.3} |",
                m.share * 100.0,
                m.latency_p50_s,
                m.ttft_p50_s
            );
        }
    }
    out
}

fn delta(base: f64, v: f64) -> String {
    let d = v - base;
    if base.abs() > 1e-12 {
        format!("{:+.1}%", d / base * 100.0)
    } else {
        format!("{d:+.3}")
    }
}
