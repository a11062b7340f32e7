//! How `toolctl` quotes back a value it was given (a word of the command line, a name or an
//! argument an MCP client sent) in an error.

/// Longest part of a value that an error quotes back.
const MAX_QUOTED_CHARS: usize = 64;

/// `value` as an error quotes it: control and direction characters escaped, and cut after
/// [`MAX_QUOTED_CHARS`] characters, so that a huge or odd value does not come back whole onto a
/// terminal or into a model's context.
pub fn quoted(value: &str) -> String {
    let mut out: String = value
        .chars()
        .take(MAX_QUOTED_CHARS)
        .flat_map(char::escape_debug)
        .collect();
    let len = value.chars().count();
    if len > MAX_QUOTED_CHARS {
        out.push_str(&format!("… ({len} characters)"));
    }
    out
}

pub use toolsrv_proto::text::{printable, shell_words};

/// Prints `toolctl: MESSAGE` on stderr, [`printable`]: for an error that may quote what
/// someone else wrote (a file's name, a coordinator's answer quoting a name).
pub fn say(message: impl std::fmt::Display) {
    eprintln!("toolctl: {}", printable(&message.to_string()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_values_are_escaped_and_bounded() {
        assert_eq!(quoted("disk_usage"), "disk_usage");
        assert_eq!(quoted("a\0b\u{202e}c\n"), "a\\0b\\u{202e}c\\n");
        let huge = quoted(&"é".repeat(100_000));
        assert!(huge.starts_with(&"é".repeat(64)), "{huge}");
        assert!(huge.ends_with("… (100000 characters)"), "{huge}");
        assert!(huge.len() < 200);
    }
}
