//! The HTTP front's vLLM dialect (NixlConnector P/D) against in-process mock vLLM workers
//! (snapshot workers on a manual clock give the router its state): the exact fields P and D
//! get, a prefill failure served by D alone, and a direct-to-D turn D served without its
//! cache recorded as `direct-cache-miss`.

mod common;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use common::answer::Answer;
use common::front::{self, Recording, error_response, json_response, sse_response, worker_routes};
use kvc_admission::ManualClock;
use kvc_core::{EngineKind, WorkerId};
use kvc_router::RouterConfig;
use kvc_router::http::PREFILL_FAILED_HEADER;
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// One request a mock worker received: its path, its `x-request-id` and `x-session-id`
/// headers, its body.
type Received = (String, HashMap<String, String>, Value);

struct Mock {
    name: String,
    /// A prefill worker answers this status to a `do_remote_decode` request.
    fail_prefill: Mutex<Option<u16>>,
    /// A request that is not a prefill is answered this status (JSON), when set.
    fail_decode: Mutex<Option<u16>>,
    /// The error message of a failing answer (default: the worker's name and the status).
    message: Mutex<Option<String>>,
    /// Whether answers carry `usage.prompt_tokens_details` (vLLM only sends it when started
    /// with `--enable-prompt-tokens-details`; null otherwise).
    details: Mutex<bool>,
    /// The cached prompt tokens a plain (no `kv_transfer_params`) request reports.
    cached: Mutex<u64>,
    received: Mutex<Vec<Received>>,
    /// The bytes of every request body received, in order.
    raw: Mutex<Vec<Bytes>>,
    /// A streamed answer's connection is held open this long after its last event.
    hold_open: Mutex<Option<Duration>>,
    /// A streamed answer comes this many ms later on the router's clock (which the worker
    /// moves on before answering).
    first_token_after: Mutex<Option<(Arc<ManualClock>, u64)>>,
    /// The next request waits for a permit of this before it is answered (once).
    hold_next: Mutex<Option<Arc<tokio::sync::Semaphore>>>,
}

impl Recording for Mock {
    type Request = Received;

    fn requests(&self) -> &Mutex<Vec<Received>> {
        &self.received
    }
}

/// What a mock prefill worker puts in its answer's `kv_transfer_params`: more than the router
/// knows of, so that a verbatim copy shows.
fn p_params(request_id: &str) -> Value {
    json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p0-engine",
        "remote_block_ids": [3, 1, 4], "remote_request_id": request_id,
        "remote_host": "10.1.2.3", "remote_port": 5600, "tp_size": 1,
        "remote_blocks_expiry_time": 1.5})
}

async fn handler(
    State(m): State<Arc<Mock>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let held = m.hold_next.lock().take();
    let response = answer(&m, &uri, &headers, &body);
    if let Some(sem) = held {
        let _ = sem.acquire().await;
    }
    if response.headers()["content-type"] == "text/event-stream"
        && let Some((clock, ms)) = &*m.first_token_after.lock()
    {
        clock.advance(*ms);
    }
    let Some(hold) = *m.hold_open.lock() else {
        return response;
    };
    if response.headers()["content-type"] != "text/event-stream" {
        return response;
    }
    // Every event at once, then the stream stays open for `hold` before it ends.
    let (parts, body) = response.into_parts();
    let events = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(1);
    tokio::spawn(async move {
        let _ = tx.send(Ok(events)).await;
        tokio::time::sleep(hold).await;
    });
    let body = axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Response::from_parts(parts, body)
}

