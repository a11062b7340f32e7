//! The coordinator: holds the tool registry, ships it to agents, keeps every host's view,
//! and routes client calls and fan-outs to agents over their links.
//!
//! Architecture invariant: identity comes from the TLS peer certificate ([`toolsrv_tls::PeerInfo`]),
//! never from message content; the agent link refuses client certificates and the client API
//! refuses agent certificates.
//!
//! Architecture invariant: memory per call is bounded. An agent sends output only against credit
//! the coordinator grants as the caller consumes it, so a slow caller slows the tool, not the fleet.

mod agent_link;
mod api;
mod approvals;
mod audit;
mod bucket;
mod calls;
mod catalog;
mod embeds;
mod enroll;
mod error;
mod expiry;
mod finder;
mod fleet;
mod followed;
/// Public for the fuzz targets; the coordinator's own use is `AgentLinkRoutes`.
pub mod framing;
mod heap;
mod identity;
/// Public for the fuzz targets; the coordinator applies it when an agent attaches.
pub mod labels;
mod link;
mod metrics;
mod pace;
pub mod policy;
mod quota;
mod refusal;
mod replicas;
mod revocation;
pub mod selector;
mod session_api;
mod sessions;
mod streams;
mod view_pace;
mod views;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolsrv_proto::v1::agent_link_server::AgentLinkServer;
use toolsrv_proto::v1::enrollment_server::EnrollmentServer;
use toolsrv_proto::v1::join_tokens_server::JoinTokensServer;
use toolsrv_proto::v1::renewal_server::RenewalServer;
use toolsrv_proto::v1::tools_server::ToolsServer;
use toolsrv_registry::{Registry, WatchOptions};
use toolsrv_tls::{ServerCreds, TlsFiles};

pub use agent_link::{AgentLinkRoutes, AgentLinkService};
pub use api::ToolsService;
pub use calls::MAX_BYPASS_REQUESTS_PER_CALL;
pub use embeds::DEFAULT_MAX_HOST_ONLY_EMBEDS_PER_HOUR;
pub use enroll::kubernetes::{self as kubernetes_join, KubernetesJoin};
pub use enroll::{DEFAULT_AGENT_CERT_TTL, SigningCa};
pub use error::FileError;
pub use expiry::{DEFAULT_WINDOW as DEFAULT_CERT_EXPIRY_WARNING, parse_duration};
pub use identity::{Caller, RequireRole};
pub use link::CHUNK_OVERHEAD;
pub use policy::Policy;
pub use quota::Limits;
pub use sessions::SessionLimits;
pub use streams::DEFAULT_MAX_PER_IDENTITY as DEFAULT_MAX_REQUESTS_PER_IDENTITY;
pub use streams::{DEFAULT_MAX_BUFFERED_BYTES_PER_IDENTITY, MIN_BUFFERED_BYTES};
pub use toolsrv_cluster::{ClusterConfig, EtcdTls};
pub use views::{DEFAULT_MAX_HOST_ONLY_TOOLS, HostOnly, MAX_HOST_ONLY_PAST_LIMIT};

/// The client allowed to administer a coordinator unless `--admin` says otherwise: the one
/// `toolsrv up` and `toolsrv pki init --clients admin` issue.
pub const DEFAULT_ADMIN: &str = "admin";

/// Keepalives per second each way a coordinator stays under unless `--max-keepalive-rate`
/// says: at the default 1 s interval, links beyond 2,000 are spaced out.
pub const DEFAULT_MAX_KEEPALIVE_RATE: u32 = 2000;

/// How long calls may finish after the shutdown signal, unless `--drain-grace-secs` says.
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(30);
/// How long an offline host stays in the fleet unless `--forget-offline-after-secs` says
/// otherwise: a day.
pub const DEFAULT_FORGET_OFFLINE_AFTER: Duration = Duration::from_secs(24 * 3600);

