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
//!
//! What a request's answer holds is bounded too. Each chunk of response data is taken from its
//! asker's budget of answer bytes (`--max-buffered-bytes-per-identity`) when the handler gives it,
//! and given back only once it has left: hyper queues a chunk whole in HTTP/2's send buffer when
//! the stream has a byte of window, and asks for the next at once, so a peer that opens its
//! window one byte at a time (or not at all) and reads nothing would pin every answer there
//! (1,000 `GetSession`s of a 1.25 MB session held 1.3 GB). The last byte of each chunk is
//! handed to hyper on its own: hyper sends it only once the stream has window again, which is
//! once the rest of the chunk has left the stream's queue, and asks for what follows only then.
//! Left the stream's queue is not yet written: HTTP/2 keeps up to 400 KiB a stream for a peer
//! whose socket takes nothing (a peer that opens the largest windows and stops reading; 1,024
//! answers of 400 KB held 410 MB on one connection). So the chunk's charge, and at the answer's
//! end its request's place, then wait in the connection's [`toolsrv_tls::Unsent`] until the
//! connection has written the data handed by then. A request keeps its place and its bytes until
//! its answer has left, not merely until it was queued. Each chunk is charged
//! [`CHUNK_OVERHEAD`] bytes besides its data, what HTTP/2 and this layer keep for it, so that an
//! answer of many small messages is held to the budget as well. A chunk past the budget is
//! dropped, and the answer ends with `RESOURCE_EXHAUSTED` in its trailers.
//!
//! The same budget holds the messages of requests still arriving: the server decodes a message
//! only once it has all of it, so each message's bytes are taken from the budget as they come
//! and given back once it is whole; a request whose message would pass the budget ends with
//! `RESOURCE_EXHAUSTED`.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

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

/// Bytes of answers one certificate identity may have waiting to leave at once by default.
pub const DEFAULT_MAX_BUFFERED_BYTES_PER_IDENTITY: usize = 256 << 20;

/// The least `--max-buffered-bytes-per-identity` may be (0 aside): a chunk of response data holds
/// one message of up to the message size limit (16 MiB) and what came before it in the encoder's
/// buffer, and a chunk above the whole budget could never be sent.
pub const MIN_BUFFERED_BYTES: usize = 32 << 20;

/// Bytes each chunk of an answer is charged besides its data while it waits to leave: about what
/// HTTP/2 keeps for a queued frame and this layer for its charge. Without it, an answer of tiny
/// messages unread would hold many times its budget in bookkeeping.
pub const CHUNK_OVERHEAD: usize = 512;

/// Bytes of answers waiting to leave at once for one address without a certificate: their
/// answers are a CA bundle and a certificate.
pub const MAX_ANONYMOUS_BUFFERED_BYTES: usize = MIN_BUFFERED_BYTES;

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

/// Called with the first refusal of each run: who, the method asked for, the refusal, and what
/// happens until the run ends.
pub type OnRun = Arc<dyn Fn(&str, &str, &Status, &str) + Send + Sync>;

/// One request's place among its asker's open requests, given back when dropped.
type Place = Slot<Asker>;

/// Bytes of an answer taken from its asker's budget, given back when dropped.
type Charge = Slot<Asker>;

/// The limits and counts; cloned into every connection's service.
#[derive(Clone)]
pub struct StreamLimits {
    per_identity: usize,
    anonymous_per_address: usize,
    buffered_bytes_per_identity: usize,
    /// Requests open per asker, shared by every connection.
    open: OpenCounts<Asker>,
    /// Bytes of answers waiting to leave and of request messages arriving, per asker.
    held: OpenCounts<Asker>,
    refused: Counter,
    answers_refused: Counter,
    /// The audit record of a run's first refusal.
    on_run: OnRun,
}

impl std::fmt::Debug for StreamLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamLimits")
            .field("per_identity", &self.per_identity)
            .field("anonymous_per_address", &self.anonymous_per_address)
            .field(
                "buffered_bytes_per_identity",
                &self.buffered_bytes_per_identity,
            )
            .finish_non_exhaustive()
    }
}

