//! A fleet of real processes under test: one PKI, one `toolsrv coordinator`, any number of
//! `toolsrv agent`s on loopback, and `toolctl` pointed at them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;
use toolsrv_tls::Identity;

use crate::bin::try_bin;
use crate::error::{Result, TestkitError, must};
use crate::files::{try_write_file, write_file};
use crate::launch::{AgentLaunch, CoordinatorLaunch, client_env};
use crate::pki::{Pki, stem_files};
use crate::proc::{Proc, try_free_port};
use crate::wait::{run_bounded, wait_for};

/// A fleet under test: one PKI, one coordinator, any number of agents, each with its own
/// `PATH`, environment, files and state. (`toolsrv_tests::Fleet` in the workspace tests.)
#[derive(Debug)]
pub struct TestFleet {
    // Fields drop in order: the processes first, so that a failing test prints their logs
    // before the directory holding them is removed.
    pub coordinator: Option<Proc>,
    pub agents: BTreeMap<String, Proc>,
    pub pki: Pki,
    pub work: tempfile::TempDir,
    pub port: u16,
    pub tools: PathBuf,
    /// What agents get as `--coordinator` instead of [`TestFleet::url`]: several replicas'
    /// URLs, comma-separated.
    pub agent_coordinators: Option<String>,
}

/// How to start one agent of a [`TestFleet`].
#[derive(Debug, Default, Clone)]
pub struct AgentSpec {
    /// Executables to put on this agent's private `PATH` dir: (name, script).
    pub binaries: Vec<(String, String)>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// Extra environment variables that need not be UTF-8.
    pub env_os: Vec<(std::ffi::OsString, std::ffi::OsString)>,
    /// Labels.
    pub labels: Vec<(String, String)>,
    /// Host-only tool directory contents: (file, content, executable).
    pub local_tools: Vec<(String, String, bool)>,
    pub max_concurrent: Option<u32>,
    /// Extra command-line arguments (`--sandbox off`, `--run-as nobody`, ...).
    pub args: Vec<String>,
    /// Run enrolled (see `AgentLaunch::enroll`): `--join TOKEN --ca-pin PIN`, or nothing for an
    /// agent whose state directory holds its certificate already.
    pub enroll: Option<Vec<String>>,
}

impl AgentSpec {
    /// An agent whose own tools directory (host-only tools) holds `tools`: each a `.meta` file's
    /// name without `.meta`, and its content.
    pub fn own_tools<S: AsRef<str>>(tools: &[(&str, S)]) -> Self {
        Self {
            local_tools: tools
                .iter()
                .map(|(name, meta)| (format!("{name}.meta"), meta.as_ref().to_string(), false))
                .collect(),
            ..Self::default()
        }
    }
}

impl TestFleet {
    /// A PKI for `agents` (plus `alice` and `bob` clients) and an empty tools directory.
    pub fn try_new(agents: &[&str]) -> Result<Self> {
        let pki = Pki::try_new(agents, &["alice", "bob"])?;
        let work = tempfile::tempdir()
            .map_err(|e| TestkitError::io("cannot make a temporary directory", e))?;
        let tools = work.path().join("tools");
        std::fs::create_dir_all(&tools)
            .map_err(|e| TestkitError::io(format!("cannot create {}", tools.display()), e))?;
        let marks = work.path().join("marks");
        std::fs::create_dir_all(&marks)
            .map_err(|e| TestkitError::io(format!("cannot create {}", marks.display()), e))?;
        Ok(Self {
            pki,
            work,
            port: try_free_port()?,
            tools,
            coordinator: None,
            agents: BTreeMap::new(),
            agent_coordinators: None,
        })
    }

