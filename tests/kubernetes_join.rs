//! Joining with Kubernetes service account tokens, end to end against a stand-in for the
//! Kubernetes API's TokenReview endpoint (no cluster can run here): an agent started with
//! `--k8s-token-file` and `--ca FILE` gets a certificate for its pod's node, signed by an
//! intermediate CA, with the coordinator's join labels; it joins again by itself after its
//! certificate expired; and every refusal: a token the API does not know, an expired one, one
//! for another audience, another service account, a token not bound to a node, a `--host-id`
//! that is not the node, the coordinator's own API credentials refused, the API failing, a
//! coordinator that does not accept such tokens, and bad settings at start.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use toolsrv_testkit::{FakeKubeApi, ServiceAccountToken};
use toolsrv_tests::{AgentSpec, Fleet, Proc, bin, run_bounded, text, wait_for};
use toolsrv_tls::Identity;

const HELLO: &str = r#"{"description": "Say hello", "cmd": "echo hello"}"#;
const AGENT_SA: &str = "toolsrv/toolsrv-agent";

/// An intermediate CA signed by the fleet's CA, written as `signing.pem` (certificate, then
/// the root) and `signing-key.pem`: what a cluster would give the coordinator to sign with.
fn intermediate_ca(fleet: &Fleet) -> (PathBuf, PathBuf) {
    let root_key =
        rcgen::KeyPair::from_pem(&std::fs::read_to_string(fleet.pki.path("ca-key.pem")).unwrap())
            .unwrap();
    let root_pem = std::fs::read_to_string(fleet.pki.path("ca.pem")).unwrap();
    let root = rcgen::Issuer::from_ca_cert_pem(&root_pem, root_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "toolsrv agents (intermediate)");
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.signed_by(&key, &root).unwrap();
    let dir = fleet.work.path();
    let (cert_path, key_path) = (dir.join("signing.pem"), dir.join("signing-key.pem"));
    std::fs::write(&cert_path, cert.pem() + &root_pem).unwrap();
    toolsrv_testkit::write_key(&key_path, &key.serialize_pem()).unwrap();
    (cert_path, key_path)
}

/// The coordinator's flags for joins reviewed by `api`, signing with an intermediate CA.
fn kubernetes_flags(fleet: &Fleet, api: &FakeKubeApi, ttl: &str) -> Vec<String> {
    let (cert, key) = intermediate_ca(fleet);
    vec![
        format!("--signing-ca-cert={}", cert.display()),
        format!("--signing-ca-key={}", key.display()),
        format!("--agent-cert-ttl={ttl}"),
        format!("--k8s-join-service-account={AGENT_SA}"),
        format!("--k8s-api={}", api.url),
        format!("--k8s-api-ca={}", api.ca.display()),
        format!("--k8s-api-token-file={}", api.token_file.display()),
        "--k8s-join-label=runtime=kubernetes".into(),
        format!("--audit-log={}", fleet.audit_log().display()),
    ]
}

fn start(fleet: &mut Fleet, flags: &[String]) {
    fleet.tool("hello.meta", HELLO, false);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    fleet.start_coordinator(&flags);
}

fn pod_token(node: Option<&str>) -> ServiceAccountToken {
    ServiceAccountToken {
        service_account: AGENT_SA.into(),
        audiences: vec!["toolsrv".into()],
        node: node.map(String::from),
        pod: "toolsrv-agent-x7k2p".into(),
        expired: false,
    }
}

/// Writes `token` where a kubelet would project it; the file's path.
fn token_file(fleet: &Fleet, name: &str, token: &str) -> PathBuf {
    let path = fleet.work.path().join(format!("{name}.token"));
    std::fs::write(&path, format!("{token}\n")).unwrap();
    path
}

/// Flags of an agent joining with the token in `file`, trusting the CA file.
fn k8s_spec(fleet: &Fleet, file: &Path, extra: &[&str]) -> AgentSpec {
    let mut flags = vec![
        format!("--k8s-token-file={}", file.display()),
        format!("--ca={}", fleet.pki.path("ca.pem").display()),
    ];
    flags.extend(extra.iter().map(|s| s.to_string()));
    AgentSpec {
        enroll: Some(flags),
        ..AgentSpec::default()
    }
}

