//! Active health checks: every worker's `GET /health` on an interval, fed to its circuit
//! breaker, for as long as the front lives.

use super::app::App;
use super::attempt::counts_against_breaker;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Starts the checks on the current Tokio runtime, if there is one (else none run); they stop
/// when `app` is dropped.
pub(super) fn spawn_health_checks(app: &Arc<App>, interval: Duration) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(health_checks(Arc::downgrade(app), interval));
    }
}

/// Every worker's `GET /health`, every `interval`, while the app lives. A transport failure,
/// a timeout or a 5xx counts against the worker's breaker, unless a request to the worker
/// succeeded after the check was sent; any other answer means it is up, and closes a breaker
/// whose cool-down has ended.
async fn health_checks(app: Weak<App>, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(app) = app.upgrade() else { return };
        app.breakers.tick(&app.service, app.service.now_ms());
        let timeout = app.options.health_check_timeout;
        let mut checks = tokio::task::JoinSet::new();
        let sent_ms = app.service.now_ms();
        for (id, w) in app.workers.iter() {
            let (client, url) = (app.client.clone(), w.url.clone());
            checks.spawn(async move { (id, client.get(&url, "/health", timeout).await) });
        }
        while let Some(done) = checks.join_next().await {
            let Ok((id, r)) = done else { continue };
            let failed = counts_against_breaker(r.as_ref().map(|a| a.status));
            app.service.metrics().record_health_check(!failed);
            if failed {
                let detail = match &r {
                    Ok(a) => format!("status {}", a.status),
                    Err(e) => e.to_string(),
                };
                let counted =
                    app.breakers
                        .on_check_failed(&app.service, id, sent_ms, app.service.now_ms());
                tracing::debug!(worker = id.0, %detail, counted, "health check failed");
            } else {
                app.breakers.on_recovered(&app.service, id);
            }
        }
    }
}
