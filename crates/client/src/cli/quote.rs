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

/// Whether `c` would change what a terminal shows around it, or hide itself: control
/// characters (escape sequences, line breaks, backspace) and the invisible format characters
/// that reorder or join text (direction marks and overrides, zero-width spaces and joiners).
fn disguises(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{061C}' | '\u{200B}'..='\u{200F}' | '\u{2028}'..='\u{202E}'
            | '\u{2060}'..='\u{2069}' | '\u{FEFF}')
}

/// `text` with every character that [`disguises`] escaped (`\u{1b}`, `\n`, `\u{202e}`),
/// nothing cut: for text someone must read whole to judge it, such as what an approval
/// request asks for, which a hostile tool or host may have written.
pub fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if disguises(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

/// `argv` as a POSIX shell would read it back: words that need no quoting as they are, others
/// in single quotes, and words holding a character that [`disguises`] in `$'...'` with that
/// character escaped. The words' bounds and every character stay visible, so a command cannot
/// pass for another on an approver's screen.
pub fn shell_words(argv: &[String]) -> String {
    let plain = |c: char| c.is_alphanumeric() || "_-./:=@%+,".contains(c);
    let mut out = String::new();
    for (i, word) in argv.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        if !word.is_empty() && word.chars().all(|c| plain(c) && !disguises(c)) {
            out.push_str(word);
        } else if !word.chars().any(disguises) {
            out.push('\'');
            out.push_str(&word.replace('\'', r"'\''"));
            out.push('\'');
        } else {
            out.push_str("$'");
            for c in word.chars() {
                match c {
                    '\'' => out.push_str(r"\'"),
                    '\\' => out.push_str(r"\\"),
                    '\n' => out.push_str(r"\n"),
                    '\t' => out.push_str(r"\t"),
                    '\u{1b}' => out.push_str(r"\e"),
                    c if (c as u32) < 0x80 && disguises(c) => {
                        out.push_str(&format!("\\x{:02x}", c as u32));
                    }
                    c if disguises(c) => out.push_str(&format!("\\u{:04x}", c as u32)),
                    c => out.push(c),
                }
            }
            out.push('\'');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_text_shows_what_would_disguise_it() {
        assert_eq!(printable("plain text, é 日本"), "plain text, é 日本");
        assert_eq!(
            printable("ok\u{1b}[2K\rfine\u{202e}txt.exe\u{200b}"),
            "ok\\u{1b}[2K\\rfine\\u{202e}txt.exe\\u{200b}"
        );
    }

    #[test]
    fn shell_words_keep_each_word_and_character_visible() {
        let words = |w: &[&str]| shell_words(&w.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(
            words(&["chmod", "0644", "/srv/app/config"]),
            "chmod 0644 /srv/app/config"
        );
        // Bounds of words that hold spaces or shell syntax stay visible.
        assert_eq!(
            words(&["rm", "/srv/a /etc/shadow"]),
            "rm '/srv/a /etc/shadow'"
        );
        assert_eq!(words(&["sh", "-c", "it's; id"]), r"sh -c 'it'\''s; id'");
        assert_eq!(words(&["touch", ""]), "touch ''");
        // What would rewrite the line is escaped, in a form a shell reads back the same.
        assert_eq!(
            words(&["ls\u{1b}[2K\rrm", "-rf", "/\u{202e}x\n"]),
            r"$'ls\e[2K\x0drm' -rf $'/\u202ex\n'"
        );
        assert_eq!(words(&["a'b\\\u{7}"]), r"$'a\'b\\\x07'");
    }

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
