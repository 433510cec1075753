//! `kvc-replay`: trace tools, simulation, comparisons and reports for kvc.
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
    /// Simulate a cluster and a routing policy on a trace (deterministic, virtual clock).
    Sim(cli::sim::Args),
    /// Replay a trace on a real clock through a real router in front of simulated workers:
    /// kvc-router over gRPC, or any router over HTTP (--http, --http-router URL).
    Live(Box<cli::live::Args>),
    /// Replay a trace on a real clock against real engines, or any router in front of them,
    /// over HTTP (OpenAI /v1/completions); records TTFT, latency, modes and cached tokens.
    Drive(Box<cli::drive::Args>),
    /// Measure a live engine (vLLM) with a bounded sweep and write an engine profile fitted to
    /// it (prefill, decode and P/D transfer factors), with the fit's residuals.
    Profile(Box<cli::profile::Args>),
    /// Standalone simulated vLLM workers (1p3d by default) serving any client's prompts,
    /// GPU-free, until Ctrl-C; writes a kvc-router configuration for them.
    Workers(Box<cli::workers::Args>),
    /// Compare run directories: headline metrics with deltas, and per execution mode.
    Compare(cli::compare::Args),
    /// Write a Markdown report with SVG plots for run directories.
    Report(cli::report::Args),
    /// Generate the SWE-agent trace, simulate the reference configurations and kvc, compare, report.
    Demo(cli::demo::Args),
    /// List the routing policies and their knobs with default values.
    Policies(cli::policies::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Gen(args) => cli::generate::run(args),
        Command::Stats(args) => cli::stats::run(args),
        Command::Sim(args) => cli::sim::run(args),
        Command::Live(args) => cli::live::run(*args),
        Command::Drive(args) => cli::drive::run(*args),
        Command::Profile(args) => cli::profile::run(*args),
        Command::Workers(args) => cli::workers::run(*args),
        Command::Compare(args) => cli::compare::run(args),
        Command::Report(args) => cli::report::run(args),
        Command::Demo(args) => cli::demo::run(args),
        Command::Policies(args) => cli::policies::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvc-replay: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
