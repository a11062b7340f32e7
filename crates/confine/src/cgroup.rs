//! A cgroup per call: where the agent may make them (v2, v1 or both), the call's limits, killing every process of a call, and clean-up
//!
//! cgroup v2 is used where the agent's cgroup (or the `--cgroup` directory) can have children:
//! a child has `cgroup.kill`, which ends every process of the call, `setsid` and double-forked
//! daemons included, and carries `pids.max`, `memory.max` and `cpu.max` for the controllers
//! enabled there. A controller v2 does not offer is taken from its v1 hierarchy where one is
//! mounted (a hybrid host: v1 controllers beside a v2 tree without them). Every call's process
//! joins all of the call's cgroups before it executes the tool, so nothing it starts is outside.
//!
//! Layout: `<base>/toolsrv-calls-<agent pid>.<n>/call-<n>` in each hierarchy used. Directories of an
//! agent that is gone are swept when an agent starts.

use std::io::{self, ErrorKind};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::error::ConfineError;
use crate::profile::Limits;
use crate::warden::{Warden, WardenStart};

/// A resource controller the agent uses
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Controller {
    Pids,
    Memory,
    Cpu,
}

impl Controller {
    pub const ALL: [Controller; 3] = [Controller::Pids, Controller::Memory, Controller::Cpu];

    pub fn name(self) -> &'static str {
        match self {
            Controller::Pids => "pids",
            Controller::Memory => "memory",
            Controller::Cpu => "cpu",
        }
    }
}

/// CFS period used for `cpu.max` and `cpu.cfs_period_us`
const CPU_PERIOD_US: u64 = 100_000;
/// Prefix of an agent's directory of call cgroups
pub(crate) const AGENT_PREFIX: &str = "toolsrv-calls-";

/// The cgroup hierarchies of this host as the agent can use them
#[derive(Debug)]
pub struct Cgroups {
    /// The v2 directory holding this agent's call cgroups, and the controllers enabled in it
    v2: Option<(PathBuf, Vec<Controller>)>,
    /// Whether v2 call cgroups have `cgroup.kill`
    kill_file: bool,
    /// Per controller taken from v1: the directory holding this agent's call cgroups
    v1: Vec<(Controller, PathBuf)>,
    next: AtomicU64,
    /// Why the v2 tree is not used, when it is not
    pub v2_problem: Option<String>,
    /// Ends the calls if the agent is gone without ending them
    warden: Option<Warden>,
}

/// What /proc/self/mounts and /proc/self/cgroup say
#[derive(Debug, Default, PartialEq, Eq)]
struct Found {
    v2_mount: Option<PathBuf>,
    v2_path: Option<String>,
    v1: Vec<(Controller, PathBuf, String)>,
}

fn parse_proc(mounts: &str, own: &str) -> Found {
    let mut found = Found::default();
    let mut v1_mounts: Vec<(Vec<String>, PathBuf)> = Vec::new();
    for line in mounts.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [_, mountpoint, fstype, options, ..] = fields[..] else {
            continue;
        };
        let mountpoint = PathBuf::from(mountpoint.replace("\\040", " "));
        match fstype {
            "cgroup2" if found.v2_mount.is_none() => found.v2_mount = Some(mountpoint),
            "cgroup" => {
                v1_mounts.push((options.split(',').map(str::to_owned).collect(), mountpoint))
            }
            _ => {}
        }
    }
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if controllers.is_empty() {
            found.v2_path = Some(path.to_owned());
            continue;
        }
        for c in Controller::ALL {
            if controllers.split(',').any(|n| n == c.name())
                && let Some((_, mount)) = v1_mounts
                    .iter()
                    .find(|(opts, _)| opts.iter().any(|o| o == c.name()))
            {
                found.v1.push((c, mount.clone(), path.to_owned()));
            }
        }
    }
    found
}

fn below(mount: &Path, path: &str) -> PathBuf {
    mount.join(path.trim_start_matches('/'))
}

fn write_file(path: &Path, text: &str) -> io::Result<()> {
    std::fs::write(path, text)
}

fn read_controllers(dir: &Path) -> Vec<Controller> {
    let text = std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
    Controller::ALL
        .into_iter()
        .filter(|c| text.split_whitespace().any(|n| n == c.name()))
        .collect()
}

