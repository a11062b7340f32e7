//! Server side: accept TLS ourselves and hand tonic connections that carry
//! the peer's identity.
//!
//! tonic's `serve_with_incoming` calls [`Connected::connect_info`] on each
//! connection and inserts the result, as the type [`PeerInfo`] itself, into
//! every request's extensions; [`peer_of`] reads it back in a handler or
//! interceptor.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::Stream;
use tokio_util::sync::WaitForCancellationFutureOwned;
use tonic::transport::server::Connected;

use crate::conns::{Connections, Registration};
use crate::throttle::LogThrottle;
use crate::unsent::{Cursor, Received, Unsent};

/// Failed handshakes are logged once a second at most: anyone who reaches the port can fail
/// one at will (about a thousand a second from one script, 170 KB of log a second), and the
/// next line says how many went unlogged (`unlogged`).
static HANDSHAKE_FAILED: LogThrottle = LogThrottle::new(Duration::from_secs(1));
use crate::counts::{OpenCounts, Slot};
use crate::enroll::labels_of;
use crate::{Identity, identity_of};

/// A handshake that takes longer than this is abandoned, so a peer that
/// connects and says nothing only costs one small task for a while.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a peer has, after the TLS handshake, to send the HTTP/2 connection
/// preface; a connection that stays silent is closed instead of being held open.
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections from one address (see [`address_key`]) being set up at once by default
/// ([`AcceptOptions::max_setting_up_per_address`]): in their TLS handshake or waiting for their
/// HTTP/2 preface. More are closed as soon as they are accepted,
/// so that a peer opening connections faster than they time out cannot take every file
/// descriptor (and with them every other host's next connection). A real host sets up one
/// connection at a time, and each takes milliseconds: a NAT in front of hundreds of hosts that
/// all reconnect at once (a coordinator restarted) stays under it or sees a few closed and
/// retried.
pub const MAX_SETTING_UP_PER_ADDRESS: usize = 256;

/// How long a connection without a certificate lasts: it exists to join (one `Join`, a
/// `TokenReview` of at most 10 s included), and while it is open it counts among its address's
/// connections being set up ([`MAX_SETTING_UP_PER_ADDRESS`]). Without a bound, a peer that can
/// reach the port when enrollment is on could keep connections open there without end (HTTP/2
/// keepalive pings would hold them) and take every file descriptor.
pub const ANONYMOUS_LIFETIME: Duration = Duration::from_secs(60);

/// Connections open at once with one certificate identity by default
/// ([`AcceptOptions::max_open_per_identity`]). Each holds a file descriptor, and HTTP/2
/// keepalive holds an idle one for good: without a bound, one stolen certificate (or a
/// compromised host's) could open connections until the process has no descriptor left for
/// anyone else. An agent keeps one; a client one per running command, and the per-client
/// quotas (64 calls, 256 watch streams) stay well under this.
pub const MAX_OPEN_PER_IDENTITY: usize = 1024;

/// The address a peer is counted under: an IPv4 address (also when mapped into IPv6), or an
/// IPv6 address's /64, which one host can hold whole.
pub fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        },
    }
}

/// What every client of a gRPC server sends first (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How long [`incoming_with`] waits for a connection to prove itself before handing it over,
/// and how many it sets up at once from one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptOptions {
    /// From accepting the TCP connection to the end of the TLS handshake.
    pub handshake: Duration,
    /// From the end of the TLS handshake to the last byte of the HTTP/2 preface.
    pub preface: Duration,
    /// Connections from one address being set up at once; more are closed when accepted.
    /// 0: no limit.
    pub max_setting_up_per_address: usize,
    /// How long a connection without a certificate lasts ([`ANONYMOUS_LIFETIME`]).
    pub anonymous_lifetime: Duration,
    /// Connections open at once with one certificate identity; more are closed after their
    /// handshake. 0: no limit.
    pub max_open_per_identity: usize,
    /// How long a connection's writes may wait on a peer that reads nothing before it is closed
    /// ([`WRITE_STALL`]).
    pub write_stall: Duration,
}

