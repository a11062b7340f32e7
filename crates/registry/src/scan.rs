//! One pass over the tools path: which `.meta` files exist, which parse, which name wins.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use toolsrv_meta::{Code, Diagnostic, Meta, Severity, parse};
use toolsrv_proto::limits::{MAX_EXECUTABLE_BYTES, MAX_META_BYTES};

/// An immutable snapshot of the registry.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    /// Bumped on every effective change; never goes back.
    pub revision: u64,
    /// The tools served, by name.
    pub tools: BTreeMap<String, Tool>,
    /// Every problem found: rejected files, warnings, shadowed tools, unreadable directories.
    pub diagnostics: Vec<Diagnostic>,
    /// Tools whose files are there but rejected, by name: not served, and listed with why.
    pub invalid: BTreeMap<String, Invalid>,
}

/// A tool whose `.meta` (or executable) is rejected: not served until it is fixed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    /// The `.meta` file.
    pub path: PathBuf,
    /// Hex SHA-256 of the bytes read (empty when none could be read), so that a rewrite that
    /// leaves the file broken is told from no change at all.
    pub digest: String,
    /// The errors that reject it, each naming the file and the field.
    pub problems: Vec<Diagnostic>,
}

/// Longest [`Invalid::reason`], so a file with thousands of problems cannot grow a listing.
const MAX_REASON_BYTES: usize = 4096;

impl Invalid {
    /// Why the tool is not served, as listings and refused calls give it:
    /// `invalid: /tools/x.meta: field `description`: expected string, got number`.
    pub fn reason(&self) -> String {
        let mut reason = String::from("invalid: ");
        let mut file: Option<&Path> = None;
        for (i, d) in self.problems.iter().enumerate() {
            let mut text = String::new();
            if i > 0 {
                text.push_str("; ");
            }
            if file != Some(d.file.as_path()) {
                text.push_str(&format!("{}: ", d.file.display()));
                file = Some(&d.file);
            }
            if let Some(field) = &d.field {
                text.push_str(&format!("field `{field}`: "));
            }
            text.push_str(&d.message);
            if i > 0 && reason.len() + text.len() > MAX_REASON_BYTES {
                reason.push_str(&format!(
                    "; and {} more problems (`toolctl lint` lists them all)",
                    self.problems.len() - i
                ));
                break;
            }
            reason.push_str(&text);
        }
        if self.problems.is_empty() {
            reason.push_str(&format!("{}: rejected", self.path.display()));
        }
        reason
    }
}

/// What changed between two catalogs, tool by tool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CatalogChanges {
    /// Served now, not before (new, or repaired).
    pub added: Vec<String>,
    /// Served before and now, with other content.
    pub changed: Vec<String>,
    /// Served before, gone now (and not because they became invalid).
    pub removed: Vec<String>,
    /// Rejected now, and not before or not the same way: name and reason.
    pub invalid: Vec<(String, String)>,
}

impl CatalogChanges {
    /// True when nothing a client would care about changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.changed.is_empty()
            && self.removed.is_empty()
            && self.invalid.is_empty()
    }
}

impl Catalog {
    /// Same tools with the same content (revision and diagnostics aside).
    pub fn same_tools(&self, other: &Catalog) -> bool {
        self.tools.len() == other.tools.len()
            && self
                .tools
                .iter()
                .zip(&other.tools)
                .all(|((a, ta), (b, tb))| a == b && ta.same_content(tb))
    }

    /// Hex SHA-256 of the tools served: each name with the digests of its `.meta` and its
    /// executable, in name order. Catalogs with the same tools have the same digest, whatever
    /// their revision, diagnostics or the directories the files came from.
    pub fn content_digest(&self) -> String {
        let mut hasher = Sha256::new();
        for (name, tool) in &self.tools {
            // Lengths first, so no concatenation of fields reads as another.
            for field in [
                name.as_str(),
                tool.digest.as_str(),
                tool.executable.as_ref().map_or("", |e| e.sha256.as_str()),
            ] {
                hasher.update((field.len() as u64).to_le_bytes());
                hasher.update(field.as_bytes());
            }
        }
        hex(&hasher.finalize())
    }

