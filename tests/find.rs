//! `toolctl find` against a live coordinator and three agents (two alike): tools ranked per selector, the index
//! following `.meta` edits, no match, and bad requests.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::time::Duration;

use serde_json::Value;
use toolsrv_tests::{
    AgentSpec, Fleet, assert_exit, find_model_dir, http_get, mpnet_model_dir, text, wait_for,
};

fn fleet() -> Fleet {
    fleet_with(&[])
}

fn fleet_with(coordinator_args: &[&str]) -> Fleet {
    // a and c are alike (they report the same view), b has a GPU.
    let mut fleet = Fleet::new(&["a", "b", "c"]);
    let tool = |name: &str, body: &str| fleet.tool(&format!("{name}.meta"), body, false);
    tool(
        "disk_usage",
        r#"{"description": "Show disk usage per mounted filesystem", "keywords": ["df", "free space"], "cmd": "df -h"}"#,
    );
    tool(
        "kill_process",
        r#"{"description": "Send a signal to a process by pid", "keywords": ["terminate", "stop"], "cmd": "true"}"#,
    );
    tool(
        "gpu_status",
        r#"{"description": "Show GPU utilisation and memory", "keywords": ["nvidia", "graphics card"], "cmd": "true",
            "variants": [{"match": {"env": "HAS_GPU"}}]}"#,
    );
    fleet.start_coordinator(coordinator_args);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.start_agent(
        "b",
        &AgentSpec {
            env: vec![("HAS_GPU".into(), "1".into())],
            ..AgentSpec::default()
        },
    );
    fleet.start_agent("c", &AgentSpec::default());
    fleet.wait_online(&["a", "b", "c"], "gpu_status");
    fleet
}

/// Adds `n` made-up tools, `widget_0` to `widget_{n-1}`, each with a description and two
/// keyword phrases: a catalog that takes the encoder a while to embed.
fn add_widgets(fleet: &Fleet, n: usize) {
    for i in 0..n {
        fleet.tool(
            &format!("widget_{i}.meta"),
            &format!(
                r#"{{"description": "Check that widget {i} of the assembly line is calibrated", "keywords": ["widget {i}", "calibration {i}"], "cmd": "true"}}"#
            ),
            false,
        );
    }
}

/// `toolctl find ARGS --json`, parsed; exit 1 (nothing matched) must come with `[]`.
fn find(fleet: &Fleet, args: &[&str]) -> Vec<Value> {
    find_saying(fleet, args).0
}

/// As [`find`], with what `toolctl` said on stderr.
fn find_saying(fleet: &Fleet, args: &[&str]) -> (Vec<Value>, String) {
    let mut all = vec!["find"];
    all.extend_from_slice(args);
    all.push("--json");
    let out = fleet.toolctl(&all);
    let found: Vec<Value> = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{all:?}: {e}: {}", text(&out.stderr)));
    let code = if found.is_empty() { 1 } else { 0 };
    assert_eq!(
        out.status.code(),
        Some(code),
        "{all:?}: {}",
        text(&out.stderr)
    );
    (found, text(&out.stderr))
}

/// As [`find`], once the coordinator answers by meaning: while it builds its first ranking it
/// answers by words alone and says so (how long that takes depends on the machine's load).
/// Bounded: 60 s.
fn find_by_meaning(fleet: &Fleet, args: &[&str]) -> Vec<Value> {
    toolsrv_tests::wait_for(
        "an answer ranked by meaning",
        Duration::from_secs(60),
        || {
            let (found, said) = find_saying(fleet, args);
            (!said.contains("ranked by words alone for now")).then_some(found)
        },
    )
}

