//! KV-cache events of data-parallel engines and of engines that connect to the router: a
//! vLLM worker whose `GET /kv_event_sources` lists ranks 0 and 1 is read as two streams,
//! each rank's blocks indexed under it (a session's residency names rank 1 when rank 1
//! published it), listed and exported per rank; with `kv-events-listen` the router binds one
//! SUB socket, engines connect their PUB to it, each message indexed under the worker its
//! topic names, an unknown topic counted and never indexed. Every wait is bounded.

mod common;

use axum::http::StatusCode;
use axum::routing::get;
use common::Cluster;
use kvc_core::{SessionId, WorkerId};
use kvc_router::{ListedWorker, RouterConfig};
use std::net::SocketAddr;
use std::time::Duration;

const METRICS: &str = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n\
     vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0\n\
     vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0\n\
     vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"5750\"} 1.0\n";

/// A mock vLLM HTTP server: `/metrics` as vLLM's, `/kv_event_sources` answering `sources`.
async fn mock_vllm(sources: String) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = axum::Router::new()
        .route("/metrics", get(|| async { METRICS }))
        .route(
            "/v1/models",
            get(|| async { "{\"object\":\"list\",\"data\":[{\"id\":\"m\"}]}" }),
        )
        .route(
            "/kv_event_sources",
            get(move || {
                let s = sources.clone();
                async move { (StatusCode::OK, s) }
            }),
        );
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

fn port(endpoint: &str) -> &str {
    endpoint.rsplit(':').next().unwrap()
}

/// One batch storing `blocks` blocks (16 tokens each) of `session` from hash `first` on.
fn stored(first: u64, blocks: u64, session: &str, rank: Option<i64>) -> kvc_events::EventBatch {
    kvc_events::EventBatch {
        ts: 0.0,
        events: vec![kvc_events::Event::Stored(kvc_events::BlockStored {
            block_hashes: (first..first + blocks)
                .map(kvc_events::EngineHash)
                .collect(),
            parent: None,
            token_ids: (0..(blocks * 16) as u32)
                .map(|t| t + first as u32)
                .collect(),
            block_size: 16,
            session_id: Some(session.to_owned()),
            ..Default::default()
        })],
        dp_rank: rank,
    }
}

