//! Unsafe code (with [`crate::spawn`] and one registration of a process descriptor in the exec crate, the only in the workspace): the steps a tool's process takes between `fork` and `exec`, and one Landlock query
//!
//! Confined calls start through [`crate::spawn`], which runs [`ChildSetup::apply`] in a child
//! that shares the agent's memory; `pre_exec` (a forked child) remains for bypass commands and
//! where that is not available.
//!
//! Why steps in the child rather than a helper program that confines itself and then executes the tool:
//! a helper costs one more `execve` of a binary per call (its loading and relocation is most of
//! the 0.5 ms a confined call may add), has to be found and kept at the agent's version on every
//! host, and cannot serve library users, tests and benches that run calls in process. The price
//! is this module: the closure below runs in the forked child of a multi-threaded process, where
//! only async-signal-safe operations are allowed. Everything that allocates, locks or reads
//! files (building the Landlock ruleset, opening the cgroups' `cgroup.procs`, resolving the user)
//! happens in the agent before the fork; the child only makes system calls on values prepared
//! for it.
#![allow(unsafe_code)]

use std::io;
#[cfg(target_os = "linux")]
use std::os::fd::AsRawFd;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::sync::Arc;

use nix::sys::resource::{Resource, setrlimit};
use nix::unistd::{Gid, Uid};

/// Marks every descriptor this process inherited from whatever started it (3 and up)
/// close-on-exec, so that none reaches a tool: a log file, a socket or a pipe that a wrapper
/// script or a service manager left open would otherwise be open in every call, confined or
/// not, for it to write or read. Descriptors this process opens itself are close-on-exec
/// already (Rust opens them so). Call it at start, before any thread or descriptor of one's
/// own: `close_range(2)` where the kernel has it (Linux 5.11), else each descriptor listed in
/// `/proc/self/fd`.
pub fn close_inherited_on_exec() -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: close_range(2) with CLOSE_RANGE_CLOEXEC only sets a flag on descriptors.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_close_range,
                3 as libc::c_uint,
                libc::c_uint::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            )
        };
        if rc == 0 {
            return Ok(());
        }
    }
    let listed: Vec<i32> = std::fs::read_dir("/proc/self/fd")?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    // The directory's own descriptor is closed by now: EBADF for it is expected.
    for fd in listed {
        // SAFETY: fcntl(2) on a descriptor number, reading and setting its flags only.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
    Ok(())
}

/// What the child does before it executes the tool, in this order: join the call's cgroups,
/// lower its resource limits, switch user, set `no_new_privs`, restrict itself with Landlock
#[derive(Debug, Default)]
pub struct ChildSetup {
    /// `cgroup.procs` of each of the call's cgroups, open for writing
    pub cgroup_procs: Vec<OwnedFd>,
    /// (resource, soft and hard limit)
    pub rlimits: Vec<(Resource, u64)>,
    /// The user and group to become, with no supplementary groups but `gid`
    pub ids: Option<(Uid, Gid)>,
    pub no_new_privs: bool,
    /// Drop [`DROPPED_CAPABILITIES`] from the bounding set, so that a tool running as root
    /// has none of them after its exec
    pub drop_capabilities: bool,
    /// A Landlock ruleset to restrict the process with (requires `no_new_privs` or
    /// `CAP_SYS_ADMIN`)
    pub landlock: Option<OwnedFd>,
    /// A seccomp filter to install last (see [`crate::seccomp`]; requires `no_new_privs` or
    /// `CAP_SYS_ADMIN`)
    pub seccomp: Option<crate::seccomp::Filter>,
}

/// What a confined tool never gets, even as root: raising its own resource limits
/// (`CAP_SYS_RESOURCE`, which would undo the call's), making files immutable (which kept the
/// agent from removing the call's directory), device nodes, kernel modules, raw I/O, the
/// clock, reboot, process accounting, the TTY configuration, MAC policy, file capabilities,
/// BPF and perf, checkpoints, audit control, wake alarms, suspend blocking, and (last, since
/// dropping the others needs it) changing capability sets. Kept: what tools that inspect or
/// manage a host use (`CAP_SYS_ADMIN`, `CAP_NET_ADMIN`, `CAP_SYS_PTRACE`, `CAP_DAC_*`,
/// `CAP_SYSLOG`, `CAP_KILL` within the sandbox's signal rules, ...).
#[cfg(target_os = "linux")]
pub const DROPPED_CAPABILITIES: &[(libc::c_int, &str)] = &[
    (24, "CAP_SYS_RESOURCE"),
    (9, "CAP_LINUX_IMMUTABLE"),
    (27, "CAP_MKNOD"),
    (16, "CAP_SYS_MODULE"),
    (17, "CAP_SYS_RAWIO"),
    (22, "CAP_SYS_BOOT"),
    (25, "CAP_SYS_TIME"),
    (20, "CAP_SYS_PACCT"),
    (26, "CAP_SYS_TTY_CONFIG"),
    (32, "CAP_MAC_OVERRIDE"),
    (33, "CAP_MAC_ADMIN"),
    (31, "CAP_SETFCAP"),
    (39, "CAP_BPF"),
    (38, "CAP_PERFMON"),
    (40, "CAP_CHECKPOINT_RESTORE"),
    (30, "CAP_AUDIT_CONTROL"),
    (35, "CAP_WAKE_ALARM"),
    (36, "CAP_BLOCK_SUSPEND"),
    (8, "CAP_SETPCAP"),
];

