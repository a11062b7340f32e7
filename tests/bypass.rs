//! The bypass path end to end: a confined tool asks through its call's socket, the coordinator
//! decides by policy or by a person, the agent runs the approved command outside the Landlock
//! rules but inside the call's cgroup; every outcome audited.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use toolsrv_tests::{AgentSpec, Fleet, bin, decisions, finish_child, text, wait_for};

const POLICY: &str = r#"{"default": "allow", "rules": [
    {"tools": ["bp_allow", "raw", "bp_wait"], "effect": "allow", "bypass": "allow"},
    {"tools": ["bp_deny"], "effect": "allow", "bypass": "deny"},
    {"tools": ["bp_ask"], "effect": "allow", "bypass": "ask"},
    {"tools": ["bp_bob", "raw_bob"], "effect": "allow", "bypass": "ask", "approvers": ["bob"]}]}"#;

/// Tries to write `$OUT` itself (the sandbox refuses), then asks for a command that writes it
/// and says which cgroup it ran in.
const ASKER: &str = r#"set -u
out=$(jq -r .out)
if (echo inside > "$out") 2>/dev/null; then echo "tool wrote=yes"; else echo "tool wrote=no"; fi
toolsrv bypass --no-stdin --reason "write the mark" -- sh -c 'echo outside > "$1" && echo "cmd wrote=yes" && grep -c "/call-" /proc/self/cgroup | sed "s/^/cmd in call cgroup lines=/"' sh "$out"
echo "bypass exit=$?""#;

