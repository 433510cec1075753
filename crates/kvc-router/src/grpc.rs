//! The gRPC front: `kvc.v1.Router` over a [`RouterService`], with standard health and
//! reflection. The only module of the router that sees protobuf types: each call is converted
//! to `kvc-core`/`kvc-policy` types here (with `kvc-proto`'s conversions), answered by the
//! service, and converted back.
//!
//! Every answer is a gRPC status. A request that does not reach its handler because its bytes
//! are not a message of the method's type (malformed protobuf, a truncated frame, no message
//! at all) is `INVALID_ARGUMENT`: tonic reports those as `INTERNAL`, which would blame the
//! router, so [`MalformedLayer`] rewrites them (only for `kvc.v1.Router` calls whose handler
//! did not run). A message over the decoding limit (four times `max-message-bytes`) is refused
//! by the transport with `OUT_OF_RANGE`. Limits checked by the service: `input_length` at most
//! `limits.max-input-tokens` (16 Mi tokens by default), `hash_ids` at most one per block of
//! the input, `resident_tokens` of `ReportOutcome` at most the decode worker's
//! `capacity-tokens`, worker ids that exist. Session ids are 64-bit numbers here (no length to
//! bound). With `[auth.grpc]` every call but health needs the bearer token
//! ([`crate::auth`]); with `[tls.grpc]` the listener is TLS, optionally mutual
//! ([`crate::tls`]).
//!
//! A client of a router served in this process:
//!
//! ```
//! use kvc_proto::pb;
//! use kvc_router::{serve, RouterConfig};
//!
//! # tokio::runtime::Runtime::new()?.block_on(async {
//! let config = RouterConfig {
//!     listen: "127.0.0.1:0".parse()?,
//!     metrics_listen: None,
//!     ..RouterConfig::default()
//! };
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let router = serve(config, async { let _ = stopped.await; }).await?;
//!
//! let mut client =
//!     pb::router_client::RouterClient::connect(format!("http://{}", router.grpc_addr())).await?;
//! let workers = client.list_workers(pb::ListWorkersRequest {}).await?.into_inner();
//! assert!(workers.workers.is_empty());
//!
//! let _ = stop.send(());
//! router.wait().await?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::error::{RequestError, ServeError};
use crate::service::{DecisionOutcome, ListedWorker, RouterDecision, RouterService};
use crate::telemetry::Telemetry;
use kvc_core::{Outcome, RequestId, SessionId, StableName, WorkerId};
use kvc_proto::convert::ProtoEnum;
use kvc_proto::pb;
use prost::Message as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

/// `kvc.v1.Router` served by a shared [`RouterService`].
#[derive(Debug, Clone)]
pub struct RouterGrpc {
    service: Arc<RouterService>,
    telemetry: Telemetry,
}

impl RouterGrpc {
    /// The gRPC face of `service`.
    pub fn new(service: Arc<RouterService>) -> Self {
        RouterGrpc {
            service,
            telemetry: Telemetry::off(),
        }
    }

    /// The same, each `Route` call traced by `telemetry` ([`crate::telemetry`]: a span per
    /// call, the child of the caller's `traceparent` metadata).
    pub fn with_telemetry(mut self, telemetry: Telemetry) -> Self {
        self.telemetry = telemetry;
        self
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

    /// `INVALID_ARGUMENT` for a request over `max-message-bytes` (encoded), counted as a
    /// refused route like every other malformed request.
    fn check_size(&self, size: usize) -> Result<(), RequestError> {
        let limit = self.service.config().max_message_bytes;
        if size > limit {
            let e = RequestError::InvalidArgument(format!(
                "request of {size} bytes exceeds the limit of {limit} bytes"
            ));
            self.service.metrics().record_route_error(e.code());
            return Err(e);
        }
        Ok(())
    }
}

/// A call's W3C trace context (`traceparent`, `tracestate` metadata), for its span.
struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl opentelemetry::propagation::Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Serves `kvc.v1.Router` for `service`, `grpc.health.v1.Health` and gRPC reflection on
/// `listener` until `stop` is cancelled (health turns `NOT_SERVING` as it stops), over TLS
/// when `tls` is given, with every call but health checked against `token` when one is.
pub(crate) async fn spawn_grpc(
    service: &Arc<RouterService>,
    listener: TcpListener,
    stop: &CancellationToken,
    tls: Option<tonic::transport::ServerTlsConfig>,
    token: Option<Arc<crate::auth::Token>>,
    telemetry: Telemetry,
) -> Result<JoinHandle<Result<(), ServeError>>, ServeError> {
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<pb::router_server::RouterServer<RouterGrpc>>()
        .await;
    let stop = stop.clone();
    let router = RouterGrpc::new(Arc::clone(service))
        .with_telemetry(telemetry)
        .into_server();
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut builder = Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    let mut builder = builder
        .layer(crate::auth::GrpcAuthLayer::new(token))
        .layer(MalformedLayer);
    Ok(tokio::spawn(async move {
        builder
            .add_service(health_service)
            .add_service(reflection)
            .add_service(router)
            .serve_with_incoming_shutdown(incoming, async move {
                stop.cancelled().await;
                health
                    .set_not_serving::<pb::router_server::RouterServer<RouterGrpc>>()
                    .await;
            })
            .await
            .map_err(ServeError::from)
    }))
}

/// Marks, for [`MalformedLayer`], that a `kvc.v1.Router` handler ran for this call.
#[derive(Debug, Clone)]
struct Reached(Arc<AtomicBool>);

/// Notes in `request` that its handler runs (see [`MalformedLayer`]).
fn reached<T>(request: &Request<T>) {
    if let Some(r) = request.extensions().get::<Reached>() {
        r.0.store(true, Ordering::Relaxed);
    }
}

/// The path prefix of `kvc.v1.Router` calls.
const ROUTER_PATH: &str = "/kvc.v1.Router/";

/// A tower layer of the gRPC server: a `kvc.v1.Router` call answered `INTERNAL` before its
/// handler ran (tonic could not decode the request) is answered `INVALID_ARGUMENT` instead,
/// with tonic's message. Errors of the handlers themselves pass unchanged.
#[derive(Debug, Clone, Copy, Default)]
pub struct MalformedLayer;

impl<S> tower::Layer<S> for MalformedLayer {
    type Service = Malformed<S>;

