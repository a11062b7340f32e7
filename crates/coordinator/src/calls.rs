//! Routing one call to one host and pumping its events to a caller, with flow control and audit.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use toolsrv_proto::text::printable_line;
use toolsrv_proto::v1::{
    ApprovalRequest, BypassRequest, CallResult, CallStatus, OutputChunk, SandboxFacts, StartCall,
};

use crate::State;
use crate::approvals::{Decision, Next, Rejudged};
use crate::audit::{Pending, Record};
use crate::link::{AgentEvent, CallHandle};
use crate::policy::{Bypass, Verdict};
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
    /// The call waits for this approval.
    Approval(ApprovalRequest),
}

/// Extra time past a call's own timeout before the coordinator gives up on the agent's answer.
const DEADLINE_SLACK: Duration = Duration::from_secs(30);

/// Most bytes of a bypass request's command and reason together. An agent of this version
/// refuses a request line of more than 64 KiB besides its standard input, so only a
/// compromised or broken one sends more; what a person is asked to read stays bounded.
const MAX_BYPASS_BYTES: usize = 64 * 1024;

/// Why a bypass request cannot be put to anyone, if it cannot: no command, or a command and
/// reason larger than [`MAX_BYPASS_BYTES`].
fn malformed_bypass(request: &BypassRequest) -> Option<String> {
    let bytes: usize = request.argv.iter().map(String::len).sum::<usize>() + request.reason.len();
    if request.argv.is_empty() || request.argv[0].is_empty() {
        Some("refused: the request names no command".into())
    } else if bytes > MAX_BYPASS_BYTES {
        Some(format!(
            "refused: the command and reason take {bytes} bytes, more than the {MAX_BYPASS_BYTES} a request may"
        ))
    } else {
        None
    }
}

/// A call the coordinator may start: the host's link, what the policy said, the quota slot.
struct Routed {
    link: std::sync::Arc<crate::link::Link>,
    verdict: Verdict,
    slot: Slot,
    /// The tool's definition in the host's view.
    definition: Option<std::sync::Arc<toolsrv_proto::v1::ToolDefinition>>,
}

/// Checks everything the coordinator knows (host, view, policy, quota). `slot`: the call's share
/// of the client's quota, when the caller took it already.
async fn route(
    state: &State,
    host_id: &str,
    spec: &CallSpec,
    slot: Option<Slot>,
) -> Result<Routed, CallResult> {
    let host = refusal::online_host(state, host_id, |h| refusal::settled(state, h, &spec.tool))
        .await
        .map_err(Refusal::result)?;
    let Some(link) = host.link.clone().filter(|_| host.online()) else {
        return Err(Refusal::offline(host_id).result());
    };
    if link.draining() {
        return Err(Refusal::shutting_down(host_id).result());
    }
    refusal::visible_tool(state, &host, &spec.tool).map_err(Refusal::result)?;
    let verdict = state
        .policy
        .now()
        .check(&spec.client, &spec.tool, &host.policy_facts())
        .map_err(|reason| CallResult::not_run(CallStatus::Denied, reason))?;
    let sandbox = host.facts.sandbox.clone().unwrap_or_default();
    if let Some(rule) = verdict.unconfined_on(&sandbox.level) {
        return Err(unconfined(&sandbox, host_id, &spec.tool, rule));
    }
    let slot = match slot {
        Some(slot) => slot,
        None => state
            .quotas
            .call(&spec.client, host_id, spec.fanout.is_some())
            .map_err(|reason| CallResult::not_run(CallStatus::Busy, reason))?,
    };
    Ok(Routed {
        link,
        verdict,
        slot,
        definition: host.tool(&spec.tool).and_then(|t| t.definition.clone()),
    })
}

