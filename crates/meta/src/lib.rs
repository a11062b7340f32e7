//! The `.meta` tool contract: parsing, linting, host facts, variant and command resolution, argument validation.
//!
//! Everything here is pure or touches the file system only through [`FileProbe`], so the
//! coordinator, the agent, the CLI and the tests share one implementation and can evaluate
//! a tool as any host without a network.

mod args;
mod command;
mod diag;
mod host;
mod model;
mod name;
mod parse;
mod resolve;
mod suggest;

pub use args::{
    ArgsError, ArgsTextError, ArgsValidator, JsonValuesError, MAX_ARGS_VALUES, Violation,
    check_args_json, compact_json, json_error, parse_args_json, read_json_values,
};
pub use command::{CommandError, CommandSource, resolve_command};
pub use diag::{Code, Diagnostic, Severity};
pub use host::{FileProbe, Host, RealFs, go_arch, go_os, path_list};
pub use model::{Condition, MatchKey, Meta, Tier, ToolDef, Variant};
pub use name::{MAX_NAME_BYTES, NAME_RULE, is_valid_name, name_problem, tool_name_of};
pub use parse::{MCP_HOST_ARG, MCP_MAX_NAME_CHARS, MCP_OWN_TOOLS, Parsed, parse};
pub use resolve::{Resolution, ResolvedTool};
pub use suggest::{closest, did_you_mean};

/// File extension of tool definitions (`N.meta` declares the tool `N`).
pub const META_EXTENSION: &str = "meta";
