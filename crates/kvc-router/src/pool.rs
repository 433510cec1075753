//! A Kubernetes InferencePool's pods as the router's workers (the `[inference-pool]` table,
//! [`crate::config::InferencePoolConfig`]).
//!
//! Every `poll-ms` the router reads the pool from the Kubernetes API (`GET
//! /apis/<api-version>/namespaces/<ns>/inferencepools/<name>`: its `spec.selector` and target
//! port), then the pods it selects (`GET /api/v1/namespaces/<ns>/pods?labelSelector=…`), and
//! makes the fleet follow them: a ready pod that is not yet a worker joins
//! ([`crate::RouterService::add_worker`], as an `engine = "vllm"` worker with `http-url`
//! `http://POD_IP:PORT`, discovered like any other); a worker whose pod is not ready or is
//! terminating is drained (its sessions move at their next turn, its requests finish) and put
//! back once the pod is ready again; a worker whose pod is gone, or has another IP now, is
//! removed. A worker the fleet cannot do without (the last decode worker …) is drained and
//! its removal tried again at the next poll. A pod whose role label says no role the router
//! knows is left out, with a warning naming it.
//!
//! The calls carry the service account's token (re-read at every poll) and check the API's
//! certificate against its CA; a failed read changes nothing (the fleet stays as it is) and is
//! logged when its reason changes. The parsing and the plan of each poll are pure functions
//! ([`parse_pool`], [`parse_pods`], [`plan`]), tested on their own.

use crate::RouterService;
pub use crate::config::ApiUrl;
use crate::config::{InferencePoolConfig, WorkerConfig};
use crate::error::ConfigError;
use hyper::body::Bytes;
use kvc_core::{EngineKind, WorkerId, WorkerRole};
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Where a pod finds its service account's token, CA and namespace.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// What the InferencePool says of its pods: the labels that select them and the port they
/// serve on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// `spec.selector`'s labels, each `key = value`, sorted by key.
    pub selector: Vec<(String, String)>,
    /// The pods' serving port (the first of `spec.targetPorts`, or `spec.targetPortNumber`).
    pub port: u16,
}

impl PoolSpec {
    /// The selector as the pod list's `labelSelector` query value (`k=v,k2=v2`, escaped).
    pub fn label_selector(&self) -> String {
        let joined: Vec<String> = self
            .selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        escape_query(&joined.join(","))
    }
}

/// `s` with every byte but RFC 3986's unreserved ones percent-escaped.
fn escape_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A string-to-string map of `value` (labels), or why it is not one.
fn string_map(value: &Value, what: &str) -> Result<Vec<(String, String)>, String> {
    let Some(map) = value.as_object() else {
        return Err(format!("{what} is not an object"));
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let Some(v) = v.as_str() else {
            return Err(format!("{what}[{k}] is not a string"));
        };
        out.push((k.clone(), v.to_owned()));
    }
    out.sort();
    Ok(out)
}

/// Reads an InferencePool object (`inference.networking.k8s.io/v1`: `spec.selector.matchLabels`
/// and `spec.targetPorts[0].number`; `v1alpha2`: `spec.selector` as the labels and
/// `spec.targetPortNumber`).
pub fn parse_pool(body: &[u8]) -> Result<PoolSpec, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the pool is not JSON: {e}"))?;
    let spec = value.get("spec").ok_or("the pool has no spec")?;
    let selector = spec
        .get("selector")
        .ok_or("the pool has no spec.selector")?;
    let labels = match (
        selector.get("matchLabels"),
        selector.get("matchExpressions"),
    ) {
        (_, Some(e)) if e.as_array().is_some_and(|a| !a.is_empty()) => {
            return Err(
                "the pool's spec.selector.matchExpressions are not read: select its pods with \
                 matchLabels"
                    .into(),
            );
        }
        (Some(m), _) => string_map(m, "spec.selector.matchLabels")?,
        (None, _) => string_map(selector, "spec.selector")?,
    };
    if labels.is_empty() {
        return Err("the pool's selector names no label (it would select every pod)".into());
    }
    let port = match (spec.get("targetPorts"), spec.get("targetPortNumber")) {
        (Some(ports), _) => ports
            .as_array()
            .and_then(|a| a.first())
            .and_then(|p| p.get("number"))
            .and_then(Value::as_u64),
        (None, Some(n)) => n.as_u64(),
        (None, None) => None,
    }
    .and_then(|p| u16::try_from(p).ok())
    .filter(|&p| p != 0)
    .ok_or("the pool names no target port (spec.targetPorts[0].number)")?;
    Ok(PoolSpec {
        selector: labels,
        port,
    })
}