    /// What changed from `before` to this catalog.
    pub fn changes_since(&self, before: &Catalog) -> CatalogChanges {
        let mut changes = CatalogChanges::default();
        for (name, tool) in &self.tools {
            match before.tools.get(name) {
                None => changes.added.push(name.clone()),
                Some(old) if !old.same_content(tool) => changes.changed.push(name.clone()),
                Some(_) => {}
            }
        }
        changes.removed = before
            .tools
            .keys()
            .filter(|name| !self.tools.contains_key(*name) && !self.invalid.contains_key(*name))
            .cloned()
            .collect();
        changes.invalid = self
            .invalid
            .iter()
            .filter(|(name, invalid)| before.invalid.get(*name) != Some(invalid))
            .map(|(name, invalid)| (name.clone(), invalid.reason()))
            .collect();
        changes
    }

    pub fn has_errors(&self) -> bool {
        self.diagnostics
            .iter()
            .any(|d| d.severity == Severity::Error)
    }
}

/// One served tool.
#[derive(Debug, Clone)]
pub struct Tool {
    pub meta: Arc<Meta>,
    /// Hex SHA-256 of the `.meta` bytes.
    pub digest: String,
    /// The `.meta` document byte for byte, as shipped to agents.
    pub bytes: Arc<[u8]>,
    /// The executable beside the `.meta`, if there is one.
    pub executable: Option<Executable>,
}

impl Tool {
    /// Whether `other` ships the same: the same `.meta` bytes and the same executable.
    pub fn same_content(&self, other: &Tool) -> bool {
        self.digest == other.digest
            && self.executable.as_ref().map(|e| &e.sha256)
                == other.executable.as_ref().map(|e| &e.sha256)
    }
}

/// A co-located executable, content-addressed so it can be shipped and cached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Executable {
    pub path: PathBuf,
    /// Hex SHA-256 of the file's content.
    pub sha256: String,
    pub size: u64,
}

/// Splits a colon-separated tools path, dropping empty entries; the directories' names need
/// not be UTF-8.
pub fn split_tools_path(path: impl AsRef<std::ffi::OsStr>) -> Vec<PathBuf> {
    toolsrv_meta::path_list(path.as_ref())
        .map(Path::to_path_buf)
        .collect()
}

/// Scans a tools path, reusing what it parsed before for files whose bytes did not change.
#[derive(Debug, Default)]
pub struct Scanner {
    dirs: Vec<PathBuf>,
    /// Parse results by `.meta` path, keyed on the bytes' digest.
    metas: HashMap<PathBuf, Cached>,
    /// Executable digests by path, keyed on size and modification time.
    executables: HashMap<PathBuf, (u64, Option<SystemTime>, Hashed)>,
    /// When the earliest file held back by the last scan (see [`Scanner::recheck_at`]) settles.
    recheck: Option<SystemTime>,
    /// The last scan that read the whole tools path, served again by a scan the machine cut short.
    complete: Option<Catalog>,
    /// What cut the current scan short, if anything did (see [`is_shortage`]).
    shortage: Option<String>,
    /// The directories the last complete scan listed. One of them that cannot be listed now
    /// (moved away, unmounted, its permissions changed) does not empty the catalog of its tools.
    listed: HashSet<PathBuf>,
    /// A directory of [`Scanner::listed`] the current scan could not list, and why.
    unlisted: Option<String>,
}

/// How soon a scan cut short by the machine (see [`is_shortage`]) is tried again.
pub const SHORTAGE_RETRY: Duration = Duration::from_secs(1);

/// Whether `error` says the machine ran short (of file descriptors, memory, kernel buffers)
/// rather than anything about the file: no reason to stop serving a tool. An agent whose
/// descriptors a flood of connections took read an empty tools directory this way, and
/// reported that its host had no tools.
pub fn is_shortage(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(
            libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOBUFS | libc::EAGAIN | libc::EINTR
        )
    )
}

#[derive(Debug)]
struct Cached {
    /// File identity when it was read, if it is safe to trust for skipping the next read.
    stamp: Option<Stamp>,
    digest: String,
    bytes: Arc<[u8]>,
    meta: Option<Arc<Meta>>,
    diagnostics: Vec<Diagnostic>,
}

