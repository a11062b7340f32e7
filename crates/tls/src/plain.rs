//! Listeners without TLS: the coordinator's gRPC health port and the `/metrics` ports. They
//! answer anyone who reaches them (the kubelet's probes come from the node, a scraper from
//! wherever it runs), and every connection they hold is a file descriptor of the process that
//! also serves the agents' links and runs calls. So a peer cannot keep connections there
//! without end: at most [`PlainLimits::per_address`] at once from one address (see
//! [`address_key`]), [`PlainLimits::total`] in all, and each is closed after
//! [`PlainLimits::lifetime`]. Connections past a limit are closed as soon as they are accepted.
//! A probe or a scrape takes one connection for milliseconds (Prometheus keeps one open between
//! scrapes and opens another when it is closed).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;
use tokio_stream::Stream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::address_key;

/// How many connections a plain port keeps, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlainLimits {
    /// Open at once from one address.
    pub per_address: usize,
    /// Open at once in all.
    pub total: usize,
    /// How long a connection lasts, however busy.
    pub lifetime: Duration,
}

impl PlainLimits {
    /// 16 per address, 256 in all, one minute each.
    pub const DEFAULT: Self = Self {
        per_address: 16,
        total: 256,
        lifetime: Duration::from_secs(60),
    };
}

impl Default for PlainLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// A plain TCP listener that holds connections within [`PlainLimits`].
#[derive(Debug)]
pub struct PlainListener {
    listener: TcpListener,
    limits: PlainLimits,
    open: Arc<Mutex<Open>>,
    /// What the port serves, for the log ("metrics", "health").
    what: &'static str,
}

/// Connections open now.
#[derive(Debug, Default)]
struct Open {
    total: usize,
    /// Whether going over the total was logged since the port was last under it.
    total_logged: bool,
    /// Per address: how many, and whether its going over was logged.
    addresses: HashMap<IpAddr, (usize, bool)>,
}

impl Open {
    /// Counts a connection from `ip` if the limits allow it; logs the first refused of a run.
    fn admit(&mut self, ip: IpAddr, limits: &PlainLimits, what: &str) -> Option<IpAddr> {
        let key = address_key(ip);
        if self.total >= limits.total {
            if !std::mem::replace(&mut self.total_logged, true) {
                tracing::warn!(
                    port = what,
                    limit = limits.total,
                    "too many connections open on this plain-text port: new ones are closed until some end"
                );
            }
            return None;
        }
        let (n, logged) = self.addresses.entry(key).or_insert((0, false));
        if *n >= limits.per_address {
            if !std::mem::replace(logged, true) {
                tracing::warn!(port = what, remote = %ip, limit = limits.per_address, "too many connections open from this address on a plain-text port: new ones are closed until some end");
            }
            return None;
        }
        *n += 1;
        self.total += 1;
        Some(key)
    }

    fn release(&mut self, key: IpAddr) {
        self.total = self.total.saturating_sub(1);
        if self.total == 0 {
            self.total_logged = false;
        }
        if let Some((n, _)) = self.addresses.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.addresses.remove(&key);
            }
        }
    }
}

/// One connection's place in its listener's count, given back when the connection is dropped.
#[derive(Debug)]
struct Permit {
    open: Arc<Mutex<Open>>,
    key: IpAddr,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .release(self.key);
    }
}

