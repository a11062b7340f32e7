//! `toolsrv up`, the README's run command, as a newcomer meets it: in a clean environment (a fresh
//! HOME, nothing but PATH and HOME set, no `toolctl` installed), every command its banner prints
//! works pasted as it is into another shell, and they are the README's tour.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use toolsrv_tests::{
    assert_exit, bin, fake_version_manager, free_port, run_bounded, text, wait_for,
};

/// The only `PATH` the clean environment has: no `toolctl` there unless one is installed
/// system-wide, and the banner's `PATH` comes first anyway.
const CLEAN_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// `toolsrv up` in a clean environment with `home` as HOME, killed (with its process group) on drop.
struct Up {
    child: Child,
    stderr: std::path::PathBuf,
}

impl Up {
    fn start(home: &Path, port: u16, extra_env: &[(&str, &str)]) -> Self {
        let env: Vec<(&str, &std::ffi::OsStr)> = extra_env
            .iter()
            .map(|(k, v)| (*k, std::ffi::OsStr::new(*v)))
            .collect();
        Self::start_os(home, port, &env)
    }

    /// [`Up::start`] with values that need not be UTF-8.
    fn start_os(home: &Path, port: u16, extra_env: &[(&str, &std::ffi::OsStr)]) -> Self {
        let stderr = home.join("up.log");
        let mut cmd = Command::new(bin("toolsrv"));
        cmd.args(["up", "--listen", &format!("127.0.0.1:{port}")])
            .env_clear()
            .env("PATH", CLEAN_PATH)
            .env("HOME", home)
            .envs(extra_env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .process_group(0);
        Self {
            child: cmd.spawn().unwrap(),
            stderr,
        }
    }

    /// The banner, up to its last line (bounded: `up` prints it within seconds or the test fails).
    fn banner(&mut self) -> Vec<String> {
        let stdout = self.child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = Vec::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let last = line.contains("Ctrl-C stops it");
                lines.push(line);
                if last {
                    break;
                }
            }
            let _ = tx.send(lines);
        });
        let lines = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("no banner within 60 s; log:\n{}", self.log()));
        assert!(
            lines.last().is_some_and(|l| l.contains("Ctrl-C")),
            "the banner ended early: {lines:?}\nlog:\n{}",
            self.log()
        );
        lines
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn stop(mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let status = wait_for("up to exit on SIGTERM", Duration::from_secs(20), || {
            self.child.try_wait().unwrap()
        });
        assert!(status.success(), "{status:?}\n{}", self.log());
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(self.child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = self.child.wait();
        }
    }
}

/// `sh -c SCRIPT` in the clean environment, as a second shell would run it.
fn shell(home: &Path, script: &str) -> Command {
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(script)
        .env_clear()
        .env("PATH", CLEAN_PATH)
        .env("HOME", home);
    cmd
}

/// The lines of the banner's command block that start with `prefix`, as printed.
fn block<'a>(banner: &'a [String], prefix: &str) -> Vec<&'a str> {
    banner
        .iter()
        .map(|l| l.trim())
        .filter(|l| l.starts_with(prefix))
        .collect()
}

/// The workspace's README.
fn readme() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")).unwrap()
}

