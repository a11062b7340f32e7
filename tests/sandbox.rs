//! Confinement of calls on real agents: each claim proven by a tool that tries to break it
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use toolsrv_tests::{AgentSpec, Fleet, bin, text, wait_for};

fn host<'a>(hosts: &'a [Value], id: &str) -> &'a Value {
    hosts.iter().find(|h| h["host_id"] == id).unwrap()
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

/// The value of `key=` on a line of `out`.
fn field(out: &str, key: &str) -> Option<String> {
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")).map(str::to_owned))
}

/// Reads the key and state of its own agent, writes inside and outside its directories, and
/// prints its environment.
const PROBE: &str = r#"#!/bin/sh
try() { if eval "$2" >/dev/null 2>&1; then echo "$1=yes"; else echo "$1=no"; fi; }
try read_key "cat \"$KEY\""
try list_state "ls \"$STATE\""
try read_blobs "ls \"$STATE/blobs\""
try read_sibling "cat \"$SIBLING\""
try read_catalog "cat \"$OLLIE_TOOLS_PATH/probe.meta\""
try write_pwd "echo x > \"$PWD/f\""
try write_tmpdir "echo x > \"$TMPDIR/f\""
try write_home "echo x > \"$HOME/g\""
try write_outside "echo x > \"$OUTSIDE\""
try write_tmp "echo x > /tmp/toolsrv-sandbox-test-$$"
echo "uid=$(id -u)"
env | sed 's/^/env:/'
"#;

#[test]
fn a_confined_tool_cannot_reach_the_agents_files_nor_write_outside_nor_see_its_environment() {
    let mut fleet = Fleet::new(&["a"]);
    let key = fleet.pki.path("agent-a-key.pem");
    let state = fleet.work.path().join("host-a/state");
    let sibling = fleet.work.path().join("readable.txt");
    std::fs::write(&sibling, "public").unwrap();
    let outside = fleet.work.path().join("outside.txt");
    // The arguments name what to try; the probe is a shipped executable, run from the catalog.
    fleet.tool(
        "probe.meta",
        r#"{"description": "tries the sandbox"}"#,
        false,
    );
    fleet.tool("probe", PROBE, true);
    fleet.start_coordinator(&[]);
    // The whole of /tmp, which holds the PKI and the agent's state, is granted for reading: the
    // agent's files must be carved out of it (as /etc/toolsrv would be out of /etc).
    fleet.start_agent(
        "a",
        &AgentSpec {
            env: vec![
                ("SECRET_TOKEN".into(), "hunter2".into()),
                ("OLLIE_BYPASS_SOCKET".into(), "/forged.sock".into()),
                ("KEY".into(), key.display().to_string()),
                ("STATE".into(), state.display().to_string()),
                ("SIBLING".into(), sibling.display().to_string()),
                ("OUTSIDE".into(), outside.display().to_string()),
            ],
            args: vec![
                "--sandbox-read=/tmp".into(),
                "--sandbox-env=KEY,STATE,SIBLING,OUTSIDE".into(),
            ],
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["a"], "probe");
    let out = fleet.toolctl(&["call", "a", "probe"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout} {}", text(&out.stderr));
    for (what, want) in [
        ("read_key", "no"),
        ("list_state", "no"),
        ("read_blobs", "no"),
        ("read_sibling", "yes"),
        ("read_catalog", "yes"),
        ("write_pwd", "yes"),
        ("write_tmpdir", "yes"),
        ("write_home", "yes"),
        ("write_outside", "no"),
        ("write_tmp", "no"),
    ] {
        assert_eq!(
            field(&stdout, what).as_deref(),
            Some(want),
            "{what}: {stdout}"
        );
    }
    assert!(!outside.exists());
    let env: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("env:"))
        .collect();
    assert!(!stdout.contains("hunter2"), "{stdout}");
    assert!(!stdout.contains("/forged.sock"), "{stdout}");
    let var = |name: &str| {
        env.iter()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("{name} in {env:?}"))
    };
    assert!(var("PATH").contains("/usr/bin"));
    assert!(var("OLLIE_TOOLS_PATH").ends_with("host-a/state/catalog"));
    let pwd = var("PWD");
    assert_eq!(var("TMPDIR"), pwd);
    assert_eq!(var("HOME"), pwd);
    // Removed right after the outcome is sent (the clean-up does not hold up the caller).
    wait_for(
        "the call's private directory to be removed after the call",
        Duration::from_secs(10),
        || (!Path::new(pwd).exists()).then_some(()),
    );

    // What the host enforces is in its facts and selects it.
    let hosts = fleet.hosts();
    let sandbox = &host(&hosts, "a")["sandbox"];
    eprintln!("sandbox facts of a: {sandbox}");
    assert_eq!(sandbox["level"], "enforced", "{sandbox}");
    assert_eq!(sandbox["mode"], "best-effort");
    assert!(sandbox["landlock_abi"].as_u64().unwrap() >= 1);
    let out = fleet.toolctl(&["fanout", "sandbox=enforced", "probe", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn nothing_a_call_starts_outlives_it_setsid_and_double_forked_daemons_included() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "daemons.meta",
        r#"{"description": "leaves daemons behind",
            "cmd": "setsid sh -c 'echo setsid=$$; exec sleep 300 </dev/null >/dev/null 2>&1' & sh -c 'sleep 301 </dev/null >/dev/null 2>&1 & echo double=$!'; sleep 0.3; echo done"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "daemons");
    let out = fleet.toolctl(&["call", "a", "daemons"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout} {}", text(&out.stderr));
    let setsid: i32 = field(&stdout, "setsid").unwrap().parse().unwrap();
    let double: i32 = field(&stdout, "double").unwrap().parse().unwrap();
    // Gone by the time the caller has the result: no waiting.
    assert!(
        !alive(setsid),
        "the setsid daemon {setsid} outlived its call"
    );
    assert!(
        !alive(double),
        "the double-forked daemon {double} outlived its call"
    );
}

/// The calls' warden started by agent `agent`: its pid, and its process group.
fn warden_of(agent: i32) -> Option<(i32, i32)> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
            let (ppid, pgid): (i32, i32) =
                (fields.get(1)?.parse().ok()?, fields.get(2)?.parse().ok()?);
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let arg0 = cmdline.split(|b| *b == 0).next()?;
            (ppid == agent && arg0 == b"toolsrv-call-warden").then_some((pid, pgid))
        })
}

