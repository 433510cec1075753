//! `kvc-replay demo`: the embedded default run.

use anyhow::Result;
use kvc_core::Topology;
use kvc_policy::PolicyConfig;
use kvc_replay::output::{compare_table, read_summary, run_and_write};
use kvc_replay::report::{run_name, write_report};
use kvc_replay::sim::SimConfig;
use kvc_replay::trace::{self, generate::SweConfig};
use std::path::PathBuf;

/// Options of `kvc-replay demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Where to write the runs and the report.
    #[arg(long, default_value = "kvc-demo")]
    pub(crate) out: PathBuf,
    /// Seed of the generated SWE-agent trace.
    #[arg(long, default_value_t = 7)]
    pub(crate) seed: u64,
    /// Sessions in the generated trace.
    #[arg(long, default_value_t = 52)]
    pub(crate) sessions: usize,
    /// No progress bars.
    #[arg(long, short)]
    pub(crate) quiet: bool,
}

/// The demo's configurations: the colocated baseline, the study's KVC baseline, its fix,
/// kvc's default policy, and kvc on the best configuration of four GPUs measured
/// (`1p3d-hybrid`: the prefill worker hosts sessions too; docs/kvc-policy.md).
pub(crate) fn demo_configs() -> Result<Vec<(String, SimConfig)>> {
    let runs = [
        ("4dp", "cache-aware"),
        ("1p3d", "kv-aware-v0"),
        ("1p3d", "kvc-v2"),
        ("1p3d", "kvc"),
        ("1p3d-hybrid", "kvc"),
    ];
    runs.iter()
        .map(|(t, p)| {
            let topology: Topology = t.parse()?;
            let cfg = SimConfig::new(topology, PolicyConfig::from_name(p)?);
            Ok((format!("{t}-{p}"), cfg))
        })
        .collect()
}

/// Runs `kvc-replay demo`.
pub(crate) fn run(args: Args) -> Result<()> {
    let cfg = SweConfig {
        seed: args.seed,
        sessions: args.sessions,
        ..SweConfig::default()
    };
    let records = trace::generate::swe(&cfg);
    let trace_path = args.out.join("swe-trace.jsonl");
    std::fs::create_dir_all(&args.out)?;
    let file = std::io::BufWriter::new(std::fs::File::create(&trace_path)?);
    trace::write_jsonl(file, &records)?;
    let (trace, _) = trace::load(&trace_path, &trace::LoadOptions::default())?;
    eprintln!(
        "generated {} requests in {} sessions (seed {}) -> {}",
        trace.requests.len(),
        trace.sessions(),
        args.seed,
        trace_path.display()
    );
    let mut dirs = Vec::new();
    for (name, cfg) in demo_configs()? {
        let dir = args.out.join(&name);
        eprintln!("simulating {name} ...");
        run_and_write(&trace, &cfg, &dir, args.quiet)?;
        dirs.push(dir);
    }
    let mut runs = Vec::new();
    for d in &dirs {
        let s = read_summary(d)?;
        runs.push((run_name(d, &s), s));
    }
    print!("{}", compare_table(&runs));
    let report = write_report(&dirs, &args.out.join("report"))?;
    println!("\nreport: {}", report.display());
    Ok(())
}
