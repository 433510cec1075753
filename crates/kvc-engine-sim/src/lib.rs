//! # kvc-engine-sim — simulated inference engines
//!
//! Engines to route to without a GPU: the worker model the simulator runs, and workers that
//! serve it on a real clock over SGLang's and vLLM's HTTP APIs, showing their state as a
//! stock engine does.
#![forbid(unsafe_code)]

pub mod cluster;
mod error;
pub mod http;
pub mod model;
pub mod prompt;
pub mod publish;

pub use cluster::ClusterSpec;
pub use error::{WorkerError, check_pacing, check_router_state};
