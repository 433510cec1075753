//! The configuration's parsing, defaults and checks, on TOML documents.

use super::*;

#[test]
fn example_file_parses() {
    let text = include_str!("../../examples/router.toml");
    let cfg = RouterConfig::from_toml_str(text).unwrap();
    assert_eq!(cfg.workers.len(), 5);
    // The worker given by engine and http-url alone: its metrics URL derived, its event
    // source left to discovery, in rotation.
    let bare = &cfg.workers[4];
    assert_eq!(
        bare.metrics_url.as_deref(),
        Some("http://127.0.0.1:30004/metrics")
    );
    assert!(bare.discovers_events() && !bare.drained && bare.kv_events.is_none());
    assert!(!cfg.workers[3].discovers_events(), "kv-events configured");
    assert_eq!(cfg.workers[3].engine, Some(EngineKind::Vllm));
    assert_eq!(
        cfg.workers[3].metrics_url.as_deref(),
        Some("http://127.0.0.1:30003/metrics")
    );
    assert_eq!(cfg.engine_signals, EngineSignalsConfig::default());
    assert_eq!(
        cfg.workers[3].kv_events.as_deref(),
        Some("tcp://127.0.0.1:5557")
    );
    assert_eq!(cfg.workers[3].block_size, None);
    assert_eq!(cfg.workers[0].role, WorkerRole::Prefill);
    assert_eq!(cfg.sessions.ttl_ms, 600_000);
    assert_eq!(cfg.policy.name(), "kvc");
    assert_eq!(
        cfg.http_listen,
        Some(SocketAddr::from(([127, 0, 0, 1], 8000)))
    );
    assert_eq!(cfg.http, HttpConfig::default());
    assert_eq!(cfg.http.infer_min_blocks, 1);
    assert_eq!(cfg.http.tokenizer, None);
    assert_eq!(cfg.http.max_retries, 2);
    assert!(cfg.workers.iter().all(|w| w.can_append_prefill()));
    assert!(cfg.workers.iter().all(|w| w.http_url.is_some()));
    assert_eq!(cfg.workers[0].bootstrap_port, Some(8998));
    assert_eq!(
        cfg.workers[1].http_url.as_deref(),
        Some("http://127.0.0.1:30001")
    );
    assert_eq!(cfg.workers[2].bootstrap_port, None);
    let url = WorkerUrl::parse(cfg.workers[0].http_url.as_deref().unwrap()).unwrap();
    assert_eq!(url.port, 30000);
    // The HTTP keys survive a round trip inline in `[[workers]]`.
    let text = toml::to_string(&cfg).unwrap();
    assert!(
        text.contains("http-url = \"http://127.0.0.1:30002\""),
        "{text}"
    );
    assert_eq!(RouterConfig::from_toml_str(&text).unwrap(), cfg);
}

#[test]
fn http_keys_are_validated() {
    let worker = "[[workers]]\nid = 0\nrole = \"prefill\"\ncapacity-tokens = 10\nsnapshot = \"/p\"\n\
                  [[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/x\"\n";
    let cfg = RouterConfig::from_toml_str(worker).unwrap();
    assert_eq!(cfg.http_listen, None);
    assert!(cfg.workers.iter().all(|w| w.http_url.is_none()));
    for url in [
        "https://h:1",
        "http://:1",
        "http://h:x",
        "http://h/a b",
        "http://h/?q=1",
    ] {
        let bad_url = format!("{worker}http-url = \"{url}\"\n");
        let err = RouterConfig::from_toml_str(&bad_url).unwrap_err();
        assert!(
            matches!(err, ConfigError::Invalid(ref m) if m.contains("http-url") && m.contains("worker 1")),
            "{url}: {err}"
        );
    }
    let orphan_port = format!("{worker}bootstrap-port = 9000\n");
    let err = RouterConfig::from_toml_str(&orphan_port).unwrap_err();
    assert!(
        matches!(err, ConfigError::Invalid(ref m) if m.contains("needs `http-url`")),
        "{err}"
    );
    let bad_listen = format!("http-listen = \"nowhere\"\n{worker}");
    assert!(matches!(
        RouterConfig::from_toml_str(&bad_listen),
        Err(ConfigError::Parse(_))
    ));
    let unknown = format!("{worker}http-port = 1\n");
    assert!(matches!(
        RouterConfig::from_toml_str(&unknown),
        Err(ConfigError::Parse(_))
    ));
}