/// Pids listed in a cgroup's `cgroup.procs`
fn procs(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Whether a process `pid` exists: one of another user's (another agent's, running as
/// root while this one does not) exists too, though this process may not signal it.
pub(crate) fn pid_alive(pid: i32) -> bool {
    !matches!(
        kill(Pid::from_raw(pid), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

/// Waits between retries while the kernel lets go of a call's processes or cgroup: short at
/// first (usually a few microseconds suffice, and a call's result waits for this), doubling to
/// 10 ms; about half a second in all.
fn retry_pauses() -> impl Iterator<Item = Duration> {
    (0..u32::MAX)
        .map(|i| Duration::from_micros(20u64 << i.min(9)).min(Duration::from_millis(10)))
        .take(60)
}

/// SIGKILL to every process listed in `dir`, again until none is left (bounded)
fn kill_listed(dir: &Path) {
    for pause in retry_pauses() {
        let pids = procs(dir);
        if pids.is_empty() {
            return;
        }
        for pid in pids {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        std::thread::sleep(pause);
    }
}

/// Removes an empty cgroup directory, retrying a moment while its last processes are reaped
fn remove_cgroup(dir: &Path) -> io::Result<()> {
    let mut last = Ok(());
    for pause in retry_pauses() {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => last = Err(e),
        }
        std::thread::sleep(pause);
    }
    last
}

/// The pid of the agent a directory of call cgroups is named for (`toolsrv-calls-<pid>.<n>`)
pub(crate) fn agent_of(name: &str) -> Option<i32> {
    let (pid, n) = name.strip_prefix(AGENT_PREFIX)?.split_once('.')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse::<i32>().ok().filter(|pid| *pid > 0)
}

/// Kills and removes the call cgroups of agents that are gone, and those left under this
/// agent's own name
fn sweep(parent: &Path, own: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(pid) = entry.file_name().to_str().and_then(agent_of) else {
            continue;
        };
        // A directory of this agent's own name was left by an earlier process with its pid
        // (an agent that is process 1 of a container, under a delegated cgroup that outlives
        // it): its calls are not this agent's, and their names would clash with this agent's.
        if path != own && pid_alive(pid) {
            continue;
        }
        let ended = end_left_behind(&path);
        if ended > 0 {
            tracing::warn!(
                agent_pid = pid,
                processes = ended,
                "the calls of an agent that is gone were still running: ended them and removed \
                 their cgroups"
            );
        }
    }
}

/// Whether `dir` is in a cgroup file system (v2 or v1): what is taken for a call cgroup and
/// killed must be one, whatever a directory's name says
fn in_cgroupfs(dir: &Path) -> io::Result<bool> {
    use nix::sys::statfs::{CGROUP_SUPER_MAGIC, CGROUP2_SUPER_MAGIC, statfs};
    let kind = statfs(dir).map_err(io::Error::from)?.filesystem_type();
    Ok(kind == CGROUP2_SUPER_MAGIC || kind == CGROUP_SUPER_MAGIC)
}

/// Kills everything in an agent's call cgroups (its subdirectories named `call-N`, links not
/// followed) and removes them; returns how many processes were found there. A directory that
/// is not in a cgroup file system is left alone.
pub(crate) fn end_left_behind(dir: &Path) -> usize {
    let mut found = 0;
    match in_cgroupfs(dir) {
        Ok(true) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => return 0,
        Ok(false) => {
            tracing::warn!(dir = %dir.display(), "not a cgroup: its subdirectories are not ended as calls");
            return 0;
        }
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot tell whether this is a cgroup: its calls are not ended");
            return 0;
        }
    }
    let calls = match std::fs::read_dir(dir) {
        Ok(calls) => Some(calls),
        Err(e) if e.kind() == ErrorKind::NotFound => None,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot list the call cgroups left behind");
            None
        }
    };
    if let Some(calls) = calls {
        let is_call = |e: &std::fs::DirEntry| {
            e.file_type().is_ok_and(|t| t.is_dir())
                && e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_prefix("call-"))
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        };
        for call in calls.flatten().filter(is_call) {
            let path = call.path();
            found += procs(&path).len();
            if path.join("cgroup.kill").exists() {
                let _ = write_file(&path.join("cgroup.kill"), "1");
            }
            kill_listed(&path);
            if let Err(e) = remove_cgroup(&path) {
                tracing::warn!(cgroup = %path.display(), error = %e, "cannot remove a call cgroup left behind");
            }
        }
    }
    if let Err(e) = remove_cgroup(dir) {
        tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove the call cgroups left behind");
    }
    found
}

