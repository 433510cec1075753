//! `kvc-replay`: trace tools (and, later, simulation and replay) for kvc.
#![forbid(unsafe_code)]

mod cli;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// Trace tools, simulation and replay for kvc.
#[derive(Debug, Parser)]
#[command(name = "kvc-replay", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate a synthetic trace (JSONL).
    Gen(cli::generate::Args),
    /// Summarize a trace: requests, sessions, token distributions, appends, gaps.
    Stats(cli::stats::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Gen(args) => cli::generate::run(args),
        Command::Stats(args) => cli::stats::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvc-replay: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
