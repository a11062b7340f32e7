//! Real processes confined by a real confiner: each claim proven by a shell command that tries it
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use toolsrv_confine::spawn::Spawned;
use toolsrv_confine::{CallPlan, ConfineError, Confiner, Grant, Level, Prepared, Settings};

struct World {
    root: tempfile::TempDir,
    confiner: Confiner,
    /// Start tools by fork and `pre_exec` (as bypass commands are) instead of the spawner
    fork: bool,
}

impl World {
    /// A confiner whose private files are `<root>/state` and `<root>/pki`, with `<root>` itself
    /// granted for reading, so the carving out is what keeps them unreadable
    fn new() -> Self {
        Self::with(|_| {})
    }

    fn with(adjust: impl FnOnce(&mut Settings)) -> Self {
        let root = tempfile::tempdir().unwrap();
        for dir in ["state/catalog", "pki", "tools", "public"] {
            std::fs::create_dir_all(root.path().join(dir)).unwrap();
        }
        std::fs::write(root.path().join("pki/agent-key.pem"), "SECRET KEY").unwrap();
        std::fs::write(root.path().join("state/blob"), "state").unwrap();
        std::fs::write(root.path().join("public/readme"), "public").unwrap();
        let mut settings = Settings::new(vec![root.path().join("state"), root.path().join("pki")]);
        settings.defaults.read.push(root.path().to_path_buf());
        settings.call_dir = root.path().join("calls");
        adjust(&mut settings);
        let confiner = Confiner::new(settings).unwrap();
        Self {
            root,
            confiner,
            fork: false,
        }
    }

    /// Prepares a call of a tool in `<root>/tools`, in `cwd` when given, with no grant.
    fn prepare(&self, cwd: Option<&Path>) -> Result<Prepared, ConfineError> {
        self.confiner.prepare(&CallPlan {
            tool_dir: &self.path("tools"),
            cwd,
            grant: None,
            agent_env: &[],
            timeout: Duration::from_secs(10),
        })
    }

    fn path(&self, p: &str) -> PathBuf {
        self.root.path().join(p)
    }

    fn run(&self, script: &str, grant: Option<&Grant>, cwd: Option<&Path>) -> (Output, PathBuf) {
        let agent_env: Vec<(OsString, OsString)> = vec![
            ("PATH".into(), "/usr/bin:/bin".into()),
            ("AGENT_SECRET".into(), "hunter2".into()),
        ];
        let tools = self.path("tools");
        let prepared = self
            .confiner
            .prepare(&CallPlan {
                tool_dir: &tools,
                cwd,
                grant,
                agent_env: &agent_env,
                timeout: Duration::from_secs(10),
            })
            .unwrap();
        let cwd = prepared.cwd.clone().unwrap();
        let env = prepared.env.clone().unwrap();
        let out = if self.fork {
            let mut cmd = Command::new("/bin/sh");
            cmd.arg("-c")
                .arg(script)
                .env_clear()
                .envs(env)
                .current_dir(&cwd)
                .stdin(Stdio::null());
            prepared.jail.install(&mut cmd);
            cmd.output().unwrap()
        } else {
            let args = [OsStr::new("/bin/sh"), OsStr::new("-c"), OsStr::new(script)];
            let spawned = prepared
                .jail
                .spawn(Path::new("/bin/sh"), &args, &env, &cwd)
                .expect("a confined call has a set-up to apply")
                .unwrap();
            collect(spawned)
        };
        prepared.jail.release();
        (out, cwd)
    }
}

