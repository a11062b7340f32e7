//! The connections `toolctl mcp --http` accepts. Its bearer token refuses other local users'
//! requests, not their connections, and a connection that sends nothing is held by the HTTP
//! server for good: whoever can reach the port could open them until this process has no file
//! descriptor left, and then the model's own client could not connect, nor this process reach
//! the coordinator. So a connection is a *stranger* until one of its requests presents the
//! token: at most [`MAX_STRANGERS`] that have sent nothing are open at once (a new one closes
//! the oldest of them, so a client with the token, which sends its request at once, gets in),
//! at most [`MAX_SPEAKING_STRANGERS`] in all (a burst of clients whose requests wait to be
//! read: closing them for being many would turn away the clients the token is for), and each is
//! closed [`STRANGER_LIFETIME`] after it was accepted. A connection that presented the token is
//! kept as long as its client keeps it: MCP's event streams last as long as the session.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// Connections open at once that have not presented the token and sent nothing yet.
pub const MAX_STRANGERS: usize = 64;
/// Connections open at once that have not presented the token, whether or not they sent a
/// request that waits to be read.
pub const MAX_SPEAKING_STRANGERS: usize = 256;
/// How long a connection may take to present the token (a client sends its request at once).
pub const STRANGER_LIFETIME: Duration = Duration::from_secs(10);

/// One connection's standing: trusted once a request on it presented the token. What the
/// request handlers get (as `ConnectInfo`) to say so.
#[derive(Debug, Clone)]
pub struct Standing(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    trusted: AtomicBool,
    /// Whether the HTTP server has read anything from the connection.
    heard: AtomicBool,
    /// The connection's socket, to look for bytes that wait to be read.
    fd: RawFd,
    /// Cancelled to close the connection, and when it closes by itself.
    closed: CancellationToken,
}

impl Standing {
    fn new(trusted: bool, fd: RawFd) -> Self {
        Self(Arc::new(Inner {
            trusted: AtomicBool::new(trusted),
            heard: AtomicBool::new(false),
            fd,
            closed: CancellationToken::new(),
        }))
    }

    /// Whether the connection has sent nothing: nothing read from it, nothing waiting to be.
    /// Asked only of connections still open (their socket is theirs).
    fn silent(&self) -> bool {
        if self.0.heard.load(Ordering::Relaxed) {
            return false;
        }
        use nix::sys::socket::{MsgFlags, recv};
        let mut byte = [0u8; 1];
        // Ok(0) is a connection its peer closed, which says nothing either.
        !matches!(
            recv(self.0.fd, &mut byte, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT),
            Ok(n) if n > 0
        )
    }

    /// The connection presented the token: it is kept from now on.
    pub fn trust(&self) {
        self.0.trusted.store(true, Ordering::Relaxed);
    }

    fn trusted(&self) -> bool {
        self.0.trusted.load(Ordering::Relaxed)
    }

    fn close(&self) {
        self.0.closed.cancel();
    }

    fn closed(&self) -> bool {
        self.0.closed.is_cancelled()
    }
}

impl Connected<IncomingStream<'_, Listener>> for Standing {
    fn connect_info(stream: IncomingStream<'_, Listener>) -> Self {
        stream.io().standing.clone()
    }
}

/// A TCP listener whose connections are strangers until they present the token.
pub struct Listener {
    inner: TcpListener,
    /// Every connection is trusted from the start (`--http-no-auth`: there is no token).
    open: bool,
    /// Strangers, oldest first (and some since trusted or closed, dropped at the next accept).
    strangers: VecDeque<Standing>,
    /// Whether closing a stranger for a newer one was said already this run.
    said: bool,
}

impl Listener {
    pub fn new(inner: TcpListener, open: bool) -> Self {
        Self {
            inner,
            open,
            strangers: VecDeque::new(),
            said: false,
        }
    }

    /// Counts a new stranger, closing the oldest that has sent nothing when there are too many
    /// (the oldest of all past [`MAX_SPEAKING_STRANGERS`]), and closes it after its lifetime
    /// unless it presents the token by then.
    fn admit(&mut self, standing: &Standing, from: SocketAddr) {
        let strangers = &mut self.strangers;
        strangers.retain(|s| !s.trusted() && !s.closed());
        let victim = if strangers.len() >= MAX_SPEAKING_STRANGERS {
            Some(0)
        } else if strangers.len() >= MAX_STRANGERS {
            strangers.iter().position(Standing::silent)
        } else {
            None
        };
        if let Some(oldest) = victim.and_then(|i| strangers.remove(i)) {
            oldest.close();
            if !self.said {
                self.said = true;
                eprintln!(
                    "toolctl mcp: {} connections are open that have not presented \
                     the bearer token (the newest from {from}): closing the oldest that has sent \
                     nothing (or past {MAX_SPEAKING_STRANGERS}, the oldest) for each new one. A \
                     client without the token, or another user of this machine; said once per \
                     run",
                    strangers.len() + 1
                );
            }
        }
        strangers.push_back(standing.clone());
        let standing = standing.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(STRANGER_LIFETIME) => {
                    if !standing.trusted() {
                        standing.close();
                    }
                }
                () = standing.0.closed.cancelled() => {}
            }
        });
    }
}

impl axum::serve::Listener for Listener {
    type Io = Connection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Connection, SocketAddr) {
        // axum's own accept: it waits and retries when accepting fails (no descriptor left).
        let (stream, from) = axum::serve::Listener::accept(&mut self.inner).await;
        let standing = Standing::new(self.open, stream.as_raw_fd());
        if !self.open {
            self.admit(&standing, from);
        }
        (Connection::new(stream, standing), from)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// An accepted connection: the TCP stream, whose reads fail once it is closed for lack of the
/// token (the HTTP server then drops it).
pub struct Connection {
    stream: TcpStream,
    standing: Standing,
    closing: Pin<Box<WaitForCancellationFutureOwned>>,
    closed: bool,
}

impl Connection {
    fn new(stream: TcpStream, standing: Standing) -> Self {
        Self {
            closing: Box::pin(standing.0.closed.clone().cancelled_owned()),
            stream,
            standing,
            closed: false,
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Ends its lifetime's timer, and tells the count it is gone.
        self.standing.close();
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.closed && self.closing.as_mut().poll(cx).is_ready() {
            self.closed = true;
        }
        if self.closed {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed: it did not present the bearer token",
            )));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.standing.0.heard.store(true, Ordering::Relaxed);
        }
        read
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
