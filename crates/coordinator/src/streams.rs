//! Requests (HTTP/2 streams) open at once per peer, on every service of the mTLS port.
//!
//! A stream costs the coordinator a few kilobytes from the moment its headers arrive: its HTTP/2
//! state and the handler waiting for the request's body. Nothing in HTTP/2 or tonic bounds how
//! many one connection opens, so a peer that sends headers and never a body (one connection
//! without a certificate, when enrollment is on, was enough: 20,000 streams took 120 MB) could
//! grow the process until it is killed. Each request is counted from its headers until its
//! response ends (or is dropped), per certificate identity, or per address (see
//! [`toolsrv_tls::address_key`]) for a peer without a certificate; past the limit it is refused
//! at once with `RESOURCE_EXHAUSTED` and its stream closed. Other replicas (the coordinator's
//! own identity) are not counted: every request they relay was counted for its client on the
//! replica it reached.
//!
//! The per-client quotas (calls, watches, finds) bound what a client keeps open on purpose, far
//! under these limits; this bounds what the quotas do not see.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};
use toolsrv_metrics::Counter;
use toolsrv_tls::counts::{OpenCounts, Slot};
use toolsrv_tls::{Identity, Role};

/// Requests open at once with one certificate identity by default.
pub const DEFAULT_MAX_PER_IDENTITY: usize = 1024;

/// Requests open at once from one address without a certificate: a joining host makes one or
/// two (its CA bundle, its join), and hosts behind one NAT join a few at a time.
pub const MAX_ANONYMOUS_PER_ADDRESS: usize = 64;

/// Who a request is counted for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Asker {
    Identity(Identity),
    Address(IpAddr),
}

impl std::fmt::Display for Asker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Asker::Identity(identity) => write!(f, "{identity}"),
            Asker::Address(ip) => write!(f, "{ip} (without a certificate)"),
        }
    }
}

impl Asker {
    /// Who it is in an audit record: a client's name, as in the records of its calls.
    fn audited(&self) -> String {
        match self {
            Asker::Identity(Identity::Client(name)) => name.clone(),
            other => other.to_string(),
        }
    }
}

/// Called with the first refusal of each run: who, the method asked for, the refusal.
pub type OnRun = Arc<dyn Fn(&str, &str, &Status) + Send + Sync>;

/// One request's place among its asker's open requests, given back when dropped.
type Place = Slot<Asker>;

/// The limits and counts; cloned into every connection's service.
#[derive(Clone)]
pub struct StreamLimits {
    per_identity: usize,
    anonymous_per_address: usize,
    /// Requests open per asker, shared by every connection.
    open: OpenCounts<Asker>,
    refused: Counter,
    /// The audit record of a run's first refusal.
    on_run: OnRun,
}

impl std::fmt::Debug for StreamLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamLimits")
            .field("per_identity", &self.per_identity)
            .field("anonymous_per_address", &self.anonymous_per_address)
            .finish_non_exhaustive()
    }
}

impl StreamLimits {
    /// `per_identity` 0: no limit for peers with a certificate. `refused` counts refusals;
    /// `on_run` is called with the first of each run (until the peer has none open).
    pub fn new(per_identity: usize, refused: Counter, on_run: OnRun) -> Self {
        Self {
            per_identity,
            anonymous_per_address: MAX_ANONYMOUS_PER_ADDRESS,
            open: OpenCounts::default(),
            refused,
            on_run,
        }
    }

    /// A place for one more request of `info`'s peer for method `rpc`, or why not. `None` for
    /// a request not counted (another replica's, or one without connection information).
    fn admit(
        &self,
        info: Option<&toolsrv_tls::ConnInfo>,
        rpc: &str,
    ) -> Result<Option<Place>, Status> {
        let Some(info) = info else { return Ok(None) };
        let (asker, limit) = match &info.peer {
            Some(peer) if peer.identity.role() == Role::Coordinator => return Ok(None),
            Some(peer) => (Asker::Identity(peer.identity.clone()), self.per_identity),
            None => (
                Asker::Address(toolsrv_tls::address_key(info.remote.ip())),
                self.anonymous_per_address,
            ),
        };
        let full = match self.open.admit(asker.clone(), limit) {
            Ok(place) => return Ok(Some(place)),
            Err(full) => full,
        };
        self.refused.inc();
        let status = Status::resource_exhausted(format!(
            "{asker} has {limit} requests open on this coordinator, the most it may: finish some \
             first"
        ));
        if full.first {
            tracing::warn!(asker = %asker, remote = %info.remote, limit, rpc, "too many requests open at once: new ones are refused until some end (--max-requests-per-identity)");
            (self.on_run)(&asker.audited(), rpc, &status);
        }
        Err(status)
    }
}

