//! Reloadable server credentials: new handshakes see new files, broken
//! files keep the old config.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;
use std::path::Path;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use toolsrv_tls::{Identity, ServerCreds, TlsFiles};

use common::{WAIT, alice, check, client_cfg, files, serve, server_leaf};

/// Issues a second coordinator certificate from the CA of `dir`, with an
/// extra name, into `dir/next`.
fn next_coordinator(dir: &Path) -> TlsFiles {
    let next = dir.join("next");
    fs::create_dir(&next).unwrap();
    fs::copy(dir.join("ca.pem"), next.join("ca.pem")).unwrap();
    fs::copy(dir.join("ca-key.pem"), next.join("ca-key.pem")).unwrap();
    toolsrv_tls::issue(&next, &Identity::Coordinator, &["next.example".into()]).unwrap();
    TlsFiles::in_dir(&next, &Identity::Coordinator)
}

/// Replaces a file the way rotation tools do: write aside, then rename.
fn replace(from: &Path, to: &Path) {
    let tmp = to.with_extension("tmp");
    fs::copy(from, &tmp).unwrap();
    fs::rename(&tmp, to).unwrap();
}

#[tokio::test]
async fn reload_switches_new_handshakes_and_keeps_old_config_on_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::pki(dir);
    let live = files(dir, &Identity::Coordinator);
    let creds = ServerCreds::new(live.clone()).unwrap();
    let server = serve(creds.subscribe()).await;
    let alice_files = files(dir, &alice());
    let raw = || common::raw_client_config(&live.ca, Some((&alice_files.cert, &alice_files.key)));

    let old = common::certs(&live.cert)[0].clone();
    assert_eq!(server_leaf(server.addr, raw()).await, old);

    let next = next_coordinator(dir);
    let new = common::certs(&next.cert)[0].clone();
    assert_ne!(new, old);
    replace(&next.key, &live.key);
    replace(&next.cert, &live.cert);
    creds.reload().unwrap();
    assert_eq!(server_leaf(server.addr, raw()).await, new);
    check(&server.url(), client_cfg(dir, &alice()))
        .await
        .unwrap();

    // A broken certificate file: error naming it, old config kept.
    fs::write(&live.cert, "not a certificate\n").unwrap();
    let err = creds.reload().unwrap_err().to_string();
    assert!(
        err.contains("coordinator.pem") && err.contains("no certificate"),
        "{err}"
    );
    assert_eq!(server_leaf(server.addr, raw()).await, new);

    // A certificate with somebody else's key: same.
    replace(&dir.join("client-alice.pem"), &live.cert);
    let err = creds.reload().unwrap_err().to_string();
    assert!(err.contains("does not match"), "{err}");
    assert_eq!(server_leaf(server.addr, raw()).await, new);
    check(&server.url(), client_cfg(dir, &alice()))
        .await
        .unwrap();
    server.stop().await;
}

#[tokio::test]
async fn file_changes_are_picked_up_by_polling() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::pki(dir);
    let live = files(dir, &Identity::Coordinator);
    let creds = ServerCreds::new(live.clone()).unwrap();
    let stop = CancellationToken::new();
    let watcher = creds.spawn_reload_on_change(Duration::from_millis(20), stop.clone());
    let mut rx = creds.subscribe();
    let before = creds.current();

    let next = next_coordinator(dir);
    replace(&next.key, &live.key);
    replace(&next.cert, &live.cert);
    // Only a successful reload publishes, and the key-first replacement
    // means the first consistent pair seen is the new one.
    tokio::time::timeout(WAIT, rx.changed())
        .await
        .expect("the new certificate was never loaded")
        .unwrap();
    let server = serve(creds.subscribe()).await;
    let raw = common::raw_client_config(
        &live.ca,
        Some((
            &dir.join("client-alice.pem"),
            &dir.join("client-alice-key.pem"),
        )),
    );
    assert_eq!(
        server_leaf(server.addr, raw).await,
        common::certs(&next.cert)[0]
    );
    assert!(!std::sync::Arc::ptr_eq(&before, &creds.current()));

    stop.cancel();
    tokio::time::timeout(WAIT, watcher).await.unwrap().unwrap();
}
