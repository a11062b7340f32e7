//! What the agent's `PATH` finds that a confined call could not run: programs that are symbolic
//! links to files outside every path calls may read (Homebrew's `bin`, a hand-made link into a
//! build tree), and a version manager's shims, scripts that run a program under the manager's
//! root (pyenv, rbenv, asdf, mise). Variants find such programs, so their tools are visible, and
//! a call fails with `Permission denied`: the agent says so once, at start, naming what to grant.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Most entries of one `PATH` directory looked at.
const MAX_ENTRIES: usize = 20_000;

/// Most directories of link targets warned about one by one; the rest are counted.
const MAX_TARGET_DIRS: usize = 8;

/// Most programs one warning names.
const MAX_NAMED: usize = 5;

/// One reason programs found on `PATH` cannot run in a confined call.
#[derive(Debug, PartialEq)]
pub enum OutOfReach {
    /// A version manager's `shims` directory whose `root` no grant covers.
    Shims { shims: PathBuf, root: PathBuf },
    /// Programs on `PATH` (the links) whose files lie in `target_dir`, which no grant covers.
    Links {
        target_dir: PathBuf,
        programs: Vec<PathBuf>,
    },
    /// More directories of link targets than are warned about one by one.
    MoreLinks { dirs: usize },
}

impl OutOfReach {
    /// Logs it as a warning that says what to grant.
    pub fn warn(&self) {
        match self {
            Self::Shims { shims, root } => tracing::warn!(
                shims = %shims.display(),
                root = %root.display(),
                "PATH holds a version manager's shims, which run programs under its root: \
                 confined calls cannot read it, so tools found there fail with `Permission \
                 denied`; add --sandbox-read ROOT, or put the programs' own directories on PATH"
            ),
            Self::Links {
                target_dir,
                programs,
            } => tracing::warn!(
                dir = %target_dir.display(),
                programs = %named(programs),
                "programs on PATH are symbolic links to files in a directory confined calls \
                 cannot read, so tools that run them fail with `Permission denied`; add \
                 --sandbox-read DIR (or a directory above it)"
            ),
            Self::MoreLinks { dirs } => tracing::warn!(
                dirs,
                "and programs on PATH link into more directories confined calls cannot read"
            ),
        }
    }
}

/// The first programs of `programs`, comma-separated, then how many more.
fn named(programs: &[PathBuf]) -> String {
    let mut text = programs
        .iter()
        .take(MAX_NAMED)
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    if programs.len() > MAX_NAMED {
        text.push_str(&format!(" and {} more", programs.len() - MAX_NAMED));
    }
    text
}

/// The absolute directories of this process's `PATH`, in order, as variants read them
/// ([`Host::path_dirs`](toolsrv_meta::Host::path_dirs)): where they find programs, and what
/// confined calls may read besides the system.
pub fn path_dirs() -> Vec<PathBuf> {
    toolsrv_meta::Host::current()
        .path_dirs()
        .filter(|d| d.is_absolute())
        .map(Path::to_path_buf)
        .collect()
}

/// The version managers' shims among `path_dirs` (a directory named `shims`), each with the root
/// whose programs they run: its parent. A root that is `/`, `home` or holds `home` is no
/// manager's and is left out.
pub fn shim_roots(path_dirs: &[PathBuf], home: Option<&Path>) -> Vec<(PathBuf, PathBuf)> {
    path_dirs
        .iter()
        .filter(|d| d.file_name().is_some_and(|n| n == "shims") && d.is_dir())
        .filter_map(|d| Some((d.clone(), d.parent()?.to_path_buf())))
        .filter(|(_, root)| {
            root.parent().is_some() && home.is_none_or(|home| !home.starts_with(root))
        })
        .collect()
}

