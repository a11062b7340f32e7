//! What `toolctl mcp` answers a request that is not a JSON-RPC message, on stdio and over HTTP
//! alike: a JSON-RPC error naming what is wrong and where (`-32700` for what is not JSON,
//! `-32600` for JSON that is not a message), with the request's id when it can be recovered.
//! The SDK would drop such a line on stdio, leaving its client waiting for good, and answer
//! `415` over HTTP.

use rmcp::model::ClientJsonRpcMessage;
use serde::Deserialize;
use serde_json::Value;
use toolsrv_proto::text::printable_line;

/// JSON-RPC's code for a request that is not JSON.
pub const PARSE_ERROR: i32 = -32700;
/// JSON-RPC's code for JSON that is not a request.
pub const INVALID_REQUEST: i32 = -32600;

/// Most bytes of a decoder's reason an error quotes: the request may be megabytes, and a
/// reason may quote part of it.
const MAX_REASON_BYTES: usize = 300;
/// Most bytes of a value a refusal quotes back.
const MAX_QUOTED_BYTES: usize = 64;
/// Longest string id given back: a longer one is not a client's counter, and is not echoed.
const MAX_ID_BYTES: usize = 256;

/// What a message as received is.
#[derive(Debug, PartialEq)]
pub enum Check {
    /// A message the SDK reads.
    Message,
    /// A JSON object that is no request and that the SDK cannot read (a notification of another
    /// protocol, say). The SDK's stdio transport has its own way with these (it skips those of
    /// other protocols and answers the rest): it gets them, as before. Over HTTP, refused so.
    Stray(Refusal),
    /// Not a message: answered with this error.
    Refused(Refusal),
}

/// The JSON-RPC error that answers a message that is not one.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub code: i32,
    /// The request's id (a string or an integer) when it could be read, else `null`.
    pub id: Value,
    pub message: String,
}

impl Refusal {
    /// The error response, as JSON.
    pub fn to_json(&self) -> Vec<u8> {
        let response = serde_json::json!({
            "jsonrpc": "2.0",
            "id": self.id,
            "error": {"code": self.code, "message": self.message},
        });
        // A `Value` of strings and numbers always serializes.
        serde_json::to_vec(&response).unwrap_or_default()
    }
}

/// Looks at one message as received (a line on stdio, without its line break; a POST body):
/// whether the SDK reads it, and else what to answer.
pub fn check(message: &[u8]) -> Check {
    // As the SDK does: RFC 8259 lets a parser ignore a byte order mark.
    let message = without_bom(message);
    // The common case costs one parse more than the SDK's own.
    let typed = match serde_json::from_slice::<ClientJsonRpcMessage>(message) {
        Ok(_) => return Check::Message,
        Err(e) => e,
    };
    let text = match std::str::from_utf8(message) {
        Ok(text) => text,
        Err(e) => {
            return Check::Refused(Refusal {
                code: PARSE_ERROR,
                id: id_of(message),
                message: format!(
                    "parse error: invalid UTF-8 at byte {} of the request (counting from 0)",
                    e.valid_up_to()
                ),
            });
        }
    };
    if text.trim().is_empty() {
        return Check::Refused(Refusal {
            code: PARSE_ERROR,
            id: Value::Null,
            message: "parse error: the request is empty".to_string(),
        });
    }
    let value = match serde_json::from_str::<Value>(text) {
        Ok(value) => value,
        Err(e) => {
            return Check::Refused(Refusal {
                code: PARSE_ERROR,
                id: id_of(message),
                message: format!("parse error: not JSON: {}", reason(&e)),
            });
        }
    };
    let kind = match value {
        Value::Object(_) => None,
        Value::Array(_) => Some("an array (this protocol has no batches)"),
        Value::Null => Some("null"),
        Value::Bool(_) => Some("a boolean"),
        Value::Number(_) => Some("a number"),
        Value::String(_) => Some("a string"),
    };
    if let Some(kind) = kind {
        return Check::Refused(Refusal {
            code: INVALID_REQUEST,
            id: Value::Null,
            message: format!("invalid request: a JSON-RPC message is an object, not {kind}"),
        });
    }
    let probe = Probe::of(message);
    let keys = Keys::of(message);
    let wrong = keys.as_ref().and_then(|keys| what_is_wrong(keys, &value));
    // A request whose id is given twice has none the probe reads, and is a request all the
    // same: answered (with a `null` id), not left to the SDK, which answers it without one.
    let request = probe.is_request()
        || wrong.is_some()
            && keys.as_ref().is_some_and(|k| {
                k.0.iter().any(|k| k == "id") && k.0.iter().any(|k| k == "method")
            });
    let refusal = Refusal {
        code: INVALID_REQUEST,
        id: probe.request_id(),
        message: format!(
            "invalid request: {}",
            wrong.unwrap_or_else(|| reason(&typed))
        ),
    };
    if request {
        Check::Refused(refusal)
    } else {
        Check::Stray(refusal)
    }
}

