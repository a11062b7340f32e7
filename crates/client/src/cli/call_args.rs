//! A call's arguments as `toolctl call`, `fanout` and `local call` take them: one JSON object,
//! `-` for one on stdin, or `KEY=VALUE` and `KEY:=JSON` words, each one argument.

use serde_json::{Map, Value};
use toolsrv_proto::limits::MAX_ARGS_BYTES;

use super::quote::quoted;

/// The words' meaning, shown in `--help` and in the errors below.
pub const HELP: &str = "Arguments: a JSON object, `-` to read one from stdin, or words \
    `KEY=VALUE` (a string) and `KEY:=JSON` (any JSON value: `port:=8080`, `force:=true`, \
    `hosts:='[\"a\",\"b\"]'`); none means `{}`";

/// The arguments, and the names given a string by a `KEY=VALUE` word (which a tool wanting a
/// number or a boolean refuses: [`string_note`] says what to write instead).
#[derive(Debug, PartialEq)]
pub struct CallArgs {
    pub value: Value,
    /// The same object as JSON text, as written: the object given whole, or the words' values
    /// (`KEY:=JSON` as typed) in their order. What is sent, so that the tool reads a number's
    /// digits and a string's escapes as the caller wrote them.
    pub text: String,
    pub string_keys: Vec<String>,
}

/// What `toolctl` adds when a tool refused, as `message` words it, the type of an argument
/// given as a `KEY=VALUE` word: that it was a string, and how to give a number, a boolean or
/// JSON instead. `None` when no such argument is refused for its type (a missing or unknown
/// name, or a string the tool wants but not that one, say).
pub fn string_note(string_keys: &[String], message: &str) -> Option<String> {
    string_keys.iter().find_map(|key| {
        // The validator names a value by its JSON pointer, quotes it when it is a string, and
        // joins its complaints with "; ".
        let pointer = key.replace('~', "~0").replace('/', "~1");
        let about = format!("at /{pointer}: \"");
        let wrong_type = message
            .split("; ")
            .any(|part| part.contains(&about) && part.contains("is not of type"));
        wrong_type.then(|| {
            format!(
                "note: `{}=...` passes a string; write `{}:=VALUE` for a number, a boolean, \
                 an array or an object (`port:=8080`, `force:=true`)",
                quoted(key),
                quoted(key)
            )
        })
    })
}

/// What `input` holds, as the arguments of `-`: at most what a call may carry
/// ([`MAX_ARGS_BYTES`]), so that `toolctl call HOST TOOL - < /dev/zero` (or a large file piped
/// by mistake) is refused at once instead of read until memory runs out.
fn stdin_arguments(input: impl std::io::Read) -> Result<String, String> {
    let bytes = toolsrv_tls::files::read_up_to(input, MAX_ARGS_BYTES as u64)
        .map_err(|e| format!("cannot read arguments from stdin: {e}"))?
        .ok_or_else(|| {
            format!(
                "arguments on stdin are over the limit of {MAX_ARGS_BYTES} bytes; hand large \
                 inputs to a tool as files"
            )
        })?;
    String::from_utf8(bytes).map_err(|_| "arguments on stdin are not valid UTF-8".to_string())
}

/// The arguments of `words`; the error names the word at fault and what it should be.
pub fn parse(words: &[String]) -> Result<CallArgs, String> {
    let object = |value: Value, text: &str| {
        if value.is_object() {
            Ok(CallArgs {
                value,
                text: text.to_string(),
                string_keys: Vec::new(),
            })
        } else {
            Err("arguments must be a JSON object".to_string())
        }
    };
    match words {
        [] => object(Value::Object(Map::new()), "{}"),
        [only] if only == "-" => {
            let text = stdin_arguments(std::io::stdin().lock())?;
            let value =
                json(&text).map_err(|e| format!("arguments on stdin are not valid JSON: {e}"))?;
            object(value, &text)
        }
        [only] if starts_json(only) => object(
            json(only).map_err(|e| format!("arguments are not valid JSON: {e}"))?,
            only,
        ),
        [only] if !only.contains('=') => match serde_json::from_str(only) {
            Ok(value) => object(value, only),
            Err(_) => Err(format!(
                "argument `{}` is neither a JSON object nor KEY=VALUE or KEY:=JSON",
                quoted(only)
            )),
        },
        words => from_words(words),
    }
}

