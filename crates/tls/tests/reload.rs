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

/// A coordinator certificate from the CA of `dir`, valid from `dates.0` to `dates.1`, written
/// as `<stem>.pem` and `<stem>-key.pem`.
fn coordinator_between(
    dir: &Path,
    stem: &str,
    dates: (std::time::SystemTime, std::time::SystemTime),
) -> TlsFiles {
    toolsrv_testkit::sign_with_ca_between(
        dir,
        stem,
        vec![
            common::uri_san(&Identity::Coordinator),
            rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()),
        ],
        vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ],
        Some(dates),
    )
    .unwrap()
}

/// A PKI in a new directory, and server credentials loaded from its coordinator's files.
fn live_creds() -> (tempfile::TempDir, TlsFiles, ServerCreds) {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let live = files(tmp.path(), &Identity::Coordinator);
    let creds = ServerCreds::new(live.clone()).unwrap();
    (tmp, live, creds)
}

/// Replaces a file the way rotation tools do: write aside, then rename.
fn replace(from: &Path, to: &Path) {
    let tmp = to.with_extension("tmp");
    fs::copy(from, &tmp).unwrap();
    fs::rename(&tmp, to).unwrap();
}

#[tokio::test]
async fn reload_switches_new_handshakes_and_keeps_old_config_on_error() {
    let (tmp, live, creds) = live_creds();
    let dir = tmp.path();
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
    let (tmp, live, creds) = live_creds();
    let dir = tmp.path();
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

/// A coordinator certificate outside its dates (expired, or valid only from tomorrow by this
/// machine's clock) is refused at start and on reload, naming the file and its dates: the
/// previous one stays in use, rather than one no peer takes.
#[tokio::test]
async fn a_certificate_outside_its_dates_is_refused_and_the_old_one_kept() {
    let (tmp, live, creds) = live_creds();
    let dir = tmp.path();
    let server = serve(creds.subscribe()).await;
    let alice_files = files(dir, &alice());
    let raw = || common::raw_client_config(&live.ca, Some((&alice_files.cert, &alice_files.key)));
    let old = common::certs(&live.cert)[0].clone();
    let day = Duration::from_secs(86_400);
    let now = std::time::SystemTime::now();
    for (stem, dates, says) in [
        (
            "expired",
            (now - 3 * day, now - day),
            "this certificate expired at",
        ),
        ("future", (now + day, now + 3 * day), "is valid only from"),
    ] {
        let odd = coordinator_between(dir, stem, dates);
        // At start: refused.
        let err = ServerCreds::new(odd.clone()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("{stem}.pem")) && err.contains(says),
            "{err}"
        );
        // On reload: refused, and the old certificate still served.
        let saved = (fs::read(&live.cert).unwrap(), fs::read(&live.key).unwrap());
        replace(&odd.key, &live.key);
        replace(&odd.cert, &live.cert);
        let err = creds.reload().unwrap_err().to_string();
        assert!(
            err.contains("coordinator.pem") && err.contains(says),
            "{err}"
        );
        assert_eq!(server_leaf(server.addr, raw()).await, old);
        fs::write(&live.cert, &saved.0).unwrap();
        fs::write(&live.key, &saved.1).unwrap();
    }
    creds.reload().unwrap();
    assert_eq!(server_leaf(server.addr, raw()).await, old);
    server.stop().await;
}

/// A key refused for its permissions is read again once they are fixed: `chmod` changes
/// neither the file's size nor its modification time, only its change time and mode.
#[tokio::test]
async fn a_key_made_private_after_a_refusal_is_picked_up() {
    use std::os::unix::fs::PermissionsExt;
    let (tmp, live, creds) = live_creds();
    let dir = tmp.path();
    let stop = CancellationToken::new();
    let watcher = creds.spawn_reload_on_change(Duration::from_millis(20), stop.clone());
    let mut rx = creds.subscribe();
    let next = next_coordinator(dir);
    fs::set_permissions(&next.key, fs::Permissions::from_mode(0o644)).unwrap();
    replace(&next.key, &live.key);
    fs::set_permissions(&live.key, fs::Permissions::from_mode(0o644)).unwrap();
    replace(&next.cert, &live.cert);
    // Refused while every user may read the key.
    assert!(
        tokio::time::timeout(Duration::from_millis(500), rx.changed())
            .await
            .is_err(),
        "a key every user may read was taken"
    );
    fs::set_permissions(&live.key, fs::Permissions::from_mode(0o600)).unwrap();
    tokio::time::timeout(WAIT, rx.changed())
        .await
        .expect("the key made private was never taken")
        .unwrap();
    stop.cancel();
    tokio::time::timeout(WAIT, watcher).await.unwrap().unwrap();
}

/// A certificate issued a moment ago by a machine whose clock runs ahead (cert-manager's, by a
/// few minutes at most) is taken: within five minutes of its start it counts as valid. One
/// further ahead is refused, then taken once the clock gets there, without the files changing
/// again.
#[tokio::test]
async fn a_certificate_not_valid_yet_is_taken_once_the_clock_gets_there() {
    let (tmp, live, creds) = live_creds();
    let dir = tmp.path();
    let now = std::time::SystemTime::now();
    let issue = |stem: &str, ahead: Duration| {
        coordinator_between(dir, stem, (now + ahead, now + Duration::from_secs(86_400)))
    };
    // A minute ahead: within the skew, taken at once.
    let soon = issue("soon", Duration::from_secs(60));
    ServerCreds::new(soon).unwrap();

    // Five minutes and two seconds ahead: refused, then taken by the watcher within seconds.
    let stop = CancellationToken::new();
    let watcher = creds.spawn_reload_on_change(Duration::from_millis(100), stop.clone());
    let mut rx = creds.subscribe();
    let later = issue("later", Duration::from_secs(302));
    replace(&later.key, &live.key);
    replace(&later.cert, &live.cert);
    assert!(creds.reload().is_err(), "not valid yet");
    tokio::time::timeout(Duration::from_secs(10), rx.changed())
        .await
        .expect("taken once the clock got within the skew, without another change")
        .unwrap();
    stop.cancel();
    tokio::time::timeout(WAIT, watcher).await.unwrap().unwrap();
}
