//! `kvc.v1.Worker`, both sides: the service for a worker in this process ([`LocalWorker`],
//! bound by [`serve_worker`] or [`serve_worker_until`]) and the client the router polls and commits through
//! ([`WorkerClient`]), each speaking `kvc-core`/`kvc-admission` types to its caller.

use crate::convert::InvalidEnum;
use crate::pb;
use kvc_admission::{
    Clock, CommitError, CommitReply, CommitRequest, CommitSender, ReadError, SnapshotReader,
};
use kvc_core::{Health, WorkerId, WorkerState};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};

/// The clock a [`LocalWorker`] judges its snapshot's age with: the one its writer stamps
/// publishes with.
pub type SharedClock = Arc<dyn Clock + Send + Sync>;

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
        let (worker, req) = request.get_ref().to_core();
        if worker != self.reader.worker_id() {
            return Err(Status::invalid_argument(format!(
                "this is worker {}, not {}",
                self.reader.worker_id().0,
                worker.0
            )));
        }
        let pending = self.commit.submit(req).map_err(commit_status)?;
        let timeout = self.timeout;
        let reply = tokio::task::spawn_blocking(move || pending.wait(timeout))
            .await
            .map_err(|e| Status::internal(format!("commit wait task: {e}")))?
            .map_err(commit_status)?;
        Ok(Response::new(reply.into()))
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

/// Why a worker service could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeWorkerError {
    /// The listener could not be bound.
    #[error("cannot bind the worker service on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("worker service: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The server task panicked or was cancelled.
    #[error("worker service task: {0}")]
    Join(String),
}

/// A worker service running in this process; [`RunningWorker::stop`] ends it.
#[derive(Debug)]
pub struct RunningWorker {
    addr: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<Result<(), ServeWorkerError>>,
}

impl RunningWorker {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address as the URI a router's worker `address` takes (`http://127.0.0.1:50061`).
    pub fn uri(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops it and waits until it has stopped.
    pub async fn stop(self) -> Result<(), ServeWorkerError> {
        self.stop.cancel();
        self.task
            .await
            .map_err(|e| ServeWorkerError::Join(e.to_string()))?
    }
}

/// Serves `worker` as `kvc.v1.Worker` on `addr` (port 0 picks a free port) until stopped.
/// Must be called within a tokio runtime.
pub async fn serve_worker(
    addr: SocketAddr,
    worker: LocalWorker,
) -> Result<RunningWorker, ServeWorkerError> {
    serve_worker_until(addr, worker, CancellationToken::new()).await
}

/// [`serve_worker`] until `stop` is cancelled (by the caller, or by [`RunningWorker::stop`]):
/// one token can stop every service a caller started.
pub async fn serve_worker_until(
    addr: SocketAddr,
    worker: LocalWorker,
    stop: CancellationToken,
) -> Result<RunningWorker, ServeWorkerError> {
    let bind_error = |source| ServeWorkerError::Bind { addr, source };
    let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let server = worker.into_server();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        Server::builder()
            .add_service(server)
            .serve_with_incoming_shutdown(incoming, token.cancelled_owned())
            .await
            .map_err(ServeWorkerError::from)
    });
    Ok(RunningWorker {
        addr: bound,
        stop,
        task,
    })
}

/// Why a worker's `State` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum WorkerStateError {
    /// The call failed (transport, or the worker's own error status).
    #[error(transparent)]
    Call(#[from] Status),
    /// The answer names no valid health.
    #[error(transparent)]
    Invalid(#[from] InvalidEnum),
}

/// A client of one worker's `kvc.v1.Worker` service. It connects at its first call (and again
/// after a failure); every call is bounded by the timeout it was made with. Cheap to clone.
#[derive(Debug, Clone)]
pub struct WorkerClient {
    inner: pb::worker_client::WorkerClient<Channel>,
}

impl WorkerClient {
    /// A client of the service at `uri` (`http://127.0.0.1:50061`): connecting, and each call,
    /// give up after `timeout`. Fails only for a URI that cannot name a service.
    pub fn connect_lazy(uri: &str, timeout: Duration) -> Result<Self, tonic::transport::Error> {
        let endpoint = Endpoint::from_shared(uri.to_owned())?
            .connect_timeout(timeout)
            .timeout(timeout);
        Ok(WorkerClient {
            inner: pb::worker_client::WorkerClient::new(endpoint.connect_lazy()),
        })
    }

    /// The worker's state as it reports it (its health about itself, the age of its state).
    pub async fn state(&self) -> Result<WorkerState, WorkerStateError> {
        let reply = self.inner.clone().state(pb::WorkerStateRequest {}).await?;
        Ok(WorkerState::try_from(reply.into_inner())?)
    }

    /// Asks `worker` to make room for `req` (evicting if needed); its error status as it came
    /// (`RESOURCE_EXHAUSTED` when its queue is full, `DEADLINE_EXCEEDED` when its owner did
    /// not answer in time).
    pub async fn commit_evict(
        &self,
        worker: WorkerId,
        req: CommitRequest,
    ) -> Result<CommitReply, Status> {
        let reply = self
            .inner
            .clone()
            .commit_evict(pb::CommitEvictRequest::for_worker(worker, req))
            .await?;
        Ok(reply.into_inner().into())
    }
}
