//! Writing and reading run directories, and the comparison tables.
//!
//! A run directory holds `metrics.jsonl` (one [`RequestRecord`] per line, in trace order),
//! `summary.json` ([`Summary`]), `occupancy.csv` (time and pool use of every worker) and
//! `committed.csv` (what of each pool eviction cannot reclaim). [`stream_and_write`] writes
//! them as a run goes ([`RunDirWriter`]), [`write_run`] from a run kept in memory; both write
//! the same bytes.

use crate::sim::metrics::{RequestRecord, Summary};
use crate::sim::{
    Occupancy, Progress, RunSink, SimConfig, SimError, SimOutput, simulate, simulate_stream,
};
use crate::trace::{RequestSource, Trace, TraceArrivals};
use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;

mod background;
use background::BackgroundFile;

/// How a run shows its progress on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressMode {
    /// A bar on a terminal, once the run has taken a second; nothing elsewhere.
    #[default]
    Bar,
    /// A line every few seconds, terminal or not (for logs), besides the bar on a terminal.
    Lines,
    /// Nothing.
    Quiet,
}

/// The progress display of one run: a bar (its length the trace's bytes or requests,
/// whichever the source knows) with requests done and their rate, and with
/// [`ProgressMode::Lines`] a plain line every 5 s.
pub struct ProgressDisplay {
    mode: ProgressMode,
    started: std::time::Instant,
    bar: Option<indicatif::ProgressBar>,
    last_line: f64,
}

/// Bar positions per unit of the fraction read.
const BAR_STEPS: u64 = 10_000;

impl ProgressDisplay {
    /// A display in `mode`, starting now.
    pub fn new(mode: ProgressMode) -> Self {
        ProgressDisplay {
            mode,
            started: std::time::Instant::now(),
            bar: None,
            last_line: 0.0,
        }
    }

    /// Shows where the run stands.
    pub fn update(&mut self, p: &Progress) {
        if self.mode == ProgressMode::Quiet {
            return;
        }
        let elapsed = self.started.elapsed().as_secs_f64();
        let rate = p.completed as f64 / elapsed.max(1e-9);
        let fraction = match p.total {
            Some(t) => Some(p.completed as f64 / t.max(1) as f64),
            None => p.fraction_read,
        };
        if self.bar.is_none() && elapsed > 1.0 {
            let b = indicatif::ProgressBar::new(BAR_STEPS);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "simulating [{bar:40}] {percent}% {msg} ({eta} left)",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            self.bar = Some(b);
        }
        if let Some(b) = &self.bar {
            b.set_position((fraction.unwrap_or(0.0) * BAR_STEPS as f64) as u64);
            b.set_message(format!("{} requests, {rate:.0}/s", p.completed));
        }
        if self.mode == ProgressMode::Lines && elapsed - self.last_line >= 5.0 {
            self.last_line = elapsed;
            let share = fraction.map_or(String::new(), |f| format!(" ({:.1}%)", f * 100.0));
            let line = format!(
                "kvc-replay: {} requests simulated{share}, {rate:.0}/s, {elapsed:.0} s",
                p.completed
            );
            match &self.bar {
                Some(b) if !b.is_hidden() => b.println(line),
                _ => eprintln!("{line}"),
            }
        }
    }

    /// Clears the bar.
    pub fn finish(self) {
        if let Some(b) = self.bar {
            b.finish_and_clear();
        }
    }
}

/// Simulates `trace` under `cfg` (with a progress bar on stderr unless `quiet` or the run
/// takes under a second) and writes the run directory `out`; returns the summary.
pub fn run_and_write(trace: &Trace, cfg: &SimConfig, out: &Path, quiet: bool) -> Result<Summary> {
    let mode = if quiet {
        ProgressMode::Quiet
    } else {
        ProgressMode::Bar
    };
    let mut source = TraceArrivals::new(trace);
    if source.turns_in_trace_order() {
        return stream_and_write(&mut source, cfg, out, mode).map_err(anyhow::Error::from);
    }
    // A session whose turns are not in trace order: the summary is built from all records.
    let mut display = ProgressDisplay::new(mode);
    let n = trace.len();
    let output = simulate(trace, cfg, &mut |done, total| {
        display.update(&Progress {
            completed: done,
            read: n,
            total: Some(total),
            fraction_read: None,
        })
    })?;
    display.finish();
    write_run(&output, out)?;
    Ok(output.summary)
}

/// Simulates the requests of `source` under `cfg`, writing the run directory `out` as the run
/// goes (records in trace order as they complete, pool samples as they are taken), with
/// progress shown as `mode` says; returns the summary (also written to `summary.json`).
pub fn stream_and_write(
    source: &mut dyn RequestSource,
    cfg: &SimConfig,
    out: &Path,
    mode: ProgressMode,
) -> Result<Summary, SimError> {
    let mut display = ProgressDisplay::new(mode);
    let mut sink = RunDirWriter::create(out).map_err(|e| SimError::Output(format!("{e:#}")))?;
    let result = simulate_stream(source, cfg, &mut sink, &mut |p| display.update(p));
    display.finish();
    let streamed = result?;
    sink.finish(&streamed.summary)
        .map_err(|e| SimError::Output(format!("{e:#}")))?;
    Ok(streamed.summary)
}

/// A run directory written as the run goes: `metrics.jsonl` a record at a time,
/// `occupancy.csv` and `committed.csv` a row at a time, `summary.json` at the end. The bytes
/// are those [`write_run`] writes for the same run.
pub struct RunDirWriter {
    dir: std::path::PathBuf,
    /// Written on a thread of its own: the run's largest file.
    metrics: BackgroundFile,
    occupancy: BufWriter<std::fs::File>,
    committed: Option<BufWriter<std::fs::File>>,
    header: String,
    row: String,
}

