//! The keys of `cargo xtask bench`'s `summary.json` and the check a run makes of it: every
//! documented key there, and a number.

use crate::bench::{
    CELL_METRICS, EPP_KEYS, EVENTS_FANIN_KEYS, Mode, POLICIES, ROUTER_KEYS, SELECT_DIRECT,
    SELECT_FLEETS, SESSIONS_KEYS, SWEEP_TOPOLOGIES, TIME_SCALES, TOPOLOGIES, TRACE_KEYS, read_json,
};
use std::path::Path;

/// Every key `summary.json` holds after a run in `mode` (`cargo xtask help` documents each).
pub(crate) fn expected_keys(mode: Mode) -> Vec<String> {
    let mut keys = Vec::new();
    for d in SELECT_FLEETS {
        keys.push(format!("policy.select_ns.{d}"));
        for direct in SELECT_DIRECT {
            keys.push(format!("policy.select_ns.{d}.{direct}"));
        }
    }
    let prefixed = |prefix: &str, names: &[&str]| -> Vec<String> {
        names.iter().map(|k| format!("{prefix}.{k}")).collect()
    };
    keys.extend(prefixed("policy.sessions", &SESSIONS_KEYS));
    keys.extend(prefixed("router", &ROUTER_KEYS));
    keys.extend(prefixed("router.decision", &TRACE_KEYS));
    keys.extend(prefixed("epp", &EPP_KEYS));
    keys.extend(prefixed(
        "admission",
        &[
            "probe_ns",
            "probe_ns_2_readers",
            "probes_per_sec",
            "commit_evict_us",
        ],
    ));
    keys.extend(prefixed(
        "events",
        &[
            "apply_blocks_per_s",
            "overlap_4096_tokens_8_workers_ns",
            "overlap_hashed_4096_tokens_8_workers_ns",
            "bytes_per_block",
        ],
    ));
    keys.extend(prefixed("events", &EVENTS_FANIN_KEYS));
    keys.extend(prefixed("sim.default", &["wall_s", "requests_per_sec"]));
    keys.extend(prefixed(
        "sim.large",
        &["requests", "wall_s", "peak_rss_mib"],
    ));
    keys.extend(prefixed(
        mode.sim_sizes().stream_key,
        &["wall_s", "requests_per_sec", "peak_rss_mib"],
    ));
    keys.push("sim.kvc_ts10_2p6d_seeds".into());
    for (_, key) in SWEEP_TOPOLOGIES {
        keys.push(format!("sim.kvc_ts10_{key}_mechanism_errors_max"));
        keys.push(format!("sim.kvc_ts10_{key}_mechanism_errors_total"));
    }
    for topology in TOPOLOGIES {
        for policy in POLICIES {
            for ts in TIME_SCALES {
                for (m, _) in CELL_METRICS {
                    keys.push(format!("matrix.{topology}.{policy}.ts{ts}.{m}"));
                }
            }
        }
    }
    keys
}

/// Checks the summary at `path` as a reader of it would: a JSON object holding every key of
/// `expected` as a finite number. The error names the file and every key missing or not a
/// number.
pub(crate) fn check_summary(path: &Path, expected: &[String]) -> Result<(), String> {
    let v = read_json(path)?;
    let obj = v
        .as_object()
        .ok_or_else(|| format!("{}: not a JSON object", path.display()))?;
    let mut missing = Vec::new();
    let mut not_numbers = Vec::new();
    for key in expected {
        match obj.get(key) {
            None => missing.push(key.as_str()),
            Some(v) if v.as_f64().is_none_or(|x| !x.is_finite()) => {
                not_numbers.push(format!("{key} = {v}"));
            }
            Some(_) => {}
        }
    }
    if missing.is_empty() && not_numbers.is_empty() {
        return Ok(());
    }
    let mut err = format!("{}:", path.display());
    if !missing.is_empty() {
        err.push_str(&format!(
            " {} documented key(s) missing: {}",
            missing.len(),
            missing.join(", ")
        ));
    }
    if !not_numbers.is_empty() {
        err.push_str(&format!(
            " {} key(s) not a finite number: {}",
            not_numbers.len(),
            not_numbers.join(", ")
        ));
    }
    Err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, Value};
    use std::path::PathBuf;

    /// A summary file in a scratch folder, removed with the value.
    struct Summary(PathBuf);

    impl Summary {
        fn write(tag: &str, obj: &Map<String, Value>) -> Summary {
            let dir =
                std::env::temp_dir().join(format!("xtask-summary-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("summary.json");
            std::fs::write(&path, Value::Object(obj.clone()).to_string()).unwrap();
            Summary(path)
        }
    }

    impl Drop for Summary {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(self.0.parent().unwrap());
        }
    }

    fn complete(mode: Mode) -> Map<String, Value> {
        expected_keys(mode)
            .into_iter()
            .enumerate()
            .map(|(i, k)| (k, Value::from(i as f64 + 0.5)))
            .collect()
    }

    #[test]
    fn a_complete_summary_passes() {
        let s = Summary::write("complete", &complete(Mode::Smoke));
        assert_eq!(check_summary(&s.0, &expected_keys(Mode::Smoke)), Ok(()));
    }

    #[test]
    fn a_summary_missing_a_documented_key_fails_naming_it() {
        let mut obj = complete(Mode::Full);
        obj.remove("policy.select_ns.d8.kvc-v2-direct");
        obj.remove("matrix.8dp.kvc.ts10.mechanism_errors");
        let s = Summary::write("missing", &obj);
        let err = check_summary(&s.0, &expected_keys(Mode::Full)).unwrap_err();
        assert!(err.contains("2 documented key(s) missing"), "{err}");
        assert!(err.contains("policy.select_ns.d8.kvc-v2-direct"), "{err}");
        assert!(
            err.contains("matrix.8dp.kvc.ts10.mechanism_errors"),
            "{err}"
        );
        // A quick run's summary lacks the full run's streamed keys.
        let s = Summary::write("quick", &complete(Mode::Quick));
        let err = check_summary(&s.0, &expected_keys(Mode::Full)).unwrap_err();
        assert!(err.contains("sim.stream_10m.wall_s"), "{err}");
    }

    #[test]
    fn a_key_that_is_not_a_finite_number_fails() {
        let mut obj = complete(Mode::Smoke);
        obj.insert("events.bytes_per_block".into(), Value::Null);
        obj.insert("router.route_rps".into(), Value::from("fast"));
        let s = Summary::write("nan", &obj);
        let err = check_summary(&s.0, &expected_keys(Mode::Smoke)).unwrap_err();
        assert!(err.contains("2 key(s) not a finite number"), "{err}");
        assert!(err.contains("events.bytes_per_block = null"), "{err}");
        assert!(err.contains("router.route_rps = \"fast\""), "{err}");
    }

    #[test]
    fn a_missing_or_broken_summary_file_fails_naming_it() {
        let s = Summary::write("broken", &complete(Mode::Smoke));
        std::fs::write(&s.0, "{ not json").unwrap();
        let err = check_summary(&s.0, &expected_keys(Mode::Smoke)).unwrap_err();
        assert!(err.starts_with("invalid JSON in "), "{err}");
        std::fs::remove_file(&s.0).unwrap();
        let err = check_summary(&s.0, &expected_keys(Mode::Smoke)).unwrap_err();
        assert!(err.starts_with("cannot read "), "{err}");
        assert!(err.contains("summary.json"), "{err}");
    }
}
