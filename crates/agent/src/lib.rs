//! The per-host agent: dials the coordinator, keeps the shipped catalog, reports which tools this
//! host can run, runs calls and streams their output back.
//!
//! Architecture invariant: the agent decides what its host offers. Variants are evaluated here,
//! against this host, after every catalog update and every `recheck_every`; the coordinator only
//! relays the views it is sent.
//!
//! Architecture invariant: every `StartCall` gets exactly one `CallFinished` while the link
//! lives; no call outlives its session.

mod backoff;
mod blobs;
mod calls;
mod config;
mod error;
mod facts;
mod keeper;
mod outcome;
mod reconnect;
mod run;
mod session;
mod store;
mod view;

pub use backoff::{Backoff, full_jitter};
pub use blobs::{
    BLOB_MODE, BlobCache, BlobSource, BlobStream, FileStamp, GrpcBlobs, SETTLE, is_sha256_hex,
};
pub use config::{
    AgentConfig, DEFAULT_DRAIN_GRACE, DEFAULT_MAX_CONCURRENT_CALLS, DEFAULT_RECHECK_EVERY,
};
pub use error::AgentError;
pub use facts::{hello, host_facts};
pub use keeper::CatalogKeeper;
pub use outcome::{finished, not_run, refusal_status};
pub use reconnect::{SessionEnd, SessionOutcome, reconnect_loop};
pub use run::{check_identity, connect_tls, run, run_with_connector};
pub use store::{ApplyReport, CatalogStore};
pub use view::{
    VIEW_PART_BYTES, ViewTracker, definition, parts, tool_status, tool_statuses, within_limits,
};