/// Why the host would refuse `spec`'s arguments, checked against the tool's definition in its
/// view before anyone is asked to approve the call: a person must not approve a call that
/// cannot run (900 KB of arguments shown cut to 4 KiB, refused after the approval for a key
/// the approver never saw). The agent checks them again; a definition the coordinator cannot
/// read is left to it.
fn unrunnable_args(
    definition: Option<&toolsrv_proto::v1::ToolDefinition>,
    spec: &CallSpec,
) -> Option<CallResult> {
    let definition = definition?;
    let refused = |why: String| {
        Some(CallResult::not_run(
            CallStatus::InvalidArgs,
            format!("tool `{}`: {why}", spec.tool),
        ))
    };
    let args = match toolsrv_meta::parse_args_json(&spec.args_json) {
        Ok(args) => args,
        Err(e) => return refused(e.to_string()),
    };
    let schema: serde_json::Value = serde_json::from_str(&definition.args_schema_json).ok()?;
    let validator = toolsrv_meta::ArgsValidator::compile(&schema).ok()?;
    match validator.validate(&args) {
        Ok(()) => None,
        Err(e) => refused(e.to_string()),
    }
}

/// Files an approval request, shows it to the caller, and waits for the decision (audited);
/// shows it again whenever who decides it changes (the policy or the host labels changed). The
/// decision, and the request as it was decided (its approvers then); `None` when the caller
/// went away before anyone decided.
async fn ask<F, Fut>(
    state: &State,
    request: ApprovalRequest,
    approvers: &[String],
    call_ended: Option<&CancellationToken>,
    emit: &mut F,
) -> Option<(Decision, ApprovalRequest)>
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let timeout = state.config.approval_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    // Set before filing: the pending copy is what `ListApprovals` shows and sorts by.
    let request = ApprovalRequest {
        expires_unix_ms: toolsrv_proto::unix_ms()
            .saturating_add(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)),
        ..request
    };
    if let Some(why) = crate::approvals::undecidable(approvers, &request.caller) {
        // Denied now rather than left to expire unanswered.
        let mut request = request;
        (request.approvers, request.caller_may_decide) = crate::approvals::deciders(approvers);
        let decision = Decision::Denied {
            by: "coordinator".into(),
            reason: why,
        };
        state.audit.approval(&request, &decision);
        state.metrics.approval(&decision);
        return Some((decision, request));
    }
    let mut waiting = state.approvals.file(request, approvers);
    // Recorded withdrawn however the wait ends undecided, this future dropped included (the
    // caller went away and its stream went with it): no request goes unaudited.
    let mut undecided = Undecided {
        state,
        request: Some(waiting.request.clone()),
    };
    if !emit(Event::Approval(waiting.request.clone())).await {
        return None;
    }
    // A running call that ends meanwhile (its tool timed out, its host went away) takes its
    // request back: nobody is left to decide for.
    let never = CancellationToken::new();
    let call_ended = call_ended.unwrap_or(&never);
    let decision = loop {
        let next = tokio::select! {
            next = waiting.next(deadline) => next,
            () = call_ended.cancelled() => break Decision::Withdrawn,
        };
        match next {
            Next::Decided(decision) => break decision,
            Next::Retold => {
                undecided.request = Some(waiting.request.clone());
                if !emit(Event::Approval(waiting.request.clone())).await {
                    break Decision::Withdrawn;
                }
            }
        }
    };
    undecided.request = None;
    let decision = unless_unrecorded(state, decision);
    state.audit.approval(&waiting.request, &decision);
    state.metrics.approval(&decision);
    Some((decision, waiting.request.clone()))
}

/// An approval request waited for: recorded withdrawn when dropped before it is decided.
struct Undecided<'a> {
    state: &'a State,
    /// The request as last shown; `None` once decided (its decision is recorded by the wait).
    request: Option<ApprovalRequest>,
}

impl Drop for Undecided<'_> {
    fn drop(&mut self) {
        if let Some(request) = self.request.take() {
            self.state.audit.approval(&request, &Decision::Withdrawn);
            self.state.metrics.approval(&Decision::Withdrawn);
        }
    }
}

/// How a decision taken under a policy that changed since the call began says so.
const POLICY_CHANGED: &str = "the policy or host labels changed since the call was made";

/// What the policy in force says of the running call `spec` on `host_id`, for its bypass
/// requests: the verdict of the policy in force now, or `started` (what it started under)
/// when this coordinator no longer holds the host. `Err`: the policy now denies the call.
fn verdict_now(
    state: &State,
    host_id: &str,
    spec: &CallSpec,
    started: &Verdict,
) -> Result<Verdict, String> {
    match state.fleet.get(host_id) {
        Some(host) => state
            .policy
            .now()
            .check(&spec.client, &spec.tool, &host.policy_facts()),
        None => Ok(started.clone()),
    }
}

