//! Requests over the documented bounds are refused with INVALID_ARGUMENT naming the bound,
//! before anything is routed, and the refusals are audited.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use common::{Coordinator, WAIT, client};
use tonic::Code;
use toolsrv_proto::v1::{CallRequest, DescribeToolRequest, FanOutRequest, ListToolsRequest};

fn refused<T: std::fmt::Debug>(what: &str, result: Result<T, tonic::Status>, names: &str) {
    let status = result.expect_err(&format!("{what} must be refused"));
    assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
    assert!(
        status.message().contains(names),
        "{what}: the refusal names {names}: {status:?}"
    );
    assert!(status.message().len() < 512, "{what}: a short message");
}

#[tokio::test]
async fn oversized_requests_are_refused_naming_the_limit() {
    let coordinator = Coordinator::start(&[], |config, dir| {
        config.audit_log = Some(dir.join("audit.jsonl"));
        config.limits.max_call_timeout = std::time::Duration::from_secs(60);
    })
    .await;
    let mut api = coordinator.tools(&client("alice")).await;
    let huge = "h".repeat(5 << 20);
    tokio::time::timeout(WAIT, async {
        let call = |f: fn(&mut CallRequest)| {
            let mut req = CallRequest {
                host: "web-1".into(),
                tool: "t".into(),
                ..CallRequest::default()
            };
            f(&mut req);
            req
        };
        let mut big_args = call(|_| {});
        big_args.args_json = format!(r#"{{"x": "{}"}}"#, "a".repeat(2 << 20));
        refused("2 MiB of arguments", api.call(big_args).await, "1048576");
        // Within 1 MiB, but 260,000 values: 89 MB as a JSON tree, which is never built.
        let mut tiny_values = call(|_| {});
        tiny_values.args_json = format!(r#"{{"a": [{}0]}}"#, "[0],".repeat(65_000));
        refused(
            "1 MiB of tiny JSON values",
            api.call(tiny_values).await,
            "65536 JSON values",
        );
        let mut big_host = call(|_| {});
        big_host.host = huge.clone();
        refused("a 5 MB host", api.call(big_host).await, "253");
        refused(
            "a 5 KB cwd",
            api.call(call(|r| r.cwd = "/x".repeat(2500))).await,
            "4096",
        );
        refused(
            "a timeout over the maximum",
            api.call(call(|r| r.timeout_ms = 61_000)).await,
            "max-call-timeout",
        );
        refused(
            "a 5 MB selector",
            api.fan_out(FanOutRequest {
                selector: huge.clone(),
                tool: "t".into(),
                ..FanOutRequest::default()
            })
            .await,
            "4096",
        );
        refused(
            "ListTools of a 5 MB host",
            api.list_tools(ListToolsRequest {
                host: huge.clone(),
                include_hidden: true,
                ..ListToolsRequest::default()
            })
            .await,
            "253",
        );
        refused(
            "DescribeTool of a 5 MB tool",
            api.describe_tool(DescribeToolRequest {
                host: "web-1".into(),
                tool: huge.clone(),
            })
            .await,
            "250",
        );
    })
    .await
    .unwrap();
    let log = std::fs::read_to_string(coordinator.dir.path().join("audit.jsonl")).unwrap();
    let refusals = log
        .lines()
        .filter(|l| l.contains(r#""status":"REFUSED""#))
        .count();
    // The six Call and FanOut refusals; listings are not calls.
    assert_eq!(refusals, 6, "{log}");
    assert!(
        log.len() < 16 << 10,
        "the audit log stays small: {} bytes",
        log.len()
    );
    coordinator.stop().await;
}

/// A request that is small on the wire but huge once decoded (three million empty `autoLoad`
/// names: 6 MB sent, 150 MB decoded) is refused before it is decoded, naming the field, and
/// the connection goes on serving the client's next request.
#[tokio::test]
async fn a_request_that_would_decode_to_too_much_memory_is_refused_undecoded() {
    use toolsrv_proto::v1::{OpenSessionRequest, SessionProfile};
    let coordinator = Coordinator::start(&[], |_, _| {}).await;
    let mut api = coordinator
        .tools(&client("alice"))
        .await
        .max_encoding_message_size(toolsrv_proto::limits::MAX_MESSAGE_BYTES);
    let flood = OpenSessionRequest {
        profile: Some(SessionProfile {
            auto_load: vec![String::new(); 3_000_000],
            ..SessionProfile::default()
        }),
        hosts: String::new(),
    };
    let status = tokio::time::timeout(WAIT, api.open_session(flood))
        .await
        .expect("answered")
        .expect_err("refused");
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    for words in [
        "profile.auto_load",
        "refused before decoding",
        "toolsrv.v1.OpenSessionRequest",
    ] {
        assert!(status.message().contains(words), "{status:?}");
    }
    let listed = tokio::time::timeout(WAIT, api.list_tools(ListToolsRequest::default())).await;
    assert!(
        listed.is_ok_and(|r| r.is_ok() || r.is_err_and(|s| s.code() != Code::Unavailable)),
        "the same connection serves the next request"
    );
}