impl StreamLimits {
    /// `per_identity` requests and `buffered_bytes_per_identity` bytes of answers (0: no limit)
    /// for peers with a certificate. `refused` counts refused requests, `answers_refused`
    /// answers cut short; `on_run` is called with the first refusal of each run (until the peer
    /// has none open, or no answer bytes waiting).
    pub fn new(
        per_identity: usize,
        buffered_bytes_per_identity: usize,
        refused: Counter,
        answers_refused: Counter,
        on_run: OnRun,
    ) -> Self {
        Self {
            per_identity,
            anonymous_per_address: MAX_ANONYMOUS_PER_ADDRESS,
            buffered_bytes_per_identity,
            open: OpenCounts::default(),
            held: OpenCounts::default(),
            refused,
            answers_refused,
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
            (self.on_run)(
                &asker.audited(),
                rpc,
                &status,
                "until fewer are open, its requests are refused without a record each",
            );
        }
        Err(status)
    }

    /// The budget of buffered bytes `asker` has, 0 for none.
    fn budget(&self, asker: &Asker) -> usize {
        match asker {
            Asker::Identity(_) => self.buffered_bytes_per_identity,
            Asker::Address(_) => MAX_ANONYMOUS_BUFFERED_BYTES,
        }
    }

    /// Takes `bytes` more of what `asker`'s request to `rpc` holds (part of its answer, or of
    /// a message of its request still arriving: `arriving`) from its budget into `charge`, or
    /// says why not.
    fn charge(
        &self,
        asker: &Asker,
        rpc: &str,
        bytes: usize,
        arriving: bool,
        charge: &mut Option<Charge>,
    ) -> Result<(), Status> {
        let limit = self.budget(asker);
        if limit == 0 {
            return Ok(());
        }
        let weight = if arriving {
            bytes
        } else {
            bytes + CHUNK_OVERHEAD
        };
        let taken = match charge {
            Some(charge) => charge.grow(weight, limit),
            None => self
                .held
                .admit_weighing(asker.clone(), weight, limit)
                .map(|taken| *charge = Some(taken)),
        };
        let Err(full) = taken else { return Ok(()) };
        self.answers_refused.inc();
        let this = if arriving {
            "this request's message, still arriving,"
        } else {
            "this answer's"
        };
        let status = Status::resource_exhausted(format!(
            "{asker} has {} of answers this coordinator cannot send until it reads them and of \
             requests still arriving, and {this} {} would pass the most it may hold ({}): read \
             the answers of its other requests, finish sending them, or make fewer at once",
            mib(full.held),
            mib(bytes),
            mib(limit)
        ));
        if full.first {
            tracing::warn!(asker = %asker, held = full.held, bytes, limit, rpc, arriving, "answers waiting to be read and requests still arriving hold too many bytes: new ones are cut short until some leave (--max-buffered-bytes-per-identity)");
            (self.on_run)(
                &asker.audited(),
                rpc,
                &status,
                "until its waiting answers are read and its requests sent, what passes the budget \
                 is cut short without a record each",
            );
        }
        Err(status)
    }
}

/// `bytes` for a person: MiB with one decimal, or bytes below 1 MiB.
fn mib(bytes: usize) -> String {
    if bytes < 1 << 20 {
        format!("{bytes} bytes")
    } else {
        format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
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
    S: Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
    B: HttpBody<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<tonic::codegen::StdError>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let info = req.extensions().get::<toolsrv_tls::ConnInfo>();
        let unsent = info.map(|info| info.unsent.clone());
        match self.limits.admit(info, req.uri().path()) {
            Ok(None) => Box::pin(self.inner.call(req.map(Body::new))),
            Ok(Some(place)) => {
                let rpc: Arc<str> = Arc::from(req.uri().path());
                let (limits, asker) = (self.limits.clone(), place.key().clone());
                let fut = self.inner.call(req.map(|body| {
                    Body::new(Arriving {
                        body: Box::pin(body),
                        limits,
                        asker,
                        rpc: rpc.clone(),
                        prefix: 0,
                        length: [0; 4],
                        rest: 0,
                        current: 0,
                        charge: None,
                    })
                }));
                let limits = self.limits.clone();
                // Held by the future until the response comes, then by its body until it ends.
                Box::pin(async move {
                    let response = fut.await?;
                    Ok(response.map(|body| {
                        Body::new(Counted {
                            body,
                            place: Some(place),
                            unsent,
                            limits,
                            rpc,
                            last: None,
                            charge: None,
                            ended: false,
                        })
                    }))
                })
            }
            Err(status) => Box::pin(async move { Ok(status.into_http()) }),
        }
    }
}

