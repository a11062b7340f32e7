//! The error returned when a tool call cannot be started

use std::io;
use std::path::PathBuf;

/// Why a tool call could not be started
///
/// Once a call has started, everything that happens to it (non-zero exit,
/// signal, timeout, cancellation) is reported in its [`crate::Outcome`], not here.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// The operating system refused to start the program
    #[error("cannot start {program}: {reason}")]
    Spawn {
        /// The executable that was to be run
        program: String,
        /// The OS error in words, e.g. "permission denied"
        reason: String,
        /// The underlying error
        #[source]
        source: io::Error,
    },
    /// The working directory is missing or is not a directory
    #[error("cannot use working directory {}: {reason}", path.display())]
    Cwd {
        /// The directory that was asked for
        path: PathBuf,
        /// What is wrong with it, e.g. "no such file or directory"
        reason: String,
    },
    /// `spawn` was called outside a tokio runtime
    #[error("cannot run {program} outside a tokio runtime: call spawn from within one")]
    NoRuntime {
        /// The executable that was to be run
        program: String,
    },
    /// The child started but one of its pipes was not set up
    #[error("{program} started without its {pipe} pipe")]
    MissingPipe {
        /// The executable that was run
        program: String,
        /// "stdin", "stdout" or "stderr"
        pipe: &'static str,
    },
    /// The supervising task ended without reporting an outcome (it panicked)
    #[error("the call to {program} ended without reporting an outcome")]
    NoOutcome {
        /// The executable that was run
        program: String,
    },
}

/// The OS error in lower-case words without the "(os error N)" suffix
pub(crate) fn os_reason(err: &io::Error) -> String {
    let text = match err.raw_os_error() {
        Some(code) => nix::errno::Errno::from_raw(code).desc().to_owned(),
        None => err.to_string(),
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_reason_is_lower_case_words() {
        let cases = [
            (libc_code(13), "permission denied"),
            (libc_code(2), "no such file or directory"),
        ];
        for (err, want) in cases {
            assert_eq!(os_reason(&err), want);
        }
        let custom = io::Error::other("Broken thing");
        assert_eq!(os_reason(&custom), "broken thing");
    }

    fn libc_code(code: i32) -> io::Error {
        io::Error::from_raw_os_error(code)
    }
}
