//! End-to-end tests that run real child processes through `toolsrv_exec`

// A failed expectation in a test should panic with its message.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio_util::sync::CancellationToken;
use toolsrv_exec::{
    Ending, Event, ExecError, Exit, Invocation, Outcome, Program, Stream, run_to_end, spawn,
};

/// Every test is bounded by this
const LIMIT: Duration = Duration::from_secs(20);
const PATH: &str = "/usr/local/bin:/usr/bin:/bin";

fn shell(script: &str) -> Invocation {
    let mut inv = Invocation::new(Program::Shell(script.to_owned()), "/");
    inv.env = vec![("PATH".into(), PATH.into())];
    inv.timeout = Duration::from_secs(15);
    inv
}

async fn run(inv: Invocation) -> (Vec<u8>, Vec<u8>, Outcome) {
    bounded(run_to_end(inv, CancellationToken::new()))
        .await
        .expect("the call starts")
}

async fn bounded<F: Future>(fut: F) -> F::Output {
    tokio::time::timeout(LIMIT, fut)
        .await
        .expect("test finished within its bound")
}

fn text(result: &serde_json::Value) -> &str {
    result["content"][0]["text"]
        .as_str()
        .expect("a text result")
}

/// Whether `pid` names a running process (zombies count as gone: they cannot run
/// and this container's init does not reap orphans)
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next());
            !matches!(state, Some("Z" | "X"))
        }
        Err(_) => false,
    }
}

