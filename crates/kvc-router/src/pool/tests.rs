use super::*;
use serde_json::json;
use std::path::PathBuf;

fn pod(name: &str, ip: Option<&str>, ready: bool, role: Option<&str>) -> Value {
    let mut labels = json!({"app": "vllm"});
    if let Some(r) = role {
        labels["llm-d.ai/role"] = json!(r);
    }
    json!({
        "metadata": {"name": name, "labels": labels},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [
                {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": if ready { "True" } else { "False" }},
            ],
        },
    })
}

fn pods(items: Vec<Value>) -> Vec<Pod> {
    let body = serde_json::to_vec(&json!({"kind": "PodList", "items": items})).unwrap();
    parse_pods(&body, "llm-d.ai/role", WorkerRole::Colocated).unwrap()
}

#[test]
fn api_urls_are_read_with_their_default_ports() {
    assert_eq!(
        ApiUrl::parse("https://10.96.0.1").unwrap(),
        ApiUrl {
            https: true,
            host: "10.96.0.1".into(),
            port: 443
        }
    );
    let proxy = ApiUrl::parse("http://127.0.0.1:8001/").unwrap();
    assert_eq!((proxy.https, proxy.port), (false, 8001));
    assert_eq!(proxy.to_string(), "http://127.0.0.1:8001");
    let v6 = ApiUrl::parse("https://[fd00::1]:6443").unwrap();
    assert_eq!((v6.host.as_str(), v6.port), ("fd00::1", 6443));
    assert_eq!(v6.to_string(), "https://[fd00::1]:6443");
    for bad in [
        "10.96.0.1:443",
        "ftp://host",
        "https://",
        "https://host:0",
        "https://host:http",
        "https://host/api",
        "https://[fd00::1",
    ] {
        assert!(ApiUrl::parse(bad).is_err(), "{bad} was accepted");
    }
}

#[test]
fn a_v1_pool_gives_its_match_labels_and_first_target_port() {
    let body = json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "spec": {
            "selector": {"matchLabels": {"app": "vllm", "llm-d.ai/inference-serving": "true"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
        },
    });
    let spec = parse_pool(&serde_json::to_vec(&body).unwrap()).unwrap();
    assert_eq!(spec.port, 8000);
    assert_eq!(
        spec.selector,
        vec![
            ("app".to_owned(), "vllm".to_owned()),
            ("llm-d.ai/inference-serving".to_owned(), "true".to_owned())
        ]
    );
    assert_eq!(
        spec.label_selector(),
        "app%3Dvllm%2Cllm-d.ai%2Finference-serving%3Dtrue"
    );
}

