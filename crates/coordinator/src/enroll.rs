//! Enrollment: join tokens, joins and renewals (`proto/toolsrv/v1/enroll.proto`).
//!
//! - `JoinTokens` (clients matching `--admin`): creates a one-time token bound to a host id and
//!   labels; only its SHA-256 is kept ([`tokens`]).
//! - `Enrollment` (also served to peers without a certificate, the only service that is): the
//!   CA bundle, and `Join`, which exchanges a token (or a Kubernetes service account token the
//!   API vouches for, [`kubernetes`]) and a CSR for a short-lived agent certificate signed with
//!   `--signing-ca-cert`/`--signing-ca-key`.
//! - `Renewal` (agents): a new certificate for the caller's own host id and labels, as proven
//!   by its current certificate.
//!
//! Every token creation, join and renewal, granted or refused, is audited; an address whose
//! joins keep being refused, and an agent that keeps renewing, are slowed down ([`throttle`]).

pub mod kubernetes;
mod throttle;
pub mod tokens;

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tonic::{Request, Response, Status};
use toolsrv_proto::text::printable_line;
use toolsrv_proto::v1::enrollment_server::Enrollment as EnrollmentRpc;
use toolsrv_proto::v1::join_tokens_server::JoinTokens;
use toolsrv_proto::v1::renewal_server::Renewal;
use toolsrv_proto::v1::{
    CreateJoinTokenRequest, CreateJoinTokenResponse, GetCaBundleRequest, GetCaBundleResponse,
    JoinRequest, JoinResponse, JoinTokenInfo, ListJoinTokensRequest, ListJoinTokensResponse,
    RenewRequest, RenewResponse, RevokeJoinTokenRequest, RevokeJoinTokenResponse,
};
use toolsrv_tls::enroll::{Signer, check_label, new_token, pin_for};

use crate::State;
use crate::identity::Caller;
use kubernetes::Reviewer;
pub(crate) use tokens::UNKNOWN as UNKNOWN_TOKEN;
use tokens::{ConsumeError, RevokeError, TokenRecord, Tokens};

/// A token's lifetime when the request names none.
pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(3600);
/// The longest lifetime a token may ask for.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(30 * 86_400);
/// The default lifetime of enrolled agents' certificates (`--agent-cert-ttl`).
pub const DEFAULT_AGENT_CERT_TTL: Duration = Duration::from_secs(86_400);
/// Longest token we read; real ones are 52 characters.
const MAX_TOKEN_LEN: usize = 256;

/// Where the signing CA is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SigningCa {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

/// Enrollment as a running coordinator has it: on when a signing CA was given.
#[derive(Debug)]
pub(crate) struct Enrollment {
    signer: Signer,
    ttl: Duration,
    tokens: Tokens,
    /// What `toolsrv agent --ca-pin` takes: the pin of the CA the coordinator's certificate
    /// chains to.
    pin: String,
    /// Joins with Kubernetes service account tokens; `None` when off.
    kubernetes: Option<Reviewer>,
    /// Refused joins per address ([`toolsrv_tls::address_key`]).
    joins: throttle::Throttle<std::net::IpAddr>,
    /// Renewals per agent.
    renewals: throttle::Throttle<String>,
}