#[test]
fn find_ranks_the_tools_of_the_selected_hosts() {
    let fleet = fleet();
    let found = find(&fleet, &["all", "how much free space is left on the disk"]);
    assert_eq!(found[0]["name"], "disk_usage", "{found:?}");
    assert_eq!(found[0]["hosts"], serde_json::json!(["a", "b", "c"]));
    assert_eq!(
        found[0]["description"],
        "Show disk usage per mounted filesystem"
    );
    let score = found[0]["score"].as_f64().unwrap();
    assert!(score > 0.0 && score <= 1.0, "{score}");
    assert!(found[0]["lexical"].as_f64().is_some(), "{found:?}");

    // The GPU tool is offered by b only: ranked for b, absent for a.
    let on_b = find(&fleet, &["b", "graphics card memory"]);
    assert_eq!(on_b[0]["name"], "gpu_status", "{on_b:?}");
    assert_eq!(on_b[0]["hosts"], serde_json::json!(["b"]));
    let on_a = find(&fleet, &["a", "graphics card memory"]);
    assert!(on_a.iter().all(|m| m["name"] != "gpu_status"), "{on_a:?}");
    let everywhere = find(&fleet, &["all", "graphics card memory"]);
    assert_eq!(everywhere[0]["name"], "gpu_status", "{everywhere:?}");
    assert_eq!(everywhere[0]["hosts"], serde_json::json!(["b"]));
    let alike = find(&fleet, &["c", "how much free space is left on the disk"]);
    assert_eq!(alike[0]["hosts"], serde_json::json!(["c"]), "{alike:?}");

    // --limit bounds the answer; best first.
    let one = find(&fleet, &["all", "show", "--limit", "1"]);
    assert!(one.len() <= 1, "{one:?}");

    // Nothing matching: an empty array and exit 1; in text, a line on stderr.
    assert_eq!(find(&fleet, &["all", "zyxxy qwvvq"]), Vec::<Value>::new());
    let out = fleet.toolctl(&["find", "all", "zyxxy qwvvq"]);
    assert_exit(&out, 1, &[]);
    assert!(out.stdout.is_empty());
    assert!(
        text(&out.stderr).contains("no tool"),
        "{}",
        text(&out.stderr)
    );

    // The text table.
    let out = fleet.toolctl(&["find", "all", "terminate a process"]);
    let table = text(&out.stdout);
    assert!(table.starts_with("SCORE"), "{table}");
    assert!(
        table.lines().nth(1).unwrap().contains("kill_process"),
        "{table}"
    );
}

#[test]
fn the_index_follows_meta_edits() {
    let fleet = fleet();
    let before = find(&fleet, &["all", "certificate expiry"]);
    assert!(
        before.iter().all(|m| m["name"] != "kill_process"),
        "{before:?}"
    );
    fleet.tool(
        "kill_process.meta",
        r#"{"description": "Report when a TLS certificate expires", "cmd": "true"}"#,
        false,
    );
    wait_for(
        "the edited tool to be found",
        Duration::from_secs(30),
        || {
            let found = find(&fleet, &["all", "certificate expiry"]);
            (found.first().map(|m| m["name"].clone()) == Some("kill_process".into())).then_some(())
        },
    );
}

#[test]
fn bad_requests_are_refused_before_ranking() {
    let fleet = fleet();
    let long = "disk ".repeat(1000);
    for args in [
        vec!["find", "all", ""],
        vec!["find", "all", "disk", "--limit", "0"],
        vec!["find", "all", "disk", "--limit", "5000"],
        vec!["find", "all", long.as_str()],
        vec!["find", "os=", "disk"],
    ] {
        let out = fleet.toolctl(&args);
        assert_eq!(
            out.status.code(),
            Some(64),
            "{:?}: {}",
            &args[..3],
            text(&out.stderr)
        );
    }
    // Odd bytes and a query of punctuation only: an answer, never a failure.
    assert_eq!(
        find(&fleet, &["all", "?!…\u{1}\u{7f}"]),
        Vec::<Value>::new()
    );
}

/// With `--find-model` the coordinator ranks by meaning too: a request sharing no word with the
/// tool finds it, with a semantic score.
#[test]
fn with_either_encoder_a_request_in_other_words_finds_its_tool() {
    for model in [find_model_dir(), mpnet_model_dir()] {
        other_words_find_their_tool(&model);
    }
}

fn other_words_find_their_tool(model: &std::path::Path) {
    let fleet = fleet_with(&["--find-model", model.to_str().unwrap()]);
    let found = find_by_meaning(&fleet, &["all", "is the storage nearly exhausted"]);
    assert_eq!(found[0]["name"], "disk_usage", "{found:?}");
    assert!(found[0]["semantic"].as_f64().unwrap() > 0.0, "{found:?}");
    let found = find(&fleet, &["all", "end the runaway job with pid 4412"]);
    assert_eq!(found[0]["name"], "kill_process", "{found:?}");
}

