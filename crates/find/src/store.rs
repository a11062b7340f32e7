//! Text vectors kept on disk between runs, so that a restarted coordinator (or the next
//! `toolctl local find`) embeds only texts it has never seen instead of the whole catalog
//! again: 22 s of CPU for 1,000 tools with all-MiniLM-L6-v2, over two minutes with
//! all-mpnet-base-v2 (BENCHMARKS.md "find").
//!
//! One file per model, named by the encoder's [fingerprint](Encoder::fingerprint), in a
//! directory only its owner may write. The file is a cache: whatever is wrong with it (another
//! model's, truncated, edited, a vector that is not unit length, a mode that lets others write
//! it, a symbolic link) makes the reader ignore it with a reason, and the next write replaces
//! it. A reader never trusts a vector it did not check: vectors steer the ranking, and a file
//! another local user could write would let them choose which tool a model is offered.
//!
//! Layout, little-endian: the magic `toolsrv-vectors\n`, a format number (u32), the vectors'
//! length (u32), their count (u64), the encoder's fingerprint (32 bytes); then per vector the
//! SHA-256 of its text (32 bytes) and its values (f32); last, the SHA-256 of all that precedes.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::FindError;
use crate::encoder::Encoder;

/// The SHA-256 of a text, which a vector is filed under.
pub(crate) type TextHash = [u8; 32];

/// Vectors by the hash of their text.
pub(crate) type Vectors = HashMap<TextHash, Arc<[f32]>>;

const MAGIC: &[u8; 16] = b"toolsrv-vectors\n";
const FORMAT: u32 = 1;
const HEADER_BYTES: usize = 16 + 4 + 4 + 8 + 32;
const CHECKSUM_BYTES: usize = 32;
/// Largest file read: far above a catalog's (1,000 tools of all-mpnet-base-v2: 13 MB), low
/// enough that a planted file cannot make a reader allocate without bound.
const MAX_FILE_BYTES: u64 = 1 << 30;
/// How far from unit length a vector may be (the encoder's are unit length to about 1e-6).
const NORM_SLACK: f32 = 1e-3;

/// Where one encoder's vectors are kept.
#[derive(Debug, Clone)]
pub struct VectorStore {
    path: PathBuf,
    fingerprint: [u8; 32],
    dims: usize,
}

