//! Revocation and credential reloads with real processes: `toolctl revoke` closes a revoked
//! agent's link and a revoked client's streams within seconds and refuses both afterwards, a CRL
//! refuses the certificates it lists (and closes their connections), and replaced certificate,
//! key and CA files are taken up without dropping the connections already open.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use toolsrv_tests::{
    AgentSpec, Fleet, LineWatch, Pki, assert_exit, bin, finish_child, run_bounded, text, wait_for,
};
use toolsrv_tls::Identity;

/// A tool that prints `started`, then runs for a minute unless ended.
const SLOW: &str = r#"{"description": "Run a while", "cmd": "echo started; sleep 60"}"#;

/// [`SLOW`] for one test only, so that its process can be told from the others' (`sleep 61`).
const SLOWER: &str = r#"{"description": "Run a while longer", "cmd": "echo started; sleep 61"}"#;

fn spawn(mut cmd: Command) -> Child {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("cannot start toolctl")
}

/// Waits until `child` has ended by itself (within `limit`) and returns its output.
fn ended_within(child: Child, limit: Duration, what: &str) -> std::process::Output {
    let started = Instant::now();
    let out = finish_child(child, limit + Duration::from_secs(5));
    assert!(
        started.elapsed() < limit,
        "{what} took {:?} to end: {}",
        started.elapsed(),
        text(&out.stderr)
    );
    out
}

/// A fleet whose coordinator keeps its state in `work/state` and takes alice as administrator.
fn admin_fleet(agents: &[&str], extra: &[&str]) -> Fleet {
    let mut fleet = Fleet::new(agents);
    fleet.tool("slow.meta", SLOW, false);
    fleet.tool("slower.meta", SLOWER, false);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    let state = format!("--state-dir={}", fleet.work.path().join("state").display());
    let audit = fleet.audit_arg();
    let mut args = vec!["--admin=alice", state.as_str(), audit.as_str()];
    args.extend_from_slice(extra);
    fleet.start_coordinator(&args);
    for agent in agents {
        fleet.start_agent(agent, &AgentSpec::default());
    }
    fleet.wait_online(agents, "hello");
    fleet
}

fn host_state(fleet: &Fleet, host: &str) -> String {
    fleet
        .hosts()
        .iter()
        .find(|h| h["host_id"] == host)
        .map(|h| h["state"].as_str().unwrap_or_default().to_string())
        .unwrap_or_default()
}

fn coordinator_log(fleet: &Fleet) -> String {
    fleet.coordinator.as_ref().unwrap().log()
}

