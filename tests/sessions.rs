//! Sessions with real processes: `toolctl session ...` and the Rust client against a coordinator
//! and two agents that resolve tools differently. autoLoad, load, unload, `maxLoaded` eviction by
//! tier, a `.meta` change and a host going offline reaching a watcher, two sessions independent,
//! another client kept out, idle expiry and close.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::process::Output;
use std::time::Duration;

use serde_json::Value;
use toolsrv_tests::{AgentSpec, Fleet, LineWatch, assert_exit, line_starting, text, wait_for};

/// A fleet of `a` and `b`: `b` has `ROLE_B` set, so `per_host` resolves differently there and
/// `only_b` is visible only there.
fn fleet(coordinator_args: &[&str]) -> Fleet {
    fleet_under(coordinator_args, None)
}

/// [`fleet`], its coordinator following a policy file that says `policy`.
fn fleet_under(coordinator_args: &[&str], policy: Option<&str>) -> Fleet {
    let mut fleet = Fleet::new(&["a", "b"]);
    let tool = |name: &str, body: &str| fleet.tool(&format!("{name}.meta"), body, false);
    tool(
        "pinned",
        r#"{"description": "Always wanted", "cmd": "echo pinned", "tier": "hot"}"#,
    );
    tool(
        "pinned2",
        r#"{"description": "Also always wanted", "cmd": "echo pinned2", "tier": "hot"}"#,
    );
    tool(
        "everyday",
        r#"{"description": "Used all the time", "prompt": "Call me often.", "cmd": "echo everyday"}"#,
    );
    tool(
        "everyday2",
        r#"{"description": "Used a lot too", "cmd": "echo everyday2", "tier": "warm"}"#,
    );
    tool(
        "rare1",
        r#"{"description": "Seldom used", "cmd": "echo rare1", "tier": "cold"}"#,
    );
    tool(
        "rare2",
        r#"{"description": "Seldom used too", "cmd": "echo rare2", "tier": "cold"}"#,
    );
    tool(
        "per_host",
        r#"{"description": "Plain flavour", "cmd": "echo plain",
            "variants": [{"match": {"env": "ROLE_B"}, "description": "B flavour"}, {"match": {}}]}"#,
    );
    tool(
        "only_b",
        r#"{"description": "Only where ROLE_B is set", "cmd": "echo b",
            "variants": [{"match": {"env": "ROLE_B"}}]}"#,
    );
    tool(
        "nowhere",
        r#"{"description": "Needs a binary no host has", "cmd": "echo no",
            "variants": [{"match": {"binary": "no-such-binary-anywhere"}}]}"#,
    );
    let policy = policy.map(|p| fleet.policy_arg(p));
    let mut args = coordinator_args.to_vec();
    args.extend(policy.as_deref());
    fleet.start_coordinator(&args);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.start_agent(
        "b",
        &AgentSpec {
            env: vec![("ROLE_B".into(), "1".into())],
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["a", "b"], "only_b");
    fleet
}

fn profile(fleet: &Fleet, name: &str, json: &str) -> String {
    let path = fleet.work.path().join(name);
    std::fs::write(&path, json).unwrap();
    path.display().to_string()
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: exit {:?}, stderr: {}",
        out.status.code(),
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn open(fleet: &Fleet, args: &[&str]) -> String {
    let mut all = vec!["session", "open"];
    all.extend_from_slice(args);
    let id = ok(&fleet.toolctl(&all), "session open").trim().to_string();
    assert!(
        id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit()),
        "`session open` prints the id alone: {id:?}"
    );
    id
}

fn show(fleet: &Fleet, id: &str) -> Value {
    let out = ok(
        &fleet.toolctl(&["session", "show", id, "--json"]),
        "session show",
    );
    serde_json::from_str(&out).unwrap()
}

fn loaded(state: &Value) -> Vec<String> {
    state["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect()
}

fn tool<'a>(state: &'a Value, name: &str) -> &'a Value {
    state["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("{name} not loaded: {state}"))
}

