//! The coding agents' APIs of standalone simulated vLLM workers, over HTTP: Anthropic
//! Messages (`/v1/messages`, `/v1/messages/count_tokens`) and OpenAI Responses
//! (`/v1/responses`), whole and streamed. A conversation that grows (the previous turn's
//! messages, the reply, a tool call and its result) reads the previous turn's prompt from the
//! worker's prefix cache; a P→D pair goes through `kv_transfer_params`, directly and through
//! the decode-side sidecar; malformed bodies get 400 in each API's error shape.
//!
//! Prompts are tokenized one token per word, each message as `<|role|>` and its words, the
//! prompt closed by `<|assistant|>`; blocks are 16 tokens. [`FIRST_WORDS`] makes a first turn
//! of 64 message tokens (`<|system|>` and 2 words, `<|user|>` and 60 words), 65 in all: four
//! full blocks the next turn finds cached.

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::StatusCode;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use kvc_core::openai::{VllmApi, nixl_prefill_body};
use kvc_core::{EngineKind, EvictionMode, StateSource, Topology};
use kvc_engine_sim::ClusterSpec;
use kvc_engine_sim::http::{Faults, HttpWorkers, StandaloneOptions, WorkerOptions};
use kvc_engine_sim::model::Profile;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

/// Words of the first turn's user message.
const FIRST_WORDS: usize = 60;
/// The first turn's prompt: 3 + 61 message tokens and the generation prompt.
const FIRST_PROMPT: u64 = 65;
/// What the next turn finds cached: the first turn's four full blocks.
const FIRST_CACHED: u64 = 64;

static NEXT_DIR: AtomicU64 = AtomicU64::new(0);

struct Workers {
    rt: tokio::runtime::Runtime,
    workers: Option<HttpWorkers>,
    client: Client<HttpConnector, Full<Bytes>>,
    dir: std::path::PathBuf,
}

impl Drop for Workers {
    fn drop(&mut self) {
        if let Some(w) = self.workers.take() {
            let _ = w.stop();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One reply of a worker.
struct Reply {
    status: StatusCode,
    headers: hyper::HeaderMap,
    body: Bytes,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!("{e}: {}", String::from_utf8_lossy(&self.body));
        })
    }

    /// The SSE events: (`event:` name, data).
    fn events(&self) -> Vec<(Option<String>, Value)> {
        let text = std::str::from_utf8(&self.body).unwrap();
        text.split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let mut name = None;
                let mut data = String::new();
                for line in e.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = Some(n.to_owned());
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data.push_str(d);
                    }
                }
                let data = if data == "[DONE]" {
                    Value::String(data)
                } else {
                    serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"))
                };
                (name, data)
            })
            .collect()
    }
}

impl Workers {
    /// Standalone vLLM workers of `topology` (with the decode-side sidecar when `pd_shim`).
    fn start(topology: &str, pd_shim: bool) -> Self {
        Self::start_with(topology, pd_shim, Faults::default())
    }

    /// [`Workers::start`], showing `faults`.
    fn start_with(topology: &str, pd_shim: bool, faults: Faults) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = std::env::temp_dir().join(format!(
            "kvc-sim-agent-apis-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let standalone = StandaloneOptions::default();
        let cluster = ClusterSpec {
            topology: topology.parse::<Topology>().unwrap(),
            local_prefill: true,
            profile: Profile::default(),
            eviction: EvictionMode::IdleLru,
            seed: 0,
            jitter: 0.0,
            block_size: standalone.block_size,
        };
        let opts = WorkerOptions {
            speedup: 200.0,
            http_base_port: None,
            bootstrap_base_port: None,
            snapshot_dir: dir.clone(),
            table_slots: 64,
            model: "sim-model".into(),
            router_state: StateSource::Snapshot,
            engine_base_port: None,
            engine: EngineKind::Vllm,
            faults,
            pd_shim,
        };
        let workers = HttpWorkers::start_standalone(rt.handle(), &cluster, &opts, standalone)
            .expect("the workers start");
        let client = Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(kvc_engine_sim::http::connector());
        Workers {
            rt,
            workers: Some(workers),
            client,
            dir,
        }
    }

    fn addr(&self, i: usize) -> SocketAddr {
        self.workers.as_ref().unwrap().addrs()[i]
    }

    fn post_raw(&self, worker: usize, path: &str, headers: &[(&str, &str)], body: Bytes) -> Reply {
        let mut req = hyper::Request::post(format!("http://{}{path}", self.addr(worker)))
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body)).unwrap();
        self.rt.block_on(async {
            let resp =
                tokio::time::timeout(std::time::Duration::from_secs(30), self.client.request(req))
                    .await
                    .expect("an answer in time")
                    .expect("an answer");
            let status = resp.status();
            let headers = resp.headers().clone();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            Reply {
                status,
                headers,
                body,
            }
        })
    }

    fn post(&self, worker: usize, path: &str, headers: &[(&str, &str)], body: &Value) -> Reply {
        self.post_raw(worker, path, headers, Bytes::from(body.to_string()))
    }
}

