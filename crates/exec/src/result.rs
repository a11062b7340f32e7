//! Turning what a tool wrote into its tool result

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Map, Value, json};

use crate::event::{Ending, Exit};
use crate::output::CaptureState;

/// Builds a tool result from the tool's stdout
///
/// On success, stdout that is a JSON object with a `content` array is the
/// result as is. Anything else is wrapped as one text item,
/// `{"content":[{"type":"text","text":<stdout as lossy UTF-8>}]}`, with `note`
/// on a line of its own after the text. On failure the result always gets
/// `"isError": true`. A note given with a structured success result is added
/// as a last text item.
pub fn tool_result(stdout: &[u8], success: bool, note: Option<&str>) -> Value {
    if success && let Some(mut structured) = structured(stdout) {
        if let Some(note) = note
            && let Some(Value::Array(content)) = structured.get_mut("content")
        {
            content.push(text_item(note.to_owned()));
        }
        return structured;
    }
    let mut text = String::from_utf8_lossy(stdout).into_owned();
    if let Some(note) = note {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(note);
    }
    let mut result = Map::new();
    result.insert("content".to_owned(), Value::Array(vec![text_item(text)]));
    if !success {
        result.insert("isError".to_owned(), Value::Bool(true));
    }
    Value::Object(result)
}

/// Stdout parsed as a structured result, if it is one
fn structured(stdout: &[u8]) -> Option<Value> {
    let value: Value = serde_json::from_slice(stdout).ok()?;
    value
        .get("content")
        .is_some_and(Value::is_array)
        .then_some(value)
}

fn text_item(text: String) -> Value {
    json!({ "type": "text", "text": text })
}

