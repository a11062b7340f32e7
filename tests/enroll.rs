//! Enrollment with join tokens, end to end: `toolctl token create`, `toolsrv agent --join`,
//! the certificate it gets (identity, labels, usage, lifetime), renewal under a short lifetime
//! with a call running across it, and every refusal: a used, expired, unknown or other host's
//! token, a non-administrator, a peer without a certificate calling anything but enrollment, a
//! garbage CSR, a CSR asking for more than the token says, a renewal for another host.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use toolsrv_proto::v1::enrollment_client::EnrollmentClient;
use toolsrv_proto::v1::{GetCaBundleRequest, JoinRequest};
use toolsrv_tests::{AgentSpec, Fleet, assert_exit, bin, run_bounded, text, wait_for};
use toolsrv_tls::{Identity, Role};

const HELLO: &str = r#"{"description": "Say hello", "cmd": "echo hello"}"#;

/// A fleet whose coordinator enrolls with the test PKI's CA, `alice` as administrator, tokens
/// kept in a state directory; `extra` flags added.
fn enrolling_fleet(agents: &[&str], extra: &[&str]) -> Fleet {
    let mut fleet = Fleet::new(agents);
    fleet.tool("hello.meta", HELLO, false);
    start_enrolling(&mut fleet, extra);
    fleet
}

fn start_enrolling(fleet: &mut Fleet, extra: &[&str]) {
    let state = fleet.work.path().join("coordinator-state");
    let mut args = vec![
        format!("--signing-ca-cert={}", fleet.pki.path("ca.pem").display()),
        format!(
            "--signing-ca-key={}",
            fleet.pki.path("ca-key.pem").display()
        ),
        format!("--state-dir={}", state.display()),
        "--admin=alice".to_string(),
        format!("--audit-log={}", fleet.audit_log().display()),
    ];
    args.extend(extra.iter().map(|s| (*s).to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fleet.start_coordinator(&args);
}

/// `toolctl token create` as `stem`: (token, pin) on success, else the output.
fn create_token(
    fleet: &Fleet,
    stem: &str,
    args: &[&str],
) -> Result<(String, String), std::process::Output> {
    let mut all = vec!["token", "create"];
    all.extend_from_slice(args);
    let out = fleet.toolctl_as(stem, &all, None);
    if !out.status.success() {
        return Err(out);
    }
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "the token alone on stdout: {stdout:?}");
    let pin = toolsrv_tests::ca_pin_in(&text(&out.stderr));
    Ok((lines[0].to_string(), pin))
}

fn token(fleet: &Fleet, host: &str, extra: &[&str]) -> (String, String) {
    let mut args = vec!["--host-id", host];
    args.extend_from_slice(extra);
    create_token(fleet, "client-alice", &args)
        .unwrap_or_else(|out| panic!("token create failed: {}", text(&out.stderr)))
}

fn join_spec(token: &str, pin: &str) -> AgentSpec {
    AgentSpec {
        enroll: Some(vec![format!("--join={token}"), format!("--ca-pin={pin}")]),
        ..AgentSpec::default()
    }
}

/// The enrolled identity file of agent `id` of the fleet.
fn identity_file(fleet: &Fleet, id: &str) -> PathBuf {
    fleet
        .work
        .path()
        .join(format!("host-{id}/state/enroll/identity.pem"))
}

/// Runs `toolsrv agent` with `args` (and a fresh state directory `state`) for at most 20 s.
fn run_agent(fleet: &Fleet, state: &Path, args: &[String]) -> std::process::Output {
    let mut cmd = Command::new(bin("toolsrv"));
    cmd.arg("agent")
        .arg(format!("--coordinator={}", fleet.url()))
        .arg(format!("--state-dir={}", state.display()))
        .arg("--sandbox=off")
        .args(args)
        .env("TOOLSRV_LOG", "info");
    run_bounded(cmd, None, Duration::from_secs(20))
}

fn audit(fleet: &Fleet, event: &str) -> Vec<Value> {
    fleet
        .audit_records()
        .into_iter()
        .filter(|r| r["event"] == event)
        .collect()
}

fn der_of(pem: &str) -> Vec<Vec<u8>> {
    toolsrv_tls::enroll::certs_from_pem(pem)
        .unwrap()
        .into_iter()
        .map(|c| c.as_ref().to_vec())
        .collect()
}

/// The URI and DNS SANs of a DER certificate.
fn sans(der: &[u8]) -> Vec<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).unwrap();
    let san = cert.subject_alternative_name().unwrap().unwrap();
    san.value
        .general_names
        .iter()
        .map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => format!("URI:{u}"),
            x509_parser::extensions::GeneralName::DNSName(d) => format!("DNS:{d}"),
            other => format!("{other:?}"),
        })
        .collect()
}

