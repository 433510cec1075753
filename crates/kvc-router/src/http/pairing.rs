//! P→D pairing: the bootstrap fields that pair a prefill worker with a decode worker
//! (`bootstrap_host`, `bootstrap_port`, a fresh `bootstrap_room`), and the prefill worker's
//! request, which runs beside the decode worker's and may outlive the client's answer.

use super::app::App;
use super::attempt::{counts_against_breaker, is_success};
use super::endpoints::HttpWorker;
use crate::telemetry::WorkerCall;
use crate::worker_http::{Call, ForwardError, WorkerAnswer};
use axum::body::Bytes;
use axum::http::{HeaderName, HeaderValue};
use kvc_core::WorkerId;
use serde_json::{Map, Value};
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::task::JoinHandle;

/// Random bootstrap rooms: each P→D pair gets one, so that P and D find each other's KV
/// transfer.
pub(super) struct BootstrapRooms {
    random: std::collections::hash_map::RandomState,
    counter: AtomicU64,
}

impl BootstrapRooms {
    pub(super) fn new() -> Self {
        BootstrapRooms {
            random: std::collections::hash_map::RandomState::new(),
            counter: AtomicU64::new(0),
        }
    }

    /// A random room in `0..2^63`.
    pub(super) fn next(&self) -> u64 {
        let mut h = self.random.build_hasher();
        h.write_u64(self.counter.fetch_add(1, Ordering::Relaxed));
        h.finish() >> 1
    }

    /// Injects prefill worker `p`'s bootstrap address and a fresh room into `body`.
    pub(super) fn add_to(&self, body: &mut Map<String, Value>, p: &HttpWorker) {
        body.insert("bootstrap_host".into(), Value::from(p.url.host.clone()));
        body.insert("bootstrap_port".into(), Value::from(p.bootstrap_port));
        body.insert("bootstrap_room".into(), Value::from(self.next()));
    }
}

/// P's answer (or its absence), as its task ends.
pub(super) type PrefillResult = Result<WorkerAnswer, ForwardError>;

/// Whether P's answer says it gave up waiting for its decode partner: a `504 Gateway
/// Timeout` from the prefill worker itself (it answered, so it is up; the only party it
/// waits for is the decode worker that should join its bootstrap room).
pub(super) fn partner_timed_out(r: &PrefillResult) -> bool {
    matches!(r, Ok(a) if a.status == 504)
}

/// The request to the prefill worker of a P→D path, running on its own task (it feeds P's
/// breaker itself, so it may outlive the client's answer).
pub(super) struct PrefillLeg {
    pub(super) id: WorkerId,
    task: JoinHandle<PrefillResult>,
    /// P's answer once it is known to be a success.
    done: Option<PrefillResult>,
}

/// A task that ended without its result (panicked or aborted), as a broken call.
fn lost(e: &tokio::task::JoinError) -> PrefillResult {
    Err(ForwardError::Broken(e.to_string()))
}

impl PrefillLeg {
    /// Sends `payload` to prefill worker `id` at `p` on its own task, `call` its span.
    pub(super) fn start(
        app: &Arc<App>,
        id: WorkerId,
        p: HttpWorker,
        path: &'static str,
        payload: Bytes,
        headers: Vec<(HeaderName, HeaderValue)>,
        mut call: WorkerCall,
    ) -> PrefillLeg {
        let timeout = app.options.request_timeout;
        app.breakers
            .on_dispatch(&app.service, id, app.service.now_ms());
        let app = Arc::clone(app);
        let task = tokio::spawn(async move {
            let r = app
                .client
                .post_whole(Call {
                    base: p.url.clone(),
                    path,
                    headers: &headers,
                    body: payload,
                    timeout,
                })
                .await;
            call.record_answer(r.as_ref().map(|a| a.status));
            if partner_timed_out(&r) {
                // P is up and says its decode partner never came: that is the partner's
                // failure, judged where the partner is known (`Attempt::prefill_failed_first`).
                app.breakers.on_abandoned(&app.service, id);
            } else {
                app.feed_breaker(id, counts_against_breaker(r.as_ref().map(|a| a.status)));
            }
            if !is_success(&r) {
                let detail = match &r {
                    Ok(a) => format!("status {}", a.status),
                    Err(e) => e.to_string(),
                };
                tracing::warn!(worker = id.0, %detail, "prefill worker failed");
            }
            r
        });
        PrefillLeg {
            id,
            task,
            done: None,
        }
    }

    /// Runs `decode` (the decode worker's side) to its end, unless P fails first: then
    /// `decode` is dropped (closing its connection: D would only wait for KV that never
    /// comes) and P's failure is the error. When both are ready, D's answer wins.
    pub(super) async fn race<T>(
        &mut self,
        decode: impl Future<Output = T>,
    ) -> Result<T, PrefillResult> {
        tokio::pin!(decode);
        loop {
            if self.done.is_some() {
                return Ok(decode.await);
            }
            tokio::select! {
                biased;
                out = &mut decode => return Ok(out),
                joined = &mut self.task => {
                    let r = joined.unwrap_or_else(|e| lost(&e));
                    if is_success(&r) {
                        self.done = Some(r);
                    } else {
                        return Err(r);
                    }
                }
            }
        }
    }

    /// Whether P has already failed on its own account (its task ended without success,
    /// other than by waiting in vain for its decode partner).
    pub(super) async fn failed(&mut self) -> bool {
        if self.done.is_none() && self.task.is_finished() {
            let r = (&mut self.task).await.unwrap_or_else(|e| lost(&e));
            self.done = Some(r);
        }
        self.done
            .as_ref()
            .is_some_and(|r| !is_success(r) && !partner_timed_out(r))
    }

    /// Stops P's request if it is still running: D will take no KV from it. Its breaker is
    /// not fed (the failure was not P's).
    pub(super) fn abandon(self, app: &App) {
        if self.done.is_none() && !self.task.is_finished() {
            self.task.abort();
            app.breakers.on_abandoned(&app.service, self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::WorkerUrl;

    #[test]
    fn rooms_are_below_2_pow_63_and_differ() {
        let rooms = BootstrapRooms::new();
        let all: std::collections::HashSet<u64> = (0..1_000).map(|_| rooms.next()).collect();
        assert_eq!(all.len(), 1_000);
        assert!(all.iter().all(|r| *r < 1 << 63));
    }

    #[test]
    fn bootstrap_fields_name_the_prefill_worker() {
        let p = HttpWorker {
            url: WorkerUrl::parse("http://10.0.0.1:30000").unwrap(),
            bootstrap_port: 8998,
            engine: None,
        };
        let mut body = Map::new();
        BootstrapRooms::new().add_to(&mut body, &p);
        assert_eq!(body["bootstrap_host"], "10.0.0.1");
        assert_eq!(body["bootstrap_port"], 8998);
        assert!(body["bootstrap_room"].as_u64().unwrap() < 1 << 63);
    }
}