#[test]
fn worker_urls_parse() {
    let u = WorkerUrl::parse("http://10.0.0.1:30000").unwrap();
    assert_eq!(
        (u.host.as_str(), u.port, u.prefix.as_str()),
        ("10.0.0.1", 30000, "")
    );
    assert_eq!(u.uri("/generate"), "http://10.0.0.1:30000/generate");
    let u = WorkerUrl::parse("http://h/p/").unwrap();
    assert_eq!((u.port, u.prefix.as_str()), (80, "/p"));
    assert_eq!(u.uri("/health"), "http://h:80/p/health");
    let u = WorkerUrl::parse("http://[fe80::1]").unwrap();
    assert_eq!((u.host.as_str(), u.port), ("fe80::1", 80));
    for bad in ["http://[::1", "http://[::1]x", "ftp://h", "http://h:70000"] {
        assert_eq!(WorkerUrl::parse(bad), Err(bad.to_owned()));
    }
}

#[test]
fn the_http_table_is_parsed_and_validated() {
    let cfg = RouterConfig::from_toml_str(
        "[http]\nmax-retries = 1\nbreaker-failures = 0\nhealth-check-interval-ms = 0\n\
         request-timeout-ms = 700\npool-max-idle-per-worker = 0\n",
    )
    .unwrap();
    assert_eq!(cfg.http.max_retries, 1);
    assert_eq!(
        cfg.http.retry_backoff_ms, 25,
        "absent keys take their defaults"
    );
    assert_eq!(cfg.http.breaker_failures, 0);
    assert_eq!(cfg.http.health_check_interval_ms, 0);
    assert_eq!(cfg.http.request_timeout_ms, 700);
    assert_eq!(cfg.http.pool_max_idle_per_worker, 0);
    assert_eq!(cfg.http.connect_timeout_ms, 5_000);
    for (text, key) in [
        ("[http]\nrequest-timeout-ms = 0\n", "request-timeout-ms"),
        ("[http]\nconnect-timeout-ms = 0\n", "connect-timeout-ms"),
        ("[http]\npool-idle-timeout-ms = 0\n", "pool-idle-timeout-ms"),
        (
            "[http]\nhealth-check-timeout-ms = 0\n",
            "health-check-timeout-ms",
        ),
        ("[http]\nmax-retries = 11\n", "max-retries"),
        (
            "[http]\nbreaker-cooldown-ms = 10\nbreaker-max-cooldown-ms = 5\n",
            "breaker-max-cooldown-ms",
        ),
    ] {
        let err = RouterConfig::from_toml_str(text).unwrap_err();
        assert!(
            matches!(err, ConfigError::Invalid(ref m) if m.contains(key)),
            "{text}: {err}"
        );
    }
    assert!(matches!(
        RouterConfig::from_toml_str("[http]\nretries = 1\n"),
        Err(ConfigError::Parse(_))
    ));
}

#[test]
fn a_stock_sglang_decode_worker_gets_no_direct_turn_unless_declared() {
    let mut w = WorkerConfig::new(1, WorkerRole::Decode, 10);
    assert!(w.can_append_prefill(), "kvc's own workers append-prefill");
    w.engine = Some(EngineKind::Vllm);
    assert!(
        w.can_append_prefill(),
        "vLLM serves a plain request in full"
    );
    w.engine = Some(EngineKind::Sglang);
    assert!(
        !w.can_append_prefill(),
        "stock SGLang cannot serve without a room"
    );
    w.append_prefill = Some(true);
    assert!(w.can_append_prefill(), "a patched engine, declared");
    w.engine = Some(EngineKind::Vllm);
    w.append_prefill = Some(false);
    assert!(!w.can_append_prefill());
    // An SGLang prefill worker's default `false` is not a misplaced key.
    let mut p = WorkerConfig::new(0, WorkerRole::Prefill, 10);
    p.snapshot = Some("/p".into());
    p.engine = Some(EngineKind::Sglang);
    assert!(p.validate().is_ok());
}

