//! Proves the caller's role once, in front of each service: a request reaches a handler only
//! if the peer's certificate carries the role that service serves, and the handler takes the
//! proven name from the request ([`Caller`]), never from a certificate or a message itself.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::server::NamedService;
use toolsrv_tls::Role;

use crate::revocation::Revocations;

/// Who called, as proven by the peer's certificate: put into every request's extensions by
/// [`RequireRole`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub role: Role,
    /// The host id (agents) or client name (clients).
    pub name: String,
    /// The labels the caller's certificate carries (bound at enrollment): trusted labels.
    pub labels: std::collections::BTreeMap<String, String>,
    /// When the certificate of the caller's connection expires (Unix seconds); `None` for a
    /// relayed client (the relaying replica's connection is not the client's).
    pub not_after: Option<i64>,
}

impl Caller {
    /// The caller of `extensions`, which must have role `role`. Only a service mounted without
    /// its [`RequireRole`] layer lacks one: a wiring bug, refused rather than trusted.
    pub fn of(extensions: &http::Extensions, role: Role) -> Result<&Caller, Status> {
        match extensions.get::<Caller>() {
            Some(caller) if caller.role == role => Ok(caller),
            _ => Err(Status::internal(
                "this service is served without its identity check; refusing the request",
            )),
        }
    }

    /// The client name of a client-API request.
    pub fn client<T>(req: &tonic::Request<T>) -> Result<String, Status> {
        Self::of(req.extensions(), Role::Client).map(|c| c.name.clone())
    }

    /// The client name of a client-API request, which must match one of `admins` (client-name
    /// globs, `--admin`): administration (join tokens, revocation) is refused to anyone else.
    pub fn admin<T>(req: &tonic::Request<T>, admins: &[String]) -> Result<String, Status> {
        let name = Self::client(req)?;
        Self::admin_name(&name, admins)?;
        Ok(name)
    }

    /// [`Caller::admin`] for a client name already taken from the request.
    pub fn admin_name(name: &str, admins: &[String]) -> Result<(), Status> {
        if admins.iter().any(|glob| crate::selector::glob(glob, name)) {
            Ok(())
        } else {
            Err(Status::permission_denied(format!(
                "client `{name}` is not an administrator of this coordinator: administrators are \
                 the clients matching --admin ({})",
                admins.join(", ")
            )))
        }
    }

    /// The host id of an agent-link request.
    pub fn agent<T>(req: &tonic::Request<T>) -> Result<String, Status> {
        Self::of(req.extensions(), Role::Agent).map(|c| c.name.clone())
    }
}

/// A service that only peers with certificates of `role` may use.
#[derive(Debug, Clone)]
pub struct RequireRole<S> {
    inner: S,
    /// `None`: any proven identity (services that need no particular role, such as health).
    role: Option<Role>,
    /// What the refusal says the service needs.
    needs: &'static str,
    /// Identities refused whatever their certificate (`toolctl revoke`).
    revocations: Option<Arc<Revocations>>,
    /// Client API with replicas: another replica (a coordinator certificate) may call on behalf
    /// of a client it named in `toolsrv-on-behalf-of` (see `replicas`).
    relays: bool,
}

impl<S> RequireRole<S> {
    /// Client API: `toolsrv://client/<name>` certificates only.
    pub fn clients(inner: S) -> Self {
        Self {
            inner,
            role: Some(Role::Client),
            needs: "the client API needs a client certificate (toolsrv://client/<name>)",
            revocations: None,
            relays: false,
        }
    }

    /// Agent link: `toolsrv://agent/<host-id>` certificates only.
    pub fn agents(inner: S) -> Self {
        Self {
            inner,
            role: Some(Role::Agent),
            needs: "the agent link needs an agent certificate (toolsrv://agent/<host-id>)",
            revocations: None,
            relays: false,
        }
    }

    /// Also refuses every request of a revoked identity, with PERMISSION_DENIED naming the
    /// revocation.
    pub(crate) fn refusing(mut self, revocations: Arc<Revocations>) -> Self {
        self.revocations = Some(revocations);
        self
    }

    /// Also serves other coordinator replicas relaying for a client (the client API with
    /// `--etcd`): the request names the client in `toolsrv-on-behalf-of`, checked like a
    /// certificate's name, and the revocations apply to that client.
    pub(crate) fn relayed_by_replicas(mut self, on: bool) -> Self {
        self.relays = on;
        self
    }

    /// Any peer with a verified certificate, whatever its role: for health and reflection on
    /// the mTLS port, which a peer without a certificate (a host joining) must not reach.
    pub fn authenticated(inner: S) -> Self {
        Self {
            inner,
            role: None,
            needs: "this service needs a verified certificate",
            revocations: None,
            relays: false,
        }
    }

