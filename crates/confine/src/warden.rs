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
use std::process::{ChildStdin, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::cgroup::{AGENT_PREFIX, end_left_behind};

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

/// The agent's side of a running warden: dropping it closes the pipe, and the warden ends
/// whatever is left in the agent's call cgroups
#[derive(Debug)]
pub(crate) struct Warden {
    /// Kept open for as long as the agent's calls may run
    _pipe: ChildStdin,
    /// Set before the pipe closes on purpose, so the end of the warden is not reported
    closing: Arc<AtomicBool>,
}

impl Warden {
    /// Starts `program` (the agent's own binary, `/proc/self/exe`) as the warden of the call
    /// cgroups under `dirs`. A thread waits for it and warns if it ends while the agent runs.
    pub(crate) fn start(how: &WardenStart, dirs: &[&Path]) -> io::Result<Self> {
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
        let pipe = child
            .stdin
            .take()
            .ok_or_else(|| io::Error::other("the warden's standard input is not a pipe"))?;
        let closing = Arc::new(AtomicBool::new(false));
        let seen = closing.clone();
        let pid = child.id();
        std::thread::Builder::new()
            .name("call-warden".into())
            .spawn(move || {
                let status = child.wait();
                if !seen.load(Ordering::Acquire) {
                    tracing::warn!(
                        pid,
                        status = ?status,
                        "the calls' warden ended: if this agent is killed outright, its calls \
                         now run on until an agent starts again on this host"
                    );
                }
            })?;
        tracing::debug!(pid, "calls' warden started");
        Ok(Self {
            _pipe: pipe,
            closing,
        })
    }
}

impl Drop for Warden {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Release);
    }
}

/// Why a warden's arguments are refused, if they are: each must be an absolute path whose
/// name is an agent's directory of call cgroups, of the process that started the warden
fn refused(dirs: &[PathBuf], parent: u32) -> Option<String> {
    if dirs.is_empty() {
        return Some("no directory of call cgroups was given".into());
    }
    let own = format!("{AGENT_PREFIX}{parent}.");
    dirs.iter().find_map(|dir| {
        let named = dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&own));
        (!dir.is_absolute() || !named).then(|| {
            format!(
                "{} is not a directory of call cgroups of the process that started this one \
                 (an absolute path named {own}N)",
                dir.display()
            )
        })
    })
}

/// Runs a warden: the whole of a process started under the name [`ARG0`], logging through
/// `tracing` (the binary sets up a subscriber first)
pub fn main() -> ExitCode {
    let dirs: Vec<PathBuf> = std::env::args_os()
        .skip(1)
        .map(|a: OsString| PathBuf::from(a))
        .collect();
    let agent = std::os::unix::process::parent_id();
    if let Some(why) = refused(&dirs, agent) {
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
    fn only_the_call_cgroups_of_its_own_agent_are_taken() {
        let ok = |p: &str| refused(&[PathBuf::from(p)], 42);
        assert_eq!(ok("/sys/fs/cgroup/x/toolsrv-calls-42.0"), None);
        assert_eq!(ok("/sys/fs/cgroup/x/toolsrv-calls-42.17"), None);
        for bad in [
            "/sys/fs/cgroup/x/toolsrv-calls-43.0",
            "/sys/fs/cgroup/x/toolsrv-calls-420.0",
            "/sys/fs/cgroup/x/toolsrv-calls-42",
            "toolsrv-calls-42.0",
            "/sys/fs/cgroup/user.slice",
            "/",
        ] {
            let why = ok(bad).unwrap_or_else(|| panic!("{bad} taken"));
            assert!(why.contains("toolsrv-calls-42."), "{why}");
        }
        assert!(refused(&[], 42).unwrap().contains("no directory"));
    }
}
