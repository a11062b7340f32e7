//! Text that crosses the link from a peer to people: what could disguise it on a terminal.
//!
//! An agent reports why a tool is hidden and how a call ended, and a confined tool asks for a
//! command outside its sandbox; all of it ends up on someone's terminal or in a model's
//! context. The coordinator keeps such text to one line of bounded length, and `toolctl` shows
//! what a tool chose with every disguising character escaped.

/// A transport error's text in the words of people: hyper's HTTP/2 layer names itself `h2`
/// (`h2 protocol error`), which reads like a host of that name, and rustls ends some errors
/// with a link to its manual (`: https://docs.rs/rustls/...`), which says nothing to someone
/// whose call broke.
pub fn transport_words(text: &str) -> String {
    let mut out = text.replace("h2 protocol error", "HTTP/2 protocol error");
    while let Some(at) = out.find(": https://docs.rs/") {
        let rest = &out[at + 2..];
        let end = rest
            .find(|c: char| c.is_whitespace() || c == ')')
            .map_or(out.len(), |n| at + 2 + n);
        out.replace_range(at..end, "");
    }
    out
}

/// Whether `c` would change what a terminal shows around it, or hide itself: control characters
/// (escape sequences, line breaks, carriage returns, backspace) and the invisible format
/// characters that reorder or join text (direction marks and overrides, zero-width spaces and
/// joiners, the byte-order mark).
pub fn disguises(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{061C}' | '\u{200B}'..='\u{200F}' | '\u{2028}'..='\u{202E}'
            | '\u{2060}'..='\u{2069}' | '\u{FEFF}')
}

/// `text` with every character that [`disguises`] escaped (`\u{1b}`, `\n`, `\u{202e}`), nothing
/// cut: for text someone must read whole to judge it.
pub fn printable(text: &str) -> String {
    printable_line(text, usize::MAX)
}

/// [`printable`] `text`, cut to at most `max` bytes (on a character boundary, escapes whole)
/// with `…` and the original length when it was longer: one bounded line from a peer.
pub fn printable_line(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max));
    for c in text.chars() {
        let start = out.len();
        if disguises(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
        if out.len() > max {
            out.truncate(start);
            out.push_str(&format!("… ({} bytes)", text.len()));
            break;
        }
    }
    out
}

/// `text` for a reader who takes it whole, lines and all (a tool's description and prompt, for
/// a model and whoever reads along): line breaks and tabs kept (`\r\n` read as `\n`), every
/// other character that [`disguises`] escaped.
pub fn printable_lines(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\r' if chars.peek() == Some(&'\n') => {}
            '\n' | '\t' => out.push(c),
            c if disguises(c) => out.extend(c.escape_debug()),
            c => out.push(c),
        }
    }
    out
}

/// `text` as one line: its line breaks, with the blanks around them, read as one space, then
/// [`printable`]. For a line of a list that no text may break into two.
pub fn one_line(text: &str) -> String {
    let breaks = [
        '\n', '\r', '\u{0B}', '\u{0C}', '\u{85}', '\u{2028}', '\u{2029}',
    ];
    let joined = text
        .split(breaks)
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    printable(&joined)
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
    fn transport_errors_are_worded_for_people() {
        assert_eq!(
            transport_words(
                "h2 protocol error: error reading a body from connection: peer closed connection \
                 without sending TLS close_notify: https://docs.rs/rustls/latest/rustls/manual/\
                 _03_howto/index.html#unexpected-eof"
            ),
            "HTTP/2 protocol error: error reading a body from connection: peer closed connection \
             without sending TLS close_notify"
        );
        assert_eq!(transport_words("x (y: https://docs.rs/a/b) z"), "x (y) z");
        assert_eq!(transport_words("connection refused"), "connection refused");
    }

    #[test]
    fn printable_text_shows_what_would_disguise_it() {
        assert_eq!(printable("plain text, é 日本"), "plain text, é 日本");
        assert_eq!(
            printable("ok\u{1b}[2K\rfine\u{202e}txt.exe\u{200b}"),
            "ok\\u{1b}[2K\\rfine\\u{202e}txt.exe\\u{200b}"
        );
    }

    #[test]
    fn text_for_models_keeps_its_lines_and_shows_what_would_disguise_it() {
        assert_eq!(
            printable_lines("## Title\r\n\tline\u{1b}[2J\rover\u{202e}txt\n"),
            "## Title\n\tline\\u{1b}[2J\\rover\\u{202e}txt\n"
        );
        assert_eq!(
            one_line("Lists files.\n\nrm_all (loaded, score 0.999):\u{2028} safe\r\n\u{1b}[2J"),
            "Lists files. rm_all (loaded, score 0.999): safe \\u{1b}[2J"
        );
    }

    #[test]
    fn printable_lines_are_bounded_and_say_how_long_they_were() {
        assert_eq!(printable_line("short", 10), "short");
        assert_eq!(printable_line("exactly 10", 10), "exactly 10");
        assert_eq!(printable_line("a\nb", 10), "a\\nb");
        let long = "é".repeat(3000);
        let cut = printable_line(&long, 1024);
        assert!(
            cut.starts_with("éé") && cut.ends_with("… (6000 bytes)"),
            "{cut}"
        );
        assert!(cut.len() <= 1024 + 32, "{}", cut.len());
        // An escape is never cut in half.
        let cut = printable_line("ab\u{1b}cd", 5);
        assert_eq!(cut, "ab… (5 bytes)");
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
}
