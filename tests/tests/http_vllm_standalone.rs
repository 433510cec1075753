//! Standalone simulated vLLM workers (`kvc-replay workers`) behind the `kvc-router` binary,
//! each a separate process on loopback, driven by a plain HTTP client with chat prompts of its
//! own (no trace): a conversation's first turn goes through P, its second is served
//! direct-to-D with the tokens the first left on D reported cached, streaming and not, with
//! the session named by `x-session-id` or inferred by the router; the workers' KV events name
//! sessions by the client's key; bad requests get clear 4xx answers.
#![forbid(unsafe_code)]

mod common;

use common::http::{Answer, post};
use common::{Guard, bin_dir, free_port, http_get, wait_for_ready_file};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Reads one answer with a `Content-Length` body from a kept-alive connection: status and
/// JSON body.
fn read_answer(conn: &mut TcpStream) -> (u16, Value) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        conn.read_exact(&mut byte).expect("an answer head");
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().unwrap())
        })
        .expect("a Content-Length");
    let mut body = vec![0u8; length];
    conn.read_exact(&mut body).unwrap();
    (status, serde_json::from_slice(&body).unwrap())
}

/// A conversation of `turns` user turns, each answered with `answer`: the messages of its
/// last turn.
fn conversation(topic: &str, turns: usize, answer: &str) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content":
        "You are a careful assistant who answers questions about software engineering, \
         explains each step of the reasoning, cites the files it changed, and keeps every \
         answer short enough to read in one minute without scrolling back and forth."})];
    for t in 0..turns {
        if t > 0 {
            m.push(json!({"role": "assistant", "content": answer}));
        }
        m.push(json!({"role": "user", "content":
            format!("Question {t} about {topic}: which module parses the configuration file, \
                     and what happens when a key is missing or has the wrong type there?")}));
    }
    m
}

/// Cached tokens and completion text of an answer (whole or streamed).
fn usage_and_text(a: &Answer, stream: bool) -> (u64, u64, String) {
    let (usage, text) = if stream {
        let events = a.events();
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{}",
            a.body
        );
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        let usage = chunks
            .iter()
            .find(|c| c["choices"].as_array().is_some_and(Vec::is_empty))
            .map(|c| c["usage"].clone())
            .expect("a usage chunk");
        (usage, text)
    } else {
        let v = a.json();
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        (v["usage"].clone(), text)
    };
    (
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
        text,
    )
}

/// Two turns of one conversation through the router: the modes and cached tokens of each.
fn two_turns(router: &str, topic: &str, session: Option<&str>, stream: bool) -> [(String, u64); 2] {
    let mut headers = Vec::new();
    if let Some(s) = session {
        headers.push(("x-session-id", s));
    }
    let mut answer = String::new();
    let mut out = Vec::new();
    for turn in 1..=2 {
        let mut body = json!({"model": "sim", "messages": conversation(topic, turn, &answer),
            "max_tokens": 12, "stream": stream});
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let a = post(router, "/v1/chat/completions", &headers, &body.to_string());
        assert_eq!(a.status, 200, "turn {turn}: {}", a.body);
        let (cached, completion, text) = usage_and_text(&a, stream);
        assert_eq!(completion, 12);
        assert_eq!(text.split_whitespace().count(), 12, "{text}");
        answer = text;
        out.push((a.find_header("x-kvc-mode").unwrap_or("").to_owned(), cached));
    }
    [out[0].clone(), out[1].clone()]
}

