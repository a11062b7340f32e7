//! Tool names: the one rule for which names are tools, shared by the registry scan, the agent's
//! catalog store and the linter, so a name the coordinator serves is a name every agent accepts.

/// The rule, as error messages state it.
pub const NAME_RULE: &str = "tool names match [A-Za-z0-9_.-]+, are at most 250 bytes long, do \
                             not start with `.` and do not end in `.meta`";

/// Longest tool name: the file `N.meta` that defines a tool `N` must fit in a file name (255
/// bytes on Linux and macOS).
pub const MAX_NAME_BYTES: usize = 250;

/// Why `name` is not a valid tool name, or `None` when it is one.
///
/// A tool named `N` is the file `N.meta`, with its executable (if any) the file `N` beside it.
/// Beyond the character set `[A-Za-z0-9_.-]+`, two shapes are refused because they collide with
/// other files on disk, in the tools path as in an agent's materialized catalog:
/// - a name ending in `.meta`: the executable of `x.meta` would be the file `x.meta`, which is
///   the definition of the tool `x` (so `x.meta.meta` is refused on both sides, not served by
///   the coordinator only to be refused by every agent);
/// - a name starting with `.`: dot-files are never tools (temp files are dot-files, and `.` and
///   `..` are not files at all), so such a tool would be written but never found.
pub fn name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        return Some("it is empty");
    }
    if name.len() > MAX_NAME_BYTES {
        return Some("it is longer than 250 bytes (its `.meta` could not be a file)");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Some("it has characters outside [A-Za-z0-9_.-]");
    }
    if name.starts_with('.') {
        return Some("it starts with `.` (dot-files are never tools)");
    }
    if name.ends_with(".meta") {
        return Some(
            "it ends in `.meta` (its executable would be the file that defines the tool without that suffix)",
        );
    }
    None
}

/// True when `name` may name a tool (see [`name_problem`] for the rule and why).
pub fn is_valid_name(name: &str) -> bool {
    name_problem(name).is_none()
}

/// The tool a file of a tools directory declares, by its file name: `N.meta` declares `N`.
///
/// `None` for files that are no tool definition at all: without the `.meta` suffix, or dot-files
/// (temp files, editors' swap files). The name returned may still be invalid; check it with
/// [`name_problem`], so a file such as `bad name.meta` is reported rather than ignored.
pub fn tool_name_of(file_name: &str) -> Option<&str> {
    if file_name.starts_with('.') {
        return None;
    }
    file_name.strip_suffix(".meta")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let cases = [
            ("disk-usage", true),
            ("a.b_c-1", true),
            ("x.metadata", true),
            ("metax", true),
            ("", false),
            (".", false),
            ("..", false),
            ("..x", false),
            (".hidden", false),
            ("../x", false),
            ("a/b", false),
            ("/abs", false),
            ("x.meta", false),
            ("sp ace", false),
            ("ünï", false),
            (&"a".repeat(MAX_NAME_BYTES), true),
            (&"a".repeat(MAX_NAME_BYTES + 1), false),
        ];
        for (name, ok) in cases {
            assert_eq!(is_valid_name(name), ok, "{name:?}");
        }
        // The words state the bound the code holds.
        let bound = MAX_NAME_BYTES.to_string();
        assert!(NAME_RULE.contains(&bound));
        assert!(name_problem(&"a".repeat(MAX_NAME_BYTES + 1)).is_some_and(|p| p.contains(&bound)));
    }

    #[test]
    fn file_names() {
        let cases = [
            ("x.meta", Some("x")),
            ("x.meta.meta", Some("x.meta")),
            ("bad name.meta", Some("bad name")),
            ("x", None),
            ("x.meta~", None),
            (".x.meta", None),
            (".tmp-x.meta-0123", None),
        ];
        for (file, name) in cases {
            assert_eq!(tool_name_of(file), name, "{file:?}");
        }
    }
}
