//! The materialized shipped catalog `<state>/catalog/`: `N.meta` and `N` written atomically from
//! catalog updates.
//!
//! Architecture invariant: nothing is written outside the catalog and blob directories, whatever
//! names the coordinator sends; every file appears whole (temp file + rename) or not at all.
//!
//! Executables are hard links to (or, across file systems, copies of) cached blobs, and the
//! store remembers which blob each tool's executable is: a call checks the file against that
//! digest before it runs it ([`CatalogStore::check_executable`]), and at start-up an executable
//! that is no intact cached blob is removed with its tool until the coordinator ships it again.
//! Files are read-only (`.meta` 0444, executables 0555).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use toolsrv_proto::v1::{BlobRef, CatalogUpdate, ToolDocument};
use toolsrv_registry::hex_sha256;

use crate::blobs::{BLOB_MODE, BlobCache, BlobSource, FileStamp, create_private_dir};
use crate::error::AgentError;

/// Prefix of temp files; the scanner skips dot-files, and a full update sweeps leftovers.
const TMP_PREFIX: &str = ".tmp-";
/// Mode of a materialized `.meta`.
const META_MODE: u32 = 0o444;

/// What applying one update did besides writing files.
#[derive(Debug, Default)]
pub struct ApplyReport {
    /// Tools whose executable could not be fetched: they are served without it for now.
    pub missing: BTreeMap<String, BlobRef>,
    /// Upserts and removals that were refused (bad name, wrong digest, a write that failed),
    /// with the reason.
    pub refused: Vec<AgentError>,
    /// Tools whose new version could not be written (a full disk): their old files are removed
    /// (a tool is served as the catalog says or not at all), and the update is tried again.
    pub unwritten: BTreeMap<String, Unwritten>,
}

/// A tool whose new version could not be written, and why.
#[derive(Debug, Clone)]
pub struct Unwritten {
    pub doc: ToolDocument,
    pub why: String,
}

/// The catalog directory and the blob cache it links executables from. Clones share what they
/// know of the executables placed.
#[derive(Debug, Clone)]
pub struct CatalogStore {
    dir: PathBuf,
    blobs: BlobCache,
    /// The blob each tool's executable in the directory is, by tool name.
    placed: Arc<Mutex<HashMap<String, BlobRef>>>,
}

impl CatalogStore {
    /// A store over `dir`, made absolute like the scanner's directories, so that a call can tell
    /// a shipped executable by its path whatever the agent's `--state-dir` was.
    pub fn new(dir: impl Into<PathBuf>, blobs: BlobCache) -> Self {
        let dir = dir.into();
        Self {
            dir: std::path::absolute(&dir).unwrap_or(dir),
            blobs,
            placed: Arc::default(),
        }
    }

    /// Creates the catalog and blob directories (not writable by other users), and checks the
    /// executables a previous run left: each must be an intact cached blob (hashed now), or it
    /// is removed together with its `.meta`, so nothing altered while the agent was stopped
    /// runs before the coordinator ships the tool again.
    pub fn open(&self) -> Result<(), AgentError> {
        create_private_dir(&self.dir, "cannot create the catalog directory")?;
        self.blobs.open()?;
        self.adopt_executables()
    }