/// What the policy in force says of a waiting request: the approvers it names now, or its
/// decision when it no longer asks anyone (it denies the call or the command, or lets it run).
/// A request whose host this coordinator no longer holds is left as it is (its call ends).
pub(crate) fn rejudged(state: &State, request: &ApprovalRequest) -> Rejudged {
    let Some(host) = state.fleet.get(&request.host) else {
        return Rejudged::Keep;
    };
    let policy = state.policy.now();
    let decided =
        |approve, why| Rejudged::Decide(by_policy(approve, format!("{POLICY_CHANGED}: {why}")));
    let verdict = match policy.check(&request.caller, &request.tool, &host.policy_facts()) {
        Ok(verdict) => verdict,
        Err(why) => return decided(false, why),
    };
    if request.bypass_argv.is_empty() {
        return match verdict.approve {
            true => Rejudged::Ask(verdict.approvers),
            false => decided(
                true,
                rule_text(&verdict, "lets the call run without approval"),
            ),
        };
    }
    match bypass_by_policy(&verdict) {
        Some((approve, why)) => decided(approve, why),
        None => Rejudged::Ask(verdict.approvers),
    }
}

/// A decision the policy took by itself (`decided_by: "policy"`).
fn by_policy(approve: bool, reason: String) -> Decision {
    let by = "policy".to_string();
    if approve {
        Decision::Approved { by, reason }
    } else {
        Decision::Denied { by, reason }
    }
}

/// What the policy's `bypass` decides of a bypass request without asking anyone, and why;
/// `None` when it asks the rule's approvers.
fn bypass_by_policy(verdict: &Verdict) -> Option<(bool, String)> {
    match verdict.bypass {
        Bypass::Allow => Some((true, rule_text(verdict, "allows bypass requests"))),
        Bypass::Deny => Some((false, rule_text(verdict, "denies bypass requests"))),
        Bypass::Ask => None,
    }
}

/// A decision to run something (a call the policy asks about, a command outside the sandbox),
/// turned into the coordinator's denial while the audit log cannot be written: nothing runs
/// that the log cannot record ([`crate::audit`]). `Approve` refuses such an approval first;
/// this holds for one given as the log failed, and for the policy's own.
fn unless_unrecorded(state: &State, decision: Decision) -> Decision {
    match (&decision, state.audit.writable()) {
        (Decision::Approved { .. }, Err(why)) => Decision::Denied {
            by: "coordinator".into(),
            reason: why,
        },
        _ => decision,
    }
}

/// Why a decision refused, for the caller or the tool.
fn refusal(decision: &Decision, request: &ApprovalRequest, timeout: Duration) -> String {
    match decision {
        Decision::Approved { .. } => String::new(),
        Decision::Denied { by, reason } if reason.is_empty() => format!("approval denied by {by}"),
        Decision::Denied { by, reason } => format!("approval denied by {by}: {reason}"),
        Decision::Withdrawn => "the call ended before anyone decided".into(),
        Decision::Expired => {
            let who = if request.caller_may_decide {
                "the caller".to_string()
            } else {
                request.approvers.join(", ")
            };
            format!("not approved within {} s by {who}", timeout.as_secs())
        }
    }
}

/// What the policy's rule says of the call, for messages.
fn rule_text(verdict: &Verdict, what: &str) -> String {
    match verdict.rule {
        Some(i) => format!("policy rule {i} {what}"),
        None => format!("the policy's default {what}"),
    }
}

/// The approval request of a call, before any bypass.
fn call_request(state: &State, host_id: &str, spec: &CallSpec) -> ApprovalRequest {
    let host_only = state
        .fleet
        .get(host_id)
        .and_then(|host| host.tool(&spec.tool).map(|t| t.host_only))
        .unwrap_or(false);
    ApprovalRequest {
        caller: spec.client.clone(),
        host: host_id.to_string(),
        tool: spec.tool.clone(),
        args_sha256: spec.args_sha256.clone(),
        args_json: spec.args_json.clone(),
        fanout: spec.fanout.clone().unwrap_or_default(),
        host_only,
        ..ApprovalRequest::default()
    }
}

