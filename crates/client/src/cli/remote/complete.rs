//! Shell completion of what only the coordinator knows: host ids (`call`, `describe`, `tools`,
//! and `fanout` and `find` selectors) and the tools a host offers (`call HOST <TAB>`).
//!
//! The shell runs `toolctl` with `TOOLCTL_COMPLETE=SHELL` and the words typed so far; these completers
//! connect as the command itself would (the `--addr`, `--ca`, `--cert`, `--key` and `--control`
//! already typed, else their environment variables), quietly and for at most
//! [`COMPLETION_WAIT`]: a coordinator that is not there completes nothing, it prints nothing.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::time::Duration;

use clap_complete::CompletionCandidate;

use super::ConnArgs;
use crate::Client;

/// Longest a completion waits for the coordinator.
pub const COMPLETION_WAIT: Duration = Duration::from_secs(2);

/// Options of the remote commands that take a value: the word after one is not a positional.
const VALUE_OPTIONS: [&str; 7] = [
    "--addr",
    "--ca",
    "--cert",
    "--key",
    "--control",
    "--cwd",
    "--timeout",
];

/// Host ids starting with `current`, each with its state as help.
pub fn hosts(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(current) = current.to_str() else {
        return Vec::new();
    };
    let conn = conn_from(&typed_words());
    let Some(hosts) = ask(&conn, |client| async move { client.hosts().await }) else {
        return Vec::new();
    };
    hosts
        .into_iter()
        .filter(|h| h.host_id.starts_with(current))
        .map(|h| {
            let state = crate::shape::host_state_name(h.state);
            CompletionCandidate::new(h.host_id).help(Some(state.into()))
        })
        .collect()
}

/// A selector's first term: `all`, or a host id.
pub fn selectors(current: &OsStr) -> Vec<CompletionCandidate> {
    let all = current
        .to_str()
        .is_some_and(|c| "all".starts_with(c))
        .then(|| CompletionCandidate::new("all").help(Some("every host".into())));
    all.into_iter().chain(hosts(current)).collect()
}

/// The tools the host typed before this word offers, starting with `current`, each with its
/// description as help.
pub fn tools(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(current) = current.to_str() else {
        return Vec::new();
    };
    let words = typed_words();
    let Some(host) = host_word(&words) else {
        return Vec::new();
    };
    let conn = conn_from(&words);
    let Some(listing) = ask(
        &conn,
        |client| async move { client.tools(&host, false).await },
    ) else {
        return Vec::new();
    };
    listing
        .tools
        .into_iter()
        .filter(|t| t.visible && t.name.starts_with(current))
        .map(|t| CompletionCandidate::new(t.name).help(Some(t.description.into())))
        .collect()
}

/// Runs `request` against the coordinator on a runtime of its own, for at most
/// [`COMPLETION_WAIT`]; `None` on any failure, which completion keeps to itself.
fn ask<T, F, Fut>(conn: &ConnArgs, request: F) -> Option<T>
where
    F: FnOnce(Client) -> Fut,
    Fut: Future<Output = Result<T, crate::ClientError>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    runtime.block_on(async {
        tokio::time::timeout(COMPLETION_WAIT, async {
            let client = quiet_connect(conn).await?;
            request(client).await.ok()
        })
        .await
        .ok()
        .flatten()
    })
}

/// [`super::connect`] without a word on stderr: through a master's socket when one answers
/// there, else directly.
async fn quiet_connect(conn: &ConnArgs) -> Option<Client> {
    if let Some(path) = conn.control_path()
        && let Ok(client) = Client::connect_control(&path).await
    {
        return Some(client);
    }
    Client::connect(&conn.direct().ok()?).await.ok()
}

/// The words of the command line being completed: what the shell passes after `--`.
fn typed_words() -> Vec<String> {
    let args: Vec<OsString> = std::env::args_os().collect();
    let after = args.iter().position(|a| a == "--").map_or(0, |i| i + 1);
    args[after..]
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// The connection settings typed on the command line, else from the environment.
fn conn_from(words: &[String]) -> ConnArgs {
    let typed = |option: &str| -> Option<String> {
        let with_equals = format!("{option}=");
        words
            .iter()
            .enumerate()
            .find_map(|(i, w)| match w.strip_prefix(&with_equals) {
                Some(value) => Some(value.to_string()),
                None if w == option => words.get(i + 1).cloned(),
                None => None,
            })
    };
    let setting = |option: &str, var: &str| {
        typed(option).or_else(|| std::env::var(var).ok().filter(|v| !v.is_empty()))
    };
    ConnArgs {
        addr: setting("--addr", "TOOLSRV_ADDR"),
        ca: setting("--ca", "TOOLSRV_CA").map(PathBuf::from),
        cert: setting("--cert", "TOOLSRV_CERT").map(PathBuf::from),
        key: setting("--key", "TOOLSRV_KEY").map(PathBuf::from),
        control: setting("--control", "TOOLSRV_CONTROL").map(PathBuf::from),
    }
}

/// The host of `toolctl call HOST TOOL` (or `describe`): the first positional word after the
/// subcommand, when another word follows it (the one being completed).
fn host_word(words: &[String]) -> Option<String> {
    let command = words.iter().position(|w| w == "call" || w == "describe")?;
    let mut rest = words[command + 1..].iter();
    let mut positionals = Vec::new();
    while let Some(word) = rest.next() {
        if word.starts_with("--") {
            if VALUE_OPTIONS.contains(&word.as_str()) {
                rest.next();
            }
        } else {
            positionals.push(word);
        }
    }
    // The last word is the one being completed.
    (positionals.len() >= 2).then(|| positionals[0].clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(w: &[&str]) -> Vec<String> {
        w.iter().map(|s| (*s).to_string()).collect()
    }

    #[test]
    fn the_host_is_the_first_positional_after_the_command() {
        assert_eq!(
            host_word(&words(&["toolctl", "call", "web-1", "di"])),
            Some("web-1".into())
        );
        assert_eq!(
            host_word(&words(&[
                "toolctl",
                "call",
                "--addr",
                "h:1",
                "--approve",
                "--cwd=/t",
                "web-1",
                ""
            ])),
            Some("web-1".into())
        );
        assert_eq!(
            host_word(&words(&["toolctl", "describe", "--timeout", "3", "db", ""])),
            Some("db".into())
        );
        // Still completing the host, or no such command.
        assert_eq!(host_word(&words(&["toolctl", "call", "we"])), None);
        assert_eq!(host_word(&words(&["toolctl", "tools", "a", "b"])), None);
    }

    #[test]
    fn settings_typed_win_over_the_environment() {
        let conn = conn_from(&words(&[
            "toolctl",
            "call",
            "--addr=https://typed:1",
            "--ca",
            "/typed/ca.pem",
            "x",
        ]));
        assert_eq!(conn.addr.as_deref(), Some("https://typed:1"));
        assert_eq!(conn.ca, Some(PathBuf::from("/typed/ca.pem")));
    }
}
