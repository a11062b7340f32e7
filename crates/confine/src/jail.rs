//! The agent's confiner and one call's jail: probing the host, preparing a call, ending it

use std::ffi::OsString;
use std::fmt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::resource::{Resource, getrlimit};
use nix::unistd::{Gid, Uid, User};

use crate::cgroup::{CallCgroup, Cgroups, Controller, LimitHit};
use crate::env::confined_env;
use crate::error::ConfineError;
use crate::profile::{Grant, Profile};
use crate::sys::{ChildSetup, landlock_abi};

#[cfg(target_os = "linux")]
use crate::fs_rules::{Access, OpenRule, Plan, build, open_rule, open_rules};

/// Paths of the system every confined call may read and execute (those that exist)
pub const SYSTEM_READ: [&str; 13] = [
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
    "/opt",
    "/proc",
    "/sys",
    "/run/systemd/resolve",
    // NixOS and Nix: every program, library and `/bin/sh` itself lives here.
    "/nix/store",
];

/// Devices every confined call may read and write; the rest of `/dev` (disks among it) is out
/// of reach
pub const DEVICES: [&str; 6] = [
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
];

/// How strictly the agent confines calls (`--sandbox`)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Everything or the agent does not start
    Enforce,
    /// What the kernel supports; the rest is logged and reported
    #[default]
    BestEffort,
    /// No confinement (a `--run-as` user still applies)
    Off,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::BestEffort => "best-effort",
            Mode::Off => "off",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "enforce" => Ok(Mode::Enforce),
            "best-effort" => Ok(Mode::BestEffort),
            "off" => Ok(Mode::Off),
            _ => Err(format!(
                "sandbox mode `{s}` is unknown: use enforce, best-effort or off"
            )),
        }
    }
}

/// How much of the confinement a host enforces, as reported in its facts (`sandbox=...`)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Landlock file-system rules, a cgroup per call with pids and memory limits, the
    /// environment allowlist and `no_new_privs`
    Enforced,
    /// Some of it (what is missing is listed)
    Partial,
    /// None of it
    Off,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Enforced => "enforced",
            Level::Partial => "partial",
            Level::Off => "off",
        }
    }
}

/// What the agent was told about confinement
#[derive(Debug, Clone)]
pub struct Settings {
    pub mode: Mode,
    /// What every call may do before the coordinator's grants
    pub defaults: Profile,
    /// The agent's private files: never reachable by a call
    pub hidden: Vec<PathBuf>,
    /// The user tools run as; `None` keeps the agent's
    pub run_as: Option<String>,
    /// Where the private per-call directories are made
    pub call_dir: PathBuf,
    /// `call_dir` is the operator's choice (`--call-dir`), not the default under the temporary
    /// directory: it is used as it is or not at all.
    pub call_dir_chosen: bool,
    /// A delegated cgroup v2 directory for call cgroups; `None`: the agent's own cgroup
    pub cgroup: Option<PathBuf>,
    /// How to start the agent's own binary again as the calls' warden ([`crate::warden`])
    /// where calls get cgroups; `None`: no warden, and calls left by an agent killed outright
    /// run on until an agent starts again on the host
    pub warden: Option<crate::warden::WardenStart>,
}

impl Settings {
    /// Best effort, default limits (1 GiB of memory, 512 processes, 4096 open files, network
    /// allowed), calls' directories under the system's temporary directory
    pub fn new(hidden: Vec<PathBuf>) -> Self {
        let euid = nix::unistd::geteuid();
        Self {
            mode: Mode::BestEffort,
            defaults: Profile {
                network: true,
                limits: crate::profile::Limits {
                    memory: Some(1 << 30),
                    pids: Some(512),
                    cpu_millis: None,
                    nofile: Some(4096),
                },
                ..Profile::default()
            },
            hidden,
            run_as: None,
            call_dir: std::env::temp_dir().join(format!("toolsrv-calls.{euid}")),
            call_dir_chosen: false,
            cgroup: None,
            warden: None,
        }
    }
}

