//! Generated code for the toolsrv gRPC protocol (`proto/toolsrv/v1`): the agent link and the client API.

#![allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]

pub mod codec;
pub mod cost;
pub mod limits;
pub mod outbound;
pub mod received;
mod results;
pub mod text;

pub use results::status_name;

/// Version 1 of the protocol.
pub mod v1 {
    tonic::include_proto!("toolsrv.v1");
}

/// Wall-clock time now, in the Unix milliseconds that every `*_unix_ms` field of the protocol
/// carries (0 for a clock before 1970). For what is shown to people only: durations and
/// liveness are measured on a monotonic clock.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Metadata of a refusal that says when to ask again, in milliseconds: gRPC's own name for a
/// server's pushback. A throttled join or renewal carries it; its message says the same in
/// words.
pub const RETRY_PUSHBACK_METADATA: &str = "grpc-retry-pushback-ms";

/// Marks `status` as asking its caller to wait `wait` before asking again
/// ([`RETRY_PUSHBACK_METADATA`]).
pub fn with_retry_pushback(mut status: tonic::Status, wait: std::time::Duration) -> tonic::Status {
    let millis = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    status
        .metadata_mut()
        .insert(RETRY_PUSHBACK_METADATA, millis.into());
    status
}

/// How long `status` asks its caller to wait before asking again, when it says
/// ([`RETRY_PUSHBACK_METADATA`]); `None` for a status that does not, or whose value is not a
/// number of milliseconds.
pub fn retry_pushback(status: &tonic::Status) -> Option<std::time::Duration> {
    let value = status.metadata().get(RETRY_PUSHBACK_METADATA)?;
    let millis = value.to_str().ok()?.trim().parse::<u64>().ok()?;
    Some(std::time::Duration::from_millis(millis))
}

/// Metadata of a `NOT_FOUND` that is about the session a request named (closed, ended idle,
/// or gone with its coordinator), not about a tool or a host in it (its value is `true`): a
/// client keeping a session for someone opens a new one on it.
pub const SESSION_GONE_METADATA: &str = "toolsrv-session-gone";

/// Marks `status` as saying that the session a request named no longer exists
/// ([`SESSION_GONE_METADATA`]).
pub fn session_gone(mut status: tonic::Status) -> tonic::Status {
    status.metadata_mut().insert(
        SESSION_GONE_METADATA,
        tonic::metadata::MetadataValue::from_static("true"),
    );
    status
}

/// Whether `status` says that the session a request named no longer exists
/// ([`SESSION_GONE_METADATA`]).
pub fn is_session_gone(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::NotFound
        && status
            .metadata()
            .get(SESSION_GONE_METADATA)
            .is_some_and(|v| v == "true")
}

/// Response metadata of `DescribeTool` when the tool described is the host's own, not the
/// catalog's (its value is `true`).
pub const HOST_ONLY_METADATA: &str = "toolsrv-host-only";

/// Response metadata of `DescribeTool`: a `CallerPolicy` (what the policy says of the caller
/// calling the tool on that host), encoded as protobuf (binary metadata, hence the suffix).
pub const CALLER_POLICY_METADATA: &str = "toolsrv-caller-policy-bin";

/// The encoded file descriptor set, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("toolsrv_descriptor");
