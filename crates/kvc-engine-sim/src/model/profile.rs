//! Engine profiles: model and hardware facts plus fitted efficiency factors, and the
//! first-order timing model built from them.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// The default profile (Qwen3-30B-A3B on H100 SXM), embedded from `profiles/`.
pub const DEFAULT_PROFILE_TOML: &str = include_str!("../../../../profiles/qwen3-30b-a3b-h100.toml");

/// An engine profile (`profiles/*.toml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Profile name, echoed in run configs.
    pub name: String,
    /// Model facts.
    pub model: ModelFacts,
    /// Hardware facts.
    pub hardware: HardwareFacts,
    /// Fitted factors.
    pub fit: FitFactors,
}

/// Model architecture facts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFacts {
    /// Transformer layers.
    pub layers: u32,
    /// Query heads.
    pub q_heads: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Parameters outside the experts.
    pub dense_params: f64,
    /// Parameters of all experts together (0 for a dense model).
    pub expert_params: f64,
    /// Experts per MoE layer (1 for a dense model).
    pub experts: u32,
    /// Experts active per token.
    pub active_experts: u32,
    /// Bytes per parameter (and per KV element).
    pub bytes_per_param: u32,
    /// Longest accepted input, in tokens.
    pub max_input_tokens: u64,
}

/// Hardware facts of one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareFacts {
    /// Dense peak FLOP/s at the model's precision.
    pub peak_flops: f64,
    /// Memory bandwidth in bytes/s.
    pub hbm_bytes_per_s: f64,
    /// KV pool per worker, in tokens.
    pub kv_pool_tokens: u64,
}

/// Factors fitted to the calibration targets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FitFactors {
    /// Fraction of peak FLOP/s reached by prefill (with `attention_efficiency` set: by its
    /// linear work, the matmuls over the model's parameters).
    pub prefill_efficiency: f64,
    /// Fraction of peak FLOP/s reached by prefill attention (the FLOPs that grow with the
    /// context). Absent, attention runs at `prefill_efficiency`: one efficiency for all
    /// prefill FLOPs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_efficiency: Option<f64>,
    /// Fixed cost of a prefill batch, ms.
    pub prefill_overhead_ms: f64,
    /// Fraction of memory bandwidth reached by a decode step.
    pub decode_efficiency: f64,
    /// Fixed cost of a decode step, ms.
    pub decode_overhead_ms: f64,
    /// Chunked-prefill budget per iteration, tokens.
    pub chunk_tokens: u64,
    /// Whether an iteration carries prefill chunks and the decode step together; if not, a
    /// waiting prefill runs alone first (prefill priority).
    #[serde(default)]
    pub mixed_batches: bool,
    /// P→D KV transfer bandwidth, bytes/s.
    pub transfer_bytes_per_s: f64,
    /// Fixed cost of one transfer, ms.
    pub transfer_setup_ms: f64,
    /// A transfer waiting longer than this for room on D fails, s.
    pub transfer_timeout_s: f64,
    /// Fixed cost of taking a request in, ms: the engine's front end turning a chat request
    /// into token ids (its chat template and tokenizer, vLLM's API server) before the
    /// scheduler sees it. It runs beside the engine's steps (another process), so it delays
    /// its own request and holds up no other. Absent (0): a request reaches the scheduler
    /// when it is sent. The profiler measures it as a text prompt's time less a token-id
    /// prompt's, both of the same length and fully cached.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub intake_ms: f64,
    /// The part of the intake that grows with the prompt, ms per 1,000 prompt tokens
    /// (tokenizing the text; cached tokens are tokenized too).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub intake_ms_per_1k_tokens: f64,
    /// Failure paths of the decode engine under memory pressure (defaults: SGLang's).
    #[serde(default)]
    pub pressure: PressureFacts,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// How a decode worker behaves when its KV pool runs out (`[fit.pressure]`). None of it acts
