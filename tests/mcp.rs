//! `toolctl mcp` driven by a client nobody here wrote: the Python `mcp` package (2.3.0) against a
//! live coordinator and agents, over stdio (both protocol revisions) and streamable HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use toolsrv_tests::{AgentSpec, Fleet, Venv, assert_exit, free_port, run_bounded, text, wait_for};

/// The `mcp` package version these tests hold `toolctl mcp` to.
const MCP_PACKAGE: &str = "mcp==2.3.0";

/// A Python with the `mcp` package: `$TOOLSRV_TEST_MCP_PYTHON`, or a virtualenv under
/// `target/` created on first use (once per test process: parallel pip installs into one new
/// virtualenv break each other).
fn python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON.get_or_init(python_once).clone()
}

fn python_once() -> PathBuf {
    Venv {
        env_override: "TOOLSRV_TEST_MCP_PYTHON",
        dir: "mcp-venv",
        packages: &[MCP_PACKAGE],
        check: "import importlib.metadata as m; assert m.version('mcp') == '2.3.0'",
    }
    .python()
}

/// `toolctl mcp ARGS` as alice, as the Python client starts it: `{"command", "args", "env"}`.
fn server_config(fleet: &Fleet, args: &[&str]) -> Value {
    let cmd = fleet.toolctl_command("client-alice", args);
    let mut env = serde_json::Map::new();
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            env.insert(k.to_string_lossy().into(), v.to_string_lossy().into());
        }
    }
    env.insert("TOOLCTL_LOG".into(), "info".into());
    json!({
        "command": cmd.get_program().to_string_lossy(),
        "args": cmd.get_args().map(|a| a.to_string_lossy()).collect::<Vec<_>>(),
        "env": env,
    })
}

/// Runs a scenario of `tests/python/mcp_client.py` and returns what it printed.
fn scenario(name: &str, config: &Value) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/mcp_client.py");
    let mut cmd = Command::new(python());
    cmd.arg(script).arg(name).arg(config.to_string());
    let out = run_bounded(cmd, None, Duration::from_secs(120));
    assert!(
        out.status.success(),
        "scenario {name} failed: {}\n{}",
        text(&out.stderr),
        text(&out.stdout)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "scenario {name} printed no JSON ({e}): {}",
            text(&out.stdout)
        )
    })
}

/// The one text of a tool result.
fn result_text(result: &Value) -> String {
    result["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["text"].as_str())
        .collect::<Vec<_>>()
        .join("")
}

/// The description of the tool `name` in a scenario's `tools`.
fn description<'a>(out: &'a Value, name: &str) -> &'a str {
    out["tools"]
        .as_array()
        .and_then(|tools| tools.iter().find(|t| t["name"] == name))
        .and_then(|t| t["description"].as_str())
        .unwrap_or_else(|| panic!("no tool `{name}` listed: {out}"))
}

fn profile(fleet: &Fleet, body: &Value) -> PathBuf {
    let path = fleet.work.path().join("profile.json");
    std::fs::write(&path, body.to_string()).unwrap();
    path
}

/// A tool with every model-facing field.
const GREET: &str = r###"{"description": "Greets someone", "prompt": "## Greeting\n\nSay hello to `name`.",
    "args": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    "tier": "hot", "scope": "host", "outputFormat": "text", "resetsCounter": false,
    "cmd": "jq -r '\"hello \" + .name'"}"###;

/// One host, `a`, with the tools the single-host scenarios use.
fn one_host_fleet(extra: &[&str]) -> Fleet {
    let mut fleet = Fleet::new(&["a"]);
    let marks = fleet.marks();
    fleet.tool("greet.meta", GREET, false);
    fleet.tool(
        "jsonout.meta",
        r#"{"description": "Prints a JSON object", "cmd": "echo '{\"answer\": 42}'"}"#,
        false,
    );
    fleet.tool(
        "fail.meta",
        r#"{"description": "Always fails", "cmd": "echo broken >&2; exit 3"}"#,
        false,
    );
    fleet.tool(
        "slow.meta",
        r#"{"description": "Prints three lines slowly",
            "cmd": "for i in 1 2 3; do echo line $i; sleep 0.4; done"}"#,
        false,
    );
    fleet.tool(
        "sleeper.meta",
        &format!(
            r#"{{"description": "Writes its pid and sleeps",
                "cmd": "echo $$ > {}/sleeper.pid; exec sleep 300"}}"#,
            marks.display()
        ),
        false,
    );
    fleet.tool(
        "extra.meta",
        r#"{"description": "Loaded on request", "prompt": "Extra documentation.", "cmd": "echo extra"}"#,
        false,
    );
    fleet.start_coordinator(extra);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "extra");
    fleet
}

fn one_host_profile(fleet: &Fleet) -> PathBuf {
    profile(
        fleet,
        &json!({"autoLoad": ["greet", "jsonout", "fail", "slow", "sleeper"], "hosts": "a"}),
    )
}

fn check_basics(out: &Value, edited: &str) {
    let tools = out["tools"].as_array().unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "tool_search",
            "tool_load",
            "greet",
            "jsonout",
            "fail",
            "slow",
            "sleeper"
        ]
    );
    let greet = &tools[2];
    assert_eq!(
        greet["description"],
        "Greets someone\n\n## Greeting\n\nSay hello to `name`."
    );
    assert_eq!(greet["title"], "Greeting");
    assert_eq!(
        greet["inputSchema"]["required"],
        json!(["name"]),
        "one host: no host argument"
    );
    assert_eq!(
        greet["_meta"],
        json!({"toolsrv/tier": "hot", "toolsrv/scope": "host", "toolsrv/outputFormat": "text",
               "toolsrv/resetsCounter": false, "toolsrv/hosts": ["a"]})
    );
    assert_eq!(tools[3]["inputSchema"], json!({"type": "object"}));

    assert_eq!(result_text(&out["greet"]), "hello world\n");
    assert_eq!(out["greet"]["isError"], false);
    assert_eq!(out["jsonout"]["structuredContent"], json!({"answer": 42}));
    assert_eq!(out["fail"]["isError"], true, "{}", out["fail"]);
    assert!(
        result_text(&out["fail"]).contains("broken"),
        "{}",
        out["fail"]
    );

    assert_eq!(result_text(&out["slow"]), "line 1\nline 2\nline 3\n");
    let progress = out["progress"].as_array().unwrap();
    let messages: Vec<&str> = progress
        .iter()
        .filter_map(|p| p["message"].as_str())
        .collect();
    assert_eq!(messages, ["line 1", "line 2", "line 3"], "{progress:?}");
    let values: Vec<f64> = progress
        .iter()
        .map(|p| p["progress"].as_f64().unwrap())
        .collect();
    assert!(
        values.windows(2).all(|w| w[0] < w[1]),
        "progress must grow: {values:?}"
    );

    assert_eq!(result_text(&out["load"]), "Extra documentation.");
    assert_eq!(out["load_changed"], true, "no list_changed after tool_load");
    assert!(
        out["after_load"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n == "extra")
    );
    assert_eq!(
        out["load_unknown"]["isError"], true,
        "{}",
        out["load_unknown"]
    );
    assert!(result_text(&out["load_unknown"]).contains("no_such_tool"));

    assert_eq!(
        out["edit_changed"], true,
        "no list_changed after the .meta edit"
    );
    assert!(
        out["edited"][0]["description"]
            .as_str()
            .unwrap()
            .starts_with(edited),
        "{}",
        out["edited"]
    );
}

#[test]
fn stdio_serves_tools_calls_progress_and_changes_in_both_revisions() {
    let fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    let greet = |description: &str| {
        json!({"description": description, "args": {"type": "object"}, "cmd": "echo hi"})
            .to_string()
    };
    for (mode, protocol, edited) in [
        ("auto", "2026-07-28", "Greets, edited for the new revision"),
        (
            "legacy",
            "2025-11-25",
            "Greets, edited for the old revision",
        ),
    ] {
        // Each run starts from the original greet.
        fleet.tool("greet.meta", GREET, false);
        wait_for("the original greet", Duration::from_secs(20), || {
            fleet
                .tools("a")
                .filter(|t| t.iter().any(|e| e["description"] == "Greets someone"))
        });
        let mut config = server_config(&fleet, &["mcp", "--profile", profile.to_str().unwrap()]);
        config["mode"] = json!(mode);
        config["edit_path"] = json!(fleet.tools.join("greet.meta"));
        config["edit_content"] = json!(greet(edited));
        let out = scenario("basics", &config);
        assert_eq!(out["protocol"], protocol);
        check_basics(&out, edited);
    }
}

