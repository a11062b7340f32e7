//! Metrics: the coordinator's and the agents' `/metrics` after real calls, checked by
//! `promtool` and scraped by a real Prometheus server.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use toolsrv_tests::{
    AgentSpec, Fleet, Prometheus, assert_exit, bin, ensure_program, http_get, run_bounded, text,
    wait_for,
};

/// The label names any toolsrv series may carry: each takes a handful of values, none a host
/// id, client name, tool name or argument.
const BOUNDED_LABELS: &[&str] = &[
    "kind",
    "status",
    "stream",
    "decision",
    "state",
    "certificate",
    "outcome",
    "role",
    "source",
    "le",
    // `toolsrv_settings_info`: two files, one digest each at a time (the one in force).
    "file",
    "sha256",
];

struct Metered {
    fleet: Fleet,
    coordinator: String,
    agents: Vec<String>,
}

fn metered_fleet() -> Metered {
    let mut fleet = Fleet::new(&["a", "b"]);
    fleet.tool(
        "hello.meta",
        r#"{"description": "Say hello", "cmd": "echo hello; echo to-stderr >&2"}"#,
        false,
    );
    // Ports the system chooses, read back from each process's log: a port picked in advance
    // can be taken meanwhile by any connection's own port.
    fleet.start_coordinator(&["--metrics-listen=127.0.0.1:0"]);
    for id in ["a", "b"] {
        let spec = AgentSpec {
            args: vec!["--metrics-listen=127.0.0.1:0".into()],
            ..AgentSpec::default()
        };
        fleet.start_agent(id, &spec);
    }
    fleet.wait_online(&["a", "b"], "hello");
    let coordinator = fleet.coordinator.as_ref().unwrap().metrics_addr();
    let agents = ["a", "b"]
        .map(|id| fleet.agents[id].metrics_addr())
        .to_vec();
    Metered {
        fleet,
        coordinator,
        agents,
    }
}

fn scrape(addr: &str) -> String {
    let (status, body) = http_get(addr, "/metrics").unwrap();
    assert_eq!(status, 200, "GET /metrics on {addr}: {body}");
    body
}

/// The value of the sample `series` (name and labels exactly as printed), if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// Every label name used in an exposition.
fn label_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((_, labels)) = line.split_once('{') else {
            continue;
        };
        let labels = labels.split('}').next().unwrap_or_default();
        for pair in labels.split(',').filter(|p| !p.is_empty()) {
            names.insert(pair.split('=').next().unwrap().to_string());
        }
    }
    names
}

