//! Parsing and linting `.meta` documents: every kind of broken file and its message.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::Path;

use toolsrv_meta::{Code, Severity, parse};

/// One problem: severity, code, field and the whole message.
type Problem = (Severity, Code, Option<String>, String);

fn problems(doc: &str) -> (bool, Vec<Problem>) {
    let parsed = parse("t", Path::new("/tools/t.meta"), doc.as_bytes());
    let list = parsed
        .diagnostics
        .iter()
        .map(|d| (d.severity, d.code, d.field.clone(), d.to_string()))
        .collect();
    (parsed.meta.is_some(), list)
}

/// Asserts that `doc` is rejected with an error of `code` on `field` whose message contains `needle`.
fn rejected(doc: &str, code: Code, field: Option<&str>, needle: &str) {
    let (ok, list) = problems(doc);
    assert!(!ok, "{doc} should be rejected");
    let hit = list
        .iter()
        .find(|(s, c, f, _)| *s == Severity::Error && *c == code && f.as_deref() == field);
    let (_, _, _, msg) =
        hit.unwrap_or_else(|| panic!("{doc}: no {code:?} error on {field:?} in {list:?}"));
    assert!(msg.starts_with("/tools/t.meta: error: "), "{msg}");
    assert!(msg.contains(needle), "{msg} should mention {needle}");
}

#[test]
fn a_complete_document_parses_cleanly() {
    let doc = r#"{
        "description": "Read logs", "prompt": "Docs", "keywords": ["logs"], "tier": "warm",
        "args": {"type": "object", "properties": {"n": {"type": "integer"}}},
        "cmd": "journalctl", "scope": "host", "outputFormat": "text", "resetsCounter": true,
        "variants": [{"match": {"os": ["linux"], "binary": "journalctl"}, "cmd": "x"}]
    }"#;
    let (ok, list) = problems(doc);
    assert!(ok);
    assert!(list.is_empty(), "{list:?}");
}

