//! The listener: one SUB socket the router *binds*, for engines that connect their PUB
//! socket to it (llm-d's "central" mode: vLLM connects its publisher for an endpoint
//! `tcp://HOST:PORT` that names no wildcard).
//!
//! Every engine publishes on the same socket, so a message's topic names its worker
//! ([`Listener::expect`] says which topics are whose):
//! - a topic equal to a worker's own configured topic is that worker's;
//! - otherwise a topic `kv@NAME` or `kv@NAME@MODEL` (the form vLLM deployments use,
//!   `kv@<pod>@<model>`) is the worker named `NAME` — the text between the first `@` and the
//!   next one (or the end), compared exactly;
//! - any other topic, or one naming no listening worker, is **never** indexed: it is
//!   counted ([`ListenerStats::unknown_topic`]) and logged once per topic (the first 256
//!   distinct topics; the rest are counted only).
//!
//! Data-parallel ranks: vLLM offsets its endpoint's port by the rank, so an engine's rank
//! `r` connects to `PORT + r`. A listener for `ranks` ranks binds `PORT, …, PORT + ranks −
//! 1`, and a message that arrives on socket `r` belongs to rank `r` of its worker.
//!
//! Each (worker, rank) keeps its own sequence tracking, replay and counters: the listener
//! only hands its messages to that stream's task ([`Listener::start`]), the same one a
//! worker's own SUB socket feeds ([`crate::subscriber`]), through a bounded queue. A full
//! queue drops the message (counted as `overflow`), which the stream sees as a gap and
//! closes by replay. Messages for a listening worker whose stream has not started yet (the
//! router does not know its block size yet) are counted as `not_started` and dropped: once
//! started, the stream's first message above 0 asks for a replay from 0.

use crate::subscriber::{SharedIndex, Subscriber, SubscriberConfig, spawn_fed};
use kvc_core::WorkerId;
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SubSocket, ZmqMessage};

/// Distinct unknown topics logged (and listed in [`ListenerStats`]); more are only counted.
pub const LOGGED_TOPICS: usize = 256;

/// Where a listener binds.
#[derive(Debug, Clone)]
pub struct ListenerConfig {
    /// `tcp://*:PORT`, `tcp://0.0.0.0:PORT` or `tcp://HOST:PORT` (the wildcard is bound as
    /// `0.0.0.0`); port 0 picks a free port (one rank only).
    pub endpoint: String,
    /// Data-parallel ranks of the engines: sockets bound at `PORT + r` for each `r` below it.
    pub ranks: u32,
    /// Messages queued per stream; more are dropped (`overflow`).
    pub queue: usize,
}

impl ListenerConfig {
    /// One rank, 10,000 messages queued per stream.
    pub fn new(endpoint: impl Into<String>) -> Self {
        ListenerConfig {
            endpoint: endpoint.into(),
            ranks: 1,
            queue: 10_000,
        }
    }
}

/// Why a listener could not start.
#[derive(Debug, Error)]
pub enum ListenError {
    /// The endpoint is not `tcp://host:port`.
    #[error("`{0}` is not tcp://host:port")]
    Endpoint(String),
    /// Port 0 with several ranks (their ports follow the first one's).
    #[error("`{0}`: several data-parallel ranks need a fixed port (rank r binds port + r)")]
    PortZero(String),
    /// A port past 65535.
    #[error("`{endpoint}`: rank {rank}'s port {port} is past 65535")]
    PortRange {
        /// The configured endpoint.
        endpoint: String,
        /// The rank.
        rank: u32,
        /// Its port.
        port: u32,
    },
    /// A socket could not bind.
    #[error("cannot bind {endpoint}: {error}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// The ZeroMQ error.
        error: String,
    },
}

/// What the listener could not hand to a stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListenerStats {
    /// Messages received, on every socket.
    pub received: u64,
    /// Messages whose frames were not `[topic, 8-byte seq, payload]`.
    pub malformed: u64,
    /// Messages whose topic names no listening worker (never indexed).
    pub unknown_topic: u64,
    /// Messages for a listening worker whose stream of that rank has not started.
    pub not_started: u64,
    /// Messages dropped because their stream's queue was full.
    pub overflow: u64,
    /// The unknown topics seen (at most [`LOGGED_TOPICS`]), in the order first seen.
    pub unknown_topics: Vec<String>,
}

#[derive(Debug, Default)]
struct Counters {
    received: AtomicU64,
    malformed: AtomicU64,
    unknown_topic: AtomicU64,
    not_started: AtomicU64,
    overflow: AtomicU64,
}