#[test]
fn a_host_joins_with_a_token_and_later_starts_without_one() {
    let mut fleet = enrolling_fleet(&["a"], &["--agent-cert-ttl=2h"]);
    let (tok, pin) = token(&fleet, "Web-9", &["--label", "role=db", "--ttl", "10m"]);
    assert!(tok.starts_with("tsj_") && tok.len() >= 36, "{tok}");
    assert_eq!(
        pin,
        toolsrv_tls::enroll::pin_for(&fleet.pki.path("ca.pem"), &fleet.pki.path("ca.pem")).unwrap(),
        "the pin is the CA certificate's"
    );
    fleet.start_agent("web-9", &join_spec(&tok, &pin));
    fleet.wait_online(&["web-9"], "hello");
    // Given on the command line, the token is not left there for every user of the host to
    // read while the agent runs: it moved to the agent's environment.
    let agent = &fleet.agents["web-9"];
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", agent.pid())).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(
        cmdline.contains("agent") && !cmdline.contains(&tok),
        "{cmdline}"
    );
    assert!(
        agent.log().contains("TOOLSRV_JOIN_TOKEN"),
        "{}",
        agent.log()
    );
    // Nor is it left in the environment the agent started with, which every process of its
    // user may read (a tool running as root, the default): read, then overwritten.
    let environ = std::fs::read(format!("/proc/{}/environ", agent.pid())).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(
        !environ.contains(&tok),
        "the join token is in the agent's environment"
    );
    assert!(environ.contains("TOOLSRV_JOIN_TOKEN="), "{environ}");

    // The certificate: the token's host id and labels, clientAuth, the configured lifetime,
    // and the key kept beside it, readable by the agent's user only.
    let file = identity_file(&fleet, "web-9");
    let pem = std::fs::read_to_string(&file).unwrap();
    assert!(
        pem.contains("PRIVATE KEY"),
        "the key stays in the state directory"
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let ders = der_of(&pem);
    assert_eq!(
        toolsrv_tls::identity_of(&ders[0]).unwrap(),
        Identity::Agent("web-9".into())
    );
    assert_eq!(
        sans(&ders[0]),
        vec!["URI:toolsrv://agent/web-9", "URI:toolsrv://label/role=db"]
    );
    let (nb, na) = toolsrv_tls::enroll::validity_of(&ders[0]).unwrap();
    assert_eq!(na - nb, 7200);
    let (_, cert) = x509_parser::parse_x509_certificate(&ders[0]).unwrap();
    let eku = cert.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.client_auth && !eku.server_auth);

    let hosts = fleet.hosts();
    let host = hosts.iter().find(|h| h["host_id"] == "web-9").unwrap();
    assert_eq!(host["trusted_labels"]["role"], "db", "{host}");
    assert!(fleet.toolctl(&["call", "web-9", "hello"]).status.success());

    // Restarted without a token, it uses the stored certificate.
    fleet.agents.remove("web-9");
    fleet.start_agent(
        "web-9",
        &AgentSpec {
            enroll: Some(Vec::new()),
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["web-9"], "hello");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), pem, "no new join");

    // The token is spent: another host cannot use it.
    let out = run_agent(
        &fleet,
        &fleet.work.path().join("thief"),
        &[format!("--join={tok}"), format!("--ca-pin={pin}")],
    );
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(log.contains("join token already used"), "{log}");

    // And the audit log says who did what.
    let created = audit(&fleet, "join_token");
    assert_eq!(created.len(), 1);
    assert_eq!(created[0]["client"], "alice");
    assert_eq!(created[0]["outcome"], "granted");
    assert!(
        !fleet
            .audit_records()
            .iter()
            .any(|r| r.to_string().contains(&tok))
    );
    let joins = audit(&fleet, "join");
    assert_eq!(joins.len(), 2, "{joins:?}");
    assert_eq!(joins[0]["outcome"], "granted");
    assert_eq!(joins[0]["host"], "web-9");
    assert_eq!(joins[1]["outcome"], "refused");
}

#[test]
fn expired_unknown_and_other_hosts_tokens_are_refused() {
    let fleet = enrolling_fleet(&["a"], &[]);
    let (tok, pin) = token(&fleet, "x-1", &["--ttl", "1s"]);
    std::thread::sleep(Duration::from_millis(2100));
    let out = run_agent(
        &fleet,
        &fleet.work.path().join("late"),
        &[format!("--join={tok}"), format!("--ca-pin={pin}")],
    );
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(log.contains("join token expired"), "{log}");

    let out = run_agent(
        &fleet,
        &fleet.work.path().join("guess"),
        &[
            format!("--join=tsj_{}", "0".repeat(48)),
            format!("--ca-pin={pin}"),
        ],
    );
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(log.contains("join token not recognised"), "{log}");

    // A token for x-2 does not make a certificate for y; refused before it is used.
    let (tok, pin) = token(&fleet, "x-2", &[]);
    let out = run_agent(
        &fleet,
        &fleet.work.path().join("other"),
        &[
            format!("--join={tok}"),
            format!("--ca-pin={pin}"),
            "--host-id=y".into(),
        ],
    );
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(log.contains("join token is for host `x-2`"), "{log}");

    // A wrong pin: nothing is sent to a coordinator whose CA does not match.
    let out = run_agent(
        &fleet,
        &fleet.work.path().join("pin"),
        &[
            format!("--join={tok}"),
            format!("--ca-pin=sha256:{}", "ab".repeat(32)),
        ],
    );
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(log.contains("has the pin"), "{log}");

    // The token survived both refusals.
    let state = fleet.work.path().join("right");
    let mut cmd = Command::new(bin("toolsrv"));
    cmd.arg("agent")
        .arg(format!("--coordinator={}", fleet.url()))
        .arg(format!("--state-dir={}", state.display()))
        .arg("--sandbox=off")
        .arg(format!("--join={tok}"))
        .arg(format!("--ca-pin={pin}"))
        .env("TOOLSRV_LOG", "info")
        .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    wait_for("x-2 to join", Duration::from_secs(20), || {
        state.join("enroll/identity.pem").exists().then_some(())
    });
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn only_administrators_create_tokens() {
    let fleet = enrolling_fleet(&["a"], &[]);
    let out = create_token(&fleet, "client-bob", &["--host-id", "z"]).unwrap_err();
    assert_exit(&out, 77, &["client `bob` is not an administrator"]);
    assert!(text(&out.stdout).is_empty());
    let records = audit(&fleet, "join_token");
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["outcome"], "refused");
    assert_eq!(records[0]["client"], "bob");

    // An agent certificate is no client at all.
    let out = create_token(&fleet, "agent-a", &["--host-id", "z"]).unwrap_err();
    assert!(!out.status.success());

    // Through alice's `toolctl master`, with no certificate of its own.
    let socket = fleet.work.path().join("ctl.sock");
    let socket_arg = socket.display().to_string();
    let mut master = fleet
        .toolctl_command("client-alice", &["master", "--control", &socket_arg])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the master's socket", Duration::from_secs(10), || {
        socket.exists().then_some(())
    });
    let mut cmd = Command::new(bin("toolctl"));
    cmd.args([
        "token",
        "create",
        "--control",
        &socket_arg,
        "--host-id",
        "m-1",
    ])
    .env_clear()
    .env("PATH", "/usr/bin:/bin");
    let out = run_bounded(cmd, None, Duration::from_secs(20));
    let _ = master.kill();
    let _ = master.wait();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("tsj_"));
}

