//! Cluster and session builders shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

use kvc_core::{
    BlockHash, Capabilities, Health, Outcome, RequestId, SessionId, TurnId, WorkerId, WorkerRole,
    WorkerState,
};
use kvc_policy::{
    ClusterView, Decision, Observation, PolicyConfig, PolicyError, RouteRequest, RouterState,
    WorkerView, route,
};

/// KV pool of every test worker.
pub const CAP: u64 = 100_000;

/// Tokens per block.
pub const BS: u64 = 512;

/// Blocks of the system prompt every session shares.
pub const SYSTEM: [u64; 4] = [1, 2, 3, 4];

pub fn worker(id: u32, role: WorkerRole) -> WorkerView {
    WorkerView::new(WorkerId(id), role, WorkerState::empty(CAP))
}

/// `p` prefill workers (ids `0..p`) then `d` decode workers (ids `p..p+d`).
pub fn pd(p: u32, d: u32) -> Vec<WorkerView> {
    (0..p)
        .map(|i| worker(i, WorkerRole::Prefill))
        .chain((p..p + d).map(|i| worker(i, WorkerRole::Decode)))
        .collect()
}

/// `p` prefill and `d` decode workers whose decode workers serve turns alone (vLLM).
pub fn pd_local(p: u32, d: u32) -> Vec<WorkerView> {
    pd(p, d)
        .into_iter()
        .map(|w| match w.role {
            WorkerRole::Decode => {
                w.with_caps(Capabilities::of_role(WorkerRole::Decode).with_local())
            }
            _ => w,
        })
        .collect()
}

/// `n` colocated workers, ids `0..n`.
pub fn dp(n: u32) -> Vec<WorkerView> {
    (0..n).map(|i| worker(i, WorkerRole::Colocated)).collect()
}

pub fn set_used(ws: &mut [WorkerView], id: u32, used: u64) {
    ws.iter_mut()
        .find(|w| w.id.0 == id)
        .unwrap()
        .state
        .used_tokens = used;
}

pub fn set_health(ws: &mut [WorkerView], id: u32, health: Health) {
    ws.iter_mut().find(|w| w.id.0 == id).unwrap().state.health = health;
}

pub fn set_load(ws: &mut [WorkerView], id: u32, in_flight: u32, queue: u32) {
    let w = ws.iter_mut().find(|w| w.id.0 == id).unwrap();
    w.state.in_flight = in_flight;
    w.state.queue_depth = queue;
}

/// The blocks of a session's context of `n` blocks past the system prompt: chained ids unique
/// to the session (and to `generation`, which models an agent rewriting its history from
/// block `SYSTEM.len()` on).
pub fn ctx_blocks(session: u64, generation: u64, n: usize) -> Vec<BlockHash> {
    SYSTEM
        .iter()
        .copied()
        .chain((0..n as u64).map(|k| session * 1_000_000 + generation * 10_000 + k))
        .map(BlockHash)
        .collect()
}

/// A router for tests: state plus a request counter.
pub struct Router {
    pub config: PolicyConfig,
    pub state: RouterState,
    pub next_request: u64,
}

impl Router {
    pub fn new(config: PolicyConfig, workers: &[WorkerView]) -> Self {
        let state = RouterState::new(&config, workers);
        Router {
            config,
            state,
            next_request: 1,
        }
    }

    pub fn named(name: &str, workers: &[WorkerView]) -> Self {
        Router::new(PolicyConfig::from_name(name).unwrap(), workers)
    }

    pub fn decide(
        &self,
        workers: &[WorkerView],
        req: &RouteRequest<'_>,
    ) -> Result<Decision, PolicyError> {
        route(
            &self.config,
            &self.state,
            &ClusterView::new(0, workers),
            req,
        )
    }

    /// Routes, applies, and completes successfully (the worker keeps the whole input resident).
    /// Returns the decision.
    pub fn serve(
        &mut self,
        workers: &[WorkerView],
        session: Option<(u64, u32)>,
        blocks: &[BlockHash],
    ) -> Decision {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let input = blocks.len() as u64 * BS;
        let mut req = RouteRequest::new(id, input, 10, blocks);
        if let Some((s, t)) = session {
            req = req.in_session(SessionId(s), TurnId(t));
        }
        let d = self.decide(workers, &req).expect("route");
        self.state.apply(&d.change);
        self.state.observe(&Observation::Completed {
            request_id: id,
            session: session.map(|(s, _)| SessionId(s)),
            worker: d.decode,
            outcome: Outcome::Ok,
            resident_tokens: input,
            direct: d.is_direct(),
        });
        d
    }

    /// A later-turn request of `session`.
    pub fn request<'b>(
        &mut self,
        session: u64,
        turn: u32,
        blocks: &'b [BlockHash],
    ) -> RouteRequest<'b> {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        RouteRequest::new(id, blocks.len() as u64 * BS, 10, blocks)
            .in_session(SessionId(session), TurnId(turn))
    }
}

pub fn approx(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}
