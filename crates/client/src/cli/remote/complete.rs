//! Shell completion of what only the coordinator knows: host ids (`call`, `describe`, `tools`,
//! and `fanout` and `find` selectors), the tools a host offers (`call HOST <TAB>`) and a tool's
//! arguments as `KEY=VALUE` words (`call HOST TOOL <TAB>`); and, from the tools path rather than
//! the coordinator, the tools and arguments of `local call` and `local describe`.
//!
//! The shell runs `toolctl` with `TOOLCTL_COMPLETE=SHELL` and the words typed so far; these
//! completers connect as the command itself would (the `--addr`, `--ca`, `--cert`, `--key` and
//! `--control` already typed, else their environment variables), quietly and for at most
//! [`COMPLETION_WAIT`]: a coordinator that is not there completes nothing, it prints nothing.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::time::Duration;

use clap_complete::CompletionCandidate;

use super::ConnArgs;
use crate::Client;

/// Longest a completion waits for the coordinator.
pub const COMPLETION_WAIT: Duration = Duration::from_secs(2);

/// Options of the commands completed here that take a value: the word after one is not a
/// positional.
const VALUE_OPTIONS: [&str; 10] = [
    "--addr",
    "--ca",
    "--cert",
    "--key",
    "--control",
    "--cwd",
    "--timeout",
    "--tools",
    "--as",
    "--output-cap",
];

/// Host ids starting with `current`, each with its state as help.
pub fn hosts(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(current) = current.to_str() else {
        return Vec::new();
    };
    let conn = conn_from(&typed_words());
    let hosts = ask(&conn, |client| async move { client.hosts().await }).unwrap_or_default();
    let words = hosts.into_iter().map(|h| {
        let state = crate::shape::host_state_name(h.state).to_string();
        (h.host_id, Some(state))
    });
    candidates(words, current)
}

/// This client's session ids starting with `current`, each with its hosts and loaded tools as
/// help.
pub fn sessions(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(current) = current.to_str() else {
        return Vec::new();
    };
    let conn = conn_from(&typed_words());
    let sessions = ask(&conn, |client| async move { client.sessions().await }).unwrap_or_default();
    let words = sessions.into_iter().map(|s| {
        let help = format!("hosts `{}`, {} loaded", s.hosts, s.tools.len());
        (s.id, Some(help))
    });
    candidates(words, current)
}

/// For `session load ID <TAB>`, the tools the session's online hosts offer that it has not
/// loaded (at most [`MAX_HOSTS_ASKED`] hosts asked); for `session unload ID <TAB>`, the tools
/// it has loaded. Each starting with `current`.
pub fn session_tools(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(current) = current.to_str().map(str::to_string) else {
        return Vec::new();
    };
    let words = typed_words();
    let Some((command, positionals)) = command_positionals(&words, &["load", "unload"]) else {
        return Vec::new();
    };
    // The session id, and the word being typed.
    let [id, _current] = positionals.as_slice() else {
        return Vec::new();
    };
    let id = id.clone();
    let conn = conn_from(&words);
    let words = ask(&conn, |client| async move {
        let session = client.session(&id).await?;
        let loaded = session.tools.into_iter().map(|t| (t.name, None));
        if command == "unload" {
            return Ok(loaded.collect());
        }
        let loaded: Vec<String> = loaded.map(|(name, _)| name).collect();
        let online = session
            .selected
            .into_iter()
            .filter(|h| h.state == crate::HostState::Online as i32)
            .take(MAX_HOSTS_ASKED)
            .map(|h| h.host_id);
        let mut offered = offered(&client, online).await?;
        offered.retain(|name, _| !loaded.contains(name));
        Ok(offered)
    });
    candidates(words.unwrap_or_default(), &current)
}

/// A selector's first term: `all`, or a host id.
pub fn selectors(current: &OsStr) -> Vec<CompletionCandidate> {
    let all = current
        .to_str()
        .is_some_and(|c| "all".starts_with(c))
        .then(|| CompletionCandidate::new("all").help(Some("every host".into())));
    all.into_iter().chain(hosts(current)).collect()
}

