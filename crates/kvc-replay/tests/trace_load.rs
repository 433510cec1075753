//! Loading traces: validation errors with file and line, blank lines, skipping, sessions,
//! ordering, shared block-id storage, writing, and arbitrary input.

use kvc_core::{BlockHash, BlockSize, SessionId, TraceRecord, TurnId};
use kvc_replay::trace::{self, LoadOptions, LoadReport, Trace, TraceError};
use proptest::prelude::*;

const FILE: &str = "t.jsonl";

fn parse_with(text: &str, opts: LoadOptions) -> Result<(Trace, LoadReport), TraceError> {
    trace::parse(text.as_bytes(), FILE, &opts)
}

fn parse(text: &str) -> Result<(Trace, LoadReport), TraceError> {
    parse_with(text, LoadOptions::default())
}

fn skip() -> LoadOptions {
    LoadOptions {
        skip_invalid: true,
        ..LoadOptions::default()
    }
}

fn infer() -> LoadOptions {
    LoadOptions {
        infer_sessions: true,
        ..LoadOptions::default()
    }
}

/// A valid line: `input` tokens, ids `first..` (ceil(input / 512) of them).
fn line(ts: u64, input: u64, first: u64) -> String {
    let ids: Vec<String> = (first..first + input.div_ceil(512))
        .map(|i| i.to_string())
        .collect();
    format!(
        r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": 10, "hash_ids": [{}]}}"#,
        ids.join(", ")
    )
}

const GOOD: &str =
    r#"{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#;

#[test]
fn bad_json_names_file_and_line() {
    let text = format!("{GOOD}\n{{\"timestamp\": 1,\n{GOOD}\n");
    let err = parse(&text).unwrap_err();
    assert!(
        matches!(&err, TraceError::Json { file, line: 2, .. } if file == FILE),
        "{err:?}"
    );
    assert!(
        err.to_string().starts_with("t.jsonl:2: invalid JSON"),
        "{err}"
    );
}

#[test]
fn non_objects_and_duplicate_keys_are_json_errors() {
    for bad in [
        "[1, 2]",
        "42",
        "\"text\"",
        "null",
        r#"{"timestamp": 1, "timestamp": 2, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#,
        "{\"timestamp\": 1} trailing",
    ] {
        let err = parse(&format!("{GOOD}\n{bad}\n")).unwrap_err();
        assert!(
            matches!(err, TraceError::Json { line: 2, .. }),
            "{bad}: {err:?}"
        );
    }
}

#[test]
fn missing_fields_are_named() {
    let fields = [
        ("timestamp", "1"),
        ("input_length", "600"),
        ("output_length", "5"),
        ("hash_ids", "[1, 2]"),
    ];
    for skip_field in 0..fields.len() {
        let body: Vec<String> = fields
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != skip_field)
            .map(|(_, (k, v))| format!("\"{k}\": {v}"))
            .collect();
        let text = format!("\n{GOOD}\n{{{}}}\n", body.join(", "));
        let err = parse(&text).unwrap_err();
        let want = fields[skip_field].0;
        assert!(
            matches!(&err, TraceError::MissingField { line: 3, field, .. } if *field == want),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!("t.jsonl:3: missing field `{want}`")
        );
    }
    // `null` counts as missing.
    let err = parse(
        r#"{"timestamp": 1, "input_length": 600, "output_length": null, "hash_ids": [1, 2]}"#,
    )
    .unwrap_err();
    assert!(matches!(
        err,
        TraceError::MissingField {
            line: 1,
            field: "output_length",
            ..
        }
    ));
}