/// Waits for a spawned process, reading its (non-blocking) stdout and stderr to the end.
fn collect(spawned: Spawned) -> Output {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    drop(spawned.stdin);
    let mut pipes = [
        (std::fs::File::from(spawned.stdout), Vec::new(), false),
        (std::fs::File::from(spawned.stderr), Vec::new(), false),
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while pipes.iter().any(|(_, _, done)| !done) {
        assert!(
            std::time::Instant::now() < deadline,
            "the tool's output did not end"
        );
        let mut idle = true;
        for (file, buf, done) in &mut pipes {
            if *done {
                continue;
            }
            let mut chunk = [0u8; 4096];
            match file.read(&mut chunk) {
                Ok(0) => *done = true,
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    idle = false;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("reading the tool's output: {e}"),
            }
        }
        if idle {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let status = match nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(spawned.pid), None) {
        Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => (code & 0xff) << 8,
        Ok(nix::sys::wait::WaitStatus::Signaled(_, signal, _)) => signal as i32,
        other => panic!("unexpected wait status {other:?}"),
    };
    let [(_, stdout, _), (_, stderr, _)] = pipes;
    Output {
        status: std::process::ExitStatus::from_raw(status),
        stdout,
        stderr,
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn this_host_enforces_everything() {
    let world = World::new();
    let a = world.confiner.abilities();
    assert_eq!(a.level, Level::Enforced, "{a:?}");
    assert!(a.landlock_abi >= 1, "{a:?}");
}

#[test]
fn the_agents_files_are_out_of_reach_and_the_rest_of_a_granted_directory_is_not() {
    let world = World::new();
    let key = world.path("pki/agent-key.pem");
    let state = world.path("state/blob");
    let public = world.path("public/readme");
    let script = format!(
        "cat {} && echo KEY-READ; cat {} && echo STATE-READ; ls {} && echo STATE-LISTED; cat {}",
        key.display(),
        state.display(),
        world.path("state").display(),
        public.display()
    );
    let (out, _) = world.run(&script, None, None);
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("SECRET"), "{stdout}");
    assert!(!stdout.contains("KEY-READ"), "{stdout}");
    assert!(!stdout.contains("STATE-READ"), "{stdout}");
    assert!(!stdout.contains("STATE-LISTED"), "{stdout}");
    assert!(stdout.contains("public"), "{stdout} {}", text(&out.stderr));
}

#[test]
fn writes_land_only_in_the_private_directory() {
    let world = World::new();
    let outside = world.path("public/written");
    let script = format!(
        "echo a > \"$PWD/in-pwd\" && echo b > \"$TMPDIR/in-tmp\" && cat \"$HOME/in-pwd\" \"$TMPDIR/in-tmp\"; \
         echo c > {} && echo OUTSIDE-WRITTEN; echo d > /tmp/toolsrv-confine-test && echo TMP-WRITTEN; pwd",
        outside.display()
    );
    let (out, cwd) = world.run(&script, None, None);
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("a\nb\n"),
        "{stdout} {}",
        text(&out.stderr)
    );
    assert!(!stdout.contains("WRITTEN"), "{stdout}");
    assert!(!outside.exists());
    assert!(stdout.contains(cwd.to_str().unwrap()));
    assert!(
        !cwd.exists(),
        "the private directory is removed after the call"
    );
}

#[test]
fn the_agents_environment_stays_out_but_path_and_the_contract_are_in() {
    let world = World::new();
    let (out, cwd) = world.run("env", None, None);
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("hunter2"), "{stdout}");
    for want in [
        "PATH=/usr/bin:/bin".to_string(),
        format!("PWD={}", cwd.display()),
        format!("TMPDIR={}", cwd.display()),
        format!("HOME={}", cwd.display()),
        format!("OLLIE_TOOLS_PATH={}", world.path("tools").display()),
    ] {
        assert!(stdout.lines().any(|l| l == want), "{want} in {stdout}");
    }
}

#[test]
fn a_grant_widens_and_a_caller_cwd_is_readable_only() {
    let world = World::new();
    let shared = world.path("shared");
    std::fs::create_dir_all(&shared).unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("f"), "outside").unwrap();
    let grant = Grant {
        write: vec![shared.clone(), world.path("pki")],
        env: vec!["AGENT_*".into()],
        ..Grant::default()
    };
    let script = format!(
        "echo x > {}/granted && echo GRANTED; echo y > {}/forged && echo PKI-WRITTEN; echo $AGENT_SECRET; cat f; echo z > g && echo CWD-WRITTEN",
        shared.display(),
        world.path("pki").display()
    );
    let (out, cwd) = world.run(&script, Some(&grant), Some(outside.path()));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("GRANTED"), "{stdout} {}", text(&out.stderr));
    assert!(
        !stdout.contains("PKI-WRITTEN"),
        "a grant cannot reach the agent's files: {stdout}"
    );
    assert!(
        stdout.contains("hunter2"),
        "the grant passes AGENT_*: {stdout}"
    );
    assert!(
        stdout.contains("outside"),
        "the caller's cwd is readable: {stdout}"
    );
    assert!(
        !stdout.contains("CWD-WRITTEN"),
        "but not writable: {stdout}"
    );
    assert_eq!(cwd, std::fs::canonicalize(outside.path()).unwrap());
}

