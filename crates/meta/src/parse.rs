//! Parsing a `.meta` document into a [`Meta`], collecting every problem with its field path.

use std::path::Path;

use serde_json::{Map, Value};

use crate::args::{ArgsValidator, json_type};
use crate::diag::{Code, Diagnostic, Severity};
use crate::model::{Condition, MatchKey, Meta, Tier, ToolDef, Variant};
use crate::name::{NAME_RULE, name_problem};

/// The outcome of parsing one file: the tool (absent when any error was found) and every problem.
#[derive(Debug)]
pub struct Parsed {
    pub meta: Option<Meta>,
    pub diagnostics: Vec<Diagnostic>,
}

/// GOOS values Go knows; others are accepted but warned about.
const GO_OS: &[&str] = &[
    "aix",
    "android",
    "darwin",
    "dragonfly",
    "freebsd",
    "illumos",
    "ios",
    "js",
    "linux",
    "netbsd",
    "openbsd",
    "plan9",
    "solaris",
    "wasip1",
    "windows",
];
/// GOARCH values Go knows; others are accepted but warned about.
const GO_ARCH: &[&str] = &[
    "386", "amd64", "arm", "arm64", "loong64", "mips", "mipsle", "mips64", "mips64le", "ppc64",
    "ppc64le", "riscv64", "s390x", "wasm",
];

/// Parses the `.meta` file at `path` (whose bytes are `bytes`) declaring the tool `name`.
pub fn parse(name: &str, path: &Path, bytes: &[u8]) -> Parsed {
    let mut p = Parser {
        path,
        diags: Vec::new(),
    };
    let meta = p.document(name, bytes);
    let failed = p.diags.iter().any(|d| d.severity == Severity::Error);
    Parsed {
        meta: if failed { None } else { meta },
        diagnostics: p.diags,
    }
}

struct Parser<'a> {
    path: &'a Path,
    diags: Vec<Diagnostic>,
}

