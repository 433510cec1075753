//! Event sources read from the engine: a vLLM worker configured with `engine` and `http-url`
//! only asks `GET /kv_event_sources` where its KV-cache events are, subscribes there (a
//! wildcard bind host replaced by the worker's host) and indexes them; an engine that is not
//! up yet, answers 404 or garbage, has no events, or is unreachable is listed with what is
//! wrong and asked again, never a panic.

mod common;

use axum::http::StatusCode;
use axum::routing::get;
use common::Cluster;
use kvc_core::Health;
use kvc_router::{ListedWorker, RouterConfig};
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// What a mock vLLM answers on `/kv_event_sources`.
type Answer = Arc<Mutex<(StatusCode, String)>>;

const METRICS: &str = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n\
     vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0\n\
     vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0\n\
     vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"5750\"} 1.0\n";

/// A mock vLLM HTTP server on `listener`: `/metrics` as vLLM's, `/kv_event_sources` as set,
/// `/v1/models` listing model `m`.
async fn mock_vllm(listener: tokio::net::TcpListener, sources: (StatusCode, String)) -> Answer {
    mock_vllm_serving(listener, sources, "m").await
}

/// [`mock_vllm`] serving `model`.
async fn mock_vllm_serving(
    listener: tokio::net::TcpListener,
    sources: (StatusCode, String),
    model: &str,
) -> Answer {
    let answer: Answer = Arc::new(Mutex::new(sources));
    let shared = Arc::clone(&answer);
    let models = format!(
        "{{\"object\":\"list\",\"data\":[{{\"id\":\"{model}\",\"object\":\"model\",\"max_model_len\":16384}}]}}"
    );
    let app = axum::Router::new()
        .route("/metrics", get(|| async { METRICS }))
        .route("/v1/models", get(move || async move { models }))
        .route(
            "/kv_event_sources",
            get(move || {
                let shared = Arc::clone(&shared);
                async move { shared.lock().clone() }
            }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await });
    answer
}

async fn listener() -> (tokio::net::TcpListener, SocketAddr) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr)
}

/// vLLM's answer for one rank publishing on `tcp://*:PORT` with a replay socket.
fn sources(events: &str, replay: &str, topic: &str) -> String {
    let port = |e: &str| e.rsplit(':').next().unwrap().to_owned();
    format!(
        "{{\"0\": {{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \
         \"endpoint\": \"tcp://*:{}\", \"replay_endpoint\": \"tcp://*:{}\", \
         \"buffer_steps\": 10000, \"hwm\": 100000, \"max_queue_size\": 100000, \
         \"topic\": \"{topic}\"}}}}",
        port(events),
        port(replay)
    )
}

/// Workers as an operator writes them when the engines say the rest: id, name, role,
/// `engine = "vllm"` and `http-url`.
fn config(addrs: &[SocketAddr]) -> String {
    let roles = ["prefill", "decode", "decode"];
    let mut text = String::from("listen = \"127.0.0.1:0\"\n");
    for (i, addr) in addrs.iter().enumerate() {
        text += &format!(
            "\n[[workers]]\nid = {i}\nname = \"{}{i}\"\nrole = \"{}\"\nengine = \"vllm\"\n\
             serve-alone = false\nhttp-url = \"http://{addr}\"\n",
            &roles[i][..1],
            roles[i]
        );
    }
    text
}

async fn start(addrs: &[SocketAddr]) -> Cluster {
    let parsed = RouterConfig::from_toml_str(&config(addrs)).unwrap();
    Cluster::start(move |cfg| {
        cfg.engine_signals.scrape_interval_ms = 20;
        cfg.workers = parsed.workers;
    })
    .await
}