/// Says it started (`$started`), waits for the test's go (`$go`, at most 60 s), then asks for a
/// command that writes `$out`.
const WAITER: &str = r#"set -u
args=$(cat)
arg() { printf '%s' "$args" | jq -r ".$1"; }
touch "$(arg started)"
i=0
while [ ! -e "$(arg go)" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
toolsrv bypass --no-stdin --reason "write the mark" -- sh -c 'echo outside > "$1"' sh "$(arg out)"
echo "bypass exit=$?""#;

/// Speaks the wire format itself: a malformed line, then a good request, on one connection;
/// optionally on a socket named in the arguments instead of its own; optionally first opening
/// `hold` connections at once and saying what each got (`held` for nothing) before closing them.
const RAW: &str = r#"import json, os, socket, sys
args = json.load(sys.stdin)
path = args.get("socket") or os.environ["OLLIE_BYPASS_SOCKET"]
if args.get("publish"):
    open(args["publish"], "w").write(os.environ["OLLIE_BYPASS_SOCKET"])
    import time
    time.sleep(args.get("linger", 0))
held = []
for _ in range(args.get("hold", 0)):
    c = socket.socket(socket.AF_UNIX)
    c.connect(path)
    held.append(c)
if held:
    import time
    time.sleep(0.5)
    for c in held:
        c.settimeout(0.5)
        try:
            got = c.recv(4096).decode().strip() or "closed"
        except socket.timeout:
            got = "held"
        print(json.dumps({"held": got}), flush=True)
    for c in held:
        c.close()
    time.sleep(0.5)
s = socket.socket(socket.AF_UNIX)
s.connect(path)
f = s.makefile("rwb")
for line in args["lines"]:
    f.write(line.encode() + b"\n"); f.flush()
    print(f.readline().decode().strip(), flush=True)
"#;

fn fleet(extra: &[&str]) -> Fleet {
    let mut fleet = Fleet::new(&["a"]);
    for tool in ["bp_allow", "bp_deny", "bp_ask", "bp_bob"] {
        let meta = serde_json::json!({"description": tool, "cmd": ASKER});
        fleet.tool(&format!("{tool}.meta"), &meta.to_string(), false);
    }
    fleet.tool(
        "bp_wait.meta",
        &serde_json::json!({"description": "bp_wait", "cmd": WAITER}).to_string(),
        false,
    );
    for tool in ["raw", "raw_bob"] {
        fleet.tool(
            &format!("{tool}.meta"),
            &serde_json::json!({"description": tool, "cmd": "/usr/bin/python3 -c \"$RAW\""})
                .to_string(),
            false,
        );
    }
    let mut args = vec![fleet.policy_arg(POLICY), fleet.audit_arg()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fleet.start_coordinator(&args);
    // `toolsrv bypass` on the calls' PATH, readable under their Landlock rules.
    let toolsrv = bin("toolsrv");
    let bin_dir = toolsrv.parent().unwrap().to_path_buf();
    fleet.start_agent(
        "a",
        &AgentSpec {
            env: vec![
                (
                    "PATH".into(),
                    format!("{}:/usr/bin:/bin", bin_dir.display()),
                ),
                ("RAW".into(), RAW.into()),
            ],
            args: vec![
                format!("--sandbox-read={}", bin_dir.display()),
                "--sandbox-env=RAW".into(),
            ],
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["a"], "bp_bob");
    fleet
}

fn bypasses(fleet: &Fleet) -> Vec<(String, Option<String>)> {
    decisions(&fleet.audit_records(), "bypass")
}

fn mark_args(fleet: &Fleet, name: &str) -> (std::path::PathBuf, String) {
    let out = fleet.work.path().join(name);
    (out.clone(), format!(r#"{{"out": "{}"}}"#, out.display()))
}

/// The approval requests bob may decide, once there are some.
fn pending_for_bob(fleet: &Fleet) -> Vec<Value> {
    wait_for("bob to see the request", Duration::from_secs(20), || {
        let out = fleet.toolctl_as("client-bob", &["approvals", "--json"], None);
        let list: Vec<Value> = serde_json::from_slice(&out.stdout).ok()?;
        (!list.is_empty()).then_some(list)
    })
}

/// alice's call of `bp_wait`, started and waiting for its go (the file returned) before it asks
/// for a command that writes `mark`.
fn started_waiter(
    fleet: &Fleet,
    mark: &std::path::Path,
) -> (std::process::Child, std::path::PathBuf) {
    let (started, go) = (fleet.marks().join("started"), fleet.marks().join("go"));
    let args = serde_json::json!({"out": mark, "started": started, "go": go}).to_string();
    let mut caller = fleet.toolctl_command("client-alice", &["call", "a", "bp_wait", &args]);
    caller.stdout(Stdio::piped()).stderr(Stdio::piped());
    let caller = caller.spawn().unwrap();
    wait_for("the call to start", Duration::from_secs(20), || {
        started.exists().then_some(())
    });
    (caller, go)
}

fn assert_ran(stdout: &str, mark: &std::path::Path) {
    assert!(stdout.contains("tool wrote=no"), "{stdout}");
    assert!(stdout.contains("cmd wrote=yes"), "{stdout}");
    assert!(stdout.contains("cmd in call cgroup lines="), "{stdout}");
    assert!(!stdout.contains("cmd in call cgroup lines=0"), "{stdout}");
    assert!(stdout.contains("bypass exit=0"), "{stdout}");
    assert_eq!(std::fs::read_to_string(mark).unwrap(), "outside\n");
}

#[test]
fn policy_allows_or_denies_a_bypass() {
    let fleet = fleet(&[]);
    let (mark, args) = mark_args(&fleet, "allowed.txt");
    let out = fleet.toolctl(&["call", "a", "bp_allow", &args]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_ran(&text(&out.stdout), &mark);

    let (mark, args) = mark_args(&fleet, "denied.txt");
    let out = fleet.toolctl(&["call", "a", "bp_deny", &args]);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("bypass exit=77"), "{stdout}");
    assert!(!mark.exists());
    assert_eq!(
        bypasses(&fleet),
        [
            ("approved".into(), Some("policy".into())),
            ("denied".into(), Some("policy".into())),
        ]
    );
    let record = fleet
        .audit_records()
        .into_iter()
        .find(|r| r["event"] == "bypass")
        .unwrap();
    assert_eq!(record["bypass_reason"], "write the mark");
    assert!(record["bypass_argv"].as_str().unwrap().starts_with("sh -c"));
}

#[test]
fn the_caller_approves_or_denies_a_bypass() {
    let fleet = fleet(&[]);
    let (mark, args) = mark_args(&fleet, "asked.txt");
    let out = fleet.toolctl_detached("client-alice", &["call", "a", "bp_ask", &args, "--approve"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_ran(&text(&out.stdout), &mark);

    let (mark, args) = mark_args(&fleet, "refused.txt");
    let out = fleet.toolctl_detached("client-alice", &["call", "a", "bp_ask", &args, "--deny"]);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("bypass exit=77"), "{stdout}");
    assert!(!mark.exists());
    assert_eq!(
        bypasses(&fleet),
        [
            ("approved".into(), Some("alice".into())),
            ("denied".into(), Some("alice".into())),
        ]
    );
}

#[test]
fn an_unanswered_bypass_expires_as_a_denial() {
    let fleet = fleet(&["--approval-timeout-secs=1"]);
    let (mark, args) = mark_args(&fleet, "expired.txt");
    let out = fleet.toolctl_detached("client-alice", &["call", "a", "bp_bob", &args]);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("bypass exit=77"),
        "{stdout} {}",
        text(&out.stderr)
    );
    assert!(!mark.exists());
    assert_eq!(bypasses(&fleet), [("expired".into(), None)]);
}

#[test]
fn a_second_identity_approves_a_bypass_while_the_caller_waits() {
    let fleet = fleet(&[]);
    let (mark, args) = mark_args(&fleet, "bob.txt");
    let mut caller =
        fleet.toolctl_command("client-alice", &["call", "a", "bp_bob", &args, "--approve"]);
    caller.stdout(Stdio::piped()).stderr(Stdio::piped());
    let caller = caller.spawn().unwrap();
    let pending = pending_for_bob(&fleet);
    let id = pending[0]["id"].as_str().unwrap();
    let out = fleet.toolctl_as("client-bob", &["approve", id, "--reason", "ticket 7"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = finish_child(caller, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_ran(&text(&out.stdout), &mark);
    assert_eq!(bypasses(&fleet), [("approved".into(), Some("bob".into()))]);
}

/// An approver's reason for a denial reaches the caller through the tool's stderr escaped:
/// `toolsrv bypass` printed it raw, so bob could clear alice's screen or retitle her terminal.
#[test]
fn a_denial_s_reason_reaches_the_caller_escaped() {
    let fleet = fleet(&[]);
    let (mark, args) = mark_args(&fleet, "denied.txt");
    let mut caller = fleet.toolctl_command("client-alice", &["call", "a", "bp_bob", &args]);
    caller
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let caller = caller.spawn().unwrap();
    let pending = pending_for_bob(&fleet);
    let id = pending[0]["id"].as_str().unwrap();
    let reason = "no\u{1b}[2J\u{1b}]0;owned\u{7}";
    let out = fleet.toolctl_as("client-bob", &["deny", id, "--reason", reason], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = finish_child(caller, Duration::from_secs(30));
    let stderr = text(&out.stderr);
    assert!(stderr.contains(r"denied by bob: no\u{1b}[2J"), "{stderr:?}");
    assert!(
        !stderr.contains('\u{1b}') && !stderr.contains('\u{7}'),
        "{stderr:?}"
    );
    assert!(!mark.exists());
}

#[test]
fn the_approver_sees_the_command_asked_for_word_by_word_and_nothing_it_would_hide() {
    let fleet = fleet(&[]);
    // A hostile tool's command: an escape sequence that would wipe the line and start it
    // again with an innocent word, a word with a space in it, a direction override.
    let argv = ["ls\u{1b}[2K\rrm", "-rf", "/srv/a /etc/shadow"];
    let request = serde_json::json!({"argv": argv, "reason": "tidy\u{202e}txt"});
    let args = serde_json::json!({"lines": [request.to_string()]});
    let shown = r"`$'ls\e[2K\x0drm' -rf '/srv/a /etc/shadow'`";
    let mut caller =
        fleet.toolctl_command("client-alice", &["call", "a", "raw_bob", &args.to_string()]);
    caller.stdout(Stdio::piped()).stderr(Stdio::piped());
    let caller = caller.spawn().unwrap();
    let pending = pending_for_bob(&fleet);
    // Programs get the words exactly.
    assert_eq!(pending[0]["bypass_argv"], serde_json::json!(argv));
    assert_eq!(pending[0]["bypass_reason"], "tidy\u{202e}txt");
    // People get them quoted as a shell reads them back, with nothing that rewrites the line.
    let out = fleet.toolctl_as("client-bob", &["approvals"], None);
    let table = text(&out.stdout);
    assert!(
        table.contains(&format!("outside the sandbox: {}", shown.trim_matches('`'))),
        "{table}"
    );
    assert!(
        !table.contains('\u{1b}') && !table.contains('\r'),
        "{table:?}"
    );
    let id = pending[0]["id"].as_str().unwrap();
    let out = fleet.toolctl_as("client-bob", &["deny", id, "--reason", "no"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = finish_child(caller, Duration::from_secs(30));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        stdout.contains(r#""approved":false"#) || stdout.contains(r#""approved": false"#),
        "{stdout}"
    );
    // The caller waiting on bob was told what the tool asks for, the same way.
    assert!(
        stderr.contains(&format!(
            "asks to run {shown} outside its sandbox, saying \"tidy\\u{{202e}}txt\""
        )),
        "{stderr}"
    );
    assert!(
        !stderr.contains('\u{1b}') && !stderr.contains('\u{202e}'),
        "{stderr:?}"
    );
    assert_eq!(bypasses(&fleet), [("denied".into(), Some("bob".into()))]);
    // The audit keeps the words' bounds too.
    let record = fleet
        .audit_records()
        .into_iter()
        .find(|r| r["event"] == "bypass")
        .unwrap();
    assert_eq!(record["bypass_argv"], shown.trim_matches('`'));
}

/// What the `raw` tool, given `args`, printed: one JSON value a line.
fn raw_answers(fleet: &Fleet, args: &Value) -> Vec<Value> {
    let out = fleet.toolctl(&["call", "a", "raw", &args.to_string()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A call holds at most 4 connections to its socket at once: more are refused at once, saying
/// why, and the agent keeps neither their descriptors nor their buffers (24,000 held open left
/// the agent no descriptor to scan its tools with, and 150 sending 6 MB each took 900 MB of
/// its memory). Once closed, the call's requests are served again.
#[test]
fn a_call_holds_a_bounded_number_of_connections_to_its_socket() {
    let fleet = fleet(&[]);
    let args = serde_json::json!({"hold": 10, "lines": [
        r#"{"argv": ["echo", "hello"], "reason": "greet"}"#,
    ]});
    let answers = raw_answers(&fleet, &args);
    assert_eq!(answers.len(), 11, "{answers:?}");
    let held = answers[..10].iter().filter(|a| a["held"] == "held").count();
    assert_eq!(held, 4, "{answers:?}");
    for refused in answers[..10].iter().filter(|a| a["held"] != "held") {
        let line: Value = serde_json::from_str(refused["held"].as_str().unwrap()).unwrap();
        assert_eq!(line["approved"], false);
        assert!(
            line["reason"]
                .as_str()
                .unwrap()
                .contains("4 bypass connections open, the most it may"),
            "{line}"
        );
    }
    assert_eq!(answers[10]["approved"], true, "{answers:?}");
    assert_eq!(answers[10]["stdout"], "hello\n");
}

#[test]
fn a_malformed_line_is_refused_and_the_connection_goes_on() {
    let fleet = fleet(&[]);
    let args = serde_json::json!({"lines": [
        "not json",
        r#"{"argv": []}"#,
        r#"{"argv": ["echo", "hello"], "reason": "greet"}"#,
    ]});
    let answers = raw_answers(&fleet, &args);
    assert_eq!(answers.len(), 3, "{answers:?}");
    assert_eq!(answers[0]["approved"], false);
    assert!(
        answers[0]["reason"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );
    assert_eq!(answers[1]["approved"], false);
    assert_eq!(answers[2]["approved"], true);
    assert_eq!(answers[2]["exit_code"], 0);
    assert_eq!(answers[2]["stdout"], "hello\n");
    assert_eq!(answers[2]["truncated"], false);
}

#[test]
fn another_calls_tool_cannot_use_this_calls_socket() {
    let fleet = fleet(&[]);
    // The first call publishes its socket's path and stays a while; the second uses it.
    let published = fleet.marks().join("socket-path");
    let first = serde_json::json!({
        "publish": published.display().to_string(), "linger": 5, "lines": [],
    });
    let mut holder =
        fleet.toolctl_command("client-alice", &["call", "a", "raw", &first.to_string()]);
    holder.stdout(Stdio::piped()).stderr(Stdio::piped());
    let holder = holder.spawn().unwrap();
    let path = wait_for(
        "the first call to publish its socket",
        Duration::from_secs(20),
        || {
            std::fs::read_to_string(&published)
                .ok()
                .filter(|p| !p.is_empty())
        },
    );
    let second = serde_json::json!({
        "socket": path, "lines": [r#"{"argv": ["echo", "stolen"]}"#],
    });
    let out = fleet.toolctl(&["call", "a", "raw", &second.to_string()]);
    let stdout = text(&out.stdout);
    let answer: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|_| panic!("{stdout} {}", text(&out.stderr)));
    assert_eq!(answer["approved"], false, "{answer}");
    assert!(
        answer["reason"]
            .as_str()
            .unwrap()
            .contains("serves only the processes of call")
    );
    let out = finish_child(holder, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        !std::path::Path::new(&path).exists(),
        "the socket is removed after the call"
    );
    assert!(
        bypasses(&fleet).is_empty(),
        "nothing reached the coordinator"
    );
}

/// Nothing runs outside the sandbox that the audit log cannot record: a bypass the policy
/// allows, asked for while the log cannot be written, is denied by the coordinator, naming the
/// log, and the command never runs.
#[test]
fn a_bypass_the_audit_log_cannot_record_is_denied() {
    let fleet = fleet(&[]);
    let (mark, _) = mark_args(&fleet, "unrecorded.txt");
    let (caller, go) = started_waiter(&fleet, &mark);

    // The disk fills up; the next record (a call to a host nobody knows) cannot be written.
    fleet.point_audit_log_at(std::path::Path::new("/dev/full"));
    let out = fleet.toolctl(&["call", "nowhere", "bp_allow"]);
    assert!(!out.status.success());
    std::fs::write(&go, "").unwrap();
    let out = finish_child(caller, Duration::from_secs(60));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(stdout.contains("bypass exit=77"), "{stdout}{stderr}");
    assert!(stderr.contains("cannot write its audit log"), "{stderr}");
    assert!(
        !mark.exists(),
        "the command ran outside the sandbox unrecorded"
    );
    let log = fleet.coordinator.as_ref().unwrap().log();
    assert!(
        log.contains(r#"\"event\":\"bypass\""#) || log.contains(r#""event":"bypass""#),
        "the denial's record went to the coordinator's log: {log}"
    );
}

/// A bypass request is decided under the policy in force when it is decided, not the one its
/// call started under: one waiting for bob when a new policy denies such requests is denied at
/// once, and a call that started while its requests were allowed asks after the change and is
/// denied too. Neither command runs; both decisions are audited as the policy's.
#[test]
fn bypass_requests_follow_the_policy_put_in_force() {
    let fleet = fleet(&[]);
    let (asked_mark, asked_args) = mark_args(&fleet, "asked.txt");
    let mut asked = fleet.toolctl_command("client-alice", &["call", "a", "bp_bob", &asked_args]);
    asked.stdout(Stdio::piped()).stderr(Stdio::piped());
    let asked = asked.spawn().unwrap();
    pending_for_bob(&fleet);

    let (later_mark, _) = mark_args(&fleet, "later.txt");
    let (later, go) = started_waiter(&fleet, &later_mark);

    fleet.replace_policy(
        r#"{"default": "allow", "rules": [
            {"tools": ["bp_allow", "raw"], "effect": "allow", "bypass": "allow"},
            {"tools": ["bp_bob", "bp_wait"], "effect": "allow", "bypass": "deny"}]}"#,
        0o644,
    );
    let out = finish_child(asked, Duration::from_secs(30));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(stdout.contains("bypass exit=77"), "{stdout}{stderr}");
    assert!(
        stderr.contains(
            "the policy or host labels changed since the call was made: policy rule 1 denies bypass requests"
        ),
        "{stderr}"
    );
    std::fs::write(&go, "").unwrap();
    let out = finish_child(later, Duration::from_secs(60));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(stdout.contains("bypass exit=77"), "{stdout}{stderr}");
    assert!(
        stderr.contains("policy rule 1 denies bypass requests"),
        "{stderr}"
    );
    assert!(!asked_mark.exists() && !later_mark.exists());
    assert_eq!(
        bypasses(&fleet),
        [
            ("denied".into(), Some("policy".into())),
            ("denied".into(), Some("policy".into()))
        ]
    );
}