/// A request body that holds the bytes of the message arriving (from its gRPC prefix to its
/// last byte) in its asker's budget until the message is whole: the server decodes a message
/// only once it has all of it, and a peer that announces messages of 16 MiB and never sends
/// their last byte would otherwise hold 16 MiB a request (1,024 requests: 16 GiB).
struct Arriving<B> {
    body: Pin<Box<B>>,
    limits: StreamLimits,
    asker: Asker,
    rpc: Arc<str>,
    /// Bytes of the arriving message's 5-byte prefix read so far, and its length bytes.
    prefix: usize,
    length: [u8; 4],
    /// Bytes of the message's payload still to come, once its prefix is read.
    rest: u64,
    /// Bytes of the arriving message read so far, its prefix included.
    current: usize,
    /// What those bytes took from the budget.
    charge: Option<Charge>,
}

/// The bytes of a gRPC message prefix: a flag byte, then the message's length in 4 bytes.
const PREFIX_BYTES: usize = 5;

impl<B> Arriving<B> {
    /// Follows the messages through `data`: the bytes of a message that is not whole at its end
    /// are charged, and a message made whole gives its charges back.
    fn follow(&mut self, data: &[u8]) -> Result<(), Status> {
        let mut at = 0;
        while at < data.len() {
            if self.prefix < PREFIX_BYTES {
                if self.prefix >= 1 {
                    self.length[self.prefix - 1] = data[at];
                }
                self.prefix += 1;
                self.current += 1;
                at += 1;
                if self.prefix == PREFIX_BYTES {
                    self.rest = u64::from(u32::from_be_bytes(self.length));
                }
            } else {
                let take = usize::try_from(self.rest)
                    .unwrap_or(usize::MAX)
                    .min(data.len() - at);
                self.rest -= take as u64;
                self.current += take;
                at += take;
            }
            if self.prefix == PREFIX_BYTES && self.rest == 0 {
                // Whole: the decoder takes it from here.
                self.prefix = 0;
                self.current = 0;
                self.charge = None;
            }
        }
        let charged = self.charge.as_ref().map_or(0, Charge::weight);
        if self.current > charged {
            let more = self.current - charged;
            self.limits
                .charge(&self.asker, &self.rpc, more, true, &mut self.charge)?;
        }
        Ok(())
    }
}