#[test]
fn revoking_closes_a_live_agent_and_a_live_client_and_refuses_them_after() {
    let mut fleet = admin_fleet(&["a", "b"], &[]);

    // bob: a watch stream and a running call; alice: a running call on host a.
    let bob_watch = spawn(fleet.toolctl_command("client-bob", &["watch", "--json"]));
    let bob_call = spawn(fleet.toolctl_command("client-bob", &["call", "b", "slow"]));
    let alice_call = spawn(fleet.toolctl_command("client-alice", &["call", "a", "slow"]));
    // Time for the calls to start on their hosts.
    std::thread::sleep(Duration::from_secs(3));

    // Revoke the client: both of its streams end within seconds.
    let out = fleet.toolctl(&["revoke", "client/bob", "--reason", "laptop stolen"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("revoked client/bob"),
        "{}",
        text(&out.stderr)
    );
    let out = ended_within(bob_call, Duration::from_secs(5), "bob's call");
    assert!(!out.status.success(), "bob's call went on: {out:?}");
    let out = ended_within(bob_watch, Duration::from_secs(5), "bob's watch");
    assert!(!out.status.success());

    // A fresh connection of bob's: refused, naming the revocation.
    let out = fleet.toolctl_as("client-bob", &["hosts"], None);
    assert_exit(&out, 77, &["client/bob is revoked", "laptop stolen"]);
    let out = fleet.toolctl_as("client-bob", &["call", "a", "hello"], None);
    assert_exit(&out, 77, &[]);

    // Revoke an agent, in another case: its link ends, its call ends with a status, and the
    // host leaves the fleet (forgotten once offline, long before --forget-offline-after-secs)
    // and stays out (the agent's retries are refused); a call to it says why.
    let alice_watch = LineWatch::start(fleet.toolctl_command("client-alice", &["watch", "--json"]));
    alice_watch.until("the watch's snapshot", |v| v["kind"] == "snapshot");
    let out = fleet.toolctl(&["revoke", "agent/A", "--reason", "decommissioned"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = ended_within(alice_call, Duration::from_secs(5), "the call on a");
    assert_exit(&out, 75, &["revoked"]);
    wait_for("host a to leave the fleet", Duration::from_secs(10), || {
        host_state(&fleet, "a").is_empty().then_some(())
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(host_state(&fleet, "a"), "", "a came back");
    let out = fleet.toolctl(&["call", "a", "hello"]);
    assert_exit(
        &out,
        127,
        &[
            "host `a` is not in the fleet: the identity agent/a is revoked on this coordinator \
           (by alice: decommissioned)",
        ],
    );
    alice_watch.until("host a forgotten", |v| {
        v["kind"] == "host_forgotten" && v["host"] == "a"
    });
    let agent_log = fleet.agents["a"].log();
    assert!(
        agent_log.contains("agent/a is revoked"),
        "the agent is told why: {agent_log}"
    );
    // At once, in the Goodbye that ends its link: not a broken connection.
    assert!(
        agent_log
            .lines()
            .any(|l| l.contains("the coordinator refused this agent")
                && l.contains("was revoked by alice")),
        "{agent_log}"
    );
    // Host b and alice are untouched.
    assert_eq!(host_state(&fleet, "b"), "online");
    let out = fleet.toolctl(&["call", "b", "hello"]);
    assert_eq!(text(&out.stdout), "hello\n");

    // Listed, in lowercase.
    let out = fleet.toolctl(&["revocations", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<&str> = list
        .iter()
        .map(|r| r["identity"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["agent/a", "client/bob"]);
    assert_eq!(list[1]["revoked_by"], "alice");
    assert_eq!(list[1]["reason"], "laptop stolen");

    // A restart forgets nothing.
    let state = format!("--state-dir={}", fleet.work.path().join("state").display());
    fleet.coordinator.as_mut().unwrap().stop();
    fleet.start_coordinator(&["--admin=alice", &state, &fleet.audit_arg()]);
    let out = fleet.toolctl_as("client-bob", &["hosts"], None);
    assert_exit(&out, 77, &[]);

    // Lifted: bob is back at once; agent a once restarted (it waits minutes after a refusal).
    for args in [
        &["unrevoke", "client/bob"][..],
        &["revoke", "--undo", "agent/a"],
    ] {
        let out = fleet.toolctl(args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    }
    let out = fleet.toolctl_as("client-bob", &["hosts"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    fleet.agents.get_mut("a").unwrap().stop();
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "hello");
    // b reconnects to the restarted coordinator on its own, and is stopped only once back:
    // stopped before, it would be a host this coordinator never saw, never offline.
    wait_for("host b back online", Duration::from_secs(30), || {
        (host_state(&fleet, "b") == "online").then_some(())
    });

    // A host retired first and revoked after, while offline: it leaves the fleet then.
    fleet.agents.get_mut("b").unwrap().stop();
    wait_for("host b offline", Duration::from_secs(10), || {
        (host_state(&fleet, "b") == "offline").then_some(())
    });
    let out = fleet.toolctl(&["revoke", "agent/b", "--reason", "retired"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    wait_for("host b to leave the fleet", Duration::from_secs(10), || {
        host_state(&fleet, "b").is_empty().then_some(())
    });

    let events: Vec<(String, String, String)> = fleet
        .audit_records()
        .iter()
        .filter(|r| r["event"] == "revocation")
        .map(|r| {
            (
                r["action"].as_str().unwrap().to_string(),
                r["identity"].as_str().unwrap().to_string(),
                r["outcome"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let want = [
        ("revoke", "client/bob", "done"),
        ("revoke", "agent/a", "done"),
        ("unrevoke", "client/bob", "done"),
        ("unrevoke", "agent/a", "done"),
        ("revoke", "agent/b", "done"),
    ]
    .map(|(a, i, o)| (a.to_string(), i.to_string(), o.to_string()));
    assert_eq!(events, want);
}

#[test]
fn only_administrators_revoke_and_odd_identities_are_refused() {
    let fleet = admin_fleet(&["a"], &[]);

    // bob is no administrator.
    for args in [
        &["revoke", "client/alice"][..],
        &["unrevoke", "client/alice"],
        &["revocations"],
    ] {
        let out = fleet.toolctl_as("client-bob", args, None);
        assert_eq!(
            out.status.code(),
            Some(77),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains("not an administrator"),
            "{}",
            text(&out.stderr)
        );
    }
    let out = fleet.toolctl(&["call", "a", "hello"]);
    assert_eq!(text(&out.stdout), "hello\n", "alice is not revoked");

    // Identities that are not ones, and one's own.
    for identity in [
        "coordinator",
        "agent/a/b",
        "agent/a b",
        "client/bob\u{1}",
        "client/bób",
        "bob",
        "agent/",
        "client/alice",
        "client/ALICE",
    ] {
        let out = fleet.toolctl(&["revoke", identity]);
        assert_eq!(
            out.status.code(),
            Some(64),
            "{identity:?}: {}",
            text(&out.stderr)
        );
    }
    let out = fleet.toolctl(&["revoke", "client/bob", "--reason", "two\nlines"]);
    assert_exit(&out, 64, &[]);
    let out = fleet.toolctl(&["unrevoke", "client/bob"]);
    assert_exit(&out, 127, &["is not revoked"]);
    let out = fleet.toolctl(&["revocations", "--json"]);
    assert_eq!(text(&out.stdout).trim(), "[]");

    // Revoking twice keeps the first record.
    assert!(
        fleet
            .toolctl(&["revoke", "client/Bob", "--reason", "first"])
            .status
            .success()
    );
    let out = fleet.toolctl(&["revoke", "client/bob", "--reason", "second"]);
    assert!(out.status.success());
    assert!(
        text(&out.stderr).contains("revoked already"),
        "{}",
        text(&out.stderr)
    );
    let out = fleet.toolctl(&["revocations", "--json"]);
    let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["reason"], "first");

    let refused = fleet
        .audit_records()
        .iter()
        .filter(|r| r["event"] == "revocation" && r["outcome"] == "refused")
        .count();
    assert!(
        refused >= 3 + 9,
        "every refused attempt is audited: {refused}"
    );
}

#[test]
fn without_a_state_dir_revoking_is_refused_saying_why() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.start_coordinator(&["--admin=alice"]);
    let out = fleet.toolctl(&["revoke", "client/bob"]);
    assert_exit(&out, 69, &["--state-dir", "would not survive a restart"]);
    let out = fleet.toolctl_as("client-bob", &["hosts"], None);
    assert!(
        out.status.success(),
        "bob was not revoked: {}",
        text(&out.stderr)
    );
}

/// A CRL of the fleet's CA listing the certificates of `revoked` (PEM files), PEM or DER.
fn crl(pki: &Pki, revoked: &[&str], pem: bool) -> Vec<u8> {
    let read = |name: &str| std::fs::read_to_string(pki.path(name)).unwrap();
    let key = rcgen::KeyPair::from_pem(&read("ca-key.pem")).unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_pem(&read("ca.pem"), key).unwrap();
    let revoked_certs = revoked
        .iter()
        .map(|file| {
            let serial = &toolsrv_tls::certificates_in(&pki.path(file)).unwrap()[0].serial;
            let bytes: Vec<u8> = serial
                .split(':')
                .map(|b| u8::from_str_radix(b, 16).unwrap())
                .collect();
            rcgen::RevokedCertParams {
                serial_number: rcgen::SerialNumber::from(bytes),
                revocation_time: rcgen::date_time_ymd(2025, 1, 1),
                reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                invalidity_date: None,
            }
        })
        .collect();
    let params = rcgen::CertificateRevocationListParams {
        this_update: rcgen::date_time_ymd(2025, 1, 1),
        next_update: rcgen::date_time_ymd(2099, 1, 1),
        crl_number: rcgen::SerialNumber::from(1u64),
        issuing_distribution_point: None,
        revoked_certs,
        key_identifier_method: rcgen::KeyIdMethod::Sha256,
    };
    let crl = params.signed_by(&issuer).unwrap();
    if pem {
        crl.pem().unwrap().into_bytes()
    } else {
        crl.der().to_vec()
    }
}

/// Replaces `path` whole (write beside, rename), as a CRL distribution job would.
fn replace(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[test]
fn a_crl_refuses_what_it_lists_closes_it_live_and_survives_garbage() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    let crl_path = fleet.work.path().join("ca.crl");
    std::fs::write(&crl_path, crl(&fleet.pki, &[], true)).unwrap();
    fleet.start_coordinator(&[&format!("--crl={}", crl_path.display())]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "hello");

    let bob_watch = spawn(fleet.toolctl_command("client-bob", &["watch", "--json"]));
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        fleet
            .toolctl_as("client-bob", &["hosts"], None)
            .status
            .success()
    );

    // bob's certificate is listed: the watch ends, new handshakes fail.
    replace(&crl_path, &crl(&fleet.pki, &["client-bob.pem"], true));
    let out = ended_within(bob_watch, Duration::from_secs(8), "bob's watch");
    assert!(!out.status.success());
    let out = fleet.toolctl_as("client-bob", &["hosts"], None);
    assert!(!out.status.success(), "bob got in: {}", text(&out.stdout));
    // The client sees its connection closed (TLS 1.3 sends the alert after the client's side of
    // the handshake is done); the coordinator says why.
    assert!(
        coordinator_log(&fleet).contains("invalid peer certificate: Revoked"),
        "{}",
        coordinator_log(&fleet)
    );
    assert_eq!(host_state(&fleet, "a"), "online", "the agent is not listed");
    assert!(
        coordinator_log(&fleet).contains("closed connections whose certificate a CRL now revokes")
    );

    // Garbage in the file: logged, and the last good CRL stays in force.
    replace(
        &crl_path,
        b"-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n",
    );
    wait_for("the reload error", Duration::from_secs(10), || {
        coordinator_log(&fleet)
            .contains("cannot be loaded; keeping the previous ones")
            .then_some(())
    });
    let out = fleet.toolctl_as("client-bob", &["hosts"], None);
    assert!(
        !out.status.success(),
        "garbage let bob in: {}",
        text(&out.stdout)
    );
    std::fs::remove_file(&crl_path).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let out = fleet.toolctl_as("client-bob", &["hosts"], None);
    assert!(!out.status.success(), "a missing CRL let bob in");
    assert!(fleet.toolctl(&["hosts"]).status.success(), "alice is fine");

    // A DER CRL that lists nothing lets bob back in.
    replace(&crl_path, &crl(&fleet.pki, &[], false));
    wait_for("bob to be accepted again", Duration::from_secs(10), || {
        fleet
            .toolctl_as("client-bob", &["hosts"], None)
            .status
            .success()
            .then_some(())
    });
}

/// The certificate the coordinator on `port` presents, as PEM (`openssl s_client`).
fn served_certificate(port: u16) -> String {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(format!(
        "openssl s_client -connect 127.0.0.1:{port} -alpn h2 </dev/null 2>/dev/null \
         | openssl x509"
    ));
    text(&run_bounded(cmd, None, Duration::from_secs(20)).stdout)
}

#[test]
fn new_certificates_and_cas_are_taken_up_without_dropping_live_connections() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "tick.meta",
        r#"{"description": "Tick", "cmd": "for i in 1 2 3 4 5 6 7 8; do echo tick $i; sleep 1; done"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "tick");
    let call = spawn(fleet.toolctl_command("client-alice", &["call", "a", "tick"]));
    std::thread::sleep(Duration::from_secs(1));

    // A new coordinator certificate from the same CA, and a second CA in the bundle.
    let fresh = tempfile::tempdir().unwrap();
    for name in ["ca.pem", "ca-key.pem"] {
        std::fs::copy(fleet.pki.path(name), fresh.path().join(name)).unwrap();
    }
    toolsrv_tls::issue(fresh.path(), &Identity::Coordinator, &[]).unwrap();
    for name in ["coordinator.pem", "coordinator-key.pem"] {
        std::fs::copy(fresh.path().join(name), fleet.pki.path(name)).unwrap();
    }
    let other = Pki::new(&[], &["mallory"]);
    let mut bundle = std::fs::read_to_string(fleet.pki.path("ca.pem")).unwrap();
    bundle.push_str(&std::fs::read_to_string(other.path("ca.pem")).unwrap());
    replace(&fleet.pki.path("ca.pem"), bundle.as_bytes());

    // New connections: a client of the new CA gets in once the files are read again, and the
    // coordinator presents its new certificate.
    wait_for(
        "a client of the new CA to get in",
        Duration::from_secs(15),
        || {
            let mut cmd = Command::new(bin("toolctl"));
            cmd.arg("hosts")
                .env("TOOLSRV_ADDR", fleet.url())
                .env("TOOLSRV_CA", fleet.pki.path("ca.pem"))
                .env("TOOLSRV_CERT", other.path("client-mallory.pem"))
                .env("TOOLSRV_KEY", other.path("client-mallory-key.pem"));
            run_bounded(cmd, None, Duration::from_secs(30))
                .status
                .success()
                .then_some(())
        },
    );
    assert!(coordinator_log(&fleet).contains("reloaded TLS credentials"));
    assert!(fleet.toolctl(&["hosts"]).status.success());
    let presented = served_certificate(fleet.port);
    let issued = std::fs::read_to_string(fresh.path().join("coordinator.pem")).unwrap();
    assert_eq!(
        presented.trim(),
        issued.trim(),
        "the old certificate is still served"
    );

    // The call that was running finished whole, and the agent never re-attached.
    let out = finish_child(call, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).lines().count(),
        8,
        "{}",
        text(&out.stdout)
    );
    assert_eq!(
        coordinator_log(&fleet).matches("agent attached").count(),
        1,
        "the agent link was dropped"
    );
}

#[test]
fn certificates_near_expiry_are_warned_about_once_and_counted() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello"}"#,
        false,
    );
    // The coordinator's certificate and carol's are in the last third of their lives, an hour
    // from their end: "near" expiry within the default week. dave's is a day's certificate
    // issued a minute ago, as enrolled agents get them and renew them at two thirds of their
    // life: due in 24 h, within the week, but not near its end.
    let now = std::time::SystemTime::now();
    let hours = |h: u64| Duration::from_secs(h * 3600);
    fleet.pki.issue_between(
        &toolsrv_tls::Identity::Coordinator,
        (now - hours(3), now + hours(1)),
    );
    fleet.pki.issue_between(
        &toolsrv_tls::Identity::Client("carol".into()),
        (now - hours(3), now + hours(1)),
    );
    fleet.pki.issue_between(
        &toolsrv_tls::Identity::Client("dave".into()),
        (now - Duration::from_secs(60), now + hours(24)),
    );
    // A window longer than any development certificate lives: alice's and the agent's, a year
    // long and fresh, are not near their end either.
    fleet.start_coordinator(&["--cert-expiry-warning=100000d"]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "hello");
    for stem in ["client-carol", "client-dave", "client-alice"] {
        for _ in 0..3 {
            assert!(fleet.toolctl_as(stem, &["hosts"], None).status.success());
        }
    }
    let log = coordinator_log(&fleet);
    let warnings = |who: &str| {
        log.lines()
            .filter(|l| l.contains("within the warning window") && l.contains(who))
            .count()
    };
    assert_eq!(
        warnings("client/carol"),
        1,
        "once, not per connection:\n{log}"
    );
    assert_eq!(
        warnings("coordinator.pem"),
        1,
        "the own certificate:\n{log}"
    );
    for fresh in ["client/dave", "client/alice", "agent/a", "ca.pem"] {
        assert_eq!(warnings(fresh), 0, "{fresh} is not near its end:\n{log}");
    }
}

/// An mTLS handshake checks a certificate's dates once; the connection could otherwise carry
/// requests and streams for as long as the client keeps it open.
#[test]
fn a_client_certificate_that_expires_ends_its_streams_and_is_refused_on_its_connection() {
    let fleet = admin_fleet(&["a"], &[]);
    let lifetime = Duration::from_secs(10);
    let issued = Instant::now();
    fleet.pki.issue_client_expiring("carol", lifetime);

    // Opened while the certificate is valid: a watch, a running call, and a connection of the
    // client library that makes a request now and another after the expiry.
    let watch = spawn(fleet.toolctl_command("client-carol", &["watch", "--json"]));
    let call = spawn(fleet.toolctl_command("client-carol", &["call", "a", "slower"]));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (client, refusal) = rt.block_on(async {
        toolsrv_tls::install_crypto_provider();
        let client = toolsrv_client::Client::connect(&toolsrv_client::ConnectOptions {
            addr: fleet.url(),
            tls: toolsrv_testkit::stem_files(fleet.pki.root(), "client-carol"),
        })
        .await
        .unwrap();
        assert_eq!(client.hosts().await.unwrap().len(), 1);
        tokio::time::sleep((lifetime + Duration::from_secs(1)).saturating_sub(issued.elapsed()))
            .await;
        let refusal = client.hosts().await.unwrap_err().to_string();
        (client, refusal)
    });
    assert!(
        refusal.contains("certificate of this connection expired"),
        "{refusal}"
    );

    let limit = lifetime + Duration::from_secs(5);
    let out = ended_within(call, limit.saturating_sub(issued.elapsed()), "carol's call");
    assert_eq!(out.status.code(), Some(77), "the call went on: {out:?}");
    assert!(text(&out.stdout).contains("started"), "{out:?}");
    assert!(
        text(&out.stderr).contains("expired"),
        "the call says why: {}",
        text(&out.stderr)
    );
    let out = ended_within(watch, Duration::from_secs(5), "carol's watch");
    assert_eq!(out.status.code(), Some(77), "{out:?}");
    assert!(
        text(&out.stderr).contains("expired"),
        "{}",
        text(&out.stderr)
    );
    // The call's process on host a was ended with it: nothing of carol's runs any more.
    wait_for(
        "carol's call to end on host a",
        Duration::from_secs(10),
        || {
            let out = Command::new("pgrep")
                .args(["-f", "sleep 61"])
                .output()
                .unwrap();
            out.stdout.is_empty().then_some(())
        },
    );
    assert!(
        coordinator_log(&fleet).contains("certificate expired"),
        "{}",
        coordinator_log(&fleet)
    );
    // toolctl refuses to connect with the expired certificate, naming it, rather than report
    // the broken connection the coordinator's refusal in the handshake looks like.
    let out = fleet.toolctl_as("client-carol", &["hosts"], None);
    assert_exit(
        &out,
        78,
        &["client-carol.pem", "this certificate expired at"],
    );
    // Other clients are untouched.
    let out = fleet.toolctl(&["call", "a", "hello"]);
    assert_eq!(text(&out.stdout), "hello\n");

    // A long-lived client whose certificate was renewed on disk: the coordinator closes the
    // connection shortly after the expiry, and the client connects again with the new one.
    fleet
        .pki
        .issue_client_expiring("carol", Duration::from_secs(3600));
    let renewed = rt.block_on(async {
        let mut last = String::new();
        for _ in 0..20 {
            match client.hosts().await {
                Ok(hosts) => return Ok(hosts.len()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Err(last)
    });
    assert_eq!(renewed, Ok(1), "the renewed certificate was not taken up");
}

/// The coordinator's state files are its own. In a state directory others may write (a volume
/// mounted mode 0777), a symbolic link left where the revocation list's temporary file goes
/// does not make a revocation write through it onto the file it leads to; and a revocation list
/// another user could have written (owned by them, or writable by every user) stops a
/// coordinator at start, naming it, instead of letting it start with someone else's list.
#[test]
fn state_files_another_user_could_have_written_are_not_used() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let fleet = admin_fleet(&["a"], &[]);
    let state = fleet.work.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    let victim = fleet.work.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    std::os::unix::fs::symlink(&victim, state.join(".revocations.json.tmp")).unwrap();
    let out = fleet.toolctl(&["revoke", "client/bob", "--reason", "laptop stolen"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    let list = state.join("revocations.json");
    let md = std::fs::symlink_metadata(&list).unwrap();
    assert!(md.is_file(), "the list is a file of its own: {md:?}");
    assert_eq!(md.mode() & 0o777, 0o600);
    assert!(
        std::fs::read_to_string(&list)
            .unwrap()
            .contains("client/bob")
    );

    let start = || {
        let mut cmd = Command::new(bin("toolsrv"));
        cmd.arg("coordinator")
            .args(fleet.pki.tls_args("coordinator"))
            .arg("--listen=127.0.0.1:0")
            .arg(format!(
                "--tools={}",
                fleet.work.path().join("tools").display()
            ))
            .arg(format!("--state-dir={}", state.display()));
        run_bounded(cmd, None, Duration::from_secs(30))
    };
    std::fs::set_permissions(&list, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_exit(
        &start(),
        1,
        &[
            &list.display().to_string(),
            "writable by every user of this machine (mode 0666)",
            &format!("chmod o-w {}", list.display()),
        ],
    );
    std::fs::set_permissions(&list, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&list, Some(65534), None).unwrap();
    assert_exit(
        &start(),
        1,
        &[
            &list.display().to_string(),
            "owned by uid 65534",
            &format!("chown 0 {}", list.display()),
        ],
    );
}
