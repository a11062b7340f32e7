//! `toolctl local` and `toolctl lint` as a user runs them: a real binary on real tool directories.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::{Value, json};
use toolsrv_testkit::{
    assert_exit, must, text, try_run_bounded, write, write_executable as executable,
};

fn toolctl() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_toolctl"));
    cmd.env_remove("OLLIE_TOOLS_PATH");
    cmd
}

/// Runs `toolctl` with a bounded wait.
fn run(cmd: &mut Command) -> Output {
    must(try_run_bounded(cmd, None, Duration::from_secs(30)))
}

fn stdout(o: &Output) -> String {
    text(&o.stdout)
}

fn stderr(o: &Output) -> String {
    text(&o.stderr)
}

/// A tools directory with one tool of each kind.
fn fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(
        d,
        "echo.meta",
        r#"{"description": "Echo the call", "cmd": "cat; printf '\\n%s\\n%s\\n' \"$OLLIE_TOOLS_PATH\" \"$PWD\"; pwd; echo to-stderr >&2",
        "args": {"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": false}}"#,
    );
    write(
        d,
        "structured.meta",
        r#"{"description": "Structured", "cmd": "echo '{\"content\":[{\"type\":\"text\",\"text\":\"hi\"}],\"extra\":1}'"}"#,
    );
    write(
        d,
        "fail.meta",
        r#"{"description": "Fails", "cmd": "echo broken >&2; exit 3"}"#,
    );
    write(
        d,
        "slow.meta",
        r#"{"description": "Sleeps", "cmd": "sleep 30"}"#,
    );
    write(
        d,
        "beside.meta",
        r#"{"description": "Co-located", "cmd": "echo from-cmd"}"#,
    );
    executable(d, "beside", "#!/bin/sh\necho from-executable\n");
    write(
        d,
        "logs.meta",
        r#"{"description": "Logs", "variants": [
        {"match": {"os": "darwin"}, "description": "macOS logs", "cmd": "echo mac"},
        {"match": {"os": "linux"}, "cmd": "echo linux"}]}"#,
    );
    write(
        d,
        "gpu.meta",
        r#"{"description": "GPU", "variants": [{"match": {"binary": "definitely-not-installed-gpu-tool"}}]}"#,
    );
    write(d, "broken.meta", "{ not json");
    dir
}

fn tools_arg(dir: &tempfile::TempDir) -> String {
    dir.path().display().to_string()
}

#[test]
fn list_shows_visible_tools_and_all_adds_hidden_ones_with_reasons() {
    let dir = fixture();
    let out = run(toolctl().args(["local", "list", "--tools", &tools_arg(&dir), "--json"]));
    assert!(out.status.success(), "{}", stderr(&out));
    let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = list.iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["beside", "echo", "fail", "logs", "slow", "structured"]
    );
    let logs = &list[3];
    assert_eq!(
        (logs["visible"].clone(), logs["variant"].clone()),
        (json!(true), json!(1))
    );
    assert_eq!(list[1]["variant"], Value::Null);
    assert_eq!(
        list[1]["reason"],
        Value::Null,
        "`reason` is always there, null when visible: {}",
        list[1]
    );
    assert!(
        stderr(&out).contains("broken.meta"),
        "a rejected file is reported: {}",
        stderr(&out)
    );

    let out = run(toolctl().args([
        "local",
        "list",
        "--tools",
        &tools_arg(&dir),
        "--all",
        "--json",
    ]));
    let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let gpu = list.iter().find(|e| e["name"] == "gpu").unwrap();
    assert_eq!(gpu["visible"], json!(false));
    assert!(
        gpu["reason"]
            .as_str()
            .unwrap()
            .contains("definitely-not-installed-gpu-tool"),
        "{gpu}"
    );
    assert_eq!(gpu["description"], json!("GPU"));
    // An invalid file is listed hidden with what is wrong with it, file and all.
    let broken = list.iter().find(|e| e["name"] == "broken").unwrap();
    assert_eq!(broken["visible"], json!(false));
    let reason = broken["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("invalid: ")
            && reason.contains("broken.meta")
            && reason.contains("not valid JSON"),
        "{broken}"
    );

    let out = run(toolctl().args(["local", "list", "--tools", &tools_arg(&dir), "--all"]));
    assert!(
        stdout(&out)
            .lines()
            .any(|l| l.starts_with("gpu") && l.contains("(hidden)")),
        "{}",
        stdout(&out)
    );
}

