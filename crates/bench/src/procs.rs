//! Real `toolsrv coordinator` and `toolsrv agent` processes on 127.0.0.1 for the fleet bench
//! (started with `toolsrv-testkit`'s command lines), the paths they need, and their memory as
//! `/proc/PID/status` reports it.
//!
//! Every process runs in its own process group and is killed with it when its handle drops;
//! every wait is bounded.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use toolsrv_client::{Client, ConnectOptions, HostInfo, HostState};
use toolsrv_testkit::{AgentLaunch, CoordinatorLaunch, Proc, try_free_port};
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
        self.tls(&Identity::Client(CLIENT.into()))
    }

    /// The certificate files of `identity`.
    pub fn tls(&self, identity: &Identity) -> TlsFiles {
        TlsFiles::in_dir(&self.pki, identity)
    }
}

/// The release binaries next to this bench executable (`target/release/deps/fleet-*` → `target/release`).
pub fn default_bin_dir() -> Option<PathBuf> {
    toolsrv_testkit::profile_dir()
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

/// The memory of a running [`Proc`].
pub trait ProcMem {
    fn mem(&self) -> Result<Mem, BenchError>;
}

impl ProcMem for Proc {
    fn mem(&self) -> Result<Mem, BenchError> {
        mem_of(&self.pid().to_string())
    }
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
    // The benches drive the fleet from one client on purpose: no per-client quota.
    let args = [
        "--max-calls-per-client=100000",
        "--max-calls-per-client-host=100000",
        "--max-fanout-hosts=100000",
    ]
    .map(String::from);
    start_coordinator_on(paths, name, tools, (try_free_port()?, "warn"), &args)
}

/// Starts `toolsrv coordinator` serving `tools` on loopback port `port` with the flags `args`
/// and `TOOLSRV_LOG=log`, and waits (at most 20 s) until it accepts connections.
pub fn start_coordinator_on(
    paths: &Paths,
    name: &str,
    tools: &Path,
    (port, log): (u16, &str),
    args: &[String],
) -> Result<Coordinator, BenchError> {
    let mut launch = CoordinatorLaunch::new(port, tools, paths.tls(&Identity::Coordinator));
    launch.args = args.to_vec();
    launch.log = log.into();
    let proc = launch.start(&paths.toolsrv(), name, &paths.work)?;
    Ok(Coordinator {
        proc,
        url: launch.url(),
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
    let mut launch = AgentLaunch::new(id, url, paths.tls(&Identity::Agent(id.into())), &home);
    launch.args = extra.to_vec();
    launch.log = "warn".into();
    launch.address_space = address_space;
    Ok(launch.start(&paths.toolsrv(), &paths.work)?)
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