#[test]
fn cancelling_a_call_kills_its_process_on_the_host() {
    let fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    for mode in ["auto", "legacy"] {
        let pid_file = fleet.marks().join("sleeper.pid");
        let _ = std::fs::remove_file(&pid_file);
        let mut config = server_config(&fleet, &["mcp", "--profile", profile.to_str().unwrap()]);
        config["mode"] = json!(mode);
        config["pid_file"] = json!(pid_file);
        let out = scenario("cancel", &config);
        assert_eq!(out["timed_out"], false, "{out}");
        assert_eq!(out["after"], true, "{out}");
        let pid = out["pid"].as_i64().unwrap();
        wait_for(
            &format!("the cancelled call's process {pid} to end ({mode})"),
            Duration::from_secs(10),
            || {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                // Gone, or a zombie nobody has reaped yet: either way it no longer runs.
                (stat.is_empty() || stat.contains(") Z ")).then_some(())
            },
        );
    }
}

/// A coordinator that dies mid-call leaves the model an error result that says what is known:
/// the connection broke, and whether the tool finished is not known. Before, the model read
/// "failed: h2 protocol error: ... https://docs.rs/rustls/...", and nothing of whether it ran.
/// Once the coordinator is back the same server calls again.
#[test]
fn a_coordinator_lost_mid_call_is_told_to_the_model_as_such() {
    let mut fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    let pid_file = fleet.marks().join("sleeper.pid");
    let mut mcp = toolsrv_tests::McpStdio::start(
        fleet.toolctl_command(
            "client-alice",
            &["mcp", "--profile", profile.to_str().unwrap()],
        ),
        fleet.work.path().join("mcp.stderr"),
    );
    // A tool the model loads: the session the restart takes with it had it.
    let loaded = mcp.request(
        "tools/call",
        json!({"name": "tool_load", "arguments": {"name": "extra"}}),
    );
    assert_eq!(loaded["result"]["isError"], false, "{loaded}");
    let id = mcp.send_request("tools/call", json!({"name": "sleeper", "arguments": {}}));
    wait_for("the tool to start", Duration::from_secs(30), || {
        pid_file.exists().then_some(())
    });
    fleet.coordinator.as_mut().unwrap().kill();
    let answer = mcp.answer(id);
    assert_eq!(answer["result"]["isError"], true, "{answer}");
    let said = result_text(&answer["result"]);
    assert!(
        said.starts_with(
            "the connection to the coordinator broke during the call of `sleeper` on host `a`"
        ) && said.contains("whether the tool finished is not known"),
        "{said}"
    );
    assert!(said.len() < 600, "{} bytes: {said}", said.len());

    // The coordinator comes back before the host does: the new session is opened while no
    // host offers `extra` (its load then was refused, and the tool lost for good).
    fleet.agents.remove("a");
    fleet.start_coordinator(&[]);
    wait_for("a new session", Duration::from_secs(60), || {
        mcp.stderr().contains("opened session").then_some(())
    });
    assert!(
        mcp.stderr().contains(
            "the tools the last one had loaded: greet, jsonout, fail, slow, sleeper, extra"
        ),
        "{}",
        mcp.stderr()
    );
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "greet");
    wait_for("`extra` offered again", Duration::from_secs(60), || {
        let listed = mcp.request("tools/list", json!({}));
        let names = listed["result"]["tools"].as_array()?.clone();
        names.iter().any(|t| t["name"] == "extra").then_some(())
    });
    let called = wait_for("a call after the restart", Duration::from_secs(60), || {
        let answer = mcp.request(
            "tools/call",
            json!({"name": "greet", "arguments": {"name": "b"}}),
        );
        if answer["result"]["isError"] == false {
            return Some(answer);
        }
        std::thread::sleep(Duration::from_millis(500));
        None
    });
    assert_eq!(result_text(&called["result"]).trim(), "hello b", "{called}");
}

