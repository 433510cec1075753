//! The prefill gate (`http.prefills-per-worker`): how many turns the front lets prefill on one
//! worker at a time, and which waiting turn goes next.
//!
//! A stock engine matches a prompt against its prefix cache when it schedules the prompt, not
//! when the prompt arrives, and schedules its waiting prompts first come, first served. On a
//! busy engine with a small pool a turn whose prefix is cached when the router sends it can
//! wait seconds behind other sessions' long prefills, whose blocks evict that prefix before
//! its turn comes: the engine then computes it all again. With the gate, the front sends a
//! worker at most `limit` turns it has not yet seen the first token of; the others wait in
//! the front, and when one of the sent turns produces its first token (or ends), the waiting
//! turn with the fewest tokens to prefill goes next. A turn whose prefix is cached is short
//! to prefill and allocates little, so it runs before the recomputations that would evict
//! others. A waiting turn's tokens count for half as much for every [`HALF_LIFE`] it has
//! waited, so a long prefill is not held back for good.
//!
//! Only turns their own worker prefills pass through it (colocated, local prefill,
//! direct-to-D): a P→D turn's prefill runs on P, and its first token comes after the KV
//! transfer.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// A waiting turn's tokens to prefill count for half as much for every this long it waited.
pub(crate) const HALF_LIFE: Duration = Duration::from_secs(2);

/// One worker's turns in prefill and the turns waiting for it.
#[derive(Debug, Default)]
struct Lane {
    running: usize,
    waiting: Vec<Waiter>,
}

#[derive(Debug)]
struct Waiter {
    tokens: u64,
    since: Instant,
    seq: u64,
    go: oneshot::Sender<()>,
}

impl Waiter {
    /// Its tokens, halved for every [`HALF_LIFE`] it has waited by `now`.
    fn weight(&self, now: Instant) -> f64 {
        let waited = now.saturating_duration_since(self.since).as_secs_f64();
        self.tokens as f64 * 0.5f64.powf(waited / HALF_LIFE.as_secs_f64())
    }
}

/// The gate of every worker (by worker id); `limit` 0 lets everything through at once.
#[derive(Debug, Clone)]
pub(crate) struct PrefillGate {
    limit: usize,
    lanes: Arc<Mutex<(HashMap<u32, Lane>, u64)>>,
}

/// A turn's place in prefill on its worker; given back when its first token comes
/// ([`Permit::release`]) or when it is dropped.
#[derive(Debug)]
pub(crate) struct Permit {
    gate: Option<(PrefillGate, u32)>,
}

impl PrefillGate {
    pub(crate) fn new(limit: usize) -> Self {
        PrefillGate {
            limit,
            lanes: Arc::default(),
        }
    }

    /// [`PrefillGate::enter`] for a turn of `decision` with `input` prompt tokens, when its
    /// worker prefills it itself (not a P→D turn), waiting at most `timeout` (then the turn
    /// goes without a place: the wait never fails a request).
    pub(crate) async fn enter_for(
        &self,
        decision: &super::decision::Decision,
        input: u64,
        timeout: Duration,
    ) -> Permit {
        if self.limit == 0 || decision.prefill.is_some() {
            return Permit { gate: None };
        }
        let tokens = input.saturating_sub(decision.cached_tokens);
        tokio::time::timeout(timeout, self.enter(decision.decode.0, tokens))
            .await
            .unwrap_or(Permit { gate: None })
    }

    /// Waits until `worker` may take a turn of `tokens` tokens to prefill; the permit holds
    /// its place until released. At once when the gate is off.
    pub(crate) async fn enter(&self, worker: u32, tokens: u64) -> Permit {
        if self.limit == 0 {
            return Permit { gate: None };
        }
        let rx = {
            let mut guard = self.lanes.lock();
            let (lanes, seq) = &mut *guard;
            let lane = lanes.entry(worker).or_default();
            if lane.running < self.limit && lane.waiting.is_empty() {
                lane.running += 1;
                None
            } else {
                let (go, rx) = oneshot::channel();
                *seq += 1;
                lane.waiting.push(Waiter {
                    tokens,
                    since: Instant::now(),
                    seq: *seq,
                    go,
                });
                Some(rx)
            }
        };
        if let Some(rx) = rx {
            let mut waiting = Waiting {
                rx: Some(rx),
                gate: self.clone(),
                worker,
            };
            let handed = match waiting.rx.as_mut() {
                Some(rx) => rx.await.is_ok(),
                None => false,
            };
            waiting.rx = None;
            if !handed {
                // The sender went without sending: the gate itself is gone.
                return Permit { gate: None };
            }
        }
        Permit {
            gate: Some((self.clone(), worker)),
        }
    }