#[test]
fn the_calls_of_an_agent_killed_outright_are_ended_by_its_warden() {
    let mut fleet = Fleet::new(&["a", "b"]);
    let marks = fleet.marks();
    fleet.tool(
        "linger.meta",
        &format!(
            r#"{{"description": "starts a daemon, then waits",
                "cmd": "setsid sh -c 'echo daemon=$$ >> {marks}/pids; exec sleep 300 </dev/null >/dev/null 2>&1' & echo self=$$ >> {marks}/pids; sleep 300"}}"#,
            marks = marks.display()
        ),
        false,
    );
    fleet.start_coordinator(&[]);
    // It logs as its agent does: here one JSON object a line.
    fleet.start_agent(
        "a",
        &AgentSpec {
            args: vec!["--log-format=json".into()],
            ..AgentSpec::default()
        },
    );
    fleet.start_agent("b", &AgentSpec::default());
    fleet.wait_online(&["a", "b"], "linger");
    let agent = fleet.agents["a"].pid();
    let (warden, group) = wait_for("agent a's warden", Duration::from_secs(10), || {
        warden_of(agent)
    });
    assert_ne!(group, agent, "the warden shares the agent's process group");
    // Nothing of the agent's environment lives on in it but how to log.
    let environ = std::fs::read(format!("/proc/{warden}/environ")).unwrap();
    let mut names: Vec<String> = environ
        .split(|b| *b == 0)
        .filter(|v| !v.is_empty())
        .map(|v| String::from_utf8_lossy(v.split(|b| *b == b'=').next().unwrap()).into_owned())
        .collect();
    names.sort();
    names.retain(|n| n != "NO_COLOR");
    assert_eq!(names, ["TOOLSRV_LOG", "TOOLSRV_LOG_FORMAT"]);
    // Seen as itself in `ps`, and deaf to what ends processes by name or by service (SIGTERM),
    // a hang-up (which the kernel sends an orphaned group with a stopped member), Ctrl-C.
    let comm = std::fs::read_to_string(format!("/proc/{warden}/comm")).unwrap();
    assert_eq!(comm.trim(), "toolsrv-warden");
    for signal in ["TERM", "HUP", "INT"] {
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &warden.to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        alive(warden),
        "the warden ended on a signal it should ignore"
    );
    // Killed outright, it is started again.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(warden),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let (warden, _) = wait_for("agent a's next warden", Duration::from_secs(10), || {
        warden_of(agent).filter(|(pid, _)| *pid != warden)
    });
    let caller = fleet
        .toolctl_command("client-alice", &["call", "a", "linger", "--timeout", "600"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pids: Vec<i32> = wait_for("the call's two processes", Duration::from_secs(20), || {
        let text = std::fs::read_to_string(marks.join("pids")).ok()?;
        let pids: Vec<i32> = text
            .lines()
            .filter_map(|l| l.split_once('=')?.1.parse().ok())
            .collect();
        (pids.len() == 2).then_some(pids)
    });
    // The whole group of the agent gets SIGKILL: nothing of it can end the call.
    fleet.agents.get_mut("a").unwrap().kill();
    for pid in &pids {
        wait_for(
            &format!("process {pid} of the call to be ended"),
            Duration::from_secs(10),
            || (!alive(*pid)).then_some(()),
        );
    }
    wait_for("the warden to exit", Duration::from_secs(10), || {
        (!alive(warden)).then_some(())
    });
    // It says so where the agent logged, as the agent logs.
    let log = fleet.agents["a"].log();
    let said: Value = log
        .lines()
        .find(|l| l.contains("the agent ended without ending its calls"))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON line of the warden in {log}"));
    assert_eq!(said["fields"]["agent_pid"], agent, "{said}");
    let ended = said["fields"]["processes"].as_u64().unwrap();
    assert!((2..=3).contains(&ended), "{said}");
    let out = toolsrv_tests::finish_child(caller, Duration::from_secs(30));
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("the link to its host ended mid-call"),
        "{stderr}"
    );

    // An agent that stops as asked ends its calls itself; its warden exits with it.
    let agent = fleet.agents["b"].pid();
    let (warden, _) = wait_for("agent b's warden", Duration::from_secs(10), || {
        warden_of(agent)
    });
    fleet.agents.get_mut("b").unwrap().terminate().unwrap();
    wait_for("b's warden to exit", Duration::from_secs(10), || {
        (!alive(warden)).then_some(())
    });

    // Started by hand with a directory named like its starter's call cgroups that is no cgroup
    // (a `cgroup.procs` that is a plain file listing another process): nothing is killed.
    let fake = tempfile::tempdir().unwrap();
    let mut victim = Command::new("sleep").arg("60").spawn().unwrap();
    let calls = fake
        .path()
        .join(format!("toolsrv-calls-{}.0", std::process::id()));
    std::fs::create_dir_all(calls.join("call-1")).unwrap();
    std::fs::write(calls.join("call-1/cgroup.procs"), victim.id().to_string()).unwrap();
    let out = Command::new(bin("toolsrv"))
        .arg0("toolsrv-call-warden")
        .arg(&calls)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let still = victim.try_wait().unwrap().is_none();
    let _ = victim.kill();
    let _ = victim.wait();
    assert!(still, "the warden killed a process outside any call cgroup");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("not a cgroup"),
        "{}",
        text(&out.stderr)
    );

    // Started by hand, a warden takes no directory that is not its starter's call cgroups.
    let out = Command::new(bin("toolsrv"))
        .arg0("toolsrv-call-warden")
        .arg("/sys/fs/cgroup")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(
            "/sys/fs/cgroup is not a directory of call cgroups (named toolsrv-calls-PID.N)"
        ),
        "{stderr}"
    );
}