/// On a session of several hosts, a tool with an argument of its own named `target_host` could
/// never be called (the server's host argument replaced it): it is not offered, and `tool_load`
/// says why and leaves the session as it was, loading again what the load unloaded to make room
/// (before, a full session silently lost a tool). `toolctl lint` warns its author.
#[test]
fn a_tool_clients_could_not_call_is_neither_offered_nor_loaded() {
    let mut fleet = Fleet::new(&["a", "b"]);
    let clash = r#"{"description": "Pings a target host over the network",
        "args": {"type": "object", "properties": {"target_host": {"type": "string"}}},
        "cmd": "cat"}"#;
    fleet.tool("ping_target.meta", clash, false);
    fleet.tool("greet.meta", GREET, false);
    fleet.tool(
        "plain.meta",
        r#"{"description": "Warm, so unloaded to make room", "cmd": "echo plain"}"#,
        false,
    );
    let lint = fleet.toolctl(&[
        "lint",
        fleet.tools.join("ping_target.meta").to_str().unwrap(),
    ]);
    assert!(
        text(&lint.stdout).contains("args.properties.target_host")
            && text(&lint.stdout).contains("rename the argument"),
        "{}",
        text(&lint.stdout)
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.start_agent("b", &AgentSpec::default());
    fleet.wait_online(&["a", "b"], "ping_target");
    // Full: loading another tool unloads `plain` to make room (`greet` is `hot`).
    let profile = profile(
        &fleet,
        &json!({"autoLoad": ["greet", "plain"], "hosts": "all", "maxLoaded": 2}),
    );
    let mut mcp = toolsrv_tests::McpStdio::start(
        fleet.toolctl_command(
            "client-alice",
            &["mcp", "--profile", profile.to_str().unwrap()],
        ),
        fleet.work.path().join("mcp.stderr"),
    );
    let loaded = mcp.request(
        "tools/call",
        json!({"name": "tool_load", "arguments": {"name": "ping_target"}}),
    );
    assert_eq!(loaded["result"]["isError"], true, "{loaded}");
    assert!(
        result_text(&loaded["result"]).starts_with(
            "cannot load `ping_target`: MCP clients cannot be offered it: it has an argument \
             `target_host` of its own"
        ) && result_text(&loaded["result"])
            .ends_with("Its load had unloaded `plain` to make room: loaded again"),
        "{loaded}"
    );
    let listed = mcp.request("tools/list", json!({}));
    let names: Vec<&str> = listed["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(
        names,
        ["tool_search", "tool_load", "greet", "plain"],
        "{listed}"
    );
    let id = mcp
        .stderr()
        .lines()
        .find_map(|l| l.strip_prefix("toolctl mcp: session "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_string();
    let shown = fleet.toolctl(&["session", "show", &id, "--json"]);
    let state: Value = serde_json::from_slice(&shown.stdout).unwrap();
    let loaded: Vec<&str> = state["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(loaded, ["greet", "plain"], "taken out again: {state}");
}

#[test]
fn tool_search_returns_structured_matches() {
    let fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    let mut config = server_config(&fleet, &["mcp", "--profile", profile.to_str().unwrap()]);
    config["query"] = json!("greet someone by name");
    let out = scenario("search", &config);
    let search = &out["search"];
    assert_eq!(search["isError"], false, "{search}");
    let results = search["structuredContent"]["results"].as_array().unwrap();
    assert!(!results.is_empty() && results.len() <= 3, "{search}");
    for r in results {
        assert!(r["name"].is_string() && r["description"].is_string(), "{r}");
        assert!(
            r["score"].as_f64().is_some_and(|s| s > 0.0 && s <= 1.0),
            "{r}"
        );
        assert!(
            r["hosts"].as_array().unwrap().iter().all(|h| h == "a"),
            "{r}"
        );
        // The profile's tools are loaded already: the model is told so, not to load them.
        let auto = r["name"] != "extra";
        assert_eq!(r.get("loaded"), auto.then_some(&json!(true)), "{r}");
    }
    assert_eq!(results[0]["name"], "greet", "{search}");
    assert!(
        result_text(search).starts_with("greet (loaded, score "),
        "{search}"
    );
}

/// Tools a host serves from its own directory reach the model marked as the host's word: in the
/// tool list (description and `_meta`), in `tool_search` and in what `tool_load` returns.
#[test]
fn a_host_only_tool_is_offered_to_the_model_as_the_host_s_word() {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool("greet.meta", GREET, false);
    fleet.start_coordinator(&[]);
    let own = |description: &str| {
        format!(
            r#"{{"description": "{description}", "prompt": "Use it whenever asked.", "cmd": "echo own"}}"#
        )
    };
    let spec = AgentSpec::own_tools(&[
        ("rotate_keys", own("Rotate the host keys")),
        ("wipe_cache", own("Wipe the package cache")),
    ]);
    fleet.start_agent("a", &spec);
    fleet.wait_online(&["a"], "wipe_cache");
    let profile = profile(
        &fleet,
        &json!({"autoLoad": ["greet", "rotate_keys"], "hosts": "a"}),
    );
    let mut config = server_config(&fleet, &["mcp", "--profile", profile.to_str().unwrap()]);
    config["query"] = json!("wipe the package cache");
    config["load"] = json!("wipe_cache");
    let out = scenario("host_only", &config);

    let tool = |name: &str| {
        out["tools"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {}", out["tools"]))
            .clone()
    };
    let rotate = tool("rotate_keys");
    let description = rotate["description"].as_str().unwrap();
    assert!(
        description.starts_with("[Host-only tool: not from the fleet's tool catalog.")
            && description.contains("host `a`")
            && description.ends_with("Rotate the host keys\n\nUse it whenever asked."),
        "{rotate}"
    );
    assert_eq!(rotate["_meta"]["toolsrv/hostOnly"], true, "{rotate}");
    let greet = tool("greet");
    assert!(
        greet["description"]
            .as_str()
            .unwrap()
            .starts_with("Greets someone"),
        "{greet}"
    );
    assert!(greet["_meta"].get("toolsrv/hostOnly").is_none(), "{greet}");

    let results = out["search"]["structuredContent"]["results"]
        .as_array()
        .unwrap();
    let wipe = results
        .iter()
        .find(|r| r["name"] == "wipe_cache")
        .unwrap_or_else(|| panic!("{}", out["search"]));
    assert_eq!(wipe["hostOnly"], true, "{wipe}");
    assert!(
        results
            .iter()
            .filter(|r| r["name"] != "wipe_cache" && r["name"] != "rotate_keys")
            .all(|r| r.get("hostOnly").is_none()),
        "{results:?}"
    );
    assert!(
        result_text(&out["search"]).contains("wipe_cache [host-only:"),
        "{}",
        out["search"]
    );

    assert_eq!(out["load"]["isError"], false, "{}", out["load"]);
    let loaded = result_text(&out["load"]);
    assert!(
        loaded.starts_with("[Host-only tool:") && loaded.ends_with("Use it whenever asked."),
        "{loaded}"
    );
}

/// What a careless or hostile model might send: each request is answered on its own, as an
/// error result naming what is wrong (a tool that does not exist is a protocol error, as MCP
/// wants), nothing it sent comes back unbounded, and the server goes on serving the session.
#[test]
fn hostile_requests_get_error_results_and_the_server_goes_on() {
    let fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    let config = server_config(&fleet, &["mcp", "--profile", profile.to_str().unwrap()]);
    let out = scenario("hostile", &config);
    let says = |key: &str, needles: &[&str]| {
        let result = &out[key];
        assert_eq!(result["isError"], true, "{key}: {result}");
        let text = result_text(result);
        for needle in needles {
            assert!(text.contains(needle), "{key}: {needle:?} not in {text:?}");
        }
        // Nothing the model sent comes back whole: a 200 KB name or 2 MiB argument is not
        // echoed into the model's context.
        assert!(text.len() < 2048, "{key}: {} bytes of text", text.len());
    };
    says("long_query", &["4096"]);
    says("bad_limit", &["`limit`", "whole number"]);
    says("negative_limit", &["`limit`", "whole number"]);
    says("fractional_limit", &["`limit`", "whole number"]);
    assert_eq!(
        out["float_limit"]["isError"], false,
        "2.0 is a whole number: {}",
        out["float_limit"]
    );
    says("no_query", &["`query` is required"]);
    says("odd_load", &["cannot load"]);
    says("huge_load", &["cannot load"]);
    says("number_load", &["`name` is required"]);
    says("wrong_type", &["invalid_args"]);
    says("missing_arg", &["invalid_args"]);
    says("huge_arg", &["1048576"]);
    let odd = &out["odd_arg"];
    assert_eq!(
        odd["isError"], false,
        "odd bytes are the tool's business: {odd}"
    );
    assert!(
        out["unknown"]["protocolError"]
            .as_str()
            .is_some_and(|e| e.contains("no_such_tool")),
        "{}",
        out["unknown"]
    );
    assert_eq!(out["after"]["isError"], false, "{}", out["after"]);
    assert_eq!(result_text(&out["after"]).trim(), "hello still here");
}

#[test]
fn several_hosts_take_a_host_argument_kept_current() {
    let mut fleet = Fleet::new(&["a", "b", "c"]);
    fleet.tool(
        "where.meta",
        r#"{"description": "Says where it runs", "variants": [{"match": {"binary": "whereami"}}],
            "cmd": "whereami"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    for host in ["a", "b", "c"] {
        let mut spec = AgentSpec::default();
        if host != "c" {
            spec.binaries = vec![("whereami".into(), format!("#!/bin/sh\necho on {host}\n"))];
        }
        fleet.start_agent(host, &spec);
    }
    fleet.wait_online(&["a", "b", "c"], "where");
    let profile = profile(&fleet, &json!({"autoLoad": ["where"], "hosts": "all"}));
    let mut config = server_config(&fleet, &["mcp", "--profile", profile.to_str().unwrap()]);
    config["calls"] = json!({
        "on_b": {"target_host": "b"},
        "on_c": {"target_host": "c"},
        "no_host": {},
        "elsewhere": {"target_host": "z"},
        "huge_host": {"target_host": "h".repeat(20_000)},
        "object_host": {"target_host": {"name": "x".repeat(20_000)}},
    });
    let out = scenario("multihost", &config);
    let tool = &out["tools"][2];
    assert_eq!(tool["name"], "where");
    let schema = &tool["inputSchema"];
    assert_eq!(schema["required"], json!(["target_host"]));
    assert_eq!(
        schema["properties"]["target_host"]["enum"],
        json!(["a", "b"])
    );
    assert!(schema["properties"]["target_host"]["description"].is_string());
    assert_eq!(result_text(&out["on_b"]), "on b\n");
    for (call, needle) in [
        ("on_c", "hidden"),
        ("no_host", "target_host"),
        ("elsewhere", "not one of"),
        ("huge_host", "not one of"),
        ("object_host", "must be a host name"),
    ] {
        assert_eq!(out[call]["isError"], true, "{call}: {}", out[call]);
        let text = result_text(&out[call]);
        assert!(text.contains(needle), "{call}: {}", out[call]);
        // What the model sent is not echoed back whole into its context.
        assert!(text.len() < 1024, "{call}: {} bytes", text.len());
    }

    // Host b goes away: the enum follows, and a call naming it is an error result.
    fleet.agents.get_mut("b").unwrap().stop();
    fleet.wait_state("b", "offline", Duration::from_secs(20));
    config["mode"] = json!("legacy");
    config["calls"] = json!({"on_b": {"target_host": "b"}, "on_a": {"target_host": "a"}});
    let out = scenario("multihost", &config);
    assert_eq!(
        out["tools"][2]["inputSchema"]["properties"]["target_host"]["enum"],
        json!(["a"])
    );
    assert_eq!(out["on_b"]["isError"], true, "{}", out["on_b"]);
    assert!(
        result_text(&out["on_b"]).contains("offline"),
        "{}",
        out["on_b"]
    );
    assert_eq!(result_text(&out["on_a"]), "on a\n");
}

/// Host `a` offering `tools`, each printing `<tool> ran`, its coordinator following `policy`.
fn fleet_under(tools: &[&str], policy: &str) -> Fleet {
    let mut fleet = Fleet::new(&["a"]);
    for tool in tools {
        fleet.tool(
            &format!("{tool}.meta"),
            &format!(r#"{{"description": "{tool}", "cmd": "echo {tool} ran"}}"#),
            false,
        );
    }
    let policy = fleet.policy_arg(policy);
    fleet.start_coordinator(&[&policy]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], tools[0]);
    fleet
}

#[test]
fn approvals_become_elicitations() {
    let fleet = fleet_under(
        &["restart", "drop_table"],
        r#"{"default": "allow", "rules": [
            {"tools": ["restart"], "effect": "approve"},
            {"tools": ["drop_table"], "effect": "approve", "approvers": ["bob"]}]}"#,
    );
    let profile = profile(
        &fleet,
        &json!({"autoLoad": ["restart", "drop_table"], "hosts": "a"}),
    );
    let base = server_config(&fleet, &["mcp", "--profile", profile.to_str().unwrap()]);

    for mode in ["auto", "legacy"] {
        let mut config = base.clone();
        config["mode"] = json!(mode);
        config["tool"] = json!("restart");
        config["answer"] = json!(true);
        let out = scenario("approve", &config);
        assert_eq!(
            result_text(&out["result"]),
            "restart ran\n",
            "{mode}: {out}"
        );
        // Told beforehand that the user is asked, in the tool list and in what a search finds.
        assert!(
            description(&out, "restart").ends_with(
                "[Approval: each call of this tool waits until the user approves it: the user \
                 is asked through this client when you call it; if the user declines, the call \
                 is denied.]"
            ),
            "{mode}: {out}"
        );
        assert_eq!(
            out["search"]["structuredContent"]["results"][0]["approvals"],
            json!([{"approvers": ["caller"], "hosts": ["a"]}]),
            "{mode}: {out}"
        );
        assert!(
            result_text(&out["load"]).ends_with("if the user declines, the call is denied.]"),
            "{mode}: {out}"
        );
        let asked = &out["elicitations"][0];
        assert_eq!(asked["mode"], "form", "{mode}: {out}");
        let message = asked["message"].as_str().unwrap();
        assert!(
            message.contains("restart") && message.contains("`a`"),
            "{message}"
        );
        assert_eq!(
            asked["requestedSchema"]["properties"]["approve"]["type"],
            "boolean"
        );

        config["answer"] = json!(false);
        let out = scenario("approve", &config);
        assert_eq!(out["result"]["isError"], true, "{mode}: {out}");
        assert!(
            result_text(&out["result"]).starts_with("denied"),
            "{mode}: {out}"
        );

        // A client without elicitation: told beforehand that such calls are denied, and
        // denied, saying why.
        config.as_object_mut().unwrap().remove("answer");
        let out = scenario("approve", &config);
        let told = "needs the user's approval, which this client cannot ask for (it does not \
                    support MCP elicitation), so such calls are denied";
        assert!(description(&out, "restart").contains(told), "{mode}: {out}");
        assert!(result_text(&out["search"]).contains(told), "{mode}: {out}");
        assert!(result_text(&out["load"]).contains(told), "{mode}: {out}");
        assert_eq!(out["result"]["isError"], true, "{mode}: {out}");
        assert!(out["elicitations"].as_array().unwrap().is_empty());
        assert!(
            result_text(&out["result"]).contains("elicitation is unsupported"),
            "{out}"
        );
    }

    // Only bob may decide drop_table: the client is told it waits, and bob approves.
    let mut config = base.clone();
    config["tool"] = json!("drop_table");
    config["answer"] = json!(true);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/mcp_client.py");
    let child = Command::new(python())
        .arg(script)
        .arg("approve")
        .arg(config.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let id = wait_for(
        "drop_table's approval request",
        Duration::from_secs(30),
        || {
            let out = fleet.toolctl_as("client-bob", &["approvals", "--json"], None);
            let list: Vec<Value> = serde_json::from_slice(&out.stdout).ok()?;
            list.first()
                .and_then(|r| r["id"].as_str().map(String::from))
        },
    );
    let out = fleet.toolctl_as("client-bob", &["approve", &id], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = toolsrv_tests::finish_child(child, Duration::from_secs(60));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(result_text(&out["result"]), "drop_table ran\n", "{out}");
    assert!(out["elicitations"].as_array().unwrap().is_empty(), "{out}");
    let progress = out["progress"].as_array().unwrap();
    assert!(
        progress.iter().any(|m| m
            .as_str()
            .is_some_and(|m| m.contains("waiting for approval by bob"))),
        "{out}"
    );
}

/// A 2026-07-28 client comes back for a call that waits for approval with the wrong tool's
/// name: refused, and the call still waits (before, the call was taken, then dropped, and the
/// right answer found nothing); the right answer then runs it.
#[test]
fn a_resume_naming_another_tool_leaves_the_waiting_call() {
    use std::io::Write;
    let fleet = fleet_under(
        &["restart", "other"],
        r#"{"default": "allow", "rules": [{"tools": ["restart"], "effect": "approve"}]}"#,
    );
    let profile = profile(
        &fleet,
        &json!({"autoLoad": ["restart", "other"], "hosts": "a"}),
    );
    let (mut child, mut stdin, rx) = stdio_server(&fleet, &profile);
    let meta = json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}},
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
    });
    let mut ask = |id: u64, params: Value| -> Value {
        let request = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params});
        writeln!(stdin, "{request}").unwrap();
        stdin.flush().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = rx
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no answer to {id}"));
            let message: Value = serde_json::from_str(&line).unwrap();
            if message["id"] == id {
                return message;
            }
        }
    };
    let started = ask(
        1,
        json!({"name": "restart", "arguments": {}, "_meta": meta}),
    );
    let state = started["result"]["requestState"]
        .as_str()
        .unwrap_or_else(|| panic!("no requestState: {started}"))
        .to_string();
    let approve = json!({"approval": {"action": "accept", "content": {"approve": true}}});
    let wrong = ask(
        2,
        json!({"name": "other", "arguments": {}, "_meta": meta,
               "requestState": state, "inputResponses": approve}),
    );
    let message = wrong["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("belongs to a call of `restart`, not of `other`")
            && message.contains("still waits"),
        "{wrong}"
    );
    let right = ask(
        3,
        json!({"name": "restart", "arguments": {}, "_meta": meta,
               "requestState": state, "inputResponses": approve}),
    );
    assert_eq!(result_text(&right["result"]), "restart ran\n", "{right}");
    drop(stdin);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn streamable_http_serves_on_loopback_only_unless_told() {
    let fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    let profile = profile.to_str().unwrap();

    let out = fleet.toolctl(&["mcp", "--profile", profile, "--http", "0.0.0.0:0"]);
    assert_exit(&out, 64, &["--http-allow-remote"]);
    let out = fleet.toolctl(&[
        "mcp",
        "--profile",
        profile,
        "--http",
        "127.0.0.1:0",
        "--http-no-auth",
        "--http-token-file",
        "x",
    ]);
    assert_exit(&out, 64, &["cannot be used with"]);

    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let command = fleet.toolctl_command(
        "client-alice",
        &["mcp", "--profile", profile, "--http", &addr],
    );
    let mut server = toolsrv_tests::Proc::spawn("mcp-http", command, fleet.work.path());
    let token = wait_for(
        "the MCP HTTP server to listen",
        Duration::from_secs(20),
        || bearer_in(&server.log()),
    );
    assert_eq!(token.len(), 64, "{}", server.log());
    for mode in ["auto", "legacy"] {
        let config = json!({"url": format!("http://{addr}/mcp"), "mode": mode, "token": token});
        let out = scenario("http", &config);
        assert!(
            out["tools"]
                .as_array()
                .unwrap()
                .iter()
                .any(|n| n == "greet"),
            "{out}"
        );
        assert_eq!(result_text(&out["greet"]), "hello http\n", "{mode}: {out}");
    }
    // Loopback keeps other machines out, not other users of this one: without the token (or
    // with a wrong one, or one a byte short) a request is refused before MCP sees it.
    let last = if token.ends_with('0') { '1' } else { '0' };
    let wrong = format!("{}{last}", &token[..63]);
    for authorization in [None, Some(wrong.as_str()), Some(&token[..63])] {
        let (status, head) = initialize_over_http(&addr, authorization);
        assert_eq!(status, 401, "{authorization:?}: {head}");
        assert!(head.contains("www-authenticate: Bearer"), "{head}");
    }
    assert_eq!(initialize_over_http(&addr, Some(&token)).0, 200);
    // A web page of another site (a name of its own resolved to 127.0.0.1: DNS rebinding) is
    // refused, token or not; a page served from loopback is not.
    for origin in ["http://evil.example", "http://evil.example:{port}", "null"] {
        let origin = format!(
            "Origin: {}\r\n",
            origin.replace("{port}", &port.to_string())
        );
        let (status, head) = initialize_over_http_with(&addr, Some(&token), &origin);
        assert_eq!(status, 403, "{origin}: {head}");
    }
    for origin in [format!("http://localhost:{port}"), format!("http://{addr}")] {
        let header = format!("Origin: {origin}\r\n");
        let (status, head) = initialize_over_http_with(&addr, Some(&token), &header);
        assert_eq!(status, 200, "{origin}: {head}");
    }
    // Exits on SIGTERM, closing its session.
    let log = server.log();
    let id = log
        .split("toolctl mcp: session ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no session id in the log: {log}"))
        .to_string();
    let out = fleet.toolctl(&["session", "show", &id]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        server.terminate().is_some_and(|s| s.success()),
        "{}",
        server.log()
    );
    let out = fleet.toolctl(&["session", "show", &id]);
    assert_eq!(
        out.status.code(),
        Some(127),
        "the session outlived toolctl mcp: {}",
        text(&out.stdout)
    );
}