async fn gone_within(pid: u32, wait: Duration) -> bool {
    let end = Instant::now() + wait;
    while Instant::now() < end {
        if !alive(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    !alive(pid)
}

fn first_pid(stdout: &[u8]) -> u32 {
    String::from_utf8_lossy(stdout)
        .lines()
        .next()
        .and_then(|line| line.trim().parse().ok())
        .expect("the script printed a pid first")
}

#[tokio::test]
async fn stdin_is_delivered_then_closed() {
    let mut inv = shell("cat; echo end");
    inv.stdin = b"hello tool".to_vec();
    let (stdout, stderr, outcome) = run(inv).await;
    assert_eq!(stdout, b"hello toolend\n");
    assert!(stderr.is_empty());
    assert!(outcome.success());
    assert_eq!(outcome.exit, Exit::Code(0));
    assert_eq!(outcome.stdout_bytes, 14);
}

#[tokio::test]
async fn env_is_exactly_what_was_given() {
    let mut inv = Invocation::new(Program::Exec("/usr/bin/env".into()), "/");
    inv.env = vec![("FOO".into(), "bar".into()), ("EMPTY".into(), "".into())];
    let (stdout, _, outcome) = run(inv).await;
    assert!(outcome.success());
    // The order of the variables is not part of the contract.
    let mut lines: Vec<_> = std::str::from_utf8(&stdout)
        .expect("utf-8")
        .lines()
        .collect();
    lines.sort_unstable();
    assert_eq!(lines, ["EMPTY=", "FOO=bar"]);
}

#[tokio::test]
async fn cwd_is_honored() {
    let dir = tempfile::tempdir().expect("tempdir");
    let want = dir.path().canonicalize().expect("canonical tempdir");
    let mut inv = shell("pwd -P");
    inv.cwd = dir.path().to_owned();
    let (stdout, _, outcome) = run(inv).await;
    assert!(outcome.success());
    assert_eq!(
        String::from_utf8_lossy(&stdout).trim_end(),
        want.to_string_lossy()
    );
}

#[tokio::test]
async fn structured_output_passes_through() {
    let (_, _, outcome) = run(shell(
        r#"printf '%s' '{"content":[{"type":"text","text":"hi"}],"meta":{"k":1}}'"#,
    ))
    .await;
    assert_eq!(
        outcome.result,
        json!({"content":[{"type":"text","text":"hi"}],"meta":{"k":1}})
    );
}

#[tokio::test]
async fn plain_output_is_wrapped_as_text() {
    let (_, _, outcome) = run(shell("echo hello")).await;
    assert_eq!(
        outcome.result,
        json!({"content":[{"type":"text","text":"hello\n"}]})
    );
}

#[tokio::test]
async fn non_zero_exit_is_an_error_explained_by_stderr() {
    let (_, stderr, outcome) = run(shell("echo oops >&2; exit 3")).await;
    assert_eq!(stderr, b"oops\n");
    assert_eq!(outcome.exit, Exit::Code(3));
    assert_eq!(outcome.ending, Ending::Exited);
    assert!(!outcome.success());
    assert_eq!(
        outcome.result,
        json!({"content":[{"type":"text","text":"oops\n"}],"isError":true})
    );
}

#[tokio::test]
async fn structured_output_of_a_failed_tool_is_wrapped() {
    let (_, _, outcome) = run(shell(r#"printf '{"content":[]}'; exit 1"#)).await;
    assert_eq!(outcome.result["isError"], true);
    assert_eq!(text(&outcome.result), r#"{"content":[]}"#);
}

#[tokio::test]
async fn a_child_killed_by_a_signal() {
    let (_, _, outcome) = run(shell("kill -KILL $$")).await;
    assert_eq!(outcome.exit, Exit::Signal(9));
    assert_eq!(outcome.ending, Ending::Exited);
    assert!(!outcome.success());
    assert_eq!(outcome.result["isError"], true);
    assert!(text(&outcome.result).contains("killed by signal 9"));
}

/// A group whose shell and grandchild both ignore SIGTERM; prints the grandchild's pid
const STUBBORN: &str = r#"trap "" TERM; sleep 100 & echo $!; wait; wait"#;

#[tokio::test]
async fn timeout_kills_a_group_that_ignores_sigterm() {
    let mut inv = shell(STUBBORN);
    inv.timeout = Duration::from_millis(800);
    inv.kill_grace = Duration::from_millis(700);
    let started = Instant::now();
    let (stdout, _, outcome) = run(inv).await;
    let took = started.elapsed();
    assert_eq!(outcome.ending, Ending::TimedOut);
    assert_eq!(outcome.exit, Exit::Signal(9));
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(6),
        "took {took:?}"
    );
    assert_eq!(outcome.result["isError"], true);
    assert!(text(&outcome.result).contains("tool timed out after 800ms"));
    let grandchild = first_pid(&stdout);
    assert!(gone_within(grandchild, Duration::from_secs(2)).await);
}

#[tokio::test]
async fn timeout_of_a_well_behaved_tool_does_not_wait_the_grace() {
    let mut inv = shell("sleep 100");
    inv.timeout = Duration::from_millis(300);
    inv.kill_grace = Duration::from_secs(10);
    let started = Instant::now();
    let (_, _, outcome) = run(inv).await;
    assert_eq!(outcome.ending, Ending::TimedOut);
    assert_eq!(outcome.exit, Exit::Signal(15));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn cancellation_kills_a_group_that_ignores_sigterm() {
    let mut inv = shell(STUBBORN);
    inv.kill_grace = Duration::from_millis(500);
    let cancel = CancellationToken::new();
    let mut execution = spawn(inv, cancel.clone()).expect("spawn");
    let started = Instant::now();
    let outcome = bounded(async {
        let mut stdout = Vec::new();
        let mut grandchild = None;
        loop {
            match execution.next().await.expect("events until Finished") {
                Event::Output {
                    stream: Stream::Stdout,
                    data,
                } => {
                    stdout.extend_from_slice(&data);
                    if grandchild.is_none() && stdout.contains(&b'\n') {
                        grandchild = Some(first_pid(&stdout));
                        cancel.cancel();
                    }
                }
                Event::Output { .. } => {}
                Event::Finished(outcome) => break (outcome, grandchild),
            }
        }
    })
    .await;
    let (outcome, grandchild) = outcome;
    assert_eq!(outcome.ending, Ending::Cancelled);
    assert_eq!(outcome.exit, Exit::Signal(9));
    assert!(started.elapsed() >= Duration::from_millis(500));
    assert!(started.elapsed() < Duration::from_secs(6));
    assert!(text(&outcome.result).contains("tool was cancelled"));
    assert!(
        bounded(execution.next()).await.is_none(),
        "Finished is last"
    );
    let grandchild = grandchild.expect("saw the grandchild pid");
    assert!(gone_within(grandchild, Duration::from_secs(2)).await);
}

#[tokio::test]
async fn dropping_the_execution_kills_the_group() {
    let inv = shell("sleep 100 & echo $!; wait");
    let mut execution = spawn(inv, CancellationToken::new()).expect("spawn");
    let leader = execution.pid();
    let grandchild = bounded(async {
        match execution.next().await {
            Some(Event::Output { data, .. }) => first_pid(&data),
            other => panic!("expected the pid, got {other:?}"),
        }
    })
    .await;
    assert!(alive(leader) && alive(grandchild));
    drop(execution);
    assert!(gone_within(grandchild, Duration::from_secs(5)).await);
    assert!(gone_within(leader, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn output_cap_truncates_marks_and_keeps_counting() {
    let mut inv = shell("head -c 100000 /dev/zero; head -c 50000 /dev/zero >&2; echo done >&2");
    inv.output_cap = 1000;
    let (stdout, stderr, outcome) = run(inv).await;
    let marker = b"\n[toolsrv: output truncated at 1000 bytes]\n";
    let mut all = stdout.clone();
    all.extend_from_slice(&stderr);
    assert_eq!(all.len(), 1000 + marker.len());
    assert_eq!(all.windows(marker.len()).filter(|w| w == marker).count(), 1);
    assert!(outcome.truncated);
    assert_eq!(outcome.stdout_bytes, 100_000);
    assert_eq!(outcome.stderr_bytes, 50_005);
    assert!(outcome.success(), "the child still finishes: {outcome:?}");
    assert!(text(&outcome.result).ends_with("[toolsrv: output truncated at 1000 bytes]\n"));
}

#[tokio::test]
async fn large_output_on_both_pipes_while_reading_large_stdin() {
    const MIB: usize = 1 << 20;
    let mut inv = shell(
        "head -c 8388608 /dev/zero & head -c 8388608 /dev/zero >&2 & \
         n=$(wc -c); wait; test \"$n\" -eq 4194304 || exit 7",
    );
    inv.stdin = vec![b'i'; 4 * MIB];
    inv.output_cap = 64 * MIB as u64;
    let (stdout, stderr, outcome) = run(inv).await;
    assert_eq!(
        outcome.exit,
        Exit::Code(0),
        "{:?}",
        String::from_utf8_lossy(&stderr[..stderr.len().min(200)])
    );
    assert_eq!(stdout.len(), 8 * MIB);
    assert_eq!(stderr.len(), 8 * MIB);
    assert_eq!(outcome.stdout_bytes, 8 * MIB as u64);
    assert_eq!(outcome.stderr_bytes, 8 * MIB as u64);
    assert!(!outcome.truncated);
}

#[tokio::test]
async fn a_slow_consumer_loses_nothing() {
    let mut inv = shell("head -c 3000000 /dev/zero");
    inv.output_cap = 10_000_000;
    let mut execution = spawn(inv, CancellationToken::new()).expect("spawn");
    let outcome = bounded(async {
        let mut seen = 0usize;
        loop {
            match execution.next().await.expect("events until Finished") {
                Event::Output { data, .. } => {
                    seen += data.len();
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Event::Finished(outcome) => break (seen, outcome),
            }
        }
    })
    .await;
    assert_eq!(outcome.0, 3_000_000);
    assert_eq!(outcome.1.stdout_bytes, 3_000_000);
}

#[tokio::test]
async fn background_children_do_not_outlive_the_call() {
    let started = Instant::now();
    let (stdout, _, outcome) = run(shell("sleep 100 & echo $!")).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(outcome.ending, Ending::Exited);
    assert!(outcome.success());
    assert!(gone_within(first_pid(&stdout), Duration::from_secs(2)).await);
}

#[tokio::test]
async fn a_child_that_ignores_stdin_is_fine() {
    let mut inv = shell("echo hi");
    inv.stdin = vec![0; 8 << 20];
    let (stdout, _, outcome) = run(inv).await;
    assert_eq!(stdout, b"hi\n");
    assert!(outcome.success());
}

#[tokio::test]
async fn into_stream_yields_the_same_events() {
    use tokio_stream::StreamExt;
    let execution = spawn(shell("echo a; echo b >&2"), CancellationToken::new()).expect("spawn");
    let events: Vec<Event> = bounded(execution.into_stream().collect()).await;
    assert!(matches!(events.last(), Some(Event::Finished(o)) if o.success()));
    let finished = events
        .iter()
        .filter(|e| matches!(e, Event::Finished(_)))
        .count();
    assert_eq!(finished, 1);
}

#[tokio::test]
async fn missing_program_is_a_spawn_error_naming_it() {
    let inv = Invocation::new(Program::Exec("/nonexistent/tool".into()), "/");
    let err = run_to_end(inv, CancellationToken::new())
        .await
        .expect_err("cannot start");
    assert!(matches!(err, ExecError::Spawn { .. }));
    assert_eq!(
        err.to_string(),
        "cannot start /nonexistent/tool: no such file or directory"
    );
}

#[tokio::test]
async fn non_executable_program_is_permission_denied() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tool = dir.path().join("tool");
    std::fs::write(&tool, "#!/bin/sh\necho hi\n").expect("write tool");
    let inv = Invocation::new(Program::Exec(tool.clone()), dir.path());
    let err = spawn(inv, CancellationToken::new()).expect_err("not executable");
    assert_eq!(
        err.to_string(),
        format!("cannot start {}: permission denied", tool.display())
    );
}

#[tokio::test]
async fn missing_cwd_is_an_error_naming_it() {
    let inv = Invocation::new(Program::Shell("true".into()), "/nonexistent/dir");
    let err = spawn(inv, CancellationToken::new()).expect_err("no cwd");
    assert!(matches!(err, ExecError::Cwd { .. }));
    assert_eq!(
        err.to_string(),
        "cannot use working directory /nonexistent/dir: no such file or directory"
    );
    let file = tempfile::NamedTempFile::new().expect("tempfile");
    let inv = Invocation::new(Program::Shell("true".into()), file.path());
    let err = spawn(inv, CancellationToken::new()).expect_err("cwd is a file");
    assert!(err.to_string().ends_with("not a directory"), "{err}");
}

#[test]
fn spawn_outside_a_runtime_is_an_error() {
    let inv = Invocation::new(Program::Shell("true".into()), Path::new("/"));
    let err = spawn(inv, CancellationToken::new()).expect_err("no runtime");
    assert!(matches!(err, ExecError::NoRuntime { .. }));
}

#[tokio::test]
async fn a_slow_consumer_stalls_the_tool() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut inv = shell("head -c 20000000 /dev/zero; touch done");
    inv.cwd = dir.path().to_owned();
    inv.output_cap = 30_000_000;
    let mut execution = spawn(inv, CancellationToken::new()).expect("spawn");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The channel and the pipe hold about a MiB: the tool must be blocked writing.
    assert!(
        !dir.path().join("done").exists(),
        "the tool ran ahead of its consumer"
    );
    let outcome = bounded(async {
        loop {
            if let Some(Event::Finished(outcome)) = execution.next().await {
                break outcome;
            }
        }
    })
    .await;
    assert!(outcome.success());
    assert_eq!(outcome.stdout_bytes, 20_000_000);
    assert!(dir.path().join("done").exists());
}

#[tokio::test]
async fn a_process_that_escaped_the_group_cannot_hold_the_call_past_its_timeout() {
    // The pause lets setsid run before the exit-time group kill could reach it.
    let mut inv = shell("setsid sleep 30 & echo $!; sleep 0.5");
    inv.timeout = Duration::from_secs(1);
    let started = Instant::now();
    let (stdout, _, outcome) = run(inv).await;
    let escaped = first_pid(&stdout);
    let _ = std::process::Command::new("kill")
        .args(["-9", &escaped.to_string()])
        .status();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(outcome.ending, Ending::TimedOut);
    assert_eq!(outcome.exit, Exit::Code(0));
    assert!(!outcome.success());
}

#[tokio::test]
async fn the_result_keeps_only_the_start_of_a_large_output_while_all_of_it_streams() {
    let mut inv = shell("head -c 3145728 /dev/zero | tr '\\0' x");
    inv.output_cap = 8 << 20;
    inv.result_cap = 1 << 20;
    let (stdout, _, outcome) = run(inv).await;
    assert_eq!(stdout.len(), 3 << 20, "everything streams");
    assert!(!outcome.truncated);
    let text = text(&outcome.result);
    assert!(
        text.starts_with(&"x".repeat(1 << 20)),
        "the first MiB is kept"
    );
    assert!(
        text.ends_with(
            "[toolsrv: the result holds the first 1048576 of 3145728 bytes; the rest was streamed]"
        ),
        "{}",
        &text[text.len() - 120..]
    );
    assert!(text.len() < (1 << 20) + 200);
}

/// A process that holds the executable open for writing a moment longer (as every process
/// forked in the agent does with whatever it was writing, until it runs its own program) does
/// not fail the call: the start is tried again once the file is free.
#[tokio::test]
async fn an_executable_busy_for_a_moment_still_starts() {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tool");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .open(&path)
        .unwrap();
    file.write_all(b"#!/bin/sh\necho started\n").unwrap();
    // Still open for writing when the call starts; closed 20 ms later.
    let writer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        drop(file);
    });
    let mut inv = Invocation::new(Program::Exec(path), "/");
    inv.env = vec![("PATH".into(), PATH.into())];
    let (stdout, stderr, outcome) = run(inv).await;
    writer.join().unwrap();
    assert_eq!(
        outcome.exit,
        Exit::Code(0),
        "{}",
        String::from_utf8_lossy(&stderr)
    );
    assert!(String::from_utf8_lossy(&stdout).contains("started"));
}