/// JSON text as a value, a key given twice in one object refused as the coordinator refuses it
/// (read into a value, the last would win without a word).
fn json(text: &str) -> Result<Value, String> {
    if let Err(toolsrv_meta::JsonValuesError::Invalid(e)) =
        toolsrv_meta::read_json_values(text.as_bytes(), usize::MAX)
    {
        return Err(toolsrv_meta::json_error(&e));
    }
    serde_json::from_str(text).map_err(|e| toolsrv_meta::json_error(&e))
}

/// A word that opens a JSON object or array.
fn starts_json(word: &str) -> bool {
    word.trim_start().starts_with(['{', '['])
}

fn from_words(words: &[String]) -> Result<CallArgs, String> {
    let mut map = Map::new();
    let mut string_keys = Vec::new();
    // `{"key":value,...}`, each `KEY:=JSON` value as typed.
    let mut text = String::from("{");
    for word in words {
        if word == "-" || starts_json(word) {
            return Err(format!(
                "argument `{}`: a JSON object or `-` must be the only argument; \
                 otherwise give KEY=VALUE or KEY:=JSON words",
                quoted(word)
            ));
        }
        let Some((key, value)) = word.split_once('=') else {
            return Err(format!(
                "argument `{}` is neither a JSON object nor KEY=VALUE or KEY:=JSON",
                quoted(word)
            ));
        };
        let (key, value, written) = match key.strip_suffix(':') {
            Some(key) => (
                key,
                json(value).map_err(|e| {
                    format!(
                        "argument `{}`: the value after `:=` is not JSON: {e}",
                        quoted(word)
                    )
                })?,
                value.to_string(),
            ),
            None => {
                string_keys.push(key.to_string());
                let string = Value::String(value.to_string());
                let written = string.to_string();
                (key, string, written)
            }
        };
        if key.is_empty() {
            return Err(format!(
                "argument `{}` has no name before `=`",
                quoted(word)
            ));
        }
        if map.insert(key.to_string(), value).is_some() {
            return Err(format!("argument `{}` is given twice", quoted(key)));
        }
        if text.len() > 1 {
            text.push(',');
        }
        text.push_str(&Value::String(key.to_string()).to_string());
        text.push(':');
        text.push_str(&written);
    }
    text.push('}');
    Ok(CallArgs {
        value: Value::Object(map),
        text,
        string_keys,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_text_sent_is_the_arguments_as_written() {
        let text = |w: &[&str]| parse(&words(w)).unwrap().text;
        let whole = r#"{"n": 12345678901234567890123, "s": "caf\u00e9"}"#;
        assert_eq!(text(&[whole]), whole);
        assert_eq!(text(&[]), "{}");
        assert_eq!(
            text(&[
                "n:=12345678901234567890123",
                "s=caf\u{e9} \"q\"",
                "f:=1.10",
                "o:={\"a\": [1, 2.50]}"
            ]),
            "{\"n\":12345678901234567890123,\"s\":\"caf\u{e9} \\\"q\\\"\",\"f\":1.10,\"o\":{\"a\": [1, 2.50]}}"
        );
        // What is sent reads back as the value checked.
        for w in [
            &["a=1", "b:=[true, null]"][..],
            &[r#"{"x": {"y": "\ud83d\ude00"}}"#],
        ] {
            let args = parse(&words(w)).unwrap();
            assert_eq!(
                serde_json::from_str::<Value>(&args.text).unwrap(),
                args.value
            );
        }
    }

    #[test]
    fn arguments_on_stdin_are_read_up_to_the_limit_of_a_call() {
        let at_limit = format!("{{\"a\":\"{}\"}}", "x".repeat(MAX_ARGS_BYTES - 8));
        assert_eq!(
            stdin_arguments(at_limit.as_bytes()).unwrap().len(),
            MAX_ARGS_BYTES
        );
        // An endless input stops one byte past the limit.
        let err = stdin_arguments(std::io::repeat(b' ')).unwrap_err();
        assert!(err.contains("over the limit of 1048576 bytes"), "{err}");
        let err = stdin_arguments(&[b'"', 0xff, b'"'][..]).unwrap_err();
        assert!(err.contains("not valid UTF-8"), "{err}");
    }

    fn words(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_string()).collect()
    }

    fn ok(w: &[&str]) -> Value {
        parse(&words(w)).unwrap().value
    }

    fn err(w: &[&str]) -> String {
        parse(&words(w)).unwrap_err()
    }

    #[test]
    fn no_word_is_an_empty_object_and_one_json_object_is_taken_as_it_is() {
        assert_eq!(ok(&[]), json!({}));
        assert_eq!(
            ok(&[r#"{"path": "/a=b", "n": 2}"#]),
            json!({"path": "/a=b", "n": 2})
        );
        assert_eq!(ok(&[" {}"]), json!({}));
    }

    #[test]
    fn words_give_strings_and_json_values() {
        let args = parse(&words(&[
            "path=/srv/a=b",
            "port:=8080",
            "force:=true",
            "tags:=[\"a\", \"b\"]",
            "empty=",
            "literal:=\"007\"",
            "a:b=c",
        ]))
        .unwrap();
        assert_eq!(
            args.value,
            json!({
                "path": "/srv/a=b", "port": 8080, "force": true, "tags": ["a", "b"],
                "empty": "", "literal": "007", "a:b": "c"
            })
        );
        assert_eq!(args.string_keys, ["path", "empty", "a:b"]);
        assert!(parse(&words(&["port:=1"])).unwrap().string_keys.is_empty());
    }

    #[test]
    fn bad_words_name_the_word_and_the_fix() {
        assert_eq!(err(&["[1]"]), "arguments must be a JSON object");
        assert_eq!(err(&["42"]), "arguments must be a JSON object");
        assert!(err(&["{"]).starts_with("arguments are not valid JSON"));
        let neither = "argument `path` is neither a JSON object nor KEY=VALUE or KEY:=JSON";
        assert_eq!(err(&["path"]), neither);
        assert_eq!(err(&["a=1", "path"]), neither);
        assert_eq!(err(&["=x"]), "argument `=x` has no name before `=`");
        assert_eq!(err(&[":=1"]), "argument `:=1` has no name before `=`");
        assert_eq!(err(&["a=1", "a:=2"]), "argument `a` is given twice");
        assert!(err(&["n:=08"]).starts_with("argument `n:=08`: the value after `:=` is not JSON"));
        assert!(err(&["n:="]).starts_with("argument `n:=`: the value after `:=` is not JSON"));
        assert!(err(&["a=1", "{}"]).contains("must be the only argument"));
        assert!(err(&["a=1", "-"]).contains("must be the only argument"));
        // Half a surrogate pair, either half, is told as such, where serde says "end of hex
        // escape" or "lone leading surrogate".
        for half in [
            r#"{"x":"\ud800"}"#,
            r#"{"x":"\udc00"}"#,
            r#"{"x":"\ud800\u0041"}"#,
        ] {
            let e = err(&[half]);
            assert!(
                e.starts_with("arguments are not valid JSON: ")
                    && e.contains("must be one of a pair: a high surrogate, D800 to DBFF"),
                "{half}: {e}"
            );
        }
        let e = err(&[r#"x:="\udc00""#]);
        assert!(e.contains("must be one of a pair"), "{e}");
        // A key given twice inside a `:=` value is refused as in a whole object.
        let e = err(&[r#"x:={"a":1,"a":2}"#]);
        assert!(
            e.contains("the key \"a\" is given twice in one object"),
            "{e}"
        );
    }

    #[test]
    fn the_note_names_a_string_the_tool_refused_and_only_that() {
        let keys = words(&["limit", "a/b", "name"]);
        let note = string_note(
            &keys,
            "invalid arguments: at /limit: \"5\" is not of type \"integer\"",
        );
        assert!(
            note.unwrap()
                .starts_with("note: `limit=...` passes a string; write `limit:=VALUE`")
        );
        let note = string_note(&keys, "at /a~1b: \"x\" is not of type \"boolean\"");
        assert!(note.unwrap().contains("`a/b:=VALUE`"));
        // A string, only not that one (quoting would not help); and with a type error too.
        let short = "at /name: \"ab\" is shorter than 3 characters";
        assert_eq!(string_note(&keys, short), None);
        let both = format!("{short}; at /limit: \"5\" is not of type \"integer\"");
        assert!(
            string_note(&keys, &both)
                .unwrap()
                .contains("`limit:=VALUE`")
        );
        // A name the tool does not know, a missing one, or a string it accepts: no note.
        assert_eq!(
            string_note(
                &keys,
                "at /: Additional properties are not allowed ('limitt' was unexpected)"
            ),
            None
        );
        assert_eq!(
            string_note(&keys, "at /: \"ports\" is a required property"),
            None
        );
        assert_eq!(
            string_note(&[], "at /limit: \"5\" is not of type \"integer\""),
            None
        );
    }

    #[test]
    fn odd_bytes_and_long_words_are_quoted_safely() {
        let e = err(&["a=1", "\u{1b}[31mred\u{7}"]);
        assert!(e.contains("\\u{1b}[31mred\\u{7}"), "{e}");
        let long = "x".repeat(1000);
        let e = err(&["a=1", &long]);
        assert!(e.contains("… (1000 characters)") && e.len() < 200, "{e}");
    }
}