/// Connections that never present the token (another user of the machine may open them: the
/// token refuses their requests, not their connections) are few and short-lived: they cannot
/// take the server's file descriptors, a client with the token gets in meanwhile, and a
/// connection that presented it is kept.
#[test]
fn streamable_http_holds_few_connections_that_never_present_the_token() {
    use std::io::Read;
    let fleet = one_host_fleet(&[]);
    let (server, addr, token) = http_server(&fleet, &one_host_profile(&fleet));
    let pid = server.pid();
    let descriptors = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    // A hundred descriptors to spare, no more.
    let base = descriptors();
    let limit = (base + 100).to_string();
    let mut prlimit = Command::new("prlimit");
    prlimit.args([format!("--pid={pid}"), format!("--nofile={limit}:{limit}")]);
    let out = run_bounded(prlimit, None, Duration::from_secs(10));
    assert!(out.status.success(), "prlimit: {}", text(&out.stderr));

    // A connection that presents the token, then stays idle past a stranger's lifetime.
    let mut kept = std::net::TcpStream::connect(&addr).unwrap();
    // MCP's answer to a GET without a session: past the token's check (which would say 401).
    let (status, head) = exchange(&mut kept, &addr, &token);
    assert_eq!(status, 400, "{head}");

    // 400 connections that send nothing.
    let to: std::net::SocketAddr = addr.parse().unwrap();
    let idle: Vec<std::net::TcpStream> = (0..400)
        .map(|i| {
            std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("connection {i}: not accepted: {e}"))
        })
        .collect();
    // A client with the token is served meanwhile.
    assert_eq!(initialize_over_http(&addr, Some(&token)).0, 200);
    wait_for(
        "the server to hold at most 64 of them",
        Duration::from_secs(20),
        || (descriptors() <= base + 64 + 8).then_some(()),
    );
    let closed = |stream: &std::net::TcpStream| {
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        match (&*stream).read(&mut [0u8; 16]) {
            Ok(0) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
            Ok(_) => false,
        }
    };
    assert!(closed(&idle[0]), "the oldest stranger is still open");
    let log = server.log();
    assert_eq!(
        log.matches("connections are open that have not presented the bearer token")
            .count(),
        1,
        "{log}"
    );
    // After their lifetime (10 s) the newest are closed too, and the descriptors are back.
    wait_for(
        "the newest strangers to be closed",
        Duration::from_secs(30),
        || closed(&idle[399]).then_some(()),
    );
    wait_for("the descriptors back", Duration::from_secs(10), || {
        (descriptors() <= base + 8).then_some(())
    });
    // The trusted connection is still served.
    let (status, head) = exchange(&mut kept, &addr, &token);
    assert_eq!(status, 400, "{head}");
    drop(idle);
}

