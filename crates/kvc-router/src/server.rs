//! Running the router: bind the gRPC and metrics listeners, start the background tasks, stop
//! on a shutdown future.

use crate::config::RouterConfig;
use crate::error::ServeError;
use crate::service::RouterService;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A router serving in this process.
#[derive(Debug)]
pub struct RunningRouter {
    grpc_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    http_addr: Option<SocketAddr>,
    epp_addr: Option<SocketAddr>,
    service: Arc<RouterService>,
    stop: CancellationToken,
    task: JoinHandle<Result<(), ServeError>>,
}

impl RunningRouter {
    /// The bound gRPC address (the real port when the configuration asked for port 0).
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// The bound metrics address, if metrics are served.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The bound HTTP data-plane address, if the HTTP front is served (`http-listen`).
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// The bound endpoint-picker address, if the picker is served (`epp-listen`).
    pub fn epp_addr(&self) -> Option<SocketAddr> {
        self.epp_addr
    }

    /// The service behind the listeners.
    pub fn service(&self) -> &Arc<RouterService> {
        &self.service
    }

    /// Starts a graceful shutdown (as if the shutdown future had completed).
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Waits until the servers and background tasks have stopped.
    pub async fn wait(self) -> Result<(), ServeError> {
        self.task
            .await
            .map_err(|e| ServeError::Join(e.to_string()))?
    }
}

