//! `kvc`'s choice of who prefills a turn that is not direct-to-D, on clusters where workers
//! that host sessions can also serve turns alone ([`kvc_core::Capabilities::local`]).
//!
//! For a host `H` (the worker that will keep the session), the paths are:
//!
//! - **local** on `H` (`local-prefill`): `H` prefills what it does not hold of the prompt;
//! - **P→D** from a prefill-capable worker `P ≠ H` to `H`, if `H` decodes transferred KV.
//!
//! Each path gets an expected cost in seconds: the time to first token plus what the prefill
//! costs the decode batch of the worker that runs it.
//!
//! ```text
//! cost(local on H) = backlog(H) + prefill(H) × (1 + interference_weight × decoding(H))
//! cost(P → H)      = backlog(P) + prefill(P) × (1 + interference_weight × decoding(P))
//!                    + transfer(input)
//! prefill(W)       = new / prefill_tokens_per_s + new × (cached + new / 2) / attention_tokens2_per_s
//!                    (new = input − cached, cached = what W holds of the prompt)
//! ```
//!
//! `backlog(W)` is the router's own estimate of the prefill work it sent `W` that has not
//! produced a first token ([`crate::RouterState::prefill_backlog_s`]); `decoding(W)` is the
//! requests in flight on `W` if it hosts sessions, 0 for a worker that only prefills (a
//! prefill there runs alone, as SGLang and vLLM schedule it, so every running sequence waits
//! for it). `cached` on `H` is what the router's live view says `H` holds (the session's own
//! KV, or the prefixes of other sessions resident there); on `P`, its grow-only view.
//!
//! Two rules keep any class of turns from starving:
//!
//! - **prefill headroom**: a turn that has a local path takes a P only while that P's backlog
//!   is at most `p-headroom-s`, so P stays free for the turns that have no other path (hosts
//!   that cannot serve alone, turns re-routed after a refused admission);
//! - **decode protection**: a host whose backlog is above `max-local-backlog-s` takes no local
//!   turns (its decode batch would wait behind them), unless it has no other path at all.
//!
//! A host is also not offered a local turn when its published room (free plus evictable) is
//! short of the turn's footprint. Placement of a session that is not resident adds
//! `−ttft-weight × cost` of the host's cheapest path to the `kvc` score of each host, so
//! queues and prefix reuse decide where new sessions go when they differ by seconds, and
//! `kvc`'s placement terms decide when they do not.

use crate::config::check;
use crate::error::PolicyError;
use serde::{Deserialize, Serialize};

/// Configuration of `kvc`'s local prefill (its `local-prefill` knob).
///
/// | field | default | meaning |
/// |---|---:|---|
/// | `enabled` | `true` | plan `local-prefill` turns on workers that can serve alone |
/// | `prefill-tokens-per-s` | 127,000 | linear prefill rate (2 × active params FLOPs per token) |
/// | `attention-tokens2-per-s` | 1.07e9 | attention rate: `new × (cached + new/2)` per second |
/// | `transfer-tokens-per-s` | 254,000 | P→D KV transfer rate |
/// | `transfer-setup-ms` | 15 | fixed cost of a transfer |
/// | `interference-weight` | 1.0 | cost per second a prefill stalls each decoding request |
/// | `p-headroom-s` | 1.0 | largest P backlog a turn with a local path may join |
/// | `max-local-backlog-s` | 4.0 | largest backlog of a host that takes local turns |
/// | `ttft-weight` | 5.0 | placement points per second of expected path cost |
/// | `active-weight` | 0.25 | replaces `kvc`'s `active-weight` (0.5) where local prefill is planned |
/// | `no-room-s` | 30 | added cost of a path onto a host whose published room is short of the turn's footprint |
///
/// The rates default to the first-order physics of the default engine profile
/// (Qwen3-30B-A3B on an H100: 85% of 989 TFLOP/s, 98,304 bytes of KV per token, 25 GB/s);
/// set them for another model and GPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct LocalPrefillConfig {
    /// Plan `local-prefill` turns where workers can serve alone.
    pub enabled: bool,
    /// Tokens per second of the linear part of a prefill.
    pub prefill_tokens_per_s: f64,
    /// `new × (cached + new / 2)` per second: the attention part of a prefill.
    pub attention_tokens2_per_s: f64,
    /// Tokens of KV shipped per second from P to D.
    pub transfer_tokens_per_s: f64,
    /// Fixed milliseconds per transfer.
    pub transfer_setup_ms: f64,
    /// Seconds of cost per second a prefill holds up each request decoding on its worker.
    pub interference_weight: f64,
    /// A turn that has a local path uses a P only while the P's backlog is at most this.
    pub p_headroom_s: f64,
    /// A host whose backlog is above this takes no local turns while it has another path.
    pub max_local_backlog_s: f64,
    /// Placement points per second of the cheapest path's cost, for sessions being placed.
    pub ttft_weight: f64,
    /// Penalty per session active on a host, in place of `kvc`'s `active-weight` where local
    /// prefill is planned: the path term already charges a host for the requests decoding
    /// there (interference), which is part of what the active-session term stands for.
    pub active_weight: f64,
    /// Seconds added to a path onto a host whose published room (free plus evictable) is
    /// short of the turn's footprint: the turn would wait there for room.
    pub no_room_s: f64,
}

