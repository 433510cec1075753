//! The public Mooncake trace (shared/traces/synthetic_trace.jsonl, never copied here).

use kvc_replay::trace::{self, LoadOptions, TurnId, stats};
use std::path::Path;

const MOONCAKE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/traces/synthetic_trace.jsonl"
);

#[test]
fn loads_every_request_each_its_own_session() {
    let (trace, report) = trace::load(Path::new(MOONCAKE), &LoadOptions::default()).unwrap();
    assert_eq!(trace.len(), 3_993);
    assert_eq!((report.lines, report.skipped, report.blank), (3_993, 0, 0));
    assert_eq!(trace.sessions(), 3_993);
    assert!(trace.iter().all(|r| r.turn == TurnId(1)));
    // Session id = line index; the file is already in time order.
    assert!(trace.iter().all(|r| r.session.0 == r.index as u64));
    let s = stats::compute(&trace, kvc_core::DEFAULT_MAX_INPUT_TOKENS);
    // Figures of SOURCE.md.
    assert_eq!(s.input_tokens.p50, 11_587);
    assert_eq!(s.input_tokens.max, 191_378);
    assert_eq!(s.output_tokens.p50, 69);
    assert_eq!(s.span_s, 1_022.025);
    assert_eq!(s.sessions_multi_turn, 0);
    // No session ids, no parents, no flags: every request its own session, none live.
    assert_eq!(
        (
            s.subagents.explicit,
            s.subagents.inferred,
            s.subagents.common_blocks
        ),
        (0, 0, 0)
    );
    assert_eq!((s.compactions.turns, s.compactions.count), (0, 0));
    assert_eq!((s.ends.count, s.ends.final_not_last), (0, 0));
}

#[test]
fn inferred_sessions_match_the_provenance_notes() {
    let opts = LoadOptions {
        infer_sessions: true,
        ..LoadOptions::default()
    };
    let (trace, _) = trace::load(Path::new(MOONCAKE), &opts).unwrap();
    assert_eq!(trace.len(), 3_993);
    let s = stats::compute(&trace, kvc_core::DEFAULT_MAX_INPUT_TOKENS);
    // 219 ± 10% sessions of two or more requests.
    assert!(
        (197..=241).contains(&s.sessions_multi_turn),
        "{}",
        s.sessions_multi_turn
    );
    // Follow-ups (requests that are not a session's first).
    let follow_ups = trace.iter().filter(|r| !r.turn.is_first()).count();
    assert!((693..=847).contains(&follow_ups), "{follow_ups}");
    assert_eq!(follow_ups, s.append.turns);
    // No prefix is common to most conversations; 279 of them open with blocks of another
    // that is still going (several conversations about one document), from 108 sessions, ±10%.
    assert_eq!(s.subagents.common_blocks, 0);
    assert_eq!(s.subagents.explicit, 0);
    assert!(
        (251..=307).contains(&s.subagents.inferred),
        "{}",
        s.subagents.inferred
    );
    assert!(
        (97..=119).contains(&s.subagents.inferred_parents),
        "{}",
        s.subagents.inferred_parents
    );
    // Follow-ups extend their prompt; none is rewritten from its start.
    assert_eq!(s.compactions.turns, follow_ups);
    assert_eq!(s.compactions.count, 0);
    assert_eq!(s.ends.count, 0);
    // Inferred ids are numbered by first request.
    for (next, r) in trace.iter().filter(|r| r.turn.is_first()).enumerate() {
        assert_eq!(r.session.0, next as u64);
    }
    // A follow-up is longer than its session's first request.
    for sess in trace.session_list() {
        let first = &trace.requests[sess.requests[0]];
        for &i in &sess.requests[1..] {
            assert!(trace.requests[i].input_length > first.input_length);
        }
    }
}