/// A burst of clients with the token, each on a new connection, all get in: the server holds
/// few connections that have sent nothing, not few that wait for their request to be read.
/// Before, past 64 connections not yet read, each new one closed the oldest, and from 7 to 240
/// of 400 such requests were reset.
#[test]
fn streamable_http_lets_a_burst_of_clients_with_the_token_in() {
    let fleet = one_host_fleet(&[]);
    let (_server, addr, token) = http_server(&fleet, &one_host_profile(&fleet));
    const CLIENTS: usize = 200;
    let start = std::sync::Arc::new(std::sync::Barrier::new(CLIENTS));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (addr, token, start) = (addr.clone(), token.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                std::panic::catch_unwind(|| initialize_over_http(&addr, Some(&token)).0)
                    .unwrap_or(0)
            })
        })
        .collect();
    let statuses: Vec<u16> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let refused = statuses.iter().filter(|s| **s != 200).count();
    assert_eq!(
        refused, 0,
        "{refused} of {CLIENTS} not served: {statuses:?}"
    );
}

/// `toolctl mcp --profile PROFILE --http` on a free loopback port, as alice: the server, its
/// address and the bearer token it printed.
fn http_server(fleet: &Fleet, profile: &Path) -> (toolsrv_tests::Proc, String, String) {
    http_server_with(fleet, profile, &[])
}

/// [`http_server`] with more flags.
fn http_server_with(
    fleet: &Fleet,
    profile: &Path,
    extra: &[&str],
) -> (toolsrv_tests::Proc, String, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut args = vec![
        "mcp",
        "--profile",
        profile.to_str().unwrap(),
        "--http",
        &addr,
    ];
    args.extend_from_slice(extra);
    let command = fleet.toolctl_command("client-alice", &args);
    let server = toolsrv_tests::Proc::spawn("mcp-http", command, fleet.work.path());
    let token = wait_for(
        "the MCP HTTP server to listen",
        Duration::from_secs(20),
        || bearer_in(&server.log()),
    );
    (server, addr, token)
}

/// `toolctl mcp --profile PROFILE` over stdio, as alice: the process, its stdin, and its stdout
/// line by line (read by a thread, so that every wait can be bounded).
fn stdio_server(
    fleet: &Fleet,
    profile: &Path,
) -> (
    std::process::Child,
    std::process::ChildStdin,
    std::sync::mpsc::Receiver<String>,
) {
    use std::io::BufRead;
    let mut child = fleet
        .toolctl_command(
            "client-alice",
            &["mcp", "--profile", profile.to_str().unwrap()],
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, stdin, rx)
}

/// One `GET /mcp` with the token on `stream`, kept open: the status and the response head.
fn exchange(stream: &mut std::net::TcpStream, addr: &str, token: &str) -> (u16, String) {
    use std::io::{BufRead, BufReader, Read, Write};
    let request = format!(
        "GET /mcp HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\
         Authorization: Bearer {token}\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reader = BufReader::new(&*stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status: {head:?}"));
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or_else(|| panic!("no content-length: {head:?}"));
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    (status, head)
}

/// The bearer token `toolctl mcp --http` printed, once it listens.
fn bearer_in(log: &str) -> Option<String> {
    if !log.contains("serving MCP on") {
        return None;
    }
    let rest = log.split("Authorization: Bearer ").nth(1)?;
    Some(rest.split('`').next()?.to_string())
}

/// POSTs an MCP `initialize` to `http://ADDR/mcp` by hand, with `Authorization: Bearer TOKEN`
/// when given: the status, and the response head in lowercase (header values as sent).
fn initialize_over_http(addr: &str, token: Option<&str>) -> (u16, String) {
    initialize_over_http_with(addr, token, "")
}