/// Waits for the approval of a call the policy marks `approve`.
/// `Err((result, caller_present))` when the call must not run.
async fn approve_call<F, Fut>(
    state: &State,
    host_id: &str,
    spec: &CallSpec,
    verdict: &Verdict,
    emit: &mut F,
) -> Result<(), (CallResult, bool)>
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let mut request = call_request(state, host_id, spec);
    request.reason = rule_text(verdict, "requires approval");
    let Some((decision, request)) = ask(state, request, &verdict.approvers, None, emit).await
    else {
        return Err((
            CallResult::not_run(CallStatus::Cancelled, "the caller went away"),
            false,
        ));
    };
    if matches!(decision, Decision::Approved { .. }) {
        return Ok(());
    }
    let why = refusal(&decision, &request, state.config.approval_timeout);
    Err((CallResult::not_run(CallStatus::Denied, why), true))
}

/// Decides a confined tool's request to run a command outside its sandbox, as the policy's
/// `bypass` says (asking if need be), or until the call ends. `None` when the caller went away.
async fn decide_bypass<F, Fut>(
    state: &State,
    host_id: &str,
    spec: &CallSpec,
    started: &Verdict,
    bypass: &BypassRequest,
    call_ended: &CancellationToken,
    emit: &mut F,
) -> Option<(bool, String)>
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    if let Some(why) = malformed_bypass(bypass) {
        return Some(refuse_bypass(state, host_id, spec, bypass, why));
    }
    let mut request = call_request(state, host_id, spec);
    request.bypass_argv = bypass.argv.clone();
    request.bypass_reason = bypass.reason.clone();
    // Decided under the policy in force now, which may not be the one the call started under.
    let decided = match verdict_now(state, host_id, spec, started) {
        Err(why) => (false, format!("{POLICY_CHANGED}: {why}")),
        Ok(verdict) => match bypass_by_policy(&verdict) {
            Some(decided) => decided,
            None => {
                request.reason = rule_text(&verdict, "asks before a bypass");
                let (decision, request) =
                    ask(state, request, &verdict.approvers, Some(call_ended), emit).await?;
                let approved = matches!(decision, Decision::Approved { .. });
                let why = match decision {
                    Decision::Approved { by, reason } if by == "policy" => reason,
                    Decision::Approved { by, .. } => format!("approved by {by}"),
                    other => refusal(&other, &request, state.config.approval_timeout),
                };
                return Some((approved, why));
            }
        },
    };
    // Decided by policy alone: audited all the same.
    let (approved, why) = decided;
    request.reason = why.clone();
    let decision = by_policy(approved, why);
    let decision = unless_unrecorded(state, decision);
    state.audit.approval(&request, &decision);
    let approved = matches!(decision, Decision::Approved { .. });
    let why = match decision {
        Decision::Approved { reason, .. } | Decision::Denied { reason, .. } => reason,
        Decision::Expired | Decision::Withdrawn => request.reason,
    };
    Some((approved, why))
}

/// Refuses a bypass request on the coordinator's own account, whatever the policy says, and
/// audits it as what it is, without the flood: the start of the command and of its reason.
fn refuse_bypass(
    state: &State,
    host_id: &str,
    spec: &CallSpec,
    bypass: &BypassRequest,
    why: String,
) -> (bool, String) {
    let mut request = call_request(state, host_id, spec);
    request.bypass_argv = vec![printable_line(&bypass.argv.join(" "), 256)];
    request.bypass_reason = printable_line(&bypass.reason, 256);
    request.reason = why.clone();
    let decision = Decision::Denied {
        by: "coordinator".into(),
        reason: why.clone(),
    };
    state.audit.approval(&request, &decision);
    (false, why)
}

