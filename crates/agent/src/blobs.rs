//! The content-addressed executable cache `<state>/blobs/<sha256>`, filled from a blob source.
//!
//! Tools run as the agent's user, so a tool can write to the cache: a cached blob is a claim,
//! checked against its SHA-256 whenever it is taken into use (at agent start, when a catalog
//! update brings or changes a tool that uses it, and before every call that runs it). A blob that
//! does not hash to its name is logged, dropped and fetched again; nothing runs it.
//!
//! Hashing costs about 0.7 ms per MiB with SHA extensions (1.4 GB/s measured; 3 to 4 times as
//! long without): 3 µs for a 4 KiB script, 7 ms for a 10 MiB binary, 47 ms at the 64 MiB
//! limit, where a call's whole overhead is about 0.13 ms. So a file is hashed again only when
//! its identity changed since it last passed: inode, size, mtime and ctime. Any write or
//! `chmod` moves the ctime, which no unprivileged process can set back; a ctime less than
//! [`SETTLE`] old is not trusted (a write within the file system's timestamp granularity would
//! not move it), so a fresh file is hashed on every use until it settles.
//!
//! Blobs are read-only (0555) and the directory is not writable by other users. What remains
//! is a race between the check and the `exec`, which only a tool already running concurrently
//! on the same host could use.

use std::collections::HashMap;
use std::future::Future;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::Channel;
use toolsrv_proto::limits::{MAX_EXECUTABLE_BYTES, MAX_MESSAGE_BYTES};
use toolsrv_proto::v1::agent_link_client::AgentLinkClient;
use toolsrv_proto::v1::{BlobRef, FetchBlobRequest};

use crate::error::AgentError;

/// Mode of a cached blob and of the executables linked from it: readable and runnable, not
/// writable, so that a tool cannot alter one by accident (on purpose, it must `chmod` first,
/// which the verification notices).
pub const BLOB_MODE: u32 = 0o555;
/// How old a file's ctime must be before a check of its content is trusted until it changes.
pub const SETTLE: Duration = Duration::from_secs(2);

/// The chunks of one blob, in order.
pub type BlobStream = Pin<Box<dyn Stream<Item = Result<Vec<u8>, tonic::Status>> + Send>>;

/// Where blobs come from: the coordinator's `FetchBlob`, or a fake in tests.
pub trait BlobSource: Sync {
    /// Starts streaming the blob whose hex SHA-256 is `sha256`.
    fn fetch(&self, sha256: &str)
    -> impl Future<Output = Result<BlobStream, tonic::Status>> + Send;
}

/// `AgentLink.FetchBlob` on the session's channel.
#[derive(Debug, Clone)]
pub struct GrpcBlobs {
    client: AgentLinkClient<Channel>,
}

impl GrpcBlobs {
    pub fn new(channel: Channel) -> Self {
        Self {
            client: AgentLinkClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        }
    }
}

impl BlobSource for GrpcBlobs {
    async fn fetch(&self, sha256: &str) -> Result<BlobStream, tonic::Status> {
        let mut client = self.client.clone();
        let chunks = client
            .fetch_blob(FetchBlobRequest {
                sha256: sha256.to_string(),
            })
            .await?
            .into_inner();
        Ok(Box::pin(chunks.map(|chunk| chunk.map(|c| c.data))))
    }
}

/// The blob cache directory. Clones share what was verified.
#[derive(Debug, Clone)]
pub struct BlobCache {
    dir: PathBuf,
    /// Files whose content passed a check, with their identity then: unchanged, they still pass.
    verified: Arc<Mutex<HashMap<PathBuf, (String, FileStamp)>>>,
}

/// What changes whenever a file's content or mode does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    pub fn of(md: &std::fs::Metadata) -> Self {
        Self {
            dev: md.dev(),
            ino: md.ino(),
            len: md.len(),
            mtime: (md.mtime(), md.mtime_nsec()),
            ctime: (md.ctime(), md.ctime_nsec()),
        }
    }

    /// Same file (device and inode).
    pub fn same_file(&self, other: &FileStamp) -> bool {
        (self.dev, self.ino) == (other.dev, other.ino)
    }

    /// Changed at least [`SETTLE`] before `now`.
    fn settled(&self, now: SystemTime) -> bool {
        let (secs, nanos) = self.ctime;
        let ctime = u64::try_from(secs).ok().and_then(|s| {
            SystemTime::UNIX_EPOCH.checked_add(Duration::new(s, u32::try_from(nanos).ok()?))
        });
        ctime
            .and_then(|c| now.duration_since(c).ok())
            .is_some_and(|age| age >= SETTLE)
    }
}

