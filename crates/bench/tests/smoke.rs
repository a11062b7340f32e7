//! Runs every measured function once on tiny inputs, so CI notices when a bench breaks.
//!
//! The benches themselves are plain `main`s (`harness = false`) that `cargo test` never runs;
//! `BENCH_QUICK=1 cargo bench -p toolsrv-bench` runs them whole in a few seconds.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use toolsrv_bench::call::{
    CallFixture, SpawnSetup, confined_call, confiner, direct_spawn, jail_only, pairs,
    prepare_batch, timed_load,
};
use toolsrv_bench::scan::{ScanFixture, cold_scan, rescan_after, timed_scan};
use toolsrv_bench::stats::{Summary, nanos};
use toolsrv_bench::variants::{Case, case_meta, resolve_batch};
use toolsrv_meta::Host;

#[test]
fn registry_scan_runs() {
    let mut fixture = ScanFixture::new(20).unwrap();
    cold_scan(&fixture).unwrap();
    let mut scanner = fixture.scanner();
    timed_scan(&mut scanner, 20).unwrap();
    rescan_after(&mut fixture, &mut scanner, |_| Ok(())).unwrap();
    rescan_after(&mut fixture, &mut scanner, |f| f.touch(3, 0)).unwrap();
    rescan_after(&mut fixture, &mut scanner, |f| f.edit(3, 0)).unwrap();
}

#[test]
fn variant_eval_runs() {
    let host = Host::current();
    let existing = tempfile::NamedTempFile::new().unwrap();
    for case in Case::ALL {
        // case_meta checks the case resolves as intended on this host.
        let meta = case_meta(case, &host, existing.path()).unwrap();
        resolve_batch(&meta, &host, 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_overhead_runs() {
    let fixture = CallFixture::new().unwrap();
    let measured = pairs(&fixture, 2).await.unwrap();
    let overhead: Vec<f64> = measured.iter().map(|p| p.overhead_ns()).collect();
    assert!(Summary::of_nanos(&overhead).is_some());
    for p in &measured {
        let t = p.toolsrv;
        assert!(t.prepared <= t.started && t.started <= t.output && t.output <= t.finished);
    }
    direct_spawn(&fixture, SpawnSetup::LIKE_EXEC).await.unwrap();
    prepare_batch(&fixture, 2).unwrap();
    assert_eq!(nanos(&[timed_load(&fixture)]).len(), 1);
    let root = tempfile::tempdir().unwrap();
    let confiner = confiner(&root.path().join("calls"), vec![root.path().join("state")]).unwrap();
    confined_call(&fixture, &confiner).await.unwrap();
    jail_only(&fixture, &confiner).unwrap();
}

/// The load generator's protocol core, without a network: Hello, Welcome, a view for every
/// catalog update, and an immediate `ok` for every call.
#[test]
fn fake_agent_answers_the_protocol() {
    use toolsrv_bench::fakeagents::{Definitions, FAKE_OUTPUT, Reaction, Responder};
    use toolsrv_proto::v1::agent_message::Msg as Out;
    use toolsrv_proto::v1::coordinator_message::Msg as In;
    use toolsrv_proto::v1::{
        CallStatus, CatalogUpdate, CoordinatorMessage, StartCall, ToolDocument, Welcome,
    };

    let msg = |m: In| CoordinatorMessage { msg: Some(m) };
    let doc = |name: &str, meta: &str| ToolDocument {
        name: name.into(),
        meta: meta.as_bytes().to_vec(),
        ..ToolDocument::default()
    };
    let mut r = Responder::new("fake-0001", Definitions::FromMeta);
    match r.hello().msg {
        Some(Out::Hello(h)) => assert_eq!(h.host_id, "fake-0001"),
        other => panic!("not a hello: {other:?}"),
    }
    // Anything before the Welcome ends the link.
    let mut early = r.clone();
    assert!(matches!(
        early.react(msg(In::Catalog(CatalogUpdate::default()))),
        Reaction::End(_)
    ));
    let welcome = Welcome {
        keepalive_interval_ms: 1000,
        ..Welcome::default()
    };
    assert_eq!(
        r.react(msg(In::Welcome(welcome))),
        Reaction::Welcomed(std::time::Duration::from_secs(1))
    );

    let full = CatalogUpdate {
        revision: 3,
        full: true,
        upserts: vec![
            doc(
                "echo_ok",
                r##"{"description":"says ok","prompt":"# echo","keywords":["ok"],"args":{"type":"object"}}"##,
            ),
            doc("other", "{}"),
        ],
        removals: vec![],
        more: false,
    };
    let Reaction::Send(sent) = r.react(msg(In::Catalog(full))) else {
        panic!("no answer to a catalog update");
    };
    let [
        toolsrv_proto::v1::AgentMessage {
            msg: Some(Out::View(view)),
        },
    ] = sent.as_slice()
    else {
        panic!("expected one view, got {sent:?}");
    };
    assert_eq!(view.catalog_revision, 3);
    assert_eq!(view.tools.len(), 2);
    assert!(
        view.tools
            .iter()
            .all(|t| t.visible && t.definition.is_some())
    );
    let echo = view.tools[0].definition.as_ref().unwrap();
    assert_eq!(
        (echo.description.as_str(), echo.prompt.as_str()),
        ("says ok", "# echo")
    );

    let incremental = CatalogUpdate {
        revision: 4,
        full: false,
        upserts: vec![],
        removals: vec!["other".into()],
        more: false,
    };
    r.react(msg(In::Catalog(incremental)));
    assert_eq!(r.tools().collect::<Vec<_>>(), ["echo_ok"]);

    let start = StartCall {
        call_id: 9,
        tool: "echo_ok".into(),
        ..StartCall::default()
    };
    let Reaction::Send(sent) = r.react(msg(In::Start(start))) else {
        panic!("no answer to a call");
    };
    match (&sent[0].msg, &sent[1].msg) {
        (Some(Out::Output(out)), Some(Out::Finished(done))) => {
            assert_eq!((out.call_id, done.call_id), (9, 9));
            assert_eq!(out.chunk.as_ref().unwrap().data, FAKE_OUTPUT);
            assert_eq!(done.result.as_ref().unwrap().status, CallStatus::Ok as i32);
        }
        other => panic!("expected output then finished, got {other:?}"),
    }
}