/// Another call's private directory stays out of reach, whatever working directory the caller
/// names: above it (`--cwd /` read every call's files), or in it (refused).
#[test]
fn a_caller_cwd_opens_no_other_call_s_directory() {
    let world = World::new();
    let other = world.prepare(None).unwrap();
    let private = other.cwd.clone().unwrap();
    std::fs::write(private.join("secret"), "other-call-secret").unwrap();
    let above = world.path("calls").parent().unwrap().to_path_buf();
    std::fs::write(above.join("beside"), "beside-the-calls").unwrap();
    let script = format!(
        "cat {}/secret; ls {}; cat beside",
        private.display(),
        world.path("calls").display()
    );
    let (out, _) = world.run(&script, None, Some(&above));
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("other-call-secret"), "{stdout}");
    assert!(
        !stdout.contains(private.file_name().unwrap().to_str().unwrap()),
        "the calls' directory cannot be listed: {stdout}"
    );
    assert!(
        stdout.contains("beside-the-calls"),
        "the rest of the caller's cwd is readable: {stdout} {}",
        text(&out.stderr)
    );
    let err = world.prepare(Some(&private)).unwrap_err();
    assert!(err.to_string().contains("private files"), "{err}");
    other.jail.release();
}

/// A call may make files, directories and pipes in its private directory, not devices: as
/// root, a character device there was a way to the kernel log (and a block device to a disk).
#[test]
fn a_call_makes_no_device_even_where_it_may_write() {
    if !nix::unistd::Uid::effective().is_root() {
        panic!("this test needs root (to make device nodes at all)");
    }
    let world = World::new();
    let (out, _) = world.run(
        "mknod kmsg c 1 11 && echo CHAR; mknod disk b 7 0 && echo BLOCK; mkfifo pipe && echo FIFO",
        None,
        None,
    );
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("CHAR"), "{stdout}");
    assert!(!stdout.contains("BLOCK"), "{stdout}");
    assert!(stdout.contains("FIFO"), "{stdout} {}", text(&out.stderr));
}

/// A tool running as root keeps what inspecting and managing a host needs, not what would undo
/// its confinement: it cannot raise its own limits, make a file immutable (the agent could not
/// remove the call's directory after it), and its bounding set lacks every dropped capability.
#[test]
fn a_root_tool_cannot_undo_its_limits_or_pin_its_files() {
    if !nix::unistd::Uid::effective().is_root() {
        panic!("this test needs root (capabilities)");
    }
    let world = World::new();
    let script = "grep CapBnd /proc/self/status; \
                  ulimit -Hn 999999 2>/dev/null && echo RAISED; \
                  touch f && chattr +i f 2>/dev/null && echo IMMUTABLE; \
                  hostname >/dev/null && echo STILL-ROOT";
    let (out, cwd) = world.run(script, None, None);
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("RAISED"), "{stdout}");
    assert!(!stdout.contains("IMMUTABLE"), "{stdout}");
    assert!(
        stdout.contains("STILL-ROOT"),
        "{stdout} {}",
        text(&out.stderr)
    );
    let bounding = stdout
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
        .unwrap_or_else(|| panic!("no CapBnd: {stdout}"));
    for (cap, name) in toolsrv_confine::DROPPED_CAPABILITIES {
        assert_eq!(bounding & (1 << cap), 0, "{name} kept: {bounding:x}");
    }
    // CAP_SYS_ADMIN (21) and CAP_NET_ADMIN (12) stay.
    assert_ne!(bounding & (1 << 21), 0, "{bounding:x}");
    assert_ne!(bounding & (1 << 12), 0, "{bounding:x}");
    // And the call's directory was removed.
    assert!(!cwd.exists(), "{} left behind", cwd.display());
}