impl VectorStore {
    /// The store of `encoder`'s vectors in `dir`, which is made (owner-only) when it does not
    /// exist. Refused when `dir` is not a directory, or is owned by another user or writable by
    /// group or others: whoever can write there chooses the vectors.
    pub fn open(dir: &Path, encoder: &Encoder) -> Result<VectorStore, FindError> {
        let refused = |reason: String| FindError::Store {
            path: dir.to_path_buf(),
            reason,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| refused(format!("cannot create it: {e}")))?;
        let meta = std::fs::metadata(dir).map_err(|e| refused(e.to_string()))?;
        if !meta.is_dir() {
            return Err(refused("not a directory".into()));
        }
        private(&meta).map_err(refused)?;
        let fingerprint = encoder.fingerprint();
        let name: String = fingerprint[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(VectorStore {
            path: dir.join(format!("{name}.vectors")),
            fingerprint,
            dims: encoder.dims(),
        })
    }

    /// The file the vectors are kept in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The vectors the file holds; none when it does not exist yet.
    pub(crate) fn read(&self) -> Result<Vectors, FindError> {
        let refused = |reason: String| FindError::Store {
            path: self.path.clone(),
            reason,
        };
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&self.path)
        {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vectors::new()),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(refused("a symbolic link; not followed".into()));
            }
            Err(e) => return Err(refused(format!("cannot open it: {e}"))),
        };
        let meta = file.metadata().map_err(|e| refused(e.to_string()))?;
        if !meta.is_file() {
            return Err(refused("not a regular file".into()));
        }
        private(&meta).map_err(refused)?;
        if meta.len() > MAX_FILE_BYTES {
            return Err(refused(format!(
                "{} bytes, over the {MAX_FILE_BYTES} read",
                meta.len()
            )));
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        file.take(MAX_FILE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| refused(format!("cannot read it: {e}")))?;
        self.decode(&bytes).map_err(refused)
    }

    /// What [`read`](Self::read) makes of `bytes` as the file of an encoder with this
    /// `fingerprint` and vectors of `dims` values: how many vectors it takes, or why it takes
    /// none. For the fuzz target (`fuzz/fuzz_targets/vector_store.rs`), which needs no model.
    #[doc(hidden)]
    pub fn check_file(bytes: &[u8], fingerprint: [u8; 32], dims: usize) -> Result<usize, String> {
        let store = VectorStore {
            path: PathBuf::new(),
            fingerprint,
            dims,
        };
        store.decode(bytes).map(|v| v.len())
    }

    fn decode(&self, bytes: &[u8]) -> Result<Vectors, String> {
        if bytes.len() < HEADER_BYTES + CHECKSUM_BYTES {
            return Err(format!("{} bytes, shorter than a header", bytes.len()));
        }
        let (body, checksum) = bytes.split_at(bytes.len() - CHECKSUM_BYTES);
        if !body.starts_with(MAGIC) {
            return Err("not a vector store (no toolsrv-vectors header)".into());
        }
        let mut at = MAGIC.len();
        let mut take = |n: usize| {
            let field = &body[at..at + n];
            at += n;
            field
        };
        let format = u32::from_le_bytes(array(take(4)));
        let dims = u32::from_le_bytes(array(take(4))) as usize;
        let count = u64::from_le_bytes(array(take(8)));
        let fingerprint: [u8; 32] = array(take(32));
        if format != FORMAT {
            return Err(format!("format {format}; this build reads format {FORMAT}"));
        }
        if fingerprint != self.fingerprint {
            return Err("written for another model, or another build of the encoder".into());
        }
        if dims != self.dims {
            return Err(format!(
                "vectors of {dims} values; the model's have {}",
                self.dims
            ));
        }
        let entry = 32 + 4 * dims;
        let expected = usize::try_from(count)
            .ok()
            .and_then(|n| n.checked_mul(entry))
            .and_then(|n| n.checked_add(HEADER_BYTES));
        if expected != Some(body.len()) {
            return Err(format!(
                "the header counts {count} vectors and the file holds {} bytes of them: cut \
                 short or padded",
                body.len() - HEADER_BYTES
            ));
        }
        if Sha256::digest(body).as_slice() != checksum {
            return Err("its checksum does not match its content".into());
        }
        let mut vectors = Vectors::with_capacity(body.len() / entry);
        for (n, record) in body[HEADER_BYTES..].chunks_exact(entry).enumerate() {
            let (hash, values) = record.split_at(32);
            let v: Vec<f32> = values
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(array(b)))
                .collect();
            let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
            if !norm.is_finite() || (norm - 1.0).abs() > NORM_SLACK {
                return Err(format!("vector {n} is not of unit length (norm {norm})"));
            }
            vectors.insert(array(hash), v.into());
        }
        Ok(vectors)
    }

    /// Replaces the file with the vectors of `sets` (each text once), so that a reader finds the
    /// old file or the new one whole, never a mix (a crash that leaves a file cut short is
    /// caught by its checksum).
    pub(crate) fn write(&self, sets: &[&Vectors]) -> Result<(), FindError> {
        let refused = |reason: String| FindError::Store {
            path: self.path.clone(),
            reason,
        };
        let bytes = self.encode(sets);
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Unique per writer: two processes, or two indexes of one, writing at once must not
        // share a temporary file.
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let n = WRITES.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(&bytes))
            .and_then(|()| std::fs::rename(&tmp, &self.path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(refused(format!("cannot write it: {e}")));
        }
        Ok(())
    }

    fn encode(&self, sets: &[&Vectors]) -> Vec<u8> {
        let entries: std::collections::BTreeMap<&TextHash, &Arc<[f32]>> = sets
            .iter()
            .flat_map(|set| set.iter())
            .filter(|(_, v)| v.len() == self.dims)
            .collect();
        let mut bytes = Vec::with_capacity(
            HEADER_BYTES + entries.len() * (32 + 4 * self.dims) + CHECKSUM_BYTES,
        );
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&FORMAT.to_le_bytes());
        bytes.extend_from_slice(&(self.dims as u32).to_le_bytes());
        bytes.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&self.fingerprint);
        for (hash, v) in entries {
            bytes.extend_from_slice(hash);
            for x in v.iter() {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
        }
        let checksum = Sha256::digest(&bytes);
        bytes.extend_from_slice(&checksum);
        bytes
    }
}

