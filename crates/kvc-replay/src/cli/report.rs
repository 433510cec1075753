//! `kvc-replay report`: a Markdown report with SVG plots over run directories.

use anyhow::Result;
use std::path::PathBuf;

/// Options of `kvc-replay report`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Run directories written by `sim` or `live`; deltas are against the first.
    #[arg(required = true, num_args = 1..)]
    pub(crate) dirs: Vec<PathBuf>,
    /// Where to write report.md and the SVG plots.
    #[arg(long)]
    pub(crate) out: PathBuf,
}

/// Runs `kvc-replay report`.
pub(crate) fn run(args: Args) -> Result<()> {
    let path = kvc_replay::report::write_report(&args.dirs, &args.out)?;
    println!("wrote {}", path.display());
    Ok(())
}
