//! Cluster shapes: `NpMd` (disaggregated) and `Ndp` (colocated).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// The shape of a cluster: `1p3d` is one prefill and three decode workers, `4dp` is four
/// colocated (data-parallel) workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topology {
    /// Prefill/decode disaggregation.
    Disaggregated {
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
}

/// A topology string that is not `NpMd` or `Ndp`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid topology `{0}`: expected NpMd (e.g. 1p3d) or Ndp (e.g. 4dp), counts ≥ 1")]
pub struct TopologyError(pub String);

impl Topology {
    /// Total number of workers.
    pub fn worker_count(self) -> u32 {
        match self {
            Topology::Disaggregated { prefill, decode } => prefill + decode,
            Topology::Colocated { workers } => workers,
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
        let (p, d) = lower.split_once('p').ok_or_else(err)?;
        let d = d.strip_suffix('d').ok_or_else(err)?;
        Ok(Topology::Disaggregated {
            prefill: count(p).ok_or_else(err)?,
            decode: count(d).ok_or_else(err)?,
        })
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Topology::Disaggregated { prefill, decode } => write!(f, "{prefill}p{decode}d"),
            Topology::Colocated { workers } => write!(f, "{workers}dp"),
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
