//! Real `toolsrv coordinator` and `toolsrv agent` processes on 127.0.0.1 for the fleet bench,
//! the paths they need, and their memory as `/proc/PID/status` reports it.
//!
//! Every process runs in its own process group and is killed with it when its handle drops;
//! every wait is bounded.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use toolsrv_client::{Client, ConnectOptions, HostInfo, HostState};
use toolsrv_tls::{Identity, TlsFiles};

use crate::BenchError;

/// The client certificate the bench calls with (`toolsrv pki init --clients bench`).
pub const CLIENT: &str = "bench";

/// Where the binaries, certificates and example tools are, and a scratch directory.
#[derive(Debug)]
pub struct Paths {
    /// Holds `toolsrv` and `toolctl` (release builds).
    pub bin_dir: PathBuf,
    /// A PKI written by `toolsrv pki init` with the agents and the `bench` client.
    pub pki: PathBuf,
    /// `examples/tools` of the repository.
    pub examples: PathBuf,
    /// Scratch space (logs, tools directories, agent state).
    pub work: PathBuf,
}

impl Paths {
    pub fn toolsrv(&self) -> PathBuf {
        self.bin_dir.join("toolsrv")
    }

    pub fn toolctl(&self) -> PathBuf {
        self.bin_dir.join("toolctl")
    }

    pub fn client_tls(&self) -> TlsFiles {
        TlsFiles::in_dir(&self.pki, &Identity::Client(CLIENT.into()))
    }

    /// `--ca/--cert/--key` of a certificate stem such as `coordinator` or `agent-real-1`.
    pub fn tls_args(&self, identity: &Identity) -> Vec<String> {
        let files = TlsFiles::in_dir(&self.pki, identity);
        vec![
            format!("--ca={}", files.ca.display()),
            format!("--cert={}", files.cert.display()),
            format!("--key={}", files.key.display()),
        ]
    }
}

/// The release binaries next to this bench executable (`target/release/deps/fleet-*` → `target/release`).
pub fn default_bin_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.parent()?.to_path_buf())
}

/// Memory of a process from `/proc/PID/status`, in KiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Mem {
    /// VmRSS: resident now.
    pub rss_kib: u64,
    /// VmHWM: the peak resident set since start (or since the last reset).
    pub hwm_kib: u64,
}

/// Reads VmRSS and VmHWM of `pid` (`"self"` for this process).
pub fn mem_of(pid: &str) -> Result<Mem, BenchError> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64, BenchError> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .ok_or_else(|| format!("no {name} in /proc/{pid}/status"))?;
        let kib = line
            .trim_start_matches(name)
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()?;
        Ok(kib)
    };
    Ok(Mem {
        rss_kib: field("VmRSS:")?,
        hwm_kib: field("VmHWM:")?,
    })
}

/// Resets VmHWM of this process to the current RSS (`echo 5 > /proc/self/clear_refs`).
pub fn reset_own_peak() -> Result<(), BenchError> {
    std::fs::write("/proc/self/clear_refs", "5")?;
    Ok(())
}

/// Raises this process's open-file limit to its hard limit (children inherit it): a thousand
/// TLS links need a thousand descriptors here and in the coordinator.
pub fn raise_nofile() -> Result<u64, BenchError> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    Ok(hard)
}