/// Runs `toolsrv agent` joining with the token in `file` (fresh state) for at most 20 s.
fn run_agent(fleet: &Fleet, name: &str, file: &Path, extra: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(bin("toolsrv"));
    cmd.arg("agent")
        .arg(format!("--coordinator={}", fleet.url()))
        .arg(format!(
            "--state-dir={}",
            fleet.work.path().join(format!("{name}-state")).display()
        ))
        .arg("--sandbox=off")
        .arg(format!("--k8s-token-file={}", file.display()))
        .arg(format!("--ca={}", fleet.pki.path("ca.pem").display()))
        .args(extra)
        .env("TOOLSRV_LOG", "info");
    run_bounded(cmd, None, Duration::from_secs(20))
}

fn joins(fleet: &Fleet) -> Vec<Value> {
    fleet
        .audit_records()
        .into_iter()
        .filter(|r| r["event"] == "join")
        .collect()
}

#[test]
fn a_pod_joins_as_its_node_with_its_service_account_token() {
    let mut fleet = Fleet::new(&["a"]);
    let api = FakeKubeApi::start(fleet.work.path()).unwrap();
    api.add_token("jwt-node-a", pod_token(Some("Node-A")));
    let flags = kubernetes_flags(&fleet, &api, "2h");
    start(&mut fleet, &flags);
    let file = token_file(&fleet, "node-a", "jwt-node-a");
    fleet.start_agent("node-a", &k8s_spec(&fleet, &file, &["--host-id=node-a"]));
    fleet.wait_online(&["node-a"], "hello");

    // The certificate names the node and the coordinator's join labels, and comes with the
    // intermediate that signed it; the coordinator verifies that chain on every connection.
    let pem = std::fs::read_to_string(
        fleet
            .work
            .path()
            .join("host-node-a/state/enroll/identity.pem"),
    )
    .unwrap();
    let certs = toolsrv_tls::enroll::certs_from_pem(&pem).unwrap();
    assert_eq!(certs.len(), 2, "leaf and intermediate: {pem}");
    assert_eq!(
        toolsrv_tls::identity_of(&certs[0]).unwrap(),
        Identity::Agent("node-a".into())
    );
    let (_, leaf) = x509_parser::parse_x509_certificate(certs[0].as_ref()).unwrap();
    let (_, intermediate) = x509_parser::parse_x509_certificate(certs[1].as_ref()).unwrap();
    assert_eq!(leaf.issuer(), intermediate.subject());
    let uris: Vec<String> = leaf
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect();
    assert!(
        uris.iter()
            .any(|u| u.contains("toolsrv://label/runtime=kubernetes")),
        "{uris:?}"
    );
    let hosts = fleet.hosts();
    let host = hosts.iter().find(|h| h["host_id"] == "node-a").unwrap();
    assert_eq!(host["trusted_labels"]["runtime"], "kubernetes", "{host}");
    assert!(fleet.toolctl(&["call", "node-a", "hello"]).status.success());

    // The review asked for our audience, with the coordinator's own credentials.
    let reviews = api.reviews();
    assert_eq!(reviews.len(), 1, "{reviews:?}");
    assert_eq!(reviews[0]["spec"]["token"], "jwt-node-a");
    assert_eq!(
        reviews[0]["spec"]["audiences"],
        serde_json::json!(["toolsrv"])
    );

    // The audit record says how, for which pod; never the token.
    let joins = joins(&fleet);
    assert_eq!(joins.len(), 1, "{joins:?}");
    assert_eq!(joins[0]["outcome"], "granted");
    assert_eq!(joins[0]["host"], "node-a");
    assert_eq!(joins[0]["with"], "kubernetes");
    assert_eq!(joins[0]["kubernetes"]["service_account"], AGENT_SA);
    assert_eq!(joins[0]["kubernetes"]["pod"], "toolsrv-agent-x7k2p");
    assert!(
        !fleet
            .audit_records()
            .iter()
            .any(|r| r.to_string().contains("jwt-node-a"))
    );
}

