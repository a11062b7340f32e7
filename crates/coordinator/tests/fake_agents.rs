//! The coordinator in process against fake agents (real mTLS links, the real protocol, nothing
//! run): a fan-out's error budget and concurrency limit, credit on a streaming call, and what a
//! compromised agent can and cannot make the coordinator say.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Coordinator, WAIT, client};
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use toolsrv_coordinator::{DEFAULT_MAX_HOST_ONLY_TOOLS, MAX_HOST_ONLY_PAST_LIMIT};
use toolsrv_proto::v1::tools_client::ToolsClient;
use toolsrv_proto::v1::{
    CallRequest, CallResult, CallStatus, FanOutRequest, FanOutSummary, FindToolsRequest, HostState,
    ListHostsRequest, ListToolsRequest, ListToolsResponse, call_event, fan_out_event,
};
use toolsrv_testkit::fake::{
    Answer, Behaviour, Connected, Definitions, FORGED_TEXT, FORGED_TOOL, FakeAgents, Gate, fake_id,
};
use toolsrv_testkit::{must, wait_until};

const TOOL: &str = r#"{"description": "fake", "cmd": "true"}"#;

/// A coordinator serving tool `t` and `n` fake agents attached to it, each behaving as
/// `behaviour` says, all online with their views in.
async fn fleet(
    n: usize,
    configure: impl FnOnce(&mut toolsrv_coordinator::CoordinatorConfig),
    behaviour: impl Fn(&str) -> Behaviour,
) -> (Coordinator, FakeAgents) {
    let ids: Vec<String> = (0..n).map(fake_id).collect();
    let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let coordinator =
        Coordinator::start_with(&id_refs, &[("t.meta", TOOL)], |config, _| configure(config)).await;
    let connected = must(Connected::connect(&coordinator.url, &coordinator.pki(), &ids, 4).await);
    let agents = connected.attach_with(behaviour);
    must(agents.wait_ready(WAIT).await);
    let mut api = coordinator.tools(&client("alice")).await;
    must(
        wait_until("every fake host online with its view", WAIT, async || {
            let hosts = api
                .list_hosts(ListHostsRequest::default())
                .await
                .ok()?
                .into_inner()
                .hosts;
            let ready = hosts
                .iter()
                .filter(|h| h.state == HostState::Online as i32 && h.visible_tools == 1)
                .count();
            (ready == n).then_some(())
        })
        .await,
    );
    (coordinator, agents)
}

/// What a fan-out reported: each host's status, and the summary.
#[derive(Debug)]
struct Outcome {
    statuses: BTreeMap<String, (CallStatus, String)>,
    summary: FanOutSummary,
}

impl Outcome {
    fn count(&self, status: CallStatus) -> usize {
        self.statuses.values().filter(|(s, _)| *s == status).count()
    }
}

/// Fans tool `t` out to every fake host and reads the stream to its summary.
async fn fan_out(coordinator: &Coordinator, concurrency: u32, max_errors: u32) -> Outcome {
    let mut api = coordinator.tools(&client("alice")).await;
    let request = FanOutRequest {
        selector: "fleet=fake".into(),
        tool: "t".into(),
        concurrency,
        max_errors,
        ..FanOutRequest::default()
    };
    let mut events = api.fan_out(request).await.unwrap().into_inner();
    let mut statuses = BTreeMap::new();
    let summary = tokio::time::timeout(WAIT, async {
        while let Some(event) = events.next().await {
            let event = event.unwrap();
            match event.event {
                Some(fan_out_event::Event::Result(result)) => {
                    let status = CallStatus::try_from(result.status).unwrap();
                    let before = statuses.insert(event.host.clone(), (status, result.message));
                    assert!(before.is_none(), "two results for {}", event.host);
                }
                Some(fan_out_event::Event::Summary(summary)) => return summary,
                _ => {}
            }
        }
        panic!("the fan-out ended without a summary");
    })
    .await
    .expect("the fan-out ends within the wait");
    Outcome { statuses, summary }
}

