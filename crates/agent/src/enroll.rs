//! Enrollment on the agent: joining with a token (`--join`) or, on Kubernetes, with the pod's
//! projected service account token (`--k8s-token-file`), and keeping the certificate renewed
//! over the agent's connection.
//!
//! Everything lives in `<state>/enroll/` (0700): `identity.pem` holds the certificate chain and
//! then the private key, one file replaced by a rename, so that a connection never reads a
//! certificate with the other key; `ca.pem` the CA bundle the coordinator is verified with.
//! The key is made here and never leaves the host; each renewal makes a fresh one.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use toolsrv_proto::v1::enrollment_client::EnrollmentClient;
use toolsrv_proto::v1::renewal_client::RenewalClient;
use toolsrv_proto::v1::{GetCaBundleRequest, JoinRequest, RenewRequest};
use toolsrv_tls::enroll as pki;
use toolsrv_tls::enroll::utc;
use toolsrv_tls::{Identity, Role, TlsFiles};

use crate::config::AgentConfig;
use crate::error::AgentError;

/// The directory of the enrollment files, in the state directory.
pub const ENROLL_DIR: &str = "enroll";
/// Certificate chain, then key.
pub const IDENTITY_FILE: &str = "identity.pem";
/// The CA bundle.
pub const CA_FILE: &str = "ca.pem";
/// How long one enrollment RPC may take.
const RPC_TIMEOUT: Duration = Duration::from_secs(30);

/// How to trust the coordinator before the agent has its CA bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaTrust {
    /// `--ca-pin sha256:HEX`: the CA bundle is fetched and kept only if a certificate in it has
    /// this pin (SHA-256 of the CA certificate's DER).
    Pin(String),
    /// `--ca FILE`: the CA bundle to verify the coordinator with.
    File(PathBuf),
}

/// What the agent joins with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinCredential {
    /// `--join TOKEN`: a one-time join token.
    Token(String),
    /// `--k8s-token-file FILE`: the pod's projected service account token, read at each
    /// join (the kubelet rotates it); it may be used again, so an expired certificate is
    /// replaced by joining again.
    KubernetesTokenFile(PathBuf),
}

impl JoinCredential {
    /// The flag that gave it, for messages.
    fn flag(&self) -> &'static str {
        match self {
            JoinCredential::Token(_) => "--join",
            JoinCredential::KubernetesTokenFile(_) => "--k8s-token-file",
        }
    }
}

/// What enrollment needs from the flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnrollConfig {
    /// What to join with; only used when the state directory holds no usable certificate.
    pub credential: Option<JoinCredential>,
    /// How to trust the coordinator for the join.
    pub trust: Option<CaTrust>,
}

/// The TLS files of an enrolled agent with state directory `state_dir`.
pub fn enrolled_files(state_dir: &Path) -> TlsFiles {
    let dir = state_dir.join(ENROLL_DIR);
    TlsFiles {
        ca: dir.join(CA_FILE),
        cert: dir.join(IDENTITY_FILE),
        key: dir.join(IDENTITY_FILE),
    }
}

/// Whether `state_dir` holds an enrolled certificate (valid or not).
pub fn is_enrolled(state_dir: &Path) -> bool {
    enrolled_files(state_dir).cert.exists()
}

/// The stored certificate's host id and validity.
struct Stored {
    host_id: String,
    not_before: i64,
    not_after: i64,
}

fn read_stored(files: &TlsFiles) -> Result<Stored, AgentError> {
    let bad = |msg: String| AgentError::Identity(format!("{}: {msg}", files.cert.display()));
    let text =
        toolsrv_tls::files::read_text_bounded(&files.cert, toolsrv_tls::files::MAX_PEM_BYTES)
            .map_err(|e| AgentError::io("cannot read", &files.cert, e))?;
    let certs = pki::certs_from_pem(&text).map_err(bad)?;
    let host_id = match toolsrv_tls::identity_of(&certs[0]) {
        Ok(Identity::Agent(id)) => id,
        Ok(other) => return Err(bad(format!("names {other}, not an agent"))),
        Err(e) => return Err(bad(e.to_string())),
    };
    let (not_before, not_after) = pki::validity_of(&certs[0]).map_err(bad)?;
    Ok(Stored {
        host_id,
        not_before,
        not_after,
    })
}