/// True for a lower-case hex SHA-256, the only names the cache accepts (so a digest can never
/// name a path outside it).
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl BlobCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            verified: Arc::default(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates the directory (not writable by other users) and removes temp files a crash left
    /// behind. Blobs are checked when taken into use, not here (the cache keeps blobs no tool
    /// uses any more, for when one comes back).
    pub fn open(&self) -> Result<(), AgentError> {
        create_private_dir(&self.dir, "cannot create the blob cache")?;
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| AgentError::io("cannot list the blob cache", &self.dir, e))?;
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(".tmp-") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(())
    }

    /// The blob's place in the cache, for a valid digest.
    pub fn path(&self, sha256: &str) -> Option<PathBuf> {
        is_sha256_hex(sha256).then(|| self.dir.join(sha256))
    }

    /// The cached blobs by file identity, to recognize the executables linked from them.
    pub fn by_file(&self) -> Vec<(FileStamp, BlobRef)> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().into_string().ok()?;
                if !is_sha256_hex(&name) {
                    return None;
                }
                let md = std::fs::metadata(entry.path()).ok()?;
                let blob = BlobRef {
                    sha256: name,
                    size: md.len(),
                };
                Some((FileStamp::of(&md), blob))
            })
            .collect()
    }

    /// Whether the file at `path` holds exactly the blob `blob` (hashing it unless it passed
    /// before and has not changed since). A file that is gone or unreadable does not.
    pub fn holds(&self, path: &Path, blob: &BlobRef) -> bool {
        let Ok(md) = std::fs::metadata(path) else {
            return false;
        };
        let stamp = FileStamp::of(&md);
        if md.len() != blob.size || !md.is_file() {
            return false;
        }
        if self.passed_unchanged(path, blob, &stamp) {
            return true;
        }
        let now = SystemTime::now();
        let hashed = toolsrv_registry::hash_file_bounded(path, MAX_EXECUTABLE_BYTES);
        let passed =
            matches!(&hashed, Ok(Some(h)) if h.sha256 == blob.sha256 && h.size == blob.size);
        // Trusted from now on only if the file did not change while it was read.
        let after = std::fs::metadata(path).map(|md| FileStamp::of(&md));
        if passed && after.as_ref().is_ok_and(|a| *a == stamp) && stamp.settled(now) {
            self.lock()
                .insert(path.to_path_buf(), (blob.sha256.clone(), stamp));
        }
        passed
    }

    /// Whether `path`, now `stamp`, passed a check for `blob` and has not changed since.
    fn passed_unchanged(&self, path: &Path, blob: &BlobRef, stamp: &FileStamp) -> bool {
        self.lock()
            .get(path)
            .is_some_and(|(sha, s)| *sha == blob.sha256 && s == stamp)
    }

    /// [`Self::holds`], hashing off the async runtime's threads (a large blob takes a while); a
    /// file unchanged since it passed costs one `stat` here.
    pub async fn holds_async(&self, path: &Path, blob: &BlobRef) -> bool {
        let unchanged = std::fs::metadata(path)
            .is_ok_and(|md| self.passed_unchanged(path, blob, &FileStamp::of(&md)));
        if unchanged {
            return true;
        }
        let (cache, path, blob) = (self.clone(), path.to_path_buf(), blob.clone());
        tokio::task::spawn_blocking(move || cache.holds(&path, &blob))
            .await
            .unwrap_or(false)
    }

    /// Forgets what was verified about `path` (it is being replaced or removed).
    pub fn forget(&self, path: &Path) {
        self.lock().remove(path);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, (String, FileStamp)>> {
        // Entries are inserted and removed whole, so a poisoned map is still consistent.
        self.verified.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops a cached blob that failed its check, so the next [`Self::ensure`] fetches it again.
    pub fn drop_blob(&self, blob: &BlobRef) {
        if let Some(path) = self.path(&blob.sha256) {
            self.forget(&path);
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::error!(blob = %blob.sha256, error = %e, "cannot remove an altered blob from the cache");
            }
        }
    }

    /// The cached blob, checked against its digest, fetched from `source` first unless the cache
    /// holds it intact.
    ///
    /// A fetched blob is written to a temp file while hashed, checked against the digest and
    /// size, made read-only and executable and only then renamed into place: the cache never
    /// holds a partial or wrong blob under a digest's name, except one altered after the fact,
    /// which this check finds, drops and fetches again.
    pub async fn ensure(
        &self,
        blob: &BlobRef,
        source: &impl BlobSource,
    ) -> Result<PathBuf, AgentError> {
        let Some(path) = self.path(&blob.sha256) else {
            return Err(AgentError::refused(
                format!("blob {:?}", blob.sha256),
                "its digest is not a lower-case hex SHA-256; the coordinator sent a bad BlobRef",
            ));
        };
        if std::fs::symlink_metadata(&path).is_ok() {
            if self.holds_async(&path, blob).await {
                return Ok(path);
            }
            tracing::warn!(
                blob = %blob.sha256, path = %path.display(),
                "cached blob does not match its SHA-256 (altered on this host?); dropping it and fetching it again"
            );
            self.drop_blob(blob);
        }
        let tmp = self
            .dir
            .join(format!(".tmp-{}-{:016x}", blob.sha256, fastrand::u64(..)));
        let fetched = self.fetch_to(&tmp, blob, source).await;
        let placed = fetched.and_then(|()| {
            std::fs::rename(&tmp, &path)
                .map_err(|e| AgentError::io("cannot move into the blob cache", &path, e))
        });
        if placed.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        placed.map(|()| path)
    }

    async fn fetch_to(
        &self,
        tmp: &Path,
        blob: &BlobRef,
        source: &impl BlobSource,
    ) -> Result<(), AgentError> {
        let what = || format!("blob {}", blob.sha256);
        let mut chunks = source
            .fetch(&blob.sha256)
            .await
            .map_err(|status| AgentError::Rpc {
                what: "fetching a tool executable",
                status,
            })?;
        let mut file = tokio::fs::File::create(tmp)
            .await
            .map_err(|e| AgentError::io("cannot create", tmp, e))?;
        let mut hasher = Sha256::new();
        let mut size: u64 = 0;
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|status| AgentError::Rpc {
                what: "fetching a tool executable",
                status,
            })?;
            size = size.saturating_add(chunk.len() as u64);
            if size > blob.size {
                return Err(AgentError::refused(
                    what(),
                    format!(
                        "the coordinator sent more than the announced {} bytes",
                        blob.size
                    ),
                ));
            }
            hasher.update(&chunk);
            file.write_all(&chunk)
                .await
                .map_err(|e| AgentError::io("cannot write", tmp, e))?;
        }
        if size != blob.size {
            return Err(AgentError::refused(
                what(),
                format!("got {size} bytes, the coordinator announced {}", blob.size),
            ));
        }
        let digest = hex(&hasher.finalize());
        if digest != blob.sha256 {
            return Err(AgentError::refused(
                what(),
                format!(
                    "its content hashes to {digest}; the download was corrupted or the catalog is inconsistent"
                ),
            ));
        }
        // tokio's file hands each write to a thread and reports its error at the next
        // operation: `flush` waits for the last one and returns its error, which `sync_all`
        // would not (a full disk cut the last write short and the blob was cached truncated).
        file.flush()
            .await
            .map_err(|e| AgentError::io("cannot write", tmp, e))?;
        file.sync_all()
            .await
            .map_err(|e| AgentError::io("cannot sync", tmp, e))?;
        drop(file);
        // What is on disk, not what was sent, goes under the digest's name.
        let written = tokio::fs::metadata(tmp)
            .await
            .map_err(|e| AgentError::io("cannot read back", tmp, e))?;
        if written.len() != blob.size {
            return Err(AgentError::io(
                "cannot write",
                tmp,
                std::io::Error::other(format!(
                    "{} of its {} bytes are on disk",
                    written.len(),
                    blob.size
                )),
            ));
        }
        std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(BLOB_MODE))
            .map_err(|e| AgentError::io("cannot make read-only and executable", tmp, e))
    }
}

/// Creates `dir` if needed and takes write permission on it away from group and others (tools
/// of other users must not replace what the agent runs). Refuses it unless it and every
/// directory above it are this user's or root's, none writable by others but sticky ones
/// ([`toolsrv_tls::files::check_owned_dir`]): a state directory another user made beforehand
/// (`/tmp/state`) would let them swap the catalog for tools of theirs, which the agent runs.
pub(crate) fn create_private_dir(dir: &Path, op: &'static str) -> Result<(), AgentError> {
    toolsrv_tls::files::check_before_creating(dir)
        .map_err(|why| AgentError::refused(format!("the directory {}", dir.display()), why))?;
    std::fs::create_dir_all(dir).map_err(|e| AgentError::io(op, dir, e))?;
    toolsrv_tls::files::check_owned_dir(dir)
        .map_err(|why| AgentError::refused(format!("the directory {}", dir.display()), why))?;
    let md = std::fs::metadata(dir).map_err(|e| AgentError::io(op, dir, e))?;
    let mode = md.permissions().mode();
    if mode & 0o022 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o7755))
            .map_err(|e| AgentError::io("cannot make not writable by others", dir, e))?;
    }
    Ok(())
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