/// With `max_errors`, hosts whose turn comes after more than that many failures are not
/// called: they end SKIPPED, and the summary counts them as failed. Without a budget, every
/// host runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_after_the_error_budget_is_spent_are_skipped() {
    let (coordinator, agents) = fleet(
        6,
        |_| {},
        |_| Behaviour {
            answer: Answer::Fail,
            ..Behaviour::default()
        },
    )
    .await;

    // One host at a time, so the budget is spent in a known number of calls: two failures are
    // within the budget, the third spends it, and the three hosts left are skipped.
    let outcome = fan_out(&coordinator, 1, 2).await;
    assert_eq!(outcome.statuses.len(), 6, "{outcome:?}");
    assert_eq!(outcome.count(CallStatus::ToolError), 3, "{outcome:?}");
    assert_eq!(outcome.count(CallStatus::Skipped), 3, "{outcome:?}");
    for (status, message) in outcome.statuses.values() {
        if *status == CallStatus::Skipped {
            assert!(
                message.contains("more than 2 hosts failed"),
                "the skip says why: {message}"
            );
        }
    }
    let summary = &outcome.summary;
    assert_eq!(
        (summary.targeted, summary.ok, summary.failed),
        (6, 0, 6),
        "{summary:?}"
    );
    assert_eq!(
        agents.counters.calls.load(Ordering::SeqCst),
        3,
        "skipped hosts are never called"
    );

    // No budget (0): every host is called and fails.
    let outcome = fan_out(&coordinator, 1, 0).await;
    assert_eq!(outcome.count(CallStatus::ToolError), 6, "{outcome:?}");
    assert_eq!(agents.counters.calls.load(Ordering::SeqCst), 9);

    // Failures among successes: only the failing hosts spend the budget.
    drop(agents);
    coordinator.stop().await;
    let (coordinator, _agents) = fleet(
        6,
        |_| {},
        |id| Behaviour {
            answer: if id == fake_id(0) {
                Answer::Fail
            } else {
                Answer::Ok
            },
            ..Behaviour::default()
        },
    )
    .await;
    let outcome = fan_out(&coordinator, 1, 1).await;
    assert_eq!(outcome.count(CallStatus::Ok), 5, "{outcome:?}");
    assert_eq!(outcome.count(CallStatus::ToolError), 1, "{outcome:?}");
    assert_eq!((outcome.summary.ok, outcome.summary.failed), (5, 1));
    coordinator.stop().await;
}

/// A fan-out never has more calls running than its concurrency; 0 means every host at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_runs_at_most_its_concurrency_at_once() {
    let gate = Gate::closed();
    let held = gate.clone();
    let (coordinator, agents) = fleet(
        6,
        |_| {},
        move |_| Behaviour {
            hold: Some(held.clone()),
            ..Behaviour::default()
        },
    )
    .await;
    let counters = agents.counters.clone();
    let in_flight = || counters.in_flight.load(Ordering::SeqCst);

    let fan = fan_out(&coordinator, 2, 0);
    let watch = async {
        must(
            wait_until("two calls held on the fake hosts", WAIT, async || {
                (in_flight() >= 2).then_some(())
            })
            .await,
        );
        // The coordinator starts no third call while two are running.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let running = in_flight();
        gate.open();
        assert_eq!(running, 2, "calls running at once with concurrency 2");
    };
    let (outcome, ()) = tokio::join!(fan, watch);
    assert_eq!(outcome.count(CallStatus::Ok), 6, "{outcome:?}");
    assert_eq!(counters.max_in_flight.load(Ordering::SeqCst), 2);

    // Concurrency 0: every host at once.
    gate.close();
    let fan = fan_out(&coordinator, 0, 0);
    let watch = async {
        must(
            wait_until("all six calls held at once", WAIT, async || {
                (in_flight() == 6).then_some(())
            })
            .await,
        );
        gate.open();
    };
    let (outcome, ()) = tokio::join!(fan, watch);
    assert_eq!(outcome.count(CallStatus::Ok), 6, "{outcome:?}");
    assert_eq!(counters.max_in_flight.load(Ordering::SeqCst), 6);
    coordinator.stop().await;
}

/// Output flows only against credit, and the coordinator hands credit back in batches of at
/// least half its window as the caller reads, not once per chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_goes_back_in_batches_as_the_caller_reads() {
    credit_comes_back(false).await;
}

