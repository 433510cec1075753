//! `kvc-replay workers`: standalone simulated workers serving any client until stopped.

use super::{HttpWorkers, StandaloneOptions, WorkerOptions};
use super::{http_router_config, ready_json, write_file};
use crate::live::LiveError;
use crate::sim::SimConfig;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Where the `kvc-router` configuration for standalone workers is written, and the addresses
/// it gives the router.
#[derive(Debug, Clone)]
pub struct RouterConfigTarget {
    /// The TOML file.
    pub path: PathBuf,
    /// The router's HTTP front.
    pub http_listen: SocketAddr,
    /// Its gRPC listener.
    pub listen: SocketAddr,
    /// Its `/metrics` listener.
    pub metrics_listen: SocketAddr,
}

/// How long standalone workers run and what they write once they serve.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Written (JSON) once the workers serve: their names, roles and URLs.
    pub ready_file: Option<PathBuf>,
    /// Written (TOML) once the workers serve: a `kvc-router` configuration for them.
    pub router_config: Option<RouterConfigTarget>,
    /// Stop after this long (wall time); else on Ctrl-C or SIGTERM only.
    pub duration: Option<Duration>,
}

/// One line per worker: name, role, HTTP URL, and with engine signals its `/metrics` URL and
/// event endpoints.
pub fn worker_lines(workers: &HttpWorkers) -> Vec<String> {
    let names = workers.shared().names();
    workers
        .addrs()
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            let mut line = format!("{} {} http://{addr}", names[i], workers.roles()[i]);
            if let Some(e) = workers.engine_urls().get(i) {
                line.push_str(&format!(
                    " metrics={} kv-events={} kv-events-replay={}",
                    e.metrics_url, e.kv_events, e.kv_events_replay
                ));
            }
            line
        })
        .collect()
}

/// Runs standalone simulated workers (`cfg`'s topology, `opts`, `standalone`): prints their
/// addresses on stdout, writes the ready file and router configuration of `serve`, and serves
/// until Ctrl-C, SIGTERM or `serve.duration`.
pub fn serve_workers(
    cfg: &SimConfig,
    opts: &WorkerOptions,
    standalone: StandaloneOptions,
    serve: &ServeOptions,
) -> Result<(), LiveError> {
    cfg.validate()?;
    let rt = crate::live::runtime()?;
    let workers = HttpWorkers::start_standalone(
        rt.handle(),
        &cfg.cluster(standalone.block_size),
        opts,
        standalone,
    )?;
    for line in worker_lines(&workers) {
        println!("{line}");
    }
    if let Some(target) = &serve.router_config {
        let rc = http_router_config(
            cfg,
            &opts.snapshot_dir,
            target.listen,
            target.http_listen,
            Some(target.metrics_listen),
            &workers,
        );
        write_file(&target.path, &rc.to_toml()?)?;
    }
    if let Some(path) = &serve.ready_file {
        write_file(path, &format!("{:#}\n", ready_json(&workers)))?;
    }
    let stopped_by = rt.block_on(async {
        let duration = async {
            match serve.duration {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            r = tokio::signal::ctrl_c() => match r {
                Ok(()) => Ok("Ctrl-C"),
                Err(e) => Err(LiveError::Invalid(format!("cannot wait for Ctrl-C: {e}"))),
            },
            () = term => Ok("SIGTERM"),
            () = duration => Ok("the end of --duration-s"),
        }
    })?;
    eprintln!("kvc-replay workers: stopping ({stopped_by})");
    Ok(workers.stop()?)
}
