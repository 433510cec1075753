//! Cluster shapes: `NpMd` (disaggregated), `NpMd-hybrid` (disaggregated, prefill workers may
//! host sessions), `Ndp` (colocated) and `Nx` (all-capable), and the workers each one lays out.

use crate::names::WorkerRole;
use crate::worker::Capabilities;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// The shape of a cluster: `1p3d` is one prefill and three decode workers, `1p3d-hybrid` the
/// same workers with prefill workers that may also host sessions, `4dp` is four colocated
/// (data-parallel) workers, `4x` four workers that can each prefill for the others, decode
/// transferred KV and serve turns alone.
///
/// What a worker can do is declared per worker ([`Capabilities`]); [`Topology::layout`]
/// gives the workers of a shape with the capabilities it declares. Decode workers serve turns
/// alone (local prefill) when their engine can — a vLLM instance can, a stock SGLang decode
/// server cannot — so [`Topology::layout`] takes that as a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topology {
    /// Prefill/decode disaggregation.
    Disaggregated {
        /// Prefill workers (at least one).
        prefill: u32,
        /// Decode workers (at least one).
        decode: u32,
    },
    /// Prefill/decode disaggregation whose prefill workers may also host sessions (serve
    /// turns alone and keep their KV, as a vLLM prefill instance can).
    Hybrid {
        /// Prefill workers (at least one).
        prefill: u32,
        /// Decode workers (at least one).
        decode: u32,
    },
    /// Colocated workers that prefill and decode.
    Colocated {
        /// Workers (at least one).
        workers: u32,
    },
    /// Workers that each prefill for the others, decode transferred KV and serve turns alone:
    /// the policy decides per request which one prefills and which one decodes.
    AllCapable {
        /// Workers (at least two: a P→D path needs a worker to ship KV to another).
        workers: u32,
    },
}

/// A topology string that is not one of the shapes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid topology `{0}`: expected NpMd (e.g. 1p3d), NpMd-hybrid (e.g. 1p3d-hybrid), \
     Ndp (e.g. 4dp) or Nx (e.g. 4x), counts ≥ 1 (≥ 2 for Nx)"
)]
pub struct TopologyError(pub String);

impl Topology {
    /// Total number of workers.
    pub fn worker_count(self) -> u32 {
        match self {
            Topology::Disaggregated { prefill, decode } | Topology::Hybrid { prefill, decode } => {
                prefill + decode
            }
            Topology::Colocated { workers } | Topology::AllCapable { workers } => workers,
        }
    }

    /// Whether every worker is colocated (no P/D paths at all).
    pub fn is_colocated(self) -> bool {
        matches!(self, Topology::Colocated { .. })
    }

    /// The workers of the shape, in worker-id order (prefill workers first), with their roles
    /// and declared capabilities. `local_prefill` says whether the engines are vLLM's, which
    /// serve turns alone and whose decode engines also send a session's KV (NixlConnector
    /// sends whatever the `kv_role`), or stock SGLang's, whose decode servers do neither:
    ///
    /// | shape | prefill workers | decode workers |
    /// |---|---|---|
    /// | `NpMd` | prefill | decode, + local + send-kv if `local_prefill` |
    /// | `NpMd-hybrid` | prefill, + local if `local_prefill` | decode, + local + send-kv if `local_prefill` |
    /// | `Nx` | – | role `decode`: prefill + decode + send-kv, + local if `local_prefill` |
    /// | `Ndp` | – | role `colocated` (serve alone, whatever `local_prefill` says) |
    pub fn layout(self, local_prefill: bool) -> Vec<(WorkerRole, Capabilities)> {
        let with_local = |c: Capabilities| if local_prefill { c.with_local() } else { c };
        let p = Capabilities::of_role(WorkerRole::Prefill);
        let d = Capabilities::of_role(WorkerRole::Decode);
        let d = if local_prefill {
            d.with_local().with_send_kv()
        } else {
            d
        };
        let repeat = |n: u32, role, caps| std::iter::repeat_n((role, caps), n as usize);
        match self {
            Topology::Disaggregated { prefill, decode } => repeat(prefill, WorkerRole::Prefill, p)
                .chain(repeat(decode, WorkerRole::Decode, d))
                .collect(),
            Topology::Hybrid { prefill, decode } => {
                repeat(prefill, WorkerRole::Prefill, with_local(p))
                    .chain(repeat(decode, WorkerRole::Decode, d))
                    .collect()
            }
            Topology::Colocated { workers } => repeat(
                workers,
                WorkerRole::Colocated,
                Capabilities::of_role(WorkerRole::Colocated),
            )
            .collect(),
            Topology::AllCapable { workers } => repeat(
                workers,
                WorkerRole::Decode,
                with_local(Capabilities {
                    prefill: true,
                    decode: true,
                    local: false,
                    send_kv: true,
                }),
            )
            .collect(),
        }
    }
}