/// Builds a [`RouterService`] from `config` and serves it until `shutdown` completes.
///
/// Returns once every listener is bound (port 0 picks a free port; see
/// [`RunningRouter::grpc_addr`]). Serves `kvc.v1.Router`, `grpc.health.v1.Health` and gRPC
/// reflection on the gRPC address, Prometheus text on `/metrics` at the metrics address, and,
/// when `http-listen` is set, the HTTP data plane ([`crate::http`], forwarding to the
/// workers' `http-url`s) at that address, and when `epp-listen` is set, the endpoint picker
/// for Envoy ([`crate::epp`]) at that one; the two share one front state.
/// Must be called within a tokio runtime.
pub async fn serve(
    config: RouterConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<RunningRouter, ServeError> {
    let service = Arc::new(RouterService::new(config)?);
    serve_service(service, shutdown).await
}

/// Serves an existing [`RouterService`] (e.g. one on a test clock) until `shutdown` completes.
pub async fn serve_service(
    service: Arc<RouterService>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<RunningRouter, ServeError> {
    let config = service.config().clone();
    // Tokens and TLS files, read before anything is bound.
    crate::auth::warn_open_listeners(&config);
    let tokens = crate::auth::Tokens::load(&config.auth)?;
    let grpc_tls = config.tls.grpc.as_ref().map(crate::tls::grpc_server_config);
    let http_tls = config.tls.http.as_ref().map(crate::tls::http_server_config);
    let (grpc_tls, http_tls) = (grpc_tls.transpose()?, http_tls.transpose()?);
    // The inference pool's reader (its API, namespace, token and CA found) before anything is
    // bound.
    let pool = config
        .inference_pool
        .as_ref()
        .map(crate::pool::PoolReader::from_config)
        .transpose()?;
    // Tracing (off without a `[tracing]` table), shared by the fronts.
    let telemetry = crate::telemetry::Telemetry::from_config(&config)?;
    // The HTTP front (its tokenizer file loaded, its workers' URLs parsed) before anything
    // is bound.
    let front = match (config.http_listen, config.epp_listen) {
        (None, None) => None,
        _ => Some(crate::http::front_state_from_config(
            Arc::clone(&service),
            telemetry.clone(),
        )?),
    };
    let http_app = match (config.http_listen, &front) {
        (Some(_), Some(front)) => Some(crate::auth::require_http(
            crate::http::router_over(Arc::clone(front)),
            tokens.http.clone(),
        )),
        _ => None,
    };
    let epp = match config.epp_listen {
        Some(addr) => Some(bind("epp", addr).await?),
        None => None,
    };
    let epp_addr = epp.as_ref().map(|(_, a)| *a);
    let (grpc_listener, grpc_addr) = bind("grpc", config.listen).await?;
    let (metrics_listener, metrics_addr) = match config.metrics_listen {
        Some(addr) => {
            let (listener, bound) = bind("metrics", addr).await?;
            (Some(listener), Some(bound))
        }
        None => (None, None),
    };

    let http = match (config.http_listen, http_app) {
        (Some(addr), Some(app)) => {
            let (listener, bound) = bind("http", addr).await?;
            Some((listener, bound, app))
        }
        _ => None,
    };
    let http_addr = http.as_ref().map(|(_, a, _)| *a);

    let stop = CancellationToken::new();
    // The gRPC front (it builds its reflection service first: nothing runs yet if that fails).
    let grpc = crate::grpc::spawn_grpc(
        &service,
        grpc_listener,
        &stop,
        grpc_tls,
        tokens.grpc,
        telemetry.clone(),
    )
    .await?;
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = shutdown => stop.cancel(),
                () = stop.cancelled() => {}
            }
        });
    }

    service.bind_event_listener(&stop).await?;
    let mut background = spawn_background(&service, &stop);
    if let Some(pool) = pool {
        background.push(pool.spawn(Arc::clone(&service), stop.clone()));
    }

    let metrics = metrics_listener.map(|listener| {
        let stop = stop.clone();
        let svc = Arc::clone(&service);
        tokio::spawn(async move {
            let app = axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || {
                    let svc = Arc::clone(&svc);
                    async move {
                        (
                            [(
                                axum::http::header::CONTENT_TYPE,
                                "text/plain; version=0.0.4; charset=utf-8",
                            )],
                            svc.render_metrics(),
                        )
                    }
                }),
            );
            axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
                .map_err(ServeError::Metrics)
        })
    });

    let epp = match (epp, front) {
        (Some((listener, _)), Some(front)) => Some(crate::epp::spawn_epp(front, listener, &stop)),
        _ => None,
    };

    let http = http.map(|(listener, _, app)| {
        let stop = stop.clone();
        // Bounded connections and deadlines (the `[http]` listener keys); `TCP_NODELAY`, so
        // streamed events go out as they come; TLS when configured.
        let options = crate::http::ListenerOptions::from_config(&service.config().http);
        let tls = http_tls.map(tokio_rustls::TlsAcceptor::from);
        tokio::spawn(async move {
            crate::http::serve_front(listener, app, options, tls, stop).await;
            Ok(())
        })
    });

    tracing::info!(
        grpc = %grpc_addr,
        metrics = ?metrics_addr,
        http = ?http_addr,
        epp = ?epp_addr,
        policy = service.config().policy.name(),
        workers = service.config().workers.len(),
        "kvc-router serving"
    );

    let grace = Duration::from_millis(service.config().shutdown_grace_ms);
    let task = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let grpc_result = finish(grpc, &stop, grace, "grpc").await;
            // Whatever ended the gRPC server ends everything else.
            stop.cancel();
            // The other servers drain concurrently: the grace period bounds them together.
            let (metrics_result, http_result, epp_result) = tokio::join!(
                async {
                    match metrics {
                        Some(m) => finish(m, &stop, grace, "metrics").await,
                        None => Ok(()),
                    }
                },
                async {
                    match http {
                        Some(h) => finish(h, &stop, grace, "http").await,
                        None => Ok(()),
                    }
                },
                async {
                    match epp {
                        Some(e) => finish(e, &stop, grace, "epp").await,
                        None => Ok(()),
                    }
                },
            );
            for b in background {
                let _ = b.await;
            }
            // The spans still queued go to the collector (within its export deadline).
            if telemetry.is_on() {
                let t = telemetry.clone();
                let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
            }
            grpc_result?;
            metrics_result?;
            http_result?;
            epp_result?;
            tracing::info!("kvc-router stopped");
            Ok(())
        })
    };

    Ok(RunningRouter {
        grpc_addr,
        metrics_addr,
        http_addr,
        epp_addr,
        service,
        stop,
        task,
    })
}

/// Waits for a server task; once `stop` is cancelled, waits at most `grace` more (clients
/// holding idle connections would otherwise delay a graceful shutdown forever), then aborts it.
async fn finish(
    mut task: JoinHandle<Result<(), ServeError>>,
    stop: &CancellationToken,
    grace: Duration,
    what: &'static str,
) -> Result<(), ServeError> {
    let joined = tokio::select! {
        r = &mut task => r,
        () = async {
            stop.cancelled().await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(server = what, grace_ms = grace.as_millis() as u64, "connections still open after the grace period; closing them");
            task.abort();
            match task.await {
                Err(e) if e.is_cancelled() => Ok(Ok(())),
                other => other,
            }
        }
    };
    joined.map_err(|e| ServeError::Join(e.to_string()))?
}

