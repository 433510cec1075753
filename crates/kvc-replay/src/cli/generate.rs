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
    ///
    /// Coding-agent traffic beyond that, all off by default (and then the trace is exactly the
    /// one without them): subagent sessions (`--subagents`), compactions (`--compactions`) and
    /// explicit session ends (`--ends`); `--agentic` turns all three on.
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

    /// Share of sessions that spawn subagents, e.g. 0.3 [default: 0, or 0.3 with --agentic].
    ///
    /// Such a session, after one of its turns, starts 1–3 child sessions in its pause before
    /// the next turn, which waits for the last of them. A child's first prompt is the shared
    /// system prompt (the same leading block ids as its parent's) and a task of its own
    /// (1,200–4,500 tokens); it runs 2–6 turns that grow as a session's do, with short pauses
    /// (p50 1.8 s). Every request of a child carries `parent_session_id`; children get session
    /// ids from the number of sessions upward, numbered by parent, then by start. Their
    /// requests come on top of --requests.
    #[arg(long, value_name = "FRACTION", value_parser = fraction)]
    subagents: Option<f64>,

    /// Share of long sessions that compact, e.g. 0.5 [default: 0, or 0.5 with --agentic].
    ///
    /// Long sessions are those whose prompt passes 40,000 tokens (other than the ones that end
    /// past the input limit). A compacting session, at every turn where its prompt would pass
    /// 40,000 tokens, rewrites it: the shared system prompt blocks, then new blocks of a
    /// summary (2,000–8,000 tokens), then the newest message; later turns extend the compacted
    /// prompt.
    #[arg(long, value_name = "FRACTION", value_parser = fraction)]
    compactions: Option<f64>,

    /// Share of sessions whose last request carries `"final": true` (the client ends the
    /// session explicitly), e.g. 0.8 [default: 0, or 0.8 with --agentic]. Each subagent
    /// session ends so with that probability.
    #[arg(long, value_name = "FRACTION", value_parser = fraction)]
    ends: Option<f64>,

    /// Coding-agent preset: --subagents 0.3 --compactions 0.5 --ends 0.8 (each may still be
    /// given explicitly, which overrides the preset).
    #[arg(long)]
    agentic: bool,

    /// Output file (`-` for stdout).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,

    #[command(flatten)]
    output: OutputArgs,
}

/// A share from 0 to 1.
fn fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("expected a fraction from 0 to 1, not {text:?}")),
    }
}

/// Runs `kvc-replay gen`.
pub(crate) fn run(args: Args) -> anyhow::Result<()> {
    match args.kind {
        Kind::Swe(a) => swe(a),
    }
}

fn swe(a: SweArgs) -> anyhow::Result<()> {
    let (subagents, compactions, ends) = generate::SweConfig::AGENTIC;
    let cfg = generate::SweConfig {
        seed: a.seed,
        sessions: a.sessions,
        requests: a.requests,
        start_span_s: a.start_span,
        subagents: a
            .subagents
            .unwrap_or(if a.agentic { subagents } else { 0.0 }),
        compactions: a
            .compactions
            .unwrap_or(if a.agentic { compactions } else { 0.0 }),
        ends: a.ends.unwrap_or(if a.agentic { ends } else { 0.0 }),
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
    let subagent_sessions = stream.planned_subagents();
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
        let children = if subagent_sessions > 0 {
            format!(" (and {subagent_sessions} subagent sessions)")
        } else {
            String::new()
        };
        eprintln!(
            "kvc-replay: generated {} requests in {} sessions{} (seed {}) to {}",
            written,
            cfg.sessions,
            children,
            cfg.seed,
            a.out.display()
        );
    }
    Ok(())
}