impl RunDirWriter {
    /// Creates `dir` (if missing), its `metrics.jsonl` and `occupancy.csv`; a `summary.json`
    /// or `committed.csv` left by an earlier run is removed, so a run that fails part way
    /// never leaves a summary of other records.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        for stale in ["summary.json", "committed.csv"] {
            let path = dir.join(stale);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("cannot remove {}", path.display()));
                }
                _ => {}
            }
        }
        Ok(RunDirWriter {
            dir: dir.to_owned(),
            metrics: {
                let path = dir.join("metrics.jsonl");
                let file = std::fs::File::create(&path)
                    .with_context(|| format!("cannot write {}", path.display()))?;
                BackgroundFile::new(file)
                    .with_context(|| format!("cannot start the writer of {}", path.display()))?
            },
            occupancy: create_file(&dir.join("occupancy.csv"))?,
            committed: None,
            header: String::new(),
            row: String::new(),
        })
    }

    fn path_error(&self, name: &str, e: impl std::fmt::Display) -> SimError {
        SimError::Output(format!(
            "cannot write {}: {e}",
            self.dir.join(name).display()
        ))
    }

    /// Flushes the files and writes `summary.json`.
    pub fn finish(mut self, summary: &Summary) -> Result<()> {
        let flush = |w: &mut BufWriter<std::fs::File>, name: &str| -> Result<()> {
            w.flush()
                .with_context(|| format!("cannot write {}", self.dir.join(name).display()))
        };
        let metrics = self.dir.join("metrics.jsonl");
        self.metrics
            .finish()
            .with_context(|| format!("cannot write {}", metrics.display()))?;
        flush(&mut self.occupancy, "occupancy.csv")?;
        if let Some(c) = &mut self.committed {
            flush(c, "committed.csv")?;
        }
        write_summary(summary, &self.dir)
    }
}

fn create_file(path: &Path) -> Result<BufWriter<std::fs::File>> {
    let file =
        std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(BufWriter::with_capacity(1 << 20, file))
}

impl RunSink for RunDirWriter {
    fn start(&mut self, worker_names: &[String]) -> Result<(), SimError> {
        self.header = csv_header(worker_names);
        let header = std::mem::take(&mut self.header);
        let r = self.occupancy.write_all(header.as_bytes());
        self.header = header;
        r.map_err(|e| self.path_error("occupancy.csv", e))
    }

    fn record(&mut self, record: &RequestRecord) -> Result<(), SimError> {
        serde_json::to_writer(&mut self.metrics, record)
            .map_err(std::io::Error::from)
            .and_then(|()| self.metrics.write_all(b"\n"))
            .map_err(|e| self.path_error("metrics.jsonl", e))
    }

    fn sample(&mut self, time_s: f64, used: &[f64], committed: &[f64]) -> Result<(), SimError> {
        if self.committed.is_none() {
            let mut w = create_file(&self.dir.join("committed.csv"))
                .map_err(|e| SimError::Output(format!("{e:#}")))?;
            w.write_all(self.header.as_bytes())
                .map_err(|e| self.path_error("committed.csv", e))?;
            self.committed = Some(w);
        }
        let mut row = std::mem::take(&mut self.row);
        csv_row(&mut row, time_s, used);
        let r = self.occupancy.write_all(row.as_bytes());
        r.map_err(|e| self.path_error("occupancy.csv", e))?;
        csv_row(&mut row, time_s, committed);
        if let Some(w) = &mut self.committed {
            let r = w.write_all(row.as_bytes());
            r.map_err(|e| self.path_error("committed.csv", e))?;
        }
        self.row = row;
        Ok(())
    }
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
    write_summary(&output.summary, dir)?;
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

/// Writes `DIR/summary.json`.
fn write_summary(summary: &Summary, dir: &Path) -> Result<()> {
    let path = dir.join("summary.json");
    let mut text = serde_json::to_string_pretty(summary)?;
    text.push('\n');
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// `time_s,` and the worker names: the header of a fractions CSV.
fn csv_header(names: &[String]) -> String {
    let mut csv = String::from("time_s");
    for n in names {
        let _ = write!(csv, ",{n}");
    }
    csv.push('\n');
    csv
}

/// One row of a fractions CSV (time, then four decimals per worker) into `row`, replacing
/// what it held.
fn csv_row(row: &mut String, t: f64, fractions: &[f64]) {
    row.clear();
    let _ = write!(row, "{t}");
    for f in fractions {
        let _ = write!(row, ",{f:.4}");
    }
    row.push('\n');
}

/// `time_s` and one column per worker, four decimals, one row per sample.
fn occupancy_csv(names: &[String], rows: &Occupancy) -> String {
    let mut csv = csv_header(names);
    let mut row = String::new();
    for (t, fr) in rows {
        csv_row(&mut row, *t, fr);
        csv.push_str(&row);
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

const HEADLINE: [(&str, Metric); 11] = [
    ("TTFT mean (s)", |s| s.ttft_s.mean),
    ("TTFT p50 (s)", |s| s.ttft_s.p50),
    ("TTFT p90 (s)", |s| s.ttft_s.p90),
    ("TTFT p99 (s)", |s| s.ttft_s.p99),
    ("latency mean (s)", |s| s.latency_s.mean),
    ("latency p50 (s)", |s| s.latency_s.p50),
    ("latency p90 (s)", |s| s.latency_s.p90),
    ("latency p99 (s)", |s| s.latency_s.p99),
    ("direct-to-D rate", |s| s.direct_to_d_rate),
    ("prefilled (Mtok)", |s| {
        s.prompt_tokens.computed as f64 / 1e6
    }),
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
