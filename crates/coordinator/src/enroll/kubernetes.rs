//! Joining with a Kubernetes service account token (`toolsrv coordinator
//! --k8s-join-service-account NS/NAME`): the agent's pod gets a projected token with the
//! coordinator's audience, sends it in place of a join token, and the coordinator asks the
//! Kubernetes API (`TokenReview`) whether the token is valid, for that audience, of an allowed
//! service account, and bound to a pod on which node. The node's name is the host id.
//!
//! Only the API server vouches for a token: nothing in the JWT is read here. A review that
//! cannot be made (API unreachable, the coordinator's own credentials refused) refuses the
//! join as UNAVAILABLE, so the agent retries; a review that says no refuses it as
//! PERMISSION_DENIED.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::Request;
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST, USER_AGENT};
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// The key of a token review's `user.extra` naming the node of the pod the token is bound to
/// (Kubernetes 1.30 and later).
pub const NODE_NAME_KEY: &str = "authentication.kubernetes.io/node-name";
/// The key naming the pod the token is bound to.
pub const POD_NAME_KEY: &str = "authentication.kubernetes.io/pod-name";
/// Where the Kubernetes API is reviewed.
const TOKEN_REVIEW_PATH: &str = "/apis/authentication.k8s.io/v1/tokenreviews";
/// The longest service account token read; real ones are 1–2 KiB.
pub const MAX_TOKEN_LEN: usize = 16 * 1024;
/// The most of a review response read.
const MAX_RESPONSE_BYTES: usize = 256 * 1024;
/// How long one review may take, connection included.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);

/// In-cluster defaults, as every pod has them.
pub const IN_CLUSTER_CA: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
pub const IN_CLUSTER_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// How the coordinator checks service account tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesJoin {
    /// The API server's base URL (`https://HOST:PORT`).
    pub api_url: String,
    /// The CA bundle the API server's certificate chains to.
    pub api_ca: PathBuf,
    /// The coordinator's own bearer token for the API, read again for every review (the
    /// kubelet rotates it).
    pub api_token_file: PathBuf,
    /// The audience the agents' tokens must be for.
    pub audience: String,
    /// `namespace/name` of each service account whose tokens may join.
    pub service_accounts: Vec<String>,
    /// Labels bound to every certificate issued this way (trusted labels).
    pub labels: BTreeMap<String, String>,
}

/// What a review vouched for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reviewed {
    /// The node's name, normalised as a host id.
    pub host_id: String,
    /// `namespace/name`.
    pub service_account: String,
    /// The pod the token is bound to, when the review says.
    pub pod: String,
}

/// Why a join with a service account token failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReviewError {
    /// The API says no, or the token is not one that may join.
    #[error("{0}")]
    Refused(String),
    /// The review could not be made; the agent should try again.
    #[error("{0}")]
    Unavailable(String),
}

impl From<ReviewError> for tonic::Status {
    fn from(e: ReviewError) -> Self {
        match e {
            ReviewError::Refused(m) => tonic::Status::permission_denied(m),
            ReviewError::Unavailable(m) => tonic::Status::unavailable(m),
        }
    }
}

/// Reviews tokens against one API server.
#[derive(Debug)]
pub struct Reviewer {
    config: KubernetesJoin,
    tls: std::sync::Arc<rustls::ClientConfig>,
    /// `host:port` to dial, the name (or address) the certificate must carry, the `Host`
    /// header and the path prefix of the base URL.
    authority: String,
    server_name: ServerName<'static>,
    path: String,
}

#[derive(Debug, Deserialize)]
struct Review {
    #[serde(default)]
    status: ReviewStatus,
}

#[derive(Debug, Default, Deserialize)]
struct ReviewStatus {
    #[serde(default)]
    authenticated: bool,
    #[serde(default)]
    error: String,
    #[serde(default)]
    audiences: Vec<String>,
    #[serde(default)]
    user: ReviewUser,
}

#[derive(Debug, Default, Deserialize)]
struct ReviewUser {
    #[serde(default)]
    username: String,
    #[serde(default)]
    extra: BTreeMap<String, Vec<String>>,
}

