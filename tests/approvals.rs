//! Calls the policy marks `approve`: decided by the caller (`--approve`, `--deny`, no terminal),
//! by a second identity with `toolctl approve ID`, or by nobody (expired); every decision audited.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use toolsrv_tests::{AgentSpec, Fleet, assert_exit, decisions, finish_child, text, wait_for};

const POLICY: &str = r#"{"default": "allow", "rules": [
    {"tools": ["restart"], "effect": "approve"},
    {"tools": ["drop_table"], "effect": "approve", "approvers": ["bob"]}]}"#;

fn fleet(extra: &[&str]) -> Fleet {
    let mut fleet = Fleet::new(&["a"]);
    for tool in ["restart", "drop_table"] {
        fleet.tool(
            &format!("{tool}.meta"),
            &format!(r#"{{"description": "{tool}", "cmd": "echo {tool} ran"}}"#),
            false,
        );
    }
    let mut args = vec![fleet.policy_arg(POLICY), fleet.audit_arg()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fleet.start_coordinator(&args);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "restart");
    fleet
}

/// The pending requests client `stem` may decide, as `toolctl approvals --json` lists them.
fn approvals_for(fleet: &Fleet, stem: &str) -> Vec<Value> {
    let out = fleet.toolctl_as(stem, &["approvals", "--json"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_caller_approves_or_denies_its_own_call() {
    let fleet = fleet(&[]);
    let out = fleet.toolctl_detached("client-alice", &["call", "a", "restart", "--approve"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "restart ran\n");

    let out = fleet.toolctl_detached("client-alice", &["call", "a", "restart", "--deny"]);
    assert_exit(&out, 77, &["approval denied by alice"]);

    // No flag and no terminal: denied, saying how to decide without one.
    let out = fleet.toolctl_detached("client-alice", &["call", "a", "restart"]);
    assert_exit(&out, 77, &["no terminal"]);

    // Tools the rule does not name run at once, and nothing else waited.
    let out = fleet.toolctl(&["fanout", "a", "restart", "--approve"]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    let records = fleet.audit_records();
    assert_eq!(
        decisions(&records, "approval"),
        [
            ("approved".into(), Some("alice".into())),
            ("denied".into(), Some("alice".into())),
            ("denied".into(), Some("alice".into())),
            ("approved".into(), Some("alice".into())),
        ]
    );
    let calls: Vec<&str> = records
        .iter()
        .filter(|r| r["event"] == "call")
        .map(|r| r["status"].as_str().unwrap())
        .collect();
    assert_eq!(
        calls,
        [
            "CALL_STATUS_OK",
            "CALL_STATUS_DENIED",
            "CALL_STATUS_DENIED",
            "CALL_STATUS_OK"
        ]
    );
}

#[test]
fn a_two_person_rule_waits_for_the_second_identity() {
    let fleet = fleet(&[]);
    // alice's --approve cannot decide a request that needs bob.
    let mut caller =
        fleet.toolctl_command("client-alice", &["call", "a", "drop_table", "--approve"]);
    caller.stdout(Stdio::piped()).stderr(Stdio::piped());
    let caller = caller.spawn().unwrap();

    let list = |stem: &str| approvals_for(&fleet, stem);
    let pending = wait_for("bob to see the request", Duration::from_secs(20), || {
        let list = list("client-bob");
        (!list.is_empty()).then_some(list)
    });
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0]["caller"], "alice");
    assert_eq!(pending[0]["tool"], "drop_table");
    assert!(
        pending[0]["expires_unix_ms"].as_u64().unwrap() > 0,
        "the listing says when the request expires: {pending:?}"
    );
    assert!(list("client-alice").is_empty(), "the caller may not decide");
    let id = pending[0]["id"].as_str().unwrap();
    // The request whole, for the approver only.
    let out = fleet.toolctl_as("client-bob", &["approvals", "--id", id], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(
        shown.contains(&format!("request {id}")) && shown.contains("arguments (2 bytes"),
        "{shown}"
    );
    let out = fleet.toolctl_as("client-alice", &["approvals", "--id", id], None);
    assert_exit(&out, 77, &["needs another approver"]);

    let out = fleet.toolctl_as("client-alice", &["approve", id], None);
    assert_exit(&out, 77, &[]);
    let out = fleet.toolctl_as(
        "client-bob",
        &["approve", id, "--reason", "ticket 42"],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Used once.
    let out = fleet.toolctl_as("client-bob", &["approve", id], None);
    assert_exit(&out, 127, &[]);

    let out = finish_child(caller, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "drop_table ran\n");
    assert!(
        text(&out.stderr).contains("waiting for approval by bob"),
        "the caller sees for whom it waits: {}",
        text(&out.stderr)
    );
    let records = fleet.audit_records();
    let decision = records.iter().find(|r| r["event"] == "approval").unwrap();
    assert_eq!(decision["decided_by"], "bob");
    assert_eq!(decision["client"], "alice");
    assert_eq!(decision["reason"], "ticket 42");
}

/// An approver deciding on a host's own tool is told so: it is vetted by no one but the host.
#[test]
fn an_approver_is_told_when_the_tool_is_the_host_s_own() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "drop_table.meta",
        r#"{"description": "drop_table", "cmd": "echo drop_table ran"}"#,
        false,
    );
    let policy = r#"{"default": "allow", "rules": [
        {"tools": ["drop_table", "wipe"], "effect": "approve", "approvers": ["bob"]}]}"#;
    let args = [fleet.policy_arg(policy), fleet.audit_arg()];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fleet.start_coordinator(&args);
    let spec = AgentSpec::own_tools(&[("wipe", r#"{"description": "Wipe", "cmd": "echo wiped"}"#)]);
    fleet.start_agent("a", &spec);
    fleet.wait_online(&["a"], "wipe");

    for (tool, host_only) in [("wipe", true), ("drop_table", false)] {
        let mut caller = fleet.toolctl_command("client-alice", &["call", "a", tool]);
        caller.stdout(Stdio::piped()).stderr(Stdio::piped());
        let caller = caller.spawn().unwrap();
        let pending = wait_for("bob to see the request", Duration::from_secs(20), || {
            let out = fleet.toolctl_as("client-bob", &["approvals", "--json"], None);
            let list: Vec<Value> = serde_json::from_slice(&out.stdout).ok()?;
            (!list.is_empty()).then_some(list)
        });
        assert_eq!(pending[0]["tool"], tool);
        assert_eq!(pending[0]["host_only"], host_only, "{pending:?}");
        let table = text(&fleet.toolctl_as("client-bob", &["approvals"], None).stdout);
        assert_eq!(
            table.contains(&format!("{tool} [host-only]")),
            host_only,
            "{table}"
        );
        let id = pending[0]["id"].as_str().unwrap();
        let out = fleet.toolctl_as("client-bob", &["approve", id], None);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let out = finish_child(caller, Duration::from_secs(30));
        assert!(out.status.success(), "{}", text(&out.stderr));
        let waiting = text(&out.stderr);
        assert_eq!(
            waiting.contains(&format!(
                "`{tool}` (host-only: the host's own tool, not the catalog's) on host `a`"
            )),
            host_only,
            "{waiting}"
        );
    }
    let records = fleet.audit_records();
    let marks: Vec<(&str, bool)> = records
        .iter()
        .filter(|r| r["event"] == "approval")
        .map(|r| (r["tool"].as_str().unwrap(), r["host_only"] == true))
        .collect();
    assert_eq!(marks, [("wipe", true), ("drop_table", false)]);
}

#[test]
fn an_unanswered_request_expires_as_a_denial() {
    let fleet = fleet(&["--approval-timeout-secs=1"]);
    let out = fleet.toolctl_detached("client-alice", &["call", "a", "drop_table"]);
    assert_exit(&out, 77, &["not approved within 1 s by bob"]);
    let records = fleet.audit_records();
    assert_eq!(decisions(&records, "approval"), [("expired".into(), None)]);
}

/// No call runs that the audit log cannot record, however it comes to run: an approval given
/// while the log cannot be written is refused to its approver (exit 75, naming the log), the
/// request keeps waiting, and once the log is written again (the refusal's record is its next
/// try) the approval goes through and the call runs, each step recorded.
#[test]
fn an_approval_the_audit_log_cannot_record_is_not_given() {
    let fleet = fleet(&[]);
    let mut caller =
        fleet.toolctl_command("client-alice", &["call", "a", "drop_table", "--approve"]);
    caller.stdout(Stdio::piped()).stderr(Stdio::piped());
    let caller = caller.spawn().unwrap();
    let pending = || approvals_for(&fleet, "client-bob");
    let id = wait_for("bob to see the request", Duration::from_secs(20), || {
        pending()
            .first()
            .map(|r| r["id"].as_str().unwrap().to_string())
    });

    // The disk fills up; the next record (a call to a host nobody knows) cannot be written.
    fleet.point_audit_log_at(std::path::Path::new("/dev/full"));
    let out = fleet.toolctl(&["call", "nowhere", "restart"]);
    assert!(!out.status.success());
    let approve = || fleet.toolctl_as("client-bob", &["approve", &id], None);
    let out = approve();
    assert_exit(
        &out,
        75,
        &[
            "cannot write its audit log",
            &fleet.audit_log().display().to_string(),
        ],
    );
    assert_eq!(pending().len(), 1, "the request keeps waiting");

    // Room again: the first approval is refused still, and its refusal is recorded.
    let file = fleet.work.path().join("audit-after.jsonl");
    std::fs::write(&file, "").unwrap();
    fleet.point_audit_log_at(&file);
    assert_exit(&approve(), 75, &["cannot write its audit log"]);
    let out = approve();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = finish_child(caller, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "drop_table ran\n");

    let records = toolsrv_tests::json_lines(&file);
    let events: Vec<&str> = records
        .iter()
        .map(|r| r["event"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["refusal", "approval", "call"], "{records:?}");
    assert_eq!(records[0]["client"], "bob");
    assert_eq!(records[0]["approval_id"], id.as_str());
    assert_eq!(records[0]["code"], "Unavailable");
    assert_eq!(records[1]["decided_by"], "bob");
    assert_eq!(records[2]["status"], "CALL_STATUS_OK");
}

/// A request waiting for a person is decided under the policy in force when it is decided. An
/// edit naming other approvers moves it to them: the old ones no longer see or decide it, and
/// the caller is told for whom it waits now. An edit that lets the call run without asking runs
/// it; one that denies the call denies it at once. Each decision is audited as taken.
#[test]
fn a_waiting_request_follows_the_policy_put_in_force() {
    let fleet = fleet(&[]);
    fleet
        .pki
        .issue_client_expiring("carol", Duration::from_secs(3600));
    let policy = |drop_table: &str| {
        format!(r#"{{"default": "allow", "rules": [{{"tools": ["drop_table"], {drop_table}}}]}}"#)
    };
    // Each version in force before the test goes on: its `loaded` record is in the audit log.
    let loaded = std::cell::Cell::new(0);
    let put = |drop_table: &str| {
        fleet.replace_policy(&policy(drop_table), 0o644);
        loaded.set(loaded.get() + 1);
        wait_for("the new policy in force", Duration::from_secs(20), || {
            let records = fleet.audit_records();
            let n = records
                .iter()
                .filter(|r| r["event"] == "policy" && r["outcome"] == "loaded")
                .count();
            (n == loaded.get()).then_some(())
        });
    };
    let waiting_call = || {
        let mut caller =
            fleet.toolctl_command("client-alice", &["call", "a", "drop_table", "--deny"]);
        caller.stdout(Stdio::piped()).stderr(Stdio::piped());
        caller.spawn().unwrap()
    };
    let first_for = |stem: &str| {
        approvals_for(&fleet, stem)
            .first()
            .map(|r| r["id"].as_str().unwrap().to_string())
    };

    // Waits for bob; the new policy asks carol instead.
    let caller = waiting_call();
    let id = wait_for("bob to see the request", Duration::from_secs(20), || {
        first_for("client-bob")
    });
    put(r#""effect": "approve", "approvers": ["carol"]"#);
    let moved = wait_for("carol to see the request", Duration::from_secs(20), || {
        first_for("client-carol")
    });
    assert_eq!(moved, id, "the same request, asked of its new approver");
    assert!(approvals_for(&fleet, "client-bob").is_empty());
    assert_exit(
        &fleet.toolctl_as("client-bob", &["approve", &id], None),
        77,
        &["its approvers are carol"],
    );
    let out = fleet.toolctl_as("client-carol", &["approve", &id], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = finish_child(caller, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "drop_table ran\n");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("waiting for approval by bob")
            && stderr.contains("waiting for approval by carol"),
        "the caller is told whom it waits for, then whom it waits for now: {stderr}"
    );

    // Back to the caller: it decides (here, with --deny) once told.
    let caller = waiting_call();
    wait_for("carol to see the request", Duration::from_secs(20), || {
        first_for("client-carol")
    });
    put(r#""effect": "approve""#);
    let out = finish_child(caller, Duration::from_secs(30));
    assert_exit(&out, 77, &["approval denied by alice"]);

    // Allowed without asking: it runs.
    put(r#""effect": "approve", "approvers": ["carol"]"#);
    let caller = waiting_call();
    wait_for("carol to see the request", Duration::from_secs(20), || {
        first_for("client-carol")
    });
    put(r#""effect": "allow""#);
    let out = finish_child(caller, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "drop_table ran\n");

    // Denied: at once, saying why.
    put(r#""effect": "approve", "approvers": ["carol"]"#);
    let caller = waiting_call();
    wait_for("carol to see the request", Duration::from_secs(20), || {
        first_for("client-carol")
    });
    put(r#""effect": "deny""#);
    let out = finish_child(caller, Duration::from_secs(30));
    assert_exit(
        &out,
        77,
        &[
            "approval denied by policy: the policy or host labels changed since the call was made: \
             policy rule 0 denies client alice calling drop_table on a",
        ],
    );

    let records = fleet.audit_records();
    assert_eq!(
        decisions(&records, "approval"),
        [
            ("approved".into(), Some("carol".into())),
            ("denied".into(), Some("alice".into())),
            ("approved".into(), Some("policy".into())),
            ("denied".into(), Some("policy".into())),
        ]
    );
    let first = records.iter().find(|r| r["event"] == "approval").unwrap();
    assert_eq!(first["approvers"], serde_json::json!(["carol"]), "{first}");
}

/// A call that waits for approval is first held to the arguments the tool takes on the host:
/// arguments the host would refuse are refused at once (exit 65), and nobody is asked to
/// approve a call that cannot run. Before, bob was asked to approve 900 KB of arguments shown
/// cut to 4 KiB, and the call failed on the key he never saw once he had.
#[test]
fn nobody_is_asked_to_approve_a_call_whose_arguments_cannot_run() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "drop_table.meta",
        r#"{"description": "drop_table", "cmd": "echo dropped",
            "args": {"type": "object", "additionalProperties": false,
                     "properties": {"table": {"type": "string"}}}}"#,
        false,
    );
    let args = [fleet.policy_arg(POLICY), fleet.audit_arg()];
    fleet.start_coordinator(&[&args[0], &args[1]]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "drop_table");
    // 900 KB of arguments (from stdin: more than a command line takes), a key the tool does
    // not take past the first 4 KiB; a wrong type; a key it does not take.
    let hidden = format!(
        r#"{{"table": "t{}", "cascade": true}}"#,
        " ".repeat(900_000)
    );
    let from_stdin = fleet.toolctl_command("client-alice", &["call", "a", "drop_table", "-"]);
    let out = toolsrv_tests::run_bounded(from_stdin, Some(&hidden), Duration::from_secs(30));
    assert_exit(&out, 65, &["drop_table", "cascade"]);
    for bad in [r#"{"table": 7}"#, r#"{"cascade": true}"#] {
        let out = fleet.toolctl_detached("client-alice", &["call", "a", "drop_table", bad]);
        assert_exit(&out, 65, &["drop_table"]);
    }
    assert!(approvals_for(&fleet, "client-bob").is_empty());
    // Arguments the tool takes still wait for bob.
    let child = fleet
        .toolctl_command(
            "client-alice",
            &["call", "a", "drop_table", r#"{"table": "t"}"#],
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let id = wait_for("bob's request", Duration::from_secs(30), || {
        approvals_for(&fleet, "client-bob")
            .first()
            .and_then(|r| r["id"].as_str().map(String::from))
    });
    let out = fleet.toolctl_as("client-bob", &["approve", &id], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = finish_child(child, Duration::from_secs(30));
    assert_eq!(text(&out.stdout), "dropped\n", "{}", text(&out.stderr));
    let records = fleet.audit_records();
    let refused = records
        .iter()
        .filter(|r| r["event"] == "call" && r["status"] == "CALL_STATUS_INVALID_ARGS")
        .count();
    assert_eq!(refused, 3, "each refused call audited");
}

/// A caller that goes away while its request waits leaves an audit record of it all the same:
/// `withdrawn`, as when its call ends. Before, the wait was dropped with the caller's stream
/// and the request was recorded nowhere.
#[test]
fn a_request_whose_caller_vanishes_is_recorded_withdrawn() {
    let fleet = fleet(&[]);
    let mut caller = fleet
        .toolctl_command("client-alice", &["call", "a", "drop_table"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("bob's request", Duration::from_secs(30), || {
        (!approvals_for(&fleet, "client-bob").is_empty()).then_some(())
    });
    caller.kill().unwrap();
    caller.wait().unwrap();
    wait_for("the request withdrawn", Duration::from_secs(30), || {
        approvals_for(&fleet, "client-bob").is_empty().then_some(())
    });
    let decided = wait_for(
        "the withdrawal's audit record",
        Duration::from_secs(30),
        || {
            let found = decisions(&fleet.audit_records(), "approval");
            (!found.is_empty()).then_some(found)
        },
    );
    assert_eq!(decided, [("withdrawn".to_string(), None)]);
}

/// A question asked on the terminal is withdrawn when its request is decided elsewhere
/// (`toolctl approve` from another shell): the call's output is not held behind it, and the
/// command does not wait for an answer that no longer counts.
#[test]
fn a_question_decided_elsewhere_is_withdrawn_from_the_terminal() {
    let fleet = fleet(&[]);
    let inner = fleet.toolctl_command("client-alice", &["call", "a", "restart"]);
    let line: Vec<String> = std::iter::once(inner.get_program())
        .chain(inner.get_args())
        .map(|a| format!("'{}'", a.to_str().unwrap()))
        .collect();
    // `script` gives the command a terminal of its own to be asked on; nobody types on it.
    let mut cmd = std::process::Command::new("script");
    cmd.args(["-qefc", &line.join(" "), "/dev/null"]);
    for (k, v) in inner.get_envs() {
        if let Some(v) = v {
            cmd.env(k, v);
        }
    }
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut caller = cmd.spawn().unwrap();
    // Held open: an end of input would answer the question on the terminal.
    let _typing = caller.stdin.take();
    let id = wait_for("the question to be asked", Duration::from_secs(20), || {
        approvals_for(&fleet, "client-alice")
            .first()
            .map(|r| r["id"].as_str().unwrap().to_string())
    });
    let out = fleet.toolctl_as("client-alice", &["approve", &id], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = finish_child(caller, Duration::from_secs(30));
    let seen = text(&out.stdout);
    assert!(out.status.success(), "{seen}{}", text(&out.stderr));
    assert!(
        seen.contains("approve? [y/N]"),
        "asked on the terminal: {seen}"
    );
    assert!(seen.contains("restart ran"), "{seen}");
    assert!(
        seen.contains(&format!("request {id} was decided elsewhere")),
        "{seen}"
    );
}