impl Enrollment {
    /// Loads the signing CA and the tokens; `None` when enrollment is off.
    pub fn open(
        config: &crate::CoordinatorConfig,
    ) -> Result<Option<Self>, crate::CoordinatorError> {
        let Some(signing) = &config.signing_ca else {
            if config.kubernetes_join.is_some() {
                return Err(crate::CoordinatorError::Enrollment(
                    "--k8s-join-service-account needs a CA to sign with: give \
                     --signing-ca-cert and --signing-ca-key"
                        .into(),
                ));
            }
            tracing::info!(
                "enrollment is off (no --signing-ca-cert and --signing-ca-key): hosts need \
                 certificates issued elsewhere"
            );
            return Ok(None);
        };
        let signer = Signer::load(&signing.cert, &signing.key, &config.tls.ca)?;
        let tokens = Tokens::open(config.state_dir.as_deref())
            .map_err(crate::CoordinatorError::Enrollment)?;
        if !tokens.persistent() {
            tracing::warn!(
                "no --state-dir: join tokens are kept in memory only; a restart forgets them \
                 (tokens not yet used stop working), give --state-dir to keep them"
            );
        }
        let pin = pin_for(&config.tls.ca, &config.tls.cert)?;
        tracing::info!(
            signing_ca = %signing.cert.display(),
            agent_cert_ttl = ?config.agent_cert_ttl,
            ca_pin = %pin,
            "enrollment is on: hosts may join with tokens"
        );
        let kubernetes = match &config.kubernetes_join {
            Some(k8s) => {
                let reviewer =
                    Reviewer::new(k8s.clone()).map_err(crate::CoordinatorError::Enrollment)?;
                tracing::info!(
                    api = %k8s.api_url,
                    audience = %k8s.audience,
                    service_accounts = ?k8s.service_accounts,
                    "pods may join with Kubernetes service account tokens"
                );
                Some(reviewer)
            }
            None => None,
        };
        Ok(Some(Self {
            signer,
            ttl: config.agent_cert_ttl,
            tokens,
            pin,
            kubernetes,
            joins: throttle::Throttle::new(throttle::JOIN_RATE),
            renewals: throttle::Throttle::new(throttle::renewal_rate(config.agent_cert_ttl)),
        }))
    }
}

fn enrollment(state: &State) -> Result<&Enrollment, Status> {
    state.enrollment.as_ref().ok_or_else(|| {
        Status::failed_precondition(
            "enrollment is off on this coordinator: start it with --signing-ca-cert and \
             --signing-ca-key",
        )
    })
}

/// The refusal of a join or renewal (`event`) its asker's [`throttle`] did not admit, counted
/// in the metrics; `too_many` says whose requests are over. `record`: the first of a run, with
/// the fields of its audit record, which says `"outcome": "throttled"`.
fn throttled(
    state: &State,
    event: &'static str,
    too_many: String,
    retry_after: Duration,
    record: Option<serde_json::Value>,
) -> Status {
    state.metrics.enrollment_throttled(event);
    let message = format!(
        "{too_many}: come back in {} s",
        retry_after.as_secs().max(1)
    );
    if let Some(serde_json::Value::Object(fields)) = record {
        let mut line = serde_json::Map::from_iter([("outcome".to_string(), json!("throttled"))]);
        line.extend(fields);
        line.insert(
            "message".into(),
            json!(format!(
                "{message}; until then its {event}s are refused without a record each"
            )),
        );
        state.audit.event(event, line.into());
    }
    toolsrv_proto::with_retry_pushback(Status::resource_exhausted(message), retry_after)
}

fn ca_bundle(state: &State) -> Result<String, Status> {
    toolsrv_tls::files::read_text_bounded(&state.config.tls.ca, toolsrv_tls::files::MAX_PEM_BYTES).map_err(|e| {
        tracing::error!(error = %e, path = %state.config.tls.ca.display(), "cannot read the CA bundle");
        Status::internal("the coordinator cannot read its CA bundle; see its log")
    })
}

fn remote<T>(req: &Request<T>) -> String {
    remote_addr(req).map(|a| a.to_string()).unwrap_or_default()
}

fn remote_addr<T>(req: &Request<T>) -> Option<std::net::SocketAddr> {
    req.extensions()
        .get::<toolsrv_tls::ConnInfo>()
        .map(|c| c.remote)
}

/// The `Enrollment` service: served to anyone who reaches the port.
#[derive(Debug, Clone)]
pub struct EnrollmentService {
    pub(crate) state: Arc<State>,
}