#[test]
fn a_session_loads_unloads_and_evicts_by_tier() {
    let fleet = fleet(&[]);
    let p = profile(
        &fleet,
        "p.json",
        r#"{"autoLoad": ["pinned", "everyday"], "maxLoaded": 3}"#,
    );
    let id = open(&fleet, &["--profile", &p]);
    let state = show(&fleet, &id);
    assert_eq!(loaded(&state), ["pinned", "everyday"]);
    assert_eq!(state["hosts"], "all");
    assert_eq!(state["maxLoaded"], 3);
    let everyday = tool(&state, "everyday");
    assert_eq!(everyday["autoLoaded"], true);
    assert_eq!(everyday["tier"], "warm", "no tier is warm");
    assert_eq!(everyday["hosts"], serde_json::json!(["a", "b"]));
    let def = &everyday["resolutions"][0]["definition"];
    assert_eq!(def["prompt"], "Call me often.");
    assert_eq!(tool(&state, "pinned")["tier"], "hot");

    // Full: the cold tool goes before the warm one.
    ok(
        &fleet.toolctl(&["session", "load", &id, "rare1"]),
        "load rare1",
    );
    let evicting = fleet.toolctl(&["session", "load", &id, "rare2", "--json"]);
    // What made room is said, as `tool_load` tells a model.
    assert!(
        text(&evicting.stderr).contains("unloaded `rare1` to make room for `rare2` (maxLoaded 3)"),
        "{}",
        text(&evicting.stderr)
    );
    let out = ok(&evicting, "load rare2");
    let state: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(loaded(&state), ["pinned", "everyday", "rare2"]);
    assert_eq!(tool(&state, "rare2")["autoLoaded"], false);

    // No cold tool left but the one just loaded: the least recently used warm one goes.
    ok(
        &fleet.toolctl(&["session", "unload", &id, "rare2"]),
        "unload",
    );
    ok(
        &fleet.toolctl(&["session", "load", &id, "everyday2"]),
        "load everyday2",
    );
    // Loading a loaded tool marks it used: now `everyday2` is the least recently used.
    std::thread::sleep(Duration::from_millis(5));
    ok(
        &fleet.toolctl(&["session", "load", &id, "everyday"]),
        "reload everyday",
    );
    ok(
        &fleet.toolctl(&["session", "load", &id, "rare1"]),
        "load rare1",
    );
    assert_eq!(loaded(&show(&fleet, &id)), ["pinned", "everyday", "rare1"]);

    // Unloading what is not loaded, loading what does not exist or what no host offers.
    let out = fleet.toolctl(&["session", "unload", &id, "rare2"]);
    assert_exit(&out, 127, &["not loaded"]);
    let out = fleet.toolctl(&["session", "load", &id, "no_such_tool"]);
    assert_exit(&out, 127, &["not in the catalog"]);
    let out = fleet.toolctl(&["session", "load", &id, "nowhere"]);
    assert_exit(&out, 69, &["offered by no host", "no-such-binary"]);
    let out = fleet.toolctl(&["session", "load", &id, "../etc/passwd"]);
    assert_exit(&out, 64, &[]);
    assert_eq!(loaded(&show(&fleet, &id)), ["pinned", "everyday", "rare1"]);

    // Only hot tools loaded and full: refused, naming the limit.
    let p = profile(
        &fleet,
        "hot.json",
        r#"{"autoLoad": ["pinned", "pinned2"], "maxLoaded": 2}"#,
    );
    let hot = open(&fleet, &["--profile", &p]);
    let out = fleet.toolctl(&["session", "load", &hot, "everyday"]);
    assert_exit(&out, 69, &["maxLoaded"]);

    // The two sessions are independent.
    assert_eq!(loaded(&show(&fleet, &hot)), ["pinned", "pinned2"]);
    assert_eq!(loaded(&show(&fleet, &id)), ["pinned", "everyday", "rare1"]);

    // With every host offline, a loaded tool keeps the tier its definition gives (the one
    // eviction goes by), rather than showing `warm` while eviction treats it as `hot`.
    let mut fleet = fleet;
    drop(fleet.agents.remove("a"));
    drop(fleet.agents.remove("b"));
    fleet.wait_state("a", "offline", Duration::from_secs(30));
    fleet.wait_state("b", "offline", Duration::from_secs(30));
    let state = show(&fleet, &hot);
    assert_eq!(tool(&state, "pinned")["tier"], "hot", "{state}");
    assert!(tool(&state, "pinned")["unavailable"].is_string(), "{state}");
    assert_eq!(tool(&show(&fleet, &id), "rare1")["tier"], "cold");
    let out = fleet.toolctl(&["session", "load", &hot, "everyday"]);
    assert_exit(&out, 69, &["all of them `hot`"]);
}