fn promtool_check(exposition: &str, what: &str) {
    let promtool = ensure_program("promtool", "prometheus").unwrap();
    let mut cmd = Command::new(promtool);
    cmd.args(["check", "metrics"]);
    let out = run_bounded(cmd, Some(exposition), Duration::from_secs(30));
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics on {what}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

#[test]
fn calls_show_in_the_metrics_that_promtool_and_prometheus_accept() {
    let m = metered_fleet();
    let fleet = &m.fleet;
    for host in ["a", "b"] {
        let out = fleet.toolctl(&["call", host, "hello", "{}"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    let missing = fleet.toolctl(&["call", "a", "no_such_tool", "{}"]);
    assert!(!missing.status.success());
    let fanout = fleet.toolctl(&["fanout", "all", "hello", "{}"]);
    assert!(fanout.status.success(), "{}", text(&fanout.stderr));
    // FindTools: one request matched, one matched nothing, one refused.
    assert_exit(&fleet.toolctl(&["find", "all", "say hello"]), 0, &[]);
    assert_exit(
        &fleet.toolctl(&["find", "all", "quantum chromodynamics"]),
        1,
        &[],
    );
    assert_exit(
        &fleet.toolctl(&["find", "a,,b", "say hello"]),
        64,
        &["empty term"],
    );

    let coordinator = scrape(&m.coordinator);
    for (series, want) in [
        (r#"toolsrv_calls_total{kind="call",status="ok"}"#, 2.0),
        (
            r#"toolsrv_calls_total{kind="call",status="unknown_tool"}"#,
            1.0,
        ),
        (r#"toolsrv_calls_total{kind="fanout",status="ok"}"#, 2.0),
        (r#"toolsrv_calls_in_flight{kind="call"}"#, 0.0),
        (r#"toolsrv_call_duration_seconds_count{kind="call"}"#, 3.0),
        ("toolsrv_fanout_hosts_count", 1.0),
        ("toolsrv_fanout_hosts_sum", 2.0),
        // "hello\n" and "to-stderr\n" from four runs.
        (r#"toolsrv_streamed_bytes_total{stream="stdout"}"#, 24.0),
        (r#"toolsrv_streamed_bytes_total{stream="stderr"}"#, 40.0),
        (r#"toolsrv_agents{state="online"}"#, 2.0),
        (r#"toolsrv_agents{state="offline"}"#, 0.0),
        ("toolsrv_agent_attachments_total", 2.0),
        ("toolsrv_views_passed_over_total", 0.0),
        ("toolsrv_requests_refused_total", 0.0),
        ("toolsrv_catalog_revision", 1.0),
        ("toolsrv_sessions", 0.0),
        ("toolsrv_audit_log_failing", 0.0),
        ("toolsrv_policy_file_refused", 0.0),
        ("toolsrv_host_labels_file_refused", 0.0),
        (r#"toolsrv_find_requests_total{outcome="matched"}"#, 1.0),
        (r#"toolsrv_find_requests_total{outcome="no_match"}"#, 1.0),
        (r#"toolsrv_find_requests_total{outcome="refused"}"#, 1.0),
        (r#"toolsrv_find_duration_seconds_count"#, 2.0),
        // Both hosts resolve `hello` the same way: one document.
        ("toolsrv_find_index_documents", 1.0),
        ("toolsrv_find_index_deferred", 0.0),
        // No encoder: no text is embedded, reused or kept.
        (r#"toolsrv_find_index_texts_total{source="embedded"}"#, 0.0),
        (r#"toolsrv_find_index_texts_total{source="kept"}"#, 0.0),
    ] {
        assert_eq!(
            sample(&coordinator, series),
            Some(want),
            "{series} in\n{coordinator}"
        );
    }
    let builds = sample(
        &coordinator,
        r#"toolsrv_find_index_builds_total{outcome="ok"}"#,
    );
    assert!(builds.is_some_and(|n| n >= 1.0), "{coordinator}");
    assert!(
        sample(&coordinator, "toolsrv_find_index_build_seconds_count") >= builds,
        "{coordinator}"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let expiry = sample(
        &coordinator,
        r#"toolsrv_certificate_expiry_timestamp_seconds{certificate="own"}"#,
    )
    .unwrap();
    assert!(expiry > now + 86_400.0, "expiry {expiry} vs now {now}");
    // The development certificates are far from expiry; the agents are connected.
    for role in ["own", "ca", "agent", "client"] {
        let series = format!(r#"toolsrv_certificates_expiring{{role="{role}"}}"#);
        assert_eq!(sample(&coordinator, &series), Some(0.0), "{series}");
    }
    let agents_expire = sample(
        &coordinator,
        r#"toolsrv_peer_certificate_earliest_expiry_timestamp_seconds{role="agent"}"#,
    )
    .unwrap();
    assert!(agents_expire > now + 86_400.0, "{agents_expire}");
    let memory = sample(&coordinator, "toolsrv_process_resident_memory_bytes").unwrap();
    assert!(memory > 1e6 && memory < 2e9, "{memory}");

    let agent_a = scrape(&m.agents[0]);
    for (series, want) in [
        (r#"toolsrv_agent_calls_total{status="ok"}"#, 2.0),
        ("toolsrv_agent_calls_running", 0.0),
        ("toolsrv_agent_link_up", 1.0),
        (r#"toolsrv_agent_tools{state="visible"}"#, 1.0),
        ("toolsrv_catalog_revision", 1.0),
    ] {
        assert_eq!(
            sample(&agent_a, series),
            Some(want),
            "{series} in\n{agent_a}"
        );
    }

    let settings = coordinator
        .lines()
        .filter(|l| l.starts_with("toolsrv_settings_info{"))
        .count();
    assert_eq!(
        settings, 2,
        "one series per settings file in\n{coordinator}"
    );

    for (exposition, what) in [(&coordinator, "the coordinator"), (&agent_a, "an agent")] {
        promtool_check(exposition, what);
        let unbounded: Vec<_> = label_names(exposition)
            .into_iter()
            .filter(|l| !BOUNDED_LABELS.contains(&l.as_str()))
            .collect();
        assert!(unbounded.is_empty(), "labels {unbounded:?} on {what}");
        assert!(
            exposition
                .lines()
                .filter(|l| !l.starts_with('#') && !l.is_empty())
                .all(|l| l.starts_with("toolsrv_")),
            "every series is toolsrv_-prefixed on {what}"
        );
    }

    // A real Prometheus scrapes all three (it asks for OpenMetrics) and can query the series.
    let mut targets = vec![m.coordinator.clone()];
    targets.extend(m.agents.iter().cloned());
    let prometheus = Prometheus::try_start(fleet.work.path(), &targets).unwrap();
    let healthy = wait_for(
        "Prometheus to scrape every target",
        Duration::from_secs(30),
        || {
            let list = prometheus.targets().ok()?;
            (list.len() == 3 && list.iter().all(|(_, health, _)| health == "up")).then_some(list)
        },
    );
    assert_eq!(healthy.len(), 3, "{healthy:?}");
    let ok_calls = wait_for(
        "toolsrv_calls_total in Prometheus",
        Duration::from_secs(30),
        || {
            let result = prometheus
                .query("toolsrv_calls_total%7Bkind%3D%22call%22%2Cstatus%3D%22ok%22%7D")
                .ok()?;
            result
                .first()
                .map(|r| r["value"][1].as_str().unwrap_or_default().to_string())
        },
    );
    assert_eq!(ok_calls, "2");
    let links = prometheus.query("sum(toolsrv_agent_link_up)").unwrap();
    assert_eq!(links[0]["value"][1], "2", "{links:?}");
    let online = prometheus
        .query("toolsrv_agents%7Bstate%3D%22online%22%7D")
        .unwrap();
    assert_eq!(online[0]["value"][1], "2", "{online:?}");
}

#[test]
fn a_stopped_agent_shows_offline_and_its_link_down() {
    let mut m = metered_fleet();
    m.fleet.agents.get_mut("b").unwrap().kill();
    let coordinator = wait_for("b offline in the metrics", Duration::from_secs(20), || {
        let text = scrape(&m.coordinator);
        (sample(&text, r#"toolsrv_agents{state="offline"}"#) == Some(1.0)).then_some(text)
    });
    assert_eq!(
        sample(&coordinator, r#"toolsrv_agents{state="online"}"#),
        Some(1.0)
    );
}

#[test]
fn a_metrics_port_in_use_stops_the_coordinator_saying_which_flag() {
    let fleet = Fleet::new(&[]);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let mut cmd = Command::new(bin("toolsrv"));
    cmd.arg("coordinator")
        .arg(format!("--listen=127.0.0.1:{}", fleet.port))
        .arg(format!("--metrics-listen={addr}"))
        .arg(format!("--tools={}", fleet.tools.display()))
        .args(fleet.pki.tls_args("coordinator"));
    let out = run_bounded(cmd, None, Duration::from_secs(20));
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&addr.to_string()) && err.contains("--metrics-listen"),
        "{err}"
    );
    drop(taken);
}
