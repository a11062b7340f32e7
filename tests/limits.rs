//! The size limits with real processes: a `.meta` too large to ship does not take the fleet
//! offline, and a host view larger than a message still reaches the coordinator whole.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::time::Duration;

use serde_json::Value;
use toolsrv_tests::{AgentSpec, Fleet, assert_exit, text, wait_for};

/// `(host id, connected_unix_ms, state)` of every host.
fn connections(fleet: &Fleet) -> Vec<(String, u64, String)> {
    fleet
        .hosts()
        .iter()
        .map(|h| {
            (
                h["host_id"].as_str().unwrap().to_string(),
                h["connected_unix_ms"].as_u64().unwrap(),
                h["state"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn call_ok(fleet: &Fleet, host: &str, tool: &str, expect: &str) {
    let out = fleet.toolctl(&["call", host, tool]);
    assert!(
        out.status.success(),
        "{tool} on {host}: {}",
        text(&out.stderr)
    );
    assert_eq!(text(&out.stdout), expect, "{tool} on {host}");
}

#[test]
fn a_five_mib_meta_is_reported_and_every_host_stays_online() {
    let mut fleet = Fleet::new(&["a", "b"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    fleet.tool(
        "beside.meta",
        r#"{"description": "Runs its executable"}"#,
        false,
    );
    fleet.tool("beside", "#!/bin/sh\necho from beside\n", true);
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.start_agent("b", &AgentSpec::default());
    fleet.wait_online(&["a", "b"], "beside");
    let before = connections(&fleet);
    assert!(before.iter().all(|(_, _, state)| state == "online"));

    // The file of the incident: a 5 MiB prompt.
    let prompt = "x".repeat(5 << 20);
    fleet.tool(
        "big.meta",
        &format!(r#"{{"description": "Too big", "cmd": "true", "prompt": "{prompt}"}}"#),
        false,
    );
    let coordinator = fleet.coordinator.as_ref().unwrap();
    wait_for(
        "the coordinator to report big.meta",
        Duration::from_secs(20),
        || {
            let log = coordinator.log();
            log.lines()
                .any(|l| l.contains("big.meta") && l.contains("limit of 262144 bytes"))
                .then_some(())
        },
    );
    // A tool added after it still ships: the registry moves on.
    fleet.tool(
        "later.meta",
        r#"{"description": "Added later", "cmd": "echo later"}"#,
        false,
    );
    fleet.wait_online(&["a", "b"], "later");
    // Long enough for several keepalive rounds and rechecks, had any link been dropped.
    std::thread::sleep(Duration::from_secs(4));

    assert_eq!(
        connections(&fleet),
        before,
        "no host went offline or reconnected"
    );
    for host in ["a", "b"] {
        call_ok(&fleet, host, "hello", "hello\n");
        call_ok(&fleet, host, "beside", "from beside\n");
        call_ok(&fleet, host, "later", "later\n");
        // Not served: listed hidden, with the reason, and refused with it.
        let tools = fleet.tools(host).unwrap();
        let big = tools.iter().find(|t| t["name"] == "big").unwrap();
        assert_eq!(big["visible"], false, "big is not served to {host}");
        assert!(
            big["reason"]
                .as_str()
                .unwrap()
                .contains("limit of 262144 bytes"),
            "{big}"
        );
        let out = fleet.toolctl(&["call", host, "big"]);
        assert_exit(&out, 69, &["limit of 262144 bytes"]);
        let log = fleet.agents[host].log();
        assert_eq!(
            log.matches("attached to the coordinator").count(),
            1,
            "agent {host} attached once:\n{log}"
        );
    }

    // toolctl lint says the same about the file.
    let out = fleet.toolctl(&["lint", &fleet.tools.display().to_string()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(
        text(&out.stdout)
            .lines()
            .any(|l| l.contains("big.meta: error:") && l.contains("limit of 262144 bytes")),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn a_view_larger_than_a_message_is_reported_whole() {
    // 90 tools of about 200 KiB each (each under the 256 KiB .meta limit): an 18 MiB view,
    // more than the 16 MiB one message may hold.
    const TOOLS: usize = 90;
    const PROMPT: usize = 200 << 10;
    let mut fleet = Fleet::new(&["a"]);
    let prompt = "p".repeat(PROMPT);
    for i in 0..TOOLS {
        fleet.tool(
            &format!("t{i:03}.meta"),
            &format!(r#"{{"description": "tool {i}", "cmd": "echo {i}", "prompt": "{prompt}"}}"#),
            false,
        );
    }
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    let host = wait_for("host a's whole view", Duration::from_secs(90), || {
        fleet
            .hosts()
            .into_iter()
            .find(|h| h["host_id"] == "a" && h["visible_tools"] == TOOLS)
    });
    assert_eq!(host["state"], "online");

    // The listing comes in pages, every tool once, in order.
    let tools = fleet.tools("a").unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t["name"].as_str().unwrap()).collect();
    let expected: Vec<String> = (0..TOOLS).map(|i| format!("t{i:03}")).collect();
    assert_eq!(names, expected);
    let out = fleet.toolctl(&["describe", "a", "t089"]);
    let def: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(def["prompt"].as_str().unwrap().len(), PROMPT);
    call_ok(&fleet, "a", "t042", "42\n");

    let log = fleet.agents["a"].log();
    assert_eq!(
        log.matches("attached to the coordinator").count(),
        1,
        "the agent attached once:\n{log}"
    );
    let first = fleet.hosts()[0]["connected_unix_ms"].clone();
    assert_eq!(first, host["connected_unix_ms"]);
}
