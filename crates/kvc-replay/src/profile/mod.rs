//! Engine profiling (`kvc-replay profile`): a live OpenAI-compatible engine (vLLM first) measured
//! with a bounded sweep of requests, and the factors of an engine profile
//! ([`kvc_engine_sim::model::Profile`], the `profiles/*.toml` format that `kvc-replay sim
//! --profile` reads) fitted to what was measured.
//!
//! What is measured, each as time at the client:
//! - **prefill**: single requests one at a time, `n` new tokens after `c` cached ones (the
//!   prefix sent alone first, its `cached_tokens` checked); the time to the first token is
//!   fitted as `overhead + linear(n) / (efficiency × peak) + attention(n, c) /
//!   (attention efficiency × peak)` with the profile's own FLOP counts →
//!   `fit.prefill_efficiency`, `fit.attention_efficiency`, `fit.prefill_overhead_ms`; when the
//!   two efficiencies cannot be told apart (within one standard error of each other, or points
//!   that cannot separate them) one efficiency for all FLOPs, with a warning
//!   ([`fit::fit_prefill`]);
//! - **decode**: `B` concurrent streams of context `L`, each prompt sent alone first to be
//!   cached (so that the streams start together and no step of theirs also prefills); the
//!   time of one decode step while all `B` decode is fitted as `overhead + bytes(B, Σ
//!   context) / (efficiency × bandwidth)` → `fit.decode_efficiency`, `fit.decode_overhead_ms`.
//!   The one time not taken at the client: where the engine counts its own decoding (vLLM's
//!   `vllm:request_decode_time_seconds` and `vllm:generation_tokens_total`, read before and
//!   after each point, [`fit::engine_decode_step`]), the step is its seconds of decoding
//!   over its steps, since a loaded client or API server delivers tokens in bursts whose
//!   times say little of the engine's (the streams' reading is reported beside it);
//! - **transfer** (with a NixlConnector prefill/decode pair): vLLM's two calls, P's answer's
//!   `kv_transfer_params` handed to D; D's time to the first token less one decode step is
//!   fitted as `setup + tokens × KV bytes per token / bandwidth` → `fit.transfer_bytes_per_s`,
//!   `fit.transfer_setup_ms`;
//! - **intake**: cached chats (their text the engine's `/detokenize` of token ids, where it
//!   serves it); a chat's time less the prefill fit's time for its uncached tail is fitted as
//!   `intake + per_token × prompt tokens` → `fit.intake_ms`, `fit.intake_ms_per_1k_tokens`
//!   ([`fit::intake_line`]).
//!
//! Every intercept holds whatever a request costs whatever its size: the engine's own fixed
//! cost, and the HTTP round trip, request parsing and streaming at the client (the profiler
//! reports the client's `GET /health` round trip beside it); a cost per prompt token of the
//! server's request handling lands in the prefill and transfer slopes the same way. That is
//! the cost a request sees, which is what the simulator's overheads stand for.
//!
//! Two readings depend on what the engine does, and are chosen from what it shows:
//! - an engine that does not count its decoding (the simulated workers) has the decode step
//!   read off the streams: with one chunk per token, as the streams' time from first to last
//!   token while every stream decodes, over the steps between, only chunks that end a burst
//!   taken as ends; with several tokens a chunk (the simulated workers: the first token, then
//!   the rest), as the mean gap of the stream that started last ([`fit::decode_step`]);
//! - a prefill engine that answers P's call only once it has prefilled (vLLM) leaves nothing
//!   to take off D's wait; one that answers at once and prefills while D waits (the simulated
//!   workers) has the prefill its answer did not cover taken off too ([`fit::transfer_seconds`]).
//!
//! Measuring an engine and writing its profile (`profile.fit.json` goes beside it):
//!
//! ```no_run
//! use kvc_replay::profile::{PdUrls, ProfileOptions, profile_engine, write_profile};
//!
//! let mut opts = ProfileOptions::new("http://127.0.0.1:8000");
//! opts.pair = Some(PdUrls {
//!     prefill: "http://127.0.0.1:8100".into(),
//!     decode: "http://127.0.0.1:8200".into(),
//! });
//! opts.peak_flops = Some(989e12);
//! opts.seed = 42;
//! let run = profile_engine(&opts, &mut |line| eprintln!("{line}"))?;
//! println!("prefill efficiency {:.3}", run.profile.fit.prefill_efficiency);
//! write_profile(&run, std::path::Path::new("profile.toml"))?;
//! # Ok::<(), kvc_replay::profile::ProfileError>(())
//! ```
//!
//! | module | job |
//! |---|---|
//! | [`plan`] | the sweep plan from the engine's limits, and the never-seen token-id prompts (pure) |
//! | [`fit`] | least squares, residuals, the work of a point, the decode-step and transfer estimates, the factors (pure) |
//! | [`report`] | each sweep's points and fit, the engine's facts, the profile built and its TOML with the residuals (pure) |
//! | `engine` | the HTTP calls to an engine and their timing (I/O) |
//! | `run` | the sweeps carried out against the engines, in order, with progress lines |

mod engine;
pub mod fit;
pub mod plan;
pub mod report;
mod run;

pub use report::{FitReport, ProfileRun};
pub use run::{fit_json_path, profile_engine, write_profile};

use kvc_engine_sim::model::Profile;
use std::time::Duration;