/// What makes `message` (a JSON object, its `keys` in order) no JSON-RPC message, in words,
/// when it is one of the members JSON-RPC and MCP give a shape: the decoder's own reason
/// (`unrecognized JSON-RPC message`) names nothing.
fn what_is_wrong(keys: &Keys, message: &Value) -> Option<String> {
    let mut seen = std::collections::HashSet::new();
    if let Some(twice) = keys.0.iter().find(|k| !seen.insert(k.as_str())) {
        return Some(format!(
            "the key \"{}\" is given twice",
            printable_line(twice, MAX_QUOTED_BYTES)
        ));
    }
    // As JSON, escaped and cut: a huge or odd value does not come back whole.
    let shown = |v: &Value| printable_line(&v.to_string(), MAX_QUOTED_BYTES);
    match message.get("jsonrpc") {
        None => return Some("\"jsonrpc\" is missing: it must be \"2.0\"".to_string()),
        Some(v) if v != "2.0" => {
            return Some(format!("\"jsonrpc\" must be \"2.0\", not {}", shown(v)));
        }
        Some(_) => {}
    }
    match message.get("id") {
        Some(Value::String(_)) | None => {}
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => {}
        Some(v) => {
            return Some(format!(
                "\"id\" must be a string or an integer, not {}",
                shown(v)
            ));
        }
    }
    match message.get("method") {
        Some(Value::String(_)) | None => {}
        Some(v) => return Some(format!("\"method\" must be a string, not {}", shown(v))),
    }
    match message.get("params") {
        Some(Value::Object(_) | Value::Null) | None => None,
        Some(v) if message.get("method").is_some() => {
            Some(format!("\"params\" must be an object, not {}", shown(v)))
        }
        Some(_) => None,
    }
}

/// The keys of a JSON object, in order, repeats included (a `Value` keeps the last of them).
struct Keys(Vec<String>);

impl Keys {
    fn of(message: &[u8]) -> Option<Self> {
        serde_json::from_slice(message).ok()
    }
}

impl<'de> Deserialize<'de> for Keys {
    fn deserialize<D: serde::Deserializer<'de>>(decoder: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Keys;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Keys, A::Error> {
                let mut keys = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    map.next_value::<serde::de::IgnoredAny>()?;
                    keys.push(key);
                }
                Ok(Keys(keys))
            }
        }
        decoder.deserialize_map(Visitor)
    }
}

/// `message` without the byte order mark it may start with.
pub fn without_bom(message: &[u8]) -> &[u8] {
    message.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(message)
}

/// A decoder's reason, escaped and cut.
fn reason(e: &serde_json::Error) -> String {
    toolsrv_proto::text::printable_line(&toolsrv_meta::json_error(e), MAX_REASON_BYTES)
}

/// The id of a request that does not parse, when what is wrong with it is elsewhere (a byte
/// that is not UTF-8, an escape of half a character, nesting too deep, a huge number, trailing
/// bytes): `null` when it cannot be told, or when the message is no request.
fn id_of(message: &[u8]) -> Value {
    Probe::of(message).request_id()
}

/// The two members of a JSON-RPC object that tell a request and name it, read past whatever
/// else is wrong: serde_json skips the other members' values without decoding their strings
/// or numbers, nor counting their depth, and trailing bytes are not looked at.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Probe {
    id: Option<Value>,
    method: Option<serde::de::IgnoredAny>,
}