/// How a coordinator runs.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// The tools path.
    pub tools: Vec<PathBuf>,
    pub tls: TlsFiles,
    /// How often each side of an agent link sends a keepalive.
    pub keepalive: Duration,
    /// An agent silent for this long is lost; its in-flight calls end as LOST.
    pub lost_after: Duration,
    /// Keepalives per second each way the coordinator spaces links' intervals to stay under
    /// (the interval grows in whole seconds as the fleet does; `lost_after` with it); 0: never.
    pub max_keepalive_rate: u32,
    /// Connections from one address in their TLS handshake or before their HTTP/2 preface at
    /// once; more are closed when accepted. 0: no limit.
    pub max_connecting_per_address: usize,
    /// Connections open at once with one certificate identity; more are closed after their
    /// handshake. 0: no limit.
    pub max_connections_per_identity: usize,
    /// Requests (HTTP/2 streams) open at once with one certificate identity; more are refused
    /// with RESOURCE_EXHAUSTED. 0: no limit.
    pub max_requests_per_identity: usize,
    /// Bytes one certificate identity may have held at once: answers waiting to leave (given by a
    /// handler, not yet written to the connection) and request messages still arriving;
    /// the answer or request past it is cut short with RESOURCE_EXHAUSTED. 0: no limit;
    /// otherwise at least [`MIN_BUFFERED_BYTES`].
    pub max_buffered_bytes_per_identity: usize,
    /// Output bytes a call may have in flight between agent and caller.
    pub credit_window: u64,
    /// An agent link whose queue stays full this long with the agent reading none of it is
    /// closed (the agent reconnects; its calls end as LOST) instead of holding what waits to be
    /// sent, calls to the host among them, for ever.
    pub stalled_after: Duration,
    pub policy: Option<PathBuf>,
    /// JSON-lines audit file; `None` logs audit records under the `audit` target.
    pub audit_log: Option<PathBuf>,
    /// Labels the coordinator assigns to hosts by id glob (JSON): what policy rules match.
    pub host_labels: Option<PathBuf>,
    /// Per-client quotas and the longest call timeout.
    pub limits: Limits,
    /// How long a call waits for an approval before it is denied.
    pub approval_timeout: Duration,
    /// What is taken of the tools an agent serves from its own directories: whether they are
    /// offered at all (`allowed: false`: listed hidden, saying so, and nobody can call them
    /// through this coordinator), and how many of one host are kept.
    pub host_only: HostOnly,
    /// How long idle sessions live and how many a client may hold.
    pub sessions: SessionLimits,
    /// A sentence encoder's directory (all-MiniLM-L6-v2 or all-mpnet-base-v2:
    /// `model.safetensors`, `tokenizer.json`, `config.json`) for FindTools to rank by meaning as
    /// well as by words; `None`: words only.
    pub find_model: Option<PathBuf>,
    /// Client-name globs allowed to administer the coordinator (join tokens, revocation).
    pub admins: Vec<String>,
    /// After the shutdown signal, how long calls already running may take to finish before
    /// they are ended; new calls are refused meanwhile.
    pub drain_grace: Duration,
    /// A host offline for longer than this leaves the fleet (no longer listed; calls to it are
    /// `UNKNOWN_HOST`), as nodes an autoscaler removed do; zero: hosts are kept until restart.
    pub forget_offline_after: Duration,
    /// Where the coordinator keeps what must outlive it (revocations, join tokens, and the
    /// vectors of the tools' texts with `find_model`, in `find-vectors/`); `None`: nothing is
    /// kept, what needs it is refused saying so, and a restart embeds the catalog again.
    pub state_dir: Option<PathBuf>,
    /// Certificate revocation lists (PEM or DER): client certificates they list are refused at
    /// the handshake, and open connections of ones a new CRL lists are closed.
    pub crls: Vec<PathBuf>,
    /// How often the certificate, key, CA bundle and CRL files are checked for changes.
    pub tls_reload: Duration,
    /// Warn about (and count in the metrics) certificates that expire within this; zero: off.
    pub cert_expiry_warning: Duration,
    /// The CA (or intermediate) that signs enrolled agents' certificates; enrollment is off
    /// without it.
    pub signing_ca: Option<SigningCa>,
    /// Lifetime of the certificates enrollment and renewal issue.
    pub agent_cert_ttl: Duration,
    /// Joins with Kubernetes service account tokens, reviewed by the Kubernetes API; `None`:
    /// join tokens only.
    pub kubernetes_join: Option<KubernetesJoin>,
    /// Run as one of several replicas sharing the fleet through etcd (`--etcd`); `None`: alone.
    pub cluster: Option<toolsrv_cluster::ClusterConfig>,
    pub watch: WatchOptions,
}

