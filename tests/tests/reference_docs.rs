//! The operators' reference pages agree with the code they describe:
//! - `docs/configuration.md` is exactly what `cargo xtask config-reference` renders from the
//!   configuration's schema (`kvc_router::config::reference`), and every key of that schema
//!   has a description and an example;
//! - `docs/metrics.md` has an entry for every metric family the router exports, and only for
//!   those, with the family's type, its labels, and each enumerated label's values — all read
//!   from the text exposition of a router whose every optional family is on, not from a list
//!   kept by hand.
#![forbid(unsafe_code)]

use kvc_core::{BreakerState, WorkerId, WorkerRole, WorkerState};
use kvc_router::metrics::{BlockSizes, Gauges, Metrics, PoolStats, WorkerSample};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn read(path: &str) -> String {
    let full = Path::new(ROOT).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// Where two texts first differ: the line number and both lines.
fn first_difference(committed: &str, rendered: &str) -> String {
    let mut a = committed.lines();
    let mut b = rendered.lines();
    for n in 1.. {
        match (a.next(), b.next()) {
            (None, None) => break,
            (x, y) if x == y => {}
            (x, y) => {
                return format!(
                    "line {n}:\n  committed: {}\n  rendered:  {}",
                    x.unwrap_or("(end of file)"),
                    y.unwrap_or("(end of file)")
                );
            }
        }
    }
    "the line ends differ".to_owned()
}

#[test]
fn the_configuration_reference_is_rendered_from_the_schema() {
    let reference =
        kvc_router::config::reference::render(&read("crates/kvc-router/examples/router.toml"));
    assert!(
        reference.problems.is_empty(),
        "the configuration's schema is incomplete (give each key a doc comment and an example), \
         then run `cargo xtask config-reference`:\n{}",
        reference.problems.join("\n")
    );
    let committed = read("docs/configuration.md");
    assert!(
        committed == reference.markdown,
        "docs/configuration.md is not what the configuration's schema renders: run `cargo xtask \
         config-reference` (first difference at {})",
        first_difference(&committed, &reference.markdown)
    );
}

#[test]
fn every_key_of_the_schema_is_in_the_configuration_reference() {
    // Independent of the renderer: each property of each table of the schema has a heading.
    let schema = kvc_router::config::reference::schema();
    let page = read("docs/configuration.md");
    let mut names = BTreeSet::new();
    let mut stack = vec![&schema];
    while let Some(s) = stack.pop() {
        if let Some(props) = s.get("properties").and_then(|p| p.as_object()) {
            names.extend(props.keys().cloned());
        }
        for key in ["$defs", "oneOf", "anyOf"] {
            match s.get(key) {
                Some(serde_json::Value::Object(m)) => stack.extend(m.values()),
                Some(serde_json::Value::Array(a)) => stack.extend(a.iter()),
                _ => {}
            }
        }
    }
    assert!(names.len() > 100, "{names:?}");
    for name in names {
        // A key's heading (`### `a.b.name``), or a table's (`## `[a.name]``, `[[name]]`).
        let found = [
            format!(".{name}`\n"),
            format!("# `{name}`\n"),
            format!("`[{name}]`\n"),
            format!(".{name}]`\n"),
            format!("`[[{name}]]`\n"),
        ]
        .iter()
        .any(|h| page.contains(h.as_str()));
        assert!(
            found,
            "`{name}` has no entry in docs/configuration.md: run `cargo xtask config-reference`"
        );
    }
}

/// One metric family as the exposition shows it.
#[derive(Debug, Default)]
struct Family {
    kind: String,
    /// Each label's values seen.
    labels: BTreeMap<String, BTreeSet<String>>,
}

/// The families of a Prometheus text exposition, by name: `# TYPE` lines, then each sample's
/// labels (a histogram's `le` left out).
fn families(text: &str) -> BTreeMap<String, Family> {
    let mut out: BTreeMap<String, Family> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            out.entry(name.to_owned()).or_default().kind = kind.to_owned();
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).expect("a sample line");
        let sample = &line[..name_end];
        let family = out
            .keys()
            .filter(|f| sample.starts_with(f.as_str()))
            .max_by_key(|f| f.len())
            .cloned()
            .unwrap_or_else(|| panic!("sample {sample} before its # TYPE"));
        let Some(labels) = line[name_end..]
            .strip_prefix('{')
            .and_then(|l| l.split_once('}'))
        else {
            continue;
        };
        for pair in split_labels(labels.0) {
            let (k, v) = pair.split_once('=').expect("label=value");
            if k == "le" {
                continue;
            }
            let v = v.trim_matches('"').to_owned();
            let f = out.get_mut(&family).expect("known family");
            f.labels.entry(k.to_owned()).or_default().insert(v);
        }
    }
    out
}