impl Probe {
    fn of(message: &[u8]) -> Self {
        // Only an object: the derived decoder would take an array's first item for the id.
        if message.trim_ascii_start().first() != Some(&b'{') {
            return Self::default();
        }
        let mut decoder = serde_json::Deserializer::from_slice(message);
        Self::deserialize(&mut decoder).unwrap_or_default()
    }

    fn is_request(&self) -> bool {
        self.method.is_some() && self.id.is_some()
    }

    /// The id as the request gave it, when JSON-RPC allows it (a string or an integer), and
    /// the message is a request; else `null`.
    fn request_id(&self) -> Value {
        if !self.is_request() {
            return Value::Null;
        }
        match &self.id {
            Some(Value::String(s)) if s.len() <= MAX_ID_BYTES => Value::String(s.clone()),
            Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Value::Number(n.clone()),
            _ => Value::Null,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    fn refused(message: &[u8]) -> Refusal {
        match check(message) {
            Check::Refused(refusal) => refusal,
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(message)),
        }
    }

    #[test]
    fn messages_the_sdk_reads_pass() {
        for message in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            "\u{feff}{\"jsonrpc\":\"2.0\",\"id\":\"a\",\"method\":\"ping\"}",
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"no/such","params":{"x":[1,2]}}"#,
            r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"x","arguments":"text"}}"#,
            r#"{"jsonrpc":"2.0","id":4,"result":{}}"#,
            r#"  {"jsonrpc":"2.0","id":5,"method":"ping"}  "#,
        ] {
            assert_eq!(check(message.as_bytes()), Check::Message, "{message}");
        }
    }

    #[test]
    fn what_is_not_json_is_a_parse_error_naming_where_with_the_id_when_it_can_be_read() {
        let deep = format!(
            r#"{{"jsonrpc":"2.0","id":"deep","method":"tools/call","params":{{"name":"x","arguments":{{"a":{}1{}}}}}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        let huge_garbage = format!("{}{{", "x".repeat(1_000_000));
        let long_id = format!(
            r#"{{"jsonrpc":"2.0","id":"{}","method":"ping","params":{{"a":"\ud800"}}}}"#,
            "i".repeat(1000)
        );
        let cases: Vec<(&[u8], Value, &str)> = vec![
            (
                b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"tools/call\",\"params\":{\"name\":\"x\",\"arguments\":{\"json\":\"caf\xe9\"}}}",
                json!(4),
                "invalid UTF-8 at byte 91 of the request",
            ),
            (
                br#"{"jsonrpc":"2.0","id":"s-1","method":"tools/call","params":{"name":"x","arguments":{"a":"\ud800"}}}"#,
                json!("s-1"),
                "unexpected end of hex escape at line 1 column",
            ),
            (
                deep.as_bytes(),
                json!("deep"),
                "recursion limit exceeded at line 1 column",
            ),
            (
                br#"{"jsonrpc":"2.0","id":1e400,"method":"ping"}"#,
                Value::Null,
                "number out of range at line 1 column 27",
            ),
            (
                br#"{"jsonrpc":"2.0","id":7,"method":"ping"} trailing"#,
                json!(7),
                "trailing characters at line 1 column 42",
            ),
            (
                b"not json at all {",
                Value::Null,
                "expected ident at line 1 column 2",
            ),
            (
                huge_garbage.as_bytes(),
                Value::Null,
                "expected value at line 1 column 1",
            ),
            // A notification, or a response: no id to give.
            (
                br#"{"jsonrpc":"2.0","method":"notifications/x","params":{"a":"\ud800"}}"#,
                Value::Null,
                "hex escape",
            ),
            (
                br#"{"jsonrpc":"2.0","id":8,"result":{"a":"\ud800"}}"#,
                Value::Null,
                "hex escape",
            ),
            (long_id.as_bytes(), Value::Null, "hex escape"),
            (b"", Value::Null, "the request is empty"),
            (b" \t", Value::Null, "the request is empty"),
        ];
        for (message, id, what) in cases {
            let shown = String::from_utf8_lossy(&message[..message.len().min(80)]).to_string();
            let refusal = refused(message);
            assert_eq!(refusal.code, PARSE_ERROR, "{shown}");
            assert_eq!(refusal.id, id, "{shown}");
            assert!(
                refusal.message.starts_with("parse error: ") && refusal.message.contains(what),
                "{shown}: {}",
                refusal.message
            );
            assert!(refusal.message.len() < 400, "{}", refusal.message);
        }
    }

    #[test]
    fn json_that_is_not_a_message_is_an_invalid_request() {
        for (message, kind) in [
            ("[]", "an array"),
            (r#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#, "an array"),
            ("null", "null"),
            ("5", "a number"),
            (r#""ping""#, "a string"),
            ("true", "a boolean"),
        ] {
            let refusal = refused(message.as_bytes());
            assert_eq!(
                (refusal.code, &refusal.id),
                (INVALID_REQUEST, &Value::Null),
                "{message}"
            );
            assert!(
                refusal.message.starts_with(&format!(
                    "invalid request: a JSON-RPC message is an object, not {kind}"
                )),
                "{message}: {}",
                refusal.message
            );
        }
        // A request the SDK cannot read: answered, with its id (one JSON-RPC allows: not a
        // float, nor a number past 64 bits), naming what is wrong.
        let thirty_digits = "1".repeat(30);
        for (message, id, what) in [
            (
                r#"{"jsonrpc":"1.0","id":"x","method":"ping"}"#.to_string(),
                json!("x"),
                r#""jsonrpc" must be "2.0", not "1.0""#,
            ),
            (
                r#"{"id":2,"method":"ping"}"#.into(),
                json!(2),
                r#""jsonrpc" is missing: it must be "2.0""#,
            ),
            (
                r#"{"jsonrpc":"2.0","id":1.5,"method":"ping"}"#.into(),
                Value::Null,
                r#""id" must be a string or an integer, not 1.5"#,
            ),
            (
                format!(r#"{{"jsonrpc":"2.0","id":{thirty_digits},"method":"ping"}}"#),
                Value::Null,
                r#""id" must be a string or an integer, not 1.1111"#,
            ),
            (
                r#"{"jsonrpc":"2.0","id":[1],"method":"ping"}"#.into(),
                Value::Null,
                r#""id" must be a string or an integer, not [1]"#,
            ),
            (
                r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":[1,2]}"#.into(),
                json!(3),
                r#""params" must be an object, not [1,2]"#,
            ),
            (
                r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":"x"}"#.into(),
                json!(4),
                r#""params" must be an object, not "x""#,
            ),
            (
                r#"{"jsonrpc":"2.0","id":5,"method":7}"#.into(),
                json!(5),
                r#""method" must be a string, not 7"#,
            ),
            (
                r#"{"id":13,"id":14,"method":"ping"}"#.into(),
                Value::Null,
                r#"the key "id" is given twice"#,
            ),
            (
                // A message with a key given twice is not read for its id.
                r#"{"jsonrpc":"2.0","id":6,"method":"ping","method":"tools/list"}"#.into(),
                Value::Null,
                r#"the key "method" is given twice"#,
            ),
        ] {
            let refusal = refused(message.as_bytes());
            assert_eq!(
                (refusal.code, &refusal.id),
                (INVALID_REQUEST, &id),
                "{message}"
            );
            assert!(
                refusal
                    .message
                    .starts_with(&format!("invalid request: {what}")),
                "{message}: {}",
                refusal.message
            );
        }
        // Other objects are left to the transport, with the error to answer over HTTP.
        for message in [
            r#"{"jsonrpc":"2.0","method":"$/lsp","params":[]}"#,
            r#"{"jsonrpc":"2.0","id":1}"#,
            r#"{"id":1,"result":{}}"#,
        ] {
            let Check::Stray(refusal) = check(message.as_bytes()) else {
                panic!("{message}: not a stray");
            };
            assert_eq!(
                (refusal.code, refusal.id),
                (INVALID_REQUEST, Value::Null),
                "{message}"
            );
        }
    }

    #[test]
    fn the_error_is_a_json_rpc_response() {
        let refusal = Refusal {
            code: PARSE_ERROR,
            id: json!(3),
            message: "parse error: x".to_string(),
        };
        let response: Value = serde_json::from_slice(&refusal.to_json()).unwrap();
        assert_eq!(
            response,
            json!({"jsonrpc": "2.0", "id": 3, "error": {"code": -32700, "message": "parse error: x"}})
        );
    }
}
