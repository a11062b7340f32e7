//! A host view in parts against an in-process coordinator, from a hand-driven agent link: the
//! view is stored only once its last part is in, and an agent that sends parts without end
//! loses its link instead of growing the coordinator's memory.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::time::Duration;

use common::{Coordinator, WAIT, catalog_revision, client};
use tokio::sync::mpsc;
use tonic::Streaming;
use toolsrv_proto::limits::{MAX_MESSAGE_BYTES, MAX_VIEW_BYTES};
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::{
    AgentMessage, CoordinatorMessage, HostView, ListToolsRequest, ToolDefinition, ToolStatus,
};
use toolsrv_testkit::{must, wait_until};

/// A coordinator serving tools `a` to `d`, with agent `a` in its PKI.
async fn coordinator() -> Coordinator {
    let meta = r#"{"description": "a tool", "cmd": "true"}"#;
    let tools = [
        ("a.meta", meta),
        ("b.meta", meta),
        ("c.meta", meta),
        ("d.meta", meta),
    ];
    Coordinator::start_with(&["a"], &tools, |config, _| {
        // Parts take a while to send in a debug build; silence is not what this test is about.
        config.lost_after = Duration::from_secs(30);
    })
    .await
}

/// Attaches as agent `a`: sends the Hello, reads the Welcome and the catalog.
async fn attach(coordinator: &Coordinator) -> Agent {
    let (out, mut inbound) = coordinator.attach_as("a").await;
    let revision = catalog_revision(&mut inbound).await;
    Agent {
        out,
        inbound,
        revision,
    }
}

struct Agent {
    out: mpsc::Sender<AgentMessage>,
    inbound: Streaming<CoordinatorMessage>,
    revision: u64,
}

impl Agent {
    /// Sends a view part; false once the coordinator no longer takes messages.
    async fn part(&self, tools: Vec<ToolStatus>, more: bool) -> bool {
        let view = HostView {
            catalog_revision: self.revision,
            tools,
            more,
        };
        let msg = AgentMessage {
            msg: Some(Out::View(view)),
        };
        tokio::time::timeout(WAIT, self.out.send(msg))
            .await
            .is_ok_and(|sent| sent.is_ok())
    }
}

fn tool(name: &str, prompt: usize) -> ToolStatus {
    ToolStatus {
        name: name.into(),
        visible: true,
        description: name.into(),
        definition: Some(ToolDefinition {
            name: name.into(),
            description: name.into(),
            prompt: "p".repeat(prompt),
            ..ToolDefinition::default()
        }),
        ..ToolStatus::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_in_parts_is_stored_whole_and_endless_parts_end_the_link() {
    let coordinator = coordinator().await;
    let mut agent = attach(&coordinator).await;

    // The first parts are held back: nobody sees a host with half a view.
    assert!(agent.part(vec![tool("a", 10), tool("b", 10)], true).await);
    assert!(agent.part(vec![tool("c", 10)], true).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let host = coordinator.host("a").await.unwrap();
    assert_eq!((host.view_revision, host.visible_tools), (0, 0));

    assert!(agent.part(vec![tool("d", 10)], false).await);
    must(
        wait_until("the whole view", WAIT, async || {
            let host = coordinator.host("a").await?;
            (host.visible_tools == 4).then_some(())
        })
        .await,
    );
    let listing = coordinator
        .tools(&client("alice"))
        .await
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .list_tools(ListToolsRequest {
            host: "a".into(),
            ..ListToolsRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<_> = listing.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c", "d"]);
    assert_eq!(listing.catalog_revision, agent.revision);

    // Parts of 1 MiB that never end: the link ends before MAX_VIEW_BYTES are piled up.
    let parts_allowed = MAX_VIEW_BYTES / (1 << 20);
    let mut sent = 0;
    while sent <= parts_allowed + 8 {
        if !agent
            .part(vec![tool(&format!("x{sent:04}"), 1 << 20)], true)
            .await
        {
            break;
        }
        sent += 1;
    }
    let ended = tokio::time::timeout(WAIT, async {
        loop {
            match agent.inbound.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the coordinator ends the link");
    assert!(
        ended.is_err() || matches!(ended, Ok(None)),
        "the link ends: {ended:?}"
    );
    assert!(sent <= parts_allowed + 8, "{sent} parts taken");
    let host = must(
        wait_until("the host to go offline", WAIT, async || {
            let host = coordinator.host("a").await?;
            (host.state == toolsrv_proto::v1::HostState::Offline as i32).then_some(host)
        })
        .await,
    );
    assert_eq!(host.visible_tools, 4, "the last whole view is kept");
}

/// A compromised agent's view part of 200,000 empty entries: 400 KB sent, which decoded to
/// 70 MB (16 MiB of them to 1.7 GB). It is refused before it is decoded, the refusal names
/// the field, and the link ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_part_too_large_once_decoded_ends_the_link_undecoded() {
    let coordinator = coordinator().await;
    let mut agent = attach(&coordinator).await;
    assert!(agent.part(vec![tool("a", 10)], false).await);
    must(
        wait_until("the view", WAIT, async || {
            let host = coordinator.host("a").await?;
            (host.visible_tools == 1).then_some(())
        })
        .await,
    );
    agent.part(vec![ToolStatus::default(); 200_000], true).await;
    let goodbye = tokio::time::timeout(WAIT, goodbye_or_end(&mut agent.inbound))
        .await
        .expect("the coordinator ends the link")
        .expect("with a Goodbye saying why");
    for words in [
        "view.tools",
        "refused before decoding",
        "toolsrv.v1.AgentMessage",
    ] {
        assert!(goodbye.contains(words), "{goodbye}");
    }
    assert!(
        matches!(agent.inbound.message().await, Ok(None) | Err(_)),
        "then the link ends"
    );
    let host = must(
        wait_until("the host to go offline", WAIT, async || {
            let host = coordinator.host("a").await?;
            (host.state == toolsrv_proto::v1::HostState::Offline as i32).then_some(host)
        })
        .await,
    );
    assert_eq!(host.visible_tools, 1, "the last whole view is kept");
}

/// The reason of the coordinator's next Goodbye on the link; `None` when the link ends without
/// one.
async fn goodbye_or_end(inbound: &mut tonic::Streaming<CoordinatorMessage>) -> Option<String> {
    loop {
        match inbound.message().await {
            Ok(Some(CoordinatorMessage {
                msg: Some(In::Goodbye(goodbye)),
            })) => {
                assert!(
                    goodbye.refused,
                    "a link ended over the agent's message is marked refused: {goodbye:?}"
                );
                return Some(goodbye.reason);
            }
            Ok(Some(_)) => continue,
            _ => return None,
        }
    }
}

/// An agent that says goodbye is let go without one back: only a link ended over what the
/// agent sent is told why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_says_goodbye_gets_none_back() {
    let coordinator = coordinator().await;
    let mut agent = attach(&coordinator).await;
    let goodbye = AgentMessage {
        msg: Some(Out::Goodbye(toolsrv_proto::v1::Goodbye {
            reason: "agent shutting down".into(),
            refused: false,
        })),
    };
    agent.out.send(goodbye).await.unwrap();
    let answered = tokio::time::timeout(WAIT, goodbye_or_end(&mut agent.inbound))
        .await
        .expect("the coordinator ends the link");
    assert_eq!(answered, None, "no Goodbye back");
}
