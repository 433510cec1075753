//! Workers named on the command line by their URL alone (`kvc-router --prefill URL --decode
//! URL`, `--worker URL`), made into `[[workers]]` entries the rest of the router reads as if
//! a file held them.
//!
//! Such a worker has its `http-url`, its `engine` and nothing else the operator must know:
//! a vLLM engine's pool, block size, KV-event source and served model are read from the engine
//! itself (`discover`, by default on for `engine = "vllm"` with an `http-url`: `metrics-url`
//! is `<URL>/metrics`, the event source `GET <URL>/kv_event_sources`), so `capacity-tokens` is
//! left at 0 unless `--capacity-tokens` sets it. An SGLang engine reports neither its events'
//! source nor (to the router) its pool size, so SGLang workers need `--capacity-tokens`; their
//! load is read from `<URL>/metrics` (SGLang's `--enable-metrics`).
//!
//! Names are `p0`, `p1`, … for prefill workers, `d0`, … for decode workers and `w0`, … for
//! colocated ones (the lowest free one, when a configuration file's workers hold a name); ids
//! continue after the file's highest.

use crate::ConfigError;
use crate::config::{RouterConfig, WorkerConfig, WorkerUrl};
use kvc_core::{EngineKind, WorkerRole};
use std::path::Path;

/// Reads a configuration file as [`RouterConfig::from_file`] does (the same errors, the keys
/// read from each worker's engine URLs filled in), but leaves validation to the caller: the
/// command line's workers are added first (a file of decode workers may get its prefill
/// workers from the command line), then the whole is validated.
pub fn read_unvalidated(path: &Path) -> Result<RouterConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    let mut cfg: RouterConfig =
        toml::from_str(&text).map_err(|e| ConfigError::Parse(e.to_string()))?;
    for w in &mut cfg.workers {
        w.fill_from_engine_urls();
    }
    Ok(cfg)
}

/// The workers given on the command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlagWorkers {
    /// `--prefill` URLs, in order.
    pub prefill: Vec<String>,
    /// `--decode` URLs, in order.
    pub decode: Vec<String>,
    /// `--worker` URLs (colocated workers), in order.
    pub colocated: Vec<String>,
    /// The engine behind every one of them (`--engine`; default vLLM).
    pub engine: Option<EngineKind>,
    /// Their KV pool in tokens (`--capacity-tokens`); `None` reads it from a vLLM engine.
    pub capacity_tokens: Option<u64>,
}

/// Why the command line's workers cannot be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlagWorkerError {
    /// A URL that is not `http://host:port[/prefix]`.
    #[error("{flag} `{url}`: not a worker URL (expected http://host:port[/prefix])")]
    BadUrl {
        /// The flag that gave it (`--prefill`, `--decode`, `--worker`).
        flag: &'static str,
        /// The value given.
        url: String,
    },
    /// A URL given twice, or given by a flag and held by a configured worker.
    #[error("{flag} `{url}`: this URL is already worker `{other}` (a worker is named once)")]
    Twice {
        /// The flag that gave it the second time.
        flag: &'static str,
        /// The value given.
        url: String,
        /// The worker that has it.
        other: String,
    },
    /// SGLang workers without a pool size.
    #[error(
        "--engine sglang needs --capacity-tokens (the KV pool of each worker, SGLang's \
         max_total_num_tokens): the router reads a pool size from vLLM engines only"
    )]
    SglangWithoutCapacity,
}

impl FlagWorkers {
    /// Whether any worker was given.
    pub fn is_empty(&self) -> bool {
        self.prefill.is_empty() && self.decode.is_empty() && self.colocated.is_empty()
    }