impl ChildSetup {
    /// Runs in the child between fork and exec
    ///
    /// Runs in a forked child, or in one started by [`crate::spawn`] that shares the agent's
    /// memory. Every call here is one system call: `write` on a descriptor opened by the
    /// parent, `setrlimit`, `setgroups`, `setresgid`, `setresuid` (raw, see [`set_ids`]),
    /// `prctl` and `landlock_restrict_self`. None allocates, takes a lock or touches state shared with other
    /// threads of the parent, and errors are returned as raw OS errors (an `io::Error` holding
    /// an errno does not allocate), which std reports to the parent through its exec pipe.
    pub(crate) fn apply(&self) -> io::Result<()> {
        for fd in &self.cgroup_procs {
            // "0" moves the writing process.
            nix::unistd::write(fd, b"0")?;
        }
        for &(resource, limit) in &self.rlimits {
            setrlimit(resource, limit, limit)?;
        }
        #[cfg(target_os = "linux")]
        if self.drop_capabilities {
            for &(cap, _) in DROPPED_CAPABILITIES {
                // SAFETY: prctl(2) with PR_CAPBSET_DROP takes two integers and reads no memory.
                let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
                if rc != 0 {
                    let e = io::Error::last_os_error();
                    // EINVAL: a capability this kernel does not know; EPERM: no CAP_SETPCAP,
                    // so not root, and the tool has none of them anyway.
                    if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EPERM)) {
                        return Err(e);
                    }
                }
            }
        }
        if let Some((uid, gid)) = self.ids {
            set_ids(uid, gid)?;
        }
        #[cfg(target_os = "linux")]
        if self.no_new_privs {
            nix::sys::prctl::set_no_new_privs()?;
        }
        #[cfg(target_os = "linux")]
        if let Some(ruleset) = &self.landlock {
            // SAFETY: landlock_restrict_self(2) takes a ruleset descriptor (owned by `self`,
            // open for the whole call) and a flags word; it reads no memory of ours.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_landlock_restrict_self,
                    ruleset.as_raw_fd(),
                    0 as libc::c_uint,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        #[cfg(target_os = "linux")]
        if let Some(filter) = &self.seccomp {
            let program = libc::sock_fprog {
                // At most a few dozen instructions (see `seccomp::filter`).
                len: filter.0.len() as libc::c_ushort,
                filter: filter.0.as_ptr().cast_mut(),
            };
            // SAFETY: seccomp(2) reads the program, which lives on this frame and points into
            // the shared filter (owned by `self`, alive for the whole call).
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_seccomp,
                    SECCOMP_SET_MODE_FILTER,
                    0 as libc::c_uint,
                    &program as *const libc::sock_fprog,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// Overwrites the value of the environment variable `name` with NUL bytes where it lies, in the
/// block of environment strings this process started with: the block `/proc/PID/environ`
/// shows every process of the same user (a tool run as root, among them). The variable then
/// reads as empty here too. For a secret read once at start (the join token). Returns whether
/// the variable was set.
///
/// Call it before any other thread starts: no thread may read or change the environment
/// meanwhile.
pub fn scrub_env_value(name: &std::ffi::CStr) -> bool {
    // SAFETY: getenv(3) returns null or a pointer to the variable's NUL-terminated value inside
    // the environment; strlen reads up to that NUL, and write_bytes writes only the bytes
    // before it. No other thread runs yet (the caller's duty), so nothing reads or moves the
    // environment meanwhile.
    unsafe {
        let value = libc::getenv(name.as_ptr());
        if value.is_null() {
            return false;
        }
        let len = libc::strlen(value);
        std::ptr::write_bytes(value, 0, len);
    }
    true
}

/// Makes this process (the calls' warden) deaf to the signals that end or stop a process by
/// default and that reach it without anyone meaning it: a terminal's (`SIGINT`, `SIGQUIT`,
/// `SIGTSTP`, `SIGTTIN`, `SIGTTOU`), a hang-up (`SIGHUP`, which the kernel also sends a process
/// group left orphaned with a stopped member), `SIGTERM` sent to every process of a service or
/// a name, and `SIGPIPE`. Only `SIGKILL` and `SIGSTOP` still act on it.
pub(crate) fn ignore_ending_signals() -> io::Result<()> {
    use nix::sys::signal::{SigHandler, Signal, signal};
    for sig in [
        Signal::SIGHUP,
        Signal::SIGINT,
        Signal::SIGQUIT,
        Signal::SIGTERM,
        Signal::SIGTSTP,
        Signal::SIGTTIN,
        Signal::SIGTTOU,
        Signal::SIGPIPE,
    ] {
        // SAFETY: setting a disposition to SIG_IGN installs no handler; nothing runs on delivery.
        unsafe { signal(sig, SigHandler::SigIgn) }?;
    }
    Ok(())
}

/// seccomp(2) operations (linux/seccomp.h)
#[cfg(target_os = "linux")]
const SECCOMP_SET_MODE_FILTER: libc::c_uint = 1;
#[cfg(target_os = "linux")]
const SECCOMP_GET_ACTION_AVAIL: libc::c_uint = 2;

/// Whether this kernel runs seccomp filters that answer with an errno (Linux 4.14 and later,
/// built with `CONFIG_SECCOMP_FILTER`)
#[cfg(target_os = "linux")]
pub fn seccomp_available() -> bool {
    let action: u32 = 0x0005_0000; // SECCOMP_RET_ERRNO
    // SAFETY: seccomp(2) with SECCOMP_GET_ACTION_AVAIL reads one u32, which lives on this
    // frame, and changes nothing.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            SECCOMP_GET_ACTION_AVAIL,
            0 as libc::c_uint,
            &action as *const u32,
        )
    };
    rc == 0
}

