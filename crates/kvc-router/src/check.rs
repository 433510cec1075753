//! `kvc-router check`: what each worker's engine says of itself, and what is wrong with it,
//! before the router serves (as `nginx -t` checks a configuration).
//!
//! A configuration that loads is checked worker by worker, all at once, each call to an
//! engine within one deadline (module `probe`): the served models, the KV pool and block size
//! and whether prefix caching is on (the engine's `/metrics`, read by
//! [`crate::engine_load`]), where its KV-cache events are and whether replay is offered
//! (configured, or the engine's `GET /kv_event_sources` read by [`crate::discovery`]),
//! whether its answers count cached prompt tokens (one request of one token), and its P/D
//! role and connector where the engine says them. Then the fleet: workers that serve another
//! model than the rest ([`crate::discovery`]'s rule).
//!
//! Each finding is a **problem** (the router cannot do its work with this worker: it cannot be
//! reached, has no KV events, runs without prefix caching, has another role or model than
//! configured) or a **warning** (it works, with less: no event replay, no cached-token
//! counts), and names its fix. The texts are the router's own, where it logs the same thing
//! while it runs.

mod probe;

use crate::config::RouterConfig;
use crate::worker_http::{PoolOptions, WorkerClient};
use kvc_core::{EngineKind, WorkerRole};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

/// One worker as the check found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerCheck {
    /// Its display name.
    pub name: String,
    /// Its configured role.
    pub role: WorkerRole,
    /// Its engine, when configured.
    pub engine: Option<EngineKind>,
    /// Its `http-url`, when configured.
    pub url: Option<String>,
    /// What was found, as (what, value) in the order asked.
    pub facts: Vec<(String, String)>,
    /// What keeps the router from doing its work with it, each with its fix.
    pub problems: Vec<String>,
    /// What works with less than it could, each with its fix.
    pub warnings: Vec<String>,
    /// The models its engine serves (empty: not known).
    pub models: Vec<String>,
}

impl WorkerCheck {
    fn new(w: &crate::config::WorkerConfig) -> Self {
        WorkerCheck {
            name: w.display_name(),
            role: w.role,
            engine: w.engine,
            url: w.http_url.clone(),
            facts: Vec::new(),
            problems: Vec::new(),
            warnings: Vec::new(),
            models: Vec::new(),
        }
    }

    fn fact(&mut self, what: &str, value: impl Into<String>) {
        self.facts.push((what.to_owned(), value.into()));
    }

    fn problem(&mut self, text: impl Into<String>) {
        self.problems.push(text.into());
    }

    fn warning(&mut self, text: impl Into<String>) {
        self.warnings.push(text.into());
    }
}

/// Everything the check found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CheckReport {
    /// Every configured worker, in the configuration's order.
    pub workers: Vec<WorkerCheck>,
    /// Problems of the configuration as a whole (no workers at all).
    pub problems: Vec<String>,
    /// Things the check did not look at, said so.
    pub notes: Vec<String>,
}

impl CheckReport {
    /// How many problems were found, the workers' and the configuration's.
    pub fn problem_count(&self) -> usize {
        self.problems.len() + self.workers.iter().map(|w| w.problems.len()).sum::<usize>()
    }

    /// How many warnings were found.
    pub fn warning_count(&self) -> usize {
        self.workers.iter().map(|w| w.warnings.len()).sum()
    }