/// `n` distinct words starting with `tag`.
fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A first Messages turn: a 2-word system prompt, one user message of [`FIRST_WORDS`] words.
fn messages_turn1(tag: &str, stream: bool) -> Value {
    json!({"model": "sim-model", "max_tokens": 4, "stream": stream,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                   {"type": "text", "text": "You code."}],
        "messages": [{"role": "user", "content": [{"type": "text",
            "text": words(tag, FIRST_WORDS), "cache_control": {"type": "ephemeral"}}]}]})
}

/// The next Messages turn: the first's messages, the reply with a tool call, its result.
fn messages_turn2(tag: &str, stream: bool) -> Value {
    let mut b = messages_turn1(tag, stream);
    b["system"][0]["text"] = json!("x-anthropic-billing-header: cch=2;");
    let m = b["messages"].as_array_mut().unwrap();
    m.push(json!({"role": "assistant", "content": [
        {"type": "text", "text": "tok tok"},
        {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a.rs"}}]}));
    m.push(json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "fn main() {}"}]}));
    b
}

/// A first Responses turn: 2-word instructions, one user message of [`FIRST_WORDS`] words.
fn responses_turn1(tag: &str, stream: bool) -> Value {
    json!({"model": "sim-model", "max_output_tokens": 4, "stream": stream, "store": false,
        "instructions": "You code.",
        "input": [{"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": words(tag, FIRST_WORDS)}]}]})
}

/// The next Responses turn: the first's input, the reply, a function call and its output.
fn responses_turn2(tag: &str, stream: bool) -> Value {
    let mut b = responses_turn1(tag, stream);
    let m = b["input"].as_array_mut().unwrap();
    m.push(json!({"type": "message", "role": "assistant",
        "content": [{"type": "output_text", "text": "tok tok"}]}));
    m.push(json!({"type": "function_call", "name": "shell",
        "arguments": "{\"cmd\":\"ls\"}", "call_id": "c1"}));
    m.push(json!({"type": "function_call_output", "call_id": "c1", "output": "a.rs b.rs"}));
    b
}

fn count_tokens(w: &Workers, body: &Value) -> u64 {
    let r = w.post(0, "/v1/messages/count_tokens", &[], body);
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert_eq!(
        v["context_management"]["original_input_tokens"],
        v["input_tokens"]
    );
    v["input_tokens"].as_u64().unwrap()
}

/// A whole Messages answer's usage: (input, output, cache read).
fn messages_usage(v: &Value) -> (u64, u64, u64) {
    let u = &v["usage"];
    (
        u["input_tokens"].as_u64().unwrap(),
        u["output_tokens"].as_u64().unwrap(),
        u["cache_read_input_tokens"].as_u64().unwrap(),
    )
}

/// A Messages stream: its event names and the usage of its `message_delta`, checked against
/// the events vLLM sends.
fn messages_stream(r: &Reply, prompt: u64, output: u64) -> (u64, u64, u64) {
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["content-type"], "text/event-stream");
    let events = r.events();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_deref().unwrap());
    }
    let start = &events[0].1["message"];
    assert_eq!(
        (&start["type"], &start["role"], &start["model"]),
        (&json!("message"), &json!("assistant"), &json!("sim-model"))
    );
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        start["usage"],
        json!({"input_tokens": prompt, "output_tokens": 0})
    );
    assert_eq!(
        events[1].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let text: String = events[2..4]
        .iter()
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(text, vec!["tok"; output as usize].join(" "));
    let delta = &events[5].1;
    assert_eq!(
        delta["delta"],
        json!({"stop_reason": "max_tokens", "stop_sequence": null})
    );
    messages_usage(delta)
}

