//! Shared fixtures: a router over snapshot-publishing test workers on a manual clock, a minimal
//! HTTP GET, and a Prometheus text parser; the HTTP front over mock workers in `front`, its
//! client in `client`, and the answer both read in `answer`.
#![allow(dead_code, unreachable_pub)]

pub mod answer;
pub mod client;
pub mod front;
pub mod sglang_mock;

use kvc_admission::{ManualClock, SnapshotWriter};
use kvc_core::WorkerId;
use kvc_proto::convert::ProtoEnum;
use kvc_proto::pb;
use kvc_proto::pb::router_client::RouterClient;
use kvc_router::{RouterConfig, RouterService, RunningRouter, WorkerConfig};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;

pub const CAPACITY: u64 = 92_000;
pub const START_MS: u64 = 1_000_000;
pub const STALE_MS: u64 = 1_000;

/// How long a test polls for a condition before it gives up: far longer than any condition
/// takes on a loaded machine, so only a router that never gets there waits it out.
pub const WAIT: Duration = Duration::from_secs(30);

/// The bound on one small exchange with a server under test: it only guards against a hang.
pub const EXCHANGE: Duration = Duration::from_secs(30);

/// Polls `done` every 10 ms until it holds; panics with `what` when it does not within
/// [`WAIT`] (by the clock, however slowly the polls come).
pub async fn wait_until(what: impl std::fmt::Display, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + WAIT;
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// [`wait_until`] for a thread outside a runtime: polls `done` every 20 ms.
pub fn wait_until_blocking(what: impl std::fmt::Display, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + WAIT;
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A unique temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvc-router-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One prefill (id 0) and two decode workers (ids 1, 2), each publishing a snapshot.
pub struct Cluster {
    pub dir: TempDir,
    pub clock: Arc<ManualClock>,
    pub writers: Vec<SnapshotWriter>,
    pub router: RunningRouter,
    pub client: RouterClient<Channel>,
}

pub fn base_config(dir: &TempDir) -> RouterConfig {
    let mut cfg = RouterConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        stale_after_ms: STALE_MS,
        refresh_interval_ms: 5,
        poll_interval_ms: 20,
        rpc_timeout_ms: 300,
        max_message_bytes: 4_096,
        ..RouterConfig::default()
    };
    let roles = [
        kvc_core::WorkerRole::Prefill,
        kvc_core::WorkerRole::Decode,
        kvc_core::WorkerRole::Decode,
    ];
    cfg.workers = roles
        .iter()
        .enumerate()
        .map(|(i, role)| WorkerConfig {
            name: Some(format!("{}{i}", &role.to_string()[..1])),
            snapshot: Some(dir.0.join(format!("w{i}.snap"))),
            ..WorkerConfig::new(i as u32, *role, CAPACITY)
        })
        .collect();
    cfg
}

impl Cluster {
    pub async fn start(edit: impl FnOnce(&mut RouterConfig)) -> Cluster {
        let dir = TempDir::new("cluster");
        let clock = Arc::new(ManualClock::new(START_MS));
        let mut cfg = base_config(&dir);
        edit(&mut cfg);
        let mut writers = Vec::new();
        for w in &cfg.workers {
            if let Some(path) = &w.snapshot {
                let mut writer =
                    SnapshotWriter::create(path, WorkerId(w.id), w.capacity_tokens, 64).unwrap();
                let mut data = writer.empty_data();
                data.free_tokens = w.capacity_tokens;
                data.publish_ms = START_MS;
                writer.publish(&data).unwrap();
                writers.push(writer);
            }
        }
        let service = Arc::new(RouterService::with_clock(cfg, clock.clone()).unwrap());
        let router = kvc_router::serve_service(service, std::future::pending())
            .await
            .unwrap();
        let client = RouterClient::connect(format!("http://{}", router.grpc_addr()))
            .await
            .unwrap();
        Cluster {
            dir,
            clock,
            writers,
            router,
            client,
        }
    }

    pub fn now(&self) -> u64 {
        use kvc_admission::Clock;
        self.clock.now_ms()
    }

    /// Publishes worker `id`'s pool: `used` tokens used, `free` free, nothing evictable.
    pub fn publish(&mut self, id: u32, used: u64, free: u64) {
        let now = self.now();
        let w = self
            .writers
            .iter_mut()
            .find(|w| w.worker_id() == WorkerId(id))
            .unwrap();
        let mut data = w.empty_data();
        data.used_tokens = used;
        data.free_tokens = free;
        data.publish_ms = now;
        w.publish(&data).unwrap();
    }

    pub fn heartbeat(&mut self, ids: &[u32]) {
        let now = self.now();
        for w in &mut self.writers {
            if ids.contains(&w.worker_id().0) {
                w.heartbeat(now);
            }
        }
    }

    /// Waits (at most [`WAIT`]) until every worker in `ids` has health `health`.
    pub async fn wait_health(&self, ids: &[u32], health: kvc_core::Health) {
        wait_health(self.router.service(), ids, health).await;
    }

    pub async fn metrics(&self) -> Vec<Sample> {
        let text = http_get(self.router.metrics_addr().unwrap(), "/metrics").await;
        parse_prometheus(&text.1)
    }

    /// `ListWorkers` over gRPC.
    pub async fn list_workers(&self) -> Vec<pb::WorkerInfo> {
        self.client
            .clone()
            .list_workers(pb::ListWorkersRequest {})
            .await
            .unwrap()
            .into_inner()
            .workers
    }

    pub fn service(&self) -> &Arc<RouterService> {
        self.router.service()
    }

    /// Reports decision `decision_id` (request `request_id`) served, `resident` tokens left
    /// on its worker.
    pub async fn report_ok(&mut self, decision_id: u64, request_id: u64, resident: u64) {
        self.client
            .report_outcome(pb::OutcomeReport {
                decision_id,
                request_id,
                outcome: kvc_core::Outcome::Ok.to_proto(),
                resident_tokens: resident,
            })
            .await
            .unwrap();
    }
}

/// Waits (at most [`WAIT`]) until every worker in `ids` of `service` has health `health`.
pub async fn wait_health(service: &RouterService, ids: &[u32], health: kvc_core::Health) {
    wait_until(format!("workers {ids:?} becoming {health}"), || {
        let views = service.worker_views();
        ids.iter().all(|id| {
            views
                .iter()
                .any(|v| v.id.0 == *id && v.state.health == health)
        })
    })
    .await;
}

pub fn route_req(
    request_id: u64,
    session: Option<u64>,
    turn: Option<u32>,
    input: u64,
    hash_ids: &[u64],
) -> pb::RouteRequest {
    pb::RouteRequest {
        request_id,
        session_id: session,
        turn_id: turn,
        input_length: input,
        output_hint: 40,
        hash_ids: hash_ids.to_vec(),
        rejected_by: None,
        parent_session_id: None,
    }
}

/// A bounded HTTP/1.1 GET; returns (headers, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(answer::request_head("GET", path, "test", &[], None).as_bytes())
            .await
            .unwrap();
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.unwrap();
        let text = String::from_utf8(buf).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        (head.to_owned(), body.to_owned())
    };
    tokio::time::timeout(EXCHANGE, fut)
        .await
        .expect("metrics GET timed out")
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Parses the Prometheus text format 0.0.4 strictly enough to catch malformed output: every
/// sample's family has a `# TYPE`, names and label names are valid, values are numbers.
pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let kind = parts.next().unwrap();
            let name = parts
                .next()
                .unwrap_or_else(|| panic!("bad comment: {line}"));
            assert!(valid_name(name), "bad metric name in {line}");
            if kind == "TYPE" {
                let t = parts.next().unwrap();
                assert!(
                    ["counter", "gauge", "histogram", "summary", "untyped"].contains(&t),
                    "bad type in {line}"
                );
                assert!(
                    types.insert(name.to_owned(), t.to_owned()).is_none(),
                    "TYPE twice: {name}"
                );
            }
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample: {line}"));
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("bad value in {line}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series.to_owned(), BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels: {line}"));
                (name.to_owned(), parse_labels(body, line))
            }
        };
        assert!(valid_name(&name), "bad metric name in {line}");
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|base| types.get(*base).is_some_and(|t| t == "histogram"))
            })
            .unwrap_or(&name);
        assert!(types.contains_key(family), "sample without TYPE: {line}");
        samples.push(Sample {
            name,
            labels,
            value,
        });
    }
    samples
}