/// The layer for tonic's `Server::builder().layer(..)`.
#[derive(Debug, Clone)]
pub struct StreamLimitLayer(pub StreamLimits);

impl<S> tower::Layer<S> for StreamLimitLayer {
    type Service = StreamLimited<S>;

    fn layer(&self, inner: S) -> StreamLimited<S> {
        StreamLimited {
            inner,
            limits: self.0.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct StreamLimited<S> {
    inner: S,
    limits: StreamLimits,
}

impl<S, B> Service<http::Request<B>> for StreamLimited<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match self.limits.admit(
            req.extensions().get::<toolsrv_tls::ConnInfo>(),
            req.uri().path(),
        ) {
            Ok(None) => Box::pin(self.inner.call(req)),
            Ok(Some(place)) => {
                let fut = self.inner.call(req);
                // Held by the future until the response comes, then by its body until it ends.
                Box::pin(async move {
                    let response = fut.await?;
                    Ok(response.map(|body| {
                        Body::new(Counted {
                            body,
                            _place: place,
                        })
                    }))
                })
            }
            Err(status) => Box::pin(async move { Ok(status.into_http()) }),
        }
    }
}

/// A response body that keeps its request's [`Place`] until it ends or is dropped.
struct Counted {
    body: Body,
    _place: Place,
}

impl HttpBody for Counted {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::net::SocketAddr;
    use std::sync::Mutex;

    use super::*;

    fn info(identity: Option<Identity>, remote: &str) -> toolsrv_tls::ConnInfo {
        let remote: SocketAddr = remote.parse().unwrap();
        toolsrv_tls::ConnInfo {
            peer: identity.map(|identity| toolsrv_tls::PeerInfo {
                identity,
                remote,
                labels: Default::default(),
                not_after: None,
            }),
            remote,
        }
    }

    #[test]
    fn counted_per_identity_or_address_and_given_back() {
        let refused = Counter::default();
        let runs: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let seen = runs.clone();
        let limits = StreamLimits::new(
            2,
            refused.clone(),
            Arc::new(move |peer: &str, rpc: &str, _: &Status| {
                seen.lock().unwrap().push((peer.into(), rpc.into()));
            }),
        );
        let alice = info(Some(Identity::Client("alice".into())), "192.0.2.1:1");
        let bob = info(Some(Identity::Client("bob".into())), "192.0.2.1:2");
        let held: Vec<Place> = (0..2)
            .map(|_| limits.admit(Some(&alice), "/t/M").unwrap().unwrap())
            .collect();
        let err = limits.admit(Some(&alice), "/t/M").unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains("client/alice"), "{err:?}");
        assert!(
            limits.admit(Some(&bob), "/t/M").unwrap().is_some(),
            "another identity"
        );
        // Replicas are not counted.
        let replica = info(Some(Identity::Coordinator), "192.0.2.9:1");
        for _ in 0..10 {
            assert!(limits.admit(Some(&replica), "/t/M").unwrap().is_none());
        }
        // Without a certificate: per address (an IPv6 /64), at its own limit.
        let anonymous: Vec<Place> = (0..MAX_ANONYMOUS_PER_ADDRESS)
            .map(|i| {
                limits
                    .admit(Some(&info(None, &format!("[2001:db8::{i:x}]:1"))), "/t/M")
                    .unwrap()
                    .unwrap()
            })
            .collect();
        assert!(
            limits
                .admit(Some(&info(None, "[2001:db8::ff]:1")), "/t/M")
                .is_err()
        );
        assert!(
            limits
                .admit(Some(&info(None, "192.0.2.1:3")), "/t/M")
                .is_ok()
        );
        assert_eq!(refused.get(), 2);
        // Each run's first refusal is recorded: alice's (by her name), the /64's.
        assert_eq!(
            *runs.lock().unwrap(),
            [
                ("alice".to_string(), "/t/M".to_string()),
                (
                    "2001:db8:: (without a certificate)".to_string(),
                    "/t/M".to_string()
                )
            ]
        );
        drop((held, anonymous));
        assert!(limits.admit(Some(&alice), "/t/M").unwrap().is_some());
        assert!(limits.open.is_empty(), "every place given back");
    }
}
