//! Configuration files: `--config FILE` (TOML) sets any flag of a role, `--print-config` shows
//! the effective configuration. Both read clap's own description of the flags, so a flag added
//! to `cli.rs` is settable from the file, and printed, with no code here.
//!
//! A file's values become the flags' defaults before the command line is parsed again, so clap's
//! own order decides: a flag, then its environment variable, then the file, then the default.

mod file;
mod print;

use std::any::TypeId;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Arg, ArgAction, ArgMatches, Args, Command, CommandFactory, FromArgMatches};

use crate::cli::Cli;

/// The id (field name) of `--config`.
const CONFIG_ID: &str = "config";
/// The id (field name) of `--print-config`.
const PRINT_ID: &str = "print_config";

/// `--config` and `--print-config`, flattened into each role that a file can configure.
#[derive(Debug, Args, Clone)]
pub struct ConfigArgs {
    /// A TOML file that sets any of these flags, keyed by the long name with `_` for `-`
    /// (`health_listen = "..."`); flags and environment variables override it
    #[arg(long, env = "TOOLSRV_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration as TOML, with where each value came from, and exit
    #[arg(long)]
    pub print_config: bool,
}

/// What `main` does after reading the command line.
#[derive(Debug)]
pub enum Start {
    /// Run this command.
    Run(Box<Cli>),
    /// Exit at once with this status (the configuration was printed, or refused).
    Exit(ExitCode),
}

/// Reads the command line, the environment and the configuration file it names; prints the
/// effective configuration for `--print-config`. Command-line errors exit as clap does.
pub fn parse_command_line() -> Start {
    match parse_from(std::env::args_os().collect()) {
        Ok(Parsed::Run(cli)) => Start::Run(cli),
        Ok(Parsed::Print { text, cli }) => {
            print!("{text}");
            // Exit 0 all the same: the configuration was shown as asked; what would stop the
            // role is said beside it.
            if let Err(e) = cli.check() {
                eprintln!(
                    "toolsrv: note: this configuration would not start: {}",
                    toolsrv_tls::error_chain(e.as_ref())
                );
            }
            Start::Exit(ExitCode::SUCCESS)
        }
        Err(Failure::Clap(e)) => {
            let argv: Vec<OsString> = std::env::args_os().collect();
            let note = toolsrv_client::cli::env_note::note(&Cli::command(), &argv, &e);
            let _ = e.print();
            if let Some(note) = note {
                eprintln!("{note}");
            }
            Start::Exit(ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2)))
        }
        Err(Failure::File(problems)) => {
            for problem in problems {
                eprintln!("toolsrv: {problem}");
            }
            // As for a bad flag: the file is the command line written down.
            Start::Exit(ExitCode::from(2))
        }
    }
}

enum Parsed {
    Run(Box<Cli>),
    Print { text: String, cli: Box<Cli> },
}

enum Failure {
    Clap(clap::Error),
    /// What is wrong with the configuration file, one problem a line.
    File(Vec<String>),
}

impl From<clap::Error> for Failure {
    fn from(e: clap::Error) -> Self {
        Failure::Clap(e)
    }
}

fn parse_from(argv: Vec<OsString>) -> Result<Parsed, Failure> {
    let command = Cli::command();
    // A first reading finds the subcommand and its `--config` (flag or TOOLSRV_CONFIG); none of
    // the flags is required, so nothing the file could set makes it fail.
    let first = command.clone().try_get_matches_from(&argv)?;
    let Some((name, sub_matches)) = first.subcommand() else {
        return Ok(Parsed::Run(Box::new(Cli::from_arg_matches(&first)?)));
    };
    let Some(sub) = command.find_subcommand(name) else {
        return Ok(Parsed::Run(Box::new(Cli::from_arg_matches(&first)?)));
    };
    if !sub.get_arguments().any(|a| a.get_id() == CONFIG_ID) {
        return Ok(Parsed::Run(Box::new(Cli::from_arg_matches(&first)?)));
    }
    let settings = settings(&command, sub);
    let file = match sub_matches
        .get_one::<PathBuf>(CONFIG_ID)
        .filter(|p| !p.as_os_str().is_empty())
    {
        Some(path) => Some(file::read(path, &settings).map_err(Failure::File)?),
        None => None,
    };
    let print = sub_matches.get_flag(PRINT_ID);
    let (matches, command) = match &file {
        Some(file) => {
            let command = with_defaults(command, name, &settings, file);
            (command.clone().try_get_matches_from(&argv)?, command)
        }
        None => (first.clone(), command),
    };
    let cli = Box::new(Cli::from_arg_matches(&matches)?);
    if !print {
        return Ok(Parsed::Run(cli));
    }
    let sub_matches = matches.subcommand_matches(name).unwrap_or(&matches);
    let text = print::render(
        &format!("{} {name}", command.get_name()),
        &settings,
        sub_matches,
        file.as_ref(),
    );
    Ok(Parsed::Print { text, cli })
}

