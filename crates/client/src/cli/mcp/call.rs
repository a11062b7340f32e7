//! An MCP `tools/call` run on the fleet: output as progress notifications, cancellation, approval
//! requests as elicitations (a server-to-client request for 2025-11-25 clients, an
//! `input_required` round trip for 2026-07-28 ones), and the call's result as an MCP result.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::cli::quote::{printable, quoted};
use crate::cli::remote::asked;
use rmcp::model::{
    CallToolResponse, CallToolResult, ContentBlock, ElicitRequest, ElicitRequestParams,
    ElicitResult, ElicitationAction, InputRequest, InputRequests, InputRequiredResult,
    ProgressNotificationParam, ProgressToken, ProtocolVersion, ResultType,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer};
use serde_json::{Value, json};
use tokio_util::task::TaskTracker;

use crate::{
    ApprovalRequest, CallRequest, CallResult, CallStatus, CallStream, CallUpdate, Client,
    status_name,
};

/// The key of the one input request of an approval round trip.
const APPROVAL_INPUT: &str = "approval";
/// How long a parked call outlives its approval request's expiry, should the client never
/// come back (the coordinator has denied it by then; the call ends as denied).
const PARKED_GRACE: Duration = Duration::from_secs(5);
/// Longest progress message (a chunk of output can be large).
const MAX_PROGRESS_MESSAGE: usize = 4096;

/// A call under way.
#[derive(Debug)]
pub struct Running {
    stream: CallStream,
    host: String,
    tool: String,
    /// Bytes of output so far: the progress value, which must only grow.
    progress: f64,
}

/// Calls that wait for a 2026-07-28 client to come back with an approval decision, by the
/// opaque `requestState` handed to it. The handle is only a key: the call stays here.
#[derive(Debug, Clone, Default)]
pub struct Parked {
    calls: Arc<Mutex<HashMap<String, (Running, ApprovalRequest)>>>,
}

/// What became of a `requestState` a client came back with.
enum Taken {
    /// The call, taken: the client's answer decides it.
    Call(Box<(Running, ApprovalRequest)>),
    /// No call waits under the handle.
    Gone,
    /// A call of another tool waits under it, and stays.
    OtherTool(String),
}

impl Parked {
    fn take(&self, handle: &str) -> Option<(Running, ApprovalRequest)> {
        self.calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(handle)
    }

    /// The call waiting under `handle` if it is one of `tool`: a client that names another
    /// tool must not end a call it did not describe.
    fn take_for(&self, handle: &str, tool: &str) -> Taken {
        let mut calls = self
            .calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match calls.get(handle) {
            None => Taken::Gone,
            Some((run, _)) if run.tool != tool => Taken::OtherTool(run.tool.clone()),
            Some(_) => calls
                .remove(handle)
                .map_or(Taken::Gone, |c| Taken::Call(Box::new(c))),
        }
    }

    /// Parks `run` under a new handle until the client comes back, or until the request
    /// expires (dropping the stream then cancels whatever is left of the call).
    fn park(&self, run: Running, request: ApprovalRequest, tasks: &TaskTracker) -> String {
        // Any client of this server may answer any of its elicitations (none is authenticated);
        // the handle only has to be unique, not secret.
        let handle = format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
        let left_ms = request
            .expires_unix_ms
            .saturating_sub(toolsrv_proto::unix_ms());
        self.calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(handle.clone(), (run, request));
        let parked = self.clone();
        let key = handle.clone();
        tasks.spawn(async move {
            tokio::time::sleep(Duration::from_millis(left_ms) + PARKED_GRACE).await;
            parked.take(&key);
        });
        handle
    }
}

/// What the server's handlers share for calls.
#[derive(Debug, Clone)]
pub struct Calls {
    pub client: Client,
    pub parked: Parked,
    pub tasks: TaskTracker,
    /// Told when a request found the session gone, so that the keeper opens a new one at once.
    pub session_gone: Arc<tokio::sync::Notify>,
}

impl Calls {
    /// Starts `tool` on `host` for `session` and runs it to an MCP result.
    pub async fn start(
        &self,
        session: &str,
        host: String,
        tool: String,
        args: serde_json::Map<String, Value>,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let request = CallRequest {
            host: host.clone(),
            tool: tool.clone(),
            args_json: Value::Object(args).to_string(),
            session: session.to_string(),
            ..Default::default()
        };
        let stream = match self.client.call(request).await {
            Ok(stream) => stream,
            Err(e) => {
                return Ok(error(format!("cannot call `{tool}` on host `{host}`: {e}")).into());
            }
        };
        let run = Running {
            stream,
            host,
            tool,
            progress: 0.0,
        };
        self.pump(run, ctx).await
    }