#[test]
fn serving_alone_defaults_from_the_engine_and_can_be_declared() {
    let caps = |role, engine, serve_alone| {
        let mut w = WorkerConfig::new(0, role, 10);
        w.engine = engine;
        w.serve_alone = serve_alone;
        w.capabilities()
    };
    let (p, d, c) = (
        WorkerRole::Prefill,
        WorkerRole::Decode,
        WorkerRole::Colocated,
    );
    let vllm = Some(EngineKind::Vllm);
    let sglang = Some(EngineKind::Sglang);
    // No engine, or SGLang: the role's own work only, as before capabilities existed.
    for role in [p, d, c] {
        assert_eq!(caps(role, None, None), Capabilities::of_role(role));
        assert_eq!(caps(role, sglang, None), Capabilities::of_role(role));
    }
    // vLLM of either role serves a plain request in full.
    for role in [p, d] {
        assert_eq!(
            caps(role, vllm, None),
            Capabilities::of_role(role).with_local()
        );
        assert_eq!(caps(role, vllm, Some(false)), Capabilities::of_role(role));
        assert_eq!(
            caps(role, None, Some(true)),
            Capabilities::of_role(role).with_local(),
            "kvc's own engine, declared"
        );
    }
    assert_eq!(caps(c, vllm, None), Capabilities::of_role(c));
}

#[test]
fn a_decode_worker_declared_to_send_kv_sends_its_sessions_kv_and_nothing_else_may() {
    let base = "[[workers]]\nid = 0\nrole = \"prefill\"\ncapacity-tokens = 10\nsnapshot = \"/p\"\n\
                [[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/d\"\n";
    let cfg =
        RouterConfig::from_toml_str(&format!("{base}engine = \"vllm\"\nsend-kv = true\n")).unwrap();
    let caps = cfg.workers[1].capabilities();
    assert!(caps.send_kv && caps.decode && !caps.prefill, "{caps:?}");
    // Not declared: no sending; the key is written out only when set.
    let plain = RouterConfig::from_toml_str(base).unwrap();
    assert!(!plain.workers[1].capabilities().send_kv);
    assert!(!toml::to_string(&plain).unwrap().contains("send-kv"));
    assert_eq!(
        toml::to_string(&cfg)
            .unwrap()
            .matches("send-kv = true")
            .count(),
        1
    );
    let sglang =
        RouterConfig::from_toml_str(&format!("{base}engine = \"sglang\"\nsend-kv = true\n"))
            .unwrap_err();
    assert!(
        matches!(sglang, ConfigError::Invalid(ref m) if m.contains("worker 1: send-kv") && m.contains("stock SGLang decode server")),
        "{sglang}"
    );
    let on_p = "[[workers]]\nid = 0\nrole = \"prefill\"\ncapacity-tokens = 10\nsnapshot = \"/p\"\n\
                send-kv = true\n[[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\n\
                snapshot = \"/d\"\n";
    let err = RouterConfig::from_toml_str(on_p).unwrap_err();
    assert!(
        matches!(err, ConfigError::Invalid(ref m) if m.contains("worker 0: send-kv applies to decode workers only")),
        "{err}"
    );
}

#[test]
fn serve_alone_is_refused_where_the_engine_cannot() {
    let base = "[[workers]]\nid = 0\nrole = \"prefill\"\ncapacity-tokens = 10\nsnapshot = \"/p\"\n\
                [[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/d\"\n";
    let with = |extra: &str| RouterConfig::from_toml_str(&format!("{base}{extra}"));
    let cfg = with("engine = \"vllm\"\nserve-alone = false\n").unwrap();
    assert_eq!(cfg.workers[1].serve_alone, Some(false));
    assert!(!cfg.workers[1].capabilities().local);
    // It survives a round trip; an absent key is not written out.
    let out = toml::to_string(&cfg).unwrap();
    assert_eq!(out.matches("serve-alone").count(), 1, "{out}");
    assert_eq!(RouterConfig::from_toml_str(&out).unwrap(), cfg);
    assert!(with("engine = \"sglang\"\nserve-alone = false\n").is_ok());
    let err = with("engine = \"sglang\"\nserve-alone = true\n").unwrap_err();
    assert!(
        matches!(err, ConfigError::Invalid(ref m)
            if m.contains("serve-alone = true") && m.contains("stock SGLang decode")),
        "{err}"
    );
    let colocated = "[[workers]]\nid = 0\nrole = \"colocated\"\ncapacity-tokens = 10\n\
                     snapshot = \"/c\"\nserve-alone = true\n";
    let err = RouterConfig::from_toml_str(colocated).unwrap_err();
    assert!(
        matches!(err, ConfigError::Invalid(ref m) if m.contains("prefill and decode workers only")),
        "{err}"
    );
    assert!(matches!(
        with("serve-alone = \"yes\"\n"),
        Err(ConfigError::Parse(_))
    ));
}

