//! Errors of the files a coordinator reads at start (policy, host labels, audit log): which file,
//! and either the I/O error underneath or what is wrong with its content.

use std::path::{Path, PathBuf};

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
    /// Makes the coordinator's `--state-dir` (0700) if needed, and refuses one another user
    /// could change: owned by them, or under a directory or a link of theirs. Its revocations
    /// and join tokens would be theirs to delete or write.
    pub fn own_state_dir(dir: &Path) -> Result<(), Self> {
        use std::os::unix::fs::DirBuilderExt;
        const WHAT: &str = "state directory";
        toolsrv_tls::files::check_before_creating(dir)
            .map_err(|why| Self::invalid(WHAT, dir, why))?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| match source.kind() {
                // `create` says only "File exists" of a file, a FIFO or a device there.
                std::io::ErrorKind::AlreadyExists => {
                    Self::invalid(WHAT, dir, "exists and is not a directory".into())
                }
                _ => Self::Io {
                    what: WHAT,
                    action: "create",
                    path: dir.to_path_buf(),
                    source,
                },
            })?;
        // Whether others may write it is the state files' own check (each is made anew, and
        // refused when another user could have written it): a volume mounted mode 0777 is
        // used that way.
        toolsrv_tls::files::check_owned_dir(dir).map_err(|why| Self::invalid(WHAT, dir, why))?;
        Ok(())
    }

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

    /// The bytes of a state file the coordinator wrote for itself (`what`: `join token file`,
    /// `revocations file`), `None` when there is none yet. Refused when another user could
    /// have written it: it is owned by someone other than this process's user or root (made
    /// there before the coordinator made it, or put in its place, in a directory others may
    /// write), or every user may write it. Such a file could hold someone's own join token or
    /// lack a revocation; starting without it would lose the real ones, so the role stops.
    pub fn read_own_state(what: &'static str, path: &Path) -> Result<Option<Vec<u8>>, Self> {
        let file = match toolsrv_tls::files::open_read(path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Self::read(what, path, e)),
        };
        let md = file.metadata().map_err(|e| Self::read(what, path, e))?;
        Self::unless_own(
            what,
            path,
            &md,
            "could have written it, so it is not used; if its content is yours",
        )?;
        toolsrv_tls::files::read_up_to(file, toolsrv_tls::files::MAX_SETTINGS_BYTES)
            .map_err(|e| Self::read(what, path, e))?
            .map(Some)
            .ok_or_else(|| {
                Self::invalid(
                    what,
                    path,
                    format!(
                        "larger than {} bytes, the most read of such a file",
                        toolsrv_tls::files::MAX_SETTINGS_BYTES
                    ),
                )
            })
    }

    /// An error if `md` (of `path`, as opened) says another user could have written the file:
    /// it is owned by someone other than this process's user or root, or (a regular file)
    /// every user may write it. `why` says what that other user could have done, and is
    /// followed by the `chown` or `chmod` that makes it the coordinator's own.
    pub fn unless_own(
        what: &'static str,
        path: &Path,
        md: &std::fs::Metadata,
        why: &str,
    ) -> Result<(), Self> {
        use std::os::unix::fs::MetadataExt;
        let uid = nix::unistd::geteuid().as_raw();
        let message = if md.uid() != uid && md.uid() != 0 {
            format!(
                "owned by uid {}, neither this process's user (uid {uid}) nor root: another user \
                 {why}, chown {uid} {}",
                md.uid(),
                path.display()
            )
        } else if md.is_file() && md.mode() & 0o002 != 0 {
            format!(
                "writable by every user of this machine (mode {:04o}): another user {why}, \
                 chmod o-w {}",
                md.mode() & 0o7777,
                path.display()
            )
        } else {
            return Ok(());
        };
        Err(Self::invalid(what, path, message))
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_state_directory_that_is_a_file_or_a_fifo_is_said_to_be_no_directory() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, "x").unwrap();
        let fifo = dir.path().join("fifo");
        toolsrv_testkit::mkfifo(&fifo);
        for path in [file, fifo] {
            let err = FileError::own_state_dir(&path).unwrap_err().to_string();
            assert!(
                err.contains("exists and is not a directory"),
                "{}: {err}",
                path.display()
            );
        }
    }
}
