//! Test harness: a development PKI, and coordinator and agent processes on loopback ports.
//!
//! Every process runs in its own process group and is killed when its handle drops; every wait
//! is bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)] // A harness that cannot set up should fail loudly.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A built binary of this workspace (`toolsrv`, `toolctl`), next to the test executable's
/// directory. Fails, saying how to fix it, when the binary is missing or older than a source it
/// is built from: `cargo test -p toolsrv-tests` alone does not rebuild the binaries, and a test
/// of stale binaries passes or fails for the wrong reasons.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace binaries first (cargo build --bins)",
        path.display()
    );
    let built = std::fs::metadata(&path).and_then(|m| m.modified()).unwrap();
    // The crates each binary is not built from: a change there does not relink it.
    let not_built_from: &[&str] = match name {
        "toolsrv" => &["client", "bench"],
        "toolctl" => &["server", "coordinator", "agent", "bench"],
        _ => &["bench"],
    };
    if let Some((source, changed)) = newest_source(not_built_from)
        && changed > built
    {
        panic!(
            "{} is older than {}: rebuild the binaries (cargo build --bins), or run the tests \
             with cargo test --workspace, which builds them",
            path.display(),
            source.display()
        );
    }
    path
}

/// The most recently modified source a binary is built from: the crates but `skip_crates`,
/// the protocol, the embedded example tools and the lock file.
fn newest_source(skip_crates: &[&str]) -> Option<(PathBuf, std::time::SystemTime)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()?
        .to_path_buf();
    let skip: Vec<PathBuf> = skip_crates
        .iter()
        .map(|c| root.join("crates").join(c))
        .collect();
    let mut newest: Option<(PathBuf, std::time::SystemTime)> = None;
    let mut consider = |path: PathBuf| {
        if let Ok(modified) = std::fs::metadata(&path).and_then(|m| m.modified())
            && newest.as_ref().is_none_or(|(_, t)| modified > *t)
        {
            newest = Some((path, modified));
        }
    };
    consider(root.join("Cargo.lock"));
    let mut dirs = vec![
        root.join("crates"),
        root.join("proto"),
        root.join("examples/tools"),
    ];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            // Tests and benches are not part of the binaries.
            if ["target", "tests", "benches"].contains(&name.to_string_lossy().as_ref())
                || skip.contains(&path)
            {
                continue;
            }
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(path);
            } else {
                consider(path);
            }
        }
    }
    newest
}

/// Polls `f` until it returns `Some`, for at most `limit`.
pub fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A free port on 127.0.0.1 (bound then released; good enough for tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A development PKI in a temporary directory.
#[derive(Debug)]
pub struct Pki {
    pub dir: tempfile::TempDir,
}

impl Pki {
    pub fn new(agents: &[&str], clients: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(bin("toolsrv"))
            .args(["pki", "init"])
            .arg(dir.path())
            .arg(format!("--agents={}", agents.join(",")))
            .arg(format!("--clients={}", clients.join(",")))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pki init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir }
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// Writes `<stem>.pem` and `<stem>-key.pem`: a clientAuth certificate from this PKI's CA
    /// whose identity URI is `uri` exactly as given (`pki init` would write the name lowercase),
    /// as another CA might issue it.
    pub fn issue_raw(&self, stem: &str, uri: &str) {
        let read = |name: &str| std::fs::read_to_string(self.path(name)).unwrap();
        let ca_key = rcgen::KeyPair::from_pem(&read("ca-key.pem")).unwrap();
        let issuer = rcgen::Issuer::from_ca_cert_pem(&read("ca.pem"), ca_key).unwrap();
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into().unwrap())];
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &issuer).unwrap();
        std::fs::write(self.path(&format!("{stem}.pem")), cert.pem()).unwrap();
        std::fs::write(self.path(&format!("{stem}-key.pem")), key.serialize_pem()).unwrap();
    }

    /// `--ca/--cert/--key` for a certificate stem such as `agent-web-1` or `client-alice`.
    pub fn tls_args(&self, stem: &str) -> Vec<String> {
        vec![
            format!("--ca={}", self.path("ca.pem").display()),
            format!("--cert={}", self.path(&format!("{stem}.pem")).display()),
            format!("--key={}", self.path(&format!("{stem}-key.pem")).display()),
        ]
    }
}

/// A child process killed (with its whole process group) on drop.
#[derive(Debug)]
pub struct Proc {
    pub child: Child,
    pub name: String,
    log: PathBuf,
}

impl Proc {
    /// Starts `cmd` in its own process group, output to `<log_dir>/<name>.log` (printed if the test fails).
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Self {
        let log = log_dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Self {
            child,
            name: name.to_string(),
            log,
        }
    }

    /// The process's output so far, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGKILL to the whole group: the host vanishes without a goodbye.
    pub fn kill(&mut self) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.pid()),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }

    /// SIGTERM, then a bounded wait for a clean exit.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid()),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
        if std::thread::panicking() {
            eprintln!("----- {} log -----\n{}", self.name, self.log());
        }
    }
}

/// A fleet under test: one PKI, one coordinator, any number of agents, each with its own
/// `PATH`, environment, files and state.
#[derive(Debug)]
pub struct Fleet {
    pub pki: Pki,
    pub work: tempfile::TempDir,
    pub port: u16,
    pub tools: PathBuf,
    pub coordinator: Option<Proc>,
    pub agents: BTreeMap<String, Proc>,
}

