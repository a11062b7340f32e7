//! The agent's entry point: connect, run a session, reconnect with backoff, until shutdown.

use std::ffi::OsString;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use toolsrv_confine::Confiner;
use toolsrv_meta::Host;
use toolsrv_tls::{Identity, Role, TlsFiles};

use crate::backoff::full_jitter;
use crate::blobs::BlobCache;
use crate::config::AgentConfig;
use crate::error::AgentError;
use crate::reconnect::{SessionEnd, SessionOutcome, reconnect_loop};
use crate::session::{Agent, session};
use crate::store::CatalogStore;

/// Sets the state directory to 0711 and the blob cache to 0700, so another user can reach the
/// catalog (0755, read-only files) and nothing else.
fn restrict_state_dir(config: &AgentConfig) -> Result<(), AgentError> {
    use std::os::unix::fs::PermissionsExt;
    for (dir, mode) in [(&config.state_dir, 0o711), (&config.blobs_dir(), 0o700)] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
            .map_err(|e| AgentError::io("cannot set the mode of", dir, e))?;
    }
    Ok(())
}

/// Says once what calls are confined with, and what is not enforced.
fn log_abilities(a: &toolsrv_confine::Abilities) {
    tracing::info!(
        mode = a.mode.as_str(),
        level = a.level.as_str(),
        landlock_abi = a.landlock_abi,
        cgroup = %a.cgroup,
        controllers = ?a.controllers,
        kill = %a.kill,
        run_as = %a.run_as,
        "sandbox"
    );
    for missing in &a.missing {
        tracing::warn!(what = %missing, "sandbox: not enforced on this host");
    }
}

/// Runs the agent until `shutdown` fires: dials the coordinator over mutual TLS, serves the
/// agent link, and reconnects after any failure with capped exponential backoff and full jitter.
///
/// On shutdown, in-flight calls get `drain_grace` to finish, the rest are cancelled, and the
/// agent says goodbye. Fails only when the state directory cannot be set up.
///
/// Fails at once when the agent certificate names another host than `host_id` (or is no agent
/// certificate): the coordinator would refuse every attempt, so retrying would only hide it.
///
/// With enrollment (`config.enroll`), the certificate in the state directory is used, after
/// joining with the token when there is none yet, and renewed while the agent runs.
pub async fn run(mut config: AgentConfig, shutdown: CancellationToken) -> Result<(), AgentError> {
    toolsrv_tls::install_crypto_provider();
    if let Some(enroll) = config.enroll.clone()
        && !crate::enroll::prepare(&mut config, &enroll, &shutdown).await?
    {
        return Ok(());
    }
    check_identity(&config.tls, &config.host_id)?;
    let urls = Coordinators::new(&config.coordinator, &config.host_id);
    let tls = config.tls.clone();
    let host_id = config.host_id.clone();
    // The latest channel, for renewals over the agent's own connection.
    let (channels, latest) = tokio::sync::watch::channel(None);
    let renewal = config.enroll.is_some().then(|| {
        tokio::spawn(crate::enroll::keep_renewed(
            config.state_dir.clone(),
            latest,
            shutdown.clone(),
        ))
    });
    let result = run_with_connector(config, shutdown, move || {
        let url = urls.current();
        let connecting = connect_tls(url, tls.clone(), host_id.clone());
        let (channels, urls) = (channels.clone(), urls.clone());
        async move {
            let channel = connecting.await.inspect_err(|_| urls.next())?;
            channels.send_replace(Some(channel.clone()));
            Ok(channel)
        }
    })
    .await;
    if let Some(renewal) = renewal {
        renewal.abort();
    }
    result
}

/// The coordinator URLs an agent may attach to (`--coordinator URL[,URL...]`: replicas), and
/// the one it tries next. Hosts start at different URLs (by host id), so a fleet spreads over
/// the replicas; a URL that cannot be reached moves the next attempt to the next one.
#[derive(Debug, Clone)]
pub struct Coordinators {
    urls: Arc<Vec<String>>,
    next: Arc<std::sync::atomic::AtomicUsize>,
}

