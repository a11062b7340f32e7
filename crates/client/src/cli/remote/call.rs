//! `toolctl call`: run one tool on one host with live output, and exit as the tool did.

use std::io::Write;

use crate::{CallRequest, CallResult, CallStatus, CallUpdate, OutputStream, status_name};

use super::{ConnArgs, exit, interrupted, note_strings, prepare_run};

/// Options of `toolctl call`.
#[derive(Debug)]
pub struct CallOptions {
    /// Working directory on the host; the agent's default when `None`.
    pub cwd: Option<String>,
    /// Timeout in seconds; the agent's default when `None`.
    pub timeout: Option<f64>,
    /// Print the final `result_json` instead of streaming stdout.
    pub print_result: bool,
    /// How to answer approval requests this caller may decide.
    pub answer: super::Answer,
}

pub async fn call(
    conn: &ConnArgs,
    host: &str,
    tool: &str,
    args: &[String],
    opts: CallOptions,
) -> u8 {
    let (remote, prepared) = match prepare_run(conn, args, opts.timeout).await {
        Ok(prepared) => prepared,
        Err(code) => return code,
    };
    let super::Prepared {
        args_json,
        string_keys,
        timeout_ms,
    } = prepared;
    let request = CallRequest {
        host: host.to_string(),
        tool: tool.to_string(),
        args_json,
        cwd: opts.cwd.unwrap_or_default(),
        timeout_ms,
        session: String::new(),
    };
    let what = || format!("cannot call `{tool}` on host `{host}`");
    let mut stream = match remote.client.call(request).await {
        Ok(stream) => stream,
        Err(e) => return remote.fail(&what(), &e),
    };
    let (mut stdout, mut stderr) = (std::io::stdout(), std::io::stderr());
    let mut prompts = super::approve::Prompts::new(&remote, opts.answer);
    loop {
        let update = tokio::select! {
            update = stream.next() => update,
            () = prompts.answered() => continue,
            () = interrupted() => {
                // Dropping the stream resets it, which cancels the call on the host.
                drop(stream);
                eprintln!("toolctl: interrupted: cancelled `{tool}` on host `{host}`");
                return exit::CANCELLED;
            }
        };
        if matches!(
            update,
            Some(Ok(CallUpdate::Output(_) | CallUpdate::Result(_)))
        ) {
            prompts.decided_on(host);
        }
        match update {
            Some(Ok(CallUpdate::Output(chunk))) => {
                // A reader that went away (`| head`) must not end the call with an error here.
                if chunk.stream == OutputStream::Stderr as i32 {
                    let _ = stderr.write_all(&chunk.data);
                } else if !opts.print_result {
                    let _ = stdout.write_all(&chunk.data).and_then(|()| stdout.flush());
                }
            }
            Some(Ok(CallUpdate::Approval(request))) => prompts.request(request),
            Some(Ok(CallUpdate::Result(result))) => {
                if opts.print_result && !result.result_json.is_empty() {
                    crate::cli::say_out(&result.result_json);
                }
                if result.status != CallStatus::Ok as i32 {
                    eprintln!("toolctl: {}", failure_line(host, tool, &result));
                    note_strings(&string_keys, &result);
                }
                return exit_code(&result);
            }
            Some(Err(e @ crate::ClientError::Transport { .. })) => {
                eprintln!("toolctl: {}", broke_mid_call(tool, host, &e));
                return super::error_code(&e);
            }
            Some(Err(e)) => return remote.fail(&what(), &e),
            // `CallStream` yields an error before ending without a result.
            None => {
                let e = crate::ClientError::Protocol("the stream ended without a result".into());
                return remote.fail(&what(), &e);
            }
        }
    }
}

/// What is known of a call whose connection to the coordinator broke after it was sent (the
/// coordinator went away, or the network between): the tool may have run, and may have
/// finished. `toolctl call` and `toolctl mcp` say it in the same words.
pub(crate) fn broke_mid_call(tool: &str, host: &str, e: &crate::ClientError) -> String {
    format!(
        "the connection to the coordinator broke during the call of `{tool}` on host `{host}` \
         ({}): whether the tool finished is not known (a coordinator stops the calls of a \
         caller it loses, and a host those of a coordinator it loses); check before calling it \
         again if it changes anything",
        toolsrv_proto::text::printable_line(&e.to_string(), 200)
    )
}

