//! The publisher: what an engine's `ZmqEventPublisher` does, for simulated workers and tests.
//!
//! A PUB socket sends `[topic, seq, payload]` for every published batch (`seq` from 0); an
//! optional ROUTER socket answers replay requests from a ring buffer of the last
//! `buffer_steps` batches (default 10,000, vLLM's default), with the framing of
//! [`crate::frames`]: vLLM 0.32's (the topic frame in every reply) unless
//! [`PublisherConfig::replay_topic_frame`] is off (SGLang's and older vLLM's). Payloads are
//! vLLM's map shape ([`crate::encode`]).
//!
//! With [`PublisherConfig::connect`] the PUB socket connects to a subscriber that binds
//! instead (what vLLM does with an endpoint `tcp://HOST:PORT` that names no wildcard, and
//! llm-d's central mode relies on); the replay socket always binds.
//!
//! For tests, [`Publisher::publish_unsent`] numbers and buffers a batch without sending it
//! on the PUB socket — the gap a slow subscriber would see.

use crate::encode::encode_batch;
use crate::event::EventBatch;
use crate::frames::{END_SEQ, parse_seq, seq_frame};
use bytes::Bytes;
use std::collections::VecDeque;
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Where a publisher binds and what it keeps.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// The PUB endpoint to bind, e.g. `tcp://127.0.0.1:5557` (port 0: any free port), or
    /// with `connect` the subscriber's endpoint to connect to.
    pub endpoint: String,
    /// Connect the PUB socket to `endpoint` (a subscriber that binds) instead of binding it.
    pub connect: bool,
    /// The replay ROUTER endpoint to bind, if any.
    pub replay_endpoint: Option<String>,
    /// The topic frame of every message.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Replay replies carry the topic frame, `["", topic, seq, payload]` ending with `["",
    /// "", END_SEQ, ""]`, as vLLM 0.32 and later send them; off: `["", seq, payload]` ending
    /// with `["", END_SEQ, ""]` (SGLang, older vLLM).
    pub replay_topic_frame: bool,
}

impl PublisherConfig {
    /// A publisher on `endpoint`: no replay socket, empty topic, a 10,000-batch buffer,
    /// replies framed as vLLM 0.32 frames them.
    pub fn new(endpoint: impl Into<String>) -> Self {
        PublisherConfig {
            endpoint: endpoint.into(),
            connect: false,
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            replay_topic_frame: true,
        }
    }
}

/// Why publishing failed.
#[derive(Debug, Error)]
pub enum PublishError {
    /// A socket could not bind (or, with `connect`, the PUB socket could not connect).
    #[error("cannot bind or connect {endpoint}: {error}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// The ZeroMQ error.
        error: String,
    },
    /// The publisher task has stopped (cancelled).
    #[error("the publisher has stopped")]
    Closed,
}

struct Publish {
    payload: Bytes,
    /// False: numbered and buffered, not sent live.
    live: bool,
    seq: oneshot::Sender<u64>,
}

/// A running publisher (its task owns the sockets).
#[derive(Debug)]
pub struct Publisher {
    tx: mpsc::Sender<Publish>,
    endpoint: String,
    replay_endpoint: Option<String>,
    task: JoinHandle<()>,
}

impl Publisher {
    /// Binds the sockets (connects the PUB one with [`PublisherConfig::connect`]) and starts
    /// the task; it stops when `cancel` fires or the publisher is dropped.
    pub async fn bind(
        cfg: PublisherConfig,
        cancel: CancellationToken,
    ) -> Result<Self, PublishError> {
        let bind_err = |endpoint: &str, e: zeromq::ZmqError| PublishError::Bind {
            endpoint: endpoint.to_string(),
            error: e.to_string(),
        };
        let mut publisher = PubSocket::new();
        let endpoint = if cfg.connect {
            publisher
                .connect(&cfg.endpoint)
                .await
                .map_err(|e| bind_err(&cfg.endpoint, e))?;
            cfg.endpoint.clone()
        } else {
            publisher
                .bind(&cfg.endpoint)
                .await
                .map_err(|e| bind_err(&cfg.endpoint, e))?
                .to_string()
        };
        let (router, replay_endpoint) = match &cfg.replay_endpoint {
            Some(ep) => {
                let mut r = RouterSocket::new();
                let bound = r.bind(ep).await.map_err(|e| bind_err(ep, e))?;
                (Some(r), Some(bound.to_string()))
            }
            None => (None, None),
        };
        let (tx, rx) = mpsc::channel(1024);
        let task = tokio::spawn(serve(cfg, publisher, router, rx, cancel));
        Ok(Publisher {
            tx,
            endpoint,
            replay_endpoint,
            task,
        })
    }

