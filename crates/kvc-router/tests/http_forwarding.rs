//! The HTTP front end to end: a router over one prefill and two decode snapshot workers (manual
//! clock), with in-process mock HTTP workers that record what they receive: turns forwarded P→D
//! and direct-to-D on every API, malformed bodies, health, and failing workers' errors.

mod common;

use common::front::ids;
use common::sglang_mock::{
    Behaviour, dead_addr, generate_body, start, start_full, without_resilience,
};
use kvc_core::{Health, WorkerId};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::Duration;

#[tokio::test]
async fn first_turn_goes_to_p_and_d_then_direct_to_d() {
    let s = start().await;
    let session = [("x-session-id", "agent-7")];

    let r = s
        .send("/generate", &session, &generate_body(0..1_300))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    let d: u32 = r.headers["x-kvc-decode-worker"].parse().unwrap();
    assert!(d == 1 || d == 2);
    let other = 3 - d;
    assert_eq!(r.body["text"], format!("answer from d{d}"));

    let p_got = s.received_at_least(0, 1).await;
    let d_got = s.received(d);
    assert_eq!(p_got.len(), 1);
    assert_eq!(d_got.len(), 1);
    assert!(s.received(other).is_empty());
    let (p_path, p_body) = &p_got[0];
    let (d_path, d_body) = &d_got[0];
    assert_eq!(p_path, "/generate");
    assert_eq!(d_path, "/generate");
    // The same body to both, with the bootstrap fields of P injected.
    assert_eq!(p_body, d_body);
    assert_eq!(p_body["bootstrap_host"], s.addrs[&0].ip().to_string());
    assert_eq!(p_body["bootstrap_port"], 9_098);
    let room = p_body["bootstrap_room"].as_u64().expect("room is a u64");
    assert!(room < 1 << 63);
    assert_eq!(p_body["input_ids"], ids(0..1_300));
    assert_eq!(p_body["sampling_params"]["max_new_tokens"], 40);
    assert_eq!(p_body["stream"], false);
    // The outcome was reported.
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(s.outcomes("ok"), 1.0);

    // Turn 2 extends the prompt: the session is resident on D, so D alone gets it, unchanged.
    let r = s
        .send("/generate", &session, &generate_body(0..1_900))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "direct-to-d");
    assert_eq!(r.headers["x-kvc-decode-worker"], d.to_string());
    assert!(!r.headers.contains_key("x-kvc-prefill-worker"));
    assert_eq!(r.body["text"], format!("answer from d{d}"));
    assert_eq!(s.received(0).len(), 1, "P must not see a direct-to-D turn");
    assert!(s.received(other).is_empty());
    let d_got = s.received(d);
    assert_eq!(d_got.len(), 2);
    let body = d_got[1].1.as_object().unwrap();
    assert!(!body.contains_key("bootstrap_room"));
    assert!(!body.contains_key("bootstrap_host"));
    assert_eq!(body["input_ids"], ids(0..1_900));
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(s.outcomes("ok"), 2.0);

    // Another session starts on the P path again, with a different room.
    let r = s
        .send(
            "/generate",
            &[("x-session-id", "agent-8")],
            &generate_body(5_000..5_600),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    let p_got = s.received_at_least(0, 2).await;
    assert_eq!(p_got.len(), 2);
    assert_ne!(p_got[1].1["bootstrap_room"], room);
}

