//! A real fleet on loopback: a coordinator and agents as separate processes, each agent with its
//! own PATH, environment and state, driven through `toolctl` as a user would.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use toolsrv_tests::{
    AgentSpec, Fleet, Proc, assert_exit, bin, line_starting, run_bounded, text, wait_for,
};

fn script(body: &str) -> String {
    format!("#!/bin/sh\n{body}\n")
}

/// The entry of `tool` in a `tools --all --json` listing.
fn entry<'a>(tools: &'a [Value], tool: &str) -> &'a Value {
    tools
        .iter()
        .find(|t| t["name"] == tool)
        .unwrap_or_else(|| panic!("no {tool} in {tools:?}"))
}

/// Three hosts that differ by PATH and environment.
fn three_hosts() -> Fleet {
    let mut fleet = Fleet::new(&["a", "b", "c", "d"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello from $(hostname) && cat"}"#,
        false,
    );
    fleet.tool(
        "logs.meta",
        r#"{"description": "Read logs", "variants": [
            {"match": {"binary": "journalctl-fake"}, "description": "journald logs", "cmd": "journalctl-fake"},
            {"match": {"env": "SYSLOG_FILE"}, "description": "syslog file", "cmd": "echo syslog at $SYSLOG_FILE"}]}"#,
        false,
    );
    fleet.tool("gpu.meta", r#"{"description": "GPU", "variants": [{"match": {"binary": "nvidia-smi"}, "cmd": "nvidia-smi"}]}"#, false);
    fleet.tool("local_only.meta", r#"{"description": "Not over SSH", "variants": [{"match": {"nenv": "SSH_CONNECTION"}, "cmd": "echo local"}]}"#, false);
    fleet.start_coordinator(&[]);
    let a = AgentSpec {
        binaries: vec![("journalctl-fake".into(), script("echo journald on a"))],
        labels: vec![("role".into(), "web".into())],
        ..AgentSpec::default()
    };
    let b = AgentSpec {
        binaries: vec![("nvidia-smi".into(), script("echo GPU 0: fake"))],
        env: vec![("SYSLOG_FILE".into(), "/var/log/syslog".into())],
        labels: vec![("role".into(), "db".into())],
        // Variants see the agent's whole environment; a confined tool sees only the allowlist,
        // so the variable its command uses is passed on by configuration.
        args: vec!["--sandbox-env=SYSLOG_FILE".into()],
        ..AgentSpec::default()
    };
    let c = AgentSpec {
        env: vec![("SSH_CONNECTION".into(), "10.0.0.1 22 10.0.0.2 22".into())],
        labels: vec![("role".into(), "web".into())],
        ..AgentSpec::default()
    };
    fleet.start_agent("a", &a);
    fleet.start_agent("b", &b);
    fleet.start_agent("c", &c);
    fleet.wait_online(&["a", "b", "c"], "hello");
    fleet
}

#[test]
fn hosts_see_different_tools_and_variants() {
    let fleet = three_hosts();
    let (a, b, c) = (
        fleet.tools("a").unwrap(),
        fleet.tools("b").unwrap(),
        fleet.tools("c").unwrap(),
    );
    assert_eq!(entry(&a, "logs")["variant"], 0);
    assert_eq!(entry(&a, "logs")["description"], "journald logs");
    assert_eq!(entry(&b, "logs")["variant"], 1);
    assert_eq!(entry(&b, "logs")["description"], "syslog file");
    assert_eq!(entry(&c, "logs")["visible"], false);
    assert!(
        entry(&c, "logs")["reason"]
            .as_str()
            .unwrap()
            .contains("journalctl-fake")
    );
    assert_eq!(entry(&a, "gpu")["visible"], false);
    assert_eq!(entry(&b, "gpu")["visible"], true);
    assert_eq!(entry(&c, "local_only")["visible"], false);
    assert_eq!(entry(&a, "local_only")["visible"], true);

    // Each host runs its own variant.
    let out = fleet.toolctl(&["call", "a", "logs"]);
    assert_eq!(
        text(&out.stdout),
        "journald on a\n",
        "{}",
        text(&out.stderr)
    );
    let out = fleet.toolctl(&["call", "b", "logs"]);
    assert_eq!(text(&out.stdout), "syslog at /var/log/syslog\n");
    let out = fleet.toolctl(&["call", "c", "logs"]);
    assert_eq!(out.status.code(), Some(69), "hidden: {}", text(&out.stderr));

    // Describe prints the resolved definition of that host's variant.
    let out = fleet.toolctl(&["describe", "b", "logs"]);
    let def: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(def["description"], "syslog file");

    // hosts lists facts and labels.
    let hosts = fleet.hosts();
    let b = hosts.iter().find(|h| h["host_id"] == "b").unwrap();
    assert_eq!(b["state"], "online");
    assert_eq!(b["labels"]["role"], "db");
    assert_eq!(b["os"], "linux");
}

#[test]
fn calls_stream_output_live_and_pass_arguments() {
    let fleet = three_hosts();
    fleet.tool("slowprint.meta", r#"{"description": "Two lines, slowly", "cmd": "echo first; sleep 2; echo second >&2; echo third"}"#, false);
    fleet.tool(
        "args.meta",
        r#"{"description": "Echo args", "cmd": "cat; echo; pwd",
            "args": {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}}"#,
        false,
    );
    fleet.wait_online(&["a"], "slowprint");
    fleet.wait_online(&["a"], "args");

    let out = fleet.toolctl(&["call", "a", "args", r#"{"n": 5}"#, "--cwd", "/tmp"]);
    assert_eq!(
        text(&out.stdout),
        "{\"n\":5}\n\n/tmp\n",
        "{}",
        text(&out.stderr)
    );
    let out = fleet.toolctl(&["call", "a", "args", r#"{"n": "five"}"#]);
    assert_exit(&out, 65, &["/n"]);
    // KEY:=JSON and KEY=VALUE words; a string where the tool wants a number is refused with a
    // note saying how to write it, by `call` and once by `fanout`.
    let out = fleet.toolctl(&["call", "a", "args", "n:=6", "--cwd", "/tmp"]);
    assert_eq!(
        text(&out.stdout),
        "{\"n\":6}\n\n/tmp\n",
        "{}",
        text(&out.stderr)
    );
    let note = "note: `n=...` passes a string; write `n:=VALUE`";
    let out = fleet.toolctl(&["call", "a", "args", "n=6"]);
    assert_eq!(
        assert_exit(&out, 65, &["/n", note]).matches(note).count(),
        1
    );
    let out = fleet.toolctl(&["fanout", "role=web", "args", "n=6"]);
    assert_eq!(assert_exit(&out, 1, &[note]).matches(note).count(), 1);
    assert_eq!(text(&out.stdout).matches("invalid_args").count(), 2);
    let out = fleet.toolctl(&["fanout", "role=web", "args", "n:=6"]);
    assert_exit(&out, 0, &[]);
    assert_eq!(
        text(&out.stdout).matches("{\"n\":6}").count(),
        2,
        "{}",
        text(&out.stdout)
    );

    let mut child = fleet
        .toolctl_command("client-alice", &["call", "a", "slowprint"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "first");
    let first_at = start.elapsed();
    assert_eq!(lines.next().unwrap().unwrap(), "third");
    let done_at = start.elapsed();
    let status = child.wait().unwrap();
    assert!(status.success());
    assert!(
        done_at - first_at > Duration::from_millis(1500),
        "first line came {first_at:?}, end {done_at:?}: not streamed"
    );
}

/// Ports are picked free, then released: should another process take the fleet's port before
/// the coordinator binds it, the coordinator starts on another, and no test talks to the
/// stranger (a connection that succeeds is not enough: the listener must be the coordinator's).
#[test]
fn a_coordinator_whose_port_was_taken_meanwhile_starts_on_another() {
    let mut fleet = Fleet::new(&["a"]);
    let taken = fleet.port;
    let _stranger = std::net::TcpListener::bind(("127.0.0.1", taken)).unwrap();
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    assert_ne!(fleet.port, taken);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "hello");
    let out = fleet.toolctl(&["call", "a", "hello"]);
    assert_eq!(text(&out.stdout), "hello\n", "{}", text(&out.stderr));
}

/// What bash completes after `words` (the last one being typed), through the script
/// `TOOLCTL_COMPLETE=bash toolctl` prints, with `env` on top of alice's settings: every candidate, in order.
fn bash_completes(fleet: &Fleet, words: &[&str], env: &[(&str, &str)]) -> Vec<String> {
    let base = fleet.toolctl_command("client-alice", &[]);
    let toolctl = base.get_program().to_string_lossy().into_owned();
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let script = format!(
        "source <(TOOLCTL_COMPLETE=bash '{toolctl}')\n\
         COMP_WORDS=('{toolctl}' {})\nCOMP_CWORD={}\nCOMP_TYPE=9\n\
         _clap_complete_toolctl toolctl \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"\n\
         printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        quoted.join(" "),
        words.len()
    );
    let mut cmd = std::process::Command::new("bash");
    cmd.arg("-c").arg(script);
    for (key, value) in base.get_envs() {
        if let Some(value) = value {
            cmd.env(key, value);
        }
    }
    // A variable as generic as clap's usual one, set for something else, changes nothing.
    cmd.env("COMPLETE", "1").envs(env.iter().copied());
    let out = run_bounded(cmd, None, Duration::from_secs(20));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stderr),
        "",
        "completion prints nothing but candidates"
    );
    text(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// Shell completion asks the coordinator: host ids after `call`, the tools that host offers
/// after `call HOST`, the tool's arguments after `call HOST TOOL`, `all` and hosts for a selector; an unreachable coordinator completes no
/// host, quietly and within seconds.
#[test]
fn bash_completes_hosts_and_the_tools_each_host_offers() {
    let fleet = three_hosts();
    let hosts: Vec<String> = bash_completes(&fleet, &["call", ""], &[])
        .into_iter()
        .filter(|c| !c.starts_with("--"))
        .collect();
    assert_eq!(hosts, ["a", "b", "c"]);
    assert_eq!(
        bash_completes(&fleet, &["describe", "b", "g"], &[]),
        ["gpu"]
    );
    // A hides `gpu` (no nvidia-smi there); options typed before the host are skipped.
    let on_a = bash_completes(&fleet, &["call", "--timeout", "5", "a", ""], &[]);
    assert!(on_a.contains(&"hello".to_string()) && on_a.contains(&"logs".to_string()));
    assert!(!on_a.contains(&"gpu".to_string()), "{on_a:?}");
    // A tool's arguments, from its schema as the host resolves it.
    fleet.tool(
        "args.meta",
        r#"{"description": "Echo args", "cmd": "cat",
            "args": {"type": "object", "required": ["n"], "properties": {
                "n": {"type": "integer", "description": "How many"},
                "mode": {"type": "string", "enum": ["fast", "slow"]}}}}"#,
        false,
    );
    fleet.wait_online(&["a"], "args");
    let words = |typed: &[&str]| -> Vec<String> {
        bash_completes(&fleet, typed, &[])
            .into_iter()
            .filter(|c| !c.starts_with("--"))
            .collect()
    };
    assert_eq!(words(&["call", "a", "args", ""]), ["n:=", "mode="]);
    assert_eq!(words(&["call", "a", "args", "n:=3", ""]), ["mode="]);
    assert_eq!(
        words(&["call", "a", "args", "mode="]),
        ["mode=fast", "mode=slow"]
    );
    // A session's ids, the tools its hosts offer that it has not loaded, and those it has.
    let out = fleet.toolctl(&["session", "open"]);
    let id = text(&out.stdout).trim().to_string();
    assert_eq!(words(&["session", "show", &id[..4]]), [id.as_str()]);
    assert!(
        fleet
            .toolctl(&["session", "load", &id, "hello"])
            .status
            .success()
    );
    assert_eq!(words(&["session", "load", &id, "g"]), ["gpu"]);
    assert_eq!(words(&["session", "load", &id, "h"]), Vec::<String>::new());
    assert_eq!(words(&["session", "unload", &id, ""]), ["hello"]);
    // For a fan-out, the tools of the host a selector names, or of every online host.
    assert_eq!(words(&["fanout", "b", "g"]), ["gpu"]);
    assert_eq!(words(&["fanout", "a", "g"]), Vec::<String>::new());
    assert_eq!(words(&["fanout", "role=web", "g"]), ["gpu"]);
    assert_eq!(words(&["fanout", "all", "args", "mode=f"]), ["mode=fast"]);
    let selectors = bash_completes(&fleet, &["fanout", ""], &[]);
    assert_eq!(&selectors[..4], ["all", "a", "b", "c"], "{selectors:?}");
    assert_eq!(bash_completes(&fleet, &["call", "b"], &[]), ["b"]);
    let closed = format!("https://127.0.0.1:{}", toolsrv_tests::free_port());
    let start = Instant::now();
    let none = bash_completes(&fleet, &["call", ""], &[("TOOLSRV_ADDR", &closed)]);
    assert!(none.iter().all(|c| c.starts_with("--")), "{none:?}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn fan_out_reports_every_host_even_offline_and_lost() {
    let mut fleet = three_hosts();
    fleet.tool(
        "sleepy.meta",
        r#"{"description": "Sleeps", "cmd": "echo start; sleep 4; echo done"}"#,
        false,
    );
    fleet.start_agent("d", &AgentSpec::default());
    fleet.wait_online(&["a", "b", "c", "d"], "sleepy");
    // d goes offline.
    fleet.agents.get_mut("d").unwrap().terminate();
    fleet.wait_state("d", "offline", Duration::from_secs(15));

    let mut fanout = fleet
        .toolctl_command("client-alice", &["fanout", "all", "sleepy", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let mut events = Vec::new();
    let mut lines = BufReader::new(fanout.stdout.take().unwrap()).lines();
    // b vanishes (SIGKILL, no goodbye) once it has started.
    for line in lines.by_ref() {
        let event: Value = serde_json::from_str(&line.unwrap()).unwrap();
        let b_started = event["host"] == "b" && event["type"] == "stdout";
        events.push(event);
        if b_started {
            fleet.agents.get_mut("b").unwrap().kill();
            break;
        }
    }
    for line in lines {
        events.push(serde_json::from_str(&line.unwrap()).unwrap());
    }
    let status = fanout.wait().unwrap();
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(20),
        "fan-out took {elapsed:?}"
    );
    assert_eq!(status.code(), Some(1), "not every host was ok");
    let result = |host: &str| {
        events
            .iter()
            .find(|e| e["type"] == "result" && e["host"] == host)
            .unwrap_or_else(|| panic!("no result for {host} in {events:#?}"))
    };
    assert_eq!(result("a")["status"], "ok");
    assert_eq!(result("c")["status"], "ok");
    assert_eq!(result("b")["status"], "lost");
    assert_eq!(result("d")["status"], "offline");
    let summary = events
        .iter()
        .find(|e| e["type"] == "summary")
        .expect("a summary");
    assert_eq!(summary["targeted"], 4);
    assert_eq!(summary["ok"], 2);
    assert_eq!(summary["failed"], 2);

    // A selector by label picks the web hosts only; a host named outright but unknown is reported.
    let out = fleet.toolctl(&["fanout", "role=web", "hello", "--json"]);
    let results: Vec<Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["type"] == "result")
        .collect();
    let hosts: Vec<&str> = results
        .iter()
        .map(|e| e["host"].as_str().unwrap())
        .collect();
    assert_eq!(hosts.len(), 2, "{results:?}");
    assert!(hosts.contains(&"a") && hosts.contains(&"c"));
    let out = fleet.toolctl(&["fanout", "a,ghost", "hello", "--json"]);
    assert!(
        text(&out.stdout).contains("unknown_host"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn catalog_changes_reach_agents_and_watchers_and_survive_a_coordinator_restart() {
    let mut fleet = three_hosts();
    let mut watch = fleet
        .toolctl_command("client-alice", &["watch", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = watch.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    std::thread::sleep(Duration::from_millis(500));

    // A new tool with a co-located executable: shipped, cached and run on every host.
    fleet.tool(
        "shipped.meta",
        r#"{"description": "Ships with an executable"}"#,
        false,
    );
    fleet.tool(
        "shipped",
        "#!/bin/sh\necho \"shipped-ok in $OLLIE_TOOLS_PATH\"\n",
        true,
    );
    fleet.wait_online(&["a", "b", "c"], "shipped");
    for host in ["a", "b", "c"] {
        let out = fleet.toolctl(&["call", host, "shipped"]);
        let stdout = text(&out.stdout);
        assert!(
            stdout.starts_with("shipped-ok in "),
            "{host}: {stdout} {}",
            text(&out.stderr)
        );
        assert!(
            stdout.contains(&format!("host-{host}")),
            "{host} runs its own cached copy: {stdout}"
        );
    }
    let registry_event = wait_for(
        "a registry event on the watch",
        Duration::from_secs(10),
        || {
            rx.try_iter()
                .find(|line| line.to_lowercase().contains("registry"))
        },
    );
    assert!(registry_event.contains("revision"), "{registry_event}");

    // A changed tool reaches every agent.
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello, v2", "cmd": "echo v2"}"#,
        false,
    );
    for host in ["a", "b", "c"] {
        wait_for(
            &format!("{host} to see hello v2"),
            Duration::from_secs(15),
            || {
                fleet
                    .tools(host)
                    .filter(|t| entry(t, "hello")["description"] == "Say hello, v2")
            },
        );
    }

    // A `toolctl master` holding a connection across the restart.
    let socket = fleet.work.path().join("master.sock");
    let mut cmd = fleet.toolctl_command("client-alice", &["master", "--control"]);
    cmd.arg(&socket);
    let mut master = Proc::spawn("toolctl-master", cmd, fleet.work.path());
    wait_for("the master's socket", Duration::from_secs(10), || {
        socket.exists().then_some(())
    });
    let via_master = |args: &[&str]| {
        let mut cmd = std::process::Command::new(bin("toolctl"));
        cmd.args(args).env("TOOLSRV_CONTROL", &socket);
        run_bounded(cmd, None, Duration::from_secs(30))
    };
    let out = via_master(&["call", "c", "hello"]);
    assert_eq!(text(&out.stdout), "v2\n", "{}", text(&out.stderr));

    // Restart the coordinator: agents come back by themselves with the catalog intact.
    fleet.coordinator.as_mut().unwrap().kill();
    let out = via_master(&["hosts"]);
    assert_eq!(
        out.status.code(),
        Some(75),
        "the master answers at once while the coordinator is gone: {}",
        text(&out.stderr)
    );
    fleet.start_coordinator(&[]);
    fleet.wait_online(&["a", "b", "c"], "shipped");
    let out = fleet.toolctl(&["call", "c", "hello"]);
    assert_eq!(text(&out.stdout), "v2\n", "{}", text(&out.stderr));
    // The master reconnected by itself.
    let out = via_master(&["call", "a", "hello"]);
    assert_eq!(text(&out.stdout), "v2\n", "{}", text(&out.stderr));
    master.terminate().expect("the master stops on SIGTERM");
    assert!(!socket.exists(), "and removes its socket");
    let _ = watch.kill();
    let _ = watch.wait();
}

#[test]
fn host_changes_are_reported_without_a_catalog_change() {
    let fleet = three_hosts();
    fleet.tool("late.meta", r#"{"description": "Needs late-tool", "variants": [{"match": {"binary": "late-tool"}, "cmd": "late-tool"}]}"#, false);
    fleet.wait_online(&["a"], "late");
    assert_eq!(entry(&fleet.tools("a").unwrap(), "late")["visible"], false);
    let installed = Instant::now();
    toolsrv_tests::write_file(
        &fleet.agent_bin("a").join("late-tool"),
        &script("echo late"),
        true,
    );
    wait_for(
        "late to become visible on a",
        Duration::from_secs(10),
        || {
            fleet
                .tools("a")
                .filter(|t| entry(t, "late")["visible"] == true)
        },
    );
    eprintln!("host change reported after {:?}", installed.elapsed());
    let out = fleet.toolctl(&["call", "a", "late"]);
    assert_eq!(text(&out.stdout), "late\n");
    assert_eq!(
        entry(&fleet.tools("b").unwrap(), "late")["visible"],
        false,
        "b has no late-tool"
    );
}

#[test]
fn a_client_cancel_kills_the_process_on_the_agent() {
    let fleet = three_hosts();
    let pid_file = fleet.marks().join("hang.pid");
    fleet.tool(
        "hang.meta",
        &format!(
            r#"{{"description": "Hangs", "cmd": "sh -c 'echo $$ > {}; exec sleep 120' & wait"}}"#,
            pid_file.display()
        ),
        false,
    );
    fleet.wait_online(&["a"], "hang");
    let mut call = fleet
        .toolctl_command("client-alice", &["call", "a", "hang"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid: i32 = wait_for("the tool to start", Duration::from_secs(15), || {
        std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
    });
    assert!(alive(pid));
    // The client goes away abruptly: the coordinator notices and the agent kills the process group.
    call.kill().unwrap();
    call.wait().unwrap();
    wait_for("the tool's process to die", Duration::from_secs(10), || {
        (!alive(pid)).then_some(())
    });
    let hosts = fleet.hosts();
    let a = hosts.iter().find(|h| h["host_id"] == "a").unwrap();
    wait_for("no call in flight on a", Duration::from_secs(10), || {
        let hosts = fleet.hosts();
        let a = hosts.iter().find(|h| h["host_id"] == "a").cloned().unwrap();
        (a["calls_in_flight"] == 0).then_some(())
    });
    assert_eq!(a["state"], "online");
}

/// Alive and not a zombie.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn a_frozen_host_is_detected_as_lost_within_seconds_and_comes_back() {
    // SIGSTOP freezes the agent without closing its connection: no FIN, no RST, as when a
    // host drops off the network. Only keepalives can tell.
    let fleet = three_hosts();
    fleet.tool(
        "sleepy.meta",
        r#"{"description": "Sleeps", "cmd": "echo start; sleep 30"}"#,
        false,
    );
    fleet.wait_online(&["a"], "sleepy");
    let mut call = fleet
        .toolctl_command("client-alice", &["call", "a", "sleepy"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(call.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "start");
    let agent = nix::unistd::Pid::from_raw(fleet.agents["a"].pid());
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let frozen = Instant::now();
    let out = wait_for("the call to end", Duration::from_secs(15), || {
        call.try_wait().unwrap()
    });
    let detected = frozen.elapsed();
    assert!(detected < Duration::from_secs(5), "lost after {detected:?}");
    assert_eq!(out.code(), Some(75), "lost maps to 75");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut call.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("lost"), "{stderr}");
    assert!(
        fleet
            .hosts()
            .iter()
            .any(|h| h["host_id"] == "a" && h["state"] == "offline")
    );

    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGCONT).unwrap();
    fleet.wait_state("a", "online", Duration::from_secs(30));
    let out = fleet.toolctl(&["call", "a", "hello"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn host_only_tools_and_the_concurrency_limit() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    fleet.tool(
        "hold.meta",
        r#"{"description": "Holds a slot", "cmd": "sleep 2; echo held"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    let spec = AgentSpec {
        local_tools: vec![
            (
                "mine.meta".into(),
                r#"{"description": "Only here"}"#.into(),
                false,
            ),
            (
                "mine".into(),
                script("echo from the host-only directory"),
                true,
            ),
            // Same name as a shipped tool: the shipped one wins, the local one is reported shadowed.
            (
                "hello.meta".into(),
                r#"{"description": "Local hello", "cmd": "echo local"}"#.into(),
                false,
            ),
        ],
        max_concurrent: Some(1),
        ..AgentSpec::default()
    };
    fleet.start_agent("a", &spec);
    fleet.wait_online(&["a"], "mine");
    let out = fleet.toolctl(&["call", "a", "mine"]);
    assert_eq!(
        text(&out.stdout),
        "from the host-only directory\n",
        "{}",
        text(&out.stderr)
    );
    let out = fleet.toolctl(&["call", "a", "hello"]);
    assert_eq!(
        text(&out.stdout),
        "hello\n",
        "the shipped tool wins a name clash"
    );
    // The host's own tool is listed as such; a shipped one says what the catalog says.
    let out = fleet.toolctl(&["tools", "a"]);
    let listing = text(&out.stdout);
    let line = |name: &str| line_starting(&listing, name);
    assert!(line("mine").ends_with("Only here [host-only]"), "{listing}");
    assert!(line("hello").ends_with("Say hello"), "{listing}");
    let out = fleet.toolctl(&["tools", "a", "--json"]);
    let tools: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let own: Vec<&str> = tools
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["host_only"] == true)
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(own, ["mine"]);

    // With one slot, two 2-second calls run one after the other.
    let spawn = |fleet: &Fleet| {
        fleet
            .toolctl_command("client-alice", &["call", "a", "hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let started = Instant::now();
    let (first, second) = (spawn(&fleet), spawn(&fleet));
    let (first, second) = (
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    );
    assert_eq!(
        (text(&first.stdout), text(&second.stdout)),
        ("held\n".into(), "held\n".into())
    );
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(3900),
        "two calls through one slot took only {elapsed:?}"
    );
}

#[test]
fn a_host_only_tool_is_marked_wherever_it_is_offered_and_cannot_write_to_the_terminal() {
    // A careless (or hostile) host's own tool whose description clears the screen and reverses
    // the text after it: tables show it escaped, and every place that offers it to a person or
    // a model (tools, find, sessions) says it is the host's word.
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "disk_usage.meta",
        r#"{"description": "Disk usage of a directory", "cmd": "echo used"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    let spec = AgentSpec::own_tools(&[
        (
            "rotate_keys",
            r#"{"description": "Rotate keys \u001b[2J\u202eedoc ruoy", "prompt": "Rotate the keys.", "cmd": "echo rotated"}"#.to_string(),
        ),
        (
            "wipe_cache",
            r#"{"description": "Wipe the package cache", "cmd": "echo wiped"}"#.to_string(),
        ),
        // As large as a `.meta` may be: the coordinator's bound on a host-only tool's
        // definition (against a compromised agent) must let it through.
        (
            "big_doc",
            format!(
                r#"{{"description": "Large documentation", "cmd": "true", "prompt": "{}"}}"#,
                "p".repeat(256 * 1024 - 80)
            ),
        ),
    ]);
    fleet.start_agent("a", &spec);
    fleet.wait_online(&["a"], "rotate_keys");

    let listing = text(&fleet.toolctl(&["tools", "a"]).stdout);
    let line = line_starting(&listing, "rotate_keys");
    assert!(
        line.ends_with(r"Rotate keys \u{1b}[2J\u{202e}edoc ruoy [host-only]"),
        "{listing}"
    );
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("big_doc") && l.ends_with("Large documentation [host-only]")),
        "{listing}"
    );

    // describe prints the definition as it is, and says on stderr whose word it is.
    let out = fleet.toolctl(&["describe", "a", "rotate_keys"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let described: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(described["name"], "rotate_keys");
    assert!(
        text(&out.stderr).contains("`rotate_keys` is host `a`'s own tool, not the catalog's"),
        "{}",
        text(&out.stderr)
    );
    let out = fleet.toolctl(&["describe", "a", "disk_usage"]);
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{}",
        text(&out.stderr)
    );

    let out = fleet.toolctl(&["find", "all", "rotate keys"]);
    let table = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let row = table
        .lines()
        .find(|l| l.contains("rotate_keys"))
        .unwrap_or_else(|| panic!("rotate_keys in {table}"));
    assert!(row.contains("rotate_keys [host-only]"), "{table}");
    let out = fleet.toolctl(&["find", "all", "rotate keys disk usage", "--json"]);
    let found: Value = serde_json::from_slice(&out.stdout).unwrap();
    let marks: Vec<(&str, bool)> = found
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["name"].as_str().unwrap(), m["host_only"] == true))
        .collect();
    assert!(marks.contains(&("rotate_keys", true)), "{found}");
    assert!(marks.contains(&("disk_usage", false)), "{found}");

    let profile = fleet.work.path().join("both.json");
    std::fs::write(
        &profile,
        r#"{"autoLoad": ["rotate_keys", "disk_usage"], "hosts": "a"}"#,
    )
    .unwrap();
    let out = fleet.toolctl(&["session", "open", "--profile", profile.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let id = text(&out.stdout).trim().to_string();
    let shown = text(&fleet.toolctl(&["session", "show", &id]).stdout);
    assert!(shown.contains("rotate_keys [host-only]"), "{shown}");
    assert!(!shown.contains("disk_usage [host-only]"), "{shown}");
    let out = fleet.toolctl(&["session", "show", &id, "--json"]);
    let state: Value = serde_json::from_slice(&out.stdout).unwrap();
    let marks: Vec<(&str, bool)> = state["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["name"].as_str().unwrap(), t["hostOnly"] == true))
        .collect();
    assert_eq!(marks, [("rotate_keys", true), ("disk_usage", false)]);
    // A host-only tool loads by name as a shipped one does (what `tool_search` finds, a model
    // loads); a name no host offers and the catalog lacks is refused, saying both.
    let out = fleet.toolctl(&["session", "load", &id, "wipe_cache"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&fleet.toolctl(&["session", "show", &id]).stdout);
    assert!(shown.contains("wipe_cache [host-only]"), "{shown}");
    let out = fleet.toolctl(&["session", "load", &id, "no_such_tool"]);
    assert_exit(
        &out,
        127,
        &["not in the catalog, and no host of the session offers it as its own"],
    );

    // What the coordinator says back quotes what it was given: escaped on the terminal too.
    let out = fleet.toolctl(&["find", "a,\u{1b}[2J\u{202e}", "rotate keys"]);
    let said = text(&out.stderr);
    assert!(
        !out.status.success() && said.contains(r"\u{1b}[2J\u{202e}"),
        "{said:?}"
    );
    let out = fleet.toolctl(&["call", "a", "no\u{1b}[2Jpe"]);
    let refused = text(&out.stderr);
    assert!(
        !out.status.success() && refused.contains(r"no\u{1b}[2Jpe"),
        "{refused:?}"
    );
    // Nothing the host wrote reached the terminal as a control or direction character.
    for out in [&listing, &table, &shown, &said, &refused] {
        assert!(
            !out.contains('\u{1b}') && !out.contains('\u{202e}'),
            "{out:?}"
        );
    }
}

/// A coordinator that refuses host-only tools: a session that names one says why it has none,
/// in the coordinator's words, and cannot load it.
#[test]
fn a_session_says_why_a_refused_host_only_tool_is_unavailable() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "disk_usage.meta",
        r#"{"description": "Disk usage", "cmd": "echo used"}"#,
        false,
    );
    fleet.start_coordinator(&["--refuse-host-only-tools"]);
    let spec = AgentSpec::own_tools(&[("wipe", r#"{"description": "Wipe", "cmd": "echo wiped"}"#)]);
    fleet.start_agent("a", &spec);
    fleet.wait_online(&["a"], "disk_usage");
    wait_for("the refused tool listed", Duration::from_secs(20), || {
        let out = fleet.toolctl(&["tools", "a", "--all"]);
        text(&out.stdout).contains("wipe").then_some(())
    });
    let profile = fleet.work.path().join("wipe.json");
    std::fs::write(&profile, r#"{"autoLoad": ["wipe"], "hosts": "a"}"#).unwrap();
    let out = fleet.toolctl(&["session", "open", "--profile", profile.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let id = text(&out.stdout).trim().to_string();
    let out = fleet.toolctl(&["session", "show", &id, "--json"]);
    let state: Value = serde_json::from_slice(&out.stdout).unwrap();
    let why = state["tools"][0]["unavailable"]
        .as_str()
        .unwrap_or_default();
    assert!(
        why.starts_with("hidden on a: host-only tools are refused by this coordinator"),
        "{state}"
    );
    // A session that has not loaded it cannot (one that has keeps the name, as above).
    let out = fleet.toolctl(&["session", "open", "--hosts", "a"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let other = text(&out.stdout).trim().to_string();
    let out = fleet.toolctl(&["session", "load", &other, "wipe"]);
    assert_exit(&out, 69, &["hidden on a: host-only tools are refused"]);
}

/// A host with more tools of its own than the coordinator keeps of one host
/// (`--max-host-only-tools`): the first by name are offered, the others listed hidden (a call to
/// one is refused, saying why), the shipped tool is untouched, and the coordinator's log says so.
#[test]
fn a_host_offers_at_most_max_host_only_tools_of_its_own() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "disk_usage.meta",
        r#"{"description": "Disk usage", "cmd": "echo used"}"#,
        false,
    );
    fleet.start_coordinator(&["--max-host-only-tools", "2"]);
    let own: Vec<(&str, String)> = ["own_e", "own_d", "own_c", "own_b", "own_a"]
        .into_iter()
        .map(|n| {
            (
                n,
                format!(r#"{{"description": "Tool {n}", "cmd": "echo {n}"}}"#),
            )
        })
        .collect();
    fleet.start_agent("a", &AgentSpec::own_tools(&own));
    fleet.wait_online(&["a"], "disk_usage");
    let listed = wait_for(
        "the host's own tools listed",
        Duration::from_secs(20),
        || {
            let out = fleet.toolctl(&["tools", "a", "--all", "--json"]);
            let tools: Value = serde_json::from_slice(&out.stdout).ok()?;
            let names: Vec<String> = tools
                .as_array()?
                .iter()
                .filter_map(|t| t["name"].as_str().map(String::from))
                .collect();
            names.iter().any(|n| n.starts_with("own_")).then_some(names)
        },
    );
    assert_eq!(
        listed,
        ["disk_usage", "own_a", "own_b", "own_c", "own_d", "own_e"]
    );
    let out = fleet.toolctl(&["tools", "a"]);
    let offered = text(&out.stdout);
    assert!(
        offered.contains("own_b") && !offered.contains("own_c"),
        "{offered}"
    );
    let out = fleet.toolctl(&["call", "a", "own_a"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "own_a");
    let out = fleet.toolctl(&["call", "a", "own_e"]);
    assert_exit(
        &out,
        69,
        &[
            "the host offers 5 tools of its own, more than this coordinator keeps of one host \
           (--max-host-only-tools 2): only the first 2 by name are offered",
        ],
    );
    let log = fleet.coordinator.as_ref().unwrap().log();
    assert!(
        log.contains(
            "5 tools of its own offered, more than this coordinator keeps of one host \
             (--max-host-only-tools 2)"
        ),
        "{log}"
    );
}

#[test]
fn keepalives_are_spaced_as_the_fleet_grows_and_a_frozen_host_is_still_lost() {
    // At most 2 keepalives a second each way: 1 or 2 links get 1 s, 3 links 2 s (whole
    // seconds); --lost-after-ms grows with the interval (600 ms at 200 ms: three intervals).
    let mut fleet = Fleet::new(&["p1", "p2", "p3"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    fleet.start_coordinator(&[
        "--keepalive-ms=200",
        "--lost-after-ms=600",
        "--max-keepalive-rate=2",
    ]);
    fleet.start_agent("p1", &AgentSpec::default());
    fleet.wait_online(&["p1"], "hello");
    assert!(
        fleet.agents["p1"].log().contains("keepalive=1s"),
        "{}",
        fleet.agents["p1"].log()
    );
    for id in ["p2", "p3"] {
        fleet.start_agent(id, &AgentSpec::default());
    }
    fleet.wait_online(&["p1", "p2", "p3"], "hello");
    wait_for(
        "p1 told to keep alive every 2 s",
        Duration::from_secs(10),
        || {
            fleet.agents["p1"]
                .log()
                .contains("changed the keepalive interval keepalive=2s")
                .then_some(())
        },
    );
    // Links at the slower pace stay up: nobody is lost for being quieter.
    std::thread::sleep(Duration::from_secs(5));
    let coordinator = fleet.coordinator.as_ref().unwrap().log();
    assert!(!coordinator.contains("nothing heard"), "{coordinator}");

    // The fleet shrinks: the pace comes back down.
    fleet.agents.remove("p2");
    fleet.agents.remove("p3");
    wait_for(
        "p1 told to keep alive every 1 s",
        Duration::from_secs(10),
        || {
            fleet.agents["p1"]
                .log()
                .contains("changed the keepalive interval keepalive=1s")
                .then_some(())
        },
    );

    // A frozen host is lost within its scaled silence (3 s) and a tick.
    let agent = nix::unistd::Pid::from_raw(fleet.agents["p1"].pid());
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let frozen = Instant::now();
    fleet.wait_state("p1", "offline", Duration::from_secs(15));
    let detected = frozen.elapsed();
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGCONT).unwrap();
    assert!(detected < Duration::from_secs(8), "lost after {detected:?}");
}

/// Starts the coordinator, then agent `slow` behind a slow [`toolsrv_tests::TcpLink`], and waits until its view
/// of `tools` tools, all visible, is in.
fn start_slow_host(fleet: &mut Fleet, up: Option<usize>, down: Option<usize>, tools: usize) {
    fleet.start_coordinator(&[]);
    let proxy = toolsrv_tests::TcpLink::start(fleet.port, up, down).port;
    fleet.agent_coordinators = Some(format!("https://127.0.0.1:{proxy}"));
    fleet.start_agent("slow", &AgentSpec::default());
    let started = Instant::now();
    wait_for("the slow host's view", Duration::from_secs(60), || {
        let listed = fleet.tools("slow")?;
        (listed.len() == tools && listed.iter().all(|t| t["visible"] == true)).then_some(())
    });
    eprintln!("view in after {:?}", started.elapsed());
}

#[test]
fn a_view_that_takes_longer_than_lost_after_to_arrive_does_not_lose_its_host() {
    // 300 tools with 4 KiB prompts: a view of 1.2 MB, its first part a whole megabyte, through
    // an uplink of 160 KiB/s: 7 s, with the agent's keepalives queued behind it, where
    // --lost-after-ms is 3 s. The bytes arriving are the agent alive.
    let mut fleet = Fleet::new(&["slow"]);
    let prompt = "p".repeat(4096);
    for i in 0..300 {
        fleet.tool(
            &format!("tool_{i:03}.meta"),
            &format!(r#"{{"description": "Tool {i}", "prompt": "{prompt}", "cmd": "echo {i}"}}"#),
            false,
        );
    }
    start_slow_host(&mut fleet, Some(160 << 10), None, 300);
    let coordinator = fleet.coordinator.as_ref().unwrap().log();
    assert!(!coordinator.contains("nothing heard"), "{coordinator}");
    let out = fleet.toolctl(&["call", "slow", "tool_299"]);
    assert_exit(&out, 0, &[]);
    assert_eq!(text(&out.stdout), "299\n");
}

#[test]
fn a_catalog_message_that_takes_longer_than_the_silence_allowed_does_not_lose_the_coordinator() {
    // A .meta of 200 KiB goes out whole (catalog messages are ~16 KiB unless one .meta is
    // larger), through a downlink of 40 KiB/s: 5 s, with the coordinator's keepalives queued
    // behind it, where the agent allows 3 s of silence (three 1 s intervals).
    let mut fleet = Fleet::new(&["slow"]);
    let prompt = "p".repeat(200 << 10);
    fleet.tool(
        "big.meta",
        &format!(r#"{{"description": "A tool with a long prompt", "prompt": "{prompt}", "cmd": "echo big"}}"#),
        false,
    );
    fleet.tool(
        "small.meta",
        r#"{"description": "A small tool", "cmd": "echo small"}"#,
        false,
    );
    start_slow_host(&mut fleet, None, Some(40 << 10), 2);
    let agent = fleet.agents["slow"].log();
    assert!(!agent.contains("nothing heard"), "{agent}");
    let out = fleet.toolctl(&["call", "slow", "big"]);
    assert_exit(&out, 0, &[]);
    assert_eq!(text(&out.stdout), "big\n");
}

/// An agent whose environment holds bytes that are not UTF-8 (in a variable's value, in
/// another's name) starts, takes the variable as set for `env` matches, and runs calls: it
/// used to panic before connecting (`std::env::vars`).
#[test]
fn an_environment_that_is_not_utf8_is_no_panic() {
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;
    let mut fleet = Fleet::new(&["odd"]);
    fleet.tool(
        "odd.meta",
        r#"{"description": "Odd", "variants": [{"match": {"env": "ODD_VALUE"}, "cmd": "echo odd is set"}]}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent(
        "odd",
        &AgentSpec {
            env_os: vec![
                ("ODD_VALUE".into(), OsString::from_vec(b"caf\xe9".to_vec())),
                (OsString::from_vec(b"NAME_\xff".to_vec()), "x".into()),
            ],
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["odd"], "odd");
    let out = fleet.toolctl(&["call", "odd", "odd"]);
    assert_exit(&out, 0, &[]);
    assert_eq!(text(&out.stdout).trim(), "odd is set");
}

/// A tool on a host reads its arguments as the client wrote them (on one line): the coordinator
/// and the agent pass the text on, rather than a value parsed and written again.
#[test]
fn a_tool_on_a_host_reads_its_arguments_as_written() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "echo.meta",
        r#"{"description": "Its input", "cmd": "cat"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "echo");
    let whole = "{\"n\": 12345678901234567890123, \"f\": 1.10, \"s\": \"caf\\u00e9\"}";
    let out = fleet.toolctl(&["call", "a", "echo", whole]);
    assert_exit(&out, 0, &[]);
    assert_eq!(
        text(&out.stdout),
        "{\"n\":12345678901234567890123,\"f\":1.10,\"s\":\"caf\\u00e9\"}\n"
    );
}

/// A coordinator whose tools directory's name is not UTF-8 serves it (clap refused the flag:
/// "invalid UTF-8 was detected").
#[test]
fn a_tools_path_that_is_not_utf8_is_served() {
    use std::os::unix::ffi::OsStrExt;
    let mut fleet = Fleet::new(&["a"]);
    let odd = fleet
        .work
        .path()
        .join(std::ffi::OsStr::from_bytes(b"tools-\xff"));
    std::fs::create_dir(&odd).unwrap();
    fleet.tools = odd;
    fleet.tool(
        "hi.meta",
        r#"{"description": "Says hi", "cmd": "echo hi"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "hi");
    let out = fleet.toolctl(&["call", "a", "hi"]);
    assert_exit(&out, 0, &[]);
    assert_eq!(text(&out.stdout), "hi\n");
}