/// Embedding a changed catalog takes a while: requests meanwhile are answered from the last
/// index (for the tools visible now), and the new tools are found once it is rebuilt.
#[test]
fn while_a_changed_catalog_is_embedded_requests_are_answered_from_the_last_index() {
    const ADDED: usize = 400;
    let model = find_model_dir();
    let fleet = fleet_with(&["--find-model", model.to_str().unwrap()]);
    let found = find_by_meaning(&fleet, &["all", "is the storage nearly exhausted"]);
    assert_eq!(found[0]["name"], "disk_usage", "{found:?}");

    add_widgets(&fleet, ADDED);
    let docs = format!("docs={}", ADDED + 3);
    let log = || fleet.coordinator.as_ref().unwrap().log();
    let saw = |log: &str, what: &str| log.lines().any(|l| l.contains(what) && l.contains(&docs));
    wait_for(
        "a rebuild with the new tools to start",
        Duration::from_secs(60),
        || saw(&log(), "rebuilding the tool index").then_some(()),
    );
    let found = find(&fleet, &["all", "is the storage nearly exhausted"]);
    assert!(
        !saw(&log(), "tool index rebuilt"),
        "the request was answered after the rebuild, not during it: {}",
        log()
    );
    assert_eq!(found[0]["name"], "disk_usage", "{found:?}");
    assert!(
        found
            .iter()
            .all(|m| !m["name"].as_str().unwrap().starts_with("widget_"))
    );

    wait_for(
        "the new tools to be found",
        Duration::from_secs(300),
        || {
            let found = find(&fleet, &["all", "calibration of widget 7"]);
            (found.first().map(|m| m["name"].clone()) == Some("widget_7".into())).then_some(())
        },
    );
    assert!(saw(&log(), "tool index rebuilt"), "{}", log());
}

/// The first build with an encoder embeds every text (minutes for a large catalog with the
/// larger model and nothing kept): requests meanwhile are answered at once by words alone, then
/// by meaning once it is done.
#[test]
fn before_the_first_build_with_an_encoder_is_done_requests_are_ranked_by_words() {
    // Enough texts that their first embedding takes well over the 2 s a request waits for it,
    // on a machine several times as fast as this one (about 6 ms a text here).
    const TOOLS: usize = 2000;
    let model = find_model_dir();
    let mut fleet = Fleet::new(&["a"]);
    add_widgets(&fleet, TOOLS);
    fleet.start_coordinator(&["--find-model", model.to_str().unwrap()]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "widget_7");
    let log = || fleet.coordinator.as_ref().unwrap().log();
    const BY_MEANING: &str = "FindTools ranks by meaning from now on";

    let (found, said) = find_saying(&fleet, &["all", "calibration of widget 7"]);
    assert!(
        !log().contains(BY_MEANING),
        "answered after the first build, not during it: {}",
        log()
    );
    assert_eq!(found[0]["name"], "widget_7", "{found:?}");
    assert!(found[0]["semantic"].is_null(), "by words alone: {found:?}");
    // And the user is told, so that a poor answer to a paraphrase is not taken as final.
    assert!(said.contains("ranked by words alone for now"), "{said}");
    assert_eq!(
        found[0]["description"], "Check that widget 7 of the assembly line is calibrated",
        "{found:?}"
    );

    let said = wait_for(
        "requests to be ranked by meaning",
        Duration::from_secs(300),
        || {
            let (found, said) = find_saying(&fleet, &["all", "calibration of widget 7"]);
            found[0]["semantic"].is_number().then_some(said)
        },
    );
    assert!(log().contains(BY_MEANING), "{}", log());
    assert!(!said.contains("words alone"), "{said}");
}

