//! `--print-config`: the effective configuration as a TOML file that `--config` reads back,
//! each value with the flag's help above it and where it came from beside it.

use std::any::TypeId;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::{ArgAction, ArgMatches};

use super::file::FileSettings;
use super::{Kind, Setting};

/// Where a flag's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    Flag,
    /// The environment variable, by name.
    Env(String),
    File,
    Default,
    /// No value at all (an optional flag nobody set).
    Unset,
}

/// Width the help comments are wrapped to.
const WIDTH: usize = 96;

/// The configuration of `command` (`toolsrv coordinator`) given by `matches`, `file` being the
/// configuration file read, if any.
pub(crate) fn render(
    command: &str,
    settings: &[Setting],
    matches: &ArgMatches,
    file: Option<&FileSettings>,
) -> String {
    let mut out = format!(
        "# The effective configuration of `{command}`, which `--config` reads back.\n\
         # Beside each value, where it came from: flag, env VARIABLE, file or default.\n"
    );
    if let Some(file) = file {
        let _ = writeln!(out, "# file: {}", file.path.display());
    }
    // Paths given relative on the command line or in the environment are relative to where
    // the process runs; printed absolute, the output means the same wherever it is saved.
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    for setting in settings {
        out.push('\n');
        if let Some(help) = setting.arg.get_help() {
            for line in wrap(&help.to_string(), WIDTH - 2) {
                let _ = writeln!(out, "# {line}");
            }
        }
        let in_file = file.is_some_and(|f| f.values.contains_key(&setting.key));
        let source = super::source(matches, setting, in_file);
        let raw: Vec<&std::ffi::OsStr> = matches
            .get_raw(setting.arg.get_id().as_str())
            .map(Iterator::collect)
            .unwrap_or_default();
        let key = &setting.key;
        let comment = match &source {
            Source::Flag => "flag".to_string(),
            Source::Env(var) => format!("env {var}"),
            Source::File => "file".to_string(),
            Source::Default => "default".to_string(),
            Source::Unset => {
                let _ = writeln!(out, "# {key}: not set");
                continue;
            }
        };
        if setting.is_secret() {
            let _ = writeln!(out, "# {key}: set, not shown  # {comment}");
            continue;
        }
        // TOML holds text only: a value with bytes that are not UTF-8 (a path) cannot be
        // written as it is, and a value with U+FFFD in their place would name something else.
        let Some(values) = raw
            .iter()
            .map(|v| v.to_str().map(str::to_owned))
            .collect::<Option<Vec<String>>>()
        else {
            // Quoted as Rust shows bytes that are not UTF-8: "/srv/tools-\xFF".
            let shown: Vec<String> = raw.iter().map(|v| format!("{v:?}")).collect();
            let _ = writeln!(
                out,
                "# {key}: not UTF-8, which a TOML file cannot hold: give it as the flag or its \
                 environment variable ({})  # {comment}",
                shown.join(", ")
            );
            continue;
        };
        let value = toml_value(setting, &values, &cwd);
        let _ = writeln!(out, "{key} = {value}  # {comment}");
    }
    out
}

/// The TOML for `values`, the flag's raw values.
fn toml_value(setting: &Setting, values: &[String], cwd: &Path) -> String {
    let one = |v: &str| -> String {
        let v = setting.resolve(v, cwd);
        if is_integer_type(setting)
            && let Ok(n) = v.parse::<i64>()
        {
            return n.to_string();
        }
        toml::Value::String(v).to_string()
    };
    match setting.kind {
        Kind::Switch => {
            let holds = values.first().is_some_and(|v| v == "true");
            let given = holds == matches!(setting.arg.get_action(), ArgAction::SetTrue);
            given.to_string()
        }
        Kind::Count => values.first().cloned().unwrap_or_else(|| "0".into()),
        Kind::List => format!(
            "[{}]",
            values.iter().map(|v| one(v)).collect::<Vec<_>>().join(", ")
        ),
        Kind::One => values.first().map(|v| one(v)).unwrap_or_default(),
    }
}

/// Whether the flag holds an integer, to print it as one.
fn is_integer_type(setting: &Setting) -> bool {
    let ty = setting.arg.get_value_parser().type_id();
    [
        TypeId::of::<u8>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
        TypeId::of::<i8>(),
        TypeId::of::<i16>(),
        TypeId::of::<i32>(),
        TypeId::of::<i64>(),
        TypeId::of::<isize>(),
    ]
    .into_iter()
    .any(|t| ty == t)
}

/// `text` in lines of at most `width` characters, broken at spaces (a longer word stays whole).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    for paragraph in text.lines() {
        let mut line = String::new();
        for word in paragraph.split_whitespace() {
            if !line.is_empty() && line.len() + 1 + word.len() > width {
                lines.push(std::mem::take(&mut line));
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(word);
        }
        lines.push(line);
    }
    lines
}