#[derive(Debug)]
struct Route {
    worker: WorkerId,
    /// Per rank, the queue of its stream once started.
    ranks: Vec<Option<mpsc::Sender<ZmqMessage>>>,
}

#[derive(Debug, Default)]
struct Routes {
    routes: Vec<Route>,
    by_name: HashMap<String, usize>,
    by_topic: HashMap<Vec<u8>, usize>,
}

impl Routes {
    fn find(&self, topic: &[u8]) -> Option<usize> {
        if let Some(&i) = self.by_topic.get(topic) {
            return Some(i);
        }
        let name = topic_worker(topic)?;
        self.by_name.get(name).copied()
    }
}

/// The worker name a topic `kv@NAME` or `kv@NAME@MODEL` carries (see the module doc).
pub fn topic_worker(topic: &[u8]) -> Option<&str> {
    let rest = std::str::from_utf8(topic).ok()?.strip_prefix("kv@")?;
    let name = rest.split('@').next().unwrap_or("");
    (!name.is_empty()).then_some(name)
}

#[derive(Debug, Default)]
struct Shared {
    routes: RwLock<Routes>,
    counters: Counters,
    unknown: Mutex<(HashSet<Vec<u8>>, Vec<String>)>,
}

/// A running listener (its tasks own the sockets).
#[derive(Debug)]
pub struct Listener {
    shared: Arc<Shared>,
    endpoints: Vec<String>,
    queue: usize,
    tasks: Vec<JoinHandle<()>>,
}

impl Listener {
    /// Binds one SUB socket per rank (subscribed to every topic) and starts reading them;
    /// the tasks stop when `cancel` fires.
    pub async fn bind(cfg: ListenerConfig, cancel: CancellationToken) -> Result<Self, ListenError> {
        let (host, port) = cfg
            .endpoint
            .strip_prefix("tcp://")
            .and_then(|r| r.rsplit_once(':'))
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .filter(|(h, _)| !h.is_empty())
            .ok_or_else(|| ListenError::Endpoint(cfg.endpoint.clone()))?;
        let host = if host == "*" { "0.0.0.0" } else { host };
        let ranks = cfg.ranks.max(1);
        if port == 0 && ranks > 1 {
            return Err(ListenError::PortZero(cfg.endpoint.clone()));
        }
        let shared = Arc::new(Shared::default());
        let mut endpoints = Vec::new();
        let mut sockets = Vec::new();
        for rank in 0..ranks {
            let p = u32::from(port) + rank;
            if p > u32::from(u16::MAX) {
                return Err(ListenError::PortRange {
                    endpoint: cfg.endpoint.clone(),
                    rank,
                    port: p,
                });
            }
            let ep = format!("tcp://{host}:{p}");
            let mut sub = SubSocket::new();
            let bind_err = |e: zeromq::ZmqError| ListenError::Bind {
                endpoint: ep.clone(),
                error: e.to_string(),
            };
            sub.subscribe("").await.map_err(bind_err)?;
            let bound = sub.bind(&ep).await.map_err(bind_err)?;
            endpoints.push(bound.to_string());
            sockets.push(sub);
        }
        let tasks = sockets
            .into_iter()
            .enumerate()
            .map(|(rank, sub)| tokio::spawn(read(sub, rank, Arc::clone(&shared), cancel.clone())))
            .collect();
        Ok(Listener {
            shared,
            endpoints,
            queue: cfg.queue.max(1),
            tasks,
        })
    }

    /// The bound endpoints, rank 0's first (ports resolved).
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Declares `worker`, named `name`, a listening worker: messages whose topic names it
    /// (its own `topic`, when it has one, or `kv@name[@…]`) are its. Declaring a worker
    /// again adds the name and topic (its streams stay); declaring a name or topic again
    /// gives it to the later worker.
    pub fn expect(&self, worker: WorkerId, name: &str, topic: Option<&str>) {
        let mut r = self.shared.routes.write();
        let i = match r.routes.iter().position(|x| x.worker == worker) {
            Some(i) => i,
            None => {
                r.routes.push(Route {
                    worker,
                    ranks: Vec::new(),
                });
                r.routes.len() - 1
            }
        };
        r.by_name.insert(name.to_owned(), i);
        if let Some(t) = topic.filter(|t| !t.is_empty()) {
            r.by_topic.insert(t.as_bytes().to_vec(), i);
        }
    }

