//! The vectors kept between runs ([`VectorStore`]): a second index embeds nothing it finds
//! there and ranks exactly as the first, and every file it should not trust (damaged, edited
//! with a fresh checksum, another model's, writable by others, a symbolic link) is ignored with
//! a reason, then replaced, and never written through.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use sha2::{Digest, Sha256};
use toolsrv_find::{Doc, Encoder, Index, Updated, VectorStore};

/// The small encoder, loaded once for the whole binary.
fn encoder() -> Arc<Encoder> {
    static ENCODER: OnceLock<Arc<Encoder>> = OnceLock::new();
    ENCODER
        .get_or_init(|| Arc::new(Encoder::load(&common::model_dir()).unwrap()))
        .clone()
}

/// A dozen tools of the evaluation catalog: enough texts to rank, quick to embed.
fn docs() -> Vec<(String, Doc)> {
    common::catalog().into_iter().take(12).collect()
}

/// Texts the encoder sees for `docs`: a summary per tool and each distinct keyword phrase.
fn texts(docs: &[(String, Doc)]) -> usize {
    let mut all = std::collections::HashSet::new();
    for (_, d) in docs {
        all.insert(format!("summary of {}", d.name));
        all.extend(d.keywords.iter().filter(|k| !k.trim().is_empty()).cloned());
    }
    all.len()
}

fn index_in(dir: &Path) -> Index<String> {
    let store = VectorStore::open(dir, &encoder()).unwrap();
    Index::new(Some(encoder())).with_store(store)
}

fn store_file(dir: &Path) -> std::path::PathBuf {
    VectorStore::open(dir, &encoder())
        .unwrap()
        .path()
        .to_path_buf()
}

const REQUESTS: [&str; 3] = [
    "is the disk nearly full",
    "unpack the bundle someone sent me",
    "what is eating the cpu",
];

/// Names and scores of each request's hits.
fn rankings(index: &Index<String>) -> Vec<Vec<(String, f32)>> {
    REQUESTS
        .iter()
        .map(|q| {
            index
                .search(q, 5, |_| true)
                .unwrap()
                .into_iter()
                .map(|h| (h.key, h.score))
                .collect()
        })
        .collect()
}

#[test]
fn kept_vectors_spare_the_encoder_and_rank_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("made/on/demand");
    let docs = docs();
    let all = texts(&docs);

    let first = index_in(&store_dir);
    let updated = first.update(docs.clone()).unwrap();
    assert_eq!(
        (updated.embedded, updated.stored, updated.store_problem),
        (all, 0, None)
    );
    let file = store_file(&store_dir);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&store_dir), 0o700);
    assert_eq!(mode(&file), 0o600);

    // A new index (a restarted process) embeds nothing and ranks exactly as the first.
    let second = index_in(&store_dir);
    let updated = second.update(docs.clone()).unwrap();
    assert_eq!(
        (updated.embedded, updated.stored, updated.store_problem),
        (0, all, None)
    );
    let ranked = rankings(&first);
    assert!(ranked.iter().all(|r| !r.is_empty()), "{ranked:?}");
    assert_eq!(rankings(&second), ranked);
    let without = Index::new(Some(encoder()));
    without.update(docs.clone()).unwrap();
    assert_eq!(rankings(&without), ranked);

    // One tool edited: only its summary is embedded, and the file then holds it too.
    let mut edited = docs.clone();
    edited[0]
        .1
        .description
        .push_str(" Also reports the mount's options.");
    let updated = second.update(edited.clone()).unwrap();
    assert_eq!((updated.embedded, updated.stored), (1, 0), "{updated:?}");
    let third = index_in(&store_dir);
    let updated = third.update(edited).unwrap();
    assert_eq!((updated.embedded, updated.stored), (0, all), "{updated:?}");
}

/// After a start, views reach a coordinator over some seconds: its first updates hold none or
/// part of the catalog. The kept vectors wait for the rest, are written back with whatever is
/// embedded meanwhile, and are let go once an update with tools needs none of them.
#[test]
fn kept_vectors_wait_for_the_tools_still_to_come() {
    let dir = tempfile::tempdir().unwrap();
    let docs = docs();
    index_in(dir.path()).update(docs.clone()).unwrap();
    let (first, rest) = docs.split_at(6);
    let mut new = common::catalog()[30].clone();
    new.1.description = "A tool the kept file has never seen".into();

    let index = index_in(dir.path());
    let updated = index.update(Vec::new()).unwrap();
    assert_eq!((updated.embedded, updated.stored), (0, 0), "{updated:?}");
    // Half the tools and a new one: only the new one is embedded, and the file written then
    // keeps the other half's vectors.
    let mut half = first.to_vec();
    half.push(new.clone());
    let updated = index.update(half).unwrap();
    assert_eq!(
        (updated.embedded, updated.stored),
        (texts(std::slice::from_ref(&new)), texts(first)),
        "{updated:?}"
    );
    let mut all = docs.clone();
    all.push(new.clone());
    let updated = index.update(all.clone()).unwrap();
    assert_eq!(
        (updated.embedded, updated.stored),
        (0, texts(rest)),
        "{updated:?}"
    );
    let updated = index_in(dir.path()).update(all.clone()).unwrap();
    assert_eq!(
        (updated.embedded, updated.stored),
        (0, texts(&all)),
        "the file holds every tool: {updated:?}"
    );

    // An update with tools that takes nothing kept lets the rest go.
    let index = index_in(dir.path());
    let others = common::catalog()[40..44].to_vec();
    let updated = index.update(others).unwrap();
    assert_eq!(updated.stored, 0, "{updated:?}");
    let updated = index.update(docs.clone()).unwrap();
    assert_eq!(
        (updated.embedded, updated.stored),
        (texts(&docs), 0),
        "{updated:?}"
    );
}

