//! `--config FILE` and `--print-config` as a user meets them: every flag of each role settable
//! from the file, the order of precedence, refusals of bad files before anything starts,
//! relative paths, and a printed configuration read back.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

/// The roles a configuration file configures.
const ROLES: [&str; 2] = ["coordinator", "agent"];

/// `toolsrv ARGS` in `cwd` with only `env` in its environment (the developer's TOOLSRV_* and
/// OLLIE_TOOLS_PATH must not leak in).
fn toolsrv(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_toolsrv"))
        .args(args)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `--print-config` of `role`, which must succeed.
fn print_config(cwd: &Path, role: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = toolsrv(cwd, &[&[role, "--print-config"], args].concat(), env);
    assert!(
        out.status.success(),
        "{role} --print-config {args:?}: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// The value lines of a printed configuration: key → (TOML value, where it came from).
fn entries(printed: &str) -> BTreeMap<String, (String, String)> {
    printed
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (key, rest) = l.split_once(" = ").unwrap();
            let (value, source) = rest.rsplit_once("  # ").unwrap();
            (key.to_string(), (value.to_string(), source.to_string()))
        })
        .collect()
}

/// A flag as `--help` shows it: long name, whether it takes a value, its default, its first
/// possible value.
#[derive(Debug)]
struct HelpFlag {
    long: String,
    takes_value: bool,
    default: Option<String>,
    possible: Option<String>,
}

/// The flags `toolsrv ROLE --help` lists, read from clap's own help rather than from
/// `--print-config`, so that a flag the file mechanism missed is noticed.
fn help_flags(cwd: &Path, role: &str) -> Vec<HelpFlag> {
    let help = text(&toolsrv(cwd, &[role, "--help"], &[]).stdout);
    // Each flag's block: its line (indented at most 6: `  -h, --help`, `      --listen <LISTEN>`)
    // and the lines of help that follow, joined, since clap wraps `[default: ...]` anywhere.
    let mut blocks: Vec<(String, String)> = Vec::new();
    for line in help.lines() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim_start();
        let flag = trimmed.strip_prefix("--").or_else(|| {
            trimmed
                .split_once(", --")
                .map(|(_, f)| f)
                .filter(|_| trimmed.starts_with('-'))
        });
        match flag {
            Some(flag) if (1..=6).contains(&indent) => {
                blocks.push((flag.to_string(), String::new()))
            }
            _ => {
                if let Some((_, rest)) = blocks.last_mut() {
                    rest.push(' ');
                    rest.push_str(trimmed);
                }
            }
        }
    }
    let mut flags: Vec<HelpFlag> = blocks
        .into_iter()
        .map(|(flag, rest)| {
            let long: String = flag
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            let all = format!("{flag} {rest}")
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            HelpFlag {
                takes_value: flag[long.len()..].trim_start().starts_with('<'),
                default: between(&all, "[default: ", "]"),
                possible: between(&all, "[possible values: ", "]")
                    .and_then(|p| p.split(", ").next().map(str::to_string)),
                long,
            }
        })
        .collect();
    flags.retain(|f| !["help", "version", "config", "print-config"].contains(&f.long.as_str()));
    assert!(
        flags.len() > 5,
        "no flags read from the help of {role}:\n{help}"
    );
    flags
}

fn between(line: &str, start: &str, end: &str) -> Option<String> {
    let from = line.find(start)? + start.len();
    let len = line[from..].find(end)?;
    Some(line[from..from + len].to_string())
}

