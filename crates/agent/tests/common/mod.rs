//! Helpers shared by the agent's integration tests: a fake blob source and tool documents.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

pub mod fake;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use toolsrv_agent::{BlobSource, BlobStream};
use toolsrv_proto::v1::{BlobRef, ToolDocument};
use toolsrv_registry::hex_sha256;

/// Serves blobs from memory and counts fetches; `serve_as` lets a test send wrong bytes.
#[derive(Default)]
pub struct FakeBlobs {
    pub blobs: Mutex<HashMap<String, Vec<u8>>>,
    pub fetches: AtomicUsize,
    /// Bytes per chunk sent; 0 is 7.
    pub chunk: AtomicUsize,
}

impl FakeBlobs {
    pub fn with(contents: &[&[u8]]) -> Self {
        let fake = Self::default();
        for c in contents {
            fake.add(c);
        }
        fake
    }

    pub fn add(&self, content: &[u8]) -> BlobRef {
        let blob = blob_ref(content);
        self.serve_as(&blob.sha256, content);
        blob
    }

    pub fn serve_as(&self, sha256: &str, content: &[u8]) {
        self.blobs
            .lock()
            .unwrap()
            .insert(sha256.to_string(), content.to_vec());
    }

    pub fn remove(&self, sha256: &str) {
        self.blobs.lock().unwrap().remove(sha256);
    }

    /// Sends each blob in chunks of `bytes` (a blob in one chunk is written in one write).
    pub fn in_chunks_of(self, bytes: usize) -> Self {
        self.chunk.store(bytes, Ordering::SeqCst);
        self
    }

    pub fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }
}

impl BlobSource for FakeBlobs {
    async fn fetch(&self, sha256: &str) -> Result<BlobStream, tonic::Status> {
        self.fetches.fetch_add(1, Ordering::SeqCst);
        let content = self
            .blobs
            .lock()
            .unwrap()
            .get(sha256)
            .cloned()
            .ok_or_else(|| tonic::Status::not_found(format!("no blob {sha256}")))?;
        // Several chunks, to exercise the streaming hash.
        let size = match self.chunk.load(Ordering::SeqCst) {
            0 => 7,
            n => n,
        };
        let chunks: Vec<Result<Vec<u8>, tonic::Status>> =
            content.chunks(size).map(|c| Ok(c.to_vec())).collect();
        Ok(Box::pin(tokio_stream::iter(chunks)))
    }
}

pub fn blob_ref(content: &[u8]) -> BlobRef {
    BlobRef {
        sha256: hex_sha256(content),
        size: content.len() as u64,
    }
}

pub fn doc(name: &str, meta: &str, executable: Option<BlobRef>) -> ToolDocument {
    ToolDocument {
        name: name.to_string(),
        meta: meta.as_bytes().to_vec(),
        meta_sha256: hex_sha256(meta.as_bytes()),
        executable,
    }
}

/// A shell script tool executable.
pub fn script(body: &str) -> Vec<u8> {
    format!("#!/bin/sh\n{body}\n").into_bytes()
}

/// The sorted file names in `dir`.
pub fn files(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Overwrites `path` with same-size `content` as a tool running as the agent's user could: made
/// writable, written, the modification time put back.
pub fn tamper(path: &std::path::Path, content: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    let before = std::fs::metadata(path).unwrap();
    assert_eq!(before.len(), content.len() as u64, "same size");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    std::io::Write::write_all(&mut &file, content).unwrap();
    file.set_modified(before.modified().unwrap()).unwrap();
}
