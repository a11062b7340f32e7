//! Starting a confined tool without copying the agent: `clone(CLONE_VM | CLONE_VFORK)`, the child set-up, then `execve`
//!
//! `std` forks when a `pre_exec` step is given, and a fork copies the page tables of the whole
//! agent (and makes every page it then writes fault, until the child executes): the larger the
//! agent, the slower every confined call. This starts the child the way `posix_spawn` does: it
//! shares the agent's memory, on a stack of its own, while the calling thread waits for it to
//! execute the tool or fail. It runs [`ChildSetup::apply`] (system calls on prepared values
//! only) between its own plumbing steps: default signal handling and an empty signal mask, a
//! new process group, the pipes as stdin, stdout and stderr, the working directory.
//!
//! Because the child shares memory with the agent's other threads, it must not call anything
//! that takes a lock, allocates, or acts on the agent's threads (glibc's `setresuid` tells every
//! thread of the process to switch: it would switch the agent's). Everything it touches is made
//! before the clone; [`ChildSetup::apply`] makes raw system calls only.
#![allow(unsafe_code)]

use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::sys::ChildSetup;

/// The child's stack: its plumbing and [`ChildSetup::apply`] need a few KiB.
const STACK_BYTES: usize = 128 << 10;

/// A tool process started by [`spawn`], with the agent's ends of its pipes
#[derive(Debug)]
pub struct Spawned {
    /// Its process id, also its process group id
    pub pid: i32,
    /// A descriptor of the process (readable once it has exited), for waiting without races
    pub pidfd: OwnedFd,
    /// Write end of its stdin (non-blocking)
    pub stdin: OwnedFd,
    /// Read end of its stdout (non-blocking)
    pub stdout: OwnedFd,
    /// Read end of its stderr (non-blocking)
    pub stderr: OwnedFd,
}

/// What failed in the child before the tool ran
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
enum Stage {
    Pgroup = 1,
    Stdio = 2,
    Cwd = 3,
    Confine = 4,
    Exec = 5,
}

impl Stage {
    fn from_raw(raw: u32) -> &'static str {
        match raw {
            1 => "cannot start a process group",
            2 => "cannot set up stdin, stdout and stderr",
            3 => "cannot enter the working directory",
            4 => "cannot confine the process (cgroups, limits, user, no_new_privs, Landlock)",
            _ => "cannot execute the program",
        }
    }
}

/// Everything the child reads, made before the clone
struct ChildArgs<'a> {
    path: &'a CString,
    argv: &'a [*const libc::c_char],
    envp: &'a [*const libc::c_char],
    cwd: &'a CString,
    /// The child's ends: stdin (read), stdout (write), stderr (write)
    stdio: [RawFd; 3],
    /// Where the child reports a failure: (stage, errno), 8 bytes
    report: RawFd,
    setup: &'a ChildSetup,
}

/// Starts `program` (an absolute path) with `args` (the first is `argv[0]`), exactly the
/// environment `env`, in `cwd`, applying `setup` before it executes; returns once the program
/// runs, or with the error that kept it from running (what failed and the OS error).
pub fn spawn(
    program: &Path,
    args: &[&OsStr],
    env: &[(OsString, OsString)],
    cwd: &Path,
    setup: &ChildSetup,
) -> io::Result<Spawned> {
    let path = c_string(program.as_os_str())?;
    let cwd = c_string(cwd.as_os_str())?;
    let args: Vec<CString> = args
        .iter()
        .map(|a| c_string(a))
        .collect::<io::Result<_>>()?;
    let env: Vec<CString> = env
        .iter()
        .map(|(k, v)| {
            let mut pair = k.clone();
            pair.push("=");
            pair.push(v);
            c_string(&pair)
        })
        .collect::<io::Result<_>>()?;
    let argv = null_terminated(&args);
    let envp = null_terminated(&env);

    let (stdin_read, stdin_write) = pipe()?;
    let (stdout_read, stdout_write) = pipe()?;
    let (stderr_read, stderr_write) = pipe()?;
    let (report_read, report_write) = pipe()?;
    for fd in [&stdin_write, &stdout_read, &stderr_read] {
        set_nonblocking(fd)?;
    }
    let child = ChildArgs {
        path: &path,
        argv: &argv,
        envp: &envp,
        cwd: &cwd,
        stdio: [
            stdin_read.as_raw_fd(),
            stdout_write.as_raw_fd(),
            stderr_write.as_raw_fd(),
        ],
        report: report_write.as_raw_fd(),
        setup,
    };
    let mut stack = vec![0u8; STACK_BYTES];
    // The stack grows down on every architecture Linux runs toolsrv on: pass its 16-byte
    // aligned top.
    let top = {
        let end = stack.as_mut_ptr() as usize + STACK_BYTES;
        (end & !0xf) as *mut libc::c_void
    };
    let mut pidfd: libc::c_int = -1;
    let (pid, clone_error) = {
        let _blocked = BlockedSignals::new();
        // SAFETY: `child_main` runs on `stack`, which outlives the call (the calling thread
        // sleeps until the child executes or exits: CLONE_VFORK), and reads only `child`,
        // which lives on this frame until then. CLONE_PIDFD stores a descriptor in `pidfd`.
        // All signals are blocked meanwhile, so no handler of the agent's runs on the child's
        // stack before the child resets them.
        let pid = unsafe {
            libc::clone(
                child_main,
                top,
                libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD | libc::SIGCHLD,
                std::ptr::from_ref(&child).cast_mut().cast(),
                &mut pidfd as *mut libc::c_int,
            )
        };
        (pid, io::Error::last_os_error())
    };
    drop(stack);
    // The child's ends: the tool holds its own copies now (or never will).
    drop((stdin_read, stdout_write, stderr_write, report_write));
    if pid < 0 {
        return Err(clone_error);
    }
    // SAFETY: the kernel made `pidfd` for us (CLONE_PIDFD) and nothing else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let mut report = [0u8; 8];
    let read = read_full(&report_read, &mut report)?;
    if read == 0 {
        return Ok(Spawned {
            pid,
            pidfd,
            stdin: stdin_write,
            stdout: stdout_read,
            stderr: stderr_read,
        });
    }
    // The child failed and exited: reap it, then say what failed.
    reap(pid);
    let stage = u32::from_ne_bytes([report[0], report[1], report[2], report[3]]);
    let errno = i32::from_ne_bytes([report[4], report[5], report[6], report[7]]);
    let os = io::Error::from_raw_os_error(errno);
    if stage == Stage::Exec as u32 {
        // As std reports a program that cannot be executed: the OS error alone.
        return Err(os);
    }
    Err(io::Error::new(
        os.kind(),
        format!("{}: {os}", Stage::from_raw(stage)),
    ))
}

