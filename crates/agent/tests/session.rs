//! The agent against an in-process fake coordinator over plain TCP: hello, catalog, calls,
//! credit, cancellation, reconnects and the shutdown drain.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::fake::{Attached, call_output, serve};
use common::{blob_ref, doc, script, tamper};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Endpoint;
use toolsrv_agent::{AgentConfig, AgentError, Backoff, run_with_connector};
use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::{
    CallStatus, CancelCall, CatalogUpdate, CoordinatorMessage, Credit, Goodbye, Keepalive,
    StartCall, Welcome,
};

const WAIT: Duration = Duration::from_secs(20);

struct Harness {
    state: std::sync::Arc<tempfile::TempDir>,
    stop_server: CancellationToken,
    shutdown: CancellationToken,
    agent: JoinHandle<Result<(), AgentError>>,
    attaches: mpsc::Receiver<Attached>,
    fake: common::fake::Fake,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.cancel();
        self.stop_server.cancel();
    }
}

impl Harness {
    async fn start(drain_grace: Duration) -> Self {
        Self::start_in(
            drain_grace,
            std::sync::Arc::new(tempfile::tempdir().unwrap()),
        )
        .await
    }

    /// An agent whose state lives in `state` (a second agent over the state of a stopped one is
    /// that agent restarted).
    async fn start_in(drain_grace: Duration, state: std::sync::Arc<tempfile::TempDir>) -> Self {
        Self::start_configured(state, |config| config.drain_grace = drain_grace).await
    }