#[test]
fn a_mistyped_description_is_one_problem_not_also_a_missing_one() {
    for doc in [
        r#"{"description": 3, "cmd": "true"}"#,
        r#"{"variants": [{"match": {}, "description": false}], "cmd": "true"}"#,
    ] {
        let (ok, list) = problems(doc);
        assert!(!ok);
        assert_eq!(list.len(), 1, "{doc}: {list:?}");
        assert_eq!(list[0].1, Code::WrongType, "{doc}: {list:?}");
    }
    let (_, list) = problems(r#"{"cmd": "true"}"#);
    assert!(
        list.iter().any(|p| p.3.contains("missing")),
        "an absent description is still reported: {list:?}"
    );
}

#[test]
fn not_json() {
    rejected("{\"description\": ", Code::NotJson, None, "not valid JSON");
    rejected("", Code::NotJson, None, "line 1");
    rejected("[1, 2]", Code::NotObject, None, "got array");
    // Serde's words alone say nothing a tool author can act on.
    rejected(
        "\u{feff}{\"description\": \"d\"}",
        Code::NotJson,
        None,
        "starts with a UTF-8 byte-order mark; save it as UTF-8 without one",
    );
    rejected(
        r#"{"description": "\ud800"}"#,
        Code::NotJson,
        None,
        "must be one of a pair: a high surrogate, D800 to DBFF, then at once a low one",
    );
    // A key given twice: a reviewer reads the first, a parser keeping the last runs `id`.
    rejected(
        r#"{"description": "dup", "cmd": "true", "cmd": "id"}"#,
        Code::NotJson,
        None,
        "not valid JSON: the key \"cmd\" is given twice in one object at line 1",
    );
    rejected(
        r#"{"description": "d", "variants": [{"match": {"os": "linux", "os": "darwin"}}]}"#,
        Code::NotJson,
        None,
        "the key \"os\" is given twice in one object",
    );
}

#[test]
fn wrong_field_types_name_the_field() {
    let cases = [
        (
            r#"{"description": 1}"#,
            "description",
            "expected string, got number",
        ),
        (
            r#"{"prompt": ["a"]}"#,
            "prompt",
            "expected string, got array",
        ),
        (
            r#"{"keywords": "logs"}"#,
            "keywords",
            "expected array of strings, got string",
        ),
        (
            r#"{"keywords": ["ok", 3]}"#,
            "keywords[1]",
            "expected string, got number",
        ),
        (
            r#"{"cmd": {"run": "x"}}"#,
            "cmd",
            "expected string, got object",
        ),
        (
            r#"{"resetsCounter": "yes"}"#,
            "resetsCounter",
            "expected boolean, got string",
        ),
        (r#"{"tier": 1}"#, "tier", "expected string, got number"),
        (
            r#"{"variants": {}}"#,
            "variants",
            "expected array of objects, got object",
        ),
        (
            r#"{"variants": [1]}"#,
            "variants[0]",
            "expected object, got number",
        ),
        (
            r#"{"variants": [{"match": "linux"}]}"#,
            "variants[0].match",
            "expected object, got string",
        ),
        (
            r#"{"variants": [{"match": {"os": 1}}]}"#,
            "variants[0].match.os",
            "expected string or array of strings",
        ),
        (
            r#"{"variants": [{}, {"match": {"os": ["linux", 2]}}]}"#,
            "variants[1].match.os[1]",
            "expected string",
        ),
        (
            r#"{"variants": [{"description": false}]}"#,
            "variants[0].description",
            "expected string, got boolean",
        ),
        (
            r#"{"variants": [{"variants": []}]}"#,
            "variants[0].variants",
            "cannot be nested",
        ),
    ];
    for (doc, field, needle) in cases {
        rejected(doc, Code::WrongType, Some(field), needle);
    }
}

#[test]
fn bad_tier() {
    rejected(
        r#"{"tier": "lukewarm"}"#,
        Code::BadTier,
        Some("tier"),
        "use hot, warm or cold",
    );
    rejected(
        r#"{"variants": [{"tier": "HOT"}]}"#,
        Code::BadTier,
        Some("variants[0].tier"),
        "`HOT`",
    );
}

#[test]
fn invalid_schema() {
    rejected(
        r#"{"args": {"type": "strng"}}"#,
        Code::InvalidSchema,
        Some("args"),
        "not a valid JSON Schema",
    );
    rejected(
        r#"{"args": "object"}"#,
        Code::InvalidSchema,
        Some("args"),
        "must be an object",
    );
    rejected(
        r#"{"variants": [{"args": {"required": 5}}]}"#,
        Code::InvalidSchema,
        Some("variants[0].args"),
        "JSON Schema",
    );
}

/// A call's arguments are one JSON object. A schema that takes no object refused every call,
/// and MCP clients (both official SDKs) refused the whole list of tools holding it.
#[test]
fn args_that_take_no_object_are_refused() {
    for (doc, field, needle) in [
        (
            r#"{"args": {"type": "string"}}"#,
            "args.type",
            r#"`type` must be "object" (or left out), not "string""#,
        ),
        (
            r#"{"args": {"type": "array"}}"#,
            "args.type",
            "not \"array\"",
        ),
        (
            r#"{"args": {"type": ["object", "null"]}}"#,
            "args.type",
            r#"not ["object","null"]"#,
        ),
        (
            r#"{"variants": [{"args": {"type": "integer"}}]}"#,
            "variants[0].args.type",
            "must be \"object\"",
        ),
        (r#"{"args": false}"#, "args", "accepts no arguments at all"),
        (
            r#"{"args": {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object"}}"#,
            "args.$schema",
            r#"not "http://json-schema.org/draft-04/schema#": leave `$schema` out"#,
        ),
    ] {
        rejected(doc, Code::InvalidSchema, Some(field), needle);
    }
    for fine in [
        r#"{"description": "d", "args": {"type": "object"}}"#,
        r#"{"description": "d", "args": {"properties": {"n": {"type": "integer"}}}}"#,
        r#"{"description": "d", "args": true}"#,
        r#"{"description": "d", "args": {"$schema": "https://json-schema.org/draft/2020-12/schema"}}"#,
    ] {
        let (ok, list) = problems(fine);
        assert!(ok && list.is_empty(), "{fine}: {list:?}");
    }
}

/// A pattern this validator takes and MCP clients cannot compile (they read ECMAScript's
/// syntax) is refused, naming where it is; ECMAScript patterns pass.
#[test]
fn patterns_are_ecmascript_regular_expressions() {
    for (doc, field, needle) in [
        (
            r#"{"args": {"properties": {"n": {"type": "string", "pattern": "(?i)abc"}}}}"#,
            "args.properties.n.pattern",
            r#""(?i)abc" is not an ECMAScript regular expression"#,
        ),
        (
            r#"{"args": {"patternProperties": {"\\Ax": {}}}}"#,
            r"args.patternProperties.\Ax",
            "not an ECMAScript regular expression",
        ),
        (
            r#"{"args": {"prefixItems": [{"pattern": "[[:alpha:]]+"}]}}"#,
            "args.prefixItems[0].pattern",
            "not an ECMAScript regular expression",
        ),
        (
            r#"{"variants": [{"args": {"properties": {"p": {"pattern": "a++"}}}}]}"#,
            "variants[0].args.properties.p.pattern",
            "not an ECMAScript regular expression",
        ),
    ] {
        rejected(doc, Code::InvalidSchema, Some(field), needle);
    }
    let fine = r#"{"description": "d", "args": {"properties": {
        "n": {"type": "string", "pattern": "^[a-z0-9_-]{1,64}$"},
        "m": {"pattern": "^\\d+(?<unit>[kMG])?$"},
        "pattern": {"type": "string"}},
        "patternProperties": {"^x-": {"type": "string"}}}}"#;
    let (ok, list) = problems(fine);
    assert!(ok && list.is_empty(), "{list:?}");
}

