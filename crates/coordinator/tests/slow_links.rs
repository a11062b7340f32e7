//! An agent on a link whose round trip is longer than `lost_after`: it speaks only once the
//! Welcome has reached it, so its first word comes a round trip after the Welcome left. It is
//! not judged lost for that; once it has spoken, silence counts as before.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::time::Duration;

use common::Coordinator;
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::{AgentMessage, HostState, Keepalive};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_first_word_takes_longer_than_lost_after_is_not_lost() {
    let coordinator = Coordinator::start_with(&["a"], &[], |config, _| {
        config.keepalive = Duration::from_millis(100);
        config.lost_after = Duration::from_millis(400);
    })
    .await;
    let (out, mut inbound) = coordinator.attach_as("a").await;
    // A round trip of 1.5 s: nothing comes from the agent meanwhile (what the coordinator
    // sends is read, as a slow link would deliver it).
    let reader = tokio::spawn(async move {
        let mut received = 0u32;
        while let Ok(Some(_)) = inbound.message().await {
            received += 1;
        }
        received
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let keepalive = |ms| AgentMessage {
        msg: Some(Out::Keepalive(Keepalive {
            sent_unix_ms: ms,
            interval_ms: 0,
        })),
    };
    out.send(keepalive(1))
        .await
        .expect("the link is still open");
    // Then keepalives as often as the coordinator asks: the link holds.
    for i in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        out.send(keepalive(2 + i)).await.expect("the link holds");
    }
    let host = coordinator.host("a").await.expect("host a is listed");
    // Connected (syncing: this agent sends no view), not lost.
    assert_eq!(host.state(), HostState::Syncing, "{host:?}");

    // Silent after it has spoken: lost after `lost_after`, as before.
    let lost = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if coordinator
                .host("a")
                .await
                .is_some_and(|h| h.state() == HostState::Offline)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(lost.is_ok(), "a silent agent is still lost");
    drop(out);
    let _ = tokio::time::timeout(Duration::from_secs(10), reader).await;
}
