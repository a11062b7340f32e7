//! Approvals from the command line: answering the requests a `call` or `fanout` waits for
//! (`--approve`, `--deny`, or a y/N question on the terminal), and `toolctl approvals`,
//! `approve ID`, `deny ID` for requests someone else's call waits for.

use std::io::Write;

use crate::ApprovalRequest;
use serde_json::json;

use super::{ConnArgs, Remote, connect, marked, write_json, write_table};
use crate::cli::quote::{printable, shell_words};

/// How `call` and `fanout` answer the approval requests the caller may decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// `--approve`: approve every one, without asking.
    Approve,
    /// `--deny`: deny every one, without asking.
    Deny,
    /// Ask on the terminal; deny when there is none.
    Ask,
}

/// What the request asks for, in one line, every part [`printable`] (a bypass's command and
/// reason come from the tool that asks).
fn describe(request: &ApprovalRequest) -> String {
    format!(
        "{} by {} ({})",
        asked(request),
        printable(&request.caller),
        printable(&request.reason)
    )
}

/// The call or the command an approval request is for, in one line, every part [`printable`].
pub fn asked(request: &ApprovalRequest) -> String {
    let (tool, host) = (printable(&request.tool), printable(&request.host));
    // The host's own tool: what it does is vetted by no one but the host.
    let tool = if request.host_only {
        format!("`{tool}` (host-only: the host's own tool, not the catalog's)")
    } else {
        format!("`{tool}`")
    };
    if request.bypass_argv.is_empty() {
        format!(
            "call {tool} on host `{host}` with {}",
            printable(&request.args_json)
        )
    } else {
        let why = match request.bypass_reason.as_str() {
            "" => String::new(),
            reason => format!(", saying \"{}\"", printable(reason)),
        };
        format!(
            "{tool} on host `{host}` asks to run `{}` outside its sandbox{why}",
            shell_words(&request.bypass_argv)
        )
    }
}

/// Seconds until `expires_unix_ms`.
fn expires_in(request: &ApprovalRequest) -> u64 {
    request
        .expires_unix_ms
        .saturating_sub(toolsrv_proto::unix_ms())
        .div_ceil(1000)
}

