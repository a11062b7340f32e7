//! What can go wrong while setting up a test or a bench, and [`must`], which turns it into a
//! test failure.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

/// Why a fixture could not be set up or a wait gave up.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] toolsrv_tls::TlsError),
    /// A certificate could not be signed.
    #[error("cannot sign {stem}: {reason}")]
    Certificate { stem: String, reason: String },
    /// A workspace binary is not built.
    #[error("{} is missing: build the workspace binaries first (cargo build --bins)", path.display())]
    MissingBinary { path: PathBuf },
    /// A workspace binary is older than a source it is built from.
    #[error(
        "{} is older than {}: rebuild the binaries (cargo build --bins), or run the tests with \
         cargo test --workspace, which builds them",
        path.display(),
        newer.display()
    )]
    StaleBinary { path: PathBuf, newer: PathBuf },
    /// A bounded wait ran out.
    #[error("timed out after {limit:?} waiting for {what}")]
    Timeout { what: String, limit: Duration },
    /// A process ended while it was expected to run.
    #[error("{name} exited ({status}):\n{log}")]
    Exited {
        name: String,
        status: ExitStatus,
        log: String,
    },
    /// A command ran but did not do what was asked.
    #[error("{what} failed: {detail}")]
    Failed { what: String, detail: String },
    /// A fake agent's link failed.
    #[error("fake agent {host}: {reason}")]
    Link { host: String, reason: String },
}

impl TestkitError {
    /// An I/O error with what was being done.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn link(host: &str, reason: impl std::fmt::Display) -> Self {
        Self::Link {
            host: host.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// Results of this crate.
pub type Result<T, E = TestkitError> = std::result::Result<T, E>;

/// The value, or a panic with the error: how the panicking wrappers for tests fail.
#[track_caller]
pub fn must<T>(result: Result<T>) -> T {
    match result {
        Ok(value) => value,
        Err(e) => panic!("{e}"),
    }
}