    fn layer(&self, inner: S) -> Malformed<S> {
        Malformed { inner }
    }
}

/// The service [`MalformedLayer`] wraps around the gRPC routes.
#[derive(Debug, Clone)]
pub struct Malformed<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> tower::Service<http::Request<B>> for Malformed<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let flag = req
            .uri()
            .path()
            .starts_with(ROUTER_PATH)
            .then(|| Arc::new(AtomicBool::new(false)));
        if let Some(f) = &flag {
            req.extensions_mut().insert(Reached(Arc::clone(f)));
        }
        let answer = self.inner.call(req);
        Box::pin(async move {
            let mut response = answer.await?;
            if let Some(f) = flag
                && !f.load(Ordering::Relaxed)
            {
                let headers = response.headers_mut();
                let internal = i32::from(tonic::Code::Internal).to_string();
                if headers
                    .get("grpc-status")
                    .is_some_and(|v| v.as_bytes() == internal.as_bytes())
                {
                    let code = i32::from(tonic::Code::InvalidArgument).to_string();
                    if let Ok(v) = http::HeaderValue::from_str(&code) {
                        headers.insert("grpc-status", v);
                    }
                }
            }
            Ok(response)
        })
    }
}

fn decision_to_pb(d: &RouterDecision) -> pb::RouteDecision {
    pb::RouteDecision {
        decision_id: d.decision_id,
        mode: d.mode.to_proto(),
        prefill_worker: d.prefill_worker.map(|w| w.0),
        decode_worker: d.decode_worker.0,
        fall_through_reason: d.fall_through_reason.map(ProtoEnum::to_proto),
        cached_tokens: d.cached_tokens,
        recommended_pause_ms: d.recommended_pause_ms,
        need_tokens: d.need_tokens,
        probe_rejected_by: d.probe_rejected_by.map(|w| w.0),
    }
}