fn parse_labels(body: &str, line: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut chars = body.chars().peekable();
    loop {
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' {
                break;
            }
            key.push(c);
            chars.next();
        }
        if key.is_empty() {
            break;
        }
        assert!(valid_name(&key), "bad label name `{key}` in {line}");
        assert_eq!(chars.next(), Some('='), "{line}");
        assert_eq!(chars.next(), Some('"'), "{line}");
        let mut value = String::new();
        loop {
            match chars.next() {
                Some('\\') => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(c @ ('\\' | '"')) => value.push(c),
                    other => panic!("bad escape {other:?} in {line}"),
                },
                Some('"') => break,
                Some(c) => value.push(c),
                None => panic!("unterminated label value in {line}"),
            }
        }
        out.insert(key, value);
        match chars.next() {
            Some(',') => continue,
            None => break,
            Some(c) => panic!("unexpected `{c}` in {line}"),
        }
    }
    out
}

/// The value of the sample `name` with exactly these labels.
pub fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && s.labels.len() == labels.len()
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .unwrap_or_else(|| panic!("no sample {name} {labels:?}"))
        .value
}

/// A KV-cache event publisher on loopback ports, with a replay socket, under `topic` (empty:
/// none), stopped by `stop`.
/// Publishes `batch` and waits (at most [`WAIT`]) until `applied(seq)` holds, `seq` the
/// batch's number, which it returns. A PUB socket drops what it sends before a subscription
/// has reached it (a subscriber that has just connected, on a loaded machine): when the batch
/// is not applied within a second, an empty batch with the same time follows, whose number
/// shows the subscriber the gap, which it closes by replay.
pub async fn publish_applied(
    p: &kvc_events::Publisher,
    batch: kvc_events::EventBatch,
    what: &str,
    applied: impl Fn(u64) -> bool,
) -> u64 {
    let seq = p.publish(&batch).await.unwrap();
    let nudge_at = std::time::Instant::now() + Duration::from_secs(1);
    while std::time::Instant::now() < nudge_at {
        if applied(seq) {
            return seq;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let empty = kvc_events::EventBatch {
        events: Vec::new(),
        ..batch
    };
    p.publish(&empty).await.unwrap();
    wait_until(what, || applied(seq)).await;
    seq
}

pub async fn event_publisher(
    topic: &str,
    stop: &tokio_util::sync::CancellationToken,
) -> kvc_events::Publisher {
    let mut cfg = kvc_events::PublisherConfig::new("tcp://127.0.0.1:0");
    cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    cfg.topic = topic.into();
    kvc_events::Publisher::bind(cfg, stop.clone())
        .await
        .unwrap()
}