/// How to start one agent.
#[derive(Debug, Default, Clone)]
pub struct AgentSpec {
    /// Executables to put on this agent's private `PATH` dir: (name, script).
    pub binaries: Vec<(String, String)>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// Labels.
    pub labels: Vec<(String, String)>,
    /// Host-only tool directory contents: (file, content, executable).
    pub local_tools: Vec<(String, String, bool)>,
    pub max_concurrent: Option<u32>,
    /// Extra command-line arguments (`--sandbox off`, `--run-as nobody`, ...).
    pub args: Vec<String>,
}

impl Fleet {
    /// A PKI for `agents` (plus `alice` and `bob` clients) and an empty tools directory.
    pub fn new(agents: &[&str]) -> Self {
        let pki = Pki::new(agents, &["alice", "bob"]);
        let work = tempfile::tempdir().unwrap();
        let tools = work.path().join("tools");
        std::fs::create_dir_all(&tools).unwrap();
        std::fs::create_dir_all(work.path().join("marks")).unwrap();
        Self {
            pki,
            work,
            port: free_port(),
            tools,
            coordinator: None,
            agents: BTreeMap::new(),
        }
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// Writes a tool file into the coordinator's tools directory.
    pub fn tool(&self, file: &str, content: &str, executable: bool) {
        write_file(&self.tools.join(file), content, executable);
    }

    pub fn start_coordinator(&mut self, extra: &[&str]) {
        let mut cmd = Command::new(bin("toolsrv"));
        cmd.arg("coordinator")
            .arg(format!("--listen=127.0.0.1:{}", self.port))
            .arg(format!("--tools={}", self.tools.display()))
            .args(self.pki.tls_args("coordinator"))
            .args(["--rescan-secs=1"])
            .args(extra)
            .env("TOOLSRV_LOG", "info,toolsrv_coordinator=debug");
        self.coordinator = Some(Proc::spawn("coordinator", cmd, self.work.path()));
        let port = self.port;
        wait_for("the coordinator to listen", Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).ok()
        });
    }

    /// Starts agent `id` with its own PATH (a private bin dir plus /usr/bin:/bin), env and state.
    pub fn start_agent(&mut self, id: &str, spec: &AgentSpec) {
        let home = self.work.path().join(format!("host-{id}"));
        let bin_dir = home.join("bin");
        std::fs::create_dir_all(&bin_dir).unwrap();
        for (name, script) in &spec.binaries {
            write_file(&bin_dir.join(name), script, true);
        }
        let mut cmd = Command::new(bin("toolsrv"));
        cmd.arg("agent")
            .arg(format!("--coordinator={}", self.url()))
            .arg(format!("--host-id={id}"))
            .args(self.pki.tls_args(&format!("agent-{id}")))
            .arg(format!("--state-dir={}", home.join("state").display()))
            .arg(format!("--workdir={}", home.display()))
            .arg("--recheck-secs=1")
            .arg(format!("--sandbox-write={}", self.marks().display()))
            .args(&spec.args)
            .env_clear()
            .env(
                "PATH",
                format!("{}:/usr/local/bin:/usr/bin:/bin", bin_dir.display()),
            )
            .env("HOME", &home)
            .env("TOOLSRV_LOG", "info,toolsrv_agent=debug");
        if let Some(n) = spec.max_concurrent {
            cmd.arg(format!("--max-concurrent-calls={n}"));
        }
        for (k, v) in &spec.labels {
            cmd.arg(format!("--label={k}={v}"));
        }
        if !spec.local_tools.is_empty() {
            let dir = home.join("local-tools");
            std::fs::create_dir_all(&dir).unwrap();
            for (file, content, exe) in &spec.local_tools {
                write_file(&dir.join(file), content, *exe);
            }
            cmd.arg(format!("--tools={}", dir.display()));
        }
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        let proc = Proc::spawn(&format!("agent-{id}"), cmd, self.work.path());
        self.agents.insert(id.to_string(), proc);
    }

    /// The one directory every agent's calls may write besides their own: where test tools
    /// leave marks for the test to see (the agents are confined, `--sandbox-write`).
    pub fn marks(&self) -> PathBuf {
        self.work.path().join("marks")
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
    pub fn toolctl_command(&self, stem: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(bin("toolctl"));
        cmd.args(args)
            .env("TOOLSRV_ADDR", self.url())
            .env("TOOLSRV_CA", self.pki.path("ca.pem"))
            .env("TOOLSRV_CERT", self.pki.path(&format!("{stem}.pem")))
            .env("TOOLSRV_KEY", self.pki.path(&format!("{stem}-key.pem")));
        cmd
    }

    /// `toolctl hosts --json`, parsed.
    pub fn hosts(&self) -> Vec<Value> {
        let out = self.toolctl(&["hosts", "--json"]);
        assert!(
            out.status.success(),
            "toolctl hosts failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
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

pub fn write_file(path: &Path, content: &str, executable: bool) {
    let tmp = path.with_extension("tmp-write");
    std::fs::write(&tmp, content).unwrap();
    let mode = if executable { 0o755 } else { 0o644 };
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Runs a command to completion with a bounded wait, feeding `stdin` if given.
pub fn run_bounded(mut cmd: Command, stdin: Option<&str>, limit: Duration) -> Output {
    use std::io::Write;
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .process_group(0);
    let mut child = cmd.spawn().unwrap();
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            panic!("{cmd:?} did not finish within {limit:?}");
        }
    }
}

/// Waits (bounded) for `child`, started with piped output, to exit and returns its output.
pub fn finish_child(child: Child, limit: Duration) -> Output {
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            panic!("process {pid} did not finish within {limit:?}");
        }
    }
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