    /// The report as `kvc-router check` prints it: each worker and its facts, then every
    /// problem and every warning with the worker it is about, then the counts.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let width = self
            .workers
            .iter()
            .flat_map(|w| w.facts.iter().map(|(k, _)| k.len()))
            .max()
            .unwrap_or(0);
        for w in &self.workers {
            let engine = w.engine.map_or("no engine".to_owned(), |e| e.to_string());
            let url = w.url.as_deref().unwrap_or("no http-url");
            let _ = writeln!(out, "{} ({}, {engine}) {url}", w.name, w.role);
            for (what, value) in &w.facts {
                let _ = writeln!(out, "  {what:<width$}  {value}");
            }
        }
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        let problems: Vec<(&str, &String)> = self
            .problems
            .iter()
            .map(|p| ("configuration", p))
            .chain(
                self.workers
                    .iter()
                    .flat_map(|w| w.problems.iter().map(|p| (w.name.as_str(), p))),
            )
            .collect();
        let warnings: Vec<(&str, &String)> = self
            .workers
            .iter()
            .flat_map(|w| w.warnings.iter().map(|p| (w.name.as_str(), p)))
            .collect();
        for (label, list) in [("problem", &problems), ("warning", &warnings)] {
            for (who, text) in list {
                let _ = writeln!(out, "{label}: {who}: {text}");
            }
        }
        let _ = writeln!(
            out,
            "{} worker(s) checked: {} problem(s), {} warning(s)",
            self.workers.len(),
            problems.len(),
            warnings.len()
        );
        out
    }
}

/// Checks every worker of `config` (already loaded and validated), each call to an engine
/// within `timeout`.
pub async fn check_workers(config: &RouterConfig, timeout: Duration) -> CheckReport {
    let client = WorkerClient::new(PoolOptions {
        connect_timeout: timeout,
        idle_timeout: Duration::from_secs(1),
        max_idle_per_worker: 1,
    });
    let config = Arc::new(config.clone());
    let mut tasks = tokio::task::JoinSet::new();
    for (i, w) in config.workers.iter().enumerate() {
        let (client, config, w) = (client.clone(), Arc::clone(&config), w.clone());
        tasks.spawn(async move {
            let mut out = WorkerCheck::new(&w);
            probe::Probe {
                client: &client,
                router: &config,
                timeout,
            }
            .worker(&w, &mut out)
            .await;
            (i, out)
        });
    }
    let mut workers: Vec<Option<WorkerCheck>> = vec![None; config.workers.len()];
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok((i, out)) => workers[i] = Some(out),
            Err(e) => tracing::error!(error = %e, "a worker's check stopped"),
        }
    }
    let mut report = CheckReport {
        workers: workers
            .into_iter()
            .zip(&config.workers)
            .map(|(w, cfg)| {
                w.unwrap_or_else(|| {
                    let mut w = WorkerCheck::new(cfg);
                    w.problem("its check stopped before it ended");
                    w
                })
            })
            .collect(),
        ..CheckReport::default()
    };
    let served: Vec<Vec<String>> = report.workers.iter().map(|w| w.models.clone()).collect();
    for (w, warning) in report
        .workers
        .iter_mut()
        .zip(crate::discovery::model_warnings(&served))
    {
        if let Some(text) = warning {
            w.problem(text);
        }
    }
    match &config.inference_pool {
        Some(pool) => report.notes.push(format!(
            "the InferencePool `{}`'s pods join as workers while the router runs; they are \
             not checked here",
            pool.name
        )),
        None if config.workers.is_empty() => report.problems.push(
            "no workers: give them with --prefill URL and --decode URL (or --worker URL for \
             colocated engines), or [[workers]] entries in --config"
                .into(),
        ),
        None => {}
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_lists_facts_then_findings_with_their_worker_and_counts() {
        let mut d0 = WorkerCheck {
            name: "d0".into(),
            role: WorkerRole::Decode,
            engine: Some(EngineKind::Vllm),
            url: Some("http://h:1".into()),
            facts: Vec::new(),
            problems: Vec::new(),
            warnings: Vec::new(),
            models: Vec::new(),
        };
        d0.fact("model", "m");
        d0.fact("KV events", "none");
        d0.problem("no KV events: fix it");
        d0.warning("no replay");
        let report = CheckReport {
            workers: vec![d0],
            problems: vec!["no workers".into()],
            notes: Vec::new(),
        };
        assert_eq!(report.problem_count(), 2);
        assert_eq!(report.warning_count(), 1);
        assert_eq!(
            report.render(),
            "d0 (decode, vllm) http://h:1\n  model      m\n  KV events  none\n\
             problem: configuration: no workers\nproblem: d0: no KV events: fix it\n\
             warning: d0: no replay\n1 worker(s) checked: 2 problem(s), 1 warning(s)\n"
        );
    }
}