/// A process of the agent's user outside the call (the agent, its warden, another caller's
/// call) is out of reach of a root tool: neither its limits nor its scheduling change; the tool
/// still changes its own, and `clone3`, which could start a child in another cgroup, is
/// unavailable.
#[test]
fn a_root_tool_cannot_change_other_processes_of_its_user() {
    if !nix::unistd::Uid::effective().is_root() {
        panic!("this test needs root (the same user as the process out of reach)");
    }
    let mut victim = Command::new("sleep").arg("60").spawn().unwrap();
    let pid = victim.id();
    let limits_before = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let world = World::new();
    let script = format!(
        "prlimit --pid {pid} --nofile=0:0 2>/dev/null && echo PRLIMIT-OTHER; \
         renice -n 5 -p {pid} >/dev/null 2>&1 && echo RENICE-OTHER; \
         renice -n 5 -u root >/dev/null 2>&1 && echo RENICE-USER; \
         ionice -c 3 -p {pid} 2>/dev/null && echo IONICE-OTHER; \
         taskset -p 1 {pid} >/dev/null 2>&1 && echo TASKSET-OTHER; \
         chrt -b -p 0 {pid} >/dev/null 2>&1 && echo CHRT-OTHER; \
         ulimit -n 100 && echo ULIMIT-SELF; \
         prlimit --nofile=90:90 sh -c 'ulimit -n' ; \
         nice -n 5 true && echo NICE-SELF; \
         ionice -c 3 true && echo IONICE-SELF; \
         taskset -c 0 true && echo TASKSET-SELF; \
         /usr/bin/python3 -c 'import ctypes; r = ctypes.CDLL(None, use_errno=True).syscall(435, 0, 0); print(\"CLONE3\", r, ctypes.get_errno())'; \
         sh -c 'echo CHILD-RAN'"
    );
    let (out, _) = world.run(&script, None, None);
    let stdout = text(&out.stdout);
    let limits_after = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let _ = victim.kill();
    let _ = victim.wait();
    assert_eq!(limits_before, limits_after);
    for other in [
        "PRLIMIT-OTHER",
        "RENICE-OTHER",
        "RENICE-USER",
        "IONICE-OTHER",
        "TASKSET-OTHER",
        "CHRT-OTHER",
    ] {
        assert!(!stdout.contains(other), "{other}: {stdout}");
    }
    for own in [
        "ULIMIT-SELF",
        "\n90\n",
        "NICE-SELF",
        "IONICE-SELF",
        "TASKSET-SELF",
        "CHILD-RAN",
    ] {
        assert!(
            stdout.contains(own),
            "{own}: {stdout} {}",
            text(&out.stderr)
        );
    }
    // ENOSYS (38): libc then starts children with clone, as on a kernel before 5.3.
    assert!(
        stdout.contains("CLONE3 -1 38"),
        "{stdout} {}",
        text(&out.stderr)
    );
}

/// `--cgroup` naming a directory that is no cgroup stops the agent, naming it: every call
/// would fail to join its cgroup.
#[test]
fn a_cgroup_directory_that_is_no_cgroup_is_refused_at_start() {
    let root = tempfile::tempdir().unwrap();
    let plain = root.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    let mut settings = Settings::new(Vec::new());
    settings.call_dir = root.path().join("calls");
    settings.cgroup = Some(plain.clone());
    let e = Confiner::new(settings).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "cannot make call cgroups under --cgroup {}: {} is not a cgroup v2 directory",
            plain.display(),
            plain.display()
        )),
        "{e}"
    );
    // Nothing was made in it.
    assert_eq!(std::fs::read_dir(&plain).unwrap().count(), 0);
}

/// Private directories of calls whose agent is gone (killed outright, before it removed them)
/// are removed when an agent starts; those of running processes, and names it did not make,
/// are left.
#[test]
fn private_directories_of_agents_gone_are_removed_at_start() {
    let own = std::process::id();
    let mut calls = PathBuf::new();
    let world = World::with(|settings| {
        calls = settings.call_dir.clone();
        for name in [
            "call-999999999-0123456789abcdef".to_string(),
            "call-1-0123456789abcdef".to_string(),
            format!("call-{own}-0123456789abcdef"),
            "call-0123456789abcdef".to_string(),
        ] {
            std::fs::create_dir_all(calls.join(&name).join("sub")).unwrap();
            std::fs::write(calls.join(&name).join("sub/file"), "left").unwrap();
        }
        // A link named like a gone agent's directory is not followed.
        let kept = calls.parent().unwrap().join("kept");
        std::fs::create_dir_all(&kept).unwrap();
        std::fs::write(kept.join("file"), "kept").unwrap();
        std::os::unix::fs::symlink(&kept, calls.join("call-999999998-0123456789abcdef")).unwrap();
    });
    let left: Vec<String> = std::fs::read_dir(&calls)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        !left.contains(&"call-999999999-0123456789abcdef".to_string()),
        "{left:?}"
    );
    for kept in [
        "call-1-0123456789abcdef".to_string(),
        format!("call-{own}-0123456789abcdef"),
        "call-0123456789abcdef".to_string(),
    ] {
        assert!(left.contains(&kept), "{kept} removed: {left:?}");
    }
    assert!(world.root.path().join("kept/file").exists());
}