impl Cgroups {
    /// Finds where this agent can make call cgroups: under `v2_base` (a delegated v2 directory)
    /// or the agent's own v2 cgroup, controllers v2 lacks from v1. `None` when no hierarchy is
    /// usable at all.
    pub fn setup(v2_base: Option<&Path>) -> Option<Self> {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let found = parse_proc(&mounts, &own);
        // Several confiners may live in one process (tests): each has its own directory.
        static INSTANCE: AtomicU64 = AtomicU64::new(0);
        let instance = INSTANCE.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{AGENT_PREFIX}{}.{instance}", std::process::id());
        let mut cgroups = Cgroups {
            v2: None,
            kill_file: false,
            v1: Vec::new(),
            next: AtomicU64::new(1),
            v2_problem: None,
            warden: None,
        };
        let base = v2_base
            .map(Path::to_path_buf)
            .or_else(|| Some(below(found.v2_mount.as_deref()?, found.v2_path.as_deref()?)));
        match base {
            Some(base) => match setup_v2(&base, &tag, v2_base.is_none()) {
                Ok((dir, controllers)) => cgroups.v2 = Some((dir, controllers)),
                Err(why) => cgroups.v2_problem = Some(why),
            },
            None => cgroups.v2_problem = Some("no cgroup v2 hierarchy is mounted".into()),
        }
        let in_v2 = |c: Controller| {
            cgroups
                .v2
                .as_ref()
                .is_some_and(|(_, controllers)| controllers.contains(&c))
        };
        let mut v1 = Vec::new();
        for (controller, mount, path) in &found.v1 {
            if in_v2(*controller) || v1.iter().any(|(c, _)| c == controller) {
                continue;
            }
            let parent = below(mount, path);
            let dir = parent.join(&tag);
            sweep(&parent, &dir);
            match std::fs::create_dir(&dir) {
                Ok(()) => v1.push((*controller, dir)),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => v1.push((*controller, dir)),
                Err(e) => tracing::info!(
                    controller = controller.name(), dir = %dir.display(), error = %e,
                    "cannot use the cgroup v1 controller"
                ),
            }
        }
        cgroups.v1 = v1;
        if let Some((dir, _)) = &cgroups.v2 {
            cgroups.kill_file = dir.join("cgroup.kill").exists();
        }
        (cgroups.v2.is_some() || !cgroups.v1.is_empty()).then_some(cgroups)
    }

    /// "v2", "v1", "hybrid" (v2 beside v1 controllers)
    pub fn version(&self) -> &'static str {
        match (self.v2.is_some(), self.v1.is_empty()) {
            (true, true) => "v2",
            (true, false) => "hybrid",
            (false, _) => "v1",
        }
    }

    /// The controllers that limit calls, each with the hierarchy it comes from
    pub fn controllers(&self) -> Vec<(Controller, &'static str)> {
        let mut list: Vec<(Controller, &'static str)> = self
            .v2
            .iter()
            .flat_map(|(_, cs)| cs.iter().map(|c| (*c, "v2")))
            .chain(self.v1.iter().map(|(c, _)| (*c, "v1")))
            .collect();
        list.sort();
        list
    }

    pub fn has(&self, controller: Controller) -> bool {
        self.controllers().iter().any(|(c, _)| *c == controller)
    }

    /// Whether a call's processes are ended with `cgroup.kill` (else by signalling each, again
    /// until none is left)
    pub fn kill_file(&self) -> bool {
        self.kill_file
    }

    /// The directories holding this agent's call cgroups, one per hierarchy used
    fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.v2
            .iter()
            .map(|(d, _)| d.as_path())
            .chain(self.v1.iter().map(|(_, d)| d.as_path()))
    }

    /// Starts `program` (this binary) as the warden of the call cgroups, which ends every call
    /// left running if this process ends without ending them (see [`crate::warden`])
    pub fn start_warden(&mut self, how: &WardenStart) -> std::io::Result<()> {
        let dirs: Vec<&Path> = self.dirs().collect();
        let warden = Warden::start(how, &dirs)?;
        self.warden = Some(warden);
        Ok(())
    }

    /// Makes the cgroups of one call with `limits` and opens their `cgroup.procs` for the call's
    /// process to join
    pub fn create(&self, limits: &Limits) -> Result<(CallCgroup, Vec<OwnedFd>), ConfineError> {
        let name = format!("call-{}", self.next.fetch_add(1, Ordering::Relaxed));
        let mut call = CallCgroup {
            v2: None,
            v1: Vec::new(),
            kill_file: self.kill_file,
        };
        let mut joins = Vec::new();
        if let Some((parent, controllers)) = &self.v2 {
            let dir = parent.join(&name);
            std::fs::create_dir(&dir)
                .map_err(|e| ConfineError::io("create the call cgroup", &dir, e))?;
            call.v2 = Some((dir.clone(), controllers.clone()));
            for c in controllers {
                set_v2_limit(&dir, *c, limits)?;
            }
            joins.push(open_procs(&dir)?);
        }
        for (c, parent) in &self.v1 {
            let dir = parent.join(&name);
            std::fs::create_dir(&dir)
                .map_err(|e| ConfineError::io("create the call cgroup", &dir, e))?;
            call.v1.push((*c, dir.clone()));
            set_v1_limit(&dir, *c, limits)?;
            joins.push(open_procs(&dir)?);
        }
        Ok((call, joins))
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for dir in self.dirs() {
            end_left_behind(dir);
        }
        // Then the warden's pipe closes (the field drops), and it finds nothing left.
    }
}