impl Default for LocalPrefillConfig {
    fn default() -> Self {
        Self::ON
    }
}

impl LocalPrefillConfig {
    /// The defaults: local prefill on, with the knobs above.
    pub const ON: LocalPrefillConfig = LocalPrefillConfig {
        enabled: true,
        prefill_tokens_per_s: 127_000.0,
        attention_tokens2_per_s: 1.07e9,
        transfer_tokens_per_s: 254_000.0,
        transfer_setup_ms: 15.0,
        interference_weight: 1.0,
        p_headroom_s: 1.0,
        max_local_backlog_s: 4.0,
        ttft_weight: 5.0,
        active_weight: 0.25,
        no_room_s: 30.0,
    };

    /// Local prefill switched off: `kvc` plans only direct-to-D and P→D paths.
    pub const OFF: LocalPrefillConfig = LocalPrefillConfig {
        enabled: false,
        ..LocalPrefillConfig::ON
    };

    pub(crate) fn validate(&self, policy: &'static str) -> Result<(), PolicyError> {
        check(
            [
                self.prefill_tokens_per_s,
                self.attention_tokens2_per_s,
                self.transfer_tokens_per_s,
            ]
            .iter()
            .all(|r| r.is_finite() && *r > 0.0),
            policy,
            "local-prefill rates must be finite and > 0",
        )?;
        check(
            [
                self.transfer_setup_ms,
                self.interference_weight,
                self.p_headroom_s,
                self.max_local_backlog_s,
                self.ttft_weight,
                self.active_weight,
                self.no_room_s,
            ]
            .iter()
            .all(|w| w.is_finite() && *w >= 0.0),
            policy,
            "local-prefill weights and limits must be finite and >= 0",
        )
    }

    /// Expected seconds to prefill `new` tokens after `cached` ones.
    pub(crate) fn prefill_s(&self, new: u64, cached: u64) -> f64 {
        let (n, c) = (new as f64, cached as f64);
        n / self.prefill_tokens_per_s + n * (c + n / 2.0) / self.attention_tokens2_per_s
    }

    /// Expected seconds to ship the KV of `tokens` tokens.
    pub(crate) fn transfer_s(&self, tokens: u64) -> f64 {
        tokens as f64 / self.transfer_tokens_per_s + self.transfer_setup_ms / 1e3
    }

    /// The cost of a prefill of `prefill_s` seconds on a worker with `backlog_s` ahead of it
    /// and `decoding` requests decoding there.
    pub(crate) fn run_cost(&self, backlog_s: f64, prefill_s: f64, decoding: u32) -> f64 {
        backlog_s + prefill_s * (1.0 + self.interference_weight * f64::from(decoding))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_follow_the_first_order_model() {
        let c = LocalPrefillConfig::default();
        // 10K tokens from scratch: 10,000 / 127,000 + 10,000 × 5,000 / 1.07e9.
        let p = c.prefill_s(10_000, 0);
        assert!((p - (10_000.0 / 127_000.0 + 5e7 / 1.07e9)).abs() < 1e-12);
        // A cached prefix makes the same new tokens dearer (attention), never cheaper.
        assert!(c.prefill_s(2_000, 30_000) > c.prefill_s(2_000, 0));
        assert!((c.transfer_s(254_000) - 1.015).abs() < 1e-9);
        // Interference: each decoding request pays the prefill once more.
        assert!((c.run_cost(0.5, 0.2, 3) - (0.5 + 0.2 * 4.0)).abs() < 1e-12);
        assert!(c.validate("kvc").is_ok());
        let bad = LocalPrefillConfig {
            prefill_tokens_per_s: 0.0,
            ..c
        };
        assert!(bad.validate("kvc").is_err());
        let bad = LocalPrefillConfig {
            p_headroom_s: f64::NAN,
            ..c
        };
        assert!(bad.validate("kvc").is_err());
        assert_eq!(
            LocalPrefillConfig {
                enabled: false,
                ..c
            },
            LocalPrefillConfig::OFF
        );
    }
}