    /// Appends the workers to `cfg.workers`, after the ones there; returns how many. The
    /// result is not validated (the caller validates the whole configuration).
    pub fn add_to(&self, cfg: &mut RouterConfig) -> Result<usize, FlagWorkerError> {
        let engine = self.engine.unwrap_or(EngineKind::Vllm);
        if engine == EngineKind::Sglang && self.capacity_tokens.is_none() && !self.is_empty() {
            return Err(FlagWorkerError::SglangWithoutCapacity);
        }
        let mut next_id = cfg.workers.iter().map(|w| w.id + 1).max().unwrap_or(0);
        let groups = [
            ("--prefill", WorkerRole::Prefill, "p", &self.prefill),
            ("--decode", WorkerRole::Decode, "d", &self.decode),
            ("--worker", WorkerRole::Colocated, "w", &self.colocated),
        ];
        let mut added = 0;
        for (flag, role, prefix, urls) in groups {
            for url in urls {
                let parsed = WorkerUrl::parse(url).map_err(|_| FlagWorkerError::BadUrl {
                    flag,
                    url: url.clone(),
                })?;
                let key = url_key(&parsed);
                if let Some(other) = cfg.workers.iter().find(|w| {
                    w.http_url
                        .as_deref()
                        .and_then(|u| WorkerUrl::parse(u).ok())
                        .is_some_and(|u| url_key(&u) == key)
                }) {
                    return Err(FlagWorkerError::Twice {
                        flag,
                        url: url.clone(),
                        other: other.display_name(),
                    });
                }
                let name = free_name(cfg, prefix);
                let mut w = WorkerConfig {
                    name: Some(name),
                    http_url: Some(url.clone()),
                    engine: Some(engine),
                    ..WorkerConfig::new(next_id, role, self.capacity_tokens.unwrap_or(0))
                };
                match engine {
                    EngineKind::Vllm => w.fill_from_engine_urls(),
                    EngineKind::Sglang => w.metrics_url = Some(parsed.uri("/metrics")),
                }
                cfg.workers.push(w);
                next_id += 1;
                added += 1;
            }
        }
        Ok(added)
    }
}

/// A worker URL as two spellings of one server compare: host lower-cased, port explicit,
/// prefix kept.
fn url_key(u: &WorkerUrl) -> String {
    format!("{}{}", u.authority().to_ascii_lowercase(), u.prefix)
}

