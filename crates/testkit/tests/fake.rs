//! The fake agents' protocol core, without a network: what a fake host answers to each
//! coordinator message, for each way of answering calls.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use toolsrv_proto::v1::agent_message::Msg as Out;
use toolsrv_proto::v1::coordinator_message::Msg as In;
use toolsrv_proto::v1::{
    AgentMessage, CallStatus, CancelCall, CatalogUpdate, CoordinatorMessage, Credit, StartCall,
    ToolDocument, Welcome,
};
use toolsrv_testkit::fake::{Answer, Definitions, FAKE_FAILURE, FAKE_OUTPUT, Reaction, Responder};

fn msg(m: In) -> CoordinatorMessage {
    CoordinatorMessage { msg: Some(m) }
}

fn doc(name: &str, meta: &str) -> ToolDocument {
    ToolDocument {
        name: name.into(),
        meta: meta.as_bytes().to_vec(),
        ..ToolDocument::default()
    }
}

/// A welcomed responder answering calls with `answer`.
fn welcomed(answer: Answer) -> Responder {
    let mut r = Responder::new("fake-0002", Definitions::Minimal).answering(answer);
    r.react(msg(In::Welcome(Welcome::default())));
    r
}

fn start(call_id: u64, initial_credit: u64) -> CoordinatorMessage {
    msg(In::Start(StartCall {
        call_id,
        tool: "t".into(),
        initial_credit,
        ..StartCall::default()
    }))
}

fn sent(reaction: Reaction) -> Vec<Out> {
    match reaction {
        Reaction::Send(sent) => sent
            .into_iter()
            .map(|m: AgentMessage| m.msg.unwrap())
            .collect(),
        other => panic!("expected messages, got {other:?}"),
    }
}

/// The protocol core, without a network: Hello, Welcome, a view for every
/// catalog update, and an immediate `ok` for every call.
#[test]
fn fake_agent_answers_the_protocol() {
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

#[test]
fn a_failing_host_answers_with_stderr_and_a_tool_error() {
    let mut r = welcomed(Answer::Fail);
    match sent(r.react(start(4, 1000))).as_slice() {
        [Out::Output(out), Out::Finished(done)] => {
            assert_eq!(out.chunk.as_ref().unwrap().data, FAKE_FAILURE);
            let result = done.result.as_ref().unwrap();
            assert_eq!(result.status, CallStatus::ToolError as i32);
            assert_eq!(result.exit_code, Some(1));
        }
        other => panic!("expected output then finished, got {other:?}"),
    }
}

/// A streaming host sends no more than its credit, and ends once all its output is out.
#[test]
fn a_streaming_host_sends_only_against_credit() {
    let mut r = welcomed(Answer::Stream {
        bytes: 1000,
        chunk: 300,
    });
    let bytes = |out: &[Out]| -> usize {
        out.iter()
            .map(|m| match m {
                Out::Output(o) => o.chunk.as_ref().unwrap().data.len(),
                _ => 0,
            })
            .sum()
    };
    let finished = |out: &[Out]| out.iter().any(|m| matches!(m, Out::Finished(_)));

    let first = sent(r.react(start(7, 500)));
    assert_eq!(bytes(&first), 500, "{first:?}");
    assert!(!finished(&first));
    let credit = |bytes: u64| msg(In::Credit(Credit { call_id: 7, bytes }));
    let second = sent(r.react(credit(200)));
    assert_eq!(bytes(&second), 200);
    assert!(!finished(&second));
    let last = sent(r.react(credit(1000)));
    assert_eq!(bytes(&last), 300);
    match last.last() {
        Some(Out::Finished(done)) => {
            assert_eq!(done.result.as_ref().unwrap().status, CallStatus::Ok as i32);
        }
        other => panic!("expected the end, got {other:?}"),
    }
    assert!(
        sent(r.react(credit(1000))).is_empty(),
        "nothing after the end"
    );

    // A cancelled stream ends as cancelled.
    sent(r.react(start(8, 100)));
    match sent(r.react(msg(In::Cancel(CancelCall { call_id: 8 })))).as_slice() {
        [Out::Finished(done)] => assert_eq!(
            done.result.as_ref().unwrap().status,
            CallStatus::Cancelled as i32
        ),
        other => panic!("expected the end, got {other:?}"),
    }
}
