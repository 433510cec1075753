//! `kvc-replay gen`: generate synthetic traces.

use super::OutputArgs;
use anyhow::Context;
use kvc_replay::trace::{self, generate};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

/// Generate a synthetic trace as JSON Lines (with session and turn ids).
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    kind: Kind,
}

#[derive(Debug, clap::Subcommand)]
enum Kind {
    /// SWE-agent sessions (52 sessions give ~4,449 requests).
    ///
    /// Long multi-turn sessions whose context grows turn by turn, with old tool output elided
    /// (which makes some appends large), a system prompt shared by every session, and the two
    /// longest sessions (per 52) ending just past the 92,098-token input limit. Records carry
    /// `session_id` and `turn_id` and are sorted by timestamp. The same seed and options give a
    /// byte-identical file on every platform.
    Swe(SweArgs),
}

#[derive(Debug, clap::Args)]
struct SweArgs {
    /// Seed of the generator.
    #[arg(long)]
    seed: u64,

    /// Number of sessions.
    #[arg(long, default_value_t = generate::REFERENCE_SESSIONS)]
    sessions: usize,

    /// Total requests [default: round(4,449 × sessions / 52)].
    #[arg(long)]
    requests: Option<usize>,

    /// Seconds over which session starts are spread [default: 5,600 × sessions / 52, the
    /// reference rate of new sessions]; a smaller span packs more sessions at once (e.g. for a
    /// cluster larger than the reference's four workers).
    #[arg(long, value_name = "SECONDS")]
    start_span: Option<f64>,

    /// Output file (`-` for stdout).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,

    #[command(flatten)]
    output: OutputArgs,
}

/// Runs `kvc-replay gen`.
pub(crate) fn run(args: Args) -> anyhow::Result<()> {
    match args.kind {
        Kind::Swe(a) => swe(a),
    }
}

fn swe(a: SweArgs) -> anyhow::Result<()> {
    let cfg = generate::SweConfig {
        seed: a.seed,
        sessions: a.sessions,
        requests: a.requests,
        start_span_s: a.start_span,
        ..generate::SweConfig::default()
    };
    if let Some(span) = a.start_span
        && !(span.is_finite() && span >= 0.0)
    {
        anyhow::bail!("--start-span must be a number of seconds, not {span}");
    }
    // Records are written as they are generated; the trace is never held whole.
    let mut written = 0usize;
    let stream = generate::swe_stream(&cfg);
    let (planned, turn_cap) = stream.planned();
    match cfg.requests {
        Some(asked) if planned < asked => eprintln!(
            "kvc-replay: warning: {asked} requests asked for, {planned} in {} sessions: a \
             session that stays under the input limit has at most {turn_cap} turns (one less \
             than the shortest session that passes it); give more --sessions for more requests",
            cfg.sessions
        ),
        Some(asked) if planned > asked => eprintln!(
            "kvc-replay: warning: {asked} requests asked for, {planned} in {} sessions: every \
             session has a few turns at least and some run past the input limit; give fewer \
             --sessions for fewer requests",
            cfg.sessions
        ),
        _ => {}
    }
    let records = stream.inspect(|_| written += 1);
    if a.out.as_os_str() == "-" {
        let mut out = BufWriter::new(std::io::stdout().lock());
        trace::write_jsonl(&mut out, records).context("cannot write to stdout")?;
        out.flush()?;
    } else {
        let file =
            File::create(&a.out).with_context(|| format!("cannot create {}", a.out.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        trace::write_jsonl(&mut out, records)
            .and_then(|()| out.flush())
            .with_context(|| format!("cannot write {}", a.out.display()))?;
    }
    if !a.output.quiet {
        eprintln!(
            "kvc-replay: generated {} requests in {} sessions (seed {}) to {}",
            written,
            cfg.sessions,
            cfg.seed,
            a.out.display()
        );
    }
    Ok(())
}
