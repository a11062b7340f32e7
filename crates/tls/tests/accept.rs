//! The accept path closes connections that never become gRPC: no TLS handshake, or a handshake
//! and then silence instead of the HTTP/2 preface.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use toolsrv_tls::{AcceptOptions, Identity, ServerCreds};

use common::{alice, check, client_cfg, files};

const SHORT: AcceptOptions = AcceptOptions {
    handshake: Duration::from_millis(300),
    preface: Duration::from_millis(300),
    ..AcceptOptions::DEFAULT
};
/// Well past the timeouts above, well short of the default ones.
const BOUND: Duration = Duration::from_secs(5);

/// Reads and discards until the peer closes; how long that took.
async fn until_closed(mut conn: impl AsyncRead + Unpin) -> Duration {
    let start = Instant::now();
    let drained = async {
        let mut buf = [0u8; 1024];
        while let Ok(n) = conn.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::time::timeout(BOUND, drained)
        .await
        .expect("the server kept a silent connection open");
    start.elapsed()
}

#[tokio::test]
async fn silent_connections_are_closed_within_the_timeouts() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let server = common::serve_with("127.0.0.1:0", creds.subscribe(), SHORT).await;

    // TCP only: never a ClientHello.
    let tcp = TcpStream::connect(server.addr).await.unwrap();
    let took = until_closed(tcp).await;
    assert!(took >= SHORT.handshake / 2, "closed after {took:?}");

    // A valid client certificate, a complete handshake, then nothing.
    let tcp = TcpStream::connect(server.addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(client_cfg(tmp.path(), &alice()))
        .connect(ServerName::IpAddress(server.addr.ip().into()), tcp)
        .await
        .unwrap();
    let took = until_closed(tls).await;
    assert!(took >= SHORT.preface / 2, "closed after {took:?}");

    // Half a preface is no better.
    let tcp = TcpStream::connect(server.addr).await.unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(client_cfg(tmp.path(), &alice()))
        .connect(ServerName::IpAddress(server.addr.ip().into()), tcp)
        .await
        .unwrap();
    tls.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    tls.flush().await.unwrap();
    until_closed(tls).await;

    // Nobody who was closed got through to a handler; a real client still does, and is served.
    assert!(server.seen.lock().unwrap().is_empty());
    check(&server.url(), client_cfg(tmp.path(), &alice()))
        .await
        .unwrap();
    assert_eq!(*server.seen.lock().unwrap(), vec![alice()]);
    server.stop().await;
}

#[tokio::test]
async fn a_connection_that_sent_its_preface_outlives_the_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let server = common::serve_with("127.0.0.1:0", creds.subscribe(), SHORT).await;
    // The preface and an empty SETTINGS frame, then an idle HTTP/2 connection.
    let mut tls = idle_h2("127.0.0.1", server.addr, client_cfg(tmp.path(), &alice()))
        .await
        .unwrap();
    let idle = async {
        let mut buf = [0u8; 1024];
        loop {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    let waited = SHORT.preface * 4;
    assert!(
        tokio::time::timeout(waited, idle).await.is_err(),
        "closed within {waited:?} though the preface came"
    );
    // A graceful stop waits for open connections.
    drop(tls);
    server.stop().await;
}

/// A TCP connection to `to` from the local address `from` (any port).
async fn connect_from(from: &str, to: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    socket.connect(to).await.unwrap()
}

/// A peer that opens connections and never handshakes holds at most
/// `MAX_SETTING_UP_PER_ADDRESS` of them: the next are closed at once (before, each one was
/// kept until its handshake timed out, so a peer opening them faster than that took every
/// file descriptor). Another address is served meanwhile, and the peer is served again once
/// its connections are gone.
#[tokio::test]
async fn a_peer_opening_connections_without_end_holds_only_a_few_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let long = AcceptOptions {
        handshake: Duration::from_secs(30),
        preface: Duration::from_secs(30),
        ..AcceptOptions::DEFAULT
    };
    let server = common::serve_with("127.0.0.1:0", creds.subscribe(), long).await;
    const FLOODER: &str = "127.0.0.2";

    let mut held = Vec::new();
    for _ in 0..toolsrv_tls::MAX_SETTING_UP_PER_ADDRESS {
        held.push(connect_from(FLOODER, server.addr).await);
    }
    // One more: closed at once, well before any timeout.
    let extra = connect_from(FLOODER, server.addr).await;
    let took = until_closed(extra).await;
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
    // Another address is served meanwhile.
    let url = format!("https://{}", server.addr);
    check(&url, client_cfg(tmp.path(), &alice())).await.unwrap();

    // Its connections gone, the peer is served again.
    drop(held);
    let deadline = Instant::now() + BOUND;
    loop {
        let tcp = connect_from(FLOODER, server.addr).await;
        let tls = tokio_rustls::TlsConnector::from(client_cfg(tmp.path(), &alice()))
            .connect(ServerName::IpAddress(server.addr.ip().into()), tcp)
            .await;
        if tls.is_ok() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never served again: {:?}",
            tls.err()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.stop().await;
}

/// An HTTP/2 connection from `from` to `to` made with `config`, idle after its preface and an
/// empty SETTINGS frame.
async fn idle_h2(
    from: &str,
    to: std::net::SocketAddr,
    config: std::sync::Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = connect_from(from, to).await;
    let mut tls = tokio_rustls::TlsConnector::from(config)
        .connect(ServerName::IpAddress(to.ip().into()), tcp)
        .await?;
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await?;
    tls.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await?;
    tls.flush().await?;
    Ok(tls)
}

/// [`idle_h2`] without a client certificate, as a joining agent connects.
async fn anonymous_idle(
    from: &str,
    to: std::net::SocketAddr,
    tmp: &std::path::Path,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let config = toolsrv_tls::anonymous_client_config(
        &tmp.join(toolsrv_tls::CA_CERT),
        toolsrv_tls::Role::Coordinator,
    )
    .unwrap();
    idle_h2(from, to, config).await
}

/// A peer without a certificate, which the server lets in to join when enrollment is on, keeps
/// its connections counted among its address's connections being set up for as long as they
/// are open, and each lasts only `anonymous_lifetime`. Before, an anonymous connection stopped
/// counting once its preface came, and HTTP/2 keepalive held it open for good: one peer could
/// open connections until the process ran out of file descriptors.
#[tokio::test]
async fn connections_without_a_certificate_count_until_they_close_and_end_after_a_while() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds =
        ServerCreds::with_options(files(tmp.path(), &Identity::Coordinator), Vec::new(), true)
            .unwrap();
    let options = AcceptOptions {
        max_setting_up_per_address: 4,
        anonymous_lifetime: Duration::from_millis(1500),
        ..AcceptOptions::DEFAULT
    };
    let server = common::serve_with("127.0.0.1:0", creds.subscribe(), options).await;
    const JOINER: &str = "127.0.0.2";

    let mut held = Vec::new();
    for _ in 0..options.max_setting_up_per_address {
        held.push(
            anonymous_idle(JOINER, server.addr, tmp.path())
                .await
                .unwrap(),
        );
    }
    // One more from there: closed at once, before its handshake.
    let extra = connect_from(JOINER, server.addr).await;
    let took = until_closed(extra).await;
    assert!(took < Duration::from_secs(1), "closed after {took:?}");
    // A client with a certificate from another address is served meanwhile.
    let url = format!("https://{}", server.addr);
    check(&url, client_cfg(tmp.path(), &alice())).await.unwrap();

    // Idle as they are, the anonymous connections end after their lifetime...
    let start = Instant::now();
    for conn in held {
        until_closed(conn).await;
    }
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(700), "closed after {took:?}");
    // ... and the address is served again.
    let deadline = Instant::now() + BOUND;
    while let Err(e) = anonymous_idle(JOINER, server.addr, tmp.path()).await {
        assert!(Instant::now() < deadline, "never served again: {e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.stop().await;
}

/// One certificate identity holds at most `max_open_per_identity` connections at once: the next
/// is closed right after its handshake, other identities are served meanwhile, and the identity
/// is served again once one of its connections closes. Before, a stolen or compromised
/// certificate could keep open as many idle connections (held by HTTP/2 keepalive) as the
/// process had file descriptors.
#[tokio::test]
async fn one_identity_holds_only_so_many_connections() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let options = AcceptOptions {
        max_open_per_identity: 3,
        ..AcceptOptions::DEFAULT
    };
    let server = common::serve_with("127.0.0.1:0", creds.subscribe(), options).await;
    let alice_cfg = || client_cfg(tmp.path(), &alice());

    let mut held = Vec::new();
    for _ in 0..options.max_open_per_identity {
        held.push(
            idle_h2("127.0.0.1", server.addr, alice_cfg())
                .await
                .unwrap(),
        );
    }
    // One more: closed once the server sees whose it is.
    if let Ok(extra) = idle_h2("127.0.0.1", server.addr, alice_cfg()).await {
        let took = until_closed(extra).await;
        assert!(took < Duration::from_secs(1), "closed after {took:?}");
    }
    // Another identity is served meanwhile.
    let url = format!("https://{}", server.addr);
    let agent = Identity::Agent("web-1".into());
    check(&url, client_cfg(tmp.path(), &agent)).await.unwrap();

    // One closed, alice is served again.
    held.pop();
    let deadline = Instant::now() + BOUND;
    while let Err(e) = check(&url, alice_cfg()).await {
        assert!(Instant::now() < deadline, "never served again: {e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(server.seen.lock().unwrap().contains(&alice()));
    drop(held);
    server.stop().await;
}

/// A peer that reads nothing while the server writes to it is closed once the writes have waited
/// `write_stall` on it; one that reads, however slowly, is not. Before, HTTP/2 keepalive ended
/// such a connection only by sending a GOAWAY that waited behind everything queued for it, and
/// its descriptor, its place among its identity's connections and all that was queued stayed for
/// as long as the peer kept its socket open.
#[tokio::test]
async fn a_peer_that_reads_nothing_is_closed_once_writes_have_waited_on_it_too_long() {
    use tokio_stream::StreamExt;

    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let options = AcceptOptions {
        write_stall: Duration::from_secs(2),
        ..AcceptOptions::DEFAULT
    };
    let mut incoming = toolsrv_tls::incoming_with(listener, creds.subscribe(), options);
    let chunk = vec![0u8; 256 << 10];

    // Reads nothing.
    let silent = idle_h2("127.0.0.1", addr, client_cfg(tmp.path(), &alice()))
        .await
        .unwrap();
    let mut conn = incoming.next().await.unwrap().unwrap();
    let start = Instant::now();
    let written = async {
        loop {
            if let Err(e) = conn.write_all(&chunk).await {
                return e;
            }
        }
    };
    let err: std::io::Error = tokio::time::timeout(BOUND, written)
        .await
        .expect("writes to a peer that reads nothing went on waiting");
    let took = start.elapsed();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    assert!(err.to_string().contains("read nothing"), "{err}");
    assert!(took >= options.write_stall, "closed after {took:?}");
    drop((conn, silent));

    // Reads 8 MiB with a pause of 50 ms after each 256 KiB (5 MB/s: writes wait for the socket's
    // buffers to drain by a third, a few hundred milliseconds at a time).
    let mut slow = idle_h2("127.0.0.1", addr, client_cfg(tmp.path(), &alice()))
        .await
        .unwrap();
    let mut conn = incoming.next().await.unwrap().unwrap();
    let total = 8 << 20;
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 256 << 10];
        let mut read = 0;
        while read < total {
            match slow.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => read += n,
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        read
    });
    for _ in 0..total / chunk.len() {
        tokio::time::timeout(BOUND, conn.write_all(&chunk))
            .await
            .expect("a peer that reads was not written to")
            .expect("a peer that reads was closed");
    }
    conn.flush().await.unwrap();
    let read = tokio::time::timeout(BOUND * 4, reader)
        .await
        .unwrap()
        .unwrap();
    assert!(read >= total, "read {read} of {total}");
}