#[tonic::async_trait]
impl EnrollmentRpc for EnrollmentService {
    async fn get_ca_bundle(
        &self,
        _req: Request<GetCaBundleRequest>,
    ) -> Result<Response<GetCaBundleResponse>, Status> {
        enrollment(&self.state)?;
        Ok(Response::new(GetCaBundleResponse {
            ca_bundle_pem: ca_bundle(&self.state)?,
        }))
    }

    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinResponse>, Status> {
        let from = remote(&req);
        // Marked by another replica that did not know the token: answered here alone, and
        // counted against the joining host's address by the replica it reached.
        let relayed = crate::replicas::is_relayed(&req);
        let counted = match (&self.state.enrollment, remote_addr(&req)) {
            (Some(enrollment), Some(addr)) if !relayed => {
                Some((&enrollment.joins, toolsrv_tls::address_key(addr.ip())))
            }
            _ => None,
        };
        let body = req.into_inner();
        let with = if body.kubernetes_token.is_empty() {
            "join_token"
        } else {
            "kubernetes"
        };
        if let Some((throttle, ip)) = counted
            && let throttle::Admit::No {
                retry_after,
                record,
            } = throttle.admit(&ip, tokio::time::Instant::now())
        {
            if record {
                tracing::warn!(remote = %from, "joins refused unexamined: too many refused joins from this address (10 at once, then one each 6 s); only the first is recorded");
            }
            return Err(throttled(
                &self.state,
                "join",
                format!("too many refused joins from {ip}"),
                retry_after,
                record.then(|| {
                    json!({"host": "", "remote": from, "asked_host": body.host_id, "with": with})
                }),
            ));
        }
        let mut by = serde_json::Value::Null;
        let mut signed_by = None;
        // No certificate is handed out that the audit log cannot record ([`crate::audit`]).
        let mut result = if let Err(why) = self.state.audit.writable() {
            Err((body.host_id.clone(), Status::unavailable(why)))
        } else if body.kubernetes_token.is_empty() {
            self.inner_join(&body)
        } else {
            self.inner_kubernetes_join(&body, &mut by).await
        };
        // A token another replica keeps: that replica signs and uses it.
        if let (Err((_, status)), Some(replicas)) = (&result, &self.state.replicas)
            && !relayed
            && body.kubernetes_token.is_empty()
            && status.message().starts_with(UNKNOWN_TOKEN)
            && let Some((replica, answer)) = replicas.join_elsewhere(&body).await
        {
            signed_by = Some(replica);
            result = answer.map_err(|status| (body.host_id.clone(), status));
        }
        let audit = |outcome: &str, host: &str, message: &str| {
            self.state.audit.event(
                "join",
                json!({"outcome": outcome, "host": host, "remote": from, "asked_host": body.host_id,
                       "with": with, "kubernetes": by, "message": message,
                       "signed_by_replica": signed_by}),
            );
        };
        match &result {
            Ok(resp) => {
                tracing::info!(host = %resp.host_id, remote = %from, with, "host joined");
                audit("granted", &resp.host_id, "");
            }
            Err((host, status)) => {
                // The reason quotes what the peer asked for: escaped, as all a peer sends.
                tracing::info!(host = %printable_line(host, 256), remote = %from, with,
                    reason = %printable_line(status.message(), 1024), "join refused");
                audit("refused", host, status.message());
                // The coordinator's own trouble (its audit log) is not the joining host's.
                if let Some((throttle, ip)) = counted
                    && status.code() != tonic::Code::Unavailable
                {
                    throttle.count(ip, tokio::time::Instant::now());
                }
            }
        }
        result.map(Response::new).map_err(|(_, status)| status)
    }
}

impl EnrollmentService {
    /// A join with a Kubernetes service account token: the API reviews it, the node it names
    /// is the host id. Sets `by` to what the review said, for the audit record.
    async fn inner_kubernetes_join(
        &self,
        req: &JoinRequest,
        by: &mut serde_json::Value,
    ) -> Result<JoinResponse, (String, Status)> {
        let enrollment = enrollment(&self.state).map_err(|s| (String::new(), s))?;
        let refuse = |s: Status| (String::new(), s);
        let Some(reviewer) = &enrollment.kubernetes else {
            return Err(refuse(Status::failed_precondition(
                "this coordinator does not accept Kubernetes service account tokens: start it \
                 with --k8s-join-service-account NAMESPACE/NAME, or join with a token from \
                 `toolctl token create`",
            )));
        };
        if !req.token.is_empty() {
            return Err(refuse(Status::invalid_argument(
                "a join token and a Kubernetes service account token were both given: send one",
            )));
        }
        let token = req.kubernetes_token.trim();
        if token.len() > kubernetes::MAX_TOKEN_LEN || token.contains(char::is_whitespace) {
            return Err(refuse(Status::invalid_argument(format!(
                "not a service account token (a JWT of at most {} bytes)",
                kubernetes::MAX_TOKEN_LEN
            ))));
        }
        let reviewed = reviewer.review(token).await.map_err(|e| refuse(e.into()))?;
        *by = json!({"service_account": reviewed.service_account, "pod": reviewed.pod});
        let host = reviewed.host_id;
        if !req.host_id.is_empty() && toolsrv_tls::normalize_name(&req.host_id) != host {
            return Err((
                host.clone(),
                Status::permission_denied(format!(
                    "the service account token is bound to a pod on node `{host}`, but this agent \
                     was started with --host-id {}: on Kubernetes the host id is the node name \
                     (spec.nodeName)",
                    req.host_id
                )),
            ));
        }
        let labels = reviewer.labels().clone();
        let issued = enrollment
            .signer
            .issue_agent(&req.csr_der, &host, &labels, enrollment.ttl)
            .map_err(|e| (host.clone(), Status::from(e)))?;
        Ok(JoinResponse {
            certificate_chain_pem: issued.chain_pem,
            ca_bundle_pem: ca_bundle(&self.state).map_err(|s| (host.clone(), s))?,
            host_id: host,
            labels,
            not_after_unix: issued.not_after,
        })
    }