#[test]
fn a_pod_whose_certificate_expired_joins_again_by_itself() {
    let mut fleet = Fleet::new(&["a"]);
    let api = FakeKubeApi::start(fleet.work.path()).unwrap();
    api.add_token("jwt-b", pod_token(Some("node-b")));
    let flags = kubernetes_flags(&fleet, &api, "5s");
    start(&mut fleet, &flags);
    let file = token_file(&fleet, "node-b", "jwt-b");
    fleet.start_agent("node-b", &k8s_spec(&fleet, &file, &[]));
    fleet.wait_online(&["node-b"], "hello");
    fleet.agents.remove("node-b");
    std::thread::sleep(Duration::from_secs(6));

    // The kubelet has rotated the token meanwhile; the agent reads the new one.
    api.add_token("jwt-b-rotated", pod_token(Some("node-b")));
    std::fs::write(&file, "jwt-b-rotated").unwrap();
    fleet.start_agent("node-b", &k8s_spec(&fleet, &file, &[]));
    fleet.wait_online(&["node-b"], "hello");
    let reviews = api.reviews();
    assert_eq!(
        reviews.last().unwrap()["spec"]["token"],
        "jwt-b-rotated",
        "{reviews:?}"
    );
    assert_eq!(joins(&fleet).len(), 2);
}

#[test]
fn tokens_the_api_does_not_vouch_for_are_refused_with_the_reason() {
    let mut fleet = Fleet::new(&["a"]);
    let api = FakeKubeApi::start(fleet.work.path()).unwrap();
    api.add_token("jwt-ok", pod_token(Some("node-c")));
    let mut expired = pod_token(Some("node-c"));
    expired.expired = true;
    api.add_token("jwt-expired", expired);
    let mut other_audience = pod_token(Some("node-c"));
    other_audience.audiences = vec!["vault".into()];
    api.add_token("jwt-vault", other_audience);
    let mut other_account = pod_token(Some("node-c"));
    other_account.service_account = "default/default".into();
    api.add_token("jwt-default", other_account);
    api.add_token("jwt-no-pod", pod_token(None));
    let flags = kubernetes_flags(&fleet, &api, "1h");
    start(&mut fleet, &flags);

    for (token, expect) in [
        ("jwt-unknown", "token lookup failed"),
        ("jwt-expired", "has expired"),
        ("jwt-vault", "audiences is invalid"),
        ("jwt-default", "default/default may not join"),
        ("jwt-no-pod", "authentication.kubernetes.io/node-name"),
    ] {
        let file = token_file(&fleet, token, token);
        let out = run_agent(&fleet, token, &file, &[]);
        let log = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{token}: {log}");
        assert!(
            log.contains(expect),
            "{token}: expected {expect:?} in {log}"
        );
    }

    // A --host-id that is not the pod's node.
    let file = token_file(&fleet, "ok", "jwt-ok");
    let out = run_agent(&fleet, "liar", &file, &["--host-id=db-1"]);
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(
        log.contains("bound to a pod on node `node-c`") && log.contains("--host-id db-1"),
        "{log}"
    );

    // An empty or oversized token file is refused before anything is sent.
    let empty = token_file(&fleet, "empty", "");
    let out = run_agent(&fleet, "empty", &empty, &[]);
    assert!(
        text(&out.stderr).contains("not a service account token"),
        "{}",
        text(&out.stderr)
    );
    let huge = token_file(&fleet, "huge", &"x".repeat(100 * 1024));
    let out = run_agent(&fleet, "huge", &huge, &[]);
    assert!(
        text(&out.stderr).contains("not a service account token"),
        "{}",
        text(&out.stderr)
    );

    let refused = joins(&fleet)
        .into_iter()
        .filter(|j| j["outcome"] == "refused")
        .count();
    assert_eq!(refused, 6, "{:?}", joins(&fleet));
    assert!(
        fleet.hosts().iter().all(|h| h["host_id"] != "node-c"),
        "no refused pod attached"
    );
}