/// The `toolctl` lines of the README's tour, in section 1 ("See it work").
fn readme_tour() -> Vec<String> {
    let readme = readme();
    let section = readme
        .split("### 1.")
        .nth(1)
        .and_then(|s| s.split("### 2.").next())
        .expect("the README has a section 1 before section 2");
    section
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("toolctl "))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_commands_up_prints_work_verbatim_in_a_clean_environment() {
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    let port = free_port();
    let mut up = Up::start(home, port, &[]);
    let banner = up.banner();
    let exports = block(&banner, "export ");
    let commands = block(&banner, "toolctl ");
    assert_eq!(exports.len(), 5, "{banner:#?}");
    assert!(exports[0].starts_with("export PATH="), "{banner:#?}");
    assert_eq!(
        commands,
        readme_tour(),
        "up prints the README's tour, comments and all"
    );
    assert!(
        commands.len() >= 5 && commands.iter().any(|c| c.starts_with("toolctl watch")),
        "{commands:?}"
    );
    let settings = exports.join("\n");
    // The `toolctl` the commands run is the one `up` linked, whatever else is installed.
    let which = run_bounded(
        shell(home, &format!("{settings}\ncommand -v toolctl")),
        None,
        Duration::from_secs(10),
    );
    assert_eq!(
        text(&which.stdout).trim(),
        home.join(".local/state/toolsrv/up/bin/toolctl")
            .display()
            .to_string(),
        "{}",
        text(&which.stderr)
    );
    // The state directory is the default one under the fresh HOME.
    assert!(
        settings.contains(
            &home
                .join(".local/state/toolsrv/up/pki")
                .display()
                .to_string()
        ),
        "{settings}"
    );

    for command in commands {
        let script = format!("{settings}\n{command}");
        if command.starts_with("toolctl watch") {
            // Runs until Ctrl-C: its first line is the snapshot, then it is stopped.
            let mut child = shell(home, &script)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0)
                .spawn()
                .unwrap();
            let mut stdout = child.stdout.take().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut first = Vec::new();
                let mut byte = [0u8; 1];
                while stdout.read(&mut byte).is_ok_and(|n| n == 1) && byte[0] != b'\n' {
                    first.push(byte[0]);
                }
                let _ = tx.send(String::from_utf8_lossy(&first).into_owned());
            });
            let first = rx.recv_timeout(Duration::from_secs(30));
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGINT,
            );
            // The shell may die of the interrupt itself; toolctl, in the same group, ends too.
            wait_for("watch to end on Ctrl-C", Duration::from_secs(20), || {
                child.try_wait().unwrap()
            });
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let mut stderr = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
            let first =
                first.unwrap_or_else(|_| panic!("{command}: no event within 30 s: {stderr}"));
            assert!(first.starts_with("snapshot"), "{command}: {first} {stderr}");
            continue;
        }
        let out = run_bounded(shell(home, &script), None, Duration::from_secs(60));
        assert!(
            out.status.success(),
            "`{command}` failed ({:?}):\n{}{}\nup's log:\n{}",
            out.status,
            text(&out.stdout),
            text(&out.stderr),
            up.log()
        );
        assert!(!out.stdout.is_empty(), "`{command}` printed nothing");
        if command.starts_with("toolctl hosts") {
            assert!(
                text(&out.stdout).contains("local  online"),
                "the agent is there as soon as the banner is: {}",
                text(&out.stdout)
            );
        }
    }

    // A second `up` on the same port says what probably holds it and how to pick another.
    let other = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(bin("toolsrv"));
    cmd.args(["up", "--listen", &format!("127.0.0.1:{port}")])
        .env_clear()
        .env("PATH", CLEAN_PATH)
        .env("HOME", other.path());
    let out = run_bounded(cmd, None, Duration::from_secs(30));
    assert_exit(&out, 1, &[]);
    let err = text(&out.stderr);
    assert!(
        err.contains("another `toolsrv up` may be running")
            && err.contains(&format!("--listen 127.0.0.1:{} --state DIR", port + 1)),
        "{err}"
    );
    assert!(
        !other.path().join(".local/state/toolsrv/up/pki").exists(),
        "a second up that cannot listen leaves no state behind"
    );

    up.stop();
}

/// The example `fix_perms` asks for `chmod` and `stat` outside its sandbox with `toolsrv
/// bypass`: under `up` it is offered (its variant wants `toolsrv` on PATH, which `up` links for
/// its agent) and, approved by its caller, changes a file's mode outside the sandbox.
#[test]
fn up_offers_the_bypass_example_and_runs_it_once_approved() {
    use std::os::unix::fs::PermissionsExt;
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    let mut up = Up::start(home, free_port(), &[]);
    let banner = up.banner();
    let settings = block(&banner, "export ").join("\n");
    let file = home.join("outside.conf");
    std::fs::write(&file, "x").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let script = format!(
        "{settings}\ntoolctl call --approve local fix_perms path={} mode=0640",
        file.display()
    );
    let out = run_bounded(shell(home, &script), None, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "{:?}\n{}{}\nup's log:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr),
        up.log()
    );
    assert!(
        text(&out.stdout).starts_with("640 "),
        "{}",
        text(&out.stdout)
    );
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o640);
    up.stop();
}

