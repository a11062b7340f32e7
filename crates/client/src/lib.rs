//! The toolsrv client library: list hosts and tools, and call tools through a coordinator over mutual TLS.
//!
//! ```no_run
//! # async fn demo(tls: toolsrv_client::TlsFiles) -> Result<(), toolsrv_client::ClientError> {
//! use toolsrv_client::{CallRequest, Client, ConnectOptions};
//! toolsrv_tls::install_crypto_provider();
//! let client = Client::connect(&ConnectOptions { addr: "https://127.0.0.1:7443".into(), tls }).await?;
//! let outcome = client
//!     .call_to_end(CallRequest { host: "web-1".into(), tool: "env_info".into(), ..Default::default() })
//!     .await?;
//! println!("{}", toolsrv_client::status_name(outcome.result.status));
//! # Ok(())
//! # }
//! ```

#[cfg(feature = "cli")]
pub mod cli;
mod client;
pub mod control;
mod enroll;
mod error;
mod revocation;
mod session;
mod shape;
mod status;

pub use client::{
    CallOutcome, CallStream, Client, ConnectOptions, Described, FanOutStream, HostEvent,
    MAX_MESSAGE_SIZE, WatchStream,
};
pub use error::ClientError;
pub use session::{Profile, SessionWatch};
pub use shape::{definition_json, host_state_name, list_entry, match_json, session_json};
pub use status::{is_ok, status_name};

pub use toolsrv_proto::v1::call_event::Event as CallUpdate;
pub use toolsrv_proto::v1::fan_out_event::Event as FanOutUpdate;
pub use toolsrv_proto::v1::{
    ApprovalRequest, CallEvent, CallRequest, CallResult, CallStatus, CallerPolicy, CatalogEvent,
    CatalogEventKind, FanOutEvent, FanOutRequest, FanOutSummary, FindToolsResponse, HostFacts,
    HostInfo, HostState, InvalidTool, ListToolsResponse, LoadedTool, OutputChunk, OutputStream,
    PolicyEffect, Revocation, RevokeResponse, SandboxFacts, SessionHost, SessionState,
    ToolDefinition, ToolMatch, ToolResolution, ToolStatus, WaitsForApproval,
};
pub use toolsrv_tls::{TlsError, TlsFiles};
