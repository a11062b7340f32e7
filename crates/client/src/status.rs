//! Call statuses as the short snake_case names that `toolctl` prints and JSON output carries.

use toolsrv_proto::v1::CallStatus;

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

/// True when `status` is `CALL_STATUS_OK`.
pub fn is_ok(status: i32) -> bool {
    status == CallStatus::Ok as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_the_proto_names() {
        for value in 0..=15 {
            let proto = CallStatus::try_from(value).unwrap().as_str_name();
            let expected = proto.strip_prefix("CALL_STATUS_").unwrap().to_lowercase();
            assert_eq!(status_name(value), expected, "status {value}");
        }
        assert_eq!(status_name(99), "unknown");
        assert!(is_ok(1));
        assert!(!is_ok(2));
    }
}