    /// Takes up a call parked for an approval, with the client's answer.
    pub async fn resume(
        &self,
        tool: &str,
        handle: &str,
        responses: Option<&rmcp::model::InputResponses>,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let (run, request) = match self.parked.take_for(handle, tool) {
            Taken::Call(call) => *call,
            Taken::Gone => {
                return Ok(error(format!(
                    "the call of `{}` is no longer waiting for this approval (the request \
                     expired, or was answered already): call the tool again",
                    quoted(tool)
                ))
                .into());
            }
            Taken::OtherTool(other) => {
                return Err(McpError::invalid_params(
                    format!(
                        "requestState belongs to a call of `{}`, not of `{}`; that call still \
                         waits for its answer",
                        quoted(&other),
                        quoted(tool)
                    ),
                    None,
                ));
            }
        };
        let answer = responses
            .and_then(|r| r.get(APPROVAL_INPUT))
            .and_then(|v| serde_json::from_value::<ElicitResult>(v.clone()).ok());
        let (approve, reason) = decision(answer.as_ref());
        self.decide(&request, approve, &reason).await;
        self.pump(run, ctx).await
    }

    /// Reads the call's events to its result, or until the client cancels (dropping the stream
    /// cancels the call on the host, which kills its processes).
    async fn pump(
        &self,
        mut run: Running,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let token = ctx.meta.get_progress_token();
        loop {
            let event = tokio::select! {
                () = ctx.ct.cancelled() => {
                    tracing::info!(tool = %run.tool, host = %run.host, "cancelled by the MCP client");
                    drop(run);
                    return Err(McpError::internal_error("cancelled by the client", None));
                }
                event = run.stream.next() => event,
            };
            match event {
                Some(Ok(CallUpdate::Output(chunk))) => {
                    run.progress += chunk.data.len() as f64;
                    if let Some(token) = &token {
                        let text = String::from_utf8_lossy(&chunk.data);
                        progress(ctx, token, run.progress, text.trim_end()).await;
                    }
                }
                Some(Ok(CallUpdate::Approval(request))) => {
                    if let Some(parked) = self.approval(&mut run, request, ctx, &token).await {
                        let handle = self.parked.park(run, parked.1, &self.tasks);
                        let mut inputs = InputRequests::new();
                        inputs.insert(APPROVAL_INPUT.to_string(), parked.0);
                        return Ok(InputRequiredResult::new(Some(inputs), Some(handle)).into());
                    }
                }
                Some(Ok(CallUpdate::Result(result))) => {
                    return Ok(tool_result(&run.host, &run.tool, &result).into());
                }
                Some(Err(e @ crate::ClientError::Transport { .. })) => {
                    return Ok(error(crate::cli::remote::call::broke_mid_call(
                        &run.tool, &run.host, &e,
                    ))
                    .into());
                }
                Some(Err(e)) => {
                    return Ok(error(format!(
                        "the call of `{}` on host `{}` failed: {e}",
                        run.tool, run.host
                    ))
                    .into());
                }
                None => {
                    return Ok(error(format!(
                        "the call of `{}` on host `{}` ended without a result",
                        run.tool, run.host
                    ))
                    .into());
                }
            }
        }
    }

