//! Shared helpers of the simulator tests (included with `mod common;`).
#![allow(dead_code, unreachable_pub)]

use kvc_core::Topology;
use kvc_policy::PolicyConfig;
use kvc_replay::sim::{SimConfig, SimOutput, simulate};
use kvc_replay::trace::{self, Trace, generate::SweConfig};
use std::sync::OnceLock;

/// The generated SWE-agent trace for `seed` (52 sessions), loaded as the simulator sees it.
pub fn swe_trace(seed: u64, sessions: usize) -> Trace {
    trace_of(&SweConfig {
        seed,
        sessions,
        ..SweConfig::default()
    })
}

/// The generated SWE-agent trace of `cfg`, loaded as the simulator sees it.
pub fn trace_of(cfg: &SweConfig) -> Trace {
    let records = trace::generate::swe(cfg);
    let mut bytes = Vec::new();
    trace::write_jsonl(&mut bytes, &records).unwrap();
    trace::parse(&bytes[..], "generated", &trace::LoadOptions::default())
        .unwrap()
        .0
}

/// The seed-7 trace, generated once per test binary.
pub fn seed7() -> &'static Trace {
    static T: OnceLock<Trace> = OnceLock::new();
    T.get_or_init(|| swe_trace(7, 52))
}

/// Runs `topology` + `policy` with the reference settings (time-scale 1, concurrency 32).
pub fn run(trace: &Trace, topology: &str, policy: &str) -> SimOutput {
    run_with(trace, topology, policy, |_| {})
}

/// Like [`run`], with a hook to adjust the config.
pub fn run_with(
    trace: &Trace,
    topology: &str,
    policy: &str,
    adjust: impl FnOnce(&mut SimConfig),
) -> SimOutput {
    let t: Topology = topology.parse().unwrap();
    let mut cfg = SimConfig::new(t, PolicyConfig::from_name(policy).unwrap());
    adjust(&mut cfg);
    simulate(trace, &cfg, &mut |_, _| {}).unwrap()
}