/// `a="x",b="y,z"` split at the commas between pairs.
fn split_labels(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in s.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < s.len() {
        out.push(&s[start..]);
    }
    out
}

/// The exposition with every family the router can export present: a worker of each kind
/// of source (events, ranks, a discovered event source, cache accounting, a drained
/// worker), the listen socket, the inference pool, a breaker, a session-key source.
fn full_exposition() -> String {
    let metrics = Metrics::new();
    metrics.record_breaker_state(WorkerId(1), BreakerState::Open);
    metrics.record_breaker_state(WorkerId(1), BreakerState::HalfOpen);
    metrics.record_breaker_state(WorkerId(1), BreakerState::Closed);
    let _ = metrics.session_key_counter("x-session-id");
    let events = kvc_events::StatsSnapshot::default();
    let worker = |id: u32, role, drained| WorkerSample {
        id: WorkerId(id),
        name: format!("w{id}"),
        role,
        state: WorkerState::empty(1_000),
        events: Some(events),
        ranks: vec![(0, events), (1, events)],
        cache_accounting: Some(id != 1),
        kv_events: Some((
            "tcp://127.0.0.1:5557".to_owned(),
            if id == 0 { "engine" } else { "config" },
        )),
        discovery_warnings: 1,
        drained,
        prefill_pace: 1.0,
    };
    let gauges = Gauges {
        workers: vec![
            worker(0, WorkerRole::Prefill, false),
            worker(1, WorkerRole::Decode, true),
            worker(2, WorkerRole::Colocated, false),
        ],
        sessions_tracked: 1,
        pending_decisions: 1,
        blocks: BlockSizes::default(),
        listener: Some(kvc_events::ListenerStats::default()),
        pool: Some(PoolStats::default()),
    };
    let mut text = metrics.render(&gauges);
    // And a service's own rendering, so that anything it adds beside `Gauges` is seen too.
    let service = kvc_router::RouterService::new(kvc_router::RouterConfig::default())
        .expect("the default configuration");
    text.push_str(&service.render_metrics());
    text
}

/// One entry of `docs/metrics.md`: its type line and its label bullets.
#[derive(Debug, Default)]
struct Entry {
    kind: String,
    /// The labels the type line names.
    labels: BTreeSet<String>,
    /// Each label's bullet: its enumerated values, or `None` for a label whose values are
    /// described in words (worker ids, names, endpoints).
    values: BTreeMap<String, Option<BTreeSet<String>>>,
}

/// The backticked words of `text` outside parentheses.
fn top_level_code(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            '`' => {
                let word: String = chars.by_ref().take_while(|&c| c != '`').collect();
                if depth == 0 {
                    out.push(word);
                }
            }
            _ => {}
        }
    }
    out
}