/// The child: plumbing, [`ChildSetup::apply`], `execve`. Returns only by exiting.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` the parent keeps alive until this child executes or exits.
    let child = unsafe { &*(arg as *const ChildArgs<'_>) };
    let fail = |stage: Stage, error: io::Error| -> libc::c_int {
        let errno = error.raw_os_error().unwrap_or(libc::EIO);
        let mut report = [0u8; 8];
        report[..4].copy_from_slice(&(stage as u32).to_ne_bytes());
        report[4..].copy_from_slice(&errno.to_ne_bytes());
        // SAFETY: write(2) and _exit(2) on a descriptor and buffer of ours.
        unsafe {
            libc::write(child.report, report.as_ptr().cast(), report.len());
            libc::_exit(127)
        }
    };
    // SAFETY (for the block): each call is one system call on values owned by `child` or on
    // this stack; none allocates or locks.
    unsafe {
        // Handlers of the agent's do not belong in the tool (SIGPIPE is ignored by Rust
        // programs); a separate handler table (no CLONE_SIGHAND) makes this ours alone.
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        for signo in 1..libc::SIGRTMAX() {
            if signo != libc::SIGKILL && signo != libc::SIGSTOP {
                libc::sigaction(signo, &default, std::ptr::null_mut());
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        if libc::setpgid(0, 0) != 0 {
            return fail(Stage::Pgroup, io::Error::last_os_error());
        }
        for (target, &fd) in child.stdio.iter().enumerate() {
            let target = target as RawFd;
            let rc = if fd == target {
                // dup2 onto itself keeps close-on-exec: clear it instead.
                libc::fcntl(fd, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, target)
            };
            if rc < 0 {
                return fail(Stage::Stdio, io::Error::last_os_error());
            }
        }
        if libc::chdir(child.cwd.as_ptr()) != 0 {
            return fail(Stage::Cwd, io::Error::last_os_error());
        }
    }
    if let Err(e) = child.setup.apply() {
        return fail(Stage::Confine, e);
    }
    // SAFETY: execve(2) with NUL-terminated strings and NULL-terminated arrays made by the
    // parent; it returns only on failure.
    unsafe {
        libc::execve(
            child.path.as_ptr(),
            child.argv.as_ptr(),
            child.envp.as_ptr(),
        );
    }
    fail(Stage::Exec, io::Error::last_os_error())
}

/// All signals blocked on this thread until dropped (the previous mask restored then)
struct BlockedSignals {
    old: libc::sigset_t,
}

impl BlockedSignals {
    fn new() -> Self {
        // SAFETY: pthread_sigmask(3) on sets that live on this frame.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            Self { old }
        }
    }
}

impl Drop for BlockedSignals {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved by `new`.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut());
        }
    }
}

fn c_string(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} holds a NUL byte", s.to_string_lossy()),
        )
    })
}

fn null_terminated(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// A pipe, both ends close-on-exec: (read, write)
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2(2) fills the two-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl(2) on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Reads until `buf` is full or end of file; returns the bytes read.
fn read_full(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    let mut read = 0;
    while read < buf.len() {
        // SAFETY: read(2) into the unfilled part of `buf`.
        let n = unsafe {
            libc::read(
                fd.as_raw_fd(),
                buf[read..].as_mut_ptr().cast(),
                buf.len() - read,
            )
        };
        match n {
            0 => break,
            n if n > 0 => read += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(read)
}

/// Waits for child `pid`, which has exited or is about to.
fn reap(pid: i32) {
    let mut status = 0;
    // SAFETY: waitpid(2) on our own child.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
        && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
    {}
}