/// One pod of the pool, as [`parse_pods`] read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// `metadata.name`.
    pub name: String,
    /// `status.podIP`, once it has one.
    pub ip: Option<IpAddr>,
    /// Running, its `Ready` condition true, and not terminating.
    pub ready: bool,
    /// Its role by its role label, or why the label names none.
    pub role: Result<WorkerRole, String>,
}

/// The role a role label's value names: `prefill`, `decode` (and llm-d's `both`: a decode pod
/// that also serves a request alone, as a vLLM decode worker does), `colocated`.
fn role_of(value: &str) -> Option<WorkerRole> {
    match value {
        "prefill" => Some(WorkerRole::Prefill),
        "decode" | "both" => Some(WorkerRole::Decode),
        "colocated" => Some(WorkerRole::Colocated),
        _ => None,
    }
}

/// Reads a pod list (`items[]`: `metadata.name`, `metadata.labels`,
/// `metadata.deletionTimestamp`, `status.phase`, `status.podIP`, `status.conditions`), each
/// pod's role by `role_label`, else `default_role`.
pub fn parse_pods(
    body: &[u8],
    role_label: &str,
    default_role: WorkerRole,
) -> Result<Vec<Pod>, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the pod list is not JSON: {e}"))?;
    let items = value
        .get("items")
        .and_then(Value::as_array)
        .ok_or("the pod list has no items")?;
    let mut pods = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let meta = item.get("metadata");
        let Some(name) = meta.and_then(|m| m.get("name")).and_then(Value::as_str) else {
            return Err(format!("pod {i} of the list has no metadata.name"));
        };
        let terminating = meta
            .and_then(|m| m.get("deletionTimestamp"))
            .is_some_and(|t| !t.is_null());
        let status = item.get("status");
        let ip = status
            .and_then(|s| s.get("podIP"))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<IpAddr>()
                    .map_err(|_| format!("pod `{name}`'s status.podIP `{s}` is not an IP address"))
            })
            .transpose()?;
        let running =
            status.and_then(|s| s.get("phase")).and_then(Value::as_str) == Some("Running");
        let ready_condition = status
            .and_then(|s| s.get("conditions"))
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.get("type").and_then(Value::as_str) == Some("Ready")
                        && c.get("status").and_then(Value::as_str) == Some("True")
                })
            });
        let label = meta
            .and_then(|m| m.get("labels"))
            .and_then(|l| l.get(role_label))
            .and_then(Value::as_str);
        let role = match label {
            None => Ok(default_role),
            Some(v) => role_of(v).ok_or_else(|| {
                format!(
                    "pod `{name}`'s label {role_label}={v} names no role (expected prefill, \
                     decode, both or colocated): it is left out"
                )
            }),
        };
        pods.push(Pod {
            name: name.to_owned(),
            ip,
            ready: running && ready_condition && !terminating && ip.is_some(),
            role,
        });
    }
    pods.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(pods)
}

/// A worker the pool's pods made, as [`plan`] knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolWorker {
    /// Its worker id.
    pub id: u32,
    /// Its `http-url`, `http://POD_IP:PORT`.
    pub url: String,
    /// Its role.
    pub role: WorkerRole,
    /// Whether the pool drained it (its pod not ready).
    pub drained: bool,
}

/// One change of the fleet a poll makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A ready pod joins: its name, `http-url` and role.
    Add {
        /// The pod's name (the worker's name).
        pod: String,
        /// `http://POD_IP:PORT`.
        url: String,
        /// Its role.
        role: WorkerRole,
    },
    /// The pod is not ready (or terminating): its worker takes no new work.
    Drain(String),
    /// The pod is ready again: its worker is back in rotation.
    Undrain(String),
    /// The pod is gone, or its IP or role changed: its worker leaves.
    Remove(String),
}

/// `http://IP:PORT` for a pod.
fn pod_url(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("http://{v4}:{port}"),
        IpAddr::V6(v6) => format!("http://[{v6}]:{port}"),
    }
}