    /// A join; on refusal, the token's host id when known (for the audit record) and why.
    fn inner_join(&self, req: &JoinRequest) -> Result<JoinResponse, (String, Status)> {
        let enrollment = enrollment(&self.state).map_err(|s| (String::new(), s))?;
        let token = req.token.trim();
        if token.is_empty() || token.len() > MAX_TOKEN_LEN {
            return Err((
                String::new(),
                Status::invalid_argument(
                    "no join token, or not one: give the token `toolctl token create` printed",
                ),
            ));
        }
        let now = toolsrv_tls::unix_now();
        let record = enrollment
            .tokens
            .check(token, &req.host_id, now)
            .map_err(|r| (String::new(), Status::permission_denied(r.to_string())))?;
        let host = record.host_id.clone();
        // Sign first (a bad CSR leaves the token usable), use the token, then hand the
        // certificate out: a certificate is only ever returned for a token marked used on disk.
        let issued = enrollment
            .signer
            .issue_agent(
                &req.csr_der,
                &record.host_id,
                &record.labels,
                enrollment.ttl,
            )
            .map_err(|e| (host.clone(), Status::from(e)))?;
        enrollment
            .tokens
            .consume(token, &req.host_id, now)
            .map_err(|e| match e {
                ConsumeError::Refused(r) => (host.clone(), Status::permission_denied(r.to_string())),
                ConsumeError::Store(msg) => {
                    tracing::error!(error = %msg, "cannot record a join token as used; join refused");
                    (
                        host.clone(),
                        Status::unavailable("the coordinator cannot record the token as used; try again later"),
                    )
                }
            })?;
        Ok(JoinResponse {
            certificate_chain_pem: issued.chain_pem,
            ca_bundle_pem: ca_bundle(&self.state).map_err(|s| (host.clone(), s))?,
            host_id: record.host_id,
            labels: record.labels,
            not_after_unix: issued.not_after,
        })
    }
}

/// The `JoinTokens` service: administrators only.
#[derive(Debug, Clone)]
pub struct JoinTokensService {
    pub(crate) state: Arc<State>,
}

#[tonic::async_trait]
impl JoinTokens for JoinTokensService {
    async fn create_join_token(
        &self,
        req: Request<CreateJoinTokenRequest>,
    ) -> Result<Response<CreateJoinTokenResponse>, Status> {
        let client = Caller::client(&req).unwrap_or_default();
        let admin = Caller::admin(&req, &self.state.config.admins);
        let body = req.into_inner();
        let result = admin.and_then(|admin| {
            self.state.audit.writable().map_err(Status::unavailable)?;
            self.inner_create(&admin, &body)
        });
        let (outcome, message, expires) = match &result {
            Ok((_, record)) => ("granted", String::new(), Some(record.expires_unix)),
            Err(status) => ("refused", status.message().to_string(), None),
        };
        self.state.audit.event(
            "join_token",
            json!({"outcome": outcome, "client": client, "host": body.host_id,
                   "labels": body.labels, "expires_unix": expires, "message": message}),
        );
        let (token, record) = result?;
        tracing::info!(host = %record.host_id, by = %client, "join token created");
        Ok(Response::new(CreateJoinTokenResponse {
            token,
            expires_unix: record.expires_unix,
            ca_pin: enrollment(&self.state)?.pin.clone(),
            id: record.id().to_string(),
        }))
    }