#[test]
fn wrong_types_are_invalid_fields() {
    let cases = [
        (r#""timestamp": "soon""#, "timestamp"),
        (r#""timestamp": true"#, "timestamp"),
        (r#""input_length": "600""#, "input_length"),
        (r#""input_length": 600.5"#, "input_length"),
        (r#""output_length": [5]"#, "output_length"),
        (r#""hash_ids": "1,2""#, "hash_ids"),
        (r#""hash_ids": {"a": 1}"#, "hash_ids"),
        (r#""hash_ids": [1, "x"]"#, "hash_ids"),
        (r#""hash_ids": [1, -2]"#, "hash_ids"),
        (r#""session_id": [1]"#, "session_id"),
        (r#""session_id": -1"#, "session_id"),
        (r#""turn_id": 0"#, "turn_id"),
        (r#""turn_id": "first""#, "turn_id"),
        (r#""turn_id": 4294967296"#, "turn_id"),
    ];
    let base = [
        ("timestamp", "1"),
        ("input_length", "600"),
        ("output_length", "5"),
        ("hash_ids", "[1, 2]"),
    ];
    for (replacement, field) in cases {
        let mut parts: Vec<String> = base
            .iter()
            .filter(|(k, _)| !replacement.starts_with(&format!("\"{k}\"")))
            .map(|(k, v)| format!("\"{k}\": {v}"))
            .collect();
        parts.push(replacement.to_owned());
        let text = format!("{GOOD}\n{GOOD}\n{{{}}}\n", parts.join(", "));
        let err = parse(&text).unwrap_err();
        assert!(
            matches!(&err, TraceError::InvalidField { line: 3, field: f, .. } if *f == field),
            "{replacement}: {err:?}"
        );
        assert!(
            err.to_string()
                .starts_with(&format!("t.jsonl:3: field `{field}`: ")),
            "{err}"
        );
    }
}

#[test]
fn entry_of_a_bad_hash_list_is_reported() {
    let err =
        parse(r#"{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2.5]}"#)
            .unwrap_err();
    assert_eq!(
        err.to_string(),
        "t.jsonl:1: field `hash_ids`: entry 1 is the number 2.5, expected a non-negative integer"
    );
}

#[test]
fn negative_and_zero_lengths_are_rejected() {
    let err =
        parse(r#"{"timestamp": 1, "input_length": 600, "output_length": -5, "hash_ids": [1, 2]}"#)
            .unwrap_err();
    assert!(matches!(
        err,
        TraceError::InvalidField {
            line: 1,
            field: "output_length",
            ..
        }
    ));
    assert!(err.to_string().contains("-5"), "{err}");
    let err =
        parse(r#"{"timestamp": -3, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#)
            .unwrap_err();
    assert!(matches!(
        err,
        TraceError::InvalidField {
            line: 1,
            field: "timestamp",
            ..
        }
    ));
    let err = parse(r#"{"timestamp": 1, "input_length": 0, "output_length": 5, "hash_ids": []}"#)
        .unwrap_err();
    assert!(matches!(
        err,
        TraceError::InvalidField {
            line: 1,
            field: "input_length",
            ..
        }
    ));
}

#[test]
fn hash_list_must_fit_the_input() {
    let text = format!(
        "{GOOD}\n{}\n",
        r#"{"timestamp": 2, "input_length": 1025, "output_length": 5, "hash_ids": [1, 2]}"#
    );
    let err = parse(&text).unwrap_err();
    assert!(
        matches!(
            err,
            TraceError::HashLength {
                line: 2,
                expected: 3,
                got: 2,
                input_length: 1025,
                block_size: 512,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.field(), Some("hash_ids"));
    // With another block size the same record is fine.
    let opts = LoadOptions {
        block_size: BlockSize::new(1024).unwrap(),
        ..LoadOptions::default()
    };
    let (trace, _) = parse_with(text.lines().nth(1).unwrap(), opts).unwrap();
    assert_eq!(trace.block_size().tokens(), 1024);
}

#[test]
fn empty_inputs_are_an_error() {
    for text in ["", "\n\n  \n\t\r\n"] {
        let err = parse(text).unwrap_err();
        assert!(
            matches!(&err, TraceError::Empty { file } if file == FILE),
            "{err:?}"
        );
        assert_eq!(err.line(), None);
    }
    // Every line skipped: nothing left.
    let err = parse_with("{\n[]\n", skip()).unwrap_err();
    assert!(matches!(err, TraceError::Empty { .. }));
}

#[test]
fn missing_file_is_an_io_error_naming_it() {
    let path = std::path::Path::new("/nonexistent/dir/trace.jsonl");
    let err = trace::load(path, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&err, TraceError::Io { path: p, .. } if p == path),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .starts_with("/nonexistent/dir/trace.jsonl: "),
        "{err}"
    );
}

#[test]
fn blank_lines_count_toward_line_numbers_and_are_skipped() {
    let text = format!("\n{GOOD}\n   \n\n{{bad\n");
    let err = parse(&text).unwrap_err();
    assert_eq!(err.line(), Some(5));
    let (trace, report) = parse(&format!("\n{GOOD}\n\n{}\n\n", line(3, 100, 9))).unwrap();
    assert_eq!(trace.len(), 2);
    assert_eq!(
        (report.lines, report.blank, report.records, report.skipped),
        (5, 3, 2, 0)
    );
}

#[test]
fn crlf_bom_and_unknown_fields_are_tolerated() {
    let text = format!(
        "\u{feff}{}\r\n{}\r\n",
        r#"{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2], "extra": {"nested": [1, {"x": null}]}, "model": "m"}"#,
        r#"{"hash_ids": [3], "output_length": 1, "input_length": 12, "timestamp": 7.9, "note": null}"#
    );
    let (trace, report) = parse(&text).unwrap();
    assert_eq!(report.records, 2);
    assert_eq!(trace.requests[0].hash_ids[..], [BlockHash(1), BlockHash(2)]);
    // A fractional timestamp is rounded down.
    assert_eq!(trace.requests[1].timestamp_ms, 7);
}

#[test]
fn skip_invalid_counts_and_keeps_the_first_errors() {
    let text = format!(
        "{}\n{{oops\n{}\n{}\n\n{}\n",
        line(1, 600, 1),
        line(2, 600, 10),
        r#"{"timestamp": 3, "input_length": 600, "output_length": 5}"#,
        line(4, 600, 20),
    );
    assert_eq!(parse(&text).unwrap_err().line(), Some(2));
    let (trace, report) = parse_with(&text, skip()).unwrap();
    assert_eq!(trace.len(), 3);
    assert_eq!(
        (report.lines, report.records, report.skipped, report.blank),
        (6, 3, 2, 1)
    );
    let lines: Vec<Option<usize>> = report.first_errors.iter().map(TraceError::line).collect();
    assert_eq!(lines, [Some(2), Some(4)]);
    assert!(matches!(
        report.first_errors[1],
        TraceError::MissingField {
            field: "hash_ids",
            ..
        }
    ));
}

#[test]
fn at_most_ten_errors_are_kept() {
    let text = "{\n".repeat(25) + GOOD;
    let (_, report) = parse_with(&text, skip()).unwrap();
    assert_eq!(report.skipped, 25);
    assert_eq!(report.first_errors.len(), trace::MAX_REPORTED_ERRORS);
    assert_eq!(report.first_errors[9].line(), Some(10));
}

#[test]
fn requests_are_sorted_by_timestamp_stably() {
    let text = [
        line(50, 100, 1),
        line(10, 100, 2),
        line(50, 100, 3),
        line(0, 100, 4),
    ]
    .join("\n");
    let (trace, _) = parse(&text).unwrap();
    let order: Vec<(u64, u64)> = trace
        .iter()
        .map(|r| (r.timestamp_ms, r.hash_ids[0].0))
        .collect();
    assert_eq!(order, [(0, 4), (10, 2), (50, 1), (50, 3)]);
    assert!(trace.iter().enumerate().all(|(i, r)| r.index == i));
    // Without session ids: one session per request, id = 0-based line index, turn 1.
    let sessions: Vec<u64> = trace.iter().map(|r| r.session.0).collect();
    assert_eq!(sessions, [3, 1, 0, 2]);
    assert!(trace.iter().all(|r| r.turn == TurnId(1)));
    assert_eq!(trace.sessions(), 4);
}

fn with_session(ts: u64, session: &str, turn: Option<u32>, ids: &[u64], input: u64) -> String {
    let turn = turn.map_or(String::new(), |t| format!(", \"turn_id\": {t}"));
    let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
    format!(
        r#"{{"timestamp": {ts}, "session_id": {session}{turn}, "input_length": {input}, "output_length": 1, "hash_ids": [{}]}}"#,
        ids.join(",")
    )
}

#[test]
fn explicit_sessions_keep_their_ids_and_turns() {
    let text = [
        with_session(5, "7", None, &[1], 10),
        with_session(1, "9", Some(3), &[2], 10),
        with_session(8, "7", None, &[1, 3], 600),
        with_session(2, "9", Some(1), &[2, 4], 600),
        with_session(3, "\"agent-a\"", None, &[5], 10),
    ]
    .join("\n");
    let (trace, _) = parse(&text).unwrap();
    assert_eq!(trace.sessions(), 3);
    let got: Vec<(u64, u64, u32)> = trace
        .iter()
        .map(|r| (r.timestamp_ms, r.session.0, r.turn.0))
        .collect();
    let a = SessionId::from_key("agent-a").0;
    assert_eq!(got, [(1, 9, 3), (2, 9, 1), (3, a, 1), (5, 7, 1), (8, 7, 2)]);
    // Sessions in order of first request; requests of a session in turn order.
    let list = trace.session_list();
    assert_eq!(list[0].id, SessionId(9));
    assert_eq!(list[0].requests, [1, 0]);
    assert_eq!(list[2].id, SessionId(7));
    assert_eq!(list[2].requests, [3, 4]);
}

#[test]
fn duplicate_turns_are_rejected_or_skipped() {
    let text = [
        with_session(1, "4", Some(1), &[1], 10),
        with_session(2, "4", Some(2), &[2], 10),
        with_session(3, "4", Some(2), &[3], 10),
    ]
    .join("\n");
    let err = parse(&text).unwrap_err();
    assert!(
        matches!(
            err,
            TraceError::DuplicateTurn {
                line: 3,
                first_line: 2,
                session: 4,
                turn: 2,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "t.jsonl:3: field `turn_id`: turn 2 of session 4 already appears at line 2"
    );
    let (trace, report) = parse_with(&text, skip()).unwrap();
    assert_eq!((trace.len(), report.skipped), (2, 1));
}

#[test]
fn sessions_are_inferred_from_block_ids() {
    // a: blocks 1,2 full + partial 3. b continues a (holds 2, the last full block a introduced;
    // a's partial block was renamed). c is unrelated. d continues b. e repeats c's prefix but is
    // not longer, so it starts its own session.
    let text = [
        with_ids(0, 1100, &[1, 2, 3]),
        with_ids(10, 500, &[20]),
        with_ids(20, 1600, &[1, 2, 4, 5]),
        with_ids(30, 2100, &[1, 2, 4, 6, 7]),
        with_ids(40, 500, &[20]),
    ]
    .join("\n");
    let (trace, _) = parse_with(&text, infer()).unwrap();
    let got: Vec<(u64, u32)> = trace.iter().map(|r| (r.session.0, r.turn.0)).collect();
    assert_eq!(got, [(0, 1), (1, 1), (0, 2), (0, 3), (2, 1)]);
    assert_eq!(trace.sessions(), 3);
    // Without inference every request is alone.
    assert_eq!(parse(&text).unwrap().0.sessions(), 5);
}

fn with_ids(ts: u64, input: u64, ids: &[u64]) -> String {
    let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
    format!(
        r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": 1, "hash_ids": [{}]}}"#,
        ids.join(",")
    )
}

#[test]
fn mixed_files_number_anonymous_requests_after_explicit_ids() {
    let text = [with_session(0, "5", None, &[1], 10), with_ids(1, 10, &[2])].join("\n");
    let (trace, _) = parse(&text).unwrap();
    let ids: Vec<u64> = trace.iter().map(|r| r.session.0).collect();
    // Line index 1, numbered after the largest explicit id (5).
    assert_eq!(ids, [5, 7]);
}

#[test]
fn a_session_shares_block_storage_between_turns() {
    // Turn 2 extends turn 1's whole list (turn 1 ends on a block boundary); turn 3 retries
    // turn 2's prompt; turn 4 diverges.
    let text = [
        with_session(0, "1", None, &[1, 2], 1024),
        with_session(1, "1", None, &[1, 2, 3], 1300),
        with_session(2, "1", None, &[1, 2, 3], 1300),
        with_session(3, "1", None, &[1, 9, 10], 1300),
        with_session(4, "2", None, &[1, 2], 1024),
    ]
    .join("\n");
    let (trace, _) = parse(&text).unwrap();
    let r = &trace.requests;
    assert!(r[0].hash_ids.shares_storage_with(&r[1].hash_ids));
    assert!(r[1].hash_ids.shares_storage_with(&r[2].hash_ids));
    assert!(r[0].hash_ids.shares_storage_with(&r[3].hash_ids));
    assert!(!r[0].hash_ids.shares_storage_with(&r[4].hash_ids));
    // Session 1 holds 3 + 3 ids, not 2 + 3 + 3 + 3.
    assert_eq!(r[0].hash_ids.store_len(), 6);
    assert_eq!(r[3].hash_ids[..], [1, 9, 10].map(BlockHash));
    assert_eq!(r[2].hash_ids, r[1].hash_ids);
}

#[test]
fn writing_and_loading_round_trips() {
    let records = vec![
        TraceRecord {
            timestamp: 5,
            session_id: Some(SessionId(2)),
            parent_session_id: None,
            turn_id: Some(TurnId(1)),
            session_final: false,
            input_length: 513,
            output_length: 0,
            hash_ids: vec![BlockHash(0), BlockHash(u64::MAX)],
        },
        TraceRecord {
            timestamp: 9,
            session_id: Some(SessionId(2)),
            parent_session_id: None,
            turn_id: Some(TurnId(2)),
            session_final: false,
            input_length: 700,
            output_length: 3,
            hash_ids: vec![BlockHash(0), BlockHash(4)],
        },
    ];
    let mut out = Vec::new();
    trace::write_jsonl(&mut out, &records).unwrap();
    let text = String::from_utf8(out.clone()).unwrap();
    assert_eq!(
        text.lines().next().unwrap(),
        r#"{"timestamp":5,"session_id":2,"turn_id":1,"input_length":513,"output_length":0,"hash_ids":[0,18446744073709551615]}"#
    );
    let (trace, _) = trace::parse(&out[..], "mem", &LoadOptions::default()).unwrap();
    assert_eq!(trace.to_records(), records);
    let (again, _) = Trace::from_records(&records, &LoadOptions::default()).unwrap();
    assert_eq!(again.requests, trace.requests);
}

#[test]
fn from_records_validates_like_a_file() {
    let bad = TraceRecord {
        timestamp: 0,
        session_id: None,
        parent_session_id: None,
        turn_id: None,
        session_final: false,
        input_length: 2000,
        output_length: 1,
        hash_ids: vec![BlockHash(1)],
    };
    let err = Trace::from_records([&bad], &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            TraceError::HashLength {
                line: 1,
                expected: 4,
                got: 1,
                ..
            }
        ),
        "{err:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        for opts in [LoadOptions::default(), skip(), LoadOptions { infer_sessions: true, skip_invalid: true, ..LoadOptions::default() }] {
            match trace::parse(&bytes[..], FILE, &opts) {
                Ok((trace, report)) => {
                    prop_assert_eq!(report.records + report.blank + report.skipped, report.lines);
                    prop_assert_eq!(trace.len(), report.records);
                }
                Err(e) => {
                    let lines = bytes.split(|&b| b == b'\n').count();
                    prop_assert!(e.line().is_none_or(|l| l >= 1 && l <= lines), "{e}");
                }
            }
        }
    }

    #[test]
    fn near_valid_lines_never_panic(lines in proptest::collection::vec(near_valid_line(), 0..12)) {
        let text = lines.join("\n");
        for opts in [LoadOptions::default(), skip(), LoadOptions { infer_sessions: true, skip_invalid: true, ..LoadOptions::default() }] {
            match parse_with(&text, opts) {
                Ok((trace, report)) => {
                    prop_assert_eq!(report.records + report.blank + report.skipped, report.lines);
                    prop_assert!(trace.iter().all(|r| r.hash_ids.len() as u64 == r.input_length.div_ceil(512)));
                    prop_assert!(trace.requests.windows(2).all(|w| w[0].timestamp_ms <= w[1].timestamp_ms));
                }
                Err(e) => prop_assert!(e.line().is_none_or(|l| l >= 1 && l <= lines.len().max(1)), "{e}"),
            }
        }
    }

    #[test]
    fn valid_records_round_trip(recs in proptest::collection::vec((0u64..1000, 1u64..3000, 0u64..100, proptest::option::of(0u64..4)), 1..20)) {
        let records: Vec<TraceRecord> = recs.iter().enumerate().map(|(i, &(ts, input, output, session))| TraceRecord {
            timestamp: ts,
            session_id: session.map(SessionId),
            parent_session_id: None,
            turn_id: None,
            session_final: false,
            input_length: input,
            output_length: output,
            hash_ids: (0..input.div_ceil(512)).map(|k| BlockHash(i as u64 * 10 + k)).collect(),
        }).collect();
        let mut out = Vec::new();
        trace::write_jsonl(&mut out, &records).unwrap();
        let (trace, report) = trace::parse(&out[..], FILE, &LoadOptions::default()).unwrap();
        prop_assert_eq!(report.records, records.len());
        let mut expected: Vec<(u64, u64, u64, Vec<BlockHash>)> = records.iter().map(|r| (r.timestamp, r.input_length, r.output_length, r.hash_ids.clone())).collect();
        expected.sort_by_key(|e| e.0);
        let got: Vec<(u64, u64, u64, Vec<BlockHash>)> = trace.iter().map(|r| (r.timestamp_ms, r.input_length, r.output_length, r.hash_ids.to_vec())).collect();
        prop_assert_eq!(got, expected);
        // Turns of each session are 1..=n in timestamp order.
        for s in trace.session_list() {
            let turns: Vec<u32> = s.requests.iter().map(|&i| trace.requests[i].turn.0).collect();
            prop_assert_eq!(turns, (1..=s.requests.len() as u32).collect::<Vec<_>>());
        }
    }
}

/// JSON objects whose fields are drawn from valid and invalid values.
fn near_valid_line() -> impl Strategy<Value = String> {
    let value = prop_oneof![
        (0u64..3000).prop_map(|v| v.to_string()),
        Just("-1".to_owned()),
        Just("1.5".to_owned()),
        Just("\"x\"".to_owned()),
        Just("null".to_owned()),
        Just("[]".to_owned()),
        Just("[0, 1, 2]".to_owned()),
        Just("[1, -1]".to_owned()),
        Just("{}".to_owned()),
        Just("1e400".to_owned()),
        Just("18446744073709551616".to_owned()),
    ];
    let key = prop_oneof![
        Just("timestamp"),
        Just("input_length"),
        Just("output_length"),
        Just("hash_ids"),
        Just("session_id"),
        Just("turn_id"),
        Just("other"),
    ];
    prop_oneof![
        proptest::collection::vec((key, value), 0..8).prop_map(|fields| {
            let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
            format!("{{{}}}", body.join(", "))
        }),
        (0u64..100, 1u64..2000, proptest::option::of(0u64..3), proptest::option::of(1u32..4)).prop_map(
            |(ts, input, session, turn)| {
                let ids: Vec<String> = (0..input.div_ceil(512)).map(|k| (k + ts).to_string()).collect();
                let session = session.map_or(String::new(), |s| format!(", \"session_id\": {s}"));
                let turn = turn.map_or(String::new(), |t| format!(", \"turn_id\": {t}"));
                format!(
                    "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": 1, \"hash_ids\": [{}]{session}{turn}}}",
                    ids.join(",")
                )
            }
        ),
        Just(String::new()),
    ]
}

#[test]
fn parent_sessions_and_final_flags_are_read_and_written_back() {
    let text = "\
{\"timestamp\": 1, \"session_id\": 4, \"turn_id\": 1, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}
{\"timestamp\": 2, \"session_id\": 9, \"parent_session_id\": 4, \"turn_id\": 1, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 3]}
{\"timestamp\": 3, \"session_id\": 9, \"parent_session_id\": 4, \"turn_id\": 2, \"final\": true, \"input_length\": 700, \"output_length\": 5, \"hash_ids\": [1, 3]}
{\"timestamp\": 4, \"session_id\": \"agent-7\", \"parent_session_id\": \"agent-6\", \"final\": false, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [8]}
";
    let (trace, _) = parse(text).unwrap();
    let r = &trace.requests;
    assert_eq!(r[0].parent_session, None);
    assert!(!r[0].session_final);
    assert_eq!(r[1].parent_session, Some(SessionId(4)));
    assert!(!r[1].session_final);
    assert_eq!(r[2].parent_session, Some(SessionId(4)));
    assert!(r[2].session_final);
    assert_eq!(r[3].session, SessionId::from_key("agent-7"));
    assert_eq!(r[3].parent_session, Some(SessionId::from_key("agent-6")));
    assert!(!r[3].session_final);

    // Written back, set fields appear and unset ones do not; loading again gives the same.
    let mut out = Vec::new();
    trace::write_jsonl(&mut out, trace.to_records()).unwrap();
    let written = String::from_utf8(out.clone()).unwrap();
    let lines: Vec<&str> = written.lines().collect();
    assert_eq!(
        lines[0],
        r#"{"timestamp":1,"session_id":4,"turn_id":1,"input_length":600,"output_length":5,"hash_ids":[1,2]}"#
    );
    assert_eq!(
        lines[2],
        r#"{"timestamp":3,"session_id":9,"parent_session_id":4,"turn_id":2,"final":true,"input_length":700,"output_length":5,"hash_ids":[1,3]}"#
    );
    let (again, _) = trace::parse(&out[..], FILE, &LoadOptions::default()).unwrap();
    assert_eq!(again.requests, trace.requests);

    // A stream reads them too.
    let mut stream = trace::TraceStream::new(text.as_bytes(), FILE, &LoadOptions::default());
    let arrivals = trace::stream::collect(&mut stream).unwrap();
    let streamed: Vec<_> = arrivals.into_iter().map(|a| a.request).collect();
    assert_eq!(streamed, trace.requests);
}

#[test]
fn bad_parent_sessions_and_final_flags_are_invalid_fields() {
    let cases = [
        (
            r#""session_id": 3, "final": 1"#,
            "final",
            "t.jsonl:2: field `final`: expected true or false, got the number 1",
        ),
        (
            r#""session_id": 3, "final": "yes""#,
            "final",
            "t.jsonl:2: field `final`: expected true or false, got the string \"yes\"",
        ),
        (
            r#""session_id": 3, "parent_session_id": 3"#,
            "parent_session_id",
            "t.jsonl:2: field `parent_session_id`: names the record's own session 3 (a \
             session cannot be its own parent)",
        ),
        (
            r#""session_id": "a", "parent_session_id": "a""#,
            "parent_session_id",
            "t.jsonl:2: field `parent_session_id`: names the record's own session \
             12638187200555641996 (a session cannot be its own parent)",
        ),
        (
            r#""parent_session_id": 3"#,
            "parent_session_id",
            "t.jsonl:2: field `parent_session_id`: parent session 3 given on a record \
             without `session_id` (a child session must be named to be linked to its parent)",
        ),
        (
            r#""session_id": 3, "parent_session_id": -2"#,
            "parent_session_id",
            "t.jsonl:2: field `parent_session_id`: expected a non-negative integer or a \
             string, got the number -2",
        ),
    ];
    let good = r#"{"timestamp": 1, "session_id": 1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#;
    for (fields, field, msg) in cases {
        let text = format!(
            "{good}\n{{\"timestamp\": 2, {fields}, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}}\n"
        );
        let err = parse(&text).unwrap_err();
        assert!(
            matches!(&err, TraceError::InvalidField { line: 2, field: f, .. } if *f == field),
            "{fields}: {err:?}"
        );
        assert_eq!(err.to_string(), msg);
        // Skippable like every record error.
        let (trace, report) = parse_with(&text, skip()).unwrap();
        assert_eq!((trace.len(), report.skipped), (1, 1));
    }
    // Records in memory are checked the same way.
    let own = TraceRecord {
        timestamp: 0,
        session_id: Some(SessionId(5)),
        parent_session_id: Some(SessionId(5)),
        turn_id: None,
        session_final: true,
        input_length: 10,
        output_length: 1,
        hash_ids: vec![BlockHash(1)],
    };
    let err = Trace::from_records([&own], &LoadOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "<records>:1: field `parent_session_id`: names the record's own session 5 (a session \
         cannot be its own parent)"
    );
}
