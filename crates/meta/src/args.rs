//! Validation of a call's arguments against the tool's resolved `args` JSON Schema.

use std::fmt;
use std::sync::Arc;

use serde_json::Value;

/// A compiled `args` schema. Cheap to clone.
#[derive(Clone)]
pub struct ArgsValidator {
    inner: Arc<jsonschema::Validator>,
}

/// One way in which the arguments break the schema.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    /// JSON Pointer into the arguments (`/` for the whole object).
    pub path: String,
    pub message: String,
}

/// The arguments do not satisfy the schema; nothing was run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ArgsError {
    pub violations: Vec<Violation>,
}

impl fmt::Display for ArgsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("invalid arguments")?;
        for (i, v) in self.violations.iter().enumerate() {
            let sep = if i == 0 { ": " } else { "; " };
            write!(f, "{sep}at {}: {}", v.path, v.message)?;
        }
        Ok(())
    }
}

pub use toolsrv_proto::limits::MAX_ARGS_VALUES;

/// Why a call's arguments are refused before anything is built from them.
#[derive(Debug, thiserror::Error)]
pub enum ArgsTextError {
    /// Not JSON.
    #[error("args_json is not valid JSON: {}", json_error(.0))]
    Invalid(serde_json::Error),
    /// JSON, but not an object.
    #[error("args_json must be a JSON object")]
    NotObject,
    /// More than [`MAX_ARGS_VALUES`] values.
    #[error(
        "args_json holds more than {MAX_ARGS_VALUES} JSON values (counted at any depth), the most \
         a call's arguments may: pass large inputs as files on the host instead"
    )]
    TooManyValues,
}

/// Checks a call's arguments as text, building nothing from them: JSON, an object, at most
/// [`MAX_ARGS_VALUES`] values. Empty text is `{}`.
pub fn check_args_json(json: &str) -> Result<(), ArgsTextError> {
    if json.trim().is_empty() {
        return Ok(());
    }
    match read_json_values(json.as_bytes(), MAX_ARGS_VALUES) {
        Ok(true) => Ok(()),
        Ok(false) => Err(ArgsTextError::NotObject),
        Err(JsonValuesError::TooMany) => Err(ArgsTextError::TooManyValues),
        Err(JsonValuesError::Invalid(e)) => Err(ArgsTextError::Invalid(e)),
    }
}

/// Why [`read_json_values`] refused a text.
#[derive(Debug, thiserror::Error)]
pub enum JsonValuesError {
    /// Not JSON.
    #[error("not valid JSON: {}", json_error(.0))]
    Invalid(serde_json::Error),
    /// More values than the limit.
    #[error("more JSON values than the limit")]
    TooMany,
}

/// Why JSON text does not parse, as serde says it, with what to do where its words do not say:
/// a `\u` escape of half a UTF-16 surrogate pair is told as an "end of hex escape" or a "lone
/// leading surrogate" (for a trailing one too).
pub fn json_error(e: &serde_json::Error) -> String {
    let text = e.to_string();
    if text.contains("surrogate") || text.contains("hex escape") {
        return format!(
            "{text} (a `\\u` escape between D800 and DFFF must be one of a pair: a high \
             surrogate, D800 to DBFF, then at once a low one, DC00 to DFFF)"
        );
    }
    text
}

/// Reads JSON text from a peer without building anything from it, stopping past `max_values`
/// values (objects, arrays, strings, numbers, booleans, nulls, at any depth): whether its top
/// is an object. Built into memory, a value takes tens of bytes whatever its text; read first,
/// a text is known to be small enough to build.
pub fn read_json_values(json: &[u8], max_values: usize) -> Result<bool, JsonValuesError> {
    let mut de = serde_json::Deserializer::from_slice(json);
    let mut count = Count {
        values: 0,
        max: max_values,
        too_many: false,
    };
    let object = serde::de::DeserializeSeed::deserialize(Any(&mut count), &mut de).and_then(|o| {
        de.end()?;
        Ok(o)
    });
    match object {
        _ if count.too_many => Err(JsonValuesError::TooMany),
        Ok(object) => Ok(object),
        Err(e) => Err(JsonValuesError::Invalid(e)),
    }
}

