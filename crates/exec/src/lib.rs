//! Runs one tool call as a child process in its own process group and streams its output live
//!
//! A call is described by an [`Invocation`]: the program, the bytes for its stdin,
//! its working directory and its complete environment, plus a timeout, an output
//! cap and a kill grace period. [`spawn`] starts it and returns an [`Execution`]
//! that yields [`Event::Output`] chunks as the tool writes them, then exactly one
//! [`Event::Finished`] carrying the [`Outcome`].
//!
//! Architecture invariant: nothing a tool starts outlives its call. The tool runs
//! as the leader of a fresh process group; when it exits, times out or is
//! cancelled, the whole group is killed, so background processes a tool leaves
//! behind do not survive the call.
//!
//! Architecture invariant: a slow consumer slows the tool down instead of
//! growing memory. Output goes through a bounded channel and the pipe readers
//! wait for room, so the tool blocks on a full pipe.

mod child;
mod error;
mod event;
mod group;
mod invocation;
mod output;
mod result;
mod run;

pub use error::ExecError;
pub use event::{Ending, Event, Exit, LimitHit, Outcome, Stream};
pub use invocation::{
    DEFAULT_KILL_GRACE, DEFAULT_OUTPUT_CAP, DEFAULT_RESULT_CAP, DEFAULT_TIMEOUT, Invocation,
    Program, SHELL,
};
pub use result::tool_result;
pub use run::{EventStream, Execution, run_to_end, spawn};
/// Marks the descriptors a process inherited close-on-exec, so that none reaches the tools it
/// runs (see [`toolsrv_confine::close_inherited_on_exec`]).
pub use toolsrv_confine::close_inherited_on_exec;
