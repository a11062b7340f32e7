//! What an agent is told at start-up: where the coordinator is, who it is, where its state lives.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::backoff::Backoff;

/// Calls run at once unless configured otherwise.
pub const DEFAULT_MAX_CONCURRENT_CALLS: u32 = 16;
/// How often the host is re-evaluated unless configured otherwise.
pub const DEFAULT_RECHECK_EVERY: Duration = Duration::from_secs(3);
/// How long in-flight calls may run on after shutdown is requested, unless configured otherwise.
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(10);

/// Everything [`crate::run`] needs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The coordinator's agent-link URL, e.g. `https://127.0.0.1:7443`.
    pub coordinator: String,
    /// This host's id; must match the id in the agent certificate (case-insensitively: both are
    /// lowercased, see [`toolsrv_tls::normalize_name`]).
    pub host_id: String,
    /// The agent's certificate, key and the CA the coordinator must chain to.
    pub tls: toolsrv_tls::TlsFiles,
    /// Host-only tool directories, served besides the shipped catalog (shipped tools win a name clash).
    pub tools: Vec<PathBuf>,
    /// Operator-given labels reported in the host facts.
    pub labels: BTreeMap<String, String>,
    /// `<state>/blobs/<sha256>` is the executable cache (kept across restarts),
    /// `<state>/catalog/` the materialized shipped catalog.
    pub state_dir: PathBuf,
    /// Calls run at once; further calls wait in a queue (their timeout counts from their start).
    pub max_concurrent_calls: u32,
    /// Per-call timeout and output limits.
    pub limits: toolsrv_host::Limits,
    /// Working directory of calls that do not ask for one.
    pub workdir: PathBuf,
    /// How often variants are re-evaluated against the host; a changed view is re-reported.
    pub recheck_every: Duration,
    /// Reconnect delays.
    pub backoff: Backoff,
    /// On shutdown, how long in-flight calls may finish before they are cancelled.
    pub drain_grace: Duration,
    /// A link whose queue to the coordinator stays full this long with the coordinator reading
    /// none of it is given up on (and connected again) instead of waited on for ever.
    pub stalled_after: Duration,
    /// How calls are confined. `hidden` lists private files beyond the ones the agent hides
    /// anyway: its state directory and TLS files (and the directory of its key).
    pub sandbox: toolsrv_confine::Settings,
    /// Where to serve Prometheus metrics (`GET /metrics`, plain HTTP); off when `None`.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Enrollment (`--join`, or a certificate enrolled earlier in the state directory): `tls`
    /// and `host_id` then come from `<state>/enroll/`, and the certificate is kept renewed.
    /// `None`: the certificate files of `tls` are used as they are.
    pub enroll: Option<crate::enroll::EnrollConfig>,
    /// Directories put before the agent's own `PATH` for its tools: where `binary` matches look
    /// and the `PATH` calls get (`toolsrv up`: the directory where it links `toolsrv` and
    /// `toolctl`).
    pub path_first: Vec<PathBuf>,
}

impl AgentConfig {
    /// A configuration with the defaults for everything but the essentials; `host_id` is stored
    /// lowercase.
    pub fn new(
        coordinator: impl Into<String>,
        host_id: impl Into<String>,
        tls: toolsrv_tls::TlsFiles,
        state_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            coordinator: coordinator.into(),
            host_id: toolsrv_tls::normalize_name(&host_id.into()),
            tls,
            tools: Vec::new(),
            labels: BTreeMap::new(),
            state_dir: state_dir.into(),
            max_concurrent_calls: DEFAULT_MAX_CONCURRENT_CALLS,
            limits: toolsrv_host::Limits::agent(),
            workdir: std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")),
            recheck_every: DEFAULT_RECHECK_EVERY,
            backoff: Backoff::default(),
            drain_grace: DEFAULT_DRAIN_GRACE,
            stalled_after: toolsrv_proto::outbound::DEFAULT_STALLED_AFTER,
            sandbox: toolsrv_confine::Settings::new(Vec::new()),
            metrics_listen: None,
            enroll: None,
            path_first: Vec::new(),
        }
    }

    /// What no call may reach: the configured hidden paths, the state directory, the TLS files,
    /// and the directory holding the key unless it is one of the system directories calls read
    /// (then only the files are hidden).
    pub fn hidden_paths(&self) -> Vec<PathBuf> {
        let mut hidden = self.sandbox.hidden.clone();
        hidden.push(self.state_dir.clone());
        for file in [&self.tls.key, &self.tls.cert, &self.tls.ca] {
            hidden.push(file.clone());
        }
        if let Some(dir) = self.tls.key.parent().filter(|d| !d.as_os_str().is_empty()) {
            let system = toolsrv_confine::SYSTEM_READ
                .iter()
                .any(|s| std::path::Path::new(s) == dir)
                || dir == std::path::Path::new("/");
            if !system {
                hidden.push(dir.to_path_buf());
            }
        }
        hidden
    }

    /// Where the shipped catalog is materialized.
    pub fn catalog_dir(&self) -> PathBuf {
        self.state_dir.join("catalog")
    }

    /// Where shipped executables are cached by SHA-256.
    pub fn blobs_dir(&self) -> PathBuf {
        self.state_dir.join("blobs")
    }
}
