//! Running one `StartCall`: wait for a slot, prepare and start the process, stream its output
//! under the coordinator's flow-control credit, and report exactly one `CallFinished`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use toolsrv_confine::{CallPlan, Confiner, Grant, grant_for};
use toolsrv_exec::{Event, Invocation, Stream};
use toolsrv_host::{CallRequest, Limits};
use toolsrv_meta::Host;
use toolsrv_proto::v1::agent_message::Msg;
use toolsrv_proto::v1::{
    AgentMessage, CallFinished, CallOutput, CallResult, CallStatus, OutputChunk, OutputStream,
    StartCall,
};
use toolsrv_registry::Catalog;

use crate::blobs::GrpcBlobs;
use crate::bypass::{Broker, CallSide, Pending};
use crate::metrics::AgentMetrics;
use crate::outcome::{finished, refusal_status};
use crate::store::CatalogStore;

/// How long past its timeout and kill grace a call may wait for credit before its further output
/// is dropped, so a coordinator that stops granting credit cannot keep a call from finishing.
const CREDIT_SLACK: Duration = Duration::from_secs(2);

/// What every call of a session shares.
#[derive(Debug)]
pub(crate) struct CallEnv {
    /// The current catalog, published by the keeper.
    pub catalog: watch::Receiver<Arc<Catalog>>,
    pub host: Host,
    /// The agent's own environment, which tools start from.
    pub base_env: Vec<(OsString, OsString)>,
    pub limits: Limits,
    pub workdir: PathBuf,
    /// One permit per call allowed to run at once.
    pub slots: Arc<Semaphore>,
    pub out: toolsrv_proto::outbound::Outbound<AgentMessage>,
    /// Where shipped executables are checked before they run, and fetched again if altered.
    pub store: CatalogStore,
    pub blobs: GrpcBlobs,
    /// Confines every call.
    pub confiner: Arc<Confiner>,
    /// The coordinator's sandbox grants for this host (none until its SandboxPolicy arrives).
    pub grants: RwLock<Arc<Vec<Grant>>>,
    /// The bypass decisions the calls wait for.
    pub bypasses: Arc<Pending>,
    pub metrics: AgentMetrics,
}

/// Output bytes a call may still send: starts at the call's initial credit, grows with each
/// `Credit`, and may go negative when a chunk is larger than what was left.
#[derive(Debug)]
pub(crate) struct Credit(watch::Sender<i64>);

impl Credit {
    pub fn new(initial: u64) -> Self {
        Self(watch::Sender::new(clamp(initial)))
    }

    pub fn grant(&self, bytes: u64) {
        self.0.send_modify(|c| *c = c.saturating_add(clamp(bytes)));
    }

    #[cfg(test)]
    pub fn available(&self) -> i64 {
        *self.0.borrow()
    }

    /// Waits until some credit is left, then spends `n` bytes. False when `cancel` fires or
    /// `deadline` passes first.
    pub async fn take(&self, n: usize, cancel: &CancellationToken, deadline: Instant) -> bool {
        let mut rx = self.0.subscribe();
        let ready = tokio::select! {
            // The sender lives in `self`, so waiting cannot fail.
            ready = rx.wait_for(|c| *c > 0) => ready.is_ok(),
            () = cancel.cancelled() => false,
            () = tokio::time::sleep_until(deadline) => false,
        };
        if ready {
            self.0
                .send_modify(|c| *c = c.saturating_sub(clamp(n as u64)));
        }
        ready
    }
}

