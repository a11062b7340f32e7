//! A `.meta` broken while the fleet runs, then repaired: the tool does not vanish silently. The
//! coordinator logs the file, field and reason once, `tools --all` lists it hidden with the
//! reason, `watch` says it became invalid, `call` refuses it with the reason; repaired, it is
//! back everywhere.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::time::Duration;

use serde_json::Value;
use toolsrv_tests::{AgentSpec, Fleet, LineWatch, assert_exit, text, wait_for};

const GOOD: &str = r#"{"description": "Say hello", "cmd": "echo hello"}"#;
const BROKEN: &str = r#"{"description": 3, "cmd": "echo hello"}"#;

fn tool_entry(fleet: &Fleet, name: &str) -> Option<Value> {
    fleet.tools("a")?.into_iter().find(|t| t["name"] == name)
}

/// Lines of the coordinator's log that say a tool is not served.
fn not_served_lines(fleet: &Fleet) -> Vec<String> {
    fleet
        .coordinator
        .as_ref()
        .unwrap()
        .log()
        .lines()
        .filter(|l| l.contains("tool not served"))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_tool_broken_and_repaired_while_running_says_why_and_comes_back() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool("hello.meta", GOOD, false);
    fleet.tool(
        "other.meta",
        r#"{"description": "Other", "cmd": "true"}"#,
        false,
    );
    // `--rescan-secs=1` (the harness's): several periodic rescans happen during the test.
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "hello");
    let watch = LineWatch::start(fleet.toolctl_command("client-alice", &["watch", "--json"]));
    watch.until("snapshot", |e| e["kind"] == "snapshot");

    // Broken.
    fleet.tool("hello.meta", BROKEN, false);
    let path = fleet.tools.join("hello.meta").display().to_string();
    let reason = format!("invalid: {path}: field `description`: expected string, got number");
    let event = watch.until("the registry event", |e| e["kind"] == "registry");
    assert_eq!(event["invalid"][0]["name"], "hello", "{event}");
    assert_eq!(event["invalid"][0]["reason"], reason.as_str(), "{event}");
    assert_eq!(event["removed"], serde_json::json!([]), "{event}");

    let hidden = wait_for(
        "the listing to show hello hidden",
        Duration::from_secs(20),
        || tool_entry(&fleet, "hello").filter(|t| t["visible"] == false),
    );
    assert_eq!(hidden["reason"], reason.as_str(), "{hidden}");
    let listing = fleet.toolctl(&["tools", "a", "--all"]);
    assert!(
        text(&listing.stdout).contains(&format!("hello  (hidden) {reason}")),
        "{}",
        text(&listing.stdout)
    );
    let out = fleet.toolctl(&["tools", "a"]);
    assert!(
        !text(&out.stdout).contains("hello"),
        "without --all only what can be called: {}",
        text(&out.stdout)
    );

    let out = fleet.toolctl(&["call", "a", "hello"]);
    assert_exit(&out, 69, &[]);
    assert_eq!(
        text(&out.stderr),
        format!("toolctl: tool `hello` is hidden on host `a`: {reason}\n")
    );
    let out = fleet.toolctl(&["describe", "a", "hello"]);
    assert_exit(&out, 69, &[]);
    assert_eq!(
        text(&out.stderr),
        format!("toolctl: tool `hello` is hidden on host `a`: {reason}\n")
    );
    let out = fleet.toolctl(&["call", "a", "other"]);
    assert!(out.status.success(), "the other tools keep working");

    // Logged with file, field and reason, once: not again at the periodic rescans.
    let lines = wait_for("the log line", Duration::from_secs(10), || {
        Some(not_served_lines(&fleet)).filter(|l| !l.is_empty())
    });
    assert!(
        lines[0].contains("hello.meta") && lines[0].contains("field `description`"),
        "{lines:?}"
    );
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        not_served_lines(&fleet).len(),
        1,
        "{:?}",
        not_served_lines(&fleet)
    );

    // Repaired.
    fleet.tool("hello.meta", GOOD, false);
    let event = watch.until("the repair", |e| {
        e["kind"] == "registry" && e["added"] == serde_json::json!(["hello"])
    });
    assert_eq!(event["invalid"], serde_json::json!([]), "{event}");
    let out = wait_for("the repaired tool to run", Duration::from_secs(20), || {
        let out = fleet.toolctl(&["call", "a", "hello"]);
        out.status.success().then_some(out)
    });
    assert_eq!(text(&out.stdout), "hello\n");
    assert_eq!(tool_entry(&fleet, "hello").unwrap()["visible"], true);
    assert_eq!(
        not_served_lines(&fleet).len(),
        1,
        "the repair logs no problem"
    );
}

#[test]
fn a_rewrite_in_place_that_pauses_between_truncation_and_write_never_drops_the_tool() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool("hello.meta", GOOD, false);
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "hello");
    let watch = LineWatch::start(fleet.toolctl_command("client-alice", &["watch", "--json"]));
    watch.until("snapshot", |e| e["kind"] == "snapshot");

    // `>` in a shell, or an editor saving in place: the file is empty for a while, across a
    // file event and the harness's periodic rescan (every second).
    let path = fleet.tools.join("hello.meta");
    std::fs::File::create(&path).unwrap();
    std::thread::sleep(Duration::from_millis(1300));
    assert_eq!(
        tool_entry(&fleet, "hello").unwrap()["visible"],
        true,
        "served while being written"
    );
    std::fs::write(
        &path,
        r#"{"description": "Say hello again", "cmd": "echo again"}"#,
    )
    .unwrap();

    let event = watch.until("the rewrite", |e| {
        let names = |field: &str| e[field].as_array().cloned().unwrap_or_default();
        let hello = serde_json::json!("hello");
        assert!(
            !names("removed").contains(&hello)
                && !names("invalid").iter().any(|i| i["name"] == hello),
            "the half-written file reached the fleet: {e}"
        );
        e["kind"] == "registry" && names("changed").contains(&hello)
    });
    assert_eq!(event["added"], serde_json::json!([]), "{event}");
    let out = wait_for("the new version to run", Duration::from_secs(20), || {
        let out = fleet.toolctl(&["call", "a", "hello"]);
        (text(&out.stdout) == "again\n").then_some(out)
    });
    assert_exit(&out, 0, &[]);
    assert!(
        not_served_lines(&fleet).is_empty(),
        "{:?}",
        not_served_lines(&fleet)
    );
}
