//! Every RPC of each service refuses a peer whose certificate has the wrong role, before any
//! handler runs.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use common::{Coordinator, WAIT, agent, client};
use tonic::Code;
use toolsrv_proto::v1::{
    AgentMessage, CallRequest, DescribeToolRequest, FanOutRequest, FetchBlobRequest, Hello,
    ListHostsRequest, ListToolsRequest, WatchCatalogRequest, agent_message,
};

fn refused<T: std::fmt::Debug>(what: &str, result: Result<T, tonic::Status>) {
    let status = result.expect_err(&format!("{what} must be refused"));
    assert_eq!(status.code(), Code::PermissionDenied, "{what}: {status:?}");
    assert!(
        status.message().contains("certificate"),
        "{what}: the refusal names the certificate: {status:?}"
    );
}

#[tokio::test]
async fn every_client_api_rpc_refuses_an_agent_certificate() {
    let coordinator = Coordinator::start(&[], |_, _| {}).await;
    let mut api = coordinator.tools(&agent("web-1")).await;
    tokio::time::timeout(WAIT, async {
        refused(
            "ListHosts",
            api.list_hosts(ListHostsRequest::default()).await,
        );
        refused(
            "ListTools",
            api.list_tools(ListToolsRequest {
                host: "web-1".into(),
                include_hidden: true,
                ..ListToolsRequest::default()
            })
            .await,
        );
        refused(
            "DescribeTool",
            api.describe_tool(DescribeToolRequest {
                host: "web-1".into(),
                tool: "x".into(),
            })
            .await,
        );
        refused(
            "Call",
            api.call(CallRequest {
                host: "web-1".into(),
                tool: "x".into(),
                ..CallRequest::default()
            })
            .await,
        );
        refused(
            "FanOut",
            api.fan_out(FanOutRequest {
                selector: "*".into(),
                tool: "x".into(),
                ..FanOutRequest::default()
            })
            .await,
        );
        refused(
            "WatchCatalog",
            api.watch_catalog(WatchCatalogRequest {}).await,
        );
    })
    .await
    .unwrap();
    coordinator.stop().await;
}

#[tokio::test]
async fn every_agent_link_rpc_refuses_a_client_certificate() {
    let coordinator = Coordinator::start(&[], |_, _| {}).await;
    let mut link = coordinator.agent_link(&client("alice")).await;
    tokio::time::timeout(WAIT, async {
        let hello = tokio_stream::iter(vec![AgentMessage::default()]);
        refused("Attach", link.attach(hello).await);
        refused(
            "FetchBlob",
            link.fetch_blob(FetchBlobRequest {
                sha256: "00".repeat(32),
            })
            .await,
        );
    })
    .await
    .unwrap();
    coordinator.stop().await;
}

#[tokio::test]
async fn the_right_role_gets_through() {
    let coordinator = Coordinator::start(&[], |_, _| {}).await;
    let mut api = coordinator.tools(&client("alice")).await;
    let hosts = tokio::time::timeout(WAIT, api.list_hosts(ListHostsRequest::default()))
        .await
        .unwrap()
        .unwrap();
    assert!(hosts.into_inner().hosts.is_empty());
    let mut link = coordinator.agent_link(&agent("web-1")).await;
    let missing = tokio::time::timeout(
        WAIT,
        link.fetch_blob(FetchBlobRequest {
            sha256: "00".repeat(32),
        }),
    )
    .await
    .unwrap();
    // Past the identity check: the blob is simply not there.
    assert_eq!(missing.unwrap_err().code(), Code::NotFound);
    coordinator.stop().await;
}

/// `toolsrv agent` refuses to start with a certificate of another host, but the coordinator must
/// not rely on that: a hello that claims another host than the certificate is refused.
#[tokio::test]
async fn a_hello_claiming_another_host_is_refused() {
    let coordinator = Coordinator::start(&[], |_, _| {}).await;
    let mut link = coordinator.agent_link(&agent("web-1")).await;
    tokio::time::timeout(WAIT, async {
        let hello = AgentMessage {
            msg: Some(agent_message::Msg::Hello(Hello {
                host_id: "web-2".into(),
                ..Hello::default()
            })),
        };
        let status = match link.attach(tokio_stream::iter(vec![hello])).await {
            Err(status) => status,
            Ok(response) => response
                .into_inner()
                .message()
                .await
                .expect_err("a false claim must end the link"),
        };
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert!(
            status.message().contains("certificate names agent/web-1"),
            "{status:?}"
        );
    })
    .await
    .unwrap();
    coordinator.stop().await;
}
