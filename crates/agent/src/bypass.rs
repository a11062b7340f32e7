//! The bypass broker of one call: a Unix socket only the call's processes may use, each request
//! forwarded to the coordinator, an approved command run outside the Landlock rules but inside
//! the call's cgroup.
//!
//! Wire format (README, "Asking for more: bypass"): the tool writes one JSON line
//! `{"argv": [...], "reason": "...", "stdin": "..."}` and reads one JSON line back,
//! `{"approved": true, "exit_code": N, "stdout": "...", "stderr": "...", "truncated": bool}` or
//! `{"approved": false, "reason": "..."}`. Several requests per connection, one at a time per
//! call.
//!
//! Architecture invariant: a bypass command runs only after the coordinator approved it, inside
//! the call's cgroup (its limits, its end), with the call's environment and user.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use toolsrv_confine::CallJail;
use toolsrv_proto::v1::agent_message::Msg;
use toolsrv_proto::v1::{AgentMessage, BypassDecision, BypassRequest};

/// The socket's name in the call's private directory.
pub(crate) const SOCKET_NAME: &str = "bypass.sock";
/// The most standard input a request may give its command.
pub const MAX_STDIN: usize = 1 << 20;
/// The longest request line: the command, its reason and its standard input as JSON text (an
/// escaped byte takes up to 6).
pub const MAX_LINE: usize = 64 * 1024 + 6 * MAX_STDIN;
/// Most JSON values a request line may hold, at any depth: its object, `argv` and its words,
/// `reason`, `stdin` and a few more. 1 MiB of `[0],` took 89 MB as a JSON tree; this many take
/// a few hundred KB.
pub const MAX_REQUEST_VALUES: usize = 4096 + 8;
/// The most of each of the command's stdout and stderr kept; the rest is dropped (`truncated`).
pub const MAX_OUTPUT: usize = 1 << 20;
/// Most bytes of a refused peer's request read (and dropped) before closing.
const REFUSAL_DRAIN_BYTES: usize = 64 << 10;
/// How long a refused peer is given to read its refusal.
const REFUSAL_WRITE: Duration = Duration::from_secs(1);
/// How long the broker's tasks may take to end once the call ended.
const STOP_WAIT: Duration = Duration::from_secs(2);
/// Most connections open at once on one call's socket (refused ones included). Requests are
/// answered one at a time per call, so more wait for nothing; each may buffer a request line of
/// up to [`MAX_LINE`] in the agent, outside the call's memory limit, and holds one of the
/// agent's descriptors: 24,000 of them left the agent no descriptor to scan its tools with.
pub const MAX_CONNECTIONS: usize = 4;

/// The answer when the call ends (ended, cancelled, out of time) while a request waits.
pub(crate) const CALL_ENDED: &str = "the call ended before the request was decided";
/// The answer when the link to the coordinator goes while a request waits.
pub(crate) const LINK_LOST: &str = "the link to the coordinator was lost";

/// The decisions the session's calls wait for, by (call id, request id).
#[derive(Debug, Default)]
pub(crate) struct Pending {
    inner: Mutex<PendingInner>,
}

#[derive(Debug, Default)]
struct PendingInner {
    waiting: HashMap<(u64, u64), oneshot::Sender<BypassDecision>>,
    /// The link is gone: nothing more will be decided.
    closed: bool,
}

impl Pending {
    fn lock(&self) -> std::sync::MutexGuard<'_, PendingInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a request; `None` when the link is already gone.
    fn wait(self: &Arc<Self>, call_id: u64, request_id: u64) -> Option<Waiter> {
        let (tx, rx) = oneshot::channel();
        let mut inner = self.lock();
        if inner.closed {
            return None;
        }
        inner.waiting.insert((call_id, request_id), tx);
        Some(Waiter {
            pending: self.clone(),
            key: (call_id, request_id),
            rx,
        })
    }

    /// Hands a decision to the request it answers; false when nobody waits for it (the call or
    /// the request is gone).
    pub fn deliver(&self, decision: BypassDecision) -> bool {
        let tx = self
            .lock()
            .waiting
            .remove(&(decision.call_id, decision.request_id));
        tx.is_some_and(|tx| tx.send(decision).is_ok())
    }