/// What of `path_dirs` a confined call could not run, given what it may read: the system's
/// directories and `granted` (the agent's defaults, `PATH` directories among them).
pub fn out_of_reach(
    path_dirs: &[PathBuf],
    granted: &[PathBuf],
    home: Option<&Path>,
) -> Vec<OutOfReach> {
    // Grants apply to what a path resolves to (`/bin` is `/usr/bin` on most systems).
    let readable: Vec<PathBuf> = toolsrv_confine::SYSTEM_READ
        .iter()
        .map(PathBuf::from)
        .chain(granted.iter().cloned())
        .filter_map(|p| p.canonicalize().ok())
        .collect();
    let reachable = |path: &Path| readable.iter().any(|r| path.starts_with(r));
    let mut found: Vec<OutOfReach> = shim_roots(path_dirs, home)
        .into_iter()
        .filter(|(_, root)| !root.canonicalize().is_ok_and(|r| reachable(&r)))
        .map(|(shims, root)| OutOfReach::Shims { shims, root })
        .collect();
    let mut targets: BTreeMap<PathBuf, Vec<PathBuf>> = BTreeMap::new();
    for dir in path_dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten().take(MAX_ENTRIES) {
            if !entry.file_type().is_ok_and(|t| t.is_symlink()) {
                continue;
            }
            // A dangling link finds nothing, so it offers no tool either.
            let Ok(target) = entry.path().canonicalize() else {
                continue;
            };
            if !reachable(&target)
                && let Some(parent) = target.parent()
            {
                targets
                    .entry(parent.to_path_buf())
                    .or_default()
                    .push(entry.path());
            }
        }
    }
    let more = targets.len().saturating_sub(MAX_TARGET_DIRS);
    for (target_dir, mut programs) in targets.into_iter().take(MAX_TARGET_DIRS) {
        programs.sort();
        found.push(OutOfReach::Links {
            target_dir,
            programs,
        });
    }
    if more > 0 {
        found.push(OutOfReach::MoreLinks { dirs: more });
    }
    found
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn shims_name_their_managers_root_but_never_home_or_the_root_directory() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home/u");
        for d in [
            "home/u/.pyenv/shims",
            "home/u/shims",
            "opt/tools/bin",
            "home/u/.asdf/shims",
        ] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        let path: Vec<PathBuf> = [
            "home/u/.pyenv/shims",
            "opt/tools/bin",
            "home/u/shims",
            "home/u/.rbenv/shims", // not there
            "home/u/.asdf/shims",
        ]
        .iter()
        .map(|d| dir.path().join(d))
        .collect();
        let roots: Vec<PathBuf> = shim_roots(&path, Some(&home))
            .into_iter()
            .map(|(_, root)| root)
            .collect();
        assert_eq!(roots, [home.join(".pyenv"), home.join(".asdf")]);
        assert!(shim_roots(&[PathBuf::from("/")], None).is_empty());
        // Without HOME, a `shims` directory's parent is still only that directory.
        assert_eq!(shim_roots(&path[2..3], None)[0].1, home);
    }

    #[test]
    fn links_out_of_reach_are_grouped_by_target_directory_and_grants_silence_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().canonicalize().unwrap();
        let (bin, cellar, tools) = (d.join("bin"), d.join("cellar/jq/bin"), d.join("tools"));
        for x in [&bin, &cellar, &tools] {
            std::fs::create_dir_all(x).unwrap();
        }
        for name in ["jq", "yq"] {
            std::fs::write(cellar.join(name), "").unwrap();
            symlink(cellar.join(name), bin.join(name)).unwrap();
        }
        std::fs::write(tools.join("own"), "").unwrap();
        // Into another PATH directory, into the system, and dangling: all fine.
        symlink(tools.join("own"), bin.join("own")).unwrap();
        symlink("/bin/sh", bin.join("sh")).unwrap();
        symlink(d.join("gone"), bin.join("gone")).unwrap();
        let path = [bin.clone(), tools.clone()];
        let found = out_of_reach(&path, &path, None);
        assert_eq!(
            found,
            [OutOfReach::Links {
                target_dir: cellar.clone(),
                programs: vec![bin.join("jq"), bin.join("yq")],
            }]
        );
        let granted = [bin.clone(), tools, d.join("cellar")];
        assert_eq!(out_of_reach(&path, &granted, None), []);
    }

    #[test]
    fn many_target_directories_are_counted_past_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().canonicalize().unwrap();
        let bin = d.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        for i in 0..MAX_TARGET_DIRS + 3 {
            let target = d.join(format!("pkg-{i:02}"));
            std::fs::create_dir_all(&target).unwrap();
            std::fs::write(target.join("p"), "").unwrap();
            symlink(target.join("p"), bin.join(format!("p{i}"))).unwrap();
        }
        let found = out_of_reach(std::slice::from_ref(&bin), std::slice::from_ref(&bin), None);
        assert_eq!(found.len(), MAX_TARGET_DIRS + 1);
        assert_eq!(found.last(), Some(&OutOfReach::MoreLinks { dirs: 3 }));
    }

    #[test]
    fn a_warning_names_a_few_programs_then_counts() {
        let programs: Vec<PathBuf> = (0..8).map(|i| PathBuf::from(format!("/b/p{i}"))).collect();
        assert_eq!(named(&programs[..2]), "/b/p0, /b/p1");
        assert_eq!(
            named(&programs),
            "/b/p0, /b/p1, /b/p2, /b/p3, /b/p4 and 3 more"
        );
    }
}
