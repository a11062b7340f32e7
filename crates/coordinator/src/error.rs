//! Errors of the files a coordinator reads at start (policy, host labels, audit log): which file,
//! and either the I/O error underneath or what is wrong with its content.

use std::path::PathBuf;

/// A configuration file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot {action} {what} {}: {source}", path.display())]
    Io {
        /// What the file is: `policy`, `host labels`, `audit log`.
        what: &'static str,
        /// `read`, `open`, `reopen`.
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {}: {message}", path.display())]
    Invalid {
        what: &'static str,
        path: PathBuf,
        /// What is wrong, naming the rule or entry.
        message: String,
    },
}

impl FileError {
    pub fn read(what: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        Self::Io {
            what,
            action: "read",
            path: path.to_path_buf(),
            source,
        }
    }

    pub fn invalid(what: &'static str, path: &std::path::Path, message: String) -> Self {
        Self::Invalid {
            what,
            path: path.to_path_buf(),
            message,
        }
    }

    /// An error if every user of the machine could rewrite `path` (see
    /// [`toolsrv_registry::writable_by_anyone`]): whoever writes a file that says who may do
    /// what could grant themselves anything.
    pub fn unless_guarded(what: &'static str, path: &std::path::Path) -> Result<(), Self> {
        match toolsrv_registry::writable_by_anyone(path) {
            Some(open) => Err(Self::invalid(
                what,
                path,
                open.explained("anyone here could rewrite who may do what, so it is not used"),
            )),
            None => Ok(()),
        }
    }
}