impl AcceptOptions {
    /// The defaults: [`HANDSHAKE_TIMEOUT`], [`PREFACE_TIMEOUT`], [`MAX_SETTING_UP_PER_ADDRESS`],
    /// [`ANONYMOUS_LIFETIME`], [`MAX_OPEN_PER_IDENTITY`], [`WRITE_STALL`].
    pub const DEFAULT: Self = Self {
        handshake: HANDSHAKE_TIMEOUT,
        preface: PREFACE_TIMEOUT,
        max_setting_up_per_address: MAX_SETTING_UP_PER_ADDRESS,
        anonymous_lifetime: ANONYMOUS_LIFETIME,
        max_open_per_identity: MAX_OPEN_PER_IDENTITY,
        write_stall: WRITE_STALL,
    };
}

impl Default for AcceptOptions {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Handshaken connections waiting for tonic to pick them up.
const QUEUE: usize = 64;

/// Who is on the other end of a connection, as proven by its certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The identity read from the peer's certificate.
    pub identity: Identity,
    /// The peer's address.
    pub remote: SocketAddr,
    /// The labels the peer's certificate carries (`toolsrv://label/<k>=<v>` URI SANs, written
    /// by the CA at enrollment): trusted labels.
    pub labels: BTreeMap<String, String>,
    /// When the peer's certificate expires (`notAfter`, Unix seconds): a connection lives on
    /// past it unless the server ends it.
    pub not_after: Option<i64>,
}

/// What tonic puts into every request of a connection: the proven peer, or none for a peer
/// that sent no certificate (accepted only when the server config allows it, for enrollment).
/// [`peer`] reads the proven peer back; nothing else should look at this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnInfo {
    /// The peer proven by its certificate; `None` on an unauthenticated connection.
    pub peer: Option<PeerInfo>,
    /// The peer's address.
    pub remote: SocketAddr,
    /// The connection's data bytes handed to HTTP/2 and not yet written, and what waits on
    /// them: a response body keeps what it holds for its answer here until the answer has left.
    pub unsent: Unsent,
}

/// An accepted, handshaken mTLS connection whose peer has an identity and has sent the HTTP/2
/// preface (read here, and replayed to whoever reads the connection).
pub struct TlsConn {
    stream: TlsStream<TcpStream>,
    info: ConnInfo,
    /// How much of [`H2_PREFACE`] has been replayed to the reader.
    replayed: usize,
    /// Its place among the open [`Connections`]; cancelled to close it. `None` for a peer
    /// without a certificate (enrollment), which has no identity to revoke.
    registration: Option<Registration>,
    /// Resolves when `registration.close` is cancelled; polled by reads, so a connection that
    /// only waits for the peer still notices.
    closing: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    /// A client's connection ends [`EXPIRED_CLIENT_GRACE`] after its certificate expires, so
    /// that the client connects again, with a renewed certificate if it has one. (The services
    /// end its streams and refuse its requests from the expiry on, with a status saying why.)
    /// Agents are not cut here: their link lets running calls finish first.
    expires: Option<Pin<Box<tokio::time::Sleep>>>,
    /// A connection without a certificate: its place among its address's connections being set
    /// up, kept until it closes, and the end of its lifetime
    /// ([`AcceptOptions::anonymous_lifetime`], in seconds for the message).
    anonymous: Option<(Slot<IpAddr>, Pin<Box<tokio::time::Sleep>>, u64)>,
    /// The data bytes of the frames written, counted into `info.unsent`.
    sent: Cursor,
    /// What the peer sends, followed for a lowered stream window.
    received: Received,
    /// Since when writes have waited on the peer, and the deadline of `write_stall`.
    blocked: Option<(Instant, Pin<Box<tokio::time::Sleep>>)>,
    /// [`AcceptOptions::write_stall`].
    write_stall: Duration,
    /// When writes last stopped waiting on the peer (or the connection was handed over).
    unblocked: Instant,
    /// When to look again at what waits in `info.unsent` ([`Unsent`]'s idle release).
    idle: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// How long a connection's writes may wait on a peer that reads nothing before the connection
/// is closed, by default. HTTP/2 keepalive ends such a connection first (its pings go
/// unanswered), but ending it means sending a GOAWAY that waits behind everything else: without
/// this, its descriptor, its place among its identity's connections and everything queued for it
/// stayed for as long as the peer kept its socket open.
pub const WRITE_STALL: Duration = Duration::from_secs(30);

/// Connections closed for [`WRITE_STALL`] are logged once a second at most.
static STALLED: LogThrottle = LogThrottle::new(Duration::from_secs(1));

/// How long a client's connection outlives its certificate: time for the statuses that end its
/// streams at the expiry to reach it.
pub const EXPIRED_CLIENT_GRACE: Duration = Duration::from_secs(2);

impl std::fmt::Debug for TlsConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConn")
            .field("info", &self.info)
            .field("closed", &self.closed())
            .finish_non_exhaustive()
    }
}

