//! # kvc-proto — the `kvc.v1` gRPC API of kvc
//!
//! The wire edge shared by everything that speaks kvc over gRPC: the router serves
//! `kvc.v1.Router` and calls `kvc.v1.Worker`; the live replay calls `kvc.v1.Router` and serves
//! `kvc.v1.Worker` for its simulated workers. The `.proto` files sit beside this crate in
//! `proto/kvc/v1/`; the code is generated from them at build time with the `protoc` vendored by
//! `protoc-bin-vendored` (no system `protoc`).
//!
//! - [`pb`]: the generated messages, clients (`pb::router_client::RouterClient`,
//!   `pb::worker_client::WorkerClient`) and servers, and [`pb::FILE_DESCRIPTOR_SET`] for gRPC
//!   reflection.
//! - [`convert`]: the proto enums and messages to and from `kvc-core`, `kvc-policy` and
//!   `kvc-admission` types. Every enum maps one to one onto a stable name of `kvc-core`
//!   ([`convert::ProtoEnum`]); a value of 0 (`..._UNSPECIFIED`) or an unknown number is an
//!   error, never a default.
//! - [`worker`]: `kvc.v1.Worker` on both sides — [`worker::LocalWorker`] serves it for a worker
//!   in this process (its snapshot reader and commit queue; [`worker::serve_worker`] binds it),
//!   [`worker::WorkerClient`] calls it and answers in `kvc-core` types.
//!
//! Code above this crate converts at its edge and works in `kvc-core` types below it: a
//! protobuf type never reaches a routing decision.
//!
//! ```
//! use kvc_core::{ExecutionMode, WorkerState};
//! use kvc_proto::convert::ProtoEnum;
//! use kvc_proto::pb;
//!
//! let wire = ExecutionMode::DirectToD.to_proto();
//! assert_eq!(wire, pb::ExecutionMode::DirectToD as i32);
//! assert_eq!(ExecutionMode::from_proto(wire).unwrap(), ExecutionMode::DirectToD);
//! assert!(ExecutionMode::from_proto(0).is_err());
//!
//! let state = WorkerState::empty(92_000);
//! let back = WorkerState::try_from(pb::WorkerState::from(state)).unwrap();
//! assert_eq!(back, state);
//! ```
#![forbid(unsafe_code)]

pub mod convert;
pub mod worker;

pub use convert::{InvalidEnum, ProtoEnum};

/// Generated code for the `kvc.v1` protobuf package.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("kvc.v1");

    /// The encoded file descriptor set of `kvc.v1`, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("kvc_v1_descriptor");
}
