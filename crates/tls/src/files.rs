//! Reading a file an operator names (a certificate, a key, a CRL, a policy, a configuration
//! file): at most a bound's worth, so that a path to a device (`/dev/zero`) or a runaway file
//! is an error naming it instead of a process that reads until memory runs out.

use std::io::Read;
use std::path::{Path, PathBuf};

/// Most bytes read of a PEM file of certificates or of a key: a system CA bundle is about
/// 200 KiB.
pub const MAX_PEM_BYTES: u64 = 4 << 20;
/// Most bytes read of a CRL file: a large CA's CRL runs to tens of megabytes.
pub const MAX_CRL_BYTES: u64 = 256 << 20;
/// Most bytes read of a configuration, policy or labels file, or a state file of the
/// coordinator's own.
pub const MAX_SETTINGS_BYTES: u64 = 64 << 20;

/// At most `max` bytes of `input`: `None` when it holds more (it is read up to `max + 1`, so an
/// endless input ends there). Every bounded read of a file, a pipe or stdin goes through here,
/// each caller saying in its own words that the input was too large.
pub fn read_up_to(input: impl Read, max: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    input.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= max).then_some(bytes))
}

/// [`read_up_to`], as UTF-8 text (invalid UTF-8 is an error, as `read_to_string` makes it).
pub fn read_text_up_to(input: impl Read, max: u64) -> std::io::Result<Option<String>> {
    read_up_to(input, max)?
        .map(|bytes| {
            String::from_utf8(bytes).map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "stream did not contain valid UTF-8",
                )
            })
        })
        .transpose()
}

/// Opens `path` for reading without waiting for a writer. A plain `open` of a FIFO that no
/// process writes to (a path named by mistake, or another user's trap) waits for one for good,
/// in a process whose runtime has taken over SIGTERM and SIGINT: only SIGKILL ended it. The file
/// is opened non-blocking, then made blocking again, so a FIFO with a writer (`--ca <(...)`) is
/// read as before and one without reads as empty; a terminal does not become the process's.
pub fn open_read(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(OPEN_WITHOUT_WAITING)
        .open(path)?;
    blocking_again(&file)?;
    Ok(file)
}

/// Flags that open a file without waiting for a FIFO's other end, nor making a terminal the
/// process's: give them to `OpenOptions::custom_flags`, then [`blocking_again`].
pub const OPEN_WITHOUT_WAITING: i32 =
    nix::fcntl::OFlag::O_NONBLOCK.bits() | nix::fcntl::OFlag::O_NOCTTY.bits();

/// Makes reads and writes of `file`, opened with [`OPEN_WITHOUT_WAITING`], wait again.
pub fn blocking_again(file: &std::fs::File) -> std::io::Result<()> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    let flags = OFlag::from_bits_retain(fcntl(file, FcntlArg::F_GETFL)?);
    fcntl(file, FcntlArg::F_SETFL(flags - OFlag::O_NONBLOCK))?;
    Ok(())
}

/// The bytes of `path`, or an error when it holds more than `max`.
pub fn read_bounded(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    read_up_to(open_read(path)?, max)?.ok_or_else(|| too_large(max))
}

/// [`read_bounded`], as UTF-8 text.
pub fn read_text_bounded(path: &Path, max: u64) -> std::io::Result<String> {
    read_text_up_to(open_read(path)?, max)?.ok_or_else(|| too_large(max))
}

/// The text of the private key file `path`, refused when every user of the machine may read
/// or write it: whoever can read a key acts as its certificate's holder (an agent, the
/// coordinator, an administrator, or a CA that signs anyone in), as `ssh` refuses such a key.
/// Its group may read it (the deployments give a service's group the key, mode 0440 or 0640);
/// only a regular file's mode counts (a pipe, `/dev/stdin`, has none to speak of), and only
/// when it holds a private key (a certificate given as the key is left to the caller's parser
/// to explain). The mode is that of the file opened, so a rename in between changes nothing.
pub fn read_private_key(path: &Path) -> Result<String, crate::TlsError> {
    use std::os::unix::fs::MetadataExt;
    let cannot_read = |e| crate::TlsError::io("cannot read", path, e);
    let file = open_read(path).map_err(cannot_read)?;
    let md = file.metadata().map_err(cannot_read)?;
    let text = read_text_up_to(file, MAX_PEM_BYTES)
        .map_err(cannot_read)?
        .ok_or_else(|| cannot_read(too_large(MAX_PEM_BYTES)))?;
    if text.contains("PRIVATE KEY-----")
        && let Some(why) = open_to_others(md.is_file(), md.mode())
    {
        return Err(crate::TlsError::bad_file(
            path,
            format!(
                "{why}: anyone logged in here could use this private key to act as its \
                 certificate's holder, so it is not used: chmod o-rw {} (in a Kubernetes Secret \
                 volume, give it defaultMode 0400, or 0440 with the pod's fsGroup)",
                path.display()
            ),
        ));
    }
    Ok(text)
}

