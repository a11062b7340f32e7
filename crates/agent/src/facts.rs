//! The agent's introduction: its Hello with the facts it reports about its host.

use toolsrv_confine::Abilities;
use toolsrv_meta::Host;
use toolsrv_proto::v1::{Hello, HostFacts, SandboxFacts};

use crate::config::AgentConfig;

/// What the agent enforces on every call, as reported in its facts.
pub fn sandbox_facts(abilities: &Abilities) -> SandboxFacts {
    SandboxFacts {
        mode: abilities.mode.as_str().to_owned(),
        level: abilities.level.as_str().to_owned(),
        landlock_abi: u32::try_from(abilities.landlock_abi).unwrap_or(0),
        cgroup: abilities.cgroup.clone(),
        controllers: abilities.controllers.clone(),
        kill: abilities.kill.clone(),
        run_as: abilities.run_as.clone(),
        missing: abilities.missing.clone(),
    }
}

/// The facts reported about this host: OS and arch as variants see them, names from the kernel,
/// and what its calls are confined with.
pub fn host_facts(config: &AgentConfig, host: &Host, abilities: &Abilities) -> HostFacts {
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
        sandbox: Some(sandbox_facts(abilities)),
    }
}

/// The first message of every session.
pub fn hello(config: &AgentConfig, host: &Host, abilities: &Abilities) -> Hello {
    Hello {
        host_id: config.host_id.clone(),
        facts: Some(host_facts(config, host, abilities)),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        max_concurrent_calls: config.max_concurrent_calls,
        // `stream` in `calls` spends StartCall.chunk_overhead on every chunk.
        counts_chunk_overhead: true,
    }
}
