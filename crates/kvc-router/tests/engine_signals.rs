//! Workers backed by stock engines: the router scrapes each engine's Prometheus `/metrics`
//! (vLLM and SGLang names), builds the worker's state from it, and takes a worker out of
//! rotation while its scrape fails.

mod common;

use axum::http::StatusCode;
use axum::routing::get;
use common::{Cluster, route_req};
use kvc_core::{EngineKind, Health, StateSource, WorkerId};
use kvc_router::RouterConfig;
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::Arc;

/// What a mock engine's `/metrics` answers.
type Answer = Arc<Mutex<(StatusCode, String)>>;

async fn mock_engine(text: &str) -> (SocketAddr, Answer) {
    let answer: Answer = Arc::new(Mutex::new((StatusCode::OK, text.to_owned())));
    let shared = Arc::clone(&answer);
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let shared = Arc::clone(&shared);
            async move { shared.lock().clone() }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, answer)
}

fn vllm_text(running: u32, waiting: u32, usage: f64, blocks: u64) -> String {
    format!(
        "# TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage}\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"{blocks}\"}} 1.0\n"
    )
}

const SGLANG_TEXT: &str = "sglang:num_running_reqs{model_name=\"m\"} 2\n\
     sglang:num_queue_reqs{model_name=\"m\"} 1\n\
     sglang:num_decode_transfer_queue_reqs{model_name=\"m\"} 2\n\
     sglang:token_usage{model_name=\"m\"} 0.5\n\
     sglang:max_total_num_tokens{model_name=\"m\"} 92000\n";

