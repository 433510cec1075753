//! Every file under `examples/` parses, and says what running kvc-router as Envoy's endpoint
//! picker needs: the Envoy bootstrap's ext_proc settings and original-destination cluster, the
//! Kubernetes picker's ports, probes and replicas, and its router configuration accepted by
//! kvc-router, and its picker runs the image `scripts/image/build.sh` makes.
#![forbid(unsafe_code)]

mod common;

use serde::Deserialize as _;
use serde_json::Value;
use std::path::{Path, PathBuf};

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");

/// Every YAML document of `path`, as JSON values.
fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .collect()
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path));
        } else {
            out.push(path);
        }
    }
    out.sort();
    out
}

#[test]
fn every_example_file_parses() {
    let all = files(Path::new(EXAMPLES));
    assert!(all.len() >= 3, "{all:?}");
    for path in &all {
        match path.extension().and_then(|e| e.to_str()) {
            Some("yaml" | "yml") => assert!(!documents(path).is_empty(), "{}", path.display()),
            Some("toml") => {
                kvc_router::RouterConfig::from_file(path)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
            _ => panic!("{}: an example of an unknown kind", path.display()),
        }
    }
}

#[test]
fn the_envoy_bootstrap_streams_both_ways_and_routes_to_the_pick() {
    let b = &documents(&Path::new(EXAMPLES).join("envoy/envoy.yaml"))[0];
    let hcm =
        &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filters = hcm["http_filters"].as_array().unwrap();
    assert_eq!(filters[0]["name"], "envoy.filters.http.ext_proc");
    assert_eq!(filters.last().unwrap()["name"], "envoy.filters.http.router");
    let ext = &filters[0]["typed_config"];
    let mode = &ext["processing_mode"];
    assert_eq!(mode["request_body_mode"], "FULL_DUPLEX_STREAMED");
    assert_eq!(mode["response_body_mode"], "FULL_DUPLEX_STREAMED");
    assert_eq!(mode["request_header_mode"], "SEND");
    assert_eq!(mode["response_header_mode"], "SEND");
    assert_eq!(ext["allow_content_length_header"], true);
    assert_eq!(ext["failure_mode_allow"], false);
    let meta = &ext["metadata_options"];
    assert_eq!(
        meta["receiving_namespaces"]["untyped"],
        serde_json::json!([kvc_router::epp::LB_NAMESPACE])
    );
    let forwarded = meta["forwarding_namespaces"]["untyped"].as_array().unwrap();
    for ns in [
        kvc_router::epp::LB_NAMESPACE,
        kvc_router::epp::SUBSET_NAMESPACE,
    ] {
        assert!(forwarded.iter().any(|v| v == ns), "{ns} not forwarded");
    }
    let picker = ext["grpc_service"]["envoy_grpc"]["cluster_name"]
        .as_str()
        .unwrap();
    let clusters = b["static_resources"]["clusters"].as_array().unwrap();
    let find = |name: &str| clusters.iter().find(|c| c["name"] == name).unwrap();
    let epp = find(picker);
    assert_eq!(
        epp["health_checks"][0]["grpc_health_check"]["service_name"],
        "readiness"
    );
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"];
    let servers = find(route["cluster"].as_str().unwrap());
    assert_eq!(servers["type"], "ORIGINAL_DST");
    assert_eq!(
        servers["original_dst_lb_config"]["http_header_name"],
        kvc_router::epp::DESTINATION_HEADER
    );
}

#[test]
fn the_kubernetes_picker_runs_two_replicas_with_its_ports_and_probes() {
    let dir = Path::new(EXAMPLES).join("kubernetes");
    let mut docs: Vec<Value> = Vec::new();
    for f in files(&dir) {
        docs.extend(documents(&f));
    }
    let kind = |k: &str| -> Vec<&Value> { docs.iter().filter(|d| d["kind"] == k).collect() };
    let pool = kind("InferencePool")[0];
    let picker_ref = &pool["spec"]["endpointPickerRef"];
    let port = picker_ref["port"]["number"].as_u64().unwrap();
    let service = kind("Service")
        .into_iter()
        .find(|s| s["metadata"]["name"] == picker_ref["name"])
        .expect("the pool's picker Service");
    assert!(
        service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["port"] == port)
    );
    // The picker's Deployment: the one whose pods the picker's Service selects.
    let selects = |d: &Value| {
        let labels = &d["spec"]["template"]["metadata"]["labels"];
        service["spec"]["selector"]
            .as_object()
            .unwrap()
            .iter()
            .all(|(k, v)| &labels[k] == v)
    };
    let deployment = kind("Deployment")
        .into_iter()
        .find(|d| selects(d))
        .expect("the picker's Deployment");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["livenessProbe"]["grpc"]["service"], "liveness");
    assert_eq!(container["readinessProbe"]["grpc"]["service"], "readiness");
    assert_eq!(container["readinessProbe"]["grpc"]["port"], port);
    // The image scripts/image/build.sh makes (`kvc-router:<the crate's version>`), loaded on
    // the nodes rather than pulled.
    assert_eq!(
        container["image"],
        format!("kvc-router:{}", common::kvc_router_version()).as_str()
    );
    assert_eq!(container["imagePullPolicy"], "IfNotPresent");
    // The router configuration in the ConfigMap is one kvc-router accepts, serving the
    // picker on the pool's port from the engines' own signals, read from each engine.
    let map = kind("ConfigMap")[0];
    let toml = map["data"]["router.toml"].as_str().unwrap();
    let cfg = kvc_router::RouterConfig::from_toml_str(toml).unwrap();
    cfg.validate().unwrap();
    assert_eq!(cfg.epp_listen.map(|a| u64::from(a.port())), Some(port));
    for w in &cfg.workers {
        assert!(w.discovers_events() && w.snapshot.is_none(), "{w:?}");
        let url = w.http_url.as_deref().unwrap();
        assert_eq!(w.metrics_url, Some(format!("{url}/metrics")));
    }
    // Its workers are the pool's pods: the ConfigMap names the pool, which kvc-router reads
    // (selector and port) as the API serves it.
    let pool_cfg = cfg
        .inference_pool
        .as_ref()
        .expect("an [inference-pool] table");
    assert_eq!(pool["metadata"]["name"], pool_cfg.name.as_str());
    assert_eq!(pool["apiVersion"], pool_cfg.api_version.as_str());
    let spec = kvc_router::pool::parse_pool(&serde_json::to_vec(pool).unwrap()).unwrap();
    assert_eq!(spec.port, 8000);
    // The model servers' pods are selected by it, each with a role the router reads.
    let mut pods = Vec::new();
    for d in kind("Deployment") {
        let template = &d["spec"]["template"];
        let labels = template["metadata"]["labels"].as_object().unwrap();
        if !spec
            .selector
            .iter()
            .all(|(k, v)| labels.get(k).and_then(Value::as_str) == Some(v.as_str()))
        {
            continue;
        }
        let serves_on_port = template["spec"]["containers"][0]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["containerPort"] == u64::from(spec.port));
        assert!(serves_on_port, "{}", d["metadata"]["name"]);
        pods.push(serde_json::json!({
            "metadata": {"name": d["metadata"]["name"], "labels": labels},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }));
    }
    let list = serde_json::to_vec(&serde_json::json!({"items": pods})).unwrap();
    let pods =
        kvc_router::pool::parse_pods(&list, &pool_cfg.role_label, pool_cfg.default_role).unwrap();
    let roles: Vec<_> = pods.iter().map(|p| p.role.clone().unwrap()).collect();
    assert_eq!(
        roles,
        vec![kvc_core::WorkerRole::Decode, kvc_core::WorkerRole::Prefill],
        "{pods:?}"
    );
    // The picker's service account may read the pool and list its pods.
    let account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .expect("the picker runs with a service account");
    assert!(
        kind("ServiceAccount")
            .iter()
            .any(|a| a["metadata"]["name"] == account)
    );
    let binding = kind("RoleBinding")
        .into_iter()
        .find(|b| b["subjects"][0]["name"] == account)
        .expect("a RoleBinding of the picker's service account");
    let role = kind("Role")
        .into_iter()
        .find(|r| r["metadata"]["name"] == binding["roleRef"]["name"])
        .expect("the bound Role");
    let group = pool_cfg.api_version.split('/').next().unwrap();
    let grants = |group: &str, resource: &str, verb: &str| {
        role["rules"].as_array().unwrap().iter().any(|r| {
            let has = |key: &str, v: &str| r[key].as_array().unwrap().iter().any(|x| x == v);
            has("apiGroups", group) && has("resources", resource) && has("verbs", verb)
        })
    };
    assert!(grants(group, "inferencepools", "get"));
    assert!(grants("", "pods", "list"));
}
