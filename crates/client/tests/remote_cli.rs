//! Smoke test of the client library and the remote `toolctl` commands against an in-process
//! coordinator and two agents on an ephemeral loopback port.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use toolsrv_client::{
    CallRequest, CallStatus, Client, ConnectOptions, FanOutRequest, FanOutUpdate, HostState,
};
use toolsrv_testkit::{assert_exit, client_env, text, write, write_pki};
use toolsrv_tls::{Identity, TlsFiles};

const HOSTS: [&str; 2] = ["web-1", "web-2"];

/// A coordinator and two agents in this process, stopped on drop.
struct InProcessFleet {
    dir: tempfile::TempDir,
    url: String,
    shutdown: CancellationToken,
}

impl Drop for InProcessFleet {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl InProcessFleet {
    fn pki(&self) -> std::path::PathBuf {
        self.dir.path().join("pki")
    }

    fn tools(&self) -> String {
        self.dir.path().join("tools").display().to_string()
    }

    fn client_files(&self) -> TlsFiles {
        TlsFiles::in_dir(&self.pki(), &Identity::Client("alice".into()))
    }

    /// `toolctl` with the connection in the environment, as a user would set it up.
    fn toolctl(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_toolctl"));
        cmd.args(args)
            .envs(client_env(&self.url, &self.client_files()))
            .env_remove("OLLIE_TOOLS_PATH")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    }

    async fn run(&self, args: &[&str]) -> Output {
        run(self.toolctl(args)).await
    }

    async fn client(&self) -> Client {
        let opts = ConnectOptions {
            addr: self.url.clone(),
            tls: self.client_files(),
        };
        Client::connect(&opts).await.unwrap()
    }
}

async fn run(mut cmd: tokio::process::Command) -> Output {
    let child = cmd.spawn().unwrap();
    tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("toolctl did not finish within 30 s: {cmd:?}"))
        .unwrap()
}

