//! The materialized shipped catalog `<state>/catalog/`: `N.meta` and `N` written atomically from
//! catalog updates.
//!
//! Architecture invariant: nothing is written outside the catalog and blob directories, whatever
//! names the coordinator sends; every file appears whole (temp file + rename) or not at all.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use toolsrv_proto::v1::{BlobRef, CatalogUpdate, ToolDocument};
use toolsrv_registry::hex_sha256;

use crate::blobs::{BlobCache, BlobSource};
use crate::error::AgentError;

/// Prefix of temp files; the scanner skips dot-files, and a full update sweeps leftovers.
const TMP_PREFIX: &str = ".tmp-";

/// What applying one update did besides writing files.
#[derive(Debug, Default)]
pub struct ApplyReport {
    /// Tools whose executable could not be fetched: they are served without it for now.
    pub missing: BTreeMap<String, BlobRef>,
    /// Upserts and removals that were refused (bad name, wrong digest), with the reason.
    pub refused: Vec<AgentError>,
}

/// The catalog directory and the blob cache it links executables from.
#[derive(Debug, Clone)]
pub struct CatalogStore {
    dir: PathBuf,
    blobs: BlobCache,
}

/// A tool name that may become a file name in the catalog directory.
///
/// `[A-Za-z0-9_.-]+`, not `.` or `..`, and not ending in `.meta` (the executable of `x.meta`
/// would overwrite the definition of `x`).
pub fn is_safe_tool_name(name: &str) -> bool {
    toolsrv_meta::is_valid_name(name) && name != "." && name != ".." && !name.ends_with(".meta")
}

impl CatalogStore {
    pub fn new(dir: impl Into<PathBuf>, blobs: BlobCache) -> Self {
        Self {
            dir: dir.into(),
            blobs,
        }
    }

