//! Command-line flags (each also settable from the environment, and from a configuration file:
//! `config`) and dispatch.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use toolsrv_agent::AgentConfig;
use toolsrv_coordinator::CoordinatorConfig;
use toolsrv_registry::split_tools_path;
use toolsrv_tls::TlsFiles;

/// This binary, for a process to start it again (the calls' warden, see `toolsrv_confine::warden`)
pub const SELF_EXE: &str = "/proc/self/exe";

/// The toolsrv server.
#[derive(Debug, Parser)]
#[command(
    name = "toolsrv",
    version,
    about = "Remote tool server: coordinator, agent, PKI"
)]
pub struct Cli {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args)]
pub struct LogArgs {
    /// Log filter, e.g. `info` or `toolsrv_coordinator=debug`
    #[arg(long, global = true, env = "TOOLSRV_LOG", default_value = "info", value_parser = log_filter)]
    log_level: String,
    /// `text`, or `json` (one JSON object per line)
    #[arg(
        long,
        global = true,
        env = "TOOLSRV_LOG_FORMAT",
        default_value = "text",
        value_parser = ["text", "json"]
    )]
    log_format: String,
}

impl LogArgs {
    /// How an agent starts its calls' warden: this binary, logging as this process does
    pub fn warden(&self) -> toolsrv_confine::warden::WardenStart {
        let mut env: Vec<(std::ffi::OsString, std::ffi::OsString)> = vec![
            ("TOOLSRV_LOG".into(), self.log_level.clone().into()),
            ("TOOLSRV_LOG_FORMAT".into(), self.log_format.clone().into()),
        ];
        if let Some(no_colour) = std::env::var_os("NO_COLOR") {
            env.push(("NO_COLOR".into(), no_colour));
        }
        toolsrv_confine::warden::WardenStart {
            program: SELF_EXE.into(),
            env,
        }
    }

    /// The logging of a warden: as its agent's, from the environment the agent gave it
    pub fn of_warden() -> Self {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
        Self {
            log_level: var("TOOLSRV_LOG", "info"),
            log_format: var("TOOLSRV_LOG_FORMAT", "text"),
        }
    }
}

/// A log filter as `tracing` reads it, refused here rather than replaced by `info` unseen.
fn log_filter(value: &str) -> Result<String, String> {
    tracing_subscriber::EnvFilter::try_new(value)
        .map(|_| value.to_string())
        .map_err(|e| {
            format!("{e} (a level such as `info`, or `target=level` pairs joined by commas)")
        })
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the catalog to agents and the client API to clients (mTLS)
    Coordinator(Box<CoordinatorArgs>),
    /// Connect this host to a coordinator, report its tools and run calls
    Agent(Box<AgentArgs>),
    /// Development certificates
    #[command(subcommand)]
    Pki(PkiCommand),
    /// A coordinator, a local agent, development certificates and the example tools, in one process
    Up(crate::up::UpArgs),
    /// Ask to run a command outside the call's sandbox: `toolsrv bypass --reason TEXT -- CMD ARGS...`
    Bypass(crate::bypass::BypassArgs),
    /// Policy files, without a coordinator
    #[command(subcommand)]
    Policy(PolicyCommand),
}

#[derive(Debug, Subcommand)]
enum PolicyCommand {
    /// Check a policy (and host labels) file as the coordinator reads it, and say what it
    /// decides for one call: `toolsrv policy check FILE --client NAME --tool NAME --host ID`
    Check(crate::policy_check::PolicyCheckArgs),
}

/// TLS files, shared by both roles. Each is needed, as a flag or from the environment: they are
/// options to clap so that its usage line does not claim a flag is needed when its variable is
/// set; [`Required`] checks them.
#[derive(Debug, Args, Clone)]
pub struct TlsArgs {
    /// CA certificate (PEM) that peers must chain to. Needed
    #[arg(long, env = "TOOLSRV_CA", value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// This process's certificate (PEM). Needed
    #[arg(long, env = "TOOLSRV_CERT", value_name = "FILE")]
    pub cert: Option<PathBuf>,
    /// This process's private key (PEM). Needed
    #[arg(long, env = "TOOLSRV_KEY", value_name = "FILE")]
    pub key: Option<PathBuf>,
}

impl TlsArgs {
    fn files(&self, needed: &mut Required) -> Option<TlsFiles> {
        let ca = needed.take(&self.ca, "--ca", "TOOLSRV_CA");
        let cert = needed.take(&self.cert, "--cert", "TOOLSRV_CERT");
        let key = needed.take(&self.key, "--key", "TOOLSRV_KEY");
        Some(TlsFiles {
            ca: ca?,
            cert: cert?,
            key: key?,
        })
    }
}

/// Settings that are needed but may come from a flag or from the environment; collects the
/// missing ones so that one error names them all.
#[derive(Debug, Default)]
struct Required {
    missing: Vec<String>,
}

impl Required {
    fn take<T: Clone>(&mut self, value: &Option<T>, flag: &str, env: &str) -> Option<T> {
        if value.is_none() {
            self.missing.push(format!("{flag} (or {env})"));
        }
        value.clone()
    }

    fn check(self, command: &str) -> anyhow::Result<()> {
        if self.missing.is_empty() {
            return Ok(());
        }
        bail!(
            "{command}: missing {}: give each as a flag, in its environment variable or in \
             the configuration file (`toolsrv {command} --help` lists them)",
            self.missing.join(", ")
        )
    }
}