    /// Handles one approval request of a running call. Returns the elicitation to hand a
    /// 2026-07-28 client (and the request to park the call with); `None` when the call goes on
    /// reading (decided here, or left to the approvers it names).
    async fn approval(
        &self,
        run: &mut Running,
        request: ApprovalRequest,
        ctx: &RequestContext<RoleServer>,
        token: &Option<ProgressToken>,
    ) -> Option<(InputRequest, ApprovalRequest)> {
        if !request.caller_may_decide {
            let text = format!(
                "waiting for approval by {} (request {}, expires in {} s): {}",
                request.approvers.join(" or "),
                request.id,
                request
                    .expires_unix_ms
                    .saturating_sub(toolsrv_proto::unix_ms())
                    .div_ceil(1000),
                asked(&request)
            );
            eprintln!("toolctl mcp: {text}");
            if let Some(token) = token {
                progress(ctx, token, run.progress, &text).await;
            }
            return None;
        }
        if !can_ask(ctx) {
            let reason = "MCP elicitation is unsupported by the client, so nobody can be asked: \
                          denied (decide such calls with `toolctl call`, or change the policy)";
            self.decide(&request, false, reason).await;
            return None;
        }
        let params = ElicitRequestParams::FormElicitationParams {
            meta: None,
            message: elicitation_message(&request),
            requested_schema: approval_schema(),
        };
        let modern = ctx
            .protocol_version()
            .is_some_and(|v| v.as_str() >= ProtocolVersion::V_2026_07_28.as_str());
        if modern {
            let input = InputRequest::Elicitation(ElicitRequest::new(params));
            return Some((input, request));
        }
        let left = Duration::from_millis(
            request
                .expires_unix_ms
                .saturating_sub(toolsrv_proto::unix_ms()),
        );
        let answer = tokio::select! {
            // Cancelled while asking: the call is dropped by `pump` right after.
            () = ctx.ct.cancelled() => return None,
            answer = ctx.peer.create_elicitation_with_timeout(params, Some(left)) => answer,
        };
        let (approve, reason) = match answer {
            Ok(answer) => decision(Some(&answer)),
            Err(e) => (false, format!("the MCP elicitation failed: {e}")),
        };
        self.decide(&request, approve, &reason).await;
        None
    }

    async fn decide(&self, request: &ApprovalRequest, approve: bool, reason: &str) {
        if let Err(e) = self.client.decide(&request.id, approve, reason).await {
            // The call ends as denied when the request expires; its result says so.
            eprintln!(
                "toolctl mcp: cannot answer approval request {}: {e}",
                request.id
            );
        }
    }
}

/// Whether the client can ask its user for an approval: it supports form elicitation.
pub fn can_ask(ctx: &RequestContext<RoleServer>) -> bool {
    ctx.client_capabilities()
        .and_then(|c| c.elicitation)
        .is_some_and(|e| {
            // A client that names no mode supports form mode (2025-06-18 clients).
            e.form.is_some() || e.url.is_none()
        })
}

async fn progress(ctx: &RequestContext<RoleServer>, token: &ProgressToken, value: f64, text: &str) {
    let mut message = text.to_string();
    if message.len() > MAX_PROGRESS_MESSAGE {
        let mut cut = MAX_PROGRESS_MESSAGE;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push('…');
    }
    let param = ProgressNotificationParam::new(token.clone(), value).with_message(message);
    if let Err(e) = ctx.peer.notify_progress(param).await {
        tracing::debug!(error = %e, "cannot send a progress notification");
    }
}

/// The question a person answers.
fn elicitation_message(request: &ApprovalRequest) -> String {
    format!(
        "Approve? {}. Why approval is needed: {}.",
        asked(request),
        printable(&request.reason)
    )
}

/// A yes/no form.
fn approval_schema() -> rmcp::model::ElicitationSchema {
    let schema = json!({
        "type": "object",
        "properties": {
            "approve": {"type": "boolean", "title": "Approve",
                        "description": "Yes runs it; no denies it"},
        },
        "required": ["approve"],
    });
    // A constant schema of the shape ElicitationSchema models: cannot fail.
    serde_json::from_value(schema)
        .unwrap_or_else(|_| rmcp::model::ElicitationSchema::new(Default::default()))
}

/// Approve only on an accepted form that says yes.
fn decision(answer: Option<&ElicitResult>) -> (bool, String) {
    match answer {
        Some(r) if r.action == ElicitationAction::Accept => {
            let yes = r
                .content
                .as_ref()
                .and_then(|c| c.get("approve"))
                .and_then(Value::as_bool)
                == Some(true);
            let word = if yes { "approved" } else { "denied" };
            (yes, format!("{word} through an MCP elicitation"))
        }
        Some(r) => (
            false,
            format!("the MCP elicitation was answered `{:?}`", r.action).to_lowercase(),
        ),
        None => (false, "no answer to the MCP elicitation".to_string()),
    }
}

/// An error result with one text block.
pub fn error(text: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text)])
}