#[test]
fn a_messages_conversation_that_grows_reads_its_previous_turn_from_the_cache() {
    let w = Workers::start("1dp", false);
    for (tag, stream) in [("w", false), ("s", true)] {
        let turn1 = messages_turn1(tag, stream);
        let turn2 = messages_turn2(tag, stream);
        assert_eq!(count_tokens(&w, &turn1), FIRST_PROMPT);
        // The reply's 3 words, the tool result's 3, each message's role token.
        let prompt2 = count_tokens(&w, &turn2);
        assert_eq!(prompt2, FIRST_PROMPT + 4 + 4);
        let headers = [("x-session-id", tag)];
        let (r1, r2) = (
            w.post(0, "/v1/messages", &headers, &turn1),
            w.post(0, "/v1/messages", &headers, &turn2),
        );
        let (u1, u2) = if stream {
            (
                messages_stream(&r1, FIRST_PROMPT, 4),
                messages_stream(&r2, prompt2, 4),
            )
        } else {
            let (v1, v2) = (r1.json(), r2.json());
            assert_eq!(r1.status, StatusCode::OK, "{v1}");
            for v in [&v1, &v2] {
                assert_eq!(v["type"], "message");
                assert_eq!(v["role"], "assistant");
                assert_eq!(v["model"], "sim-model");
                assert_eq!(v["stop_reason"], "max_tokens");
                assert_eq!(
                    v["content"],
                    json!([{"type": "text", "text": "tok tok tok tok"}])
                );
                assert!(v["id"].as_str().unwrap().starts_with("msg_"));
                assert!(v.get("kv_transfer_params").is_none());
            }
            (messages_usage(&v1), messages_usage(&v2))
        };
        assert_eq!(
            u1,
            (FIRST_PROMPT, 4, 0),
            "{tag}: the first turn is prefilled"
        );
        assert_eq!(
            u2,
            (prompt2 - FIRST_CACHED, 4, FIRST_CACHED),
            "{tag}: the first turn's blocks are read from the cache"
        );
    }
}

/// A whole Responses answer's usage: (input, output, cached, total).
fn responses_usage(v: &Value) -> (u64, u64, u64, u64) {
    let u = &v["usage"];
    assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 0);
    (
        u["input_tokens"].as_u64().unwrap(),
        u["output_tokens"].as_u64().unwrap(),
        u["input_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        u["total_tokens"].as_u64().unwrap(),
    )
}

