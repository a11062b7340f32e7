//! A TCP link on loopback between a process and its peer that a test can slow down or cut.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Result, TestkitError};

/// A forwarder from a port of its own to `127.0.0.1:target`, one thread with its own runtime
/// for the test's lifetime. [`TcpLink::cut`] makes it a black hole: what either side sends is
/// read and dropped, nothing is closed or reset (a cable pulled, a silent firewall), and new
/// connections are accepted and never reach the target; [`TcpLink::heal`] forwards again
/// on the connections made since (one that lost bytes to the cut stays a black hole: what
/// came after them would make no sense to the other side).
#[derive(Debug, Clone)]
pub struct TcpLink {
    /// The port to connect to instead of the target's.
    pub port: u16,
    cut: Arc<AtomicBool>,
}

/// How much one read passes on at a time.
const SLICE: usize = 4096;

impl TcpLink {
    /// A link to `target` that forwards at most `up` bytes a second towards it and `down` back
    /// (`None`: as fast as it can).
    pub fn try_start(target: u16, up: Option<usize>, down: Option<usize>) -> Result<Self> {
        let io = |what: &str| {
            let what = what.to_string();
            move |e| TestkitError::io(what, e)
        };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io("bind a link"))?;
        listener
            .set_nonblocking(true)
            .map_err(io("make the link's listener non-blocking"))?;
        let port = listener
            .local_addr()
            .map_err(io("read the link's port"))?
            .port();
        let cut = Arc::new(AtomicBool::new(false));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io("start the link's runtime"))?;
        let severed = cut.clone();
        std::thread::spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                while let Ok((client, _)) = listener.accept().await {
                    let cut = severed.clone();
                    tokio::spawn(async move {
                        if cut.load(Ordering::Relaxed) {
                            swallow(client).await;
                            return;
                        }
                        let Ok(server) =
                            tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                        else {
                            return;
                        };
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        tokio::select! {
                            () = pass(client_read, server_write, up, &cut) => {}
                            () = pass(server_read, client_write, down, &cut) => {}
                        }
                    });
                }
            });
        });
        Ok(Self { port, cut })
    }

    /// [`TcpLink::try_start`], failing the test on error.
    #[track_caller]
    pub fn start(target: u16, up: Option<usize>, down: Option<usize>) -> Self {
        crate::must(Self::try_start(target, up, down))
    }

    /// From now on nothing crosses the link, and nobody is told.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }

    /// Forwards again.
    pub fn heal(&self) {
        self.cut.store(false, Ordering::Relaxed);
    }
}

/// Copies `from` to `to`, at most `per_second` bytes a second; while `cut`, reads and drops.
async fn pass(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    per_second: Option<usize>,
    cut: &AtomicBool,
) {
    let pause = per_second.map(|r| Duration::from_secs_f64(SLICE as f64 / r as f64));
    let mut buf = vec![0; SLICE];
    let mut dropped = false;
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 {
            break;
        }
        dropped = dropped || cut.load(Ordering::Relaxed);
        if dropped {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
    }
}

/// Reads and drops what `stream` sends until it closes.
async fn swallow(mut stream: tokio::net::TcpStream) {
    let mut buf = vec![0; SLICE];
    while let Ok(n) = stream.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
}