#[test]
fn a_v1alpha2_pool_gives_its_flat_selector_and_port_number() {
    let body = json!({"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000}});
    let spec = parse_pool(&serde_json::to_vec(&body).unwrap()).unwrap();
    assert_eq!(spec.port, 8000);
    assert_eq!(spec.selector, vec![("app".to_owned(), "vllm".to_owned())]);
}

#[test]
fn pools_that_cannot_be_followed_say_why() {
    let cases = [
        (
            json!({"spec": {"selector": {"matchLabels": {"app": "v"}}}}),
            "target port",
        ),
        (
            json!({"spec": {"selector": {"matchLabels": {"app": "v"}, "matchExpressions": [{"key": "app"}]}, "targetPorts": [{"number": 1}]}}),
            "matchExpressions",
        ),
        (
            json!({"spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}}),
            "every pod",
        ),
        (
            json!({"spec": {"selector": {"matchLabels": {"app": 3}}, "targetPorts": [{"number": 1}]}}),
            "not a string",
        ),
        (
            json!({"spec": {"targetPorts": [{"number": 1}]}}),
            "spec.selector",
        ),
        (json!({"kind": "Status"}), "no spec"),
        (
            json!({"spec": {"selector": {"app": "v"}, "targetPorts": [{"number": 70000}]}}),
            "target port",
        ),
    ];
    for (body, expected) in cases {
        let err = parse_pool(&serde_json::to_vec(&body).unwrap()).unwrap_err();
        assert!(err.contains(expected), "{body}: {err}");
    }
    assert!(parse_pool(b"<html>").unwrap_err().contains("not JSON"));
}

#[test]
fn pods_are_ready_only_running_ready_with_an_ip_and_not_terminating() {
    let mut terminating = pod("d-3", Some("10.0.0.4"), true, Some("decode"));
    terminating["metadata"]["deletionTimestamp"] = json!("2026-12-04T01:00:00Z");
    let mut pending = pod("d-4", Some("10.0.0.5"), true, Some("decode"));
    pending["status"]["phase"] = json!("Pending");
    let list = pods(vec![
        pod("d-1", Some("10.0.0.2"), true, Some("decode")),
        pod("p-0", Some("10.0.0.1"), true, Some("prefill")),
        pod("d-2", Some("10.0.0.3"), false, Some("both")),
        terminating,
        pending,
        pod("d-5", None, true, Some("decode")),
        pod("c-0", Some("fd00::7"), true, None),
        pod("x-0", Some("10.0.0.9"), true, Some("router")),
    ]);
    let summary: Vec<(&str, bool, Option<WorkerRole>)> = list
        .iter()
        .map(|p| (p.name.as_str(), p.ready, p.role.clone().ok()))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("c-0", true, Some(WorkerRole::Colocated)),
            ("d-1", true, Some(WorkerRole::Decode)),
            ("d-2", false, Some(WorkerRole::Decode)),
            ("d-3", false, Some(WorkerRole::Decode)),
            ("d-4", false, Some(WorkerRole::Decode)),
            ("d-5", false, Some(WorkerRole::Decode)),
            ("p-0", true, Some(WorkerRole::Prefill)),
            ("x-0", true, None),
        ]
    );
    assert!(
        list[7]
            .role
            .as_ref()
            .unwrap_err()
            .contains("llm-d.ai/role=router")
    );
    assert_eq!(list[0].ip, Some("fd00::7".parse().unwrap()));
}

#[test]
fn pod_lists_that_cannot_be_read_say_why() {
    let bad_ip = json!({"items": [pod("d-0", Some("10.0.0.300"), true, None)]});
    let err = parse_pods(
        &serde_json::to_vec(&bad_ip).unwrap(),
        "role",
        WorkerRole::Decode,
    )
    .unwrap_err();
    assert!(err.contains("`d-0`") && err.contains("10.0.0.300"), "{err}");
    let nameless = json!({"items": [{"metadata": {}}]});
    let err = parse_pods(
        &serde_json::to_vec(&nameless).unwrap(),
        "role",
        WorkerRole::Decode,
    )
    .unwrap_err();
    assert!(
        err.contains("pod 0") && err.contains("metadata.name"),
        "{err}"
    );
    assert!(
        parse_pods(b"{}", "role", WorkerRole::Decode)
            .unwrap_err()
            .contains("no items")
    );
}

fn known(entries: &[(&str, u32, &str, WorkerRole, bool)]) -> BTreeMap<String, PoolWorker> {
    entries
        .iter()
        .map(|&(name, id, url, role, drained)| {
            (
                name.to_owned(),
                PoolWorker {
                    id,
                    url: url.to_owned(),
                    role,
                    drained,
                },
            )
        })
        .collect()
}

#[test]
fn a_first_poll_adds_the_ready_pods_decode_before_prefill() {
    let list = pods(vec![
        pod("a-prefill", Some("10.0.0.1"), true, Some("prefill")),
        pod("b-decode", Some("10.0.0.2"), true, Some("decode")),
        pod("c-decode", Some("10.0.0.3"), false, Some("decode")),
        pod("d-odd", Some("10.0.0.4"), true, Some("gateway")),
        pod("e-decode", Some("fd00::5"), true, Some("decode")),
    ]);
    let steps = plan(&BTreeMap::new(), &list, 8000);
    assert_eq!(
        steps,
        vec![
            Step::Add {
                pod: "b-decode".into(),
                url: "http://10.0.0.2:8000".into(),
                role: WorkerRole::Decode
            },
            Step::Add {
                pod: "e-decode".into(),
                url: "http://[fd00::5]:8000".into(),
                role: WorkerRole::Decode
            },
            Step::Add {
                pod: "a-prefill".into(),
                url: "http://10.0.0.1:8000".into(),
                role: WorkerRole::Prefill
            },
        ]
    );
}

#[test]
fn later_polls_drain_undrain_remove_and_replace() {
    let k = known(&[
        (
            "p-0",
            1024,
            "http://10.0.0.1:8000",
            WorkerRole::Prefill,
            false,
        ),
        (
            "d-1",
            1025,
            "http://10.0.0.2:8000",
            WorkerRole::Decode,
            false,
        ),
        (
            "d-2",
            1026,
            "http://10.0.0.3:8000",
            WorkerRole::Decode,
            true,
        ),
        (
            "d-3",
            1027,
            "http://10.0.0.4:8000",
            WorkerRole::Decode,
            false,
        ),
        (
            "d-4",
            1028,
            "http://10.0.0.5:8000",
            WorkerRole::Decode,
            false,
        ),
        (
            "d-5",
            1029,
            "http://10.0.0.6:8000",
            WorkerRole::Decode,
            false,
        ),
    ]);
    let list = pods(vec![
        // p-0 unchanged; d-1 no longer ready; d-2 ready again; d-3 gone;
        // d-4 restarted with another IP; d-5 has no IP for now (restarting).
        pod("p-0", Some("10.0.0.1"), true, Some("prefill")),
        pod("d-1", Some("10.0.0.2"), false, Some("decode")),
        pod("d-2", Some("10.0.0.3"), true, Some("decode")),
        pod("d-4", Some("10.0.0.15"), true, Some("decode")),
        pod("d-5", None, false, Some("decode")),
        pod("d-6", Some("10.0.0.7"), true, Some("decode")),
    ]);
    let steps = plan(&k, &list, 8000);
    assert_eq!(
        steps,
        vec![
            Step::Drain("d-1".into()),
            Step::Undrain("d-2".into()),
            Step::Remove("d-3".into()),
            Step::Remove("d-4".into()),
            Step::Drain("d-5".into()),
            Step::Add {
                pod: "d-4".into(),
                url: "http://10.0.0.15:8000".into(),
                role: WorkerRole::Decode
            },
            Step::Add {
                pod: "d-6".into(),
                url: "http://10.0.0.7:8000".into(),
                role: WorkerRole::Decode
            },
        ]
    );
    // A fleet that already follows its pods changes nothing.
    let settled = known(&[(
        "p-0",
        1024,
        "http://10.0.0.1:8000",
        WorkerRole::Prefill,
        false,
    )]);
    let same = pods(vec![pod("p-0", Some("10.0.0.1"), true, Some("prefill"))]);
    assert_eq!(plan(&settled, &same, 8000), vec![]);
    // A relabelled pod leaves and joins in its new role.
    let relabelled = pods(vec![pod("p-0", Some("10.0.0.1"), true, Some("decode"))]);
    assert_eq!(
        plan(&settled, &relabelled, 8000),
        vec![
            Step::Remove("p-0".into()),
            Step::Add {
                pod: "p-0".into(),
                url: "http://10.0.0.1:8000".into(),
                role: WorkerRole::Decode
            }
        ]
    );
}

#[test]
fn a_pods_worker_is_a_vllm_engine_known_by_its_url() {
    let w = pod_worker(
        1030,
        "vllm-decode-7f9c",
        "http://10.0.0.2:8000",
        WorkerRole::Decode,
    );
    assert_eq!(w.id, 1030);
    assert_eq!(w.name.as_deref(), Some("vllm-decode-7f9c"));
    assert_eq!(w.engine, Some(EngineKind::Vllm));
    assert_eq!(w.http_url.as_deref(), Some("http://10.0.0.2:8000"));
    assert_eq!(w.capacity_tokens, 0);
    assert_eq!(
        w.metrics_url.as_deref(),
        Some("http://10.0.0.2:8000/metrics")
    );
    assert!(w.kv_events.is_none() && w.discovers());
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvc-pool-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn the_defaults_come_from_the_pod_the_router_runs_in() {
    let cfg = InferencePoolConfig {
        name: "vllm-pd".into(),
        ..InferencePoolConfig::default()
    };
    // Outside a pod: no API address.
    let empty = temp_dir("empty");
    let err = PoolReader::with_env(&cfg, |_| None, &empty).err().unwrap();
    assert!(err.to_string().contains("KUBERNETES_SERVICE_HOST"), "{err}");
    // In a pod whose service account directory is missing its namespace file.
    let env = |k: &str| match k {
        "KUBERNETES_SERVICE_HOST" => Some("fd00::1".to_owned()),
        "KUBERNETES_SERVICE_PORT" => Some("6443".to_owned()),
        _ => None,
    };
    let err = PoolReader::with_env(&cfg, env, &empty).err().unwrap();
    assert!(err.to_string().contains("set namespace"), "{err}");
    // The namespace there, but no CA for the https API: the file is named.
    std::fs::write(empty.join("namespace"), "llm\n").unwrap();
    let err = PoolReader::with_env(&cfg, env, &empty).err().unwrap();
    assert!(err.to_string().contains("ca.crt"), "{err}");
    // A plain-HTTP API (kubectl proxy) needs no CA; no token file, no token.
    let proxy = InferencePoolConfig {
        api_url: Some("http://127.0.0.1:8001".into()),
        ..cfg.clone()
    };
    let reader = PoolReader::with_env(&proxy, env, &empty).unwrap();
    assert_eq!(reader.namespace, "llm");
    assert_eq!(reader.api.url.to_string(), "http://127.0.0.1:8001");
    assert!(reader.api.token_file.is_none() && reader.api.tls.is_none());
    std::fs::write(empty.join("token"), "t0k3n").unwrap();
    let reader = PoolReader::with_env(&proxy, env, &empty).unwrap();
    assert_eq!(reader.api.token_file, Some(empty.join("token")));
    let _ = std::fs::remove_dir_all(&empty);
}