    /// The link is gone: every waiting request is answered as such, and no new one waits.
    pub fn close(&self) {
        let mut inner = self.lock();
        inner.closed = true;
        inner.waiting.clear();
    }
}

/// One registered request; unregistered when dropped.
struct Waiter {
    pending: Arc<Pending>,
    key: (u64, u64),
    rx: oneshot::Receiver<BypassDecision>,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.pending.lock().waiting.remove(&self.key);
    }
}

/// What the broker of one call needs.
#[derive(Debug)]
pub(crate) struct CallSide {
    pub call_id: u64,
    pub tool: String,
    pub jail: Arc<CallJail>,
    /// The call's environment and working directory, which an approved command gets too.
    pub env: Vec<(OsString, OsString)>,
    pub cwd: PathBuf,
    /// The end of the call's time: waits and commands end by then.
    pub deadline: Instant,
    pub cancel: CancellationToken,
    pub out: toolsrv_proto::outbound::Outbound<AgentMessage>,
    pub pending: Arc<Pending>,
}

/// A running broker; [`Broker::stop`] ends it and removes its socket.
#[derive(Debug)]
pub(crate) struct Broker {
    path: PathBuf,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Broker {
    /// The socket's path, for `OLLIE_BYPASS_SOCKET`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serves the socket `dir/bypass.sock` for the call: mode 0600, owned by the user the call
    /// runs as.
    pub fn start(dir: &Path, call: CallSide) -> Result<Self, String> {
        let path = dir.join(SOCKET_NAME);
        let failed = |what: &str, e: &dyn std::fmt::Display| {
            format!(
                "tool `{}`: cannot {what} the bypass socket {}: {e}; check the calls' directory (--call-dir)",
                call.tool,
                path.display()
            )
        };
        let listener = UnixListener::bind(&path).map_err(|e| failed("create", &e))?;
        let ready = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| failed("set the mode of", &e))
            .and_then(|()| match call.jail.owner() {
                Some((uid, gid)) => nix::unistd::chown(
                    &path,
                    Some(nix::unistd::Uid::from_raw(uid)),
                    Some(nix::unistd::Gid::from_raw(gid)),
                )
                .map_err(|e| failed("give the --run-as user", &e)),
                None => Ok(()),
            });
        if let Err(e) = ready {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve(listener, Arc::new(Shared::new(call)), stop.clone()));
        Ok(Self { path, stop, task })
    }

    /// Ends the broker (requests still waiting are dropped with their connections) and removes
    /// its socket.
    pub async fn stop(self) {
        self.stop.cancel();
        let mut task = self.task;
        if tokio::time::timeout(STOP_WAIT, &mut task).await.is_err() {
            task.abort();
        }
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(socket = %self.path.display(), error = %e, "cannot remove the bypass socket");
        }
    }
}

/// The broker's state, shared by its connections.
struct Shared {
    call: CallSide,
    next_request: AtomicU64,
    /// One request of the call at a time.
    one_at_a_time: tokio::sync::Mutex<()>,
}

impl Shared {
    fn new(call: CallSide) -> Self {
        Self {
            call,
            next_request: AtomicU64::new(1),
            one_at_a_time: tokio::sync::Mutex::new(()),
        }
    }
}