/// The tools offered where the command runs, starting with `current`, each with its description
/// as help: on the host of `call HOST` or `describe HOST`; for `fanout SELECTOR`, on that host
/// when the selector is a host id, else on any online host (the coordinator alone resolves
/// selectors, so this offers a little more than the selector may pick).
pub fn tools(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(current) = current.to_str().map(str::to_string) else {
        return Vec::new();
    };
    let words = typed_words();
    let Some((command, positionals)) = command_positionals(&words, &["call", "describe", "fanout"])
    else {
        return Vec::new();
    };
    // The host or selector, and the word being typed.
    let [target, _current] = positionals.as_slice() else {
        return Vec::new();
    };
    let target = target.clone();
    let conn = conn_from(&words);
    let words = ask(&conn, |client| async move {
        let hosts = hosts_of(&client, &command, &target).await?;
        offered(&client, hosts).await
    });
    candidates(words.unwrap_or_default(), &current)
}

/// Most hosts asked for their tools when completing a selector that is not a host id.
const MAX_HOSTS_ASKED: usize = 64;

/// The tools `hosts` offer, each with its description (the first host's that offers it).
async fn offered(
    client: &Client,
    hosts: impl IntoIterator<Item = String>,
) -> Result<BTreeMap<String, Option<String>>, crate::ClientError> {
    let mut offered = BTreeMap::new();
    for host in hosts {
        for tool in client.tools(&host, false).await?.tools {
            if tool.visible {
                offered.entry(tool.name).or_insert(Some(tool.description));
            }
        }
    }
    Ok(offered)
}

/// Completion candidates of `words` (each with its help) that start with `current`.
fn candidates(
    words: impl IntoIterator<Item = (String, Option<String>)>,
    current: &str,
) -> Vec<CompletionCandidate> {
    words
        .into_iter()
        .filter(|(word, _)| word.starts_with(current))
        .map(|(word, help)| CompletionCandidate::new(word).help(help.map(Into::into)))
        .collect()
}

/// The hosts whose tools complete `command TARGET`: the host itself for `call` and `describe`;
/// for `fanout`, the host a selector names, else the online hosts (at most [`MAX_HOSTS_ASKED`]).
async fn hosts_of(
    client: &Client,
    command: &str,
    target: &str,
) -> Result<Vec<String>, crate::ClientError> {
    if command != "fanout" {
        return Ok(vec![target.to_string()]);
    }
    let hosts = client.hosts().await?;
    if hosts.iter().any(|h| h.host_id == target) {
        return Ok(vec![target.to_string()]);
    }
    Ok(hosts
        .into_iter()
        .filter(|h| h.state == crate::HostState::Online as i32)
        .take(MAX_HOSTS_ASKED)
        .map(|h| h.host_id)
        .collect())
}

/// The argument words of `toolctl call HOST TOOL ...` (or `fanout SELECTOR TOOL ...`) starting
/// with `current`, from the tool's schema as the host resolves it (for a fan-out, the first host
/// of [`hosts_of`] that offers it): see [`argument_words`].
pub fn args(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(current) = current.to_str() else {
        return Vec::new();
    };
    let words = typed_words();
    let Some((command, positionals)) = command_positionals(&words, &["call", "fanout"]) else {
        return Vec::new();
    };
    // HOST (or SELECTOR), TOOL, the arguments typed so far, and the one being typed.
    let [target, tool, typed @ .., _current] = positionals.as_slice() else {
        return Vec::new();
    };
    let (target, tool) = (target.clone(), tool.clone());
    let conn = conn_from(&words);
    let definition = ask(&conn, |client| async move {
        let mut last = None;
        for host in hosts_of(&client, &command, &target).await? {
            match client.describe(&host, &tool).await {
                Ok(definition) => return Ok(Some(definition)),
                Err(e) => last = Some(e),
            }
        }
        last.map_or(Ok(None), Err)
    });
    let Some(definition) = definition.flatten() else {
        return Vec::new();
    };
    let Ok(schema) = serde_json::from_str(&definition.args_schema_json) else {
        return Vec::new();
    };
    candidates(argument_words(&schema, typed, current), current)
}