#[test]
fn up_says_when_ollie_tools_path_replaces_the_example_tools() {
    use std::os::unix::ffi::OsStrExt;
    let home = tempfile::tempdir().unwrap();
    // A name that is not UTF-8 is a path all the same (it was taken for no OLLIE_TOOLS_PATH).
    let tools = home
        .path()
        .join(std::ffi::OsStr::from_bytes(b"my-tools-\xe9"));
    std::fs::create_dir(&tools).unwrap();
    std::fs::write(
        tools.join("mine.meta"),
        r#"{"description": "Mine", "cmd": "echo mine"}"#,
    )
    .unwrap();
    std::fs::write(
        tools.join("bigout.meta"),
        r#"{"description": "Prints 2,000,000 bytes", "cmd": "head -c 2000000 /dev/zero"}"#,
    )
    .unwrap();
    let mut up = Up::start_os(
        home.path(),
        free_port(),
        &[("OLLIE_TOOLS_PATH", tools.as_os_str())],
    );
    let lines = up.banner();
    let banner = lines.join("\n");
    assert!(
        banner.contains(&format!("tools from {}", tools.display()))
            && banner.contains(
                "from OLLIE_TOOLS_PATH in your environment, instead of the example tools"
            ),
        "{banner}"
    );
    assert!(
        up.log().contains("OLLIE_TOOLS_PATH"),
        "and the log says it: {}",
        up.log()
    );
    // Its agent keeps an agent's output limit (16 MiB), not `toolctl local call`'s (1 MiB).
    let settings = block(&lines, "export ").join("\n");
    let out = run_bounded(
        shell(
            home.path(),
            &format!("{settings}\ntoolctl call local bigout | wc -c"),
        ),
        None,
        Duration::from_secs(60),
    );
    assert_eq!(text(&out.stdout).trim(), "2000000", "{}", text(&out.stderr));
    up.stop();
}

/// On a developer's machine `python3` is often a version manager's shim, which runs a program
/// under the manager's root: `up` lets its local agent's calls read that root (and logs it), so
/// tools found through the shim run confined as they would unconfined.
#[test]
fn up_lets_its_agent_run_programs_behind_a_version_managers_shims() {
    let home = tempfile::tempdir().unwrap();
    let root = home.path().join(".fakeenv");
    fake_version_manager(&root, "fakepy");
    let tools = home.path().join("my-tools");
    std::fs::create_dir(&tools).unwrap();
    std::fs::write(
        tools.join("py.meta"),
        r#"{"description": "runs the managed interpreter", "cmd": "fakepy hi",
            "variants": [{"match": {"binary": "fakepy"}}]}"#,
    )
    .unwrap();
    let path = format!("{}:{CLEAN_PATH}", root.join("shims").display());
    let mut up = Up::start(
        home.path(),
        free_port(),
        &[
            ("PATH", &path),
            ("OLLIE_TOOLS_PATH", tools.to_str().unwrap()),
        ],
    );
    let banner = up.banner();
    let settings = block(&banner, "export ").join("\n");
    let out = shell(home.path(), &format!("{settings}\ntoolctl call local py"))
        .output()
        .unwrap();
    assert_eq!(
        text(&out.stdout),
        "fakepy ran: hi\n",
        "{}\n{}",
        text(&out.stderr),
        up.log()
    );
    let log = up.log();
    let line = log
        .lines()
        .find(|l| l.contains("PATH holds a version manager's shims"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains(&format!("root={}", root.display())), "{line}");
    up.stop();
}

/// Runs `script` (a `toolctl find`) until its answer is ranked by meaning: while the coordinator
/// builds its first ranking it answers by words alone and says so on stderr (how long the build
/// takes depends on the machine's load). Bounded: 60 s.
fn find_by_meaning(home: &Path, script: &str) -> std::process::Output {
    wait_for(
        "an answer ranked by meaning",
        Duration::from_secs(60),
        || {
            let out = run_bounded(shell(home, script), None, Duration::from_secs(60));
            let by_words = text(&out.stderr).contains("ranked by words alone for now");
            (!by_words).then_some(out)
        },
    )
}