fn answer(m: &Mock, uri: &axum::http::Uri, headers: &HeaderMap, body: &Bytes) -> Response {
    let value: Value = serde_json::from_slice(body).expect("forwarded JSON");
    m.raw.lock().push(body.clone());
    let kept: HashMap<String, String> = ["x-session-id", "x-request-id"]
        .iter()
        .filter_map(|h| {
            headers
                .get(*h)
                .map(|v| (h.to_string(), v.to_str().unwrap().to_owned()))
        })
        .collect();
    m.received
        .lock()
        .push((uri.path().to_owned(), kept.clone(), value.clone()));
    let params = &value["kv_transfer_params"];
    if params["do_remote_decode"] == true {
        if let Some(status) = *m.fail_prefill.lock() {
            return error_response(
                StatusCode::from_u16(status).unwrap(),
                m.message
                    .lock()
                    .clone()
                    .unwrap_or_else(|| format!("{} failed", m.name)),
            );
        }
        let id = kept.get("x-request-id").cloned().unwrap_or_default();
        return json_response(
            StatusCode::OK,
            &json!({"choices": [{"text": "x"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1},
            "kv_transfer_params": p_params(&id)}),
        );
    }
    if let Some(status) = *m.fail_decode.lock() {
        return error_response(
            StatusCode::from_u16(status).unwrap(),
            m.message
                .lock()
                .clone()
                .unwrap_or_else(|| format!("{} says {status}", m.name)),
        );
    }
    let cached = if params.is_object() {
        0
    } else {
        *m.cached.lock()
    };
    let details = if *m.details.lock() {
        json!({"cached_tokens": cached})
    } else {
        Value::Null
    };
    match uri.path() {
        "/v1/messages" => return messages_answer(&value, cached, *m.details.lock()),
        "/v1/responses" => return responses_answer(&value, cached),
        _ => {}
    }
    let usage = json!({"prompt_tokens": 2_000, "completion_tokens": 2, "total_tokens": 2_002,
        "prompt_tokens_details": details});
    if value["stream"] == true {
        let mut events = vec![
            json!({"choices": [{"index": 0, "text": "a", "finish_reason": null}]}),
            json!({"choices": [{"index": 0, "text": " b", "finish_reason": "length"}]}),
        ];
        if value["stream_options"]["include_usage"] == true {
            events.push(json!({"choices": [], "usage": usage}));
        }
        let mut text: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
        text.push_str("data: [DONE]\n\n");
        return sse_response(text);
    }
    json_response(
        StatusCode::OK,
        &json!({"choices": [{"index": 0, "text": "a b", "finish_reason": "length"}],
        "usage": usage, "kv_transfer_params": null}),
    )
}

/// SSE events with `event:` lines, as vLLM's Messages and Responses streams write them.
fn named_events(events: &[(&str, Value)]) -> String {
    events
        .iter()
        .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
        .collect()
}

/// A Messages answer as vLLM writes it: `input_tokens` without the cached ones, which are
/// `cache_read_input_tokens` (absent without prompt-token details); a stream's last usage in
/// its `message_delta`.
fn messages_answer(request: &Value, cached: u64, details: bool) -> Response {
    let mut usage = json!({"input_tokens": 2_000u64.saturating_sub(cached), "output_tokens": 2});
    if details {
        usage["cache_read_input_tokens"] = json!(cached);
    }
    if request["stream"] == true {
        return sse_response(named_events(&[
            (
                "message_start",
                json!({"type": "message_start", "message": {"id": "msg_1",
                "type": "message", "role": "assistant", "content": [],
                "usage": {"input_tokens": 2_000, "output_tokens": 0}}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": "a b"}}),
            ),
            (
                "message_delta",
                json!({"type": "message_delta",
                "delta": {"stop_reason": "max_tokens"}, "usage": usage}),
            ),
            ("message_stop", json!({"type": "message_stop"})),
        ]));
    }
    json_response(
        StatusCode::OK,
        &json!({"id": "msg_1", "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": "a b"}], "stop_reason": "max_tokens",
            "usage": usage, "kv_transfer_params": null}),
    )
}

/// A Responses answer as vLLM writes it; a stream's usage in its `response.completed`.
fn responses_answer(request: &Value, cached: u64) -> Response {
    let response = json!({"id": "resp_1", "object": "response", "status": "completed",
        "output": [{"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "a b"}]}],
        "usage": {"input_tokens": 2_000, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": 2, "total_tokens": 2_002}});
    if request["stream"] == true {
        return sse_response(named_events(&[
            (
                "response.created",
                json!({"type": "response.created",
                "response": {"id": "resp_1", "status": "in_progress"}}),
            ),
            (
                "response.output_text.delta",
                json!({"type": "response.output_text.delta",
                "delta": "a b"}),
            ),
            (
                "response.completed",
                json!({"type": "response.completed", "response": response}),
            ),
        ]));
    }
    json_response(StatusCode::OK, &response)
}

async fn spawn_mock(name: &str) -> (Arc<Mock>, SocketAddr) {
    let mock = Arc::new(Mock {
        name: name.to_owned(),
        fail_prefill: Mutex::new(None),
        fail_decode: Mutex::new(None),
        message: Mutex::new(None),
        details: Mutex::new(true),
        cached: Mutex::new(100_000),
        received: Mutex::new(Vec::new()),
        raw: Mutex::new(Vec::new()),
        hold_open: Mutex::new(None),
        first_token_after: Mutex::new(None),
        hold_next: Mutex::new(None),
    });
    let addr = front::serve(worker_routes(handler).with_state(mock.clone())).await;
    (mock, addr)
}

type Front = front::Front<Mock>;

/// P0 and D1 (snapshot workers), both `engine = "vllm"`, each with a mock vLLM server,
/// declared with fixed roles (`serve-alone = false`): every turn that is not direct goes
/// P→D.
async fn start() -> Front {
    start_with([Some(false), Some(false)]).await
}

/// [`start`] with P0's and D1's `serve-alone` keys as given (`None`: the vLLM default,
/// serving alone).
async fn start_with(serve_alone: [Option<bool>; 2]) -> Front {
    start_gated(serve_alone, 0).await
}

/// [`start_with`], with `http.prefills-per-worker` at `gate`; with a gate, a KV transfer
/// costs the policy 1,000 s, so that a worker that serves alone prefills every turn itself.
async fn start_gated(serve_alone: [Option<bool>; 2], gate: usize) -> Front {
    let edit = |cfg: &mut RouterConfig| {
        if gate > 0 {
            cfg.policy = serde_json::from_str(
                r#"{"policy":"kvc","local-prefill":{"transfer-setup-ms":1000000}}"#,
            )
            .unwrap();
        }
        cfg.workers.truncate(2);
        for (w, alone) in cfg.workers.iter_mut().zip(serve_alone) {
            w.engine = Some(EngineKind::Vllm);
            w.serve_alone = alone;
        }
    };
    let vllm = |http: &mut kvc_router::http::WorkerEndpoints| {
        for id in [0, 1] {
            http.set_engine(WorkerId(id), Some(EngineKind::Vllm));
        }
    };
    // Only guards against a hang.
    let options = kvc_router::http::HttpOptions {
        prefills_per_worker: gate,
        ..front::options(Duration::from_secs(30))
    };
    Front::start(edit, spawn_mock, |_, _| None, vllm, options).await
}

impl Front {
    /// One POST of `body` in session `session`.
    async fn post_as(&self, path: &str, session: &str, body: &Value) -> Answer {
        self.post(path, &[("x-session-id", session)], body).await
    }
}

fn words(n: u32) -> String {
    (0..n)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn completion(n: u32, stream: bool) -> Value {
    json!({"model": "m", "prompt": words(n), "max_tokens": 8, "min_tokens": 2,
        "stream": stream, "temperature": 0.0})
}

fn as_object(v: &Value) -> serde_json::Map<String, Value> {
    v.as_object().unwrap().clone()
}

#[tokio::test]
async fn p_and_d_get_exactly_the_nixl_fields_and_nothing_a_client_smuggled() {
    let f = start().await;
    // Turn 1 (P→D), with fields only the router may set.
    let mut sent = completion(1_300, false);
    sent["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_host": "evil"});
    sent["bootstrap_host"] = json!("evil");
    sent["bootstrap_room"] = json!(7);
    let r = f.post_as("/v1/completions", "agent-1", &sent).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    assert!(!r.headers.contains_key(PREFILL_FAILED_HEADER));
    let client = completion(1_300, false);
    let (p_path, p_headers, p_body) = f.received(0).pop().unwrap();
    let (d_path, d_headers, d_body) = f.received(1).pop().unwrap();
    assert_eq!(
        (p_path.as_str(), d_path.as_str()),
        ("/v1/completions", "/v1/completions")
    );
    let mut want_p = as_object(&client);
    want_p.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    want_p.insert("stream".into(), json!(false));
    want_p.insert("max_tokens".into(), json!(1));
    want_p.remove("min_tokens");
    assert_eq!(p_body, Value::Object(want_p));
    // D: the client's body with P's parameters verbatim.
    let request_id = &p_headers["x-request-id"];
    assert!(!request_id.is_empty());
    assert_eq!(&d_headers["x-request-id"], request_id, "one id for P and D");
    assert_eq!(p_headers["x-session-id"], "agent-1");
    let mut want_d = as_object(&client);
    want_d.insert("kv_transfer_params".into(), p_params(request_id));
    assert_eq!(d_body, Value::Object(want_d));

    // Turn 2: direct-to-D, the client's body as it is.
    let r = f
        .post_as("/v1/completions", "agent-1", &completion(1_900, false))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    assert_eq!(f.received(0).len(), 1, "P is not called");
    let (_, d_headers, d_body) = f.received(1).pop().unwrap();
    assert_eq!(d_body, completion(1_900, false));
    assert!(d_headers.contains_key("x-request-id"));

    // Turn 3, streamed chat without usage asked: D is asked for the usage chunk, the client
    // does not see it.
    let chat = |n: u32, usage: bool| {
        let mut v = json!({"messages": [{"role": "user", "content": words(n)}],
            "max_completion_tokens": 8, "stream": true});
        if usage {
            v["stream_options"] = json!({"include_usage": true});
        }
        v
    };
    let r = f
        .post_as("/v1/chat/completions", "chat-1", &chat(1_300, false))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    let (_, _, p_body) = f.received(0).pop().unwrap();
    assert_eq!(p_body["max_completion_tokens"], 1);
    assert_eq!(p_body["stream"], false);
    assert!(p_body.get("stream_options").is_none());
    let r = f
        .post_as("/v1/chat/completions", "chat-1", &chat(1_900, false))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    let (_, _, d_body) = f.received(1).pop().unwrap();
    let mut want = as_object(&chat(1_900, false));
    want.insert("stream_options".into(), json!({"include_usage": true}));
    assert_eq!(d_body, Value::Object(want));
    assert!(
        r.body.contains("\" b\"") && r.body.ends_with("data: [DONE]\n\n"),
        "{}",
        r.body
    );
    assert!(!r.body.contains("\"usage\""), "{}", r.body);
    // Asked for by the client: relayed.
    let r = f
        .post_as("/v1/chat/completions", "chat-1", &chat(2_500, true))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    assert!(r.body.contains("\"choices\":[]"), "{}", r.body);
    f.settle().await;
    assert_eq!(f.outcomes("ok"), 5.0);
    // No worker ever got a field a client set.
    for id in [0, 1] {
        for (_, _, body) in f.received(id) {
            assert!(body.get("bootstrap_host").is_none() && body.get("bootstrap_room").is_none());
            assert_ne!(body["kv_transfer_params"]["remote_host"], "evil");
        }
    }
}

#[tokio::test]
async fn a_turn_that_adds_nothing_to_the_body_forwards_the_client_s_bytes() {
    let f = start().await;
    let r = f
        .post_as("/v1/completions", "agent-2", &completion(1_300, false))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    // The client's own spacing and key order: a re-written body would lose both.
    let client = |n: u32, stream: bool| {
        format!(
            "{{ \"stream\": {stream},\n  \"prompt\" : \"{}\", \"max_tokens\":8 , \"model\":\"m\" }}",
            words(n)
        )
    };
    let send = |text: String| {
        let addr = f.addr;
        async move {
            common::client::exchange(
                addr,
                "/v1/completions",
                &[("x-session-id", "agent-2")],
                &text,
            )
            .await
        }
    };
    let text = client(1_900, false);
    let Answer {
        status,
        headers,
        body: answer,
    } = send(text.clone()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(headers["x-kvc-mode"], "direct-to-d");
    assert_eq!(f.mocks[&1].raw.lock().last().unwrap()[..], *text.as_bytes());
    // A streamed turn whose client did not ask for the usage: D's body gains the field,
    // appended to the client's own bytes.
    let text = client(2_500, true);
    let Answer {
        status,
        headers,
        body: answer,
    } = send(text.clone()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(headers["x-kvc-mode"], "direct-to-d");
    let raw = f.mocks[&1].raw.lock().last().unwrap().clone();
    let head = text.trim_end().strip_suffix('}').unwrap();
    assert_eq!(
        raw[..],
        *format!("{head},\"stream_options\":{{\"include_usage\":true}}}}").as_bytes()
    );
    let mut want: Value = serde_json::from_str(&text).unwrap();
    want["stream_options"] = json!({"include_usage": true});
    assert_eq!(serde_json::from_slice::<Value>(&raw).unwrap(), want);
    // A field of the client's that the router changes: the body is written anew.
    let text = client(2_700, true).replacen(
        '{',
        "{\"stream_options\": {\"continuous_usage_stats\": false}, ",
        1,
    );
    let Answer {
        status,
        body: answer,
        ..
    } = send(text.clone()).await;
    assert_eq!(status, 200, "{answer}");
    let raw = f.mocks[&1].raw.lock().last().unwrap().clone();
    assert!(text.contains(" : "));
    assert!(
        !raw.windows(3).any(|w| w == b" : "),
        "written anew: the client's spacing is gone"
    );
    let mut want: Value = serde_json::from_str(&text).unwrap();
    want["stream_options"]["include_usage"] = json!(true);
    assert_eq!(serde_json::from_slice::<Value>(&raw).unwrap(), want);
    // A client's router-only field is removed, so its bytes are never forwarded as they are.
    let text = client(3_100, false).replacen('{', "{\"bootstrap_room\": 5, ", 1);
    let Answer {
        status,
        headers,
        body: answer,
    } = send(text.clone()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(headers["x-kvc-mode"], "direct-to-d");
    let raw = f.mocks[&1].raw.lock().last().unwrap().clone();
    let got: Value = serde_json::from_slice(&raw).unwrap();
    assert!(got.get("bootstrap_room").is_none(), "{got}");
    assert_eq!(got["prompt"], words(3_100));
}

#[tokio::test]
async fn a_failed_prefill_leaves_the_request_to_d_alone() {
    let f = start().await;
    *f.mocks[&0].fail_prefill.lock() = Some(500);
    for (i, stream) in [false, true].into_iter().enumerate() {
        let session = format!("s{i}");
        let r = f
            .post_as("/v1/completions", &session, &completion(1_300, stream))
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
        assert_eq!(r.header(PREFILL_FAILED_HEADER), "0");
        let (_, _, d_body) = f.received(1).pop().unwrap();
        assert!(d_body.get("kv_transfer_params").is_none(), "{d_body}");
        assert_eq!(d_body["prompt"], words(1_300));
    }
    f.settle().await;
    assert_eq!(f.outcomes("ok"), 2.0);
    assert_eq!(f.outcomes("worker-failed"), 0.0);
    // D holds the session it served in full: the next turn goes direct.
    let r = f
        .post_as("/v1/completions", "s0", &completion(1_900, false))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
}

#[tokio::test]
async fn a_direct_turn_d_served_without_its_cache_is_a_direct_cache_miss() {
    let f = start().await;
    for (i, stream) in [false, true].into_iter().enumerate() {
        let session = format!("m{i}");
        *f.mocks[&1].cached.lock() = 100_000;
        let r = f
            .post_as("/v1/completions", &session, &completion(1_300, stream))
            .await;
        assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
        // D evicted the session behind the router's back: it reports no cached tokens.
        *f.mocks[&1].cached.lock() = 0;
        let r = f
            .post_as("/v1/completions", &session, &completion(1_900, stream))
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
        f.settle().await;
        assert_eq!(f.outcomes("direct-cache-miss"), (i + 1) as f64);
        // The policy no longer counts the session resident on D: the next turn goes via P.
        let r = f
            .post_as("/v1/completions", &session, &completion(2_500, stream))
            .await;
        assert_ne!(r.header("x-kvc-mode"), "direct-to-d");
        assert!(!r.headers.contains_key(PREFILL_FAILED_HEADER));
    }
    f.settle().await;
    assert_eq!(f.outcomes("ok"), 4.0);
    let snapshot = f.cluster.service().render_metrics();
    assert!(
        snapshot.contains("outcome=\"direct-cache-miss\"} 2"),
        "counted in /metrics"
    );
}

#[tokio::test]
async fn an_engine_s_refusal_of_a_request_is_its_own_outcome_and_leaves_the_session_in_place() {
    let f = start().await;
    for n in [1_300, 1_900] {
        let r = f
            .post_as("/v1/completions", "r", &completion(n, false))
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // vLLM refuses a direct turn it was not started for (`tool_choice: "auto"` without
    // `--enable-auto-tool-choice`): the client gets vLLM's 400 as it is.
    *f.mocks[&1].fail_decode.lock() = Some(400);
    *f.mocks[&1].message.lock() =
        Some("\"auto\" tool choice requires --enable-auto-tool-choice".into());
    for (i, stream) in [false, true].into_iter().enumerate() {
        let r = f
            .post_as(
                "/v1/completions",
                "r",
                &completion(2_500 + i as u32, stream),
            )
            .await;
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body.contains("enable-auto-tool-choice"), "{}", r.body);
        assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    }
    f.settle().await;
    assert_eq!(f.outcomes("invalid-request"), 2.0);
    assert_eq!(f.outcomes("worker-failed"), 0.0);
    let samples = common::parse_prometheus(&f.cluster.service().render_metrics());
    let closed = common::value(
        &samples,
        "kvc_router_http_breaker_state",
        &[("worker", "1"), ("state", "closed")],
    );
    assert_eq!(closed, 1.0, "D's breaker heard no failure");
    // The engine touched none of the session's KV: the next turn still goes direct.
    *f.mocks[&1].fail_decode.lock() = None;
    let r = f
        .post_as("/v1/completions", "r", &completion(2_600, false))
        .await;
    assert_eq!((r.status, r.header("x-kvc-mode")), (200, "direct-to-d"));
    // P refusing a first turn as over the model's context is `input-too-long`.
    *f.mocks[&0].fail_prefill.lock() = Some(400);
    *f.mocks[&0].message.lock() = Some(
        "This model's maximum context length is 16384 tokens. However, you requested 17000 \
         tokens."
            .into(),
    );
    let r = f
        .post_as("/v1/completions", "long", &completion(1_300, false))
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    f.settle().await;
    assert_eq!(f.outcomes("input-too-long"), 1.0);
    assert_eq!(f.outcomes("worker-failed"), 0.0);
}

#[tokio::test]
async fn an_engine_without_prompt_token_details_is_shown_and_its_turns_are_not_judged() {
    let f = start().await;
    let accounting = |f: &Front| {
        let samples = common::parse_prometheus(&f.cluster.service().render_metrics());
        samples
            .iter()
            .find(|s| {
                s.name == "kvc_router_worker_cache_accounting"
                    && s.labels.get("worker").map(String::as_str) == Some("1")
            })
            .map(|s| s.value)
    };
    assert_eq!(accounting(&f), None, "not known before an answer");
    // vLLM started without --enable-prompt-tokens-details: `prompt_tokens_details` is null.
    *f.mocks[&1].details.lock() = false;
    *f.mocks[&1].cached.lock() = 0;
    for (n, stream) in [(1_300, false), (1_900, false), (2_500, true)] {
        let r = f
            .post_as("/v1/completions", "nd", &completion(n, stream))
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    f.settle().await;
    assert_eq!(
        accounting(&f),
        Some(0.0),
        "shown as an engine without cache accounting"
    );
    // Nothing to judge a direct turn by: no direct-cache-miss is claimed.
    assert_eq!(f.outcomes("direct-cache-miss"), 0.0);
    assert_eq!(f.outcomes("ok"), 3.0);
    *f.mocks[&1].details.lock() = true;
    *f.mocks[&1].cached.lock() = 100_000;
    let r = f
        .post_as("/v1/completions", "nd", &completion(3_100, false))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    f.settle().await;
    assert_eq!(accounting(&f), Some(1.0));
}

#[tokio::test]
async fn a_decode_worker_s_error_on_a_stream_reaches_the_client_whole() {
    let f = start().await;
    *f.mocks[&1].fail_decode.lock() = Some(400);
    let r = f
        .post_as("/v1/completions", "e", &completion(1_300, true))
        .await;
    assert_eq!(r.status, 400);
    let v: Value = serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body));
    assert_eq!(v["error"]["message"], "d1 says 400");
    f.settle().await;
    // The engine refused the request itself: the client's error, not the worker's.
    assert_eq!(f.outcomes("invalid-request"), 1.0);
    assert_eq!(f.outcomes("worker-failed"), 0.0);
}

#[tokio::test]
async fn generate_is_refused_on_a_vllm_cluster() {
    let f = start().await;
    let body = json!({"text": words(100), "sampling_params": {"max_new_tokens": 4}});
    let r = f.post_as("/generate", "g", &body).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/completions"),
        "{v}"
    );
    assert!(f.received(0).is_empty() && f.received(1).is_empty());
}

#[tokio::test]
async fn a_local_turn_is_the_client_s_body_to_the_chosen_worker_and_p_gets_nothing() {
    // D1 declares nothing: a vLLM instance serves a plain request in full by default. P0 only
    // prefills for others.
    let f = start_with([Some(false), None]).await;
    let chat = json!({"messages": [{"role": "user", "content": words(1_300)}],
        "max_completion_tokens": 8, "stream": true});
    let cases = [
        ("/v1/completions", completion(1_300, false)),
        ("/v1/completions", completion(1_300, true)),
        ("/v1/chat/completions", chat.clone()),
    ];
    for (i, (path, sent)) in cases.iter().enumerate() {
        let session = format!("local-{i}");
        // What only the router may set is removed first, as on every path.
        let mut smuggled = sent.clone();
        smuggled["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_host": "evil"});
        let r = f.post_as(path, &session, &smuggled).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        assert_eq!(r.header("x-kvc-mode"), "local-prefill", "{path}");
        assert_eq!(r.header("x-kvc-decode-worker"), "1");
        assert!(!r.headers.contains_key("x-kvc-prefill-worker"));
        assert!(!r.headers.contains_key(PREFILL_FAILED_HEADER));
        let got = f.received(1);
        assert_eq!(got.len(), i + 1, "one call to the chosen worker");
        let (d_path, d_headers, d_body) = got.last().unwrap().clone();
        assert_eq!(d_path, *path);
        assert_eq!(d_headers["x-session-id"], session);
        assert!(d_headers.contains_key("x-request-id"));
        // The client's body, without `kv_transfer_params`; a stream asks for the usage chunk
        // (as on a direct turn), the client does not see it.
        let mut want = as_object(sent);
        if sent["stream"] == true {
            want.insert("stream_options".into(), json!({"include_usage": true}));
            assert!(!r.body.contains("\"usage\""), "{}", r.body);
            assert!(r.body.contains("data: [DONE]"), "{}", r.body);
        } else {
            assert_eq!(
                serde_json::from_str::<Value>(&r.body).unwrap()["choices"][0]["text"],
                "a b"
            );
        }
        assert_eq!(d_body, Value::Object(want), "{path}");
        assert!(f.received(0).is_empty(), "P gets nothing on a local turn");
    }
    f.settle().await;
    // Reported `ok` and counted under its own mode; the session stays on D1.
    assert_eq!(f.outcomes("ok"), 3.0);
    assert_eq!(
        f.cluster
            .service()
            .metrics()
            .decisions(kvc_core::ExecutionMode::LocalPrefill, None),
        3
    );
    let r = f
        .post_as("/v1/completions", "local-0", &completion(1_900, false))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    assert_eq!(r.header("x-kvc-decode-worker"), "1");
    assert!(f.received(0).is_empty());
}

/// A Messages body of `n` words in one user message (`max_tokens` 8).
fn messages(n: u32, stream: bool) -> Value {
    json!({"model": "m", "max_tokens": 8, "stream": stream,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                   {"type": "text", "text": "You code."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": words(n)}]}]})
}

/// A Responses body of `n` words keyed by Codex's `prompt_cache_key`.
fn responses(n: u32, stream: bool) -> Value {
    json!({"model": "m", "max_output_tokens": 8, "stream": stream, "store": false,
        "prompt_cache_key": "codex-thread-1", "instructions": "You code.",
        "input": [{"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": words(n)}]}]})
}

#[tokio::test]
async fn the_coding_agents_apis_go_p_to_d_then_direct_and_are_judged_by_their_own_usage() {
    let f = start().await;
    let claude = [("x-claude-code-session-id", "cc-1")];
    // Messages, turn 1: P gets the API's own output limit, D P's parameters verbatim.
    let r = f
        .post("/v1/messages", &claude, &messages(1_300, false))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    assert_eq!(r.header("x-kvc-session"), "cc-1");
    let (p_path, p_headers, p_body) = f.received(0).pop().unwrap();
    assert_eq!(p_path, "/v1/messages");
    let mut want_p = as_object(&messages(1_300, false));
    want_p.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    want_p.insert("max_tokens".into(), json!(1));
    assert_eq!(p_body, Value::Object(want_p));
    let (d_path, _, d_body) = f.received(1).pop().unwrap();
    assert_eq!(d_path, "/v1/messages");
    let mut want_d = as_object(&messages(1_300, false));
    want_d.insert(
        "kv_transfer_params".into(),
        p_params(&p_headers["x-request-id"]),
    );
    assert_eq!(d_body, Value::Object(want_d));
    // Turn 2 (the conversation grown), streamed: direct to D, nothing added to the body, the
    // events relayed with their names; D's `cache_read_input_tokens` says it held the session.
    let mut grown = messages(1_300, true);
    grown["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": [{"type": "text", "text": "a b"}]}),
        json!({"role": "user", "content": words(400)}),
    ]);
    let r = f.post("/v1/messages", &claude, &grown).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    assert!(
        r.body.starts_with("event: message_start\ndata: "),
        "{}",
        r.body
    );
    assert!(r.body.contains("event: message_stop\n"), "{}", r.body);
    let (_, _, d_body) = f.received(1).pop().unwrap();
    assert_eq!(d_body, grown, "a Messages stream is not asked for usage");
    f.settle().await;
    assert_eq!(f.outcomes("ok"), 2.0);
    // D's count of its cache says the session was gone: a cache miss, in this API's shape.
    *f.mocks[&1].cached.lock() = 0;
    let mut again = grown.clone();
    again["stream"] = json!(false);
    again["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": words(30)}));
    let r = f.post("/v1/messages", &claude, &again).await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    f.settle().await;
    assert_eq!(f.outcomes("direct-cache-miss"), 1.0);
    *f.mocks[&1].cached.lock() = 100_000;

    // Responses, keyed by the body's `prompt_cache_key`: P gets `max_output_tokens: 1` and is
    // not asked to store its one-token response.
    let r = f.post("/v1/responses", &[], &responses(1_300, false)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    assert_eq!(r.header("x-kvc-session"), "codex-thread-1");
    let (p_path, _, p_body) = f.received(0).pop().unwrap();
    assert_eq!(p_path, "/v1/responses");
    assert_eq!(
        (
            &p_body["max_output_tokens"],
            &p_body["store"],
            &p_body["stream"]
        ),
        (&json!(1), &json!(false), &json!(false))
    );
    assert!(p_body.get("max_tokens").is_none(), "{p_body}");
    let mut grown = responses(1_300, true);
    grown["input"].as_array_mut().unwrap().extend([
        json!({"type": "function_call", "name": "shell", "arguments": "{}", "call_id": "c1"}),
        json!({"type": "function_call_output", "call_id": "c1", "output": words(300)}),
    ]);
    let r = f.post("/v1/responses", &[], &grown).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    assert!(r.body.contains("event: response.completed\n"), "{}", r.body);
    let (_, _, d_body) = f.received(1).pop().unwrap();
    assert_eq!(d_body, grown);
    f.settle().await;
    assert_eq!(f.outcomes("ok"), 4.0);
    assert_eq!(f.outcomes("direct-cache-miss"), 1.0);
    let source = |s: &str| f.metric("kvc_router_http_session_keys_total", &[("source", s)]);
    assert_eq!(source("x-claude-code-session-id"), 3.0);
    assert_eq!(source("prompt_cache_key"), 2.0);
}

#[tokio::test]
async fn the_agents_apis_answer_the_front_s_own_errors_in_their_own_shapes() {
    let f = start().await;
    // Messages: Anthropic's `{"type": "error", "error": {"type", "message"}}`, whatever the
    // error: a malformed body, a wrong method.
    let mut no_limit = messages(10, false);
    no_limit.as_object_mut().unwrap().remove("max_tokens");
    let r = f.post("/v1/messages", &[], &no_limit).await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json(),
        json!({"type": "error", "error": {"type": "invalid_request_error",
            "message": "missing `max_tokens`"}})
    );
    let r = f
        .post(
            "/v1/messages",
            &[],
            &json!({"max_tokens": 1, "messages": [{"role": "user",
            "content": [{"type": "text"}]}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("messages[0].content[0].text"),
        "{}",
        r.body
    );
    let r = f.get("GET", "/v1/messages").await;
    assert_eq!(r.status, 405);
    assert_eq!(r.json()["type"], "error", "{}", r.body);
    // Responses: OpenAI's shape; a stored conversation is refused, saying why.
    let mut stored = responses(10, false);
    stored["previous_response_id"] = json!("resp_0");
    let r = f.post("/v1/responses", &[], &stored).await;
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("previous_response_id"),
        "{e}"
    );
    assert_eq!(f.count(0) + f.count(1), 0, "no worker was called");
}

#[tokio::test]
async fn a_session_its_client_ends_is_released_at_once() {
    let f = start().await;
    let service = f.cluster.service().clone();
    let chat =
        |n: u32| json!({"messages": [{"role": "user", "content": words(n)}], "max_tokens": 8});
    let ended = |f: &Front| f.metric("kvc_router_sessions_forgotten_total", &[("cause", "ended")]);
    // DELETE on the sessions endpoint: forgotten by the front and the router.
    for n in [1_300, 1_900] {
        assert_eq!(
            f.post_as("/v1/chat/completions", "end-1", &chat(n))
                .await
                .status,
            200
        );
    }
    f.settle().await;
    let s1 = kvc_core::SessionId::from_key("end-1");
    assert!(service.knows_session(s1));
    let sessions = service.policy_session_count();
    let r = f.get("DELETE", "/v1/sessions/end-1").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json(), json!({"session": "end-1", "ended": true}));
    assert!(!service.knows_session(s1));
    assert_eq!(service.policy_session_count(), sessions - 1);
    assert_eq!(ended(&f), 1.0);
    let r = f.get("DELETE", "/v1/sessions/end-1").await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("end-1"), "{}", r.body);
    // The key starts afresh: its first turn again, nothing counted resident on D.
    let r = f
        .post_as("/v1/chat/completions", "end-1", &chat(2_500))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");

    // A request marked its session's last: answered as usual, then the session is released.
    assert_eq!(
        f.post_as("/v1/chat/completions", "end-2", &chat(1_300))
            .await
            .status,
        200
    );
    let r = f
        .post(
            "/v1/chat/completions",
            &[("x-session-id", "end-2"), ("x-session-final", "true")],
            &chat(1_900),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    f.settle().await;
    assert!(!service.knows_session(kvc_core::SessionId::from_key("end-2")));
    assert_eq!(ended(&f), 2.0);
    let r = f
        .post_as("/v1/chat/completions", "end-2", &chat(2_500))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "turn1-seed");
    // `false` leaves the session as it is; anything else is refused, naming the header.
    let r = f
        .post(
            "/v1/chat/completions",
            &[("x-session-id", "end-2"), ("x-session-final", "false")],
            &chat(2_600),
        )
        .await;
    assert_eq!(r.header("x-kvc-mode"), "direct-to-d");
    let r = f
        .post(
            "/v1/chat/completions",
            &[("x-session-id", "end-2"), ("x-session-final", "soon")],
            &chat(2_700),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("x-session-final"), "{}", r.body);
    f.settle().await;
    assert_eq!(ended(&f), 2.0);
}

/// A client may send its next turn as soon as it reads its stream's closing event, before the
/// stream itself ends (a chunked body's last chunk, a connection's close). The turn's outcome
/// is recorded before that event reaches the client: here a direct-to-D turn whose stream
/// shows D no longer held the session (`direct-cache-miss`) is followed at once by the next
/// turn, which must not be sent to D as resident again — with D holding every stream open for
/// 5 s after its last event, on each API whose stream the front relays.
#[tokio::test]
async fn a_turn_sent_on_the_closing_event_of_the_last_sees_its_outcome() {
    let f = start().await;
    *f.mocks[&1].hold_open.lock() = Some(Duration::from_secs(5));
    let grow_completion = |mut b: Value, n: u32| {
        b["prompt"] = json!(format!(
            "{} a b {}",
            b["prompt"].as_str().unwrap(),
            words(n)
        ));
        b
    };
    let grow_messages = |mut b: Value, n: u32| {
        b["messages"].as_array_mut().unwrap().extend([
            json!({"role": "assistant", "content": [{"type": "text", "text": "a b"}]}),
            json!({"role": "user", "content": words(n)}),
        ]);
        b
    };
    let grow_responses = |mut b: Value, n: u32| {
        b["input"]
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": words(n)}]}));
        b
    };
    type Grow<'a> = &'a dyn Fn(Value, u32) -> Value;
    /// Path, headers, turn 1's body, how the conversation grows, D's closing event.
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], Value, Grow<'a>, &'a str);
    let cases: [Case<'_>; 3] = [
        (
            "/v1/completions",
            &[("x-session-id", "closing-1")],
            completion(1_300, false),
            &grow_completion,
            "data: [DONE]\n\n",
        ),
        (
            "/v1/messages",
            &[("x-claude-code-session-id", "closing-2")],
            messages(1_300, false),
            &grow_messages,
            "data: {\"type\":\"message_stop\"}\n\n",
        ),
        (
            "/v1/responses",
            &[],
            responses(1_300, false),
            &grow_responses,
            "\"type\":\"response.completed\"",
        ),
    ];
    let d_cached = |n: u64| *f.mocks[&1].cached.lock() = n;
    for (path, headers, first, grow, closing) in cases {
        d_cached(100_000);
        let r = f.post(path, headers, &first).await;
        assert_eq!(
            (r.status, r.header("x-kvc-mode")),
            (200, "turn1-seed"),
            "{path}"
        );
        // Turn 2, streamed, direct to D; D's usage says it no longer held the session.
        d_cached(0);
        let mut second = grow(first.clone(), 20);
        second["stream"] = json!(true);
        let mut stream = common::client::post(f.addr, path, headers, &second.to_string()).await;
        assert_eq!(stream.status, 200, "{path}");
        assert_eq!(stream.headers["x-kvc-mode"], "direct-to-d", "{path}");
        let mut read = String::new();
        while !read.contains(closing) || !read.ends_with("\n\n") {
            let piece = stream.next_piece().await.expect("the closing event");
            read.push_str(&String::from_utf8(piece).unwrap());
        }
        // D still holds the stream open: turn 3 goes out now, and is not sent to D as if the
        // session were there.
        d_cached(100_000);
        let r = f.post(path, headers, &grow(second, 20)).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        assert_eq!(
            (r.header("x-kvc-mode"), r.find_header("x-kvc-reason")),
            ("fallback", Some("session-not-resident")),
            "{path}"
        );
        // The stream then ends as D ends it, nothing after its closing event.
        assert_eq!(stream.read_all().await, "", "{path}");
    }
    f.settle().await;
    assert_eq!(f.outcomes("direct-cache-miss"), 3.0);
    assert_eq!(f.outcomes("ok"), 6.0);
}

