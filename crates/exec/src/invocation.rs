//! The description of one tool call: what to run, with what input and limits

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use toolsrv_confine::CallJail;

/// The shell used for [`Program::Shell`]
pub const SHELL: &str = "/bin/sh";
/// How long a tool may ignore SIGTERM before it gets SIGKILL, unless set otherwise
pub const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(2);
/// The timeout [`Invocation::new`] starts with
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// The output cap [`Invocation::new`] starts with (1 MiB)
pub const DEFAULT_OUTPUT_CAP: u64 = 1 << 20;
/// The result cap [`Invocation::new`] starts with (1 MiB)
pub const DEFAULT_RESULT_CAP: u64 = 1 << 20;

/// What to run
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Program {
    /// Run this executable with no arguments
    Exec(PathBuf),
    /// Run `/bin/sh -c <script>`
    Shell(String),
}

impl Program {
    /// The executable that will actually be started
    pub(crate) fn executable(&self) -> String {
        match self {
            Program::Exec(path) => path.display().to_string(),
            Program::Shell(_) => SHELL.to_owned(),
        }
    }
}

/// One tool call
#[derive(Clone)]
pub struct Invocation {
    /// What to run
    pub program: Program,
    /// Written to the child's stdin, which is then closed; a child that never
    /// reads it is fine
    pub stdin: Vec<u8>,
    /// The child's working directory
    pub cwd: PathBuf,
    /// The complete environment: nothing is inherited from this process
    pub env: Vec<(OsString, OsString)>,
    /// How long the call may take, output delivery included
    pub timeout: Duration,
    /// The most stdout+stderr bytes (combined) delivered to the caller
    pub output_cap: u64,
    /// The most bytes of each stream kept for the final result; the streamed output is not
    /// bounded by this, only the copy held in memory for [`crate::Outcome::result`]
    pub result_cap: u64,
    /// After SIGTERM on timeout or cancellation, how long to wait before SIGKILL
    pub kill_grace: Duration,
    /// The call's confinement: the process confines itself with it before the program runs,
    /// every process of the call is ended through it, and it is released when the call ends.
    /// `None`: an unconfined process group.
    pub jail: Option<Arc<CallJail>>,
}

impl Invocation {
    /// A call with empty stdin and environment and the default limits
    pub fn new(program: Program, cwd: impl Into<PathBuf>) -> Self {
        Self {
            program,
            stdin: Vec::new(),
            cwd: cwd.into(),
            env: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            output_cap: DEFAULT_OUTPUT_CAP,
            result_cap: DEFAULT_RESULT_CAP,
            kill_grace: DEFAULT_KILL_GRACE,
            jail: None,
        }
    }
}

// Hand-written so that logging an invocation neither dumps megabytes of stdin
// nor leaks secrets passed in environment values.
impl fmt::Debug for Invocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let env_names: Vec<_> = self.env.iter().map(|(name, _)| name).collect();
        f.debug_struct("Invocation")
            .field("program", &self.program)
            .field("stdin_len", &self.stdin.len())
            .field("cwd", &self.cwd)
            .field("env_names", &env_names)
            .field("timeout", &self.timeout)
            .field("output_cap", &self.output_cap)
            .field("result_cap", &self.result_cap)
            .field("kill_grace", &self.kill_grace)
            .field("confined", &self.jail.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_stdin_and_env_values() {
        let mut inv = Invocation::new(Program::Shell("true".into()), "/");
        inv.stdin = vec![b'x'; 10];
        inv.env = vec![("TOKEN".into(), "s3cret".into())];
        let text = format!("{inv:?}");
        assert!(text.contains("stdin_len: 10"), "{text}");
        assert!(text.contains("TOKEN"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
    }

    #[test]
    fn executable_names_what_is_started() {
        assert_eq!(Program::Exec("/x/y".into()).executable(), "/x/y");
        assert_eq!(Program::Shell("echo hi".into()).executable(), SHELL);
    }
}
