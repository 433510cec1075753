//! The endpoint picker (EPP): kvc-router behind Envoy, deciding each request's endpoint over
//! Envoy's external-processing gRPC API (`envoy.service.ext_proc.v3.ExternalProcessor`), as
//! the Kubernetes Gateway API Inference Extension expects. Envoy moves the bytes; the router
//! decides, with the same [`RouterService`](crate::RouterService) and the same request
//! reading as the HTTP front ([`crate::http`]).
//!
//! This module doc is the picker's specification.
//!
//! **Listener.** `epp-listen` in the configuration (`--epp-listen` on the command line; none
//! by default) serves, on one gRPC port, `envoy.service.ext_proc.v3.ExternalProcessor` and
//! `grpc.health.v1.Health` with the services `liveness` (serving while the process answers),
//! `readiness` and `""` (serving while a new request can be routed: the HTTP front's
//! `/readyz` rule, checked every [`READINESS_INTERVAL`]) and
//! `envoy.service.ext_proc.v3.ExternalProcessor` (serving until shutdown). The picker shares
//! the HTTP front's state (its `[http]` options, worker endpoints, circuit breakers, session
//! book and health checks) whether or not `http-listen` is set.
//!
//! **Request phase** (Envoy's `processing_mode`: request headers `SEND`, request body
//! `FULL_DUPLEX_STREAMED`, trailers `SKIP`).
//!
//! - The headers are held and the body buffered until `end_of_stream` (at most
//!   `http.max-body-bytes`, else an immediate 413).
//! - `/v1/completions`, `/v1/chat/completions` and `/generate` are read exactly as the HTTP
//!   front reads them (`crate::http`'s request reading): the session key from the session
//!   header (`x-session-id`) or the body's session field, else
//!   inferred from the prompt's prefix; the client's router-only fields removed; a request the
//!   front would refuse gets the front's 400 with its JSON body as an `ImmediateResponse`.
//! - The decision comes from the routing service (workers outside Envoy's subset hint,
//!   `metadata_context["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`,
//!   count as down for it; no configured worker in the subset is an immediate 503). No
//!   routable worker is 503, a shed request (the service's resources exhausted) 429 with
//!   `x-kvc-request-dropped-reason`, a bad request 400: all `ImmediateResponse`s with a JSON
//!   body.
//! - The answer: a `request_headers` response with `clear_route_cache: true` and the header
//!   mutations `x-gateway-destination-endpoint: ip:port` (the decode worker's, from its
//!   `http-url`), `Content-Length` (of the body sent back), the session header with the
//!   session key (inferred ones included), and on a P→D path `x-prefiller-host-port:
//!   ip:port` (the prefill worker's; llm-d's convention: the decode side's sidecar runs the
//!   vLLM two-step). A direct-to-D, local-prefill or colocated decision adds no prefiller
//!   header, and a client's own `x-prefiller-host-port` is removed. The same pick goes in
//!   `dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]`. Then the body, as
//!   `streamed_response` chunks of at most [`MAX_CHUNK`] bytes, the last with
//!   `end_of_stream`. The body is the client's, as the HTTP front would send it to the decode
//!   worker: a direct-to-D `/generate` gets its continuation parameters, and a streamed
//!   request to a vLLM worker gets `stream_options.include_usage` (the final usage chunk
//!   reports the cached tokens).
//! - A request without a body (`end_of_stream` on the headers, e.g. `GET /health`), or with
//!   a body on another path, is sent to a routable worker in turn (decode or colocated
//!   workers when there are any; within the subset hint), the body unchanged; 503 when none
//!   is routable.
//!
//! **Response phase** (response headers `SEND`, body `FULL_DUPLEX_STREAMED`). The response
//! headers get the HTTP front's decision headers (`x-kvc-mode`, `x-kvc-decode-worker`,
//! `x-kvc-prefill-worker`, `x-kvc-reason`, `x-kvc-session`); every body chunk is echoed as it
//! comes (a stream stays a stream), but for the usage-only chunk the router asked for and the
//! client did not, which is removed (and `Content-Length` with it). The outcome is reported
//! when the answer ends, judged as the HTTP front judges a decode worker's answer: `ok` for a
//! 2xx answer (resident tokens: the input plus the answer's `usage.completion_tokens`, the
//! last one of a stream), `direct-cache-miss` for a vLLM direct-to-D turn whose
//! `usage.prompt_tokens_details.cached_tokens` is under half of what the decision counted
//! on, `rejected` for a 503 with `x-kvc-admission: rejected`, else `worker-failed`; so is an
//! answer Envoy reports served by another endpoint than the pick
//! (`metadata_context["envoy.lb"]["x-gateway-destination-endpoint-served"]`), and a stream
//! that ends before the answer did. The decode worker's circuit breaker hears of it as from
//! the HTTP front.
//!
//! **Replicas.** A picker's decisions depend on the request and on what it reads from the
//! workers; with `state = events` (engine KV events and `/metrics`) every replica reads the
//! same, so replicas run active-active behind Envoy's ext_proc cluster with no shared store.
//! What stays per replica is in docs/envoy.md ("Replicas").
//!
//! | module | job |
//! |---|---|
//! | this one | the gRPC server: the ext_proc service, health, serving until shutdown |
//! | `exchange` | one stream: buffering, the decision, the answer's outcome |
//! | `wire` | Envoy's messages: headers, metadata, body chunks, immediate answers |