impl CoordinatorConfig {
    pub fn new(tools: Vec<PathBuf>, tls: TlsFiles) -> Self {
        Self {
            tools,
            tls,
            keepalive: Duration::from_secs(1),
            lost_after: Duration::from_secs(3),
            max_keepalive_rate: DEFAULT_MAX_KEEPALIVE_RATE,
            max_connecting_per_address: toolsrv_tls::MAX_SETTING_UP_PER_ADDRESS,
            max_connections_per_identity: toolsrv_tls::MAX_OPEN_PER_IDENTITY,
            max_requests_per_identity: streams::DEFAULT_MAX_PER_IDENTITY,
            max_buffered_bytes_per_identity: streams::DEFAULT_MAX_BUFFERED_BYTES_PER_IDENTITY,
            credit_window: 1 << 20,
            stalled_after: link::DEFAULT_STALLED_AFTER,
            policy: None,
            audit_log: None,
            host_labels: None,
            limits: Limits::default(),
            approval_timeout: Duration::from_secs(60),
            host_only: HostOnly::default(),
            sessions: SessionLimits::default(),
            find_model: None,
            admins: vec![DEFAULT_ADMIN.to_string()],
            state_dir: None,
            drain_grace: DEFAULT_DRAIN_GRACE,
            forget_offline_after: DEFAULT_FORGET_OFFLINE_AFTER,
            crls: Vec::new(),
            tls_reload: Duration::from_secs(2),
            cert_expiry_warning: expiry::DEFAULT_WINDOW,
            signing_ca: None,
            agent_cert_ttl: DEFAULT_AGENT_CERT_TTL,
            kubernetes_join: None,
            cluster: None,
            watch: WatchOptions::default(),
        }
    }
}