/// JSON text on one line: the blanks between its tokens left out, every token (a number's
/// digits, a string's escapes) as written. `text` must be valid JSON, as checked before: a tool
/// then reads the arguments as the caller wrote them, where writing a parsed value again would
/// turn `\u00e9` into `é` and an integer beyond 64 bits into a float.
pub fn compact_json(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in text.chars() {
        if in_string {
            out.push(c);
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
        } else if !matches!(c, ' ' | '\t' | '\n' | '\r') {
            in_string = c == '"';
            out.push(c);
        }
    }
    out
}

/// A call's arguments from their JSON text, as the wire carries them ([`check_args_json`]
/// first): empty text is `{}`.
pub fn parse_args_json(json: &str) -> Result<Value, ArgsTextError> {
    check_args_json(json)?;
    if json.trim().is_empty() {
        return Ok(Value::Object(serde_json::Map::new()));
    }
    serde_json::from_str(json).map_err(ArgsTextError::Invalid)
}

/// Values seen so far; `too_many` once past the limit (the walk then stops with an error).
struct Count {
    values: usize,
    max: usize,
    too_many: bool,
}

impl Count {
    fn one<E: serde::de::Error>(&mut self) -> Result<(), E> {
        self.values += 1;
        if self.values > self.max {
            self.too_many = true;
            return Err(E::custom("too many values"));
        }
        Ok(())
    }
}

/// A value: counted, with everything in it; whether it is an object.
struct Any<'c>(&'c mut Count);

