//! Whom a client trusts at a control socket: a socket file, and a serving process, of its own
//! user or root; checked before a single byte of a request is sent.
//!
//! Whoever serves a master receives the calls' arguments and answers with a fleet of its choosing,
//! so a socket on a path another user could have taken (a shared `/tmp`, a mistyped variable) must
//! not be talked to.

use std::io;
use std::path::Path;

use tokio::net::UnixStream;

/// Which user a client is, and which users it trusts besides itself (root, who can read its
/// memory anyway).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Trust {
    own_uid: u32,
}

/// Why a control socket is not trusted; the message names the path, the uid found and what to do.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Untrusted(pub(crate) String);

impl Trust {
    /// Trusts the effective user of this process, and root.
    pub(crate) fn current() -> Self {
        Self::of_uid(nix::unistd::geteuid().as_raw())
    }

    /// Trusts `own_uid` and root.
    pub(crate) fn of_uid(own_uid: u32) -> Self {
        Self { own_uid }
    }

    fn trusts(self, uid: u32) -> bool {
        uid == self.own_uid || uid == 0
    }

    /// Checks what is at `path` without following a symbolic link: it must be a socket owned by
    /// us or root. `Ok(false)` when nothing is there.
    pub(crate) fn check_file(self, path: &Path) -> Result<bool, Untrusted> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let meta = match std::fs::symlink_metadata(path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => {
                return Err(Untrusted(format!(
                    "cannot inspect the control socket {}: {e}: check the path and its directory's permissions",
                    path.display()
                )));
            }
        };
        let kind = meta.file_type();
        if kind.is_symlink() {
            return Err(Untrusted(format!(
                "the control socket {} is a symbolic link: point --control (TOOLSRV_CONTROL) at the socket itself",
                path.display()
            )));
        }
        if !kind.is_socket() {
            return Err(Untrusted(format!(
                "{} is not a socket: point --control (TOOLSRV_CONTROL) at the socket a `toolctl master` serves",
                path.display()
            )));
        }
        if !self.trusts(meta.uid()) {
            return Err(Untrusted(format!(
                "the control socket {} belongs to uid {}, not to you (uid {}) or root: someone else \
                 may be serving there; use a socket path only you can write to, such as one under \
                 $XDG_RUNTIME_DIR",
                path.display(),
                meta.uid(),
                self.own_uid
            )));
        }
        Ok(true)
    }

    /// Checks the process serving `path` on the connected `stream` from the kernel's peer
    /// credentials: it must run as us or root.
    pub(crate) fn check_peer(self, path: &Path, stream: &UnixStream) -> Result<(), Untrusted> {
        let cred = stream.peer_cred().map_err(|e| {
            Untrusted(format!(
                "cannot read who serves the control socket {}: {e}: refusing to use it",
                path.display()
            ))
        })?;
        self.check_peer_uid(path, cred.uid(), cred.pid())
    }

    /// [`Trust::check_peer`] on credentials already read.
    pub(crate) fn check_peer_uid(
        self,
        path: &Path,
        uid: u32,
        pid: Option<i32>,
    ) -> Result<(), Untrusted> {
        if self.trusts(uid) {
            return Ok(());
        }
        let pid = pid.map(|p| format!(" (pid {p})")).unwrap_or_default();
        Err(Untrusted(format!(
            "the control socket {} is served by a process of uid {uid}{pid}, not by you (uid {}) \
             or root: nothing was sent to it; stop that process or use a socket path only you can \
             write to, such as one under $XDG_RUNTIME_DIR",
            path.display(),
            self.own_uid
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_own_uid_and_root_are_trusted_as_peers() {
        let path = Path::new("/run/user/1000/toolctl.sock");
        let me = Trust::of_uid(1000);
        assert!(me.check_peer_uid(path, 1000, Some(7)).is_ok());
        assert!(me.check_peer_uid(path, 0, None).is_ok());
        let err = me.check_peer_uid(path, 1001, Some(42)).unwrap_err();
        let msg = err.to_string();
        for part in [
            "/run/user/1000/toolctl.sock",
            "uid 1001",
            "pid 42",
            "uid 1000",
            "nothing was sent",
        ] {
            assert!(msg.contains(part), "{part}: {msg}");
        }
        // Root trusts root only (and itself).
        let root = Trust::of_uid(0);
        assert!(root.check_peer_uid(path, 0, None).is_ok());
        assert!(root.check_peer_uid(path, 65534, None).is_err());
    }

    #[tokio::test]
    async fn the_file_must_be_a_socket_of_ours_and_not_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let me = Trust::current();
        let socket = dir.path().join("ctl.sock");
        assert!(!me.check_file(&socket).unwrap(), "nothing there yet");
        let _listener = tokio::net::UnixListener::bind(&socket).unwrap();
        assert!(me.check_file(&socket).unwrap());

        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&socket, &link).unwrap();
        let err = me.check_file(&link).unwrap_err().to_string();
        assert!(
            err.contains("symbolic link") && err.contains("link.sock"),
            "{err}"
        );

        let file = dir.path().join("plain");
        std::fs::write(&file, "").unwrap();
        let err = me.check_file(&file).unwrap_err().to_string();
        assert!(err.contains("is not a socket"), "{err}");

        // A socket of another user: as root, make one; otherwise, judge ours as another user.
        let (judge, owner) = if me.own_uid == 0 {
            std::os::unix::fs::chown(&socket, Some(65534), Some(65534)).unwrap();
            (me, 65534)
        } else {
            (Trust::of_uid(me.own_uid + 1), me.own_uid)
        };
        let err = judge.check_file(&socket).unwrap_err().to_string();
        assert!(
            err.contains(&format!("belongs to uid {owner}")) && err.contains("ctl.sock"),
            "{err}"
        );
    }
}