/// Waits (at most [`common::WAIT`]) until `check` holds for the router's worker list.
async fn wait_for(
    cluster: &Cluster,
    what: &str,
    check: impl Fn(&[kvc_router::ListedWorker]) -> bool,
) {
    let deadline = std::time::Instant::now() + common::WAIT;
    loop {
        let workers = cluster.service().list_workers();
        if check(&workers) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {:?}; workers: {workers:?}",
            common::WAIT
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_metrics_are_the_state_of_workers_without_a_snapshot() {
    let (p_addr, _p) = mock_engine(&vllm_text(1, 0, 0.1, 5_750)).await;
    let (d1_addr, d1) = mock_engine(&vllm_text(3, 4, 0.25, 5_750)).await;
    let (d2_addr, _d2) = mock_engine(SGLANG_TEXT).await;
    let engines = [
        (p_addr, EngineKind::Vllm),
        (d1_addr, EngineKind::Vllm),
        (d2_addr, EngineKind::Sglang),
    ];
    let cluster = Cluster::start(|cfg| {
        cfg.engine_signals.scrape_interval_ms = 20;
        for (w, (addr, kind)) in cfg.workers.iter_mut().zip(engines) {
            w.snapshot = None;
            w.engine = Some(kind);
            // The fixed roles this test routes on (a vLLM instance serves alone by default).
            w.serve_alone = Some(false);
            w.metrics_url = Some(format!("http://{addr}/metrics"));
        }
    })
    .await;
    wait_for(&cluster, "all scraped", |ws| {
        ws.iter().all(|w| w.state.health == Health::Healthy)
    })
    .await;
    let ws = cluster.service().list_workers();
    assert!(ws.iter().all(|w| w.source == StateSource::Events));
    // vLLM: the pool is num_gpu_blocks × block_size; use is a fraction of it.
    let d1_state = ws[1].state;
    assert_eq!(d1_state.capacity_tokens, 5_750 * 16);
    assert_eq!(d1_state.used_tokens, 23_000);
    assert_eq!((d1_state.in_flight, d1_state.queue_depth), (3, 4));
    assert_eq!(d1_state.evictable_tokens, 0);
    // SGLang: the disaggregation queues count as waiting.
    let d2_state = ws[2].state;
    assert_eq!(d2_state.capacity_tokens, 92_000);
    assert_eq!(d2_state.used_tokens, 46_000);
    assert_eq!((d2_state.in_flight, d2_state.queue_depth), (2, 3));

    // The policy routes over the scraped state.
    let mut client = cluster.client.clone();
    let decision = client
        .route(route_req(1, Some(7), Some(1), 600, &[11, 12]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decision.mode(), kvc_proto::pb::ExecutionMode::Turn1Seed);
    assert_eq!(decision.prefill_worker, Some(0));

    // A failing scrape takes the worker out of rotation at once; garbage keeps it out; a good
    // answer brings it back with the new figures.
    *d1.lock() = (StatusCode::INTERNAL_SERVER_ERROR, String::new());
    wait_for(&cluster, "d1 down after HTTP 500", |ws| {
        ws[1].state.health == Health::Down
    })
    .await;
    *d1.lock() = (
        StatusCode::OK,
        "vllm:num_requests_running{a=\"b} 1\n".to_owned(),
    );
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(
        cluster.service().list_workers()[1].state.health,
        Health::Down
    );
    let views = cluster.service().worker_views();
    assert_eq!(views[1].state.health, Health::Down);
    *d1.lock() = (StatusCode::OK, vllm_text(0, 0, 0.5, 5_750));
    wait_for(&cluster, "d1 back", |ws| {
        ws[1].state.health == Health::Healthy && ws[1].state.used_tokens == 46_000
    })
    .await;
    assert_eq!(views[1].id, WorkerId(1));
}

/// A prefill and a decode worker, each a vLLM engine scraped at `engines` every 20 ms with
/// fixed roles, configured further by `edit`; returns once both are in rotation.
async fn vllm_pair(engines: [SocketAddr; 2], edit: impl FnOnce(&mut RouterConfig)) -> Cluster {
    let cluster = Cluster::start(|cfg| {
        cfg.engine_signals.scrape_interval_ms = 20;
        cfg.workers.truncate(2);
        for (w, addr) in cfg.workers.iter_mut().zip(engines) {
            w.snapshot = None;
            w.engine = Some(EngineKind::Vllm);
            w.serve_alone = Some(false);
            w.metrics_url = Some(format!("http://{addr}/metrics"));
        }
        edit(cfg);
    })
    .await;
    wait_for(&cluster, "both scraped", |ws| {
        ws.iter().all(|w| w.state.health == Health::Healthy)
    })
    .await;
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_with_prefix_caching_off_is_listed_with_the_fix_until_it_is_on() {
    let off = vllm_text(0, 0, 0.0, 5_750).replace(
        "num_gpu_blocks=",
        "enable_prefix_caching=\"False\",num_gpu_blocks=",
    );
    let (p_addr, _p) = mock_engine(&vllm_text(0, 0, 0.0, 5_750)).await;
    let (d_addr, d) = mock_engine(&off).await;
    let cluster = vllm_pair([p_addr, d_addr], |_| {}).await;
    wait_for(&cluster, "d1's warning", |ws| !ws[1].warnings.is_empty()).await;
    let ws = cluster.service().list_workers();
    assert!(ws[0].warnings.is_empty(), "{:?}", ws[0].warnings);
    assert_eq!(ws[1].warnings.len(), 1);
    assert!(
        ws[1].warnings[0].contains("prefix caching off"),
        "{:?}",
        ws[1].warnings
    );
    assert!(ws[1].warnings[0].contains("--no-enable-prefix-caching"));
    let metrics = cluster.service().render_metrics();
    assert!(
        metrics.contains(
            "kvc_router_worker_discovery_warnings{worker=\"1\",name=\"d1\",role=\"decode\"} 1"
        ),
        "{metrics}"
    );
    *d.lock() = (
        StatusCode::OK,
        off.replace(
            "enable_prefix_caching=\"False\"",
            "enable_prefix_caching=\"True\"",
        ),
    );
    wait_for(&cluster, "d1's warning gone", |ws| {
        ws[1].warnings.is_empty()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_pool_left_out_of_the_configuration_is_read_from_the_engine() {
    use kvc_core::Outcome;
    use kvc_proto::convert::ProtoEnum;
    use kvc_proto::pb;
    let (p_addr, _p) = mock_engine(&vllm_text(0, 0, 0.0, 5_750)).await;
    let (d_addr, d) = mock_engine(&vllm_text(0, 0, 0.0, 4_000)).await;
    let cluster = vllm_pair([p_addr, d_addr], |cfg| {
        for w in &mut cfg.workers {
            w.capacity_tokens = 0;
        }
    })
    .await;
    let ws = cluster.service().list_workers();
    assert_eq!(ws[0].state.capacity_tokens, 5_750 * 16);
    assert_eq!(ws[1].state.capacity_tokens, 4_000 * 16);
    let metrics = cluster.service().render_metrics();
    assert!(
        metrics.contains(
            "kvc_router_worker_capacity_tokens{worker=\"1\",name=\"d1\",role=\"decode\"} 64000"
        ),
        "{metrics}"
    );
    // The pool bounds what a report may claim resident, as a configured one does.
    let mut client = cluster.client.clone();
    let t1 = client
        .route(route_req(1, Some(9), Some(1), 2_000, &[1, 2, 3]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(t1.decode_worker, 1);
    let report = |resident_tokens: u64, request_id: u64, decision_id: u64| pb::OutcomeReport {
        decision_id,
        request_id,
        outcome: Outcome::Ok.to_proto(),
        resident_tokens,
    };
    client
        .report_outcome(report(2_040, 1, t1.decision_id))
        .await
        .expect("2,040 tokens fit the engine's 64,000-token pool");
    let t2 = client
        .route(route_req(2, Some(10), Some(1), 2_000, &[4, 5, 6]))
        .await
        .unwrap()
        .into_inner();
    let err = client
        .report_outcome(report(64_001, 2, t2.decision_id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.message().contains("64000 tokens"), "{err}");
    // A pool that changes on the engine is followed.
    *d.lock() = (StatusCode::OK, vllm_text(0, 0, 0.0, 8_000));
    wait_for(&cluster, "the larger pool", |ws| {
        ws[1].state.capacity_tokens == 128_000
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_that_only_times_out_leaves_the_state_to_age() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let (p_addr, _p) = mock_engine(&vllm_text(0, 0, 0.0, 5_750)).await;
    // D's /metrics answers at once until `slow` is set, then never (a busy CPU engine's API
    // server, past any scrape deadline); `unanswered` counts the scrapes it leaves waiting.
    let slow = Arc::new(AtomicBool::new(false));
    let unanswered = Arc::new(AtomicU64::new(0));
    let (flag, count) = (Arc::clone(&slow), Arc::clone(&unanswered));
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let (flag, count) = (Arc::clone(&flag), Arc::clone(&count));
            async move {
                if flag.load(Ordering::SeqCst) {
                    count.fetch_add(1, Ordering::SeqCst);
                    std::future::pending::<()>().await;
                }
                vllm_text(1, 0, 0.1, 5_750)
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let d_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let cluster = vllm_pair([p_addr, d_addr], |cfg| {
        // Short enough that the test sees scrapes time out, long enough that the scrapes
        // answered at once (while the pair comes up) never do on a loaded machine.
        cfg.engine_signals.scrape_timeout_ms = 1_000;
        cfg.engine_signals.stale_after_ms = 3_000;
    })
    .await;
    slow.store(true, Ordering::SeqCst);
    // Several scrapes time out (the router's clock stands still): D's scrapes go one after
    // another, so once a third has reached the engine, two have timed out. The last good
    // state is still fresh, so D stays in rotation with its figures.
    common::wait_until("two of D's scrapes timed out", || {
        unanswered.load(Ordering::SeqCst) >= 3
    })
    .await;
    let ws = cluster.service().list_workers();
    assert_eq!(ws[1].state.health, Health::Healthy, "{:?}", ws[1]);
    assert_eq!(ws[1].state.in_flight, 1, "the last good scrape's figures");
    // Once that state is older than stale-after-ms, D is out.
    cluster.clock.advance(3_001);
    wait_for(&cluster, "d stale", |ws| {
        ws[1].state.health != Health::Healthy
    })
    .await;
}

/// A vLLM engine's `/metrics` as vLLM serves it: `text` whole at `/metrics`, and at
/// `/metrics/` only the families its `name[]` query names (`prometheus_client`'s filter), or
/// the status in `filtered_status` when it is not 200. Counts the reads of each path.
struct FilteringEngine {
    addr: SocketAddr,
    whole_reads: Arc<std::sync::atomic::AtomicUsize>,
    filtered_reads: Arc<std::sync::atomic::AtomicUsize>,
    filtered_status: Arc<Mutex<StatusCode>>,
}

async fn filtering_engine(text: String) -> FilteringEngine {
    use axum::extract::RawQuery;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let whole_reads = Arc::new(AtomicUsize::new(0));
    let filtered_reads = Arc::new(AtomicUsize::new(0));
    let filtered_status = Arc::new(Mutex::new(StatusCode::OK));
    let (w, f, st) = (
        Arc::clone(&whole_reads),
        Arc::clone(&filtered_reads),
        Arc::clone(&filtered_status),
    );
    let whole_text = text.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                w.fetch_add(1, Ordering::SeqCst);
                let t = whole_text.clone();
                async move { t }
            }),
        )
        .route(
            "/metrics/",
            get(move |RawQuery(query): RawQuery| {
                f.fetch_add(1, Ordering::SeqCst);
                let status = *st.lock();
                let names: Vec<String> = query
                    .unwrap_or_default()
                    .split('&')
                    .filter_map(|kv| kv.split_once('='))
                    .filter(|(k, _)| *k == "name%5B%5D" || *k == "name[]")
                    .map(|(_, v)| v.replace("%3A", ":"))
                    .collect();
                let kept: String = text
                    .lines()
                    .filter(|l| !l.starts_with('#'))
                    .filter(|l| {
                        let name = l.split(['{', ' ']).next().unwrap_or("");
                        names.iter().any(|n| n == name)
                    })
                    .map(|l| format!("{l}\n"))
                    .collect();
                async move { (status, kept) }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    FilteringEngine {
        addr,
        whole_reads,
        filtered_reads,
        filtered_status,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_engine_is_asked_for_the_families_of_its_load_alone() {
    use std::sync::atomic::Ordering;
    // Beside the load's families, a histogram the router has no use for.
    let text = vllm_text(2, 1, 0.5, 5_750)
        + "vllm:e2e_request_latency_seconds_bucket{le=\"1.0\",model_name=\"m\"} 3.0\n";
    let p = filtering_engine(text.clone()).await;
    let d = filtering_engine(text).await;
    let cluster = vllm_pair([p.addr, d.addr], |_| {}).await;
    common::wait_until("three filtered reads of each engine", || {
        [&p, &d]
            .iter()
            .all(|e| e.filtered_reads.load(Ordering::SeqCst) >= 3)
    })
    .await;
    for e in [&p, &d] {
        assert_eq!(e.whole_reads.load(Ordering::SeqCst), 0, "never read whole");
    }
    let state = cluster.service().list_workers()[1].state;
    assert_eq!((state.in_flight, state.queue_depth), (2, 1));
    assert_eq!(state.capacity_tokens, 5_750 * 16);
    assert_eq!(state.used_tokens, 5_750 * 8);

    // A failing engine's 500 on the filtered path is its failure, not a sign that the path
    // is not served: D goes out of rotation, and comes back on the same path.
    *d.filtered_status.lock() = StatusCode::INTERNAL_SERVER_ERROR;
    wait_for(&cluster, "d down after HTTP 500", |ws| {
        ws[1].state.health == Health::Down
    })
    .await;
    *d.filtered_status.lock() = StatusCode::OK;
    wait_for(&cluster, "d back", |ws| {
        ws[1].state.health == Health::Healthy
    })
    .await;
    assert_eq!(
        d.whole_reads.load(Ordering::SeqCst),
        0,
        "still never read whole"
    );

    // An endpoint that does not serve the filter (a 404 there) is read whole from then on.
    *p.filtered_status.lock() = StatusCode::NOT_FOUND;
    common::wait_until("P read whole", || p.whole_reads.load(Ordering::SeqCst) >= 2).await;
    let filtered = p.filtered_reads.load(Ordering::SeqCst);
    common::wait_until("P read whole again", || {
        p.whole_reads.load(Ordering::SeqCst) >= 4
    })
    .await;
    assert_eq!(
        p.filtered_reads.load(Ordering::SeqCst),
        filtered,
        "the filtered path is not asked again"
    );
    let ws = cluster.service().list_workers();
    assert_eq!(ws[0].state.health, Health::Healthy, "{:?}", ws[0]);
    assert_eq!((ws[0].state.in_flight, ws[0].state.queue_depth), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_engine_stays_down_and_the_rest_route() {
    let (p_addr, _p) = mock_engine(&vllm_text(0, 0, 0.0, 5_750)).await;
    let (d_addr, _d) = mock_engine(&vllm_text(0, 0, 0.0, 5_750)).await;
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let engines = [p_addr, d_addr, closed];
    let cluster = Cluster::start(|cfg| {
        cfg.engine_signals.scrape_interval_ms = 20;
        for (w, addr) in cfg.workers.iter_mut().zip(engines) {
            w.snapshot = None;
            w.engine = Some(EngineKind::Vllm);
            // The fixed roles this test routes on (a vLLM instance serves alone by default).
            w.serve_alone = Some(false);
            w.metrics_url = Some(format!("http://{addr}/metrics"));
        }
    })
    .await;
    wait_for(&cluster, "p and d1 scraped", |ws| {
        ws[0].state.health == Health::Healthy && ws[1].state.health == Health::Healthy
    })
    .await;
    assert_eq!(
        cluster.service().list_workers()[2].state.health,
        Health::Down
    );
    let mut client = cluster.client.clone();
    for i in 0..4 {
        let decision = client
            .route(route_req(i, Some(100 + i), Some(1), 600, &[i, i + 1]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            decision.decode_worker, 1,
            "request {i} went to the down worker"
        );
    }
}

/// A `BlockStored` of `blocks` 16-token blocks for `session`, hashes from `first`.
fn stored(first: u64, blocks: u64, parent: Option<u64>, session: &str) -> kvc_events::Event {
    kvc_events::Event::Stored(kvc_events::BlockStored {
        block_hashes: (first..first + blocks)
            .map(kvc_events::EngineHash)
            .collect(),
        parent: parent.map(kvc_events::EngineHash),
        token_ids: (0..blocks * 16)
            .map(|t| (first * 1_000 + t) as u32)
            .collect(),
        block_size: 16,
        session_id: Some(session.to_owned()),
        ..Default::default()
    })
}

async fn publish(p: &kvc_events::Publisher, events: Vec<kvc_events::Event>) {
    publish_at(p, 0.0, events).await;
}

/// [`publish`] with the batch's timestamp (`ts`, seconds on the engine's clock).
async fn publish_at(p: &kvc_events::Publisher, ts: f64, events: Vec<kvc_events::Event>) {
    p.publish(&kvc_events::EventBatch {
        ts,
        events,
        dp_rank: None,
    })
    .await
    .unwrap();
}

/// Publishes a batch at engine time `ts` and waits until the router has applied it
/// ([`common::publish_applied`]).
async fn publish_applied(
    cluster: &Cluster,
    p: &kvc_events::Publisher,
    ts: f64,
    events: Vec<kvc_events::Event>,
    what: &str,
) -> u64 {
    let batch = kvc_events::EventBatch {
        ts,
        events,
        dp_rank: None,
    };
    common::publish_applied(p, batch, what, |seq| {
        cluster.service().list_workers()[1]
            .events
            .as_ref()
            .is_some_and(|e| e.last_seq.is_some_and(|s| s >= seq))
    })
    .await
}

/// The engine's event for block `i` (16 tokens, hash 500 + i, chained to block i − 1) of
/// `prompt`, stored under `session`.
fn prompt_block(prompt: &[u32], i: usize, session: &str) -> kvc_events::Event {
    kvc_events::Event::Stored(kvc_events::BlockStored {
        block_hashes: vec![kvc_events::EngineHash(500 + i as u64)],
        parent: i
            .checked_sub(1)
            .map(|p| kvc_events::EngineHash(500 + p as u64)),
        token_ids: prompt[i * 16..(i + 1) * 16].to_vec(),
        block_size: 16,
        session_id: Some(session.to_owned()),
        ..Default::default()
    })
}

/// Turn `turn` (request `id`) of `session`: `len` tokens, of which `hashes` are the blocks,
/// 16 tokens of output expected.
fn turn_of(
    session: kvc_core::SessionId,
    hashes: &[kvc_core::BlockHash],
    id: u64,
    turn: u32,
    len: usize,
) -> kvc_policy::RouteRequest<'_> {
    kvc_policy::RouteRequest {
        request_id: kvc_core::RequestId(id),
        session: Some(session),
        turn: Some(kvc_core::TurnId(turn)),
        input_length: len as u64,
        output_hint: 16,
        hash_ids: hashes,
        rejected_by: None,
        parent: None,
    }
}

/// P (worker 0), d1 (worker 1, with a KV-event publisher) and d2 (worker 2, out of rotation
/// so that sessions land on d1), all vLLM engines scraped every 20 ms; returned once P and d1
/// are scraped and d1's subscriber is up. Cancel the token to stop the publisher.
async fn events_cluster(
    edit: impl FnOnce(&mut RouterConfig),
) -> (
    Cluster,
    kvc_events::Publisher,
    tokio_util::sync::CancellationToken,
    [Answer; 3],
) {
    let (p_addr, p) = mock_engine(&vllm_text(0, 0, 0.0, 5_750)).await;
    let (d1_addr, d1) = mock_engine(&vllm_text(0, 0, 0.1, 5_750)).await;
    let (d2_addr, d2) = mock_engine(&vllm_text(0, 0, 0.0, 5_750)).await;
    // d2 is out of rotation, so the session lands on d1.
    *d2.lock() = (StatusCode::SERVICE_UNAVAILABLE, String::new());
    let stop = tokio_util::sync::CancellationToken::new();
    let publisher = common::event_publisher("kv@d1@m", &stop).await;
    let (events, replay) = (
        publisher.endpoint().to_owned(),
        publisher.replay_endpoint().unwrap().to_owned(),
    );
    let addrs = [p_addr, d1_addr, d2_addr];
    let cluster = Cluster::start(|cfg| {
        cfg.engine_signals.scrape_interval_ms = 20;
        for (w, addr) in cfg.workers.iter_mut().zip(addrs) {
            w.snapshot = None;
            w.engine = Some(EngineKind::Vllm);
            // The fixed roles this test routes on (a vLLM instance serves alone by default).
            w.serve_alone = Some(false);
            w.metrics_url = Some(format!("http://{addr}/metrics"));
        }
        // The block size comes from d1's /metrics (cache_config_info).
        cfg.workers[1].kv_events = Some(events.clone());
        cfg.workers[1].kv_events_replay = Some(replay.clone());
        cfg.workers[1].kv_events_topic = Some("kv@d1@m".into());
        edit(cfg);
    })
    .await;
    // The router's background tasks (scrapes, the subscriber) run with the served router.
    wait_for(&cluster, "p and d1 scraped, subscriber up", |ws| {
        ws[0].state.health == Health::Healthy
            && ws[1].state.health == Health::Healthy
            && ws[1].events.is_some()
    })
    .await;
    (cluster, publisher, stop, [p, d1, d2])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_events_show_residency_and_an_eviction_drops_the_direct_plan() {
    use kvc_core::{Outcome, SessionId};
    use kvc_proto::convert::ProtoEnum;
    use kvc_proto::pb;

    let (cluster, publisher, stop, _engines) = events_cluster(|_| {}).await;
    let key = "agent-7";
    let session = SessionId::from_key(key).0;
    let mut client = cluster.client.clone();
    let t1 = client
        .route(route_req(1, Some(session), Some(1), 2_000, &[1, 2, 3]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(t1.decode_worker, 1);
    client
        .report_outcome(pb::OutcomeReport {
            decision_id: t1.decision_id,
            request_id: 1,
            outcome: Outcome::Ok.to_proto(),
            resident_tokens: 2_040,
        })
        .await
        .unwrap();
    // d1's engine says what it stored.
    publish(&publisher, vec![stored(100, 64, None, key)]).await;
    publish(&publisher, vec![stored(164, 63, Some(163), key)]).await;
    publish(&publisher, vec![stored(227, 1, Some(226), "other")]).await;
    wait_for(&cluster, "d1's blocks indexed", |ws| {
        ws[1]
            .events
            .as_ref()
            .is_some_and(|e| e.indexed_blocks == 128 && e.last_seq == Some(2))
    })
    .await;
    let listed = cluster.list_workers().await;
    assert_eq!(listed[1].indexed_blocks, Some(128));
    assert_eq!(listed[1].last_event_seq, Some(2));
    assert_eq!(listed[1].source, "events");
    assert_eq!(listed[0].indexed_blocks, None);

    // Turn 2: resident by the events, so direct to d1.
    let t2 = client
        .route(route_req(2, Some(session), Some(2), 2_200, &[1, 2, 3, 4]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(t2.mode(), pb::ExecutionMode::DirectToD);
    assert_eq!(t2.decode_worker, 1);
    client
        .report_outcome(pb::OutcomeReport {
            decision_id: t2.decision_id,
            request_id: 2,
            outcome: Outcome::Ok.to_proto(),
            resident_tokens: 2_240,
        })
        .await
        .unwrap();

    // The engine evicts the session's blocks: the next turn is not planned direct-to-D.
    publish(
        &publisher,
        vec![kvc_events::Event::Removed(kvc_events::BlockRemoved {
            block_hashes: (100..227).map(kvc_events::EngineHash).collect(),
            medium: None,
        })],
    )
    .await;
    wait_for(&cluster, "the eviction indexed", |ws| {
        ws[1].events.as_ref().is_some_and(|e| e.indexed_blocks == 1)
    })
    .await;
    let t3 = client
        .route(route_req(
            3,
            Some(session),
            Some(3),
            2_400,
            &[1, 2, 3, 4, 5],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_ne!(t3.mode(), pb::ExecutionMode::DirectToD);
    assert_eq!(t3.prefill_worker, Some(0));
    let metrics = cluster.metrics().await;
    assert_eq!(
        common::value(&metrics, "kvc_router_event_evictions_total", &[]),
        1.0
    );
    assert_eq!(
        common::value(
            &metrics,
            "kvc_router_worker_kv_events",
            &[("worker", "1"), ("name", "d1"), ("kind", "batches")]
        ),
        4.0
    );
    stop.cancel();
}

/// A session's blocks that another session re-used (vLLM reports a prefix-cache hit as a
/// store by the request that hit, under that request's session) are still the session's: the
/// eviction check of a front that has the prompt's tokens asks how much of the prompt the
/// worker holds, whoever stored it last; the removal of those blocks is still an eviction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_another_session_reused_still_holds_the_session() {
    use kvc_core::{BlockHash, ExecutionMode, Outcome, RequestId, SessionId};
    use kvc_router::DecisionOutcome;

    let (cluster, publisher, stop, _engines) = events_cluster(|_| {}).await;
    let service = cluster.service();
    let a = SessionId::from_key("agent-a");
    // The prompt of A's first turn: 2,000 tokens, of which d1 stores 125 blocks of 16.
    let prompt: Vec<u32> = (0..2_400).map(|t| 7_000 + t).collect();
    let hashes: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
    let request = |id: u64, turn: u32, len: usize, blocks: usize| {
        turn_of(a, &hashes[..blocks], id, turn, len)
    };
    let t1 = service
        .route_prompt(&request(1, 1, 2_000, 3), &[], Some(&prompt[..2_000]))
        .unwrap();
    assert_eq!(t1.decode_worker.0, 1);
    service
        .report_outcome(&DecisionOutcome {
            decision_id: t1.decision_id,
            request_id: RequestId(1),
            outcome: Outcome::Ok,
            resident_tokens: 2_000,
        })
        .unwrap();
    let block = |i: usize, session: &str| prompt_block(&prompt, i, session);
    // Batches the engine published after A's answer (the events have caught up with it).
    let engine_now = cluster.now() as f64 / 1_000.0;
    let a_blocks = (0..125).map(|i| block(i, "agent-a")).collect();
    publish_applied(&cluster, &publisher, engine_now, a_blocks, "A's blocks").await;
    // Session B hits the first 96 blocks (its system prompt is A's): the engine reports them
    // stored again, under B.
    let b_hits = (0..96).map(|i| block(i, "agent-b")).collect();
    publish_applied(&cluster, &publisher, engine_now, b_hits, "B's hits").await;
    let listed = cluster.list_workers().await;
    assert_eq!(listed[1].indexed_blocks, Some(125));
    // The events credit A with 29 blocks (464 tokens), B with 96; d1 holds all 2,000 of A's.
    let t2 = service
        .route_prompt(&request(2, 2, 2_200, 4), &[], Some(&prompt[..2_200]))
        .unwrap();
    assert_eq!(
        (t2.mode, t2.decode_worker.0, t2.cached_tokens),
        (ExecutionMode::DirectToD, 1, 1_536)
    );
    service
        .report_outcome(&DecisionOutcome {
            decision_id: t2.decision_id,
            request_id: RequestId(2),
            outcome: Outcome::Ok,
            resident_tokens: 2_200,
        })
        .unwrap();
    // The engine drops the blocks from the 17th on: what d1 holds of the prompt (256 tokens)
    // is under half of what a direct turn would count on.
    let removed = vec![kvc_events::Event::Removed(kvc_events::BlockRemoved {
        block_hashes: (516..625).map(kvc_events::EngineHash).collect(),
        medium: None,
    })];
    publish_applied(&cluster, &publisher, engine_now, removed, "the removal").await;
    assert_eq!(cluster.list_workers().await[1].indexed_blocks, Some(16));
    let t3 = service
        .route_prompt(&request(3, 3, 2_400, 4), &[], Some(&prompt[..]))
        .unwrap();
    assert_ne!(t3.mode, ExecutionMode::DirectToD);
    assert_eq!(t3.prefill_worker.map(|w| w.0), Some(0));
    let metrics = cluster.metrics().await;
    assert_eq!(
        common::value(&metrics, "kvc_router_event_evictions_total", &[]),
        1.0
    );
    stop.cancel();
}

/// Two colocated vLLM engines: a session the events show gone from its engine is placed again
/// by score, as a P/D session whose direct turn they rule out is, rather than held to the
/// engine that evicted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_colocated_session_its_engine_evicted_is_placed_again() {
    use kvc_core::{BlockHash, ExecutionMode, Outcome, RequestId, SessionId, WorkerRole};
    use kvc_router::DecisionOutcome;

    let (cluster, publisher, stop, [w0, w1, _]) = events_cluster(|cfg| {
        for w in &mut cfg.workers {
            w.role = WorkerRole::Colocated;
            w.serve_alone = None;
        }
    })
    .await;
    let service = cluster.service();
    // w0 out of rotation for the first turn, so that the session starts on w1 (the engine
    // with events).
    *w0.lock() = (StatusCode::SERVICE_UNAVAILABLE, String::new());
    wait_for(&cluster, "w0 out", |ws| {
        ws[0].state.health != Health::Healthy
    })
    .await;
    let a = SessionId::from_key("agent-a");
    let prompt: Vec<u32> = (0..2_400).map(|t| 7_000 + t).collect();
    let hashes: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
    let request = |id: u64, turn: u32, len: usize, blocks: usize| {
        turn_of(a, &hashes[..blocks], id, turn, len)
    };
    let answered = |d: &kvc_router::RouterDecision, id: u64, tokens: u64| {
        service
            .report_outcome(&DecisionOutcome {
                decision_id: d.decision_id,
                request_id: RequestId(id),
                outcome: Outcome::Ok,
                resident_tokens: tokens,
            })
            .unwrap();
    };
    let t1 = service
        .route_prompt(&request(1, 1, 2_000, 3), &[], Some(&prompt[..2_000]))
        .unwrap();
    assert_eq!((t1.mode, t1.decode_worker.0), (ExecutionMode::Colocated, 1));
    answered(&t1, 1, 2_000);
    let engine_now = cluster.now() as f64 / 1_000.0;
    let stored = (0..125)
        .map(|i| prompt_block(&prompt, i, "agent-a"))
        .collect();
    publish_applied(&cluster, &publisher, engine_now, stored, "A's blocks").await;
    // Both engines in rotation, w1 the fuller: a session held there stays there.
    *w0.lock() = (StatusCode::OK, vllm_text(0, 0, 0.0, 5_750));
    *w1.lock() = (StatusCode::OK, vllm_text(0, 0, 0.3, 5_750));
    wait_for(&cluster, "w0 back, w1 at 30%", |ws| {
        ws[0].state.health == Health::Healthy && ws[1].state.used_tokens > 20_000
    })
    .await;
    let t2 = service
        .route_prompt(&request(2, 2, 2_200, 4), &[], Some(&prompt[..2_200]))
        .unwrap();
    assert_eq!((t2.mode, t2.decode_worker.0), (ExecutionMode::Colocated, 1));
    assert!(t2.cached_tokens > 1_000, "{t2:?}");
    answered(&t2, 2, 2_200);
    // w1 drops the blocks from the 17th on: 256 tokens of the prompt left there.
    let removed = vec![kvc_events::Event::Removed(kvc_events::BlockRemoved {
        block_hashes: (516..625).map(kvc_events::EngineHash).collect(),
        medium: None,
    })];
    publish_applied(&cluster, &publisher, engine_now, removed, "the removal").await;
    let t3 = service
        .route_prompt(&request(3, 3, 2_400, 4), &[], Some(&prompt[..]))
        .unwrap();
    // Placed again by score: the emptier engine (w1's small remainder and the weak sticky
    // bonus do not outweigh its 30% committed).
    assert_eq!((t3.mode, t3.decode_worker.0), (ExecutionMode::Colocated, 0));
    assert_eq!(t3.cached_tokens, 0);
    let metrics = cluster.metrics().await;
    assert_eq!(
        common::value(&metrics, "kvc_router_event_evictions_total", &[]),
        1.0
    );
    stop.cancel();
}

/// Routes the first turns of sessions `sessions` (1,600 tokens each, outcomes never reported,
/// so the work piles up) and returns (mode, prefill worker, decode worker) per decision.
async fn first_turns(
    cluster: &Cluster,
    sessions: std::ops::Range<u64>,
) -> Vec<(kvc_core::ExecutionMode, Option<u32>, u32)> {
    use kvc_proto::convert::ProtoEnum;
    let mut client = cluster.client.clone();
    let mut out = Vec::new();
    for s in sessions {
        let d = client
            .route(route_req(
                s,
                Some(1_000 + s),
                Some(1),
                1_600,
                &[s * 10, s * 10 + 1, s * 10 + 2],
            ))
            .await
            .unwrap()
            .into_inner();
        out.push((
            kvc_core::ExecutionMode::from_proto(d.mode).unwrap(),
            d.prefill_worker,
            d.decode_worker,
        ));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_workers_serve_turns_alone_where_kvc_keeps_them_local() {
    use kvc_core::ExecutionMode;
    // A loaded P (busy and queueing, as its /metrics says), two idle vLLM decode workers;
    // nobody declares `serve-alone`: vLLM's default.
    let (p_addr, _p) = mock_engine(&vllm_text(12, 30, 0.8, 5_750)).await;
    let (d1_addr, _d1) = mock_engine(&vllm_text(0, 0, 0.0, 5_750)).await;
    let (d2_addr, _d2) = mock_engine(&vllm_text(0, 0, 0.0, 5_750)).await;
    let addrs = [p_addr, d1_addr, d2_addr];
    let start = |fixed_roles: bool| {
        Cluster::start(move |cfg| {
            cfg.engine_signals.scrape_interval_ms = 20;
            for (w, addr) in cfg.workers.iter_mut().zip(addrs) {
                w.snapshot = None;
                w.engine = Some(EngineKind::Vllm);
                w.metrics_url = Some(format!("http://{addr}/metrics"));
                if fixed_roles {
                    w.serve_alone = Some(false);
                }
            }
        })
    };
    let cluster = start(false).await;
    wait_for(&cluster, "all scraped", |ws| {
        ws.iter().all(|w| w.state.health == Health::Healthy)
    })
    .await;
    let turns = first_turns(&cluster, 1..7).await;
    // An idle decode worker prefills the turn itself rather than queue it behind P and ship
    // its KV: every first turn is local, none touches P.
    for (i, (mode, prefill, decode)) in turns.iter().enumerate() {
        assert_eq!(*mode, ExecutionMode::LocalPrefill, "turn {i}: {turns:?}");
        assert_eq!(*prefill, None);
        assert!([1, 2].contains(decode), "turn {i}: {turns:?}");
    }
    let m = cluster.metrics().await;
    assert_eq!(
        common::value(
            &m,
            "kvc_router_decisions_total",
            &[("mode", "local-prefill"), ("reason", "none")]
        ),
        6.0
    );
    drop(cluster);

    // The same engines declared with fixed roles: every first turn goes through P.
    let cluster = start(true).await;
    wait_for(&cluster, "all scraped", |ws| {
        ws.iter().all(|w| w.state.health == Health::Healthy)
    })
    .await;
    for (mode, prefill, decode) in first_turns(&cluster, 1..7).await {
        assert_eq!((mode, prefill), (ExecutionMode::Turn1Seed, Some(0)));
        assert!([1, 2].contains(&decode));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_decode_worker_never_gets_a_local_turn() {
    use kvc_core::ExecutionMode;
    // A loaded vLLM P (serving alone by default, so it may host sessions), an SGLang decode
    // worker and a vLLM one.
    let (p_addr, _p) = mock_engine(&vllm_text(12, 30, 0.8, 5_750)).await;
    let (d1_addr, _d1) = mock_engine(SGLANG_TEXT).await;
    let (d2_addr, d2) = mock_engine(&vllm_text(0, 0, 0.0, 5_750)).await;
    let engines = [
        (p_addr, EngineKind::Vllm),
        (d1_addr, EngineKind::Sglang),
        (d2_addr, EngineKind::Vllm),
    ];
    let cluster = Cluster::start(|cfg| {
        cfg.engine_signals.scrape_interval_ms = 20;
        for (w, (addr, kind)) in cfg.workers.iter_mut().zip(engines) {
            w.snapshot = None;
            w.engine = Some(kind);
            w.metrics_url = Some(format!("http://{addr}/metrics"));
        }
    })
    .await;
    wait_for(&cluster, "all scraped", |ws| {
        ws.iter().all(|w| w.state.health == Health::Healthy)
    })
    .await;
    let mut turns = first_turns(&cluster, 1..9).await;
    // With the vLLM decode worker out of rotation, the SGLang one is the only decode worker.
    *d2.lock() = (StatusCode::SERVICE_UNAVAILABLE, String::new());
    wait_for(&cluster, "d2 down", |ws| ws[2].state.health == Health::Down).await;
    turns.extend(first_turns(&cluster, 9..15).await);
    assert!(
        turns.iter().any(|t| t.2 == 1),
        "the SGLang worker was never chosen: {turns:?}"
    );
    for t in &turns {
        match t.2 {
            1 => assert_eq!((t.0, t.1), (ExecutionMode::Turn1Seed, Some(0)), "{turns:?}"),
            _ => assert!(
                [ExecutionMode::LocalPrefill, ExecutionMode::Turn1Seed].contains(&t.0),
                "{turns:?}"
            ),
        }
    }
}

/// The evictions the router took from its engines' KV events so far.
async fn evictions(cluster: &Cluster) -> f64 {
    let metrics = cluster.metrics().await;
    common::value(&metrics, "kvc_router_event_evictions_total", &[])
}

/// The engines' clock, in seconds: the router's manual clock, now.
fn engine_now(cluster: &Cluster) -> f64 {
    cluster.now() as f64 / 1_000.0
}

/// Reports decision `d` (of request `id`) answered, `resident` tokens left on its worker.
async fn answer_ok(
    client: &mut kvc_proto::pb::router_client::RouterClient<tonic::transport::Channel>,
    d: &kvc_proto::pb::RouteDecision,
    id: u64,
    resident: u64,
) {
    use kvc_proto::convert::ProtoEnum;
    client
        .report_outcome(kvc_proto::pb::OutcomeReport {
            decision_id: d.decision_id,
            request_id: id,
            outcome: kvc_core::Outcome::Ok.to_proto(),
            resident_tokens: resident,
        })
        .await
        .unwrap();
}

/// The events of a session's last turn may not have reached the router when its next turn
/// comes (the engine publishes after its step, the router reads in the background): until the
/// events have caught up with the session's last answer (a batch the engine published since
/// is applied), and for at most `events-lag-ms`, blocks the events never showed on its D are
/// not an eviction; after either, they are. (Blocks the events showed and then removed are one
/// at once: the test above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_right_after_the_last_is_not_judged_by_events_still_on_their_way() {
    use kvc_core::SessionId;
    use kvc_proto::pb;

    let (cluster, publisher, stop, _engines) = events_cluster(|cfg| {
        cfg.engine_signals.events_lag_ms = 2_000;
    })
    .await;
    let mut client = cluster.client.clone();
    let answered = async |client: &mut kvc_proto::pb::router_client::RouterClient<_>,
                          (session, blocks_from): (u64, u64),
                          id: u64,
                          turn: u32| {
        let input = 2_000 + 200 * u64::from(turn);
        let hashes: Vec<u64> = (1..=2 + u64::from(turn)).map(|h| h + blocks_from).collect();
        let d = client
            .route(route_req(id, Some(session), Some(turn), input, &hashes))
            .await
            .unwrap()
            .into_inner();
        answer_ok(client, &d, id, input + 40).await;
        d
    };
    // Each session with its own blocks.
    let (a, b) = (
        (SessionId::from_key("agent-8").0, 0),
        (SessionId::from_key("agent-9").0, 1_000),
    );
    let t1 = answered(&mut client, a, 1, 1).await;
    assert_eq!(
        (t1.mode(), t1.decode_worker),
        (pb::ExecutionMode::Turn1Seed, 1)
    );
    // d1's events so far hold another session's blocks only, published before the answer.
    publish_applied(
        &cluster,
        &publisher,
        engine_now(&cluster) - 1.0,
        vec![stored(500, 4, None, "other")],
        "d1's first batch applied",
    )
    .await;
    // Turn 2 at once (the manual clock has not moved): direct to d1.
    let t2 = answered(&mut client, a, 2, 2).await;
    assert_eq!(
        (t2.mode(), t2.decode_worker),
        (pb::ExecutionMode::DirectToD, 1)
    );
    assert_eq!(evictions(&cluster).await, 0.0);
    // Past the lag, with the session still absent from d1's events: an eviction.
    cluster.clock.advance(2_000);
    wait_for(&cluster, "d1 scraped again", |ws| {
        ws[1].state.health == Health::Healthy && ws[0].state.health == Health::Healthy
    })
    .await;
    let t3 = answered(&mut client, a, 3, 3).await;
    assert_ne!(t3.mode(), pb::ExecutionMode::DirectToD);
    assert_eq!(t3.prefill_worker, Some(0));
    assert_eq!(evictions(&cluster).await, 1.0);

    // Session b: its turn 1 answered, then a batch d1 published after the answer applied
    // without b's blocks: the events have caught up, and b is not there.
    let u1 = answered(&mut client, b, 11, 1).await;
    assert_eq!(
        (u1.mode(), u1.decode_worker),
        (pb::ExecutionMode::Turn1Seed, 1)
    );
    publish_applied(
        &cluster,
        &publisher,
        engine_now(&cluster),
        vec![stored(600, 4, None, "other")],
        "d1's second batch applied",
    )
    .await;
    let u2 = answered(&mut client, b, 12, 2).await;
    assert_ne!(u2.mode(), pb::ExecutionMode::DirectToD);
    assert_eq!(u2.prefill_worker, Some(0));
    assert_eq!(evictions(&cluster).await, 2.0);

    // Session c: the events, caught up, show it holding two blocks of 16 tokens on d1 (say, a
    // shared system prompt's it stored last) where the plan counts on its whole last turn:
    // less than half of it, so not resident.
    let c = (SessionId::from_key("agent-10").0, 2_000);
    let v1 = answered(&mut client, c, 21, 1).await;
    assert_eq!(
        (v1.mode(), v1.decode_worker),
        (pb::ExecutionMode::Turn1Seed, 1)
    );
    publish_applied(
        &cluster,
        &publisher,
        engine_now(&cluster),
        vec![stored(700, 2, None, "agent-10")],
        "d1's third batch applied",
    )
    .await;
    let v2 = answered(&mut client, c, 22, 2).await;
    assert_ne!(v2.mode(), pb::ExecutionMode::DirectToD);
    assert_eq!(evictions(&cluster).await, 3.0);
    stop.cancel();
}

/// A request of a session while an earlier one of it on the same worker is still waiting for
/// its outcome (an agent's title request beside its turn; a seed whose prefill and transfer
/// take longer than `events-lag-ms`): the worker's events, caught up and past the lag, do not
/// show the session's blocks yet, and that is no eviction: the KV is on its way. Once the
/// earlier request is answered, the events judge again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_beside_the_sessions_seed_in_flight_is_not_judged_by_events() {
    use kvc_core::SessionId;
    use kvc_proto::pb;

    let (cluster, publisher, stop, _engines) = events_cluster(|cfg| {
        cfg.engine_signals.events_lag_ms = 2_000;
    })
    .await;
    let mut client = cluster.client.clone();
    let session = SessionId::from_key("agent-11").0;

    // The seed: P→D to d1, not answered yet.
    let seed = client
        .route(route_req(1, Some(session), Some(1), 1_448, &[3_001, 3_002]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (seed.mode(), seed.decode_worker),
        (pb::ExecutionMode::Turn1Seed, 1)
    );
    // Thirty seconds on, d1 has published since (other sessions' blocks), never this one's.
    cluster.clock.advance(30_000);
    wait_for(&cluster, "p and d1 scraped again", |ws| {
        ws[1].state.health == Health::Healthy && ws[0].state.health == Health::Healthy
    })
    .await;
    publish_applied(
        &cluster,
        &publisher,
        engine_now(&cluster),
        vec![stored(800, 4, None, "other")],
        "d1's batch applied",
    )
    .await;
    // The session's next request, its seed still in flight: direct to d1, no eviction.
    let beside = client
        .route(route_req(
            2,
            Some(session),
            Some(2),
            5_712,
            &[4_001, 4_002, 4_003],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (beside.mode(), beside.decode_worker),
        (pb::ExecutionMode::DirectToD, 1)
    );
    assert_eq!(evictions(&cluster).await, 0.0);

    // Both answered; d1 publishes again after the answers, still without the session's
    // blocks: now that is an eviction, and the next turn goes through P.
    answer_ok(&mut client, &seed, 1, 1_488).await;
    answer_ok(&mut client, &beside, 2, 5_752).await;
    cluster.clock.advance(10);
    publish_applied(
        &cluster,
        &publisher,
        engine_now(&cluster),
        vec![stored(900, 4, None, "other")],
        "d1's batch after the answers applied",
    )
    .await;
    let next = client
        .route(route_req(
            3,
            Some(session),
            Some(3),
            5_900,
            &[4_001, 4_002, 4_003, 4_004],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_ne!(next.mode(), pb::ExecutionMode::DirectToD);
    assert_eq!(next.prefill_worker, Some(0));
    assert_eq!(evictions(&cluster).await, 1.0);
    stop.cancel();
}

/// On a stock engine the session's cached blocks sit in the room the engine reports free, and
/// the KV of P→D requests on their way there takes that room before a direct turn runs: a
/// direct turn goes through P while what is inbound leaves no room for the session beside it,
/// and direct again once it has landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_turn_needs_room_for_its_session_beside_the_kv_on_its_way() {
    use kvc_core::{Outcome, SessionId};
    use kvc_proto::convert::ProtoEnum;
    use kvc_proto::pb;

    // d1: 92,000 tokens, 10 % used by running requests: 82,800 free by its /metrics.
    let (cluster, publisher, stop, _engines) = events_cluster(|_| {}).await;
    let mut client = cluster.client.clone();
    let report = async |client: &mut kvc_proto::pb::router_client::RouterClient<_>,
                        d: &pb::RouteDecision,
                        id: u64,
                        resident: u64| {
        client
            .report_outcome(pb::OutcomeReport {
                decision_id: d.decision_id,
                request_id: id,
                outcome: Outcome::Ok.to_proto(),
                resident_tokens: resident,
            })
            .await
            .unwrap();
    };
    let reroutes = async |cluster: &Cluster| {
        let metrics = cluster.metrics().await;
        common::value(&metrics, "kvc_router_probe_reroutes_total", &[])
    };
    let key = "agent-11";
    let session = SessionId::from_key(key).0;
    let t1 = client
        .route(route_req(1, Some(session), Some(1), 2_000, &[1, 2, 3]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (t1.mode(), t1.decode_worker),
        (pb::ExecutionMode::Turn1Seed, 1)
    );
    report(&mut client, &t1, 1, 2_040).await;
    publish_applied(
        &cluster,
        &publisher,
        0.0,
        vec![stored(100, 127, None, key)],
        "the session's blocks indexed",
    )
    .await;
    wait_for(&cluster, "the session's blocks indexed", |ws| {
        ws[1]
            .events
            .as_ref()
            .is_some_and(|e| e.indexed_blocks == 127)
    })
    .await;

    // Four first turns of 45 blocks (512 tokens each) sent P→D to d1, none answered yet:
    // 92,160 tokens of KV on their way to it.
    let mut inbound = Vec::new();
    for i in 0..4u64 {
        let id = 100 + i;
        let hashes: Vec<u64> = (0..45).map(|b| 10_000 * (i + 1) + b).collect();
        let d = client
            .route(route_req(id, Some(500 + i), Some(1), 23_040, &hashes))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (d.mode(), d.decode_worker),
            (pb::ExecutionMode::Turn1Seed, 1)
        );
        inbound.push((id, d));
    }
    // Turn 2 needs 200 new tokens beside what d1 holds of it: room by d1's figures alone
    // (82,800 free, or 84,840 once the session's first answer is counted out), none beside
    // what is inbound.
    let t2 = client
        .route(route_req(2, Some(session), Some(2), 2_200, &[1, 2, 3, 4]))
        .await
        .unwrap()
        .into_inner();
    assert_ne!(t2.mode(), pb::ExecutionMode::DirectToD);
    assert_eq!((t2.prefill_worker, t2.decode_worker), (Some(0), 1));
    assert_eq!(reroutes(&cluster).await, 1.0);
    report(&mut client, &t2, 2, 2_240).await;

    // Two of them land (answered): 46,080 tokens still inbound, and room for the session.
    for (id, d) in inbound.drain(..2) {
        report(&mut client, &d, id, 23_080).await;
    }
    let t3 = client
        .route(route_req(
            3,
            Some(session),
            Some(3),
            2_400,
            &[1, 2, 3, 4, 5],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (t3.mode(), t3.decode_worker),
        (pb::ExecutionMode::DirectToD, 1)
    );
    assert_eq!(reroutes(&cluster).await, 1.0);
    stop.cancel();
}