/// Waits (at most 20 s) until `check` holds for the listed workers.
async fn wait_for(cluster: &Cluster, what: &str, check: impl Fn(&[ListedWorker]) -> bool) {
    for _ in 0..2_000 {
        if check(&cluster.service().list_workers()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{what}: not within 20 s; workers: {:#?}",
        cluster.service().list_workers()
    );
}

/// Publishes `batch` until `done` (a PUB socket drops what it sends before it has seen the
/// subscription): at most 200 times, 50 ms apart.
async fn publish_until(
    p: &kvc_events::Publisher,
    batch: &kvc_events::EventBatch,
    what: &str,
    done: impl Fn() -> bool,
) {
    for _ in 0..200 {
        p.publish(batch).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        if done() {
            return;
        }
    }
    panic!("{what}: gave up publishing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_data_parallel_rank_of_a_discovered_engine_is_indexed_under_its_rank() {
    let stop = tokio_util::sync::CancellationToken::new();
    let rank0 = common::event_publisher("kv@d1@m", &stop).await;
    let rank1 = common::event_publisher("kv@d1@m", &stop).await;
    let entry = |p: &kvc_events::Publisher| {
        format!(
            "{{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \
             \"tcp://*:{}\", \"replay_endpoint\": \"tcp://*:{}\", \"topic\": \"kv@d1@m\"}}",
            port(p.endpoint()),
            port(p.replay_endpoint().unwrap())
        )
    };
    let d1 = mock_vllm(format!(
        "{{\"1\": {}, \"0\": {}}}",
        entry(&rank1),
        entry(&rank0)
    ))
    .await;
    let p0 = mock_vllm("{}".into()).await;
    let text = format!(
        "[[workers]]\nid = 0\nname = \"p0\"\nrole = \"prefill\"\nengine = \"vllm\"\n\
         serve-alone = false\nhttp-url = \"http://{p0}\"\n\n\
         [[workers]]\nid = 1\nname = \"d1\"\nrole = \"decode\"\nengine = \"vllm\"\n\
         serve-alone = false\nhttp-url = \"http://{d1}\"\n"
    );
    let parsed = RouterConfig::from_toml_str(&text).unwrap();
    let cluster = Cluster::start(move |cfg| {
        cfg.engine_signals.scrape_interval_ms = 20;
        cfg.workers = parsed.workers;
    })
    .await;
    wait_for(&cluster, "both ranks subscribed", |ws| {
        ws[1].event_ranks.len() == 2 && ws[1].event_ranks.iter().all(|r| r.stats.synced)
    })
    .await;
    // Rank 1 holds the session's three blocks, rank 0 one block of another session.
    let svc = cluster.service().clone();
    publish_until(
        &rank1,
        &stored(100, 3, "agent-r1", Some(1)),
        "rank 1",
        || svc.list_workers()[1].event_ranks[1].stats.indexed_blocks == 3,
    )
    .await;
    publish_until(
        &rank0,
        &stored(100, 1, "agent-r0", Some(0)),
        "rank 0",
        || svc.list_workers()[1].event_ranks[0].stats.indexed_blocks == 1,
    )
    .await;
    let d = WorkerId(1);
    assert_eq!(
        svc.resident_rank(d, SessionId::from_key("agent-r1")),
        Some(1)
    );
    assert_eq!(
        svc.resident_rank(d, SessionId::from_key("agent-r0")),
        Some(0)
    );
    assert_eq!(svc.resident_rank(d, SessionId::from_key("nobody")), None);

    let ws = svc.list_workers();
    let ranks: Vec<(u32, Option<String>, u64)> = ws[1]
        .event_ranks
        .iter()
        .map(|r| (r.rank, r.endpoint.clone(), r.stats.indexed_blocks))
        .collect();
    assert_eq!(
        ranks,
        [
            (
                0,
                Some(format!("tcp://127.0.0.1:{}", port(rank0.endpoint()))),
                1
            ),
            (
                1,
                Some(format!("tcp://127.0.0.1:{}", port(rank1.endpoint()))),
                3
            ),
        ]
    );
    assert_eq!(ws[1].events.unwrap().indexed_blocks, 4);
    assert!(ws[1].warnings.is_empty(), "{:?}", ws[1].warnings);
    assert!(
        !ws.iter()
            .flat_map(|w| &w.warnings)
            .any(|w| w.contains("only rank")),
        "{ws:?}"
    );

    let listed = cluster.list_workers().await;
    assert_eq!(listed[1].indexed_blocks, Some(4));
    let pb: Vec<(u32, u64)> = listed[1]
        .event_ranks
        .iter()
        .map(|r| (r.rank, r.indexed_blocks))
        .collect();
    assert_eq!(pb, [(0, 1), (1, 3)]);
    let metrics = cluster.metrics().await;
    for (rank, blocks) in [("0", 1.0), ("1", 3.0)] {
        assert_eq!(
            common::value(
                &metrics,
                "kvc_router_worker_kv_events_rank",
                &[
                    ("worker", "1"),
                    ("name", "d1"),
                    ("rank", rank),
                    ("kind", "indexed-blocks")
                ]
            ),
            blocks
        );
    }
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_that_connect_to_the_router_are_indexed_under_their_topics_worker() {
    let stop = tokio_util::sync::CancellationToken::new();
    let engine = mock_vllm("{}".into()).await;
    let engine_d = mock_vllm("{}".into()).await;
    let text = format!(
        "kv-events-listen = \"tcp://127.0.0.1:0\"\n\n\
         [[workers]]\nid = 0\nname = \"p0\"\nrole = \"prefill\"\nengine = \"vllm\"\n\
         serve-alone = false\nmetrics-url = \"http://{engine}/metrics\"\n\n\
         [[workers]]\nid = 1\nname = \"d1\"\nrole = \"decode\"\nengine = \"vllm\"\n\
         serve-alone = false\nmetrics-url = \"http://{engine_d}/metrics\"\n\
         kv-events-replay = \"REPLAY\"\n"
    );
    // d1's engine: its PUB connects to the router, its replay socket binds.
    let mut cfg = kvc_events::PublisherConfig::new("tcp://127.0.0.1:1");
    cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    let replay_probe = kvc_events::Publisher::bind(
        kvc_events::PublisherConfig {
            endpoint: "tcp://127.0.0.1:0".into(),
            ..cfg.clone()
        },
        stop.clone(),
    )
    .await
    .unwrap();
    let replay_at = replay_probe.replay_endpoint().unwrap().to_owned();
    replay_probe.shutdown().await;
    let parsed = RouterConfig::from_toml_str(&text.replace("REPLAY", &replay_at)).unwrap();
    assert_eq!(parsed.event_listen_ranks(), 1);
    let cluster = Cluster::start(move |c| {
        c.engine_signals.scrape_interval_ms = 20;
        c.kv_events_listen = parsed.kv_events_listen;
        c.workers = parsed.workers;
    })
    .await;
    let svc = cluster.service().clone();
    let at = svc.event_listen_endpoints()[0].clone();
    cfg.endpoint = at.clone();
    cfg.connect = true;
    cfg.topic = "kv@d1@m".into();
    cfg.replay_endpoint = Some(replay_at.clone());
    let d1 = kvc_events::Publisher::bind(cfg, stop.clone())
        .await
        .unwrap();
    wait_for(&cluster, "both workers' streams started", |ws| {
        ws[0].event_ranks.len() == 1 && ws[1].event_ranks.len() == 1
    })
    .await;
    publish_until(&d1, &stored(10, 2, "agent-7", None), "d1", || {
        svc.list_workers()[1]
            .events
            .is_some_and(|e| e.indexed_blocks == 2)
    })
    .await;
    let ws = svc.list_workers();
    assert_eq!(ws[1].kv_events_from, "listen");
    assert_eq!(ws[1].kv_events.as_deref(), Some("tcp://127.0.0.1:0"));
    assert_eq!(ws[1].event_ranks[0].endpoint, None);
    assert_eq!(ws[0].events.map(|e| e.indexed_blocks), Some(0));

    // An engine whose topic names no worker: counted, never indexed.
    let mut cfg = kvc_events::PublisherConfig::new(at);
    cfg.connect = true;
    cfg.topic = "kv@stranger@m".into();
    let stranger = kvc_events::Publisher::bind(cfg, stop.clone())
        .await
        .unwrap();
    publish_until(
        &stranger,
        &stored(500, 3, "agent-x", None),
        "unknown topic",
        || {
            svc.event_listener_stats()
                .is_some_and(|s| s.unknown_topic >= 2)
        },
    )
    .await;
    let st = svc.event_listener_stats().unwrap();
    assert_eq!(st.unknown_topics, ["kv@stranger@m"]);
    let ws = svc.list_workers();
    assert_eq!(ws[1].events.unwrap().indexed_blocks, 2);
    assert_eq!(ws[0].events.unwrap().indexed_blocks, 0);
    let metrics = cluster.metrics().await;
    assert!(
        common::value(
            &metrics,
            "kvc_router_kv_events_listen",
            &[("kind", "unknown-topic")]
        ) >= 2.0
    );
    stop.cancel();
}

#[test]
fn listen_mode_and_rank_keys_are_checked_with_the_key_named() {
    let base = "[[workers]]\nid = 0\nname = \"p0\"\nrole = \"prefill\"\nengine = \"vllm\"\n\
                serve-alone = false\nmetrics-url = \"http://127.0.0.1:1/metrics\"\n\n\
                [[workers]]\nid = 1\nname = \"d1\"\nrole = \"decode\"\nengine = \"vllm\"\n\
                serve-alone = false\nmetrics-url = \"http://127.0.0.1:2/metrics\"\n";
    let err = |text: &str| RouterConfig::from_toml_str(text).unwrap_err().to_string();
    // kv-events by hand with two ranks: each rank at its port offset.
    let ok = RouterConfig::from_toml_str(&format!(
        "{base}kv-events = \"tcp://10.0.0.1:5557\"\nkv-events-replay = \"tcp://10.0.0.1:6000\"\n\
         kv-events-ranks = 2\n"
    ))
    .unwrap();
    assert_eq!(ok.workers[1].kv_events_ranks, Some(2));
    assert_eq!(
        kvc_router::WorkerConfig::rank_endpoint("tcp://10.0.0.1:5557", 1).as_deref(),
        Some("tcp://10.0.0.1:5558")
    );
    for (text, says) in [
        (
            format!("{base}kv-events = \"ipc:///tmp/e\"\nkv-events-ranks = 2\n"),
            "kv-events `ipc:///tmp/e` with kv-events-ranks = 2",
        ),
        (
            format!("{base}kv-events = \"tcp://h:65535\"\nkv-events-ranks = 2\n"),
            "port below 65534",
        ),
        (
            format!("{base}kv-events = \"tcp://h:1\"\nkv-events-ranks = 0\n"),
            "kv-events-ranks must be positive",
        ),
        // Without kv-events or a router that listens, the rank and replay keys mean nothing.
        (
            format!("{base}kv-events-ranks = 2\n"),
            "need `kv-events`, or the router's `kv-events-listen`",
        ),
        (
            format!("{base}kv-events-replay = \"tcp://h:2\"\n"),
            "need `kv-events`, or the router's `kv-events-listen`",
        ),
        (
            format!("kv-events-listen = \"udp://x:1\"\n{base}"),
            "kv-events-listen `udp://x:1` is not tcp://host:port",
        ),
        (
            format!("kv-events-listen = \"tcp://*:0\"\n{base}kv-events-ranks = 2\n"),
            "kv-events-listen `tcp://*:0`: a listening worker has kv-events-ranks = 2",
        ),
    ] {
        let e = err(&text);
        assert!(e.contains(says), "{e}\n  lacks: {says}");
    }
    // A listening SGLang worker needs its block size, as with kv-events.
    let sglang = format!("kv-events-listen = \"tcp://*:5557\"\n{base}")
        .replace("engine = \"vllm\"", "engine = \"sglang\"");
    let e = err(&sglang);
    assert!(
        e.contains("a worker that listens") && e.contains("needs `block-size`"),
        "{e}"
    );
    // A listening worker's ranks set how many ports the router binds; a worker with its own
    // kv-events is read there, not through the listener.
    let listen = RouterConfig::from_toml_str(&format!(
        "kv-events-listen = \"tcp://*:5557\"\n{base}kv-events-ranks = 3\n"
    ))
    .unwrap();
    assert_eq!(listen.event_listen_ranks(), 3);
    assert!(listen.workers[1].listens_for_events(true));
    let mixed = RouterConfig::from_toml_str(&format!(
        "kv-events-listen = \"tcp://*:5557\"\n{base}kv-events = \"tcp://10.0.0.1:5557\"\n"
    ))
    .unwrap();
    assert!(!mixed.workers[1].listens_for_events(true));
    assert!(mixed.workers[0].listens_for_events(true));
}
