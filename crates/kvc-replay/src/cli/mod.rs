//! Subcommands of `kvc-replay`, one module each, and the options they share.

pub(crate) mod compare;
pub(crate) mod demo;
pub(crate) mod drive;
pub(crate) mod generate;
pub(crate) mod live;
pub(crate) mod policies;
pub(crate) mod profile;
pub(crate) mod report;
pub(crate) mod sim;
pub(crate) mod stats;
pub(crate) mod workers;

use anyhow::Context;
use kvc_core::BlockSize;
use kvc_replay::trace::{self, LoadOptions, Trace};
use std::path::Path;
use std::time::Instant;

/// How to read a trace file (shared by every subcommand that reads one).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TraceArgs {
    /// Rebuild sessions of requests without `session_id` from their block ids: request B
    /// continues request A when B holds the last full block that first appeared in A and B's
    /// input is longer. Without it, each such request is its own session.
    #[arg(long)]
    pub(crate) infer_sessions: bool,

    /// Skip malformed lines instead of failing on the first one; how many were skipped (and
    /// the first errors) is reported on stderr.
    #[arg(long)]
    pub(crate) skip_invalid: bool,

    /// Tokens covered by one `hash_ids` entry; every record must have
    /// ceil(input_length / block size) ids.
    #[arg(long, value_name = "TOKENS", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) block_size: u32,
}

impl TraceArgs {
    /// The library's load options.
    pub(crate) fn options(&self) -> LoadOptions {
        LoadOptions {
            infer_sessions: self.infer_sessions,
            skip_invalid: self.skip_invalid,
            block_size: BlockSize::new(self.block_size).unwrap_or_default(),
        }
    }

    /// Loads `path`; reports skipped lines on stderr (always) and a summary line unless `quiet`.
    pub(crate) fn load(&self, path: &Path, quiet: bool) -> anyhow::Result<Trace> {
        let started = Instant::now();
        let (trace, report) = trace::load(path, &self.options())
            .with_context(|| format!("cannot load trace {}", path.display()))?;
        report_skipped(path, &report);
        if !quiet {
            eprintln!(
                "kvc-replay: loaded {} requests in {} sessions from {} ({:.2} s)",
                trace.len(),
                trace.sessions(),
                path.display(),
                started.elapsed().as_secs_f64()
            );
        }
        Ok(trace)
    }
}

/// A duration option given in seconds, which must be a finite number above 0; the error names
/// the option.
pub(crate) fn positive_seconds(name: &str, v: f64) -> anyhow::Result<std::time::Duration> {
    if !(v.is_finite() && v > 0.0) {
        anyhow::bail!("{name} must be a number of seconds > 0 (got {v})");
    }
    Ok(std::time::Duration::from_secs_f64(v))
}

/// Reports skipped lines of `path` on stderr, if any.
pub(crate) fn report_skipped(path: &Path, report: &trace::LoadReport) {
    if report.skipped == 0 {
        return;
    }
    eprintln!(
        "kvc-replay: skipped {} invalid line(s) of {}",
        report.skipped,
        path.display()
    );
    for err in &report.first_errors {
        eprintln!("  {err}");
    }
    if report.skipped > report.first_errors.len() {
        eprintln!(
            "  ... and {} more",
            report.skipped - report.first_errors.len()
        );
    }
}

/// Options about what a subcommand prints besides its output.
#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct OutputArgs {
    /// Print no progress or summary lines on stderr (warnings and errors still are).
    #[arg(long, short)]
    pub(crate) quiet: bool,
}