    /// The bound PUB endpoint (the port resolved), or the one connected to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The bound replay endpoint, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Publishes a batch in vLLM's map shape; returns its sequence number.
    pub async fn publish(&self, batch: &EventBatch) -> Result<u64, PublishError> {
        self.publish_payload(Bytes::from(encode_batch(batch))).await
    }

    /// For tests: numbers and buffers a batch like [`Publisher::publish`] but does not send
    /// it live, so subscribers see a gap they can only close by replay.
    pub async fn publish_unsent(&self, batch: &EventBatch) -> Result<u64, PublishError> {
        self.send(Bytes::from(encode_batch(batch)), false).await
    }

    /// Publishes raw payload bytes (any bytes: tests send malformed ones); returns the
    /// sequence number.
    pub async fn publish_payload(&self, payload: Bytes) -> Result<u64, PublishError> {
        self.send(payload, true).await
    }

    async fn send(&self, payload: Bytes, live: bool) -> Result<u64, PublishError> {
        let (seq, rx) = oneshot::channel();
        self.tx
            .send(Publish { payload, live, seq })
            .await
            .map_err(|_| PublishError::Closed)?;
        rx.await.map_err(|_| PublishError::Closed)
    }

    /// Stops the task and waits for it (the sockets are closed).
    pub async fn shutdown(self) {
        drop(self.tx);
        let _ = self.task.await;
    }
}

async fn recv_request(router: &mut Option<RouterSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match router {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

async fn serve(
    cfg: PublisherConfig,
    mut publisher: PubSocket,
    mut router: Option<RouterSocket>,
    mut rx: mpsc::Receiver<Publish>,
    cancel: CancellationToken,
) {
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
    let mut next = 0u64;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            cmd = rx.recv() => {
                let Some(Publish { payload, live, seq }) = cmd else { break };
                if live {
                    let frames = vec![topic.clone(), seq_frame(next), payload.clone()];
                    if let Ok(msg) = ZmqMessage::try_from(frames)
                        && let Err(e) = publisher.send(msg).await
                    {
                        tracing::debug!("kv-events publisher: send failed: {e}");
                    }
                }
                if cfg.buffer_steps > 0 {
                    if buffer.len() == cfg.buffer_steps {
                        buffer.pop_front();
                    }
                    buffer.push_back((next, payload));
                }
                let _ = seq.send(next);
                next += 1;
            }
            req = recv_request(&mut router) => {
                match req {
                    Ok(req) => {
                        if let Some(r) = router.as_mut() {
                            let reply_topic = cfg.replay_topic_frame.then_some(&topic);
                            answer_replay(r, req, &buffer, reply_topic).await;
                        }
                    }
                    Err(e) => tracing::debug!("kv-events publisher: replay socket: {e}"),
                }
            }
        }
    }
}

/// Answers one replay request `[identity, "", start_seq]` (the delimiter optional) with every
/// buffered batch from `start_seq` on, then the end marker; with `topic`, each reply carries
/// it before the sequence (the end marker an empty topic frame).
async fn answer_replay(
    router: &mut RouterSocket,
    req: ZmqMessage,
    buffer: &VecDeque<(u64, Bytes)>,
    topic: Option<&Bytes>,
) {
    let frames = req.into_vec();
    let (id, delim, start) = match frames.as_slice() {
        [id, d, s] if d.is_empty() => (id.clone(), true, parse_seq(s)),
        [id, s] => (id.clone(), false, parse_seq(s)),
        _ => (Bytes::new(), false, None),
    };
    let Some(start) = start else {
        tracing::debug!("kv-events publisher: malformed replay request ignored");
        return;
    };
    let reply = |topic: Option<Bytes>, seq: Bytes, payload: Bytes| {
        let mut f = vec![id.clone()];
        if delim {
            f.push(Bytes::new());
        }
        f.extend(topic);
        f.push(seq);
        f.push(payload);
        ZmqMessage::try_from(f)
    };
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        let Ok(msg) = reply(topic.cloned(), seq_frame(*seq), payload.clone()) else {
            return;
        };
        if let Err(e) = router.send(msg).await {
            tracing::debug!("kv-events publisher: replay reply failed: {e}");
            return;
        }
    }
    let end_topic = topic.map(|_| Bytes::new());
    if let Ok(msg) = reply(end_topic, Bytes::copy_from_slice(&END_SEQ), Bytes::new())
        && let Err(e) = router.send(msg).await
    {
        tracing::debug!("kv-events publisher: replay end marker failed: {e}");
    }
}