/// Errors that stop a coordinator from starting.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error(transparent)]
    Tls(#[from] toolsrv_tls::TlsError),
    /// A policy, host labels or audit file that cannot be used.
    #[error(transparent)]
    File(#[from] error::FileError),
    /// The sentence encoder of `--find-model` cannot be loaded.
    #[error("--find-model: {0}")]
    FindModel(toolsrv_find::FindError),
    /// The join tokens kept in the state directory cannot be read.
    #[error("enrollment: {0}")]
    Enrollment(String),
    #[error("cannot build the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// etcd cannot be joined (`--etcd`).
    #[error("--etcd: {0}")]
    Cluster(String),
    #[error("cannot serve metrics: {0}")]
    Metrics(std::io::Error),
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
}

/// Shared state of a running coordinator.
#[derive(Debug)]
pub(crate) struct State {
    pub config: CoordinatorConfig,
    pub registry: Registry,
    pub fleet: fleet::Fleet,
    /// The policy in force, following `--policy`.
    pub policy: followed::Followed<Policy>,
    pub audit: audit::Audit,
    /// The host labels in force, following `--host-labels`.
    pub host_labels: followed::Followed<labels::HostLabels>,
    /// Bumped once a new policy or new host labels are in force, hosts relabelled: each agent's
    /// link then sends its sandbox grants again if they changed.
    pub settings_applied: tokio::sync::watch::Sender<u64>,
    /// Told when an agent's identity is revoked: its host is forgotten once offline.
    pub agent_revoked: tokio::sync::Notify,
    pub quotas: Arc<quota::Quotas>,
    pub approvals: approvals::Approvals,
    pub sessions: sessions::Sessions,
    pub finder: finder::Finder,
    pub metrics: metrics::Metrics,
    /// Every link's keepalive interval.
    pub pace: pace::Pace,
    /// The other replicas and the routing table, with `--etcd`.
    pub replicas: Option<Arc<replicas::Replicas>>,
    /// Join tokens and the signer; `None` when enrollment is off.
    pub enrollment: Option<enroll::Enrollment>,
    /// Revoked identities (`toolctl revoke`).
    pub revocations: Arc<revocation::Revocations>,
    /// Cancelled by the shutdown signal: new calls are refused from then on, while the ones
    /// running may finish (within `drain_grace`).
    pub draining: CancellationToken,
    /// Every call and fan-out running, so the drain knows when they are done.
    pub in_flight: TaskTracker,
    /// Cancelled when the drain is over: links say goodbye, the calls still running end, the
    /// servers stop.
    pub shutdown: CancellationToken,
    /// Every task the services spawn, so shutdown can wait for them.
    pub tasks: TaskTracker,
}

/// The coordinator's plain-text ports, each off when `None`.
#[derive(Debug, Default)]
pub struct PlainPorts {
    /// gRPC health, for Kubernetes probes and load balancers.
    pub health: Option<TcpListener>,
    /// Prometheus metrics: `GET /metrics`.
    pub metrics: Option<TcpListener>,
}

/// Whether `dir` looks like a `--find-model` directory (it exists and holds the model's files),
/// without loading the model: what [`serve`] would refuse first, for a caller that starts other
/// work (`toolsrv up`'s agent) alongside it.
pub fn check_find_model(dir: &std::path::Path) -> Result<(), CoordinatorError> {
    toolsrv_find::Encoder::check_dir(dir).map_err(CoordinatorError::FindModel)
}

/// Serves the agent link and the client API on `listener` (mTLS) and, when given, gRPC health
/// and metrics on `plain`, until `drain` is cancelled and the drain is over: from then on new
/// calls are refused with `UNAVAILABLE` (health says NOT_SERVING) while the calls already
/// running finish, for at most `config.drain_grace`; then the rest end with status
/// `cancelled`, agents are told goodbye (they reconnect) and the servers stop.
pub async fn serve(
    config: CoordinatorConfig,
    listener: TcpListener,
    plain: PlainPorts,
    drain: CancellationToken,
) -> Result<(), CoordinatorError> {
    let shutdown = CancellationToken::new();
    // Before the audit log and the settings files are opened: a SIGHUP from then on is heard.
    let (audit_hangups, settings_hangups) = (hangups(), hangups());
    if let Some(dir) = config.state_dir.as_deref() {
        FileError::own_state_dir(dir)?;
    }
    let revocations = Arc::new(revocation::Revocations::load(config.state_dir.as_deref())?);
    let expiry = Arc::new(expiry::ExpiryWatch::new(
        config.cert_expiry_warning,
        config.tls.clone(),
    ));
    let enrollment = enroll::Enrollment::open(&config)?;
    // A joining host has no certificate yet: with enrollment on, the port also accepts peers
    // without one, whose requests carry no proven identity and reach only `Enrollment`.
    let creds = ServerCreds::with_options(
        config.tls.clone(),
        config.crls.clone(),
        enrollment.is_some(),
    )?;
    let policy = followed::Followed::open("policy", config.policy.as_deref(), Policy::load)?;
    let audit = audit::Audit::open(config.audit_log.as_deref())?;
    let host_labels = followed::Followed::open(
        "host labels",
        config.host_labels.as_deref(),
        labels::HostLabels::load,
    )?;
    if let Some(path) = policy.path() {
        let now = policy.now();
        tracing::info!(
            path = %path.display(),
            rules = now.rules(),
            sandbox = now.sandbox_entries(),
            sha256 = now.sha256(),
            "policy in force"
        );
    }
    if let Some(path) = host_labels.path() {
        let now = host_labels.now();
        tracing::info!(path = %path.display(), entries = now.len(), sha256 = now.sha256(), "host labels in force");
    }
    let encoder = match &config.find_model {
        Some(dir) => {
            let encoder = toolsrv_find::Encoder::load(dir).map_err(CoordinatorError::FindModel)?;
            tracing::info!(model = %dir.display(), "FindTools ranks by meaning as well as by words");
            Some(Arc::new(encoder))
        }
        None => None,
    };
    // Replicas serve the revision they agree on in etcd, not one of their own.
    let numbering = match &config.cluster {
        Some(_) => toolsrv_registry::Numbering::Agreed,
        None => toolsrv_registry::Numbering::Local,
    };
    let registry = Registry::with_numbering(config.tools.clone(), numbering);
    toolsrv_registry::log_problems(&registry.catalog());
    let replicas = match &config.cluster {
        Some(cluster) => {
            let replicas = replicas::Replicas::join(cluster.clone(), &config.tls).await?;
            replicas
                .agree_catalog(&registry, &registry.catalog())
                .await
                .map_err(|e| {
                    CoordinatorError::Cluster(format!(
                        "cannot agree on the catalog revision in etcd: {e}"
                    ))
                })?;
            revocations.share();
            let kept = replicas
                .cluster
                .keep_revocations(&revocations.records())
                .await
                .map_err(|e| {
                    CoordinatorError::Cluster(format!("cannot read the revocations in etcd: {e}"))
                })?;
            revocations
                .replace_with(&kept, |_, _| {})
                .map_err(|e| CoordinatorError::Cluster(e.message().to_string()))?;
            Some(Arc::new(replicas))
        }
        None => None,
    };
    let fleet = fleet::Fleet::new(registry.catalog().revision);
    let tasks = TaskTracker::new();
    let state = Arc::new(State {
        config: config.clone(),
        registry: registry.clone(),
        fleet,
        policy,
        audit,
        host_labels,
        settings_applied: tokio::sync::watch::Sender::new(0),
        agent_revoked: tokio::sync::Notify::new(),
        quotas: Arc::new(quota::Quotas::new(config.limits.clone())),
        approvals: approvals::Approvals::default(),
        sessions: sessions::Sessions::new(
            config.sessions.clone(),
            replicas.as_ref().map(|r| r.id().to_string()),
        ),
        finder: finder::Finder::new(
            encoder,
            config.state_dir.as_deref(),
            config.limits.finds_per_client,
            config.host_only.embeds_per_hour,
        ),
        metrics: metrics::Metrics::default(),
        pace: pace::Pace::new(
            config.keepalive,
            config.lost_after,
            config.max_keepalive_rate,
        ),
        replicas: replicas.clone(),
        draining: drain.clone(),
        in_flight: TaskTracker::new(),
        revocations: revocations.clone(),
        enrollment,
        shutdown: shutdown.clone(),
        tasks: tasks.clone(),
    });
    tasks.spawn(
        registry
            .clone()
            .watch(config.watch.clone(), shutdown.clone()),
    );
    tasks.spawn(follow_registry(state.clone()));
    tasks.spawn(replicas::follow_catalog(state.clone()));
    tasks.spawn(replicas::follow_peer_views(state.clone()));
    tasks.spawn(reap_sessions(state.clone()));
    tasks.spawn(forget_offline_hosts(state.clone()));
    tasks.spawn(finder::follow_views(state.clone()));
    #[cfg(unix)]
    tasks.spawn(reopen_audit_on_hangup(state.clone(), audit_hangups));
    tasks.spawn(follow_settings(state.clone(), settings_hangups));
    let reload = creds.spawn_reload_on_change(config.tls_reload, shutdown.clone());
    let incoming = toolsrv_tls::incoming_with(
        listener,
        creds.subscribe(),
        toolsrv_tls::AcceptOptions {
            max_setting_up_per_address: config.max_connecting_per_address,
            max_open_per_identity: config.max_connections_per_identity,
            ..toolsrv_tls::AcceptOptions::DEFAULT
        },
    );
    let conns = incoming.connections();
    revocations.enforce_on(conns.clone());
    expiry.watch_peers(&conns);
    tasks.spawn(revocation::follow_crls(
        creds.subscribe_crls(),
        conns,
        expiry.clone(),
        shutdown.clone(),
    ));

    let (reporter, health_service) = tonic_health::server::health_reporter();
    reporter.set_serving::<ToolsServer<ToolsService>>().await;
    reporter
        .set_serving::<AgentLinkServer<AgentLinkService>>()
        .await;
    if state.replicas.is_some() {
        reporter
            .set_service_status(
                replicas::CLUSTER_HEALTH,
                tonic_health::ServingStatus::Serving,
            )
            .await;
        tasks.spawn(replicas::follow(state.clone(), reporter.clone()));
    }
    tasks.spawn(drain_then_stop(state.clone(), reporter));
    let reflection = |builder: tonic_reflection::server::Builder<'static>| {
        builder
            .register_encoded_file_descriptor_set(toolsrv_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(
                tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
            )
    };
    let reflection_v1 = reflection(tonic_reflection::server::Builder::configure()).build_v1()?;
    let reflection_v1alpha =
        reflection(tonic_reflection::server::Builder::configure()).build_v1alpha()?;

    if let Some(listener) = plain.metrics {
        let mut registry = toolsrv_metrics::registry();
        state.metrics.register(&mut registry);
        registry.register_collector(Box::new(metrics::StateCollector {
            state: Arc::downgrade(&state),
        }));
        registry.register_collector(Box::new(toolsrv_metrics::CertificateCollector::new(
            config.tls.cert.clone(),
            config.tls.ca.clone(),
        )));
        registry.register_collector(Box::new(expiry::ExpiryCollector {
            watch: expiry.clone(),
        }));
        let served =
            toolsrv_metrics::MetricsServer::spawn(listener, Arc::new(registry), shutdown.clone())
                .map_err(CoordinatorError::Metrics)?;
        tracing::info!(addr = %served.addr, "metrics at http://{}/metrics", served.addr);
    }
    if let Some(health) = plain.health {
        let health_service = health_service.clone();
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            match health.local_addr() {
                Ok(addr) => tracing::info!(%addr, "gRPC health (plain text) at {addr}"),
                Err(e) => tracing::warn!(error = %e, "cannot read the health port's address"),
            }
            let incoming = toolsrv_tls::PlainListener::new(
                health,
                toolsrv_tls::PlainLimits::DEFAULT,
                "health",
            )
            .incoming();
            // A health check is one request at a time.
            let served = toolsrv_tls::bounded_server(16)
                .add_service(health_service)
                .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "health server failed");
            }
        });
    }

    // Each service proves its callers' role before any handler runs.
    let agent_link = RequireRole::agents(AgentLinkRoutes::new(AgentLinkService {
        state: state.clone(),
    }))
    .refusing(revocations.clone());
    let tools = RequireRole::clients(
        ToolsServer::new(ToolsService {
            state: state.clone(),
        })
        .max_decoding_message_size(toolsrv_proto::limits::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(toolsrv_proto::limits::MAX_MESSAGE_BYTES),
    )
    .refusing(revocations.clone())
    .relayed_by_replicas(replicas.is_some());
    let join_tokens = RequireRole::clients(JoinTokensServer::new(enroll::JoinTokensService {
        state: state.clone(),
    }))
    .refusing(revocations.clone())
    .relayed_by_replicas(replicas.is_some());
    let renewal = RequireRole::agents(RenewalServer::new(enroll::RenewalService {
        state: state.clone(),
    }))
    .refusing(revocations);
    // The one service a peer without a certificate reaches (see `enroll`).
    let enrollment = EnrollmentServer::new(enroll::EnrollmentService {
        state: state.clone(),
    });
    let audit_to = Arc::downgrade(&state);
    let stream_limits = streams::StreamLimits::new(
        state.config.max_requests_per_identity,
        state.config.max_buffered_bytes_per_identity,
        state.metrics.requests_refused.clone(),
        state.metrics.answers_refused.clone(),
        Arc::new(
            move |peer: &str, rpc: &str, why: &tonic::Status, until: &str| {
                if let Some(state) = audit_to.upgrade() {
                    state.audit.requests_refused(peer, rpc, why, until);
                }
            },
        ),
    );
    let served = toolsrv_tls::bounded_server(toolsrv_tls::STREAMS_PER_CONNECTION)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .tcp_nodelay(true)
        .layer(streams::StreamLimitLayer(stream_limits))
        .add_service(agent_link)
        .add_service(tools)
        .add_service(join_tokens)
        .add_service(renewal)
        .add_service(enrollment)
        .add_service(RequireRole::authenticated(health_service))
        .add_service(RequireRole::authenticated(reflection_v1))
        .add_service(RequireRole::authenticated(reflection_v1alpha))
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned())
        .await;
    shutdown.cancel();
    reload.abort();
    tasks.close();
    // Sessions say goodbye to their agents; give them a moment, but never hang shutdown.
    let _ = tokio::time::timeout(Duration::from_secs(5), tasks.wait()).await;
    if let Some(replicas) = &replicas {
        // The lease goes, and with it this replica's claims: other replicas see its hosts
        // free at once rather than after the lease's time.
        let _ = tokio::time::timeout(Duration::from_secs(5), replicas.cluster.shutdown()).await;
    }
    served.map_err(CoordinatorError::from)
}

