//! Turning a call request into a running process: find the tool, validate, resolve the command, spawn.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use toolsrv_exec::{ExecError, Execution, Invocation, Program};
use toolsrv_meta::{ArgsError, CommandError, CommandSource, Host, Resolution, resolve_command};
use toolsrv_registry::Catalog;

/// Per-call limits a host enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Timeout of a call that asks for none.
    pub default_timeout: Duration,
    /// The longest timeout a call may ask for.
    pub max_timeout: Duration,
    /// Most bytes of stdout and stderr (together) delivered per call.
    pub output_cap: u64,
    /// Most bytes of output kept in memory for the final result (the rest is only streamed).
    pub result_cap: u64,
    /// Time between SIGTERM and SIGKILL when a call is stopped.
    pub kill_grace: Duration,
}

/// Most bytes of output (stdout and stderr together) per call on an agent, by default: a host
/// serves the fleet, whose tools may dump a log; running a tool by hand (`toolctl local call`)
/// keeps [`toolsrv_exec::DEFAULT_OUTPUT_CAP`].
pub const AGENT_OUTPUT_CAP: u64 = 16 << 20;

impl Limits {
    /// The limits of an agent's calls by default (`toolsrv agent`, and `toolsrv up`'s agent).
    pub fn agent() -> Self {
        Self {
            output_cap: AGENT_OUTPUT_CAP,
            ..Self::default()
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            default_timeout: Duration::from_secs(60),
            max_timeout: Duration::from_secs(3600),
            output_cap: toolsrv_exec::DEFAULT_OUTPUT_CAP,
            result_cap: toolsrv_exec::DEFAULT_RESULT_CAP,
            kill_grace: toolsrv_exec::DEFAULT_KILL_GRACE,
        }
    }
}

/// One call of one tool.
#[derive(Debug, Clone)]
pub struct CallRequest {
    pub tool: String,
    /// The arguments: a JSON object, validated against the tool's resolved `args` schema.
    pub args: Value,
    /// The same arguments as the caller wrote them, when it did: the tool gets this text on one
    /// line ([`toolsrv_meta::compact_json`]), its numbers and escapes as written. `None`: `args`
    /// written out.
    pub args_text: Option<String>,
    /// The call's working directory (also `PWD`).
    pub cwd: PathBuf,
    /// `None` takes the host's default.
    pub timeout: Option<Duration>,
}

/// Why a call did not start. Nothing ran in any of these cases.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No tool of that name; `suggestion` is a "; did you mean …?" or empty.
    #[error("unknown tool `{name}`{suggestion}")]
    UnknownTool { name: String, suggestion: String },
    #[error("tool `{name}` is hidden on this host: {reason}")]
    Hidden { name: String, reason: String },
    #[error("tool `{name}`: {source}")]
    InvalidArgs { name: String, source: ArgsError },
    #[error("tool `{name}`: timeout of {requested:?} is above this host's maximum of {max:?}")]
    TimeoutTooLong {
        name: String,
        requested: Duration,
        max: Duration,
    },
    #[error(transparent)]
    NoCommand(#[from] CommandError),
    #[error("tool `{name}`: {source}")]
    Spawn { name: String, source: ExecError },
}

/// Checks a call against the catalog as `host` sees it and builds the process invocation.
///
/// `base_env` is the environment the tool starts from; `OLLIE_TOOLS_PATH` and `PWD` are set on top.
pub fn prepare(
    catalog: &Catalog,
    host: &Host,
    req: &CallRequest,
    limits: &Limits,
    base_env: &[(OsString, OsString)],
) -> Result<Invocation, CallError> {
    let name = &req.tool;
    let entry = catalog
        .tools
        .get(name)
        .ok_or_else(|| unknown(catalog, name))?;
    let tool = match entry.meta.resolve(host) {
        Resolution::Visible { tool, .. } => tool,
        Resolution::Hidden { reason } => {
            return Err(CallError::Hidden {
                name: name.clone(),
                reason,
            });
        }
    };
    tool.validator
        .validate(&req.args)
        .map_err(|source| CallError::InvalidArgs {
            name: name.clone(),
            source,
        })?;
    let timeout = req.timeout.unwrap_or(limits.default_timeout);
    if timeout > limits.max_timeout {
        return Err(CallError::TimeoutTooLong {
            name: name.clone(),
            requested: timeout,
            max: limits.max_timeout,
        });
    }
    let dir = entry.meta.dir();
    let program = match resolve_command(dir, name, tool.cmd.as_deref(), host)? {
        CommandSource::CoLocated(path) | CommandSource::OnPath(path) => Program::Exec(path),
        CommandSource::Shell(script) => Program::Shell(script),
    };
    let mut env: Vec<(OsString, OsString)> = base_env
        .iter()
        .filter(|(k, _)| k != "OLLIE_TOOLS_PATH" && k != "PWD")
        .cloned()
        .collect();
    env.push(("OLLIE_TOOLS_PATH".into(), dir.as_os_str().to_owned()));
    env.push(("PWD".into(), req.cwd.as_os_str().to_owned()));
    let mut stdin = match &req.args_text {
        Some(text) => toolsrv_meta::compact_json(text).into_bytes(),
        None => serde_json::to_vec(&req.args).unwrap_or_default(),
    };
    stdin.push(b'\n');
    Ok(Invocation {
        program,
        stdin,
        cwd: req.cwd.clone(),
        env,
        timeout,
        output_cap: limits.output_cap,
        result_cap: limits.result_cap,
        kill_grace: limits.kill_grace,
        jail: None,
    })
}

/// Why `name` is not in `catalog`: invalid (hidden, with what is wrong), or unknown (with the
/// closest names it has).
pub fn unknown(catalog: &Catalog, name: &str) -> CallError {
    match catalog.invalid.get(name) {
        Some(invalid) => CallError::Hidden {
            name: name.to_string(),
            reason: invalid.reason(),
        },
        None => CallError::UnknownTool {
            name: name.to_string(),
            suggestion: toolsrv_meta::did_you_mean(
                name,
                catalog
                    .tools
                    .keys()
                    .chain(catalog.invalid.keys())
                    .map(String::as_str),
            ),
        },
    }
}

/// Starts a prepared call; `cancel` stops it (the whole process group).
pub fn start(
    name: &str,
    invocation: Invocation,
    cancel: CancellationToken,
) -> Result<Execution, CallError> {
    toolsrv_exec::spawn(invocation, cancel).map_err(|source| CallError::Spawn {
        name: name.to_string(),
        source,
    })
}