impl TlsConn {
    /// Whether the server closed this connection (its peer was revoked).
    fn closed(&self) -> bool {
        self.registration
            .as_ref()
            .is_some_and(|r| r.close.is_cancelled())
    }

    /// Why the server ends this connection now, if it does: its peer was revoked, or a
    /// client's certificate expired. Polled, so that `cx` is woken when either comes.
    fn ended(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if let Some(closing) = self.closing.as_mut()
            && closing.as_mut().poll(cx).is_ready()
        {
            return Some(closed_by_server());
        }
        if let Some(expires) = self.expires.as_mut()
            && expires.as_mut().poll(cx).is_ready()
        {
            return Some(expired_certificate());
        }
        if let Some((_, ends, secs)) = self.anonymous.as_mut()
            && ends.as_mut().poll(cx).is_ready()
        {
            return Some(anonymous_lifetime_over(*secs));
        }
        None
    }

    /// After a write or flush: counts the data bytes of `written` (the first `n` bytes of those
    /// slices) on `Ready`, or notes that writes wait on the peer on `Pending`, and closes the
    /// connection once they have waited `write_stall`.
    fn after_write<'s, T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
        written: impl FnOnce(&T) -> (&'s [io::IoSlice<'s>], usize),
    ) -> Poll<io::Result<T>> {
        match &polled {
            Poll::Ready(Ok(value)) => {
                let (slices, n) = written(value);
                let mut left = n;
                let mut data = 0;
                for slice in slices {
                    if left == 0 {
                        break;
                    }
                    let take = slice.len().min(left);
                    data += self.sent.data_bytes(&slice[..take]);
                    left -= take;
                }
                self.info.unsent.written(data);
                if self.blocked.take().is_some() {
                    self.unblocked = Instant::now();
                    // Reads armed no idle release while writes waited, and a quiet peer may
                    // send nothing that would have them look again.
                    self.release_idle(cx);
                }
                polled
            }
            Poll::Ready(Err(_)) => polled,
            Poll::Pending => {
                let stall = self.write_stall;
                let (since, deadline) = self.blocked.get_or_insert_with(|| {
                    let now = Instant::now();
                    (
                        now,
                        Box::pin(tokio::time::sleep_until((now + stall).into())),
                    )
                });
                if deadline.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let waited = since.elapsed();
                if let Some(unlogged) = STALLED.pass() {
                    let identity = self.info.peer.as_ref().map_or_else(
                        || "(without a certificate)".to_string(),
                        |p| p.identity.to_string(),
                    );
                    tracing::info!(remote = %self.info.remote, %identity, ?waited, unlogged, "connection closed: the peer read nothing of what was sent to it for too long");
                }
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the server closed this connection: the peer read nothing of what was \
                         sent to it for {:?}",
                        self.write_stall
                    ),
                )))
            }
        }
    }

    /// Lets go of what waits in `info.unsent` on data h2 dropped (see [`Unsent`]), unless writes
    /// wait on the peer or the peer lowered its window; arms `idle` to look again.
    fn release_idle(&mut self, cx: &mut Context<'_>) {
        if self.blocked.is_some() || self.received.lowered() {
            self.idle = None;
            return;
        }
        let Some(next) = self
            .info
            .unsent
            .release_idle(Instant::now(), self.unblocked)
        else {
            self.idle = None;
            return;
        };
        let next = tokio::time::Instant::from_std(next);
        let idle = self
            .idle
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(next)));
        if idle.deadline() != next {
            idle.as_mut().reset(next);
        }
        if idle.as_mut().poll(cx).is_ready() {
            // Due already: read again, and look again then.
            cx.waker().wake_by_ref();
        }
    }
}

impl Drop for TlsConn {
    fn drop(&mut self) {
        self.info.unsent.close();
    }
}

/// The error a connection's reads and writes return once its client's certificate expired.
fn expired_certificate() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "the server closed this connection: the client's certificate expired",
    )
}

/// The error a connection without a certificate returns past its lifetime.
fn anonymous_lifetime_over(secs: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        format!(
            "the server closed this connection: one without a certificate lasts at most {secs} s, \
             time to join"
        ),
    )
}