/// The file's parts, and a way to put it back together with a checksum that matches.
const HEADER: usize = 16 + 4 + 4 + 8 + 32;

fn with_checksum(mut body: Vec<u8>) -> Vec<u8> {
    let sum = Sha256::digest(&body);
    body.extend_from_slice(&sum);
    body
}

/// The body (all but the checksum) of a good file.
fn good_body(dir: &Path) -> Vec<u8> {
    let bytes = std::fs::read(store_file(dir)).unwrap();
    bytes[..bytes.len() - 32].to_vec()
}

fn first_value_at() -> usize {
    HEADER + 32
}

/// Each damaged file is ignored, naming the file and what is wrong; everything is embedded
/// again, and the file is replaced by a good one.
#[test]
fn a_damaged_or_edited_store_is_ignored_and_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let docs = docs();
    let all = texts(&docs);
    index_in(dir.path()).update(docs.clone()).unwrap();
    let good = std::fs::read(store_file(dir.path())).unwrap();
    let body = good_body(dir.path());
    let dims = encoder().dims();

    let set = |body: &mut Vec<u8>, at: usize, value: &[u8]| {
        body[at..at + value.len()].copy_from_slice(value);
    };
    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x40;
    cases.push(("a flipped bit", flipped, "checksum does not match"));
    cases.push((
        "cut short",
        good[..good.len() - 100].to_vec(),
        "cut short or padded",
    ));
    cases.push(("empty", Vec::new(), "shorter than a header"));
    cases.push((
        "another kind of file",
        b"{\"not\": \"vectors\"}".repeat(10),
        "not a vector store",
    ));
    // Edited, with a checksum that matches: each field is checked for itself.
    let mut format = body.clone();
    set(&mut format, 16, &2u32.to_le_bytes());
    cases.push(("a later format", with_checksum(format), "format 2"));
    let mut dims_field = body.clone();
    set(&mut dims_field, 20, &(dims as u32 * 2).to_le_bytes());
    cases.push((
        "other dimensions",
        with_checksum(dims_field),
        "vectors of 768 values",
    ));
    let mut count = body.clone();
    set(&mut count, 24, &u64::MAX.to_le_bytes());
    cases.push((
        "a count far over the file",
        with_checksum(count),
        "cut short or padded",
    ));
    let mut model = body.clone();
    model[32] ^= 1;
    cases.push((
        "another model's",
        with_checksum(model),
        "written for another model",
    ));
    let mut nan = body.clone();
    set(&mut nan, first_value_at(), &f32::NAN.to_le_bytes());
    cases.push(("a NaN", with_checksum(nan), "not of unit length (norm NaN)"));
    let mut long = body.clone();
    set(&mut long, first_value_at(), &3.0f32.to_le_bytes());
    cases.push((
        "a vector that is not unit length",
        with_checksum(long),
        "vector 0 is not of unit length",
    ));

    let path = store_file(dir.path());
    for (what, bytes, reason) in cases {
        std::fs::write(&path, &bytes).unwrap();
        let index = index_in(dir.path());
        let updated = index.update(docs.clone()).unwrap();
        let problem = updated.store_problem.clone().unwrap_or_default();
        assert!(
            problem.contains(reason) && problem.contains(&path.display().to_string()),
            "{what}: {problem:?}"
        );
        assert_eq!((updated.embedded, updated.stored), (all, 0), "{what}");
        assert!(!index.search(REQUESTS[0], 3, |_| true).unwrap().is_empty());
        // Replaced by a good file, which the next index takes whole.
        let updated = index_in(dir.path()).update(docs.clone()).unwrap();
        assert_eq!(
            (updated.embedded, updated.stored, updated.store_problem),
            (0, all, None),
            "{what}"
        );
    }
}

