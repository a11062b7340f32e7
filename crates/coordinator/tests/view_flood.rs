//! An agent that reports views without pause (compromised, or a script rewriting its tools in
//! a loop) against an in-process coordinator: its views are stored at a bounded pace, the last
//! one always lands, its link stays up, and the other hosts' views are stored at once.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Coordinator, WAIT, catalog_revision, client};
use tokio::sync::mpsc;
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::{
    AgentMessage, CatalogEventKind, HostState, HostView, ToolStatus, WatchCatalogRequest,
};
use toolsrv_testkit::{must, wait_until};

async fn coordinator() -> Coordinator {
    let meta = r#"{"description": "a tool", "cmd": "true"}"#;
    let tools = [("t1.meta", meta), ("t2.meta", meta), ("t3.meta", meta)];
    Coordinator::start_with(&["a", "b"], &tools, |_, _| {}).await
}

struct Agent {
    out: mpsc::Sender<AgentMessage>,
    /// Read in the background so that the coordinator's messages never back up.
    _inbound: tokio::task::JoinHandle<()>,
    revision: u64,
}

async fn attach(coordinator: &Coordinator, id: &str) -> Agent {
    let (out, mut inbound) = coordinator.attach_as(id).await;
    let revision = catalog_revision(&mut inbound).await;
    let reader = tokio::spawn(async move { while let Ok(Some(_)) = inbound.message().await {} });
    Agent {
        out,
        _inbound: reader,
        revision,
    }
}

impl Agent {
    /// Reports the tools of `visible` visible, the others hidden.
    async fn view(&self, visible: &[&str]) -> bool {
        let tools = ["t1", "t2", "t3"]
            .iter()
            .map(|name| ToolStatus {
                name: (*name).into(),
                visible: visible.contains(name),
                ..ToolStatus::default()
            })
            .collect();
        let msg = AgentMessage {
            msg: Some(Out::View(HostView {
                catalog_revision: self.revision,
                tools,
                more: false,
            })),
        };
        tokio::time::timeout(WAIT, self.out.send(msg))
            .await
            .is_ok_and(|sent| sent.is_ok())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_reporting_views_without_pause_is_paced_and_its_last_view_lands() {
    let coordinator = coordinator().await;
    let a = attach(&coordinator, "a").await;
    let b = attach(&coordinator, "b").await;
    assert!(a.view(&["t1"]).await && b.view(&["t1"]).await);
    for id in ["a", "b"] {
        must(
            wait_until("the first views", WAIT, async || {
                (coordinator.host(id).await?.visible_tools == 1).then_some(())
            })
            .await,
        );
    }

    // Every host view event a client watching the catalog is told of, per host.
    let stored_a = Arc::new(AtomicUsize::new(0));
    let stored_b = Arc::new(AtomicUsize::new(0));
    let mut events = coordinator
        .tools(&client("alice"))
        .await
        .watch_catalog(WatchCatalogRequest::default())
        .await
        .unwrap()
        .into_inner();
    let watcher = tokio::spawn({
        let (stored_a, stored_b) = (stored_a.clone(), stored_b.clone());
        async move {
            while let Ok(Some(event)) = events.message().await {
                if event.kind == CatalogEventKind::HostView as i32 {
                    match event.host.as_str() {
                        "a" => stored_a.fetch_add(1, Ordering::Relaxed),
                        "b" => stored_b.fetch_add(1, Ordering::Relaxed),
                        _ => 0,
                    };
                }
            }
        }
    });

    // Host a alternates between two views for three seconds, as fast as its link takes them;
    // host b changes its view once in the middle.
    let started = Instant::now();
    let flood = Duration::from_secs(3);
    let mut sent = 0usize;
    let mut b_changed = false;
    while started.elapsed() < flood {
        let visible: &[&str] = if sent.is_multiple_of(2) {
            &["t1", "t2"]
        } else {
            &["t3"]
        };
        assert!(
            a.view(visible).await,
            "the link of a ends after {sent} views"
        );
        sent += 1;
        if !b_changed && started.elapsed() > flood / 2 {
            assert!(b.view(&["t1", "t2", "t3"]).await);
            b_changed = true;
        }
    }
    // The last view: t1, t2 and t3 all visible.
    assert!(a.view(&["t1", "t2", "t3"]).await);
    let last_sent = Instant::now();
    let flood_took = started.elapsed();
    must(
        wait_until("a's last view", WAIT, async || {
            (coordinator.host("a").await?.visible_tools == 3).then_some(())
        })
        .await,
    );
    let landed = last_sent.elapsed();
    let a_host = coordinator.host("a").await.unwrap();
    assert_eq!(a_host.state, HostState::Online as i32, "a's link stays up");
    let b_host = coordinator.host("b").await.unwrap();
    assert_eq!(b_host.visible_tools, 3);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (stored_a, stored_b) = (
        stored_a.load(Ordering::Relaxed),
        stored_b.load(Ordering::Relaxed),
    );
    println!(
        "sent {sent} views in {flood_took:?}; a stored {stored_a}, b stored {stored_b}; \
         the last landed after {landed:?}"
    );
    // 16 at once, then one each 500 ms while the flood lasted, and the last one; the first
    // views were stored before the watch began. (Before: about 60,000 in a debug build.)
    let most = 16 + (flood_took.as_millis() / 500) as usize + 2;
    assert!(
        stored_a <= most,
        "{stored_a} views of a stored, at most {most} expected"
    );
    assert!(sent > most * 10, "the flood was a flood: {sent} views");
    assert_eq!(stored_b, 1, "b's one change is stored, once");
    watcher.abort();
}