#[derive(Debug, Args)]
pub struct CoordinatorArgs {
    #[command(flatten)]
    pub file: crate::config::ConfigArgs,
    /// Address of the mTLS gRPC port (agents and clients)
    #[arg(long, env = "TOOLSRV_LISTEN", default_value = "0.0.0.0:7443")]
    pub listen: SocketAddr,
    /// Address of a plain-text gRPC health port for probes; off when unset
    #[arg(long, env = "TOOLSRV_HEALTH_LISTEN")]
    pub health_listen: Option<SocketAddr>,
    /// Address of a plain-HTTP Prometheus endpoint (`GET /metrics`); off when unset
    #[arg(long, env = "TOOLSRV_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Colon-separated tool directories; the first wins a name clash. Needed
    #[arg(long, env = "OLLIE_TOOLS_PATH", value_name = "PATH")]
    pub tools: Option<std::ffi::OsString>,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Call policy (JSON); everything is allowed without one
    #[arg(long, env = "TOOLSRV_POLICY")]
    pub policy: Option<PathBuf>,
    /// Audit log file (JSON lines); without one, audit records go to the log
    #[arg(long, env = "TOOLSRV_AUDIT_LOG")]
    pub audit_log: Option<PathBuf>,
    /// Keepalive interval on agent links, in milliseconds
    #[arg(long, env = "TOOLSRV_KEEPALIVE_MS", default_value_t = 1000)]
    pub keepalive_ms: u64,
    /// An agent silent this long (milliseconds) is lost and its calls end as LOST
    #[arg(long, env = "TOOLSRV_LOST_AFTER_MS", default_value_t = 3000)]
    pub lost_after_ms: u64,
    /// Keepalives per second (each way) to stay under: beyond this many links, their keepalive
    /// interval (and --lost-after-ms with it) grows in whole seconds, and shrinks back as the
    /// fleet does. 0: always --keepalive-ms
    #[arg(
        long,
        env = "TOOLSRV_MAX_KEEPALIVE_RATE",
        value_name = "PER_SECOND",
        default_value_t = toolsrv_coordinator::DEFAULT_MAX_KEEPALIVE_RATE
    )]
    pub max_keepalive_rate: u32,
    /// Connections from one address (IPv4, or IPv6 /64) in their TLS handshake or before their
    /// first HTTP/2 bytes at once; more are closed as soon as they are accepted. 0: no limit
    #[arg(
        long,
        env = "TOOLSRV_MAX_CONNECTING_PER_ADDRESS",
        value_name = "N",
        default_value_t = toolsrv_tls::MAX_SETTING_UP_PER_ADDRESS
    )]
    pub max_connecting_per_address: usize,
    /// Connections open at once with one certificate identity (one agent, or one client
    /// certificate however many commands share it); more are closed after their handshake.
    /// 0: no limit
    #[arg(
        long,
        env = "TOOLSRV_MAX_CONNECTIONS_PER_IDENTITY",
        value_name = "N",
        default_value_t = toolsrv_tls::MAX_OPEN_PER_IDENTITY
    )]
    pub max_connections_per_identity: usize,
    /// Requests (HTTP/2 streams) open at once with one certificate identity, over all its
    /// connections; more are refused with RESOURCE_EXHAUSTED. 0: no limit
    #[arg(
        long,
        env = "TOOLSRV_MAX_REQUESTS_PER_IDENTITY",
        value_name = "N",
        default_value_t = toolsrv_coordinator::DEFAULT_MAX_REQUESTS_PER_IDENTITY
    )]
    pub max_requests_per_identity: usize,
    /// Bytes one certificate identity may have held at once: answers waiting to leave (sent,
    /// not yet read) and request messages still arriving (`256M`, `1G`); the answer or request
    /// past it is cut short with RESOURCE_EXHAUSTED. 0: no limit
    #[arg(
        long,
        env = "TOOLSRV_MAX_BUFFERED_BYTES_PER_IDENTITY",
        value_name = "SIZE",
        default_value = "256M",
        value_parser = buffered_bytes_arg
    )]
    pub max_buffered_bytes_per_identity: usize,
    /// Rescan the tools path this often (seconds) even without file events
    #[arg(long, env = "TOOLSRV_RESCAN_SECS", default_value_t = 30)]
    pub rescan_secs: u64,
    /// Labels the coordinator assigns to hosts by id glob (JSON: {"db-*": {"role": "db"}});
    /// policy rules match only these, never the labels an agent reports about itself
    #[arg(long, env = "TOOLSRV_HOST_LABELS")]
    pub host_labels: Option<PathBuf>,
    /// Calls one client may have running at once across the fleet (fan-out host calls count);
    /// more are refused with RESOURCE_EXHAUSTED
    #[arg(long, env = "TOOLSRV_MAX_CALLS_PER_CLIENT", default_value_t = 64)]
    pub max_calls_per_client: usize,
    /// Calls one client may have running at once on one host
    #[arg(long, env = "TOOLSRV_MAX_CALLS_PER_CLIENT_HOST", default_value_t = 8)]
    pub max_calls_per_client_host: usize,
    /// Hosts one fan-out may target
    #[arg(long, env = "TOOLSRV_MAX_FANOUT_HOSTS", default_value_t = 4096)]
    pub max_fanout_hosts: usize,
    /// The longest timeout (seconds) a call may ask for; longer ones are refused
    #[arg(long, env = "TOOLSRV_MAX_CALL_TIMEOUT_SECS", default_value_t = 3600)]
    pub max_call_timeout_secs: u64,
    /// Offer only the tools the catalog ships: tools an agent serves from its own `--tools`
    /// directories are listed hidden, saying so, and cannot be called through this coordinator
    #[arg(long, env = "TOOLSRV_REFUSE_HOST_ONLY_TOOLS")]
    pub refuse_host_only_tools: bool,
    /// Most tools of its own (from its `--tools` directories) one host may offer, the first by
    /// name (0: none); the next 4,096 are listed hidden, saying why, the rest left out
    #[arg(long, env = "TOOLSRV_MAX_HOST_ONLY_TOOLS", default_value_t = toolsrv_coordinator::DEFAULT_MAX_HOST_ONLY_TOOLS)]
    pub max_host_only_tools: usize,
    /// With --find-model: texts of one host's own tools the encoder embeds per hour (at least
    /// 33, one tool's); a tool whose host has spent them is found by FindTools once it has more
    #[arg(long, env = "TOOLSRV_MAX_HOST_ONLY_EMBEDS_PER_HOUR", default_value_t = toolsrv_coordinator::DEFAULT_MAX_HOST_ONLY_EMBEDS_PER_HOUR)]
    pub max_host_only_embeds_per_hour: usize,
    /// How long (seconds) a call the policy marks `approve` waits for a decision; then it is denied
    #[arg(long, env = "TOOLSRV_APPROVAL_TIMEOUT_SECS", default_value_t = 60)]
    pub approval_timeout_secs: u64,
    /// How long (seconds) a session lives with no `session watch` (or MCP server) attached
    #[arg(long, env = "TOOLSRV_SESSION_IDLE_SECS", default_value_t = 300)]
    pub session_idle_secs: u64,
    /// Sessions one client may have open at once
    #[arg(long, env = "TOOLSRV_MAX_SESSIONS_PER_CLIENT", default_value_t = 64)]
    pub max_sessions_per_client: usize,
    /// Watch streams (`toolctl watch`, `session watch`, an MCP server's) one client may have
    /// open at once; more are refused with RESOURCE_EXHAUSTED
    #[arg(long, env = "TOOLSRV_MAX_WATCHES_PER_CLIENT", default_value_t = 256)]
    pub max_watches_per_client: usize,
    /// FindTools requests (`toolctl find`, MCP `tool_search`) one client may have in progress
    /// at once; more are refused with RESOURCE_EXHAUSTED
    #[arg(long, env = "TOOLSRV_MAX_FINDS_PER_CLIENT", default_value_t = 8)]
    pub max_finds_per_client: usize,
    /// A sentence encoder (all-MiniLM-L6-v2, or all-mpnet-base-v2: better, slower) for
    /// `toolctl find` and MCP `tool_search` to rank by meaning as well as by words;
    /// `scripts/fetch-find-model [--model NAME]` lays one out
    #[arg(long, env = "TOOLSRV_FIND_MODEL", value_name = "DIR")]
    pub find_model: Option<PathBuf>,
    /// A client-name glob allowed to administer this coordinator (join tokens, revocation);
    /// repeatable (env: comma-separated)
    #[arg(
        long = "admin",
        env = "TOOLSRV_ADMINS",
        value_delimiter = ',',
        default_value = toolsrv_coordinator::DEFAULT_ADMIN
    )]
    pub admins: Vec<String>,
    /// On SIGTERM, how long (seconds) running calls may finish while new ones are refused;
    /// then the rest are ended. A second signal exits at once
    #[arg(long, env = "TOOLSRV_DRAIN_GRACE_SECS", default_value_t = 30)]
    pub drain_grace_secs: u64,
    /// A host offline for longer than this (seconds) leaves the fleet: no longer listed, calls to
    /// it UNKNOWN_HOST, back as a new host if it connects again (nodes an autoscaler removed); 0
    /// keeps every host until the coordinator restarts
    #[arg(
        long,
        env = "TOOLSRV_FORGET_OFFLINE_AFTER_SECS",
        default_value_t = 86_400
    )]
    pub forget_offline_after_secs: u64,
    /// Where the coordinator keeps what must outlive a restart (revocations, join tokens, the
    /// vectors --find-model made of the tools' texts)
    #[arg(long, env = "TOOLSRV_COORDINATOR_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// A certificate revocation list (PEM, several CRLs allowed, or DER): client certificates
    /// it lists are refused and their open connections closed; read again when it changes
    /// (repeatable; env: comma-separated)
    #[arg(
        long = "crl",
        env = "TOOLSRV_CRLS",
        value_delimiter = ',',
        value_name = "FILE"
    )]
    pub crls: Vec<PathBuf>,
    /// Warn in the log and count in the metrics certificates (own, CA, peers') that expire
    /// within this (30s, 15m, 24h, 7d, 2w; 0: never)
    #[arg(
        long,
        env = "TOOLSRV_CERT_EXPIRY_WARNING",
        value_name = "DURATION",
        default_value = "7d",
        value_parser = toolsrv_coordinator::parse_duration
    )]
    pub cert_expiry_warning: Duration,
    /// CA certificate (PEM) that signs the certificates of hosts enrolled with join tokens: the
    /// CA of --ca or an intermediate it signed. Enrollment is off without it
    #[arg(long, env = "TOOLSRV_SIGNING_CA_CERT", value_name = "FILE")]
    pub signing_ca_cert: Option<PathBuf>,
    /// The signing CA's private key (PEM)
    #[arg(long, env = "TOOLSRV_SIGNING_CA_KEY", value_name = "FILE")]
    pub signing_ca_key: Option<PathBuf>,
    /// Lifetime of the certificates enrollment and renewal issue (`24h`, `90s`, `1h30m`);
    /// agents renew at two thirds of it
    #[arg(
        long,
        env = "TOOLSRV_AGENT_CERT_TTL",
        value_name = "DURATION",
        default_value = "24h",
        value_parser = parse_agent_cert_ttl
    )]
    pub agent_cert_ttl: Duration,
    /// Let pods of this Kubernetes service account (NAMESPACE/NAME) join with their projected
    /// service account token, checked with the Kubernetes API (TokenReview); the host id is
    /// the pod's node. Repeatable (env: comma-separated); needs --signing-ca-cert
    #[arg(
        long = "k8s-join-service-account",
        env = "TOOLSRV_K8S_JOIN_SERVICE_ACCOUNTS",
        value_delimiter = ',',
        value_name = "NS/NAME"
    )]
    pub k8s_join_service_accounts: Vec<String>,
    /// The audience agents' projected tokens must be for
    #[arg(
        long,
        env = "TOOLSRV_K8S_JOIN_AUDIENCE",
        value_name = "AUDIENCE",
        default_value = "toolsrv"
    )]
    pub k8s_join_audience: String,
    /// A label KEY=VALUE bound to the certificate of every host joining with a service account
    /// token (a trusted label); repeatable (env: comma-separated)
    #[arg(
        long = "k8s-join-label",
        env = "TOOLSRV_K8S_JOIN_LABELS",
        value_delimiter = ',',
        value_parser = label_arg
    )]
    pub k8s_join_labels: Vec<String>,
    /// The Kubernetes API's URL (default: in the cluster, from KUBERNETES_SERVICE_HOST and
    /// KUBERNETES_SERVICE_PORT)
    #[arg(long, env = "TOOLSRV_K8S_API", value_name = "URL")]
    pub k8s_api: Option<String>,
    /// The CA bundle of the Kubernetes API's certificate
    #[arg(
        long,
        env = "TOOLSRV_K8S_API_CA",
        value_name = "FILE",
        default_value = toolsrv_coordinator::kubernetes_join::IN_CLUSTER_CA
    )]
    pub k8s_api_ca: PathBuf,
    /// The coordinator's own bearer token for the Kubernetes API (read for every review)
    #[arg(
        long,
        env = "TOOLSRV_K8S_API_TOKEN_FILE",
        value_name = "FILE",
        default_value = toolsrv_coordinator::kubernetes_join::IN_CLUSTER_TOKEN
    )]
    pub k8s_api_token_file: PathBuf,
    /// Run as one of several replicas sharing the fleet through etcd: its client URLs,
    /// comma-separated (`http://`, or `https://` with --etcd-ca, --etcd-cert and --etcd-key)
    #[arg(long, env = "TOOLSRV_ETCD", value_name = "URL[,URL...]")]
    pub etcd: Option<String>,
    /// The CA bundle etcd's certificates chain to
    #[arg(long, env = "TOOLSRV_ETCD_CA", value_name = "FILE")]
    pub etcd_ca: Option<PathBuf>,
    /// A client certificate for etcd (PEM)
    #[arg(long, env = "TOOLSRV_ETCD_CERT", value_name = "FILE")]
    pub etcd_cert: Option<PathBuf>,
    /// The key of --etcd-cert (PEM)
    #[arg(long, env = "TOOLSRV_ETCD_KEY", value_name = "FILE")]
    pub etcd_key: Option<PathBuf>,
    /// The key prefix of this fleet's records in etcd (several fleets may share one etcd)
    #[arg(
        long,
        env = "TOOLSRV_ETCD_PREFIX",
        value_name = "PREFIX",
        default_value = "/toolsrv/"
    )]
    pub etcd_prefix: String,
    /// This replica's etcd lease: a replica that stops renewing it loses its hosts after this
    /// long (2s to 60s)
    #[arg(
        long,
        env = "TOOLSRV_ETCD_LEASE",
        value_name = "DURATION",
        default_value = "10s",
        value_parser = toolsrv_coordinator::parse_duration
    )]
    pub etcd_lease: Duration,
    /// This replica's id among the replicas [default: the host name]
    #[arg(long, env = "TOOLSRV_REPLICA_ID", value_name = "ID")]
    pub replica_id: Option<String>,
    /// Where the other replicas reach this one's --listen port, `https://HOST:PORT` (the
    /// coordinator certificate must name HOST) [default: https://<host name>:<--listen port>]
    #[arg(long, env = "TOOLSRV_ADVERTISE_URL", value_name = "URL")]
    pub advertise_url: Option<String>,
}