/// Refuses what another user owns, or what group or others may write.
fn private(meta: &std::fs::Metadata) -> Result<(), String> {
    private_to(meta.uid(), meta.mode(), nix::unistd::geteuid().as_raw())
}

fn private_to(owner: u32, mode: u32, uid: u32) -> Result<(), String> {
    if owner != uid {
        return Err(format!(
            "owned by uid {owner}, not by this user (uid {uid})"
        ));
    }
    if mode & 0o022 != 0 {
        return Err(format!(
            "writable by group or others (mode {:o}); chmod go-w it",
            mode & 0o777
        ));
    }
    Ok(())
}

/// A fixed-size field from a slice of exactly its length.
fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(bytes);
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn only_the_owner_may_write() {
        assert!(private_to(1000, 0o100600, 1000).is_ok());
        assert!(private_to(1000, 0o40755, 1000).is_ok());
        let e = private_to(65534, 0o100600, 0).unwrap_err();
        assert!(
            e.contains("owned by uid 65534") && e.contains("uid 0"),
            "{e}"
        );
        for mode in [0o100620, 0o100602, 0o40777] {
            let e = private_to(0, mode, 0).unwrap_err();
            assert!(e.contains("writable by group or others"), "{mode:o}: {e}");
        }
    }

    /// The fuzz target's seed (`fuzz/seeds/vector_store`): a good file of two vectors.
    #[test]
    fn a_file_of_two_vectors_is_taken_and_its_checksum_checked() {
        let seed = include_bytes!("../../../fuzz/seeds/vector_store/two_vectors_with_checksum");
        assert_eq!(VectorStore::check_file(seed, [0; 32], 4), Ok(2));
        let e = VectorStore::check_file(seed, [1; 32], 4).unwrap_err();
        assert!(e.contains("another model"), "{e}");
        let mut bad = seed.to_vec();
        bad[HEADER_BYTES + 40] ^= 1;
        let e = VectorStore::check_file(&bad, [0; 32], 4).unwrap_err();
        assert!(e.contains("checksum"), "{e}");
    }

    fn vectors(n: usize, dims: usize, seed: u8) -> Vectors {
        (0..n)
            .map(|i| {
                let mut hash = [seed; 32];
                hash[..8].copy_from_slice(&(i as u64).to_le_bytes());
                let mut v = vec![0.0f32; dims];
                v[i % dims] = 1.0;
                (hash, Arc::from(v))
            })
            .collect()
    }

    /// Writers replacing the file while a reader reads it: every read finds one writer's set
    /// whole (never a mix, never a half-written file), and no temporary file is left.
    #[test]
    fn readers_see_one_whole_file_while_writers_replace_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = VectorStore {
            path: dir.path().join("test.vectors"),
            fingerprint: [7; 32],
            dims: 64,
        };
        let sets: Vec<Vectors> = (0..4).map(|w| vectors(100 + 50 * w, 64, w as u8)).collect();
        store.write(&[&sets[0]]).unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        let reads = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut reads = 0;
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    let read = store.read().unwrap();
                    assert!(sets.contains(&read), "a read found {} vectors", read.len());
                    reads += 1;
                }
                reads
            });
            let writers: Vec<_> = sets
                .iter()
                .map(|set| {
                    let store = &store;
                    s.spawn(move || {
                        for _ in 0..50 {
                            store.write(&[set]).unwrap();
                        }
                    })
                })
                .collect();
            for w in writers {
                w.join().unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::Release);
            reader.join().unwrap()
        });
        assert!(reads > 0);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["test.vectors"]);
    }
}
