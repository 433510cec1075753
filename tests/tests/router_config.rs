//! The router configurations `kvc-replay` writes (without linking the router) are accepted by
//! `kvc-router`'s loader and mean what the replay's workers are: addresses, policy, snapshots,
//! worker services and HTTP endpoints, every other key at the router's default.
#![forbid(unsafe_code)]

mod common;

use common::bin_dir;
use kvc_core::{Topology, WorkerId, WorkerRole};
use kvc_policy::PolicyConfig;
use kvc_replay::live::{router_config, snapshot_path};
use kvc_replay::sim::SimConfig;
use kvc_router::{RouterConfig, WorkerConfig};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

/// The configuration a router for a `1p2d` replay publishing into `dir` must load to.
fn expected(
    dir: &Path,
    policy: PolicyConfig,
    listen: SocketAddr,
    metrics: Option<SocketAddr>,
    service_base: Option<u16>,
) -> RouterConfig {
    let capacity = SimConfig::new("1p2d".parse::<Topology>().unwrap(), policy.clone())
        .profile
        .hardware
        .kv_pool_tokens;
    let roles = [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Decode];
    let names = ["p0", "d0", "d1"];
    RouterConfig {
        listen,
        metrics_listen: metrics,
        policy,
        workers: (0..3u32)
            .map(|i| WorkerConfig {
                name: Some(names[i as usize].to_owned()),
                snapshot: Some(snapshot_path(dir, WorkerId(i))),
                address: service_base.map(|b| format!("http://127.0.0.1:{}", b + i as u16)),
                ..WorkerConfig::new(i, roles[i as usize], capacity)
            })
            .collect(),
        ..RouterConfig::default()
    }
}

#[test]
fn write_router_config_is_loaded_by_the_router() {
    let dir = std::env::temp_dir().join(format!("kvc-router-config-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("router.toml");
    let snapshots = dir.join("snap");
    let ok = Command::new(bin_dir().join("kvc-replay"))
        .args(["live", "--topology", "1p2d", "--policy", "kvc-v2"])
        .args(["--router-listen", "127.0.0.1:50151"])
        .args(["--router-metrics-listen", "127.0.0.1:9564"])
        .args(["--worker-base-port", "50160", "--snapshot-dir"])
        .arg(&snapshots)
        .arg("--write-router-config")
        .arg(&file)
        .status()
        .unwrap();
    assert!(ok.success(), "writing the router config failed");
    let loaded = RouterConfig::from_file(&file).unwrap();
    let want = expected(
        &snapshots,
        PolicyConfig::from_name("kvc-v2").unwrap(),
        "127.0.0.1:50151".parse().unwrap(),
        Some("127.0.0.1:9564".parse().unwrap()),
        Some(50160),
    );
    assert_eq!(loaded, want);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn http_router_config_is_loaded_by_the_router() {
    let dir = Path::new("/tmp/kvc-snapshots");
    let policy = PolicyConfig::from_name("kvc").unwrap();
    let cfg = SimConfig::new("1p2d".parse::<Topology>().unwrap(), policy.clone());
    let listen: SocketAddr = "127.0.0.1:50051".parse().unwrap();
    let http: SocketAddr = "127.0.0.1:8000".parse().unwrap();
    let urls = [
        ("http://127.0.0.1:30000".to_owned(), Some(8998)),
        ("http://127.0.0.1:30001".to_owned(), None),
        ("http://127.0.0.1:30002".to_owned(), None),
    ];
    let text = router_config(&cfg, dir, listen, None, &[])
        .with_http(http, &urls)
        .to_toml()
        .unwrap();
    let loaded = RouterConfig::from_toml_str(&text).unwrap();
    let mut want = expected(
        dir,
        policy,
        listen,
        RouterConfig::default().metrics_listen,
        None,
    );
    want.http_listen = Some(http);
    for (w, (url, bootstrap_port)) in want.workers.iter_mut().zip(&urls) {
        w.http_url = Some(url.clone());
        w.bootstrap_port = *bootstrap_port;
    }
    assert_eq!(loaded, want);
    assert!(loaded.validate().is_ok());
}