async fn serve(listener: UnixListener, shared: Arc<Shared>, stop: CancellationToken) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) if conns.len() >= MAX_CONNECTIONS => {
                    // Told without waiting for the peer (no task, no descriptor held), closed.
                    let _ = stream.try_write(denied(&format!(
                        "refused: call {} has {MAX_CONNECTIONS} bypass connections open, the most it may; requests are answered one at a time, so send them on one connection",
                        shared.call.call_id
                    )).as_bytes());
                    drop(stream);
                }
                Ok((stream, _)) => {
                    let pid = stream.peer_cred().ok().and_then(|c| c.pid());
                    if pid.is_some_and(|pid| shared.call.jail.holds(pid)) {
                        conns.spawn(serve_connection(stream, shared.clone()));
                    } else {
                        tracing::warn!(
                            call_id = shared.call.call_id, peer_pid = ?pid,
                            "refused a bypass connection from a process outside the call"
                        );
                        let why = format!(
                            "refused: this socket serves only the processes of call {} (tool `{}`); use the socket in your own OLLIE_BYPASS_SOCKET",
                            shared.call.call_id, shared.call.tool
                        );
                        conns.spawn(refuse(stream, why));
                    }
                }
                Err(e) => {
                    tracing::warn!(call_id = shared.call.call_id, error = %e, "cannot accept a bypass connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    conns.abort_all();
    while conns.join_next().await.is_some() {}
}

/// Answers a connection from outside the call with a denial. The peer may not have written its
/// request yet: closing at once would make that write fail (EPIPE) before it reads why, so the
/// request is read and dropped (a bounded amount, for a bounded time) before closing.
async fn refuse(mut stream: UnixStream, why: String) {
    let line = denied(&why);
    let _ = tokio::time::timeout(REFUSAL_WRITE, async {
        stream.write_all(line.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut left = REFUSAL_DRAIN_BYTES;
        while left > 0 {
            let n = stream.read(&mut sink).await?;
            if n == 0 {
                break;
            }
            left = left.saturating_sub(n);
        }
        Ok::<(), std::io::Error>(())
    })
    .await;
}

/// `{"approved": false, "reason": why}` as a line.
fn denied(why: &str) -> String {
    format!("{}\n", json!({"approved": false, "reason": why}))
}

/// One line read within a bound.
#[derive(Debug, PartialEq, Eq)]
enum Line {
    Text(Vec<u8>),
    /// Longer than the bound: skipped up to its end.
    TooLong,
    Eof,
}

async fn read_line<R: AsyncBufRead + Unpin>(r: &mut R, max: usize) -> std::io::Result<Line> {
    let mut line = Vec::new();
    let mut too_long = false;
    loop {
        let chunk = r.fill_buf().await?;
        if chunk.is_empty() {
            // A last line without a newline counts.
            return Ok(match (too_long, line.is_empty()) {
                (true, _) => Line::TooLong,
                (false, true) => Line::Eof,
                (false, false) => Line::Text(line),
            });
        }
        let (take, end) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (chunk.len(), false),
        };
        if !too_long {
            if line.len() + take > max {
                too_long = true;
                line = Vec::new();
            } else {
                line.extend_from_slice(&chunk[..take]);
            }
        }
        r.consume(take + usize::from(end));
        if end {
            return Ok(if too_long {
                Line::TooLong
            } else {
                Line::Text(line)
            });
        }
    }
}

async fn serve_connection(stream: UnixStream, shared: Arc<Shared>) {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    loop {
        let answer = match read_line(&mut read, MAX_LINE).await {
            Ok(Line::Eof) | Err(_) => return,
            Ok(Line::TooLong) => denied(&format!(
                "refused: the request line is longer than {MAX_LINE} bytes; give the command less standard input (at most {MAX_STDIN} bytes)"
            )),
            Ok(Line::Text(text)) => match Request::parse(&text) {
                Err(why) => denied(&format!("refused: {why}")),
                Ok(request) => {
                    let _turn = shared.one_at_a_time.lock().await;
                    handle(&shared.call, &shared.next_request, request).await
                }
            },
        };
        if write.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// One request of a tool.
#[derive(Debug, PartialEq, Eq)]
struct Request {
    argv: Vec<String>,
    reason: String,
    stdin: Option<Vec<u8>>,
}

impl Request {
    fn parse(line: &[u8]) -> Result<Self, String> {
        const FORMAT: &str = r#"write one JSON object per line: {"argv": ["cmd", "arg"], "reason": "why", "stdin": "optional text"}"#;
        // Read before anything is built from it: a JSON tree takes tens of times its text, and
        // a line may be megabytes, held in the agent outside the call's memory limit.
        match toolsrv_meta::read_json_values(line, MAX_REQUEST_VALUES) {
            Ok(_) => {}
            Err(toolsrv_meta::JsonValuesError::TooMany) => {
                return Err(format!(
                    "the request holds more than {MAX_REQUEST_VALUES} JSON values, the most one \
                     may (`argv` of at most {} words); {FORMAT}",
                    MAX_REQUEST_VALUES - 8
                ));
            }
            Err(toolsrv_meta::JsonValuesError::Invalid(e)) => {
                return Err(format!("the request is not valid JSON ({e}); {FORMAT}"));
            }
        }
        let value: Value = serde_json::from_slice(line)
            .map_err(|e| format!("the request is not valid JSON ({e}); {FORMAT}"))?;
        let Value::Object(map) = value else {
            return Err(format!("the request is not a JSON object; {FORMAT}"));
        };
        let argv: Vec<String> = match map.get("argv") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .ok_or_else(|| format!("`argv` must be an array of strings; {FORMAT}"))?,
            _ => return Err(format!("`argv` is missing or not an array; {FORMAT}")),
        };
        if argv.first().is_none_or(String::is_empty) {
            return Err(format!("`argv` must name a command; {FORMAT}"));
        }
        let reason = match map.get("reason") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(format!("`reason` must be a string; {FORMAT}")),
        };
        let stdin = match map.get("stdin") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.len() <= MAX_STDIN => Some(s.clone().into_bytes()),
            Some(Value::String(_)) => {
                return Err(format!(
                    "`stdin` is longer than {MAX_STDIN} bytes; give the command less input"
                ));
            }
            Some(_) => return Err(format!("`stdin` must be a string; {FORMAT}")),
        };
        Ok(Self {
            argv,
            reason,
            stdin,
        })
    }
}