/// Waits for the drain signal, refuses new calls (health: NOT_SERVING) while the running ones
/// finish within the grace, then stops everything.
async fn drain_then_stop(state: Arc<State>, reporter: tonic_health::server::HealthReporter) {
    tokio::select! {
        () = state.draining.cancelled() => {}
        () = state.shutdown.cancelled() => return,
    }
    let grace = state.config.drain_grace;
    reporter
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    reporter
        .set_not_serving::<ToolsServer<ToolsService>>()
        .await;
    reporter
        .set_not_serving::<AgentLinkServer<AgentLinkService>>()
        .await;
    state.in_flight.close();
    let running = state.in_flight.len();
    tracing::info!(
        calls = running,
        ?grace,
        "draining: new calls are refused, running calls may finish"
    );
    if tokio::time::timeout(grace, state.in_flight.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            calls = state.in_flight.len(),
            "drain grace over: ending the calls still running"
        );
    } else if running > 0 {
        tracing::info!("every running call finished");
    }
    state.shutdown.cancel();
}

/// The SIGHUPs this process received, counted: the first call, which must be made within a
/// runtime, starts listening for them; each receiver sees those that come after it was made.
/// `toolsrv coordinator` calls it before it binds its port, so that a SIGHUP sent once the
/// port listens (logrotate right after a start) neither ends the process (SIGHUP's default)
/// nor goes unheard; [`serve`] subscribes before it opens the audit log.
pub fn hangups() -> tokio::sync::watch::Receiver<u64> {
    use tokio::signal::unix::{SignalKind, signal};
    static HANGUPS: std::sync::OnceLock<tokio::sync::watch::Sender<u64>> =
        std::sync::OnceLock::new();
    HANGUPS
        .get_or_init(|| {
            let (tx, _) = tokio::sync::watch::channel(0);
            match signal(SignalKind::hangup()) {
                Ok(mut signals) => {
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        while signals.recv().await.is_some() {
                            tx.send_modify(|n| *n += 1);
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGHUP: the audit log will not be reopened, nor the settings files looked at on it");
                }
            }
            tx
        })
        .subscribe()
}

/// Reopens the audit log on SIGHUP, for logrotate.
#[cfg(unix)]
async fn reopen_audit_on_hangup(state: Arc<State>, mut hangups: tokio::sync::watch::Receiver<u64>) {
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            got = hangups.changed() => {
                if got.is_err() {
                    return;
                }
                match state.audit.reopen() {
                    Ok(()) => tracing::info!("SIGHUP: audit log reopened"),
                    Err(e) => tracing::error!(error = %e, "SIGHUP: cannot reopen the audit log; still writing the old file"),
                }
            }
        }
    }
}

