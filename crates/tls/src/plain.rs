//! Listeners without TLS: the coordinator's gRPC health port and the `/metrics` ports. They
//! answer anyone who reaches them (the kubelet's probes come from the node, a scraper from
//! wherever it runs), and every connection they hold is a file descriptor of the process that
//! also serves the agents' links and runs calls. So a peer cannot keep connections there
//! without end: at most [`PlainLimits::per_address`] at once from one address (see
//! [`address_key`]), [`PlainLimits::total`] in all, and each is closed after
//! [`PlainLimits::lifetime`]. Connections past a limit are closed as soon as they are accepted.
//! A probe or a scrape takes one connection for milliseconds (Prometheus keeps one open between
//! scrapes and opens another when it is closed).

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;
use tokio_stream::Stream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::address_key;
use crate::counts::{OpenCounts, Slot};

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
    /// Connections open, in all (one key) and per address.
    total: OpenCounts<()>,
    addresses: OpenCounts<IpAddr>,
    /// What the port serves, for the log ("metrics", "health").
    what: &'static str,
}

/// One connection's places in its listener's counts, given back when the connection is dropped.
#[derive(Debug)]
struct Permit {
    _total: Slot<()>,
    _address: Slot<IpAddr>,
}

impl PlainListener {
    /// `what` names the port in log lines.
    pub fn new(listener: TcpListener, limits: PlainLimits, what: &'static str) -> Self {
        Self {
            listener,
            limits,
            total: OpenCounts::default(),
            addresses: OpenCounts::default(),
            what,
        }
    }

    /// Places for a connection from `ip` if the limits allow it; logs the first refused of a
    /// run.
    fn admit(&self, ip: IpAddr) -> Option<Permit> {
        let what = self.what;
        let total = match self.total.admit((), self.limits.total) {
            Ok(slot) => slot,
            Err(full) => {
                if full.first {
                    tracing::warn!(
                        port = what,
                        limit = self.limits.total,
                        "too many connections open on this plain-text port: new ones are closed until some end"
                    );
                }
                return None;
            }
        };
        let address = match self
            .addresses
            .admit(address_key(ip), self.limits.per_address)
        {
            Ok(slot) => slot,
            Err(full) => {
                if full.first {
                    tracing::warn!(port = what, remote = %ip, limit = self.limits.per_address, "too many connections open from this address on a plain-text port: new ones are closed until some end");
                }
                return None;
            }
        };
        Some(Permit {
            _total: total,
            _address: address,
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The next connection the limits allow; the others are closed on the way.
    pub async fn accept(&mut self) -> (PlainConn, SocketAddr) {
        loop {
            match self.listener.accept().await {
                Ok((tcp, remote)) => {
                    // Refused: `tcp` is dropped, which closes it.
                    let Some(permit) = self.admit(remote.ip()) else {
                        continue;
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

    #[tokio::test]
    async fn counts_go_back_to_nothing() {
        let listener = PlainListener::new(
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
            SMALL,
            "test",
        );
        let ip: IpAddr = "2001:db8::1".parse().unwrap();
        let permits: Vec<Permit> = (0..SMALL.per_address)
            .map(|_| listener.admit(ip).unwrap())
            .collect();
        // Another host of the same /64 is the same address.
        assert!(listener.admit("2001:db8::2".parse().unwrap()).is_none());
        drop(permits);
        assert!(listener.total.is_empty() && listener.addresses.is_empty());
    }
}
