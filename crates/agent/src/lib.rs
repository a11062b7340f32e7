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
mod bypass;
mod calls;
mod config;
pub mod enroll;
mod error;
mod facts;
mod keeper;
mod metrics;
mod outcome;
mod path_reach;
mod received;
mod reconnect;
pub(crate) mod run;
mod sandbox;
mod session;
mod store;
mod view;

// The public surface: what `toolsrv agent` and `toolsrv up` run (`run`, `AgentConfig`), and the
// seams the tests drive without a coordinator (the reconnect loop's connector, the catalog
// store and keeper, the blob source). Everything else stays inside the crate.
pub use backoff::Backoff;
pub use blobs::{BlobCache, BlobSource, BlobStream, SETTLE};
pub use config::AgentConfig;
pub use error::AgentError;
pub use keeper::CatalogKeeper;
pub use metrics::AgentMetrics;
pub use path_reach::{path_dirs, shim_roots};
pub use run::{check_identity, run, run_with_connector};
pub use store::CatalogStore;
pub use toolsrv_registry::definition;