/// Why a profile could not be measured or written.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// A bad setting.
    #[error("{0}")]
    Invalid(String),
    /// An engine's `GET /health` did not answer 2xx in time (the message names the URL).
    #[error("{0}")]
    NotReady(String),
    /// A call to an engine failed on the way: refused, broken off, or not answered in time.
    #[error("{url}: {message}")]
    Transport {
        /// The URL asked.
        url: String,
        /// What happened.
        message: String,
    },
    /// An engine answered with a status other than 2xx.
    #[error("{url} answered {status} (expected {expected}): {body}")]
    Status {
        /// The URL asked.
        url: String,
        /// The HTTP status.
        status: u16,
        /// What should have come.
        expected: String,
        /// The first bytes of the answer's body.
        body: String,
    },
    /// An engine answered something other than what was expected.
    #[error("{url}: {message}")]
    Unexpected {
        /// The URL asked.
        url: String,
        /// What was expected and what came.
        message: String,
    },
    /// A sweep left too few usable points to fit a line.
    #[error(
        "the {sweep} sweep left {usable} usable point(s); a fit needs at least {needed} at two \
         or more sizes"
    )]
    TooFewPoints {
        /// `prefill`, `decode` or `transfer`.
        sweep: &'static str,
        /// Points measured and usable.
        usable: usize,
        /// Points needed.
        needed: usize,
    },
    /// The measured times do not fit the model (they do not grow with the work).
    #[error("the {sweep} sweep cannot be fitted: {message}")]
    Unfittable {
        /// `prefill`, `decode` or `transfer`.
        sweep: &'static str,
        /// Why.
        message: String,
    },
    /// A fitted efficiency above 1: the hardware facts understate the hardware.
    #[error(
        "{factor} came out at {value:.3}, above 1: the engine ran faster than the hardware facts \
         allow ({fact} = {fact_value:e}); raise {flag} to the hardware's real figure"
    )]
    EfficiencyAboveOne {
        /// The profile key (`fit.prefill_efficiency`, `fit.decode_efficiency`).
        factor: &'static str,
        /// The fitted value.
        value: f64,
        /// The hardware fact it divides (`hardware.peak_flops`, `hardware.hbm_bytes_per_s`).
        fact: &'static str,
        /// Its value.
        fact_value: f64,
        /// The option that sets it (`--peak-flops`, `--mem-bandwidth`).
        flag: &'static str,
    },
    /// The profile or its report could not be written.
    #[error("cannot write {path}: {message}")]
    Write {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
}

/// A NixlConnector prefill/decode pair, for the transfer sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdUrls {
    /// The prefill engine (`kv_role: kv_producer`).
    pub prefill: String,
    /// The decode engine (`kv_role: kv_consumer`).
    pub decode: String,
}

/// What to measure and how.
#[derive(Debug, Clone)]
pub struct ProfileOptions {
    /// A colocated engine (serves whole requests): the prefill and decode sweeps.
    pub url: String,
    /// Where the engine's Prometheus metrics are (default: `url` + `/metrics`, as vLLM serves
    /// them).
    pub metrics_url: Option<String>,
    /// A prefill/decode pair for the transfer sweep; without one the facts profile's transfer
    /// factors are kept.
    pub pair: Option<PdUrls>,
    /// The model named in requests (default: the first of the engine's `/v1/models`).
    pub model: Option<String>,
    /// The profile whose `[model]` and `[hardware]` facts the fits use and whose other `[fit]`
    /// factors are kept.
    pub facts: Profile,
    /// Where the facts came from (named in the output).
    pub facts_origin: String,
    /// Overrides `hardware.peak_flops`.
    pub peak_flops: Option<f64>,
    /// Overrides `hardware.hbm_bytes_per_s`.
    pub mem_bandwidth: Option<f64>,
    /// The engine's chunked-prefill budget (default: the facts' `fit.chunk_tokens`).
    pub chunk_tokens: Option<u64>,
    /// The longest context any sweep sends.
    pub max_context: u64,
    /// Each point is measured this many times; the median is fitted.
    pub repeats: usize,
    /// Tokens each decode stream generates.
    pub decode_tokens: u64,
    /// The profile's name (default: the model's, with `-profiled`).
    pub name: Option<String>,
    /// Seeds the prompts' token ids. Two runs with one seed send the same prompts: against
    /// the same engine, the second would find the first's cached (the command line seeds
    /// from the clock).
    pub seed: u64,
    /// Most wall time one request may take.
    pub request_timeout: Duration,
    /// Most wall time to wait for each engine's `GET /health`.
    pub connect_timeout: Duration,
}

impl ProfileOptions {
    /// Options with the defaults of `kvc-replay profile` for the engine at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        let facts = Profile::default();
        ProfileOptions {
            url: url.into(),
            metrics_url: None,
            pair: None,
            model: None,
            facts,
            facts_origin: "the embedded default profile".into(),
            peak_flops: None,
            mem_bandwidth: None,
            chunk_tokens: None,
            max_context: DEFAULT_MAX_CONTEXT,
            repeats: DEFAULT_REPEATS,
            decode_tokens: DEFAULT_DECODE_TOKENS,
            name: None,
            seed: 0,
            request_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(30),
        }
    }
}

/// The longest context a sweep sends by default, in tokens.
pub const DEFAULT_MAX_CONTEXT: u64 = 8192;

/// How many times each point is measured by default.
pub const DEFAULT_REPEATS: usize = 2;

/// Tokens each decode stream generates by default.
pub const DEFAULT_DECODE_TOKENS: u64 = 32;
