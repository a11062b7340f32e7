//! End-to-end mTLS through `incoming` and `connect`: identities reach the
//! handler, and every kind of wrong peer is refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use toolsrv_tls::{Identity, PkiOptions, Role, ServerCreds, TlsFiles, client_config};

use common::{WAIT, alice, check, client_cfg, files, serve};

#[tokio::test]
async fn client_identity_reaches_the_handler() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let server = serve(creds.subscribe()).await;

    check(&server.url(), client_cfg(tmp.path(), &alice()))
        .await
        .unwrap();
    // An agent certificate works as a client too; the role is what differs.
    let agent = Identity::Agent("web-1".into());
    check(&server.url(), client_cfg(tmp.path(), &agent))
        .await
        .unwrap();
    assert_eq!(*server.seen.lock().unwrap(), vec![alice(), agent]);

    // `localhost` is in the coordinator certificate as well.
    let url = format!("https://localhost:{}", server.addr.port());
    check(&url, client_cfg(tmp.path(), &alice())).await.unwrap();
    server.stop().await;
}

#[tokio::test]
async fn lazy_channel_connects_on_first_call() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let server = serve(creds.subscribe()).await;
    let channel =
        toolsrv_tls::lazy_channel(&server.url(), client_cfg(tmp.path(), &alice())).unwrap();
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    let call = client.check(tonic_health::pb::HealthCheckRequest {
        service: String::new(),
    });
    tokio::time::timeout(WAIT, call).await.unwrap().unwrap();
    assert_eq!(*server.seen.lock().unwrap(), vec![alice()]);
}

#[tokio::test]
async fn a_silent_connection_does_not_block_others() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let server = serve(creds.subscribe()).await;
    // Connects and never sends a ClientHello; another one sends garbage.
    let _silent = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let mut garbage = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let quick = tokio::time::timeout(
        Duration::from_secs(5),
        check(&server.url(), client_cfg(tmp.path(), &alice())),
    )
    .await
    .expect("a silent peer blocked the accept loop");
    quick.unwrap();
}

#[tokio::test]
async fn client_from_another_ca_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    let evil = tmp.path().join("evil");
    common::pki(&good);
    let mut opts = PkiOptions::new(&evil);
    opts.clients = vec!["alice".into()];
    toolsrv_tls::init(&opts).unwrap();

    let creds = ServerCreds::new(files(&good, &Identity::Coordinator)).unwrap();
    let server = serve(creds.subscribe()).await;
    // Trusts the real server, presents a same-named cert from another CA.
    let evil_alice = TlsFiles::in_dir(&evil, &alice());
    let cfg = common::raw_client_config(
        &good.join("ca.pem"),
        Some((&evil_alice.cert, &evil_alice.key)),
    );
    assert!(check(&server.url(), cfg).await.is_err());
    // Our own loader refuses that mix up front, naming the file.
    let mixed = TlsFiles {
        ca: good.join("ca.pem"),
        ..evil_alice
    };
    let err = client_config(&mixed, Role::Coordinator)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not signed by the CA"), "{err}");
    assert!(server.seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn client_without_certificate_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let server = serve(creds.subscribe()).await;
    let cfg = common::raw_client_config(&tmp.path().join("ca.pem"), None);
    assert!(check(&server.url(), cfg).await.is_err());
    assert!(server.seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn client_certificate_without_identity_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::pki(dir);
    // A certificate from the right CA, with clientAuth but no toolsrv URI.
    let nobody = common::sign_custom(
        dir,
        "nobody",
        vec![rcgen::SanType::DnsName(
            "nobody.example".try_into().unwrap(),
        )],
        vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
    );

    let creds = ServerCreds::new(files(dir, &Identity::Coordinator)).unwrap();
    let server = serve(creds.subscribe()).await;
    let cfg = common::raw_client_config(&nobody.ca, Some((&nobody.cert, &nobody.key)));
    assert!(check(&server.url(), cfg).await.is_err());
    assert!(server.seen.lock().unwrap().is_empty());

    let err = client_config(&nobody, Role::Coordinator)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no toolsrv:// URI SAN"), "{err}");
}

#[tokio::test]
async fn server_with_an_agent_certificate_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::pki(dir);
    // An agent identity in a certificate webpki would accept for a server
    // at 127.0.0.1 (serverAuth, IP SAN): only the role check can refuse it.
    let rogue = Identity::Agent("rogue".into());
    let rogue_files = common::sign_custom(
        dir,
        "rogue",
        vec![
            common::uri_san(&rogue),
            rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()),
        ],
        vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ],
    );

    let err = toolsrv_tls::server_config(&rogue_files)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("agent/rogue") && err.contains("coordinator"),
        "{err}"
    );
    // And so is a plain agent certificate from `pki`.
    let web1 = files(dir, &Identity::Agent("web-1".into()));
    assert!(toolsrv_tls::server_config(&web1).is_err());

    let cfg = common::raw_server_config(&rogue_files.ca, &rogue_files.cert, &rogue_files.key);
    let (_tx, rx) = watch::channel(cfg);
    let server = serve(rx).await;
    let err = check(&server.url(), client_cfg(dir, &alice()))
        .await
        .unwrap_err();
    assert!(err.contains("expected a coordinator"), "{err}");
    assert!(server.seen.lock().unwrap().is_empty());

    // The same server passes when an agent is what we expect.
    let expect_agent = client_config(&files(dir, &alice()), Role::Agent).unwrap();
    check(&server.url(), expect_agent).await.unwrap();
}