/// A TOML value the flag accepts: `true` for a switch, its default (an integer one plus one, to
/// differ from it), its first possible value, or the first of a few candidates that
/// `--print-config` accepts alone.
fn value_for(dir: &Path, role: &str, flag: &HelpFlag) -> String {
    if !flag.takes_value {
        return "true".into();
    }
    if let Some(default) = &flag.default {
        return match default.parse::<u64>() {
            Ok(n) => (n + 1).to_string(),
            Err(_) => toml::Value::String(default.clone()).to_string(),
        };
    }
    if let Some(p) = &flag.possible {
        return toml::Value::String(p.clone()).to_string();
    }
    let key = flag.long.replace('-', "_");
    for candidate in ["\"/srv/x\"", "\"127.0.0.1:9\"", "\"500m\"", "7", "\"x=y\""] {
        let file = dir.join("probe.toml");
        std::fs::write(&file, format!("{key} = {candidate}\n")).unwrap();
        let out = toolsrv(
            dir,
            &[role, "--print-config", "--config", file.to_str().unwrap()],
            &[],
        );
        if out.status.success() {
            return candidate.into();
        }
    }
    panic!("{role}: no candidate value is accepted for `{key}`")
}

#[test]
fn every_flag_of_each_role_is_settable_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    for role in ROLES {
        let flags = help_flags(dir.path(), role);
        let mut file = String::new();
        let mut wanted = BTreeMap::new();
        for flag in &flags {
            let key = flag.long.replace('-', "_");
            let value = value_for(dir.path(), role, flag);
            file.push_str(&format!("{key} = {value}\n"));
            wanted.insert(key, value);
        }
        let path = dir.path().join(format!("{role}.toml"));
        std::fs::write(&path, &file).unwrap();
        let printed = print_config(dir.path(), role, &["--config", path.to_str().unwrap()], &[]);
        let got = entries(&printed);
        for (key, value) in &wanted {
            let Some((printed_value, source)) = got.get(key) else {
                // A secret (`--join TOKEN`) is said to be set, never printed.
                let hidden = format!("# {key}: set, not shown  # file");
                if printed.lines().any(|l| l == hidden) {
                    continue;
                }
                panic!("{role}: `{key}` is not printed:\n{printed}");
            };
            assert_eq!(source, "file", "{role}: `{key}`:\n{printed}");
            // Repeatable flags print as arrays; a file may give one value.
            let want = toml::from_str::<toml::Table>(&format!("v = {value}")).unwrap();
            let have = toml::from_str::<toml::Table>(&format!("v = {printed_value}")).unwrap();
            let as_list = |v: &toml::Value| match v {
                toml::Value::Array(a) => a.clone(),
                other => vec![other.clone()],
            };
            assert_eq!(
                as_list(&want["v"]),
                as_list(&have["v"]),
                "{role}: `{key}` set to {value}:\n{printed}"
            );
        }
        let secrets = wanted.keys().filter(|k| !got.contains_key(*k)).count();
        assert_eq!(
            got.len() + secrets,
            wanted.len(),
            "{role}: --print-config prints exactly the flags of --help:\n{printed}"
        );
    }
}

