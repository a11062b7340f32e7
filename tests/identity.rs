//! Identity comes from certificates: wrong CAs, wrong roles and false claims are refused,
//! and the policy and audit log act on the proven identity.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::time::Duration;

use std::process::Command;

use serde_json::Value;
use toolsrv_tests::{AgentSpec, Fleet, Pki, Proc, assert_exit, bin, run_bounded, text, wait_for};

fn fleet_with_a() -> Fleet {
    let mut fleet = Fleet::new(&["a", "b"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "hello");
    fleet
}

fn host_ids(fleet: &Fleet) -> Vec<String> {
    fleet
        .hosts()
        .iter()
        .map(|h| h["host_id"].as_str().unwrap().to_string())
        .collect()
}

/// Runs `toolsrv agent --host-id=ID` with the given TLS flags for at most 4 s (it retries
/// failures it cannot tell apart from a coordinator that is away) and returns what it printed.
fn run_agent_briefly(fleet: &Fleet, host_id: &str, tls_args: &[String]) -> std::process::Output {
    let mut cmd = Command::new("timeout");
    cmd.arg("4")
        .arg(bin("toolsrv"))
        .arg("agent")
        .arg(format!("--coordinator={}", fleet.url()))
        .arg(format!("--host-id={host_id}"))
        .args(tls_args)
        .arg(format!(
            "--state-dir={}",
            fleet.work.path().join(format!("brief-{host_id}")).display()
        ))
        .env("TOOLSRV_LOG", "info");
    run_bounded(cmd, None, Duration::from_secs(20))
}

#[test]
fn an_agent_cannot_claim_another_hosts_id() {
    let fleet = fleet_with_a();
    let out = run_agent_briefly(&fleet, "b", &fleet.pki.tls_args("agent-a"));
    let log = text(&out.stderr);
    // No retry can fix it: the agent stops at once, saying what to change (the coordinator's
    // own refusal of such a claim is tested in the coordinator's `roles` tests).
    assert_eq!(out.status.code(), Some(1), "the agent exits: {log}");
    assert!(
        log.contains("names host `a`") && log.contains("--host-id a"),
        "the refusal is explained: {log}"
    );
    assert!(!host_ids(&fleet).contains(&"b".to_string()));
    let hosts = fleet.hosts();
    assert_eq!(
        hosts.iter().find(|h| h["host_id"] == "a").unwrap()["state"],
        "online",
        "a was not displaced"
    );
}

#[test]
fn a_client_certificate_cannot_open_the_agent_link() {
    let fleet = fleet_with_a();
    let out = run_agent_briefly(&fleet, "alice", &fleet.pki.tls_args("client-alice"));
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "the agent exits: {log}");
    assert!(
        log.contains("is a client certificate") && log.contains("toolsrv://agent/alice"),
        "the refusal names the problem: {log}"
    );
    assert!(!host_ids(&fleet).contains(&"alice".to_string()));
}

#[test]
fn an_agent_certificate_cannot_use_the_client_api_and_foreign_cas_are_refused() {
    let fleet = fleet_with_a();
    let out = fleet.toolctl_as("agent-a", &["hosts"], None);
    assert!(
        !out.status.success(),
        "an agent certificate used the client API: {}",
        text(&out.stdout)
    );

    // A client and an agent from another CA.
    let other = Pki::new(&["a"], &["mallory"]);
    let mut cmd = Command::new(bin("toolctl"));
    cmd.arg("hosts")
        .env("TOOLSRV_ADDR", fleet.url())
        .env("TOOLSRV_CA", fleet.pki.path("ca.pem"))
        .env("TOOLSRV_CERT", other.path("client-mallory.pem"))
        .env("TOOLSRV_KEY", other.path("client-mallory-key.pem"));
    let out = run_bounded(cmd, None, Duration::from_secs(30));
    assert!(
        !out.status.success(),
        "a foreign client got in: {}",
        text(&out.stdout)
    );

    // A client trusting another CA than the one that issued the coordinator's certificate:
    // told so, as a setting to fix (exit 78), not a coordinator away (75), nor rustls's
    // `invalid peer certificate: BadSignature`.
    let mut cmd = Command::new(bin("toolctl"));
    cmd.arg("hosts")
        .env("TOOLSRV_ADDR", fleet.url())
        .env("TOOLSRV_CA", other.path("ca.pem"))
        .env("TOOLSRV_CERT", other.path("client-mallory.pem"))
        .env("TOOLSRV_KEY", other.path("client-mallory-key.pem"));
    let out = run_bounded(cmd, None, Duration::from_secs(30));
    toolsrv_tests::assert_exit(
        &out,
        78,
        &["the server's certificate was not issued by a CA this side trusts"],
    );

    let foreign = [
        format!("--ca={}", fleet.pki.path("ca.pem").display()),
        format!("--cert={}", other.path("agent-a.pem").display()),
        format!("--key={}", other.path("agent-a-key.pem").display()),
    ];
    run_agent_briefly(&fleet, "a", &foreign);
    // The real a was never displaced.
    let hosts = fleet.hosts();
    assert_eq!(
        hosts.iter().find(|h| h["host_id"] == "a").unwrap()["state"],
        "online"
    );
    let out = fleet.toolctl(&["call", "a", "hello"]);
    assert_eq!(text(&out.stdout), "hello\n");
}