/// `command` with the file's values as the defaults of their flags.
fn with_defaults(
    mut command: Command,
    sub: &str,
    settings: &[Setting],
    file: &file::FileSettings,
) -> Command {
    for setting in settings {
        let Some(value) = file.values.get(setting.key.as_str()) else {
            continue;
        };
        let values = value.raw.clone();
        let set = move |arg: Arg| arg.default_values(values).required(false);
        let id = setting.arg.get_id().as_str();
        command = if setting.global {
            // Set on the root: clap copies global flags into the subcommands when it builds.
            command.mut_arg(id, set)
        } else {
            command.mut_subcommand(sub, |s| s.mut_arg(id, set))
        };
    }
    command
}

/// A flag that a configuration file may set.
#[derive(Debug, Clone)]
pub(crate) struct Setting {
    /// clap's description of the flag.
    pub arg: Arg,
    /// Its key in a file: the long name with `_` for `-`.
    pub key: String,
    pub kind: Kind,
    /// Defined on the root command for every subcommand (the log flags).
    pub global: bool,
}

/// How a flag takes values, hence which TOML values set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A flag without a value (`--verbose`): a TOML boolean, `true` meaning the flag is given.
    Switch,
    /// A flag given several times to count (`-vvv`): a TOML integer.
    Count,
    /// A repeatable flag (`--label`): a TOML array, or one value.
    List,
    /// A flag with one value: a TOML string, integer or float.
    One,
}

/// How a flag's values name files, so that relative ones in a file mean the file's directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PathKind {
    /// One path: the flag's type is a path, or its value name is `FILE` or `DIR`.
    One,
    /// A colon-separated list of paths: the value name is `PATH` (as in `$PATH`).
    List,
}

/// The flags of subcommand `sub` that a file may set: every flag with a long name but help,
/// version, `--config` and `--print-config`, and the global flags of `root`.
pub(crate) fn settings(root: &Command, sub: &Command) -> Vec<Setting> {
    let own = sub.get_arguments().map(|a| (a, false));
    let global = root
        .get_arguments()
        .filter(|a| a.is_global_set())
        .map(|a| (a, true));
    own.chain(global)
        .filter(|(a, _)| ![CONFIG_ID, PRINT_ID].contains(&a.get_id().as_str()))
        .filter_map(|(arg, global)| {
            let key = arg.get_long()?.replace('-', "_");
            let kind = kind(arg)?;
            Some(Setting {
                arg: arg.clone(),
                key,
                kind,
                global,
            })
        })
        .collect()
}

fn kind(arg: &Arg) -> Option<Kind> {
    match arg.get_action() {
        ArgAction::SetTrue | ArgAction::SetFalse => Some(Kind::Switch),
        ArgAction::Count => Some(Kind::Count),
        ArgAction::Append => Some(Kind::List),
        ArgAction::Set if arg.get_num_args().is_some_and(|n| n.max_values() > 1) => {
            Some(Kind::List)
        }
        ArgAction::Set => Some(Kind::One),
        // Help and version print and exit; nothing to set.
        _ => None,
    }
}

impl Setting {
    /// Whether (and how) the flag's values are paths.
    pub fn path_kind(&self) -> Option<PathKind> {
        if self.arg.get_value_parser().type_id() == TypeId::of::<PathBuf>() {
            return Some(PathKind::One);
        }
        let names = self.arg.get_value_names().unwrap_or_default();
        if names.iter().any(|n| n.as_str() == "PATH") {
            Some(PathKind::List)
        } else if names.iter().any(|n| ["FILE", "DIR"].contains(&n.as_str())) {
            Some(PathKind::One)
        } else {
            None
        }
    }

    /// Whether the flag's value is a secret, never printed: its name or its value's name
    /// (`--join TOKEN`) says token, secret or password.
    pub fn is_secret(&self) -> bool {
        let names = self.arg.get_value_names().unwrap_or_default();
        ["token", "secret", "password"].iter().any(|word| {
            self.key.contains(word)
                || names
                    .iter()
                    .any(|n| n.as_str().to_ascii_lowercase().contains(word))
        })
    }

    /// `value` with its relative paths taken from `base` (a value that is not a path as is).
    pub fn resolve(&self, value: &str, base: &Path) -> String {
        let one = |p: &str| {
            let path = Path::new(p);
            if p.is_empty() || path.is_absolute() {
                p.to_string()
            } else {
                base.join(path).to_string_lossy().into_owned()
            }
        };
        match self.path_kind() {
            None => value.to_string(),
            Some(PathKind::One) => one(value),
            Some(PathKind::List) => value.split(':').map(one).collect::<Vec<_>>().join(":"),
        }
    }
}

/// Where a flag's value came from, for `--print-config`.
pub(crate) fn source(matches: &ArgMatches, setting: &Setting, file: bool) -> print::Source {
    use clap::parser::ValueSource;
    match matches.value_source(setting.arg.get_id().as_str()) {
        Some(ValueSource::CommandLine) => print::Source::Flag,
        Some(ValueSource::EnvVariable) => print::Source::Env(
            setting
                .arg
                .get_env()
                .map(|v| v.to_string_lossy().into_owned())
                .unwrap_or_default(),
        ),
        Some(ValueSource::DefaultValue) if file => print::Source::File,
        Some(_) => print::Source::Default,
        None if file => print::Source::File,
        None => print::Source::Unset,
    }
}

#[cfg(test)]
mod tests;