/// Asks `question` on the controlling terminal; `None` when there is none (a script, a pipe).
///
/// The terminal is read without blocking a thread (polled every 50 ms while a person types), so
/// that dropping the future stops the question: a request decided elsewhere while it is asked
/// (`toolctl approve` from another shell) must not leave a reader that takes the user's next
/// line. Its own opening of `/dev/tty` is non-blocking; the shell's is not touched.
async fn ask_terminal(question: String) -> Option<bool> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // Written through a blocking opening: a slow terminal (a link with flow control) may not
    // take a 4 KiB question at once, and a non-blocking write would fail rather than wait.
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/tty")
        .ok()?;
    out.write_all(format!("{question} [y/N] ").as_bytes())
        .ok()?;
    out.flush().ok()?;
    let tty = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY)
        .open("/dev/tty")
        .ok()?;
    let mut line = Vec::new();
    let mut buf = [0u8; 256];
    // A line is what a person types: bounded, the rest of a pasted flood is not read.
    while !line.contains(&b'\n') && line.len() < 1024 {
        match (&tty).read(&mut buf) {
            Ok(0) => return None,
            Ok(n) => line.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    let line = String::from_utf8_lossy(&line);
    let answer = line.lines().next().unwrap_or("").trim();
    Some(matches!(answer, "y" | "Y" | "yes" | "YES" | "Yes"))
}

/// Tells the terminal that the question on it is withdrawn: the request was decided elsewhere.
fn withdraw_question(request: &ApprovalRequest) {
    if let Ok(mut tty) = std::fs::OpenOptions::new().write(true).open("/dev/tty") {
        let _ = writeln!(
            tty,
            "\ntoolctl: request {} was decided elsewhere; the question is withdrawn",
            printable(&request.id)
        );
    }
}

/// A question being answered on the terminal, then sent to the coordinator.
type Answering<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + 'a>>;

/// The approval questions of one command, asked on the terminal one at a time while its
/// stream goes on: output or a result of the host a question is about means the request was
/// decided elsewhere, and the question is withdrawn rather than left to hold up the output.
pub struct Prompts<'a> {
    remote: &'a Remote,
    answer: Answer,
    /// The request being answered, and its answering.
    asking: Option<(ApprovalRequest, Answering<'a>)>,
    queued: std::collections::VecDeque<ApprovalRequest>,
}

impl<'a> Prompts<'a> {
    pub fn new(remote: &'a Remote, answer: Answer) -> Self {
        Self {
            remote,
            answer,
            asking: None,
            queued: std::collections::VecDeque::new(),
        }
    }

    /// A request the call or fan-out waits for: answered now, or after the one being asked.
    pub fn request(&mut self, request: ApprovalRequest) {
        // The same request told again (who decides it changed) replaces the one waiting.
        self.queued.retain(|q| q.id != request.id);
        if self
            .asking
            .as_ref()
            .is_some_and(|(r, _)| r.id == request.id)
        {
            self.asking = None;
        }
        self.queued.push_back(request);
        self.next();
    }

    fn next(&mut self) {
        if self.asking.is_some() {
            return;
        }
        if let Some(request) = self.queued.pop_front() {
            let (remote, answer) = (self.remote, self.answer);
            let asked = request.clone();
            let answering = Box::pin(async move { answer_request(remote, &asked, answer).await });
            self.asking = Some((request, answering));
        }
    }

    /// Host `host` sent output or a result: its requests were decided.
    pub fn decided_on(&mut self, host: &str) {
        self.queued.retain(|q| q.host != host);
        if self.asking.as_ref().is_some_and(|(r, _)| r.host == host) {
            if let Some((request, _)) = self.asking.take() {
                withdraw_question(&request);
            }
            self.next();
        }
    }

    /// Runs the question being asked until it is answered; pending forever when none is.
    pub async fn answered(&mut self) {
        match &mut self.asking {
            Some((_, answering)) => {
                answering.await;
                self.asking = None;
                self.next();
            }
            None => std::future::pending().await,
        }
    }
}

/// Answers one request the running command's call waits for, as `answer` says; a request only
/// someone else may decide is announced and left to them.
pub async fn answer_request(remote: &Remote, request: &ApprovalRequest, answer: Answer) {
    if !request.caller_may_decide {
        eprintln!(
            "toolctl: waiting for approval by {} (request {}, expires in {} s): {}",
            request.approvers.join(" or "),
            request.id,
            expires_in(request),
            describe(request)
        );
        return;
    }
    let (approve, how) = match answer {
        Answer::Approve => (true, "--approve"),
        Answer::Deny => (false, "--deny"),
        Answer::Ask => {
            let question = format!("toolctl: approval needed: {}; approve?", describe(request));
            match ask_terminal(question).await {
                Some(yes) => (yes, "answered on the terminal"),
                None => {
                    eprintln!(
                        "toolctl: approval needed for {}, and no terminal to ask on: denied \
                         (pass --approve or --deny to decide without asking)",
                        describe(request)
                    );
                    (false, "no terminal to ask on")
                }
            }
        }
    };
    match remote.client.decide(&request.id, approve, how).await {
        Ok(()) => {}
        // Someone else (`toolctl approve` in another shell) or the timeout was first.
        Err(e) if e.code() == tonic::Code::NotFound => eprintln!(
            "toolctl: request {} was decided already (elsewhere, or it expired): this answer \
             does not count",
            printable(&request.id)
        ),
        Err(e) => eprintln!(
            "toolctl: cannot answer approval request {} at {}: {e}",
            request.id, remote.addr
        ),
    }
}

/// `toolctl approvals`: the pending requests this identity may decide.
pub async fn approvals(conn: &ConnArgs, json_out: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let requests = match remote.client.approvals().await {
        Ok(requests) => requests,
        Err(e) => return remote.fail("cannot list approval requests", &e),
    };
    let mut out = std::io::stdout().lock();
    let written = if json_out {
        let list: Vec<_> = requests.iter().map(request_json).collect();
        write_json(&mut out, &json!(list))
    } else {
        let rows: Vec<Vec<String>> = requests
            .iter()
            .map(|r| {
                vec![
                    printable(&r.id),
                    printable(&r.caller),
                    printable(&r.host),
                    marked(&r.tool, r.host_only),
                    format!("{} s", expires_in(r)),
                    if r.bypass_argv.is_empty() {
                        printable(&r.args_json)
                    } else {
                        format!("outside the sandbox: {}", shell_words(&r.bypass_argv))
                    },
                ]
            })
            .collect();
        let written = write_table(
            &mut out,
            &["ID", "CALLER", "HOST", "TOOL", "EXPIRES", "ARGUMENTS"],
            &rows,
        );
        if requests.iter().any(|r| r.args_json.ends_with(" bytes]")) {
            eprintln!(
                "toolctl: arguments longer than 4 KiB are cut here: `toolctl approvals --id ID` \
                 shows a request's whole"
            );
        }
        written
    };
    super::written(written, "the approval requests")
}

/// One request as `toolctl approvals --json` prints it.
fn request_json(r: &ApprovalRequest) -> serde_json::Value {
    json!({
        "id": r.id, "caller": r.caller, "host": r.host, "tool": r.tool,
        "args_json": r.args_json, "args_sha256": r.args_sha256,
        "approvers": r.approvers, "reason": r.reason,
        "fanout": (!r.fanout.is_empty()).then_some(&r.fanout),
        "bypass_argv": r.bypass_argv,
        "bypass_reason": (!r.bypass_argv.is_empty()).then_some(&r.bypass_reason),
        "expires_unix_ms": r.expires_unix_ms,
        "host_only": r.host_only,
    })
}

/// `toolctl approvals --id ID`: one pending request with its arguments whole, so that an
/// approver reads all of what it approves.
pub async fn approval(conn: &ConnArgs, id: &str, json_out: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let r = match remote.client.approval(id).await {
        Ok(request) => request,
        Err(e) => return remote.fail(&format!("cannot show request {}", printable(id)), &e),
    };
    let mut out = std::io::stdout().lock();
    let written = if json_out {
        write_json(&mut out, &request_json(&r))
    } else {
        // The arguments one key per line when they are JSON (they are, for a call), escaped:
        // they come from the caller.
        let args = serde_json::from_str::<serde_json::Value>(&r.args_json)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or_else(|| r.args_json.clone());
        let args: Vec<String> = args.lines().map(printable).collect();
        writeln!(
            out,
            "request {}\n{}\nexpires in {} s; decided by {}\narguments ({} bytes, SHA-256 {}):\n{}",
            printable(&r.id),
            describe(&r),
            expires_in(&r),
            if r.caller_may_decide {
                "the caller".to_string()
            } else {
                r.approvers.join(" or ")
            },
            r.args_json.len(),
            r.args_sha256,
            args.join("\n")
        )
    };
    super::written(written, "the approval request")
}

/// `toolctl approve ID` / `toolctl deny ID [--reason TEXT]`.
pub async fn decide(conn: &ConnArgs, id: &str, approve: bool, reason: &str) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let verb = if approve { "approve" } else { "deny" };
    match remote.client.decide(id, approve, reason).await {
        Ok(()) => {
            let past = if approve { "approved" } else { "denied" };
            eprintln!("toolctl: {past} request {id}");
            0
        }
        Err(e) => remote.fail(&format!("cannot {verb} request {id}"), &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_for_a_host_s_own_tool_says_so_in_both_forms() {
        let call = ApprovalRequest {
            tool: "wipe".into(),
            host: "a".into(),
            args_json: "{}".into(),
            host_only: true,
            ..ApprovalRequest::default()
        };
        assert_eq!(
            asked(&call),
            "call `wipe` (host-only: the host's own tool, not the catalog's) on host `a` with {}"
        );
        let bypass = ApprovalRequest {
            bypass_argv: vec!["rm".into(), "-rf".into(), "/srv/a b".into()],
            ..call.clone()
        };
        assert_eq!(
            asked(&bypass),
            "`wipe` (host-only: the host's own tool, not the catalog's) on host `a` asks to run \
             `rm -rf '/srv/a b'` outside its sandbox"
        );
        let shipped = ApprovalRequest {
            host_only: false,
            ..call
        };
        assert_eq!(asked(&shipped), "call `wipe` on host `a` with {}");
    }
}
