//! What a policy returns.

use kvc_core::{
    BlockHash, ExecutionMode, FallThroughReason, RequestId, SessionId, WorkerId, WorkerRole,
};
use serde::ser::{SerializeMap, SerializeStruct};
use serde::{Deserialize, Serialize, Serializer};

/// A routing decision plus the state change that carrying it out implies.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// The planned path.
    pub mode: ExecutionMode,
    /// The decode worker, or the colocated worker.
    pub decode: WorkerId,
    /// The prefill worker: `Some` on every P→D path (`turn1-seed`, `fallback`, `reseed`, and
    /// `migrate-kv`, where it is the worker the session moves from);
    /// `None` on `direct-to-d`, `local-prefill` and `colocated`, where `decode` prefills.
    pub prefill: Option<WorkerId>,
    /// Why a later turn is not direct-to-D: `Some` for `fallback`, `reseed` and `migrate-kv`, and for a
    /// `local-prefill` turn that is not a first turn.
    pub reason: Option<FallThroughReason>,
    /// Tokens reused, as the router believes: of the session's KV on D for direct-to-D; of the
    /// prefill worker's prefix cache on a P→D path; of the worker's prefix cache when colocated.
    pub cached_tokens: u64,
    /// Footprint estimate on D (or the colocated worker), see [`crate::footprint_tokens`].
    pub need_tokens: u64,
    /// Backpressure hint from the chosen worker's queue and use, see
    /// [`crate::recommended_pause_ms`].
    pub recommended_pause_ms: u32,
    /// One entry per healthy candidate considered: decode (or colocated) workers first, then
    /// prefill workers, each group by increasing id.
    pub scores: Vec<ScoreEntry>,
    /// What to apply to the [`crate::RouterState`] if the decision is carried out.
    pub change: StateChange,
}

impl Decision {
    /// Whether the decision goes direct-to-D.
    pub fn is_direct(&self) -> bool {
        self.mode == ExecutionMode::DirectToD
    }

    /// The score entry of `worker` in `role`, if it was a candidate.
    pub fn score(&self, worker: WorkerId, role: WorkerRole) -> Option<&ScoreEntry> {
        self.scores
            .iter()
            .find(|s| s.worker == worker && s.role == role)
    }
}

/// One named part of a candidate's score.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Component {
    /// Its name (stable, snake_case; documented by each policy).
    pub name: &'static str,
    /// Its value.
    pub value: f64,
}

/// Most components a score entry holds.
const MAX_COMPONENTS: usize = 9;

/// The score of one candidate, for debugging. `total` is what the policy maximised (each
/// policy documents it); ties are broken as the policy documents. Components are stored inline
/// (no allocation per candidate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreEntry {
    /// The candidate.
    pub worker: WorkerId,
    /// The role it was scored for.
    pub role: WorkerRole,
    /// Whether the policy could pick it (`false` e.g. for a D over the hard cap while another
    /// D is under it, or a D excluded by a migration).
    pub eligible: bool,
    /// The quantity the policy maximised.
    pub total: f64,
    components: [Component; MAX_COMPONENTS],
    len: u8,
}

impl ScoreEntry {
    pub(crate) fn new(worker: WorkerId, role: WorkerRole) -> Self {
        ScoreEntry {
            worker,
            role,
            eligible: true,
            total: 0.0,
            components: [Component {
                name: "",
                value: 0.0,
            }; MAX_COMPONENTS],
            len: 0,
        }
    }

    /// Adds a component (ignored past the inline capacity, which no policy reaches; debug
    /// builds check it).
    pub(crate) fn with(mut self, name: &'static str, value: f64) -> Self {
        debug_assert!(
            (self.len as usize) < MAX_COMPONENTS,
            "score entry full: raise MAX_COMPONENTS for `{name}`"
        );
        if (self.len as usize) < MAX_COMPONENTS {
            self.components[self.len as usize] = Component { name, value };
            self.len += 1;
        }
        self
    }

    /// The components, in the policy's order.
    pub fn components(&self) -> &[Component] {
        &self.components[..self.len as usize]
    }

    /// The value of the component named `name`.
    pub fn component(&self, name: &str) -> Option<f64> {
        self.components()
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.value)
    }
}

struct ComponentMap<'a>(&'a [Component]);

impl Serialize for ComponentMap<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for c in self.0 {
            m.serialize_entry(c.name, &c.value)?;
        }
        m.end()
    }
}

impl Serialize for ScoreEntry {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("ScoreEntry", 5)?;
        st.serialize_field("worker", &self.worker)?;
        st.serialize_field("role", &self.role)?;
        st.serialize_field("eligible", &self.eligible)?;
        st.serialize_field("total", &self.total)?;
        st.serialize_field("components", &ComponentMap(self.components()))?;
        st.end()
    }
}

/// The change to the router state a decision implies, as a value: pass it to
/// [`crate::RouterState::apply`] once the request is actually dispatched.
///
/// Applying it: counts the request in flight on `decode` (and `prefill`, and the P→D pair) until
/// an [`crate::Observation::Completed`] for `request_id` arrives (applying a second change for
/// the same request id replaces the first, as when re-routing after a reject); records `blocks`
/// as sent to `decode` (and `prefill`) in the grow-only block view; advances the round-robin
/// cursor of each role to the chosen worker; and, for a session, makes `decode` its current D
/// (counting a D change if it differs), marks it resident there with `blocks`, sets
/// `reject_count` and records `now_ms` as its last routing time; adds `prefill_us` to the
/// prefilling worker's backlog.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct StateChange {
    /// The request.
    pub request_id: RequestId,
    /// Its session.
    pub session: Option<SessionId>,
    /// The caller's time at decision.
    pub now_ms: u64,
    /// The decode (or colocated) worker.
    pub decode: WorkerId,
    /// `decode` or `colocated`: which round-robin cursor `decode` advances.
    pub decode_role: WorkerRole,
    /// The prefill worker on a P→D path.
    pub prefill: Option<WorkerId>,
    /// Whether the path is direct-to-D.
    pub direct: bool,
    /// The request's block ids (what the worker will hold once the request is served).
    pub blocks: Vec<BlockHash>,
    /// New value of the session's admission-reject count on a worker (after a reject, or reset
    /// to 0 on the D a migration releases).
    pub reject_count: Option<(WorkerId, u32)>,
    /// The policy's estimate of the request's prefill, in microseconds, on the worker that
    /// prefills it (`prefill`, else `decode`); 0 when the policy makes none. It counts in that
    /// worker's backlog ([`crate::RouterState::prefill_backlog_s`]) until the request reports
    /// its first token or completes.
    #[serde(default)]
    pub prefill_us: u64,
}