/// The result of a finished call from what was collected of its output
///
/// A failed tool that wrote nothing to stdout is explained by its stderr, and
/// a call that did not end with an exit code gets a note saying why.
pub(crate) fn outcome_result(
    captured: &CaptureState,
    exit: Exit,
    ending: Ending,
    timeout: Duration,
) -> Value {
    let success = ending == Ending::Exited && exit == Exit::Code(0);
    let use_stdout = success || captured.stdout_delivered > 0;
    let (text, delivered) = if use_stdout {
        (captured.stdout.as_slice(), captured.stdout_delivered)
    } else {
        (captured.stderr.as_slice(), captured.stderr_delivered)
    };
    // Only the start of a large output is kept for the result; say so rather than pass it off
    // as the whole.
    let partial = (text.len() as u64) < delivered;
    let cut = partial.then(|| {
        format!(
            "[toolsrv: the result holds the first {} of {delivered} bytes; the rest was streamed]",
            text.len()
        )
    });
    if success {
        return tool_result(text, true, cut.as_deref());
    }
    let why = match (ending, exit) {
        (Ending::TimedOut, _) => Some(format!("tool timed out after {timeout:?}")),
        (Ending::Cancelled, _) => Some("tool was cancelled".to_owned()),
        (Ending::Exited, Exit::Signal(signo)) => Some(match Signal::try_from(signo) {
            Ok(signal) => format!("tool killed by signal {signo} ({signal})"),
            Err(_) => format!("tool killed by signal {signo}"),
        }),
        (Ending::Exited, Exit::Code(code)) if text.is_empty() => {
            Some(format!("tool exited with code {code}"))
        }
        (Ending::Exited, Exit::Code(_)) => None,
    };
    let note = match (cut, why) {
        (Some(cut), Some(why)) => Some(format!("{cut}\n{why}")),
        (cut, why) => cut.or(why),
    };
    tool_result(text, false, note.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_result_table() {
        let structured = r#"{"content":[{"type":"text","text":"hi"}],"extra":1}"#;
        let cases: [(&str, bool, Option<&str>, Value); 8] = [
            (
                structured,
                true,
                None,
                json!({"content":[{"type":"text","text":"hi"}],"extra":1}),
            ),
            (
                structured,
                false,
                None,
                json!({"content":[{"type":"text","text":structured}],"isError":true}),
            ),
            (
                "hello\n",
                true,
                None,
                json!({"content":[{"type":"text","text":"hello\n"}]}),
            ),
            (
                r#"{"content":"not an array"}"#,
                true,
                None,
                json!({"content":[{"type":"text","text":r#"{"content":"not an array"}"#}]}),
            ),
            (
                "[1,2]",
                true,
                None,
                json!({"content":[{"type":"text","text":"[1,2]"}]}),
            ),
            (
                "partial",
                false,
                Some("tool was cancelled"),
                json!({"content":[{"type":"text","text":"partial\ntool was cancelled"}],"isError":true}),
            ),
            (
                "",
                false,
                Some("tool was cancelled"),
                json!({"content":[{"type":"text","text":"tool was cancelled"}],"isError":true}),
            ),
            (
                r#"{"content":[]}"#,
                true,
                Some("note"),
                json!({"content":[{"type":"text","text":"note"}]}),
            ),
        ];
        for (stdout, success, note, want) in cases {
            assert_eq!(
                tool_result(stdout.as_bytes(), success, note),
                want,
                "{stdout}"
            );
        }
    }

    #[test]
    fn invalid_utf8_is_replaced_not_rejected() {
        let result = tool_result(b"a\xffb", true, None);
        assert_eq!(result["content"][0]["text"], "a\u{fffd}b");
    }

    #[test]
    fn outcome_result_table() {
        let secs = Duration::from_secs(5);
        let cases = [
            (
                b"out".as_slice(),
                b"err".as_slice(),
                Exit::Code(0),
                Ending::Exited,
                "out",
                false,
            ),
            (b"out", b"err", Exit::Code(3), Ending::Exited, "out", true),
            (b"", b"err", Exit::Code(3), Ending::Exited, "err", true),
            (
                b"",
                b"",
                Exit::Code(3),
                Ending::Exited,
                "tool exited with code 3",
                true,
            ),
            (
                b"",
                b"",
                Exit::Signal(9),
                Ending::Exited,
                "tool killed by signal 9 (SIGKILL)",
                true,
            ),
            (
                b"",
                b"err\n",
                Exit::Signal(15),
                Ending::TimedOut,
                "err\ntool timed out after 5s",
                true,
            ),
            (
                b"x",
                b"",
                Exit::Signal(9),
                Ending::Cancelled,
                "x\ntool was cancelled",
                true,
            ),
        ];
        for (stdout, stderr, exit, ending, text, is_error) in cases {
            let captured = CaptureState {
                stdout: stdout.to_vec(),
                stderr: stderr.to_vec(),
                stdout_delivered: stdout.len() as u64,
                stderr_delivered: stderr.len() as u64,
                ..CaptureState::default()
            };
            let result = outcome_result(&captured, exit, ending, secs);
            assert_eq!(result["content"][0]["text"], text, "{exit:?} {ending:?}");
            assert_eq!(
                result.get("isError").is_some(),
                is_error,
                "{exit:?} {ending:?}"
            );
        }
    }

    #[test]
    fn a_partial_copy_is_labelled_not_passed_off_as_whole() {
        let secs = Duration::from_secs(5);
        let captured = CaptureState {
            stdout: b"0123".to_vec(),
            stdout_delivered: 10,
            ..CaptureState::default()
        };
        let ok = outcome_result(&captured, Exit::Code(0), Ending::Exited, secs);
        assert_eq!(
            ok["content"][0]["text"],
            "0123\n[toolsrv: the result holds the first 4 of 10 bytes; the rest was streamed]"
        );
        assert!(ok.get("isError").is_none());
        let failed = outcome_result(&captured, Exit::Code(2), Ending::TimedOut, secs);
        let text = failed["content"][0]["text"].as_str().unwrap();
        assert!(
            text.starts_with("0123\n[toolsrv: the result holds the first 4 of 10 bytes"),
            "{text}"
        );
        assert!(text.ends_with("tool timed out after 5s"), "{text}");
        assert_eq!(failed["isError"], true);
    }
}
