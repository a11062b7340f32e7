//! Starting a tool call and supervising it to the end: timeout, cancellation, group kill, reaping

use std::io;
use std::pin::Pin;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::io::AsyncWrite;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, sleep, sleep_until};
use tokio_util::sync::{CancellationToken, DropGuard};
use toolsrv_confine::CallJail;

use crate::child::{Child, Started};
use crate::error::{ExecError, os_reason};
use crate::event::{Ending, Event, Exit, Outcome, Stream};
use crate::group::{group_has_live_members, signal_group};
use crate::invocation::{Invocation, Program, SHELL};
use crate::output::{Capture, pump};
use crate::result::outcome_result;

/// Events buffered between the pipe readers and the consumer; small, so a slow
/// consumer quickly stalls the tool instead of growing memory
const CHANNEL_CAPACITY: usize = 16;
/// How often to look whether a group that got SIGTERM has emptied
const GROUP_POLL: Duration = Duration::from_millis(20);
/// After killing a call, how long its output may still drain before the readers
/// are stopped (a process that left the group could keep a pipe open forever)
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(1);

/// A running tool call
///
/// Yields [`Event::Output`] chunks, then one [`Event::Finished`]. Dropping it
/// cancels the call: the process group is killed and reaped in the background.
#[derive(Debug)]
pub struct Execution {
    events: mpsc::Receiver<Event>,
    pid: u32,
    _cancel_on_drop: DropGuard,
    // Kept so the supervisor is owned; it ends on its own once the call is over.
    _supervisor: JoinHandle<()>,
}

impl Execution {
    /// The next event; `None` after [`Event::Finished`] has been returned
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// The tool's process id, which is also its process group id
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The events as a `Stream`; dropping the stream cancels the call like dropping `self`
    pub fn into_stream(self) -> EventStream {
        EventStream { execution: self }
    }
}

/// The events of an [`Execution`] as a [`tokio_stream::Stream`]
#[derive(Debug)]
pub struct EventStream {
    execution: Execution,
}

impl tokio_stream::Stream for EventStream {
    type Item = Event;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        self.get_mut().execution.events.poll_recv(cx)
    }
}

/// Starts a tool call; must be called from within a tokio runtime
///
/// The tool becomes the leader of a new process group with piped stdio and a
/// cleared environment. Cancelling `cancel` (or dropping the returned
/// [`Execution`]) ends the call with [`Ending::Cancelled`].
///
/// Tools' background processes do not survive the call: when the tool exits,
/// whatever is left in its process group is killed with SIGKILL; on timeout or
/// cancellation the group gets SIGTERM, then SIGKILL after `kill_grace`. The
/// tool is always reaped.
pub fn spawn(inv: Invocation, cancel: CancellationToken) -> Result<Execution, ExecError> {
    let program = inv.program.executable();
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(ExecError::NoRuntime { program });
    }
    check_cwd(&inv)?;

    let started = Instant::now();
    let Started {
        child,
        pid,
        stdin,
        stdout,
        stderr,
    } = start(&inv, &program)?;
    // From here on, an early return drops `child`, which kills it and reaps it in the
    // background; nothing else has started yet.
    let pgid = Pid::from_raw(i32::try_from(pid).map_err(|_| ExecError::Spawn {
        program: program.clone(),
        reason: format!("process id {pid} is out of range"),
        source: io::Error::other("process id out of range"),
    })?);

    let (tx, events) = mpsc::channel(CHANNEL_CAPACITY);
    let capture = Arc::new(Capture::new(inv.output_cap, inv.result_cap));
    let cancel = cancel.child_token();
    let mut readers = JoinSet::new();
    readers.spawn(pump(stdout, Stream::Stdout, capture.clone(), tx.clone()));
    readers.spawn(pump(stderr, Stream::Stderr, capture.clone(), tx.clone()));
    let call = Call {
        stdin_task: tokio::spawn(feed_stdin(stdin, inv.stdin)),
        readers,
        child,
        pgid,
        tx,
        cancel: cancel.clone(),
        capture,
        started,
        timeout: inv.timeout,
        kill_grace: inv.kill_grace,
        jail: inv.jail,
    };
    tracing::debug!(pid, program, "tool started");
    Ok(Execution {
        events,
        pid,
        _cancel_on_drop: cancel.drop_guard(),
        _supervisor: tokio::spawn(call.supervise()),
    })
}

/// Pauses before each new try of a start the kernel refused with "text file busy", doubling
/// from 1 ms: 63 ms in all.
const BUSY_RETRIES: u32 = 6;

/// [`start_once`], tried again while the executable is busy. The kernel refuses to run a file
/// some process holds open for writing, and a process forked anywhere in the agent holds a copy
/// of every descriptor open at that instant until it runs its own program: a call started just
/// as the agent writes another tool's executable (a blob fetched from the coordinator) can be
/// refused for a moment though nothing is wrong with its own. The pauses block the thread, as
/// the fork itself does; it happens only on that refusal.
fn start(inv: &Invocation, program: &str) -> Result<Started, ExecError> {
    let mut tries = 0;
    loop {
        match start_once(inv, program) {
            Err(ExecError::Spawn { source, .. })
                if source.kind() == io::ErrorKind::ExecutableFileBusy && tries < BUSY_RETRIES =>
            {
                std::thread::sleep(Duration::from_millis(1 << tries));
                tries += 1;
            }
            started => return started,
        }
    }
}