impl Reviewer {
    /// Checks the settings and loads the API server's CA.
    pub fn new(config: KubernetesJoin) -> Result<Self, String> {
        let uri: hyper::Uri = config
            .api_url
            .parse()
            .map_err(|e| format!("--k8s-api {}: not a URL: {e}", config.api_url))?;
        if uri.scheme_str() != Some("https") {
            return Err(format!(
                "--k8s-api {}: the Kubernetes API is reached over https only",
                config.api_url
            ));
        }
        let host = uri
            .host()
            .ok_or_else(|| format!("--k8s-api {}: no host in it", config.api_url))?;
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let server_name = ServerName::try_from(bare.to_string())
            .map_err(|e| format!("--k8s-api {}: {e}", config.api_url))?;
        let authority = format!("{host}:{}", uri.port_u16().unwrap_or(443));
        let path = uri.path().trim_end_matches('/').to_string() + TOKEN_REVIEW_PATH;
        if config.service_accounts.is_empty() {
            return Err("--k8s-join-service-account: name at least one NAMESPACE/NAME".into());
        }
        for sa in &config.service_accounts {
            parse_service_account(sa)?;
        }
        if config.audience.trim().is_empty() {
            return Err("--k8s-join-audience: empty".into());
        }
        let tls = toolsrv_tls::https_client_config(&config.api_ca).map_err(|e| e.to_string())?;
        Ok(Self {
            config,
            tls,
            authority,
            server_name,
            path,
        })
    }

    /// The labels bound to certificates issued this way.
    pub fn labels(&self) -> &BTreeMap<String, String> {
        &self.config.labels
    }

    /// Asks the API about `token`; what it vouches for, or why not.
    pub async fn review(&self, token: &str) -> Result<Reviewed, ReviewError> {
        let status = tokio::time::timeout(REVIEW_TIMEOUT, self.ask(token))
            .await
            .map_err(|_| {
                ReviewError::Unavailable(format!(
                    "the Kubernetes API at {} did not answer the token review within {} s",
                    self.config.api_url,
                    REVIEW_TIMEOUT.as_secs()
                ))
            })??;
        self.judge(status)
    }

    /// The review's status as the API answered it.
    async fn ask(&self, token: &str) -> Result<ReviewStatus, ReviewError> {
        let unavailable = |what: String| {
            ReviewError::Unavailable(format!(
                "cannot review the service account token with the Kubernetes API at {}: {what}",
                self.config.api_url
            ))
        };
        let bearer = toolsrv_tls::files::read_text_bounded(
            &self.config.api_token_file,
            toolsrv_tls::files::MAX_PEM_BYTES,
        )
        .map_err(|e| {
            unavailable(format!(
                "cannot read the coordinator's own API token {}: {e}",
                self.config.api_token_file.display()
            ))
        })?;
        let body = json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [self.config.audience]},
        });
        let request = Request::post(&self.path)
            .header(HOST, &self.authority)
            .header(AUTHORIZATION, format!("Bearer {}", bearer.trim()))
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "application/json")
            .header(
                USER_AGENT,
                concat!("toolsrv-coordinator/", env!("CARGO_PKG_VERSION")),
            )
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| unavailable(e.to_string()))?;
        let tcp = TcpStream::connect(&self.authority)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let tls = TlsConnector::from(self.tls.clone())
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|e| unavailable(format!("TLS: {e}")))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let driver = tokio::spawn(connection);
        let response = sender.send_request(request).await;
        let result = async {
            let response = response.map_err(|e| unavailable(e.to_string()))?;
            let code = response.status();
            let bytes = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
                .collect()
                .await
                .map_err(|e| unavailable(format!("reading the answer: {e}")))?
                .to_bytes();
            match code.as_u16() {
                200 | 201 => {}
                401 | 403 => {
                    return Err(unavailable(format!(
                        "the API refused the coordinator's own credentials ({code}): its service \
                         account needs the system:auth-delegator cluster role (or `create` on \
                         tokenreviews)"
                    )));
                }
                _ => {
                    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned();
                    return Err(unavailable(format!("HTTP {code}: {text}")));
                }
            }
            serde_json::from_slice::<Review>(&bytes)
                .map(|r| r.status)
                .map_err(|e| unavailable(format!("not a TokenReview: {e}")))
        }
        .await;
        driver.abort();
        result
    }

    /// Whether what the API said lets the token join.
    fn judge(&self, status: ReviewStatus) -> Result<Reviewed, ReviewError> {
        let refuse = |m: String| Err(ReviewError::Refused(m));
        if !status.authenticated {
            let why = if status.error.is_empty() {
                "no reason given".to_string()
            } else {
                status.error
            };
            return refuse(format!(
                "the Kubernetes API did not accept the service account token ({why}): project a \
                 fresh token with audience `{}` into the agent's pod",
                self.config.audience
            ));
        }
        if !status.audiences.iter().any(|a| a == &self.config.audience) {
            return refuse(format!(
                "the service account token is not for audience `{}` (the API says it is for {:?}): \
                 set the projected token's audience to `{}`",
                self.config.audience, status.audiences, self.config.audience
            ));
        }
        let Some(account) = status.user.username.strip_prefix("system:serviceaccount:") else {
            return refuse(format!(
                "`{}` is not a service account: only pods' service account tokens may join",
                status.user.username
            ));
        };
        let account = account.replacen(':', "/", 1);
        if !self.config.service_accounts.iter().any(|a| a == &account) {
            return refuse(format!(
                "service account {account} may not join: this coordinator accepts {}",
                self.config.service_accounts.join(", ")
            ));
        }
        let node = match status.user.extra.get(NODE_NAME_KEY).map(Vec::as_slice) {
            Some([node]) if !node.is_empty() => node.clone(),
            _ => {
                return refuse(format!(
                    "the token of {account} is not bound to a pod on a node (no `{NODE_NAME_KEY}` \
                     in the review): use a projected service account token, on Kubernetes 1.30 \
                     or later"
                ));
            }
        };
        let host_id = toolsrv_tls::Identity::agent(&node)
            .map_err(|e| ReviewError::Refused(format!("node name `{node}`: {e}")))?
            .name()
            .unwrap_or_default()
            .to_string();
        let pod = status
            .user
            .extra
            .get(POD_NAME_KEY)
            .and_then(|p| p.first())
            .cloned()
            .unwrap_or_default();
        Ok(Reviewed {
            host_id,
            service_account: account,
            pod,
        })
    }
}