/// `--agent-cert-ttl`: a duration from 5 s to 365 days.
fn parse_agent_cert_ttl(text: &str) -> Result<Duration, String> {
    let ttl = toolsrv_tls::enroll::parse_duration(text)?;
    if ttl < Duration::from_secs(5) || ttl > Duration::from_secs(365 * 86_400) {
        return Err(format!("{text}: use 5s to 365d"));
    }
    Ok(ttl)
}

impl CoordinatorArgs {
    /// The replica settings, when --etcd is given.
    fn cluster(&self) -> anyhow::Result<Option<toolsrv_coordinator::ClusterConfig>> {
        let Some(etcd) = self.etcd.as_deref().filter(|e| !e.trim().is_empty()) else {
            for (set, flag) in [
                (self.replica_id.is_some(), "--replica-id"),
                (self.advertise_url.is_some(), "--advertise-url"),
                (self.etcd_ca.is_some(), "--etcd-ca"),
            ] {
                if set {
                    bail!("{flag} is only for replicas: give --etcd too");
                }
            }
            return Ok(None);
        };
        let endpoints = toolsrv_coordinator::ClusterConfig::parse_endpoints(etcd)
            .map_err(|e| anyhow::anyhow!("--etcd: {e}"))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_lowercase())
            .unwrap_or_default();
        let replica_id = match &self.replica_id {
            Some(id) => id.clone(),
            None if !host.is_empty() => host.clone(),
            None => bail!("--replica-id: the host name cannot be read; give an id"),
        };
        let advertise_url = self
            .advertise_url
            .clone()
            .unwrap_or_else(|| format!("https://{host}:{}", self.listen.port()));
        if !advertise_url.starts_with("https://") {
            bail!("--advertise-url {advertise_url}: replicas reach each other over https://");
        }
        if self.etcd_lease < Duration::from_secs(2) || self.etcd_lease > Duration::from_secs(60) {
            bail!("--etcd-lease: use 2s to 60s");
        }
        let mut config =
            toolsrv_coordinator::ClusterConfig::new(endpoints, &replica_id, &advertise_url);
        config.key_prefix = self.etcd_prefix.clone();
        config.lease_ttl = self.etcd_lease;
        config.tls = match (&self.etcd_ca, &self.etcd_cert, &self.etcd_key) {
            (None, None, None) => None,
            (Some(ca), Some(cert), Some(key)) => Some(toolsrv_coordinator::EtcdTls {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => bail!("--etcd-ca, --etcd-cert and --etcd-key go together (etcd over https)"),
        };
        Ok(Some(config))
    }

    /// Joins with Kubernetes service account tokens, when a service account is named.
    fn kubernetes_join(&self) -> anyhow::Result<Option<toolsrv_coordinator::KubernetesJoin>> {
        let service_accounts: Vec<String> = self
            .k8s_join_service_accounts
            .iter()
            .filter(|a| !a.is_empty())
            .cloned()
            .collect();
        if service_accounts.is_empty() {
            return Ok(None);
        }
        let Some(api_url) = self
            .k8s_api
            .clone()
            .or_else(toolsrv_coordinator::kubernetes_join::in_cluster_url)
        else {
            bail!(
                "--k8s-join-service-account needs the Kubernetes API: give --k8s-api URL (in a \
                 pod it comes from KUBERNETES_SERVICE_HOST)"
            );
        };
        let labels = parse_labels(&self.k8s_join_labels)
            .map_err(|e| anyhow::anyhow!("--k8s-join-label: {e}"))?;
        for (k, v) in &labels {
            toolsrv_tls::enroll::check_label(k, v)
                .map_err(|e| anyhow::anyhow!("--k8s-join-label {k}={v}: {e}"))?;
        }
        Ok(Some(toolsrv_coordinator::KubernetesJoin {
            api_url,
            api_ca: self.k8s_api_ca.clone(),
            api_token_file: self.k8s_api_token_file.clone(),
            audience: self.k8s_join_audience.clone(),
            service_accounts,
            labels,
        }))
    }

    pub fn config(&self) -> anyhow::Result<CoordinatorConfig> {
        if self.lost_after_ms <= self.keepalive_ms {
            bail!(
                "--lost-after-ms ({}) must be longer than --keepalive-ms ({})",
                self.lost_after_ms,
                self.keepalive_ms
            );
        }
        let mut needed = Required::default();
        let tools = needed.take(&self.tools, "--tools", "OLLIE_TOOLS_PATH");
        let tls = self.tls.files(&mut needed);
        needed.check("coordinator")?;
        let (Some(tools), Some(tls)) = (tools, tls) else {
            bail!("coordinator: a needed setting is missing");
        };
        let mut config = CoordinatorConfig::new(split_tools_path(&tools), tls);
        config.keepalive = Duration::from_millis(self.keepalive_ms.max(1));
        config.lost_after = Duration::from_millis(self.lost_after_ms);
        config.max_keepalive_rate = self.max_keepalive_rate;
        config.max_connecting_per_address = self.max_connecting_per_address;
        config.max_connections_per_identity = self.max_connections_per_identity;
        config.max_requests_per_identity = self.max_requests_per_identity;
        config.max_buffered_bytes_per_identity = self.max_buffered_bytes_per_identity;
        config.policy = self.policy.clone();
        config.audit_log = self.audit_log.clone();
        config.watch.rescan_every = Duration::from_secs(self.rescan_secs.max(1));
        config.host_labels = self.host_labels.clone();
        config.limits = toolsrv_coordinator::Limits {
            calls_per_client: self.max_calls_per_client.max(1),
            calls_per_client_host: self.max_calls_per_client_host.max(1),
            fanout_hosts: self.max_fanout_hosts.max(1),
            max_call_timeout: Duration::from_secs(self.max_call_timeout_secs.max(1)),
            watches_per_client: self.max_watches_per_client.max(1),
            finds_per_client: self.max_finds_per_client.max(1),
        };
        config.approval_timeout = Duration::from_secs(self.approval_timeout_secs.max(1));
        config.host_only = toolsrv_coordinator::HostOnly {
            allowed: !self.refuse_host_only_tools,
            max: self.max_host_only_tools,
            embeds_per_hour: self.max_host_only_embeds_per_hour,
        };
        config.sessions = toolsrv_coordinator::SessionLimits {
            idle: Duration::from_secs(self.session_idle_secs.max(1)),
            per_client: self.max_sessions_per_client.max(1),
        };
        config.find_model = self.find_model.clone();
        config.state_dir = self.state_dir.clone();
        config.drain_grace = Duration::from_secs(self.drain_grace_secs);
        config.forget_offline_after = Duration::from_secs(self.forget_offline_after_secs);
        config.crls = self.crls.clone();
        config.cert_expiry_warning = self.cert_expiry_warning;
        config.signing_ca = match (&self.signing_ca_cert, &self.signing_ca_key) {
            (Some(cert), Some(key)) => Some(toolsrv_coordinator::SigningCa {
                cert: cert.clone(),
                key: key.clone(),
            }),
            (None, None) => None,
            _ => bail!(
                "--signing-ca-cert and --signing-ca-key go together: give both to turn \
                 enrollment on, or neither"
            ),
        };
        config.agent_cert_ttl = self.agent_cert_ttl;
        config.kubernetes_join = self.kubernetes_join()?;
        config.cluster = self.cluster()?;
        config.admins = self
            .admins
            .iter()
            .filter(|a| !a.is_empty())
            .cloned()
            .collect();
        Ok(config)
    }
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    #[command(flatten)]
    pub file: crate::config::ConfigArgs,
    /// The coordinator's URL. Needed
    #[arg(long, env = "TOOLSRV_COORDINATOR", value_name = "URL")]
    pub coordinator: Option<String>,
    /// This host's id; must match the agent certificate (`toolsrv://agent/<id>`), in any case.
    /// Needed, except for an enrolled agent (`--join`), whose id comes from its token
    #[arg(long, env = "TOOLSRV_HOST_ID", value_name = "ID")]
    pub host_id: Option<String>,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Enroll this host with a one-time join token (`toolctl token create`): the agent makes
    /// its key, gets a certificate from the coordinator and keeps both in --state-dir; later
    /// starts use them, without a token. Instead of --cert and --key
    #[arg(long = "join", env = "TOOLSRV_JOIN_TOKEN", value_name = "TOKEN")]
    pub join: Option<String>,
    /// On Kubernetes, instead of --join: enroll with the pod's projected service account token
    /// in FILE (audience as the coordinator's --k8s-join-audience). Read again whenever the
    /// agent must join, so a pod whose certificate expired joins again by itself
    #[arg(
        long,
        env = "TOOLSRV_K8S_TOKEN_FILE",
        value_name = "FILE",
        conflicts_with = "join"
    )]
    pub k8s_token_file: Option<PathBuf>,
    /// For --join without --ca: the pin of the coordinator's CA, `sha256:HEX` (SHA-256 of the
    /// CA certificate's DER; `toolctl token create` prints it)
    #[arg(long, env = "TOOLSRV_CA_PIN", value_name = "PIN")]
    pub ca_pin: Option<String>,
    /// Colon-separated host-only tool directories, served besides the coordinator's catalog
    #[arg(long, env = "TOOLSRV_AGENT_TOOLS", value_name = "PATH")]
    pub tools: Option<std::ffi::OsString>,
    /// A label for host selection, KEY=VALUE; repeatable (env: comma-separated)
    #[arg(
        long = "label",
        env = "TOOLSRV_LABELS",
        value_delimiter = ',',
        value_parser = label_arg
    )]
    pub labels: Vec<String>,
    /// Blob cache and materialized catalog
    #[arg(
        long,
        env = "TOOLSRV_STATE_DIR",
        default_value = "/var/lib/toolsrv-agent"
    )]
    pub state_dir: PathBuf,
    /// Calls run at once; more wait in a queue
    #[arg(long, env = "TOOLSRV_MAX_CONCURRENT_CALLS", default_value_t = 16)]
    pub max_concurrent_calls: u32,
    /// Timeout of calls that ask for none, in seconds
    #[arg(long, env = "TOOLSRV_DEFAULT_TIMEOUT_SECS", default_value_t = 60)]
    pub default_timeout_secs: u64,
    /// Longest timeout a call may ask for, in seconds
    #[arg(long, env = "TOOLSRV_MAX_TIMEOUT_SECS", default_value_t = 3600)]
    pub max_timeout_secs: u64,
    /// Most bytes of output (stdout and stderr together) per call
    #[arg(long, env = "TOOLSRV_OUTPUT_CAP", default_value_t = toolsrv_host::AGENT_OUTPUT_CAP)]
    pub output_cap: u64,
    /// Most bytes of output kept for a call's final result; beyond it output only streams
    #[arg(long, env = "TOOLSRV_RESULT_CAP", default_value_t = 1 << 20)]
    pub result_cap: u64,
    /// Working directory of calls that do not name one
    #[arg(long, env = "TOOLSRV_WORKDIR")]
    pub workdir: Option<PathBuf>,
    /// Re-evaluate variants against the host this often, in seconds
    #[arg(long, env = "TOOLSRV_RECHECK_SECS", default_value_t = 3)]
    pub recheck_secs: u64,
    /// Address of a plain-HTTP Prometheus endpoint (`GET /metrics`); off when unset
    #[arg(long, env = "TOOLSRV_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// On SIGTERM, how long (seconds) running calls may finish (new ones are refused); then
    /// the rest are cancelled and the agent says goodbye. A second signal exits at once
    #[arg(long, env = "TOOLSRV_AGENT_DRAIN_GRACE_SECS", default_value_t = 10)]
    pub drain_grace_secs: u64,
    #[command(flatten)]
    pub sandbox: SandboxArgs,
}

