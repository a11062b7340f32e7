//! A child process in its own process group, its output in a log file, killed with its group
//! when its handle drops; and free loopback ports.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use crate::error::{Result, TestkitError, must};

/// How long [`Proc::terminate`] waits for a clean exit.
const TERMINATE_WAIT: Duration = Duration::from_secs(20);
/// How long [`Proc::stop`] waits for a clean exit before killing the group.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// Lowest port [`try_free_port`] picks below the ephemeral range.
const FIRST_OWN_PORT: u16 = 10_000;

/// A port on 127.0.0.1 that nothing listens on now, for a process a test starts to listen on.
///
/// Taken below the kernel's range of ephemeral ports (`ip_local_port_range`) when there is room:
/// a port of that range, free when picked, can become any outgoing connection's own end before
/// the process binds it (an agent's metrics port was lost that way in one CI run), where a port
/// below it goes only to a listener that asks for it by number. Never the same port twice in
/// one test process. Falls back to a port the kernel picks (bound, then released).
pub fn try_free_port() -> Result<u16> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok());
    if let Some(low) = ephemeral.filter(|&low| low > FIRST_OWN_PORT + 1000) {
        let span = u64::from(low - FIRST_OWN_PORT);
        let mut seed = u64::from(std::process::id())
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
            ^ (given.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for _ in 0..256 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let port = FIRST_OWN_PORT + u16::try_from(seed % span).unwrap_or(0);
            if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.push(port);
                return Ok(port);
            }
        }
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| TestkitError::io("cannot find a free port on 127.0.0.1", e))?;
    given.push(port);
    Ok(port)
}

/// [`try_free_port`], failing the test on error.
#[track_caller]
pub fn free_port() -> u16 {
    must(try_free_port())
}

/// Whether process `pid` holds a listening TCP socket on `port` (any address): one of its file
/// descriptors is a socket that `/proc/PID/net/tcp` or `tcp6` lists in state LISTEN there.
pub fn listens_on(pid: i32, port: u16) -> bool {
    let mut inodes = Vec::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl, local_address (ADDR:PORT in hex), rem_address, st (0A: LISTEN), ..., inode.
            let (Some(local), Some(state), Some(inode)) =
                (fields.get(1), fields.get(3), fields.get(9))
            else {
                continue;
            };
            let local_port = local
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) && *state == "0A" {
                inodes.push(format!("socket:[{inode}]"));
            }
        }
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
    })
}

/// A child process killed (with its whole process group) on drop. When the thread is
/// panicking, the drop prints the process's log.
#[derive(Debug)]
pub struct Proc {
    pub child: Child,
    pub name: String,
    log: PathBuf,
}

impl Proc {
    /// Starts `cmd` in its own process group, output to `<log_dir>/<name>.log`.
    pub fn try_spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Result<Self> {
        let log = log_dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log)
            .map_err(|e| TestkitError::io(format!("cannot create {}", log.display()), e))?;
        let out = file
            .try_clone()
            .map_err(|e| TestkitError::io(format!("cannot share {}", log.display()), e))?;
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(file)
            .process_group(0);
        let child = cmd
            .spawn()
            .map_err(|e| TestkitError::io(format!("cannot start {name}"), e))?;
        Ok(Self {
            child,
            name: name.to_string(),
            log,
        })
    }

    /// [`Proc::try_spawn`], failing the test on error.
    #[track_caller]
    pub fn spawn(name: &str, cmd: Command, log_dir: &Path) -> Self {
        must(Self::try_spawn(name, cmd, log_dir))
    }

    /// The process's output so far, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Where the process serves its metrics, from its log line `metrics at http://ADDR/metrics`:
    /// started with `--metrics-listen 127.0.0.1:0`, the port the system chose, so that no port
    /// picked in advance can be taken by another process meanwhile. Waits for the line at most
    /// 20 s.
    #[track_caller]
    pub fn metrics_addr(&self) -> String {
        self.logged_addr("its metrics", "metrics at http://")
    }

    /// The value of the sample `name` (with its labels, if any: `toolsrv_x{k="v"}`) the process
    /// serves on its metrics port now ([`Proc::metrics_addr`]); `None` when it has none.
    #[track_caller]
    pub fn metric(&self, name: &str) -> Option<String> {
        let (_, body) = crate::must(crate::http_get(&self.metrics_addr(), "/metrics"));
        let prefix = format!("{name} ");
        body.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .map(|v| v.trim().to_string())
    }

    /// Where a coordinator serves gRPC health in plain text, from its log line `gRPC health
    /// (plain text) at ADDR` (started with `--health-listen 127.0.0.1:0`), as
    /// [`Proc::metrics_addr`].
    #[track_caller]
    pub fn health_addr(&self) -> String {
        self.logged_addr("gRPC health", "gRPC health (plain text) at ")
    }

    /// The address after `marker` in the first log line that has it; waits at most 20 s.
    #[track_caller]
    fn logged_addr(&self, what: &str, marker: &str) -> String {
        crate::wait_for(
            &format!("{} to serve {what}", self.name),
            Duration::from_secs(20),
            || {
                self.log().lines().find_map(|l| {
                    let rest = l.split(marker).nth(1)?;
                    let end = rest
                        .find(|c: char| c.is_whitespace() || c == '"' || c == '/')
                        .unwrap_or(rest.len());
                    Some(rest[..end].to_string())
                })
            },
        )
    }

    /// The last `lines` lines of the process's output.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// An error, with the end of the log, if the process has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(TestkitError::Exited {
                name: self.name.clone(),
                status,
                log: self.log_tail(15),
            }),
            Err(e) => Err(TestkitError::io(
                format!("cannot wait for {}", self.name),
                e,
            )),
        }
    }

    /// SIGKILL to the whole group: the host vanishes without a goodbye.
    pub fn kill(&mut self) {
        let _ = killpg(Pid::from_raw(self.pid()), Signal::SIGKILL);
        let _ = self.child.wait();
    }

    /// SIGTERM, then a bounded wait (20 s) for a clean exit; killed after that.
    pub fn terminate(&mut self) -> Option<ExitStatus> {
        self.terminate_within(TERMINATE_WAIT)
    }

    /// SIGTERM, then at most `limit` for a clean exit; `None` (and killed) after that.
    pub fn terminate_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let _ = kill(Pid::from_raw(self.pid()), Signal::SIGTERM);
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }

    /// [`Proc::terminate_within`] 10 s, then SIGKILL to what is left of the group.
    pub fn stop(&mut self) {
        self.terminate_within(STOP_WAIT);
        let _ = killpg(Pid::from_raw(self.pid()), Signal::SIGKILL);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
        if std::thread::panicking() {
            eprintln!("----- {} log -----\n{}", self.name, self.log());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_is_found_on_its_own_process_only() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let me = std::process::id() as i32;
        assert!(listens_on(me, port));
        // A connected socket on another port is no listener there; the parent holds none of ours.
        let _client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        assert!(!listens_on(me, free_port()));
        assert!(!listens_on(nix::unistd::getppid().as_raw(), port));
    }

    #[test]
    fn free_ports_are_distinct_and_outside_the_ephemeral_range_when_there_is_room() {
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "a port was given twice");
        if low > FIRST_OWN_PORT + 1000 {
            assert!(
                ports.iter().all(|&p| (FIRST_OWN_PORT..low).contains(&p)),
                "{ports:?} against the range from {low}"
            );
        }
        for port in ports {
            std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }
}
