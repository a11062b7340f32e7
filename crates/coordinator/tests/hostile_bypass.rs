//! A compromised agent, from a hand-driven agent link. Its bypass requests: a command without
//! end or without a name is refused by the coordinator itself, audited, and put to nobody; the
//! call and the link go on. A second request while the first waits for a person, or output past
//! a call's credit, ends that call (the agent is told to kill it), not the link or its other
//! calls; and a request waiting for a person is withdrawn when its call ends.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::time::Duration;

use common::{Coordinator, WAIT, audited, call_result, client, next};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::Streaming;
use tonic::transport::Channel;
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::tools_client::ToolsClient;
use toolsrv_proto::v1::{
    AgentMessage, BypassDecision, BypassRequest, CallEvent, CallFinished, CallOutput, CallRequest,
    CallResult, CallStatus, CoordinatorMessage, ListApprovalsRequest, OutputChunk, OutputStream,
    call_event,
};
use toolsrv_testkit::{must, wait_until};

async fn send(out: &mpsc::Sender<AgentMessage>, msg: Out) {
    out.send(AgentMessage { msg: Some(msg) }).await.unwrap();
}

/// A coordinator whose policy asks a person before any bypass, with tool `asker` and host `a`
/// attached by hand, its view in; the agent's sender and the coordinator's messages.
async fn asking_coordinator(
    configure: impl FnOnce(&mut toolsrv_coordinator::CoordinatorConfig),
) -> (
    Coordinator,
    mpsc::Sender<AgentMessage>,
    Streaming<CoordinatorMessage>,
) {
    let meta = r#"{"description": "asks for more", "cmd": "true"}"#;
    let coordinator = Coordinator::start_with(&["a"], &[("asker.meta", meta)], |config, dir| {
        config.audit_log = Some(dir.join("audit.jsonl"));
        let policy = dir.join("policy.json");
        std::fs::write(
            &policy,
            r#"{"default": "allow", "default_bypass": "ask", "rules": []}"#,
        )
        .unwrap();
        config.policy = Some(policy);
        configure(config);
    })
    .await;
    let (out, inbound) = coordinator.attach_offering("a", &["asker"]).await;
    (coordinator, out, inbound)
}

