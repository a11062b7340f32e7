//! The agent's introduction: its Hello with the facts it reports about its host.

use toolsrv_meta::Host;
use toolsrv_proto::v1::{Hello, HostFacts};

use crate::config::AgentConfig;

/// The facts reported about this host: OS and arch as variants see them, names from the kernel.
pub fn host_facts(config: &AgentConfig, host: &Host) -> HostFacts {
    HostFacts {
        os: host.os.clone(),
        arch: host.arch.clone(),
        // Facts are informational: a host that cannot tell its name still serves calls.
        hostname: sysinfo::System::host_name().unwrap_or_default(),
        kernel: sysinfo::System::kernel_version().unwrap_or_default(),
        labels: config
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    }
}

/// The first message of every session.
pub fn hello(config: &AgentConfig, host: &Host) -> Hello {
    Hello {
        host_id: config.host_id.clone(),
        facts: Some(host_facts(config, host)),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        max_concurrent_calls: config.max_concurrent_calls,
    }
}