impl<B> HttpBody for Arriving<B>
where
    B: HttpBody<Data = bytes::Bytes>,
    B::Error: Into<tonic::codegen::StdError>,
{
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let frame = match ready!(this.body.as_mut().poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(e)) => return Poll::Ready(Some(Err(Status::from_error(e.into())))),
            None => {
                this.charge = None;
                return Poll::Ready(None);
            }
        };
        if let Some(data) = frame.data_ref()
            && let Err(status) = this.follow(data)
        {
            this.charge = None;
            return Poll::Ready(Some(Err(status)));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A response body that keeps its request's [`Place`] until its answer has left or it is
/// dropped, and each chunk's bytes in its asker's budget until the chunk has left (see the
/// module's documentation).
struct Counted {
    body: Body,
    /// Taken when dropped, to wait in `unsent` with the last chunk's charge.
    place: Option<Place>,
    /// The connection's data not yet written: what this body holds for data it handed waits
    /// there until that data has left.
    unsent: Option<toolsrv_tls::Unsent>,
    limits: StreamLimits,
    /// The method, for the record of a refusal.
    rpc: Arc<str>,
    /// The last byte of the chunk being handed out, kept back until hyper asks again.
    last: Option<bytes::Bytes>,
    /// The bytes of the chunk being handed out, taken from the budget.
    charge: Option<Charge>,
    /// The answer was cut short: nothing follows.
    ended: bool,
}

impl Counted {
    /// `data` goes to hyper: its bytes are counted among the connection's data not yet written.
    fn hand(&self, data: &bytes::Bytes) {
        if let Some(unsent) = &self.unsent {
            unsent.handed(data.len());
        }
    }

    /// Keeps `held` until the data handed so far has been written (or at once without a
    /// connection to wait on).
    fn keep(&self, held: Slot<Asker>) {
        if let Some(unsent) = &self.unsent {
            unsent.hold(held);
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        // The answer's last bytes, and its request's place, wait until they have left.
        if let Some(charge) = self.charge.take() {
            self.keep(charge);
        }
        if let Some(place) = self.place.take() {
            self.keep(place);
        }
    }
}

impl HttpBody for Counted {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if let Some(last) = this.last.take() {
            this.hand(&last);
            return Poll::Ready(Some(Ok(Frame::data(last))));
        }
        // Asked again after a chunk's last byte: hyper took that byte, so the chunk is in
        // HTTP/2's hands, free to be sent; its bytes stay charged until they are written.
        if let Some(charge) = this.charge.take() {
            this.keep(charge);
        }
        if this.ended {
            return Poll::Ready(None);
        }
        let frame = match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            other => return Poll::Ready(other),
        };
        let mut data = match frame.into_data() {
            Ok(data) if data.len() > 1 => data,
            Ok(data) => {
                this.hand(&data);
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            Err(frame) => return Poll::Ready(Some(Ok(frame))),
        };
        let Some(place) = &this.place else {
            return Poll::Ready(None);
        };
        if let Err(status) =
            this.limits
                .charge(place.key(), &this.rpc, data.len(), false, &mut this.charge)
        {
            // What the handler had ready goes now, not when the peer reads.
            this.body = Body::empty();
            this.ended = true;
            let mut trailers = http::HeaderMap::new();
            return Poll::Ready(Some(match status.add_header(&mut trailers) {
                Ok(()) => Ok(Frame::trailers(trailers)),
                Err(status) => Err(status),
            }));
        }
        this.last = Some(data.split_off(data.len() - 1));
        this.hand(&data);
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.last.is_none() && (self.ended || self.body.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        if self.last.is_some() || self.ended {
            SizeHint::default()
        } else {
            self.body.size_hint()
        }
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
            unsent: toolsrv_tls::Unsent::default(),
        }
    }

    #[test]
    fn counted_per_identity_or_address_and_given_back() {
        let refused = Counter::default();
        let runs: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let seen = runs.clone();
        let limits = StreamLimits::new(
            2,
            0,
            refused.clone(),
            Counter::default(),
            Arc::new(move |peer: &str, rpc: &str, _: &Status, _: &str| {
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

    /// A body of `chunks` then trailers saying OK, as tonic's encoder would give.
    fn answer(chunks: &[usize]) -> Body {
        let mut frames: Vec<Result<Frame<bytes::Bytes>, Status>> = chunks
            .iter()
            .map(|&n| Ok(Frame::data(bytes::Bytes::from(vec![7u8; n]))))
            .collect();
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        frames.push(Ok(Frame::trailers(trailers)));
        Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)))
    }

    /// `body` as the answer of client `who`'s request.
    fn counted(limits: &StreamLimits, who: &str, body: Body) -> Counted {
        let who = info(Some(Identity::Client(who.into())), "192.0.2.1:1");
        counted_from(limits, &who, body)
    }

    /// `body` as the answer of a request on a connection of `peer`'s.
    fn counted_from(limits: &StreamLimits, peer: &toolsrv_tls::ConnInfo, body: Body) -> Counted {
        let place = limits.admit(Some(peer), "/t/M").unwrap().unwrap();
        Counted {
            body,
            place: Some(place),
            unsent: None,
            limits: limits.clone(),
            rpc: "/t/M".into(),
            last: None,
            charge: None,
            ended: false,
        }
    }

    fn next(body: &mut Counted) -> Option<Frame<bytes::Bytes>> {
        let waker = std::task::Waker::noop();
        match Pin::new(body).poll_frame(&mut Context::from_waker(waker)) {
            Poll::Ready(frame) => frame.map(|f| f.unwrap()),
            Poll::Pending => panic!("the test body is always ready"),
        }
    }

    fn data_len(frame: Option<Frame<bytes::Bytes>>) -> usize {
        frame.unwrap().into_data().unwrap().len()
    }

    /// Each chunk leaves in two, its last byte on its own, and its bytes stay in the asker's
    /// budget until hyper asks for what follows that byte (by then the chunk has left).
    #[test]
    fn a_chunk_s_bytes_are_held_until_its_last_byte_is_taken() {
        const O: usize = CHUNK_OVERHEAD;
        let limits = quiet_limits(0, 2 * O + 100);
        let alice = Asker::Identity(Identity::Client("alice".into()));
        let mut body = counted(&limits, "alice", answer(&[60, 1, 30]));
        assert_eq!(data_len(next(&mut body)), 59);
        assert!(!body.is_end_stream());
        assert_eq!(held(&limits, &alice), 60 + O, "taken when the chunk came");
        assert_eq!(data_len(next(&mut body)), 1);
        assert_eq!(
            held(&limits, &alice),
            60 + O,
            "its last byte has not left yet"
        );
        // A chunk of one byte goes as it is, with nothing taken.
        assert_eq!(data_len(next(&mut body)), 1);
        assert_eq!(held(&limits, &alice), 0, "the first chunk has left");
        assert_eq!(data_len(next(&mut body)), 29);
        assert_eq!(held(&limits, &alice), 30 + O);
        assert_eq!(data_len(next(&mut body)), 1);
        assert!(next(&mut body).unwrap().is_trailers());
        assert_eq!(held(&limits, &alice), 0);
        assert!(next(&mut body).is_none());
        drop(body);
        assert!(limits.open.is_empty() && limits.held.is_empty());
    }

    /// On a connection, a chunk's bytes and its request's place stay held after hyper took
    /// them, until the connection has written the data handed by then: a peer that opens large
    /// windows and stops reading its socket leaves answers queued in HTTP/2's buffers, which the
    /// budget and the request limit still see.
    #[test]
    fn what_an_answer_holds_waits_until_the_connection_has_written_it() {
        const O: usize = CHUNK_OVERHEAD;
        let limits = quiet_limits(5, 2 * O + 100);
        let alice = Asker::Identity(Identity::Client("alice".into()));
        let unsent = toolsrv_tls::Unsent::default();
        let mut body = counted(&limits, "alice", answer(&[60, 30]));
        body.unsent = Some(unsent.clone());
        assert_eq!(data_len(next(&mut body)), 59);
        assert_eq!(data_len(next(&mut body)), 1);
        assert_eq!(data_len(next(&mut body)), 29);
        assert_eq!(
            held(&limits, &alice),
            90 + 2 * O,
            "the first chunk is taken, not written"
        );
        unsent.written(59);
        assert_eq!(
            held(&limits, &alice),
            90 + 2 * O,
            "one byte of it is not written yet"
        );
        unsent.written(1);
        assert_eq!(held(&limits, &alice), 30 + O);
        assert_eq!(data_len(next(&mut body)), 1);
        assert!(next(&mut body).unwrap().is_trailers());
        drop(body);
        // The answer ended: its last chunk and its place wait for its last 30 bytes.
        assert_eq!(held(&limits, &alice), 30 + O);
        assert_eq!(unsent.held(), 2);
        assert!(!limits.open.is_empty(), "its place is still taken");
        unsent.written(30);
        assert!(limits.open.is_empty() && limits.held.is_empty());
    }

    /// An answer of many small chunks unread is held to the budget by what keeping each chunk
    /// costs, not by its data alone: 20 chunks of 10 bytes against a budget of ten chunks.
    #[test]
    fn small_chunks_are_charged_what_keeping_them_costs() {
        // Ten chunks of 10 bytes, at 512 bytes each of keeping (CHUNK_OVERHEAD).
        let budget = 10 * (512 + 10);
        let limits = quiet_limits(0, budget);
        let unsent = toolsrv_tls::Unsent::default();
        let mut body = counted(&limits, "alice", answer(&[10; 20]));
        body.unsent = Some(unsent.clone());
        let mut data = 0;
        let trailers = loop {
            let frame = next(&mut body).unwrap();
            match frame.into_data() {
                Ok(_) => data += 1,
                Err(frame) => break frame.into_trailers().unwrap(),
            }
        };
        assert_eq!(data, 20, "ten chunks, each in two");
        assert_eq!(trailers["grpc-status"], "8", "{trailers:?}");
        drop(body);
        unsent.written(100);
        assert!(limits.held.is_empty());
    }

    /// A chunk past the asker's budget is dropped and its answer ends with RESOURCE_EXHAUSTED
    /// in the trailers; the first of a run is recorded, others' answers are not touched, and
    /// once the asker's chunks have left its answers go again.
    #[test]
    fn an_answer_past_the_budget_is_cut_short_and_others_go_on() {
        let cut = Counter::default();
        let runs: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let seen = runs.clone();
        const O: usize = CHUNK_OVERHEAD;
        let limits = StreamLimits::new(
            0,
            100 + O,
            Counter::default(),
            cut.clone(),
            Arc::new(move |peer: &str, _: &str, why: &Status, until: &str| {
                seen.lock()
                    .unwrap()
                    .push((peer.into(), format!("{} {until}", why.message())));
            }),
        );
        let mut first = counted(&limits, "alice", answer(&[80]));
        assert_eq!(data_len(next(&mut first)), 79);
        let mut second = counted(&limits, "alice", answer(&[30, 5]));
        let trailers = next(&mut second).unwrap().into_trailers().unwrap();
        assert_eq!(trailers["grpc-status"], "8", "{trailers:?}");
        let message = trailers["grpc-message"].to_str().unwrap();
        // Percent-encoded, as gRPC carries it.
        assert!(
            message.starts_with(&format!(
                "client/alice%20has%20{}%20bytes%20of%20answers",
                80 + O
            )),
            "{message}"
        );
        assert!(second.is_end_stream());
        assert!(next(&mut second).is_none(), "nothing after the refusal");
        // Bob has a budget of his own.
        let mut bob = counted(&limits, "bob", answer(&[90]));
        assert_eq!(data_len(next(&mut bob)), 89);
        // A third refusal of alice's run is counted, not recorded.
        let mut third = counted(&limits, "alice", answer(&[30]));
        assert!(next(&mut third).unwrap().is_trailers());
        assert_eq!(cut.get(), 2);
        assert_eq!(runs.lock().unwrap().len(), 1, "{runs:?}");
        assert!(runs.lock().unwrap()[0].1.contains("cut short"), "{runs:?}");
        // Alice's first answer leaves; her next goes whole.
        assert_eq!(data_len(next(&mut first)), 1);
        assert!(next(&mut first).unwrap().is_trailers());
        let mut fourth = counted(&limits, "alice", answer(&[30]));
        assert_eq!(data_len(next(&mut fourth)), 29);
        // A body dropped before its chunk left gives its bytes back.
        drop((first, second, third, fourth, bob));
        assert!(limits.held.is_empty() && limits.open.is_empty());
    }

    /// A peer without a certificate has a budget of its own per address, whatever the flag.
    #[test]
    fn an_address_without_a_certificate_has_its_own_budget() {
        let limits = quiet_limits(0, 0);
        let mut body = counted_from(
            &limits,
            &info(None, "192.0.2.7:1"),
            answer(&[MAX_ANONYMOUS_BUFFERED_BYTES + 1]),
        );
        let trailers = next(&mut body).unwrap().into_trailers().unwrap();
        assert_eq!(trailers["grpc-status"], "8", "{trailers:?}");
        // Alice, with no limit, is not held to it.
        let mut alice = counted(
            &limits,
            "alice",
            answer(&[MAX_ANONYMOUS_BUFFERED_BYTES + 1]),
        );
        assert_eq!(data_len(next(&mut alice)), MAX_ANONYMOUS_BUFFERED_BYTES);
    }

    /// A request body of `chunks`, as the server reads it.
    fn arriving(limits: &StreamLimits, chunks: Vec<Vec<u8>>) -> Arriving<Body> {
        let frames: Vec<Result<Frame<bytes::Bytes>, Status>> = chunks
            .into_iter()
            .map(|c| Ok(Frame::data(bytes::Bytes::from(c))))
            .collect();
        Arriving {
            body: Box::pin(Body::new(http_body_util::StreamBody::new(
                tokio_stream::iter(frames),
            ))),
            limits: limits.clone(),
            asker: Asker::Identity(Identity::Client("alice".into())),
            rpc: "/t/M".into(),
            prefix: 0,
            length: [0; 4],
            rest: 0,
            current: 0,
            charge: None,
        }
    }

    fn read(body: &mut Arriving<Body>) -> Option<Result<usize, Status>> {
        let waker = std::task::Waker::noop();
        match Pin::new(body).poll_frame(&mut Context::from_waker(waker)) {
            Poll::Ready(frame) => frame.map(|f| f.map(|f| f.into_data().map_or(0, |d| d.len()))),
            Poll::Pending => panic!("the test body is always ready"),
        }
    }

    fn prefix(len: u32) -> Vec<u8> {
        toolsrv_testkit::grpc_prefix(len).to_vec()
    }

    /// The bytes of a message still arriving are held in the asker's budget until it is whole,
    /// its prefix split over chunks included; one that would pass the budget ends the request.
    #[test]
    fn a_request_s_message_is_held_until_it_is_whole() {
        let limits = quiet_limits(0, 100);
        let alice = Asker::Identity(Identity::Client("alice".into()));
        let mut first = prefix(50);
        first.extend([1; 20]);
        let mut third = vec![2; 20];
        // The next message's prefix, split.
        third.extend(&prefix(200)[..3]);
        let mut fourth = prefix(200)[3..].to_vec();
        fourth.extend([3; 88]);
        let mut body = arriving(
            &limits,
            vec![first, vec![1; 10], third, fourth, vec![3; 10]],
        );
        assert_eq!(read(&mut body).unwrap().unwrap(), 25);
        assert_eq!(held(&limits, &alice), 25);
        assert_eq!(read(&mut body).unwrap().unwrap(), 10);
        assert_eq!(held(&limits, &alice), 35);
        // The first message is whole; 3 bytes of the next's prefix are held.
        assert_eq!(read(&mut body).unwrap().unwrap(), 23);
        assert_eq!(held(&limits, &alice), 3);
        assert_eq!(read(&mut body).unwrap().unwrap(), 90);
        assert_eq!(held(&limits, &alice), 93);
        // 103 bytes of a message of 205 would pass 100.
        let refused = read(&mut body).unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(
            refused
                .message()
                .contains("this request's message, still arriving, 10 bytes would pass"),
            "{refused:?}"
        );
        assert!(limits.held.is_empty(), "given back with the refusal");
        drop(body);
        // A request whose body ends gives back what its last message held.
        let mut body = arriving(&limits, vec![prefix(40)]);
        assert_eq!(read(&mut body).unwrap().unwrap(), 5);
        assert_eq!(held(&limits, &alice), 5);
        assert!(read(&mut body).is_none());
        assert!(limits.held.is_empty());
    }

    /// `requests` and `bytes` as the limits, with nothing counting or recording refusals.
    fn quiet_limits(requests: usize, bytes: usize) -> StreamLimits {
        let no_run: OnRun = Arc::new(|_: &str, _: &str, _: &Status, _: &str| {});
        StreamLimits::new(
            requests,
            bytes,
            Counter::default(),
            Counter::default(),
            no_run,
        )
    }

    fn held(limits: &StreamLimits, asker: &Asker) -> usize {
        // Nothing held: anything admits the whole budget.
        match limits.held.admit_weighing(asker.clone(), usize::MAX, 1) {
            Err(full) => full.held,
            Ok(_) => unreachable!("a weight above the limit is refused"),
        }
    }
}
