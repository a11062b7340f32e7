//! Exit codes of `toolctl` for failures that happen before or around a tool, kept stable for scripts.
//!
//! A tool that ran exits `toolctl` with its own code; one killed by signal N exits with 128+N.
//! Remote commands use the same codes for the same outcomes (`call` maps each call status onto
//! them), plus [`UNAVAILABLE`], [`DENIED`] and [`CONFIG`] for what only a network can cause.

/// Bad command line, or arguments that are not a JSON object.
pub const USAGE: u8 = 64;
/// The arguments break the tool's `args` schema.
pub const INVALID_ARGS: u8 = 65;
/// The tool exists but is hidden on this host (no variant matches, or its files are invalid).
pub const HIDDEN: u8 = 69;
/// Internal failure, such as a runtime that would not start.
pub const INTERNAL: u8 = 70;
/// The tool could not be started (permission denied, bad working directory, ...).
pub const CANNOT_START: u8 = 126;
/// Unknown tool, or no command resolves for it.
pub const NOT_FOUND: u8 = 127;
/// The call timed out (as `timeout(1)` does).
pub const TIMED_OUT: u8 = 124;
/// The call was cancelled (interrupt): 128 + SIGINT.
pub const CANCELLED: u8 = 130;
/// `find` and `local find`: no tool matched the request (as `grep` exits when nothing matches).
pub const NO_MATCH: u8 = 1;
/// `lint` found at least one error.
pub const LINT_ERRORS: u8 = 1;
/// `fanout`: not every targeted host ended OK, or the selector picked no host.
pub const FANOUT_FAILED: u8 = 1;
/// The coordinator cannot be reached, the host is offline or was lost mid-call, or a per-client
/// quota is full (EX_TEMPFAIL: retry later).
pub const UNAVAILABLE: u8 = 75;
/// The coordinator refused us: the policy denies the call, or our certificate is not accepted (EX_NOPERM).
pub const DENIED: u8 = 77;
/// Our TLS files are missing or unusable, `master` cannot serve on its control socket, or the
/// `local find --model` directory is unusable (EX_CONFIG).
pub const CONFIG: u8 = 78;
