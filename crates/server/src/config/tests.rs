//! The configuration file against made-up commands: keys, types, paths, defaults, printing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::{Path, PathBuf};

use clap::{Arg, ArgAction, Command, value_parser};

use super::file::parse;
use super::*;

/// A role with one flag of each kind, a global log flag and `--config`/`--print-config`.
fn command() -> Command {
    Command::new("toolsrv")
        .arg(
            Arg::new("log_level")
                .long("log-level")
                .global(true)
                .default_value("info"),
        )
        .subcommand(
            ConfigArgs::augment_args(Command::new("role"))
                .arg(
                    Arg::new("listen")
                        .long("listen")
                        .value_parser(value_parser!(std::net::SocketAddr))
                        .default_value("0.0.0.0:1"),
                )
                .arg(
                    Arg::new("keepalive_ms")
                        .long("keepalive-ms")
                        .value_parser(value_parser!(u64))
                        .default_value("1000"),
                )
                .arg(
                    Arg::new("labels")
                        .long("label")
                        .action(ArgAction::Append)
                        .value_delimiter(','),
                )
                .arg(
                    Arg::new("ca")
                        .long("ca")
                        .value_parser(value_parser!(PathBuf)),
                )
                .arg(
                    Arg::new("tools")
                        .long("tools")
                        .value_name("PATH")
                        .value_parser(value_parser!(std::ffi::OsString)),
                )
                .arg(Arg::new("quiet").long("quiet").action(ArgAction::SetTrue))
                .arg(Arg::new("enroll_token").long("enroll-token")),
        )
}

fn role_settings() -> Vec<Setting> {
    let root = command();
    let sub = root.find_subcommand("role").unwrap().clone();
    settings(&root, &sub)
}

fn read(text: &str) -> Result<file::FileSettings, Vec<String>> {
    parse(
        Path::new("/etc/t/role.toml"),
        Path::new("/etc/t"),
        text,
        &role_settings(),
    )
}

#[test]
fn every_long_flag_is_a_key_but_config_and_print_config() {
    let keys: Vec<String> = role_settings().into_iter().map(|s| s.key).collect();
    assert_eq!(
        keys,
        [
            "listen",
            "keepalive_ms",
            "label",
            "ca",
            "tools",
            "quiet",
            "enroll_token",
            "log_level"
        ]
    );
}

#[test]
fn values_of_each_kind() {
    let file = read(
        "listen = \"127.0.0.1:5\"\nkeepalive_ms = 0x10\nlabel = [\"a=1\", \"b=2\"]\n\
         quiet = true\nlog_level = \"debug\"\n",
    )
    .unwrap();
    let raw = |k: &str| file.values[k].raw.clone();
    assert_eq!(raw("listen"), ["127.0.0.1:5"]);
    assert_eq!(raw("keepalive_ms"), ["16"]);
    assert_eq!(raw("label"), ["a=1", "b=2"]);
    assert_eq!(raw("quiet"), ["true"]);
    assert_eq!(raw("log_level"), ["debug"]);
    // One string for a list, and a number as a string.
    let file = read("label = \"a=1\"\nkeepalive_ms = \"7\"\n").unwrap();
    assert_eq!(file.values["label"].raw, ["a=1"]);
    assert_eq!(file.values["keepalive_ms"].raw, ["7"]);
}

#[test]
fn problems_name_the_file_the_line_and_the_key() {
    let cases = [
        (
            "\n\nlistn = \"x\"\n",
            "/etc/t/role.toml:3: unknown key `listn`; did you mean `listen`?",
        ),
        (
            "keepalive-ms = 5\n",
            "/etc/t/role.toml:1: unknown key `keepalive-ms`; did you mean `keepalive_ms`?",
        ),
        (
            "listen = [\"127.0.0.1:5\"]\n",
            "/etc/t/role.toml:1: `listen`: takes one value (a string or a number), not an array",
        ),
        (
            "[label]\nx = 1\n",
            "/etc/t/role.toml:1: `label`: takes an array of strings (or one string), not a table",
        ),
        (
            "quiet = \"yes\"\n",
            "/etc/t/role.toml:1: `quiet`: takes true or false, not a string",
        ),
        (
            "listen = \"nowhere\"\n",
            "/etc/t/role.toml:1: `listen`: invalid value 'nowhere' for '--listen <listen>'",
        ),
        (
            "keepalive_ms = -1\n",
            "/etc/t/role.toml:1: `keepalive_ms`: invalid value '-1'",
        ),
        (
            "config = \"other.toml\"\n",
            "/etc/t/role.toml:1: unknown key `config` (a configuration file cannot name another)",
        ),
    ];
    for (text, want) in cases {
        let problems = read(text).unwrap_err();
        assert!(
            problems.len() == 1 && problems[0].starts_with(want),
            "{text:?}: want {want:?}, got {problems:?}"
        );
    }
    // Every problem at once, in the order of the file.
    let problems = read("b = 1\nlisten = []\na = 2\n").unwrap_err();
    assert_eq!(problems.len(), 3, "{problems:?}");
    assert!(problems[0].contains(":1: unknown key `b`"));
    assert!(problems[2].contains(":3: unknown key `a`"));
    // A file that is not TOML says where.
    let problems = read("listen = \n").unwrap_err();
    assert!(
        problems[0].starts_with("/etc/t/role.toml: TOML parse error at line 1"),
        "{problems:?}"
    );
    // The line it quotes reaches the terminal escaped, its line breaks kept.
    let problems = read("listen = \"x\u{1b}[31mred\n").unwrap_err();
    assert!(
        problems[0].contains("listen = \"x\\u{1b}[31mred"),
        "{problems:?}"
    );
    assert!(!problems[0].contains('\u{1b}'), "{problems:?}");
    assert!(problems[0].contains("\n  |"), "{problems:?}");
    let problems = read("listen = 1\nfoo\r = 2").unwrap_err();
    assert!(problems[0].contains("foo\\r = 2"), "{problems:?}");
}