impl Scanner {
    /// A scanner over `dirs`, made absolute so that tools see an absolute `OLLIE_TOOLS_PATH`.
    pub fn new(dirs: Vec<PathBuf>) -> Self {
        let dirs = dirs
            .into_iter()
            .map(|d| std::path::absolute(&d).unwrap_or(d))
            .collect();
        Self {
            dirs,
            ..Self::default()
        }
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// When a file held back by the last scan settles, so that the caller scans again then:
    /// a `.meta` that no longer parses but was modified under [`SETTLE_AGE`] ago, while its
    /// previous version parsed, is taken as a write in progress (truncated, not yet rewritten)
    /// and the previous version stays served until the file settles.
    pub fn recheck_at(&self) -> Option<SystemTime> {
        self.recheck
    }

    /// Reads every directory of the tools path. The result has revision 0; the caller numbers it.
    ///
    /// A scan the machine cuts short (a directory or file that cannot be opened for want of
    /// descriptors or memory, see [`is_shortage`]) returns the last complete scan's tools with a
    /// warning saying so, and asks through [`Scanner::recheck_at`] to be run again in
    /// [`SHORTAGE_RETRY`]: a host out of descriptors keeps its tools, not an empty catalog.
    pub fn scan(&mut self) -> Catalog {
        self.recheck = None;
        self.shortage = None;
        self.unlisted = None;
        let mut listed = HashSet::with_capacity(self.dirs.len());
        let mut catalog = Catalog::default();
        let mut seen_metas = HashSet::with_capacity(self.metas.len());
        let mut seen_exes = HashSet::new();
        let mut claimed: HashMap<String, PathBuf> = HashMap::new();
        let mut exposure = Exposure::default();
        for dir in self.dirs.clone() {
            if self.shortage.is_some() {
                break;
            }
            let files = match list_meta_files(&dir) {
                Ok(files) => {
                    listed.insert(dir.clone());
                    files
                }
                Err(e) if is_shortage(&e) => {
                    self.shortage = Some(format!(
                        "cannot read tools directory {}: {e}",
                        dir.display()
                    ));
                    break;
                }
                Err(e) if self.listed.contains(&dir) => {
                    // Read by the last complete scan: most likely moved or unmounted for a
                    // moment, not meant to take every tool it holds off the fleet.
                    self.unlisted.get_or_insert_with(|| {
                        format!("cannot read tools directory {}: {e}", dir.display())
                    });
                    continue;
                }
                Err(e) => {
                    let message = format!("cannot read tools directory: {e}");
                    catalog
                        .diagnostics
                        .push(Diagnostic::warning(&dir, None, Code::Io, message));
                    continue;
                }
            };
            for (name, path) in files {
                if let Some(winner) = claimed.get(&name) {
                    let message = format!(
                        "tool `{name}` is shadowed by {}, which comes first on the tools path",
                        winner.display()
                    );
                    catalog.diagnostics.push(Diagnostic::warning(
                        &path,
                        None,
                        Code::Shadowed,
                        message,
                    ));
                    continue;
                }
                claimed.insert(name.clone(), path.clone());
                let Some(cached) = self.load(&name, &path) else {
                    if self.shortage.is_some() {
                        break;
                    }
                    continue;
                };
                catalog
                    .diagnostics
                    .extend(cached.diagnostics.iter().cloned());
                let (meta, digest, bytes) = (
                    cached.meta.clone(),
                    cached.digest.clone(),
                    cached.bytes.clone(),
                );
                let errors: Vec<Diagnostic> = cached
                    .diagnostics
                    .iter()
                    .filter(|d| d.severity == Severity::Error)
                    .cloned()
                    .collect();
                let invalid = |problems: Vec<Diagnostic>| Invalid {
                    path: path.clone(),
                    digest: digest.clone(),
                    problems,
                };
                let Some(meta) = meta else {
                    catalog.invalid.insert(name, invalid(errors));
                    seen_metas.insert(path);
                    continue;
                };
                let executable = self.executable(&dir.join(&name)).and_then(|executable| {
                    // Anyone who can rewrite the .meta or the executable chooses what runs.
                    let exposed = std::iter::once(path.as_path())
                        .chain(executable.as_ref().map(|e| e.path.as_path()))
                        .find_map(|file| Some((file, exposure.of(file)?)));
                    match exposed {
                        Some((file, reason)) => {
                            Err(Diagnostic::error(file, None, Code::Exposed, reason))
                        }
                        None => Ok(executable),
                    }
                });
                if self.shortage.is_some() {
                    break;
                }
                let executable = match executable {
                    Ok(executable) => executable,
                    Err(diag) => {
                        // Exposed, not served; served without its executable, the tool
                        // would silently run something else (its `cmd`, or a binary on PATH):
                        // not served at all.
                        catalog.diagnostics.push(diag.clone());
                        catalog.invalid.insert(name, invalid(vec![diag]));
                        seen_metas.insert(path);
                        continue;
                    }
                };
                seen_metas.insert(path);
                {
                    if let Some(exe) = &executable {
                        seen_exes.insert(exe.path.clone());
                    }
                    catalog.tools.insert(
                        name,
                        Tool {
                            meta,
                            digest,
                            bytes,
                            executable,
                        },
                    );
                }
            }
        }
        if let Some(why) = self.shortage.take() {
            return self.cut_short(catalog, why);
        }
        if let Some(why) = self.unlisted.take() {
            let message = format!(
                "{why}: the tools of the last complete scan are served until it can be read \
                 again (tried every {}s); to take every tool of a directory off, empty it rather \
                 than remove it",
                SHORTAGE_RETRY.as_secs()
            );
            return self.kept(catalog, message);
        }
        self.listed = listed;
        self.metas.retain(|p, _| seen_metas.contains(p));
        self.executables.retain(|p, _| seen_exes.contains(p));
        self.complete = Some(catalog.clone());
        catalog
    }

    /// The result of a scan the machine cut short: the last complete scan (the first scan has
    /// none: what it read), with a warning naming what could not be read, and a recheck soon.
    /// What it did read is kept in the caches for the next scan; nothing is forgotten.
    fn cut_short(&mut self, partial: Catalog, why: String) -> Catalog {
        let message = format!(
            "{why}: the machine is short of file descriptors or memory, so the tools of the last \
             complete scan are served until a scan completes (tried again every {}s)",
            SHORTAGE_RETRY.as_secs()
        );
        self.kept(partial, message)
    }

    /// The last complete scan (the first scan has none: `partial`, what it read) with the
    /// warning `message`, and a recheck in [`SHORTAGE_RETRY`].
    fn kept(&mut self, partial: Catalog, message: String) -> Catalog {
        let at = SystemTime::now() + SHORTAGE_RETRY;
        self.recheck = Some(self.recheck.map_or(at, |r| r.min(at)));
        let mut kept = self.complete.clone().unwrap_or(partial);
        let dir = self.dirs.first().cloned().unwrap_or_default();
        kept.diagnostics
            .push(Diagnostic::warning(&dir, None, Code::Io, message));
        kept
    }

    /// Reads and parses one file unless its bytes are unchanged since the last scan.
    fn load(&mut self, name: &str, path: &Path) -> Option<&Cached> {
        let stamp = Stamp::of(path);
        if stamp.is_some() && self.metas.get(path).is_some_and(|c| c.stamp == stamp) {
            return self.metas.get(path);
        }
        let bytes = match read_meta(path) {
            Ok(bytes) => bytes,
            Err(ReadError::Gone) => return None,
            Err(ReadError::Short(e)) => {
                self.shortage = Some(format!("cannot read {}: {e}", path.display()));
                return None;
            }
            Err(ReadError::Rejected(diag)) => {
                // A file rejected for its size keeps being rejected while its stamp holds (a
                // rewrite changes size or mtime); one that could not be read is tried again.
                let stamp = stamp.filter(|_| diag.code == Code::TooLarge);
                let cached = Cached {
                    stamp,
                    digest: String::new(),
                    bytes: Arc::from([]),
                    meta: None,
                    diagnostics: vec![*diag],
                };
                self.metas.insert(path.to_path_buf(), cached);
                return self.metas.get(path);
            }
        };
        let digest = hex_sha256(&bytes);
        // Trust the stamp next time only if the file was not modified just now: a write within
        // the file system's timestamp granularity could otherwise go unnoticed (git's "racy" rule).
        let settles_at = stamp.and_then(|s| s.settles_at());
        let stamp = stamp.filter(Stamp::settled);
        if let Some(cached) = self.metas.get_mut(path).filter(|c| c.digest == digest) {
            cached.stamp = stamp;
        } else {
            let parsed = parse(name, path, &bytes);
            if parsed.meta.is_none()
                && let Some(until) = settles_at
                && let Some(previous) = self.metas.get_mut(path).filter(|c| c.meta.is_some())
            {
                // Most likely caught between the truncation and the write of an in-place
                // rewrite (`>` in a shell, most editors' "save"): keep serving the previous
                // version, read the file again next time, and ask for a scan once it settles.
                previous.stamp = None;
                self.recheck = Some(self.recheck.map_or(until, |r| r.min(until)));
                tracing::debug!(file = ?path, "a .meta being written does not parse yet: its previous version stays until it settles");
                return self.metas.get(path);
            }
            let cached = Cached {
                stamp,
                digest,
                bytes: Arc::from(bytes),
                meta: parsed.meta.map(Arc::new),
                diagnostics: parsed.diagnostics,
            };
            self.metas.insert(path.to_path_buf(), cached);
        }
        self.metas.get(path)
    }

    /// The executable beside a `.meta` (`Ok(None)`: there is none, or it cannot be read), hashing
    /// it only when its size or mtime changed; an error diagnostic when it is larger than
    /// [`MAX_EXECUTABLE_BYTES`].
    fn executable(&mut self, path: &Path) -> Result<Option<Executable>, Diagnostic> {
        use std::os::unix::fs::PermissionsExt;
        let Ok(md) = std::fs::metadata(path) else {
            return Ok(None);
        };
        if !md.is_file() || md.permissions().mode() & 0o111 == 0 {
            return Ok(None);
        }
        let (size, mtime) = (md.len(), md.modified().ok());
        if size > MAX_EXECUTABLE_BYTES {
            return Err(executable_too_large(path, size));
        }
        let hashed = match self.executables.get(path) {
            Some((s, m, hashed)) if *s == size && *m == mtime && mtime.is_some() => hashed.clone(),
            _ => {
                let hashed = match hash_file_bounded(path, MAX_EXECUTABLE_BYTES) {
                    Ok(Some(hashed)) => hashed,
                    Ok(None) => return Err(executable_too_large(path, MAX_EXECUTABLE_BYTES + 1)),
                    Err(e) if is_shortage(&e) => {
                        self.shortage = Some(format!("cannot read {}: {e}", path.display()));
                        return Ok(None);
                    }
                    // Removed between the two looks, or unreadable (as before: not shipped,
                    // while `toolctl local` may still run it).
                    Err(_) => return Ok(None),
                };
                self.executables
                    .insert(path.to_path_buf(), (size, mtime, hashed.clone()));
                hashed
            }
        };
        Ok(Some(Executable {
            path: path.to_path_buf(),
            sha256: hashed.sha256,
            // What was hashed, not what the metadata said: the digest and size shipped to
            // agents describe the same bytes even if the file changed in between.
            size: hashed.size,
        }))
    }
}

fn executable_too_large(path: &Path, size: u64) -> Diagnostic {
    let message = format!(
        "the tool's executable is {size} bytes, above the limit of {MAX_EXECUTABLE_BYTES} bytes \
         (64 MiB); the tool is not served: make the executable smaller (strip it, or install it \
         on the hosts and call it from `cmd`)"
    );
    Diagnostic::error(path, None, Code::TooLarge, message)
}

/// Whether a tool's files could be rewritten by any user of the machine ([`writable_by_anyone`]),
/// with the directories looked at once per scan.
#[derive(Debug, Default)]
struct Exposure {
    dirs: HashMap<PathBuf, DirAccess>,
}

impl Exposure {
    /// Why `file` is exposed, if it is, as the error that rejects its tool.
    fn of(&mut self, file: &Path) -> Option<String> {
        let open = writable_by_anyone_with(file, |dir| {
            self.dirs
                .entry(dir.to_path_buf())
                .or_insert_with(|| dir_access(dir))
                .clone()
        })?;
        Some(open.explained("anyone here could change what the tool runs, so it is not served"))
    }
}

/// A file, or a directory holding it, that every user of the machine may write; or a file (or
/// directory on the way to it) that any of them could have put where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenToAll {
    /// The file or directory at fault.
    pub path: PathBuf,
    /// What makes it so.
    pub how: Open,
}