#[test]
fn an_api_that_cannot_review_leaves_the_agent_retrying() {
    let mut fleet = Fleet::new(&["a"]);
    let api = FakeKubeApi::start(fleet.work.path()).unwrap();
    api.add_token("jwt-d", pod_token(Some("node-d")));
    let mut flags = kubernetes_flags(&fleet, &api, "1h");
    // The coordinator's own credentials are not the API's.
    let wrong = fleet.work.path().join("wrong-token");
    std::fs::write(&wrong, "not-the-coordinators").unwrap();
    flags.retain(|f| !f.starts_with("--k8s-api-token-file"));
    flags.push(format!("--k8s-api-token-file={}", wrong.display()));
    start(&mut fleet, &flags);
    let file = token_file(&fleet, "node-d", "jwt-d");
    fleet.start_agent("node-d", &k8s_spec(&fleet, &file, &[]));
    let agent = fleet.agents.get("node-d").unwrap();
    wait_for(
        "the agent to say why it retries",
        Duration::from_secs(20),
        || agent.log().contains("system:auth-delegator").then_some(()),
    );

    // Fixed (the kubelet writes the right token into the file), the agent's retry joins.
    std::fs::write(&wrong, toolsrv_testkit::COORDINATOR_TOKEN).unwrap();
    fleet.wait_online(&["node-d"], "hello");

    // An API failing with 500 is UNAVAILABLE too: the agent retries, it does not exit.
    api.fail_with(Some(500));
    let file = token_file(&fleet, "node-e", "jwt-d");
    let mut cmd = Command::new(bin("toolsrv"));
    cmd.arg("agent")
        .arg(format!("--coordinator={}", fleet.url()))
        .arg(format!(
            "--state-dir={}",
            fleet.work.path().join("e-state").display()
        ))
        .arg("--sandbox=off")
        .arg(format!("--k8s-token-file={}", file.display()))
        .arg(format!("--ca={}", fleet.pki.path("ca.pem").display()));
    let mut proc = Proc::spawn("node-e", cmd, fleet.work.path());
    wait_for("a retry on HTTP 500", Duration::from_secs(20), || {
        let log = proc.log();
        (log.contains("HTTP 500") && log.contains("retrying")).then_some(())
    });
    assert!(proc.check_alive().is_ok(), "{}", proc.log());
}

#[test]
fn a_coordinator_without_kubernetes_join_refuses_such_tokens_and_bad_settings_stop_it() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool("hello.meta", HELLO, false);
    let signing = [
        format!("--signing-ca-cert={}", fleet.pki.path("ca.pem").display()),
        format!(
            "--signing-ca-key={}",
            fleet.pki.path("ca-key.pem").display()
        ),
    ];
    let args: Vec<&str> = signing.iter().map(String::as_str).collect();
    fleet.start_coordinator(&args);
    let file = token_file(&fleet, "f", "jwt-f");
    let out = run_agent(&fleet, "f", &file, &[]);
    let log = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{log}");
    assert!(
        log.contains("does not accept Kubernetes service account tokens"),
        "{log}"
    );

    // Bad settings stop the coordinator before it serves, naming the flag.
    let api = FakeKubeApi::start(fleet.work.path()).unwrap();
    let base = |extra: &[String]| {
        let mut cmd = Command::new(bin("toolsrv"));
        cmd.arg("coordinator")
            .arg("--listen=127.0.0.1:0")
            .arg(format!(
                "--tools={}",
                fleet.work.path().join("tools").display()
            ))
            .args(toolsrv_testkit::tls_args(&toolsrv_testkit::stem_files(
                fleet.pki.root(),
                "coordinator",
            )))
            .args(extra);
        run_bounded(cmd, None, Duration::from_secs(20))
    };
    let api_flags = vec![
        format!("--k8s-api={}", api.url),
        format!("--k8s-api-ca={}", api.ca.display()),
    ];
    for (extra, expect) in [
        (
            [
                vec![format!("--k8s-join-service-account={AGENT_SA}")],
                api_flags.clone(),
            ]
            .concat(),
            "needs a CA to sign with",
        ),
        (
            [
                signing.to_vec(),
                vec!["--k8s-join-service-account=agents".into()],
                api_flags.clone(),
            ]
            .concat(),
            "expected NAMESPACE/NAME",
        ),
        (
            [
                signing.to_vec(),
                vec![format!("--k8s-join-service-account={AGENT_SA}")],
            ]
            .concat(),
            "needs the Kubernetes API",
        ),
        (
            [
                signing.to_vec(),
                vec![
                    format!("--k8s-join-service-account={AGENT_SA}"),
                    "--k8s-api=http://127.0.0.1:1".into(),
                ],
            ]
            .concat(),
            "over https only",
        ),
        (
            [
                signing.to_vec(),
                vec![
                    format!("--k8s-join-service-account={AGENT_SA}"),
                    "--k8s-join-label=bad key=x".into(),
                ],
                api_flags.clone(),
            ]
            .concat(),
            "--k8s-join-label",
        ),
    ] {
        let out = base(&extra);
        let log = text(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{extra:?}: {log}");
        assert!(
            log.contains(expect),
            "{extra:?}: expected {expect:?} in {log}"
        );
    }
}

