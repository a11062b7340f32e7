//! Approvals from the command line: answering the requests a `call` or `fanout` waits for
//! (`--approve`, `--deny`, or a y/N question on the terminal), and `toolctl approvals`,
//! `approve ID`, `deny ID` for requests someone else's call waits for.

use std::io::{BufRead, Write};

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
async fn ask_terminal(question: String) -> Option<bool> {
    tokio::task::spawn_blocking(move || {
        let tty = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/tty")
            .ok()?;
        let mut out = tty.try_clone().ok()?;
        write!(out, "{question} [y/N] ").ok()?;
        out.flush().ok()?;
        let mut line = String::new();
        std::io::BufReader::new(tty).read_line(&mut line).ok()?;
        Some(matches!(line.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
    })
    .await
    .ok()
    .flatten()
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
    if let Err(e) = remote.client.decide(&request.id, approve, how).await {
        eprintln!(
            "toolctl: cannot answer approval request {} at {}: {e}",
            request.id, remote.addr
        );
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
        let list: Vec<_> = requests
            .iter()
            .map(|r| {
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
            })
            .collect();
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
        write_table(
            &mut out,
            &["ID", "CALLER", "HOST", "TOOL", "EXPIRES", "ARGUMENTS"],
            &rows,
        )
    };
    super::written(written, "the approval requests")
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
