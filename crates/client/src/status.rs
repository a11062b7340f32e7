//! Call statuses as the short snake_case names that `toolctl` prints and JSON output carries.

use toolsrv_proto::v1::CallStatus;

pub use toolsrv_proto::status_name;

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
