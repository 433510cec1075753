//! Policy selection by stable name, with serde configs.

use crate::cache_aware::CacheAwareConfig;
use crate::error::PolicyError;
use crate::kv_aware_v0::KvAwareV0Config;
use crate::kvc::KvcConfig;
use crate::kvc_v2::KvcV2Config;
use crate::round_robin::RoundRobinConfig;
use kvc_core::{BlockSize, PrefillPolicy};
use serde::{Deserialize, Serialize};

/// A routing policy and its configuration.
///
/// Serialized internally tagged by `policy` with the stable name, fields in kebab-case; absent
/// fields take the documented defaults:
///
/// ```
/// use kvc_policy::PolicyConfig;
/// let cfg: PolicyConfig = serde_json::from_str(r#"{"policy": "kvc-v2", "hard-cap": 0.9}"#).unwrap();
/// let PolicyConfig::KvcV2(v2) = &cfg else { unreachable!() };
/// assert_eq!(v2.hard_cap, 0.9);
/// assert_eq!(v2.migrate_after_rejects, 3);
/// assert_eq!(cfg.name(), "kvc-v2");
/// ```
///
/// Adding a policy: one module with its config (`Default`, `validate`) and its `route`, one
/// variant here, one arm in each `match` of this file and of `route.rs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "policy", rename_all = "kebab-case")]
pub enum PolicyConfig {
    /// `round-robin`: P, D and colocated workers in turn; no session notion.
    RoundRobin(RoundRobinConfig),
    /// `cache-aware`: the SGLang router's baseline; no session notion.
    CacheAware(CacheAwareConfig),
    /// `kv-aware-v0`: the reference study's baseline, pinning defect included.
    KvAwareV0(KvAwareV0Config),
    /// `kvc-v2`: the study's fix (capacity term, hard cap, migration).
    KvcV2(KvcV2Config),
    /// `kvc`: the default: `kvc-v2`'s procedure with active-session-aware placement.
    Kvc(KvcConfig),
}

const NAMES: &[&str] = &["round-robin", "cache-aware", "kv-aware-v0", "kvc-v2", "kvc"];

impl Default for PolicyConfig {
    /// `kvc` with its defaults.
    fn default() -> Self {
        PolicyConfig::Kvc(KvcConfig::default())
    }
}

impl PolicyConfig {
    /// The stable name.
    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::RoundRobin(_) => NAMES[0],
            PolicyConfig::CacheAware(_) => NAMES[1],
            PolicyConfig::KvAwareV0(_) => NAMES[2],
            PolicyConfig::KvcV2(_) => NAMES[3],
            PolicyConfig::Kvc(_) => NAMES[4],
        }
    }

    /// The policy with this stable name and its default configuration.
    pub fn from_name(name: &str) -> Result<PolicyConfig, PolicyError> {
        match name {
            "round-robin" => Ok(PolicyConfig::RoundRobin(RoundRobinConfig::default())),
            "cache-aware" => Ok(PolicyConfig::CacheAware(CacheAwareConfig::default())),
            "kv-aware-v0" => Ok(PolicyConfig::KvAwareV0(KvAwareV0Config::default())),
            "kvc-v2" => Ok(PolicyConfig::KvcV2(KvcV2Config::default())),
            "kvc" => Ok(PolicyConfig::Kvc(KvcConfig::default())),
            other => Err(PolicyError::UnknownPolicy(other.to_owned())),
        }
    }

    /// Every stable name, for CLI help.
    pub fn all_names() -> &'static [&'static str] {
        NAMES
    }

    /// Checks every value is in range (done by [`crate::route`] on each call as well).
    pub fn validate(&self) -> Result<(), PolicyError> {
        match self {
            PolicyConfig::RoundRobin(c) => c.validate(),
            PolicyConfig::CacheAware(c) => c.validate(),
            PolicyConfig::KvAwareV0(c) => c.validate(),
            PolicyConfig::KvcV2(c) => c.validate(),
            PolicyConfig::Kvc(c) => c.validate(),
        }
    }

    /// How the policy chooses P; `None` for `cache-aware`, which picks P by its own
    /// cache-aware rule over the prefill workers.
    pub fn prefill_policy(&self) -> Option<PrefillPolicy> {
        match self {
            PolicyConfig::RoundRobin(c) => Some(c.prefill),
            PolicyConfig::CacheAware(_) => None,
            PolicyConfig::KvAwareV0(c) => Some(c.prefill),
            PolicyConfig::KvcV2(c) => Some(c.prefill),
            PolicyConfig::Kvc(c) => Some(c.prefill),
        }
    }

    /// The direct-to-D limit on the uncached append; `None` for policies that never go
    /// direct-to-D.
    pub fn direct_limit_tokens(&self) -> Option<u64> {
        match self {
            PolicyConfig::RoundRobin(_) | PolicyConfig::CacheAware(_) => None,
            PolicyConfig::KvAwareV0(c) => Some(c.direct_limit_tokens),
            PolicyConfig::KvcV2(c) => Some(c.direct_limit_tokens),
            PolicyConfig::Kvc(c) => Some(c.direct_limit_tokens),
        }
    }

    /// Tokens per block the policy assumes for `hash_ids`.
    pub fn block_size(&self) -> BlockSize {
        match self {
            PolicyConfig::RoundRobin(c) => c.block_size,
            PolicyConfig::CacheAware(c) => c.block_size,
            PolicyConfig::KvAwareV0(c) => c.block_size,
            PolicyConfig::KvcV2(c) => c.block_size,
            PolicyConfig::Kvc(c) => c.block_size,
        }
    }
}

pub(crate) fn check(
    ok: bool,
    policy: &'static str,
    detail: &'static str,
) -> Result<(), PolicyError> {
    if ok {
        Ok(())
    } else {
        Err(PolicyError::InvalidConfig { policy, detail })
    }
}

pub(crate) fn check_backpressure(
    bp: &crate::BackpressureConfig,
    policy: &'static str,
) -> Result<(), PolicyError> {
    check(
        bp.used_free.is_finite() && (0.0..=1.0).contains(&bp.used_free),
        policy,
        "backpressure used-free must be within [0, 1]",
    )
}