/// With no tool on any host there is nothing a ranking by meaning would find either: an answer
/// before the first build over the fleet's tools does not say that more may come.
#[test]
fn with_no_tool_at_all_the_answer_promises_nothing_more_by_meaning() {
    let model = find_model_dir();
    let mut fleet = Fleet::new(&["a"]);
    fleet.start_coordinator(&["--find-model", model.to_str().unwrap()]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_state("a", "online", Duration::from_secs(30));
    let (found, said) = find_saying(&fleet, &["all", "free space on the disk"]);
    assert!(found.is_empty(), "{found:?}");
    assert!(!said.contains("words alone"), "{said}");
}

/// With `--state-dir` the vectors of the tools' texts outlive the coordinator: restarted, it
/// embeds nothing it had embedded before, and ranks as it did.
#[test]
fn a_restarted_coordinator_embeds_only_texts_it_has_not_seen() {
    let model = find_model_dir();
    let state = tempfile::tempdir().unwrap();
    let args = [
        "--find-model".to_string(),
        model.display().to_string(),
        format!("--state-dir={}", state.path().display()),
        "--metrics-listen=127.0.0.1:0".to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut fleet = fleet_with(&args);
    let request = ["all", "is the storage nearly exhausted"];
    let before = find_by_meaning(&fleet, &request);
    assert_eq!(before[0]["name"], "disk_usage", "{before:?}");
    let kept: Vec<_> = std::fs::read_dir(state.path().join("find-vectors"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");

    fleet.coordinator.as_mut().unwrap().stop();
    fleet.start_coordinator(&args);
    fleet.wait_online(&["a", "b", "c"], "gpu_status");
    let after = find_by_meaning(&fleet, &request);
    toolsrv_tests::assert_same_ranking(&Value::from(after), &Value::from(before));
    let log = fleet.coordinator.as_ref().unwrap().log();
    let line = log
        .lines()
        .find(|l| l.contains("tool index built from the vectors kept by an earlier run"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains("embedded=0"), "{line}");
    let metrics = fleet.coordinator.as_ref().unwrap().metrics_addr();
    let (_, exposition) = http_get(&metrics, "/metrics").unwrap();
    let texts = |source: &str| {
        let series = format!("toolsrv_find_index_texts_total{{source=\"{source}\"}} ");
        exposition
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{series}in\n{exposition}"))
    };
    assert!(texts("kept") > 0.0, "{exposition}");
    assert_eq!(texts("embedded"), 0.0, "{exposition}");
}

#[test]
fn a_coordinator_with_an_unusable_model_directory_refuses_to_start() {
    // Run to its exit, not "until it listens": a port found free may be someone else's by then.
    let fleet = toolsrv_tests::Fleet::new(&["a"]);
    let dir = fleet.work.path().join("not-a-model");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), "{}").unwrap();
    let mut cmd = std::process::Command::new(toolsrv_tests::bin("toolsrv"));
    cmd.arg("coordinator")
        .arg("--listen=127.0.0.1:0")
        .arg(format!(
            "--tools={}",
            fleet.work.path().join("tools").display()
        ))
        .args(fleet.pki.tls_args("coordinator"))
        .args(["--find-model", dir.to_str().unwrap()]);
    let out = toolsrv_tests::run_bounded(cmd, None, Duration::from_secs(20));
    assert!(
        !out.status.success(),
        "the coordinator must not start without its model"
    );
    let text = text(&out.stderr);
    assert!(
        text.contains("--find-model")
            && text.contains("not-a-model")
            && text.contains("model.safetensors"),
        "the error names the flag, the directory and the missing file: {text}"
    );
}

/// One client may have 8 FindTools requests in progress at once: of 24 long requests sent
/// together once the index of 400 tools is built, those that come while eight of hers are
/// being encoded are refused at once with RESOURCE_EXHAUSTED naming the limit, the others are
/// answered, and bob, another client, is not held back by her.
#[test]
fn one_client_may_have_eight_requests_in_progress() {
    requests_in_progress_are_limited_per_client(None);
}

/// `--max-finds-per-client` sets that limit.
#[test]
fn max_finds_per_client_sets_the_limit() {
    requests_in_progress_are_limited_per_client(Some(3));
}

fn requests_in_progress_are_limited_per_client(flag: Option<usize>) {
    const TOOLS: usize = 400;
    const SENT: usize = 24;
    let limit = flag.unwrap_or(8);
    let model = find_model_dir();
    let mut fleet = Fleet::new(&["a"]);
    add_widgets(&fleet, TOOLS);
    let flag = flag.map(|n| n.to_string());
    let mut args = vec!["--find-model", model.to_str().unwrap()];
    if let Some(n) = &flag {
        args.extend(["--max-finds-per-client", n]);
    }
    fleet.start_coordinator(&args);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "widget_0");

    let rt = tokio::runtime::Runtime::new().unwrap();
    let (alice, bob) = rt.block_on(async {
        toolsrv_tls::install_crypto_provider();
        let connect = |name: &str| {
            let options = toolsrv_client::ConnectOptions {
                addr: fleet.url(),
                tls: toolsrv_testkit::stem_files(fleet.pki.root(), name),
            };
            async move { toolsrv_client::Client::connect(&options).await.unwrap() }
        };
        let (alice, bob) = (connect("client-alice").await, connect("client-bob").await);
        // Once the index holds the fleet's tools and ranks by meaning, so that no answer comes
        // from an earlier one, or by words alone, while a build is under way (as the
        // coordinator answers meanwhile).
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
        loop {
            let found = bob.find_tools("all", "calibration of widget 7", 3).await;
            if found.is_ok_and(|f| {
                f.matches
                    .first()
                    .is_some_and(|m| m.name == "widget_7" && m.semantic_score.is_some())
            }) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "widget_7 never found"
            );
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        // A long request (about 500 tokens, cut to what the encoder reads) takes it a while, so
        // that many of hers are in progress at once: a short one is answered in milliseconds.
        let long = "calibration of widget 7 ".repeat(100);
        let mut sent = tokio::task::JoinSet::new();
        for _ in 0..SENT {
            let (alice, long) = (alice.clone(), long.clone());
            sent.spawn(async move { alice.find_tools("all", &long, 3).await });
        }
        let bob = bob.find_tools("all", "calibration of widget 7", 3).await;
        (sent.join_all().await, bob)
    });
    let log = || fleet.coordinator.as_ref().unwrap().log();
    assert!(
        log().contains("tool index rebuilt"),
        "the requests waited for the first index: {}",
        log()
    );
    let refused: Vec<String> = alice
        .iter()
        .filter_map(|r| r.as_ref().err())
        .map(|e| {
            assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
            e.to_string()
        })
        .collect();
    // How many of the 24 find as many of hers in progress as the limit depends on how fast the
    // client sends them (a debug build sends slowly): at least one does, and at least the limit
    // are answered.
    assert!(
        !refused.is_empty() && refused.len() <= SENT - limit,
        "{} refused: {refused:?}",
        refused.len()
    );
    let named = format!("at once ({limit}, the coordinator's --max-finds-per-client)");
    assert!(refused[0].contains(&named), "{refused:?}");
    for found in alice.iter().filter_map(|r| r.as_ref().ok()) {
        assert_eq!(found.matches[0].name, "widget_7");
    }
    assert_eq!(bob.unwrap().matches[0].name, "widget_7");
}

/// A host whose own tools keep changing (a compromised agent, or a script rewriting its tools
/// directory) cannot keep the coordinator's encoder busy: once it has spent its texts of the
/// hour (`--max-host-only-embeds-per-hour`), its new tools are left out of FindTools, still
/// listed and callable, and the coordinator says so once; another host's new tool of its own
/// and the catalog's tools are found as before.
#[test]
fn a_host_whose_own_tools_keep_changing_cannot_keep_the_encoder_busy() {
    const PER_HOUR: usize = 40;
    const TOOLS: usize = 10;
    let model = find_model_dir();
    let mut fleet = Fleet::new(&["a", "b"]);
    fleet.tool(
        "disk_usage.meta",
        r#"{"description": "Show disk usage per mounted filesystem", "keywords": ["df", "free space"], "cmd": "df -h"}"#,
        false,
    );
    let per_hour = PER_HOUR.to_string();
    fleet.start_coordinator(&[
        "--find-model",
        model.to_str().unwrap(),
        "--max-host-only-embeds-per-hour",
        &per_hour,
        "--metrics-listen=127.0.0.1:0",
    ]);
    // One text each (a summary, no keyword phrases): a round of edits costs a's budget TOOLS.
    let churn = |round: usize| -> Vec<(String, String)> {
        (0..TOOLS)
            .map(|i| {
                let meta = format!(
                    r#"{{"description": "Rotate flux capacitor number {i}, revision {round}", "cmd": "true"}}"#
                );
                (format!("churn_{i}"), meta)
            })
            .collect()
    };
    let first = churn(0);
    let first: Vec<(&str, &String)> = first.iter().map(|(n, m)| (n.as_str(), m)).collect();
    fleet.start_agent("a", &AgentSpec::own_tools(&first));
    fleet.start_agent(
        "b",
        &AgentSpec::own_tools(&[(
            "polish_telescope",
            r#"{"description": "Polish the brass telescope on the roof", "cmd": "true"}"#,
        )]),
    );
    fleet.wait_online(&["a", "b"], "disk_usage");
    let metric = |name: &str| -> f64 {
        let coordinator = fleet.coordinator.as_ref().unwrap();
        coordinator
            .metric(name)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no number for {name} in the coordinator's metrics"))
    };
    // The first embedding of every host's tools is done when a answers by meaning.
    let found = find_by_meaning(&fleet, &["a", "turn the flux capacitor"]);
    assert!(
        found[0]["name"].as_str().unwrap().starts_with("churn_"),
        "{found:?}"
    );

    // Rewrite a's tools, round after round, until a build leaves all of them out (a few rounds
    // past 40 texts; each round waited for, so that no round goes unembedded).
    let dir = fleet.work.path().join("host-a/local-tools");
    let mut round = 0;
    while metric("toolsrv_find_index_deferred") < TOOLS as f64 {
        round += 1;
        assert!(
            round <= 3 * PER_HOUR / TOOLS,
            "round {round}: a is never stopped"
        );
        for (name, meta) in churn(round) {
            std::fs::write(dir.join(format!("{name}.meta")), meta).unwrap();
        }
        let revision = format!("revision {round}");
        wait_for(
            &format!("round {round} on a"),
            Duration::from_secs(30),
            || {
                let tools = fleet.tools("a")?;
                let listed = tools.iter().filter(|t| {
                    t["description"]
                        .as_str()
                        .is_some_and(|d| d.contains(&revision))
                });
                (listed.count() == TOOLS).then_some(())
            },
        );
        wait_for(
            &format!("the index after round {round}"),
            Duration::from_secs(30),
            || {
                let deferred = metric("toolsrv_find_index_deferred");
                let embedded = metric(r#"toolsrv_find_index_texts_total{source="embedded"}"#);
                // Either a's new texts are in, or some were left out.
                let whole = embedded >= (3 + 1 + TOOLS * (round + 1)) as f64;
                (deferred > 0.0 || whole).then_some(())
            },
        );
    }
    // What the encoder took of a: its first round and the budget's 40 texts, not a round more
    // (the catalog's disk_usage is 3 texts, b's tool 1; a text refills every 90 s).
    let embedded = metric(r#"toolsrv_find_index_texts_total{source="embedded"}"#);
    assert!(
        embedded <= (3 + 1 + PER_HOUR + 1) as f64,
        "{embedded} texts embedded in {round} rounds"
    );
    assert!(round >= PER_HOUR / TOOLS, "{round}");

    // a's tools are offered and callable, and not found: neither by meaning nor by words.
    let (found, _) = find_saying(&fleet, &["a", "rotate flux capacitor number 3"]);
    assert!(
        found
            .iter()
            .all(|m| !m["name"].as_str().unwrap().starts_with("churn_")),
        "{found:?}"
    );
    let out = fleet.toolctl(&["call", "a", "churn_3"]);
    assert_exit(&out, 0, &[]);
    let log = fleet.coordinator.as_ref().unwrap().log();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("--max-host-only-embeds-per-hour"))
        .collect();
    assert_eq!(said.len(), 1, "said once, whatever the rounds after: {log}");
    assert!(
        said[0].contains("host=a") && said[0].contains("of them are left out"),
        "{}",
        said[0]
    );

    // b's budget is its own: a new tool of b's is found by meaning, and so is the catalog's.
    std::fs::write(
        fleet
            .work
            .path()
            .join("host-b/local-tools/feed_parrot.meta"),
        r#"{"description": "Give the parrot in the lobby its seeds", "cmd": "true"}"#,
    )
    .unwrap();
    wait_for("b's new tool found", Duration::from_secs(30), || {
        let (found, _) = find_saying(&fleet, &["b", "the bird downstairs is hungry"]);
        (found.first()?["name"] == "feed_parrot").then_some(())
    });
    let found = find_by_meaning(&fleet, &["all", "is the storage nearly exhausted"]);
    assert_eq!(found[0]["name"], "disk_usage", "{found:?}");
}
