//! Where the control socket is when none is named: `$XDG_RUNTIME_DIR/toolctl.sock`, or, without
//! that variable, `toolctl.sock` in a directory of our own under the temporary directory
//! (`/tmp/toolctl-<uid>`), created 0700 and refused when someone else made it first.

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The word that stands for the default socket in `--control` and `TOOLSRV_CONTROL`.
pub const DEFAULT_WORD: &str = "default";

/// File name of the control socket in its directory.
const SOCKET_NAME: &str = "toolctl.sock";

/// The default control socket of this user: `$XDG_RUNTIME_DIR/toolctl.sock` when that variable
/// names an absolute directory (per user and 0700 by its definition), else
/// `<temporary directory>/toolctl-<uid>/toolctl.sock`.
pub fn default_socket() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        Some(dir) if dir.is_absolute() => dir.join(SOCKET_NAME),
        _ => private_dir().join(SOCKET_NAME),
    }
}

/// `<temporary directory>/toolctl-<uid>`: ours alone, or nothing.
fn private_dir() -> PathBuf {
    std::env::temp_dir().join(format!("toolctl-{}", nix::unistd::getuid()))
}

/// Makes sure the directory of the default socket `socket` is ours alone before a master binds
/// there: the per-user directory under the temporary directory is created 0700 when missing, and
/// refused when it is a symbolic link, not a directory, owned by another user, or open to others
/// (anyone can create a name in a shared temporary directory first). Any other path is left as
/// it is: its owner chose it.
pub fn prepare_default_dir(socket: &Path) -> io::Result<()> {
    let dir = private_dir();
    if socket.parent() != Some(dir.as_path()) {
        return Ok(());
    }
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("cannot create {}: {e}", dir.display()),
            ));
        }
    }
    check_private(&dir, nix::unistd::getuid().as_raw())
}

/// `dir` is a real directory (not a link) owned by `uid` with no access for group or others.
fn check_private(dir: &Path, uid: u32) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    let refuse = |why: String| {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{}: {why}, so it is not a private directory for the control socket: remove it, \
                 or give --control (TOOLSRV_CONTROL) a path only you can reach",
                dir.display()
            ),
        ))
    };
    if !meta.file_type().is_dir() {
        return refuse("not a directory (a symbolic link is never followed)".into());
    }
    if meta.uid() != uid {
        return refuse(format!(
            "owned by uid {}, not by us (uid {uid})",
            meta.uid()
        ));
    }
    if meta.mode() & 0o077 != 0 {
        return refuse(format!(
            "mode {:o} lets other users in (it must be 700)",
            meta.mode() & 0o777
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn only_a_directory_of_ours_closed_to_others_is_private() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = nix::unistd::getuid().as_raw();
        let dir = tmp.path().join("d");
        std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        check_private(&dir, uid).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = check_private(&dir, uid).unwrap_err().to_string();
        assert!(e.contains("mode 755"), "{e}");
        let e = check_private(&dir, uid.wrapping_add(1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("owned by uid"), "{e}");
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = check_private(&link, uid).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }

    #[test]
    fn the_default_lives_in_a_per_user_place() {
        let path = default_socket();
        assert!(path.ends_with(SOCKET_NAME), "{}", path.display());
        assert!(path.is_absolute(), "{}", path.display());
    }
}