impl Coordinators {
    pub fn new(list: &str, host_id: &str) -> Self {
        let mut urls: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_string)
            .collect();
        if urls.is_empty() {
            urls.push(list.to_string());
        }
        let start = host_id.bytes().fold(0usize, |h, b| {
            h.wrapping_mul(31).wrapping_add(usize::from(b))
        });
        Self {
            next: Arc::new((start % urls.len()).into()),
            urls: Arc::new(urls),
        }
    }

    /// The URL to try now.
    pub fn current(&self) -> String {
        let i = self.next.load(std::sync::atomic::Ordering::Relaxed);
        self.urls[i % self.urls.len()].clone()
    }

    /// Moves on to the next URL.
    pub fn next(&self) {
        if self.urls.len() > 1 {
            let url = self.current();
            self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(unreachable = %url, next = %self.current(), "trying the next coordinator");
        }
    }
}

/// Refuses a certificate that names another identity than `toolsrv://agent/<host_id>`. One
/// that cannot be read yet passes: it may still be on its way (a certificate being issued), and
/// the connection attempts say what is wrong with it.
pub fn check_identity(tls: &TlsFiles, host_id: &str) -> Result<(), AgentError> {
    let Ok(identity) = toolsrv_tls::certificate_identity(&tls.cert) else {
        return Ok(());
    };
    let cert = tls.cert.display();
    match identity {
        Identity::Agent(id) if id == host_id => Ok(()),
        Identity::Agent(id) => Err(AgentError::Identity(format!(
            "the agent certificate {cert} names host `{id}` ({}), not `{host_id}`: start the agent \
             with --host-id {id}, or give it a certificate issued for `{host_id}` (`toolsrv pki \
             init DIR --agents {host_id}`)",
            Identity::Agent(id.clone()).uri()
        ))),
        other => Err(AgentError::Identity(format!(
            "{cert} is a {} certificate ({}), not an agent's: give the agent a certificate issued \
             for {} (`toolsrv pki init DIR --agents {host_id}`)",
            other.role(),
            other.uri(),
            Identity::Agent(host_id.to_string()).uri()
        ))),
    }
}

/// Dials `url` with the agent's credentials, requiring the peer to be a coordinator.
///
/// The TLS files are read on every attempt, so renewed certificates are picked up on reconnect;
/// a renewed one that names another host is refused here, before dialling.
pub async fn connect_tls(
    url: String,
    tls: TlsFiles,
    host_id: String,
) -> Result<Channel, AgentError> {
    check_identity(&tls, &host_id)?;
    // Refused by the coordinator in the handshake, which the agent would see only as a broken
    // connection: said here, naming the file and its dates, at each attempt.
    toolsrv_tls::check_dates(
        &tls.cert,
        "the coordinator refuses it: give the agent a current certificate (its files are read \
         again at each attempt to connect)",
    )
    .map_err(|source| AgentError::Connect {
        url: url.clone(),
        source,
    })?;
    toolsrv_tls::connect_reloading(&url, &tls, Role::Coordinator)
        .await
        .map_err(|source| AgentError::Connect { url, source })
}

/// Serves the agent's metrics on `addr` until `shutdown`.
async fn serve_metrics(
    addr: std::net::SocketAddr,
    metrics: &crate::AgentMetrics,
    config: &AgentConfig,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let failed = |source| AgentError::Metrics { addr, source };
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(failed)?;
    let mut registry = toolsrv_metrics::registry();
    metrics.register(&mut registry);
    registry.register_collector(Box::new(toolsrv_metrics::CertificateCollector::new(
        config.tls.cert.clone(),
        config.tls.ca.clone(),
    )));
    let served = toolsrv_metrics::MetricsServer::spawn(listener, Arc::new(registry), shutdown)
        .map_err(failed)?;
    tracing::info!(addr = %served.addr, "metrics at http://{}/metrics", served.addr);
    Ok(())
}