/// while the pool has room: a request is admitted with room for its whole output when there
/// is some, and nothing is ever retracted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PressureFacts {
    /// Free room (tokens) a decode worker keeps for every active request when it admits an
    /// incoming transfer or a retracted request (for an append: for that request alone); the
    /// requests already active count for the worker's token ratio of it. A budget, not an
    /// allocation: output KV is allocated token by token as decoding goes on
    /// (SGLang's `num_reserved_decode_tokens`, 512).
    pub decode_reserve_tokens: u64,
    /// A running request that cannot get its next step of room, with nothing evictable under
    /// the eviction mode, is retracted (its KV freed; it waits on the same worker and
    /// recomputes its context when room returns). The retraction after this many fails it
    /// with `decode-oom`. This is the rule of workers that can prefill (colocated workers,
    /// and workers that serve turns alone); a decode-only worker backs up instead
    /// (`retraction_host_pool_tokens`).
    pub max_retractions: u32,
    /// Host memory (tokens of KV) a decode-only worker has for the KV of requests it retracts.
    /// Such a worker cannot recompute a request's context (it has no prefill path of its own):
    /// it copies the KV to this pool, loads it back when room returns, and while any retracted
    /// request waits it preallocates room for no new transfer (SGLang's disaggregated decode
    /// server). A retraction the pool has no room for fails the request with `decode-oom` at
    /// once. 0 (the default for profiles without the key): no host pool, every retraction on a
    /// decode-only worker fails its request.
    pub retraction_host_pool_tokens: u64,
    /// A session with a request in flight (on P, in D's transfer queue, on D) is not idle: its
    /// KV on its decode worker cannot be evicted by idle-only eviction (the reference engine
    /// pins a session when its request is routed).
    pub pin_in_flight: bool,
    /// Share of `decode_reserve_tokens` a decode worker counts for each request already active
    /// on it when it admits another, right after a retraction (SGLang's `new_token_ratio`
    /// starts here, 0.7): admission bets that running requests will not all use their budget.
    /// The admitted request keeps its whole reserve. 1 with `min_new_token_ratio` 1 is the
    /// fixed reserve.
    pub init_new_token_ratio: f64,
    /// The floor the ratio decays to while nothing is retracted (SGLang: 0.14 × the initial
    /// ratio). The lower, the more a full worker admits past what its running requests will
    /// write, and the more it retracts later.
    pub min_new_token_ratio: f64,
    /// Decode steps of a worker over which its ratio decays from the initial value to the
    /// floor (SGLang: 600); a retraction on the worker sets it back to the initial value.
    pub new_token_ratio_decay_steps: u32,
    /// The transfer timeout runs from the moment a P→D request is sent until its KV has
    /// arrived on D (SGLang's decode worker aborts a request whose KV has not come in time,
    /// wherever it is held up: D's prealloc queue, P's queue or prefill, P's sender), not
    /// only while it waits for room on D.
    pub timeout_until_arrival: bool,
    /// A P whose send to a D failed (with `timeout_until_arrival`, D gave up on a request P
    /// was prefilling or sending, and P's send went to a room D no longer holds) marks its
    /// transfer session to that D dead, and every transfer from that P to that D
    /// fails as soon as its KV is ready to ship (SGLang's Mooncake sender marks a session
    /// failed at its first failed send), for this many seconds, until the decode worker is
    /// registered again. 0 turns the mechanism off.
    pub failed_pair_recovery_s: f64,
}

impl Default for PressureFacts {
    fn default() -> Self {
        PressureFacts {
            decode_reserve_tokens: 512,
            max_retractions: 3,
            retraction_host_pool_tokens: 0,
            pin_in_flight: true,
            init_new_token_ratio: 0.7,
            min_new_token_ratio: 0.098,
            new_token_ratio_decay_steps: 600,
            timeout_until_arrival: false,
            failed_pair_recovery_s: 0.0,
        }
    }
}

/// Prefill FLOPs by the rate they run at.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillFlops {
    /// The matmuls over the model's parameters: `2 × active params × new`.
    pub linear: f64,
    /// Attention: `4 × layers × q_heads × head_dim × new × (cached + new / 2)`.
    pub attention: f64,
}

/// A profile that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The file could not be read.
    #[error("cannot read profile {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not a valid profile.
    #[error("invalid profile {path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

impl Default for Profile {
    fn default() -> Self {
        Profile::parse(DEFAULT_PROFILE_TOML, "<embedded default>")
            .expect("the embedded default profile is valid")
    }
}

