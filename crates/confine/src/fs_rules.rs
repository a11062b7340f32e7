//! Landlock rules of a call: which paths it may read or write, the agent's own files carved out
//!
//! Landlock only allows; it cannot deny a path beneath an allowed one. So a hidden path (the
//! agent's state, keys, configuration) beneath a granted directory (`/etc/toolsrv` beneath
//! `/etc`) is carved out by granting the directory's entries one by one instead of the
//! directory, every entry but the one that leads to the hidden path, and again one level down,
//! until the hidden path itself is left out. The directories enumerated this way lose their
//! listing (`ls /etc` fails) while every other entry stays reachable by its path. Entries made
//! after the enumeration are not granted, so a rule set is planned again when one of the
//! enumerated directories changes.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access as _, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, Ruleset, RulesetAttr,
    Scope,
};
use nix::fcntl::{OFlag, open};
use nix::sys::stat::Mode;

use crate::error::ConfineError;

/// The Landlock ABI these rules are written and tested for: a newer kernel is used at this
/// level, an older one at its own (rights it lacks are not restricted, and reported)
pub const TESTED_ABI: ABI = ABI::V7;

/// What a rule allows beneath a path
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Access {
    /// Read files, list directories, execute
    Read,
    /// Everything but device nodes: read, execute, create, write, remove
    Write,
}

impl Access {
    fn rights(self, is_dir: bool) -> BitFlags<AccessFs> {
        let rights = match self {
            Access::Read => AccessFs::from_read(TESTED_ABI),
            // A writable directory is no licence to make a character or block device in it: a
            // tool running as root made `/dev/kmsg`'s twin there and wrote to the kernel log.
            Access::Write => {
                AccessFs::from_all(TESTED_ABI) & !(AccessFs::MakeChar | AccessFs::MakeBlock)
            }
        };
        if is_dir {
            rights
        } else {
            rights & AccessFs::from_file(TESTED_ABI)
        }
    }
}

/// A directory whose entries were granted one by one, and how it looked then
#[derive(Debug, Clone, PartialEq, Eq)]
struct Listed {
    path: PathBuf,
    stamp: Option<(u64, i64, i64)>,
}

fn dir_stamp(path: &Path) -> Option<(u64, i64, i64)> {
    let md = std::fs::metadata(path).ok()?;
    Some((md.ino(), md.mtime(), md.mtime_nsec()))
}

/// Paths to grant, hidden paths carved out
#[derive(Debug, Default)]
pub struct Plan {
    pub rules: Vec<(PathBuf, Access)>,
    listed: Vec<Listed>,
}

impl Plan {
    /// Plans `grants` (paths that do not exist are left out) so that nothing beneath a `hidden`
    /// path is reachable through them. `hidden` must be canonical paths.
    pub fn new(grants: &[(PathBuf, Access)], hidden: &[PathBuf]) -> Self {
        let mut plan = Plan::default();
        for (path, access) in grants {
            let Ok(real) = std::fs::canonicalize(path) else {
                continue;
            };
            if hidden.iter().any(|h| real.starts_with(h)) {
                tracing::debug!(path = %path.display(), "not granted: it lies in the agent's private files");
                continue;
            }
            plan.grant(real, *access, hidden);
        }
        plan.rules.sort();
        plan.rules.dedup();
        plan
    }

    fn grant(&mut self, path: PathBuf, access: Access, hidden: &[PathBuf]) {
        let inside = hidden.iter().any(|h| h.starts_with(&path) && *h != path);
        if !inside {
            self.rules.push((path, access));
            return;
        }
        let Ok(entries) = std::fs::read_dir(&path) else {
            return;
        };
        self.listed.push(Listed {
            stamp: dir_stamp(&path),
            path: path.clone(),
        });
        for entry in entries.flatten() {
            let entry_path = entry.path();
            if hidden.contains(&entry_path) {
                continue;
            }
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_symlink() {
                // Landlock checks the path a link resolves to: grant the target, unless it leads
                // into (or holds) a hidden path.
                match std::fs::canonicalize(&entry_path) {
                    Ok(target)
                        if !hidden
                            .iter()
                            .any(|h| target.starts_with(h) || h.starts_with(&target)) =>
                    {
                        self.rules.push((target, access));
                    }
                    _ => {}
                }
            } else if kind.is_dir() {
                self.grant(entry_path, access, hidden);
            } else {
                self.rules.push((entry_path, access));
            }
        }
    }

    /// Whether a directory enumerated for this plan has changed since (entries added, removed
    /// or replaced): the plan must be made again
    pub fn stale(&self) -> bool {
        self.listed.iter().any(|l| dir_stamp(&l.path) != l.stamp)
    }

    /// How many directories were enumerated to carve hidden paths out
    pub fn enumerated(&self) -> usize {
        self.listed.len()
    }
}

/// One rule, its path held open (`O_PATH`) so that adding it to a rule set is one system call
#[derive(Debug)]
pub struct OpenRule {
    fd: OwnedFd,
    rights: BitFlags<AccessFs>,
}

/// Opens the paths of `rules`; paths that vanished are left out
pub fn open_rules(rules: &[(PathBuf, Access)]) -> Vec<OpenRule> {
    rules
        .iter()
        .filter_map(|(path, access)| open_rule(path, *access))
        .collect()
}