/// A call's result as an MCP result: the tool's content passed through (and, when it is one
/// text that is a JSON object, also as `structuredContent`); every status but `ok` an error.
pub fn tool_result(host: &str, tool: &str, result: &CallResult) -> CallToolResult {
    let ran = matches!(
        CallStatus::try_from(result.status),
        Ok(CallStatus::Ok | CallStatus::ToolError)
    );
    let failure = || {
        format!(
            "{}: {}",
            status_name(result.status),
            crate::cli::remote::failure_line(host, tool, result)
        )
    };
    if !ran {
        return error(failure());
    }
    let ok = crate::is_ok(result.status);
    let mut mcp = serde_json::from_str::<CallToolResult>(&result.result_json)
        .unwrap_or_else(|_| CallToolResult::success(vec![ContentBlock::text(&result.result_json)]));
    mcp.result_type = Some(ResultType::COMPLETE);
    mcp.is_error = Some(!ok);
    if ok
        && mcp.structured_content.is_none()
        && let [ContentBlock::Text(text)] = mcp.content.as_slice()
        && let Ok(object @ Value::Object(_)) = serde_json::from_str::<Value>(&text.text)
    {
        mcp.structured_content = Some(object);
    }
    if !ok
        && mcp
            .content
            .iter()
            .all(|c| c.as_text().is_some_and(|t| t.text.trim().is_empty()))
    {
        mcp.content = vec![ContentBlock::text(failure())];
    }
    if result.truncated {
        mcp.content.push(ContentBlock::text(
            "(the output was cut at the host's output cap)",
        ));
    }
    mcp
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn result(status: CallStatus, json: &str, message: &str) -> CallResult {
        CallResult {
            status: status as i32,
            result_json: json.into(),
            message: message.into(),
            ..Default::default()
        }
    }

    fn wire(r: &CallToolResult) -> Value {
        serde_json::to_value(r).unwrap()
    }

    #[test]
    fn content_passes_through_and_json_objects_become_structured() {
        let r = tool_result(
            "a",
            "t",
            &result(
                CallStatus::Ok,
                r#"{"content":[{"type":"text","text":"hi\n"}]}"#,
                "",
            ),
        );
        assert_eq!(
            wire(&r),
            json!({"resultType": "complete", "content": [{"type": "text", "text": "hi\n"}], "isError": false})
        );
        let r = tool_result(
            "a",
            "t",
            &result(
                CallStatus::Ok,
                r#"{"content":[{"type":"text","text":"{\"n\": 1}"}]}"#,
                "",
            ),
        );
        assert_eq!(r.structured_content, Some(json!({"n": 1})));
        let r = tool_result(
            "a",
            "t",
            &result(
                CallStatus::Ok,
                r#"{"content":[{"type":"text","text":"[1]"}]}"#,
                "",
            ),
        );
        assert_eq!(
            r.structured_content, None,
            "only objects are structured content"
        );
    }

    #[test]
    fn failures_are_error_results_with_a_clear_text() {
        let r = tool_result(
            "a",
            "t",
            &result(
                CallStatus::ToolError,
                r#"{"content":[{"type":"text","text":"boom\n"}],"isError":true}"#,
                "exited with code 3",
            ),
        );
        assert_eq!(r.is_error, Some(true));
        assert_eq!(r.content[0].as_text().unwrap().text, "boom\n");
        assert_eq!(r.structured_content, None);

        let r = tool_result(
            "a",
            "t",
            &result(
                CallStatus::ToolError,
                r#"{"content":[],"isError":true}"#,
                "exited with code 3",
            ),
        );
        assert_eq!(
            r.content[0].as_text().unwrap().text,
            "tool_error: tool `t` on host `a`: exited with code 3"
        );

        for (status, message) in [
            (
                CallStatus::Hidden,
                "tool `t` is hidden on host `a`: no variant matches",
            ),
            (CallStatus::Offline, "host `a` is offline"),
            (CallStatus::Denied, "approval denied by alice"),
            (CallStatus::TimedOut, "timed out after 1s"),
            (CallStatus::Lost, ""),
        ] {
            let r = tool_result("a", "t", &result(status, "", message));
            assert_eq!(r.is_error, Some(true));
            let text = &r.content[0].as_text().unwrap().text;
            assert!(text.starts_with(status_name(status as i32)), "{text}");
            assert!(text.contains(message), "{text}");
        }
    }

    #[test]
    fn only_an_accepted_yes_approves() {
        let answer = |v: Value| serde_json::from_value::<ElicitResult>(v).unwrap();
        assert!(
            decision(Some(&answer(
                json!({"action": "accept", "content": {"approve": true}})
            )))
            .0
        );
        assert!(
            !decision(Some(&answer(
                json!({"action": "accept", "content": {"approve": false}})
            )))
            .0
        );
        assert!(!decision(Some(&answer(json!({"action": "decline"})))).0);
        assert!(!decision(Some(&answer(json!({"action": "cancel"})))).0);
        assert!(!decision(None).0);
        assert!(
            serde_json::to_value(approval_schema()).unwrap()["properties"]["approve"]["type"]
                == "boolean"
        );
    }
}