/// Makes `config` use the enrolled certificate: the one in the state directory while it is
/// valid, else a new one from joining with the token. Returns false when `shutdown` fired
/// during the join.
pub async fn prepare(
    config: &mut AgentConfig,
    enroll: &EnrollConfig,
    shutdown: &CancellationToken,
) -> Result<bool, AgentError> {
    let files = enrolled_files(&config.state_dir);
    let dir = config.state_dir.join(ENROLL_DIR);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| AgentError::io("cannot create", &dir, e))?;
    private_dir(&dir)?;
    if files.cert.exists() {
        let stored = read_stored(&files)?;
        if toolsrv_tls::unix_now() < stored.not_after {
            check_host(&config.host_id, &stored.host_id, &files.cert)?;
            if let Some(JoinCredential::Token(_)) = &enroll.credential {
                tracing::info!(
                    host_id = %stored.host_id,
                    "already enrolled: --join is not needed and was not used"
                );
            }
            config.host_id = stored.host_id;
            config.tls = files;
            return Ok(true);
        }
        if enroll.credential.is_none() {
            return Err(AgentError::Identity(format!(
                "the enrolled certificate {} (host `{}`) expired at {} UTC, and an expired \
                 certificate cannot be renewed: create a new token (`toolctl token create \
                 --host-id {}`) and start the agent with --join TOKEN",
                files.cert.display(),
                stored.host_id,
                utc(stored.not_after),
                stored.host_id
            )));
        }
        let flag = enroll
            .credential
            .as_ref()
            .map_or("--join", JoinCredential::flag);
        tracing::warn!(host_id = %stored.host_id, "the enrolled certificate expired; joining again with {flag}");
    }
    let Some(credential) = &enroll.credential else {
        return Err(AgentError::Identity(format!(
            "{} holds no enrolled certificate: start the agent with --join TOKEN (`toolctl token \
             create --host-id ID` prints one), or give --cert and --key",
            dir.display()
        )));
    };
    let Some(trust) = &enroll.trust else {
        return Err(AgentError::Identity(format!(
            "{} needs a way to trust the coordinator: --ca-pin sha256:HEX (`toolctl token \
             create` prints it) or --ca FILE",
            credential.flag()
        )));
    };
    let mut delay = Duration::from_millis(500);
    let urls = crate::run::Coordinators::new(&config.coordinator, &config.host_id);
    loop {
        let url = urls.current();
        let attempt = join(config, &url, credential, trust, &files);
        let result = tokio::select! {
            r = attempt => r,
            () = shutdown.cancelled() => return Ok(false),
        };
        match result {
            Ok(host_id) => {
                config.host_id = host_id;
                config.tls = files;
                return Ok(true);
            }
            Err(e)
                if e.needs_operator()
                    || matches!(&e, AgentError::Rpc { status, .. } if matches!(
                        status.code(),
                        // A bad request, or a coordinator that does not enroll this way: only
                        // an operator changes either.
                        tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition
                    )) =>
            {
                return Err(e);
            }
            Err(e) => {
                // A coordinator that throttles joins from this address says when to come back.
                let wait = delay.max(asked_to_wait(&e));
                tracing::warn!(error = %e, retry_in = ?wait, "cannot join yet; retrying");
                urls.next();
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = shutdown.cancelled() => return Ok(false),
                }
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    }
}

fn check_host(asked: &str, cert_host: &str, cert: &Path) -> Result<(), AgentError> {
    if asked.is_empty() || asked == cert_host {
        return Ok(());
    }
    Err(AgentError::Identity(format!(
        "--host-id {asked} differs from the host id `{cert_host}` this agent was enrolled as \
         ({}): drop --host-id, or enroll `{asked}` with its own state directory and token",
        cert.display()
    )))
}

