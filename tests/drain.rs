//! Graceful drain: a coordinator or an agent that gets SIGTERM lets running calls finish,
//! refuses new ones, and a restart loses no call that started before it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::process::{Child, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use toolsrv_tests::{AgentSpec, Fleet, finish_child, text, wait_for};

/// A tool that leaves `<marks>/<name>.pid` once it runs, then takes `secs` seconds.
fn slow_tool(fleet: &Fleet, name: &str, secs: u32) {
    let marks = fleet.marks();
    fleet.tool(
        &format!("{name}.meta"),
        &format!(
            r#"{{"description": "Takes {secs} s", "cmd": "echo $$ > {marks}/{name}.pid; sleep {secs}; echo done"}}"#,
            marks = marks.display()
        ),
        false,
    );
}

fn started(fleet: &Fleet, name: &str) -> i32 {
    let pid_file = fleet.marks().join(format!("{name}.pid"));
    wait_for("the tool to start", Duration::from_secs(20), || {
        std::fs::read_to_string(&pid_file).ok()?.trim().parse().ok()
    })
}

fn call_in_background(fleet: &Fleet, host: &str, tool: &str) -> Child {
    fleet
        .toolctl_command("client-alice", &["call", host, tool, "{}"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn sigterm(pid: i32) {
    kill(Pid::from_raw(pid), Signal::SIGTERM).unwrap();
}

fn host_state(fleet: &Fleet, id: &str) -> Option<String> {
    fleet
        .hosts()
        .iter()
        .find(|h| h["host_id"] == id)
        .and_then(|h| h["state"].as_str().map(String::from))
}

#[test]
fn a_call_in_flight_completes_across_a_coordinator_sigterm_and_restart() {
    let mut fleet = Fleet::new(&["a"]);
    slow_tool(&fleet, "slow", 3);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    fleet.start_coordinator(&["--drain-grace-secs=30"]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "slow");

    let running = call_in_background(&fleet, "a", "slow");
    started(&fleet, "slow");
    let coordinator_pid = fleet.coordinator.as_ref().unwrap().pid();
    sigterm(coordinator_pid);

    // While it drains, a new call is refused at once with a hint to retry (exit 75).
    let refused = wait_for("a new call to be refused", Duration::from_secs(10), || {
        let out = fleet.toolctl(&["call", "a", "hello", "{}"]);
        (out.status.code() == Some(75)).then_some(out)
    });
    let err = text(&refused.stderr);
    assert!(
        err.contains("shutting down") && err.contains("retry"),
        "{err}"
    );

    // The call that was running when the drain began ends normally.
    let out = finish_child(running, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "done");

    // Then the coordinator exits by itself, cleanly.
    let coordinator = fleet.coordinator.as_mut().unwrap();
    let status = wait_for("the coordinator to exit", Duration::from_secs(20), || {
        coordinator.child.try_wait().ok().flatten()
    });
    assert!(status.success(), "{status:?}: {}", coordinator.log_tail(20));
    assert!(
        coordinator.log().contains("every running call finished"),
        "{}",
        coordinator.log_tail(20)
    );

    // A new coordinator on the same port: the agent comes back and calls work again.
    fleet.start_coordinator(&[]);
    fleet.wait_online(&["a"], "hello");
    let out = fleet.toolctl(&["call", "a", "hello", "{}"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn calls_still_running_after_the_grace_are_cancelled_on_the_host() {
    let mut fleet = Fleet::new(&["a"]);
    slow_tool(&fleet, "forever", 300);
    fleet.start_coordinator(&["--drain-grace-secs=1"]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "forever");

    let running = call_in_background(&fleet, "a", "forever");
    let tool_pid = started(&fleet, "forever");
    sigterm(fleet.coordinator.as_ref().unwrap().pid());
    let out = finish_child(running, Duration::from_secs(30));
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("drain grace"), "{err}");
    // The process on the host is gone: the coordinator cancelled the call on the agent.
    wait_for("the tool process to end", Duration::from_secs(20), || {
        kill(Pid::from_raw(tool_pid), None).is_err().then_some(())
    });
}

#[test]
fn an_agent_sigterm_finishes_its_call_and_is_offline_at_once() {
    let mut fleet = Fleet::new(&["a"]);
    slow_tool(&fleet, "slow", 4);
    // An agent that vanished without a word would show offline only after a minute: only its
    // goodbye can make it offline within this test's bounds.
    fleet.start_coordinator(&["--lost-after-ms=60000"]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "slow");

    let running = call_in_background(&fleet, "a", "slow");
    started(&fleet, "slow");
    sigterm(fleet.agents["a"].pid());
    // While it drains, a new call is refused by the coordinator as the host shutting down
    // (offline, exit 75: retry later), not run and not "cancelled" (exit 130, as for Ctrl-C).
    wait_for(
        "the agent to say it drains",
        Duration::from_secs(10),
        || {
            let log = fleet.coordinator.as_ref().unwrap().log();
            log.contains("the agent is shutting down").then_some(())
        },
    );
    let refused = fleet.toolctl(&["call", "a", "slow"]);
    toolsrv_tests::assert_exit(&refused, 75, &["host `a` is shutting down"]);
    let agent = fleet.agents.get_mut("a").unwrap();
    let out = finish_child(running, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "done");
    let status = wait_for("the agent to exit", Duration::from_secs(20), || {
        agent.child.try_wait().ok().flatten()
    });
    assert!(status.success(), "{status:?}");
    let state = wait_for("a offline", Duration::from_secs(10), || {
        host_state(&fleet, "a").filter(|s| s == "offline")
    });
    assert_eq!(state, "offline");
}

/// A coordinator that dies mid-call (SIGKILL: no drain) leaves `toolctl call` saying what is
/// known, in the words `toolctl mcp` gives a model: the connection broke during the call, and
/// whether the tool finished is not known. Before, it said `cannot call ...: h2 protocol error:
/// error reading a body from connection`.
#[test]
fn a_coordinator_lost_mid_call_leaves_the_caller_told_what_is_known() {
    let mut fleet = Fleet::new(&["a"]);
    slow_tool(&fleet, "slow", 30);
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "slow");
    let running = call_in_background(&fleet, "a", "slow");
    started(&fleet, "slow");
    fleet.coordinator.as_mut().unwrap().kill();
    let out = finish_child(running, Duration::from_secs(30));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{err}");
    assert!(
        err.starts_with(
            "toolctl: the connection to the coordinator broke during the call of `slow` on host `a`"
        ) && err.contains("whether the tool finished is not known"),
        "{err}"
    );
    assert!(!err.contains("h2 protocol error"), "{err}");
}