    /// Turns waiting for `worker`.
    #[cfg(test)]
    fn waiting(&self, worker: u32) -> usize {
        self.lanes
            .lock()
            .0
            .get(&worker)
            .map_or(0, |l| l.waiting.len())
    }

    /// Gives a place on `worker` back: the waiting turn that weighs least goes next (the
    /// earliest among equals). A waiter that gave up (its request went away) is skipped.
    fn leave(&self, worker: u32) {
        let mut guard = self.lanes.lock();
        let Some(lane) = guard.0.get_mut(&worker) else {
            return;
        };
        lane.running = lane.running.saturating_sub(1);
        let now = Instant::now();
        while lane.running < self.limit && !lane.waiting.is_empty() {
            let next = (0..lane.waiting.len())
                .min_by(|&a, &b| {
                    let (a, b) = (&lane.waiting[a], &lane.waiting[b]);
                    a.weight(now)
                        .total_cmp(&b.weight(now))
                        .then(a.seq.cmp(&b.seq))
                })
                .unwrap_or(0);
            let waiter = lane.waiting.swap_remove(next);
            if waiter.go.send(()).is_ok() {
                lane.running += 1;
            }
        }
    }
}

/// A turn waiting for its place. Dropped while waiting (its request went away), it gives
/// back a place handed to it in the meantime.
struct Waiting {
    rx: Option<oneshot::Receiver<()>>,
    gate: PrefillGate,
    worker: u32,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if rx.try_recv().is_ok() {
                self.gate.leave(self.worker);
            }
        }
    }
}

impl Permit {
    /// The turn's first token came (or it ended): its worker may take the next.
    pub(crate) fn release(&mut self) {
        if let Some((gate, worker)) = self.gate.take() {
            gate.leave(worker);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lets the spawned tasks that can run, run.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn the_turn_with_the_fewest_tokens_goes_next_and_a_dropped_one_is_skipped() {
        let gate = PrefillGate::new(1);
        let mut first = gate.enter(7, 5_000).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for tokens in [4_000u64, 300, 2_000, 100] {
            let (gate, order) = (gate.clone(), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let mut p = gate.enter(7, tokens).await;
                order.lock().push(tokens);
                p.release();
            }));
            settle().await;
        }
        // Another worker's lane is its own.
        let other = gate.enter(8, 1).await;
        drop(other);
        // A waiter whose request went away gives up its place.
        let quitter = {
            let gate = gate.clone();
            tokio::spawn(async move {
                gate.enter(7, 1).await;
                unreachable!("it is aborted while waiting");
            })
        };
        settle().await;
        assert_eq!(gate.waiting(7), 5);
        quitter.abort();
        settle().await;
        assert!(
            order.lock().is_empty(),
            "nothing goes before the first is released"
        );
        first.release();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock(), [100, 300, 2_000, 4_000]);
        assert_eq!(gate.waiting(7), 0);
        // The place is free again: the next turn goes at once.
        let p = tokio::time::timeout(Duration::from_secs(5), gate.enter(7, 9_000)).await;
        assert!(p.is_ok());
    }

    #[tokio::test]
    async fn a_long_wait_outweighs_a_long_prefill_and_an_open_gate_never_waits() {
        let gate = PrefillGate::new(1);
        let mut first = gate.enter(1, 10).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let long = {
            let (gate, order) = (gate.clone(), Arc::clone(&order));
            tokio::spawn(async move {
                let _p = gate.enter(1, 8_000).await;
                order.lock().push(8_000u64);
            })
        };
        settle().await;
        // Eight half-lives later, 8,000 tokens weigh about 31: less than a new turn of 100.
        {
            let mut guard = gate.lanes.lock();
            let w = &mut guard.0.get_mut(&1).unwrap().waiting[0];
            w.since -= HALF_LIFE * 8;
        }
        let short = {
            let (gate, order) = (gate.clone(), Arc::clone(&order));
            tokio::spawn(async move {
                let _p = gate.enter(1, 100).await;
                order.lock().push(100);
            })
        };
        settle().await;
        first.release();
        long.await.unwrap();
        short.await.unwrap();
        assert_eq!(*order.lock(), [8_000, 100]);

        let open = PrefillGate::new(0);
        let _a = open.enter(1, 1).await;
        let b = tokio::time::timeout(Duration::from_secs(5), open.enter(1, 1)).await;
        assert!(b.is_ok(), "limit 0: no gate");
    }
}