fn clamp(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// Runs one call to its end and reports it; returns the call id.
pub(crate) async fn run_call(
    env: Arc<CallEnv>,
    start: StartCall,
    cancel: CancellationToken,
    credit: Arc<Credit>,
) -> u64 {
    let id = start.call_id;
    let meter = env.metrics.call();
    let result = run(&env, &start, &cancel, &credit).await;
    meter.finish(&result);
    tracing::debug!(call_id = id, tool = %start.tool, status = ?result.status(), "call finished");
    let msg = Msg::Finished(CallFinished {
        call_id: id,
        result: Some(result),
    });
    // A failed send means the link is gone; nobody is left to tell.
    let _ = env.out.send(AgentMessage { msg: Some(msg) }).await;
    id
}

async fn run(
    env: &CallEnv,
    start: &StartCall,
    cancel: &CancellationToken,
    credit: &Credit,
) -> CallResult {
    let waiting = env.metrics.waiting();
    let permit = tokio::select! {
        permit = env.slots.clone().acquire_owned() => permit,
        () = cancel.cancelled() => {
            return CallResult::not_run(CallStatus::Cancelled, "call was cancelled while waiting for a free call slot");
        }
    };
    drop(waiting);
    let Ok(_permit) = permit else {
        return CallResult::not_run(CallStatus::Cancelled, "agent is shutting down");
    };
    let _running = env.metrics.running();
    if cancel.is_cancelled() {
        return CallResult::not_run(
            CallStatus::Cancelled,
            "call was cancelled before it started",
        );
    }
    let args = match toolsrv_meta::parse_args_json(&start.args_json) {
        Ok(args) => args,
        Err(e) => {
            return CallResult::not_run(
                CallStatus::InvalidArgs,
                format!("tool `{}`: {e}", start.tool),
            );
        }
    };
    let req = CallRequest {
        tool: start.tool.clone(),
        args,
        // Passed on as the caller wrote it (empty text is `{}`, written out).
        args_text: (!start.args_json.trim().is_empty()).then(|| start.args_json.clone()),
        cwd: if start.cwd.is_empty() {
            env.workdir.clone()
        } else {
            PathBuf::from(&start.cwd)
        },
        timeout: (start.timeout_ms > 0).then(|| Duration::from_millis(start.timeout_ms)),
    };
    let catalog = env.catalog.borrow().clone();
    let mut invocation =
        match toolsrv_host::prepare(&catalog, &env.host, &req, &env.limits, &env.base_env) {
            Ok(invocation) => invocation,
            Err(e) => return CallResult::not_run(refusal_status(&e), e.to_string()),
        };
    if start.require_sandbox && !env.confiner.enforced() {
        let a = env.confiner.abilities();
        return CallResult::not_run(
            CallStatus::Unconfined,
            format!(
                "tool `{}`: the policy requires confinement, and this host's sandbox is {} (--sandbox {}): {}",
                start.tool,
                a.level.as_str(),
                a.mode.as_str(),
                a.missing.join("; ")
            ),
        );
    }
    let tool_dir = catalog
        .tools
        .get(&start.tool)
        .map(|entry| entry.meta.dir().to_path_buf())
        .unwrap_or_default();
    if let Err(e) = confine(env, start, &tool_dir, &mut invocation) {
        return CallResult::not_run(CallStatus::FailedToStart, e);
    }
    if let toolsrv_exec::Program::Exec(path) = &invocation.program
        && *path == env.store.dir().join(&start.tool)
        && let Err(e) = env.store.check_executable(&start.tool, &env.blobs).await
    {
        return CallResult::not_run(CallStatus::FailedToStart, e.to_string());
    }
    let timeout = invocation.timeout;
    let deadline = Instant::now() + timeout + invocation.kill_grace + CREDIT_SLACK;
    let broker = match start_broker(env, start, &mut invocation, cancel) {
        Ok(broker) => broker,
        Err(e) => return CallResult::not_run(CallStatus::FailedToStart, e),
    };
    let result = match toolsrv_host::start(&start.tool, invocation, cancel.clone()) {
        Ok(execution) => stream(env, start, execution, cancel, credit, deadline, timeout).await,
        Err(e) => CallResult::not_run(refusal_status(&e), e.to_string()),
    };
    if let Some(broker) = broker {
        broker.stop().await;
    }
    result
}

/// Serves the call's bypass socket when the call can run a bypass command (it is confined, with
/// a cgroup), and names it in the call's environment.
fn start_broker(
    env: &CallEnv,
    start: &StartCall,
    invocation: &mut Invocation,
    cancel: &CancellationToken,
) -> Result<Option<Broker>, String> {
    let Some(jail) = invocation.jail.clone() else {
        return Ok(None);
    };
    let Some(dir) = jail.private_dir().filter(|_| jail.can_bypass()) else {
        return Ok(None);
    };
    let broker = Broker::start(
        dir,
        CallSide {
            call_id: start.call_id,
            tool: start.tool.clone(),
            jail: jail.clone(),
            env: invocation.env.clone(),
            cwd: invocation.cwd.clone(),
            deadline: Instant::now() + invocation.timeout,
            cancel: cancel.clone(),
            out: env.out.clone(),
            pending: env.bypasses.clone(),
        },
    )?;
    invocation.env.push((
        "OLLIE_BYPASS_SOCKET".into(),
        broker.path().as_os_str().to_owned(),
    ));
    Ok(Some(broker))
}

/// Forwards a started call's output under credit until it finishes.
async fn stream(
    env: &CallEnv,
    start: &StartCall,
    mut execution: toolsrv_exec::Execution,
    cancel: &CancellationToken,
    credit: &Credit,
    deadline: Instant,
    timeout: Duration,
) -> CallResult {
    let mut forwarding = true;
    let mut dropped = false;
    while let Some(event) = execution.next().await {
        match event {
            Event::Output { stream, data } => {
                // Each chunk costs what holding it costs the coordinator, besides its data.
                let cost = data.len().saturating_add(start.chunk_overhead as usize);
                if forwarding && credit.take(cost, cancel, deadline).await {
                    env.metrics.streamed(output_stream(stream), data.len());
                    let chunk = OutputChunk {
                        stream: output_stream(stream).into(),
                        data: data.to_vec(),
                    };
                    let msg = Msg::Output(CallOutput {
                        call_id: start.call_id,
                        chunk: Some(chunk),
                    });
                    if env.out.send(AgentMessage { msg: Some(msg) }).await.is_err() {
                        // The link is gone: nobody can receive the output.
                        cancel.cancel();
                        forwarding = false;
                    }
                } else {
                    // Cancelled, or out of credit past the deadline: keep draining so the
                    // outcome arrives, but stop forwarding.
                    forwarding = false;
                    dropped |= !cancel.is_cancelled();
                }
            }
            Event::Finished(outcome) => {
                let mut result = finished(&outcome, timeout);
                result.truncated |= dropped;
                return result;
            }
        }
    }
    CallResult::not_run(
        CallStatus::ToolError,
        format!(
            "tool `{}`: the call ended without reporting an outcome; see the agent's log",
            start.tool
        ),
    )
}

/// Confines a prepared call: its jail, and the working directory and environment that go with it.
fn confine(
    env: &CallEnv,
    start: &StartCall,
    tool_dir: &std::path::Path,
    invocation: &mut Invocation,
) -> Result<(), String> {
    let grants = env.grants.read().unwrap_or_else(|p| p.into_inner()).clone();
    let cwd = (!start.cwd.is_empty()).then(|| std::path::Path::new(&start.cwd));
    let prepared = env
        .confiner
        .prepare(&CallPlan {
            tool_dir,
            cwd,
            grant: grant_for(&grants, &start.tool),
            agent_env: &env.base_env,
            timeout: invocation.timeout,
        })
        .map_err(|e| format!("tool `{}`: {e}", start.tool))?;
    if let Some(cwd) = prepared.cwd {
        invocation.cwd = cwd;
    }
    if let Some(vars) = prepared.env {
        invocation.env = vars;
    }
    invocation.jail = Some(Arc::new(prepared.jail));
    Ok(())
}

fn output_stream(stream: Stream) -> OutputStream {
    match stream {
        Stream::Stdout => OutputStream::Stdout,
        Stream::Stderr => OutputStream::Stderr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn credit_waits_until_positive_and_may_go_negative() {
        let credit = Arc::new(Credit::new(10));
        let cancel = CancellationToken::new();
        let far = Instant::now() + Duration::from_secs(60);
        assert!(credit.take(25, &cancel, far).await);
        assert_eq!(credit.available(), -15);
        let waiter = {
            let (credit, cancel) = (credit.clone(), cancel.clone());
            tokio::spawn(async move { credit.take(5, &cancel, far).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "no credit: the sender must wait");
        credit.grant(15);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "credit 0 is not enough");
        credit.grant(1);
        let took = tokio::time::timeout(Duration::from_secs(5), waiter).await;
        assert!(matches!(took, Ok(Ok(true))));
        assert_eq!(credit.available(), -4);
    }

    #[tokio::test]
    async fn credit_wait_ends_on_cancel_or_deadline() {
        let credit = Credit::new(0);
        let cancel = CancellationToken::new();
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(!credit.take(1, &cancel, soon).await);
        cancel.cancel();
        let far = Instant::now() + Duration::from_secs(60);
        assert!(!credit.take(1, &cancel, far).await);
        assert_eq!(credit.available(), 0);
    }
}
