//! Fan-in: one router-side ingest subscribed to many engines on loopback.
//!
//! The engines run in a child process (this binary again, `KVC_FANIN_ROLE=engines`) so the
//! ingest's CPU time is its own. Each healthy engine is a [`Publisher`] with a replay socket
//! (PUB + ROUTER, topic `kv@bench`) and publishes `messages` batches in vLLM's map shape, each
//! storing 16 blocks of 16 tokens and removing the 16 stored by the batch before (so every
//! worker's index stays at 32 blocks; 32 block events per batch). The ingest is one tokio
//! runtime with one worker thread, one shared index and the crate's subscribers.
//!
//! Per run: the time from starting the subscribers until every engine that can connect is
//! connected and caught up (the catch-up replay from 0 included); the ingest process's
//! resident memory, open descriptors and tokio tasks added per subscriber at that point; then
//! the engines publish, and the ingest's block events applied per second of its own CPU time
//! (user + system, from `/proc/self/stat`) and per second of wall time, until every healthy
//! worker has applied its last batch.
//!
//! Unhealthy engines (the `dead` run, 10 % of the fleet, in four equal parts): a publisher
//! that connects and never publishes (stalled), one shut down when publishing starts
//! (killed: its subscriber then retries a refused port), a TCP listener that accepts and never
//! speaks (its subscriber's handshake times out, again and again), and a port that refuses
//! from the start. The `dead` run's healthy engines are those of a `base` run of the same
//! size; the ratio of their per-core rates (medians of three alternating pairs of runs) is
//! `ingest_with_dead_engines_ratio`, measured while every backoff is still short (publishing
//! starts once the healthy engines are connected). `ingest_with_dead_engines_settled_ratio`
//! is the same with publishing 20 s later, the dead engines' subscribers retrying at their
//! longest backoff, as they are once an engine has been dead a while; the CPU the ingest
//! spends during those 20 s, per unhealthy engine and second, is
//! `dead_engine_retry_cpu_us_per_s` (their retries: nothing else runs then).
//!
//! Figures are printed and, for `cargo xtask bench`, written as JSON to the file named by
//! `KVC_BENCH_OUT`. `KVC_FANIN_QUICK=1` publishes a quarter of the batches.
//!
//! `KVC_BENCH_SMOKE=1` (a check that the bench runs, not a measurement; it overrides the quick
//! switch) keeps every key but runs 4, 8 and 16 engines in place of 64, 512 and 4,096 (the
//! `dead` run: 16, one of each unhealthy kind) publishing 800, 400 and 200 batches each (CPU
//! time enough for `/proc`'s 10 ms ticks to count), one pair of runs and a 1 s settle.

use bytes::Bytes;
use kvc_core::{BlockSize, WorkerId};
use kvc_events::{
    BlockRemoved, BlockStored, EngineHash, Event, EventBatch, KvIndex, Publisher, PublisherConfig,
    SharedIndex, SubscriberConfig, WorkerSpec, encode_batch, spawn_subscriber,
};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const BS: u32 = 16;
/// Blocks each batch stores (and removes).
const BLOCKS: u32 = 16;
const TOPIC: &str = "kv@bench";
/// The longest any phase of a run may take.
const PHASE_LIMIT: Duration = Duration::from_secs(240);
/// How long the `settled` runs wait between connecting and publishing: the dead engines'
/// subscribers are then at their longest backoff (5 s, reached after about 18 s).
const SETTLE: Duration = Duration::from_secs(20);
/// Alternating base and dead runs whose medians the dead-engine ratio compares.
const PAIRS: usize = 3;
/// The runs of healthy engines: (the size their keys name, engines, batches each engine
/// publishes before `KVC_FANIN_QUICK`); the largest also gives the `dead` run's size.
const SIZES: [(usize, usize, usize); 3] = [(64, 64, 1600), (512, 512, 200), (4096, 4096, 25)];
/// [`SIZES`] in the smoke run.
const SMOKE_SIZES: [(usize, usize, usize); 3] = [(64, 4, 800), (512, 8, 400), (4096, 16, 200)];
/// [`SETTLE`] in the smoke run.
const SMOKE_SETTLE: Duration = Duration::from_secs(1);
/// `USER_HZ`, the unit of `/proc/self/stat`'s CPU times (100 on every Linux target).
const TICKS_PER_S: f64 = 100.0;

/// How many engines of each kind a run has.
#[derive(Debug, Clone, Copy, Default)]
struct Plan {
    healthy: usize,
    stalled: usize,
    killed: usize,
    silent: usize,
    refused: usize,
}