/// Text for models and people that holds escape sequences or invisible formatting characters is
/// served (clients see them escaped), with a warning naming the field and the character.
#[test]
fn hidden_characters_in_model_facing_text_are_warned_of() {
    let doc = r##"{"description": "Lists\u001b[2J files", "prompt": "Title\r\n\tfine\n",
        "keywords": ["ok", "right\u202eleft"], "scope": "host\u200b", "cmd": "printf '\u001b'"}"##;
    let (ok, list) = problems(doc);
    assert!(ok, "{list:?}");
    let warned: Vec<(Option<&str>, &str)> = list
        .iter()
        .filter(|p| p.1 == Code::Suspicious)
        .map(|p| (p.2.as_deref(), p.3.as_str()))
        .collect();
    let fields: Vec<Option<&str>> = warned.iter().map(|w| w.0).collect();
    assert_eq!(
        fields,
        [Some("description"), Some("scope"), Some("keywords[1]")],
        "{warned:?}"
    );
    assert!(
        warned[0].1.contains(r"holds \u{1b} at byte 5"),
        "{warned:?}"
    );
}

/// Names that MCP clients and model APIs would not take, and the names `toolctl mcp` keeps for
/// itself, are warned of: served all the same, which the tool author now knows.
#[test]
fn names_models_cannot_take_are_warned_of() {
    let warned = |name: &str, doc: &str| -> Vec<(Option<String>, String)> {
        let parsed = parse(name, Path::new("/tools/x.meta"), doc.as_bytes());
        assert!(parsed.meta.is_some(), "{name}: {:?}", parsed.diagnostics);
        parsed
            .diagnostics
            .iter()
            .filter(|d| d.severity == Severity::Warning && d.code == Code::Suspicious)
            .map(|d| (d.field.clone(), d.message.clone()))
            .collect()
    };
    let plain = r#"{"description": "d"}"#;
    assert!(warned("disk_usage", plain).is_empty());
    assert!(warned(&"n".repeat(64), plain).is_empty());
    let long = warned(&"n".repeat(129), plain);
    assert_eq!(long.len(), 1, "{long:?}");
    assert!(
        long[0]
            .1
            .contains("longer than the 128 characters MCP allows"),
        "{long:?}"
    );
    for name in ["x.y", &"n".repeat(65)] {
        let warnings = warned(name, plain);
        assert!(
            warnings[0].1.contains("some model APIs"),
            "{name}: {warnings:?}"
        );
    }
    for own in ["tool_search", "tool_load"] {
        let warnings = warned(own, plain);
        assert!(
            warnings[0]
                .1
                .contains("offers a tool of its own by this name"),
            "{warnings:?}"
        );
    }
    let args = r#"{"description": "d", "args": {"properties": {
        "ok_name": {}, "v1.2": {}, "target_host": {}, "": {}, "with space": {}, "\u001b[2J": {}}}}"#;
    let warnings = warned("t", args);
    let fields: Vec<&str> = warnings.iter().filter_map(|(f, _)| f.as_deref()).collect();
    assert_eq!(
        fields,
        [
            "args.properties.target_host",
            "args.properties.",
            "args.properties.with space",
            "args.properties.\\u{1b}[2J"
        ],
        "{warnings:?}"
    );
    assert!(
        warnings[0].1.contains("adds an argument `target_host`"),
        "{warnings:?}"
    );
    assert!(warnings[1].1.contains("1 to 64 characters"), "{warnings:?}");
}