impl Parser<'_> {
    fn error(&mut self, field: Option<String>, code: Code, msg: impl Into<String>) {
        self.diags
            .push(Diagnostic::error(self.path, field, code, msg));
    }

    fn warn(&mut self, field: Option<String>, code: Code, msg: impl Into<String>) {
        self.diags
            .push(Diagnostic::warning(self.path, field, code, msg));
    }

    /// Warns of a valid tool name that MCP clients or model APIs will not take as it is.
    fn name_for_models(&mut self, name: &str) {
        if name_problem(name).is_some() {
            return;
        }
        let problem = if MCP_OWN_TOOLS.contains(&name) {
            "`toolctl mcp` offers a tool of its own by this name, so MCP clients are never \
             offered this one: rename the file"
        } else if name.len() > MCP_MAX_NAME_CHARS {
            "the name is longer than the 128 characters MCP allows, so `toolctl mcp` does not \
             offer the tool to MCP clients: rename the file"
        } else if !model_api_name(name, false) {
            "the name is longer than 64 characters, or has a `.`: some model APIs (OpenAI's \
             function names) refuse it, and a client of theirs may refuse every tool of the \
             session: rename the file"
        } else {
            return;
        };
        self.warn(None, Code::Suspicious, problem);
    }

    fn document(&mut self, name: &str, bytes: &[u8]) -> Option<Meta> {
        if let Some(problem) = name_problem(name) {
            self.error(
                None,
                Code::BadName,
                format!(
                    "`{name}` is not a valid tool name: {problem}; {NAME_RULE}, rename the file"
                ),
            );
        }
        self.name_for_models(name);
        // A key given twice is refused, as in call arguments: whoever reviews the file reads
        // the first, this parser keeps the last.
        if let Err(crate::JsonValuesError::Invalid(e)) = crate::read_json_values(bytes, usize::MAX)
        {
            self.error(None, Code::NotJson, not_json(bytes, &e));
            return None;
        }
        let value: Value = match serde_json::from_slice(bytes) {
            Ok(v) => v,
            Err(e) => {
                self.error(None, Code::NotJson, not_json(bytes, &e));
                return None;
            }
        };
        let Value::Object(mut obj) = value else {
            self.error(
                None,
                Code::NotObject,
                format!(
                    "a .meta document must be a JSON object, got {}",
                    json_type(&value)
                ),
            );
            return None;
        };
        let variants = obj.remove("variants");
        let (def, unknown) = self.def(obj, "", false);
        for key in unknown.keys() {
            self.warn(
                Some(key.clone()),
                Code::UnknownField,
                "unknown field, kept and ignored",
            );
        }
        let variants = variants.map(|v| self.variants(v)).unwrap_or_default();
        // A description of the wrong type is reported as such, not also as missing.
        let mistyped = self.diags.iter().any(|d| {
            d.code == Code::WrongType
                && d.field
                    .as_deref()
                    .is_some_and(|f| f == "description" || f.ends_with("].description"))
        });
        if !mistyped
            && def.description.as_deref().is_none_or(str::is_empty)
            && variants.iter().all(|v| v.def.description.is_none())
        {
            self.warn(
                Some("description".into()),
                Code::Suspicious,
                "missing: models will not know what the tool does",
            );
        }
        Some(Meta {
            name: name.to_string(),
            path: self.path.to_path_buf(),
            def,
            variants,
            unknown,
        })
    }

    /// Reads the overridable fields out of `obj`; returns what is left over.
    fn def(
        &mut self,
        mut obj: Map<String, Value>,
        prefix: &str,
        in_variant: bool,
    ) -> (ToolDef, Map<String, Value>) {
        let at = |f: &str| format!("{prefix}{f}");
        let mut def = ToolDef {
            description: obj
                .remove("description")
                .and_then(|v| self.string(v, at("description"))),
            prompt: obj
                .remove("prompt")
                .and_then(|v| self.string(v, at("prompt"))),
            keywords: obj
                .remove("keywords")
                .and_then(|v| self.strings(v, at("keywords"))),
            cmd: obj.remove("cmd").and_then(|v| self.string(v, at("cmd"))),
            scope: obj
                .remove("scope")
                .and_then(|v| self.string(v, at("scope"))),
            output_format: obj
                .remove("outputFormat")
                .and_then(|v| self.string(v, at("outputFormat"))),
            ..ToolDef::default()
        };
        let texts = [
            ("description", def.description.as_deref()),
            ("prompt", def.prompt.as_deref()),
            ("scope", def.scope.as_deref()),
            ("outputFormat", def.output_format.as_deref()),
        ];
        for (field, text) in texts {
            self.hidden_characters(at(field), text.unwrap_or_default());
        }
        for (i, keyword) in def.keywords.iter().flatten().enumerate() {
            self.hidden_characters(at(&format!("keywords[{i}]")), keyword);
        }
        if def.cmd.as_deref().is_some_and(|c| c.trim().is_empty()) {
            self.warn(Some(at("cmd")), Code::Suspicious, "empty command");
        }
        if let Some(v) = obj.remove("resetsCounter") {
            match v {
                Value::Bool(b) => def.resets_counter = Some(b),
                other => self.wrong_type(at("resetsCounter"), "boolean", &other),
            }
        }
        if let Some(v) = obj.remove("tier") {
            match v.as_str().map(|s| (s, Tier::parse(s))) {
                Some((_, Some(t))) => def.tier = Some(t),
                Some((s, None)) => self.error(
                    Some(at("tier")),
                    Code::BadTier,
                    format!("`{s}` is not a tier: use hot, warm or cold"),
                ),
                None => self.wrong_type(at("tier"), "string", &v),
            }
        }
        if let Some(schema) = obj.remove("args") {
            match ArgsValidator::compile(&schema) {
                Ok(validator) => {
                    if let Some((field, problem)) = args_problem(&schema) {
                        self.error(Some(at(field)), Code::InvalidSchema, problem);
                    } else if let Some((field, problem)) = foreign_pattern(&schema, &at("args")) {
                        self.error(Some(field), Code::InvalidSchema, problem);
                    } else {
                        self.argument_names(&schema, &at("args.properties"));
                        def.args = Some((schema, validator));
                    }
                }
                Err(reason) => self.error(
                    Some(at("args")),
                    Code::InvalidSchema,
                    format!("not a valid JSON Schema: {reason}"),
                ),
            }
        }
        if in_variant && obj.remove("variants").is_some() {
            self.error(
                Some(at("variants")),
                Code::WrongType,
                "variants cannot be nested inside a variant",
            );
        }
        (def, obj)
    }

    /// Warns of characters in text for models and people that would hide or disguise something
    /// on a terminal: control characters other than line breaks and tabs, direction overrides,
    /// zero-width characters. Clients are shown them escaped, so the text reads oddly.
    fn hidden_characters(&mut self, field: String, text: &str) {
        let hides = |c: char| !matches!(c, '\n' | '\r' | '\t') && toolsrv_proto::text::disguises(c);
        if let Some((at, c)) = text.char_indices().find(|&(_, c)| hides(c)) {
            self.warn(
                Some(field),
                Code::Suspicious,
                format!(
                    "holds {} at byte {at}, a control or invisible formatting character: \
                     clients and terminals are shown it escaped; remove it",
                    c.escape_unicode()
                ),
            );
        }
    }

    /// Warns of argument names that clients of models refuse, or that the MCP server takes.
    fn argument_names(&mut self, schema: &Value, at: &str) {
        let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
            return;
        };
        for key in properties.keys() {
            let field = Some(format!("{at}.{}", shown_key(key)));
            if key == MCP_HOST_ARG {
                self.warn(
                    field,
                    Code::Suspicious,
                    format!(
                        "`toolctl mcp` adds an argument `{MCP_HOST_ARG}` to choose the host when \
                         a session has several, so on such a session MCP clients are not offered \
                         this tool: rename the argument"
                    ),
                );
            } else if !model_api_name(key, true) {
                self.warn(
                    field,
                    Code::Suspicious,
                    "model APIs (OpenAI's, Anthropic's) take argument names of 1 to 64 \
                     characters of A-Z a-z 0-9 _ . - only, and may refuse every tool of a \
                     session that has this one: rename the argument",
                );
            }
        }
    }

    fn variants(&mut self, value: Value) -> Vec<Variant> {
        let Value::Array(items) = value else {
            self.wrong_type("variants".into(), "array of objects", &value);
            return Vec::new();
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.into_iter().enumerate() {
            let prefix = format!("variants[{i}].");
            let Value::Object(mut obj) = item else {
                self.wrong_type(format!("variants[{i}]"), "object", &item);
                continue;
            };
            let mut variant = Variant::default();
            match obj.remove("match") {
                None | Some(Value::Null) => {}
                Some(Value::Object(m)) => self.conditions(m, &prefix, &mut variant),
                Some(other) => self.wrong_type(format!("{prefix}match"), "object", &other),
            }
            let (def, unknown) = self.def(obj, &prefix, true);
            for key in unknown.keys() {
                self.warn(
                    Some(format!("{prefix}{key}")),
                    Code::UnknownField,
                    "unknown field, kept and ignored",
                );
            }
            variant.def = def;
            out.push(variant);
        }
        out
    }

    fn conditions(&mut self, m: Map<String, Value>, prefix: &str, variant: &mut Variant) {
        for (key, value) in m {
            let field = format!("{prefix}match.{key}");
            let Some(mk) = MatchKey::parse(&key) else {
                let known = MatchKey::ALL.map(MatchKey::as_str).join(", ");
                self.warn(
                    Some(field),
                    Code::UnknownMatchKey,
                    format!("unknown match key, so this variant never matches (known: {known})"),
                );
                variant.unknown_keys.push(key);
                continue;
            };
            let values = match value {
                Value::String(s) => vec![s],
                Value::Array(items) => {
                    let mut values = Vec::with_capacity(items.len());
                    for (j, item) in items.into_iter().enumerate() {
                        match item {
                            Value::String(s) => values.push(s),
                            other => self.wrong_type(format!("{field}[{j}]"), "string", &other),
                        }
                    }
                    if values.is_empty() {
                        self.warn(
                            Some(field.clone()),
                            Code::Suspicious,
                            "empty list: this condition never holds",
                        );
                    }
                    values
                }
                other => {
                    self.wrong_type(field, "string or array of strings", &other);
                    continue;
                }
            };
            for v in &values {
                self.check_value(mk, v, &field);
            }
            variant.conditions.push(Condition {
                key: mk,
                any_of: values,
            });
        }
    }

    fn check_value(&mut self, key: MatchKey, value: &str, field: &str) {
        let hint = |v: &str| match v {
            "macos" | "osx" => Some("darwin"),
            "x86_64" | "x64" => Some("amd64"),
            "aarch64" => Some("arm64"),
            "i386" | "i686" | "x86" => Some("386"),
            _ => None,
        };
        let field = Some(field.to_string());
        match key {
            MatchKey::Os if !GO_OS.contains(&value) => {
                let more = hint(value)
                    .map(|h| format!("; did you mean `{h}`?"))
                    .unwrap_or_default();
                self.warn(
                    field,
                    Code::Suspicious,
                    format!("`{value}` is not a Go GOOS value{more}"),
                );
            }
            MatchKey::Arch if !GO_ARCH.contains(&value) => {
                let more = hint(value)
                    .map(|h| format!("; did you mean `{h}`?"))
                    .unwrap_or_default();
                self.warn(
                    field,
                    Code::Suspicious,
                    format!("`{value}` is not a Go GOARCH value{more}"),
                );
            }
            MatchKey::Binary if value.contains('/') && !value.starts_with('/') => {
                self.warn(
                    field,
                    Code::Suspicious,
                    format!("`{value}` is neither a bare name nor an absolute path"),
                );
            }
            MatchKey::Env | MatchKey::Nenv if value.is_empty() || value.contains('=') => {
                self.warn(
                    field,
                    Code::Suspicious,
                    format!("`{value}` is not a variable name"),
                );
            }
            _ => {}
        }
    }

    fn string(&mut self, v: Value, field: String) -> Option<String> {
        match v {
            Value::String(s) => Some(s),
            other => {
                self.wrong_type(field, "string", &other);
                None
            }
        }
    }

    fn strings(&mut self, v: Value, field: String) -> Option<Vec<String>> {
        let Value::Array(items) = v else {
            self.wrong_type(field, "array of strings", &v);
            return None;
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.into_iter().enumerate() {
            match item {
                Value::String(s) => out.push(s),
                other => self.wrong_type(format!("{field}[{i}]"), "string", &other),
            }
        }
        Some(out)
    }

    fn wrong_type(&mut self, field: String, expected: &str, got: &Value) {
        self.error(
            Some(field),
            Code::WrongType,
            format!("expected {expected}, got {}", json_type(got)),
        );
    }
}

/// The tools `toolctl mcp` serves itself, whatever the session loads.
pub const MCP_OWN_TOOLS: [&str; 2] = ["tool_search", "tool_load"];

/// The argument `toolctl mcp` adds to every tool of a session of several hosts, naming the host.
pub const MCP_HOST_ARG: &str = "target_host";

/// The longest tool name MCP allows.
pub const MCP_MAX_NAME_CHARS: usize = 128;

/// The JSON Schema dialects an `args` may name in `$schema`: those MCP clients read.
const READ_DIALECTS: [&str; 4] = [
    "https://json-schema.org/draft/2020-12/schema",
    "https://json-schema.org/draft/2020-12/schema#",
    "http://json-schema.org/draft-07/schema#",
    "http://json-schema.org/draft-07/schema",
];

/// Whether `dialect` (a `$schema` value) is one MCP clients read ([`READ_DIALECTS`]).
fn read_dialect(dialect: &Value) -> bool {
    dialect.as_str().is_some_and(|d| READ_DIALECTS.contains(&d))
}

/// Why `args` cannot take a call's arguments, one JSON object, with the field to name: `false`
/// takes nothing, and a `type` other than `"object"` takes no object (MCP clients also refuse
/// such a schema, and with it the list of every tool).
fn args_problem(schema: &Value) -> Option<(&'static str, String)> {
    match schema {
        Value::Bool(false) => Some((
            "args",
            "`false` accepts no arguments at all, so every call would be refused: leave `args` \
             out for a tool that takes none"
                .into(),
        )),
        Value::Object(object) => match object.get("type") {
            _ if object.get("$schema").is_some_and(|d| !read_dialect(d)) => Some((
                "args.$schema",
                format!(
                    "MCP clients read input schemas as JSON Schema 2020-12 (or draft-07), not \
                     {}: leave `$schema` out and write the schema for 2020-12",
                    shown_value(&object["$schema"])
                ),
            )),
            None => None,
            Some(t) if t == "object" => None,
            Some(t) => Some((
                "args.type",
                format!(
                    "a call's arguments are one JSON object, so `type` must be \"object\" (or \
                     left out), not {}",
                    shown_value(t)
                ),
            )),
        },
        _ => None,
    }
}

/// The first `pattern` (or `patternProperties` key) of `schema` that is no ECMAScript regular
/// expression, with the field path under `at` and why. JSON Schema's patterns are ECMA-262's,
/// and MCP clients compile them so (Ajv, with the `u` flag); the validator here takes more
/// (`(?i)`, `\A`, `(?P<n>...)`, possessive quantifiers, POSIX classes), which a client then
/// refuses, with the tool or with the whole list of tools.
fn foreign_pattern(schema: &Value, at: &str) -> Option<(String, String)> {
    let refused = |field: String, pattern: &str| {
        let e = regress::Regex::with_flags(pattern, "u").err()?;
        Some((
            field,
            format!(
                "{} is not an ECMAScript regular expression, as JSON Schema and MCP clients \
                 read patterns ({e}): write it in that syntax",
                shown_value(&Value::from(pattern))
            ),
        ))
    };
    match schema {
        Value::Object(object) => object.iter().find_map(|(key, value)| {
            let field = format!("{at}.{}", shown_key(key));
            match (key.as_str(), value) {
                ("pattern", Value::String(pattern)) => refused(field, pattern),
                ("patternProperties", Value::Object(patterns)) => {
                    patterns.iter().find_map(|(pattern, sub)| {
                        refused(format!("{field}.{}", shown_key(pattern)), pattern).or_else(|| {
                            foreign_pattern(sub, &format!("{field}.{}", shown_key(pattern)))
                        })
                    })
                }
                _ => foreign_pattern(value, &field),
            }
        }),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| foreign_pattern(item, &format!("{at}[{i}]"))),
        _ => None,
    }
}

/// Whether model APIs take `name`: 1 to 64 characters of `[A-Za-z0-9_-]`, and `.` too when
/// `dot` (argument names: Anthropic's rule; OpenAI's function names take no `.`).
fn model_api_name(name: &str, dot: bool) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-') || (dot && b == b'.'))
}

/// A property name as a field path shows it: control characters escaped, cut to 80 characters.
fn shown_key(key: &str) -> String {
    let mut shown: String = key.chars().take(80).collect();
    if shown.len() < key.len() {
        shown.push('…');
    }
    toolsrv_proto::text::printable(&shown)
}

/// A JSON value as a message quotes it: compact, cut to 80 characters.
fn shown_value(value: &Value) -> String {
    shown_key(&value.to_string())
}

/// Why `bytes` is no JSON, in words that say what to do where serde's do not.
fn not_json(bytes: &[u8], e: &serde_json::Error) -> String {
    if bytes.starts_with(b"\xEF\xBB\xBF") {
        return "not valid JSON: the file starts with a UTF-8 byte-order mark; save it as UTF-8 \
                without one"
            .into();
    }
    format!("not valid JSON: {}", crate::json_error(e))
}