    /// [`TestFleet::try_new`], failing the test on error.
    #[track_caller]
    pub fn new(agents: &[&str]) -> Self {
        must(Self::try_new(agents))
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// Writes a tool file into the coordinator's tools directory.
    pub fn tool(&self, file: &str, content: &str, executable: bool) {
        write_file(&self.tools.join(file), content, executable);
    }

    /// Starts the coordinator on this fleet's port (rescanning every second, `extra` flags) and
    /// waits until it listens.
    pub fn try_start_coordinator(&mut self, extra: &[&str]) -> Result<()> {
        let mut launch = CoordinatorLaunch::new(
            self.port,
            &self.tools,
            self.pki.files(&Identity::Coordinator),
        );
        launch.log = "info,toolsrv_coordinator=debug".into();
        launch.args = std::iter::once("--rescan-secs=1")
            .chain(extra.iter().copied())
            .map(String::from)
            .collect();
        // The port was free when picked; should another process take it before the coordinator
        // binds it, pick another (agents and clients are pointed at the fleet's port later).
        let mut attempts = 1;
        let proc = loop {
            match launch.start(&try_bin("toolsrv")?, "coordinator", self.work.path()) {
                Err(TestkitError::Exited { log, .. })
                    if log.contains("Address already in use") && attempts < 3 =>
                {
                    attempts += 1;
                    self.port = try_free_port()?;
                    launch.port = self.port;
                }
                started => break started?,
            }
        };
        self.coordinator = Some(proc);
        Ok(())
    }

    /// [`TestFleet::try_start_coordinator`], failing the test on error.
    #[track_caller]
    pub fn start_coordinator(&mut self, extra: &[&str]) {
        must(self.try_start_coordinator(extra));
    }

    /// Starts agent `id` with its own PATH (a private bin dir plus /usr/local/bin:/usr/bin:/bin),
    /// env and state.
    pub fn try_start_agent(&mut self, id: &str, spec: &AgentSpec) -> Result<()> {
        let home = self.work.path().join(format!("host-{id}"));
        let bin_dir = home.join("bin");
        let create = |dir: &PathBuf| {
            std::fs::create_dir_all(dir)
                .map_err(|e| TestkitError::io(format!("cannot create {}", dir.display()), e))
        };
        create(&bin_dir)?;
        for (name, script) in &spec.binaries {
            try_write_file(&bin_dir.join(name), script, true)?;
        }
        let tls = stem_files(self.pki.root(), &format!("agent-{id}"));
        let coordinators = self
            .agent_coordinators
            .clone()
            .unwrap_or_else(|| self.url());
        let mut launch = AgentLaunch::new(id, &coordinators, tls, &home);
        launch.path = format!("{}:{}", bin_dir.display(), launch.path);
        launch.log = "info,toolsrv_agent=debug".into();
        launch.recheck_secs = Some(1);
        launch.max_concurrent = spec.max_concurrent;
        launch.labels.clone_from(&spec.labels);
        launch.env.clone_from(&spec.env);
        launch.env_os.clone_from(&spec.env_os);
        launch.enroll.clone_from(&spec.enroll);
        // Agents are confined: test tools leave marks in the one directory they may write.
        launch.args = std::iter::once(format!("--sandbox-write={}", self.marks().display()))
            .chain(spec.args.iter().cloned())
            .collect();
        if !spec.local_tools.is_empty() {
            let dir = home.join("local-tools");
            create(&dir)?;
            for (file, content, exe) in &spec.local_tools {
                try_write_file(&dir.join(file), content, *exe)?;
            }
            launch.tools = Some(dir);
        }
        let proc = launch.start(&try_bin("toolsrv")?, self.work.path())?;
        self.agents.insert(id.to_string(), proc);
        Ok(())
    }

    /// [`TestFleet::try_start_agent`], failing the test on error.
    #[track_caller]
    pub fn start_agent(&mut self, id: &str, spec: &AgentSpec) {
        must(self.try_start_agent(id, spec));
    }

    /// The one directory every agent's calls may write besides their own: where test tools
    /// leave marks for the test to see (the agents are confined, `--sandbox-write`).
    pub fn marks(&self) -> PathBuf {
        self.work.path().join("marks")
    }

    /// Writes `json` as a coordinator policy file (`policy.json` in the work directory) and
    /// returns the `--policy=PATH` argument that gives it to the coordinator.
    #[track_caller]
    pub fn policy_arg(&self, json: &str) -> String {
        let path = self.work.path().join("policy.json");
        write_file(&path, json, false);
        format!("--policy={}", path.display())
    }

    /// Puts `json` in place of the policy file of [`TestFleet::policy_arg`] with `mode`, whole,
    /// as an editor saving by rename does (a look between a truncation and a write would see an
    /// empty file); a running coordinator follows it.
    #[track_caller]
    pub fn replace_policy(&self, json: &str, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        let path = self.work.path().join("policy.json");
        let new = self.work.path().join("policy.json.new");
        must(
            std::fs::write(&new, json).map_err(|e| TestkitError::io(new.display().to_string(), e)),
        );
        must(
            std::fs::set_permissions(&new, std::fs::Permissions::from_mode(mode))
                .map_err(|e| TestkitError::io(new.display().to_string(), e)),
        );
        must(
            std::fs::rename(&new, &path)
                .map_err(|e| TestkitError::io(path.display().to_string(), e)),
        );
    }

    /// Where the coordinator writes its audit log when given [`TestFleet::audit_arg`].
    pub fn audit_log(&self) -> PathBuf {
        self.work.path().join("audit.jsonl")
    }

    /// `--audit-log=PATH` for [`TestFleet::audit_log`].
    pub fn audit_arg(&self) -> String {
        format!("--audit-log={}", self.audit_log().display())
    }

    /// Makes [`TestFleet::audit_log`] a symbolic link to `target` (`/dev/full` for a full disk,
    /// a file for room again), replacing what is there, and has the coordinator reopen it
    /// ([`TestFleet::reopen_audit_log`]).
    #[track_caller]
    pub fn point_audit_log_at(&self, target: &std::path::Path) {
        let next = self.work.path().join("audit-next.jsonl");
        let _ = std::fs::remove_file(&next);
        must(
            std::os::unix::fs::symlink(target, &next)
                .and_then(|()| std::fs::rename(&next, self.audit_log()))
                .map_err(|e| TestkitError::io("cannot point the audit log elsewhere", e)),
        );
        self.reopen_audit_log();
    }

    /// Sends the coordinator SIGHUP, which reopens its audit log by its path (as logrotate
    /// does), and returns once it says it has.
    #[track_caller]
    pub fn reopen_audit_log(&self) {
        const REOPENED: &str = "SIGHUP: audit log reopened";
        let Some(coordinator) = self.coordinator.as_ref() else {
            panic!("reopen_audit_log: no coordinator is running");
        };
        let before = coordinator.log().matches(REOPENED).count();
        must(
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(coordinator.pid()),
                nix::sys::signal::Signal::SIGHUP,
            )
            .map_err(|e| {
                TestkitError::io("cannot signal the coordinator", std::io::Error::from(e))
            }),
        );
        let reopened = crate::wait::try_wait_for(
            "the coordinator to reopen its audit log",
            Duration::from_secs(20),
            || (coordinator.log().matches(REOPENED).count() > before).then_some(()),
        );
        if let Err(e) = reopened {
            // What the coordinator said meanwhile tells a refused reopen from a slow one.
            let log = coordinator.log();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            panic!(
                "{e}; the coordinator's last lines, newest first:\n{}",
                tail.join("\n")
            );
        }
    }