/// What this host enforces, for the agent's log and facts
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abilities {
    pub mode: Mode,
    pub level: Level,
    /// The kernel's Landlock ABI; 0 without Landlock
    pub landlock_abi: i32,
    /// "v2", "v1", "hybrid" or "none"
    pub cgroup: String,
    /// Controllers limiting calls, as `pids`, or `memory (v1)` when taken from v1
    pub controllers: Vec<String>,
    /// How every process of a call is ended: "cgroup.kill", "cgroup signals" or "process group"
    pub kill: String,
    /// The user tools run as; empty: the agent's
    pub run_as: String,
    /// What is not enforced, and why
    pub missing: Vec<String>,
}

/// One call, as the confiner needs it
#[derive(Debug)]
pub struct CallPlan<'a> {
    /// The tool's directory (`OLLIE_TOOLS_PATH`): readable and executable
    pub tool_dir: &'a Path,
    /// The working directory the caller asked for, if any
    pub cwd: Option<&'a Path>,
    /// The coordinator's grant for this tool on this host, if any
    pub grant: Option<&'a Grant>,
    /// The agent's environment, filtered through the allowlist
    pub agent_env: &'a [(OsString, OsString)],
    /// The call's timeout, which bounds its CPU time too
    pub timeout: Duration,
}

/// A call made ready to run confined
#[derive(Debug)]
pub struct Prepared {
    pub jail: CallJail,
    /// The working directory to run in (`PWD`); `None` keeps the agent's default
    pub cwd: Option<PathBuf>,
    /// The complete environment; `None` keeps the unconfined one
    pub env: Option<Vec<(OsString, OsString)>>,
}

/// The rules every call shares, opened once and planned again when a carved-out directory
/// changes
#[cfg(target_os = "linux")]
#[derive(Debug)]
struct SharedRules {
    plan: Plan,
    open: Vec<OpenRule>,
}

/// The agent's confinement: set up once, prepares every call
pub struct Confiner {
    settings: Settings,
    abilities: Abilities,
    cgroups: Option<Cgroups>,
    /// What a call's processes may not do to others (`None`: not on this kernel or build)
    seccomp: Option<crate::seccomp::Filter>,
    ids: Option<(Uid, Gid)>,
    hidden: Vec<PathBuf>,
    #[cfg(target_os = "linux")]
    shared: Mutex<Arc<SharedRules>>,
}

impl fmt::Debug for Confiner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Confiner")
            .field("abilities", &self.abilities)
            .field("call_dir", &self.settings.call_dir)
            .finish()
    }
}

fn resolve_user(name: &str) -> Result<(Uid, Gid), ConfineError> {
    let err = |why: String| ConfineError::User {
        user: name.to_owned(),
        why,
    };
    let user = if let Ok(uid) = name.parse::<u32>() {
        User::from_uid(Uid::from_raw(uid))
    } else {
        User::from_name(name)
    }
    .map_err(|e| err(e.desc().to_owned()))?
    .ok_or_else(|| err("no such user".to_owned()))?;
    Ok((user.uid, user.gid))
}

/// Makes the directory that holds calls' private directories: owned by the agent, not a link,
/// writable by the agent only, traversable by everyone (a `--run-as` user reaches its own
/// call's directory in it, and nothing else)
fn make_call_root(dir: &Path) -> Result<(), ConfineError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| ConfineError::io("create the calls' directory", dir, e))?;
    let md = std::fs::symlink_metadata(dir)
        .map_err(|e| ConfineError::io("inspect the calls' directory", dir, e))?;
    if !md.is_dir() || md.uid() != nix::unistd::geteuid().as_raw() {
        return Err(ConfineError::io(
            "use as the calls' directory",
            dir,
            std::io::Error::other(
                "it is not a directory owned by the agent's user; remove it or choose another with --call-dir",
            ),
        ));
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
        .map_err(|e| ConfineError::io("set the mode of", dir, e))
}

/// Removes the private directories that agents gone without removing them (killed outright)
/// left in `root`: those named for a process that no longer runs (`call-<pid>-<random>`).
fn sweep_private_dirs(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let own = std::process::id();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.strip_prefix("call-"))
            .and_then(|n| n.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let gone = i32::try_from(pid).is_ok_and(|pid| !crate::cgroup::pid_alive(pid));
        if pid == own || !gone || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = entry.path();
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => tracing::info!(
                dir = %dir.display(),
                agent_pid = pid,
                "removed the private directory of a call of an agent that is gone"
            ),
            Err(e) => tracing::warn!(
                dir = %dir.display(),
                error = %e,
                "cannot remove the private directory of a call of an agent that is gone"
            ),
        }
    }
}