/// Routes the call, waits for its approval if the policy asks for one, and starts it.
async fn start<F, Fut>(
    state: &State,
    host_id: &str,
    spec: &CallSpec,
    slot: Option<Slot>,
    emit: &mut F,
) -> Result<(CallHandle, Slot, Verdict), (CallResult, bool)>
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let mut routed = route(state, host_id, spec, slot)
        .await
        .map_err(|result| (result, true))?;
    if routed.verdict.approve {
        if let Some(refused) = unrunnable_args(routed.definition.as_deref(), spec) {
            return Err((refused, true));
        }
        approve_call(state, host_id, spec, &routed.verdict, emit).await?;
        // Routed again after the wait, which may have been minutes: the host may have
        // reconnected since (the link routed to first is closed), or gone, or no longer offer
        // the tool. The approval holds for this call wherever it is routed now.
        routed = route(state, host_id, spec, Some(routed.slot))
            .await
            .map_err(|result| (result, true))?;
    }
    let start = StartCall {
        call_id: 0,
        tool: spec.tool.clone(),
        args_json: spec.args_json.clone(),
        cwd: spec.cwd.clone(),
        timeout_ms: spec.timeout_ms,
        require_sandbox: routed.verdict.require_sandbox.is_some(),
        // The link sets the id and what the call's output may cost.
        ..StartCall::default()
    };
    let handle = routed
        .link
        .start_call(start)
        .await
        .map_err(|result| (result, true))?;
    Ok((handle, routed.slot, routed.verdict))
}

/// The refusal of a call that policy rule `rule` requires to run confined on a host whose
/// `sandbox` is not `enforced` (as its agent reports it, in full; the agent checks again
/// before it runs the call).
fn unconfined(sandbox: &SandboxFacts, host_id: &str, tool: &str, rule: usize) -> CallResult {
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
    CallResult::not_run(
        CallStatus::Unconfined,
        crate::policy::unconfined_refusal(rule, tool, host_id, &state),
    )
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
    let mut audit = Pending::new(
        &state.audit,
        Record {
            client: &spec.client,
            host: host_id,
            tool: &spec.tool,
            args_sha256: &spec.args_sha256,
            fanout: spec.fanout.as_deref(),
        },
    );
    let meter = state.metrics.call(spec.fanout.is_some());
    let metrics = &state.metrics;
    let mut emit = |event: Event| {
        if let Event::Output(chunk) = &event {
            metrics.streamed(chunk.stream, chunk.data.len() as u64);
        }
        emit(event)
    };
    let (result, caller_present) = match start(state, host_id, spec, slot, &mut emit).await {
        Err(ended) => ended,
        Ok((handle, _slot, verdict)) => {
            let mut pump = Pump::new(handle, spec, state.quotas.limits.max_call_timeout)
                .until(state.shutdown.clone());
            let mut bypasses = 0;
            loop {
                match pump.step(&mut emit).await {
                    Step::Done(result, present) => break (result, present),
                    Step::Bypass(request) => {
                        bypasses += 1;
                        let ended = pump.handle.ended().clone();
                        let decided = if bypasses <= MAX_BYPASS_REQUESTS_PER_CALL {
                            decide_bypass(
                                state, host_id, spec, &verdict, &request, &ended, &mut emit,
                            )
                            .await
                        } else {
                            let first = bypasses == MAX_BYPASS_REQUESTS_PER_CALL + 1;
                            Some(past_the_limit(
                                state, host_id, spec, &request, first, &mut audit,
                            ))
                        };
                        match decided {
                            Some((approved, why)) => {
                                pump.handle.answer_bypass(&request, approved, why).await;
                            }
                            None => {
                                break (
                                    CallResult::not_run(
                                        CallStatus::Cancelled,
                                        "the caller went away",
                                    ),
                                    false,
                                );
                            }
                        }
                    }
                }
            }
        }
    };
    audit.finish(&result);
    meter.finish(&result);
    if caller_present {
        emit(Event::Result(result.clone())).await;
    }
    result
}

/// Bypass requests one call may have decided (by the policy, an approver or the coordinator).
/// Past it, the coordinator refuses them at once, and audits the first: a tool (or a
/// compromised agent) asking again as soon as it is answered wrote 40,000 records in 10 s.
pub const MAX_BYPASS_REQUESTS_PER_CALL: u32 = 64;