    /// The records of [`TestFleet::audit_log`] so far.
    pub fn audit_records(&self) -> Vec<Value> {
        crate::files::json_lines(&self.audit_log())
    }

    /// The private bin directory of agent `id` (to install a binary while it runs).
    pub fn agent_bin(&self, id: &str) -> PathBuf {
        self.work.path().join(format!("host-{id}/bin"))
    }

    /// Runs `toolctl` as client `alice` against this fleet, with a bounded wait.
    pub fn toolctl(&self, args: &[&str]) -> Output {
        self.toolctl_as("client-alice", args, None)
    }

    pub fn toolctl_as(&self, stem: &str, args: &[&str], stdin: Option<&str>) -> Output {
        run_bounded(
            self.toolctl_command(stem, args),
            stdin,
            Duration::from_secs(60),
        )
    }

    /// A `toolctl` command set up to reach this fleet with certificate `stem`, for tests that
    /// need to watch it run (stream its output, kill it).
    #[track_caller]
    pub fn toolctl_command(&self, stem: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(must(try_bin("toolctl")));
        cmd.args(args)
            .envs(client_env(&self.url(), &stem_files(self.pki.root(), stem)));
        cmd
    }

    /// `toolctl` as `stem` in a new session, so that it has no controlling terminal to ask on;
    /// bounded like [`TestFleet::toolctl_as`].
    pub fn toolctl_detached(&self, stem: &str, args: &[&str]) -> Output {
        let inner = self.toolctl_command(stem, args);
        let mut cmd = Command::new("setsid");
        // --wait: the command is made a group leader, so setsid forks; wait for the child.
        cmd.arg("--wait")
            .arg(inner.get_program())
            .args(inner.get_args());
        for (k, v) in inner.get_envs() {
            if let Some(v) = v {
                cmd.env(k, v);
            }
        }
        run_bounded(cmd, None, Duration::from_secs(60))
    }

    /// `toolctl hosts --json`, parsed.
    pub fn hosts(&self) -> Vec<Value> {
        let out = self.toolctl(&["hosts", "--json"]);
        assert!(
            out.status.success(),
            "toolctl hosts failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        match serde_json::from_slice(&out.stdout) {
            Ok(hosts) => hosts,
            Err(e) => panic!("toolctl hosts --json printed no JSON list: {e}"),
        }
    }

    /// `toolctl tools HOST --all --json`, parsed; `None` while the host has no view yet.
    pub fn tools(&self, host: &str) -> Option<Vec<Value>> {
        let out = self.toolctl(&["tools", host, "--all", "--json"]);
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice::<Vec<Value>>(&out.stdout)
            .ok()
            .filter(|t| !t.is_empty())
    }

    /// Waits until `toolctl hosts` lists `host` in `state` (`online`, `offline`, ...).
    pub fn wait_state(&self, host: &str, state: &str, limit: Duration) {
        wait_for(&format!("host {host} to be {state}"), limit, || {
            self.hosts()
                .iter()
                .any(|h| h["host_id"] == host && h["state"] == state)
                .then_some(())
        });
    }

    /// Waits until every named host is online and has reported a view with `tool` in it.
    pub fn wait_online(&self, hosts: &[&str], tool: &str) {
        for host in hosts {
            wait_for(
                &format!("host {host} to report {tool}"),
                Duration::from_secs(30),
                || {
                    self.tools(host)
                        .filter(|t| t.iter().any(|e| e["name"] == tool))
                },
            );
        }
    }
}