/// The entries of `docs/metrics.md`'s reference: a `### `name`` heading, then a line
/// `<type> · labels `a`, `b`` (or `<type> · no labels`), then a bullet per label:
/// `` - `label`: `v1`, `v2` (…) `` lists the values, `` - `label`: words `` describes them.
fn entries(page: &str) -> BTreeMap<String, Entry> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, Entry)> = None;
    let mut lines = page.lines().peekable();
    while let Some(line) = lines.next() {
        if let Some(name) = line.strip_prefix("### `").and_then(|l| l.strip_suffix('`')) {
            if let Some((n, e)) = current.take() {
                out.insert(n, e);
            }
            while lines.peek().is_some_and(|l| l.is_empty()) {
                lines.next();
            }
            let kind_line = lines.next().unwrap_or_default();
            let (kind, labels) = kind_line
                .split_once(" · ")
                .unwrap_or_else(|| panic!("{name}: `<type> · labels …` expected"));
            let entry = Entry {
                kind: kind.to_owned(),
                labels: top_level_code(labels).into_iter().collect(),
                values: BTreeMap::new(),
            };
            current = Some((name.to_owned(), entry));
            continue;
        }
        if line.starts_with("## ") {
            if let Some((n, e)) = current.take() {
                out.insert(n, e);
            }
            continue;
        }
        if let Some((_, entry)) = current.as_mut()
            && let Some(rest) = line.strip_prefix("- `")
            && let Some((label, first)) = rest.split_once("`: ")
            && entry.labels.contains(label)
        {
            // A bullet goes on over the indented lines after it.
            let mut text = first.to_owned();
            while let Some(more) = lines.peek().and_then(|l| l.strip_prefix("  ")) {
                text.push(' ');
                text.push_str(more.trim());
                lines.next();
            }
            let values = text
                .starts_with('`')
                .then(|| top_level_code(&text).into_iter().collect());
            entry.values.insert(label.to_owned(), values);
        }
    }
    if let Some((n, e)) = current {
        out.insert(n, e);
    }
    out
}

#[test]
fn the_metrics_reference_lists_every_exported_metric_and_no_other() {
    let exposed = families(&full_exposition());
    let page = read("docs/metrics.md");
    let documented = entries(&page);
    assert!(exposed.len() >= 40, "{:?}", exposed.keys());
    let missing: Vec<&String> = exposed
        .keys()
        .filter(|n| !documented.contains_key(*n))
        .collect();
    assert!(
        missing.is_empty(),
        "exported without an entry in docs/metrics.md: {missing:?}"
    );
    let gone: Vec<&String> = documented
        .keys()
        .filter(|n| !exposed.contains_key(*n))
        .collect();
    assert!(
        gone.is_empty(),
        "docs/metrics.md has entries for metrics the router does not export: {gone:?}"
    );
    for (name, family) in &exposed {
        let entry = &documented[name];
        assert_eq!(
            entry.kind, family.kind,
            "{name}: its type in docs/metrics.md"
        );
        let labels: BTreeSet<String> = family.labels.keys().cloned().collect();
        assert_eq!(
            entry.labels, labels,
            "{name}: its labels in docs/metrics.md"
        );
        for (label, seen) in &family.labels {
            match entry.values.get(label) {
                None => panic!("{name}: docs/metrics.md has no `- `{label}`: …` line"),
                Some(Some(listed)) => assert_eq!(
                    listed, seen,
                    "{name}: the values of `{label}` in docs/metrics.md"
                ),
                Some(None) => {}
            }
        }
    }
    // Every metric named anywhere on the page (the alerts' expressions too) exists, as a
    // family or as one of a histogram's series.
    let mut named = BTreeSet::new();
    let mut rest = page.as_str();
    while let Some(i) = rest.find("kvc_router_") {
        let word: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[i + word.len()..];
        if !word.ends_with('_') {
            named.insert(word);
        }
    }
    for word in named {
        let known = exposed.contains_key(&word)
            || ["_bucket", "_sum", "_count"].iter().any(|s| {
                word.strip_suffix(s)
                    .is_some_and(|f| exposed.get(f).is_some_and(|f| f.kind == "histogram"))
            });
        assert!(
            known,
            "docs/metrics.md names `{word}`, which the router does not export"
        );
    }
}