#[test]
fn append_prefill_is_a_decode_worker_key() {
    let text = "[[workers]]\nid = 0\nrole = \"prefill\"\ncapacity-tokens = 10\nsnapshot = \"/p\"\n\
                [[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/d1\"\n\
                append-prefill = false\n\
                [[workers]]\nid = 2\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/d2\"\n\
                append-prefill = true\n";
    let cfg = RouterConfig::from_toml_str(text).unwrap();
    let off: Vec<u32> = cfg
        .workers
        .iter()
        .filter(|w| !w.can_append_prefill())
        .map(|w| w.id)
        .collect();
    assert_eq!(off, [1]);
    // It survives a round trip; an absent key is not written out.
    let out = toml::to_string(&cfg).unwrap();
    assert_eq!(out.matches("append-prefill = false").count(), 1, "{out}");
    assert_eq!(out.matches("append-prefill").count(), 2, "{out}");
    assert_eq!(RouterConfig::from_toml_str(&out).unwrap(), cfg);
    // The policy state learns it.
    let svc = crate::RouterService::new(cfg).unwrap();
    assert!(
        !svc.config()
            .worker(WorkerId(1))
            .unwrap()
            .can_append_prefill()
    );
    let bad = text.replace(
        "snapshot = \"/p\"\n",
        "snapshot = \"/p\"\nappend-prefill = false\n",
    );
    let err = RouterConfig::from_toml_str(&bad).unwrap_err();
    assert!(
        matches!(err, ConfigError::Invalid(ref m) if m.contains("decode workers only") && m.contains("worker 0")),
        "{err}"
    );
}

#[test]
fn tokenizer_and_inference_keys() {
    let cfg = RouterConfig::from_toml_str(
        "[http]\ntokenizer = \"/nowhere/tokenizer.json\"\ninfer-min-blocks = 0\n",
    )
    .unwrap();
    assert_eq!(
        cfg.http.tokenizer.as_deref(),
        Some(Path::new("/nowhere/tokenizer.json"))
    );
    assert_eq!(cfg.http.infer_min_blocks, 0);
    let text = toml::to_string(&cfg).unwrap();
    assert_eq!(RouterConfig::from_toml_str(&text).unwrap(), cfg);
    assert!(
        !toml::to_string(&RouterConfig::default())
            .unwrap()
            .contains("tokenizer")
    );
}

/// The message of the error `toml` is rejected with.
fn error_of(toml: &str) -> String {
    RouterConfig::from_toml_str(toml).unwrap_err().to_string()
}

