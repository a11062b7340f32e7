//! A compromised agent's bypass requests, from a hand-driven agent link: a command without end
//! or without a name is refused by the coordinator itself, audited, and put to nobody; the call
//! and the link go on.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use common::{Coordinator, WAIT, call_result, client};
use tokio::sync::mpsc;
use tonic::Streaming;
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::{
    AgentMessage, BypassDecision, BypassRequest, CallFinished, CallRequest, CallResult, CallStatus,
    CoordinatorMessage, HostView, ListApprovalsRequest, ToolDefinition, ToolStatus,
};

/// The next message of `kind` from the coordinator, within the wait.
async fn next<T>(inbound: &mut Streaming<CoordinatorMessage>, kind: impl Fn(In) -> Option<T>) -> T {
    tokio::time::timeout(WAIT, async {
        loop {
            let msg = inbound.message().await.unwrap().expect("the link stays up");
            if let Some(found) = msg.msg.and_then(&kind) {
                return found;
            }
        }
    })
    .await
    .expect("the coordinator sends it within the wait")
}

async fn send(out: &mpsc::Sender<AgentMessage>, msg: Out) {
    out.send(AgentMessage { msg: Some(msg) }).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bypass_requests_no_person_should_read_are_refused_by_the_coordinator() {
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
    })
    .await;
    let (out, mut inbound) = coordinator.attach_as("a").await;
    let revision = next(&mut inbound, |m| match m {
        In::Catalog(update) if !update.more => Some(update.revision),
        _ => None,
    })
    .await;
    let asker = ToolStatus {
        name: "asker".into(),
        visible: true,
        definition: Some(ToolDefinition::default()),
        ..ToolStatus::default()
    };
    send(
        &out,
        Out::View(HostView {
            catalog_revision: revision,
            tools: vec![asker],
            more: false,
        }),
    )
    .await;

    let mut api = coordinator.tools(&client("alice")).await;
    let mut events = api
        .call(CallRequest {
            host: "a".into(),
            tool: "asker".into(),
            ..CallRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    let call_id = next(&mut inbound, |m| match m {
        In::Start(start) => Some(start.call_id),
        _ => None,
    })
    .await;

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
        send(
            &out,
            Out::Bypass(BypassRequest {
                call_id,
                request_id,
                argv,
                reason: reason.into(),
                stdin_bytes: 0,
            }),
        )
        .await;
        let decision: BypassDecision = next(&mut inbound, |m| match m {
            In::Bypass(decision) => Some(decision),
            _ => None,
        })
        .await;
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
    send(
        &out,
        Out::Finished(CallFinished {
            call_id,
            result: Some(CallResult {
                status: CallStatus::Ok as i32,
                exit_code: Some(0),
                ..CallResult::default()
            }),
        }),
    )
    .await;
    let result = call_result(&mut events).await;
    assert_eq!(result.status, CallStatus::Ok as i32, "{result:?}");

    // Each refusal audited, bounded.
    let audit = std::fs::read_to_string(coordinator.dir.path().join("audit.jsonl")).unwrap();
    let bypasses: Vec<serde_json::Value> = audit
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["event"] == "bypass")
        .collect();
    assert_eq!(bypasses.len(), 3, "{audit}");
    for record in &bypasses {
        assert_eq!(record["decision"], "denied");
        assert_eq!(record["decided_by"], "coordinator");
        assert!(
            record["bypass_argv"].as_str().unwrap().len() < 400,
            "{record}"
        );
    }
    assert!(audit.len() < 8_000, "{} bytes of audit", audit.len());
    coordinator.stop().await;
}