/// The error a closed connection's reads and writes return.
fn closed_by_server() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "the server closed this connection: the peer's certificate is no longer accepted",
    )
}

impl TlsConn {
    /// Who the peer is; `None` when it sent no certificate.
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.info.peer.as_ref()
    }

    /// The underlying TLS stream (negotiated protocol, certificates...).
    pub fn get_ref(&self) -> &TlsStream<TcpStream> {
        &self.stream
    }
}

impl Connected for TlsConn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(e) = self.ended(cx) {
            return Poll::Ready(Err(e));
        }
        if let Some(rest) = H2_PREFACE.get(self.replayed..).filter(|r| !r.is_empty()) {
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            self.replayed += n;
            return Poll::Ready(Ok(()));
        }
        self.release_idle(cx);
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            self.received.read(&buf.filled()[before..]);
        }
        polled
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.ended(cx) {
            return Poll::Ready(Err(e));
        }
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        let slices = [io::IoSlice::new(buf)];
        self.after_write(cx, polled, |n| (&slices, *n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.stream).poll_flush(cx);
        self.after_write(cx, polled, |()| (&[], 0))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.ended(cx) {
            return Poll::Ready(Err(e));
        }
        let polled = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.after_write(cx, polled, |n| (bufs, *n))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// The identity tonic stored in a request's extensions, if it came through [`incoming`] on a
/// connection whose peer presented a verified certificate.
pub fn peer(req_extensions: &tonic::Extensions) -> Option<&PeerInfo> {
    req_extensions
        .get::<ConnInfo>()
        .and_then(|c| c.peer.as_ref())
}

/// The identity of the peer that sent `req`, if it came through [`incoming`].
pub fn peer_of<T>(req: &tonic::Request<T>) -> Option<&PeerInfo> {
    peer(req.extensions())
}

/// The stream of connections [`incoming`] returns. Dropping it stops the
/// accept loop, closes the listener and abandons pending handshakes.
#[derive(Debug)]
pub struct TlsIncoming {
    rx: mpsc::Receiver<TlsConn>,
    accept: JoinHandle<()>,
    conns: Connections,
}

impl TlsIncoming {
    /// The connections this stream handed over that are still open: to close those of a peer
    /// no longer accepted.
    pub fn connections(&self) -> Connections {
        self.conns.clone()
    }
}

impl Stream for TlsIncoming {
    type Item = Result<TlsConn, io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|conn| conn.map(Ok))
    }
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Accepts TCP connections on `listener` and yields those whose mTLS
/// handshake (with the config current in `creds` at accept time) succeeds,
/// whose client certificate names an identity (or who sent none, when the
/// config allows that: see [`crate::server_config_with`]), and which then send the
/// HTTP/2 preface. Each connection is set up in its own task, within
/// [`HANDSHAKE_TIMEOUT`] for the handshake and [`PREFACE_TIMEOUT`] for the
/// preface; failures are logged and dropped, never ending the stream. Must be
/// called inside a tokio runtime.
pub fn incoming(listener: TcpListener, creds: watch::Receiver<Arc<ServerConfig>>) -> TlsIncoming {
    incoming_with(listener, creds, AcceptOptions::default())
}

/// [`incoming`] with other timeouts or another limit per address.
pub fn incoming_with(
    listener: TcpListener,
    creds: watch::Receiver<Arc<ServerConfig>>,
    options: AcceptOptions,
) -> TlsIncoming {
    let (tx, rx) = mpsc::channel(QUEUE);
    let conns = Connections::default();
    let accept = tokio::spawn(accept_loop(listener, creds, options, conns.clone(), tx));
    TlsIncoming { rx, accept, conns }
}