async fn start() -> InProcessFleet {
    toolsrv_tls::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    write_pki(&pki, &HOSTS, &["alice"]).unwrap();

    let tools = dir.path().join("tools");
    std::fs::create_dir(&tools).unwrap();
    write(
        &tools,
        "echo.meta",
        r#"{"description": "Echo the arguments", "prompt": "Says it back", "keywords": ["echo"], "tier": "hot",
            "args": {"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": false},
            "cmd": "cat; printf 'partial'; sleep 0.1; echo ' line'; echo to-stderr >&2"}"#,
    );
    write(
        &tools,
        "fail.meta",
        r#"{"description": "Fails", "cmd": "echo broken >&2; exit 3"}"#,
    );
    write(
        &tools,
        "slow.meta",
        r#"{"description": "Sleeps", "cmd": "echo started; sleep 30"}"#,
    );
    write(
        &tools,
        "plan9.meta",
        r#"{"description": "Plan 9 only", "variants": [{"match": {"os": "plan9"}, "cmd": "true"}]}"#,
    );

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let config = toolsrv_coordinator::CoordinatorConfig::new(
        vec![tools.clone()],
        TlsFiles::in_dir(&pki, &Identity::Coordinator),
    );
    tokio::spawn(toolsrv_coordinator::serve(
        config,
        listener,
        Default::default(),
        shutdown.clone(),
    ));
    for host in HOSTS {
        let mut config = toolsrv_agent::AgentConfig::new(
            url.clone(),
            host,
            TlsFiles::in_dir(&pki, &Identity::Agent(host.into())),
            dir.path().join(format!("agent-{host}")),
        );
        config.labels.insert("role".into(), "web".into());
        config.workdir = dir.path().to_path_buf();
        tokio::spawn(toolsrv_agent::run(config, shutdown.clone()));
    }
    let fleet = InProcessFleet { dir, url, shutdown };

    // Both agents connected and reported their views.
    let client = fleet.client().await;
    let ready = async {
        loop {
            let hosts = client.hosts().await.unwrap();
            let online = hosts
                .iter()
                .filter(|h| h.state == HostState::Online as i32 && h.visible_tools >= 3)
                .count();
            if online == HOSTS.len() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), ready)
        .await
        .expect("both agents online within 20 s");
    fleet
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_commands_against_a_real_fleet() {
    let fleet = start().await;

    // The library: a call to its end.
    let client = fleet.client().await;
    let outcome = client
        .call_to_end(CallRequest {
            host: "web-1".into(),
            tool: "echo".into(),
            args_json: r#"{"n": 1}"#.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        outcome.result.status,
        CallStatus::Ok as i32,
        "{:?}",
        outcome.result
    );
    assert_eq!(text(&outcome.stdout), "{\"n\":1}\npartial line\n");
    assert_eq!(text(&outcome.stderr), "to-stderr\n");

    // The library: a fan-out ends with a summary after a result per host.
    let mut stream = client
        .fan_out(FanOutRequest {
            selector: "role=web".into(),
            tool: "fail".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut results = Vec::new();
    let mut summary = None;
    while let Some(event) = stream.next().await {
        match event.unwrap().event {
            FanOutUpdate::Result(r) => results.push(r.status),
            FanOutUpdate::Summary(s) => summary = Some(s),
            FanOutUpdate::Output(_) | FanOutUpdate::Approval(_) => {}
        }
    }
    assert_eq!(results, [CallStatus::ToolError as i32; 2]);
    let summary = summary.unwrap();
    assert_eq!((summary.targeted, summary.ok, summary.failed), (2, 0, 2));

    // hosts --json
    let out = fleet.run(&["hosts", "--json"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let hosts: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<&str> = hosts
        .iter()
        .map(|h| h["host_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, HOSTS);
    assert_eq!(hosts[0]["state"], "online");
    assert_eq!(hosts[0]["labels"], json!({"role": "web"}));
    let out = fleet.run(&["hosts"]).await;
    assert!(
        text(&out.stdout).starts_with("HOST "),
        "{}",
        text(&out.stdout)
    );

    // tools --json lists what `local list` lists for the same tools on the same machine.
    let out = fleet.run(&["tools", "web-1", "--all", "--json"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut remote: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    // Besides, the coordinator says of each visible tool what its policy (none: allow all)
    // lets this client do.
    for entry in &mut remote {
        let policy = entry.as_object_mut().unwrap().remove("policy");
        let expected = (entry["visible"] == true).then(|| json!({"effect": "allow", "rule": null}));
        assert_eq!(policy, expected, "{entry}");
    }
    let out = fleet
        .run(&[
            "local",
            "list",
            "--tools",
            &fleet.tools(),
            "--all",
            "--json",
        ])
        .await;
    let local: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    // The same listing, hidden tools (with their reasons and top-level descriptions) included.
    assert_eq!(remote, local);
    let plan9 = remote.iter().find(|e| e["name"] == "plan9").unwrap();
    assert_eq!(plan9["visible"], false);
    assert!(
        plan9["reason"].as_str().unwrap().contains("variant 0"),
        "{plan9}"
    );

    // describe prints exactly what `local describe` prints.
    let out = fleet.run(&["describe", "web-1", "echo"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let local = fleet
        .run(&["local", "describe", "--tools", &fleet.tools(), "echo"])
        .await;
    assert_eq!(text(&out.stdout), text(&local.stdout));
    let out = fleet.run(&["describe", "web-1", "plan9"]).await;
    assert_exit(&out, 69, &[]);
    let out = fleet.run(&["describe", "web-1", "nope"]).await;
    assert_exit(&out, 127, &[]);

    // call: output, exit codes, statuses.
    let out = fleet.run(&["call", "web-1", "echo", r#"{"n": 2}"#]).await;
    assert_exit(&out, 0, &[]);
    assert_eq!(text(&out.stdout), "{\"n\":2}\npartial line\n");
    assert_eq!(text(&out.stderr), "to-stderr\n");
    let out = fleet.run(&["call", "web-1", "echo", "--result"]).await;
    let result: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(result["content"].is_array(), "{result}");
    let out = fleet.run(&["call", "web-1", "fail"]).await;
    assert_exit(
        &out,
        3,
        &["toolctl: tool `fail` on host `web-1`: exited with code 3"],
    );
    let cases: [(&[&str], i32, &str); 8] = [
        (
            &["call", "web-1", "echo", r#"{"n": "x"}"#],
            65,
            "toolctl: tool `echo`: invalid arguments: at /n: ",
        ),
        (
            &["call", "web-1", "plan9"],
            69,
            "toolctl: tool `plan9` is hidden on host `web-1`: no variant matches",
        ),
        (
            &["call", "web-1", "nope"],
            127,
            "toolctl: unknown tool `nope` on host `web-1`\n",
        ),
        (
            &["call", "web-1", "ehco"],
            127,
            "toolctl: unknown tool `ehco` on host `web-1`; did you mean `echo`?\n",
        ),
        (
            &["call", "nohost", "echo"],
            127,
            "toolctl: no host `nohost` has connected to this coordinator (or not for 86400 s: \
             hosts offline that long are forgotten)\n",
        ),
        (
            &["call", "web-1", "slow", "--timeout", "0.3"],
            124,
            "toolctl: tool `slow` on host `web-1`: timed out after 300ms",
        ),
        (&["call", "web-1", "echo", "[1]"], 64, "JSON object"),
        // A working directory on another host is named from its root.
        (
            &["call", "web-1", "echo", "--cwd", "srv/app"],
            64,
            "cwd \"srv/app\" is not an absolute path",
        ),
    ];
    for (args, code, says) in cases {
        let out = fleet.run(args).await;
        assert_eq!(
            out.status.code(),
            Some(code),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(says),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }

    // The same unknown host, or unknown tool, reads the same through every command: the
    // coordinator's words, the closest known name, no gRPC code.
    for (host, tool, message, code) in [
        (
            "wbe-1",
            "echo",
            "no host `wbe-1` has connected to this coordinator (or not for 86400 s: hosts \
             offline that long are forgotten); did you mean `web-1`?",
            127,
        ),
        (
            "web-1",
            "ehco",
            "unknown tool `ehco` on host `web-1`; did you mean `echo`?",
            127,
        ),
        (
            "web-1",
            "plan9",
            "tool `plan9` is hidden on host `web-1`: no variant matches this host",
            69,
        ),
    ] {
        let line = format!("toolctl: {message}");
        let commands: [Vec<&str>; 3] = [
            vec!["call", host, tool],
            vec!["describe", host, tool],
            vec!["tools", host],
        ];
        for args in &commands {
            if args[0] == "tools" && host == "web-1" {
                continue; // a listing of a known host is no error
            }
            let out = fleet.run(args).await;
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
            assert!(stderr.starts_with(&line), "{args:?}: {stderr}");
            assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
            for code in [
                "NotFound",
                "FailedPrecondition",
                "unknown_host",
                "unknown_tool",
            ] {
                assert!(!stderr.contains(code), "{args:?}: {stderr}");
            }
        }
        let out = fleet.run(&["fanout", host, tool, "--json"]).await;
        let stdout = text(&out.stdout);
        let result = stdout
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .find(|e| e["type"] == "result")
            .unwrap_or_else(|| panic!("no result: {stdout}"));
        assert!(
            result["message"].as_str().unwrap().starts_with(message),
            "{result}"
        );
        let out = fleet.run(&["fanout", host, tool]).await;
        assert!(text(&out.stdout).contains(message), "{}", text(&out.stdout));
    }

    // fanout: prefixed whole lines, a summary table, exit 1 when a host fails.
    let out = fleet.run(&["fanout", "role=web", "echo"]).await;
    assert_exit(&out, 0, &[]);
    let stdout = text(&out.stdout);
    for host in HOSTS {
        assert!(
            stdout.contains(&format!("{host} | partial line\n")),
            "{stdout}"
        );
        assert!(text(&out.stderr).contains(&format!("{host} | to-stderr\n")));
    }
    assert!(stdout.contains("2 hosts: 2 ok, 0 failed"), "{stdout}");
    let out = fleet.run(&["fanout", "web-*", "fail", "--json"]).await;
    assert_exit(&out, 1, &[]);
    let events: Vec<Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let summary = events.last().unwrap();
    assert_eq!(summary["type"], "summary");
    assert_eq!(summary["failed"], 2);
    assert_eq!(
        summary["hosts"]["web-1"],
        json!({"status": "tool_error", "exit_code": 3})
    );
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "stderr" && e["data"] == "broken\n")
    );
    let out = fleet.run(&["fanout", "role=nothing", "echo"]).await;
    let err = assert_exit(&out, 1, &["matches no host"]);
    assert!(!err.contains("0 hosts"), "one line says it: {err}");

    // watch starts with a snapshot.
    let mut watch = fleet.toolctl(&["watch", "--json"]).spawn().unwrap();
    let mut stdout = tokio::io::BufReader::new(watch.stdout.take().unwrap());
    let line = first_line(&mut stdout, "watch prints a snapshot").await;
    let first: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(first["kind"], "snapshot", "{line}");
    watch.kill().await.unwrap();

    // Ctrl-C cancels a running call on the host and exits 130.
    interrupt_slow_call(&client, fleet.toolctl(&["call", "web-2", "slow"])).await;
}

/// The next line from `reader`; `what` should happen within 10 s.
async fn first_line(reader: &mut (impl tokio::io::AsyncBufRead + Unpin), what: &str) -> String {
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::AsyncBufReadExt::read_line(reader, &mut line),
    )
    .await
    .unwrap_or_else(|_| panic!("{what}: nothing within 10 s"))
    .unwrap();
    line
}

/// Runs `call` (a `toolctl call` of `slow`), interrupts it once the tool has started, and checks
/// that it exits 130 and that the call ends on the host.
async fn interrupt_slow_call(client: &Client, mut call: tokio::process::Command) {
    let mut call = call.spawn().unwrap();
    let mut stdout = tokio::io::BufReader::new(call.stdout.take().unwrap());
    let line = first_line(&mut stdout, "the tool starts").await;
    assert_eq!(line, "started\n");
    let pid = call.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(10), call.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(130));
    let drained = async {
        loop {
            let hosts = client.hosts().await.unwrap();
            if hosts.iter().all(|h| h.calls_in_flight == 0) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), drained)
        .await
        .expect("the cancelled call ends on the host");
}

/// Starts `toolctl master` on `socket` and waits until it serves; the task yields the rest of its log.
async fn start_master(
    fleet: &InProcessFleet,
    socket: &Path,
    extra: &[&str],
) -> (tokio::process::Child, tokio::task::JoinHandle<String>) {
    let mut cmd = fleet.toolctl(&["master"]);
    cmd.arg("--control").arg(socket).args(extra);
    let mut master = cmd.spawn().unwrap();
    let mut stderr = tokio::io::BufReader::new(master.stderr.take().unwrap());
    let line = first_line(&mut stderr, "the master says it serves").await;
    assert!(line.starts_with("toolctl master: serving "), "{line}");
    assert!(socket.exists());
    // Keep draining its log so that it never blocks on a full pipe.
    let log = tokio::spawn(async move {
        let mut rest = String::new();
        let _ = tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut rest).await;
        rest
    });
    (master, log)
}

/// `toolctl` that knows only the control socket: no address, no certificate.
fn via_control(fleet: &InProcessFleet, socket: &Path, args: &[&str]) -> tokio::process::Command {
    let mut cmd = fleet.toolctl(args);
    cmd.env("TOOLSRV_CONTROL", socket)
        .env_remove("TOOLSRV_ADDR")
        .env_remove("TOOLSRV_CA")
        .env_remove("TOOLSRV_CERT")
        .env_remove("TOOLSRV_KEY");
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_serves_commands_on_its_control_socket() {
    let fleet = start().await;
    let client = fleet.client().await;
    let socket = fleet.dir.path().join("master.sock");
    let (mut master, log) = start_master(&fleet, &socket, &[]).await;
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&socket).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the socket is for our user only");

    // Commands with no credentials at all go through it: streamed output, exit codes, fan-out.
    let mut cmd = via_control(&fleet, &socket, &["call", "web-1", "echo", "-"]);
    cmd.stdin(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stdin, br#"{"n": 7}"#)
        .await
        .unwrap();
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "{\"n\":7}\npartial line\n");
    assert_eq!(text(&out.stderr), "to-stderr\n");
    let out = run(via_control(&fleet, &socket, &["call", "web-2", "fail"])).await;
    assert_exit(&out, 3, &[]);
    let out = run(via_control(&fleet, &socket, &["hosts", "--json"])).await;
    let hosts: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(hosts.as_array().unwrap().len(), 2, "{hosts}");
    let out = run(via_control(&fleet, &socket, &["fanout", "all", "echo"])).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(via_control(&fleet, &socket, &["call", "web-1", "nope"])).await;
    assert_exit(&out, 127, &[]);
    // Sessions through the master: opened, listed, closed.
    let out = run(via_control(&fleet, &socket, &["session", "open"])).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let id = text(&out.stdout).trim().to_string();
    let out = run(via_control(&fleet, &socket, &["session", "list", "--json"])).await;
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["id"], id.as_str(), "{listed}");
    let out = run(via_control(&fleet, &socket, &["session", "close", &id])).await;
    assert!(out.status.success(), "{}", text(&out.stderr));

    // Ctrl-C on a relayed call cancels it on the host.
    interrupt_slow_call(
        &client,
        via_control(&fleet, &socket, &["call", "web-1", "slow"]),
    )
    .await;

    // One master per socket.
    let mut cmd = fleet.toolctl(&["master"]);
    cmd.arg("--control").arg(&socket);
    let out = run(cmd).await;
    assert_exit(&out, 78, &["another master is serving there"]);

    // Only our own user (or root) may use it, whatever the file's mode says.
    if nix::unistd::geteuid().is_root() {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(fleet.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
        let mut cmd = via_control(&fleet, &socket, &["hosts"]);
        cmd.uid(65534).gid(65534);
        let out = run(cmd).await;
        assert_exit(&out, 75, &[]);
        assert!(out.stdout.is_empty());
    }

    // SIGTERM stops it and removes the socket, even with a relayed watch that never ends by
    // itself (it gets a grace period, then is ended); then a command with credentials connects
    // directly and one without says where it looked.
    let mut watch = via_control(&fleet, &socket, &["watch", "--json"])
        .spawn()
        .unwrap();
    let mut watch_out = tokio::io::BufReader::new(watch.stdout.take().unwrap());
    let line = first_line(&mut watch_out, "a relayed watch prints a snapshot").await;
    assert!(line.contains("snapshot"), "{line}");
    let pid = nix::unistd::Pid::from_raw(i32::try_from(master.id().unwrap()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(15), master.wait())
        .await
        .expect("the master stops within its grace period")
        .unwrap();
    let watched = tokio::time::timeout(Duration::from_secs(10), watch.wait())
        .await
        .expect("the relayed watch ends with the master")
        .unwrap();
    assert!(!watched.success(), "{watched:?}");
    assert!(status.success(), "{status:?}");
    assert!(!socket.exists());
    let log = log.await.unwrap();
    if nix::unistd::geteuid().is_root() {
        assert!(log.contains("refused a process of another user"), "{log}");
    }
    let mut cmd = fleet.toolctl(&["hosts"]);
    cmd.env("TOOLSRV_CONTROL", &socket);
    let out = run(cmd).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(via_control(&fleet, &socket, &["hosts"])).await;
    assert_exit(&out, 75, &[]);
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&socket.display().to_string()) && stderr.contains("toolctl master"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    let mut cmd = fleet.toolctl(&["hosts"]);
    cmd.env_remove("TOOLSRV_CERT");
    let out = run(cmd).await;
    assert_exit(&out, 64, &["--cert (TOOLSRV_CERT)"]);

    // With --idle-exit it goes away by itself once no client is left.
    let (mut master, _log) = start_master(&fleet, &socket, &["--idle-exit", "0.5"]).await;
    let out = run(via_control(&fleet, &socket, &["hosts"])).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let status = tokio::time::timeout(Duration::from_secs(10), master.wait())
        .await
        .expect("an idle master exits by itself")
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!socket.exists());
}

/// Without XDG_RUNTIME_DIR the default control socket is in a private directory of ours under
/// the temporary directory, never at `/toolctl.sock`; `default` names it for every command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_control_socket_lives_in_a_private_directory() {
    use std::os::unix::fs::PermissionsExt;
    let fleet = start().await;
    let tmp = fleet.dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let dir = tmp.join(format!("toolctl-{}", nix::unistd::getuid()));
    let socket = dir.join("toolctl.sock");
    let mut cmd = fleet.toolctl(&["master", "--idle-exit", "1"]);
    cmd.env_remove("XDG_RUNTIME_DIR")
        .env_remove("TOOLSRV_CONTROL")
        .env("TMPDIR", &tmp);
    let mut master = cmd.spawn().unwrap();
    let mut stderr = tokio::io::BufReader::new(master.stderr.take().unwrap());
    let line = first_line(&mut stderr, "the master says it serves").await;
    assert!(
        line.contains(&format!(" on {} ", socket.display())),
        "{line}"
    );
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "the directory is created private");
    let mut cmd = via_control(&fleet, Path::new("default"), &["hosts"]);
    cmd.env_remove("XDG_RUNTIME_DIR").env("TMPDIR", &tmp);
    let out = run(cmd).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let status = tokio::time::timeout(Duration::from_secs(10), master.wait())
        .await
        .expect("an idle master exits by itself")
        .unwrap();
    assert!(status.success(), "{status:?}");

    // A directory open to others at that place is refused, not used.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut cmd = fleet.toolctl(&["master"]);
    cmd.env_remove("XDG_RUNTIME_DIR")
        .env_remove("TOOLSRV_CONTROL")
        .env("TMPDIR", &tmp);
    let out = run(cmd).await;
    assert_exit(&out, 78, &["mode 777 lets other users in"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_failures_are_one_line_with_a_documented_code() {
    let fleet = start().await;

    // Nothing listens on port 1.
    let out = fleet.run(&["hosts", "--addr", "https://127.0.0.1:1"]).await;
    assert_exit(&out, 75, &[]);
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("toolctl: cannot connect to https://127.0.0.1:1: "),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");

    // An agent certificate is not a client certificate.
    let agent = TlsFiles::in_dir(&fleet.pki(), &Identity::Agent("web-1".into()));
    let mut cmd = fleet.toolctl(&["hosts"]);
    cmd.env("TOOLSRV_CERT", &agent.cert)
        .env("TOOLSRV_KEY", &agent.key);
    let out = run(cmd).await;
    assert_exit(&out, 77, &[]);

    // A key file that does not exist.
    let out = fleet.run(&["hosts", "--key", "/nonexistent/key.pem"]).await;
    assert_exit(&out, 78, &["/nonexistent/key.pem"]);

    // A certificate from another CA: refused by the coordinator during or after the handshake.
    let other = fleet.dir.path().join("other");
    write_pki(&other, &[], &["mallory"]).unwrap();
    let mallory = TlsFiles::in_dir(&other, &Identity::Client("mallory".into()));
    let mut cmd = fleet.toolctl(&["hosts"]);
    cmd.env("TOOLSRV_CERT", &mallory.cert)
        .env("TOOLSRV_KEY", &mallory.key)
        .env("TOOLSRV_CA", &mallory.ca);
    let out = run(cmd).await;
    assert!(!out.status.success());
    assert_eq!(
        text(&out.stderr).lines().count(),
        1,
        "{}",
        text(&out.stderr)
    );
}
