//! What a command-line error owes to the environment: clap names the flag whose value it
//! refused, not the variable the value came from (`TOOLSRV_LABELS='a=b,c'` is reported as a bad
//! `--label`), and says only "invalid UTF-8 was detected" when a variable is not UTF-8. The
//! note names the variable.

use std::ffi::OsString;

use clap::Command;
use clap::error::{ContextKind, ContextValue, ErrorKind};

/// The flags of `command` and its subcommands that take their value from an environment
/// variable: (`--flag`, variable).
fn flags_with_env(command: &Command, out: &mut Vec<(String, String)>) {
    for arg in command.get_arguments() {
        if let (Some(long), Some(var)) = (arg.get_long(), arg.get_env()) {
            out.push((format!("--{long}"), var.to_string_lossy().into_owned()));
        }
    }
    for sub in command.get_subcommands() {
        flags_with_env(sub, out);
    }
}

/// A line to print after `error`, naming the environment variable behind it; `None` when the
/// error is not about a value from the environment. `argv` is the command line as given.
pub fn note(command: &Command, argv: &[OsString], error: &clap::Error) -> Option<String> {
    note_with(command, argv, error, |var| std::env::var_os(var))
}

fn note_with(
    command: &Command,
    argv: &[OsString],
    error: &clap::Error,
    env: impl Fn(&str) -> Option<OsString>,
) -> Option<String> {
    let mut flags = Vec::new();
    flags_with_env(command, &mut flags);
    match error.kind() {
        ErrorKind::InvalidUtf8 => {
            let mut bad: Vec<&str> = flags
                .iter()
                .filter(|(_, var)| env(var).is_some_and(|v| v.to_str().is_none()))
                .map(|(_, var)| var.as_str())
                .collect();
            bad.sort_unstable();
            bad.dedup();
            (!bad.is_empty()).then(|| {
                format!(
                    "note: the environment variable {} is not UTF-8, and its value must be \
                     text: set it again, or unset it",
                    bad.join(", ")
                )
            })
        }
        ErrorKind::ValueValidation | ErrorKind::InvalidValue => {
            let Some(ContextValue::String(arg)) = error.get(ContextKind::InvalidArg) else {
                return None;
            };
            let long = arg.split_whitespace().next()?;
            let given = argv.iter().any(|a| {
                a.to_str()
                    .is_some_and(|a| a == long || a.starts_with(&format!("{long}=")))
            });
            if given {
                return None;
            }
            let (_, var) = flags
                .iter()
                .find(|(flag, var)| flag == long && env(var).is_some())?;
            Some(format!(
                "note: {long} is not on the command line: the value comes from the environment \
                 variable {var}"
            ))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use clap::{Arg, ArgAction};

    fn command() -> Command {
        Command::new("t").subcommand(
            Command::new("agent")
                .arg(
                    Arg::new("label")
                        .long("label")
                        .env("T_LABELS")
                        .value_delimiter(',')
                        .action(ArgAction::Append)
                        .value_parser(|v: &str| {
                            v.contains('=')
                                .then(|| v.to_string())
                                .ok_or("expected KEY=VALUE")
                        }),
                )
                .arg(Arg::new("host").long("host").env("T_HOST")),
        )
    }

    fn env_of(pairs: &[(&str, OsString)]) -> impl Fn(&str) -> Option<OsString> + use<> {
        let pairs: Vec<(String, OsString)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        move |var| pairs.iter().find(|(k, _)| k == var).map(|(_, v)| v.clone())
    }

    #[test]
    fn a_bad_value_from_the_environment_names_its_variable() {
        let argv: Vec<OsString> = ["t", "agent"].iter().map(Into::into).collect();
        let env = env_of(&[("T_LABELS", "a=b,c".into())]);
        // clap reads the real environment; the note is held against the same value.
        let error = command()
            .try_get_matches_from(["t", "agent", "--label", "c"])
            .unwrap_err();
        assert_eq!(
            note_with(&command(), &argv, &error, &env).as_deref(),
            Some(
                "note: --label is not on the command line: the value comes from the \
                 environment variable T_LABELS"
            )
        );
        // Given on the command line: the flag is to blame, as clap says.
        let argv: Vec<OsString> = ["t", "agent", "--label", "c"]
            .iter()
            .map(Into::into)
            .collect();
        assert_eq!(note_with(&command(), &argv, &error, &env), None);
    }

    #[test]
    fn a_variable_that_is_not_utf8_is_named() {
        use std::os::unix::ffi::OsStringExt;
        let odd = OsString::from_vec(b"web\xff".to_vec());
        let error = clap::Error::new(ErrorKind::InvalidUtf8);
        let env = env_of(&[("T_HOST", odd), ("T_LABELS", "a=b".into())]);
        assert_eq!(
            note_with(&command(), &[], &error, &env).as_deref(),
            Some(
                "note: the environment variable T_HOST is not UTF-8, and its value must be \
                 text: set it again, or unset it"
            )
        );
        assert_eq!(note_with(&command(), &[], &error, env_of(&[])), None);
    }
}
