//! Refusals about hosts and tools, worded once: `Call`, `FanOut`, `ListTools` and `DescribeTool`
//! say the same thing for the same condition, whether it reaches the caller as a call status or
//! as a gRPC status. Unknown names come with the closest known ones.

use std::time::Duration;

use tonic::Status;
use toolsrv_meta::did_you_mean;
use toolsrv_proto::v1::{CallResult, CallStatus};

use crate::State;
use crate::fleet::HostEntry;
use crate::views::StoredTool;

/// How long a request waits for a host's view when the host has just attached, or has not yet
/// reported a revision that settles the tool asked for.
pub const SYNC_WAIT: Duration = Duration::from_secs(5);

/// Why a request about a host or a tool is refused; nothing ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: CallStatus,
    pub message: String,
}

impl Refusal {
    fn new(status: CallStatus, message: String) -> Self {
        Self { status, message }
    }

    /// No host of that id has attached, or not since the coordinator forgot it.
    pub fn unknown_host(state: &State, id: &str) -> Self {
        // A revoked host is forgotten once offline: say so rather than guess.
        let agent = toolsrv_tls::Identity::Agent(toolsrv_tls::normalize_name(id));
        if let Err(revoked) = state.revocations.check(&agent) {
            return Self::new(
                CallStatus::UnknownHost,
                format!("host `{id}` is not in the fleet: {}", revoked.message()),
            );
        }
        // A host another replica held, listed offline or reconnecting by every replica.
        if let Some((owner, how)) = state.replicas.as_ref().and_then(|r| r.last_owner(id)) {
            let why = if how == toolsrv_proto::v1::HostState::Reconnecting {
                "the replica that held its link is gone from the cluster, and it has attached to \
                 no other replica yet"
            } else {
                "its agent is connected to no replica"
            };
            return Self::new(
                CallStatus::Offline,
                format!("host `{id}` is offline: {why} (it was last held by replica {owner})"),
            );
        }
        let ids = state.fleet.ids();
        let suggestion = did_you_mean(id, ids.iter().map(String::as_str));
        let after = state.config.forget_offline_after;
        let forgotten = if after.is_zero() {
            String::new()
        } else {
            format!(
                " (or not for {} s: hosts offline that long are forgotten)",
                after.as_secs()
            )
        };
        Self::new(
            CallStatus::UnknownHost,
            format!("no host `{id}` has connected to this coordinator{forgotten}{suggestion}"),
        )
    }

    /// The host is known but its agent is not connected.
    pub fn offline(id: &str) -> Self {
        Self::new(
            CallStatus::Offline,
            format!(
                "host `{id}` is offline: its agent is not connected (start it, or read its log, \
                 on that host)"
            ),
        )
    }

    /// The host's agent said it is shutting down: it finishes its calls and takes no new one.
    pub fn shutting_down(id: &str) -> Self {
        Self::new(
            CallStatus::Offline,
            format!(
                "host `{id}` is shutting down: its agent finishes the calls it runs and takes no \
                 new one (try again once it is back)"
            ),
        )
    }

    /// Neither the catalog nor the host has a tool of that name.
    pub fn unknown_tool(state: &State, host: &HostEntry, tool: &str) -> Self {
        let catalog = state.registry.catalog();
        let on_host = host
            .view
            .iter()
            .flat_map(|v| v.tools.iter())
            .map(|t| t.name.as_str());
        let names = catalog
            .tools
            .keys()
            .chain(catalog.invalid.keys())
            .map(String::as_str)
            .chain(on_host);
        let suggestion = did_you_mean(tool, names);
        Self::new(
            CallStatus::UnknownTool,
            format!("unknown tool `{tool}` on host `{}`{suggestion}", host.id),
        )
    }

    /// The host does not offer the tool, for `reason` (no variant matches, invalid files, ...).
    pub fn hidden(tool: &str, host: &str, reason: &str) -> Self {
        Self::new(
            CallStatus::Hidden,
            format!("tool `{tool}` is hidden on host `{host}`: {reason}"),
        )
    }

    /// As a call's result.
    pub fn result(self) -> CallResult {
        CallResult::not_run(self.status, self.message)
    }

    /// As the gRPC status of a request that is not a call (a listing, a description).
    pub fn grpc(self) -> Status {
        let code = match self.status {
            CallStatus::UnknownHost | CallStatus::UnknownTool => tonic::Code::NotFound,
            CallStatus::Offline => tonic::Code::Unavailable,
            CallStatus::Hidden => tonic::Code::FailedPrecondition,
            CallStatus::Denied => tonic::Code::PermissionDenied,
            CallStatus::Busy => tonic::Code::ResourceExhausted,
            CallStatus::InvalidArgs => tonic::Code::InvalidArgument,
            _ => tonic::Code::Internal,
        };
        Status::new(code, self.message)
    }
}

/// Host `id`, online, once `ready` holds for it (waiting at most [`SYNC_WAIT`] for the view a
/// host reports after attaching or after a catalog change).
pub async fn online_host(
    state: &State,
    id: &str,
    ready: impl Fn(&HostEntry) -> bool,
) -> Result<HostEntry, Refusal> {
    let host = state
        .fleet
        .wait_for(id, SYNC_WAIT, ready)
        .await
        .ok_or_else(|| Refusal::unknown_host(state, id))?;
    if !host.online() {
        return Err(Refusal::offline(id));
    }
    Ok(host)
}

/// True when `host`'s view settles what it offers of `tool`: it has reported on this connection,
/// and its view is not older than a catalog that added the tool, or that made it invalid while
/// the view still offers it.
pub fn settled(state: &State, host: &HostEntry, tool: &str) -> bool {
    if !host.synced {
        return false;
    }
    let stale = host
        .view
        .as_ref()
        .is_none_or(|v| v.catalog_revision < state.fleet.revision());
    if !stale {
        return true;
    }
    let catalog = state.registry.catalog();
    let served = catalog.tools.contains_key(tool);
    match host.tool(tool) {
        None => !served,
        Some(t) => !(t.visible && !served && catalog.invalid.contains_key(tool)),
    }
}

/// What `host` offers of `tool`: the view's entry when visible, else why not.
pub fn visible_tool<'h>(
    state: &State,
    host: &'h HostEntry,
    tool: &str,
) -> Result<&'h StoredTool, Refusal> {
    match host.tool(tool) {
        Some(t) if t.visible => Ok(t),
        Some(t) => Err(Refusal::hidden(tool, &host.id, &t.reason)),
        None => {
            let catalog = state.registry.catalog();
            if let Some(invalid) = catalog.invalid.get(tool) {
                Err(Refusal::hidden(tool, &host.id, &invalid.reason()))
            } else if catalog.tools.contains_key(tool) {
                Err(Refusal::hidden(
                    tool,
                    &host.id,
                    &format!(
                        "the host did not report the tool within {} s of being asked",
                        SYNC_WAIT.as_secs()
                    ),
                ))
            } else {
                Err(Refusal::unknown_tool(state, host, tool))
            }
        }
    }
}