impl<'de> serde::de::DeserializeSeed<'de> for Any<'_> {
    type Value = bool;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Any<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        self.0.one()?;
        // A key given twice is refused: this reader keeps the last, and the tool that gets the
        // text may keep the first (C's cJSON does), so a value the schema checked would not be
        // the one the tool uses.
        let mut keys = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if keys.contains(&key) {
                let mut shown: String = key.chars().take(64).collect();
                if shown.len() < key.len() {
                    shown.push('…');
                }
                return Err(serde::de::Error::custom(format!(
                    "the key {shown:?} is given twice in one object"
                )));
            }
            keys.insert(key);
            map.next_value_seed(Any(&mut *self.0))?;
        }
        Ok(true)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        self.0.one()?;
        while seq.next_element_seed(Any(&mut *self.0))?.is_some() {}
        Ok(false)
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<bool, E> {
        self.0.one().map(|()| false)
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<bool, E> {
        self.0.one().map(|()| false)
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<bool, E> {
        self.0.one().map(|()| false)
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<bool, E> {
        self.0.one().map(|()| false)
    }

    fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<bool, E> {
        self.0.one().map(|()| false)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<bool, E> {
        self.0.one().map(|()| false)
    }
}

impl ArgsValidator {
    /// Compiles a schema, checking it against its meta-schema; the error says why it is invalid.
    pub fn compile(schema: &Value) -> Result<Self, String> {
        if !schema.is_object() && !schema.is_boolean() {
            return Err("a JSON Schema must be an object or a boolean".into());
        }
        jsonschema::validator_for(schema)
            .map(|v| Self { inner: Arc::new(v) })
            .map_err(|e| {
                let at = e.instance_path().as_str();
                if at.is_empty() {
                    e.to_string()
                } else {
                    format!("at {at}: {e}")
                }
            })
    }

    /// Validates one call's arguments. They must be a JSON object whatever the schema says.
    pub fn validate(&self, args: &Value) -> Result<(), ArgsError> {
        if !args.is_object() {
            return Err(ArgsError {
                violations: vec![Violation {
                    path: "/".into(),
                    message: format!("arguments must be a JSON object, got {}", json_type(args)),
                }],
            });
        }
        let violations: Vec<Violation> = self
            .inner
            .iter_errors(args)
            .map(|e| {
                let path = e.instance_path().as_str();
                let message = match e.kind() {
                    jsonschema::error::ValidationErrorKind::Enum { options } => {
                        enum_message(e.instance(), options)
                    }
                    _ => e.to_string(),
                };
                Violation {
                    path: if path.is_empty() {
                        "/".into()
                    } else {
                        path.to_string()
                    },
                    message,
                }
            })
            .collect();
        if violations.is_empty() {
            Ok(())
        } else {
            Err(ArgsError { violations })
        }
    }
}

impl fmt::Debug for ArgsValidator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ArgsValidator")
    }
}

/// Most bytes of allowed values an enum violation lists; a longer list ends with how many more.
const MAX_ENUM_LISTING: usize = 2048;

/// `"x" is not one of the allowed values: "a", "b", "c"`: every value (up to
/// [`MAX_ENUM_LISTING`] bytes of them), where the schema library would name only a few.
fn enum_message(instance: &Value, options: &Value) -> String {
    let Some(options) = options.as_array() else {
        return format!("{instance} is not one of the allowed values");
    };
    let mut listed = String::new();
    for (i, option) in options.iter().enumerate() {
        let text = option.to_string();
        if i > 0 && listed.len() + text.len() > MAX_ENUM_LISTING {
            listed.push_str(&format!(" and {} more", options.len() - i));
            break;
        }
        if i > 0 {
            listed.push_str(", ");
        }
        listed.push_str(&text);
    }
    format!("{instance} is not one of the allowed values: {listed}")
}

/// The JSON type name of a value, for messages.
pub(crate) fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn compact_json_keeps_every_token_as_written() {
        let text = "{ \"a b\" : [ 1.10 ,\n\t12345678901234567890123 ],\r\n \"s\": \"x \\\" y\\\\\", \"e\": \"\\u00e9 \\n\" }";
        let compact = compact_json(text);
        assert_eq!(
            compact,
            "{\"a b\":[1.10,12345678901234567890123],\"s\":\"x \\\" y\\\\\",\"e\":\"\\u00e9 \\n\"}"
        );
        assert!(!compact.contains('\n'));
        let parsed = |t: &str| serde_json::from_str::<Value>(t).unwrap();
        assert_eq!(parsed(&compact), parsed(text));
    }

    #[test]
    fn empty_args_are_an_empty_object() {
        assert_eq!(parse_args_json("").ok(), Some(json!({})));
        assert_eq!(parse_args_json("  ").ok(), Some(json!({})));
        assert_eq!(parse_args_json(r#"{"a":1}"#).ok(), Some(json!({"a":1})));
        assert!(parse_args_json("{").is_err());
    }

    #[test]
    fn a_key_given_twice_is_refused_at_any_depth() {
        // The schema would check the last `path`; a tool whose parser keeps the first would
        // use the other.
        for text in [
            r#"{"path": "/etc/shadow", "path": "/tmp/safe"}"#,
            r#"{"a": {"k": 1, "k": 2}}"#,
            r#"{"a": [{"k": 1, "\u006b": 2}]}"#,
        ] {
            let err = parse_args_json(text).unwrap_err().to_string();
            assert!(
                err.contains("is given twice in one object"),
                "{text}: {err}"
            );
        }
        // The same key in two objects is no duplicate.
        assert!(parse_args_json(r#"{"a": {"k": 1}, "b": {"k": 2}}"#).is_ok());
        let long = format!(r#"{{"{0}": 1, "{0}": 2}}"#, "x".repeat(10_000));
        let err = parse_args_json(&long).unwrap_err().to_string();
        assert!(err.len() < 300, "{err}");
    }

    fn schema() -> ArgsValidator {
        ArgsValidator::compile(&json!({
            "type": "object",
            "required": ["path"],
            "properties": {
                "path": {"type": "string"},
                "level": {"enum": ["info", "warn", "error"]},
                "filters": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"}}}}
            },
            "additionalProperties": false
        }))
        .unwrap()
    }

    #[test]
    fn accepts_valid_arguments() {
        schema()
            .validate(&json!({"path": "/x", "level": "warn", "filters": [{"n": 1}]}))
            .unwrap();
    }

    #[test]
    fn names_the_failing_path() {
        let cases = [
            (json!({}), "/", "path"),
            (json!({"path": 3}), "/path", "string"),
            (json!({"path": "a", "level": "loud"}), "/level", "loud"),
            (
                json!({"path": "a", "filters": [{"n": 1}, {"n": "two"}]}),
                "/filters/1/n",
                "integer",
            ),
            (json!({"path": "a", "extra": true}), "/", "extra"),
            (json!([1, 2]), "/", "object"),
            (json!("text"), "/", "object"),
        ];
        for (args, path, needle) in cases {
            let err = schema().validate(&args).unwrap_err();
            assert_eq!(err.violations[0].path, path, "{args}: {err}");
            assert!(err.to_string().contains(needle), "{args}: {err}");
        }
    }

    #[test]
    fn enum_violations_list_every_allowed_value() {
        let levels = [
            "emerg", "alert", "crit", "err", "warning", "notice", "info", "debug",
        ];
        let validator = ArgsValidator::compile(&json!({
            "type": "object",
            "properties": {"priority": {"enum": levels}}
        }))
        .unwrap();
        let err = validator.validate(&json!({"priority": "x"})).unwrap_err();
        assert_eq!(
            err.violations[0].message,
            r#""x" is not one of the allowed values: "emerg", "alert", "crit", "err", "warning", "notice", "info", "debug""#
        );
        let many: Vec<String> = (0..1000).map(|i| format!("value-{i}")).collect();
        let validator = ArgsValidator::compile(&json!({
            "type": "object",
            "properties": {"v": {"enum": many}}
        }))
        .unwrap();
        let message = &validator.validate(&json!({"v": 1})).unwrap_err().violations[0].message;
        assert!(message.len() < 2 * MAX_ENUM_LISTING, "{message}");
        assert!(message.ends_with(" more"), "{message}");
    }

    #[test]
    fn rejects_invalid_schemas() {
        for bad in [
            json!({"type": "nonsense"}),
            json!({"required": "path"}),
            json!(7),
            json!({"minLength": -1}),
        ] {
            assert!(
                ArgsValidator::compile(&bad).is_err(),
                "{bad} should be rejected"
            );
        }
    }

    /// Arguments are read as text before anything is built from them: JSON, an object, and at
    /// most `MAX_ARGS_VALUES` values at any depth; 1 MiB of tiny values (89 MB as a JSON tree)
    /// is refused naming the limit.
    #[test]
    fn arguments_are_checked_as_text_before_anything_is_built() {
        for ok in [
            "",
            "  ",
            "{}",
            r#"{"a": [1, {"b": null}], "c": "\u00e9\n"}"#,
        ] {
            check_args_json(ok).unwrap();
            assert!(parse_args_json(ok).unwrap().is_object());
        }
        for not_object in ["[]", "7", "\"x\"", "null", "true"] {
            assert!(
                matches!(check_args_json(not_object), Err(ArgsTextError::NotObject)),
                "{not_object}"
            );
        }
        for invalid in ["{", "{} {}", r#"{"a": }"#, "{\"a\": 1,}", &"[".repeat(200)] {
            assert!(
                matches!(check_args_json(invalid), Err(ArgsTextError::Invalid(_))),
                "{invalid}"
            );
        }
        // The object itself and its values: exactly the limit passes, one more does not.
        let within = format!("{{\"a\": [{}0]}}", "0,".repeat(MAX_ARGS_VALUES - 3));
        check_args_json(&within).unwrap();
        let over = format!("{{\"a\": [{}0]}}", "0,".repeat(MAX_ARGS_VALUES - 2));
        assert!(matches!(
            check_args_json(&over),
            Err(ArgsTextError::TooManyValues)
        ));
        let flood = format!("{{\"a\": [{}0]}}", "[0],".repeat((1 << 20) / 4 - 4));
        let err = parse_args_json(&flood).unwrap_err();
        assert!(matches!(err, ArgsTextError::TooManyValues));
        assert!(err.to_string().contains("65536 JSON values"), "{err}");
    }
}