/// A new directory beside `taken`, made by this process now (`<taken>.<random>`, 0711), for
/// calls' private directories.
fn fresh_call_root(taken: &Path) -> Result<PathBuf, ConfineError> {
    use std::os::unix::fs::DirBuilderExt;
    let mut last = None;
    for _ in 0..8 {
        let dir = PathBuf::from(format!("{}.{:016x}", taken.display(), fastrand::u64(..)));
        match std::fs::DirBuilder::new().mode(0o711).create(&dir) {
            Ok(()) => {
                make_call_root(&dir)?;
                return Ok(dir);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(ConfineError::io(
        "create a calls' directory beside",
        taken,
        last.unwrap_or_else(|| std::io::Error::other("no free name")),
    ))
}

fn canonical(paths: &[PathBuf]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = paths
        .iter()
        .map(|p| {
            std::fs::canonicalize(p)
                .unwrap_or_else(|_| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

impl Confiner {
    /// Probes the host and sets up what every call shares; in `enforce` mode, fails when the
    /// host cannot enforce everything
    pub fn new(mut settings: Settings) -> Result<Self, ConfineError> {
        let ids = settings.run_as.as_deref().map(resolve_user).transpose()?;
        let hidden = canonical(&settings.hidden);
        let abi = landlock_abi();
        let run_as = settings.run_as.clone().unwrap_or_default();
        if settings.mode == Mode::Off {
            return Ok(Self {
                abilities: Abilities {
                    mode: Mode::Off,
                    level: Level::Off,
                    landlock_abi: abi,
                    cgroup: "none".into(),
                    controllers: Vec::new(),
                    kill: "process group".into(),
                    run_as,
                    missing: vec!["everything: --sandbox off".into()],
                },
                settings,
                cgroups: None,
                seccomp: None,
                ids,
                hidden,
                #[cfg(target_os = "linux")]
                shared: Mutex::new(Arc::new(SharedRules {
                    plan: Plan::default(),
                    open: Vec::new(),
                })),
            });
        }
        if let Err(e) = make_call_root(&settings.call_dir) {
            // The default name under /tmp is known in advance: another local user who made it
            // first must not keep the agent from starting. A new directory of the agent's own
            // is made beside it instead.
            if settings.call_dir_chosen {
                return Err(e);
            }
            let fresh = fresh_call_root(&settings.call_dir)?;
            tracing::warn!(
                taken = %settings.call_dir.display(),
                using = %fresh.display(),
                error = %e,
                "the default calls' directory cannot be used (someone else made it?): using a new one"
            );
            settings.call_dir = fresh;
        }
        sweep_private_dirs(&settings.call_dir);
        // Every call's private directory is out of reach of the others': the directory holding
        // them is hidden like the agent's files (a shared read rule, a grant or a caller's
        // `--cwd` above it opens none of them; each call is granted its own).
        let mut hidden = hidden;
        hidden.extend(canonical(std::slice::from_ref(&settings.call_dir)));
        let mut cgroups = if cfg!(target_os = "linux") {
            Cgroups::setup(settings.cgroup.as_deref())
        } else {
            None
        };
        // A directory the operator named that cannot be used is their mistake to hear about,
        // not a reason to fall back on something else unseen.
        if let Some(path) = &settings.cgroup
            && let Some(why) = match &cgroups {
                Some(c) => c.v2_problem.clone(),
                None => Some("it cannot be used".to_owned()),
            }
        {
            return Err(ConfineError::Cgroup {
                path: path.clone(),
                why,
            });
        }
        if let (Some(cgroups), Some(how)) = (cgroups.as_mut(), settings.warden.as_ref())
            && let Err(e) = cgroups.start_warden(how)
        {
            tracing::warn!(
                program = %how.program.display(),
                error = %e,
                "cannot start the calls' warden: if this agent is killed outright, its calls \
                 run on until an agent starts again on this host"
            );
        }
        let seccomp = crate::seccomp::filter().filter(|_| crate::sys::seccomp_available());
        let abilities = abilities(&settings, abi, cgroups.as_ref(), seccomp.is_some(), run_as);
        if settings.mode == Mode::Enforce && abilities.level != Level::Enforced {
            return Err(ConfineError::NotEnforceable {
                missing: abilities.missing.join("; "),
            });
        }
        let confiner = Self {
            #[cfg(target_os = "linux")]
            shared: Mutex::new(Arc::new(shared_rules(&settings.defaults, &hidden))),
            settings,
            abilities,
            cgroups,
            seccomp,
            ids,
            hidden,
        };
        Ok(confiner)
    }

    pub fn abilities(&self) -> &Abilities {
        &self.abilities
    }

    /// Whether calls run with everything the level `enforced` stands for
    pub fn enforced(&self) -> bool {
        self.abilities.level == Level::Enforced
    }

    /// The shared rules, planned again if a carved-out directory changed
    #[cfg(target_os = "linux")]
    fn shared(&self) -> Arc<SharedRules> {
        let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        if shared.plan.stale() {
            *shared = Arc::new(shared_rules(&self.settings.defaults, &self.hidden));
        }
        shared.clone()
    }

    /// Prepares one call: its private directory, cgroups, Landlock rules, limits and
    /// environment. Nothing is left behind on error.
    pub fn prepare(&self, call: &CallPlan<'_>) -> Result<Prepared, ConfineError> {
        if self.settings.mode == Mode::Off {
            let setup = self.ids.map(|ids| ChildSetup {
                ids: Some(ids),
                ..ChildSetup::default()
            });
            return Ok(Prepared {
                jail: CallJail::new(setup, None, None),
                cwd: None,
                env: None,
            });
        }
        let profile = self.settings.defaults.widened(call.grant);
        let caller_cwd = match call.cwd {
            Some(cwd) => {
                let real = std::fs::canonicalize(cwd).unwrap_or_else(|_| cwd.to_path_buf());
                if self.hidden.iter().any(|h| real.starts_with(h)) {
                    return Err(ConfineError::HiddenCwd {
                        path: cwd.to_path_buf(),
                    });
                }
                Some(real)
            }
            None => None,
        };
        let private = self.make_private_dir()?;
        // From here on, dropping the jail removes the directory and the cgroups.
        let mut jail = CallJail::new(None, None, Some(private.clone()));
        let cwd = caller_cwd.clone().unwrap_or_else(|| private.clone());
        let env = confined_env(call.agent_env, &profile.env, call.tool_dir, &cwd, &private);
        let mut setup = ChildSetup {
            ids: self.ids,
            no_new_privs: true,
            drop_capabilities: true,
            seccomp: self.seccomp.clone(),
            ..ChildSetup::default()
        };
        if let Some(cgroups) = &self.cgroups {
            let (cgroup, joins) = cgroups.create(&profile.limits)?;
            jail.cgroup = Some(cgroup);
            setup.cgroup_procs = joins;
        }
        setup.rlimits = self.rlimits(&profile, call.timeout);
        jail.bypass = Some(BypassSetup {
            rlimits: setup.rlimits.clone(),
            ids: self.ids,
        });
        #[cfg(target_os = "linux")]
        if self.abilities.landlock_abi > 0 {
            setup.landlock = self.landlock(call, &profile, &private, caller_cwd.as_deref())?;
        }
        jail.setup = Mutex::new(Some(Arc::new(setup)));
        Ok(Prepared {
            jail,
            cwd: Some(cwd),
            env: Some(env),
        })
    }

    #[cfg(target_os = "linux")]
    fn landlock(
        &self,
        call: &CallPlan<'_>,
        profile: &Profile,
        private: &Path,
        caller_cwd: Option<&Path>,
    ) -> Result<Option<std::os::fd::OwnedFd>, ConfineError> {
        let shared = self.shared();
        // The tool's own directory may lie in the agent's state (the shipped catalog): it is
        // granted as it is, not planned against the hidden paths.
        let mut own: Vec<OpenRule> = [
            open_rule(call.tool_dir, Access::Read),
            open_rule(private, Access::Write),
        ]
        .into_iter()
        .flatten()
        .collect();
        if let Some(cwd) = caller_cwd {
            own.extend(open_rules(
                &Plan::new(&[(cwd.to_path_buf(), Access::Read)], &self.hidden).rules,
            ));
        }
        if let Some(grant) = call.grant {
            let paths: Vec<(PathBuf, Access)> = grant
                .read
                .iter()
                .map(|p| (p.clone(), Access::Read))
                .chain(grant.write.iter().map(|p| (p.clone(), Access::Write)))
                .collect();
            own.extend(open_rules(&Plan::new(&paths, &self.hidden).rules));
        }
        build(shared.open.iter().chain(own.iter()), profile.network)
    }

    /// Resource limits per process: open files always; CPU seconds bounded by the timeout;
    /// address space where no memory controller limits the call; processes per user where
    /// tools run as a user other than root (root is not held by `RLIMIT_NPROC`)
    fn rlimits(&self, profile: &Profile, timeout: Duration) -> Vec<(Resource, u64)> {
        let has = |c| self.cgroups.as_ref().is_some_and(|g| g.has(c));
        let limits = &profile.limits;
        let mut wanted = vec![(
            Resource::RLIMIT_CPU,
            Some(timeout.as_secs().saturating_add(2)),
        )];
        wanted.push((Resource::RLIMIT_NOFILE, limits.nofile));
        if !has(Controller::Memory) {
            wanted.push((Resource::RLIMIT_AS, limits.memory));
        }
        let uid = self.ids.map_or_else(nix::unistd::getuid, |(uid, _)| uid);
        if !uid.is_root() {
            wanted.push((Resource::RLIMIT_NPROC, limits.pids));
        }
        wanted
            .into_iter()
            .filter_map(|(resource, limit)| {
                let limit = limit?;
                // Never above the current hard limit: raising it needs a privilege.
                let hard = getrlimit(resource).map(|(_, hard)| hard).unwrap_or(limit);
                Some((resource, limit.min(hard)))
            })
            .collect()
    }

    fn make_private_dir(&self) -> Result<PathBuf, ConfineError> {
        use std::os::unix::fs::DirBuilderExt;
        let mut last = None;
        for _ in 0..8 {
            // The agent's pid in the name: an agent that starts removes those of agents gone.
            let dir = self.settings.call_dir.join(format!(
                "call-{}-{:016x}",
                std::process::id(),
                fastrand::u64(..)
            ));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    if let Some((uid, gid)) = self.ids
                        && let Err(e) = nix::unistd::chown(&dir, Some(uid), Some(gid))
                    {
                        let _ = std::fs::remove_dir(&dir);
                        return Err(ConfineError::io(
                            "give the call's directory to the --run-as user",
                            dir,
                            e.into(),
                        ));
                    }
                    return Ok(dir);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some((dir, e)),
                Err(e) => return Err(ConfineError::io("create the call's directory", dir, e)),
            }
        }
        let (dir, e) = last.unwrap_or_else(|| {
            (
                self.settings.call_dir.clone(),
                std::io::Error::other("no free name"),
            )
        });
        Err(ConfineError::io("create the call's directory", dir, e))
    }
}

#[cfg(target_os = "linux")]
fn shared_rules(defaults: &Profile, hidden: &[PathBuf]) -> SharedRules {
    let grants: Vec<(PathBuf, Access)> = SYSTEM_READ
        .iter()
        .map(|p| (PathBuf::from(p), Access::Read))
        .chain(DEVICES.iter().map(|p| (PathBuf::from(p), Access::Write)))
        .chain(defaults.read.iter().map(|p| (p.clone(), Access::Read)))
        .chain(defaults.write.iter().map(|p| (p.clone(), Access::Write)))
        .collect();
    let plan = Plan::new(&grants, hidden);
    if plan.enumerated() > 0 {
        tracing::debug!(
            directories = plan.enumerated(),
            rules = plan.rules.len(),
            "granted the entries of directories holding the agent's private files one by one"
        );
    }
    let open = open_rules(&plan.rules);
    SharedRules { plan, open }
}

fn abilities(
    settings: &Settings,
    abi: i32,
    cgroups: Option<&Cgroups>,
    seccomp: bool,
    run_as: String,
) -> Abilities {
    let mut missing = Vec::new();
    if !seccomp {
        missing.push(
            "seccomp: no filter on this kernel or architecture (a tool may change the resource \
             limits and scheduling of other processes of its user, and start a child in \
             another cgroup)"
                .to_owned(),
        );
    }
    match abi {
        0 => missing.push(
            "Landlock file-system rules: this kernel has no Landlock (or it is disabled)"
                .to_owned(),
        ),
        1..=3 => missing.push(format!(
            "network rules: Landlock ABI {abi} lacks them (4 or later)"
        )),
        4 | 5 => missing.push(format!(
            "signal scoping: Landlock ABI {abi} lacks it (6 or later)"
        )),
        _ => {}
    }
    let controllers: Vec<(Controller, &str)> =
        cgroups.map(Cgroups::controllers).unwrap_or_default();
    let has = |c: Controller| controllers.iter().any(|(x, _)| *x == c);
    match cgroups {
        None => missing.push(
            "a cgroup per call: no usable cgroup hierarchy (processes are ended by process group)"
                .to_owned(),
        ),
        Some(g) => {
            if let Some(why) = &g.v2_problem {
                missing.push(format!("cgroup v2: {why}"));
            }
            if !g.kill_file() {
                missing
                    .push("cgroup.kill: processes of a call are signalled one by one".to_owned());
            }
        }
    }
    if !has(Controller::Pids) {
        missing.push(
            "pids limit: no pids controller (RLIMIT_NPROC applies only with --run-as)".to_owned(),
        );
    }
    if !has(Controller::Memory) {
        missing
            .push("memory limit: no memory controller (RLIMIT_AS per process instead)".to_owned());
    }
    if !has(Controller::Cpu) && settings.defaults.limits.cpu_millis.is_some() {
        missing.push("cpu limit: no cpu controller".to_owned());
    }
    let enforced =
        abi > 0 && seccomp && cgroups.is_some() && has(Controller::Pids) && has(Controller::Memory);
    Abilities {
        mode: settings.mode,
        level: if enforced {
            Level::Enforced
        } else {
            Level::Partial
        },
        landlock_abi: abi,
        cgroup: cgroups.map_or("none", Cgroups::version).to_owned(),
        controllers: controllers
            .iter()
            .map(|(c, from)| match (*from, cgroups.map(Cgroups::version)) {
                ("v1", Some("hybrid")) => format!("{} (v1)", c.name()),
                _ => c.name().to_owned(),
            })
            .collect(),
        kill: match cgroups {
            Some(g) if g.kill_file() => "cgroup.kill",
            Some(_) => "cgroup signals",
            None => "process group",
        }
        .to_owned(),
        run_as,
        missing,
    }
}

/// One call's confinement: what its process does before exec, and what is ended and removed
/// after
pub struct CallJail {
    setup: Mutex<Option<Arc<ChildSetup>>>,
    cgroup: Option<CallCgroup>,
    private: Option<PathBuf>,
    /// What an approved bypass command of the call gets: the call's limits and user, not its
    /// Landlock rules; `None` when the call is not confined
    bypass: Option<BypassSetup>,
    released: AtomicBool,
}

/// The part of a call's confinement a bypass command keeps
#[derive(Debug, Clone)]
struct BypassSetup {
    rlimits: Vec<(Resource, u64)>,
    ids: Option<(Uid, Gid)>,
}

impl fmt::Debug for CallJail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallJail")
            .field("cgroup", &self.cgroup)
            .field("private", &self.private)
            .finish()
    }
}

impl CallJail {
    fn new(
        setup: Option<ChildSetup>,
        cgroup: Option<CallCgroup>,
        private: Option<PathBuf>,
    ) -> Self {
        Self {
            setup: Mutex::new(setup.map(Arc::new)),
            cgroup,
            private,
            bypass: None,
            released: AtomicBool::new(false),
        }
    }

    /// Makes `cmd`'s process confine itself before it executes the tool. Call once: the
    /// descriptors it holds are closed when `cmd` is dropped.
    pub fn install(&self, cmd: &mut std::process::Command) {
        let setup = self.setup.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(setup) = setup {
            crate::sys::install(cmd, setup);
        }
    }

    /// Starts the call's process confined without forking the agent (see [`crate::spawn`]):
    /// `program` (absolute) with `args` (`argv[0]` first), exactly `env`, in `cwd`. `None` when
    /// there is nothing to apply (the call is not confined, or this was done already): start it
    /// as usual then.
    #[cfg(target_os = "linux")]
    pub fn spawn(
        &self,
        program: &Path,
        args: &[&std::ffi::OsStr],
        env: &[(std::ffi::OsString, std::ffi::OsString)],
        cwd: &Path,
    ) -> Option<std::io::Result<crate::spawn::Spawned>> {
        let setup = self
            .setup
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        Some(crate::spawn::spawn(program, args, env, cwd, &setup))
    }

    /// The call's private directory (its `TMPDIR` and `HOME`); `None` when not confined
    pub fn private_dir(&self) -> Option<&Path> {
        self.private.as_deref()
    }

    /// The user and group the call's processes run as; `None`: the agent's
    pub fn owner(&self) -> Option<(u32, u32)> {
        self.bypass
            .as_ref()
            .and_then(|b| b.ids)
            .map(|(uid, gid)| (uid.as_raw(), gid.as_raw()))
    }

    /// Whether a bypass command can run for this call: only inside the call's cgroup, so its
    /// limits and its end apply to it
    pub fn can_bypass(&self) -> bool {
        self.bypass.is_some() && self.cgroup.is_some()
    }

    /// Whether process `pid` belongs to the call (is in its cgroup); false without a cgroup
    pub fn holds(&self, pid: i32) -> bool {
        self.cgroup.as_ref().is_some_and(|c| c.holds(pid))
    }

    /// Makes `cmd`'s process join the call's cgroups, take its resource limits, its user and
    /// `no_new_privs`, but not its Landlock rules: an approved bypass command. Refused when the
    /// call has no cgroup (the command would escape the call's limits and end).
    pub fn install_bypass(&self, cmd: &mut std::process::Command) -> Result<(), ConfineError> {
        let (Some(bypass), Some(cgroup)) = (&self.bypass, &self.cgroup) else {
            return Err(ConfineError::io(
                "run a bypass command in the call's cgroup",
                self.private.clone().unwrap_or_default(),
                std::io::Error::other(
                    "the call has no cgroup; give the agent a cgroup hierarchy (--cgroup) to allow bypass requests",
                ),
            ));
        };
        let setup = ChildSetup {
            cgroup_procs: cgroup.open_joins()?,
            rlimits: bypass.rlimits.clone(),
            ids: bypass.ids,
            no_new_privs: true,
            // The command a person approved runs outside the call's Landlock rules, with what
            // its user may do: keeping their limits is the cgroup's job, which it cannot leave.
            drop_capabilities: false,
            landlock: None,
            seccomp: None,
        };
        crate::sys::install(cmd, Arc::new(setup));
        Ok(())
    }

    /// Whether the call has its own cgroup (else only its process group can be ended)
    pub fn has_cgroup(&self) -> bool {
        self.cgroup.is_some()
    }

    /// Ends every process of the call (those that left its process group too)
    pub fn kill(&self) {
        if let Some(cgroup) = &self.cgroup {
            cgroup.kill();
        }
    }

    /// Whether a process of the call is left; `None` without a cgroup
    pub fn populated(&self) -> Option<bool> {
        self.cgroup.as_ref().map(CallCgroup::populated)
    }

    /// Ends what is left of the call (waiting, bounded, until none of its processes is left)
    /// and says which limits it ran into; what it made stays until [`CallJail::release`].
    /// Blocking. Lets the caller learn the outcome before the clean-up, which takes longer.
    pub fn finish(&self) -> Vec<LimitHit> {
        match &self.cgroup {
            Some(cgroup) => {
                cgroup.end();
                cgroup.limits_hit()
            }
            None => Vec::new(),
        }
    }

    /// Ends what is left, removes the call's cgroups and private directory, and says which
    /// limits the call ran into. Blocking (it removes what the tool wrote); runs once.
    pub fn release(&self) -> Vec<LimitHit> {
        if self.released.swap(true, Ordering::SeqCst) {
            return Vec::new();
        }
        let hits = self
            .cgroup
            .as_ref()
            .map(CallCgroup::limits_hit)
            .unwrap_or_default();
        if let Some(cgroup) = &self.cgroup {
            cgroup.remove();
        }
        if let Some(dir) = &self.private
            && let Err(e) = std::fs::remove_dir_all(dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the call's directory");
        }
        hits
    }
}

impl Drop for CallJail {
    fn drop(&mut self) {
        self.release();
    }
}