/// [`initialize_over_http`] with more header lines (`Name: value\r\n` each).
fn initialize_over_http_with(addr: &str, token: Option<&str>, headers: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}"#;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let request = format!(
        "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\n{auth}{headers}Content-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status: {head:?}"));
    let head = head
        .lines()
        .map(|l| match l.split_once(':') {
            Some((k, v)) => format!("{}:{v}", k.to_ascii_lowercase()),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    (status, head)
}

/// A 2025-11-25 HTTP client that drops its connection mid-call, with neither `DELETE` nor a
/// cancellation, leaves its session idle: `--http-session-idle-secs` later the session ends,
/// and the call with it, its process on the host killed. Before, the call ran to the tool's end
/// (up to an hour) and held its place in the caller's quota, and the session lived 5 minutes;
/// then it ran 5 seconds past the bound, while the SDK waited for it to answer.
#[test]
fn an_abandoned_http_session_ends_its_calls_once_idle() {
    use std::io::Write;
    let fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    let (_server, addr, token) =
        http_server_with(&fleet, &profile, &["--http-session-idle-secs", "2"]);
    let (status, head) = initialize_over_http(&addr, Some(&token));
    assert_eq!(status, 200, "{head}");
    let session = head
        .lines()
        .find_map(|l| l.strip_prefix("mcp-session-id:"))
        .unwrap_or_else(|| panic!("no session id: {head}"))
        .trim()
        .to_string();
    let post = |body: &str| {
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        let request = format!(
            "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Accept: application/json, text/event-stream\r\nAuthorization: Bearer {token}\r\n\
             Mcp-Session-Id: {session}\r\nMCP-Protocol-Version: 2025-11-25\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).unwrap();
        stream
    };
    drop(post(
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
    ));
    let pid_file = fleet.marks().join("sleeper.pid");
    let call = post(
        r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"sleeper","arguments":{}}}"#,
    );
    let pid = wait_for("the tool to start", Duration::from_secs(30), || {
        std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
    });
    let dropped = std::time::Instant::now();
    drop(call);
    wait_for(
        "the abandoned call's process to end",
        Duration::from_secs(30),
        || (!Path::new(&format!("/proc/{pid}")).exists()).then_some(()),
    );
    // Within the idle bound (2 s since the call came in), and some time to kill it; not 5 s
    // later, as when the SDK waited for the call to answer before it cancelled it.
    let took = dropped.elapsed();
    assert!(
        took < Duration::from_millis(4500),
        "the abandoned call ended {took:?} after the client dropped it"
    );
}

/// A client that opens a session per request and never closes it cannot pile them up: past
/// 256 the oldest is closed (its requests then get 404, as for an ended session), and the
/// newest serve.
#[test]
fn streamable_http_keeps_a_bounded_number_of_sessions() {
    use std::io::{Read, Write};
    let fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    let (server, addr, token) = http_server(&fleet, &profile);
    let sessions: Vec<String> = (0..260)
        .map(|_| {
            let (status, head) = initialize_over_http(&addr, Some(&token));
            assert_eq!(status, 200, "{head}");
            head.lines()
                .find_map(|l| l.strip_prefix("mcp-session-id:"))
                .unwrap_or_else(|| panic!("no session id: {head}"))
                .trim()
                .to_string()
        })
        .collect();
    // The status of one request in `session`.
    let status_in = |session: &str, body: &str| -> u16 {
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let request = format!(
            "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Accept: application/json, text/event-stream\r\nAuthorization: Bearer {token}\r\n\
             Mcp-Session-Id: {session}\r\nMCP-Protocol-Version: 2025-11-25\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).unwrap();
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).unwrap();
        String::from_utf8_lossy(&head[9..12]).parse().unwrap()
    };
    let initialized = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
    let list = r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#;
    assert_eq!(
        status_in(&sessions[0], list),
        404,
        "{}",
        server.log_tail(20)
    );
    assert_eq!(status_in(&sessions[3], list), 404);
    let newest = &sessions[259];
    assert_eq!(status_in(newest, initialized), 202);
    assert_eq!(status_in(newest, list), 200);
    // Ended by its client: 204, which clients take for success (the official Python client
    // logged 202 as a failed termination); then it is gone.
    let delete = |session: &str| -> u16 {
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let request = format!(
            "DELETE /mcp HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
             Mcp-Session-Id: {session}\r\nMCP-Protocol-Version: 2025-11-25\r\n\
             Connection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).unwrap();
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).unwrap();
        String::from_utf8_lossy(&head[9..12]).parse().unwrap()
    };
    assert_eq!(delete(&sessions[258]), 204);
    assert_eq!(status_in(&sessions[258], list), 404);
    assert!(
        server
            .log()
            .contains("too many MCP sessions: closing the oldest")
    );
}

/// `--http-token-file`: the token is made there, owner-only, and taken from there on the next
/// run; a file others may read is refused.
#[test]
fn streamable_http_keeps_its_token_in_a_private_file() {
    use std::os::unix::fs::PermissionsExt;
    let fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    let profile = profile.to_str().unwrap();
    let token_file = fleet.work.path().join("mcp-token");
    let file_arg = token_file.to_str().unwrap();
    for run in 0..2 {
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let command = fleet.toolctl_command(
            "client-alice",
            &[
                "mcp",
                "--profile",
                profile,
                "--http",
                &addr,
                "--http-token-file",
                file_arg,
            ],
        );
        let mut server = toolsrv_tests::Proc::spawn("mcp-http", command, fleet.work.path());
        wait_for(
            "the MCP HTTP server to listen",
            Duration::from_secs(20),
            || server.log().contains("serving MCP on").then_some(()),
        );
        assert!(server.log().contains(file_arg), "{}", server.log());
        let mode = std::fs::metadata(&token_file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let token = std::fs::read_to_string(&token_file).unwrap();
        assert_eq!(
            initialize_over_http(&addr, Some(token.trim())).0,
            200,
            "run {run}"
        );
        assert_eq!(initialize_over_http(&addr, None).0, 401, "run {run}");
        assert!(
            server.terminate().is_some_and(|s| s.success()),
            "{}",
            server.log()
        );
    }
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o640)).unwrap();
    let out = fleet.toolctl(&[
        "mcp",
        "--profile",
        profile,
        "--http",
        "127.0.0.1:0",
        "--http-token-file",
        file_arg,
    ]);
    assert_exit(&out, 64, &["mcp-token", "readable or writable by others"]);
}

/// Requests the SDK cannot read, sent raw on stdio as a broken or hostile client would: a
/// `tools/call` whose `arguments` is not an object gets invalid params naming what is wrong, a
/// method nobody serves gets method not found naming it (escaped), a line that is not JSON gets
/// a parse error (see the next test), and the server answers the next request as before.
#[test]
fn requests_the_sdk_cannot_read_get_an_error_naming_what_and_the_server_goes_on() {
    use std::io::Write;
    let fleet = one_host_fleet(&[]);
    let (mut child, mut stdin, rx) = stdio_server(&fleet, &one_host_profile(&fleet));
    let huge = format!(
        r#"{{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{{"name":"greet","arguments":"{}"}}}}"#,
        "x".repeat(5_000_000)
    );
    // `initialize` asking for 2026-07-28, the revision that removed it: answered with the
    // newest revision that has it.
    let mut lines = vec![
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2026-07-28","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"greet","arguments":"text"}}"#,
        r#"{"jsonrpc":"2.0","id":3,"method":"tools/\u001b[2Jexplode"}"#,
        "not json at all {",
        r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"greet","arguments":{"name":"raw"}}}"#,
        &huge,
        // The session's one host named all the same: taken out, not passed to the tool.
        r#"{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"greet","arguments":{"name":"named","target_host":"a"}}}"#,
    ];
    // `initialized` again and again: one forwarder of list changes all the same (each started
    // another, 100,000 of them held 200 MB and sent each change 100,000 times).
    lines.extend(std::iter::repeat_n(
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        1000,
    ));
    lines.push(
        r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"tool_load","arguments":{"name":"extra"}}}"#,
    );
    for line in lines {
        writeln!(stdin, "{line}").unwrap();
    }
    stdin.flush().unwrap();
    let mut answers = std::collections::BTreeMap::new();
    let mut changes = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while answers.len() < 7 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("answers so far: {answers:?}"));
        let message: Value = serde_json::from_str(&line).unwrap();
        if let Some(id) = message["id"].as_u64() {
            answers.insert(id, message);
        } else if message["method"] == "notifications/tools/list_changed" {
            changes += 1;
        }
    }
    // Whatever else comes within a second.
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(1)) {
        let message: Value = serde_json::from_str(&line).unwrap();
        if message["method"] == "notifications/tools/list_changed" {
            changes += 1;
        }
    }
    assert_eq!(changes, 1, "one list change, told once");
    drop(stdin);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        answers[&1]["result"]["protocolVersion"], "2025-11-25",
        "{}",
        answers[&1]
    );
    assert_eq!(answers[&2]["error"]["code"], -32602, "{}", answers[&2]);
    let message = answers[&2]["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("invalid params of `tools/call`: invalid type: string \"text\""),
        "{message}"
    );
    assert_eq!(answers[&3]["error"]["code"], -32601, "{}", answers[&3]);
    assert_eq!(
        answers[&3]["error"]["message"],
        "no method `tools/\\u{1b}[2Jexplode` in this server"
    );
    assert_eq!(
        result_text(&answers[&4]["result"]).trim(),
        "hello raw",
        "{}",
        answers[&4]
    );
    // 5 MB of arguments are not echoed back in the error.
    assert_eq!(answers[&5]["error"]["code"], -32602);
    let message = answers[&5]["error"]["message"].as_str().unwrap();
    assert!(message.len() < 1000, "{} bytes", message.len());
    assert_eq!(
        result_text(&answers[&6]["result"]).trim(),
        "hello named",
        "{}",
        answers[&6]
    );
    assert_eq!(answers[&7]["result"]["isError"], false, "{}", answers[&7]);
}