/// Waits (at most 15 s: a retry waits up to a few seconds) until `check` holds.
async fn wait_for(cluster: &Cluster, what: &str, check: impl Fn(&[ListedWorker]) -> bool) {
    for _ in 0..1_500 {
        if check(&cluster.service().list_workers()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{what}: not within 15 s; workers: {:#?}",
        cluster.service().list_workers()
    );
}

fn warned(w: &ListedWorker, text: &str) -> bool {
    w.warnings.iter().any(|x| x.contains(text))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_worker_known_by_its_http_url_reads_its_events_from_the_engine() {
    let stop = tokio_util::sync::CancellationToken::new();
    let publisher = common::event_publisher("kv@d1@m", &stop).await;
    let (l0, a0) = listener().await;
    let (l1, a1) = listener().await;
    let (l2, a2) = listener().await;
    let _p0 = mock_vllm(l0, (StatusCode::OK, "{}".into())).await;
    // d1's engine is still starting: its API server answers 503 for now.
    let d1 = mock_vllm(l1, (StatusCode::SERVICE_UNAVAILABLE, String::new())).await;
    // d2 serves another model than the fleet.
    let _d2 = mock_vllm_serving(l2, (StatusCode::OK, "{}".into()), "other").await;
    let cluster = start(&[a0, a1, a2]).await;
    wait_for(&cluster, "d1's 503 listed", |ws| warned(&ws[1], "HTTP 503")).await;
    let ws = cluster.service().list_workers();
    assert_eq!(
        (ws[1].kv_events.as_deref(), ws[1].kv_events_from),
        (None, "")
    );
    assert!(
        ws[1].events.is_none(),
        "no subscriber before the source is known"
    );

    *d1.lock() = (
        StatusCode::OK,
        sources(
            publisher.endpoint(),
            publisher.replay_endpoint().unwrap(),
            "kv@d1@m",
        ),
    );
    let port = publisher.endpoint().rsplit(':').next().unwrap().to_owned();
    wait_for(&cluster, "d1 subscribed where its engine said", |ws| {
        ws[1].events.is_some_and(|e| e.connected && e.synced)
    })
    .await;
    let ws = cluster.service().list_workers();
    // The metrics URL came from http-url too: the state is the engine's /metrics.
    assert_eq!(ws[1].state.health, Health::Healthy);
    assert_eq!(ws[1].state.capacity_tokens, 5_750 * 16);
    assert_eq!(
        ws[1].kv_events.as_deref(),
        Some(format!("tcp://127.0.0.1:{port}").as_str())
    );
    assert_eq!(ws[1].kv_events_from, "engine");
    assert!(ws[1].warnings.is_empty(), "{:?}", ws[1].warnings);
    // The engines without events are said so, with the fix.
    for w in [&ws[0], &ws[2]] {
        assert!(warned(w, "--kv-events-config"), "{w:?}");
        assert!(w.events.is_none() && w.kv_events.is_none());
    }
    assert!(
        warned(&ws[2], "serves `other` but the other workers serve `m`"),
        "{:?}",
        ws[2].warnings
    );
    assert!(!warned(&ws[0], "serves"), "{:?}", ws[0].warnings);

    // d1's events are indexed under d1.
    let batch = kvc_events::EventBatch {
        ts: 0.0,
        events: vec![kvc_events::Event::Stored(kvc_events::BlockStored {
            block_hashes: (100..104).map(kvc_events::EngineHash).collect(),
            parent: None,
            token_ids: (0..64).collect(),
            block_size: 16,
            session_id: Some("agent-1".to_owned()),
            ..Default::default()
        })],
        dp_rank: None,
    };
    common::publish_applied(&publisher, batch, "d1's blocks indexed", |_| {
        cluster.service().list_workers()[1]
            .events
            .is_some_and(|e| e.indexed_blocks == 4)
    })
    .await;

    let listed = cluster.list_workers().await;
    assert_eq!(listed[1].kv_events_from, "engine");
    assert_eq!(listed[1].indexed_blocks, Some(4));
    assert!(listed[0].warnings[0].contains("--kv-events-config"));
    let metrics = cluster.metrics().await;
    assert_eq!(
        common::value(
            &metrics,
            "kvc_router_worker_kv_events_source",
            &[
                ("worker", "1"),
                ("name", "d1"),
                ("endpoint", &format!("tcp://127.0.0.1:{port}")),
                ("from", "engine")
            ]
        ),
        1.0
    );
    assert_eq!(
        common::value(
            &metrics,
            "kvc_router_worker_discovery_warnings",
            &[("worker", "0"), ("name", "p0"), ("role", "prefill")]
        ),
        1.0
    );
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_discoveries_are_listed_and_retried_until_the_engine_answers() {
    let stop = tokio_util::sync::CancellationToken::new();
    let publisher = common::event_publisher("", &stop).await;
    let good = sources(
        publisher.endpoint(),
        publisher.replay_endpoint().unwrap(),
        "",
    );
    let (l0, a0) = listener().await;
    let (l1, a1) = listener().await;
    // d2's port is free: nothing listens there until later.
    let (l2, a2) = listener().await;
    drop(l2);
    let p0 = mock_vllm(l0, (StatusCode::NOT_FOUND, String::new())).await;
    let d1 = mock_vllm(l1, (StatusCode::OK, "<html>not vllm</html>".into())).await;
    let cluster = start(&[a0, a1, a2]).await;
    wait_for(&cluster, "every failure listed", |ws| {
        warned(&ws[0], "404")
            && warned(&ws[1], "not JSON")
            && warned(&ws[2], "GET /kv_event_sources:")
    })
    .await;
    let ws = cluster.service().list_workers();
    assert!(
        warned(&ws[0], "kv-events"),
        "the 404 names the fix: {:?}",
        ws[0].warnings
    );
    assert!(ws.iter().all(|w| w.events.is_none()));

    // Each engine is asked again: d1 now has no events, p0 and d2 (up at last) have a source.
    *d1.lock() = (StatusCode::OK, "{}".into());
    *p0.lock() = (StatusCode::OK, good.clone());
    let l2 = tokio::net::TcpListener::bind(a2).await.unwrap();
    let _d2 = mock_vllm(l2, (StatusCode::OK, good)).await;
    wait_for(&cluster, "d1 without events, d2 subscribed", |ws| {
        warned(&ws[1], "--kv-events-config") && ws[2].kv_events_from == "engine"
    })
    .await;
    // p0 answered 404: it is asked again only after the longest wait.
    let ws = cluster.service().list_workers();
    assert!(warned(&ws[0], "404"), "{:?}", ws[0].warnings);
    assert_eq!(ws[1].warnings.len(), 1, "{:?}", ws[1].warnings);
    assert!(ws[2].warnings.is_empty(), "{:?}", ws[2].warnings);
    stop.cancel();
}

#[test]
fn the_metrics_url_is_derived_and_discovery_can_be_turned_off() {
    let text = config(&[
        "127.0.0.1:8000".parse().unwrap(),
        "127.0.0.1:8010".parse().unwrap(),
    ]);
    let cfg = RouterConfig::from_toml_str(&text).unwrap();
    let w = &cfg.workers[0];
    assert_eq!(
        w.metrics_url.as_deref(),
        Some("http://127.0.0.1:8000/metrics")
    );
    assert!(w.discovers_events());
    let off =
        RouterConfig::from_toml_str(&text.replace("serve-alone", "discover = false\nserve-alone"));
    let err = off.unwrap_err().to_string();
    assert!(err.contains("needs a snapshot path"), "{err}");
    let sglang = text.replace("engine = \"vllm\"", "engine = \"sglang\"\ndiscover = true");
    let err = RouterConfig::from_toml_str(&sglang)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("discover = true needs engine = \"vllm\""),
        "{err}"
    );
}