/// A child process killed, with its process group, when dropped.
#[derive(Debug)]
pub struct Proc {
    child: Child,
    pub name: String,
    log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Result<Self, BenchError> {
        let log = log_dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log)?;
        cmd.stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .process_group(0);
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        Ok(Self {
            child,
            name: name.to_string(),
            log,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn mem(&self) -> Result<Mem, BenchError> {
        mem_of(&self.pid().to_string())
    }

    /// The last lines of the process's log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Fails with the log if the process has exited.
    pub fn check_alive(&mut self) -> Result<(), BenchError> {
        if let Some(status) = self.child.try_wait()? {
            return Err(format!("{} exited ({status}):\n{}", self.name, self.log_tail()).into());
        }
        Ok(())
    }

    /// SIGTERM, a bounded wait, then SIGKILL to the group.
    pub fn stop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
            let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// A free port on 127.0.0.1 (bound, then released).
pub fn free_port() -> Result<u16, BenchError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A running coordinator on 127.0.0.1.
#[derive(Debug)]
pub struct Coordinator {
    pub proc: Proc,
    pub url: String,
}

/// Starts `toolsrv coordinator` serving `tools` on a free loopback port and waits (at most 20 s)
/// until it accepts connections.
pub fn start_coordinator(
    paths: &Paths,
    name: &str,
    tools: &Path,
) -> Result<Coordinator, BenchError> {
    let port = free_port()?;
    let mut cmd = Command::new(paths.toolsrv());
    cmd.arg("coordinator")
        .arg(format!("--listen=127.0.0.1:{port}"))
        .arg(format!("--tools={}", tools.display()))
        .args(paths.tls_args(&Identity::Coordinator))
        // The benches drive the fleet from one client on purpose: no per-client quota.
        .args([
            "--max-calls-per-client=100000",
            "--max-calls-per-client-host=100000",
            "--max-fanout-hosts=100000",
        ])
        .env("TOOLSRV_LOG", "warn");
    let mut proc = Proc::spawn(name, cmd, &paths.work)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        proc.check_alive()?;
        if Instant::now() > deadline {
            return Err(format!("{name} did not listen on 127.0.0.1:{port} within 20 s").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Coordinator {
        proc,
        url: format!("https://127.0.0.1:{port}"),
    })
}

/// Starts `toolsrv agent` as host `id` against `url`, with its own state directory and `extra`
/// flags (`--max-concurrent-calls=64`, `--output-cap=...`, `--tools=...`).
pub fn start_agent(
    paths: &Paths,
    url: &str,
    id: &str,
    extra: &[String],
) -> Result<Proc, BenchError> {
    start_agent_limited(paths, url, id, extra, None)
}

/// [`start_agent`], optionally under `prlimit --as=BYTES` (a cap on its address space, so an agent
/// that tries to hold a huge output in memory fails instead of exhausting the machine).
pub fn start_agent_limited(
    paths: &Paths,
    url: &str,
    id: &str,
    extra: &[String],
    address_space: Option<u64>,
) -> Result<Proc, BenchError> {
    let home = paths.work.join(format!("host-{id}"));
    std::fs::create_dir_all(&home)?;
    let mut cmd = match address_space {
        Some(bytes) => {
            let mut c = Command::new("prlimit");
            c.arg(format!("--as={bytes}"))
                .arg("--")
                .arg(paths.toolsrv());
            c
        }
        None => Command::new(paths.toolsrv()),
    };
    cmd.arg("agent")
        .arg(format!("--coordinator={url}"))
        .arg(format!("--host-id={id}"))
        .args(paths.tls_args(&Identity::Agent(id.into())))
        .arg(format!("--state-dir={}", home.join("state").display()))
        .arg(format!("--workdir={}", home.display()))
        .args(extra)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", &home)
        .env("TOOLSRV_LOG", "warn");
    Proc::spawn(&format!("agent-{id}"), cmd, &paths.work)
}

/// Connects the library client as `bench` (the TLS layer bounds the connect to 5 s).
pub async fn connect(paths: &Paths, url: &str) -> Result<Client, BenchError> {
    let opts = ConnectOptions {
        addr: url.to_string(),
        tls: paths.client_tls(),
    };
    Ok(Client::connect(&opts).await?)
}

/// `client.hosts()`, bounded to 10 s.
pub async fn hosts(client: &Client) -> Result<Vec<HostInfo>, BenchError> {
    tokio::time::timeout(Duration::from_secs(10), client.hosts())
        .await
        .map_err(|_| "ListHosts: no answer within 10 s")?
        .map_err(Into::into)
}

/// Waits (at most `limit`) until host `id` is online and offers `tool`.
pub async fn wait_for_tool(
    client: &Client,
    id: &str,
    tool: &str,
    limit: Duration,
) -> Result<HostInfo, BenchError> {
    let started = Instant::now();
    loop {
        let hosts = hosts(client).await?;
        if let Some(host) = hosts
            .into_iter()
            .find(|h| h.host_id == id && h.state == HostState::Online as i32)
            && let Ok(Ok(tools)) =
                tokio::time::timeout(Duration::from_secs(10), client.tools(id, false)).await
            && tools.tools.iter().any(|t| t.name == tool)
        {
            return Ok(host);
        }
        if started.elapsed() > limit {
            return Err(format!("host {id} did not offer {tool} within {limit:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes a tools directory with one `cmd` tool per `(name, cmd)`.
pub fn write_tools(dir: &Path, tools: &[(&str, &str)]) -> Result<(), BenchError> {
    std::fs::create_dir_all(dir)?;
    for (name, cmd) in tools {
        let meta = serde_json::json!({
            "description": format!("fleet bench tool: {cmd}"),
            "cmd": cmd,
            "args": {"type": "object"},
        });
        std::fs::write(dir.join(format!("{name}.meta")), meta.to_string())?;
    }
    Ok(())
}

/// What a [`MemSampler`] saw of one process.
#[derive(Debug, Clone, Default)]
pub struct Sampled {
    pub name: String,
    /// Largest VmRSS seen.
    pub max_rss_kib: u64,
    /// The last VmHWM read (the kernel's own peak).
    pub hwm_kib: u64,
    /// The process disappeared while being sampled.
    pub vanished: bool,
}

/// Samples the memory of some processes on a thread, every `every`, until stopped, so a peak
/// is known even for a process that dies.
#[derive(Debug)]
pub struct MemSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<Sampled>>>,
}

impl MemSampler {
    pub fn start(pids: Vec<(String, String)>, every: Duration) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen: Vec<Sampled> = pids
                .iter()
                .map(|(name, _)| Sampled {
                    name: name.clone(),
                    ..Sampled::default()
                })
                .collect();
            loop {
                for (s, (_, pid)) in seen.iter_mut().zip(&pids) {
                    if s.vanished {
                        continue;
                    }
                    match mem_of(pid) {
                        Ok(m) => {
                            s.max_rss_kib = s.max_rss_kib.max(m.rss_kib);
                            s.hwm_kib = m.hwm_kib;
                        }
                        Err(_) => s.vanished = true,
                    }
                }
                if flag.load(std::sync::atomic::Ordering::Relaxed) {
                    return seen;
                }
                std::thread::sleep(every);
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    pub fn stop(mut self) -> Vec<Sampled> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for MemSampler {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// CPU time a process used so far (user + system), including children it has waited for (an
/// agent's tool processes), from `/proc/PID/stat` (`"self"` for this process).
pub fn cpu_of(pid: &str) -> Result<(Duration, Duration), BenchError> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = stat
        .rsplit_once(") ")
        .map(|(_, r)| r)
        .ok_or("malformed /proc/PID/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime, stime, cutime, cstime are fields 14-17 of stat(5), i.e. 11-14 after the name.
    let ticks = |i: usize| -> Result<u64, BenchError> {
        Ok(fields
            .get(i)
            .ok_or("short /proc/PID/stat")?
            .parse::<u64>()?)
    };
    // USER_HZ is 100 on Linux for every architecture this runs on.
    let hz = 100;
    let own = ticks(11)? + ticks(12)?;
    let children = ticks(13)? + ticks(14)?;
    Ok((
        Duration::from_millis(own * 1000 / hz),
        Duration::from_millis(children * 1000 / hz),
    ))
}