#[test]
fn a_cwd_among_the_agents_files_is_refused() {
    let world = World::new();
    let state = world.path("state");
    let err = world.prepare(Some(&state)).unwrap_err();
    assert!(err.to_string().contains("private files"), "{err}");
}

#[test]
fn without_network_tcp_connect_fails() {
    let world = World::new();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let script = format!("exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED");
    let bash = |grant: Option<&Grant>| {
        let (out, _) = world.run(&format!("bash -c '{script}'"), grant, None);
        text(&out.stdout)
    };
    assert!(
        bash(None).contains("CONNECTED"),
        "network is allowed by default"
    );
    let offline = Grant {
        network: Some(false),
        ..Grant::default()
    };
    assert!(!bash(Some(&offline)).contains("CONNECTED"));
}

#[test]
fn a_forked_child_is_confined_the_same_way() {
    let mut world = World::new();
    world.fork = true;
    let key = world.path("pki/agent-key.pem");
    let outside = world.path("public/written");
    let script = format!(
        "cat {} && echo KEY-READ; echo c > {} && echo OUTSIDE-WRITTEN; echo \"$AGENT_SECRET\"; echo ok > \"$PWD/f\" && cat f",
        key.display(),
        outside.display()
    );
    let (out, _) = world.run(&script, None, None);
    let stdout = text(&out.stdout);
    assert!(
        !stdout.contains("READ") && !stdout.contains("WRITTEN"),
        "{stdout}"
    );
    assert!(!stdout.contains("hunter2"), "{stdout}");
    assert!(stdout.ends_with("ok\n"), "{stdout} {}", text(&out.stderr));
}

/// The spawner's child shares the agent's memory; its signal handling must still be a fresh
/// process's: SIGPIPE ends `yes` quietly (Rust programs ignore SIGPIPE, and an ignored SIGPIPE
/// would be inherited, making `yes` fail with an error message instead).
#[test]
fn a_spawned_tool_gets_default_signal_handling_and_its_own_process_group() {
    let world = World::new();
    let (out, _) = world.run(
        "yes | head -n 1; ps -o pgid= -p $$; ps -o pgid= -p $PPID",
        None,
        None,
    );
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(stdout.starts_with("y\n"), "{stdout} {stderr}");
    assert!(!stderr.contains("Broken pipe"), "{stderr}");
    let groups: Vec<&str> = stdout.lines().skip(1).map(str::trim).collect();
    assert_eq!(groups.len(), 2, "{stdout} {stderr}");
    assert_ne!(
        groups[0], groups[1],
        "the tool leads a group of its own: {stdout}"
    );
}