/// The same with an agent that spends each chunk's overhead: what it spent comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_spent_on_each_chunk_s_overhead_comes_back() {
    credit_comes_back(true).await;
}

async fn credit_comes_back(counts_chunk_overhead: bool) {
    const WINDOW: u64 = 1024;
    const BYTES: u64 = 16 * 1024;
    const CHUNK: u64 = 128;
    let (coordinator, agents) = fleet(
        1,
        |config| config.credit_window = WINDOW,
        |_| Behaviour {
            answer: Answer::Stream {
                bytes: BYTES,
                chunk: CHUNK,
            },
            counts_chunk_overhead,
            ..Behaviour::default()
        },
    )
    .await;
    let mut api = coordinator.tools(&client("alice")).await;
    let mut events = api
        .call(CallRequest {
            host: fake_id(0),
            tool: "t".into(),
            ..CallRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (stdout, result) = tokio::time::timeout(WAIT, async {
        let mut stdout = 0;
        while let Some(event) = events.next().await {
            match event.unwrap().event {
                Some(call_event::Event::Output(chunk)) => stdout += chunk.data.len() as u64,
                Some(call_event::Event::Result(result)) => return (stdout, result),
                _ => {}
            }
        }
        panic!("the call ended without a result");
    })
    .await
    .expect("the call ends within the wait");
    assert_eq!(result.status, CallStatus::Ok as i32, "{result:?}");
    assert_eq!(stdout, BYTES);

    let counters = &agents.counters;
    let grants = counters.credits.load(Ordering::SeqCst) as u64;
    let granted = counters.credit_bytes.load(Ordering::SeqCst);
    let smallest = counters.smallest_credit.load(Ordering::SeqCst);
    // Each chunk cost its data, and its overhead where counted.
    let overhead = match counts_chunk_overhead {
        true => toolsrv_coordinator::CHUNK_OVERHEAD,
        false => 0,
    };
    let spent = BYTES + BYTES / CHUNK * overhead;
    assert!(
        granted >= spent - WINDOW,
        "the agent got the credit it needed beyond its first window: {granted} of {spent}"
    );
    assert!(
        smallest >= WINDOW / 2,
        "every grant is at least half a window: {smallest}"
    );
    assert!(
        grants <= spent / (WINDOW / 2),
        "{grants} grants for {} chunks: batched",
        BYTES / CHUNK
    );
    coordinator.stop().await;
}

/// A compromised agent (`definitions`, answering calls `answer`) attached as host
/// `fake-0000` to a coordinator serving `tools` and set up by `configure`; its whole view, once
/// reported.
async fn compromised_host(
    tools: &[(&str, &str)],
    configure: impl FnOnce(&mut toolsrv_coordinator::CoordinatorConfig),
    definitions: Definitions,
    answer: Answer,
) -> (Coordinator, FakeAgents, ListToolsResponse) {
    let id = fake_id(0);
    let coordinator =
        Coordinator::start_with(&[id.as_str()], tools, |config, _| configure(config)).await;
    let connected = must(
        Connected::connect(
            &coordinator.url,
            &coordinator.pki(),
            std::slice::from_ref(&id),
            1,
        )
        .await,
    );
    let agents = connected.attach_with(move |_| Behaviour {
        definitions,
        answer,
        ..Behaviour::default()
    });
    must(agents.wait_ready(WAIT).await);
    let mut api = coordinator.tools(&client("alice")).await;
    let list = must(
        wait_until("the compromised host's view", WAIT, async || {
            let list = api
                .list_tools(ListToolsRequest {
                    host: id.clone(),
                    include_hidden: true,
                    ..ListToolsRequest::default()
                })
                .await
                .ok()?
                .into_inner();
            (!list.tools.is_empty()).then_some(list)
        })
        .await,
    );
    (coordinator, agents, list)
}

/// How a call of `tool` on `host`, without arguments, ended.
async fn called(api: &mut ToolsClient<Channel>, host: &str, tool: &str) -> CallResult {
    let mut events = api
        .call(CallRequest {
            host: host.to_string(),
            tool: tool.to_string(),
            ..CallRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    common::call_result(&mut events).await
}

/// What every host's tools rank for the forged words.
async fn find_forged(coordinator: &Coordinator) -> toolsrv_proto::v1::FindToolsResponse {
    let request = FindToolsRequest {
        selector: "all".into(),
        query: FORGED_TEXT.into(),
        limit: 10,
    };
    let mut api = coordinator.tools(&client("alice")).await;
    api.find_tools(request).await.unwrap().into_inner()
}

/// A compromised agent says every tool is about something else, offers a tool the catalog does
/// not have, gives a hidden tool a reason that would clear the screen and runs on for 100 KB,
/// and ends calls with such a message. The coordinator takes from it which shipped tools its
/// host offers and why not the others, as one bounded line; what each shipped tool says comes
/// from the catalog. The tool the catalog does not have is listed as the host's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compromised_agent_cannot_make_a_tool_say_what_its_meta_does_not() {
    let id = fake_id(0);
    let hidden_t = r#"{"description": "hidden here", "cmd": "true"}"#;
    let (coordinator, agents, list) = compromised_host(
        &[("t.meta", TOOL), ("hidden_t.meta", hidden_t)],
        |_| {},
        Definitions::Forged,
        Answer::Hostile,
    )
    .await;
    let mut api = coordinator.tools(&client("alice")).await;
    let names: Vec<&str> = list.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, [FORGED_TOOL, "hidden_t", "t"]);
    // Its own tool is the host's word, and says so.
    let own = &list.tools[0];
    assert!(own.visible && own.host_only);
    assert_eq!(own.definition.as_ref().unwrap().prompt, FORGED_TEXT);
    let t = &list.tools[2];
    assert!(!t.host_only);
    assert!(t.visible);
    let def = t.definition.as_ref().unwrap();
    assert_eq!(
        (def.description.as_str(), def.prompt.as_str()),
        ("fake", "")
    );
    assert_eq!(t.description, "fake");
    assert_eq!(def.args_schema_json, r#"{"type":"object"}"#);
    let hidden = &list.tools[1];
    assert!(!hidden.host_only);
    assert!(!hidden.visible);
    assert_eq!(hidden.description, "hidden here");
    assert!(
        hidden
            .reason
            .starts_with("\\u{1b}[2J\\u{1b}[Hall clear\\nsecond line"),
        "{}",
        &hidden.reason[..80]
    );
    assert!(hidden.reason.len() < 5_000, "{}", hidden.reason.len());
    assert!(!hidden.reason.contains(['\u{1b}', '\n']));

    // The forged words find only the host's own tool: they are in no shipped tool's definition.
    let found = find_forged(&coordinator).await;
    assert!(
        found
            .matches
            .iter()
            .all(|m| m.name == FORGED_TOOL || !m.description.contains("IGNORE")),
        "{found:?}"
    );
    // What found the host's own tool says it is the host's word; shipped tools are not marked.
    assert!(
        found
            .matches
            .iter()
            .all(|m| m.host_only == (m.name == FORGED_TOOL)),
        "{found:?}"
    );
    assert!(
        found.matches.iter().any(|m| m.name == FORGED_TOOL),
        "{found:?}"
    );

    // How a call ended, in the agent's words: one bounded line.
    let result = called(&mut api, &id, "t").await;
    assert_eq!(result.status, CallStatus::ToolError as i32);
    assert!(
        result.message.starts_with("\\u{1b}[2J"),
        "{}",
        &result.message[..40]
    );
    assert!(result.message.len() < 5_000, "{}", result.message.len());
    assert!(!result.message.contains(['\u{1b}', '\n']));
    assert!(
        result.message.ends_with("bytes)"),
        "{}",
        &result.message[result.message.len() - 40..]
    );
    drop(agents);
    coordinator.stop().await;
}

/// A compromised agent offering 10,000 tools of its own cannot make the coordinator hold, list,
/// index and embed them all: the first 256 by name are kept (`--max-host-only-tools`), the next
/// 4,096 listed hidden by name, the rest left out, and the host's shipped tool and every
/// request go on as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_cannot_flood_the_coordinator_with_tools_of_its_own() {
    let id = fake_id(0);
    let (coordinator, agents, list) = compromised_host(
        &[("t.meta", TOOL)],
        |_| {},
        Definitions::Flood(10_000),
        Answer::Ok,
    )
    .await;
    let mut api = coordinator.tools(&client("alice")).await;
    let own: Vec<&str> = list
        .tools
        .iter()
        .filter(|t| t.host_only && t.visible)
        .map(|t| t.name.as_str())
        .collect();
    let first: Vec<String> = (0..DEFAULT_MAX_HOST_ONLY_TOOLS)
        .map(|i| format!("flood_{i:05}"))
        .collect();
    assert_eq!(own.len(), first.len(), "tools of its own kept");
    assert_eq!(own, first, "the first by name, whatever order they came in");
    // The next ones by name are listed hidden, by name alone, saying why; the rest left out.
    let past: Vec<&str> = list
        .tools
        .iter()
        .filter(|t| t.host_only && !t.visible)
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(past.len(), MAX_HOST_ONLY_PAST_LIMIT);
    assert_eq!(past[0], format!("flood_{DEFAULT_MAX_HOST_ONLY_TOOLS:05}"));
    assert_eq!(
        list.tools.len(),
        1 + DEFAULT_MAX_HOST_ONLY_TOOLS + MAX_HOST_ONLY_PAST_LIMIT
    );
    let shipped = list.tools.iter().find(|t| t.name == "t").unwrap();
    assert!(shipped.visible && !shipped.host_only);

    // A call to a tool past the limit is refused, not run: hidden, saying why, or, past the
    // names listed, unknown.
    for (tool, status, says) in [
        (
            "flood_00256",
            CallStatus::Hidden,
            "the host offers 10000 tools of its own, more than this coordinator keeps of one host \
             (--max-host-only-tools 256)",
        ),
        ("flood_09999", CallStatus::UnknownTool, "unknown tool"),
    ] {
        let result = called(&mut api, &id, tool).await;
        assert_eq!(result.status, status as i32, "{result:?}");
        assert!(result.message.contains(says), "{}", result.message);
    }
    // The kept ones rank (once the index has taken the view in); the rest are in no index.
    let find = async |query: &str| {
        let mut api = coordinator.tools(&client("alice")).await;
        let found = api
            .find_tools(FindToolsRequest {
                selector: "all".into(),
                query: query.into(),
                limit: 5,
            })
            .await
            .unwrap()
            .into_inner();
        found
            .matches
            .into_iter()
            .map(|m| m.name)
            .collect::<Vec<_>>()
    };
    let kept = must(
        wait_until("a kept tool in the index", WAIT, async || {
            Some(find("flooding tool number 255").await).filter(|f| !f.is_empty())
        })
        .await,
    );
    assert_eq!(kept[0], "flood_00255", "{kept:?}");
    let left_out = find("flooding tool number 9999").await;
    assert!(left_out.is_empty(), "{left_out:?}");
    drop(agents);
    coordinator.stop().await;
}

/// With `--refuse-host-only-tools`, the tool a compromised agent adds is listed hidden, saying
/// why, ranks for nothing and cannot be called; the shipped tools are offered as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_that_refuses_host_only_tools_offers_only_what_it_ships() {
    let id = fake_id(0);
    let (coordinator, agents, list) = compromised_host(
        &[("t.meta", TOOL)],
        |config| config.host_only.allowed = false,
        Definitions::Forged,
        Answer::Ok,
    )
    .await;
    let mut api = coordinator.tools(&client("alice")).await;
    let own = &list.tools[0];
    assert_eq!(own.name, FORGED_TOOL);
    assert!(!own.visible && own.host_only && own.definition.is_none());
    assert!(
        own.reason.contains("--refuse-host-only-tools"),
        "{}",
        own.reason
    );
    assert!(!own.description.contains("IGNORE"), "{}", own.description);
    assert!(list.tools[1].visible && list.tools[1].name == "t");

    let found = find_forged(&coordinator).await;
    assert!(
        found.matches.iter().all(|m| m.name != FORGED_TOOL),
        "{found:?}"
    );
    let result = called(&mut api, &id, FORGED_TOOL).await;
    assert_eq!(result.status, CallStatus::Hidden as i32, "{result:?}");
    drop(agents);
    coordinator.stop().await;
}
