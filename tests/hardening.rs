//! Attacks on the fleet by one client, one agent or one tool, each of which must leave
//! everyone else's calls, the links and the audit log intact.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use toolsrv_tests::{
    AgentSpec, Fleet, LineWatch, assert_exit, finish_child, json_lines, text, wait_for,
};

/// Starts `cmd` in its own process group with piped output.
fn spawn(mut cmd: Command) -> Child {
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    cmd.spawn().unwrap()
}

fn signal(child: &Child, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).unwrap();
}

fn host<'a>(hosts: &'a [Value], id: &str) -> &'a Value {
    hosts.iter().find(|h| h["host_id"] == id).unwrap()
}

/// A tool that marks a file, then sleeps: the mark says it is running.
fn marking_tool(fleet: &Fleet, name: &str, mark: &Path, secs: u32) {
    fleet.tool(
        &format!("{name}.meta"),
        &format!(
            r#"{{"description": "mark and sleep", "cmd": "touch {}; sleep {secs}; echo finished"}}"#,
            mark.display()
        ),
        false,
    );
}

#[test]
fn oversized_arguments_are_refused_and_leave_other_calls_and_the_link_alone() {
    let mut fleet = Fleet::new(&["a"]);
    let mark = fleet.marks().join("slow-running");
    marking_tool(&fleet, "slow", &mark, 2);
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "cat"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "echo");
    let connected = host(&fleet.hosts(), "a")["connected_unix_ms"].clone();

    let bob = spawn(fleet.toolctl_command("client-bob", &["call", "a", "slow"]));
    wait_for("bob's call to run", Duration::from_secs(20), || {
        mark.exists().then_some(())
    });
    // On stdin, toolctl reads no more than a call may carry and refuses the rest itself.
    for size in [5_000_000, 15_000_000] {
        let args = format!(r#"{{"x": "{}"}}"#, "a".repeat(size));
        let out = fleet.toolctl_as("client-alice", &["call", "a", "echo", "-"], Some(&args));
        assert_exit(
            &out,
            64,
            &["arguments on stdin are over the limit of 1048576 bytes"],
        );
    }
    // As words (each under the kernel's 128 KiB per argument), 1.1 MiB of them reach the
    // coordinator, which refuses them.
    let words: Vec<String> = (0..9)
        .map(|i| format!("k{i}={}", "a".repeat(127 * 1024)))
        .collect();
    let mut argv = vec!["call", "a", "echo"];
    argv.extend(words.iter().map(String::as_str));
    let out = fleet.toolctl_as("client-alice", &argv, None);
    assert_exit(&out, 64, &["1048576"]);
    assert!(
        !text(&out.stderr).contains("on stdin"),
        "{}",
        text(&out.stderr)
    );
    let bob = finish_child(bob, Duration::from_secs(30));
    assert!(bob.status.success(), "{}", text(&bob.stderr));
    assert_eq!(text(&bob.stdout).trim(), "finished");

    // Arguments under the limit still go through, and the link was never re-established.
    let args = format!(r#"{{"x": "{}"}}"#, "b".repeat(900_000));
    let out = fleet.toolctl_as("client-alice", &["call", "a", "echo", "-"], Some(&args));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(out.stdout.len(), args.len());
    assert_eq!(host(&fleet.hosts(), "a")["connected_unix_ms"], connected);

    // A key given twice, sent as it is by a client of the API (toolctl reads JSON into a
    // value and sends that): the coordinator would check the last value, and a tool's parser
    // may keep the first (C's cJSON does). Refused before any host sees it.
    let refused = toolsrv_tests::runtime().block_on(async {
        toolsrv_tests::api_client(&fleet, "client-alice")
            .await
            .call_to_end(toolsrv_client::CallRequest {
                host: "a".into(),
                tool: "echo".into(),
                args_json: r#"{"x": "/etc/shadow", "x": "/tmp/fine"}"#.into(),
                ..Default::default()
            })
            .await
            .unwrap_err()
    });
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    assert!(
        refused
            .to_string()
            .contains("the key \"x\" is given twice in one object"),
        "{refused}"
    );
}

#[test]
fn callers_that_vanish_mid_call_are_audited_and_so_are_refusals() {
    let mut fleet = Fleet::new(&["a", "b"]);
    let log = fleet.audit_log();
    let marks = fleet.work.path().join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    fleet.tool(
        "mark.meta",
        &format!(
            r#"{{"description": "mark and sleep", "args": {{"type": "object", "properties": {{"n": {{"type": "string"}}}}}},
                "cmd": "touch {}/$(jq -r .n)-$(hostname)-$$; sleep 30"}}"#,
            marks.display()
        ),
        false,
    );
    fleet.start_coordinator(&[&fleet.audit_arg()]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.start_agent("b", &AgentSpec::default());
    fleet.wait_online(&["a", "b"], "mark");
    let running = |n: &str, count: usize| {
        let prefix = format!("{n}-");
        wait_for(
            &format!("{count} tool(s) of call {n} to run"),
            Duration::from_secs(20),
            || {
                let seen = std::fs::read_dir(&marks)
                    .unwrap()
                    .filter(|e| {
                        e.as_ref()
                            .unwrap()
                            .file_name()
                            .to_string_lossy()
                            .starts_with(&prefix)
                    })
                    .count();
                (seen >= count).then_some(())
            },
        )
    };
    let records_for = |sha_of: &str| {
        let args = format!(r#"{{"n":"{sha_of}"}}"#);
        move |r: &&Value| r["tool"] == "mark" && r["args_sha256"] == sha256_hex(&args)
    };

    let cases = [
        ("kill", nix::sys::signal::Signal::SIGKILL),
        ("int", nix::sys::signal::Signal::SIGINT),
    ];
    for (n, sig) in cases {
        let args = format!(r#"{{"n":"{n}"}}"#);
        let caller = spawn(fleet.toolctl_command("client-alice", &["call", "a", "mark", &args]));
        running(n, 1);
        signal(&caller, sig);
        finish_child(caller, Duration::from_secs(20));
        let record = wait_for(
            &format!("the audit record of the call killed by {sig}"),
            Duration::from_secs(20),
            || json_lines(&log).iter().find(records_for(n)).cloned(),
        );
        assert_eq!(record["status"], "CALL_STATUS_CANCELLED", "{record}");
        assert_eq!(record["client"], "alice");
        assert_eq!(record["host"], "a");
    }

    // A killed fan-out: one record per host.
    let fanout =
        spawn(fleet.toolctl_command("client-alice", &["fanout", "a,b", "mark", r#"{"n":"fan"}"#]));
    running("fan", 2);
    signal(&fanout, nix::sys::signal::Signal::SIGKILL);
    finish_child(fanout, Duration::from_secs(20));
    wait_for(
        "an audit record for each host of the killed fan-out",
        Duration::from_secs(20),
        || {
            let records = json_lines(&log);
            let fan: Vec<_> = records.iter().filter(records_for("fan")).collect();
            (fan.len() == 2).then_some(())
        },
    );

    // Refused before routing: bad arguments, a bad selector, an unknown host.
    let out = fleet.toolctl(&["call", "a", "mark", r#"{"n": 1}"#]);
    assert_exit(&out, 65, &[]);
    let out = fleet.toolctl(&["fanout", "a b", "mark"]);
    assert_exit(&out, 64, &[]);
    let out = fleet.toolctl(&["call", "nowhere", "mark"]);
    assert_exit(&out, 127, &[]);
    let records = json_lines(&log);
    let statuses: Vec<(&str, &str)> = records
        .iter()
        .map(|r| (r["host"].as_str().unwrap(), r["status"].as_str().unwrap()))
        .collect();
    for expected in [
        ("a", "CALL_STATUS_INVALID_ARGS"),
        ("a b", "REFUSED"),
        ("nowhere", "CALL_STATUS_UNKNOWN_HOST"),
    ] {
        assert!(statuses.contains(&expected), "{expected:?} in {statuses:?}");
    }
    // Exactly one record per call: the two killed calls, two fan-out hosts, three refusals.
    assert_eq!(records.len(), 7, "{records:#?}");
}

fn sha256_hex(text: &str) -> String {
    toolsrv_registry::hex_sha256(text.as_bytes())
}

#[test]
fn a_host_cannot_relabel_itself_out_of_a_policy_rule() {
    let mut fleet = Fleet::new(&["db-1", "web-1"]);
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "echo hi"}"#,
        false,
    );
    let labels = fleet.work.path().join("host-labels.json");
    std::fs::write(&labels, r#"{"db-*": {"role": "db"}}"#).unwrap();
    let policy = fleet
        .policy_arg(r#"{"rules": [{"clients": ["alice"], "hosts": "role=db", "effect": "deny"}]}"#);
    fleet.start_coordinator(&[&format!("--host-labels={}", labels.display()), &policy]);
    let says = |role: &str| AgentSpec {
        labels: vec![("role".into(), role.into())],
        ..AgentSpec::default()
    };
    // db-1 claims to be a web host; web-1 claims to be a database.
    fleet.start_agent("db-1", &says("web"));
    fleet.start_agent("web-1", &says("db"));
    fleet.wait_online(&["db-1", "web-1"], "echo");

    let out = fleet.toolctl(&["call", "db-1", "echo"]);
    assert_exit(&out, 77, &["policy rule 0"]);
    let out = fleet.toolctl(&["call", "web-1", "echo"]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    let hosts = fleet.hosts();
    assert_eq!(host(&hosts, "db-1")["trusted_labels"]["role"], "db");
    assert_eq!(host(&hosts, "db-1")["labels"]["role"], "web");
    assert_eq!(
        host(&hosts, "web-1")["trusted_labels"],
        serde_json::json!({})
    );
}

#[test]
fn one_client_cannot_fill_a_host_and_others_are_served_at_once() {
    let mut fleet = Fleet::new(&["a"]);
    let marks = fleet.work.path().join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    fleet.tool(
        "slow.meta",
        &format!(
            r#"{{"description": "mark and sleep", "cmd": "touch {}/$$; sleep 5"}}"#,
            marks.display()
        ),
        false,
    );
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "echo hi"}"#,
        false,
    );
    fleet.start_coordinator(&[
        "--max-calls-per-client-host=2",
        "--max-calls-per-client=3",
        "--max-fanout-hosts=1",
        "--max-call-timeout-secs=60",
    ]);
    fleet.start_agent(
        "a",
        &AgentSpec {
            max_concurrent: Some(3),
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["a"], "echo");
    let callers: Vec<Child> = (0..2)
        .map(|_| spawn(fleet.toolctl_command("client-alice", &["call", "a", "slow"])))
        .collect();
    wait_for("alice's two calls to run", Duration::from_secs(20), || {
        (std::fs::read_dir(&marks).unwrap().count() >= 2).then_some(())
    });
    let out = fleet.toolctl(&["call", "a", "echo"]);
    assert_exit(&out, 75, &["max-calls-per-client-host"]);
    let started = Instant::now();
    let out = fleet.toolctl_as("client-bob", &["call", "a", "echo"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "bob's call did not wait for alice's calls ({:?})",
        started.elapsed()
    );

    // A fan-out wider than the limit, and a timeout over the maximum, are refused.
    let out = fleet.toolctl_as("client-bob", &["fanout", "a,ghost", "echo"], None);
    assert_exit(&out, 75, &["max-fanout-hosts"]);
    let out = fleet.toolctl_as("client-bob", &["call", "a", "echo", "--timeout=120"], None);
    assert_exit(&out, 64, &["max-call-timeout"]);

    for caller in callers {
        let out = finish_child(caller, Duration::from_secs(30));
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    // The slots came back.
    let out = fleet.toolctl(&["call", "a", "echo"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// Starts `fleet`'s coordinator with its audit log, and host `a` with a tool `echo`.
fn start_with_an_audit_log(fleet: &mut Fleet) {
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "echo hi"}"#,
        false,
    );
    fleet.start_coordinator(&[&fleet.audit_arg()]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "echo");
}

#[test]
fn sighup_reopens_the_audit_log_for_logrotate() {
    let mut fleet = Fleet::new(&["a"]);
    let log = fleet.audit_log();
    start_with_an_audit_log(&mut fleet);
    assert!(fleet.toolctl(&["call", "a", "echo"]).status.success());
    let rotated = fleet.work.path().join("audit.jsonl.1");
    std::fs::rename(&log, &rotated).unwrap();
    fleet.reopen_audit_log();
    assert!(fleet.toolctl(&["call", "a", "echo"]).status.success());
    assert_eq!(
        json_lines(&rotated).len(),
        1,
        "the first call stays in the rotated file"
    );
    assert_eq!(
        json_lines(&log).len(),
        1,
        "the second call goes to the new file"
    );
    // Each log the coordinator made is its user's and group's only.
    use std::os::unix::fs::PermissionsExt;
    for file in [&rotated, &log] {
        let mode = std::fs::metadata(file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640, "{}", file.display());
    }
}

/// A FIFO where a file is named (by mistake, or as another user's trap) is read, or refused,
/// without waiting for a writer: a plain `open` waited for one for good, and SIGTERM no longer
/// ended the process. The coordinator stops at once on one as its policy or its audit log; one
/// put in the audit log's place before a SIGHUP is refused (the old file is kept, calls go on,
/// SIGTERM ends the coordinator); `toolctl` says what is wrong with one as its CA or a profile.
#[test]
fn a_fifo_named_as_a_file_is_refused_without_waiting_for_a_writer() {
    let mut fleet = Fleet::new(&["a"]);
    let fifo = fleet.work.path().join("trap");
    toolsrv_testkit::mkfifo(&fifo);
    let shown = fifo.display().to_string();
    for flag in ["--policy", "--audit-log"] {
        let started = Instant::now();
        let err = fleet
            .try_start_coordinator(&[&format!("{flag}={shown}")])
            .unwrap_err()
            .to_string();
        assert!(started.elapsed() < Duration::from_secs(15), "{flag}: {err}");
        assert!(err.contains(&shown), "{flag}: {err}");
    }
    assert!(
        fleet
            .try_start_coordinator(&[&format!("--audit-log={shown}")])
            .unwrap_err()
            .to_string()
            .contains("is a FIFO or a socket")
    );

    start_with_an_audit_log(&mut fleet);
    let log = fleet.audit_log();
    std::fs::rename(&log, fleet.work.path().join("audit.jsonl.1")).unwrap();
    toolsrv_testkit::mkfifo(&log);
    let coordinator = fleet.coordinator.as_ref().unwrap();
    let pid = nix::unistd::Pid::from_raw(coordinator.pid());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    wait_for("the refused reopen", Duration::from_secs(20), || {
        coordinator
            .log()
            .contains("cannot reopen the audit log")
            .then_some(())
    });
    assert!(fleet.toolctl(&["call", "a", "echo"]).status.success());
    assert_eq!(
        json_lines(&fleet.work.path().join("audit.jsonl.1")).len(),
        1,
        "the call's record went to the file kept open"
    );

    // toolctl: the FIFO as its CA, and as a profile.
    let started = Instant::now();
    let out = fleet.toolctl_command("client-alice", &["hosts"]);
    let mut out = out;
    out.env("TOOLSRV_CA", &fifo);
    let out = toolsrv_tests::run_bounded(out, None, Duration::from_secs(60));
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains(&shown), "{}", text(&out.stderr));
    let out = fleet.toolctl(&["session", "open", "--profile", &shown]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains(&shown), "{}", text(&out.stderr));
    assert!(started.elapsed() < Duration::from_secs(20));

    // SIGTERM still ends the coordinator.
    let coordinator = fleet.coordinator.as_mut().unwrap();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    wait_for(
        "the coordinator to exit on SIGTERM",
        Duration::from_secs(20),
        || coordinator.child.try_wait().unwrap(),
    );
}

/// The audit log on a full disk (`/dev/full`, through a symlink): the call that finds it so
/// runs, its record going to the coordinator's log instead; every call and fan-out after it is
/// refused before reaching a host (exit 75, naming the log), and so says the metric. Once the
/// log takes records again (the symlink pointed at a file, then SIGHUP), the refusal that is
/// written lets the next call run.
#[test]
fn an_audit_log_that_cannot_be_written_stops_calls_until_it_can() {
    let mut fleet = Fleet::new(&["a"]);
    let work = fleet.work.path().to_path_buf();
    let log = fleet.audit_log();
    std::os::unix::fs::symlink("/dev/full", &log).unwrap();
    let mark = fleet.marks().join("ran");
    marking_tool(&fleet, "mark", &mark, 0);
    let state = format!("--state-dir={}", work.join("state").display());
    fleet.start_coordinator(&[
        &format!("--audit-log={}", log.display()),
        "--metrics-listen=127.0.0.1:0",
        "--admin=alice",
        &state,
    ]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "mark");
    let failing = || {
        fleet
            .coordinator
            .as_ref()
            .unwrap()
            .metric("toolsrv_audit_log_failing")
    };
    assert_eq!(failing().as_deref(), Some("0"));

    // The first call runs: nothing said the log was full before its record.
    let out = fleet.toolctl(&["call", "a", "mark"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(mark.exists());
    let coordinator_log = fleet.coordinator.as_ref().unwrap().log();
    assert!(
        coordinator_log.contains("cannot write the audit log")
            && coordinator_log.contains("logged here instead"),
        "{coordinator_log}"
    );
    assert_eq!(failing().as_deref(), Some("1"));

    // Then nothing runs, a call or a fan-out.
    std::fs::remove_file(&mark).unwrap();
    let refused = |args: &[&str]| {
        let out = fleet.toolctl(args);
        assert_exit(
            &out,
            75,
            &["cannot write its audit log", &log.display().to_string()],
        );
    };
    refused(&["call", "a", "mark"]);
    refused(&["fanout", "all", "mark"]);
    assert!(!mark.exists(), "a refused call reached the host");
    // A revocation shuts someone out and goes on; lifting one lets them in again and waits.
    let out = fleet.toolctl(&["revoke", "client/bob", "--reason", "laptop stolen"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    refused(&["unrevoke", "client/bob"]);
    assert_exit(
        &fleet.toolctl_as("client-bob", &["hosts"], None),
        77,
        &["revoked"],
    );

    // Room again: the log points at a file, the coordinator reopens it.
    let file = work.join("audit-after.jsonl");
    fleet.point_audit_log_at(&file);
    // The first call is refused still; its refusal is the record that shows the log works.
    refused(&["call", "a", "mark"]);
    assert_eq!(failing().as_deref(), Some("0"));
    let out = fleet.toolctl(&["call", "a", "mark"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(mark.exists());
    let records = json_lines(&file);
    assert_eq!(records.len(), 2, "{records:?}");
    assert_eq!(records[0]["event"], "refusal");
    assert_eq!(records[0]["code"], "Unavailable");
    assert_eq!(records[1]["event"], "call");
    assert_eq!(records[1]["status"], "CALL_STATUS_OK");
}

/// One client may hold `--max-watches-per-client` watch streams (catalog and session watches
/// alike); the next is refused at once (exit 75) naming the flag, also when the client marks it
/// as relayed by a replica; another client is not held back, and a watch whose client goes away
/// gives its slot back.
#[test]
fn watch_streams_per_client_are_bounded() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Greets", "cmd": "echo hi"}"#,
        false,
    );
    fleet.start_coordinator(&["--max-watches-per-client", "2"]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "hello");
    let watch = |who: &str| {
        let w = LineWatch::start(fleet.toolctl_command(who, &["watch", "--json"]));
        w.until("snapshot", |e| e["kind"] == "snapshot");
        w
    };
    let first = watch("client-alice");
    let _second = watch("client-alice");
    let out = fleet.toolctl(&["watch", "--json"]);
    assert_exit(
        &out,
        75,
        &["2 watch streams open", "--max-watches-per-client"],
    );
    // A session watch is a watch stream too.
    let profile = fleet.work.path().join("profile.json");
    std::fs::write(&profile, r#"{"autoLoad": ["hello"]}"#).unwrap();
    let out = fleet.toolctl(&["session", "open", "--profile", profile.to_str().unwrap()]);
    assert_exit(&out, 0, &[]);
    let id = text(&out.stdout).trim().to_string();
    let out = fleet.toolctl(&["session", "watch", &id]);
    assert_exit(&out, 75, &["--max-watches-per-client"]);
    // Alice claiming to be a replica relaying a watch (the header replicas mark relayed
    // requests with, which skip the slot the relaying replica already took) is still alice.
    let url = fleet.url();
    let files = toolsrv_testkit::stem_files(fleet.pki.root(), "client-alice");
    let refused = toolsrv_tests::runtime().block_on(async {
        let channel = toolsrv_tls::connect_reloading(&url, &files, toolsrv_tls::Role::Coordinator)
            .await
            .unwrap();
        let mut tools = toolsrv_proto::v1::tools_client::ToolsClient::new(channel);
        let mut request = tonic::Request::new(toolsrv_proto::v1::WatchCatalogRequest {});
        request
            .metadata_mut()
            .insert("toolsrv-relayed-by", "r9".parse().unwrap());
        tools.watch_catalog(request).await.err()
    });
    let refused = refused.expect("a third watch stream, relay header or not, is refused");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("--max-watches-per-client"),
        "{refused:?}"
    );
    // Bob is not held back by alice.
    let _bob = watch("client-bob");
    // Alice's first watch goes away: its slot comes back.
    drop(first);
    wait_for("alice's slot to come back", Duration::from_secs(20), || {
        let mut again = fleet.toolctl_command("client-alice", &["watch", "--json"]);
        // Still running after 2 s: admitted (and stopped here).
        toolsrv_tests::try_run_bounded(&mut again, None, Duration::from_secs(2))
            .is_err()
            .then_some(())
    });
}

/// Descriptors the process `pid` has open.
fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Sets the process's limit of open files (soft and hard) to `n`.
fn limit_fds(pid: i32, n: usize) {
    prlimit_nofile(pid, &format!("{n}:{n}"));
}

/// Sets the process's limits of open files as `prlimit --nofile=SOFT:HARD` does (either may be
/// left out).
fn prlimit_nofile(pid: i32, limits: &str) {
    let out = Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={limits}"))
        .output()
        .unwrap();
    assert!(out.status.success(), "prlimit: {}", text(&out.stderr));
}

/// The process's soft limit of open files.
fn soft_fd_limit(pid: i32) -> String {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    line.split_whitespace().nth(3).unwrap().to_string()
}

/// Sets the process's soft limit of open files to `soft`, leaving the hard one.
fn set_soft_fd_limit(pid: i32, soft: &str) {
    prlimit_nofile(pid, &format!("{soft}:"));
}

/// A process out of file descriptors (a flood of connections, a leak elsewhere) can open
/// neither a tools directory nor a `.meta`. Before, the agent's next recheck read its
/// directories as empty and reported a host with no tools, and the coordinator's next rescan
/// published an empty catalog, so every agent removed every shipped tool. Now a scan cut short
/// serves the last complete one, says why, and is tried again; once descriptors are back, the
/// edit made meanwhile is served.
#[test]
fn a_process_out_of_descriptors_keeps_serving_its_tools() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "shipped.meta",
        r#"{"description": "shipped", "cmd": "echo shipped"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent(
        "a",
        &AgentSpec::own_tools(&[("own", r#"{"description": "own", "cmd": "echo own"}"#)]),
    );
    fleet.wait_online(&["a"], "own");
    fleet.wait_online(&["a"], "shipped");
    let visible = |fleet: &Fleet| -> Vec<String> {
        let tools = fleet.tools("a").unwrap_or_default();
        let mut names: Vec<String> = tools
            .iter()
            .filter(|t| t["visible"] == true)
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect();
        names.sort();
        names
    };
    assert_eq!(visible(&fleet), ["own", "shipped"]);

    // The agent: no descriptor left for a few of its rechecks (one a second here). A limit of
    // 0 leaves the descriptors open as they are and lets no new one be opened.
    let agent_pid = fleet.agents["a"].pid();
    let soft = soft_fd_limit(agent_pid);
    set_soft_fd_limit(agent_pid, "0");
    // Four rechecks, whose views (were they empty) would have gone out by now.
    std::thread::sleep(Duration::from_secs(4));
    let during = visible(&fleet);
    set_soft_fd_limit(agent_pid, &soft);
    let agent = &fleet.agents["a"];
    assert_eq!(during, ["own", "shipped"], "{}", agent.log_tail(40));
    assert!(
        agent.log().contains("short of file descriptors"),
        "{}",
        agent.log_tail(40)
    );

    // The coordinator: a `.meta` edited while it has no descriptor to read it with.
    let coordinator_pid = fleet.coordinator.as_ref().unwrap().pid();
    let soft = soft_fd_limit(coordinator_pid);
    set_soft_fd_limit(coordinator_pid, "0");
    fleet.tool(
        "shipped.meta",
        r#"{"description": "shipped, edited", "cmd": "echo shipped"}"#,
        false,
    );
    // The edit is seen, and a rescan (one a second besides) tried, well within this.
    std::thread::sleep(Duration::from_secs(4));
    set_soft_fd_limit(coordinator_pid, &soft);
    let coordinator = fleet.coordinator.as_ref().unwrap();
    assert!(
        coordinator.log().contains("short of file descriptors"),
        "{}",
        coordinator.log_tail(40)
    );
    wait_for(
        "the edit to reach the host",
        Duration::from_secs(30),
        || {
            fleet
                .tools("a")?
                .iter()
                .any(|t| t["name"] == "shipped" && t["description"] == "shipped, edited")
                .then_some(())
        },
    );
    assert_eq!(visible(&fleet), ["own", "shipped"]);
    // No revision in between took a tool away.
    let coordinator_log = fleet.coordinator.as_ref().unwrap().log();
    let agent_log = fleet.agents["a"].log();
    for line in coordinator_log
        .lines()
        .filter(|l| l.contains("tool registry changed"))
    {
        assert!(line.contains("removed=[]"), "{line}");
    }
    for line in agent_log.lines().filter(|l| l.contains("catalog updated")) {
        assert!(!line.contains("tools=0"), "{line}");
    }
    assert_eq!(fleet.toolctl(&["call", "a", "own"]).status.code(), Some(0));
}

/// The plain-text ports (the coordinator's gRPC health and `/metrics`, an agent's `/metrics`)
/// answer whoever reaches them; a flood of idle connections from 40 addresses must not take the
/// descriptors the processes need for links, calls and clients. Before, each port kept every
/// connection it accepted: with the processes' limits a few hundred descriptors above what they
/// use, the coordinator could no longer accept the client's connection and the call failed.
#[test]
fn idle_connections_to_the_plain_text_ports_leave_the_processes_their_descriptors() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "echo still here"}"#,
        false,
    );
    fleet.start_coordinator(&[
        "--metrics-listen=127.0.0.1:0",
        "--health-listen=127.0.0.1:0",
    ]);
    fleet.start_agent(
        "a",
        &AgentSpec {
            args: vec!["--metrics-listen=127.0.0.1:0".into()],
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["a"], "echo");
    let coordinator = fleet.coordinator.as_ref().unwrap();
    let agent = &fleet.agents["a"];
    let ports: Vec<std::net::SocketAddr> = [
        coordinator.health_addr(),
        coordinator.metrics_addr(),
        agent.metrics_addr(),
    ]
    .iter()
    .map(|a| a.parse().unwrap())
    .collect();
    let (coordinator_pid, agent_pid) = (coordinator.pid(), agent.pid());
    // Room for the test's own connections and a call, not for a flood.
    let coordinator_before = open_fds(coordinator_pid);
    let agent_before = open_fds(agent_pid);
    limit_fds(coordinator_pid, coordinator_before + 700);
    limit_fds(agent_pid, agent_before + 400);

    let rt = toolsrv_tests::runtime();
    let flood = rt.block_on(async {
        let mut held = Vec::new();
        for port in &ports {
            // A port whose backlog is full (nothing accepted any more) stops taking connections:
            // a few unanswered attempts are enough to say so.
            let mut unanswered = 0;
            for host in 2..42u8 {
                for _ in 0..20 {
                    if unanswered == 5 {
                        break;
                    }
                    let socket = tokio::net::TcpSocket::new_v4().unwrap();
                    socket
                        .bind(std::net::SocketAddr::from(([127, 0, 0, host], 0)))
                        .unwrap();
                    match tokio::time::timeout(Duration::from_millis(500), socket.connect(*port))
                        .await
                    {
                        Ok(Ok(conn)) => held.push(conn),
                        _ => unanswered += 1,
                    }
                }
            }
        }
        // Let the servers accept (and close) what they will.
        tokio::time::sleep(Duration::from_secs(1)).await;
        held
    });
    assert!(flood.len() >= 3 * 256, "{} connections opened", flood.len());

    // 16 per address and 256 in all per port: the rest were closed.
    let coordinator_now = open_fds(coordinator_pid);
    let agent_now = open_fds(agent_pid);
    assert!(
        coordinator_now <= coordinator_before + 2 * 256 + 32,
        "the coordinator holds {coordinator_now} descriptors, {coordinator_before} before the flood"
    );
    assert!(
        agent_now <= agent_before + 256 + 32,
        "the agent holds {agent_now} descriptors, {agent_before} before the flood"
    );
    // Clients, links and calls still have their descriptors.
    let out = fleet.toolctl(&["call", "a", "echo"]);
    assert_exit(&out, 0, &[]);
    assert_eq!(text(&out.stdout).trim(), "still here");
    assert_eq!(host(&fleet.hosts(), "a")["state"], "online");

    // The flood gone, every port answers again.
    drop(flood);
    let coordinator = fleet.coordinator.as_ref().unwrap();
    for metrics in [coordinator.metrics_addr(), fleet.agents["a"].metrics_addr()] {
        let status = wait_for("/metrics to answer again", Duration::from_secs(10), || {
            toolsrv_tests::http_get(&metrics, "/metrics")
                .ok()
                .filter(|(status, _)| *status == 200)
        });
        assert_eq!(status.0, 200);
    }
    let health = coordinator.health_addr();
    let serving = rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let checked = async {
                let channel = tonic::transport::Endpoint::from_shared(format!("http://{health}"))
                    .unwrap()
                    .connect()
                    .await
                    .map_err(|e| e.to_string())?;
                tonic_health::pb::health_client::HealthClient::new(channel)
                    .check(tonic_health::pb::HealthCheckRequest::default())
                    .await
                    .map(|r| r.into_inner().status)
                    .map_err(|e| e.to_string())
            };
            match tokio::time::timeout(Duration::from_secs(3), checked).await {
                Ok(Ok(status)) => return status,
                other => assert!(
                    Instant::now() < deadline,
                    "health never answered: {other:?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    assert_eq!(
        serving,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

/// One client certificate holds at most `--max-requests-per-identity` requests open at once,
/// over all its connections: streams opened past it (headers, never a body) are refused at
/// once, other clients are served meanwhile, and the client is served again once its streams
/// are gone. Before, each such stream waited for its body for good, a few kilobytes each, with
/// no bound on how many one connection opened.
#[test]
fn one_client_cannot_hold_requests_open_without_end() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "cat"}"#,
        false,
    );
    let audit = fleet.audit_arg();
    fleet.start_coordinator(&["--max-requests-per-identity=50", &audit]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "echo");
    let alice = client_tls(&fleet, "alice");
    let rt = toolsrv_tests::runtime();
    let streams = rt.block_on(toolsrv_tests::open_bodiless_streams(
        fleet.port,
        alice,
        "/toolsrv.v1.Tools/ListHosts",
        500,
    ));
    assert_eq!((streams.taken, streams.refused), (50, 450), "{streams:?}");
    let answers: Vec<_> = streams.answers.iter().collect();
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(answers[0].0, "8", "RESOURCE_EXHAUSTED: {answers:?}");
    assert!(answers[0].1.contains("client/alice"), "{answers:?}");

    // Alice's next command is refused too, and says why; Bob is served.
    let out = fleet.toolctl(&["hosts"]);
    assert_exit(&out, 75, &["client/alice has 50 requests open"]);
    let out = fleet.toolctl_as("client-bob", &["call", "a", "echo", r#"{"x":1}"#], None);
    assert_exit(&out, 0, &[]);
    // The run's first refusal is recorded, the others are not; bob's call is.
    let records = fleet.audit_records();
    let refusals: Vec<&Value> = records.iter().filter(|r| r["event"] == "refusal").collect();
    assert_eq!(refusals.len(), 1, "{records:?}");
    assert_eq!(refusals[0]["client"], "alice");
    assert_eq!(refusals[0]["rpc"], "/toolsrv.v1.Tools/ListHosts");
    assert!(
        records
            .iter()
            .any(|r| r["event"] == "call" && r["client"] == "bob"),
        "{records:?}"
    );

    // Her streams gone with their connection, she is served again.
    drop(streams);
    wait_for("alice to be served again", Duration::from_secs(10), || {
        fleet.toolctl(&["hosts"]).status.success().then_some(())
    });
}

/// An answer keeps its request's place, and its bytes in the client's budget, until it has
/// left, not merely until the coordinator queued it. A client whose streams give the
/// coordinator a window of one byte and read nothing holds at most `--max-requests-per-identity`
/// requests and `--max-buffered-bytes-per-identity` bytes of answers: past them, requests are
/// refused and answers cut short with `RESOURCE_EXHAUSTED`, other clients are served, small
/// answers to the same client still go, and once its streams are gone it is served again.
/// Before, each answer was queued whole in the HTTP/2 send buffer and its request counted as
/// ended: 1,000 unread answers of 1.25 MB held the coordinator at 1.3 GB, and no request limit
/// applied to them.
#[test]
fn answers_nobody_reads_are_held_to_the_limits() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "cat"}"#,
        false,
    );
    // One page of ListTools holds about 1 MiB of these.
    long_tools(&mut fleet, 20, 2_000);
    let audit = fleet.audit_arg();
    fleet.start_coordinator(&[
        "--max-requests-per-identity=50",
        "--max-buffered-bytes-per-identity=32M",
        &audit,
    ]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "long19");
    let alice = client_tls(&fleet, "alice");
    let rt = toolsrv_tests::runtime();

    // Small answers: each keeps its request's place while it waits.
    let unread = rt.block_on(toolsrv_tests::open_unread_answers(
        fleet.port,
        alice.clone(),
        "/toolsrv.v1.Tools/ListHosts",
        &[],
        60,
        1,
        Duration::from_secs(3),
    ));
    assert_eq!(unread.waiting, 50, "{unread:?}");
    assert_eq!(unread.ended.len(), 10, "{unread:?}");
    for (status, message) in &unread.ended {
        assert_eq!(status, "8", "RESOURCE_EXHAUSTED: {unread:?}");
        assert!(message.contains("50%20requests%20open"), "{message}");
    }
    let out = fleet.toolctl(&["hosts"]);
    assert_exit(&out, 75, &["client/alice has 50 requests open"]);
    drop(unread);
    wait_for("alice to be served again", Duration::from_secs(10), || {
        fleet.toolctl(&["hosts"]).status.success().then_some(())
    });

    // Large answers: held to 32 MiB, the rest cut short.
    let host_a = [0x0a, 0x01, b'a'];
    let unread = rt.block_on(toolsrv_tests::open_unread_answers(
        fleet.port,
        alice,
        "/toolsrv.v1.Tools/ListTools",
        &host_a,
        45,
        1,
        Duration::from_secs(3),
    ));
    assert!(
        (20..=34).contains(&unread.waiting) && unread.waiting + unread.ended.len() == 45,
        "{unread:?}"
    );
    for (status, message) in &unread.ended {
        assert_eq!(status, "8", "RESOURCE_EXHAUSTED: {unread:?}");
        assert!(
            message.contains("would%20pass%20the%20most%20it%20may%20hold%20(32.0%20MiB)"),
            "{message}"
        );
    }
    // Alice's next large answer is cut short too, and says why; her small ones go; Bob is served.
    let out = fleet.toolctl(&["tools", "a"]);
    assert_exit(
        &out,
        75,
        &["of answers this coordinator cannot send until it reads them"],
    );
    assert_exit(&fleet.toolctl(&["hosts"]), 0, &[]);
    let out = fleet.toolctl_as("client-bob", &["tools", "a"], None);
    assert_exit(&out, 0, &[]);
    assert!(text(&out.stdout).contains("long19"), "{out:?}");
    // The run's first cut is recorded, once.
    let cut = cut_short_records(&fleet);
    assert_eq!(cut.len(), 1, "{cut:?}");
    assert_eq!(cut[0]["client"], "alice");
    assert_eq!(cut[0]["rpc"], "/toolsrv.v1.Tools/ListTools");

    // Her streams gone with their connection, her large answers go again.
    drop(unread);
    wait_for(
        "alice's large answers to go again",
        Duration::from_secs(10),
        || {
            fleet
                .toolctl(&["tools", "a"])
                .status
                .success()
                .then_some(())
        },
    );
}

/// Answers HTTP/2 has taken to send, that wait in its buffers because the peer opened the
/// largest windows and then stopped reading its socket, stay in the asker's budget
/// (`--max-buffered-bytes-per-identity`) until the connection has written them: 300 answers of
/// about 300 KB hold at most the budget, and the rest are cut short. Before, an answer under
/// HTTP/2's send buffer of 400 KiB left the budget as soon as it was queued, and one connection
/// pinned about 410 MB. A peer that then cancels the answers queued for it (their data is
/// dropped, never written) is not held back afterwards on that connection.
#[test]
fn answers_queued_for_a_peer_that_stops_reading_its_socket_are_held_to_the_budget() {
    let mut fleet = Fleet::new(&["a"]);
    // One page of ListTools holds about 300 KB of these.
    long_tools(&mut fleet, 5, 1_800);
    let audit = fleet.audit_arg();
    fleet.start_coordinator(&["--max-buffered-bytes-per-identity=32M", &audit]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "long04");
    let alice = client_tls(&fleet, "alice");
    let rt = toolsrv_tests::runtime();
    let host_a = [0x0a, 0x01, b'a'];
    let list_tools = "/toolsrv.v1.Tools/ListTools";
    let cuts = |fleet: &Fleet| cut_short_records(fleet).len();

    let mut peer = rt.block_on(toolsrv_tests::StalledPeer::connect(
        fleet.port,
        alice.clone(),
    ));
    peer.stop_reading();
    rt.block_on(peer.request(list_tools, &host_a, 300));
    wait_for(
        "the budget to cut answers short",
        Duration::from_secs(30),
        || (cuts(&fleet) == 1).then_some(()),
    );
    // Bob is served meanwhile.
    let out = fleet.toolctl_as("client-bob", &["tools", "a"], None);
    assert_exit(&out, 0, &[]);
    peer.read_again();
    let outcomes = rt.block_on(peer.outcomes(Duration::from_secs(60)));
    assert_eq!(outcomes.whole + outcomes.ended.len(), 300, "{outcomes:?}");
    eprintln!("{} of 300 answers read whole", outcomes.whole);
    // 32 MiB of answers of 300 KB, and what the sockets' buffers took.
    assert!(
        (60..=200).contains(&outcomes.whole),
        "{} read whole: {outcomes:?}",
        outcomes.whole
    );
    for (status, message) in &outcomes.ended {
        assert_eq!(status, "8", "RESOURCE_EXHAUSTED: {outcomes:?}");
        assert!(
            message.contains("would%20pass%20the%20most%20it%20may%20hold%20(32.0%20MiB)"),
            "{message}"
        );
    }
    // Written, they are given back.
    wait_for("alice to be served again", Duration::from_secs(10), || {
        fleet
            .toolctl(&["tools", "a"])
            .status
            .success()
            .then_some(())
    });

    // The same again, then the peer cancels them all: their queued data is dropped, never
    // written. What it held is let go once the connection's writes have not waited on the peer
    // for a while, though the connection stays open: another connection of alice's is served
    // whole (30 answers, 9 MB, more than the sockets' buffers took).
    peer.stop_reading();
    rt.block_on(peer.request(list_tools, &host_a, 300));
    wait_for(
        "the budget to cut answers short again",
        Duration::from_secs(30),
        || (cuts(&fleet) == 2).then_some(()),
    );
    // Every request answered (HTTP/2 ends a connection whose peer resets many streams the server
    // has not taken yet), then all cancelled; the resets reach the coordinator while its writes
    // still wait.
    std::thread::sleep(Duration::from_secs(1));
    peer.reset_all();
    std::thread::sleep(Duration::from_millis(500));
    peer.read_again();
    std::thread::sleep(toolsrv_tls::IDLE_RELEASE + Duration::from_secs(3));
    let mut other = rt.block_on(toolsrv_tests::StalledPeer::connect(fleet.port, alice));
    rt.block_on(other.request(list_tools, &host_a, 30));
    let outcomes = rt.block_on(other.outcomes(Duration::from_secs(60)));
    assert_eq!(outcomes.whole, 30, "{outcomes:?}");
    drop(peer);
}

/// A message that is still arriving holds its bytes in the client's budget
/// (`--max-buffered-bytes-per-identity`) until it is whole: requests that announce messages of
/// 12 MiB, send 10 MiB of each and never the rest hold at most the budget, the one that would
/// pass it is ended with `RESOURCE_EXHAUSTED`, and other clients are served. Before, each such
/// request held its 10 MiB with no bound but the request limit (1,024 requests: 10 GiB) and no
/// timeout.
#[test]
fn messages_that_never_end_are_held_to_the_budget() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "cat"}"#,
        false,
    );
    fleet.start_coordinator(&["--max-buffered-bytes-per-identity=32M"]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "echo");
    let mut sent = toolsrv_tests::grpc_prefix(12 << 20).to_vec();
    sent.resize(5 + (10 << 20), b'x');
    let rt = toolsrv_tests::runtime();
    let streams = rt.block_on(toolsrv_tests::open_unfinished_streams(
        fleet.port,
        client_tls(&fleet, "alice"),
        "/toolsrv.v1.Tools/ListHosts",
        bytes::Bytes::from(sent),
        6,
        Duration::from_secs(10),
    ));
    assert!(
        streams.taken <= 3 && streams.refused >= 3 && streams.taken + streams.refused == 6,
        "{streams:?}"
    );
    for (status, message) in &streams.answers {
        assert_eq!(status, "8", "RESOURCE_EXHAUSTED: {streams:?}");
        assert!(message.contains("still%20arriving"), "{message}");
    }
    let out = fleet.toolctl_as("client-bob", &["call", "a", "echo", r#"{"x":1}"#], None);
    assert_exit(&out, 0, &[]);
    drop(streams);
}

/// The TLS settings of client `name`'s certificate, for a raw HTTP/2 client.
/// `count` tools `long00`, `long01`, ... whose prompts are a sentence `repeat` times (33 bytes
/// each): the pages of `ListTools` that answers nobody reads are made of.
fn long_tools(fleet: &mut Fleet, count: usize, repeat: usize) {
    let prompt = "the answer of this tool is long. ".repeat(repeat);
    for i in 0..count {
        fleet.tool(
            &format!("long{i:02}.meta"),
            &serde_json::json!({"description": "a tool with a long prompt", "prompt": prompt, "cmd": "true"})
                .to_string(),
            false,
        );
    }
}

/// The audit records of refusals that say answers past the budget are cut short.
fn cut_short_records(fleet: &Fleet) -> Vec<Value> {
    fleet
        .audit_records()
        .into_iter()
        .filter(|r| {
            r["event"] == "refusal" && r["message"].as_str().unwrap_or("").contains("cut short")
        })
        .collect()
}

fn client_tls(fleet: &Fleet, name: &str) -> std::sync::Arc<tokio_rustls::rustls::ClientConfig> {
    toolsrv_tls::client_config(
        &fleet.pki.files(&toolsrv_tls::Identity::Client(name.into())),
        toolsrv_tls::Role::Coordinator,
    )
    .unwrap()
}

/// Whoever can write the audit log can change or erase its records. A log another user made
/// first (in a directory every user may write: `/tmp`, an emptyDir), one every user may write,
/// or a symbolic link another user left at its name (which would lead the records into a file
/// of the link's choosing) stops the coordinator at start, naming it and the fix, and nothing is
/// written through the link.
#[test]
fn an_audit_log_another_user_could_rewrite_is_not_written() {
    use std::os::unix::fs::PermissionsExt;
    let fleet = Fleet::new(&["a"]);
    let dir = fleet.work.path();
    let start = |log: &Path| {
        let mut cmd = Command::new(toolsrv_tests::bin("toolsrv"));
        cmd.arg("coordinator")
            .args(fleet.pki.tls_args("coordinator"))
            .arg("--listen=127.0.0.1:0")
            .arg(format!("--tools={}", dir.join("tools").display()))
            .arg(format!("--audit-log={}", log.display()));
        toolsrv_tests::run_bounded(cmd, None, Duration::from_secs(30))
    };
    let refused = |log: &Path, needles: &[&str]| {
        let out = start(log);
        assert!(!out.status.success(), "{log:?} was used: {out:?}");
        let err = text(&out.stderr);
        assert!(
            err.contains(&format!("audit log {}", log.display())),
            "{err}"
        );
        for needle in needles {
            assert!(err.contains(needle), "no {needle:?} in {err}");
        }
    };

    let open = dir.join("open.jsonl");
    std::fs::write(&open, "").unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
    refused(
        &open,
        &[
            "writable by every user of this machine (mode 0666)",
            &format!("chmod o-w {}", open.display()),
        ],
    );

    let theirs = dir.join("theirs.jsonl");
    std::fs::write(&theirs, "").unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    refused(&theirs, &["owned by uid 65534", "chown 0"]);

    let victim = dir.join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    let link = dir.join("link.jsonl");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).unwrap();
    refused(&link, &["owned by uid 65534"]);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
}