/// What `toolctl call` prints when a call did not end OK. A call refused before anything ran
/// (unknown host or tool, hidden, offline, denied, busy, bad arguments) prints the message as the
/// coordinator or agent worded it, the same words `describe`, `tools` and `fanout` use for the
/// same condition; a tool that ran and failed is named with its host:
/// `` tool `fail` on host `web-1`: exited with code 3 ``. Control and direction characters are
/// escaped.
pub fn failure_line(host: &str, tool: &str, result: &CallResult) -> String {
    let message = result.message.trim();
    let refused = matches!(
        CallStatus::try_from(result.status),
        Ok(CallStatus::UnknownHost
            | CallStatus::UnknownTool
            | CallStatus::Hidden
            | CallStatus::Offline
            | CallStatus::Denied
            | CallStatus::Busy
            | CallStatus::InvalidArgs
            | CallStatus::FailedToStart)
    );
    let line = match message {
        "" => format!(
            "tool `{tool}` on host `{host}`: {}",
            status_name(result.status).replace('_', " ")
        ),
        message if refused => message.to_string(),
        message => format!("tool `{tool}` on host `{host}`: {message}"),
    };
    // It may quote what the caller typed (an unknown tool's name): one escaped line.
    crate::cli::quote::printable(&line)
}

/// The exit code `toolctl call` ends with for a call's result, the same as `toolctl local call`
/// for the outcomes both can have.
pub fn exit_code(result: &CallResult) -> u8 {
    let exited = || match (result.exit_code, result.signal) {
        (_, Some(signal)) => 128u8.saturating_add(u8::try_from(signal).unwrap_or(127)),
        // A tool error that exited 0 cannot happen; do not turn it into success.
        (Some(0), None) | (None, None) => 1,
        (Some(code), None) => u8::try_from(code).unwrap_or(1),
    };
    match CallStatus::try_from(result.status) {
        Ok(CallStatus::Ok) => 0,
        Ok(CallStatus::ToolError) => exited(),
        Ok(CallStatus::TimedOut) => exit::TIMED_OUT,
        Ok(CallStatus::InvalidArgs) => exit::INVALID_ARGS,
        Ok(CallStatus::Hidden) => exit::HIDDEN,
        Ok(CallStatus::UnknownHost | CallStatus::UnknownTool) => exit::NOT_FOUND,
        Ok(CallStatus::FailedToStart) => exit::CANNOT_START,
        Ok(CallStatus::Offline | CallStatus::Lost | CallStatus::Busy) => exit::UNAVAILABLE,
        Ok(CallStatus::Denied | CallStatus::Unconfined) => exit::DENIED,
        Ok(CallStatus::Cancelled) => exit::CANCELLED,
        // Skipped only happens in fan-outs; a status we do not know is the coordinator's doing.
        Ok(CallStatus::Skipped) => exit::FANOUT_FAILED,
        Ok(CallStatus::Unspecified) | Err(_) => exit::INTERNAL,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(status: CallStatus, exit_code: Option<i32>, signal: Option<i32>) -> CallResult {
        CallResult {
            status: status as i32,
            exit_code,
            signal,
            ..Default::default()
        }
    }

    #[test]
    fn statuses_map_to_exit_codes() {
        use CallStatus as S;
        let cases = [
            (result(S::Ok, Some(0), None), 0),
            (result(S::ToolError, Some(3), None), 3),
            (result(S::ToolError, None, Some(9)), 137),
            (result(S::ToolError, None, None), 1),
            (result(S::ToolError, Some(0), None), 1),
            (result(S::TimedOut, None, Some(9)), 124),
            (result(S::TimedOut, Some(0), None), 124),
            (result(S::InvalidArgs, None, None), 65),
            (result(S::Hidden, None, None), 69),
            (result(S::UnknownTool, None, None), 127),
            (result(S::UnknownHost, None, None), 127),
            (result(S::FailedToStart, None, None), 126),
            (result(S::Offline, None, None), 75),
            (result(S::Lost, None, None), 75),
            (result(S::Denied, None, None), 77),
            (result(S::Cancelled, None, None), 130),
            (result(S::Skipped, None, None), 1),
            (result(S::Unspecified, None, None), 70),
        ];
        for (r, code) in cases {
            assert_eq!(exit_code(&r), code, "{r:?}");
        }
        let unknown = CallResult {
            status: 99,
            ..Default::default()
        };
        assert_eq!(exit_code(&unknown), 70);
    }

    #[test]
    fn failure_lines_say_what_happened_without_status_codes() {
        let mut r = result(CallStatus::Hidden, None, None);
        r.message = "tool `ls` is hidden on host `web-1`: no variant matches".into();
        assert_eq!(
            failure_line("web-1", "ls", &r),
            "tool `ls` is hidden on host `web-1`: no variant matches"
        );
        let mut r = result(CallStatus::ToolError, Some(3), None);
        r.message = "exited with code 3".into();
        assert_eq!(
            failure_line("web-1", "fail", &r),
            "tool `fail` on host `web-1`: exited with code 3"
        );
        let r = result(CallStatus::TimedOut, None, Some(9));
        assert_eq!(
            failure_line("web-1", "slow", &r),
            "tool `slow` on host `web-1`: timed out"
        );
    }
}