#[test]
fn as_evaluates_another_hosts_os_and_arch() {
    let dir = fixture();
    let out = run(toolctl().args([
        "local",
        "list",
        "--tools",
        &tools_arg(&dir),
        "--json",
        "--as",
        "os=darwin,arch=arm64",
    ]));
    let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let logs = list.iter().find(|e| e["name"] == "logs").unwrap();
    assert_eq!(
        (logs["variant"].clone(), logs["description"].clone()),
        (json!(0), json!("macOS logs"))
    );
    let out = run(toolctl().args([
        "local",
        "list",
        "--tools",
        &tools_arg(&dir),
        "--as",
        "kernel=6",
    ]));
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    let out = run(toolctl().args([
        "local",
        "describe",
        "--tools",
        &tools_arg(&dir),
        "logs",
        "--as",
        "os=windows",
    ]));
    assert_exit(&out, 69, &[]);
    assert!(
        stderr(&out).contains("os is `windows`, not `darwin`"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn describe_prints_the_resolved_model_facing_definition() {
    let dir = fixture();
    let out = run(toolctl()
        .args(["local", "describe", "--tools", &tools_arg(&dir), "echo"])
        .env("OLLIE_TOOLS_PATH", "/nonexistent"));
    assert!(out.status.success(), "{}", stderr(&out));
    let def: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(def["name"], "echo");
    assert_eq!(def["description"], "Echo the call");
    assert_eq!(def["args"]["properties"]["n"]["type"], "integer");
    assert!(def.get("cmd").is_none(), "cmd is not model-facing: {def}");
    // The tools path also comes from OLLIE_TOOLS_PATH.
    let out = run(toolctl()
        .args(["local", "describe", "structured"])
        .env("OLLIE_TOOLS_PATH", tools_arg(&dir)));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["args"],
        json!({"type": "object"})
    );
}

#[test]
fn call_passes_arguments_on_stdin_with_env_and_cwd() {
    let dir = fixture();
    let cwd = tempfile::tempdir().unwrap();
    let cwd_path = cwd.path().canonicalize().unwrap();
    let out = run(toolctl()
        .args([
            "local",
            "call",
            "--tools",
            &tools_arg(&dir),
            "echo",
            r#"{"n": 7}"#,
            "--cwd",
        ])
        .arg(&cwd_path)
        .env("OLLIE_TOOLS_PATH", "/should/be/replaced"));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], r#"{"n":7}"#);
    assert_eq!(lines[1], "", "stdin ends with a newline then EOF");
    assert_eq!(
        Path::new(lines[2]),
        dir.path(),
        "OLLIE_TOOLS_PATH is the tool's directory"
    );
    assert_eq!(Path::new(lines[3]), cwd_path, "PWD is the call's directory");
    assert_eq!(Path::new(lines[4]), cwd_path, "and so is the cwd");
    assert_eq!(stderr(&out), "to-stderr\n");
}

/// Bytes that are not UTF-8 in the environment (a value, a name): `local` lists and calls as
/// usual, and the variable passes to the tool as it is (it panicked in `std::env::vars`).
#[test]
fn an_environment_that_is_not_utf8_is_no_panic() {
    use std::ffi::OsString;
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let dir = fixture();
    write(
        dir.path(),
        "odd.meta",
        r#"{"description": "Odd", "variants": [{"match": {"env": "ODD_VALUE"}, "cmd": "printf '%s' \"$ODD_VALUE\" | od -An -tx1"}]}"#,
    );
    let odd = |cmd: &mut Command| {
        cmd.env("ODD_VALUE", OsString::from_vec(b"caf\xe9".to_vec()))
            .env(OsString::from_vec(b"NAME_\xff".to_vec()), "x");
    };
    let mut list = toolctl();
    list.args(["local", "list", "--tools", &tools_arg(&dir)]);
    odd(&mut list);
    let out = run(&mut list);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("odd"), "{}", stdout(&out));
    let mut call = toolctl();
    call.args(["local", "call", "--tools", &tools_arg(&dir), "odd"]);
    odd(&mut call);
    let out = run(&mut call);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "63 61 66 e9");

    // A directory of PATH whose name is not UTF-8: `binary` finds what is in it, and so does
    // a tool without `cmd` (it runs the program of its name); it was looked for under a name
    // with U+FFFD in place of the byte.
    let bin = dir.path().join(std::ffi::OsStr::from_bytes(b"bin-\xff"));
    std::fs::create_dir(&bin).unwrap();
    executable(&bin, "oddtool", "#!/bin/sh\necho odd tool ran\n");
    write(
        dir.path(),
        "oddtool.meta",
        r#"{"description": "Odd", "variants": [{"match": {"binary": "oddtool"}}]}"#,
    );
    let mut path = bin.into_os_string();
    path.push(":/usr/bin:/bin");
    let out = run(toolctl()
        .args(["local", "call", "--tools", &tools_arg(&dir), "oddtool"])
        .env("PATH", &path));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "odd tool ran");
}

