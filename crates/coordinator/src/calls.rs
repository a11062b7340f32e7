//! Routing one call to one host and pumping its events to a caller, with flow control and audit.

use std::time::Duration;

use toolsrv_proto::v1::{CallResult, CallStatus, OutputChunk, StartCall};

use crate::State;
use crate::audit::{Pending, Record};
use crate::fleet::HostEntry;
use crate::link::{AgentEvent, CallHandle, status};
use crate::quota::Slot;

/// What a caller asked for, host aside.
#[derive(Debug, Clone)]
pub struct CallSpec {
    pub client: String,
    pub tool: String,
    pub args_json: String,
    pub args_sha256: String,
    pub cwd: String,
    pub timeout_ms: u64,
    /// The fan-out id, when part of one.
    pub fanout: Option<String>,
}

/// An event to pass on to the caller.
#[derive(Debug)]
pub enum Event {
    Output(OutputChunk),
    Result(CallResult),
}

/// Extra time past a call's own timeout before the coordinator gives up on the agent's answer.
const DEADLINE_SLACK: Duration = Duration::from_secs(30);
/// How long a call waits for a host's view when the host has just attached, or has not yet
/// reported a revision that has the tool.
pub const SYNC_WAIT: Duration = Duration::from_secs(5);

/// True when `host`'s view may still change the answer for `tool`: the host has not reported
/// on this connection yet, or its view predates a catalog that has the tool.
fn view_pending(state: &State, host: &HostEntry, tool: &str) -> bool {
    if !host.synced {
        return true;
    }
    host.tool(tool).is_none()
        && state.registry.catalog().tools.contains_key(tool)
        && host
            .view
            .as_ref()
            .is_none_or(|v| v.catalog_revision < state.fleet.revision())
}

/// Checks everything the coordinator knows (host, view, policy, quota) and starts the call on
/// the agent. `slot`: the call's share of the client's quota, when the caller took it already.
async fn start(
    state: &State,
    host_id: &str,
    spec: &CallSpec,
    slot: Option<Slot>,
) -> Result<(CallHandle, Slot), CallResult> {
    let Some(host) = state
        .fleet
        .wait_for(host_id, SYNC_WAIT, |h| !view_pending(state, h, &spec.tool))
        .await
    else {
        return Err(status(
            CallStatus::UnknownHost,
            format!("no host `{host_id}` has connected to this coordinator"),
        ));
    };
    let Some(link) = host.link.clone().filter(|_| host.online()) else {
        return Err(status(
            CallStatus::Offline,
            format!("host `{host_id}` is offline"),
        ));
    };
    match host.tool(&spec.tool) {
        Some(tool) if tool.visible => {}
        Some(tool) => {
            return Err(status(
                CallStatus::Hidden,
                format!(
                    "tool `{}` is hidden on host `{host_id}`: {}",
                    spec.tool, tool.reason
                ),
            ));
        }
        None if !state.registry.catalog().tools.contains_key(&spec.tool) => {
            return Err(status(
                CallStatus::UnknownTool,
                format!("unknown tool `{}`", spec.tool),
            ));
        }
        None => {
            return Err(status(
                CallStatus::Hidden,
                format!(
                    "host `{host_id}` did not report tool `{}` within {} s of being asked",
                    spec.tool,
                    SYNC_WAIT.as_secs()
                ),
            ));
        }
    }
    let allowed = state
        .policy
        .check(&spec.client, &spec.tool, &host.policy_facts())
        .map_err(|reason| status(CallStatus::Denied, reason))?;
    if let Some(rule) = allowed.require_sandbox {
        unconfined(&host, host_id, &spec.tool, rule)?;
    }
    let slot = match slot {
        Some(slot) => slot,
        None => state
            .quotas
            .call(&spec.client, host_id, spec.fanout.is_some())
            .map_err(|reason| status(CallStatus::Busy, reason))?,
    };
    let start = StartCall {
        call_id: 0,
        tool: spec.tool.clone(),
        args_json: spec.args_json.clone(),
        cwd: spec.cwd.clone(),
        timeout_ms: spec.timeout_ms,
        initial_credit: 0,
        require_sandbox: allowed.require_sandbox.is_some(),
    };
    Ok((link.start_call(start).await?, slot))
}

/// Refuses a call that policy rule `rule` requires to run confined on a host whose sandbox is
/// not `enforced` (as its agent reports it; the agent checks again before it runs the call).
fn unconfined(host: &HostEntry, host_id: &str, tool: &str, rule: usize) -> Result<(), CallResult> {
    let sandbox = host.facts.sandbox.clone().unwrap_or_default();
    if sandbox.level == "enforced" {
        return Ok(());
    }
    let state = if sandbox.level.is_empty() {
        "reports no sandbox (its agent predates confinement)".to_string()
    } else if sandbox.missing.is_empty() {
        format!(
            "reports sandbox={} (--sandbox {})",
            sandbox.level, sandbox.mode
        )
    } else {
        format!(
            "reports sandbox={} (--sandbox {}): {}",
            sandbox.level,
            sandbox.mode,
            sandbox.missing.join("; ")
        )
    };
    Err(status(
        CallStatus::Unconfined,
        format!(
            "policy rule {rule} requires tool `{tool}` to run confined, and host `{host_id}` {state}; run it where `sandbox=enforced`"
        ),
    ))
}