/// Refuses a bypass request past [`MAX_BYPASS_REQUESTS_PER_CALL`]: the `first` is audited,
/// the others only counted in the call's record (`audit`), since a looping tool could send them
/// by the thousand a second.
fn past_the_limit(
    state: &State,
    host_id: &str,
    spec: &CallSpec,
    bypass: &BypassRequest,
    first: bool,
    audit: &mut Pending<'_>,
) -> (bool, String) {
    let why = format!(
        "refused: the call has asked for {MAX_BYPASS_REQUESTS_PER_CALL} commands outside its \
         sandbox, the most one call may; its further requests are refused without a record \
         each (the call's record counts them)"
    );
    if first {
        return refuse_bypass(state, host_id, spec, bypass, why);
    }
    audit.bypass_unrecorded();
    (false, why)
}

/// Where a running call stands after [`Pump::step`].
enum Step {
    /// The call ended: its result, not yet given to the caller, and whether the caller is
    /// still there.
    Done(CallResult, bool),
    /// Its tool asks to run a command outside the sandbox; answer, then step on.
    Bypass(BypassRequest),
}

/// Passes a running call's output on to the caller until its end, within the coordinator's
/// deadline for the call.
struct Pump {
    handle: CallHandle,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// The coordinator's end: the call ends when it fires.
    stop: CancellationToken,
}

impl Pump {
    /// `max_timeout` is the coordinator's deadline for a call that leaves its timeout to the
    /// agent.
    fn new(handle: CallHandle, spec: &CallSpec, max_timeout: Duration) -> Self {
        let deadline = match spec.timeout_ms {
            0 => max_timeout,
            ms => Duration::from_millis(ms),
        } + DEADLINE_SLACK;
        Self {
            handle,
            deadline: Box::pin(tokio::time::sleep(deadline)),
            stop: CancellationToken::new(),
        }
    }

    /// Ends the call (cancelled on the agent) when `stop` fires.
    fn until(mut self, stop: CancellationToken) -> Self {
        self.stop = stop;
        self
    }

    async fn step<F, Fut>(&mut self, emit: &mut F) -> Step
    where
        F: FnMut(Event) -> Fut,
        Fut: Future<Output = bool>,
    {
        loop {
            let event = tokio::select! {
                // The coordinator's end first: a link closing for it must not read as LOST.
                biased;
                () = self.stop.cancelled() => {
                    return Step::Done(CallResult::not_run(CallStatus::Cancelled, "the coordinator shut down before the call ended (its drain grace, --drain-grace-secs, was over); the call was cancelled on the host"), true);
                }
                event = self.handle.next() => event,
                () = &mut self.deadline => {
                    // Dropping the handle cancels the call on the agent.
                    return Step::Done(CallResult::not_run(CallStatus::TimedOut, "the agent did not report the call's end in time"), true);
                }
            };
            match event {
                Some(AgentEvent::Output(chunk)) => {
                    let n = chunk.data.len();
                    if !emit(Event::Output(chunk)).await {
                        // Dropping the handle cancels the call on the agent.
                        return Step::Done(
                            CallResult::not_run(CallStatus::Cancelled, "the caller went away"),
                            false,
                        );
                    }
                    self.handle.consumed(n).await;
                }
                Some(AgentEvent::Bypass(request)) => return Step::Bypass(request),
                Some(AgentEvent::Finished(result)) => return Step::Done(result, true),
                None => {
                    return Step::Done(
                        CallResult::not_run(CallStatus::Lost, "the call ended without a result"),
                        true,
                    );
                }
            }
        }
    }
}

/// Runs `pump` to the call's end, denying any bypass request (for tests of the pump alone).
#[cfg(test)]
async fn pump<F, Fut>(
    handle: CallHandle,
    spec: &CallSpec,
    max_timeout: Duration,
    emit: &mut F,
) -> (CallResult, bool)
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = bool>,
{
    let mut pump = Pump::new(handle, spec, max_timeout);
    loop {
        match pump.step(emit).await {
            Step::Done(result, present) => return (result, present),
            Step::Bypass(request) => {
                pump.handle
                    .answer_bypass(&request, false, "no bypass in tests".into())
                    .await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;

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
        toolsrv_proto::outbound::Taken<toolsrv_proto::v1::CoordinatorMessage>,
    ) {
        let (tx, rx) = toolsrv_proto::outbound::channel(64, crate::link::DEFAULT_STALLED_AFTER);
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