/// Every streamed answer of both mocks comes 400 ms after its request on the router's clock.
fn slow_first_tokens(f: &Front) {
    for id in [0, 1] {
        *f.mocks[&id].first_token_after.lock() = Some((Arc::clone(&f.cluster.clock), 400));
    }
}

/// A streamed first turn of 1,300 words in `session`, answered 200.
async fn streamed_turn(f: &Front, session: &str) -> Answer {
    let r = f
        .post_as("/v1/completions", session, &completion(1_300, true))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r
}

#[tokio::test]
async fn a_streamed_turn_its_worker_prefilled_measures_that_worker_s_pace() {
    // D1 serves alone; P0 only prefills for others. Every streamed answer comes 400 ms after
    // its request on the router's clock, far past the policy's estimate for 1,300 words.
    let f = start_with([Some(false), None]).await;
    slow_first_tokens(&f);
    let pace = |w: usize| f.cluster.service().gauges().workers[w].prefill_pace;
    for i in 0..3 {
        assert_eq!(pace(1), 1.0, "not measured before three first tokens");
        let r = streamed_turn(&f, &format!("pace-{i}")).await;
        assert_eq!(r.header("x-kvc-mode"), "local-prefill");
    }
    let d1 = pace(1);
    assert!(d1 > 5.0 && d1 < 4096.0, "D1's pace {d1}");
    assert_eq!(pace(0), 1.0, "P0 prefilled nothing");
    // A whole answer has no first token to time.
    let r = f
        .post_as("/v1/completions", "pace-whole", &completion(1_300, false))
        .await;
    assert_eq!(r.header("x-kvc-mode"), "local-prefill");
    assert_eq!(pace(1), d1);

    // With fixed roles every first turn goes P→D: its first token comes after the KV
    // transfer, and times neither worker.
    let f = start().await;
    slow_first_tokens(&f);
    for i in 0..3 {
        let r = streamed_turn(&f, &format!("pd-{i}")).await;
        assert_eq!(r.header("x-kvc-prefill-worker"), "0");
    }
    let pace = |w: usize| f.cluster.service().gauges().workers[w].prefill_pace;
    assert_eq!((pace(0), pace(1)), (1.0, 1.0));
}

