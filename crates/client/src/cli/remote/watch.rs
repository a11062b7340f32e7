//! `toolctl watch`: catalog and fleet changes as they happen, until Ctrl-C.

use std::io::Write;

use crate::{CatalogEvent, CatalogEventKind};
use serde_json::{Value, json};

use super::{ConnArgs, connect, exit, interrupted};

pub async fn watch(conn: &ConnArgs, json: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let what = "cannot watch the catalog";
    let mut stream = match remote.client.watch().await {
        Ok(stream) => stream,
        Err(e) => return remote.fail(what, &e),
    };
    loop {
        let event = tokio::select! {
            event = stream.next() => event,
            // Ctrl-C is how a watch is meant to end: not a failure.
            () = interrupted() => return 0,
        };
        match event {
            Some(Ok(event)) => {
                let line = if json {
                    event_json(&event).to_string()
                } else {
                    // Escaped as it is built, like every table: an invalid tool's reason is a
                    // line of its own.
                    event_line(&event)
                };
                let mut out = std::io::stdout().lock();
                if let Err(e) = writeln!(out, "{line}").and_then(|()| out.flush()) {
                    return super::written(Err(e), "the event");
                }
            }
            Some(Err(e)) => return remote.fail(what, &e),
            None => {
                eprintln!(
                    "toolctl: the coordinator at {} ended the watch: it is probably shutting down",
                    remote.addr
                );
                return exit::UNAVAILABLE;
            }
        }
    }
}

/// `host_online`, `registry`, ...; `unknown` for kinds this client does not know.
fn kind_name(kind: i32) -> String {
    CatalogEventKind::try_from(kind).map_or("unknown".to_string(), |k| {
        let name = k.as_str_name();
        name.strip_prefix("CATALOG_EVENT_KIND_")
            .unwrap_or(name)
            .to_lowercase()
    })
}

/// One event as text: the kind, the revision, the host or what changed in the registry; each
/// tool that became invalid follows on a line of its own with the reason. What hosts and files
/// named (hosts, tools, reasons) is escaped: a line break in it cannot start a line.
fn event_line(e: &CatalogEvent) -> String {
    use crate::cli::quote::printable;
    let mut line = format!("{:<12}  revision {}", kind_name(e.kind), e.revision);
    if !e.host.is_empty() {
        line.push_str(&format!("  host {}", printable(&e.host)));
    }
    if e.kind == CatalogEventKind::HostView as i32 {
        line.push_str(&format!("  view_revision {}", e.view_revision));
    }
    if e.kind == CatalogEventKind::Registry as i32 {
        let invalid: Vec<String> = e.invalid.iter().map(|t| t.name.clone()).collect();
        for (what, names) in [
            ("added", &e.added),
            ("changed", &e.changed),
            ("removed", &e.removed),
            ("invalid", &invalid),
        ] {
            if !names.is_empty() {
                line.push_str(&format!("  {what} {}", printable(&names.join(","))));
            }
        }
        if e.omitted > 0 {
            line.push_str(&format!("  and {} more", e.omitted));
        }
        for tool in &e.invalid {
            line.push_str(&format!(
                "\n{:<12}  {}: {}",
                "",
                printable(&tool.name),
                printable(&tool.reason)
            ));
        }
    }
    line
}

fn event_json(e: &CatalogEvent) -> Value {
    let mut value = json!({"kind": kind_name(e.kind), "revision": e.revision});
    if !e.host.is_empty() {
        value["host"] = json!(e.host);
    }
    if e.kind == CatalogEventKind::HostView as i32 {
        value["view_revision"] = json!(e.view_revision);
    }
    if e.kind == CatalogEventKind::Registry as i32 {
        value["added"] = json!(e.added);
        value["changed"] = json!(e.changed);
        value["removed"] = json!(e.removed);
        value["invalid"] = e
            .invalid
            .iter()
            .map(|t| json!({"name": t.name, "reason": t.reason}))
            .collect();
        value["omitted"] = json!(e.omitted);
    }
    value
}

#[cfg(test)]
mod tests {
    use crate::InvalidTool;

    use super::*;

    fn event(kind: CatalogEventKind, host: &str) -> CatalogEvent {
        CatalogEvent {
            kind: kind as i32,
            revision: 4,
            host: host.into(),
            view_revision: 3,
            ..CatalogEvent::default()
        }
    }

    #[test]
    fn events_print_kind_revision_and_host() {
        assert_eq!(
            event_line(&event(CatalogEventKind::Snapshot, "")),
            "snapshot      revision 4"
        );
        assert_eq!(
            event_line(&event(CatalogEventKind::HostView, "web-1")),
            "host_view     revision 4  host web-1  view_revision 3"
        );
        assert_eq!(
            event_json(&event(CatalogEventKind::HostOnline, "web-1")),
            json!({"kind": "host_online", "revision": 4, "host": "web-1"})
        );
        assert_eq!(kind_name(42), "unknown");
    }

    #[test]
    fn registry_events_say_which_tools_changed_and_why_one_is_invalid() {
        let mut e = event(CatalogEventKind::Registry, "");
        e.added = vec!["a".into(), "b".into()];
        e.removed = vec!["r".into()];
        e.invalid = vec![InvalidTool {
            name: "x".into(),
            reason: "invalid: /t/x.meta: field `tier`: `lukewarm` is not a tier".into(),
        }];
        assert_eq!(
            event_line(&e),
            "registry      revision 4  added a,b  removed r  invalid x\n\
             \x20             x: invalid: /t/x.meta: field `tier`: `lukewarm` is not a tier"
        );
        // A line break in a reason stays in its line.
        e.invalid[0].reason = "two\nlines".into();
        assert!(
            event_line(&e).ends_with("x: two\\nlines"),
            "{}",
            event_line(&e)
        );
        e.invalid[0].reason = "invalid: /t/x.meta: field `tier`: `lukewarm` is not a tier".into();
        assert_eq!(
            event_json(&e),
            json!({"kind": "registry", "revision": 4, "added": ["a", "b"], "changed": [],
                   "removed": ["r"], "omitted": 0,
                   "invalid": [{"name": "x", "reason": "invalid: /t/x.meta: field `tier`: `lukewarm` is not a tier"}]})
        );
    }
}
