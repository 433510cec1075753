//! Load and pool size of a stock engine, read from its Prometheus `/metrics` text.
//!
//! | what | vLLM | SGLang |
//! |---|---|---|
//! | running requests | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | waiting requests | `vllm:num_requests_waiting` | `sglang:num_queue_reqs`, plus the P/D queues `sglang:num_decode_prealloc_queue_reqs`, `sglang:num_decode_transfer_queue_reqs`, `sglang:num_prefill_bootstrap_queue_reqs` |
//! | pool use (0–1) | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` |
//! | pool size | `vllm:cache_config_info` labels `num_gpu_blocks` × `block_size` | `sglang:max_total_num_tokens` |
//! | prefix caching on | `vllm:cache_config_info` label `enable_prefix_caching` | — |
//!
//! An endpoint serving several engines (data-parallel ranks, one series per `engine` label)
//! reads as one worker: counts and pool sizes add up, pool use is the mean over the series.
//! Any other series is ignored; a series read here without a finite, non-negative value is an
//! error naming its line. The text parser follows the exposition format (comments, labels with
//! escaped quotes, optional timestamps) and never panics.

use kvc_core::EngineKind;

/// What one scrape of an engine's `/metrics` says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineLoad {
    /// Requests the engine is running (decoding or prefilling).
    pub running: u32,
    /// Requests waiting for a slot (for SGLang P/D, its prealloc, transfer and bootstrap
    /// queues included).
    pub waiting: u32,
    /// Fraction of the KV pool in use by requests, 0–1.
    pub kv_usage: f64,
    /// Size of the KV pool in tokens, when the engine reports it.
    pub pool_tokens: Option<u64>,
    /// The engine's KV block (page) size in tokens, when it reports it (vLLM).
    pub block_size: Option<u32>,
    /// Whether the engine reuses cached prefixes, when it says (vLLM's `cache_config_info`
    /// label `enable_prefix_caching`, `True` or `False`).
    pub prefix_caching: Option<bool>,
}

/// Why a `/metrics` text could not be read as an engine's load.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// A line that is not `name[{labels}] value [timestamp]`.
    #[error("line {line}: {reason}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// What was expected there.
        reason: String,
    },
    /// A series the engine must publish is absent.
    #[error("no `{0}` series (is this the engine's /metrics, and the right engine kind?)")]
    Missing(&'static str),
}

/// One sample of the text: metric name, labels, value.
#[derive(Debug, Clone, PartialEq)]
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

impl Sample<'_> {
    fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The metric names of one engine.
struct Names {
    running: &'static [&'static str],
    waiting: &'static [&'static str],
    usage: &'static [&'static str],
}

const VLLM: Names = Names {
    running: &["vllm:num_requests_running"],
    waiting: &["vllm:num_requests_waiting"],
    usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
};

const SGLANG: Names = Names {
    running: &["sglang:num_running_reqs"],
    waiting: &[
        "sglang:num_queue_reqs",
        "sglang:num_decode_prealloc_queue_reqs",
        "sglang:num_decode_transfer_queue_reqs",
        "sglang:num_prefill_bootstrap_queue_reqs",
    ],
    usage: &["sglang:token_usage"],
};

/// Reads `text` (a `/metrics` answer) as the load of an engine of `kind`.
///
/// Errors: [`LoadError::Syntax`] for a malformed sample line, [`LoadError::Missing`] when the
/// running, waiting or usage series is absent.
pub fn parse_engine_load(kind: EngineKind, text: &str) -> Result<EngineLoad, LoadError> {
    let names = match kind {
        EngineKind::Vllm => &VLLM,
        EngineKind::Sglang => &SGLANG,
    };
    let mut running = None::<f64>;
    let mut waiting = None::<f64>;
    // The first usage name present wins (vLLM's newer name before its older one).
    let mut usage: Vec<Option<(f64, u32)>> = vec![None; names.usage.len()];
    let mut pool_tokens = None::<u64>;
    let mut block_size = None::<u32>;
    let mut prefix_caching = None::<bool>;
    for (i, line) in text.lines().enumerate() {
        let Some(sample) = parse_line(line).map_err(|reason| LoadError::Syntax {
            line: i + 1,
            reason,
        })?
        else {
            continue;
        };
        let name = sample.name;
        let used = names.running.contains(&name)
            || names.waiting.contains(&name)
            || names.usage.contains(&name)
            || name == "sglang:max_total_num_tokens";
        if used && !(sample.value.is_finite() && sample.value >= 0.0) {
            return Err(LoadError::Syntax {
                line: i + 1,
                reason: format!(
                    "`{name}` is {}; expected a finite, non-negative value",
                    sample.value
                ),
            });
        }
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + sample.value);
        if names.running.contains(&name) {
            add(&mut running);
        } else if names.waiting.contains(&name) {
            add(&mut waiting);
        } else if let Some(k) = names.usage.iter().position(|n| *n == name) {
            let (sum, n) = usage[k].unwrap_or((0.0, 0));
            usage[k] = Some((sum + sample.value, n + 1));
        } else if kind == EngineKind::Vllm && name == "vllm:cache_config_info" {
            let blocks = sample
                .label("num_gpu_blocks")
                .and_then(|v| v.parse::<u64>().ok());
            let size = sample
                .label("block_size")
                .and_then(|v| v.parse::<u32>().ok());
            if let (Some(b), Some(s)) = (blocks, size) {
                pool_tokens = Some(pool_tokens.unwrap_or(0).saturating_add(b * u64::from(s)));
                block_size = Some(s);
            }
            match sample.label("enable_prefix_caching") {
                Some("True" | "true") => prefix_caching = Some(prefix_caching.unwrap_or(true)),
                Some("False" | "false") => prefix_caching = Some(false),
                _ => {}
            }
        } else if kind == EngineKind::Sglang && name == "sglang:max_total_num_tokens" {
            pool_tokens = Some(pool_tokens.unwrap_or(0).saturating_add(sample.value as u64));
        }
    }
    let running = running.ok_or(LoadError::Missing(names.running[0]))?;
    let waiting = waiting.ok_or(LoadError::Missing(names.waiting[0]))?;
    let (sum, n) = usage
        .into_iter()
        .flatten()
        .next()
        .ok_or(LoadError::Missing(names.usage[0]))?;
    Ok(EngineLoad {
        running: count(running),
        waiting: count(waiting),
        kv_usage: (sum / f64::from(n)).clamp(0.0, 1.0),
        pool_tokens,
        block_size,
        prefix_caching,
    })
}

