//! Real processes confined by a real confiner: each claim proven by a shell command that tries it
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use toolsrv_confine::{CallPlan, Confiner, Grant, Level, Settings};

struct World {
    root: tempfile::TempDir,
    confiner: Confiner,
}

impl World {
    /// A confiner whose private files are `<root>/state` and `<root>/pki`, with `<root>` itself
    /// granted for reading, so the carving out is what keeps them unreadable
    fn new() -> Self {
        let root = tempfile::tempdir().unwrap();
        for dir in ["state/catalog", "pki", "tools", "public"] {
            std::fs::create_dir_all(root.path().join(dir)).unwrap();
        }
        std::fs::write(root.path().join("pki/agent-key.pem"), "SECRET KEY").unwrap();
        std::fs::write(root.path().join("state/blob"), "state").unwrap();
        std::fs::write(root.path().join("public/readme"), "public").unwrap();
        let mut settings = Settings::new(vec![root.path().join("state"), root.path().join("pki")]);
        settings.defaults.read.push(root.path().to_path_buf());
        settings.call_dir = root.path().join("calls");
        let confiner = Confiner::new(settings).unwrap();
        Self { root, confiner }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.root.path().join(p)
    }

    fn run(&self, script: &str, grant: Option<&Grant>, cwd: Option<&Path>) -> (Output, PathBuf) {
        let agent_env: Vec<(OsString, OsString)> = vec![
            ("PATH".into(), "/usr/bin:/bin".into()),
            ("AGENT_SECRET".into(), "hunter2".into()),
        ];
        let tools = self.path("tools");
        let prepared = self
            .confiner
            .prepare(&CallPlan {
                tool_dir: &tools,
                cwd,
                grant,
                agent_env: &agent_env,
                timeout: Duration::from_secs(10),
            })
            .unwrap();
        let cwd = prepared.cwd.clone().unwrap();
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(script)
            .env_clear()
            .envs(prepared.env.clone().unwrap())
            .current_dir(&cwd)
            .stdin(Stdio::null());
        prepared.jail.install(&mut cmd);
        let out = cmd.output().unwrap();
        prepared.jail.release();
        (out, cwd)
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn this_host_enforces_everything() {
    let world = World::new();
    let a = world.confiner.abilities();
    assert_eq!(a.level, Level::Enforced, "{a:?}");
    assert!(a.landlock_abi >= 1, "{a:?}");
}

#[test]
fn the_agents_files_are_out_of_reach_and_the_rest_of_a_granted_directory_is_not() {
    let world = World::new();
    let key = world.path("pki/agent-key.pem");
    let state = world.path("state/blob");
    let public = world.path("public/readme");
    let script = format!(
        "cat {} && echo KEY-READ; cat {} && echo STATE-READ; ls {} && echo STATE-LISTED; cat {}",
        key.display(),
        state.display(),
        world.path("state").display(),
        public.display()
    );
    let (out, _) = world.run(&script, None, None);
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("SECRET"), "{stdout}");
    assert!(!stdout.contains("KEY-READ"), "{stdout}");
    assert!(!stdout.contains("STATE-READ"), "{stdout}");
    assert!(!stdout.contains("STATE-LISTED"), "{stdout}");
    assert!(stdout.contains("public"), "{stdout} {}", text(&out.stderr));
}

#[test]
fn writes_land_only_in_the_private_directory() {
    let world = World::new();
    let outside = world.path("public/written");
    let script = format!(
        "echo a > \"$PWD/in-pwd\" && echo b > \"$TMPDIR/in-tmp\" && cat \"$HOME/in-pwd\" \"$TMPDIR/in-tmp\"; \
         echo c > {} && echo OUTSIDE-WRITTEN; echo d > /tmp/toolsrv-confine-test && echo TMP-WRITTEN; pwd",
        outside.display()
    );
    let (out, cwd) = world.run(&script, None, None);
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("a\nb\n"),
        "{stdout} {}",
        text(&out.stderr)
    );
    assert!(!stdout.contains("WRITTEN"), "{stdout}");
    assert!(!outside.exists());
    assert!(stdout.contains(cwd.to_str().unwrap()));
    assert!(
        !cwd.exists(),
        "the private directory is removed after the call"
    );
}

#[test]
fn the_agents_environment_stays_out_but_path_and_the_contract_are_in() {
    let world = World::new();
    let (out, cwd) = world.run("env", None, None);
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("hunter2"), "{stdout}");
    for want in [
        "PATH=/usr/bin:/bin".to_string(),
        format!("PWD={}", cwd.display()),
        format!("TMPDIR={}", cwd.display()),
        format!("HOME={}", cwd.display()),
        format!("OLLIE_TOOLS_PATH={}", world.path("tools").display()),
    ] {
        assert!(stdout.lines().any(|l| l == want), "{want} in {stdout}");
    }
}

#[test]
fn a_grant_widens_and_a_caller_cwd_is_readable_only() {
    let world = World::new();
    let shared = world.path("shared");
    std::fs::create_dir_all(&shared).unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("f"), "outside").unwrap();
    let grant = Grant {
        write: vec![shared.clone(), world.path("pki")],
        env: vec!["AGENT_*".into()],
        ..Grant::default()
    };
    let script = format!(
        "echo x > {}/granted && echo GRANTED; echo y > {}/forged && echo PKI-WRITTEN; echo $AGENT_SECRET; cat f; echo z > g && echo CWD-WRITTEN",
        shared.display(),
        world.path("pki").display()
    );
    let (out, cwd) = world.run(&script, Some(&grant), Some(outside.path()));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("GRANTED"), "{stdout} {}", text(&out.stderr));
    assert!(
        !stdout.contains("PKI-WRITTEN"),
        "a grant cannot reach the agent's files: {stdout}"
    );
    assert!(
        stdout.contains("hunter2"),
        "the grant passes AGENT_*: {stdout}"
    );
    assert!(
        stdout.contains("outside"),
        "the caller's cwd is readable: {stdout}"
    );
    assert!(
        !stdout.contains("CWD-WRITTEN"),
        "but not writable: {stdout}"
    );
    assert_eq!(cwd, std::fs::canonicalize(outside.path()).unwrap());
}

#[test]
fn a_cwd_among_the_agents_files_is_refused() {
    let world = World::new();
    let state = world.path("state");
    let err = world
        .confiner
        .prepare(&CallPlan {
            tool_dir: &world.path("tools"),
            cwd: Some(&state),
            grant: None,
            agent_env: &[],
            timeout: Duration::from_secs(1),
        })
        .unwrap_err();
    assert!(err.to_string().contains("private files"), "{err}");
}

#[test]
fn without_network_tcp_connect_fails() {
    let world = World::new();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let script = format!("exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED");
    let bash = |grant: Option<&Grant>| {
        let (out, _) = world.run(&format!("bash -c '{script}'"), grant, None);
        text(&out.stdout)
    };
    assert!(
        bash(None).contains("CONNECTED"),
        "network is allowed by default"
    );
    let offline = Grant {
        network: Some(false),
        ..Grant::default()
    };
    assert!(!bash(Some(&offline)).contains("CONNECTED"));
}