#[test]
fn a_session_resolves_tools_per_host_and_is_its_clients_alone() {
    let fleet = fleet(&[]);
    let p = profile(
        &fleet,
        "p.json",
        r#"{"autoLoad": ["per_host", "only_b", "nowhere"], "hosts": "a"}"#,
    );
    // --hosts replaces the profile's selector.
    let id = open(&fleet, &["--profile", &p, "--hosts", "all"]);
    let state = show(&fleet, &id);
    assert_eq!(state["hosts"], "all");
    let per_host = tool(&state, "per_host");
    let resolutions = per_host["resolutions"].as_array().unwrap();
    assert_eq!(resolutions.len(), 2, "two definitions: {per_host}");
    let by_host: Vec<(String, String)> = resolutions
        .iter()
        .map(|r| {
            (
                r["hosts"][0].as_str().unwrap().to_string(),
                r["definition"]["description"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!(
        by_host.contains(&("a".into(), "Plain flavour".into())),
        "{by_host:?}"
    );
    assert!(
        by_host.contains(&("b".into(), "B flavour".into())),
        "{by_host:?}"
    );
    assert_eq!(tool(&state, "only_b")["hosts"], serde_json::json!(["b"]));
    // An autoLoad entry no host offers stays, saying why.
    let nowhere = tool(&state, "nowhere");
    assert_eq!(nowhere["hosts"], serde_json::json!([]));
    assert!(
        nowhere["unavailable"]
            .as_str()
            .unwrap()
            .contains("hidden on a"),
        "{nowhere}"
    );

    // With the profile's selector, only `a`.
    let on_a = open(&fleet, &["--profile", &p]);
    let state = show(&fleet, &on_a);
    assert_eq!(
        state["selected"],
        serde_json::json!([{"host": "a", "state": "online"}])
    );
    assert_eq!(tool(&state, "only_b")["hosts"], serde_json::json!([]));

    // Alice lists her two sessions, sorted by id; bob lists none of them.
    let listed: Value =
        serde_json::from_str(&ok(&fleet.toolctl(&["session", "list", "--json"]), "list")).unwrap();
    let mut ids = vec![id.clone(), on_a.clone()];
    ids.sort();
    let listed_ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed_ids, ids);
    let first = show(&fleet, &ids[0]);
    for field in ["hosts", "selected", "tools", "maxLoaded"] {
        assert_eq!(
            listed[0][field], first[field],
            "as `session show` has it: {field}"
        );
    }
    let text_list = ok(&fleet.toolctl(&["session", "list"]), "list");
    assert!(text_list.starts_with("SESSION"), "{text_list}");
    assert!(text_list.contains(&format!("{id}  all ")), "{text_list}");
    let bobs = fleet.toolctl_as("client-bob", &["session", "list"], None);
    assert_eq!(ok(&bobs, "bob's list"), "(no session)\n");
    let bobs = fleet.toolctl_as("client-bob", &["session", "list", "--json"], None);
    assert_eq!(ok(&bobs, "bob's list"), "[]\n");

    // Bob cannot see, change or close alice's session: it does not exist for him.
    for args in [
        vec!["session", "show", id.as_str()],
        vec!["session", "load", id.as_str(), "pinned"],
        vec!["session", "close", id.as_str()],
    ] {
        let out = fleet.toolctl_as("client-bob", &args, None);
        assert_eq!(
            out.status.code(),
            Some(127),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    // A call made for alice's session by bob is refused and does not run.
    let out = fleet.toolctl_as(
        "client-bob",
        &["session", "show", "x".repeat(100_000).as_str()],
        None,
    );
    assert_exit(&out, 127, &[]);
    assert!(
        text(&out.stderr).len() < 1000,
        "a huge id does not come back whole"
    );
    assert_eq!(
        loaded(&show(&fleet, &id)),
        ["per_host", "only_b", "nowhere"]
    );

    // A bad profile is refused before anything is sent, naming the file and the key.
    let bad = profile(&fleet, "bad.json", r#"{"autoload": ["pinned"]}"#);
    let out = fleet.toolctl(&["session", "open", "--profile", &bad]);
    assert_exit(&out, 64, &["bad.json", "autoload"]);
    let p = profile(&fleet, "big.json", r#"{"maxLoaded": 5000}"#);
    let out = fleet.toolctl(&["session", "open", "--profile", &p]);
    assert_exit(&out, 64, &[]);
    let p = profile(&fleet, "sel.json", r#"{"hosts": "os="}"#);
    let out = fleet.toolctl(&["session", "open", "--profile", &p]);
    assert_exit(&out, 64, &[]);
    // A selector of 4 KiB of odd bytes, within the limit, is refused as a bad argument (exit
    // 64), quoted escaped and cut: quoted whole, twice, the refusal overflowed the client's
    // headers (exit 70, "h2 protocol error").
    let odd = "€".repeat(1365);
    for args in [
        vec!["session", "open", "--hosts", odd.as_str()],
        vec!["find", odd.as_str(), "disk"],
    ] {
        let out = fleet.toolctl(&args);
        assert_exit(&out, 64, &["… (4095 bytes)"]);
        assert!(text(&out.stderr).len() < 1000, "{}", text(&out.stderr));
    }
    // Odd bytes in a selector, a session id or a tool name come back escaped.
    for args in [
        vec!["session", "open", "--hosts", "web\u{1b}[2J"],
        vec!["session", "show", "id\u{1b}[2J"],
        vec!["session", "unload", id.as_str(), "tool\u{1b}[2J"],
    ] {
        let out = fleet.toolctl(&args);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(!stderr.contains('\u{1b}'), "{args:?}: {stderr:?}");
        assert!(stderr.contains(r"\u{1b}[2J"), "{args:?}: {stderr:?}");
    }
}

/// `toolctl session watch ID --json` as alice.
fn watch(fleet: &Fleet, id: &str) -> LineWatch {
    LineWatch::start(fleet.toolctl_command("client-alice", &["session", "watch", id, "--json"]))
}

/// A coordinator shutting down ends its sessions, and their watches: `session watch` says so
/// and exits 75, as `toolctl watch` does. Before, it exited 0 without a word.
#[test]
fn a_watch_ended_by_a_coordinator_shutting_down_is_not_a_success() {
    let mut fleet = fleet(&[]);
    let p = profile(&fleet, "p.json", r#"{"autoLoad": ["everyday"]}"#);
    let id = open(&fleet, &["--profile", &p]);
    let watcher = watch(&fleet, &id);
    watcher.until("the first state", |s| s["id"] == id.as_str());
    fleet.coordinator.as_mut().unwrap().terminate();
    assert_eq!(watcher.end(), Some(75));
}

#[test]
fn a_watcher_sees_loads_meta_edits_and_hosts_going_away() {
    let mut fleet = fleet(&[]);
    let p = profile(&fleet, "p.json", r#"{"autoLoad": ["everyday"]}"#);
    let id = open(&fleet, &["--profile", &p]);
    let watch = watch(&fleet, &id);
    let first = watch.until("first state", |_| true);
    assert_eq!(loaded(&first), ["everyday"]);
    assert_eq!(first["watchers"], 1);
    assert_eq!(first["idleExpiresUnixMs"], 0, "no idle clock while watched");
    let listed = ok(&fleet.toolctl(&["session", "list"]), "list");
    let row = line_starting(&listed, &id);
    assert!(row.ends_with(" 1         watched"), "{row}");

    ok(
        &fleet.toolctl(&["session", "load", &id, "per_host"]),
        "load",
    );
    watch.until("the load", |s| loaded(s) == ["everyday", "per_host"]);

    // A .meta edit of a loaded tool reaches the watcher with the new definition.
    fleet.tool(
        "everyday.meta",
        r#"{"description": "Used all the time, now better", "cmd": "echo everyday"}"#,
        false,
    );
    watch.until("the edited description", |s| {
        tool(s, "everyday")["resolutions"][0]["definition"]["description"]
            == "Used all the time, now better"
    });

    // A call made for the session is not a change worth a message, but it marks the tool used.
    let before = tool(&show(&fleet, &id), "everyday")["lastUsedUnixMs"]
        .as_u64()
        .unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = toolsrv_tests::api_client(&fleet, "client-alice").await;
        let outcome = client
            .call_to_end(toolsrv_client::CallRequest {
                host: "a".into(),
                tool: "everyday".into(),
                session: id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(
            toolsrv_client::is_ok(outcome.result.status),
            "{:?}",
            outcome.result
        );
        // A session that is not the caller's refuses the call before it runs.
        let refused = client
            .call_to_end(toolsrv_client::CallRequest {
                host: "a".into(),
                tool: "everyday".into(),
                session: "0".repeat(32),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::NotFound, "{refused}");
        // A session that does not exist is told apart from a tool the session does not know,
        // both NOT_FOUND, by programs as well as by the words: a client keeping a session for
        // a model opens a new one for the first only.
        let gone = client
            .load_tool(&"0".repeat(32), "everyday")
            .await
            .unwrap_err();
        assert!(gone.session_gone(), "{gone:?}");
        let unknown = client.load_tool(&id, "no_such_tool").await.unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown}");
        assert!(!unknown.session_gone(), "{unknown:?}");
    });
    let after = tool(&show(&fleet, &id), "everyday")["lastUsedUnixMs"]
        .as_u64()
        .unwrap();
    assert!(
        after > before,
        "the call marked the tool used: {before} -> {after}"
    );

    // Host b goes away: the watcher hears that only `a` offers the tools now.
    drop(fleet.agents.remove("b"));
    let state = watch.until("b offline", |s| {
        tool(s, "everyday")["hosts"] == serde_json::json!(["a"])
    });
    assert!(
        state["selected"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!({"host": "b", "state": "offline"})),
        "{state}"
    );

    // Closing the session ends the watch, with the not-found code.
    ok(&fleet.toolctl(&["session", "close", &id]), "close");
    assert_eq!(watch.end(), Some(127));
    let out = fleet.toolctl(&["session", "show", &id]);
    assert_exit(&out, 127, &[]);
}

#[test]
fn a_session_ends_after_the_idle_time_without_a_watcher() {
    let fleet = fleet(&["--session-idle-secs", "2"]);
    let unwatched = open(&fleet, &[]);
    let watched = open(&fleet, &[]);
    let state = show(&fleet, &unwatched);
    assert!(state["idleExpiresUnixMs"].as_u64().unwrap() > 0, "{state}");
    let watch = watch(&fleet, &watched);
    watch.until("first state", |_| true);
    wait_for(
        "the unwatched session to end",
        Duration::from_secs(15),
        || {
            (fleet
                .toolctl(&["session", "show", &unwatched])
                .status
                .code()
                == Some(127))
            .then_some(())
        },
    );
    // Well past the idle time, the watched one lives.
    std::thread::sleep(Duration::from_secs(3));
    ok(
        &fleet.toolctl(&["session", "show", &watched]),
        "watched session",
    );
    // Once its watcher goes, its idle clock starts.
    drop(watch);
    wait_for(
        "the formerly watched session to end",
        Duration::from_secs(15),
        || (fleet.toolctl(&["session", "show", &watched]).status.code() == Some(127)).then_some(()),
    );
}

/// A client holds at most `--max-sessions-per-client` sessions, refused before anything else
/// of the request is examined; a profile's autoLoad has at most 10,000 entries.
#[test]
fn a_client_holds_a_bounded_number_of_sessions() {
    let fleet = fleet(&["--max-sessions-per-client", "2"]);
    let first = open(&fleet, &[]);
    open(&fleet, &[]);
    let out = fleet.toolctl(&["session", "open"]);
    assert_exit(&out, 75, &["--max-sessions-per-client"]);
    // A client at its limit is refused before its profile's names are examined (5,000 of them
    // would be refused as more than maxLoaded, and a million took a second of a runtime thread
    // each time); a profile of 20,000 names is refused before any is, from any client.
    let many = |n: usize| {
        let names: Vec<String> = (0..n).map(|i| format!("\"t{i}\"")).collect();
        format!(r#"{{"autoLoad": [{}]}}"#, names.join(","))
    };
    let five_thousand = profile(&fleet, "5000.json", &many(5_000));
    let out = fleet.toolctl(&["session", "open", "--profile", &five_thousand]);
    assert_exit(&out, 75, &["--max-sessions-per-client"]);
    let twenty_thousand = profile(&fleet, "20000.json", &many(20_000));
    let out = fleet.toolctl_as(
        "client-bob",
        &["session", "open", "--profile", &twenty_thousand],
        None,
    );
    assert_exit(
        &out,
        64,
        &["autoLoad has 20000 entries, over the limit of 10000"],
    );
    // Another client has its own allowance.
    let out = fleet.toolctl_as("client-bob", &["session", "open"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Closing one makes room.
    ok(&fleet.toolctl(&["session", "close", &first]), "close");
    open(&fleet, &[]);
}

/// A session offers its owner only what the policy lets it call: a tool denied on every host is
/// not loaded (saying why), one denied on some hosts lists only the others, and `toolctl find`
/// leaves out the same; another client is offered everything. An edited policy reaches a
/// watcher at once.
/// A session says where the policy makes its owner's calls wait for approval, and by whom;
/// an edited policy reaches its watchers.
#[test]
fn a_session_says_which_calls_wait_for_approval() {
    let fleet = fleet_under(
        &[],
        Some(
            r#"{"rules": [
                {"tools": ["everyday"], "hosts": "b", "effect": "approve", "approvers": ["oncall-*"]},
                {"tools": ["pinned"], "effect": "approve"}]}"#,
        ),
    );
    let p = profile(
        &fleet,
        "p.json",
        r#"{"autoLoad": ["everyday", "pinned", "rare1"]}"#,
    );
    let id = open(&fleet, &["--profile", &p]);
    let state = show(&fleet, &id);
    assert_eq!(
        tool(&state, "everyday")["approvals"],
        serde_json::json!([{"approvers": ["oncall-*"], "hosts": ["b"]}])
    );
    assert_eq!(
        tool(&state, "pinned")["approvals"],
        serde_json::json!([{"approvers": ["caller"], "hosts": ["a", "b"]}])
    );
    assert_eq!(tool(&state, "rare1").get("approvals"), None);
    let table = ok(&fleet.toolctl(&["session", "show", &id]), "show");
    let line = |name: &str| line_starting(&table, name);
    assert!(
        line("everyday").ends_with("Used all the time [waits for approval by oncall-* on b]"),
        "{table}"
    );
    assert!(
        line("pinned").ends_with("Always wanted [waits for approval by you]"),
        "{table}"
    );
    assert!(line("rare1").ends_with("Seldom used"), "{table}");

    // What find ranks says the same before anything is loaded.
    let found = ok(
        &fleet.toolctl(&["find", "all", "used all the time", "--json"]),
        "find",
    );
    let found: Vec<Value> = serde_json::from_str(&found).unwrap();
    let everyday = found.iter().find(|m| m["name"] == "everyday").unwrap();
    assert_eq!(
        everyday["approvals"],
        serde_json::json!([{"approvers": ["oncall-*"], "hosts": ["b"]}]),
        "{found:?}"
    );
    let table = ok(&fleet.toolctl(&["find", "all", "always wanted"]), "find");
    assert!(
        table
            .lines()
            .any(|l| l.contains(" pinned ")
                && l.ends_with("Always wanted [waits for approval by you]")),
        "{table}"
    );
    let found = ok(
        &fleet.toolctl(&["find", "all", "seldom used", "--json"]),
        "find",
    );
    let found: Vec<Value> = serde_json::from_str(&found).unwrap();
    let rare1 = found.iter().find(|m| m["name"] == "rare1").unwrap();
    assert_eq!(rare1.get("approvals"), None, "{found:?}");

    let watcher = watch(&fleet, &id);
    watcher.until("the first state", |v| v["tools"].is_array());
    fleet.replace_policy(r#"{"default": "allow"}"#, 0o644);
    watcher.until("no call waiting for approval", |v| {
        v["tools"]
            .as_array()
            .is_some_and(|tools| tools.iter().all(|t| t.get("approvals").is_none()))
    });
}

#[test]
fn a_session_and_find_offer_only_what_the_policy_lets_the_owner_call() {
    let fleet = fleet_under(
        &[],
        Some(
            r#"{"rules": [
                {"clients": ["alice"], "tools": ["rare1"], "effect": "deny"},
                {"clients": ["alice"], "tools": ["everyday"], "hosts": "b", "effect": "deny"}]}"#,
        ),
    );
    let p = profile(&fleet, "p.json", r#"{"autoLoad": ["everyday"]}"#);
    let id = open(&fleet, &["--profile", &p]);
    let state = show(&fleet, &id);
    assert_eq!(tool(&state, "everyday")["hosts"], serde_json::json!(["a"]));
    let out = fleet.toolctl(&["session", "load", &id, "rare1"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains(
            "denied to you on every host of the session that offers it: policy rule 0 denies \
             client alice calling rare1 on a"
        ),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(loaded(&show(&fleet, &id)), ["everyday"]);

    let find = |stem: &str, query: &str| -> Vec<Value> {
        let out = fleet.toolctl_as(
            stem,
            &["find", "all", query, "--json", "--limit", "20"],
            None,
        );
        serde_json::from_str(&ok(&out, "find")).unwrap()
    };
    let hosts_of = |found: &[Value], name: &str| -> Option<Value> {
        found
            .iter()
            .find(|m| m["name"] == name)
            .map(|m| m["hosts"].clone())
    };
    let alice = find("client-alice", "seldom used");
    assert_eq!(hosts_of(&alice, "rare1"), None, "{alice:?}");
    assert!(hosts_of(&alice, "rare2").is_some(), "{alice:?}");
    let alice = find("client-alice", "used all the time");
    assert_eq!(hosts_of(&alice, "everyday"), Some(serde_json::json!(["a"])));
    let bob = find("client-bob", "seldom used");
    assert_eq!(hosts_of(&bob, "rare1"), Some(serde_json::json!(["a", "b"])));

    // The policy edited: alice is offered everyday on b too, and may load rare1.
    let watcher = watch(&fleet, &id);
    watcher.until("the first state", |v| v["tools"].is_array());
    fleet.replace_policy(r#"{"default": "allow"}"#, 0o644);
    watcher.until("everyday on both hosts", |v| {
        v["tools"][0]["hosts"] == serde_json::json!(["a", "b"])
    });
    ok(
        &fleet.toolctl(&["session", "load", &id, "rare1"]),
        "load rare1",
    );
}

/// A session's state is one message: a load or an open that would take it past 8 MiB is
/// refused before anything changes, naming the limit; a state that grows past it through a
/// `.meta` edit leaves out the definitions of the tool loaded last, saying why, rather than
/// failing every read of the session; a list of sessions past 12 MiB leaves out the largest
/// ones' definitions (`definitionsOmitted`). Before, each of these failed with the transport's
/// OUT_OF_RANGE, some after the change was made.
#[test]
fn a_session_s_state_stays_within_a_message() {
    let mut fleet = Fleet::new(&["a"]);
    // Each tool's definition takes about 200 kB: 41 fit in 8 MiB, 42 do not.
    let big = |fleet: &Fleet, i: usize, prompt_bytes: usize| {
        let prompt = "x".repeat(prompt_bytes);
        fleet.tool(
            &format!("big{i:02}.meta"),
            &format!(
                r#"{{"description": "Big tool {i}", "cmd": "echo {i}", "prompt": "{prompt}"}}"#
            ),
            false,
        );
    };
    for i in 0..45 {
        big(&fleet, i, 200_000);
    }
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "big44");
    let names = |n: usize| -> String {
        (0..n)
            .map(|i| format!("\"big{i:02}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let too_many = profile(
        &fleet,
        "too-many.json",
        &format!(r#"{{"autoLoad": [{}], "maxLoaded": 100}}"#, names(43)),
    );
    let out = fleet.toolctl(&["session", "open", "--profile", &too_many]);
    assert_exit(
        &out,
        69,
        &[
            "the profile's autoLoad would make the session's state",
            "over the 8 MiB a session's state may take",
        ],
    );
    let listed = ok(&fleet.toolctl(&["session", "list", "--json"]), "list");
    assert_eq!(listed.trim(), "[]", "nothing was opened");

    let forty = profile(
        &fleet,
        "forty.json",
        &format!(r#"{{"autoLoad": [{}], "maxLoaded": 100}}"#, names(40)),
    );
    let id = open(&fleet, &["--profile", &forty]);
    ok(
        &fleet.toolctl(&["session", "load", &id, "big40"]),
        "load 41st",
    );
    let out = fleet.toolctl(&["session", "load", &id, "big41"]);
    assert_exit(
        &out,
        69,
        &["loading `big41` would make the session's state"],
    );
    let state = show(&fleet, &id);
    assert_eq!(loaded(&state).len(), 41, "the refused load changed nothing");
    assert!(
        tool(&state, "big40")["unavailable"].is_null(),
        "{}",
        tool(&state, "big40")
    );

    // Five definitions grow by 50 kB each: the state would pass 8 MiB, and the tool loaded last
    // is left out, saying why; the others keep theirs.
    for i in 0..5 {
        big(&fleet, i, 250_000);
    }
    let state = wait_for("the grown definitions", Duration::from_secs(30), || {
        let state = show(&fleet, &id);
        tool(&state, "big40")["unavailable"]
            .as_str()
            .is_some_and(|why| why.contains("left out of the session's state"))
            .then_some(state)
    });
    assert_eq!(loaded(&state).len(), 41);
    assert_eq!(tool(&state, "big40")["resolutions"], serde_json::json!([]));
    let kept = tool(&state, "big00");
    assert_eq!(
        kept["resolutions"][0]["definition"]["prompt"]
            .as_str()
            .map(str::len),
        Some(250_000),
        "big00 keeps its grown definition"
    );

    // Two sessions of some 8 and 6 MB: listed whole they would pass 12 MiB, so the larger is
    // listed without its definitions, the other whole.
    let thirty = profile(
        &fleet,
        "thirty.json",
        &format!(r#"{{"autoLoad": [{}]}}"#, names(30)),
    );
    let other = open(&fleet, &["--profile", &thirty]);
    let listed: Value =
        serde_json::from_str(&ok(&fleet.toolctl(&["session", "list", "--json"]), "list")).unwrap();
    let entry = |id: &str| {
        listed
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == id)
            .unwrap_or_else(|| panic!("{id} not listed"))
            .clone()
    };
    let (larger, smaller) = (entry(&id), entry(&other));
    assert_eq!(larger["definitionsOmitted"], true);
    assert_eq!(loaded(&larger).len(), 41);
    assert_eq!(tool(&larger, "big01")["resolutions"], serde_json::json!([]));
    assert!(smaller["definitionsOmitted"].is_null(), "{}", smaller["id"]);
    assert_eq!(
        tool(&smaller, "big01")["resolutions"][0]["hosts"],
        serde_json::json!(["a"])
    );
}

/// A session's generation never pairs with an older state than one an earlier generation
/// showed: 8 clients read the session while one loads tool after tool (loads only, so the
/// number of tools loaded only grows). Before, a read computing its state while a load finished
/// could take the newer generation for the older list of tools.
#[test]
fn a_session_s_generation_never_goes_with_an_older_state() {
    let fleet = fleet(&[]);
    let files = toolsrv_testkit::stem_files(fleet.pki.root(), "client-alice");
    let url = fleet.url();
    let tools = [
        "pinned",
        "pinned2",
        "everyday",
        "everyday2",
        "rare1",
        "rare2",
        "per_host",
        "only_b",
    ];
    let rounds = toolsrv_tests::runtime().block_on(async {
        let client = toolsrv_client::Client::connect(&toolsrv_client::ConnectOptions {
            addr: url,
            tls: files,
        })
        .await
        .unwrap();
        let mut rounds = 0;
        for _ in 0..30 {
            // Each reader's states and the loader's, checked together.
            let mut round: Vec<(u64, usize)> = Vec::new();
            let id = client
                .open_session(&toolsrv_client::Profile::default(), None)
                .await
                .unwrap()
                .id;
            let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let mut readers = tokio::task::JoinSet::new();
            for _ in 0..8 {
                let (client, id, done) = (client.clone(), id.clone(), done.clone());
                readers.spawn(async move {
                    let mut states = Vec::new();
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        let state = client.session(&id).await.unwrap();
                        states.push((state.generation, state.tools.len()));
                    }
                    states
                });
            }
            for tool in tools {
                let state = client.load_tool(&id, tool).await.unwrap();
                round.push((state.generation, state.tools.len()));
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            while let Some(states) = readers.join_next().await {
                round.extend(states.unwrap());
            }
            client.close_session(&id).await.unwrap();
            for &(g1, n1) in &round {
                for &(g2, n2) in &round {
                    assert!(
                        !(g1 < g2 && n1 > n2),
                        "generation {g1} had {n1} tools, the later {g2} only {n2}"
                    );
                }
            }
            rounds += 1;
        }
        rounds
    });
    assert_eq!(rounds, 30);
}