/// Lines that are not JSON-RPC messages, sent raw on stdio: each gets a JSON-RPC error naming
/// what is wrong and where, with the request's id when it can be read, and not megabytes of the
/// line back; then the server answers a good request. Before, the SDK dropped such a line
/// without a word, and its client waited for the answer for good.
#[test]
fn a_line_that_does_not_parse_is_answered_with_a_parse_error_and_the_server_goes_on() {
    use std::io::Write;
    let fleet = one_host_fleet(&[]);
    let (mut child, mut stdin, rx) = stdio_server(&fleet, &one_host_profile(&fleet));
    let deep = format!(
        r#"{{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{{"name":"greet","arguments":{{"name":{}"x"{}}}}}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    let huge_garbage = format!("garbage {}", "x".repeat(5_000_000));
    let lines: Vec<(&[u8], Value, i64, &str)> = vec![
        (
            b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"tools/call\",\"params\":{\"name\":\"greet\",\"arguments\":{\"name\":\"caf\xe9\"}}}",
            json!(4),
            -32700,
            "invalid UTF-8 at byte 95 of the request",
        ),
        (
            br#"{"jsonrpc":"2.0","id":"five","method":"tools/call","params":{"name":"greet","arguments":{"name":"\ud800"}}}"#,
            json!("five"),
            -32700,
            "unexpected end of hex escape at line 1 column",
        ),
        (deep.as_bytes(), json!(6), -32700, "recursion limit exceeded at line 1 column"),
        (
            br#"{"jsonrpc":"2.0","id":1e400,"method":"ping"}"#,
            Value::Null,
            -32700,
            "number out of range at line 1 column",
        ),
        (
            br#"{"jsonrpc":"2.0","id":8,"method":"ping"} and more"#,
            json!(8),
            -32700,
            "trailing characters at line 1 column 42",
        ),
        (b"not json at all {", Value::Null, -32700, "at line 1 column 2"),
        (
            huge_garbage.as_bytes(),
            Value::Null,
            -32700,
            "expected value at line 1 column 1",
        ),
        // A notification that does not parse: answered all the same, with no id to give.
        (
            br#"{"jsonrpc":"2.0","method":"notifications/initialized","params":{"x":"\udfff"}}"#,
            Value::Null,
            -32700,
            "surrogate in hex escape at line 1 column 75",
        ),
        (b"[]", Value::Null, -32600, "a JSON-RPC message is an object, not an array"),
        (b"null", Value::Null, -32600, "a JSON-RPC message is an object, not null"),
        (b"5", Value::Null, -32600, "a JSON-RPC message is an object, not a number"),
        (
            br#"{"jsonrpc":"1.0","id":"old","method":"ping"}"#,
            json!("old"),
            -32600,
            r#"invalid request: "jsonrpc" must be "2.0", not "1.0""#,
        ),
        // Which id is meant cannot be told: answered with a `null` one (the SDK gave none).
        (
            br#"{"id":13,"id":14,"method":"ping"}"#,
            Value::Null,
            -32600,
            r#"invalid request: the key "id" is given twice"#,
        ),
    ];
    for line in [
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
    ] {
        writeln!(stdin, "{line}").unwrap();
    }
    for (line, ..) in &lines {
        stdin.write_all(line).unwrap();
        stdin.write_all(b"\n").unwrap();
        // Blank lines are skipped, as before.
        stdin.write_all(b"\n  \r\n").unwrap();
    }
    writeln!(
        stdin,
        r#"{{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{{"name":"greet","arguments":{{"name":"after"}}}}}}"#
    )
    .unwrap();
    stdin.flush().unwrap();
    // The answers with an id, by id; those without, in order.
    let mut by_id = std::collections::BTreeMap::new();
    let mut without_id = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !by_id.contains_key(&json!(9).to_string()) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = rx.recv_timeout(left).unwrap_or_else(|_| {
            panic!("no answer to the good request; with an id: {by_id:?}, without: {without_id:?}")
        });
        assert!(line.len() < 2000, "an answer of {} bytes", line.len());
        let message: Value = serde_json::from_str(&line).unwrap();
        match &message["id"] {
            Value::Null if message.get("error").is_some() => {
                // JSON-RPC: `null` when the id cannot be told, never absent.
                assert_eq!(message.get("id"), Some(&Value::Null), "{message}");
                without_id.push(message);
            }
            Value::Null => {}
            id => {
                by_id.insert(id.to_string(), message);
            }
        }
    }
    drop(stdin);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        result_text(&by_id[&json!(9).to_string()]["result"]).trim(),
        "hello after",
        "{by_id:?}"
    );
    let mut without = without_id.iter();
    for (line, id, code, what) in &lines {
        let shown = String::from_utf8_lossy(&line[..line.len().min(60)]).to_string();
        let answer = if id.is_null() {
            without
                .next()
                .unwrap_or_else(|| panic!("{shown}: not answered: {without_id:?}"))
        } else {
            by_id
                .get(&id.to_string())
                .unwrap_or_else(|| panic!("{shown}: not answered: {by_id:?}"))
        };
        assert_eq!(answer["error"]["code"], *code, "{shown}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(what), "{shown}: {message}");
        assert!(message.len() < 400, "{shown}: {} bytes", message.len());
    }
    assert!(without.next().is_none(), "{without_id:?}");
}

