//! The calls' warden: a small process beside the agent that ends the agent's calls when the
//! agent itself is gone without ending them (SIGKILL, a crash, the OOM killer)
//!
//! The agent starts its own binary again under the name [`ARG0`], with the directories that
//! hold its call cgroups as arguments and a pipe as standard input, in a process group of its
//! own: what is sent to the agent's group (a terminal's Ctrl-C, a supervisor's `kill -9` of the
//! group) does not reach it. The warden reads nothing from the pipe. When the pipe's other end
//! closes, which the kernel does however the agent ends, it kills every process in those
//! cgroups, removes them, and exits. An agent that stops normally has ended its calls and
//! removed its cgroups first, so the warden finds nothing left to do.
//!
//! Without cgroups (`--sandbox off`, or a host where none can be made) there is no warden: a
//! call is then a process group, and what it started outside the group cannot be found.

use std::ffi::OsString;
use std::io::{self, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cgroup::{AGENT_PREFIX, agent_of, end_left_behind};

/// The name a warden runs under (`argv[0]`): a binary started by this name is a warden
pub const ARG0: &str = "toolsrv-call-warden";

/// How an agent starts its warden
#[derive(Debug, Clone)]
pub struct WardenStart {
    /// The agent's own binary (`/proc/self/exe`), which runs [`main`] when started as [`ARG0`]
    pub program: PathBuf,
    /// The warden's whole environment (how to log, as the agent does): nothing else of the
    /// agent's, whose environment may hold a join token, lives on in it
    pub env: Vec<(OsString, OsString)>,
}

/// The agent's side of its warden: dropping it closes the pipe, and the warden ends whatever is
/// left in the agent's call cgroups. A warden that ends while the agent runs (killed by hand) is
/// started again.
#[derive(Debug)]
pub(crate) struct Warden {
    /// The running warden's pipe, kept open for as long as the agent's calls may run
    pipe: Arc<Mutex<Option<ChildStdin>>>,
    /// Set before the pipe closes on purpose, so the end of the warden is not reported
    closing: Arc<AtomicBool>,
}

/// A warden that lived this long before it ended is started again after a second; one that
/// keeps ending sooner waits twice as long each time
const STEADY: Duration = Duration::from_secs(60);
/// The longest wait before a warden that keeps ending is started again
const MAX_PAUSE: Duration = Duration::from_secs(60);

impl Warden {
    /// Starts `how.program` as the warden of the call cgroups under `dirs`. A thread waits for
    /// it, and starts another if it ends while the agent runs.
    pub(crate) fn start(how: &WardenStart, dirs: &[&Path]) -> io::Result<Self> {
        let dirs: Vec<PathBuf> = dirs.iter().map(|d| d.to_path_buf()).collect();
        let (child, pipe) = spawn(how, &dirs)?;
        tracing::debug!(pid = child.id(), "calls' warden started");
        let pipe = Arc::new(Mutex::new(Some(pipe)));
        let closing = Arc::new(AtomicBool::new(false));
        let keeper = Keeper {
            how: how.clone(),
            dirs,
            pipe: pipe.clone(),
            closing: closing.clone(),
        };
        std::thread::Builder::new()
            .name("call-warden".into())
            .spawn(move || keeper.keep(child))?;
        Ok(Self { pipe, closing })
    }
}

impl Drop for Warden {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Release);
        drop(self.pipe.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

/// Starts one warden; its pipe
fn spawn(how: &WardenStart, dirs: &[PathBuf]) -> io::Result<(Child, ChildStdin)> {
    let mut child = Command::new(&how.program)
        .arg0(ARG0)
        .args(dirs)
        .env_clear()
        .envs(how.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()?;
    match child.stdin.take() {
        Some(pipe) => Ok((child, pipe)),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            Err(io::Error::other(
                "the warden's standard input is not a pipe",
            ))
        }
    }
}

/// What the agent's thread that waits for its warden holds
struct Keeper {
    how: WardenStart,
    dirs: Vec<PathBuf>,
    pipe: Arc<Mutex<Option<ChildStdin>>>,
    closing: Arc<AtomicBool>,
}

impl Keeper {
    fn keep(self, mut child: Child) {
        let mut pause = Duration::from_secs(1);
        loop {
            let started = Instant::now();
            let pid = child.id();
            let status = child.wait();
            if self.closing.load(Ordering::Acquire) {
                return;
            }
            tracing::warn!(pid, status = ?status, "the calls' warden ended; starting another");
            if started.elapsed() >= STEADY {
                pause = Duration::from_secs(1);
            }
            child = loop {
                std::thread::sleep(pause);
                pause = (pause * 2).min(MAX_PAUSE);
                if self.closing.load(Ordering::Acquire) {
                    return;
                }
                match spawn(&self.how, &self.dirs) {
                    Ok((next, pipe)) => {
                        let mut held = self.pipe.lock().unwrap_or_else(|p| p.into_inner());
                        // Dropped meanwhile: the new warden's pipe closes at once, and it ends
                        // what is left, as the old one would have.
                        if self.closing.load(Ordering::Acquire) {
                            return;
                        }
                        *held = Some(pipe);
                        tracing::info!(pid = next.id(), "calls' warden started again");
                        break next;
                    }
                    Err(e) => tracing::warn!(
                        error = %e,
                        "cannot start the calls' warden again: if this agent is killed \
                         outright, its calls run on until an agent starts again on this host"
                    ),
                }
            };
        }
    }
}

/// Why a warden's arguments are refused, if they are: each must be an absolute path named as an
/// agent's directory of call cgroups (`toolsrv-calls-<pid>.<n>`), of `parent` (the process that
/// started the warden) or of a process that is gone (an agent killed before its warden looked).
fn refused(dirs: &[PathBuf], parent: i32, alive: impl Fn(i32) -> bool) -> Option<String> {
    if dirs.is_empty() {
        return Some("no directory of call cgroups was given".into());
    }
    dirs.iter().find_map(|dir| {
        let pid = dir.file_name().and_then(|n| n.to_str()).and_then(agent_of);
        // Control characters escaped, for the terminal or log it lands in.
        let shown = || -> String {
            dir.to_string_lossy()
                .chars()
                .flat_map(|c| {
                    let escaped: Vec<char> = if c.is_control() {
                        c.escape_debug().collect()
                    } else {
                        vec![c]
                    };
                    escaped
                })
                .collect()
        };
        match pid {
            _ if !dir.is_absolute() => Some(format!("{} is not an absolute path", shown())),
            None => Some(format!(
                "{} is not a directory of call cgroups (named {AGENT_PREFIX}PID.N)",
                shown()
            )),
            Some(pid) if pid != parent && alive(pid) => Some(format!(
                "{} holds the calls of process {pid}, which is running and did not start this \
                 one",
                shown()
            )),
            Some(_) => None,
        }
    })
}

/// Runs a warden: the whole of a process started under the name [`ARG0`], logging through
/// `tracing` (the binary sets up a subscriber first)
pub fn main() -> ExitCode {
    // Seen as this in `ps` and `top`, not as `exe` (it was started as /proc/self/exe).
    let _ = nix::sys::prctl::set_name(c"toolsrv-warden");
    if let Err(e) = crate::sys::ignore_ending_signals() {
        tracing::warn!(error = %e, "{ARG0}: cannot ignore the signals that would end it");
    }
    let dirs: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let agent = std::os::unix::process::parent_id();
    let parent = i32::try_from(agent).unwrap_or(0);
    if let Some(why) = refused(&dirs, parent, crate::cgroup::pid_alive) {
        tracing::error!("{ARG0}: {why}; only a toolsrv agent starts this");
        return ExitCode::from(2);
    }
    // Nothing comes down the pipe: its end is the agent's end.
    let mut stdin = io::stdin().lock();
    let mut sink = [0u8; 64];
    loop {
        match stdin.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let ended: usize = dirs.iter().map(|d| end_left_behind(d)).sum();
    if ended > 0 {
        tracing::warn!(
            agent_pid = agent,
            processes = ended,
            "the agent ended without ending its calls: the calls' warden ended their processes \
             and removed their cgroups"
        );
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_call_cgroups_of_its_own_agent_or_of_one_gone_are_taken() {
        // Process 42 started it; 43 is running; every other pid is gone.
        let check = |p: &[u8]| {
            use std::os::unix::ffi::OsStrExt;
            refused(
                &[PathBuf::from(std::ffi::OsStr::from_bytes(p))],
                42,
                |pid| pid == 42 || pid == 43,
            )
        };
        assert_eq!(check(b"/sys/fs/cgroup/x/toolsrv-calls-42.0"), None);
        assert_eq!(check(b"/sys/fs/cgroup/x/toolsrv-calls-42.17"), None);
        // An agent killed before its warden looked: its parent is no longer the agent.
        assert_eq!(check(b"/sys/fs/cgroup/x/toolsrv-calls-7.0"), None);
        for (bad, why) in [
            (
                &b"/sys/fs/cgroup/x/toolsrv-calls-43.0"[..],
                "process 43, which is running",
            ),
            (
                b"/sys/fs/cgroup/x/toolsrv-calls-42",
                "named toolsrv-calls-PID.N",
            ),
            (
                b"/sys/fs/cgroup/x/toolsrv-calls-42.",
                "named toolsrv-calls-PID.N",
            ),
            (
                b"/sys/fs/cgroup/x/toolsrv-calls-x.1",
                "named toolsrv-calls-PID.N",
            ),
            (b"/sys/fs/cgroup/user.slice", "named toolsrv-calls-PID.N"),
            (b"/", "named toolsrv-calls-PID.N"),
            (b"toolsrv-calls-42.0", "not an absolute path"),
            (b"/x/\xff\x1b[1m", "/x/\u{fffd}\\u{1b}[1m is not"),
        ] {
            let said = check(bad).unwrap_or_else(|| panic!("{bad:?} taken"));
            assert!(said.contains(why), "{said}");
        }
        assert!(refused(&[], 42, |_| true).unwrap().contains("no directory"));
    }
}
