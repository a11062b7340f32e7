//! Bounded waits: polling for a condition, and running a command to its end.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Result, TestkitError, must};

/// How often the polling waits look again.
const POLL: Duration = Duration::from_millis(50);

/// Polls `f` until it returns `Some`, for at most `limit`.
pub fn try_wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(TestkitError::Timeout {
                what: what.to_string(),
                limit,
            });
        }
        std::thread::sleep(POLL);
    }
}

/// [`try_wait_for`], failing the test when the time runs out.
#[track_caller]
pub fn wait_for<T>(what: &str, limit: Duration, f: impl FnMut() -> Option<T>) -> T {
    must(try_wait_for(what, limit, f))
}

/// Polls the async `check` until it returns `Some`, for at most `limit`.
pub async fn wait_until<T>(
    what: &str,
    limit: Duration,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> Result<T> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(TestkitError::Timeout {
                what: what.to_string(),
                limit,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Runs a command to completion in its own process group, feeding `stdin` if given; after
/// `limit` the whole group is killed and the run is an error.
pub fn try_run_bounded(cmd: &mut Command, stdin: Option<&str>, limit: Duration) -> Result<Output> {
    use std::io::Write;
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .process_group(0);
    let what = format!("{cmd:?}");
    let mut child = cmd
        .spawn()
        .map_err(|e| TestkitError::io(format!("cannot start {what}"), e))?;
    if let Some(input) = stdin
        && let Some(mut pipe) = child.stdin.take()
    {
        // A command that exits without reading its input is for the test to judge.
        let _ = pipe.write_all(input.as_bytes());
    }
    try_finish_child(child, limit, &what)
}

/// Waits (bounded) for `child`, started with piped output in its own process group, to exit and
/// returns its output; after `limit` its group is killed and the wait is an error.
pub fn try_finish_child(child: Child, limit: Duration, what: &str) -> Result<Output> {
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.map_err(|e| TestkitError::io(format!("cannot wait for {what}"), e)),
        Err(_) => {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            Err(TestkitError::Timeout {
                what: format!("{what} to finish"),
                limit,
            })
        }
    }
}

/// [`try_finish_child`], failing the test on error.
#[track_caller]
pub fn finish_child(child: Child, limit: Duration) -> Output {
    let what = format!("process {}", child.id());
    must(try_finish_child(child, limit, &what))
}

/// [`try_run_bounded`], failing the test on error.
#[track_caller]
pub fn run_bounded(mut cmd: Command, stdin: Option<&str>, limit: Duration) -> Output {
    must(try_run_bounded(&mut cmd, stdin, limit))
}