#[test]
fn a_client_s_own_chat_is_served_direct_to_d_on_its_second_turn() {
    let bins = bin_dir();
    let dir = std::env::temp_dir().join(format!("kvc-standalone-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let http = format!("127.0.0.1:{}", free_port());
    let (config, ready) = (dir.join("router.toml"), dir.join("ready.json"));
    let mut workers = Guard(
        Command::new(bins.join("kvc-replay"))
            .args([
                "workers",
                "--topology",
                "1p3d",
                "--speedup",
                "20",
                "--kv-events",
            ])
            // Workers held to their roles: a first turn goes through P (NixlConnector's two
            // calls), not to a decode worker alone.
            .args(["--local-prefill", "off"])
            .args(["--duration-s", "300", "--router-http-listen", &http])
            .args(["--router-listen", "127.0.0.1:0"])
            .args(["--router-metrics-listen", "127.0.0.1:0"])
            .arg("--snapshot-dir")
            .arg(dir.join("snap"))
            .arg("--ready-file")
            .arg(&ready)
            .arg("--write-router-config")
            .arg(&config)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for_ready_file(&mut workers.0, &ready);
    // The addresses printed: one line per worker, with its engine signals.
    let mut printed = String::new();
    let mut stdout = workers.0.stdout.take().unwrap();
    let mut buf = [0u8; 4096];
    while printed.lines().count() < 4 {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "the workers printed {printed:?}");
        printed.push_str(std::str::from_utf8(&buf[..n]).unwrap());
    }
    let lines: Vec<&str> = printed.lines().collect();
    assert!(
        lines[0].starts_with("p0 prefill http://127.0.0.1:"),
        "{printed}"
    );
    assert!(
        lines[3].starts_with("d2 decode http://127.0.0.1:"),
        "{printed}"
    );
    assert!(
        lines.iter().all(|l| l.contains(" metrics=http://")),
        "{printed}"
    );
    let ready_json: Value =
        serde_json::from_str(&std::fs::read_to_string(&ready).unwrap()).unwrap();
    let urls: Vec<String> = ready_json["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            w["url"]
                .as_str()
                .unwrap()
                .trim_start_matches("http://")
                .to_owned()
        })
        .collect();
    assert_eq!(urls.len(), 4);
    let toml = std::fs::read_to_string(&config).unwrap();
    assert!(toml.contains("engine = \"vllm\""), "{toml}");
    assert!(toml.contains("block-size = 16"), "{toml}");

    let _router = Guard(
        Command::new(bins.join("kvc-router"))
            .arg("--config")
            .arg(&config)
            .args(["--log", "warn"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let up = TcpStream::connect(&http).is_ok() && http_get(&http, "/health").contains(" 200 ");
        if up {
            break;
        }
        assert!(Instant::now() < deadline, "the router never became ready");
        std::thread::sleep(Duration::from_millis(200));
    }

    // Keyed sessions, whole answers and streams: turn 1 through P, turn 2 direct to D with
    // what turn 1 left there reported cached.
    // A later conversation's first turn finds the shared system prompt's full blocks (two
    // of 16 tokens) in P's prefix cache, as vLLM's prefix caching does.
    for (session, stream, shared) in [("conv-a", false, 0), ("conv-b", true, 32)] {
        let [(m1, c1), (m2, c2)] = two_turns(&http, session, Some(session), stream);
        assert_eq!((m1.as_str(), c1), ("turn1-seed", shared), "{session}");
        assert_eq!(m2, "direct-to-d", "{session}");
        assert!(c2 >= 64, "{session}: {c2} cached tokens");
    }
    // No session header: the router infers the session from the prompt's prefix.
    let [(m1, c1), (m2, c2)] = two_turns(&http, "inferred", None, false);
    assert_eq!((m1.as_str(), c1), ("turn1-seed", 32));
    assert_eq!(m2, "direct-to-d");
    assert!(c2 >= 64, "{c2} cached tokens");

    // Bad requests: clear 4xx answers with JSON errors, from the router and from a worker.
    let chat = "/v1/chat/completions";
    let a = post(&http, chat, &[], "{not json");
    assert_eq!(a.status, 400);
    assert!(a.json()["error"]["message"].is_string(), "{}", a.body);
    let d0 = urls[1].as_str();
    for (path, body, want) in [
        (chat, r#"{"messages": []}"#, "is empty"),
        (chat, r#"{"messages": [{"content": "hi"}]}"#, "role"),
        (
            chat,
            r#"{"messages": [{"role": "user", "content": "  "}]}"#,
            "",
        ),
        ("/v1/completions", r#"{"prompt": ""}"#, "empty"),
        (
            "/v1/completions",
            r#"{"prompt": {"a": 1}}"#,
            "`prompt` must be",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "a", "max_tokens": "x"}"#,
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "a", "stream_options": {}}"#,
            "stream",
        ),
    ] {
        let a = post(d0, path, &[], body);
        if want.is_empty() {
            // A chat of blank messages still has the template's tokens: served.
            assert_eq!(a.status, 200, "{body}: {}", a.body);
            continue;
        }
        assert_eq!(a.status, 400, "{body}: {}", a.body);
        let msg = a.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(msg.contains(want), "{body}: {msg}");
    }
    let long = "w ".repeat(100_000);
    let a = post(
        d0,
        "/v1/completions",
        &[],
        &json!({"prompt": long}).to_string(),
    );
    assert_eq!(a.status, 400);
    assert_eq!(a.json()["error"]["type"], "input_too_long");
    // A token-id prompt, straight to a decode worker: served in full there.
    let a = post(
        d0,
        "/v1/completions",
        &[],
        r#"{"prompt": [1, 2, 3], "max_tokens": 2}"#,
    );
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.json()["usage"]["prompt_tokens"], 3);
    assert_eq!(a.json()["choices"][0]["text"], "tok tok");
    // A route the workers do not serve (vllm-router asks P for /v1/completions/render) is a
    // 404 that reads the body, so the connection stays usable for the next request.
    let mut conn = TcpStream::connect(d0).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut answers = Vec::new();
    for (path, body) in [
        ("/v1/completions/render", r#"{"prompt": "a b c"}"#),
        ("/v1/completions", r#"{"prompt": "a b c", "max_tokens": 1}"#),
    ] {
        write!(
            conn,
            "POST {path} HTTP/1.1\r\nHost: {d0}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        answers.push(read_answer(&mut conn));
    }
    assert_eq!(answers[0].0, 404);
    assert_eq!(
        (answers[1].0, answers[1].1["usage"]["prompt_tokens"].clone()),
        (200, json!(3))
    );
    // What a vLLM server also answers.
    assert!(http_get(d0, "/v1/models").contains("\"object\":\"list\""));
    assert!(http_get(d0, "/health").contains(" 200 "));
    let metrics_url = lines[1]
        .split(' ')
        .find_map(|f| f.strip_prefix("metrics=http://"))
        .unwrap();
    let (addr, path) = metrics_url.split_once('/').unwrap();
    let metrics = http_get(addr, &format!("/{path}"));
    assert!(metrics.contains("vllm:num_requests_running"), "{metrics}");
    let _ = std::fs::remove_dir_all(&dir);
}