/// The tool reads its arguments as the caller wrote them, on one line: an integer beyond 64
/// bits, a number's trailing zero and an escape arrive as typed (written again from a parsed
/// value they became `1.2345678901234568e+22`, `1.1` and `é`).
#[test]
fn a_tool_reads_its_arguments_as_written() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "echo.meta",
        r#"{"description": "Its input", "cmd": "cat"}"#,
    );
    let tools = dir.path().display().to_string();
    let whole = "{\"n\": 12345678901234567890123,\n \"f\": 1.10, \"s\": \"caf\\u00e9\"}";
    let out = run(toolctl().args(["local", "call", "--tools", &tools, "echo", whole]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "{\"n\":12345678901234567890123,\"f\":1.10,\"s\":\"caf\\u00e9\"}\n"
    );
    let out = run(toolctl().args([
        "local",
        "call",
        "--tools",
        &tools,
        "echo",
        "n:=12345678901234567890123",
        "s=a b",
    ]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "{\"n\":12345678901234567890123,\"s\":\"a b\"}\n"
    );
}

/// A tools directory whose name is not UTF-8, given with `--tools`, in `OLLIE_TOOLS_PATH` or to
/// `lint`: read like any other (clap refused it: "invalid UTF-8 was detected").
#[test]
fn a_tools_directory_whose_name_is_not_utf8_is_read() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let tools = dir.path().join(std::ffi::OsStr::from_bytes(b"tools-\xff"));
    std::fs::create_dir(&tools).unwrap();
    write(
        &tools,
        "hi.meta",
        r#"{"description": "Says hi", "cmd": "echo hi"}"#,
    );
    let out = run(toolctl()
        .args(["local", "call", "--tools"])
        .arg(&tools)
        .arg("hi"));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), "hi\n");
    let out = run(toolctl()
        .args(["local", "list"])
        .env("OLLIE_TOOLS_PATH", &tools));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("hi"), "{}", stdout(&out));
    let out = run(toolctl().arg("lint").arg(&tools));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    write(&tools, "bad.meta", r#"{"description": "#);
    let out = run(toolctl().arg("lint").arg(&tools));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("bad.meta: error: not valid JSON"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn call_reads_arguments_from_stdin_with_a_dash() {
    let dir = fixture();
    let mut cmd = toolctl();
    cmd.args(["local", "call", "--tools", &tools_arg(&dir), "echo", "-"]);
    let out = must(try_run_bounded(
        &mut cmd,
        Some(r#"{"n": 42}"#),
        Duration::from_secs(30),
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with(r#"{"n":42}"#), "{}", stdout(&out));
}

#[test]
fn call_takes_key_value_words_and_says_how_to_pass_a_number() {
    let dir = fixture();
    let t = tools_arg(&dir);
    let out = run(toolctl().args(["local", "call", "--tools", &t, "echo", "n:=7"]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with(r#"{"n":7}"#), "{}", stdout(&out));
    // A string where the tool wants a number: refused as before, with the way to write it.
    let out = run(toolctl().args(["local", "call", "--tools", &t, "echo", "n=7"]));
    assert_eq!(out.status.code(), Some(65), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("at /n: \"7\" is not of type \"integer\"")
            && stderr(&out).contains("note: `n=...` passes a string; write `n:=VALUE`"),
        "{}",
        stderr(&out)
    );
    // A name the tool does not take: no such note, since quoting would not help.
    let out = run(toolctl().args(["local", "call", "--tools", &t, "echo", "m=7"]));
    assert_eq!(out.status.code(), Some(65), "{}", stderr(&out));
    assert!(!stderr(&out).contains("note:"), "{}", stderr(&out));
    // Words that are neither: a usage error naming the word, nothing run.
    for (args, needle) in [
        (
            &["n:=seven"][..],
            "argument `n:=seven`: the value after `:=` is not JSON",
        ),
        (&["n:=1", "n:=2"], "argument `n` is given twice"),
        (&["n:=1", "{}"], "must be the only argument"),
        (
            &["seven"],
            "argument `seven` is neither a JSON object nor KEY=VALUE",
        ),
    ] {
        let out = run(toolctl()
            .args(["local", "call", "--tools", &t, "echo"])
            .args(args));
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
        assert!(stdout(&out).is_empty(), "{args:?}: nothing ran");
    }
}

#[test]
fn call_exit_codes() {
    let dir = fixture();
    let t = tools_arg(&dir);
    let cases: &[(&[&str], i32, &str)] = &[
        (&["fail"], 3, "broken"),
        (&["nope"], 127, "unknown tool `nope`"),
        (&["ech"], 127, "unknown tool `ech`; did you mean `echo`?"),
        // An invalid file is not an unknown tool: it is refused with what is wrong with it.
        (&["broken"], 69, "is hidden on this host: invalid: "),
        (&["gpu"], 69, "hidden on this host"),
        (&["echo", r#"{"n": "seven"}"#], 65, "at /n"),
        (&["echo", r#"{"m": 1}"#], 65, "at /"),
        (&["echo", "[1]"], 64, "JSON object"),
        (&["echo", "{oops"], 64, "not valid JSON"),
        (
            &["echo", r#"{"n": 1, "n": 2}"#],
            64,
            "the key \"n\" is given twice in one object",
        ),
        (&["slow", "--timeout", "0.3"], 124, "timed out"),
        (
            &["echo", "--timeout", "-1"],
            64,
            "--timeout -1: must be a positive number",
        ),
        // Too large or too small for a timeout is said so, the value shown short.
        (
            &["echo", "--timeout", "1e300"],
            64,
            "--timeout 1e300: over a year",
        ),
        (
            &["echo", "--timeout", "1e-300"],
            64,
            "--timeout 1e-300: under a millisecond",
        ),
    ];
    for (args, code, needle) in cases {
        let out = run(toolctl().args(["local", "call", "--tools", &t]).args(*args));
        assert_eq!(out.status.code(), Some(*code), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(needle),
            "{args:?}: {needle:?} not in {}",
            stderr(&out)
        );
    }
}

#[test]
fn call_with_result_prints_structured_or_wrapped_output() {
    let dir = fixture();
    let t = tools_arg(&dir);
    let out = run(toolctl().args(["local", "call", "--tools", &t, "structured", "--result"]));
    let result: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        result,
        json!({"content": [{"type": "text", "text": "hi"}], "extra": 1})
    );
    let out = run(toolctl().args(["local", "call", "--tools", &t, "fail", "--result"]));
    assert_exit(&out, 3, &[]);
    let result: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(result["isError"], json!(true));
    assert!(
        result["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("broken"),
        "{result}"
    );
}

#[test]
fn a_co_located_executable_wins_over_cmd() {
    let dir = fixture();
    let out = run(toolctl().args(["local", "call", "--tools", &tools_arg(&dir), "beside"]));
    assert_eq!(stdout(&out), "from-executable\n");
}

#[test]
fn lint_reports_every_problem_with_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "ok.meta", r#"{"description": "fine", "cmd": "true"}"#);
    write(d, "notjson.meta", "{");
    write(d, "types.meta", r#"{"description": 3, "keywords": "x"}"#);
    write(d, "tier.meta", r#"{"description": "d", "tier": "tepid"}"#);
    write(
        d,
        "schema.meta",
        r#"{"description": "d", "args": {"type": "objekt"}}"#,
    );
    write(
        d,
        "matchkey.meta",
        r#"{"description": "d", "cmd": "true", "variants": [{"match": {"distro": "debian"}}]}"#,
    );
    write(d, "lonely.meta", r#"{"description": "d"}"#);
    write(d, "plain.meta", r#"{"description": "d"}"#);
    write(d, "plain", "#!/bin/sh\n");
    let out = run(toolctl().arg("lint").arg(d));
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let text = stdout(&out);
    let expect = [
        ("notjson.meta: error:", "not valid JSON"),
        (
            "types.meta: error: field `description`:",
            "expected string, got number",
        ),
        (
            "types.meta: error: field `keywords`:",
            "expected array of strings",
        ),
        ("tier.meta: error: field `tier`:", "tepid"),
        (
            "schema.meta: error: field `args`:",
            "not a valid JSON Schema",
        ),
        (
            "matchkey.meta: error: field `variants[0].match.distro`:",
            "unknown match key",
        ),
        ("lonely.meta: warning:", "only where `lonely` is on PATH"),
        ("plain.meta: warning:", "is not executable"),
    ];
    for (prefix, needle) in expect {
        assert!(
            text.lines()
                .any(|l| l.contains(prefix) && l.contains(needle)),
            "no line with {prefix:?} and {needle:?} in\n{text}"
        );
    }
    assert!(!text.contains("ok.meta"), "{text}");

    let clean = tempfile::tempdir().unwrap();
    write(
        clean.path(),
        "ok.meta",
        r#"{"description": "fine", "cmd": "true"}"#,
    );
    let out = run(toolctl().arg("lint").arg(clean.path()));
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    // A single file works too, and --json gives one object per line.
    let out = run(toolctl().args(["lint", "--json"]).arg(d.join("tier.meta")));
    let first: Value = serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    assert_eq!(
        (first["field"].clone(), first["severity"].clone()),
        (json!("tier"), json!("error"))
    );
    let out = run(toolctl().arg("lint").arg(d.join("missing-dir")));
    assert_exit(&out, 1, &[]);
}

/// A FIFO named like a `.meta` (which a reader would wait on forever) and a link to a device:
/// `lint` of the directory and of the FIFO itself, and `local list --all`, each end at once
/// with an error naming the file and what it is.
#[test]
fn lint_and_list_name_a_fifo_or_a_device_where_a_meta_should_be() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "ok.meta", r#"{"description": "fine", "cmd": "true"}"#);
    let fifo = d.join("pipe.meta");
    toolsrv_testkit::mkfifo(&fifo);
    std::os::unix::fs::symlink("/dev/zero", d.join("zero.meta")).unwrap();
    // Links that lead nowhere: gone, and a loop. They were left out without a word.
    std::os::unix::fs::symlink(d.join("gone"), d.join("dangling.meta")).unwrap();
    std::os::unix::fs::symlink("loop.meta", d.join("loop.meta")).unwrap();
    let out = run(toolctl().arg("lint").arg(d));
    assert_exit(&out, 1, &["4 error(s)"]);
    let said = stdout(&out);
    assert!(
        said.contains("pipe.meta: error: cannot read: a FIFO, not a regular file")
            && said.contains("zero.meta: error: cannot read: a device")
            && said.contains("dangling.meta: error: cannot read: a link to ")
            && said.contains("gone, which does not exist")
            && said.contains("loop.meta: error: cannot read: Too many levels of symbolic links"),
        "{said}"
    );
    let out = run(toolctl().arg("lint").arg(&fifo));
    assert_exit(&out, 1, &["1 error(s)"]);
    assert!(stdout(&out).contains("pipe.meta: error: cannot read: a FIFO"));
    // A loop named on the command line is a file that cannot be read, not a directory.
    let out = run(toolctl().arg("lint").arg(d.join("loop.meta")));
    assert_exit(&out, 1, &["1 error(s)"]);
    assert!(stdout(&out).contains("loop.meta: error: cannot read: Too many levels"));
    let out = run(toolctl()
        .args(["local", "list", "--all", "--json", "--tools"])
        .arg(d));
    assert_exit(&out, 0, &[]);
    let listed: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = listed.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["dangling", "loop", "ok", "pipe", "zero"],
        "{listed:?}"
    );
}

/// A directory that does not exist is an error for `lint`, named relative or absolute.
#[test]
fn lint_of_a_missing_directory_is_an_error_however_it_is_named() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["missing", "./missing"] {
        let out = run(toolctl().current_dir(dir.path()).args(["lint", name]));
        assert_exit(&out, 1, &["1 error(s)"]);
        assert!(
            stdout(&out).contains("error: cannot read tools directory"),
            "{name}: {}",
            stdout(&out)
        );
    }
    let out = run(toolctl().arg("lint").arg(dir.path().join("missing")));
    assert_exit(&out, 1, &["1 error(s)"]);
}

#[test]
fn a_bad_command_line_exits_64_and_help_exits_0() {
    for args in [&["call", "--bogus"][..], &[][..]] {
        let out = run(toolctl().args(args));
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains("Usage"), "{args:?}: {}", stderr(&out));
    }
    // A setting that may come from the environment is not shown as needed by the usage line,
    // and its absence is explained with both ways to give it.
    let out = run(toolctl().args(["local", "list", "--help"]));
    assert!(
        stdout(&out).contains("Usage: toolctl local list [OPTIONS]\n"),
        "{}",
        stdout(&out)
    );
    let out = run(toolctl().args(["local", "list", "--all"]));
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--tools") && stderr(&out).contains("OLLIE_TOOLS_PATH"),
        "{}",
        stderr(&out)
    );
    for args in [&["--help"][..], &["call", "--help"][..], &["--version"][..]] {
        let out = run(toolctl().args(args));
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert!(!out.stdout.is_empty(), "{args:?}");
    }
}

/// `lint` and `local` read through the registry: an oversized `.meta` (and `x.meta.meta`) is
/// reported like any broken file, and the other tools still work.
#[test]
fn lint_and_local_report_an_oversized_meta_and_keep_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(
        d,
        "ok.meta",
        r#"{"description": "fine", "cmd": "echo fine"}"#,
    );
    let prompt = "p".repeat(5 << 20);
    write(
        d,
        "big.meta",
        &format!(r#"{{"description": "big", "cmd": "true", "prompt": "{prompt}"}}"#),
    );
    write(d, "x.meta.meta", r#"{"description": "x", "cmd": "true"}"#);
    let size = std::fs::metadata(d.join("big.meta")).unwrap().len();
    let limit = toolsrv_proto::limits::MAX_META_BYTES;

    for target in [d.to_path_buf(), d.join("big.meta")] {
        let out = run(toolctl().arg("lint").arg(&target));
        assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
        let text = stdout(&out);
        assert!(
            text.lines().any(|l| l.contains("big.meta: error:")
                && l.contains(&format!("{size} bytes"))
                && l.contains(&format!("limit of {limit} bytes"))),
            "{target:?}:\n{text}"
        );
    }
    let out = run(toolctl().arg("lint").arg(d.join("x.meta.meta")));
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stdout(&out).contains("ends in `.meta`"), "{}", stdout(&out));

    let tools = tools_arg(&dir);
    let out = run(toolctl().args(["local", "list", "--tools", &tools, "--json"]));
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["ok"], "{}", stderr(&out));
    assert!(
        stderr(&out).contains("big.meta") && stderr(&out).contains("limit of"),
        "{}",
        stderr(&out)
    );
    let out = run(toolctl().args(["local", "call", "--tools", &tools, "ok"]));
    assert_eq!(stdout(&out), "fine\n", "{}", stderr(&out));
}

/// Files named by another user of a shared tools directory: names holding an escape sequence,
/// a terminal title sequence or a line break are shown escaped, one line per problem, by
/// `lint`, `local list` (its listing and its warnings) and `local call`'s refusal.
#[test]
fn odd_file_names_are_shown_escaped_and_on_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(
        d,
        "good.meta",
        r#"{"description": "fine", "cmd": "echo fine"}"#,
    );
    write(
        d,
        "x\u{1b}[2Jy.meta",
        r#"{"description": "fine", "cmd": "true"}"#,
    );
    write(d, "bad\u{1b}]0;owned\u{7}.meta", r#"{"description": 5}"#);
    write(
        d,
        "two\nlines.meta",
        r#"{"description": "fine", "cmd": "true"}"#,
    );
    let tools = tools_arg(&dir);
    let clean = |shown: &str| {
        assert!(!shown.contains(['\u{1b}', '\u{7}']), "{shown:?}");
    };

    let out = run(toolctl().arg("lint").arg(d));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let lint = stdout(&out);
    clean(&lint);
    // Four problems (three bad names, one bad field), four lines.
    assert_eq!(lint.lines().count(), 4, "{lint}");
    assert!(lint.contains(r"x\u{1b}[2Jy.meta: error:"), "{lint}");
    assert!(lint.contains(r"two\nlines.meta: error:"), "{lint}");

    let out = run(toolctl().args(["local", "list", "--all", "--tools", &tools]));
    let listed = stdout(&out);
    clean(&listed);
    // Without --all the broken files are warned about on stderr instead.
    let warned = stderr(&run(toolctl().args(["local", "list", "--tools", &tools])));
    clean(&warned);
    assert_eq!(warned.lines().count(), 4, "{warned}");
    assert_eq!(listed.lines().count(), 4, "{listed}");
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with(r"bad\u{1b}]0;owned\u{7}  (hidden)")),
        "{listed}"
    );
    assert!(warned.contains(r"x\u{1b}[2Jy"), "{warned}");

    let out = run(toolctl().args(["local", "call", "--tools", &tools, "x\u{1b}[2Jy"]));
    assert_ne!(out.status.code(), Some(0));
    clean(&stderr(&out));
    assert!(stderr(&out).contains(r"x\u{1b}[2Jy"), "{}", stderr(&out));
}

/// A hidden tool's reason quotes its `.meta` (the file a variant needs), which whoever can
/// write to a shared tools directory wrote: `describe`, `call` and `list --all` show it escaped.
#[test]
fn a_hidden_tool_s_reason_cannot_write_to_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "x.meta",
        r#"{"description": "d", "cmd": "true",
            "variants": [{"match": {"file": "/nonexistent\u001b[2J\u001b]0;owned\u0007"}}]}"#,
    );
    let tools = tools_arg(&dir);
    for args in [
        &["local", "describe", "--tools", &tools, "x"][..],
        &["local", "call", "--tools", &tools, "x"],
        &["local", "list", "--all", "--tools", &tools],
    ] {
        let out = run(toolctl().args(args));
        let shown = format!("{}{}", stdout(&out), stderr(&out));
        assert!(!shown.contains(['\u{1b}', '\u{7}']), "{args:?}: {shown:?}");
        assert!(
            shown.contains(r"/nonexistent\u{1b}[2J\u{1b}]0;owned\u{7}"),
            "{args:?}: {shown}"
        );
    }
}

/// What bash completes after `words` (the last one being typed) through the script
/// `TOOLCTL_COMPLETE=bash toolctl` prints, options left out.
fn bash_completes(words: &[&str], env: &[(&str, &str)]) -> Vec<String> {
    let toolctl = env!("CARGO_BIN_EXE_toolctl");
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let script = format!(
        "source <(TOOLCTL_COMPLETE=bash '{toolctl}')\n\
         COMP_WORDS=('{toolctl}' {})\nCOMP_CWORD={}\nCOMP_TYPE=9\n\
         _clap_complete_toolctl toolctl \"${{COMP_WORDS[COMP_CWORD]}}\" x\n\
         printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        quoted.join(" "),
        words.len()
    );
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(script)
        .env_remove("OLLIE_TOOLS_PATH")
        .envs(env.iter().copied());
    candidates(run(&mut cmd), str::to_string)
}

/// What fish offers for the command line `toolctl WORDS` (the last word being completed), from
/// the script `TOOLCTL_COMPLETE=fish toolctl` prints, through fish's own `complete -C`.
fn fish_completes(words: &[&str], env: &[(&str, &str)]) -> Vec<String> {
    let toolctl = env!("CARGO_BIN_EXE_toolctl");
    let line = format!("toolctl {}", words.join(" "));
    let script = format!(
        "source (TOOLCTL_COMPLETE=fish '{toolctl}' | psub); complete -C '{}'",
        line.replace('\'', "\\'")
    );
    let mut cmd = Command::new(shell("fish"));
    cmd.arg("--no-config")
        .arg("-c")
        .arg(script)
        .env_remove("OLLIE_TOOLS_PATH")
        .envs(env.iter().copied());
    candidates(run(&mut cmd), |line| {
        line.split('\t').next().unwrap_or(line).to_string()
    })
}

/// What zsh offers for `toolctl WORDS`: the function `TOOLCTL_COMPLETE=zsh toolctl` defines,
/// run by zsh on the words as its completion system passes them, with `_describe` (which
/// would draw the menu) replaced by one that prints each value.
fn zsh_completes(words: &[&str], env: &[(&str, &str)]) -> Vec<String> {
    let toolctl = env!("CARGO_BIN_EXE_toolctl");
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let script = format!(
        "compdef() {{ }}\n\
         _describe() {{ print -rl -- \"${{(@P)3}}\" }}\n\
         source <(TOOLCTL_COMPLETE=zsh '{toolctl}')\n\
         words=(toolctl {})\nCURRENT={}\n\
         _clap_dynamic_completer_toolctl",
        quoted.join(" "),
        words.len() + 1
    );
    let mut cmd = Command::new(shell("zsh"));
    cmd.arg("-f")
        .arg("-c")
        .arg(script)
        .env_remove("OLLIE_TOOLS_PATH")
        .envs(env.iter().copied());
    // `_describe` takes `VALUE:DESCRIPTION`, a colon in the value escaped.
    candidates(run(&mut cmd), |line| {
        let mut value = String::new();
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => value.extend(chars.next()),
                ':' => break,
                c => value.push(c),
            }
        }
        value
    })
}

/// `name` on `PATH`; a test of that shell fails, not skips, where it is not installed.
fn shell(name: &str) -> String {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(name).is_file()));
    assert!(
        found,
        "{name} is not installed: `apt-get install -y {name}` (.ci/run does)"
    );
    name.to_string()
}

/// The values a completion run printed, options left out, each read by `value`.
fn candidates(out: std::process::Output, value: impl Fn(&str) -> String) -> Vec<String> {
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stderr(&out), "", "completion prints nothing but candidates");
    stdout(&out)
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with("--"))
        .map(value)
        .collect()
}