    /// Creates the catalog and blob directories.
    pub fn open(&self) -> Result<(), AgentError> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| AgentError::io("cannot create the catalog directory", &self.dir, e))?;
        self.blobs.open()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blobs(&self) -> &BlobCache {
        &self.blobs
    }

    /// Brings the directory to the state `update` describes.
    ///
    /// Per-tool problems are reported, not fatal: one bad document does not stop the others. A
    /// refused upsert leaves that tool's existing files as they were (even on a full update).
    pub async fn apply(&self, update: &CatalogUpdate, source: &impl BlobSource) -> ApplyReport {
        let mut report = ApplyReport::default();
        let mut keep = BTreeSet::new();
        for doc in &update.upserts {
            if !is_safe_tool_name(&doc.name) {
                report.refused.push(bad_name(&doc.name));
                continue;
            }
            keep.insert(doc.name.clone());
            if let Err(e) = self.upsert(doc, source, &mut report).await {
                report.refused.push(e);
            }
        }
        for name in &update.removals {
            if !is_safe_tool_name(name) {
                report.refused.push(bad_name(name));
                continue;
            }
            if let Err(e) = self.remove(name) {
                report.refused.push(e);
            }
        }
        // A full catalog in several parts is swept by the caller once the last part is in
        // (`sweep_except`): sweeping after the first would delete what the next parts rewrite.
        if update.full && !update.more {
            report.refused.extend(self.sweep_except(&keep));
        }
        for e in &report.refused {
            tracing::error!(error = %e, revision = update.revision, "catalog update partly refused");
        }
        report
    }

    /// Writes one tool: its executable first, so a new `.meta` never pairs with an old executable.
    async fn upsert(
        &self,
        doc: &ToolDocument,
        source: &impl BlobSource,
        report: &mut ApplyReport,
    ) -> Result<(), AgentError> {
        let digest = hex_sha256(&doc.meta);
        if !digest.eq_ignore_ascii_case(&doc.meta_sha256) {
            return Err(AgentError::refused(
                format!("tool `{}`", doc.name),
                format!(
                    "its .meta hashes to {digest}, not the announced {}; nothing was written",
                    doc.meta_sha256
                ),
            ));
        }
        let exe = self.dir.join(&doc.name);
        match &doc.executable {
            Some(blob) => {
                if let Err(e) = self.place_executable(&doc.name, blob, source).await {
                    tracing::error!(
                        tool = %doc.name, error = %e,
                        "cannot get the tool's executable; serving it without one and retrying at the next recheck"
                    );
                    remove_if_exists(&exe)?;
                    report.missing.insert(doc.name.clone(), blob.clone());
                }
            }
            None => remove_if_exists(&exe)?,
        }
        write_atomic(&self.dir, &format!("{}.meta", doc.name), &doc.meta)
    }

    /// Makes `catalog/<name>` the cached blob, fetching it first if needed.
    pub async fn place_executable(
        &self,
        name: &str,
        blob: &BlobRef,
        source: &impl BlobSource,
    ) -> Result<(), AgentError> {
        let cached = self.blobs.ensure(blob, source).await?;
        let dest = self.dir.join(name);
        let tmp = tmp_path(&self.dir, name);
        let linked = std::fs::hard_link(&cached, &tmp).or_else(|_| {
            // Different file systems: copy, and the copy needs its own mode.
            std::fs::copy(&cached, &tmp)?;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        });
        let placed = linked
            .map_err(|e| AgentError::io("cannot link the cached executable to", &tmp, e))
            .and_then(|()| {
                std::fs::rename(&tmp, &dest)
                    .map_err(|e| AgentError::io("cannot move the executable to", &dest, e))
            });
        if placed.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        placed
    }

    fn remove(&self, name: &str) -> Result<(), AgentError> {
        remove_if_exists(&self.dir.join(format!("{name}.meta")))?;
        remove_if_exists(&self.dir.join(name))
    }

    /// Deletes every file that belongs to no tool in `keep` (and temp files a crash left).
    pub fn sweep_except(&self, keep: &BTreeSet<String>) -> Vec<AgentError> {
        let mut failed = Vec::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) => {
                failed.push(AgentError::io(
                    "cannot list the catalog directory",
                    &self.dir,
                    e,
                ));
                return failed;
            }
        };
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let file_name = file_name.to_string_lossy();
            let tool = file_name.strip_suffix(".meta").unwrap_or(&file_name);
            if keep.contains(tool) || keep.contains(file_name.as_ref()) {
                continue;
            }
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                tracing::warn!(path = %path.display(), "unexpected directory in the catalog directory; leaving it");
                continue;
            }
            if let Err(e) = remove_if_exists(&path) {
                failed.push(e);
            }
        }
        failed
    }
}

fn bad_name(name: &str) -> AgentError {
    AgentError::refused(
        format!("tool name {name:?}"),
        "names must match [A-Za-z0-9_.-]+, not be `.` or `..` and not end in `.meta`; fix the tool's file name on the coordinator",
    )
}

fn tmp_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{TMP_PREFIX}{name}-{:016x}", fastrand::u64(..)))
}

fn remove_if_exists(path: &Path) -> Result<(), AgentError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(AgentError::io("cannot remove", path, e))
        }
        _ => Ok(()),
    }
}

/// Writes `dir/name` whole or not at all: temp file, fsync, rename.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), AgentError> {
    use std::io::Write;
    let tmp = tmp_path(dir, name);
    let dest = dir.join(name);
    let written = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()
    })()
    .map_err(|e| AgentError::io("cannot write", &tmp, e))
    .and_then(|()| {
        std::fs::rename(&tmp, &dest).map_err(|e| AgentError::io("cannot move into place", &dest, e))
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_names() {
        let cases = [
            ("disk-usage", true),
            ("a.b_c-1", true),
            ("..x", true),
            ("", false),
            (".", false),
            ("..", false),
            ("../x", false),
            ("a/b", false),
            ("/abs", false),
            ("x.meta", false),
            ("sp ace", false),
            ("ünï", false),
        ];
        for (name, ok) in cases {
            assert_eq!(is_safe_tool_name(name), ok, "{name:?}");
        }
    }
}
