//! The HTTP front's streams and resilience end to end, over the same mock workers as
//! `http_forwarding.rs`: streamed answers relayed as they arrive or broken off, retries before
//! the first byte, circuit breakers opened by failures and health checks, and recovery.

mod common;

use common::front::ids;
use common::sglang_mock::{
    Behaviour, dead_addr, generate_body, start, start_full, start_with_dead_d2, stream_events,
    without_resilience,
};
use kvc_core::{Health, WorkerId};
use serde_json::{Value, json};
use std::time::Duration;

#[tokio::test]
async fn streamed_answers_are_relayed_as_they_arrive() {
    let s = start().await;
    let body = |n: u32| {
        json!({"input_ids": ids(0..n), "sampling_params": {"max_new_tokens": 40},
               "session_params": {"id": "stream-1"}, "stream": true})
    };
    // P streams too (its answer is drained, not relayed): let it through at once.
    s.mocks[&0].gate.notify_one();
    let mut ws = s.open_stream("/generate", &body(1_300)).await;
    assert_eq!(ws.status, 200);
    assert_eq!(ws.headers["content-type"], "text/event-stream");
    let d = s.chosen_decode([1, 0, 0]);
    // The first event reaches the client while the worker still holds the rest back: the
    // answer is not buffered.
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("tok0") {
        got.extend(ws.next_piece().await.expect("the first event"));
    }
    assert!(!String::from_utf8_lossy(&got).contains("tok1"));
    s.mocks[&d].gate.notify_one();
    let rest = ws.read_all().await;
    let all = format!("{}{rest}", String::from_utf8(got).unwrap());
    assert_eq!(all, stream_events(&format!("d{d}"), "/generate").concat());
    // The outcome is reported once P has answered too.
    s.settle().await;
    // P and D got the same body, with the bootstrap fields and `stream: true`.
    let (_, p_body) = &s.received(0)[0];
    let (_, d_body) = &s.received(d)[0];
    assert_eq!(p_body, d_body);
    assert_eq!(d_body["stream"], true);
    assert!(d_body["bootstrap_room"].is_u64());
    assert_eq!(s.outcomes("ok"), 1.0);

    // The outcome made the session resident on D: the next turn streams direct-to-D.
    let before = s.counts();
    let mut ws = s.open_stream("/generate", &body(1_900)).await;
    assert_eq!(s.chosen_decode(before), d);
    s.mocks[&d].gate.notify_one();
    let all = ws.read_all().await;
    assert_eq!(all, stream_events(&format!("d{d}"), "/generate").concat());
    assert_eq!(s.counts()[0], 1, "P must not see a direct-to-D turn");
    s.settle().await;
    assert_eq!(s.outcomes("ok"), 2.0);

    // OpenAI completions stream the same way, to the same path.
    s.mocks[&0].gate.notify_one();
    let before = s.counts();
    let mut ws = s
        .open_stream(
            "/v1/completions",
            &json!({"prompt": "stream this please", "max_tokens": 3, "stream": true}),
        )
        .await;
    let d = s.chosen_decode(before);
    s.mocks[&d].gate.notify_one();
    let all = ws.read_all().await;
    assert_eq!(
        all,
        stream_events(&format!("d{d}"), "/v1/completions").concat()
    );
    assert_eq!(s.received(d).last().unwrap().0, "/v1/completions");
    s.settle().await;
    assert_eq!(s.outcomes("ok"), 3.0);
    assert_eq!(s.outcomes("worker-failed"), 0.0);
}