#[test]
fn the_spawner_reports_what_kept_the_program_from_running() {
    let world = World::new();
    let tools = world.path("tools");
    let agent_env: Vec<(OsString, OsString)> = vec![("PATH".into(), "/usr/bin:/bin".into())];
    let plan = CallPlan {
        tool_dir: &tools,
        cwd: None,
        grant: None,
        agent_env: &agent_env,
        timeout: Duration::from_secs(10),
    };

    // A program that is not there: the OS error alone, as std reports it.
    let prepared = world.confiner.prepare(&plan).unwrap();
    let missing = world.path("tools/missing");
    let err = prepared
        .jail
        .spawn(
            &missing,
            &[missing.as_os_str()],
            &[],
            &prepared.cwd.clone().unwrap(),
        )
        .unwrap()
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{err}");
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
    prepared.jail.release();

    // A working directory that is gone: says which step failed.
    let prepared = world.confiner.prepare(&plan).unwrap();
    let gone = world.path("no-such-dir");
    let err = prepared
        .jail
        .spawn(Path::new("/bin/true"), &[OsStr::new("true")], &[], &gone)
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("working directory"), "{err}");
    // The set-up was used up: a second start is not confined again, it is refused.
    assert!(
        prepared
            .jail
            .spawn(Path::new("/bin/true"), &[OsStr::new("true")], &[], &gone)
            .is_none()
    );
    prepared.jail.release();

    // An argument with a NUL byte cannot be passed: refused before anything starts.
    let prepared = world.confiner.prepare(&plan).unwrap();
    let cwd = prepared.cwd.clone().unwrap();
    let bad = OsStr::new("a\0b");
    let err = prepared
        .jail
        .spawn(
            Path::new("/bin/echo"),
            &[OsStr::new("echo"), bad],
            &[],
            &cwd,
        )
        .unwrap()
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
    prepared.jail.release();
}

/// The spawned child shares the agent's memory and switches user with raw system calls, which
/// act on the child alone: after a call as `nobody`, every thread of this process is still root.
#[test]
fn running_a_tool_as_another_user_leaves_the_agents_threads_alone() {
    if !nix::unistd::Uid::effective().is_root() {
        panic!("this test needs root (to switch users)");
    }
    let world = World::with(|s| s.run_as = Some("nobody".into()));
    // Threads of our own, parked while the tool runs, like an agent's runtime.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let parked: Vec<_> = (0..4)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        })
        .collect();
    let (out, _) = world.run("id -u; id -g; id -G", None, None);
    let stdout = text(&out.stdout);
    assert_eq!(
        stdout,
        "65534\n65534\n65534\n",
        "{stdout} {}",
        text(&out.stderr)
    );
    let mut threads = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        // A thread of another test may end between the listing and the read.
        let Ok(status) = std::fs::read_to_string(task.unwrap().path().join("status")) else {
            continue;
        };
        for line in status
            .lines()
            .filter(|l| l.starts_with("Uid:") || l.starts_with("Gid:"))
        {
            assert!(
                line.split_whitespace().skip(1).all(|id| id == "0"),
                "a thread of the agent changed identity: {line}"
            );
        }
        threads += 1;
    }
    assert!(threads >= 5, "{threads} threads looked at");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in parked {
        t.join().unwrap();
    }
}

/// The default calls' directory has a name known in advance (`/tmp/toolsrv-calls.<uid>`):
/// another local user who made it first gets a new directory of the agent's own used beside
/// it, not an agent that cannot start. One the operator chose (`--call-dir`) is used as it
/// is, or refused.
#[test]
fn a_default_calls_directory_someone_else_made_is_not_used_nor_a_reason_to_stop() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test gives a directory to another user, which needs root (as CI runs)"
    );
    let root = tempfile::tempdir().unwrap();
    let taken = root.path().join("toolsrv-calls.0");
    std::fs::create_dir(&taken).unwrap();
    std::os::unix::fs::chown(&taken, Some(65534), Some(65534)).unwrap();
    let settings = |chosen: bool| {
        let mut s = Settings::new(vec![root.path().join("state")]);
        s.call_dir = taken.clone();
        s.call_dir_chosen = chosen;
        s
    };
    let Err(err) = Confiner::new(settings(true)) else {
        panic!("a chosen calls' directory someone else made is used");
    };
    assert!(
        err.to_string()
            .contains("not a directory owned by the agent's user"),
        "{err}"
    );

    let confiner = Confiner::new(settings(false)).expect("a default one taken is worked around");
    let prepared = confiner
        .prepare(&CallPlan {
            tool_dir: root.path(),
            cwd: None,
            grant: None,
            agent_env: &[],
            timeout: Duration::from_secs(10),
        })
        .unwrap();
    let cwd = prepared.cwd.clone().unwrap();
    assert!(!cwd.starts_with(&taken), "{}", cwd.display());
    assert!(
        cwd.parent()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("toolsrv-calls.0.")),
        "{}",
        cwd.display()
    );
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(cwd.parent().unwrap()).unwrap().uid(), 0);
    prepared.jail.release();
}