fn count(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok().filter(|n| *n >= 1)
}

impl FromStr for Topology {
    type Err = TopologyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || TopologyError(s.to_owned());
        let lower = s.to_ascii_lowercase();
        if let Some(n) = lower.strip_suffix("dp") {
            return Ok(Topology::Colocated {
                workers: count(n).ok_or_else(err)?,
            });
        }
        if let Some(n) = lower.strip_suffix('x') {
            return Ok(Topology::AllCapable {
                workers: count(n).filter(|n| *n >= 2).ok_or_else(err)?,
            });
        }
        let (pd, hybrid) = match lower.strip_suffix("-hybrid") {
            Some(pd) => (pd, true),
            None => (lower.as_str(), false),
        };
        let (p, d) = pd.split_once('p').ok_or_else(err)?;
        let d = d.strip_suffix('d').ok_or_else(err)?;
        let (prefill, decode) = (count(p).ok_or_else(err)?, count(d).ok_or_else(err)?);
        Ok(if hybrid {
            Topology::Hybrid { prefill, decode }
        } else {
            Topology::Disaggregated { prefill, decode }
        })
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Topology::Disaggregated { prefill, decode } => write!(f, "{prefill}p{decode}d"),
            Topology::Hybrid { prefill, decode } => write!(f, "{prefill}p{decode}d-hybrid"),
            Topology::Colocated { workers } => write!(f, "{workers}dp"),
            Topology::AllCapable { workers } => write!(f, "{workers}x"),
        }
    }
}

impl Serialize for Topology {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Topology {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hybrid_and_all_capable_shapes_parse_and_print() {
        for (text, t) in [
            (
                "1p3d-hybrid",
                Topology::Hybrid {
                    prefill: 1,
                    decode: 3,
                },
            ),
            (
                "2P6D-Hybrid",
                Topology::Hybrid {
                    prefill: 2,
                    decode: 6,
                },
            ),
            ("4x", Topology::AllCapable { workers: 4 }),
            ("8X", Topology::AllCapable { workers: 8 }),
        ] {
            assert_eq!(text.parse::<Topology>().unwrap(), t, "{text}");
            assert_eq!(t.to_string(), text.to_ascii_lowercase());
            let json = serde_json::to_string(&t).unwrap();
            assert_eq!(serde_json::from_str::<Topology>(&json).unwrap(), t);
        }
        for bad in [
            "1x",
            "0x",
            "x",
            "1p3d-",
            "1p3dhybrid",
            "4dp-hybrid",
            "-hybrid",
            "4x-hybrid",
        ] {
            assert!(bad.parse::<Topology>().is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn layouts_declare_what_each_worker_can_do() {
        let p = Capabilities::of_role(WorkerRole::Prefill);
        let d = Capabilities::of_role(WorkerRole::Decode);
        let plain: Topology = "1p2d".parse().unwrap();
        assert_eq!(
            plain.layout(false),
            vec![
                (WorkerRole::Prefill, p),
                (WorkerRole::Decode, d),
                (WorkerRole::Decode, d)
            ]
        );
        // vLLM decode workers serve turns alone and send their sessions' KV; the prefill
        // worker of a plain shape does neither.
        let l = plain.layout(true);
        assert_eq!(l[0], (WorkerRole::Prefill, p));
        assert_eq!(l[1], (WorkerRole::Decode, d.with_local().with_send_kv()));
        assert!(!plain.layout(false)[1].1.send_kv);
        let hybrid: Topology = "1p2d-hybrid".parse().unwrap();
        assert_eq!(
            hybrid.layout(true)[0],
            (WorkerRole::Prefill, p.with_local())
        );
        assert_eq!(hybrid.layout(false)[0], (WorkerRole::Prefill, p));
        let all: Topology = "3x".parse().unwrap();
        assert_eq!(
            all.layout(true),
            vec![(WorkerRole::Decode, Capabilities::ALL); 3]
        );
        assert!(
            all.layout(false)
                .iter()
                .all(|(_, c)| c.prefill && c.decode && !c.local)
        );
        let dp: Topology = "2dp".parse().unwrap();
        assert_eq!(dp.layout(false), dp.layout(true));
        assert!(dp.is_colocated() && !all.is_colocated());
        for t in [plain, hybrid, all, dp] {
            assert_eq!(t.layout(true).len() as u32, t.worker_count());
        }
        assert!(p.with_local().hosts_sessions() && d.hosts_sessions() && !p.hosts_sessions());
    }
}
