//! Variant evaluation: which definition of a tool a given host sees, or why it sees none.

use serde::Serialize;
use serde_json::{Value, json};

use crate::args::ArgsValidator;
use crate::host::Host;
use crate::model::{Condition, MatchKey, Meta, Tier, ToolDef};

/// What a host sees of one tool.
// Most tools resolve visible, so boxing the large variant would only add an allocation per tool.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Resolution {
    /// The tool is offered; `variant` is the index of the variant that decided, if any.
    Visible {
        variant: Option<usize>,
        tool: ResolvedTool,
    },
    /// The tool has variants and none matches this host.
    Hidden { reason: String },
}

impl Resolution {
    pub fn tool(&self) -> Option<&ResolvedTool> {
        match self {
            Resolution::Visible { tool, .. } => Some(tool),
            Resolution::Hidden { .. } => None,
        }
    }
}

/// A tool's definition after variant resolution: what models see, plus the command to run.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedTool {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub keywords: Vec<String>,
    /// The `args` schema; `{"type":"object"}` when the tool declares none.
    pub args: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<Tier>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_format: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resets_counter: Option<bool>,
    /// The resolved `cmd`; not model-facing.
    #[serde(skip)]
    pub cmd: Option<String>,
    #[serde(skip)]
    pub validator: ArgsValidator,
}

impl ResolvedTool {
    /// The text a request is ranked against: description, prompt and keywords.
    pub fn ranking_text(&self) -> String {
        let mut text = String::new();
        for part in [self.description.as_deref(), self.prompt.as_deref()]
            .into_iter()
            .flatten()
        {
            text.push_str(part);
            text.push('\n');
        }
        text.push_str(&self.keywords.join("\n"));
        text
    }
}

impl Meta {
    /// Evaluates the variants against `host`: the first whose conditions all hold decides.
    pub fn resolve(&self, host: &Host) -> Resolution {
        if self.variants.is_empty() {
            return Resolution::Visible {
                variant: None,
                tool: self.finish(&self.def),
            };
        }
        let mut misses = Vec::with_capacity(self.variants.len());
        for (i, variant) in self.variants.iter().enumerate() {
            let miss = match variant.unknown_keys.first() {
                Some(key) => Some(format!("unknown match key `{key}`")),
                None => variant.conditions.iter().find_map(|c| miss(c, host)),
            };
            match miss {
                None => {
                    return Resolution::Visible {
                        variant: Some(i),
                        tool: self.finish(&variant.def.over(&self.def)),
                    };
                }
                Some(why) => misses.push(format!("variant {i}: {why}")),
            }
        }
        Resolution::Hidden {
            reason: format!("no variant matches this host ({})", misses.join("; ")),
        }
    }

    /// The definition a host that chose `variant` sees (`None`: the tool's own, for a tool
    /// without variants), as [`Meta::resolve`] gives it; `None` when no host can have chosen
    /// it: the tool has no such variant, or it has variants and none was named, or the
    /// variant has a match key this version does not know (so it never matches).
    pub fn resolve_variant(&self, variant: Option<usize>) -> Option<ResolvedTool> {
        match variant {
            None if self.variants.is_empty() => Some(self.finish(&self.def)),
            None => None,
            Some(i) => self
                .variants
                .get(i)
                .filter(|v| v.unknown_keys.is_empty())
                .map(|v| self.finish(&v.def.over(&self.def))),
        }
    }

    fn finish(&self, def: &ToolDef) -> ResolvedTool {
        let (args, validator) = match &def.args {
            Some((schema, validator)) => (schema.clone(), validator.clone()),
            None => default_args(),
        };
        ResolvedTool {
            name: self.name.clone(),
            description: def.description.clone(),
            prompt: def.prompt.clone(),
            keywords: def.keywords.clone().unwrap_or_default(),
            args,
            tier: def.tier,
            scope: def.scope.clone(),
            output_format: def.output_format.clone(),
            resets_counter: def.resets_counter,
            cmd: def.cmd.clone(),
            validator,
        }
    }
}

fn default_args() -> (Value, ArgsValidator) {
    static DEFAULT: std::sync::OnceLock<(Value, ArgsValidator)> = std::sync::OnceLock::new();
    DEFAULT
        .get_or_init(|| {
            let schema = json!({"type": "object"});
            // A constant, well-formed schema: compiling it cannot fail.
            #[allow(clippy::expect_used)]
            let validator = ArgsValidator::compile(&schema).expect("the default schema compiles");
            (schema, validator)
        })
        .clone()
}

/// Why a condition does not hold on `host`, or `None` when it holds.
fn miss(c: &Condition, host: &Host) -> Option<String> {
    let holds = |v: &String| match c.key {
        MatchKey::Os => host.os == *v,
        MatchKey::Arch => host.arch == *v,
        MatchKey::Binary => host.find_executable(v).is_some(),
        MatchKey::File => host.fs.exists(std::path::Path::new(v)),
        MatchKey::Env => host.env_set(v),
        MatchKey::Nenv => !host.env_set(v),
    };
    if c.any_of.iter().any(holds) {
        return None;
    }
    let wanted = c
        .any_of
        .iter()
        .map(|v| format!("`{v}`"))
        .collect::<Vec<_>>()
        .join(" or ");
    Some(match c.key {
        MatchKey::Os => format!("os is `{}`, not {wanted}", host.os),
        MatchKey::Arch => format!("arch is `{}`, not {wanted}", host.arch),
        MatchKey::Binary => format!("no executable {wanted} found"),
        MatchKey::File => format!("no file {wanted}"),
        MatchKey::Env => format!("env {wanted} unset or empty"),
        MatchKey::Nenv => format!("env {wanted} set"),
    })
}