/// What lets any user of the machine change a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Open {
    /// The file is writable by every user (its permission bits): `chmod o-w` it.
    File { mode: u32 },
    /// The directory holding it is writable by every user without the sticky bit (its
    /// permission bits): `chmod o-w` it.
    Directory { mode: u32 },
    /// It is another user's (`owner`), in `dir`, a directory every user may write with the
    /// sticky bit (as `/tmp`; `mode` is that directory's): anyone could have put it there, and
    /// it is theirs to change.
    Planted { owner: u32, dir: PathBuf, mode: u32 },
    /// Who could change it cannot be told: an entry on the way to it cannot be looked at (a
    /// path longer than the system takes, too many links, no permission). Why.
    Unchecked(String),
}

impl OpenToAll {
    /// What is open, `why` that matters, and what closes it.
    pub fn explained(&self, why: &str) -> String {
        match self.how {
            Open::Unchecked(_) => format!("{self}: {why}"),
            Open::Planted { .. } => format!(
                "{self}: {why}: remove it, or chown it to root or this process's user (uid {})",
                nix::unistd::geteuid()
            ),
            Open::File { .. } | Open::Directory { .. } => {
                format!("{self}: {why}: chmod o-w {}", self.path.display())
            }
        }
    }
}

impl std::fmt::Display for OpenToAll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = self.path.display();
        match &self.how {
            Open::Unchecked(why) => write!(f, "who could change {path} cannot be told ({why})"),
            Open::Planted { owner, dir, mode } => write!(
                f,
                "{path} is owned by uid {owner}, in the directory {}, which every user of this \
                 machine may write (mode {mode:04o}): any of them could have put it there",
                dir.display(),
            ),
            Open::Directory { mode } => write!(
                f,
                "in the directory {path}, which every user of this machine may write (mode \
                 {mode:04o}, no sticky bit)"
            ),
            Open::File { mode } => write!(
                f,
                "writable by every user of this machine (mode {mode:04o})"
            ),
        }
    }
}

