//! How a call's end is told to the coordinator: `CallResult` from an outcome or a refusal.

use std::time::Duration;

use toolsrv_exec::{Ending, Exit, Outcome};
use toolsrv_host::CallError;
use toolsrv_proto::v1::{CallResult, CallStatus};

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
    CallResult {
        status: status.into(),
        exit_code,
        signal,
        duration_ms: u64::try_from(outcome.duration.as_millis()).unwrap_or(u64::MAX),
        truncated: outcome.truncated,
        result_json: outcome.result.to_string(),
        message,
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
        CallError::UnknownTool(_) => CallStatus::UnknownTool,
        CallError::Hidden { .. } => CallStatus::Hidden,
        CallError::InvalidArgs { .. } | CallError::TimeoutTooLong { .. } => CallStatus::InvalidArgs,
        CallError::NoCommand(_) | CallError::Spawn { .. } => CallStatus::FailedToStart,
    }
}

/// The result of a call that did not run.
pub fn not_run(status: CallStatus, message: impl Into<String>) -> CallResult {
    CallResult {
        status: status.into(),
        message: message.into(),
        ..CallResult::default()
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
            (CallError::UnknownTool("x".into()), CallStatus::UnknownTool),
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
}