/// Opens one path for a rule; `None` when it is gone
pub fn open_rule(path: &Path, access: Access) -> Option<OpenRule> {
    let flags = OFlag::O_PATH | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
    let fd = open(path, flags, Mode::empty()).ok()?;
    let is_dir = nix::sys::stat::fstat(&fd)
        .map(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
        .ok()?;
    Some(OpenRule {
        fd,
        rights: access.rights(is_dir),
    })
}

/// Builds a Landlock rule set from `rules` and returns its descriptor, for the tool's process
/// to restrict itself with; `None` when the kernel has no Landlock
///
/// Without `network`, TCP bind and connect are denied (ABI 4 and later) and so is connecting to
/// abstract Unix sockets made outside the call (ABI 6). Signals to processes outside the call
/// are always denied (ABI 6): a tool cannot signal the agent.
pub fn build<'a>(
    rules: impl IntoIterator<Item = &'a OpenRule>,
    network: bool,
) -> Result<Option<OwnedFd>, ConfineError> {
    let err = |e: landlock::RulesetError| ConfineError::Landlock(e.to_string());
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(TESTED_ABI))
        .map_err(err)?
        .scope(Scope::Signal)
        .map_err(err)?;
    if !network {
        ruleset = ruleset
            .handle_access(AccessNet::from_all(TESTED_ABI))
            .map_err(err)?
            .scope(Scope::AbstractUnixSocket)
            .map_err(err)?;
    }
    let created: Option<OwnedFd> = ruleset.create().map_err(err)?.into();
    let Some(ruleset) = created else {
        return Ok(None);
    };
    // One system call per rule: the rights were fitted to the path's type when it was opened
    // (the `landlock` crate would `fstat` each path again, per call and rule, to find out), and
    // are cut to what this kernel handles, as the rule set was made.
    let handled = AccessFs::from_all(ABI::from(crate::sys::landlock_abi()).min(TESTED_ABI));
    for rule in rules {
        let rights = rule.rights & handled;
        if rights.is_empty() {
            continue;
        }
        crate::sys::landlock_add_path_rule(ruleset.as_fd(), rule.fd.as_fd(), rights.bits())
            .map_err(|e| {
                ConfineError::Landlock(format!("cannot add a rule to the rule set: {e}"))
            })?;
    }
    Ok(Some(ruleset))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn hidden_paths_are_carved_out_of_granted_directories() {
        let root = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(root.path()).unwrap();
        let etc = root.join("etc");
        for dir in ["etc/toolsrv/pki", "etc/ssl", "etc/other/deep"] {
            std::fs::create_dir_all(root.join(dir)).unwrap();
        }
        for file in [
            "etc/passwd",
            "etc/toolsrv/agent.conf",
            "etc/toolsrv/pki/agent-key.pem",
        ] {
            std::fs::write(root.join(file), "x").unwrap();
        }
        std::os::unix::fs::symlink(etc.join("toolsrv/pki"), etc.join("keys")).unwrap();
        std::os::unix::fs::symlink(etc.join("ssl"), etc.join("certs")).unwrap();
        std::os::unix::fs::symlink(root.join("nowhere"), etc.join("dangling")).unwrap();

        let hidden = [etc.join("toolsrv/pki")];
        let plan = Plan::new(&[(etc.clone(), Access::Read)], &hidden);
        let got: Vec<String> = plan
            .rules
            .iter()
            .map(|(p, _)| p.strip_prefix(&root).unwrap().display().to_string())
            .collect();
        // `keys` leads into the hidden directory and `dangling` nowhere: both left out; `certs`
        // is granted as its target.
        assert_eq!(
            got,
            [
                "etc/other",
                "etc/passwd",
                "etc/ssl",
                "etc/toolsrv/agent.conf"
            ]
        );
        assert_eq!(plan.enumerated(), 2, "etc and etc/toolsrv were enumerated");
        assert!(!plan.stale());
        std::fs::write(etc.join("new"), "x").unwrap();
        assert!(plan.stale(), "a new entry in /etc needs a new plan");

        let whole = Plan::new(
            &[(etc.join("toolsrv"), Access::Write)],
            std::slice::from_ref(&etc),
        );
        assert!(
            whole.rules.is_empty(),
            "a grant inside a hidden path is dropped"
        );
        let untouched = Plan::new(&[(etc.join("ssl"), Access::Read)], &hidden);
        assert_eq!(untouched.rules, [(etc.join("ssl"), Access::Read)]);
        assert_eq!(untouched.enumerated(), 0);
        let missing = Plan::new(&[(root.join("missing"), Access::Read)], &hidden);
        assert!(missing.rules.is_empty());
    }

    #[test]
    fn files_get_file_rights_only() {
        assert!(!Access::Read.rights(false).contains(AccessFs::ReadDir));
        assert!(Access::Read.rights(true).contains(AccessFs::ReadDir));
        assert!(!Access::Write.rights(false).contains(AccessFs::MakeDir));
        assert!(Access::Write.rights(false).contains(AccessFs::WriteFile));
    }
}
