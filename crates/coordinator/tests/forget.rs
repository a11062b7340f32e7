//! Hosts offline for longer than `forget_offline_after` leave the fleet (nodes an autoscaler
//! removed, a host renamed): they are no longer listed, watchers are told, a call to one is
//! `UNKNOWN_HOST` saying why, and one that connects again is a host like any other. A host that
//! stays connected is never forgotten, however long it has been quiet.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::time::Duration;

use common::{Coordinator, WAIT, call_result, client};
use tokio_stream::StreamExt;
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::{
    AgentMessage, CallRequest, CallStatus, CatalogEventKind, HostState, Keepalive,
    WatchCatalogRequest,
};
use toolsrv_testkit::{must, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_offline_too_long_are_forgotten_and_come_back_as_new() {
    let coordinator = Coordinator::start_with(
        &["a", "b"],
        &[("t.meta", r#"{"description": "t", "cmd": "true"}"#)],
        |config, _| config.forget_offline_after = Duration::from_secs(2),
    )
    .await;
    let (a_out, a_in) = coordinator.attach_offering("a", &["t"]).await;
    let (b_out, mut b_in) = coordinator.attach_offering("b", &["t"]).await;
    // b stays connected, and quiet but for its keepalives, past the time a is forgotten in.
    let b_alive = tokio::spawn(async move {
        let keepalive = || AgentMessage {
            msg: Some(Out::Keepalive(Keepalive::default())),
        };
        loop {
            tokio::select! {
                message = b_in.message() => if !matches!(message, Ok(Some(_))) { return },
                () = tokio::time::sleep(Duration::from_millis(300)) => {
                    if b_out.send(keepalive()).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    for id in ["a", "b"] {
        must(
            wait_until(&format!("host {id} online"), WAIT, async || {
                let host = coordinator.host(id).await?;
                (host.state == HostState::Online as i32).then_some(())
            })
            .await,
        );
    }
    let mut api = coordinator.tools(&client("alice")).await;
    let mut events = api
        .watch_catalog(WatchCatalogRequest::default())
        .await
        .unwrap()
        .into_inner();

    // a's agent goes away.
    drop(a_out);
    drop(a_in);
    let forgotten = tokio::time::timeout(WAIT, async {
        while let Some(event) = events.next().await {
            let event = event.unwrap();
            if event.kind == CatalogEventKind::HostForgotten as i32 {
                return event.host;
            }
        }
        panic!("the watch ended");
    })
    .await
    .expect("watchers are told within the wait");
    assert_eq!(forgotten, "a");
    assert!(
        coordinator.host("a").await.is_none(),
        "a is no longer listed"
    );
    let b = coordinator.host("b").await.expect("b is still listed");
    assert_eq!(b.state, HostState::Online as i32);

    let mut call = api
        .call(CallRequest {
            host: "a".into(),
            tool: "t".into(),
            ..CallRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    let result = call_result(&mut call).await;
    assert_eq!(result.status, CallStatus::UnknownHost as i32, "{result:?}");
    assert!(
        result
            .message
            .contains("or not for 2 s: hosts offline that long are forgotten"),
        "{}",
        result.message
    );

    // It comes back: a host like any other.
    let (_a_out, _a_in) = coordinator.attach_offering("a", &["t"]).await;
    must(
        wait_until("host a online again", WAIT, async || {
            let host = coordinator.host("a").await?;
            (host.state == HostState::Online as i32 && host.visible_tools == 1).then_some(())
        })
        .await,
    );
    assert!(!b_alive.is_finished(), "b's link stayed up");
    b_alive.abort();
    coordinator.stop().await;
}