/// Host `a` offering `hello`, under a policy that denies bob on `role=db` hosts, with the
/// coordinator's host labels `labels` (kept in the returned file) and an audit log.
fn bob_denied_on_db_hosts(labels: &str) -> (Fleet, std::path::PathBuf) {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    let policy = fleet.policy_arg(
        r#"{"default": "allow", "rules": [{"clients": ["bob"], "hosts": "role=db", "effect": "deny"}]}"#,
    );
    let path = fleet.work.path().join("host-labels.json");
    std::fs::write(&path, labels).unwrap();
    fleet.start_coordinator(&[
        &policy,
        &fleet.audit_arg(),
        &format!("--host-labels={}", path.display()),
    ]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "hello");
    (fleet, path)
}

/// `toolctl tools` and `describe` tell each client what a call would meet under the policy
/// (denied, and by which rule; waiting for whom), so nobody learns it from a refused call.
#[test]
fn listings_say_what_the_policy_lets_each_client_do() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    fleet.tool(
        "restart_web.meta",
        r#"{"description": "Restart the web server", "cmd": "echo restarted"}"#,
        false,
    );
    let policy = fleet.policy_arg(
        r#"{"default": "allow", "rules": [
            {"clients": ["bob"], "tools": ["hello"], "effect": "deny"},
            {"tools": ["restart_*"], "effect": "approve", "approvers": ["oncall-*"]}]}"#,
    );
    fleet.start_coordinator(&[&policy]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "restart_web");

    let listed = |stem: &str| -> serde_json::Value {
        let out = fleet.toolctl_as(stem, &["tools", "a", "--json"], None);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let tools: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        tools
            .into_iter()
            .map(|t| (t["name"].as_str().unwrap().to_string(), t["policy"].clone()))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    assert_eq!(
        listed("client-bob"),
        serde_json::json!({
            "hello": {"effect": "deny", "rule": 0,
                      "denial": "policy rule 0 denies client bob calling hello on a"},
            "restart_web": {"effect": "approve", "rule": 1, "approvers": ["oncall-*"]},
        })
    );
    assert_eq!(
        listed("client-alice"),
        serde_json::json!({
            "hello": {"effect": "allow", "rule": null},
            "restart_web": {"effect": "approve", "rule": 1, "approvers": ["oncall-*"]},
        })
    );
    let out = fleet.toolctl_as("client-bob", &["tools", "a"], None);
    assert_eq!(
        text(&out.stdout),
        "hello        Say hello [denied to you: rule 0]\n\
         restart_web  Restart the web server [waits for approval by oncall-*: rule 1]\n"
    );
    // What the listing says is what a call meets.
    assert_exit(
        &fleet.toolctl_as("client-bob", &["call", "a", "hello"], None),
        77,
        &["policy rule 0 denies client bob calling hello on a"],
    );

    // `describe` prints the definition as before and says the same on stderr.
    let out = fleet.toolctl_as("client-bob", &["describe", "a", "hello"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let definition: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(definition["description"], "Say hello");
    assert!(
        text(&out.stderr).contains(
            "a call of `hello` on host `a` by you: [denied to you: rule 0] (policy rule 0 denies \
             client bob calling hello on a)"
        ),
        "{}",
        text(&out.stderr)
    );
    let out = fleet.toolctl(&["describe", "a", "hello"]);
    assert!(out.status.success());
    assert_eq!(text(&out.stderr), "", "nothing to say of an allowed call");
    let out = fleet.toolctl(&["describe", "a", "restart_web"]);
    assert!(
        text(&out.stderr).contains("[waits for approval by oncall-*: rule 1]"),
        "{}",
        text(&out.stderr)
    );

    // Through bob's `toolctl master` the answers are bob's, listing and header alike.
    let socket = fleet.work.path().join("bob.sock");
    let mut cmd = fleet.toolctl_command("client-bob", &["master", "--control"]);
    cmd.arg(&socket);
    let _master = Proc::spawn("toolctl-master", cmd, fleet.work.path());
    wait_for("the master's socket", Duration::from_secs(10), || {
        socket.exists().then_some(())
    });
    let via_master = |args: &[&str]| {
        let mut cmd = Command::new(bin("toolctl"));
        cmd.args(args).env("TOOLSRV_CONTROL", &socket);
        run_bounded(cmd, None, Duration::from_secs(30))
    };
    let out = via_master(&["tools", "a"]);
    assert!(
        text(&out.stdout).contains("Say hello [denied to you: rule 0]"),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let out = via_master(&["describe", "a", "hello"]);
    assert!(
        text(&out.stderr).contains("by you: [denied to you: rule 0]"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn policy_denies_by_proven_identity_and_every_call_is_audited() {
    // The rule matches a label the coordinator assigns: what an agent says of itself is not
    // trusted for policy.
    let (fleet, _) = bob_denied_on_db_hosts(r#"{"a": {"role": "db"}}"#);
    let out = fleet.toolctl_as("client-bob", &["call", "a", "hello"], None);
    assert_exit(&out, 77, &["denies client bob"]);
    let out = fleet.toolctl(&["call", "a", "hello"]);
    assert_eq!(text(&out.stdout), "hello\n");

    let lines = fleet.audit_records();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(
        (lines[0]["client"].as_str(), lines[0]["status"].as_str()),
        (Some("bob"), Some("CALL_STATUS_DENIED"))
    );
    assert_eq!(
        (lines[1]["client"].as_str(), lines[1]["status"].as_str()),
        (Some("alice"), Some("CALL_STATUS_OK"))
    );
    assert_eq!(lines[1]["host"], "a");
    assert!(lines[1]["args_sha256"].as_str().unwrap().len() == 64);
}

/// The policy file is followed while the coordinator runs: an edit decides the calls from then
/// on and reaches the agents' sandboxes; a broken file, or one every user could rewrite, leaves
/// the policy in force; each is audited.
#[test]
fn a_policy_edited_while_the_coordinator_runs_decides_the_calls_from_then_on() {
    use std::os::unix::fs::PermissionsExt;
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    // Writes a mark in a directory the agent's sandbox does not grant by default.
    let outside = fleet.work.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mark = outside.join("mark");
    fleet.tool(
        "touch_it.meta",
        &format!(
            r#"{{"description": "Leave a mark", "cmd": "touch {}"}}"#,
            mark.display()
        ),
        false,
    );
    let policy = fleet
        .policy_arg(r#"{"default": "allow", "rules": [{"clients": ["bob"], "effect": "deny"}]}"#);
    let path = fleet.work.path().join("policy.json");
    fleet.start_coordinator(&[&policy, &fleet.audit_arg(), "--metrics-listen=127.0.0.1:0"]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "touch_it");
    let refused_gauge = || {
        fleet
            .coordinator
            .as_ref()
            .unwrap()
            .metric("toolsrv_policy_file_refused")
    };
    assert_eq!(refused_gauge().as_deref(), Some("0"));
    // Which text is in force, by its digest: what replicas compare.
    let in_force = |text: &str| {
        let series = format!(
            "toolsrv_settings_info{{file=\"policy\",sha256=\"{}\"}}",
            toolsrv_registry::hex_sha256(text.as_bytes())
        );
        fleet.coordinator.as_ref().unwrap().metric(&series)
    };
    let first = std::fs::read_to_string(&path).unwrap();
    assert_eq!(in_force(&first).as_deref(), Some("1"));

    let bob = |fleet: &Fleet| fleet.toolctl_as("client-bob", &["call", "a", "hello"], None);
    assert_exit(&bob(&fleet), 77, &["denies client bob"]);
    let out = fleet.toolctl(&["call", "a", "touch_it"]);
    assert!(!out.status.success(), "the sandbox let the mark be written");
    assert!(!mark.exists());

    // Bob allowed, alice's hello denied, and touch_it granted the directory.
    let second = format!(
        r#"{{"default": "allow",
            "rules": [{{"clients": ["alice"], "tools": ["hello"], "effect": "deny"}}],
            "sandbox": [{{"tools": ["touch_it"], "write": ["{}"]}}]}}"#,
        outside.display()
    );
    fleet.replace_policy(&second, 0o644);
    wait_for(
        "bob allowed by the new policy",
        Duration::from_secs(15),
        || bob(&fleet).status.success().then_some(()),
    );
    assert_exit(
        &fleet.toolctl(&["call", "a", "hello"]),
        77,
        &["denies client alice"],
    );
    wait_for(
        "the agent's new sandbox grant",
        Duration::from_secs(15),
        || {
            fleet
                .toolctl(&["call", "a", "touch_it"])
                .status
                .success()
                .then_some(())
        },
    );
    assert!(mark.exists());
    assert_eq!(in_force(&second).as_deref(), Some("1"));
    assert_eq!(in_force(&first), None);

    // Broken, then open to every user: each refused once, the second policy stays in force.
    let coordinator_log = || fleet.coordinator.as_ref().unwrap().log();
    let refused = "policy: the file changed and cannot be used";
    fleet.replace_policy(
        r#"{"default": "deny", "rules": [{"effect": "allow", "typo": 1}]}"#,
        0o644,
    );
    wait_for("the broken policy refused", Duration::from_secs(15), || {
        (coordinator_log().matches(refused).count() == 1).then_some(())
    });
    fleet.replace_policy(r#"{"default": "deny"}"#, 0o666);
    wait_for("the open policy refused", Duration::from_secs(15), || {
        (coordinator_log().matches(refused).count() == 2).then_some(())
    });
    assert!(
        coordinator_log().contains("chmod o-w"),
        "{}",
        coordinator_log()
    );
    assert_eq!(refused_gauge().as_deref(), Some("1"));
    assert_eq!(in_force(&second).as_deref(), Some("1"));
    assert!(
        bob(&fleet).status.success(),
        "the second policy is no longer in force"
    );
    assert_exit(
        &fleet.toolctl(&["call", "a", "hello"]),
        77,
        &["denies client alice"],
    );
    // Fixed: in force.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    wait_for("the fixed policy in force", Duration::from_secs(15), || {
        (bob(&fleet).status.code() == Some(77)).then_some(())
    });

    let policies: Vec<(String, String)> = fleet
        .audit_records()
        .iter()
        .filter(|r| r["event"] == "policy")
        .map(|r| {
            let detail = match r["outcome"].as_str() {
                Some("loaded") => format!("{} rules, {} sandbox", r["rules"], r["sandbox"]),
                _ => r["reason"].as_str().unwrap_or_default().to_string(),
            };
            (
                r["outcome"].as_str().unwrap_or_default().to_string(),
                detail,
            )
        })
        .collect();
    assert_eq!(policies.len(), 4, "{policies:?}");
    assert_eq!(policies[0], ("loaded".into(), "1 rules, 1 sandbox".into()));
    assert_eq!(policies[1].0, "refused");
    assert!(policies[1].1.contains("typo"), "{policies:?}");
    assert!(
        policies[2].1.contains("mode 0666") || policies[2].1.contains("666"),
        "{policies:?}"
    );
    assert_eq!(policies[3], ("loaded".into(), "0 rules, 0 sandbox".into()));
    assert_eq!(refused_gauge().as_deref(), Some("0"));
    let fixed = r#"{"default": "deny"}"#;
    assert_eq!(in_force(fixed).as_deref(), Some("1"));
    // Each text put in force is audited with its digest.
    let digests: Vec<Value> = fleet
        .audit_records()
        .iter()
        .filter(|r| r["event"] == "policy" && r["outcome"] == "loaded")
        .map(|r| r["sha256"].clone())
        .collect();
    let sha = |text: &str| Value::from(toolsrv_registry::hex_sha256(text.as_bytes()));
    assert_eq!(digests, [sha(&second), sha(fixed)]);
    // `toolsrv policy check` names the same digest, for a file to compare with what runs.
    let out = run_bounded(
        {
            let mut cmd = Command::new(bin("toolsrv"));
            cmd.args(["policy", "check"]).arg(&path);
            cmd
        },
        None,
        Duration::from_secs(20),
    );
    assert!(
        text(&out.stdout).contains(&format!("(sha256 {})", sha(fixed).as_str().unwrap())),
        "{}",
        text(&out.stdout)
    );
}

/// The host labels file is followed too: a host given a label while connected is matched by
/// policy rules and sandbox entries at once, and shows it.
#[test]
fn host_labels_edited_while_the_coordinator_runs_relabel_hosts_at_once() {
    use std::os::unix::fs::PermissionsExt;
    let (fleet, labels) = bob_denied_on_db_hosts("{}");
    let bob = |fleet: &Fleet| fleet.toolctl_as("client-bob", &["call", "a", "hello"], None);
    assert!(bob(&fleet).status.success());

    let new = fleet.work.path().join("host-labels.json.new");
    std::fs::write(&new, r#"{"a*": {"role": "db"}}"#).unwrap();
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::rename(&new, &labels).unwrap();
    wait_for(
        "bob denied on the relabelled host",
        Duration::from_secs(15),
        || (bob(&fleet).status.code() == Some(77)).then_some(()),
    );
    let out = fleet.toolctl(&["hosts", "--json"]);
    let hosts: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(hosts[0]["trusted_labels"]["role"], "db", "{hosts}");
    // The same host is selected by its new label.
    let out = fleet.toolctl(&["fanout", "role=db", "hello"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("hello"), "{}", text(&out.stdout));
    // Broken: refused, the labels stay.
    std::fs::write(&new, r#"{"a*": {"role": 7}}"#).unwrap();
    std::fs::rename(&new, &labels).unwrap();
    wait_for("the broken labels refused", Duration::from_secs(15), || {
        let log = fleet.coordinator.as_ref().unwrap().log();
        log.contains("host_labels: the file changed and cannot be used")
            .then_some(())
    });
    assert_eq!(bob(&fleet).status.code(), Some(77));
    let records: Vec<String> = fleet
        .audit_records()
        .iter()
        .filter(|r| r["event"] == "host_labels")
        .map(|r| format!("{} {} {}", r["outcome"], r["hosts_relabelled"], r["sha256"]))
        .collect();
    let digest = toolsrv_registry::hex_sha256(br#"{"a*": {"role": "db"}}"#);
    assert_eq!(
        records,
        [
            format!("\"loaded\" 1 \"{digest}\""),
            "\"refused\" null null".to_string()
        ]
    );
}

/// `toolsrv policy check` reads a policy and host labels as the coordinator does and says what
/// it decides for one call, with the exit status a script can test.
#[test]
fn policy_check_says_what_the_policy_decides_for_a_call() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.json");
    std::fs::write(
        &policy,
        r#"{"default": "allow",
            "rules": [{"clients": ["ci-*"], "tools": ["service_*"], "effect": "deny"},
                      {"tools": ["restart_*"], "hosts": "role=db", "effect": "approve",
                       "approvers": ["oncall-*"], "require_sandbox": true}],
            "sandbox": [{"tools": ["system_logs"], "hosts": "os=linux", "read": ["/var/log"]}]}"#,
    )
    .unwrap();
    let labels = dir.path().join("labels.json");
    std::fs::write(&labels, r#"{"db-*": {"role": "db"}}"#).unwrap();
    let check = |args: &[&str]| {
        let mut command = Command::new(bin("toolsrv"));
        command.args(["policy", "check"]).arg(&policy).args(args);
        let out = run_bounded(command, None, Duration::from_secs(10));
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    let (code, stdout, _) = check(&[]);
    assert_eq!(code, Some(0));
    assert!(stdout.contains("2 rules, 1 sandbox entry"), "{stdout}");

    // Approved by on-call, confined, with the labels the file gives db-1 (names in any case).
    let labels_arg = format!("--host-labels={}", labels.display());
    let (code, stdout, _) = check(&[
        &labels_arg,
        "--client=Alice",
        "--tool=restart_nginx",
        "--host=DB-1",
        "--fact=os=linux",
        "--fact=sandbox=enforced",
    ]);
    assert_eq!(code, Some(0), "{stdout}");
    for line in [
        "trusted labels of db-1: role=db",
        "alice calling restart_nginx on db-1: approve: waits for one of oncall-* (policy rule 1)",
        "must run confined (policy rule 1): the host's sandbox is enforced",
        "sandbox grants for db-1: 1",
        "tools system_logs; read /var/log",
    ] {
        assert!(stdout.contains(line), "{line:?} in {stdout}");
    }
    // The same call where the sandbox is off: refused, as the coordinator refuses it.
    let (code, stdout, _) = check(&[
        &labels_arg,
        "--client=alice",
        "--tool=restart_nginx",
        "--host=db-1",
        "--fact=sandbox=off",
    ]);
    assert_eq!(code, Some(77), "{stdout}");
    assert!(stdout.contains("refused `unconfined`"), "{stdout}");
    // A name with an escape sequence is shown escaped, not obeyed by the terminal.
    let (_, stdout, _) = check(&["--client=eve\u{1b}[31m", "--tool=x", "--host=web-1"]);
    assert!(!stdout.contains('\u{1b}'), "{stdout:?}");
    assert!(
        stdout.contains("eve\\u{1b}[31m calling x on web-1"),
        "{stdout:?}"
    );
    // Denied by a rule; a label only the certificate carries counts as trusted too.
    let (code, stdout, _) = check(&["--client=ci-7", "--tool=service_status", "--host=web-1"]);
    assert_eq!(code, Some(77), "{stdout}");
    assert!(
        stdout.contains("denied: policy rule 0 denies client ci-7 calling service_status on web-1"),
        "{stdout}"
    );
    let (code, stdout, _) = check(&[
        "--client=bob",
        "--tool=restart_x",
        "--host=web-1",
        "--label=role=db",
    ]);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains("approve: waits for one of oncall-*"),
        "{stdout}"
    );

    // What is not a fact, and what a file cannot be.
    let (code, _, stderr) = check(&["--client=a", "--tool=t", "--host=h", "--fact=role=db"]);
    assert_eq!(code, Some(64));
    assert!(stderr.contains("--fact role: not a fact"), "{stderr}");
    std::fs::write(&policy, r#"{"rules": [{"effect": "allow", "typo": 1}]}"#).unwrap();
    let (code, _, stderr) = check(&[]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("unknown field `typo`"), "{stderr}");
    std::fs::write(&policy, "{}").unwrap();
    std::fs::set_permissions(&policy, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (code, _, stderr) = check(&[]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("chmod o-w"), "{stderr}");
}

#[test]
fn host_and_client_names_compare_case_insensitively() {
    let mut fleet = Fleet::new(&["db-2"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    // Certificates that spell their names with capitals, as another CA might issue them.
    fleet.pki.issue_raw("agent-web-1", "toolsrv://agent/Web-1");
    fleet
        .pki
        .issue_raw("client-Alice", "toolsrv://client/Alice");
    // db-2's agent is started as `--host-id DB-2` with its lowercase certificate.
    for suffix in [".pem", "-key.pem"] {
        std::fs::copy(
            fleet.pki.path(&format!("agent-db-2{suffix}")),
            fleet.pki.path(&format!("agent-DB-2{suffix}")),
        )
        .unwrap();
    }
    let policy = fleet.policy_arg(
        r#"{"default": "deny", "rules": [
            {"clients": ["alice"], "hosts": "web-1", "effect": "allow"},
            {"clients": ["BOB"], "hosts": "DB-2", "effect": "allow"}]}"#,
    );
    fleet.start_coordinator(&[&policy]);
    // Cert `agent/Web-1`, hello `web-1`; cert `agent/db-2`, flag `DB-2`.
    fleet.start_agent("web-1", &AgentSpec::default());
    fleet.start_agent("DB-2", &AgentSpec::default());
    fleet.wait_online(&["web-1", "db-2"], "hello");
    assert_eq!(host_ids(&fleet), ["db-2", "web-1"]);

    let call = |stem: &str, host: &str| fleet.toolctl_as(stem, &["call", host, "hello"], None);
    for (stem, host, allowed) in [
        ("client-Alice", "Web-1", true),
        ("client-Alice", "web-1", true),
        ("client-Alice", "db-2", false),
        ("client-bob", "DB-2", true),
        ("client-bob", "db-2", true),
        ("client-bob", "WEB-1", false),
    ] {
        let out = call(stem, host);
        if allowed {
            assert!(
                out.status.success(),
                "{stem} on {host}: {}",
                text(&out.stderr)
            );
            assert_eq!(text(&out.stdout), "hello\n");
        } else {
            assert_eq!(
                out.status.code(),
                Some(77),
                "{stem} on {host}: {}",
                text(&out.stderr)
            );
        }
    }
    // A fan-out selector in capitals finds the host too.
    let out = fleet.toolctl_as("client-Alice", &["fanout", "WEB-*", "hello"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("hello"), "{}", text(&out.stdout));
}

/// Whoever can read a private key can act as its holder: another user of the machine who reads
/// an agent's, the coordinator's or an administrator's key, or the CA's, is that agent, that
/// coordinator, that administrator, or signs anyone in. A key file every user may read stops
/// whoever was given it, naming the file and the `chmod` that fixes it; one its group may read
/// (as the deployments give a service's group its key) is used.
#[test]
fn private_keys_every_user_could_read_are_not_used() {
    use std::os::unix::fs::PermissionsExt;
    let fleet = fleet_with_a();
    let dir = fleet.work.path();
    let copy = |name: &str, mode: u32| {
        let open = dir.join(format!("copy-{mode:o}-{name}"));
        std::fs::copy(fleet.pki.path(name), &open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(mode)).unwrap();
        open
    };
    let refused = |out: &std::process::Output, key: &std::path::Path, who: &str| {
        assert!(!out.status.success(), "{who} used an open key: {out:?}");
        let err = text(&out.stderr);
        for needle in [
            format!(
                "{}: readable by every user of this machine (mode 0644)",
                key.display()
            ),
            format!("chmod o-rw {}", key.display()),
        ] {
            assert!(err.contains(&needle), "{who}: no {needle:?} in {err}");
        }
    };

    // The coordinator.
    let key = copy("coordinator-key.pem", 0o644);
    let mut cmd = Command::new(bin("toolsrv"));
    cmd.arg("coordinator")
        .arg(format!("--ca={}", fleet.pki.path("ca.pem").display()))
        .arg(format!(
            "--cert={}",
            fleet.pki.path("coordinator.pem").display()
        ))
        .arg(format!("--key={}", key.display()))
        .arg("--listen=127.0.0.1:0")
        .arg(format!("--tools={}", dir.join("tools").display()));
    refused(
        &run_bounded(cmd, None, Duration::from_secs(30)),
        &key,
        "the coordinator",
    );

    // An agent: it never reaches the coordinator.
    let key = copy("agent-b-key.pem", 0o644);
    let out = run_agent_briefly(
        &fleet,
        "b",
        &[
            format!("--ca={}", fleet.pki.path("ca.pem").display()),
            format!("--cert={}", fleet.pki.path("agent-b.pem").display()),
            format!("--key={}", key.display()),
        ],
    );
    refused(&out, &key, "the agent");
    assert!(!host_ids(&fleet).contains(&"b".to_string()));

    // A client, then the same key readable by its group only.
    let toolctl = |key: &std::path::Path| {
        let mut cmd = Command::new(bin("toolctl"));
        cmd.arg("hosts")
            .env("TOOLSRV_ADDR", fleet.url())
            .env("TOOLSRV_CA", fleet.pki.path("ca.pem"))
            .env("TOOLSRV_CERT", fleet.pki.path("client-alice.pem"))
            .env("TOOLSRV_KEY", key);
        run_bounded(cmd, None, Duration::from_secs(30))
    };
    let key = copy("client-alice-key.pem", 0o644);
    let out = toolctl(&key);
    refused(&out, &key, "toolctl");
    assert_eq!(out.status.code(), Some(78), "{out:?}");
    let out = toolctl(&copy("client-alice-key.pem", 0o640));
    assert!(out.status.success(), "{out:?}");
    assert!(text(&out.stdout).contains('a'), "{}", text(&out.stdout));

    // The CA: `toolsrv pki init` adds nothing with a CA key others may read.
    let ca_dir = dir.join("open-ca");
    std::fs::create_dir(&ca_dir).unwrap();
    for name in ["ca.pem", "ca-key.pem"] {
        std::fs::copy(fleet.pki.path(name), ca_dir.join(name)).unwrap();
    }
    let ca_key = ca_dir.join("ca-key.pem");
    std::fs::set_permissions(&ca_key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut cmd = Command::new(bin("toolsrv"));
    cmd.args(["pki", "init"])
        .arg(&ca_dir)
        .args(["--agents", "mallory"]);
    refused(
        &run_bounded(cmd, None, Duration::from_secs(30)),
        &ca_key,
        "toolsrv pki",
    );
    assert!(!ca_dir.join("agent-mallory.pem").exists());
}
