//! `toolctl hosts`: the fleet as a table or a JSON array.

use std::io::Write;

use crate::HostInfo;
use serde_json::{Value, json};

use super::{ConnArgs, connect, write_json, write_table, written};

pub async fn hosts(conn: &ConnArgs, json: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let hosts = match remote.client.hosts().await {
        Ok(hosts) => hosts,
        Err(e) => return remote.fail("cannot list hosts", &e),
    };
    let mut out = std::io::stdout().lock();
    let result = if json {
        let hosts: Vec<Value> = hosts.iter().map(host_json).collect();
        write_json(&mut out, &hosts)
    } else {
        write_hosts(&mut out, &hosts, now_ms())
    };
    written(result, "the host list")
}

use toolsrv_proto::unix_ms as now_ms;

use crate::host_state_name as state_name;

/// One host as a JSON object; labels keep their sorted order.
fn host_json(h: &HostInfo) -> Value {
    let facts = h.facts.clone().unwrap_or_default();
    json!({
        "host_id": h.host_id,
        "state": state_name(h.state),
        "os": facts.os,
        "arch": facts.arch,
        "hostname": facts.hostname,
        "kernel": facts.kernel,
        "labels": facts.labels,
        "sandbox": sandbox_json(facts.sandbox.as_ref()),
        "trusted_labels": h.trusted_labels.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "agent_version": h.agent_version,
        "visible_tools": h.visible_tools,
        "calls_in_flight": h.calls_in_flight,
        "max_concurrent_calls": h.max_concurrent_calls,
        "view_revision": h.view_revision,
        "last_seen_unix_ms": h.last_seen_unix_ms,
        "connected_unix_ms": h.connected_unix_ms,
        "replica": (!h.replica.is_empty()).then_some(&h.replica),
    })
}

/// What the host's agent enforces on its calls; `null` for an agent that reports nothing.
fn sandbox_json(sandbox: Option<&crate::SandboxFacts>) -> Value {
    match sandbox {
        None => Value::Null,
        Some(s) => json!({
            "mode": s.mode, "level": s.level, "landlock_abi": s.landlock_abi, "cgroup": s.cgroup,
            "controllers": s.controllers, "kill": s.kill, "run_as": s.run_as, "missing": s.missing,
        }),
    }
}

/// The sandbox column: the level, `-` for an agent that reports none.
fn sandbox_cell(facts: &crate::HostFacts) -> String {
    match facts.sandbox.as_ref().map(|s| s.level.as_str()) {
        None | Some("") => "-".to_string(),
        Some(level) => level.to_string(),
    }
}

/// How long ago `then_ms` was, for people: `now`, `42s ago`, `5m ago`, `3h ago`, `2d ago`; `-` for never.
fn ago(now_ms: u64, then_ms: u64) -> String {
    if then_ms == 0 {
        return "-".to_string();
    }
    let secs = now_ms.saturating_sub(then_ms) / 1000;
    match secs {
        0 => "now".to_string(),
        1..60 => format!("{secs}s ago"),
        60..3600 => format!("{}m ago", secs / 60),
        3600..86_400 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86_400),
    }
}