#[test]
fn without_a_signing_ca_enrollment_is_off_and_says_so() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool("hello.meta", HELLO, false);
    fleet.start_coordinator(&["--admin=alice"]);
    let out = create_token(&fleet, "client-alice", &["--host-id", "z"]).unwrap_err();
    assert!(
        text(&out.stderr).contains("enrollment is off on this coordinator"),
        "{}",
        text(&out.stderr)
    );
    // And a peer without a certificate does not even finish the handshake.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        toolsrv_tls::install_crypto_provider();
        let tls = toolsrv_tls::unverified_client_config().unwrap();
        if let Ok(channel) = toolsrv_tls::connect(&fleet.url(), tls).await {
            let answer = EnrollmentClient::new(channel)
                .get_ca_bundle(GetCaBundleRequest {})
                .await;
            assert!(answer.is_err(), "{answer:?}");
        }
    });
}

#[test]
fn a_signing_ca_that_does_not_chain_to_the_bundle_stops_the_coordinator() {
    let fleet = Fleet::new(&["a"]);
    let other = toolsrv_tests::Pki::new(&[], &[]);
    let mut cmd = toolsrv_testkit_command(&fleet);
    cmd.arg(format!(
        "--signing-ca-cert={}",
        other.path("ca.pem").display()
    ))
    .arg(format!(
        "--signing-ca-key={}",
        other.path("ca-key.pem").display()
    ));
    let out = run_bounded(cmd, None, Duration::from_secs(20));
    let log = text(&out.stderr);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("does not chain to the CA bundle"), "{log}");

    let mut cmd = toolsrv_testkit_command(&fleet);
    cmd.arg(format!(
        "--signing-ca-cert={}",
        fleet.pki.path("ca.pem").display()
    ));
    let out = run_bounded(cmd, None, Duration::from_secs(20));
    assert!(
        text(&out.stderr).contains("go together"),
        "{}",
        text(&out.stderr)
    );
}

fn toolsrv_testkit_command(fleet: &Fleet) -> Command {
    let mut cmd = Command::new(bin("toolsrv"));
    cmd.arg("coordinator")
        .arg(format!("--listen=127.0.0.1:{}", toolsrv_tests::free_port()))
        .arg(format!("--tools={}", fleet.tools.display()))
        .args(fleet.pki.tls_args("coordinator"));
    cmd
}

