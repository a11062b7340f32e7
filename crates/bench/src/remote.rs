//! The measured operations of the fleet bench: one remote call by `toolctl`, by `ssh` over a
//! master connection, and by the library; calls from many concurrent callers; a fan-out; a
//! streamed call. Each returns what it timed and checks the outcome, so a broken setup fails
//! instead of producing fast numbers.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::process::Command;
use toolsrv_client::{CallRequest, CallUpdate, Client, FanOutRequest, FanOutSummary, FanOutUpdate};

use crate::BenchError;
use crate::procs::Paths;
use toolsrv_testkit::{Proc, client_env};

/// The script of the trivial tool, and what the baselines run.
pub const SCRIPT: &str = crate::call::SCRIPT;
/// The most trivial tool there is: one shell, no other process, stdin left unread.
pub const BARE_SCRIPT: &str = "echo ok";
/// How long any one spawned command may take before the bench gives up on it.
const COMMAND_LIMIT: Duration = Duration::from_secs(30);

/// Runs a command with `stdin` fed and closed, bounded by [`COMMAND_LIMIT`]; checks it exited 0
/// (and printed `expect`, when given); returns the wall time from spawn to exit.
async fn timed_command(
    mut cmd: Command,
    stdin: &[u8],
    expect: Option<&[u8]>,
    what: &str,
) -> Result<Duration, BenchError> {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("{what}: cannot start: {e}"))?;
    let mut input = child.stdin.take().ok_or("no stdin")?;
    input.write_all(stdin).await?;
    drop(input);
    let out = tokio::time::timeout(COMMAND_LIMIT, child.wait_with_output())
        .await
        .map_err(|_| format!("{what}: no answer within {COMMAND_LIMIT:?}"))??;
    let elapsed = started.elapsed();
    if !out.status.success() || expect.is_some_and(|e| out.stdout != e) {
        return Err(format!(
            "{what} failed: {}, stdout {:?}, stderr {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(elapsed)
}

/// How a fresh `toolctl` process reaches the coordinator.
#[derive(Debug, Clone, Copy)]
pub enum Route<'a> {
    /// Its own connection: certificates from the environment, as a user would set them.
    Direct(&'a str),
    /// Through the control socket of a running `toolctl master`, no certificates.
    Master(&'a Path),
}

impl Route<'_> {
    fn apply(self, paths: &Paths, cmd: &mut std::process::Command) {
        match self {
            Route::Direct(url) => {
                cmd.envs(client_env(url, &paths.client_tls()));
            }
            Route::Master(socket) => {
                cmd.env("TOOLSRV_CONTROL", socket);
            }
        }
    }
}

/// `toolctl call HOST TOOL` as a fresh process, arguments defaulting to `{}`; checks it printed `ok`.
pub async fn toolctl_call(
    paths: &Paths,
    route: Route<'_>,
    host: &str,
    tool: &str,
) -> Result<Duration, BenchError> {
    let mut cmd = Command::new(paths.toolctl());
    cmd.args(["call", host, tool]);
    route.apply(paths, cmd.as_std_mut());
    timed_command(cmd, b"", Some(b"ok\n"), "toolctl call").await
}

/// Starts `toolctl master` for `url` on a control socket in the work directory and waits (at most
/// 10 s) until it serves.
pub async fn start_master(paths: &Paths, url: &str) -> Result<(Proc, PathBuf), BenchError> {
    let socket = paths.work.join("toolctl-master.sock");
    let mut cmd = std::process::Command::new(paths.toolctl());
    cmd.args(["master", "--control"]).arg(&socket);
    Route::Direct(url).apply(paths, &mut cmd);
    let mut master = Proc::try_spawn("toolctl-master", cmd, &paths.work)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        master.check_alive()?;
        if Instant::now() > deadline {
            return Err(format!(
                "toolctl master did not serve within 10 s: {}",
                master.log_tail(15)
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((master, socket))
}

/// In this process: load the certificates, connect (TCP, TLS 1.3 with client certificate,
/// HTTP/2) and make one RPC, as `toolctl hosts` does after its process has started.
pub async fn connect_and_list(paths: &Paths, url: &str) -> Result<Duration, BenchError> {
    let started = Instant::now();
    let listed = async {
        let client = crate::procs::connect(paths, url).await?;
        client.hosts().await?;
        Ok::<_, BenchError>(())
    };
    tokio::time::timeout(COMMAND_LIMIT, listed)
        .await
        .map_err(|_| "connect and list: no answer within 30 s")??;
    Ok(started.elapsed())
}

/// Spawning `/bin/true` the same way: the floor of any fresh-process client.
pub async fn spawn_floor() -> Result<Duration, BenchError> {
    timed_command(Command::new("/bin/true"), b"", None, "/bin/true").await
}

/// Breakdown of a `toolctl call`: `toolctl --version` (process start and exit only) and
/// `toolctl hosts` (plus connecting by `route` and one RPC).
pub async fn toolctl_parts(
    paths: &Paths,
    route: Route<'_>,
) -> Result<(Duration, Duration), BenchError> {
    let mut version = Command::new(paths.toolctl());
    version.arg("--version");
    let version = timed_command(version, b"", None, "toolctl --version").await?;
    let mut hosts = Command::new(paths.toolctl());
    hosts.arg("hosts");
    route.apply(paths, hosts.as_std_mut());
    let hosts = timed_command(hosts, b"", None, "toolctl hosts").await?;
    Ok((version, hosts))
}

/// An ssh destination with a master connection already open (set up by `fleet-bench.sh`).
#[derive(Debug, Clone)]
pub struct SshTarget {
    /// `ssh -F` config naming the host, key, port and `ControlPath`.
    pub config: PathBuf,
    /// The `Host` alias in that config.
    pub host: String,
}

impl SshTarget {
    /// From `FLEET_SSH_CONFIG` and `FLEET_SSH_HOST`; otherwise why the comparison is skipped
    /// (`FLEET_SSH_SKIP` carries the script's reason).
    pub fn from_env() -> Result<Self, String> {
        if let Ok(reason) = std::env::var("FLEET_SSH_SKIP") {
            return Err(reason);
        }
        match (
            std::env::var_os("FLEET_SSH_CONFIG"),
            std::env::var("FLEET_SSH_HOST"),
        ) {
            (Some(config), Ok(host)) => Ok(Self {
                config: config.into(),
                host,
            }),
            _ => Err("no sshd set up: FLEET_SSH_CONFIG/FLEET_SSH_HOST unset \
                      (crates/bench/fleet-bench.sh sets them)"
                .into()),
        }
    }
}

/// `ssh HOST SCRIPT` over the master connection, `{}` on stdin (what a tool gets).
pub async fn ssh_call(target: &SshTarget, script: &str) -> Result<Duration, BenchError> {
    let mut cmd = Command::new("ssh");
    cmd.arg("-F")
        .arg(&target.config)
        .args(["-T", &target.host, script]);
    timed_command(cmd, b"{}", Some(b"ok\n"), "ssh").await
}

/// One call through the library on an open connection, to its result.
pub async fn library_call(client: &Client, host: &str, tool: &str) -> Result<Duration, BenchError> {
    let started = Instant::now();
    let call = client.call_to_end(CallRequest {
        host: host.into(),
        tool: tool.into(),
        ..CallRequest::default()
    });
    let outcome = tokio::time::timeout(COMMAND_LIMIT, call)
        .await
        .map_err(|_| format!("library call: no result within {COMMAND_LIMIT:?}"))??;
    let elapsed = started.elapsed();
    if !toolsrv_client::is_ok(outcome.result.status) || outcome.stdout != b"ok\n" {
        return Err(format!(
            "library call failed: {} {:?}, stdout {:?}",
            toolsrv_client::status_name(outcome.result.status),
            outcome.result.message,
            String::from_utf8_lossy(&outcome.stdout)
        )
        .into());
    }
    Ok(elapsed)
}

/// What `callers` concurrent callers achieved in a fixed time.
#[derive(Debug, Clone)]
pub struct Throughput {
    pub calls: usize,
    pub elapsed: Duration,
    /// Latency of every call, as each caller saw it.
    pub latencies: Vec<Duration>,
}

impl Throughput {
    pub fn per_sec(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }
}

/// `callers` tasks calling `tool` on `host` back to back over one shared connection for
/// `duration` (each finishes the call it is in).
pub async fn concurrent_calls(
    client: &Client,
    host: &str,
    tool: &str,
    callers: usize,
    duration: Duration,
) -> Result<Throughput, BenchError> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    for _ in 0..callers {
        let (client, host, tool, stop) = (
            client.clone(),
            host.to_string(),
            tool.to_string(),
            stop.clone(),
        );
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                latencies.push(library_call(&client, &host, &tool).await?);
            }
            Ok::<_, BenchError>(latencies)
        });
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    let joined = tokio::time::timeout(COMMAND_LIMIT, async {
        while let Some(done) = tasks.join_next().await {
            latencies.extend(done??);
        }
        Ok::<_, BenchError>(())
    })
    .await;
    let elapsed = started.elapsed();
    match joined {
        Err(_) => return Err("concurrent callers did not stop in time".into()),
        Ok(r) => r?,
    }
    Ok(Throughput {
        calls: latencies.len(),
        elapsed,
        latencies,
    })
}

/// One fan-out timed from the request to the summary.
#[derive(Debug, Clone, Copy)]
pub struct FanOutTiming {
    /// From sending the request to receiving the summary.
    pub end_to_end: Duration,
    /// Until the first host's result arrived.
    pub first_result: Duration,
    /// The coordinator's own `duration_ms`.
    pub summary: FanOutSummary,
}

/// Fans `tool` out to `selector` and checks every one of `expected` hosts answered OK.
pub async fn fan_out(
    client: &Client,
    selector: &str,
    tool: &str,
    expected: usize,
) -> Result<FanOutTiming, BenchError> {
    let started = Instant::now();
    let mut stream = client
        .fan_out(FanOutRequest {
            selector: selector.into(),
            tool: tool.into(),
            ..FanOutRequest::default()
        })
        .await?;
    let mut first_result = None;
    let mut results = 0;
    let deadline = started + COMMAND_LIMIT;
    loop {
        let event = tokio::time::timeout_at(deadline.into(), stream.next())
            .await
            .map_err(|_| "fan-out: no summary within 30 s")?;
        match event {
            None => return Err("fan-out ended without a summary".into()),
            Some(event) => match event?.event {
                // The benches run without a policy: nothing asks for approval.
                FanOutUpdate::Output(_) | FanOutUpdate::Approval(_) => {}
                FanOutUpdate::Result(r) => {
                    first_result.get_or_insert_with(|| started.elapsed());
                    results += 1;
                    if !toolsrv_client::is_ok(r.status) {
                        return Err(format!("fan-out: a host failed: {}", r.message).into());
                    }
                }
                FanOutUpdate::Summary(summary) => {
                    let end_to_end = started.elapsed();
                    if summary.targeted as usize != expected
                        || summary.ok as usize != expected
                        || results != expected
                    {
                        return Err(format!(
                            "fan-out: expected {expected} hosts OK, got {summary:?} and {results} results"
                        )
                        .into());
                    }
                    return Ok(FanOutTiming {
                        end_to_end,
                        first_result: first_result.unwrap_or(end_to_end),
                        summary,
                    });
                }
            },
        }
    }
}

/// One streamed call: bytes received without keeping them.
#[derive(Debug, Clone)]
pub struct Streamed {
    pub bytes: u64,
    pub chunks: u64,
    pub first_byte: Duration,
    /// When the last output byte arrived.
    pub last_byte: Duration,
    /// When the result arrived.
    pub elapsed: Duration,
    /// The result's status name (`ok`, `lost`, ...) and message.
    pub status: String,
    pub message: String,
    pub truncated: bool,
}

impl Streamed {
    /// Output throughput in MB/s (10^6 bytes per second), up to the last byte.
    pub fn mb_per_sec(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.last_byte.as_secs_f64()
    }

    pub fn ok(&self) -> bool {
        self.status == "ok"
    }
}

/// Calls `tool` and counts its stdout as it streams (nothing is kept: the client's memory stays
/// bounded), until the result. Fails unless exactly `expected` bytes arrived; the result itself is
/// reported, not checked. `at_last_byte` runs when the last expected byte has arrived.
pub async fn stream_call(
    client: &Client,
    host: &str,
    tool: &str,
    expected: u64,
    limit: Duration,
    at_last_byte: &mut dyn FnMut(),
) -> Result<Streamed, BenchError> {
    let started = Instant::now();
    let mut stream = client
        .call(CallRequest {
            host: host.into(),
            tool: tool.into(),
            timeout_ms: limit.as_millis() as u64,
            ..CallRequest::default()
        })
        .await?;
    let (mut bytes, mut chunks, mut first_byte, mut last_byte) = (0u64, 0u64, None, None);
    let deadline = started + limit;
    loop {
        let event = tokio::time::timeout_at(deadline.into(), stream.next())
            .await
            .map_err(|_| format!("stream: not done within {limit:?} ({bytes} bytes so far)"))?;
        let (status, message, truncated) = match event {
            None => (
                "none".to_string(),
                "stream ended without a result".to_string(),
                false,
            ),
            Some(Err(e)) => ("error".to_string(), e.to_string(), false),
            // The benches run without a policy: nothing asks for approval.
            Some(Ok(CallUpdate::Approval(_))) => continue,
            Some(Ok(CallUpdate::Output(chunk))) => {
                first_byte.get_or_insert_with(|| started.elapsed());
                bytes += chunk.data.len() as u64;
                chunks += 1;
                if bytes >= expected && last_byte.is_none() {
                    last_byte = Some(started.elapsed());
                    at_last_byte();
                }
                continue;
            }
            Some(Ok(CallUpdate::Result(result))) => (
                toolsrv_client::status_name(result.status).to_string(),
                result.message,
                result.truncated,
            ),
        };
        let elapsed = started.elapsed();
        if bytes != expected {
            return Err(format!(
                "stream: {bytes} of {expected} bytes arrived, then {status}: {message}"
            )
            .into());
        }
        return Ok(Streamed {
            bytes,
            chunks,
            first_byte: first_byte.unwrap_or(elapsed),
            last_byte: last_byte.unwrap_or(elapsed),
            elapsed,
            status,
            message,
            truncated,
        });
    }
}