/// What makes a file of `mode` open to every user of the machine, if anything.
fn open_to_others(regular: bool, mode: u32) -> Option<String> {
    let what = match (mode & 0o004 != 0, mode & 0o002 != 0) {
        _ if !regular => return None,
        (true, true) => "readable and writable",
        (true, false) => "readable",
        (false, true) => "writable",
        (false, false) => return None,
    };
    Some(format!(
        "{what} by every user of this machine (mode {:04o})",
        mode & 0o7777
    ))
}

fn too_large(max: u64) -> std::io::Error {
    std::io::Error::other(format!(
        "larger than {max} bytes, the most read of such a file"
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_device_or_a_file_past_the_bound_is_an_error_and_one_at_it_is_read() {
        let err = read_bounded(Path::new("/dev/zero"), 1024).unwrap_err();
        assert!(err.to_string().contains("larger than 1024 bytes"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, "x".repeat(1024)).unwrap();
        assert_eq!(read_text_bounded(&path, 1024).unwrap().len(), 1024);
        assert!(read_bounded(&path, 1023).is_err());
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert!(read_text_bounded(&path, 1024).is_err());
        assert!(read_bounded(&dir.path().join("missing"), 1).is_err());
    }

    #[test]
    fn a_private_key_every_user_may_read_or_write_is_refused_naming_the_fix() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.pem");
        std::fs::write(&path, "-----BEGIN PRIVATE KEY-----\n").unwrap();
        for (mode, what) in [
            (0o644, "readable by every user of this machine (mode 0644)"),
            (0o604, "readable by every user of this machine (mode 0604)"),
            (0o602, "writable by every user of this machine (mode 0602)"),
            (
                0o666,
                "readable and writable by every user of this machine (mode 0666)",
            ),
        ] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = read_private_key(&path).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("{}: {what}", path.display())),
                "{err}"
            );
            assert!(
                err.contains(&format!("chmod o-rw {}", path.display())),
                "{err}"
            );
        }
        // Its owner and its group may read it.
        for mode in [0o400, 0o600, 0o640, 0o440, 0o660] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(
                read_private_key(&path).unwrap(),
                "-----BEGIN PRIVATE KEY-----\n"
            );
        }
        // A file with no key in it (a certificate given as the key) is left to the parser.
        std::fs::write(&path, "-----BEGIN CERTIFICATE-----\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_private_key(&path).is_ok());
        // A pipe's mode says nothing about who holds the key.
        assert_eq!(open_to_others(false, 0o666), None);
        let err = read_private_key(&dir.path().join("missing")).unwrap_err();
        assert!(err.to_string().starts_with("cannot read"), "{err}");
    }
}

/// One entry met on the way to a path by [`walk`].
#[derive(Debug)]
pub struct Step<'a> {
    /// The entry, as resolved so far (a link's target is followed from the directory holding it).
    pub path: &'a Path,
    /// What `lstat` says of it: a symbolic link is itself, not what it leads to.
    pub md: &'a std::fs::Metadata,
    /// The directory holding it, with its metadata (none for `/`).
    pub parent: Option<(&'a Path, &'a std::fs::Metadata)>,
    /// Whether it is the end of the way: what the path names, once every link is followed.
    pub last: bool,
}

/// Why [`walk`] stopped.
#[derive(Debug)]
pub enum WalkError {
    /// An entry could not be looked at (gone, a path too long for the system, no permission,
    /// too many links): callers judging who could change a file treat it as they see fit.
    Io {
        /// The entry.
        at: PathBuf,
        /// What the system said.
        error: std::io::Error,
    },
    /// The visitor refused a step.
    Refused(String),
}

impl std::fmt::Display for WalkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Io { at, error } => write!(f, "{}: {error}", at.display()),
            Self::Refused(why) => f.write_str(why),
        }
    }
}

/// Most symbolic links [`walk`] follows, as the kernel (`ELOOP`).
const MAX_LINKS: usize = 40;