#[test]
fn a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.toml");
    std::fs::write(&file, "keepalive_ms = 11\n").unwrap();
    let config = ["--config", file.to_str().unwrap()];
    // Command line, environment, then the value and where it came from.
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: [Case; 4] = [
        (
            &[&config[..], &["--keepalive-ms", "13"]].concat(),
            &[("TOOLSRV_KEEPALIVE_MS", "12")],
            "13",
            "flag",
        ),
        (
            &config,
            &[("TOOLSRV_KEEPALIVE_MS", "12")],
            "12",
            "env TOOLSRV_KEEPALIVE_MS",
        ),
        (&config, &[], "11", "file"),
        (&[], &[], "1000", "default"),
    ];
    for (args, env, value, source) in cases {
        let printed = print_config(dir.path(), "coordinator", args, env);
        let got = entries(&printed);
        assert_eq!(
            got["keepalive_ms"],
            (value.to_string(), source.to_string()),
            "{args:?} {env:?}:\n{printed}"
        );
    }
    // The global log flags, and a repeatable flag, whose environment variable replaces the
    // file's list rather than adding to it.
    let agent_file = dir.path().join("a.toml");
    std::fs::write(
        &agent_file,
        "log_level = \"debug\"\nsandbox_env = [\"A\", \"B\"]\n",
    )
    .unwrap();
    let agent_config = ["--config", agent_file.to_str().unwrap()];
    let printed = print_config(
        dir.path(),
        "agent",
        &agent_config,
        &[("TOOLSRV_SANDBOX_ENV", "C,D"), ("TOOLSRV_LOG", "warn")],
    );
    let got = entries(&printed);
    let entry = |k: &str| (got[k].0.as_str(), got[k].1.as_str());
    assert_eq!(
        entry("sandbox_env"),
        ("[\"C\", \"D\"]", "env TOOLSRV_SANDBOX_ENV")
    );
    assert_eq!(entry("log_level"), ("\"warn\"", "env TOOLSRV_LOG"));
    let printed = print_config(dir.path(), "agent", &agent_config, &[]);
    let got = entries(&printed);
    assert_eq!(got["sandbox_env"], ("[\"A\", \"B\"]".into(), "file".into()));
    assert_eq!(got["log_level"], ("\"debug\"".into(), "file".into()));
    // TOOLSRV_CONFIG names the file as --config does.
    let printed = print_config(
        dir.path(),
        "coordinator",
        &[],
        &[("TOOLSRV_CONFIG", file.to_str().unwrap())],
    );
    assert_eq!(
        entries(&printed)["keepalive_ms"],
        ("11".into(), "file".into())
    );
}

/// Runs `toolsrv coordinator` with `file` and every flag it needs to start, expecting the file
/// to be refused: exit 2, nothing logged, nothing listening; returns stderr.
fn refused(dir: &Path, file: &str) -> String {
    let path = dir.join("bad.toml");
    std::fs::write(&path, file).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let out = toolsrv(
        dir,
        &[
            "coordinator",
            "--config",
            path.to_str().unwrap(),
            "--listen",
            &listen,
            "--tools",
            "/nonexistent",
            "--ca",
            "ca.pem",
            "--cert",
            "c.pem",
            "--key",
            "k.pem",
        ],
        &[],
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        !err.contains("starting") && !err.contains("INFO"),
        "something started: {err}"
    );
    assert!(
        std::net::TcpListener::bind(&listen).is_ok(),
        "{listen} was taken"
    );
    err
}