/// Checks a `namespace/name` service account reference.
pub fn parse_service_account(text: &str) -> Result<(&str, &str), String> {
    let dns_label = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    match text.split_once('/') {
        Some((ns, name)) if dns_label(ns) && dns_label(name) => Ok((ns, name)),
        _ => Err(format!(
            "--k8s-join-service-account {text}: expected NAMESPACE/NAME (lowercase DNS names), \
             e.g. toolsrv/toolsrv-agent"
        )),
    }
}

/// The API server's URL as every pod sees it, when the coordinator runs in a cluster.
pub fn in_cluster_url() -> Option<String> {
    let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
    let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
    Some(if host.contains(':') {
        format!("https://[{host}]:{port}")
    } else {
        format!("https://{host}:{port}")
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn reviewer() -> Reviewer {
        let dir = tempfile::tempdir().unwrap();
        toolsrv_tls::init(&toolsrv_tls::PkiOptions::new(dir.path())).unwrap();
        Reviewer::new(KubernetesJoin {
            api_url: "https://10.96.0.1:443".into(),
            api_ca: dir.path().join(toolsrv_tls::CA_CERT),
            api_token_file: "/nonexistent".into(),
            audience: "toolsrv".into(),
            service_accounts: vec!["toolsrv/toolsrv-agent".into()],
            labels: BTreeMap::new(),
        })
        .unwrap()
    }

    fn status(user: &str, audiences: &[&str], node: Option<&str>) -> ReviewStatus {
        let mut extra = BTreeMap::new();
        if let Some(node) = node {
            extra.insert(NODE_NAME_KEY.to_string(), vec![node.to_string()]);
        }
        ReviewStatus {
            authenticated: true,
            error: String::new(),
            audiences: audiences.iter().map(|a| a.to_string()).collect(),
            user: ReviewUser {
                username: user.into(),
                extra,
            },
        }
    }

    #[test]
    fn a_review_names_the_node_of_an_allowed_account_for_our_audience() {
        let r = reviewer();
        let ok = r
            .judge(status(
                "system:serviceaccount:toolsrv:toolsrv-agent",
                &["toolsrv"],
                Some("Node-7"),
            ))
            .unwrap();
        assert_eq!(ok.host_id, "node-7");
        assert_eq!(ok.service_account, "toolsrv/toolsrv-agent");
        let refused = |s: ReviewStatus| match r.judge(s) {
            Err(ReviewError::Refused(m)) => m,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert!(
            refused(status(
                "system:serviceaccount:toolsrv:toolsrv-agent",
                &["other"],
                Some("n")
            ))
            .contains("audience `toolsrv`")
        );
        assert!(
            refused(status(
                "system:serviceaccount:default:default",
                &["toolsrv"],
                Some("n")
            ))
            .contains("default/default may not join")
        );
        assert!(
            refused(status("alice", &["toolsrv"], Some("n"))).contains("not a service account")
        );
        assert!(
            refused(status(
                "system:serviceaccount:toolsrv:toolsrv-agent",
                &["toolsrv"],
                None
            ))
            .contains(NODE_NAME_KEY)
        );
        let mut denied = status("x", &[], None);
        denied.authenticated = false;
        denied.error = "token has expired".into();
        assert!(refused(denied).contains("token has expired"));
    }

    #[test]
    fn settings_are_checked_at_start() {
        assert!(parse_service_account("toolsrv/toolsrv-agent").is_ok());
        for bad in ["toolsrv", "/x", "a/", "Tool/x", "a/b c"] {
            assert!(parse_service_account(bad).is_err(), "{bad}");
        }
    }
}
