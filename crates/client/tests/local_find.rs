//! `toolctl local find` as a user runs it: the real binary on the evaluation catalog of
//! toolsrv-find, with and without the sentence encoder.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;
use toolsrv_testkit::{assert_exit, must, text, try_run_bounded, write};

fn toolctl() -> Command {
    // The vectors `find --model` keeps go to a directory of this test binary's, not the
    // user's cache.
    static CACHE: OnceLock<tempfile::TempDir> = OnceLock::new();
    let cache = CACHE.get_or_init(|| tempfile::tempdir().unwrap());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_toolctl"));
    cmd.env_remove("OLLIE_TOOLS_PATH")
        .env_remove("TOOLSRV_FIND_MODEL")
        .env_remove("TOOLSRV_FIND_VECTORS")
        .env("XDG_CACHE_HOME", cache.path());
    cmd
}

fn run(cmd: &mut Command) -> Output {
    must(try_run_bounded(cmd, None, Duration::from_secs(120)))
}

fn catalog() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../find/eval/tools");
    root.display().to_string()
}

fn find(args: &[&str]) -> Output {
    run(toolctl()
        .args(["local", "find", "--tools", &catalog()])
        .args(args))
}

fn names(out: &Output) -> Vec<String> {
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| h["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn words_rank_the_tool_first_with_score_and_description() {
    let out = find(&["restart the nginx service", "--json", "--limit", "3"]);
    assert_exit(&out, 0, &[]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let hits = v.as_array().unwrap();
    assert!(!hits.is_empty() && hits.len() <= 3, "{v}");
    assert_eq!(hits[0]["name"], "restart_service");
    assert!(hits[0]["description"].as_str().unwrap().contains("systemd"));
    let score = hits[0]["score"].as_f64().unwrap();
    assert!(score > 0.0 && score <= 1.0, "{v}");
    assert!(hits[0]["semantic"].is_null());

    let plain = find(&["restart the nginx service"]);
    assert_exit(&plain, 0, &[]);
    let first = text(&plain.stdout).lines().next().unwrap_or("").to_string();
    assert!(first.contains("restart_service"), "{first}");
}

#[test]
fn no_match_is_an_empty_array_or_a_line_on_stderr_and_exit_1() {
    let out = find(&["bake a chocolate cake", "--json"]);
    assert_exit(&out, 1, &[]);
    assert_eq!(text(&out.stdout).trim(), "[]");
    let out = find(&["bake a chocolate cake"]);
    assert_exit(&out, 1, &[]);
    assert!(text(&out.stdout).is_empty());
    assert!(
        text(&out.stderr).contains("no tool"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn only_tools_visible_here_are_ranked() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "gpu_watch.meta",
        r#"{"description": "GPU utilisation and memory", "variants": [{"match": {"binary": "definitely-not-installed-gpu-tool"}, "cmd": "x"}]}"#,
    );
    write(
        dir.path(),
        "gpu_docs.meta",
        r#"{"description": "Where the GPU manuals are", "cmd": "true"}"#,
    );
    let out = run(toolctl()
        .args(["local", "find", "--tools"])
        .arg(dir.path())
        .args(["gpu utilisation", "--json"]));
    assert_exit(&out, 0, &[]);
    assert_eq!(names(&out), ["gpu_docs"]);
}

/// A tools path can be another user's directory: what its tools say reaches the terminal of
/// `local find` and `local list` with control and direction characters escaped.
#[test]
fn a_tool_s_description_cannot_write_to_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "gpu_docs.meta",
        r#"{"description": "GPU manuals\u001b]0;owned\u0007\u001b[2J\u202e", "cmd": "true"}"#,
    );
    let out = run(toolctl()
        .args(["local", "find", "--tools"])
        .arg(dir.path())
        .arg("gpu manuals"));
    assert_exit(&out, 0, &[]);
    let found = text(&out.stdout);
    assert!(
        found.contains(r"GPU manuals\u{1b}]0;owned\u{7}\u{1b}[2J\u{202e}"),
        "{found:?}"
    );
    let out = run(toolctl().args(["local", "list", "--tools"]).arg(dir.path()));
    assert_exit(&out, 0, &[]);
    let listed = text(&out.stdout);
    assert!(listed.contains(r"GPU manuals\u{1b}]0;owned"), "{listed:?}");
    for shown in [&found, &listed] {
        assert!(
            !shown.contains(['\u{1b}', '\u{7}', '\u{202e}']),
            "{shown:?}"
        );
    }
}

#[test]
fn bad_limits_requests_and_model_directories_are_refused() {
    for limit in ["0", "1001", "-1", "many"] {
        let out = find(&["disk", "--limit", limit]);
        assert_eq!(out.status.code(), Some(64), "--limit {limit}");
    }
    let out = find(&[&"a".repeat(4097)]);
    assert_exit(&out, 64, &["4096"]);

    let empty = tempfile::tempdir().unwrap();
    // A model of an architecture the encoder does not run, and an MPNet configuration over
    // BERT weights: refused when loaded, naming the file and why.
    let real = toolsrv_testkit::find_model_dir();
    let foreign = tempfile::tempdir().unwrap();
    let mismatched = tempfile::tempdir().unwrap();
    for dir in [foreign.path(), mismatched.path()] {
        for file in ["model.safetensors", "tokenizer.json"] {
            std::fs::copy(real.join(file), dir.join(file)).unwrap();
        }
    }
    write(
        foreign.path(),
        "config.json",
        r#"{"model_type": "llama", "hidden_size": 384}"#,
    );
    let mpnet_config = toolsrv_testkit::mpnet_model_dir().join("config.json");
    std::fs::copy(mpnet_config, mismatched.path().join("config.json")).unwrap();
    for (dir, says) in [
        (empty.path().join("absent"), "does not exist"),
        (empty.path().to_path_buf(), "model.safetensors"),
        (foreign.path().to_path_buf(), "model_type \"llama\""),
        (mismatched.path().to_path_buf(), "model.safetensors"),
    ] {
        let out = run(toolctl()
            .args(["local", "find", "--tools", &catalog(), "disk"])
            .env("TOOLSRV_FIND_MODEL", &dir));
        assert_exit(&out, 78, &[]);
        let err = text(&out.stderr);
        assert!(
            err.contains(&dir.display().to_string()) && err.contains(says),
            "{err}"
        );
    }
}

#[test]
fn with_either_model_a_paraphrase_finds_its_tool() {
    for model in [
        toolsrv_testkit::find_model_dir(),
        toolsrv_testkit::mpnet_model_dir(),
    ] {
        paraphrase_finds_its_tool(&model);
    }
}

fn paraphrase_finds_its_tool(model: &Path) {
    let out = run(toolctl()
        .args([
            "local",
            "find",
            "--tools",
            &catalog(),
            "--json",
            "--limit",
            "3",
        ])
        .arg("4412 is stuck, put it out of its misery")
        .arg("--model")
        .arg(model));
    assert_exit(&out, 0, &[]);
    assert!(
        names(&out).contains(&"kill_process".to_string()),
        "{}: {}",
        model.display(),
        text(&out.stdout)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v[0]["semantic"].is_number(), "{v}");
}

/// `scripts/fetch-find-model` run with bad arguments: refused with exit 2 and a reason, before
/// anything is fetched or written. A model name is never a path.
#[test]
fn the_model_script_refuses_bad_arguments() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/fetch-find-model");
    let home = tempfile::tempdir().unwrap();
    for (args, says) in [
        (vec!["--model"], "--model needs a name"),
        (vec!["--model", "nope"], "unknown model nope"),
        (vec!["--model", "../../etc"], "unknown model ../../etc"),
        (vec!["--model", "all-MiniLM-L6-v2\n"], "unknown model"),
        (vec!["one", "two"], "usage:"),
    ] {
        let out = run(Command::new("bash")
            .arg(&script)
            .args(&args)
            .env("HOME", home.path()));
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(says),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    assert_eq!(
        std::fs::read_dir(home.path()).unwrap().count(),
        0,
        "nothing written"
    );
    // A directory that already holds the model (here through a symlink) is left as it is.
    let link = home.path().join("linked");
    std::os::unix::fs::symlink(toolsrv_testkit::find_model_dir(), &link).unwrap();
    let out = run(Command::new("bash").arg(&script).arg(&link));
    assert_exit(&out, 0, &[]);
    assert!(
        text(&out.stdout).contains("already has"),
        "{}",
        text(&out.stdout)
    );
}

/// The vectors of the tools' texts are kept between runs: the second run finds the same
/// tools with the same scores without writing the file again; `--no-vectors` keeps none; a
/// directory others may write is not used, with a warning, and the tools are found all the same.
#[test]
fn vectors_are_kept_between_runs_where_only_this_user_writes() {
    let model = toolsrv_testkit::find_model_dir();
    let dir = tempfile::tempdir().unwrap();
    let vectors = dir.path().join("vectors");
    let run_with = |extra: &[&str], vectors: &Path| {
        run(toolctl()
            .args(["local", "find", "--tools", &catalog(), "--json"])
            .arg("4412 is stuck, put it out of its misery")
            .arg("--model")
            .arg(&model)
            .args(extra)
            .env("TOOLSRV_FIND_VECTORS", vectors))
    };
    let first = run_with(&[], &vectors);
    assert_exit(&first, 0, &[]);
    assert!(text(&first.stderr).is_empty(), "{}", text(&first.stderr));
    let files: Vec<_> = std::fs::read_dir(&vectors)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].extension().is_some_and(|e| e == "vectors"));
    let written = std::fs::metadata(&files[0]).unwrap().modified().unwrap();

    let second = run_with(&[], &vectors);
    assert_exit(&second, 0, &[]);
    assert_eq!(text(&second.stdout), text(&first.stdout));
    assert_eq!(
        std::fs::metadata(&files[0]).unwrap().modified().unwrap(),
        written,
        "nothing new was embedded, so nothing was written"
    );

    let none = dir.path().join("none");
    let out = run_with(&["--no-vectors"], &none);
    assert_exit(&out, 0, &[]);
    assert_eq!(text(&out.stdout), text(&first.stdout));
    assert!(!none.exists());

    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = run_with(&[], &open);
    assert_exit(&out, 0, &[]);
    assert_eq!(text(&out.stdout), text(&first.stdout));
    let err = text(&out.stderr);
    assert!(
        err.contains("toolctl: warning: vector store")
            && err.contains(&open.display().to_string())
            && err.contains("writable by group or others"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);
}