/// What a directory on the way to a file lets every user of the machine do.
#[derive(Debug, Clone)]
enum DirAccess {
    /// Nothing: only its owner (and those of its group) may write it, or it is read-only.
    Closed,
    /// Replace anything in it: writable by all, no sticky bit.
    Open(OpenToAll),
    /// Add entries of their own (writable by all, sticky, as `/tmp`): the directory's owner
    /// and mode.
    Sticky { owner: u32, mode: u32 },
}

/// Whether any user of this machine could rewrite `file`: it is writable by every user, or a
/// directory holding it (as named, or after symbolic links) is, without the sticky bit. A
/// directory with the sticky bit (as `/tmp`) lets nobody replace another's file, but lets
/// anyone add one: what is in it on the way to `file` (`file` itself, or a directory) counts
/// only when root, this process's user or the directory's owner owns it. Nothing on a file
/// system mounted read-only (a Kubernetes ConfigMap, whose directories are mode 0777) can be
/// written: it never counts. `None` also when `file` cannot be looked at; a device's own
/// mode does not count.
pub fn writable_by_anyone(file: &Path) -> Option<OpenToAll> {
    writable_by_anyone_with(file, dir_access)
}

fn writable_by_anyone_with(
    file: &Path,
    mut access: impl FnMut(&Path) -> DirAccess,
) -> Option<OpenToAll> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(file).ok()?;
    let mode = md.mode();
    // Devices (`/dev/null` is mode 0666) are not files anyone rewrites.
    if md.is_file() && mode & 0o002 != 0 && !read_only(file) {
        return Some(OpenToAll {
            path: file.to_path_buf(),
            how: Open::File {
                mode: mode & 0o7777,
            },
        });
    }
    // Every entry on the way, as the kernel resolves it, links wherever they are met: each in a
    // directory every user may write without the sticky bit counts, and one in a sticky one
    // counts when another user owns it.
    let me = nix::unistd::geteuid().as_raw();
    let mut found = None;
    let walked = toolsrv_tls::files::walk(file, |step| {
        let Some((dir, _)) = step.parent else {
            return Ok(());
        };
        match access(dir) {
            DirAccess::Closed => Ok(()),
            DirAccess::Open(open) => {
                found = Some(open);
                Err(String::new())
            }
            DirAccess::Sticky { owner, mode } => {
                let theirs = step.md.uid();
                if theirs == 0 || theirs == me || theirs == owner {
                    return Ok(());
                }
                found = Some(OpenToAll {
                    path: step.path.to_path_buf(),
                    how: Open::Planted {
                        owner: theirs,
                        dir: dir.to_path_buf(),
                        mode,
                    },
                });
                Err(String::new())
            }
        }
    });
    match walked {
        Ok(_) => None,
        Err(toolsrv_tls::files::WalkError::Refused(_)) => found,
        // Gone meanwhile: whoever reads it next says so.
        Err(toolsrv_tls::files::WalkError::Io { error, .. })
            if error.kind() == std::io::ErrorKind::NotFound =>
        {
            None
        }
        // What cannot be looked at is not trusted (a link to a path longer than the system
        // takes hid a planted file).
        Err(e) => Some(OpenToAll {
            path: file.to_path_buf(),
            how: Open::Unchecked(e.to_string()),
        }),
    }
}

