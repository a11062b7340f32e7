//! The call overhead benchmark: a local toolsrv call against spawning the same shell script directly.

use std::ffi::OsString;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;
use toolsrv_confine::{CallPlan, Confiner, Settings};
use toolsrv_exec::{Event, Invocation, Stream};
use toolsrv_host::{CallRequest, Limits, prepare, start};
use toolsrv_meta::Host;
use toolsrv_registry::{Catalog, Scanner};

use crate::BenchError;

/// What the tool and the baseline run: read all of stdin, answer `ok`.
pub const SCRIPT: &str = "cat >/dev/null; echo ok";
/// The tool's name in the fixture's tools directory.
pub const TOOL: &str = "echo_ok";

/// A tools directory holding one tool whose `cmd` is [`SCRIPT`], scanned once, and the call
/// `toolctl local call echo_ok` would make (default limits, `{}` arguments, this environment).
#[derive(Debug)]
pub struct CallFixture {
    dir: TempDir,
    catalog: Catalog,
    host: Host,
    base_env: Vec<(OsString, OsString)>,
    limits: Limits,
    request: CallRequest,
}

impl CallFixture {
    pub fn new() -> Result<Self, BenchError> {
        let dir = tempfile::tempdir()?;
        let meta = json!({
            "description": "Answers ok after reading its arguments",
            "cmd": SCRIPT,
            "args": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "limit": {"type": "integer", "minimum": 1},
                    "level": {"enum": ["info", "warn", "error"]},
                },
                "additionalProperties": false,
            },
        });
        std::fs::write(dir.path().join(format!("{TOOL}.meta")), meta.to_string())?;
        let (catalog, host) = load(dir.path());
        if !catalog.tools.contains_key(TOOL) {
            return Err(format!("fixture tool not loaded: {:?}", catalog.diagnostics).into());
        }
        let request = CallRequest {
            tool: TOOL.to_string(),
            args: json!({}),
            args_text: None,
            cwd: dir.path().to_path_buf(),
            timeout: Some(Duration::from_secs(60)),
        };
        Ok(Self {
            base_env: std::env::vars_os().collect(),
            limits: Limits::default(),
            catalog,
            host,
            request,
            dir,
        })
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// What `toolctl local call` does once per process before the call: host facts and a scan.
pub fn load(tools_dir: &Path) -> (Catalog, Host) {
    let host = Host::current();
    let catalog = Scanner::new(vec![tools_dir.to_path_buf()]).scan();
    (catalog, host)
}

/// Times [`load`] of the fixture's tools directory.
pub fn timed_load(fixture: &CallFixture) -> Duration {
    let started = Instant::now();
    std::hint::black_box(load(fixture.dir()));
    started.elapsed()
}

/// How the direct spawn is set up; the default is the baseline, the rest replay one by one
/// what toolsrv's exec crate adds, to attribute the overhead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpawnSetup {
    /// `process_group(0)`: the child leads a new process group.
    pub process_group: bool,
    /// `env_clear()` and the environment passed back explicitly.
    pub explicit_env: bool,
    /// `current_dir(...)`.
    pub cwd: bool,
    /// stderr piped and read, instead of `/dev/null`.
    pub pipe_stderr: bool,
}

impl SpawnSetup {
    /// Everything toolsrv's exec crate sets on the command.
    pub const LIKE_EXEC: Self = Self {
        process_group: true,
        explicit_env: true,
        cwd: true,
        pipe_stderr: true,
    };
}