fn count(v: f64) -> u32 {
    // Values were checked finite and non-negative; gauges of request counts are integers.
    v.round().min(f64::from(u32::MAX)) as u32
}

/// One line of the exposition text: `None` for blank and comment lines.
fn parse_line(line: &str) -> Result<Option<Sample<'_>>, String> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .ok_or_else(|| "a metric name followed by a value".to_owned())?;
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_:".contains(c))
    {
        return Err(format!("`{name}` is not a metric name"));
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail) = parse_labels(after)?;
        labels = parsed;
        rest = tail;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = fields
        .next()
        .ok_or_else(|| format!("`{name}` has no value"))?;
    let value = parse_value(value).ok_or_else(|| format!("`{value}` is not a number"))?;
    if let Some(ts) = fields.next()
        && ts.parse::<i64>().is_err()
    {
        return Err(format!("`{ts}` is not a timestamp"));
    }
    if fields.next().is_some() {
        return Err("text after the timestamp".to_owned());
    }
    Ok(Some(Sample {
        name,
        labels,
        value,
    }))
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

type Labels<'a> = Vec<(&'a str, String)>;

/// The labels after `{` up to the closing `}`, and the text after it.
fn parse_labels(mut s: &str) -> Result<(Labels<'_>, &str), String> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(tail) = s.strip_prefix('}') {
            return Ok((labels, tail));
        }
        let eq = s
            .find('=')
            .ok_or_else(|| "a label `key=\"value\"` or `}`".to_owned())?;
        let key = s[..eq].trim();
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("`{key}` is not a label name"));
        }
        let after = s[eq + 1..].trim_start();
        let mut chars = after
            .strip_prefix('"')
            .ok_or_else(|| format!("label `{key}` needs a quoted value"))?
            .char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next() {
                None => return Err(format!("label `{key}`: unterminated value")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err(format!("label `{key}`: unterminated value")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((key, value));
        // Skip the value (after the opening quote) and its closing quote.
        s = after[1 + end + 1..].trim_start();
        if let Some(tail) = s.strip_prefix(',') {
            s = tail;
        } else if !s.starts_with('}') {
            return Err(format!("`,` or `}}` after label `{key}`"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const VLLM_TEXT: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 4.0
vllm:num_requests_waiting{engine="1",model_name="qwen"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="qwen"} 0.25
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="500"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="qwen"} 12345.0
"#;

    #[test]
    fn vllm_series_add_up_across_engines() {
        let load = parse_engine_load(EngineKind::Vllm, VLLM_TEXT).unwrap();
        assert_eq!(load.running, 5);
        assert_eq!(load.waiting, 4);
        assert!((load.kv_usage - 0.375).abs() < 1e-12);
        assert_eq!(load.pool_tokens, Some(1500 * 16));
        assert_eq!(load.block_size, Some(16));
    }

    #[test]
    fn prefix_caching_is_read_and_off_on_any_rank_wins() {
        let text = |a: &str, b: &str| {
            format!(
                "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n\
                 vllm:kv_cache_usage_perc 0\n\
                 vllm:cache_config_info{{block_size=\"16\",enable_prefix_caching=\"{a}\",engine=\"0\",num_gpu_blocks=\"10\"}} 1.0\n\
                 vllm:cache_config_info{{block_size=\"16\",enable_prefix_caching=\"{b}\",engine=\"1\",num_gpu_blocks=\"10\"}} 1.0\n"
            )
        };
        let on = parse_engine_load(EngineKind::Vllm, &text("True", "True")).unwrap();
        assert_eq!(on.prefix_caching, Some(true));
        let mixed = parse_engine_load(EngineKind::Vllm, &text("True", "False")).unwrap();
        assert_eq!(mixed.prefix_caching, Some(false));
        let unsaid = parse_engine_load(EngineKind::Vllm, VLLM_TEXT).unwrap();
        assert_eq!(unsaid.prefix_caching, None);
    }

    #[test]
    fn vllm_older_usage_name_is_read_when_the_newer_is_absent() {
        let text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n\
                    vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.75\n";
        let load = parse_engine_load(EngineKind::Vllm, text).unwrap();
        assert_eq!((load.running, load.waiting), (1, 0));
        assert!((load.kv_usage - 0.75).abs() < 1e-12);
        assert_eq!(load.pool_tokens, None);
        // With both, the newer one counts.
        let both = format!("{text}vllm:kv_cache_usage_perc 0.1\n");
        let load = parse_engine_load(EngineKind::Vllm, &both).unwrap();
        assert!((load.kv_usage - 0.1).abs() < 1e-12);
    }

    #[test]
    fn sglang_waiting_includes_the_disaggregation_queues() {
        let text = r#"sglang:num_running_reqs{model_name="m",tp_rank="0"} 7
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 2
sglang:num_decode_prealloc_queue_reqs{model_name="m"} 3
sglang:num_decode_transfer_queue_reqs{model_name="m"} 1
sglang:token_usage{model_name="m"} 0.9
sglang:max_total_num_tokens{model_name="m"} 400000
sglang:cache_hit_rate{model_name="m"} 0.6
"#;
        let load = parse_engine_load(EngineKind::Sglang, text).unwrap();
        assert_eq!(load.running, 7);
        assert_eq!(load.waiting, 6);
        assert!((load.kv_usage - 0.9).abs() < 1e-12);
        assert_eq!(load.pool_tokens, Some(400_000));
        assert_eq!(load.block_size, None);
    }

    #[test]
    fn the_wrong_engine_kind_names_the_missing_series() {
        assert_eq!(
            parse_engine_load(EngineKind::Sglang, VLLM_TEXT),
            Err(LoadError::Missing("sglang:num_running_reqs"))
        );
        let no_usage = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n";
        assert_eq!(
            parse_engine_load(EngineKind::Vllm, no_usage),
            Err(LoadError::Missing("vllm:kv_cache_usage_perc"))
        );
    }

    #[test]
    fn labels_with_escapes_commas_and_braces_are_read() {
        let s = parse_line(r#"m{a="x,\"y\"}",b="c\\d\ne", } 2.5 1700000000"#)
            .unwrap()
            .unwrap();
        assert_eq!(s.name, "m");
        assert_eq!(s.label("a"), Some("x,\"y\"}"));
        assert_eq!(s.label("b"), Some("c\\d\ne"));
        assert_eq!(s.value, 2.5);
        assert_eq!(parse_line("  # a comment").unwrap(), None);
        assert_eq!(parse_line("").unwrap(), None);
    }

    #[test]
    fn malformed_lines_name_their_line_and_fault() {
        let cases = [
            ("vllm:num_requests_running", "followed by a value"),
            ("vllm:num_requests_running{a=\"b\"}", "has no value"),
            ("vllm:num_requests_running abc", "is not a number"),
            ("vllm:num_requests_running -1", "non-negative"),
            ("vllm:num_requests_running NaN", "non-negative"),
            ("vllm:num_requests_running{a=\"b} 1", "unterminated"),
            ("vllm:num_requests_running{a=b} 1", "quoted value"),
            ("vllm:num_requests_running{a=\"b\" c=\"d\"} 1", "`,` or `}`"),
            ("bad-name 1", "not a metric name"),
            ("sglang:max_total_num_tokens -5", "non-negative"),
            ("m 1 notatime", "not a timestamp"),
            ("m 1 2 3", "after the timestamp"),
        ];
        for (line, fault) in cases {
            let text = format!("# HELP x y\n{line}\n");
            match parse_engine_load(EngineKind::Vllm, &text) {
                Err(LoadError::Syntax { line: 2, reason }) => {
                    assert!(reason.contains(fault), "{line}: {reason}")
                }
                other => panic!("{line}: {other:?}"),
            }
        }
    }

    proptest! {
        #[test]
        fn any_text_is_read_or_refused_without_panic(text in "\\PC{0,200}") {
            let _ = parse_engine_load(EngineKind::Vllm, &text);
            let _ = parse_engine_load(EngineKind::Sglang, &text);
        }

        #[test]
        fn valid_counts_round_trip(running in 0u32..100_000, waiting in 0u32..100_000, usage in 0.0f64..=1.0) {
            let text = format!(
                "vllm:num_requests_running{{model_name=\"m\"}} {running}\n\
                 vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}.0\n\
                 vllm:kv_cache_usage_perc{{model_name=\"m\"}} {usage}\n"
            );
            let load = parse_engine_load(EngineKind::Vllm, &text).unwrap();
            prop_assert_eq!(load.running, running);
            prop_assert_eq!(load.waiting, waiting);
            prop_assert!((load.kv_usage - usage).abs() < 1e-12);
        }
    }
}