/// How the agent confines calls.
#[derive(Debug, Args, Clone)]
pub struct SandboxArgs {
    /// `enforce` (refuse to start unless everything is enforced), `best-effort` (enforce what
    /// the host supports, log and report the rest) or `off`
    #[arg(
        long = "sandbox",
        env = "TOOLSRV_SANDBOX",
        default_value = "best-effort"
    )]
    pub mode: String,
    /// Run tools as this user (name or uid), so the agent's files are out of reach by
    /// permissions as well
    #[arg(long, env = "TOOLSRV_RUN_AS")]
    pub run_as: Option<String>,
    /// A path every call may read and execute; repeatable (env: comma-separated)
    #[arg(
        long = "sandbox-read",
        env = "TOOLSRV_SANDBOX_READ",
        value_delimiter = ','
    )]
    pub read: Vec<PathBuf>,
    /// A path every call may write; repeatable (env: comma-separated)
    #[arg(
        long = "sandbox-write",
        env = "TOOLSRV_SANDBOX_WRITE",
        value_delimiter = ','
    )]
    pub write: Vec<PathBuf>,
    /// A path no call may reach, besides the state directory and TLS files; repeatable
    #[arg(
        long = "sandbox-hide",
        env = "TOOLSRV_SANDBOX_HIDE",
        value_delimiter = ','
    )]
    pub hide: Vec<PathBuf>,
    /// A variable of the agent's environment passed to calls (a name, or a prefix ending in
    /// `*`); repeatable
    #[arg(
        long = "sandbox-env",
        env = "TOOLSRV_SANDBOX_ENV",
        value_delimiter = ','
    )]
    pub env: Vec<String>,
    /// Memory of one call (`512M`, `2G`), or `unlimited`
    #[arg(
        long = "sandbox-memory",
        env = "TOOLSRV_SANDBOX_MEMORY",
        default_value = "1G",
        value_parser = memory_arg
    )]
    pub memory: String,
    /// Processes and threads of one call, or 0 for unlimited
    #[arg(
        long = "sandbox-pids",
        env = "TOOLSRV_SANDBOX_PIDS",
        default_value_t = 512
    )]
    pub pids: u64,
    /// CPU of one call in cores (`0.5`, `2`) or thousandths (`500m`); unlimited when unset
    #[arg(long = "sandbox-cpu", env = "TOOLSRV_SANDBOX_CPU", value_parser = cpu_arg)]
    pub cpu: Option<String>,
    /// Open files per process of a call, or 0 to keep the agent's limit
    #[arg(
        long = "sandbox-nofile",
        env = "TOOLSRV_SANDBOX_NOFILE",
        default_value_t = 4096
    )]
    pub nofile: u64,
    /// `allow` or `deny` TCP bind and connect by default (policy grants decide per tool)
    #[arg(
        long = "sandbox-network",
        env = "TOOLSRV_SANDBOX_NETWORK",
        default_value = "allow",
        value_parser = network_arg
    )]
    pub network: String,
    /// Where calls' private directories are made (default: `<tmp>/toolsrv-calls.<uid>`)
    #[arg(long, env = "TOOLSRV_CALL_DIR")]
    pub call_dir: Option<PathBuf>,
    /// A delegated cgroup v2 directory for call cgroups (default: the agent's own cgroup)
    #[arg(long, env = "TOOLSRV_CGROUP")]
    pub cgroup: Option<PathBuf>,
}