#[tokio::test]
async fn text_prompts_and_session_params_follow_the_session() {
    let s = start().await;
    let words: Vec<String> = (0..1_900).map(|i| format!("w{i}")).collect();
    let body = |n: usize| {
        json!({"text": words[..n].join(" "), "session_params": {"id": "chat-1"},
               "sampling_params": {"max_new_tokens": 40}})
        .to_string()
    };
    let r = s.send("/generate", &[], &body(1_300)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    let d = r.headers["x-kvc-decode-worker"].clone();
    assert_eq!(
        s.received_at_least(0, 1).await[0].1["text"],
        words[..1_300].join(" ")
    );

    let r = s.send("/generate", &[], &body(1_900)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "direct-to-d");
    assert_eq!(r.headers["x-kvc-decode-worker"], d);
    assert_eq!(s.counts()[0], 1);
}

#[tokio::test]
async fn openai_completions_are_forwarded_on_the_same_path() {
    let s = start().await;
    let body =
        json!({"model": "test-model", "prompt": "say hello to the cluster", "max_tokens": 12})
            .to_string();
    let r = s.send("/v1/completions", &[], &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let d: u32 = r.headers["x-kvc-decode-worker"].parse().unwrap();
    assert_eq!(r.body["choices"][0]["text"], format!("answer from d{d}"));
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    let (path, got) = &s.received(d)[0];
    assert_eq!(path, "/v1/completions");
    assert_eq!(got["prompt"], "say hello to the cluster");
    assert_eq!(got["max_tokens"], 12);
    assert_eq!(
        got["bootstrap_room"],
        s.received_at_least(0, 1).await[0].1["bootstrap_room"]
    );
    assert_eq!(s.cluster.service().pending_decisions(), 0);
}

/// The shape a real agent sent without a session key: `[system, user]`, its answer cut off, then
/// the same with a second user message (no answer in between, at once), then one more. The
/// first prompt is short (two full blocks of 512, the second inside the system prompt): it
/// used to be routed without a session, so the second request, which extends it, started one
/// and was prefilled again. Each request continues the first one's session.
#[tokio::test]
async fn a_keyless_retry_after_a_cut_off_answer_continues_its_session() {
    let s = start().await;
    let words = |r: std::ops::Range<u32>| r.map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let mut messages = vec![
        json!({"role": "system", "content": words(0..1_100)}),
        json!({"role": "user", "content": "list the files"}),
    ];
    let mut seen = Vec::new();
    for more in ["and read the first one", "then edit it"] {
        let body =
            json!({"model": "test-model", "messages": messages, "max_tokens": 4}).to_string();
        let r = s.send("/v1/chat/completions", &[], &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        seen.push((
            r.headers["x-kvc-session"].clone(),
            r.headers["x-kvc-mode"].clone(),
        ));
        messages.push(json!({"role": "user", "content": more}));
    }
    let body = json!({"model": "test-model", "messages": messages, "max_tokens": 4}).to_string();
    let r = s.send("/v1/chat/completions", &[], &body).await;
    seen.push((
        r.headers["x-kvc-session"].clone(),
        r.headers["x-kvc-mode"].clone(),
    ));
    let first = &seen[0].0;
    assert!(first.starts_with("kvc-inferred-"), "{seen:?}");
    assert!(seen.iter().all(|(session, _)| session == first), "{seen:?}");
    let modes: Vec<&str> = seen.iter().map(|(_, m)| m.as_str()).collect();
    assert_eq!(modes, ["turn1-seed", "direct-to-d", "direct-to-d"]);
    // A conversation with the same system prompt and another first message is another.
    let other = json!({"model": "test-model", "max_tokens": 4, "messages": [
        {"role": "system", "content": words(0..1_100)},
        {"role": "user", "content": "list the tests"},
    ]})
    .to_string();
    let r = s.send("/v1/chat/completions", &[], &other).await;
    assert_ne!(&r.headers["x-kvc-session"], first);
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
}

#[tokio::test]
async fn chat_completions_are_forwarded_unchanged_and_follow_the_session() {
    let s = start().await;
    let words = |r: std::ops::Range<u32>| r.map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": words(0..1_300)}),
    ];
    let session = [("x-session-id", "chat-9")];
    let body = json!({"model": "test-model", "messages": messages, "max_tokens": 12}).to_string();
    let r = s.send("/v1/chat/completions", &session, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    let d: u32 = r.headers["x-kvc-decode-worker"].parse().unwrap();
    assert_eq!(
        r.body["choices"][0]["message"]["content"],
        format!("answer from d{d}")
    );
    let (p_path, p_body) = &s.received_at_least(0, 1).await[0];
    let (d_path, d_body) = &s.received(d)[0];
    assert_eq!(p_path, "/v1/chat/completions");
    assert_eq!(d_path, "/v1/chat/completions");
    assert_eq!(p_body, d_body);
    // The messages go through as the client sent them (no template applied).
    assert_eq!(d_body["messages"], Value::from(messages.clone()));
    assert_eq!(d_body["max_tokens"], 12);
    assert_eq!(d_body["bootstrap_port"], 9_098);
    assert_eq!(s.outcomes("ok"), 1.0);

    // The next turn repeats the conversation and adds to it: direct to the same D, unchanged.
    messages.push(json!({"role": "assistant", "content": format!("answer from d{d}")}));
    messages.push(json!({"role": "user", "content": words(1_300..1_900)}));
    let body = json!({"model": "test-model", "messages": messages, "max_tokens": 12}).to_string();
    let r = s.send("/v1/chat/completions", &session, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-kvc-mode"], "direct-to-d");
    assert_eq!(r.headers["x-kvc-decode-worker"], d.to_string());
    assert_eq!(s.counts()[0], 1, "P must not see a direct-to-D turn");
    let (_, d_body) = &s.received(d)[1];
    assert!(!d_body.as_object().unwrap().contains_key("bootstrap_room"));
    assert_eq!(d_body["messages"], Value::from(messages));
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(s.outcomes("ok"), 2.0);

    // Malformed chat bodies: 400 with the JSON error shape, nothing forwarded.
    for (bad, want) in [
        (r#"{"messages": []}"#, "empty"),
        (
            r#"{"messages": [{"role": "user", "content": 3}]}"#,
            "content",
        ),
        (r#"{"prompt": "a"}"#, "missing `messages`"),
    ] {
        let r = s.send("/v1/chat/completions", &[], bad).await;
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(r.body["error"]["type"], "invalid_request_error");
        let message = r.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(want), "{bad}: {message}");
    }
    assert_eq!(s.counts()[0], 1);
}

#[tokio::test]
async fn malformed_bodies_get_400_with_a_json_error() {
    let s = start().await;
    let cases: [(&str, &str, &str); 7] = [
        ("/generate", "{not json", "invalid JSON"),
        ("/generate", "[1, 2]", "JSON object"),
        ("/generate", r#"{"sampling_params": {}}"#, "missing"),
        ("/generate", r#"{"text": "a", "stream": 1}"#, "stream"),
        ("/generate", r#"{"text": "   "}"#, "empty"),
        ("/v1/completions", r#"{"prompt": ["a", "b"]}"#, "batched"),
        (
            "/v1/completions",
            r#"{"prompt": "a", "max_tokens": "many"}"#,
            "max_tokens",
        ),
    ];
    for (path, body, want) in cases {
        let r = s.send(path, &[], body).await;
        assert_eq!(r.status, 400, "{path} {body}");
        let message = r.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(want), "{body}: {message}");
        assert_eq!(r.body["error"]["type"], "invalid_request_error");
    }
    // An empty session header is malformed too.
    let r = s
        .send("/generate", &[("x-session-id", " ")], r#"{"text":"a"}"#)
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("x-session-id")
    );
    // A body over the limit: 413, same error shape.
    let big = generate_body(0..20_000);
    assert!(big.len() > 64 * 1024);
    let r = s.send("/generate", &[], &big).await;
    assert_eq!(r.status, 413);
    assert!(r.body["error"]["message"].is_string());
    assert_eq!(r.body["error"]["type"], "invalid_request_error");
    assert_eq!(s.counts(), [0, 0, 0], "nothing malformed reaches a worker");
    assert_eq!(s.cluster.service().pending_decisions(), 0);
}

#[tokio::test]
async fn health_and_models_answer() {
    let s = start().await;
    let r = s.request("GET", "/health").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["status"], "ok");
    assert_eq!(r.body["healthy_workers"], 3);
    // The engines' own model, not the configured fallback name.
    let r = s.request("GET", "/v1/models").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["object"], "list");
    assert_eq!(r.body["data"][0]["id"], "engine-model");
    assert_eq!(r.body["data"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn models_come_from_a_worker_that_answers_and_their_absence_is_a_503_naming_each() {
    let s = start_full(|_| {}, without_resilience).await;
    let down = |id: u32| {
        s.mocks[&id]
            .up
            .store(false, std::sync::atomic::Ordering::SeqCst)
    };
    down(0);
    let r = s.request("GET", "/v1/models").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["data"][0]["id"], "engine-model");
    assert_ne!(r.body["data"][0]["owned_by"], "kvc");
    down(1);
    down(2);
    let r = s.request("GET", "/v1/models").await;
    assert_eq!(r.status, 503, "{}", r.body);
    let message = r.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("no worker answered GET /v1/models"),
        "{message}"
    );
    for id in 0..3 {
        assert!(
            message.contains(&format!("worker {id}: HTTP 503")),
            "{message}"
        );
    }
}

#[tokio::test]
async fn health_is_503_when_no_worker_is_routable() {
    let s = start().await;
    // Let every snapshot go stale.
    s.cluster.clock.advance(common::STALE_MS + 500);
    s.cluster.wait_health(&[0, 1, 2], Health::Stale).await;
    let r = s.request("GET", "/health").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.body["error"]["message"], "no routable worker");
    // Not ready, yet a request that comes all the same is routed on the workers' last known
    // state rather than refused (their publishers are late; a worker that is gone would fail
    // the request and be taken out by its breaker).
    let r = s.send("/generate", &[], &generate_body(0..100)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(s.cluster.service().metrics().stale_routed(), 1);
}

#[tokio::test]
async fn failed_prefill_is_reported_and_the_next_turn_is_not_direct() {
    let s = start().await;
    *s.mocks[&0].behaviour.lock() = Behaviour::Fail;
    // The decode workers never answer (they wait for KV that does not come).
    for m in s.decode_mocks() {
        *m.behaviour.lock() = Behaviour::Stall;
    }
    let session = [("x-session-id", "agent-9")];
    let r = s
        .send("/generate", &session, &generate_body(0..1_300))
        .await;
    // P failed first: its answer, not a timeout of D's, and counted as worker-failed, so
    // nothing is resident.
    assert_eq!(r.status, 500, "{}", r.body);
    assert_eq!(r.body["error"]["message"], "p0 failed");
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(s.outcomes("worker-failed"), 1.0);
    assert_eq!(s.outcomes("ok"), 0.0);
    *s.mocks[&0].behaviour.lock() = Behaviour::Answer;
    for m in s.decode_mocks() {
        *m.behaviour.lock() = Behaviour::Answer;
    }
    let r = s
        .send("/generate", &session, &generate_body(0..1_900))
        .await;
    assert_eq!(r.status, 200);
    assert_ne!(r.headers["x-kvc-mode"], "direct-to-d");
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    assert_eq!(s.counts()[0], 2);
}

#[tokio::test]
async fn failing_stalled_and_dead_decode_workers_give_json_errors() {
    // Worker 2 points at a port nobody listens on; `deadline` is the request deadline.
    let with_dead_d2 = |deadline: Option<Duration>| {
        start_full(
            |w| {
                w.insert(WorkerId(2), &format!("http://{}", dead_addr()), None)
                    .unwrap();
            },
            move |o| {
                without_resilience(o);
                if let Some(d) = deadline {
                    o.request_timeout = d;
                }
            },
        )
    };
    let s = with_dead_d2(None).await;
    *s.mocks[&1].behaviour.lock() = Behaviour::Fail;
    let mut seen: HashMap<&str, u32> = HashMap::new();
    let mut requests = 0.0;
    // Distinct sessions and prompts until both decode workers were chosen (bounded).
    for i in 0..32u32 {
        if seen.contains_key("failing") && seen.contains_key("dead") {
            break;
        }
        let r = s.send_session("s", i).await;
        requests += 1.0;
        match r.headers["x-kvc-decode-worker"].as_str() {
            "1" => {
                // The worker's own error is passed through.
                assert_eq!(r.status, 500);
                assert_eq!(r.body["error"]["message"], "d1 failed");
                *seen.entry("failing").or_default() += 1;
            }
            "2" => {
                assert_eq!(r.status, 502);
                assert_eq!(r.body["error"]["type"], "worker_error");
                *seen.entry("dead").or_default() += 1;
            }
            other => panic!("unexpected decode worker {other}"),
        }
    }
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(s.outcomes("worker-failed"), requests);

    // A stalled worker meets the request deadline: a front whose deadline is short enough to
    // fire within the test (the one above only guards against a hang).
    let s = with_dead_d2(Some(Duration::from_millis(500))).await;
    *s.mocks[&1].behaviour.lock() = Behaviour::Stall;
    for i in 0..32u32 {
        let key = format!("t{i}");
        let r = s
            .send(
                "/generate",
                &[("x-session-id", key.as_str())],
                &generate_body(50_000 + i * 1_000..50_000 + i * 1_000 + 600),
            )
            .await;
        if r.headers["x-kvc-decode-worker"] == "1" {
            assert_eq!(r.status, 504, "{}", r.body);
            let message = r.body["error"]["message"].as_str().unwrap();
            assert!(message.contains("no answer within"), "{message}");
            *seen.entry("stalled").or_default() += 1;
            break;
        }
    }
    assert_eq!(s.cluster.service().pending_decisions(), 0);
    assert_eq!(seen.len(), 3, "every failure kind exercised: {seen:?}");
}

#[tokio::test]
async fn the_session_header_name_is_configurable() {
    let s = start_full(
        |_| {},
        |o| {
            o.session_header = "x-conversation".to_owned();
            o.session_headers = vec!["x-conversation".to_owned()];
        },
    )
    .await;
    let r = s
        .send(
            "/generate",
            &[("x-conversation", "c1")],
            &generate_body(0..1_300),
        )
        .await;
    assert_eq!(r.headers["x-kvc-mode"], "turn1-seed");
    let r = s
        .send(
            "/generate",
            &[("x-conversation", "c1")],
            &generate_body(0..1_900),
        )
        .await;
    assert_eq!(r.headers["x-kvc-mode"], "direct-to-d");
    // The default header now names no session: a request that does not extend c1's prompt
    // starts a session of its own (inferred), through P.
    let r = s
        .send(
            "/generate",
            &[("x-session-id", "c1")],
            &generate_body(5_000..7_000),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["x-kvc-prefill-worker"], "0");
    assert_ne!(r.headers["x-kvc-session"], "c1");
    // One that does extend it continues it, by its prompt.
    let r = s
        .send(
            "/generate",
            &[("x-session-id", "c1")],
            &generate_body(0..2_000),
        )
        .await;
    assert_eq!(
        (
            r.headers["x-kvc-session"].as_str(),
            r.headers["x-kvc-mode"].as_str()
        ),
        ("c1", "direct-to-d")
    );
    assert_eq!(s.counts()[0], 2);
}