#[tokio::test]
async fn host_name_is_checked() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    // Linux routes all of 127/8 to loopback; 127.0.0.2 is not in the
    // coordinator certificate.
    let server = common::serve_on("127.0.0.2:0", creds.subscribe()).await;
    let err = check(&server.url(), client_cfg(tmp.path(), &alice()))
        .await
        .unwrap_err();
    assert!(err.contains("127.0.0.2"), "{err}");
    assert!(server.seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn urls_must_be_https() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    for url in [
        "http://127.0.0.1:1",
        "127.0.0.1:1",
        "https://",
        "https://bad host:1",
    ] {
        let err = toolsrv_tls::connect(url, client_cfg(tmp.path(), &alice()))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("invalid URL"), "{url}: {err}");
    }
    // Nothing listens on port 1: a clear connect error, not a hang.
    let err = toolsrv_tls::connect("https://127.0.0.1:1", client_cfg(tmp.path(), &alice()))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cannot connect to https://127.0.0.1:1"),
        "{err}"
    );
}

#[tokio::test]
async fn a_reloading_channel_presents_renewed_certificates_after_a_reconnect() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let server = serve(creds.subscribe()).await;
    let addr = server.addr;

    // The files the channel reads: alice's for now.
    let current = tmp.path().join("current");
    std::fs::create_dir(&current).unwrap();
    let install = |id: &Identity| {
        let from = files(tmp.path(), id);
        std::fs::copy(&from.ca, current.join("ca.pem")).unwrap();
        std::fs::copy(&from.cert, current.join("cert.pem")).unwrap();
        std::fs::copy(&from.key, current.join("key.pem")).unwrap();
    };
    install(&alice());
    let live = TlsFiles {
        ca: current.join("ca.pem"),
        cert: current.join("cert.pem"),
        key: current.join("key.pem"),
    };
    let channel = toolsrv_tls::connect_reloading(&server.url(), &live, Role::Coordinator)
        .await
        .unwrap();
    let health = |channel: tonic::transport::Channel| async move {
        tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
    };
    health(channel.clone()).await.unwrap();
    assert_eq!(*server.seen.lock().unwrap(), vec![alice()]);

    // Renewal writes other credentials (here another identity, to tell them apart), then the
    // connection drops: the channel's next connection reads the files again.
    let agent = Identity::Agent("web-1".into());
    install(&agent);
    server.stop().await;
    let server = common::serve_on(&addr.to_string(), creds.subscribe()).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while health(channel.clone()).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "no reconnect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(*server.seen.lock().unwrap(), vec![agent]);
    server.stop().await;
}