impl SandboxArgs {
    /// The settings these flags give, before the agent adds its own private files to `hidden`.
    pub fn settings(&self) -> anyhow::Result<toolsrv_confine::Settings> {
        let mut s = toolsrv_confine::Settings::new(self.hide.clone());
        s.mode = self.mode.parse().map_err(anyhow::Error::msg)?;
        s.run_as = self.run_as.clone().filter(|u| !u.is_empty());
        s.defaults.read = self.read.clone();
        s.defaults.write = self.write.clone();
        s.defaults.env = self.env.clone();
        s.defaults.network = match self.network.as_str() {
            "allow" => true,
            "deny" => false,
            other => bail!("--sandbox-network {other}: use allow or deny"),
        };
        let limits = &mut s.defaults.limits;
        limits.memory = match self.memory.as_str() {
            "unlimited" | "0" => None,
            text => Some(
                toolsrv_confine::parse_size(text)
                    .map_err(|e| anyhow::anyhow!("--sandbox-memory: {e}"))?,
            ),
        };
        limits.pids = (self.pids > 0).then_some(self.pids);
        limits.nofile = (self.nofile > 0).then_some(self.nofile);
        limits.cpu_millis = self
            .cpu
            .as_deref()
            .map(toolsrv_confine::parse_cpu)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--sandbox-cpu: {e}"))?;
        if let Some(dir) = &self.call_dir {
            s.call_dir = dir.clone();
            s.call_dir_chosen = true;
        }
        s.cgroup = self.cgroup.clone();
        Ok(s)
    }
}

