//! The worker model: prefill, decode and colocated workers with KV pools, prefix caches,
//! resident sessions, continuous batching, append-prefill and KV transfers.

mod cache;
pub mod engine;
pub mod profile;

pub use engine::{
    DirectAdmission, Engine, EngineOptions, Event, Job, LocalAdmission, Micros, Wake, micros,
};
pub use profile::Profile;
