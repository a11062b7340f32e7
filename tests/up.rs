//! `toolsrv up`, the README's run command: one process, a working system, and `toolctl` against
//! it with exactly the settings its banner prints.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use toolsrv_tests::{bin, free_port, run_bounded, text, wait_for};

#[test]
fn up_runs_a_whole_system_that_toolctl_can_use() {
    let state = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut up = Command::new(bin("toolsrv"))
        .args(["up", "--listen", &format!("127.0.0.1:{port}"), "--state"])
        .arg(state.path())
        .env("TOOLSRV_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    // The banner's export lines are the client settings.
    let mut env = Vec::new();
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(assign) = line.trim().strip_prefix("export ") {
            let (k, v) = assign.split_once('=').unwrap();
            env.push((k.to_string(), v.to_string()));
        }
        if line.contains("Ctrl-C") {
            break;
        }
    }
    assert_eq!(env.len(), 4, "{env:?}");
    let toolctl = |args: &[&str]| {
        let mut cmd = Command::new(bin("toolctl"));
        cmd.args(args).envs(env.iter().cloned());
        run_bounded(cmd, None, Duration::from_secs(60))
    };
    wait_for(
        "the local agent to report its tools",
        Duration::from_secs(30),
        || {
            let out = toolctl(&["tools", "local", "--json"]);
            let tools: Vec<Value> = serde_json::from_slice(&out.stdout).ok()?;
            tools.iter().any(|t| t["name"] == "env_info").then_some(())
        },
    );
    let out = toolctl(&["call", "local", "env_info"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let facts: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(facts["os"], "linux");
    let out = toolctl(&[
        "fanout",
        "all",
        "json_value",
        r#"{"json": {"a": 1}, "path": ".a"}"#,
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains(r#""status":"ok""#),
        "{}",
        text(&out.stdout)
    );
    // The example tools were written into the state directory, and a second run reuses it.
    assert!(state.path().join("tools/env_info.meta").exists());
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(up.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let status = wait_for("up to exit on SIGTERM", Duration::from_secs(20), || {
        up.try_wait().unwrap()
    });
    assert!(status.success(), "{status:?}");
}
