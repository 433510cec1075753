//! Errors.

use kvc_core::{WorkerId, WorkerRole};

/// Why a policy could not decide, or a configuration is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// No healthy worker of a role the decision needs.
    #[error("no healthy {role} worker")]
    NoHealthyWorker {
        /// The role needed.
        role: WorkerRole,
    },
    /// The cluster view does not describe a topology the policy can route on.
    #[error("wrong topology: {detail}")]
    WrongTopology {
        /// What is wrong.
        detail: &'static str,
    },
    /// A policy name that is not one of [`crate::PolicyConfig::all_names`].
    #[error("unknown policy `{0}` (expected one of: {names})", names = crate::PolicyConfig::all_names().join(", "))]
    UnknownPolicy(String),
    /// A configuration value out of its range.
    #[error("invalid {policy} config: {detail}")]
    InvalidConfig {
        /// The policy's stable name.
        policy: &'static str,
        /// Which value and why.
        detail: &'static str,
    },
    /// A worker id at or above [`crate::MAX_WORKERS`].
    #[error("worker id {0} out of range (ids must be below {max})", max = crate::MAX_WORKERS)]
    WorkerIdOutOfRange(WorkerId),
    /// The same worker id twice in one cluster view.
    #[error("worker {0} appears twice in the cluster view")]
    DuplicateWorker(WorkerId),
}