/// The response object of a whole answer or of `response.completed`, checked.
fn check_response(v: &Value, text: &str) {
    assert_eq!(v["object"], "response");
    assert_eq!(v["model"], "sim-model");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["instructions"], "You code.");
    let out = &v["output"][0];
    assert_eq!(
        (&out["type"], &out["role"], &out["status"]),
        (&json!("message"), &json!("assistant"), &json!("completed"))
    );
    assert!(out["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(out["content"][0]["type"], "output_text");
    assert_eq!(out["content"][0]["text"], text);
    assert_eq!(out["content"][0]["annotations"], json!([]));
}

/// A Responses stream: its events checked, the usage of `response.completed`.
fn responses_stream(r: &Reply) -> (u64, u64, u64, u64) {
    assert_eq!(r.status, StatusCode::OK);
    let events = r.events();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_deref().unwrap());
        assert_eq!(data["sequence_number"], i as u64);
    }
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    let deltas: String = events[4..6]
        .iter()
        .map(|(_, d)| d["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(deltas, "tok tok tok tok");
    assert_eq!(events[6].1["text"], "tok tok tok tok");
    let item = events[2].1["item"]["id"].clone();
    assert_eq!(events[8].1["item"]["id"], item);
    let done = &events[9].1["response"];
    check_response(done, "tok tok tok tok");
    assert_eq!(done["output"][0]["id"], item);
    responses_usage(done)
}

#[test]
fn a_responses_conversation_that_grows_reads_its_previous_turn_from_the_cache() {
    let w = Workers::start("1dp", false);
    for (tag, stream) in [("w", false), ("s", true)] {
        let headers = [("x-session-id", tag)];
        let r1 = w.post(0, "/v1/responses", &headers, &responses_turn1(tag, stream));
        let r2 = w.post(0, "/v1/responses", &headers, &responses_turn2(tag, stream));
        let (u1, u2) = if stream {
            (responses_stream(&r1), responses_stream(&r2))
        } else {
            let (v1, v2) = (r1.json(), r2.json());
            assert_eq!(r1.status, StatusCode::OK, "{v1}");
            check_response(&v1, "tok tok tok tok");
            check_response(&v2, "tok tok tok tok");
            assert!(v1["kv_transfer_params"].is_null());
            (responses_usage(&v1), responses_usage(&v2))
        };
        // The reply, the call (`<tool_call shell>{…}</tool_call>`) and its output: a role
        // token and 2 words each.
        let prompt2 = FIRST_PROMPT + 3 * 3;
        assert_eq!(u1, (FIRST_PROMPT, 4, 0, FIRST_PROMPT + 4), "{tag}");
        assert_eq!(
            u2,
            (prompt2, 4, FIRST_CACHED, prompt2 + 4),
            "{tag}: the first turn's blocks are read from the cache"
        );
    }
}

/// A P→D pair through `path`: P holds the request and answers its `kv_transfer_params`, D
/// pulls it (streamed when `stream`); a second pull of the same hold is refused. Returns D's
/// reply and the refusal.
fn p_to_d(w: &Workers, path: &str, api: VllmApi, client: &Value) -> (Value, Reply, Reply) {
    let p_body = nixl_prefill_body(client.as_object().unwrap(), api);
    let p = w.post(
        0,
        path,
        &[("x-request-id", "req-1")],
        &Value::Object(p_body),
    );
    assert_eq!(p.status, StatusCode::OK);
    let p = p.json();
    let params = p["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], "p0");
    // 64 message tokens: four blocks.
    assert_eq!(params["remote_block_ids"], json!([0, 1, 2, 3]));
    assert!(
        params["remote_request_id"]
            .as_str()
            .unwrap()
            .starts_with("req-1-")
    );
    assert_eq!(params["remote_port"], w.addr(0).port());
    let mut d_body = client.clone();
    d_body["kv_transfer_params"] = params;
    let d = w.post(1, path, &[], &d_body);
    let again = w.post(1, path, &[], &d_body);
    (p, d, again)
}

#[test]
fn messages_go_from_prefill_to_decode_over_kv_transfer_params() {
    let w = Workers::start("1p1d", false);
    let (p, d, again) = p_to_d(
        &w,
        "/v1/messages",
        VllmApi::Messages,
        &messages_turn1("pd", false),
    );
    assert_eq!(messages_usage(&p), (FIRST_PROMPT, 1, 0));
    assert_eq!(p["content"], json!([{"type": "text", "text": "tok"}]));
    assert_eq!(d.status, StatusCode::OK);
    let d = d.json();
    assert_eq!(messages_usage(&d), (FIRST_PROMPT, 4, 0));
    assert!(d.get("kv_transfer_params").is_none());
    assert_eq!(again.status, StatusCode::BAD_REQUEST);
    let e = again.json();
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("remote_request_id"),
        "{e}"
    );
    // Streamed on D.
    let (_, d, _) = p_to_d(
        &w,
        "/v1/messages",
        VllmApi::Messages,
        &messages_turn1("pds", true),
    );
    assert_eq!(messages_stream(&d, FIRST_PROMPT, 4), (FIRST_PROMPT, 4, 0));
}

#[test]
fn responses_go_from_prefill_to_decode_over_kv_transfer_params() {
    let w = Workers::start("1p1d", false);
    let (p, d, again) = p_to_d(
        &w,
        "/v1/responses",
        VllmApi::Responses,
        &responses_turn1("pd", false),
    );
    assert_eq!(responses_usage(&p), (FIRST_PROMPT, 1, 0, FIRST_PROMPT + 1));
    assert_eq!(p["max_output_tokens"], 1);
    assert_eq!(d.status, StatusCode::OK);
    let d = d.json();
    check_response(&d, "tok tok tok tok");
    assert_eq!(responses_usage(&d), (FIRST_PROMPT, 4, 0, FIRST_PROMPT + 4));
    assert_eq!(again.status, StatusCode::BAD_REQUEST);
    let e = again.json();
    assert_eq!(e["error"]["type"], "kv_transfer_error");
    assert_eq!(e["error"]["code"], 400);
    let (_, d, _) = p_to_d(
        &w,
        "/v1/responses",
        VllmApi::Responses,
        &responses_turn1("pds", true),
    );
    assert_eq!(responses_stream(&d), (FIRST_PROMPT, 4, 0, FIRST_PROMPT + 4));
}

#[test]
fn the_decode_side_sidecar_prefills_both_apis_on_their_own_routes() {
    let w = Workers::start("1p1d", true);
    let p = w.addr(0).to_string();
    let header = [("x-prefiller-host-port", p.as_str())];
    let m = w.post(1, "/v1/messages", &header, &messages_turn1("shim", false));
    assert_eq!(m.status, StatusCode::OK);
    assert!(m.headers.get("x-kvc-prefill-failed").is_none());
    assert_eq!(messages_usage(&m.json()), (FIRST_PROMPT, 4, 0));
    let r = w.post(
        1,
        "/v1/responses",
        &header,
        &responses_turn1("shim-r", true),
    );
    assert!(r.headers.get("x-kvc-prefill-failed").is_none());
    assert_eq!(responses_stream(&r), (FIRST_PROMPT, 4, 0, FIRST_PROMPT + 4));
    // A header naming no known prefill worker: refused in the API's shape.
    let bad = [("x-prefiller-host-port", "127.0.0.1:1")];
    let m = w.post(1, "/v1/messages", &bad, &messages_turn1("x", false));
    assert_eq!(m.status, StatusCode::BAD_REQUEST);
    assert_eq!(m.json()["error"]["type"], "invalid_request_error");
    let r = w.post(1, "/v1/responses", &bad, &responses_turn1("x", false));
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
}

#[test]
fn malformed_bodies_are_refused_in_each_api_s_shape() {
    let w = Workers::start("1dp", false);
    let user = json!([{"role": "user", "content": "hi"}]);
    for (path, body, field) in [
        (
            "/v1/messages",
            json!({"model": "m", "messages": user}),
            "max_tokens",
        ),
        (
            "/v1/messages",
            json!({"model": "m", "max_tokens": "many", "messages": user}),
            "max_tokens",
        ),
        (
            "/v1/messages",
            json!({"model": "m", "max_tokens": 2,
                   "messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        (
            "/v1/messages",
            json!({"model": "m", "max_tokens": 2}),
            "messages",
        ),
        (
            "/v1/messages/count_tokens",
            json!({"model": "m"}),
            "messages",
        ),
        (
            "/v1/messages/count_tokens",
            json!({"model": "m", "system": 3, "messages": user}),
            "system",
        ),
    ] {
        let r = w.post(0, path, &[], &body);
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path} {body}");
        let e = r.json();
        assert_eq!(e["type"], "error", "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("`{field}`")),
            "{field}: {message}"
        );
    }
    for (body, field) in [
        (json!({"model": "m"}), "`input`"),
        (json!({"model": "m", "input": []}), "`input`"),
        (
            json!({"model": "m", "input": "hi", "max_output_tokens": -3}),
            "`max_output_tokens`",
        ),
        (
            json!({"model": "m", "input": [{"type": "message", "content": "x"}]}),
            "`input[0].role`",
        ),
        (
            json!({"model": "m", "input": "hi", "previous_response_id": "resp_1"}),
            "`previous_response_id`",
        ),
    ] {
        let r = w.post(0, "/v1/responses", &[], &body);
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert_eq!(e["error"]["code"], 400);
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{field}: {message}");
    }
    let r = w.post_raw(0, "/v1/messages", &[], Bytes::from_static(b"{not json"));
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not JSON")
    );
}

#[test]
fn a_failed_prefill_is_answered_in_the_messages_shape() {
    let w = Workers::start_with(
        "1p1d",
        false,
        Faults {
            fail_prefill: true,
            evict_before_plain: false,
        },
    );
    let body = nixl_prefill_body(
        messages_turn1("f", false).as_object().unwrap(),
        VllmApi::Messages,
    );
    let r = w.post(0, "/v1/messages", &[], &Value::Object(body));
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    let e = r.json();
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "api_error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("prefill failed")
    );
    // A decode worker given `do_remote_decode` cannot produce KV: 400.
    let body = nixl_prefill_body(
        responses_turn1("f", false).as_object().unwrap(),
        VllmApi::Responses,
    );
    let r = w.post(1, "/v1/responses", &[], &Value::Object(body));
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not a prefill worker")
    );
}