#[test]
fn rejects_bad_configs() {
    let base = "[[workers]]\nid = 1\nrole = \"decode\"\ncapacity-tokens = 10\n";
    // The same worker alone in a cluster that can route.
    let colocated = |toml: &str| toml.replace("\"decode\"", "\"colocated\"");
    assert!(error_of(base).contains("a snapshot path, a service address or a metrics-url"));
    let dup = format!("{base}snapshot = \"/x\"\n{base}snapshot = \"/y\"\n");
    assert!(error_of(&dup).contains("twice"));
    let scraped = format!("{base}metrics-url = \"http://127.0.0.1:8001/metrics\"\n");
    assert!(error_of(&scraped).contains("`metrics-url` needs `engine`"));
    let garbled = format!("{base}engine = \"vllm\"\nmetrics-url = \"tcp://h:1\"\n");
    assert!(error_of(&garbled).contains("metrics-url `tcp://h:1` is not"));
    let unknown_engine = format!("{scraped}engine = \"trt\"\n");
    assert!(matches!(
        RouterConfig::from_toml_str(&unknown_engine),
        Err(ConfigError::Parse(_))
    ));
    let events = format!(
        "{base}address = \"http://h:2\"\nengine = \"sglang\"\nkv-events = \"tcp://h:5557\"\n"
    );
    assert!(error_of(&events).contains("needs `metrics-url`"));
    let events = format!("{events}metrics-url = \"http://h:1/metrics\"\n");
    assert!(error_of(&events).contains("needs `block-size`"));
    let ok_events = format!("{events}block-size = 32\nkv-events-replay = \"tcp://h:5558\"\n");
    assert_eq!(
        RouterConfig::from_toml_str(&colocated(&ok_events))
            .unwrap()
            .workers[0]
            .block_size,
        Some(32)
    );
    let topic = format!("{ok_events}kv-events-topic = \"kv@pod@m\"\n");
    assert_eq!(
        RouterConfig::from_toml_str(&colocated(&topic))
            .unwrap()
            .workers[0]
            .kv_events_topic
            .as_deref(),
        Some("kv@pod@m")
    );
    let bad_endpoint = ok_events.replace("tcp://h:5557", "udp://h:5557");
    assert!(error_of(&bad_endpoint).contains("kv-events `udp://h:5557` is not tcp://host:port"));
    // The engine's bind form is not an address to connect to; an ipc path is.
    let wildcard = ok_events.replace("tcp://h:5557", "tcp://*:5557");
    assert!(error_of(&wildcard).contains("kv-events `tcp://*:5557` is not tcp://host:port"));
    let ipc = ok_events.replace("tcp://h:5557", "ipc:///run/vllm/events.sock");
    assert_eq!(
        RouterConfig::from_toml_str(&colocated(&ipc))
            .unwrap()
            .workers[0]
            .kv_events
            .as_deref(),
        Some("ipc:///run/vllm/events.sock")
    );
    assert!(error_of(&ok_events.replace("tcp://h:5557", "ipc://")).contains("ipc://path"));
    let orphan = format!("{scraped}engine = \"vllm\"\nkv-events-replay = \"tcp://h:1\"\n");
    assert!(error_of(&orphan).contains("need `kv-events`"));
    let vllm = format!("{scraped}engine = \"vllm\"\nkv-events = \"tcp://h:1\"\n");
    assert!(RouterConfig::from_toml_str(&colocated(&vllm)).is_ok());
    let ok = format!("{scraped}engine = \"sglang\"\n");
    let cfg = RouterConfig::from_toml_str(&colocated(&ok)).unwrap();
    assert_eq!(cfg.workers[0].engine, Some(EngineKind::Sglang));
    assert_eq!(cfg.engine_signals, EngineSignalsConfig::default());
    assert!(
        error_of(&format!("[engine-signals]\nscrape-interval-ms = 0\n{ok}"))
            .contains("engine-signals.scrape-interval-ms must be positive")
    );
    let unknown = "bogus = 1\n";
    assert!(matches!(
        RouterConfig::from_toml_str(unknown),
        Err(ConfigError::Parse(_))
    ));
    for key in [
        "stale-after-ms",
        "refresh-interval-ms",
        "poll-interval-ms",
        "rpc-timeout-ms",
        "max-message-bytes",
        "max-pending-decisions",
    ] {
        let err = RouterConfig::from_toml_str(&format!("{key} = 0\n")).unwrap_err();
        assert!(
            matches!(err, ConfigError::Invalid(ref m) if m == &format!("{key} must be positive")),
            "{key}: {err}"
        );
    }
    for (key, name) in [("ttl-ms", "sessions.ttl-ms"), ("max", "sessions.max")] {
        let err = RouterConfig::from_toml_str(&format!("[sessions]\n{key} = 0\n")).unwrap_err();
        assert!(err.to_string().contains(name), "{err}");
    }
    let policy = "[policy]\npolicy = \"kvc-v2\"\nhard-cap = 3.0\n";
    assert!(matches!(
        RouterConfig::from_toml_str(policy),
        Err(ConfigError::Invalid(_))
    ));
    let range =
        "[[workers]]\nid = 4096\nrole = \"decode\"\ncapacity-tokens = 10\nsnapshot = \"/x\"\n";
    assert!(
        error_of(range).contains("worker id 4096 out of range (ids must be below 4096)"),
        "{}",
        error_of(range)
    );
    let capacity = format!("{}snapshot = \"/x\"\n", base.replace("10", "0"));
    assert!(error_of(&capacity).contains("worker 1 capacity-tokens must be positive"));
    // Left out: only where vLLM's /metrics reports the pool.
    let no_capacity = base.replace("capacity-tokens = 10\n", "");
    let scraped = "metrics-url = \"http://h:1/metrics\"\n";
    let vllm = format!("{no_capacity}engine = \"vllm\"\n{scraped}");
    let cfg = RouterConfig::from_toml_str(&vllm.replace("\"decode\"", "\"colocated\""));
    let cfg = cfg.unwrap();
    assert_eq!(cfg.workers[0].capacity_tokens, 0);
    assert!(cfg.workers[0].pool_from_engine());
    assert!(!toml::to_string(&cfg).unwrap().contains("capacity-tokens"));
    let sglang = format!("{no_capacity}engine = \"sglang\"\n{scraped}");
    assert!(error_of(&sglang).contains("capacity-tokens must be positive"));
    let snapshot = format!("{vllm}snapshot = \"/x\"\n");
    assert!(error_of(&snapshot).contains("may be left out only for an engine = \"vllm\""));
    let address = format!("{base}address = \"not a uri\"\n");
    assert!(error_of(&address).contains("worker 1 address `not a uri` is not a URI"));
}