#[test]
fn zsh_and_fish_complete_tools_and_arguments_as_bash_does() {
    let dir = fixture();
    let t = tools_arg(&dir);
    let t = t.as_str();
    /// The words of a command line, and the environment it completes in.
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);
    let cases: &[Case] = &[
        (&["local", "call", "--tools", t, "e"], &[]),
        (&["local", "describe", "--tools", t, "g"], &[]),
        (&["local", "call", "l"], &[("OLLIE_TOOLS_PATH", t)]),
        (&["local", "call", "--tools", t, "echo", ""], &[]),
        (&["local", "call", "--tools", t, "echo", "n:=1", ""], &[]),
        (&["local", "call", "--tools", "/nonexistent", "e"], &[]),
        (&["local", "c"], &[]),
    ];
    for (words, env) in cases {
        let bash = bash_completes(words, env);
        assert_eq!(zsh_completes(words, env), bash, "zsh: {words:?}");
        assert_eq!(fish_completes(words, env), bash, "fish: {words:?}");
    }
    // Not vacuous: the cases above offer something.
    assert_eq!(zsh_completes(cases[0].0, &[]), ["echo"]);
    assert_eq!(fish_completes(cases[3].0, &[]), ["n:="]);
}

#[test]
fn bash_completes_the_tools_of_the_tools_path_and_their_arguments() {
    let dir = fixture();
    let t = tools_arg(&dir);
    let t = t.as_str();
    assert_eq!(
        bash_completes(&["local", "call", "--tools", t, "e"], &[]),
        ["echo"]
    );
    // Visible tools only, as this machine (or `--as`) resolves them.
    assert_eq!(
        bash_completes(&["local", "describe", "--tools", t, "g"], &[]),
        Vec::<String>::new()
    );
    assert_eq!(
        bash_completes(&["local", "call", "l"], &[("OLLIE_TOOLS_PATH", t)]),
        ["logs"]
    );
    assert_eq!(
        bash_completes(&["local", "call", "--tools", t, "echo", ""], &[]),
        ["n:="]
    );
    assert_eq!(
        bash_completes(&["local", "call", "--tools", t, "echo", "n:=1", ""], &[]),
        Vec::<String>::new()
    );
    // No tools path, or one that is not there: nothing, silently.
    assert_eq!(
        bash_completes(&["local", "call", "e"], &[]),
        Vec::<String>::new()
    );
    assert_eq!(
        bash_completes(&["local", "call", "--tools", "/nonexistent", "e"], &[]),
        Vec::<String>::new()
    );
}

