//! A coordinator and an agent each started from a configuration file alone, relative paths in
//! the files meaning their directory, and a real call through them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use toolsrv_tests::{Fleet, Proc, assert_exit, bin, json_lines, text, wait_for, write};

/// `toolsrv ROLE --config FILE`, run from `cwd` with no TOOLSRV_* variable: only the file
/// configures it.
fn from_file(role: &str, file: &Path, cwd: &Path) -> Command {
    let mut cmd = Command::new(bin("toolsrv"));
    cmd.arg(role)
        .arg("--config")
        .arg(file)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", cwd);
    cmd
}

#[test]
fn a_coordinator_and_an_agent_from_their_files_serve_a_call() {
    let fleet = Fleet::new(&["web-1"]);
    let work = fleet.work.path();
    // Each role's directory holds its file and, relative to it, everything the file names.
    let etc = work.join("etc");
    let coordinator_dir = etc.join("coordinator");
    let agent_dir = etc.join("agent");
    for dir in [&coordinator_dir, &agent_dir] {
        std::fs::create_dir_all(dir).unwrap();
        std::os::unix::fs::symlink(fleet.pki.root(), dir.join("pki")).unwrap();
    }
    let tools = coordinator_dir.join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    write(
        &tools,
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
    );
    write(
        &tools,
        "guarded.meta",
        r#"{"description": "Refused by the policy", "cmd": "echo no"}"#,
    );
    write(
        &coordinator_dir,
        "policy.json",
        r#"{"rules": [{"tools": ["guarded"], "effect": "deny"}]}"#,
    );
    write(
        &coordinator_dir,
        "coordinator.toml",
        &format!(
            "# toolsrv coordinator\n\
             listen = \"127.0.0.1:{port}\"\n\
             tools = \"tools\"\n\
             ca = \"pki/ca.pem\"\n\
             cert = \"pki/coordinator.pem\"\n\
             key = \"pki/coordinator-key.pem\"\n\
             policy = \"policy.json\"\n\
             audit_log = \"audit.jsonl\"\n\
             rescan_secs = 1\n\
             max_calls_per_client = 8\n\
             log_level = \"info,toolsrv_coordinator=debug\"\n",
            port = fleet.port
        ),
    );
    write(
        &agent_dir,
        "agent.toml",
        &format!(
            "coordinator = \"{url}\"\n\
             host_id = \"web-1\"\n\
             ca = \"pki/ca.pem\"\n\
             cert = \"pki/agent-web-1.pem\"\n\
             key = \"pki/agent-web-1-key.pem\"\n\
             state_dir = \"state\"\n\
             label = [\"role=web\", \"zone=a\"]\n\
             recheck_secs = 1\n",
            url = fleet.url()
        ),
    );

    // Started from the work directory, not the files' own.
    let mut coordinator = Proc::spawn(
        "coordinator",
        from_file(
            "coordinator",
            &coordinator_dir.join("coordinator.toml"),
            work,
        ),
        work,
    );
    wait_for("the coordinator to listen", Duration::from_secs(20), || {
        std::net::TcpStream::connect(("127.0.0.1", fleet.port))
            .ok()
            .or_else(|| {
                coordinator.check_alive().unwrap();
                None
            })
    });
    let _agent = Proc::spawn(
        "agent-web-1",
        from_file("agent", &agent_dir.join("agent.toml"), work),
        work,
    );
    fleet.wait_online(&["web-1"], "hello");

    let out = fleet.toolctl(&["call", "web-1", "hello"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "hello");
    let hosts = fleet.hosts();
    let labels = &hosts[0]["labels"];
    assert_eq!(labels["role"], "web", "{hosts:?}");
    assert_eq!(labels["zone"], "a", "{hosts:?}");
    // The file's policy refuses, and its audit log records, beside the file.
    let out = fleet.toolctl(&["call", "web-1", "guarded"]);
    assert_exit(&out, 77, &[]);
    let audit = coordinator_dir.join("audit.jsonl");
    let records = wait_for("two audit records", Duration::from_secs(10), || {
        Some(json_lines(&audit)).filter(|r| r.len() >= 2)
    });
    assert!(
        records.iter().any(|r| r["tool"] == "guarded"),
        "{records:?}"
    );
    assert!(
        agent_dir.join("state").is_dir(),
        "the agent's state is beside its file"
    );
}

/// A file setting that names a device or a runaway file (`/dev/zero`, by mistake or by a
/// hostile edit of a unit file) stops the role at once with an error naming the file and the
/// bound, instead of reading until memory runs out; a missing file says so once.
#[test]
fn a_file_setting_that_never_ends_stops_the_role_naming_it() {
    let fleet = Fleet::new(&["a"]);
    let tools = fleet.work.path().join("tools");
    // The role's certificate flags, but those `extra` gives itself.
    let run = |role: &str, stem: &str, extra: &[&str]| {
        let mut cmd = Command::new(bin("toolsrv"));
        cmd.arg(role);
        for tls in fleet.pki.tls_args(stem) {
            let flag = tls.split('=').next().unwrap_or_default();
            if !extra.iter().any(|e| e.starts_with(flag)) {
                cmd.arg(tls);
            }
        }
        if role == "coordinator" {
            cmd.arg("--listen=127.0.0.1:0")
                .arg(format!("--tools={}", tools.display()));
        } else {
            cmd.args(["--coordinator=https://127.0.0.1:9", "--host-id=a"]);
        }
        cmd.args(extra);
        toolsrv_tests::run_bounded(cmd, None, Duration::from_secs(30))
    };
    let runs: [(&str, &str, &[&str], &str); 6] = [
        (
            "coordinator",
            "coordinator",
            &["--config=/dev/zero"],
            "the configuration file /dev/zero",
        ),
        (
            "agent",
            "agent-a",
            &["--config=/dev/zero"],
            "the configuration file /dev/zero",
        ),
        (
            "coordinator",
            "coordinator",
            &["--policy=/dev/zero"],
            "/dev/zero",
        ),
        (
            "coordinator",
            "coordinator",
            &["--host-labels=/dev/zero"],
            "/dev/zero",
        ),
        (
            "coordinator",
            "coordinator",
            &["--crl=/dev/zero"],
            "/dev/zero",
        ),
        (
            "coordinator",
            "coordinator",
            &["--ca=/dev/zero"],
            "/dev/zero",
        ),
    ];
    for (role, stem, extra, names) in runs {
        let out = run(role, stem, extra);
        let said = text(&out.stderr);
        assert!(!out.status.success(), "{role} {extra:?} started: {said}");
        let last = said.lines().last().unwrap_or_default();
        assert!(
            last.contains(names) && last.contains("larger than"),
            "{role} {extra:?}: {said}"
        );
    }
    // The cause is said once, not again after itself.
    let out = run(
        "coordinator",
        "coordinator",
        &["--policy=/nonexistent/policy.json"],
    );
    let said = text(&out.stderr);
    let last = said.lines().last().unwrap_or_default();
    assert_eq!(
        last.matches("No such file or directory").count(),
        1,
        "{said}"
    );
}

/// A configuration file every user of the machine could rewrite sets nothing: it could make
/// anyone an administrator or turn the sandbox off. The role stops at start, naming the file
/// and the `chmod` that fixes it; so does a coordinator given such a policy or host labels.
#[test]
fn files_every_user_could_rewrite_stop_the_role() {
    use std::os::unix::fs::PermissionsExt;
    let fleet = Fleet::new(&["a"]);
    let dir = fleet.work.path();
    let open = |name: &str, content: &str| {
        let path = dir.join(name);
        std::fs::write(&path, content).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        path
    };
    let config = open("coordinator.toml", "listen = \"127.0.0.1:0\"\n");
    let out = toolsrv_tests::run_bounded(
        from_file("coordinator", &config, dir),
        None,
        Duration::from_secs(30),
    );
    assert_exit(
        &out,
        2,
        &[
            &format!("the configuration file {}", config.display()),
            "writable by every user of this machine (mode 0666)",
            &format!("chmod o-w {}", config.display()),
        ],
    );
    let agent_config = open("agent.toml", "host_id = \"a\"\n");
    let out = toolsrv_tests::run_bounded(
        from_file("agent", &agent_config, dir),
        None,
        Duration::from_secs(30),
    );
    assert_exit(&out, 2, &[&format!("chmod o-w {}", agent_config.display())]);

    for (flag, file) in [
        ("--policy", open("policy.json", r#"{"rules": []}"#)),
        ("--host-labels", open("labels.json", "{}")),
    ] {
        let mut cmd = Command::new(bin("toolsrv"));
        cmd.arg("coordinator")
            .args(fleet.pki.tls_args("coordinator"))
            .arg("--listen=127.0.0.1:0")
            .arg(format!("--tools={}", dir.join("tools").display()))
            .arg(format!("{flag}={}", file.display()));
        let out = toolsrv_tests::run_bounded(cmd, None, Duration::from_secs(30));
        assert!(!out.status.success(), "{flag}: {out:?}");
        let err = text(&out.stderr);
        assert!(
            err.contains(&format!("chmod o-w {}", file.display())),
            "{flag}: {err}"
        );
    }
}
