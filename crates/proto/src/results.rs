//! Results that carry no process: what the coordinator and the agent both answer for a call
//! that did not run (unknown host, hidden tool, refused arguments, lost link...).

use crate::limits::MAX_MESSAGE_TEXT;
use crate::v1::{CallResult, CallStatus};

impl CallResult {
    /// A result with only `status` and `message` (cut to [`MAX_MESSAGE_TEXT`] bytes, saying
    /// so: a refusal can quote the arguments, and arguments may be large).
    pub fn not_run(status: CallStatus, message: impl Into<String>) -> Self {
        Self {
            status: status.into(),
            message: bounded_text(message.into()),
            ..Self::default()
        }
    }
}

/// `text` cut to at most [`MAX_MESSAGE_TEXT`] bytes (on a character boundary), saying so.
fn bounded_text(mut text: String) -> String {
    if text.len() <= MAX_MESSAGE_TEXT {
        return text;
    }
    let total = text.len();
    let mut end = MAX_MESSAGE_TEXT - 100;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push_str(&format!("… [toolsrv: message cut, {total} bytes in all]"));
    text
}

/// The short name of a `CallStatus` value: `ok`, `tool_error`, `hidden`, ...; `unknown` for values
/// this client does not know (a newer coordinator) and `unspecified` for 0.
pub fn status_name(status: i32) -> &'static str {
    match CallStatus::try_from(status) {
        Ok(CallStatus::Unspecified) => "unspecified",
        Ok(CallStatus::Ok) => "ok",
        Ok(CallStatus::ToolError) => "tool_error",
        Ok(CallStatus::Hidden) => "hidden",
        Ok(CallStatus::Offline) => "offline",
        Ok(CallStatus::Lost) => "lost",
        Ok(CallStatus::TimedOut) => "timed_out",
        Ok(CallStatus::Denied) => "denied",
        Ok(CallStatus::UnknownHost) => "unknown_host",
        Ok(CallStatus::UnknownTool) => "unknown_tool",
        Ok(CallStatus::InvalidArgs) => "invalid_args",
        Ok(CallStatus::Cancelled) => "cancelled",
        Ok(CallStatus::Skipped) => "skipped",
        Ok(CallStatus::FailedToStart) => "failed_to_start",
        Ok(CallStatus::Busy) => "busy",
        Ok(CallStatus::Unconfined) => "unconfined",
        Err(_) => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_saying_so() {
        let long = format!("bad value {}", "é".repeat(MAX_MESSAGE_TEXT));
        let r = CallResult::not_run(CallStatus::InvalidArgs, long.clone());
        assert!(r.message.len() <= MAX_MESSAGE_TEXT, "{}", r.message.len());
        assert!(r.message.starts_with("bad value é"));
        assert!(
            r.message
                .ends_with(&format!("{} bytes in all]", long.len()))
        );
        let short = CallResult::not_run(CallStatus::InvalidArgs, "short");
        assert_eq!(short.message, "short");
        assert_eq!(short.status, CallStatus::InvalidArgs as i32);
        assert_eq!(short.exit_code, None);
    }
}