async fn accept_loop(
    listener: TcpListener,
    creds: watch::Receiver<Arc<ServerConfig>>,
    options: AcceptOptions,
    conns: Connections,
    tx: mpsc::Sender<TlsConn>,
) {
    // Owned here so that aborting this task aborts every pending handshake.
    let mut handshakes = JoinSet::new();
    let setting_up = SettingUp::default();
    loop {
        tokio::select! {
            () = tx.closed() => return,
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((tcp, remote)) => {
                    let Some(permit) = setting_up.admit(remote, options.max_setting_up_per_address) else {
                        continue;
                    };
                    let acceptor = TlsAcceptor::from(creds.borrow().clone());
                    handshakes.spawn(handshake(acceptor, tcp, remote, permit, options, conns.clone(), tx.clone()));
                }
                Err(e) => {
                    // Usually out of file descriptors: back off instead of
                    // spinning, and keep serving the connections we have.
                    tracing::warn!(error = %e, "cannot accept a TCP connection; retrying in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// Connections being set up, per address ([`MAX_SETTING_UP_PER_ADDRESS`]): each counted from
/// its accept until its slot is dropped (the handshake done, or for a connection without a
/// certificate, the connection closed).
#[derive(Debug, Clone, Default)]
struct SettingUp(OpenCounts<IpAddr>);

impl SettingUp {
    /// A place for a connection from `remote`, counted under its [`address_key`], if at most
    /// `limit` (0: any number) are being set up from there; logs the first one refused of each
    /// run.
    fn admit(&self, remote: SocketAddr, limit: usize) -> Option<Slot<IpAddr>> {
        match self.0.admit(address_key(remote.ip()), limit) {
            Ok(slot) => Some(slot),
            Err(full) => {
                if full.first {
                    tracing::warn!(%remote, limit, "too many connections from this address being set up at once: new ones are closed until some are done (--max-connecting-per-address)");
                }
                None
            }
        }
    }
}

async fn handshake(
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    remote: SocketAddr,
    permit: Slot<IpAddr>,
    options: AcceptOptions,
    conns: Connections,
    tx: mpsc::Sender<TlsConn>,
) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(%remote, error = %e, "cannot set TCP_NODELAY");
    }
    let mut stream = match tokio::time::timeout(options.handshake, acceptor.accept(tcp)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => {
            if let Some(unlogged) = HANDSHAKE_FAILED.pass() {
                tracing::info!(%remote, error = %e, unlogged, "TLS handshake failed; connection dropped");
            }
            return;
        }
        Err(_) => {
            if let Some(unlogged) = HANDSHAKE_FAILED.pass() {
                tracing::info!(%remote, timeout = ?options.handshake, unlogged, "TLS handshake timed out; connection dropped");
            }
            return;
        }
    };
    // A peer without a certificate gets here only when the config allows it (enrollment on):
    // its requests carry no `PeerInfo`, so every service but enrollment refuses them.
    let leaf = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.clone().into_owned());
    let peer = match &leaf {
        Some(leaf) => match identity_of(leaf).and_then(|id| Ok((id, labels_of(leaf)?))) {
            Ok((identity, labels)) => Some(PeerInfo {
                identity,
                remote,
                labels,
                not_after: crate::CertInfo::of(leaf).map(|c| c.not_after),
            }),
            Err(e) => {
                tracing::info!(%remote, error = %e, "peer certificate has no usable identity; connection dropped");
                return;
            }
        },
        None => None,
    };
    let identity = peer
        .as_ref()
        .map_or_else(|| "unauthenticated".to_string(), |p| p.identity.to_string());
    // hyper waits for the preface without a deadline (its keepalive pings start only after it),
    // so an authenticated peer that goes quiet here would hold the connection forever.
    let mut preface = [0u8; H2_PREFACE.len()];
    match tokio::time::timeout(options.preface, stream.read_exact(&mut preface)).await {
        Ok(Ok(_)) if preface == *H2_PREFACE => {}
        Ok(Ok(_)) => {
            tracing::info!(%remote, %identity, "peer did not speak HTTP/2; connection dropped");
            return;
        }
        Ok(Err(e)) => {
            tracing::info!(%remote, %identity, error = %e, "connection ended before the HTTP/2 preface; dropped");
            return;
        }
        Err(_) => {
            tracing::info!(%remote, %identity, timeout = ?options.preface, "no HTTP/2 preface after the TLS handshake; connection dropped");
            return;
        }
    }
    tracing::debug!(%remote, %identity, "TLS connection accepted");
    // Connections with a proven peer are tracked, so they can be closed when it is revoked;
    // an unauthenticated one can do nothing but enroll.
    let registration = match (&peer, leaf) {
        (Some(peer), Some(leaf)) => {
            match conns.register(peer, leaf, options.max_open_per_identity) {
                Some(registration) => Some(registration),
                // Too many open with this identity: closed (logged by `register`).
                None => return,
            }
        }
        _ => None,
    };
    let closing = registration
        .as_ref()
        .map(|r| Box::pin(r.close.clone().cancelled_owned()));
    let expires = peer
        .as_ref()
        .filter(|p| p.identity.role() == crate::Role::Client)
        .and_then(|p| p.not_after)
        .map(|not_after| {
            Box::pin(tokio::time::sleep(
                crate::until_unix(not_after) + EXPIRED_CLIENT_GRACE,
            ))
        });
    // A peer with a certificate is set up; one without stays counted until it closes.
    let anonymous = match &peer {
        Some(_) => {
            drop(permit);
            None
        }
        None => Some((
            permit,
            Box::pin(tokio::time::sleep(options.anonymous_lifetime)),
            options.anonymous_lifetime.as_secs(),
        )),
    };
    let conn = TlsConn {
        stream,
        info: ConnInfo {
            peer,
            remote,
            unsent: Unsent::default(),
        },
        replayed: 0,
        registration,
        closing,
        expires,
        anonymous,
        sent: Cursor::default(),
        received: Received::default(),
        blocked: None,
        write_stall: options.write_stall,
        unblocked: Instant::now(),
        idle: None,
    };
    // An error means the server is gone; the connection just closes.
    let _ = tx.send(conn).await;
}

/// HTTP/2 streams one connection to a toolsrv server may have open at once, as the server says
/// in its SETTINGS: as many as one identity may have open over all its connections on a
/// coordinator (`--max-requests-per-identity`'s default), so a client on one connection is not
/// held below that; streams past it are refused by HTTP/2 itself before any work is spent.
pub const STREAMS_PER_CONNECTION: u32 = 1024;

/// Streams a server may reset over a peer's protocol errors on one connection before it ends
/// the connection: h2's own default, which tonic replaces with none.
pub const LOCAL_ERROR_RESETS: usize = 1024;

/// A tonic server with the HTTP/2 bounds every toolsrv server keeps: at most `streams` open at
/// once per connection, and at most [`LOCAL_ERROR_RESETS`] streams reset for a peer's errors.
///
/// tonic leaves both unbounded unless told. Without the stream limit a peer (one without a
/// certificate included, on a coordinator that enrolls) opened streams faster than they were
/// refused, and the coordinator grew by 45 MB a second until its other clients timed out;
/// without the reset limit a peer made it reset streams without end (MadeYouReset,
/// CVE-2025-8671), to the same effect. Past either, that connection's streams are refused or
/// the connection ended; other connections are not touched.
pub fn bounded_server(streams: u32) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(Some(streams))
        .http2_max_local_error_reset_streams(Some(LOCAL_ERROR_RESETS))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn an_ipv6_slash_64_is_one_address_and_mapped_ipv4_its_ipv4() {
        assert_eq!(address_key(ip("192.0.2.7")), ip("192.0.2.7"));
        assert_eq!(address_key(ip("::ffff:198.51.100.1")), ip("198.51.100.1"));
        assert_eq!(
            address_key(ip("2001:db8:1:2:ffff:ee:dd:9")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(
            address_key(ip("2001:db8:1:2::1")),
            address_key(ip("2001:db8:1:2:8000::"))
        );
        assert_ne!(
            address_key(ip("2001:db8:1:2::1")),
            address_key(ip("2001:db8:1:3::1"))
        );
    }

    #[test]
    fn setting_up_counts_per_address_and_forgets_an_address_at_zero() {
        let setting_up = SettingUp::default();
        let from = |s: &str| SocketAddr::new(ip(s), 40000);
        let mut permits: Vec<Slot<IpAddr>> = (0..MAX_SETTING_UP_PER_ADDRESS)
            .map(|_| {
                let permit = setting_up
                    .admit(from("2001:db8::1"), MAX_SETTING_UP_PER_ADDRESS)
                    .unwrap();
                assert_eq!(permit.key(), &ip("2001:db8::"));
                permit
            })
            .collect();
        // The same /64 is full; another address is not.
        assert!(
            setting_up
                .admit(from("2001:db8::2"), MAX_SETTING_UP_PER_ADDRESS)
                .is_none()
        );
        assert!(
            setting_up
                .admit(from("192.0.2.1"), MAX_SETTING_UP_PER_ADDRESS)
                .is_some()
        );
        // No limit: taken however many.
        assert!(setting_up.admit(from("2001:db8::2"), 0).is_some());
        permits.pop();
        permits.push(
            setting_up
                .admit(from("2001:db8::3"), MAX_SETTING_UP_PER_ADDRESS)
                .unwrap(),
        );
        drop(permits);
        assert!(setting_up.0.is_empty());
    }
}