/// `--find-model` (here through `TOOLSRV_FIND_MODEL`) gives `up`'s coordinator the sentence
/// encoder: the banner says so, and a request that shares no word with its tool finds it. What
/// the coordinator keeps (the texts' vectors, revocations) outlives it in the state directory:
/// the next `up` embeds nothing it had embedded, and still knows what was revoked.
#[test]
fn up_ranks_by_meaning_with_a_find_model() {
    let model = toolsrv_tests::find_model_dir();
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    let port = free_port();
    let env = [("TOOLSRV_FIND_MODEL", model.to_str().unwrap())];
    let mut up = Up::start(home, port, &env);
    let banner = up.banner();
    let all = banner.join("\n");
    assert!(
        all.contains(&format!(
            "rank tools by meaning, with the encoder in {}",
            model.display()
        )),
        "{all}"
    );
    let settings = block(&banner, "export ").join("\n");
    let script = format!(
        "{settings}\ntoolctl find local 'fingerprint this tarball so i can tell nobody tampered with it' --json"
    );
    let out = find_by_meaning(home, &script);
    assert_exit(&out, 0, &[]);
    let hits: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(hits[0]["name"], "checksum", "{hits}");
    assert_eq!(hits[0]["lexical"], 0.0, "no word in common: {hits}");
    assert!(
        hits[0]["semantic"].is_number(),
        "ranked by the encoder: {hits}"
    );
    let revoke = format!("{settings}\ntoolctl revoke client/mallory --reason 'key leaked'");
    let out = run_bounded(shell(home, &revoke), None, Duration::from_secs(60));
    assert_exit(&out, 0, &[]);
    let kept = home.join(".local/state/toolsrv/up/coordinator");
    assert!(kept.join("revocations.json").is_file());
    assert_eq!(
        std::fs::read_dir(kept.join("find-vectors"))
            .unwrap()
            .count(),
        1
    );
    up.stop();

    let mut up = Up::start(home, port, &env);
    up.banner();
    let out = find_by_meaning(home, &script);
    assert_exit(&out, 0, &[]);
    let again: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    toolsrv_tests::assert_same_ranking(&again, &hits);
    assert!(
        up.log()
            .contains("tool index built from the vectors kept by an earlier run"),
        "{}",
        up.log()
    );
    let list = format!("{settings}\ntoolctl revocations --json");
    let out = run_bounded(shell(home, &list), None, Duration::from_secs(60));
    assert_exit(&out, 0, &[]);
    assert!(
        text(&out.stdout).contains("client/mallory"),
        "{}",
        text(&out.stdout)
    );
    up.stop();
}

/// A `--find-model` directory without the model stops `up` at once, naming the directory and
/// the missing file, before anything starts: no certificates written, no agent connecting to a
/// coordinator that is about to refuse the model.
#[test]
fn up_refuses_a_find_model_directory_without_the_model_before_starting() {
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    let empty = home.join("no-model");
    std::fs::create_dir(&empty).unwrap();
    let mut up = Up::start(
        home,
        free_port(),
        &[("TOOLSRV_FIND_MODEL", empty.to_str().unwrap())],
    );
    let status = wait_for("up to exit", Duration::from_secs(30), || {
        up.child.try_wait().unwrap()
    });
    let log = up.log();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("--find-model") && log.contains(&empty.display().to_string()),
        "{log}"
    );
    assert!(log.contains("model.safetensors"), "{log}");
    assert_eq!(
        log.trim().lines().count(),
        1,
        "one line, nothing else logged: {log}"
    );
    assert!(
        !home.join(".local/state/toolsrv/up").exists(),
        "the state directory was made: {log}"
    );
}

/// The README's MCP tour, run verbatim in the settings `up` printed: the ranking, then a model's
/// part in JSON-RPC lines on `toolctl mcp`'s stdio, answered as the README says.
#[test]
fn the_readme_mcp_tour_works_verbatim() {
    let readme = readme();
    let tour = readme
        .split("**A tour: from `toolsrv up` to a model loading and calling a tool.**")
        .nth(1)
        .and_then(|s| s.split("```sh\n").nth(1))
        .and_then(|s| s.split("```").next())
        .expect("the README has the MCP tour in a sh block");
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    let mut up = Up::start(home, free_port(), &[]);
    let banner = up.banner();
    let settings = block(&banner, "export ").join("\n");
    let mut cmd = shell(home, &format!("{settings}\n{tour}"));
    cmd.current_dir(home);
    let out = run_bounded(cmd, None, Duration::from_secs(60));
    assert_exit(&out, 0, &["session"]);
    let stdout = text(&out.stdout);
    // First the ranking, under its header: disk_usage first.
    let first = stdout.lines().nth(1).unwrap_or("");
    assert!(first.contains("disk_usage"), "{stdout}");
    // Then one JSON-RPC message a line.
    let messages: Vec<serde_json::Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let answer = |id: u64| {
        messages
            .iter()
            .find(|m| m["id"] == id)
            .unwrap_or_else(|| panic!("no answer to {id}: {stdout}"))
    };
    assert!(answer(1)["result"]["capabilities"]["tools"].is_object());
    let search = &answer(2)["result"];
    assert_eq!(
        search["structuredContent"]["results"][0]["name"], "disk_usage",
        "{search}"
    );
    let load = &answer(3)["result"];
    assert_ne!(load["isError"], true, "{load}");
    assert!(
        messages
            .iter()
            .any(|m| m["method"] == "notifications/tools/list_changed"),
        "{stdout}"
    );
    let call = &answer(4)["result"];
    assert_ne!(call["isError"], true, "{call}");
    assert!(
        call["content"][0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("/tmp")),
        "{call}"
    );
    up.stop();
}