fn worker_to_pb(w: ListedWorker) -> pb::WorkerInfo {
    pb::WorkerInfo {
        id: w.id.0,
        name: w.name,
        role: w.role.to_proto(),
        state: Some(w.state.into()),
        source: w.source.as_str().to_owned(),
        indexed_blocks: w.events.as_ref().map(|e| e.indexed_blocks),
        last_event_seq: w.events.and_then(|e| e.last_seq),
        kv_events: w.kv_events,
        kv_events_from: w.kv_events_from.to_owned(),
        warnings: w.warnings,
        drained: w.drained,
        event_ranks: w
            .event_ranks
            .into_iter()
            .map(|r| pb::RankEvents {
                rank: r.rank,
                endpoint: r.endpoint,
                indexed_blocks: r.stats.indexed_blocks,
                last_event_seq: r.stats.last_seq,
                synced: r.stats.synced,
                gaps: r.stats.gaps,
                resets: r.stats.resets,
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl pb::router_server::Router for RouterGrpc {
    async fn route(
        &self,
        request: Request<pb::RouteRequest>,
    ) -> Result<Response<pb::RouteDecision>, Status> {
        reached(&request);
        let span = self.telemetry.request_span(
            "kvc.v1.Router/Route",
            "/kvc.v1.Router/Route",
            &MetadataExtractor(request.metadata()),
        );
        let req = request.into_inner();
        let hash_ids = req.block_hashes();
        let core = req.to_core(&hash_ids);
        if span.is_recording() {
            span.record_session(None, core.session.zip(core.turn.map(|t| t.0)));
        }
        let answer = self
            .check_size(req.encoded_len())
            .and_then(|()| self.service.route(&core));
        match answer {
            Ok(d) => {
                span.record_decision(&d);
                span.record_grpc_code(0);
                Ok(Response::new(decision_to_pb(&d)))
            }
            Err(e) => {
                if span.is_recording() {
                    span.record_error(&e.to_string());
                    span.record_grpc_code(e.code() as i32);
                }
                tracing::debug!(request_id = req.request_id, error = %e, "route refused");
                Err(e.into())
            }
        }
    }

    async fn report_outcome(
        &self,
        request: Request<pb::OutcomeReport>,
    ) -> Result<Response<pb::OutcomeAck>, Status> {
        reached(&request);
        let report = request.get_ref();
        let outcome = Outcome::from_proto(report.outcome)
            .map_err(|e| RequestError::InvalidArgument(e.to_string()))?;
        self.service.report_outcome(&DecisionOutcome {
            decision_id: report.decision_id,
            request_id: RequestId(report.request_id),
            outcome,
            resident_tokens: report.resident_tokens,
        })?;
        Ok(Response::new(pb::OutcomeAck {}))
    }

    async fn probe(
        &self,
        request: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeReply>, Status> {
        reached(&request);
        let req = request.get_ref();
        let outcome = self.service.probe_worker(
            WorkerId(req.worker),
            req.need_tokens,
            req.session_id.map(SessionId),
        )?;
        Ok(Response::new(outcome.reply.into()))
    }

    async fn commit_evict(
        &self,
        request: Request<pb::CommitEvictRequest>,
    ) -> Result<Response<pb::CommitEvictReply>, Status> {
        reached(&request);
        let (worker, req) = request.get_ref().to_core();
        let reply = self.service.commit_evict(worker, req).await?;
        Ok(Response::new(reply.into()))
    }

    async fn drain_worker(
        &self,
        request: Request<pb::DrainWorkerRequest>,
    ) -> Result<Response<pb::DrainWorkerReply>, Status> {
        reached(&request);
        control_plane(&self.service, "DrainWorker")?;
        let req = request.into_inner();
        match self.service.set_drained(WorkerId(req.worker), req.drain) {
            Some(was_drained) => Ok(Response::new(pb::DrainWorkerReply { was_drained })),
            None => Err(Status::not_found(format!("no worker {}", req.worker))),
        }
    }

    async fn add_worker(
        &self,
        request: Request<pb::AddWorkerRequest>,
    ) -> Result<Response<pb::AddWorkerReply>, Status> {
        reached(&request);
        control_plane(&self.service, "AddWorker")?;
        let req = request.into_inner();
        let cfg = crate::config::WorkerConfig::from_toml_str(&req.worker_toml).map_err(|e| {
            Status::invalid_argument(format!("worker_toml is not a [[workers]] entry: {e}"))
        })?;
        let worker = cfg.id;
        self.service
            .add_worker(cfg)
            .map_err(|e| Status::new(e.code(), e.to_string()))?;
        Ok(Response::new(pb::AddWorkerReply { worker }))
    }

    async fn remove_worker(
        &self,
        request: Request<pb::RemoveWorkerRequest>,
    ) -> Result<Response<pb::RemoveWorkerReply>, Status> {
        reached(&request);
        control_plane(&self.service, "RemoveWorker")?;
        let req = request.into_inner();
        let removed = self
            .service
            .remove_worker(WorkerId(req.worker))
            .map_err(|e| Status::new(e.code(), e.to_string()))?;
        Ok(Response::new(pb::RemoveWorkerReply {
            resident_sessions: removed.resident_sessions as u64,
            in_flight: removed.in_flight as u64,
        }))
    }

    async fn list_workers(
        &self,
        request: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersReply>, Status> {
        reached(&request);
        Ok(Response::new(pb::ListWorkersReply {
            workers: self
                .service
                .list_workers()
                .into_iter()
                .map(worker_to_pb)
                .collect(),
        }))
    }

    async fn ping(
        &self,
        request: Request<pb::PingRequest>,
    ) -> Result<Response<pb::PingReply>, Status> {
        reached(&request);
        Ok(Response::new(pb::PingReply {}))
    }
}

/// Refuses control-plane call `what` on a gRPC listener without a bearer token.
fn control_plane(service: &RouterService, what: &str) -> Result<(), Status> {
    if service.config().auth.grpc.is_none() {
        return Err(Status::permission_denied(format!(
            "{what} needs a bearer token on the gRPC listener ([auth.grpc]): on an open \
             listener any client could change the fleet"
        )));
    }
    Ok(())
}
