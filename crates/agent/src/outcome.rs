//! How a call's end is told to the coordinator: `CallResult` from an outcome or a refusal.

use std::time::Duration;

use toolsrv_exec::{Ending, Exit, LimitHit, Outcome};
use toolsrv_host::CallError;
use toolsrv_proto::limits::MAX_MESSAGE_BYTES;
use toolsrv_proto::v1::{CallResult, CallStatus};

/// The largest `result_json` sent on the link: half of what a message may hold
/// ([`MAX_MESSAGE_BYTES`], 16 MiB), the rest of a `CallFinished` being a few short fields. One
/// oversized message would end the link for every call on it, so a larger result (a large
/// `--result-cap` of control bytes, each escaped to six) is replaced by a short explanation.
/// The coordinator relays the result as it is, so it fits the client API's messages too.
pub const MAX_RESULT_JSON: usize = MAX_MESSAGE_BYTES / 2;

fn bounded_result(outcome: &Outcome) -> String {
    let json = outcome.result.to_string();
    if json.len() <= MAX_RESULT_JSON {
        return json;
    }
    let text = format!(
        "[toolsrv: the result ({} bytes as JSON) is too large to send; the output was streamed]",
        json.len()
    );
    let mut result = serde_json::json!({"content": [{"type": "text", "text": text}]});
    if !outcome.success() {
        result["isError"] = serde_json::Value::Bool(true);
    }
    result.to_string()
}

/// The result of a call that ran.
///
/// `timeout` is the call's effective timeout, for the message of a timed-out call.
pub fn finished(outcome: &Outcome, timeout: Duration) -> CallResult {
    let (exit_code, signal) = match outcome.exit {
        Exit::Code(code) => (Some(code), None),
        Exit::Signal(signo) => (None, Some(signo)),
    };
    let (status, message) = if outcome.success() {
        (CallStatus::Ok, String::new())
    } else {
        match outcome.ending {
            Ending::TimedOut => (CallStatus::TimedOut, format!("timed out after {timeout:?}")),
            Ending::Cancelled => (CallStatus::Cancelled, "call was cancelled".to_string()),
            Ending::Exited => (CallStatus::ToolError, exit_message(outcome.exit)),
        }
    };
    let message = limits_note(message, &outcome.limits_hit);
    CallResult {
        status: status.into(),
        exit_code,
        signal,
        duration_ms: u64::try_from(outcome.duration.as_millis()).unwrap_or(u64::MAX),
        truncated: outcome.truncated,
        result_json: bounded_result(outcome),
        message,
    }
}

/// `message` with the limits the call ran into, which explain a kill or a failed fork.
fn limits_note(message: String, hits: &[LimitHit]) -> String {
    let notes: Vec<&str> = hits
        .iter()
        .map(|hit| match hit {
            LimitHit::Memory => {
                "the call reached its memory limit: the kernel ended processes of it"
            }
            LimitHit::Pids => "the call reached its process limit: forks failed",
        })
        .collect();
    match (message.is_empty(), notes.is_empty()) {
        (_, true) => message,
        (true, false) => notes.join("; "),
        (false, false) => format!("{message}; {}", notes.join("; ")),
    }
}

fn exit_message(exit: Exit) -> String {
    match exit {
        Exit::Code(code) => format!("exited with code {code}"),
        Exit::Signal(signo) => format!("killed by signal {signo}"),
    }
}

/// The status a call that did not start ends with.
pub fn refusal_status(err: &CallError) -> CallStatus {
    match err {
        CallError::UnknownTool { .. } => CallStatus::UnknownTool,
        CallError::Hidden { .. } => CallStatus::Hidden,
        CallError::InvalidArgs { .. } | CallError::TimeoutTooLong { .. } => CallStatus::InvalidArgs,
        CallError::NoCommand(_) | CallError::Spawn { .. } => CallStatus::FailedToStart,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn outcome(exit: Exit, ending: Ending) -> Outcome {
        Outcome {
            exit,
            ending,
            duration: Duration::from_millis(1234),
            truncated: true,
            stdout_bytes: 0,
            stderr_bytes: 0,
            result: json!({"content": []}),
            limits_hit: Vec::new(),
        }
    }

    #[test]
    fn outcomes_map_to_statuses_and_messages() {
        let secs = Duration::from_secs(5);
        let cases = [
            (Exit::Code(0), Ending::Exited, CallStatus::Ok, ""),
            (
                Exit::Code(3),
                Ending::Exited,
                CallStatus::ToolError,
                "exited with code 3",
            ),
            (
                Exit::Signal(9),
                Ending::Exited,
                CallStatus::ToolError,
                "killed by signal 9",
            ),
            (
                Exit::Signal(15),
                Ending::TimedOut,
                CallStatus::TimedOut,
                "timed out after 5s",
            ),
            (
                Exit::Code(0),
                Ending::TimedOut,
                CallStatus::TimedOut,
                "timed out after 5s",
            ),
            (
                Exit::Signal(9),
                Ending::Cancelled,
                CallStatus::Cancelled,
                "call was cancelled",
            ),
        ];
        for (exit, ending, status, message) in cases {
            let r = finished(&outcome(exit, ending), secs);
            assert_eq!(r.status(), status, "{exit:?} {ending:?}");
            assert_eq!(r.message, message, "{exit:?} {ending:?}");
            assert_eq!(r.duration_ms, 1234);
            assert!(r.truncated);
            assert_eq!(r.result_json, r#"{"content":[]}"#);
        }
        let r = finished(&outcome(Exit::Code(3), Ending::Exited), secs);
        assert_eq!((r.exit_code, r.signal), (Some(3), None));
        let r = finished(&outcome(Exit::Signal(9), Ending::Exited), secs);
        assert_eq!((r.exit_code, r.signal), (None, Some(9)));
    }

    #[test]
    fn refusals_map_to_statuses() {
        let cases = [
            (
                CallError::UnknownTool {
                    name: "x".into(),
                    suggestion: String::new(),
                },
                CallStatus::UnknownTool,
            ),
            (
                CallError::Hidden {
                    name: "x".into(),
                    reason: "r".into(),
                },
                CallStatus::Hidden,
            ),
            (
                CallError::TimeoutTooLong {
                    name: "x".into(),
                    requested: Duration::from_secs(2),
                    max: Duration::from_secs(1),
                },
                CallStatus::InvalidArgs,
            ),
            (
                CallError::NoCommand(toolsrv_meta::CommandError {
                    name: "x".into(),
                    meta_dir: "/d".into(),
                }),
                CallStatus::FailedToStart,
            ),
        ];
        for (err, status) in cases {
            assert_eq!(refusal_status(&err), status, "{err}");
        }
    }

    #[test]
    fn oversized_results_are_replaced_not_sent() {
        let mut big = outcome(Exit::Code(1), Ending::Exited);
        big.result = json!({"content": [{"type": "text", "text": "\u{0}".repeat(2 << 20)}], "isError": true});
        let r = finished(&big, Duration::from_secs(5));
        assert!(r.result_json.len() < 1000, "{}", r.result_json.len());
        let result: serde_json::Value = serde_json::from_str(&r.result_json).unwrap();
        assert!(
            result["content"][0]["text"]
                .as_str()
                .unwrap()
                .contains("too large to send")
        );
        assert_eq!(result["isError"], true);
    }
}
