//! `toolctl tools` and `toolctl describe`: a host's tools, in the shapes `toolctl local` prints.

use std::io::Write;

use toolsrv_client::{ToolStatus, definition_json, list_entry};

use super::{ConnArgs, connect, exit, write_json, written};

pub async fn tools(conn: &ConnArgs, host: &str, all: bool, json: bool) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let listing = match remote.client.tools(host, all).await {
        Ok(listing) => listing,
        Err(e) => return remote.fail(&format!("cannot list the tools of host `{host}`"), &e),
    };
    let mut out = std::io::stdout().lock();
    let result = if json {
        let entries: Vec<_> = listing.tools.iter().map(list_entry).collect();
        write_json(&mut out, &entries)
    } else {
        write_tools(&mut out, &listing.tools)
    };
    written(result, "the tool list")
}

/// The same text table as `toolctl local list`.
fn write_tools(out: &mut impl Write, tools: &[ToolStatus]) -> std::io::Result<()> {
    let width = tools.iter().map(|t| t.name.len()).max().unwrap_or(0);
    for t in tools {
        let name = &t.name;
        if t.visible {
            let variant = t
                .variant
                .map(|i| format!(" [variant {i}]"))
                .unwrap_or_default();
            let desc = t.definition.as_ref().map_or("", |d| d.description.as_str());
            writeln!(out, "{name:width$}  {desc}{variant}")?;
        } else {
            writeln!(out, "{name:width$}  (hidden) {}", t.reason)?;
        }
    }
    Ok(())
}

pub async fn describe(conn: &ConnArgs, host: &str, tool: &str) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let definition = match remote.client.describe(host, tool).await {
        Ok(definition) => definition,
        Err(e) => {
            return remote.fail(
                &format!("cannot describe tool `{tool}` on host `{host}`"),
                &e,
            );
        }
    };
    match definition_json(&definition) {
        Ok(value) => written(
            write_json(&mut std::io::stdout().lock(), &value),
            "the definition",
        ),
        Err(e) => {
            eprintln!("toolctl: host `{host}` sent an unusable definition of `{tool}`: {e}");
            exit::INTERNAL
        }
    }
}

#[cfg(test)]
mod tests {
    use toolsrv_client::ToolDefinition;

    use super::*;

    #[test]
    fn table_matches_local_list() {
        let tools = [
            ToolStatus {
                name: "disk_usage".into(),
                visible: true,
                variant: Some(1),
                definition: Some(ToolDefinition {
                    description: "Disk usage".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ToolStatus {
                name: "ls".into(),
                visible: false,
                reason: "no variant matches this host (variant 0: os is linux)".into(),
                ..Default::default()
            },
            ToolStatus {
                name: "true".into(),
                visible: true,
                definition: Some(ToolDefinition::default()),
                ..Default::default()
            },
        ];
        let mut out = Vec::new();
        write_tools(&mut out, &tools).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "disk_usage  Disk usage [variant 1]\n\
             ls          (hidden) no variant matches this host (variant 0: os is linux)\n\
             true        \n"
        );
    }
}