/// A peer without a certificate sends bogus joins in a loop, service account tokens the API
/// does not know and join tokens that do not exist: after 10 refusals its joins are refused
/// unexamined (RESOURCE_EXHAUSTED, saying when to come back), so the API reviews at most 10 of
/// them and the audit log holds a dozen records rather than one per request (before: every
/// request reviewed and recorded), also those that claim to be relayed by a replica. A pod
/// with a good token on the same address joins once it has waited.
#[test]
fn an_address_that_keeps_sending_bad_joins_is_slowed_and_not_recorded_each_time() {
    use toolsrv_proto::v1::JoinRequest;
    use toolsrv_proto::v1::enrollment_client::EnrollmentClient;

    let mut fleet = Fleet::new(&["a"]);
    let api = FakeKubeApi::start(fleet.work.path()).unwrap();
    api.add_token("jwt-good", pod_token(Some("node-g")));
    let flags = kubernetes_flags(&fleet, &api, "1h");
    start(&mut fleet, &flags);

    const SENT: usize = 200;
    let started = std::time::Instant::now();
    let codes = toolsrv_tests::runtime().block_on(async {
        let mut client = EnrollmentClient::new(toolsrv_tests::anonymous_channel(&fleet).await);
        let mut codes = Vec::new();
        for i in 0..SENT {
            let mut join = JoinRequest {
                csr_der: b"not even a CSR".to_vec(),
                ..JoinRequest::default()
            };
            if i % 2 == 0 {
                join.kubernetes_token = format!("jwt-bogus-{i}");
            } else {
                join.token = format!("tsj_bogus{i:040}");
            }
            // Half of them claim to be relayed by a replica (whose joins the replica that
            // took them counted): without a coordinator certificate, that counts for nothing.
            let mut join = tonic::Request::new(join);
            if i % 4 < 2 {
                join.metadata_mut()
                    .insert("toolsrv-relayed-by", "r9".parse().unwrap());
            }
            let err = client.join(join).await.unwrap_err();
            codes.push((err.code(), err.message().to_string()));
        }
        codes
    });
    let took = started.elapsed();
    // Examined: the first 10, and one more per 6 s the loop took.
    let examined = 10 + (took.as_secs() / 6) as usize + 1;
    let throttled: Vec<_> = codes
        .iter()
        .filter(|(code, _)| *code == tonic::Code::ResourceExhausted)
        .collect();
    assert!(
        throttled.len() >= SENT - examined,
        "{} of {SENT} throttled in {took:?}; the first answers: {:?}",
        throttled.len(),
        &codes[..12]
    );
    assert!(
        throttled[0]
            .1
            .contains("too many refused joins from 127.0.0.1")
            && throttled[0].1.contains("come back in"),
        "{:?}",
        throttled[0]
    );
    let reviews = api.reviews().len();
    assert!(reviews <= examined, "{reviews} reviews asked of the API");
    let records = joins(&fleet);
    assert!(
        records.len() <= examined + 1,
        "{} join records: {records:?}",
        records.len()
    );
    assert!(records.iter().any(|r| r["outcome"] == "throttled"));
    let log = fleet.coordinator.as_ref().unwrap().log();
    assert_eq!(
        log.matches("joins refused unexamined").count(),
        1,
        "warned once per run: {log}"
    );

    // Once it has waited, a good token from the same address is examined, and granted.
    std::thread::sleep(Duration::from_secs(7));
    let file = token_file(&fleet, "node-g", "jwt-good");
    fleet.start_agent("node-g", &k8s_spec(&fleet, &file, &[]));
    fleet.wait_online(&["node-g"], "hello");
    assert_eq!(joins(&fleet).last().unwrap()["outcome"], "granted");
}