impl AgentArgs {
    /// Whether the agent runs enrolled: `--join`, or no `--cert`/`--key` and a certificate
    /// enrolled earlier in the state directory.
    fn enrolling(&self) -> bool {
        let join = self.join.as_deref().is_some_and(|t| !t.is_empty());
        join || self.k8s_token_file.is_some()
            || (self.tls.cert.is_none()
                && self.tls.key.is_none()
                && toolsrv_agent::enroll::is_enrolled(&self.state_dir))
    }

    /// The configuration of an enrolled agent (see [`Self::enrolling`]).
    fn enrolled_config(&self) -> anyhow::Result<AgentConfig> {
        if self.tls.cert.is_some() || self.tls.key.is_some() {
            bail!(
                "agent: --join and --cert/--key exclude each other: an enrolled agent makes its \
                 own key and keeps its certificate in --state-dir"
            );
        }
        let trust = match (&self.ca_pin, &self.tls.ca) {
            (Some(_), Some(_)) => bail!("agent: give --ca-pin or --ca, not both"),
            (Some(pin), None) => Some(toolsrv_agent::enroll::CaTrust::Pin(
                toolsrv_tls::enroll::parse_pin(pin)
                    .map_err(|e| anyhow::anyhow!("--ca-pin: {e}"))?,
            )),
            (None, Some(ca)) => Some(toolsrv_agent::enroll::CaTrust::File(ca.clone())),
            (None, None) => None,
        };
        let token = match (&self.join, &self.k8s_token_file) {
            (Some(t), _) if !t.is_empty() => {
                Some(toolsrv_agent::enroll::JoinCredential::Token(t.clone()))
            }
            (_, Some(file)) => Some(toolsrv_agent::enroll::JoinCredential::KubernetesTokenFile(
                file.clone(),
            )),
            _ => None,
        };
        if token.is_some()
            && trust.is_none()
            && !toolsrv_agent::enroll::is_enrolled(&self.state_dir)
        {
            bail!(
                "agent: --join needs a way to trust the coordinator: --ca-pin sha256:HEX \
                 (`toolctl token create` prints it) or --ca FILE"
            );
        }
        let mut needed = Required::default();
        let coordinator = needed.take(&self.coordinator, "--coordinator", "TOOLSRV_COORDINATOR");
        needed.check("agent")?;
        let Some(coordinator) = coordinator else {
            bail!("agent: a needed setting is missing");
        };
        let host_id = self.host_id.clone().unwrap_or_default();
        let tls = toolsrv_agent::enroll::enrolled_files(&self.state_dir);
        let mut config = AgentConfig::new(coordinator, host_id, tls, self.state_dir.clone());
        config.enroll = Some(toolsrv_agent::enroll::EnrollConfig {
            credential: token,
            trust,
        });
        Ok(config)
    }