/// One join: the CA (checked against the pin), then the token and a CSR for a new key over a
/// connection that verifies the coordinator. Writes the files and returns the host id.
async fn join(
    config: &AgentConfig,
    url: &str,
    credential: &JoinCredential,
    trust: &CaTrust,
    files: &TlsFiles,
) -> Result<String, AgentError> {
    let url = &url.to_string();
    let connect_failed = |source| AgentError::Connect {
        url: url.clone(),
        source,
    };
    let ca_pem = match trust {
        CaTrust::File(path) => {
            toolsrv_tls::files::read_text_bounded(path, toolsrv_tls::files::MAX_PEM_BYTES)
                .map_err(|e| AgentError::io("cannot read", path, e))?
        }
        CaTrust::Pin(pin) => {
            // Nothing secret goes over this connection: only the CA bundle comes back, and
            // only its certificates with the pin are kept.
            let tls = toolsrv_tls::unverified_client_config().map_err(connect_failed)?;
            let channel = toolsrv_tls::connect(url, tls)
                .await
                .map_err(connect_failed)?;
            let bundle = EnrollmentClient::new(channel)
                .get_ca_bundle(timed(GetCaBundleRequest {}))
                .await
                .map_err(|status| AgentError::Rpc {
                    what: "fetching the coordinator's CA bundle",
                    status,
                })?
                .into_inner()
                .ca_bundle_pem;
            pki::pinned_certs(&bundle, pin).map_err(AgentError::Identity)?
        }
    };
    write_file(&files.ca, ca_pem.as_bytes())?;
    let tls = toolsrv_tls::anonymous_client_config(&files.ca, Role::Coordinator)
        .map_err(connect_failed)?;
    let channel = toolsrv_tls::connect(url, tls)
        .await
        .map_err(connect_failed)?;
    let (key_pem, csr_der) =
        pki::new_key_and_csr().map_err(|e| AgentError::Identity(e.to_string()))?;
    let mut request = JoinRequest {
        csr_der,
        host_id: config.host_id.clone(),
        ..JoinRequest::default()
    };
    let what = match credential {
        JoinCredential::Token(token) => {
            request.token = token.clone();
            "joining with the token"
        }
        JoinCredential::KubernetesTokenFile(path) => {
            request.kubernetes_token = read_service_account_token(path)?;
            "joining with the Kubernetes service account token"
        }
    };
    let response = EnrollmentClient::new(channel)
        .join(timed(request))
        .await
        .map_err(|status| AgentError::Rpc { what, status })?
        .into_inner();
    let host_id = check_issued(&response.certificate_chain_pem, &key_pem)?;
    check_host(&config.host_id, &host_id, &files.cert)?;
    let mut identity = response.certificate_chain_pem;
    identity.push_str(&key_pem);
    write_file(&files.cert, identity.as_bytes())?;
    if !response.ca_bundle_pem.is_empty() {
        write_file(&files.ca, response.ca_bundle_pem.as_bytes())?;
    }
    tracing::info!(
        host_id = %host_id,
        labels = ?response.labels,
        not_after = %utc(response.not_after_unix),
        "joined: certificate issued and kept in the state directory"
    );
    Ok(host_id)
}

/// The projected token, as the kubelet last wrote it. Bounded: a token is a few KiB.
fn read_service_account_token(path: &Path) -> Result<String, AgentError> {
    const MAX: u64 = 64 * 1024;
    let text = toolsrv_tls::files::open_read(path)
        .and_then(|f| toolsrv_tls::files::read_text_up_to(f, MAX))
        .map_err(|e| AgentError::io("cannot read the service account token", path, e))?;
    let token = text.as_deref().map_or("", str::trim);
    if token.is_empty() {
        return Err(AgentError::Identity(format!(
            "--k8s-token-file {}: not a service account token (empty, or over {} KiB)",
            path.display(),
            MAX / 1024
        )));
    }
    Ok(token.to_string())
}

fn timed<T>(msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.set_timeout(RPC_TIMEOUT);
    req
}

/// Checks that an issued chain is an agent certificate for our key; its host id.
fn check_issued(chain_pem: &str, key_pem: &str) -> Result<String, AgentError> {
    let bad = |msg: String| AgentError::Protocol(format!("the issued certificate: {msg}"));
    let certs = pki::certs_from_pem(chain_pem).map_err(bad)?;
    let ours = pki::public_key_of(key_pem).map_err(bad)?;
    if pki::certificate_public_key(&certs[0]).map_err(bad)? != ours {
        return Err(bad("it is not for the key this agent sent".into()));
    }
    match toolsrv_tls::identity_of(&certs[0]) {
        Ok(Identity::Agent(id)) => Ok(id),
        Ok(other) => Err(bad(format!("it names {other}, not an agent"))),
        Err(e) => Err(bad(e.to_string())),
    }
}

/// Refuses the directory of the enrolled certificate and key unless it is the agent's own: made
/// by this process's user or root, and no other user may write it. One made beforehand
/// by someone who could write the state directory (it is made mode 0700 when it does not exist)
/// could hold a certificate and key of theirs, or swap them later.
fn private_dir(dir: &Path) -> Result<(), AgentError> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(dir).map_err(|e| AgentError::io("cannot look at", dir, e))?;
    // Its owner, and every entry on the way to it, as every state directory is checked.
    let why = if let Err(why) = toolsrv_tls::files::check_owned_dir(dir) {
        why
    } else if md.mode() & 0o022 != 0 {
        format!(
            "mode {:04o} lets other users write it; chmod 700 {}",
            md.mode() & 0o7777,
            dir.display()
        )
    } else {
        return Ok(());
    };
    Err(AgentError::Refused {
        what: format!("the enrollment directory {}", dir.display()),
        why,
    })
}