#[tokio::test]
async fn client_certificate_without_the_client_auth_usage_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::pki(dir);
    let creds = ServerCreds::new(files(dir, &Identity::Coordinator)).unwrap();
    let server = serve(creds.subscribe()).await;

    // alice's identity from the right CA, but no EKU at all (webpki takes that as "any
    // purpose"), or only serverAuth.
    for (stem, ekus) in [
        ("alice-no-eku", vec![]),
        (
            "alice-server-only",
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth],
        ),
    ] {
        let bad = common::sign_custom(dir, stem, vec![common::uri_san(&alice())], ekus);
        let cfg = common::raw_client_config(&bad.ca, Some((&bad.cert, &bad.key)));
        assert!(check(&server.url(), cfg).await.is_err(), "{stem} got in");
        // Our own loader says so up front, naming the file.
        let err = client_config(&bad, Role::Coordinator)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{stem}.pem")) && err.contains("clientAuth"),
            "{err}"
        );
    }
    assert!(server.seen.lock().unwrap().is_empty());
    // The PKI's own certificates pass.
    check(&server.url(), client_cfg(dir, &alice()))
        .await
        .unwrap();
}

#[tokio::test]
async fn coordinator_certificate_without_the_server_auth_usage_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::pki(dir);
    for (stem, ekus) in [
        (
            "coordinator-client-only",
            vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth],
        ),
        ("coordinator-no-eku", vec![]),
    ] {
        let bad = common::sign_custom(
            dir,
            stem,
            vec![
                common::uri_san(&Identity::Coordinator),
                rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()),
            ],
            ekus,
        );
        let err = toolsrv_tls::server_config(&bad).unwrap_err().to_string();
        assert!(
            err.contains(&format!("{stem}.pem")) && err.contains("serverAuth"),
            "{err}"
        );

        let cfg = common::raw_server_config(&bad.ca, &bad.cert, &bad.key);
        let (_tx, rx) = watch::channel(cfg);
        let server = serve(rx).await;
        let err = check(&server.url(), client_cfg(dir, &alice()))
            .await
            .unwrap_err();
        // webpki itself refuses an EKU without serverAuth; we refuse a missing EKU.
        assert!(
            err.contains("serverAuth") || err.contains("server authentication"),
            "{stem}: {err}"
        );
        assert!(server.seen.lock().unwrap().is_empty());
    }
}

/// A service that takes every request and never answers: a server that is stuck, not gone (its
/// connection still answers HTTP/2 pings).
#[derive(Clone)]
struct Wedged;

impl tonic::server::NamedService for Wedged {
    const NAME: &'static str = "grpc.health.v1.Health";
}

impl tower::Service<tonic::codegen::http::Request<tonic::body::Body>> for Wedged {
    type Response = tonic::codegen::http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Pending<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
        std::future::pending()
    }
}

/// With `connect_reloading_within`, a request to a server that never begins its answer fails
/// after that long; without it, it would wait for as long as the connection lives.
#[tokio::test]
async fn a_request_to_a_stuck_server_fails_after_the_answer_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let creds = ServerCreds::new(files(tmp.path(), &Identity::Coordinator)).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let incoming = toolsrv_tls::incoming_with(listener, creds.subscribe(), Default::default());
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(Wedged)
            .serve_with_incoming(incoming),
    );
    let ask = |channel: tonic::transport::Channel| async move {
        tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
    };
    let alice = files(tmp.path(), &alice());
    let within = Duration::from_secs(1);
    let channel = toolsrv_tls::connect_reloading_within(&url, &alice, Role::Coordinator, within)
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let status = tokio::time::timeout(WAIT, ask(channel))
        .await
        .expect("the request ends by itself")
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Cancelled, "{status:?}");
    assert_eq!(status.message(), "Timeout expired");
    assert!(started.elapsed() >= within);

    // Without the bound, the same request is still waiting.
    let channel = toolsrv_tls::connect_reloading(&url, &alice, Role::Coordinator)
        .await
        .unwrap();
    let waiting = tokio::time::timeout(Duration::from_secs(3), ask(channel)).await;
    assert!(waiting.is_err(), "{waiting:?}");
    server.abort();
}
