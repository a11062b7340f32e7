//! Why confinement could not be set up, for the agent or for one call

use std::path::PathBuf;

/// What went wrong; each names what failed, where, and what to do
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfineError {
    /// `--sandbox enforce` and the host cannot enforce part of it
    #[error(
        "cannot enforce the sandbox on this host: {missing}; use --sandbox best-effort to run with what the host supports, or fix the host"
    )]
    NotEnforceable { missing: String },
    /// The Landlock rule set could not be built
    #[error("cannot build the call's Landlock rules: {0}; check the kernel's Landlock support")]
    Landlock(String),
    /// A file or directory of the sandbox could not be made, read or written
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        /// e.g. "create the call cgroup"
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `--run-as` names a user this host does not have
    #[error("cannot run tools as user `{user}`: {why}; create the user or change --run-as")]
    User { user: String, why: String },
    /// The caller's working directory is among the agent's private files
    #[error(
        "working directory {} is among the agent's private files; choose another directory",
        path.display()
    )]
    HiddenCwd { path: PathBuf },
    /// `--cgroup` names a directory where call cgroups cannot be made
    #[error(
        "cannot make call cgroups under --cgroup {}: {why}; name a cgroup v2 directory delegated to the agent, or leave --cgroup out to use the agent's own cgroup",
        path.display()
    )]
    Cgroup { path: PathBuf, why: String },
}

impl ConfineError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            op,
            path: path.into(),
            source,
        }
    }
}