/// [`run`] with the channel-opening step given: tests pass a plain-TCP connector to an in-process
/// fake coordinator.
pub async fn run_with_connector<C, F>(
    config: AgentConfig,
    shutdown: CancellationToken,
    mut connect: C,
) -> Result<(), AgentError>
where
    C: FnMut() -> F,
    F: Future<Output = Result<Channel, AgentError>>,
{
    let store = CatalogStore::new(config.catalog_dir(), BlobCache::new(config.blobs_dir()));
    store.open()?;
    if config.sandbox.run_as.is_some() {
        // The tools' user reaches the shipped catalog through the state directory, and may
        // list nothing in it.
        restrict_state_dir(&config)?;
    }
    let mut settings = config.sandbox.clone();
    settings.hidden = config.hidden_paths();
    // Tools run what variants found on the agent's PATH: its directories are readable and
    // executable (any that lie among the agent's private files stay hidden).
    let dirs = crate::path_reach::path_dirs();
    settings.defaults.read.extend(dirs.iter().cloned());
    if settings.mode != toolsrv_confine::Mode::Off {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        for reach in
            crate::path_reach::out_of_reach(&dirs, &settings.defaults.read, home.as_deref())
        {
            reach.warn();
        }
    }
    let confiner = Confiner::new(settings)?;
    log_abilities(confiner.abilities());
    let metrics = crate::AgentMetrics::default();
    if let Some(addr) = config.metrics_listen {
        serve_metrics(addr, &metrics, &config, shutdown.clone()).await?;
    }
    let base_env = env_with_path_first(std::env::vars_os(), &config.path_first);
    let agent = Agent {
        metrics,
        confiner: Arc::new(confiner),
        host: Host::with_env_os(base_env.iter().cloned()),
        base_env,
        store,
        config,
    };
    tracing::info!(
        host_id = %agent.config.host_id,
        coordinator = %agent.config.coordinator,
        "agent starting"
    );
    let mut rng = fastrand::Rng::new();
    let (agent, token) = (&agent, &shutdown);
    reconnect_loop(
        agent.config.backoff,
        token,
        move || {
            let connecting = connect();
            async move {
                let mut welcomed = false;
                let result = async {
                    let channel = tokio::select! {
                        channel = connecting => channel?,
                        () = token.cancelled() => return Ok(SessionEnd::Shutdown),
                    };
                    session(agent, channel, token, &mut welcomed).await
                }
                .await;
                SessionOutcome { welcomed, result }
            }
        },
        tokio::time::sleep,
        |ceiling| full_jitter(ceiling, &mut rng),
    )
    .await;
    tracing::info!("agent stopped");
    Ok(())
}