/// Runs a call on `host_id`, handing each event to `emit`. `emit` returns false when the caller
/// is gone, which cancels the call on the agent. Returns the final result.
///
/// The call is audited exactly once: the record is written before the caller is given the
/// result, and also when this future is dropped before the end (the caller vanished).
pub async fn run<F, Fut>(
    state: &State,
    host_id: &str,
    spec: &CallSpec,
    slot: Option<Slot>,
    mut emit: F,
) -> CallResult
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let audit = Pending::new(
        &state.audit,
        Record {
            client: &spec.client,
            host: host_id,
            tool: &spec.tool,
            args_sha256: &spec.args_sha256,
            fanout: spec.fanout.as_deref(),
        },
    );
    let (result, caller_present) = match start(state, host_id, spec, slot).await {
        Err(result) => (result, true),
        Ok((handle, _slot)) => {
            pump(
                handle,
                spec,
                state.quotas.limits.max_call_timeout,
                &mut emit,
            )
            .await
        }
    };
    audit.finish(&result);
    if caller_present {
        emit(Event::Result(result.clone())).await;
    }
    result
}

/// Passes a running call's output on until its end; returns the result, not yet given to the
/// caller, and whether the caller is still there.
/// `max_timeout` is the coordinator's deadline for a call that leaves its timeout to the agent.
async fn pump<F, Fut>(
    mut handle: CallHandle,
    spec: &CallSpec,
    max_timeout: Duration,
    emit: &mut F,
) -> (CallResult, bool)
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = match spec.timeout_ms {
        0 => max_timeout,
        ms => Duration::from_millis(ms),
    } + DEADLINE_SLACK;
    let deadline = tokio::time::sleep(deadline);
    tokio::pin!(deadline);
    loop {
        let event = tokio::select! {
            event = handle.next() => event,
            () = &mut deadline => {
                // Dropping the handle cancels the call on the agent.
                return (status(CallStatus::TimedOut, "the agent did not report the call's end in time"), true);
            }
        };
        match event {
            Some(AgentEvent::Output(chunk)) => {
                let n = chunk.data.len() as u64;
                if !emit(Event::Output(chunk)).await {
                    // Dropping the handle cancels the call on the agent.
                    return (status(CallStatus::Cancelled, "the caller went away"), false);
                }
                handle.consumed(n).await;
            }
            Some(AgentEvent::Finished(result)) => return (result, true),
            None => {
                return (
                    status(CallStatus::Lost, "the call ended without a result"),
                    true,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;

    use tokio::sync::mpsc;
    use toolsrv_proto::v1::OutputStream;

    use super::*;
    use crate::link::Link;

    fn spec(timeout_ms: u64) -> CallSpec {
        CallSpec {
            client: "alice".into(),
            tool: "t".into(),
            args_json: "{}".into(),
            args_sha256: String::new(),
            cwd: String::new(),
            timeout_ms,
            fanout: None,
        }
    }

    async fn started(
        window: u64,
    ) -> (
        Arc<Link>,
        CallHandle,
        mpsc::Receiver<toolsrv_proto::v1::CoordinatorMessage>,
    ) {
        let (tx, rx) = mpsc::channel(64);
        let link = Arc::new(Link::new("a".into(), 1, tx, window));
        let handle = link.start_call(StartCall::default()).await.unwrap();
        (link, handle, rx)
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_agent_times_out_after_the_call_timeout_plus_slack() {
        let (_link, handle, _rx) = started(1000).await;
        let begun = tokio::time::Instant::now();
        let mut emit = |_: Event| async { true };
        let (result, present) =
            pump(handle, &spec(10_000), Duration::from_secs(3600), &mut emit).await;
        assert_eq!(result.status, CallStatus::TimedOut as i32);
        assert!(present);
        assert_eq!(begun.elapsed(), Duration::from_secs(10) + DEADLINE_SLACK);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_timeout_the_coordinator_waits_its_maximum() {
        let (_link, handle, _rx) = started(1000).await;
        let begun = tokio::time::Instant::now();
        let mut emit = |_: Event| async { true };
        let (result, _) = pump(handle, &spec(0), Duration::from_secs(60), &mut emit).await;
        assert_eq!(result.status, CallStatus::TimedOut as i32);
        assert_eq!(begun.elapsed(), Duration::from_secs(60) + DEADLINE_SLACK);
    }

    #[tokio::test]
    async fn a_caller_gone_mid_output_cancels_the_call() {
        let (link, handle, mut rx) = started(1000).await;
        let _start = rx.recv().await;
        link.deliver(
            1,
            AgentEvent::Output(OutputChunk {
                stream: OutputStream::Stdout as i32,
                data: b"x".to_vec(),
            }),
        );
        let mut emit = |_: Event| async { false };
        let (result, present) = pump(handle, &spec(0), Duration::from_secs(60), &mut emit).await;
        assert_eq!(result.status, CallStatus::Cancelled as i32);
        assert!(!present, "nobody to give the result to");
        let cancel = rx.recv().await.unwrap();
        assert!(matches!(
            cancel.msg,
            Some(toolsrv_proto::v1::coordinator_message::Msg::Cancel(_))
        ));
    }
}