/// The baseline: `/bin/sh -c SCRIPT` with tokio, `{}` written to stdin which is then closed,
/// stdout captured, awaiting the output (with `setup` adding toolsrv's spawn options).
///
/// Equivalent to `wait_with_output` (which also joins the exit and the pipe reads), but reads
/// stdout itself to note when the first bytes arrive.
pub async fn direct_spawn(
    fixture: &CallFixture,
    setup: SpawnSetup,
) -> Result<CallPhases, BenchError> {
    let started = Instant::now();
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(SCRIPT)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(if setup.pipe_stderr {
            Stdio::piped()
        } else {
            Stdio::null()
        });
    if setup.process_group {
        cmd.process_group(0);
    }
    if setup.explicit_env {
        cmd.env_clear().envs(fixture.base_env.iter().cloned());
    }
    if setup.cwd {
        cmd.current_dir(fixture.dir());
    }
    let mut child = cmd.spawn()?;
    let spawned = started.elapsed();
    let mut stdin = child.stdin.take().ok_or("baseline child has no stdin")?;
    let mut stdout = child.stdout.take().ok_or("baseline child has no stdout")?;
    let stderr = child.stderr.take();
    stdin.write_all(b"{}").await?;
    drop(stdin);
    let read_stdout = async {
        let (mut buf, mut first) = (Vec::new(), None);
        while stdout.read_buf(&mut buf).await? > 0 {
            first.get_or_insert_with(|| started.elapsed());
        }
        Ok::<_, std::io::Error>((buf, first))
    };
    let read_stderr = async {
        let mut buf = Vec::new();
        if let Some(mut stderr) = stderr {
            stderr.read_to_end(&mut buf).await?;
        }
        Ok::<_, std::io::Error>(buf)
    };
    let (status, out, _) = tokio::try_join!(child.wait(), read_stdout, read_stderr)?;
    let finished = started.elapsed();
    let (stdout, output) = out;
    if !status.success() || stdout != b"ok\n" {
        return Err(format!("baseline call failed: {status}, stdout {stdout:?}").into());
    }
    Ok(CallPhases {
        prepared: Duration::ZERO,
        started: spawned,
        output: output.unwrap_or(finished),
        finished,
    })
}

/// Moments of one call, each measured from its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallPhases {
    /// toolsrv: `prepare` returned (tool found, variants resolved, arguments validated, command
    /// resolved). Zero for a direct spawn.
    pub prepared: Duration,
    /// The process is spawned (toolsrv: `start` returned, supervisor tasks running).
    pub started: Duration,
    /// The stdout bytes `ok` arrived.
    pub output: Duration,
    /// The call is over (toolsrv: `Finished` arrived; direct: exit and both pipes at EOF).
    pub finished: Duration,
}

/// One local call the way `toolctl local call` makes it (minus printing and its Ctrl-C
/// listener): `prepare`, `start`, then draining the events until `Finished`.
pub async fn toolsrv_call(fixture: &CallFixture) -> Result<CallPhases, BenchError> {
    let started = Instant::now();
    let invocation = prepare(
        &fixture.catalog,
        &fixture.host,
        &fixture.request,
        &fixture.limits,
        &fixture.base_env,
    )?;
    run_prepared(started, invocation, "toolsrv").await
}

/// Runs a prepared invocation to its `Finished` event, timing each phase from `started`;
/// `what` names the kind of call in the error when it does not print `ok`.
async fn run_prepared(
    started: Instant,
    invocation: Invocation,
    what: &str,
) -> Result<CallPhases, BenchError> {
    let prepared = started.elapsed();
    let mut execution = start(TOOL, invocation, CancellationToken::new())?;
    let spawned = started.elapsed();
    let mut stdout = Vec::new();
    let mut output = None;
    let outcome = loop {
        match execution.next().await {
            Some(Event::Output {
                stream: Stream::Stdout,
                data,
            }) => {
                output.get_or_insert_with(|| started.elapsed());
                stdout.extend_from_slice(&data);
            }
            Some(Event::Output { .. }) => {}
            Some(Event::Finished(outcome)) => break outcome,
            None => return Err("the call ended without a Finished event".into()),
        }
    };
    let finished = started.elapsed();
    if !outcome.success() || stdout != b"ok\n" {
        return Err(format!("{what} call failed: {outcome:?}, stdout {stdout:?}").into());
    }
    Ok(CallPhases {
        prepared,
        started: spawned,
        output: output.unwrap_or(finished),
        finished,
    })
}

