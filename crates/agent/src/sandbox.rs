//! The coordinator's sandbox grants for this host, as the agent keeps them for its calls

use std::path::PathBuf;

use toolsrv_confine::Grant;
use toolsrv_proto::v1::{SandboxGrant, SandboxPolicy};

/// The grants of a `SandboxPolicy`, in order; a relative path (which would depend on the
/// agent's working directory) is left out with a warning.
pub fn grants(policy: SandboxPolicy) -> Vec<Grant> {
    policy.grants.into_iter().map(grant).collect()
}

fn paths(list: Vec<String>, what: &str) -> Vec<PathBuf> {
    list.into_iter()
        .map(PathBuf::from)
        .filter(|p| {
            let absolute = p.is_absolute();
            if !absolute {
                tracing::warn!(path = %p.display(), what, "ignoring a sandbox grant path that is not absolute");
            }
            absolute
        })
        .collect()
}

fn grant(g: SandboxGrant) -> Grant {
    Grant {
        tools: g.tools,
        read: paths(g.read, "read"),
        write: paths(g.write, "write"),
        network: g.network,
        memory: (g.memory_bytes > 0).then_some(g.memory_bytes),
        pids: (g.pids > 0).then_some(g.pids),
        cpu_millis: (g.cpu_millis > 0).then_some(g.cpu_millis),
        env: g.env,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_means_the_default_and_relative_paths_are_dropped() {
        let got = grants(SandboxPolicy {
            grants: vec![SandboxGrant {
                tools: vec!["system_*".into()],
                read: vec!["/var/log".into(), "relative".into()],
                write: vec!["/srv/out".into()],
                network: Some(false),
                memory_bytes: 512 << 20,
                pids: 0,
                cpu_millis: 0,
                env: vec!["JOURNAL_*".into()],
            }],
        });
        assert_eq!(
            got,
            [Grant {
                tools: vec!["system_*".into()],
                read: vec!["/var/log".into()],
                write: vec!["/srv/out".into()],
                network: Some(false),
                memory: Some(512 << 20),
                pids: None,
                cpu_millis: None,
                env: vec!["JOURNAL_*".into()],
            }]
        );
    }
}