    pub fn config(&self) -> anyhow::Result<AgentConfig> {
        let mut config = if self.enrolling() {
            self.enrolled_config()?
        } else {
            if self.ca_pin.is_some() {
                bail!("agent: --ca-pin is only for --join");
            }
            self.certificate_config()?
        };
        self.apply(&mut config)?;
        Ok(config)
    }

    /// The configuration of an agent given its certificate files.
    fn certificate_config(&self) -> anyhow::Result<AgentConfig> {
        let mut needed = Required::default();
        let coordinator = needed.take(&self.coordinator, "--coordinator", "TOOLSRV_COORDINATOR");
        let host_id = needed.take(&self.host_id, "--host-id", "TOOLSRV_HOST_ID");
        let tls = self.tls.files(&mut needed);
        needed.check("agent")?;
        let (Some(coordinator), Some(host_id), Some(tls)) = (coordinator, host_id, tls) else {
            bail!("agent: a needed setting is missing");
        };
        Ok(AgentConfig::new(
            coordinator,
            host_id,
            tls,
            self.state_dir.clone(),
        ))
    }

    /// Everything but the identity.
    fn apply(&self, config: &mut AgentConfig) -> anyhow::Result<()> {
        config.tools = self
            .tools
            .as_deref()
            .map(split_tools_path)
            .unwrap_or_default();
        config.labels = parse_labels(&self.labels)?;
        config.max_concurrent_calls = self.max_concurrent_calls.max(1);
        config.limits.default_timeout = Duration::from_secs(self.default_timeout_secs.max(1));
        config.limits.max_timeout =
            Duration::from_secs(self.max_timeout_secs.max(self.default_timeout_secs).max(1));
        config.limits.output_cap = self.output_cap;
        config.limits.result_cap = self.result_cap;
        if let Some(workdir) = &self.workdir {
            config.workdir = workdir.clone();
        }
        config.recheck_every = Duration::from_secs(self.recheck_secs.max(1));
        config.sandbox = self.sandbox.settings()?;
        config.metrics_listen = self.metrics_listen;
        config.drain_grace = Duration::from_secs(self.drain_grace_secs);
        Ok(())
    }
}

/// A `--label` (or `--k8s-join-label`) as its parser checks it, so that a configuration file's
/// bad label is refused naming the file, line and key like any other bad value.
fn label_arg(text: &str) -> Result<String, String> {
    if !text.is_empty() {
        let Some((k, v)) = text.split_once('=') else {
            return Err(format!("`{text}`: expected KEY=VALUE"));
        };
        if k.is_empty() {
            return Err(format!("`{text}`: the key is empty"));
        }
        toolsrv_tls::enroll::check_label(k, v).map_err(|e| format!("`{text}`: {e}"))?;
    }
    Ok(text.to_string())
}

/// `--sandbox-memory` as its parser checks it (`512M`, `2G`, `unlimited`).
fn memory_arg(text: &str) -> Result<String, String> {
    if !matches!(text, "unlimited" | "0") {
        toolsrv_confine::parse_size(text)?;
    }
    Ok(text.to_string())
}

/// `--max-buffered-bytes-per-identity`: 0, or a size of at least the largest message and then
/// some.
fn buffered_bytes_arg(text: &str) -> Result<usize, String> {
    if text.trim() == "0" {
        return Ok(0);
    }
    let bytes = toolsrv_confine::parse_size(text)?;
    let least = toolsrv_coordinator::MIN_BUFFERED_BYTES;
    match usize::try_from(bytes) {
        Ok(bytes) if bytes >= least => Ok(bytes),
        _ => Err(format!(
            "use 0 (no limit) or at least {}M: one answer may hold a message of 16 MiB",
            least >> 20
        )),
    }
}

/// `--sandbox-network` as its parser checks it.
fn network_arg(text: &str) -> Result<String, String> {
    match text {
        "allow" | "deny" => Ok(text.to_string()),
        _ => Err("use allow or deny".into()),
    }
}

/// `--sandbox-cpu` as its parser checks it (`0.5`, `2`, `500m`).
fn cpu_arg(text: &str) -> Result<String, String> {
    toolsrv_confine::parse_cpu(text).map(|_| text.to_string())
}

fn parse_labels(raw: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    for item in raw.iter().filter(|s| !s.is_empty()) {
        let Some((k, v)) = item.split_once('=') else {
            bail!("--label {item}: expected KEY=VALUE")
        };
        if k.is_empty() {
            bail!("--label {item}: the key is empty");
        }
        // The coordinator refuses a hello with such a label, and the agent would only retry:
        // said here, once, at start.
        if let Err(e) = toolsrv_tls::enroll::check_label(k, v) {
            bail!("--label {item}: {e}");
        }
        labels.insert(k.to_string(), v.to_string());
    }
    Ok(labels)
}

#[derive(Debug, Subcommand)]
enum PkiCommand {
    /// Write a CA and certificates for a coordinator, agents and clients (adds to an existing directory)
    Init {
        /// Directory to write into (created 0700)
        dir: PathBuf,
        /// Agent host ids, comma-separated (issued in lowercase)
        #[arg(long, value_delimiter = ',')]
        agents: Vec<String>,
        /// Client names, comma-separated (issued in lowercase)
        #[arg(long, value_delimiter = ',')]
        clients: Vec<String>,
        /// Extra DNS names or IPs for the coordinator certificate (it always has localhost and 127.0.0.1)
        #[arg(long, value_delimiter = ',')]
        coordinator_names: Vec<String>,
        /// Validity of the issued certificates, in days
        #[arg(long, default_value_t = toolsrv_tls::DEFAULT_VALID_DAYS)]
        days: u32,
    },
}