#[tokio::test]
async fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let s = start().await;
    for m in s.decode_mocks() {
        *m.behaviour.lock() = Behaviour::DieMidStream;
    }
    let chat = json!({"messages": [{"role": "user", "content": "tell me a long story"}],
                      "max_tokens": 50, "stream": true});
    let mut ws = s.open_stream("/v1/chat/completions", &chat).await;
    assert_eq!(ws.status, 200);
    let d = s.chosen_decode([1, 0, 0]);
    let all = ws.read_all().await;
    let events = stream_events(&format!("d{d}"), "/v1/chat/completions");
    // What the worker sent before it died comes first, unchanged.
    assert!(all.starts_with(&events[..2].concat()), "{all}");
    // The stream ends with one well-formed SSE error event.
    assert!(all.ends_with("\n\n"), "{all:?}");
    let last = all
        .trim_end()
        .rsplit("\n\n")
        .next()
        .unwrap()
        .strip_prefix("data: ")
        .unwrap_or_else(|| panic!("no error event at the end: {all:?}"));
    let error: Value = serde_json::from_str(last).unwrap();
    assert_eq!(error["error"]["type"], "worker_error");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("decode worker")
    );
    assert!(!all.contains("[DONE]"));
    // Counted, as a worker failure.
    s.settle().await;
    assert_eq!(s.outcomes("worker-failed"), 1.0);
    assert_eq!(s.outcomes("ok"), 0.0);
}

#[tokio::test]
async fn a_stream_to_a_dead_decode_worker_gets_a_json_error() {
    let s = start_full(
        |w| {
            for id in [1, 2] {
                w.insert(WorkerId(id), &format!("http://{}", dead_addr()), None)
                    .unwrap();
            }
        },
        without_resilience,
    )
    .await;
    let body = json!({"text": "a b c", "stream": true}).to_string();
    let r = s.send("/generate", &[], &body).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert_eq!(r.body["error"]["type"], "worker_error");
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(s.outcomes("worker-failed"), 1.0);
}

#[tokio::test]
async fn a_refused_decode_worker_is_retried_on_the_other_and_its_breaker_opens() {
    let s = start_with_dead_d2(1).await;
    let service = s.cluster.service().clone();
    let mut requests = 0.0;
    // Distinct sessions until one was first routed to the dead worker (bounded).
    for i in 0..32u32 {
        let r = s.send_session("r", i).await;
        requests += 1.0;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.headers["x-kvc-decode-worker"], "1");
        assert_eq!(r.body["text"], "answer from d1");
        if service.metrics().http_retries() > 0 {
            break;
        }
    }
    assert_eq!(
        service.metrics().http_retries(),
        1,
        "the dead worker was tried once"
    );
    assert_eq!(s.metric("kvc_router_http_retries_total", &[]), 1.0);
    // One failure opened its breaker: out of rotation, nothing more is sent its way.
    assert!(service.is_http_down(WorkerId(2)));
    assert_eq!(
        service.metrics().breaker_state(WorkerId(2)),
        Some(kvc_router::http::BreakerState::Open)
    );
    assert_eq!(
        s.metric(
            "kvc_router_http_breaker_state",
            &[("worker", "2"), ("state", "open")]
        ),
        1.0
    );
    assert_eq!(
        s.metric(
            "kvc_router_http_breaker_transitions_total",
            &[("to", "open")]
        ),
        1.0
    );
    let views = service.worker_views();
    assert_eq!(views[2].state.health, Health::Down);
    assert_eq!(views[1].state.health, Health::Healthy);
    for i in 100..104u32 {
        let r = s.send_session("r", i).await;
        requests += 1.0;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.headers["x-kvc-decode-worker"], "1");
    }
    assert_eq!(service.metrics().http_retries(), 1);
    // The failed decision and every answered one are reported.
    assert_eq!(service.pending_decisions(), 0);
    assert_eq!(s.outcomes("worker-failed"), 1.0);
    assert_eq!(s.outcomes("ok"), requests);
}