    async fn list_join_tokens(
        &self,
        req: Request<ListJoinTokensRequest>,
    ) -> Result<Response<ListJoinTokensResponse>, Status> {
        let admin = Caller::admin(&req, &self.state.config.admins)?;
        let enrollment = enrollment(&self.state)?;
        let now = toolsrv_tls::unix_now();
        let mut tokens: Vec<JoinTokenInfo> = enrollment
            .tokens
            .list()
            .iter()
            .map(|r| token_info(r, now))
            .collect();
        // Through any replica, the tokens every replica keeps.
        if let Some(replicas) = &self.state.replicas
            && !crate::replicas::is_relayed(&req)
        {
            tokens.extend(replicas.remote_tokens(&admin).await);
            tokens.sort_by_key(|t| t.created_unix);
        }
        Ok(Response::new(ListJoinTokensResponse { tokens }))
    }

    async fn revoke_join_token(
        &self,
        req: Request<RevokeJoinTokenRequest>,
    ) -> Result<Response<RevokeJoinTokenResponse>, Status> {
        let client = Caller::client(&req).unwrap_or_default();
        let admin = Caller::admin(&req, &self.state.config.admins);
        let relayed = crate::replicas::is_relayed(&req);
        let id = req.into_inner().id;
        // A token another replica keeps is revoked there (and audited there).
        if let (Ok(admin), Some(replicas)) = (&admin, &self.state.replicas)
            && !relayed
            && self
                .state
                .enrollment
                .as_ref()
                .is_some_and(|e| !e.tokens.knows(&id))
            && let Some(answer) = replicas
                .revoke_token_elsewhere(admin, &RevokeJoinTokenRequest { id: id.clone() })
                .await
        {
            return answer.map(Response::new);
        }
        let result = admin.and_then(|admin| {
            let now = toolsrv_tls::unix_now();
            let enrollment = enrollment(&self.state)?;
            enrollment
                .tokens
                .revoke(&id, &admin, now)
                .map(|r| token_info(&r, now))
                .map_err(|e| match e {
                    RevokeError::NotFound(m) => Status::not_found(m),
                    RevokeError::NotUsable(r) => Status::failed_precondition(format!(
                        "join token {} (host `{}`) is {} already: nothing to revoke",
                        r.id(),
                        r.host_id,
                        r.state(now)
                    )),
                    RevokeError::Store(m) => {
                        tracing::error!(error = %m, "cannot record a join token's revocation");
                        Status::unavailable(
                            "the coordinator cannot record the revocation (see its log); the \
                             token is unchanged",
                        )
                    }
                })
        });
        let (outcome, message, host) = match &result {
            Ok(t) => ("granted", String::new(), t.host_id.clone()),
            Err(s) => ("refused", s.message().to_string(), String::new()),
        };
        self.state.audit.event(
            "join_token_revoked",
            json!({"outcome": outcome, "client": client, "id": id, "host": host, "message": message}),
        );
        let token = result?;
        tracing::info!(id = %token.id, host = %token.host_id, by = %client, "join token revoked");
        Ok(Response::new(RevokeJoinTokenResponse {
            token: Some(token),
        }))
    }
}

/// A kept token as the API shows it.
fn token_info(r: &TokenRecord, now: i64) -> JoinTokenInfo {
    JoinTokenInfo {
        id: r.id().to_string(),
        host_id: r.host_id.clone(),
        labels: r.labels.clone().into_iter().collect(),
        created_by: r.created_by.clone(),
        created_unix: r.created_unix,
        expires_unix: r.expires_unix,
        used_unix: r.used_unix.unwrap_or(0),
        revoked_unix: r.revoked_unix.unwrap_or(0),
        revoked_by: r.revoked_by.clone().unwrap_or_default(),
        state: r.state(now).to_string(),
    }
}