/// Follows the `--policy` and `--host-labels` files: looked at every 2 s and on SIGHUP. A new
/// policy decides the calls that start from then on (a running call keeps the verdict it
/// started with); new host labels relabel every host at once. Then each agent whose sandbox
/// grants changed is sent them. A file that cannot be used leaves the settings in force. Each
/// is logged and audited (`"event": "policy"` or `"host_labels"`).
async fn follow_settings(state: Arc<State>, mut hangups: tokio::sync::watch::Receiver<u64>) {
    if state.policy.path().is_none() && state.host_labels.path().is_none() {
        return;
    }
    let mut ticks = tokio::time::interval(followed::LOOK_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let hangup = async {
            if hangups.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            _ = ticks.tick() => {}
            _ = hangup => {}
        }
        let policy_applied = look_at(&state, "policy", &state.policy, || {
            let policy = state.policy.now();
            let (rules, sandbox) = (policy.rules(), policy.sandbox_entries());
            tracing::info!(
                rules,
                sandbox,
                sha256 = policy.sha256(),
                "policy reloaded: calls that start from now on, and requests waiting for a decision, are decided by it"
            );
            serde_json::json!({"rules": rules, "sandbox": sandbox, "sha256": policy.sha256()})
        });
        let labels_applied = look_at(&state, "host_labels", &state.host_labels, || {
            let labels = state.host_labels.now();
            let ids = state.fleet.relabel(|id| labels.of(id));
            let relabelled = ids.len();
            tracing::info!(
                hosts = relabelled,
                sha256 = labels.sha256(),
                "host labels reloaded: every host of this coordinator relabelled"
            );
            if let Some(replicas) = state.replicas.clone() {
                let state = state.clone();
                state
                    .tasks
                    .clone()
                    .spawn(async move { replicas.relabelled(&state.fleet, ids).await });
            }
            serde_json::json!({"hosts_relabelled": relabelled, "sha256": labels.sha256()})
        });
        if policy_applied || labels_applied {
            rejudge_waiting(&state);
            state.settings_applied.send_modify(|n| *n += 1);
        }
    }
}