/// Writes `bytes` to `path` (0600) by a rename, so readers see the old or the new file.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), AgentError> {
    toolsrv_tls::write_atomically(path, bytes).map_err(|e| AgentError::io("cannot write", path, e))
}

/// When to renew a certificate valid from `not_before` to `not_after`: at two thirds of its
/// lifetime, as Unix seconds.
pub fn renewal_due(not_before: i64, not_after: i64) -> i64 {
    not_before + (not_after - not_before).max(0) * 2 / 3
}

/// How long to wait before trying a failed renewal again: a tenth of what is left, between 1 s
/// and 30 s.
fn retry_after(not_after: i64, now: i64) -> Duration {
    let left = u64::try_from(not_after - now).unwrap_or(0);
    Duration::from_secs((left / 10).clamp(1, 30))
}

/// Renews the enrolled certificate at two thirds of its lifetime, for as long as the agent runs,
/// over the latest channel the agent opened (its link's connection). The new certificate and
/// key replace the old in one rename; the live link goes on with the connection it has, and
/// the next connection presents the new certificate.
pub async fn keep_renewed(
    state_dir: PathBuf,
    channels: watch::Receiver<Option<Channel>>,
    shutdown: CancellationToken,
) {
    let files = enrolled_files(&state_dir);
    let mut wait = None;
    // A renewed certificate that could not be written (a full disk): written again until it
    // is, not asked for again (each request has the coordinator sign one more).
    let mut unstored: Option<Issued> = None;
    loop {
        let stored = match read_stored(&files) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot read the enrolled certificate; renewal stops");
                return;
            }
        };
        let now = toolsrv_tls::unix_now();
        let sleep = wait.take().unwrap_or_else(|| {
            Duration::from_secs(
                u64::try_from(renewal_due(stored.not_before, stored.not_after) - now).unwrap_or(0),
            )
        });
        tokio::select! {
            () = tokio::time::sleep(sleep) => {}
            () = shutdown.cancelled() => return,
        }
        let now = toolsrv_tls::unix_now();
        if let Some(issued) = unstored.take().filter(|i| i.not_after > now) {
            match issued.store(&files) {
                Ok(()) => {
                    tracing::info!(host_id = %stored.host_id, not_after = %utc(issued.not_after), "renewed certificate written")
                }
                Err(e) => {
                    let retry = retry_after(issued.not_after, now);
                    tracing::error!(error = %e, retry_in = ?retry, "still cannot write the renewed certificate; the current one is used until it can be");
                    wait = Some(retry);
                    unstored = Some(issued);
                }
            }
            continue;
        }
        let Some(channel) = channels.borrow().clone() else {
            wait = Some(Duration::from_secs(1));
            continue;
        };
        let renewed = renew_once(channel, &stored.host_id).await;
        match renewed.and_then(|issued| match issued.store(&files) {
            Ok(()) => Ok(issued.not_after),
            Err(e) => {
                unstored = Some(issued);
                Err(e)
            }
        }) {
            Ok(not_after) => {
                tracing::info!(host_id = %stored.host_id, not_after = %utc(not_after), "certificate renewed");
            }
            Err(e) if unstored.is_some() => {
                let retry = retry_after(stored.not_after, toolsrv_tls::unix_now());
                tracing::error!(error = %e, retry_in = ?retry, "the certificate was renewed, but cannot be written; it is written again until it can be");
                wait = Some(retry);
            }
            Err(e) => {
                let now = toolsrv_tls::unix_now();
                if now >= stored.not_after {
                    tracing::error!(
                        error = %e,
                        "the certificate expired before it could be renewed: the agent needs a \
                         new token (`toolctl token create --host-id {}`, then --join)",
                        stored.host_id
                    );
                    wait = Some(Duration::from_secs(60));
                } else {
                    // A coordinator that throttles renewals says when to come back.
                    let retry = retry_after(stored.not_after, now).max(asked_to_wait(&e));
                    tracing::warn!(error = %e, retry_in = ?retry, "cannot renew the certificate yet");
                    wait = Some(retry);
                }
            }
        }
    }
}

