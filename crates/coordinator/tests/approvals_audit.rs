//! Approvals and fan-outs as the audit log and their callers see them, from hand-driven agent
//! links: a decision someone may not take is refused and on the record; a request nobody but
//! its caller is named to decide is denied at once; an approved call runs on the link its host
//! has when it is approved; every host of a fan-out is on the record, whether it ran, was
//! skipped or was never reached; a selector that matches nothing is on the record too.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use common::{Coordinator, WAIT, audited, call_result, client, next};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::Streaming;
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::{
    AgentMessage, ApproveRequest, CallEvent, CallFinished, CallRequest, CallResult, CallStatus,
    CoordinatorMessage, FanOutRequest, ListApprovalsRequest, call_event, fan_out_event,
};
use toolsrv_testkit::{must, wait_until};

/// `t` waits for bob's approval, `u` names only alice (who calls it), `plain` asks nobody.
const POLICY: &str = r#"{"default": "allow", "rules": [
  {"tools": ["t"], "effect": "approve", "approvers": ["bob"]},
  {"tools": ["u"], "effect": "approve", "approvers": ["alice"]}
]}"#;

const TOOL: &str = r#"{"description": "fake", "cmd": "true"}"#;

async fn coordinator(hosts: &[&str]) -> Coordinator {
    Coordinator::start_with(
        hosts,
        &[("t.meta", TOOL), ("u.meta", TOOL), ("plain.meta", TOOL)],
        |config, dir| {
            config.audit_log = Some(dir.join("audit.jsonl"));
            let policy = dir.join("policy.json");
            std::fs::write(&policy, POLICY).unwrap();
            config.policy = Some(policy);
        },
    )
    .await
}

/// Waits until the audit log holds `n` records of `event` matching `keep`, and returns them.
async fn audited_within(
    coordinator: &Coordinator,
    event: &str,
    n: usize,
    keep: impl Fn(&serde_json::Value) -> bool,
) -> Vec<serde_json::Value> {
    must(
        wait_until(&format!("{n} `{event}` records"), WAIT, async || {
            let records: Vec<_> = audited(coordinator, event)
                .into_iter()
                .filter(|r| keep(r))
                .collect();
            (records.len() >= n).then_some(records)
        })
        .await,
    )
}

async fn started(inbound: &mut Streaming<CoordinatorMessage>) -> u64 {
    next(inbound, |m| match m {
        In::Start(start) => Some(start.call_id),
        _ => None,
    })
    .await
}

async fn finish(out: &mpsc::Sender<AgentMessage>, call_id: u64, status: CallStatus) {
    let msg = Out::Finished(CallFinished {
        call_id,
        result: Some(CallResult {
            status: status as i32,
            exit_code: Some(if status == CallStatus::Ok { 0 } else { 1 }),
            ..CallResult::default()
        }),
    });
    out.send(AgentMessage { msg: Some(msg) }).await.unwrap();
}