/// Sets up `<base>/<tag>` in the v2 tree with every usable controller enabled; returns it and
/// those controllers, or why v2 cannot be used
fn setup_v2(base: &Path, tag: &str, own: bool) -> Result<(PathBuf, Vec<Controller>), String> {
    use nix::sys::statfs::{CGROUP2_SUPER_MAGIC, statfs};
    match statfs(base) {
        Ok(fs) if fs.filesystem_type() == CGROUP2_SUPER_MAGIC => {}
        Ok(_) => return Err(format!("{} is not a cgroup v2 directory", base.display())),
        Err(e) => return Err(format!("cannot look at {}: {e}", base.display())),
    }
    let dir = base.join(tag);
    sweep(base, &dir);
    if let Err(e) = std::fs::create_dir(&dir)
        && e.kind() != ErrorKind::AlreadyExists
    {
        return Err(format!("cannot create {}: {e}", dir.display()));
    }
    let available = read_controllers(base);
    let mut enabled = Vec::new();
    for c in available {
        let control = base.join("cgroup.subtree_control");
        let mut result = write_file(&control, &format!("+{}", c.name()));
        if matches!(&result, Err(e) if e.raw_os_error() == Some(libc::EBUSY))
            && own
            && procs(base) == [std::process::id() as i32]
        {
            // The agent's own cgroup holds only the agent: a delegated service cgroup. Controllers
            // can be enabled for children only once no process is left in it, so the agent
            // moves to a leaf of its own.
            let leaf = base.join("toolsrv-agent");
            let moved = std::fs::create_dir(&leaf)
                .or_else(|e| {
                    if e.kind() == ErrorKind::AlreadyExists {
                        Ok(())
                    } else {
                        Err(e)
                    }
                })
                .and_then(|()| {
                    write_file(&leaf.join("cgroup.procs"), &std::process::id().to_string())
                });
            if moved.is_ok() {
                result = write_file(&control, &format!("+{}", c.name()));
            }
        }
        if result.is_ok()
            && write_file(
                &dir.join("cgroup.subtree_control"),
                &format!("+{}", c.name()),
            )
            .is_ok()
        {
            enabled.push(c);
        }
    }
    Ok((dir, enabled))
}

fn open_procs(dir: &Path) -> Result<OwnedFd, ConfineError> {
    let path = dir.join("cgroup.procs");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .map(OwnedFd::from)
        .map_err(|e| ConfineError::io("open for writing", path, e))
}

fn set(dir: &Path, file: &str, value: &str) -> Result<(), ConfineError> {
    let path = dir.join(file);
    write_file(&path, value).map_err(|e| ConfineError::io("set the call limit in", path, e))
}

