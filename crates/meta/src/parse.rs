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
        let value: Value = match serde_json::from_slice(bytes) {
            Ok(v) => v,
            Err(e) => {
                self.error(None, Code::NotJson, format!("not valid JSON: {e}"));
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
                    if schema.get("type").is_some_and(|t| t != "object") {
                        self.warn(
                            Some(at("args.type")),
                            Code::Suspicious,
                            "arguments are always a JSON object",
                        );
                    }
                    def.args = Some((schema, validator));
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