/// Resolves `path` one entry at a time from `/`, as the kernel does, and calls `visit` on every
/// entry it looks at: each directory, each symbolic link (wherever it is met, a link inside a
/// link's target included) and the end; returns where the path leads. Nothing is resolved by
/// `canonicalize`, which hides the links on the way and fails on paths longer than the system
/// takes, so whoever could change any entry on the way is seen.
pub fn walk(
    path: &Path,
    mut visit: impl FnMut(&Step<'_>) -> Result<(), String>,
) -> Result<PathBuf, WalkError> {
    use std::collections::VecDeque;
    use std::ffi::OsString;
    use std::path::Component;
    let parts = |p: &Path| -> VecDeque<OsString> {
        p.components()
            .filter_map(|c| match c {
                Component::Normal(name) => Some(name.to_owned()),
                Component::ParentDir => Some("..".into()),
                _ => None,
            })
            .collect()
    };
    let io = |at: &Path| {
        let at = at.to_path_buf();
        move |error| WalkError::Io { at, error }
    };
    let absolute = std::path::absolute(path).map_err(io(path))?;
    let root = PathBuf::from("/");
    let root_md = std::fs::symlink_metadata(&root).map_err(io(&root))?;
    let mut rest = parts(&absolute);
    visit(&Step {
        path: &root,
        md: &root_md,
        parent: None,
        last: rest.is_empty(),
    })
    .map_err(WalkError::Refused)?;
    // The directories from `/` down to the current one, for `..`.
    let mut trail: Vec<(PathBuf, std::fs::Metadata)> = vec![(root.clone(), root_md)];
    let mut links = 0;
    while let Some(name) = rest.pop_front() {
        if name == ".." {
            if trail.len() > 1 {
                trail.pop();
            }
            continue;
        }
        // `/` stays at the bottom of the trail: it is never empty.
        let Some((dir, dir_md)) = trail.last().cloned() else {
            break;
        };
        let next = dir.join(&name);
        let md = std::fs::symlink_metadata(&next).map_err(io(&next))?;
        let link = md.file_type().is_symlink();
        visit(&Step {
            path: &next,
            md: &md,
            parent: Some((&dir, &dir_md)),
            last: rest.is_empty() && !link,
        })
        .map_err(WalkError::Refused)?;
        if link {
            links += 1;
            if links > MAX_LINKS {
                return Err(WalkError::Io {
                    at: next,
                    error: std::io::Error::other("too many symbolic links on the way"),
                });
            }
            let target = std::fs::read_link(&next).map_err(io(&next))?;
            if target.is_absolute() {
                trail.truncate(1);
            }
            let mut followed = parts(&target);
            followed.extend(rest.drain(..));
            rest = followed;
            continue;
        }
        trail.push((next, md));
    }
    Ok(trail.last().map_or(root, |(p, _)| p.clone()))
}

/// Whether users other than this process's user (and root) may write a directory of `md`: it
/// is writable by everyone, or by a group this process is not in. A group of this process's
/// own (a Kubernetes `fsGroup` volume is mode 2775 of the pod's group) is its grant to make.
pub fn writable_by_others(md: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    let mode = md.mode();
    if mode & 0o002 != 0 {
        return true;
    }
    if mode & 0o020 == 0 {
        return false;
    }
    let gid = nix::unistd::Gid::from_raw(md.gid());
    let ours = gid == nix::unistd::getegid()
        || nix::unistd::getgroups().is_ok_and(|groups| groups.contains(&gid));
    !ours
}

/// Before `dir` is made: the nearest of it and the directories above it that exists passes
/// [`check_owned_dir`], and when `dir` is to be made in it, no other user may write it unless
/// it is sticky. So nothing is made where another user's link or directory leads, before the
/// made directory is refused.
pub fn check_before_creating(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let absolute = std::path::absolute(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let Some(existing) = absolute
        .ancestors()
        .find(|a| std::fs::symlink_metadata(a).is_ok())
    else {
        return Ok(());
    };
    check_owned_dir(existing)?;
    if existing != absolute {
        let md = std::fs::metadata(existing).map_err(|e| format!("{}: {e}", existing.display()))?;
        let mode = md.mode();
        if writable_by_others(&md) && mode & 0o1000 == 0 {
            return Err(format!(
                "{} would be made in {}, which other users may write (mode {:04o}): chmod \
                 go-w {} (or +t), or use another directory",
                absolute.display(),
                existing.display(),
                mode & 0o7777,
                existing.display()
            ));
        }
    }
    Ok(())
}

/// Refuses `dir` (which exists) unless this process's user or root owns it and every entry on
/// the way to it, symbolic links included wherever they are met, and no other user may change a
/// directory above it: writable by group or others only with the sticky bit, as `/tmp` is, where
/// nobody renames what another user owns. Otherwise another local user could swap what the
/// directory holds (a certificate, a CA key, a tool the agent runs as root): one who made
/// `/tmp/state` before the service did owns it still, and one whose link is on the way can point
/// it elsewhere. Whether `dir` itself is writable by others is the caller's to judge. The reason
/// names the entry at fault and what to do.
pub fn check_owned_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let uid = nix::unistd::geteuid().as_raw();
    walk(dir, |step| {
        let owner = step.md.uid();
        if owner != uid && owner != 0 {
            let what = if step.md.file_type().is_symlink() {
                format!("the symbolic link {}", step.path.display())
            } else if step.last {
                step.path.display().to_string()
            } else {
                format!("{}, a directory above it,", step.path.display())
            };
            return Err(format!(
                "{what} is owned by uid {owner}, neither this process's user (uid {uid}) nor \
                 root: that user could replace what is in it; use a directory only root or uid \
                 {uid} can change"
            ));
        }
        let mode = step.md.mode();
        if !step.last && step.md.is_dir() && writable_by_others(step.md) && mode & 0o1000 == 0 {
            return Err(format!(
                "the directory above it, {}, may be written by other users (mode {:04o}), \
                 who could replace what is in it: chmod go-w {} (or +t), or use another \
                 directory",
                step.path.display(),
                mode & 0o7777,
                step.path.display()
            ));
        }
        Ok(())
    })
    .map(drop)
    .map_err(|e| match e {
        WalkError::Refused(why) => why,
        io => format!("{}: cannot be checked: {io}", dir.display()),
    })
}

#[cfg(test)]
mod owned_tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_directory_of_ones_own_under_private_or_sticky_parents_passes() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        check_owned_dir(&dir).unwrap();
        // A sticky directory anyone may write (as /tmp) above it is fine.
        mode(root.path(), 0o1777);
        check_owned_dir(&dir).unwrap();
    }

    /// Group write for a group of this process's own is its grant (a Kubernetes `fsGroup`
    /// volume, mode 2775 of the pod's group); for another group, it lets others in.
    #[test]
    fn group_write_counts_only_for_a_group_this_process_is_not_in() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("shared/state");
        std::fs::create_dir_all(&dir).unwrap();
        let shared = root.path().join("shared");
        mode(&shared, 0o2775);
        check_owned_dir(&dir).unwrap();
        assert!(
            nix::unistd::geteuid().is_root(),
            "giving the directory to another group needs root (as CI runs)"
        );
        let others = nix::unistd::Gid::from_raw(65534);
        assert!(!nix::unistd::getgroups().unwrap().contains(&others));
        std::os::unix::fs::chown(&shared, None, Some(65534)).unwrap();
        mode(&shared, 0o2775);
        let err = check_owned_dir(&dir).unwrap_err();
        assert!(err.contains("mode 2775"), "{err}");
    }

    #[test]
    fn a_directory_others_may_change_above_it_is_refused_by_name() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("shared/state");
        std::fs::create_dir_all(&dir).unwrap();
        mode(&root.path().join("shared"), 0o777);
        let err = check_owned_dir(&dir).unwrap_err();
        assert!(
            err.contains(&root.path().join("shared").display().to_string())
                && err.contains("mode 0777"),
            "{err}"
        );
    }

    #[test]
    fn another_users_directory_or_link_on_the_way_is_refused() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test gives files to another user, which needs root (as CI runs)"
        );
        let root = tempfile::tempdir().unwrap();
        let nobody = 65534;
        let theirs = root.path().join("theirs");
        std::fs::create_dir_all(theirs.join("state")).unwrap();
        std::os::unix::fs::chown(&theirs, Some(nobody), None).unwrap();
        let err = check_owned_dir(&theirs.join("state")).unwrap_err();
        assert!(
            err.contains(&theirs.display().to_string()) && err.contains("uid 65534"),
            "{err}"
        );
        // A link of theirs to a directory of ours: they could point it elsewhere.
        let ours = root.path().join("ours");
        std::fs::create_dir(&ours).unwrap();
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&ours, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(nobody), None).unwrap();
        let err = check_owned_dir(&link).unwrap_err();
        assert!(
            err.contains("symbolic link") && err.contains(&link.display().to_string()),
            "{err}"
        );
        // The same link reached through one of ours: a link in the middle of the way, which
        // neither the path as given nor its canonical form shows.
        let ours_to_theirs = root.path().join("state");
        std::os::unix::fs::symlink(&link, &ours_to_theirs).unwrap();
        let err = check_owned_dir(&ours_to_theirs).unwrap_err();
        assert!(
            err.contains("symbolic link") && err.contains(&link.display().to_string()),
            "{err}"
        );
        // And in a link's relative target, after `..`.
        let sub = root.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        std::os::unix::fs::symlink("../link", sub.join("up")).unwrap();
        assert!(check_owned_dir(&sub.join("up")).is_err());
        check_owned_dir(&ours).unwrap();
    }
}