#[test]
fn defaults_round_trip_through_toml() {
    let cfg = RouterConfig::default();
    let text = toml::to_string(&cfg).unwrap();
    assert_eq!(RouterConfig::from_toml_str(&text).unwrap(), cfg);
}

#[test]
fn the_example_files_inference_pool_table_gives_the_defaults() {
    // The commented-out table of the example file, uncommented, is accepted, and the values
    // it shows are the defaults.
    let text = include_str!("../../examples/router.toml");
    let start = text.find("# [inference-pool]").unwrap();
    let table: String = text[start..]
        .lines()
        .take_while(|l| l.starts_with("# "))
        .map(|l| format!("{}\n", &l[2..]))
        .collect();
    let cfg = RouterConfig::from_toml_str(&table).unwrap();
    let pool = cfg.inference_pool.unwrap();
    assert_eq!(
        pool,
        InferencePoolConfig {
            name: "vllm-pd".into(),
            namespace: Some("llm".into()),
            api_url: Some("https://10.96.0.1:443".into()),
            token_file: Some("/var/run/secrets/kubernetes.io/serviceaccount/token".into()),
            ca_file: Some("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt".into()),
            ..InferencePoolConfig::default()
        }
    );
    assert!(cfg.workers.is_empty());
}

#[test]
fn inference_pool_tables_that_cannot_be_followed_are_refused() {
    let cases = [
        ("", "inference-pool.name is required"),
        (
            "name = \"p\"\nnamespace = \"\"",
            "namespace must not be empty",
        ),
        ("name = \"p\"\napi-version = \"v9\"", "api-version `v9`"),
        (
            "name = \"p\"\napi-url = \"10.96.0.1\"",
            "api-url `10.96.0.1`",
        ),
        (
            "name = \"p\"\npoll-ms = 0",
            "inference-pool.poll-ms must be positive",
        ),
        (
            "name = \"p\"\nrole-label = \"\"",
            "role-label must not be empty",
        ),
        ("name = \"p\"\nfirst-id = 4096", "first-id 4096"),
        ("name = \"p\"\ndefault-role = \"router\"", "default-role"),
        ("name = \"p\"\npods = 3", "pods"),
    ];
    for (body, expected) in cases {
        let err = RouterConfig::from_toml_str(&format!("[inference-pool]\n{body}\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(expected), "{body:?}: {err}");
    }
}