#[test]
fn a_bad_file_is_refused_naming_the_file_the_line_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    let f = file.display();
    let err = refused(dir.path(), "rescan_secs = 5\nlisen = \"127.0.0.1:1\"\n");
    assert!(
        err.contains(&format!(
            "{f}:2: unknown key `lisen`; did you mean `listen`?"
        )),
        "{err}"
    );
    let err = refused(dir.path(), "health_listen = [\"127.0.0.1:1\"]\n");
    assert!(
        err.contains(&format!("{f}:1: `health_listen`: takes one value")),
        "{err}"
    );
    let err = refused(dir.path(), "[policy]\nfile = \"p.json\"\n");
    assert!(
        err.contains(&format!("{f}:1: `policy`: takes one value")),
        "{err}"
    );
    let err = refused(dir.path(), "max_fanout_hosts = \"many\"\n");
    assert!(
        err.contains(&format!("{f}:1: `max_fanout_hosts`: invalid value 'many'")),
        "{err}"
    );
    // A bad value is refused even when a flag overrides its key: the file is wrong.
    let err = refused(dir.path(), "listen = \"nowhere\"\n");
    assert!(
        err.contains(&format!("{f}:1: `listen`: invalid value")),
        "{err}"
    );
    let err = refused(dir.path(), "listen = \n");
    assert!(
        err.contains(&format!("{f}: TOML parse error at line 1")),
        "{err}"
    );
    // An empty file is fine.
    std::fs::write(&file, "").unwrap();
    print_config(
        dir.path(),
        "coordinator",
        &["--config", file.to_str().unwrap()],
        &[],
    );
    // A missing file.
    let out = toolsrv(dir.path(), &["agent", "--config", "missing.toml"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("cannot read the configuration file missing.toml"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn relative_paths_in_the_file_are_the_files_directory() {
    let work = tempfile::tempdir().unwrap();
    let etc = work.path().join("etc");
    let elsewhere = work.path().join("elsewhere");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::write(
        etc.join("agent.toml"),
        "ca = \"pki/ca.pem\"\nkey = \"/abs/key.pem\"\nstate_dir = \"state\"\n\
         tools = \"tools:/opt/tools\"\nsandbox_read = [\"data\", \"/usr\"]\nhost_id = \"rel\"\n",
    )
    .unwrap();
    // Run from another directory, naming the file relatively: the file's directory counts.
    let printed = print_config(
        &elsewhere,
        "agent",
        &["--config", "../etc/agent.toml", "--cert", "mine.pem"],
        &[],
    );
    let got = entries(&printed);
    let etc = std::fs::canonicalize(&etc).unwrap().display().to_string();
    let value = |k: &str| got[k].0.clone();
    assert_eq!(value("ca"), format!("\"{etc}/pki/ca.pem\""), "{printed}");
    assert_eq!(value("key"), "\"/abs/key.pem\"");
    assert_eq!(value("state_dir"), format!("\"{etc}/state\""));
    assert_eq!(value("tools"), format!("\"{etc}/tools:/opt/tools\""));
    assert_eq!(value("sandbox_read"), format!("[\"{etc}/data\", \"/usr\"]"));
    assert_eq!(value("host_id"), "\"rel\"", "not a path");
    // A relative flag is the working directory's, printed absolute.
    assert_eq!(
        value("cert"),
        format!(
            "\"{}/mine.pem\"",
            std::fs::canonicalize(&elsewhere).unwrap().display()
        )
    );
}

#[test]
fn a_printed_configuration_reads_back_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let files = [
        (
            "coordinator",
            "listen = \"127.0.0.1:7000\"\ntools = \"a:b\"\nca = \"ca.pem\"\npolicy = \"p.json\"\n\
             max_calls_per_client = 3\nlog_format = \"json\"\n",
        ),
        (
            "agent",
            "coordinator = \"https://c:7443\"\nlabel = [\"role=web\", \"zone=a\"]\n\
             sandbox = \"off\"\nsandbox_cpu = 0.5\nsandbox_write = [\"w\"]\n",
        ),
    ];
    for (role, content) in files {
        let first = dir.path().join(format!("{role}.toml"));
        std::fs::write(&first, content).unwrap();
        let printed = print_config(
            dir.path(),
            role,
            &["--config", first.to_str().unwrap(), "--key", "k.pem"],
            &[("TOOLSRV_RECHECK_SECS", "9"), ("TOOLSRV_RESCAN_SECS", "9")],
        );
        let second = dir.path().join("sub").join(format!("{role}.toml"));
        std::fs::create_dir_all(second.parent().unwrap()).unwrap();
        std::fs::write(&second, &printed).unwrap();
        let again = print_config(
            dir.path(),
            role,
            &["--config", second.to_str().unwrap()],
            &[],
        );
        let values = |p: &str| -> BTreeMap<String, String> {
            entries(p).into_iter().map(|(k, (v, _))| (k, v)).collect()
        };
        assert_eq!(values(&printed), values(&again), "{printed}\n---\n{again}");
        assert!(
            entries(&again).values().all(|(_, source)| source == "file"),
            "{again}"
        );
        // The unset flags stay unset.
        let unset = |p: &str| -> Vec<String> {
            p.lines()
                .filter(|l| l.ends_with(": not set"))
                .map(String::from)
                .collect()
        };
        assert_eq!(unset(&printed), unset(&again));
    }
}

#[test]
fn print_config_says_what_would_stop_the_role() {
    let dir = tempfile::tempdir().unwrap();
    let out = toolsrv(dir.path(), &["coordinator", "--print-config"], &[]);
    assert!(out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("would not start") && err.contains("--tools"),
        "{err}"
    );
    assert!(text(&out.stdout).contains("# tools: not set"));
}
