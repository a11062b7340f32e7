//! The tool's process as the supervisor sees it: started by tokio, or without a fork by the confined spawner (Linux)

use std::io;
use std::process::ExitStatus;

use tokio::io::{AsyncRead, AsyncWrite};

/// A started tool: the process and the agent's ends of its pipes
pub(crate) struct Started {
    pub child: Child,
    pub pid: u32,
    pub stdin: Box<dyn AsyncWrite + Send + Unpin>,
    pub stdout: Box<dyn AsyncRead + Send + Unpin>,
    pub stderr: Box<dyn AsyncRead + Send + Unpin>,
}

/// The tool's process; dropping it before it was reaped kills it and reaps it in the background
pub(crate) enum Child {
    Tokio(tokio::process::Child),
    #[cfg(target_os = "linux")]
    Raw(raw::RawChild),
}

impl Child {
    /// Waits for the process to exit and reaps it; again after that, the same status
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        match self {
            Child::Tokio(child) => child.wait().await,
            #[cfg(target_os = "linux")]
            Child::Raw(child) => child.wait().await,
        }
    }
}

#[cfg(target_os = "linux")]
pub(crate) mod raw {
    //! A child started by `toolsrv_confine::spawn`: waited for through its pidfd.

    use std::io;
    use std::os::fd::OwnedFd;
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    use nix::sys::signal::{Signal, kill};
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    use nix::unistd::Pid;
    use tokio::io::unix::AsyncFd;
    use toolsrv_confine::spawn::Spawned;

    use super::{Child, Started};

    pub(crate) struct RawChild {
        pid: Pid,
        pidfd: Option<AsyncFd<OwnedFd>>,
        status: Option<ExitStatus>,
    }

    /// Wraps a process started by the confined spawner; must run within a tokio runtime.
    pub(crate) fn adopt(spawned: Spawned) -> io::Result<Started> {
        let Spawned {
            pid,
            pidfd,
            stdin,
            stdout,
            stderr,
        } = spawned;
        let pid_u32 = u32::try_from(pid).map_err(|_| io::Error::other("negative process id"))?;
        // Registered first: if anything below fails, dropping `child` kills and reaps it.
        let mut child = RawChild {
            pid: Pid::from_raw(pid),
            pidfd: None,
            status: None,
        };
        // SAFETY: `register` is unsafe because tokio cannot know that the descriptor outlives
        // its registration; an `OwnedFd` moved into the `AsyncFd` is closed only when the
        // `AsyncFd` is dropped, after it deregisters.
        #[allow(unsafe_code)]
        let registered = unsafe { AsyncFd::register(pidfd) }.map_err(io::Error::from)?;
        child.pidfd = Some(registered);
        // The spawner made the agent's ends non-blocking.
        let stdin = tokio::net::unix::pipe::Sender::from_owned_fd_unchecked(stdin)?;
        let stdout = tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(stdout)?;
        let stderr = tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(stderr)?;
        Ok(Started {
            child: Child::Raw(child),
            pid: pid_u32,
            stdin: Box::new(stdin),
            stdout: Box::new(stdout),
            stderr: Box::new(stderr),
        })
    }

    /// The status of `pid` if it has exited (reaping it), `None` while it runs.
    fn try_reap(pid: Pid) -> io::Result<Option<ExitStatus>> {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => Ok(Some(ExitStatus::from_raw((code & 0xff) << 8))),
            Ok(WaitStatus::Signaled(_, signal, core)) => Ok(Some(ExitStatus::from_raw(
                signal as i32 | if core { 0x80 } else { 0 },
            ))),
            Ok(_) => Ok(None),
            Err(nix::errno::Errno::EINTR) => Ok(None),
            Err(e) => Err(io::Error::from(e)),
        }
    }

    impl RawChild {
        pub(crate) async fn wait(&mut self) -> io::Result<ExitStatus> {
            if let Some(status) = self.status {
                return Ok(status);
            }
            let Some(pidfd) = &self.pidfd else {
                return Err(io::Error::other("the process cannot be waited for"));
            };
            loop {
                let mut ready = pidfd.readable().await?;
                if let Some(status) = try_reap(self.pid)? {
                    self.status = Some(status);
                    return Ok(status);
                }
                ready.clear_ready();
            }
        }
    }

    impl Drop for RawChild {
        fn drop(&mut self) {
            if self.status.is_some() {
                return;
            }
            let _ = kill(self.pid, Signal::SIGKILL);
            if let Ok(Some(_)) = try_reap(self.pid) {
                return;
            }
            // Not dead yet: reap it when it is, without blocking this thread.
            let pid = self.pid;
            let pidfd = self.pidfd.take();
            match (tokio::runtime::Handle::try_current(), pidfd) {
                (Ok(runtime), Some(pidfd)) => {
                    runtime.spawn(async move {
                        let mut child = RawChild {
                            pid,
                            pidfd: Some(pidfd),
                            status: None,
                        };
                        let _ = child.wait().await;
                    });
                }
                _ => {
                    let _ = std::thread::Builder::new()
                        .name("reap-tool".into())
                        .spawn(move || {
                            let _ = waitpid(pid, None);
                        });
                }
            }
        }
    }
}