/// `env` with `first` put before its `PATH` (which is set if it was not). A directory whose
/// name holds `:` cannot be on `PATH` (it would be read as two): it is left out, with a warning.
fn env_with_path_first(
    env: impl IntoIterator<Item = (OsString, OsString)>,
    first: &[PathBuf],
) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = env.into_iter().collect();
    let (kept, refused): (Vec<&PathBuf>, Vec<&PathBuf>) = first
        .iter()
        .partition(|dir| std::env::join_paths([dir]).is_ok());
    for dir in refused {
        tracing::warn!(
            dir = %dir.display(),
            "this directory's name holds `:`, so it cannot be put on the tools' PATH: programs \
             in it are not found by name"
        );
    }
    let Ok(mut path) = std::env::join_paths(kept) else {
        return env;
    };
    if path.is_empty() {
        return env;
    }
    match env.iter_mut().find(|(name, _)| name == "PATH") {
        Some((_, value)) => {
            if !value.is_empty() {
                path.push(":");
                path.push(&*value);
            }
            *value = path;
        }
        None => env.push(("PATH".into(), path)),
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_put_first_go_before_the_path_or_make_it() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(OsString, OsString)> {
            pairs.iter().map(|(k, v)| (k.into(), v.into())).collect()
        };
        let first = [PathBuf::from("/up/bin"), PathBuf::from("/more")];
        assert_eq!(
            env_with_path_first(env(&[("A", "1"), ("PATH", "/usr/bin:/bin")]), &first),
            env(&[("A", "1"), ("PATH", "/up/bin:/more:/usr/bin:/bin")])
        );
        assert_eq!(
            env_with_path_first(env(&[("A", "1")]), &first[..1]),
            env(&[("A", "1"), ("PATH", "/up/bin")])
        );
        assert_eq!(
            env_with_path_first(env(&[("PATH", "")]), &first[..1]),
            env(&[("PATH", "/up/bin")])
        );
        assert_eq!(
            env_with_path_first(env(&[("PATH", "/bin")]), &[]),
            env(&[("PATH", "/bin")])
        );
        // A name with `:` would be read as two directories: left out.
        let odd = [PathBuf::from("/tmp/a:b/bin"), PathBuf::from("/up/bin")];
        assert_eq!(
            env_with_path_first(env(&[("PATH", "/bin")]), &odd),
            env(&[("PATH", "/up/bin:/bin")])
        );
        assert_eq!(
            env_with_path_first(env(&[("PATH", "/bin")]), &odd[..1]),
            env(&[("PATH", "/bin")])
        );
    }

    #[test]
    fn a_certificate_for_another_host_is_refused_before_any_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = toolsrv_tls::PkiOptions::new(dir.path());
        opts.agents = vec!["web-2".into()];
        opts.clients = vec!["alice".into()];
        toolsrv_tls::init(&opts).unwrap();
        let agent = TlsFiles::in_dir(dir.path(), &Identity::Agent("web-2".into()));
        check_identity(&agent, "web-2").unwrap();
        let err = check_identity(&agent, "web-1").unwrap_err();
        assert!(err.needs_operator());
        let text = err.to_string();
        assert!(
            text.contains("names host `web-2`") && text.contains("--host-id web-2"),
            "{text}"
        );
        let client = TlsFiles::in_dir(dir.path(), &Identity::Client("alice".into()));
        let text = check_identity(&client, "web-1").unwrap_err().to_string();
        assert!(text.contains("client certificate"), "{text}");
        // Not there yet: the attempts will say why, and it may still come.
        let missing = TlsFiles::in_dir(&dir.path().join("none"), &Identity::Agent("x".into()));
        check_identity(&missing, "x").unwrap();
    }

    /// An agent certificate outside its dates is named, with its dates, at each attempt to
    /// connect: the coordinator's refusal in the handshake reads as a broken connection.
    #[tokio::test]
    async fn a_certificate_outside_its_dates_is_named_before_dialling() {
        let dir = tempfile::tempdir().unwrap();
        toolsrv_testkit::write_pki(dir.path(), &["web-1"], &[]).unwrap();
        let day = std::time::Duration::from_secs(86_400);
        let now = std::time::SystemTime::now();
        let identity = Identity::Agent("web-1".into());
        for (stem, dates, says) in [
            (
                "old",
                (now - 3 * day, now - day),
                "this certificate expired at",
            ),
            ("early", (now + day, now + 3 * day), "is valid only from"),
        ] {
            let tls = toolsrv_testkit::sign_with_ca_between(
                dir.path(),
                stem,
                vec![toolsrv_testkit::uri_san(&identity).unwrap()],
                vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
                Some(dates),
            )
            .unwrap();
            // Nothing listens there: the certificate is refused before any dialling.
            let err = connect_tls("https://127.0.0.1:9".into(), tls, "web-1".into())
                .await
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("{stem}.pem")) && err.contains(says),
                "{err}"
            );
        }
    }
}