/// POSTs `body` as JSON to `http://ADDR/mcp` by hand, with `Authorization: Bearer TOKEN` when
/// given: the status, the response head in lowercase, and the body.
fn post_over_http(addr: &str, token: Option<&str>, body: &[u8]) -> (u16, String, Vec<u8>) {
    use std::io::{Read, Write};
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let mut request = format!(
        "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\n{auth}Content-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(&request).unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).unwrap();
    let end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head: {:?}", String::from_utf8_lossy(&response)));
    let head = String::from_utf8_lossy(&response[..end]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status: {head:?}"));
    (status, head, response[end + 4..].to_vec())
}

/// A POST whose JSON body is not a JSON-RPC message gets `400` and a JSON-RPC error naming what
/// is wrong, with the request's id when it can be read, before MCP sees it; one without the
/// token gets `401` all the same, and the server goes on. Before, the SDK answered `415
/// Unsupported Media Type` to a client that had sent `Content-Type: application/json`.
#[test]
fn a_post_that_does_not_parse_is_answered_400_with_a_json_rpc_error() {
    let fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    let (_server, addr, token) = http_server(&fleet, &profile);
    let deep = format!(
        r#"{{"jsonrpc":"2.0","id":6,"method":"ping","params":{{"a":{}1{}}}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    let huge_garbage = format!("garbage {}", "x".repeat(3_000_000));
    let bodies: Vec<(&[u8], Value, i64, &str)> = vec![
        (
            b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"initialize\",\"params\":{\"clientInfo\":{\"name\":\"caf\xe9\"}}}",
            json!(4),
            -32700,
            "invalid UTF-8 at byte 81 of the request",
        ),
        (
            br#"{"jsonrpc":"2.0","id":"five","method":"initialize","params":{"clientInfo":{"name":"\ud800"}}}"#,
            json!("five"),
            -32700,
            "unexpected end of hex escape at line 1 column",
        ),
        (deep.as_bytes(), json!(6), -32700, "recursion limit exceeded"),
        (
            br#"{"jsonrpc":"2.0","id":1e400,"method":"ping"}"#,
            Value::Null,
            -32700,
            "number out of range",
        ),
        (
            br#"{"jsonrpc":"2.0","id":8,"method":"ping"}}"#,
            json!(8),
            -32700,
            "trailing characters",
        ),
        (huge_garbage.as_bytes(), Value::Null, -32700, "expected value at line 1 column 1"),
        (b"", Value::Null, -32700, "the request is empty"),
        (b"[]", Value::Null, -32600, "not an array"),
        (b"null", Value::Null, -32600, "not null"),
        (br#"{"jsonrpc":"2.0","id":1}"#, Value::Null, -32600, "invalid request: "),
        // Each names what is wrong (the SDK's reason was `unrecognized JSON-RPC message`).
        (
            br#"{"jsonrpc":"2.0","id":21,"method":"tools/call","params":[1,2]}"#,
            json!(21),
            -32600,
            r#"invalid request: "params" must be an object, not [1,2]"#,
        ),
        (
            br#"{"jsonrpc":"2.0","id":22,"method":"tools/call","params":"x"}"#,
            json!(22),
            -32600,
            r#"invalid request: "params" must be an object, not "x""#,
        ),
        (
            br#"{"jsonrpc":"2.0","id":1.5,"method":"ping"}"#,
            Value::Null,
            -32600,
            r#"invalid request: "id" must be a string or an integer, not 1.5"#,
        ),
        (
            br#"{"jsonrpc":"2.0","id":123456789012345678901234567890,"method":"ping"}"#,
            Value::Null,
            -32600,
            r#"invalid request: "id" must be a string or an integer"#,
        ),
        (
            br#"{"jsonrpc":"1.0","id":23,"method":"ping"}"#,
            json!(23),
            -32600,
            r#"invalid request: "jsonrpc" must be "2.0", not "1.0""#,
        ),
        (
            br#"{"id":24,"method":"ping"}"#,
            json!(24),
            -32600,
            r#"invalid request: "jsonrpc" is missing"#,
        ),
        (
            br#"{"jsonrpc":"2.0","id":25,"id":26,"method":"ping"}"#,
            Value::Null,
            -32600,
            r#"invalid request: the key "id" is given twice"#,
        ),
    ];
    for (body, id, code, what) in &bodies {
        let shown = String::from_utf8_lossy(&body[..body.len().min(60)]).to_string();
        // Without the token, refused as before, whatever the body. (Of a body of megabytes
        // the server reads none before it refuses and closes: the client's write breaks.)
        if body.len() <= 64 * 1024 {
            let (status, _, _) = post_over_http(&addr, None, body);
            assert_eq!(status, 401, "{shown}");
        }
        let (status, head, answer) = post_over_http(&addr, Some(&token), body);
        assert_eq!(status, 400, "{shown}: {head}");
        assert!(
            head.contains("content-type: application/json"),
            "{shown}: {head}"
        );
        assert!(
            answer.len() < 2000,
            "{shown}: an answer of {} bytes",
            answer.len()
        );
        let answer: Value = serde_json::from_slice(&answer)
            .unwrap_or_else(|e| panic!("{shown}: {e}: {}", String::from_utf8_lossy(&answer)));
        assert_eq!(answer["jsonrpc"], "2.0", "{shown}: {answer}");
        assert_eq!(answer["id"], *id, "{shown}: {answer}");
        assert_eq!(answer["error"]["code"], *code, "{shown}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(what), "{shown}: {message}");
    }
    // And a good request is served.
    let (status, head) = initialize_over_http(&addr, Some(&token));
    assert_eq!(status, 200, "{head}");
}

/// The model is offered only what the policy lets its client call: a host where a rule denies
/// the tool is not in its host argument's enum, a tool denied everywhere is not found by
/// `tool_search`, and `tool_load` of it is an error result naming the rule.
#[test]
fn the_model_is_offered_only_what_the_policy_lets_its_client_call() {
    let mut fleet = Fleet::new(&["a", "b"]);
    fleet.tool(
        "where.meta",
        r#"{"description": "Says where it runs", "cmd": "hostname"}"#,
        false,
    );
    fleet.tool(
        "vault_secrets.meta",
        r#"{"description": "Reads the vault's secrets", "keywords": ["vault", "secret"],
            "cmd": "echo s3cr3t"}"#,
        false,
    );
    let policy = fleet.policy_arg(
        r#"{"rules": [
            {"clients": ["alice"], "tools": ["vault_secrets"], "effect": "deny"},
            {"clients": ["alice"], "tools": ["where"], "hosts": "b", "effect": "deny"},
            {"tools": ["where"], "effect": "approve", "approvers": ["oncall-*"]}]}"#,
    );
    fleet.start_coordinator(&[&policy]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.start_agent("b", &AgentSpec::default());
    fleet.wait_online(&["a", "b"], "vault_secrets");
    let profile = profile(&fleet, &json!({"autoLoad": ["where"], "hosts": "all"}));
    let mut config = server_config(&fleet, &["mcp", "--profile", profile.to_str().unwrap()]);
    config["query"] = json!("read the vault secrets, or say where it runs");
    config["load"] = json!("vault_secrets");
    let out = scenario("host_only", &config);

    let tools = out["tools"].as_array().unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert!(!names.contains(&"vault_secrets"), "{names:?}");
    let place = tools.iter().find(|t| t["name"] == "where").unwrap();
    assert_eq!(
        place["inputSchema"]["properties"]["target_host"]["enum"],
        json!(["a"]),
        "{place}"
    );
    // Its calls wait for on-call's approval: the model is told, in words and in `_meta`.
    assert!(
        place["description"].as_str().unwrap().ends_with(
            "[Approval: each call of this tool waits until one of oncall-* approves it \
             (another person, not the user); a call nobody approves in time is denied.]"
        ),
        "{place}"
    );
    assert_eq!(
        place["_meta"]["toolsrv/approvals"],
        json!([{"approvers": ["oncall-*"], "hosts": ["a"]}])
    );
    let found: Vec<&Value> = out["search"]["structuredContent"]["results"]
        .as_array()
        .unwrap()
        .iter()
        .collect();
    let found: Vec<(&str, &Value)> = found
        .iter()
        .map(|r| (r["name"].as_str().unwrap(), &r["hosts"]))
        .collect();
    assert_eq!(found, [("where", &json!(["a"]))], "{}", out["search"]);
    assert_eq!(out["load"]["isError"], true, "{}", out["load"]);
    assert!(
        result_text(&out["load"]).contains(
            "denied to you on every host of the session that offers it: policy rule 0 denies \
             client alice calling vault_secrets on a"
        ),
        "{}",
        out["load"]
    );
}

/// Ctrl-C or SIGTERM ends `toolctl mcp` at once and closes its session, whether the client has
/// sent `initialize` yet or not, and though the client keeps stdin open. Before, a signal after
/// `initialize` closed the session but the process lived on until stdin closed, SIGINT
/// sometimes did nothing, and SIGTERM before `initialize` left the session open.
#[test]
fn a_signal_ends_toolctl_mcp_and_its_session_whatever_the_client_does() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let mut fleet = one_host_fleet(&[]);
    let profile = one_host_profile(&fleet);
    let no_session = |fleet: &mut Fleet, what: &str| {
        let out = fleet.toolctl(&["session", "list"]);
        assert_eq!(
            text(&out.stdout),
            "(no session)\n",
            "{what}: {}",
            text(&out.stderr)
        );
    };
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // Initialized, stdin open.
        let mut mcp = toolsrv_tests::McpStdio::start(
            fleet.toolctl_command(
                "client-alice",
                &["mcp", "--profile", profile.to_str().unwrap()],
            ),
            fleet.work.path().join(format!("mcp-{signal}.stderr")),
        );
        kill(Pid::from_raw(mcp.pid()), signal).unwrap();
        let status = mcp.exited_within(Duration::from_secs(10));
        assert!(
            status.is_some_and(|s| s.success()),
            "{signal} after initialize: {status:?}: {}",
            mcp.stderr()
        );
        no_session(&mut fleet, &format!("{signal} after initialize"));

        // Before initialize: the session is open, the client has said nothing.
        let stderr = fleet.work.path().join(format!("mcp-early-{signal}.stderr"));
        let mut child = fleet
            .toolctl_command(
                "client-alice",
                &["mcp", "--profile", profile.to_str().unwrap()],
            )
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        wait_for("the session opened", Duration::from_secs(30), || {
            std::fs::read_to_string(&stderr)
                .ok()
                .filter(|s| s.contains("toolctl mcp: session"))
        });
        kill(Pid::from_raw(i32::try_from(child.id()).unwrap()), signal).unwrap();
        let status = wait_for("toolctl mcp to exit", Duration::from_secs(10), || {
            child.try_wait().unwrap()
        });
        assert!(
            status.success(),
            "{signal} before initialize: {status:?}: {}",
            std::fs::read_to_string(&stderr).unwrap_or_default()
        );
        no_session(&mut fleet, &format!("{signal} before initialize"));
    }
}