/// What every user may do in `dir`.
fn dir_access(dir: &Path) -> DirAccess {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::metadata(dir) else {
        return DirAccess::Closed;
    };
    let mode = md.mode();
    if mode & 0o002 == 0 || read_only(dir) {
        return DirAccess::Closed;
    }
    if mode & 0o1000 != 0 {
        return DirAccess::Sticky {
            owner: md.uid(),
            mode: mode & 0o7777,
        };
    }
    DirAccess::Open(OpenToAll {
        path: dir.to_path_buf(),
        how: Open::Directory {
            mode: mode & 0o7777,
        },
    })
}

/// Whether `path` is on a file system mounted read-only.
fn read_only(path: &Path) -> bool {
    use nix::sys::statvfs::{FsFlags, statvfs};
    statvfs(path).is_ok_and(|s| s.flags().contains(FsFlags::ST_RDONLY))
}

/// Why [`read_meta`] returned no bytes.
#[derive(Debug)]
pub enum ReadError {
    /// The file does not exist (any more).
    Gone,
    /// The machine is short of descriptors or memory ([`is_shortage`]): nothing is known of
    /// the file; try again.
    Short(std::io::Error),
    /// The file is too large or unreadable: the diagnostic that rejects it.
    Rejected(Box<Diagnostic>),
}

