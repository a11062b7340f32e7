//! Clients nobody here wrote: Python's stock `grpcio`, with stubs generated from `proto/`,
//! calls the coordinator over mTLS, checks health and lists services through reflection, and
//! drives the model's side (FindTools, sessions).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use toolsrv_tests::{AgentSpec, Fleet, Venv, run_bounded, text};

/// A Python with grpcio, grpcio-tools, grpcio-health-checking and grpcio-reflection:
/// `$TOOLSRV_TEST_PYTHON`, or a virtualenv under `target/` created on first use.
///
/// Set up once per test process: the tests of this file run in parallel, and two pip installs
/// into one new virtualenv at once break each other.
fn python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON.get_or_init(python_once).clone()
}

fn python_once() -> PathBuf {
    Venv {
        env_override: "TOOLSRV_TEST_PYTHON",
        dir: "test-venv",
        packages: &[
            "grpcio",
            "grpcio-tools",
            "grpcio-health-checking",
            "grpcio-reflection",
        ],
        check: "import grpc, grpc_tools, grpc_health, grpc_reflection",
    }
    .python()
}

/// Python modules generated from `proto/` with grpcio-tools, in a temporary directory.
fn python_stubs(python: &Path) -> tempfile::TempDir {
    let proto = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let stubs = tempfile::tempdir().unwrap();
    let mut protoc = Command::new(python);
    protoc
        .args(["-m", "grpc_tools.protoc"])
        .arg(format!("-I{}", proto.display()))
        .arg(format!("--python_out={}", stubs.path().display()))
        .arg(format!("--grpc_python_out={}", stubs.path().display()))
        .args([
            "toolsrv/v1/common.proto",
            "toolsrv/v1/agent.proto",
            "toolsrv/v1/tools.proto",
        ])
        .current_dir(&proto);
    let out = run_bounded(protoc, None, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "protoc for Python failed: {}",
        text(&out.stderr)
    );
    stubs
}

/// Runs `tests/python/client.py` as alice against `fleet`: `args` after the connection ones.
fn python_client(python: &Path, stubs: &Path, fleet: &Fleet, args: &[&str]) -> Value {
    python_script("client.py", python, stubs, fleet, args)
}

