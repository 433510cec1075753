//! The gRPC faces: `kvc.v1.Router` over a [`RouterService`], and `kvc.v1.Worker` over an
//! in-process worker ([`LocalWorker`]: a snapshot reader plus a commit queue).

use crate::pb;
use crate::service::{RouterService, SharedClock};
use kvc_admission::{CommitError, CommitRequest, CommitSender, ReadError, SnapshotReader};
use kvc_core::{Health, SessionId};
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};

/// `kvc.v1.Router` served by a shared [`RouterService`].
#[derive(Debug, Clone)]
pub struct RouterGrpc {
    service: Arc<RouterService>,
}

impl RouterGrpc {
    /// The gRPC face of `service`.
    pub fn new(service: Arc<RouterService>) -> Self {
        RouterGrpc { service }
    }

    /// The tonic server for it, with the decoding limit set from the configuration (requests
    /// between the configured limit and four times it reach the service and are refused with
    /// `INVALID_ARGUMENT`; larger ones are refused by the transport).
    pub fn into_server(self) -> pb::router_server::RouterServer<RouterGrpc> {
        let limit = self
            .service
            .config()
            .max_message_bytes
            .saturating_mul(4)
            .max(64 * 1024);
        pb::router_server::RouterServer::new(self).max_decoding_message_size(limit)
    }
}

#[tonic::async_trait]
impl pb::router_server::Router for RouterGrpc {
    async fn route(
        &self,
        request: Request<pb::RouteRequest>,
    ) -> Result<Response<pb::RouteDecision>, Status> {
        let req = request.into_inner();
        match self.service.route(&req) {
            Ok(d) => Ok(Response::new(d)),
            Err(e) => {
                tracing::debug!(request_id = req.request_id, error = %e, "route refused");
                Err(e.into())
            }
        }
    }

    async fn report_outcome(
        &self,
        request: Request<pb::OutcomeReport>,
    ) -> Result<Response<pb::OutcomeAck>, Status> {
        self.service.report_outcome(request.get_ref())?;
        Ok(Response::new(pb::OutcomeAck {}))
    }

    async fn probe(
        &self,
        request: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeReply>, Status> {
        Ok(Response::new(self.service.probe(request.get_ref())?))
    }

    async fn commit_evict(
        &self,
        request: Request<pb::CommitEvictRequest>,
    ) -> Result<Response<pb::CommitEvictReply>, Status> {
        Ok(Response::new(
            self.service.commit_evict(request.into_inner()).await?,
        ))
    }

    async fn list_workers(
        &self,
        _request: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersReply>, Status> {
        Ok(Response::new(self.service.list_workers()))
    }

    async fn ping(
        &self,
        _request: Request<pb::PingRequest>,
    ) -> Result<Response<pb::PingReply>, Status> {
        Ok(Response::new(pb::PingReply {}))
    }
}

/// `kvc.v1.Worker` for a worker in this process: `State` reads its snapshot, `CommitEvict`
/// goes through its commit queue (answered by the worker's single writer at its step
/// boundary).
pub struct LocalWorker {
    reader: SnapshotReader,
    commit: CommitSender,
    clock: SharedClock,
    timeout: Duration,
}

impl std::fmt::Debug for LocalWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalWorker")
            .field("reader", &self.reader)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl LocalWorker {
    /// A worker service over a snapshot reader and a commit queue; commits wait at most
    /// `timeout` for the owner's answer; `clock` must be the one the snapshot writer stamps with.
    pub fn new(
        reader: SnapshotReader,
        commit: CommitSender,
        clock: SharedClock,
        timeout: Duration,
    ) -> Self {
        LocalWorker {
            reader,
            commit,
            clock,
            timeout,
        }
    }

    /// The tonic server for it.
    pub fn into_server(self) -> pb::worker_server::WorkerServer<LocalWorker> {
        pb::worker_server::WorkerServer::new(self)
    }
}

#[tonic::async_trait]
impl pb::worker_server::Worker for LocalWorker {
    async fn commit_evict(
        &self,
        request: Request<pb::CommitEvictRequest>,
    ) -> Result<Response<pb::CommitEvictReply>, Status> {
        let req = request.into_inner();
        if req.worker != self.reader.worker_id().0 {
            return Err(Status::invalid_argument(format!(
                "this is worker {}, not {}",
                self.reader.worker_id().0,
                req.worker
            )));
        }
        let pending = self
            .commit
            .submit(CommitRequest {
                need_tokens: req.need_tokens,
                session: req.session_id.map(SessionId),
            })
            .map_err(commit_status)?;
        let timeout = self.timeout;
        let reply = tokio::task::spawn_blocking(move || pending.wait(timeout))
            .await
            .map_err(|e| Status::internal(format!("commit wait task: {e}")))?
            .map_err(commit_status)?;
        Ok(Response::new(pb::CommitEvictReply {
            admitted: reply.admitted,
            freed_tokens: reply.freed_tokens,
            evicted_sessions: reply.evicted.iter().map(|s| s.0).collect(),
            recommended_pause_ms: reply.recommended_pause_ms,
        }))
    }

    async fn state(
        &self,
        _request: Request<pb::WorkerStateRequest>,
    ) -> Result<Response<pb::WorkerState>, Status> {
        let data = self.reader.read().map_err(|e| match e {
            ReadError::NotPublished | ReadError::Contended => Status::unavailable(e.to_string()),
            ReadError::Checksum { .. } => Status::internal(e.to_string()),
        })?;
        let now = self.clock.now_ms();
        let age = now.saturating_sub(data.publish_ms);
        let health = if age > self.reader.stale_after_ms() {
            Health::Stale
        } else {
            Health::Healthy
        };
        Ok(Response::new(data.worker_state(now, health).into()))
    }
}

fn commit_status(e: CommitError) -> Status {
    match e {
        CommitError::Busy { .. } => Status::resource_exhausted(e.to_string()),
        CommitError::OwnerGone => Status::unavailable(e.to_string()),
        CommitError::Timeout => Status::deadline_exceeded(e.to_string()),
    }
}