mod exchange;
mod wire;

pub use wire::{
    DESTINATION_HEADER, DROPPED_REASON_HEADER, LB_NAMESPACE, MAX_CHUNK, PREFILLER_HEADER,
    SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE, body_chunk, set_header,
};

use crate::error::ServeError;
use crate::http::{App, readiness_of};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use exchange::Exchange;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

/// How often the `readiness` health service is brought up to date.
pub const READINESS_INTERVAL: Duration = Duration::from_millis(200);

/// The ext_proc gRPC service name (also a health service name).
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The ext_proc service over the front's shared state.
struct Picker {
    app: Arc<App>,
    next_any: Arc<AtomicUsize>,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let mut exchange = Exchange::new(Arc::clone(&self.app), Arc::clone(&self.next_any));
        tokio::spawn(async move {
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(m)) => m,
                    // The stream ended or broke: a decision still waiting is reported when
                    // the exchange is dropped.
                    Ok(None) | Err(_) => break,
                };
                for answer in exchange.on_message(msg).await {
                    if tx.send(Ok(answer)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Serves the picker over `app` on `listener` until `stop` is cancelled (health turns
/// `NOT_SERVING` as it stops).
pub(crate) fn spawn_epp(
    app: Arc<App>,
    listener: TcpListener,
    stop: &CancellationToken,
) -> JoinHandle<Result<(), ServeError>> {
    let (health, health_service) = tonic_health::server::health_reporter();
    let stop = stop.clone();
    let picker = Picker {
        app: Arc::clone(&app),
        next_any: Arc::new(AtomicUsize::new(0)),
    };
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(async move {
        health
            .set_service_status("liveness", ServingStatus::Serving)
            .await;
        health
            .set_service_status(EXT_PROC_SERVICE, ServingStatus::Serving)
            .await;
        let readiness = {
            let health = health.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(READINESS_INTERVAL);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        _ = tick.tick() => {}
                    }
                    let status = if readiness_of(&app).missing.is_none() {
                        ServingStatus::Serving
                    } else {
                        ServingStatus::NotServing
                    };
                    health.set_service_status("readiness", status).await;
                    health.set_service_status("", status).await;
                }
            })
        };
        let result = tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(ExternalProcessorServer::new(picker))
            .serve_with_incoming_shutdown(incoming, {
                let health = health.clone();
                async move {
                    stop.cancelled().await;
                    for name in ["", "readiness", "liveness", EXT_PROC_SERVICE] {
                        health
                            .set_service_status(name, ServingStatus::NotServing)
                            .await;
                    }
                }
            })
            .await;
        readiness.abort();
        result.map_err(ServeError::Transport)
    })
}
