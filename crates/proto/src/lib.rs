//! Generated code for the toolsrv gRPC protocol (`proto/toolsrv/v1`): the agent link and the client API.

#![allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]

pub mod codec;
pub mod limits;

/// Version 1 of the protocol.
pub mod v1 {
    tonic::include_proto!("toolsrv.v1");
}

/// The encoded file descriptor set, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("toolsrv_descriptor");