/// Reads a `.meta` file, refusing one larger than [`MAX_META_BYTES`] (checked before reading,
/// and again while reading, since the file may grow in between).
///
/// The registry scan and `toolctl lint` both read through here, so they reject the same files.
pub fn read_meta(path: &Path) -> Result<Vec<u8>, ReadError> {
    let rejected = |code, message: String| {
        ReadError::Rejected(Box::new(Diagnostic::error(path, None, code, message)))
    };
    let unreadable = |e: std::io::Error| {
        // A link whose target is missing is a broken tool, not a file deleted meanwhile.
        let dangling = || {
            std::fs::symlink_metadata(path)
                .is_ok_and(|m| m.file_type().is_symlink())
                .then(|| std::fs::read_link(path).ok())
                .flatten()
        };
        if e.kind() == std::io::ErrorKind::NotFound {
            match dangling() {
                Some(target) => rejected(
                    Code::Io,
                    format!(
                        "cannot read: a link to {}, which does not exist",
                        target.display()
                    ),
                ),
                None => ReadError::Gone,
            }
        } else if is_shortage(&e) {
            ReadError::Short(e)
        } else {
            rejected(Code::Io, format!("cannot read: {e}"))
        }
    };
    let file = open_regular(path).map_err(unreadable)?;
    let announced = file.metadata().map_err(unreadable)?.len();
    read_meta_from(path, file, announced)
}

/// The bytes of `.meta` `path` from `file`, whose metadata announced `announced` bytes: at most
/// [`MAX_META_BYTES`], whatever it announced.
fn read_meta_from(
    path: &Path,
    file: impl std::io::Read,
    announced: u64,
) -> Result<Vec<u8>, ReadError> {
    use std::io::Read;
    let rejected = |code, message: String| {
        ReadError::Rejected(Box::new(Diagnostic::error(path, None, code, message)))
    };
    let unreadable = |e: std::io::Error| {
        if is_shortage(&e) {
            ReadError::Short(e)
        } else {
            rejected(Code::Io, format!("cannot read: {e}"))
        }
    };
    if announced > MAX_META_BYTES {
        return Err(rejected(Code::TooLarge, meta_too_large(announced)));
    }
    // One byte more than the limit tells a file that grew past it from one that is exactly at it.
    let mut bytes = Vec::with_capacity(usize::try_from(announced).unwrap_or(0));
    file.take(MAX_META_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(unreadable)?;
    if bytes.len() as u64 > MAX_META_BYTES {
        return Err(rejected(Code::TooLarge, meta_too_large(bytes.len() as u64)));
    }
    Ok(bytes)
}

fn meta_too_large(size: u64) -> String {
    let at_least = if size > MAX_META_BYTES + 1 {
        ""
    } else {
        "at least "
    };
    format!(
        "the file is {at_least}{size} bytes, above the limit of {MAX_META_BYTES} bytes (256 KiB) \
         for a .meta; the tool is not served: shorten it (a long `prompt` belongs in a file the \
         tool reads)"
    )
}

/// How long after its last modification a file counts as still being written: beyond the
/// timestamp granularity of common file systems (1 to 2 s), and far beyond any single save.
pub const SETTLE_AGE: Duration = Duration::from_secs(2);

/// What identifies a file's content cheaply: inode, size and modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    len: u64,
    mtime: SystemTime,
}

