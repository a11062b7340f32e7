//! Diagnostics: one problem in one `.meta` file, naming the file, the field and the reason.

use std::fmt;
use std::path::PathBuf;

/// How bad a problem is: an error rejects the tool, a warning only informs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Warning,
    Error,
}

/// What kind of problem, so callers (the linter) can treat some kinds more strictly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Code {
    /// The file could not be read.
    Io,
    /// The file (a `.meta` or its executable) is larger than the registry loads.
    TooLarge,
    /// The file is not valid JSON.
    NotJson,
    /// The document or a nested value is not an object where one is required.
    NotObject,
    /// A field has the wrong JSON type.
    WrongType,
    /// `tier` is not one of `hot`, `warm`, `cold`.
    BadTier,
    /// `args` is not a valid JSON Schema.
    InvalidSchema,
    /// The file name does not give a valid tool name.
    BadName,
    /// A field the contract does not know (kept and ignored).
    UnknownField,
    /// A `match` key the contract does not know: the variant never matches.
    UnknownMatchKey,
    /// A value that is legal but almost certainly a mistake.
    Suspicious,
    /// A tool of the same name earlier on the tools path hides this one.
    Shadowed,
    /// The file (a `.meta` or its executable), or a directory on the way to it, is writable by
    /// every user of the machine: the tool is not served.
    Exposed,
}

/// One problem found in one file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Diagnostic {
    pub file: PathBuf,
    /// Path of the offending field, such as `variants[1].match.os`; `None` for the whole file.
    pub field: Option<String>,
    pub severity: Severity,
    pub code: Code,
    pub message: String,
}

impl Diagnostic {
    pub fn new(
        file: &std::path::Path,
        field: Option<String>,
        severity: Severity,
        code: Code,
        message: impl Into<String>,
    ) -> Self {
        Self {
            file: file.to_path_buf(),
            field,
            severity,
            code,
            message: message.into(),
        }
    }

    pub fn error(
        file: &std::path::Path,
        field: Option<String>,
        code: Code,
        message: impl Into<String>,
    ) -> Self {
        Self::new(file, field, Severity::Error, code, message)
    }

    pub fn warning(
        file: &std::path::Path,
        field: Option<String>,
        code: Code,
        message: impl Into<String>,
    ) -> Self {
        Self::new(file, field, Severity::Warning, code, message)
    }

    /// Severity as the linter sees it: problems that silently change behaviour are errors there.
    pub fn lint_severity(&self) -> Severity {
        match self.code {
            Code::UnknownMatchKey => Severity::Error,
            _ => self.severity,
        }
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Severity::Warning => "warning",
            Severity::Error => "error",
        })
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: ", self.file.display(), self.severity)?;
        if let Some(field) = &self.field {
            write!(f, "field `{field}`: ")?;
        }
        f.write_str(&self.message)
    }
}