#[tokio::test]
async fn retries_stop_at_the_limit_and_the_last_failure_is_answered() {
    let s = start_full(
        |w| {
            for id in [1, 2] {
                w.insert(WorkerId(id), &format!("http://{}", dead_addr()), None)
                    .unwrap();
            }
        },
        |o| {
            o.max_retries = 1;
            o.retry_backoff = Duration::from_millis(2);
            o.breaker.failure_threshold = 0;
            o.health_check_interval = None;
        },
    )
    .await;
    let r = s.send("/generate", &[], &generate_body(0..600)).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert_eq!(r.body["error"]["type"], "worker_error");
    // The first attempt and one retry, each reported.
    assert_eq!(s.cluster.service().metrics().http_retries(), 1);
    assert_eq!(s.outcomes("worker-failed"), 2.0);
    assert_eq!(s.cluster.service().pending_decisions(), 0);
}

#[tokio::test]
async fn a_stream_is_retried_on_another_decode_worker_before_any_byte() {
    // No breaker: the dead worker stays in rotation, every pick of it is retried.
    let s = start_with_dead_d2(0).await;
    for m in s.mocks.values() {
        *m.behaviour.lock() = Behaviour::Flow;
    }
    let metrics = || s.cluster.service().metrics().http_retries();
    let mut requests = 0.0;
    for i in 0..32u32 {
        let body = json!({"input_ids": ids(i * 1_000..i * 1_000 + 600),
                          "session_params": {"id": format!("st{i}")}, "stream": true});
        let mut ws = s.open_stream("/generate", &body).await;
        requests += 1.0;
        assert_eq!(ws.status, 200);
        let text = ws.read_all().await;
        assert!(
            text.contains("d1 tok2") && text.ends_with("data: [DONE]\n\n"),
            "{text}"
        );
        s.settle().await;
        if metrics() > 0 {
            break;
        }
    }
    let retries = metrics() as f64;
    assert!(retries >= 1.0, "the dead worker was never picked");
    assert_eq!(s.outcomes("worker-failed"), retries);
    assert_eq!(s.outcomes("ok"), requests);
}

#[tokio::test]
async fn health_checks_open_the_breaker_and_recovery_closes_it() {
    use kvc_router::http::BreakerState;
    let s = start_full(
        |_| {},
        |o| {
            o.max_retries = 0;
            o.breaker.failure_threshold = 2;
            o.breaker.cooldown = Duration::from_millis(10);
            o.health_check_interval = Some(Duration::from_millis(20));
            // Long enough that a healthy worker's check never times out on a loaded
            // machine; the down worker answers 503 at once.
            o.health_check_timeout = Duration::from_secs(5);
        },
    )
    .await;
    let service = s.cluster.service().clone();
    let w2 = WorkerId(2);
    s.mocks[&2]
        .up
        .store(false, std::sync::atomic::Ordering::SeqCst);
    common::wait_until("failing health checks opening the breaker", || {
        service.metrics().breaker_state(w2) == Some(BreakerState::Open)
    })
    .await;
    assert!(service.is_http_down(w2));
    assert!(service.metrics().health_checks(false) >= 2);
    assert!(s.metric("kvc_router_http_health_checks_total", &[("result", "ok")]) >= 2.0);
    // Out of rotation: requests go to the other decode worker.
    for i in 0..4u32 {
        let r = s.send_session("h", i).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.headers["x-kvc-decode-worker"], "1");
    }
    // The router's clock is manual: the cool-down ends when it is advanced.
    s.mocks[&2]
        .up
        .store(true, std::sync::atomic::Ordering::SeqCst);
    s.cluster.clock.advance(20);
    common::wait_until("a healthy worker's breaker closing", || {
        service.metrics().breaker_state(w2) == Some(BreakerState::Closed)
    })
    .await;
    assert!(!service.is_http_down(w2));
    assert_eq!(service.worker_views()[2].state.health, Health::Healthy);
    let m = service.metrics();
    assert!(m.breaker_transitions(BreakerState::Open) >= 1);
    assert!(m.breaker_transitions(BreakerState::HalfOpen) >= 1);
    assert!(m.breaker_transitions(BreakerState::Closed) >= 1);
}