/// Alice calls `asker` on `a`: her event stream, and the call's id on the link.
async fn call_asker(
    api: &mut ToolsClient<Channel>,
    inbound: &mut Streaming<CoordinatorMessage>,
) -> (Streaming<CallEvent>, u64) {
    let events = api
        .call(CallRequest {
            host: "a".into(),
            tool: "asker".into(),
            ..CallRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    let call_id = next(inbound, |m| match m {
        In::Start(start) => Some(start.call_id),
        _ => None,
    })
    .await;
    (events, call_id)
}

/// Sends `request` as the agent and waits for the coordinator's decision on it.
async fn decided(
    out: &mpsc::Sender<AgentMessage>,
    inbound: &mut Streaming<CoordinatorMessage>,
    request: BypassRequest,
) -> BypassDecision {
    send(out, Out::Bypass(request)).await;
    next(inbound, |m| match m {
        In::Bypass(decision) => Some(decision),
        _ => None,
    })
    .await
}

fn bypass(call_id: u64, request_id: u64) -> Out {
    Out::Bypass(BypassRequest {
        call_id,
        request_id,
        argv: vec!["cat".into(), "/etc/shadow".into()],
        reason: "audit".into(),
        stdin_bytes: 0,
    })
}

fn finished(call_id: u64, status: CallStatus) -> Out {
    Out::Finished(CallFinished {
        call_id,
        result: Some(CallResult {
            status: status as i32,
            exit_code: (status == CallStatus::Ok).then_some(0),
            ..CallResult::default()
        }),
    })
}

/// The approval requests waiting, within the wait, once there are `n`.
async fn approvals_waiting(api: &mut ToolsClient<Channel>, n: usize) {
    must(
        wait_until(
            &format!("{n} approval requests waiting"),
            WAIT,
            async || {
                let waiting = api
                    .list_approvals(ListApprovalsRequest::default())
                    .await
                    .ok()?
                    .into_inner()
                    .requests;
                (waiting.len() == n).then_some(())
            },
        )
        .await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bypass_requests_no_person_should_read_are_refused_by_the_coordinator() {
    let (coordinator, out, mut inbound) = asking_coordinator(|_| {}).await;
    let mut api = coordinator.tools(&client("alice")).await;
    let (mut events, call_id) = call_asker(&mut api, &mut inbound).await;

    let requests = [
        (
            vec!["rm".to_string(), "x".repeat(100_000)],
            "tidy",
            "100006 bytes",
        ),
        (Vec::new(), "nothing", "names no command"),
        (
            vec![String::new(), "-rf".into()],
            "empty",
            "names no command",
        ),
    ];
    for (i, (argv, reason, why)) in requests.into_iter().enumerate() {
        let request_id = i as u64 + 1;
        let request = BypassRequest {
            call_id,
            request_id,
            argv,
            reason: reason.into(),
            stdin_bytes: 0,
        };
        let decision = decided(&out, &mut inbound, request).await;
        assert_eq!(decision.request_id, request_id);
        assert!(!decision.approved);
        assert!(
            decision.reason.starts_with("refused: ") && decision.reason.contains(why),
            "{}",
            decision.reason
        );
    }
    // Nobody was asked: the caller's stream carries no approval request, nor does the list.
    let approvals = api
        .list_approvals(ListApprovalsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(approvals.requests.is_empty(), "{approvals:?}");

    // The call goes on to its end.
    send(&out, finished(call_id, CallStatus::Ok)).await;
    let result = call_result(&mut events).await;
    assert_eq!(result.status, CallStatus::Ok as i32, "{result:?}");

    // Each refusal audited, bounded.
    let bypasses = audited(&coordinator, "bypass");
    assert_eq!(bypasses.len(), 3, "{bypasses:?}");
    for record in &bypasses {
        assert_eq!(record["decision"], "denied");
        assert_eq!(record["decided_by"], "coordinator");
        assert!(
            record["bypass_argv"].as_str().unwrap().len() < 400,
            "{record}"
        );
    }
    let audit = std::fs::read_to_string(coordinator.dir.path().join("audit.jsonl")).unwrap();
    assert!(audit.len() < 8_000, "{} bytes of audit", audit.len());
    coordinator.stop().await;
}

/// An agent that asks again as soon as it is answered (40,000 audit records in 10 s from one
/// call): past the limit of one call its requests are refused, the first with a record, the
/// others counted in the call's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_s_bypass_requests_past_its_limit_are_refused_and_counted() {
    let (coordinator, out, mut inbound) = asking_coordinator(|_| {}).await;
    let mut api = coordinator.tools(&client("alice")).await;
    let (mut events, call_id) = call_asker(&mut api, &mut inbound).await;
    let limit = u64::from(toolsrv_coordinator::MAX_BYPASS_REQUESTS_PER_CALL);
    let asked = 1000;
    for request_id in 1..=asked {
        // Named no command: refused by the coordinator whatever the policy, put to nobody.
        let request = BypassRequest {
            call_id,
            request_id,
            ..BypassRequest::default()
        };
        let decision = decided(&out, &mut inbound, request).await;
        assert_eq!(decision.request_id, request_id);
        assert!(!decision.approved);
        let why = match request_id <= limit {
            true => "names no command",
            false => "the most one call may",
        };
        assert!(
            decision.reason.contains(why),
            "{request_id}: {}",
            decision.reason
        );
    }
    send(&out, finished(call_id, CallStatus::Ok)).await;
    let result = call_result(&mut events).await;
    assert_eq!(result.status, CallStatus::Ok as i32, "{result:?}");

    let bypasses = audited(&coordinator, "bypass");
    assert_eq!(
        bypasses.len() as u64,
        limit + 1,
        "one record past the limit"
    );
    let last = bypasses.last().unwrap();
    assert!(
        last["reason"]
            .as_str()
            .unwrap()
            .contains("refused without a record"),
        "{last}"
    );
    let calls = audited(&coordinator, "call");
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(
        calls[0]["bypass_unrecorded"],
        asked - limit - 1,
        "{}",
        calls[0]
    );
    coordinator.stop().await;
}

/// Alice's call of `asker` on `a`, its agent asking for a command outside the sandbox, and the
/// request waiting for a person (for ten minutes if nobody answers).
async fn a_request_waiting_for_a_person() -> (
    Coordinator,
    mpsc::Sender<AgentMessage>,
    Streaming<CoordinatorMessage>,
    ToolsClient<Channel>,
    Streaming<CallEvent>,
    u64,
) {
    let (coordinator, out, mut inbound) =
        asking_coordinator(|config| config.approval_timeout = Duration::from_secs(600)).await;
    let mut api = coordinator.tools(&client("alice")).await;
    let (events, call_id) = call_asker(&mut api, &mut inbound).await;
    send(&out, bypass(call_id, 1)).await;
    approvals_waiting(&mut api, 1).await;
    (coordinator, out, inbound, api, events, call_id)
}

/// A tool's process killed at its timeout while its request outside the sandbox waits for a
/// person: the request is withdrawn (nobody can approve a command for a call that is over) and
/// the caller has the result at once, not after the approval's own timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_a_person_is_withdrawn_when_its_call_ends() {
    let (coordinator, out, _inbound, mut api, mut events, call_id) =
        a_request_waiting_for_a_person().await;
    send(&out, finished(call_id, CallStatus::TimedOut)).await;
    let result = call_result(&mut events).await;
    assert_eq!(result.status, CallStatus::TimedOut as i32, "{result:?}");
    approvals_waiting(&mut api, 0).await;
    let records = audited(&coordinator, "bypass");
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0]["decision"], "withdrawn", "{}", records[0]);
    coordinator.stop().await;
}

/// The agent asks one command at a time for a call; a second request while the first waits is
/// a broken or compromised agent. That call ends (the agent is told to kill it, the waiting
/// request is withdrawn), nothing is put to a person, and the link serves the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_request_while_the_first_waits_ends_that_call_not_the_link() {
    let (coordinator, out, mut inbound, mut api, mut events, call_id) =
        a_request_waiting_for_a_person().await;
    for request_id in 2..50 {
        send(&out, bypass(call_id, request_id)).await;
    }
    assert_eq!(cancelled(&mut inbound).await, call_id);
    let result = call_result(&mut events).await;
    lost_saying(
        &result,
        "host a asked for a second command outside the sandbox",
    );
    approvals_waiting(&mut api, 0).await;
    let records = audited(&coordinator, "bypass");
    assert_eq!(records.len(), 1, "one request was filed: {records:?}");
    assert_eq!(records[0]["decision"], "withdrawn");
    the_link_serves_another_call(&mut api, &mut inbound, &out).await;
    coordinator.stop().await;
}