/// Words for a tool's arguments given its JSON Schema `schema`, starting with `current`: each
/// property not in `typed` as `NAME=` (a string, or a property of no declared type) or `NAME:=`
/// (anything else), required ones first, with the property's description; once `NAME=` is
/// typed, `NAME=VALUE` for each value its `enum` allows (`NAME:=VALUE` for values that are not
/// strings).
fn argument_words(
    schema: &serde_json::Value,
    typed: &[String],
    current: &str,
) -> Vec<(String, Option<String>)> {
    let Some(properties) = schema["properties"].as_object() else {
        return Vec::new();
    };
    let required: Vec<&str> = schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    if let Some((key, _)) = current.split_once('=') {
        let key = key.strip_suffix(':').unwrap_or(key);
        let Some(values) = properties.get(key).and_then(|p| p["enum"].as_array()) else {
            return Vec::new();
        };
        return values
            .iter()
            .map(|v| match v.as_str() {
                Some(text) => format!("{key}={text}"),
                None => format!("{key}:={v}"),
            })
            .filter(|word| word.starts_with(current))
            .map(|word| (word, None))
            .collect();
    }
    let given = |name: &str| {
        typed.iter().any(|w| {
            w.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('=') || rest.starts_with(":="))
        })
    };
    let mut words: Vec<(bool, String, Option<String>)> = properties
        .iter()
        .filter(|(name, _)| !given(name))
        .map(|(name, property)| {
            let stringly = match &property["type"] {
                serde_json::Value::String(t) => t == "string",
                serde_json::Value::Null => true,
                _ => false,
            };
            let word = format!("{name}{}", if stringly { "=" } else { ":=" });
            let is_required = required.contains(&name.as_str());
            let description = property["description"]
                .as_str()
                .and_then(|d| d.lines().next())
                .map(str::to_string);
            let help = match (is_required, description) {
                (true, Some(d)) => Some(format!("(required) {d}")),
                (true, None) => Some("(required)".to_string()),
                (false, d) => d,
            };
            (!is_required, word, help)
        })
        .filter(|(_, word, _)| word.starts_with(current))
        .collect();
    words.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    words
        .into_iter()
        .map(|(_, word, help)| (word, help))
        .collect()
}

/// The tools `toolctl local call` (or `local describe`) would find, starting with `current`: the
/// visible tools of the tools path typed (`--tools`), else `OLLIE_TOOLS_PATH`, on this machine
/// (or as `--as` says).
pub fn local_tools(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(current) = current.to_str() else {
        return Vec::new();
    };
    let views = local_views(&typed_words());
    candidates(
        views
            .into_iter()
            .map(|(name, tool)| (name, tool.description)),
        current,
    )
}

/// The argument words of `toolctl local call TOOL ...` starting with `current`, from the tool's
/// schema as this machine resolves it: see [`argument_words`].
pub fn local_args(current: &OsStr) -> Vec<CompletionCandidate> {
    let Some(current) = current.to_str() else {
        return Vec::new();
    };
    let words = typed_words();
    let Some((_, positionals)) = command_positionals(&words, &["call"]) else {
        return Vec::new();
    };
    // TOOL, the arguments typed so far, and the one being typed.
    let [tool, typed @ .., _current] = positionals.as_slice() else {
        return Vec::new();
    };
    let Some((_, resolved)) = local_views(&words)
        .into_iter()
        .find(|(name, _)| name == tool)
    else {
        return Vec::new();
    };
    candidates(argument_words(&resolved.args, typed, current), current)
}

/// The visible tools, resolved, of the tools path and host facts typed in `words` (or
/// `OLLIE_TOOLS_PATH` and this machine).
fn local_views(words: &[String]) -> Vec<(String, toolsrv_meta::ResolvedTool)> {
    let Some(path) = typed(words, "--tools").or_else(|| env_setting("OLLIE_TOOLS_PATH")) else {
        return Vec::new();
    };
    let tools = crate::cli::ToolsArgs {
        tools: Some(path.into()),
        as_host: typed(words, "--as"),
    };
    let Some((catalog, host)) = crate::cli::local::load_quietly(&tools) else {
        return Vec::new();
    };
    toolsrv_host::view(&catalog, &host)
        .into_iter()
        .filter_map(|v| match v.resolution {
            toolsrv_meta::Resolution::Visible { tool, .. } => Some((v.name, tool)),
            toolsrv_meta::Resolution::Hidden { .. } => None,
        })
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

/// The value of `option` typed in `words` (`--option VALUE` or `--option=VALUE`).
fn typed(words: &[String], option: &str) -> Option<String> {
    let with_equals = format!("{option}=");
    words
        .iter()
        .enumerate()
        .find_map(|(i, w)| match w.strip_prefix(&with_equals) {
            Some(value) => Some(value.to_string()),
            None if w == option => words.get(i + 1).cloned(),
            None => None,
        })
}

/// An environment variable that is set and not empty.
fn env_setting(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|v| !v.is_empty())
}