pub fn init_logging(args: &LogArgs) {
    let mut filter = tracing_subscriber::EnvFilter::try_new(&args.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // The HTTP/2 library warns once per connection it ends for a peer's abuse (too many
    // resets, streams reset for its errors): any peer that reaches the port could write a
    // line a connection. Its errors stay; a filter that names it decides for itself.
    if !args.log_level.contains("h2")
        && let Ok(quiet) = "h2=error".parse()
    {
        filter = filter.add_directive(quiet);
    }
    // Colours only for a person at a terminal: a journal, a file or a pipe gets plain text.
    use std::io::IsTerminal;
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    if args.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// A token cancelled by the first SIGTERM or SIGINT; a second signal exits at once.
pub fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        tracing::info!("shutting down (a second signal exits at once)");
        cancel.cancel();
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        std::process::exit(130);
    });
    token
}

impl Cli {
    /// Whether the settings would start the role, without starting anything: what
    /// `--print-config` adds to the configuration it prints.
    pub fn check(&self) -> anyhow::Result<()> {
        match &self.command {
            Command::Coordinator(args) => args.config().map(drop),
            Command::Agent(args) => args.config().map(drop),
            Command::Pki(_) | Command::Up(_) | Command::Bypass(_) | Command::Policy(_) => Ok(()),
        }
    }

    /// `toolsrv policy check`, which `main` runs alone, like `bypass`.
    pub fn policy_check(&self) -> Option<&crate::policy_check::PolicyCheckArgs> {
        match &self.command {
            Command::Policy(PolicyCommand::Check(args)) => Some(args),
            _ => None,
        }
    }

    /// `toolsrv bypass`, which `main` runs alone: no runtime, no logging, the command's status.
    pub fn bypass(&self) -> Option<&crate::bypass::BypassArgs> {
        match &self.command {
            Command::Bypass(args) => Some(args),
            _ => None,
        }
    }
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Coordinator(args) => {
            let config = args.config()?;
            // SIGHUP heard from before the port listens (see `hangups`).
            drop(toolsrv_coordinator::hangups());
            let listener = bind(args.listen, COORDINATOR_LISTEN_HINT).await?;
            let plain = toolsrv_coordinator::PlainPorts {
                health: bind_optional(args.health_listen, HEALTH_LISTEN_HINT).await?,
                metrics: bind_optional(args.metrics_listen, METRICS_LISTEN_HINT).await?,
            };
            tracing::info!(listen = %args.listen, tools = ?config.tools, "coordinator starting");
            toolsrv_coordinator::serve(config, listener, plain, shutdown_on_signals()).await?;
            Ok(())
        }
        Command::Agent(args) => {
            let mut config = args.config()?;
            config.sandbox.warden = Some(cli.log.warden());
            toolsrv_agent::run(config, shutdown_on_signals()).await?;
            Ok(())
        }
        Command::Pki(PkiCommand::Init {
            dir,
            agents,
            clients,
            coordinator_names,
            days,
        }) => {
            let mut opts = toolsrv_tls::PkiOptions::new(&dir);
            opts.agents = agents;
            opts.clients = clients;
            opts.coordinator_names = coordinator_names;
            opts.valid_days = days;
            let written = toolsrv_tls::init(&opts)?;
            if written.is_empty() {
                println!(
                    "{}: nothing to write, every certificate exists",
                    dir.display()
                );
            }
            for path in written {
                println!("wrote {}", path.display());
            }
            let ca = dir.join(toolsrv_tls::CA_CERT);
            let pin = toolsrv_tls::enroll::pin_for(&ca, &ca)?;
            println!("CA pin (for `toolsrv agent --join ... --ca-pin`): {pin}");
            Ok(())
        }
        Command::Up(args) => crate::up::run(args, cli.log.warden(), shutdown_on_signals()).await,
        // Handled by `main` before the runtime starts: it exits with the command's status.
        Command::Bypass(_) | Command::Policy(_) => bail!(
            "toolsrv bypass and policy run without the server's runtime; this is a bug, please report it"
        ),
    }
}

/// Listens on `addr`; when the address is taken, the error adds `in_use_hint` (what probably
/// holds it, and how to pick another).
pub async fn bind(addr: SocketAddr, in_use_hint: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            anyhow::anyhow!("cannot listen on {addr}: {e}: {in_use_hint}")
        } else {
            anyhow::anyhow!("cannot listen on {addr}: {e}")
        }
    })
}

/// [`bind`] when an address is given.
async fn bind_optional(
    addr: Option<SocketAddr>,
    in_use_hint: &str,
) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    match addr {
        Some(addr) => Ok(Some(bind(addr, in_use_hint).await?)),
        None => Ok(None),
    }
}

/// What to do when the coordinator cannot listen.
const COORDINATOR_LISTEN_HINT: &str = "another coordinator (or `toolsrv up`) may be running \
     there, or another server uses the port: stop it, or pick another address with --listen \
     (TOOLSRV_LISTEN)";
/// What to do when the metrics port cannot listen.
const METRICS_LISTEN_HINT: &str =
    "another process uses the port: pick another with --metrics-listen (TOOLSRV_METRICS_LISTEN)";
/// What to do when the health port cannot listen.
const HEALTH_LISTEN_HINT: &str =
    "another process uses the port: pick another with --health-listen (TOOLSRV_HEALTH_LISTEN)";

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use clap::Parser;

    use super::Cli;

    fn refusal(args: &[&str]) -> String {
        let argv = ["toolsrv"]
            .iter()
            .chain(args)
            .chain(&["pki", "init", "/nowhere"]);
        Cli::try_parse_from(argv).unwrap_err().to_string()
    }

    /// A log setting that would be read as something else is a usage error, not `info` or
    /// plain text in place of what was asked.
    #[test]
    fn log_settings_that_do_not_read_are_refused() {
        let wrong = refusal(&["--log-format", "jsn"]);
        assert!(wrong.contains("possible values: text, json"), "{wrong}");
        let wrong = refusal(&["--log-level", "toolsrv=loud"]);
        assert!(wrong.contains("'toolsrv=loud' for '--log-level"), "{wrong}");
        assert!(wrong.contains("target=level"), "{wrong}");
        for good in ["info", "toolsrv_coordinator=debug,warn", "off"] {
            let argv = ["toolsrv", "--log-level", good, "--log-format", "json"];
            let cli = Cli::try_parse_from(argv.iter().chain(&["pki", "init", "/x"]));
            assert!(cli.is_ok(), "{good}");
        }
    }
}