#[test]
fn bad_tool_name() {
    let parsed = parse("bad name", Path::new("/tools/bad name.meta"), b"{}");
    assert!(parsed.meta.is_none());
    assert!(parsed.diagnostics.iter().any(|d| d.code == Code::BadName));
}

#[test]
fn unknown_match_key_is_a_warning_that_lint_makes_an_error() {
    let (ok, _) = problems(r#"{"description": "d", "variants": [{"match": {"kernel": "6"}}]}"#);
    assert!(ok);
    let parsed = parse(
        "t",
        Path::new("/tools/t.meta"),
        br#"{"description": "d", "variants": [{"match": {"kernel": "6"}}]}"#,
    );
    let d = &parsed.diagnostics[0];
    assert_eq!(
        (d.code, d.severity, d.lint_severity()),
        (Code::UnknownMatchKey, Severity::Warning, Severity::Error)
    );
    assert_eq!(d.field.as_deref(), Some("variants[0].match.kernel"));
    assert!(
        d.message
            .contains("known: os, arch, binary, file, env, nenv"),
        "{}",
        d.message
    );
}

#[test]
fn unknown_fields_are_kept_with_a_warning() {
    let parsed = parse(
        "t",
        Path::new("/tools/t.meta"),
        br#"{"description": "d", "icon": "x", "variants": [{"color": 1}]}"#,
    );
    let meta = parsed.meta.unwrap();
    assert_eq!(meta.unknown.get("icon"), Some(&serde_json::json!("x")));
    let fields: Vec<_> = parsed
        .diagnostics
        .iter()
        .filter(|d| d.code == Code::UnknownField)
        .map(|d| d.field.clone())
        .collect();
    assert_eq!(
        fields,
        [
            Some("icon".to_string()),
            Some("variants[0].color".to_string())
        ]
    );
    assert!(
        parsed
            .diagnostics
            .iter()
            .all(|d| d.severity == Severity::Warning)
    );
}

#[test]
fn rust_vocabulary_gets_a_hint() {
    let (ok, list) = problems(
        r#"{"description": "d", "variants": [{"match": {"os": "macos", "arch": ["x86_64"]}}]}"#,
    );
    assert!(ok);
    let msgs: Vec<_> = list.iter().map(|(_, _, _, m)| m.as_str()).collect();
    assert!(
        msgs.iter().any(|m| m.contains("did you mean `darwin`")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter().any(|m| m.contains("did you mean `amd64`")),
        "{msgs:?}"
    );
}

#[test]
fn every_error_is_reported_not_just_the_first() {
    let (ok, list) = problems(
        r#"{"description": 1, "tier": "x", "args": {"type": 3}, "variants": [{"cmd": 2}]}"#,
    );
    assert!(!ok);
    assert_eq!(
        list.iter().filter(|(s, ..)| *s == Severity::Error).count(),
        4,
        "{list:?}"
    );
}

#[test]
fn missing_description_is_warned() {
    let (ok, list) = problems(r#"{"cmd": "true"}"#);
    assert!(ok);
    assert!(list.iter().any(|(s, c, f, _)| *s == Severity::Warning
        && *c == Code::Suspicious
        && f.as_deref() == Some("description")));
}