/// How long a refusal asks the agent to wait: a throttled join or renewal says so in its metadata
/// ([`toolsrv_proto::RETRY_PUSHBACK_METADATA`]); at most an hour is taken from it.
fn asked_to_wait(e: &AgentError) -> Duration {
    let AgentError::Rpc { status, .. } = e else {
        return Duration::ZERO;
    };
    toolsrv_proto::retry_pushback(status)
        .map_or(Duration::ZERO, |wait| wait.min(Duration::from_secs(3600)))
}

/// A certificate the coordinator issued on renewal, with its key, before it is written.
struct Issued {
    ca_bundle_pem: String,
    /// The certificate chain, then the key.
    identity_pem: String,
    not_after: i64,
}

impl Issued {
    /// Writes the CA bundle (when the coordinator sent one), then the certificate and key in
    /// one rename.
    fn store(&self, files: &TlsFiles) -> Result<(), AgentError> {
        if !self.ca_bundle_pem.is_empty() {
            write_file(&files.ca, self.ca_bundle_pem.as_bytes())?;
        }
        write_file(&files.cert, self.identity_pem.as_bytes())
    }
}

async fn renew_once(channel: Channel, host_id: &str) -> Result<Issued, AgentError> {
    let (key_pem, csr_der) =
        pki::new_key_and_csr().map_err(|e| AgentError::Identity(e.to_string()))?;
    let response = RenewalClient::new(channel)
        .renew(timed(RenewRequest {
            csr_der,
            host_id: host_id.to_string(),
        }))
        .await
        .map_err(|status| AgentError::Rpc {
            what: "renewing the certificate",
            status,
        })?
        .into_inner();
    let issued = check_issued(&response.certificate_chain_pem, &key_pem)?;
    if issued != host_id {
        return Err(AgentError::Protocol(format!(
            "the renewed certificate names host `{issued}`, not `{host_id}`"
        )));
    }
    let mut identity_pem = response.certificate_chain_pem;
    identity_pem.push_str(&key_pem);
    Ok(Issued {
        ca_bundle_pem: response.ca_bundle_pem,
        identity_pem,
        not_after: response.not_after_unix,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The enrollment directory is the agent's own, or the agent stops. (Needs root, to give the
    /// directory away.)
    #[test]
    fn an_enrollment_directory_another_user_could_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join(ENROLL_DIR);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        private_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
        let err = private_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("mode 0770 lets other users write it"), "{err}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&dir, Some(65534), None).unwrap();
        let err = private_dir(&dir).unwrap_err().to_string();
        assert!(
            err.contains(&dir.display().to_string()) && err.contains("owned by uid 65534"),
            "{err}"
        );
    }

    #[test]
    fn renewal_at_two_thirds() {
        assert_eq!(renewal_due(1000, 1090), 1060);
        assert_eq!(renewal_due(0, 86_400), 57_600);
        assert_eq!(renewal_due(10, 5), 10);
        assert_eq!(retry_after(100, 0), Duration::from_secs(10));
        assert_eq!(retry_after(100, 99), Duration::from_secs(1));
        assert_eq!(retry_after(100_000, 0), Duration::from_secs(30));
        assert_eq!(retry_after(0, 100), Duration::from_secs(1));
    }

    #[test]
    fn a_throttled_renewal_waits_as_long_as_it_is_told() {
        let refused = |status: tonic::Status| AgentError::Rpc {
            what: "renewing the certificate",
            status,
        };
        let throttled = |wait| {
            refused(toolsrv_proto::with_retry_pushback(
                tonic::Status::resource_exhausted("too many renewals from a1: come back in 8 s"),
                wait,
            ))
        };
        assert_eq!(
            asked_to_wait(&throttled(Duration::from_millis(7_500))),
            Duration::from_millis(7_500)
        );
        assert_eq!(
            asked_to_wait(&throttled(Duration::from_secs(86_400))),
            Duration::from_secs(3600)
        );
        // The words alone are for people.
        let worded = tonic::Status::resource_exhausted("come back in 8 s");
        assert_eq!(asked_to_wait(&refused(worded)), Duration::ZERO);
        let mut odd = tonic::Status::resource_exhausted("slow down");
        odd.metadata_mut().insert(
            toolsrv_proto::RETRY_PUSHBACK_METADATA,
            "soon".parse().unwrap(),
        );
        assert_eq!(asked_to_wait(&refused(odd)), Duration::ZERO);
    }
}