    /// An agent whose state lives in `state`, its configuration adjusted by `configure`.
    async fn start_configured(
        state: std::sync::Arc<tempfile::TempDir>,
        configure: impl FnOnce(&mut AgentConfig),
    ) -> Self {
        let stop_server = CancellationToken::new();
        let (addr, fake, attaches) = serve(stop_server.clone()).await;
        let tls = toolsrv_tls::TlsFiles {
            ca: "unused".into(),
            cert: "unused".into(),
            key: "unused".into(),
        };
        let mut config = AgentConfig::new(
            format!("http://{addr}"),
            "host-1",
            tls,
            state.path().join("state"),
        );
        config.labels.insert("role".into(), "test".into());
        config.max_concurrent_calls = 4;
        config.workdir = state.path().to_path_buf();
        config.recheck_every = Duration::from_millis(100);
        config.limits.kill_grace = Duration::from_millis(200);
        config.backoff = Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
        };
        configure(&mut config);
        let shutdown = CancellationToken::new();
        let url = format!("http://{addr}");
        let agent = tokio::spawn(run_with_connector(config, shutdown.clone(), move || {
            let url = url.clone();
            async move {
                Endpoint::from_shared(url)
                    .map_err(|e| AgentError::LinkLost(e.to_string()))?
                    .connect()
                    .await
                    .map_err(|e| AgentError::LinkLost(e.to_string()))
            }
        }));
        Self {
            state,
            stop_server,
            shutdown,
            agent,
            attaches,
            fake,
        }
    }

    /// The next attach, after checking its Hello.
    async fn attach(&mut self) -> Attached {
        let mut link = tokio::time::timeout(WAIT, self.attaches.recv())
            .await
            .expect("the agent attaches")
            .unwrap();
        match link.next(WAIT).await {
            Some(Out::Hello(hello)) => {
                assert_eq!(hello.host_id, "host-1");
                assert_eq!(hello.max_concurrent_calls, 4);
                assert_eq!(hello.agent_version, env!("CARGO_PKG_VERSION"));
                let facts = hello.facts.unwrap();
                assert!(
                    ["linux", "darwin"].contains(&facts.os.as_str()),
                    "{}",
                    facts.os
                );
                assert!(!facts.arch.is_empty());
                assert_eq!(facts.labels["role"], "test");
            }
            other => panic!("expected Hello first, got {other:?}"),
        }
        link
    }

    /// Attach, welcome, ship the test catalog, and wait for the first view.
    async fn ready(&mut self) -> Attached {
        let link = self.attach().await;
        link.send(In::Welcome(Welcome {
            keepalive_interval_ms: 200,
            coordinator_version: "test".into(),
        }))
        .await;
        self.ship_catalog(link).await
    }

    async fn ship_catalog(&mut self, mut link: Attached) -> Attached {
        let exe = script("cat");
        let blob = blob_ref(&exe);
        self.fake
            .blobs
            .lock()
            .unwrap()
            .insert(blob.sha256.clone(), exe);
        link.send(In::Catalog(CatalogUpdate {
            revision: 5,
            full: true,
            upserts: vec![
                doc("echo", r#"{"description":"echo stdin"}"#, Some(blob)),
                doc("hello", r#"{"cmd":"printf hello"}"#, None),
                doc("sleepy", r#"{"cmd":"sleep 30"}"#, None),
                doc(
                    "drip",
                    r#"{"cmd":"for i in 1 2 3 4 5 6; do echo a; sleep 0.2; done"}"#,
                    None,
                ),
            ],
            removals: vec![],
            more: false,
        }))
        .await;
        match link.next(WAIT).await {
            Some(Out::View(view)) => {
                assert_eq!(view.catalog_revision, 5);
                let names: Vec<_> = view.tools.iter().map(|t| t.name.as_str()).collect();
                assert_eq!(names, ["drip", "echo", "hello", "sleepy"]);
                assert!(view.tools.iter().all(|t| t.visible));
            }
            other => panic!("expected a HostView, got {other:?}"),
        }
        link
    }

    async fn stopped(self) -> Result<(), AgentError> {
        let agent = take_agent(self);
        tokio::time::timeout(WAIT, agent)
            .await
            .expect("the agent stops in time")
            .unwrap()
    }
}

/// Moves the join handle out of a harness whose Drop still cancels everything.
fn take_agent(mut h: Harness) -> JoinHandle<Result<(), AgentError>> {
    let placeholder = tokio::spawn(async { Ok(()) });
    std::mem::replace(&mut h.agent, placeholder)
}

fn start(call_id: u64, tool: &str, args: &str, credit: u64) -> In {
    In::Start(StartCall {
        call_id,
        tool: tool.into(),
        args_json: args.into(),
        cwd: String::new(),
        timeout_ms: 0,
        initial_credit: credit,
        ..StartCall::default()
    })
}

#[tokio::test]
async fn calls_run_and_report_their_outcome() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    let mut link = h.ready().await;

    // A shipped executable gets the args on stdin.
    link.send(start(1, "echo", r#"{"x":1}"#, 1 << 20)).await;
    let (output, result) = call_output(&mut link, 1).await;
    assert_eq!(String::from_utf8(output).unwrap(), "{\"x\":1}\n");
    assert_eq!(result.status(), CallStatus::Ok, "{}", result.message);
    assert_eq!(result.exit_code, Some(0));
    let json: serde_json::Value = serde_json::from_str(&result.result_json).unwrap();
    assert_eq!(json["content"][0]["text"], "{\"x\":1}\n");

    let refusals = [
        (2, "nope", "{}", CallStatus::UnknownTool),
        (3, "echo", "{not json", CallStatus::InvalidArgs),
        (4, "echo", "[1]", CallStatus::InvalidArgs),
    ];
    for (id, tool, args, status) in refusals {
        link.send(start(id, tool, args, 1 << 20)).await;
        let (output, result) = call_output(&mut link, id).await;
        assert!(output.is_empty());
        assert_eq!(result.status(), status, "{tool} {args}: {}", result.message);
        assert!(!result.message.is_empty());
    }

    // Credit and cancel messages for unknown calls are ignored.
    link.send(In::Credit(Credit {
        call_id: 99,
        bytes: 1,
    }))
    .await;
    link.send(In::Cancel(CancelCall { call_id: 99 })).await;

    // Without credit, output waits for a Credit.
    link.send(start(5, "hello", "", 0)).await;
    let quiet = tokio::time::timeout(Duration::from_millis(400), link.next(WAIT)).await;
    assert!(
        quiet.is_err(),
        "no output may flow without credit: {quiet:?}"
    );
    link.send(In::Credit(Credit {
        call_id: 5,
        bytes: 1,
    }))
    .await;
    let (output, result) = call_output(&mut link, 5).await;
    assert_eq!(output, b"hello");
    assert_eq!(result.status(), CallStatus::Ok);

    // Cancelling a running call kills it.
    link.send(start(6, "sleepy", "", 1 << 20)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    link.send(In::Cancel(CancelCall { call_id: 6 })).await;
    let (_, result) = call_output(&mut link, 6).await;
    assert_eq!(result.status(), CallStatus::Cancelled);

    // A timeout.
    link.send(In::Start(StartCall {
        call_id: 7,
        tool: "sleepy".into(),
        timeout_ms: 300,
        initial_credit: 1 << 20,
        ..StartCall::default()
    }))
    .await;
    let (_, result) = call_output(&mut link, 7).await;
    assert_eq!(result.status(), CallStatus::TimedOut);
    assert_eq!(result.message, "timed out after 300ms");

    h.shutdown.cancel();
    says_draining_then_goodbye(&mut link).await;
    h.stopped().await.unwrap();
}

/// Every chunk spends the overhead the coordinator asks on top of its data, so output in many
/// small chunks waits for credit as soon as the coordinator's count says it should.
#[tokio::test]
async fn each_output_chunk_spends_the_overhead_asked() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    let mut link = h.ready().await;
    // Enough for three chunks of a line each at 256 bytes a chunk (two leave 1 byte, above
    // zero), where the six lines' 12 bytes alone would all fit.
    link.send(In::Start(StartCall {
        call_id: 1,
        tool: "drip".into(),
        initial_credit: 2 * (256 + 2) + 1,
        chunk_overhead: 256,
        ..StartCall::default()
    }))
    .await;
    let (mut chunks, mut bytes) = (0, 0);
    // The tool prints a line every 200 ms: after 2 s it has printed them all. Keepalives say
    // the coordinator is still there.
    for _ in 0..20 {
        link.send(In::Keepalive(Keepalive {
            sent_unix_ms: 0,
            interval_ms: 0,
        }))
        .await;
        let tick = tokio::time::Instant::now() + Duration::from_millis(100);
        while let Ok(message) = tokio::time::timeout_at(tick, link.next(WAIT)).await {
            match message {
                Some(Out::Output(o)) => {
                    chunks += 1;
                    bytes += o.chunk.unwrap().data.len();
                }
                Some(Out::View(_) | Out::Keepalive(_)) => {}
                other => panic!("output expected, got {other:?}"),
            }
        }
    }
    assert_eq!(chunks, 3, "three chunks fit the credit ({bytes} bytes)");
    assert!(bytes < 12, "the rest waits for credit: {bytes} bytes came");
    link.send(In::Credit(Credit {
        call_id: 1,
        bytes: 1 << 20,
    }))
    .await;
    let (rest, result) = call_output(&mut link, 1).await;
    assert_eq!(bytes + rest.len(), 12, "all of it once credit came");
    assert_eq!(result.status(), CallStatus::Ok, "{}", result.message);
    drop(link);
    h.shutdown.cancel();
}

#[tokio::test]
async fn shutdown_drains_then_cancels_and_says_goodbye() {
    let mut h = Harness::start(Duration::from_millis(500)).await;
    let mut link = h.ready().await;
    link.send(start(1, "sleepy", "", 1 << 20)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.shutdown.cancel();
    // The agent says first that it takes no new call.
    assert!(matches!(link.next(WAIT).await, Some(Out::Draining(_))));
    // New calls that cross that word are refused while draining.
    link.send(start(2, "hello", "", 1 << 20)).await;
    let (_, refused) = call_output(&mut link, 2).await;
    assert_eq!(refused.status(), CallStatus::Cancelled);
    assert_eq!(refused.message, "agent is shutting down");
    // The in-flight call is cancelled once the drain grace is over.
    let (_, result) = call_output(&mut link, 1).await;
    assert_eq!(result.status(), CallStatus::Cancelled);
    match link.next(WAIT).await {
        Some(Out::Goodbye(g)) => assert!(!g.reason.is_empty()),
        other => panic!("expected Goodbye, got {other:?}"),
    }
    // The outbound stream is closed after the Goodbye.
    assert!(link.from_agent.message().await.unwrap().is_none());
    drop(link);
    h.stopped().await.unwrap();
}

#[tokio::test]
async fn reconnects_after_refusal_silence_goodbye_and_bad_first_message() {
    let mut h = Harness::start(Duration::from_secs(1)).await;
    h.fake
        .refuse
        .lock()
        .unwrap()
        .push(tonic::Status::resource_exhausted(
            "too many agents attaching at once",
        ));

    // First attach refused by the fake (a refusal that goes away by itself: one that does not,
    // such as a certificate of another host, waits minutes instead, see `reconnect`); the next
    // one gets a non-Welcome first message.
    let link = h.attach().await;
    link.send(In::Keepalive(Keepalive {
        sent_unix_ms: 0,
        interval_ms: 0,
    }))
    .await;
    drop(link);

    // A silent coordinator is given up on after three keepalive intervals, and its calls stop.
    let mut link = h.ready().await;
    link.send(start(1, "sleepy", "", 1 << 20)).await;
    let (_, result) = tokio::time::timeout(WAIT, call_output(&mut link, 1))
        .await
        .expect("the lost session's call is cancelled");
    assert_eq!(result.status(), CallStatus::Cancelled);
    drop(link);

    // A Goodbye from the coordinator ends the session; the agent comes back.
    let link = h.ready().await;
    link.send(In::Goodbye(Goodbye {
        reason: "restart".into(),
        refused: false,
    }))
    .await;
    let link2 = h.attach().await;
    drop(link);
    drop(link2);
    h.shutdown.cancel();
    h.stopped().await.unwrap();
}

/// A coordinator that keeps talking but reads nothing the agent sends (wedged, while its
/// connection still answers HTTP/2 pings): once the agent's queue has stayed full for the stall
/// limit with nothing taken, the agent gives the link up and connects again. Before, it waited
/// for room for ever: its session never judged the coordinator again, and it never reconnected
/// (to another replica, say).
#[tokio::test]
async fn a_coordinator_that_reads_nothing_is_given_up_on() {
    let state = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let mut h = Harness::start_configured(state, |config| {
        config.drain_grace = Duration::from_secs(1);
        config.stalled_after = Duration::from_secs(2);
    })
    .await;
    let mut link = h.ready().await;
    link.send(In::Catalog(CatalogUpdate {
        revision: 6,
        full: false,
        upserts: vec![doc("spew", r#"{"cmd":"yes"}"#, None)],
        removals: vec![],
        more: false,
    }))
    .await;
    match link.next(WAIT).await {
        Some(Out::View(view)) => assert_eq!(view.catalog_revision, 6),
        other => panic!("expected a HostView, got {other:?}"),
    }
    // Output without end and all the credit it could want; from here on, nothing is read.
    link.send(start(1, "spew", "", u64::MAX / 2)).await;
    let talking = tokio::spawn({
        let to_agent = link.to_agent.clone();
        async move {
            loop {
                let keepalive = In::Keepalive(Keepalive {
                    sent_unix_ms: 0,
                    interval_ms: 0,
                });
                let message = CoordinatorMessage {
                    msg: Some(keepalive),
                };
                if to_agent.send(Ok(message)).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    let again = h.attach().await;
    talking.abort();
    drop(link);
    drop(again);
    h.shutdown.cancel();
    h.stopped().await.unwrap();
}

#[test]
fn run_is_send() {
    fn assert_send<T: Send>(_: &T) {}
    let config = AgentConfig::new(
        "https://127.0.0.1:1",
        "h",
        toolsrv_tls::TlsFiles {
            ca: "ca".into(),
            cert: "c".into(),
            key: "k".into(),
        },
        "/nonexistent",
    );
    let fut = toolsrv_agent::run(config, CancellationToken::new());
    assert_send(&fut);
}

#[tokio::test]
async fn run_attaches_over_mutual_tls() {
    use toolsrv_tls::{Identity, TlsFiles};
    let pki = tempfile::tempdir().unwrap();
    toolsrv_testkit::write_pki(pki.path(), &["web-1"], &[]).unwrap();
    let stop = CancellationToken::new();
    let (addr, fake, mut attaches) = common::fake::serve_tls(
        stop.clone(),
        TlsFiles::in_dir(pki.path(), &Identity::Coordinator),
    )
    .await;
    let state = tempfile::tempdir().unwrap();
    let config = AgentConfig::new(
        format!("https://{addr}"),
        "web-1",
        TlsFiles::in_dir(pki.path(), &Identity::Agent("web-1".into())),
        state.path(),
    );
    let shutdown = CancellationToken::new();
    let agent = tokio::spawn(toolsrv_agent::run(config, shutdown.clone()));
    let mut link = tokio::time::timeout(WAIT, attaches.recv())
        .await
        .expect("the agent attaches over mTLS")
        .unwrap();
    assert!(matches!(link.next(WAIT).await, Some(Out::Hello(h)) if h.host_id == "web-1"));
    assert_eq!(
        fake.peers.lock().unwrap().as_slice(),
        [Some(Identity::Agent("web-1".into()))]
    );
    link.send(In::Welcome(Welcome {
        keepalive_interval_ms: 1000,
        coordinator_version: "test".into(),
    }))
    .await;
    link.send(In::Catalog(CatalogUpdate {
        revision: 1,
        full: true,
        upserts: vec![],
        removals: vec![],
        more: false,
    }))
    .await;
    assert!(matches!(link.next(WAIT).await, Some(Out::View(v)) if v.catalog_revision == 1));
    shutdown.cancel();
    says_draining_then_goodbye(&mut link).await;
    drop(link);
    tokio::time::timeout(WAIT, agent)
        .await
        .expect("the agent stops")
        .unwrap()
        .unwrap();
    stop.cancel();
}

/// A tool that alters a cached executable (same size, same mtime) changes nothing that runs:
/// neither while the agent runs nor across a restart.
#[tokio::test]
async fn an_altered_cached_executable_never_runs() {
    let mut h = Harness::start(Duration::from_secs(5)).await;
    let mut link = h.ready().await;
    // `echo` is `cat`; the altered one prints something else, in as many bytes.
    let exe = script("cat");
    let evil = script("pwd");
    let cached = h
        .state
        .path()
        .join("state/blobs")
        .join(blob_ref(&exe).sha256);
    let mut id = 0;
    let mut call = async |link: &mut Attached| {
        id += 1;
        link.send(start(id, "echo", r#"{"n":1}"#, 1 << 20)).await;
        let (output, result) = call_output(link, id).await;
        assert_eq!(result.status(), CallStatus::Ok, "{}", result.message);
        String::from_utf8(output).unwrap()
    };
    assert_eq!(call(&mut link).await, "{\"n\":1}\n");
    // Tampered right after its check, and again once its check is trusted until it changes.
    tamper(&cached, &evil);
    assert_eq!(call(&mut link).await, "{\"n\":1}\n");
    // Keep the link alive (the agent expects to hear from the coordinator) while the file settles.
    let settled = tokio::time::Instant::now() + toolsrv_agent::SETTLE + Duration::from_millis(500);
    while tokio::time::Instant::now() < settled {
        link.send(In::Keepalive(Keepalive {
            sent_unix_ms: 0,
            interval_ms: 0,
        }))
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(call(&mut link).await, "{\"n\":1}\n");
    assert_eq!(call(&mut link).await, "{\"n\":1}\n");
    tamper(&cached, &evil);
    assert_eq!(call(&mut link).await, "{\"n\":1}\n");
    assert_eq!(std::fs::read(&cached).unwrap(), exe);

    // Tampered while the agent is stopped.
    h.shutdown.cancel();
    says_draining_then_goodbye(&mut link).await;
    let state = h.state.clone();
    h.stopped().await.unwrap();
    tamper(&cached, &evil);
    let mut h = Harness::start_in(Duration::from_secs(5), state).await;
    let mut link = h.ready().await;
    assert_eq!(call(&mut link).await, "{\"n\":1}\n");
    assert_eq!(std::fs::read(&cached).unwrap(), exe);
    h.shutdown.cancel();
}

/// The agent's last words after a shutdown: `Draining` (no new call), then `Goodbye`.
async fn says_draining_then_goodbye(link: &mut Attached) {
    match link.next(WAIT).await {
        Some(Out::Draining(_)) => {}
        other => panic!("expected Draining, got {other:?}"),
    }
    match link.next(WAIT).await {
        Some(Out::Goodbye(_)) => {}
        other => panic!("expected Goodbye, got {other:?}"),
    }
}