/// Judges the approval requests still waiting again, under the policy and host labels now in
/// force: who decides each, or its decision when the policy no longer asks anyone.
fn rejudge_waiting(state: &State) {
    for (request, what) in state
        .approvals
        .rejudge(|request| calls::rejudged(state, request))
    {
        match what {
            approvals::Rejudged::Ask(_) => tracing::info!(
                id = %request.id,
                caller = %request.caller,
                tool = %request.tool,
                host = %request.host,
                approvers = %request.approvers.join(", "),
                "approval request: asked of other approvers under the settings now in force"
            ),
            approvals::Rejudged::Decide(decision) => tracing::info!(
                id = %request.id,
                caller = %request.caller,
                tool = %request.tool,
                host = %request.host,
                ?decision,
                "approval request: decided by the settings now in force"
            ),
            approvals::Rejudged::Keep => {}
        }
    }
}

/// Looks at one followed settings file: when a new version took force, `loaded` applies it
/// and gives the audit record's fields; a version refused is logged. Either is audited
/// (`"event": what`). Whether a new version took force.
fn look_at<T: Default>(
    state: &State,
    what: &str,
    followed: &followed::Followed<T>,
    loaded: impl FnOnce() -> serde_json::Value,
) -> bool {
    let file = followed
        .path()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let (record, applied) = match followed.look() {
        followed::Looked::Same => return false,
        followed::Looked::Loaded => {
            let mut fields = loaded();
            if let Some(fields) = fields.as_object_mut() {
                fields.insert("file".into(), file.into());
                fields.insert("outcome".into(), "loaded".into());
            }
            (fields, true)
        }
        followed::Looked::Refused(e) => {
            tracing::error!(error = %e, "{what}: the file changed and cannot be used; what was in force stays");
            let record =
                serde_json::json!({"file": file, "outcome": "refused", "reason": e.to_string()});
            (record, false)
        }
    };
    state.audit.event(what, record);
    applied
}

