//! Command resolution: which program a call of a resolved tool runs.

use std::path::{Path, PathBuf};

use crate::host::Host;

/// Where the command of a tool comes from, in order of precedence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandSource {
    /// An executable named like the tool beside its `.meta` file.
    CoLocated(PathBuf),
    /// The resolved `cmd`, run through `/bin/sh -c`.
    Shell(String),
    /// An executable named like the tool on the host's `PATH`.
    OnPath(PathBuf),
}

/// No way to run the tool was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "tool `{name}` has no command: no executable `{name}` beside {}, no `cmd`, and no `{name}` on PATH",
    meta_dir.join(format!("{name}.meta")).display()
)]
pub struct CommandError {
    pub name: String,
    pub meta_dir: PathBuf,
}

/// Resolves the command of tool `name` whose `.meta` is in `meta_dir` and whose resolved `cmd` is `cmd`.
pub fn resolve_command(
    meta_dir: &Path,
    name: &str,
    cmd: Option<&str>,
    host: &Host,
) -> Result<CommandSource, CommandError> {
    let beside = meta_dir.join(name);
    if host.fs.is_executable(&beside) {
        return Ok(CommandSource::CoLocated(beside));
    }
    if let Some(cmd) = cmd.filter(|c| !c.trim().is_empty()) {
        return Ok(CommandSource::Shell(cmd.to_string()));
    }
    host.find_executable(name)
        .map(CommandSource::OnPath)
        .ok_or_else(|| CommandError {
            name: name.to_string(),
            meta_dir: meta_dir.to_path_buf(),
        })
}
