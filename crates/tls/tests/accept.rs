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
    let tcp = TcpStream::connect(server.addr).await.unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(client_cfg(tmp.path(), &alice()))
        .connect(ServerName::IpAddress(server.addr.ip().into()), tcp)
        .await
        .unwrap();
    // The preface and an empty SETTINGS frame, then an idle HTTP/2 connection.
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    tls.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    tls.flush().await.unwrap();
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