/// Mirrors registry changes into the fleet's change feed: each new revision, and each tool that
/// became invalid (which changes no revision), with what changed.
async fn follow_registry(state: Arc<State>) {
    let mut catalogs = state.registry.subscribe();
    let mut last = catalogs.borrow().clone();
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            changed = catalogs.changed() => {
                if changed.is_err() {
                    return;
                }
                let next = catalogs.borrow_and_update().clone();
                let changes = next.changes_since(&last);
                if next.revision != last.revision || !changes.invalid.is_empty() {
                    state.fleet.registry_changed(next.revision, &changes);
                }
                last = next;
            }
        }
    }
}

/// Ends sessions that have had no watcher for the idle time.
/// Whether a fleet event (or its loss) calls for a look at once: a host gone offline that
/// `revoked` says is revoked, or events missed. A closed stream never does.
fn offline_and(
    event: Result<toolsrv_proto::v1::CatalogEvent, RecvError>,
    revoked: impl Fn(&str) -> bool,
) -> bool {
    match event {
        Ok(event) => {
            event.kind == toolsrv_proto::v1::CatalogEventKind::HostOffline as i32
                && revoked(&event.host)
        }
        Err(RecvError::Lagged(_)) => true,
        Err(RecvError::Closed) => false,
    }
}

/// Removes hosts offline for longer than `forget_offline_after` (0: never) from the fleet (and,
/// with replicas, the hosts other replicas held that have had no link as long), looking a few
/// times within that time and at least every minute; and those whose agent's identity is
/// revoked as soon as they are offline (on the revocation, or on the news that they went
/// offline here or on another replica).
async fn forget_offline_hosts(state: Arc<State>) {
    let after = Some(state.config.forget_offline_after).filter(|a| !a.is_zero());
    let every = after.map_or(Duration::from_secs(60), |after| {
        (after / 4).clamp(Duration::from_millis(100), Duration::from_secs(60))
    });
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut events = state.fleet.subscribe();
    let mut remote = state.replicas.as_ref().map(|r| r.remote_events());
    let revoked = |id: &str| {
        state
            .revocations
            .is_revoked(&toolsrv_tls::Identity::Agent(id.to_string()))
    };
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            _ = ticks.tick() => {}
            () = state.agent_revoked.notified() => {}
            event = events.recv() => {
                if matches!(event, Err(RecvError::Closed)) {
                    return;
                }
                if !offline_and(event, revoked) {
                    continue;
                }
            }
            event = replicas::next_remote(&mut remote) => {
                if matches!(event, Err(RecvError::Closed)) {
                    remote = None;
                }
                if !offline_and(event, revoked) {
                    continue;
                }
            }
        }
        let cutoff = after.map_or(0, |after| {
            fleet::now_ms().saturating_sub(u64::try_from(after.as_millis()).unwrap_or(u64::MAX))
        });
        let elsewhere = |id: &str| {
            state
                .replicas
                .as_ref()
                .is_some_and(|r| r.routed_elsewhere(id))
        };
        let mut forgotten = state.fleet.forget_offline(cutoff, elsewhere, revoked);
        if let Some(replicas) = &state.replicas {
            forgotten.extend(replicas.forget_gone(&state, after, revoked));
        }
        if !forgotten.is_empty() {
            state.metrics.hosts_forgotten(forgotten.len());
            tracing::info!(
                hosts = ?forgotten,
                "forgot hosts offline for more than {} s (--forget-offline-after-secs) or revoked",
                after.map_or(0, |a| a.as_secs())
            );
        }
    }
}

async fn reap_sessions(state: Arc<State>) {
    let mut ticks = tokio::time::interval(state.sessions.reap_interval());
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            _ = ticks.tick() => {
                state.sessions.reap();
            }
        }
    }
}
