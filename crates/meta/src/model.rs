//! The `.meta` document model: top-level definition, variants and their match conditions.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::args::ArgsValidator;

/// Context retention tier of a tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Hot,
    Warm,
    Cold,
}

impl Tier {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "hot" => Some(Tier::Hot),
            "warm" => Some(Tier::Warm),
            "cold" => Some(Tier::Cold),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Hot => "hot",
            Tier::Warm => "warm",
            Tier::Cold => "cold",
        }
    }
}

/// The overridable fields of a tool: the top level sets them, a variant may override each.
///
/// `None` means "not set here": a variant inherits it from the top level.
#[derive(Debug, Clone, Default)]
pub struct ToolDef {
    pub description: Option<String>,
    pub prompt: Option<String>,
    pub keywords: Option<Vec<String>>,
    /// The JSON Schema of the call's arguments, with its compiled validator.
    pub args: Option<(Value, ArgsValidator)>,
    pub tier: Option<Tier>,
    pub cmd: Option<String>,
    pub scope: Option<String>,
    pub output_format: Option<String>,
    pub resets_counter: Option<bool>,
}

impl ToolDef {
    /// Field-by-field inheritance: what `self` sets wins, the rest comes from `base`.
    pub fn over(&self, base: &ToolDef) -> ToolDef {
        ToolDef {
            description: self
                .description
                .clone()
                .or_else(|| base.description.clone()),
            prompt: self.prompt.clone().or_else(|| base.prompt.clone()),
            keywords: self.keywords.clone().or_else(|| base.keywords.clone()),
            args: self.args.clone().or_else(|| base.args.clone()),
            tier: self.tier.or(base.tier),
            cmd: self.cmd.clone().or_else(|| base.cmd.clone()),
            scope: self.scope.clone().or_else(|| base.scope.clone()),
            output_format: self
                .output_format
                .clone()
                .or_else(|| base.output_format.clone()),
            resets_counter: self.resets_counter.or(base.resets_counter),
        }
    }
}

/// A `match` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchKey {
    /// Operating system, in Go's `runtime.GOOS` vocabulary.
    Os,
    /// CPU architecture, in Go's `runtime.GOARCH` vocabulary.
    Arch,
    /// A bare name found executable on `PATH`, or an absolute path to an executable.
    Binary,
    /// A path that exists (file or directory).
    File,
    /// A variable that is set and non-empty.
    Env,
    /// A variable that is empty or unset.
    Nenv,
}

impl MatchKey {
    pub const ALL: [MatchKey; 6] = [
        MatchKey::Os,
        MatchKey::Arch,
        MatchKey::Binary,
        MatchKey::File,
        MatchKey::Env,
        MatchKey::Nenv,
    ];

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            MatchKey::Os => "os",
            MatchKey::Arch => "arch",
            MatchKey::Binary => "binary",
            MatchKey::File => "file",
            MatchKey::Env => "env",
            MatchKey::Nenv => "nenv",
        }
    }
}

impl fmt::Display for MatchKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One key of a `match` object: holds when any of `any_of` holds (a string is a one-element list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    pub key: MatchKey,
    pub any_of: Vec<String>,
}

/// One entry of `variants`: conditions (ANDed) and the fields it overrides.
#[derive(Debug, Clone, Default)]
pub struct Variant {
    pub conditions: Vec<Condition>,
    /// Match keys the contract does not know; a variant with any never matches.
    pub unknown_keys: Vec<String>,
    pub def: ToolDef,
}

/// A parsed `.meta` document.
#[derive(Debug, Clone)]
pub struct Meta {
    /// The tool name: the file name without `.meta`.
    pub name: String,
    /// The `.meta` file.
    pub path: PathBuf,
    pub def: ToolDef,
    pub variants: Vec<Variant>,
    /// Top-level fields this version does not know, kept for forward compatibility.
    pub unknown: Map<String, Value>,
}

impl Meta {
    /// The directory holding the `.meta` file (and a co-located executable, if any).
    pub fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }
}