/// What makes the fleet follow `pods`, given the pool's workers `known` (by pod name): the
/// removals first, then drains and undrains, then the pods that join, the non-prefill ones
/// before the prefill ones (a prefill worker alone cannot serve). A pod whose IP or role
/// changed is removed and joins anew; a pod with no role is neither added nor kept.
pub fn plan(known: &BTreeMap<String, PoolWorker>, pods: &[Pod], port: u16) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut adds = Vec::new();
    let by_name: BTreeMap<&str, &Pod> = pods.iter().map(|p| (p.name.as_str(), p)).collect();
    for (name, w) in known {
        let still = by_name.get(name.as_str()).and_then(|p| {
            let same = p.ip.map(|ip| pod_url(ip, port)).as_deref() == Some(w.url.as_str())
                && p.role.as_ref().ok() == Some(&w.role);
            // A pod that has no IP any more (being restarted) keeps its worker, drained.
            (same || p.ip.is_none() && p.role.is_ok()).then_some(*p)
        });
        match still {
            None => steps.push(Step::Remove(name.clone())),
            Some(p) if !p.ready && !w.drained => steps.push(Step::Drain(name.clone())),
            Some(p) if p.ready && w.drained => steps.push(Step::Undrain(name.clone())),
            Some(_) => {}
        }
    }
    for p in pods {
        let (Some(ip), Ok(role), true) = (p.ip, &p.role, p.ready) else {
            continue;
        };
        let url = pod_url(ip, port);
        let stays = known
            .get(&p.name)
            .is_some_and(|w| w.url == url && w.role == *role);
        if !stays {
            adds.push(Step::Add {
                pod: p.name.clone(),
                url,
                role: *role,
            });
        }
    }
    adds.sort_by_key(|s| {
        matches!(
            s,
            Step::Add {
                role: WorkerRole::Prefill,
                ..
            }
        )
    });
    steps.extend(adds);
    steps
}

/// The worker entry of a pod that joins: `engine = "vllm"`, named by the pod, known by its
/// `http-url` (its `/metrics` there), everything else discovered from the engine.
pub fn pod_worker(id: u32, pod: &str, url: &str, role: WorkerRole) -> WorkerConfig {
    let mut w = WorkerConfig::new(id, role, 0);
    w.name = Some(pod.to_owned());
    w.engine = Some(EngineKind::Vllm);
    w.http_url = Some(url.to_owned());
    w.fill_from_engine_urls();
    w
}

/// Reads the pool and its pods every `poll-ms`, and makes the fleet follow them.
pub(crate) struct PoolReader {
    cfg: InferencePoolConfig,
    namespace: String,
    api: Api,
    /// The workers the pods made, by pod name.
    known: BTreeMap<String, PoolWorker>,
    /// The last problem logged (logged again only when it changes).
    problem: Option<String>,
    /// Pods left out, already warned of.
    warned: std::collections::BTreeSet<String>,
    /// What `/metrics` shows of the reader.
    stats: crate::metrics::PoolStats,
}

impl PoolReader {
    /// The reader of `cfg`, its defaults taken from the pod it runs in: the API from
    /// `KUBERNETES_SERVICE_HOST`/`_PORT`, the namespace, token and CA from the service
    /// account's directory. Errors name what is missing and the key that would give it.
    pub(crate) fn from_config(cfg: &InferencePoolConfig) -> Result<PoolReader, ConfigError> {
        Self::with_env(
            cfg,
            |k| std::env::var(k).ok(),
            Path::new(SERVICE_ACCOUNT_DIR),
        )
    }

