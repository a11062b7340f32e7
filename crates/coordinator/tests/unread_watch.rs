//! A client that opens a session's watch and reads nothing while the session changes: the
//! coordinator holds the state it has not taken and computes the next one only once it has,
//! as the newest there is then. With room for four states queued, plus one waiting to be
//! queued, a client's unread watchers held about eight states each (gigabytes from one client
//! with large tool definitions). And the watch of a session that ends says it is gone.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::time::Duration;

use common::{Coordinator, WAIT, client};
use toolsrv_proto::limits::MAX_MESSAGE_BYTES;
use toolsrv_proto::v1::{
    GetSessionRequest, LoadToolRequest, OpenSessionRequest, SessionProfile, UnloadToolRequest,
};
use toolsrv_testkit::{must, wait_until};

/// Tools of about 200 KB each: eight of them loaded make a state of some 1.6 MB.
const BIG: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unread_watch_holds_one_state_and_then_gets_the_newest() {
    let big = format!(
        r#"{{"description": "a tool with a long text", "prompt": "{}", "cmd": "true"}}"#,
        "word ".repeat(40_000)
    );
    let small = r#"{"description": "a small tool", "cmd": "true"}"#;
    let names: Vec<String> = (0..BIG).map(|i| format!("big{i}")).collect();
    let files: Vec<(String, &str)> = names
        .iter()
        .map(|n| (format!("{n}.meta"), big.as_str()))
        .chain([("small.meta".to_string(), small)])
        .collect();
    let files: Vec<(&str, &str)> = files.iter().map(|(n, m)| (n.as_str(), *m)).collect();
    let coordinator = Coordinator::start_with(&["a"], &files, |_, _| {}).await;
    let mut offered: Vec<&str> = names.iter().map(String::as_str).collect();
    offered.push("small");
    let (_out, _inbound) = coordinator.attach_offering("a", &offered).await;

    let mut api = coordinator
        .tools(&client("alice"))
        .await
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let opened = api
        .open_session(OpenSessionRequest {
            profile: Some(SessionProfile {
                auto_load: names.clone(),
                hosts: "a".into(),
                max_loaded: 20,
            }),
            hosts: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let session = opened.id.clone();
    // Once the host's view is in, the tools load.
    must(
        wait_until("the host's view to be in", WAIT, async || {
            let mut api = api.clone();
            let loaded = api.load_tool(LoadToolRequest {
                session: session.clone(),
                tool: "small".into(),
            });
            loaded.await.ok().map(drop)
        })
        .await,
    );
    let mut watch = api
        .watch_session(GetSessionRequest {
            session: session.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    // Twenty changes the watcher does not read, each allowed to reach it.
    let mut last = 0;
    for i in 0..20 {
        let state = match i % 2 {
            1 => {
                api.load_tool(LoadToolRequest {
                    session: session.clone(),
                    tool: "small".into(),
                })
                .await
            }
            _ => {
                api.unload_tool(UnloadToolRequest {
                    session: session.clone(),
                    tool: "small".into(),
                })
                .await
            }
        };
        last = state.unwrap().into_inner().generation;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // Read now: what was queued, then the newest state.
    let mut before_newest = 0;
    loop {
        let state = tokio::time::timeout(WAIT, watch.message())
            .await
            .expect("a state within the wait")
            .unwrap()
            .expect("the watch goes on");
        assert!(
            state.tools.len() >= BIG,
            "every state carries the big tools"
        );
        if state.generation == last {
            break;
        }
        before_newest += 1;
    }
    // What the client's own connection took before it stopped reading (its HTTP/2 window of a
    // few MB), what the server's connection buffers hold, and the one state queued.
    assert!(
        before_newest <= 5,
        "{before_newest} older states came before the newest: the coordinator queued more than one"
    );

    // Its session closed, the watch ends saying so, marked as `GetSession` marks it, so that
    // a client opens another session at once instead of watching again.
    api.close_session(GetSessionRequest {
        session: session.clone(),
    })
    .await
    .unwrap();
    let ended = tokio::time::timeout(WAIT, watch.message())
        .await
        .expect("the end within the wait")
        .unwrap_err();
    assert_eq!(ended.code(), tonic::Code::NotFound, "{ended:?}");
    assert!(toolsrv_proto::is_session_gone(&ended), "{ended:?}");
    coordinator.stop().await;
}
