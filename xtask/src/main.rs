//! `cargo xtask` — maintainer tasks for kvc.
//!
//! ```text
//! cargo xtask test              the full test suite (what CI runs)
//! cargo xtask bench [--quick]   run the workspace's criterion benches
//! ```
#![forbid(unsafe_code)]

use std::process::{Command, ExitCode};

const HELP: &str = "\
cargo xtask — maintainer tasks for kvc

USAGE:
    cargo xtask test
    cargo xtask bench [--quick]

COMMANDS:
    test       Run the whole test suite: `cargo test --workspace --locked`, then the loom
               model checks of kvc-admission (built with `--cfg loom` into target/loom).

    bench      Run the criterion benches of every workspace crate.
               --quick  shorter warm-up and measurement times

    help       Print this help.
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") if args.len() == 1 => test(),
        Some("bench") => bench(&args[1..]),
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

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn run(what: &str, cmd: &mut Command) -> Result<(), ExitCode> {
    match cmd.status() {
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
    let loom_tests = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../crates/kvc-admission/tests/loom.rs");
    if loom_tests.exists() {
        let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/loom");
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
                .env("CARGO_TARGET_DIR", target),
        );
        if let Err(code) = loom {
            return code;
        }
    }
    ExitCode::SUCCESS
}

fn bench(args: &[String]) -> ExitCode {
    let mut quick = false;
    for a in args {
        match a.as_str() {
            "--quick" => quick = true,
            other => {
                eprintln!("xtask bench: unknown option `{other}`\n\n{HELP}");
                return ExitCode::from(2);
            }
        }
    }
    let mut cmd = cargo();
    cmd.args(["bench", "--workspace", "--exclude", "xtask", "--"]);
    if quick {
        cmd.args(["--warm-up-time", "0.5", "--measurement-time", "2"]);
    }
    match run("cargo bench", &mut cmd) {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}