#[test]
fn policy_trusts_enrollment_labels_not_what_an_agent_says() {
    let mut fleet = Fleet::new(&["b"]);
    fleet.tool("hello.meta", HELLO, false);
    let policy = fleet.policy_arg(
        r#"{"default": "deny", "rules": [{"hosts": "role=db", "tools": ["hello"], "effect": "allow"}]}"#,
    );
    start_enrolling(&mut fleet, &[&policy]);
    let (tok, pin) = token(&fleet, "db-1", &["--label", "role=db"]);
    fleet.start_agent("db-1", &join_spec(&tok, &pin));
    // b says it is a database; only its own word.
    fleet.start_agent(
        "b",
        &AgentSpec {
            labels: vec![("role".into(), "db".into())],
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["db-1", "b"], "hello");
    let out = fleet.toolctl(&["call", "db-1", "hello"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = fleet.toolctl(&["call", "b", "hello"]);
    assert_exit(&out, 77, &[]);
}

#[test]
fn renewal_under_a_short_lifetime_keeps_a_running_call_and_the_link() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "slow.meta",
        r#"{"description": "Slow", "cmd": "echo start; sleep 8; echo done"}"#,
        false,
    );
    start_enrolling(&mut fleet, &["--agent-cert-ttl=6s"]);
    let (tok, pin) = token(&fleet, "r-1", &["--label", "zone=z1"]);
    fleet.start_agent("r-1", &join_spec(&tok, &pin));
    fleet.wait_online(&["r-1"], "slow");
    let file = identity_file(&fleet, "r-1");
    let first = std::fs::read_to_string(&file).unwrap();

    let started = Instant::now();
    let call = fleet
        .toolctl_command("client-alice", &["call", "r-1", "slow"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Renewed at two thirds of 6 s, while the call runs.
    wait_for(
        "the certificate to be renewed",
        Duration::from_secs(10),
        || (std::fs::read_to_string(&file).unwrap() != first).then_some(()),
    );
    let out = toolsrv_tests::finish_child(call, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("done"), "{}", text(&out.stdout));
    assert!(started.elapsed() > Duration::from_secs(7));

    // A fresh key, the same identity and labels.
    let renewed = std::fs::read_to_string(&file).unwrap();
    let key_of = |pem: &str| pem[pem.find("-----BEGIN PRIVATE KEY").unwrap()..].to_string();
    assert_ne!(key_of(&first), key_of(&renewed));
    let der = &der_of(&renewed)[0];
    assert_eq!(
        sans(der),
        vec!["URI:toolsrv://agent/r-1", "URI:toolsrv://label/zone=z1"]
    );
    let renewals = audit(&fleet, "renewal");
    assert!(
        renewals
            .iter()
            .any(|r| r["outcome"] == "granted" && r["host"] == "r-1"),
        "{renewals:?}"
    );
    // The link's connection was made with the first certificate, which expired while the call
    // ran: the coordinator let the call finish, then ended the link, which came back with a
    // renewed certificate.
    let coordinator = fleet.coordinator.as_ref().unwrap();
    wait_for(
        "the link moved to a renewed certificate",
        Duration::from_secs(15),
        || {
            let log = coordinator.log();
            let moved = log.contains("its certificate expired")
                && log.matches("agent attached").count() >= 2;
            moved.then_some(())
        },
    );
    let log = coordinator.log();
    let first_end = log
        .lines()
        .find(|l| l.contains("agent detached"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        first_end.contains("its certificate expired"),
        "the first link ended for its certificate, after the call: {first_end}"
    );
    // The new link is up; its view may take a moment more (the host is `syncing` until then).
    wait_for("r-1 online again", Duration::from_secs(20), || {
        let hosts = fleet.hosts();
        let host = hosts.iter().find(|h| h["host_id"] == "r-1")?;
        (host["state"] == "online").then_some(())
    });
    assert!(fleet.toolctl(&["call", "r-1", "slow"]).status.success());
    fleet.coordinator = None;
    start_enrolling(&mut fleet, &["--agent-cert-ttl=6s"]);
    fleet.wait_online(&["r-1"], "slow");
    assert!(fleet.toolctl(&["call", "r-1", "slow"]).status.success());
}

/// Straight to the gRPC services, as a peer without a certificate and as an agent.
mod wire {
    use super::*;
    use toolsrv_proto::v1::agent_link_client::AgentLinkClient;
    use toolsrv_proto::v1::join_tokens_client::JoinTokensClient;
    use toolsrv_proto::v1::renewal_client::RenewalClient;
    use toolsrv_proto::v1::tools_client::ToolsClient;
    use toolsrv_proto::v1::{
        CreateJoinTokenRequest, FetchBlobRequest, ListHostsRequest, RenewRequest,
    };

    use toolsrv_tests::{anonymous_channel as anonymous, runtime};

    #[test]
    fn a_peer_without_a_certificate_gets_nothing_but_enrollment() {
        let fleet = enrolling_fleet(&["a"], &[]);
        runtime().block_on(async {
            let channel = anonymous(&fleet).await;
            let bundle = EnrollmentClient::new(channel.clone())
                .get_ca_bundle(GetCaBundleRequest {})
                .await
                .unwrap()
                .into_inner();
            assert!(bundle.ca_bundle_pem.contains("BEGIN CERTIFICATE"));

            let denied = |r: Result<(), tonic::Status>, what: &str| {
                let err = r.unwrap_err();
                assert_eq!(err.code(), tonic::Code::Unauthenticated, "{what}: {err:?}");
            };
            denied(
                ToolsClient::new(channel.clone())
                    .list_hosts(ListHostsRequest::default())
                    .await
                    .map(drop),
                "ListHosts",
            );
            denied(
                JoinTokensClient::new(channel.clone())
                    .create_join_token(CreateJoinTokenRequest {
                        host_id: "z".into(),
                        ..Default::default()
                    })
                    .await
                    .map(drop),
                "CreateJoinToken",
            );
            denied(
                RenewalClient::new(channel.clone())
                    .renew(RenewRequest::default())
                    .await
                    .map(drop),
                "Renew",
            );
            denied(
                AgentLinkClient::new(channel.clone())
                    .fetch_blob(FetchBlobRequest {
                        sha256: "0".repeat(64),
                    })
                    .await
                    .map(drop),
                "FetchBlob",
            );
            let attach = AgentLinkClient::new(channel.clone())
                .attach(tokio_stream::empty::<toolsrv_proto::v1::AgentMessage>())
                .await;
            denied(attach.map(drop), "Attach");
            let health = tonic_health::pb::health_client::HealthClient::new(channel.clone())
                .check(tonic_health::pb::HealthCheckRequest::default())
                .await;
            denied(health.map(drop), "Health");
        });
        assert!(audit(&fleet, "join_token").is_empty());
    }

    /// A peer without a certificate holds at most 64 requests open at once: past that, its
    /// streams are refused at once instead of each waiting for a body that never comes. Before,
    /// one connection opened 20,000 such streams and the coordinator grew by 120 MB; nothing
    /// stopped it at any number.
    #[test]
    fn a_peer_without_a_certificate_cannot_hold_requests_open_without_end() {
        let fleet = enrolling_fleet(&["a"], &["--metrics-listen=127.0.0.1:0"]);
        let tls = toolsrv_tls::anonymous_client_config(
            &fleet.pki.path("ca.pem"),
            toolsrv_tls::Role::Coordinator,
        )
        .unwrap();
        let streams = runtime().block_on(toolsrv_tests::open_bodiless_streams(
            fleet.port,
            tls,
            "/toolsrv.v1.Enrollment/Join",
            2000,
        ));
        assert_eq!(streams.taken, 64, "{streams:?}");
        assert_eq!(streams.refused, 2000 - 64);
        let answers: Vec<_> = streams.answers.iter().collect();
        assert_eq!(answers.len(), 1, "{answers:?}");
        assert_eq!(answers[0].0, "8", "RESOURCE_EXHAUSTED: {answers:?}");
        assert!(answers[0].1.contains("127.0.0.1"), "{answers:?}");
        let metrics = toolsrv_tests::http_get(
            &fleet.coordinator.as_ref().unwrap().metrics_addr(),
            "/metrics",
        )
        .unwrap()
        .1;
        assert!(
            metrics.contains("toolsrv_requests_refused_total 1936"),
            "{metrics}"
        );
        // One record for the run, not one per refusal.
        let refusals = audit(&fleet, "refusal");
        assert_eq!(refusals.len(), 1, "{refusals:?}");
        assert_eq!(refusals[0]["client"], "127.0.0.1 (without a certificate)");
        assert_eq!(refusals[0]["rpc"], "/toolsrv.v1.Enrollment/Join");
        assert_eq!(refusals[0]["code"], "ResourceExhausted");
        // The coordinator still serves the fleet.
        let out = fleet.toolctl(&["hosts"]);
        toolsrv_tests::assert_exit(&out, 0, &[]);
        drop(streams);
    }

    fn csr(sans: Vec<rcgen::SanType>) -> (rcgen::KeyPair, Vec<u8>) {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.subject_alt_names = sans;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "toolsrv://coordinator");
        let csr = params.serialize_request(&key).unwrap();
        (key, csr.der().to_vec())
    }

    fn uri(u: &str) -> rcgen::SanType {
        rcgen::SanType::URI(u.to_string().try_into().unwrap())
    }

    #[test]
    fn the_certificate_says_only_what_the_token_says() {
        let fleet = enrolling_fleet(&["a"], &[]);
        let (tok, _) = token(&fleet, "h-1", &["--label", "role=web"]);
        runtime().block_on(async {
            let mut client = EnrollmentClient::new(anonymous(&fleet).await);
            let join = |csr_der: Vec<u8>| JoinRequest {
                token: tok.clone(),
                csr_der,
                ..JoinRequest::default()
            };
            // Garbage: refused, and the token stays usable.
            let err = client.join(join(b"not a csr".to_vec())).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
            let err = client.join(join(Vec::new())).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
            // A CSR signed by another key than the one it names.
            let (_, mut bad) = csr(Vec::new());
            let last = bad.len() - 1;
            bad[last] ^= 0x55;
            let err = client.join(join(bad)).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
            // Asking for another host's identity, or a client's.
            for other in [
                "toolsrv://agent/h-2",
                "toolsrv://client/alice",
                "toolsrv://coordinator",
            ] {
                let (_, der) = csr(vec![uri(other)]);
                let err = client.join(join(der)).await.unwrap_err();
                assert_eq!(
                    err.code(),
                    tonic::Code::PermissionDenied,
                    "{other}: {err:?}"
                );
            }
            // Extra names and labels are ignored: the certificate has the token's only.
            let (key, der) = csr(vec![
                uri("toolsrv://agent/h-1"),
                uri("toolsrv://label/role=admin"),
                uri("spiffe://example.org/x"),
                rcgen::SanType::DnsName("evil.example".try_into().unwrap()),
            ]);
            let issued = client.join(join(der)).await.unwrap().into_inner();
            assert_eq!(issued.host_id, "h-1");
            let ders = der_of(&issued.certificate_chain_pem);
            assert_eq!(
                sans(&ders[0]),
                vec!["URI:toolsrv://agent/h-1", "URI:toolsrv://label/role=web"]
            );
            assert_eq!(
                toolsrv_tls::enroll::certificate_public_key(&ders[0]).unwrap(),
                key.public_key_raw()
            );
            let (_, cert) = x509_parser::parse_x509_certificate(&ders[0]).unwrap();
            assert_eq!(cert.subject().to_string(), "O=toolsrv, CN=agent/h-1");
            // Used now.
            let (_, der) = csr(Vec::new());
            let err = client.join(join(der)).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::PermissionDenied);
            assert!(err.message().contains("already used"), "{err:?}");
        });
    }

    /// The audit log on a full disk (`/dev/full`, through a symlink): the token created as the
    /// log fails is handed out (its record goes to the coordinator's log instead), then neither
    /// a token nor a certificate is until the log takes records again; the token refused
    /// meanwhile stays usable.
    #[test]
    fn nothing_is_granted_that_the_audit_log_cannot_record() {
        let mut fleet = Fleet::new(&["a"]);
        fleet.tool("hello.meta", HELLO, false);
        let log = fleet.audit_log();
        std::os::unix::fs::symlink("/dev/full", &log).unwrap();
        start_enrolling(&mut fleet, &[]);
        let (tok, _) = token(&fleet, "h-1", &[]);
        let out = create_token(&fleet, "client-alice", &["--host-id", "h-2"]).unwrap_err();
        assert_exit(&out, 75, &["cannot write its audit log"]);
        runtime().block_on(async {
            let mut client = EnrollmentClient::new(anonymous(&fleet).await);
            let join = || JoinRequest {
                token: tok.clone(),
                csr_der: csr(Vec::new()).1,
                ..JoinRequest::default()
            };
            let err = client.join(join()).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
            assert!(
                err.message().contains("cannot write its audit log"),
                "{err:?}"
            );

            // Room again: the symlink goes, and the coordinator makes a file in its place.
            std::fs::remove_file(&log).unwrap();
            let pid = fleet.coordinator.as_ref().unwrap().pid();
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGHUP,
            )
            .unwrap();
            wait_for("the audit log reopened", Duration::from_secs(20), || {
                log.symlink_metadata()
                    .is_ok_and(|m| m.is_file())
                    .then_some(())
            });
            // The refusal written is what shows the log works; the token was never used.
            let err = client.join(join()).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
            let issued = client.join(join()).await.unwrap().into_inner();
            assert_eq!(issued.host_id, "h-1");
        });
        let joins = audit(&fleet, "join");
        assert_eq!(joins.len(), 2, "{joins:?}");
        assert_eq!(joins[0]["outcome"], "refused");
        assert_eq!(joins[1]["outcome"], "granted");
    }

    /// An agent renewing in a loop (compromised, or broken) gets 5 renewals at once, then one
    /// each quarter of its certificate's lifetime: the rest are refused unexamined, nothing
    /// signed, one record for the run (before: each one signed and recorded).
    #[test]
    fn an_agent_renewing_in_a_loop_is_slowed_and_not_recorded_each_time() {
        let fleet = enrolling_fleet(&["a"], &["--agent-cert-ttl=1h"]);
        let codes = runtime().block_on(async {
            let files = fleet.pki.files(&Identity::Agent("a".into()));
            let channel = toolsrv_tls::connect_reloading(&fleet.url(), &files, Role::Coordinator)
                .await
                .unwrap();
            let mut client = RenewalClient::new(channel);
            let mut codes = Vec::new();
            for _ in 0..50 {
                let renewed = client
                    .renew(RenewRequest {
                        csr_der: csr(Vec::new()).1,
                        host_id: String::new(),
                    })
                    .await;
                codes.push(renewed.map(drop).map_err(|e| {
                    (
                        e.code(),
                        e.message().to_string(),
                        toolsrv_proto::retry_pushback(&e),
                    )
                }));
            }
            codes
        });
        let granted = codes.iter().filter(|c| c.is_ok()).count();
        assert_eq!(granted, 5, "{:?}", &codes[..8]);
        let Err((code, message, pushback)) = &codes[5] else {
            panic!("{:?}", codes[5]);
        };
        assert_eq!(*code, tonic::Code::ResourceExhausted);
        // When to come back is said in the trailers too, for programs.
        let wait = pushback.unwrap_or_else(|| panic!("no retry pushback in {:?}", codes[5]));
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(3600),
            "{wait:?}"
        );
        assert!(
            message.contains("too many renewals from `a`") && message.contains("come back in"),
            "{message}"
        );
        let renewals = audit(&fleet, "renewal");
        assert_eq!(renewals.len(), 6, "{renewals:?}");
        assert_eq!(renewals[5]["outcome"], "throttled");
    }

    /// Renewals go on while the audit log cannot be written (an agent whose certificate lapsed
    /// would have to join again), each recorded in the coordinator's log instead and counted
    /// against the agent's share as ever; once there is room, records go to the file again.
    #[test]
    fn renewals_go_on_while_the_audit_log_fails_recorded_in_the_coordinator_s_log() {
        let fleet = enrolling_fleet(&["a"], &["--agent-cert-ttl=1h"]);
        fleet.point_audit_log_at(Path::new("/dev/full"));
        let after = fleet.work.path().join("audit-after.jsonl");
        let codes = runtime().block_on(async {
            let files = fleet.pki.files(&Identity::Agent("a".into()));
            let channel = toolsrv_tls::connect_reloading(&fleet.url(), &files, Role::Coordinator)
                .await
                .unwrap();
            let renew = |mut client: RenewalClient<_>| async move {
                let request = RenewRequest {
                    csr_der: csr(Vec::new()).1,
                    host_id: String::new(),
                };
                client.renew(request).await.map(drop).map_err(|e| e.code())
            };
            let client = RenewalClient::new(channel);
            let mut codes = Vec::new();
            for _ in 0..3 {
                codes.push(renew(client.clone()).await);
            }
            fleet.point_audit_log_at(&after);
            codes.push(renew(client.clone()).await);
            codes
        });
        assert_eq!(codes, [Ok(()), Ok(()), Ok(()), Ok(())]);
        let log = fleet.coordinator.as_ref().unwrap().log();
        let kept = log
            .lines()
            .filter(|l| l.contains("logged here instead") && l.contains("renewal"))
            .count();
        assert_eq!(kept, 3, "{log}");
        let records = toolsrv_tests::json_lines(&after);
        assert_eq!(records.len(), 1, "{records:?}");
        assert_eq!(records[0]["event"], "renewal");
        assert_eq!(records[0]["outcome"], "granted");
    }

    #[test]
    fn an_agent_renews_only_its_own_certificate() {
        let fleet = enrolling_fleet(&["a"], &[]);
        runtime().block_on(async {
            let files = fleet.pki.files(&Identity::Agent("a".into()));
            let channel = toolsrv_tls::connect_reloading(&fleet.url(), &files, Role::Coordinator)
                .await
                .unwrap();
            let mut client = RenewalClient::new(channel);
            let (_, der) = csr(Vec::new());
            // Another host's name, with a forged log line and a clear-screen after it.
            let err = client
                .renew(RenewRequest {
                    csr_der: der.clone(),
                    host_id: format!("b\n{FORGED}\x1b[2J"),
                })
                .await
                .unwrap_err();
            assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
            let (_, other) = csr(vec![uri("toolsrv://agent/b")]);
            let err = client
                .renew(RenewRequest {
                    csr_der: other,
                    host_id: String::new(),
                })
                .await
                .unwrap_err();
            assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
            let renewed = client
                .renew(RenewRequest {
                    csr_der: der,
                    host_id: "A".into(),
                })
                .await
                .unwrap()
                .into_inner();
            let ders = der_of(&renewed.certificate_chain_pem);
            assert_eq!(sans(&ders[0]), vec!["URI:toolsrv://agent/a"]);

            // A client certificate cannot renew anything.
            let files = fleet.pki.files(&Identity::Client("alice".into()));
            let channel = toolsrv_tls::connect_reloading(&fleet.url(), &files, Role::Coordinator)
                .await
                .unwrap();
            let err = RenewalClient::new(channel)
                .renew(RenewRequest::default())
                .await
                .unwrap_err();
            assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
        });
        let renewals = audit(&fleet, "renewal");
        assert_eq!(renewals.len(), 3, "{renewals:?}");
        assert_eq!(renewals[2]["outcome"], "granted");
        // What it asked for is quoted in the coordinator's log, escaped: no line of its own.
        let log = fleet.coordinator.as_ref().unwrap().log();
        assert!(log.contains("renewal refused"), "{log}");
        assert!(
            !log.lines().any(|l| l.starts_with(FORGED)) && !log.contains('\x1b'),
            "{log}"
        );
    }

    /// A log line as the coordinator writes them, which a peer could try to pass off as one.
    const FORGED: &str = "2026-12-07T14:41:00.000000Z  WARN toolsrv_coordinator::revocation: \
                          identity revoked identity=client/admin";
}

