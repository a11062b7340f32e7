//! The content-addressed executable cache `<state>/blobs/<sha256>`, filled from a blob source.

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::Channel;
use toolsrv_proto::v1::agent_link_client::AgentLinkClient;
use toolsrv_proto::v1::{BlobRef, FetchBlobRequest};

use crate::error::AgentError;

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
            client: AgentLinkClient::new(channel),
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

/// The blob cache directory.
#[derive(Debug, Clone)]
pub struct BlobCache {
    dir: PathBuf,
}

/// True for a lower-case hex SHA-256, the only names the cache accepts (so a digest can never
/// name a path outside it).
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl BlobCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates the directory and removes temp files a crash left behind.
    pub fn open(&self) -> Result<(), AgentError> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| AgentError::io("cannot create the blob cache", &self.dir, e))?;
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

    /// The cached blob, fetched from `source` first unless it is already there.
    ///
    /// A fetched blob is written to a temp file while hashed, checked against the digest and
    /// size, made executable and only then renamed into place: the cache never holds a partial
    /// or wrong blob under a digest's name.
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
        if std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == blob.size) {
            return Ok(path);
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
        file.sync_all()
            .await
            .map_err(|e| AgentError::io("cannot sync", tmp, e))?;
        drop(file);
        std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| AgentError::io("cannot make executable", tmp, e))
    }
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