/// A confiner as an agent sets one up (best effort, default limits), with its calls'
/// directories in `call_dir`; `hidden` are the private files to carve out (a path under `/etc`
/// makes every call's rules list `/etc` entry by entry).
pub fn confiner(call_dir: &Path, hidden: Vec<std::path::PathBuf>) -> Result<Confiner, BenchError> {
    let mut settings = Settings::new(hidden);
    settings.call_dir = call_dir.to_path_buf();
    Ok(Confiner::new(settings).map_err(|e| e.to_string())?)
}

/// [`toolsrv_call`], confined the way the agent confines a call: the jail is prepared after
/// `prepare` (private directory, cgroups, Landlock rules, environment) and released before
/// `Finished` (processes ended, cgroups and directory removed).
pub async fn confined_call(
    fixture: &CallFixture,
    confiner: &Confiner,
) -> Result<CallPhases, BenchError> {
    let started = Instant::now();
    let mut invocation = prepare(
        &fixture.catalog,
        &fixture.host,
        &fixture.request,
        &fixture.limits,
        &fixture.base_env,
    )?;
    let prepared = confiner
        .prepare(&CallPlan {
            tool_dir: fixture.dir(),
            cwd: None,
            grant: None,
            agent_env: &fixture.base_env,
            timeout: invocation.timeout,
        })
        .map_err(|e| e.to_string())?;
    if let Some(cwd) = prepared.cwd {
        invocation.cwd = cwd;
    }
    if let Some(env) = prepared.env {
        invocation.env = env;
    }
    invocation.jail = Some(Arc::new(prepared.jail));
    run_prepared(started, invocation, "confined").await
}

/// Times the confiner alone, no process: preparing a call's jail, then releasing it.
pub fn jail_only(
    fixture: &CallFixture,
    confiner: &Confiner,
) -> Result<(Duration, Duration), BenchError> {
    let started = Instant::now();
    let prepared = confiner
        .prepare(&CallPlan {
            tool_dir: fixture.dir(),
            cwd: None,
            grant: None,
            agent_env: &fixture.base_env,
            timeout: Duration::from_secs(60),
        })
        .map_err(|e| e.to_string())?;
    let set_up = started.elapsed();
    let released = Instant::now();
    prepared.jail.release();
    Ok((set_up, released.elapsed()))
}

/// Times `prepare` alone (no process), repeated `batch` times.
pub fn prepare_batch(fixture: &CallFixture, batch: usize) -> Result<Duration, BenchError> {
    let started = Instant::now();
    for _ in 0..batch {
        std::hint::black_box(prepare(
            &fixture.catalog,
            &fixture.host,
            &fixture.request,
            &fixture.limits,
            &fixture.base_env,
        )?);
    }
    Ok(started.elapsed())
}

/// One interleaved pair: the baseline and the toolsrv call, in the order `baseline_first` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    pub baseline: CallPhases,
    pub toolsrv: CallPhases,
}

impl Pair {
    /// toolsrv minus baseline, in nanoseconds (negative when toolsrv was faster this time).
    pub fn overhead_ns(&self) -> f64 {
        self.phase_overhead_ns(|p| p.finished)
    }

    /// toolsrv minus baseline at one phase, in nanoseconds.
    pub fn phase_overhead_ns(&self, phase: fn(&CallPhases) -> Duration) -> f64 {
        phase(&self.toolsrv).as_nanos() as f64 - phase(&self.baseline).as_nanos() as f64
    }
}

pub async fn pair(fixture: &CallFixture, baseline_first: bool) -> Result<Pair, BenchError> {
    let (baseline, toolsrv) = if baseline_first {
        let b = direct_spawn(fixture, SpawnSetup::default()).await?;
        (b, toolsrv_call(fixture).await?)
    } else {
        let t = toolsrv_call(fixture).await?;
        (direct_spawn(fixture, SpawnSetup::default()).await?, t)
    };
    Ok(Pair { baseline, toolsrv })
}

/// `count` interleaved pairs, alternating which of the two goes first so neither always
/// profits from the other warming caches.
pub async fn pairs(fixture: &CallFixture, count: usize) -> Result<Vec<Pair>, BenchError> {
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        out.push(pair(fixture, i % 2 == 0).await?);
    }
    Ok(out)
}
