//! The endpoint picker (`epp-listen`) against a tonic client playing Envoy's ext_proc filter
//! (FULL_DUPLEX_STREAMED): the exact answers for a P→D and a direct-to-D turn, a streamed
//! answer's usage chunk removed and judged, a body-less request, the subset hint, immediate
//! answers, a cut-off stream, large bodies in chunks, and the health services.

mod common;

use common::Cluster;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue as EnvoyHeader, Metadata,
};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, body_mutation,
    processing_request, processing_response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value as PbValue, value};
use kvc_core::{EngineKind, Health};
use kvc_router::RouterConfig;
use kvc_router::epp::{
    DESTINATION_HEADER, LB_NAMESPACE, MAX_CHUNK, PREFILLER_HEADER, SERVED_KEY, SUBSET_KEY,
    SUBSET_NAMESPACE,
};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

/// P0 at 10.0.0.1:8000, D1 at 10.0.0.2:8000, D2 at 10.0.0.3:8000: vLLM engines held to their
/// roles, no health checks (the picker never calls them; its client plays their answers).
async fn cluster() -> Cluster {
    cluster_with(false).await
}

/// [`cluster`], its engines allowed to serve a turn alone (`serve-alone`) or not.
async fn cluster_with(serve_alone: bool) -> Cluster {
    let c = Cluster::start(|cfg: &mut RouterConfig| {
        cfg.epp_listen = Some("127.0.0.1:0".parse().unwrap());
        cfg.http.health_check_interval_ms = 0;
        for w in &mut cfg.workers {
            w.http_url = Some(format!("http://10.0.0.{}:8000", w.id + 1));
            w.engine = Some(EngineKind::Vllm);
            w.serve_alone = Some(serve_alone);
        }
    })
    .await;
    c.wait_health(&[0, 1, 2], Health::Healthy).await;
    c
}

