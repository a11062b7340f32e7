//! `toolctl tools` and `toolctl describe`: a host's tools, in the shapes `toolctl local` prints.

use crate::cli::quote::printable;
use crate::{definition_json, list_entry};

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
    let entries: Vec<_> = listing.tools.iter().map(list_entry).collect();
    crate::cli::print_listing(&entries, json)
}

pub async fn describe(conn: &ConnArgs, host: &str, tool: &str) -> u8 {
    let remote = match connect(conn).await {
        Ok(remote) => remote,
        Err(code) => return code,
    };
    let described = match remote.client.describe_tool(host, tool).await {
        Ok(described) => described,
        Err(e) => {
            return remote.fail(
                &format!("cannot describe tool `{tool}` on host `{host}`"),
                &e,
            );
        }
    };
    if described.host_only {
        eprintln!(
            "toolctl: note: `{}` is host `{}`'s own tool, not the catalog's: what it says is the host's word",
            printable(tool),
            printable(host)
        );
    }
    // What a call would meet, when it is not simply run.
    if let Some(policy) = described
        .policy
        .as_ref()
        .map(crate::shape::PolicyJson::from)
        && let Some(note) = policy.note()
    {
        let why = if policy.denial.is_empty() {
            String::new()
        } else {
            format!(" ({})", policy.denial)
        };
        eprintln!(
            "toolctl: note: a call of `{}` on host `{}` by you: {}{}",
            printable(tool),
            printable(host),
            printable(&note),
            printable(&why)
        );
    }
    match definition_json(&described.definition) {
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
    use crate::{CallerPolicy, PolicyEffect};
    use crate::{ToolDefinition, ToolStatus};

    use super::*;

    #[test]
    fn table_matches_local_list() {
        let tools = [
            ToolStatus {
                name: "disk_usage".into(),
                visible: true,
                variant: Some(1),
                description: "Disk usage".into(),
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
            ToolStatus {
                name: "wipe".into(),
                visible: true,
                description: "Wipe\u{1b}[2J it".into(),
                definition: Some(ToolDefinition::default()),
                policy: Some(CallerPolicy {
                    effect: PolicyEffect::Approve as i32,
                    rule: Some(3),
                    approvers: vec!["oncall-\u{1b}[2J".into()],
                    ..Default::default()
                }),
                ..Default::default()
            },
        ];
        let entries: Vec<_> = tools.iter().map(list_entry).collect();
        let mut out = Vec::new();
        crate::cli::write_listing(&mut out, &entries).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "disk_usage  Disk usage [variant 1]\n\
             ls          (hidden) no variant matches this host (variant 0: os is linux)\n\
             true        \n\
             wipe        Wipe\\u{1b}[2J it [waits for approval by oncall-\\u{1b}[2J: rule 3]\n"
        );
    }
}