/// An index over `store_dir` that finds its file refused for `reason`, and embeds every text.
fn refused_then_embedded(store_dir: &Path, docs: &[(String, Doc)], reason: &str) {
    let updated = index_in(store_dir).update(docs.to_vec()).unwrap();
    let problem = updated.store_problem.as_deref().unwrap_or_default();
    assert!(problem.contains(reason), "{updated:?}");
    assert_eq!(updated.embedded, texts(docs), "{updated:?}");
}

/// Whoever can write the store chooses the vectors, and with them which tool a request finds.
#[test]
fn a_store_others_can_write_is_not_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let docs = docs();
    // A directory group or others may write is refused outright.
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = VectorStore::open(&open, &encoder())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("writable by group or others (mode 777)") && e.contains("open"),
        "{e}"
    );
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    let e = VectorStore::open(&file, &encoder())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cannot create it") || e.contains("not a directory"),
        "{e}"
    );

    // A file others may write is read by nobody, and replaced by a private one.
    let store_dir = dir.path().join("store");
    index_in(&store_dir).update(docs.clone()).unwrap();
    let path = store_file(&store_dir);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    refused_then_embedded(&store_dir, &docs, "writable by group or others (mode 666)");
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // A symbolic link in its place is not followed, neither to read nor to write: the file it
    // points to (here a good store someone left elsewhere) stays as it was.
    let elsewhere = dir.path().join("elsewhere.vectors");
    std::fs::rename(&path, &elsewhere).unwrap();
    let before = std::fs::read(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
    refused_then_embedded(&store_dir, &docs, "a symbolic link; not followed");
    assert_eq!(std::fs::read(&elsewhere).unwrap(), before);
    assert!(
        std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_file(),
        "the link was replaced by a file"
    );
}

/// Two processes keeping their vectors in one directory at once (two `toolctl local find`, say)
/// leave a file one of them wrote whole, never a mix.
#[test]
fn writers_at_once_leave_one_whole_file() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = common::catalog();
    let halves = [catalog[..20].to_vec(), catalog[20..40].to_vec()];
    std::thread::scope(|s| {
        for half in &halves {
            let dir = dir.path();
            s.spawn(move || {
                for _ in 0..3 {
                    let index = index_in(dir);
                    let updated: Updated = index.update(half.clone()).unwrap();
                    assert_eq!(updated.store_problem, None);
                }
            });
        }
    });
    let updated = index_in(dir.path()).update(catalog.clone()).unwrap();
    assert_eq!(updated.store_problem, None);
    let one_half = halves.iter().any(|h| texts(h) == updated.stored);
    assert!(one_half, "{updated:?}");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Without an encoder there are no vectors: the store is neither read nor written.
#[test]
fn without_an_encoder_nothing_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let store = VectorStore::open(dir.path(), &encoder()).unwrap();
    let path = store.path().to_path_buf();
    let index = Index::new(None).with_store(store);
    let updated = index.update(docs()).unwrap();
    assert_eq!((updated.embedded, updated.stored), (0, 0));
    assert!(!path.exists());
}

/// A caller bounds what documents from untrusted sources cost the encoder: `admit` is asked
/// with each document's count of texts without a vector, and a document it refuses is left out
/// unembedded, to be taken by a later update; a document whose texts all have vectors costs
/// nothing and is never asked about.
#[test]
fn a_refused_document_is_left_out_unembedded_and_taken_later() {
    let docs = docs();
    let index = Index::new(Some(encoder()));
    let refused = docs[3].0.clone();
    let mut asked = Vec::new();
    let updated = index
        .update_admitting(docs.clone(), |key, new| {
            asked.push((key.clone(), new));
            *key != refused
        })
        .unwrap();
    assert_eq!(asked.len(), docs.len(), "every document is new: {asked:?}");
    assert!(asked.iter().all(|(_, new)| *new >= 1), "{asked:?}");
    let refused_texts = asked.iter().find(|(k, _)| *k == refused).unwrap().1;
    assert_eq!(updated.deferred, 1);
    assert_eq!(updated.docs, docs.len() - 1);
    assert_eq!(updated.embedded, texts(&docs) - refused_texts);
    assert_eq!(index.len(), docs.len() - 1);
    // Left out of both rankers: not found by its own name.
    let by_name = docs[3].1.name.replace('_', " ");
    assert!(
        index
            .search(&by_name, 20, |_| true)
            .unwrap()
            .iter()
            .all(|h| h.key != refused),
        "a refused document was ranked"
    );

    // The next update asks about the refused document only, and takes it.
    let mut asked = Vec::new();
    let updated = index
        .update_admitting(docs.clone(), |key, new| {
            asked.push((key.clone(), new));
            true
        })
        .unwrap();
    assert_eq!(asked, vec![(refused.clone(), refused_texts)]);
    assert_eq!((updated.deferred, updated.docs), (0, docs.len()));
    assert_eq!(updated.embedded, refused_texts);
    let hits = index.search(&by_name, 3, |_| true).unwrap();
    assert_eq!(hits.first().map(|h| &h.key), Some(&refused), "{hits:?}");
}
