//! A host that has attached but not reported its view yet shows as syncing, and calls and
//! listings for it wait for the view instead of answering hidden or empty.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::time::{Duration, Instant};

use common::{Coordinator, WAIT, client};
use tokio_stream::StreamExt;
use toolsrv_proto::v1::{
    AgentMessage, CallFinished, CallRequest, CallResult, CallStatus, Hello, HostState, HostView,
    ListHostsRequest, ListToolsRequest, ToolDefinition, ToolStatus, agent_message,
    coordinator_message,
};

const ECHO: &str = r#"{"description": "echo", "cmd": "echo hi"}"#;
/// How long the fake agent holds its view back.
const VIEW_DELAY: Duration = Duration::from_millis(1500);

/// An agent that attaches, waits `VIEW_DELAY`, reports `echo` visible, and answers every call OK.
async fn slow_agent(coordinator: &Coordinator) -> tokio::task::JoinHandle<()> {
    let (tx, mut inbound) = coordinator
        .attach(Hello {
            host_id: "web-1".into(),
            agent_version: "test".into(),
            max_concurrent_calls: 4,
            ..Hello::default()
        })
        .await;
    tokio::spawn(async move {
        let mut revision = None;
        let view_at = tokio::time::sleep(VIEW_DELAY);
        tokio::pin!(view_at);
        let mut view_sent = false;
        loop {
            tokio::select! {
                () = &mut view_at, if !view_sent && revision.is_some() => {
                    view_sent = true;
                    // Built by assignment so that fields added to HostView later keep defaults.
                    #[allow(clippy::field_reassign_with_default)]
                    let view = {
                    let mut view = HostView::default();
                    view.catalog_revision = revision.unwrap();
                    view.tools = vec![ToolStatus {
                        name: "echo".into(),
                        visible: true,
                        definition: Some(ToolDefinition {
                            name: "echo".into(),
                            description: "echo".into(),
                            ..ToolDefinition::default()
                        }),
                        description: "echo".into(),
                        ..ToolStatus::default()
                    }];
                    view
                    };
                    let msg = agent_message::Msg::View(view);
                    if tx.send(AgentMessage { msg: Some(msg) }).await.is_err() {
                        return;
                    }
                }
                msg = inbound.next() => {
                    let Some(Ok(msg)) = msg else { return };
                    match msg.msg {
                        Some(coordinator_message::Msg::Catalog(update)) if !update.more => {
                            revision = Some(update.revision);
                        }
                        Some(coordinator_message::Msg::Start(start)) => {
                            let finished = CallFinished {
                                call_id: start.call_id,
                                result: Some(CallResult {
                                    status: CallStatus::Ok as i32,
                                    result_json: r#"{"content":[]}"#.into(),
                                    ..CallResult::default()
                                }),
                            };
                            let msg = agent_message::Msg::Finished(finished);
                            if tx.send(AgentMessage { msg: Some(msg) }).await.is_err() {
                                return;
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    })
}

#[tokio::test]
async fn a_call_right_after_attach_waits_for_the_view() {
    let coordinator = Coordinator::start(&[("echo.meta", ECHO)], |_, _| {}).await;
    let mut api = coordinator.tools(&client("alice")).await;
    let attached = Instant::now();
    let agent = slow_agent(&coordinator).await;

    // Listed as syncing until its view arrives.
    let hosts = tokio::time::timeout(WAIT, async {
        loop {
            let hosts = api
                .list_hosts(ListHostsRequest::default())
                .await
                .unwrap()
                .into_inner();
            if let Some(h) = hosts.hosts.into_iter().find(|h| h.host_id == "web-1") {
                return h;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(hosts.state, HostState::Syncing as i32);

    let mut events = tokio::time::timeout(
        WAIT,
        api.call(CallRequest {
            host: "web-1".into(),
            tool: "echo".into(),
            ..CallRequest::default()
        }),
    )
    .await
    .unwrap()
    .unwrap()
    .into_inner();
    let result = common::call_result(&mut events).await;
    assert_eq!(result.status, CallStatus::Ok as i32, "{result:?}");
    assert!(
        attached.elapsed() >= VIEW_DELAY,
        "the call waited for the view"
    );

    let tools = api
        .list_tools(ListToolsRequest {
            host: "web-1".into(),
            include_hidden: true,
            ..ListToolsRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(tools.tools.len(), 1);
    let hosts = api
        .list_hosts(ListHostsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(hosts.hosts[0].state, HostState::Online as i32);
    agent.abort();
    coordinator.stop().await;
}

#[tokio::test]
async fn a_listing_right_after_attach_waits_for_the_view() {
    let coordinator = Coordinator::start(&[("echo.meta", ECHO)], |_, _| {}).await;
    let mut api = coordinator.tools(&client("alice")).await;
    let agent = slow_agent(&coordinator).await;
    // The host is known as soon as the hello is in; poll until it is.
    let tools = tokio::time::timeout(WAIT, async {
        loop {
            match api
                .list_tools(ListToolsRequest {
                    host: "web-1".into(),
                    include_hidden: true,
                    ..ListToolsRequest::default()
                })
                .await
            {
                Ok(tools) => return tools.into_inner(),
                Err(status) => assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}"),
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(tools.tools.len(), 1, "never an empty listing: {tools:?}");
    agent.abort();
    coordinator.stop().await;
}
