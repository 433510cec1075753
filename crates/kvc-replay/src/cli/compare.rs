//! `kvc-replay compare`: the reference study's kind of table over run directories.

use anyhow::{Result, bail};
use kvc_replay::output::{compare_table, read_summary};
use kvc_replay::report::run_name;
use std::path::PathBuf;

/// Options of `kvc-replay compare`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Run directories written by `sim` or `live`; deltas are against the first.
    #[arg(required = true, num_args = 1..)]
    pub(crate) dirs: Vec<PathBuf>,
}

/// Runs `kvc-replay compare`.
pub(crate) fn run(args: Args) -> Result<()> {
    if args.dirs.is_empty() {
        bail!("give at least one run directory");
    }
    let mut runs = Vec::new();
    for d in &args.dirs {
        let s = read_summary(d)?;
        runs.push((run_name(d, &s), s));
    }
    print!("{}", compare_table(&runs));
    Ok(())
}