    /// Starts the stream of `cfg.worker`'s rank `cfg.rank` (declared with
    /// [`Listener::expect`] first; `None` otherwise, or when that rank already runs): its
    /// messages from now on go to a task with its own sequence tracking, replaying from
    /// `cfg.replay_endpoint`.
    pub fn start(
        &self,
        cfg: SubscriberConfig,
        index: SharedIndex,
        cancel: CancellationToken,
    ) -> Option<Subscriber> {
        let mut r = self.shared.routes.write();
        let route = r.routes.iter_mut().find(|x| x.worker == cfg.worker)?;
        let rank = cfg.rank as usize;
        if route.ranks.len() <= rank {
            route.ranks.resize_with(rank + 1, || None);
        }
        if route.ranks[rank].is_some() {
            return None;
        }
        let (tx, rx) = mpsc::channel(self.queue);
        route.ranks[rank] = Some(tx);
        drop(r);
        Some(spawn_fed(cfg, index, rx, cancel))
    }

    /// What could not be handed to a stream, so far.
    pub fn stats(&self) -> ListenerStats {
        let c = &self.shared.counters;
        ListenerStats {
            received: c.received.load(Relaxed),
            malformed: c.malformed.load(Relaxed),
            unknown_topic: c.unknown_topic.load(Relaxed),
            not_started: c.not_started.load(Relaxed),
            overflow: c.overflow.load(Relaxed),
            unknown_topics: self.shared.unknown.lock().1.clone(),
        }
    }

    /// Stops the tasks (they stop on the cancellation token too) and waits for them.
    pub async fn shutdown(self) {
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Reads one rank's socket until cancelled, handing each message to its stream.
async fn read(mut sub: SubSocket, rank: usize, shared: Arc<Shared>, cancel: CancellationToken) {
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => return,
            m = sub.recv() => m,
        };
        match msg {
            Ok(m) => route(&shared, rank, m),
            Err(e) => {
                // A bound socket outlives its peers; an error here is the socket's own end.
                tracing::warn!(rank, "kv-events listener: socket closed: {e}");
                return;
            }
        }
    }
}

fn route(shared: &Shared, rank: usize, msg: ZmqMessage) {
    let c = &shared.counters;
    c.received.fetch_add(1, Relaxed);
    let topic = match msg.get(0) {
        Some(t) if msg.len() == 3 && msg.get(1).is_some_and(|s| s.len() == 8) => t.clone(),
        _ => {
            c.malformed.fetch_add(1, Relaxed);
            tracing::debug!(
                rank,
                frames = msg.len(),
                "kv-events listener: malformed message dropped"
            );
            return;
        }
    };
    let routes = shared.routes.read();
    let Some(i) = routes.find(&topic) else {
        drop(routes);
        c.unknown_topic.fetch_add(1, Relaxed);
        let mut seen = shared.unknown.lock();
        if seen.0.len() < LOGGED_TOPICS && seen.0.insert(topic.to_vec()) {
            let shown = String::from_utf8_lossy(&topic).into_owned();
            tracing::warn!(
                rank,
                topic = %shown,
                "kv-events listener: a topic that names no listening worker (want kv@NAME@MODEL \
                 with a worker's name, or a worker's kv-events-topic); its events are not indexed"
            );
            seen.1.push(shown);
        }
        return;
    };
    let route = &routes.routes[i];
    match route.ranks.get(rank).and_then(Option::as_ref) {
        None => {
            c.not_started.fetch_add(1, Relaxed);
            tracing::debug!(worker = %route.worker, rank, "kv-events listener: stream not started; message dropped");
        }
        Some(tx) => {
            if let Err(e) = tx.try_send(msg) {
                c.overflow.fetch_add(1, Relaxed);
                tracing::debug!(worker = %route.worker, rank, "kv-events listener: stream queue: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_name_their_worker() {
        assert_eq!(topic_worker(b"kv@d0@llama"), Some("d0"));
        assert_eq!(topic_worker(b"kv@d0"), Some("d0"));
        assert_eq!(topic_worker(b"kv@pod-1@org/model@v2"), Some("pod-1"));
        for t in [&b"kv@"[..], b"kv@@m", b"d0", b"", b"KV@d0@m", b"\xff"] {
            assert_eq!(topic_worker(t), None, "{t:?}");
        }
        let mut r = Routes::default();
        r.routes.push(Route {
            worker: WorkerId(1),
            ranks: Vec::new(),
        });
        r.routes.push(Route {
            worker: WorkerId(2),
            ranks: Vec::new(),
        });
        r.by_name.insert("d0".into(), 0);
        r.by_name.insert("d1".into(), 1);
        r.by_topic.insert(b"custom".to_vec(), 1);
        assert_eq!(r.find(b"kv@d0@m"), Some(0));
        assert_eq!(r.find(b"custom"), Some(1));
        assert_eq!(r.find(b"kv@d2@m"), None);
        assert_eq!(r.find(b"kv@d01@m"), None);
    }
}