/// Starts the tool: confined calls through the jail's spawner, which does not fork the agent
/// (Linux, absolute programs); anything else through tokio, the jail's steps (if any) run
/// between fork and exec.
fn start_once(inv: &Invocation, program: &str) -> Result<Started, ExecError> {
    let spawn_error = |source: io::Error| ExecError::Spawn {
        program: program.to_owned(),
        reason: os_reason(&source),
        source,
    };
    #[cfg(target_os = "linux")]
    if let Some(jail) = &inv.jail {
        use std::ffi::OsStr;
        let target = match &inv.program {
            Program::Exec(path) if path.is_absolute() => {
                Some((path.as_path(), vec![path.as_os_str()]))
            }
            Program::Shell(script) => Some((
                std::path::Path::new(SHELL),
                vec![
                    OsStr::new(SHELL),
                    OsStr::new("-c"),
                    OsStr::new(script.as_str()),
                ],
            )),
            Program::Exec(_) => None,
        };
        if let Some((path, args)) = target
            && let Some(spawned) = jail.spawn(path, &args, &inv.env, &inv.cwd)
        {
            return crate::child::raw::adopt(spawned.map_err(spawn_error)?).map_err(spawn_error);
        }
    }
    let mut cmd = match &inv.program {
        Program::Exec(path) => Command::new(path),
        Program::Shell(script) => {
            let mut cmd = Command::new(SHELL);
            cmd.arg("-c").arg(script);
            cmd
        }
    };
    if let Some(jail) = &inv.jail {
        jail.install(cmd.as_std_mut());
    }
    cmd.env_clear()
        .envs(inv.env.iter().map(|(name, value)| (name, value)))
        .current_dir(&inv.cwd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(spawn_error)?;
    let pid = child.id().ok_or_else(|| ExecError::Spawn {
        program: program.to_owned(),
        reason: "exited before it could be tracked".to_owned(),
        source: io::Error::other("no process id"),
    })?;
    let missing = |pipe| ExecError::MissingPipe {
        program: program.to_owned(),
        pipe,
    };
    let stdin = child.stdin.take().ok_or_else(|| missing("stdin"))?;
    let stdout = child.stdout.take().ok_or_else(|| missing("stdout"))?;
    let stderr = child.stderr.take().ok_or_else(|| missing("stderr"))?;
    Ok(Started {
        child: Child::Tokio(child),
        pid,
        stdin: Box::new(stdin),
        stdout: Box::new(stdout),
        stderr: Box::new(stderr),
    })
}

/// Runs a call to the end, collecting its output; for tests, benches and simple callers
///
/// Returns what was delivered on stdout and stderr (cut at the cap, marker included).
pub async fn run_to_end(
    inv: Invocation,
    cancel: CancellationToken,
) -> Result<(Vec<u8>, Vec<u8>, Outcome), ExecError> {
    let program = inv.program.executable();
    let mut execution = spawn(inv, cancel)?;
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    while let Some(event) = execution.next().await {
        match event {
            Event::Output {
                stream: Stream::Stdout,
                data,
            } => stdout.extend_from_slice(&data),
            Event::Output {
                stream: Stream::Stderr,
                data,
            } => stderr.extend_from_slice(&data),
            Event::Finished(outcome) => return Ok((stdout, stderr, outcome)),
        }
    }
    Err(ExecError::NoOutcome { program })
}

fn check_cwd(inv: &Invocation) -> Result<(), ExecError> {
    let reason = match std::fs::metadata(&inv.cwd) {
        Ok(meta) if meta.is_dir() => return Ok(()),
        Ok(_) => "not a directory".to_owned(),
        Err(err) => os_reason(&err),
    };
    Err(ExecError::Cwd {
        path: inv.cwd.clone(),
        reason,
    })
}

/// Writes the tool's input and closes its stdin
///
/// A tool may exit or close stdin without reading it all; the resulting EPIPE
/// is expected, not an error.
async fn feed_stdin(mut pipe: impl AsyncWrite + Unpin, data: Vec<u8>) {
    if data.is_empty() {
        return;
    }
    match pipe.write_all(&data).await {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::BrokenPipe => {}
        Err(err) => tracing::debug!(%err, "cannot write tool stdin"),
    }
    // Dropping `pipe` closes it: the tool sees EOF.
}

/// Everything the supervisor owns for one call
struct Call {
    child: Child,
    pgid: Pid,
    stdin_task: JoinHandle<()>,
    /// The stdout and stderr readers
    readers: JoinSet<()>,
    tx: mpsc::Sender<Event>,
    cancel: CancellationToken,
    capture: Arc<Capture>,
    started: Instant,
    timeout: Duration,
    kill_grace: Duration,
    jail: Option<Arc<CallJail>>,
}

/// What woke the supervisor while the tool was running
enum Wake {
    Exited(io::Result<ExitStatus>),
    Stop(Ending),
}

impl Call {
    /// Waits for the tool to end or be stopped, cleans up its group, drains
    /// its output and sends the one `Finished` event
    async fn supervise(mut self) {
        let deadline = deadline_after(self.started, self.timeout);
        let wake = tokio::select! {
            status = self.child.wait() => Wake::Exited(status),
            () = sleep_until(deadline) => Wake::Stop(Ending::TimedOut),
            () = self.cancel.cancelled() => Wake::Stop(Ending::Cancelled),
            () = self.tx.closed() => Wake::Stop(Ending::Cancelled),
        };
        let (status, mut ending) = match wake {
            Wake::Exited(status) => {
                // Background processes must not outlive the call, and they may hold the pipes
                // open; those that left the process group are still in the call's cgroup.
                self.kill_all();
                (status, Ending::Exited)
            }
            Wake::Stop(ending) => {
                tracing::debug!(pgid = self.pgid.as_raw(), ?ending, "stopping tool");
                (self.terminate().await, ending)
            }
        };
        let exit = match status {
            Ok(status) => exit_of(status),
            Err(err) => {
                tracing::warn!(pgid = self.pgid.as_raw(), %err, "cannot wait for tool");
                self.kill_all();
                Exit::Code(-1)
            }
        };

        if let Some(stopped) = self.drain(deadline, ending).await {
            ending = stopped;
        }
        self.stdin_task.abort();
        // Every process of the call is ended before the outcome is told; removing what the
        // call made (its cgroups, its directory, which may be large) waits until after.
        let limits_hit = match self.jail.clone() {
            Some(jail) => tokio::task::spawn_blocking(move || jail.finish())
                .await
                .unwrap_or_default(),
            None => Vec::new(),
        };

        let captured = self.capture.take();
        let outcome = Outcome {
            result: outcome_result(&captured, exit, ending, self.timeout),
            exit,
            ending,
            duration: self.started.elapsed(),
            truncated: captured.truncated,
            stdout_bytes: captured.stdout_total,
            stderr_bytes: captured.stderr_total,
            limits_hit,
        };
        tracing::debug!(pgid = self.pgid.as_raw(), ?exit, ?ending, "tool finished");
        // A consumer that went away does not want the outcome; nothing to do then.
        let _ = self.tx.send(Event::Finished(outcome)).await;
        if let Some(jail) = self.jail.take() {
            // Blocking, and nobody waits for it: the supervisor's task ends with it.
            let _ = tokio::task::spawn_blocking(move || jail.release()).await;
        }
    }

    /// SIGTERM to the group, up to `kill_grace` for it to empty, then SIGKILL; reaps the leader
    async fn terminate(&mut self) -> io::Result<ExitStatus> {
        signal_group(self.pgid, Signal::SIGTERM);
        let grace_end = deadline_after(Instant::now(), self.kill_grace);
        let mut status = None;
        tokio::select! {
            res = self.child.wait() => status = Some(res),
            () = sleep_until(grace_end) => {}
        }
        if status.is_some() {
            // The leader is gone but members may linger, e.g. ones ignoring SIGTERM.
            while Instant::now() < grace_end && group_has_live_members(self.pgid) {
                sleep(GROUP_POLL).await;
            }
        }
        self.kill_all();
        match status {
            Some(status) => status,
            None => self.child.wait().await,
        }
    }

    /// SIGKILL to the process group and to everything in the call's cgroup
    fn kill_all(&self) {
        signal_group(self.pgid, Signal::SIGKILL);
        if let Some(jail) = &self.jail {
            jail.kill();
        }
    }

    /// Waits for both pipe readers to reach EOF, within bounds
    ///
    /// After a normal exit the call's deadline and cancellation still apply;
    /// after a kill, output gets `DRAIN_AFTER_KILL` more. Returns a new ending
    /// if the call was stopped while draining.
    async fn drain(&mut self, deadline: Instant, ending: Ending) -> Option<Ending> {
        let exited = ending == Ending::Exited;
        let limit = deadline_after(Instant::now(), DRAIN_AFTER_KILL);
        let stopped = tokio::select! {
            () = async { while self.readers.join_next().await.is_some() {} } => None,
            () = sleep_until(deadline), if exited => Some(Ending::TimedOut),
            () = self.cancel.cancelled(), if exited => Some(Ending::Cancelled),
            () = sleep_until(limit), if !exited => None,
        };
        // Awaiting the aborted readers guarantees none sends after `Finished`.
        self.readers.shutdown().await;
        if stopped.is_some() {
            tracing::debug!(
                pgid = self.pgid.as_raw(),
                "tool output still open after the call ended"
            );
        }
        stopped
    }
}

fn exit_of(status: ExitStatus) -> Exit {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => Exit::Code(code),
        (None, Some(signo)) => Exit::Signal(signo),
        // wait() reports only exits and deaths by signal; this is unreachable in practice.
        (None, None) => Exit::Code(-1),
    }
}

/// `start + after`, or a date decades away when that overflows
fn deadline_after(start: Instant, after: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(60 * 60 * 24 * 365 * 30);
    start.checked_add(after).unwrap_or_else(|| start + FAR)
}
