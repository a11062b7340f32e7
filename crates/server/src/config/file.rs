//! Reading a configuration file: TOML keys matched to flags, values checked by the flags' own
//! parsers, relative paths taken from the file's directory. Every problem names the file, the
//! line and the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::{Arg, ArgAction, ColorChoice, Command};
use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::{Kind, Setting};

/// The flags a file sets, by key.
#[derive(Debug)]
pub(crate) struct FileSettings {
    /// The file, as named.
    pub path: PathBuf,
    pub values: BTreeMap<String, FileValue>,
}

/// One key of a file: its values as they would be written on the command line, relative paths
/// already resolved.
#[derive(Debug)]
pub(crate) struct FileValue {
    pub raw: Vec<String>,
}

/// Reads `path` against the flags `settings`; the problems, one a line, when it is unusable.
pub(crate) fn read(path: &Path, settings: &[Setting]) -> Result<FileSettings, Vec<String>> {
    // It sets any flag: the policy, the sandbox, who is an administrator.
    if let Some(open) = toolsrv_registry::writable_by_anyone(path) {
        return Err(vec![format!(
            "the configuration file {} is {}",
            path.display(),
            open.explained(
                "anyone here could rewrite how this process runs and who may do what, so it is \
                 not used"
            )
        )]);
    }
    let text = toolsrv_tls::files::read_text_bounded(path, toolsrv_tls::files::MAX_SETTINGS_BYTES)
        .map_err(|e| {
            vec![format!(
                "cannot read the configuration file {}: {e}",
                path.display()
            )]
        })?;
    // Relative paths in the file are taken from its directory, wherever the process runs. The
    // directory without `..` or links, but not the file itself: a Kubernetes ConfigMap's file
    // is a link into a directory that each update replaces.
    let base = std::path::absolute(path)
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .map(|dir| std::fs::canonicalize(&dir).unwrap_or(dir))
        .unwrap_or_default();
    parse(path, &base, &text, settings)
}

/// Parses `text`, the content of `path`, whose relative paths are taken from `base`.
pub(crate) fn parse(
    path: &Path,
    base: &Path,
    text: &str,
    settings: &[Setting],
) -> Result<FileSettings, Vec<String>> {
    // The parser quotes the line it stopped at: whatever it holds is shown escaped.
    let table = DeTable::parse(text).map_err(|e| {
        vec![format!(
            "{}: {}",
            path.display(),
            toolsrv_proto::text::printable_lines(&e.to_string())
        )]
    })?;
    let mut problems: Vec<(usize, String)> = Vec::new();
    let mut values = BTreeMap::new();
    for (key, value) in table.get_ref() {
        let line = line_of(text, key.span().start);
        let key: &str = key.get_ref();
        let at = format!("{}:{line}", path.display());
        let Some(setting) = settings.iter().find(|s| s.key == key) else {
            problems.push((line, unknown(&at, key, settings)));
            continue;
        };
        match raw_values(setting, value).and_then(|raw| {
            raw.into_iter()
                .map(|v| {
                    let v = setting.resolve(&v, base);
                    check(&setting.arg, &v).map(|()| v)
                })
                .collect::<Result<Vec<_>, _>>()
        }) {
            Ok(raw) => {
                values.insert(setting.key.clone(), FileValue { raw });
            }
            Err(why) => problems.push((line, format!("{at}: `{}`: {why}", setting.key))),
        }
    }
    if !problems.is_empty() {
        problems.sort();
        return Err(problems.into_iter().map(|(_, p)| p).collect());
    }
    Ok(FileSettings {
        path: path.to_path_buf(),
        values,
    })
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(0, |before| before.matches('\n').count())
        + 1
}

fn unknown(at: &str, key: &str, settings: &[Setting]) -> String {
    let hint = toolsrv_meta::did_you_mean(key, settings.iter().map(|s| s.key.as_str()));
    let reason = match key {
        "config" => " (a configuration file cannot name another)",
        "print_config" => " (a command-line flag only)",
        _ => "",
    };
    format!("{at}: unknown key `{key}`{reason}{hint}")
}

/// The command-line values a TOML value stands for, or why it does not fit the flag.
fn raw_values(setting: &Setting, value: &Spanned<DeValue<'_>>) -> Result<Vec<String>, String> {
    let value = value.get_ref();
    match setting.kind {
        Kind::Switch => match value {
            // `true` is the flag given; a SetFalse flag then holds false.
            DeValue::Boolean(given) => {
                let holds = *given == matches!(setting.arg.get_action(), ArgAction::SetTrue);
                Ok(vec![holds.to_string()])
            }
            other => Err(format!("takes true or false, not {}", describe(other))),
        },
        Kind::Count => match value {
            DeValue::Integer(_) => scalar(value).map(|v| vec![v]),
            other => Err(format!("takes an integer, not {}", describe(other))),
        },
        Kind::One => match value {
            DeValue::Array(_) | DeValue::Table(_) => Err(format!(
                "takes one value (a string or a number), not {}",
                describe(value)
            )),
            _ => scalar(value).map(|v| vec![v]),
        },
        Kind::List => match value {
            DeValue::Array(items) => items
                .iter()
                .map(|item| scalar(item.get_ref()).map_err(|why| format!("in the array: {why}")))
                .collect(),
            DeValue::Table(_) => Err(format!(
                "takes an array of strings (or one string), not {}",
                describe(value)
            )),
            _ => scalar(value).map(|v| vec![v]),
        },
    }
}

/// The text of a string, number or boolean.
fn scalar(value: &DeValue<'_>) -> Result<String, String> {
    match value {
        DeValue::String(s) => Ok(s.to_string()),
        DeValue::Integer(i) => i128::from_str_radix(i.as_str(), i.radix())
            .map(|n| n.to_string())
            .map_err(|e| format!("integer {i}: {e}")),
        DeValue::Float(f) => Ok(f.as_str().to_string()),
        DeValue::Boolean(b) => Ok(b.to_string()),
        other => Err(format!(
            "takes a string or a number, not {}",
            describe(other)
        )),
    }
}

fn describe(value: &DeValue<'_>) -> &'static str {
    match value {
        DeValue::String(_) => "a string",
        DeValue::Integer(_) => "an integer",
        DeValue::Float(_) => "a float",
        DeValue::Boolean(_) => "a boolean",
        DeValue::Datetime(_) => "a date-time",
        DeValue::Array(_) => "an array",
        DeValue::Table(_) => "a table (settings are top-level keys)",
    }
}

/// Whether the flag's own parser accepts `value`, as if given on the command line: a file is
/// refused for a bad value even when a flag or the environment overrides that key.
fn check(arg: &Arg, value: &str) -> Result<(), String> {
    if matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse) {
        return Ok(());
    }
    let Some(long) = arg.get_long() else {
        return Ok(());
    };
    // A bare copy: the real flag may refer to others (requires, conflicts), absent here.
    let mut probe = Arg::new(arg.get_id().clone())
        .long(long.to_string())
        .value_parser(arg.get_value_parser().clone())
        .action(ArgAction::Append);
    if let Some(names) = arg.get_value_names() {
        probe = probe.value_names(names.to_vec());
    }
    if let Some(delimiter) = arg.get_value_delimiter() {
        probe = probe.value_delimiter(delimiter);
    }
    Command::new("toolsrv")
        .no_binary_name(true)
        .color(ColorChoice::Never)
        .disable_help_flag(true)
        .arg(probe)
        .try_get_matches_from([format!("--{long}={value}")])
        .map(drop)
        .map_err(|e| {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            first.strip_prefix("error: ").unwrap_or(first).to_string()
        })
}