/// The call ended `lost`, its message saying `what`.
fn lost_saying(result: &CallResult, what: &str) {
    assert_eq!(result.status, CallStatus::Lost as i32, "{result:?}");
    assert!(result.message.contains(what), "{}", result.message);
}

/// The id of the next call the coordinator tells the agent to kill.
async fn cancelled(inbound: &mut Streaming<CoordinatorMessage>) -> u64 {
    next(inbound, |m| match m {
        In::Cancel(cancel) => Some(cancel.call_id),
        _ => None,
    })
    .await
}

/// A new call on the link starts and ends as the agent says.
async fn the_link_serves_another_call(
    api: &mut ToolsClient<Channel>,
    inbound: &mut Streaming<CoordinatorMessage>,
    out: &mpsc::Sender<AgentMessage>,
) {
    let (mut events, call_id) = call_asker(api, inbound).await;
    send(out, finished(call_id, CallStatus::Ok)).await;
    let result = call_result(&mut events).await;
    assert_eq!(result.status, CallStatus::Ok as i32, "{result:?}");
}

/// An agent that ignores flow control and streams a call's output while its caller reads
/// nothing: the coordinator passes on no more than the call's credit (the first window, what it
/// granted back, and one chunk), ends the call naming the breach, tells the agent to kill it,
/// and serves the link's next call. What it grants back depends on how much the transport took
/// while the caller read nothing (its HTTP/2 windows and the call's queue to it) and on how the
/// runtime ran the link's reader and the call between the flood's chunks, so the grants are
/// counted as the agent gets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_past_a_call_s_credit_ends_that_call_not_the_link() {
    const WINDOW: u64 = 64 << 10;
    let (coordinator, out, mut inbound) =
        asking_coordinator(|config| config.credit_window = WINDOW).await;
    let mut api = coordinator.tools(&client("alice")).await;
    let (mut events, call_id) = call_asker(&mut api, &mut inbound).await;
    // 64 windows of output, none of it read by the caller yet.
    let flood = tokio::spawn({
        let out = out.clone();
        async move {
            for _ in 0..64 {
                let chunk = OutputChunk {
                    stream: OutputStream::Stdout as i32,
                    data: vec![b'x'; WINDOW as usize],
                };
                let output = Out::Output(CallOutput {
                    call_id,
                    chunk: Some(chunk),
                });
                if out.send(AgentMessage { msg: Some(output) }).await.is_err() {
                    return;
                }
            }
        }
    });
    let granted = std::cell::Cell::new(0u64);
    let cancelled = next(&mut inbound, |m| match m {
        In::Credit(credit) if credit.call_id == call_id => {
            granted.set(granted.get() + credit.bytes);
            None
        }
        In::Cancel(cancel) => Some(cancel.call_id),
        _ => None,
    })
    .await;
    assert_eq!(cancelled, call_id);
    tokio::time::timeout(WAIT, flood).await.unwrap().unwrap();

    let mut bytes = 0;
    let result = tokio::time::timeout(WAIT, async {
        while let Some(event) = events.next().await {
            match event.unwrap().event {
                Some(call_event::Event::Output(chunk)) => bytes += chunk.data.len() as u64,
                Some(call_event::Event::Result(result)) => return result,
                _ => {}
            }
        }
        panic!("no result");
    })
    .await
    .unwrap();
    let granted = granted.get();
    assert!(
        bytes <= WINDOW + granted + WINDOW,
        "{bytes} bytes passed on for a window of {WINDOW} and {granted} granted back"
    );
    assert!(bytes < 64 * WINDOW, "the whole flood passed on");
    lost_saying(
        &result,
        "host a sent output for the call beyond the credit it was given",
    );
    the_link_serves_another_call(&mut api, &mut inbound, &out).await;
    coordinator.stop().await;
}

/// An agent that says a call it ran was denied by the policy (a status only the coordinator
/// gives): the caller and the audit log get `lost`, saying what the host claimed, not a denial
/// the policy never made; the link serves the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_cannot_have_the_audit_log_say_the_policy_denied_a_call_it_ran() {
    let (coordinator, out, mut inbound) = asking_coordinator(|_| {}).await;
    let mut api = coordinator.tools(&client("alice")).await;
    let (mut events, call_id) = call_asker(&mut api, &mut inbound).await;
    send(&out, finished(call_id, CallStatus::Denied)).await;
    let result = call_result(&mut events).await;
    lost_saying(
        &result,
        "CALL_STATUS_DENIED, which only the coordinator gives",
    );
    let records = audited(&coordinator, "call");
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0]["status"], "CALL_STATUS_LOST", "{}", records[0]);
    the_link_serves_another_call(&mut api, &mut inbound, &out).await;
    coordinator.stop().await;
}