/// A reader that stops early (`| head`, `| true`) ends toolctl as the command would have ended,
/// never with a panic and exit 101 (`failed printing to stdout: Broken pipe`).
#[test]
fn a_reader_that_went_away_is_no_panic() {
    let dir = fixture();
    let tools = dir.path().to_str().unwrap();
    for args in [
        vec!["local", "describe", "--tools", tools, "echo"],
        vec!["local", "call", "--tools", tools, "structured", "--result"],
        vec!["local", "list", "--tools", tools],
        vec!["lint", tools],
    ] {
        // stdout is a pipe whose reading end is closed before toolctl writes.
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        drop(read);
        // Bounded by `timeout`: the harness's bounded run would take stdout for itself.
        let out = Command::new("timeout")
            .arg("30")
            .arg(env!("CARGO_BIN_EXE_toolctl"))
            .args(&args)
            .env_remove("OLLIE_TOOLS_PATH")
            .stdout(std::process::Stdio::from(write))
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_ne!(out.status.code(), Some(101), "{args:?}: {err}");
    }
}

/// `lint` reads a tools path as the registries do, so a tool in two of its directories is
/// reported shadowed in the later one; `local` says when a directory of the path cannot be
/// read (a typo: `list` was empty, `call` said unknown tool, and nothing more).
#[test]
fn a_shadowed_tool_and_a_missing_tools_directory_are_reported() {
    let first = fixture();
    let second = fixture();
    let path = format!("{}:{}", first.path().display(), second.path().display());
    let out = run(toolctl().args(["lint", &path]));
    let said = stdout(&out);
    assert!(
        said.lines().any(|l| l.contains("shadowed")
            && l.contains(&second.path().join("echo.meta").display().to_string())),
        "{said}"
    );

    let missing = first.path().join("no-such-dir");
    let tools = format!("{}:{}", missing.display(), first.path().display());
    let out = run(toolctl().args(["local", "list", "--tools", &tools]));
    let err = stderr(&out);
    assert!(
        err.contains(&missing.display().to_string()) && err.contains("cannot read tools directory"),
        "{err}"
    );
    assert!(
        stdout(&out).contains("echo"),
        "the rest is listed: {}",
        stdout(&out)
    );
}

/// `local call` runs the tool with stdin, stdout and stderr open and nothing else toolctl
/// inherited (a wrapper's log file, a pipe of the shell): they were all open in the tool.
#[test]
fn a_descriptor_toolctl_inherited_reaches_no_tool() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "fds.meta",
        r#"{"description": "Lists its descriptors", "cmd": "ls /proc/self/fd"}"#,
    );
    // F_DUPFD does not set close-on-exec, and Command leaves such descriptors open.
    let log = tempfile::tempfile().unwrap();
    let inherited = nix::fcntl::fcntl(&log, nix::fcntl::FcntlArg::F_DUPFD(200)).unwrap();
    let out = run(toolctl().args([
        "local",
        "call",
        "--tools",
        dir.path().to_str().unwrap(),
        "fds",
    ]));
    nix::unistd::close(inherited).unwrap();
    let open: Vec<i32> = stdout(&out)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert!(open.contains(&1), "{}", stdout(&out));
    assert!(
        !open.contains(&inherited),
        "descriptor {inherited} is open in the tool: {open:?}"
    );
}