/// Asks the coordinator, waits for its decision, runs the command if approved; the answer line.
async fn handle(call: &CallSide, next: &AtomicU64, request: Request) -> String {
    let request_id = next.fetch_add(1, Ordering::Relaxed);
    let Some(mut waiter) = call.pending.wait(call.call_id, request_id) else {
        return denied(LINK_LOST);
    };
    let msg = Msg::Bypass(BypassRequest {
        call_id: call.call_id,
        request_id,
        argv: request.argv.clone(),
        reason: request.reason.clone(),
        stdin_bytes: request.stdin.as_ref().map_or(0, |s| s.len() as u64),
    });
    tracing::info!(call_id = call.call_id, request_id, argv = ?request.argv, "bypass requested");
    let sent = tokio::select! {
        sent = call.out.send(AgentMessage { msg: Some(msg) }) => sent.is_ok(),
        () = call.cancel.cancelled() => return denied(CALL_ENDED),
        () = sleep_until(call.deadline) => return denied(CALL_ENDED),
    };
    if !sent {
        return denied(LINK_LOST);
    }
    let decision = tokio::select! {
        biased;
        decision = &mut waiter.rx => match decision {
            Ok(decision) => decision,
            Err(_) => return denied(LINK_LOST),
        },
        () = call.cancel.cancelled() => return denied(CALL_ENDED),
        () = sleep_until(call.deadline) => return denied(CALL_ENDED),
    };
    drop(waiter);
    if !decision.approved {
        let why = if decision.reason.is_empty() {
            "denied by the coordinator".to_owned()
        } else {
            decision.reason
        };
        return denied(&why);
    }
    let ran = run_command(call, &request).await;
    format!(
        "{}\n",
        json!({
            "approved": true,
            "exit_code": ran.exit_code,
            "stdout": String::from_utf8_lossy(&ran.stdout),
            "stderr": String::from_utf8_lossy(&ran.stderr),
            "truncated": ran.truncated,
        })
    )
}

/// What an approved command did.
#[derive(Debug, Default)]
struct Ran {
    exit_code: i32,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    truncated: bool,
}

impl Ran {
    /// A command that could not run, reported as a shell would (127).
    fn not_run(why: String) -> Self {
        Self {
            exit_code: 127,
            stderr: why.into_bytes(),
            ..Self::default()
        }
    }
}

async fn run_command(call: &CallSide, request: &Request) -> Ran {
    let program = &request.argv[0];
    let mut cmd = std::process::Command::new(program);
    cmd.args(&request.argv[1..])
        .env_clear()
        .envs(call.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&call.cwd)
        .stdin(if request.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    if let Err(e) = call.jail.install_bypass(&mut cmd) {
        return Ran::not_run(format!(
            "toolsrv: approved, but cannot run `{program}`: {e}\n"
        ));
    }
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => {
            return Ran::not_run(format!(
                "toolsrv: approved, but cannot run `{program}`: {e}; check the command's name and PATH\n"
            ));
        }
    };
    let pid = child.id();
    let stdin = child.stdin.take();
    let input = request.stdin.clone().unwrap_or_default();
    let feed = async move {
        if let Some(mut stdin) = stdin {
            // A command that does not read its input is fine.
            let _ = stdin.write_all(&input).await;
        }
    };
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let work = async {
        let ((), (out, out_cut), (err, err_cut), status) =
            tokio::join!(feed, capped(stdout), capped(stderr), child.wait());
        (out, out_cut, err, err_cut, status)
    };
    let ended = tokio::select! {
        done = work => Ok(done),
        () = call.cancel.cancelled() => Err("the call ended"),
        () = sleep_until(call.deadline) => Err("the call's time ran out"),
    };
    match ended {
        Ok((stdout, out_cut, stderr, err_cut, status)) => Ran {
            exit_code: match status {
                Ok(status) => exit_code(status),
                Err(_) => 127,
            },
            stdout,
            stderr,
            truncated: out_cut || err_cut,
        },
        Err(why) => {
            if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            Ran {
                exit_code: 137,
                stderr: format!("toolsrv: the command was killed: {why}\n").into_bytes(),
                ..Ran::default()
            }
        }
    }
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(127)
}

