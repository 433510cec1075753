//! Reading what a worker's vLLM engine says of itself while the router runs: where its
//! KV-cache events are (`GET /kv_event_sources`, parsed by [`crate::discovery`]) and which
//! models it serves (`GET /v1/models`), each problem kept for `ListWorkers`.

use super::RouterService;
use kvc_core::WorkerId;
use std::time::Duration;

impl RouterService {
    /// Asks `worker`'s vLLM engine where its KV-cache events are (`GET /kv_event_sources`),
    /// for a worker configured without `kv-events`. `None` once there is nothing more to do
    /// (the source is known, or the worker does not discover); else how long to wait before
    /// asking again: growing after a failure (unreachable, an error status, an answer that is
    /// not vLLM's), the longest wait after an answer without a usable source (the engine may
    /// be restarted with events). Problems and warnings are logged when they change, and
    /// shown by [`RouterService::list_workers`].
    pub async fn discover_events(&self, worker: WorkerId) -> Option<Duration> {
        let entry = self.entry(worker.0)?;
        let url = entry.discover.as_ref()?;
        if entry.kv_events().is_some() {
            return None;
        }
        let timeout = Duration::from_millis(self.config.engine_signals.scrape_timeout_ms);
        let answer = self
            .scrape_client
            .get(url, "/kv_event_sources", timeout)
            .await;
        let found = match answer {
            Ok(a) if a.status == 200 => crate::discovery::parse_event_sources(
                &a.body,
                &url.host,
                self.config.kv_events_listen.is_some(),
            )
            .map(|mut d| {
                self.keep_listened_ranks(&mut d);
                d
            })
            .map_err(|e| (e.to_string(), false)),
            Ok(a) if a.status == 404 => {
                Err((crate::discovery::NO_EVENT_SOURCES_ROUTE.to_owned(), true))
            }
            Ok(a) => Err((
                format!("GET /kv_event_sources answered HTTP {}", a.status),
                false,
            )),
            Err(e) => Err((format!("GET /kv_event_sources: {e}"), false)),
        };
        // Which models it serves, asked once it answers as vLLM does.
        let models_known = !entry.discovery.lock().models.is_empty();
        let models = match (&found, !models_known) {
            (Ok(_), true) => match self.scrape_client.get(url, "/v1/models", timeout).await {
                Ok(a) if a.status == 200 => crate::discovery::parse_models(&a.body),
                _ => None,
            },
            _ => None,
        };
        let mut st = entry.discovery.lock();
        st.attempts += 1;
        if let Some(models) = models {
            st.models = models;
        }
        match found {
            Ok(d) => {
                st.answered = true;
                st.problem = None;
                st.wait = Duration::ZERO;
                if st.warnings != d.warnings {
                    for w in &d.warnings {
                        tracing::warn!(worker = worker.0, name = %entry.name, "kv-events discovery: {w}");
                    }
                    st.warnings = d.warnings;
                }
                match d.source {
                    Some(mut source) => {
                        source.block_size =
                            self.workers().config(worker.0).and_then(|c| c.block_size);
                        for r in &source.ranks {
                            tracing::info!(
                                worker = worker.0,
                                name = %entry.name,
                                rank = r.rank,
                                endpoint = r.endpoint.as_deref().unwrap_or("kv-events-listen"),
                                replay = r.replay.as_deref().unwrap_or("none"),
                                topic = %source.topic,
                                "kv-events: source read from the engine"
                            );
                        }
                        entry.set_discovered(source);
                        None
                    }
                    None => Some(crate::discovery::RETRY_MAX),
                }
            }
            Err((problem, answered)) => {
                st.answered |= answered;
                if st.problem.as_deref() != Some(problem.as_str()) {
                    tracing::warn!(worker = worker.0, name = %entry.name, "kv-events discovery: {problem} (retrying)");
                    st.problem = Some(problem);
                }
                st.wait = if answered {
                    crate::discovery::RETRY_MAX
                } else {
                    crate::discovery::next_wait(st.wait)
                };
                Some(st.wait)
            }
        }
    }

    /// Leaves out of a discovered source the ranks that connect to a `kv-events-listen`
    /// port the router does not bind (rank `r` connects to the port plus `r`), each with a
    /// warning naming the key that fixes it.
    fn keep_listened_ranks(&self, d: &mut crate::discovery::Discovered) {
        let bound = self.config.event_listen_ranks();
        let Some(source) = d.source.as_mut() else {
            return;
        };
        source.ranks.retain(|r| {
            let kept = r.endpoint.is_some() || r.rank < bound;
            if !kept {
                d.warnings.push(format!(
                    "rank {} connects to the router's kv-events-listen port plus {}, which the \
                     router does not bind (it binds {bound} port(s)): give a listening worker \
                     kv-events-ranks = {} so that the router binds them",
                    r.rank,
                    r.rank,
                    r.rank + 1
                ));
            }
            kept
        });
        if source.ranks.is_empty() {
            d.source = None;
        }
    }

    /// Per worker, the warning of one whose engine serves none of the fleet's model (as the
    /// engines' `/v1/models` said during discovery).
    pub(super) fn model_warnings(&self) -> Vec<Option<String>> {
        let served: Vec<Vec<String>> = self
            .workers()
            .list
            .iter()
            .map(|w| w.discovery.lock().models.clone())
            .collect();
        crate::discovery::model_warnings(&served)
    }
}