/// Alice calls `tool` on host `a` with `args_json`: her events and the approval request the
/// call waits for.
async fn call_waiting(
    coordinator: &Coordinator,
    tool: &str,
    args_json: &str,
) -> (Streaming<CallEvent>, toolsrv_proto::v1::ApprovalRequest) {
    let mut api = coordinator.tools(&client("alice")).await;
    let mut events = api
        .call(CallRequest {
            host: "a".into(),
            tool: tool.into(),
            args_json: args_json.into(),
            ..CallRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    let request = tokio::time::timeout(WAIT, async {
        while let Some(event) = events.next().await {
            if let Some(call_event::Event::Approval(request)) = event.unwrap().event {
                return request;
            }
        }
        panic!("the call ended without asking for approval");
    })
    .await
    .expect("the call asks within the wait");
    (events, request)
}

async fn decide(
    coordinator: &Coordinator,
    who: &str,
    id: &str,
    approve: bool,
) -> Result<(), tonic::Status> {
    let mut api = coordinator.tools(&client(who)).await;
    api.approve(ApproveRequest {
        id: id.into(),
        approve,
        reason: String::new(),
    })
    .await
    .map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_refused_is_on_the_record_and_the_request_still_waits() {
    let coordinator = coordinator(&["a"]).await;
    let (out, mut inbound) = coordinator.attach_offering("a", &["t"]).await;
    let (mut events, request) = call_waiting(&coordinator, "t", "").await;

    // The caller may not approve a call its rule gives to bob.
    let refused = decide(&coordinator, "alice", &request.id, true)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    let records = audited_within(&coordinator, "refusal", 1, |r| {
        r["approval_id"] == request.id.as_str()
    })
    .await;
    assert_eq!(records[0]["client"], "alice", "{records:?}");
    assert_eq!(records[0]["code"], "PermissionDenied", "{records:?}");
    assert!(
        records[0]["message"]
            .as_str()
            .unwrap()
            .contains("needs another approver"),
        "{records:?}"
    );

    // An empty id is a usage error, not an unknown request.
    let empty = decide(&coordinator, "bob", "", true).await.unwrap_err();
    assert_eq!(empty.code(), tonic::Code::InvalidArgument, "{empty:?}");

    // The request is still bob's to decide.
    decide(&coordinator, "bob", &request.id, true)
        .await
        .unwrap();
    let call_id = started(&mut inbound).await;
    finish(&out, call_id, CallStatus::Ok).await;
    assert_eq!(call_result(&mut events).await.status, CallStatus::Ok as i32);
    coordinator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_only_its_caller_is_named_to_decide_is_denied_at_once() {
    let coordinator = coordinator(&["a"]).await;
    let (_out, _inbound) = coordinator.attach_offering("a", &["u"]).await;
    let mut api = coordinator.tools(&client("alice")).await;
    let mut events = api
        .call(CallRequest {
            host: "a".into(),
            tool: "u".into(),
            ..CallRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    // Not after the approval timeout (minutes): at once.
    let result = call_result(&mut events).await;
    assert_eq!(result.status, CallStatus::Denied as i32, "{result:?}");
    assert!(
        result.message.contains("nobody can approve it"),
        "{}",
        result.message
    );
    let records = audited_within(&coordinator, "approval", 1, |_| true).await;
    assert_eq!(records[0]["decision"], "denied", "{records:?}");
    assert_eq!(records[0]["decided_by"], "coordinator", "{records:?}");
    coordinator.stop().await;
}

/// The host reconnects while its call waits for approval: once approved, the call starts on
/// the new link (it was started on the closed one, and failed as lost, the approval spent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approved_call_runs_on_the_link_its_host_has_when_approved() {
    let coordinator = coordinator(&["a"]).await;
    let (old_out, _old_inbound) = coordinator.attach_offering("a", &["t"]).await;
    let (mut events, request) = call_waiting(&coordinator, "t", "").await;
    drop(old_out);
    let (out, mut inbound) = coordinator.attach_offering("a", &["t"]).await;
    must(
        wait_until("host a back online", WAIT, async || {
            let host = coordinator.host("a").await?;
            (host.state == toolsrv_proto::v1::HostState::Online as i32 && host.visible_tools == 1)
                .then_some(())
        })
        .await,
    );
    decide(&coordinator, "bob", &request.id, true)
        .await
        .unwrap();
    let call_id = started(&mut inbound).await;
    finish(&out, call_id, CallStatus::Ok).await;
    let result = call_result(&mut events).await;
    assert_eq!(result.status, CallStatus::Ok as i32, "{result:?}");
    coordinator.stop().await;
}

/// Fans `plain` out to every host, one at a time with `max_errors`: the stream.
async fn fan_out(
    coordinator: &Coordinator,
    selector: &str,
    max_errors: u32,
) -> Streaming<toolsrv_proto::v1::FanOutEvent> {
    let mut api = coordinator.tools(&client("alice")).await;
    api.fan_out(FanOutRequest {
        selector: selector.into(),
        tool: "plain".into(),
        concurrency: 1,
        max_errors,
        ..FanOutRequest::default()
    })
    .await
    .unwrap()
    .into_inner()
}

/// The `Start` and `Cancel` messages of several hand-driven links, tagged with their host, in
/// the order they come.
struct Links {
    rx: mpsc::Receiver<(String, In)>,
    outs: std::collections::HashMap<String, mpsc::Sender<AgentMessage>>,
}

impl Links {
    async fn attach(coordinator: &Coordinator, hosts: &[&str]) -> Links {
        let (tx, rx) = mpsc::channel(64);
        let mut outs = std::collections::HashMap::new();
        for host in hosts {
            let (out, mut inbound) = coordinator.attach_offering(host, &["plain"]).await;
            outs.insert(host.to_string(), out);
            let (tx, host) = (tx.clone(), host.to_string());
            tokio::spawn(async move {
                while let Ok(Some(msg)) = inbound.message().await {
                    if let Some(msg @ (In::Start(_) | In::Cancel(_))) = msg.msg
                        && tx.send((host.clone(), msg)).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
        Links { rx, outs }
    }

    /// The next message, within the wait.
    async fn next(&mut self) -> (String, In) {
        tokio::time::timeout(WAIT, self.rx.recv())
            .await
            .expect("a message within the wait")
            .expect("the links stay up")
    }

    async fn started(&mut self) -> (String, u64) {
        match self.next().await {
            (host, In::Start(start)) => (host, start.call_id),
            other => panic!("expected a start, got {other:?}"),
        }
    }

    async fn finish(&self, host: &str, call_id: u64, status: CallStatus) {
        finish(&self.outs[host], call_id, status).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_host_of_a_fan_out_is_on_the_record_reached_or_not() {
    let coordinator = coordinator(&["a", "b", "c"]).await;
    let mut links = Links::attach(&coordinator, &["a", "b", "c"]).await;
    for host in ["a", "b", "c"] {
        must(
            wait_until(&format!("host {host} online"), WAIT, async || {
                let h = coordinator.host(host).await?;
                (h.visible_tools == 1).then_some(())
            })
            .await,
        );
    }

    // The caller goes away while the first host runs: it is cancelled, the two others were
    // never reached.
    let events = fan_out(&coordinator, "a,b,c", 0).await;
    let (first, call) = links.started().await;
    drop(events);
    match links.next().await {
        (host, In::Cancel(cancel)) => assert_eq!((host, cancel.call_id), (first.clone(), call)),
        other => panic!("expected the cancel of {first}'s call, got {other:?}"),
    }
    links.finish(&first, call, CallStatus::Cancelled).await;
    let records = audited_within(&coordinator, "call", 3, |r| r["tool"] == "plain").await;
    let by_host = |host: &str| {
        records
            .iter()
            .find(|r| r["host"] == host)
            .unwrap_or_else(|| panic!("no record of {host}: {records:#?}"))
            .clone()
    };
    assert_eq!(by_host(&first)["status"], "CALL_STATUS_CANCELLED");
    for host in ["a", "b", "c"].into_iter().filter(|h| *h != first) {
        let record = by_host(host);
        assert_eq!(record["status"], "CALL_STATUS_CANCELLED", "{records:#?}");
        assert!(
            record["message"].as_str().unwrap().contains("not started"),
            "{records:#?}"
        );
        assert_eq!(record["fanout"], by_host(&first)["fanout"], "{records:#?}");
    }

    // An error budget of 1: two hosts fail, the third is skipped, and its skip is on the
    // record.
    let mut events = fan_out(&coordinator, "a,b,c", 1).await;
    let mut failed = Vec::new();
    for _ in 0..2 {
        let (host, call) = links.started().await;
        links.finish(&host, call, CallStatus::ToolError).await;
        failed.push(host);
    }
    tokio::time::timeout(WAIT, async {
        while let Some(event) = events.next().await {
            if let Some(fan_out_event::Event::Summary(_)) = event.unwrap().event {
                return;
            }
        }
    })
    .await
    .expect("the fan-out ends");
    let skipped = audited_within(&coordinator, "call", 1, |r| {
        r["status"] == "CALL_STATUS_SKIPPED"
    })
    .await;
    let host = skipped[0]["host"].as_str().unwrap();
    assert!(!failed.iter().any(|f| f == host), "{skipped:?}");
    assert!(
        skipped[0]["message"]
            .as_str()
            .unwrap()
            .contains("more than 1 host failed"),
        "{skipped:?}"
    );

    // A selector that matches no host reached none, and that is on the record.
    let mut events = fan_out(&coordinator, "nomatch-*", 0).await;
    while let Some(event) = events.next().await {
        event.unwrap();
    }
    let refusals = audited_within(&coordinator, "refusal", 1, |r| r["host"] == "nomatch-*").await;
    assert_eq!(refusals[0]["code"], "NotFound", "{refusals:?}");
    coordinator.stop().await;
}

/// An approver reads all of what it approves: the list cuts arguments at 4 KiB, and the
/// request asked for by its id has them whole, for those who may decide it only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approver_can_read_the_whole_arguments_of_a_request() {
    let coordinator = coordinator(&["a"]).await;
    let (_out, _inbound) = coordinator.attach_offering("a", &["t"]).await;
    let mut alice = coordinator.tools(&client("alice")).await;
    // What rides at the end of 10 KB of arguments, where the list does not show it.
    let args = format!(
        r#"{{"note": "{}", "also": "rm -rf /"}}"#,
        "x".repeat(10_000)
    );
    let (events, asked) = call_waiting(&coordinator, "t", &args).await;
    let mut bob = coordinator.tools(&client("bob")).await;
    let listed = bob
        .list_approvals(ListApprovalsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .requests;
    assert_eq!(listed.len(), 1);
    assert!(
        !listed[0].args_json.contains("rm -rf"),
        "the list cuts them"
    );
    let whole = bob
        .list_approvals(ListApprovalsRequest {
            id: asked.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .requests;
    assert_eq!(whole.len(), 1);
    assert_eq!(whole[0].args_json, args);
    // Not to someone who may not decide it, and not for a request that is not pending.
    let refused = alice
        .list_approvals(ListApprovalsRequest {
            id: asked.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    let unknown = bob
        .list_approvals(ListApprovalsRequest { id: "0".repeat(32) })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    drop(events);
    coordinator.stop().await;
}
