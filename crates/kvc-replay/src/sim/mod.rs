//! The discrete-event simulator: replays a trace through a modelled P/D or colocated cluster
//! with a routing policy from `kvc-policy`, on a virtual clock.
//!
//! | module | job |
//! |---|---|
//! | [`replay`] | the replay loop: requests read as it goes, pacing, routing, carrying decisions out, one record per request in trace order ([`simulate`], [`run`] for a trace in memory; [`simulate_stream`], [`run_stream`] for any [`RequestSource`](crate::trace::RequestSource) into a [`RunSink`]) |
//! | [`decider`] | the loop's seams: [`Decider`] (decisions; [`LocalPolicy`] in process) and [`Hooks`] (the clock; [`Virtual`]) |
//! | [`config`] | run configuration ([`SimConfig`], [`EvictionMode`]), its checks, the summary's `config` block |
//! | [`cluster`] | a topology's workers: roles, capabilities, names, the initial view |
//!
//! | [`metrics`] | per-request records and the run summary ([`metrics::SummaryBuilder`]: built as records come) |
//!
//! The worker model the loop drives (engine, profiles and their timing physics) is
//! [`kvc_engine_sim::model`].
//!
//! Replay semantics are in [`replay`]; the invariants (determinism, one record per request,
//! policies unchanged) in ARCHITECTURE.md.
//!
//! Determinism: events are ordered by (time in µs, sequence number); no wall clock and no
//! unordered iteration feed the logic, so the same trace, config and seed give byte-identical
//! records.

pub mod cluster;
pub mod config;
pub mod decider;
pub mod metrics;
pub mod replay;

pub use cluster::{initial_views, worker_names, worker_roles};
pub use config::{EvictionMode, SimConfig, run_config};
pub use decider::{Decider, Hooks, LocalPolicy, Routed, Virtual};
pub use kvc_engine_sim::model::Profile;
pub use replay::{Progress, RunSink, StreamOutput, run, run_stream, simulate, simulate_stream};

use metrics::{RequestRecord, Summary};

/// A configuration the simulator cannot run, or a run that could not finish.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A bad setting.
    #[error("invalid simulation setting: {0}")]
    Invalid(String),
    /// The modelled cluster stopped making progress with requests unfinished (a request that
    /// can never fit, for instance). This is a simulator bug or an impossible profile.
    #[error(
        "simulation stalled with {unfinished} request(s) unfinished (first: trace index {first})"
    )]
    Stalled {
        /// Requests that never finished.
        unfinished: usize,
        /// Trace index of the first of them.
        first: usize,
    },
    /// The trace could not be read as the run went.
    #[error(transparent)]
    Source(#[from] crate::trace::SourceError),
    /// A run output could not be written.
    #[error("{0}")]
    Output(String),
}

/// Pool occupancy samples: (time in s, used fraction of every worker's pool by worker index).
pub type Occupancy = Vec<(f64, Vec<f64>)>;

/// Records and summary of one run.
#[derive(Debug, Clone)]
pub struct SimOutput {
    /// One record per trace request, in trace order.
    pub records: Vec<RequestRecord>,
    /// The summary.
    pub summary: Summary,
    /// Decode (or colocated) worker names, by worker index (`None` for prefill workers).
    pub worker_names: Vec<String>,
    /// Pool occupancy samples, every 10 s of simulated time.
    pub occupancy: Occupancy,
    /// Committed share of every pool at the same instants: tokens the worker cannot evict
    /// (running requests and, on decode workers, sessions that are not idle) over capacity.
    pub committed: Occupancy,
}