impl Plan {
    fn total(&self) -> usize {
        self.healthy + self.stalled + self.killed + self.silent + self.refused
    }

    fn to_env(self) -> String {
        format!(
            "{},{},{},{},{}",
            self.healthy, self.stalled, self.killed, self.silent, self.refused
        )
    }

    fn from_env(s: &str) -> Plan {
        let v: Vec<usize> = s.split(',').map(|x| x.parse().expect("plan")).collect();
        Plan {
            healthy: v[0],
            stalled: v[1],
            killed: v[2],
            silent: v[3],
            refused: v[4],
        }
    }
}

/// The two batches engine `e` alternates: each stores one set of blocks and removes the
/// other.
fn payloads(e: usize) -> [Bytes; 2] {
    let base = (e as u64) << 20;
    let set = |s: u64| -> Vec<EngineHash> {
        (0..u64::from(BLOCKS))
            .map(|i| EngineHash(base + s * 1000 + i))
            .collect()
    };
    let batch = |store: u64| {
        let seed = (e as u32)
            .wrapping_mul(7919)
            .wrapping_add(store as u32 * 104_729);
        let tokens = (0..BLOCKS * BS).map(|t| seed.wrapping_add(t)).collect();
        let events = vec![
            Event::Stored(BlockStored {
                block_hashes: set(store),
                parent: None,
                token_ids: tokens,
                block_size: BS,
                ..BlockStored::default()
            }),
            Event::Removed(BlockRemoved {
                block_hashes: set(1 - store),
                medium: None,
            }),
        ];
        Bytes::from(encode_batch(&EventBatch {
            ts: 0.0,
            events,
            dp_rank: None,
        }))
    };
    [batch(0), batch(1)]
}

fn one_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

// ---------------------------------------------------------------- engines (child process)

/// The child: binds the plan's engines, prints `ep KIND ENDPOINT REPLAY|-` lines then `ready`,
/// publishes on `go`, prints `done`, and exits when its stdin closes.
fn engines_main() {
    let plan = Plan::from_env(&std::env::var("KVC_FANIN_PLAN").expect("plan"));
    let messages: usize = std::env::var("KVC_FANIN_MESSAGES")
        .expect("messages")
        .parse()
        .expect("messages");
    let rt = one_thread_runtime();
    rt.block_on(async move {
        let cancel = CancellationToken::new();
        let mut out = std::io::stdout().lock();
        let bind = |_: usize| {
            let mut cfg = PublisherConfig::new("tcp://127.0.0.1:0");
            cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
            cfg.topic = TOPIC.into();
            cfg.buffer_steps = messages + 1;
            Publisher::bind(cfg, cancel.clone())
        };
        let bound = Instant::now();
        let mut healthy = Vec::new();
        let mut killed = Vec::new();
        let mut stalled = Vec::new();
        for (kind, n) in [
            ("healthy", plan.healthy),
            ("stalled", plan.stalled),
            ("killed", plan.killed),
        ] {
            for i in 0..n {
                let p = bind(i).await.expect("bind");
                let replay = p.replay_endpoint().unwrap_or("-").to_string();
                writeln!(out, "ep {kind} {} {replay}", p.endpoint()).unwrap();
                match kind {
                    "healthy" => healthy.push(p),
                    "stalled" => stalled.push(p),
                    _ => killed.push(p),
                }
            }
        }
        let mut held = Vec::new();
        for _ in 0..plan.silent {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            writeln!(out, "ep silent tcp://{} -", l.local_addr().unwrap()).unwrap();
            held.push(tokio::spawn(async move {
                let mut conns = Vec::new();
                while let Ok((c, _)) = l.accept().await {
                    conns.push(c);
                }
            }));
        }
        for _ in 0..plan.refused {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            writeln!(out, "ep refused tcp://{} -", l.local_addr().unwrap()).unwrap();
        }
        eprintln!(
            "fan-in engines: {} bound in {:.2} s",
            plan.total(),
            bound.elapsed().as_secs_f64()
        );
        writeln!(out, "ready").unwrap();
        out.flush().unwrap();
        let mut lines = BufReader::new(std::io::stdin()).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "go");
        for p in killed {
            p.shutdown().await;
        }
        let batches: Vec<[Bytes; 2]> = (0..healthy.len()).map(payloads).collect();
        for m in 0..messages {
            for (p, b) in healthy.iter().zip(&batches) {
                p.publish_payload(b[m % 2].clone()).await.expect("publish");
            }
        }
        writeln!(out, "done").unwrap();
        out.flush().unwrap();
        // Stay up (sockets open, replays answered) until the ingest has finished.
        for _ in lines.by_ref() {}
        cancel.cancel();
        drop(stalled);
        for h in held {
            h.abort();
        }
    });
}

