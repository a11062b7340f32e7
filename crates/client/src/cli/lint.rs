//! `toolctl lint`: every problem in every `.meta` file, one per line, with file and field.

use std::path::{Path, PathBuf};

use toolsrv_meta::{Code, Diagnostic, Host, Severity};
use toolsrv_registry::{ReadError, Scanner, read_meta, split_tools_path};

use super::exit;

/// Lints files, directories and tools paths; exits non-zero when any problem is an error.
pub fn run(paths: &[std::ffi::OsString], json: bool) -> u8 {
    let mut diags = Vec::new();
    for arg in paths {
        // The directories of one tools path are scanned together, as a registry reads them:
        // a tool in two of them is reported shadowed in the later one.
        // A path that cannot be looked at (missing, a link that leads nowhere) is a file when
        // it is named like one, so that lint says what is wrong with it; else a directory.
        let (files, dirs): (Vec<PathBuf>, Vec<PathBuf>) =
            split_tools_path(arg).into_iter().partition(|p| {
                std::fs::metadata(p).map_or_else(
                    |_| {
                        p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.ends_with(".meta"))
                    },
                    |m| !m.is_dir(),
                )
            });
        for file in &files {
            diags.extend(lint_file(file));
        }
        if !dirs.is_empty() {
            diags.extend(lint_dirs(dirs));
        }
    }
    let mut errors = 0;
    for d in &diags {
        let severity = d.lint_severity();
        if severity == Severity::Error {
            errors += 1;
        }
        if json {
            let mut value = serde_json::to_value(d).unwrap_or_default();
            value["severity"] = serde_json::json!(severity);
            super::say_out(value);
        } else {
            // One line per problem whatever the file is called: a name holding a line break or
            // an escape sequence is shown escaped, not obeyed by the terminal.
            let line = Diagnostic {
                severity,
                ..d.clone()
            }
            .to_string();
            super::say_out(super::quote::printable(&line));
        }
    }
    if !json {
        let warnings = diags.len() - errors;
        eprintln!("{errors} error(s), {warnings} warning(s)");
    }
    if errors > 0 { exit::LINT_ERRORS } else { 0 }
}

/// The directories of one tools path, in order. (Anything but a directory is linted as a file:
/// a FIFO or a device named on the command line is reported as what it is, not as a directory
/// that cannot be read.)
fn lint_dirs(dirs: Vec<PathBuf>) -> Vec<Diagnostic> {
    let mut scanner = Scanner::new(dirs.clone());
    let catalog = scanner.scan();
    let mut diags = catalog.diagnostics;
    for (name, tool) in &catalog.tools {
        diags.extend(command_problems(
            name,
            &tool.meta.path,
            tool.meta.def.cmd.is_some() || has_variant_cmd(&tool.meta),
        ));
    }
    // The scanner names a directory as an absolute path: `lint tools` of a missing `tools` is
    // an error too.
    let named: Vec<PathBuf> = dirs
        .iter()
        .flat_map(|d| {
            [
                d.clone(),
                std::path::absolute(d).unwrap_or_else(|_| d.clone()),
            ]
        })
        .collect();
    for d in diags
        .iter_mut()
        .filter(|d| d.code == Code::Io && named.contains(&d.file))
    {
        d.severity = Severity::Error;
    }
    diags
}

fn lint_file(path: &Path) -> Vec<Diagnostic> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(toolsrv_meta::tool_name_of);
    let Some(name) = name else {
        return vec![Diagnostic::error(
            path,
            None,
            Code::BadName,
            "not a .meta file (tool definitions are named N.meta and are not dot-files)",
        )];
    };
    // The registry's reader: the same size limit, the same diagnostics.
    let bytes = match read_meta(path) {
        Ok(bytes) => bytes,
        Err(ReadError::Rejected(diag)) => return vec![*diag],
        Err(ReadError::Short(e)) => {
            return vec![Diagnostic::error(
                path,
                None,
                Code::Io,
                format!("cannot read: {e} (the machine is short of file descriptors or memory)"),
            )];
        }
        Err(ReadError::Gone) => {
            return vec![Diagnostic::error(
                path,
                None,
                Code::Io,
                "cannot read: no such file",
            )];
        }
    };
    let parsed = toolsrv_meta::parse(name, path, &bytes);
    let mut diags = parsed.diagnostics;
    if let Some(meta) = parsed.meta {
        diags.extend(command_problems(
            name,
            path,
            meta.def.cmd.is_some() || has_variant_cmd(&meta),
        ));
    }
    diags
}

fn has_variant_cmd(meta: &toolsrv_meta::Meta) -> bool {
    meta.variants.iter().any(|v| v.def.cmd.is_some())
}

/// Warns about a file beside the `.meta` that is not executable, and a tool that only works if on PATH.
fn command_problems(name: &str, meta_path: &Path, has_cmd: bool) -> Vec<Diagnostic> {
    let dir = meta_path.parent().unwrap_or(Path::new("."));
    let beside: PathBuf = dir.join(name);
    let host = Host::current();
    let mut out = Vec::new();
    let warn = |message: String| Diagnostic::warning(meta_path, None, Code::Suspicious, message);
    if beside.is_file() && !host.fs.is_executable(&beside) {
        out.push(warn(format!(
            "{} is not executable, so it is not used: chmod +x it",
            beside.display()
        )));
    } else if !beside.is_file() && !has_cmd {
        out.push(warn(format!("no executable `{name}` beside it and no `cmd`: the tool runs only where `{name}` is on PATH")));
    }
    out
}
