//! An agent that stops reading its link (its process wedged, not gone: HTTP/2 still answers
//! pings, so the connection looks alive). Before, the coordinator waited for room in the link's
//! queue for ever: the host stayed online, its silence was never judged, and calls to it never
//! ended. Now the link closes once its queue has stayed full with nothing taken for the stall
//! limit; the host is offline, its calls end, and it may connect again.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::time::Duration;

use common::{Coordinator, WAIT, call_result, client};
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::{AgentMessage, CallRequest, CallStatus, HostState, Keepalive};
use toolsrv_testkit::{must, wait_until};

/// A tool whose definition is about 8 KiB: a catalog of many of them fills a link's queue.
fn bulky(i: usize) -> String {
    format!(
        r#"{{"description": "bulky tool {i}", "prompt": "{}", "cmd": "true"}}"#,
        "p".repeat(8 << 10)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_stops_reading_is_cut_off_and_may_come_back() {
    let coordinator = Coordinator::start_with(
        &["a"],
        &[("t.meta", r#"{"description": "t", "cmd": "true"}"#)],
        |config, _| config.stalled_after = Duration::from_secs(3),
    )
    .await;
    let (out, mut inbound) = coordinator.attach_offering("a", &["t"]).await;
    let message = |msg| AgentMessage { msg: Some(msg) };
    let online = async |coordinator: &Coordinator| {
        coordinator
            .host("a")
            .await
            .is_some_and(|h| h.state == HostState::Online as i32 && h.visible_tools == 1)
    };
    must(
        wait_until("host a online with its view", WAIT, async || {
            online(&coordinator).await.then_some(())
        })
        .await,
    );

    // From now on the agent only talks: keepalives, and never a read of what it is sent.
    let talker = tokio::spawn({
        let out = out.clone();
        async move {
            loop {
                let keepalive = message(Out::Keepalive(Keepalive::default()));
                if out.send(keepalive).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    });
    // A catalog of about 16 MB: far more than the connection's windows and the link's queue.
    let tools = coordinator.tools_dir();
    for i in 0..2_000 {
        std::fs::write(tools.join(format!("bulky{i}.meta")), bulky(i)).unwrap();
    }
    let mut api = coordinator.tools(&client("alice")).await;
    let call = api.call(CallRequest {
        host: "a".into(),
        tool: "t".into(),
        timeout_ms: 1_000,
        ..CallRequest::default()
    });
    let mut events = tokio::time::timeout(WAIT, call)
        .await
        .expect("the call is answered")
        .unwrap()
        .into_inner();
    let result = call_result(&mut events).await;
    assert_ne!(result.status, CallStatus::Ok as i32, "{result:?}");

    must(
        wait_until("host a offline", WAIT, async || {
            let host = coordinator.host("a").await?;
            (host.state == HostState::Offline as i32).then_some(())
        })
        .await,
    );
    // The agent's side of the link has ended too.
    let ended = tokio::time::timeout(WAIT, async {
        while let Ok(Some(_)) = inbound.message().await {}
    })
    .await;
    assert!(ended.is_ok(), "the link's stream ends for the agent");
    talker.abort();

    // It connects again and reads this time: back online, with the whole catalog.
    let (_out, _inbound) = coordinator.attach_offering("a", &["t"]).await;
    must(
        wait_until("host a online again", WAIT, async || {
            online(&coordinator).await.then_some(())
        })
        .await,
    );
    coordinator.stop().await;
}
