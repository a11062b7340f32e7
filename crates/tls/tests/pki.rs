//! `init` and `issue`: files, modes, identities, idempotence, validation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use toolsrv_tls::{Identity, PkiOptions, TlsFiles, identity_of};

fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let bytes = fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect()
}

fn identity_in(path: &Path) -> Identity {
    identity_of(&common::certs(path)[0]).unwrap()
}

#[test]
fn init_writes_everything_with_private_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pki");
    let mut opts = PkiOptions::new(&dir);
    opts.agents = vec!["web-1".into(), "db.2".into()];
    opts.clients = vec!["alice".into()];
    opts.coordinator_names = vec!["coord.example.com".into(), "10.1.2.3".into()];
    let written = toolsrv_tls::init(&opts).unwrap();

    let names: Vec<String> = written
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "ca.pem",
        "ca-key.pem",
        "coordinator.pem",
        "coordinator-key.pem",
        "agent-web-1.pem",
        "agent-web-1-key.pem",
        "agent-db.2.pem",
        "agent-db.2-key.pem",
        "client-alice.pem",
        "client-alice-key.pem",
    ] {
        assert!(names.contains(&want.to_string()), "{want} not in {names:?}");
    }
    assert_eq!(names.len(), 10, "{names:?}");

    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    for p in &written {
        if p.to_string_lossy().ends_with("-key.pem") {
            assert_eq!(mode(p), 0o600, "{}", p.display());
        }
    }

    for id in [
        Identity::Coordinator,
        Identity::Agent("web-1".into()),
        Identity::Agent("db.2".into()),
        Identity::Client("alice".into()),
    ] {
        let files = TlsFiles::in_dir(&dir, &id);
        assert_eq!(identity_in(&files.cert), id);
    }
    assert!(identity_of(&common::certs(&dir.join("ca.pem"))[0]).is_err());

    // The coordinator certificate serves its default and extra names.
    let der = &common::certs(&dir.join("coordinator.pem"))[0];
    let (_, cert) = x509_parser::parse_x509_certificate(der).unwrap();
    let sans: Vec<String> = cert
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names
        .iter()
        .map(|n| n.to_string())
        .collect();
    for want in [
        "DNSName(localhost)",
        "DNSName(coord.example.com)",
        "URI(toolsrv://coordinator)",
    ] {
        assert!(sans.iter().any(|s| s == want), "{want} not in {sans:?}");
    }
    assert_eq!(
        sans.iter().filter(|s| s.starts_with("IPAddress")).count(),
        3,
        "{sans:?}"
    );
}

#[test]
fn init_again_is_additive_and_keeps_the_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::pki(dir);
    let before = snapshot(dir);

    // Same options again: nothing written, nothing changed.
    let mut opts = PkiOptions::new(dir);
    opts.agents = vec!["web-1".into()];
    opts.clients = vec!["alice".into()];
    assert!(toolsrv_tls::init(&opts).unwrap().is_empty());
    assert_eq!(snapshot(dir), before);

    // One more agent: only its two files appear.
    opts.agents.push("c".into());
    let written = toolsrv_tls::init(&opts).unwrap();
    assert_eq!(
        written,
        vec![dir.join("agent-c.pem"), dir.join("agent-c-key.pem")]
    );
    let after = snapshot(dir);
    for (path, bytes) in &before {
        assert_eq!(after.get(path), Some(bytes), "{} changed", path.display());
    }
    assert_eq!(after.len(), before.len() + 2);

    // The new agent chains to the same CA: the coordinator accepts it.
    let files = TlsFiles::in_dir(dir, &Identity::Agent("c".into()));
    assert_eq!(identity_in(&files.cert), Identity::Agent("c".into()));
    toolsrv_tls::client_config(&files, toolsrv_tls::Role::Coordinator).unwrap();
}