impl PlainListener {
    /// `what` names the port in log lines.
    pub fn new(listener: TcpListener, limits: PlainLimits, what: &'static str) -> Self {
        Self {
            listener,
            limits,
            open: Arc::default(),
            what,
        }
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The next connection the limits allow; the others are closed on the way.
    pub async fn accept(&mut self) -> (PlainConn, SocketAddr) {
        loop {
            match self.listener.accept().await {
                Ok((tcp, remote)) => {
                    let admitted = self
                        .open
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .admit(remote.ip(), &self.limits, self.what);
                    // Refused: `tcp` is dropped, which closes it.
                    let Some(key) = admitted else { continue };
                    let permit = Permit {
                        open: self.open.clone(),
                        key,
                    };
                    let conn = PlainConn {
                        tcp,
                        _permit: permit,
                        ends: Box::pin(tokio::time::sleep(self.limits.lifetime)),
                    };
                    return (conn, remote);
                }
                Err(e) => {
                    // Usually out of file descriptors: back off instead of spinning.
                    tracing::warn!(port = self.what, error = %e, "cannot accept a TCP connection; retrying in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    /// The connections as a stream, for tonic's `serve_with_incoming`; accepting stops when
    /// the stream is dropped.
    pub fn incoming(mut self) -> impl Stream<Item = io::Result<PlainConn>> + Send + 'static {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    () = tx.closed() => return,
                    (conn, _) = self.accept() => conn,
                };
                if tx.send(Ok(conn)).await.is_err() {
                    return;
                }
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }
}

/// A connection of a [`PlainListener`]: ends (reads see the end of the stream, writes fail)
/// once its lifetime is over.
#[derive(Debug)]
pub struct PlainConn {
    tcp: TcpStream,
    _permit: Permit,
    ends: Pin<Box<Sleep>>,
}

impl PlainConn {
    /// Whether the lifetime is over; polled, so that `cx` is woken when it is.
    fn over(&mut self, cx: &mut Context<'_>) -> bool {
        self.ends.as_mut().poll(cx).is_ready()
    }
}

fn lifetime_over() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the server closed this connection: its lifetime on a plain-text port is over",
    )
}

impl Connected for PlainConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.tcp.connect_info()
    }
}

impl AsyncRead for PlainConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.over(cx) {
            // The end of the stream: the server closes the connection quietly.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for PlainConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.over(cx) {
            return Poll::Ready(Err(lifetime_over()));
        }
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.over(cx) {
            return Poll::Ready(Err(lifetime_over()));
        }
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const SMALL: PlainLimits = PlainLimits {
        per_address: 2,
        total: 3,
        lifetime: Duration::from_millis(400),
    };

    /// Serves `listener` with an echo per connection.
    fn echo(mut listener: PlainListener) {
        tokio::spawn(async move {
            loop {
                let (mut conn, _) = listener.accept().await;
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    loop {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if conn.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
    }

    /// Whether the server answers on `stream` (an echo) rather than closing it.
    async fn answered(stream: &mut TcpStream) -> bool {
        if stream.write_all(b"x").await.is_err() {
            return false;
        }
        let mut byte = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), stream.read(&mut byte)).await,
            Ok(Ok(1))
        )
    }

    async fn from(ip: &str, to: SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket
            .bind(SocketAddr::new(ip.parse().unwrap(), 0))
            .unwrap();
        socket.connect(to).await.unwrap()
    }

    #[tokio::test]
    async fn connections_are_bounded_per_address_and_in_all_and_end_after_their_lifetime() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        echo(PlainListener::new(listener, SMALL, "test"));

        let mut a1 = from("127.0.0.1", addr).await;
        let mut a2 = from("127.0.0.1", addr).await;
        let mut a3 = from("127.0.0.1", addr).await;
        assert!(answered(&mut a1).await && answered(&mut a2).await);
        assert!(
            !answered(&mut a3).await,
            "a third from one address is closed"
        );
        let mut b1 = from("127.0.0.2", addr).await;
        assert!(answered(&mut b1).await, "another address is served");
        let mut c1 = from("127.0.0.3", addr).await;
        assert!(!answered(&mut c1).await, "past the total, nobody is");

        // Their lifetime over, the connections end, however busy, and free their places.
        let start = Instant::now();
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), a1.read(&mut byte)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        drop((a1, a2, b1));
        let mut again = None;
        for _ in 0..50 {
            let mut a4 = from("127.0.0.1", addr).await;
            if answered(&mut a4).await {
                again = Some(a4);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(again.is_some(), "served again once the others ended");
    }

    #[test]
    fn counts_go_back_to_nothing() {
        let mut open = Open::default();
        let ip: IpAddr = "2001:db8::1".parse().unwrap();
        let keys: Vec<IpAddr> = (0..SMALL.per_address)
            .map(|_| open.admit(ip, &SMALL, "test").unwrap())
            .collect();
        // Another host of the same /64 is the same address.
        assert_eq!(
            open.admit("2001:db8::2".parse().unwrap(), &SMALL, "test"),
            None
        );
        for key in keys {
            open.release(key);
        }
        assert_eq!(open.total, 0);
        assert!(open.addresses.is_empty() && !open.total_logged);
    }
}
