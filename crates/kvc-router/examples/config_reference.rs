//! Writes the configuration reference, `docs/configuration.md`, rendered from the
//! configuration's schema (`kvc_router::config::reference`): `cargo xtask config-reference`
//! runs it. With a path argument it writes the page there, else to stdout. It fails, after
//! writing, when the reference has problems (a key without a description or an example).
#![forbid(unsafe_code)]

use std::process::ExitCode;

const EXAMPLE: &str = include_str!("router.toml");

fn main() -> ExitCode {
    let reference = kvc_router::config::reference::render(EXAMPLE);
    match std::env::args_os().nth(1) {
        Some(path) => {
            if let Err(e) = std::fs::write(&path, &reference.markdown) {
                eprintln!("config-reference: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
        None => print!("{}", reference.markdown),
    }
    for problem in &reference.problems {
        eprintln!("config-reference: {problem}");
    }
    if reference.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
