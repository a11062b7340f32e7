//! `toolsrv` as a command: help, flag errors, and the development PKI.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

fn toolsrv() -> Command {
    Command::new(env!("CARGO_BIN_EXE_toolsrv"))
}

/// `toolsrv pki init DIR ARGS...`, run to its end.
fn pki_init(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    toolsrv()
        .args(["pki", "init"])
        .arg(dir)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn help_lists_every_role() {
    let out = toolsrv().arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for cmd in ["coordinator", "agent", "pki", "up"] {
        assert!(help.contains(cmd), "{cmd} missing from:\n{help}");
    }
}

#[test]
fn pki_init_writes_a_usable_layout_and_is_additive() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let out = pki_init(&pki, &["--agents", "a,b", "--clients", "alice"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in [
        "ca.pem",
        "coordinator.pem",
        "coordinator-key.pem",
        "agent-a.pem",
        "agent-b-key.pem",
        "client-alice.pem",
    ] {
        assert!(pki.join(f).exists(), "{f} missing");
    }
    let mode = std::fs::metadata(pki.join("agent-a-key.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let ca = std::fs::read(pki.join("ca.pem")).unwrap();
    let out = pki_init(&pki, &["--agents", "c"]);
    assert!(out.status.success());
    assert_eq!(
        std::fs::read(pki.join("ca.pem")).unwrap(),
        ca,
        "the CA is kept"
    );
    assert!(pki.join("agent-c.pem").exists());
    // A name for the coordinator, asked for again later, is added to its certificate (the
    // key stays): the names a coordinator is reached by grow with the fleet.
    let key = std::fs::read(pki.join("coordinator-key.pem")).unwrap();
    for _ in 0..2 {
        let out = pki_init(&pki, &["--coordinator-names", "coord-1.example,10.0.0.9"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let pem = std::fs::read(pki.join("coordinator.pem")).unwrap();
    let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).unwrap();
    let cert = pem.parse_x509().unwrap();
    let sans = format!(
        "{:?}",
        cert.subject_alternative_name().unwrap().unwrap().value
    );
    for name in ["localhost", "coord-1.example", "[10, 0, 0, 9]"] {
        assert!(sans.contains(name), "{name} in {sans}");
    }
    assert_eq!(
        std::fs::read(pki.join("coordinator-key.pem")).unwrap(),
        key,
        "the key stays"
    );
    let mode = std::fs::metadata(pki.join("coordinator.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o644);
    let out = pki_init(&pki, &["--agents", "bad/id"]);
    assert!(!out.status.success());
}

#[test]
fn bad_flags_are_explained() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.pem");
    let out = toolsrv()
        .args(["coordinator", "--listen", "127.0.0.1:0", "--tools"])
        .arg(dir.path())
        .arg("--ca")
        .arg(&missing)
        .arg("--cert")
        .arg(&missing)
        .arg("--key")
        .arg(&missing)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nope.pem"), "the missing file is named: {err}");
    let out = toolsrv()
        .args([
            "agent",
            "--coordinator",
            "https://127.0.0.1:1",
            "--host-id",
            "x",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "missing TLS flags must fail");
}

/// A bad value that came from the environment names its variable, not only the flag: a value
/// that is not valid, and one that is not UTF-8 (clap said only "invalid UTF-8 was detected").
#[test]
fn a_bad_value_from_the_environment_names_the_variable() {
    use std::os::unix::ffi::OsStringExt;
    let out = toolsrv()
        .args(["agent", "--print-config"])
        .env("TOOLSRV_LABELS", "role=web,oops")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--label is not on the command line: the value comes from the environment variable TOOLSRV_LABELS"),
        "{err}"
    );
    let out = toolsrv()
        .args(["pki", "init"])
        .arg(tempfile::tempdir().unwrap().path())
        .env(
            "TOOLSRV_LOG",
            std::ffi::OsString::from_vec(b"info\xff".to_vec()),
        )
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the environment variable TOOLSRV_LOG is not UTF-8"),
        "{err}"
    );
    // The client names it too (and keeps its usage exit code).
    let out = Command::new(env!("CARGO_BIN_EXE_toolsrv"))
        .arg0("toolctl")
        .arg("hosts")
        .env(
            "TOOLSRV_ADDR",
            std::ffi::OsString::from_vec(b"https://\xff".to_vec()),
        )
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the environment variable TOOLSRV_ADDR is not UTF-8"),
        "{err}"
    );
}

/// A label the coordinator would refuse in the agent's hello stops the agent at start, naming
/// it, instead of a link refused again at every retry.
#[test]
fn an_agent_label_the_coordinator_would_refuse_stops_it_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let pem = dir.path().join("x.pem");
    for bad in ["ro le=web", "role=a\u{7}b"] {
        // Bounded: an agent that does not stop at start runs until it is stopped.
        let out = Command::new("timeout")
            .args(["10", env!("CARGO_BIN_EXE_toolsrv")])
            .args([
                "agent",
                "--coordinator",
                "https://127.0.0.1:1",
                "--host-id",
                "x",
            ])
            .arg("--ca")
            .arg(&pem)
            .arg("--cert")
            .arg(&pem)
            .arg("--key")
            .arg(&pem)
            .arg(format!("--label={bad}"))
            .env("TOOLSRV_STATE_DIR", dir.path().join("state"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("--label") && err.contains("label"), "{err}");
        assert!(
            !err.contains("x.pem"),
            "refused before the files are read: {err}"
        );
    }
}

/// A directory another local user made beforehand (`/tmp/state` before the service started),
/// or one under a directory they own, is refused by name: for the development PKI they could
/// put a CA of theirs in it, for an agent's state the catalog of tools it runs as its user.
#[test]
fn a_directory_another_user_owns_is_refused_for_the_pki_and_the_agents_state() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test gives directories to another user, which needs root (as CI runs)"
    );
    let dir = tempfile::tempdir().unwrap();
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let out = pki_init(&theirs, &["--agents", "x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&theirs.display().to_string()) && err.contains("uid 65534"),
        "{err}"
    );
    assert!(!theirs.join("ca-key.pem").exists(), "nothing written in it");

    // The agent, with a good PKI, and its state in their directory or beneath it.
    let pki = dir.path().join("pki");
    let made = pki_init(&pki, &["--agents", "x"]);
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    // A link of theirs on the way to a directory of ours.
    let ours = dir.path().join("ours");
    std::fs::create_dir(&ours).unwrap();
    let their_link = dir.path().join("their-link");
    std::os::unix::fs::symlink(&ours, &their_link).unwrap();
    std::os::unix::fs::lchown(&their_link, Some(65534), None).unwrap();
    let our_link = dir.path().join("state-link");
    std::os::unix::fs::symlink(&their_link, &our_link).unwrap();
    let out = pki_init(&our_link, &["--agents", "x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("symbolic link") && err.contains("uid 65534"),
        "{err}"
    );

    // The coordinator's state (revocations, join tokens) and the agent's, in their directory
    // or beneath it. Bounded: a role that does not stop at start runs until it is stopped.
    let coordinator: Vec<std::ffi::OsString> = vec![
        "coordinator".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--tools".into(),
        dir.path().into(),
        "--ca".into(),
        pki.join("ca.pem").into(),
        "--cert".into(),
        pki.join("coordinator.pem").into(),
        "--key".into(),
        pki.join("coordinator-key.pem").into(),
    ];
    let agent: Vec<std::ffi::OsString> = vec![
        "agent".into(),
        "--coordinator".into(),
        "https://127.0.0.1:1".into(),
        "--host-id".into(),
        "x".into(),
        "--ca".into(),
        pki.join("ca.pem").into(),
        "--cert".into(),
        pki.join("agent-x.pem").into(),
        "--key".into(),
        pki.join("agent-x-key.pem").into(),
    ];
    for (role, sub) in [(&coordinator, "coordinator"), (&agent, "state")] {
        for state in [theirs.clone(), theirs.join(sub)] {
            let out = Command::new("timeout")
                .args(["10", env!("CARGO_BIN_EXE_toolsrv")])
                .args(role)
                .arg("--state-dir")
                .arg(&state)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{}: {err}", state.display());
            assert!(
                err.contains(&theirs.display().to_string()) && err.contains("uid 65534"),
                "{}: {err}",
                state.display()
            );
            // Refused before anything is made there.
            assert!(
                state == theirs || !state.exists(),
                "{} was made",
                state.display()
            );
        }
    }
}

/// A configuration file's bad label, CPU, memory or network value stops the role naming the
/// file, the line and the key (exit 2), as every other bad value does: checked by the flag's
/// own parser. Before, a bad label stopped the agent later, naming neither, with exit 1, and
/// `--print-config` took `sandbox_cpu = true`.
#[test]
fn bad_values_of_a_configuration_file_are_named_by_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.toml");
    std::fs::write(
        &file,
        "coordinator = \"https://127.0.0.1:1\"\nhost_id = \"x\"\n\
         label = [\"role=web\", \"zone\"]\nsandbox_cpu = true\nsandbox_memory = \"lots\"\n\
         sandbox_network = \"maybe\"\n",
    )
    .unwrap();
    let out = toolsrv()
        .args(["agent", "--config"])
        .arg(&file)
        .arg("--print-config")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for (line, key, why) in [
        (3, "label", "expected KEY=VALUE"),
        (4, "sandbox_cpu", "not a number of cores"),
        (5, "sandbox_memory", "unknown unit"),
        (6, "sandbox_network", "use allow or deny"),
    ] {
        let at = format!("agent.toml:{line}: `{key}`");
        assert!(
            err.lines().any(|l| l.contains(&at) && l.contains(why)),
            "{at} ... {why} in:\n{err}"
        );
    }
}