/// Starts the background tasks of `service` until `stop` is cancelled: the snapshot refresher
/// (every `refresh-interval-ms`, also expiring idle sessions), one `/metrics` scraper per
/// engine-backed worker (every `engine-signals.scrape-interval-ms`) and, if any worker is known
/// only by its address, the state poller (every `poll-interval-ms`).
pub fn spawn_background(
    service: &Arc<RouterService>,
    stop: &CancellationToken,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    let refresh = Duration::from_millis(service.config().refresh_interval_ms);
    {
        let svc = Arc::clone(service);
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = ticker(refresh);
            while next_tick(&mut tick, &stop).await {
                svc.refresh_workers();
                svc.expire_sessions();
            }
        }));
    }
    for worker in service.event_workers() {
        tasks.push(spawn_event_task(service, worker, stop));
    }
    for worker in service.scraped_workers() {
        tasks.push(spawn_scrape_task(service, worker, stop));
    }
    // A worker added while the router runs gets the same tasks (the handles are not kept:
    // each ends with `stop`, or when its worker leaves the fleet).
    {
        let weak = Arc::downgrade(service);
        let stop = stop.clone();
        let runtime = tokio::runtime::Handle::current();
        service.watch_fleet(move |change| {
            let (&crate::FleetChange::Added(id), Some(svc)) = (change, weak.upgrade()) else {
                return;
            };
            let _guard = runtime.enter();
            if svc.event_workers().contains(&id) {
                drop(spawn_event_task(&svc, id, &stop));
            }
            if svc.scraped_workers().contains(&id) {
                drop(spawn_scrape_task(&svc, id, &stop));
            }
        });
    }
    if service.has_polled_workers() {
        let svc = Arc::clone(service);
        let stop = stop.clone();
        let every = Duration::from_millis(service.config().poll_interval_ms);
        tasks.push(tokio::spawn(async move {
            let mut tick = ticker(every);
            while next_tick(&mut tick, &stop).await {
                svc.poll_workers().await;
            }
        }));
    }
    tasks
}

/// Spawns `task` for `worker`, given the service, the worker's own stop token (cancelled with
/// `stop` or when the worker leaves the fleet) and the scrape interval.
fn spawn_worker_task<F>(
    service: &Arc<RouterService>,
    worker: kvc_core::WorkerId,
    stop: &CancellationToken,
    task: impl FnOnce(Arc<RouterService>, CancellationToken, Duration) -> F,
) -> JoinHandle<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let stop = service.worker_task_token(worker, stop);
    let every = Duration::from_millis(service.config().engine_signals.scrape_interval_ms);
    tokio::spawn(task(Arc::clone(service), stop, every))
}

/// `worker`'s KV-event task: the source read from the engine first when not configured, then
/// the subscriber started once the engine's block size is known (its first scrape); until
/// `stop`, or until the worker leaves the fleet.
fn spawn_event_task(
    service: &Arc<RouterService>,
    worker: kvc_core::WorkerId,
    stop: &CancellationToken,
) -> JoinHandle<()> {
    spawn_worker_task(service, worker, stop, move |svc, stop, every| async move {
        while let Some(wait) = svc.discover_events(worker).await {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
        let mut tick = ticker(every);
        while !svc.start_event_subscriber(worker, &stop) && next_tick(&mut tick, &stop).await {}
    })
}

/// `worker`'s `/metrics` scraper, every `engine-signals.scrape-interval-ms`, until `stop` or
/// until the worker leaves the fleet.
fn spawn_scrape_task(
    service: &Arc<RouterService>,
    worker: kvc_core::WorkerId,
    stop: &CancellationToken,
) -> JoinHandle<()> {
    spawn_worker_task(service, worker, stop, move |svc, stop, every| async move {
        let mut tick = ticker(every);
        while next_tick(&mut tick, &stop).await {
            svc.scrape_worker(worker).await;
        }
    })
}

/// An interval for a periodic task: a late tick delays the next ones, none is made up for.
fn ticker(period: Duration) -> tokio::time::Interval {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

/// Waits for `tick`'s next tick: `true`, or `false` once `stop` is cancelled.
async fn next_tick(tick: &mut tokio::time::Interval, stop: &CancellationToken) -> bool {
    tokio::select! {
        () = stop.cancelled() => false,
        _ = tick.tick() => true,
    }
}

/// A listener on `addr` (`what` names it in the error) and the address it bound.
async fn bind(
    what: &'static str,
    addr: SocketAddr,
) -> Result<(TcpListener, SocketAddr), ServeError> {
    let err = |source| ServeError::Bind { what, addr, source };
    let listener = TcpListener::bind(addr).await.map_err(err)?;
    let bound = listener.local_addr().map_err(err)?;
    Ok((listener, bound))
}