// ---------------------------------------------------------------- ingest (this process)

/// What one run measured.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    connect_all_s: f64,
    bytes_per_subscriber: f64,
    fds_per_subscriber: f64,
    tasks_per_subscriber: f64,
    block_events: u64,
    cpu_s: f64,
    wall_s: f64,
    replays: u64,
    /// CPU time spent while waiting `settle` (nothing published), s.
    idle_cpu_s: f64,
}

impl Outcome {
    fn per_core(&self) -> f64 {
        self.block_events as f64 / self.cpu_s
    }

    fn per_wall_s(&self) -> f64 {
        self.block_events as f64 / self.wall_s
    }
}

fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // Fields after the command name's closing parenthesis; utime and stime are the 14th and
    // 15th of the whole line.
    let rest = &stat[stat.rfind(')').expect("stat") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    ticks as f64 / TICKS_PER_S
}

fn rss_bytes() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kib * 1024.0
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// The soft limit on open descriptors.
fn fd_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

struct Engines {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::io::Lines<BufReader<ChildStdout>>,
    /// (kind, endpoint, replay endpoint)
    endpoints: Vec<(String, String, Option<String>)>,
}

impl Engines {
    fn start(plan: Plan, messages: usize) -> Engines {
        let mut child = Command::new(std::env::current_exe().expect("current_exe"))
            .env("KVC_FANIN_ROLE", "engines")
            .env("KVC_FANIN_PLAN", plan.to_env())
            .env("KVC_FANIN_MESSAGES", messages.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the engines");
        let stdin = child.stdin.take();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut endpoints = Vec::new();
        for line in lines.by_ref() {
            let line = line.expect("engines' output");
            if line == "ready" {
                break;
            }
            let f: Vec<&str> = line.split(' ').collect();
            let replay = (f[3] != "-").then(|| f[3].to_string());
            endpoints.push((f[1].to_string(), f[2].to_string(), replay));
        }
        assert_eq!(
            endpoints.len(),
            plan.total(),
            "the engines did not all start"
        );
        Engines {
            child,
            stdin,
            lines,
            endpoints,
        }
    }

    fn say(&mut self, what: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{what}").unwrap();
        stdin.flush().unwrap();
    }

    fn stop(mut self) {
        drop(self.stdin.take());
        for _ in self.lines.by_ref() {}
        let _ = self.child.wait();
    }
}

/// Waits (polling) until `done` holds, at most [`PHASE_LIMIT`].
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(
            started.elapsed() < PHASE_LIMIT,
            "{what}: not within {PHASE_LIMIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn run(
    rt: &tokio::runtime::Runtime,
    name: &str,
    plan: Plan,
    messages: usize,
    settle: Duration,
) -> Outcome {
    let mut engines = Engines::start(plan, messages);
    let index: SharedIndex = Arc::new(parking_lot::RwLock::new(KvIndex::new()));
    let cancel = CancellationToken::new();
    let spec = WorkerSpec {
        block_size: BlockSize::new(BS).unwrap(),
        capacity_blocks: 4 * BLOCKS,
    };
    let metrics = rt.metrics();
    let (rss0, fds0, tasks0) = (rss_bytes(), open_fds(), metrics.num_alive_tasks());
    let started = Instant::now();
    let subs: Vec<_> = rt.block_on(async {
        engines
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, (kind, ep, replay))| {
                let mut cfg = SubscriberConfig::new(WorkerId(i as u32), spec, ep.clone());
                cfg.replay_endpoint = replay.clone();
                cfg.topic = TOPIC.into();
                let s = spawn_subscriber(cfg, index.clone(), cancel.clone());
                (kind.clone(), s)
            })
            .collect()
    });
    let reachable = |k: &str| matches!(k, "healthy" | "stalled" | "killed");
    rt.block_on(wait_until("connect", || {
        subs.iter().filter(|(k, _)| reachable(k)).all(|(_, s)| {
            let snap = s.stats.snapshot();
            snap.connected && snap.synced
        })
    }));
    let connect_all_s = started.elapsed().as_secs_f64();
    let n = plan.total() as f64;
    let bytes_per_subscriber = (rss_bytes() - rss0) / n;
    let fds_per_subscriber = (open_fds() - fds0) as f64 / n;
    let tasks_per_subscriber = (metrics.num_alive_tasks() - tasks0) as f64 / n;

    let healthy: Vec<_> = subs.iter().filter(|(k, _)| k == "healthy").collect();
    let idle0 = cpu_seconds();
    rt.block_on(async { tokio::time::sleep(settle).await });
    let cpu0 = cpu_seconds();
    let idle_cpu_s = cpu0 - idle0;
    let t0 = Instant::now();
    engines.say("go");
    let last = messages as u64 - 1;
    rt.block_on(wait_until("ingest", || {
        healthy
            .iter()
            .all(|(_, s)| s.stats.snapshot().last_seq == Some(last))
    }));
    let (wall_s, cpu_s) = (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    let mut block_events = 0;
    let mut replays = 0;
    for (_, s) in &healthy {
        let snap = s.stats.snapshot();
        block_events += snap.blocks_stored + snap.blocks_removed;
        replays += snap.replays;
    }
    cancel.cancel();
    rt.block_on(async {
        for (_, s) in subs {
            let _ = s.task.await;
        }
    });
    engines.stop();
    let o = Outcome {
        connect_all_s,
        bytes_per_subscriber,
        fds_per_subscriber,
        tasks_per_subscriber,
        block_events,
        cpu_s,
        wall_s,
        replays,
        idle_cpu_s,
    };
    eprintln!(
        "{name:>12}: {} engines ({} healthy): connect all {:.2} s, {:.0} B, {:.2} fds, {:.2} tasks per subscriber; \
         {} block events in {:.2} s wall, {:.2} s CPU: {:.0}/s per core, {:.0}/s wall; {} replays",
        plan.total(),
        plan.healthy,
        o.connect_all_s,
        o.bytes_per_subscriber,
        o.fds_per_subscriber,
        o.tasks_per_subscriber,
        o.block_events,
        o.wall_s,
        o.cpu_s,
        o.per_core(),
        o.per_wall_s(),
        o.replays,
    );
    o
}