#[test]
fn a_fork_bomb_hits_its_pids_limit_and_the_host_still_answers_within_a_second() {
    let mut fleet = Fleet::new(&["a"]);
    let started = fleet.marks().join("bomb-started");
    // Bounded by itself: a binary tree of depth 9 (at most 1023 shells, each ending after its
    // children) even if no limit held; the policy limits it to 64 processes. The tree grows in a
    // subshell: a shell whose `&` cannot fork exits, and the tool's own shell, which forked
    // once before the tree took the pids, must live to say the bomb is over (under load the
    // first branch could take all 64 before it forked its second).
    fleet.tool(
        "bomb.meta",
        &format!(
            r#"{{"description": "fork bomb", "cmd": "touch {}; b() {{ if [ $1 -gt 0 ]; then b $(($1-1)) & b $(($1-1)) & wait; else sleep 3; fi; }}; (b 9); echo bomb over; exit 1"}}"#,
            started.display()
        ),
        false,
    );
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "echo pong"}"#,
        false,
    );
    let policy =
        fleet.policy_arg(r#"{"sandbox": [{"tools": ["bomb"], "hosts": "a", "pids": 64}]}"#);
    fleet.start_coordinator(&[&policy]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "echo");
    let bomb = fleet
        .toolctl_command("client-alice", &["call", "a", "bomb", "--timeout", "30"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the bomb to start", Duration::from_secs(20), || {
        started.exists().then_some(())
    });
    std::thread::sleep(Duration::from_millis(500));
    let asked = Instant::now();
    let out = fleet.toolctl_as("client-bob", &["call", "a", "echo"], None);
    let took = asked.elapsed();
    assert_eq!(text(&out.stdout), "pong\n", "{}", text(&out.stderr));
    assert!(took < Duration::from_secs(1), "another call took {took:?}");
    let out = toolsrv_tests::finish_child(bomb, Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert!(text(&out.stdout).contains("bomb over"), "{stderr}");
    assert!(
        stderr.contains(
            "tool `bomb` on host `a`: exited with code 1; the call reached its process limit"
        ),
        "{stderr}"
    );
}

#[test]
fn a_memory_hog_is_stopped_by_its_limit_and_the_agent_survives() {
    let mut fleet = Fleet::new(&["a"]);
    // Bounded by itself at 1 GiB even if no limit held; the policy limits it to 64 MiB.
    fleet.tool(
        "hog.meta",
        r#"{"description": "eats memory", "cmd": "head -c 1G /dev/zero | tail > /dev/null"}"#,
        false,
    );
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "echo pong"}"#,
        false,
    );
    let policy = fleet.policy_arg(r#"{"sandbox": [{"tools": ["hog"], "memory": "64M"}]}"#);
    fleet.start_coordinator(&[&policy]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "echo");
    let out = fleet.toolctl(&["call", "a", "hog", "--timeout", "60"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("the call reached its memory limit: the kernel ended processes of it"),
        "{stderr}"
    );
    let agent = fleet.agents.get_mut("a").unwrap();
    assert!(agent.child.try_wait().unwrap().is_none(), "the agent died");
    let out = fleet.toolctl(&["call", "a", "echo"]);
    assert_eq!(text(&out.stdout), "pong\n", "{}", text(&out.stderr));
}

#[test]
fn a_host_that_cannot_confine_refuses_a_tool_that_requires_it() {
    let mut fleet = Fleet::new(&["confined", "open"]);
    fleet.tool(
        "backup_db.meta",
        r#"{"description": "needs confinement", "cmd": "echo backed up"}"#,
        false,
    );
    fleet.tool(
        "echo.meta",
        r#"{"description": "echo", "cmd": "echo pong"}"#,
        false,
    );
    let policy = fleet.policy_arg(
        r#"{"rules": [{"tools": ["backup_*"], "effect": "allow", "require_sandbox": true}]}"#,
    );
    fleet.start_coordinator(&[&policy]);
    fleet.start_agent("confined", &AgentSpec::default());
    fleet.start_agent(
        "open",
        &AgentSpec {
            args: vec!["--sandbox=off".into()],
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["confined", "open"], "echo");
    let hosts = fleet.hosts();
    assert_eq!(host(&hosts, "open")["sandbox"]["level"], "off");
    assert_eq!(host(&hosts, "confined")["sandbox"]["level"], "enforced");

    let out = fleet.toolctl(&["call", "open", "backup_db"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(77), "{stderr}");
    assert!(
        stderr.contains("tool `backup_db` on host `open`: policy rule 0 requires tool `backup_db` to run confined, and host `open` reports sandbox=off"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "nothing ran");
    let out = fleet.toolctl(&["call", "confined", "backup_db"]);
    assert_eq!(text(&out.stdout), "backed up\n", "{}", text(&out.stderr));
    // Other tools run on the open host as before.
    let out = fleet.toolctl(&["call", "open", "echo"]);
    assert_eq!(text(&out.stdout), "pong\n", "{}", text(&out.stderr));

    // What a call would meet is said before it is made: the listing refuses it where the
    // sandbox is off, and a session offers the tool only where it may run.
    let policy_of = |host: &str| -> serde_json::Value {
        let out = fleet.toolctl(&["tools", host, "--json"]);
        let tools: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        tools
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "backup_db")
            .unwrap()["policy"]
            .clone()
    };
    let open = policy_of("open");
    assert_eq!(
        (&open["effect"], &open["rule"]),
        (&"deny".into(), &0.into())
    );
    assert!(
        open["denial"].as_str().unwrap().contains(
            "requires tool `backup_db` to run confined, and host `open` reports sandbox=off"
        ),
        "{open}"
    );
    assert_eq!(
        policy_of("confined"),
        serde_json::json!({"effect": "allow", "rule": 0})
    );
    let profile = fleet.work.path().join("profile.json");
    std::fs::write(&profile, r#"{"autoLoad": ["backup_db"]}"#).unwrap();
    let out = fleet.toolctl(&[
        "session",
        "open",
        "--json",
        "--profile",
        profile.to_str().unwrap(),
    ]);
    let state: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        state["tools"][0]["hosts"],
        serde_json::json!(["confined"]),
        "{state}"
    );
}

#[test]
fn tools_run_as_another_user_cannot_read_the_agents_files_by_permissions_alone() {
    let mut fleet = Fleet::new(&["off", "confined"]);
    // The test's directories must be traversable for `nobody` to reach anything at all.
    std::fs::set_permissions(fleet.work.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let key = fleet.pki.path("agent-off-key.pem");
    let blobs = fleet.work.path().join("host-off/state/blobs");
    fleet.tool(
        "whoami.meta",
        &format!(
            r#"{{"description": "who am I",
                "cmd": "echo uid=$(id -u); cat {} >/dev/null 2>&1 && echo key=read || echo key=denied; ls {} >/dev/null 2>&1 && echo blobs=listed || echo blobs=denied; echo x > \"$TMPDIR/f\" 2>/dev/null && echo tmp=written || echo tmp=denied"}}"#,
            key.display(),
            blobs.display()
        ),
        false,
    );
    fleet.start_coordinator(&[]);
    // No Landlock, no cgroup: only the user keeps the tool out.
    fleet.start_agent(
        "off",
        &AgentSpec {
            args: vec!["--sandbox=off".into(), "--run-as=nobody".into()],
            env: vec![("TMPDIR".into(), "/tmp".into())],
            ..AgentSpec::default()
        },
    );
    fleet.start_agent(
        "confined",
        &AgentSpec {
            args: vec!["--run-as=nobody".into()],
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["off", "confined"], "whoami");
    let nobody = Command::new("id").args(["-u", "nobody"]).output().unwrap();
    let nobody = text(&nobody.stdout).trim().to_string();

    let out = fleet.toolctl(&["call", "off", "whoami"]);
    let stdout = text(&out.stdout);
    assert_eq!(
        field(&stdout, "uid"),
        Some(nobody.clone()),
        "{stdout} {}",
        text(&out.stderr)
    );
    assert_eq!(field(&stdout, "key").as_deref(), Some("denied"), "{stdout}");
    assert_eq!(
        field(&stdout, "blobs").as_deref(),
        Some("denied"),
        "{stdout}"
    );

    let out = fleet.toolctl(&["call", "confined", "whoami"]);
    let stdout = text(&out.stdout);
    assert_eq!(
        field(&stdout, "uid"),
        Some(nobody),
        "{stdout} {}",
        text(&out.stderr)
    );
    assert_eq!(field(&stdout, "key").as_deref(), Some("denied"), "{stdout}");
    assert_eq!(
        field(&stdout, "tmp").as_deref(),
        Some("written"),
        "{stdout}"
    );
    assert_eq!(
        host(&fleet.hosts(), "confined")["sandbox"]["run_as"],
        "nobody"
    );
}

/// Programs on the agent's `PATH` that run files no grant covers: a version manager's shim
/// (pyenv's `python3`, say), a script that runs a program under the manager's root, and a
/// symbolic link into a directory of its own (Homebrew's `bin`). The agent says at start what to
/// grant for each; without the grant the tool is visible and fails with `Permission denied`, with
/// it the tool runs.
#[test]
fn programs_on_path_out_of_reach_are_named_at_start_and_run_once_granted() {
    let mut fleet = Fleet::new(&["plain", "granted"]);
    let root = fleet.work.path().join("manager");
    toolsrv_tests::fake_version_manager(&root, "fakepy");
    let (links, cellar) = (
        fleet.work.path().join("links"),
        fleet.work.path().join("cellar"),
    );
    std::fs::create_dir_all(&links).unwrap();
    std::fs::create_dir_all(&cellar).unwrap();
    toolsrv_tests::write_executable(&cellar, "linked", "#!/bin/sh\necho linked ran\n");
    std::os::unix::fs::symlink(cellar.join("linked"), links.join("linked")).unwrap();
    fleet.tool(
        "py.meta",
        r#"{"description": "runs the managed interpreter", "cmd": "fakepy hello",
            "variants": [{"match": {"binary": "fakepy"}}]}"#,
        false,
    );
    fleet.tool(
        "linked.meta",
        r#"{"description": "runs a linked program", "cmd": "linked",
            "variants": [{"match": {"binary": "linked"}}]}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    let path = format!(
        "{}:{}:/usr/local/bin:/usr/bin:/bin",
        root.join("shims").display(),
        links.display()
    );
    for (id, args) in [
        ("plain", vec![]),
        (
            "granted",
            vec![
                format!("--sandbox-read={}", root.display()),
                format!("--sandbox-read={}", cellar.display()),
            ],
        ),
    ] {
        let spec = AgentSpec {
            env: vec![("PATH".into(), path.clone())],
            args,
            ..AgentSpec::default()
        };
        fleet.start_agent(id, &spec);
    }
    fleet.wait_online(&["plain", "granted"], "py");
    fleet.wait_online(&["plain", "granted"], "linked");
    for (tool, ran) in [("py", "fakepy ran: hello\n"), ("linked", "linked ran\n")] {
        let out = fleet.toolctl(&["call", "granted", tool]);
        assert_eq!(text(&out.stdout), ran, "{}", text(&out.stderr));
        // Visible (found on PATH) but its program out of reach: the call says why.
        let out = fleet.toolctl(&["call", "plain", tool]);
        assert_eq!(
            out.status.code(),
            Some(126),
            "{tool}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains("Permission denied"),
            "{tool}: {}",
            text(&out.stderr)
        );
    }
    let (shims_warning, links_warning) = (
        "PATH holds a version manager's shims",
        "programs on PATH are symbolic links to files in a directory confined calls cannot read",
    );
    let log = fleet.agents["plain"].log();
    let line = |needle: &str| {
        log.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("{needle:?} not in {log}"))
            .to_string()
    };
    let shims = line(shims_warning);
    assert!(
        shims.contains(&format!("root={}", root.display())),
        "{shims}"
    );
    assert!(shims.contains("--sandbox-read ROOT"), "{shims}");
    let linked = line(links_warning);
    let cellar = cellar.canonicalize().unwrap();
    assert!(
        linked.contains(&format!("dir={}", cellar.display())),
        "{linked}"
    );
    assert!(
        linked.contains(&format!("programs={}", links.join("linked").display())),
        "{linked}"
    );
    let granted = fleet.agents["granted"].log();
    assert!(
        !granted.contains(shims_warning) && !granted.contains(links_warning),
        "{granted}"
    );
}

/// A descriptor the agent inherited from whatever started it (a wrapper's log file, a service
/// manager's socket) is open in no tool, confined or not.
#[test]
fn a_descriptor_the_agent_inherited_reaches_no_tool() {
    // Every process this test starts inherits it: F_DUPFD does not set close-on-exec, and
    // Rust's Command leaves such descriptors open.
    let log = tempfile::tempfile().unwrap();
    let inherited = nix::fcntl::fcntl(&log, nix::fcntl::FcntlArg::F_DUPFD(200)).unwrap();
    let mut fleet = Fleet::new(&["confined", "unconfined"]);
    fleet.tool(
        "fds.meta",
        r#"{"description": "lists its open descriptors", "cmd": "ls /proc/self/fd"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("confined", &AgentSpec::default());
    fleet.start_agent(
        "unconfined",
        &AgentSpec {
            args: vec!["--sandbox=off".into()],
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["confined", "unconfined"], "fds");
    for host in ["confined", "unconfined"] {
        let out = fleet.toolctl(&["call", host, "fds"]);
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{host}: {stdout} {}",
            text(&out.stderr)
        );
        let open: Vec<i32> = stdout
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        assert!(open.contains(&1), "{host}: {stdout}");
        assert!(
            !open.contains(&inherited),
            "{host}: descriptor {inherited}, the agent's inheritance, is open in the tool: {open:?}"
        );
    }
    nix::unistd::close(inherited).unwrap();
}