/// Runs `tests/python/SCRIPT` as alice against `fleet` and reads the JSON report it prints.
fn python_script(script: &str, python: &Path, stubs: &Path, fleet: &Fleet, args: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(script);
    let mut client = Command::new(python);
    client
        .arg(&script)
        .arg(format!("127.0.0.1:{}", fleet.port))
        .arg(fleet.pki.path("ca.pem"))
        .arg(fleet.pki.path("client-alice.pem"))
        .arg(fleet.pki.path("client-alice-key.pem"))
        .args(args)
        .env("PYTHONPATH", stubs);
    let out = run_bounded(client, None, Duration::from_secs(90));
    assert!(
        out.status.success(),
        "python client failed: {}",
        text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A coordinator and host `a` offering `greet` (prints `hello`), online.
fn greet_fleet() -> Fleet {
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "greet.meta",
        r#"{"description": "Greets", "cmd": "echo hello"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "greet");
    fleet
}

#[test]
fn python_grpcio_approves_a_call_and_its_bypass() {
    let python = python();
    let stubs = python_stubs(&python);
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "guarded.meta",
        r#"{"description": "Asks to run a command outside its sandbox",
            "cmd": "toolsrv bypass --no-stdin --reason 'look outside' -- echo outside"}"#,
        false,
    );
    let policy = fleet
        .policy_arg(r#"{"rules": [{"tools": ["guarded"], "effect": "approve", "bypass": "ask"}]}"#);
    fleet.start_coordinator(&[&policy, &fleet.audit_arg()]);
    // `toolsrv bypass` on the calls' PATH, readable under their Landlock rules.
    let toolsrv = toolsrv_tests::bin("toolsrv");
    let bin_dir = toolsrv.parent().unwrap().to_path_buf();
    fleet.start_agent(
        "a",
        &AgentSpec {
            env: vec![(
                "PATH".into(),
                format!("{}:/usr/bin:/bin", bin_dir.display()),
            )],
            args: vec![format!("--sandbox-read={}", bin_dir.display())],
            ..AgentSpec::default()
        },
    );
    fleet.wait_online(&["a"], "guarded");

    let report = python_client(
        &python,
        stubs.path(),
        &fleet,
        &["a", "guarded", "{}", "approve"],
    );
    assert_eq!(report["status"], "CALL_STATUS_OK", "{report}");
    assert_eq!(report["stdout"], "outside\n", "{report}");
    let approvals = report["approvals"].as_array().unwrap();
    assert_eq!(approvals.len(), 2, "{report}");
    assert_eq!(approvals[0]["bypass_argv"], serde_json::json!([]));
    assert_eq!(
        approvals[1]["bypass_argv"],
        serde_json::json!(["echo", "outside"])
    );
    let decisions: Vec<Value> = fleet
        .audit_records()
        .into_iter()
        .filter(|r| r["event"] == "approval" || r["event"] == "bypass")
        .collect();
    assert_eq!(decisions.len(), 2, "{decisions:?}");
    for d in &decisions {
        assert_eq!(d["decision"], "approved");
        assert_eq!(d["decided_by"], "alice");
        assert_eq!(d["reason"], "python");
    }
}

#[test]
fn python_grpcio_lists_hosts_and_calls_a_tool() {
    let python = python();
    let stubs = python_stubs(&python);
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "greet.meta",
        r#"{"description": "Greets", "cmd": "name=$(jq -r .name); echo \"hello $name\"; echo note >&2",
            "args": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "greet");

    let report = python_client(
        &python,
        stubs.path(),
        &fleet,
        &["a", "greet", r#"{"name": "python"}"#],
    );
    assert_eq!(report["hosts"][0]["id"], "a");
    assert_eq!(report["hosts"][0]["online"], true);
    assert_eq!(report["hosts"][0]["os"], "linux");
    assert!(
        report["tools"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t == "greet")
    );
    assert_eq!(report["stdout"], "hello python\n");
    assert_eq!(report["stderr"], "note\n");
    assert_eq!(report["status"], "CALL_STATUS_OK");
    assert_eq!(report["exit_code"], 0);
    assert_eq!(report["result"]["content"][0]["text"], "hello python\n");
    assert_eq!(report["health"], "SERVING");
    let services: Vec<&str> = report["services"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    for wanted in [
        "toolsrv.v1.Tools",
        "toolsrv.v1.AgentLink",
        "grpc.health.v1.Health",
    ] {
        assert!(
            services.contains(&wanted),
            "{wanted} missing from {services:?}"
        );
    }
}

/// The model's side from the same client: FindTools, a session opened from an inline profile,
/// watched while a tool is loaded and another unloaded, a call made as part of it, the session
/// closed (its watch ends NOT_FOUND), and two bad requests refused with their gRPC codes.
#[test]
fn python_grpcio_finds_tools_and_drives_a_session() {
    let python = python();
    let stubs = python_stubs(&python);
    let mut fleet = Fleet::new(&["a"]);
    fleet.tool(
        "greet.meta",
        r#"{"description": "Greets someone by name", "keywords": ["say hello"],
            "cmd": "echo hello", "tier": "hot"}"#,
        false,
    );
    fleet.tool(
        "disk.meta",
        r#"{"description": "Free and used space of each mounted filesystem",
            "keywords": ["disk usage", "free space"], "prompt": "Reports disk space per mount.",
            "cmd": "echo '{\"used\": 1}'"}"#,
        false,
    );
    fleet.start_coordinator(&[]);
    fleet.start_agent("a", &AgentSpec::default());
    fleet.wait_online(&["a"], "disk");

    let report = python_script(
        "session_client.py",
        &python,
        stubs.path(),
        &fleet,
        &[
            "a",
            "how much free space is left on the disks",
            "greet",
            "disk",
        ],
    );
    assert_eq!(report["ranker"], "lexical", "{report}");
    assert_eq!(report["matches"][0]["name"], "disk", "{report}");
    assert_eq!(report["matches"][0]["hosts"], serde_json::json!(["a"]));

    let names = |state: &Value| -> Vec<String> {
        state["loaded"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect()
    };
    let opened = &report["opened"];
    assert_eq!(names(opened), ["greet"], "{report}");
    assert_eq!(opened["loaded"][0]["tier"], "hot");
    assert_eq!(opened["loaded"][0]["auto_loaded"], true);
    assert_eq!(opened["selected"], serde_json::json!(["a"]));
    assert_eq!(opened["max_loaded"], 2);
    let loaded = &report["loaded"];
    assert_eq!(names(loaded), ["greet", "disk"], "{report}");
    assert_eq!(
        loaded["loaded"][1]["prompts"],
        serde_json::json!(["Reports disk space per mount."])
    );
    assert_eq!(names(&report["unloaded"]), ["disk"], "{report}");
    // The watch saw each state: as opened, after the load, after the unload.
    let watched = report["watched"].as_array().unwrap();
    assert_eq!(names(&watched[0]), ["greet"], "{report}");
    assert_eq!(names(&watched[1]), ["greet", "disk"], "{report}");
    assert_eq!(names(&watched[2]), ["disk"], "{report}");
    assert_eq!(report["call_status"], "CALL_STATUS_OK", "{report}");
    // ListSessions: this session, and only it, until it is closed.
    assert_eq!(report["listed"], serde_json::json!([true]), "{report}");
    assert_eq!(report["listed_after_close"], 0, "{report}");
    assert_eq!(report["watch_end"], "NOT_FOUND", "{report}");
    assert_eq!(report["load_closed"], "NOT_FOUND", "{report}");
    assert_eq!(report["long_query"], "INVALID_ARGUMENT", "{report}");
}

/// A client nobody here wrote sends a request of 6 MB that would decode to about 150 MB (three
/// million empty `autoLoad` names, as raw bytes): the coordinator refuses it undecoded with
/// `OUT_OF_RANGE` naming the field, and the same channel's next request is served.
#[test]
fn python_grpcio_request_too_large_once_decoded_is_refused_undecoded() {
    let python = python();
    let stubs = python_stubs(&python);
    let fleet = greet_fleet();

    let report = python_script(
        "hostile_sizes.py",
        &python,
        stubs.path(),
        &fleet,
        &["3000000"],
    );
    assert_eq!(report["code"], "OUT_OF_RANGE", "{report}");
    let details = report["details"].as_str().unwrap();
    for words in [
        "toolsrv.v1.OpenSessionRequest",
        "profile.auto_load",
        "refused before decoding",
    ] {
        assert!(details.contains(words), "{report}");
    }
    assert_eq!(report["hosts_after"], serde_json::json!(["a"]), "{report}");
}

/// An HTTP/2 peer that breaks the rules on purpose (raw frames, `tests/python/http2_limits.py`):
/// the coordinator bounds the streams one connection may open (it says so in its SETTINGS),
/// and ends a connection that makes it reset stream after stream (MadeYouReset: a window
/// update that overflows each stream's window) instead of resetting them without end, which
/// grew it by a gigabyte in half a minute. Other clients and the agents are not touched.
#[test]
fn an_http2_peer_is_held_to_a_stream_limit_and_a_reset_limit() {
    let python = python();
    let stubs = python_stubs(&python);
    let fleet = greet_fleet();

    let report = python_script("http2_limits.py", &python, stubs.path(), &fleet, &["3000"]);
    let log = || fleet.coordinator.as_ref().unwrap().log_tail(20);
    assert_eq!(
        report["max_concurrent_streams"],
        1024,
        "{report}; the coordinator's log ends: {}",
        log()
    );
    // ENHANCE_YOUR_CALM, after about as many resets as the limit.
    assert_eq!(report["goaway_code"], 11, "{report}");
    assert!(
        report["flow_control_resets"].as_u64().unwrap() <= 1100,
        "{report}"
    );
    let out = fleet.toolctl(&["call", "a", "greet"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello\n");
    // The HTTP/2 library's warning about the ended connection is not logged: any peer could
    // have it written once a connection.
    let log = fleet.coordinator.as_ref().unwrap().log();
    assert!(
        !log.contains("locally-reset streams reached limit"),
        "{log}"
    );
}