#[test]
fn an_expired_certificate_needs_a_new_token() {
    let mut fleet = enrolling_fleet(&["a"], &["--agent-cert-ttl=5s"]);
    let (tok, pin) = token(&fleet, "e-1", &[]);
    fleet.start_agent("e-1", &join_spec(&tok, &pin));
    fleet.wait_online(&["e-1"], "hello");
    fleet.agents.remove("e-1");
    let state = fleet.work.path().join("host-e-1/state");

    // Another --host-id than the enrolled one is refused at once.
    let out = run_agent(&fleet, &state, &["--host-id=e-2".to_string()]);
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(
        log.contains("--host-id e-2 differs from the host id `e-1`"),
        "{log}"
    );

    // Stopped past its certificate's end, nothing can renew it.
    std::thread::sleep(Duration::from_secs(6));
    let out = run_agent(&fleet, &state, &[]);
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(
        log.contains("expired") && log.contains("toolctl token create --host-id e-1"),
        "{log}"
    );

    // A new token enrolls it again.
    let (tok, pin) = token(&fleet, "e-1", &[]);
    fleet.start_agent("e-1", &join_spec(&tok, &pin));
    fleet.wait_online(&["e-1"], "hello");
}

#[test]
fn tokens_are_listed_by_id_and_an_unused_one_can_be_revoked() {
    let mut fleet = enrolling_fleet(&["a"], &[]);
    let (keep, pin) = token(&fleet, "keep-1", &["--label", "role=db"]);
    let (drop, _) = token(&fleet, "drop-1", &[]);
    let id_of = |tok: &str| toolsrv_tls::enroll::token_digest(tok)[..16].to_string();

    let out = fleet.toolctl_as("client-alice", &["token", "list", "--json"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed[0]["host_id"], "drop-1", "newest first");
    let kept = listed.iter().find(|t| t["host_id"] == "keep-1").unwrap();
    assert_eq!(kept["id"], id_of(&keep).as_str());
    assert_eq!(kept["state"], "usable");
    assert_eq!(kept["labels"]["role"], "db");
    assert_eq!(kept["created_by"], "alice");
    assert!(
        !text(&out.stdout).contains(&keep),
        "the token itself is never shown"
    );
    let table = fleet.toolctl_as("client-alice", &["token", "list"], None);
    assert!(
        text(&table.stdout).starts_with("ID"),
        "{}",
        text(&table.stdout)
    );

    // Only administrators list or revoke.
    let out = fleet.toolctl_as("client-bob", &["token", "list"], None);
    assert_exit(&out, 77, &[]);
    let out = fleet.toolctl_as("client-bob", &["token", "revoke", &id_of(&drop)], None);
    assert_exit(&out, 77, &[]);

    // Revoked by a prefix of its id: a join with it is refused, saying so.
    let out = fleet.toolctl_as(
        "client-alice",
        &["token", "revoke", &id_of(&drop)[..8]],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("revoked"),
        "{}",
        text(&out.stderr)
    );
    let state = fleet.work.path().join("drop-state");
    let out = run_agent(
        &fleet,
        &state,
        &[format!("--join={drop}"), format!("--ca-pin={pin}")],
    );
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(log.contains("join token revoked"), "{log}");

    // Nothing to revoke twice, nor a used token, nor an unknown or too short id.
    fleet.start_agent("keep-1", &join_spec(&keep, &pin));
    fleet.wait_online(&["keep-1"], "hello");
    for (id, expect) in [
        (id_of(&drop), "revoked already"),
        (id_of(&keep), "used already"),
        ("ffffffffffffffff".to_string(), "no join token"),
        ("abc".to_string(), "not a token id"),
    ] {
        let out = fleet.toolctl_as("client-alice", &["token", "revoke", &id], None);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{id}: {err}");
        assert!(err.contains(expect), "{id}: expected {expect:?} in {err}");
    }
    let out = fleet.toolctl_as("client-alice", &["token", "list", "--json"], None);
    let listed: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let states: Vec<(&str, &str)> = listed
        .iter()
        .map(|t| (t["host_id"].as_str().unwrap(), t["state"].as_str().unwrap()))
        .collect();
    assert!(
        states.contains(&("drop-1", "revoked")) && states.contains(&("keep-1", "used")),
        "{states:?}"
    );
    let revoked = audit(&fleet, "join_token_revoked");
    assert_eq!(
        revoked.iter().filter(|r| r["outcome"] == "granted").count(),
        1,
        "{revoked:?}"
    );
}

/// Someone who could write an agent's state directory made its enrollment directory first (to
/// put their own certificate there later): the agent does not join into it, and its token is
/// left unused; made by the agent, it joins.
#[test]
fn an_enrollment_directory_another_user_made_stops_the_agent() {
    use std::os::unix::fs::PermissionsExt;
    let mut fleet = enrolling_fleet(&["a"], &[]);
    let (tok, pin) = token(&fleet, "x-1", &[]);
    let state = fleet.work.path().join("planted");
    let enroll = state.join("enroll");
    std::fs::create_dir_all(&enroll).unwrap();
    std::fs::set_permissions(&enroll, std::fs::Permissions::from_mode(0o777)).unwrap();
    let args = [
        format!("--join={tok}"),
        format!("--ca-pin={pin}"),
        "--host-id=x-1".to_string(),
    ];
    let out = run_agent(&fleet, &state, &args);
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(
        log.contains(&enroll.display().to_string()) && log.contains("lets other users write it"),
        "{log}"
    );
    assert!(!enroll.join("identity.pem").exists());
    std::os::unix::fs::chown(&enroll, Some(65534), None).unwrap();
    std::fs::set_permissions(&enroll, std::fs::Permissions::from_mode(0o700)).unwrap();
    let out = run_agent(&fleet, &state, &args);
    assert!(
        text(&out.stderr).contains("owned by uid 65534"),
        "{}",
        text(&out.stderr)
    );
    // The token was never used: the host joins with it into a directory of its own.
    fleet.start_agent("x-1", &join_spec(&tok, &pin));
    fleet.wait_online(&["x-1"], "hello");
}

/// A renewed certificate the agent cannot write (its state directory's disk is full) is kept
/// and written once there is room, not asked for again: each request has the coordinator
/// sign one more. (Needs root, for the mount.)
#[test]
fn a_renewed_certificate_that_cannot_be_written_is_written_later_not_asked_again() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test mounts a file system: run it as root"
    );
    let fleet_extra = ["--agent-cert-ttl=9s"];
    let mut fleet = enrolling_fleet(&["a"], &fleet_extra);
    let enroll = fleet.work.path().join("host-w-1/state/enroll");
    std::fs::create_dir_all(&enroll).unwrap();
    let mount = |args: &[&str]| {
        let out = Command::new("mount").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "mount {args:?}: {}",
            text(&out.stderr)
        );
    };
    mount(&[
        "-t",
        "tmpfs",
        "-o",
        "size=256k,mode=0700",
        "agent-enroll",
        enroll.to_str().unwrap(),
    ]);
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(enroll.clone());
    let (tok, pin) = token(&fleet, "w-1", &[]);
    fleet.start_agent("w-1", &join_spec(&tok, &pin));
    fleet.wait_online(&["w-1"], "hello");
    let file = identity_file(&fleet, "w-1");
    let first = std::fs::read_to_string(&file).unwrap();

    // Full: the renewal (at two thirds of 9 s) is granted, and cannot be written.
    let filler = enroll.join("filler");
    let _ = std::fs::write(&filler, vec![0u8; 512 << 10]);
    let granted = || {
        audit(&fleet, "renewal")
            .iter()
            .filter(|r| r["outcome"] == "granted" && r["host"] == "w-1")
            .count()
    };
    wait_for("a renewal granted", Duration::from_secs(15), || {
        (granted() >= 1).then_some(())
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), first);
    assert_eq!(
        granted(),
        1,
        "asked again while the first could not be written"
    );

    // Room again: the renewed certificate is written, without another renewal.
    std::fs::remove_file(&filler).unwrap();
    wait_for(
        "the renewed certificate written",
        Duration::from_secs(10),
        || (std::fs::read_to_string(&file).unwrap() != first).then_some(()),
    );
    assert_eq!(granted(), 1);
    let log = fleet.agents["w-1"].log();
    assert!(
        log.contains("the certificate was renewed, but cannot be written")
            && log.contains("No space left on device"),
        "{log}"
    );
}
