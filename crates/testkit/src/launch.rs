//! The command lines of `toolsrv coordinator`, `toolsrv agent` and `toolctl`, in one place for
//! the tests and the benches: a new flag is wired here.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use toolsrv_tls::TlsFiles;

use crate::error::{Result, TestkitError};
use crate::pki::tls_args;
use crate::proc::Proc;

/// How long a coordinator may take to listen.
const LISTEN_WAIT: Duration = Duration::from_secs(20);

/// How to start one `toolsrv coordinator` on 127.0.0.1.
#[derive(Debug, Clone)]
pub struct CoordinatorLaunch {
    pub port: u16,
    /// The tools path (`--tools`).
    pub tools: PathBuf,
    pub tls: TlsFiles,
    /// `TOOLSRV_LOG`.
    pub log: String,
    /// Further flags.
    pub args: Vec<String>,
}

impl CoordinatorLaunch {
    pub fn new(port: u16, tools: &Path, tls: TlsFiles) -> Self {
        Self {
            port,
            tools: tools.to_path_buf(),
            tls,
            log: "info".into(),
            args: Vec::new(),
        }
    }

    /// Where agents and clients reach it.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The command, run with the `toolsrv` binary `toolsrv`. The caller's `TOOLSRV_*` variables
    /// are not passed on (the coordinator reads its settings from them): its flags alone
    /// configure it, whatever the shell that runs the tests or benches exported (a
    /// `TOOLSRV_FIND_MODEL` meant for the bench's fused run made its lexical one rank by
    /// meaning).
    pub fn command(&self, toolsrv: &Path) -> Command {
        let mut cmd = Command::new(toolsrv);
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("TOOLSRV_") {
                cmd.env_remove(name);
            }
        }
        cmd.arg("coordinator")
            .arg(format!("--listen=127.0.0.1:{}", self.port))
            .arg(flag("--tools=", &self.tools))
            .args(tls_args(&self.tls))
            .args(&self.args)
            .env("TOOLSRV_LOG", &self.log);
        cmd
    }

    /// Starts it as process `name` (log in `log_dir`) and waits (at most 20 s) until it accepts
    /// connections; an error with its log if it exits first.
    pub fn start(&self, toolsrv: &Path, name: &str, log_dir: &Path) -> Result<Proc> {
        let mut proc = Proc::try_spawn(name, self.command(toolsrv), log_dir)?;
        let deadline = Instant::now() + LISTEN_WAIT;
        // Another process may hold the port (ports are picked free, then released): a
        // connection must reach this coordinator, not that one.
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err()
            || !crate::proc::listens_on(proc.pid(), self.port)
        {
            proc.check_alive()?;
            if Instant::now() > deadline {
                return Err(TestkitError::Timeout {
                    what: format!("{name} to listen on 127.0.0.1:{}", self.port),
                    limit: LISTEN_WAIT,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(proc)
    }
}

/// How to start one `toolsrv agent`: its host id, certificate, home (state under
/// `<home>/state`, working directory `<home>`), and a cleared environment but for `PATH`,
/// `HOME`, `TOOLSRV_LOG` and `env`.
#[derive(Debug, Clone)]
pub struct AgentLaunch {
    pub id: String,
    /// The coordinator's URL.
    pub coordinator: String,
    pub tls: TlsFiles,
    pub home: PathBuf,
    /// `PATH`.
    pub path: String,
    /// `TOOLSRV_LOG`.
    pub log: String,
    /// Host-only tools (`--tools`).
    pub tools: Option<PathBuf>,
    /// `--label KEY=VALUE`s.
    pub labels: Vec<(String, String)>,
    /// `--max-concurrent-calls`.
    pub max_concurrent: Option<u32>,
    /// `--recheck-secs`.
    pub recheck_secs: Option<u32>,
    /// Further flags.
    pub args: Vec<String>,
    /// Further environment variables (after the ones above: they may replace them).
    pub env: Vec<(String, String)>,
    /// Further environment variables that need not be UTF-8.
    pub env_os: Vec<(std::ffi::OsString, std::ffi::OsString)>,
    /// Run under `prlimit --as=BYTES`: a cap on its address space.
    pub address_space: Option<u64>,
    /// Run enrolled: these flags (`--join TOKEN`, `--ca-pin PIN`, or none for an agent enrolled
    /// before) instead of `--host-id` and the certificate files, which come from the state
    /// directory.
    pub enroll: Option<Vec<String>>,
}

impl AgentLaunch {
    pub fn new(id: &str, coordinator: &str, tls: TlsFiles, home: &Path) -> Self {
        Self {
            id: id.to_string(),
            coordinator: coordinator.to_string(),
            tls,
            home: home.to_path_buf(),
            path: "/usr/local/bin:/usr/bin:/bin".into(),
            log: "info".into(),
            tools: None,
            labels: Vec::new(),
            max_concurrent: None,
            recheck_secs: None,
            args: Vec::new(),
            env: Vec::new(),
            env_os: Vec::new(),
            address_space: None,
            enroll: None,
        }
    }

    /// The command, run with the `toolsrv` binary `toolsrv`.
    pub fn command(&self, toolsrv: &Path) -> Command {
        let mut cmd = match self.address_space {
            Some(bytes) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--as={bytes}")).arg("--").arg(toolsrv);
                c
            }
            None => Command::new(toolsrv),
        };
        cmd.arg("agent")
            .arg(format!("--coordinator={}", self.coordinator));
        match &self.enroll {
            Some(flags) => cmd.args(flags),
            None => cmd
                .arg(format!("--host-id={}", self.id))
                .args(tls_args(&self.tls)),
        };
        cmd.arg(format!("--state-dir={}", self.home.join("state").display()))
            .arg(format!("--workdir={}", self.home.display()));
        if let Some(secs) = self.recheck_secs {
            cmd.arg(format!("--recheck-secs={secs}"));
        }
        if let Some(n) = self.max_concurrent {
            cmd.arg(format!("--max-concurrent-calls={n}"));
        }
        for (k, v) in &self.labels {
            cmd.arg(format!("--label={k}={v}"));
        }
        if let Some(tools) = &self.tools {
            cmd.arg(flag("--tools=", tools));
        }
        cmd.args(&self.args)
            .env_clear()
            .env("PATH", &self.path)
            .env("HOME", &self.home)
            .env("TOOLSRV_LOG", &self.log);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        for (k, v) in &self.env_os {
            cmd.env(k, v);
        }
        cmd
    }

    /// Creates its home and starts it as process `agent-<id>`, its log in `log_dir`.
    pub fn start(&self, toolsrv: &Path, log_dir: &Path) -> Result<Proc> {
        std::fs::create_dir_all(&self.home)
            .map_err(|e| TestkitError::io(format!("cannot create {}", self.home.display()), e))?;
        Proc::try_spawn(
            &format!("agent-{}", self.id),
            self.command(toolsrv),
            log_dir,
        )
    }
}

/// The environment that points `toolctl` at coordinator `url` with the certificate `tls`, as a
/// user would set it up.
pub fn client_env(url: &str, tls: &TlsFiles) -> [(&'static str, OsString); 4] {
    [
        ("TOOLSRV_ADDR", url.into()),
        ("TOOLSRV_CA", tls.ca.clone().into()),
        ("TOOLSRV_CERT", tls.cert.clone().into()),
        ("TOOLSRV_KEY", tls.key.clone().into()),
    ]
}

/// `--flag=` and a path, the path's bytes as they are (`display()` would put U+FFFD in place of
/// bytes that are not UTF-8, and name another path).
fn flag(name: &str, path: &Path) -> std::ffi::OsString {
    let mut arg = std::ffi::OsString::from(name);
    arg.push(path);
    arg
}