#[tokio::test]
async fn with_a_prefill_gate_a_worker_gets_its_next_turn_at_the_first_token_shortest_first() {
    // One turn at a time in prefill on D1 (which serves alone; P0 only prefills for others).
    let f = start_gated([Some(false), None], 1).await;
    let d1 = &f.mocks[&1];
    let hold = Arc::new(tokio::sync::Semaphore::new(0));
    *d1.hold_next.lock() = Some(Arc::clone(&hold));
    let front = Arc::new(f);
    // Prompts of `n` words of their own (no one the start of another's).
    let send = |session: &'static str, n: u32| {
        let f = Arc::clone(&front);
        let prompt: Vec<String> = (0..n).map(|i| format!("{session}{i}")).collect();
        let body = json!({"model": "m", "prompt": prompt.join(" "), "max_tokens": 8,
            "stream": true, "temperature": 0.0});
        tokio::spawn(async move { f.post_as("/v1/completions", session, &body).await })
    };
    // The first turn is held by D1 before its first token; a long turn, then a short one,
    // come while it is.
    let first = send("gate-a", 1_300);
    front.received_at_least(1, 1).await;
    let long = send("gate-long", 2_600);
    let short = send("gate-short", 1_300);
    // Both decided (a turn enters its worker's gate right after its decision), then a
    // margin for them to reach it on a loaded machine.
    common::wait_until("three decisions awaiting their outcome", || {
        front.cluster.service().pending_decisions() >= 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        front.count(1),
        1,
        "D1 gets nothing more before the first token"
    );
    hold.add_permits(1);
    for (name, task) in [("first", first), ("long", long), ("short", short)] {
        let r = task.await.unwrap();
        assert_eq!(r.status, 200, "{name}: {}", r.body);
        // D1 prefills each itself (the later two find the first's prompt there).
        assert!(!r.headers.contains_key("x-kvc-prefill-worker"), "{name}");
        assert_eq!(r.header("x-kvc-decode-worker"), "1", "{name}");
    }
    let sessions: Vec<String> = front
        .received(1)
        .iter()
        .map(|(_, h, _)| h["x-session-id"].clone())
        .collect();
    assert_eq!(sessions, ["gate-a", "gate-short", "gate-long"]);
}
