//! The workspace's built binaries (`toolsrv`, `toolctl`), refused when older than their sources.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::{Result, TestkitError, must};

/// The directory of the running test or bench executable's profile (`target/debug` for
/// `target/debug/deps/fleet-*`), where cargo puts the workspace binaries.
pub fn profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.parent()?.to_path_buf())
}

/// A built binary of this workspace (`toolsrv`, `toolctl`) in [`profile_dir`]. An error, saying
/// how to fix it, when the binary is missing or older than a source it is built from:
/// `cargo test -p toolsrv-tests` alone does not rebuild the binaries, and a test of stale
/// binaries passes or fails for the wrong reasons.
pub fn try_bin(name: &str) -> Result<PathBuf> {
    let dir = profile_dir().ok_or_else(|| TestkitError::MissingBinary {
        path: PathBuf::from(name),
    })?;
    let path = dir.join(name);
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .map_err(|_| TestkitError::MissingBinary { path: path.clone() })?;
    // The crates each binary is not built from: a change there does not relink it.
    let not_built_from: &[&str] = match name {
        "toolsrv" => &["client", "bench", "testkit"],
        "toolctl" => &[
            "server",
            "coordinator",
            "agent",
            "metrics",
            "cluster",
            "bench",
            "testkit",
        ],
        _ => &["bench", "testkit"],
    };
    // Only `toolsrv` embeds the example tools (for `toolsrv up`).
    let embeds_examples = name == "toolsrv";
    if let Some((newer, changed)) = newest_source(not_built_from, embeds_examples)
        && changed > built
    {
        return Err(TestkitError::StaleBinary { path, newer });
    }
    Ok(path)
}

/// [`try_bin`], failing the test when the binary is missing or stale.
#[track_caller]
pub fn bin(name: &str) -> PathBuf {
    must(try_bin(name))
}

/// The root of the workspace this crate belongs to.
pub fn workspace_root() -> PathBuf {
    // crates/testkit → the workspace.
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(Path::parent)
        .unwrap_or(manifest)
        .to_path_buf()
}

/// The most recently modified source a binary is built from: the crates but `skip_crates`, the
/// protocol, and the example tools when it embeds them: Rust and proto sources only. Manifests
/// and the lock file are left out: they also change for test-only dependencies, which relink
/// nothing.
fn newest_source(skip_crates: &[&str], examples: bool) -> Option<(PathBuf, SystemTime)> {
    let root = workspace_root();
    let skip: Vec<PathBuf> = skip_crates
        .iter()
        .map(|c| root.join("crates").join(c))
        .collect();
    let mut newest: Option<(PathBuf, SystemTime)> = None;
    let mut consider = |path: PathBuf| {
        if let Ok(modified) = std::fs::metadata(&path).and_then(|m| m.modified())
            && newest.as_ref().is_none_or(|(_, t)| modified > *t)
        {
            newest = Some((path, modified));
        }
    };
    let mut dirs = vec![root.join("crates"), root.join("proto")];
    if examples {
        dirs.push(root.join("examples/tools"));
    }
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            // Tests and benches are not part of the binaries.
            if ["target", "tests", "benches"].contains(&name.to_string_lossy().as_ref())
                || skip.contains(&path)
            {
                continue;
            }
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(path);
            } else if path.starts_with(root.join("examples"))
                || path.extension().is_some_and(|e| e == "rs" || e == "proto")
            {
                // Manifests are left out like the lock file: a test-only dependency changes
                // them without relinking anything.
                consider(path);
            }
        }
    }
    newest
}