impl Stamp {
    fn of(path: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(path).ok()?;
        Some(Self {
            ino: md.ino(),
            len: md.len(),
            mtime: md.modified().ok()?,
        })
    }

    /// Modified long enough ago that a same-size rewrite would have moved the mtime.
    fn settled(&self) -> bool {
        self.mtime.elapsed().is_ok_and(|age| age > SETTLE_AGE)
    }

    /// When the file settles, if it was modified at most [`SETTLE_AGE`] ago (`None` when it is
    /// older, or dated in the future: no wait would settle it).
    fn settles_at(&self) -> Option<SystemTime> {
        let age = SystemTime::now().duration_since(self.mtime).ok()?;
        (age <= SETTLE_AGE).then(|| self.mtime + SETTLE_AGE)
    }
}

/// `(name, path)` of the `.meta` files in `dir`, sorted by name; dot-files are skipped.
///
/// A name that is not UTF-8 is kept under its lossy form, and a FIFO, socket or device named
/// `x.meta` is kept too, as is a link that leads nowhere (dangling, a loop, no permission):
/// reading them reports them ([`read_meta`]), where skipping them would leave a tool missing
/// without a word.
fn list_meta_files(dir: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        // An invalid name is kept: parsing reports it, like any other broken `.meta`.
        let Some(name) = toolsrv_meta::tool_name_of(&file_name) else {
            continue;
        };
        // Follow symlinks: a linked .meta is a tool, a directory named x.meta is not.
        if !std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir()) {
            out.push((name.to_string(), entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Hex SHA-256 of `bytes`.
pub fn hex_sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Opens `path` for reading if it is a regular file (after symbolic links), and refuses
/// anything else without blocking: a FIFO put where a `.meta` or an executable was (between a
/// look at its type and the open) would otherwise hang the reader until someone writes to it.
pub fn open_regular(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    let what = if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else {
        "not a file"
    };
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{what}, not a regular file"),
    ))
}

/// Hex SHA-256 of a file's content, streamed.
pub fn hash_file(path: &Path) -> std::io::Result<String> {
    let mut file = open_regular(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(hex(&hasher.finalize()))
}

/// A file's digest and the number of bytes it was computed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hashed {
    /// Hex SHA-256.
    pub sha256: String,
    pub size: u64,
}

/// [`hash_file`] reading at most `limit` bytes: `None` when the file is larger.
pub fn hash_file_bounded(path: &Path, limit: u64) -> std::io::Result<Option<Hashed>> {
    use std::io::Read;
    let file = open_regular(path)?;
    let mut hasher = Sha256::new();
    let size = std::io::copy(&mut file.take(limit.saturating_add(1)), &mut hasher)?;
    if size > limit {
        return Ok(None);
    }
    Ok(Some(Hashed {
        sha256: hex(&hasher.finalize()),
        size,
    }))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_meta_is_read_up_to_the_limit_whatever_its_metadata_announced() {
        let path = Path::new("grows.meta");
        // Announced empty, endless in fact (a file that grew after the look at its size).
        match read_meta_from(path, std::io::repeat(b' '), 0) {
            Err(ReadError::Rejected(d)) => {
                assert_eq!(d.code, Code::TooLarge);
                assert!(
                    d.message
                        .contains(&format!("at least {} bytes", MAX_META_BYTES + 1)),
                    "{d}"
                );
            }
            other => panic!("expected a rejection, got {other:?}"),
        }
        // Announced too large: refused before reading.
        match read_meta_from(path, std::io::empty(), MAX_META_BYTES + 10) {
            Err(ReadError::Rejected(d)) => assert!(
                d.message
                    .contains(&format!("is {} bytes", MAX_META_BYTES + 10)),
                "{d}"
            ),
            other => panic!("expected a rejection, got {other:?}"),
        }
        let exact = vec![b' '; MAX_META_BYTES as usize];
        let read = read_meta_from(path, &exact[..], 0).unwrap_or_default();
        assert_eq!(read.len(), exact.len());
    }
}
