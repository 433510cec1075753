//! # kvc-router — the kvc routing service
//!
//! This crate serves the `kvc.v1` gRPC API defined in `proto/kvc/v1/router.proto` (compiled at
//! build time with a vendored `protoc`; no system `protoc` is needed).
//!
//! [`pb`] holds the generated messages, clients and servers; [`convert`] maps the proto enums to
//! and from the stable vocabulary of `kvc-core`, so a proto value and a kvc-core name always
//! mean the same thing.
//!
//! ```
//! use kvc_core::ExecutionMode;
//! use kvc_router::{convert::ProtoEnum, pb};
//!
//! let wire = ExecutionMode::DirectToD.to_proto();
//! assert_eq!(wire, pb::ExecutionMode::DirectToD as i32);
//! assert_eq!(ExecutionMode::from_proto(wire).unwrap(), ExecutionMode::DirectToD);
//! ```
#![forbid(unsafe_code)]

pub mod convert;

/// Generated code for the `kvc.v1` protobuf package.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("kvc.v1");

    /// The encoded file descriptor set of `kvc.v1`, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("kvc_v1_descriptor");
}