    fn with_env(
        cfg: &InferencePoolConfig,
        env: impl Fn(&str) -> Option<String>,
        sa_dir: &Path,
    ) -> Result<PoolReader, ConfigError> {
        let invalid = |m: String| ConfigError::Invalid(format!("inference-pool: {m}"));
        let url = match &cfg.api_url {
            Some(u) => ApiUrl::parse(u).map_err(|e| invalid(format!("api-url `{u}`: {e}")))?,
            None => {
                let Some(host) = env("KUBERNETES_SERVICE_HOST") else {
                    return Err(invalid(
                        "api-url is not set and KUBERNETES_SERVICE_HOST is not in the \
                         environment (the router is not running in a pod): set api-url"
                            .into(),
                    ));
                };
                let port = env("KUBERNETES_SERVICE_PORT").unwrap_or_else(|| "443".into());
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host
                };
                ApiUrl::parse(&format!("https://{host}:{port}")).map_err(|e| {
                    invalid(format!(
                        "KUBERNETES_SERVICE_HOST/PORT do not make an API address: {e}"
                    ))
                })?
            }
        };
        let namespace = match &cfg.namespace {
            Some(n) => n.clone(),
            None => {
                let file = sa_dir.join("namespace");
                std::fs::read_to_string(&file)
                    .map(|n| n.trim().to_owned())
                    .ok()
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| {
                        invalid(format!(
                            "namespace is not set and {} cannot be read: set namespace",
                            file.display()
                        ))
                    })?
            }
        };
        let token_file = match &cfg.token_file {
            Some(f) => Some(f.clone()),
            None => Some(sa_dir.join("token")).filter(|f| f.exists()),
        };
        let tls = if url.https {
            let ca = cfg.ca_file.clone().unwrap_or_else(|| sa_dir.join("ca.crt"));
            let config = crate::tls::client_config("inference-pool", "ca-file", &ca)?;
            Some(tokio_rustls::TlsConnector::from(config))
        } else {
            None
        };
        Ok(PoolReader {
            cfg: cfg.clone(),
            namespace,
            api: Api {
                url,
                tls,
                token_file,
                timeout: Duration::from_millis(cfg.timeout_ms),
            },
            known: BTreeMap::new(),
            problem: None,
            warned: std::collections::BTreeSet::new(),
            stats: crate::metrics::PoolStats::default(),
        })
    }

    /// The JSON of `GET path`, or what went wrong, with the fix where there is one.
    async fn get_ok(&self, path: &str, what: &str) -> Result<Bytes, String> {
        let (status, body) = self.api.get(path).await?;
        match status {
            200 => Ok(body),
            401 => Err(format!(
                "{} answered 401 to reading {what}: the token is missing or not accepted \
                 (token-file)",
                self.api.url
            )),
            403 => Err(format!(
                "{} answered 403 to reading {what}: the router's service account needs `get` \
                 on inferencepools and `list` on pods in namespace {} (a Role and RoleBinding)",
                self.api.url, self.namespace
            )),
            404 => Err(format!(
                "{} answered 404 to reading {what}: no such object (check inference-pool.name, \
                 namespace and api-version)",
                self.api.url
            )),
            s => Err(format!(
                "{} answered HTTP {s} to reading {what}: {}",
                self.api.url,
                String::from_utf8_lossy(&body[..body.len().min(200)])
            )),
        }
    }

    /// The pool's spec and pods, read now.
    async fn read(&self) -> Result<(PoolSpec, Vec<Pod>), String> {
        let ns = escape_query(&self.namespace);
        let pool_path = format!(
            "/apis/{}/namespaces/{ns}/inferencepools/{}",
            self.cfg.api_version,
            escape_query(&self.cfg.name)
        );
        let what = format!("InferencePool {}/{}", self.namespace, self.cfg.name);
        let body = self.get_ok(&pool_path, &what).await?;
        let spec = parse_pool(&body).map_err(|e| format!("{what}: {e}"))?;
        let pods_path = format!(
            "/api/v1/namespaces/{ns}/pods?labelSelector={}",
            spec.label_selector()
        );
        let body = self.get_ok(&pods_path, "the pool's pods").await?;
        let pods = parse_pods(&body, &self.cfg.role_label, self.cfg.default_role)
            .map_err(|e| format!("the pods of {what}: {e}"))?;
        Ok((spec, pods))
    }

    /// One poll: the pool and its pods read, the fleet made to follow them.
    pub(crate) async fn poll(&mut self, svc: &RouterService) {
        self.stats.reads += 1;
        match self.read().await {
            Ok((spec, pods)) => {
                if let Some(p) = self.problem.take() {
                    tracing::info!(pool = %self.cfg.name, "inference pool read again (it failed: {p})");
                }
                self.apply(svc, &spec, &pods);
                self.stats.failing = false;
                self.stats.pods = pods.len();
                self.stats.ready = pods.iter().filter(|p| p.ready).count();
                self.stats.unknown_role = pods.iter().filter(|p| p.role.is_err()).count();
            }
            Err(e) => {
                self.stats.read_failures += 1;
                self.stats.failing = true;
                if self.problem.as_deref() != Some(e.as_str()) {
                    tracing::warn!(pool = %self.cfg.name, "inference pool not read, the fleet is left as it is: {e}");
                    self.problem = Some(e);
                }
            }
        }
        self.retain_in_fleet(svc);
        self.stats.workers = self.known.len();
        svc.set_pool_stats(self.stats);
    }

    /// Forgets the pods whose workers left the fleet some other way (`RemoveWorker`): they
    /// join anew at the next read.
    fn retain_in_fleet(&mut self, svc: &RouterService) {
        self.known
            .retain(|name, w| svc.worker_name(w.id).as_deref() == Some(name.as_str()));
    }

    fn apply(&mut self, svc: &RouterService, spec: &PoolSpec, pods: &[Pod]) {
        self.retain_in_fleet(svc);
        for p in pods {
            if let Err(why) = &p.role
                && self.warned.insert(format!("{}: {why}", p.name))
            {
                tracing::warn!(pool = %self.cfg.name, "{why}");
            }
        }
        let mut adds = Vec::new();
        for step in plan(&self.known, pods, spec.port) {
            match step {
                Step::Remove(pod) => {
                    let Some(w) = self.known.get(&pod).cloned() else {
                        continue;
                    };
                    match svc.remove_worker(WorkerId(w.id)) {
                        Ok(r) => {
                            tracing::info!(pool = %self.cfg.name, pod = %pod, worker = w.id, resident_sessions = r.resident_sessions, in_flight = r.in_flight, "the pod left the pool: its worker is removed");
                            self.known.remove(&pod);
                        }
                        Err(e) => {
                            // The fleet cannot do without it yet: drained meanwhile.
                            if !w.drained {
                                svc.set_drained(WorkerId(w.id), true);
                                if let Some(k) = self.known.get_mut(&pod) {
                                    k.drained = true;
                                }
                            }
                            self.note_problem(format!("pod `{pod}` left the pool: {e}"));
                        }
                    }
                }
                Step::Drain(pod) => {
                    if let Some(w) = self.known.get_mut(&pod) {
                        svc.set_drained(WorkerId(w.id), true);
                        w.drained = true;
                        tracing::info!(pool = %self.cfg.name, pod = %pod, worker = w.id, "the pod is not ready: its worker is drained");
                    }
                }
                Step::Undrain(pod) => {
                    if let Some(w) = self.known.get_mut(&pod) {
                        svc.set_drained(WorkerId(w.id), false);
                        w.drained = false;
                        tracing::info!(pool = %self.cfg.name, pod = %pod, worker = w.id, "the pod is ready again: its worker is back in rotation");
                    }
                }
                Step::Add { pod, url, role } => {
                    // A pod whose IP or role changed joins once its old worker is gone.
                    if !self.known.contains_key(&pod) {
                        adds.push((pod, url, role));
                    }
                }
            }
        }
        self.add(svc, adds);
    }

    /// Adds the pods `adds` (name, `http-url`, role): together (a prefill pod and a decode pod
    /// can only join together), else each on its own.
    fn add(&mut self, svc: &RouterService, adds: Vec<(String, String, WorkerRole)>) {
        let mut batch = Vec::with_capacity(adds.len());
        let mut next = self.cfg.first_id;
        for (pod, url, role) in adds {
            let Some(id) = svc.lowest_free_id(next) else {
                self.note_problem(format!(
                    "pod `{pod}` not added: no worker id is free from inference-pool.first-id {} up",
                    self.cfg.first_id
                ));
                continue;
            };
            next = id + 1;
            batch.push((pod_worker(id, &pod, &url, role), pod));
        }
        let together = match batch.len() {
            0 => return,
            1 => Err(()),
            _ => svc
                .add_pool_workers(batch.iter().map(|(w, _)| w.clone()).collect())
                .map_err(|e| tracing::debug!(pool = %self.cfg.name, "the new pods cannot join together ({e}): each is tried alone")),
        };
        if together.is_ok() {
            for (w, pod) in batch {
                self.joined(w, pod);
            }
            return;
        }
        for (w, pod) in batch {
            match svc.add_pool_workers(vec![w.clone()]) {
                Ok(()) => self.joined(w, pod),
                Err(e) => self.note_problem(format!("pod `{pod}` not added: {e}")),
            }
        }
    }

    fn joined(&mut self, w: WorkerConfig, pod: String) {
        let url = w.http_url.clone().unwrap_or_default();
        tracing::info!(pool = %self.cfg.name, pod = %pod, worker = w.id, url = %url, role = ?w.role, "the pod joined the pool: its worker is added");
        self.known.insert(
            pod,
            PoolWorker {
                id: w.id,
                url,
                role: w.role,
                drained: false,
            },
        );
    }

    fn note_problem(&mut self, p: String) {
        if self.warned.len() >= 1_024 {
            // Bounded: an old warning may be logged again.
            self.warned.clear();
        }
        if self.warned.insert(p.clone()) {
            tracing::warn!(pool = %self.cfg.name, "{p}");
        }
    }

    /// Polls every `poll-ms` until `stop`.
    pub(crate) fn spawn(
        mut self,
        svc: Arc<RouterService>,
        stop: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let every = Duration::from_millis(self.cfg.poll_ms);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = self.poll(&svc) => {}
                }
            }
        })
    }
}

mod api;
#[cfg(test)]
mod tests;

use api::Api;
