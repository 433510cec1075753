//! Reading criterion's results where criterion writes them.
//!
//! criterion 0.8 files a benchmark under a folder made from its id with every `/` (and a few
//! other characters) turned into `_` and long names cut, and with a suffix when two ids map
//! to one folder: `select/d8/kvc-v2-direct` is `select/d8_kvc-v2-direct/`. Rather than redo
//! that mapping, the reader finds each `new/benchmark.json` under the criterion folder, whose
//! `full_id` is the id as the bench named it, and reads `new/estimates.json` beside it. A result
//! older than the run that asks for it is refused: a folder left by an earlier run (or an
//! earlier layout) never stands in for a benchmark that did not run.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// One benchmark's files: its `new/` folder and when its estimates were written.
#[derive(Debug)]
struct Entry {
    new_dir: PathBuf,
    written: Option<SystemTime>,
}

/// The benchmarks found under one criterion folder, by full id.
#[derive(Debug)]
pub(crate) struct Results {
    root: PathBuf,
    by_id: BTreeMap<String, Entry>,
}

impl Results {
    /// Every benchmark under `root` (e.g. `target/criterion`); an absent folder holds none.
    pub(crate) fn scan(root: &Path) -> Result<Results, String> {
        let mut by_id = BTreeMap::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let entries = match std::fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(format!("cannot list {}: {e}", dir.display())),
            };
            for entry in entries {
                let path = entry
                    .map_err(|e| format!("cannot list {}: {e}", dir.display()))?
                    .path();
                if !path.is_dir() {
                    continue;
                }
                // A run's own results are in `new/`; `base/` and `change/` are comparisons.
                if path.file_name().is_some_and(|n| n == "new") {
                    let meta = path.join("benchmark.json");
                    if !meta.is_file() {
                        continue;
                    }
                    let id = crate::bench::read_json(&meta)?
                        .get("full_id")
                        .and_then(Value::as_str)
                        .ok_or_else(|| format!("{}: no full_id", meta.display()))?
                        .to_owned();
                    let written = std::fs::metadata(path.join("estimates.json"))
                        .and_then(|m| m.modified())
                        .ok();
                    // Two folders with one id (an earlier layout's beside today's): the
                    // newer one is this run's.
                    let newer = by_id.get(&id).is_none_or(|e: &Entry| e.written < written);
                    if newer {
                        by_id.insert(
                            id,
                            Entry {
                                new_dir: path,
                                written,
                            },
                        );
                    }
                } else if path.file_name().is_none_or(|n| n != "report") {
                    stack.push(path);
                }
            }
        }
        Ok(Results {
            root: root.to_path_buf(),
            by_id,
        })
    }

    /// The median of benchmark `id`, in ns, from estimates written at or after `since`.
    pub(crate) fn median_ns(&self, id: &str, since: SystemTime) -> Result<f64, String> {
        let Some(entry) = self.by_id.get(id) else {
            let known: Vec<&str> = self.by_id.keys().map(String::as_str).collect();
            return Err(format!(
                "criterion wrote no result for `{id}` under {} (found: {})",
                self.root.display(),
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ));
        };
        let path = entry.new_dir.join("estimates.json");
        match entry.written {
            None => return Err(format!("cannot read {}", path.display())),
            Some(t) if t < since => {
                return Err(format!(
                    "{} is older than this run: `{id}` did not run (or wrote elsewhere)",
                    path.display()
                ));
            }
            Some(_) => {}
        }
        let v = crate::bench::read_json(&path)?;
        crate::bench::at(&v, &["median", "point_estimate"])
            .and_then(Value::as_f64)
            .filter(|m| m.is_finite())
            .ok_or_else(|| format!("{}: no median.point_estimate", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A scratch folder, removed with the value.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let dir =
                std::env::temp_dir().join(format!("xtask-criterion-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Writes a benchmark's `new/` files as criterion 0.8 does, in folder `dir`.
    fn write_bench(root: &Path, dir: &str, full_id: &str, median: f64) {
        let new = root.join(dir).join("new");
        std::fs::create_dir_all(&new).unwrap();
        std::fs::write(
            new.join("benchmark.json"),
            serde_json::json!({ "full_id": full_id, "directory_name": dir }).to_string(),
        )
        .unwrap();
        std::fs::write(
            new.join("estimates.json"),
            serde_json::json!({ "median": { "point_estimate": median } }).to_string(),
        )
        .unwrap();
    }

    #[test]
    fn an_id_with_slashes_is_read_from_the_folder_criterion_made_of_it() {
        let s = Scratch::new("slashes");
        write_bench(&s.0, "select/d8", "select/d8", 120.0);
        write_bench(
            &s.0,
            "select/d8_kvc-v2-direct",
            "select/d8/kvc-v2-direct",
            45.5,
        );
        // The older nested layout's folder for the same id, with a stale figure: not read.
        write_bench(
            &s.0,
            "select/d8/kvc-v2-direct",
            "select/d8/kvc-v2-direct",
            1.0,
        );
        let stale = std::fs::File::options()
            .write(true)
            .open(s.0.join("select/d8/kvc-v2-direct/new/estimates.json"))
            .unwrap();
        stale
            .set_modified(SystemTime::now() - Duration::from_secs(3600))
            .unwrap();
        let r = Results::scan(&s.0).unwrap();
        let since = SystemTime::now() - Duration::from_secs(60);
        assert_eq!(r.median_ns("select/d8", since), Ok(120.0));
        assert_eq!(r.median_ns("select/d8/kvc-v2-direct", since), Ok(45.5));
    }

    #[test]
    fn a_missing_benchmark_is_an_error_naming_it_and_what_was_found() {
        let s = Scratch::new("missing");
        write_bench(&s.0, "probe/readers1", "probe/readers1", 30.0);
        let r = Results::scan(&s.0).unwrap();
        let err = r
            .median_ns("probe/readers2", SystemTime::UNIX_EPOCH)
            .unwrap_err();
        assert!(err.contains("no result for `probe/readers2`"), "{err}");
        assert!(err.contains("found: probe/readers1"), "{err}");
        // An estimates file removed after the scan: its path is named.
        std::fs::remove_file(s.0.join("probe/readers1/new/estimates.json")).unwrap();
        let err = Results::scan(&s.0)
            .unwrap()
            .median_ns("probe/readers1", SystemTime::UNIX_EPOCH)
            .unwrap_err();
        assert!(err.contains("readers1/new/estimates.json"), "{err}");
        // No criterion folder at all: nothing found, no panic.
        let none = Results::scan(&s.0.join("absent")).unwrap();
        let err = none
            .median_ns("probe/readers1", SystemTime::UNIX_EPOCH)
            .unwrap_err();
        assert!(err.contains("found: none"), "{err}");
    }

    #[test]
    fn a_result_older_than_the_run_is_refused() {
        let s = Scratch::new("stale");
        write_bench(
            &s.0,
            "commit_evict/round_trip",
            "commit_evict/round_trip",
            9.0,
        );
        let r = Results::scan(&s.0).unwrap();
        let later = SystemTime::now() + Duration::from_secs(3600);
        let err = r.median_ns("commit_evict/round_trip", later).unwrap_err();
        assert!(err.contains("older than this run"), "{err}");
    }

    #[test]
    fn estimates_without_a_median_are_an_error() {
        let s = Scratch::new("nomedian");
        write_bench(&s.0, "events_apply/x", "events_apply/x", 1.0);
        std::fs::write(
            s.0.join("events_apply/x/new/estimates.json"),
            r#"{"mean": {"point_estimate": 3.0}}"#,
        )
        .unwrap();
        let err = Results::scan(&s.0)
            .unwrap()
            .median_ns("events_apply/x", SystemTime::UNIX_EPOCH)
            .unwrap_err();
        assert!(err.contains("no median.point_estimate"), "{err}");
    }
}