    fn adopt_executables(&self) -> Result<(), AgentError> {
        let blobs = self.blobs.by_file();
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| AgentError::io("cannot list the catalog directory", &self.dir, e))?;
        for entry in entries.flatten() {
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if name.starts_with('.') || name.ends_with(".meta") {
                continue;
            }
            let path = entry.path();
            let Ok(md) = std::fs::metadata(&path) else {
                continue;
            };
            let stamp = FileStamp::of(&md);
            let blob = blobs
                .iter()
                .find(|(s, _)| s.same_file(&stamp))
                .map(|(_, b)| b.clone());
            match blob {
                Some(blob) if self.blobs.holds(&path, &blob) => {
                    if md.permissions().mode() & 0o777 != BLOB_MODE {
                        let _ = std::fs::set_permissions(
                            &path,
                            std::fs::Permissions::from_mode(BLOB_MODE),
                        );
                    }
                    self.placed_map().insert(name, blob);
                }
                Some(blob) => {
                    tracing::warn!(
                        tool = %name, blob = %blob.sha256,
                        "cached blob does not match its SHA-256 (altered while the agent was stopped?); dropping it and the tool until the coordinator ships it again"
                    );
                    self.blobs.drop_blob(&blob);
                    self.remove(&name)?;
                }
                None => {
                    tracing::warn!(
                        tool = %name,
                        "the tool's executable is not a cached blob (replaced, or copied from another file system); removing the tool until the coordinator ships it again"
                    );
                    self.remove(&name)?;
                }
            }
        }
        Ok(())
    }

    fn placed_map(&self) -> std::sync::MutexGuard<'_, HashMap<String, BlobRef>> {
        // Entries are inserted and removed whole, so a poisoned map is still consistent.
        self.placed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The blob tool `name`'s executable is, if it has one from the catalog.
    pub fn placed(&self, name: &str) -> Option<BlobRef> {
        self.placed_map().get(name).cloned()
    }

    /// Checks tool `name`'s executable against the blob it was placed from, right before a call
    /// runs it. One that does not match is logged, dropped and fetched again from `source`; an
    /// error means it could not be restored, and it must not run.
    ///
    /// Tools without a shipped executable (and host-only tools) pass: there is nothing to check.
    pub async fn check_executable(
        &self,
        name: &str,
        source: &impl BlobSource,
    ) -> Result<(), AgentError> {
        let Some(blob) = self.placed(name) else {
            return Ok(());
        };
        let path = self.dir.join(name);
        if self.blobs.holds_async(&path, &blob).await {
            return Ok(());
        }
        tracing::warn!(
            tool = %name, blob = %blob.sha256, path = %path.display(),
            "the tool's executable does not match its blob's SHA-256 (altered on this host?); dropping it and fetching it again"
        );
        self.blobs.forget(&path);
        self.place_executable(name, &blob, source)
            .await
            .map_err(|e| {
                AgentError::refused(
                    format!("tool `{name}`"),
                    format!(
                        "its executable was altered on this host and could not be restored ({e}); it was not run, retry once the coordinator is reachable"
                    ),
                )
            })
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
    /// refused upsert removes that tool's existing files: an agent never serves a version of a
    /// tool the catalog no longer has (a fix, a tightened `args`) under the catalog's new
    /// revision. One refused for a write that failed is in the report's `unwritten`, to retry.
    pub async fn apply(&self, update: &CatalogUpdate, source: &impl BlobSource) -> ApplyReport {
        let mut report = ApplyReport::default();
        let mut keep = BTreeSet::new();
        for doc in &update.upserts {
            if !toolsrv_meta::is_valid_name(&doc.name) {
                report.refused.push(bad_name(&doc.name));
                continue;
            }
            keep.insert(doc.name.clone());
            if let Err(e) = self.upsert(doc, source, &mut report).await {
                if let Err(removal) = self.remove(&doc.name) {
                    report.refused.push(removal);
                }
                if let AgentError::Io { source, .. } = &e {
                    // The error alone: the file it names is a temporary one, named anew at
                    // each try, and the view (which says it) would change at every retry.
                    let why = source.to_string();
                    report.unwritten.insert(
                        doc.name.clone(),
                        Unwritten {
                            doc: doc.clone(),
                            why,
                        },
                    );
                }
                report.refused.push(e);
            }
        }
        for name in &update.removals {
            if !toolsrv_meta::is_valid_name(name) {
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
        let meta = self.dir.join(format!("{}.meta", doc.name));
        // What is on disk already is not written again: a reconnect ships the whole catalog,
        // and on a full disk every write would fail and take the tool off.
        let meta_unchanged = std::fs::metadata(&meta)
            .is_ok_and(|md| md.is_file() && md.len() == doc.meta.len() as u64)
            && std::fs::read(&meta).is_ok_and(|on_disk| on_disk == doc.meta);
        match &doc.executable {
            Some(blob)
                if self.placed(&doc.name).as_ref() == Some(blob)
                    && self.blobs.holds_async(&exe, blob).await => {}
            Some(blob) => {
                if let Err(e) = self.place_executable(&doc.name, blob, source).await {
                    tracing::error!(
                        tool = %doc.name, error = %e,
                        "cannot get the tool's executable; serving it without one and retrying at the next recheck"
                    );
                    self.placed_map().remove(&doc.name);
                    remove_if_exists(&exe)?;
                    report.missing.insert(doc.name.clone(), blob.clone());
                }
            }
            None => {
                self.placed_map().remove(&doc.name);
                remove_if_exists(&exe)?;
            }
        }
        if meta_unchanged {
            return Ok(());
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
        let tmp = tmp_path(&self.dir);
        let linked = std::fs::hard_link(&cached, &tmp).or_else(|_| {
            // Different file systems: copy, and the copy needs its own mode.
            std::fs::copy(&cached, &tmp)?;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(BLOB_MODE))
        });
        let placed = linked
            .map_err(|e| AgentError::io("cannot link the cached executable to", &tmp, e))
            .and_then(|()| {
                self.blobs.forget(&dest);
                std::fs::rename(&tmp, &dest)
                    .map_err(|e| AgentError::io("cannot move the executable to", &dest, e))
            });
        match &placed {
            Ok(()) => {
                self.placed_map().insert(name.to_string(), blob.clone());
            }
            Err(_) => {
                let _ = std::fs::remove_file(&tmp);
            }
        }
        placed
    }

    fn remove(&self, name: &str) -> Result<(), AgentError> {
        self.placed_map().remove(name);
        remove_if_exists(&self.dir.join(format!("{name}.meta")))?;
        let exe = self.dir.join(name);
        self.blobs.forget(&exe);
        remove_if_exists(&exe)
    }

    /// Deletes every file that belongs to no tool in `keep` (and temp files a crash left).
    pub fn sweep_except(&self, keep: &BTreeSet<String>) -> Vec<AgentError> {
        self.placed_map().retain(|name, _| keep.contains(name));
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

/// The refusal of a name outside the rule the registry scan applies too (so a coordinator of
/// this version never sends one): a valid name is also a safe file name in the catalog directory.
fn bad_name(name: &str) -> AgentError {
    let problem = toolsrv_meta::name_problem(name).unwrap_or("it is not a valid tool name");
    AgentError::refused(
        format!("tool name {name:?}"),
        format!(
            "{problem}; {}; fix the tool's file name on the coordinator",
            toolsrv_meta::NAME_RULE
        ),
    )
}

/// A temp file's path in `dir`: short, whatever the tool's name (a name may take 250 of a file
/// name's 255 bytes; the name in the temp file's name made those from 229 bytes up unwritable,
/// and the tool vanished from every agent).
fn tmp_path(dir: &Path) -> PathBuf {
    dir.join(format!("{TMP_PREFIX}{:016x}", fastrand::u64(..)))
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
    let tmp = tmp_path(dir);
    let dest = dir.join(name);
    let written = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        file.set_permissions(std::fs::Permissions::from_mode(META_MODE))
    })()
    // Named by the file it was to become: the temporary name says nothing to a reader.
    .map_err(|e| AgentError::io("cannot write", &dest, e))
    .and_then(|()| {
        std::fs::rename(&tmp, &dest).map_err(|e| AgentError::io("cannot move into place", &dest, e))
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
