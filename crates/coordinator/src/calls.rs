//! Routing one call to one host and pumping its events to a caller, with flow control and audit.

use std::time::Duration;

use toolsrv_proto::v1::{CallResult, CallStatus, OutputChunk, StartCall};

use crate::State;
use crate::audit::{Pending, Record};
use crate::link::{AgentEvent, CallHandle, status};
use crate::quota::Slot;
use crate::refusal::{self, Refusal};

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

/// Checks everything the coordinator knows (host, view, policy, quota) and starts the call on
/// the agent. `slot`: the call's share of the client's quota, when the caller took it already.
async fn start(
    state: &State,
    host_id: &str,
    spec: &CallSpec,
    slot: Option<Slot>,
) -> Result<(CallHandle, Slot), CallResult> {
    let host = refusal::online_host(state, host_id, |h| refusal::settled(state, h, &spec.tool))
        .await
        .map_err(Refusal::result)?;
    let Some(link) = host.link.clone().filter(|_| host.online()) else {
        return Err(Refusal::offline(host_id).result());
    };
    refusal::visible_tool(state, &host, &spec.tool).map_err(Refusal::result)?;
    if let Err(reason) = state
        .policy
        .check(&spec.client, &spec.tool, &host.policy_facts())
    {
        return Err(status(CallStatus::Denied, reason));
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
    };
    Ok((link.start_call(start).await?, slot))
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
        Ok((handle, _slot)) => pump(handle, spec, state, &mut emit).await,
    };
    audit.finish(&result);
    if caller_present {
        emit(Event::Result(result.clone())).await;
    }
    result
}

/// Passes a running call's output on until its end; returns the result, not yet given to the
/// caller, and whether the caller is still there.
async fn pump<F, Fut>(
    mut handle: CallHandle,
    spec: &CallSpec,
    state: &State,
    emit: &mut F,
) -> (CallResult, bool)
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = match spec.timeout_ms {
        0 => state.quotas.limits.max_call_timeout,
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