impl Profile {
    /// Reads a profile file.
    pub fn load(path: &Path) -> Result<Self, ProfileError> {
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses profile TOML; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ProfileError> {
        let p: Profile = toml::from_str(text).map_err(|e| ProfileError::Invalid {
            path: origin.to_owned(),
            message: e.to_string(),
        })?;
        p.validate().map_err(|message| ProfileError::Invalid {
            path: origin.to_owned(),
            message,
        })?;
        Ok(p)
    }

    fn validate(&self) -> Result<(), String> {
        let m = &self.model;
        let h = &self.hardware;
        let f = &self.fit;
        let positive = [
            ("model.layers", f64::from(m.layers)),
            ("model.q_heads", f64::from(m.q_heads)),
            ("model.kv_heads", f64::from(m.kv_heads)),
            ("model.head_dim", f64::from(m.head_dim)),
            ("model.experts", f64::from(m.experts)),
            ("model.bytes_per_param", f64::from(m.bytes_per_param)),
            ("model.max_input_tokens", m.max_input_tokens as f64),
            ("hardware.peak_flops", h.peak_flops),
            ("hardware.hbm_bytes_per_s", h.hbm_bytes_per_s),
            ("hardware.kv_pool_tokens", h.kv_pool_tokens as f64),
            ("fit.prefill_efficiency", f.prefill_efficiency),
            ("fit.decode_efficiency", f.decode_efficiency),
            ("fit.chunk_tokens", f.chunk_tokens as f64),
            ("fit.transfer_bytes_per_s", f.transfer_bytes_per_s),
            ("fit.transfer_timeout_s", f.transfer_timeout_s),
            (
                "fit.pressure.decode_reserve_tokens",
                f.pressure.decode_reserve_tokens as f64,
            ),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be a positive number (got {v})"));
            }
        }
        let blocks = m.max_input_tokens.div_ceil(512) * 512;
        if h.kv_pool_tokens < blocks {
            return Err(format!(
                "hardware.kv_pool_tokens ({}) must hold the longest accepted input in 512-token \
                 blocks ({blocks} tokens for model.max_input_tokens = {})",
                h.kv_pool_tokens, m.max_input_tokens
            ));
        }
        if m.active_experts > m.experts {
            return Err("model.active_experts must not exceed model.experts".into());
        }
        if let Some(v) = f.attention_efficiency
            && !(v.is_finite() && v > 0.0)
        {
            return Err(format!(
                "fit.attention_efficiency must be a positive number (got {v})"
            ));
        }
        for (name, v) in [
            ("fit.prefill_efficiency", f.prefill_efficiency),
            ("fit.decode_efficiency", f.decode_efficiency),
        ]
        .into_iter()
        .chain(
            f.attention_efficiency
                .map(|v| ("fit.attention_efficiency", v)),
        ) {
            if v > 1.0 {
                return Err(format!("{name} is a fraction of peak: at most 1 (got {v})"));
            }
        }
        for (name, v) in [
            ("model.dense_params", m.dense_params),
            ("model.expert_params", m.expert_params),
            ("fit.prefill_overhead_ms", f.prefill_overhead_ms),
            ("fit.decode_overhead_ms", f.decode_overhead_ms),
            ("fit.transfer_setup_ms", f.transfer_setup_ms),
            ("fit.intake_ms", f.intake_ms),
            ("fit.intake_ms_per_1k_tokens", f.intake_ms_per_1k_tokens),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be ≥ 0 (got {v})"));
            }
        }
        let pr = &f.pressure;
        if !(pr.min_new_token_ratio > 0.0
            && pr.min_new_token_ratio <= pr.init_new_token_ratio
            && pr.init_new_token_ratio <= 1.0)
        {
            return Err(format!(
                "fit.pressure needs 0 < min_new_token_ratio ({}) ≤ init_new_token_ratio ({}) ≤ 1",
                pr.min_new_token_ratio, pr.init_new_token_ratio
            ));
        }
        if pr.new_token_ratio_decay_steps == 0 {
            return Err("fit.pressure.new_token_ratio_decay_steps must be at least 1".into());
        }
        if !(pr.failed_pair_recovery_s.is_finite() && pr.failed_pair_recovery_s >= 0.0) {
            return Err(format!(
                "fit.pressure.failed_pair_recovery_s must be ≥ 0 (got {})",
                pr.failed_pair_recovery_s
            ));
        }
        Ok(())
    }

    /// KV bytes per token: 2 (K and V) × layers × KV heads × head dim × bytes.
    pub fn kv_bytes_per_token(&self) -> f64 {
        let m = &self.model;
        2.0 * f64::from(m.layers)
            * f64::from(m.kv_heads)
            * f64::from(m.head_dim)
            * f64::from(m.bytes_per_param)
    }

    /// Parameters active per token.
    pub fn active_params(&self) -> f64 {
        let m = &self.model;
        m.dense_params + m.expert_params * f64::from(m.active_experts) / f64::from(m.experts)
    }

    /// FLOPs of prefilling the given pieces, each `(new, cached)` tokens: linear
    /// `2 × active params × new` and attention `4 × layers × q_heads × head_dim × new ×
    /// (cached + new / 2)`.
    pub fn prefill_flops(&self, pieces: impl IntoIterator<Item = (u64, u64)>) -> PrefillFlops {
        self.prefill_work(pieces).1
    }

    /// All prefill FLOPs of the pieces summed piece by piece, and split by kind.
    fn prefill_work(&self, pieces: impl IntoIterator<Item = (u64, u64)>) -> (f64, PrefillFlops) {
        let m = &self.model;
        let attn_coeff = 4.0 * f64::from(m.layers) * f64::from(m.q_heads) * f64::from(m.head_dim);
        let linear_coeff = 2.0 * self.active_params();
        let mut flops = 0.0;
        let mut split = PrefillFlops::default();
        for (new, cached) in pieces {
            let n = new as f64;
            let linear = linear_coeff * n;
            let attention = attn_coeff * n * (cached as f64 + n / 2.0);
            flops += linear + attention;
            split.linear += linear;
            split.attention += attention;
        }
        (flops, split)
    }

    /// Seconds to prefill the given pieces in one batch; each piece is `(new, cached)` tokens.
    ///
    /// FLOPs as [`Profile::prefill_flops`]; time = linear FLOPs / (`prefill_efficiency` ×
    /// peak) plus attention FLOPs / (`attention_efficiency` × peak) plus overhead, attention
    /// at `prefill_efficiency` when no `attention_efficiency` is set.
    pub fn prefill_seconds(&self, pieces: impl IntoIterator<Item = (u64, u64)>) -> f64 {
        let (flops, split) = self.prefill_work(pieces);
        let peak = self.hardware.peak_flops;
        let compute = match self.fit.attention_efficiency {
            None => flops / (self.fit.prefill_efficiency * peak),
            Some(attention) => {
                split.linear / (self.fit.prefill_efficiency * peak)
                    + split.attention / (attention * peak)
            }
        };
        compute + self.fit.prefill_overhead_ms / 1e3
    }

    /// Seconds of one decode step for `batch` sequences holding `context_tokens` in total.
    ///
    /// Bytes: dense weights + the experts the batch activates (each of `experts` is touched with
    /// probability `1 − (1 − active/experts)^batch`) + the KV of every context; time = bytes /
    /// (efficiency × bandwidth) + overhead.
    pub fn decode_step_seconds(&self, batch: usize, context_tokens: u64) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        let m = &self.model;
        let miss = 1.0 - f64::from(m.active_experts) / f64::from(m.experts);
        let touched = 1.0 - miss.powi(batch.min(i32::MAX as usize) as i32);
        let weight_bytes =
            (m.dense_params + m.expert_params * touched) * f64::from(m.bytes_per_param);
        let kv_bytes = context_tokens as f64 * self.kv_bytes_per_token();
        (weight_bytes + kv_bytes) / (self.fit.decode_efficiency * self.hardware.hbm_bytes_per_s)
            + self.fit.decode_overhead_ms / 1e3
    }

    /// Seconds from sending a request of `prompt_tokens` tokens to its reaching the
    /// scheduler: `intake_ms + intake_ms_per_1k_tokens × prompt_tokens / 1000`.
    pub fn intake_seconds(&self, prompt_tokens: u64) -> f64 {
        (self.fit.intake_ms + self.fit.intake_ms_per_1k_tokens * prompt_tokens as f64 / 1e3) / 1e3
    }

    /// Seconds to ship the KV of `tokens` tokens from P to D.
    pub fn transfer_seconds(&self, tokens: u64) -> f64 {
        tokens as f64 * self.kv_bytes_per_token() / self.fit.transfer_bytes_per_s
            + self.fit.transfer_setup_ms / 1e3
    }
}
