//! Run configuration: what a simulated or replayed run depends on besides the trace, its
//! checks, and the `config` block of the summary it yields.

use super::SimError;
use super::metrics::RunConfig;
use crate::trace::Trace;
use kvc_core::{BlockSize, StableName, Topology, WorkerId};
use kvc_engine_sim::ClusterSpec;
use kvc_engine_sim::model::{Engine, Profile};
use kvc_policy::PolicyConfig;

pub use kvc_core::EvictionMode;

/// Everything a run depends on besides the trace.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Cluster shape.
    pub topology: Topology,
    /// Routing policy (with its prefill selection).
    pub policy: PolicyConfig,
    /// Trace time is divided by this (10 replays ten times faster).
    pub time_scale: f64,
    /// Most requests in flight.
    pub concurrency: usize,
    /// Seed of the iteration-time jitter.
    pub seed: u64,
    /// Honour the recommended pause of routing decisions before starting a request.
    pub backpressure: bool,
    /// Decode-side eviction.
    pub eviction: EvictionMode,
    /// Engine profile.
    pub profile: Profile,
    /// Relative jitter of iteration times (deterministic from `seed`).
    pub jitter: f64,
    /// Whether the engines serve turns alone (local prefill), as vLLM instances of any role
    /// do: then decode workers, and the prefill workers of `NpMd-hybrid` shapes, declare it
    /// ([`kvc_core::Topology::layout`]). Off models stock SGLang decode servers, which
    /// cannot: nor can they recompute a request they retract, which they back up to host
    /// memory or abort (`retraction_host_pool_tokens` in the profile). Only policies that plan
    /// `local-prefill` turns (`kvc`) route by it; on every policy it decides what a decode
    /// worker does with a retracted request. It also says whether decode workers send their
    /// sessions' KV (vLLM's do; only `kvc` with `migrate-with-kv` uses it).
    pub local_prefill: bool,
    /// Whether the clients' explicit session ends (a trace's `final`) are honoured: the
    /// router forgets the session once its last request is answered, and the engine releases
    /// its KV (as vLLM holds an ended request's blocks unreferenced, the first to go). Off,
    /// ended sessions stay until evicted or expired, as without the signal.
    pub session_ends: bool,
    /// Workers the operator drains during the run (none by default).
    pub drains: Vec<Drain>,
}

/// A worker drained during a run, as an operator drains a node for maintenance: from `at_s`
/// on (seconds of the run's clock, after the time scale) no decision places a turn on it,
/// while it finishes what it runs and keeps the KV it holds (health `draining`: a policy
/// that moves sessions with their KV may still have it send a session it holds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Drain {
    /// The drained worker.
    pub worker: WorkerId,
    /// When, in seconds of the run's clock.
    pub at_s: f64,
}

impl SimConfig {
    /// The simulated workers this configuration runs, in the trace's block size: the one
    /// constructor the simulator and the live workers share.
    pub fn engine(&self, trace: &Trace) -> Engine {
        self.cluster(trace.block_size()).engine()
    }

    /// The simulated workers of this configuration, serving requests whose block ids cover
    /// `block_size` tokens each.
    pub fn cluster(&self, block_size: BlockSize) -> ClusterSpec {
        ClusterSpec {
            topology: self.topology,
            local_prefill: self.local_prefill,
            profile: self.profile.clone(),
            eviction: self.eviction,
            seed: self.seed,
            jitter: self.jitter,
            block_size,
        }
    }

    /// The reference setup: time-scale 1, concurrency 32, seed 0, the default profile, engines
    /// that serve turns alone (vLLM).
    pub fn new(topology: Topology, policy: PolicyConfig) -> Self {
        SimConfig {
            topology,
            policy,
            time_scale: 1.0,
            concurrency: 32,
            seed: 0,
            backpressure: true,
            eviction: EvictionMode::IdleLru,
            profile: Profile::default(),
            jitter: 0.02,
            local_prefill: true,
            session_ends: true,
            drains: Vec::new(),
        }
    }

