//! Why simulated workers could not start or publish, and the settings every real-clock run of
//! them shares.

use kvc_core::StateSource;

/// Why the simulated workers could not start, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A bad setting.
    #[error("invalid simulated worker setting: {0}")]
    Invalid(String),
    /// A snapshot file could not be created or published.
    #[error("snapshot {path}: {message}")]
    Snapshot {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
    /// A server could not listen, or an engine signal could not be served.
    #[error("serve: {0}")]
    Serve(String),
}

/// The router may read the workers' state from their snapshots or their engine signals (a
/// worker that only answers `State` is not simulated on a real clock).
pub fn check_router_state(source: StateSource) -> Result<(), WorkerError> {
    match source {
        StateSource::Snapshot | StateSource::Events => Ok(()),
        StateSource::Service => Err(WorkerError::Invalid(
            "the router state of a live replay is `snapshot` or `events`".to_owned(),
        )),
    }
}

/// The rule for the settings every real-clock run shares (the live replay's and the HTTP
/// workers'): wall time runs `speedup` (positive, finite) times faster than engine time, and
/// snapshots hold at least one resident session (`table_slots`).
pub fn check_pacing(speedup: f64, table_slots: usize) -> Result<(), WorkerError> {
    if !(speedup.is_finite() && speedup > 0.0) {
        return Err(WorkerError::Invalid(format!(
            "speedup must be a positive number (got {speedup})"
        )));
    }
    if table_slots == 0 {
        return Err(WorkerError::Invalid(
            "table slots must be at least 1".into(),
        ));
    }
    Ok(())
}
