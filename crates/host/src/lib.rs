//! One host's side of the contract: which tools it offers from a catalog, and how a call becomes a process.
//!
//! Used by `toolctl local` (this machine, no network) and by the agent (every fleet host).

mod call;
mod view;

pub use call::{AGENT_OUTPUT_CAP, CallError, CallRequest, Limits, prepare, start, unknown};
pub use toolsrv_exec::close_inherited_on_exec;
pub use view::{ListEntry, ToolView, view};