    /// Checks the settings a run cannot do with: a positive, finite time scale and a
    /// concurrency of at least 1. (The profile is checked when it is parsed.)
    pub fn validate(&self) -> Result<(), SimError> {
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(SimError::Invalid(format!(
                "time-scale must be a positive number (got {})",
                self.time_scale
            )));
        }
        if self.concurrency == 0 {
            return Err(SimError::Invalid("concurrency must be at least 1".into()));
        }
        let layout = self.topology.layout(self.local_prefill);
        let workers = layout.len();
        if workers > kvc_policy::MAX_WORKERS {
            return Err(SimError::Invalid(format!(
                "topology {} has {workers} workers; the routing policies hold at most {} \
                 (kvc_policy::MAX_WORKERS): choose a smaller topology",
                self.topology,
                kvc_policy::MAX_WORKERS
            )));
        }
        self.validate_drains(&layout)
    }

    /// Checks the drains: a worker of the topology that hosts sessions, drained once, at a
    /// time that is a number of seconds, and one such worker left undrained.
    fn validate_drains(
        &self,
        layout: &[(kvc_core::WorkerRole, kvc_core::Capabilities)],
    ) -> Result<(), SimError> {
        let names = kvc_engine_sim::cluster::layout_names(layout);
        let mut drained = vec![false; layout.len()];
        for d in &self.drains {
            let slot = d.worker.0 as usize;
            let Some((_, caps)) = layout.get(slot) else {
                return Err(SimError::Invalid(format!(
                    "drain: topology {} has no worker {} (it has {})",
                    self.topology,
                    d.worker.0,
                    layout.len()
                )));
            };
            if !caps.hosts_sessions() {
                return Err(SimError::Invalid(format!(
                    "drain: {} is a prefill worker, which holds no session to move; drain a \
                     worker that hosts sessions",
                    names[slot]
                )));
            }
            if !(d.at_s.is_finite() && d.at_s >= 0.0) {
                return Err(SimError::Invalid(format!(
                    "drain: the time of {}'s drain must be a number of seconds, at least 0 \
                     (got {})",
                    names[slot], d.at_s
                )));
            }
            if std::mem::replace(&mut drained[slot], true) {
                return Err(SimError::Invalid(format!(
                    "drain: {} is drained twice",
                    names[slot]
                )));
            }
        }
        let left = layout
            .iter()
            .zip(&drained)
            .any(|((_, caps), d)| caps.hosts_sessions() && !d);
        if !left {
            return Err(SimError::Invalid(
                "drain: every worker that hosts sessions is drained; leave one to route to".into(),
            ));
        }
        Ok(())
    }

    /// Checks that the policy counts blocks of the trace's size (block ids of another size
    /// would be compared as if they covered the same tokens).
    pub fn check_block_size(&self, trace: &Trace) -> Result<(), SimError> {
        self.check_block_size_of(trace.block_size())
    }

    /// Checks that the policy counts blocks of `block_size` tokens (a trace's).
    pub fn check_block_size_of(&self, block_size: BlockSize) -> Result<(), SimError> {
        if self.policy.block_size() != block_size {
            return Err(SimError::Invalid(format!(
                "the trace has {}-token blocks but the policy counts {}-token blocks \
                 (set the policy knob block-size)",
                block_size.tokens(),
                self.policy.block_size().tokens()
            )));
        }
        Ok(())
    }
}

/// The `config` block of a run's summary.
pub fn run_config(cfg: &SimConfig) -> RunConfig {
    RunConfig {
        topology: cfg.topology.to_string(),
        policy: cfg.policy.name().to_owned(),
        prefill_policy: cfg
            .policy
            .prefill_policy()
            .filter(|_| !cfg.topology.is_colocated())
            .map(|p| p.as_str().to_owned()),
        time_scale: cfg.time_scale,
        concurrency: cfg.concurrency,
        seed: cfg.seed,
        backpressure: cfg.backpressure,
        eviction: cfg.eviction.as_str().to_owned(),
        profile: cfg.profile.name.clone(),
        local_prefill: cfg.local_prefill,
        session_ends: (!cfg.session_ends).then_some(false),
        policy_config: serde_json::to_value(&cfg.policy).unwrap_or(serde_json::Value::Null),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{LoadOptions, parse};
    use kvc_core::BlockSize;

    fn config() -> SimConfig {
        SimConfig::new("1p2d".parse().unwrap(), PolicyConfig::default())
    }

    #[test]
    fn settings_a_run_cannot_do_with_are_refused() {
        assert!(config().validate().is_ok());
        for time_scale in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let cfg = SimConfig {
                time_scale,
                ..config()
            };
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains("time-scale"), "{err}");
        }
        let cfg = SimConfig {
            concurrency: 0,
            ..config()
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("concurrency"), "{err}");
        // A fleet past the policies' worker limit is refused before any request runs, with
        // the limit named (it used to run with every request rejected).
        let cfg = SimConfig::new(
            "1024p3073d-hybrid".parse().unwrap(),
            PolicyConfig::default(),
        );
        let err = cfg.validate().unwrap_err().to_string();
        assert!(
            err.contains("4097 workers") && err.contains("at most 4096"),
            "{err}"
        );
        let at_limit = SimConfig::new("1024p3072d".parse().unwrap(), PolicyConfig::default());
        assert!(at_limit.validate().is_ok());
    }

    #[test]
    fn the_policy_counts_blocks_of_the_trace_size() {
        let two_blocks =
            br#"{"timestamp": 0, "input_length": 500, "output_length": 2, "hash_ids": [1, 2]}"#;
        let opts = LoadOptions {
            block_size: BlockSize::new(256).unwrap(),
            ..LoadOptions::default()
        };
        let (trace, _) = parse(&two_blocks[..], "t.jsonl", &opts).unwrap();
        let err = config().check_block_size(&trace).unwrap_err().to_string();
        assert!(err.contains("256-token blocks"), "{err}");
        let one_block =
            br#"{"timestamp": 0, "input_length": 500, "output_length": 2, "hash_ids": [1]}"#;
        let (trace, _) = parse(&one_block[..], "t.jsonl", &LoadOptions::default()).unwrap();
        assert!(config().check_block_size(&trace).is_ok());
    }
}
