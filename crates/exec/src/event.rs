//! What a running call reports: output chunks, then how it ended

use std::time::Duration;

use bytes::Bytes;
pub use toolsrv_confine::LimitHit;

/// Which pipe a chunk of output came from
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// The tool's standard output
    Stdout,
    /// The tool's standard error
    Stderr,
}

/// One thing that happened to a running call
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A chunk the tool wrote, in order per stream (the two streams interleave freely)
    Output {
        /// Where it was written
        stream: Stream,
        /// The bytes, possibly cut at the output cap
        data: Bytes,
    },
    /// The call is over; always the last event, sent exactly once
    Finished(Outcome),
}

/// How the tool process ended
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this status code
    Code(i32),
    /// It was killed by this signal number
    Signal(i32),
}

/// Why the call ended
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The tool exited on its own
    Exited,
    /// The call ran past its timeout and was killed
    TimedOut,
    /// The call was cancelled (by the token or by dropping the `Execution`) and killed
    Cancelled,
}

/// The summary of a finished call
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// How the tool process ended
    pub exit: Exit,
    /// Why the call ended
    pub ending: Ending,
    /// Wall time from spawn to the end of output
    pub duration: Duration,
    /// Whether the output cap was hit (and later output discarded)
    pub truncated: bool,
    /// Bytes the tool wrote to stdout, including any discarded beyond the cap
    pub stdout_bytes: u64,
    /// Bytes the tool wrote to stderr, including any discarded beyond the cap
    pub stderr_bytes: u64,
    /// The tool result, built by [`crate::tool_result`]
    pub result: serde_json::Value,
    /// Limits of a confined call that it ran into (its memory, its number of processes)
    pub limits_hit: Vec<LimitHit>,
}

impl Outcome {
    /// True when the tool exited on its own with status 0
    pub fn success(&self) -> bool {
        self.ending == Ending::Exited && self.exit == Exit::Code(0)
    }
}