/// The connection settings typed on the command line, else from the environment.
fn conn_from(words: &[String]) -> ConnArgs {
    let setting = |option: &str, var: &str| typed(words, option).or_else(|| env_setting(var));
    ConnArgs {
        addr: setting("--addr", "TOOLSRV_ADDR"),
        ca: setting("--ca", "TOOLSRV_CA").map(PathBuf::from),
        cert: setting("--cert", "TOOLSRV_CERT").map(PathBuf::from),
        key: setting("--key", "TOOLSRV_KEY").map(PathBuf::from),
        control: setting("--control", "TOOLSRV_CONTROL").map(PathBuf::from),
    }
}

/// The first of `commands` in `words`, and the positional words after it: neither options nor
/// the values of those that take one. The last is the word being completed.
fn command_positionals(words: &[String], commands: &[&str]) -> Option<(String, Vec<String>)> {
    let command = words.iter().position(|w| commands.contains(&w.as_str()))?;
    let mut rest = words[command + 1..].iter();
    let mut positionals = Vec::new();
    while let Some(word) = rest.next() {
        if word.starts_with("--") {
            if VALUE_OPTIONS.contains(&word.as_str()) {
                rest.next();
            }
        } else {
            positionals.push(word.clone());
        }
    }
    Some((words[command].clone(), positionals))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(w: &[&str]) -> Vec<String> {
        w.iter().map(|s| (*s).to_string()).collect()
    }

    #[test]
    fn positionals_skip_options_and_their_values() {
        let positionals =
            |w: &[&str]| command_positionals(&words(w), &["call", "describe", "fanout"]);
        let p = |c: &str, w: &[&str]| Some((c.to_string(), words(w)));
        assert_eq!(
            positionals(&["toolctl", "call", "web-1", "di"]),
            p("call", &["web-1", "di"])
        );
        assert_eq!(
            positionals(&[
                "toolctl",
                "call",
                "--addr",
                "h:1",
                "--approve",
                "--cwd=/t",
                "web-1",
                ""
            ]),
            p("call", &["web-1", ""])
        );
        assert_eq!(
            positionals(&[
                "toolctl",
                "fanout",
                "--timeout",
                "3",
                "role=db",
                "x",
                "a=1",
                ""
            ]),
            p("fanout", &["role=db", "x", "a=1", ""])
        );
        assert_eq!(positionals(&["toolctl", "tools", "a", "b"]), None);
    }

    #[test]
    fn arguments_come_from_the_schema_required_first_and_not_twice() {
        let schema = serde_json::json!({
            "type": "object",
            "required": ["path"],
            "properties": {
                "algorithm": {"type": "string", "enum": ["sha1", "sha256"], "description": "Digest"},
                "path": {"type": "string", "description": "File to hash\nmore"},
                "follow": {"type": "boolean"},
                "limit": {"type": "integer", "enum": [10, 20]},
                "anything": {}
            }
        });
        let words = |typed: &[&str], current: &str| -> Vec<(String, Option<String>)> {
            let typed: Vec<String> = typed.iter().map(|w| (*w).to_string()).collect();
            argument_words(&schema, &typed, current)
        };
        let all: Vec<String> = words(&[], "").into_iter().map(|(w, _)| w).collect();
        assert_eq!(
            all,
            ["path=", "algorithm=", "anything=", "follow:=", "limit:="]
        );
        assert_eq!(
            words(&[], "pa"),
            [(
                "path=".to_string(),
                Some("(required) File to hash".to_string())
            )]
        );
        let left: Vec<String> = words(&["path=/etc/hosts", "follow:=true"], "")
            .into_iter()
            .map(|(w, _)| w)
            .collect();
        assert_eq!(left, ["algorithm=", "anything=", "limit:="]);
        let values: Vec<String> = words(&[], "algorithm=")
            .into_iter()
            .map(|(w, _)| w)
            .collect();
        assert_eq!(values, ["algorithm=sha1", "algorithm=sha256"]);
        assert_eq!(words(&[], "algorithm=sha2")[0].0, "algorithm=sha256");
        assert_eq!(words(&[], "limit:=2")[0].0, "limit:=20");
        assert!(
            words(&[], "path=/e").is_empty(),
            "no enum, nothing to offer"
        );
        assert!(argument_words(&serde_json::json!({}), &[], "").is_empty());
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