/// The ingest of one run (its own process, so memory and descriptors start from nothing):
/// prints its [`Outcome`] as one line.
fn ingest_main() {
    let plan = Plan::from_env(&std::env::var("KVC_FANIN_PLAN").expect("plan"));
    let messages: usize = std::env::var("KVC_FANIN_MESSAGES")
        .expect("messages")
        .parse()
        .expect("messages");
    let name = std::env::var("KVC_FANIN_NAME").unwrap_or_default();
    let rt = one_thread_runtime();
    let settle = std::env::var("KVC_FANIN_SETTLE_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::ZERO, Duration::from_secs);
    let o = run(&rt, &name, plan, messages, settle);
    println!(
        "outcome {} {} {} {} {} {} {} {} {}",
        o.connect_all_s,
        o.bytes_per_subscriber,
        o.fds_per_subscriber,
        o.tasks_per_subscriber,
        o.block_events,
        o.cpu_s,
        o.wall_s,
        o.replays,
        o.idle_cpu_s
    );
}

/// Runs one ingest process and reads its outcome.
fn measure(name: &str, plan: Plan, messages: usize, settle: Duration) -> Outcome {
    let out = Command::new(std::env::current_exe().expect("current_exe"))
        .env("KVC_FANIN_ROLE", "ingest")
        .env("KVC_FANIN_NAME", name)
        .env("KVC_FANIN_PLAN", plan.to_env())
        .env("KVC_FANIN_MESSAGES", messages.to_string())
        .env("KVC_FANIN_SETTLE_S", settle.as_secs().to_string())
        .stderr(Stdio::inherit())
        .output()
        .expect("run the ingest");
    assert!(out.status.success(), "{name}: the ingest failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("outcome "))
        .expect("an outcome line");
    let f: Vec<f64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
    Outcome {
        connect_all_s: f[0],
        bytes_per_subscriber: f[1],
        fds_per_subscriber: f[2],
        tasks_per_subscriber: f[3],
        block_events: f[4] as u64,
        cpu_s: f[5],
        wall_s: f[6],
        replays: f[7] as u64,
        idle_cpu_s: f[8],
    }
}

fn main() {
    match std::env::var("KVC_FANIN_ROLE").as_deref() {
        Ok("engines") => return engines_main(),
        Ok("ingest") => return ingest_main(),
        _ => {}
    }
    // `cargo bench` passes `--bench`; `cargo test --benches` would run this too: only run
    // when asked to bench.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let smoke = std::env::var("KVC_BENCH_SMOKE").is_ok_and(|v| v == "1");
    let quick = !smoke && std::env::var("KVC_FANIN_QUICK").is_ok_and(|v| v == "1");
    let scale = |m: usize| if quick { m / 4 } else { m };
    let (sizes, pairs, settle) = if smoke {
        (SMOKE_SIZES, 1, SMOKE_SETTLE)
    } else {
        (SIZES, PAIRS, SETTLE)
    };
    let (_, largest, largest_messages) = sizes[sizes.len() - 1];
    // Per engine the ingest holds one SUB connection (and a replay DEALER while a replay
    // runs); the engines' side a PUB and a ROUTER listener and the connections they accept.
    // 4,096 engines: the ingest needs about 4,100 descriptors (more while catch-up replays
    // run), the engines' process about 12,300 (and this check runs before either starts).
    let need = 3 * largest as u64 + 512;
    match fd_limit() {
        Some(limit) if limit < need => {
            eprintln!(
                "fan-in: the open-file soft limit is {limit}, the runs need {need}: raise it (ulimit -n)"
            );
            std::process::exit(2);
        }
        limit => eprintln!("fan-in: open-file soft limit {limit:?}"),
    }
    let healthy = |n: usize| Plan {
        healthy: n,
        ..Plan::default()
    };
    let mut figures = Vec::new();
    for (name, n, messages) in sizes {
        let o = measure(&format!("{n}"), healthy(n), scale(messages), Duration::ZERO);
        figures.push((format!("ingest_blocks_per_s_{name}_engines"), o.per_core()));
        figures.push((
            format!("ingest_wall_blocks_per_s_{name}_engines"),
            o.per_wall_s(),
        ));
        figures.push((format!("subscriber_bytes_{name}"), o.bytes_per_subscriber));
        figures.push((format!("connect_all_{name}_s"), o.connect_all_s));
        if n == largest {
            figures.push((format!("subscriber_fds_{name}"), o.fds_per_subscriber));
            figures.push((format!("subscriber_tasks_{name}"), o.tasks_per_subscriber));
        }
    }
    let n = largest;
    // At least one of each unhealthy kind (the smoke run's fleet is under 40 engines).
    let bad = (n / 40).max(1);
    let unhealthy = Plan {
        healthy: n - 4 * bad,
        stalled: bad,
        killed: bad,
        silent: bad,
        refused: bad,
    };
    let messages = scale(largest_messages);
    // Alternating pairs, medians: the machine's other load moves between runs.
    let (mut base, mut dead, mut settled) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..pairs {
        let at_once = Duration::ZERO;
        base.push(measure(
            "base",
            healthy(unhealthy.healthy),
            messages,
            at_once,
        ));
        dead.push(measure("dead", unhealthy, messages, at_once));
        settled.push(measure("settled", unhealthy, messages, settle));
    }
    let median = |runs: &[Outcome], f: fn(&Outcome) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    figures.push((
        "ingest_with_dead_engines_ratio".into(),
        median(&dead, Outcome::per_core) / median(&base, Outcome::per_core),
    ));
    figures.push((
        "ingest_wall_with_dead_engines_ratio".into(),
        median(&dead, Outcome::per_wall_s) / median(&base, Outcome::per_wall_s),
    ));
    figures.push((
        "ingest_with_dead_engines_settled_ratio".into(),
        median(&settled, Outcome::per_core) / median(&base, Outcome::per_core),
    ));
    // What the unhealthy engines' subscribers cost while nothing is published: their
    // retries, per engine, averaged over the first 20 s (1 s in the smoke run) after starting.
    let unhealthy_n = (unhealthy.total() - unhealthy.healthy) as f64;
    figures.push((
        "dead_engine_retry_cpu_us_per_s".into(),
        median(&settled, |o| o.idle_cpu_s) / settle.as_secs_f64() / unhealthy_n * 1e6,
    ));
    figures.push((
        "connect_all_with_dead_engines_s".into(),
        median(&dead, |o| o.connect_all_s),
    ));
    let json: Vec<String> = figures
        .iter()
        .map(|(k, v)| format!("  \"{k}\": {v:.4}"))
        .collect();
    let json = format!("{{\n{}\n}}\n", json.join(",\n"));
    eprint!("{json}");
    if let Some(path) = std::env::var_os("KVC_BENCH_OUT") {
        std::fs::write(&path, json).expect("write KVC_BENCH_OUT");
    }
}
