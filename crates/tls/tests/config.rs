//! Loading credentials: each kind of broken file gives an error naming it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;

use toolsrv_tls::{Identity, PkiOptions, Role, TlsFiles, client_config, server_config};

fn setup() -> (tempfile::TempDir, TlsFiles, TlsFiles) {
    let tmp = tempfile::tempdir().unwrap();
    common::pki(tmp.path());
    let coord = TlsFiles::in_dir(tmp.path(), &Identity::Coordinator);
    let alice = TlsFiles::in_dir(tmp.path(), &common::alice());
    (tmp, coord, alice)
}

fn both_errors(files: &TlsFiles) -> [String; 2] {
    [
        server_config(files).unwrap_err().to_string(),
        client_config(files, Role::Coordinator)
            .unwrap_err()
            .to_string(),
    ]
}

#[test]
fn good_files_load() {
    let (_tmp, coord, alice) = setup();
    let server = server_config(&coord).unwrap();
    assert_eq!(server.alpn_protocols, vec![b"h2".to_vec()]);
    let client = client_config(&alice, Role::Coordinator).unwrap();
    assert_eq!(client.alpn_protocols, vec![b"h2".to_vec()]);
    // Works with no process-default provider installed, and installing
    // one twice is harmless.
    toolsrv_tls::install_crypto_provider();
    toolsrv_tls::install_crypto_provider();
}

#[test]
fn missing_file_is_named() {
    let (tmp, coord, _) = setup();
    for field in ["ca", "cert", "key"] {
        let mut files = coord.clone();
        let missing = tmp.path().join(format!("missing-{field}.pem"));
        match field {
            "ca" => files.ca = missing.clone(),
            "cert" => files.cert = missing.clone(),
            _ => files.key = missing.clone(),
        }
        for err in both_errors(&files) {
            assert!(err.starts_with("cannot read"), "{err}");
            assert!(err.contains(&*missing.to_string_lossy()), "{err}");
        }
    }
}

#[test]
fn empty_and_swapped_files_are_explained() {
    let (tmp, coord, _) = setup();
    let empty = tmp.path().join("empty.pem");
    fs::write(&empty, "").unwrap();

    let files = TlsFiles {
        cert: empty.clone(),
        ..coord.clone()
    };
    for err in both_errors(&files) {
        assert!(err.contains("empty.pem: no certificate in it"), "{err}");
    }
    let files = TlsFiles {
        key: empty.clone(),
        ..coord.clone()
    };
    for err in both_errors(&files) {
        assert!(err.contains("empty.pem: no private key in it"), "{err}");
    }
    let files = TlsFiles {
        ca: empty.clone(),
        ..coord.clone()
    };
    for err in both_errors(&files) {
        assert!(err.contains("empty.pem: no certificate in it"), "{err}");
    }
    // Certificate and key given the wrong way round.
    let files = TlsFiles {
        cert: coord.key.clone(),
        key: coord.cert.clone(),
        ..coord.clone()
    };
    for err in both_errors(&files) {
        assert!(err.contains("no certificate in it"), "{err}");
    }
}

#[test]
fn key_of_another_certificate_is_refused() {
    let (_tmp, coord, alice) = setup();
    let files = TlsFiles {
        key: alice.key.clone(),
        ..coord
    };
    for err in both_errors(&files) {
        assert!(err.contains("client-alice-key.pem"), "{err}");
        assert!(err.contains("does not match the certificate"), "{err}");
    }
}

#[test]
fn certificate_from_another_ca_is_refused() {
    let (tmp, coord, _) = setup();
    let other = tmp.path().join("other");
    toolsrv_tls::init(&PkiOptions::new(&other)).unwrap();
    let files = TlsFiles {
        ca: other.join("ca.pem"),
        ..coord
    };
    for err in both_errors(&files) {
        assert!(err.contains("coordinator.pem"), "{err}");
        assert!(err.contains("not signed by the CA"), "{err}");
    }
}

#[test]
fn client_certificate_cannot_serve() {
    let (_tmp, _, alice) = setup();
    let err = server_config(&alice).unwrap_err().to_string();
    assert!(
        err.contains("client/alice") && err.contains("coordinator identity"),
        "{err}"
    );
}

/// A certificate or key file cut short (a copy interrupted, a half-written rotation) is said
/// in words, not as the byte values of the line it lacks.
#[test]
fn a_file_cut_short_is_explained_in_words() {
    use std::os::unix::fs::PermissionsExt;
    let (tmp, coord, _) = setup();
    let cut = |from: &std::path::Path, name: &str| {
        let text = fs::read_to_string(from).unwrap();
        let path = tmp.path().join(name);
        fs::write(&path, &text[..text.len() / 2]).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        path
    };
    let files = TlsFiles {
        cert: cut(&coord.cert, "cut-cert.pem"),
        ..coord.clone()
    };
    for err in both_errors(&files) {
        assert!(
            err.contains("no `-----END CERTIFICATE-----` line: the file is cut short"),
            "{err}"
        );
    }
    let files = TlsFiles {
        key: cut(&coord.key, "cut-key.pem"),
        ..coord.clone()
    };
    for err in both_errors(&files) {
        assert!(err.contains("-----END") && !err.contains("[45, "), "{err}");
    }
}