#[test]
fn relative_paths_are_the_files_directory() {
    let file =
        read("ca = \"pki/ca.pem\"\ntools = \"tools:/abs:../more\"\nlabel = \"x=y\"\n").unwrap();
    assert_eq!(file.values["ca"].raw, ["/etc/t/pki/ca.pem"]);
    assert_eq!(
        file.values["tools"].raw,
        ["/etc/t/tools:/abs:/etc/t/../more"]
    );
    assert_eq!(file.values["label"].raw, ["x=y"], "not a path");
    let file = read("ca = \"/abs/ca.pem\"\n").unwrap();
    assert_eq!(file.values["ca"].raw, ["/abs/ca.pem"]);
}

fn parse_with(text: &str, argv: &[&str]) -> (Vec<Setting>, ArgMatches, file::FileSettings) {
    let file = read(text).unwrap();
    let root = command();
    let settings = role_settings();
    let root = with_defaults(root, "role", &settings, &file);
    let matches = root
        .try_get_matches_from(std::iter::once("toolsrv").chain(argv.iter().copied()))
        .unwrap();
    let sub = matches.subcommand_matches("role").unwrap().clone();
    (settings, sub, file)
}

#[test]
fn the_file_gives_defaults_that_flags_override() {
    let (settings, m, file) = parse_with(
        "listen = \"127.0.0.1:5\"\nlabel = [\"a=1\"]\nlog_level = \"debug\"\nquiet = true\n",
        &["role", "--listen", "127.0.0.1:6", "--log-level", "warn"],
    );
    let get = |id: &str| m.get_raw(id).unwrap().next().unwrap().to_owned();
    assert_eq!(get("listen"), "127.0.0.1:6");
    assert_eq!(get("log_level"), "warn");
    assert_eq!(get("labels"), "a=1");
    assert!(m.get_flag("quiet"));
    let source_of = |key: &str| {
        let s = settings.iter().find(|s| s.key == key).unwrap();
        source(&m, s, file.values.contains_key(key))
    };
    assert_eq!(source_of("listen"), print::Source::Flag);
    assert_eq!(source_of("log_level"), print::Source::Flag);
    assert_eq!(source_of("label"), print::Source::File);
    assert_eq!(source_of("keepalive_ms"), print::Source::Default);
    assert_eq!(source_of("ca"), print::Source::Unset);
    // A flag given on the command line replaces the file's list, it does not add to it.
    let (_, m, _) = parse_with("label = [\"a=1\", \"b=2\"]\n", &["role", "--label", "c=3"]);
    let labels: Vec<_> = m.get_raw("labels").unwrap().collect();
    assert_eq!(labels, ["c=3"]);
}

#[test]
fn a_value_that_is_not_utf8_is_not_printed_as_something_else() {
    use std::os::unix::ffi::OsStringExt;
    let settings = role_settings();
    let odd = std::ffi::OsString::from_vec(b"/srv/tools-\xff".to_vec());
    let matches = command()
        .try_get_matches_from([
            "toolsrv".into(),
            "role".into(),
            "--tools".into(),
            odd,
            "--ca".into(),
            "/etc/ca.pem".into(),
        ])
        .unwrap();
    let m = matches.subcommand_matches("role").unwrap();
    let text = print::render("toolsrv role", &settings, m, None);
    assert!(
        text.lines().any(|l| l
            == "# tools: not UTF-8, which a TOML file cannot hold: give it as the flag or its \
                environment variable (\"/srv/tools-\\xFF\")  # flag"),
        "{text}"
    );
    assert!(!text.contains('\u{FFFD}'), "{text}");
    assert!(
        text.lines().any(|l| l == "ca = \"/etc/ca.pem\"  # flag"),
        "{text}"
    );
    // What is printed reads back, without the value that could not be written.
    let again = read(&text).unwrap();
    assert!(!again.values.contains_key("tools"));
}

#[test]
fn printed_configuration_reads_back_and_hides_secrets() {
    let (settings, m, file) = parse_with(
        "listen = \"127.0.0.1:5\"\nlabel = [\"a=1\", \"b=2\"]\nca = \"ca.pem\"\n\
         enroll_token = \"s3cret\"\nquiet = true\n",
        &["role", "--keepalive-ms", "5"],
    );
    let text = print::render("toolsrv role", &settings, &m, Some(&file));
    assert!(!text.contains("s3cret"), "{text}");
    for line in [
        "# file: /etc/t/role.toml",
        "listen = \"127.0.0.1:5\"  # file",
        "keepalive_ms = 5  # flag",
        "label = [\"a=1\", \"b=2\"]  # file",
        "ca = \"/etc/t/ca.pem\"  # file",
        "quiet = true  # file",
        "# tools: not set",
        "# enroll_token: set, not shown  # file",
        "log_level = \"info\"  # default",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line:?} missing from:\n{text}"
        );
    }
    let again = read(&text).unwrap();
    assert_eq!(again.values["keepalive_ms"].raw, ["5"]);
    assert_eq!(again.values["label"].raw, ["a=1", "b=2"]);
    assert_eq!(again.values["ca"].raw, ["/etc/t/ca.pem"]);
    assert!(!again.values.contains_key("enroll_token"));
}