/// Drops supplementary groups and switches group and user, for this process alone
///
/// Raw system calls, not libc's wrappers: in a process with threads, glibc's `setresuid` and
/// friends coordinate every thread of the process (walking its list of threads under a lock and
/// signalling each), and a child started by [`crate::spawn`] shares the agent's memory, that list
/// and lock included, which another thread of the agent may hold at that moment. The kernel's
/// calls act on the calling process only.
fn set_ids(uid: Uid, gid: Gid) -> io::Result<()> {
    let gid = gid.as_raw();
    let uid = uid.as_raw();
    let groups = [gid];
    let check = |rc: libc::c_long| {
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    // SAFETY: setgroups(2) reads `groups` (one entry); setresgid(2) and setresuid(2) take
    // plain numbers.
    unsafe {
        check(libc::syscall(
            libc::SYS_setgroups,
            1 as libc::size_t,
            groups.as_ptr(),
        ))?;
        check(libc::syscall(libc::SYS_setresgid, gid, gid, gid))?;
        check(libc::syscall(libc::SYS_setresuid, uid, uid, uid))?;
    }
    Ok(())
}

/// Makes `cmd`'s child apply `setup` right before it executes the program
pub fn install(cmd: &mut std::process::Command, setup: Arc<ChildSetup>) {
    // SAFETY: the closure runs in the child after fork, where only async-signal-safe code may
    // run; `ChildSetup::apply` is only system calls on prepared values (see there). The `Arc`
    // is only read in the child: its count is not touched until the parent drops the command.
    unsafe {
        cmd.pre_exec(move || setup.apply());
    }
}

/// The Landlock ABI version of the running kernel; 0 when Landlock is not built in or not enabled
#[cfg(target_os = "linux")]
pub fn landlock_abi() -> i32 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with a null attribute pointer, a size of 0 and the VERSION flag,
    // landlock_create_ruleset(2) reads no memory and only returns a number (or -1).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0 as libc::size_t,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    i32::try_from(rc).ok().filter(|&v| v > 0).unwrap_or(0)
}

/// Adds a rule to a Landlock rule set: `rights` (the kernel's access bits) beneath `parent`
#[cfg(target_os = "linux")]
pub fn landlock_add_path_rule(
    ruleset: std::os::fd::BorrowedFd<'_>,
    parent: std::os::fd::BorrowedFd<'_>,
    rights: u64,
) -> io::Result<()> {
    /// `struct landlock_path_beneath_attr` of the kernel's uapi (packed).
    #[repr(C, packed)]
    struct PathBeneathAttr {
        allowed_access: u64,
        parent_fd: i32,
    }
    const LANDLOCK_RULE_PATH_BENEATH: libc::c_int = 1;
    let attr = PathBeneathAttr {
        allowed_access: rights,
        parent_fd: parent.as_raw_fd(),
    };
    // SAFETY: landlock_add_rule(2) reads the attribute struct, which lives on this frame, and
    // takes two descriptors borrowed for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset.as_raw_fd(),
            LANDLOCK_RULE_PATH_BENEATH,
            std::ptr::from_ref(&attr),
            0 as libc::c_uint,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Landlock is Linux's: 0 elsewhere
#[cfg(not(target_os = "linux"))]
pub fn landlock_abi() -> i32 {
    0
}