/// Sets a file that not every kernel has; one that is missing is fine
fn set_optional(dir: &Path, file: &str, value: &str) {
    let path = dir.join(file);
    if path.exists()
        && let Err(e) = write_file(&path, value)
    {
        tracing::debug!(file = %path.display(), error = %e, "cannot set an optional cgroup file");
    }
}

fn set_v2_limit(dir: &Path, c: Controller, limits: &Limits) -> Result<(), ConfineError> {
    match c {
        Controller::Pids => {
            if let Some(n) = limits.pids {
                set(dir, "pids.max", &n.to_string())?;
            }
        }
        Controller::Memory => {
            if let Some(bytes) = limits.memory {
                set(dir, "memory.max", &bytes.to_string())?;
                // Swap would let a call go past its limit; and the whole call ends on OOM.
                set_optional(dir, "memory.swap.max", "0");
                set_optional(dir, "memory.oom.group", "1");
            }
        }
        Controller::Cpu => {
            if let Some(millis) = limits.cpu_millis {
                let quota = u64::from(millis) * CPU_PERIOD_US / 1000;
                set(
                    dir,
                    "cpu.max",
                    &format!("{} {CPU_PERIOD_US}", quota.max(1000)),
                )?;
            }
        }
    }
    Ok(())
}

fn set_v1_limit(dir: &Path, c: Controller, limits: &Limits) -> Result<(), ConfineError> {
    match c {
        Controller::Pids => {
            if let Some(n) = limits.pids {
                set(dir, "pids.max", &n.to_string())?;
            }
        }
        Controller::Memory => {
            if let Some(bytes) = limits.memory {
                set(dir, "memory.limit_in_bytes", &bytes.to_string())?;
                set_optional(dir, "memory.memsw.limit_in_bytes", &bytes.to_string());
            }
        }
        Controller::Cpu => {
            if let Some(millis) = limits.cpu_millis {
                let quota = u64::from(millis) * CPU_PERIOD_US / 1000;
                set(dir, "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
                set(dir, "cpu.cfs_quota_us", &quota.max(1000).to_string())?;
            }
        }
    }
    Ok(())
}

/// A limit a call ran into
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitHit {
    /// The kernel's OOM killer ended processes of the call at its memory limit
    Memory,
    /// The call tried to start more processes than its limit
    Pids,
}

/// The cgroups of one call
#[derive(Debug)]
pub struct CallCgroup {
    v2: Option<(PathBuf, Vec<Controller>)>,
    v1: Vec<(Controller, PathBuf)>,
    kill_file: bool,
}

impl CallCgroup {
    fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.v2
            .iter()
            .map(|(d, _)| d.as_path())
            .chain(self.v1.iter().map(|(_, d)| d.as_path()))
    }

    /// The directory whose process list is the whole call
    fn main_dir(&self) -> Option<&Path> {
        self.dirs().next()
    }

    /// Ends every process of the call
    pub fn kill(&self) {
        if let Some((dir, _)) = &self.v2
            && self.kill_file
            && write_file(&dir.join("cgroup.kill"), "1").is_ok()
        {
            return;
        }
        if let Some(dir) = self.main_dir() {
            kill_listed(dir);
        }
    }

    /// Opens the `cgroup.procs` of each of the call's cgroups, for one more process to join
    /// them (a bypass command approved for the call)
    pub fn open_joins(&self) -> Result<Vec<OwnedFd>, ConfineError> {
        self.dirs().map(open_procs).collect()
    }

    /// Whether `pid` is a process of the call. The call's cgroups have no children, so its
    /// `cgroup.procs` lists every process of it; reading that list is exact where matching the
    /// process's `/proc/<pid>/cgroup` against the mount would have to guess the mount point.
    pub fn holds(&self, pid: i32) -> bool {
        self.main_dir().is_some_and(|d| procs(d).contains(&pid))
    }

    /// Whether a process of the call is still there
    pub fn populated(&self) -> bool {
        if let Some((dir, _)) = &self.v2
            && let Ok(events) = std::fs::read_to_string(dir.join("cgroup.events"))
        {
            return events.lines().any(|l| l == "populated 1");
        }
        self.main_dir().is_some_and(|d| !procs(d).is_empty())
    }

    /// The limits the call ran into
    pub fn limits_hit(&self) -> Vec<LimitHit> {
        let mut hits = Vec::new();
        let count = |path: PathBuf, key: &str| -> u64 {
            std::fs::read_to_string(path)
                .unwrap_or_default()
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    (k == key).then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0)
        };
        let mut memory = 0;
        let mut pids = 0;
        if let Some((dir, controllers)) = &self.v2 {
            if controllers.contains(&Controller::Memory) {
                memory += count(dir.join("memory.events"), "oom_kill");
            }
            if controllers.contains(&Controller::Pids) {
                pids += count(dir.join("pids.events"), "max");
            }
        }
        for (c, dir) in &self.v1 {
            match c {
                Controller::Memory => memory += count(dir.join("memory.oom_control"), "oom_kill"),
                Controller::Pids => pids += count(dir.join("pids.events"), "max"),
                Controller::Cpu => {}
            }
        }
        if memory > 0 {
            hits.push(LimitHit::Memory);
        }
        if pids > 0 {
            hits.push(LimitHit::Pids);
        }
        hits
    }

    /// Kills what is left and removes the call's cgroups
    /// Kills what is left of the call and waits (bounded) until none of its processes is left
    pub fn end(&self) {
        if !self.populated() {
            return;
        }
        self.kill();
        for pause in retry_pauses() {
            if !self.populated() {
                return;
            }
            std::thread::sleep(pause);
        }
        for dir in self.dirs() {
            kill_listed(dir);
        }
    }

    pub fn remove(&self) {
        if self.populated() {
            self.kill();
        }
        for dir in self.dirs() {
            kill_listed(dir);
            if let Err(e) = remove_cgroup(dir) {
                tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove the call cgroup");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sweep of leftover call cgroups must not take another user's live agent for a gone
    /// one: a process this one may not signal is alive all the same.
    #[test]
    #[allow(unsafe_code)]
    fn another_users_process_is_alive() {
        let mine = i32::try_from(std::process::id()).unwrap();
        assert!(pid_alive(mine));
        if !nix::unistd::geteuid().is_root() {
            assert!(pid_alive(1), "pid 1, which this user may not signal");
            return;
        }
        // As root, ask from a child that has become nobody.
        // SAFETY: the child makes system calls only (setuid, kill, _exit) before it exits.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                let code = if nix::unistd::setuid(nix::unistd::Uid::from_raw(65534)).is_err() {
                    2
                } else if pid_alive(1) {
                    0
                } else {
                    1
                };
                // SAFETY: _exit(2) ends the child without running the parent's destructors.
                unsafe { libc::_exit(code) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                let status = nix::sys::wait::waitpid(child, None).unwrap();
                assert_eq!(
                    status,
                    nix::sys::wait::WaitStatus::Exited(child, 0),
                    "1: pid 1 taken for gone by a user who may not signal it; 2: setuid failed"
                );
            }
        }
    }

    #[test]
    fn finds_hybrid_and_unified_layouts() {
        let hybrid_mounts = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n\
            cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0\n\
            cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n\
            cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0\n\
            cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
        let hybrid_own =
            "9:name=systemd:/\n8:pids:/a\n4:memory:/process_api/x\n1:cpu,cpuacct:/\n0::/\n";
        let found = parse_proc(hybrid_mounts, hybrid_own);
        assert_eq!(found.v2_mount, Some("/sys/fs/cgroup/unified".into()));
        assert_eq!(found.v2_path.as_deref(), Some("/"));
        assert_eq!(
            found.v1,
            [
                (Controller::Pids, "/sys/fs/cgroup/pids".into(), "/a".into()),
                (
                    Controller::Memory,
                    "/sys/fs/cgroup/memory".into(),
                    "/process_api/x".into()
                ),
                (
                    Controller::Cpu,
                    "/sys/fs/cgroup/cpu,cpuacct".into(),
                    "/".into()
                ),
            ]
        );
        assert_eq!(
            below(Path::new("/sys/fs/cgroup/memory"), "/process_api/x"),
            Path::new("/sys/fs/cgroup/memory/process_api/x")
        );

        let unified = parse_proc(
            "cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n",
            "0::/system.slice/toolsrv-agent.service\n",
        );
        assert_eq!(unified.v2_mount, Some("/sys/fs/cgroup".into()));
        assert_eq!(
            unified.v2_path.as_deref(),
            Some("/system.slice/toolsrv-agent.service")
        );
        assert!(unified.v1.is_empty());
        assert_eq!(parse_proc("", ""), Found::default());
    }
}
