//! `kvc-replay stats`: summarize a trace.

use super::{OutputArgs, TraceArgs};
use kvc_replay::trace::stats;
use std::io::Write;
use std::path::PathBuf;

const KEYS: &str = "\
JSON keys (--json; stable, scripts may rely on them):
  requests               requests in the trace
  sessions               sessions
  sessions_multi_turn    sessions of two or more requests
  turns_per_session      {mean, p50, min, max} requests per session
  input_tokens           {mean, p50, p90, p99, max} of input_length
  output_tokens          {mean, p50, p90, p99, max} of output_length
  session_peak_input     {mean, p50, max} over sessions of their largest input
  append                 uncached append of turns 2+ (input past the leading full blocks
                         shared with the session's previous turn): shares up_to_2048,
                         2049_to_8192, over_8192; turns counted; p50, p90 in tokens
  gap_s                  {p10, p50, p90, p99, max, mean} seconds between consecutive turns
                         of a session; count of gaps
  span_s                 seconds from the first to the last timestamp
  limit                  the --limit used
  over_limit             requests whose input exceeds --limit
  over_limit_sessions    ids of the sessions holding them, ascending
  subagents              subagent sessions: explicit (their requests carry parent_session_id),
                         explicit_parents (distinct sessions named); inferred (sessions without
                         parent_session_id found by the rule below), inferred_parents;
                         common_blocks; share of sessions that are subagents
  compactions            later turns whose prompt was rewritten: count, share of later turns;
                         diverging (turns whose hash_ids differ from the previous turn's before
                         its last full block), diverging_share; turns (turns 2+) counted
  ends                   sessions whose last request carries \"final\": true: count, share of
                         sessions; final_not_last (final requests that are not their session's
                         last)
  block_size             tokens per block id

Inferred subagents: a session without parent_session_id whose first request is turn 1 and
whose first prompt shares leading blocks with the latest prompt of a live session (one with
a request before it and one after it in trace order) beyond the common blocks (block ids in
the first prompts of more than half of the sessions: the system prompt all sessions share).
A child sharing only the common blocks with its parent is not inferred. Without session ids
each request is its own session and none is live: give --infer-sessions.

Compactions: a diverging turn that keeps at most a quarter of the previous prompt's full
blocks. Agents that elide old tool output diverge often but keep most of the prompt; those
turns count in diverging only.

Percentiles are nearest-rank.";

/// Summarize a trace: requests, sessions, turns, token distributions, uncached appends,
/// gaps between turns, span, requests over an input limit, and coding-agent structure
/// (subagent sessions, explicit and inferred; compactions; explicit session ends).
#[derive(Debug, clap::Args)]
#[command(after_long_help = KEYS)]
pub(crate) struct Args {
    /// The trace (JSON Lines).
    #[arg(value_name = "FILE")]
    file: PathBuf,

    #[command(flatten)]
    trace: TraceArgs,

    /// Input limit in tokens: requests above it are counted in `over_limit`.
    #[arg(long, value_name = "TOKENS", default_value_t = kvc_core::DEFAULT_MAX_INPUT_TOKENS)]
    limit: u64,

    /// Print one JSON object (keys listed in --help) instead of a table.
    #[arg(long)]
    json: bool,

    #[command(flatten)]
    output: OutputArgs,
}

/// Runs `kvc-replay stats`.
pub(crate) fn run(args: Args) -> anyhow::Result<()> {
    let trace = args.trace.load(&args.file, args.output.quiet)?;
    let s = stats::compute(&trace, args.limit);
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &s)?;
        writeln!(out)?;
    } else {
        write!(out, "{s}")?;
    }
    out.flush()?;
    Ok(())
}