/// Reads `r` to its end, keeping at most [`MAX_OUTPUT`] bytes; true when some were dropped.
async fn capped(r: Option<impl AsyncRead + Unpin>) -> (Vec<u8>, bool) {
    let Some(mut r) = r else {
        return (Vec::new(), false);
    };
    let mut kept = Vec::new();
    let mut cut = false;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return (kept, cut),
            Ok(n) => {
                let room = MAX_OUTPUT - kept.len();
                kept.extend_from_slice(&buf[..n.min(room)]);
                cut |= n > room;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_are_bounded_and_a_long_one_is_skipped() {
        let input: &[u8] = b"short\nthis one is far too long\nlast";
        let mut r = BufReader::with_capacity(4, input);
        assert_eq!(
            read_line(&mut r, 10).await.ok(),
            Some(Line::Text(b"short".to_vec()))
        );
        assert_eq!(read_line(&mut r, 10).await.ok(), Some(Line::TooLong));
        assert_eq!(
            read_line(&mut r, 10).await.ok(),
            Some(Line::Text(b"last".to_vec()))
        );
        assert_eq!(read_line(&mut r, 10).await.ok(), Some(Line::Eof));
    }

    #[test]
    fn requests_are_checked() {
        let ok = Request::parse(br#"{"argv": ["stat", "/x"], "reason": "why", "stdin": "in"}"#);
        assert_eq!(
            ok,
            Ok(Request {
                argv: vec!["stat".into(), "/x".into()],
                reason: "why".into(),
                stdin: Some(b"in".to_vec()),
            })
        );
        for bad in [
            &b"not json"[..],
            br#"["stat"]"#,
            br#"{"argv": []}"#,
            br#"{"argv": [""]}"#,
            br#"{"argv": ["a", 1]}"#,
            br#"{"argv": ["a"], "reason": 3}"#,
            br#"{"argv": ["a"], "stdin": 3}"#,
        ] {
            assert!(
                Request::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        // 4,096 words pass; a line of megabytes of tiny values (hundreds of MB as a JSON tree)
        // is refused unbuilt, saying why.
        let words = format!(r#"{{"argv": ["a"{}]}}"#, r#", "b""#.repeat(4095));
        assert_eq!(Request::parse(words.as_bytes()).unwrap().argv.len(), 4096);
        let flood = format!(r#"{{"argv": ["a"], "x": [{}0]}}"#, "[0],".repeat(1 << 20));
        let refused = Request::parse(flood.as_bytes()).unwrap_err();
        assert!(refused.contains("more than 4104 JSON values"), "{refused}");
    }

    #[test]
    fn decisions_reach_their_request_and_a_closed_link_answers_all() {
        let pending = Arc::new(Pending::default());
        let mut waiter = pending.wait(7, 1).unwrap_or_else(|| unreachable!());
        let decision = |call_id, request_id| BypassDecision {
            call_id,
            request_id,
            approved: true,
            reason: String::new(),
        };
        assert!(!pending.deliver(decision(8, 1)), "another call's decision");
        assert!(pending.deliver(decision(7, 1)));
        assert!(waiter.rx.try_recv().is_ok());
        drop(waiter);
        assert!(!pending.deliver(decision(7, 1)), "used once");
        let mut waiter = pending.wait(7, 2).unwrap_or_else(|| unreachable!());
        pending.close();
        assert!(waiter.rx.try_recv().is_err());
        assert!(pending.wait(7, 3).is_none());
    }
}