#[test]
fn invalid_names_are_rejected_before_writing() {
    for (agents, clients, names) in [
        (vec!["a/b"], vec![], vec![]),
        (vec![""], vec![], vec![]),
        (vec!["ok"], vec!["bad name"], vec![]),
        (vec![], vec!["../x"], vec![]),
        (vec![], vec![], vec!["not a host"]),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pki");
        let mut opts = PkiOptions::new(&dir);
        opts.agents = agents.iter().map(|s| s.to_string()).collect();
        opts.clients = clients.iter().map(|s| s.to_string()).collect();
        opts.coordinator_names = names.iter().map(|s| s.to_string()).collect();
        let err = toolsrv_tls::init(&opts).unwrap_err();
        assert!(err.to_string().starts_with("invalid "), "{err}");
        assert!(!dir.exists(), "{err}: wrote files anyway");
    }
    let long = "a".repeat(254);
    let mut opts = PkiOptions::new(tempfile::tempdir().unwrap().path().join("x"));
    opts.agents = vec![long];
    assert!(toolsrv_tls::init(&opts).is_err());
    opts.agents.clear();
    opts.valid_days = 0;
    assert!(toolsrv_tls::init(&opts).is_err());
}

#[test]
fn half_pairs_are_reported_not_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::pki(dir);
    fs::remove_file(dir.join("client-alice-key.pem")).unwrap();
    let mut opts = PkiOptions::new(dir);
    opts.clients = vec!["alice".into()];
    let err = toolsrv_tls::init(&opts).unwrap_err().to_string();
    assert!(
        err.contains("client-alice-key.pem") && err.contains("missing"),
        "{err}"
    );

    fs::remove_file(dir.join("ca-key.pem")).unwrap();
    let err = toolsrv_tls::init(&PkiOptions::new(dir))
        .unwrap_err()
        .to_string();
    assert!(err.contains("ca-key.pem"), "{err}");
}

#[test]
fn issue_needs_a_ca_and_adds_names() {
    let tmp = tempfile::tempdir().unwrap();
    let err = toolsrv_tls::issue(tmp.path(), &Identity::Coordinator, &[]).unwrap_err();
    assert!(err.to_string().contains("pki init"), "{err}");

    common::pki(tmp.path());
    let other = tmp.path().join("other");
    fs::create_dir(&other).unwrap();
    fs::copy(tmp.path().join("ca.pem"), other.join("ca.pem")).unwrap();
    fs::copy(tmp.path().join("ca-key.pem"), other.join("ca-key.pem")).unwrap();
    let written =
        toolsrv_tls::issue(&other, &Identity::Agent("x".into()), &["127.0.0.1".into()]).unwrap();
    assert_eq!(written.len(), 2);
    let files = TlsFiles {
        ca: tmp.path().join("ca.pem"),
        ..TlsFiles::in_dir(&other, &Identity::Agent("x".into()))
    };
    assert_eq!(identity_in(&files.cert), Identity::Agent("x".into()));
    toolsrv_tls::client_config(&files, toolsrv_tls::Role::Coordinator).unwrap();
}

#[test]
fn names_are_issued_in_lowercase() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut opts = PkiOptions::new(dir);
    opts.agents = vec!["Web-1".into()];
    opts.clients = vec!["Alice".into()];
    toolsrv_tls::init(&opts).unwrap();
    let web1 = TlsFiles::in_dir(dir, &Identity::Agent("web-1".into()));
    assert_eq!(identity_in(&web1.cert), Identity::Agent("web-1".into()));
    // However the caller spells it, it is the same identity and the same files.
    assert_eq!(
        TlsFiles::in_dir(dir, &Identity::Agent("WEB-1".into())),
        web1
    );
    let alice = TlsFiles::in_dir(dir, &Identity::Client("alice".into()));
    assert_eq!(identity_in(&alice.cert), Identity::Client("alice".into()));

    // Running it again with another spelling adds nothing.
    opts.agents = vec!["web-1".into()];
    opts.clients = vec!["ALICE".into()];
    assert!(toolsrv_tls::init(&opts).unwrap().is_empty());
    let written = toolsrv_tls::issue(dir, &Identity::Client("Bob".into()), &[]).unwrap();
    assert!(written[0].ends_with("client-bob.pem"), "{written:?}");
    assert_eq!(identity_in(&written[0]), Identity::Client("bob".into()));
}
