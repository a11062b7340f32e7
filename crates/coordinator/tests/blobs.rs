//! The executables the coordinator serves to agents (`FetchBlob`), against a tools directory
//! whose files change between the scan and the fetch: what is served is what was hashed, and a
//! FIFO put in an executable's place is refused at once instead of waited on.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::time::Duration;

use common::{Coordinator, WAIT, agent};
use tokio_stream::StreamExt;
use tonic::Code;
use toolsrv_proto::v1::FetchBlobRequest;

const SCRIPT: &str = "#!/bin/sh\necho served\n";

#[tokio::test]
async fn an_executable_changed_after_the_scan_is_served_as_hashed_or_refused() {
    let coordinator = Coordinator::start(
        &[("probe.meta", r#"{"description": "Probe"}"#)],
        |config, dir| {
            toolsrv_testkit::write_executable(&dir.join("tools"), "probe", SCRIPT);
            // No rescan during the test: the catalog keeps what the first scan hashed.
            config.watch.debounce = Duration::from_secs(3600);
            config.watch.rescan_every = Duration::from_secs(3600);
        },
    )
    .await;
    let executable = coordinator.tools_dir().join("probe");
    let request = || FetchBlobRequest {
        sha256: toolsrv_registry::hex_sha256(SCRIPT.as_bytes()),
    };
    let mut link = coordinator.agent_link(&agent("web-1")).await;
    tokio::time::timeout(WAIT, async {
        // Grown since the scan (or a link to /dev/zero now): cut at the size hashed, which here
        // is the script itself.
        std::fs::write(&executable, format!("{SCRIPT}{}", "x".repeat(1 << 20))).unwrap();
        let mut stream = link.fetch_blob(request()).await.unwrap().into_inner();
        let mut bytes = Vec::new();
        while let Some(chunk) = stream.next().await {
            bytes.extend(chunk.unwrap().data);
        }
        assert!(
            bytes == SCRIPT.as_bytes(),
            "served {} bytes where {} were hashed",
            bytes.len(),
            SCRIPT.len()
        );

        // A FIFO in its place: refused, naming it, without waiting for a writer.
        std::fs::remove_file(&executable).unwrap();
        toolsrv_testkit::mkfifo(&executable);
        let err = link.fetch_blob(request()).await.unwrap_err();
        assert_eq!(err.code(), Code::Unavailable, "{err}");
        assert!(err.message().contains("a FIFO"), "{err}");
    })
    .await
    .expect("a fetch waited on a FIFO or streamed without end");
    coordinator.stop().await;
}