fn write_hosts(out: &mut impl Write, hosts: &[HostInfo], now_ms: u64) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = hosts
        .iter()
        .map(|h| {
            let facts = h.facts.clone().unwrap_or_default();
            // Trusted labels (assigned by the coordinator) are marked `*`: policy matches only
            // those; the others are what the agent says of itself.
            let mut trusted: Vec<_> = h.trusted_labels.iter().collect();
            trusted.sort();
            let labels: Vec<String> = trusted
                .iter()
                .map(|(k, v)| format!("{k}={v}*"))
                .chain(
                    facts
                        .labels
                        .iter()
                        .filter(|(k, _)| !h.trusted_labels.contains_key(*k))
                        .map(|(k, v)| format!("{k}={v}")),
                )
                .collect();
            let labels = if labels.is_empty() {
                "-".to_string()
            } else {
                labels.join(",")
            };
            vec![
                h.host_id.clone(),
                state_name(h.state).to_string(),
                format!("{}/{}", facts.os, facts.arch),
                sandbox_cell(&facts),
                labels,
                h.visible_tools.to_string(),
                format!("{}/{}", h.calls_in_flight, h.max_concurrent_calls),
                ago(now_ms, h.last_seen_unix_ms),
            ]
        })
        .collect();
    write_table(
        out,
        &[
            "HOST",
            "STATE",
            "OS/ARCH",
            "SANDBOX",
            "LABELS",
            "TOOLS",
            "CALLS",
            "LAST SEEN",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use crate::HostFacts;

    use super::*;

    use crate::HostState;

    fn host(id: &str, state: HostState, labels: &[(&str, &str)], last_seen: u64) -> HostInfo {
        HostInfo {
            host_id: id.into(),
            state: state as i32,
            facts: Some(HostFacts {
                os: "linux".into(),
                arch: "amd64".into(),
                hostname: format!("{id}.example"),
                kernel: "6.1.0".into(),
                labels: labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
                sandbox: (id == "db-1").then(|| crate::SandboxFacts {
                    mode: "best-effort".into(),
                    level: "enforced".into(),
                    landlock_abi: 7,
                    cgroup: "v2".into(),
                    controllers: vec!["pids".into(), "memory".into()],
                    kill: "cgroup.kill".into(),
                    ..Default::default()
                }),
            }),
            agent_version: "0.1.0".into(),
            connected_unix_ms: 1_000,
            last_seen_unix_ms: last_seen,
            view_revision: 7,
            visible_tools: 12,
            calls_in_flight: 2,
            max_concurrent_calls: 16,
            trusted_labels: Default::default(),
            replica: String::new(),
        }
    }

    #[test]
    fn table_lists_every_host() {
        let now = 10_000_000;
        let hosts = [
            host(
                "db-1",
                HostState::Online,
                &[("role", "db"), ("az", "b")],
                now - 1_500,
            ),
            host("web-10", HostState::Offline, &[], now - 7_200_000),
        ];
        let mut out = Vec::new();
        write_hosts(&mut out, &hosts, now).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HOST    STATE    OS/ARCH      SANDBOX   LABELS        TOOLS  CALLS  LAST SEEN\n\
             db-1    online   linux/amd64  enforced  az=b,role=db  12     2/16   1s ago\n\
             web-10  offline  linux/amd64  -         -             12     2/16   2h ago\n"
        );
    }

    #[test]
    fn ages_are_coarse() {
        assert_eq!(ago(5_000, 0), "-");
        assert_eq!(ago(5_000, 4_500), "now");
        assert_eq!(ago(100_000, 58_000), "42s ago");
        assert_eq!(ago(400_000, 100_000), "5m ago");
        assert_eq!(ago(3 * 86_400_000, 1_000), "2d ago");
        // A clock behind the coordinator's is not a negative age.
        assert_eq!(ago(1_000, 9_000), "now");
    }

    #[test]
    fn json_has_every_field() {
        let value = host_json(&host("db-1", HostState::Online, &[("role", "db")], 5));
        assert_eq!(
            value,
            json!({
                "host_id": "db-1", "state": "online", "os": "linux", "arch": "amd64",
                "hostname": "db-1.example", "kernel": "6.1.0", "labels": {"role": "db"},
                "sandbox": {
                    "mode": "best-effort", "level": "enforced", "landlock_abi": 7, "cgroup": "v2",
                    "controllers": ["pids", "memory"], "kill": "cgroup.kill", "run_as": "",
                    "missing": [],
                },
                "trusted_labels": {},
                "agent_version": "0.1.0", "visible_tools": 12, "calls_in_flight": 2,
                "max_concurrent_calls": 16, "view_revision": 7, "last_seen_unix_ms": 5,
                "connected_unix_ms": 1000, "replica": null,
            })
        );
    }
}