/// `<prefix><n>` with the lowest `n` no worker of `cfg` is named (or displayed) as.
fn free_name(cfg: &RouterConfig, prefix: &str) -> String {
    (0..)
        .map(|n| format!("{prefix}{n}"))
        .find(|name| cfg.workers.iter().all(|w| w.display_name() != *name))
        .expect("a free name")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn urls_become_discovering_vllm_workers_named_by_role() {
        let flags = FlagWorkers {
            prefill: urls(&["http://10.0.0.1:8000"]),
            decode: urls(&["http://10.0.0.2:8000", "http://10.0.0.3:8000/v"]),
            ..FlagWorkers::default()
        };
        let mut cfg = RouterConfig::default();
        assert_eq!(flags.add_to(&mut cfg), Ok(3));
        cfg.validate().unwrap();
        let got: Vec<(u32, String, WorkerRole)> = cfg
            .workers
            .iter()
            .map(|w| (w.id, w.display_name(), w.role))
            .collect();
        assert_eq!(
            got,
            [
                (0, "p0".to_owned(), WorkerRole::Prefill),
                (1, "d0".to_owned(), WorkerRole::Decode),
                (2, "d1".to_owned(), WorkerRole::Decode),
            ]
        );
        let d1 = &cfg.workers[2];
        assert_eq!(d1.engine, Some(EngineKind::Vllm));
        assert_eq!(d1.capacity_tokens, 0);
        assert_eq!(
            d1.metrics_url.as_deref(),
            Some("http://10.0.0.3:8000/v/metrics")
        );
        assert!(d1.pool_from_engine() && d1.discovers_events());
        assert_eq!(d1.kv_events, None);
    }

    #[test]
    fn flag_workers_follow_a_files_ids_and_names() {
        let mut cfg = RouterConfig::from_toml_str(
            "[[workers]]\nid = 4\nrole = \"colocated\"\ncapacity-tokens = 1000\n\
             snapshot = \"/dev/shm/x.snap\"\nhttp-url = \"http://h:1\"\n",
        )
        .unwrap();
        let flags = FlagWorkers {
            colocated: urls(&["http://h:2"]),
            ..FlagWorkers::default()
        };
        flags.add_to(&mut cfg).unwrap();
        // The file's worker is displayed as `w4`; the flag's is the lowest free `w`.
        assert_eq!(cfg.workers[1].id, 5);
        assert_eq!(cfg.workers[1].display_name(), "w0");
        cfg.validate().unwrap();
    }

    #[test]
    fn a_file_is_read_as_the_loader_reads_it_and_checked_with_the_flags_workers() {
        let dir = std::env::temp_dir().join(format!("kvc-flag-workers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("router.toml");
        std::fs::write(
            &file,
            "[[workers]]\nid = 0\nrole = \"decode\"\nengine = \"vllm\"\nhttp-url = \"http://d:1\"\n",
        )
        .unwrap();
        // Alone, the file's decode worker cannot route; with a prefill worker it can.
        assert!(RouterConfig::from_file(&file).is_err());
        let mut cfg = read_unvalidated(&file).unwrap();
        assert_eq!(
            cfg.workers[0].metrics_url.as_deref(),
            Some("http://d:1/metrics")
        );
        let flags = FlagWorkers {
            prefill: urls(&["http://p:1"]),
            ..FlagWorkers::default()
        };
        flags.add_to(&mut cfg).unwrap();
        cfg.validate().unwrap();
        std::fs::write(
            &file,
            "[[workers]]\nid = 0\nrole = \"decode\"\ncapcity-tokens = 5\n",
        )
        .unwrap();
        let parse = read_unvalidated(&file).unwrap_err().to_string();
        assert_eq!(
            parse,
            RouterConfig::from_file(&file).unwrap_err().to_string()
        );
        assert!(parse.contains("capcity-tokens"), "{parse}");
        let missing = read_unvalidated(&dir.join("absent.toml")).unwrap_err();
        assert!(matches!(missing, ConfigError::Read { .. }), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_url_given_twice_or_malformed_is_named_with_its_flag() {
        let twice = FlagWorkers {
            prefill: urls(&["http://H:80"]),
            decode: urls(&["http://h"]),
            ..FlagWorkers::default()
        };
        let e = twice.add_to(&mut RouterConfig::default()).unwrap_err();
        assert_eq!(
            e,
            FlagWorkerError::Twice {
                flag: "--decode",
                url: "http://h".into(),
                other: "p0".into()
            }
        );
        assert!(e.to_string().starts_with("--decode `http://h`"), "{e}");
        let bad = FlagWorkers {
            decode: urls(&["10.0.0.1:8000"]),
            ..FlagWorkers::default()
        };
        let e = bad.add_to(&mut RouterConfig::default()).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("--decode `10.0.0.1:8000`: not a worker URL"),
            "{e}"
        );
    }

    #[test]
    fn sglang_workers_need_a_pool_size_and_read_their_load_from_metrics() {
        let mut flags = FlagWorkers {
            prefill: urls(&["http://p:30000"]),
            decode: urls(&["http://d:30000"]),
            engine: Some(EngineKind::Sglang),
            ..FlagWorkers::default()
        };
        assert_eq!(
            flags.add_to(&mut RouterConfig::default()),
            Err(FlagWorkerError::SglangWithoutCapacity)
        );
        flags.capacity_tokens = Some(92_000);
        let mut cfg = RouterConfig::default();
        flags.add_to(&mut cfg).unwrap();
        cfg.validate().unwrap();
        assert_eq!(
            cfg.workers[1].metrics_url.as_deref(),
            Some("http://d:30000/metrics")
        );
        assert!(!cfg.workers[1].can_append_prefill());
    }
}