/// One ext_proc stream, as Envoy drives it.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(c: &Cluster) -> Stream {
        let addr = c.router.epp_addr().expect("the picker is served");
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel(64);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Stream { tx, rx }
    }

    async fn send(&self, request: processing_request::Request, meta: Option<Metadata>) {
        self.tx
            .send(ProcessingRequest {
                request: Some(request),
                metadata_context: meta,
                ..Default::default()
            })
            .await
            .unwrap();
    }

    async fn next(&mut self) -> processing_response::Response {
        tokio::time::timeout(common::EXCHANGE, self.rx.message())
            .await
            .expect("an answer in time")
            .unwrap()
            .expect("the stream is open")
            .response
            .unwrap()
    }

    async fn next_full(&mut self) -> ProcessingResponse {
        tokio::time::timeout(common::EXCHANGE, self.rx.message())
            .await
            .expect("an answer in time")
            .unwrap()
            .expect("the stream is open")
    }

    /// Sends the request headers and `body` (in two chunks when it has more than one byte).
    async fn request(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        meta: Option<Metadata>,
    ) {
        let mut all = vec![(":path", path), (":method", "POST")];
        all.extend_from_slice(headers);
        self.send(
            processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(envoy_headers(&all)),
                end_of_stream: false,
                ..Default::default()
            }),
            meta,
        )
        .await;
        let half = body.len() / 2;
        for (chunk, last) in [(&body[..half], false), (&body[half..], true)] {
            self.send(
                processing_request::Request::RequestBody(HttpBody {
                    body: chunk.to_vec(),
                    end_of_stream: last,
                    ..Default::default()
                }),
                None,
            )
            .await;
        }
    }

    /// Reads the headers answer and the body sent back.
    async fn decision(&mut self) -> Decided {
        let full = self.next_full().await;
        let Some(processing_response::Response::RequestHeaders(h)) = full.response else {
            panic!("not a headers answer: {full:?}");
        };
        let common = h.response.unwrap();
        let mutation = common.header_mutation.unwrap();
        let set: HashMap<String, String> = mutation
            .set_headers
            .iter()
            .map(|o| {
                let h = o.header.as_ref().unwrap();
                (
                    h.key.clone(),
                    String::from_utf8(h.raw_value.clone()).unwrap(),
                )
            })
            .collect();
        let mut body = Vec::new();
        let mut chunks = Vec::new();
        loop {
            let processing_response::Response::RequestBody(b) = self.next().await else {
                panic!("not a body answer");
            };
            let Some(body_mutation::Mutation::StreamedResponse(s)) =
                b.response.unwrap().body_mutation.unwrap().mutation
            else {
                panic!("not a streamed body");
            };
            chunks.push(s.body.len());
            body.extend_from_slice(&s.body);
            if s.end_of_stream {
                break;
            }
        }
        Decided {
            clear_route_cache: common.clear_route_cache,
            set,
            removed: mutation.remove_headers,
            metadata: full.dynamic_metadata,
            body,
            chunks,
        }
    }

    /// Plays the answer: `status`, `content_type`, the body in `pieces`; returns the headers
    /// set on the answer and the body echoed back.
    async fn answer(
        &mut self,
        status: u16,
        content_type: &str,
        pieces: &[&[u8]],
        served: Option<&str>,
    ) -> (HashMap<String, String>, Vec<u8>) {
        let meta = served.map(|s| metadata(LB_NAMESPACE, SERVED_KEY, string(s)));
        let status = status.to_string();
        self.send(
            processing_request::Request::ResponseHeaders(HttpHeaders {
                headers: Some(envoy_headers(&[
                    (":status", &status),
                    ("content-type", content_type),
                ])),
                end_of_stream: false,
                ..Default::default()
            }),
            meta,
        )
        .await;
        let processing_response::Response::ResponseHeaders(h) = self.next().await else {
            panic!("not a response headers answer");
        };
        let set = h
            .response
            .and_then(|c| c.header_mutation)
            .map(|m| {
                m.set_headers
                    .iter()
                    .map(|o| {
                        let h = o.header.as_ref().unwrap();
                        (
                            h.key.clone(),
                            String::from_utf8(h.raw_value.clone()).unwrap(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut echoed = Vec::new();
        for (i, piece) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len();
            self.send(
                processing_request::Request::ResponseBody(HttpBody {
                    body: piece.to_vec(),
                    end_of_stream: last,
                    ..Default::default()
                }),
                None,
            )
            .await;
            let processing_response::Response::ResponseBody(b) = self.next().await else {
                panic!("not a response body answer");
            };
            let Some(body_mutation::Mutation::StreamedResponse(s)) =
                b.response.unwrap().body_mutation.unwrap().mutation
            else {
                panic!("not a streamed body");
            };
            assert_eq!(s.end_of_stream, last);
            echoed.extend_from_slice(&s.body);
        }
        (set, echoed)
    }
}

struct Decided {
    clear_route_cache: bool,
    set: HashMap<String, String>,
    removed: Vec<String>,
    metadata: Option<Struct>,
    body: Vec<u8>,
    chunks: Vec<usize>,
}

impl Decided {
    /// The pick in the `envoy.lb` dynamic metadata.
    fn metadata_pick(&self) -> String {
        let ns = &self.metadata.as_ref().unwrap().fields[LB_NAMESPACE];
        let Some(value::Kind::StructValue(s)) = &ns.kind else {
            panic!("envoy.lb is not a struct");
        };
        let Some(value::Kind::StringValue(v)) = &s.fields[DESTINATION_HEADER].kind else {
            panic!("the pick is not a string");
        };
        v.clone()
    }
}

fn envoy_headers(pairs: &[(&str, &str)]) -> EnvoyHeaders {
    EnvoyHeaders {
        headers: pairs
            .iter()
            .map(|(k, v)| EnvoyHeader {
                key: (*k).to_owned(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}

fn string(s: &str) -> PbValue {
    PbValue {
        kind: Some(value::Kind::StringValue(s.to_owned())),
    }
}

fn metadata(namespace: &str, key: &str, v: PbValue) -> Metadata {
    let mut m = Metadata::default();
    m.filter_metadata.insert(
        namespace.to_owned(),
        Struct {
            fields: [(key.to_owned(), v)].into_iter().collect(),
        },
    );
    m
}

fn words(n: u32) -> String {
    (0..n)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn outcomes(c: &Cluster, outcome: &str) -> f64 {
    let samples = common::parse_prometheus(&c.service().render_metrics());
    common::value(
        &samples,
        "kvc_router_outcomes_total",
        &[("outcome", outcome)],
    )
}

async fn settle(c: &Cluster) {
    for _ in 0..500 {
        if c.service().pending_decisions() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("an outcome was never reported");
}

#[tokio::test]
async fn a_p_to_d_turn_then_a_direct_turn_are_picked_answered_and_judged() {
    let c = cluster().await;
    // Turn 1: P→D. A client's own prefiller header and router-only fields are not kept.
    let mut s = Stream::open(&c).await;
    let sent = json!({"model": "m", "prompt": words(1_300), "max_tokens": 8,
        "kv_transfer_params": {"remote_host": "evil"}});
    s.request(
        "/v1/completions",
        &[
            ("x-session-id", "agent-1"),
            (PREFILLER_HEADER, "6.6.6.6:80"),
        ],
        sent.to_string().as_bytes(),
        None,
    )
    .await;
    let d = s.decision().await;
    assert!(d.clear_route_cache);
    let decode = d.set[DESTINATION_HEADER].clone();
    assert!(
        ["10.0.0.2:8000", "10.0.0.3:8000"].contains(&decode.as_str()),
        "{decode}"
    );
    assert_eq!(d.metadata_pick(), decode, "the same pick twice");
    assert_eq!(d.set[PREFILLER_HEADER], "10.0.0.1:8000");
    assert_eq!(d.set["x-session-id"], "agent-1");
    let want = json!({"model": "m", "prompt": words(1_300), "max_tokens": 8});
    assert_eq!(serde_json::from_slice::<Value>(&d.body).unwrap(), want);
    assert_eq!(d.set["content-length"], d.body.len().to_string());
    let answer = json!({"choices": [{"text": "a b"}], "usage": {"prompt_tokens": 1_300,
        "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}})
    .to_string();
    let (set, echoed) = s
        .answer(200, "application/json", &[answer.as_bytes()], Some(&decode))
        .await;
    assert_eq!(echoed, answer.as_bytes());
    assert_eq!(set["x-kvc-mode"], "turn1-seed");
    assert_eq!(set["x-kvc-prefill-worker"], "0");
    assert_eq!(set["x-kvc-session"], "agent-1");
    drop(s);
    settle(&c).await;
    assert_eq!(outcomes(&c, "ok"), 1.0);

    // Turn 2: direct-to-D on the same decode worker, streamed: no prefiller header (a
    // client's is removed), the usage chunk asked for, and removed from the client's stream.
    let mut s = Stream::open(&c).await;
    let sent = json!({"prompt": words(1_900), "max_tokens": 8, "stream": true});
    s.request(
        "/v1/completions",
        &[
            ("x-session-id", "agent-1"),
            (PREFILLER_HEADER, "10.0.0.1:8000"),
        ],
        sent.to_string().as_bytes(),
        None,
    )
    .await;
    let d = s.decision().await;
    assert_eq!(d.set[DESTINATION_HEADER], decode);
    assert!(!d.set.contains_key(PREFILLER_HEADER));
    assert_eq!(d.removed, [PREFILLER_HEADER]);
    let mut want = sent.clone();
    want["stream_options"] = json!({"include_usage": true});
    assert_eq!(serde_json::from_slice::<Value>(&d.body).unwrap(), want);
    let events = [
        "data: {\"choices\":[{\"text\":\"a\"}]}\n\n".to_owned(),
        "data: {\"choices\":[{\"text\":\" b\"}]}\n\n".to_owned(),
        format!(
            "data: {}\n\ndata: [DONE]\n\n",
            json!({"choices": [], "usage": {"prompt_tokens": 1_900, "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 0}}})
        ),
    ];
    let pieces: Vec<&[u8]> = events.iter().map(|e| e.as_bytes()).collect();
    let (set, echoed) = s
        .answer(200, "text/event-stream", &pieces, Some(&decode))
        .await;
    assert_eq!(set["x-kvc-mode"], "direct-to-d");
    assert_eq!(
        String::from_utf8(echoed).unwrap(),
        format!("{}{}data: [DONE]\n\n", events[0], events[1]),
        "the usage chunk the client did not ask for is removed"
    );
    drop(s);
    settle(&c).await;
    // D said it served none of the session from its cache: a miss, not `ok`.
    assert_eq!(outcomes(&c, "direct-cache-miss"), 1.0);
    assert_eq!(outcomes(&c, "ok"), 1.0);
}

#[tokio::test]
async fn body_less_requests_subsets_and_refusals() {
    let mut c = cluster().await;
    // No body: any routable decode worker, nothing decided.
    let mut s = Stream::open(&c).await;
    s.send(
        processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(envoy_headers(&[(":path", "/health"), (":method", "GET")])),
            end_of_stream: true,
            ..Default::default()
        }),
        None,
    )
    .await;
    let processing_response::Response::RequestHeaders(h) = s.next().await else {
        panic!("a body-less request gets a headers answer");
    };
    let set = &h.response.unwrap().header_mutation.unwrap().set_headers;
    let pick = String::from_utf8(set[0].header.as_ref().unwrap().raw_value.clone()).unwrap();
    assert!(
        ["10.0.0.2:8000", "10.0.0.3:8000"].contains(&pick.as_str()),
        "{pick}"
    );
    drop(s);

    // A subset hint with D2 only: D2.
    let subset = PbValue {
        kind: Some(value::Kind::ListValue(ListValue {
            values: vec![string("10.0.0.1:8000"), string("10.0.0.3:8000")],
        })),
    };
    let mut s = Stream::open(&c).await;
    let body = json!({"prompt": words(600), "max_tokens": 4}).to_string();
    s.request(
        "/v1/completions",
        &[("x-session-id", "agent-2")],
        body.as_bytes(),
        Some(metadata(SUBSET_NAMESPACE, SUBSET_KEY, subset)),
    )
    .await;
    let d = s.decision().await;
    assert_eq!(d.set[DESTINATION_HEADER], "10.0.0.3:8000");
    // Cut off before any answer: reported, as failed.
    drop(s);
    settle(&c).await;
    assert_eq!(outcomes(&c, "worker-failed"), 1.0);

    // A subset of unknown endpoints: 503.
    let mut s = Stream::open(&c).await;
    s.request(
        "/v1/completions",
        &[],
        body.as_bytes(),
        Some(metadata(SUBSET_NAMESPACE, SUBSET_KEY, string("10.9.9.9:1"))),
    )
    .await;
    let immediate = |r: processing_response::Response| {
        let processing_response::Response::ImmediateResponse(i) = r else {
            panic!("not an immediate answer: {r:?}");
        };
        let body: Value = serde_json::from_slice(&i.body).unwrap();
        (i.status.unwrap().code, body)
    };
    let (code, body503) = immediate(s.next().await);
    assert_eq!(code, 503);
    assert_eq!(body503["error"]["code"], 503);
    drop(s);

    // A body the front would refuse: its 400.
    let mut s = Stream::open(&c).await;
    s.request("/v1/completions", &[], b"{\"max_tokens\": 3}", None)
        .await;
    let (code, body400) = immediate(s.next().await);
    assert_eq!(code, 400);
    assert!(
        body400["error"]["message"]
            .as_str()
            .unwrap()
            .contains("missing `prompt`"),
        "{body400}"
    );
    drop(s);

    // A body over 62,000 bytes goes back in chunks, whole.
    let mut s = Stream::open(&c).await;
    let big = json!({"prompt": words(20_000), "max_tokens": 4}).to_string();
    assert!(big.len() > 2 * MAX_CHUNK);
    s.request(
        "/v1/completions",
        &[("x-session-id", "agent-3")],
        big.as_bytes(),
        None,
    )
    .await;
    let d = s.decision().await;
    assert!(d.chunks.iter().all(|n| *n <= MAX_CHUNK), "{:?}", d.chunks);
    assert_eq!(d.chunks.len(), big.len().div_ceil(MAX_CHUNK));
    assert_eq!(
        serde_json::from_slice::<Value>(&d.body).unwrap(),
        serde_json::from_str::<Value>(&big).unwrap()
    );
    drop(s);
    settle(&c).await;

    // Every worker stale: a request with a body is routed on the state last known (a late
    // publisher is not a dead worker), and counted; one without, which no decision places,
    // finds no ready endpoint: 503.
    c.clock.advance(common::STALE_MS * 3);
    c.heartbeat(&[]);
    c.wait_health(&[0, 1, 2], Health::Stale).await;
    let mut s = Stream::open(&c).await;
    s.request("/v1/completions", &[], body.as_bytes(), None)
        .await;
    let d = s.decision().await;
    assert!(!d.set[DESTINATION_HEADER].is_empty());
    assert_eq!(c.service().metrics().stale_routed(), 1);
    drop(s);
    settle(&c).await;
    let mut s = Stream::open(&c).await;
    s.send(
        processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(envoy_headers(&[
                (":path", "/v1/models"),
                (":method", "GET"),
            ])),
            end_of_stream: true,
            ..Default::default()
        }),
        None,
    )
    .await;
    assert_eq!(immediate(s.next().await).0, 503);
}

/// The status of `service` (-1 when the check fails).
async fn health_status(
    client: &mut tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>,
    service: &str,
) -> i32 {
    client
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .map(|r| r.into_inner().status)
        .unwrap_or(-1)
}

/// Waits (bounded) until `service` reports `want`; returns the last status seen.
async fn wait_status(
    client: &mut tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>,
    service: &str,
    want: i32,
) -> i32 {
    let mut last = -1;
    for _ in 0..50 {
        last = health_status(client, service).await;
        if last == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    last
}

#[tokio::test]
async fn the_health_services_follow_liveness_and_readiness() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let mut c = cluster().await;
    let addr = c.router.epp_addr().unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let serving = ServingStatus::Serving as i32;
    assert_eq!(
        wait_status(&mut health, "readiness", serving).await,
        serving
    );
    assert_eq!(health_status(&mut health, "liveness").await, serving);
    assert_eq!(
        health_status(&mut health, "envoy.service.ext_proc.v3.ExternalProcessor").await,
        serving
    );
    // Every worker stale: not ready, still live.
    c.clock.advance(common::STALE_MS * 3);
    c.heartbeat(&[]);
    c.wait_health(&[0, 1, 2], Health::Stale).await;
    let not_serving = ServingStatus::NotServing as i32;
    assert_eq!(
        wait_status(&mut health, "readiness", not_serving).await,
        not_serving
    );
    assert_eq!(health_status(&mut health, "liveness").await, serving);
}

#[tokio::test]
async fn the_picker_reads_the_coding_agents_session_headers() {
    let c = cluster().await;
    let answer = |n: u64| {
        json!({"choices": [{"text": "a b"}], "usage": {"prompt_tokens": n,
            "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}})
        .to_string()
    };
    // Claude Code's session header names the session the picker routes and forwards.
    let mut s = Stream::open(&c).await;
    let sent = json!({"prompt": words(1_300), "max_tokens": 8});
    s.request(
        "/v1/completions",
        &[("X-Claude-Code-Session-Id", "cc-7")],
        sent.to_string().as_bytes(),
        None,
    )
    .await;
    let d = s.decision().await;
    assert_eq!(d.set["x-session-id"], "cc-7");
    assert!(
        d.set.contains_key(PREFILLER_HEADER),
        "a first turn goes P→D"
    );
    let decode = d.set[DESTINATION_HEADER].clone();
    let (set, _) = s
        .answer(
            200,
            "application/json",
            &[answer(1_300).as_bytes()],
            Some(&decode),
        )
        .await;
    assert_eq!(set["x-kvc-session"], "cc-7");
    drop(s);
    settle(&c).await;

    // Its next turn goes direct to the same D; a subagent of the session is its own.
    let mut s = Stream::open(&c).await;
    let sent = json!({"prompt": words(1_900), "max_tokens": 8});
    s.request(
        "/v1/completions",
        &[("x-claude-code-session-id", "cc-7")],
        sent.to_string().as_bytes(),
        None,
    )
    .await;
    let d = s.decision().await;
    assert_eq!(d.set[DESTINATION_HEADER], decode);
    assert!(!d.set.contains_key(PREFILLER_HEADER), "direct to D");
    drop(s);

    let mut s = Stream::open(&c).await;
    s.request(
        "/v1/completions",
        &[
            ("x-claude-code-session-id", "cc-7"),
            ("x-claude-code-agent-id", "a1"),
        ],
        sent.to_string().as_bytes(),
        None,
    )
    .await;
    let d = s.decision().await;
    assert_eq!(d.set["x-session-id"], "cc-7/agent/a1");
    assert!(
        d.set.contains_key(PREFILLER_HEADER),
        "the subagent's first turn"
    );
}

#[tokio::test]
async fn the_picker_places_a_subagent_on_its_parents_d_and_ends_a_marked_session() {
    // vLLM engines that may serve a turn alone: a D can take a session it has no KV of.
    let c = cluster_with(true).await;
    let answer = |n: u64, cached: u64| {
        json!({"choices": [{"text": "a b"}], "usage": {"prompt_tokens": n,
            "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": cached}}})
        .to_string()
    };
    let turn = |headers: &'static [(&'static str, &'static str)], prompt: String| {
        let c = &c;
        async move {
            let mut s = Stream::open(c).await;
            let sent = json!({"prompt": prompt, "max_tokens": 8});
            s.request(
                "/v1/completions",
                headers,
                sent.to_string().as_bytes(),
                None,
            )
            .await;
            let d = s.decision().await;
            (s, d)
        }
    };
    // The parent, a Codex thread.
    let (mut s, d) = turn(&[("thread-id", "th-1")], words(1_300)).await;
    let parent_d = d.set[DESTINATION_HEADER].clone();
    s.answer(
        200,
        "application/json",
        &[answer(1_300, 0).as_bytes()],
        Some(&parent_d),
    )
    .await;
    drop(s);
    settle(&c).await;
    // Its subagent shares the parent's first two blocks: an append on the parent's D.
    let child = format!("{} {}", words(1_024), "x ".repeat(300).trim_end());
    let (mut s, d) = turn(
        &[("thread-id", "th-2"), ("x-codex-parent-thread-id", "th-1")],
        child,
    )
    .await;
    assert_eq!(d.set[DESTINATION_HEADER], parent_d);
    assert!(!d.set.contains_key(PREFILLER_HEADER), "direct to D");
    assert_eq!(d.set["x-session-id"], "th-2");
    s.answer(
        200,
        "application/json",
        &[answer(1_324, 1_024).as_bytes()],
        Some(&parent_d),
    )
    .await;
    drop(s);
    settle(&c).await;
    // The parent's last turn, marked so: once answered, the router forgets the session.
    let th1 = kvc_core::SessionId::from_key("th-1");
    assert!(c.service().knows_session(th1));
    let (mut s, d) = turn(
        &[("thread-id", "th-1"), ("x-session-final", "true")],
        words(1_900),
    )
    .await;
    assert_eq!(d.set[DESTINATION_HEADER], parent_d);
    s.answer(
        200,
        "application/json",
        &[answer(1_900, 1_024).as_bytes()],
        Some(&parent_d),
    )
    .await;
    drop(s);
    settle(&c).await;
    assert!(!c.service().knows_session(th1), "ended by x-session-final");
    let samples = common::parse_prometheus(&c.service().render_metrics());
    assert_eq!(
        common::value(
            &samples,
            "kvc_router_sessions_forgotten_total",
            &[("cause", "ended")]
        ),
        1.0
    );
    assert_eq!(
        common::value(
            &samples,
            "kvc_router_http_subagent_sessions_total",
            &[("parent", "header")]
        ),
        1.0
    );
}

/// `n` words tagged `tag` (`tag0 tag1 …`): prompts of different tags share no block.
fn tagged(tag: &str, n: u32) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One completion through the picker with `headers`, answered by the picked worker (its
/// usage `prompt_tokens` and `cached`); the decode worker's id and the answer's headers.
async fn picked(
    c: &Cluster,
    headers: &[(&str, &str)],
    prompt: String,
    prompt_tokens: u64,
    cached: u64,
) -> (u32, HashMap<String, String>) {
    let mut s = Stream::open(c).await;
    let sent = json!({"prompt": prompt, "max_tokens": 8});
    s.request(
        "/v1/completions",
        headers,
        sent.to_string().as_bytes(),
        None,
    )
    .await;
    let d = s.decision().await;
    let dest = d.set[DESTINATION_HEADER].clone();
    let answer = json!({"choices": [{"text": "a b"}], "usage": {"prompt_tokens": prompt_tokens,
        "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": cached}}})
    .to_string();
    let (set, _) = s
        .answer(200, "application/json", &[answer.as_bytes()], Some(&dest))
        .await;
    drop(s);
    settle(c).await;
    (set["x-kvc-decode-worker"].parse().unwrap(), set)
}

#[tokio::test]
async fn the_picker_moves_a_compacted_session_off_a_busy_worker_and_releases_it() {
    let mut c = cluster().await;
    let key = [("x-session-id", "cmp-1")];
    let history = |n: u32| format!("{} {}", tagged("sys", 2_048), tagged("h", n));
    let (old_d, set) = picked(&c, &key, history(10_000), 12_048, 0).await;
    assert_eq!(set["x-kvc-mode"], "turn1-seed");
    let (d, set) = picked(&c, &key, history(10_400), 12_448, 12_048).await;
    assert_eq!((set["x-kvc-mode"].as_str(), d), ("direct-to-d", old_d));
    let session = kvc_core::SessionId::from_key("cmp-1");
    let before = c.service().session_view(session).unwrap();
    assert_eq!(before.decode, Some(kvc_core::WorkerId(old_d)));
    assert_eq!(before.held_blocks, before.blocks);
    // Its D gets busy, then the agent summarises: a fresh seed on the other D.
    c.publish(old_d, common::CAPACITY * 6 / 10, common::CAPACITY * 4 / 10);
    for _ in 0..200 {
        if c.service().worker_views()[old_d as usize].state.used_tokens > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let summary = format!("{} {}", tagged("sys", 2_048), tagged("s", 8_600));
    let (new_d, set) = picked(&c, &key, summary, 10_648, 2_048).await;
    assert_eq!(
        (set["x-kvc-mode"].as_str(), set["x-kvc-reason"].as_str()),
        ("fallback", "compacted")
    );
    assert_ne!(new_d, old_d);
    let after = c.service().session_view(session).unwrap();
    assert_eq!(
        (after.decode, after.moves, after.residency),
        (
            Some(kvc_core::WorkerId(new_d)),
            1,
            kvc_policy::Residency::Resident
        )
    );
    assert!(after.blocks < before.blocks, "{after:?} after {before:?}");
    assert_eq!(after.held_blocks, after.blocks);
    // The old D, idle again, takes the next session.
    c.publish(old_d, 0, common::CAPACITY);
    for _ in 0..200 {
        if c.service().worker_views()[old_d as usize].state.used_tokens == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (d, set) = picked(
        &c,
        &[("x-session-id", "next")],
        tagged("n", 1_300),
        1_300,
        0,
    )
    .await;
    assert_eq!((set["x-kvc-mode"].as_str(), d), ("turn1-seed", old_d));
    assert_eq!(
        outcomes(&c, "ok"),
        4.0,
        "every turn answered and judged served"
    );
}

#[tokio::test]
async fn the_picker_gives_an_ended_sessions_worker_to_the_next_session() {
    let c = cluster().await;
    let mut placed = Vec::new();
    for key in ["a", "b", "c"] {
        let (d, set) = picked(&c, &[("x-session-id", key)], tagged(key, 1_300), 1_300, 0).await;
        assert_eq!(set["x-kvc-mode"], "turn1-seed");
        placed.push((key, d));
    }
    assert_ne!(placed[0].1, placed[1].1, "two active sessions are spread");
    let busy = if placed[2].1 == placed[0].1 {
        placed[0].1
    } else {
        placed[1].1
    };
    // The two sessions on the busy D end, each with its last turn marked so.
    for (key, d) in placed.iter().filter(|(_, d)| *d == busy) {
        let last = format!("{} {}", tagged(key, 1_300), tagged("x", 200));
        let (d2, set) = picked(
            &c,
            &[("x-session-id", key), ("x-session-final", "true")],
            last,
            1_500,
            1_024,
        )
        .await;
        assert_eq!((set["x-kvc-mode"].as_str(), d2), ("direct-to-d", *d));
        assert!(
            !c.service()
                .knows_session(kvc_core::SessionId::from_key(key))
        );
    }
    let samples = common::parse_prometheus(&c.service().render_metrics());
    assert_eq!(
        common::value(
            &samples,
            "kvc_router_sessions_forgotten_total",
            &[("cause", "ended")]
        ),
        2.0
    );
    // The next session goes where the ended ones were, not beside the live one.
    let (d, set) = picked(&c, &[("x-session-id", "e")], tagged("e", 1_300), 1_300, 0).await;
    assert_eq!((set["x-kvc-mode"].as_str(), d), ("turn1-seed", busy));
}
