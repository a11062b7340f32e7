//! Routing one call to one host and pumping its events to a caller, with flow control and audit.

use std::time::Duration;

use toolsrv_proto::v1::{CallResult, CallStatus, OutputChunk, StartCall};

use crate::State;
use crate::audit::Record;
use crate::link::{AgentEvent, CallHandle, status};

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
/// The coordinator's deadline for calls that leave the timeout to the agent.
const DEFAULT_DEADLINE: Duration = Duration::from_secs(3600);

/// Checks everything the coordinator knows (host, view, policy) and starts the call on the agent.
async fn start(state: &State, host_id: &str, spec: &CallSpec) -> Result<CallHandle, CallResult> {
    let Some(host) = state.fleet.get(host_id) else {
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
                format!("host `{host_id}` has not reported tool `{}` yet", spec.tool),
            ));
        }
    }
    if let Err(reason) = state
        .policy
        .check(&spec.client, &spec.tool, &host.selector_facts())
    {
        return Err(status(CallStatus::Denied, reason));
    }
    let start = StartCall {
        call_id: 0,
        tool: spec.tool.clone(),
        args_json: spec.args_json.clone(),
        cwd: spec.cwd.clone(),
        timeout_ms: spec.timeout_ms,
        initial_credit: 0,
    };
    link.start_call(start).await
}

/// Runs a call on `host_id`, handing each event to `emit`. `emit` returns false when the caller
/// is gone, which cancels the call on the agent. Returns the final result (also audited).
pub async fn run<F, Fut>(state: &State, host_id: &str, spec: &CallSpec, mut emit: F) -> CallResult
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let result = match start(state, host_id, spec).await {
        Err(result) => {
            emit(Event::Result(result.clone())).await;
            result
        }
        Ok(handle) => pump(handle, spec, &mut emit).await,
    };
    state.audit.record(&Record {
        client: &spec.client,
        host: host_id,
        tool: &spec.tool,
        args_sha256: &spec.args_sha256,
        fanout: spec.fanout.as_deref(),
        result: &result,
    });
    result
}

async fn pump<F, Fut>(mut handle: CallHandle, spec: &CallSpec, emit: &mut F) -> CallResult
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = match spec.timeout_ms {
        0 => DEFAULT_DEADLINE,
        ms => Duration::from_millis(ms) + DEADLINE_SLACK,
    };
    let deadline = tokio::time::sleep(deadline);
    tokio::pin!(deadline);
    loop {
        let event = tokio::select! {
            event = handle.next() => event,
            () = &mut deadline => {
                let result = status(CallStatus::TimedOut, "the agent did not report the call's end in time");
                emit(Event::Result(result.clone())).await;
                return result;
            }
        };
        match event {
            Some(AgentEvent::Output(chunk)) => {
                let n = chunk.data.len() as u64;
                if !emit(Event::Output(chunk)).await {
                    // Dropping the handle cancels the call on the agent.
                    return status(CallStatus::Cancelled, "the caller went away");
                }
                handle.consumed(n).await;
            }
            Some(AgentEvent::Finished(result)) => {
                emit(Event::Result(result.clone())).await;
                return result;
            }
            None => return status(CallStatus::Lost, "the call ended without a result"),
        }
    }
}