    /// The caller `peer` proves to be, if it has this service's role. `on_behalf` is what a
    /// relaying replica says the client is.
    fn prove(
        &self,
        peer: Option<&toolsrv_tls::PeerInfo>,
        on_behalf: Option<&str>,
    ) -> Result<Caller, Status> {
        if let (true, Some(p), Some(client)) = (self.relays, peer, on_behalf)
            && p.identity.role() == Role::Coordinator
            && self.role == Some(Role::Client)
        {
            let identity = toolsrv_tls::Identity::client(client).map_err(|e| {
                Status::invalid_argument(format!("a relayed request's client name: {e}"))
            })?;
            if let Some(revocations) = &self.revocations {
                revocations.check(&identity)?;
            }
            return Ok(Caller {
                role: Role::Client,
                name: identity.name().unwrap_or_default().to_string(),
                labels: Default::default(),
                not_after: None,
            });
        }
        match peer {
            Some(p) if self.role.is_none_or(|role| p.identity.role() == role) => {
                // The handshake checked the certificate's dates, but an HTTP/2 connection
                // carries new requests for as long as the client keeps it open. (An agent's
                // link ends at expiry on its own, once its calls are done: see `agent_link`.)
                if p.identity.role() == Role::Client
                    && let Some(reason) = expired(p.not_after, toolsrv_tls::unix_now())
                {
                    tracing::info!(identity = %p.identity, remote = ?p.remote, "refused a request on a connection whose certificate expired");
                    return Err(Status::unauthenticated(reason));
                }
                if let Some(revocations) = &self.revocations {
                    revocations.check(&p.identity).inspect_err(|_| {
                        tracing::info!(identity = %p.identity, remote = ?p.remote, "refused a request of a revoked identity");
                    })?;
                }
                Ok(Caller {
                    role: p.identity.role(),
                    name: p.identity.name().unwrap_or_default().to_string(),
                    labels: p.labels.clone(),
                    not_after: p.not_after,
                })
            }
            Some(other) => Err(Status::permission_denied(format!(
                "{}; this one is {}",
                self.needs, other.identity
            ))),
            None => Err(Status::unauthenticated(
                "no verified certificate on this connection: only enrollment (joining with a \
                 token) is served without one",
            )),
        }
    }
}

impl<S: NamedService> NamedService for RequireRole<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for RequireRole<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let on_behalf = req
            .headers()
            .get(crate::replicas::ON_BEHALF_OF)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        match self.prove(toolsrv_tls::peer(req.extensions()), on_behalf.as_deref()) {
            Ok(caller) => {
                let not_after = caller.not_after.filter(|_| caller.role == Role::Client);
                req.extensions_mut().insert(caller);
                let fut = self.inner.call(req);
                match not_after {
                    // A stream (a watch, a call's output) ends when the certificate does.
                    Some(not_after) => Box::pin(async move {
                        let response = fut.await?;
                        Ok(response.map(|body| Body::new(UntilExpiry::new(body, not_after))))
                    }),
                    None => Box::pin(fut),
                }
            }
            Err(status) => Box::pin(async move { Ok(status.into_http()) }),
        }
    }
}

/// Why a request on a connection whose certificate is valid until `not_after` (Unix seconds)
/// is refused at `now`, if it is.
fn expired(not_after: Option<i64>, now: i64) -> Option<String> {
    let not_after = not_after?;
    (now >= not_after).then(|| {
        format!(
            "the client certificate of this connection expired at {} UTC ({} s ago): connect again \
             with a valid one",
            toolsrv_tls::enroll::utc(not_after),
            now - not_after
        )
    })
}

/// A client's response body that ends, with UNAUTHENTICATED in its trailers, when the
/// certificate of the client's connection expires: a watch or a call's output opened before
/// then does not outlive the certificate. Dropping the inner body ends the stream on the
/// coordinator's side as a client that went away would (a call's process is cancelled).
struct UntilExpiry {
    inner: Body,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    not_after: i64,
    ended: bool,
}

impl UntilExpiry {
    fn new(inner: Body, not_after: i64) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(toolsrv_tls::until_unix(not_after))),
            not_after,
            ended: false,
        }
    }
}

impl http_body::Body for UntilExpiry {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Status>>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            this.ended = true;
            // The inner body (the handler's stream) is dropped with this one.
            this.inner = Body::empty();
            let reason = expired(
                Some(this.not_after),
                toolsrv_tls::unix_now().max(this.not_after),
            )
            .unwrap_or_default();
            let mut trailers = http::HeaderMap::new();
            return Poll::Ready(Some(
                Status::unauthenticated(reason)
                    .add_header(&mut trailers)
                    .map(|()| http_body::Frame::trailers(trailers)),
            ));
        }
        let frame = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            this.ended = true;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::expired;

    #[test]
    fn a_certificate_counts_as_expired_from_its_not_after_on() {
        assert_eq!(expired(None, 1_000), None);
        assert_eq!(expired(Some(1_001), 1_000), None);
        let reason = expired(Some(1_000), 1_003).unwrap();
        assert!(
            reason.contains("1970-01-01 00:16:40 UTC (3 s ago)"),
            "{reason}"
        );
        assert!(expired(Some(1_000), 1_000).is_some());
    }
}