impl JoinTokensService {
    fn inner_create(
        &self,
        admin: &str,
        req: &CreateJoinTokenRequest,
    ) -> Result<(String, TokenRecord), Status> {
        let enrollment = enrollment(&self.state)?;
        let host = toolsrv_tls::Identity::agent(&req.host_id)
            .map_err(|e| Status::invalid_argument(format!("--host-id: {e}")))?;
        let host_id = host.name().unwrap_or_default().to_string();
        let ttl = match req.ttl_seconds {
            0 => DEFAULT_TOKEN_TTL,
            secs => Duration::from_secs(secs),
        };
        if ttl > MAX_TOKEN_TTL {
            return Err(Status::invalid_argument(format!(
                "--ttl of {} s is over the longest a token may live, {} days",
                ttl.as_secs(),
                MAX_TOKEN_TTL.as_secs() / 86_400
            )));
        }
        if req.labels.len() > toolsrv_tls::enroll::MAX_CERT_LABELS {
            return Err(Status::invalid_argument(format!(
                "{} labels, over the limit of {}",
                req.labels.len(),
                toolsrv_tls::enroll::MAX_CERT_LABELS
            )));
        }
        for (k, v) in &req.labels {
            check_label(k, v).map_err(|e| Status::invalid_argument(format!("--label: {e}")))?;
        }
        let token = new_token().map_err(|e| Status::internal(e.to_string()))?;
        let now = toolsrv_tls::unix_now();
        let record = TokenRecord {
            sha256: toolsrv_tls::enroll::token_digest(&token),
            host_id,
            labels: req.labels.clone(),
            created_by: admin.to_string(),
            created_unix: now,
            expires_unix: now.saturating_add(i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX)),
            used_unix: None,
            revoked_unix: None,
            revoked_by: None,
        };
        enrollment.tokens.add(record.clone(), now).map_err(|e| {
            tracing::error!(error = %e, "cannot keep a join token");
            Status::unavailable(
                "the coordinator cannot keep the token (see its log); try again later",
            )
        })?;
        Ok((token, record))
    }
}

/// The `Renewal` service: agents, for their own host id.
#[derive(Debug, Clone)]
pub struct RenewalService {
    pub(crate) state: Arc<State>,
}

#[tonic::async_trait]
impl Renewal for RenewalService {
    async fn renew(&self, req: Request<RenewRequest>) -> Result<Response<RenewResponse>, Status> {
        let caller = Caller::of(req.extensions(), toolsrv_tls::Role::Agent)?.clone();
        let body = req.into_inner();
        if let Some(enrollment) = &self.state.enrollment {
            let now = tokio::time::Instant::now();
            if let throttle::Admit::No {
                retry_after,
                record,
            } = enrollment.renewals.admit(&caller.name, now)
            {
                if record {
                    tracing::warn!(host = %caller.name, "renewals refused unexamined: the agent asked for more than its certificate's lifetime calls for; only the first is recorded");
                }
                return Err(throttled(
                    &self.state,
                    "renewal",
                    format!("too many renewals from `{}`", caller.name),
                    retry_after,
                    record.then(|| {
                        json!({"host": caller.name, "asked_host": body.host_id, "labels": caller.labels})
                    }),
                ));
            }
            enrollment.renewals.count(caller.name.clone(), now);
        }
        let result = self.inner_renew(&caller, &body);
        let (outcome, message) = match &result {
            Ok(_) => ("granted", String::new()),
            Err(status) => ("refused", status.message().to_string()),
        };
        self.state.audit.event(
            "renewal",
            json!({"outcome": outcome, "host": caller.name, "asked_host": body.host_id,
                   "labels": caller.labels, "message": message}),
        );
        match &result {
            Ok(r) => {
                tracing::info!(host = %caller.name, not_after = r.not_after_unix, "agent certificate renewed")
            }
            Err(s) => tracing::info!(host = %caller.name,
                reason = %printable_line(s.message(), 1024), "renewal refused"),
        }
        result.map(Response::new)
    }
}

impl RenewalService {
    fn inner_renew(&self, caller: &Caller, req: &RenewRequest) -> Result<RenewResponse, Status> {
        let enrollment = enrollment(&self.state)?;
        if !req.host_id.is_empty() && toolsrv_tls::normalize_name(&req.host_id) != caller.name {
            return Err(Status::permission_denied(format!(
                "a renewal for host `{}` over the connection of `{}` is refused: an agent renews \
                 only its own certificate",
                req.host_id, caller.name
            )));
        }
        let issued = enrollment.signer.issue_agent(
            &req.csr_der,
            &caller.name,
            &caller.labels,
            enrollment.ttl,
        )?;
        Ok(RenewResponse {
            certificate_chain_pem: issued.chain_pem,
            ca_bundle_pem: ca_bundle(&self.state)?,
            not_after_unix: issued.not_after,
        })
    }
}
