//! Call cgroups left under this process's own name, by an earlier process that had its pid (an
//! agent that is process 1 of a container, under a delegated cgroup that outlives it). Alone in
//! its test binary: the confiner it makes is this process's first, so its name is known.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use toolsrv_confine::{CallPlan, Confiner, Settings};

/// A v2 directory of this test's own under the process's cgroup, removed on drop
struct Delegated(PathBuf);

impl Delegated {
    fn new() -> Self {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let mount = mounts
            .lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                let (_, at, kind) = (f.next()?, f.next()?, f.next()?);
                (kind == "cgroup2").then(|| PathBuf::from(at))
            })
            .expect("a cgroup v2 hierarchy is mounted");
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let path = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .expect("this process's v2 cgroup");
        let dir = mount
            .join(path.trim_start_matches('/'))
            .join(format!("toolsrv-test-same-pid-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Delegated {
    fn drop(&mut self) {
        // Deepest first; each is empty of processes by now.
        let mut dirs: Vec<PathBuf> = walk(&self.0);
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for dir in dirs {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(walk(&entry.path()));
        }
    }
    out
}

#[test]
fn call_cgroups_left_under_this_processs_name_are_ended_and_do_not_clash() {
    let base = Delegated::new();
    // What the earlier process left: its first call cgroup, a process still in it.
    let left = base
        .0
        .join(format!("toolsrv-calls-{}.0/call-1", std::process::id()));
    std::fs::create_dir_all(&left).unwrap();
    let mut orphan = Command::new("sleep")
        .arg("300")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    std::fs::write(left.join("cgroup.procs"), orphan.id().to_string()).unwrap();

    let root = tempfile::tempdir().unwrap();
    let mut settings = Settings::new(Vec::new());
    settings.cgroup = Some(base.0.clone());
    settings.call_dir = root.path().join("calls");
    let confiner = Confiner::new(settings).unwrap();
    assert_eq!(
        confiner.abilities().kill,
        "cgroup.kill",
        "{:?}",
        confiner.abilities()
    );

    // The earlier process's call is ended...
    let deadline = Instant::now() + Duration::from_secs(5);
    let ended = loop {
        if let Some(status) = orphan.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = orphan.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        ended.is_some(),
        "the process left in {} lives on",
        left.display()
    );
    // ...and this one's first call gets a cgroup of that name.
    let tools = root.path().join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    let prepared = confiner.prepare(&CallPlan {
        tool_dir: &tools,
        cwd: None,
        grant: None,
        agent_env: &[],
        timeout: Duration::from_secs(10),
    });
    assert!(prepared.is_ok(), "{prepared:?}");
    drop(prepared);
    drop(confiner);
}
